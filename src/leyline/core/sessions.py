"""Live sessions: tenants, leases, limits and LRU eviction, for any backend.

A session belongs to the tenant that created it; another tenant asking for its id gets
``unknown_session`` (404, never 403: an id reveals nothing). A session is *busy* while a
request leases it: leases on one session run one after another (an asyncio lock), and
only idle sessions are evicted, least recently used first, past the count or byte budget.
A tenant past its own quota (optional) loses its own idle sessions, never another
tenant's; the server-wide budgets still evict anyone's. A later request for an evicted
session gets ``unknown_session``.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Generic

from leyline.core.backend import Backend, H
from leyline.protocol.envelope import DroppedSpan
from leyline.protocol.errors import ErrorCode, LeylineError
from leyline.protocol.retention import Mark, Marks

DEFAULT_TENANT = "default"


def salt_of(tenant: str, cache_salt: str | None = None) -> str:
    """The shared-cache partition of a tenant (and of a ``cache_salt`` inside it)."""
    return tenant if cache_salt is None else f"{tenant}\x00{cache_salt}"


TENANT_NAMESPACE_PREFIX = "leyline-tenant-"


def tenant_namespace(secret: bytes, tenant: str, cache_salt: str | None) -> str:
    """The namespace of a tenant's KV (of its ``cache_salt``, if any): derived with a
    secret of the server process, so no other tenant and no plain request can name it
    (sessions live in that process only, so the names need not outlive it)."""
    name = f"{tenant}\x00{cache_salt or ''}".encode()
    return TENANT_NAMESPACE_PREFIX + hmac.new(secret, name, "sha256").hexdigest()[:32]


@dataclass(eq=False)
class Session(Generic[H]):
    id: str
    tenant: str
    handle: H
    busy: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    marks: Marks = field(default_factory=Marks)
    """Its pin, decay and scratch marks, in its current revision."""
    dropped: list[DroppedSpan] = field(default_factory=list)
    """Spans dropped since its last response (the next one reports them)."""

    def take_dropped(self) -> list[DroppedSpan]:
        out, self.dropped = self.dropped, []
        return out


@dataclass(frozen=True, slots=True)
class Evicted:
    tenant: str
    session: str
    why: str  # "count" / "bytes" (the server's budgets), "tenant_count" / "tenant_bytes"


Drop = Callable[["Session[H]", list[Mark]], Awaitable[None]]
"""Executes the drop of some decay marks of an idle session (held for the call)."""

log = logging.getLogger(__name__)


class SessionStore(Generic[H]):
    def __init__(
        self,
        backend: Backend[H],
        *,
        max_sessions: int | None = None,
        max_cache_bytes: int | None = None,
        tenant_max_sessions: int | None = None,
        tenant_max_cache_bytes: int | None = None,
        on_evict: Callable[[Evicted], None] = lambda e: None,
        clock: Callable[[], float] = time.time,  # pins report their deadline in Unix time
    ) -> None:
        self.backend = backend
        self.max_sessions = max_sessions
        self.max_cache_bytes = max_cache_bytes
        self.tenant_max_sessions = tenant_max_sessions
        self.tenant_max_cache_bytes = tenant_max_cache_bytes
        self._on_evict = on_evict
        self.clock = clock
        self.drop: Drop[H] | None = None  # set by the service that executes drops
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
                f"all {cap} sessions are busy or pinned with a ttl_s; retry later",
                "session",
            )
        quota = self.tenant_max_sessions
        full = quota is not None and len(self.ids(tenant)) >= quota
        if full and self._idle_victim(tenant) is None:
            raise LeylineError(
                ErrorCode.limit_exceeded,
                f"all {quota} sessions of this tenant (its quota) are busy or pinned with a "
                "ttl_s; retry later",
                "session",
            )

    # -- lifecycle ---------------------------------------------------------------------

    def create(
        self, tenant: str, session_id: str | None = None, *, cache_salt: str | None = None
    ) -> Session[H]:
        """A new empty session (evicting an idle one if a count is at its cap). Its shared
        cache partition is its tenant's, narrowed by ``cache_salt`` if given."""
        self.check_new(tenant, session_id)
        self._make_room(tenant)
        sid = session_id or uuid.uuid4().hex
        session = Session(sid, tenant, self.backend.open(salt_of(tenant, cache_salt)))
        self._lru[(tenant, sid)] = session
        return session

    def _make_room(self, tenant: str) -> None:
        """Free a slot for one more session of ``tenant`` (``check_new`` saw one is free):
        its own least recently used idle one at its quota, then anyone's at the server's."""
        quota = self.tenant_max_sessions
        while quota is not None and len(self.ids(tenant)) >= quota:
            if not self._evict_one("tenant_count", tenant):
                break
        cap = self.max_sessions
        while cap is not None and len(self._lru) >= cap:
            if not self._evict_one("count"):
                break

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
            await self.relieve(session.tenant)
            self.enforce_budget(session.tenant)

    @asynccontextmanager
    async def leased(self, tenant: str, session_id: str) -> AsyncIterator[Session[H]]:
        async with self.lease(self.get(tenant, session_id)) as session:
            yield session

    # -- budget ------------------------------------------------------------------------

    def total_bytes(self, tenant: str | None = None) -> int:
        """Bytes the sessions hold: all of them, or ``tenant``'s."""
        return sum(
            self.backend.nbytes(s.handle)
            for (t, _), s in self._lru.items()
            if tenant is None or t == tenant
        )

    def budget_too_small_for(self, session: Session[H]) -> str | None:
        """The byte budget ``session`` alone exceeds, in words (it cannot be kept), or None."""
        nbytes = self.backend.nbytes(session.handle)
        if self.max_cache_bytes is not None and nbytes > self.max_cache_bytes:
            return "this server's cache budget (--max-cache-gib)"
        if self.tenant_max_cache_bytes is not None and nbytes > self.tenant_max_cache_bytes:
            return "its tenant's cache quota (--tenant-max-cache-gib)"
        return None

    def enforce_budget(self, tenant: str | None = None) -> None:
        """Evict idle sessions, least recently used first: ``tenant``'s own (every tenant's
        if None) past its quota, then anyone's past the server's byte budget."""
        quota = self.tenant_max_cache_bytes
        if quota is not None:
            for each in {t for t, _ in self._lru} if tenant is None else {tenant}:
                self._evict_down_to(quota, "tenant_bytes", each)
        if self.max_cache_bytes is not None:
            self._evict_down_to(self.max_cache_bytes, "bytes")

    def _over_budget(self, tenant: str) -> str | None:
        """Which byte budget is exceeded now (``tenant``'s quota first), or None."""
        quota = self.tenant_max_cache_bytes
        if quota is not None and self.total_bytes(tenant) > quota:
            return tenant
        if self.max_cache_bytes is not None and self.total_bytes() > self.max_cache_bytes:
            return ""
        return None

    async def relieve(self, tenant: str) -> None:
        """Drop decay spans of idle sessions, lowest priority first, while a byte budget is
        exceeded (``tenant``'s quota: its own sessions; the server's: anyone's)."""
        if self.drop is None:
            return
        while (scope := self._over_budget(tenant)) is not None:
            found = self._decay_victim(scope or None)
            if found is None:
                return
            session, mark = found
            session.busy += 1
            try:
                async with session.lock:
                    await self.drop(session, [mark])
            except Exception:  # never loop on a drop that fails: forget the mark instead
                log.exception("dropping decay span of session %s failed", session.id)
                session.marks = Marks(tuple(m for m in session.marks.marks if m != mark))
            finally:
                session.busy -= 1

    def _decay_victim(self, tenant: str | None) -> tuple[Session[H], Mark] | None:
        """The idle session and decay mark to drop next: lowest priority, then the least
        recently used session, then the oldest mark."""
        best: tuple[tuple[int, int, int], Session[H], Mark] | None = None
        for order, ((t, _), s) in enumerate(self._lru.items()):
            if s.busy or (tenant is not None and t != tenant):
                continue
            for m in s.marks.decays()[:1]:
                key = (m.priority, order, m.seq)
                if best is None or key < best[0]:
                    best = (key, s, m)
        return None if best is None else (best[1], best[2])

    def _evict_down_to(self, cap: int, why: str, tenant: str | None = None) -> None:
        """Evict idle sessions (``tenant``'s if given), LRU first, until they hold <= cap."""
        while self.total_bytes(tenant) > cap and self._evict_one(why, tenant):
            pass

    def _idle_victim(self, tenant: str | None = None) -> tuple[str, str] | None:
        """The least recently used idle session (of ``tenant`` if given) that holds no pin;
        else the least recently used one whose pins have no ``ttl_s`` (pinned sessions go
        last); never one with a pin whose ``ttl_s`` runs."""
        now = self.clock()
        idle = [
            (key, s)
            for key, s in self._lru.items()
            if s.busy == 0 and (tenant is None or key[0] == tenant)
        ]
        unpinned = (key for key, s in idle if not s.marks.has_pin(now))
        untimed = (key for key, s in idle if not s.marks.has_timed_pin(now))
        return next(unpinned, None) or next(untimed, None)

    def _evict_one(self, why: str, tenant: str | None = None) -> bool:
        key = self._idle_victim(tenant)
        if key is None:
            return False
        session = self._lru.pop(key)
        self.backend.close(session.handle)
        self._on_evict(Evicted(key[0], key[1], why))
        return True
