"""Tenants on the vLLM backend, as on SGLang: with API keys (``LEYLINE_API_KEYS_FILE``)
each tenant's sessions cache their exact KV under a ``cache_salt`` derived from the tenant
(and the session's own salt) with a secret of the server process: reserved, so no plain
request can send it, and unknown to every other tenant. Keys are checked where the plugin
answers only; vLLM's own routes keep vLLM's ``--api-key``."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI

from leyline.core.service import SessionService
from leyline.core.sessions import DEFAULT_TENANT, TENANT_NAMESPACE_PREFIX, SessionStore
from leyline.protocol import Limits
from leyline.protocol.resources import Routes, SessionCreate
from leyline.vllm.backend import RESERVED_SALT_PREFIX, VllmBackend, VllmSession
from leyline.vllm.endpoint import mount

from ._fake_engine import FakeEngine
from ._stand_in import call, stand_in_app

BLOCK = 4
TOKENS = list(range(100, 121))
KEYS = {"a" * 16: "alpha", "b" * 16: "bravo"}


def _backend(secret: bytes | None) -> tuple[VllmBackend, FakeEngine]:
    engine = FakeEngine(BLOCK)
    backend = VllmBackend(
        engine, None, limits=Limits(), vocab_size=1000, block_size=BLOCK, tenant_secret=secret
    )
    return backend, engine


def _salt(service: SessionService[VllmSession], tenant: str, session: str) -> str | None:
    return service.store.get(tenant, session).handle.shared_salt


def test_each_tenant_caches_in_namespaces_nobody_else_can_name() -> None:
    backend, engine = _backend(b"s" * 32)
    assert backend.capabilities().tenants
    service = SessionService(backend, SessionStore(backend))
    for tenant in ("alpha", "bravo"):
        for name, salt in (("s", None), ("salted", "team")):
            body = SessionCreate(session=name, tokens=TOKENS, cache_salt=salt)
            asyncio.run(service.create(tenant, body))
    salts = {_salt(service, t, s) for t in ("alpha", "bravo") for s in ("s", "salted")}
    assert len(salts) == 4 and None not in salts  # four namespaces, none public
    for salt in salts:
        assert salt is not None and salt.startswith(TENANT_NAMESPACE_PREFIX)
        assert salt.startswith(RESERVED_SALT_PREFIX)  # a plain request naming it: a 422
        assert "alpha" not in salt and "bravo" not in salt and "team" not in salt
        assert engine.cached_blocks(salt, TOKENS) == len(TOKENS) // BLOCK
    assert engine.cached_blocks(None, TOKENS) == 0  # a plain request finds none of it
    assert engine.cached_blocks("team", TOKENS) == 0  # nor one that sends the salt
    other, _ = _backend(b"t" * 32)  # another process derives other names
    assert other.namespace_of("alpha") not in salts


def test_without_keys_there_is_one_tenant_and_salts_are_vllms() -> None:
    backend, engine = _backend(None)
    assert not backend.capabilities().tenants
    service = SessionService(backend, SessionStore(backend))
    asyncio.run(service.create(DEFAULT_TENANT, SessionCreate(session="s", tokens=TOKENS)))
    assert _salt(service, DEFAULT_TENANT, "s") is None
    assert engine.cached_blocks(None, TOKENS) == len(TOKENS) // BLOCK
    assert backend.namespace_of(DEFAULT_TENANT, "team") == "team"


def _call(app: FastAPI, method: str, path: str, key: str | None, body: Any = None) -> Any:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    return call(app, method, path, body, headers)


def test_keys_are_checked_where_the_plugin_answers_only() -> None:
    app, endpoint = stand_in_app()
    backend, _ = _backend(b"s" * 32)
    endpoint.mounted = mount(backend, KEYS)
    for key in (None, "not-a-key-of-anyone"):
        refused = _call(app, "GET", Routes.capabilities, key)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "unauthorized"
    assert _call(app, "GET", Routes.capabilities, "a" * 16).json()["tenants"] is True
    created = _call(app, "POST", Routes.sessions, "a" * 16, {"session": "s", "tokens": TOKENS})
    assert created.status_code == 201, created.text
    hidden = _call(app, "GET", Routes.session.format(session="s"), "b" * 16)
    assert hidden.status_code == 404 and hidden.json()["error"]["code"] == "unknown_session"
    mine = _call(app, "GET", Routes.session.format(session="s"), "a" * 16)
    assert mine.status_code == 200
    turn = {"prompt": [1, 2], "max_tokens": 1, "leyline": {"session": "s"}}
    assert _call(app, "POST", "/v1/completions", None, turn).status_code == 401
    plain = {"prompt": [1, 2], "max_tokens": 1}  # vLLM's own: no key asked here
    assert _call(app, "POST", "/v1/completions", None, plain).json() == {"vllm": plain}
