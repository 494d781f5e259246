"""Skill messages as the planner sees them: a side field naming a registered skill.

Pure (no I/O): :mod:`.skills` registers skills and builds these messages; the planner looks
them up with a :data:`SkillLookup` and strips the side field before anything is sent, so a
server (Leyline or not) only ever sees an ordinary message whose content is the skill's text.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from leyline.protocol.directives import MAX_SEAM_TOKENS, Recompute

from .messages import Message

SKILL_KEY = "leyline_skill"
"""The side field of a skill message: the id of the skill its content was registered as."""


@dataclass(frozen=True, slots=True)
class SkillBlock:
    """A registered skill as a compose needs it: its id and the tokens it was registered with."""

    skill: str
    tokens: tuple[int, ...]
    """The block: what the server renders for the message, separator before it included."""
    seam_tokens: int = 4
    recompute: Recompute | None = None
    """Selective recompute past the seam the compose asks for (None: the directive's
    default, ``{"mode": "none"}``)."""

    def __post_init__(self) -> None:
        if not self.tokens:
            raise ValueError(f"skill {self.skill!r} has no tokens")
        if not 0 <= self.seam_tokens <= MAX_SEAM_TOKENS:
            raise ValueError(f"seam_tokens must be in [0, {MAX_SEAM_TOKENS}]")


SkillLookup = Callable[[Message], SkillBlock | None]
"""A skill message -> its block, or None: not a skill message, an unknown skill, or one whose
role or content no longer match what was registered (then its text is sent as is)."""


def skill_id_of(message: Message) -> str | None:
    """The skill a message names in its side field, if any."""
    value = message.get(SKILL_KEY)
    return value if isinstance(value, str) and value else None


def wire_message(message: Message) -> Message:
    """The message as it goes on the wire: without the side field (a strict server would
    reject an unknown field). Messages without one stay the caller's own objects."""
    if SKILL_KEY not in message:
        return message
    return {k: v for k, v in message.items() if k != SKILL_KEY}


def skill_blocks(messages: tuple[Message, ...], lookup: SkillLookup) -> Mapping[int, SkillBlock]:
    """Index -> block for every message that names a skill the lookup still vouches for."""
    found: dict[int, SkillBlock] = {}
    for index, message in enumerate(messages):
        if skill_id_of(message) is not None and (block := lookup(message)) is not None:
            found[index] = block
    return found
