"""Choose how an edit batch runs (in place, by copy, or re-prefill) and run it.

:class:`Splicer` is what execution needs of the engine, handed over explicitly: the model's
forwards, how its keys rotate (or why they cannot) and whether sessions edit in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from leyline.core.errors import SpliceUnsupportedError
from leyline.core.report import OpReport
from leyline.engine.edits.in_place_edit import InPlaceOutcome, edit_in_place
from leyline.engine.edits.run_executor import (
    SourcedRun,
    SpliceOutcome,
    exact_after_edit,
    execute_edit,
    fill_runs,
    slice_kv,
)
from leyline.engine.forward import Forwards
from leyline.engine.kv.kv_blocks import KVCache
from leyline.engine.kv.layouts import CacheLayout
from leyline.engine.rope import RopeSpec
from leyline.engine.session_state import SessionState
from leyline.protocol.algebra import EditResult
from leyline.protocol.envelope import Path
from leyline.protocol.fallback import FallbackReason


@dataclass(frozen=True, slots=True)
class Splicer:
    """The engine's model as edits see it (``Engine.splicer``)."""

    forwards: Forwards
    layout: CacheLayout | None
    rope: RopeSpec | None
    refusal: SpliceUnsupportedError | None
    """Why no key of this model can be rotated exactly, or None."""
    in_place: bool
    """Sessions that own their KV edit it in place (``in_place_edit``)."""

    def blocker(self, runs: Sequence[SourcedRun], total: int) -> SpliceUnsupportedError | None:
        """Why the moved keys of ``runs`` (a ``total``-token sequence) cannot be rotated
        exactly, or None if they can."""
        if not any(s.run.kind == "kept" and s.run.delta for s in runs):
            return None  # nothing moves: no RoPE involved
        if self.refusal is not None:
            return self.refusal
        assert self.rope is not None
        try:
            self.rope.check_length(total)
        except SpliceUnsupportedError as exc:
            return exc
        return None

    def edit_in_place(
        self, kv: KVCache, result: EditResult, *, want_logits: bool
    ) -> InPlaceOutcome | None:
        """``result`` executed inside ``kv``'s own buffers (the caller owns them), or None
        with nothing touched when in-place edits are off or these buffers cannot take it."""
        if not self.in_place:
            return None
        assert self.layout is not None and self.rope is not None
        return edit_in_place(
            self.forwards, self.layout, self.rope, kv, result, want_logits=want_logits
        )

    def fill(
        self, tokens: Sequence[int], runs: Sequence[SourcedRun], *, template: KVCache,
        want_logits: bool,
    ) -> tuple[KVCache, torch.Tensor | None, bool]:  # fmt: skip
        """``run_executor.fill_runs`` with this model."""
        return fill_runs(
            self.forwards, self.layout, self.rope, tokens, runs,
            template=template, want_logits=want_logits,
        )  # fmt: skip


def run_edits(
    splicer: Splicer,
    state: SessionState,
    result: EditResult,
    *,
    forget: bool,
    allow_fallback: bool,
    want_logits: bool = False,
) -> tuple[SessionState, OpReport]:
    """The new state (revision and spans left to the caller) and its report.

    ``state`` must hold KV for all of its tokens; ``forget`` says the batch has a FORGET
    (reported as ``reprefill``: everything after it is prefilled again). Raises
    ``SpliceUnsupportedError`` when a splice cannot run exactly and ``allow_fallback`` is
    false. ``want_logits``: see ``execute_edit``.
    """
    revision = state.revision + 1
    runs = [SourcedRun(r) for r in result.runs]
    total = max(len(result.tokens), result.position_map.old_length)
    blocker = splicer.blocker(runs, total)
    if blocker is not None:
        if not allow_fallback:
            raise blocker
        return reprefill_from_change(splicer, state, result, blocker.reason)
    moved = (
        splicer.edit_in_place(state.kv, result, want_logits=want_logits) if state.owns_kv else None
    )
    if moved is not None:
        exact = exact_after_edit(result, state.exact_length, rerun=moved.rerun)
        outcome = SpliceOutcome(moved.kv, moved.logits, exact)
    else:
        outcome = execute_edit(
            splicer.forwards, splicer.layout, splicer.rope, state.kv, result,
            old_exact_length=state.exact_length, want_logits=want_logits,
        )  # fmt: skip
    new = SessionState(
        result.tokens, outcome.kv, outcome.logits, revision, (), outcome.exact_length, True
    )
    report = OpReport(
        Path.reprefill if forget else Path.splice,
        revision,
        reused_tokens=result.reused_tokens,
        prefilled_tokens=result.prefilled_tokens,
        rotated_tokens=result.rotated_tokens,
        first_change=result.first_change,
    )
    return new, report


def reprefill_from_change(
    splicer: Splicer, state: SessionState, result: EditResult, reason: FallbackReason
) -> tuple[SessionState, OpReport]:
    """Keep the unchanged prefix, prefill everything from the first change (the fallback
    of a splice or a compose that cannot rotate exactly)."""
    fc, n = result.first_change, len(result.tokens)
    kv, logits = slice_kv(state.kv, 0, fc), None
    if fc < n:
        kv, logits = splicer.forwards.tokens(kv, result.tokens[fc:])
    exact = min(state.exact_length, fc)
    owns = fc < n or state.owns_kv  # a prefill's new buffers, or a view of our own
    new = SessionState(
        result.tokens, kv, logits, state.revision + 1, (), n if exact == fc else exact, owns
    )
    report = OpReport(Path.reprefill, new.revision, fc, n - fc, 0, fc, reason)
    return new, report
