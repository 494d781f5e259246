"""16 clients on 16 sessions plus conflicting edits on one: all finish, no lost update."""

from __future__ import annotations

import concurrent.futures as futures
from typing import Any

import httpx
import pytest

from .conftest import API_KEY, Server

pytestmark = [pytest.mark.slow, pytest.mark.model]

CLIENTS = 16
EDITORS = 6


def _two_turns(base_url: str, i: int) -> list[str]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    messages = [{"role": "user", "content": f"Say the number {i}."}]
    paths = []
    with httpx.Client(base_url=base_url, headers=headers, timeout=300) as http:
        for _ in range(2):
            reply = http.post(
                "/v1/chat/completions",
                json={
                    "messages": messages,
                    "max_tokens": 3,
                    "temperature": 0,
                    "leyline": {"session": f"crowd-{i}"},
                },
            )
            reply.raise_for_status()
            body = reply.json()
            paths.append(body["leyline"]["path"])
            messages += [
                {"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                {"role": "user", "content": "Again."},
            ]
    return paths


def _edit(base_url: str, revision: int, k: int) -> int:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    directive = {"verb": "splice", "span": {"start": 2, "end": 3}, "replacement": [100 + k]}
    with httpx.Client(base_url=base_url, headers=headers, timeout=300) as http:
        reply = http.post(
            "/leyline/v1/sessions/contested/directives",
            json={"base_revision": revision, "directives": [directive]},
        )
    return reply.status_code


def test_many_sessions_and_conflicting_edits_all_finish(server: Server) -> None:
    with server.client() as http:
        created = http.post(
            "/leyline/v1/sessions",
            json={"session": "contested", "text": "one two three four five six seven eight"},
        )
        assert created.status_code == 201
        revision = created.json()["revision"]

    with futures.ThreadPoolExecutor(CLIENTS + EDITORS) as pool:
        turns = [pool.submit(_two_turns, server.base_url, i) for i in range(CLIENTS)]
        edits = [pool.submit(_edit, server.base_url, revision, k) for k in range(EDITORS)]
        _, pending = futures.wait(turns + edits, timeout=600)
    assert not pending, "requests still running after 10 minutes: a deadlock?"

    for turn in turns:
        first, second = turn.result()
        # A fresh session reuses nothing unless another client's identical prompt reached
        # the shared prefix cache first; its second turn extends its own session.
        assert first in ("reprefill", "prefix_hit") and second == "prefix_hit"
    statuses = sorted(e.result() for e in edits)
    # Every editor addressed the same revision: exactly one wins, the rest conflict.
    assert statuses == [200] + [409] * (EDITORS - 1)
    with server.client() as http:
        after: dict[str, Any] = http.get("/leyline/v1/sessions/contested").json()
    assert after["revision"] == revision + 1
