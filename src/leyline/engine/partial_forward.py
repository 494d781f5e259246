"""Two partial forwards over the engine's KV buffers, for COMPOSE's selective recompute.

* :func:`forward_through` prefills tokens in place, as ``forward.forward_into`` does, but
  stops after one decoder layer: the buffers of the later layers are left untouched.
* :func:`forward_scattered` runs tokens at increasing but not necessarily contiguous
  positions of a buffer already filled around them. At every layer their new KV is written
  at their own positions, then each query attends to every buffered position up to its own
  (a causal mask by position, not by query index). It is a chunked prefill of the same
  tokens in a sequence whose other positions are given as cached KV.

Both only write the positions they compute. They take the model's decoder layers from
``get_decoder().layers`` (:func:`decoder_layers`); a model without them has neither.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from contextlib import suppress

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from leyline.engine.forward import DEFAULT_PREFILL_CHUNK, BufferedLayer, KVBuffers


class _Stop(Exception):
    """Raised before the first layer :func:`forward_through` must not run."""


def decoder_layers(model: PreTrainedModel) -> torch.nn.ModuleList | None:
    """The model's decoder layers in order, or None when they cannot be found."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    layers = getattr(decoder, "layers", None)
    expected = getattr(model.config, "num_hidden_layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) != expected:
        return None
    return layers


def _layers(model: PreTrainedModel) -> torch.nn.ModuleList:
    layers = decoder_layers(model)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no decoder layers found for a partial forward")
    return layers


@torch.no_grad()
def forward_through(
    model: PreTrainedModel,
    buffers: KVBuffers,
    length: int,
    tokens: Sequence[int],
    last_layer: int,
    *,
    chunk: int = DEFAULT_PREFILL_CHUNK,
) -> None:
    """Prefill ``tokens`` at positions ``length, length+1, ...`` through decoder layers
    ``0..last_layer`` only, attending to the first ``length`` buffered positions; their KV
    is written into those layers' buffers. Later layers are not run.

    The stop is a pre-hook on layer ``last_layer + 1`` that raises; it fires only on the
    calling thread (the model may be shared) and is removed before returning.
    """
    if not tokens:
        raise ValueError("forward_through needs at least one token")
    layers = _layers(model)
    if not 0 <= last_layer < len(layers) or len(buffers) != len(layers):
        raise ValueError(f"layer {last_layer} of {len(layers)}; {len(buffers)} buffered layers")
    caller = threading.get_ident()

    def stop(*_: object) -> None:
        if threading.get_ident() == caller:
            raise _Stop

    hook = (
        layers[last_layer + 1].register_forward_pre_hook(stop)
        if last_layer + 1 < len(layers)
        else None
    )
    try:
        capacity = int(buffers[0][0].shape[-2])
        cache = DynamicCache()
        cache.layers.extend(BufferedLayer(slots, length, capacity) for slots in buffers)
        for lo in range(0, len(tokens), chunk):
            ids = torch.tensor(
                [list(tokens[lo : lo + chunk])], dtype=torch.long, device=model.device
            )
            start = length + lo
            pos = torch.arange(start, start + ids.shape[1], device=model.device).unsqueeze(0)
            with suppress(_Stop):  # then layers 0..last_layer hold the chunk; the rest never ran
                model(
                    input_ids=ids, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=1
                )
    finally:
        if hook is not None:
            hook.remove()


class ScatterLayer(DynamicLayer):  # type: ignore[no-untyped-call]  # unannotated __init_subclass__
    """A cache layer that writes new entries at given positions of a filled buffer and shows
    the model its first ``visible`` positions."""

    def __init__(self, slots: list[torch.Tensor], index: torch.Tensor, visible: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # transformers' is unannotated
        self.slots, self.index = slots, index
        self.is_initialized, self.device = True, slots[0].device
        self.shown = (slots[0][..., :visible, :], slots[1][..., :visible, :])
        self.keys, self.values = self.shown

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        for dst, src in zip(self.slots, (key_states, value_states), strict=True):
            dst.index_copy_(dst.dim() - 2, self.index, src.to(dst.dtype))
        return self.shown  # views: they see what was just written


def causal_mask(positions: torch.Tensor, visible: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask ``[1, 1, queries, visible]``: query at position p sees positions <= p."""
    keys = torch.arange(visible, device=positions.device)
    allowed = keys.unsqueeze(0) <= positions.unsqueeze(1)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=positions.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


@torch.no_grad()
def forward_scattered(
    model: PreTrainedModel,
    buffers: KVBuffers,
    tokens: Sequence[int],
    positions: Sequence[int],
    *,
    chunk: int = DEFAULT_PREFILL_CHUNK,
) -> torch.Tensor:
    """Run ``tokens`` at ``positions`` (strictly increasing) of ``buffers``, whose other
    positions up to the last one hold KV already; every layer's entries at ``positions``
    are overwritten with the new KV. Returns the last token's fp32 next-token logits.

    Chunks go in position order: a chunk's queries see earlier chunks' new KV and nothing
    after their own positions, so chunking does not change the result.
    """
    if not tokens or len(tokens) != len(positions):
        raise ValueError(f"{len(tokens)} tokens at {len(positions)} positions")
    if any(b <= a for a, b in itertools.pairwise(positions)) or positions[0] < 0:
        raise ValueError("positions must be non-negative and strictly increasing")
    capacity = int(buffers[0][0].shape[-2])
    if positions[-1] >= capacity:
        raise ValueError(f"position {positions[-1]} is outside the {capacity}-position buffer")
    device = model.device
    dtype = model.dtype  # the attention scores' dtype
    logits: torch.Tensor | None = None
    for lo in range(0, len(tokens), chunk):
        pos = torch.tensor(list(positions[lo : lo + chunk]), dtype=torch.long, device=device)
        visible = int(pos[-1]) + 1
        cache = DynamicCache()
        cache.layers.extend(ScatterLayer(slots, pos, visible) for slots in buffers)
        ids = torch.tensor([list(tokens[lo : lo + chunk])], dtype=torch.long, device=device)
        out = model(
            input_ids=ids,
            position_ids=pos.unsqueeze(0),
            attention_mask=causal_mask(pos, visible, dtype),
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        logits = out.logits[0, -1]
    assert logits is not None
    return logits.float()
