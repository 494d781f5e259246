"""Model forward over the engine's KV, writing new entries into preallocated buffers.

The engine keeps KV as ``KVCache`` (a tuple over layers of ``(keys, values)``, the prefix
cache's format). transformers' ``DynamicLayer`` concatenates on every update: a decode step
at 4k tokens copies the whole cache, a chunked prefill copies it once per chunk. Here a
``BufferedLayer`` writes each new entry into a buffer sized for the final length instead,
and hands the model views of what is filled.

Buffers belong to the operation that allocates them (a prefill, a splice, a generation);
the KV a session already holds is only ever read, so a failed operation leaves it bitwise
unchanged.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from leyline.engine.cpu.fused_forward import decode_rows
from leyline.engine.kv.kv_blocks import KVCache
from leyline.engine.yield_points import chunk_boundary

DEFAULT_PREFILL_CHUNK = 512

KVBuffers = list[list[torch.Tensor]]
"""Per layer, per slot: a tensor ``[..., capacity, dim]``; filled up to some length."""


class BufferedLayer(DynamicLayer):  # type: ignore[no-untyped-call]  # unannotated __init_subclass__
    """A cache layer whose ``update`` writes into a fixed-capacity buffer, in place."""

    def __init__(self, slots: list[torch.Tensor] | None, length: int, capacity: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # transformers' is unannotated
        self.slots, self.length, self.capacity = slots, length, capacity
        if slots is not None:
            # never past the buffers' own room: a write there would be an empty slice,
            # which ``copy_`` takes silently (a length-1 source broadcasts to length 0)
            self.capacity = min(capacity, *(t.shape[-2] for t in slots))
            self.is_initialized = True
            self.device = slots[0].device
            self.keys, self.values = (t[..., :length, :] for t in slots)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = key_states.shape[-2]
        if self.slots is None:  # first tokens of an empty cache: allocate for the final length
            self.slots = [
                torch.empty(
                    (*t.shape[:-2], self.capacity, t.shape[-1]), dtype=t.dtype, device=t.device
                )
                for t in (key_states, value_states)
            ]
            self.is_initialized, self.device = True, key_states.device
        if self.length + n > self.capacity:
            raise ValueError(f"buffer holds {self.capacity} positions, {self.length + n} needed")
        end = self.length + n
        self.slots[0][..., self.length : end, :].copy_(key_states)
        self.slots[1][..., self.length : end, :].copy_(value_states)
        self.length = end
        self.keys, self.values = (t[..., :end, :] for t in self.slots)
        return self.keys, self.values


def kv_length(kv: KVCache) -> int:
    return 0 if not kv else int(kv[0][0].shape[-2])


def new_buffers(kv: KVCache, capacity: int) -> KVBuffers:
    """Empty buffers shaped like ``kv``'s tensors, with room for ``capacity`` positions."""
    return [
        [
            torch.empty((*t.shape[:-2], capacity, t.shape[-1]), dtype=t.dtype, device=t.device)
            for t in layer
        ]
        for layer in kv
    ]


def buffers_holding(kv: KVCache, capacity: int) -> KVBuffers:
    """New buffers with room for ``capacity`` positions, ``kv`` copied into their start."""
    length = kv_length(kv)
    buffers = new_buffers(kv, capacity)
    for layer, slots in zip(kv, buffers, strict=True):
        for src, dst in zip(layer, slots, strict=True):
            dst[..., :length, :].copy_(src)
    return buffers


def filled(buffers: KVBuffers, length: int) -> KVCache:
    """Views of the first ``length`` positions."""
    return tuple(tuple(t[..., :length, :] for t in layer) for layer in buffers)


