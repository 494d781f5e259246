"""Run the memory eval: build each item, run it through every arm, report."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from leyline.engine.engine import Engine
from leyline.evals.common import Report, progress, results_dir
from leyline.evals.common.engine import rotating_engine, run_footer

from .arms import ItemResult, arm_names, run_item
from .cases import Item, make_item
from .markdown import sections
from .plots import plot_accuracy_vs_cost
from .summary import arm_rows, by_length, setup


@dataclass(frozen=True, slots=True)
class MemoryOptions:
    model: str
    items: int
    """Items per trajectory length (one user, one update, ``questions`` questions each)."""
    trajectory: tuple[int, ...]
    """Trajectory lengths in tokens (each a budget: whole steps up to it)."""
    facts: int
    changes: int
    questions: int
    choices: int
    seams: tuple[int, ...]
    seed: int
    out: Path | None
    fast: bool = False
    progress: bool = True

    @property
    def arms(self) -> list[str]:
        return arm_names(self.seams)


def _items(engine: Engine, options: MemoryOptions) -> Iterator[Item]:
    """Item ``i`` of every length is the same user, update and questions."""
    for budget in options.trajectory:
        for index in range(options.items):
            yield make_item(
                index,
                facts=options.facts,
                changes=options.changes,
                budget=budget,
                questions=options.questions,
                choices=options.choices,
                encode=engine.encode,
                seed=options.seed,
            )


def _record(result: ItemResult, arms: list[str]) -> dict[str, Any]:
    item = result.item
    return {
        "index": item.index,
        "budget": item.budget,
        "user": item.new.user,
        "version": item.new.version,
        "changed": list(item.changed),
        "tokens": {
            "system": len(item.system),
            "profile": len(item.profile),
            "old_profile": len(item.old_profile),
            "trajectory": len(item.trajectory),
        },
        "compile_seconds": result.compile_seconds,
        "base_seconds": result.base_seconds,
        "costs": {arm: asdict(result.costs[arm]) for arm in arms},
        "questions": [
            {
                "key": q.key,
                "changed": q.changed,
                "candidates": list(q.candidates),
                "candidate_tokens": list(q.candidate_tokens),
                "arms": {
                    arm: {
                        **asdict(result.scores[arm][i]),
                        "vs_late": {
                            **asdict(result.versus[arm][i].agreement),
                            "max_dlogp_top20": result.versus[arm][i].max_dlogp,
                        },
                    }
                    for arm in arms
                },
            }
            for i, q in enumerate(item.questions)
        ],
    }


@torch.inference_mode()
def run_memory_eval(options: MemoryOptions) -> Path:
    folder = results_dir("memory", options.out)
    t0 = time.perf_counter()
    engine = rotating_engine(options.model, "profiles")
    engine.forward((), engine.encode("Warm up the allocator and the kernels."))
    results = [
        run_item(engine, item, options.seams)
        for item in progress(
            _items(engine, options),
            desc="memory items",
            total=options.items * len(options.trajectory),
            enabled=options.progress,
        )
    ]
    arms = options.arms
    summary = {
        "arms": arm_rows(results, arms),
        "by_length": by_length(results, arms),
        "setup": setup(results),
        "all_finite": all(
            v.agreement.finite for r in results for vs in r.versus.values() for v in vs
        ),
        "fallbacks": sum(
            r.costs[a].path != "splice" for r in results for a in arms if a.startswith("late_c")
        ),
    }
    config = {
        "model": engine.loaded.label,
        "random_weights": engine.loaded.random_weights,
        "items_per_length": options.items,
        "trajectory": ",".join(map(str, options.trajectory)),
        "facts": options.facts,
        "changes": options.changes,
        "questions_per_item": options.questions,
        "choices": options.choices,
        "seams": ",".join(map(str, options.seams)),
        "arms": ",".join(arms),
        **run_footer(options.seed, options.fast, t0),
    }
    report = Report("memory", "User memory placement: profile early vs late", config, folder)
    report.data = {"summary": summary, "records": [_record(r, arms) for r in results]}
    for heading, body in sections(summary):
        report.section(heading, body)
    report.plots = {"accuracy_vs_cost.png": lambda p: plot_accuracy_vs_cost(summary, p)}
    report.write()
    return folder
