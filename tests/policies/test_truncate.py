"""TruncateOldToolOutputs: the paper's rule, on realistic transcripts."""

from __future__ import annotations

from leyline.policies import (
    ReplaceContent,
    TruncateOldToolOutputs,
    apply_to_messages,
    parse_policy,
    run_policy,
)
from leyline.protocol import Mode

from .transcripts import episode, parallel_episode


def test_stubs_outputs_older_than_the_last_two_tool_turns() -> None:
    messages = episode(5)
    edits = run_policy(TruncateOldToolOutputs(keep_last=2), messages)
    assert [e.message for e in edits if isinstance(e, ReplaceContent)] == [3, 5, 7]
    assert edits[0] == ReplaceContent(
        3, "[evicted: view output from turn 1]", Mode.amortize, edits[0].reason
    )


def test_parallel_calls_of_one_message_are_one_turn() -> None:
    edits = run_policy(TruncateOldToolOutputs(keep_last=2), parallel_episode())
    # Turn 1 made two parallel calls (messages 3 and 4); turns 2 and 3 stay verbatim.
    assert sorted(e.message for e in edits if isinstance(e, ReplaceContent)) == [3, 4]


def test_nothing_to_do_on_short_episodes() -> None:
    assert run_policy(TruncateOldToolOutputs(keep_last=2), episode(2)) == []
    assert run_policy(TruncateOldToolOutputs(keep_last=2), episode(0)) == []


def test_applied_edits_never_fire_again() -> None:
    policy = TruncateOldToolOutputs(keep_last=2)
    messages = episode(6)
    once = apply_to_messages(messages, run_policy(policy, messages)).messages
    assert run_policy(policy, once) == []
    # A new turn stubs exactly one more output: the one that just fell out of the window.
    grown = [*once, *episode(7)[-2:]]
    assert [e.message for e in run_policy(policy, grown) if isinstance(e, ReplaceContent)] == [11]


def test_pinned_outputs_are_left_alone() -> None:
    edits = run_policy(TruncateOldToolOutputs(keep_last=1), episode(4), pinned=[3, 7])
    assert [e.message for e in edits if isinstance(e, ReplaceContent)] == [5]


def test_excluded_tools_and_short_outputs_are_kept() -> None:
    messages = parallel_episode()
    messages[4] = {**messages[4], "content": "ok"}  # shorter than any stub: no saving
    edits = run_policy(TruncateOldToolOutputs(keep_last=1, exclude_tools=("eval",)), messages)
    assert sorted(e.message for e in edits if isinstance(e, ReplaceContent)) == [3, 6]


def test_keep_last_zero_stubs_every_output_and_mode_is_carried() -> None:
    edits = run_policy(parse_policy("truncate:keep_last=0,mode=forget"), episode(2))
    assert [(e.message, e.mode) for e in edits if isinstance(e, ReplaceContent)] == [
        (3, Mode.forget),
        (5, Mode.forget),
    ]


def test_custom_stub_template_is_rendered_and_recognised() -> None:
    policy = parse_policy("truncate:keep_last=1,stub=[dropped {chars} chars of {tool}]")
    messages = episode(3)
    edits = run_policy(policy, messages)
    assert isinstance(edits[0], ReplaceContent)
    assert edits[0].text == f"[dropped {len(str(messages[3]['content']))} chars of view]"
    assert run_policy(policy, apply_to_messages(messages, edits).messages) == []
