"""COMPOSE's selective recompute ``{"mode": "deviation", "ratio": r}`` (after CacheBlend).

A composed block's copied tokens never attended to the context they land in; recomputing
all of them is a prefill. This recomputes the fraction whose KV the new context changes
most, ranked at an early layer where their in-context KV is cheap to get: prefill the
block through layers ``0..s`` (``partial_forward``), rank by deviation from the copy, run
the chosen tokens through every layer (``forward.forward_at``). The definition, step by
step: docs/engine.md, "Selective recompute".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from leyline.engine.forward import DEFAULT_PREFILL_CHUNK, KVBuffers, forward_at
from leyline.engine.partial_forward import decoder_layers, forward_through
from leyline.protocol.algebra import Run

SELECTION_LAYER = 4
"""The decoder layer whose in-context KV ranks the tokens (0-based: the fifth). Layer 1 is
the first whose KV depends on the context; a later one ranks better on SmolLM2 for a few
more layers of the block's prefill (docs/reports/eval-compose.md, "The selection layer")."""


def recompute_count(ratio: float, tokens: int) -> int:
    """``ceil(ratio * tokens)``, at least one when there are tokens; the product is rounded
    to 9 decimals first so that e.g. 0.15 of 20 is 3, not 4."""
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"ratio must be in (0, 1], got {ratio}")
    if tokens <= 0:
        return 0
    return max(1, min(tokens, math.ceil(round(ratio * tokens, 9))))


def selection_layer(layers: int, wanted: int = SELECTION_LAYER) -> int:
    """``wanted``, capped below the last of ``layers`` (a selection at the last layer would
    have prefilled every layer in context already) and never below layer 1 when there is
    one (layer 0's KV does not depend on the context)."""
    return max(min(wanted, layers - 2), min(1, layers - 1))


def kv_deviation(
    in_context: Sequence[torch.Tensor], rotated: Sequence[torch.Tensor]
) -> torch.Tensor:
    """``d(j)`` of the definition, fp64 ``[m]``: the tensors are one layer's slots restricted
    to the block, ``[..., m, dim]``."""
    total: torch.Tensor | None = None
    for x, y in zip(in_context, rotated, strict=True):
        m = y.shape[-2]
        diff = (x.double() - y.double()).pow(2).movedim(-2, 0).reshape(m, -1).sum(1)
        scale = y.double().pow(2).movedim(-2, 0).reshape(m, -1).sum(1).mean().clamp_min(1e-300)
        total = diff / scale if total is None else total + diff / scale
    assert total is not None
    return total


def select_largest(scores: torch.Tensor, count: int) -> list[int]:
    """Indices of the ``count`` largest scores, ascending (ties: the lower index)."""
    order = torch.sort(scores, descending=True, stable=True).indices[:count]
    return sorted(int(i) for i in order)


def supports_deviation(model: PreTrainedModel) -> bool:
    """Whether the partial forwards can run on ``model`` (its decoder layers are found)."""
    return decoder_layers(model) is not None


@dataclass(frozen=True, slots=True)
class DeviationRecompute:
    """The recompute of one composed block's copied tokens (``run_executor.Refiner``)."""

    model: PreTrainedModel
    ratio: float
    layer: int = SELECTION_LAYER
    """The selection layer asked for (capped by :func:`selection_layer`)."""
    chunk: int = DEFAULT_PREFILL_CHUNK

    def __post_init__(self) -> None:
        if self.layer < 1:
            raise ValueError(f"the selection layer must be at least 1, got {self.layer}")

    def recomputed(self, length: int) -> int:
        return recompute_count(self.ratio, length)

    def __call__(self, buffers: KVBuffers, tokens: Sequence[int], run: Run) -> list[int]:
        """Apply the definition to ``run`` (the copied tokens, already placed in
        ``buffers``); returns the recomputed positions."""
        start, end = run.new_start, run.new_end
        layer = selection_layer(len(buffers), self.layer)
        rotated = [t[..., start:end, :].clone() for t in buffers[layer]]
        block = tokens[start:end]
        forward_through(self.model, buffers, start, block, layer, chunk=self.chunk)
        in_context = [t[..., start:end, :] for t in buffers[layer]]
        chosen = select_largest(kv_deviation(in_context, rotated), self.recomputed(end - start))
        positions = [start + i for i in chosen]
        toks = [tokens[p] for p in positions]
        forward_at(self.model, buffers, positions, toks, chunk=self.chunk, by_runs=False)
        return positions
