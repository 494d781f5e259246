"""An edit batch executed inside the session's own KV buffers: forward first, move after.

The copy path (``run_executor``) writes the new KV into a new buffer, so old and new KV
coexist while it runs. A session whose buffers nobody else holds edits them in place: (1)
every computed token runs in one forward whose KV goes to a small side buffer, queries
reading kept KV where it lies (``segment_attention``), so a failure leaves the session
unchanged; (2) moved kept runs shift to their new positions, keys rotated bitwise as the
copy path rotates them, then the side entries are written. docs/engine.md has the details
and the batches left to the copy path (:func:`edit_in_place` returns None for those).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from leyline.engine.cpu.fused_forward import fused_model
from leyline.engine.forward import (
    BufferedLayer,
    Chunk,
    Forwards,
    KVBuffers,
    causal_mask_at,
    query_runs,
    run_chunks,
)
from leyline.engine.kv.buffer_views import capacity, resized
from leyline.engine.kv.kv_blocks import KVCache
from leyline.engine.kv.layouts import CacheLayout
from leyline.engine.rope import RopeSpec, delta_rotate, move_rotated, move_rows, rotate_many_into
from leyline.engine.segment_attention import (
    SEGMENTS_KWARG,
    KeptSegment,
    RotateQuery,
    SegmentPlan,
    SegmentRun,
    prepare_plan,
)
from leyline.protocol.algebra import EditResult, Run

MIN_DIRECT = 64
"""Shortest ``|delta|`` moved piece by piece in place; below it, through the bounce buffer."""
BOUNCE = 256
"""Positions per piece of a move through the bounce buffer."""


@dataclass(frozen=True, slots=True)
class InPlaceOutcome:
    kv: KVCache
    """Views of the session's own buffers, now holding the new sequence."""
    logits: torch.Tensor | None
    rerun: bool
    """Whether the last token was run again for its logits."""


def in_place_layout(layout: CacheLayout | None, rope: RopeSpec | None, grouped: bool) -> bool:
    """Whether a model with this cache layout can edit in place: grouped-query keys (the
    query's rotary band is the key's, so a counter-rotation is exact), and the engine's own
    attention function (``grouped``), which is where the segments are read."""
    return grouped and layout is not None and rope is not None and layout.kind == "gqa"


def edit_in_place(
    forwards: Forwards,
    layout: CacheLayout,
    rope: RopeSpec,
    kv: KVCache,
    result: EditResult,
    *,
    want_logits: bool,
) -> InPlaceOutcome | None:
    """Execute ``result`` (an edit of the sequence ``kv`` holds) inside ``kv``'s buffers, or
    return None, having touched nothing, when they cannot take it (module docstring). The
    caller guarantees that nobody else reads these buffers."""
    total = len(result.tokens)
    if not kv or total == 0 or not result.runs:
        return None
    if not any(r.kind == "kept" and r.new_start >= result.first_change for r in result.runs):
        return None  # nothing kept after the change (FORGET, an append): the copy path's

    caps = [capacity(t) for layer in kv for t in layer]
    if any(c is None or c < total for c in caps):
        return None
    runs = result.runs
    rerun = want_logits and runs[-1].kind == "kept"
    positions = [p for r in runs if r.kind != "kept" for p in range(r.new_start, r.new_end)]
    if rerun:
        positions.append(total - 1)
    logits = None
    side: KVBuffers = []
    if positions:
        side = [[torch.empty(_side_shape(t, len(positions)), dtype=t.dtype) for t in layer]
                for layer in kv]  # fmt: skip
        tokens = [result.tokens[p] for p in positions]
        logits = _forward_beside(forwards, layout, rope, kv, side, runs, positions, tokens)
    # -- phase 2: nothing below can fail on valid input ---------------------------------------
    span = max(total, int(kv[0][0].shape[2]))  # views reaching a growing batch's new end
    _move_kept(tuple(tuple(resized(t, span) for t in layer) for layer in kv), runs, layout, rope)
    new_kv = tuple(tuple(resized(t, total) for t in layer) for layer in kv)
    if positions:
        index = torch.tensor(positions, dtype=torch.long)
        for layer, side_layer in zip(new_kv, side, strict=True):
            for dst, src in zip(layer, side_layer, strict=True):
                dst.index_copy_(2, index, src)
    ends_prefilled = runs[-1].kind != "kept"
    return InPlaceOutcome(new_kv, logits if ends_prefilled or rerun else None, rerun)


