"""What :class:`~.middleware.LeylineOpenAI` and :class:`~.middleware_async.AsyncLeylineOpenAI`
share: their state, every decision of a call as a sans-IO flow (:mod:`.flows`), and what
makes them drop-ins for the client they wrap. The two shells only make the requests.

* the client's attributes (``base_url``, ``api_key``, ``organization``, ``project``,
  ``timeout``, ``max_retries``) and every other resource (``models``, ``embeddings``,
  ``responses``, ...) are the wrapped client's; only ``chat.completions.create`` is Leyline's;
* ``with_options(...)`` / ``copy(...)`` wrap the client's copy and keep the conversations
  (same policy, same sessions, same records): a framework's retry with other options goes
  on with the episode instead of bypassing it. A copy for another ``base_url`` is another
  server: it starts its own conversations, with the same settings.

Every request of a session carries its id as the routing key (``X-SMG-Routing-Key``); in
routed mode each Leyline request goes as an envelope (:mod:`.middleware_routed`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Literal, Self, TypeVar

import openai
from openai.types.chat import ChatCompletion
from pydantic import ValidationError

from leyline.protocol.resources import Routes, SessionInfo, SkillInfo, TokenizeResponse
from leyline.protocol.routing import DEFAULT_MODEL

from .base import SummaryRequest
from .counting import TokenCounter
from .flows import Flow
from .messages import Message, canonical_json
from .middleware_call import OpenCall, raise_pinned, session_path
from .middleware_core import CallRecord, Conversations, Episode, PreparedCall
from .middleware_dropin import ClientDropIn
from .middleware_routed import routed, unreachable
from .middleware_wire import (
    LEYLINE_KEY,
    Completion,
    Plan,
    RenderUnavailable,
    Route,
    ServerSupport,
    StreamBase,
    composes,
    extra_body_of,
    failed_skills,
    is_revision_conflict,
    is_unknown_session,
    is_unknown_skill,
    normalize_messages,
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
from .planner import Pinned, TurnPlanner
from .registry import PolicyConfig, parse_policy
from .retention_marks import Dropped
from .skills import SkillSet
from .translate import Addressing

logger = logging.getLogger("leyline.policies.middleware")

C = TypeVar("C", openai.OpenAI, openai.AsyncOpenAI)


@dataclass
class WrapperState:
    """One wrapper's state, shared with its ``with_options`` copies."""

    conversations: Conversations
    skills: SkillSet | None
    lock: Any
    """``threading.Lock`` or ``asyncio.Lock``: one call at a time plans and commits."""
    routed: bool = False
    """Leyline requests go as envelopes over ``/v1/completions`` (behind a router)."""
    unreachable_s: float = 30.0
    """Routed mode: how long a request whose worker cannot be reached is re-sent."""
    support: ServerSupport | None = None
    warned: bool = False
    model: str | None = None
    """The model of the last call (an envelope's outer ``model`` outside a call)."""

    def fresh(self, lock: Any) -> WrapperState:
        """The same settings, nothing of the conversations (for another server)."""
        old = self.conversations
        conversations = Conversations(
            old.make_planner, None, directives=old.directives, detect=old.detect, limit=old.limit
        )
        return WrapperState(
            conversations, self.skills, lock, routed=self.routed, unreachable_s=self.unreachable_s
        )


