"""The report's Markdown sections, from the summary."""

from __future__ import annotations

from typing import Any

from leyline.evals.common import markdown_table

from .arms import LATE, NONE


def _rate(rate: dict[str, Any]) -> str:
    if not rate["n"]:
        return "-"
    low, high = rate["ci95"]
    return f"{rate['k']}/{rate['n']} = {rate['rate']:.2f} [{low:.2f}, {high:.2f}]"


def _share(rate: dict[str, Any]) -> str:
    return f"{rate['k']}/{rate['n']}" if rate["n"] else "-"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}x"


def sections(summary: dict[str, Any]) -> list[tuple[str, str]]:
    arms = summary["arms"]
    setup = summary["setup"]
    chance = 1 / setup["choices"]
    accuracy = markdown_table(
        [
            "arm",
            "profile",
            "accuracy [95% CI]",
            "changed facts",
            "greedy = right",
            "P(right), candidates",
            "prefilled tokens",
            "TTFT",
            "early / arm",
        ],
        [
            [
                f"`{a['arm']}`",
                a["placement"],
                _rate(a["accuracy"]),
                _share(a["accuracy_changed_facts"]),
                _share(a["greedy"]),
                a["p_right_mean"],
                a["cost"]["prefilled_median"],
                _seconds(a["cost"]["seconds_median"]),
                _times(a["cost"]["speedup_vs_early"]),
            ]
            for a in arms
        ],
    )
    accuracy += (
        f"\n\nAccuracy: the right value's first token has the highest log-probability among "
        f"{setup['choices']} candidates of the same field (chance {chance:.2f}). Cost: after "
        "the profile update, from what the placement has cached to the next-token logits "
        "after the first question of each item; tokens and TTFT are medians over items. "
        f"Registering the new profile as a skill (the compose arms; once per version, "
        f"shared by every session) took {setup['compile_seconds']['median']:.3f} s "
        f"(median) for its {setup['profile_tokens']['median']:g} tokens, not counted above."
    )
    logits = markdown_table(
        [
            "arm",
            "KL mean",
            "KL median",
            "centred cos mean",
            "centred cos min",
            "argmax = late_full",
            "same choice",
            "max |Δ logprob| top 20",
        ],
        [
            [
                f"`{a['arm']}`",
                a["vs_late"]["kl_mean"],
                a["vs_late"]["kl_median"],
                a["vs_late"]["centred_cosine_mean"],
                a["vs_late"]["centred_cosine_min"],
                _share(a["vs_late"]["argmax_agrees"]),
                _share(a["same_choice_as_late"]),
                a["vs_late"]["max_dlogp_top20_max"],
            ]
            for a in arms
            if a["arm"] != LATE
        ],
    )
    logits += (
        "\n\nAgainst `late_full` on the next-token logits after every question: "
        "KL(late_full || arm) in nats, cosine of the mean-subtracted logits, whether the "
        "argmax over the vocabulary and the chosen candidate agree, and the largest "
        "log-probability gap over late_full's top 20 tokens (the worst question)."
    )
    out = [("Accuracy and cost of a profile update", accuracy), ("Logits vs late_full", logits)]
    if len(summary["by_length"]) > 1:
        names = [a["arm"] for a in arms]
        head = ["trajectory tokens (mean)", "items", *(f"`{n}`" for n in names)]
        rows = summary["by_length"]
        out.append(
            (
                "By trajectory length",
                "Accuracy:\n\n"
                + markdown_table(
                    head,
                    [
                        [round(r["trajectory_tokens_mean"]), r["items"],
                         *(_share(r["arms"][n]) for n in names)]
                        for r in rows
                    ],
                )
                + "\n\nCost of the update, median TTFT (median tokens prefilled):\n\n"
                + markdown_table(
                    head,
                    [
                        [round(r["trajectory_tokens_mean"]), r["items"],
                         *(f"{_seconds(r['seconds_median'][n])} ({r['prefilled_median'][n]:g})"
                           for n in names)]
                        for r in rows
                    ],
                ),
            )
        )  # fmt: skip

    def spread(key: str, digits: int = 0) -> str:
        s = setup[key]
        return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"

    out.append(
        (
            "Setup",
            markdown_table(
                ["what", "median (min-max)"],
                [
                    ["items", setup["items"]],
                    [
                        "questions (about changed facts)",
                        f"{setup['questions']} ({setup['changed_questions']})",
                    ],
                    ["facts per profile", setup["facts"]],
                    ["profile tokens", spread("profile_tokens")],
                    ["system prompt tokens", spread("system_tokens")],
                    ["trajectory tokens", spread("trajectory_tokens")],
                    ["question tokens", spread("question_tokens")],
                    ["early_full: tokens reused after the update", spread("early_reused_tokens")],
                    ["system + trajectory prefill (s)", spread("base_prefill_seconds", 2)],
                    ["profile registration (s)", spread("compile_seconds", 3)],
                    ["profile KV (bytes)", spread("profile_kv_bytes")],
                    ["compose fallbacks", summary["fallbacks"]],
                    ["all logits finite", summary["all_finite"]],
                ],
            ),
        )
    )
    none = next(a for a in arms if a["arm"] == NONE)
    out.append(
        (
            "Reading it",
            f"- `none` is the chance baseline: {_rate(none['accuracy'])} against "
            f"{chance:.2f} expected (its deviation is the model's prior over the values).\n"
            "- `early_full` vs `late_full` is the placement's effect on accuracy; "
            "`late_compose_kK` vs `late_full` is what composing costs in accuracy (KL above), "
            "and K at least the profile's length recomputes it all (equal to `late_full` up "
            "to fp32 rounding).\n"
            "- The cost columns are the point of late placement: early placement prefills "
            "the profile and the whole trajectory again after every profile change, late "
            "placement the profile and the question, and compose only the seam and the "
            "question.",
        )
    )
    return out
