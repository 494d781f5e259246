"""The request path of chat and completions, on the session core, for either backend.

Sessions, revisions, leases, limits and the ``/leyline/v1`` operations are the core's
(``core.service``); this adds a generation after the cache was brought to the prompt. A
request is checked whole on the event loop (its sampling fields, the revision it addresses,
its directives, the prompt's tokens) before any model work starts, so a rejected request
changes nothing. The model work of a turn is the backend's (``Backend.run_turn``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Generic, TypeVar

from leyline.core.backend import Backend
from leyline.core.batch import EditPlan, check_revision, check_tokens, common_prefix
from leyline.core.chat.render import Rendered
from leyline.core.chat.tool_format import parse_tool_calls
from leyline.core.openai_types import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    ToolCall,
)
from leyline.core.report import OpReport
from leyline.core.service import SessionService, with_composed, with_dropped
from leyline.core.sessions import DEFAULT_TENANT, Evicted, Session, SessionStore, salt_of
from leyline.core.turns import (
    Cancelled,
    GenerationResult,
    IsCancelled,
    OnToken,
    Outcome,
    SamplingParams,
    Turn,
)
from leyline.protocol import (
    Capabilities,
    ErrorCode,
    FallbackReason,
    LeylineError,
    LeylineRequest,
    LeylineResponse,
    Path,
    Timing,
)
from leyline.protocol.resources import SessionInfo
from leyline.serve.metrics import Metrics
from leyline.serve.retokenize import adopt_generated_ids
from leyline.serve.settings import ServerSettings

__all__ = ["Cancelled", "IsCancelled", "LeylineService", "OnToken", "Reply"]

H = TypeVar("H")


@dataclass(frozen=True, slots=True)
class Reply:
    """One generation and what the cache did to serve it."""

    generation: GenerationResult
    leyline: LeylineResponse
    prompt_tokens: int
    content: str
    tool_calls: list[ToolCall]
    ttft: float


class LeylineService(Generic[H]):
    def __init__(
        self,
        backend: Backend[H],
        settings: ServerSettings,
        *,
        model_name: str,
    ) -> None:
        self.backend = backend
        self.settings = settings
        self.model_name = model_name
        self.metrics = Metrics()
        self.sessions: SessionStore[H] = SessionStore(
            backend,
            max_sessions=settings.max_sessions,
            max_cache_bytes=settings.max_cache_bytes,
            tenant_max_sessions=settings.tenant_max_sessions,
            tenant_max_cache_bytes=settings.tenant_max_cache_bytes,
            on_evict=self._evicted,
        )
        self.core = SessionService(backend, self.sessions, on_op=self.metrics.record_cache_op)

    def _evicted(self, evicted: Evicted) -> None:
        self.metrics.evicted_sessions.labels(evicted.why).inc()

    # -- capabilities, sessions, tokens ----------------------------------------------------

    def capabilities(self) -> Capabilities:
        return self.backend.capabilities()

    def session_info(self, session: Session[H], include_tokens: bool = False) -> SessionInfo:
        return self.core.info(session, include_tokens)

    def decode(self, tokens: Sequence[int]) -> str:
        return self.backend.decode(tokens)

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
        rendered = await asyncio.to_thread(
            lambda: self.backend.renderer.render(
                request.messages, request.tools, add_generation_prompt=True
            )
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
            tokens = await asyncio.to_thread(self.backend.encode, request.prompt)
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
        rendered: Rendered | None,
        leyline: LeylineRequest | None,
        params: SamplingParams,
        on_token: OnToken | None,
        cancelled: IsCancelled,
    ) -> Reply:
        t0 = time.perf_counter()
        leyline = leyline or LeylineRequest()
        _check_request(leyline)
        if cache_salt is not None:
            self.core.check_salt(cache_salt)
        check_tokens(prompt, self.backend.vocab_size, self.backend.limits, "prompt")
        _check_room(prompt, self.backend.limits.max_session_tokens)
        first: list[float] = []

        def tick(token: int) -> bool:
            if not first:
                first.append(time.perf_counter() - t0)
            return on_token(token) if on_token is not None else True

        def turn(
            handle: H, plan: EditPlan | None, prompt: Sequence[int], rendered: Rendered | None
        ) -> Turn[H]:
            return Turn(
                handle,
                plan,
                tuple(prompt),
                rendered.spans if rendered is not None else None,
                params,
                tick,
                cancelled,
                leyline.options.allow_fallback,
            )

        if leyline.session is None:
            # Stateless: a throwaway session outside the store (it still reuses and feeds
            # the shared prefix cache).
            handle = self.backend.open(salt_of(tenant, cache_salt))
            try:
                outcome = await self.backend.run_turn(turn(handle, None, prompt, rendered))
            finally:
                self.backend.close(handle)
            return self._reply(None, None, prompt, outcome, first, t0)
        session, created = self.core.session_for_turn(tenant, leyline, cache_salt)
        try:
            async with self.sessions.lease(session):
                view = self.backend.view(session.handle)
                check_revision(view, leyline.base_revision)
                plan = None
                if leyline.directives:
                    plan = await self.core.plan(session, leyline.directives, leyline.base_revision)
                if rendered is not None:
                    # Against what the session holds once the directives ran: a reply sent
                    # back as it was generated keeps its ids, edited or not.
                    adopted = adopt_generated_ids(
                        plan.tokens if plan is not None else view.tokens,
                        prompt,
                        rendered.spans,
                        self.backend.decode,
                        self.backend.stop_token_ids,
                    )
                    if adopted is not None:
                        prompt, rendered = adopted[0], Rendered(*adopted)
                _check_room(prompt, self.backend.limits.max_session_tokens)
                retention = self.core.retention
                held = plan.tokens if plan is not None else view.tokens
                retention.check_prompt(session, held, prompt, "prompt")
                outcome = await self.backend.run_turn(turn(session.handle, plan, prompt, rendered))
                if plan is not None:
                    retention.executed(session, plan)
                retention.prompted(session, outcome.edited, prompt)
                await retention.end_turn(session)
                reply = self._reply(session.id, plan, prompt, outcome, first, t0)
                return self._with_drops(reply, session)
        except BaseException:
            if created and self.sessions.exists(tenant, session.id):
                self.sessions.delete(tenant, session.id)  # a rejected request creates nothing
            raise

    def _reply(
        self,
        session_id: str | None,
        plan: EditPlan | None,
        prompt: Sequence[int],
        outcome: Outcome,
        first: list[float],
        t0: float,
    ) -> Reply:
        generation = outcome.generation
        report = _combine(outcome.edit, outcome.prefill, outcome.edited, prompt)
        response = report.to_response(session_id, outcome.spans)
        response = response.model_copy(update={"revision": generation.revision})
        if plan is not None:
            response = with_composed(response, plan)
        if (t := outcome.timing) is not None:
            timing = Timing(queued_s=t.queued, service_s=t.service, decode_s=t.decode)
            response = response.model_copy(update={"timing": timing})
        self.metrics.record_cache_op(response)
        self.metrics.generated.inc(len(generation.tokens))
        ttft = first[0] if first else time.perf_counter() - t0
        self.metrics.ttft.observe(ttft)
        return Reply(generation, response, len(prompt), generation.text, [], ttft)

    def _with_drops(self, reply: Reply, session: Session[H]) -> Reply:
        """The reply with the spans dropped on the session since its last response; a drop
        at the end of this turn (scratch) also moved it to a new revision and spans."""
        response = with_dropped(reply.leyline, session)
        if response is reply.leyline:
            return reply
        view = self.backend.view(session.handle)
        if view.revision > response.revision:
            response = response.model_copy(
                update={"revision": view.revision, "spans": list(view.spans)}
            )
        return replace(reply, leyline=response)


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
    if leyline.options.require_session and leyline.session is None:
        # Refused rather than ignored: the client meant some session, and a stateless turn
        # would run in none.
        raise LeylineError(
            ErrorCode.invalid_directive,
            "options.require_session needs the session that must exist: set leyline.session",
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
        fallback_reason=edit.fallback_reason or prefill.fallback_reason,
    )
