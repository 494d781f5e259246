"""Leyline requests carried inside an OpenAI completions request, for routers that forward
only the OpenAI routes (sglang-router 0.3.2 answers ``/leyline/v1`` itself with a 404 and
keeps an unknown body field on ``/v1/completions`` only: docs/router-design.md).

An envelope is ``POST /v1/completions`` whose JSON body holds ``leyline.route = {"method",
"path", "body"}``. This middleware, outermost on a worker's app, runs that inner request
through the same app, so API keys, tenants, body limits and metrics apply as they do to a
direct request, and answers with the inner answer unchanged (status, headers, JSON or SSE).
Only the routes an SDK needs are carried; other requests pass through byte for byte. An
inner request is dispatched below this middleware, so envelopes never nest: a body that
still holds ``leyline.route`` reaches the protocol's request model, which refuses it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from leyline.core.route_guard import error_response
from leyline.protocol import ErrorCode, LeylineError
from leyline.protocol.resources import API_PREFIX
from leyline.serve.buffered import read_body
from leyline.serve.openai_dispatch import MAX_BODY_BYTES

ENVELOPE_PATH = "/v1/completions"
CARRIED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
"""Besides everything under ``/leyline/v1``."""
CARRIED_METHODS = frozenset({"GET", "POST", "DELETE"})
FIELD = "leyline.route"
ENVELOPE_SLACK = 64 * 1024
"""What an envelope may add to the body limit of the request it carries (its own fields)."""


@dataclass(frozen=True, slots=True)
class InnerRequest:
    method: str
    path: str
    query: bytes
    body: bytes | None
    """JSON, or None for a request without a body."""


class LeylineTunnel:
    """Unpacks envelopes on ``POST /v1/completions`` into requests to ``app``."""

    def __init__(self, app: ASGIApp, max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != ENVELOPE_PATH:
            await self.app(scope, receive, send)
            return
        read = await read_body(scope, receive, send, self.max_body_bytes)
        if read is None:
            return
        try:
            inner = inner_request(read.body)
        except LeylineError as exc:
            await error_response(exc)(scope, read.receive, send)
            return
        if inner is None:
            await self.app(scope, read.receive, send)
            return
        await self.app(inner_scope(scope, inner), _inner_receive(inner, read.receive), send)


def inner_request(body: bytes) -> InnerRequest | None:
    """The request an envelope carries; None if ``body`` is not an envelope. A malformed
    envelope is ``invalid_directive`` naming the field; a route it may not carry is
    ``not_found``."""
    if b'"route"' not in body:
        return None  # cheap: most completions never parse here
    try:
        parsed = json.loads(body)
    except ValueError:
        return None  # the host answers malformed JSON as it always does
    leyline = parsed.get("leyline") if isinstance(parsed, dict) else None
    if not isinstance(leyline, dict) or "route" not in leyline:
        return None
    route = leyline["route"]
    if not isinstance(route, dict) or set(route) - {"method", "path", "body"}:
        raise _malformed("an object with method, path and (optionally) body")
    method, target = route.get("method"), route.get("path")
    if method not in CARRIED_METHODS:
        raise _malformed(f"method one of {sorted(CARRIED_METHODS)}", ".method")
    if not isinstance(target, str) or not target.startswith("/"):
        raise _malformed("an absolute path", ".path")
    path, _, query = target.partition("?")
    if path not in CARRIED_PATHS and not path.startswith(API_PREFIX + "/"):
        raise LeylineError(
            ErrorCode.not_found,
            f"an envelope carries /v1/chat/completions, /v1/completions and {API_PREFIX}/*, "
            f"not {path!r}",
            f"{FIELD}.path",
        )
    inner_body = route.get("body")
    if method == "GET" and inner_body is not None:
        raise _malformed("no body with GET", ".body")
    encoded = None
    if inner_body is not None:
        # ASCII, escapes kept: a lone surrogate, legal as a JSON escape, has no UTF-8 form.
        encoded = json.dumps(inner_body, separators=(",", ":")).encode()
    return InnerRequest(str(method), path, query.encode(), encoded)


def inner_scope(scope: Scope, inner: InnerRequest) -> Scope:
    """The envelope's scope (client, server, headers: keys, routing key) for ``inner``."""
    headers: list[tuple[bytes, bytes]] = [
        (name, value)
        for name, value in scope["headers"]
        if name.lower() not in (b"content-length", b"content-type", b"transfer-encoding")
    ]
    if inner.body is not None:
        headers += [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(inner.body)).encode()),
        ]
    out: dict[str, Any] = dict(scope)
    out.update(
        method=inner.method,
        path=unquote(inner.path),
        raw_path=inner.path.encode(),
        query_string=inner.query,
        headers=headers,
    )
    return out


def _inner_receive(inner: InnerRequest, receive: Receive) -> Receive:
    sent = False

    async def inner_receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": inner.body or b"", "more_body": False}
        # The envelope's body is consumed; what comes next on the live channel is a
        # disconnect, which the inner request must see.
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return message

    return inner_receive


def _malformed(expected: str, where: str = "") -> LeylineError:
    return LeylineError(
        ErrorCode.invalid_directive, f"{FIELD}{where} must be {expected}", FIELD + where
    )
