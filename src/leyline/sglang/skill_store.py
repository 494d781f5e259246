"""Skills on SGLang: a block's KV is the tree's own prefill of it, locked while registered.

Registering a skill runs an ordinary generate of its tokens (after its anchor, when it has
one) in its tenant's namespace (the public one without tenants), so the radix tree caches
exactly a prefill of them from
position 0, then asks the scheduler to lock that path under the skill's name (``hold``):
a locked path is never evicted, so COMPOSE can copy the block's KV from those slots for as
long as the skill is registered. Deleting or replacing the skill lets the lock go (the
tree then evicts the tokens LRU, as any cached prefix).

The scheduler holds at most a quarter of its KV pool for skills (``scheduler_side``); past
that a registration evicts the least recently used skills no running compose holds, as the
reference server's byte budget does, and is refused with ``limit_exceeded``, evicting
nothing, when even evicting all of them leaves no room. Imports neither torch nor SGLang.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from leyline.core.backend import SkillRegistration
from leyline.core.skill_table import HeldSkill as TableSkill
from leyline.core.skill_table import SkillTable
from leyline.sglang.link import SchedulerLink, SchedulerOrder, checked


@dataclass
class HeldSkill(TableSkill):
    """A registered skill: its tokens, and how many of them the tree holds locked."""

    held: int = 0
    """Tokens of ``source`` the tree holds locked (whole pages; 0: none, every compose then
    prefills the block in context)."""
    salt: str | None = None
    """Where the tree caches it: its tenant's namespace (None: the public one)."""

    @property
    def hold_key(self) -> str:
        return json.dumps([self.tenant, self.id])


class SkillHolds(SkillTable[HeldSkill]):
    """The skill table (``core.skill_table``) whose skills SGLang's radix tree locks."""

    def __init__(
        self,
        link: SchedulerLink,
        model: str,
        namespace_of: Callable[[str], str | None] = lambda tenant: None,
    ) -> None:
        super().__init__(model, namespace_of)
        self.link = link

    async def register(self, request: SkillRegistration) -> HeldSkill:
        """Prefill and hold ``anchor + tokens`` as the skill; the same content again
        computes nothing. Raises ``limit_exceeded`` when the scheduler cannot hold it even
        with every idle skill evicted (the tokens then stay as ordinary cache)."""
        new = self.content(request)
        async with self.writing:
            if (same := self.unchanged(request, new)) is not None:
                return same
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
            await self.link.prefill(skill.source, skill.salt)
            skill.held = await self._hold(skill)
            return self.put(skill)  # replaces: the hold key is the same

    async def _hold(self, skill: HeldSkill) -> int:
        """Hold ``skill``; the scheduler may release idle skills, least recently used
        first, to make room (they are then gone), or refuse with nothing changed."""
        idle = [s.hold_key for k, s in self.entries.items()
                if not s.users and k != (skill.tenant, skill.id)]  # fmt: skip
        order = SchedulerOrder(
            "hold", skill.source, key=skill.hold_key, evictable=idle, old_salt=skill.salt
        )
        answer = checked(await self.link.send(order))
        gone = set(answer.released)
        self.drop(lambda s: s.hold_key in gone)
        return answer.cached_tokens

    async def delete(self, tenant: str, skill_id: str) -> None:
        """Raises ``unknown_skill``, or ``invalid_directive`` while a compose reads it."""
        async with self.writing:
            skill = self.removable(tenant, skill_id)
            checked(await self.link.send(SchedulerOrder("release", key=skill.hold_key)))
            del self.entries[(tenant, skill_id)]
