"""ClearToolUses: Anthropic's clear_tool_uses / LangChain's ClearToolUsesEdit knobs, as edits."""

from __future__ import annotations

import itertools
import json

import pytest

from leyline.policies import (
    ClearToolUses,
    PolicyConfigError,
    ReplaceContent,
    ReplaceMessage,
    TurnPlanner,
    apply_to_messages,
    parse_policy,
    run_policy,
)
from leyline.policies.messages import message_key

from .toy_chat import render
from .toy_server import ToyServer
from .transcripts import (
    COUNTER,
    Msg,
    assistant,
    call,
    episode,
    system,
    tool,
    total,
    user,
    view_output,
)


def cleared(messages: list[Msg], policy: ClearToolUses | str) -> list[Msg]:
    edits = run_policy(parse_policy(policy), messages, counter=COUNTER)
    return list(apply_to_messages(messages, edits).messages)


def tool_texts(messages: list[Msg]) -> list[str]:
    return [str(m["content"]) for m in messages if m["role"] == "tool"]


def test_nothing_below_the_trigger_then_everything_but_the_last_keep() -> None:
    messages = episode(5)
    size = total(messages)
    assert run_policy(ClearToolUses(trigger=size), messages, counter=COUNTER) == []
    out = cleared(messages, ClearToolUses(trigger=size - 1, keep=2))
    assert tool_texts(out)[:3] == ["[cleared]"] * 3
    assert tool_texts(out)[3:] == tool_texts(messages)[3:]  # the last two tool uses stay
    assert total(out) < size // 2


def test_trigger_forms_and_their_round_trip() -> None:
    messages = episode(4)  # 10 messages, 4 tool uses
    n_tokens = total(messages)
    fires = {
        "tokens": ClearToolUses(trigger={"tokens": n_tokens - 1}),
        "anthropic": ClearToolUses(trigger={"type": "input_tokens", "value": n_tokens - 1}),
        "fraction": ClearToolUses(trigger=["fraction", 0.5], context_window=n_tokens),
        "messages": ClearToolUses(trigger={"messages": 9}),
        "tool_uses": ClearToolUses(trigger={"type": "tool_uses", "value": 3}),
    }
    quiet = {
        "tokens": ClearToolUses(trigger=n_tokens),
        "fraction": ClearToolUses(trigger={"fraction": 1.0}, context_window=n_tokens),
        "messages": ClearToolUses(trigger={"messages": 10}),
        "tool_uses": ClearToolUses(trigger={"tool_uses": 4}),
    }
    for name, policy in fires.items():
        assert run_policy(policy, messages, counter=COUNTER), name
        assert parse_policy(policy.model_dump(mode="json")) == policy
    for name, policy in quiet.items():
        assert run_policy(policy, messages, counter=COUNTER) == [], name
    config = 'clear_tool_uses:trigger=["fraction",0.5],context_window=8000,keep=1'
    assert parse_policy(config) == ClearToolUses(
        trigger={"fraction": 0.5}, context_window=8000, keep={"type": "tool_uses", "value": 1}
    )


@pytest.mark.parametrize(
    ("config", "problem"),
    [
        ('clear_tool_uses:trigger={"fraction":0.5}', "needs context_window"),
        ('clear_tool_uses:trigger={"bogus":1}', "unknown kind 'bogus'"),
        ('clear_tool_uses:trigger={"tokens":1,"messages":2}', "exactly one"),
        ("clear_tool_uses:keep=-1", "keep"),
        ("clear_tool_uses:placeholder=[{size}]", "{size}"),
        ("clear_tool_uses:clear_at_least=true", "clear_at_least"),
    ],
)
def test_bad_configs_name_the_problem(config: str, problem: str) -> None:
    with pytest.raises(PolicyConfigError, match=problem.replace("[", r"\[").replace("{", r"\{")):
        parse_policy(config)


def test_clear_at_least_clears_all_or_nothing() -> None:
    messages = episode(3)
    one_output = COUNTER.count(tool_texts(messages)[0]) - COUNTER.count("[cleared]")
    base = {"trigger": 1, "keep": 1}
    # two eligible outputs free ~2 x one_output: enough for one_output, not for three
    assert len(run_policy(ClearToolUses(**base, clear_at_least=one_output), messages)) == 2
    assert run_policy(ClearToolUses(**base, clear_at_least=3 * one_output), messages) == []


def test_exclude_tools_pinned_and_short_outputs_are_kept() -> None:
    messages = [
        system(),
        user("Go."),
        assistant(call("p", "plan", step=1)),
        tool("p", "PLAN: " + "step " * 100),
        assistant(call("v", "view", path="a.py")),
        tool("v", view_output("a.py", 2)),
        assistant(call("s", "status")),
        tool("s", "ok"),  # shorter than the placeholder: nothing to gain
        assistant(call("w", "view", path="b.py")),
        tool("w", view_output("b.py", 4)),
        assistant(call("x", "view", path="c.py")),
        tool("x", view_output("c.py", 5)),
    ]
    policy = ClearToolUses(trigger=1, keep=1, exclude_tools=("plan",))
    edits = run_policy(policy, messages, counter=COUNTER, pinned=[9])
    assert [e.message for e in edits] == [5]  # type: ignore[union-attr]


