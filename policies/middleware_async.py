"""``AsyncLeylineOpenAI``: the ``openai.AsyncOpenAI`` twin of :class:`~.middleware.LeylineOpenAI`.

Same episode logic (:class:`~.middleware_core.Episode`), awaited I/O. The planner is pure
and synchronous; it runs in a worker thread so that, when it needs the server's rendering
of the messages, the tokenize request runs on this event loop meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any
from urllib.parse import quote

import openai
from openai.types.chat import ChatCompletion
from pydantic import ValidationError

from leyline.protocol.resources import Routes, TokenizeResponse

from .counting import TokenCounter
from .messages import Message
from .middleware_core import CallRecord, Episode, PreparedCall, new_session_id
from .middleware_wire import (
    LEYLINE_KEY,
    RenderUnavailable,
    ServerSupport,
    composes,
    extra_body_of,
    failed_skills,
    normalize_messages,
    renderer,
    resync_reason,
    server_root,
    support_from_capabilities,
    support_from_status,
    tokenize_body,
)
from .planner import Pinned, TurnPlanner
from .registry import PolicyConfig
from .skills import SkillSet
from .translate import Addressing

logger = logging.getLogger("leyline.policies.middleware")

_RENDER_TIMEOUT_S = 120.0


class AsyncLeylineOpenAI:
    """Wraps an ``openai.AsyncOpenAI`` client for one agent episode.

    The arguments are those of :class:`~.middleware.LeylineOpenAI`;
    ``await client.chat.completions.create(...)``, ``await client.probe()``,
    ``await client.aclose()``.
    """

    def __init__(
        self,
        client: openai.AsyncOpenAI,
        policy: PolicyConfig | None = None,
        *,
        session: str | None = None,
        directives: bool = True,
        counter: TokenCounter | None = None,
        addressing: Addressing = "auto",
        pinned: Pinned | None = None,
        skills: SkillSet | None = None,
    ) -> None:
        self.client = client
        self.skills = skills
        planner = TurnPlanner(policy, counter=counter, addressing=addressing, pinned=pinned)
        self.episode = Episode(planner, session or new_session_id(), directives=directives)
        self.chat = _AsyncChat(self)
        self._support: ServerSupport | None = None
        self._warned = False
        self._lock = asyncio.Lock()

    @property
    def session(self) -> str:
        return self.episode.session

    @property
    def planner(self) -> TurnPlanner:
        return self.episode.planner

    @property
    def records(self) -> list[CallRecord]:
        return self.episode.records

    async def probe(self) -> ServerSupport:
        """See :meth:`LeylineOpenAI.probe <.middleware.LeylineOpenAI.probe>`."""
        if self._support is None:
            url = server_root(self.client.base_url) + Routes.capabilities
            try:
                support = support_from_capabilities(await self.client.get(url, cast_to=object))
            except openai.APIStatusError as exc:
                support = support_from_status(exc.status_code)
            self._support = support
            if not support.leyline and not self._warned:
                self._warned = True
                logger.warning(
                    "%s: %s; edits go as plain messages, which the server re-prefills",
                    self.client.base_url,
                    support.note,
                )
        return self._support

    async def aclose(self) -> None:
        """Free the session's cache on the server (best effort; the client stays open)."""
        if self._support is None or not self._support.leyline:
            return
        path = Routes.session.format(session=quote(self.session, safe=""))
        with contextlib.suppress(openai.APIError):
            await self.client.delete(server_root(self.client.base_url) + path, cast_to=object)

    async def __aenter__(self) -> AsyncLeylineOpenAI:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- one call ---------------------------------------------------------------------

    async def _create(self, messages: Iterable[object], kwargs: dict[str, Any]) -> ChatCompletion:
        agent = normalize_messages(messages)
        extra = extra_body_of(kwargs)
        async with self._lock:
            support = await self.probe()
            prepared = await self._prepare(agent, support, kwargs.get("tools"))
            t0 = time.perf_counter()
            resync = None
            try:
                completion = await self._send(prepared, kwargs, extra)
            except (openai.APIStatusError, openai.APIConnectionError) as exc:
                if prepared.leyline is None or not prepared.plan.directives:
                    raise
                resync = resync_reason(exc)
                logger.info("re-sending without directives (%s)", resync)
                self._drop_skills(exc, prepared)
                self.episode.drop()
                prepared = await self._prepare(agent, support, kwargs.get("tools"))
                completion = await self._send(prepared, kwargs, extra)
            self.episode.commit(prepared, completion, support, time.perf_counter() - t0, resync)
            return completion

    async def _prepare(
        self, agent: Sequence[Message], support: ServerSupport, tools: object
    ) -> PreparedCall:
        if not (support.leyline and self.episode.directives):
            self.planner.render = self.planner.skills = None
            return self.episode.prepare(agent, support)
        loop = asyncio.get_running_loop()

        def tokenize(messages: Sequence[Message], listed: list[object] | None) -> TokenizeResponse:
            future = asyncio.run_coroutine_threadsafe(self._tokenize(messages, listed), loop)
            return future.result(timeout=_RENDER_TIMEOUT_S)

        self.planner.render = renderer(tokenize, tools)
        self.planner.skills = composes(self.skills, support)
        try:
            return await asyncio.to_thread(self.episode.prepare, agent, support)
        except RenderUnavailable as exc:
            logger.info("planning without the server's rendering: %s", exc)
            self.planner.render = None
            return self.episode.prepare(agent, support)
        finally:
            self.planner.render = self.planner.skills = None

    def _drop_skills(self, exc: openai.APIError, prepared: PreparedCall) -> None:
        """See :meth:`LeylineOpenAI._drop_skills <.middleware.LeylineOpenAI._drop_skills>`."""
        if self.skills is None:
            return
        for skill in failed_skills(exc, prepared.plan.directives):
            logger.info("skill %s cannot be composed here; its text goes instead", skill)
            self.skills.discard(skill)

    async def _send(
        self, prepared: PreparedCall, kwargs: dict[str, Any], extra: dict[str, object]
    ) -> ChatCompletion:
        body = dict(extra)
        client = self.client
        if prepared.leyline is not None:
            body[LEYLINE_KEY] = prepared.leyline
            if prepared.plan.directives:
                client = client.with_options(max_retries=0)  # a 409 is ours to handle
        completion: ChatCompletion = await client.chat.completions.create(
            messages=[dict(m) for m in prepared.plan.messages],  # type: ignore[misc]
            extra_body=body or None,
            **kwargs,
        )
        return completion

    async def _tokenize(
        self, messages: Sequence[Message], tools: list[object] | None
    ) -> TokenizeResponse:
        url = server_root(self.client.base_url) + Routes.tokenize
        try:
            data = await self.client.post(url, body=tokenize_body(messages, tools), cast_to=object)
            return TokenizeResponse.model_validate(data)
        except (openai.APIError, ValidationError) as exc:
            raise RenderUnavailable(str(exc)[:200]) from exc


class _AsyncCompletions:
    def __init__(self, owner: AsyncLeylineOpenAI) -> None:
        self._owner = owner

    async def create(self, *, messages: Iterable[object], **kwargs: Any) -> ChatCompletion:
        """``await client.chat.completions.create(...)`` with the policy applied; not streamed.

        Raises: as :meth:`LeylineOpenAI.chat.completions.create`.
        """
        return await self._owner._create(messages, kwargs)


class _AsyncChat:
    def __init__(self, owner: AsyncLeylineOpenAI) -> None:
        self.completions = _AsyncCompletions(owner)