class WrapperBase(ClientDropIn, Generic[C]):
    """A wrapper around an OpenAI client ``C``: its state, its drop-in attributes, and each
    call as flows (:mod:`.flows`) whose requests the sync or async shell makes."""

    client: C
    _state: WrapperState

    def __init__(
        self,
        client: C,
        policy: PolicyConfig | None = None,
        *,
        session: str | None = None,
        directives: bool = True,
        counter: TokenCounter | None = None,
        addressing: Addressing = "auto",
        pinned: Pinned | None = None,
        skills: SkillSet | None = None,
        detect_conversations: bool = True,
        max_conversations: int = 8,
        routed: bool = False,
        unreachable_s: float = 30.0,
    ) -> None:
        if unreachable_s < 0:
            raise ValueError("unreachable_s must not be negative")
        parsed = parse_policy(policy) if policy is not None else None  # errors now, not later

        def make_planner() -> TurnPlanner:
            return TurnPlanner(parsed, counter=counter, addressing=addressing, pinned=pinned)

        conversations = Conversations(
            make_planner,
            session,
            directives=directives,
            detect=detect_conversations,
            limit=max_conversations,
        )
        state = WrapperState(
            conversations, skills, self._new_lock(), routed=routed, unreachable_s=unreachable_s
        )
        self._bind(client, state)

    def _bind(self, client: C, state: WrapperState) -> None:
        self.client = client
        self._state = state
        self.chat = Chat(self._completions_type(self))

    # -- what a shell provides -----------------------------------------------------

    _lock_type: ClassVar[type[Any]]
    _completions_type: ClassVar[type]
    """``chat.completions``: its ``create`` runs :meth:`_call` (sync or awaited)."""
    _stream_type: ClassVar[type[StreamBase]]
    """Calls may send pins and marks where the server executes them (the sync wrapper
    does; the async one never has)."""

    def _new_lock(self) -> Any:
        """One call at a time plans and commits: a ``threading.Lock`` or an ``asyncio.Lock``."""
        return self._lock_type()

    def _locked(self, commit: Callable[[ChatCompletion | None], None]) -> Callable[..., Any]:
        """``commit`` made under the state's lock (a stream's commit, sync or awaited)."""
        raise NotImplementedError

    # -- the episode ------------------------------------------------------------------

    @property
    def conversations(self) -> Conversations:
        return self._state.conversations

    @property
    def episode(self) -> Episode:
        """The episode of the current (last used) conversation."""
        return self._state.conversations.current

    @property
    def session(self) -> str:
        """The Leyline session of the current conversation."""
        return self.episode.session

    @property
    def planner(self) -> TurnPlanner:
        return self.episode.planner

    @property
    def records(self) -> list[CallRecord]:
        """One record per completed call, in order (every conversation's)."""
        return self._state.conversations.records

    @property
    def skills(self) -> SkillSet | None:
        return self._state.skills

    @property
    def routed(self) -> bool:
        """Leyline requests go as envelopes over ``/v1/completions`` (behind a router)."""
        return self._state.routed

    # -- a drop-in for the wrapped client (the rest: ClientDropIn) ----------------------

    def copy(self, **options: Any) -> Self:
        """A wrapper of ``client.copy(**options)`` that keeps this one's conversations
        (unless ``base_url`` changes: another server, new conversations)."""
        client = self.client.copy(**options)
        state = self._state
        if str(client.base_url) != str(self.client.base_url):
            state = state.fresh(self._new_lock())
        twin = object.__new__(type(self))
        twin._bind(client, state)
        return twin

    with_options = copy

    # -- one call, sans IO: the flows the shells run ------------------------------------

    def _call(self, messages: Iterable[object], kwargs: dict[str, Any]) -> Flow[Any]:
        """The flow of ``chat.completions.create``; the arguments are checked now."""
        agent = normalize_messages(messages)
        return self._calling(agent, extra_body_of(kwargs), kwargs)

    def _calling(
        self, agent: list[Message], extra: dict[str, object], kwargs: dict[str, Any]
    ) -> Flow[Any]:
        streamed = bool(kwargs.get("stream"))
        if isinstance(kwargs.get("model"), str):
            self._state.model = kwargs["model"]
        support = yield from self._probe()
        episode, evicted, new = self.conversations.route(agent)
        yield from self._close_sessions(evicted)
        if episode.pending is not None:  # a stream left unread: the cache is unknown
            episode.pending = None
            episode.drop()
        if streamed and support.leyline and episode.directives:
            kwargs = with_stream_usage(kwargs)
        call = OpenCall(episode, agent, support, kwargs.get("tools"), new)
        summaries = self._summaries(kwargs.get("model"))
        prepared = yield self._plan(call, summaries)
        call.t0 = time.perf_counter()
        try:
            response = yield from self._send(self._completion(prepared, kwargs, extra))
        except (openai.APIStatusError, openai.APIConnectionError) as exc:
            raise_pinned(exc, episode)
            if self._state.routed and unreachable(exc):
                raise  # its worker stayed out of reach for unreachable_s: nothing changed
            plan = prepared.plan
            ours = plan.directives or plan.check_revision or is_unknown_session(exc)
            if prepared.leyline is None or not ours:
                raise  # nothing of ours in it: the planner is as it was
            response = None
            if is_revision_conflict(exc) and episode.planner.decaying:
                # The server dropped decay spans: mirror them, send the call again.
                call.dropped = (yield from self._mirror(episode)) or ()
                if call.dropped:
                    prepared = yield self._plan(call, summaries)
                    try:
                        response = yield from self._send(self._completion(prepared, kwargs, extra))
                    except (openai.APIStatusError, openai.APIConnectionError) as again:
                        raise_pinned(again, episode)
                        exc = again
            if response is None:
                if is_unknown_session(exc):
                    # Lost (its worker died, the server restarted): a new session, which
                    # a router binds anew, prefilled from the messages.
                    call.resync, call.lost_session = "session_lost", episode.renew()
                    logger.info(
                        "session %s lost; re-sending as plain messages in session %s",
                        call.lost_session,
                        episode.session,
                    )
                else:
                    call.resync = resync_reason(exc)
                    logger.info("re-sending without directives (%s)", call.resync)
                    call.reregistered = yield from self._skills_refused(
                        exc, prepared, episode.session
                    )
                    episode.drop()
                prepared = yield self._plan(call, summaries)
                try:
                    response = yield from self._send(self._completion(prepared, kwargs, extra))
                except openai.APIStatusError as final:
                    raise_pinned(final, episode)
                    raise
        call.prepared = prepared
        if isinstance(response, ChatCompletion):
            call.commit(response)
            return response
        return self._open_stream(response, call)

    def _open_stream(self, response: Any, call: OpenCall) -> StreamBase:
        """Wrap a streamed answer; the episode is committed when the stream says so."""
        stream: StreamBase

        def commit(completion: ChatCompletion | None) -> None:
            if call.episode.pending is not stream:
                return  # a later call already gave up on this stream
            call.episode.pending = None
            if completion is None:
                call.episode.drop()
            else:
                call.commit(completion, streamed=True)

        reported = call.prepared is not None and call.prepared.leyline is not None
        stream = self._stream_type(response, self._locked(commit), reported=reported)
        call.episode.pending = stream
        return stream

    def _probe(self) -> Flow[ServerSupport]:
        state = self._state
        if state.support is None:
            try:
                route = self._route("get", Routes.capabilities)
                support = support_from_capabilities((yield from self._send(route)))
            except openai.APIStatusError as exc:
                support = support_from_status(exc.status_code, routed=state.routed)
            state.support = support
            if not support.leyline and not state.warned:
                state.warned = True
                logger.warning(
                    "%s: %s; edits go as plain messages, which the server re-prefills",
                    self.client.base_url,
                    support.note,
                )
        return state.support

    def _close_sessions(self, episodes: Sequence[Episode]) -> Flow[None]:
        support = self._state.support
        if support is None or not support.leyline:
            return
        for episode in episodes:
            with contextlib.suppress(openai.APIError, ValueError):  # an answer not JSON
                route = self._route("delete", session_path(episode), key=episode.session)
                yield from self._send(route, wait=False)  # best effort: no waiting

    def _plan(self, call: OpenCall, summaries: Callable[[SummaryRequest], Flow[str]]) -> Plan:
        """Planning as blocking work whose requests (the server's rendering, summaries) are
        flows it runs with the ``run`` the shell gives it."""

        def work(run: Callable[[Flow[Any]], Any]) -> PreparedCall:
            episode, support = call.episode, call.support
            planner = episode.planner

            def tokenize(messages: Sequence[Message], tools: list[object] | None) -> Any:
                return run(self._tokenize(messages, tools, episode.session))

            renders = support.leyline and episode.directives
            planner.render = renderer(tokenize, call.tools) if renders else None
            planner.skills = composes(self.skills, support) if renders else None
            planner.summarizer = lambda request: run(summaries(request))
            planner.retention = renders and support.retention
            try:
                return episode.prepare(call.agent, support)
            except RenderUnavailable as exc:
                logger.info("planning without the server's rendering: %s", exc)
                planner.render = None
                return episode.prepare(call.agent, support)
            finally:
                planner.render = planner.skills = planner.summarizer = None

        return Plan(work)

    def _mirror(self, episode: Episode) -> Flow[tuple[Dropped, ...] | None]:
        """Read the session (``GET /leyline/v1/sessions/{id}``) and mirror the spans it
        dropped; None when it cannot be read or the drops are not ours."""
        try:
            route = self._route("get", session_path(episode), key=episode.session)
            data = yield from self._send(route)
            info = SessionInfo.model_validate(data)
        except (openai.APIError, ValidationError) as exc:
            logger.info("cannot read the session to mirror its drops: %s", exc)
            return None
        return episode.mirror(info)

    def _summaries(self, model: object) -> Callable[[SummaryRequest], Flow[str]]:
        """Summaries (:class:`~.summarize.Summarize`) as plain chat completions of the same
        model, outside any session; one per request within a call (a re-send reuses it)."""
        done: dict[str, str] = {}

        def summarize(request: SummaryRequest) -> Flow[str]:
            options = summary_kwargs(model, request)
            key = canonical_json(options)
            if key not in done:
                done[key] = summary_text((yield from self._send(Completion(options))))
            return done[key]

        return summarize

    def _skills_refused(
        self, exc: openai.APIError, prepared: PreparedCall, session: str
    ) -> Flow[tuple[str, ...]]:
        """A compose the server refused (skill gone or bound elsewhere) is not tried again;
        except in routed mode, where a skill the session's worker does not have
        (``unknown_skill``) is registered there again, with the session's routing key.
        Returns the skills registered again (their text goes this call, either way)."""
        skills = self.skills
        if skills is None:
            return ()
        again: list[str] = []
        register = self._state.routed and is_unknown_skill(exc)
        for skill in failed_skills(exc, prepared.plan.directives):
            if register and (yield from self._register_again(skills, skill, session)):
                logger.info("skill %s registered again for session %s", skill, session)
                again.append(skill)
                continue
            logger.info("skill %s cannot be composed here; its text goes instead", skill)
            skills.discard(skill)
        return tuple(again)

    def _register_again(self, skills: SkillSet, skill: str, session: str) -> Flow[bool]:
        """``POST /leyline/v1/skills`` with the skill's remembered block (the same content:
        the same id), with ``session`` as the routing key, so it lands on that session's
        worker; whether the server now holds it."""
        body = skills.creation(skill)
        if body is None:
            return False
        data = body.model_dump(mode="json", exclude_none=True)
        try:
            answer = yield from self._send(self._route("post", Routes.skills, data, session))
            info = SkillInfo.model_validate(answer)
        except (openai.APIError, ValidationError, ValueError) as exc:
            logger.info("skill %s could not be registered again: %s", skill, exc)
            return False
        return skills.registered_again(skill, info, session)

    @staticmethod
    def _completion(
        prepared: PreparedCall, kwargs: dict[str, Any], extra: dict[str, object]
    ) -> Completion:
        body = dict(extra)
        retries, key = True, None
        if prepared.leyline is not None:
            body[LEYLINE_KEY] = prepared.leyline
            retries = not prepared.plan.directives  # a 409 is ours to handle
            session = prepared.leyline.get("session")
            key = session if isinstance(session, str) else None
        messages = [dict(m) for m in prepared.plan.messages]
        options = {"messages": messages, "extra_body": body or None, **kwargs}
        return Completion(options, retries, key)

    def _tokenize(
        self, messages: Sequence[Message], tools: list[object] | None, session: str
    ) -> Flow[TokenizeResponse]:
        """The server's rendering of ``messages`` for the conversation of ``session`` (the
        routing key: with a router, the worker that holds it renders)."""
        try:
            route = self._route("post", Routes.tokenize, tokenize_body(messages, tools), session)
            data = yield from self._send(route)
            return TokenizeResponse.model_validate(data)
        except (openai.APIError, ValidationError) as exc:
            raise RenderUnavailable(str(exc)[:200]) from exc

    def _route(
        self,
        method: Literal["get", "post", "delete"],
        path: str,
        body: object = None,
        key: str | None = None,
    ) -> Route:
        return Route(method, server_root(self.client.base_url), path, body, key)

    def _send(self, request: Route | Completion, *, wait: bool = True) -> Flow[Any]:
        """Make ``request``: as it is, or in routed mode as an envelope, waiting out a
        worker the router cannot reach yet (:func:`.middleware_routed.routed`)."""
        state = self._state
        if not state.routed:
            return (yield request)
        model = state.model or DEFAULT_MODEL
        unreachable_s = state.unreachable_s if wait else 0.0
        return (yield from routed(request, model, unreachable_s))


class Chat:
    """``client.chat``: its ``completions`` are the wrapper's."""

    def __init__(self, completions: Any) -> None:
        self.completions = completions
