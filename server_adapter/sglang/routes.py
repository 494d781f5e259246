"""The ``/leyline/v1`` resources on SGLang's own FastAPI app (same paths and bodies as
``leyline serve``). Sessions are created from token ids or text; generation stays SGLang's
``/generate`` (or ``/v1/completions``) with the session's tokens."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse

from leyline.protocol import Capabilities, ErrorCode, LeylineError, LeylineResponse
from leyline.protocol.resources import ApplyDirectives, Routes, SessionCreate, SessionInfo
from leyline.protocol.schema import build_schema
from leyline.server_adapter.errors import SpliceUnsupportedError

from .directive_service import EXECUTED_VERBS, DirectiveService


def _error(exc: LeylineError) -> JSONResponse:
    return JSONResponse(exc.to_body().model_dump(mode="json"), status_code=exc.http_status)


def leyline_router(service: DirectiveService) -> APIRouter:
    router = APIRouter(tags=["Leyline"])

    def info(session: str, tokens: bool = False) -> SessionInfo:
        record = service.get(session)
        return SessionInfo(
            session=session,
            revision=record.revision,
            num_tokens=len(record.tokens),
            tokens=list(record.tokens) if tokens else None,
        )

    @router.get(Routes.capabilities)
    async def capabilities() -> Capabilities:
        return Capabilities(
            verbs=list(EXECUTED_VERBS), architectures=["mla", "gqa"], limits=service.limits
        )

    @router.post(Routes.sessions, status_code=201, response_model=None)
    async def create_session(body: SessionCreate) -> SessionInfo | JSONResponse:
        if body.messages is not None:
            return _error(
                LeylineError(
                    ErrorCode.invalid_directive,
                    "the SGLang plugin takes tokens or text (render messages with "
                    "/leyline/v1/tokenize on a leyline server, or SGLang's chat template)",
                    "messages",
                )
            )
        tokens = list(body.tokens or ()) or list(service.tokenize(body.text or ""))
        session, _ = await service.create(body.session, tokens)
        return info(session)

    @router.get(Routes.session, response_model=None)
    async def get_session(session: str, tokens: bool = False) -> SessionInfo | JSONResponse:
        try:
            return info(session, tokens)
        except LeylineError as exc:
            return _error(exc)

    @router.delete(Routes.session, status_code=204)
    async def delete_session(session: str) -> Response:
        service.delete(session)
        return Response(status_code=204)

    @router.post(Routes.directives, response_model=None)
    async def apply_directives(
        session: str, body: ApplyDirectives
    ) -> LeylineResponse | JSONResponse:
        try:
            return await service.apply(
                session, body.directives, body.base_revision, body.options.allow_fallback
            )
        except LeylineError as exc:
            return _error(exc)
        except SpliceUnsupportedError as exc:  # only when the client refused a fallback
            message = f"cannot splice ({exc.reason}): {exc.message}; allow_fallback to re-prefill"
            return _error(
                LeylineError(ErrorCode.invalid_span, message, "leyline.options.allow_fallback")
            )

    @router.get(Routes.schema)
    async def schema() -> dict[str, Any]:
        return build_schema()

    return router
