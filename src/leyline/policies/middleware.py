"""``LeylineOpenAI``: an ``openai.OpenAI`` client whose context edits become cache directives.

::

    client = LeylineOpenAI(openai.OpenAI(base_url=..., api_key=...), "truncate:keep_last=2")
    completion = client.chat.completions.create(model=..., messages=agent_messages, tools=...)
    client.records[-1].path  # "splice": the server kept the downstream KV

One conversation is one agent episode (one Leyline session); a call that starts another
conversation gets another session (:class:`~.middleware_core.Conversations`). Before each
call the policy runs on the agent's messages (through :class:`~.planner.TurnPlanner`); its
edits, and the agent's own rewrites of its list (diff mode), go as directives addressed
with the spans the server reported last call. Against a server without Leyline the edited
messages go out plainly (the server re-prefills) and the wrapper says so once. A request
with directives that fails is re-sent once as plain messages in the session, so the
episode goes on. ``stream=True`` streams, directives included.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any
from urllib.parse import quote

import openai
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import ValidationError

from leyline.protocol.resources import Routes, SessionInfo, TokenizeResponse

from .base import Summarizer, SummaryRequest
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


class LeylineOpenAI(WrapperBase[openai.OpenAI]):
    """Wraps an ``openai.OpenAI`` client; a drop-in for it (see :mod:`.middleware_base`).

    Args:
        client: the OpenAI client (its base URL, key, timeouts and retries are used as is).
        policy: a policy or its config (``"stale | truncate:keep_last=2"``); None: only the
            agent's own edits (diff mode).
        session: the Leyline session id of the first conversation (default: a fresh one).
        directives: False sends the edited messages without directives, even to a Leyline
            server: it then re-prefills from the first change (a baseline to compare with).
        counter, addressing, pinned: passed to :class:`~.planner.TurnPlanner`.
        skills: a :class:`~.skills.SkillLibrary`: new messages made with
            ``skills.message(name)`` are composed (their KV inserted precomputed) where the
            server executes ``compose``, and sent as text elsewhere.
        detect_conversations: a call whose messages do not carry on an earlier conversation
            (another system prompt or task) opens a new session; False: one session for all.
        max_conversations: conversations kept (least recently used ones are closed).
    """

    @staticmethod
    def _new_lock() -> Any:
        return threading.Lock()

    def _make_chat(self) -> Any:
        return _Chat(self)

    def probe(self) -> ServerSupport:
        """Ask ``GET /leyline/v1/capabilities`` once; any error status means no Leyline.

        Raises:
            openai.APIConnectionError: the server does not answer (asked again next call).
        """
        state = self._state
        if state.support is None:
            url = server_root(self.client.base_url) + Routes.capabilities
            try:
                support = support_from_capabilities(self.client.get(url, cast_to=object))
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

    def close(self) -> None:
        """Free the sessions' caches on the server (best effort; the client stays open)."""
        self._close_sessions(list(self.conversations.episodes))

    def _close_sessions(self, episodes: Sequence[Episode]) -> None:
        support = self._state.support
        if support is None or not support.leyline:
            return
        for episode in episodes:
            path = Routes.session.format(session=quote(episode.session, safe=""))
            with contextlib.suppress(openai.APIError):
                self.client.delete(server_root(self.client.base_url) + path, cast_to=object)

    def __enter__(self) -> LeylineOpenAI:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one call ---------------------------------------------------------------------

    def _create(
        self, messages: Iterable[object], kwargs: dict[str, Any]
    ) -> ChatCompletion | LeylineStream:
        agent = normalize_messages(messages)
        extra = extra_body_of(kwargs)
        streamed = bool(kwargs.get("stream"))
        with self._state.lock:
            support = self.probe()
            episode, evicted, new = self.conversations.route(agent)
            self._close_sessions(evicted)
            if episode.pending is not None:  # a stream left unread: the cache is unknown
                episode.pending = None
                episode.drop()
            if streamed and support.leyline and episode.directives:
                kwargs = with_stream_usage(kwargs)
            summarizer = self._summarizer(kwargs.get("model"))
            prepared = self._prepare(episode, agent, support, kwargs.get("tools"), summarizer)
            t0 = time.perf_counter()
            resync = None
            dropped: tuple[Dropped, ...] = ()
            try:
                response = self._send(prepared, kwargs, extra)
            except (openai.APIStatusError, openai.APIConnectionError) as exc:
                _raise_pinned(exc, episode)
                plan = prepared.plan
                if prepared.leyline is None or not (plan.directives or plan.check_revision):
                    raise  # nothing of ours in it: the planner is as it was
                response = None
                if is_revision_conflict(exc) and episode.planner.decaying:
                    # The server dropped decay spans: mirror them, send the call again.
                    dropped = self._mirror(episode) or ()
                    if dropped:
                        prepared = self._prepare(
                            episode, agent, support, kwargs.get("tools"), summarizer
                        )
                        try:
                            response = self._send(prepared, kwargs, extra)
                        except (openai.APIStatusError, openai.APIConnectionError) as again:
                            _raise_pinned(again, episode)
                            exc = again
                if response is None:
                    resync = resync_reason(exc)
                    logger.info("re-sending without directives (%s)", resync)
                    self._drop_skills(exc, prepared)
                    episode.drop()
                    prepared = self._prepare(
                        episode, agent, support, kwargs.get("tools"), summarizer
                    )
                    try:
                        response = self._send(prepared, kwargs, extra)
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

            def commit(completion: ChatCompletion | None) -> None:
                with self._state.lock:
                    if episode.pending is not stream:
                        return  # a later call already gave up on this stream
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

            stream = LeylineStream(response, commit, reported=prepared.leyline is not None)
            episode.pending = stream
            return stream

    def _prepare(
        self,
        episode: Episode,
        agent: Sequence[Message],
        support: ServerSupport,
        tools: object,
        summarizer: Summarizer,
    ) -> PreparedCall:
        planner = episode.planner
        renders = support.leyline and episode.directives
        planner.render = renderer(self._tokenize, tools) if renders else None
        planner.skills = composes(self.skills, support) if renders else None
        planner.summarizer = summarizer
        planner.retention = renders and support.retention
        try:
            return episode.prepare(agent, support)
        except RenderUnavailable as exc:
            logger.info("planning without the server's rendering: %s", exc)
            planner.render = None
            return episode.prepare(agent, support)
        finally:
            planner.render = planner.skills = planner.summarizer = None

    def _mirror(self, episode: Episode) -> tuple[Dropped, ...] | None:
        """Read the session (``GET /leyline/v1/sessions/{id}``) and mirror the spans it
        dropped; None when it cannot be read or the drops are not ours."""
        path = Routes.session.format(session=quote(episode.session, safe=""))
        try:
            data = self.client.get(server_root(self.client.base_url) + path, cast_to=object)
            info = SessionInfo.model_validate(data)
        except (openai.APIError, ValidationError) as exc:
            logger.info("cannot read the session to mirror its drops: %s", exc)
            return None
        return episode.mirror(info)

    def _summarizer(self, model: object) -> Summarizer:
        """Summaries (:class:`~.summarize.Summarize`) as plain chat completions of the same
        model, outside any session; one per request within a call (a re-send reuses it)."""
        done: dict[str, str] = {}

        def summarize(request: SummaryRequest) -> str:
            options = summary_kwargs(model, request)
            key = canonical_json(options)
            if key not in done:
                done[key] = summary_text(self.client.chat.completions.create(**options))
            return done[key]

        return summarize

    def _drop_skills(self, exc: openai.APIError, prepared: PreparedCall) -> None:
        """A compose the server refused (skill gone or bound elsewhere) is not tried again."""
        if self.skills is None:
            return
        for skill in failed_skills(exc, prepared.plan.directives):
            logger.info("skill %s cannot be composed here; its text goes instead", skill)
            self.skills.discard(skill)

    def _send(
        self, prepared: PreparedCall, kwargs: dict[str, Any], extra: dict[str, object]
    ) -> Any:
        body = dict(extra)
        client = self.client
        if prepared.leyline is not None:
            body[LEYLINE_KEY] = prepared.leyline
            if prepared.plan.directives:
                client = client.with_options(max_retries=0)  # a 409 is ours to handle
        return client.chat.completions.create(
            messages=[dict(m) for m in prepared.plan.messages],  # type: ignore[misc]
            extra_body=body or None,
            **kwargs,
        )

    def _tokenize(
        self, messages: Sequence[Message], tools: list[object] | None
    ) -> TokenizeResponse:
        url = server_root(self.client.base_url) + Routes.tokenize
        try:
            data = self.client.post(url, body=tokenize_body(messages, tools), cast_to=object)
            return TokenizeResponse.model_validate(data)
        except (openai.APIError, ValidationError) as exc:
            raise RenderUnavailable(str(exc)[:200]) from exc


