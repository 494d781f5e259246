"""Every failure the server answers is a typed Leyline error body; bad input is never a 5xx."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from leyline.core.route_guard import error_response, http_error, internal_error, validation_error
from leyline.protocol import ErrorCode, LeylineError

__all__ = ["BodyLimit", "HeadAsGet", "error_response", "install_error_handlers"]


def install_error_handlers(app: FastAPI) -> None:
    """App-level answers for what no ``LeylineRoute`` sees: unknown routes and methods, the
    app's own routes (/health, /metrics) and its middleware. The routers' own failures are
    answered by ``core.route_guard``."""

    @app.exception_handler(LeylineError)
    async def _leyline(_: Request, exc: LeylineError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code == 405:
            allow = {"Allow": allowed_methods(request)}
            exc = HTTPException(405, exc.detail, {**(exc.headers or {}), **allow})
        return error_response(http_error(exc, request), exc.headers)  # 404, 405 (Allow)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        # Starlette re-raises after answering, so uvicorn logs the traceback.
        return error_response(internal_error(exc))


def allowed_methods(request: Request) -> str:
    """The methods of every route of the app at the request's path, for ``Allow``
    (Starlette's own 405 names only the first route that matched it: GET, not DELETE, on
    ``/leyline/v1/sessions/{id}``)."""
    routes = request.app.router.routes  # included routers are nested: ask each to match

    def takes(method: str) -> bool:
        scope = {**request.scope, "method": method}
        return any(route.matches(scope)[0] is Match.FULL for route in routes)

    return ", ".join(m for m in _METHODS if takes(m))


_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


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


class HeadAsGet:
    """Answer HEAD as the GET of the same path, without the body (ASGI middleware).

    HTTP gives every GET resource a HEAD (RFC 9110, 9.3.2) and forbids a body in the
    answer; without this a HEAD anywhere was a body-less 405 or 404. Now it is the GET's
    status and headers: 200 where GET is served, else the error's (405 with ``Allow``).
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def headers_only(message: Message) -> None:
            if message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        # A copy: the server's own scope stays HEAD, so it sends no body either.
        await self.app({**scope, "method": "GET"}, receive, headers_only)
