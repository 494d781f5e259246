"""``leyline eval robustness``: the command line (nothing heavy imported here)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..common.cli import add_run_options, from_args

HELP = (
    "fuzz every route, lost updates, FORGET leaks, cross-tenant, cross-session and cross-salt "
    "reuse, /health under load"
)

DESCRIPTION = """\
Starts `leyline serve` (SmolLM2, CPU) with two tenants, or checks any live Leyline backend
at --base-url (leyline serve, SGLang with Leyline's plugin: the checks its capabilities
allow; the others are reported n/a), for what the server promises under hostile or
concurrent use:

  fuzz          near-valid and garbage requests to every route: no 5xx, every error is
                the protocol's body, a rejected request changes and creates no session,
                the keep-alive connection survives
  lost updates  clients append to shared sessions with base_revision (some stale): no
                accepted write is overwritten
  redaction     a secret is cached, then FORGET; a probe session must reuse nothing past
                the secret's start (several ways the blocks could survive)
  cross-tenant  tenant B sends tenant A's prompt: it must reuse 0 tokens (two keys and
                capabilities.tenants)
  cross-session session P splices a tool output; a plain request and a FORGET in another
                session must give the exact prefill's next-token top-20 log-probs
                (|delta| <= 1e-3; exact: transformers fp32 on --model-dir, else the
                server's own prefill in a fresh session)
  cross-salt    a session under cache_salt X caches a prompt; salt Y, no salt and a plain
                request must reuse 0 tokens (capabilities.cache_salt)
  /health       latency while a 1,600-message chat renders (p99 < 100 ms; where the
                server has /health)

Sizes: --fast (CI) 400 requests, 4 clients x 6 turns, 1 trial, 2 long chats, 2
cross-session scenarios and cross-salt trials; the default 2,000 requests, 8 x 20, 3
trials, 3 long chats, 6 scenarios; --full the issue's 10,000 requests, 16 x 60, 5 trials,
5 long chats, 12 scenarios. Exit status 1 when a target is not met (n/a is neither).

  leyline eval robustness --base-url http://127.0.0.1:30000 --model-dir DIR --fast
"""

SIZES = {
    "fast": {"requests": 400, "clients": 4, "turns": 6, "trials": 1, "renders": 2, "scenarios": 2},
    "default": {
        "requests": 2000, "clients": 8, "turns": 20, "trials": 3, "renders": 3, "scenarios": 6,
    },
    "full": {
        "requests": 10_000, "clients": 16, "turns": 60, "trials": 5, "renders": 5, "scenarios": 12,
    },
}  # fmt: skip
CHECKS = (
    "fuzz", "lost_updates", "redaction", "cross_tenant", "cross_session", "cross_salt", "health",
)  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for name, what in (
        ("requests", "fuzzed requests"),
        ("clients", "concurrent clients of the lost-update check"),
        ("turns", "writes per client"),
        ("trials", "redaction and cross-tenant trials"),
        ("renders", "long chats sent while /health is polled"),
        ("scenarios", "cross-session scenarios and cross-salt trials"),
    ):
        parser.add_argument(f"--{name}", type=_positive, help=f"{what} (overrides the mode)")
    parser.add_argument(
        "--messages", type=_positive, default=1600, help="messages of the long chat (%(default)s)"
    )
    parser.add_argument(
        "--prompt-tokens",
        type=_positive,
        default=300,
        help="about how long a cross-session prompt is (%(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0, help="fuzz seed (default: %(default)s)")
    parser.add_argument("--model", default="smollm2", help="what `leyline serve --model` takes")
    parser.add_argument(
        "--base-url",
        metavar="URL",
        help="check this live server (its root, e.g. http://127.0.0.1:30000) instead of "
        "starting leyline serve",
    )
    parser.add_argument("--api-key", metavar="KEY", help="the key to send at --base-url")
    parser.add_argument(
        "--api-key-b",
        metavar="KEY",
        help="a second tenant's key at --base-url (cross-tenant runs only with it)",
    )
    parser.add_argument(
        "--model-dir",
        type=Path,
        metavar="DIR",
        help="a HF directory of the served model: cross-session's exact reference "
        "(transformers, fp32); e.g. `python -m leyline.sglang.live_models "
        "smollm2`. Without it: the server's own prefill (weaker)",
    )
    parser.add_argument(
        "--checks",
        type=_checks,
        default=(),
        metavar="NAMES",
        help=f"only these checks, comma-separated ({', '.join(CHECKS)}); the others are n/a",
    )
    add_run_options(
        parser,
        out="results folder (default: results/robustness-<UTC time>)",
        full="the issue's sizes (see above)",
        fast="CI mode (see above)",
        progress="no progress bars",
    )


def run(args: argparse.Namespace) -> int:
    from .report import met
    from .run import Options, run_robustness

    if args.base_url is None and (args.api_key or args.api_key_b):
        raise SystemExit("--api-key and --api-key-b go with --base-url")
    mode = "fast" if args.fast else "full" if args.full else "default"
    sizes = {k: getattr(args, k) or v for k, v in SIZES[mode].items()}
    options = from_args(Options, args, mode=mode, progress=not args.no_progress, **sizes)
    data = run_robustness(options)
    return 0 if met(data) else 1


def _checks(text: str) -> tuple[str, ...]:
    names = tuple(n.strip().replace("-", "_") for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in CHECKS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"expected some of {', '.join(CHECKS)}, got {text!r}")
    return names


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value
