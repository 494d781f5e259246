"""Every failure the server answers is a typed Leyline error body; bad input is never a 5xx."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from leyline.protocol import ErrorCode, LeylineError

from ..chat.render import ChatTemplateError
from ..core.route_guard import error_response, http_error, internal_error, validation_error

__all__ = ["BodyLimit", "error_response", "install_error_handlers"]


def install_error_handlers(app: FastAPI) -> None:
    """App-level answers for what no ``LeylineRoute`` sees: unknown routes and methods, the
    app's own routes (/health, /metrics) and its middleware. The routers' own failures are
    answered by ``core.route_guard``, which leaves ``ChatTemplateError`` to the handler here.
    """

    @app.exception_handler(LeylineError)
    async def _leyline(_: Request, exc: LeylineError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        return error_response(http_error(exc, request), exc.headers)  # 404, 405 (Allow)

    @app.exception_handler(ChatTemplateError)
    async def _template(_: Request, exc: ChatTemplateError) -> JSONResponse:
        return error_response(LeylineError(ErrorCode.invalid_directive, str(exc), "messages"))

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        # Starlette re-raises after answering, so uvicorn logs the traceback.
        return error_response(internal_error(exc))


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
            # Raised inside the route's body read, which answers it as a protocol error.
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise self._error()
            return message

        await self.app(scope, counted, send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        await error_response(self._error())(scope, receive, send)

    def _error(self) -> LeylineError:
        return LeylineError(
            ErrorCode.limit_exceeded,
            f"request body is larger than this server's limit of {self.max_bytes} bytes",
            "body",
        )
