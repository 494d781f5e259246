"""Skills on vLLM: a block's KV is vLLM's own prefill of it, held while registered.

Registering a skill runs one request of ``anchor + block`` in its tenant's namespace (the
public one without tenants): vLLM computes exactly a prefill of them from position 0. The
request carries a hold order (``link.HoldOrder``): when it finishes, the connector's
scheduler side keeps a reference on each of its blocks (``holds``), so they are never
evicted or reused, and a COMPOSE loads the block's rows from them by the hold's key. A
delete (or a replacement, or an idle skill evicted to make room) gives the reference back.

The scheduler holds at most a quarter of its blocks; past that a registration releases the
least recently used skills no running compose reads (sent as ``evictable``), and is
refused with ``limit_exceeded``, releasing nothing, when even all of them leave no room.
The API server keeps the table below (which tenant owns what, who reads it); the engine
core keeps the blocks. Imports neither torch nor vLLM.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from leyline.core.backend import SkillLabel, SkillRegistration, describe_skill
from leyline.protocol import ErrorCode, LeylineError
from leyline.protocol.resolve import SkillTokens
from leyline.protocol.resources import SkillInfo, skill_content_hash
from leyline.vllm.link import Answer, HoldOrder, Order
from leyline.vllm.runner import CARRIER, PREFILL, Runner, carrier_salt

logger = logging.getLogger(__name__)


@dataclass
class HeldSkill:
    """A registered skill: its tokens, where vLLM computed them and the hold's key."""

    id: str
    tenant: str
    tokens: tuple[int, ...]
    anchor: tuple[int, ...]
    model: str
    content_hash: str
    salt: str | None
    """The tenant's namespace the prefill ran in (its blocks are exact KV of the tenant's)."""
    key: str = field(default_factory=lambda: f"skill-{uuid.uuid4().hex}")
    """The hold's key: new per registration, so a replaced skill's blocks are never read."""
    label: SkillLabel = field(default_factory=SkillLabel)
    users: int = 0
    """Running composes that read it: it is then neither deleted, replaced nor evicted."""

    @property
    def source(self) -> tuple[int, ...]:
        """What vLLM computed for it: the anchor, then the block."""
        return self.anchor + self.tokens

    def info(self, include_tokens: bool) -> SkillInfo:
        return describe_skill(
            self.id,
            self.model,
            self.tokens,
            self.content_hash,
            self.anchor,
            self.label,
            include_tokens=include_tokens,
        )


def unknown_skill(tenant: str, skill_id: str) -> LeylineError:
    return LeylineError(
        ErrorCode.unknown_skill,
        f"tenant {tenant!r} has no skill named {skill_id!r}; register it first",
        "skill",
    )


def _in_use(skill: HeldSkill) -> LeylineError:
    return LeylineError(
        ErrorCode.invalid_directive,
        f"skill {skill.id!r} is in use by {skill.users} running compose(s); retry",
        "skill",
    )


