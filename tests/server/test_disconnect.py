"""A client that disconnects mid-stream stops its generation and frees its session."""

from __future__ import annotations

import time

import httpx
import pytest

from .conftest import API_KEY, Server

pytestmark = [pytest.mark.slow, pytest.mark.model]

LONG = 400


def test_disconnect_mid_stream_cancels_the_generation(server: Server) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {
        "messages": [{"role": "user", "content": "Write a very long story about a cat."}],
        "max_tokens": LONG,
        "temperature": 0,
        "stream": True,
        "leyline": {"session": "leaver"},
    }
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as stream:
            lines = stream.iter_lines()
            seen = [next(lines) for _ in range(6)]  # a few chunks, then hang up
        assert any('"content"' in line for line in seen)

        # The generation stops at its next token and commits what it made so far.
        prompt = http.post(
            "/leyline/v1/tokenize",
            json={"messages": body["messages"], "add_generation_prompt": True},
        ).json()["tokens"]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            info = http.get("/leyline/v1/sessions/leaver").json()
            if info["num_tokens"] > len(prompt):
                break
            time.sleep(0.2)
        generated = info["num_tokens"] - len(prompt)
        assert 0 < generated < LONG / 2, generated
        follow = http.post(
            "/v1/chat/completions",
            json={"messages": body["messages"], "max_tokens": 2, "leyline": {"session": "leaver"}},
        )
        assert follow.status_code == 200


def test_a_plain_request_whose_client_left_stops_too(server: Server) -> None:
    """Not streamed: the server polls for the disconnect while it generates."""
    import json
    import socket
    from urllib.parse import urlparse

    body = {
        "messages": [{"role": "user", "content": "Write a very long story about a dog."}],
        "max_tokens": LONG,
        "temperature": 0,
        "leyline": {"session": "plain-leaver"},
    }
    raw = json.dumps(body).encode()
    url = urlparse(server.base_url)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {url.hostname}\r\n"
        f"Authorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(raw)}\r\n\r\n"
    ).encode()
    with socket.create_connection((url.hostname, url.port)) as sock:
        sock.sendall(head + raw)
        time.sleep(2.0)  # it is generating now; hang up without reading
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=60) as http:
        prompt = http.post(
            "/leyline/v1/tokenize",
            json={"messages": body["messages"], "add_generation_prompt": True},
        ).json()["tokens"]
        info: dict[str, int] = {}
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # the commit lands when the generation stops
            info = http.get("/leyline/v1/sessions/plain-leaver").json()
            if info.get("num_tokens", 0) > len(prompt):
                break
            time.sleep(0.2)
        generated = info["num_tokens"] - len(prompt)
        assert 0 < generated < LONG / 2, generated
