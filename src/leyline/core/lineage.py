"""Where a session's earlier publications sit in its current sequence, for FORGET.

A session publishes its exact prefix to the shared prefix cache after every change. After a
splice before some span, or a client re-sending edited messages, the blocks published
earlier hold that span behind a different prefix: purging the current sequence alone would
leave them reusable. So each published sequence (a *lineage*) carries, position by position,
where its token is now (or None once removed), updated through every edit with the
algebra's position map, and through a re-prefill by a diff of the old and new tokens. A
FORGET of ``[start, end)`` then purges each lineage from its first position that is now
inside the span.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from leyline.protocol.algebra import PositionMap


@dataclass
class _Lineage:
    tokens: tuple[int, ...]
    now: list[int | None]
    """``now[i]``: the current position of ``tokens[i]``, or None once it was removed."""


class Lineages:
    def __init__(self) -> None:
        self._items: list[_Lineage] = []

    def __len__(self) -> int:
        return len(self._items)

    def copy(self) -> Lineages:
        other = Lineages()
        other._items = [_Lineage(item.tokens, list(item.now)) for item in self._items]
        return other

    def published(self, tokens: Sequence[int], length: int | None = None) -> None:
        """``tokens`` (the current sequence's prefix) is now in the cache as it stands.
        ``length``: only its first ``length`` tokens are the sequence's; the rest is filler
        (cached with it to fill a block), tracked as no position, purged with the rest."""
        tokens = tuple(tokens)
        length = len(tokens) if length is None else length
        # A publication that is an unmoved prefix of this one is the same lineage, grown.
        self._items = [
            item
            for item in self._items
            if not (
                tokens[: len(item.tokens)] == item.tokens
                and all(pos == i for i, pos in enumerate(item.now))
            )
        ]
        now = [i if i < length else None for i in range(len(tokens))]
        self._items.append(_Lineage(tokens, now))

    def moved(self, position_map: PositionMap) -> None:
        """An edit ran: every tracked position follows it (or drops out)."""
        for item in self._items:
            item.now = [None if p is None else position_map.new_position(p) for p in item.now]
        self._prune()

    def realigned(self, old: Sequence[int], new: Sequence[int]) -> None:
        """The sequence was replaced by a prefill of ``new`` (a client re-sent edited
        messages): every run of tokens that ``old`` and ``new`` share, as a diff finds them,
        keeps its place; the rest drops out. A coincidental match only ever widens a later
        purge, never narrows it."""
        where: dict[int, int] = {}
        matcher = difflib.SequenceMatcher(None, list(old), list(new), autojunk=False)
        for block in matcher.get_matching_blocks():
            for k in range(block.size):
                where[block.a + k] = block.b + k
        for item in self._items:
            item.now = [None if p is None else where.get(p) for p in item.now]
        self._prune()

    def forgotten(self, spans: Iterable[tuple[int, int]]) -> list[tuple[tuple[int, ...], int]]:
        """For spans ``[start, end)`` of the current sequence being forgotten: each lineage
        that holds any of their tokens, and its first position holding one."""
        ranges = [(s, e) for s, e in spans if e > s]
        out = []
        for item in self._items:
            first = next(
                (
                    i
                    for i, p in enumerate(item.now)
                    if p is not None and any(s <= p < e for s, e in ranges)
                ),
                None,
            )
            if first is not None:
                out.append((item.tokens, first))
        return out

    def _prune(self) -> None:
        self._items = [item for item in self._items if any(p is not None for p in item.now)]
