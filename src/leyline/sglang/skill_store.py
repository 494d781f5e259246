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

import asyncio
import json
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from leyline.core.backend import SkillLabel, SkillRegistration, describe_skill
from leyline.protocol import ErrorCode, LeylineError
from leyline.protocol.resolve import SkillTokens
from leyline.protocol.resources import SkillInfo, skill_content_hash
from leyline.sglang.link import SchedulerLink, SchedulerOrder, checked


@dataclass
class HeldSkill:
    """A registered skill: its tokens, and how many of them the tree holds locked."""

    id: str
    tenant: str
    tokens: tuple[int, ...]
    anchor: tuple[int, ...]
    model: str
    content_hash: str
    label: SkillLabel = field(default_factory=SkillLabel)
    held: int = 0
    """Tokens of ``source`` the tree holds locked (whole pages; 0: none, every compose then
    prefills the block in context)."""
    users: int = 0
    """Running composes that read it: it is then neither deleted, replaced nor evicted."""
    salt: str | None = None
    """Where the tree caches it: its tenant's namespace (None: the public one)."""

    @property
    def source(self) -> tuple[int, ...]:
        """What the tree caches for it: the anchor, then the block."""
        return self.anchor + self.tokens

    @property
    def hold_key(self) -> str:
        return json.dumps([self.tenant, self.id])

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


def _unknown(tenant: str, skill_id: str) -> LeylineError:
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


class SkillHolds:
    """Skills keyed by (tenant, id), least recently used first; one event loop's."""

    def __init__(
        self,
        link: SchedulerLink,
        model: str,
        namespace_of: Callable[[str], str | None] = lambda tenant: None,
    ) -> None:
        self.link = link
        self.model = model
        self.namespace_of = namespace_of
        """A tenant's namespace: a skill is KV of that tenant's, never shared across."""
        self._entries: OrderedDict[tuple[str, str], HeldSkill] = OrderedDict()
        self._writing = asyncio.Lock()  # registrations and deletes, one at a time

    def get(self, tenant: str, skill_id: str) -> HeldSkill:
        """The skill (counts as a use). Raises ``LeylineError(unknown_skill)``."""
        skill = self._entries.get((tenant, skill_id))
        if skill is None:
            raise _unknown(tenant, skill_id)
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
        with every idle skill evicted (the tokens then stay as ordinary cache)."""
        tenant, skill_id, label = request.tenant, request.skill_id, request.label
        block, lead = tuple(int(t) for t in request.tokens), tuple(int(t) for t in request.anchor)
        digest = skill_content_hash(self.model, block, lead)
        async with self._writing:
            existing = self._entries.get((tenant, skill_id))
            if existing is not None and existing.content_hash == digest:
                existing.label = label
                self._entries.move_to_end((tenant, skill_id))
                return existing
            if existing is not None and existing.users:
                raise _in_use(existing)
            skill = HeldSkill(skill_id, tenant, block, lead, self.model, digest, label)
            skill.salt = self.namespace_of(tenant)
            await self.link.prefill(skill.source, skill.salt)
            skill.held = await self._hold(skill)
            self._entries[(tenant, skill_id)] = skill  # replaces: the hold key is the same
            self._entries.move_to_end((tenant, skill_id))
            return skill

    async def _hold(self, skill: HeldSkill) -> int:
        """Hold ``skill``; the scheduler may release idle skills, least recently used
        first, to make room (they are then gone), or refuse with nothing changed."""
        idle = [s.hold_key for k, s in self._entries.items()
                if not s.users and k != (skill.tenant, skill.id)]  # fmt: skip
        order = SchedulerOrder(
            "hold", skill.source, key=skill.hold_key, evictable=idle, old_salt=skill.salt
        )
        answer = checked(await self.link.send(order))
        gone = set(answer.released)
        for key in [k for k, s in self._entries.items() if s.hold_key in gone]:
            del self._entries[key]
        return answer.cached_tokens

    async def delete(self, tenant: str, skill_id: str) -> None:
        """Raises ``unknown_skill``, or ``invalid_directive`` while a compose reads it."""
        async with self._writing:
            skill = self.get(tenant, skill_id)
            if skill.users:
                raise _in_use(skill)
            checked(await self.link.send(SchedulerOrder("release", key=skill.hold_key)))
            del self._entries[(tenant, skill_id)]

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
