"""Which layer should rank a deviation compose's tokens? KL against the full prefill per layer.

Runs the compose eval's items (same texts, contexts, questions) through one arm only,
``compose_k{seam}_dev{P}``, once per selection layer (``Engine.recompute_selection_layer``),
on the plain and on the anchored skill, and prints each item's KL(full || arm) and, per
layer, the geometric mean of its KL over the first layer's with how many items it lowers.

    python -m leyline.evals.compose.selection_sweep --layers 1,4,6,8 --seed 2
"""

from __future__ import annotations

import argparse
import math
from collections import defaultdict
from collections.abc import Sequence

import torch

from leyline.engine.edits.skills import Skill, compile_skill
from leyline.engine.engine import Engine
from leyline.engine.session import SessionCache
from leyline.evals.common import progress
from leyline.evals.common.engine import rotating_engine

from .anchor import anchor_text
from .arms import deviation_mode, timed_compose
from .cases import fit_case
from .cli import _ints, _kinds
from .measures import compare
from .texts import Kind


def item_kls(
    engine: Engine, prefix: SessionCache, skill: Skill, question: Sequence[int],
    layers: Sequence[int], seam: int, ratio: float, answer: int | None,
) -> dict[int, float]:  # fmt: skip
    """KL of the deviation compose against the full prefill, per selection layer."""
    _, full = engine.forward(prefix.kv, list(skill.tokens) + list(question))
    default = engine.recompute_selection_layer
    out: dict[int, float] = {}
    try:
        for layer in layers:
            engine.recompute_selection_layer = layer
            logits = timed_compose(prefix, skill, seam, question, deviation_mode(ratio))[0]
            out[layer] = compare(full, logits, answer).kl
    finally:
        engine.recompute_selection_layer = default
    return out


@torch.inference_mode()
def sweep(
    kinds: Sequence[Kind], lengths: Sequence[int], items: int, layers: Sequence[int],
    seed: int, seam: int = 16, ratio: float = 0.15, model: str = "smollm2",
) -> list[tuple[str, int, bool, int, dict[int, float]]]:  # fmt: skip
    """(kind, length, anchored, item index, KL per layer) for every item."""
    engine = rotating_engine(model, "skills")
    anchor = tuple(engine.encode(anchor_text("template", engine.tokenizer)))
    work = [(k, n, a) for k in kinds for n in lengths for a in (False, True)]
    rows: list[tuple[str, int, bool, int, dict[int, float]]] = []
    for kind, length, anchored in progress(work, desc="skills", total=len(work)):
        case, cases = fit_case(
            kind, length, engine.encode, seed, items,
            max_session_tokens=engine.limits.max_session_tokens,
        )  # fmt: skip
        skill = compile_skill(
            engine, case.tokens, skill_id="sweep", tenant="eval", anchor=anchor if anchored else ()
        )
        for item in cases:
            prefix = SessionCache(engine)
            prefix.prefill(item.prefix)
            kls = item_kls(
                engine, prefix, skill, item.question, layers, seam, ratio, item.answer_token
            )
            rows.append((kind, len(skill), anchored, item.index, kls))
            print(kind, len(skill), "anchored" if anchored else "plain", item.index,
                  {s: round(v, 4) for s, v in kls.items()}, flush=True)  # fmt: skip
    return rows


def summarise(rows: Sequence[tuple[str, int, bool, int, dict[int, float]]]) -> list[str]:
    """Per layer: geometric-mean KL ratio to the first layer and items lowered; per cell: means."""
    layers = list(rows[0][4])
    base = layers[0]
    lines = []
    for layer in layers[1:]:
        logs = [math.log(r[4][layer] / r[4][base]) for r in rows]
        lines.append(
            f"layer {layer} vs {base}: KL x{math.exp(sum(logs) / len(logs)):.3f} (geometric mean),"
            f" lower in {sum(x < 0 for x in logs)}/{len(logs)} items"
        )
    cells: dict[tuple[str, int, bool], list[dict[int, float]]] = defaultdict(list)
    for kind, length, anchored, _, kls in rows:
        cells[(kind, length, anchored)].append(kls)
    for (kind, length, anchored), group in cells.items():
        means = {s: sum(g[s] for g in group) / len(group) for s in layers}
        lines.append(f"{kind} {length} {'anchored' if anchored else 'plain'}: "
                     + "  ".join(f"s{s} {v:.4f}" for s, v in means.items()))  # fmt: skip
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kinds", type=_kinds, default=("policy", "tools", "passage"))
    parser.add_argument("--lengths", type=_ints, default=(512, 1024))
    parser.add_argument("--items", type=int, default=3, help="items per kind and length")
    parser.add_argument("--layers", type=_ints, default=(1, 4, 6, 8),
                        help="selection layers; the first is the baseline")  # fmt: skip
    parser.add_argument("--seed", type=int, default=2)
    parser.add_argument("--ratio", type=float, default=0.15, help="deviation ratio")
    parser.add_argument("--seam", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if any(layer < 1 for layer in args.layers):
        parser.error("selection layers start at 1 (layer 0's KV does not depend on the context)")
    torch.set_num_threads(args.threads)
    rows = sweep(
        args.kinds, args.lengths, args.items, args.layers, args.seed, args.seam, args.ratio
    )
    print("\n".join(summarise(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
