"""Retention marks of one session (pin, decay, scratch), carried through edits. Engine-free.

A server keeps a :class:`Marks` per session and asks it three things (docs/protocol.md, 3.5):
whether a batch or a diverging prompt may run (:meth:`Marks.check_batch`,
:meth:`Marks.check_divergence`: a live pin refuses what touches it), what the marks are
after a batch ran (:meth:`Marks.after`: moved through its edits, the batch's own marks
added), and what to drop (:meth:`Marks.decays`, :meth:`Marks.scratches`, executed as edits
by :meth:`Mark.as_edit`). Times are Unix seconds of the clock the server supplies (a pin's
deadline is reported as it is, so a session's state reads the same until it changes).

A mark's edges do not take in insertions: tokens inserted exactly at its start or its end
land outside it, so a pin stays the tokens that were pinned.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from .algebra import Edit
from .directives import Mode, Verb
from .errors import ErrorCode, LeylineError
from .resolve import ResolvedMark
from .resources import MarkInfo


@dataclass(frozen=True, slots=True)
class Mark:
    """``[start, end)`` of the current revision, marked ``verb`` (pin, decay or scratch)."""

    verb: Verb
    start: int
    end: int
    seq: int
    """Order of marking: among equal priorities the older decay drops first."""
    expires_at: float | None = None
    """A pin's deadline on the server's clock; None: until unpinned."""
    priority: int = 0
    mode: Mode = Mode.forget
    replacement: tuple[int, ...] = ()

    def touched_by(self, start: int, end: int) -> bool:
        """An edit of ``[start, end)`` changes a token of the mark (or inserts inside it)."""
        if start == end:
            return self.start < start < self.end
        return start < self.end and self.start < end

    def live(self, now: float) -> bool:
        return self.expires_at is None or now < self.expires_at

    def as_edit(self, index: int = 0) -> Edit:
        """The drop of a decay or scratch mark, as the edit the server executes."""
        return Edit(self.start, self.end, self.replacement, self.mode, index)

    def info(self) -> MarkInfo:
        if self.verb is Verb.pin:
            return MarkInfo(
                verb=self.verb.value, start=self.start, end=self.end, expires_at=self.expires_at
            )
        return MarkInfo(
            verb=self.verb.value,
            start=self.start,
            end=self.end,
            priority=self.priority if self.verb is Verb.decay else None,
            mode=self.mode.value,
            replacement_tokens=len(self.replacement),
        )


def _moved_start(edits: Sequence[Edit], b: int) -> int:
    """A mark's start: edits ending at or before it (insertions at it included) shift it."""
    return b + sum(len(e.replacement) - (e.end - e.start) for e in edits if e.end <= b)


def _moved_end(edits: Sequence[Edit], b: int) -> int:
    """A mark's end: as its start, except that an insertion exactly at it stays after it."""
    return b + sum(
        len(e.replacement) - (e.end - e.start)
        for e in edits
        if e.end <= b and not (e.start == e.end == b)
    )


