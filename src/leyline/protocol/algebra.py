"""The edit algebra: a batch of resolved edits applied to a token sequence, engine-free.

Every engine and the SDK call :func:`apply_edits`; nothing else derives positions. The
result says, for each run of the new sequence, whether its KV is reused as is (``kept``,
rotated by ``delta`` when that is non-zero), computed fresh (``inserted``), or recomputed
because it lies downstream of a FORGET (``recompute``).

Rules (normative, see docs/protocol.md):

* All edits address the same base sequence. Spans must lie in ``[0, len(base)]`` and must
  not overlap; touching spans are fine. Insertions at one position apply in batch order,
  before a span that starts there.
* An edit with an empty span and an empty replacement changes nothing and is rejected.
* Leading replacement tokens equal to the span's are kept, not recomputed (the KV of a
  token depends only on the tokens before it), so splicing a span with itself is the
  identity.
* Everything after the start of the earliest FORGET is recomputed.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from .directives import Mode
from .errors import ErrorCode, LeylineError

RunKind = Literal["kept", "inserted", "recompute"]


@dataclass(frozen=True, slots=True)
class Edit:
    """Tokens ``[start, end)`` of the base replaced by ``replacement``, executed per ``mode``.

    ``index`` is the position of the originating directive in its batch (for error paths).
    """

    start: int
    end: int
    replacement: tuple[int, ...] = ()
    mode: Mode = Mode.amortize
    index: int = 0


@dataclass(frozen=True, slots=True)
class Run:
    """New positions ``[new_start, new_end)``; ``old_start`` is None for inserted tokens."""

    kind: RunKind
    new_start: int
    new_end: int
    old_start: int | None = None

    def __len__(self) -> int:
        return self.new_end - self.new_start

    @property
    def delta(self) -> int:
        """How far the run's tokens moved (new minus old position); 0 for inserted runs."""
        return 0 if self.old_start is None else self.new_start - self.old_start


@dataclass(frozen=True, slots=True)
class PositionMap:
    """Which old positions survive, and where. Built from the runs of an :class:`EditResult`."""

    old_length: int
    runs: tuple[Run, ...]  # runs with an old_start, ordered by old_start

    def new_position(self, old: int) -> int | None:
        if not 0 <= old < self.old_length:
            raise IndexError(f"old position {old} outside [0, {self.old_length})")
        i = bisect.bisect_right([r.old_start or 0 for r in self.runs], old) - 1
        if i < 0:
            return None
        run = self.runs[i]
        assert run.old_start is not None
        offset = old - run.old_start
        return run.new_start + offset if offset < len(run) else None

    def delta(self, old: int) -> int | None:
        new = self.new_position(old)
        return None if new is None else new - old

    def as_list(self) -> list[int | None]:
        """``result[old] = new position or None``; O(old_length), for tests and debugging."""
        out: list[int | None] = [None] * self.old_length
        for run in self.runs:
            assert run.old_start is not None
            for k in range(len(run)):
                out[run.old_start + k] = run.new_start + k
        return out


@dataclass(frozen=True, slots=True)
class EditResult:
    tokens: tuple[int, ...]
    runs: tuple[Run, ...]
    position_map: PositionMap
    first_change: int
    """New position of the first token whose KV is not reused unmoved (len(tokens) if none)."""

    @property
    def reused_tokens(self) -> int:
        return sum(len(r) for r in self.runs if r.kind == "kept")

    @property
    def rotated_tokens(self) -> int:
        return sum(len(r) for r in self.runs if r.kind == "kept" and r.delta != 0)

    @property
    def prefilled_tokens(self) -> int:
        return sum(len(r) for r in self.runs if r.kind != "kept")

    @property
    def is_identity(self) -> bool:
        return self.first_change == len(self.tokens) == self.position_map.old_length


