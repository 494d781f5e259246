"""A STAND-IN for "any other OpenAI server": OpenAI-compatible chat, no Leyline, for tests.

It answers ``POST /v1/chat/completions`` with a canned reply (``reply 1``, ``reply 2``, ...),
streamed as OpenAI streams when asked (usage in a chunk of its own), and ``GET /v1/models``;
every other route, ``/leyline/v1/...`` included, is a 404 with
FastAPI's body (``{"detail": "Not Found"}``), as a vLLM or llama.cpp server would answer.
It runs on real HTTP on a loopback port (stdlib ``http.server``, no torch, no fastapi), and
keeps the bodies it received so that tests can check what a client sent.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .sse import sse


class PlainServer:
    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        """Bodies of the chat requests, in order."""
        self.paths: list[str] = []
        """Every ``METHOD path`` asked, in order."""
        self.fail_next: list[int] = []
        """Statuses to answer the next chat requests with (then normal again)."""
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._http.server_address[1]}/v1"

    def chat(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        self.requests.append(body)
        if self.fail_next:
            status = self.fail_next.pop(0)
            return status, {"error": {"message": "injected failure", "type": "server_error"}}
        n = len(self.requests)
        prompt = sum(len(json.dumps(m)) for m in body.get("messages", [])) // 4
        return 200, {
            "id": f"chatcmpl-{n}",
            "object": "chat.completion",
            "created": 0,
            "model": body.get("model", "plain"),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": f"reply {n}"},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": prompt, "completion_tokens": 2, "total_tokens": prompt + 2},
        }


@contextmanager
def plain_server() -> Iterator[PlainServer]:
    server = PlainServer()
    server._thread.start()
    try:
        yield server
    finally:
        server._http.shutdown()
        server._http.server_close()


def _handler(server: PlainServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # quiet
            pass

        def do_GET(self) -> None:
            server.paths.append(f"GET {self.path}")
            if self.path.rstrip("/") == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": "plain", "object": "model"}]})
            else:
                self._send(404, {"detail": "Not Found"})

        def do_POST(self) -> None:
            server.paths.append(f"POST {self.path}")
            length = int(self.headers.get("content-length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            if self.path.rstrip("/") == "/v1/chat/completions":
                status, answer = server.chat(body)
                if body.get("stream") and status == 200:
                    usage = bool((body.get("stream_options") or {}).get("include_usage"))
                    self._stream(sse(answer, include_usage=usage, usage_apart=True))
                else:
                    self._send(status, answer)
            else:
                self._send(404, {"detail": "Not Found"})

        def do_DELETE(self) -> None:
            server.paths.append(f"DELETE {self.path}")
            self._send(404, {"detail": "Not Found"})

        def _stream(self, data: bytes) -> None:
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _send(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler
