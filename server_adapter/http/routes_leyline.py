"""The ``/leyline/v1/...`` resources: capabilities, sessions, directives, tokens, schema."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response

from leyline.protocol import Capabilities, ErrorCode, LeylineError, LeylineResponse
from leyline.protocol.resources import (
    ApplyDirectives,
    DetokenizeRequest,
    DetokenizeResponse,
    Routes,
    SessionCreate,
    SessionInfo,
    TokenizeRequest,
    TokenizeResponse,
)
from leyline.protocol.schema import build_schema

from .openai_types import ChatMessage, ToolSpec
from .service import LeylineService


def leyline_router(service: LeylineService) -> APIRouter:
    router = APIRouter(tags=["Leyline"])

    @router.get(Routes.capabilities)
    async def capabilities() -> Capabilities:
        return service.capabilities()

    @router.post(Routes.sessions, status_code=201)
    async def create_session(body: SessionCreate) -> SessionInfo:
        """Create a session, optionally prefilled from messages, text or token ids."""

        def work() -> SessionInfo:
            tokens, spans = _prompt_of(service, body)
            session = service.sessions.create(body.session)
            try:
                with service.sessions.lease(session):
                    if tokens:
                        service.metrics.record_cache_op(
                            session.prefill(tokens, spans=spans).to_response(session.id)
                        )
                    return service.session_info(session)
            except Exception:
                service.sessions.delete(session.id)  # a failed create leaves nothing behind
                raise

        info = await service.run(work)
        service.metrics.sessions.set(len(service.sessions))
        return info

    @router.get(Routes.session)
    async def get_session(session: str, tokens: bool = False) -> SessionInfo:
        return service.session_info(service.sessions.get(session), include_tokens=tokens)

    @router.delete(Routes.session, status_code=204)
    async def delete_session(session: str) -> Response:
        await service.run(lambda: service.sessions.delete(session))
        service.metrics.sessions.set(len(service.sessions))
        return Response(status_code=204)

    @router.post(Routes.directives)
    async def apply_directives(session: str, body: ApplyDirectives) -> LeylineResponse:
        """Apply a batch without generating (all-or-nothing; 409 on a stale revision)."""
        return await service.run(
            lambda: service.apply(
                session, body.directives, body.base_revision, body.options.allow_fallback
            )
        )

    @router.post(Routes.tokenize)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        if body.text is not None:
            return TokenizeResponse(tokens=list(service.engine.encode(body.text)))
        messages = [ChatMessage.model_validate(m) for m in body.messages or []]
        tools = [ToolSpec.model_validate(t) for t in body.tools or []]
        rendered = service.require_renderer().render(
            messages, tools, add_generation_prompt=body.add_generation_prompt
        )
        return TokenizeResponse(tokens=list(rendered.tokens), spans=list(rendered.spans))

    @router.post(Routes.detokenize)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        vocab = service.engine.vocab_size
        bad = [t for t in body.tokens if t >= vocab]
        if bad:
            raise LeylineError(
                ErrorCode.invalid_directive,
                f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})",
                "tokens",
            )
        return DetokenizeResponse(text=service.engine.decode(body.tokens))

    @router.get(Routes.schema)
    async def schema() -> dict[str, Any]:
        return build_schema()

    return router


def _prompt_of(
    service: LeylineService, body: SessionCreate
) -> tuple[tuple[int, ...], tuple[Any, ...]]:
    if body.messages is not None:
        messages = [ChatMessage.model_validate(m) for m in body.messages]
        rendered = service.require_renderer().render(messages)
        return rendered.tokens, rendered.spans
    if body.text is not None:
        return service.engine.encode(body.text), ()
    return tuple(body.tokens or ()), ()
