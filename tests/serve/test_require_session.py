"""``options.require_session`` over HTTP: an in-process ``leyline serve`` app on the
random-weight tiny MLA model (prompts in token ids; the chat path on both backends is
``tests/core/test_chat_turns.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from leyline.serve.settings import ServerSettings

PROMPT = [5, 17, 29, 41, 53, 65, 77, 89]


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    from leyline.serve.serve import build_app

    settings = ServerSettings(model="tiny-mla-v3", max_new_tokens=1)
    with TestClient(build_app(settings, prefix_cache_bytes=0)) as test_client:
        yield test_client


def complete(client: TestClient, prompt: list[int], **leyline: Any) -> Any:
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "leyline": leyline}
    return client.post("/v1/completions", json=body)


def test_capabilities_offer_the_option(client: TestClient) -> None:
    assert client.get("/leyline/v1/capabilities").json()["require_session"] is True


@pytest.mark.parametrize("stream", [False, True])
def test_an_unknown_session_is_404_and_not_created(client: TestClient, stream: bool) -> None:
    leyline = {"session": f"lost-{stream}", "options": {"require_session": True}}
    body = {"prompt": PROMPT, "max_tokens": 1, "stream": stream, "leyline": leyline}
    reply = client.post("/v1/completions", json=body)
    assert reply.status_code == 404, reply.text
    error = reply.json()["error"]
    assert (error["code"], error["field"]) == ("unknown_session", "leyline.session")
    assert "require_session" in error["message"]
    assert client.get(f"/leyline/v1/sessions/lost-{stream}").status_code == 404


def test_a_session_that_exists_runs_the_turn(client: TestClient) -> None:
    made = complete(client, PROMPT, session="kept")  # no option: the turn creates it
    assert made.status_code == 200, made.text
    assert made.json()["leyline"]["reused_tokens"] == 0
    held = client.get("/leyline/v1/sessions/kept", params={"tokens": "true"}).json()["tokens"]
    required = {"options": {"require_session": True}}
    again = complete(client, [*held, 3, 4], session="kept", **required)
    assert again.status_code == 200, again.text
    report = again.json()["leyline"]
    assert report["session"] == "kept" and report["reused_tokens"] >= len(PROMPT)


def test_the_option_without_a_session_is_refused(client: TestClient) -> None:
    reply = complete(client, PROMPT, options={"require_session": True})
    assert reply.status_code == 422, reply.text
    assert reply.json()["error"]["field"] == "leyline.session"
