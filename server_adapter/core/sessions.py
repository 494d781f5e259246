"""Live sessions: tenants, leases, limits and LRU eviction, for any backend.

A session belongs to the tenant that created it; another tenant asking for its id gets
``unknown_session`` (404, never 403: an id reveals nothing). A session is *busy* while a
request leases it: leases on one session run one after another (an asyncio lock), and
only idle sessions are evicted, least recently used first, past the count or byte budget.
A later request for an evicted session gets ``unknown_session``.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Generic

from leyline.protocol.errors import ErrorCode, LeylineError

from .backend import Backend, H

DEFAULT_TENANT = "default"


def salt_of(tenant: str, cache_salt: str | None = None) -> str:
    """The shared-cache partition of a tenant (and of a ``cache_salt`` inside it)."""
    return tenant if cache_salt is None else f"{tenant}\x00{cache_salt}"


@dataclass(eq=False)
class Session(Generic[H]):
    id: str
    tenant: str
    handle: H
    busy: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


@dataclass(frozen=True, slots=True)
class Evicted:
    tenant: str
    session: str
    why: str  # "count" or "bytes"


class SessionStore(Generic[H]):
    def __init__(
        self,
        backend: Backend[H],
        *,
        max_sessions: int | None = None,
        max_cache_bytes: int | None = None,
        on_evict: Callable[[Evicted], None] = lambda e: None,
    ) -> None:
        self.backend = backend
        self.max_sessions = max_sessions
        self.max_cache_bytes = max_cache_bytes
        self._on_evict = on_evict
        self._lru: OrderedDict[tuple[str, str], Session[H]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def ids(self, tenant: str = DEFAULT_TENANT) -> list[str]:
        return [sid for (t, sid) in self._lru if t == tenant]

    # -- lookup ------------------------------------------------------------------------

    def get(self, tenant: str, session_id: str) -> Session[H]:
        found = self._lru.get((tenant, session_id))
        if found is None:
            raise LeylineError(
                ErrorCode.unknown_session,
                f"no session {session_id!r}: it never existed, was deleted, was evicted while "
                "idle, or the server restarted (sessions live in memory); create it again",
                "session",
            )
        self._lru.move_to_end((tenant, session_id))
        return found

    def exists(self, tenant: str, session_id: str) -> bool:
        return (tenant, session_id) in self._lru

    def check_new(self, tenant: str, session_id: str | None) -> None:
        """Raise now what :meth:`create` would: call before any work a create needs."""
        if session_id is not None and (tenant, session_id) in self._lru:
            raise LeylineError(
                ErrorCode.invalid_directive, f"session {session_id!r} already exists", "session"
            )
        cap = self.max_sessions
        if cap is not None and len(self._lru) >= cap and self._idle_victim() is None:
            raise LeylineError(
                ErrorCode.limit_exceeded,
                f"all {cap} sessions are busy; retry later",
                "session",
            )

    # -- lifecycle ---------------------------------------------------------------------

    def create(
        self, tenant: str, session_id: str | None = None, *, cache_salt: str | None = None
    ) -> Session[H]:
        """A new empty session (evicting an idle one if the count is at its cap). Its shared
        cache partition is its tenant's, narrowed by ``cache_salt`` if given."""
        self.check_new(tenant, session_id)
        cap = self.max_sessions
        while cap is not None and len(self._lru) >= cap:
            self._evict_one("count")
        sid = session_id or uuid.uuid4().hex
        session = Session(sid, tenant, self.backend.open(salt_of(tenant, cache_salt)))
        self._lru[(tenant, sid)] = session
        return session

    def delete(self, tenant: str, session_id: str) -> None:
        session = self.get(tenant, session_id)
        del self._lru[(tenant, session_id)]
        self.backend.close(session.handle)

    @asynccontextmanager
    async def lease(self, session: Session[H]) -> AsyncIterator[Session[H]]:
        """Hold ``session`` for one request: others on it wait; it cannot be evicted."""
        session.busy += 1
        try:
            async with session.lock:
                if self._lru.get((session.tenant, session.id)) is not session:
                    # Deleted while this request waited for the one before it.
                    raise LeylineError(
                        ErrorCode.unknown_session, f"session {session.id!r} was deleted", "session"
                    )
                yield session
        finally:
            session.busy -= 1
            self.enforce_budget()

    @asynccontextmanager
    async def leased(self, tenant: str, session_id: str) -> AsyncIterator[Session[H]]:
        async with self.lease(self.get(tenant, session_id)) as session:
            yield session

    # -- budget ------------------------------------------------------------------------

    def total_bytes(self) -> int:
        return sum(self.backend.nbytes(s.handle) for s in self._lru.values())

    def fits(self, session: Session[H]) -> bool:
        """Whether ``session`` alone fits the byte budget (else it cannot be kept)."""
        cap = self.max_cache_bytes
        return cap is None or self.backend.nbytes(session.handle) <= cap

    def enforce_budget(self) -> None:
        """Evict idle sessions, least recently used first, until under the byte budget."""
        cap = self.max_cache_bytes
        while cap is not None and self.total_bytes() > cap:
            if not self._evict_one("bytes"):
                return

    def _idle_victim(self) -> tuple[str, str] | None:
        return next((key for key, s in self._lru.items() if s.busy == 0), None)

    def _evict_one(self, why: str) -> bool:
        key = self._idle_victim()
        if key is None:
            return False
        session = self._lru.pop(key)
        self.backend.close(session.handle)
        self._on_evict(Evicted(key[0], key[1], why))
        return True
