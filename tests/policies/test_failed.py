"""FailedAttempts: failed tool calls that were retried successfully."""

from __future__ import annotations

import pytest

from leyline.policies import (
    DropMessages,
    FailedAttempts,
    PolicyConfigError,
    ReplaceContent,
    apply_to_messages,
    parse_policy,
    run_policy,
)

from .transcripts import assistant, call, system, tool, user, view_output

NOT_FOUND = "Error: file src/sum_tre.py not found.\n" + "Did you mean src/sum_tree.py?\n" * 5


def retried() -> list[dict[str, object]]:
    return [
        system(),
        user("fix sum_tree"),
        assistant(call("1", "view", path="src/sum_tre.py"), text="Open it."),
        tool("1", NOT_FOUND),
        assistant(call("2", "view", path="src/sum_tree.py")),
        tool("2", view_output("src/sum_tree.py", 2)),
    ]


def test_a_failed_call_retried_successfully_is_dropped_with_its_output() -> None:
    messages = retried()
    edits = run_policy(FailedAttempts(), messages)
    assert [(type(e), e.messages) for e in edits if isinstance(e, DropMessages)] == [
        (DropMessages, (2, 3))
    ]
    after = apply_to_messages(messages, edits).messages
    assert [m["role"] for m in after] == ["system", "user", "assistant", "tool"]
    assert run_policy(FailedAttempts(), after) == []


def test_not_retried_or_retry_failed_means_nothing_to_do() -> None:
    assert run_policy(FailedAttempts(), retried()[:4]) == []
    failing_retry = [*retried()[:5], tool("2", "Traceback (most recent call last):\n  ...")]
    assert run_policy(FailedAttempts(), failing_retry) == []


def test_partial_failure_in_parallel_calls_stubs_only_the_failed_output() -> None:
    messages = [
        user("go"),
        assistant(call("a", "view", path="nope.py"), call("b", "listdir", path=".")),
        tool("a", NOT_FOUND),
        tool("b", "a.py\nb.py\n"),
        assistant(call("c", "view", path="a.py")),
        tool("c", view_output("a.py", 2)),
    ]
    edits = run_policy(FailedAttempts(), messages)
    assert [(e.message, e.text) for e in edits if isinstance(e, ReplaceContent)] == [
        (2, "[failed attempt: view call retried successfully later]")
    ]
    assert run_policy(FailedAttempts(), apply_to_messages(messages, edits).messages) == []


def test_same_arguments_requires_an_identical_retry() -> None:
    assert run_policy(FailedAttempts(same_arguments=True), retried()) == []
    flaky = retried()
    flaky[4] = assistant(call("2", "view", path="src/sum_tre.py"))
    assert run_policy(FailedAttempts(same_arguments=True), flaky) != []


def test_pinned_failures_are_stubbed_not_dropped_and_pinned_outputs_stay() -> None:
    edits = run_policy(FailedAttempts(), retried(), pinned=[2])
    assert [e.message for e in edits if isinstance(e, ReplaceContent)] == [3]
    assert run_policy(FailedAttempts(), retried(), pinned=[3]) == []


def test_stub_action_and_custom_failure_pattern() -> None:
    messages = retried()
    messages[3] = tool("1", "NOPE: no such file\n" * 10)
    assert run_policy(FailedAttempts(), messages) == []
    policy = parse_policy("failed:failure_pattern=^NOPE,action=stub")
    assert [e.message for e in run_policy(policy, messages) if isinstance(e, ReplaceContent)] == [3]


def test_bad_failure_pattern_is_a_config_error() -> None:
    with pytest.raises(PolicyConfigError, match="failure_pattern is not a valid regex"):
        parse_policy('failed:failure_pattern="(unclosed"')
    with pytest.raises(PolicyConfigError, match="missing '\\)'"):  # brackets nest: quote it
        parse_policy("failed:failure_pattern=(unclosed")
