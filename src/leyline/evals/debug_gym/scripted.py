"""A SCRIPTED stand-in for a model: fixed tool calls per task, for wiring checks only.

It is not a model and reads nothing it is sent: each task with a script gets the same
calls (eval, look, fix, eval, submit) whatever the history holds, so it solves those tasks
under every arm. What it proves: the harness drives debug-gym end to end, the policy
edits the history it sends, and the scoring counts a fixed task as solved and an unfixed
one as not. It says nothing about any policy's effect on a real model.

Everything above the transport is the real path: the planner, the policy, debug-gym's
tool-call parsing and history. Usage is an estimate (chars / 4 of the request).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from typing import Any

from openai.types.chat import ChatCompletion

from .llm import COUNTER, LeylineLLM

Call = tuple[str, dict[str, Any]]

_SHOPPING_TOTAL = (
    "        return round(sum(self.item_prices[i] * q * (1 - self.discounts.get(i, 0) / 100)"
    " for i, q in self.items.items()), 2)"
)
_PURR_STEP = """\
        if self.hunger > 20:
            result = self.intense_meow()
            self.feed("meat")
        elif self.hunger > 10:
            result = self.meow()
            self.feed("fish")"""
_SUM_TREE = """\
def build_sum_tree(root, seen=None):
    seen = set() if seen is None else seen
    if not root or id(root) in seen:
        return 0
    seen.add(id(root))
    left_sum = build_sum_tree(root.left, seen)
    right_sum = build_sum_tree(root.right, seen)
    root.sum = left_sum + right_sum + root.value
    return root.sum


def print_tree(node, level=0, seen=None):
    seen = set() if seen is None else seen
    output = []
    if node and id(node) not in seen:
        seen.add(id(node))
        output.append(f"Value: {node.value}, Sum: {node.sum}")
        output += print_tree(node.left, level + 1, seen)
        output += print_tree(node.right, level + 1, seen)
    return output"""
_PLUS_USE = """\
    def use(self, input_text):
        try:
            numbers = input_text.split(self.action)[1].split("```")[0].strip()
            number_1, number_2 = numbers.split()
        except Exception:
            return "SyntaxError: invalid syntax."
        try:
            result = int(number_1) + int(number_2)
        except ValueError:
            return "ValueError: invalid value."
        return result"""


def _edit(path: str, start: int, end: int | None, code: str) -> Call:
    return ("edit", {"path": path, "start": start, "end": end, "new_code": code})


def _view(path: str) -> Call:
    return ("view", {"path": path})


EVAL: Call = ("eval", {})
SUBMIT: Call = ("submit", {})

SCRIPTS: dict[str, tuple[Call, ...]] = {
    "shopping_cart": (
        EVAL,
        _view("shopping_cart_code.py"),
        _view("test.py"),
        _edit("shopping_cart_code.py", 24, None, _SHOPPING_TOTAL),
        EVAL,
        SUBMIT,
    ),
    "purr": (
        EVAL,
        _view("purr_code.py"),
        _edit("purr_code.py", 27, 32, _PURR_STEP),
        EVAL,
        SUBMIT,
    ),
    "sum_tree": (
        EVAL,
        _view("sum_tree_code.py"),
        _edit("sum_tree_code.py", 14, 31, _SUM_TREE),
        EVAL,
        SUBMIT,
    ),
    "scientific_calculator": (
        EVAL,
        _view("scientific_calculator_code.py"),
        _edit("scientific_calculator_code.py", 17, 29, _PLUS_USE),
        _edit("scientific_calculator_code.py", 6, None, '    action = "```plus"'),
        EVAL,
        SUBMIT,
    ),
}
"""Fixes for four tasks. Any other task gets (eval, submit): it stays unsolved."""

GIVE_UP: tuple[Call, ...] = (EVAL, SUBMIT)
USAGE_SOURCE = "scripted estimate (chars / 4 of each request), not a tokenizer"


class ScriptedLLM(LeylineLLM):
    """Answers each request with the task's next scripted tool call; no server, no model."""

    def __init__(self, task: str, **kwargs: Any) -> None:
        kwargs.setdefault("model", "scripted")
        kwargs.setdefault("base_url", "scripted://no-server")
        kwargs.setdefault("api_key", "scripted")
        super().__init__(**kwargs)
        self.script = SCRIPTS.get(task, GIVE_UP)
        self.requests: list[dict[str, Any]] = []
        """What the harness sent, request by request (messages, tools, extra_body)."""
        self._step = itertools.count()

    def end_session(self) -> None:
        return None  # no server

    def _send(self, **kwargs: Any) -> ChatCompletion:
        self.requests.append(kwargs)
        n = next(self._step)
        name, arguments = self.script[n] if n < len(self.script) else SUBMIT
        return ChatCompletion.model_validate(
            scripted_completion(n, name, arguments, kwargs.get("messages", ()))
        )


def scripted_completion(
    step: int, name: str, arguments: Mapping[str, Any], messages: Sequence[Any]
) -> dict[str, Any]:
    """An OpenAI chat completion carrying one tool call (dict form)."""
    args = json.dumps(dict(arguments))
    prompt = COUNTER.count(json.dumps(list(messages), default=str))
    completion = COUNTER.count(name + args)
    return {
        "id": f"scripted-{step}",
        "object": "chat.completion",
        "created": 0,
        "model": "scripted",
        "choices": [
            {
                "index": 0,
                "finish_reason": "tool_calls",
                "message": {
                    "role": "assistant",
                    "content": f"[scripted step {step + 1}] {name}",
                    "tool_calls": [
                        {
                            "id": f"call_{step + 1}",
                            "type": "function",
                            "function": {"name": name, "arguments": args},
                        }
                    ],
                },
            }
        ],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
    }
