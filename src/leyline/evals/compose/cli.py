"""``leyline eval compose``: arguments and entry point (torch is imported only in ``run``)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from .texts import KINDS, Kind

HELP = (
    "composed skill KV vs full prefill: KL, cosines, answer probability by seam K and with "
    "selective recompute; TTFT"
)

DESCRIPTION = """\
COMPOSE inserts a skill's KV, computed once from position 0, into a session: keys rotated
to where it lands, its first K tokens (the seam) recomputed against the prefix. How close
is that to prefilling the whole context? Skills of three kinds (support rules, gazetteer
passages, JSON tool specs), synthesized from --seed at several lengths, each composed after
a system prompt and some conversation, then a question prefilled fresh. Arms: full
recompute (the reference), compose with K = 0, 1, 4, 16, 64, compose K = 16 with selective
recompute of 15% of the block (--recompute-ratios: the tokens whose KV deviates most in
context at an early layer, after CacheBlend) and of the same share chosen by the question's
attention (--ask-ratios, the server's attention mode), the skill compiled after an anchor
such as the chat template's header (--anchor), a no-rotation control and no skill at all.
Per arm, on the next-token logits after the question: KL(full || arm), raw and centred
cosine, argmax agreement and the probability of the designated answer token (the routed
team, the passage's fact, the right tool's name), also as a table per kind; TTFT of
compose vs a full prefill by skill length (medians over interleaved repeats, prefix cached
and cold); skill KV bytes. Writes report.json, report.md, ttft.png and kl_by_k.png to --out (default
results/compose-<UTC time>); see docs/evals-compose.md.
"""


@dataclass(frozen=True, slots=True)
class Sizes:
    kinds: tuple[Kind, ...]
    lengths: tuple[int, ...]
    seams: tuple[int, ...]
    items: int


DEFAULT = Sizes(KINDS, (512, 1024, 2048), (0, 1, 4, 16, 64), 4)
DEFAULT_RATIOS = (0.15,)
# --full: up to 8k tokens (capped at the model's context less the prefix and question).
FULL_LENGTHS = (512, 1024, 2048, 4096, 8192)
# --fast: the CI mode, well under a minute on two shared cores.
FAST = Sizes(("policy", "tools"), (256,), (0, 4, 16), 2)


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return values


def _ratios(text: str) -> tuple[float, ...]:
    if text.strip().lower() == "none":
        return ()
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated fractions, got {text!r}"
        ) from None
    if not values or not all(0.0 < v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"ratios are fractions in (0, 1] or 'none'; got {text!r}")
    return tuple(dict.fromkeys(values))


def _kinds(text: str) -> tuple[Kind, ...]:
    wanted = {k.strip() for k in text.split(",") if k.strip()}
    kinds = tuple(k for k in KINDS if k in wanted)  # the canonical order
    if not kinds or len(kinds) < len(wanted):
        raise argparse.ArgumentTypeError(f"kinds are {', '.join(KINDS)}; got {text!r}")
    return kinds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default="smollm2", help="smollm2 (default), a .gguf or an HF folder"
    )
    parser.add_argument(
        "--kinds", type=_kinds, help=f"comma list of {', '.join(KINDS)} (default: all)"
    )
    parser.add_argument(
        "--lengths",
        type=_ints,
        help="skill lengths in tokens, comma list (default 512,1024,2048; --full: up to 8192)",
    )
    parser.add_argument(
        "--seams", type=_ints, help="seam sizes K, comma list (default 0,1,4,16,64)"
    )
    parser.add_argument(
        "--control-seam", type=int, default=16, help="K of the no-rotation control (default 16)"
    )
    parser.add_argument(
        "--recompute-ratios",
        type=_ratios,
        default=DEFAULT_RATIOS,
        help="selective recompute (deviation) ratios, one arm each, comma list, or 'none' "
        f"(default {','.join(map(str, DEFAULT_RATIOS))}; also in --fast)",
    )
    parser.add_argument(
        "--ask-ratios",
        type=_ratios,
        default=DEFAULT_RATIOS,
        help="question-aware recompute ratios (the server's attention mode: the block tokens "
        "the question attends to most), comma list, or 'none' (default "
        f"{','.join(map(str, DEFAULT_RATIOS))}; also in --fast)",
    )
    parser.add_argument(
        "--recompute-seam",
        type=int,
        default=16,
        help="K of the recompute and anchored arms (default 16)",
    )
    parser.add_argument(
        "--anchor",
        default="template",
        help="anchored arm: the skill compiled after this text, its KV dropped; 'template' "
        "(default): what the chat template puts before a user message; 'conversation': a "
        "system prompt and two exchanges of small talk before it; 'none': no such arm",
    )
    parser.add_argument(
        "--items",
        type=int,
        help=f"decision items per kind and length, each one TTFT repeat (default {DEFAULT.items})",
    )
    parser.add_argument(
        "--prefix-tokens",
        type=int,
        default=0,
        help="grow each context's conversation before the skill to at least this many tokens, "
        "so the skill is composed that deep (default 0: 3-5 exchanges, ~170-310 tokens)",
    )
    parser.add_argument("--seed", type=int, default=0, help="skill and context seed (default 0)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: on a shared machine 2 threads ran 10x slower)",
    )
    parser.add_argument("--out", type=Path, help="results folder")
    size = parser.add_mutually_exclusive_group()
    size.add_argument(
        "--full",
        action="store_true",
        help=f"lengths {','.join(map(str, FULL_LENGTHS))} (8192 capped at the model's context); "
        "long: tens of minutes on a CPU",
    )
    size.add_argument(
        "--fast",
        action="store_true",
        help=f"CI mode: kinds {','.join(FAST.kinds)}, {FAST.lengths[0]} tokens, "
        f"K {','.join(map(str, FAST.seams))}, {FAST.items} items (overrides those options)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    sizes = (
        FAST
        if args.fast
        else replace(
            DEFAULT,
            kinds=args.kinds or DEFAULT.kinds,
            lengths=args.lengths or (FULL_LENGTHS if args.full else DEFAULT.lengths),
            seams=args.seams or DEFAULT.seams,
            items=DEFAULT.items if args.items is None else args.items,
        )
    )
    if (
        sizes.items < 1
        or min(sizes.lengths) < 16
        or min(args.control_seam, args.recompute_seam, args.prefix_tokens) < 0
    ):
        print(
            "need --items >= 1, --lengths >= 16, --control-seam, --recompute-seam and "
            "--prefix-tokens >= 0",
            file=sys.stderr,
        )
        return 2
    import torch

    from .run import ComposeOptions, run_compose_eval

    options = ComposeOptions(
        model=args.model,
        kinds=sizes.kinds,
        lengths=tuple(dict.fromkeys(sizes.lengths)),
        seams=tuple(sorted(set(sizes.seams))),
        control_seam=args.control_seam,
        items=sizes.items,
        seed=args.seed,
        out=args.out,
        fast=args.fast,
        progress=not args.no_progress,
        recompute_seam=args.recompute_seam,
        ratios=args.recompute_ratios,
        ask_ratios=args.ask_ratios,
        anchor=args.anchor,
        prefix_tokens=args.prefix_tokens,
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, args.threads))
    try:
        folder = run_compose_eval(options)
    except ValueError as exc:  # options the model's context cannot take
        print(f"leyline eval compose: {exc}", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(threads)  # the caller's setting (tests run this in-process)
    print((folder / "report.md").read_text().split("## ", 2)[1].strip())
    print(f"\nreport: {folder}/report.md")
    return 0
