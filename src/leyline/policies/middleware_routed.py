"""Routed mode: the wrappers behind sglang-router (``LeylineOpenAI(..., routed=True)``).

The router forwards a top-level ``leyline`` object only on ``POST /v1/completions`` and
answers every ``/leyline/v1/*`` request itself with a bare 404 (docs/reports/router-probe.md),
so in routed mode each Leyline request goes as one :class:`Envelope` over that route, with
its session as the routing key; the worker's tunnel answers it as the inner route would
(status, headers, JSON or SSE). A worker the router cannot reach yet is waited for
(:func:`unreachable`, :func:`backoff`). What the wrapper does is in docs/middleware.md.

No I/O here: the shells make the requests (and the :class:`Wait`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import openai
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import BaseModel

from leyline.protocol.routing import envelope_body

from .flows import Flow
from .middleware_wire import ROUTING_KEY, Completion, Route

ENVELOPE_PATH = "/completions"
"""The route every envelope goes to, from the client's base URL (which ends in ``/v1``)."""

CHAT_PATH = "/v1/chat/completions"
"""The inner path of a chat turn."""

BACKOFF_S = (0.5, 1.0, 2.0, 4.0)
"""Waits before the re-sends of a request whose worker the router could not reach; the
last one repeats until ``unreachable_s`` is spent."""

UPSTREAM_ERROR = "call_upstream_request_error"
"""sglang-router's error code for a worker it could not reach (HTTP 500)."""

logger = logging.getLogger("leyline.policies.middleware")

_REQUEST_OPTIONS = ("extra_headers", "extra_query", "extra_body", "timeout")
"""Arguments of ``chat.completions.create`` that are not body fields."""

_OMITTED = tuple(
    kind for kind in (getattr(openai, "NotGiven", None), getattr(openai, "Omit", None)) if kind
)
"""openai's markers of an argument left out (``NOT_GIVEN``, ``omit``)."""


@dataclass(frozen=True, slots=True)
class Wait:
    """A pause the flow asks for (before a re-send): the sync shell sleeps, the async one
    awaits ``asyncio.sleep``."""

    seconds: float


@dataclass(frozen=True, slots=True)
class Envelope:
    """``inner`` (a Leyline route, or a chat turn with a ``leyline`` object) carried as
    ``POST {base_url}/completions``::

        {"model": ..., "prompt": ".", "max_tokens": 1, "stream": <the inner stream>,
         "leyline": {"route": {"method": ..., "path": ..., "body": ...}}}

    with the inner request's session as ``X-SMG-Routing-Key``. The answer is the inner
    route's (a ``ChatCompletion`` or a stream of chunks for a turn, JSON for a route), and
    its error statuses are the same ``openai.APIStatusError`` subclasses as when direct.
    """

    inner: Route | Completion
    model: str
    """The outer ``model``: the call's (a turn's own model wins)."""

    def body(self) -> dict[str, Any]:
        inner = self.inner
        if isinstance(inner, Route):
            method, path = inner.method.upper(), inner.path
            body = inner.body if inner.method == "post" else None
            model = self.model
        else:
            method, path, body = "POST", CHAT_PATH, chat_body(inner.options)
            named = body.get("model")
            model = named if isinstance(named, str) and named else self.model
        stream = isinstance(body, Mapping) and bool(body.get("stream"))
        return envelope_body(method, path, body, model, stream=stream)

    def options(self) -> dict[str, Any]:
        """The request options (openai's ``RequestOptions``): headers with the routing key,
        and a turn's ``extra_headers``, ``extra_query`` and ``timeout``."""
        inner = self.inner
        headers: dict[str, str] = {}
        options: dict[str, Any] = {}
        if isinstance(inner, Completion):
            given = inner.options
            headers.update(given.get("extra_headers") or {})
            if given.get("extra_query"):
                options["params"] = dict(given["extra_query"])
            timeout = given.get("timeout")
            if timeout is not None and not isinstance(timeout, _OMITTED):
                options["timeout"] = timeout
        if inner.key is not None:
            headers[ROUTING_KEY] = inner.key
        if headers:
            options["headers"] = headers
        return options

    def send(self, client: Any) -> Any:
        """Make it with an OpenAI client (an async client's answer is to be awaited)."""
        inner = self.inner
        if isinstance(inner, Completion) and not inner.retries:
            client = client.with_options(max_retries=0)
        body = self.body()
        chunks = openai.AsyncStream if isinstance(client, openai.AsyncOpenAI) else openai.Stream
        return client.post(
            ENVELOPE_PATH,
            body=body,
            cast_to=ChatCompletion if isinstance(inner, Completion) else object,
            stream=body["stream"],
            stream_cls=chunks[ChatCompletionChunk],
            options=self.options(),
        )


def enveloped(request: Route | Completion) -> bool:
    """Whether routed mode sends ``request`` in an envelope: every Leyline route, and every
    chat turn with a ``leyline`` object (a plain chat request, such as a summary, goes as it
    is: the router forwards it)."""
    return isinstance(request, Route) or request.leyline


def chat_body(options: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON body ``chat.completions.create(**options)`` would send: its arguments less
    the request options, ``extra_body`` merged in, omitted ones left out."""
    body = {
        name: _jsonable(value)
        for name, value in options.items()
        if name not in _REQUEST_OPTIONS and not isinstance(value, _OMITTED)
    }
    extra = options.get("extra_body")
    if isinstance(extra, Mapping):
        body.update({name: _jsonable(value) for name, value in extra.items()})
    return body


def unreachable(exc: BaseException) -> bool:
    """The router could not reach the worker (yet): HTTP 500 ``call_upstream_request_error``,
    HTTP 503 (``no_available_workers``), or no connection. Nothing reached a worker, so the
    same request may go again. A timeout is not this: the request may be running."""
    if isinstance(exc, openai.APITimeoutError):
        return False
    if isinstance(exc, openai.APIConnectionError):
        return True
    if isinstance(exc, openai.APIStatusError):
        return exc.status_code == 503 or (exc.status_code == 500 and exc.code == UPSTREAM_ERROR)
    return False


def routed(request: Route | Completion, model: str, unreachable_s: float) -> Flow[Any]:
    """Make ``request`` behind a router: as an envelope if it is a Leyline one (a route, a
    turn with a ``leyline`` object), sent again unchanged after 0.5, 1, 2, 4, 4, ... s
    while its worker cannot be reached, for at most ``unreachable_s``. Nothing reached a
    worker; were it delivered after all, its ``base_revision`` is stale by then, and the
    409 goes the way of any revision conflict: a batch is never applied twice."""
    sent: Route | Completion | Envelope = (
        Envelope(request, model) if enveloped(request) else request
    )
    deadline = time.monotonic() + unreachable_s
    waits = backoff()
    while True:
        try:
            return (yield sent)
        except (openai.APIStatusError, openai.APIConnectionError) as exc:
            delay = next(waits)
            if not unreachable(exc) or time.monotonic() + delay > deadline:
                raise
            logger.info("worker unreachable (%s); sending again in %.1f s", exc, delay)
            yield Wait(delay)


def backoff() -> Iterator[float]:
    """The waits before each re-send: :data:`BACKOFF_S`, then its last, again and again."""
    yield from BACKOFF_S
    while True:
        yield BACKOFF_S[-1]


def _jsonable(value: object) -> Any:
    """``value`` as JSON data (pydantic models dumped, as openai does with arguments)."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", exclude_unset=True)
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items() if not isinstance(v, _OMITTED)}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value
