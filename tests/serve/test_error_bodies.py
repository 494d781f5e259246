"""Every failure is the protocol's error body: bad bytes, lone surrogates, unknown routes,
wrong methods and internal errors, on the real server; and the route guard on a bare app.
"""

from __future__ import annotations

import http.client
import json
import logging
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest
from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.responses import PlainTextResponse
from fastapi.testclient import TestClient
from pydantic import BaseModel

from leyline.core.errors import SpliceUnsupportedError
from leyline.core.route_guard import MAX_JSON_DEPTH, LeylineRoute, check_json, unmatched_router
from leyline.protocol import FallbackReason
from tests.meta.fresh_python import loaded_in_fresh_python

from .conftest import API_KEY, MAX_BODY, Server

BAD = "a\\ud800b"  # as it travels: a JSON escape of a lone high surrogate
SESSION = "error-bodies"


class Wire:
    """One keep-alive HTTP/1.1 connection, to see whether an error drops it."""

    def __init__(self, base_url: str) -> None:
        self.conn = http.client.HTTPConnection(urlsplit(base_url).netloc, timeout=120)
        self.conn.connect()
        self.sock = self.conn.sock

    def send(self, method: str, path: str, raw: bytes = b"") -> tuple[int, Any, dict[str, str]]:
        headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
        self.conn.request(method, path, body=raw, headers=headers)
        reply = self.conn.getresponse()
        body = reply.read()
        return reply.status, json.loads(body) if body else None, dict(reply.getheaders())

    def still_open(self) -> bool:
        return self.conn.sock is not None and self.conn.sock is self.sock

    def close(self) -> None:
        self.conn.close()


@pytest.fixture()
def wire(server: Server) -> Iterator[Wire]:
    connection = Wire(server.base_url)
    yield connection
    connection.close()


def assert_protocol_error(body: Any, code: str, field: str | None = None) -> None:
    error = body["error"]
    assert set(error) == {"type", "code", "message", "field"}, body
    assert error["type"] == "leyline_error" and error["code"] == code and error["message"], body
    if field is not None:
        assert error["field"] == field, body


def _splice(verb: str) -> str:
    return (
        f'{{"base_revision": 1, "directives": [{{"verb": "{verb}", '
        f'"span": {{"start": 1, "end": 2}}, "replacement": "{BAD}"}}]}}'
    )


USER = f'{{"role": "user", "content": "{BAD}"}}'
DIRECTIVES = f"/leyline/v1/sessions/{SESSION}/directives"
SURROGATES: list[tuple[str, str, str, str]] = [
    ("chat content", "/v1/chat/completions", f'{{"messages": [{USER}]}}', "messages[0].content"),
    (
        "chat content part",
        "/v1/chat/completions",
        f'{{"messages": [{{"role": "user", "content": [{{"type": "text", "text": "{BAD}"}}]}}]}}',
        "messages[0].content[0].text",
    ),
    (
        "tool-call arguments",
        "/v1/chat/completions",
        '{"messages": [{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", '
        f'"function": {{"name": "f", "arguments": "{{\\"q\\": \\"{BAD}\\"}}"}}}}]}}, '
        '{"role": "tool", "tool_call_id": "c1", "content": "ok"}]}',
        "messages[0].tool_calls[0].function.arguments",
    ),
    (
        "stop string",
        "/v1/chat/completions",
        f'{{"messages": [{{"role": "user", "content": "hi"}}], "stop": ["{BAD}"]}}',
        "stop[0]",
    ),
    ("an object key", "/v1/completions", f'{{"prompt": "hi", "{BAD}": 1}}', "a\\ud800b"),
    ("completions prompt", "/v1/completions", f'{{"prompt": "{BAD}"}}', "prompt"),
    ("tokenize text", "/leyline/v1/tokenize", f'{{"text": "{BAD}"}}', "text"),
    ("session text", "/leyline/v1/sessions", f'{{"text": "{BAD}"}}', "text"),
    (
        "session messages",
        "/leyline/v1/sessions",
        f'{{"messages": [{USER}]}}',
        "messages[0].content",
    ),
    ("splice replacement", DIRECTIVES, _splice("splice"), "directives[0].replacement"),
    ("forget replacement", DIRECTIVES, _splice("forget"), "directives[0].replacement"),
    (
        "erratum text",
        DIRECTIVES,
        f'{{"base_revision": 1, "directives": [{{"verb": "erratum", "text": "{BAD}"}}]}}',
        "directives[0].text",
    ),
    (
        "splice in a chat request",
        "/v1/chat/completions",
        f'{{"messages": [{{"role": "user", "content": "hi"}}], "leyline": {{"session": '
        f'"{SESSION}", "base_revision": 1, "directives": [{{"verb": "splice", "span": '
        f'{{"start": 1, "end": 2}}, "replacement": "{BAD}"}}]}}}}',
        "leyline.directives[0].replacement",
    ),
]


