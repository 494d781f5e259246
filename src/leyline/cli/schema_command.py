"""``leyline schema``: print, write or check the protocol's JSON Schema."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def register(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "schema",
        help="print the protocol's JSON Schema",
        description="Print the JSON Schema generated from the protocol models.",
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--write",
        action="store_true",
        help="write it to the checked-in file (leyline/protocol/schemas/leyline.v1.schema.json)",
    )
    group.add_argument(
        "--check",
        action="store_true",
        help="exit 1 if the checked-in file differs from the models",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from leyline.protocol.schema import SCHEMA_PATH, checked_in_schema, render_schema

    rendered = render_schema()
    if args.write:
        SCHEMA_PATH.write_text(rendered, encoding="utf-8")
        print(f"wrote {SCHEMA_PATH}", file=sys.stderr)
    elif args.check:
        if checked_in_schema() != rendered:
            print(f"{SCHEMA_PATH} is stale: run `leyline schema --write`", file=sys.stderr)
            return 1
        print("schema up to date", file=sys.stderr)
    else:
        sys.stdout.write(rendered)
    return 0
