"""StaleToolOutputs: superseded calls and file views made stale by a later edit."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from leyline.policies import ReplaceContent, StaleToolOutputs, apply_to_messages, run_policy

from .transcripts import Msg, assistant, call, system, tool, user, view_output


def stubbed(edits: Sequence[object]) -> dict[int, str]:
    return {e.message: e.text for e in edits if isinstance(e, ReplaceContent)}


def test_a_later_identical_call_supersedes_the_earlier_output() -> None:
    messages = [
        system(),
        user("go"),
        assistant(call("1", "grep", pattern="sum", path="src")),
        tool("1", "src/a.py:3: def sum_tree\n" * 10),
        assistant(call("2", "grep", path="src", pattern="sum")),  # same arguments, reordered
        tool("2", "src/a.py:3: def sum_tree\n" * 11),
        assistant(call("3", "grep", pattern="tree", path="src")),  # different arguments
        tool("3", "src/a.py:3: def sum_tree\n" * 12),
    ]
    assert stubbed(run_policy(StaleToolOutputs(), messages)) == {
        3: "[stale: grep output superseded by a later identical call]"
    }


def test_a_view_is_stale_once_the_file_is_edited_later() -> None:
    messages = [
        system(),
        user("fix it"),
        assistant(call("v1", "view", path="./src/a.py")),
        tool("v1", view_output("src/a.py", 1)),
        assistant(call("v2", "view", path="src/b.py")),
        tool("v2", view_output("src/b.py", 2)),
        assistant(call("e1", "rewrite", path="src/a.py", start=3, end=4, new_code="pass")),
        tool("e1", "Rewrote src/a.py lines 3-4."),
        assistant(call("v3", "view", path="src/a.py")),
        tool("v3", view_output("src/a.py", 4)),
    ]
    edits = run_policy(StaleToolOutputs(), messages)
    # The view before the edit is stale (normalised path); b.py and the fresh view are not.
    assert stubbed(edits) == {3: "[stale: view output of a file edited later]"}
    assert run_policy(StaleToolOutputs(), apply_to_messages(messages, edits).messages) == []


def test_tool_maps_are_configurable_and_superseded_can_be_off() -> None:
    messages = [
        user("go"),
        assistant(call("1", "cat", file="a.py")),
        tool("1", view_output("a.py", 1)),
        assistant(call("2", "patch", file="a.py")),
        tool("2", "patched"),
        assistant(call("3", "cat", file="a.py")),
        tool("3", view_output("a.py", 3)),
    ]
    policy = StaleToolOutputs(view_tools={"cat": "file"}, edit_tools={"patch": "file"})
    assert list(stubbed(run_policy(policy, messages))) == [2]
    quiet = StaleToolOutputs(superseded=False, view_tools={}, edit_tools={})
    assert run_policy(quiet, messages) == []


VIEWED_TWICE = [
    user("go"),
    assistant(call("1", "view", path="a.py")),
    tool("1", view_output("a.py", 1)),
    assistant(call("2", "view", path="a.py")),
]
"""a.py viewed, then viewed again: the second call still waits for its output."""


@pytest.mark.parametrize(
    ("messages", "pinned"),
    [
        pytest.param(VIEWED_TWICE, [], id="a-pending-later-call-does-not-supersede-yet"),
        pytest.param(
            [
                user("go"),
                assistant(call("v", "view", path="a.py"), call("e", "rewrite", path="a.py")),
                tool("v", view_output("a.py", 1)),
                tool("e", "Rewrote a.py."),
            ],
            [],
            id="a-parallel-view-and-edit-are-not-ordered",
        ),
        pytest.param(
            [*VIEWED_TWICE, tool("2", view_output("a.py", 2))],
            [2],
            id="a-pinned-stale-output-stays",
        ),
    ],
)
def test_nothing_is_stubbed(messages: list[Msg], pinned: list[int]) -> None:
    assert run_policy(StaleToolOutputs(), messages, pinned=pinned) == []
    if pinned:  # the pin is what keeps it
        assert list(stubbed(run_policy(StaleToolOutputs(), messages))) == pinned
