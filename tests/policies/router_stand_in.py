"""A STAND-IN for sglang-router 0.3.2 in front of ``leyline serve`` workers, for tests.

It imitates what docs/reports/router-probe.md found the real router do under
``--policy manual --assignment-mode min_group``, and nothing more:

* it forwards ``POST /v1/completions`` (an envelope: docs/router-design.md) and
  ``POST /v1/chat/completions`` to one worker chosen by ``X-SMG-Routing-Key``: a key is
  sticky, a new key goes to the worker that holds fewer keys, a request without one to the
  next worker in turn (the real router picks one at random);
* it takes a top-level ``leyline`` field out of a chat body (and renames ``max_tokens`` to
  ``max_completion_tokens``), as the real router's re-serialization does;
* it answers every other request itself with a bare 404 (no body), ``/leyline/v1/*``
  included, whatever the method;
* only ``authorization``, ``content-type``, ``accept`` and ``x-smg-routing-key`` reach
  the worker; the worker's status, content type and body come back (a stream whole).

For the failure tests:

* ``kill(worker)``: the worker is gone, and with it what it held; its keys move to the
  other workers on their next request. ``restart(worker, root)``: it is back, as a fresh
  server (a new ``leyline serve``) holding nothing. The real router answers them
  ``500 call_upstream_request_error`` until its health checks move them (about 1.4 s with
  the flags of docs/router-design.md): ``fail_upstream`` imitates that window.
* ``fail_upstream = n``: the next n chat turns in envelopes get that 500, unforwarded;
* ``lose_answers = n``: the next n chat turns in envelopes are forwarded, and then
  answered that 500 instead of the worker's answer (a connection lost on the way back).

The real router in front of real workers is exercised by ``make router-live-check`` (to
come). Like ``plain_server``, it serves real HTTP on a loopback port (stdlib, no torch).
"""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import Any

import httpx

from leyline.policies.middleware_wire import ROUTING_KEY

from .loopback import Loopback, QuietHandler, serving

FORWARDED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
FORWARDED_HEADERS = frozenset({"authorization", "content-type", "accept", ROUTING_KEY.lower()})
UPSTREAM_ERROR = {
    "error": {
        "type": "Internal Server Error",
        "code": "call_upstream_request_error",
        "message": "error sending request for url (stand-in)",
    }
}


@dataclass(frozen=True)
class Forwarded:
    """A request the stand-in sent to a worker, and the worker's status."""

    worker: int
    path: str
    key: str | None
    body: dict[str, Any]
    status: int

    @property
    def route(self) -> dict[str, Any] | None:
        """The envelope's ``leyline.route`` (None: not an envelope)."""
        leyline = self.body.get("leyline") if self.path == "/v1/completions" else None
        return leyline.get("route") if isinstance(leyline, dict) else None

    @property
    def turn(self) -> dict[str, Any] | None:
        """The chat turn an envelope carried (its body), else None."""
        route = self.route
        if route is None or route["path"] != "/v1/chat/completions":
            return None
        body: dict[str, Any] = route["body"]
        return body


class RouterStandIn(Loopback):
    def __init__(self, workers: Sequence[str]) -> None:
        """``workers``: the workers' roots (``http://127.0.0.1:PORT``)."""
        super().__init__(_handler(self))
        self.clients = [httpx.Client(base_url=root, timeout=300) for root in workers]
        self.alive = [True] * len(workers)
        self.keys: dict[str, int] = {}
        """Each routing key's worker."""
        self.forwarded: list[Forwarded] = []
        self.refused: list[str] = []
        """``METHOD path`` of each request answered with the bare 404."""
        self.fail_upstream = 0
        self.lose_answers = 0
        self.failed = 0
        """Requests answered with the router's 500 (unforwarded or lost)."""
        self._lock = threading.Lock()
        self._turns = itertools.count()

    def kill(self, worker: int) -> None:
        self.alive[worker] = False

    def restart(self, worker: int, root: str) -> None:
        """Worker ``worker`` is back as a fresh server at ``root``, holding nothing: keys
        still bound to it go to it again (as the real router's do once its health checks
        pass), keys that moved while it was down stay where they went."""
        self.clients[worker].close()
        self.clients[worker] = httpx.Client(base_url=root, timeout=300)
        self.alive[worker] = True

    def pick(self, key: str | None) -> int:
        alive = [i for i, up in enumerate(self.alive) if up]
        with self._lock:
            if key is None:
                return alive[next(self._turns) % len(alive)]
            bound = self.keys.get(key)
            if bound is not None and self.alive[bound]:
                return bound
            held = {i: sum(1 for w in self.keys.values() if w == i) for i in alive}
            chosen = min(alive, key=lambda i: (held[i], i))
            self.keys[key] = chosen
            return chosen

    def workers_of(self, key: str) -> set[int]:
        """The workers that got requests with ``key``."""
        return {f.worker for f in self.forwarded if f.key == key}

    def take(self, kind: str) -> bool:
        """Use up one of ``fail_upstream`` or ``lose_answers``; whether there was one."""
        with self._lock:
            left = getattr(self, kind)
            if left <= 0:
                return False
            setattr(self, kind, left - 1)
            self.failed += 1
            return True

    def close(self) -> None:
        for client in self.clients:
            client.close()


