"""``solve_rate.png``: solve rate per arm with 95% intervals, and per task (matplotlib optional)."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

from leyline.evals.common.plots import save_figure

from .summary import Summary


def write_plot(path: Path, summary: Summary, title: str) -> Path | None:
    """Write the figure; None (nothing written) when matplotlib is not installed."""
    if importlib.util.find_spec("matplotlib") is None:
        return None
    import matplotlib

    matplotlib.use("Agg")  # no display; must precede pyplot
    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # font-cache notices
    import matplotlib.pyplot as plt

    arms = [a.arm for a in summary.arms]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [1, 3]})
    rates = [100 * (a.solved.value or 0.0) for a in summary.arms]
    below = [r - 100 * a.solved.low for r, a in zip(rates, summary.arms, strict=True)]
    above = [100 * a.solved.high - r for r, a in zip(rates, summary.arms, strict=True)]
    left.bar(arms, rates, yerr=[below, above], capsize=6, color=_colours(len(arms)))
    left.set_ylim(0, 100)
    left.set_ylabel("solved (%), 95% Wilson CI")
    left.set_title("all tasks")

    tasks = [row.task for row in summary.tasks]
    width = 0.8 / max(1, len(arms))
    for i, (arm, colour) in enumerate(zip(arms, _colours(len(arms)), strict=True)):
        values = []
        for row in summary.tasks:
            cell = row.cells.get(arm)
            values.append(100 * (cell.solved.value or 0.0) if cell else 0.0)
        xs = [t + (i - (len(arms) - 1) / 2) * width for t in range(len(tasks))]
        right.bar(xs, values, width=width, label=arm, color=colour)
    right.set_xticks(range(len(tasks)))
    right.set_xticklabels(tasks, rotation=30, ha="right")
    right.set_ylim(0, 100)
    right.set_title("per task")
    right.legend()
    fig.suptitle(title)
    save_figure(fig, path)
    return path


def _colours(n: int) -> list[str]:
    palette = ["#8c8c8c", "#4c72b0", "#dd8452", "#55a868", "#c44e52"]
    return [palette[i % len(palette)] for i in range(n)]
