"""What policies emit: message-level edits, each with the mode it wants.

Edits address messages of the transcript they were proposed on. :func:`apply_to_messages`
turns them into the edited message list (what an agent would send without Leyline);
:mod:`.translate` turns them into protocol directives.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from leyline.protocol import Mode

from .errors import PolicyEditError
from .messages import Message, with_content


@dataclass(frozen=True, slots=True)
class ReplaceContent:
    """Replace message ``message``'s content with ``text`` (a stub, or a restored text)."""

    message: int
    text: str
    mode: Mode = Mode.amortize
    reason: str = ""


@dataclass(frozen=True, slots=True)
class ReplaceMessage:
    """Replace message ``message`` whole with ``replacement`` (role, tool calls and content).

    For what :class:`ReplaceContent` cannot say: an assistant message whose tool-call
    arguments were cleared, or a summary standing in for the first message of a range whose
    other messages are dropped. The result must still be a valid transcript.
    """

    message: int
    replacement: Message
    mode: Mode = Mode.amortize
    reason: str = ""


@dataclass(frozen=True, slots=True)
class KeepServed:
    """Send message ``message`` with the text the server has cached, not the agent's text.

    Unlike :class:`ReplaceContent` it is not remembered across turns: the agent's own text
    stays what policies see next turn (so they can tell what the agent changed since).
    """

    message: int
    text: str
    reason: str = ""


@dataclass(frozen=True, slots=True)
class DropMessages:
    """Remove whole messages (e.g. a failed call together with its outputs)."""

    messages: tuple[int, ...]
    mode: Mode = Mode.amortize
    reason: str = ""


@dataclass(frozen=True, slots=True)
class AppendErratum:
    """Append a correction note as a new message, leaving the cached prefix untouched.

    ``corrects`` names the message whose value the note overrides. ``after`` places the
    note after that message instead of at the end (used when replaying edits).
    """

    text: str
    corrects: int | None = None
    role: str = "user"
    after: int | None = None
    reason: str = ""


@dataclass(frozen=True, slots=True)
class MarkSpan:
    """Mark message ``message``'s content ``decay`` or ``scratch`` on a Leyline server: no
    token changes now; the server drops the span later (``decay``: under memory pressure,
    lowest ``priority`` first; ``scratch``: once the generation that follows completes),
    leaving ``replacement`` in its place, executed as ``mode``.

    A mark changes nothing in the transcript (:func:`apply_to_messages` ignores it) and is
    not remembered across turns: the planner sends it once, and mirrors the drop when the
    server reports it (the message then holds ``replacement``). Policies propose marks only
    where ``PolicyContext.retention`` says the server executes them.
    """

    message: int
    verb: Literal["decay", "scratch"]
    replacement: str
    priority: int = 0
    mode: Mode = Mode.forget
    reason: str = ""


PolicyEdit = ReplaceContent | ReplaceMessage | KeepServed | DropMessages | AppendErratum | MarkSpan


def touched(edit: PolicyEdit) -> tuple[int, ...]:
    """The existing messages an edit changes (errata and marks change none)."""
    if isinstance(edit, ReplaceContent | ReplaceMessage | KeepServed):
        return (edit.message,)
    if isinstance(edit, DropMessages):
        return edit.messages
    return ()


@dataclass(frozen=True, slots=True)
class AppliedEdits:
    """The edited list, and for each of its messages the input index it came from."""

    messages: tuple[Message, ...]
    source: tuple[int | None, ...]
    """``source[j]``: index in the input of message ``j``; None for an appended erratum."""


def check_edits(policy: str, length: int, edits: Sequence[PolicyEdit]) -> None:
    """Indices in range, and no message changed by two edits.

    Raises:
        PolicyEditError: naming the policy and the offending edit.
    """
    owner: dict[int, int] = {}
    for k, edit in enumerate(edits):
        after = edit.after if isinstance(edit, AppendErratum) else None
        if after is not None and not -1 <= after < length:
            raise PolicyEditError(
                policy,
                f"edit {k} places a note after message {after}, outside the {length} messages",
            )
        if isinstance(edit, MarkSpan) and not 0 <= edit.message < length:
            raise PolicyEditError(
                policy, f"edit {k} marks message {edit.message}, outside the {length} messages"
            )
        for index in touched(edit):
            if not 0 <= index < length:
                raise PolicyEditError(
                    policy, f"edit {k} addresses message {index}, outside the {length} messages"
                )
            if index in owner:
                raise PolicyEditError(
                    policy, f"edits {owner[index]} and {k} both change message {index}"
                )
            owner[index] = k


def apply_to_messages(messages: Sequence[Message], edits: Sequence[PolicyEdit]) -> AppliedEdits:
    """Apply ``edits`` (all addressing ``messages``) at once; ``messages`` is not modified.

    Errata without ``after`` go at the end in edit order; those with ``after=i`` follow
    message ``i`` (``-1``: before the first), in edit order, even if ``i`` was dropped.
    """
    check_edits("<apply>", len(messages), edits)
    replaced = {e.message: e.text for e in edits if isinstance(e, ReplaceContent | KeepServed)}
    whole = {e.message: e.replacement for e in edits if isinstance(e, ReplaceMessage)}
    dropped = {i for e in edits if isinstance(e, DropMessages) for i in e.messages}
    notes = [e for e in edits if isinstance(e, AppendErratum)]
    out: list[Message] = []
    source: list[int | None] = []

    def notes_after(index: int) -> None:
        for note in notes:
            if note.after == index:
                out.append({"role": note.role, "content": note.text})
                source.append(None)

    notes_after(-1)
    for index, message in enumerate(messages):
        if index not in dropped:
            if index in whole:
                out.append(whole[index])
            elif index in replaced:
                out.append(with_content(message, replaced[index]))
            else:
                out.append(message)
            source.append(index)
        notes_after(index)
    for note in notes:
        if note.after is None:
            out.append({"role": note.role, "content": note.text})
            source.append(None)
    return AppliedEdits(tuple(out), tuple(source))


def readdress(edit: PolicyEdit, source: Sequence[int | None], policy: str) -> PolicyEdit:
    """``edit``, proposed on an edited list, addressed to the list it was edited from.

    ``source`` is :attr:`AppliedEdits.source`. Editing an appended note cannot be
    readdressed (the note has no original) and raises :class:`PolicyEditError`.
    """

    def original(index: int) -> int:
        found = source[index]
        if found is None:
            raise PolicyEditError(policy, f"edits message {index}, a note appended by an edit")
        return found

    if isinstance(edit, ReplaceContent):
        return ReplaceContent(original(edit.message), edit.text, edit.mode, edit.reason)
    if isinstance(edit, ReplaceMessage):
        return ReplaceMessage(original(edit.message), edit.replacement, edit.mode, edit.reason)
    if isinstance(edit, KeepServed):
        return KeepServed(original(edit.message), edit.text, edit.reason)
    if isinstance(edit, DropMessages):
        return DropMessages(tuple(original(i) for i in edit.messages), edit.mode, edit.reason)
    if isinstance(edit, MarkSpan):
        return MarkSpan(
            original(edit.message),
            edit.verb,
            edit.replacement,
            edit.priority,
            edit.mode,
            edit.reason,
        )
    corrects = source[edit.corrects] if edit.corrects is not None else None
    after = edit.after
    if after is not None and after >= 0:  # after the nearest message that has an original
        after = max((s for s in source[: after + 1] if s is not None), default=-1)
    return AppendErratum(edit.text, corrects, edit.role, after, edit.reason)
