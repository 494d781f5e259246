"""What a generation reports back (``OpReport``, the cache's part, lives in the core)."""

from __future__ import annotations

from dataclasses import dataclass

from leyline.core.report import OpReport
from leyline.engine.sampling import FinishReason

__all__ = ["GenerationResult", "OpReport", "TokenChoice"]


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
