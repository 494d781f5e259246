"""``report.md`` sections and the PNG plot of the erratum eval."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from leyline.evals.common import Report, markdown_table
from leyline.evals.common.plots import save_figure

from .arms import CaseResult
from .stats import decisions, qualifies, rate_text

ARM_TITLES = {
    "field_only": "field-only KV refresh",
    "erratum": "erratum appended",
    "erratum_control": "erratum, old value restated (control)",
    "no_edit": "no edit (0 by construction)",
}
SHIFT_TITLES = {
    "field_only": "field-only",
    "erratum": "erratum",
    "erratum_vs_control": "erratum vs control",
    "erratum_control": "control",
}


HIT_RATE_TEXT = (
    "The earlier request (old record) is sent to an engine with a shared prefix cache; then "
    "the updated prompt arrives as a new request, either with the erratum appended at the end "
    "or with the field edited in place (the engine reuses up to the last full block before the "
    "first changed token). Two layouts: **field late**, the decision prompts above (rule and "
    "solved examples, then the record); **field early**, the same record first, then the rule "
    "and a long static body (instructions, handbook, prior conversation) and the question: "
    "hit rates only, no decision is read in this layout. Hit rate = reused / prompt tokens, "
    "summed over cases, from the engine's reports; prompt tok: median tokens of the edited "
    "prompt; prefilled tok: mean tokens the engine computed per request; prefill ms: median "
    "wall time on this machine (shared CPU: indicative only).\n\n"
)
LAYOUTS = (("field late", "decision prompts"), ("field early", "hit rate only"))


def hit_rate_table(summary: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """Both layouts side by side, per template and overall."""
    header = [
        "template",
        "layout",
        "field at (fraction of prompt)",
        "prompt tok",
        "hit rate erratum",
        "hit rate in-prefix edit",
        "prefilled tok erratum",
        "prefilled tok edit",
        "prefill ms erratum",
        "prefill ms edit",
    ]
    early = summary["field_early"]
    rows = []
    for name, late in _groups(summary):
        early_group = early["overall"] if name == "overall" else early["templates"].get(name)
        for (layout, _), g in zip(LAYOUTS, (late, early_group), strict=True):
            if g is None or not g["cases"]:
                continue
            hits = g["hit_rate"]
            rows.append(
                [
                    name,
                    layout,
                    g["field_position"],
                    g["prompt_tokens"],
                    hits["erratum"]["hit_rate"],
                    hits["in_prefix_edit"]["hit_rate"],
                    hits["erratum"]["prefilled_mean"],
                    hits["in_prefix_edit"]["prefilled_mean"],
                    hits["erratum"]["median_ms"],
                    hits["in_prefix_edit"]["median_ms"],
                ]
            )
    return header, rows


def records(results: Sequence[CaseResult], summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Every case as JSON, with the decisions read at its template's threshold."""
    out = []
    for r in results:
        threshold = summary["thresholds"][r.template]
        row = asdict(r)
        row["threshold"] = threshold
        row["decisions"] = decisions(r, threshold)
        row["qualifies"] = qualifies(r, threshold)
        out.append(row)
    return out