@pytest.mark.parametrize(
    ("name", "path", "raw", "field"), SURROGATES, ids=[c[0] for c in SURROGATES]
)
@pytest.mark.slow
@pytest.mark.model
def test_a_lone_surrogate_anywhere_is_a_422_naming_the_field(
    wire: Wire, name: str, path: str, raw: str, field: str
) -> None:
    # A real session, so that without the check the directives would reach the engine.
    create = json.dumps({"session": SESSION, "text": "one two three four"}).encode()
    assert wire.send("POST", "/leyline/v1/sessions", create)[0] in (201, 409)
    try:
        status, body, _ = wire.send("POST", path, raw.encode())
        assert status == 422, body
        assert_protocol_error(body, "invalid_directive", field)
        # The same connection serves the next request (after a dropped one, this raises).
        pair = b'{"text": "a\\ud83d\\ude00b"}'  # a valid surrogate pair is fine
        status, body, _ = wire.send("POST", "/leyline/v1/tokenize", pair)
        assert status == 200 and body["tokens"], body
        assert wire.still_open()
    finally:
        wire.send("DELETE", f"/leyline/v1/sessions/{SESSION}")


def _case(
    name: str, method: str, path: str, raw: bytes, status: int, code: str, field: str | None
) -> tuple[str, str, str, bytes, int, str, str | None]:
    return name, method, path, raw, status, code, field


def _deep(depth: int) -> bytes:
    return b'{"text": "x", "tools": ' + b"[" * depth + b"]" * depth + b"}"


BODIES = [
    _case("invalid UTF-8", "POST", "/v1/completions", b'{"prompt": "\xff"}', 422,
          "invalid_directive", "body"),
    _case("UTF-8 of a surrogate", "POST", "/leyline/v1/tokenize", b'{"text": "\xed\xa0\x80"}',
          422, "invalid_directive", "body"),
    _case("malformed JSON", "POST", "/v1/chat/completions", b'{"messages": [', 422,
          "invalid_directive", "body"),
    _case("NaN", "POST", "/v1/completions", b'{"prompt": "hi", "temperature": NaN}', 422,
          "invalid_directive", "temperature"),
    _case("1,000-deep JSON", "POST", "/v1/chat/completions", b"[" * 1000 + b"]" * 1000, 413,
          "limit_exceeded", "body"),
    _case("100-deep tools", "POST", "/leyline/v1/tokenize", _deep(100), 413, "limit_exceeded",
          "body"),
    _case("unknown route", "POST", "/v2/nothing", b"{}", 404, "not_found", None),
    _case("unknown GET route", "GET", "/leyline/v1/nothing", b"", 404, "not_found", None),
    _case("wrong method", "DELETE", "/v1/models", b"", 405, "method_not_allowed", None),
    _case("wrong method on a resource", "PUT", "/leyline/v1/sessions", b"{}", 405,
          "method_not_allowed", None),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "method", "path", "raw", "status", "code", "field"), BODIES, ids=[c[0] for c in BODIES]
)
@pytest.mark.slow
@pytest.mark.model
def test_bad_bytes_and_routes_get_protocol_bodies(
    wire: Wire,
    name: str,
    method: str,
    path: str,
    raw: bytes,
    status: int,
    code: str,
    field: str | None,
) -> None:
    got, body, headers = wire.send(method, path, raw)
    assert got == status, body
    assert_protocol_error(body, code, field)
    if code == "method_not_allowed":
        assert headers.get("allow"), headers
    got, body, _ = wire.send("GET", "/v1/models")
    assert got == 200, body


ROUTES = {
    "/health": {"GET"},
    "/metrics": {"GET"},
    "/v1/models": {"GET"},
    "/v1/chat/completions": {"POST"},
    "/v1/completions": {"POST"},
    "/leyline/v1/capabilities": {"GET"},
    "/leyline/v1/sessions": {"POST"},
    f"/leyline/v1/sessions/{SESSION}": {"GET", "DELETE"},
    DIRECTIVES: {"POST"},
    "/leyline/v1/skills": {"GET", "POST"},
    "/leyline/v1/skills/some-skill": {"GET", "DELETE"},
    "/leyline/v1/tokenize": {"POST"},
    "/leyline/v1/detokenize": {"POST"},
    "/leyline/v1/schema": {"GET"},
}
UNKNOWN = ["/", "/v1", "/v1/embeddings", "/v1/models/x", "/leyline/v1", "/leyline/v2/schema"]
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "PROPFIND"]


