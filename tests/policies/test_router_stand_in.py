"""The wrappers behind a router, on two real ``leyline serve`` workers (SmolLM2, CPU, real
HTTP, in this process): the routing key on every request of a session (direct), and in
routed mode, through a stand-in of sglang-router 0.3.2 (``router_stand_in``), an episode
spliced on one worker, a session lost with its worker, a worker out of reach, and skills
registered on their sessions' workers and again where a worker lacks one (a worker
restarted empty included).

The agent's tool calls are scripted; the model's replies, the envelopes, the directives
and the workers' cache edits are real. The toy-worker twin: ``test_routing.py``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from leyline.policies import EstimateCounter, LeylineOpenAI, SkillLibrary
from leyline.protocol.client import LeylineClient

from .router_stand_in import RouterStandIn, recording_proxy, router_stand_in

pytest.importorskip("torch")
pytestmark = [pytest.mark.slow, pytest.mark.model]

POLICY = "truncate:keep_last=1"


@pytest.fixture(scope="module")
def workers() -> Iterator[list[str]]:
    """The roots (``http://127.0.0.1:PORT``) of two real ``leyline serve`` workers."""
    from leyline.evals.demo.server import EmbeddedServer

    with (
        EmbeddedServer("smollm2", max_new_tokens=8) as a,
        EmbeddedServer("smollm2", max_new_tokens=8) as b,
    ):
        yield [a.base_url.removesuffix("/v1"), b.base_url.removesuffix("/v1")]


def output(n: int) -> str:
    lines = [f"{i:>3} | total = price * quantity - discount_{n}_{i}" for i in range(12)]
    return f"file_{n}.py\n" + "\n".join(lines)


def turn(n: int) -> list[dict[str, Any]]:
    """The agent's scripted ``read_file`` call of ``file_<n>.py`` and the tool's output."""
    function = {"name": "read_file", "arguments": json.dumps({"path": f"file_{n}.py"})}
    return [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": f"call_{n}", "type": "function", "function": function}],
        },
        {"role": "tool", "tool_call_id": f"call_{n}", "content": output(n)},
    ]


def opening(task: str = "Why is the order total wrong?") -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You are a coding agent. Read files, then answer."},
        {"role": "user", "content": task},
        *turn(1),
    ]


def wrapped(base_url: str, **options: Any) -> LeylineOpenAI:
    client = openai.OpenAI(base_url=base_url, api_key="-", max_retries=0)
    return LeylineOpenAI(client, POLICY, counter=EstimateCounter(), **options)


def ask(wrapper: LeylineOpenAI, history: list[Any], n: int, **options: Any) -> list[Any]:
    """Ask with ``history``; the history after the agent's next scripted call (which
    replaces the reply, so the wrapper deletes the reply from the cache)."""
    done = wrapper.chat.completions.create(
        model="smollm2", messages=history, max_tokens=4, temperature=0, **options
    )
    if options.get("stream"):
        with done as stream:
            assert list(stream)
    return [*history, *turn(n)]


def turns_of(router: RouterStandIn, session: str) -> list[dict[str, Any]]:
    """The chat turns (inner bodies) the workers got in ``session``'s envelopes."""
    return [f.turn for f in router.forwarded if f.key == session and f.turn is not None]


def test_every_request_of_a_session_carries_its_routing_key(workers: list[str]) -> None:
    with recording_proxy(workers[0]) as proxy:
        wrapper = wrapped(proxy.base_url)
        history = ask(wrapper, opening(), 2)
        history = ask(wrapper, history, 3)
        ask(wrapper, history, 4, stream=True)
        wrapper._run(wrapper._mirror(wrapper.episode))  # the session's GET (after a 409)
        wrapper.close()
    session = wrapper.session
    keys = {what.split("?")[0]: key for what, key, _ in proxy.seen}
    assert keys == {
        "GET /leyline/v1/capabilities": None,  # any worker answers
        "POST /leyline/v1/tokenize": session,
        "POST /v1/chat/completions": session,
        f"GET /leyline/v1/sessions/{session}": session,
        f"DELETE /leyline/v1/sessions/{session}": session,
    }
    assert all(key == session for _, key, _ in proxy.seen[1:])
    assert [r.path for r in wrapper.records[1:]] == ["splice", "splice"]


def test_a_routed_episode_splices_on_one_worker(workers: list[str]) -> None:
    with router_stand_in(workers) as router:
        wrapper = wrapped(router.base_url, routed=True)
        history = opening()
        for n in range(2, 7):
            history = ask(wrapper, history, n, stream=n == 4)
        wrapper.close()
    records = wrapper.records
    assert [r.path for r in records[1:]] == ["splice"] * 4, records
    assert all(r.resync is None and r.session == wrapper.session for r in records)
    assert records[2].streamed and records[-1].cleared_tool_uses
    assert router.refused == []  # nothing went to /leyline/v1 unenveloped
    assert len(router.workers_of(wrapper.session)) == 1
    routes = [(f.route or {}).get("path", "") for f in router.forwarded]
    assert routes[0] == "/leyline/v1/capabilities" and routes[-1].startswith("/leyline/v1/ses")
    assert "/leyline/v1/tokenize" in routes
    assert all(f.path == "/v1/completions" and f.status in (200, 204) for f in router.forwarded)


