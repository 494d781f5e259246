"""``leyline eval robustness``: the command line (nothing heavy imported here)."""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = "fuzz every route, lost updates, FORGET leaks, cross-tenant reuse, /health under load"

DESCRIPTION = """\
Starts `leyline serve` (SmolLM2, CPU) with two tenants and checks what the server promises
under hostile or concurrent use:

  fuzz          near-valid and garbage requests to every route: no 5xx, every error is
                the protocol's body, a rejected request changes and creates no session,
                the keep-alive connection survives
  lost updates  clients append to shared sessions with base_revision (some stale): no
                accepted write is overwritten
  redaction     a secret is cached, then FORGET; a probe session must reuse nothing past
                the secret's start (several ways the blocks could survive)
  cross-tenant  tenant B sends tenant A's prompt: it must reuse 0 tokens
  /health       latency while a 1,600-message chat renders (p99 < 100 ms)

Sizes: --fast (CI) 400 requests, 4 clients x 6 turns, 1 trial, 2 long chats; the
default 2,000 requests, 8 x 20, 3 trials, 3 long chats; --full the issue's 10,000
requests, 16 x 60, 5 trials, 5 long chats. Exit status 1 when a target is not met.
"""

SIZES = {
    "fast": {"requests": 400, "clients": 4, "turns": 6, "trials": 1, "renders": 2},
    "default": {"requests": 2000, "clients": 8, "turns": 20, "trials": 3, "renders": 3},
    "full": {"requests": 10_000, "clients": 16, "turns": 60, "trials": 5, "renders": 5},
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--fast", action="store_true", help="CI mode (see above)")
    sizes.add_argument("--full", action="store_true", help="the issue's sizes (see above)")
    for name, what in (
        ("requests", "fuzzed requests"),
        ("clients", "concurrent clients of the lost-update check"),
        ("turns", "writes per client"),
        ("trials", "redaction and cross-tenant trials"),
        ("renders", "long chats sent while /health is polled"),
    ):
        parser.add_argument(f"--{name}", type=_positive, help=f"{what} (overrides the mode)")
    parser.add_argument(
        "--messages", type=_positive, default=1600, help="messages of the long chat (%(default)s)"
    )
    parser.add_argument("--seed", type=int, default=0, help="fuzz seed (default: %(default)s)")
    parser.add_argument("--model", default="smollm2", help="what `leyline serve --model` takes")
    parser.add_argument(
        "--out", type=Path, help="results folder (default: results/robustness-<UTC time>)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    from .run import Options, run_robustness

    mode = "fast" if args.fast else "full" if args.full else "default"
    sizes = {k: getattr(args, k) or v for k, v in SIZES[mode].items()}
    options = Options(
        mode=mode,
        messages=args.messages,
        seed=args.seed,
        model=args.model,
        out=args.out,
        progress=not args.no_progress,
        **sizes,
    )
    data = run_robustness(options)
    met = all(t["met"] for t in data["targets"] if not t["check"].startswith("size"))
    return 0 if met else 1


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value
