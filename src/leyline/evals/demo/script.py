"""The scripted side of the demo: the task and the agent's tool-call decisions.

A 135M model is not a reliable tool caller, so the calls the agent makes are this fixed
list, the same in both arms. Everything else is real: the tools run on the bundled
project, the model generates after every tool output, the policy edits the transcript and
the server edits its cache.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from leyline.evals.common.messages import tool_exchange

SYSTEM = (
    "You are a careful coding agent. You inspect a small Python project with the tools "
    "list_files, read_file and grep, then explain the cause of the bug you were asked about."
)

TASK = (
    "Bug #41: discounted orders come out too low (order 1187, wholesale: invoice 9.21, "
    "expected 10.84). Find the cause in the project and say which function to fix."
)


@dataclass(frozen=True, slots=True)
class ToolStep:
    """One scripted decision: call ``tool`` with ``arguments``."""

    tool: str
    arguments: dict[str, str]

    def label(self) -> str:
        args = ", ".join(self.arguments.values())
        return f"{self.tool}({args})"


SCRIPT: tuple[ToolStep, ...] = (
    ToolStep("list_files", {"path": "."}),
    ToolStep("read_file", {"path": "README.md"}),
    ToolStep("read_file", {"path": "NOTES.md"}),
    ToolStep("grep", {"pattern": "discount"}),
    ToolStep("read_file", {"path": "pricing.py"}),
    ToolStep("read_file", {"path": "orders.py"}),
    ToolStep("read_file", {"path": "check_pricing.py"}),
    ToolStep("grep", {"pattern": "apply_discount"}),
    ToolStep("read_file", {"path": "report.py"}),
    ToolStep("read_file", {"path": "catalog.py"}),
    ToolStep("grep", {"pattern": "def "}),
    ToolStep("read_file", {"path": "data/prices.csv"}),
)
"""The agent's decisions, in order; ``leyline demo --turns N`` runs the first N."""


def opening() -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]


def tool_turn(run_tool: Callable[[str, str], str], turn: int) -> list[dict[str, Any]]:
    """Turn ``turn`` (1-based) of the script: the assistant's call and the tool's real output.

    ``run_tool(name, arguments_json)`` runs the tool, e.g. ``ProjectTools.run``.
    """
    step = SCRIPT[turn - 1]
    output = run_tool(step.tool, json.dumps(step.arguments))
    return tool_exchange(turn, step.tool, step.arguments, output)
