"""Message spans: the linear method agrees with rendering every prefix, on the real template."""

from __future__ import annotations

from typing import Any

import pytest

from leyline.core.chat.render import ChatRenderer, _Offsets
from leyline.core.openai_types import parse_chat
from leyline.engine.models import load_model

pytestmark = [pytest.mark.model]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]
CALL = {
    "id": "c1",
    "type": "function",
    "function": {"name": "read_file", "arguments": '{"path": "a.py"}'},
}
CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "one user message": [{"role": "user", "content": "hi"}],
    "system first": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
    ],
    "tool loop": [
        {"role": "user", "content": "Read a.py"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": "print('hello')\n" * 5},
        {"role": "assistant", "content": "It prints hello five times."},
        {"role": "user", "content": "Thanks — ünïcödé and emoji 🎉 too."},
    ],
}


@pytest.fixture(scope="module")
def renderer() -> ChatRenderer:
    tokenizer = load_model("smollm2").tokenizer
    assert tokenizer is not None
    return ChatRenderer(tokenizer)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("tools", [False, True])
def test_linear_spans_equal_the_prefix_method(
    renderer: ChatRenderer, name: str, tools: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    messages, specs = parse_chat(CONVERSATIONS[name], TOOLS if tools else None)
    fast = renderer.render(messages, specs, add_generation_prompt=True)
    assert len(fast.spans) == len(messages)
    # The reference: every prefix rendered, tokens searched linearly.
    monkeypatch.setattr(ChatRenderer, "_bounds_by_pieces", lambda self, plain, text: None)
    monkeypatch.setattr(_Offsets, "__init__", _linear_offsets)
    slow = renderer.render(messages, specs, add_generation_prompt=True)
    assert fast == slow


def _linear_offsets(self: _Offsets, offsets: list[tuple[int, int]]) -> None:
    self.offsets, self.starts, self.ordered = offsets, [a for a, _ in offsets], False


def test_long_conversations_take_the_linear_method(renderer: ChatRenderer) -> None:
    """Speed: leyline.evals.bench_render; here: the linear method is the one that applies."""
    raw = [{"role": "user" if i % 2 else "assistant", "content": f"w{i}"} for i in range(400)]
    messages, _ = parse_chat(raw)
    out = renderer.render(messages, add_generation_prompt=True)
    assert len(out.spans) == 400
    plain = renderer.template_messages(messages)
    assert renderer._bounds_by_pieces(plain, out.text) is not None
