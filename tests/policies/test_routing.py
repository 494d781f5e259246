"""The wrappers' side of running behind a router, on a TOY worker (no model, no torch): the
routing key on every request of a session, routed mode's envelopes, a lost session going
on in a new one, and the re-sends while a worker cannot be reached.

The worker is ``compose_server`` (a SCRIPTED Leyline server on the toy rendering) behind a
transport that also unpacks envelopes, as ``leyline serve``'s tunnel does, and honours
``options.require_session``. The same on two real ``leyline serve`` workers behind a
stand-in of sglang-router: ``test_router_stand_in.py``.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import openai
import pytest

from leyline.policies import AsyncLeylineOpenAI, LeylineOpenAI, TurnPlanner
from leyline.policies.middleware_core import Episode
from leyline.policies.middleware_routed import BACKOFF_S, chat_body
from leyline.policies.middleware_wire import ROUTING_KEY

from .compose_server import BASE, OPENAI_HTTPX, ComposeServer
from .transcripts import Msg, assistant, call, system, tool, user, view_output

POLICY = "truncate:keep_last=1"
UPSTREAM = {"error": {"type": "Internal Server Error", "code": "call_upstream_request_error"}}


def turn(n: int) -> list[Msg]:
    return [assistant(call(f"c{n}", "view", path=f"f{n}.py")), tool(f"c{n}", view_output("f", n))]


def opening() -> list[Msg]:
    return [system(), user("Fix the failing test."), *turn(1)]


def step(wrapper: LeylineOpenAI, history: list[Any], n: int, **options: Any) -> list[Any]:
    done = wrapper.chat.completions.create(model="toy", messages=history, **options)
    if options.get("stream"):
        with done as stream:
            list(stream)
        return [*history, *turn(n)]  # the agent's scripted call replaces the reply
    return [*history, done.choices[0].message, *turn(n)]


@dataclass(frozen=True)
class Seen:
    """One request as the worker received it (an envelope as it arrived, unpacked)."""

    method: str
    path: str
    key: str | None
    body: Any
    route: dict[str, Any] | None = None
    """The envelope's ``leyline.route`` (None: sent directly)."""

    @property
    def inner(self) -> tuple[str, str]:
        """The method and path of the request the worker ran."""
        if self.route is not None:
            return self.route["method"], self.route["path"]
        return self.method, self.path


