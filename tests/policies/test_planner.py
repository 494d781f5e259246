"""TurnPlanner, the pure core of the middleware, against a toy Leyline server."""

from __future__ import annotations

import json

from leyline.policies import (
    EstimateCounter,
    FieldErrata,
    TokenBudget,
    TurnPlan,
    TurnPlanner,
)
from leyline.protocol import (
    ForgetDirective,
    LeylineRequest,
    MessageAnchor,
    Path,
    SpliceDirective,
)

from .toy_chat import render
from .toy_server import ToyServer
from .transcripts import Msg, assistant, call, episode, system, tool, user, view_output


def run_episode(planner: TurnPlanner, server: ToyServer, turns: int) -> list[TurnPlan]:
    """The agent appends one tool turn per step; the planner plans; the server executes."""
    full = episode(turns)
    plans = []
    for end in range(4, len(full) + 1, 2):
        plan = planner.plan(full[:end])
        planner.commit(plan, server.chat(plan))
        plans.append(plan)
    return plans


def test_truncation_sends_one_splice_per_newly_evicted_output_and_never_refires() -> None:
    server = ToyServer()
    plans = run_episode(TurnPlanner("truncate:keep_last=2"), server, turns=6)
    # Turns 1-3 fit the window; from turn 3 on, each turn evicts exactly the one output that
    # just left it, by a content splice addressed with the token spans the server reported.
    assert [len(p.directives) for p in plans] == [0, 0, 1, 1, 1, 1]
    for before, plan, evicted in zip(plans[1:], plans[2:], [3, 5, 7, 9], strict=False):
        (directive,) = plan.directives
        assert isinstance(directive, SpliceDirective)
        assert directive.span == render(before.messages).spans[evicted].content
        assert [e.message for e in plan.edits] == [evicted]  # type: ignore[union-attr]
        turn = (evicted - 1) // 2
        assert plan.messages[evicted]["content"] == f"[evicted: view output from turn {turn}]"
    assert server.revision == 6 and len(server.batches) == 4


def test_anchor_addressing_and_forget_mode() -> None:
    planner = TurnPlanner("truncate:keep_last=1,mode=forget", addressing="anchor")
    plans = run_episode(planner, ToyServer(), turns=3)
    assert plans[1].directives == (
        ForgetDirective(
            span=MessageAnchor(message=3, part="content"),
            replacement="[evicted: view output from turn 1]",
        ),
    )


def test_the_request_carries_the_batch_and_its_base_revision() -> None:
    planner = TurnPlanner("truncate:keep_last=1")
    server = ToyServer()
    run_episode(planner, server, turns=2)
    plan = planner.plan(episode(3))
    request = plan.leyline("agent-7")
    assert isinstance(request, LeylineRequest)
    body = json.loads(request.model_dump_json())
    assert body["session"] == "agent-7" and body["base_revision"] == 2
    assert body["directives"][0]["verb"] == "splice"
    assert TurnPlanner().plan(episode(1)).leyline("s") == LeylineRequest(session="s")


def test_without_leyline_the_same_edits_go_as_plain_messages() -> None:
    planner = TurnPlanner("truncate:keep_last=1")
    for end in range(4, len(episode(4)) + 1, 2):
        plan = planner.plan(episode(4)[:end])
        assert plan.directives == () and plan.base_revision is None
        planner.commit(plan, None)  # a server that answered without a leyline object
    assert "[evicted:" in str(plan.messages[3]["content"])


def test_a_failed_request_leaves_the_planner_as_it_was() -> None:
    planner = TurnPlanner("truncate:keep_last=1")
    server = ToyServer()
    run_episode(planner, server, turns=2)
    first = planner.plan(episode(3))
    # ... the request failed: nothing committed; the retry plans the same batch.
    assert planner.plan(episode(3)) == first
    planner.drop_session()  # or give up on the cache: re-prefill, keep the policy's edits
    fallback = planner.plan(episode(3))
    assert fallback.directives == () and fallback.messages == first.messages