@torch.no_grad()
def forward_into(
    model: PreTrainedModel,
    buffers: KVBuffers,
    length: int,
    tokens: Sequence[int],
    *,
    capacity: int | None = None,
    chunk: int = DEFAULT_PREFILL_CHUNK,
) -> torch.Tensor:
    """Run ``tokens`` at positions ``length, length+1, ...`` attending to the first ``length``
    buffered positions; their KV is written into the buffers. Returns fp32 next-token logits.

    ``buffers`` may be an empty list (nothing cached yet): it is filled in, allocated for
    ``capacity`` positions (default ``length + len(tokens)``). Positions are cache indices:
    the engine keeps them contiguous, a splice re-rotates moved keys instead of leaving gaps.
    """
    if not tokens:
        raise ValueError("forward_into needs at least one token")
    if buffers and len(tokens) == 1:  # a decode step: the fused loop where it applies
        stepped = decode_rows(model, [(buffers, length, tokens[0])])
        if stepped is not None:
            return stepped[0]
    cap = capacity if capacity is not None else length + len(tokens)
    layers = [BufferedLayer(slots, length, cap) for slots in buffers]
    cache = DynamicCache()
    if layers:
        cache.layers.extend(layers)
    else:  # created by the model on first use, one per layer
        cache.layer_class_to_replicate = lambda: BufferedLayer(None, length, cap)  # type: ignore[assignment]
    device = model.device
    logits: torch.Tensor | None = None
    for lo in range(0, len(tokens), chunk):
        if lo:
            chunk_boundary()  # a scheduler may run other work here (``yield_points``)
        ids = torch.tensor([list(tokens[lo : lo + chunk])], dtype=torch.long, device=device)
        pos = torch.arange(length + lo, length + lo + ids.shape[1], device=device).unsqueeze(0)
        out = model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=1)
        logits = out.logits[0, -1]
    if not buffers:
        buffers.extend(layer.slots for layer in cache.layers)  # type: ignore[union-attr]
    assert logits is not None
    return logits.float()


