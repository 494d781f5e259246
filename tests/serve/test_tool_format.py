"""The documented plain-text tool-call format: rendering and parsing round-trip."""

from __future__ import annotations

import json

from leyline.core.chat.tool_format import parse_tool_calls, render_tool_calls, render_tools
from leyline.core.openai_types import FunctionCall, FunctionSpec, ToolCall, ToolSpec


def test_rendered_calls_parse_back_to_the_same_calls() -> None:
    calls = [
        ToolCall(id="a", function=FunctionCall(name="read_file", arguments='{"path": "x.py"}')),
        ToolCall(id="b", function=FunctionCall(name="grep", arguments='{"pattern": "def "}')),
    ]
    content, parsed = parse_tool_calls("Let me look.\n" + render_tool_calls(calls))
    assert content == "Let me look."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in parsed] == [
        ("read_file", {"path": "x.py"}),
        ("grep", {"pattern": "def "}),
    ]
    assert len({c.id for c in parsed}) == 2


def test_malformed_blocks_stay_in_the_content() -> None:
    text = 'a <tool_call>{"name": 3}</tool_call> b <tool_call>not json</tool_call>'
    content, parsed = parse_tool_calls(text)
    assert parsed == [] and content == text


def test_tool_list_is_rendered_as_json_inside_tools_tags() -> None:
    block = render_tools([ToolSpec(function=FunctionSpec(name="ls", description="list"))])
    inner = block.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    assert json.loads(inner) == [{"name": "ls", "description": "list"}]
