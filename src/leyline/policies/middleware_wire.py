"""The wire side of the OpenAI-client wrappers: the requests their flows yield, probing,
request options, tokenize, streamed chunks, errors.

No I/O here: :mod:`.middleware` makes the requests, :mod:`.middleware_async` awaits them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import openai
from openai.types.chat import ChatCompletion
from pydantic import BaseModel, ValidationError

from leyline.protocol import (
    PROTOCOL_VERSION,
    Capabilities,
    ComposeDirective,
    RecomputeMode,
    Verb,
    is_compatible,
)
from leyline.protocol.resources import TokenizeRequest, TokenizeResponse
from leyline.protocol.routing import ROUTING_KEY as ROUTING_KEY  # re-exported

from .base import SummaryRequest
from .errors import PinnedSpanError
from .flows import Flow
from .messages import Message
from .skill_refs import SkillBlock, SkillLookup, wire_message
from .skills import SkillSet

LEYLINE_KEY = "leyline"
"""The key of the Leyline object in a request body (``extra_body``) and in a response."""


@dataclass(frozen=True, slots=True)
class Route:
    """A request to a Leyline route: ``GET`` or ``DELETE`` ``path``, or ``POST`` ``body``,
    at the server ``root``; ``key``: the session it belongs to (the routing key)."""

    method: Literal["get", "post", "delete"]
    root: str
    path: str
    """From the server root: ``/leyline/v1/...``."""
    body: object = None
    key: str | None = None

    def send(self, client: Any) -> Any:
        """Make it with an OpenAI client (an async client's answer is to be awaited)."""
        options: dict[str, Any] = {"body": self.body} if self.method == "post" else {}
        if self.key is not None:
            options["options"] = {"headers": {ROUTING_KEY: self.key}}
        return getattr(client, self.method)(self.root + self.path, cast_to=object, **options)


@dataclass(frozen=True, slots=True)
class Completion:
    """A chat completion with these options; ``retries=False``: without the client's retries;
    ``key``: the session it belongs to (the routing key; None for a request without one)."""

    options: dict[str, Any]
    retries: bool = True
    key: str | None = None

    def send(self, client: Any) -> Any:
        """Make it with an OpenAI client (an async client's answer is to be awaited)."""
        if not self.retries:
            client = client.with_options(max_retries=0)
        options = self.options
        if self.key is not None:
            headers = {**(options.get("extra_headers") or {}), ROUTING_KEY: self.key}
            options = {**options, "extra_headers": headers}
        return client.chat.completions.create(**options)

    @property
    def leyline(self) -> bool:
        """The request carries a ``leyline`` object (it is a turn of a session)."""
        extra = self.options.get("extra_body")
        return isinstance(extra, Mapping) and LEYLINE_KEY in extra


@dataclass(frozen=True, slots=True)
class Plan:
    """Blocking work (the planner) whose own requests are flows: ``work(run)`` answers,
    where ``run`` runs a flow to its result from the thread ``work`` runs in."""

    work: Callable[[Callable[[Flow[Any]], Any]], Any]


@dataclass(frozen=True, slots=True)
class ServerSupport:
    """What the capabilities probe found."""

    leyline: bool
    """Directives can be sent: a compatible Leyline server that executes ``splice``."""
    note: str
    """What was found, in words."""
    capabilities: Capabilities | None = None

    @property
    def retention(self) -> bool:
        """Pins and marks can be sent: a Leyline server whose verbs include ``pin``,
        ``decay`` and ``scratch``."""
        caps = self.capabilities
        wanted = {Verb.pin, Verb.decay, Verb.scratch}
        return self.leyline and caps is not None and wanted <= set(caps.verbs)

    @property
    def require_session(self) -> bool:
        """A turn may say its session must exist (``options.require_session``): a Leyline
        server whose capabilities say ``require_session``."""
        caps = self.capabilities
        return self.leyline and caps is not None and caps.require_session

    @property
    def compose(self) -> bool:
        """Skills can be composed: a Leyline server whose verbs include ``compose``."""
        caps = self.capabilities
        return self.leyline and caps is not None and Verb.compose in caps.verbs


def support_from_capabilities(data: object) -> ServerSupport:
    """Judge the body of ``GET /leyline/v1/capabilities``."""
    try:
        caps = Capabilities.model_validate(data)
    except ValidationError:
        return ServerSupport(False, "the capabilities route answered something else")
    if not is_compatible(PROTOCOL_VERSION, caps.protocol_version):
        note = f"Leyline {caps.protocol_version} is incompatible with {PROTOCOL_VERSION}"
        return ServerSupport(False, note, caps)
    if Verb.splice not in caps.verbs:
        return ServerSupport(False, "the server does not execute splice", caps)
    verbs = ", ".join(v.value for v in caps.verbs)
    return ServerSupport(True, f"Leyline {caps.protocol_version} (verbs: {verbs})", caps)


def support_from_status(status: int, *, routed: bool = False) -> ServerSupport:
    """The capabilities route answered with an error status: a server without Leyline
    (``routed``: asked in an envelope, which a server without the tunnel refuses)."""
    what = "not found" if status == 404 else f"HTTP {status}"
    if routed:
        return ServerSupport(False, f"no Leyline capabilities through the envelope ({what})")
    return ServerSupport(False, f"no Leyline capabilities route ({what})")


def normalize_messages(messages: Iterable[object]) -> list[Message]:
    """The agent's messages as mappings: dicts stay, OpenAI message objects are dumped."""
    out: list[Message] = []
    for i, message in enumerate(messages):
        if isinstance(message, Mapping):
            out.append(message)
        elif isinstance(message, BaseModel):
            out.append(message.model_dump(mode="json", exclude_none=True))
        else:
            raise TypeError(f"message {i} is a {type(message).__name__}, not a chat message")
    return out


def server_root(base_url: object) -> str:
    """``http://host:8000/v1`` -> ``http://host:8000`` (the Leyline routes hang off the root)."""
    root = str(base_url).rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


class RenderUnavailable(Exception):
    """The server could not render messages for the planner (its tokenize failed)."""


def extra_body_of(kwargs: dict[str, Any]) -> dict[str, object]:
    """Check a call's options; pop and return its ``extra_body``.

    Raises:
        ValueError: ``extra_body`` already carries ``leyline``, or is not a dict.
    """
    extra = kwargs.pop("extra_body", None) or {}
    if not isinstance(extra, dict):
        raise ValueError("extra_body must be a dict")
    if LEYLINE_KEY in extra:
        raise ValueError("extra_body['leyline'] is the wrapper's to set; leave it out")
    return extra


def with_stream_usage(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` of a streamed call, asking for the usage in the stream (unless the caller
    said otherwise): the wrapper needs the reply's token count to address it next call."""
    options = kwargs.get("stream_options")
    options = dict(options) if isinstance(options, Mapping) else {}
    if "include_usage" in options:
        return kwargs
    return {**kwargs, "stream_options": {**options, "include_usage": True}}


def summary_kwargs(model: object, request: SummaryRequest) -> dict[str, Any]:
    """The options of the chat completion that writes a summary (no session, no tools)."""
    options: dict[str, Any] = {
        "model": model,
        "messages": [dict(wire_message(m)) for m in request.messages],
    }
    if request.max_tokens is not None:
        options["max_tokens"] = request.max_tokens
    if request.temperature is not None:
        options["temperature"] = request.temperature
    return options


def summary_text(completion: object) -> str:
    choices = getattr(completion, "choices", None) or []
    message = getattr(choices[0], "message", None) if choices else None
    content = getattr(message, "content", None)
    return content if isinstance(content, str) else ""


class ChunkAccumulator:
    """Builds the ``ChatCompletion`` a stream of ``ChatCompletionChunk`` amounts to: text,
    tool calls (joined by index), finish reason, usage and the ``leyline`` report."""

    def __init__(self) -> None:
        self.id, self.model, self.created = "", "", 0
        self.content: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.finish: str | None = None
        self.usage: object | None = None
        self.leyline: object | None = None

    def add(self, chunk: BaseModel) -> None:
        self.id = str(getattr(chunk, "id", "") or self.id)
        self.model = str(getattr(chunk, "model", "") or self.model)
        self.created = int(getattr(chunk, "created", 0) or self.created)
        usage = getattr(chunk, "usage", None)
        if usage is not None:
            self.usage = usage
        extra = chunk.model_extra or {}
        if extra.get(LEYLINE_KEY) is not None:
            self.leyline = extra[LEYLINE_KEY]
        for choice in getattr(chunk, "choices", None) or []:
            if getattr(choice, "index", 0) != 0:
                continue
            if getattr(choice, "finish_reason", None):
                self.finish = choice.finish_reason
            delta = getattr(choice, "delta", None)
            if delta is None:
                continue
            if isinstance(getattr(delta, "content", None), str):
                self.content.append(delta.content)
            for call in getattr(delta, "tool_calls", None) or []:
                self._add_call(call)

    def _add_call(self, call: Any) -> None:
        entry = self.calls.setdefault(
            int(getattr(call, "index", len(self.calls)) or 0),
            {"id": "", "type": "function", "function": {"name": "", "arguments": ""}},
        )
        if getattr(call, "id", None):
            entry["id"] = call.id
        function = getattr(call, "function", None)
        if function is not None:
            entry["function"]["name"] += getattr(function, "name", None) or ""
            entry["function"]["arguments"] += getattr(function, "arguments", None) or ""

    @property
    def has_report(self) -> bool:
        """The server's ``leyline`` report arrived (it comes with the final chunk)."""
        return self.leyline is not None

    def completion(self) -> ChatCompletion:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.content) or None}
        if self.calls:
            message["tool_calls"] = [self.calls[i] for i in sorted(self.calls)]
        elif message["content"] is None:
            message["content"] = ""
        usage = self.usage.model_dump() if isinstance(self.usage, BaseModel) else self.usage
        body: dict[str, Any] = {
            "id": self.id or "stream",
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "message": message, "finish_reason": self.finish or "stop"}],
            "usage": usage,
        }
        if self.leyline is not None:
            body[LEYLINE_KEY] = self.leyline
        return ChatCompletion.model_validate(body)


class StreamBase:
    """What :class:`~.middleware.LeylineStream` and :class:`~.middleware_async.AsyncLeylineStream`
    share: the wrapped stream, its chunks so far, and when the call is committed (once):
    when the server's report is complete (with the final chunk on a Leyline server), when the
    stream ends, or with None when it fails or is closed first. The shells iterate."""

    _errors: ClassVar[type[BaseException]] = Exception
    """What the wrapped stream raises that commits (the async shell: cancellation too)."""

    def __init__(
        self, stream: Any, commit: Callable[[ChatCompletion | None], Any], *, reported: bool
    ) -> None:
        self._stream = stream
        self._commit = commit
        self._reported = reported
        self._chunks = ChunkAccumulator()
        self._done = False
        self._iterator = self._iterate(stream)

    @staticmethod
    def _iterate(stream: Any) -> Any:
        """The wrapped stream's iterator (``iter`` or ``__aiter__``)."""
        raise NotImplementedError

    def _received(self, chunk: BaseModel) -> Any:
        """Take a chunk; what ``commit`` answered if the report is complete now, else None."""
        self._chunks.add(chunk)
        if self._reported and self._chunks.has_report and self._chunks.usage is not None:
            return self._settle(self._chunks.completion())
        return None

    def _ended(self, error: BaseException) -> Any:
        """The wrapped stream raised ``error`` (its end, or a failure): commit accordingly."""
        if not isinstance(error, self._errors):
            return None
        end = isinstance(error, StopIteration | StopAsyncIteration)
        return self._settle(self._chunks.completion() if end else None)

    def _settle(self, completion: ChatCompletion | None) -> Any:
        """``commit(completion)`` the first time; None after."""
        if self._done:
            return None
        self._done = True
        return self._commit(completion)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or "_stream" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["_stream"], name)


def renderer(
    tokenize: Callable[[Sequence[Message], list[object] | None], TokenizeResponse], tools: object
) -> Callable[[Sequence[Message]], TokenizeResponse]:
    """The planner's ``render``: the server's tokens and spans, with the call's tool list."""
    listed = list(tools) if isinstance(tools, list | tuple) else None
    return lambda messages: tokenize(messages, listed)


def tokenize_body(messages: Sequence[Message], tools: list[object] | None) -> dict[str, object]:
    """The body of ``POST /leyline/v1/tokenize`` for a message list and a tool list."""
    request = TokenizeRequest.model_validate(
        {"messages": [dict(m) for m in messages], "tools": tools}
    )
    return request.model_dump(mode="json", exclude_none=True)


def composes(skills: SkillSet | None, support: ServerSupport) -> SkillLookup | None:
    """The planner's skill lookup: only where the server executes ``compose``, and only
    for blocks whose ``recompute`` mode (when one is asked for) the server lists in its
    ``compose_recompute``: another would be refused (``unsupported_option``) and cost the
    call a resync, so such a skill message goes as text."""
    if skills is None or not support.compose:
        return None
    caps = support.capabilities
    modes = frozenset(caps.compose_recompute) if caps is not None else frozenset()

    def lookup(message: Message) -> SkillBlock | None:
        block = skills.lookup(message)
        if block is None or block.recompute is None or RecomputeMode(block.recompute.mode) in modes:
            return block
        return None

    return lookup


SKILL_ERRORS = frozenset({"unknown_skill", "skill_mismatch"})
"""Codes that say a skill cannot be composed in this session until registered again."""


def failed_skills(exc: openai.APIError, directives: Sequence[object]) -> list[str]:
    """The skills a refused batch names as the cause (all its composes when the error's
    ``field`` does not point at one); none unless the code is a skill error."""
    skills = {i: d.skill for i, d in enumerate(directives) if isinstance(d, ComposeDirective)}
    if not isinstance(exc, openai.APIStatusError) or exc.code not in SKILL_ERRORS:
        return []
    body = exc.body if isinstance(exc.body, Mapping) else {}
    found = re.match(r"directives\[(\d+)\]", str(body.get("field") or ""))
    if found and int(found.group(1)) in skills:
        return [skills[int(found.group(1))]]
    return list(skills.values())


def resync_reason(exc: openai.APIError) -> str:
    """Why a request with directives failed, in a few words (the Leyline code if any)."""
    if isinstance(exc, openai.APIStatusError):
        return exc.code or f"HTTP {exc.status_code}"
    return f"{type(exc).__name__}: {exc}"[:200]


def pinned_error(exc: BaseException, session: str | None) -> PinnedSpanError | None:
    """The typed error for a ``pinned_span`` refusal (None for any other error)."""
    if not isinstance(exc, openai.APIStatusError) or exc.code != "pinned_span":
        return None
    body = exc.body if isinstance(exc.body, Mapping) else {}
    field = body.get("field")
    detail = str(body.get("message") or exc.message)
    return PinnedSpanError(session, detail, str(field) if field is not None else None)


def is_revision_conflict(exc: BaseException) -> bool:
    return isinstance(exc, openai.APIStatusError) and exc.code == "revision_conflict"


def is_unknown_skill(exc: BaseException) -> bool:
    """The server has no such skill (a compose names one it does not hold)."""
    return isinstance(exc, openai.APIStatusError) and exc.code == "unknown_skill"


def is_unknown_session(exc: BaseException) -> bool:
    """The server has no such session (a bare 404, such as a router's, is not this)."""
    return isinstance(exc, openai.APIStatusError) and exc.code == "unknown_session"
