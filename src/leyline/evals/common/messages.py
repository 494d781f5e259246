"""OpenAI-format messages the evals' scripted agents send."""

from __future__ import annotations

import json
from collections.abc import Mapping
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
