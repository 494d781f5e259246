"""The reference engine as a backend (``core.backend.Backend``): a ``SessionCache`` per session.

All model work goes through one :class:`~.scheduler.ModelScheduler`: ``run`` queues a closure
there as a job; a turn's edit and prefill are one job, its generation the scheduler's batched
decode steps. Jobs are sliced at prefill chunks, so a short one never waits for a long one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, TypeVar

from leyline.core.backend import SERVED_VERBS, SkillLabel, SkillRegistration, describe_skill
from leyline.core.batch import EditPlan, SessionView
from leyline.core.chat.render import BackendRenderer
from leyline.core.report import OpReport
from leyline.core.sessions import DEFAULT_TENANT
from leyline.core.turns import Cancelled, GenerationResult, Outcome, Turn, TurnTiming
from leyline.engine.edits.compose import supports_attention_recompute
from leyline.engine.edits.recompute import supports_deviation
from leyline.engine.edits.skills import Skill, SkillStore
from leyline.engine.engine import Engine
from leyline.engine.scheduler import JobTiming, ModelScheduler
from leyline.engine.session import PendingGeneration, SessionCache
from leyline.engine.work_estimates import SchedulePolicy, turn_cost
from leyline.protocol import PROTOCOL_VERSION, Capabilities, Limits
from leyline.protocol.directives import RecomputeMode
from leyline.protocol.resolve import SkillTokens
from leyline.protocol.resources import SkillInfo
from leyline.protocol.spans import MessageSpan

T = TypeVar("T")


class EngineBackend:
    """``Backend[SessionCache]`` over one reference :class:`Engine`. A plan whose client has
    left by the time its model work would start runs none of it (``EditPlan.cancelled``)."""

    def __init__(
        self,
        engine: Engine,
        *,
        limits: Limits,
        model_name: str,
        tenants: bool = False,
        skill_cache_bytes: int = 1 << 30,
        max_jobs: int = 8,
        max_batch: int = 32,
        decode_share: float = 0.0,
        schedule: SchedulePolicy = "srpt",
        schedule_aging: float = 0.1,
    ) -> None:
        self.engine = engine
        self.skills = SkillStore(skill_cache_bytes)
        self._labels: dict[tuple[str, str], SkillLabel] = {}
        self.model_name = model_name
        self._limits = limits
        self._tenants = tenants  # whether the server in front maps credentials to tenants
        missing = (
            f"{engine.loaded.label} has no tokenizer or chat template; send token ids to "
            "/v1/completions"
        )
        self.renderer = BackendRenderer(engine.tokenizer, missing, eager=True)
        self.scheduler = ModelScheduler(
            engine,
            max_jobs=max_jobs,
            max_batch=max_batch,
            decode_share=decode_share,
            policy=schedule,
            aging=schedule_aging,
        )

    # -- the model scheduler ------------------------------------------------------------

    async def run(self, fn: Callable[[], T], *, exclusive: bool = False) -> T:
        """Run ``fn`` as a model job and await it (``exclusive``: alone, see ``scheduler``)."""
        return await asyncio.wrap_future(self.scheduler.submit(fn, exclusive=exclusive))

    async def run_timed(
        self, fn: Callable[[], T], *, exclusive: bool = False, cost: int | None = None
    ) -> tuple[T, JobTiming | None]:
        """``run``, and where the job's time went (queued, holding the model). ``cost``:
        tokens it runs through the model, if known (``work_estimates.turn_cost``)."""
        future = self.scheduler.submit(fn, exclusive=exclusive, cost=cost)
        result = await asyncio.wrap_future(future)
        return result, self.scheduler.timing(future)

    async def generate(self, pending: PendingGeneration) -> GenerationResult:
        """Run a begun generation in the scheduler's batched decode steps; commit it."""
        return await asyncio.wrap_future(self.scheduler.generate(pending))

    def shutdown(self) -> None:
        self.scheduler.shutdown()

    # -- what the server speaks ---------------------------------------------------------

    @property
    def limits(self) -> Limits:
        return self._limits

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    def capabilities(self) -> Capabilities:
        layouts = [] if self.engine.layout is None else [self.engine.layout.kind]
        return Capabilities(
            protocol_version=PROTOCOL_VERSION,
            verbs=list(SERVED_VERBS),
            architectures=layouts,
            models=[self.model_name],
            limits=self._limits,
            tenants=self._tenants,
            cache_salt=True,  # the prefix cache is partitioned by salt (``open``)
            require_session=True,  # honoured by the session core (``session_for_turn``)
            compose_recompute=self._recompute_modes,
            # An anchored block's keys are rotated back to position 0 (``skills``).
            skill_anchors=self.engine.layout is not None and self.engine.rope is not None,
        )

    @property
    def _recompute_modes(self) -> list[RecomputeMode]:
        # Both run the model's layers apart (``recompute``): only where they are found;
        # attention also needs the engine's attention function to see the weights.
        modes = [RecomputeMode.none]
        if supports_deviation(self.engine.model):
            modes.append(RecomputeMode.deviation)
        if supports_attention_recompute(self.engine):
            modes.append(RecomputeMode.attention)
        return modes

    def encode(self, text: str) -> tuple[int, ...]:
        return self.engine.encode(text)

    def decode(self, tokens: Sequence[int]) -> str:
        return self.engine.decode(tokens)

    @property
    def tokenizer(self) -> Any | None:
        return self.engine.tokenizer

    @property
    def stop_token_ids(self) -> Collection[int]:
        return self.engine.loaded.eos_token_ids

    # -- handles ------------------------------------------------------------------------

    def open(self, salt: str) -> SessionCache:
        return SessionCache(self.engine, salt=salt)

    def view(self, handle: SessionCache) -> SessionView:
        return handle.view

    def nbytes(self, handle: SessionCache) -> int:
        return sum(t.numel() * t.element_size() for layer in handle.kv for t in layer)

    def close(self, handle: SessionCache) -> None:
        handle.release()

    async def prefill(
        self, handle: SessionCache, tokens: Sequence[int], spans: Sequence[MessageSpan]
    ) -> OpReport:
        return await self.run(lambda: handle.prefill(tokens, spans=spans))

    async def execute(
        self, handle: SessionCache, plan: EditPlan, *, allow_fallback: bool
    ) -> OpReport:
        # A plan that purges shared blocks runs alone (``scheduler``: FORGET's order).
        return await self.run(
            lambda: self.execute_now(handle, plan, allow_fallback),
            exclusive=plan.forget_from is not None,
        )

    def execute_now(
        self,
        handle: SessionCache,
        plan: EditPlan,
        allow_fallback: bool,
        final_tokens: Sequence[int] | None = None,
    ) -> OpReport:
        """``execute`` on the calling thread (the model worker): a plan's composes get
        ``plan.tenant``'s skills, held while it runs (a skill in use is never evicted,
        replaced or deleted). ``final_tokens``: the turn's prompt, when there is one (it
        ranks a compose's ``attention`` recompute)."""
        if plan.cancelled is not None and plan.cancelled():
            raise Cancelled
        if not plan.composes:
            return handle.execute(plan, allow_fallback=allow_fallback)
        tenant = plan.tenant or DEFAULT_TENANT
        with ExitStack() as held:
            skills = {
                c.index: held.enter_context(self.skills.using(tenant, c.skill))
                for c in plan.composes
            }
            return handle.execute(
                plan, allow_fallback=allow_fallback, skills=skills, final_tokens=final_tokens
            )

    async def run_turn(self, turn: Turn[SessionCache]) -> Outcome:
        """One model job up to the first token (the session is leased, so no other request
        of it interleaves), then the decode steps; a job whose client left never starts."""

        def work() -> _Begun:
            if turn.cancelled():
                raise Cancelled  # the client left while this waited in the queue
            return self._begin(turn)

        purges = turn.plan is not None and turn.plan.forget_from is not None
        begun, timing = await self.run_timed(work, exclusive=purges, cost=_cost(turn))
        t0 = time.perf_counter()
        # The scheduler's decode steps run this generation batched with the others.
        generation = await self.generate(begun.pending)
        spent = TurnTiming(
            timing.queued if timing else 0.0,
            timing.service if timing else 0.0,
            time.perf_counter() - t0,
        )
        return Outcome(begun.edit, begun.prefill, begun.edited, begun.spans, generation, spent)

    def _begin(self, turn: Turn[SessionCache]) -> _Begun:
        """The turn up to its first token: the plan executed, the prompt prefilled, the
        generation begun (its decode steps are the scheduler's)."""
        session = turn.handle
        edit = None
        if turn.plan is not None:  # through the backend: a compose needs its skills
            edit = self.execute_now(session, turn.plan, turn.allow_fallback, turn.prompt)
        edited = session.view
        spans = turn.prompt_spans(edited)
        # Room for the reply in the new KV's buffers: the decoder writes there, no second copy.
        prefill = session.prefill(turn.prompt, spans=spans, reserve=turn.params.max_new_tokens)
        pending = session.begin_generation(turn.params, on_token=turn.on_token)
        return _Begun(edit, prefill, edited.tokens, spans, pending)

    # -- skills ---------------------------------------------------------------------------

    def skill_tokens(self, tenant: str) -> SkillTokens | None:
        return self.skills.skill_tokens(tenant)

    async def register_skill(self, skill: SkillRegistration) -> SkillInfo:
        tenant = skill.tenant
        held = await self.run(
            lambda: self.skills.register(
                self.engine,
                skill.tokens,
                skill_id=skill.skill_id,
                tenant=tenant,
                anchor=skill.anchor,
            )
        )
        # The store evicts skills on its own (LRU, under its budget): drop the labels of
        # the tenant's evicted ones, so labels are bounded by the skills held.
        kept = {s.id for s in self.skills.of_tenant(tenant)}
        for key in [k for k in self._labels if k[0] == tenant and k[1] not in kept]:
            del self._labels[key]
        self._labels[(tenant, skill.skill_id)] = skill.label
        return self._info(held, include_tokens=False)

    def skill_info(self, tenant: str, skill_id: str, include_tokens: bool) -> SkillInfo:
        return self._info(self.skills.get(tenant, skill_id), include_tokens)

    def list_skills(self, tenant: str) -> list[SkillInfo]:
        return [self._info(s, include_tokens=False) for s in self.skills.of_tenant(tenant)]

    async def delete_skill(self, tenant: str, skill_id: str) -> None:
        self.skills.remove(tenant, skill_id)
        self._labels.pop((tenant, skill_id), None)

    def _info(self, skill: Skill, include_tokens: bool) -> SkillInfo:
        label = self._labels.get((skill.tenant, skill.id), SkillLabel())
        return describe_skill(
            skill.id,
            skill.model,
            skill.tokens,
            skill.content_hash,
            skill.anchor,
            label,
            include_tokens=include_tokens,
        )


@dataclass(frozen=True, slots=True)
class _Begun:
    edit: OpReport | None
    prefill: OpReport
    edited: tuple[int, ...]
    spans: tuple[MessageSpan, ...]
    pending: PendingGeneration


def _cost(turn: Turn[SessionCache]) -> int:
    """Tokens the turn's job runs through the model (the scheduler's size estimate)."""
    plan = turn.plan
    if plan is None:
        return turn_cost(turn.handle.tokens, (), (), turn.prompt)
    return turn_cost(plan.tokens, plan.edits, plan.composes, turn.prompt)
