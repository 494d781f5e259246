"""Resolve a directive batch (anchors, text) into token edits a server can apply.

The server supplies its tokenizer, its message spans and its limits; the rules live here so
every server resolves the same batch the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from .algebra import Edit
from .capabilities import Limits
from .directives import (
    ComposeDirective,
    DecayDirective,
    Directive,
    ErratumDirective,
    ForgetDirective,
    Mode,
    PinDirective,
    Recompute,
    RecomputeMode,
    RetentionDirective,
    SpliceDirective,
    UnpinDirective,
    Verb,
)
from .errors import ErrorCode, LeylineError
from .spans import InsertionPoint, MessageAnchor, MessageSpan, Replacement, Span, TokenSpan

Tokenize = Callable[[str], Sequence[int]]
SkillTokens = Callable[[str], Sequence[int] | None]
"""Skill id -> its token ids, or None when the caller's tenant has no such skill. It may raise
``LeylineError(skill_mismatch)`` for a skill bound to another model, tokenizer or template."""


@dataclass(frozen=True, slots=True)
class ResolvedCompose:
    """A compose, resolved: what the engine needs beyond its (inserting) :class:`Edit`."""

    index: int
    """Position of the directive in its batch (its edit carries the same ``index``)."""
    skill: str
    at: int
    """Insertion point in the base revision."""
    num_tokens: int
    seam_tokens: int
    """Leading block tokens to recompute in context, at most ``num_tokens``."""
    recompute: Recompute


@dataclass(frozen=True, slots=True)
class ResolvedMark:
    """A ``pin``, ``unpin``, ``decay`` or ``scratch``, resolved to a token span of the base."""

    index: int
    verb: Verb
    start: int
    end: int
    ttl_s: float | None = None
    priority: int = 0
    mode: Mode = Mode.forget
    replacement: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class ResolvedBatch:
    """Edits for the algebra, plus the non-editing directives (pin, decay, scratch) as spans.

    A compose is an inserting AMORTIZE edit whose replacement is the skill's tokens; its
    entry in ``composes`` says it is one (its KV comes precompiled, not from a prefill).
    """

    edits: tuple[Edit, ...]
    marks: tuple[ResolvedMark, ...] = field(default=())
    composes: tuple[ResolvedCompose, ...] = field(default=())


def resolve_point(
    point: InsertionPoint, spans: Sequence[MessageSpan], length: int, where: str
) -> int:
    """A token position, a message edge, or ``"end"`` as a position in ``[0, length]``."""
    if point == "end":
        return length
    if isinstance(point, int):
        if point > length:
            raise LeylineError(
                ErrorCode.invalid_span,
                f"insertion point {point} is past the base revision's {length} tokens; "
                f'use a position in [0, {length}] or "end"',
                where,
            )
        return point
    assert not isinstance(point, str)
    span = resolve_span(point.anchor(), spans, length, where)
    return span.start if point.edge == "start" else span.end


def resolve_span(span: Span, spans: Sequence[MessageSpan], length: int, where: str) -> TokenSpan:
    if isinstance(span, TokenSpan):
        if span.end > length:
            raise LeylineError(
                ErrorCode.invalid_span,
                f"span [{span.start}, {span.end}) ends past the base revision's {length} tokens",
                where,
            )
        return span
    assert isinstance(span, MessageAnchor)
    by_index = {s.message: s for s in spans}
    message = by_index.get(span.message)
    if message is None:
        raise LeylineError(
            ErrorCode.unresolved_anchor,
            f"message {span.message} is not in the base revision, which has messages "
            f"{sorted(by_index)}",
            where,
        )
    part = message.part(span.part)
    if part is None:
        raise LeylineError(
            ErrorCode.unresolved_anchor,
            f"message {span.message} ({message.role}) has no '{span.part}' part",
            where,
        )
    return part


def resolve_batch(
    directives: Sequence[Directive],
    *,
    length: int,
    tokenize: Tokenize,
    spans: Sequence[MessageSpan] = (),
    limits: Limits | None = None,
    supported: Collection[Verb] = (Verb.splice, Verb.forget, Verb.erratum),
    skill_tokens: SkillTokens | None = None,
    recompute_modes: Collection[RecomputeMode] = (RecomputeMode.none,),
) -> ResolvedBatch:
    """Resolve every directive, or raise on the first that breaks a rule.

    Args:
        directives: the batch, all addressed to the same base revision.
        length: number of tokens in the base revision.
        tokenize: text -> token ids, as the server's tokenizer does it (no special tokens).
        spans: the base revision's message spans, for message anchors.
        limits: the server's limits; ``None`` checks none.
        supported: verbs the server executes; any other gets ``unsupported_verb``.
        skill_tokens: skill id -> its token ids, or None when unknown (compose only).
        recompute_modes: compose recompute modes the server executes; any other gets
            ``unsupported_option``.

    Raises:
        LeylineError: naming the directive (``directives[i]...``) and the rule.
    """
    limits = limits or Limits(max_directives=None, max_replacement_tokens=None)
    if limits.max_directives is not None and len(directives) > limits.max_directives:
        raise LeylineError(
            ErrorCode.too_many_directives,
            f"{len(directives)} directives in one batch; this server takes at most "
            f"{limits.max_directives}: split the batch",
            "directives",
        )
    for i, directive in enumerate(directives):
        if directive.verb not in supported:
            raise LeylineError(
                ErrorCode.unsupported_verb,
                f"this server does not execute '{directive.verb}' (it executes "
                f"{', '.join(sorted(supported))})",
                f"directives[{i}].verb",
            )
        if isinstance(directive, ComposeDirective):
            recompute = RecomputeMode(directive.recompute.mode)
            if recompute not in recompute_modes:
                raise LeylineError(
                    ErrorCode.unsupported_option,
                    f"this server does not execute compose recompute mode '{recompute}' (it "
                    f"executes {', '.join(sorted(recompute_modes))})",
                    f"directives[{i}].recompute.mode",
                )

    edits: list[Edit] = []
    marks: list[ResolvedMark] = []
    composes: list[ResolvedCompose] = []
    for i, directive in enumerate(directives):
        where = f"directives[{i}]"
        if isinstance(directive, SpliceDirective | ForgetDirective):
            span = resolve_span(directive.span, spans, length, f"{where}.span")
            replacement = _tokens(directive.replacement, tokenize, limits, f"{where}.replacement")
            mode = Mode.amortize if isinstance(directive, SpliceDirective) else Mode.forget
            edits.append(Edit(span.start, span.end, replacement, mode, i))
        elif isinstance(directive, ErratumDirective):
            if directive.corrects is not None:
                resolve_span(directive.corrects, spans, length, f"{where}.corrects")
            note = _tokens(directive.text, tokenize, limits, f"{where}.text")
            edits.append(Edit(length, length, note, Mode.amortize, i))
        elif isinstance(directive, ComposeDirective):
            edit, compose = _compose(directive, length, spans, skill_tokens, where, i)
            edits.append(edit)
            composes.append(compose)
        else:
            marks.append(_mark(directive, length, spans, tokenize, limits, where, i))
    return ResolvedBatch(tuple(edits), tuple(marks), tuple(composes))


def _tokens(value: Replacement, tokenize: Tokenize, limits: Limits, where: str) -> tuple[int, ...]:
    tokens = tuple(tokenize(value)) if isinstance(value, str) else tuple(value)
    cap = limits.max_replacement_tokens
    if cap is not None and len(tokens) > cap:
        raise LeylineError(
            ErrorCode.replacement_too_long,
            f"replacement is {len(tokens)} tokens; this server takes at most {cap}",
            where,
        )
    return tokens


def _mark(
    directive: RetentionDirective,
    length: int,
    spans: Sequence[MessageSpan],
    tokenize: Tokenize,
    limits: Limits,
    where: str,
    index: int,
) -> ResolvedMark:
    span = resolve_span(directive.span, spans, length, f"{where}.span")
    if span.start == span.end:
        raise LeylineError(
            ErrorCode.invalid_span,
            f"{directive.verb} marks tokens: span [{span.start}, {span.end}) is empty",
            f"{where}.span",
        )
    verb = Verb(directive.verb)
    if isinstance(directive, PinDirective):
        return ResolvedMark(index, verb, span.start, span.end, ttl_s=directive.ttl_s)
    if isinstance(directive, UnpinDirective):
        return ResolvedMark(index, verb, span.start, span.end)
    replacement = _tokens(directive.replacement, tokenize, limits, f"{where}.replacement")
    priority = directive.priority if isinstance(directive, DecayDirective) else 0
    return ResolvedMark(
        index, verb, span.start, span.end, priority=priority, mode=Mode(directive.mode),
        replacement=replacement,
    )  # fmt: skip


def _compose(
    directive: ComposeDirective,
    length: int,
    spans: Sequence[MessageSpan],
    skill_tokens: SkillTokens | None,
    where: str,
    index: int,
) -> tuple[Edit, ResolvedCompose]:
    at = resolve_point(directive.at, spans, length, f"{where}.at")
    tokens = skill_tokens(directive.skill) if skill_tokens else None
    if tokens is None:
        raise LeylineError(
            ErrorCode.unknown_skill,
            f"no skill {directive.skill!r} is registered for this tenant "
            "(register it with POST /leyline/v1/skills)",
            f"{where}.skill",
        )
    if not tokens:
        raise LeylineError(
            ErrorCode.internal_error, f"skill {directive.skill!r} has no tokens", f"{where}.skill"
        )
    block = tuple(tokens)
    compose = ResolvedCompose(
        index=index,
        skill=directive.skill,
        at=at,
        num_tokens=len(block),
        seam_tokens=min(directive.seam_tokens, len(block)),
        recompute=directive.recompute,
    )
    return Edit(at, at, block, Mode.amortize, index), compose
