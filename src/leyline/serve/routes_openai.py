"""OpenAI-compatible endpoints: /v1/models, /v1/chat/completions, /v1/completions."""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from leyline.core.chat.token_bytes import token_bytes
from leyline.core.openai_types import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChoiceLogprobs,
    ChunkChoice,
    ChunkDelta,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    Usage,
    new_id,
)
from leyline.core.route_guard import LeylineRoute
from leyline.core.routes import client_gone, tenant_of
from leyline.core.turns import TokenChoice
from leyline.serve.jobs import Job, TokenJob
from leyline.serve.service import LeylineService, Reply
from leyline.serve.streaming import DONE, DeltaText, sse

R = TypeVar("R")


def openai_router(service: LeylineService[Any]) -> APIRouter:
    router = APIRouter(tags=["OpenAI-compatible"], route_class=LeylineRoute)

    @router.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=service.model_name)])

    @router.post("/v1/chat/completions", response_model=None)
    async def chat_completions(
        body: ChatCompletionRequest, request: Request
    ) -> ChatCompletion | StreamingResponse:
        """Chat; a ``leyline`` object in the body carries the session and directives."""
        return await _respond(
            service,
            "chat",
            request,
            body.stream,
            lambda on_token, cancelled: service.chat(
                body, on_token, tenant=tenant_of(request), cancelled=cancelled
            ),
            lambda job, first: _chat_events(service, body, job, first),
            lambda reply: _chat_completion(service, body, reply),
        )

    @router.post("/v1/completions", response_model=None)
    async def completions(
        body: CompletionRequest, request: Request
    ) -> Completion | StreamingResponse:
        """Text completion from a string or token ids; same ``leyline`` extension."""
        return await _respond(
            service,
            "completions",
            request,
            body.stream,
            lambda on_token, cancelled: service.complete(
                body, on_token, tenant=tenant_of(request), cancelled=cancelled
            ),
            lambda job, first: _completion_events(service, body, job, first),
            lambda reply: _completion(service, body, reply),
        )

    return router


async def _respond(
    service: LeylineService[Any],
    route: str,
    request: Request,
    stream: bool,
    work: Job[Reply],
    events: Callable[[TokenJob[Reply], int | None], AsyncIterator[str]],
    answer: Callable[[Reply], R],
) -> R | StreamingResponse:
    """Queue ``work`` on the model worker; stream its tokens as SSE or answer when done.

    A stream starts only after the first token, so an error before it (a bad directive, a
    revision conflict) is still a plain typed HTTP error.
    """
    t0 = time.perf_counter()
    job = TokenJob(work, client_gone(request))
    try:
        if stream:
            first = await job.first_token()
            return StreamingResponse(events(job, first), media_type="text/event-stream")
        reply = await job.result_or_cancel(request)
    finally:
        service.metrics.latency.labels(route).observe(time.perf_counter() - t0)
    return answer(reply)