class LeylineStream:
    """The chunks of a streamed call, as ``openai.Stream`` yields them.

    The episode is committed when the server's report arrives (with the final chunk on a
    Leyline server) or when the stream ends; closing it before that drops what the wrapper
    knows of the session's cache (the next call re-sends plain messages in the session).
    Other attributes (``response``, ...) are the wrapped stream's.
    """

    def __init__(
        self,
        stream: Any,
        commit: Callable[[ChatCompletion | None], None],
        *,
        reported: bool,
    ) -> None:
        self._stream = stream
        self._commit = commit
        self._reported = reported
        self._chunks = ChunkAccumulator()
        self._done = False
        self._iterator: Iterator[ChatCompletionChunk] = iter(stream)

    def __iter__(self) -> Iterator[ChatCompletionChunk]:
        return self

    def __next__(self) -> ChatCompletionChunk:
        try:
            chunk = next(self._iterator)
        except StopIteration:
            self._finish(self._chunks.completion())
            raise
        except Exception:
            self._finish(None)
            raise
        self._chunks.add(chunk)
        if self._reported and self._chunks.has_report and self._chunks.usage is not None:
            self._finish(self._chunks.completion())
        return chunk

    def _finish(self, completion: ChatCompletion | None) -> None:
        if not self._done:
            self._done = True
            self._commit(completion)

    def close(self) -> None:
        self._finish(None)
        self._stream.close()

    def __enter__(self) -> LeylineStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or "_stream" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["_stream"], name)


class _Completions:
    def __init__(self, owner: LeylineOpenAI) -> None:
        self._owner = owner

    def create(self, *, messages: Iterable[object], **kwargs: Any) -> Any:
        """``client.chat.completions.create`` with the policy applied.

        Returns a ``ChatCompletion``, or with ``stream=True`` a :class:`LeylineStream` of
        ``ChatCompletionChunk`` (directives included).

        Raises:
            ValueError: ``extra_body`` already carries ``leyline``.
            TranscriptError, PolicyEditError: the messages or the policy are at fault.
            openai.APIError: what the OpenAI client raises (the episode is left as it was).
        """
        return self._owner._create(messages, kwargs)


class _Chat:
    def __init__(self, owner: LeylineOpenAI) -> None:
        self.completions = _Completions(owner)


def _raise_pinned(exc: BaseException, episode: Episode) -> None:
    """A ``pinned_span`` refusal is the caller's to resolve: raise it typed, change nothing."""
    error = pinned_error(exc, episode.session)
    if error is not None:
        raise error from exc
