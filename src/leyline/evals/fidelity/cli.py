"""``leyline eval fidelity``: arguments and entry point (torch is imported only in ``run``)."""

from __future__ import annotations

import argparse
import sys

from ..common.cli import add_run_options, print_summary, torch_threads

HELP = "splice vs full context vs re-prefill: key error, bf16 drift, next-token KL and argmax"

DESCRIPTION = """\
How close is an AMORTIZE splice to what the model would compute? For each model: the
rope-band error of the spliced downstream keys per layer against the same hidden states
rotated by transformers at the new positions; the drift of a bf16 cache over 1..K repeated
splices with the rotation done in fp32 (the engine) vs in bf16, against an exact fp64
rotation; and over N generated agent transcripts (an old tool output replaced by a stub)
the next-token KL and argmax agreement of the splice with the full original context and
with a re-prefill of the edited text, counting which one the splice follows where those
two disagree. SmolLM2-135M runs with its real weights; the tiny MLA models are RANDOM
WEIGHTS and labelled so. Writes report.json, report.md, key_error.png, drift.png and
kl_hist.png to --out (default results/fidelity-<UTC time>).
"""

MODELS = ("smollm2", "tiny-mla-v2", "tiny-mla-v3")
DEFAULT_MODELS = ("smollm2", "tiny-mla-v2")
# --fast: the CI mode.
FAST = {"prompts": 4, "max_splices": 12, "key_prompts": 1, "drift_tokens": 16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        action="append",
        metavar="MODEL",
        help=f"model to evaluate: {', '.join(MODELS)}, a .gguf file or a Hugging Face folder "
        f"(repeat for several; default: {' and '.join(DEFAULT_MODELS)})",
    )
    parser.add_argument("--prompts", type=int, default=200, help="prompts (default 200)")
    parser.add_argument(
        "--max-splices", type=int, default=100, help="repeated splices for the drift (default 100)"
    )
    parser.add_argument(
        "--key-prompts", type=int, default=8, help="prompts with per-layer key error (default 8)"
    )
    parser.add_argument(
        "--drift-tokens", type=int, default=32, help="tokens whose keys drift (default 32)"
    )
    parser.add_argument(
        "--dtype",
        action="append",
        choices=["float32", "bfloat16"],
        help="weights and cache dtype (repeat for both; default float32); the rotation is "
        "computed in fp32 either way",
    )
    add_run_options(
        parser,
        seed="prompt and delta seed (default 0)",
        threads=True,
        fast=f"CI mode: {FAST['prompts']} prompts, {FAST['max_splices']} splices, "
        f"{FAST['key_prompts']} key prompt (overrides those options)",
        progress="no progress bars",
    )


def run(args: argparse.Namespace) -> int:
    sizes = {
        "prompts": args.prompts,
        "max_splices": args.max_splices,
        "key_prompts": args.key_prompts,
        "drift_tokens": args.drift_tokens,
    }
    if args.fast:
        sizes |= FAST
    if sizes["prompts"] < 1 or sizes["max_splices"] < 2 or sizes["drift_tokens"] < 1:
        print("need --prompts >= 1, --max-splices >= 2, --drift-tokens >= 1", file=sys.stderr)
        return 2
    from .run import FidelityOptions, run_fidelity

    options = FidelityOptions(
        models=tuple(dict.fromkeys(args.model or DEFAULT_MODELS)),
        seed=args.seed,
        out=args.out,
        progress=not args.no_progress,
        dtypes=tuple(dict.fromkeys(args.dtype or ["float32"])),
        **sizes,
    )
    with torch_threads(args.threads):
        folder = run_fidelity(options)
    return print_summary(folder)