def test_clear_tool_inputs_blanks_only_the_cleared_calls_arguments() -> None:
    messages = [
        system(),
        user("Go."),
        assistant(call("a", "write", path="a.py", text="x" * 300), call("b", "view", path="b")),
        tool("a", "wrote a.py: " + "ok " * 100),
        tool("b", view_output("b", 1)),
        assistant(call("c", "view", path="c.py")),
        tool("c", view_output("c.py", 2)),
    ]
    policy = ClearToolUses(trigger=1, keep=1, clear_tool_inputs=("write",))
    edits = run_policy(policy, messages, counter=COUNTER)
    assert [type(e).__name__ for e in edits] == [
        "ReplaceMessage",
        "ReplaceContent",
        "ReplaceContent",
    ]
    replaced = edits[0]
    assert isinstance(replaced, ReplaceMessage) and replaced.message == 2
    calls = replaced.replacement["tool_calls"]
    assert [c["function"]["arguments"] for c in calls] == [  # type: ignore[index]
        "{}",
        json.dumps({"path": "b"}),
    ]
    assert [c["id"] for c in calls] == ["a", "b"]  # type: ignore[index]
    out = list(apply_to_messages(messages, edits).messages)
    # Its own result: nothing more to clear (idempotent), also with every tool's inputs.
    assert run_policy(policy, out, counter=COUNTER) == []
    everything = ClearToolUses(trigger=1, keep=1, clear_tool_inputs=True)
    again = run_policy(everything, out, counter=COUNTER)
    assert [e.message for e in again] == [2]  # type: ignore[union-attr]  # b's input now


def test_idempotent_and_never_restubs_another_policys_stub() -> None:
    messages = episode(5)
    truncated = cleared(messages, "truncate:keep_last=3")
    chain = parse_policy("truncate:keep_last=3 | clear_tool_uses:trigger=1,keep=1")
    edits = run_policy(chain, messages, counter=COUNTER)
    out = list(apply_to_messages(messages, edits).messages)
    assert tool_texts(out)[:2] == tool_texts(truncated)[:2]  # truncate's stubs stay as they were
    assert tool_texts(out)[2:4] == ["[cleared]"] * 2
    assert run_policy(chain, out, counter=COUNTER) == []


def run(planner: TurnPlanner, messages: list[Msg], server: ToyServer | None) -> list[Msg]:
    plan = planner.plan(messages)
    planner.commit(plan, server.chat(plan) if server else None)
    return list(plan.messages)


def test_turn_reports_and_batches_on_a_plain_server() -> None:
    """No Leyline (commit(plan, None)): clears come in batches, at the turns where the
    trigger is crossed, and every turn in between extends the previous request byte for byte
    (a prefix cache hits)."""
    full = episode(12)
    per_turn = total(full[:6]) - total(full[:4])
    planner = TurnPlanner(
        ClearToolUses(trigger=total(full[:4]) + 3 * per_turn, keep=2), counter=COUNTER
    )
    sent: list[list[Msg]] = []
    for end in range(4, len(full) + 1, 2):
        sent.append(run(planner, full[:end], None))
        plan = planner.plan(full[:end])  # what it would send again: nothing new to clear
        assert plan.edits == () and plan.cleared_tool_uses == ()
        assert total(sent[-1]) <= planner.policy.trigger.tokens  # type: ignore[union-attr]
    clears = [k for k in range(1, len(sent)) if sent[k][: len(sent[k - 1])] != sent[k - 1]]
    assert 2 <= len(clears) <= 4  # batches, not one clear per turn
    for k in clears:
        assert len(set(_ids(sent[k])) - set(_ids(sent[k - 1]))) >= 2  # several outputs at once
    # Stubs never change once written.
    for a, b in itertools.pairwise(sent):
        for m, n in zip(a, b, strict=False):
            if m.get("content") == "[cleared]":
                assert message_key(m) == message_key(n)
    # The report of a turn that clears: the tool uses and the tokens it took out.
    k = clears[0]
    history = full[: 4 + 2 * k]
    fresh = TurnPlanner(planner.policy, counter=COUNTER).plan(history)
    ids = tuple(str(m["tool_call_id"]) for m in fresh.messages if m.get("content") == "[cleared]")
    assert fresh.cleared_tool_uses == ids and len(ids) >= 2
    assert fresh.cleared_tokens == total(history) - total(list(fresh.messages))


def _ids(messages: list[Msg]) -> list[str]:
    return [str(m["tool_call_id"]) for m in messages if m.get("content") == "[cleared]"]


def test_clears_are_splices_on_a_leyline_server_inputs_included() -> None:
    """On the toy Leyline server the clears (outputs and arguments) are one batch of
    directives that turn the cached tokens into the new request's (the server checks)."""
    server = ToyServer()
    planner = TurnPlanner(
        ClearToolUses(trigger=total(episode(3)), keep=1, clear_tool_inputs=True),
        counter=COUNTER,
        render=render,
    )
    full = episode(5)
    plans = []
    for end in range(4, len(full) + 1, 2):
        plan = planner.plan(full[:end])
        planner.commit(plan, server.chat(plan))
        plans.append(plan)
    firing = [p for p in plans if p.directives]
    assert firing, "the trigger was crossed"
    first = firing[0]
    assert {d.verb for d in first.directives} == {"splice"}
    assert any(isinstance(e, ReplaceMessage) for e in first.edits)
    assert any(isinstance(e, ReplaceContent) for e in first.edits)
    assert first.cleared_tool_uses and first.cleared_tokens > 0
    assert server.revision == len(plans)
