"""A stdlib HTTP server on a loopback port (no torch, no fastapi), for the tests' stand-ins
of other servers: ``plain_server`` here, ``tests/integration/flaky_proxy``, and the not-
Leyline server of ``tests/meta/test_cli``."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class QuietHandler(BaseHTTPRequestHandler):
    """A request handler that logs nothing; ``reply`` sends one whole response."""

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def reply(self, status: int, data: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class Loopback:
    """A server of ``handler`` on a free loopback port; it runs inside ``serving``."""

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self.http = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.root = f"http://127.0.0.1:{self.http.server_address[1]}"

    @property
    def base_url(self) -> str:
        """The OpenAI base URL (``/v1``)."""
        return f"{self.root}/v1"


@contextmanager
def serving(server: Loopback) -> Iterator[None]:
    """``server`` answering on a daemon thread; shut down and closed on exit."""
    threading.Thread(target=server.http.serve_forever, daemon=True).start()
    try:
        yield
    finally:
        server.http.shutdown()
        server.http.server_close()
