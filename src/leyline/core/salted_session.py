"""A session handle for backends whose cache is shared and namespaced by a salt (SGLang's
``cache_salt``, vLLM's): the protocol state, which namespace holds the session's KV, and
the rule for when that KV may no longer be shared."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from leyline.core.batch import EditPlan, SessionView
from leyline.core.lineage import Lineages
from leyline.protocol.algebra import PositionMap


@dataclass
class SaltedSession:
    """The handle: the protocol state only (the engine's cache holds the KV, shared by tokens)."""

    view: SessionView = field(default_factory=SessionView)
    shared_salt: str | None = None
    """The namespace the session shares with requests of its ``cache_salt`` (the engine's
    ``cache_salt``: keys of different salts never share cached KV); None: the public one."""
    private_salt: str | None = None
    """The session's own namespace once it holds KV that is not a prefill of its tokens
    (after a splice that kept downstream KV, or a compose): nobody else may match it."""

    lineages: dict[str | None, Lineages] = field(default_factory=dict)
    """Per namespace, the sequences the session had cached there (the tree keeps an earlier
    revision's path past each edit, and a prompt that diverged), each with where its tokens
    are now: a FORGET purges every one of them from where the forgotten tokens sit."""
    abandoned: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    """Private namespaces the session left (a fallback's partial build), with the tokens
    cached there: purged on close."""

    @property
    def salt(self) -> str | None:
        """Where the session's KV is now."""
        return self.private_salt or self.shared_salt

    def cached(self, tokens: Sequence[int], length: int | None = None) -> None:
        """``tokens`` are now cached where the session's KV is (``length``: how many of
        them are the sequence's, the rest filler; ``Lineages.published``)."""
        if tokens:
            self.lineages.setdefault(self.salt, Lineages()).published(tokens, length)

    def moved(self, position_map: PositionMap) -> None:
        """An edit ran: every lineage's positions follow it."""
        for lineages in self.lineages.values():
            lineages.moved(position_map)

    def realigned(self, old: Sequence[int], new: Sequence[int]) -> None:
        """A prompt replaced the sequence (it diverged): positions follow a diff."""
        for lineages in self.lineages.values():
            lineages.realigned(old, new)


def new_private_salt() -> str:
    """A fresh namespace of the session's own (plain requests may not use ``leyline-``)."""
    return f"leyline-session-{uuid.uuid4().hex}"


def private_namespace(handle: SaltedSession) -> str:
    """Where a session builds KV that is not the exact prefill of its tokens: its own
    namespace (one is minted the first time). The live tests' mutant replaces this."""
    return handle.private_salt or new_private_salt()


def keeps_downstream_kv(plan: EditPlan) -> bool:
    """Whether the new sequence keeps cached KV past the first change (other than its last
    token, which is always recomputed): that KV attended to what the edit removed."""
    result = plan.result
    last = len(result.tokens) - 1
    return any(
        run.kind == "kept"
        and run.new_end > result.first_change
        and max(run.new_start, result.first_change) < last
        for run in result.runs
    )
