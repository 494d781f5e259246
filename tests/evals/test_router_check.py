"""The router live check's counting and judging (``leyline.evals.router_figures``) and the
driver's hook and options (``leyline.evals.router_check``), on made-up records and
exchanges: no router, no worker, no model."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from typing import Any

import httpx
import pytest

from leyline.evals import router_check as rc
from leyline.evals import router_figures as rf
from leyline.evals.router_figures import (
    Episode,
    Exchange,
    Fault,
    Figures,
    Share,
    message_key,
    splice_share,
    stickiness,
    summarize,
    targets,
)
from leyline.evals.router_passes import Collector

CHAT = rf.CHAT_ROUTE


def tool_turn(n: int, output: str = "out") -> list[dict[str, Any]]:
    call = {"id": f"call_{n}", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    return [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": f"call_{n}", "content": output},
    ]


OPENING = [{"role": "system", "content": "sys"}, {"role": "user", "content": "task"}]


def keys(messages: list[dict[str, Any]]) -> list[list[Any]]:
    return [message_key(m) for m in messages]


def record(call: int, path: str | None, t: float, **fields: Any) -> dict[str, Any]:
    base = {"call": call, "path": path, "answered_s": t, "resync": None, "messages": 0}
    base["latency_s"] = 1.0 + call
    return {**base, **fields}


def test_a_message_is_named_by_its_call_id_or_its_role_and_content() -> None:
    a, b = tool_turn(1), tool_turn(1, output="[cleared]")
    assert message_key(a[1]) == message_key(b[1]) == ["tool", "call_1"]
    assert message_key(a[0]) == ["assistant", ["call_1"]]
    assert message_key(OPENING[1]) == ["user", "task"]
    assert message_key(OPENING[1]) != message_key({"role": "user", "content": "other task"})
    listed = {"role": "user", "content": [{"type": "text", "text": "x"}]}
    assert message_key(listed) == ["user", '[{"text": "x", "type": "text"}]']


def test_lost_messages_by_key_count_an_edited_output_as_present() -> None:
    agent = [*OPENING, *tool_turn(1), *tool_turn(2)]
    truncated = [*OPENING, *tool_turn(1, "[cleared]"), *tool_turn(2)]
    episode = Episode(0, "t", 2, answered=2, agent_messages=keys(agent))
    episode.sent_messages = keys(truncated)
    episode.records = [record(1, "splice", 1.0, messages=len(truncated))]
    assert (episode.lost_by_key(), episode.lost_by_count(), episode.lost()) == (0, 0, 0)
    episode.sent_messages = keys([*OPENING, *tool_turn(2)])  # turn 1 dropped
    assert episode.lost_by_key() == 2 and episode.lost() == 2
    episode.records = [record(1, "splice", 1.0, messages=len(agent) - 3)]
    assert episode.lost_by_count() == 3 and episode.lost() == 3


def test_an_episode_that_never_got_an_answer_lost_everything() -> None:
    episode = Episode(0, "t", 3, error="APIConnectionError: boom", agent_messages=keys(OPENING))
    assert not episode.completed
    assert episode.lost_by_count() == episode.lost_by_key() == 2
    assert Episode(1, "t", 3, answered=3).completed
    assert not Episode(2, "t", 3, answered=2).completed


def test_stickiness_counts_2xx_answers_of_stateful_requests_only() -> None:
    exchanges = [
        Exchange(1, "s1", CHAT, 200, "A"),
        Exchange(2, "s1", "/leyline/v1/tokenize", 200, "B"),  # stateless: any worker
        Exchange(3, "s1", CHAT, 500, None),  # the router's own answer
        Exchange(4, "s1", CHAT, 404, "B"),  # unknown_session on the other worker
        Exchange(5, "s1~1", CHAT, 200, "B"),
        Exchange(6, "s1~1", "/leyline/v1/sessions/s1~1", 204, "B"),
        Exchange(7, "s2", CHAT, 200, "A"),
        Exchange(8, "s2", CHAT, 200, "A#2"),  # a restarted worker is another worker
        Exchange(9, None, "/leyline/v1/capabilities", 200, "B"),
    ]
    assert stickiness(exchanges) == {"s1": {"A"}, "s1~1": {"B"}, "s2": {"A", "A#2"}}
    assert not Exchange(0, "s", "/leyline/v1/tokenize", 200, "A").stateful
    assert Exchange(0, "s", "/leyline/v1/sessions/s", 200, "A").stateful


def test_the_splice_share_in_a_window_and_without_the_recreations() -> None:
    records = [
        record(0, "reprefill", 1.0),
        record(1, "splice", 2.0),
        record(2, "prefix_hit", 3.0, resync="session_lost"),
        record(3, "splice", 4.0),
        record(4, "splice", None),  # never answered: only in the whole pass
    ]
    assert splice_share(records) == Share(3, 5)
    assert splice_share(records, recreations=False) == Share(3, 4)
    assert splice_share(records, until=2.0) == Share(0, 1)
    assert splice_share(records, since=2.0, until=4.0) == Share(1, 2)
    assert splice_share(records, since=3.0, recreations=False) == Share(1, 1)
    assert Share(1, 4).percent == 25.0 and Share(0, 0).percent is None
    assert Share(1, 3).text() == "33.3% (1/3)" and Share(0, 0).text() == "-"


GOOD = Figures(
    episodes=16,
    completed=16,
    lost_messages=0,
    sessions=20,
    sticky=20,
    share_pass1=60.0,
    share_pass2=57.0,
    overhead_ms=0.6,
    killed=True,
    called_again=4,
    unrecreated=0,
)


def test_every_target_is_met_by_good_figures() -> None:
    results = targets(GOOD)
    assert len(results) == 6 and all(t.ok for t in results), results


@pytest.mark.parametrize(
    ("change", "failing"),
    [
        ({"completed": 15}, "episodes completed"),
        ({"episodes": 0, "completed": 0}, "episodes completed"),
        ({"lost_messages": 1}, "messages lost"),
        ({"sticky": 19}, "stickiness (sessions on one worker)"),
        ({"sessions": 0, "sticky": 0}, "stickiness (sessions on one worker)"),
        ({"share_pass2": 54.9}, "splice share, pass 2 vs pass 1 (re-creations out)"),
        ({"share_pass2": 65.1}, "splice share, pass 2 vs pass 1 (re-creations out)"),
        ({"share_pass1": None}, "splice share, pass 2 vs pass 1 (re-creations out)"),
        ({"overhead_ms": 5.01}, "router overhead (p50)"),
        ({"overhead_ms": None}, "router overhead (p50)"),
        ({"killed": False}, "killed worker's sessions re-created"),
        ({"unrecreated": 1}, "killed worker's sessions re-created"),
        ({"called_again": 0}, "killed worker's sessions re-created"),
    ],
)
def test_each_target_fails_on_its_own(change: dict[str, Any], failing: str) -> None:
    failed = [t.name for t in targets(replace(GOOD, **change)) if not t.ok]
    assert failed == [failing]


def test_the_limits_themselves_pass() -> None:
    edge = replace(GOOD, share_pass2=GOOD.share_pass1 - 5.0, overhead_ms=5.0)  # type: ignore[operator]
    assert all(t.ok for t in targets(edge))


def episode(
    index: int, sessions: list[str], paths: list[tuple[str, float, str | None]], sent: int
) -> Episode:
    agent = keys([*OPENING, *tool_turn(1)])
    e = Episode(index, "t", len(paths), answered=len(paths), agent_messages=agent)
    e.sessions = sessions
    e.sent_messages = agent[:sent]
    lost = sessions[0] if len(sessions) > 1 else None
    for call, (path, t, resync) in enumerate(paths):
        e.records.append(
            record(call, path, t, resync=resync, messages=sent, lost_session=lost, session="x")
        )
    return e


def test_summarize_counts_a_pass_with_a_kill() -> None:
    fault = Fault("A", {"A": ["s0"], "B": ["s1"]}, 3, 10.0, 12.0, 15.0, 25.0, 26.0)
    pass1 = [
        episode(0, ["p0"], [("reprefill", 1, None), ("splice", 2, None)], 4),
        episode(1, ["p1"], [("reprefill", 1, None), ("splice", 2, None)], 4),
    ]
    pass2 = [
        episode(0, ["s0", "s0~1"], [("reprefill", 5, None), ("reprefill", 20, "session_lost")], 4),
        episode(1, ["s1"], [("reprefill", 5, None), ("splice", 30, None)], 3),  # one lost
    ]
    exchanges = [
        Exchange(1, "p0", CHAT, 200, "A", "pass1"),
        Exchange(5, "s0", CHAT, 200, "A", "pass2"),
        Exchange(5, "s1", CHAT, 200, "B", "pass2"),
        Exchange(11, "s0", CHAT, 500, None, "pass2"),
        Exchange(19, "s0", CHAT, 404, "B", "pass2"),
        Exchange(20, "s0~1", CHAT, 200, "B", "pass2"),
        Exchange(30, "s1", CHAT, 200, "B", "pass2"),
        Exchange(31, "s2", CHAT, 200, "A#2", "pass2"),
    ]
    out = summarize(pass1, pass2, exchanges, fault, overhead_ms=0.4)
    figures = out["figures"]
    assert (figures["episodes"], figures["completed"], figures["lost_messages"]) == (2, 2, 1)
    assert (figures["sessions"], figures["sticky"]) == (4, 4)
    # Like for like: pass 1's call where pass 2 re-created a session is left out too.
    assert figures["share_pass1"] == 100 / 3 and figures["share_pass2"] == 100 / 3
    assert (figures["called_again"], figures["unrecreated"], out["recreated"]) == (1, 0, 1)
    assert out["killed_sessions_that_called_again"] == ["s0"]
    assert out["requests_per_worker"] == {"A": 1, "A#2": 1, "B": 4, "router": 1}
    assert out["chat_turns_per_worker"] == {"A": 1, "A#2": 1, "B": 3}
    assert out["router_errors"] == {"500": 1}
    assert out["splice_share"]["pass 2 before the kill"] == "0.0% (0/2)"
    assert out["splice_share"]["pass 2 after the restart"] == "100.0% (1/1)"
    assert out["call_latency_s"]["pass2 re-creations"] == {"p50": 2.0, "p90": 2.0, "max": 2.0}
    assert out["call_latency_s"]["pass1"] == {"p50": 1.5, "p90": 2.0, "max": 2.0}
    failed = [t["name"] for t in out["targets"] if not t["ok"]]
    assert failed == ["messages lost"]
    text = rf.render(report(out))
    assert "FAILED" in text and "A#2 1" in text


def test_a_killed_worker_session_that_called_again_and_was_not_recreated_fails() -> None:
    fault = Fault("A", {"A": ["s0"], "B": []}, 3, 10.0, 12.0, 15.0, 25.0, 26.0)
    pass2 = [episode(0, ["s0"], [("reprefill", 5, None), ("splice", 30, None)], 4)]
    exchanges = [
        Exchange(5, "s0", CHAT, 200, "A", "pass2"),
        Exchange(30, "s0", CHAT, 200, "A#2", "pass2"),  # silently re-created on the restart
        Exchange(31, "s0", "/leyline/v1/sessions/s0", 204, "A#2", "pass2"),
    ]
    out = summarize(pass2, pass2, exchanges, fault, overhead_ms=0.4)
    assert (out["figures"]["called_again"], out["figures"]["unrecreated"]) == (1, 1)
    assert out["sessions_on_several_workers"] == {"s0": ["A", "A#2"]}
    failed = {t["name"] for t in out["targets"] if not t["ok"]}
    assert failed == {"killed worker's sessions re-created", "stickiness (sessions on one worker)"}


def test_a_close_after_the_kill_is_not_a_call_that_needed_a_recreation() -> None:
    fault = Fault("A", {"A": ["s0"], "B": []}, 3, 10.0, 12.0, 15.0, 25.0, 26.0)
    pass2 = [episode(0, ["s0"], [("reprefill", 5, None), ("splice", 9, None)], 4)]
    exchanges = [
        Exchange(9, "s0", CHAT, 200, "A", "pass2"),
        Exchange(11, "s0", "/leyline/v1/sessions/s0", 500, None, "pass2"),
    ]
    figures = summarize(pass2, pass2, exchanges, fault, 0.4)["figures"]
    assert (figures["called_again"], figures["unrecreated"]) == (0, 0)
    no_kill = summarize(pass2, pass2, exchanges, None, 0.4)
    assert not no_kill["figures"]["killed"]
    assert "pass 2 before the kill" not in no_kill["splice_share"]


def report(summary: dict[str, Any]) -> dict[str, Any]:
    """A report as ``run`` writes it, around ``summary``."""
    settings = {"episodes": 2, "turns": 2, "policy": "truncate:keep_last=2", "concurrency": 2}
    latency = {
        "direct": {"p50_ms": 1.0, "p90_ms": 2.0},
        "router": {"p50_ms": 1.4, "p90_ms": 2.5},
        "requests": 10,
    }
    fault = Fault("A", {"A": ["s0"], "B": ["s1"]}, 3, 10.0, 12.0, 15.0, 25.0, 26.0)
    return {
        "date": "2026-12-07T00:00:00+00:00",
        "settings": settings,
        "latency": latency,
        "fault": asdict(fault),
        "walls_s": {"pass 1": 10.0},
        **summary,
    }


def test_the_hook_reads_the_envelope_the_key_and_the_worker() -> None:
    clock = rc.Clock()
    collector = Collector(clock, lambda name: f"{name}#2" if name == "A" else name)
    collector.pass_name = "pass2"
    inner = {"messages": [*OPENING, *tool_turn(1)], "leyline": {"session": "s0"}}
    body = {
        "model": "m",
        "prompt": ".",
        "leyline": {"route": {"method": "POST", "path": CHAT, "body": inner}},
    }
    url = "http://router/v1/completions"
    request = httpx.Request("POST", url, json=body, headers={rc.ROUTING_KEY: "s0"})
    collector.hook(httpx.Response(200, headers={rc.WORKER_HEADER: "A"}, request=request))
    collector.hook(httpx.Response(500, request=request))  # the router's own answer
    tokenize = {"leyline": {"route": {"method": "POST", "path": "/leyline/v1/tokenize"}}}
    request = httpx.Request("POST", url, json=tokenize, headers={rc.ROUTING_KEY: "s0"})
    collector.hook(httpx.Response(200, headers={rc.WORKER_HEADER: "B"}, request=request))
    direct = httpx.Request("POST", "http://a/v1/chat/completions", content=json.dumps(inner))
    collector.hook(httpx.Response(200, headers={rc.WORKER_HEADER: "B"}, request=direct))
    seen = [(e.key, e.route, e.status, e.worker, e.pass_name) for e in collector.exchanges]
    assert seen == [
        ("s0", CHAT, 200, "A#2", "pass2"),
        ("s0", CHAT, 500, None, "pass2"),
        ("s0", "/leyline/v1/tokenize", 200, "B", "pass2"),
        (None, CHAT, 200, "B", "pass2"),
    ]
    assert collector.last_chat == {"s0": keys(inner["messages"])}
    assert collector.last_worker == {"s0": "A"}  # by name: whom to kill


def test_the_options_and_their_checks() -> None:
    args = rc.parse_args([])
    assert (args.episodes, args.concurrency, args.kill_at) == (16, 8, 0.4)
    assert args.policy == "truncate:keep_last=2" and args.restart_after == 5.0
    for bad in (["--kill-at", "1"], ["--episodes", "0"]):
        with pytest.raises(SystemExit):
            rc.parse_args(bad)


def test_the_percentile_between_ranks() -> None:
    assert rf.percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert rf.percentile([1.0, 2.0], 0.9) == pytest.approx(1.9)
    with pytest.raises(ValueError):
        rf.percentile([], 0.5)


def test_the_envelope_is_the_sdks() -> None:
    from leyline.policies.middleware_routed import Envelope
    from leyline.policies.middleware_wire import Route

    sdk = Envelope(Route("get", "http://r", "/leyline/v1/capabilities"), model="default").body()
    assert rc.envelope_capabilities() == sdk


def test_the_splice_share_compares_the_same_calls_of_both_passes() -> None:
    """Pass 2 re-created the session at call 1 (a splice in pass 1) and then ran call 2 as
    a re-prefill where pass 1 spliced: 0% against pass 1's 50% over calls 0 and 2."""
    turns = [("reprefill", 1, None), ("splice", 2, None), ("splice", 3, None)]
    pass1 = [episode(0, ["p0"], turns, 4)]
    lost = [("reprefill", 5, None), ("reprefill", 6, "session_lost"), ("reprefill", 7, None)]
    pass2 = [episode(0, ["s0", "s0~1"], lost, 4)]
    out = summarize(pass1, pass2, [], None, overhead_ms=0.4)
    assert (out["figures"]["share_pass1"], out["figures"]["share_pass2"]) == (50.0, 0.0)
    failed = [t["name"] for t in out["targets"] if not t["ok"]]
    assert "splice share, pass 2 vs pass 1 (re-creations out)" in failed
