"""The skill table a GPU backend keeps beside the blocks its engine holds for skills.

SGLang (``sglang.skill_store``) and vLLM (``vllm.skills``) hold a skill's KV in their own
caches and differ only in how they prefill, hold and release it; which skills exist, who owns
them, which are in use and which were used least recently is kept here, once. The reference
engine's store (``engine.edits.skills``) keeps the KV itself and shares only the errors.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from leyline.core.backend import SkillLabel, SkillRegistration, describe_skill
from leyline.protocol import ErrorCode, LeylineError
from leyline.protocol.resolve import SkillTokens
from leyline.protocol.resources import SkillInfo, skill_content_hash

__all__ = ["HeldSkill", "SkillTable", "skill_in_use", "unknown_skill"]


@dataclass
class HeldSkill:
    """A registered skill whose KV the engine's cache holds: its tokens and its use."""

    id: str
    tenant: str
    tokens: tuple[int, ...]
    anchor: tuple[int, ...]
    model: str
    content_hash: str
    label: SkillLabel = field(default_factory=SkillLabel)
    users: int = 0
    """Running composes that read it: it is then neither deleted, replaced nor evicted."""

    @property
    def source(self) -> tuple[int, ...]:
        """What the engine prefilled for it: the anchor, then the block."""
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


def skill_in_use(skill_id: str, users: int) -> LeylineError:
    return LeylineError(
        ErrorCode.invalid_directive,
        f"skill {skill_id!r} is in use by {users} running compose(s); retry",
        "skill",
    )


SkillT = TypeVar("SkillT", bound=HeldSkill)


@dataclass(frozen=True, slots=True)
class NewSkill:
    """A registration's content, as the table keys and compares it."""

    block: tuple[int, ...]
    anchor: tuple[int, ...]
    content_hash: str


class SkillTable(Generic[SkillT]):
    """Skills keyed by (tenant, id), least recently used first; one event loop's.

    Subclasses prefill and hold a new skill's tokens in ``register`` and let them go in
    ``delete``, both under :attr:`writing` (registrations and deletes, one at a time).
    """

    def __init__(self, model: str, namespace_of: Callable[[str], str | None]) -> None:
        self.model = model
        self.namespace_of = namespace_of
        """A tenant's namespace: a skill is KV of that tenant's, never shared across."""
        self.entries: OrderedDict[tuple[str, str], SkillT] = OrderedDict()
        self.writing = asyncio.Lock()

    def get(self, tenant: str, skill_id: str) -> SkillT:
        """The skill (counts as a use). Raises ``LeylineError(unknown_skill)``."""
        skill = self.entries.get((tenant, skill_id))
        if skill is None:
            raise unknown_skill(tenant, skill_id)
        self.entries.move_to_end((tenant, skill_id))
        return skill

    def of_tenant(self, tenant: str) -> list[SkillT]:
        return [s for (t, _), s in self.entries.items() if t == tenant]

    def tokens_of(self, tenant: str) -> SkillTokens:
        def tokens(skill_id: str) -> Sequence[int] | None:
            skill = self.entries.get((tenant, skill_id))
            return None if skill is None else skill.tokens

        return tokens

    def content(self, request: SkillRegistration) -> NewSkill:
        block, lead = tuple(int(t) for t in request.tokens), tuple(int(t) for t in request.anchor)
        return NewSkill(block, lead, skill_content_hash(self.model, block, lead))

    def unchanged(self, request: SkillRegistration, new: NewSkill) -> SkillT | None:
        """Under :attr:`writing`: the registered skill if it already has this content (its
        label updated; nothing to compute), else None. Raises ``invalid_directive`` when
        the skill would be replaced while a compose reads it."""
        key = (request.tenant, request.skill_id)
        existing = self.entries.get(key)
        if existing is None:
            return None
        if existing.content_hash == new.content_hash:
            existing.label = request.label
            self.entries.move_to_end(key)
            return existing
        if existing.users:
            raise skill_in_use(existing.id, existing.users)
        return None

    def put(self, skill: SkillT) -> SkillT:
        """``skill`` registered (replacing its id's), the most recently used."""
        key = (skill.tenant, skill.id)
        self.entries[key] = skill
        self.entries.move_to_end(key)
        return skill

    def removable(self, tenant: str, skill_id: str) -> SkillT:
        """Under :attr:`writing`: the skill to delete. Raises ``unknown_skill``, or
        ``invalid_directive`` while a compose reads it."""
        skill = self.get(tenant, skill_id)
        if skill.users:
            raise skill_in_use(skill.id, skill.users)
        return skill

    def drop(self, gone: Callable[[SkillT], bool]) -> None:
        """Skills the engine released (to make room) leave the table."""
        for key in [k for k, s in self.entries.items() if gone(s)]:
            del self.entries[key]

    @contextmanager
    def using(self, tenant: str, skill_ids: Sequence[str]) -> Iterator[list[SkillT]]:
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
