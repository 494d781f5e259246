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
    Directive,
    ErratumDirective,
    ForgetDirective,
    Mode,
    SpliceDirective,
    Verb,
)
from .errors import ErrorCode, LeylineError
from .spans import MessageAnchor, MessageSpan, Replacement, Span, TokenSpan

Tokenize = Callable[[str], Sequence[int]]


@dataclass(frozen=True, slots=True)
class ResolvedBatch:
    """Edits for the algebra, plus the non-editing directives (pin, decay, scratch) as spans."""

    edits: tuple[Edit, ...]
    marks: tuple[tuple[Verb, TokenSpan], ...] = field(default=())


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
    skill_tokens: Callable[[str], Sequence[int] | None] | None = None,
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

    edits: list[Edit] = []
    marks: list[tuple[Verb, TokenSpan]] = []
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
            edits.append(_compose(directive, length, skill_tokens, where, i))
        else:
            marks.append(
                (Verb(directive.verb), resolve_span(directive.span, spans, length, f"{where}.span"))
            )
    return ResolvedBatch(tuple(edits), tuple(marks))


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


def _compose(
    directive: ComposeDirective,
    length: int,
    skill_tokens: Callable[[str], Sequence[int] | None] | None,
    where: str,
    index: int,
) -> Edit:
    if directive.at > length:
        raise LeylineError(
            ErrorCode.invalid_span,
            f"compose position {directive.at} is past the base revision's {length} tokens",
            f"{where}.at",
        )
    tokens = skill_tokens(directive.skill) if skill_tokens else None
    if tokens is None:
        raise LeylineError(
            ErrorCode.unknown_skill, f"no skill named {directive.skill!r}", f"{where}.skill"
        )
    return Edit(directive.at, directive.at, tuple(tokens), Mode.amortize, index)
