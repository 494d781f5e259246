"""Values that break request shapes: wrong types, huge and negative numbers, hostile
Unicode (lone surrogates travel as raw JSON escapes), deep nesting; and a generic mutation
that puts one of them somewhere in an otherwise valid body."""

from __future__ import annotations

import json
from typing import Any

from .source import Source, below, chance, pick

LONE_SURROGATES = ("\ud800", "a\udfffb", "\udc00\ud800")
"""Python strings that ``json.dumps`` (ASCII escapes) sends as lone ``\\udXXX`` escapes."""

TEXTS = ("", " ", "x", "héllo wörld", "数据 😀", "\x00\x01", "\u202e\ufeff", "</s><|im_end|>")


def nested(depth: int, leaf: Any = 1) -> Any:
    value = leaf
    for i in range(depth):
        value = [value] if i % 2 else {"a": value}
    return value


def nasty(source: Source) -> Any:
    """One value of a wrong type, out of range, or hostile as text."""
    kind = source.integer(0, 5)
    if kind == 0:
        return pick(source, (0, -1, 1, 2**31, 2**63, 2**64, 2**70, -(2**70), 10**30))
    if kind == 1:
        return pick(source, (1.5, -0.0, 1e308, -1e-308, 0.1))
    if kind == 2:
        return pick(source, (None, True, False, [], {}, [[]], {"": None}))
    if kind == 3:
        return pick(source, (*TEXTS, "x" * 3000))
    if kind == 4:
        return pick(source, LONE_SURROGATES)
    return nested(pick(source, (3, 20, 63, 70)))


def mutate(source: Source, body: Any, rounds: int) -> Any:
    """``body`` with ``rounds`` random changes: a value replaced, a key dropped or added."""
    for _ in range(rounds):
        body = _mutate_once(source, body)
    return body


def _mutate_once(source: Source, body: Any) -> Any:
    places = list(_containers(body))
    if not places:
        return nasty(source)
    holder = places[below(source, len(places))]
    keys: list[Any] = list(holder) if isinstance(holder, dict) else list(range(len(holder)))
    key = keys[below(source, len(keys))] if keys else None
    action = source.integer(0, 2)
    if key is None or action == 2:
        if isinstance(holder, dict):
            holder[pick(source, ("extra", "mode", "verb", "session", "\ud800", ""))] = nasty(source)
        else:
            holder.append(nasty(source))
    elif action == 1:
        del holder[key]
    else:
        holder[key] = nasty(source)
    return body


def _containers(value: Any) -> list[Any]:
    found, stack = [], [value]
    while stack:
        node = stack.pop()
        if isinstance(node, dict | list):
            found.append(node)
            stack.extend(node.values() if isinstance(node, dict) else node)
    return found


def encode(body: Any) -> bytes:
    """JSON as a client would send it; ASCII escapes carry lone surrogates as ``\\udXXX``."""
    return json.dumps(body, ensure_ascii=True).encode()


def garbage(source: Source, max_body: int) -> tuple[bytes, str]:
    """A body that is not a valid request at all, and a label for the report."""
    kind = source.integer(0, 11)
    if kind == 0:
        n = source.integer(0, 48)
        return bytes(source.integer(0, 255) for _ in range(n)), "random bytes"
    if kind == 1:
        return b'{"text": "\xff\xfe"}', "invalid UTF-8"
    if kind == 2:
        return b'{"text": "\xed\xa0\x80"}', "UTF-8 of a surrogate"
    if kind == 3:
        return pick(source, (b'{"messages": [', b"{", b'{"a": 1,}', b"'x'")), "malformed JSON"
    if kind == 4:
        literal = pick(source, (b"NaN", b"Infinity", b"-Infinity", b"1e400", b"-1e400"))
        return b'{"prompt": "hi", "temperature": ' + literal + b"}", "non-finite number"
    if kind == 5:
        digits = pick(source, (b"9" * 4400, b"-" + b"1" * 5000, b"1" * 100))
        return b'{"tokens": [' + digits + b"]}", "huge integer literal"
    if kind == 6:
        depth = pick(source, (65, 200, 5000))
        return b"[" * depth + b"]" * depth, "deep nesting"
    if kind == 7:
        return pick(source, (b"[]", b'"x"', b"1", b"null", b"true", b"[{}]")), "not an object"
    if kind == 8:
        return b'{"prompt": "' + b"x" * (max_body + 1) + b'"}', "over the body limit"
    if kind == 9:
        return b'{"text": "a", "text": "\\ud800"}', "duplicate keys"
    if kind == 10:
        return encode(nested(source.integer(1, 80), pick(source, LONE_SURROGATES))), "nested"
    text = pick(source, TEXTS + LONE_SURROGATES)
    body = {"text": text} if chance(source, 50) else {text: text}
    return encode(body), "hostile text"
