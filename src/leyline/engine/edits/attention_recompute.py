"""COMPOSE's selective recompute ``{"mode": "attention", "ratio": r}``: recompute what the
tokens after the block read.

Deviation recompute (``recompute``) ranks a block's copied tokens by how much the new
context changes their KV; this mode ranks them by the attention the tokens following the
block (a turn's question) give them, then recomputes the chosen ones as deviation
recompute does. The definition: docs/engine.md, "Recompute what the question reads".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from leyline.engine.attention_mass import ATTENTION_MASS_KWARG, AttentionMass
from leyline.engine.edits.recompute import recompute_count, select_largest
from leyline.engine.forward import DEFAULT_PREFILL_CHUNK, KVBuffers, forward_at
from leyline.protocol.algebra import Run

ATTENTION_WINDOW = 256
"""The most following tokens whose attention ranks a block: enough for a question and its
chat markup, and a bound on the extra forward's cost and its score matrices' memory."""


def following_tokens(
    tokens: Sequence[int], end: int, final: Sequence[int] | None = None
) -> tuple[int, ...]:
    """The definition's ``F`` for a block ending at ``end`` of the new revision ``tokens``:
    from ``final`` (the sequence the request goes on to) when it extends ``tokens[:end]``."""
    source = tokens
    if final is not None and len(final) >= end and list(final[:end]) == list(tokens[:end]):
        source = final
    return tuple(source[end : end + ATTENTION_WINDOW])


@torch.no_grad()
def attention_scores(
    model: PreTrainedModel,
    buffers: KVBuffers,
    length: int,
    queries: Sequence[int],
    lo: int,
    hi: int,
    *,
    chunk: int = DEFAULT_PREFILL_CHUNK,
) -> torch.Tensor:
    """Step 1: the weight ``queries`` (run at positions ``length, ...`` over the buffers'
    first ``length`` positions) give each position of ``[lo, hi)``, fp64 ``[hi - lo]``.
    The buffers are only read."""
    if not queries:
        raise ValueError("attention scores need at least one query token")
    cache = DynamicCache()
    for i, (keys, values) in enumerate(buffers):
        cache.update(keys[..., :length, :], values[..., :length, :], i)  # copied: read only
    mass = AttentionMass(lo, hi)
    for start in range(0, len(queries), chunk):
        part = list(queries[start : start + chunk])
        first = length + start
        ids = torch.tensor([part], dtype=torch.long, device=model.device)
        pos = torch.arange(first, first + len(part), device=model.device).unsqueeze(0)
        model(
            input_ids=ids,
            position_ids=pos,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
            **{ATTENTION_MASS_KWARG: mass},
        )
    if mass.layers == 0:
        raise ValueError(
            f"{type(model).__name__}: its attention does not take {ATTENTION_MASS_KWARG}"
        )
    return mass.total


@dataclass(frozen=True, slots=True)
class AttentionRecompute:
    """The recompute of one composed block's copied tokens (``run_executor.Refiner``),
    ranked by the attention of ``following`` (:func:`following_tokens`)."""

    model: PreTrainedModel
    ratio: float
    following: tuple[int, ...]
    chunk: int = DEFAULT_PREFILL_CHUNK

    def recomputed(self, length: int) -> int:
        return recompute_count(self.ratio, length) if self.following else 0

    def __call__(self, buffers: KVBuffers, tokens: Sequence[int], run: Run) -> list[int]:
        """Apply the definition to ``run`` (the copied tokens, already placed in
        ``buffers`` with everything before them); returns the recomputed positions."""
        start, end = run.new_start, run.new_end
        count = self.recomputed(end - start)
        if count == 0:
            return []
        scores = attention_scores(
            self.model, buffers, end, self.following, start, end, chunk=self.chunk
        )
        positions = [start + i for i in select_largest(scores, count)]
        toks = [tokens[p] for p in positions]
        forward_at(self.model, buffers, positions, toks, chunk=self.chunk, by_runs=False)
        return positions
