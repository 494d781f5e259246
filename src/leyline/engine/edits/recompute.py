"""COMPOSE's selective recompute, ``{"mode": "deviation", "ratio": r}`` (after CacheBlend).

A composed block's copied tokens (past its seam) never attended to the context they land
in. Recomputing all of them is a prefill; this recomputes the fraction whose KV the new
context changes most, chosen at an early layer where every block token's in-context KV is
cheap to get.

Definition. The block's copied tokens sit at positions ``[a, b)`` of the new sequence
(``a = at + k`` past the seam of ``k`` tokens, ``b = at + L``), ``m = b - a`` of them; every
position before ``a`` already holds its final KV, and ``[a, b)`` holds the skill's KV with
keys rotated to those positions (the plain compose). With ``s = max(min(S, layers - 2), 1)``
(``S`` the engine's ``recompute_selection_layer``, default :data:`SELECTION_LAYER` = 4; a
one-layer model uses layer 0):

1. **Early layers in context.** Tokens ``[a, b)`` are prefilled in place through decoder
   layers ``0..s`` only, attending to everything before them and causally to each other:
   at layers ``0..s`` every copied token now holds its in-context KV (what a prefill of the
   whole new sequence computes there). Layers past ``s`` keep the rotated skill KV.
2. **Deviation.** At layer ``s``, for each token ``j`` and each cache tensor ``c`` of the
   layer (GQA: keys, values; MLA: latent, rope band),
   ``d_c(j) = ||x_c(j) - y_c(j)||^2 / mean_i ||y_c(i)||^2`` with ``x`` its in-context KV,
   ``y`` the rotated skill KV and the mean over the block's ``m`` tokens (so every tensor
   weighs the same whatever its scale); ``d(j) = sum_c d_c(j)``. Layer 0 is never the
   selection layer: there a key or value depends only on its token and position, so ``d``
   is rounding noise.
3. **Selection.** The ``n = recompute_count(r, m) = ceil(r * m)`` tokens of largest ``d``
   (ties: the earlier position first).
4. **Recompute.** The selected tokens are run through every layer at their own positions
   (:func:`partial_forward.forward_scattered`): at each layer their new KV replaces theirs
   at their positions, and each attends to every position up to its own as the cache then
   holds it (the final KV before ``a``; in-context KV at layers ``0..s`` and rotated skill
   KV past ``s`` for unselected block tokens; the recomputed KV of selected ones). At
   layers ``0..s`` this reproduces step 1's values (up to rounding).

Unselected tokens keep the rotated skill KV at layers past ``s``. With ``r = 1`` every
copied token is recomputed against exactly what a prefill sees: the block equals a prefill
of the new sequence (up to rounding). Cost: ``s + 1`` layers of the block's prefill plus
``n`` tokens' forward, attention over at most ``b`` positions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from leyline.engine.forward import DEFAULT_PREFILL_CHUNK, KVBuffers
from leyline.engine.partial_forward import decoder_layers, forward_scattered, forward_through
from leyline.protocol.algebra import Run

SELECTION_LAYER = 4
"""The decoder layer whose in-context KV ranks the tokens (0-based: the fifth). Layer 1 is
the first whose KV depends on the context, but on SmolLM2 ranking at layer 4 gave a lower KL
for 52 of 72 held-out compose items (geometric mean 0.79x of layer 1's; layer 8: 1.20x), for
3 more layers of the block's prefill: docs/evals-compose.md, "The selection layer"."""


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
        forward_scattered(
            self.model, buffers, [tokens[p] for p in positions], positions, chunk=self.chunk
        )
        return positions
