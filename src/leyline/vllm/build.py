"""How a splice that keeps downstream KV is built with vLLM's requests (no vLLM import).

vLLM caches whole blocks only, and a request computes everything from the first position it
neither finds cached nor gets loaded by the connector. So every request of a build ends on
a block boundary: a prefix that ends inside a block is padded with filler tokens up to it
(the filler's rows are computed and cached with it, and never read). Protocol 3.1 then
holds exactly: every kept row is loaded (its key rotated), only the inserted runs and the
new last token are computed.

1. The old sequence's rows come from its cached blocks. When a kept row sits in its last,
   partial block, one request of the old sequence plus filler caches that block first,
   under the old namespace (``old_rows``; it loads the rows that block holds as copies, the
   session's recipe, and computes the rest in context, as they were computed before).
2. Per inserted run ``new[p:q]``: a request of ``new[:q]`` plus filler, under the private
   namespace, loads every row before ``p`` (the previous request's rows as they are, kept
   rows rotated) and computes the run in context.
3. The whole sequence plus filler loads every row but the last, which it computes in its
   new context (protocol 3.1). Its cached copy of the last partial block is the session's
   recipe: every later request on the sequence loads those rows from it.

A COMPOSE is built the same way: its block is an inserted run whose seam is computed (step
2) and whose rest is **borrowed**: loaded like kept rows, from a held skill's blocks
(``LoadSource.hold``), keys rotated by the block's position less the skill's anchor.

When a turn follows whose prompt extends the new sequence, the backend leaves the last of
these requests to the turn: carrying the same order, the turn loads the same rows, computes
the same ones in the same context and goes on, so that request and its filler are saved.
The recipe is then that order.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

from leyline.protocol.algebra import PositionMap
from leyline.vllm.link import LoadSource, Order, RowRun, runs_of


def cached_end(computed: int, block_size: int) -> int:
    """Positions below this are in full blocks vLLM cached, when ``computed`` leading
    tokens of a sequence were computed."""
    return computed - computed % block_size


def padded(tokens: Sequence[int], block_size: int) -> tuple[int, ...]:
    """``tokens`` plus filler (its last token repeated) up to a block boundary."""
    tokens = tuple(tokens)
    return tokens + tokens[-1:] * (-len(tokens) % block_size)


def clipped(
    runs: Sequence[RowRun], *, source_end: int, dest_from: int, dest_end: int
) -> tuple[RowRun, ...]:
    """``runs`` restricted to source positions below ``source_end`` and destination
    positions in ``[dest_from, dest_end)``."""
    out = []
    for run in runs:
        first = max(0, dest_from - run.dest_start)
        last = min(run.length, source_end - run.source_start, dest_end - run.dest_start)
        if last > first:
            out.append(RowRun(run.source_start + first, run.dest_start + first, last - first))
    return tuple(out)


def recipe_of(salt: str | None, tokens: Sequence[int], length: int) -> Order:
    """Rows ``[0, length)`` of ``tokens`` cached under ``salt``, loaded as they are."""
    return Order(load=(LoadSource(salt, tuple(tokens), (RowRun(0, 0, length),)),))


def recipe_within(recipe: Order | None, end: int) -> Order | None:
    """``recipe`` for destination positions below ``end`` only (None if none are left)."""
    if recipe is None:
        return None
    sources = []
    for source in recipe.load:
        runs = clipped(source.runs, source_end=sys.maxsize, dest_from=0, dest_end=end)
        if runs:
            sources.append(LoadSource(source.salt, source.tokens, runs))
    return Order(load=tuple(sources)) if sources else None


def old_rows_needed(position_map: PositionMap, new_length: int, computed: int, block: int) -> bool:
    """Whether a kept row other than the new last token sits in the old sequence's last
    partial block (step 1)."""
    tail = cached_end(computed, block)
    kept = clipped(runs_of(position_map), source_end=computed, dest_from=0, dest_end=new_length - 1)
    return any(run.source_start + run.length > tail for run in kept)


@dataclass(frozen=True, slots=True)
class Borrowed:
    """Rows of the new sequence read from a held skill (``hold``, its key): a composed
    block past its seam."""

    hold: str
    run: RowRun


@dataclass(frozen=True, slots=True)
class BuildRequest:
    """One request of a build: its prompt and the rows it loads."""

    tokens: tuple[int, ...]
    order: Order
    length: int
    """How many of ``tokens`` are the new sequence's (the rest: filler)."""


