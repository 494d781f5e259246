"""Retention in the SDK: pins, scratch reasoning, decay marks, and mirroring server drops.

The server here is the TOY one (``toy_server``); the drops a real server makes (a scratch at
the end of its turn, a decay under memory pressure) are SCRIPTED: built by hand as the
protocol says a server reports them (docs/protocol.md, 3.5), from the toy rendering.
"""

from __future__ import annotations

import pytest

from leyline.policies import (
    ClearToolUses,
    MarkSpan,
    Pin,
    PolicyEditError,
    ReplaceContent,
    ScratchReasoning,
    TurnPlanner,
    parse_policy,
    run_policy,
)
from leyline.protocol import (
    DecayDirective,
    LeylineResponse,
    PinDirective,
    ScratchDirective,
    TokenSpan,
)
from leyline.protocol.envelope import DroppedSpan

from .toy_chat import render, tokenize
from .toy_server import ToyServer
from .transcripts import assistant, call, episode, system, tool, user


def test_pin_pins_by_role_tool_and_index_and_other_policies_respect_it() -> None:
    messages = episode(4)
    policy = parse_policy('pin:roles=["system"],messages=[3] | truncate:keep_last=1')
    edits = run_policy(policy, messages)
    stubbed = {e.message for e in edits if isinstance(e, ReplaceContent)}
    assert stubbed == {5, 7}  # outputs of turns 1..3 but 3 is pinned; turn 4 kept
    pins = Pin(roles=("system",), tools=("view",), messages=(-1,)).pins(run_policy_view(messages))
    assert pins == {0, 3, 5, 7, 9}
    assert Pin(predicate=lambda i, m: i == 1).pins(run_policy_view(messages)) == {1}
    assert parse_policy("pin:ttl_s=30").pin_ttl_s() == 30


def run_policy_view(messages: list[dict[str, object]]):  # type: ignore[no-untyped-def]
    from leyline.policies import Transcript

    return Transcript.from_messages(messages)


def test_a_policy_that_marks_a_pinned_message_is_refused() -> None:
    class Bad(ClearToolUses):
        def propose(self, transcript, context):  # type: ignore[no-untyped-def]
            return [MarkSpan(0, "decay", "x")]

    with pytest.raises(PolicyEditError, match="pinned"):
        run_policy(Bad(), episode(2), pinned=[0])


def test_the_planner_pins_once_the_message_is_in_the_session() -> None:
    server = ToyServer()
    planner = TurnPlanner('pin:roles=["system"],ttl_s=60 | truncate:keep_last=1')
    planner.retention = True
    full = episode(4)
    verbs = []
    for end in range(4, len(full) + 1, 2):
        plan = planner.plan(full[:end])
        verbs.append([d.verb for d in plan.directives])
        pins = [d for d in plan.directives if isinstance(d, PinDirective)]
        for pin in pins:
            assert pin.ttl_s == 60 and isinstance(pin.span, TokenSpan)
            assert pin.span.start == server.spans[0].start  # type: ignore[attr-defined]
        planner.commit(plan, server.chat(plan))
    assert verbs[0] == []  # nothing cached yet
    assert verbs[1].count("pin") == 1
    assert all("pin" not in v for v in verbs[2:])  # sent once
    # A plain server: no pin directive, the pin is a constraint on the policies only.
    plain = TurnPlanner('pin:roles=["system"] | truncate:keep_last=1')
    for end in range(4, len(full) + 1, 2):
        plan = plain.plan(full[:end])
        assert all(not isinstance(d, PinDirective) for d in plan.directives)
        plain.commit(plan, None)


def test_clear_tool_uses_decays_instead_of_clearing_where_the_server_drops() -> None:
    policy = ClearToolUses(trigger=1, keep=1, decay=True, placeholder="[gone {tool}]")
    full = episode(3)
    server = ToyServer()
    planner = TurnPlanner(policy)
    planner.retention = True
    plans = []
    for end in range(4, len(full) + 1, 2):
        plan = planner.plan(full[:end])
        planner.commit(plan, server.chat(plan))
        plans.append(plan)
    # Nothing is cleared: the outputs are marked, oldest turn lowest priority, once each.
    assert all(not p.edits or all(isinstance(e, MarkSpan) for e in p.edits) for p in plans)
    decays = [[d for d in p.directives if isinstance(d, DecayDirective)] for p in plans]
    assert [len(d) for d in decays] == [0, 1, 1]
    first = decays[1][0]
    assert (first.priority, first.replacement, first.mode.value) == (1, "[gone view]", "amortize")
    assert decays[2][0].priority == 2
    assert plans[-1].check_revision and planner.decaying
    assert plans[-1].leyline("s").base_revision == server.revision - 1
    # Without retention (a plain server) the same policy clears as before.
    edits = run_policy(policy, full)
    assert {type(e) for e in edits} == {ReplaceContent}


