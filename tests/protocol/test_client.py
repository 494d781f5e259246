"""The typed client builds the documented requests and decodes typed errors.

The Leyline server lands with the server issue; until then these tests answer the client
through httpx's in-process transport with handlers that check each request.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from leyline.protocol import (
    ErrorCode,
    LeylineError,
    LeylineResponse,
    Path,
    SpliceDirective,
    TokenSpan,
)
from leyline.protocol.client import AsyncLeylineClient, LeylineClient, LeylineHTTPError

SPLICE = SpliceDirective(span=TokenSpan(start=2, end=5), replacement="[evicted]")
APPLIED = LeylineResponse(
    session="a/b",
    revision=4,
    path=Path.splice,
    reused_tokens=10,
    prefilled_tokens=3,
    rotated_tokens=7,
)


def handler(request: httpx.Request) -> httpx.Response:
    route = (request.method, request.url.raw_path.decode())
    if route == ("GET", "/leyline/v1/capabilities"):
        assert request.headers["authorization"] == "Bearer k"
        return httpx.Response(200, json={"verbs": ["splice", "forget"], "architectures": ["gqa"]})
    if route == ("POST", "/leyline/v1/sessions/a%2Fb/directives"):
        body = json.loads(request.content)
        assert body == {
            "base_revision": 3,
            "directives": [SPLICE.model_dump(mode="json")],
            "options": {"infer_splices": False, "allow_fallback": True},
        }
        return httpx.Response(200, content=APPLIED.model_dump_json())
    if route == ("GET", "/leyline/v1/sessions/gone"):
        return httpx.Response(
            404,
            json={
                "error": {
                    "type": "leyline_error",
                    "code": "unknown_session",
                    "message": "no session 'gone'",
                    "field": "session",
                }
            },
        )
    if route == ("DELETE", "/leyline/v1/sessions/s1"):
        return httpx.Response(204)
    if route == ("POST", "/leyline/v1/tokenize"):
        assert json.loads(request.content) == {"text": "hi", "add_generation_prompt": False}
        return httpx.Response(200, json={"tokens": [5, 6]})
    return httpx.Response(500, text="boom")


def make_sync() -> LeylineClient:
    http = httpx.Client(transport=httpx.MockTransport(handler))
    return LeylineClient("http://leyline.test", api_key="k", http_client=http)


def test_sync_client_speaks_the_documented_routes() -> None:
    with make_sync() as client:
        assert client.capabilities().verbs == ["splice", "forget"]
        assert client.apply("a/b", 3, [SPLICE]) == APPLIED
        assert client.tokenize("hi").tokens == [5, 6]
        assert client.delete_session("s1") is None


def test_typed_errors_come_back_as_leyline_errors() -> None:
    with make_sync() as client, pytest.raises(LeylineError) as info:
        client.get_session("gone")
    assert info.value.code is ErrorCode.unknown_session and info.value.field == "session"


def test_non_protocol_failures_raise_http_errors() -> None:
    with make_sync() as client, pytest.raises(LeylineHTTPError) as info:
        client.detokenize([1])
    assert info.value.status == 500


def test_bad_arguments_fail_before_any_request() -> None:
    with make_sync() as client, pytest.raises(ValueError, match="at most one of"):
        client.create_session("s", text="a", tokens=[1])


def test_async_client_matches_the_sync_one() -> None:
    async def go() -> LeylineResponse:
        http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        async with AsyncLeylineClient(
            "http://leyline.test", api_key="k", http_client=http
        ) as client:
            assert (await client.capabilities()).verbs == ["splice", "forget"]
            return await client.apply("a/b", 3, [SPLICE])

    assert asyncio.run(go()) == APPLIED
