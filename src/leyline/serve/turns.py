"""One chat or completions turn, as the OpenAI routes and the backends' runners see it.

The service (``service.LeylineService``) checks a request whole, leases its session and
plans its directives; a ``Runner`` then does the model work of the turn on its backend:
execute the plan, bring the cache to the prompt, generate. The reference engine's runner
(``engine_runner``) does it on the model worker; SGLang's (``sglang.runner``) through the
scheduler. The OpenAI routes speak only to this interface, so both servers share them.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from leyline.core.backend import Rendered
from leyline.core.batch import EditPlan
from leyline.core.openai_types import ChatMessage, ToolCall, ToolSpec
from leyline.core.report import OpReport
from leyline.engine.reports import GenerationResult
from leyline.engine.sampling import SamplingParams
from leyline.protocol import LeylineResponse
from leyline.protocol.spans import MessageSpan

H = TypeVar("H")
OnToken = Callable[[int], bool]
"""Called with each generated token id; returning False cancels the generation."""
IsCancelled = Callable[[], bool]


class Cancelled(Exception):
    """The client disconnected before its job started."""


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
    """What a runner did: the edit, the prefill up to the prompt, the generation."""

    edit: OpReport | None
    prefill: OpReport
    edited: tuple[int, ...]
    """The session's tokens after the edit, before the prompt was brought in."""
    spans: tuple[MessageSpan, ...]
    generation: GenerationResult
    timing: TurnTiming | None = None
    """None where the runner does not measure it."""


@dataclass(frozen=True, slots=True)
class Reply:
    """One generation and what the cache did to serve it."""

    generation: GenerationResult
    leyline: LeylineResponse
    prompt_tokens: int
    content: str
    tool_calls: list[ToolCall]
    ttft: float


class Runner(Protocol[H]):
    """The model side of a turn on one backend."""

    @property
    def tokenizer(self) -> Any | None:
        """The HF tokenizer (token bytes in logprobs), or None (token ids only)."""
        ...

    @property
    def stop_token_ids(self) -> Collection[int]:
        """Ids that end a generation and are not shown as text."""
        ...

    def decode(self, tokens: Sequence[int]) -> str: ...

    def render(self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec] | None) -> Rendered:
        """A chat request's prompt (generation prompt included) with its message spans;
        ``invalid_directive`` if the model has no chat template."""
        ...

    async def run(self, turn: Turn[H]) -> Outcome:
        """Execute the plan, prefill the prompt, generate; raise ``Cancelled`` if the client
        left before the model work started (then nothing changed)."""
        ...
