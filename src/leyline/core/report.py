"""What an operation on a session reports: the protocol's path and token counts."""

from __future__ import annotations

from dataclasses import dataclass

from leyline.protocol.envelope import LeylineResponse, Path
from leyline.protocol.fallback import FallbackReason
from leyline.protocol.spans import MessageSpan


@dataclass(frozen=True, slots=True)
class OpReport:
    """One operation on a session, in the protocol's terms.

    ``path`` is ``splice`` (downstream KV kept and re-rotated), ``reprefill`` (prefilled
    again from the first changed token: FORGET, or a fallback with ``fallback_reason``),
    or ``prefix_hit`` (the sequence was extended; nothing cached was recomputed).
    """

    path: Path
    revision: int
    reused_tokens: int
    prefilled_tokens: int
    rotated_tokens: int = 0
    first_change: int = 0
    fallback_reason: FallbackReason | None = None
    seconds: float = 0.0

    def to_response(
        self, session: str | None, spans: tuple[MessageSpan, ...] = ()
    ) -> LeylineResponse:
        return LeylineResponse(
            session=session,
            revision=self.revision,
            path=self.path,
            reused_tokens=self.reused_tokens,
            prefilled_tokens=self.prefilled_tokens,
            rotated_tokens=self.rotated_tokens,
            fallback_reason=self.fallback_reason,
            spans=list(spans),
        )
