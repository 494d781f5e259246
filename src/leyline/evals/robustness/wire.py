"""One keep-alive HTTP connection to the server, and what each request got back.

The socket's local port identifies the connection: if it changes between two requests,
the server dropped the connection after the first of them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx

WRONG_KEY = "not-a-key-0123456789"


def auth_headers(key: str | None) -> dict[str, str]:
    """The bearer header for ``key``; none for a server that takes no key (None)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


@dataclass(frozen=True, slots=True)
class Outcome:
    status: int
    """The HTTP status, or 0 when the transport failed (no answer)."""
    body: bytes
    content_type: str
    seconds: float
    connection: int | None
    """The local port of the connection that carried it."""
    error: str = ""
    location: str = ""
    """A redirect's ``Location`` header."""
    closed: bool = False
    """The server closed the connection after answering (``Connection: close``)."""


class Wire:
    def __init__(self, base_url: str, api_key: str | None, timeout: float = 300) -> None:
        self.key = api_key
        self.client = httpx.Client(base_url=base_url, timeout=timeout)

    def send(self, method: str, path: str, body: bytes | None = None, auth: str = "key") -> Outcome:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        key = {"key": self.key, "wrong": WRONG_KEY, "none": None}[auth]
        if key:
            headers["Authorization"] = f"Bearer {key}"
        t0 = time.perf_counter()
        try:
            reply = self.client.request(method, path, content=body, headers=headers)
        except httpx.TransportError as exc:
            return Outcome(0, b"", "", time.perf_counter() - t0, None, repr(exc))
        port = _local_port(reply)
        content_type = reply.headers.get("content-type", "")
        seconds = time.perf_counter() - t0
        location = reply.headers.get("location", "")
        closed = reply.headers.get("connection", "").lower() == "close"
        return Outcome(
            reply.status_code, reply.content, content_type, seconds, port, location=location,
            closed=closed,
        )  # fmt: skip

    def close(self) -> None:
        self.client.close()


def _local_port(reply: httpx.Response) -> int | None:
    stream = reply.extensions.get("network_stream")
    try:
        sock = stream.get_extra_info("socket") if stream is not None else None
        return int(sock.getsockname()[1]) if sock is not None else None
    except OSError:  # already closed by the server
        return None
