"""Skills: chat messages whose KV a Leyline server computes once and composes into sessions.

:class:`SkillSet` remembers the registered skills (what the middleware looks up);
:class:`SkillLibrary` and :class:`AsyncSkillLibrary` register them through a
``LeylineClient`` / ``AsyncLeylineClient``, one sans-IO flow for both. A skill is registered
as the server's own rendering of its message (the block rule, anchors, selective recompute
and skill ids are in docs/policies.md, "Skills (compose)").

Behind a router (a routed client) skills are per worker: a skill is registered with the
routing key of the session that will compose it (``register(..., routing_key=session)``),
and the wrappers register it again where a session's worker no longer has it
(docs/middleware.md, "Skills behind a router").
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field, replace
from operator import methodcaller
from typing import Any, Generic, TypeVar

from pydantic import TypeAdapter, ValidationError

from leyline.protocol.client import AsyncLeylineClient, LeylineClient
from leyline.protocol.directives import Recompute
from leyline.protocol.resources import Message as WireMessage
from leyline.protocol.resources import SkillAnchor, SkillCreate, SkillInfo, TokenizeResponse

from .errors import SkillError
from .flows import Flow, arun, run
from .messages import ROLES, Message, canonical_json, content_text
from .skill_refs import SKILL_KEY, SkillBlock, skill_id_of

DEFAULT_SKILL_CONTEXT: tuple[Message, ...] = (
    {"role": "system", "content": "You are a helpful assistant."},
)
"""What a skill message is rendered after when registered: any message, since the block is
the skill message's own span; override it where a template refuses this one."""

C = TypeVar("C", LeylineClient, AsyncLeylineClient)
R = TypeVar("R")

_ID_NAME_CHARS = 100  # + "-" + 16 hex digits stays within the protocol's 128


@dataclass(frozen=True, slots=True)
class SkillEntry:
    """A registered skill: the message it stands for and the block the server holds."""

    name: str
    skill: str
    """The server's id."""
    message: Mapping[str, object] = field(repr=False)
    """The message as registered (role, content, other fields; no side field)."""
    tokens: tuple[int, ...] = field(repr=False)
    info: SkillInfo
    context_key: str = field(repr=False)
    seam_tokens: int = 4
    recompute: Recompute | None = None
    """Selective recompute each compose asks for (None: the directive's default, none)."""
    anchor: tuple[int, ...] = field(default=(), repr=False)
    """The anchor tokens the block was compiled after (none: compiled alone)."""
    description: str | None = None

    @property
    def text(self) -> str:
        return str(self.message["content"])

    def block(self) -> SkillBlock:
        return SkillBlock(self.skill, self.tokens, self.seam_tokens, self.recompute)


@dataclass(frozen=True, slots=True)
class _Registration:
    """One ``register`` call, checked: what to render, and how to remember the result."""

    name: str
    message: dict[str, object]
    context: tuple[Message, ...]
    seam_tokens: int
    anchored: bool = False
    recompute: Recompute | None = None

    @property
    def context_key(self) -> str:
        return canonical_json([dict(m) for m in self.context]) + ("+anchored" * self.anchored)

    def rendering(self) -> list[WireMessage]:
        """``[*context, message]`` for ``POST /tokenize`` (JSON values only)."""
        try:
            return _WIRE.validate_python([*(dict(m) for m in self.context), self.message])
        except ValidationError as exc:
            raise SkillError(self.name, f"the messages are not JSON: {exc}") from None

    def upload(self, rendered: TokenizeResponse) -> _Upload:
        """What to send ``POST /skills`` for the server's rendering of ``[*context, message]``:
        the block, and as its anchor (when ``anchored``) every token before it."""
        tokens = block_of(rendered, len(self.context), self.name)
        lead = tuple(rendered.tokens[: block_start(rendered, len(self.context))])
        anchor = lead if self.anchored else ()
        return _Upload(skill_id(self.name, tokens, anchor), tokens, anchor)

    def entry(self, upload: _Upload, info: SkillInfo, description: str | None) -> SkillEntry:
        tokens = upload.tokens
        if info.num_tokens != len(tokens):
            raise SkillError(
                self.name, f"registered {len(tokens)} tokens, the server holds {info.num_tokens}"
            )
        return SkillEntry(
            self.name,
            info.skill,
            self.message,
            tokens,
            info,
            self.context_key,
            self.seam_tokens,
            self.recompute,
            upload.anchor,
            description,
        )


