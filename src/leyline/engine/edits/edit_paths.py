"""Choose how an edit batch runs (splice or re-prefill) and run it on a session's KV."""

from __future__ import annotations

from typing import TYPE_CHECKING

from leyline.core.errors import SpliceUnsupportedError
from leyline.engine.edits.run_executor import (
    SpliceOutcome,
    exact_after_edit,
    execute_edit,
    slice_kv,
)
from leyline.engine.reports import OpReport
from leyline.engine.session_state import SessionState
from leyline.protocol.algebra import EditResult
from leyline.protocol.envelope import Path
from leyline.protocol.fallback import FallbackReason

if TYPE_CHECKING:
    from leyline.engine.engine import Engine


def splice_blocker(engine: Engine, result: EditResult) -> SpliceUnsupportedError | None:
    """Why the batch's moved keys cannot be rotated exactly, or None if they can."""
    if not any(r.kind == "kept" and r.delta != 0 for r in result.runs):
        return None  # nothing moves: no RoPE involved
    if engine.splice_refusal is not None:
        return engine.splice_refusal
    assert engine.rope is not None
    try:
        engine.rope.check_length(max(len(result.tokens), result.position_map.old_length))
    except SpliceUnsupportedError as exc:
        return exc
    return None


def run_edits(
    engine: Engine,
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
    blocker = splice_blocker(engine, result)
    if blocker is not None:
        if not allow_fallback:
            raise blocker
        return reprefill_from_change(engine, state, result, blocker.reason)
    moved = (
        engine.edit_in_place(state.kv, result, want_logits=want_logits) if state.owns_kv else None
    )
    if moved is not None:
        exact = exact_after_edit(result, state.exact_length, rerun=moved.rerun)
        outcome = SpliceOutcome(moved.kv, moved.logits, exact)
    else:
        outcome = execute_edit(
            engine.forward_into,
            engine.layout,
            engine.rope,
            state.kv,
            result,
            old_exact_length=state.exact_length,
            want_logits=want_logits,
            forward_at=engine.one_pass_forward,
        )
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
    engine: Engine, state: SessionState, result: EditResult, reason: FallbackReason
) -> tuple[SessionState, OpReport]:
    """Keep the unchanged prefix, prefill everything from the first change (the fallback
    of a splice or a compose that cannot rotate exactly)."""
    fc, n = result.first_change, len(result.tokens)
    kv, logits = slice_kv(state.kv, 0, fc), None
    if fc < n:
        kv, logits = engine.forward(kv, result.tokens[fc:])
    exact = min(state.exact_length, fc)
    owns = fc < n or state.owns_kv  # a prefill's new buffers, or a view of our own
    new = SessionState(
        result.tokens, kv, logits, state.revision + 1, (), n if exact == fc else exact, owns
    )
    report = OpReport(Path.reprefill, new.revision, fc, n - fc, 0, fc, reason)
    return new, report
