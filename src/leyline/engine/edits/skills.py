"""Skills: token blocks (a policy, a tool spec, a passage) whose KV is computed once.

A skill's KV is the engine's prefill of its tokens from position 0 with nothing before it;
COMPOSE (``compose``) later copies it into any session at any position, rotating the keys'
rope band there, so the block is never prefilled again. :class:`SkillStore` keeps them per
tenant under a byte budget. docs/engine.md ("Compose") has the definition.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from leyline.core.skill_table import unknown_skill
from leyline.engine.forward import kv_length
from leyline.engine.kv.kv_blocks import KVCache, kv_nbytes, slice_block
from leyline.engine.rope import delta_rotate
from leyline.protocol.errors import ErrorCode, LeylineError
from leyline.protocol.resources import skill_content_hash

if TYPE_CHECKING:
    from leyline.engine.engine import Engine

SkillKey = tuple[str, str]
"""(tenant, skill id)."""


@dataclass(frozen=True, slots=True)
class Skill:
    """A token block and its KV, computed from position 0 with nothing before it."""

    id: str
    tenant: str
    tokens: tuple[int, ...]
    kv: KVCache = field(compare=False, repr=False)
    model: str
    """``LoadedModel.label`` of the engine that computed ``kv``."""
    content_hash: str
    """sha256 over ``model`` and ``tokens`` (and ``anchor`` when there is one): same model,
    tokens and anchor, same hash."""
    nbytes: int
    anchor: tuple[int, ...] = ()
    """The tokens the block was compiled after (their KV is not kept); () for none."""

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def key(self) -> SkillKey:
        return (self.tenant, self.id)


def compile_skill(
    engine: Engine,
    tokens: Sequence[int],
    *,
    skill_id: str,
    tenant: str,
    anchor: Sequence[int] = (),
) -> Skill:
    """Prefill ``tokens`` alone from position 0 and keep their KV as a skill.

    ``anchor``: prefill ``anchor + tokens`` instead and keep only the block's KV, its keys'
    rope band rotated by ``-len(anchor)`` so it reads as compiled from position 0 and
    COMPOSE treats both kinds alike. The anchor (say, the chat template's system header)
    lets the block see a sequence start like the one it will land in instead of being the
    start itself, where its first token would draw the attention-sink weight. The anchor
    counts toward no limit of the block but the vocabulary's.

    Raises:
        LeylineError: ``invalid_directive`` for an empty block or ids outside the
            vocabulary; ``limit_exceeded`` past the engine's ``max_skill_tokens``;
            ``unsupported_option`` for an anchor on a model whose keys cannot be rotated.
    """
    block, lead, digest = _identity(engine, tokens, anchor)
    if not block:
        raise LeylineError(ErrorCode.invalid_directive, "a skill needs at least one token")
    cap = engine.limits.max_skill_tokens
    if cap is not None and len(block) > cap:
        raise LeylineError(
            ErrorCode.limit_exceeded,
            f"the skill is {len(block)} tokens; this server takes at most {cap}",
            "tokens",
        )
    bad = [t for t in lead + block if not 0 <= t < engine.vocab_size]
    if bad:
        raise LeylineError(
            ErrorCode.invalid_directive,
            f"token ids {bad[:5]} are outside the vocabulary [0, {engine.vocab_size})",
        )
    if lead and (engine.layout is None or engine.rope is None):
        raise LeylineError(
            ErrorCode.unsupported_option,
            f"{engine.loaded.label}: an anchored skill needs rotatable keys "
            f"({engine.splice_refusal})",
            "anchor",
        )
    kv, _ = engine.forward((), lead + block)
    if lead:
        kv = _drop_anchor(engine, kv, len(lead))
    return Skill(skill_id, tenant, block, kv, engine.loaded.label, digest, kv_nbytes(kv), lead)


def _identity(
    engine: Engine, tokens: Sequence[int], anchor: Sequence[int]
) -> tuple[tuple[int, ...], tuple[int, ...], str]:
    """The block's and the anchor's token ids as ints, and the content hash they give on
    ``engine``'s model."""
    block = tuple(int(t) for t in tokens)
    lead = tuple(int(t) for t in anchor)
    return block, lead, skill_content_hash(engine.loaded.label, block, lead)


def _drop_anchor(engine: Engine, kv: KVCache, n: int) -> KVCache:
    """The KV of positions ``[n, ...)`` as if computed at ``[0, ...)``: copied out (so the
    anchor's memory is freed) and the keys' rope band rotated by ``-n``."""
    return rotate_keys(engine, slice_block(kv, n, kv_length(kv) - n, seq_dim=-2), -n)


def rotate_keys(engine: Engine, kv: KVCache, delta: int) -> KVCache:
    """``kv`` with the keys' rope band turned by ``delta`` positions (new tensors); every
    other tensor (values, MLA latents) is ``kv``'s own."""
    layout, rope = engine.layout, engine.rope
    assert layout is not None and rope is not None, engine.splice_refusal
    return tuple(
        tuple(
            delta_rotate(t, delta, rope.inv_freq, layout.pairing, offset=layout.offset)
            if slot == layout.slot
            else t
            for slot, t in enumerate(layer)
        )
        for layer in kv
    )


def check_compatible(engine: Engine, skill: Skill, template: KVCache) -> None:
    """Refuse a skill another model computed: its KV would be meaningless here.

    The label is the contract; the tensor layout (layers, shapes, dtype, device) is
    checked too, since two models can share a label (e.g. random test models).
    ``template``: any KV of ``engine`` (a session's), or ``()`` to check the label only.

    Raises:
        LeylineError: ``skill_mismatch``.
    """
    label = engine.loaded.label
    problem = None
    if skill.model != label:
        problem = f"was compiled by {skill.model!r}; this engine serves {label!r}"
    elif kv_length(skill.kv) != len(skill.tokens):
        problem = f"holds KV for {kv_length(skill.kv)} positions, not its {len(skill)} tokens"
    elif template and _layout(template) != _layout(skill.kv):
        problem = "has a KV layout (layers, shapes, dtype, device) unlike this model's"
    if problem is not None:
        raise LeylineError(
            ErrorCode.skill_mismatch,
            f"skill {skill.id!r} {problem}: register it again on this engine",
            "skill",
        )


def _layout(kv: KVCache) -> list[list[tuple[object, ...]]]:
    """Everything about a KV except its length."""
    return [[(t.shape[:-2], t.shape[-1], t.dtype, t.device) for t in layer] for layer in kv]


@dataclass
class _Entry:
    skill: Skill
    users: int = 0


class SkillStore:
    """Skills keyed by (tenant, id) within ``budget_bytes`` of KV; thread-safe.

    Tenants never see each other's skills. Eviction is least recently used (register,
    get and acquire all count as use) among skills no compose holds: ``acquire``/``release``
    (or ``using``) mark a skill in use so it is never evicted under a compose that reads it.
    """

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[SkillKey, _Entry] = OrderedDict()  # oldest use first
        self._lock = threading.Lock()

    # -- reading ---------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(e.skill.nbytes for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: SkillKey) -> bool:
        return key in self._entries

    def get(self, tenant: str, skill_id: str) -> Skill:
        """The skill (counts as a use). Raises ``LeylineError(unknown_skill)``."""
        with self._lock:
            return self._touch(tenant, skill_id).skill

    def of_tenant(self, tenant: str) -> list[Skill]:
        """``tenant``'s skills, least recently used first (reading them is no use)."""
        with self._lock:
            return [e.skill for (t, _), e in self._entries.items() if t == tenant]

    def users(self, tenant: str, skill_id: str) -> int:
        """How many running composes hold the skill (0 when unknown)."""
        entry = self._entries.get((tenant, skill_id))
        return 0 if entry is None else entry.users

    def skill_tokens(self, tenant: str) -> Callable[[str], Sequence[int] | None]:
        """Skill id -> its tokens, or None: the resolver's ``skill_tokens`` for ``tenant``."""

        def tokens(skill_id: str) -> Sequence[int] | None:
            entry = self._entries.get((tenant, skill_id))
            return None if entry is None else entry.skill.tokens

        return tokens

    # -- writing ---------------------------------------------------------------------

    def register(
        self,
        engine: Engine,
        tokens: Sequence[int],
        *,
        skill_id: str,
        tenant: str,
        anchor: Sequence[int] = (),
    ) -> Skill:
        """Compile ``tokens`` (after ``anchor``) as ``skill_id`` of ``tenant`` and store it.

        The same tokens and anchor again (under this id or another id of the tenant) reuse
        the KV already computed: nothing is prefilled and the content hash is the same.

        Raises:
            LeylineError: see :func:`compile_skill` and :meth:`put`.
        """
        block, lead, digest = _identity(engine, tokens, anchor)
        with self._lock:
            same = self._find(tenant, digest)
        if same is not None and same.id == skill_id:
            return self.put(same)
        if same is not None:
            skill = Skill(
                skill_id, tenant, block, same.kv, same.model, digest, same.nbytes, same.anchor
            )
        else:  # prefilled outside the lock: registering never blocks composes
            skill = compile_skill(engine, block, skill_id=skill_id, tenant=tenant, anchor=lead)
        return self.put(skill)

    def put(self, skill: Skill) -> Skill:
        """Store ``skill``, evicting unused skills as the budget needs; returns the stored one.

        Raises:
            LeylineError: ``limit_exceeded`` if it cannot fit even after evicting every
                unused skill; ``invalid_directive`` when replacing, under the same id,
                different content that a running compose still holds. Nothing changes then.
        """
        with self._lock:
            old = self._entries.get(skill.key)
            if old is not None and old.skill.content_hash == skill.content_hash:
                self._entries.move_to_end(skill.key)
                return old.skill
            if old is not None and old.users:
                raise LeylineError(
                    ErrorCode.invalid_directive,
                    f"skill {skill.id!r} is in use by {old.users} running compose(s); "
                    "register the new content under another id or retry when they finish",
                    "skill",
                )
            self._make_room(skill.nbytes, replacing=skill.key)
            self._entries.pop(skill.key, None)
            self._entries[skill.key] = _Entry(skill)
            return skill

    def remove(self, tenant: str, skill_id: str) -> None:
        """Forget a skill. Raises ``unknown_skill``, or ``invalid_directive`` while in use."""
        with self._lock:
            entry = self._touch(tenant, skill_id)
            if entry.users:
                raise LeylineError(
                    ErrorCode.invalid_directive,
                    f"skill {skill_id!r} is in use by {entry.users} running compose(s)",
                    "skill",
                )
            del self._entries[(tenant, skill_id)]

    # -- use by composes -------------------------------------------------------------

    def acquire(self, tenant: str, skill_id: str) -> Skill:
        """The skill, held (never evicted) until :meth:`release`. Raises ``unknown_skill``."""
        with self._lock:
            entry = self._touch(tenant, skill_id)
            entry.users += 1
            return entry.skill

    def release(self, skill: Skill) -> None:
        with self._lock:
            entry = self._entries.get(skill.key)
            if entry is None or entry.skill is not skill or entry.users == 0:
                raise ValueError(f"skill {skill.key} was not acquired")
            entry.users -= 1

    @contextmanager
    def using(self, tenant: str, skill_id: str) -> Iterator[Skill]:
        """``acquire`` for the duration of a ``with`` block."""
        skill = self.acquire(tenant, skill_id)
        try:
            yield skill
        finally:
            self.release(skill)

    # -- internals (under the lock) -------------------------------------------------

    def _touch(self, tenant: str, skill_id: str) -> _Entry:
        entry = self._entries.get((tenant, skill_id))
        if entry is None:
            raise unknown_skill(tenant, skill_id)
        self._entries.move_to_end((tenant, skill_id))
        return entry

    def _find(self, tenant: str, digest: str) -> Skill | None:
        for (owner, _), entry in self._entries.items():
            if owner == tenant and entry.skill.content_hash == digest:
                return entry.skill
        return None

    def _make_room(self, nbytes: int, *, replacing: SkillKey) -> None:
        """Evict least recently used unused skills until ``nbytes`` more fit, or raise
        (evicting nothing) when they cannot."""
        used = sum(e.skill.nbytes for k, e in self._entries.items() if k != replacing)
        victims: list[SkillKey] = []
        for key, entry in self._entries.items():  # oldest use first
            if used + nbytes <= self.budget_bytes:
                break
            if key != replacing and entry.users == 0:
                victims.append(key)
                used -= entry.skill.nbytes
        if used + nbytes > self.budget_bytes:
            raise LeylineError(
                ErrorCode.limit_exceeded,
                f"a {nbytes}-byte skill does not fit the skill store's {self.budget_bytes} "
                f"bytes next to the {used} bytes of skills in use",
                "skill",
            )
        for key in victims:
            del self._entries[key]