@dataclass(frozen=True, slots=True)
class _Upload:
    skill: str
    tokens: tuple[int, ...]
    anchor: tuple[int, ...]

    def anchor_body(self) -> SkillAnchor | None:
        return SkillAnchor(tokens=list(self.anchor)) if self.anchor else None


_WIRE: TypeAdapter[list[WireMessage]] = TypeAdapter(list[WireMessage])


class SkillSet:
    """The registered skills of a library, in memory: what the middleware looks up.

    Args:
        context: the messages a skill message is rendered after when registered.
        seam_tokens: leading block tokens the server recomputes in context (per compose).
        model: the model to bind skills to (None: the server's default).
        anchored: have the server compile each block after the rendered ``context`` (a
            skill ``anchor``) instead of alone, so the block does not play the start of a
            sequence: closer to a prefill where it follows such a context. Needs a server
            whose capabilities say ``skill_anchors`` (else registering is refused).
        recompute: selective recompute past the seam that each compose asks for, e.g.
            ``RecomputeAttention(mode="attention", ratio=0.3)`` (None: the directive's
            default, ``{"mode": "none"}``). Per compose, like ``seam_tokens``: not part of
            the skill's id; a server whose capabilities' ``compose_recompute`` lack the mode
            gets the message as text.
    """

    def __init__(
        self,
        *,
        context: Sequence[Message] = DEFAULT_SKILL_CONTEXT,
        seam_tokens: int = 4,
        model: str | None = None,
        anchored: bool = False,
        recompute: Recompute | None = None,
    ) -> None:
        self.context, self.seam_tokens, self.model = tuple(context), seam_tokens, model
        self.anchored, self.recompute = anchored, recompute
        self._by_name: dict[str, SkillEntry] = {}
        self._by_id: dict[str, SkillEntry] = {}
        self._keys: dict[str, set[str]] = {}
        """Routed mode: each skill id's routing keys it was registered with."""

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def get(self, name: str) -> SkillEntry | None:
        return self._by_name.get(name)

    @property
    def entries(self) -> tuple[SkillEntry, ...]:
        return tuple(self._by_name.values())

    def message(self, name: str, **fields: object) -> dict[str, object]:
        """The message to put in a conversation: the skill's full text as ``content`` (what a
        plain server sees) and its id in the side field the middleware composes from.
        ``fields`` are added to it (e.g. ``tool_call_id`` for a tool-role skill).

        Raises:
            SkillError: no skill of that name is registered.
        """
        entry = self._by_name.get(name)
        if entry is None:
            raise SkillError(name, f"not registered (registered: {sorted(self._by_name)})")
        return {**entry.message, **fields, SKILL_KEY: entry.skill}

    def lookup(self, message: Message) -> SkillBlock | None:
        """The block of a skill message whose role and text are still the registered ones."""
        entry = self._by_id.get(skill_id_of(message) or "")
        if entry is None or message.get("role") != entry.message["role"]:
            return None
        return entry.block() if content_text(message) == entry.text else None

    def discard(self, skill: str) -> None:
        """Forget a skill id the server no longer holds (``unknown_skill``) or cannot use
        here (``skill_mismatch``): its messages go as text until it is registered again."""
        entry = self._by_id.pop(skill, None)
        self._keys.pop(skill, None)
        if entry is not None and self._by_name.get(entry.name) is entry:
            del self._by_name[entry.name]

    def creation(self, skill: str) -> SkillCreate | None:
        """The body of ``POST /leyline/v1/skills`` that registers skill id ``skill`` again,
        as it was (its block, anchor, model, name): the same content gives the same id.
        None: no such skill is remembered."""
        entry = self._by_id.get(skill)
        if entry is None:
            return None
        return SkillCreate(
            skill=entry.skill,
            model=self.model,
            tokens=list(entry.tokens),
            name=entry.name[:256],
            description=entry.description,
            anchor=SkillAnchor(tokens=list(entry.anchor)) if entry.anchor else None,
        )

    def registered_again(self, skill: str, info: SkillInfo, key: str | None) -> bool:
        """Whether ``info`` (the answer to :meth:`creation`'s body) is the remembered skill:
        same id and size. ``key``: the routing key it went with, remembered."""
        entry = self._by_id.get(skill)
        if entry is None or (info.skill, info.num_tokens) != (skill, len(entry.tokens)):
            return False
        self.placed(skill, key)
        return True

    def placed(self, skill: str, key: str | None) -> None:
        """Note that skill id ``skill`` was registered with routing key ``key``."""
        if key is not None:
            self._keys.setdefault(skill, set()).add(key)

    def is_placed(self, skill: str, key: str | None) -> bool:
        """Whether skill id ``skill`` was registered with routing key ``key`` (None: no key,
        any registration counts)."""
        return key is None or key in self._keys.get(skill, ())

    def _registration(
        self,
        name: str,
        text: str,
        role: str,
        context: Sequence[Message] | None,
        seam_tokens: int | None,
        recompute: Recompute | None,
        fields: Mapping[str, object],
    ) -> _Registration:
        return _Registration(
            name,
            skill_message(name, role, text, fields),
            tuple(self.context if context is None else context),
            self.seam_tokens if seam_tokens is None else seam_tokens,
            self.anchored,
            self.recompute if recompute is None else recompute,
        )

    def _cached(self, request: _Registration) -> SkillEntry | None:
        """The remembered entry for the same name, message and context (the server's block
        is the same), with the request's per-compose options (seam, recompute): the same
        entry when those match too, else an updated one, remembered in its place."""
        entry = self._by_name.get(request.name)
        if entry is None or entry.context_key != request.context_key:
            return None
        if canonical_json(entry.message) != canonical_json(request.message):
            return None
        if (entry.seam_tokens, entry.recompute) == (request.seam_tokens, request.recompute):
            return entry
        updated = replace(entry, seam_tokens=request.seam_tokens, recompute=request.recompute)
        return self._remember(updated)

    def _remember(self, entry: SkillEntry) -> SkillEntry:
        self._by_name[entry.name] = entry
        self._by_id[entry.skill] = entry
        return entry


