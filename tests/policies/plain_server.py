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
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler
from typing import Any

from .loopback import Loopback, QuietHandler, serving
from .sse import sse


class PlainServer(Loopback):
    def __init__(self) -> None:
        super().__init__(_handler(self))
        self.requests: list[dict[str, Any]] = []
        """Bodies of the chat requests, in order."""
        self.paths: list[str] = []
        """Every ``METHOD path`` asked, in order."""
        self.fail_next: list[int] = []
        """Statuses to answer the next chat requests with (then normal again)."""

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
    with serving(server):
        yield server


def _handler(server: PlainServer) -> type[BaseHTTPRequestHandler]:
    class Handler(QuietHandler):
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
            self.reply(200, data, "text/event-stream")

        def _send(self, status: int, body: dict[str, Any]) -> None:
            self.reply(status, json.dumps(body).encode())

    return Handler
