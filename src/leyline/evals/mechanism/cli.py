"""``leyline eval mechanism``: arguments and entry point (nothing heavy imported here)."""

from __future__ import annotations

import argparse
import sys

from ..common.cli import add_endpoint, add_run_options, from_args, int_list

HELP = "replayed agent trajectories: splice vs prefix-cache re-prefill at concurrency 1-16"

DESCRIPTION = """\
The paper's mechanism benchmark on a Leyline server. Clients replay multi-turn tool-using
trajectories under TruncateOldToolOutputs (the paper's "drop tool outputs older than n
turns"); every turn is sent in two arms: the policy's edits as Leyline splices, and the same
edited messages as plain requests, which the server re-prefills from the first changed token
(its warm prefix reused). Reports per concurrency level: replay cache-hit rate (reused /
prompt tokens), end-to-end latency and TTFT p50/p90, and first-token argmax agreement of the
splice arm with the warm-prefix path; plus HTTP overhead on the embedded server.

Trajectories: synthetic (seeded pytest logs, tracebacks, file views, grep hits), debug-gym
(recorded mini_nightmare episodes, bundled; or a results folder of `leyline eval debug-gym`
given as a path) and demo (the demo's scripted calls on its sample project, real tools).
Embedded server: SmolLM2-135M on CPU; its scheduler batches decode steps and slices prefills
at chunks (--serial: one request's model work after another, the baseline).
"""


_levels = int_list(
    1, "not comma-separated integers: {text!r}", "concurrency levels must be >= 1", skip_blank=False
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--levels", type=_levels, help="concurrency levels, comma-separated (default 1,4,8,16)"
    )
    parser.add_argument("--turns", type=int, help="tool turns replayed per client (default 6)")
    parser.add_argument(
        "--trajectories",
        default="synthetic,debug-gym,demo",
        help="sources, comma-separated: synthetic, debug-gym, demo, or a debug-gym results "
        "folder (default: %(default)s)",
    )
    parser.add_argument(
        "--synthetic", type=int, default=8, help="synthetic trajectories (default %(default)s)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic ones")
    parser.add_argument(
        "--keep-last", type=int, default=2, help="TruncateOldToolOutputs keep_last (default 2)"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=4, help="tokens generated per request (default 4)"
    )
    parser.add_argument("--overhead-reps", type=int, help="reps per overhead pair (default 15)")
    add_endpoint(
        parser,
        base_url="an OpenAI-compatible server to use instead",
        model="smollm2",
        model_help="embedded: model to load; else: model to request",
    )
    parser.add_argument(
        "--serial",
        action="store_true",
        help="embedded server with --max-running-jobs 1: model work one job after another "
        "(the baseline the scheduler is measured against)",
    )
    parser.add_argument(
        "--decode-share",
        type=float,
        help="embedded server: leyline serve --decode-share (model time running generations "
        "may take between two prefill slices; default: the server's, 0)",
    )
    parser.add_argument(
        "--schedule",
        choices=("las", "srpt"),
        help="embedded server: leyline serve --schedule (which waiting job takes the model "
        "next; default: the server's, srpt)",
    )
    parser.add_argument(
        "--arms-apart",
        action="store_true",
        help="run each level's clients in one arm at a time (all splice, then all re-prefill) "
        "instead of both arms turn by turn: each arm's latency then carries only the "
        "queueing its own work causes",
    )
    parser.add_argument(
        "--server-counter",
        metavar="SELECTOR",
        help="--base-url: a Prometheus counter on the server's /metrics, as name or "
        'name{label="value",...} (e.g. vLLM\'s '
        'vllm:prompt_tokens_by_source_total{source="local_compute"}), summed over the '
        "series that carry those labels; reports its growth while each arm's clients ran, "
        "by level (implies --arms-apart)",
    )
    add_run_options(
        parser,
        out="results folder (default results/mechanism-TIME)",
        fast="CI mode: levels 1,2, 3 turns, 3 overhead reps",
    )


def run(args: argparse.Namespace) -> int:
    from .metrics import CounterError, parse_selector
    from .replay import Settings
    from .run import Options, run_mechanism
    from .trajectories import load

    levels = args.levels or ((1, 2) if args.fast else (1, 4, 8, 16))
    turns = args.turns or (3 if args.fast else 6)
    reps = args.overhead_reps if args.overhead_reps is not None else (3 if args.fast else 15)
    if turns < 1:
        print("leyline eval mechanism: --turns must be >= 1", file=sys.stderr)
        return 2
    selector = None
    if args.server_counter is not None:
        if not args.base_url:
            print("leyline eval mechanism: --server-counter needs --base-url", file=sys.stderr)
            return 2
        try:
            selector = parse_selector(args.server_counter)
        except ValueError as exc:
            print(f"leyline eval mechanism: --server-counter: {exc}", file=sys.stderr)
            return 2
    try:
        pool = load(
            [s.strip() for s in args.trajectories.split(",") if s.strip()],
            synthetic_count=2 if args.fast else args.synthetic,
            seed=args.seed,
        )
    except (ValueError, FileNotFoundError) as exc:
        print(f"leyline eval mechanism: {exc}", file=sys.stderr)
        return 2
    settings = Settings(
        levels, turns, args.keep_last, args.max_tokens, args.model, arms_apart=args.arms_apart
    )
    options = from_args(
        Options,
        args,
        settings=settings,
        pool=tuple(pool),
        overhead_reps=reps,
        progress=not args.no_progress,
        server_counter=selector,
    )
    for flag, value in (("--decode-share", args.decode_share), ("--schedule", args.schedule)):
        if value is not None and args.base_url:
            print(f"leyline eval mechanism: {flag} is for the embedded server", file=sys.stderr)
            return 2
    if args.serial and args.base_url:
        print("leyline eval mechanism: --serial is for the embedded server", file=sys.stderr)
        return 2
    try:
        run_mechanism(options)
    except CounterError as exc:
        print(f"leyline eval mechanism: --server-counter: {exc}", file=sys.stderr)
        return 2
    return 0
