"""The transcript model: turns, assistant tool calls, tool outputs linked to their calls.

A turn starts at each assistant message and runs up to the next one; messages before the
first assistant message are turn 0. A tool call belongs to the turn of the assistant
message that made it, and so does its output.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from .errors import TranscriptError
from .messages import ROLES, Message, canonical_json, content_text


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One entry of an assistant message's ``tool_calls``."""

    id: str
    name: str
    arguments: str
    """The raw JSON arguments string, as the model wrote it."""
    message: int
    turn: int

    def arguments_key(self) -> str:
        """Canonical arguments (key order and spacing ignored); the raw string if not JSON."""
        try:
            return canonical_json(json.loads(self.arguments))
        except ValueError:
            return self.arguments

    def argument(self, name: str) -> object:
        """One argument's value, or None when absent or the arguments are not a JSON object."""
        try:
            parsed = json.loads(self.arguments)
        except ValueError:
            return None
        return parsed.get(name) if isinstance(parsed, dict) else None


@dataclass(frozen=True, slots=True)
class ToolOutput:
    """A ``tool`` message and the call it answers."""

    message: int
    call: ToolCall
    text: str
    """The output's content as text (``""`` when it has non-text parts)."""


@dataclass(frozen=True, slots=True)
class Transcript:
    """A validated message list. Build it with :meth:`from_messages`."""

    messages: tuple[Message, ...]
    pinned: frozenset[int]
    """Messages no policy may edit (the protocol's ``pin``)."""
    turns: tuple[int, ...]
    """The turn of each message."""
    calls: tuple[ToolCall, ...]
    outputs: tuple[ToolOutput, ...]

    @classmethod
    def from_messages(
        cls, messages: Sequence[Message], *, pinned: Collection[int] = ()
    ) -> Transcript:
        """Validate and link ``messages``.

        Raises:
            TranscriptError: naming the message and the problem (unknown role, malformed
                tool call, a tool output that answers no earlier call, a duplicate).
        """
        for index in pinned:
            if not 0 <= index < len(messages):
                raise TranscriptError(
                    None, f"pinned message {index} is outside the {len(messages)} messages"
                )
        turns: list[int] = []
        calls: dict[str, ToolCall] = {}
        outputs: list[ToolOutput] = []
        answered: dict[str, int] = {}
        turn = 0
        for index, message in enumerate(messages):
            role = _role(index, message)
            if role == "assistant":
                turn += 1
                for call in _tool_calls(index, message, turn):
                    if call.id in calls:
                        raise TranscriptError(
                            index,
                            f"tool call id {call.id!r} is already used by message "
                            f"{calls[call.id].message}; call ids must be unique",
                        )
                    calls[call.id] = call
            elif role == "tool":
                call_id = message.get("tool_call_id")
                if not isinstance(call_id, str) or not call_id:
                    raise TranscriptError(index, "tool message has no 'tool_call_id'")
                if call_id not in calls:
                    raise TranscriptError(
                        index,
                        f"tool output answers call {call_id!r}, which no earlier assistant "
                        "message made",
                    )
                if call_id in answered:
                    raise TranscriptError(
                        index,
                        f"call {call_id!r} is already answered by message {answered[call_id]}",
                    )
                answered[call_id] = index
                outputs.append(ToolOutput(index, calls[call_id], content_text(message) or ""))
            turns.append(turn)
        return cls(
            messages=tuple(messages),
            pinned=frozenset(pinned),
            turns=tuple(turns),
            calls=tuple(calls.values()),
            outputs=tuple(outputs),
        )

    def __len__(self) -> int:
        return len(self.messages)

    @property
    def num_turns(self) -> int:
        return self.turns[-1] if self.turns else 0

    def role(self, index: int) -> str:
        return str(self.messages[index]["role"])

    def text(self, index: int) -> str | None:
        """Content of message ``index`` as text (None when it has non-text parts)."""
        return content_text(self.messages[index])

    def output_of(self, call: ToolCall) -> ToolOutput | None:
        return next((o for o in self.outputs if o.call.id == call.id), None)

    def calls_of(self, message: int) -> tuple[ToolCall, ...]:
        return tuple(c for c in self.calls if c.message == message)

    def tool_turns(self) -> tuple[int, ...]:
        """Turns that made at least one tool call, oldest first."""
        return tuple(sorted({c.turn for c in self.calls}))


def _role(index: int, message: Message) -> str:
    if not isinstance(message, Mapping):
        raise TranscriptError(index, f"expected a message mapping, got {type(message).__name__}")
    role = message.get("role")
    if role == "function":
        raise TranscriptError(index, "the legacy 'function' role is not supported; use 'tool'")
    if role not in ROLES:
        raise TranscriptError(index, f"unknown role {role!r}; expected one of {sorted(ROLES)}")
    content = message.get("content")
    if content is not None and not isinstance(content, str | list | tuple):
        raise TranscriptError(
            index, f"content must be text, a list of parts or null, got {type(content).__name__}"
        )
    return str(role)


def _tool_calls(index: int, message: Message, turn: int) -> list[ToolCall]:
    raw = message.get("tool_calls")
    if raw is None:
        return []
    if not isinstance(raw, list | tuple):
        raise TranscriptError(index, "'tool_calls' must be a list")
    out: list[ToolCall] = []
    for position, entry in enumerate(raw):
        where = f"tool_calls[{position}]"
        function = entry.get("function") if isinstance(entry, Mapping) else None
        call_id = entry.get("id") if isinstance(entry, Mapping) else None
        if not isinstance(call_id, str) or not call_id:
            raise TranscriptError(index, f"{where} has no 'id'")
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise TranscriptError(index, f"{where} ({call_id!r}) has no 'function.name'")
        arguments = function.get("arguments", "")
        if not isinstance(arguments, str):
            arguments = canonical_json(arguments)  # some agents pass a dict; keep it comparable
        out.append(ToolCall(call_id, str(function["name"]), arguments, index, turn))
    return out
