"""Agent trajectories to replay: tool calls with their real or realistic outputs.

Three sources:
- ``demo``: the demo's scripted calls, run now on the bundled sample project (real tools);
- ``debug-gym``: recorded debug-gym episodes (the bundled file holds the scripted agent's
  runs on mini_nightmare: scripted actions, real debug-gym observations), or any debug-gym
  results folder written by ``leyline eval debug-gym`` (``--trajectories DIR``);
- ``synthetic``: generated, seeded (``synthetic.py``): pytest logs, tracebacks, file views,
  grep hits, listings and diffs of a made-up project.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib.resources import files
from itertools import zip_longest
from pathlib import Path
from typing import Any

from leyline.evals.common.messages import ToolTurn
from leyline.evals.common.report import json_fields

SOURCES = ("synthetic", "debug-gym", "demo")

BUNDLED_DEBUG_GYM = "debug_gym_scripted.json"

DEBUG_GYM_SYSTEM = (
    "You are a debugging agent specialized in fixing Python programs. Your goal is to debug a "
    "Python program to make sure it can pass a set of test functions. You have access to a set "
    "of tools including the pdb debugger to help you investigate the code before proposing a "
    "patch. Once you are confident, use the submit tool."
)


@dataclass(frozen=True, slots=True)
class Trajectory:
    name: str
    source: str
    system: str
    task: str
    calls: tuple[ToolTurn, ...]

    def opening(self) -> list[dict[str, Any]]:
        return [{"role": "system", "content": self.system}, {"role": "user", "content": self.task}]

    def turn(self, turn: int) -> list[dict[str, Any]]:
        """Turn ``turn`` (1-based): the assistant's call and the tool's output."""
        return self.calls[turn - 1].messages(turn)

    def tool_specs(self) -> list[dict[str, Any]]:
        """An OpenAI tool list naming every tool the trajectory calls (rendered in the prompt)."""
        names = dict.fromkeys(c.tool for c in self.calls)
        return [_spec(name, sorted({k for c in self.calls for k in c.arguments})) for name in names]

    def to_json(self) -> dict[str, Any]:
        calls = [{"name": c.tool, "arguments": c.arguments, "output": c.output} for c in self.calls]
        return json_fields(self, "name", "source", "system", "task", calls=calls)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Trajectory:
        calls = tuple(ToolTurn(c["name"], dict(c["arguments"]), c["output"]) for c in data["calls"])
        return cls(data["name"], data["source"], data["system"], data["task"], calls)


def _spec(name: str, arguments: Sequence[str]) -> dict[str, Any]:
    properties = {a: {"type": "string"} for a in arguments}
    parameters = {"type": "object", "properties": properties}
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def demo_trajectory() -> Trajectory:
    """The demo's twelve scripted calls with outputs of the real tools on the sample project."""
    from leyline.evals.demo.script import SCRIPT, SYSTEM, TASK
    from leyline.evals.demo.tools import ProjectTools, sample_project

    tools = ProjectTools(sample_project())
    calls = tuple(
        ToolTurn(s.tool, dict(s.arguments), tools.run(s.tool, json.dumps(s.arguments)))
        for s in SCRIPT
    )
    return Trajectory("demo", "demo", SYSTEM, TASK, calls)


def from_debug_gym_run(folder: Path, *, arm: str = "none") -> list[Trajectory]:
    """The episodes of a debug-gym results folder (``trajectories/<arm>/<task>-run<k>.json``).

    Each step's action and observation become a call and its output; steps without an
    action (a reply with no tool call) are skipped.
    """
    paths = sorted((folder / "trajectories" / arm).glob("*.json"))
    if not paths:
        raise FileNotFoundError(f"no trajectories under {folder / 'trajectories' / arm}")
    return [t for t in (_episode(json.loads(p.read_text()), p.stem) for p in paths) if t.calls]


def _episode(data: dict[str, Any], name: str) -> Trajectory:
    calls = tuple(
        ToolTurn(s["action"]["name"], dict(s["action"].get("arguments") or {}), s["observation"])
        for s in data["steps"]
        if s.get("action")
    )
    task = data["episode"]["task"]
    prompt = f"Fix the bug in the `{task}` project so that its tests pass."
    return Trajectory(f"debug-gym/{name}", "debug-gym", DEBUG_GYM_SYSTEM, prompt, calls)


def bundled_debug_gym() -> list[Trajectory]:
    text = files("leyline.evals.mechanism").joinpath("data", BUNDLED_DEBUG_GYM).read_text()
    return [Trajectory.from_json(t) for t in json.loads(text)["trajectories"]]


def load(sources: Iterable[str], *, synthetic_count: int, seed: int) -> list[Trajectory]:
    """The replay pool: the sources interleaved (client ``i`` replays ``pool[i % len]``, so
    even a few clients see every source), the longest trajectories of each source first."""
    from .synthetic import synthetic_trajectories

    groups: list[list[Trajectory]] = []
    for source in sources:
        if source == "synthetic":
            group = synthetic_trajectories(synthetic_count, seed=seed)
        elif source == "debug-gym":
            group = bundled_debug_gym()
        elif source == "demo":
            group = [demo_trajectory()]
        elif Path(source).is_dir():
            group = from_debug_gym_run(Path(source))
        else:
            raise ValueError(
                f"unknown trajectory source {source!r}: use {', '.join(SOURCES)} "
                "or a debug-gym results folder"
            )
        groups.append(sorted(group, key=lambda t: -len(t.calls)))
    pool = [t for row in zip_longest(*groups) for t in row if t is not None]
    if not pool:
        raise ValueError("no trajectories to replay")
    return pool
