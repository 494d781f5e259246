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
from ..errors import SpliceUnsupportedError

if TYPE_CHECKING:
    from ..chat.render import ChatRenderer
    from ..http.openai_types import ChatMessage, ToolSpec

EXECUTED_VERBS = (Verb.splice, Verb.forget, Verb.erratum)
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


class SchedulerLink(Protocol):
    async def send(
        self, verb: str, old_tokens: Sequence[int], edits: Sequence[Edit]
    ) -> SchedulerAnswer:
        """Run ``splice`` or ``forget`` of ``edits`` on the cached ``old_tokens``."""
        ...

    async def prefill(self, tokens: Sequence[int]) -> None:
        """Run an ordinary generate over ``tokens`` so the tree caches them."""
        ...


@dataclass
class SglangSession:
    """The handle: the protocol state only (the tree holds the KV, shared by tokens)."""

    view: SessionView = field(default_factory=SessionView)


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
            # SGLang maps no API key to a tenant (the plugin adds no access layer), and its
            # radix tree is one cache for the whole server, which the plugin cannot salt
            # (``open``): a session's cache_salt is refused rather than ignored.
            tenants=False,
            cache_salt=False,
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
        out = self._renderer.render(
            list(messages), list(tools or []), add_generation_prompt=add_generation_prompt
        )
        return Rendered(out.tokens, out.spans)

    # -- skills: compose is not executed here (docs/sglang.md), so none are kept ---------

    def skill_tokens(self, tenant: str) -> SkillTokens | None:
        return None

    async def register_skill(
        self,
        tenant: str,
        skill_id: str,
        tokens: Sequence[int],
        label: SkillLabel,
        *,
        anchor: Sequence[int] = (),
    ) -> SkillInfo:
        raise _no_compose()

    def skill_info(self, tenant: str, skill_id: str, include_tokens: bool) -> SkillInfo:
        raise _no_compose()

    def list_skills(self, tenant: str) -> list[SkillInfo]:
        raise _no_compose()

    def delete_skill(self, tenant: str, skill_id: str) -> None:
        raise _no_compose()

    # -- handles ------------------------------------------------------------------------

    def open(self, salt: str) -> SglangSession:
        # SGLang's radix tree is one cache for the whole server: the plugin cannot salt it
        # (docs/sglang.md). Sessions themselves are still isolated by the core.
        return SglangSession()

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
            await self.link.prefill(new)
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
            out = _checked(await self.link.send("forget", base.tokens, plan.edits))
            report = self._report(plan, Path.reprefill, min(out.cached_tokens, forget_from), 0)
        elif result.first_change == len(base.tokens):
            # Errata only: nothing cached moves; the next generate appends the note.
            report = self._report(plan, Path.prefix_hit, len(base.tokens), 0)
        else:
            report = await self._splice(plan, allow_fallback)
        handle.view = SessionView(plan.tokens, base.revision + 1, plan.spans)
        return report

    async def _splice(self, plan: EditPlan, allow_fallback: bool) -> OpReport:
        # Each inserted run may need one generate; a repeat of the same request means the
        # prefill did not land in the tree, and the splice gives up rather than loop.
        asked: set[int] = set()
        while True:
            out = _checked(await self.link.send("splice", plan.base.tokens, plan.edits))
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
            await self.link.prefill(plan.tokens[: out.pending_prefill])

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


def _no_compose() -> LeylineError:
    return LeylineError(
        ErrorCode.unsupported_verb, "the SGLang plugin does not execute compose", "skill"
    )


def _checked(out: SchedulerAnswer) -> SchedulerAnswer:
    if out.error_code is not None:
        raise LeylineError(ErrorCode(out.error_code), out.message, out.error_field)
    return out
