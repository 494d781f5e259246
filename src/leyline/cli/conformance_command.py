"""``leyline conformance URL``: run the protocol's conformance suite against a server."""

from __future__ import annotations

import argparse
from typing import Any


def register(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "conformance",
        help="check that a server at URL implements the Leyline protocol",
        description="Run the protocol conformance suite (sessions, splice, forget, erratum, "
        "batches, conflicts, typed rejections) against a running server. Exit 1 on failure.",
    )
    parser.add_argument("base_url", help="server root, e.g. http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from leyline.protocol.conformance import run_conformance

    results = run_conformance(args.base_url, api_key=args.api_key)
    width = max(len(r.name) for r in results)
    for result in results:
        mark = "PASS" if result.passed else "FAIL"
        line = f"{mark}  {result.name:<{width}}"
        print(line + (f"  {result.detail}" if result.detail else ""))
    failed = sum(not r.passed for r in results)
    print(f"{len(results) - failed} passed, {failed} failed")
    return 1 if failed else 0
