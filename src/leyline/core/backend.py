"""The one interface a serving backend implements for the session core and the server.

The core owns sessions, revisions, leases, limits, tenants, planning and the routes; a
backend owns a KV cache and the model: it opens a handle per session, makes it hold tokens
(``prefill``), executes checked plans (``execute``) and runs a chat or completions turn
(``run_turn``). Implemented by ``leyline.engine.backend`` and ``leyline.sglang.backend``.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from leyline.core.batch import EditPlan, SessionView
from leyline.core.chat.render import BackendRenderer
from leyline.core.report import OpReport
from leyline.core.turns import Outcome, Turn
from leyline.protocol.capabilities import Capabilities, Limits
from leyline.protocol.directives import Verb
from leyline.protocol.resolve import SkillTokens
from leyline.protocol.resources import SkillInfo
from leyline.protocol.spans import MessageSpan

H = TypeVar("H")

EXECUTED_VERBS = (Verb.splice, Verb.forget, Verb.erratum)
"""The edits a backend's ``execute`` runs (COMPOSE too, where it keeps skills)."""
MARKING_VERBS = (Verb.pin, Verb.unpin, Verb.decay, Verb.scratch)
"""Executed by the core for any backend: a backend only ever executes the drops' edits."""
SERVED_VERBS = (*EXECUTED_VERBS, Verb.compose, *MARKING_VERBS)
"""What both backends' capabilities list."""


@dataclass(frozen=True, slots=True)
class SkillLabel:
    """What people call a skill (``SkillCreate.name`` / ``description``)."""

    name: str | None = None
    description: str | None = None


@dataclass(frozen=True, slots=True)
class SkillRegistration:
    """A skill to register: its owner, id, block tokens, the tokens it is compiled after
    (``anchor``) and its label; the core checks it before a backend sees it."""

    tenant: str
    skill_id: str
    tokens: tuple[int, ...]
    anchor: tuple[int, ...] = ()
    label: SkillLabel = SkillLabel()


def describe_skill(
    skill_id: str,
    model: str,
    tokens: Sequence[int],
    content_hash: str,
    anchor: Sequence[int],
    label: SkillLabel,
    *,
    include_tokens: bool,
) -> SkillInfo:
    """A registered skill as the skills routes answer it (both backends)."""
    return SkillInfo(
        skill=skill_id,
        model=model,
        num_tokens=len(tokens),
        content_hash=content_hash,
        anchor_tokens=len(anchor),
        name=label.name,
        description=label.description,
        tokens=list(tokens) if include_tokens else None,
        anchor=list(anchor) if include_tokens and anchor else None,
    )


class Backend(Protocol[H]):
    """A KV cache the core drives. ``H`` is the backend's per-session handle.

    Handles are only touched by one request at a time (the core leases them), so a backend
    needs no per-session locking of its own. ``prefill`` and ``execute`` must be
    all-or-nothing: when they raise, ``view(handle)`` is as before.
    """

    @property
    def limits(self) -> Limits: ...

    @property
    def vocab_size(self) -> int: ...

    def capabilities(self) -> Capabilities: ...

    def encode(self, text: str) -> tuple[int, ...]:
        """Text to token ids, no special tokens (raises ``LeylineError`` without a tokenizer)."""
        ...

    def decode(self, tokens: Sequence[int]) -> str: ...

    @property
    def tokenizer(self) -> Any | None:
        """The HF tokenizer (token bytes in logprobs), or None (token ids only)."""
        ...

    @property
    def stop_token_ids(self) -> Collection[int]:
        """Ids that end a generation and are not shown as text."""
        ...

    @property
    def renderer(self) -> BackendRenderer:
        """Messages through the model's chat template, with each message's token span."""
        ...

    def open(self, salt: str) -> H:
        """A new, empty session handle (nothing cached yet). ``salt`` names the partition of
        any cache the backend shares between sessions (the tenant's): nothing is shared
        across salts."""
        ...

    def view(self, handle: H) -> SessionView: ...

    def nbytes(self, handle: H) -> int:
        """Bytes of KV the handle keeps alive on its own (for the eviction budget)."""
        ...

    def close(self, handle: H) -> None:
        """Let go of everything the handle holds (delete or eviction)."""
        ...

    async def prefill(
        self, handle: H, tokens: Sequence[int], spans: Sequence[MessageSpan]
    ) -> OpReport:
        """Make the handle hold ``tokens`` (reusing what it can) with these message spans."""
        ...

    async def execute(self, handle: H, plan: EditPlan, *, allow_fallback: bool) -> OpReport:
        """Run a checked plan; the handle then holds ``plan.tokens`` at revision + 1 with
        ``plan.spans``. Raises ``SpliceUnsupportedError`` when a splice cannot run exactly
        and ``allow_fallback`` is false. A plan's composes name ``plan.tenant``'s skills."""
        ...

    async def run_turn(self, turn: Turn[H]) -> Outcome:
        """Execute the turn's plan, bring the cache to its prompt, generate; raise
        ``Cancelled`` if the client left before the model work started (then nothing
        changed)."""
        ...

    # -- skills (COMPOSE); a backend without ``compose`` in its verbs is never asked ------

    def skill_tokens(self, tenant: str) -> SkillTokens | None:
        """Skill id -> its tokens for ``tenant`` (the resolver's lookup), or None."""
        ...

    async def register_skill(self, skill: SkillRegistration) -> SkillInfo:
        """Compute the block's KV once (from position 0, or after ``skill.anchor`` when the
        capabilities say ``skill_anchors``) and keep it as ``skill.skill_id``."""
        ...

    def skill_info(self, tenant: str, skill_id: str, include_tokens: bool) -> SkillInfo:
        """Raises ``LeylineError(unknown_skill)``."""
        ...

    def list_skills(self, tenant: str) -> list[SkillInfo]: ...

    async def delete_skill(self, tenant: str, skill_id: str) -> None:
        """Raises ``LeylineError(unknown_skill)``."""
        ...
