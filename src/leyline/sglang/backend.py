"""SGLang as a backend (``core.backend.Backend``): plans executed in the scheduler over a link.

A session here is only its protocol state: the KV lives in SGLang's radix tree, keyed by
tokens, and a generate with the session's tokens hits it. A plan's edits go to the scheduler
(``scheduler_side``), which splices the tree's KV or purges it (FORGET). KV that is not the
exact prefill of its tokens (kept past a splice, a composed block) is built in a namespace
(``cache_salt``) of the session's own (protocol 3.1, 3.4). Imports neither torch nor SGLang.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection, Coroutine, Sequence
from dataclasses import replace
from typing import Any

from leyline.core.backend import SERVED_VERBS, SkillRegistration
from leyline.core.batch import EditPlan, SessionView, common_prefix
from leyline.core.errors import SpliceUnsupportedError
from leyline.core.host_backend import HostBackend, edit_report, private_namespaces
from leyline.core.report import OpReport
from leyline.core.salted_session import (
    SaltedSession,
    keeps_downstream_kv,
    new_private_salt,
    private_namespace,
)
from leyline.core.sessions import DEFAULT_TENANT, tenant_namespace
from leyline.core.turns import Cancelled, GenerationResult, Outcome, Turn
from leyline.protocol import (
    PROTOCOL_VERSION,
    Capabilities,
    FallbackReason,
    Limits,
    Path,
)
from leyline.protocol.algebra import Edit
from leyline.protocol.directives import Mode
from leyline.protocol.resolve import SkillTokens
from leyline.protocol.resources import SkillInfo
from leyline.sglang.link import (
    BlockSource,
    Generator,
    SchedulerAnswer,
    SchedulerLink,
    SchedulerOrder,
    checked,
)
from leyline.sglang.skill_store import HeldSkill, SkillHolds

logger = logging.getLogger(__name__)

#: The cache layouts the scheduler side can rotate (``kv_rows``).
LAYOUTS = ("mla", "gqa")


class SglangBackend(HostBackend[SaltedSession]):
    """``Backend[SaltedSession]`` over one SGLang server's scheduler (``link``); a turn's
    generation is an ordinary SGLang generate (``generator``)."""

    def __init__(
        self,
        link: SchedulerLink,
        tokenizer: Any | None,
        *,
        limits: Limits,
        vocab_size: int,
        model_name: str = "",
        tenant_secret: bytes | None = None,
        generator: Generator | None = None,
        stop_token_ids: Collection[int] = (),
    ) -> None:
        missing = (
            "this SGLang server runs without a tokenizer (--skip-tokenizer-init): send "
            "token ids instead of text or messages"
        )
        super().__init__(
            tokenizer,
            limits=limits,
            vocab_size=vocab_size,
            model_name=model_name,
            stop_token_ids=stop_token_ids,
            missing_tokenizer=missing,
        )
        self.link = link
        self.generator = generator
        self._tenant_secret = tenant_secret
        self.skills = SkillHolds(link, model_name or "sglang", self.namespace_of)
        self._tasks: set[asyncio.Task[None]] = set()

    def capabilities(self) -> Capabilities:
        return Capabilities(
            protocol_version=PROTOCOL_VERSION,
            verbs=list(SERVED_VERBS),
            architectures=list(LAYOUTS),
            models=[self.model_name] if self.model_name else [],
            limits=self._limits,
            # Tenants only with API keys (``tenant_keys``); the tree is partitioned by
            # SGLang's own ``cache_salt`` either way (``namespace_of``).
            tenants=self._tenant_secret is not None,
            cache_salt=True,
            require_session=True,  # honoured by the session core (``session_for_turn``)
            # The block's keys are the tree's prefill after its anchor, rotated like any
            # kept run; selective recompute is not built here (``none`` only).
            skill_anchors=True,
        )

    # -- skills: the tree's own prefill of each, locked while registered (skill_store) --

    def skill_tokens(self, tenant: str) -> SkillTokens | None:
        return self.skills.tokens_of(tenant)

    async def register_skill(self, skill: SkillRegistration) -> SkillInfo:
        held = await self.skills.register(skill)
        return held.info(include_tokens=False)

    def skill_info(self, tenant: str, skill_id: str, include_tokens: bool) -> SkillInfo:
        return self.skills.get(tenant, skill_id).info(include_tokens)

    def list_skills(self, tenant: str) -> list[SkillInfo]:
        return [s.info(include_tokens=False) for s in self.skills.of_tenant(tenant)]

    async def delete_skill(self, tenant: str, skill_id: str) -> None:
        await self.skills.delete(tenant, skill_id)

    # -- handles ------------------------------------------------------------------------

    def namespace_of(self, tenant: str, cache_salt: str | None = None) -> str | None:
        """The tree namespace a tenant's exact KV shares (of its ``cache_salt``, if any).

        Without tenants: SGLang's own ``cache_salt`` as given, so a session shares KV with
        exactly the requests (``/generate`` included) that carry the same salt; none, the
        public namespace. With tenants: a name derived from the tenant and the salt with
        this process's secret, so no other tenant and no plain request can name it.
        """
        if self._tenant_secret is None:
            return cache_salt
        return tenant_namespace(self._tenant_secret, tenant, cache_salt)

    def open(self, salt: str) -> SaltedSession:
        # ``salt`` is the core's partition: the tenant, then the session's cache_salt.
        tenant, sep, cache_salt = salt.partition("\x00")
        return SaltedSession(shared_salt=self.namespace_of(tenant, cache_salt if sep else None))

    def close(self, handle: SaltedSession) -> None:
        # The session's own namespaces hold KV nobody else may read: free it now rather
        # than leave it to the tree's LRU (a deleted session lets go of what it held).
        private = private_namespaces(handle)
        if private:
            self._background(self._purge(private))

    async def _purge(self, namespaces: Sequence[tuple[str, tuple[int, ...]]]) -> None:
        """Drop each namespace's KV from its first page on (a FORGET at 0 there)."""
        for salt, tokens in namespaces:
            try:
                await self.link.send(
                    SchedulerOrder("forget", tokens, [Edit(0, 0, ())], old_salt=salt)
                )
            except Exception:  # the session is gone either way; the tree's LRU takes it
                logger.exception("purging a closed session's namespace %s failed", salt)

    def _background(self, work: Coroutine[Any, Any, None]) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # closed outside the server's loop (a test): nothing to purge
            work.close()
            return
        task = loop.create_task(work)
        self._tasks.add(task)  # a task nobody references may be collected mid-run
        task.add_done_callback(self._tasks.discard)

    async def cache_prompt(self, handle: SaltedSession, tokens: tuple[int, ...]) -> None:
        if tokens:
            await self.link.prefill(tokens, handle.salt)

    async def execute(
        self, handle: SaltedSession, plan: EditPlan, *, allow_fallback: bool
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
            report = edit_report(plan, Path.reprefill, min(out.cached_tokens, forget_from), 0)
            if keeps_downstream_kv(plan) and not plan.composes:
                # Rule 6 of a batch: a splice before the forget keeps its downstream KV up
                # to the forget, and that KV is the session's own. The build prefills the
                # rest in context.
                built = await self._private_build(handle, plan, allow_fallback, ())
                if built.path is Path.splice:
                    reused, rotated = built.reused_tokens, built.rotated_tokens
                    report = edit_report(plan, Path.reprefill, reused, rotated)
                else:
                    report = built
            elif plan.tokens:
                # Re-prefill now, as the reference does: the session's KV is whole after the
                # directive, so a later edit finds its source without a turn in between.
                await self.link.prefill(plan.tokens, handle.salt)
        elif plan.composes:
            tenant = plan.tenant or DEFAULT_TENANT
            with self.skills.using(tenant, [c.skill for c in plan.composes]) as skills:
                report = await self._private_build(
                    handle, plan, allow_fallback, _blocks(plan, skills)
                )
        elif result.first_change == len(base.tokens):
            # Errata only: nothing cached moves; the next generate appends the note.
            report = edit_report(plan, Path.prefix_hit, len(base.tokens), 0)
        elif keeps_downstream_kv(plan):
            report = await self._private_build(handle, plan, allow_fallback, ())
        else:
            # Nothing kept past the edit (a cut of the tail, say): every token from the first
            # change on is computed in context, so the build is exact and stays shared.
            report = await self._splice(plan, allow_fallback, (), handle.salt, handle.salt)
        handle.moved(result.position_map)
        handle.cached(plan.tokens)  # built, or prefilled by the next generate: as good as
        handle.view = SessionView(plan.tokens, base.revision + 1, plan.spans)
        return report

    async def run_turn(self, turn: Turn[SaltedSession]) -> Outcome:
        """The plan through ``execute``, then an ordinary generate of the prompt: SGLang's
        prefix match finds the spliced KV, so only what is new is prefilled. The session
        then holds the prompt and the generated ids, as on the reference server."""
        if turn.cancelled():
            raise Cancelled
        if self.generator is None:
            raise RuntimeError("this SglangBackend has no generator: it runs no turns")
        t0 = time.perf_counter()
        handle = turn.handle
        edit = None
        if turn.plan is not None:
            edit = await self.execute(handle, turn.plan, allow_fallback=turn.allow_fallback)
        edited = handle.view
        spans = turn.prompt_spans(edited)
        prompt = turn.prompt
        if prompt[: len(edited.tokens)] != edited.tokens:
            handle.realigned(edited.tokens, prompt)  # the tree keeps what it had cached
        revision = edited.revision if prompt == edited.tokens else edited.revision + 1
        # The prompt is the session's from here (the generate caches it), even if the
        # generation then fails: the view never claims tokens SGLang was not given.
        handle.view = SessionView(prompt, revision, spans)
        out = await self.generator.generate(prompt, turn.params, turn.on_token, handle.salt)
        reused = min(out.cached_tokens, len(prompt))
        shared = common_prefix(edited.tokens, prompt)
        path = Path.prefix_hit if shared == len(edited.tokens) else Path.reprefill
        prefill = OpReport(path, revision, reused, len(prompt) - reused, first_change=shared)
        handle.view = SessionView(prompt + out.ids, revision + 1, spans)
        handle.cached(prompt + out.ids[:-1])  # SGLang never computes the last id's KV
        seconds = time.perf_counter() - t0
        generation = GenerationResult(
            out.ids, out.text, out.finish_reason, revision + 1, prefill, seconds, out.logprobs
        )
        return Outcome(edit, prefill, edited.tokens, spans, generation)

    async def _private_build(
        self,
        handle: SaltedSession,
        plan: EditPlan,
        allow_fallback: bool,
        blocks: Sequence[BlockSource],
    ) -> OpReport:
        """A splice (its blocks copied from their skills, if any) whose KV past the first
        change is not a prefill of its tokens: built in the session's own namespace, the
        exact prefix copied there once (protocol 3.1, 3.4)."""
        salt = private_namespace(handle)
        report = await self._splice(plan, allow_fallback, blocks, handle.salt, salt)
        if report.path is Path.splice:
            handle.private_salt = salt
        elif handle.private_salt is not None:
            # A fallback may leave part of a build in the session's namespace; the generate
            # that re-prefills must not find it, so the session moves to a fresh one.
            handle.abandoned.append((handle.private_salt, plan.tokens))
            handle.private_salt = new_private_salt()
        else:
            handle.abandoned.append((salt, plan.tokens))  # a partial build nobody will read
        return report

    async def _forget(self, handle: SaltedSession, plan: EditPlan) -> SchedulerAnswer:
        """Purge what was derived from the forgotten tokens: past the edit where the
        session's KV is; once it went private, in its shared namespace too (anyone there,
        a plain request say, may have prefilled the same tokens); and in every earlier
        lineage, from where the forgotten tokens sit in it (protocol 3.2)."""
        base = handle.view
        forget = SchedulerOrder("forget", base.tokens, plan.edits, old_salt=handle.salt)
        out = checked(await self.link.send(forget))
        if handle.private_salt is not None:
            checked(await self.link.send(replace(forget, old_salt=handle.shared_salt)))
        spans = [(e.start, e.end) for e in plan.edits if e.mode is Mode.forget]
        for salt, lineages in handle.lineages.items():
            for tokens, first in lineages.forgotten(spans):
                if salt == handle.salt and tokens == base.tokens:
                    continue  # the current sequence: purged just above, from the same point
                edit = Edit(first, first, ())
                # A private lineage's tokens may have been prefilled by anyone in the shared
                # namespace (a plain request for them): that copy holds the span too.
                for where in dict.fromkeys((salt, handle.shared_salt)):
                    checked(
                        await self.link.send(
                            SchedulerOrder("forget", tokens, [edit], old_salt=where)
                        )
                    )
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
        rotated = 0  # each call builds past what the earlier ones did: their counts add up
        order = SchedulerOrder("splice", plan.base.tokens, plan.edits, blocks, old_salt, new_salt)
        while True:
            out = checked(await self.link.send(order))
            rotated += out.rotated_tokens
            if out.ok and out.pending_prefill is None:
                reason = FallbackReason(out.fallback_reason) if out.fallback_reason else None
                return edit_report(plan, Path.splice, out.reused_tokens, rotated, reason)
            if not out.ok or out.pending_prefill in asked:
                reason = FallbackReason(out.fallback_reason or FallbackReason.unsupported_runtime)
                if not allow_fallback:
                    raise SpliceUnsupportedError(reason, out.message or "prefill did not cache")
                # The next generate re-prefills from the first change (SGLang's prefix match).
                first = plan.result.first_change
                return edit_report(plan, Path.reprefill, first, 0, reason)
            assert out.pending_prefill is not None
            asked.add(out.pending_prefill)
            await self.link.prefill(plan.tokens[: out.pending_prefill], new_salt)


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
            salt=skill.salt,
        )
        for compose, where, skill in zip(plan.composes, plan.composed(), skills, strict=True)
    ]
