"""``AsyncLeylineOpenAI``: the ``openai.AsyncOpenAI`` twin of :class:`~.middleware.LeylineOpenAI`.

Same episode logic (:class:`~.middleware_core.Episode`), awaited I/O. The planner is pure
and synchronous; it runs in a worker thread so that, when it needs the server's rendering
of the messages or a summary, those requests run on this event loop meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar
from urllib.parse import quote

import openai
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import ValidationError

from leyline.protocol.resources import Routes, SessionInfo, TokenizeResponse

from .base import SummaryRequest
from .messages import Message, canonical_json
from .middleware_base import WrapperBase
from .middleware_core import Episode, PreparedCall
from .middleware_wire import (
    LEYLINE_KEY,
    ChunkAccumulator,
    RenderUnavailable,
    ServerSupport,
    composes,
    extra_body_of,
    failed_skills,
    is_revision_conflict,
    normalize_messages,
    pinned_error,
    renderer,
    resync_reason,
    server_root,
    summary_kwargs,
    summary_text,
    support_from_capabilities,
    support_from_status,
    tokenize_body,
    with_stream_usage,
)
from .retention_marks import Dropped

logger = logging.getLogger("leyline.policies.middleware")

_RENDER_TIMEOUT_S = 120.0
T = TypeVar("T")


class AsyncLeylineOpenAI(WrapperBase[openai.AsyncOpenAI]):
    """Wraps an ``openai.AsyncOpenAI`` client; a drop-in for it.

    The arguments are those of :class:`~.middleware.LeylineOpenAI`;
    ``await client.chat.completions.create(...)`` (with ``stream=True``: an async iterator
    of chunks), ``await client.probe()``, ``await client.aclose()``.
    """

    @staticmethod
    def _new_lock() -> Any:
        return asyncio.Lock()

    def _make_chat(self) -> Any:
        return _AsyncChat(self)

    async def probe(self) -> ServerSupport:
        """See :meth:`LeylineOpenAI.probe <.middleware.LeylineOpenAI.probe>`."""
        state = self._state
        if state.support is None:
            url = server_root(self.client.base_url) + Routes.capabilities
            try:
                support = support_from_capabilities(await self.client.get(url, cast_to=object))
            except openai.APIStatusError as exc:
                support = support_from_status(exc.status_code)
            state.support = support
            if not support.leyline and not state.warned:
                state.warned = True
                logger.warning(
                    "%s: %s; edits go as plain messages, which the server re-prefills",
                    self.client.base_url,
                    support.note,
                )
        return state.support

    async def aclose(self) -> None:
        """Free the sessions' caches on the server (best effort; the client stays open)."""
        await self._close_sessions(list(self.conversations.episodes))

    async def _close_sessions(self, episodes: Sequence[Episode]) -> None:
        support = self._state.support
        if support is None or not support.leyline:
            return
        for episode in episodes:
            path = Routes.session.format(session=quote(episode.session, safe=""))
            with contextlib.suppress(openai.APIError):
                await self.client.delete(server_root(self.client.base_url) + path, cast_to=object)

    async def __aenter__(self) -> AsyncLeylineOpenAI:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- one call ---------------------------------------------------------------------

    async def _create(
        self, messages: Iterable[object], kwargs: dict[str, Any]
    ) -> ChatCompletion | AsyncLeylineStream:
        agent = normalize_messages(messages)
        extra = extra_body_of(kwargs)
        streamed = bool(kwargs.get("stream"))
        async with self._state.lock:
            support = await self.probe()
            episode, evicted, new = self.conversations.route(agent)
            await self._close_sessions(evicted)
            if episode.pending is not None:  # a stream left unread: the cache is unknown
                episode.pending = None
                episode.drop()
            if streamed and support.leyline and episode.directives:
                kwargs = with_stream_usage(kwargs)
            summarizer = self._summarizer(kwargs.get("model"))
            prepared = await self._prepare(episode, agent, support, kwargs.get("tools"), summarizer)
            t0 = time.perf_counter()
            resync = None
            dropped: tuple[Dropped, ...] = ()
            try:
                response = await self._send(prepared, kwargs, extra)
            except (openai.APIStatusError, openai.APIConnectionError) as exc:
                _raise_pinned(exc, episode)
                plan = prepared.plan
                if prepared.leyline is None or not (plan.directives or plan.check_revision):
                    raise  # nothing of ours in it: the planner is as it was
                response = None
                if is_revision_conflict(exc) and episode.planner.decaying:
                    # The server dropped decay spans: mirror them, send the call again.
                    dropped = await self._mirror(episode) or ()
                    if dropped:
                        prepared = await self._prepare(
                            episode, agent, support, kwargs.get("tools"), summarizer
                        )
                        try:
                            response = await self._send(prepared, kwargs, extra)
                        except (openai.APIStatusError, openai.APIConnectionError) as again:
                            _raise_pinned(again, episode)
                            exc = again
                if response is None:
                    resync = resync_reason(exc)
                    logger.info("re-sending without directives (%s)", resync)
                    self._drop_skills(exc, prepared)
                    episode.drop()
                    prepared = await self._prepare(
                        episode, agent, support, kwargs.get("tools"), summarizer
                    )
                    try:
                        response = await self._send(prepared, kwargs, extra)
                    except openai.APIStatusError as final:
                        _raise_pinned(final, episode)
                        raise
            if isinstance(response, ChatCompletion):
                latency = time.perf_counter() - t0
                episode.commit(
                    prepared,
                    response,
                    support,
                    latency,
                    resync,
                    new_conversation=new,
                    dropped=dropped,
                )
                return response

            async def commit(completion: ChatCompletion | None) -> None:
                async with self._state.lock:
                    if episode.pending is not stream:
                        return
                    episode.pending = None
                    if completion is None:
                        episode.drop()
                        return
                    latency = time.perf_counter() - t0
                    episode.commit(
                        prepared,
                        completion,
                        support,
                        latency,
                        resync,
                        streamed=True,
                        new_conversation=new,
                        dropped=dropped,
                    )

            stream = AsyncLeylineStream(response, commit, reported=prepared.leyline is not None)
            episode.pending = stream
            return stream

    async def _prepare(
        self,
        episode: Episode,
        agent: Sequence[Message],
        support: ServerSupport,
        tools: object,
        summarizer: Callable[[SummaryRequest], Awaitable[str]],
    ) -> PreparedCall:
        """Plan in a worker thread; its requests (tokenize, summaries) run on this loop."""
        loop = asyncio.get_running_loop()

        def on_loop(make: Callable[[], Awaitable[T]]) -> T:
            async def run() -> T:
                return await make()

            return asyncio.run_coroutine_threadsafe(run(), loop).result(_RENDER_TIMEOUT_S)

        def tokenize(messages: Sequence[Message], listed: list[object] | None) -> TokenizeResponse:
            return on_loop(lambda: self._tokenize(messages, listed))

        def summarize(request: SummaryRequest) -> str:
            return on_loop(lambda: summarizer(request))

        planner = episode.planner
        renders = support.leyline and episode.directives
        planner.render = renderer(tokenize, tools) if renders else None
        planner.skills = composes(self.skills, support) if renders else None
        planner.summarizer = summarize
        try:
            return await asyncio.to_thread(episode.prepare, agent, support)
        except RenderUnavailable as exc:
            logger.info("planning without the server's rendering: %s", exc)
            planner.render = None
            return await asyncio.to_thread(episode.prepare, agent, support)
        finally:
            planner.render = planner.skills = planner.summarizer = None

    async def _mirror(self, episode: Episode) -> tuple[Dropped, ...] | None:
        """Read the session (``GET /leyline/v1/sessions/{id}``) and mirror the spans it
        dropped; None when it cannot be read or the drops are not ours."""
        path = Routes.session.format(session=quote(episode.session, safe=""))
        try:
            data = await self.client.get(server_root(self.client.base_url) + path, cast_to=object)
            info = SessionInfo.model_validate(data)
        except (openai.APIError, ValidationError) as exc:
            logger.info("cannot read the session to mirror its drops: %s", exc)
            return None
        return episode.mirror(info)

    def _summarizer(self, model: object) -> Callable[[SummaryRequest], Awaitable[str]]:
        """See :meth:`LeylineOpenAI._summarizer <.middleware.LeylineOpenAI._summarizer>`."""
        done: dict[str, str] = {}

        async def summarize(request: SummaryRequest) -> str:
            options = summary_kwargs(model, request)
            key = canonical_json(options)
            if key not in done:
                done[key] = summary_text(await self.client.chat.completions.create(**options))
            return done[key]

        return summarize

    def _drop_skills(self, exc: openai.APIError, prepared: PreparedCall) -> None:
        """See :meth:`LeylineOpenAI._drop_skills <.middleware.LeylineOpenAI._drop_skills>`."""
        if self.skills is None:
            return
        for skill in failed_skills(exc, prepared.plan.directives):
            logger.info("skill %s cannot be composed here; its text goes instead", skill)
            self.skills.discard(skill)

    async def _send(
        self, prepared: PreparedCall, kwargs: dict[str, Any], extra: dict[str, object]
    ) -> Any:
        body = dict(extra)
        client = self.client
        if prepared.leyline is not None:
            body[LEYLINE_KEY] = prepared.leyline
            if prepared.plan.directives:
                client = client.with_options(max_retries=0)  # a 409 is ours to handle
        return await client.chat.completions.create(
            messages=[dict(m) for m in prepared.plan.messages],  # type: ignore[misc]
            extra_body=body or None,
            **kwargs,
        )

    async def _tokenize(
        self, messages: Sequence[Message], tools: list[object] | None
    ) -> TokenizeResponse:
        url = server_root(self.client.base_url) + Routes.tokenize
        try:
            data = await self.client.post(url, body=tokenize_body(messages, tools), cast_to=object)
            return TokenizeResponse.model_validate(data)
        except (openai.APIError, ValidationError) as exc:
            raise RenderUnavailable(str(exc)[:200]) from exc


