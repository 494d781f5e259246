"""Protocol error bodies for Leyline's routes, on whichever FastAPI app mounts them.

``APIRouter(route_class=LeylineRoute)``'s routes check the body once before FastAPI parses
it (strict UTF-8 JSON, bounded depth, no lone surrogate: a 422 naming the field) and answer
every failure with the protocol's error body (anything unexpected: a logged 500); an
exception the host app has a handler for is left to it. No torch: SGLang's process imports it.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.routing import Route

from leyline.core.errors import SpliceUnsupportedError
from leyline.protocol import ErrorCode, LeylineError
from leyline.protocol.validation import error_from_details

log = logging.getLogger("leyline.server")

MAX_JSON_DEPTH = 64
"""Nesting a body may have (tool parameter schemas need a dozen or so levels)."""

_SURROGATE = re.compile("[\ud800-\udfff]")  # paired escapes decode to one code point
_STATUS_CODES = {
    401: ErrorCode.unauthorized,
    404: ErrorCode.not_found,
    405: ErrorCode.method_not_allowed,
    413: ErrorCode.limit_exceeded,
}

Handler = Callable[[Request], Coroutine[Any, Any, Response]]


class LeylineRoute(APIRoute):
    """An ``APIRoute`` that checks the raw body and answers every failure as the protocol."""

    def get_route_handler(self) -> Handler:
        handle = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                await check_body(request)
                return await handle(request)
            except Exception as raised:  # every failure gets a protocol body
                exc = _unwrap(raised)
                error = protocol_error(exc, request)
                if error is None:
                    if _host_handles(request, exc):
                        raise exc from None
                    where = f"{request.method} {request.url.path}"
                    log.error("internal error on %s", where, exc_info=exc)
                    error = internal_error(exc)
                headers = exc.headers if isinstance(exc, HTTPException) else None
                return error_response(error, headers)

        return guarded


def error_response(error: LeylineError, headers: Mapping[str, str] | None = None) -> JSONResponse:
    body = error.to_body().model_dump(mode="json")
    return JSONResponse(body, status_code=error.http_status, headers=headers)


def protocol_error(exc: Exception, request: Request) -> LeylineError | None:
    """The protocol's answer to ``exc``, or None when it is not the request's fault."""
    if isinstance(exc, LeylineError):
        return exc
    if isinstance(exc, RequestValidationError):
        return validation_error(exc)
    if isinstance(exc, HTTPException):
        return http_error(exc, request)
    if isinstance(exc, SpliceUnsupportedError):  # raised only when fallback was refused
        return LeylineError(
            ErrorCode.splice_refused,
            f"cannot splice exactly ({exc.reason}): {exc.message}; set allow_fallback "
            "to true to re-prefill instead",
            "leyline.options.allow_fallback",
        )
    return None


def validation_error(exc: RequestValidationError) -> LeylineError:
    # FastAPI's locations start with where the value came from ("body", "query", ...).
    details = [dict(e) | {"loc": tuple(e["loc"])[1:] or ("body",)} for e in exc.errors()]
    return error_from_details(details)


def http_error(exc: HTTPException, request: Request) -> LeylineError:
    status, where = exc.status_code, f"{request.method} {request.url.path}"
    code = _STATUS_CODES.get(status)
    if code is None:
        code = ErrorCode.internal_error if status >= 500 else ErrorCode.invalid_directive
    # Starlette's router raises these two with their bare reason phrase.
    if status == 404 and exc.detail == "Not Found":
        return LeylineError(code, f"no route {where}; the routes are listed at /docs")
    if status == 405 and exc.detail == "Method Not Allowed":
        allowed = (exc.headers or {}).get("Allow", "")
        return LeylineError(code, f"{where} is not allowed; the route takes {allowed}")
    return LeylineError(code, f"{where}: {exc.detail}")


_METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]


def unmatched_router(prefix: str, known: APIRouter) -> APIRouter:
    """One catch-all route for ``prefix/...`` that answers what no route of ``known`` takes
    (an unknown path: 404; a known path with another method: 405 with ``Allow``) with the
    protocol's body, as ``leyline serve`` does app-wide. For a host app whose own router
    answers unmatched requests in its own format (SGLang's); include it after ``known``.
    The body is not read: routing comes first."""
    router = APIRouter()
    routes = [r for r in known.routes if isinstance(r, Route)]

    @router.api_route(prefix + "/{rest:path}", methods=_METHODS, include_in_schema=False)
    async def unmatched(rest: str, request: Request) -> Response:
        path = request.url.path
        allowed = sorted({m for r in routes if r.path_regex.match(path) for m in r.methods or ()})
        if allowed:
            exc = HTTPException(405, "Method Not Allowed", {"Allow": ", ".join(allowed)})
        else:
            exc = HTTPException(404, "Not Found")
        return error_response(http_error(exc, request), exc.headers)

    return router


def internal_error(exc: BaseException) -> LeylineError:
    return LeylineError(
        ErrorCode.internal_error,
        f"internal error ({type(exc).__name__}), not caused by the request; the server logged it",
    )


# -- the body -----------------------------------------------------------------------------


async def check_body(request: Request) -> None:
    """Reject a body that is not strict UTF-8 JSON within the limits (see the module doc).

    ``request.json()`` caches the parse, so FastAPI does not parse the body a second time.
    """
    raw = await request.body()
    if not raw:
        return
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise LeylineError(
            ErrorCode.invalid_directive,
            f"the body is not valid UTF-8 (byte {exc.start}); send UTF-8 JSON",
            "body",
        ) from None
    try:
        value = await request.json()
    except RecursionError:
        raise _too_deep(MAX_JSON_DEPTH) from None
    except json.JSONDecodeError as exc:
        raise LeylineError(
            ErrorCode.invalid_directive,
            f"the body is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})",
            "body",
        ) from None
    except ValueError as exc:  # an integer literal past Python's 4,300-digit limit
        raise LeylineError(
            ErrorCode.invalid_directive,
            f"the body holds a number this server cannot read ({str(exc).split(':')[0]})",
            "body",
        ) from None
    check_json(value)


def check_json(value: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Raise ``LeylineError`` naming the first lone surrogate, non-finite number or level
    past ``max_depth`` in a parsed JSON ``value``. Iterative: any depth is safe."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(value, ())]
    while stack:
        node, path = stack.pop()
        if isinstance(node, dict):
            items: Any = node.items()
        elif isinstance(node, list):
            items = enumerate(node)
        else:
            _check_scalar(node, path)
            continue
        if len(path) >= max_depth:
            raise _too_deep(max_depth, field_path(path))
        for key, item in items:
            if isinstance(key, str):
                _check_scalar(key, (*path, key))
            if isinstance(item, dict | list):
                stack.append((item, (*path, key)))
            elif isinstance(item, str | float):
                _check_scalar(item, (*path, key))


def _check_scalar(value: object, path: tuple[str | int, ...]) -> None:
    if isinstance(value, str) and (found := _SURROGATE.search(value)):
        raise LeylineError(
            ErrorCode.invalid_directive,
            f"lone UTF-16 surrogate \\u{ord(found.group()):04x} in a string; send valid "
            "Unicode (a surrogate escape must be half of a pair)",
            field_path(path),
        )
    if isinstance(value, float) and not math.isfinite(value):
        raise LeylineError(
            ErrorCode.invalid_directive,
            f"{value} is not a JSON number; send a finite number",
            field_path(path),
        )


def _too_deep(max_depth: int, at: str | None = None) -> LeylineError:
    where = f" (at {at})" if at else ""
    return LeylineError(
        ErrorCode.limit_exceeded, f"the body nests deeper than {max_depth} levels{where}", "body"
    )


def field_path(path: tuple[str | int, ...]) -> str:
    """The protocol's field notation, ``messages[0].content``; ``body`` for the root."""
    text = ""
    for part in path:
        if isinstance(part, int):
            text += f"[{part}]"
        else:  # a key may itself hold the surrogate being reported
            key = part.encode("utf-8", "backslashreplace").decode("utf-8")
            text += f".{key}" if text else key
    return text or "body"


def _unwrap(exc: Exception) -> Exception:
    """The one exception inside task-group wrappers (Starlette's middleware reads the body
    in a task group, so a body-limit error arrives as a group of one)."""
    while isinstance(exc, ExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def _host_handles(request: Request, exc: Exception) -> bool:
    """Whether the app has a handler for this exception type (the catch-all excluded)."""
    handlers = getattr(request.app, "exception_handlers", {})
    return any(
        cls in handlers for cls in type(exc).__mro__ if cls not in (Exception, BaseException)
    )