class PlacedLayer(DynamicLayer):  # type: ignore[no-untyped-call]  # unannotated __init_subclass__
    """A cache layer over buffers already holding every position up to ``total``: ``update``
    writes the new entries at ``index`` (any positions, in place) and hands the model all
    ``total`` positions; the attention mask says which of them each query sees."""

    def __init__(self, slots: list[torch.Tensor], index: torch.Tensor, total: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # transformers' is unannotated
        self.slots, self.index = slots, index
        self.is_initialized, self.device = True, slots[0].device
        keys, values = (t[..., :total, :] for t in slots)
        self.keys, self.values, self.whole = keys, values, (keys, values)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        for slot, new in zip(self.slots, (key_states, value_states), strict=True):
            slot.index_copy_(slot.dim() - 2, self.index, new.to(slot.dtype))
        return self.whole


QUERY_RUNS_KWARG = "leyline_query_runs"
"""The model-forward keyword that tells the engine's attention (``attention``) where each
run of consecutive query positions ends, so it reads only the keys each run can see."""


def query_runs(positions: Sequence[int]) -> tuple[tuple[int, int, int], ...]:
    """``(first, end, keys)`` per run of consecutive positions: queries ``[first, end)`` of
    the forward see keys ``[0, keys)`` (the run's last position + 1), causally within it."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(positions) + 1):
        if i == len(positions) or positions[i] != positions[i - 1] + 1:
            runs.append((start, i, positions[i - 1] + 1))
            start = i
    return tuple(runs)


def causal_mask_at(
    positions: torch.Tensor, total: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Additive mask ``[1, 1, len(positions), total]``: a query at position p sees every
    buffered position up to p (transformers passes a 4D mask through as it is)."""
    keys = torch.arange(total, device=device)
    hidden = keys.unsqueeze(0) > positions.unsqueeze(1)
    mask = torch.zeros(hidden.shape, dtype=dtype, device=device)
    mask.masked_fill_(hidden, torch.finfo(dtype).min)
    return mask[None, None]


@torch.no_grad()
def forward_at(
    model: PreTrainedModel,
    buffers: KVBuffers,
    positions: Sequence[int],
    tokens: Sequence[int],
    total: int,
    *,
    chunk: int = DEFAULT_PREFILL_CHUNK,
) -> torch.Tensor:
    """Run ``tokens`` at ``positions`` (strictly increasing, any gaps) of buffers that hold
    the other positions of ``[0, total)`` already; their KV is written in place. Each token
    attends to every position up to its own, exactly as if the sequence had been prefilled
    in order, so runs scattered over a spliced sequence (a replacement and the last token,
    say) cost one pass over the weights instead of one each. Returns the last token's fp32
    next-token logits.
    """
    if not tokens or len(tokens) != len(positions):
        raise ValueError(f"{len(tokens)} tokens for {len(positions)} positions")
    if any(b <= a for a, b in itertools.pairwise(positions)) or positions[-1] >= total:
        raise ValueError(f"positions must increase and stay below {total}")
    device = model.device
    dtype = buffers[0][0].dtype
    logits: torch.Tensor | None = None
    for lo in range(0, len(tokens), chunk):
        if lo:
            chunk_boundary()
        pos = torch.tensor(list(positions[lo : lo + chunk]), dtype=torch.long, device=device)
        ids = torch.tensor([list(tokens[lo : lo + chunk])], dtype=torch.long, device=device)
        # The chunk's queries see nothing past its last position; the slots there may belong
        # to later chunks, not written yet: uninitialised memory (NaN poisons even a masked
        # score), so they are never read.
        seen = positions[min(lo + chunk, len(positions)) - 1] + 1
        cache = DynamicCache()
        cache.layers.extend(PlacedLayer(slots, pos, seen) for slots in buffers)
        mask = causal_mask_at(pos, seen, dtype, device)
        chunk_positions = positions[lo : lo + chunk]
        out = model(
            input_ids=ids,
            position_ids=pos.unsqueeze(0),
            attention_mask=mask,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
            **{QUERY_RUNS_KWARG: query_runs(chunk_positions)},
        )
        logits = out.logits[0, -1]
    assert logits is not None
    return logits.float()


def forward_tokens(
    model: PreTrainedModel,
    kv: KVCache,
    tokens: Sequence[int],
    *,
    chunk: int = DEFAULT_PREFILL_CHUNK,
    reserve: int = 0,
) -> tuple[KVCache, torch.Tensor]:
    """New KV of ``kv`` followed by ``tokens`` (one copy of ``kv``), and the next-token logits.

    ``reserve``: positions of room left in the new buffers past the result (views of their
    start), e.g. for a generation to decode into without copying the cache again."""
    if reserve < 0:
        raise ValueError(f"reserve must be >= 0, got {reserve}")
    length = kv_length(kv)
    total = length + len(tokens)
    buffers = buffers_holding(kv, total + reserve)
    logits = forward_into(model, buffers, length, tokens, capacity=total + reserve, chunk=chunk)
    return filled(buffers, total), logits


@torch.no_grad()
def prefill_at(model: PreTrainedModel, tokens: Sequence[int], start: int) -> KVCache:
    """KV of ``tokens`` prefilled from scratch at positions ``start, start+1, ...``, with
    transformers' own ``DynamicCache``: the independent reference for tests and the layout
    probe (attention is relative, so hidden states equal those at position 0 up to rounding).
    """
    cache = DynamicCache()
    ids = torch.tensor([list(tokens)], dtype=torch.long, device=model.device)
    pos = torch.arange(start, start + len(tokens), device=model.device).unsqueeze(0)
    model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=1)
    kv: list[tuple[torch.Tensor, torch.Tensor]] = []
    for layer in cache.layers:  # DynamicCache() fills DynamicLayers, all updated by the forward
        assert isinstance(layer, DynamicLayer)
        assert layer.keys is not None and layer.values is not None
        kv.append((layer.keys, layer.values))
    return tuple(kv)
