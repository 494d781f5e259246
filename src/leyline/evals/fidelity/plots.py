"""The three figures, drawn from the report's own data (``Report`` calls them when matplotlib
is installed and has already selected the Agg backend)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from leyline.evals.common.plots import save_figure

ModelData = dict[str, Any]
"""One model's entry of ``report.json["models"]``."""

_KL_LABELS = {
    "kl_splice_vs_full": "splice vs full context",
    "kl_splice_vs_reprefill": "splice vs re-prefill",
    "kl_reprefill_vs_full": "re-prefill vs full context",
    "kl_control_vs_reprefill": "unrotated splice vs re-prefill (control)",
}


def _title(data: ModelData) -> str:
    return str(data["label"])


def plot_key_error(models: dict[str, ModelData], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for data in models.values():
        keys = data["key_error"]
        layers = range(len(keys["rotated_max"]))
        (line,) = ax.plot(layers, keys["rotated_max"], marker="o", ms=3, label=_title(data))
        ax.plot(
            layers,
            keys["unrotated_min"],
            ls="--",
            color=line.get_color(),
            label=f"{_title(data)}: not rotated (scale)",
        )
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("relative L2 of the rope band")
    ax.set_title("Spliced downstream keys vs keys recomputed at the new positions (worst prompt)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    save_figure(fig, path)


def plot_drift(models: dict[str, ModelData], path: Path) -> None:
    import matplotlib.pyplot as plt

    patterns = sorted({p for d in models.values() for p in d["drift"]["errors"]})
    fig, axes = plt.subplots(
        len(models), len(patterns), figsize=(5.5 * len(patterns), 3.6 * len(models)), squeeze=False
    )
    for row, data in zip(axes, models.values(), strict=True):
        for ax, pattern in zip(row, patterns, strict=True):
            for arm, errs in data["drift"]["errors"][pattern].items():
                ax.plot(range(1, len(errs)), errs[1:], label=arm)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("splices applied")
            ax.set_ylabel("rel. L2 vs exact rotation")
            ax.set_title(f"{_title(data)}: {pattern} deltas", fontsize=9)
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=7)
    save_figure(fig, path)


def plot_kl_hist(models: dict[str, ModelData], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, data in zip(axes[0], models.values(), strict=True):
        records = data["records"]
        values = {f: [max(r[f], 1e-8) for r in records] for f in _KL_LABELS}
        lo = math.log10(min(min(v) for v in values.values()))
        hi = math.log10(max(max(v) for v in values.values()))
        bins = [10 ** (lo + (hi - lo + 1e-9) * i / 30) for i in range(31)]
        for field, label in _KL_LABELS.items():
            ax.hist(values[field], bins=bins, histtype="step", lw=1.5, label=label)
        ax.set_xscale("log")
        ax.set_xlabel("next-token KL (nats)")
        ax.set_ylabel("prompts")
        ax.set_title(f"{_title(data)}: {len(records)} prompts", fontsize=9)
        ax.legend(fontsize=7)
    save_figure(fig, path)
