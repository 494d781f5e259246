"""The typed clients' routed mode: each ``/leyline/v1/...`` call as one envelope.

A router that forwards only the OpenAI routes (sglang-router answers ``/leyline/v1`` itself
with a bare 404) gets each call as ``POST /v1/completions`` whose body carries the call in
``leyline.route`` (docs/protocol.md section 8, "Envelopes"), with a routing key in
``X-SMG-Routing-Key`` that keeps a session's calls on one worker. The worker's tunnel answers
with the inner call's answer, which is parsed exactly as a direct one.

Which key a call carries (docs/protocol.md, "Clients behind a router"):

* a call about a session (create, get, delete, apply): the session's id, always;
* any other call (capabilities, tokenize, detokenize, schema, skills): the client's
  ``routing_key`` (set at construction or by ``with_routing_key``), else none, and the
  router picks a worker. Skills are per worker: register one with the key of the session
  that will compose it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from ._calls import Call

ROUTING_KEY = "X-SMG-Routing-Key"
"""The header naming the session a request belongs to: sglang-router (``--policy manual``)
sends every request with the same key to the same worker; a server ignores it."""

ENVELOPE_PATH = "/v1/completions"
"""Where every envelope goes, from the router's root."""

DEFAULT_MODEL = "default"
"""An envelope's outer ``model`` unless the client is given one (the router requires the
field; the worker's tunnel does not read it)."""


def new_session_id() -> str:
    """A fresh session id (routed mode names a new session itself: its routing key must
    exist on the request that creates it)."""
    return f"leyline-{uuid.uuid4().hex[:16]}"


def envelope_body(
    method: str, target: str, body: object, model: str, *, stream: bool = False
) -> dict[str, Any]:
    """The JSON body of an envelope carrying ``method target`` (path with its query) with
    the JSON ``body`` (None: none); ``stream``: the inner answer is a stream (the router
    streams the worker's answer through only then)."""
    route = {"method": method.upper(), "path": target, "body": body}
    return {
        "model": model,
        "prompt": ".",
        "max_tokens": 1,
        "stream": stream,
        "leyline": {"route": route},
    }


@dataclass(frozen=True, slots=True)
class Sending:
    """How a client sends its calls: directly (``routed=False``, the call as it is) or as
    envelopes with a routing key."""

    routed: bool = False
    key: str | None = None
    """The routing key of calls not about a session (None: no header)."""
    model: str = DEFAULT_MODEL

    def request(self, call: Call[Any], session: str | None = None) -> tuple[str, str, Any]:
        """``(method, path, httpx keyword arguments)`` for ``call``; ``session``: the session
        it is about (its routing key)."""
        if not self.routed:
            return call.method, call.path, call.request_kwargs()
        kwargs: dict[str, Any] = {
            "json": envelope_body(call.method, call.target(), call.json_body(), self.model)
        }
        key = session if session is not None else self.key
        if key is not None:
            kwargs["headers"] = {ROUTING_KEY: key}
        return "POST", ENVELOPE_PATH, kwargs
