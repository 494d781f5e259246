"""COMPOSE's selective recompute ``{"mode": "attention", "ratio": r}``: recompute what the
tokens after the block read.

Deviation recompute (``recompute``) ranks a block's copied tokens by how much the new
context changes their KV, whatever is asked next. This mode ranks them by how much the
tokens that follow the block in the request (a turn's question, its chat markup) attend to
them, so the share recomputed is the part the answer reads. On SmolLM2 it lowered the KL
against a full prefill 2-20x below the plain compose's on tool specs, about 2x on rules
and passages (docs/evals-compose.md).

Definition. The block's copied tokens sit at ``[a, b)`` (past its seam), placed as the plain
compose places them; every position before ``a`` holds its final KV. The *following
tokens* ``F`` are the first :data:`ATTENTION_WINDOW` tokens after the block in the sequence
the request goes on to: a turn's prompt when its first ``b`` tokens are the new
revision's, the new revision's tokens otherwise (an ``apply`` batch). Then:

1. **Scores.** ``F`` is run at positions ``b, b+1, ...`` over the cache ``[0, b)`` as it
   now is (causally among themselves; their KV is discarded), with exact softmax attention
   in fp32. Each copied token ``j`` scores the weight all queries of ``F`` give position
   ``j``, summed over heads and layers.
2. **Selection.** The ``ceil(r * (b - a))`` tokens of largest score (ties: the earlier
   position), as ``recompute.select_largest``.
3. **Recompute.** As deviation recompute's step 4: the selected tokens run through every
   layer at their positions (``partial_forward.forward_scattered``), each attending to the
   cache as it then is.

With no following token (a block at the very end of an ``apply``), nothing past the seam is
recomputed. Cost: one forward of ``F`` (at most 256 tokens) over ``b`` keys, plus the
selected tokens' forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from leyline.engine.attention_mass import ATTENTION_MASS_KWARG, AttentionMass
from leyline.engine.edits.recompute import recompute_count, select_largest
from leyline.engine.forward import DEFAULT_PREFILL_CHUNK, KVBuffers
from leyline.engine.partial_forward import forward_scattered
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
        forward_scattered(
            self.model, buffers, [tokens[p] for p in positions], positions, chunk=self.chunk
        )
        return positions
