"""One request's report when it edited the session and then prefilled the prompt: the two
reports' tokens add up, and a fallback either of them declared is the request's."""

from __future__ import annotations

from leyline.core.report import OpReport
from leyline.protocol import FallbackReason, Path
from leyline.serve.service import _combine

EDITED = tuple(range(100, 120))
PROMPT = (*EDITED, 7, 8)


def _edit(reason: FallbackReason | None = None) -> OpReport:
    return OpReport(Path.splice, 2, 17, 3, rotated_tokens=11, first_change=4,
                    fallback_reason=reason)  # fmt: skip


def _prefill(reason: FallbackReason | None = None) -> OpReport:
    return OpReport(Path.prefix_hit, 3, 19, 3, first_change=20, fallback_reason=reason)


def test_the_edit_and_the_prefill_add_up() -> None:
    report = _combine(_edit(), _prefill(), EDITED, PROMPT)
    assert (report.path, report.revision, report.rotated_tokens) == (Path.splice, 3, 11)
    assert (report.prefilled_tokens, report.reused_tokens) == (6, 16)
    assert report.fallback_reason is None


def test_a_fallback_of_either_is_the_requests() -> None:
    missing = FallbackReason.missing_source
    assert _combine(_edit(), _prefill(missing), EDITED, PROMPT).fallback_reason == missing
    aligned = FallbackReason.page_alignment
    assert _combine(_edit(aligned), _prefill(), EDITED, PROMPT).fallback_reason == aligned
    assert _combine(_edit(aligned), _prefill(missing), EDITED, PROMPT).fallback_reason == aligned