def _usage(reply: Reply) -> Usage:
    completion = len(reply.generation.tokens)
    cached = min(reply.leyline.reused_tokens, reply.prompt_tokens)
    return Usage(
        prompt_tokens=reply.prompt_tokens,
        completion_tokens=completion,
        total_tokens=reply.prompt_tokens + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def _finish(reply: Reply) -> str:
    return "tool_calls" if reply.tool_calls else reply.generation.finish_reason


def _chat_logprobs(service: LeylineService[Any], choices: Sequence[TokenChoice]) -> ChoiceLogprobs:
    tokenizer = service.backend.tokenizer

    def entry(token: int, logprob: float) -> TopLogprob:
        text = service.decode([token])
        raw = token_bytes(tokenizer, token) if tokenizer is not None else text.encode()
        return TopLogprob(
            token=text, logprob=_finite(logprob), bytes=list(raw), token_id=int(token)
        )

    return ChoiceLogprobs(
        content=[
            TokenLogprob(
                **entry(c.token, c.logprob).model_dump(),
                top_logprobs=[entry(t, lp) for t, lp in c.top],
            )
            for c in choices
        ]
    )


def _finite(value: float) -> float:
    return value if math.isfinite(value) else -9999.0


def _chat_completion(
    service: LeylineService[Any], body: ChatCompletionRequest, reply: Reply
) -> ChatCompletion:
    logprobs = None
    if body.logprobs:
        logprobs = _chat_logprobs(service, reply.generation.logprobs)
    message = AssistantMessage(
        content=reply.content or (None if reply.tool_calls else ""),
        tool_calls=reply.tool_calls or None,
    )
    choice = ChatChoice(
        message=message,
        finish_reason=_finish(reply),
        logprobs=logprobs,
    )
    return ChatCompletion(
        model=service.model_name, choices=[choice], usage=_usage(reply), leyline=reply.leyline
    )


async def _chat_events(
    service: LeylineService[Any],
    body: ChatCompletionRequest,
    job: TokenJob[Reply],
    first: int | None,
) -> AsyncIterator[str]:
    cid, model = new_id("chatcmpl"), service.model_name
    buffered = bool(body.tools) and body.tool_choice != "none"  # tool calls parse at the end
    deltas = DeltaText(service.decode, body.stop_strings(), service.backend.stop_token_ids)

    def chunk(delta: ChunkDelta, **extra: object) -> str:
        return sse(
            ChatCompletionChunk(id=cid, model=model, choices=[ChunkChoice(delta=delta, **extra)])
        )

    try:
        yield chunk(ChunkDelta(role="assistant", content=""))
        tokens = [] if first is None else [first]
        async for token in _chain(tokens, job):
            text = deltas.push(token)
            if text and not buffered:
                yield chunk(ChunkDelta(content=text))
        reply = job.task.result()
        rest = reply.content if buffered else deltas.finish(reply.content)
        calls = [c.model_dump() | {"index": i} for i, c in enumerate(reply.tool_calls)]
        if rest or calls:
            yield chunk(ChunkDelta(content=rest or None, tool_calls=calls or None))
        usage = _usage(reply) if body.stream_options and body.stream_options.include_usage else None
        final = ChatCompletionChunk(
            id=cid,
            model=model,
            usage=usage,
            leyline=reply.leyline,
            choices=[
                ChunkChoice(
                    delta=ChunkDelta(),
                    finish_reason=_finish(reply),
                    # Every token's logprobs at once: text deltas may merge or hold tokens.
                    logprobs=_chat_logprobs(service, reply.generation.logprobs)
                    if body.logprobs
                    else None,
                )
            ],
        )
        yield sse(final)
        yield DONE
    finally:
        job.cancel()  # a client that went away stops the generation at its next token


async def _completion_events(
    service: LeylineService[Any], body: CompletionRequest, job: TokenJob[Reply], first: int | None
) -> AsyncIterator[str]:
    cid, model = new_id("cmpl"), service.model_name
    deltas = DeltaText(service.decode, body.stop_strings(), service.backend.stop_token_ids)
    try:
        tokens = [] if first is None else [first]
        async for token in _chain(tokens, job):
            if text := deltas.push(token):
                yield sse(
                    Completion(
                        id=cid,
                        model=model,
                        choices=[CompletionChoice(text=text, finish_reason=None)],
                    )
                )
        reply = job.task.result()
        final = CompletionChoice(text=deltas.finish(reply.content), finish_reason=_finish(reply))
        yield sse(
            Completion(
                id=cid, model=model, choices=[final], usage=_usage(reply), leyline=reply.leyline
            )
        )
        yield DONE
    finally:
        job.cancel()


async def _chain(first: list[int], job: TokenJob[Reply]) -> AsyncIterator[int]:
    for token in first:
        yield token
    async for token in job.rest():
        yield token


def _completion(service: LeylineService[Any], body: CompletionRequest, reply: Reply) -> Completion:
    logprobs = None
    if body.logprobs is not None:
        choices = reply.generation.logprobs
        texts = [service.decode([c.token]) for c in choices]
        offsets, at = [], 0
        for text in texts:
            offsets.append(at)
            at += len(text)
        logprobs = CompletionLogprobs(
            tokens=texts,
            token_logprobs=[_finite(c.logprob) for c in choices],
            top_logprobs=[{service.decode([t]): _finite(lp) for t, lp in c.top} for c in choices],
            text_offset=offsets,
        )
    text = reply.content
    if body.echo and isinstance(body.prompt, str):
        text = body.prompt + text
    choice = CompletionChoice(
        text=text,
        finish_reason=_finish(reply),
        logprobs=logprobs,
    )
    return Completion(
        model=service.model_name, choices=[choice], usage=_usage(reply), leyline=reply.leyline
    )
