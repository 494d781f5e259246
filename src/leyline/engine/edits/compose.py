"""COMPOSE on the reference engine: a precomputed skill's KV inserted into a session.

The skill's tokens are planned as a splice inserting them at ``at`` (``core.batch``). The
block's first ``seam_tokens`` are prefilled in context, the rest copied from the skill's KV
with keys rotated by ``at``, optionally part of it recomputed (``recompute``,
``attention_recompute``); everything after ``at`` shifts as a splice shifts it. Where keys
cannot be rotated exactly, everything from ``at`` is prefilled instead. The definition and
its exactness: docs/engine.md, "Compose".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from leyline.core.batch import EditPlan, SessionView, plan_edits
from leyline.core.report import OpReport
from leyline.engine.attention import NAME as ENGINE_ATTENTION
from leyline.engine.edits.attention_recompute import AttentionRecompute, following_tokens
from leyline.engine.edits.edit_paths import reprefill_from_change, run_edits
from leyline.engine.edits.recompute import DeviationRecompute, supports_deviation
from leyline.engine.edits.run_executor import Refiner, SourcedRun
from leyline.engine.edits.skills import Skill, check_compatible
from leyline.engine.kv.kv_blocks import KVCache
from leyline.engine.session_state import SessionState
from leyline.protocol.algebra import Edit, EditResult, Run, replacement_spans
from leyline.protocol.capabilities import Limits
from leyline.protocol.directives import (
    Mode,
    Recompute,
    RecomputeAttention,
    RecomputeDeviation,
    RecomputeNone,
)
from leyline.protocol.envelope import Path
from leyline.protocol.errors import ErrorCode, LeylineError
from leyline.protocol.resolve import ResolvedCompose

if TYPE_CHECKING:
    from leyline.engine.engine import Engine


def plan_compose(
    view: SessionView,
    skill: Skill,
    at: int,
    seam_tokens: int,
    *,
    limits: Limits,
    vocab_size: int,
    base_revision: int | None = None,
    recompute_ratio: float | None = None,
    recompute: Recompute | None = None,
) -> EditPlan:
    """Check a compose against ``view`` as the insertion of the skill's tokens at ``at``: a
    one-compose batch (directive 0) for ``SessionCache.execute``. ``recompute_ratio``: a
    deviation recompute of that ratio; ``recompute``: any mode instead.

    Raises:
        LeylineError: ``invalid_span`` for ``at`` outside ``[0, len(tokens)]``,
            ``invalid_directive`` for a negative seam or a recompute ratio outside
            ``(0, 1]``, and every rule of a splice (revision, session length, vocabulary).
    """
    if recompute_ratio is not None and recompute is not None:
        raise ValueError("give recompute_ratio or recompute, not both")
    if isinstance(recompute, RecomputeDeviation | RecomputeAttention):
        recompute_ratio = recompute.ratio  # checked as any ratio
    if not 0 <= at <= len(view.tokens):
        raise LeylineError(
            ErrorCode.invalid_span,
            f"compose position {at} is outside the base revision's {len(view.tokens)} "
            f"tokens; use a position in [0, {len(view.tokens)}]",
            "at",
        )
    if seam_tokens < 0:
        raise LeylineError(
            ErrorCode.invalid_directive, f"seam_tokens is {seam_tokens}; use 0 or more", "seam"
        )
    if recompute_ratio is not None and not 0.0 < recompute_ratio <= 1.0:
        raise LeylineError(
            ErrorCode.invalid_directive,
            f"recompute ratio is {recompute_ratio}; use a fraction in (0, 1]",
            "recompute.ratio",
        )
    # The replacement cap bounds prefill work per request; a skill's KV is precomputed.
    uncapped = limits.model_copy(update={"max_replacement_tokens": None})
    edit = Edit(at, at, skill.tokens, Mode.amortize)
    seam = min(seam_tokens, len(skill))
    if recompute is None and recompute_ratio is not None:
        recompute = RecomputeDeviation(mode="deviation", ratio=recompute_ratio)
    mode = recompute or RecomputeNone(mode="none")
    composed = ResolvedCompose(0, skill.id, at, len(skill), seam, mode)
    return plan_edits(
        view, [edit], limits=uncapped, vocab_size=vocab_size, base_revision=base_revision,
        composes=[composed],
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class Block:
    """A composed block as execution sees it: its skill, seam and selective recompute."""

    skill: Skill
    seam_tokens: int
    refine: Refiner | None = None
    """Recomputes part of the copied rest once placed (``DeviationRecompute``,
    ``AttentionRecompute``), or None."""


def supports_attention_recompute(engine: Engine) -> bool:
    """Whether ``attention`` recompute runs here: the model's layers run apart and its
    attention is the engine's, which can hand out its weights (``attention_mass``)."""
    attention = getattr(engine.model.config, "_attn_implementation", None)
    return supports_deviation(engine.model) and attention == ENGINE_ATTENTION


