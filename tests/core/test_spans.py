"""Message -> token spans carried through edits."""

from __future__ import annotations

from leyline.core.spans import remap_spans
from leyline.protocol.algebra import Edit
from leyline.protocol.directives import Mode
from leyline.protocol.spans import MessageSpan, TokenSpan

A = Mode.amortize
SPANS = (
    MessageSpan(message=0, role="system", start=0, end=10, content=TokenSpan(start=2, end=9)),
    MessageSpan(message=1, role="user", start=10, end=30, content=TokenSpan(start=13, end=29)),
    MessageSpan(message=2, role="tool", start=30, end=50, content=TokenSpan(start=33, end=49)),
)


def _bounds(spans):
    return [
        (s.message, s.start, s.end, s.content and (s.content.start, s.content.end)) for s in spans
    ]


def test_an_edit_inside_a_message_resizes_it_and_shifts_the_rest() -> None:
    out = remap_spans(SPANS, [Edit(15, 25, (1, 2), A)])
    assert _bounds(out) == [(0, 0, 10, (2, 9)), (1, 10, 22, (13, 21)), (2, 22, 42, (25, 41))]


def test_dropping_a_whole_message_renumbers_the_rest() -> None:
    out = remap_spans(SPANS, [Edit(10, 30, (), A)])
    assert _bounds(out) == [(0, 0, 10, (2, 9)), (1, 10, 30, (13, 29))]
    assert out[1].role == "tool"


def test_an_appended_erratum_belongs_to_no_message() -> None:
    out = remap_spans(SPANS, [Edit(50, 50, (7,) * 5, A)])
    assert _bounds(out) == _bounds(SPANS)


def test_an_insertion_at_a_boundary_joins_the_following_message() -> None:
    out = remap_spans(SPANS, [Edit(30, 30, (7, 7), A)])
    assert _bounds(out)[1:] == [(1, 10, 30, (13, 29)), (2, 30, 52, (35, 51))]


def test_a_batch_moves_boundaries_by_every_edit_before_them() -> None:
    out = remap_spans(SPANS, [Edit(40, 45, (), A), Edit(3, 5, (1, 1, 1, 1), A)])
    assert _bounds(out) == [(0, 0, 12, (2, 11)), (1, 12, 32, (15, 31)), (2, 32, 47, (35, 46))]
