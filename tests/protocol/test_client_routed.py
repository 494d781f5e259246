"""The typed clients' routed mode: each call as one envelope (``POST /v1/completions`` with
``leyline.route``) and its routing key; answers parsed as direct ones; direct mode unchanged.

A scripted worker (``httpx.MockTransport``) records each request as it arrived and answers
the inner call. The routed client behind a stand-in of sglang-router, on real
``leyline serve`` workers: ``tests/policies/test_routed_client.py``.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from leyline.protocol import ErrorCode, LeylineError, SpliceDirective, TokenSpan
from leyline.protocol.client import AsyncLeylineClient, LeylineClient, LeylineHTTPError
from leyline.protocol.routing import ROUTING_KEY

BASE = "http://router.test"
SPLICE = SpliceDirective(span=TokenSpan(start=2, end=5), replacement="[evicted]")
SKILL = {"skill": "rules-1", "model": "m", "num_tokens": 3, "content_hash": "00" * 32}


@dataclass(frozen=True)
class Seen:
    """One request as the worker got it: the outer request, and what it carried."""

    method: str
    path: str
    key: str | None
    auth: str | None
    body: Any
    """The outer JSON body (None: none)."""

    @property
    def route(self) -> dict[str, Any]:
        route: dict[str, Any] = self.body["leyline"]["route"]
        return route


class Worker:
    """Unpacks envelopes as ``serve/tunnel.py`` does and answers the inner call from a
    small in-memory state (sessions and skills by id)."""

    def __init__(self) -> None:
        self.seen: list[Seen] = []
        self.sessions: set[str] = set()
        self.bare_404 = False
        """Answer like the router itself: a 404 without a body."""

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        headers = request.headers
        seen = Seen(
            request.method,
            request.url.raw_path.decode(),
            headers.get(ROUTING_KEY),
            headers.get("authorization"),
            body,
        )
        self.seen.append(seen)
        if self.bare_404:
            return httpx.Response(404)
        if (seen.method, seen.path) == ("POST", "/v1/completions"):
            route = seen.route
            return self.answer(route["method"], route["path"], route["body"])
        return self.answer(seen.method, seen.path, body)

    def answer(self, method: str, target: str, body: Any) -> httpx.Response:
        path, _, query = target.partition("?")
        if (method, path) == ("GET", "/leyline/v1/capabilities"):
            return httpx.Response(200, json={"verbs": ["splice", "compose"]})
        if (method, path) == ("POST", "/leyline/v1/sessions"):
            session = body.get("session") or "server-named"
            self.sessions.add(session)
            return httpx.Response(200, json={"session": session, "revision": 0, "num_tokens": 2})
        if path.startswith("/leyline/v1/sessions/"):
            session = httpx.URL(path).path.split("/")[4]
            if session not in self.sessions:
                error = {"type": "leyline_error", "code": "unknown_session", "message": "gone"}
                return httpx.Response(404, json={"error": {**error, "field": "session"}})
            if method == "DELETE":
                return httpx.Response(204)
            if path.endswith("/directives"):
                reply = {"session": session, "revision": body["base_revision"] + 1}
                reply |= {
                    "path": "splice",
                    "reused_tokens": 2,
                    "prefilled_tokens": 1,
                    "rotated_tokens": 0,
                }
                return httpx.Response(200, json=reply)
            tokens = [1, 2] if query == "tokens=true" else None
            info = {"session": session, "revision": 0, "num_tokens": 2, "tokens": tokens}
            return httpx.Response(200, json=info)
        if (method, path) == ("POST", "/leyline/v1/skills"):
            return httpx.Response(201, json={**SKILL, "skill": body["skill"]})
        if (method, path) == ("GET", "/leyline/v1/skills"):
            return httpx.Response(200, json={"skills": [SKILL]})
        if (method, path) == ("POST", "/leyline/v1/tokenize"):
            return httpx.Response(200, json={"tokens": [5, 6]})
        return httpx.Response(500, text="boom")


def routed(worker: Worker, **options: Any) -> LeylineClient:
    http = httpx.Client(transport=httpx.MockTransport(worker))
    return LeylineClient(BASE, api_key="k", http_client=http, routed=True, **options)


def episode(client: LeylineClient) -> str:
    """Every kind of call once; the session it created."""
    client.capabilities()
    made = client.create_session(text="hello")
    client.get_session(made.session, include_tokens=True)
    client.apply(made.session, 0, [SPLICE])
    client.with_routing_key(made.session).create_skill("rules-1", tokens=[1, 2, 3])
    client.list_skills()
    client.tokenize("hi")
    client.delete_session(made.session)
    return made.session


def test_each_call_is_one_envelope_with_the_documented_shape() -> None:
    worker = Worker()
    with routed(worker) as client:
        assert client.routed and client.routing_key is None
        session = episode(client)
    assert {(s.method, s.path) for s in worker.seen} == {("POST", "/v1/completions")}
    assert all(s.auth == "Bearer k" for s in worker.seen)  # the client's credentials
    for seen in worker.seen:
        assert set(seen.body) == {"model", "prompt", "max_tokens", "stream", "leyline"}
        assert (seen.body["model"], seen.body["prompt"], seen.body["max_tokens"]) == (
            "default",
            ".",
            1,
        )
        assert seen.body["stream"] is False and set(seen.body["leyline"]) == {"route"}
    routes = [(s.route["method"], s.route["path"]) for s in worker.seen]
    assert routes == [
        ("GET", "/leyline/v1/capabilities"),
        ("POST", "/leyline/v1/sessions"),
        ("GET", f"/leyline/v1/sessions/{session}?tokens=true"),
        ("POST", f"/leyline/v1/sessions/{session}/directives"),
        ("POST", "/leyline/v1/skills"),
        ("GET", "/leyline/v1/skills"),
        ("POST", "/leyline/v1/tokenize"),
        ("DELETE", f"/leyline/v1/sessions/{session}"),
    ]
    bodies = [s.route["body"] for s in worker.seen]
    assert bodies[0] is None and bodies[2] is None and bodies[-1] is None
    assert bodies[1] == {"session": session, "text": "hello", "add_generation_prompt": False}
    assert bodies[3] == {
        "base_revision": 0,
        "directives": [SPLICE.model_dump(mode="json")],
        "options": {"infer_splices": False, "allow_fallback": True},
    }
    assert bodies[4] == {"skill": "rules-1", "tokens": [1, 2, 3]}


def test_session_calls_carry_the_session_and_the_others_the_clients_key() -> None:
    worker = Worker()
    with routed(worker) as client:
        session = episode(client)
    keys = [s.key for s in worker.seen]
    # capabilities: no key (any worker); the skill: the session's key (its worker);
    # list and tokenize: no key.
    assert keys == [None, session, session, session, session, None, None, session]
    assert session.startswith("leyline-")

    keyed = Worker()
    with routed(keyed, routing_key="agent-7", envelope_model="smollm2") as client:
        client.capabilities()
        client.create_session("s-1", tokens=[1, 2])
        client.with_routing_key(None).tokenize("hi")
        client.list_skills()
    assert [s.key for s in keyed.seen] == ["agent-7", "s-1", None, "agent-7"]
    assert {s.body["model"] for s in keyed.seen} == {"smollm2"}
    assert keyed.seen[1].route["body"]["session"] == "s-1"  # a given id is kept


def test_answers_are_parsed_as_direct_ones() -> None:
    worker = Worker()
    with routed(worker) as client:
        made = client.create_session(tokens=[1, 2])
        assert client.get_session(made.session, include_tokens=True).tokens == [1, 2]
        applied = client.apply(made.session, 4, [SPLICE])
        assert (applied.revision, applied.reused_tokens) == (5, 2)
        assert client.create_skill("s-9", tokens=[1, 2, 3]).skill == "s-9"
        assert [s.skill for s in client.list_skills()] == ["rules-1"]
        with pytest.raises(LeylineError) as info:
            client.get_session("gone")
        assert info.value.code is ErrorCode.unknown_session and info.value.field == "session"
        with pytest.raises(LeylineHTTPError) as failed:
            client.detokenize([1])
        assert failed.value.status == 500
        worker.bare_404 = True  # a router without the worker's tunnel behind it
        with pytest.raises(LeylineHTTPError) as bare:
            client.capabilities()
        assert (bare.value.status, bare.value.body) == (404, "")
    assert worker.seen[-3].key == "gone"


def test_direct_mode_is_unchanged() -> None:
    worker = Worker()
    http = httpx.Client(transport=httpx.MockTransport(worker))
    with LeylineClient(BASE, api_key="k", http_client=http, routing_key="ignored") as client:
        assert not client.routed
        session = episode(client)
    assert session == "server-named"  # no id minted: the server names the session
    assert all(s.key is None for s in worker.seen)  # no routing key, even when given one
    assert [(s.method, s.path) for s in worker.seen] == [
        ("GET", "/leyline/v1/capabilities"),
        ("POST", "/leyline/v1/sessions"),
        ("GET", "/leyline/v1/sessions/server-named?tokens=true"),
        ("POST", "/leyline/v1/sessions/server-named/directives"),
        ("POST", "/leyline/v1/skills"),
        ("GET", "/leyline/v1/skills"),
        ("POST", "/leyline/v1/tokenize"),
        ("DELETE", "/leyline/v1/sessions/server-named"),
    ]
    assert worker.seen[1].body == {"text": "hello", "add_generation_prompt": False}


def test_the_async_client_sends_what_the_sync_one_does() -> None:
    sync_worker, async_worker = Worker(), Worker()
    with routed(sync_worker, routing_key="k0") as client:
        client.capabilities()
        client.create_session("s-1", text="hello")
        client.with_routing_key("s-1").create_skill("rules-1", tokens=[1, 2, 3])
        client.delete_session("s-1")

    async def go() -> None:
        http = httpx.AsyncClient(transport=httpx.MockTransport(async_worker))
        async with AsyncLeylineClient(
            BASE, api_key="k", http_client=http, routed=True, routing_key="k0"
        ) as client:
            assert client.routed and client.routing_key == "k0"
            await client.capabilities()
            await client.create_session("s-1", text="hello")
            await client.with_routing_key("s-1").create_skill("rules-1", tokens=[1, 2, 3])
            await client.delete_session("s-1")
            minted = await client.create_session(text="x")
            assert minted.session.startswith("leyline-")
            assert async_worker.seen[-1].key == minted.session

    asyncio.run(go())
    assert async_worker.seen[:-1] == sync_worker.seen
