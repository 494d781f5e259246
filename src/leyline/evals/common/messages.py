"""OpenAI-format messages the evals' scripted agents send, and the tool turns they replay."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


def tool_exchange(
    turn: int, tool: str, arguments: Mapping[str, Any], output: str
) -> list[dict[str, Any]]:
    """Tool turn ``turn`` (1-based): the assistant's call (id ``call_<turn>``) and its output."""
    call_id = f"call_{turn}"
    function = {"name": tool, "arguments": json.dumps(dict(arguments))}
    call = {"id": call_id, "type": "function", "function": function}
    return [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": output},
    ]


@dataclass(frozen=True, slots=True)
class ToolTurn:
    """One scripted tool call and its output."""

    tool: str
    arguments: dict[str, Any]
    output: str

    def messages(self, turn: int) -> list[dict[str, Any]]:
        """This call as tool turn ``turn`` (1-based) of a chat: ``tool_exchange``."""
        return tool_exchange(turn, self.tool, self.arguments, self.output)
