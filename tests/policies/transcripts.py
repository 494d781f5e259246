"""Realistic OpenAI-format transcripts for the policy tests (a debug-gym style episode)."""

from __future__ import annotations

import json
from collections.abc import Sequence

from leyline.policies import EstimateCounter, Message, message_tokens

Msg = dict[str, object]

COUNTER = EstimateCounter()
"""What the token-budget tests count with (no tiktoken needed)."""


def total(messages: Sequence[Message]) -> int:
    return sum(message_tokens(COUNTER, m) for m in messages)


SOURCE = "\n".join(f"{n:4d}  def step_{n}(x):\n        return x + {n}" for n in range(40))


def system(text: str = "You are a debugging agent. Use the tools to fix the bug.") -> Msg:
    return {"role": "system", "content": text}


def user(text: str) -> Msg:
    return {"role": "user", "content": text}


def call(call_id: str, name: str, **arguments: object) -> Msg:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }


def assistant(*calls: Msg, text: str | None = None) -> Msg:
    message: Msg = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = list(calls)
    return message


def tool(call_id: str, text: str) -> Msg:
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def view_output(path: str, turn: int) -> str:
    return f"Viewing {path} (turn {turn}):\n{SOURCE}"


def episode(turns: int) -> list[Msg]:
    """System, task, then ``turns`` steps that each view a file and get its (long) output."""
    messages = [system(), user("The test test_sum fails. Find and fix the bug in sum_tree.py.")]
    for t in range(1, turns + 1):
        path = f"src/module_{t}.py"
        messages.append(assistant(call(f"call_{t}", "view", path=path), text=f"Look at {path}."))
        messages.append(tool(f"call_{t}", view_output(path, t)))
    return messages


def parallel_episode() -> list[Msg]:
    """Turn 1 makes two parallel calls; turns 2 and 3 one call each."""
    return [
        system(),
        user("Fix the failing test."),
        assistant(call("a", "view", path="a.py"), call("b", "listdir", path=".")),
        tool("a", view_output("a.py", 1)),
        tool("b", "a.py\nb.py\ntests/\n" * 20),
        assistant(call("c", "view", path="b.py")),
        tool("c", view_output("b.py", 2)),
        assistant(call("d", "eval")),
        tool("d", "1 failed, 3 passed\n" + "." * 400),
    ]
