"""What each session operation reports back: the protocol's path and token counts."""

from __future__ import annotations

from dataclasses import dataclass

from leyline.protocol.envelope import LeylineResponse, Path
from leyline.protocol.fallback import FallbackReason
from leyline.protocol.spans import MessageSpan

from .sampling import FinishReason


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


@dataclass(frozen=True, slots=True)
class TokenChoice:
    """One generated token with its log-probability and the most likely alternatives."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class GenerationResult:
    tokens: tuple[int, ...]
    """Every token generated, a final stop token included (it stays in the session)."""
    text: str
    """Decoded text without the stop token and cut before a matched stop string."""
    finish_reason: FinishReason
    revision: int
    prefill: OpReport
    """How the context was brought up to date before the first token."""
    seconds: float = 0.0
    logprobs: tuple[TokenChoice, ...] = ()
    """One per generated token when ``SamplingParams.logprobs`` is set."""
