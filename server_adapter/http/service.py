"""What the HTTP routes call: one engine, its sessions, and the request -> cache -> reply path.

All model work runs on one worker thread (this CPU runs one forward at a time well; more
would only thrash). Routes hand it closures and await them, so requests queue fairly and a
session is only ever changed by one request at a time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TypeVar

from leyline.protocol import (
    PROTOCOL_VERSION,
    Capabilities,
    ErrorCode,
    FallbackReason,
    LeylineError,
    LeylineRequest,
    LeylineResponse,
    Path,
)
from leyline.protocol.resources import SessionInfo

from ..chat.render import ChatRenderer, RenderedChat
from ..chat.tool_format import parse_tool_calls
from ..engine import Engine
from ..reports import GenerationResult, OpReport
from ..sampling import SamplingParams
from ..session import EXECUTED_VERBS, SessionCache
from .metrics import Metrics
from .openai_types import ChatCompletionRequest, CompletionRequest, SamplingFields, ToolCall
from .registry import Evicted, SessionRegistry
from .settings import ServerSettings

T = TypeVar("T")
OnToken = Callable[[int], bool]
"""Called with each generated token id; returning False cancels the generation."""


@dataclass(frozen=True, slots=True)
class Reply:
    """One generation and what the cache did to serve it."""

    generation: GenerationResult
    leyline: LeylineResponse
    prompt_tokens: int
    content: str
    tool_calls: list[ToolCall]
    ttft: float


class LeylineService:
    def __init__(self, engine: Engine, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.model_name = settings.served_model_name or engine.loaded.name
        self.metrics = Metrics()
        self.renderer = ChatRenderer(engine.tokenizer) if engine.tokenizer is not None else None
        self.sessions = SessionRegistry(
            engine,
            max_sessions=settings.max_sessions,
            max_cache_bytes=settings.max_cache_bytes,
            on_evict=self._evicted,
        )
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="leyline-model")

    # -- the worker -------------------------------------------------------------------

    async def run(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the model worker and await it."""
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn)

    def shutdown(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)

    def _evicted(self, evicted: Evicted) -> None:
        self.metrics.evicted_sessions.labels(evicted.why).inc()

    # -- capabilities, sessions, tokens ----------------------------------------------------

    def capabilities(self) -> Capabilities:
        layouts = [] if self.engine.layout is None else [self.engine.layout.kind]
        return Capabilities(
            protocol_version=PROTOCOL_VERSION,
            verbs=list(EXECUTED_VERBS),
            architectures=layouts,
            models=[self.model_name],
            limits=self.settings.limits,
        )

    def session_info(self, session: SessionCache, include_tokens: bool = False) -> SessionInfo:
        state = session.state
        return SessionInfo(
            session=session.id,
            revision=state.revision,
            num_tokens=len(state.tokens),
            tokens=list(state.tokens) if include_tokens else None,
            spans=list(state.spans),
        )

    def require_renderer(self) -> ChatRenderer:
        if self.renderer is None:
            raise LeylineError(
                ErrorCode.invalid_directive,
                f"{self.engine.loaded.label} has no tokenizer or chat template; send token ids "
                "to /v1/completions",
            )
        return self.renderer

    # -- the request path -------------------------------------------------------------------

    def chat(self, request: ChatCompletionRequest, on_token: OnToken | None = None) -> Reply:
        renderer = self.require_renderer()
        rendered = renderer.render(request.messages, request.tools, add_generation_prompt=True)
        params = self._sampling(
            request,
            request.token_budget(self.settings.max_new_tokens),
            request.top_logprobs if request.logprobs else None,
        )
        reply = self._serve(rendered.tokens, rendered, request.leyline, params, on_token)
        content, calls = reply.content, []
        if request.tools and request.tool_choice != "none":
            content, calls = parse_tool_calls(reply.content)
        return replace(reply, content=content, tool_calls=calls)

    def complete(self, request: CompletionRequest, on_token: OnToken | None = None) -> Reply:
        if isinstance(request.prompt, str):
            tokens = self.engine.encode(request.prompt)
        else:
            tokens = tuple(request.prompt)
        params = self._sampling(
            request, request.max_tokens or self.settings.max_new_tokens, request.logprobs
        )
        return self._serve(tokens, None, request.leyline, params, on_token)

    def _sampling(
        self, request: SamplingFields, budget: int, logprobs: int | None
    ) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=budget,
            temperature=request.temperature,
            top_p=request.top_p if request.top_p < 1 else None,
            seed=request.seed,
            stop=tuple(request.stop_strings()),
            logprobs=logprobs,
        )

    def _serve(
        self,
        prompt: Sequence[int],
        rendered: RenderedChat | None,
        leyline: LeylineRequest | None,
        params: SamplingParams,
        on_token: OnToken | None,
    ) -> Reply:
        t0 = time.perf_counter()
        leyline = leyline or LeylineRequest()
        if leyline.options.infer_splices:
            # Refused rather than ignored: inference happens client-side (leyline.policies'
            # diff mode), where the agent decides that AMORTIZE semantics are acceptable.
            raise LeylineError(
                ErrorCode.invalid_directive,
                "this server does not infer splices from message diffs; send directives "
                "(leyline.policies infers them client-side) or leave infer_splices false",
                "leyline.options.infer_splices",
            )
        if leyline.directives and leyline.session is None:
            raise LeylineError(
                ErrorCode.unknown_session,
                "directives need a session: set leyline.session",
                "leyline.session",
            )
        if leyline.directives and leyline.base_revision is None:
            raise LeylineError(
                ErrorCode.invalid_directive,
                "directives need the revision they address: set leyline.base_revision",
                "leyline.base_revision",
            )
        if leyline.session is None:
            # Stateless: a throwaway session outside the registry (it still reuses and feeds
            # the shared prefix cache).
            session = self.engine.create_session()
            try:
                return self._serve_on(
                    session, prompt, rendered, leyline, params, on_token, t0, named=False
                )
            finally:
                self.engine.close_session(session.id)
        if leyline.directives:
            session = self.sessions.get(leyline.session)
        else:
            session = self.sessions.get_or_create(leyline.session)[0]
        with self.sessions.lease(session):
            return self._serve_on(session, prompt, rendered, leyline, params, on_token, t0)

    def _serve_on(
        self,
        session: SessionCache,
        prompt: Sequence[int],
        rendered: RenderedChat | None,
        leyline: LeylineRequest,
        params: SamplingParams,
        on_token: OnToken | None,
        t0: float,
        named: bool = True,
    ) -> Reply:
        edit: OpReport | None = None
        if leyline.directives:
            edit = session.apply_directives(
                leyline.directives,
                base_revision=leyline.base_revision,
                allow_fallback=leyline.options.allow_fallback,
            )
        edited_length = len(session.tokens)
        spans = rendered.spans if rendered is not None else ()
        prefill = session.prefill(prompt, spans=spans)
        first: list[float] = []

        def tick(token: int) -> bool:
            if not first:
                first.append(time.perf_counter() - t0)
            return on_token(token) if on_token is not None else True

        generation = session.generate(params, on_token=tick)
        report = _combine(edit, prefill, edited_length, len(prompt))
        response = report.to_response(session.id if named else None, tuple(spans))
        response = response.model_copy(update={"revision": generation.revision})
        self.metrics.record_cache_op(response)
        self.metrics.generated.inc(len(generation.tokens))
        ttft = first[0] if first else time.perf_counter() - t0
        self.metrics.ttft.observe(ttft)
        return Reply(generation, response, len(prompt), generation.text, [], ttft)

    def apply(
        self,
        session_id: str,
        request_directives: Sequence[object],
        base_revision: int,
        allow_fallback: bool,
    ) -> LeylineResponse:
        session = self.sessions.get(session_id)
        with self.sessions.lease(session):
            report = session.apply_directives(
                request_directives,  # type: ignore[arg-type]
                base_revision=base_revision,
                allow_fallback=allow_fallback,
            )
            response = report.to_response(session.id, session.spans)
        self.metrics.record_cache_op(response)
        return response


def _combine(edit: OpReport | None, prefill: OpReport, edited_length: int, prompt: int) -> OpReport:
    """One report for a request that may have edited the cache, then brought it to the prompt.

    ``prefilled`` counts every token computed (replacement, recomputed tail, new messages);
    ``reused`` the rest of the prompt. When the prompt diverges from the edited sequence
    before its end, the edit did not produce what the client rendered: ``token_mismatch``.
    """
    if edit is None:
        return prefill
    prefilled = min(prompt, edit.prefilled_tokens + prefill.prefilled_tokens)
    reason = edit.fallback_reason
    if reason is None and prefill.first_change < min(edited_length, prompt - 1):
        reason = FallbackReason.token_mismatch
    path = edit.path if reason is None else Path.reprefill
    return replace(
        edit,
        path=path,
        revision=prefill.revision,
        reused_tokens=prompt - prefilled,
        prefilled_tokens=prefilled,
        fallback_reason=reason,
    )
