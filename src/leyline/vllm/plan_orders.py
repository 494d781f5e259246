"""What a checked plan asks of vLLM beyond its tokens: the rows a compose borrows from its
skills' holds, and the batches the backend re-prefills instead of building (a splice or
compose before a FORGET)."""

from __future__ import annotations

from collections.abc import Sequence

from leyline.core.batch import EditPlan
from leyline.protocol import ErrorCode, FallbackReason, LeylineError
from leyline.vllm.build import Borrowed
from leyline.vllm.link import RowRun, runs_of
from leyline.vllm.skills import HeldSkill


def splice_kept_before_forget(plan: EditPlan) -> FallbackReason | None:
    """``unsupported_runtime`` when the batch keeps downstream rows between its first change
    and its earliest forget (a splice before the forget), or composes a block before it
    whose rows past the seam are the skill's: the re-prefill recomputes both."""
    forget_from, first_change = plan.forget_from, plan.result.first_change
    if forget_from is None:
        return None
    splices_before = any(
        run.source_start < forget_from and run.dest_start + run.length > first_change
        for run in runs_of(plan.result.position_map)
    )
    # A block inserted at or before the forget's start (base positions) comes before it.
    composes_before = any(
        c.seam_tokens < c.num_tokens and c.at <= forget_from for c in plan.composes
    )
    return FallbackReason.unsupported_runtime if splices_before or composes_before else None


def borrowed_rows(plan: EditPlan, skills: Sequence[HeldSkill]) -> list[Borrowed]:
    """Each composed block's rows past its seam, read from its skill's hold: source rows
    after the anchor, keys rotated by the block's position less the anchor's length.
    Raises ``invalid_directive`` (nothing ran) when a block is no longer its skill's
    tokens (replaced since the batch was planned)."""
    out = []
    for compose, where, skill in zip(plan.composes, plan.composed(), skills, strict=True):
        if plan.tokens[where.start : where.end] != skill.tokens:
            raise LeylineError(
                ErrorCode.invalid_directive,
                f"the block at [{where.start}, {where.end}) is not skill {skill.id!r}'s "
                "tokens (replaced meanwhile?): retry the batch",
                "directives",
            )
        n, seam = len(skill.tokens), min(compose.seam_tokens, len(skill.tokens))
        if seam < n:
            run = RowRun(len(skill.anchor) + seam, where.start + seam, n - seam)
            out.append(Borrowed(skill.key, run))
    return out
