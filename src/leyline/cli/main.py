"""``leyline``: one command line for every layer; each subcommand imports its layer lazily."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version

from . import (
    conformance_command,
    demo_command,
    eval_command,
    schema_command,
    serve_command,
)


def _package_version() -> str:
    try:
        return version("leyline")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="leyline",
        description="Leyline: KV-cache directives (splice, forget, erratum) for agentic inference.",
    )
    parser.add_argument("--version", action="version", version=f"leyline {_package_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    serve_command.register(commands)
    demo_command.register(commands)
    schema_command.register(commands)
    conformance_command.register(commands)
    eval_command.register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
