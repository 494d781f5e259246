"""How a splice that keeps downstream KV is built with vLLM's requests (no vLLM import).

vLLM caches full blocks only, and a request computes everything from the first position it
neither finds cached nor gets loaded by the connector. So the new sequence is built by
requests of growing prefixes, each computing one inserted run: ``new[:e]`` with ``e`` the
run's end rounded up to a block (the kept tokens in that block are computed fresh, in
context: exact). The last request is the whole sequence; it caches every full block under
the session's private salt. Rows whose source block was never cached (a sequence's last
partial block: vLLM caches full blocks only) are computed too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from leyline.protocol.algebra import PositionMap
from leyline.vllm.link import RowRun, runs_of


def cached_end(computed: int, block_size: int) -> int:
    """Positions below this are in full blocks vLLM cached, when ``computed`` leading
    tokens of a sequence were computed."""
    return computed - computed % block_size


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


@dataclass(frozen=True, slots=True)
class BuildPlan:
    """The rows to load and the requests that build the new sequence."""

    runs: tuple[RowRun, ...]
    """Kept rows whose source is cached, never the new sequence's last token."""
    prefix_ends: tuple[int, ...]
    """Lengths of the prefixes run before the whole sequence (one per inserted run)."""

    @property
    def loaded(self) -> int:
        return sum(run.length for run in self.runs)


def plan_build(
    position_map: PositionMap, new_length: int, source_computed: int, block_size: int
) -> BuildPlan:
    """The build of a ``new_length``-token sequence keeping the rows ``position_map`` keeps,
    from a source whose first ``source_computed`` tokens were computed."""
    runs = clipped(
        runs_of(position_map),
        source_end=cached_end(source_computed, block_size),
        dest_from=0,
        dest_end=new_length - 1,
    )
    ends: list[int] = []
    position = 0  # what the requests so far leave cached (a multiple of the block size)
    while True:
        gap = _covered_to(runs, position)  # the first row neither cached nor loaded
        resumes = [run.dest_start for run in runs if run.dest_start > gap]
        if gap >= new_length - 1 or not resumes:
            break  # the whole sequence's request computes the rest
        end = -(-min(resumes) // block_size) * block_size
        if end >= new_length:
            break
        ends.append(end)  # a request of new[:end] computes the gap, to a block boundary
        position = end
    return BuildPlan(runs, tuple(ends))


def _covered_to(runs: Sequence[RowRun], position: int) -> int:
    """The end of the loaded rows that run on without a gap from ``position``."""
    end = position
    for run in runs:
        if run.dest_start <= end < run.dest_start + run.length:
            end = run.dest_start + run.length
    return end