def test_a_session_lost_with_its_worker_goes_on_in_a_new_one(workers: list[str]) -> None:
    with router_stand_in(workers) as router:
        lost_one, other = (
            wrapped(router.base_url, routed=True),
            wrapped(router.base_url, routed=True),
        )
        a, b = opening(), opening("Rename the variable total to amount.")
        for n in (2, 3):
            a, b = ask(lost_one, a, n), ask(other, b, n)
        old = lost_one.session
        dead = router.keys[old]
        assert router.keys[other.session] != dead  # new keys went to the emptier worker
        router.kill(dead)
        sent = len(a)
        a = ask(lost_one, a, 4)
        record = lost_one.records[-1]
        for n in (5, 6):
            a, b = ask(lost_one, a, n), ask(other, b, n - 1)
    assert (record.resync, record.lost_session) == ("session_lost", old)
    assert record.session == lost_one.session == f"{old}~1" != old
    refused = turns_of(router, old)[-1]
    assert refused["leyline"]["options"]["require_session"] is True
    (resent, *later) = turns_of(router, record.session)
    assert len(resent["messages"]) == record.messages == sent  # nothing the agent sent lost
    assert not resent["leyline"].get("directives")
    assert "require_session" not in resent["leyline"].get("options", {})
    assert router.workers_of(record.session) == {1 - dead}
    after = lost_one.records[-2:]
    assert [r.path for r in after] == ["splice", "splice"] and later
    assert all(r.resync is None for r in other.records)  # the other worker's episode
    assert sum(r.resync == "session_lost" for r in lost_one.records) == 1


def test_a_worker_out_of_reach_is_waited_for_and_no_batch_runs_twice(
    workers: list[str],
) -> None:
    with router_stand_in(workers) as router:
        wrapper = wrapped(router.base_url, routed=True)
        history = ask(wrapper, opening(), 2)
        router.fail_upstream = 2  # the router's 500s, then the worker again
        history = ask(wrapper, history, 3)
        waited = wrapper.records[-1]
        router.lose_answers = 1  # the batch runs; its answer is lost on the way back
        history = ask(wrapper, history, 4)
        lost_answer = wrapper.records[-1]
        ask(wrapper, history, 5)
    assert router.failed == 3 and router.fail_upstream == router.lose_answers == 0
    assert (waited.path, waited.resync) == ("splice", None)
    # Sent again, it found its revision gone (409): re-sent as plain messages, never run twice.
    assert lost_answer.resync == "revision_conflict"
    assert wrapper.records[-1].path == "splice"
    batches = [
        (t["leyline"]["session"], t["leyline"]["base_revision"])
        for f in router.forwarded
        if f.status == 200 and (t := f.turn) is not None and t["leyline"].get("directives")
    ]
    assert len(batches) == len(set(batches)) == 3  # calls 2, 3 (its answer lost) and 4
    revisions = [r.revision for r in wrapper.records]
    assert revisions == sorted(revisions) and all(isinstance(r, int) for r in revisions)


RULES = "House rules: run the tests before every commit; keep functions short.\n" * 4


def with_skill(library: SkillLibrary, history: list[Any]) -> list[Any]:
    """``history`` and the skill's message, then a question."""
    return [*history, library.message("rules"), {"role": "user", "content": "Go on."}]


def test_routed_skills_follow_their_sessions_and_survive_a_restart(workers: list[str]) -> None:
    from leyline.evals.demo.server import EmbeddedServer

    with router_stand_in(workers) as router:
        library = SkillLibrary(LeylineClient(router.root, routed=True, envelope_model="smollm2"))
        a = wrapped(router.base_url, routed=True, skills=library, session="skills-a")
        b = wrapped(router.base_url, routed=True, skills=library, session="skills-b")
        skill = library.register("rules", RULES, role="user", routing_key=a.session).skill
        ha, hb = ask(a, opening(), 2), ask(b, opening("Rename total to amount."), 2)
        assert router.keys == {"skills-a": 0, "skills-b": 1}
        ha = ask(a, with_skill(library, ha), 3)
        composed_a = a.records[-1]
        hb = with_skill(library, hb)
        sent = len(hb)
        hb = ask(b, hb, 3)  # b's worker never had the skill
        refused_b = b.records[-1]
        hb = ask(b, with_skill(library, hb), 4)
        composed_b = b.records[-1]
        # a's worker dies and comes back empty: a's session and its skill are gone.
        router.kill(0)
        with EmbeddedServer("smollm2", max_new_tokens=8) as fresh:
            router.restart(0, fresh.base_url.removesuffix("/v1"))
            ha = ask(a, ha, 4)
            lost = a.records[-1]
            ha = ask(a, with_skill(library, ha), 5)
            refused_a = a.records[-1]
            ha = ask(a, with_skill(library, ha), 6)
            ask(a, ha, 7)
            assert router.keys[a.session] == 0  # the new session went to the fresh worker
    assert composed_a.composed == (skill,) and composed_a.path == "splice"
    assert (refused_b.resync, refused_b.reregistered) == ("unknown_skill", (skill,))
    resent = turns_of(router, "skills-b")[-2]  # the re-send after the refusal
    assert len(resent["messages"]) == sent and not resent["leyline"].get("directives")
    assert RULES in [m["content"] for m in resent["messages"]]  # its text, that call
    assert (composed_b.composed, composed_b.resync) == ((skill,), None)
    assert (lost.resync, lost.lost_session, lost.session) == (
        "session_lost",
        "skills-a",
        "skills-a~1",
    )
    assert (refused_a.resync, refused_a.reregistered) == ("unknown_skill", (skill,))
    assert a.records[-2].composed == (skill,)  # composed again on the fresh worker
    assert [r.path for r in a.records[-2:]] == ["splice", "splice"]
    registered = [
        (f.key, f.worker)
        for f in router.forwarded
        if (f.route or {}).get("path") == "/leyline/v1/skills"
    ]
    assert registered == [("skills-a", 0), ("skills-b", 1), ("skills-a~1", 0)]
    assert router.refused == []
