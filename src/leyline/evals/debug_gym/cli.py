"""``python -m leyline.evals.debug_gym``: the policy leg on mini_nightmare, one command.

Runs inside the debug-gym venv (``bash scripts/debug_gym/setup_env.sh``). Nothing of
debug_gym is imported before HOME points at a throwaway folder.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

from ..common.cli import from_args
from .config import (
    ARM_NAMES,
    DEFAULT_MAX_STEPS,
    DEFAULT_POLICY,
    DEFAULT_RUN_TIMEOUT,
    DEFAULT_TOOLS,
    TASK_NAMES,
    RunConfig,
    make_arms,
)
from .sandbox import isolate

DESCRIPTION = (
    "debug-gym mini_nightmare with and without a context policy: solve rate "
    "(Wilson 95% CI), steps and tokens per episode, per arm and per task."
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m leyline.evals.debug_gym", description=DESCRIPTION)
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The harness's options (also offered by ``leyline eval debug-gym``, which passes them on)."""
    a = p.add_argument
    a(
        "--base-url",
        default=os.environ.get("LEYLINE_BASE_URL", "http://127.0.0.1:8000/v1"),
        help="OpenAI-compatible endpoint (default: $LEYLINE_BASE_URL or %(default)s)",
    )
    a("--model", default=None, help="model name (default: the first one of /v1/models)")
    a(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY", "EMPTY"),
        help="API key (default: $OPENAI_API_KEY or EMPTY)",
    )
    a("--tasks", default="all", help=f"comma-separated, or 'all': {', '.join(TASK_NAMES)}")
    a("--runs", type=int, default=3, help="episodes per task and arm (default %(default)s)")
    a(
        "--arms",
        default=",".join(ARM_NAMES),
        help="comma-separated subset of none,reprefill,splice (default: all three)",
    )
    a(
        "--policy",
        default=DEFAULT_POLICY,
        help="leyline.policies config of the policy arms (default %(default)s)",
    )
    a(
        "--max-steps",
        type=int,
        default=DEFAULT_MAX_STEPS,
        help="debug-gym's max_steps (default %(default)s, as upstream)",
    )
    a(
        "--out",
        type=Path,
        default=None,
        help="report folder (default: results/debug_gym/<UTC time>)",
    )
    a("--tools", default=",".join(DEFAULT_TOOLS), help="debug-gym tools (default %(default)s)")
    a("--temperature", type=float, default=None, help="sampling temperature (server default)")
    a("--max-tokens", type=int, default=1024, help="per reply (default %(default)s)")
    a(
        "--context-limit",
        type=int,
        default=128,
        help="thousands of tokens before debug-gym trims the prompt (default %(default)s)",
    )
    a(
        "--run-timeout",
        type=int,
        default=DEFAULT_RUN_TIMEOUT,
        help="seconds per test run (default %(default)s)",
    )
    a("--max-retries", type=int, default=3, help="retries of a failed request (default 3)")
    a("--jobs", type=int, default=1, help="episodes in parallel (default %(default)s)")
    a(
        "--data",
        type=Path,
        default=None,
        help="completed mini_nightmare copy (default: $LEYLINE_MINI_NIGHTMARE or "
        "<venv>/mini_nightmare)",
    )
    a(
        "--scripted",
        action="store_true",
        help="no server, no model: a SCRIPTED stand-in drives the agent (harness self-check)",
    )
    a("--no-progress", action="store_true", help="no progress bar")


def config_from_args(args: argparse.Namespace) -> RunConfig:
    tasks = TASK_NAMES if args.tasks == "all" else tuple(_split(args.tasks))
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    out = args.out or Path("results/debug_gym") / (stamp + ("-scripted" if args.scripted else ""))
    return from_args(
        RunConfig,
        args,
        tasks=tasks,
        arms=make_arms(_split(args.arms), args.policy),
        tools=tuple(_split(args.tools)),
        out=out,
        data_dir=args.data,
        context_limit_k=args.context_limit,
        progress=not args.no_progress,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    with tempfile.TemporaryDirectory(prefix="leyline-debuggym-home-") as home:
        isolate(Path(home))
        import httpx

        from .runner import run_benchmark  # imports debug_gym: after isolate()

        try:
            run = run_benchmark(config)
        except httpx.HTTPError as exc:
            print(f"error: cannot reach {config.base_url}: {exc}", file=sys.stderr)
            return 2
        except (FileNotFoundError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    print(run.files.markdown.read_text(encoding="utf-8"))
    written = [run.files.json, run.files.markdown, run.files.plot]
    print("written: " + ", ".join(str(p) for p in written if p is not None))
    return 0


def _split(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]