class ToyWorker:
    """``ComposeServer`` that also takes envelopes and ``options.require_session``.

    ``failures``: what the next enveloped turns get instead of an answer (a status sent as
    the router's ``call_upstream_request_error`` or 503, or ``"connect"``: no connection);
    ``lose``: enveloped turns run, then answered 500 (the answer lost on the way back).
    """

    def __init__(self) -> None:
        self.server = ComposeServer()
        self.seen: list[Seen] = []
        self.failures: list[int | str] = []
        self.lose = 0
        self.typed_204 = False
        """A 204 says its empty body is JSON (a proxy on the way that adds a content type)."""
        self.applied: list[tuple[str, int]] = []
        """Each batch run to a 200: its session and base revision."""

    def openai(self) -> openai.OpenAI:
        http = OPENAI_HTTPX.Client(transport=OPENAI_HTTPX.MockTransport(self.handle))
        return openai.OpenAI(base_url=f"{BASE}/v1", api_key="t", max_retries=0, http_client=http)

    def async_openai(self) -> openai.AsyncOpenAI:
        http = OPENAI_HTTPX.AsyncClient(transport=OPENAI_HTTPX.MockTransport(self.handle))
        return openai.AsyncOpenAI(
            base_url=f"{BASE}/v1", api_key="t", max_retries=0, http_client=http
        )

    def handle(self, request: Any) -> Any:
        content: bytes = request.content
        body = json.loads(content) if content else None
        method, path = request.method, request.url.path
        route = None
        if (method, path) == ("POST", "/v1/completions"):
            route = body["leyline"]["route"]
            method, path = route["method"], route["path"]
            content = json.dumps(route["body"]).encode() if route["body"] is not None else b""
        self.seen.append(
            Seen(request.method, request.url.path, request.headers.get(ROUTING_KEY), body, route)
        )
        turn = route is not None and path == "/v1/chat/completions"
        if turn and self.failures:
            failure = self.failures.pop(0)
            if failure == "connect":
                raise OPENAI_HTTPX.ConnectError("worker unreachable", request=request)
            error = UPSTREAM if failure == 500 else {"error": {"code": "no_available_workers"}}
            return OPENAI_HTTPX.Response(int(failure), json=error)
        status, answer = self.answer(method, path, content)
        if turn and self.lose:
            self.lose -= 1
            return OPENAI_HTTPX.Response(500, json=UPSTREAM)
        if isinstance(answer, bytes):
            return OPENAI_HTTPX.Response(
                status, content=answer, headers={"content-type": "text/event-stream"}
            )
        if answer is not None:
            return OPENAI_HTTPX.Response(status, json=answer)
        typed = {"content-type": "application/json"} if self.typed_204 else {}
        return OPENAI_HTTPX.Response(status, headers=typed)

    def answer(self, method: str, path: str, content: bytes) -> tuple[int, Any]:
        body = json.loads(content) if content else {}
        leyline = body.get("leyline") or {}
        if (method, path) == ("POST", "/v1/chat/completions") and leyline:
            required = (leyline.get("options") or {}).get("require_session")
            if required and leyline.get("session") not in self.server.sessions:
                error = {"code": "unknown_session", "message": "gone", "type": "leyline_error"}
                return 404, {"error": error}
        status, answer = self.server.answer(method, path, content)
        if (method, path) == ("GET", "/leyline/v1/capabilities"):
            answer = {**answer, "require_session": True}
        if status == 200 and leyline.get("directives"):
            self.applied.append((leyline["session"], leyline["base_revision"]))
        return status, answer

    def chats(self) -> list[Seen]:
        return [s for s in self.seen if s.inner == ("POST", "/v1/chat/completions")]


def test_every_request_of_a_session_carries_its_routing_key() -> None:
    worker = ToyWorker()
    wrapper = LeylineOpenAI(worker.openai(), POLICY)
    history = step(wrapper, opening(), 2)
    history = step(wrapper, history, 3)
    step(wrapper, history, 4, stream=True)
    wrapper._run(wrapper._mirror(wrapper.episode))  # the session's GET (after a conflict)
    wrapper.close()
    session = wrapper.session
    assert all(s.route is None for s in worker.seen)  # direct: no envelopes
    by_route = {s.inner: s.key for s in worker.seen}
    assert by_route == {
        ("GET", "/leyline/v1/capabilities"): None,  # any worker answers
        ("POST", "/leyline/v1/tokenize"): session,
        ("POST", "/v1/chat/completions"): session,
        ("GET", f"/leyline/v1/sessions/{session}"): session,
        ("DELETE", f"/leyline/v1/sessions/{session}"): session,
    }
    assert all(s.key == session for s in worker.seen[1:])
    assert [r.path for r in wrapper.records] == ["reprefill", "splice", "splice"]


