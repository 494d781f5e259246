"""A chat or completions turn on SGLang: the edit in the scheduler, then an ordinary generate.

The session core has checked and planned the request (``http.service.LeylineService``);
here the plan runs through ``SglangBackend.execute`` (a splice in the radix tree, or a
FORGET purge), and the prompt is generated from by SGLang itself: its prefix match finds
the spliced KV, so only the new messages (and the tokens a splice left to it) are
prefilled. The session then holds the prompt and the generated ids, as on the reference
server. Imports no SGLang: the generator is the link (``tokenizer_side``).
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from leyline.core.backend import Rendered
from leyline.core.batch import SessionView, common_prefix
from leyline.core.openai_types import ChatMessage, ToolSpec
from leyline.core.report import OpReport
from leyline.engine.reports import GenerationResult, TokenChoice
from leyline.engine.sampling import FinishReason, SamplingParams
from leyline.protocol import Path
from leyline.serve.turns import Cancelled, OnToken, Outcome, Turn
from leyline.sglang.backend import SglangBackend, SglangSession


@dataclass(frozen=True, slots=True)
class Generated:
    """One SGLang generation: ids (a final stop id included), text, and what it reused."""

    ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason
    cached_tokens: int
    """Prompt tokens SGLang's prefix match reused (``meta_info.cached_tokens``)."""
    logprobs: tuple[TokenChoice, ...] = ()


class Generator(Protocol):
    async def generate(
        self,
        tokens: Sequence[int],
        params: SamplingParams,
        on_token: OnToken,
        salt: str | None = None,
    ) -> Generated:
        """Generate after ``tokens`` in cache namespace ``salt`` (a session's own, once it
        composed); ``on_token`` per id, False stops (finish ``stop``)."""
        ...


class SglangRunner:
    """``Runner[SglangSession]`` over one SGLang server."""

    def __init__(
        self, backend: SglangBackend, generator: Generator, stop_token_ids: Collection[int]
    ) -> None:
        self.backend = backend
        self.generator = generator
        self._stops = tuple(stop_token_ids)

    @property
    def tokenizer(self) -> Any | None:
        return self.backend.tokenizer

    @property
    def stop_token_ids(self) -> Collection[int]:
        return self._stops

    def decode(self, tokens: Sequence[int]) -> str:
        return self.backend.decode(tokens)

    def render(self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec] | None) -> Rendered:
        return self.backend.render_chat(messages, tools, add_generation_prompt=True)

    async def run(self, turn: Turn[SglangSession]) -> Outcome:
        if turn.cancelled():
            raise Cancelled
        t0 = time.perf_counter()
        handle = turn.handle
        edit = None
        if turn.plan is not None:
            edit = await self.backend.execute(handle, turn.plan, allow_fallback=turn.allow_fallback)
        edited = handle.view
        if turn.spans is not None:
            spans = turn.spans
        else:  # token ids: the messages the prompt still holds keep their spans
            kept = common_prefix(edited.tokens, turn.prompt)
            spans = tuple(span for span in edited.spans if span.end <= kept)
        prompt = turn.prompt
        if prompt[: len(edited.tokens)] != edited.tokens:
            handle.realigned(edited.tokens, prompt)  # the tree keeps what it had cached
        revision = edited.revision if prompt == edited.tokens else edited.revision + 1
        # The prompt is the session's from here (the generate caches it), even if the
        # generation then fails: the view never claims tokens SGLang was not given.
        handle.view = SessionView(prompt, revision, spans)
        out = await self.generator.generate(prompt, turn.params, turn.on_token, handle.salt)
        reused = min(out.cached_tokens, len(prompt))
        shared = common_prefix(edited.tokens, prompt)
        path = Path.prefix_hit if shared == len(edited.tokens) else Path.reprefill
        prefill = OpReport(path, revision, reused, len(prompt) - reused, first_change=shared)
        handle.view = SessionView(prompt + out.ids, revision + 1, spans)
        handle.cached(prompt + out.ids[:-1])  # SGLang never computes the last id's KV
        generation = GenerationResult(
            out.ids,
            out.text,
            out.finish_reason,
            revision + 1,
            prefill,
            time.perf_counter() - t0,
            out.logprobs,
        )
        return Outcome(edit, prefill, edited.tokens, spans, generation)
