"""``LeylineOpenAI``: an ``openai.OpenAI`` client whose context edits become cache directives.

::

    client = LeylineOpenAI(openai.OpenAI(base_url=..., api_key=...), "truncate:keep_last=2")
    completion = client.chat.completions.create(model=..., messages=agent_messages, tools=...)
    client.records[-1].path  # "splice": the server kept the downstream KV

One instance is one agent episode (one Leyline session). Before each call the policy runs
on the agent's messages (through :class:`~.planner.TurnPlanner`); its edits, and the
agent's own rewrites of its list (diff mode), go as directives addressed with the spans
the server reported last call. Against a server without Leyline the edited messages go out
plainly (the server re-prefills) and the wrapper says so once. A request with directives
that fails is re-sent once as plain messages in the session, so the episode goes on.
"""

from __future__ import annotations

import contextlib
import logging
import threading
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


class LeylineOpenAI:
    """Wraps an ``openai.OpenAI`` client for one agent episode.

    Args:
        client: the OpenAI client (its base URL, key, timeouts and retries are used as is).
        policy: a policy or its config (``"stale | truncate:keep_last=2"``); None: only the
            agent's own edits (diff mode).
        session: the Leyline session id (default: a fresh random one).
        directives: False sends the edited messages without directives, even to a Leyline
            server: it then re-prefills from the first change (a baseline to compare with).
        counter, addressing, pinned: passed to :class:`~.planner.TurnPlanner`.
        skills: a :class:`~.skills.SkillLibrary`: new messages made with
            ``skills.message(name)`` are composed (their KV inserted precomputed) where the
            server executes ``compose``, and sent as text elsewhere.
    """

    def __init__(
        self,
        client: openai.OpenAI,
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
        self.chat = _Chat(self)
        self._support: ServerSupport | None = None
        self._warned = False
        self._lock = threading.Lock()

    @property
    def session(self) -> str:
        return self.episode.session

    @property
    def planner(self) -> TurnPlanner:
        return self.episode.planner

    @property
    def records(self) -> list[CallRecord]:
        """One record per completed call, in order."""
        return self.episode.records

    def probe(self) -> ServerSupport:
        """Ask ``GET /leyline/v1/capabilities`` once; any error status means no Leyline.

        Raises:
            openai.APIConnectionError: the server does not answer (asked again next call).
        """
        if self._support is None:
            url = server_root(self.client.base_url) + Routes.capabilities
            try:
                support = support_from_capabilities(self.client.get(url, cast_to=object))
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

    def close(self) -> None:
        """Free the session's cache on the server (best effort; the client stays open)."""
        if self._support is None or not self._support.leyline:
            return
        path = Routes.session.format(session=quote(self.session, safe=""))
        with contextlib.suppress(openai.APIError):
            self.client.delete(server_root(self.client.base_url) + path, cast_to=object)

    def __enter__(self) -> LeylineOpenAI:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one call ---------------------------------------------------------------------

    def _create(self, messages: Iterable[object], kwargs: dict[str, Any]) -> ChatCompletion:
        agent = normalize_messages(messages)
        extra = extra_body_of(kwargs)
        with self._lock:
            support = self.probe()
            prepared = self._prepare(agent, support, kwargs.get("tools"))
            t0 = time.perf_counter()
            resync = None
            try:
                completion = self._send(prepared, kwargs, extra)
            except (openai.APIStatusError, openai.APIConnectionError) as exc:
                if prepared.leyline is None or not prepared.plan.directives:
                    raise  # nothing of ours in it: the planner is as it was
                resync = resync_reason(exc)
                logger.info("re-sending without directives (%s)", resync)
                self._drop_skills(exc, prepared)
                self.episode.drop()
                prepared = self._prepare(agent, support, kwargs.get("tools"))
                completion = self._send(prepared, kwargs, extra)
            self.episode.commit(prepared, completion, support, time.perf_counter() - t0, resync)
            return completion

    def _prepare(
        self, agent: Sequence[Message], support: ServerSupport, tools: object
    ) -> PreparedCall:
        renders = support.leyline and self.episode.directives
        self.planner.render = renderer(self._tokenize, tools) if renders else None
        self.planner.skills = composes(self.skills, support) if renders else None
        try:
            return self.episode.prepare(agent, support)
        except RenderUnavailable as exc:
            logger.info("planning without the server's rendering: %s", exc)
            self.planner.render = None
            return self.episode.prepare(agent, support)
        finally:
            self.planner.render = self.planner.skills = None

    def _drop_skills(self, exc: openai.APIError, prepared: PreparedCall) -> None:
        """A compose the server refused (skill gone or bound elsewhere) is not tried again."""
        if self.skills is None:
            return
        for skill in failed_skills(exc, prepared.plan.directives):
            logger.info("skill %s cannot be composed here; its text goes instead", skill)
            self.skills.discard(skill)

    def _send(
        self, prepared: PreparedCall, kwargs: dict[str, Any], extra: dict[str, object]
    ) -> ChatCompletion:
        body = dict(extra)
        client = self.client
        if prepared.leyline is not None:
            body[LEYLINE_KEY] = prepared.leyline
            if prepared.plan.directives:
                client = client.with_options(max_retries=0)  # a 409 is ours to handle
        completion: ChatCompletion = client.chat.completions.create(
            messages=[dict(m) for m in prepared.plan.messages],  # type: ignore[misc]
            extra_body=body or None,
            **kwargs,
        )
        return completion

    def _tokenize(
        self, messages: Sequence[Message], tools: list[object] | None
    ) -> TokenizeResponse:
        url = server_root(self.client.base_url) + Routes.tokenize
        try:
            data = self.client.post(url, body=tokenize_body(messages, tools), cast_to=object)
            return TokenizeResponse.model_validate(data)
        except (openai.APIError, ValidationError) as exc:
            raise RenderUnavailable(str(exc)[:200]) from exc


class _Completions:
    def __init__(self, owner: LeylineOpenAI) -> None:
        self._owner = owner

    def create(self, *, messages: Iterable[object], **kwargs: Any) -> ChatCompletion:
        """``client.chat.completions.create`` with the policy applied; not streamed.

        Raises:
            ValueError: ``stream=True``, or ``extra_body`` already carries ``leyline``.
            TranscriptError, PolicyEditError: the messages or the policy are at fault.
            openai.APIError: what the OpenAI client raises (the episode is left as it was).
        """
        return self._owner._create(messages, kwargs)


class _Chat:
    def __init__(self, owner: LeylineOpenAI) -> None:
        self.completions = _Completions(owner)
