"""The SGLang backend's session handle: the protocol state, and where its KV sits in the tree."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from leyline.core.batch import SessionView
from leyline.core.lineage import Lineages
from leyline.protocol.algebra import PositionMap


@dataclass
class SglangSession:
    """The handle: the protocol state only (the tree holds the KV, shared by tokens)."""

    view: SessionView = field(default_factory=SessionView)
    shared_salt: str | None = None
    """The namespace the session shares with requests of its ``cache_salt`` (SGLang's own
    ``cache_salt``: keys of different salts never share a tree node); None: the public one."""
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

    def cached(self, tokens: Sequence[int]) -> None:
        """``tokens`` are now cached where the session's KV is."""
        if tokens:
            self.lineages.setdefault(self.salt, Lineages()).published(tokens)

    def moved(self, position_map: PositionMap) -> None:
        """An edit ran: every lineage's positions follow it."""
        for lineages in self.lineages.values():
            lineages.moved(position_map)

    def realigned(self, old: Sequence[int], new: Sequence[int]) -> None:
        """A prompt replaced the sequence (it diverged): positions follow a diff."""
        for lineages in self.lineages.values():
            lineages.realigned(old, new)
