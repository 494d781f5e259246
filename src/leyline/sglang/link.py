"""What the SGLang backend asks of SGLang, as protocols and plain answers (no SGLang import):
the scheduler link (splice, forget, prefill, hold) and the generator. ``tokenizer_side``
implements both over SGLang's IPC; ``tests/core`` scripts them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from leyline.core.turns import FinishReason, OnToken, SamplingParams, TokenChoice
from leyline.protocol import ErrorCode, LeylineError
from leyline.protocol.algebra import Edit


@dataclass(frozen=True, slots=True)
class SchedulerAnswer:
    """What the scheduler did with one request (the wire struct, without SGLang)."""

    ok: bool
    cached_tokens: int = 0
    reused_tokens: int = 0
    rotated_tokens: int = 0
    pending_prefill: int | None = None
    fallback_reason: str | None = None
    """A protocol fallback reason: the splice did not run (or not all of it)."""
    error_code: str | None = None
    """A protocol error code: the scheduler refused the request."""
    error_field: str | None = None
    message: str = ""
    released: tuple[str, ...] = ()
    """``hold``: the held keys released to make room."""


@dataclass(frozen=True, slots=True)
class BlockSource:
    """A composed block in the new sequence, and the cached tokens its KV is read from."""

    start: int
    end: int
    source: tuple[int, ...]
    """The skill's tokens as the tree holds them (in ``salt``): anchor, then block."""
    offset: int
    """Where the block starts in ``source`` (the anchor's length)."""
    seam: int
    """Leading block tokens prefilled in context (``min(K, n)``)."""
    salt: str | None = None
    """The namespace the skill's tokens are cached in (its tenant's; None: public)."""

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.source[self.offset :]


@dataclass(frozen=True, slots=True)
class SchedulerOrder:
    """One request to the scheduler: ``splice`` or ``forget`` of ``edits`` on the cached
    ``old_tokens`` (in the namespace ``old_salt``; a splice builds the new sequence in
    ``new_salt``'s), or ``hold`` / ``release`` of a sequence under ``key``."""

    verb: str
    old_tokens: Sequence[int] = ()
    edits: Sequence[Edit] = ()
    blocks: Sequence[BlockSource] = ()
    old_salt: str | None = None
    new_salt: str | None = None
    key: str = ""
    evictable: Sequence[str] = ()
    """``hold``: keys it may release to make room, least recently used first."""


class SchedulerLink(Protocol):
    async def send(self, order: SchedulerOrder) -> SchedulerAnswer:
        """Run one order on the scheduler (a refusal comes back in the answer: see
        :func:`checked`).

        ``hold`` locks what the tree holds of ``old_tokens`` (in ``old_salt``) under ``key``,
        replacing that key's lock, and may release keys of ``evictable`` (in order) to make
        room; the answer says how many tokens are held (``cached_tokens``) and the keys
        released. Refused with ``limit_exceeded``, changing nothing, when even releasing all
        of them leaves no room. ``release`` lets ``key``'s lock go."""
        ...

    async def prefill(self, tokens: Sequence[int], salt: str | None = None) -> None:
        """Run an ordinary generate over ``tokens`` so the tree caches them (under ``salt``)."""
        ...


def checked(out: SchedulerAnswer) -> SchedulerAnswer:
    """``out``, or its refusal raised as the protocol error it names."""
    if out.error_code is not None:
        raise LeylineError(ErrorCode(out.error_code), out.message, out.error_field)
    return out


@dataclass(frozen=True, slots=True)
class Generated:
    """One SGLang generation: ids (a final stop id included), text, and what it reused."""

    ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason
    cached_tokens: int
    """Prompt tokens SGLang's prefix match reused (``meta_info.cached_tokens``)."""
    logprobs: tuple[TokenChoice, ...] = ()


class Generator(Protocol):
    async def generate(
        self,
        tokens: Sequence[int],
        params: SamplingParams,
        on_token: OnToken,
        salt: str | None = None,
    ) -> Generated:
        """Generate after ``tokens`` in cache namespace ``salt`` (a session's own, once it
        composed); ``on_token`` per id, False stops (finish ``stop``)."""
        ...