def _side_shape(t: torch.Tensor, n: int) -> tuple[int, ...]:
    return (*t.shape[:-2], n, t.shape[-1])


def segment_runs(
    runs: Sequence[Run], positions: Sequence[int], lo: int, hi: int
) -> tuple[SegmentRun, ...]:
    """The segments each run of consecutive query positions in ``positions[lo:hi]`` (a
    chunk of the forward) reads: every kept run before it (a kept run is either wholly
    before a query or wholly after it, except the last token run again, whose own old entry
    it replaces), and the side entries up to its own."""
    out: list[SegmentRun] = []
    for first, end, _ in query_runs(positions[lo:hi]):
        p0 = positions[lo + first]
        kept: list[KeptSegment] = []
        for r in runs:
            if r.kind != "kept" or r.new_start >= p0:
                continue
            assert r.old_start is not None
            seen = min(r.new_end, p0) - r.new_start
            kept.append(KeptSegment(r.old_start, r.old_start + seen, r.delta))
        out.append(SegmentRun(first, end, tuple(kept), lo + end))
    return tuple(out)


@torch.no_grad()
def _forward_beside(
    forwards: Forwards,
    layout: CacheLayout,
    rope: RopeSpec,
    kv: KVCache,
    side: KVBuffers,
    runs: Sequence[Run],
    positions: Sequence[int],
    tokens: Sequence[int],
) -> torch.Tensor:
    """Phase 1: the forward of ``tokens`` at ``positions``, their KV into ``side``."""

    def rotate(q: torch.Tensor, delta: int) -> torch.Tensor:
        return delta_rotate(q, delta, rope.inv_freq, layout.pairing, offset=layout.offset)

    model, chunk = forwards.model, forwards.chunk
    if len(tokens) <= chunk:  # a longer pass yields between its chunks: the model's forward
        direct = _fused_beside(model, kv, side, runs, positions, tokens, rotate)
        if direct is not None:
            return direct
    dtype = kv[0][0].dtype

    def prepare(lo: int, hi: int, pos: torch.Tensor) -> Chunk:
        cache = DynamicCache()  # the chunk's KV appended to the side entries so far
        cache.layers.extend(BufferedLayer(slots, lo, len(tokens)) for slots in side)
        # side entry j is visible to chunk query i when j <= lo + i (positions increase)
        mask = causal_mask_at(torch.arange(lo, hi, device=pos.device), hi, dtype, pos.device)
        plan = SegmentPlan(kv, segment_runs(runs, positions, lo, hi), rotate)
        return cache, mask, {SEGMENTS_KWARG: plan}

    return run_chunks(model, tokens, positions, prepare, chunk=chunk)


def _fused_beside(
    model: PreTrainedModel,
    kv: KVCache,
    side: KVBuffers,
    runs: Sequence[Run],
    positions: Sequence[int],
    tokens: Sequence[int],
    rotate: RotateQuery,
) -> torch.Tensor | None:
    """Phase 1 as one loop over the model's fused layers (``fused_forward``), each layer's
    attention prepared once for all layers (``segment_attention.prepare_plan``): the same
    computation as the model's forward, bitwise, without its Python. None where the model
    does not take it; the caller runs the model's forward."""
    fused = fused_model(model)
    if fused is None or len(tokens) > fused.max_rows:
        return None
    m = len(tokens)
    plan = SegmentPlan(kv, segment_runs(runs, positions, 0, m), rotate)
    mask = causal_mask_at(torch.arange(m, device=model.device), m, kv[0][0].dtype, model.device)
    prepared = prepare_plan(plan, side, mask, fused.heads, fused.scale)

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys, values = side[layer]
        keys[0, :, :m].copy_(k[0].transpose(0, 1))
        values[0, :, :m].copy_(v[0].transpose(0, 1))
        return prepared.attend(layer, q.transpose(1, 2))

    return fused.logits([tokens], [positions], attend)[0]


