"""Envelopes (``serve.tunnel``, for routers that forward only the OpenAI routes) on a live
backend: a session made, turned, read and deleted through ``POST /v1/completions`` answers
as the same requests sent directly; plain completions still reach the host."""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Any

import httpx

from leyline.protocol.resources import Routes

from ._live import prompt_text

if TYPE_CHECKING:
    from leyline.engine.engine import Engine


def _through(server: httpx.Client, method: str, path: str, body: Any = None) -> httpx.Response:
    route: dict[str, Any] = {"method": method, "path": path}
    if body is not None:
        route["body"] = body
    stream = bool(isinstance(body, dict) and body.get("stream"))
    envelope = {"model": "m", "prompt": ".", "max_tokens": 1, "stream": stream}
    return server.post("/v1/completions", json={**envelope, "leyline": {"route": route}})


def test_a_session_through_envelopes(server: httpx.Client, reference: Engine) -> None:
    assert (
        _through(server, "GET", Routes.capabilities).json()
        == server.get(Routes.capabilities).json()
    )
    name = f"tunnel-{uuid.uuid4().hex[:10]}"
    text = prompt_text("tunnel")
    created = _through(server, "POST", Routes.sessions, {"text": text, "session": name})
    assert created.status_code == 201, created.text
    path = Routes.session.format(session=name)
    assert _through(server, "GET", path).json() == server.get(path).json()
    tokens = list(reference.encode(text))
    edited = tokens[:4] + tokens[9:]
    turn = {
        "prompt": edited + tokens[:3],
        "max_tokens": 2,
        "temperature": 0,
        "leyline": {
            "session": name,
            "base_revision": created.json()["revision"],
            "directives": [{"verb": "splice", "span": {"start": 4, "end": 9}}],
        },
    }
    answer = _through(server, "POST", "/v1/completions", turn)
    assert answer.status_code == 200, answer.text
    report = answer.json()["leyline"]
    assert report["session"] == name and report["path"] == "splice", report
    streamed = _through(
        server, "POST", "/v1/completions", {**turn, "stream": True, "leyline": {"session": name}}
    )
    assert streamed.status_code == 200, streamed.text
    assert streamed.text.rstrip().endswith("data: [DONE]")
    assert _through(server, "DELETE", path).status_code == 204
    gone = _through(server, "GET", path)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "unknown_session"


def test_a_plain_completion_still_reaches_the_host(server: httpx.Client) -> None:
    body = {
        "model": server.get("/v1/models").json()["data"][0]["id"],
        "prompt": "Hello",
        "max_tokens": 1,
        "temperature": 0,
    }
    direct = server.post("/v1/completions", json=body)
    assert direct.status_code == 200, direct.text
    assert "leyline" not in direct.json() and json.loads(direct.text)["choices"]
