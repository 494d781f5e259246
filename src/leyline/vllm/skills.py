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
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from leyline.core.backend import SkillRegistration
from leyline.core.skill_table import HeldSkill as TableSkill
from leyline.core.skill_table import SkillTable
from leyline.protocol import ErrorCode, LeylineError
from leyline.vllm.link import Answer, HoldOrder, Order
from leyline.vllm.runner import CARRIER, PREFILL, Runner, carrier_salt

logger = logging.getLogger(__name__)


@dataclass
class HeldSkill(TableSkill):
    """A registered skill: its tokens, where vLLM computed them and the hold's key."""

    salt: str | None = None
    """The tenant's namespace the prefill ran in (its blocks are exact KV of the tenant's)."""
    key: str = field(default_factory=lambda: f"skill-{uuid.uuid4().hex}")
    """The hold's key: new per registration, so a replaced skill's blocks are never read."""


class SkillStore(SkillTable[HeldSkill]):
    """The skill table (``core.skill_table``) whose skills vLLM's scheduler holds."""

    def __init__(
        self,
        runner: Runner,
        model: str,
        namespace_of: Callable[[str], str | None] = lambda tenant: None,
    ) -> None:
        super().__init__(model, namespace_of)
        self.runner = runner
        self._tasks: set[asyncio.Task[None]] = set()

    async def register(self, request: SkillRegistration) -> HeldSkill:
        """Prefill and hold ``anchor + tokens`` as the skill; the same content again
        computes nothing. Raises ``limit_exceeded`` when the scheduler cannot hold it even
        with every idle skill released (the tokens then stay as ordinary cache)."""
        new = self.content(request)
        async with self.writing:
            if (same := self.unchanged(request, new)) is not None:
                return same
            existing = self.entries.get((request.tenant, request.skill_id))
            skill = HeldSkill(
                request.skill_id,
                request.tenant,
                new.block,
                new.anchor,
                self.model,
                new.content_hash,
                request.label,
                salt=self.namespace_of(request.tenant),
            )
            others = [s for s in self.entries.values() if s is not existing]
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
            self.drop(lambda s: s.key in gone)
            return self.put(skill)  # the replaced hold was released with it

    async def delete(self, tenant: str, skill_id: str) -> None:
        """Raises ``unknown_skill``, or ``invalid_directive`` while a compose reads it."""
        async with self.writing:
            skill = self.removable(tenant, skill_id)
            del self.entries[(tenant, skill_id)]  # gone for composes even if the release fails
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
