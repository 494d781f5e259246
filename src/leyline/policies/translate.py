"""Message edits -> protocol directives, addressed with the spans the server reported.

One path serves both sources of edits: policy edits (:func:`edits_to_directives`) and an
agent's own rewrite of its message list (:func:`infer_directives`, "diff mode"); both reduce
to an old message list, a new one and an alignment, which :func:`plan_directives` turns
into a batch.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from leyline.protocol import ErratumDirective, MessageAnchor, MessageSpan, Mode, TokenSpan

from .align import Pair, align_messages, alignment_from_source
from .directive_builder import (
    Addressing,
    DirectiveBuilder,
    EditDirective,
    Render,
    Unexpressible,
    check_alignment,
)
from .edits import (
    AppendErratum,
    DropMessages,
    PolicyEdit,
    ReplaceContent,
    ReplaceMessage,
    apply_to_messages,
)
from .messages import Message
from .skill_refs import SkillBlock

__all__ = [
    "Addressing",
    "DirectivePlan",
    "EditDirective",
    "Render",
    "edits_to_directives",
    "infer_directives",
    "plan_directives",
]


@dataclass(frozen=True, slots=True)
class DirectivePlan:
    """A batch for the server's cached revision, and the messages to send with it."""

    messages: tuple[Message, ...]
    directives: tuple[EditDirective, ...] = ()
    appended: int = 0
    """Trailing messages that only extend the cached ones (they need no directive)."""
    fallback: str | None = None
    """Why the change cannot be sent as directives; then send ``messages`` without any and
    the server re-prefills from the first difference."""
    notes: tuple[str, ...] = ()
    """Why skill messages went as text rather than as composes."""
    tail_replaced: bool = False
    """The batch replaces the given ``tail``; nothing else may delete it."""


def plan_directives(
    old: Sequence[Message],
    new: Sequence[Message],
    *,
    alignment: Sequence[Pair] | None = None,
    spans: Sequence[MessageSpan] = (),
    render: Render | None = None,
    addressing: Addressing = "auto",
    forget: Collection[int] = (),
    skills: Mapping[int, SkillBlock] | None = None,
    tail: TokenSpan | None = None,
    replace_tail: bool = False,
) -> DirectivePlan:
    """Directives that turn the tokens of ``old`` into those of ``new`` (minus appended ones).

    * a message whose content changed (same role, ids and tool calls) -> a splice of its
      ``content`` part, with the new text (or, given ``render``, the server's own tokens);
    * messages removed -> a splice of each one ``all`` (or one token span over them);
    * messages inserted or replaced whole -> a token-span splice whose replacement is the new
      messages as the server renders them. That needs ``render`` (the server's tokenize of a
      message list); without it the plan falls back: send the messages, the server re-prefills;
    * messages after the last cached one -> no directive: the request's messages extend the
      session (cached messages they replace are removed first). When the batch edits anyway
      and the cached tail (generation prompt, reply) holds a reply that was not sent back
      (``replace_tail``), the first of them replaces the tail given ``render``, so the server
      keeps the tokens the two share;
    * a new skill message (``skills``) whose registered block is exactly its tokens in the new
      rendering -> a ``compose`` where the message goes instead of its tokens. Among the
      appended messages that needs ``tail`` (the cached generation prompt and reply), which the
      batch then replaces with the messages before the skill.

    Args:
        old: the messages of the server's cached revision.
        new: the messages to send now.
        alignment: which old message became which new one; computed when None.
        spans: the revision's message spans as the server reported them.
        render: the server's rendering, for inserted or wholly replaced messages.
        addressing: see :data:`Addressing`.
        forget: old messages whose removal must leave no influence (FORGET, not AMORTIZE).
        skills: new message index -> the skill it was registered as (composed when its
            block is the message's tokens in ``render``'s rendering of ``new``).
        tail: the cached tokens after the last old message (generation prompt, reply),
            when known; needed to compose a skill among the appended messages.
        replace_tail: ``tail`` holds a reply the agent did not send back. When the batch
            edits anyway, the first appended message replaces it (the server keeps the
            tokens the two share) instead of leaving it to be deleted.
    """
    pairs = tuple(alignment) if alignment is not None else align_messages(old, new)
    check_alignment(pairs, len(old), len(new))
    if spans and len(spans) != len(old):
        spans = ()  # spans of another revision: do not address with them
    use_tokens = addressing == "token" or (addressing == "auto" and bool(spans))
    builder = DirectiveBuilder(
        old, new, spans, render, use_tokens, frozenset(forget), skills, tail, replace_tail
    )
    try:
        directives, appended = builder.build(pairs)
    except Unexpressible as exc:
        return DirectivePlan(tuple(new), fallback=str(exc))
    return DirectivePlan(
        tuple(new),
        tuple(directives),
        appended,
        notes=tuple(builder.notes),
        tail_replaced=builder.tail_replaced,
    )


def infer_directives(
    old: Sequence[Message],
    new: Sequence[Message],
    *,
    spans: Sequence[MessageSpan] = (),
    render: Render | None = None,
    addressing: Addressing = "auto",
    mode: Mode = Mode.amortize,
) -> DirectivePlan:
    """Diff mode: directives for an agent that rewrote its message list from ``old`` to ``new``."""
    forget = range(len(old)) if mode is Mode.forget else ()
    return plan_directives(
        old, new, spans=spans, render=render, addressing=addressing, forget=forget
    )


def edits_to_directives(
    messages: Sequence[Message],
    edits: Sequence[PolicyEdit],
    *,
    spans: Sequence[MessageSpan] = (),
    render: Render | None = None,
    addressing: Addressing = "auto",
    errata: Literal["message", "directive"] = "message",
) -> DirectivePlan:
    """Directives for policy ``edits`` proposed on ``messages`` (the cached revision).

    ``errata="message"`` (default) sends each note as an appended message: the chat request
    then renders exactly the cached tokens plus the note, on any server. ``"directive"``
    sends ``erratum`` directives instead, for clients that work on tokens, not messages.
    """
    notes = [e for e in edits if isinstance(e, AppendErratum)] if errata == "directive" else []
    applied = apply_to_messages(messages, [e for e in edits if e not in notes])
    forget = {
        i
        for e in edits
        if isinstance(e, ReplaceContent | ReplaceMessage | DropMessages) and e.mode is Mode.forget
        for i in (e.messages if isinstance(e, DropMessages) else (e.message,))
    }
    plan = plan_directives(
        messages,
        applied.messages,
        alignment=alignment_from_source(len(messages), applied.source),
        spans=spans,
        render=render,
        addressing=addressing,
        forget=forget,
    )
    if not notes or plan.fallback:
        return plan
    use_tokens = addressing == "token" or (addressing == "auto" and bool(spans))
    extra = tuple(
        ErratumDirective(text=f"\n{n.text}\n", corrects=_whole(n.corrects, spans, use_tokens))
        for n in notes
    )
    return replace(plan, directives=plan.directives + extra)


def _whole(
    index: int | None, spans: Sequence[MessageSpan], use_tokens: bool
) -> MessageAnchor | TokenSpan | None:
    if index is None:
        return None
    if use_tokens and index < len(spans):
        return TokenSpan(start=spans[index].start, end=spans[index].end)
    return MessageAnchor(message=index)