def test_diff_mode_an_agent_that_rewrites_its_own_list() -> None:
    planner, server = TurnPlanner(), ToyServer()
    messages = episode(3)
    planner.commit(first := planner.plan(messages), server.chat(first))
    rewritten = [*messages[:2], *messages[4:]]  # the agent dropped its first tool turn
    rewritten[3] = {**rewritten[3], "content": "[summary: module_2 looks fine]"}
    plan = planner.plan([*rewritten, user("continue")])
    assert plan.messages[-1] == user("continue")
    response = server.chat(plan)  # the toy server checks edited cache + tail == request
    assert response.path is Path.splice and len(plan.directives) == 2


def test_the_agents_own_change_wins_over_a_logged_stub() -> None:
    planner, server = TurnPlanner("truncate:keep_last=1"), ToyServer()
    run_episode(planner, server, turns=3)
    messages = episode(3)
    messages[3] = tool("call_1", "short note")  # the agent rewrote the output itself
    plan = planner.plan(messages)
    assert plan.messages[3]["content"] == "short note"
    server.chat(plan)


def test_pinned_messages_are_never_stubbed() -> None:
    planner = TurnPlanner("truncate:keep_last=1", pinned=lambda i, m: i == 3)
    plans = run_episode(planner, ToyServer(), turns=4)
    assert all(3 not in [e.message for e in p.edits] for p in plans)  # type: ignore[union-attr]
    assert plans[-1].messages[3] == episode(4)[3]


def test_field_errata_keep_the_prefix_and_note_each_change_once() -> None:
    state = "You are a support agent.\norder_status: pending"
    planner, server = TurnPlanner(FieldErrata()), ToyServer()
    agent: list[Msg] = [system(state), user("Where is my order?")]
    planner.commit(plan := planner.plan(agent), server.chat(plan))
    paths, notes = [], []
    for status in ["refunded", "refunded", "pending"]:
        agent = [system(state.replace("pending", status)), *agent[1:], user(f"status {status}?")]
        plan = planner.plan(agent)
        response = server.chat(plan)
        planner.commit(plan, response)
        assert plan.messages[0] == system(state)  # the cached prefix stays byte-identical
        paths.append(response.path)
        notes.append(
            [str(m["content"]) for m in plan.messages if "[STATE UPDATE]" in str(m["content"])]
        )
    assert paths == [Path.prefix_hit] * 3  # no directive at all: errata only append
    assert [len(n) for n in notes] == [1, 1, 2]
    assert notes[2][-1].startswith("[STATE UPDATE] order_status -> pending")


def test_failed_attempts_are_dropped_from_the_cache() -> None:
    planner, server = TurnPlanner("failed"), ToyServer()
    messages: list[Msg] = [
        system(),
        user("fix"),
        assistant(call("1", "view", path="nope.py")),
        tool("1", "Error: no such file"),
    ]
    planner.commit(plan := planner.plan(messages), server.chat(plan))
    messages += [assistant(call("2", "view", path="a.py")), tool("2", view_output("a.py", 2))]
    plan = planner.plan(messages)
    assert [m.get("tool_call_id") for m in plan.messages if m["role"] == "tool"] == ["2"]
    assert len(plan.directives) == 1 and server.chat(plan).path is Path.splice


def test_a_token_budget_edits_in_a_few_batches_over_a_long_episode() -> None:
    budget = TokenBudget(max_tokens=3000, target_tokens=1500, keep_last=1)
    planner, server = TurnPlanner(budget, counter=EstimateCounter()), ToyServer()
    plans = run_episode(planner, server, turns=16)
    batches = [k for k, p in enumerate(plans) if p.directives]
    assert 2 <= len(batches) <= 5, batches  # not on every turn once over budget
    assert all(p.fallback is None for p in plans)
    assert len(server.batches) == len(batches)  # each batch checked by the toy server
