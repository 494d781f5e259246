"""Run a generation on the model worker, cancel it when the client goes away, stream tokens.

A job gets an ``on_token`` callback (called on the worker thread for every token; returns
False once cancelled) and a cancellation check; the service queues its model work on the
single worker and checks it first, so a job still queued when its client leaves never
starts; a running one stops at its next token.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Generic, TypeVar

from starlette.requests import Request

from .turns import IsCancelled, OnToken

T = TypeVar("T")
_POLL_SECONDS = 0.2

Job = Callable[[OnToken, IsCancelled], Awaitable[T]]
"""The request's work: it must not start model work once ``IsCancelled`` says so."""


class TokenJob(Generic[T]):
    """A job whose generated tokens (chosen on the worker) arrive on an asyncio queue."""

    def __init__(self, job: Job[T]) -> None:
        loop = asyncio.get_running_loop()
        self.cancelled = threading.Event()
        self.tokens: asyncio.Queue[int | None] = asyncio.Queue()

        def on_token(token: int) -> bool:
            loop.call_soon_threadsafe(self.tokens.put_nowait, token)
            return not self.cancelled.is_set()

        self.task: asyncio.Future[T] = asyncio.ensure_future(job(on_token, self.cancelled.is_set))
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
