"""Run a generation on the model worker, cancel it when the client goes away, stream tokens.

A job gets an ``on_token`` callback (called on the worker thread for every token; returns
False once cancelled) and is queued on the service's single worker. A job still queued when
its client leaves never starts; a running one stops at its next token.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from typing import Generic, TypeVar

from starlette.requests import Request

from .service import LeylineService, OnToken

T = TypeVar("T")
_POLL_SECONDS = 0.2


class Cancelled(Exception):
    """The client disconnected before its job started."""


class TokenJob(Generic[T]):
    """A job on the worker whose generated tokens arrive on an asyncio queue."""

    def __init__(self, service: LeylineService, job: Callable[[OnToken], T]) -> None:
        loop = asyncio.get_running_loop()
        self.cancelled = threading.Event()
        self.tokens: asyncio.Queue[int | None] = asyncio.Queue()

        def on_token(token: int) -> bool:
            loop.call_soon_threadsafe(self.tokens.put_nowait, token)
            return not self.cancelled.is_set()

        def guarded() -> T:
            if self.cancelled.is_set():
                raise Cancelled
            return job(on_token)

        self.task: asyncio.Future[T] = asyncio.ensure_future(service.run(guarded))
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