def refiner(
    engine: Engine,
    recompute: Recompute | None,
    following: Sequence[int] = (),
) -> Refiner | None:
    """The selective recompute ``recompute`` asks for on ``engine`` (None: seam only);
    ``following``: the tokens after the block, which rank it in ``attention`` mode.

    Raises:
        LeylineError: ``unsupported_option`` when the model cannot run the mode.
    """
    if recompute is None or recompute.mode == "none":
        return None
    if isinstance(recompute, RecomputeAttention):
        if not supports_attention_recompute(engine):
            raise LeylineError(
                ErrorCode.unsupported_option,
                f"{engine.loaded.label}: attention recompute needs the model's decoder layers "
                "and the engine's attention",
                "recompute.mode",
            )
        return AttentionRecompute(
            engine.model, recompute.ratio, tuple(following), chunk=engine.prefill_chunk
        )
    if not supports_deviation(engine.model):
        raise LeylineError(
            ErrorCode.unsupported_option,
            f"{engine.loaded.label}: deviation recompute needs the model's decoder layers",
            "recompute.mode",
        )
    return DeviationRecompute(
        engine.model,
        recompute.ratio,
        layer=engine.recompute_selection_layer,
        chunk=engine.prefill_chunk,
    )


def compose_runs(
    result: EditResult, skill: Skill, seam_tokens: int, base: KVCache, refine: Refiner | None = None
) -> list[SourcedRun]:
    """The plan's runs with the skill's inserted run split into seam + copied skill KV;
    kept runs read ``base`` (the session's KV)."""
    (insertion,) = [run for run in result.runs if run.kind == "inserted"]  # the one compose
    return batch_runs(result, {insertion.new_start: Block(skill, seam_tokens, refine)}, base)


def batch_runs(result: EditResult, blocks: Mapping[int, Block], base: KVCache) -> list[SourcedRun]:
    """The runs of a batch: kept runs read ``base``; inside an inserted run, each composed
    block (keyed by its start) is split into the prefilled seam and the skill's KV copied
    with keys rotated by its position (and refined, when it says so), and the rest (a
    splice's replacement, which the algebra may merge with an adjacent block into one run)
    is prefilled."""
    out: list[SourcedRun] = []
    for run in result.runs:
        if run.kind != "inserted":
            out.append(SourcedRun(run, base) if run.kind == "kept" else SourcedRun(run))
            continue
        at = run.new_start
        for start in sorted(b for b in blocks if run.new_start <= b < run.new_end):
            block = blocks[start]
            assert start + len(block.skill) <= run.new_end, (run, start, len(block.skill))
            if start > at:
                out.append(SourcedRun(Run("inserted", at, start)))
            out.extend(_block_runs(start, block))
            at = start + len(block.skill)
        if at < run.new_end:
            out.append(SourcedRun(Run("inserted", at, run.new_end)))
    return out


def _block_runs(start: int, block: Block) -> list[SourcedRun]:
    """A block at ``start``: its first tokens prefilled in context, the rest copied."""
    skill = block.skill
    seam_end = start + min(block.seam_tokens, len(skill))
    out: list[SourcedRun] = []
    if seam_end > start:
        out.append(SourcedRun(Run("inserted", start, seam_end)))
    if seam_end < start + len(skill):
        # old_start indexes the skill's own positions: delta = start, as the definition says.
        copied = Run("kept", seam_end, start + len(skill), seam_end - start)
        out.append(SourcedRun(copied, skill.kv, block.refine))
    return out


def exact_after_compose(
    at: int, skill_len: int, seam: int, old_exact: int, recomputed: int = 0
) -> int:
    """Prefix of the composed sequence whose KV equals a fresh prefill's (up to rounding).

    The seam attends to the real prefix, so it is exact if the prefix is. The copied rest
    of the skill attended only to the skill, which is its real context only at ``at == 0``,
    or when all of it was ``recomputed``. Downstream tokens attended to the old context:
    never exact.
    """
    if old_exact < at:
        return old_exact
    whole = at == 0 or seam + recomputed >= skill_len
    return at + (skill_len if whole else min(seam, skill_len))


def run_compose(
    engine: Engine,
    state: SessionState,
    plan: EditPlan,
    skill: Skill,
    seam_tokens: int,
    *,
    allow_fallback: bool = True,
    want_logits: bool = False,
    recompute: Recompute | None = None,
    final_tokens: Sequence[int] | None = None,
) -> tuple[SessionState, OpReport]:
    """The composed state (revision and spans left to the caller) and its report.

    ``state`` must hold KV for all of its tokens; ``plan`` comes from :func:`plan_compose`
    on it. ``want_logits``: also compute the next-token logits now (see ``fill_runs``).
    ``recompute``: the selective recompute of the copied tokens (None: the seam only).
    ``final_tokens``: the sequence the request goes on to (a turn's prompt), whose tokens
    after the block rank it in ``attention`` mode (``attention_recompute``).

    Raises:
        LeylineError: ``skill_mismatch`` when another model compiled the skill;
            ``unsupported_option`` for a recompute the model cannot run.
        SpliceUnsupportedError: a key cannot be rotated exactly and ``allow_fallback`` is
            false.
    """
    check_compatible(engine, skill, state.kv)
    result = plan.result
    at = plan.edits[0].start
    following = _following(recompute, result.tokens, at + len(skill), final_tokens)
    runs = compose_runs(result, skill, seam_tokens, state.kv, refiner(engine, recompute, following))
    seam = min(seam_tokens, len(skill))
    recomputed = sum(r.recomputed for r in runs)
    exact = exact_after_compose(at, len(skill), seam, state.exact_length, recomputed)
    return _run_sourced(
        engine, state, result, runs, template=state.kv or skill.kv, exact=exact,
        first_change=at, allow_fallback=allow_fallback, want_logits=want_logits,
    )  # fmt: skip


