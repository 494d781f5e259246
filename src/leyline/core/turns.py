"""One chat or completions turn, as a backend runs it (``Backend.run_turn``).

What a turn asks (``Turn``, its ``SamplingParams``) and what it answers (``Outcome``, its
``GenerationResult``): plain data, no torch, so both backends and the server share them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

from leyline.core.batch import EditPlan, SessionView, common_prefix
from leyline.core.report import OpReport
from leyline.protocol.spans import MessageSpan

H = TypeVar("H")
OnToken = Callable[[int], bool]
"""Called with each generated token id; returning False cancels the generation."""
IsCancelled = Callable[[], bool]

FinishReason = Literal["stop", "length"]
"""``stop`` also covers a generation cancelled by its ``on_token`` callback."""


class Cancelled(Exception):
    """The client disconnected before its job started."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """``temperature == 0`` is greedy; otherwise softmax sampling with optional top-k/top-p.

    ``stop_token_ids=None`` means the model's end-of-sequence ids. A stop token is kept in
    the session's tokens (it is part of the rendered turn) but not in the returned text.
    ``stop`` strings end the generation once the decoded text contains one; the text is
    cut before it. ``logprobs=n`` reports, per generated token, its log-probability under
    the model's distribution (before temperature and truncation) and the ``n`` most likely
    alternatives (``0``: the chosen token's only).
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")


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


@dataclass(frozen=True, slots=True)
class Turn(Generic[H]):
    """A checked request, ready for the model: nothing has changed yet."""

    handle: H
    plan: EditPlan | None
    """The directives, planned against the leased session (None: no directives)."""
    prompt: tuple[int, ...]
    spans: tuple[MessageSpan, ...] | None
    """The prompt's message spans (chat); None for token prompts (the session's kept spans)."""
    params: SamplingParams
    on_token: OnToken
    cancelled: IsCancelled
    allow_fallback: bool = True

    def prompt_spans(self, edited: SessionView) -> tuple[MessageSpan, ...]:
        """The prompt's message spans once the plan ran (``edited``): a chat's own; for
        token ids, the spans of the messages the prompt still holds."""
        if self.spans is not None:
            return self.spans
        kept = common_prefix(edited.tokens, self.prompt)
        return tuple(span for span in edited.spans if span.end <= kept)


@dataclass(frozen=True, slots=True)
class TurnTiming:
    """Where a turn's server time went (seconds)."""

    queued: float
    """Waiting for the model before its edit and prefill ran, and between their slices."""
    service: float
    """Holding the model for the edit and the prefill."""
    decode: float
    """The generation, its decode steps batched with other sessions'."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a turn did: the edit, the prefill up to the prompt, the generation."""

    edit: OpReport | None
    prefill: OpReport
    edited: tuple[int, ...]
    """The session's tokens after the edit, before the prompt was brought in."""
    spans: tuple[MessageSpan, ...]
    generation: GenerationResult
    timing: TurnTiming | None = None
    """None where the backend does not measure it."""