@dataclass(frozen=True, slots=True)
class Marks:
    """The marks of one session, in its current revision; immutable (each change returns
    a new value, so a failed request keeps the old one)."""

    marks: tuple[Mark, ...] = ()
    next_seq: int = field(default=0)

    def __len__(self) -> int:
        return len(self.marks)

    def live(self, now: float) -> Marks:
        """Without the pins whose ``ttl_s`` ran out."""
        kept = tuple(m for m in self.marks if m.live(now))
        return self if len(kept) == len(self.marks) else replace(self, marks=kept)

    def pins(self, now: float) -> list[Mark]:
        return [m for m in self.marks if m.verb is Verb.pin and m.live(now)]

    def has_pin(self, now: float) -> bool:
        return bool(self.pins(now))

    def has_timed_pin(self, now: float) -> bool:
        """A live pin with a deadline: its session must not be evicted before then."""
        return any(m.expires_at is not None for m in self.pins(now))

    def decays(self) -> list[Mark]:
        """Decay marks in the order they are dropped: lowest priority, then oldest."""
        return sorted(
            (m for m in self.marks if m.verb is Verb.decay), key=lambda m: (m.priority, m.seq)
        )

    def scratches(self) -> list[Mark]:
        return sorted((m for m in self.marks if m.verb is Verb.scratch), key=lambda m: m.start)

    def info(self, now: float) -> list[MarkInfo]:
        return [m.info() for m in sorted(self.live(now).marks, key=lambda m: m.start)]

    # -- checks (before anything changes) ----------------------------------------------------

    def check_batch(self, edits: Sequence[Edit], marks: Sequence[ResolvedMark], now: float) -> None:
        """Raise if a batch breaks a rule of section 3.5: an edit or a decay/scratch over a
        live pin (``pinned_span``), or a mark overlapping another directive of the batch
        (``overlapping_directives``)."""
        pins = self.pins(now)
        for e in edits:
            for pin in pins:
                if pin.touched_by(e.start, e.end):
                    raise _pinned(f"directives[{e.index}]", pin, f"directive {e.index} edits")
        for m in marks:
            for e in edits:
                if Mark(m.verb, m.start, m.end, 0).touched_by(e.start, e.end):
                    raise LeylineError(
                        ErrorCode.overlapping_directives,
                        f"{m.verb} span [{m.start}, {m.end}) overlaps directive {e.index}'s "
                        f"span [{e.start}, {e.end})",
                        f"directives[{m.index}].span",
                    )
            for other in marks:
                if other.index < m.index and other.start < m.end and m.start < other.end:
                    raise LeylineError(
                        ErrorCode.overlapping_directives,
                        f"{m.verb} span [{m.start}, {m.end}) overlaps directive "
                        f"{other.index}'s span [{other.start}, {other.end})",
                        f"directives[{m.index}].span",
                    )
            if m.verb in (Verb.decay, Verb.scratch):
                for pin in pins:
                    if pin.start < m.end and m.start < pin.end:
                        raise _pinned(
                            f"directives[{m.index}]", pin, f"directive {m.index} ({m.verb}) marks"
                        )

    def check_divergence(self, kept: int, length: int, now: float, where: str) -> None:
        """A prompt that keeps only ``kept`` of the session's ``length`` tokens re-prefills
        over what follows: refused if a live pin lies there."""
        if kept >= length:
            return
        for pin in self.pins(now):
            if pin.end > kept:
                raise _pinned(
                    where,
                    pin,
                    f"the prompt differs from the session from token {kept}, so it edits",
                )

    # -- changes -----------------------------------------------------------------------------

    def after(
        self, edits: Sequence[Edit], marks: Sequence[ResolvedMark] = (), now: float = 0.0
    ) -> Marks:
        """The marks once ``edits`` ran (checked by :meth:`check_batch`), then the batch's
        own ``marks`` applied in batch order, all in the new revision."""
        ordered = sorted(edits, key=lambda e: (e.start, e.end))
        out: list[Mark] = []
        for m in self.live(now).marks:
            if any(m.touched_by(e.start, e.end) for e in ordered):
                continue  # its tokens changed (a pin cannot be: check_batch refused it)
            out.append(
                replace(m, start=_moved_start(ordered, m.start), end=_moved_end(ordered, m.end))
            )
        seq = self.next_seq
        for r in sorted(marks, key=lambda r: r.index):
            start, end = _moved_start(ordered, r.start), _moved_end(ordered, r.end)

            def overlaps(m: Mark, start: int = start, end: int = end) -> bool:
                return m.start < end and start < m.end

            if r.verb is Verb.unpin:
                out = [m for m in out if not (m.verb is Verb.pin and overlaps(m))]
                continue
            # A pin replaces what it covers; a decay or scratch replaces older decays and
            # scratches (check_batch refused one over a pin).
            out = [
                m
                for m in out
                if not (overlaps(m) and (r.verb is Verb.pin or m.verb is not Verb.pin))
            ]
            expires = None if r.ttl_s is None else now + r.ttl_s
            out.append(Mark(r.verb, start, end, seq, expires, r.priority, r.mode, r.replacement))
            seq += 1
        return Marks(tuple(sorted(out, key=lambda m: (m.start, m.seq))), seq)

    def without(self, dropped: Iterable[Mark]) -> Marks:
        """The marks once ``dropped`` (decay or scratch marks of these) were executed."""
        gone = list(dropped)
        return self.after([m.as_edit(i) for i, m in enumerate(gone)])


def _pinned(where: str, pin: Mark, what: str) -> LeylineError:
    return LeylineError(
        ErrorCode.pinned_span,
        f"{what} pinned span [{pin.start}, {pin.end}): unpin it first, or leave it as it is",
        where,
    )
