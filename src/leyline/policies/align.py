"""Align two message lists: which old message became which new one.

Equal messages pair first (``difflib`` on whole-message keys); inside each changed region,
messages of the same shape (role, name, tool_call_id, tool_calls) pair as content changes.
The rest are deletions ``(i, None)`` and insertions ``(None, j)``. Pairs are monotone in
both indices, which is all :mod:`.translate` needs: any such alignment yields directives
that turn the old tokens into the new ones; a closer one yields smaller edits.
"""

from __future__ import annotations

from collections.abc import Sequence
from difflib import SequenceMatcher

from .messages import Message, message_key, shape_key

Pair = tuple[int | None, int | None]


def align_messages(old: Sequence[Message], new: Sequence[Message]) -> tuple[Pair, ...]:
    matcher = SequenceMatcher(
        None, [message_key(m) for m in old], [message_key(m) for m in new], autojunk=False
    )
    pairs: list[Pair] = []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            pairs.extend(zip(range(i1, i2), range(j1, j2), strict=True))
        else:
            pairs.extend(_by_shape(old, new, i1, i2, j1, j2))
    return tuple(pairs)


def _by_shape(
    old: Sequence[Message], new: Sequence[Message], i1: int, i2: int, j1: int, j2: int
) -> list[Pair]:
    matcher = SequenceMatcher(
        None,
        [shape_key(old[i]) for i in range(i1, i2)],
        [shape_key(new[j]) for j in range(j1, j2)],
        autojunk=False,
    )
    pairs: list[Pair] = []
    for tag, a1, a2, b1, b2 in matcher.get_opcodes():
        if tag == "equal":
            pairs.extend(zip(range(i1 + a1, i1 + a2), range(j1 + b1, j1 + b2), strict=True))
        else:
            pairs.extend((i, None) for i in range(i1 + a1, i1 + a2))
            pairs.extend((None, j) for j in range(j1 + b1, j1 + b2))
    return pairs


def alignment_from_source(old_length: int, source: Sequence[int | None]) -> tuple[Pair, ...]:
    """The exact alignment of an edit result (``source[j]``: old index of new message j)."""
    pairs: list[Pair] = []
    cursor = 0
    for j, origin in enumerate(source):
        if origin is not None:
            pairs.extend((i, None) for i in range(cursor, origin))
            cursor = origin + 1
        pairs.append((origin, j))
    pairs.extend((i, None) for i in range(cursor, old_length))
    return tuple(pairs)
