"""chain and when, pinned-span enforcement, and third-party policies."""

from __future__ import annotations

from typing import Literal

import pytest

from leyline.policies import (
    Chain,
    DropMessages,
    FailedAttempts,
    Policy,
    PolicyContext,
    PolicyEdit,
    PolicyEditError,
    ReplaceContent,
    StaleToolOutputs,
    Transcript,
    TruncateOldToolOutputs,
    When,
    apply_to_messages,
    parse_policy,
    run_policy,
)

from .transcripts import assistant, call, episode, system, tool, user, view_output


def test_chain_stubs_each_output_once_across_policies() -> None:
    messages = episode(3)
    messages += [
        assistant(call("again", "view", path="src/module_1.py")),
        tool("again", view_output("src/module_1.py", 4)),
    ]
    chain = parse_policy("stale | truncate:keep_last=1")
    edits = run_policy(chain, messages)
    texts = {e.message: e.text for e in edits if isinstance(e, ReplaceContent)}
    assert texts[3].startswith("[stale:")  # truncate saw the stale stub and left it
    assert texts[5].startswith("[evicted:") and texts[7].startswith("[evicted:")
    assert run_policy(chain, apply_to_messages(messages, edits).messages) == []


def test_chain_readdresses_edits_after_an_earlier_drop() -> None:
    messages = [
        system(),
        user("go"),
        assistant(call("1", "view", path="nope.py")),
        tool("1", "Error: no such file\n" * 20),
        assistant(call("2", "view", path="a.py")),
        tool("2", view_output("a.py", 2)),
        assistant(call("3", "view", path="b.py")),
        tool("3", view_output("b.py", 3)),
    ]
    chain = Chain(policies=(FailedAttempts(), TruncateOldToolOutputs(keep_last=1)))
    edits = run_policy(chain, messages)
    assert DropMessages((2, 3), reason=edits[0].reason) == edits[0]
    # truncate ran on the list without messages 2-3, yet its edit addresses the original.
    assert [e.message for e in edits if isinstance(e, ReplaceContent)] == [5]


def test_when_runs_its_policy_only_while_conditions_hold() -> None:
    policy = When(policy="truncate:keep_last=1", min_turns=4)
    assert run_policy(policy, episode(3)) == []
    assert len(run_policy(policy, episode(4))) == 3
    assert (
        parse_policy("when:min_messages=100,policy=(truncate:keep_last=1)").propose(
            Transcript.from_messages(episode(4)), PolicyContext()
        )
        == []
    )


class _EditsThePin(Policy):
    type: Literal["test-pin-breaker"] = "test-pin-breaker"

    def propose(self, transcript: Transcript, context: PolicyContext) -> list[PolicyEdit]:
        return [ReplaceContent(0, "overwritten")]


def test_an_edit_of_a_pinned_message_is_an_error_naming_the_policy() -> None:
    with pytest.raises(PolicyEditError, match=r"'test-pin-breaker'.*pinned message\(s\) \[0\]"):
        run_policy(_EditsThePin(), episode(1), pinned=[0])
    with pytest.raises(PolicyEditError, match="pinned"):
        run_policy(Chain(policies=(StaleToolOutputs(), _EditsThePin())), episode(1), pinned=[0])


class _Orphans(Policy):
    type: Literal["test-orphans"] = "test-orphans"

    def propose(self, transcript: Transcript, context: PolicyContext) -> list[PolicyEdit]:
        return [DropMessages((2,))]  # the assistant call, not its output


def test_edits_that_orphan_a_tool_output_are_rejected() -> None:
    with pytest.raises(PolicyEditError, match=r"invalid transcript.*which no earlier assistant"):
        run_policy(_Orphans(), episode(1))


class _Conflicts(Policy):
    type: Literal["test-conflicts"] = "test-conflicts"

    def propose(self, transcript: Transcript, context: PolicyContext) -> list[PolicyEdit]:
        return [ReplaceContent(3, "a"), ReplaceContent(3, "b"), ReplaceContent(99, "c")]


def test_two_edits_of_one_message_are_rejected() -> None:
    with pytest.raises(PolicyEditError, match="edits 0 and 1 both change message 3"):
        run_policy(_Conflicts(), episode(1))
