"""Execute an ``EditResult`` on a KV cache by copy: the edit algebra's runs, in order.

The new KV is one buffer per layer and slot for the new sequence: kept runs copied in (keys
rotated by their delta on the way), inserted runs computed in place against everything
before them. The runs say where everything goes; the old KV is only read, so a failure
midway changes nothing. COMPOSE reuses :func:`fill_runs` with kept runs read from a skill's
KV and optionally refined in context (docs/engine.md, "How a splice runs").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from leyline.engine.forward import Forwards, KVBuffers, filled, kv_length, new_buffers
from leyline.engine.kv.kv_blocks import KVCache
from leyline.engine.kv.layouts import CacheLayout
from leyline.engine.rope import RopeSpec, rotate_many_into
from leyline.protocol.algebra import EditResult, Run


@dataclass(frozen=True, slots=True)
class SpliceOutcome:
    kv: KVCache
    logits: torch.Tensor | None
    """Next-token logits after the new sequence, when its last run was prefilled."""
    exact_length: int
    """Length of the new sequence's prefix whose KV equals a fresh prefill's (up to
    rounding): everything before the first run that was kept across a change."""


class Refiner(Protocol):
    """Recomputes some entries of a kept run just placed, in context (everything before the
    run is final when it is called)."""

    def recomputed(self, length: int) -> int:
        """How many entries of a ``length``-token run it recomputes."""
        ...

    def __call__(self, buffers: KVBuffers, tokens: Sequence[int], run: Run) -> list[int]:
        """Recompute in ``buffers``; returns the positions recomputed."""
        ...


@dataclass(frozen=True, slots=True)
class SourcedRun:
    """A run of the new sequence; a kept one also names the KV its ``old_start`` indexes,
    and optionally what recomputes part of it once placed."""

    run: Run
    source: KVCache | None = None
    refine: Refiner | None = None

    @property
    def recomputed(self) -> int:
        return 0 if self.refine is None else self.refine.recomputed(len(self.run))


def slice_kv(kv: KVCache, start: int, end: int) -> KVCache:
    """Views of positions ``[start, end)`` (no copy)."""
    return tuple(tuple(t[..., start:end, :] for t in layer) for layer in kv)


def _place(
    buffers: KVBuffers,
    kv: KVCache,
    run: Run,
    layout: CacheLayout | None,
    rope: RopeSpec | None,
) -> None:
    """Write a kept run's old entries at its new positions, rotating its keys by delta (all
    layers' keys in one call: one fused kernel pass on CPU, see ``rope.rotate_many_into``)."""
    assert run.old_start is not None
    if run.delta and (layout is None or rope is None):
        raise ValueError("a kept run moves but the model has no rotatable layout")
    rotated: list[tuple[torch.Tensor, torch.Tensor]] = []
    for old_layer, new_layer in zip(kv, buffers, strict=True):
        for slot, (src, dst) in enumerate(zip(old_layer, new_layer, strict=True)):
            src = src[..., run.old_start : run.old_start + len(run), :]
            dst = dst[..., run.new_start : run.new_end, :]
            if run.delta and layout is not None and slot == layout.slot:
                rotated.append((dst, src))
            else:
                dst.copy_(src)
    if rotated and layout is not None and rope is not None:
        rotate_many_into(rotated, run.delta, rope.inv_freq, layout.pairing, offset=layout.offset)


def _exact_length(runs: Sequence[Run], first_change: int, old_exact: int) -> int:
    """Walk the runs while the new KV still equals a fresh prefill's."""
    exact = 0
    for run in runs:
        if run.kind != "kept":
            exact = run.new_end  # prefilled against an exact prefix: exact
            continue
        assert run.old_start is not None
        if run.new_start >= first_change:
            break  # kept across a change: it attended to the old context (AMORTIZE)
        if run.old_start + len(run) > old_exact:
            return run.new_start + max(0, old_exact - run.old_start)
        exact = run.new_end
    return exact


