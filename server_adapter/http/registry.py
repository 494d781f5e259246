"""Live sessions with LRU eviction of idle ones, under a count and a KV-bytes budget.

A session is *busy* while a request holds it (``lease``); only idle sessions are evicted.
Eviction is reported: the metrics count it, and a later request for that session gets
``unknown_session`` (the client re-creates it; its first request re-prefills).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from leyline.protocol import ErrorCode, LeylineError

from ..engine import Engine
from ..session import SessionCache


@dataclass(frozen=True, slots=True)
class Evicted:
    session: str
    why: str  # "count" or "bytes"


def session_bytes(session: SessionCache) -> int:
    return sum(t.numel() * t.element_size() for layer in session.kv for t in layer)


class SessionRegistry:
    def __init__(
        self,
        engine: Engine,
        *,
        max_sessions: int,
        max_cache_bytes: int,
        on_evict: Callable[[Evicted], None] = lambda e: None,
    ) -> None:
        self.engine = engine
        self.max_sessions = max_sessions
        self.max_cache_bytes = max_cache_bytes
        self._on_evict = on_evict
        self._lru: OrderedDict[str, SessionCache] = OrderedDict()
        self._busy: dict[str, int] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._lru)

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._lru)

    def create(self, session_id: str | None = None) -> SessionCache:
        with self._lock:
            if session_id is not None and session_id in self._lru:
                raise LeylineError(
                    ErrorCode.invalid_directive,
                    f"session {session_id!r} already exists",
                    "session",
                )
            while len(self._lru) >= self.max_sessions:
                if not self._evict_one("count"):
                    raise LeylineError(
                        ErrorCode.limit_exceeded,
                        f"all {self.max_sessions} sessions are busy; retry later",
                        "session",
                    )
            session = self.engine.create_session(session_id)
            self._lru[session.id] = session
            return session

    def get(self, session_id: str) -> SessionCache:
        with self._lock:
            session = self._lru.get(session_id)
            if session is None:
                raise LeylineError(
                    ErrorCode.unknown_session,
                    f"no session {session_id!r}: it never existed, was deleted, or was "
                    "evicted while idle; create it again",
                    "session",
                )
            self._lru.move_to_end(session_id)
            return session

    def get_or_create(self, session_id: str) -> tuple[SessionCache, bool]:
        try:
            return self.get(session_id), False
        except LeylineError:
            return self.create(session_id), True

    def delete(self, session_id: str) -> None:
        with self._lock:
            if self._lru.pop(session_id, None) is None:
                raise LeylineError(
                    ErrorCode.unknown_session, f"no session {session_id!r}", "session"
                )
        self.engine.close_session(session_id)

    @contextmanager
    def lease(self, session: SessionCache) -> Iterator[SessionCache]:
        """Mark ``session`` busy for the duration (it cannot be evicted meanwhile)."""
        with self._lock:
            self._busy[session.id] = self._busy.get(session.id, 0) + 1
        try:
            yield session
        finally:
            with self._lock:
                left = self._busy[session.id] - 1
                if left:
                    self._busy[session.id] = left
                else:
                    del self._busy[session.id]
            self.enforce_budget()

    def total_bytes(self) -> int:
        with self._lock:
            return sum(session_bytes(s) for s in self._lru.values())

    def enforce_budget(self) -> None:
        """Evict idle sessions, least recently used first, until under the byte budget."""
        with self._lock:
            while sum(session_bytes(s) for s in self._lru.values()) > self.max_cache_bytes:
                if not self._evict_one("bytes"):
                    return

    def _evict_one(self, why: str) -> bool:
        victim = next((sid for sid in self._lru if sid not in self._busy), None)
        if victim is None:
            return False
        self._lru.pop(victim)
        self.engine.close_session(victim)
        self._on_evict(Evicted(victim, why))
        return True
