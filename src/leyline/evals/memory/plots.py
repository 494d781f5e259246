"""The figure: accuracy against the cost of a profile update, one point per arm."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from leyline.evals.common.plots import save_figure

from .arms import EARLY, LATE, NONE

_FIXED = {EARLY: ("C3", "s"), LATE: ("C2", "D"), NONE: ("C7", "x")}
_TICKS = (0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


def plot_accuracy_vs_cost(summary: dict[str, Any], path: Path) -> None:
    """Two panels: accuracy (Wilson 95% bars) vs median TTFT after the update, and vs the
    median tokens prefilled; the prefilled arms and ``none`` in fixed colours, the
    composes in blues (darker: larger K), chance dotted."""
    import matplotlib.pyplot as plt

    arms = summary["arms"]
    composes = [a["arm"] for a in arms if a["arm"] not in _FIXED]
    blues = plt.get_cmap("Blues")
    style: dict[str, tuple[Any, str]] = dict(_FIXED)  # colour: a name or an RGBA tuple
    for j, arm in enumerate(composes):
        style[arm] = (blues(0.45 + 0.5 * j / max(1, len(composes) - 1)), "o")
    chance = 1 / summary["setup"]["choices"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, key, label in (
        (axes[0], "seconds_median", "median TTFT after a profile update (s)"),
        (axes[1], "prefilled_median", "median tokens prefilled after a profile update"),
    ):
        xs = []
        for a in arms:
            x = max(float(a["cost"][key]), 1e-3 if key == "seconds_median" else 1.0)
            xs.append(x)
            rate = a["accuracy"]
            low, high = rate["ci95"]
            colour, marker = style[a["arm"]]
            ax.errorbar(
                x, rate["rate"], yerr=[[rate["rate"] - low], [high - rate["rate"]]],
                fmt=marker, ms=7, color=colour, capsize=3, label=a["arm"],
            )  # fmt: skip
        ax.axhline(chance, ls=":", color="k", lw=1, label=f"chance ({chance:.2f})")
        ax.set_xscale("log")
        ticks = [t for t in _TICKS if min(xs) / 1.5 <= t <= max(xs) * 1.5]
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.minorticks_off()
        ax.set_ylim(0, 1.15)
        ax.set_xlabel(label)
        ax.set_ylabel("answer accuracy (candidates)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7, loc="upper left", ncol=2)
    fig.suptitle(
        f"User memory placement: accuracy vs cost ({summary['setup']['questions']} questions, "
        f"{summary['setup']['items']} items)",
        fontsize=11,
    )
    save_figure(fig, path)
