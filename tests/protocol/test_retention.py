"""Retention marks (docs/protocol.md, 3.5): what they refuse and how they move."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from leyline.protocol import (
    Edit,
    ErrorCode,
    LeylineError,
    Marks,
    Mode,
    ResolvedMark,
    Verb,
    apply_edits,
)


def mark(verb: Verb, start: int, end: int, index: int = 0, **kw: object) -> ResolvedMark:
    return ResolvedMark(index, verb, start, end, **kw)  # type: ignore[arg-type]


def pinned(start: int, end: int, ttl_s: float | None = None) -> Marks:
    return Marks().after([], [mark(Verb.pin, start, end, ttl_s=ttl_s)], now=0.0)


@pytest.mark.parametrize(
    ("start", "end"),
    [(3, 5), (4, 12), (9, 11), (6, 6)],  # overlapping, covering, inserting inside
)
def test_an_edit_that_touches_a_pin_is_refused(start: int, end: int) -> None:
    marks = pinned(4, 10)
    with pytest.raises(LeylineError) as caught:
        marks.check_batch([Edit(start, end, (1,), Mode.amortize, 2)], [], now=1.0)
    assert caught.value.code is ErrorCode.pinned_span
    assert caught.value.field == "directives[2]"


@pytest.mark.parametrize(("start", "end"), [(0, 4), (10, 12), (4, 4), (10, 10)])
def test_edits_beside_a_pin_and_insertions_at_its_edges_run(start: int, end: int) -> None:
    marks = pinned(4, 10)
    edit = Edit(start, end, (7, 7, 7), Mode.amortize)
    marks.check_batch([edit], [], now=1.0)
    (pin,) = marks.after([edit], now=1.0).marks
    tokens = tuple(range(100, 120))
    new = apply_edits(tokens, [edit]).tokens
    assert new[pin.start : pin.end] == tokens[4:10]  # the pinned tokens, moved, not grown


def test_a_pin_expires_with_its_ttl() -> None:
    marks = pinned(4, 10, ttl_s=5.0)
    assert marks.has_timed_pin(4.9) and not marks.has_pin(5.0)
    marks.check_batch([Edit(5, 6, (1,))], [], now=5.0)  # expired: an ordinary span again
    assert marks.after([Edit(5, 6, (1,))], now=5.0).marks == ()


def test_a_diverging_prompt_cannot_re_prefill_over_a_pin() -> None:
    marks = pinned(4, 10)
    marks.check_divergence(kept=10, length=30, now=0.0, where="prompt")
    with pytest.raises(LeylineError) as caught:
        marks.check_divergence(kept=9, length=30, now=0.0, where="prompt")
    assert caught.value.code is ErrorCode.pinned_span
    marks.check_divergence(kept=9, length=9, now=0.0, where="prompt")  # only appends


def test_decay_or_scratch_over_a_pin_and_marks_over_edits_are_refused() -> None:
    marks = pinned(4, 10)
    with pytest.raises(LeylineError) as caught:
        marks.check_batch([], [mark(Verb.decay, 8, 12, 1)], now=0.0)
    assert caught.value.code is ErrorCode.pinned_span
    with pytest.raises(LeylineError) as caught:
        marks.check_batch([Edit(12, 14, (1,), index=0)], [mark(Verb.scratch, 13, 20, 1)], now=0)
    assert caught.value.code is ErrorCode.overlapping_directives
    with pytest.raises(LeylineError) as caught:
        marks.check_batch([], [mark(Verb.decay, 12, 16), mark(Verb.pin, 15, 18, 1)], now=0)
    assert caught.value.code is ErrorCode.overlapping_directives
    assert caught.value.field == "directives[1].span"


def test_an_edit_removes_a_decay_it_touches_and_moves_the_others() -> None:
    marks = Marks().after(
        [], [mark(Verb.decay, 2, 5, 0, priority=1), mark(Verb.decay, 10, 14, 1)], now=0
    )
    after = marks.after([Edit(3, 4, ()), Edit(6, 8, (9,), index=1)], now=0)
    (kept,) = after.marks
    assert (kept.start, kept.end, kept.priority) == (8, 12, 0)


def test_pins_replace_decays_and_unpin_removes_pins() -> None:
    marks = Marks().after([], [mark(Verb.decay, 2, 8), mark(Verb.scratch, 10, 12, 1)], now=0)
    marks = marks.after([], [mark(Verb.pin, 0, 11, 2)], now=0)
    assert [m.verb for m in marks.marks] == [Verb.pin]
    marks = marks.after([], [mark(Verb.unpin, 5, 6)], now=0)
    assert marks.marks == ()


def test_decays_drop_lowest_priority_then_oldest_first() -> None:
    marks = Marks().after(
        [],
        [
            mark(Verb.decay, 0, 2, 0, priority=5),
            mark(Verb.decay, 4, 6, 1, priority=1),
            mark(Verb.decay, 8, 9, 2, priority=1),
        ],
        now=0,
    )
    assert [(m.start, m.priority) for m in marks.decays()] == [(4, 1), (8, 1), (0, 5)]
    first = marks.decays()[0]
    rest = marks.without([first])
    assert [(m.start, m.end) for m in rest.marks] == [(0, 2), (6, 7)]


def test_a_drop_is_the_edit_of_its_mode_and_stub() -> None:
    marks = Marks().after(
        [], [mark(Verb.scratch, 3, 9, 0, mode=Mode.amortize, replacement=(5,))], now=0
    )
    (scratch,) = marks.scratches()
    assert scratch.as_edit(0) == Edit(3, 9, (5,), Mode.amortize, 0)


edits_strategy = st.lists(
    st.tuples(st.integers(0, 40), st.integers(0, 6), st.integers(0, 5)), max_size=4
)


@settings(max_examples=200, deadline=None)
@given(
    start=st.integers(0, 38),
    length=st.integers(1, 10),
    raw=edits_strategy,
)
def test_marked_tokens_survive_any_edits_that_do_not_touch_them(
    start: int, length: int, raw: list[tuple[int, int, int]]
) -> None:
    """Independent check: the tokens a moved mark covers are the ones it marked."""
    tokens = tuple(range(1000, 1040))
    end = min(40, start + length)
    marks = Marks().after([], [mark(Verb.decay, start, end)], now=0)
    edits: list[Edit] = []
    taken: list[tuple[int, int]] = []
    for s, n, r in raw:
        e = min(40, s + n)
        if s == e and r == 0:
            continue
        if any(a < e and s < b for a, b in taken) or any(s == e and a < s < b for a, b in taken):
            continue
        if (s == e and start < s < end) or (s < e and s < end and start < e):
            continue  # touches the mark: covered by the other tests
        taken.append((s, e))
        edits.append(Edit(s, e, tuple(range(r)), Mode.amortize, len(edits)))
    try:
        new = apply_edits(tokens, edits).tokens
    except LeylineError:
        return  # e.g. two insertions' order rules; the algebra's own tests cover them
    (moved,) = marks.after(edits, now=0).marks
    assert new[moved.start : moved.end] == tokens[start:end]
