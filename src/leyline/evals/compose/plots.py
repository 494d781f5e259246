"""The two figures, drawn from the summary (``Report`` calls them when matplotlib is
installed and has already selected the Agg backend)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from leyline.evals.common.plots import save_figure

from .arms import compose_arm, plain_compose_seam
from .summary import TARGET_KL, TARGET_SEAM


def plot_ttft(summary: dict[str, Any], path: Path) -> None:
    """Median TTFT vs skill length: full prefill vs compose (K = 16, or the largest K run)."""
    import matplotlib.pyplot as plt

    rows = summary["ttft"]
    seams = [int(s) for s in rows[0]["compose"]]
    seam = TARGET_SEAM if TARGET_SEAM in seams else max(seams)
    x = [r["tokens_mean"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for when, style, face in (("cached", "-", None), ("cold", "--", "none")):
        full = [r["full"][when] for r in rows]
        composed = [r["compose"][str(seam)][when] for r in rows]
        ax.plot(
            x, full, style, marker="o", mfc=face, color="C3", label=f"full prefill, prefix {when}"
        )
        ax.plot(x, composed, style, marker="s", mfc=face, color="C0",
                label=f"compose K={seam}, prefix {when}")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("skill tokens")
    ax.set_ylabel("median TTFT (s)")
    ax.set_title("Time to the first next-token logits after the question")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def plot_kl_by_seam(summary: dict[str, Any], path: Path) -> None:
    """Mean KL(full || compose) by seam K, one panel per kind, one line per skill length;
    the no-rotation control as crosses, the issue's K = 16 bound dotted."""
    import matplotlib.pyplot as plt

    kinds = list(dict.fromkeys(c["kind"] for c in summary["cells"]))
    fig, axes = plt.subplots(1, len(kinds), figsize=(5 * len(kinds), 4), squeeze=False)
    for ax, kind in zip(axes[0], kinds, strict=True):
        for i, cell in enumerate(c for c in summary["cells"] if c["kind"] == kind):
            seams = [k for k in map(plain_compose_seam, cell["arms"]) if k is not None]
            xs = list(range(len(seams)))
            ys = [max(cell["arms"][compose_arm(s)]["kl"]["mean"], 1e-6) for s in seams]
            ax.plot(xs, ys, marker="o", color=f"C{i}", label=f"{cell['tokens']} tokens")
            for arm, at, marker in _past_plain(cell["arms"]):
                if at in seams:
                    ax.plot(seams.index(at), max(cell["arms"][arm]["kl"]["mean"], 1e-6),
                            marker, ms=6, mfc="none", color=f"C{i}")  # fmt: skip
            control = next(a for a in cell["arms"] if a.startswith("norot_k"))
            control_seam = int(control.removeprefix("norot_k"))
            if control_seam in seams:
                ax.plot(seams.index(control_seam), cell["arms"][control]["kl"]["mean"], "x",
                        ms=9, color=f"C{i}")  # fmt: skip
            ax.set_xticks(xs, [f"K={s}" for s in seams])
        if kind in TARGET_KL:
            ax.axhline(TARGET_KL[kind], ls=":", color="k", lw=1, label="target at K=16")
        ax.set_yscale("log")
        ax.set_ylabel("mean KL(full || arm), nats")
        ax.set_title(
            f"{kind} (x: no rotation; diamond: deviation,\n"
            "triangle: question-aware, square: anchored, plus: both)",
            fontsize=9,
        )
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    save_figure(fig, path)


def _past_plain(arms: Any) -> list[tuple[str, int, str]]:
    """(arm, its K, marker) of the arms past the plain compose: deviation, question-aware
    recompute and the anchored compile."""
    out = []
    for arm in arms:
        if arm.startswith("anchored_k"):
            at = int(arm.removeprefix("anchored_k").split("_")[0])
            out.append((arm, at, "P" if "_ask" in arm else "s"))
        elif arm.startswith("compose_k") and ("_dev" in arm or "_ask" in arm):
            at = int(arm.removeprefix("compose_k").split("_")[0])
            out.append((arm, at, "D" if "_dev" in arm else "^"))
    return out
