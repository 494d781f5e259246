"""``leyline eval pressure``: arguments and entry point (torch is imported only in ``run``)."""

from __future__ import annotations

import argparse
import sys

from ..common.cli import add_run_options, from_args

HELP = "agents under a tight cache budget: whole sessions evicted vs DECAY spans dropped"

DESCRIPTION = """\
Several agents share one reference server whose KV budget (--budget, a fraction of what
their sessions hold at the end without a budget) cannot keep them all. They replay seeded
debugging trajectories round-robin, one chat turn each in turn, so the sessions compete
for the cache. Three arms, each on a fresh server:
  unbounded  no budget: the reference (first-token answers, cost);
  evict      the budget, plain requests: past it the server evicts whole idle sessions,
             and an evicted agent's next turn re-prefills its whole conversation;
  decay      the budget, and every turn marks the previous tool output `decay` (priority:
             its turn, so older outputs go first; a stub replaces it): past the budget the
             server drops those spans instead. The client learns of a drop from a 409 on
             its next turn (the session's `dropped`), puts the stub in its transcript and
             resends: no re-prefill.
Reports per arm: prompt and prefilled tokens, re-prefilled tokens (prefilled beyond each
turn's new messages), sessions evicted, spans dropped, 409 retries, latency per turn
(median, p90) and first-token agreement with the unbounded arm. Writes report.json,
report.md and prefilled.png to --out (default results/pressure-<UTC time>).
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--agents", type=int, help="concurrent agents (default 4; --fast 3)")
    parser.add_argument("--turns", type=int, help="tool turns per agent (default 8; --fast 4)")
    parser.add_argument(
        "--budget",
        type=float,
        default=0.6,
        help="the cache budget as a fraction of the bytes all sessions hold at the end of the "
        "unbounded arm (default %(default)s)",
    )
    parser.add_argument(
        "--mode",
        choices=("amortize", "forget"),
        default="amortize",
        help="how a decay span is dropped (default %(default)s: downstream KV kept)",
    )
    add_run_options(
        parser,
        seed="trajectory seed (default 0)",
        threads=True,
        fast="the CI mode: 3 agents, 4 turns",
        progress="no progress bars",
    )


def run(args: argparse.Namespace) -> int:
    if not 0.0 < args.budget < 1.0:
        print("--budget is a fraction in (0, 1)", file=sys.stderr)
        return 2
    from .run import Config, run_pressure

    config = from_args(
        Config,
        args,
        agents=args.agents or (3 if args.fast else 4),
        turns=args.turns or (4 if args.fast else 8),
        progress=not args.no_progress,
    )
    if config.agents < 2 or config.turns < 2:
        print("--agents and --turns must be at least 2", file=sys.stderr)
        return 2
    out = run_pressure(config, args.out)
    print(f"wrote {out}/report.md")
    return 0