def _groups(summary: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [*summary["templates"].items(), ("overall", summary["overall"])]


def add_sections(report: Report, summary: dict[str, Any], results: Sequence[CaseResult]) -> None:
    groups = _groups(summary)
    report.section(
        "Decision recovery",
        "Fraction of qualifying cases (the oracle's decision differs between the old and the "
        "new value) where the arm decides as the oracle, with 95% Wilson intervals. "
        "Decisions: yes/no margin above the template's threshold (fitted on the clean "
        "prompts; see docs/evals-erratum.md).\n\n"
        + markdown_table(
            ["template", "cases", "qualifying", *(ARM_TITLES[a] for a in ARM_TITLES)],
            [
                [
                    name,
                    g["cases"],
                    g["qualifying"],
                    *(rate_text(g["recovery"][a]) for a in ARM_TITLES),
                ]
                for name, g in groups
            ],
        ),
    )
    report.section(
        "Threshold-free view",
        "Median fraction of the oracle's margin shift each arm reproduces "
        "((arm - reference) / (oracle - no edit); 1 = as far as the oracle), and the fraction of "
        "qualifying cases where it moved the margin the oracle's way. References: no edit; "
        "for 'erratum vs control' the same note restating the old value.\n\n"
        + markdown_table(
            [
                "template",
                *(f"shift: {SHIFT_TITLES[n]}" for n in SHIFT_TITLES),
                *(f"direction: {SHIFT_TITLES[n]}" for n in SHIFT_TITLES),
            ],
            [
                [
                    name,
                    *(g["median_shift_recovered"][n] for n in SHIFT_TITLES),
                    *(rate_text(g["direction"][n]) for n in SHIFT_TITLES),
                ]
                for name, g in groups
            ],
        ),
    )
    report.section(
        "The model's decision",
        "Threshold per template; how often the clean prompts' decision matches the written "
        "rule; how many cases qualify at the raw argmax (threshold 0) instead.\n\n"
        + markdown_table(
            ["template", "threshold", "clean decisions follow the rule", "qualifying (argmax)"],
            [
                [
                    name,
                    summary["thresholds"].get(name),
                    rate_text(g["oracle_follows_rule"]),
                    g["qualifying_raw_argmax"],
                ]
                for name, g in groups
            ],
        ),
    )
    report.section(
        "Prefix-cache hit rate", HIT_RATE_TEXT + markdown_table(*hit_rate_table(summary))
    )
    checks = summary["overall"]["checks"]
    report.section(
        "Engine checks",
        markdown_table(["check", "value"], [[k, v] for k, v in checks.items()])
        + "\n\nfield_kv_changed: the field-only splice rewrote the field's KV; "
        "max_field_kv_vs_oracle: the refreshed field equals the oracle's (rounding); "
        "downstream_kept_bitwise / min_downstream_vs_oracle: the downstream KV was kept and "
        "differs from a recompute (its stale notes); the last three compare the same tokens "
        "reached by two paths (yes/no margin).",
    )
    report.section(
        "Cases",
        markdown_table(
            [
                "template",
                "#",
                "old -> new",
                "no edit",
                "field-only",
                "erratum",
                "control",
                "oracle",
                "qualifies",
            ],
            [
                [
                    r.template,
                    r.index,
                    f"{r.old} -> {r.new}",
                    *(
                        r.margins[a]
                        for a in ("no_edit", "field_only", "erratum", "erratum_control", "oracle")
                    ),
                    qualifies(r, summary["thresholds"][r.template]),
                ]
                for r in results
            ],
        ),
    )


def plot(summary: dict[str, Any]) -> Any:
    """Recovery per arm per template (95% Wilson bars); hit rate erratum vs in-prefix edit,
    field late (decision prompts), then both layouts side by side."""

    def draw(path: Path) -> None:
        import matplotlib.pyplot as plt

        groups = _groups(summary)
        names = [name for name, _ in groups]
        arms = ["field_only", "erratum", "erratum_control"]
        fig, (left, right, layouts) = plt.subplots(1, 3, figsize=(18, 4.5))
        width = 0.8 / len(arms)
        for i, arm in enumerate(arms):
            xs, ys, low, high = [], [], [], []
            for j, (_, g) in enumerate(groups):
                rate = g["recovery"][arm]
                value = rate["rate"]
                xs.append(j + (i - 1) * width)
                ys.append(value or 0.0)
                # No qualifying case: no bar and no (0, 1) interval drawn.
                low.append(0.0 if value is None else value - rate["low"])
                high.append(0.0 if value is None else rate["high"] - value)
            left.bar(xs, ys, width, yerr=[low, high], capsize=3, label=ARM_TITLES[arm])
        left.set_xticks(range(len(names)), [f"{n}\n(n={g['qualifying']})" for n, g in groups])
        left.set_ylim(0, 1.3)  # headroom for the legend above the bars
        left.set_yticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
        left.set_ylabel("decision recovery (agreement with oracle)")
        left.set_title("Decision recovery, qualifying cases")
        left.legend(fontsize=8, loc="upper center", ncol=3)
        for i, (key, label) in enumerate(
            (("erratum", "erratum appended"), ("in_prefix_edit", "in-prefix edit"))
        ):
            ys = [g["hit_rate"][key]["hit_rate"] or 0.0 for _, g in groups]
            right.bar([j + (i - 0.5) * 0.4 for j in range(len(names))], ys, 0.4, label=label)
        right.set_xticks(range(len(names)), names)
        right.set_ylim(0, 1.3)
        right.set_yticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
        right.set_ylabel("prefix-cache hit rate (reused / prompt tokens)")
        right.set_title("Prefix-cache hit rate of the updated prompt (field late)")
        right.legend(fontsize=8, loc="upper center", ncol=2)
        _layout_panel(layouts, summary)
        save_figure(fig, path)

    return draw


def _layout_panel(ax: Any, summary: dict[str, Any]) -> None:
    """Overall hit rate, erratum vs in-prefix edit, field late vs field early."""
    groups = [summary["overall"], summary["field_early"]["overall"]]
    for i, (key, label) in enumerate(
        (("erratum", "erratum appended"), ("in_prefix_edit", "in-prefix edit"))
    ):
        ys = [g["hit_rate"][key]["hit_rate"] or 0.0 for g in groups]
        bars = ax.bar([j + (i - 0.5) * 0.4 for j in range(2)], ys, 0.4, label=label)
        ax.bar_label(bars, fmt="%.3f", fontsize=8)
    ticks = []
    for (layout, what), g in zip(LAYOUTS, groups, strict=True):
        where = f"field at {g['field_position'] or 0:.0%} of {g['prompt_tokens'] or 0:.0f} tok"
        ticks.append(f"{layout} ({what})\n{where}")
    ax.set_xticks(range(2), ticks)
    ax.set_ylim(0, 1.3)
    ax.set_yticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
    ax.set_ylabel("prefix-cache hit rate (reused / prompt tokens)")
    ax.set_title("Hit rate by where the field sits (all templates)")
    ax.legend(fontsize=8, loc="upper center", ncol=2)
