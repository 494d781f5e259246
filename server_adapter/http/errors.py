"""Every failure the server answers is a typed Leyline error body; bad input is never a 5xx."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from leyline.protocol import ErrorCode, LeylineError
from leyline.protocol.validation import error_from_details

from ..chat.render import ChatTemplateError
from ..errors import ModelNotFoundError, SpliceUnsupportedError

log = logging.getLogger("leyline.server")


def error_response(error: LeylineError) -> JSONResponse:
    return JSONResponse(error.to_body().model_dump(mode="json"), status_code=error.http_status)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(LeylineError)
    async def _leyline(_: Request, exc: LeylineError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        details = [dict(e) | {"loc": tuple(e["loc"])[1:] or ("body",)} for e in exc.errors()]
        return error_response(error_from_details(details))

    @app.exception_handler(ChatTemplateError)
    async def _template(_: Request, exc: ChatTemplateError) -> JSONResponse:
        return error_response(LeylineError(ErrorCode.invalid_directive, str(exc), "messages"))

    @app.exception_handler(SpliceUnsupportedError)
    async def _splice(_: Request, exc: SpliceUnsupportedError) -> JSONResponse:
        # Only raised when the client asked for no fallback.
        message = f"cannot splice ({exc.reason}): {exc.message}; allow_fallback to re-prefill"
        return error_response(
            LeylineError(ErrorCode.invalid_span, message, "leyline.options.allow_fallback")
        )

    @app.exception_handler(ModelNotFoundError)
    async def _model(_: Request, exc: ModelNotFoundError) -> JSONResponse:
        return error_response(LeylineError(ErrorCode.invalid_directive, str(exc), "model"))

    @app.exception_handler(ValueError)
    async def _value(_: Request, exc: ValueError) -> JSONResponse:
        # Parameter checks below the HTTP layer (sampling, settings) raise ValueError.
        return error_response(LeylineError(ErrorCode.invalid_directive, str(exc)))


class BodyLimit:
    """Reject bodies over ``max_bytes`` with 413 before they are parsed (ASGI middleware)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._reject(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge
            return message

        try:
            await self.app(scope, counted, send)
        except _TooLarge:
            await self._reject(scope, receive, send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = LeylineError(
            ErrorCode.limit_exceeded,
            f"request body is larger than this server's limit of {self.max_bytes} bytes",
            "body",
        )
        await error_response(error)(scope, receive, send)


class _TooLarge(Exception):
    pass
