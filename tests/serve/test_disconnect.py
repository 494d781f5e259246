"""A client that disconnects mid-stream stops its generation and frees its session; one
that disconnects while its directives wait for the model changes nothing."""

from __future__ import annotations

import json
import random
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest

from .conftest import API_KEY, Server, serve

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
    body = {
        "messages": [{"role": "user", "content": "Write a very long story about a dog."}],
        "max_tokens": LONG,
        "temperature": 0,
        "leyline": {"session": "plain-leaver"},
    }
    _send_and_hang_up(server, "/v1/chat/completions", body, after_s=2.0)  # mid-generation
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


@pytest.fixture(scope="module")
def one_job_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One model job at a time (``--max-running-jobs 1``): a long prefill holds the model
    whole, so every job submitted after it waits in the queue until it ends."""
    log = tmp_path_factory.mktemp("server-one-job") / "serve.log"
    with serve(log, "--max-running-jobs", "1", "--log-level", "warning") as running:
        yield running


def _send_and_hang_up(
    server: Server, path: str, body: dict[str, Any], *, after_s: float = 0.3
) -> None:
    """POST ``body`` on a raw socket and close it ``after_s`` later without reading the
    answer (by default once it is read, checked and planned: its job then waits)."""
    raw = json.dumps(body).encode()
    url = urlparse(server.base_url)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {url.hostname}\r\n"
        f"Authorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(raw)}\r\n\r\n"
    ).encode()
    assert url.hostname is not None and url.port is not None
    with socket.create_connection((url.hostname, url.port)) as sock:
        sock.sendall(head + raw)
        time.sleep(after_s)


def test_a_queued_batch_whose_client_left_changes_nothing(one_job_server: Server) -> None:
    """A directive batch, alone or with a streamed chat turn, queued behind a long prefill:
    its client hangs up before it runs, and the session keeps its revision (all-or-nothing:
    the batch never starts)."""
    splice = {"verb": "splice", "span": {"start": 1, "end": 2}, "replacement": " cat"}
    messages = [{"role": "user", "content": "one two three four five six"}]
    rng = random.Random(45)  # a prompt no cache holds: its whole prefill is one long job
    prompt = [rng.randrange(1000, 40000) for _ in range(4000)]
    with one_job_server.client() as http, ThreadPoolExecutor(1) as pool:
        revision = {}
        for session in ("left-route", "left-chat"):
            created = http.post(
                "/leyline/v1/sessions", json={"session": session, "messages": messages}
            )
            assert created.status_code == 201, created.text
            revision[session] = created.json()["revision"]

        def long_prefill() -> httpx.Response:
            with one_job_server.client() as other:
                return other.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})

        long = pool.submit(long_prefill)
        time.sleep(0.5)  # it holds the model now
        base = revision["left-route"]
        batch = {"base_revision": base, "directives": [splice]}
        _send_and_hang_up(one_job_server, "/leyline/v1/sessions/left-route/directives", batch)
        chat = {
            "messages": messages,
            "max_tokens": 2,
            "stream": True,
            "leyline": {
                "session": "left-chat",
                "base_revision": revision["left-chat"],
                "directives": [splice],
            },
        }
        _send_and_hang_up(one_job_server, "/v1/chat/completions", chat)
        assert not long.done(), "the prefill ended before the clients left: lengthen it"
        assert long.result().status_code == 200

        # The same batch again, on the same revision: it waits for the session's lease
        # (so for the queued request to end) and applies, so nothing applied before it.
        for session, base in revision.items():
            again = http.post(
                f"/leyline/v1/sessions/{session}/directives",
                json={"base_revision": base, "directives": [splice]},
            )
            assert again.status_code == 200, again.text
            assert again.json()["revision"] == base + 1
        metrics = http.get("/metrics").text
        assert 'status="499"' in metrics  # counted as clients that left
