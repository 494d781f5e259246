"""Carry a revision's message -> token spans through a batch of edits.

A span boundary ``b`` moves by the length change of every edit that ends at or before it;
an insertion exactly at ``b`` belongs to what follows ``b`` (so an erratum appended at the
end belongs to no message). A boundary inside an edited span lands just after that
edit's replacement. Messages left empty are dropped and the rest renumbered in order.
"""

from __future__ import annotations

from collections.abc import Sequence

from leyline.protocol.algebra import Edit
from leyline.protocol.spans import MessageSpan, TokenSpan


def _boundary(edits: Sequence[Edit], b: int) -> int:
    shift = 0
    for e in edits:  # sorted by start, non-overlapping
        growth = len(e.replacement) - (e.end - e.start)
        if e.end <= b and not (e.start == e.end == b):
            shift += growth
        elif e.start < b < e.end:
            return e.start + shift + len(e.replacement)
    return b + shift


def _span(edits: Sequence[Edit], span: TokenSpan | None) -> TokenSpan | None:
    if span is None:
        return None
    start, end = _boundary(edits, span.start), _boundary(edits, span.end)
    return TokenSpan(start=start, end=end) if end > start else None


def remap_spans(spans: Sequence[MessageSpan], edits: Sequence[Edit]) -> tuple[MessageSpan, ...]:
    ordered = sorted(edits, key=lambda e: (e.start, e.end))
    out: list[MessageSpan] = []
    for span in spans:
        whole = _span(ordered, TokenSpan(start=span.start, end=span.end))
        if whole is None:
            continue
        out.append(
            MessageSpan(
                message=len(out),
                role=span.role,
                start=whole.start,
                end=whole.end,
                content=_span(ordered, span.content),
                tool_calls=_span(ordered, span.tool_calls),
            )
        )
    return tuple(out)