def test_routed_mode_sends_each_leyline_request_as_one_envelope() -> None:
    worker = ToyWorker()
    wrapper = LeylineOpenAI(worker.openai(), POLICY, routed=True)
    assert wrapper.routed and wrapper.with_options(timeout=5.0).routed
    history = step(wrapper, opening(), 2)
    history = step(wrapper, history, 3, max_tokens=7, extra_headers={"X-Trace": "t1"})
    step(wrapper, history, 4, stream=True)
    wrapper.close()
    session = wrapper.session
    assert {(s.method, s.path) for s in worker.seen} == {("POST", "/v1/completions")}
    for seen in worker.seen:
        outer = seen.body
        assert set(outer) == {"model", "prompt", "max_tokens", "stream", "leyline"}
        assert (outer["model"], outer["prompt"], outer["max_tokens"]) == ("toy", ".", 1)
        assert set(outer["leyline"]) == {"route"}
        assert seen.key == (None if seen.inner[1].endswith("capabilities") else session)
    probe, *rest = worker.seen
    assert probe.route == {"method": "GET", "path": "/leyline/v1/capabilities", "body": None}
    assert rest[-1].route == {
        "method": "DELETE",
        "path": f"/leyline/v1/sessions/{session}",
        "body": None,
    }
    chats = worker.chats()
    assert [c.body["stream"] for c in chats] == [False, False, True]
    second = chats[1].route["body"]
    assert second["max_tokens"] == 7 and second["model"] == "toy"
    assert second["leyline"]["session"] == session and second["leyline"]["directives"]
    assert "extra_headers" not in second and "extra_body" not in second
    tokenized = [s for s in worker.seen if s.inner == ("POST", "/leyline/v1/tokenize")]
    assert tokenized and all(s.route["body"]["messages"] for s in tokenized)
    assert [r.path for r in wrapper.records] == ["reprefill", "splice", "splice"]
    assert wrapper.records[-1].streamed and worker.server.mismatches == []


def test_routed_mode_on_the_async_client() -> None:
    worker = ToyWorker()

    async def episode() -> list[str | None]:
        wrapper = AsyncLeylineOpenAI(worker.async_openai(), POLICY, routed=True)
        history = opening()
        for n in (2, 3):
            await wrapper.chat.completions.create(model="toy", messages=history)
            history += turn(n)
        stream = await wrapper.chat.completions.create(model="toy", messages=history, stream=True)
        async with stream:
            chunks = [chunk async for chunk in stream]
        assert chunks and wrapper.records[-1].streamed
        await wrapper.aclose()
        return [r.path for r in wrapper.records]

    assert asyncio.run(episode()) == ["reprefill", "splice", "splice"]
    assert {s.path for s in worker.seen} == {"/v1/completions"}
    assert worker.seen[-1].inner[0] == "DELETE"


def test_a_summary_goes_as_plain_chat_even_in_routed_mode() -> None:
    worker = ToyWorker()
    policy = 'summarize:trigger={"messages":6},keep_last=1,max_tokens=8'
    wrapper = LeylineOpenAI(worker.openai(), policy, routed=True)
    history = step(wrapper, opening(), 2)
    step(wrapper, [*history, *turn(3)], 4)
    plain = [s for s in worker.seen if s.route is None]
    assert plain and all(s.path == "/v1/chat/completions" and s.key is None for s in plain)
    assert all("leyline" not in s.body for s in plain)


def test_closing_is_best_effort_whatever_the_answer() -> None:
    worker = ToyWorker()
    worker.typed_204 = True
    wrapper = LeylineOpenAI(worker.openai(), POLICY, routed=True)
    step(wrapper, opening(), 2)
    wrapper.close()  # an empty body said to be JSON does not raise
    assert worker.seen[-1].inner == ("DELETE", f"/leyline/v1/sessions/{wrapper.session}")


def test_require_session_goes_with_every_call_after_the_first_answered_one() -> None:
    worker = ToyWorker()
    wrapper = LeylineOpenAI(worker.openai(), POLICY)
    history = step(wrapper, opening(), 2)
    step(wrapper, history, 3)
    first, second = (c.body["leyline"] for c in worker.chats())
    assert "require_session" not in first.get("options", {})
    assert second["options"]["require_session"] is True


