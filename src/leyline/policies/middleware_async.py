"""``AsyncLeylineOpenAI``: the ``openai.AsyncOpenAI`` twin of :class:`~.middleware.LeylineOpenAI`.

The async shell of the same flow (:class:`~.middleware_base.WrapperBase`): its requests are
awaited. The planner is pure and synchronous; it runs in a worker thread so that, when it
needs the server's rendering of the messages or a summary, those requests run on this
event loop meanwhile.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, TypeVar

import openai
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from .flows import Flow, arun
from .middleware_base import WrapperBase
from .middleware_routed import Wait
from .middleware_wire import Plan, ServerSupport, StreamBase

_RENDER_TIMEOUT_S = 120.0
T = TypeVar("T")


class AsyncLeylineStream(StreamBase):
    """The chunks of a streamed call, as ``openai.AsyncStream`` yields them (``async for``,
    ``async with``, ``await close()``); see :class:`~.middleware.LeylineStream`."""

    _errors = BaseException

    @staticmethod
    def _iterate(stream: Any) -> AsyncIterator[ChatCompletionChunk]:
        return stream.__aiter__()  # type: ignore[no-any-return]

    def __aiter__(self) -> AsyncIterator[ChatCompletionChunk]:
        return self

    async def __anext__(self) -> ChatCompletionChunk:
        try:
            chunk: ChatCompletionChunk = await self._iterator.__anext__()
        except BaseException as error:
            await _settled(self._ended(error))
            raise
        await _settled(self._received(chunk))
        return chunk

    async def close(self) -> None:
        await _settled(self._settle(None))
        await self._stream.close()

    async def __aenter__(self) -> AsyncLeylineStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class _AsyncCompletions:
    def __init__(self, owner: AsyncLeylineOpenAI) -> None:
        self._owner = owner

    async def create(self, *, messages: Iterable[object], **kwargs: Any) -> Any:
        """``await client.chat.completions.create(...)`` with the policy applied; with
        ``stream=True`` an :class:`AsyncLeylineStream`.

        Raises: as :meth:`LeylineOpenAI.chat.completions.create`.
        """
        return await self._owner._create(messages, kwargs)


class AsyncLeylineOpenAI(WrapperBase[openai.AsyncOpenAI]):
    """Wraps an ``openai.AsyncOpenAI`` client; a drop-in for it.

    The arguments are those of :class:`~.middleware.LeylineOpenAI` (``routed=True`` and
    ``unreachable_s`` included);
    ``await client.chat.completions.create(...)`` (with ``stream=True``: an async iterator
    of chunks), ``await client.probe()``, ``await client.aclose()``.
    """

    _lock_type = asyncio.Lock
    _completions_type = _AsyncCompletions
    _stream_type = AsyncLeylineStream

    async def probe(self) -> ServerSupport:
        """See :meth:`LeylineOpenAI.probe <.middleware.LeylineOpenAI.probe>`."""
        return await self._run(self._probe())

    async def aclose(self) -> None:
        """Free the sessions' caches on the server (best effort; the client stays open)."""
        await self._run(self._close_sessions(list(self.conversations.episodes)))

    async def __aenter__(self) -> AsyncLeylineOpenAI:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _create(self, messages: Iterable[object], kwargs: dict[str, Any]) -> Any:
        flow = self._call(messages, kwargs)
        async with self._state.lock:
            return await self._run(flow)

    def _locked(self, commit: Callable[[ChatCompletion | None], None]) -> Callable[..., Any]:
        async def locked(completion: ChatCompletion | None) -> None:
            async with self._state.lock:
                commit(completion)

        return locked

    async def _run(self, flow: Flow[T]) -> T:
        return await arun(flow, self._perform)

    async def _perform(self, request: Any) -> Any:
        if isinstance(request, Wait):
            await asyncio.sleep(request.seconds)
            return None
        if not isinstance(request, Plan):
            return await request.send(self.client)
        # Plan in a worker thread; its requests (tokenize, summaries) run on this loop.
        loop = asyncio.get_running_loop()

        def on_loop(flow: Flow[T]) -> T:
            return asyncio.run_coroutine_threadsafe(self._run(flow), loop).result(_RENDER_TIMEOUT_S)

        return await asyncio.to_thread(request.work, on_loop)


async def _settled(commit: Awaitable[None] | None) -> None:
    """Await what a stream's commit answered (None: it did not commit now)."""
    if commit is not None:
        await commit
