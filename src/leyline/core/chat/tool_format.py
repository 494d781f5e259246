"""Tool calls in plain text, for chat templates that know no tools (SmolLM2's ChatML).

The documented fallback format (the "Hermes" convention many open models were tuned on):

* the tool list goes into the system message inside ``<tools>...</tools>`` as JSON;
* the model calls a tool by writing ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
* an assistant message with tool calls is rendered back the same way, so the history reads
  as the model would have written it.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence

from leyline.core.openai_types import FunctionCall, ToolCall, ToolSpec

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

TOOLS_PREAMBLE = (
    "You can call functions. The available functions are listed as JSON in <tools></tools>. "
    'To call one, answer with <tool_call>{"name": <function name>, "arguments": '
    "<arguments object>}</tool_call>, one block per call."
)


def render_tools(tools: Sequence[ToolSpec]) -> str:
    specs = [tool.function.model_dump(exclude_none=True) for tool in tools]
    return f"{TOOLS_PREAMBLE}\n<tools>\n{json.dumps(specs, ensure_ascii=False)}\n</tools>"


def render_tool_calls(calls: Sequence[ToolCall]) -> str:
    blocks = []
    for call in calls:
        try:
            arguments: object = json.loads(call.function.arguments or "{}")
        except json.JSONDecodeError:
            arguments = call.function.arguments  # keep what the client sent, verbatim
        payload = {"name": call.function.name, "arguments": arguments}
        blocks.append(f"<tool_call>{json.dumps(payload, ensure_ascii=False)}</tool_call>")
    return "\n".join(blocks)


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """Split generated text into plain content and well-formed tool calls.

    A block that is not valid JSON with a string ``name`` stays in the content, so nothing
    the model wrote is lost.
    """
    calls: list[ToolCall] = []
    kept: list[str] = []
    cursor = 0
    for match in _CALL.finditer(text):
        call = _parse_one(match.group(1))
        if call is None:
            continue
        kept.append(text[cursor : match.start()])
        cursor = match.end()
        calls.append(call)
    kept.append(text[cursor:])
    return "".join(kept).strip(), calls


def _parse_one(body: str) -> ToolCall | None:
    try:
        payload = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return None
    arguments = payload.get("arguments", {})
    encoded = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return ToolCall(
        id=f"call_{uuid.uuid4().hex[:16]}",
        function=FunctionCall(name=payload["name"], arguments=encoded),
    )