@pytest.mark.slow
@pytest.mark.model
def test_every_wrong_method_and_unknown_path_is_a_protocol_error(wire: Wire) -> None:
    for path, allowed in ROUTES.items():
        for method in METHODS:
            if method in allowed:
                continue
            got, body, headers = wire.send(method, path, b"{}")
            assert got == 405, (method, path, body)
            assert_protocol_error(body, "method_not_allowed")
            assert set(headers["allow"].split(", ")) == allowed, (method, path, headers)
    for path in UNKNOWN:
        for method in METHODS:
            got, body, _ = wire.send(method, path, b"{}")
            assert got == 404, (method, path, body)
            assert_protocol_error(body, "not_found")
    assert wire.still_open()


@pytest.mark.slow
@pytest.mark.model
def test_head_is_the_get_without_its_body(wire: Wire) -> None:
    """HTTP forbids a body in a HEAD answer: it gets the GET's status and headers."""
    for path, allowed in [*ROUTES.items(), *((p, set()) for p in UNKNOWN)]:
        got, body, headers = wire.send("HEAD", path)
        status = 200 if "GET" in allowed else 405 if allowed else 404
        if path == f"/leyline/v1/sessions/{SESSION}":
            status = 404  # GET answers unknown_session: no such session
        if path == "/leyline/v1/skills/some-skill":
            status = 404  # unknown_skill
        assert (got, body) == (status, None), (path, got, body)
        assert int(headers["content-length"]) > 0  # the length the GET's body has
        if status == 405:
            assert set(headers["allow"].split(", ")) == allowed, (path, headers)
    assert wire.still_open()


