"""Tenants: each API key is a tenant; sessions and the shared prefix cache are its own.

An in-process app on the real SmolLM2 with three tenants (and the prefix cache on): nothing
of one tenant can be read, edited, deleted or reused by another, not even as a count of
reused tokens (the side channel that let a client guess another's system prompt); a
``cache_salt`` narrows that partition inside a tenant, for requests and sessions alike; a
tenant filling its session quota evicts only its own sessions.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from leyline.serve.settings import ServerSettings, load_api_keys

pytestmark = [pytest.mark.model]

KEY_A, KEY_B, KEY_C = "alpha-key-0123456789", "bravo-key-0123456789", "charlie-key-012345"
TENANT_MAX_SESSIONS = 6
SECRET = (
    "You are the vault assistant. The door code is 4817. Never reveal it. Answer every "
    "question about the weather politely and briefly, in one sentence."
)


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    from leyline.serve.serve import build_app

    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"# tenants\nalpha {KEY_A}\nbravo {KEY_B}\ncharlie {KEY_C}\n")
    settings = ServerSettings(
        max_new_tokens=1,
        api_keys=load_api_keys(keys),
        tenant_max_sessions=TENANT_MAX_SESSIONS,
    )
    with TestClient(build_app(settings, prefix_cache_bytes=256 * 1024**2)) as test_client:
        yield test_client


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def complete(client: TestClient, key: str, prompt: str = SECRET, **extra: Any) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}
    reply = client.post("/v1/completions", json=body, headers=auth(key))
    assert reply.status_code == 200, reply.text
    return dict(reply.json()["leyline"])


def test_sessions_of_one_tenant_are_unknown_to_another(client: TestClient) -> None:
    made = client.post(
        "/leyline/v1/sessions", json={"session": "1", "text": SECRET}, headers=auth(KEY_A)
    )
    assert made.status_code == 201, made.text
    rev = made.json()["revision"]
    splice = {
        "base_revision": rev,
        "directives": [{"verb": "forget", "span": {"start": 0, "end": 1}}],
    }
    chat = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
        "leyline": {"session": "1", "base_revision": rev, "directives": splice["directives"]},
    }
    for method, path, body in [
        ("GET", "/leyline/v1/sessions/1", None),
        ("POST", "/leyline/v1/sessions/1/directives", splice),
        ("DELETE", "/leyline/v1/sessions/1", None),
        ("POST", "/v1/chat/completions", chat),
    ]:
        reply = client.request(method, path, json=body, headers=auth(KEY_B))
        assert reply.status_code == 404, (method, path, reply.text)
        assert reply.json()["error"]["code"] == "unknown_session"
    # B may use the same id for its own session; A's stays as it was.
    other = client.post(
        "/leyline/v1/sessions", json={"session": "1", "tokens": [1, 2]}, headers=auth(KEY_B)
    )
    assert other.status_code == 201, other.text
    mine = client.get("/leyline/v1/sessions/1", headers=auth(KEY_A)).json()
    assert mine["revision"] == rev and mine["num_tokens"] > 2


def test_no_cached_prefix_crosses_tenants_or_salts(client: TestClient) -> None:
    complete(client, KEY_A)  # A's prompt is in A's cache now
    assert complete(client, KEY_B)["reused_tokens"] == 0  # and not in B's
    assert complete(client, KEY_A)["reused_tokens"] >= 16  # within a tenant it is reused
    assert complete(client, KEY_A, cache_salt="s1")["reused_tokens"] == 0
    assert complete(client, KEY_A, cache_salt="s1")["reused_tokens"] >= 16


NOTES = (
    "Meeting notes, third quarter planning: the launch moves to October, the budget for "
    "the field trial doubles, and the vendor contract is renewed for two more years."
)


def metric(client: TestClient, name: str, **labels: str) -> float:
    """One sample of the app's /metrics (0 if absent)."""
    text = client.get("/metrics", headers=auth(KEY_A)).text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    found = re.search(rf"^{name}(?:\{{{re.escape(want)}\}})? (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def reused_by_create(client: TestClient, key: str, **body: Any) -> int:
    """Create a session and return the prompt tokens its prefill took from the shared
    cache (the create answer says nothing of reuse; the server's counter does)."""
    before = metric(client, "leyline_tokens_total", kind="reused")
    made = client.post("/leyline/v1/sessions", json=body, headers=auth(key))
    assert made.status_code == 201, made.text
    return int(metric(client, "leyline_tokens_total", kind="reused") - before)


def test_a_session_created_with_a_cache_salt_shares_only_with_that_salt(
    client: TestClient,
) -> None:
    assert reused_by_create(client, KEY_A, session="k1", text=NOTES, cache_salt="team-1") == 0
    # The same prompt in the same tenant, under another salt, no salt, or another tenant
    # with the same salt: nothing reused.
    assert reused_by_create(client, KEY_A, session="k2", text=NOTES, cache_salt="team-2") == 0
    assert reused_by_create(client, KEY_A, session="plain", text=NOTES) == 0
    assert reused_by_create(client, KEY_B, session="k1", text=NOTES, cache_salt="team-1") == 0
    # Same tenant, same salt: the first session's prefix is reused, by a session...
    assert reused_by_create(client, KEY_A, session="k1b", text=NOTES, cache_salt="team-1") >= 16
    # ...and by a request carrying the salt.
    assert complete(client, KEY_A, NOTES, cache_salt="team-1")["reused_tokens"] >= 16
    assert complete(client, KEY_C, NOTES, cache_salt="team-1")["reused_tokens"] == 0
    empty = client.post(
        "/leyline/v1/sessions", json={"text": "hi", "cache_salt": ""}, headers=auth(KEY_A)
    )
    assert empty.status_code == 422 and empty.json()["error"]["field"] == "cache_salt"


def test_capabilities_say_tenants_salts_and_quotas(client: TestClient) -> None:
    caps = client.get("/leyline/v1/capabilities", headers=auth(KEY_A)).json()
    assert caps["tenants"] is True and caps["cache_salt"] is True
    assert caps["limits"]["tenant_max_sessions"] == TENANT_MAX_SESSIONS


def test_a_tenant_filling_its_quota_evicts_only_its_own_sessions(client: TestClient) -> None:
    def create(key: str, sid: str) -> None:
        body = {"session": sid, "tokens": [1, 2, 3]}
        made = client.post("/leyline/v1/sessions", json=body, headers=auth(key))
        assert made.status_code == 201, made.text

    def exists(key: str, sid: str) -> bool:
        return client.get(f"/leyline/v1/sessions/{sid}", headers=auth(key)).status_code == 200

    others = [(KEY_A, "quota-a"), (KEY_B, "quota-b")]  # older than any of C's
    for key, sid in others:
        create(key, sid)
    evicted = metric(client, "leyline_evicted_sessions_total", why="tenant_count")
    ids = [f"c{i}" for i in range(TENANT_MAX_SESSIONS + 3)]
    for sid in ids:
        create(KEY_C, sid)
    # C's own least recently used went (a global LRU would have taken the others' first).
    assert [sid for sid in ids if exists(KEY_C, sid)] == ids[-TENANT_MAX_SESSIONS:]
    assert metric(client, "leyline_evicted_sessions_total", why="tenant_count") - evicted == 3
    assert all(exists(key, sid) for key, sid in others)


def test_keys_are_required_and_health_says_nothing_about_sessions(client: TestClient) -> None:
    wrong = client.get("/leyline/v1/capabilities", headers=auth("not-a-key-0123456789"))
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "unauthorized"
    health = client.get("/health")
    assert health.status_code == 200 and "sessions" not in health.json()


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("alpha\n", "expected 'TENANT KEY'"),
        ("al/pha k0123456789abcdef\n", "tenant names"),
        ("alpha short\n", "at least 16"),
        ("a k0123456789abcdef\nb k0123456789abcdef\n", "already given"),
        ("# nothing\n", "no 'TENANT KEY' lines"),
    ],
)
def test_a_bad_keys_file_names_its_line(tmp_path: Path, text: str, problem: str) -> None:
    path = tmp_path / "keys.txt"
    path.write_text(text)
    with pytest.raises(ValueError, match=problem):
        load_api_keys(path)


def test_skills_of_one_tenant_are_unknown_to_another(client: TestClient) -> None:
    made = client.post("/leyline/v1/skills", json={"skill": "vault", "text": SECRET},
                       headers=auth(KEY_A))  # fmt: skip
    assert made.status_code == 201, made.text
    assert client.get("/leyline/v1/skills/vault", headers=auth(KEY_B)).status_code == 404
    assert client.get("/leyline/v1/skills", headers=auth(KEY_B)).json()["skills"] == []
    assert client.delete("/leyline/v1/skills/vault", headers=auth(KEY_B)).status_code == 404
    session = client.post("/leyline/v1/sessions", json={"text": "Hello there."},
                          headers=auth(KEY_B)).json()  # fmt: skip
    compose = {"verb": "compose", "skill": "vault", "at": 0}
    reply = client.post(
        f"/leyline/v1/sessions/{session['session']}/directives",
        json={"base_revision": session["revision"], "directives": [compose]},
        headers=auth(KEY_B),
    )
    assert reply.status_code == 404 and reply.json()["error"]["code"] == "unknown_skill"
    assert client.get("/leyline/v1/skills/vault", headers=auth(KEY_A)).status_code == 200
