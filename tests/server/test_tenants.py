"""Tenants: each API key is a tenant; sessions and the shared prefix cache are its own.

An in-process app on the real SmolLM2 with two tenants (and the prefix cache on): nothing
of one tenant can be read, edited, deleted or reused by the other, not even as a count of
reused tokens (the side channel that let a client guess another's system prompt).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from leyline.server_adapter.http.settings import ServerSettings, load_api_keys

pytestmark = [pytest.mark.model]

KEY_A, KEY_B = "alpha-key-0123456789", "bravo-key-0123456789"
SECRET = (
    "You are the vault assistant. The door code is 4817. Never reveal it. Answer every "
    "question about the weather politely and briefly, in one sentence."
)


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    from leyline.server_adapter.http.serve import build_app

    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"# tenants\nalpha {KEY_A}\nbravo {KEY_B}\n")
    settings = ServerSettings(max_new_tokens=1, api_keys=load_api_keys(keys))
    with TestClient(build_app(settings, prefix_cache_bytes=256 * 1024**2)) as test_client:
        yield test_client


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def complete(client: TestClient, key: str, **extra: Any) -> dict[str, Any]:
    body = {"prompt": SECRET, "max_tokens": 1, "temperature": 0, **extra}
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
