"""Envelopes (``serve.tunnel``): a Leyline request carried inside ``POST /v1/completions``
reaches the app as if sent directly; anything else passes through byte for byte. As ASGI
over an app that echoes what it received, then against the real ``leyline serve`` (the
``server`` fixture: SmolLM2 on CPU, with an API key)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from leyline.serve.tunnel import LeylineTunnel

from .conftest import Server


def _echo() -> FastAPI:
    app = FastAPI()

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
    async def echo(request: Request, path: str) -> dict[str, Any]:
        return {
            "method": request.method,
            "path": request.url.path,
            "query": request.url.query,
            "body": (await request.body()).decode(),
            "authorization": request.headers.get("authorization"),
            "routing_key": request.headers.get("x-smg-routing-key"),
            "content_length": request.headers.get("content-length"),
        }

    return app


def _client(max_body_bytes: int = 1 << 20) -> TestClient:
    app = _echo()
    app.add_middleware(LeylineTunnel, max_body_bytes=max_body_bytes)
    return TestClient(app)


def _envelope(route: Any, **outer: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": ".", "max_tokens": 1, **outer, "leyline": {"route": route}}


def test_an_envelope_is_the_request_it_carries() -> None:
    inner = {"session": "s1", "messages": [{"role": "user", "content": "héllo"}]}
    route = {"method": "POST", "path": "/v1/chat/completions", "body": inner}
    headers = {"Authorization": "Bearer k", "X-SMG-Routing-Key": "s1"}
    got = _client().post("/v1/completions", json=_envelope(route), headers=headers).json()
    assert (got["method"], got["path"]) == ("POST", "/v1/chat/completions")
    assert json.loads(got["body"]) == inner
    assert int(got["content_length"]) == len(got["body"].encode())
    assert (got["authorization"], got["routing_key"]) == ("Bearer k", "s1")


def test_a_session_path_keeps_its_quoting_and_query() -> None:
    route = {"method": "GET", "path": "/leyline/v1/sessions/a%2Fb?include_tokens=true"}
    got = _client().post("/v1/completions", json=_envelope(route)).json()
    assert (got["method"], got["path"], got["query"]) == (
        "GET",
        "/leyline/v1/sessions/a/b",
        "include_tokens=true",
    )
    assert got["body"] == ""
    deleted = _client().post(
        "/v1/completions", json=_envelope({"method": "DELETE", "path": "/leyline/v1/sessions/x"})
    )
    assert deleted.json()["method"] == "DELETE"


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m", "prompt": "route"},  # the word, not an envelope
        {"model": "m", "prompt": ".", "leyline": {"session": "s"}},  # a leyline completion
        {"model": "m", "prompt": ".", "route": {"method": "GET", "path": "/leyline/v1/x"}},
    ],
)
def test_other_completions_pass_byte_for_byte(body: dict[str, Any]) -> None:
    raw = json.dumps(body, indent=1).encode()
    got = _client().post("/v1/completions", content=raw).json()
    assert (got["path"], got["body"]) == ("/v1/completions", raw.decode())


def test_other_paths_are_not_unpacked() -> None:
    route = {"method": "GET", "path": "/leyline/v1/capabilities"}
    got = _client().post("/v1/chat/completions", json=_envelope(route)).json()
    assert got["path"] == "/v1/chat/completions"


@pytest.mark.parametrize(
    ("route", "status", "code", "field"),
    [
        ({"method": "GET", "path": "/metrics"}, 404, "not_found", "leyline.route.path"),
        ({"method": "GET", "path": "/health"}, 404, "not_found", "leyline.route.path"),
        ({"method": "PUT", "path": "/leyline/v1/x"}, 422, "invalid_directive", ".method"),
        ({"method": "GET", "path": "leyline/v1/x"}, 422, "invalid_directive", ".path"),
        ({"method": "GET", "path": "/leyline/v1/x", "body": {}}, 422, "invalid_directive", ".body"),
        ({"method": "GET", "path": "/leyline/v1/x", "extra": 1}, 422, "invalid_directive", "route"),
        ("GET /leyline/v1/x", 422, "invalid_directive", "leyline.route"),
    ],
)
def test_a_bad_envelope_gets_a_typed_error(route: Any, status: int, code: str, field: str) -> None:
    response = _client().post("/v1/completions", json=_envelope(route))
    assert response.status_code == status
    error = response.json()["error"]
    assert error["code"] == code and error["field"].endswith(field)


def test_an_oversized_envelope_is_refused_unread() -> None:
    route = {"method": "POST", "path": "/v1/completions", "body": {"prompt": "x" * 5000}}
    response = _client(max_body_bytes=1000).post("/v1/completions", json=_envelope(route))
    assert response.status_code == 413 and response.json()["error"]["code"] == "limit_exceeded"


def test_envelopes_do_not_nest() -> None:
    """The inner request is dispatched below the tunnel: a body that is itself an envelope
    reaches the app as it is."""
    nested = _envelope({"method": "GET", "path": "/leyline/v1/capabilities"})
    route = {"method": "POST", "path": "/v1/completions", "body": nested}
    got = _client().post("/v1/completions", json=_envelope(route)).json()
    assert got["path"] == "/v1/completions" and json.loads(got["body"]) == nested


# -- the real server ---------------------------------------------------------------------


def _through(client: httpx.Client, method: str, path: str, body: Any = None, **kw: Any) -> Any:
    route: dict[str, Any] = {"method": method, "path": path}
    if body is not None:
        route["body"] = body
    return client.post("/v1/completions", json=_envelope(route, **kw))


def test_a_session_lives_through_envelopes_on_leyline_serve(server: Server) -> None:
    with server.client() as client:
        created = _through(client, "POST", "/leyline/v1/sessions", {"text": "The cat sat."})
        assert created.status_code == 201, created.text
        session = created.json()["session"]
        direct = client.get(f"/leyline/v1/sessions/{session}").json()
        got = _through(client, "GET", f"/leyline/v1/sessions/{session}").json()
        assert got == direct
        turn = {
            "model": "default",
            "messages": [{"role": "user", "content": "Say hi."}],
            "max_tokens": 2,
            "leyline": {"session": session, "base_revision": direct["revision"]},
        }
        answer = _through(client, "POST", "/v1/chat/completions", turn)
        assert answer.status_code == 200, answer.text
        assert answer.json()["leyline"]["session"] == session
        streamed = _through(
            client,
            "POST",
            "/v1/chat/completions",
            {**turn, "stream": True, "leyline": {"session": session}},
            stream=True,
        )
        assert streamed.headers["content-type"].startswith("text/event-stream")
        assert streamed.text.rstrip().endswith("data: [DONE]")
        assert _through(client, "DELETE", f"/leyline/v1/sessions/{session}").status_code == 204
        gone = _through(client, "GET", f"/leyline/v1/sessions/{session}")
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "unknown_session"


def test_an_envelope_needs_the_key_its_inner_request_needs(server: Server) -> None:
    with httpx.Client(base_url=server.base_url, timeout=60) as anonymous:
        refused = _through(anonymous, "GET", "/leyline/v1/capabilities")
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "unauthorized"
    with server.client() as client:
        assert _through(client, "GET", "/leyline/v1/capabilities").status_code == 200


def test_a_lone_surrogate_reaches_the_inner_request_as_its_escape() -> None:
    """Found by the fuzzer: a JSON escape with no UTF-8 form (a lone surrogate) is carried
    as the escape, so the inner route judges it as it would a direct request."""
    raw = b'{"model": "m", "prompt": ".", "leyline": {"route": {"method": "POST", '
    raw += b'"path": "/leyline/v1/sessions", "body": {"text": "a\\udfffb"}}}}'
    got = _client().post("/v1/completions", content=raw).json()
    assert got["path"] == "/leyline/v1/sessions"
    assert json.loads(got["body"]) == {"text": "a\udfffb"}
