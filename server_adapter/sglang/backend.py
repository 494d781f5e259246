"""SGLang as a session-core backend: plans executed in the scheduler over a link.

A session here is only its protocol state (tokens, revision, message spans): the KV lives
in SGLang's radix tree, keyed by tokens, and an ordinary ``/generate`` with the session's
tokens hits it. Executing a plan sends the edits to the scheduler (``scheduler_side``),
which splices the tree's KV or purges it (FORGET); an inserted run with no KV yet is
prefilled by a generate and the request repeated. The core has checked the plan whole
(revision, spans, limits, tokens), so nothing here re-checks a protocol rule.

Imports neither torch nor SGLang: the link is the only part that talks to SGLang
(``tokenizer_side.TokenizerManagerLink``), so this logic runs in ``make test`` too.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from leyline.protocol import (
    PROTOCOL_VERSION,
    Capabilities,
    ErrorCode,
    FallbackReason,
    LeylineError,
    Limits,
    Path,
    Verb,
)
from leyline.protocol.algebra import Edit
from leyline.protocol.resolve import SkillTokens
from leyline.protocol.resources import Message, SkillInfo
from leyline.protocol.spans import MessageSpan

from ..core.backend import Rendered, SkillLabel
from ..core.batch import EditPlan, SessionView, common_prefix
from ..core.report import OpReport
from ..core.retention import MARKING_VERBS
from ..core.sessions import DEFAULT_TENANT
from ..errors import SpliceUnsupportedError
from .skill_store import HeldSkill, SkillHolds

if TYPE_CHECKING:
    from ..chat.render import ChatRenderer
    from ..http.openai_types import ChatMessage, ToolSpec

EXECUTED_VERBS = (Verb.splice, Verb.forget, Verb.erratum, Verb.compose)
#: The cache layouts the scheduler side can rotate (``kv_rows``).
LAYOUTS = ("mla", "gqa")


@dataclass(frozen=True, slots=True)
class SchedulerAnswer:
    """What the scheduler did with one request (the wire struct, without SGLang)."""

    ok: bool
    cached_tokens: int = 0
    reused_tokens: int = 0
    rotated_tokens: int = 0
    pending_prefill: int | None = None
    fallback_reason: str | None = None
    """A protocol fallback reason: the splice did not run (or not all of it)."""
    error_code: str | None = None
    """A protocol error code: the scheduler refused the request."""
    error_field: str | None = None
    message: str = ""
    released: tuple[str, ...] = ()
    """``hold``: the held keys released to make room."""


@dataclass(frozen=True, slots=True)
class BlockSource:
    """A composed block in the new sequence, and the cached tokens its KV is read from."""

    start: int
    end: int
    source: tuple[int, ...]
    """The skill's tokens as the tree holds them (public namespace): anchor, then block."""
    offset: int
    """Where the block starts in ``source`` (the anchor's length)."""
    seam: int
    """Leading block tokens prefilled in context (``min(K, n)``)."""

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.source[self.offset :]


class SchedulerLink(Protocol):
    async def send(
        self,
        verb: str,
        old_tokens: Sequence[int],
        edits: Sequence[Edit],
        *,
        blocks: Sequence[BlockSource] = (),
        old_salt: str | None = None,
        new_salt: str | None = None,
    ) -> SchedulerAnswer:
        """Run ``splice`` or ``forget`` of ``edits`` on the cached ``old_tokens`` (in the
        namespace ``old_salt``; a splice builds the new sequence in ``new_salt``'s)."""
        ...

    async def prefill(self, tokens: Sequence[int], salt: str | None = None) -> None:
        """Run an ordinary generate over ``tokens`` so the tree caches them (under ``salt``)."""
        ...

    async def hold(
        self, key: str, tokens: Sequence[int], evictable: Sequence[str] = ()
    ) -> tuple[int, tuple[str, ...]]:
        """Lock what the tree holds of ``tokens`` under ``key`` (replacing that key's lock),
        releasing keys of ``evictable`` (in order) if that is what makes room; returns how
        many tokens are held and the keys released. Raises ``LeylineError(limit_exceeded)``,
        changing nothing, when even releasing all of them leaves no room."""
        ...

    async def release(self, key: str) -> None:
        """Let ``key``'s lock go."""
        ...


