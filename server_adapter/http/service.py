"""The reference server's request path: chat and completions on the session core.

Sessions, revisions, leases, limits and the ``/leyline/v1`` operations are the core's
(``core.service``); this adds what only the reference engine serves: a generation after
the cache was brought to the prompt. A request is checked whole on the event loop (its
sampling fields, the revision it addresses, its directives, the prompt's tokens) before any
model work is queued, so a rejected request changes nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

from leyline.protocol import (
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
from ..core.batch import EditPlan, check_revision, check_tokens, common_prefix
from ..core.service import SessionService
from ..core.sessions import DEFAULT_TENANT, Evicted, Session, SessionStore, salt_of
from ..engine import Engine
from ..engine_backend import EngineBackend
from ..reports import GenerationResult, OpReport
from ..sampling import SamplingParams
from ..session import SessionCache
from .metrics import Metrics
from .openai_types import ChatCompletionRequest, CompletionRequest, SamplingFields, ToolCall
from .retokenize import adopt_generated_ids
from .settings import ServerSettings

T = TypeVar("T")
OnToken = Callable[[int], bool]
"""Called with each generated token id; returning False cancels the generation."""
IsCancelled = Callable[[], bool]


class Cancelled(Exception):
    """The client disconnected before its job started."""


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
        self.backend = EngineBackend(engine, limits=settings.limits, model_name=self.model_name)
        self.sessions: SessionStore[SessionCache] = SessionStore(
            self.backend,
            max_sessions=settings.max_sessions,
            max_cache_bytes=settings.max_cache_bytes,
            on_evict=self._evicted,
        )
        self.core = SessionService(self.backend, self.sessions, on_op=self.metrics.record_cache_op)

    # -- the worker -------------------------------------------------------------------

    async def run(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the model worker and await it."""
        return await self.backend.run(fn)

    def shutdown(self) -> None:
        self.backend.shutdown()

    def _evicted(self, evicted: Evicted) -> None:
        self.metrics.evicted_sessions.labels(evicted.why).inc()

    # -- capabilities, sessions, tokens ----------------------------------------------------

    @property
    def renderer(self) -> ChatRenderer | None:
        return self.backend.renderer

    def capabilities(self) -> Capabilities:
        return self.backend.capabilities()

    def session_info(
        self, session: Session[SessionCache], include_tokens: bool = False
    ) -> SessionInfo:
        return self.core.info(session, include_tokens)

    def require_renderer(self) -> ChatRenderer:
        return self.backend.require_renderer()

    # -- the request path -------------------------------------------------------------------

    async def chat(
        self,
        request: ChatCompletionRequest,
        on_token: OnToken | None = None,
        *,
        tenant: str = DEFAULT_TENANT,
        cancelled: IsCancelled = lambda: False,
    ) -> Reply:
        params = self._sampling(
            request,
            request.token_budget(self.settings.max_new_tokens),
            request.top_logprobs if request.logprobs else None,
        )
        renderer = self.require_renderer()
        rendered = await asyncio.to_thread(
            renderer.render, request.messages, request.tools, add_generation_prompt=True
        )
        reply = await self._serve(
            tenant,
            request.cache_salt,
            rendered.tokens,
            rendered,
            request.leyline,
            params,
            on_token,
            cancelled,
        )
        content, calls = reply.content, list[ToolCall]()
        if request.tools and request.tool_choice != "none":
            content, calls = parse_tool_calls(reply.content)
        return replace(reply, content=content, tool_calls=calls)

    async def complete(
        self,
        request: CompletionRequest,
        on_token: OnToken | None = None,
        *,
        tenant: str = DEFAULT_TENANT,
        cancelled: IsCancelled = lambda: False,
    ) -> Reply:
        params = self._sampling(
            request, request.max_tokens or self.settings.max_new_tokens, request.logprobs
        )
        if isinstance(request.prompt, str):
            tokens = await asyncio.to_thread(self.engine.encode, request.prompt)
        else:
            tokens = tuple(request.prompt)
        return await self._serve(
            tenant, request.cache_salt, tokens, None, request.leyline, params, on_token, cancelled
        )

    def _sampling(
        self, request: SamplingFields, budget: int, logprobs: int | None
    ) -> SamplingParams:
        try:
            return SamplingParams(
                max_new_tokens=budget,
                temperature=request.temperature,
                top_p=request.top_p if request.top_p < 1 else None,
                seed=request.seed,
                stop=tuple(request.stop_strings()),
                logprobs=logprobs,
            )
        except ValueError as exc:
            raise LeylineError(ErrorCode.invalid_directive, str(exc)) from None

    async def _serve(
        self,
        tenant: str,
        cache_salt: str | None,
        prompt: Sequence[int],
        rendered: RenderedChat | None,
        leyline: LeylineRequest | None,
        params: SamplingParams,
        on_token: OnToken | None,
        cancelled: IsCancelled,
    ) -> Reply:
        t0 = time.perf_counter()
        leyline = leyline or LeylineRequest()
        _check_request(leyline)
        check_tokens(prompt, self.engine.vocab_size, self.backend.limits, "prompt")
        _check_room(prompt, self.backend.limits.max_session_tokens)
        if leyline.session is None:
            # Stateless: a throwaway session outside the store (it still reuses and feeds
            # the shared prefix cache).
            handle = self.backend.open(salt_of(tenant, cache_salt))
            try:
                return await self._run_on(
                    handle, None, None, prompt, rendered, params, on_token, cancelled, t0
                )
            finally:
                self.backend.close(handle)
        created = False
        if leyline.directives or self.sessions.exists(tenant, leyline.session):
            session = self.sessions.get(tenant, leyline.session)
        else:
            session = self.sessions.create(tenant, leyline.session, cache_salt=cache_salt)
            created = True
        try:
            async with self.sessions.lease(session):
                check_revision(session.handle.view, leyline.base_revision)
                if rendered is not None and not leyline.directives:
                    adopted = adopt_generated_ids(
                        session.handle.tokens,
                        prompt,
                        rendered.spans,
                        self.engine.decode,
                        self.engine.loaded.eos_token_ids,
                    )
                    if adopted is not None:  # the reply came back as it was generated
                        prompt = adopted[0]
                        rendered = replace(rendered, tokens=adopted[0], spans=adopted[1])
                _check_room(prompt, self.backend.limits.max_session_tokens)
                plan = None
                if leyline.directives:
                    plan = await self.core.plan(session, leyline.directives, leyline.base_revision)
                return await self._run_on(
                    session.handle,
                    session.id,
                    plan,
                    prompt,
                    rendered,
                    params,
                    on_token,
                    cancelled,
                    t0,
                    allow_fallback=leyline.options.allow_fallback,
                )
        except BaseException:
            if created and self.sessions.exists(tenant, session.id):
                self.sessions.delete(tenant, session.id)  # a rejected request creates nothing
            raise

    async def _run_on(
        self,
        handle: SessionCache,
        session_id: str | None,
        plan: EditPlan | None,
        prompt: Sequence[int],
        rendered: RenderedChat | None,
        params: SamplingParams,
        on_token: OnToken | None,
        cancelled: IsCancelled,
        t0: float,
        *,
        allow_fallback: bool = True,
    ) -> Reply:
        def work() -> Reply:
            if cancelled():
                raise Cancelled  # the client left while this waited in the queue
            return self._generate(
                handle, session_id, plan, prompt, rendered, params, on_token, t0, allow_fallback
            )

        return await self.backend.run(work)

    def _generate(
        self,
        session: SessionCache,
        session_id: str | None,
        plan: EditPlan | None,
        prompt: Sequence[int],
        rendered: RenderedChat | None,
        params: SamplingParams,
        on_token: OnToken | None,
        t0: float,
        allow_fallback: bool,
    ) -> Reply:
        """On the worker: the edit, the prompt's prefill, the generation."""
        edit: OpReport | None = None
        if plan is not None:
            edit = session.execute(plan, allow_fallback=allow_fallback)
        edited = session.tokens
        if rendered is not None:
            spans = rendered.spans
        else:  # token ids: the messages the prompt still holds keep their spans
            kept = common_prefix(edited, prompt)
            spans = tuple(span for span in session.spans if span.end <= kept)
        prefill = session.prefill(prompt, spans=spans)
        first: list[float] = []

        def tick(token: int) -> bool:
            if not first:
                first.append(time.perf_counter() - t0)
            return on_token(token) if on_token is not None else True

        generation = session.generate(params, on_token=tick)
        report = _combine(edit, prefill, edited, prompt)
        response = report.to_response(session_id, tuple(spans))
        response = response.model_copy(update={"revision": generation.revision})
        self.metrics.record_cache_op(response)
        self.metrics.generated.inc(len(generation.tokens))
        ttft = first[0] if first else time.perf_counter() - t0
        self.metrics.ttft.observe(ttft)
        return Reply(generation, response, len(prompt), generation.text, [], ttft)


