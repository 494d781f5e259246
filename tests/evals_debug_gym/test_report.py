"""Episodes -> summary -> report.json / report.md / solve_rate.png, on made-up episodes."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from pathlib import Path

import pytest

from leyline.evals.common.stats import wilson
from leyline.evals.debug_gym.config import make_arms
from leyline.evals.debug_gym.records import EpisodeResult, StopReason, TurnRecord
from leyline.evals.debug_gym.report import SCRIPTED_BANNER, RunMeta, write_report
from leyline.evals.debug_gym.server import ServerInfo, plan_arm
from leyline.evals.debug_gym.summary import summarize


def episode(
    task: str, arm: str, run: int, resolved: bool, steps: int, leyline: bool = False
) -> EpisodeResult:
    turn = TurnRecord(
        prompt_tokens=100,
        completion_tokens=10,
        messages=4,
        policy_edits=1 if arm != "none" else 0,
        directives=1 if arm == "splice" else 0,
        path="splice" if leyline else None,
        reused_tokens=90 if leyline else None,
        prefilled_tokens=10 if leyline else None,
        rotated_tokens=5 if leyline else None,
    )
    stop: StopReason = "resolved" if resolved else "max_steps"
    return EpisodeResult.from_turns(
        task=task,
        arm=arm,
        run=run,
        resolved=resolved,
        score=1 if resolved else 0,
        max_score=1,
        stop_reason=stop,
        turns=[turn] * steps,
        wall_s=1.0,
    )


EPISODES = [
    episode("purr", "none", 0, True, 4),
    episode("purr", "none", 1, False, 9),
    episode("sum_tree", "none", 0, False, 9),
    episode("sum_tree", "none", 1, False, 9),
    episode("purr", "splice", 0, True, 3, leyline=True),
    episode("purr", "splice", 1, True, 5, leyline=True),
    episode("sum_tree", "splice", 0, True, 7, leyline=True),
    episode("sum_tree", "splice", 1, False, 9, leyline=True),
]


def meta(scripted: bool = False) -> RunMeta:
    server = ServerInfo(True, "Leyline 1.0 (verbs: splice, forget)")
    arms = tuple(plan_arm(a, server) for a in make_arms(["none", "splice"], "truncate"))
    return RunMeta(
        model="m",
        base_url="http://x/v1",
        server=server.note,
        arms=arms,
        tasks=("purr", "sum_tree"),
        runs=2,
        max_steps=10,
        tools=("view", "edit", "eval", "submit"),
        started="t0",
        finished="t1",
        scripted=scripted,
    )


def test_episode_totals_add_up_over_turns() -> None:
    e = EPISODES[4]
    assert (e.steps, e.prompt_tokens, e.completion_tokens, e.usage_turns) == (3, 300, 30, 3)
    assert (e.leyline_turns, e.reused_tokens, e.prefilled_tokens, e.rotated_tokens) == (
        3,
        270,
        30,
        15,
    )
    assert EpisodeResult.from_json(json.loads(json.dumps(e.to_json()))) == e


def test_summary_per_arm_and_per_task() -> None:
    summary = summarize(EPISODES, ["none", "splice"], ["purr", "sum_tree"])
    none, splice = summary.arm("none"), summary.arm("splice")
    assert (none.solved.successes, none.solved.trials) == (1, 4)
    assert (none.solved.low, none.solved.high) == wilson(1, 4)
    assert (splice.solved.successes, splice.solved.trials) == (3, 4)
    assert splice.steps.mean == 6.0 and splice.steps_when_solved.mean == 5.0
    assert none.prefilled_tokens is None  # no Leyline object came back for that arm
    assert splice.prefilled_tokens is not None and splice.prefilled_tokens.mean == 60.0
    assert none.stop_reasons == {"resolved": 1, "max_steps": 3}
    purr = summary.tasks[0].cells
    assert (purr["none"].solved.successes, purr["splice"].solved.successes) == (1, 2)
    diff = summary.differences["splice - none"]
    assert diff is not None and diff.value == pytest.approx(0.5)
    assert set(summary.differences) == {"splice - none"}  # no reprefill arm in this run


def test_report_files_hold_the_tables_and_the_raw_episodes(tmp_path: Path) -> None:
    files = write_report(tmp_path / "out", meta(), EPISODES)
    data = json.loads(files.json.read_text())
    assert [EpisodeResult.from_json(e) for e in data["episodes"]] == EPISODES
    assert data["summary"]["arms"][1]["solved"]["rate"] == 0.75
    assert data["meta"]["arms"][1]["transport"].startswith("Leyline directives")
    md = files.markdown.read_text()
    assert "| splice | 3/4 | 75.0% [" in md
    assert "| purr | 1/2 (6.5) | 2/2 (4.0) |" in md
    assert "prefilled / ep" in md and SCRIPTED_BANNER not in md and "## Errors" not in md
    if importlib.util.find_spec("matplotlib") is None:
        assert files.plot is None
    else:
        assert files.plot is not None and files.plot.read_bytes()[:4] == b"\x89PNG"


def test_scripted_runs_degraded_splice_and_errors_are_named(tmp_path: Path) -> None:
    plain = ServerInfo(False, "no Leyline capabilities (HTTP 404)")
    arms = tuple(plan_arm(a, plain) for a in make_arms(["none", "splice"], "truncate"))
    broken = replace(EPISODES[0], resolved=False, stop_reason="error", error="APIError: 500")
    files = write_report(tmp_path, replace(meta(scripted=True), arms=arms), [*EPISODES, broken])
    md = files.markdown.read_text()
    assert "- none/purr run 0: `APIError: 500`" in md
    assert md.count(SCRIPTED_BANNER) == 1
    assert "splice DEGRADED to re-prefill (no Leyline capabilities (HTTP 404))" in md
