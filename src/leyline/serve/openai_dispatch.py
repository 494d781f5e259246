"""Chat and completions requests that carry a ``leyline`` object, served on a host server's
app (SGLang's, vLLM's).

The host owns ``/v1/chat/completions`` and ``/v1/completions``. This ASGI middleware reads
the body of a POST to either; if it is a JSON object with a top-level ``leyline`` key (a
session, directives), the request goes to the reference server's OpenAI routes over the
plugin's ``LeylineService`` (the same checks, sessions, directives, reports and streaming
as ``leyline serve``). Everything else, an unchanged OpenAI client's request included,
reaches the host byte for byte.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from leyline.serve.buffered import read_body
from leyline.serve.errors import install_error_handlers
from leyline.serve.routes_openai import openai_router
from leyline.serve.service import LeylineService

ROUTED = frozenset({"/v1/chat/completions", "/v1/completions"})
MAX_BODY_BYTES = 32 * 1024**2
"""The most this middleware buffers to look for a ``leyline`` key (the reference server's
default body limit is far smaller); a larger body is refused, never read whole."""


def leyline_openai_app(service: LeylineService[Any]) -> FastAPI:
    """The OpenAI routes for requests with a ``leyline`` object (typed protocol errors)."""
    app = FastAPI(redirect_slashes=False, openapi_url=None, docs_url=None, redoc_url=None)
    install_error_handlers(app)
    app.include_router(openai_router(service))
    return app


class LeylineDispatch:
    """Sends ``leyline``-bearing chat / completions requests to ``leyline_app``."""

    def __init__(
        self, app: ASGIApp, leyline_app: ASGIApp, max_body_bytes: int = MAX_BODY_BYTES
    ) -> None:
        self.app = app
        self.leyline_app = leyline_app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in ROUTED:
            await self.app(scope, receive, send)
            return
        read = await read_body(scope, receive, send, self.max_body_bytes)
        if read is None:
            return
        target = self.leyline_app if _has_leyline(read.body) else self.app
        await target(scope, read.receive, send)


def _has_leyline(body: bytes) -> bool:
    if b'"leyline"' not in body:
        return False  # cheap: most requests never parse here
    try:
        parsed = json.loads(body)
    except ValueError:
        return False  # SGLang answers malformed JSON as it always does
    return isinstance(parsed, dict) and "leyline" in parsed
