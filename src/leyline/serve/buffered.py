"""A request body read whole by an ASGI middleware that must look at it before choosing
where the request goes, then replayed to whichever app it picks."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.types import Message, Receive, Scope, Send

from leyline.core.route_guard import error_response
from leyline.protocol import ErrorCode, LeylineError


@dataclass(frozen=True, slots=True)
class Buffered:
    body: bytes
    receive: Receive
    """The buffered messages first, then the live channel (a disconnect)."""


async def read_body(scope: Scope, receive: Receive, send: Send, max_bytes: int) -> Buffered | None:
    """The body, or None once a larger one was refused (413 ``limit_exceeded``; never read
    whole)."""
    messages: list[Message] = []
    body = b""
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            break  # a disconnect: let the app see it
        body += message.get("body", b"")
        if len(body) > max_bytes:
            too_large = LeylineError(
                ErrorCode.limit_exceeded, f"request body is larger than {max_bytes} bytes", "body"
            )
            await error_response(too_large)(scope, receive, send)
            return None
        if not message.get("more_body", False):
            break
    replay = iter(messages)

    async def replayed() -> Message:
        return next(replay, None) or await receive()

    return Buffered(body, replayed)
