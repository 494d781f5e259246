"""``leyline eval proxy``: the command line (no torch here; the run imports it when needed)."""

from __future__ import annotations

import argparse

from ..common.cli import add_endpoint, add_run_options, from_args, int_list

HELP = "policy proxy: stale tool outputs as distractors; accuracy without/with truncation"

DESCRIPTION = """\
A policy proxy that a 135M model can show on a CPU. In each task a scripted agent polls a
tool (track_shipment, get_job_status, ...) and waits between polls; the older polls show
now-stale values (distractors), the last one the current value, and the user then asks
for the current value. Three arms, each in its own session on the server:

  none        the full history
  reprefill   TruncateOldToolOutputs(keep_last) stubs old outputs; edited messages, plain
  splice      the same edits as Leyline splice directives (downstream KV kept)
  summarize   (with --summarize) old turns replaced by a summary the same server writes,
              sent as a splice

The answer is scored as a choice among the candidate values (the values shown) from the
next-token logprobs after an answer prefix, on each arm's own cached tokens. Reports
accuracy per arm with Wilson 95% intervals, by number of stale polls, the prompt tokens
each arm's requests prefilled and reused (the server's leyline report), and how often the
splice and re-prefill arms chose the same value. Tasks come from --seed; nothing is
downloaded. Without --base-url the embedded `leyline serve` (SmolLM2-135M, CPU) runs it.
"""

FAST_TASKS = 4
FAST_STALE = (1, 2)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tasks", type=int, default=60, help="number of tasks (default: %(default)s)"
    )
    parser.add_argument(
        "--stale",
        type=_levels,
        default=(1, 2, 4),
        help="stale polls per task, a comma list taken in turn over the tasks (default: 1,2,4)",
    )
    parser.add_argument(
        "--keep-last",
        type=int,
        default=2,
        help="the policy's keep_last: tool turns whose outputs stay verbatim; 2 keeps the "
        "last wait and the last poll (default: %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0, help="task seed (default: %(default)s)")
    add_endpoint(
        parser,
        base_url="an OpenAI-compatible endpoint (http://host:port/v1) instead of the embedded "
        "server; without Leyline the splice arm runs as re-prefill and says so",
        model="",
        model_help="model name to send (default: the endpoint's first)",
    )
    parser.add_argument(
        "--summarize",
        action="store_true",
        help="also run a fourth arm: Summarize (old turns replaced by a summary the same "
        "server writes, sent as a splice) instead of truncation",
    )
    add_run_options(
        parser,
        out="results folder (default: results/proxy-<UTC time>)",
        fast=f"CI mode: {FAST_TASKS} tasks, stale {','.join(map(str, FAST_STALE))}",
    )


def run(args: argparse.Namespace) -> int:
    from .run import ProxyOptions, run_proxy

    tasks, stale = (FAST_TASKS, FAST_STALE) if args.fast else (args.tasks, args.stale)
    if tasks < 1:
        raise SystemExit("--tasks must be at least 1")
    if args.keep_last < 1:
        raise SystemExit("--keep-last must be at least 1 (0 would stub the current poll too)")
    options = from_args(ProxyOptions, args, tasks=tasks, stale=stale, progress=not args.no_progress)
    run_proxy(options)
    return 0


_levels = int_list(
    1,
    "expected integers like 1,2,4, got {text!r}",
    "stale levels must be >= 1, got {text!r}",
    skip_blank=False,
)
