"""``leyline eval debug-gym``: the harness, run in the debug-gym venv from the main CLI.

debug-gym needs Python >= 3.12 and its own pins, so the harness lives in ``.venv-debuggym``
(``bash scripts/debug_gym/setup_env.sh``). This launcher takes the harness's own options,
passes them on to that interpreter, and adds two modes: ``--fast`` (the scripted self-check
on two tasks, no server) and ``--smoke`` (a short run against an embedded ``leyline serve``
with SmolLM2: proves the wiring; a 135M model solves next to nothing, and says so).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from . import cli as harness

HELP = "debug-gym mini_nightmare solve rates: no policy vs policy via re-prefill vs splice"

DESCRIPTION = (
    harness.DESCRIPTION
    + """

Runs `python -m leyline.evals.debug_gym` in the debug-gym venv (built by `bash
scripts/debug_gym/setup_env.sh`; override with --python or $LEYLINE_DEBUGGYM_PYTHON). Point it
at a server with --base-url (the paper's setting: a GPU server with a real model), or use
--smoke for a short run against an embedded `leyline serve` with SmolLM2 on CPU, or --fast
for the scripted self-check. Every other option goes to the harness unchanged.
"""
)

REPO = Path(__file__).resolve().parents[4]  # src/leyline/evals/debug_gym/launcher.py
DEFAULT_PYTHON = REPO / ".venv-debuggym" / "bin" / "python"

FAST = ["--scripted", "--tasks", "purr,shopping_cart", "--runs", "1"]
# SmolLM2 has an 8k context and rarely emits a well-formed tool call: few tools, short runs.
SMOKE = ["--tasks", "purr,shopping_cart", "--runs", "1", "--max-steps", "6"]
SMOKE += ["--max-tokens", "128", "--context-limit", "6", "--tools", "view,edit,eval,submit"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    harness.add_arguments(parser)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--fast",
        action="store_true",
        help="CI mode: the scripted self-check on purr and shopping_cart, one run, no server",
    )
    mode.add_argument(
        "--smoke",
        action="store_true",
        help="start an embedded `leyline serve` (SmolLM2, CPU) and run purr and shopping_cart "
        "once per arm with at most 6 steps against it",
    )
    parser.add_argument(
        "--python",
        type=Path,
        default=Path(os.environ.get("LEYLINE_DEBUGGYM_PYTHON", DEFAULT_PYTHON)),
        help="the debug-gym venv's interpreter (default: $LEYLINE_DEBUGGYM_PYTHON or "
        ".venv-debuggym/bin/python in the repository)",
    )


def harness_argv(args: argparse.Namespace) -> list[str]:
    """The harness options the user set (those that differ from their defaults), as argv."""
    argv: list[str] = []
    for action in harness.build_parser()._actions:
        if not action.option_strings or action.dest == "help":
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        flag = action.option_strings[-1]
        argv += [flag] if isinstance(action, argparse._StoreTrueAction) else [flag, str(value)]
    return argv


def run(args: argparse.Namespace) -> int:
    argv = harness_argv(args)
    if args.fast:
        argv = FAST + argv
    if args.smoke:
        return _smoke(args, SMOKE + argv)
    return _launch(args.python, argv)


def in_debug_gym_venv() -> bool:
    return importlib.util.find_spec("debug_gym") is not None


def _launch(python: Path, argv: list[str]) -> int:
    if in_debug_gym_venv():
        return harness.main(argv)
    if not python.exists():
        print(
            f"leyline eval debug-gym: no debug-gym interpreter at {python}.\n"
            "Build it once with `bash scripts/debug_gym/setup_env.sh` (Python 3.12, ~2-3 min), "
            "or pass --python.",
            file=sys.stderr,
        )
        return 2
    return subprocess.call([str(python), "-m", "leyline.evals.debug_gym", *argv])


def _smoke(args: argparse.Namespace, argv: list[str]) -> int:
    from leyline.evals.demo.server import EmbeddedServer

    # `leyline serve`'s defaults, shared prefix cache included: the plain arms reuse prefixes.
    with EmbeddedServer("smollm2", max_new_tokens=128, prefix_cache_bytes=1024**3) as server:
        print(f"smoke run: embedded leyline serve ({server.label}) at {server.base_url}")
        return _launch(args.python, ["--base-url", server.base_url, *argv])
