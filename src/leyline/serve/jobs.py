"""Run a generation on the model worker, cancel it when the client goes away, stream tokens.

A job gets an ``on_token`` callback (called on the worker thread for every token; returns
False once cancelled) and a cancellation check; the service queues its model work on the
single worker and checks it first, so a job still queued when its client leaves never
starts; a running one stops at its next token. ``ClientGone`` is what tells, for every
request of ``leyline serve``, streamed or not, chat or ``/leyline/v1``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Generic, TypeVar

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from leyline.core.turns import IsCancelled, OnToken

T = TypeVar("T")
_POLL_SECONDS = 0.2

Job = Callable[[OnToken, IsCancelled], Awaitable[T]]
"""The request's work: it must not start model work once ``IsCancelled`` says so."""


class TokenJob(Generic[T]):
    """A job whose generated tokens (chosen on the worker) arrive on an asyncio queue."""

    def __init__(self, job: Job[T], gone: IsCancelled | None = None) -> None:
        """``gone``: whether the client has hung up, where the server tracks it
        (``ClientGone``); without it, only ``result_or_cancel`` notices."""
        loop = asyncio.get_running_loop()
        self.cancelled = threading.Event()
        self.tokens: asyncio.Queue[int | None] = asyncio.Queue()

        def cancelled() -> bool:
            return self.cancelled.is_set() or (gone is not None and gone())

        def on_token(token: int) -> bool:
            loop.call_soon_threadsafe(self.tokens.put_nowait, token)
            return not cancelled()

        self.task: asyncio.Future[T] = asyncio.ensure_future(job(on_token, cancelled))
        self.task.add_done_callback(lambda _: self.tokens.put_nowait(None))

    def cancel(self) -> None:
        self.cancelled.set()

    async def first_token(self) -> int | None:
        """Wait for the first token, or for the job to end (re-raising its error)."""
        token = await self.tokens.get()
        if token is None:
            self.task.result()  # raises the job's error, if any
        return token

    async def rest(self) -> AsyncIterator[int]:
        while (token := await self.tokens.get()) is not None:
            yield token

    async def result_or_cancel(self, request: Request) -> T:
        """Await the job; cancel it if the client disconnects meanwhile."""
        while not self.task.done():
            done, _ = await asyncio.wait({self.task}, timeout=_POLL_SECONDS)
            if not done and await request.is_disconnected():
                self.cancel()
        return self.task.result()


class ClientGone:
    """Pure ASGI middleware: ``request.state.client_gone`` says whether the client hung up.

    Model jobs check it when they would start (``TokenJob``, ``EditPlan.cancelled``), so
    work queued behind other work whose client left changes nothing. Once the app has read
    the whole body, a watcher waits for the transport's ``http.disconnect``; the app's later
    ``receive`` calls (``Request.is_disconnected``, a stream's disconnect listener) are
    answered from it, since two readers of one connection would race for its messages.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        gone = threading.Event()  # read on the model's threads
        watcher: asyncio.Future[None] | None = None

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        async def tracked() -> Message:
            nonlocal watcher
            if watcher is None:
                message = await receive()
                if message["type"] == "http.disconnect":
                    gone.set()
                elif not message.get("more_body", False):  # the body is read
                    watcher = asyncio.ensure_future(watch())
                return message
            if not watcher.done():
                await asyncio.shield(watcher)  # a caller's cancel leaves the watcher be
            return {"type": "http.disconnect"}

        scope.setdefault("state", {})["client_gone"] = gone.is_set
        try:
            await self.app(scope, tracked, send)
        finally:
            if watcher is not None:
                watcher.cancel()
