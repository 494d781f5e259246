"""``leyline eval compose``: arguments and entry point (torch is imported only in ``run``)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace

from ..common.cli import (
    add_run_options,
    comma_list,
    from_args,
    int_list,
    print_summary,
    torch_threads,
)
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
# --fast: the CI mode.
FAST = Sizes(("policy", "tools"), (256,), (0, 4, 16), 2)


_ints = int_list()
_fractions = comma_list(
    float,
    lambda v: 0.0 < v <= 1.0,
    unparsable="expected comma-separated fractions, got {text!r}",
    invalid="ratios are fractions in (0, 1] or 'none'; got {text!r}",
    dedupe=True,
)


def _ratios(text: str) -> tuple[float, ...]:
    return () if text.strip().lower() == "none" else _fractions(text)


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
    add_run_options(
        parser,
        seed="skill and context seed (default 0)",
        threads=True,
        fast=f"CI mode: kinds {','.join(FAST.kinds)}, {FAST.lengths[0]} tokens, "
        f"K {','.join(map(str, FAST.seams))}, {FAST.items} items (overrides those options)",
        full=f"lengths {','.join(map(str, FULL_LENGTHS))} (8192 capped at the model's context); "
        "long: tens of minutes on a CPU",
    )


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
    from .run import ComposeOptions, run_compose_eval

    options = from_args(
        ComposeOptions,
        args,
        kinds=sizes.kinds,
        lengths=tuple(dict.fromkeys(sizes.lengths)),
        seams=tuple(sorted(set(sizes.seams))),
        items=sizes.items,
        progress=not args.no_progress,
        ratios=args.recompute_ratios,
    )
    try:
        with torch_threads(args.threads):
            folder = run_compose_eval(options)
    except ValueError as exc:  # options the model's context cannot take
        print(f"leyline eval compose: {exc}", file=sys.stderr)
        return 2
    return print_summary(folder)