def fill_runs(
    forwards: Forwards,
    layout: CacheLayout | None,
    rope: RopeSpec | None,
    tokens: Sequence[int],
    runs: Sequence[SourcedRun],
    *,
    template: KVCache,
    want_logits: bool = False,
) -> tuple[KVCache, torch.Tensor | None, bool]:
    """The KV of ``tokens``, built run by run into one new buffer per layer and slot.

    ``template`` gives the buffers' shapes (any KV of this model). Returns the KV, the
    next-token logits when known, and whether the last token was run again for them
    (``want_logits`` with a sequence ending in a kept run: one decode step in the new
    buffer, no copy). Sources are only read.

    Without a refiner, every kept run is placed first and everything else (prefilled runs,
    the last token run again) goes through the model in one masked pass: the weights stream
    once per splice instead of once per run (see :func:`fused_plan`).
    """
    total = len(tokens)
    buffers = new_buffers(template, total)
    fused = fused_plan(runs, total, want_logits)
    if fused is not None:
        positions, rerun = fused
        for sourced in runs:
            if sourced.run.kind == "kept":
                _place(buffers, _source(sourced), sourced.run, layout, rope)
        ends_prefilled = runs[-1].run.kind != "kept"
        out = forwards.at(buffers, positions, [tokens[p] for p in positions], total)
        return filled(buffers, total), out if ends_prefilled or rerun else None, rerun
    logits: torch.Tensor | None = None
    for sourced in runs:
        run = sourced.run
        if run.kind == "kept":
            _place(buffers, _source(sourced), run, layout, rope)
            if sourced.refine is not None:
                sourced.refine(buffers, tokens, run)
            logits = None  # the run's last token may be copied KV: the last-token rule
        else:
            logits = forwards.into(buffers, run.new_start, tokens[run.new_start : run.new_end])
    rerun = want_logits and logits is None and total > 0
    if rerun:
        logits = forwards.into(buffers, total - 1, tokens[-1:])
    return filled(buffers, total), logits, rerun


def _source(sourced: SourcedRun) -> KVCache:
    if sourced.source is None:
        raise ValueError(f"kept run {sourced.run} names no source KV")
    return sourced.source


def fused_plan(
    runs: Sequence[SourcedRun], total: int, want_logits: bool
) -> tuple[list[int], bool] | None:
    """The positions one masked pass computes (every prefilled run's, and the last token's
    when it must be run again for logits), and whether it is run again; None when the runs
    need the sequential loop: a refiner reads its run in context once placed, and a single
    prefilled run at the end is already one pass."""
    if not runs or total == 0 or any(r.refine is not None for r in runs):
        return None
    positions = [
        p for r in runs if r.run.kind != "kept" for p in range(r.run.new_start, r.run.new_end)
    ]
    rerun = want_logits and runs[-1].run.kind == "kept"
    if rerun:
        positions.append(total - 1)
    passes = sum(r.run.kind != "kept" for r in runs) + rerun
    return (positions, rerun) if passes > 1 else None


def execute_edit(
    forwards: Forwards,
    layout: CacheLayout | None,
    rope: RopeSpec | None,
    kv: KVCache,
    result: EditResult,
    *,
    old_exact_length: int,
    want_logits: bool = False,
) -> SpliceOutcome:
    """Build the KV of ``result.tokens`` from ``kv`` (the KV of the base sequence).

    ``layout``/``rope`` may be None only if no kept run moves (pure FORGET, erratum, or a
    same-length replacement); a moving kept run then raises ``ValueError``.

    ``want_logits``: when the new sequence ends in a kept run, run its last token again in
    the new context (in the new buffer, no copy) so that next-token logits come back too.
    """
    if kv_length(kv) != result.position_map.old_length:
        raise ValueError(
            f"KV holds {kv_length(kv)} positions, the edit's base has "
            f"{result.position_map.old_length}"
        )
    runs = [SourcedRun(run, kv if run.kind == "kept" else None) for run in result.runs]
    new_kv, logits, rerun = fill_runs(
        forwards, layout, rope, result.tokens, runs, template=kv, want_logits=want_logits
    )
    return SpliceOutcome(new_kv, logits, exact_after_edit(result, old_exact_length, rerun=rerun))


def exact_after_edit(result: EditResult, old_exact_length: int, *, rerun: bool) -> int:
    """The new sequence's prefix whose KV equals a fresh prefill's (``SpliceOutcome``);
    ``rerun``: the last token was run again in its new context."""
    exact = _exact_length(result.runs, result.first_change, old_exact_length)
    if rerun and exact >= len(result.tokens) - 1:
        exact = len(result.tokens)
    return exact
