"""The transcript model: turns, tool calls linked to outputs, validation errors."""

from __future__ import annotations

import pytest

from leyline.policies import Transcript, TranscriptError

from .transcripts import assistant, call, parallel_episode, system, tool, user


def test_outputs_link_to_their_calls_and_turns() -> None:
    t = Transcript.from_messages(parallel_episode())
    assert [(o.message, o.call.id, o.call.turn) for o in t.outputs] == [
        (3, "a", 1),
        (4, "b", 1),
        (6, "c", 2),
        (8, "d", 3),
    ]
    assert t.turns == (0, 0, 1, 1, 1, 2, 2, 3, 3)
    assert t.num_turns == 3
    assert t.tool_turns() == (1, 2, 3)
    assert [c.id for c in t.calls_of(2)] == ["a", "b"]
    assert t.calls[0].argument("path") == "a.py"


def test_arguments_key_ignores_key_order_and_spacing() -> None:
    first = assistant(call("x", "grep", pattern="foo", path="."))
    second = assistant(
        {
            "id": "y",
            "type": "function",
            "function": {"name": "grep", "arguments": '{ "path": ".",  "pattern": "foo" }'},
        }
    )
    t = Transcript.from_messages([first, tool("x", "r"), second, tool("y", "r")])
    assert t.calls[0].arguments_key() == t.calls[1].arguments_key()


def test_content_parts_read_as_text() -> None:
    parts = {
        "role": "user",
        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
    }
    assert Transcript.from_messages([parts]).text(0) == "ab"


def test_pending_call_without_output_is_fine() -> None:
    t = Transcript.from_messages([user("go"), assistant(call("p", "view", path="a"))])
    assert t.outputs == () and len(t.calls) == 1


@pytest.mark.parametrize(
    ("messages", "problem"),
    [
        ([user("hi"), tool("ghost", "x")], "answers call 'ghost', which no earlier assistant"),
        ([tool("early", "x"), assistant(call("early", "view"))], "no earlier assistant"),
        ([{"role": "tool", "content": "x"}], "no 'tool_call_id'"),
        ([{"role": "function", "name": "f", "content": "x"}], "legacy 'function' role"),
        ([{"role": "robot", "content": "x"}], "unknown role 'robot'"),
        ([{"content": "x"}], "unknown role None"),
        (["not a message"], "expected a message mapping"),
        ([assistant(call("a", "v")), assistant(call("a", "v"))], "already used by message 0"),
        ([assistant(call("a", "v")), tool("a", "1"), tool("a", "2")], "already answered"),
        ([{"role": "assistant", "tool_calls": [{"type": "function"}]}], "has no 'id'"),
        ([{"role": "assistant", "tool_calls": [{"id": "q", "function": {}}]}], "function.name"),
        ([{"role": "assistant", "tool_calls": "nope"}], "must be a list"),
        ([{"role": "user", "content": 3}], "content must be text"),
    ],
)
def test_malformed_transcripts_name_the_message_and_problem(
    messages: list[object], problem: str
) -> None:
    with pytest.raises(TranscriptError, match=problem):
        Transcript.from_messages(messages)  # type: ignore[arg-type]


def test_orphan_output_error_names_the_message_index() -> None:
    with pytest.raises(TranscriptError) as info:
        Transcript.from_messages([system(), user("x"), tool("nope", "out")])
    assert info.value.message_index == 2


def test_pinned_index_must_exist() -> None:
    with pytest.raises(TranscriptError, match="pinned message 5"):
        Transcript.from_messages([system()], pinned=[5])
