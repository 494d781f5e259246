"""Model forwards over the engine's KV buffers, written in place instead of concatenated.

The engine keeps KV as ``KVCache`` (per layer, ``(keys, values)`` views of the start of
buffers sized for the final length). transformers' ``DynamicLayer`` concatenates on every
update; the two layers here write into those buffers instead: :class:`BufferedLayer` after
the filled positions, :class:`PlacedLayer` at any positions of filled buffers.

Every forward is :func:`run_chunks`: tokens at given positions, chunk by chunk, a
scheduler free to run other work between chunks. A buffer belongs to the operation that
allocated it; a session's own KV is only read, so a failed operation leaves it unchanged.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from leyline.engine.cpu.fused_forward import decode_rows
from leyline.engine.kv.kv_blocks import KVCache
from leyline.engine.yield_points import chunk_boundary

DEFAULT_PREFILL_CHUNK = 512

KVBuffers = list[list[torch.Tensor]]
"""Per layer, per slot: a tensor ``[..., capacity, dim]``; filled up to some length."""

QUERY_RUNS_KWARG = "leyline_query_runs"
"""The model-forward keyword that tells the engine's attention (``attention``) where each
run of consecutive query positions ends, so it reads only the keys each run can see."""


class BufferedLayer(DynamicLayer):  # type: ignore[no-untyped-call]  # unannotated __init_subclass__
    """A cache layer whose ``update`` writes after its ``length`` filled positions, in place,
    and shows the model everything filled so far. ``slots`` None: allocated on first use."""

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


Chunk = tuple[DynamicCache, torch.Tensor | None, dict[str, object]]
"""What one chunk of a forward runs with: its cache, its attention mask (None: the model's
causal one) and extra model-forward keywords."""

PrepareChunk = Callable[[int, int, torch.Tensor], Chunk]
"""The :data:`Chunk` for tokens ``[lo, hi)`` of a forward, given their position tensor."""


@torch.no_grad()
def run_chunks(
    model: PreTrainedModel,
    tokens: Sequence[int],
    positions: Sequence[int],
    prepare: PrepareChunk,
    *,
    chunk: int = DEFAULT_PREFILL_CHUNK,
) -> torch.Tensor:
    """Run ``tokens`` at ``positions``, ``chunk`` at a time, each chunk with the cache and
    mask ``prepare`` gives it; the scheduler may run other work between chunks
    (``yield_points``). Returns the last token's fp32 next-token logits."""
    device = model.device
    logits: torch.Tensor | None = None
    for lo in range(0, len(tokens), chunk):
        if lo:
            chunk_boundary()
        hi = min(lo + chunk, len(tokens))
        pos = torch.tensor(list(positions[lo:hi]), dtype=torch.long, device=device)
        ids = torch.tensor([list(tokens[lo:hi])], dtype=torch.long, device=device)
        cache, mask, extra = prepare(lo, hi, pos)
        out = model(
            input_ids=ids,
            position_ids=pos.unsqueeze(0),
            attention_mask=mask,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
            **extra,
        )
        logits = out.logits[0, -1]
    assert logits is not None
    return logits.float()


def appending(buffers: KVBuffers, length: int, capacity: int) -> tuple[DynamicCache, PrepareChunk]:
    """One cache of :class:`BufferedLayer` for every chunk of a forward that appends after
    ``length`` (``buffers`` empty: allocated for ``capacity`` positions on first use)."""
    cache = DynamicCache()
    if buffers:
        cache.layers.extend(BufferedLayer(slots, length, capacity) for slots in buffers)
    else:  # created by the model on first use, one per layer
        cache.layer_class_to_replicate = lambda: BufferedLayer(None, length, capacity)  # type: ignore[assignment]
    return cache, lambda lo, hi, pos: (cache, None, {})


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
    cache, prepare = appending(buffers, length, cap)
    positions = range(length, length + len(tokens))
    logits = run_chunks(model, tokens, positions, prepare, chunk=chunk)
    if not buffers:
        buffers.extend(layer.slots for layer in cache.layers)  # type: ignore[union-attr]
    return logits


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


def forward_at(
    model: PreTrainedModel,
    buffers: KVBuffers,
    positions: Sequence[int],
    tokens: Sequence[int],
    total: int | None = None,
    *,
    chunk: int = DEFAULT_PREFILL_CHUNK,
    by_runs: bool = True,
) -> torch.Tensor:
    """Run ``tokens`` at ``positions`` (strictly increasing, any gaps) of buffers that hold
    the other positions of ``[0, total)`` already (default: the buffers' capacity); their
    KV is written in place. Each token attends to every position up to its own, exactly as
    if the sequence had been prefilled in order: runs scattered over a spliced sequence cost
    one pass over the weights instead of one each. Returns the last token's fp32 logits.

    ``by_runs``: the attention reads only the keys each run of consecutive positions sees
    (``QUERY_RUNS_KWARG``); False: one masked attention over them all (selective recompute).
    """
    if not tokens or len(tokens) != len(positions):
        raise ValueError(f"{len(tokens)} tokens for {len(positions)} positions")
    end = int(buffers[0][0].shape[-2]) if total is None else total
    increasing = all(b > a for a, b in itertools.pairwise(positions))
    if not increasing or positions[0] < 0 or positions[-1] >= end:
        raise ValueError(f"positions must increase from 0 and stay below {end}")
    dtype = buffers[0][0].dtype

    def prepare(lo: int, hi: int, pos: torch.Tensor) -> Chunk:
        # The chunk's queries see nothing past its last position; the slots there may belong
        # to later chunks, not written yet: uninitialised memory (NaN poisons even a masked
        # score), so they are never read.
        seen = positions[hi - 1] + 1
        cache = DynamicCache()
        cache.layers.extend(PlacedLayer(slots, pos, seen) for slots in buffers)
        runs: dict[str, object] = (
            {QUERY_RUNS_KWARG: query_runs(positions[lo:hi])} if by_runs else {}
        )
        return cache, causal_mask_at(pos, seen, dtype, pos.device), runs

    return run_chunks(model, tokens, positions, prepare, chunk=chunk)


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


@dataclass(frozen=True, slots=True)
class Forwards:
    """The model's forwards over KV buffers at the engine's prefill chunk: what an edit runs
    tokens with (the engine owns one; ``Engine.forwards``)."""

    model: PreTrainedModel
    chunk: int = DEFAULT_PREFILL_CHUNK

    def tokens(
        self, kv: KVCache, tokens: Sequence[int], *, reserve: int = 0
    ) -> tuple[KVCache, torch.Tensor]:
        """:func:`forward_tokens`: new KV of ``kv`` + ``tokens`` and next-token logits."""
        return forward_tokens(self.model, kv, tokens, chunk=self.chunk, reserve=reserve)

    def into(self, buffers: KVBuffers, length: int, tokens: Sequence[int]) -> torch.Tensor:
        """:func:`forward_into`: ``tokens`` prefilled in place after ``length`` positions."""
        return forward_into(self.model, buffers, length, tokens, chunk=self.chunk)

    def at(
        self,
        buffers: KVBuffers,
        positions: Sequence[int],
        tokens: Sequence[int],
        total: int | None = None,
        *,
        by_runs: bool = True,
    ) -> torch.Tensor:
        """:func:`forward_at`: ``tokens`` at scattered ``positions`` of filled buffers."""
        return forward_at(
            self.model, buffers, positions, tokens, total, chunk=self.chunk, by_runs=by_runs
        )


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