@contextmanager
def router_stand_in(workers: Sequence[str]) -> Iterator[RouterStandIn]:
    router = RouterStandIn(workers)
    try:
        with serving(router):
            yield router
    finally:
        router.close()


def _handler(router: RouterStandIn) -> type[BaseHTTPRequestHandler]:
    class Handler(QuietHandler):
        disable_nagle_algorithm = True

        def _route(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            raw = self.rfile.read(length) if length else b""
            path = self.path.split("?")[0]
            if self.command != "POST" or path not in FORWARDED_PATHS:
                router.refused.append(f"{self.command} {path}")
                self.send_response(404)
                self.send_header("content-length", "0")
                self.end_headers()
                return
            body = json.loads(raw)
            if path == "/v1/chat/completions":
                body.pop("leyline", None)
                if "max_tokens" in body:
                    body["max_completion_tokens"] = body.pop("max_tokens")
            key = self.headers.get(ROUTING_KEY)
            turn = _carries_turn(body)
            if turn and router.take("fail_upstream"):
                self.reply(500, json.dumps(UPSTREAM_ERROR).encode())
                return
            worker = router.pick(key)
            headers = {k: v for k, v in self.headers.items() if k.lower() in FORWARDED_HEADERS}
            answer = router.clients[worker].post(path, json=body, headers=headers)
            router.forwarded.append(Forwarded(worker, path, key, body, answer.status_code))
            if turn and router.take("lose_answers"):
                self.reply(500, json.dumps(UPSTREAM_ERROR).encode())
                return
            _relay(self, answer)

        do_GET = do_POST = do_DELETE = do_PUT = _route

    return Handler


def _relay(handler: BaseHTTPRequestHandler, answer: httpx.Response) -> None:
    """Send the worker's answer on: its status, content type (if any) and body."""
    handler.send_response(answer.status_code)
    if "content-type" in answer.headers:
        handler.send_header("content-type", answer.headers["content-type"])
    handler.send_header("content-length", str(len(answer.content)))
    handler.end_headers()
    handler.wfile.write(answer.content)


def _carries_turn(body: Any) -> bool:
    """Whether an envelope carries a chat turn."""
    leyline = body.get("leyline") if isinstance(body, dict) else None
    route = leyline.get("route") if isinstance(leyline, dict) else None
    return isinstance(route, dict) and route.get("path") == "/v1/chat/completions"


class RecordingProxy(Loopback):
    """A proxy that forwards everything to one worker unchanged and records what it was
    sent (``METHOD path``, routing key, JSON body): a direct client's requests, seen."""

    def __init__(self, worker: str) -> None:
        super().__init__(_recorder(self))
        self.client = httpx.Client(base_url=worker, timeout=300)
        self.seen: list[tuple[str, str | None, Any]] = []


@contextmanager
def recording_proxy(worker: str) -> Iterator[RecordingProxy]:
    proxy = RecordingProxy(worker)
    try:
        with serving(proxy):
            yield proxy
    finally:
        proxy.client.close()


def _recorder(proxy: RecordingProxy) -> type[BaseHTTPRequestHandler]:
    class Handler(QuietHandler):
        disable_nagle_algorithm = True

        def _forward(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            raw = self.rfile.read(length) if length else b""
            key = self.headers.get(ROUTING_KEY)
            proxy.seen.append((f"{self.command} {self.path}", key, json.loads(raw or b"null")))
            headers = {k: v for k, v in self.headers.items() if k.lower() in FORWARDED_HEADERS}
            answer = proxy.client.request(self.command, self.path, content=raw, headers=headers)
            _relay(self, answer)

        do_GET = do_POST = do_DELETE = _forward

    return Handler
