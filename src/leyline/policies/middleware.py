"""``LeylineOpenAI``: an ``openai.OpenAI`` client whose context edits become cache directives.

::

    client = LeylineOpenAI(openai.OpenAI(base_url=..., api_key=...), "truncate:keep_last=2")
    completion = client.chat.completions.create(model=..., messages=agent_messages, tools=...)
    client.records[-1].path  # "splice": the server kept the downstream KV

The sync shell: every decision is in :class:`~.middleware_base.WrapperBase` (a sans-IO
flow); this module makes its requests. What the wrapper does is in docs/middleware.md.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import openai
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from .flows import Flow, run
from .middleware_base import WrapperBase
from .middleware_routed import Wait
from .middleware_wire import Plan, ServerSupport, StreamBase

T = TypeVar("T")


class LeylineStream(StreamBase):
    """The chunks of a streamed call, as ``openai.Stream`` yields them.

    The episode is committed when the server's report arrives (with the final chunk on a
    Leyline server) or when the stream ends; closing it before that drops what the wrapper
    knows of the session's cache (the next call re-sends plain messages in the session).
    Other attributes (``response``, ...) are the wrapped stream's.
    """

    @staticmethod
    def _iterate(stream: Any) -> Iterator[ChatCompletionChunk]:
        return iter(stream)

    def __iter__(self) -> Iterator[ChatCompletionChunk]:
        return self

    def __next__(self) -> ChatCompletionChunk:
        try:
            chunk: ChatCompletionChunk = next(self._iterator)
        except BaseException as error:
            self._ended(error)
            raise
        self._received(chunk)
        return chunk

    def close(self) -> None:
        self._settle(None)
        self._stream.close()

    def __enter__(self) -> LeylineStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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


class LeylineOpenAI(WrapperBase[openai.OpenAI]):
    """Wraps an ``openai.OpenAI`` client; a drop-in for it (see :mod:`.middleware_base`).

    One conversation is one agent episode (one Leyline session); a call that starts another
    conversation gets another session. Before each call the policy runs on the agent's
    messages (through :class:`~.planner.TurnPlanner`); its edits, and the agent's own
    rewrites of its list (diff mode), go as directives addressed with the spans the server
    reported last call. Against a server without Leyline the edited messages go out plainly
    (the server re-prefills) and the wrapper says so once. A request with directives that
    fails is re-sent once as plain messages in the session, so the episode goes on; a
    session the server lost is replaced by a new one, prefilled from the messages.
    ``stream=True`` streams, directives included.

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
        routed: the base URL is sglang-router's: every Leyline request (capabilities,
            tokenize, a turn with a ``leyline`` object, a session's GET and DELETE) goes as
            one envelope over ``POST /v1/completions``, which a worker's tunnel unpacks.
            Direct or not, a session's requests carry its id as ``X-SMG-Routing-Key``.
        unreachable_s: in routed mode, how long a request whose worker the router cannot
            reach (HTTP 500 ``call_upstream_request_error``, 503, no connection) is sent
            again, after 0.5, 1, 2, 4, 4, ... s.
    """

    _lock_type = threading.Lock
    _completions_type = _Completions
    _stream_type = LeylineStream

    def probe(self) -> ServerSupport:
        """Ask ``GET /leyline/v1/capabilities`` once; any error status means no Leyline.

        Raises:
            openai.APIConnectionError: the server does not answer (asked again next call).
        """
        return self._run(self._probe())

    def close(self) -> None:
        """Free the sessions' caches on the server (best effort; the client stays open)."""
        self._run(self._close_sessions(list(self.conversations.episodes)))

    def __enter__(self) -> LeylineOpenAI:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _create(self, messages: Iterable[object], kwargs: dict[str, Any]) -> Any:
        flow = self._call(messages, kwargs)
        with self._state.lock:
            return self._run(flow)

    def _locked(self, commit: Callable[[ChatCompletion | None], None]) -> Callable[..., Any]:
        def locked(completion: ChatCompletion | None) -> None:
            with self._state.lock:
                commit(completion)

        return locked

    def _run(self, flow: Flow[T]) -> T:
        return run(flow, self._perform)

    def _perform(self, request: Any) -> Any:
        if isinstance(request, Plan):
            return request.work(self._run)
        if isinstance(request, Wait):
            time.sleep(request.seconds)
            return None
        return request.send(self.client)