def _check_room(prompt: Sequence[int], cap: int | None) -> None:
    """A generation needs room for one token after the prompt: refused before any change."""
    if cap is not None and len(prompt) >= cap:
        raise LeylineError(
            ErrorCode.session_too_long,
            f"the prompt is {len(prompt)} tokens; this server takes at most {cap} in a "
            "session, generated tokens included: shorten it or forget part of the session",
            "prompt",
        )


def _check_request(leyline: LeylineRequest) -> None:
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


def _combine(
    edit: OpReport | None, prefill: OpReport, edited: Sequence[int], prompt: Sequence[int]
) -> OpReport:
    """One report for a request that may have edited the cache, then brought it to the prompt.

    ``prefilled`` counts every token computed (replacement, recomputed tail, new messages);
    ``reused`` the rest of the prompt. When the prompt diverges from the edited sequence
    before the edited sequence ends, the edit did not produce what the client rendered: the
    prompt was prefilled over it (``reprefill`` / ``token_mismatch``) and the report counts
    only that prefill, since the edit's work (its rotations included) was discarded.
    """
    if edit is None:
        return prefill
    diverged = common_prefix(edited, prompt) < min(len(edited), len(prompt) - 1)
    if diverged:
        return replace(
            prefill,
            path=Path.reprefill,
            rotated_tokens=0,
            fallback_reason=edit.fallback_reason or FallbackReason.token_mismatch,
        )
    n = len(prompt)
    prefilled = min(n, edit.prefilled_tokens + prefill.prefilled_tokens)
    return replace(
        edit,
        revision=prefill.revision,
        reused_tokens=n - prefilled,
        prefilled_tokens=prefilled,
    )