@dataclass
class SglangSession:
    """The handle: the protocol state only (the tree holds the KV, shared by tokens)."""

    view: SessionView = field(default_factory=SessionView)
    shared_salt: str | None = None
    """The namespace the session shares with requests of its ``cache_salt`` (SGLang's own
    ``cache_salt``: keys of different salts never share a tree node); None: the public one."""
    private_salt: str | None = None
    """The session's own namespace once it has composed: a composed sequence is not a
    prefill of its tokens, so no other request may match it (protocol 3.4)."""

    shared_tokens: tuple[int, ...] = ()
    """What the session held in its shared namespace when it went private (that namespace
    still caches them, for every request of its salt)."""

    @property
    def salt(self) -> str | None:
        """Where the session's KV is now."""
        return self.private_salt or self.shared_salt


class SglangBackend:
    """``Backend[SglangSession]`` over one SGLang server's scheduler."""

    def __init__(
        self,
        link: SchedulerLink,
        tokenizer: Any | None,
        *,
        limits: Limits,
        vocab_size: int,
        model_name: str = "",
    ) -> None:
        self.link = link
        self.tokenizer = tokenizer
        self._limits = limits
        self._vocab_size = vocab_size
        self.model_name = model_name
        self._renderer: ChatRenderer | None = None
        self.skills = SkillHolds(link, model_name or "sglang")

    @property
    def limits(self) -> Limits:
        return self._limits

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def capabilities(self) -> Capabilities:
        return Capabilities(
            protocol_version=PROTOCOL_VERSION,
            verbs=[*EXECUTED_VERBS, *MARKING_VERBS],
            architectures=list(LAYOUTS),
            models=[self.model_name] if self.model_name else [],
            limits=self._limits,
            # SGLang maps no API key to a tenant (the plugin adds no access layer); its
            # radix tree is partitioned by SGLang's own ``cache_salt`` (``open``).
            tenants=False,
            cache_salt=True,
            # The block's keys are the tree's prefill after its anchor, rotated like any
            # kept run; selective recompute is not built here (``none`` only).
            skill_anchors=True,
        )

    def _require_tokenizer(self, field_name: str) -> Any:
        if self.tokenizer is None:
            raise LeylineError(
                ErrorCode.invalid_directive,
                "this SGLang server runs without a tokenizer (--skip-tokenizer-init): send "
                "token ids instead of text or messages",
                field_name,
            )
        return self.tokenizer

    def encode(self, text: str) -> tuple[int, ...]:
        tokenizer = self._require_tokenizer("text")
        return tuple(int(t) for t in tokenizer.encode(text, add_special_tokens=False))

    def decode(self, tokens: Sequence[int]) -> str:
        if self.tokenizer is None:
            return " ".join(str(t) for t in tokens)
        return str(self.tokenizer.decode(list(tokens), skip_special_tokens=False))

    def render(
        self,
        messages: Sequence[Message],
        tools: Sequence[Message] | None,
        *,
        add_generation_prompt: bool,
    ) -> Rendered:
        from ..http.openai_types import parse_chat

        self._require_tokenizer("messages")
        chat, specs = parse_chat(messages, tools)
        return self.render_chat(chat, specs, add_generation_prompt=add_generation_prompt)

    def render_chat(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[ToolSpec] | None,
        *,
        add_generation_prompt: bool,
    ) -> Rendered:
        """Parsed messages (a chat request's) rendered with the reference server's renderer
        over SGLang's own (HF) tokenizer: same template, same message spans, so message
        anchors resolve here as they do there."""
        from ..chat.render import ChatRenderer, ChatTemplateError

        tokenizer = self._require_tokenizer("messages")
        if self._renderer is None:
            try:
                self._renderer = ChatRenderer(tokenizer)
            except ChatTemplateError as exc:
                raise LeylineError(ErrorCode.invalid_directive, str(exc), "messages") from None
        try:
            out = self._renderer.render(
                list(messages), list(tools or []), add_generation_prompt=add_generation_prompt
            )
        except ChatTemplateError as exc:  # as the reference server answers it (http.errors)
            raise LeylineError(ErrorCode.invalid_directive, str(exc), "messages") from None
        return Rendered(out.tokens, out.spans)

    # -- skills: the tree's own prefill of each, locked while registered (skill_store) --

    def skill_tokens(self, tenant: str) -> SkillTokens | None:
        return self.skills.tokens_of(tenant)

    async def register_skill(
        self,
        tenant: str,
        skill_id: str,
        tokens: Sequence[int],
        label: SkillLabel,
        *,
        anchor: Sequence[int] = (),
    ) -> SkillInfo:
        skill = await self.skills.register(tenant, skill_id, tokens, label, anchor)
        return skill.info(include_tokens=False)

    def skill_info(self, tenant: str, skill_id: str, include_tokens: bool) -> SkillInfo:
        return self.skills.get(tenant, skill_id).info(include_tokens)

    def list_skills(self, tenant: str) -> list[SkillInfo]:
        return [s.info(include_tokens=False) for s in self.skills.of_tenant(tenant)]

    async def delete_skill(self, tenant: str, skill_id: str) -> None:
        await self.skills.delete(tenant, skill_id)

    # -- handles ------------------------------------------------------------------------

    def open(self, salt: str) -> SglangSession:
        # ``salt`` is the core's partition: the tenant (always the default one here), then
        # the session's cache_salt. SGLang's tree is partitioned by its own cache_salt, so
        # a session with one shares KV with exactly the requests (``/generate`` included)
        # that carry the same cache_salt.
        _, sep, cache_salt = salt.partition("\x00")
        return SglangSession(shared_salt=cache_salt if sep else None)

    def view(self, handle: SglangSession) -> SessionView:
        return handle.view

    def nbytes(self, handle: SglangSession) -> int:
        return 0  # the tree owns the KV; a session pins nothing (SGLang evicts it LRU)

    def close(self, handle: SglangSession) -> None:
        pass

    async def prefill(
        self, handle: SglangSession, tokens: Sequence[int], spans: Sequence[MessageSpan]
    ) -> OpReport:
        old, new = handle.view, tuple(int(t) for t in tokens)
        if new:
            await self.link.prefill(new, handle.salt)
        shared = common_prefix(old.tokens, new)
        revision = old.revision if new == old.tokens else old.revision + 1
        handle.view = SessionView(new, revision, tuple(spans))
        # Nothing reused (a fresh session) is a prefill, not a hit.
        path = Path.prefix_hit if shared == len(old.tokens) and shared > 0 else Path.reprefill
        return OpReport(path, revision, shared, len(new) - shared, first_change=shared)

    async def execute(
        self, handle: SglangSession, plan: EditPlan, *, allow_fallback: bool
    ) -> OpReport:
        base = handle.view
        if plan.is_identity:
            n = len(base.tokens)
            return OpReport(Path.splice, base.revision, n, 0, first_change=n)
        result = plan.result
        forget_from = plan.forget_from
        if forget_from is not None:
            # Everything from the forget on is prefilled by the next generate: a block
            # there is computed in full (protocol 3.4), so nothing needs a namespace.
            out = await self._forget(handle, plan)
            report = self._report(plan, Path.reprefill, min(out.cached_tokens, forget_from), 0)
        elif plan.composes:
            report = await self._compose(handle, plan, allow_fallback)
        elif result.first_change == len(base.tokens):
            # Errata only: nothing cached moves; the next generate appends the note.
            report = self._report(plan, Path.prefix_hit, len(base.tokens), 0)
        else:
            report = await self._splice(plan, allow_fallback, (), handle.salt, handle.salt)
        handle.view = SessionView(plan.tokens, base.revision + 1, plan.spans)
        return report

    async def _compose(
        self, handle: SglangSession, plan: EditPlan, allow_fallback: bool
    ) -> OpReport:
        """A splice whose blocks are copied from their skills, built in the session's own
        namespace (a composed sequence must never match another request's tokens)."""
        tenant = plan.tenant or DEFAULT_TENANT
        with self.skills.using(tenant, [c.skill for c in plan.composes]) as skills:
            blocks = _blocks(plan, skills)
            salt = handle.private_salt or _private_salt()
            report = await self._splice(plan, allow_fallback, blocks, handle.salt, salt)
        # A fallback may leave part of a build in ``salt``'s namespace; the generate that
        # re-prefills must not find it, so the session moves to a namespace of its own.
        if handle.private_salt is None:
            handle.shared_tokens = handle.view.tokens
        handle.private_salt = salt if report.path is Path.splice else _private_salt()
        return report

    async def _forget(self, handle: SglangSession, plan: EditPlan) -> SchedulerAnswer:
        """Purge what was derived from the forgotten span where the session's KV is, and,
        once it has composed, where it was before (its shared namespace still caches the
        revisions before the first compose)."""
        base = handle.view
        out = checked(await self.link.send("forget", base.tokens, plan.edits, old_salt=handle.salt))
        if handle.private_salt is not None:
            # Positions there are the tokens' before the first compose: purge from where
            # the revisions part (or from the forget, if earlier), which covers wherever
            # the forgotten tokens sat.
            shared = handle.shared_tokens
            start = plan.forget_from
            assert start is not None
            cut = min(start, common_prefix(shared, base.tokens))
            edit = Edit(cut, cut, ())
            checked(await self.link.send("forget", shared, [edit], old_salt=handle.shared_salt))
        return out

    async def _splice(
        self,
        plan: EditPlan,
        allow_fallback: bool,
        blocks: Sequence[BlockSource],
        old_salt: str | None,
        new_salt: str | None,
    ) -> OpReport:
        # Each inserted run may need one generate; a repeat of the same request means the
        # prefill did not land in the tree, and the splice gives up rather than loop.
        asked: set[int] = set()
        while True:
            out = checked(
                await self.link.send(
                    "splice",
                    plan.base.tokens,
                    plan.edits,
                    blocks=blocks,
                    old_salt=old_salt,
                    new_salt=new_salt,
                )
            )
            if out.ok and out.pending_prefill is None:
                reason = FallbackReason(out.fallback_reason) if out.fallback_reason else None
                return self._report(
                    plan, Path.splice, out.reused_tokens, out.rotated_tokens, reason
                )
            if not out.ok or out.pending_prefill in asked:
                reason = FallbackReason(out.fallback_reason or FallbackReason.unsupported_runtime)
                if not allow_fallback:
                    raise SpliceUnsupportedError(reason, out.message or "prefill did not cache")
                # The next generate re-prefills from the first change (SGLang's prefix match).
                first = plan.result.first_change
                return self._report(plan, Path.reprefill, first, 0, reason)
            assert out.pending_prefill is not None
            asked.add(out.pending_prefill)
            await self.link.prefill(plan.tokens[: out.pending_prefill], new_salt)

    @staticmethod
    def _report(
        plan: EditPlan,
        path: Path,
        reused: int,
        rotated: int,
        reason: FallbackReason | None = None,
    ) -> OpReport:
        n = len(plan.tokens)
        reused = min(reused, n)
        return OpReport(
            path,
            plan.base.revision + 1,
            reused_tokens=reused,
            prefilled_tokens=n - reused,
            rotated_tokens=rotated,
            first_change=plan.result.first_change,
            fallback_reason=reason,
        )


def _private_salt() -> str:
    return f"leyline-session-{uuid.uuid4().hex}"


def _blocks(plan: EditPlan, skills: Sequence[HeldSkill]) -> list[BlockSource]:
    """Each compose's block in the new revision, with its skill's cached source (a skill
    replaced since the batch was planned no longer matches its block: the executor refuses
    that, changing nothing)."""
    return [
        BlockSource(
            start=where.start,
            end=where.end,
            source=skill.source,
            offset=len(skill.anchor),
            seam=min(compose.seam_tokens, len(skill.tokens)),
        )
        for compose, where, skill in zip(plan.composes, plan.composed(), skills, strict=True)
    ]


def checked(out: SchedulerAnswer) -> SchedulerAnswer:
    if out.error_code is not None:
        raise LeylineError(ErrorCode(out.error_code), out.message, out.error_field)
    return out
