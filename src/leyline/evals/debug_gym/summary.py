"""Episodes -> per-arm and per-task figures: solve rates, steps, tokens."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from .records import EpisodeResult
from .stats import Difference, Rate, Spread, difference


@dataclass(frozen=True, slots=True)
class ArmSummary:
    arm: str
    solved: Rate
    steps: Spread
    steps_when_solved: Spread
    prompt_tokens: Spread
    """Per episode: the sum of ``usage.prompt_tokens`` over its turns."""
    completion_tokens: Spread
    prefilled_tokens: Spread | None
    """Per episode, as the Leyline server reported (None: no Leyline server answered)."""
    reused_tokens: Spread | None
    policy_edits: Spread
    directives: Spread
    fallbacks: int
    errors: int
    stop_reasons: dict[str, int]

    def to_json(self) -> dict[str, object]:
        optional = {
            name: spread.to_json() if spread is not None else None
            for name, spread in (
                ("prefilled_tokens", self.prefilled_tokens),
                ("reused_tokens", self.reused_tokens),
            )
        }
        return {
            "arm": self.arm,
            "solved": self.solved.to_json(),
            "steps": self.steps.to_json(),
            "steps_when_solved": self.steps_when_solved.to_json(),
            "prompt_tokens": self.prompt_tokens.to_json(),
            "completion_tokens": self.completion_tokens.to_json(),
            **optional,
            "policy_edits": self.policy_edits.to_json(),
            "directives": self.directives.to_json(),
            "fallbacks": self.fallbacks,
            "errors": self.errors,
            "stop_reasons": self.stop_reasons,
        }


@dataclass(frozen=True, slots=True)
class TaskCell:
    solved: Rate
    steps: Spread

    def to_json(self) -> dict[str, object]:
        return {"solved": self.solved.to_json(), "steps": self.steps.to_json()}


@dataclass(frozen=True, slots=True)
class TaskRow:
    task: str
    cells: dict[str, TaskCell]
    """Arm name -> figures; an arm with no episode on the task is absent."""

    def to_json(self) -> dict[str, object]:
        return {"task": self.task, "arms": {a: c.to_json() for a, c in self.cells.items()}}


@dataclass(frozen=True, slots=True)
class Summary:
    arms: tuple[ArmSummary, ...]
    tasks: tuple[TaskRow, ...]
    differences: dict[str, Difference | None]
    """``"splice - none"`` etc.: solve-rate differences with Newcombe intervals."""

    def arm(self, name: str) -> ArmSummary:
        return next(a for a in self.arms if a.arm == name)

    def to_json(self) -> dict[str, object]:
        return {
            "arms": [a.to_json() for a in self.arms],
            "tasks": [t.to_json() for t in self.tasks],
            "differences": {k: d.to_json() if d else None for k, d in self.differences.items()},
        }


def summarize(
    episodes: Sequence[EpisodeResult], arms: Sequence[str], tasks: Sequence[str]
) -> Summary:
    """Figures per arm (in ``arms`` order) and per task (in ``tasks`` order)."""
    arm_rows = tuple(_arm_summary(a, [e for e in episodes if e.arm == a]) for a in arms)
    task_rows = []
    for task in tasks:
        cells = {}
        for arm in arms:
            mine = [e for e in episodes if e.arm == arm and e.task == task]
            if mine:
                solved = Rate.of(sum(e.resolved for e in mine), len(mine))
                cells[arm] = TaskCell(solved, Spread.of([e.steps for e in mine]))
        task_rows.append(TaskRow(task, cells))
    by_name = {a.arm: a.solved for a in arm_rows}
    pairs = [("reprefill", "none"), ("splice", "none"), ("splice", "reprefill")]
    diffs = {
        f"{a} - {b}": difference(by_name[a], by_name[b])
        for a, b in pairs
        if a in by_name and b in by_name
    }
    return Summary(arm_rows, tuple(task_rows), diffs)


def _arm_summary(arm: str, episodes: Sequence[EpisodeResult]) -> ArmSummary:
    leyline = [e for e in episodes if e.leyline_turns]

    def spread(name: str, among: Sequence[EpisodeResult] = episodes) -> Spread:
        return Spread.of([float(getattr(e, name)) for e in among])

    return ArmSummary(
        arm=arm,
        solved=Rate.of(sum(e.resolved for e in episodes), len(episodes)),
        steps=spread("steps"),
        steps_when_solved=spread("steps", [e for e in episodes if e.resolved]),
        prompt_tokens=spread("prompt_tokens"),
        completion_tokens=spread("completion_tokens"),
        prefilled_tokens=spread("prefilled_tokens", leyline) if leyline else None,
        reused_tokens=spread("reused_tokens", leyline) if leyline else None,
        policy_edits=spread("policy_edits"),
        directives=spread("directives"),
        fallbacks=sum(e.fallbacks for e in episodes),
        errors=sum(e.error is not None for e in episodes),
        stop_reasons=dict(Counter(e.stop_reason for e in episodes)),
    )
