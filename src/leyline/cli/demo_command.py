"""``leyline demo``: the main job. One agent episode, its edits as splices vs re-prefills."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

DESCRIPTION = """\
Run one tool-using agent episode over a small bundled project, twice, turn by turn: once
with the policy's edits (TruncateOldToolOutputs) sent as Leyline splices, once as plain
edited messages that the server re-prefills. Prints a per-turn table and a summary (tokens
reused / prefilled / rotated, latency, next-token agreement between the arms) and writes
demo.json and demo.png to the results folder.

The agent's tool-call decisions are scripted (the same in both arms); the tools, the
model's generation (the embedded SmolLM2-135M-Instruct on CPU unless --base-url), the
policy and the cache edits are real. It takes a few minutes on a 2-core CPU.
"""


def register(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "demo",
        help="the main job: one agent episode, its context edits as splices vs re-prefills",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--turns",
        type=int,
        default=12,
        help="agent turns (scripted tool calls) to run, 1..12; each turn is one request per "
        "arm (default: %(default)s)",
    )
    parser.add_argument(
        "--keep-last",
        type=int,
        default=2,
        help="TruncateOldToolOutputs keeps the outputs of the last N tool turns and stubs older "
        "ones (default: %(default)s)",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=8,
        help="tokens the model generates per turn (greedy); only the first is scored "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--top-logprobs",
        type=int,
        default=20,
        help="candidates of the first generated token compared between the arms (KL, "
        "top-1); 0 turns scoring off (default: %(default)s)",
    )
    parser.add_argument(
        "--base-url",
        default=None,
        help="an OpenAI-compatible endpoint to use instead of the embedded server, e.g. "
        "http://127.0.0.1:8000/v1 (a server without Leyline runs both arms as re-prefills)",
    )
    parser.add_argument(
        "--api-key", default=None, help="API key for --base-url (sent as a bearer token)"
    )
    parser.add_argument(
        "--model",
        default=None,
        help="embedded: the model to load (default smollm2, the embedded SmolLM2); with "
        "--base-url: the model name to request (default: the endpoint's first model)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="results folder (default: results/demo-<timestamp> under the current folder)",
    )
    parser.add_argument(
        "--no-progress", action="store_true", help="do not show the progress bar (stderr)"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from leyline.evals.demo.episode import EpisodeSettings
    from leyline.evals.demo.run import DemoOptions, run_demo

    try:
        settings = EpisodeSettings(
            turns=args.turns,
            keep_last=args.keep_last,
            max_tokens=args.max_tokens,
            top_logprobs=args.top_logprobs,
            model=args.model or "",
        )
    except ValueError as exc:
        print(f"leyline demo: {exc}", file=sys.stderr)
        return 2
    options = DemoOptions(
        settings,
        base_url=args.base_url,
        api_key=args.api_key,
        out=args.out,
        progress=not args.no_progress,
    )
    run_demo(options)
    return 0