def _move_kept(kv: KVCache, runs: Sequence[Run], layout: CacheLayout, rope: RopeSpec) -> None:
    """Phase 2: every kept run that moved, to its new positions; ``kv`` views every position
    any run reads or writes. Runs moving left go left to right and runs moving right right
    to left, so no run overwrites another's source before it is read. The rope kernel moves
    a run in one sweep (``rope.move_rotated``, ``rope.move_rows``); without it, a run moves
    in pieces of at most ``|delta|`` positions that never meet their destination, or through
    a bounce buffer of :data:`BOUNCE` positions when ``|delta|`` is small."""
    moved = [r for r in runs if r.kind == "kept" and r.delta != 0]
    left = sorted((r for r in moved if r.delta < 0), key=lambda r: r.new_start)
    right = sorted((r for r in moved if r.delta > 0), key=lambda r: -r.new_start)
    for run in (*left, *right):
        _move_values(kv, run, layout.slot)
        _move_keys(kv, run, layout, rope)


def _pieces(run: Run, size: int) -> list[tuple[int, int]]:
    """``(offset, length)`` pieces of the run, in the order a move in its direction needs."""
    n = len(run)
    out = [(a, min(size, n - a)) for a in range(0, n, size)]
    return out if run.delta < 0 else out[::-1]


def _run_views(kv: KVCache, run: Run, slot: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(destination, source)`` views of the run in every layer's ``slot`` buffer."""
    assert run.old_start is not None
    src0, dst0, n = run.old_start, run.new_start, len(run)
    buffers = [layer[slot] for layer in kv]
    return [(t[:, :, dst0 : dst0 + n], t[:, :, src0 : src0 + n]) for t in buffers]


def _move_keys(kv: KVCache, run: Run, layout: CacheLayout, rope: RopeSpec) -> None:
    assert run.old_start is not None
    slot, d = layout.slot, run.delta
    src0, dst0 = run.old_start, run.new_start
    views = _run_views(kv, run, slot)
    if move_rotated(views, d, rope.inv_freq, layout.pairing, offset=layout.offset):
        return  # one sweep per head in the kernel, in the order the overlap allows
    if abs(d) >= MIN_DIRECT:
        for a, n in _pieces(run, abs(d)):
            pairs = [
                (t[:, :, dst0 + a : dst0 + a + n], t[:, :, src0 + a : src0 + a + n])
                for t in (layer[slot] for layer in kv)
            ]
            rotate_many_into(
                pairs, d, rope.inv_freq, layout.pairing, offset=layout.offset, disjoint=True
            )
        return
    bounce = [
        torch.empty(_side_shape(layer[slot], BOUNCE), dtype=layer[slot].dtype) for layer in kv
    ]
    for a, n in _pieces(run, BOUNCE):
        pairs = [(tmp[:, :, :n], layer[slot][:, :, src0 + a : src0 + a + n])
                 for tmp, layer in zip(bounce, kv, strict=True)]  # fmt: skip
        rotate_many_into(pairs, d, rope.inv_freq, layout.pairing, offset=layout.offset)
        for tmp, layer in zip(bounce, kv, strict=True):
            layer[slot][:, :, dst0 + a : dst0 + a + n].copy_(tmp[:, :, :n])


def _move_values(kv: KVCache, run: Run, key_slot: int) -> None:
    """Every slot but the keys, moved bitwise: by the kernel's row move, else one
    ``memmove`` per head (a head's positions are contiguous in the buffer, and ``memmove``
    takes overlapping ranges)."""
    assert run.old_start is not None
    slots = [s for s in range(len(kv[0])) if s != key_slot]
    views = [view for s in slots for view in _run_views(kv, run, s)]
    if move_rows(views):
        return  # the kernel's bitwise row move, its threads over heads
    for layer in kv:
        for s, t in enumerate(layer):
            if s == key_slot:
                continue
            cap = capacity(t)
            assert cap is not None  # checked before phase 1
            row = t.shape[3] * t.element_size()
            base = t.data_ptr()
            for h in range(t.shape[1]):
                head = base + h * cap * row
                ctypes.memmove(
                    head + run.new_start * row, head + run.old_start * row, len(run) * row
                )
