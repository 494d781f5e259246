"""A loopback proxy in front of a real server that fails chosen requests, for tests.

It forwards every request unchanged, except that while ``fail_directives`` is positive a
chat request carrying Leyline directives is answered with ``status`` (a server error the
client must survive) and not forwarded.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler
from typing import Any

import httpx

from tests.policies.loopback import Loopback, QuietHandler, serving


class FlakyProxy(Loopback):
    def __init__(self, upstream_root: str, status: int = 503) -> None:
        super().__init__(_handler(self))
        self.upstream = httpx.Client(base_url=upstream_root, timeout=300)
        self.status = status
        self.fail_directives = 0
        self.failed = 0

    def should_fail(self, body: bytes) -> bool:
        if self.fail_directives <= 0 or not body:
            return False
        leyline: Any = json.loads(body).get("leyline") or {}
        if not leyline.get("directives"):
            return False
        self.fail_directives -= 1
        self.failed += 1
        return True


@contextmanager
def flaky_proxy(upstream_root: str, status: int = 503) -> Iterator[FlakyProxy]:
    proxy = FlakyProxy(upstream_root, status)
    try:
        with serving(proxy):
            yield proxy
    finally:
        proxy.upstream.close()


def _handler(proxy: FlakyProxy) -> type[BaseHTTPRequestHandler]:
    class Handler(QuietHandler):
        def _forward(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length) if length else b""
            if proxy.should_fail(body):
                error = {"error": {"message": "injected failure", "type": "server_error"}}
                self.reply(proxy.status, json.dumps(error).encode(), "application/json")
                return
            headers = {
                k: v
                for k, v in self.headers.items()
                if k.lower() in {"content-type", "authorization"}
            }
            answer = proxy.upstream.request(self.command, self.path, content=body, headers=headers)
            self.reply(
                answer.status_code,
                answer.content,
                answer.headers.get("content-type", "application/json"),
            )

        do_GET = do_POST = do_DELETE = _forward

    return Handler
