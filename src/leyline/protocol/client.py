"""Typed HTTP clients (sync and async) for the ``/leyline/v1/...`` resources.

Errors come back as :class:`~leyline.protocol.errors.LeylineError` with the server's code;
anything else that is not a success raises :class:`LeylineHTTPError`.

``routed=True``: the base URL is a router's (sglang-router), and each call goes as one
envelope over ``POST /v1/completions`` with a routing key (:mod:`.routing`).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Self, TypeVar

import httpx

from . import _calls
from ._calls import Call, LeylineHTTPError
from .capabilities import Capabilities
from .directives import Directive
from .envelope import LeylineResponse, RequestOptions
from .resources import Message, SessionInfo, SkillAnchor, SkillInfo, TokenizeResponse
from .routing import DEFAULT_MODEL, Sending, new_session_id

__all__ = ["AsyncLeylineClient", "LeylineClient", "LeylineHTTPError"]

T = TypeVar("T")


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class _Routing:
    """What both clients share about routed mode."""

    _sending: Sending

    @property
    def routed(self) -> bool:
        """Calls go as envelopes through a router."""
        return self._sending.routed

    @property
    def routing_key(self) -> str | None:
        """The routing key of calls not about a session (routed mode; None: none sent)."""
        return self._sending.key

    def with_routing_key(self, key: str | None) -> Self:
        """This client with ``key`` as the routing key of calls not about a session (say,
        the session that will compose the skills it registers). It shares this client's
        connections: closing either closes both. Direct mode sends no key."""
        twin = copy.copy(self)
        twin._sending = Sending(self._sending.routed, key, self._sending.model)
        return twin

    def _session_id(self, session: str | None) -> str | None:
        """A new session's id: routed mode names one when none is given (the routing key
        must exist on the request that creates the session)."""
        return new_session_id() if session is None and self.routed else session


class LeylineClient(_Routing):
    """``LeylineClient("http://127.0.0.1:8000")``; the base URL is the server root.

    ``routed=True``: the base URL is a router's root; every call goes as an envelope
    (``POST /v1/completions``, docs/protocol.md section 8) with ``X-SMG-Routing-Key``: the
    session's id on a call about a session, else ``routing_key`` (None: no key, any worker
    answers). ``create_session()`` without an id then names the session itself.
    ``envelope_model``: the envelopes' outer ``model`` (the router requires one).
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout: float = 60.0,
        http_client: httpx.Client | None = None,
        routed: bool = False,
        routing_key: str | None = None,
        envelope_model: str = DEFAULT_MODEL,
    ) -> None:
        self._http = http_client or httpx.Client(base_url=base_url, timeout=timeout)
        self._http.base_url = httpx.URL(base_url)
        self._http.headers.update(_headers(api_key))
        self._sending = Sending(routed, routing_key, envelope_model)

    def _run(self, call: Call[T], session: str | None = None) -> T:
        method, path, kwargs = self._sending.request(call, session)
        return call.parse(self._http.request(method, path, **kwargs))

    def capabilities(self) -> Capabilities:
        return self._run(_calls.capabilities())

    def create_session(
        self,
        session: str | None = None,
        *,
        messages: Sequence[Message] | None = None,
        text: str | None = None,
        tokens: Sequence[int] | None = None,
        cache_salt: str | None = None,
    ) -> SessionInfo:
        session = self._session_id(session)
        call = _calls.create_session(session, messages, text, tokens, cache_salt)
        return self._run(call, session)

    def get_session(self, session: str, *, include_tokens: bool = False) -> SessionInfo:
        return self._run(_calls.get_session(session, include_tokens), session)

    def delete_session(self, session: str) -> None:
        self._run(_calls.delete_session(session), session)

    def apply(
        self,
        session: str,
        base_revision: int,
        directives: Sequence[Directive],
        options: RequestOptions | None = None,
    ) -> LeylineResponse:
        return self._run(_calls.apply(session, base_revision, directives, options), session)

    def create_skill(
        self,
        skill: str | None = None,
        *,
        text: str | None = None,
        messages: Sequence[Message] | None = None,
        tokens: Sequence[int] | None = None,
        model: str | None = None,
        name: str | None = None,
        description: str | None = None,
        anchor: SkillAnchor | None = None,
    ) -> SkillInfo:
        """Register a skill from exactly one of text, messages or token ids (its block
        compiled after ``anchor``'s tokens when given: see ``SkillCreate.anchor``)."""
        call = _calls.create_skill(skill, text, messages, tokens, model, name, description, anchor)
        return self._run(call)

    def get_skill(self, skill: str, *, include_tokens: bool = False) -> SkillInfo:
        return self._run(_calls.get_skill(skill, include_tokens))

    def list_skills(self) -> list[SkillInfo]:
        return self._run(_calls.list_skills()).skills

    def delete_skill(self, skill: str) -> None:
        self._run(_calls.delete_skill(skill))

    def tokenize(
        self,
        text: str | None = None,
        *,
        messages: Sequence[Message] | None = None,
        add_generation_prompt: bool = False,
    ) -> TokenizeResponse:
        return self._run(_calls.tokenize(text, messages, add_generation_prompt))

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self._run(_calls.detokenize(tokens)).text

    def schema(self) -> dict[str, Any]:
        return self._run(_calls.schema())

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class AsyncLeylineClient(_Routing):
    """The async twin of :class:`LeylineClient`; same methods, awaited."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout: float = 60.0,
        http_client: httpx.AsyncClient | None = None,
        routed: bool = False,
        routing_key: str | None = None,
        envelope_model: str = DEFAULT_MODEL,
    ) -> None:
        self._http = http_client or httpx.AsyncClient(base_url=base_url, timeout=timeout)
        self._http.base_url = httpx.URL(base_url)
        self._http.headers.update(_headers(api_key))
        self._sending = Sending(routed, routing_key, envelope_model)

    async def _run(self, call: Call[T], session: str | None = None) -> T:
        method, path, kwargs = self._sending.request(call, session)
        return call.parse(await self._http.request(method, path, **kwargs))

    async def capabilities(self) -> Capabilities:
        return await self._run(_calls.capabilities())

    async def create_session(
        self,
        session: str | None = None,
        *,
        messages: Sequence[Message] | None = None,
        text: str | None = None,
        tokens: Sequence[int] | None = None,
        cache_salt: str | None = None,
    ) -> SessionInfo:
        session = self._session_id(session)
        call = _calls.create_session(session, messages, text, tokens, cache_salt)
        return await self._run(call, session)

    async def get_session(self, session: str, *, include_tokens: bool = False) -> SessionInfo:
        return await self._run(_calls.get_session(session, include_tokens), session)

    async def delete_session(self, session: str) -> None:
        await self._run(_calls.delete_session(session), session)

    async def apply(
        self,
        session: str,
        base_revision: int,
        directives: Sequence[Directive],
        options: RequestOptions | None = None,
    ) -> LeylineResponse:
        return await self._run(_calls.apply(session, base_revision, directives, options), session)

    async def create_skill(
        self,
        skill: str | None = None,
        *,
        text: str | None = None,
        messages: Sequence[Message] | None = None,
        tokens: Sequence[int] | None = None,
        model: str | None = None,
        name: str | None = None,
        description: str | None = None,
        anchor: SkillAnchor | None = None,
    ) -> SkillInfo:
        """Register a skill from exactly one of text, messages or token ids (its block
        compiled after ``anchor``'s tokens when given: see ``SkillCreate.anchor``)."""
        call = _calls.create_skill(skill, text, messages, tokens, model, name, description, anchor)
        return await self._run(call)

    async def get_skill(self, skill: str, *, include_tokens: bool = False) -> SkillInfo:
        return await self._run(_calls.get_skill(skill, include_tokens))

    async def list_skills(self) -> list[SkillInfo]:
        return (await self._run(_calls.list_skills())).skills

    async def delete_skill(self, skill: str) -> None:
        await self._run(_calls.delete_skill(skill))

    async def tokenize(
        self,
        text: str | None = None,
        *,
        messages: Sequence[Message] | None = None,
        add_generation_prompt: bool = False,
    ) -> TokenizeResponse:
        return await self._run(_calls.tokenize(text, messages, add_generation_prompt))

    async def detokenize(self, tokens: Sequence[int]) -> str:
        return (await self._run(_calls.detokenize(tokens))).text

    async def schema(self) -> dict[str, Any]:
        return await self._run(_calls.schema())

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
