"""Where does a compose's error live? Oracles that hand it the exact KV in part.

For each of the compose eval's items, the block is composed (seam ``K``, no recompute) and
the whole context is prefilled too, which gives the KV every block token would have had in
context. Each oracle then replaces part of the composed block's KV by that exact KV and
prefills the question on the result; its KL against the full prefill says how much of the
compose's error that part carries:

* ``layers a-b``: every copied token's exact KV at layers ``[a, b)``, the rest as composed;
* ``error top P%``: the ``P%`` of copied tokens whose KV lies farthest from the exact one
  (squared distance summed over layers and tensors) exact at every layer;
* ``random P%``: as many tokens, drawn at random (seeded per item), for comparison.

No server does this (it needs the full prefill it is meant to save): it bounds what a
selective recompute of layers or tokens could buy.

    python -m leyline.evals.compose.error_oracle --kinds passage --lengths 512 --items 4
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from collections.abc import Sequence

import torch

from leyline.engine.edits.skills import Skill, compile_skill
from leyline.engine.engine import Engine
from leyline.engine.kv.kv_blocks import KVCache
from leyline.engine.session import SessionCache
from leyline.evals.common import progress
from leyline.evals.common.engine import rotating_engine

from .cases import fit_case
from .cli import _ints, _kinds
from .measures import compare
from .texts import Kind

COMPOSED = "composed"


def substituted(
    composed: KVCache, exact: KVCache, layers: Sequence[int], positions: torch.Tensor
) -> KVCache:
    """``composed`` with ``exact``'s rows at ``positions`` (sequence dim -2) in ``layers``;
    every other tensor is ``composed``'s own."""
    out = []
    for index, layer in enumerate(composed):
        if index not in layers or positions.numel() == 0:
            out.append(layer)
            continue
        mended = []
        for mine, theirs in zip(layer, exact[index], strict=True):
            copy = mine.clone()
            copy[..., positions, :] = theirs[..., positions, :]
            mended.append(copy)
        out.append(tuple(mended))
    return tuple(out)


def token_error(composed: KVCache, exact: KVCache, positions: torch.Tensor) -> torch.Tensor:
    """Per position in ``positions``: squared distance of its KV from the exact KV, summed
    over layers, tensors and everything but the sequence dim."""
    total = torch.zeros(positions.numel(), dtype=torch.float64)
    for mine_layer, exact_layer in zip(composed, exact, strict=True):
        for mine, theirs in zip(mine_layer, exact_layer, strict=True):
            diff = (mine[..., positions, :] - theirs[..., positions, :]).double()
            total += diff.pow(2).movedim(-2, 0).reshape(positions.numel(), -1).sum(1)
    return total


def oracle_kls(
    engine: Engine, prefix: SessionCache, skill: Skill, question: Sequence[int], seam: int,
    layer_ranges: Sequence[tuple[int, int]], ratios: Sequence[float], seed: int = 0,
) -> dict[str, float]:  # fmt: skip
    """KL(full || variant) of the plain compose and of each oracle on one item."""
    at, length = len(prefix.tokens), len(skill)
    layers = range(len(prefix.kv))
    beyond = [(low, high) for low, high in layer_ranges if high > len(layers)]
    if beyond:
        raise ValueError(f"layer ranges {beyond} reach past the model's {len(layers)} layers")
    exact, full = engine.forward(prefix.kv, list(skill.tokens) + list(question))
    session = prefix.fork()
    session.compose(skill, at, seam_tokens=seam)
    composed = session.kv
    copied = torch.arange(at + min(seam, length), at + length)

    variants: dict[str, KVCache] = {COMPOSED: composed}
    for low, high in layer_ranges:
        variants[f"layers {low}-{high}"] = substituted(composed, exact, range(low, high), copied)
    order = torch.argsort(token_error(composed, exact, copied), descending=True)
    draw = torch.Generator().manual_seed(seed)
    for ratio in ratios:
        count = round(ratio * copied.numel())
        name = f"{round(ratio * 100, 1):g}%"
        variants[f"error top {name}"] = substituted(composed, exact, layers, copied[order[:count]])
        chosen = torch.randperm(copied.numel(), generator=draw)[:count]
        variants[f"random {name}"] = substituted(composed, exact, layers, copied[chosen])
    out = {}
    for name, kv in variants.items():
        _, logits = engine.forward(kv, question)
        out[name] = compare(full, logits, None).kl
    return out


@torch.inference_mode()
def run(
    kinds: Sequence[Kind], lengths: Sequence[int], items: int, seed: int, seam: int,
    layer_ranges: Sequence[tuple[int, int]], ratios: Sequence[float], model: str = "smollm2",
) -> list[tuple[str, int, int, dict[str, float]]]:  # fmt: skip
    """(kind, skill tokens, item index, KL per variant) for every item."""
    engine = rotating_engine(model, "skills")
    rows: list[tuple[str, int, int, dict[str, float]]] = []
    work = [(kind, length) for kind in kinds for length in lengths]
    for kind, length in progress(work, desc="skills", total=len(work)):
        case, cases = fit_case(
            kind, length, engine.encode, seed, items,
            max_session_tokens=engine.limits.max_session_tokens,
        )  # fmt: skip
        skill = compile_skill(engine, case.tokens, skill_id="oracle", tenant="eval")
        for item in cases:
            prefix = SessionCache(engine)
            prefix.prefill(item.prefix)
            kls = oracle_kls(
                engine, prefix, skill, item.question, seam, layer_ranges, ratios, item.index
            )
            rows.append((kind, len(skill), item.index, kls))
    return rows


def table(rows: Sequence[tuple[str, int, int, dict[str, float]]]) -> str:
    """Mean KL per variant (rows) and cell (columns), markdown."""
    cells: dict[tuple[str, int], list[dict[str, float]]] = defaultdict(list)
    for kind, length, _, kls in rows:
        cells[(kind, length)].append(kls)
    names = list(rows[0][3])
    head = "| variant | " + " | ".join(f"{k}, {n}" for k, n in cells) + " |"
    lines = [head, "|" + "---|" * (len(cells) + 1)]
    for name in names:
        means = [sum(g[name] for g in group) / len(group) for group in cells.values()]
        lines.append(f"| {name} | " + " | ".join(f"{m:.4f}" for m in means) + " |")
    return "\n".join(lines)


def _ranges(text: str) -> tuple[tuple[int, int], ...]:
    out = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        if not high or int(low) >= int(high) or int(low) < 0:
            raise argparse.ArgumentTypeError(f"{part!r}: use layer ranges like 0-5,5-30")
        out.append((int(low), int(high)))
    return tuple(out)


def _ratios(text: str) -> tuple[float, ...]:
    values = tuple(float(x) for x in text.split(","))
    if not all(0.0 < v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: use fractions in (0, 1]")
    return values


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kinds", type=_kinds, default=("passage",))
    parser.add_argument("--lengths", type=_ints, default=(512,))
    parser.add_argument("--items", type=int, default=4, help="items per kind and length")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seam", type=int, default=16)
    parser.add_argument("--layer-ranges", type=_ranges,
                        default=((0, 5), (0, 15), (5, 30), (10, 30), (15, 30), (20, 30)),
                        help="layer ranges [a, b) made exact, e.g. 0-5,15-30")  # fmt: skip
    parser.add_argument("--ratios", type=_ratios, default=(0.15, 0.3, 0.5),
                        help="shares of the copied tokens made exact at every layer")  # fmt: skip
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = run(
        args.kinds, args.lengths, args.items, args.seed, args.seam, args.layer_ranges, args.ratios
    )
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