def validate_edits(length: int, edits: Sequence[Edit]) -> list[Edit]:
    """Check ranges and overlaps against a base of ``length`` tokens; return them in order.

    Raises:
        LeylineError: ``invalid_span`` or ``overlapping_directives``, naming the directive.
    """
    for edit in edits:
        field = f"directives[{edit.index}]"
        if not 0 <= edit.start <= edit.end <= length:
            raise LeylineError(
                ErrorCode.invalid_span,
                f"span [{edit.start}, {edit.end}) is outside the base revision's "
                f"{length} tokens; address tokens in [0, {length}]",
                field,
            )
        if edit.start == edit.end and not edit.replacement:
            raise LeylineError(
                ErrorCode.invalid_span,
                f"empty span at {edit.start} with an empty replacement changes nothing; "
                "drop the directive or give it a span or a replacement",
                field,
            )
    ordered = sorted(edits, key=lambda e: (e.start, e.end))  # stable: batch order on ties
    reach, owner = 0, None
    for edit in ordered:
        if owner is not None and edit.start < reach:
            raise LeylineError(
                ErrorCode.overlapping_directives,
                f"directives {owner.index} [{owner.start}, {owner.end}) and {edit.index} "
                f"[{edit.start}, {edit.end}) overlap; merge them into one directive",
                f"directives[{edit.index}]",
            )
        if edit.end >= reach:
            reach, owner = edit.end, edit
    return ordered


def replacement_spans(length: int, edits: Sequence[Edit]) -> list[tuple[int, int]]:
    """Where each edit's replacement lands in the new sequence, ``[start, end)``, in the
    order the edits are given (e.g. a composed block, to address it in the next batch).

    Raises:
        LeylineError: as :func:`validate_edits`.
    """
    validate_edits(length, edits)
    order = sorted(range(len(edits)), key=lambda i: (edits[i].start, edits[i].end))
    out: list[tuple[int, int]] = [(0, 0)] * len(edits)
    shift = 0
    for i in order:  # stable: batch order on ties, as apply_edits
        edit = edits[i]
        start = edit.start + shift
        out[i] = (start, start + len(edit.replacement))
        shift += len(edit.replacement) - (edit.end - edit.start)
    return out


def _trim_common_prefix(base: Sequence[int], edit: Edit) -> Edit:
    k = 0
    limit = min(edit.end - edit.start, len(edit.replacement))
    while k < limit and base[edit.start + k] == edit.replacement[k]:
        k += 1
    if k == 0:
        return edit
    return Edit(edit.start + k, edit.end, edit.replacement[k:], edit.mode, edit.index)


def apply_edits(base: Sequence[int], edits: Sequence[Edit]) -> EditResult:
    """Apply a batch of edits to ``base`` all at once; ``base`` is never modified.

    Raises:
        LeylineError: when the batch breaks a rule; nothing is applied then.
    """
    ordered = validate_edits(len(base), edits)
    tokens: list[int] = []
    runs: list[Run] = []
    cursor = 0
    forgetting = False

    def keep(old_start: int, old_end: int) -> None:
        if old_end > old_start:
            kind: RunKind = "recompute" if forgetting else "kept"
            runs.append(Run(kind, len(tokens), len(tokens) + old_end - old_start, old_start))
            tokens.extend(base[old_start:old_end])

    for edit in (_trim_common_prefix(base, e) for e in ordered):
        if edit.start == edit.end and not edit.replacement:
            continue  # the replacement equalled the span: nothing left to do
        keep(cursor, edit.start)
        forgetting = forgetting or edit.mode == Mode.forget  # plain "forget" strings too
        if edit.replacement:
            runs.append(Run("inserted", len(tokens), len(tokens) + len(edit.replacement)))
            tokens.extend(edit.replacement)
        cursor = edit.end
    keep(cursor, len(base))

    runs = _merge(runs)
    first_change = next(
        (r.new_start for r in runs if r.kind != "kept" or r.delta != 0), len(tokens)
    )
    survivors = tuple(
        sorted((r for r in runs if r.old_start is not None), key=lambda r: r.old_start or 0)
    )
    return EditResult(
        tokens=tuple(tokens),
        runs=tuple(runs),
        position_map=PositionMap(len(base), survivors),
        first_change=first_change,
    )


def _merge(runs: list[Run]) -> list[Run]:
    """Join neighbouring runs of one kind that are contiguous in the old sequence too."""
    merged: list[Run] = []
    for run in runs:
        prev = merged[-1] if merged else None
        if prev is not None and _joinable(prev, run):
            merged[-1] = Run(run.kind, prev.new_start, run.new_end, prev.old_start)
        else:
            merged.append(run)
    return merged


def _joinable(prev: Run, run: Run) -> bool:
    if prev.kind != run.kind or prev.new_end != run.new_start:
        return False
    if run.old_start is None:  # two inserted runs
        return True
    return prev.old_start is not None and prev.old_start + len(prev) == run.old_start