class AsyncLeylineStream:
    """The chunks of a streamed call, as ``openai.AsyncStream`` yields them (``async for``,
    ``async with``, ``await close()``); see :class:`~.middleware.LeylineStream`."""

    def __init__(
        self,
        stream: Any,
        commit: Callable[[ChatCompletion | None], Awaitable[None]],
        *,
        reported: bool,
    ) -> None:
        self._stream = stream
        self._commit = commit
        self._reported = reported
        self._chunks = ChunkAccumulator()
        self._done = False
        self._iterator: AsyncIterator[ChatCompletionChunk] = stream.__aiter__()

    def __aiter__(self) -> AsyncIterator[ChatCompletionChunk]:
        return self

    async def __anext__(self) -> ChatCompletionChunk:
        try:
            chunk = await self._iterator.__anext__()
        except StopAsyncIteration:
            await self._finish(self._chunks.completion())
            raise
        except BaseException:
            await self._finish(None)
            raise
        self._chunks.add(chunk)
        if self._reported and self._chunks.has_report and self._chunks.usage is not None:
            await self._finish(self._chunks.completion())
        return chunk

    async def _finish(self, completion: ChatCompletion | None) -> None:
        if not self._done:
            self._done = True
            await self._commit(completion)

    async def close(self) -> None:
        await self._finish(None)
        await self._stream.close()

    async def __aenter__(self) -> AsyncLeylineStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or "_stream" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["_stream"], name)


class _AsyncCompletions:
    def __init__(self, owner: AsyncLeylineOpenAI) -> None:
        self._owner = owner

    async def create(self, *, messages: Iterable[object], **kwargs: Any) -> Any:
        """``await client.chat.completions.create(...)`` with the policy applied; with
        ``stream=True`` an :class:`AsyncLeylineStream`.

        Raises: as :meth:`LeylineOpenAI.chat.completions.create`.
        """
        return await self._owner._create(messages, kwargs)


class _AsyncChat:
    def __init__(self, owner: AsyncLeylineOpenAI) -> None:
        self.completions = _AsyncCompletions(owner)


def _raise_pinned(exc: BaseException, episode: Episode) -> None:
    """A ``pinned_span`` refusal is the caller's to resolve: raise it typed, change nothing."""
    error = pinned_error(exc, episode.session)
    if error is not None:
        raise error from exc
