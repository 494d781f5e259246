"""A splice's last build request left to the turn that follows it, and the edit's report
once that turn has answered for the request's rows (docs/vllm-design.md, step 8)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from leyline.core.report import OpReport
from leyline.protocol import FallbackReason, Path
from leyline.vllm.build import Build, BuildRequest
from leyline.vllm.link import Answer


@dataclass(frozen=True, slots=True)
class DeferredRequest:
    """A build's last request, left to the turn that follows: the turn's prompt extends the
    new sequence, so the turn, carrying the same order, loads the same rows and computes
    the same ones in the same context, then goes on (one request and its filler fewer)."""

    build: Build
    request: BuildRequest
    rotated_before: int
    """Rows the build's earlier requests rotated."""

    def settled(self, edit: OpReport, answer: Answer | None) -> OpReport:
        """The edit's report once the turn answered for the deferred request's rows."""
        if answer is None:
            return edit
        if answer.fallback_reason not in (None, FallbackReason.missing_source):
            # The worker wrote none of them: vLLM computed them, in the turn's context.
            reason = FallbackReason(answer.fallback_reason)
            reused = min(edit.reused_tokens, edit.first_change)
            return replace(
                edit,
                path=Path.reprefill,
                reused_tokens=reused,
                prefilled_tokens=edit.reused_tokens + edit.prefilled_tokens - reused,
                rotated_tokens=0,
                fallback_reason=reason,
            )
        start = answer.missing_from
        lost = 0 if start is None else self.build.kept_rows(start, self.request.length)
        if not lost and edit.fallback_reason is None:
            return edit
        return replace(
            edit,
            reused_tokens=edit.reused_tokens - lost,
            prefilled_tokens=edit.prefilled_tokens + lost,
            rotated_tokens=min(self.build.rotated, self.rotated_before + answer.rotated),
            fallback_reason=FallbackReason.missing_source,
        )
