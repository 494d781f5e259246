"""The SGLang plugin's dispatch of OpenAI requests, as ASGI (no SGLang needed): a body with a
top-level ``leyline`` key goes to the plugin's app, anything else to SGLang's, byte for byte;
an oversized body is refused with the protocol's error. The live server runs the same
middleware in ``tests/live/test_chat.py``."""

from __future__ import annotations

import json

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from leyline.serve.openai_dispatch import LeylineDispatch

QUOTED_WORD = {"role": "user", "content": '"leyline"'}


def _echo(name: str) -> FastAPI:
    """An app that says who answered and what body it read."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    @app.post("/v1/completions")
    @app.post("/generate")
    async def echo(request: Request) -> dict[str, str]:
        return {"app": name, "body": (await request.body()).decode()}

    return app


def _client(max_body_bytes: int = 1 << 20) -> TestClient:
    sglang = _echo("sglang")
    sglang.add_middleware(
        LeylineDispatch, leyline_app=_echo("leyline"), max_body_bytes=max_body_bytes
    )
    return TestClient(sglang)


@pytest.mark.parametrize(
    ("path", "body", "answered_by"),
    [
        ("/v1/chat/completions", {"messages": [], "leyline": {"session": "s"}}, "leyline"),
        ("/v1/completions", {"prompt": [1, 2], "leyline": {}}, "leyline"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "sglang"),
        ("/v1/chat/completions", {"messages": [QUOTED_WORD]}, "sglang"),  # a value, not a key
        ("/generate", {"input_ids": [1], "leyline": {}}, "sglang"),  # not an OpenAI route
    ],
)
def test_requests_go_where_their_body_says(
    path: str, body: dict[str, object], answered_by: str
) -> None:
    raw = json.dumps(body)
    reply = _client().post(path, content=raw, headers={"content-type": "application/json"})
    assert reply.status_code == 200, reply.text
    assert reply.json() == {"app": answered_by, "body": raw}  # the body arrives unchanged


def test_malformed_json_is_sglangs_to_answer() -> None:
    reply = _client().post("/v1/chat/completions", content=b'{"leyline": ')
    assert reply.json() == {"app": "sglang", "body": '{"leyline": '}


def test_an_oversized_body_is_refused_with_the_protocols_error() -> None:
    reply = _client(max_body_bytes=64).post("/v1/chat/completions", content=b"x" * 65)
    assert reply.status_code == 413
    assert reply.json()["error"]["code"] == "limit_exceeded"
