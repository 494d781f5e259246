"""Retention marks on the wire: pins and policy marks as directives, and server drops
matched back to the messages they were in. Pure; :class:`~.planner.TurnPlanner` uses it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from leyline.protocol import (
    ComposeDirective,
    DecayDirective,
    ErratumDirective,
    MessageAnchor,
    MessageSpan,
    Mode,
    PinDirective,
    ScratchDirective,
    TokenSpan,
)
from leyline.protocol.envelope import DroppedSpan

from .align import align_messages
from .edits import MarkSpan
from .messages import Message, message_key
from .translate import EditDirective

MarkDirective = PinDirective | DecayDirective | ScratchDirective


@dataclass(frozen=True, slots=True)
class SentMark:
    """A ``pin``, ``decay`` or ``scratch`` directive of a plan, and the message it marks."""

    verb: str
    message: int
    """Index of the marked message among the plan's messages."""
    key: str
    """The message's key (:func:`~.messages.message_key`) as sent."""
    directive: MarkDirective
    replacement: str = ""
    """What the span becomes when the server drops it (decay, scratch)."""
    mode: Mode = Mode.forget


@dataclass(frozen=True, slots=True)
class Dropped:
    """A span the server dropped, mirrored in the transcript (``CallRecord.dropped``)."""

    verb: str
    """``decay`` (under memory pressure) or ``scratch`` (at the end of its turn)."""
    message: int
    """The message whose content it was (index among the messages sent)."""
    revision: int
    """The revision the drop made."""
    tokens: int
    """Tokens dropped."""
    replacement_tokens: int
    """Tokens of the stub left in their place."""


def mark_directives(
    *,
    served: Sequence[Message],
    sent: Sequence[Message],
    source: Sequence[int | None],
    spans: Sequence[MessageSpan],
    edits: Sequence[EditDirective],
    pins: Iterable[int],
    pin_ttl_s: float | None,
    marks: Sequence[MarkSpan],
    pinned_before: set[str],
    decaying: Mapping[str, SentMark],
) -> tuple[SentMark, ...]:
    """The marks to add to a batch addressed to ``served`` (with ``spans``).

    ``pins`` and ``marks`` address the agent's messages (``source`` maps the sent ones to
    them). A message is marked only when it is in the revision unchanged (so its span is
    known and no edit of the batch touches it), once: pins already sent
    (``pinned_before``) and decays still out (``decaying``) are not sent again. Without
    the revision's spans nothing is marked.
    """
    if not served or len(spans) != len(served):
        return ()
    same = {
        j: o
        for o, j in align_messages(served, sent)
        if o is not None and j is not None and message_key(served[o]) == message_key(sent[j])
    }
    sent_of = {a: j for j, a in enumerate(source) if a is not None}
    ranges = _edit_ranges(edits, spans)

    def free(start: int, end: int) -> bool:
        return not any(_touches(start, end, a, b) for a, b in ranges)

    out: list[SentMark] = []
    pinned_keys: set[str] = set(pinned_before)
    for agent_index in pins:
        j = sent_of.get(agent_index)
        o = same.get(j) if j is not None else None
        if j is None or o is None:
            continue
        key = message_key(sent[j])
        pinned_keys.add(key)
        span = spans[o]
        if key in pinned_before or span.end <= span.start or not free(span.start, span.end):
            continue
        pin = PinDirective(span=TokenSpan(start=span.start, end=span.end), ttl_s=pin_ttl_s)
        out.append(SentMark("pin", j, key, pin))
    for mark in marks:
        j = sent_of.get(mark.message)
        o = same.get(j) if j is not None else None
        if j is None or o is None:
            continue
        key = message_key(sent[j])
        content = spans[o].content
        if key in pinned_keys or content is None or content.end <= content.start:
            continue
        if mark.verb == "decay" and key in decaying:
            continue
        if not free(content.start, content.end):
            continue
        target = TokenSpan(start=content.start, end=content.end)
        directive: MarkDirective
        if mark.verb == "decay":
            directive = DecayDirective(
                span=target, priority=mark.priority, mode=mark.mode, replacement=mark.replacement
            )
        else:
            directive = ScratchDirective(span=target, mode=mark.mode, replacement=mark.replacement)
        out.append(SentMark(mark.verb, j, key, directive, mark.replacement, mark.mode))
    return tuple(out)


def match_drops(
    dropped: Sequence[DroppedSpan],
    spans: Sequence[MessageSpan],
    served: Sequence[Message],
    decaying: Mapping[str, SentMark],
) -> list[tuple[int, SentMark, DroppedSpan]] | None:
    """Which decayed message each of ``dropped`` was, given the ``spans`` of the revision
    before the first drop. Drops of one revision share its coordinates; each later revision
    is shifted by the ones before. None when a drop is not the content of a message whose
    decay mark is out."""
    current: list[tuple[int, int] | None] = [
        (s.content.start, s.content.end) if s.content is not None else None for s in spans
    ]
    out: list[tuple[int, SentMark, DroppedSpan]] = []
    revisions = sorted({d.revision for d in dropped})
    for revision in revisions:
        group = [d for d in dropped if d.revision == revision]
        hits: dict[int, DroppedSpan] = {}
        for drop in group:
            index = next(
                (i for i, c in enumerate(current) if c == (drop.start, drop.end) and i not in hits),
                None,
            )
            mark = decaying.get(message_key(served[index])) if index is not None else None
            if index is None or mark is None:
                return None
            hits[index] = drop
            out.append((index, mark, drop))
        moved: list[tuple[int, int] | None] = []
        for i, c in enumerate(current):
            if c is None:
                moved.append(None)
                continue
            shift = sum(d.replacement_tokens - (d.end - d.start) for d in group if d.end <= c[0])
            if i in hits:
                moved.append((c[0] + shift, c[0] + shift + hits[i].replacement_tokens))
            else:
                moved.append((c[0] + shift, c[1] + shift))
        current = moved
    return out


def _touches(start: int, end: int, a: int, b: int) -> bool:
    """An edit of ``[a, b)`` touches a mark ``[start, end)`` (as the server judges it)."""
    if a == b:
        return start < a < end
    return a < end and start < b


def _edit_ranges(
    edits: Sequence[EditDirective], spans: Sequence[MessageSpan]
) -> list[tuple[int, int]]:
    """The token ranges of the base revision the batch's edits change."""
    out: list[tuple[int, int]] = []
    for edit in edits:
        if isinstance(edit, ErratumDirective):
            continue
        if isinstance(edit, ComposeDirective):
            at = edit.at
            if isinstance(at, int):
                out.append((at, at))
            elif not isinstance(at, str) and at.message < len(spans):
                found = spans[at.message].part(at.part)
                if found is not None:
                    point = found.start if at.edge == "start" else found.end
                    out.append((point, point))
            continue
        span = getattr(edit, "span", None)
        if isinstance(span, TokenSpan):
            out.append((span.start, span.end))
        elif isinstance(span, MessageAnchor) and span.message < len(spans):
            part = spans[span.message].part(span.part)
            if part is not None:
                out.append((part.start, part.end))
    return out