@dataclass(frozen=True, slots=True)
class Build:
    requests: tuple[BuildRequest, ...]
    """Steps 2 and 3, in order, all under the private namespace."""
    recipe: Order
    """Where later requests load the new sequence's rows from (step 3's cached copy)."""
    kept: tuple[RowRun, ...]
    """The old rows the new sequence keeps (every one loaded, keys rotated where it moves)."""
    inserted: int
    """Tokens the inserted runs add (computed in context, or borrowed)."""
    borrowed: tuple[Borrowed, ...] = ()
    """Rows loaded from held skills (composed blocks past their seams)."""

    @property
    def loaded(self) -> tuple[RowRun, ...]:
        """Every row the build loads rather than computes: kept and borrowed."""
        return self.kept + tuple(b.run for b in self.borrowed)

    @property
    def rotated(self) -> int:
        """Loaded rows that move (keys rotated)."""
        return sum(run.length for run in self.loaded if run.shift != 0)

    @property
    def holds(self) -> frozenset[str]:
        return frozenset(b.hold for b in self.borrowed)

    def kept_rows(self, start: int = 0, end: int = sys.maxsize) -> int:
        """Loaded rows (kept or borrowed) at destination positions in ``[start, end)``."""
        return sum(
            run.length
            for run in clipped(self.loaded, source_end=sys.maxsize, dest_from=start, dest_end=end)
        )


def plan_build(
    old: tuple[str | None, Sequence[int]],
    old_computed: int,
    new: Sequence[int],
    position_map: PositionMap,
    salt: str,
    block_size: int,
    borrowed: Sequence[Borrowed] = (),
) -> Build:
    """The requests that build ``new`` under ``salt`` keeping the rows ``position_map``
    keeps, read from ``old`` (a salt and a cached sequence: its first ``old_computed``
    tokens' rows are the old ones), and the ``borrowed`` rows from held skills (inside
    inserted runs; never the new last token, computed in context as protocol 3.4 asks)."""
    new, n = tuple(new), len(new)
    old_salt, old_tokens = old[0], tuple(old[1])
    kept = clipped(runs_of(position_map), source_end=old_computed, dest_from=0, dest_end=n - 1)
    lent = tuple(
        Borrowed(b.hold, run)
        for b in borrowed
        for run in clipped((b.run,), source_end=sys.maxsize, dest_from=0, dest_end=n - 1)
    )
    inserted = _gaps(runs_of(position_map) + tuple(b.run for b in borrowed), n)
    requests: list[BuildRequest] = []
    done: tuple[int, ...] = ()  # the previous request's tokens (its rows: as they are)
    done_end = 0

    def order_to(end: int) -> Order:
        sources = []
        if done_end:
            sources.append(LoadSource(salt, done, (RowRun(0, 0, done_end),)))
        rows = clipped(kept, source_end=sys.maxsize, dest_from=done_end, dest_end=end)
        if rows:
            sources.append(LoadSource(old_salt, old_tokens, rows))
        for hold in dict.fromkeys(b.hold for b in lent):
            runs = clipped(
                [b.run for b in lent if b.hold == hold],
                source_end=sys.maxsize,
                dest_from=done_end,
                dest_end=end,
            )
            if runs:
                sources.append(LoadSource(None, (), runs, hold))
        return Order(load=tuple(sources))

    for start, end in inserted:
        tokens = padded(new[:end], block_size)
        requests.append(BuildRequest(tokens, order_to(start), end))
        done, done_end = tokens, end
    whole = padded(new, block_size)
    if done_end < n:  # else the last run's request computed the sequence to its end
        requests.append(BuildRequest(whole, order_to(n - 1), n))
    inserted_tokens = sum(end - start for start, end in inserted) + sum(
        b.run.length for b in borrowed
    )
    return Build(tuple(requests), recipe_of(salt, whole, n), kept, inserted_tokens, lent)


def _gaps(kept: Sequence[RowRun], length: int) -> list[tuple[int, int]]:
    """The destination ranges ``kept`` leaves out of ``[0, length)``: the inserted runs."""
    gaps, at = [], 0
    for run in sorted(kept, key=lambda r: r.dest_start):
        if run.dest_start > at:
            gaps.append((at, run.dest_start))
        at = max(at, run.dest_start + run.length)
    if at < length:
        gaps.append((at, length))
    return gaps