def skill_message(
    name: str, role: str, text: str, fields: Mapping[str, object]
) -> dict[str, object]:
    """The message skill ``name`` stands for.

    Raises:
        SkillError: an empty name or text, an unknown role, ``fields`` that set role or content.
    """
    if not name:
        raise SkillError(name, "a skill needs a non-empty name")
    if role not in ROLES:
        raise SkillError(name, f"unknown role {role!r}; expected one of {sorted(ROLES)}")
    if not text:
        raise SkillError(name, "a skill needs a non-empty text")
    clash = {"role", "content", SKILL_KEY} & set(fields)
    if clash:
        raise SkillError(name, f"fields may not set {sorted(clash)}")
    return {"role": role, "content": text, **fields}


def block_of(rendered: TokenizeResponse, index: int, name: str) -> tuple[int, ...]:
    """Message ``index``'s tokens in a rendering, with the separator before it.

    Raises:
        SkillError: the rendering has no span per message, or the message renders to nothing.
    """
    spans = rendered.spans
    if len(spans) != index + 1:
        raise SkillError(
            name,
            f"the server's rendering has {len(spans)} message spans for {index + 1} "
            "messages (its template cannot be split per message), so no block can be cut",
        )
    tokens = tuple(rendered.tokens[block_start(rendered, index) : spans[index].end])
    if not tokens:
        raise SkillError(name, "the message renders to no tokens")
    return tokens


def block_start(rendered: TokenizeResponse, index: int) -> int:
    """Where message ``index``'s block starts: the end of the message before it (the first
    message's own start), so a separator between messages goes with the block."""
    return rendered.spans[index - 1].end if index else rendered.spans[0].start


def skill_id(name: str, tokens: Sequence[int], anchor: Sequence[int] = ()) -> str:
    """``name-<16 hex>``: same name, block and anchor, same id; another block or anchor,
    another id (so libraries with other contexts never replace each other's blocks)."""
    digest = hashlib.sha256(_id_bytes(tokens))
    if anchor:
        digest.update(b"\0anchor" + _id_bytes(anchor))
    return f"{name[:_ID_NAME_CHARS]}-{digest.hexdigest()[:16]}"


