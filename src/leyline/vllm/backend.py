"""vLLM as a backend (``core.backend.Backend``): plans executed as vLLM requests the backend
runs itself, each carrying an order (``link``) for ``LeylineConnector``.

A session is its protocol state (the handle and the namespace logic are SGLang's: shared
and private salt, lineages): the KV lives in vLLM's prefix cache, found by (salt, tokens).
A splice that keeps KV past its first change is built in the session's private namespace
(``build``): the connector loads the kept rows, keys rotated, and vLLM computes the rest.
A FORGET re-prefills, its request carrying the purge of every lineage. A COMPOSE is a build
whose block past its seam is loaded from the skill's held blocks (``skills``). Imports
neither torch nor vLLM.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from leyline.core.backend import EXECUTED_VERBS, MARKING_VERBS, SkillRegistration
from leyline.core.batch import EditPlan, SessionView, common_prefix
from leyline.core.errors import SpliceUnsupportedError
from leyline.core.host_backend import HostBackend, edit_report, private_namespaces
from leyline.core.report import OpReport
from leyline.core.salted_session import (
    SaltedSession,
    keeps_downstream_kv,
    private_namespace,
)
from leyline.core.sessions import DEFAULT_TENANT, tenant_namespace
from leyline.core.turns import Cancelled, GenerationResult, Outcome, Turn
from leyline.protocol import (
    PROTOCOL_VERSION,
    Capabilities,
    ErrorCode,
    FallbackReason,
    LeylineError,
    Limits,
    Path,
)
from leyline.protocol.directives import Mode, Verb
from leyline.protocol.resolve import SkillTokens
from leyline.protocol.resources import SkillInfo
from leyline.vllm.build import (
    Borrowed,
    old_rows_needed,
    padded,
    plan_build,
    recipe_within,
)
from leyline.vllm.deferred import DeferredRequest
from leyline.vllm.link import Order, PurgeTarget
from leyline.vllm.plan_orders import borrowed_rows, splice_kept_before_forget
from leyline.vllm.runner import CARRIER, PREFILL, Ran, Runner, carrier_salt
from leyline.vllm.skills import SkillStore

logger = logging.getLogger(__name__)

RESERVED_SALT_PREFIX = "leyline-"
"""Salts the backend mints for private namespaces and tenants' namespaces
(``core.sessions.TENANT_NAMESPACE_PREFIX``); no client may name one."""


def reserved_salt_error() -> LeylineError:
    """What a request naming a reserved ``cache_salt`` gets (a session or a plain body)."""
    return LeylineError(
        ErrorCode.invalid_directive,
        f"cache_salt values starting with {RESERVED_SALT_PREFIX!r} are reserved for "
        "the server's private namespaces",
        "cache_salt",
    )


@dataclass
class VllmSession(SaltedSession):
    computed: int = 0
    """Leading tokens of the view that vLLM computed under :attr:`salt` (its full blocks
    are the next splice's sources)."""
    recipe: Order | None = None
    """Where the rows of the sequence's last partial block that a build loaded are cached
    (vLLM caches whole blocks only): every request on the session carries it, so they are
    loaded again, never recomputed. None when every row there was computed in context."""


class VllmBackend(HostBackend[VllmSession]):
    """``Backend[VllmSession]`` over one vLLM engine (``runner``)."""

    def __init__(
        self,
        runner: Runner,
        tokenizer: Any | None,
        *,
        limits: Limits,
        vocab_size: int,
        block_size: int,
        model_name: str = "",
        stop_token_ids: Collection[int] = (),
        refusal: SpliceUnsupportedError | None = None,
        tenant_secret: bytes | None = None,
    ) -> None:
        super().__init__(
            tokenizer,
            limits=limits,
            vocab_size=vocab_size,
            model_name=model_name,
            stop_token_ids=stop_token_ids,
            missing_tokenizer="this vLLM server has no tokenizer",
        )
        self.runner = runner
        self.block_size = block_size
        self.refusal = refusal
        """Why no order can run here (no ``LeylineConnector`` configured), or None."""
        self._tenant_secret = tenant_secret
        """With API keys (``LEYLINE_API_KEYS_FILE``): each tenant's KV in namespaces named
        with this secret (``namespace_of``); None: one tenant."""
        self._tasks: set[asyncio.Task[None]] = set()
        self._rows_written = False
        """Whether a worker has loaded rows here: until then a build's last request is
        not left to a turn, so a worker that cannot write rows is found out (and the
        splice refused or re-prefilled) before a generation runs on it."""
        self.skills = SkillStore(runner, model_name or "vllm", self.namespace_of)

    def capabilities(self) -> Capabilities:
        # Without the connector nothing can hold a skill's blocks nor load them: COMPOSE
        # and the skills routes are then refused (unsupported_verb) by not being listed.
        composes = self.refusal is None
        verbs = [*EXECUTED_VERBS, *([Verb.compose] if composes else []), *MARKING_VERBS]
        return Capabilities(
            protocol_version=PROTOCOL_VERSION,
            verbs=verbs,
            architectures=[] if self.refusal is not None else ["gqa"],
            models=[self.model_name] if self.model_name else [],
            limits=self._limits,
            tenants=self._tenant_secret is not None,
            cache_salt=True,
            require_session=True,
            # The block's rows are vLLM's prefill after its anchor, rotated like any kept
            # row; selective recompute is not built (``none`` only).
            skill_anchors=composes,
        )

    # -- skills: vLLM's own prefill of each, its blocks held while registered (skills) ---

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
        """The ``cache_salt`` a tenant's exact KV is cached under (of the session's own
        ``cache_salt``, if any): as given without tenants, so a session shares KV with the
        plain requests that carry the same salt (none: vLLM's public namespace); with
        tenants, a reserved name derived with the process's secret, which no other tenant
        and no plain request can send."""
        if self._tenant_secret is None:
            return cache_salt
        return tenant_namespace(self._tenant_secret, tenant, cache_salt)

    def open(self, salt: str) -> VllmSession:
        # ``salt`` is the core's partition: the tenant, then the session's cache_salt.
        tenant, sep, cache_salt = salt.partition("\x00")
        if sep and cache_salt.startswith(RESERVED_SALT_PREFIX):
            raise reserved_salt_error()
        return VllmSession(shared_salt=self.namespace_of(tenant, cache_salt if sep else None))

    def close(self, handle: VllmSession) -> None:
        # A private namespace holds KV nobody else may read: purged now rather than left
        # to vLLM's LRU.
        private = private_namespaces(handle)
        if not private or self.refusal is not None:
            return
        order = Order(purge=tuple(PurgeTarget(salt, tokens, 0) for salt, tokens in private))
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # closed outside the server's loop (a test): nothing runs
            return
        task = loop.create_task(self._carry(order))
        self._tasks.add(task)  # a task nobody references may be collected mid-run
        task.add_done_callback(self._tasks.discard)

    async def _carry(self, order: Order) -> None:
        try:
            await self.runner.run(CARRIER, PREFILL, carrier_salt(), order)
        except Exception:  # the session is gone either way; vLLM's LRU takes the blocks
            logger.exception("purging a closed session's private namespace failed")

    async def cache_prompt(self, handle: VllmSession, tokens: tuple[int, ...]) -> None:
        if tokens:
            await self.runner.run(tokens, PREFILL, handle.salt)
        handle.computed, handle.recipe = len(tokens), None

    async def execute(
        self, handle: VllmSession, plan: EditPlan, *, allow_fallback: bool
    ) -> OpReport:
        report, _ = await self._execute(handle, plan, allow_fallback, then=None)
        return report

    async def _execute(
        self,
        handle: VllmSession,
        plan: EditPlan,
        allow_fallback: bool,
        then: tuple[int, ...] | None,
    ) -> tuple[OpReport, DeferredRequest | None]:
        """``execute``; with ``then``, the prompt of the turn that follows, a build's last
        request may be left to that turn (returned)."""
        base = handle.view
        deferred = None
        if plan.is_identity:
            n = len(base.tokens)
            return OpReport(Path.splice, base.revision, n, 0, first_change=n), None
        result = plan.result
        built: list[tuple[tuple[int, ...], int]] = []
        # Rows of the partial block before the first change that are loaded copies stay so.
        kept_recipe = recipe_within(handle.recipe, result.first_change)
        # A build's last request may be left to the turn whose prompt extends the new tokens.
        defer = then is not None and then[: len(plan.tokens)] == plan.tokens and self._rows_written
        if plan.forget_from is not None:
            # Everything from the first change on is computed afresh, in the session's
            # namespace, by the request that carries the purge (protocol 3.2, 3.4). A splice
            # before the forget would keep its downstream rows up to it (protocol 4, rule 6):
            # not built on vLLM, so that batch says it fell back, or is refused.
            fallback = splice_kept_before_forget(plan)
            if fallback is not None and not allow_fallback:
                raise SpliceUnsupportedError(
                    fallback, "vLLM re-prefills a batch with a forget from its first change"
                )
            ran = await self._forget(handle, plan, kept_recipe)
            reused = min(ran.cached_tokens, result.first_change) if plan.tokens else 0
            report = edit_report(plan, Path.reprefill, reused, 0, fallback)
            computed, recipe = len(plan.tokens), kept_recipe
        elif plan.composes and self.refusal is None:
            # The composed blocks' rows past their seams are loaded from the skills' held
            # blocks; a skill is read only by its tenant (``using`` keys by tenant), and
            # is neither deleted nor evicted while the build runs.
            tenant = plan.tenant or DEFAULT_TENANT
            with self.skills.using(tenant, [c.skill for c in plan.composes]) as skills:
                report, recipe, built, deferred = await self._private_build(
                    handle, plan, allow_fallback, defer=defer, borrowed=borrowed_rows(plan, skills)
                )
            computed = len(plan.tokens)
        elif plan.composes or (keeps_downstream_kv(plan) and self.refusal is not None):
            # Nothing can load rows here (no connector): re-prefilled exactly, or refused.
            assert self.refusal is not None
            if not allow_fallback:
                raise self.refusal
            ran = await self.runner.run(plan.tokens, PREFILL, handle.salt, kept_recipe)
            reused = min(ran.cached_tokens, result.first_change)
            report = edit_report(plan, Path.reprefill, reused, 0, self.refusal.reason)
            computed, recipe = len(plan.tokens), kept_recipe
        elif result.first_change == len(base.tokens):
            # Errata only: nothing cached moves; the next request appends the note.
            report = edit_report(plan, Path.prefix_hit, len(base.tokens), 0)
            computed, recipe = handle.computed, handle.recipe
        elif not keeps_downstream_kv(plan):
            # Nothing kept past the first change (a cut of the tail, say): computed in
            # context from there, exact, so it stays in the shared namespace.
            ran = await self.runner.run(plan.tokens, PREFILL, handle.salt, kept_recipe)
            report = edit_report(plan, Path.splice, min(ran.cached_tokens, result.first_change), 0)
            computed, recipe = len(plan.tokens), kept_recipe
        else:
            report, recipe, built, deferred = await self._private_build(
                handle, plan, allow_fallback, defer=defer
            )
            computed = len(plan.tokens)
        handle.moved(result.position_map)
        handle.cached(plan.tokens)
        for tokens, length in built:  # the build's padded prefixes: purged with the rest
            handle.cached(tokens, length)
        handle.computed, handle.recipe = computed, recipe
        handle.view = SessionView(plan.tokens, base.revision + 1, plan.spans)
        return report, deferred

    async def run_turn(self, turn: Turn[VllmSession]) -> Outcome:
        """The plan through ``execute``, then one generate of the prompt in the session's
        namespace: vLLM's prefix lookup finds the built KV, the connector loads what a
        build left in the last partial block, or the rows of the build's last request when
        the build left it to the turn. The session then holds prompt + output."""
        if turn.cancelled():
            raise Cancelled
        t0 = time.perf_counter()
        handle = turn.handle
        edit = deferred = None
        if turn.plan is not None:
            edit, deferred = await self._execute(
                handle, turn.plan, turn.allow_fallback, then=turn.prompt
            )
        edited = handle.view
        spans = turn.prompt_spans(edited)
        prompt = turn.prompt
        extends = prompt[: len(edited.tokens)] == edited.tokens
        if not extends:
            handle.realigned(edited.tokens, prompt)
        shared = common_prefix(edited.tokens, prompt)
        recipe = recipe_within(handle.recipe, shared)
        revision = edited.revision if prompt == edited.tokens else edited.revision + 1
        # The prompt is the session's from here (the request caches it), even if the
        # generation then fails: the view never claims tokens vLLM was not given.
        handle.view, handle.computed = SessionView(prompt, revision, spans), 0
        handle.recipe = recipe
        out = await self.runner.run(prompt, turn.params, handle.salt, recipe, turn.on_token)
        reused = min(out.cached_tokens, len(prompt))
        if deferred is not None:
            # The rows of the edited sequence this request computed are the edit's.
            assert edit is not None
            edit = deferred.settled(edit, out.answer)
            reused = max(reused, len(edited.tokens))
        path = Path.prefix_hit if shared == len(edited.tokens) else Path.reprefill
        # A row the recipe names whose block vLLM evicted since: computed here instead, in
        # this context, which is no longer the splice's definition; the answer says so (the
        # edit's report, when the rows were the deferred request's).
        missing = deferred is None and out.answer is not None and out.answer.fallback_reason
        prefill = OpReport(
            path,
            revision,
            reused,
            len(prompt) - reused,
            first_change=shared,
            fallback_reason=FallbackReason.missing_source if missing else None,
        )
        handle.view = SessionView(prompt + out.ids, revision + 1, spans)
        handle.computed = len(prompt) + max(len(out.ids) - 1, 0)  # the last id: no KV
        handle.cached(prompt + out.ids[:-1])
        seconds = time.perf_counter() - t0
        generation = GenerationResult(
            out.ids, out.text, out.finish_reason, revision + 1, prefill, seconds, out.logprobs
        )
        return Outcome(edit, prefill, edited.tokens, spans, generation)

    async def _private_build(
        self,
        handle: VllmSession,
        plan: EditPlan,
        allow_fallback: bool,
        *,
        defer: bool,
        borrowed: Sequence[Borrowed] = (),
    ) -> tuple[OpReport, Order | None, list[tuple[tuple[int, ...], int]], DeferredRequest | None]:
        """The new sequence built in the session's own namespace (``build``): every kept
        row loaded, keys rotated, and so are the ``borrowed`` rows of composed blocks; the
        inserted runs (seams) and the last token computed in context.
        Returns the report, the new recipe, the sequences the build cached there, and, with
        ``defer``, the build's last request left to the turn (its order is then the recipe,
        and the report counts its rows as loaded until the turn's answer says otherwise).
        A last request that reads a skill is never left to the turn: the recipe would then
        name the skill's blocks, and a session must not change when its skill is deleted."""
        n, block = len(plan.tokens), self.block_size
        base = plan.base.tokens
        old_salt, old_tokens, old_computed = handle.salt, base, handle.computed
        missing = None
        if old_rows_needed(plan.result.position_map, n, old_computed, block):
            # The old partial block, cached whole: its loaded rows from the recipe, the rest
            # computed as before (the same tokens in the same context).
            old_tokens = padded(base[:old_computed], block)
            ran = await self.runner.run(old_tokens, PREFILL, old_salt, handle.recipe)
            self._note(ran)
            handle.cached(old_tokens, old_computed)
            if ran.answer is not None and ran.answer.fallback_reason is not None:
                missing = FallbackReason.missing_source
        salt = private_namespace(handle)
        build = plan_build(
            (old_salt, old_tokens),
            old_computed,
            plan.tokens,
            plan.result.position_map,
            salt,
            block,
            borrowed,
        )
        requests, last = build.requests, None
        if defer and requests and not any(s.hold for s in requests[-1].order.load):
            requests, last = requests[:-1], requests[-1]
        answers = []
        for request in requests:
            answers.append(await self.runner.run(request.tokens, PREFILL, salt, request.order))
            self._note(answers[-1])
        refused = next(
            (ran.answer for ran in answers if ran.answer and ran.answer.fallback_reason), None
        )
        if refused is not None and refused.fallback_reason != FallbackReason.missing_source:
            # Nothing was loaded (a worker that cannot write rows): vLLM computed it all, so
            # the private namespace holds an exact prefill nobody will read.
            handle.abandoned += [(salt, request.tokens) for request in requests]
            if handle.private_salt == salt:
                handle.private_salt = None
            reason = FallbackReason(refused.fallback_reason or "unsupported_runtime")
            if not allow_fallback:
                raise SpliceUnsupportedError(reason, refused.message or "the load was refused")
            ran = await self.runner.run(plan.tokens, PREFILL, handle.salt)
            reused = min(ran.cached_tokens, plan.result.first_change)
            return edit_report(plan, Path.reprefill, reused, 0, reason), None, [], None
        handle.private_salt = salt
        # Every kept row was loaded, less those a request found missing: from its first
        # missing position on, it computed its rows (a later request loads them as they are).
        reused = build.kept_rows() - sum(
            build.kept_rows(ran.answer.missing_from, request.length)
            for request, ran in zip(requests, answers, strict=True)
            if ran.answer is not None and ran.answer.missing_from is not None
        )
        rotated = build.rotated
        if refused is not None or missing is not None:
            missing = FallbackReason.missing_source
            rotated = min(rotated, sum(ran.answer.rotated for ran in answers if ran.answer))
        report = edit_report(plan, Path.splice, reused, rotated, missing)
        built = [(r.tokens, r.length) for r in requests]
        if last is None:
            return report, build.recipe, built, None
        before = sum(ran.answer.rotated for ran in answers if ran.answer)
        return report, last.order, built, DeferredRequest(build, last, before)

    def _note(self, ran: Ran) -> None:
        if ran.answer is not None and ran.answer.reused > 0:
            self._rows_written = True

    async def _forget(
        self, handle: VllmSession, plan: EditPlan, recipe: Order | None = None
    ) -> Ran:
        """Purge what was derived from the forgotten tokens (protocol 3.2): past the edit
        where the session's KV is; once it went private, in its shared namespace too
        (anyone there may have prefilled the same tokens); in every earlier lineage, from
        where the forgotten tokens sit in it. One request carries the purge (vLLM runs it
        before its lookup) and re-prefills the new sequence."""
        if self.refusal is not None:
            raise self.refusal  # a forget that cannot purge must not claim it did
        base = handle.view
        first = plan.forget_from
        assert first is not None
        targets = [PurgeTarget(handle.salt, base.tokens, first)]
        if handle.private_salt is not None:
            targets.append(PurgeTarget(handle.shared_salt, base.tokens, first))
        spans = [(e.start, e.end) for e in plan.edits if e.mode is Mode.forget]
        for salt, lineages in handle.lineages.items():
            for tokens, at in lineages.forgotten(spans):
                for where in dict.fromkeys((salt, handle.shared_salt)):
                    target = PurgeTarget(where, tokens, at)
                    if target not in targets:
                        targets.append(target)
        order = Order(load=recipe.load if recipe else (), purge=tuple(targets))
        if not plan.tokens:
            return await self.runner.run(CARRIER, PREFILL, carrier_salt(), order)
        return await self.runner.run(plan.tokens, PREFILL, handle.salt, order)
