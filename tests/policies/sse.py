"""A chat completion body as the server-sent events of its streamed form, for test servers.

``usage_apart``: usage in a last chunk of its own with no choices (OpenAI's form); else on
the final chunk, next to the finish reason and the ``leyline`` report (`leyline serve`'s).
"""

from __future__ import annotations

import json
from typing import Any


def sse(completion: dict[str, Any], *, include_usage: bool, usage_apart: bool) -> bytes:
    head = {k: completion[k] for k in ("id", "created", "model")}
    head["object"] = "chat.completion.chunk"
    choice = completion["choices"][0]
    message = choice["message"]

    def chunk(delta: dict[str, Any], **extra: Any) -> dict[str, Any]:
        finish = extra.pop("finish_reason", None)
        return {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}

    text = message.get("content") or ""
    cut = len(text) // 2
    events = [chunk({"role": "assistant", "content": ""})]
    events += [chunk({"content": piece}) for piece in (text[:cut], text[cut:]) if piece]
    for index, call in enumerate(message.get("tool_calls") or []):
        arguments = call["function"]["arguments"]
        name = call["function"]["name"]
        first = {"index": index, "id": call["id"], "type": "function"}
        first["function"] = {"name": name, "arguments": arguments[:3]}
        rest = {"index": index, "function": {"arguments": arguments[3:]}}
        events += [chunk({"tool_calls": [first]}), chunk({"tool_calls": [rest]})]
    final: dict[str, Any] = {}
    if "leyline" in completion:
        final["leyline"] = completion["leyline"]
    if include_usage and not usage_apart:
        final["usage"] = completion["usage"]
    events.append(chunk({}, finish_reason=choice["finish_reason"], **final))
    if include_usage and usage_apart:
        events.append({**head, "choices": [], "usage": completion["usage"]})
    lines = [f"data: {json.dumps(e)}\n\n" for e in events] + ["data: [DONE]\n\n"]
    return "".join(lines).encode()
