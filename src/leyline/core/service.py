"""The ``/leyline/v1`` operations over any backend: sessions, directives, tokens.

Every write is checked whole before anything changes (the revision it addresses, the
directives, the limits, the tokens it would leave), so a rejected request leaves every
session exactly as it was and creates nothing. Work that needs no model (rendering,
tokenizing) runs off the event loop.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Generic

from leyline.core.backend import Backend, H, SkillLabel, SkillRegistration
from leyline.core.batch import EditPlan, check_tokens, check_vocab, plan_batch
from leyline.core.chat.render import Rendered
from leyline.core.openai_types import parse_chat
from leyline.core.retention import Retention
from leyline.core.sessions import Session, SessionStore
from leyline.protocol import (
    Capabilities,
    Directive,
    ErrorCode,
    LeylineError,
    LeylineRequest,
    LeylineResponse,
    Verb,
)
from leyline.protocol.resources import (
    ApplyDirectives,
    DetokenizeRequest,
    DetokenizeResponse,
    Message,
    SessionCreate,
    SessionInfo,
    SkillAnchor,
    SkillCreate,
    SkillInfo,
    SkillList,
    TokenizeRequest,
    TokenizeResponse,
)
from leyline.protocol.spans import MessageSpan


class SessionService(Generic[H]):
    def __init__(
        self,
        backend: Backend[H],
        store: SessionStore[H],
        *,
        on_op: Callable[[LeylineResponse], None] = lambda r: None,
    ) -> None:
        self.backend = backend
        self.store = store
        self._on_op = on_op
        self.retention = Retention(backend, store, on_op=on_op)

    @property
    def verbs(self) -> list[Verb]:
        return self.backend.capabilities().verbs

    def capabilities(self) -> Capabilities:
        return self.backend.capabilities()

    def info(self, session: Session[H], include_tokens: bool = False) -> SessionInfo:
        view = self.backend.view(session.handle)
        return SessionInfo(
            session=session.id,
            revision=view.revision,
            num_tokens=len(view.tokens),
            tokens=list(view.tokens) if include_tokens else None,
            spans=list(view.spans),
            marks=session.marks.info(self.store.clock()),
            dropped=list(session.dropped),
        )

    async def plan(
        self, session: Session[H], directives: Sequence[Directive], base_revision: int | None
    ) -> EditPlan:
        """Check a batch against the leased session (tokenizing off the event loop)."""
        caps = self.capabilities()
        plan = await asyncio.to_thread(
            plan_batch,
            self.backend.view(session.handle),
            directives,
            tokenize=self.backend.encode,
            limits=self.backend.limits,
            vocab_size=self.backend.vocab_size,
            supported=caps.verbs,
            base_revision=base_revision,
            skill_tokens=self.backend.skill_tokens(session.tenant),
            recompute_modes=caps.compose_recompute,
        )
        session.marks.check_batch(plan.edits, plan.marks, self.store.clock())
        return replace(plan, tenant=session.tenant)

    # -- sessions ------------------------------------------------------------------------

    def session_for_turn(
        self, tenant: str, request: LeylineRequest, cache_salt: str | None
    ) -> tuple[Session[H], bool]:
        """The session a chat or completion turn on ``request.session`` runs in, and whether
        this call created it (the caller deletes it again if the turn is rejected).

        An unknown id is created, empty, for a turn without directives: its prompt is then
        prefilled from scratch. A turn with directives, or with ``options.require_session``,
        needs the session to exist and gets ``unknown_session`` (404) instead: directives
        address a revision that is not there, and a client that sets the option would
        rather learn that a session was lost (evicted, deleted, a restart) than pay for a
        silent re-creation.
        """
        session_id = request.session
        if session_id is None:
            raise ValueError("a stateless turn runs in no session of the store")
        if self.store.exists(tenant, session_id) or request.directives:
            return self.store.get(tenant, session_id), False  # unknown_session if gone
        if request.options.require_session:
            raise LeylineError(
                ErrorCode.unknown_session,
                f"no session {session_id!r} and options.require_session is set, so none is "
                "created: it never existed, was deleted, was evicted while idle, or the "
                "server restarted (sessions live in memory); send the turn without "
                "require_session to create it again",
                "leyline.session",
            )
        return self.store.create(tenant, session_id, cache_salt=cache_salt), True

    async def create(self, tenant: str, body: SessionCreate) -> SessionInfo:
        """Create a session, optionally prefilled; nothing is created if any check fails."""
        self.check_salt(body.cache_salt)
        tokens, spans = await self._prompt_of(body)
        check_tokens(tokens, self.backend.vocab_size, self.backend.limits, _source(body))
        self.store.check_new(tenant, body.session)
        session = self.store.create(tenant, body.session, cache_salt=body.cache_salt)
        try:
            async with self.store.lease(session):
                if tokens:
                    report = await self.backend.prefill(session.handle, tokens, spans)
                    self._on_op(report.to_response(session.id))
                if (budget := self.store.budget_too_small_for(session)) is not None:
                    # Gone before the lease ends, so its bytes evict no other session.
                    self.store.delete(tenant, session.id)
                    raise LeylineError(
                        ErrorCode.limit_exceeded,
                        f"a session of {len(tokens)} tokens does not fit {budget}",
                        _source(body),
                    )
                return self.info(session)
        except BaseException:
            if self.store.exists(tenant, session.id):
                self.store.delete(tenant, session.id)  # a failed create leaves nothing behind
            raise

    def check_salt(self, cache_salt: str | None) -> None:
        # Accepting a salt the backend cannot partition by would promise an isolation
        # that does not hold.
        if cache_salt is not None and not self.capabilities().cache_salt:
            raise LeylineError(
                ErrorCode.invalid_directive,
                "this server cannot partition its shared cache by cache_salt "
                "(capabilities.cache_salt is false); omit it",
                "cache_salt",
            )

    async def get(self, tenant: str, session_id: str, include_tokens: bool = False) -> SessionInfo:
        return self.info(self.store.get(tenant, session_id), include_tokens)

    async def delete(self, tenant: str, session_id: str) -> None:
        async with self.store.leased(tenant, session_id):  # after a running request ends
            self.store.delete(tenant, session_id)

    async def apply(
        self,
        tenant: str,
        session_id: str,
        body: ApplyDirectives,
        cancelled: Callable[[], bool] | None = None,
    ) -> LeylineResponse:
        """Apply a batch without generating: all-or-nothing, 409 on a stale revision.
        ``cancelled``: whether the client left (``EditPlan.cancelled``)."""
        async with self.store.leased(tenant, session_id) as session:
            plan = await self.plan(session, body.directives, body.base_revision)
            plan = replace(plan, cancelled=cancelled)
            report = await self.backend.execute(
                session.handle, plan, allow_fallback=body.options.allow_fallback
            )
            self.retention.executed(session, plan)
            response = report.to_response(session.id, self.backend.view(session.handle).spans)
            response = with_dropped(with_composed(response, plan), session)
        self._on_op(response)
        return response

    # -- skills (COMPOSE) ------------------------------------------------------------------

    async def create_skill(self, tenant: str, body: SkillCreate) -> SkillInfo:
        """Register a block of tokens (its KV computed once); nothing is kept if a check
        fails."""
        self._require_skills()
        caps = self.capabilities()
        if body.model is not None and body.model not in caps.models:
            raise LeylineError(
                ErrorCode.skill_mismatch,
                f"this server serves {caps.models}, not {body.model!r}: a skill's KV belongs "
                "to one model",
                "model",
            )
        tokens, source = await self._skill_source(body)
        anchor: tuple[int, ...] = ()
        if body.anchor is not None:
            if not caps.skill_anchors:
                raise LeylineError(
                    ErrorCode.unsupported_option,
                    "this server compiles skills alone from position 0 only "
                    "(capabilities: skill_anchors false)",
                    "anchor",
                )
            anchor, field = await self._skill_source(body.anchor, "anchor.")
            if not anchor:
                raise LeylineError(
                    ErrorCode.invalid_directive, "the anchor renders to no tokens", field
                )
        cap = self.backend.limits.max_skill_tokens
        total = len(anchor) + len(tokens)
        if not tokens or (cap is not None and total > cap):
            with_anchor = f" with its {len(anchor)}-token anchor" if anchor else ""
            raise LeylineError(
                ErrorCode.limit_exceeded,
                f"the skill is {total} tokens{with_anchor}; this server takes 1 to {cap or 'any'}",
                source,
            )
        skill = SkillRegistration(
            tenant,
            body.skill or uuid.uuid4().hex,
            tokens,
            anchor,
            SkillLabel(body.name, body.description),
        )
        return await self.backend.register_skill(skill)

    async def _skill_source(
        self, body: SkillCreate | SkillAnchor, prefix: str = ""
    ) -> tuple[tuple[int, ...], str]:
        """The tokens of a skill's (or its anchor's) one source, checked against the
        vocabulary, and the field they came from."""
        if body.messages is not None:
            tokens: tuple[int, ...] = (await self._render(body.messages, None, False)).tokens
        elif body.text is not None:
            tokens = await asyncio.to_thread(self.backend.encode, body.text)
        else:
            tokens = tuple(body.tokens or ())
        source = prefix + next(
            n for n in ("messages", "text", "tokens") if getattr(body, n) is not None
        )
        check_vocab(tokens, self.backend.vocab_size, source)
        return tokens, source

    async def get_skill(self, tenant: str, skill_id: str, include_tokens: bool) -> SkillInfo:
        self._require_skills()
        return self.backend.skill_info(tenant, skill_id, include_tokens)

    async def list_skills(self, tenant: str) -> SkillList:
        self._require_skills()
        return SkillList(skills=self.backend.list_skills(tenant))

    async def delete_skill(self, tenant: str, skill_id: str) -> None:
        self._require_skills()
        await self.backend.delete_skill(tenant, skill_id)

    def _require_skills(self) -> None:
        if Verb.compose not in self.verbs:
            raise LeylineError(
                ErrorCode.unsupported_verb,
                f"this server does not execute compose, so it keeps no skills (it executes "
                f"{', '.join(sorted(self.verbs))})",
                "skill",
            )

    # -- tokens --------------------------------------------------------------------------

    async def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        if body.text is not None:
            tokens = await asyncio.to_thread(self.backend.encode, body.text)
            return TokenizeResponse(tokens=list(tokens))
        rendered = await self._render(body.messages or [], body.tools, body.add_generation_prompt)
        return TokenizeResponse(tokens=list(rendered.tokens), spans=list(rendered.spans))

    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        check_vocab(body.tokens, self.backend.vocab_size, "tokens")
        return DetokenizeResponse(text=self.backend.decode(body.tokens))

    async def _render(
        self, messages: Sequence[Message], tools: Sequence[Message] | None, prompt: bool
    ) -> Rendered:
        """JSON messages (and tools), checked as a chat request's, rendered off the loop."""

        def render() -> Rendered:
            chat, specs = parse_chat(messages, tools)
            return self.backend.renderer.render(chat, specs, add_generation_prompt=prompt)

        return await asyncio.to_thread(render)

    async def _prompt_of(
        self, body: SessionCreate
    ) -> tuple[tuple[int, ...], tuple[MessageSpan, ...]]:
        if body.messages is not None:
            rendered = await self._render(body.messages, None, body.add_generation_prompt)
            return rendered.tokens, rendered.spans
        if body.text is not None:
            return await asyncio.to_thread(self.backend.encode, body.text), ()
        return tuple(body.tokens or ()), ()


def with_composed(response: LeylineResponse, plan: EditPlan) -> LeylineResponse:
    """The response with where the plan's composes put their blocks (if any)."""
    blocks = plan.composed()
    return response.model_copy(update={"composed": blocks}) if blocks else response


def with_dropped(response: LeylineResponse, session: Session[H]) -> LeylineResponse:
    """The response with the spans dropped on ``session`` since its last one (if any)."""
    dropped = session.take_dropped()
    return response.model_copy(update={"dropped": dropped}) if dropped else response


def _source(body: SessionCreate) -> str:
    return next((n for n in ("messages", "text", "tokens") if getattr(body, n) is not None), "")
