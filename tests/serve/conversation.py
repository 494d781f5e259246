"""A tool-using conversation for the server tests (scripted messages, real model replies)."""

from __future__ import annotations

from typing import Any

NOTES = (
    "\n".join(
        f"- item {i}: the {w} module was reviewed on day {i % 7} and needs follow-up"
        for i, w in enumerate(["parser", "lexer", "cache", "router", "planner", "scheduler"] * 6)
    )
    + "\nThe release deadline is Friday."
)

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the project.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]


def turn1() -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Read notes.txt and tell me the release deadline."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "read_file", "arguments": '{"path": "notes.txt"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": NOTES},
        {"role": "user", "content": "What is the deadline?"},
    ]