def _run_sourced(
    engine: Engine,
    state: SessionState,
    result: EditResult,
    runs: list[SourcedRun],
    *,
    template: KVCache,
    exact: int,
    first_change: int,
    allow_fallback: bool,
    want_logits: bool,
) -> tuple[SessionState, OpReport]:
    """Fill the new KV from sourced runs (or re-prefill from the change when a key cannot be
    rotated exactly); ``exact``: the new prefix equal to a fresh prefill's."""
    splicer = engine.splicer
    blocker = splicer.blocker(runs, len(result.tokens))
    if blocker is not None:
        if not allow_fallback:
            raise blocker
        return reprefill_from_change(splicer, state, result, blocker.reason)
    kv, logits, rerun = splicer.fill(
        result.tokens, runs, template=template, want_logits=want_logits
    )
    total = len(result.tokens)
    if rerun and exact >= total - 1:
        exact = total
    kept = [s for s in runs if s.run.kind == "kept"]
    # Recomputed entries of a copied run were computed, not reused (nor left rotated).
    reused = sum(len(s.run) - s.recomputed for s in kept)
    report = OpReport(
        Path.splice,
        state.revision + 1,
        reused_tokens=reused,
        prefilled_tokens=total - reused,
        rotated_tokens=sum(len(s.run) - s.recomputed for s in kept if s.run.delta),
        first_change=first_change,
    )
    return SessionState(result.tokens, kv, logits, state.revision + 1, (), exact), report


def run_batch(
    engine: Engine,
    state: SessionState,
    plan: EditPlan,
    skills: Mapping[int, Skill],
    *,
    allow_fallback: bool = True,
    want_logits: bool = False,
    final_tokens: Sequence[int] | None = None,
) -> tuple[SessionState, OpReport]:
    """A protocol batch holding composes (``plan.composes``; ``skills`` by directive index),
    splices and errata, on the complete ``state``. A batch with one compose and nothing else
    is :func:`run_compose`. With a FORGET, everything from its start is prefilled (as any
    FORGET batch), composed blocks after it included; exact, reported ``reprefill``.

    Raises:
        LeylineError: ``skill_mismatch`` when another model compiled a skill.
        SpliceUnsupportedError: see :func:`run_compose`.
    """
    for skill in skills.values():
        check_compatible(engine, skill, state.kv)
    if len(plan.edits) == 1 and len(plan.composes) == 1:
        c = plan.composes[0]
        return run_compose(
            engine, state, plan, skills[c.index], c.seam_tokens,
            allow_fallback=allow_fallback, want_logits=want_logits,
            recompute=c.recompute, final_tokens=final_tokens,
        )  # fmt: skip
    result = plan.result
    if plan.forget_from is not None:
        return run_edits(
            engine.splicer, state, result, forget=True, allow_fallback=allow_fallback,
            want_logits=want_logits,
        )  # fmt: skip
    where = {e.index: start for e, (start, _) in zip(plan.edits, _new_spans(plan), strict=True)}
    blocks = {}
    for c in plan.composes:
        start, skill = where[c.index], skills[c.index]
        following = _following(c.recompute, result.tokens, start + len(skill), final_tokens)
        blocks[start] = Block(skill, c.seam_tokens, refiner(engine, c.recompute, following))
    runs = batch_runs(result, blocks, state.kv)
    return _run_sourced(
        engine, state, result, runs,
        template=state.kv or next(iter(skills.values())).kv,
        # Exact (equal to a fresh prefill) up to the first change at most: conservative.
        exact=min(state.exact_length, result.first_change),
        first_change=result.first_change,
        allow_fallback=allow_fallback, want_logits=want_logits,
    )  # fmt: skip


def _following(
    recompute: Recompute | None, tokens: Sequence[int], end: int, final: Sequence[int] | None
) -> tuple[int, ...]:
    """The tokens after a block ending at ``end`` that rank it (``attention`` mode only)."""
    if not isinstance(recompute, RecomputeAttention):
        return ()
    return following_tokens(tokens, end, final)


def _new_spans(plan: EditPlan) -> list[tuple[int, int]]:
    return replacement_spans(len(plan.base.tokens), plan.edits)