def test_decay_drops_are_mirrored_and_the_next_request_extends_the_session() -> None:
    server = ToyServer()
    planner = TurnPlanner("truncate:keep_last=1,decay=true,stub=[dropped]")
    planner.retention = True
    full = episode(3)
    for end in (4, 6):
        plan = planner.plan(full[:end])
        planner.commit(plan, server.chat(plan))
    # SCRIPTED: the server drops the decay span of message 3 (under pressure).
    content = server.spans[3].content  # type: ignore[attr-defined]
    before = len(server.tokens)
    dropped = scripted_drop(server, content, "decay", "[dropped]")
    served = list(planner.served)
    served[3] = {**served[3], "content": "[dropped]"}
    spans = render(served).spans
    assert len(server.tokens) == before - (content.end - content.start) + len(tokenize("[dropped]"))
    found = planner.mirror([dropped], server.revision, spans)
    assert found is not None and [(d.verb, d.message) for d in found] == [("decay", 3)]
    assert planner.revision == server.revision and not planner.decaying
    plan = planner.plan(full)
    assert plan.messages[3]["content"] == "[dropped]"
    assert plan.base_revision == server.revision
    response = server.chat(plan)  # the toy server asserts the request extends the edit
    assert response.path.value in ("splice", "prefix_hit")
    assert render(plan.messages).tokens[: len(server.tokens)] == server.tokens
    # A drop that is not one of ours is not mirrored.
    stranger = dropped.model_copy(update={"revision": server.revision + 5, "start": 1})
    assert planner.mirror([stranger], server.revision + 5, spans) is None


def scripted_drop(server: ToyServer, content: TokenSpan, verb: str, stub: str) -> DroppedSpan:
    """SCRIPTED: the server drops the ``verb`` span ``content``, leaving ``stub``'s tokens, and
    reports it as the protocol says (a new revision)."""
    stub_tokens = tokenize(stub)
    server.tokens[content.start : content.end] = stub_tokens
    server.revision += 1
    return DroppedSpan(
        verb=verb,
        start=content.start,
        end=content.end,
        revision=server.revision,
        replacement_tokens=len(stub_tokens),
    )


def reasoning_episode() -> list[dict[str, object]]:
    return [
        system(),
        user("Fix the bug."),
        assistant(call("a", "view", path="a.py"), text="<think>maybe a.py</think>Look at a."),
        tool("a", "print(1)\n" * 30),
        assistant(call("b", "view", path="b.py"), text="<think>then b.py</think>Look at b."),
        tool("b", "print(2)\n" * 30),
        assistant(call("c", "view", path="c.py"), text="<think>finally c</think>Look at c."),
        tool("c", "print(3)\n" * 30),
    ]


def test_scratch_on_a_plain_server_removes_old_reasoning_once_byte_stable() -> None:
    full = reasoning_episode()
    planner = TurnPlanner("scratch:keep=1")
    sent = []
    for end in (4, 6, 8):
        plan = planner.plan(full[:end])
        planner.commit(plan, None)
        sent.append(plan.messages)
    assert sent[0][2]["content"] == "<think>maybe a.py</think>Look at a."
    assert sent[1][2]["content"] == "Look at a."
    assert sent[1][4]["content"] == "<think>then b.py</think>Look at b."
    assert sent[2][:4] == sent[1][:4]  # what was removed stays removed, byte for byte
    assert sent[2][4]["content"] == "Look at b."
    # Idempotent, and a reasoning field goes with its message replaced whole.
    policy = ScratchReasoning(keep=0)
    stripped = [{**m, "content": "Look."} if m.get("role") == "assistant" else m for m in full]
    assert run_policy(policy, stripped) == []
    with_field = [*full[:2], {**full[2], "reasoning_content": "hmm"}, full[3]]
    edits = run_policy(ScratchReasoning(keep=0), with_field)
    assert len(edits) == 1 and "reasoning_content" not in edits[0].replacement  # type: ignore[union-attr]


def test_scratch_marks_ride_on_the_request_and_drops_are_mirrored_at_commit() -> None:
    full = reasoning_episode()
    server = ToyServer()
    planner = TurnPlanner("scratch:keep=1")
    planner.retention = True
    plan = planner.plan(full[:4])
    planner.commit(plan, server.chat(plan))
    plan = planner.plan(full[:6])
    (mark,) = [d for d in plan.directives if isinstance(d, ScratchDirective)]
    assert mark.replacement == "Look at a."
    assert plan.messages[2]["content"] == "<think>maybe a.py</think>Look at a."  # visible
    response = server.chat(plan)
    # SCRIPTED: the server drops the scratch span once the generation completed.
    content = response.spans[2].content
    assert content is not None
    dropped = scripted_drop(server, content, "scratch", "Look at a.")
    served = [*plan.messages[:2], {**plan.messages[2], "content": "Look at a."}, *plan.messages[3:]]
    server.spans = list(render(served).spans)
    reported = LeylineResponse.model_validate(
        {
            **response.model_dump(),
            "revision": server.revision,
            "spans": server.spans,
            "dropped": [dropped],
        }
    )
    found = planner.commit(plan, reported)
    assert [(d.verb, d.message) for d in found] == [("scratch", 2)]
    assert planner.served[2]["content"] == "Look at a."
    plan = planner.plan(full)
    assert plan.messages[2]["content"] == "Look at a."
    assert [d.verb for d in plan.directives] == ["scratch"]  # the next reply's reasoning
    response = server.chat(plan)
    assert response.path.value == "splice"
