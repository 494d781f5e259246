"""report.md and prefilled.png of the memory-pressure eval."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from leyline.evals.common.plots import save_figure

ROWS = (
    ("prompt tokens", "prompt_tokens", "{:,}"),
    ("prefilled tokens", "prefilled_tokens", "{:,}"),
    ("re-prefilled tokens (beyond each turn's new messages)", "re_prefilled_tokens", "{:,}"),
    ("sessions found evicted", "evictions_seen", "{}"),
    ("decay spans dropped", "spans_dropped", "{}"),
    ("409 retries (drops mirrored)", "retries", "{}"),
    ("latency p50 per turn (s)", "latency_p50_s", "{:.3f}"),
    ("latency p90 per turn (s)", "latency_p90_s", "{:.3f}"),
    ("latency total (s)", "latency_total_s", "{:.1f}"),
    ("first-token agreement with unbounded", "first_token_agreement", "{:.1%}"),
)


def write_report(out: Path, report: dict[str, Any]) -> None:
    summary = report["summary"]
    arms = list(summary)
    config = report["config"]
    lines = [
        "# Memory pressure: whole-session eviction vs DECAY spans",
        "",
        f"{config['agents']} agents x {config['turns']} turns, round-robin, SmolLM2-135M fp32 "
        f"on CPU ({config['threads']} thread); budget {config['budget']:.0%} of the "
        f"{report['bytes_held_unbounded'] / 2**20:.1f} MiB the sessions hold unbounded "
        f"({report['budget_bytes'] / 2**20:.1f} MiB); decay mode `{config['mode']}`; "
        f"seed {config['seed']}; {report['seconds']:.0f} s.",
        "",
        "| measure | " + " | ".join(arms) + " |",
        "|---|" + "---|" * len(arms),
    ]
    for label, key, fmt in ROWS:
        lines.append(f"| {label} | " + " | ".join(fmt.format(summary[a][key]) for a in arms) + " |")
    evict, decay = summary.get("evict"), summary.get("decay")
    if evict and decay and decay["prefilled_tokens"]:
        ratio = evict["prefilled_tokens"] / decay["prefilled_tokens"]
        lines += ["", f"The evict arm prefilled {ratio:.2f}x the tokens of the decay arm."]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    _plot(out, report)


def _plot(out: Path, report: dict[str, Any]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plots are optional
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for arm, turns in report["turns"].items():
        total, xs, ys = 0, [], []
        for i, turn in enumerate(turns, start=1):
            total += turn["prefilled"]
            xs.append(i)
            ys.append(total)
        ax.plot(xs, ys, label=arm)
    ax.set_xlabel("turns served (all agents, round-robin)")
    ax.set_ylabel("prefilled tokens, cumulative")
    ax.set_title("Prefill work under a tight cache budget")
    ax.legend()
    save_figure(fig, out / "prefilled.png", dpi=120)
