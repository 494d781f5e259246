"""Per-tenant quotas of the session store: a tenant past its own count or byte quota loses
its own least recently used idle sessions, never another tenant's; busy sessions are never
evicted; a session too large for its tenant's quota is refused and leaves nothing behind.

No model: the store runs over a backend whose sessions weigh what a test says, and the
service over the SGLang backend (scripted scheduler) with bytes counted per token.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import pytest

from leyline.core.salted_session import SaltedSession
from leyline.core.service import SessionService
from leyline.core.sessions import Evicted, SessionStore
from leyline.protocol import Capabilities, ErrorCode, LeylineError, Limits
from leyline.protocol.resources import SessionCreate
from leyline.sglang.backend import SglangBackend

from .scripted_scheduler import ScriptedScheduler

A, B = "tenant-a", "tenant-b"


@dataclass(eq=False)
class Handle:
    salt: str
    nbytes: int = 0
    closed: bool = False


class Weighed:
    """The part of a backend the store uses; each handle weighs what the test sets."""

    def open(self, salt: str) -> Handle:
        return Handle(salt)

    def nbytes(self, handle: Handle) -> int:
        return handle.nbytes

    def close(self, handle: Handle) -> None:
        handle.closed = True


def store(**limits: Any) -> tuple[SessionStore[Any], list[Evicted]]:
    evicted: list[Evicted] = []
    return SessionStore(Weighed(), on_evict=evicted.append, **limits), evicted


def ids(sessions: SessionStore[Any]) -> dict[str, list[str]]:
    return {tenant: sessions.ids(tenant) for tenant in (A, B)}


async def weigh(sessions: SessionStore[Any], tenant: str, sid: str, nbytes: int) -> None:
    """One request on a session that leaves it holding ``nbytes``."""
    async with sessions.leased(tenant, sid) as session:
        session.handle.nbytes = nbytes


def test_a_tenant_at_its_count_quota_evicts_only_its_own_lru_session() -> None:
    sessions, evicted = store(max_sessions=10, tenant_max_sessions=2)
    sessions.create(B, "b1")  # B's is the oldest of all: a global LRU would pick it
    sessions.create(A, "a1")
    sessions.create(A, "a2")
    sessions.get(A, "a1")  # a1 used last: a2 is A's least recently used
    sessions.create(A, "a3")
    assert ids(sessions) == {A: ["a1", "a3"], B: ["b1"]}
    assert evicted == [Evicted(A, "a2", "tenant_count")]


def test_a_tenant_whose_sessions_are_all_busy_cannot_create_and_others_still_can() -> None:
    sessions, _ = store(tenant_max_sessions=1)

    async def scenario() -> None:
        async with sessions.leased(A, "a1"):
            with pytest.raises(LeylineError) as info:
                sessions.create(A, "a2")
            assert info.value.code is ErrorCode.limit_exceeded
            sessions.create(B, "b1")

    sessions.create(A, "a1")
    asyncio.run(scenario())
    assert ids(sessions) == {A: ["a1"], B: ["b1"]}


def test_a_tenant_past_its_byte_quota_evicts_only_its_own_idle_sessions() -> None:
    sessions, evicted = store(max_cache_bytes=10_000, tenant_max_cache_bytes=300)
    sessions.create(B, "b1").handle.nbytes = 250  # the oldest, and near A's quota itself
    for sid in ("a1", "a2"):
        sessions.create(A, sid).handle.nbytes = 100
    asyncio.run(weigh(sessions, A, "a2", 150))  # A holds 250: under its quota
    assert evicted == []
    asyncio.run(weigh(sessions, A, "a2", 250))  # A holds 350: a1 (A's LRU) goes, not B's b1
    assert ids(sessions) == {A: ["a2"], B: ["b1"]}
    assert evicted == [Evicted(A, "a1", "tenant_bytes")]


def test_a_busy_session_is_not_evicted_for_its_tenants_byte_quota() -> None:
    sessions, evicted = store(tenant_max_cache_bytes=100)
    sessions.create(A, "a1").handle.nbytes = 80

    async def scenario() -> None:
        async with sessions.leased(A, "a1"):
            await weigh(sessions, A, "a2", 80)
            # a2's lease ended with A at 160: a1 is leased, so a2 (idle) is the one to go.
            assert evicted == [Evicted(A, "a2", "tenant_bytes")]

    sessions.create(A, "a2")
    asyncio.run(scenario())
    assert ids(sessions) == {A: ["a1"], B: []}


def test_without_quotas_the_server_budget_still_evicts_any_tenants_lru() -> None:
    sessions, evicted = store(max_sessions=2)
    sessions.create(B, "b1")
    sessions.create(A, "a1")
    sessions.create(A, "a2")
    assert evicted == [Evicted(B, "b1", "count")]


# -- through the service: refusals leave nothing behind ---------------------------------


class ByToken(SglangBackend):
    """The SGLang backend, but each cached token weighs 100 bytes (as an engine's KV)."""

    def nbytes(self, handle: SaltedSession) -> int:
        return 100 * len(handle.view.tokens)


def service(**limits: Any) -> SessionService[Any]:
    backend = ByToken(ScriptedScheduler(), None, limits=Limits(), vocab_size=1000)
    return SessionService(backend, SessionStore(backend, **limits))


def create(svc: SessionService[Any], tenant: str, **body: Any) -> Any:
    return asyncio.run(svc.create(tenant, SessionCreate.model_validate(body)))


def test_a_session_too_large_for_its_tenants_quota_is_refused_and_evicts_nothing() -> None:
    svc = service(tenant_max_cache_bytes=1_000)
    create(svc, A, session="small", tokens=list(range(6)))  # 600 bytes
    with pytest.raises(LeylineError) as info:
        create(svc, A, session="big", tokens=list(range(20)))  # 2,000 bytes alone
    assert info.value.code is ErrorCode.limit_exceeded
    assert "tenant" in info.value.message and info.value.field == "tokens"
    assert svc.store.ids(A) == ["small"]  # nothing created, and "small" was not evicted
    create(svc, A, session="fits", tokens=list(range(8)))  # 800 bytes: "small" makes room
    assert svc.store.ids(A) == ["fits"]


def test_a_session_too_large_for_the_server_is_refused_the_same_way() -> None:
    svc = service(max_cache_bytes=1_000, tenant_max_cache_bytes=5_000)
    with pytest.raises(LeylineError) as info:
        create(svc, B, session="big", tokens=list(range(20)))
    assert info.value.code is ErrorCode.limit_exceeded and "server" in info.value.message
    assert len(svc.store) == 0


class Unsalted(ByToken):
    """A backend whose cache cannot be partitioned by a salt (SGLang's can)."""

    def capabilities(self) -> Capabilities:
        return super().capabilities().model_copy(update={"cache_salt": False})


def test_a_backend_that_cannot_salt_refuses_a_cache_salt() -> None:
    backend = Unsalted(ScriptedScheduler(), None, limits=Limits(), vocab_size=1000)
    svc = SessionService(backend, SessionStore(backend))
    assert svc.capabilities().cache_salt is False
    with pytest.raises(LeylineError) as info:
        create(svc, A, session="s", tokens=[1, 2], cache_salt="s1")
    assert (info.value.code, info.value.field) == (ErrorCode.invalid_directive, "cache_salt")
    assert len(svc.store) == 0