def test_a_lost_session_goes_on_in_a_new_one_with_every_message() -> None:
    worker = ToyWorker()
    wrapper = LeylineOpenAI(worker.openai(), POLICY, session="agent-7")
    history = step(wrapper, opening(), 2)
    history = step(wrapper, history, 3)
    del worker.server.sessions["agent-7"]  # the worker that held it died
    sent = len(history)
    history = step(wrapper, history, 4)
    lost = wrapper.records[-1]
    assert (lost.resync, lost.lost_session) == ("session_lost", "agent-7")
    assert lost.session == wrapper.session == "agent-7~1"
    refused, resent = worker.chats()[-2:]
    assert refused.key == "agent-7" and refused.body["leyline"]["options"]["require_session"]
    assert resent.key == "agent-7~1" and not resent.body["leyline"].get("directives")
    assert "require_session" not in resent.body["leyline"].get("options", {})
    assert lost.messages == len(resent.body["messages"]) == sent  # nothing the agent sent lost
    history = step(wrapper, history, 5)
    after = wrapper.records[-1]
    assert (after.session, after.path, after.resync) == ("agent-7~1", "splice", None)
    del worker.server.sessions["agent-7~1"]  # lost again: the count goes on
    step(wrapper, history, 6, stream=True)
    assert (wrapper.records[-1].session, wrapper.records[-1].lost_session) == (
        "agent-7~2",
        "agent-7~1",
    )
    assert worker.server.mismatches == []


def test_a_lost_sessions_new_id_fits_the_protocol() -> None:
    episode = Episode(TurnPlanner(), "s" * 126)
    assert episode.renew() == "s" * 126 and episode.session == "s" * 126 + "~1"
    episode.losses = 9
    episode.renew()
    assert episode.session.startswith("leyline-") and episode.losses == 10


def test_an_unreachable_worker_is_waited_for_and_a_batch_goes_once() -> None:
    worker = ToyWorker()
    wrapper = LeylineOpenAI(worker.openai(), POLICY, routed=True)
    history = step(wrapper, opening(), 2)
    worker.failures = [500, 503]
    history = step(wrapper, history, 3)  # with directives
    record = wrapper.records[-1]
    assert (record.path, record.resync) == ("splice", None)
    assert record.latency_s >= sum(BACKOFF_S[:2])
    tries = [s for s in worker.chats() if s.route and s.route["body"]["leyline"].get("directives")]
    assert len(tries) == 3 and all(t.body == tries[0].body for t in tries)  # the same request
    worker.failures = ["connect"]
    history = step(wrapper, history, 4)
    assert wrapper.records[-1].resync is None
    assert len(worker.applied) == len(set(worker.applied)) == 2


def test_a_batch_whose_answer_was_lost_is_not_applied_again() -> None:
    worker = ToyWorker()
    wrapper = LeylineOpenAI(worker.openai(), POLICY, routed=True)
    history = step(wrapper, opening(), 2)
    worker.lose = 1  # the batch runs; its answer never comes back
    step(wrapper, history, 3)
    record = wrapper.records[-1]
    assert record.resync == "revision_conflict"  # the re-sent batch found its revision gone
    assert len(worker.applied) == len(set(worker.applied)) == 1
    assert record.revision == worker.server.sessions[wrapper.session].revision


def test_waiting_for_a_worker_ends() -> None:
    worker = ToyWorker()
    wrapper = LeylineOpenAI(worker.openai(), POLICY, routed=True, unreachable_s=1.0)
    history = step(wrapper, opening(), 2)
    worker.failures = [500, 500, 500]
    with pytest.raises(openai.InternalServerError):
        wrapper.chat.completions.create(model="toy", messages=history)
    # Sent twice (the wait before a third would end past 1 s), then raised: not re-sent
    # as plain messages, which would wait for the same worker again.
    assert worker.failures == [500] and len(wrapper.records) == 1
    worker.failures = []
    step(wrapper, history, 3)  # the episode was left as it was: the same batch goes
    assert (wrapper.records[-1].path, wrapper.records[-1].resync) == ("splice", None)
    with pytest.raises(ValueError, match="unreachable_s"):
        LeylineOpenAI(worker.openai(), unreachable_s=-1)


def test_the_chat_body_is_what_the_openai_client_sends() -> None:
    options = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "temperature": openai.NOT_GIVEN,
        "extra_body": {"leyline": {"session": "s"}, "top_k": 3},
        "extra_headers": {"X": "1"},
        "timeout": 3.0,
        "tools": ({"type": "function", "function": {"name": "f"}},),
    }
    assert chat_body(options) == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "leyline": {"session": "s"},
        "top_k": 3,
    }
