"""``leyline eval memory``: arguments and entry point (torch is imported only in ``run``)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from ..common.cli import (
    add_run_options,
    from_args,
    int_list,
    print_summary,
    torch_threads,
)
from .profiles import FIELDS

HELP = (
    "user-memory placement: profile early vs late (prefilled or composed), answer accuracy "
    "vs the cost of a profile update"
)

DESCRIPTION = f"""\
Where should an agent put what it knows about the user? Seeded synthetic profiles (a few
dozen of {len(FIELDS)} fields: name, city, employer, pet, food, allergy, language, ...) sit
either right after the system prompt (early) or after an unrelated agent trajectory, just
before the question (late); the profile then changes (a new version) and the user asks
about it. Arms: early_full (profile early, the context re-prefilled after the update),
late_full (profile late, prefilled on the cached trajectory: the reference), late_compose_kK
(profile registered once as a skill and composed after the cached trajectory: keys rotated,
K seam tokens recomputed) and none (no profile: chance). Per arm: answer accuracy (the right
value's first token against same-field distractors, by log-probability; Wilson 95%), greedy
argmax = the right value, KL / centred cosine / argmax agreement of the next-token logits
against late_full, and the cost of the update (tokens prefilled, time to the first
next-token logits; medians over items). Writes report.json, report.md and
accuracy_vs_cost.png to --out (default results/memory-<UTC time>); see
docs/evals-memory.md.
"""


@dataclass(frozen=True, slots=True)
class Sizes:
    items: int
    trajectory: tuple[int, ...]
    facts: int
    questions: int
    seams: tuple[int, ...]


DEFAULT = Sizes(20, (1024,), 30, 8, (0, 4, 16))
# --fast: the CI mode. K = 512 is past the profile's length: that arm recomputes the whole
# profile (= late_full).
FAST = Sizes(2, (256,), 12, 3, (0, 16, 512))
MAX_CHOICES = min(len(f.pool) for f in FIELDS)


_ints = int_list(dedupe=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default="smollm2", help="smollm2 (default), a .gguf or an HF folder"
    )
    parser.add_argument(
        "--items",
        type=int,
        help=f"items (users) per trajectory length, each one timed update (default "
        f"{DEFAULT.items})",
    )
    parser.add_argument(
        "--trajectory",
        type=_ints,
        help="trajectory lengths in tokens, comma list (default "
        f"{','.join(map(str, DEFAULT.trajectory))}; e.g. 256,1024,2048)",
    )
    parser.add_argument(
        "--facts", type=int, help=f"facts per profile, 1-{len(FIELDS)} (default {DEFAULT.facts})"
    )
    parser.add_argument(
        "--changes", type=int, default=4, help="facts the profile update redraws (default 4)"
    )
    parser.add_argument(
        "--questions", type=int, help=f"questions per item (default {DEFAULT.questions})"
    )
    parser.add_argument(
        "--choices",
        type=int,
        default=5,
        help="candidates per question, the right value included (default 5: chance 0.2)",
    )
    parser.add_argument(
        "--seams",
        type=_ints,
        help=f"compose seam sizes K, comma list (default {','.join(map(str, DEFAULT.seams))})",
    )
    add_run_options(
        parser,
        seed="profile and trajectory seed",
        threads=True,
        fast=f"CI mode: {FAST.items} items, {FAST.trajectory[0]}-token trajectory, "
        f"{FAST.facts} facts, {FAST.questions} questions, K {','.join(map(str, FAST.seams))} "
        "(overrides those options)",
    )


def run(args: argparse.Namespace) -> int:
    sizes = (
        FAST
        if args.fast
        else Sizes(
            DEFAULT.items if args.items is None else args.items,
            args.trajectory or DEFAULT.trajectory,
            args.facts or DEFAULT.facts,
            args.questions or DEFAULT.questions,
            args.seams or DEFAULT.seams,
        )
    )
    if (
        sizes.items < 1
        or not 1 <= sizes.facts <= len(FIELDS)
        or not 1 <= sizes.questions <= sizes.facts
        or not 2 <= args.choices <= MAX_CHOICES
        or args.changes < 0
        or min(sizes.trajectory) < 1
    ):
        print(
            f"need --items >= 1, 1 <= --questions <= --facts <= {len(FIELDS)}, "
            f"2 <= --choices <= {MAX_CHOICES}, --changes >= 0, --trajectory >= 1",
            file=sys.stderr,
        )
        return 2
    from .run import MemoryOptions, run_memory_eval

    options = from_args(
        MemoryOptions,
        args,
        items=sizes.items,
        trajectory=sizes.trajectory,
        facts=sizes.facts,
        questions=sizes.questions,
        seams=tuple(sorted(set(sizes.seams))),
        progress=not args.no_progress,
    )
    with torch_threads(args.threads):
        folder = run_memory_eval(options)
    return print_summary(folder)