class SkillStore:
    """Skills keyed by (tenant, id), least recently used first; one event loop's."""

    def __init__(
        self,
        runner: Runner,
        model: str,
        namespace_of: Callable[[str], str | None] = lambda tenant: None,
    ) -> None:
        self.runner = runner
        self.model = model
        self.namespace_of = namespace_of
        """A tenant's namespace: a skill is KV of that tenant's, never shared across."""
        self._entries: OrderedDict[tuple[str, str], HeldSkill] = OrderedDict()
        self._writing = asyncio.Lock()  # registrations and deletes, one at a time
        self._tasks: set[asyncio.Task[None]] = set()

    def get(self, tenant: str, skill_id: str) -> HeldSkill:
        """The skill (counts as a use). Raises ``LeylineError(unknown_skill)``."""
        skill = self._entries.get((tenant, skill_id))
        if skill is None:
            raise unknown_skill(tenant, skill_id)
        self._entries.move_to_end((tenant, skill_id))
        return skill

    def of_tenant(self, tenant: str) -> list[HeldSkill]:
        return [s for (t, _), s in self._entries.items() if t == tenant]

    def tokens_of(self, tenant: str) -> SkillTokens:
        def tokens(skill_id: str) -> Sequence[int] | None:
            skill = self._entries.get((tenant, skill_id))
            return None if skill is None else skill.tokens

        return tokens

    async def register(self, request: SkillRegistration) -> HeldSkill:
        """Prefill and hold ``anchor + tokens`` as the skill; the same content again
        computes nothing. Raises ``limit_exceeded`` when the scheduler cannot hold it even
        with every idle skill released (the tokens then stay as ordinary cache)."""
        tenant, skill_id = request.tenant, request.skill_id
        block, lead = tuple(int(t) for t in request.tokens), tuple(int(t) for t in request.anchor)
        digest = skill_content_hash(self.model, block, lead)
        async with self._writing:
            existing = self._entries.get((tenant, skill_id))
            if existing is not None and existing.content_hash == digest:
                existing.label = request.label
                self._entries.move_to_end((tenant, skill_id))
                return existing
            if existing is not None and existing.users:
                raise _in_use(existing)
            skill = HeldSkill(
                skill_id, tenant, block, lead, self.model, digest, self.namespace_of(tenant)
            )
            skill.label = request.label
            others = [s for s in self._entries.values() if s is not existing]
            idle = tuple(s.key for s in others if not s.users)  # least recently used first
            hold = HoldOrder(
                skill.key,
                len(skill.source),
                evictable=idle,
                replaces=None if existing is None else existing.key,
            )
            answer = await self._prefill_and_hold(skill, hold)
            if answer is None or answer.held < len(skill.source):
                code = answer.hold_error if answer is not None else None
                raise LeylineError(
                    ErrorCode(code) if code else ErrorCode.limit_exceeded,
                    answer.message if answer is not None else "the skill's blocks were not held",
                    "tokens",
                )
            gone = set(answer.released)
            for key in [k for k, s in self._entries.items() if s.key in gone]:
                del self._entries[key]
            self._entries[(tenant, skill_id)] = skill  # the replaced hold was released with it
            self._entries.move_to_end((tenant, skill_id))
            return skill

    async def delete(self, tenant: str, skill_id: str) -> None:
        """Raises ``unknown_skill``, or ``invalid_directive`` while a compose reads it."""
        async with self._writing:
            skill = self.get(tenant, skill_id)
            if skill.users:
                raise _in_use(skill)
            del self._entries[(tenant, skill_id)]  # gone for composes even if the release fails
            await self._release(skill.key)

    async def _prefill_and_hold(self, skill: HeldSkill, hold: HoldOrder) -> Answer | None:
        """The registering request, run to its end even if the caller goes away (cancelled,
        or the engine failed): its hold is then released once it has run, so no block
        stays held for a skill nobody registered."""
        run = asyncio.ensure_future(
            self.runner.run(skill.source, PREFILL, skill.salt, Order(hold=hold))
        )
        try:
            ran = await asyncio.shield(run)
        except BaseException:
            run.add_done_callback(lambda _: self._background(self._release(skill.key)))
            raise
        return ran.answer

    async def _release(self, key: str) -> None:
        try:
            await self.runner.run(CARRIER, PREFILL, carrier_salt(), Order(release=(key,)))
        except Exception:  # the engine is failing; its blocks go with it
            logger.exception("releasing skill hold %s failed", key)

    def _background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)  # a task nobody references may be collected mid-run
        task.add_done_callback(self._tasks.discard)

    @contextmanager
    def using(self, tenant: str, skill_ids: Sequence[str]) -> Iterator[list[HeldSkill]]:
        """The skills, held (never deleted, replaced or evicted) until the block exits.
        Raises ``unknown_skill`` (holding nothing)."""
        skills = [self.get(tenant, s) for s in skill_ids]
        for skill in skills:
            skill.users += 1
        try:
            yield skills
        finally:
            for skill in skills:
                skill.users -= 1
