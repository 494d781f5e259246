"""``report.md`` sections and the PNG plot of the erratum eval."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from leyline.evals.common import Report, markdown_table

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
        "Prefix-cache hit rate",
        "The earlier request (old record) is sent to an engine with a shared prefix cache; "
        "then the updated prompt arrives as a new request, either with the erratum appended "
        "or with the field edited in place (the engine reuses up to the last full block before "
        "the first changed token). Hit rate = reused / prompt tokens, summed over cases, from "
        "the engine's reports; prefilled tok: mean tokens the engine computed per request; "
        "prefill ms: median wall time on this machine (shared CPU: indicative only).\n\n"
        + markdown_table(
            [
                "template",
                "erratum",
                "in-prefix edit",
                "field at (fraction of prompt)",
                "prefilled tok erratum",
                "prefilled tok edit",
                "prefill ms erratum",
                "prefill ms edit",
            ],
            [
                [
                    name,
                    g["hit_rate"]["erratum"]["hit_rate"],
                    g["hit_rate"]["in_prefix_edit"]["hit_rate"],
                    g["field_position"],
                    g["hit_rate"]["erratum"]["prefilled_mean"],
                    g["hit_rate"]["in_prefix_edit"]["prefilled_mean"],
                    g["hit_rate"]["erratum"]["median_ms"],
                    g["hit_rate"]["in_prefix_edit"]["median_ms"],
                ]
                for name, g in groups
            ],
        ),
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
    """Recovery per arm per template (95% Wilson bars); hit rate erratum vs in-prefix edit."""

    def draw(path: Path) -> None:
        import matplotlib.pyplot as plt

        groups = _groups(summary)
        names = [name for name, _ in groups]
        arms = ["field_only", "erratum", "erratum_control"]
        fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
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
        right.set_title("Prefix-cache hit rate of the updated prompt")
        right.legend(fontsize=8, loc="upper center", ncol=2)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)

    return draw