class _Library(SkillSet, Generic[C, R]):
    """A :class:`SkillSet` that registers through a client; ``register`` answers an ``R``
    (a :class:`SkillEntry`, or for the async shell an awaitable of one)."""

    def __init__(
        self,
        client: C,
        *,
        context: Sequence[Message] = DEFAULT_SKILL_CONTEXT,
        seam_tokens: int = 4,
        model: str | None = None,
        anchored: bool = False,
        recompute: Recompute | None = None,
    ) -> None:
        super().__init__(
            context=context,
            seam_tokens=seam_tokens,
            model=model,
            anchored=anchored,
            recompute=recompute,
        )
        self.client: C = client

    def register(
        self,
        name: str,
        text: str,
        *,
        role: str = "system",
        context: Sequence[Message] | None = None,
        description: str | None = None,
        seam_tokens: int | None = None,
        recompute: Recompute | None = None,
        routing_key: str | None = None,
        **fields: object,
    ) -> R:
        """Register ``text`` as the skill ``name``: a ``role`` message with ``fields``.

        ``seam_tokens`` and ``recompute`` override the library's for this skill's composes
        (None: the library's). They are per-compose options, not part of the skill: the id
        and the block on the server do not depend on them.

        Idempotent: the same name, message and context return the remembered entry without
        a request; the same text in another library gets the same id and content hash (the
        server answers the skill it holds and recomputes nothing). Registering it again
        with another ``seam_tokens`` or ``recompute`` sends nothing either: the remembered
        entry is updated, and the skill's messages composed from then on ask for those.

        With a routed client (``LeylineClient(..., routed=True)``) skills are per worker:
        ``routing_key`` (None: the client's own ``routing_key``) is the session that will
        compose the skill, so the registration lands on that session's worker. A skill
        already registered is sent again (``create_skill`` only, the same block: the same
        id) for a key it was not registered with yet.

        Raises:
            SkillError: bad arguments, or a rendering that cannot be cut per message.
            LeylineError: the server refused (e.g. ``limit_exceeded``; ``not_found`` from a
                server without skills).
        """

        def checked() -> _Registration:
            return self._registration(name, text, role, context, seam_tokens, recompute, fields)

        client = self.client
        if client.routed and routing_key is not None:
            client = client.with_routing_key(routing_key)
        key = client.routing_key if client.routed else None
        return self._run(self._registering(checked, description, key), client)

    def _registering(
        self, checked: Callable[[], _Registration], description: str | None, key: str | None
    ) -> Flow[SkillEntry]:
        """One ``register``, checked when the flow starts: it yields the client calls to
        make (``tokenize``, then ``create_skill``) and is sent their answers. ``key``: the
        routing key the calls go with (routed mode)."""
        request = checked()
        if (cached := self._cached(request)) is not None:
            if self.is_placed(cached.skill, key):
                return cached
            body = self.creation(cached.skill)
            assert body is not None  # remembered: _cached found it
            info = yield methodcaller(
                "create_skill",
                body.skill,
                tokens=body.tokens,
                model=body.model,
                name=body.name,
                description=body.description,
                anchor=body.anchor,
            )
            if not self.registered_again(cached.skill, info, key):
                raise SkillError(cached.name, f"the server answered another skill: {info}")
            return cached
        rendered = yield methodcaller("tokenize", messages=request.rendering())
        upload = request.upload(rendered)
        info = yield methodcaller(
            "create_skill",
            upload.skill,
            tokens=upload.tokens,
            model=self.model,
            name=request.name[:256],
            description=description,
            anchor=upload.anchor_body(),
        )
        entry = self._remember(request.entry(upload, info, description))
        self.placed(entry.skill, key)
        return entry

    def _run(self, flow: Flow[SkillEntry], client: C) -> R:
        raise NotImplementedError


class SkillLibrary(_Library[LeylineClient, SkillEntry]):
    """Registers skills through a :class:`~leyline.protocol.client.LeylineClient`.

    Pass it to :class:`~.middleware.LeylineOpenAI` (``skills=``). The other arguments are
    :class:`SkillSet`'s.
    """

    def _run(self, flow: Flow[SkillEntry], client: LeylineClient) -> SkillEntry:
        return run(flow, lambda call: call(client))


class AsyncSkillLibrary(_Library[AsyncLeylineClient, Coroutine[Any, Any, SkillEntry]]):
    """:class:`SkillLibrary` over an ``AsyncLeylineClient`` (``await library.register(...)``),
    for :class:`~.middleware_async.AsyncLeylineOpenAI`."""

    async def _run(self, flow: Flow[SkillEntry], client: AsyncLeylineClient) -> SkillEntry:
        return await arun(flow, lambda call: call(client))


def _id_bytes(ids: Sequence[int]) -> bytes:
    return b"".join(int(t).to_bytes(8, "little", signed=True) for t in ids)
