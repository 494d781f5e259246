"""``report.md`` tables and the PNG for ``leyline eval proxy`` (from the summary)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from leyline.evals.common import Report, markdown_table
from leyline.evals.common.plots import save_figure

ARM_TITLES = {
    "none": "none (full history)",
    "reprefill": "policy, re-prefill",
    "splice": "policy, splice",
    "summarize": "Summarize (server-written summary, splice)",
}


def fill(report: Report, summary: dict[str, Any], keep_last: int) -> None:
    """Add the sections and the plot of one run to ``report``."""
    arms = summary["arms"]
    rows = []
    for arm, facts in arms.items():
        acc = facts["accuracy"]
        title = ARM_TITLES[arm]
        if arm == "splice" and not facts["leyline"]:
            title += " (DEGRADED to re-prefill: the server does not speak Leyline)"
        rows.append(
            [
                title,
                f"{acc['successes']}/{acc['trials']}",
                _rate(acc),
                facts["unscored"],
                facts["prefilled"],
                facts["reused"],
                facts["rotated"],
                f"{facts['paths'].get('splice', 0)}/{facts['requests']}",
            ]
        )
    header = ["arm", "correct", "accuracy [95% CI]", "unscored", "prefilled", "reused"]
    header += ["rotated", "splice-path requests"]
    chance = summary["chance"]
    report.section(
        "Accuracy and tokens per arm",
        markdown_table(header, rows)
        + f"\n\nChance (one candidate at random): {chance:.1%}. Policy: "
        f"TruncateOldToolOutputs(keep_last={keep_last}). Tokens are the server's `leyline` "
        "report summed over the agent's requests (the scoring request is not counted).",
    )
    report.section(
        "Wrong choices: which value was picked",
        markdown_table(
            ["arm", "the one distractor", "first value", "last stale value", "another", "unscored"],
            [[ARM_TITLES[arm], *facts["wrong_picks"].values()] for arm, facts in arms.items()],
        )
        + "\n\nThe one distractor: tasks whose stale polls all show one value (one stale poll, "
        "or a repeated distractor). Otherwise: the first value shown, the last stale one "
        "(just before the answer), or another stale value.",
    )
    levels = list(next(iter(summary["by_stale"].values())).keys())
    report.section(
        "Accuracy by number of stale polls",
        markdown_table(
            ["arm", *(f"stale={k}" for k in levels)],
            [
                [ARM_TITLES[arm], *(_rate(by_level[k]) for k in levels)]
                for arm, by_level in summary["by_stale"].items()
            ],
        ),
    )
    paired = summary["paired"]
    report.section(
        "Paired: policy arm vs none, same tasks",
        markdown_table(
            ["arm", "right here, wrong in none", "right in none, wrong here"],
            [
                [ARM_TITLES[arm], p["right_only_here"], p["right_only_none"]]
                for arm, p in paired.items()
            ],
        ),
    )
    agree = summary["agreement"]
    same = agree["same_choice"]
    tokens = "not compared (chat scoring)"
    if agree["tokens_compared"]:
        tokens = f"{agree['same_tokens']}/{agree['tokens_compared']} tasks"
    report.section(
        "Agreement: splice arm vs re-prefill arm",
        f"- same choice: {same['successes']}/{same['trials']} ({_rate(same)})\n"
        f"- same cached prompt tokens scored: {tokens}\n"
        f"- KL(re-prefill || splice) of the answer token: mean {_num(agree['kl_mean'])}, "
        f"max {_num(agree['kl_max'])} nats (over the re-prefill arm's top-k)",
    )
    report.plots["proxy.png"] = lambda path: plot(path, summary, keep_last)


def plot(path: Path, summary: dict[str, Any], keep_last: int) -> None:
    import matplotlib.pyplot as plt

    arms = list(summary["arms"])
    fig, (bars, lines, tokens) = plt.subplots(1, 3, figsize=(15, 4.6))
    colors = {
        "none": "tab:gray",
        "reprefill": "tab:blue",
        "splice": "tab:orange",
        "summarize": "tab:green",
    }
    for i, arm in enumerate(arms):
        acc = summary["arms"][arm]["accuracy"]
        rate = acc["rate"] or 0.0
        low, high = acc["ci95"]
        bars.bar(i, rate, color=colors[arm])
        bars.errorbar(i, rate, yerr=[[rate - low], [high - rate]], color="black", capsize=6)
        bars.text(i, high + 0.02, f"{rate:.0%}", ha="center")
    bars.axhline(summary["chance"], color="black", linestyle=":", label="chance")
    bars.set_xticks(range(len(arms)), [ARM_TITLES[a] for a in arms], fontsize=8)
    bars.set_ylim(0, 1.12)
    bars.set_ylabel("accuracy (95% Wilson CI)")
    bars.legend(loc="lower right")
    levels = [int(k) for k in summary["by_stale"][arms[0]]]
    for j, arm in enumerate(arms):
        by = summary["by_stale"][arm]
        x = [k + (j - 1) * 0.08 for k in levels]
        y = [by[str(k)]["rate"] or 0.0 for k in levels]
        err = [
            [yy - by[str(k)]["ci95"][0] for k, yy in zip(levels, y, strict=True)],
            [by[str(k)]["ci95"][1] - yy for k, yy in zip(levels, y, strict=True)],
        ]
        lines.errorbar(x, y, yerr=err, marker="o", capsize=4, color=colors[arm], label=arm)
    lines.set_xticks(levels)
    lines.set_xlabel("stale polls before the current one")
    lines.set_ylabel("accuracy")
    lines.set_ylim(0, 1.05)
    lines.legend()
    width = 0.38
    for offset, name in ((-width / 2, "prefilled"), (width / 2, "reused")):
        tokens.bar(
            [i + offset for i in range(len(arms))],
            [summary["arms"][a][name] for a in arms],
            width,
            label=f"prompt tokens {name}",
        )
    tokens.set_xticks(range(len(arms)), [ARM_TITLES[a] for a in arms], fontsize=8)
    tokens.set_ylabel("tokens, all tasks")
    tokens.legend()
    fig.suptitle(
        f"leyline eval proxy: {summary['tasks']} tasks, "
        f"TruncateOldToolOutputs(keep_last={keep_last})"
    )
    save_figure(fig, path)


def _rate(rate: dict[str, Any]) -> str:
    if rate["rate"] is None:
        return "-"
    low, high = rate["ci95"]
    return f"{rate['rate']:.1%} [{low:.1%}, {high:.1%}]"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"
