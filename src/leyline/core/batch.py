"""Every rule a write to a session must pass, checked before anything changes.

A directive batch becomes an :class:`EditPlan`: the revision it addresses is current, its
directives resolve (anchors, text) with the protocol's own code, the server's limits hold,
the edited sequence is valid, and the message spans of the new revision are known. Both
backends execute plans and never re-check: a rule lives here once, so it holds on both.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from leyline.core.spans import remap_spans
from leyline.protocol.algebra import Edit, EditResult, apply_edits, replacement_spans
from leyline.protocol.capabilities import Limits
from leyline.protocol.directives import Directive, Mode, RecomputeMode, Verb
from leyline.protocol.envelope import ComposedBlock
from leyline.protocol.errors import ErrorCode, LeylineError
from leyline.protocol.resolve import ResolvedCompose, ResolvedMark, SkillTokens, resolve_batch
from leyline.protocol.spans import MessageSpan

Tokenize = Callable[[str], Sequence[int]]


@dataclass(frozen=True, slots=True)
class SessionView:
    """What a client can see of a session: the protocol state, no KV."""

    tokens: tuple[int, ...] = ()
    revision: int = 0
    spans: tuple[MessageSpan, ...] = ()


@dataclass(frozen=True, slots=True)
class EditPlan:
    """A checked batch, ready to execute on the revision it was planned against."""

    base: SessionView
    edits: tuple[Edit, ...]
    result: EditResult
    spans: tuple[MessageSpan, ...]
    """The new revision's message spans."""
    composes: tuple[ResolvedCompose, ...] = ()
    """The batch's composes: their edits insert the skills' tokens, whose KV is precompiled."""
    tenant: str | None = None
    """Whose skills the composes name (set by the service that planned them)."""
    marks: tuple[ResolvedMark, ...] = ()
    """The batch's pin, unpin, decay and scratch directives (the core keeps the marks)."""
    cancelled: Callable[[], bool] | None = field(default=None, compare=False, repr=False)
    """Whether the client that sent the batch has left (where the server tracks it): a
    backend checks it when the plan's model work would start and then runs none of it, so
    a batch queued behind other work whose client hung up changes nothing."""

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.result.tokens

    def composed(self) -> list[ComposedBlock]:
        """Where each compose put its skill's tokens in the new revision (the report's
        ``composed``), in batch order."""
        if not self.composes:
            return []
        where = replacement_spans(len(self.base.tokens), self.edits)
        by_index = {e.index: span for e, span in zip(self.edits, where, strict=True)}
        return [
            ComposedBlock(
                directive=c.index, skill=c.skill, start=by_index[c.index][0],
                end=by_index[c.index][1],
            )
            for c in self.composes
        ]  # fmt: skip

    @property
    def forget_from(self) -> int | None:
        """Where the earliest FORGET starts (nothing derived from it may stay), or None."""
        starts = [e.start for e in self.edits if e.mode is Mode.forget]
        return min(starts) if starts else None

    @property
    def is_identity(self) -> bool:
        return self.result.is_identity


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def check_revision(view: SessionView, base_revision: int | None) -> None:
    """A write addressed to an older revision is a conflict, never a silent overwrite."""
    if base_revision is not None and base_revision != view.revision:
        raise LeylineError(
            ErrorCode.revision_conflict,
            f"the request addressed revision {base_revision}; the session is at "
            f"{view.revision}: re-read its tokens and spans",
            "base_revision",
        )


def check_tokens(tokens: Sequence[int], vocab_size: int, limits: Limits, field: str) -> None:
    """Token ids in the vocabulary and a sequence within the session limit."""
    cap = limits.max_session_tokens
    if cap is not None and len(tokens) > cap:
        raise LeylineError(
            ErrorCode.session_too_long,
            f"the sequence would be {len(tokens)} tokens; this server takes at most {cap}",
            field,
        )
    check_vocab(tokens, vocab_size, field)


def check_vocab(tokens: Sequence[int], vocab_size: int, field: str) -> None:
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise LeylineError(
            ErrorCode.invalid_directive,
            f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})",
            field,
        )


def check_edit_limits(
    edits: Sequence[Edit], limits: Limits, precompiled: Collection[int] = ()
) -> None:
    """The batch size and replacement caps; edits whose index is in ``precompiled`` (a
    compose's skill: its KV exists, nothing is prefilled) are exempt from the latter."""
    if limits.max_directives is not None and len(edits) > limits.max_directives:
        raise LeylineError(
            ErrorCode.too_many_directives,
            f"{len(edits)} edits; at most {limits.max_directives}",
            "directives",
        )
    cap = limits.max_replacement_tokens
    for e in edits:
        if cap is not None and len(e.replacement) > cap and e.index not in precompiled:
            raise LeylineError(
                ErrorCode.replacement_too_long,
                f"replacement of {len(e.replacement)} tokens; at most {cap}",
                f"directives[{e.index}].replacement",
            )


def plan_edits(
    view: SessionView,
    edits: Sequence[Edit],
    *,
    limits: Limits,
    vocab_size: int,
    base_revision: int | None = None,
    composes: Sequence[ResolvedCompose] = (),
    marks: Sequence[ResolvedMark] = (),
) -> EditPlan:
    """Check resolved token edits against ``view``; raises ``LeylineError`` on any rule.
    ``composes`` marks the edits that insert a skill (by directive index); ``marks`` ride
    along for the core, which checks them against the session's pins."""
    check_revision(view, base_revision)
    # Mode(...) also accepts plain strings; the algebra compares modes by identity.
    normal = tuple(
        Edit(e.start, e.end, tuple(int(t) for t in e.replacement), Mode(e.mode), e.index)
        for e in edits
    )
    check_edit_limits(normal, limits, {c.index for c in composes})
    result = apply_edits(view.tokens, normal)
    check_tokens(result.tokens, vocab_size, limits, "directives")
    spans = remap_spans(view.spans, normal)
    return EditPlan(view, normal, result, spans, tuple(composes), marks=tuple(marks))


def plan_batch(
    view: SessionView,
    directives: Sequence[Directive],
    *,
    tokenize: Tokenize,
    limits: Limits,
    vocab_size: int,
    supported: Collection[Verb],
    base_revision: int | None = None,
    skill_tokens: SkillTokens | None = None,
    recompute_modes: Collection[RecomputeMode] = (RecomputeMode.none,),
) -> EditPlan:
    """Resolve a protocol batch against ``view`` (anchors, text, skills) and check it whole."""
    check_revision(view, base_revision)
    batch = resolve_batch(
        directives,
        length=len(view.tokens),
        tokenize=tokenize,
        spans=view.spans,
        limits=limits,
        supported=supported,
        skill_tokens=skill_tokens,
        recompute_modes=recompute_modes,
    )
    return plan_edits(
        view,
        batch.edits,
        limits=limits,
        vocab_size=vocab_size,
        composes=batch.composes,
        marks=batch.marks,
    )
