"""Tenants on the SGLang backend: each tenant's KV in namespaces of its own.

Over the scripted scheduler (one token set per namespace). With API keys
(``LEYLINE_API_KEYS_FILE``) every tenant's sessions and skills live under a ``cache_salt``
derived from the tenant (and the session's own ``cache_salt``) with a secret of the server
process, so no other tenant, and no plain SGLang request, can name it. Without keys there
is one tenant, whose unsalted sessions share the public namespace with every request.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from leyline.core.service import SessionService
from leyline.core.sessions import SessionStore
from leyline.protocol import Limits, Path
from leyline.protocol.directives import ComposeDirective
from leyline.protocol.resources import ApplyDirectives, SessionCreate, SkillCreate
from leyline.serve.tenant_keys import TenantKeys, tenants_from_env
from leyline.sglang.backend import SglangBackend

from .scripted_scheduler import ScriptedScheduler

OLD = tuple(range(100, 160))
SKILL = tuple(range(500, 520))
SECRET = b"s" * 32


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def _service(secret: bytes | None) -> tuple[SessionService[Any], ScriptedScheduler]:
    scheduler = ScriptedScheduler()
    backend = SglangBackend(
        scheduler, None, limits=Limits(), vocab_size=1 << 16, tenant_secret=secret
    )
    return SessionService(backend, SessionStore(backend)), scheduler


def _salt(service: SessionService[Any], tenant: str, session: str) -> str | None:
    return service.store.get(tenant, session).handle.shared_salt  # type: ignore[no-any-return]


def test_each_tenant_has_namespaces_nobody_else_can_name() -> None:
    service, scheduler = _service(SECRET)
    assert service.capabilities().tenants
    for tenant in ("alpha", "bravo"):
        run(service.create(tenant, SessionCreate(session="s", tokens=list(OLD))))
        body = SessionCreate(session="salted", tokens=list(OLD), cache_salt="team")
        run(service.create(tenant, body))
    salts = {_salt(service, t, s) for t in ("alpha", "bravo") for s in ("s", "salted")}
    assert len(salts) == 4 and None not in salts  # four namespaces, none public
    assert all("alpha" not in s and "bravo" not in s and "team" not in s for s in salts)  # type: ignore[operator]
    assert scheduler.cached_length(OLD) == 0  # a plain request finds nothing of theirs
    assert scheduler.cached_length(OLD, "team") == 0  # nor one that sends the salt
    for salt in salts:
        assert scheduler.cached_length(OLD, salt) == len(OLD)
    # Another process (another secret) derives other names.
    other, _ = _service(b"t" * 32)
    run(other.create("alpha", SessionCreate(session="s", tokens=list(OLD))))
    assert _salt(other, "alpha", "s") not in salts


def test_a_tenants_skill_is_prefilled_held_and_read_in_its_namespace() -> None:
    service, scheduler = _service(SECRET)
    run(service.create("alpha", SessionCreate(session="s", tokens=list(OLD))))
    run(service.create_skill("alpha", SkillCreate(skill="k", tokens=list(SKILL))))
    alpha = _salt(service, "alpha", "s")
    assert scheduler.cached_length(SKILL, alpha) == len(SKILL)
    assert scheduler.cached_length(SKILL) == 0  # never in the public namespace
    body = ApplyDirectives(
        base_revision=1, directives=[ComposeDirective(skill="k", at=30, seam_tokens=2)]
    )
    response = run(service.apply("alpha", "s", body))
    assert response.path is Path.splice and response.rotated_tokens > 0
    # Bravo's identical registration computes its own copy, in its own namespace.
    run(service.create("bravo", SessionCreate(session="s", tokens=list(OLD))))
    run(service.create_skill("bravo", SkillCreate(skill="k", tokens=list(SKILL))))
    assert scheduler.cached_length(SKILL, _salt(service, "bravo", "s")) == len(SKILL)


def test_without_keys_there_is_one_tenant_in_the_public_namespace() -> None:
    service, scheduler = _service(None)
    assert not service.capabilities().tenants
    run(service.create("default", SessionCreate(session="s", tokens=list(OLD))))
    assert _salt(service, "default", "s") is None
    assert scheduler.cached_length(OLD) == len(OLD)


def _app(tenants: dict[str, str]) -> TestClient:
    async def who(request: Request) -> JSONResponse:
        return JSONResponse({"tenant": getattr(request.state, "tenant", None)})

    inner = Starlette(routes=[Route("/leyline/v1/x", who), Route("/generate", who)])
    return TestClient(TenantKeys(inner, tenants=tenants, prefix="/leyline/v1"))


def test_keys_are_checked_where_the_plugin_answers_only() -> None:
    client = _app({"k" * 16: "alpha", "j" * 16: "bravo"})
    ok = client.get("/leyline/v1/x", headers={"Authorization": f"Bearer {'j' * 16}"})
    assert ok.status_code == 200 and ok.json() == {"tenant": "bravo"}
    for headers in ({}, {"Authorization": "Bearer wrong-key-of-16-chars"}):
        refused = client.get("/leyline/v1/x", headers=headers)
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "unauthorized"
    # SGLang's own routes are SGLang's (its own --api-key): untouched, no tenant.
    assert client.get("/generate").json() == {"tenant": None}


def test_the_keys_file_is_read_and_a_bad_one_refused(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LEYLINE_API_KEYS_FILE", raising=False)
    assert tenants_from_env() is None
    keys = tmp_path / "keys"
    keys.write_text("alpha " + "a" * 16 + "\nbravo " + "b" * 16 + "\n")
    monkeypatch.setenv("LEYLINE_API_KEYS_FILE", str(keys))
    assert tenants_from_env() == {"a" * 16: "alpha", "b" * 16: "bravo"}
    keys.write_text("alpha short\n")
    with pytest.raises(ValueError, match="at least 16"):
        tenants_from_env()