@pytest.mark.slow
@pytest.mark.model
def test_an_oversize_body_without_a_length_is_a_413(server: Server) -> None:
    def chunks() -> Iterator[bytes]:  # chunked: the limit is only seen while reading
        yield b'{"prompt": "'
        for _ in range(MAX_BODY // 10_000 + 2):
            yield b"x" * 10_000
        yield b'"}'

    with server.client() as http:
        reply = http.post("/v1/completions", content=chunks())
        assert reply.status_code == 413, reply.text
        assert_protocol_error(reply.json(), "limit_exceeded", "body")


# -- in process: an engine failure is a logged 500, not a 422 ------------------------------


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    from leyline.serve.serve import build_app
    from leyline.serve.settings import ServerSettings

    app = build_app(ServerSettings(max_new_tokens=2), prefix_cache_bytes=0)
    with TestClient(app) as test_client:  # runs the lifespan (the worker shuts down after)
        yield test_client


@pytest.mark.slow
@pytest.mark.model
def test_an_internal_value_error_is_a_logged_500(
    client: TestClient, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(text: str) -> tuple[int, ...]:
        raise ValueError("an engine invariant broke")

    engine = client.app.state.engine  # type: ignore[attr-defined]
    monkeypatch.setattr(engine, "encode", broken)
    with caplog.at_level(logging.ERROR, logger="leyline.server"):
        reply = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
    assert reply.status_code == 500, reply.text
    assert_protocol_error(reply.json(), "internal_error")
    assert "an engine invariant broke" not in reply.text  # internals stay in the log
    logged = [r for r in caplog.records if r.name == "leyline.server" and r.exc_info]
    assert logged and "an engine invariant broke" in str(logged[-1].exc_info[1])  # type: ignore[index]
    monkeypatch.undo()
    assert client.post("/v1/completions", json={"prompt": "hello"}).status_code == 200


@pytest.mark.slow
@pytest.mark.model
def test_out_of_range_sampling_is_a_422_at_the_request_boundary(client: TestClient) -> None:
    # SamplingParams' own ValueErrors are internal now: the request models check first.
    for field, value in [("temperature", -1), ("top_p", 0), ("max_tokens", 0), ("logprobs", 99)]:
        reply = client.post("/v1/completions", json={"prompt": "hello", field: value})
        assert reply.status_code == 422, (field, reply.text)
        assert_protocol_error(reply.json(), "invalid_directive", field)


# -- the route guard on a bare app: only its own routes change -----------------------------


class Echo(BaseModel):
    text: str


class Teapot(Exception):
    pass


def bare_app() -> FastAPI:
    def routes(router: APIRouter) -> APIRouter:
        @router.post("/echo")
        async def echo(body: Echo) -> dict[str, int]:
            return {"length": len(body.text)}

        @router.post("/fail/{kind}")
        async def fail(kind: str) -> None:
            errors: dict[str, Exception] = {
                "value": ValueError("invariant"),
                "assertion": AssertionError("invariant"),
                "splice": SpliceUnsupportedError(FallbackReason.unsupported_rope, "dynamic NTK"),
                "http": HTTPException(404, "no such widget"),
                "teapot": Teapot(),
            }
            raise errors[kind]

        return router

    app = FastAPI()
    app.include_router(routes(APIRouter(prefix="/guarded", route_class=LeylineRoute)))
    app.include_router(routes(APIRouter(prefix="/plain")))

    @app.exception_handler(Teapot)
    async def teapot(_: Request, __: Teapot) -> PlainTextResponse:
        return PlainTextResponse("host handled it", status_code=418)

    return app


def test_route_guard_answers_for_its_routes_only() -> None:
    client = TestClient(
        bare_app(), raise_server_exceptions=False, headers={"Content-Type": "application/json"}
    )
    surrogate = f'{{"text": "{BAD}"}}'.encode()

    guarded = client.post("/guarded/echo", content=surrogate)
    assert guarded.status_code == 422
    assert_protocol_error(guarded.json(), "invalid_directive", "text")
    plain = client.post("/plain/echo", content=surrogate)
    assert plain.status_code == 200 and plain.json() == {"length": 3}  # FastAPI as ever

    guarded = client.post("/guarded/echo", content=b'{"text": ')
    assert_protocol_error(guarded.json(), "invalid_directive", "body")
    plain = client.post("/plain/echo", content=b'{"text": ')
    assert plain.status_code == 422 and "detail" in plain.json()

    guarded = client.post("/guarded/echo", json={"text": 5})
    assert guarded.status_code == 422
    assert_protocol_error(guarded.json(), "invalid_directive", "text")

    for kind in ("value", "assertion"):
        guarded = client.post(f"/guarded/fail/{kind}")
        assert guarded.status_code == 500
        assert_protocol_error(guarded.json(), "internal_error")
        plain = client.post(f"/plain/fail/{kind}")
        assert plain.status_code == 500 and plain.text == "Internal Server Error"

    guarded = client.post("/guarded/fail/splice")
    assert guarded.status_code == 422
    assert_protocol_error(guarded.json(), "splice_refused", "leyline.options.allow_fallback")
    guarded = client.post("/guarded/fail/http")
    assert guarded.status_code == 404
    assert_protocol_error(guarded.json(), "not_found")
    assert "no such widget" in guarded.json()["error"]["message"]
    assert client.post("/plain/fail/http").json() == {"detail": "no such widget"}

    # A type the host app registered a handler for stays the host's.
    assert client.post("/guarded/fail/teapot").status_code == 418
    # No app-level handlers come with the route class: unknown routes are FastAPI's.
    assert client.get("/nothing").json() == {"detail": "Not Found"}


def test_the_unmatched_router_answers_under_its_prefix_only() -> None:
    """On a host app (SGLang's), unknown paths and wrong methods under the prefix get the
    protocol's 404 / 405 (with ``Allow``); the routes there and the host's own unmatched
    answers are unchanged."""
    app = FastAPI()
    known = APIRouter(route_class=LeylineRoute)

    @known.post("/api/items/{item}")
    async def post_item(item: str) -> dict[str, str]:
        return {"item": item}

    @known.get("/api/items/{item}")
    async def get_item(item: str) -> dict[str, str]:
        return {"item": item}

    @app.put("/host/thing")
    async def host_thing() -> dict[str, str]:
        return {}

    app.include_router(known)
    app.include_router(unmatched_router("/api", known))
    client = TestClient(app, raise_server_exceptions=False)
    assert client.get("/api/items/a").json() == {"item": "a"}
    wrong = client.put("/api/items/a", content=b"not json")
    assert wrong.status_code == 405 and wrong.headers["allow"] == "GET, POST"
    assert_protocol_error(wrong.json(), "method_not_allowed")
    assert "the route takes GET, POST" in wrong.json()["error"]["message"]
    missing = client.get("/api/no/such/route")
    assert missing.status_code == 404
    assert_protocol_error(missing.json(), "not_found")
    assert client.get("/nothing").json() == {"detail": "Not Found"}  # the host's, as ever
    assert client.post("/host/thing").json() == {"detail": "Method Not Allowed"}


def test_check_json_limits_depth_and_names_paths() -> None:
    def nested(depth: int) -> Any:
        value: Any = "leaf"
        for _ in range(depth):
            value = [value]
        return value

    check_json(nested(MAX_JSON_DEPTH))
    with pytest.raises(Exception, match="deeper than") as deep:
        check_json(nested(MAX_JSON_DEPTH + 1))
    assert getattr(deep.value, "field", None) == "body"
    check_json({"emoji": "\U0001f600"})  # a surrogate pair decodes to one code point
    with pytest.raises(Exception, match="surrogate") as lone:
        check_json({"messages": [{"content": ["ok", "x\udc00"]}]})
    assert getattr(lone.value, "field", None) == "messages[0].content[1]"
    with pytest.raises(Exception, match="finite") as nan:
        check_json({"a": [1.0, float("inf")]})
    assert getattr(nan.value, "field", None) == "a[1]"


def test_route_guard_imports_without_torch() -> None:
    assert loaded_in_fresh_python("import leyline.core.route_guard") == []
