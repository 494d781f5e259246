"""Read-only helpers over OpenAI-format chat messages (plain mappings, never mutated).

Messages stay the caller's own objects (dicts, OpenAI TypedDicts): nothing here copies or
validates more than it reads. :mod:`.transcript` does the validation.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

Message = Mapping[str, object]
"""An OpenAI-format chat message: ``role``, ``content``, ``tool_calls``, ``tool_call_id``..."""

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})

_SHAPE_FIELDS = ("role", "name", "tool_call_id", "tool_calls")


def canonical_json(value: object) -> str:
    """A stable text form (sorted keys, no spaces) for comparing JSON-like values."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def content_text(message: Message) -> str | None:
    """The message's content as text: ``""`` for none, ``None`` when a part is not text.

    A ``None`` result means the content cannot be addressed as text (an image part, say):
    callers treat such a message as a whole.
    """
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        texts: list[str] = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                return None
            text = part.get("text")
            if not isinstance(text, str):
                return None
            texts.append(text)
        return "".join(texts)
    return None


def with_content(message: Message, text: str) -> dict[str, object]:
    """A copy of ``message`` whose content is ``text``; every other field is kept."""
    copy = dict(message)
    copy["content"] = text
    return copy


def message_key(message: Message) -> str:
    """Equality key: two messages with one key render identically under any template."""
    return canonical_json({k: message.get(k) for k in (*_SHAPE_FIELDS, "content")})


def shape_key(message: Message) -> str:
    """Everything but the content: two messages of one shape differ at most in content."""
    return canonical_json({k: message.get(k) for k in _SHAPE_FIELDS})


def same_rendering(a: Message, b: Message) -> bool:
    """Same shape and same content text (``None`` content and ``""`` render alike)."""
    if shape_key(a) != shape_key(b):
        return False
    text_a, text_b = content_text(a), content_text(b)
    if text_a is None or text_b is None:
        return message_key(a) == message_key(b)
    return text_a == text_b
