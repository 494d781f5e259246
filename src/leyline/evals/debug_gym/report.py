"""The run's report: ``report.json`` (everything), ``report.md`` (tables), ``solve_rate.png``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from leyline.evals.common.report import json_fields

from .config import NETWORK_TASKS
from .plot import write_plot
from .records import EpisodeResult
from .server import ArmPlan
from .stats import Rate, Spread
from .summary import Summary, summarize

SCRIPTED_BANNER = (
    "**SCRIPTED RUN: no model.** A deterministic script (not a model) chose every action; "
    "it solves the tasks it has a script for whatever the context holds. These figures "
    "check the harness and its scoring, not any policy."
)


@dataclass(frozen=True, slots=True)
class RunMeta:
    model: str
    base_url: str
    server: str
    """What the probe found (or that the scripted stand-in answered)."""
    arms: tuple[ArmPlan, ...]
    tasks: tuple[str, ...]
    runs: int
    max_steps: int
    tools: tuple[str, ...]
    started: str
    finished: str
    scripted: bool = False
    usage_source: str = "server usage"
    generation: dict[str, object] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        return json_fields(
            self, "model", "base_url", "server", "scripted", "arms", "tasks", "runs", "max_steps",
            "tools", "started", "finished", "usage_source", "generation", "versions",
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class ReportFiles:
    json: Path
    markdown: Path
    plot: Path | None
    """None when matplotlib is not installed."""


def write_report(out: Path, meta: RunMeta, episodes: Sequence[EpisodeResult]) -> ReportFiles:
    """Write the three files into ``out`` (created if needed)."""
    out.mkdir(parents=True, exist_ok=True)
    names = [a.arm.name for a in meta.arms]
    summary = summarize(episodes, names, meta.tasks)
    data = {
        "meta": meta.to_json(),
        "summary": summary.to_json(),
        "episodes": [e.to_json() for e in episodes],
    }
    json_path = out / "report.json"
    json_path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    md_path = out / "report.md"
    md_path.write_text(render_markdown(meta, summary, episodes), encoding="utf-8")
    title = f"mini_nightmare, {meta.model}" + (" (SCRIPTED: no model)" if meta.scripted else "")
    plot = write_plot(out / "solve_rate.png", summary, title=title)
    return ReportFiles(json_path, md_path, plot)


def render_markdown(meta: RunMeta, summary: Summary, episodes: Sequence[EpisodeResult] = ()) -> str:
    lines = ["# debug-gym mini_nightmare: the policy leg", ""]
    if meta.scripted:
        lines += [SCRIPTED_BANNER, ""]
    lines += [
        f"- model: `{meta.model}` at `{meta.base_url}`; server: {meta.server}",
        f"- {len(meta.tasks)} tasks x {meta.runs} runs per arm; at most {meta.max_steps} "
        f"steps; tools: {', '.join(meta.tools)}",
        f"- tokens: {meta.usage_source}; run {meta.started} -> {meta.finished}",
        *[f"- {task}: {why}" for task, why in NETWORK_TASKS.items() if task in meta.tasks],
        "",
        "## Arms",
        "",
        "| arm | policy | how the history reaches the server |",
        "|---|---|---|",
    ]
    for plan in meta.arms:
        policy = f"`{plan.arm.policy}`" if plan.arm.policy else "none"
        lines.append(f"| {plan.arm.name} | {policy} | {plan.transport} |")
    lines += ["", "## Solve rate, steps and tokens per episode", ""]
    lines += _arm_table(summary)
    if summary.differences:
        lines += ["", "Solve-rate differences (95% Newcombe interval, episodes as independent):"]
        for name, diff in summary.differences.items():
            if diff is not None:
                lines.append(f"- {name}: {_pp(diff.value)} pp [{_pp(diff.low)}, {_pp(diff.high)}]")
    lines += ["", "## Per task: solved / runs (mean steps)", ""]
    names = [a.arm for a in summary.arms]
    lines += ["| task | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for row in summary.tasks:
        cells = []
        for name in names:
            cell = row.cells.get(name)
            cells.append(
                "-"
                if cell is None
                else f"{cell.solved.successes}/{cell.solved.trials} ({_num(cell.steps.mean)})"
            )
        lines.append(f"| {row.task} | " + " | ".join(cells) + " |")
    failed = [e for e in episodes if e.error is not None]
    if failed:
        lines += ["", f"## Errors ({len(failed)} episodes; the first ones)", ""]
        lines += [f"- {e.arm}/{e.task} run {e.run}: `{e.error}`" for e in failed[:10]]
    lines += ["", *LEGEND]
    return "\n".join(lines) + "\n"


LEGEND = (
    "What the columns mean: *solved* counts episodes whose last eval/submit passed every "
    "collected test (debug-gym's `resolved`); the interval is the 95% Wilson score "
    "interval. *steps* are model calls per episode. *prompt/completion tokens* sum the "
    "server's `usage` over an episode's calls. *prefilled/reused* (Leyline servers only) "
    "are the tokens the server computed vs took from cache. *edits* are policy edits, "
    "*directives* the Leyline directives sent. Errors count as unsolved.",
)


def _arm_table(summary: Summary) -> list[str]:
    leyline = any(a.prefilled_tokens is not None for a in summary.arms)
    head = "| arm | solved | rate [95% CI] | steps mean / median | steps if solved "
    head += "| prompt tok / ep | completion tok / ep "
    head += "| prefilled / ep | reused / ep " if leyline else ""
    head += "| edits / ep | directives / ep | errors |"
    rows = [head, "|---" * (head.count("|") - 1) + "|"]
    for a in summary.arms:
        cells = [
            a.arm,
            f"{a.solved.successes}/{a.solved.trials}",
            _rate(a.solved),
            f"{_num(a.steps.mean)} / {_num(a.steps.median)}",
            _num(a.steps_when_solved.mean),
            _num(a.prompt_tokens.mean, 0),
            _num(a.completion_tokens.mean, 0),
        ]
        if leyline:
            cells += [_spread_mean(a.prefilled_tokens), _spread_mean(a.reused_tokens)]
        cells += [_num(a.policy_edits.mean), _num(a.directives.mean), str(a.errors)]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def _rate(rate: Rate) -> str:
    if rate.value is None:
        return "-"
    return f"{100 * rate.value:.1f}% [{100 * rate.low:.1f}, {100 * rate.high:.1f}]"


def _spread_mean(spread: Spread | None) -> str:
    return "-" if spread is None else _num(spread.mean, 0)


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _pp(value: float) -> str:
    return f"{100 * value:+.1f}"
