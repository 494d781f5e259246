"""Aggregates over items: accuracy per arm (with Wilson intervals), agreement with
``late_full``, and the cost of a profile update (medians over items)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from leyline.evals.common.stats import wilson

from .arms import EARLY, LATE, NONE, ItemResult, compose_seam


def placement(arm: str) -> str:
    if arm == EARLY:
        return "early, prefilled"
    if arm == LATE:
        return "late, prefilled"
    if arm == NONE:
        return "no profile"
    return f"late, composed (K={compose_seam(arm)})"


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _rate(k: int, n: int) -> dict[str, Any]:
    low, high = wilson(k, n)
    return {"k": k, "n": n, "rate": k / n if n else None, "ci95": [low, high]}


def arm_rows(results: Sequence[ItemResult], arms: Sequence[str]) -> list[dict[str, Any]]:
    early_seconds = _median([r.costs[EARLY].seconds for r in results])
    rows = []
    for arm in arms:
        scores = [s for r in results for s in r.scores[arm]]
        late = [s for r in results for s in r.scores[LATE]]
        changed = [
            s for r in results for s, q in zip(r.scores[arm], r.item.questions, strict=True)
            if q.changed
        ]  # fmt: skip
        vs = [v for r in results for v in r.versus[arm]]
        kls = [v.agreement.kl for v in vs]
        seconds = [r.costs[arm].seconds for r in results]
        median_seconds = _median(seconds)
        rows.append(
            {
                "arm": arm,
                "placement": placement(arm),
                "accuracy": _rate(sum(s.correct for s in scores), len(scores)),
                "accuracy_changed_facts": _rate(sum(s.correct for s in changed), len(changed)),
                "greedy": _rate(sum(s.greedy for s in scores), len(scores)),
                "p_right_mean": statistics.fmean(s.p_right for s in scores),
                "logp_right_mean": statistics.fmean(s.logps[0] for s in scores),
                "same_choice_as_late": _rate(
                    sum(
                        max(range(len(a.logps)), key=a.logps.__getitem__)
                        == max(range(len(b.logps)), key=b.logps.__getitem__)
                        for a, b in zip(scores, late, strict=True)
                    ),
                    len(scores),
                ),
                "vs_late": {
                    "kl_mean": statistics.fmean(kls),
                    "kl_median": statistics.median(kls),
                    "kl_max": max(kls),
                    "centred_cosine_mean": statistics.fmean(v.agreement.centred_cosine for v in vs),
                    "centred_cosine_min": min(v.agreement.centred_cosine for v in vs),
                    "cosine_mean": statistics.fmean(v.agreement.cosine for v in vs),
                    "argmax_agrees": _rate(sum(v.agreement.argmax_agrees for v in vs), len(vs)),
                    "max_dlogp_top20_max": max(v.max_dlogp for v in vs),
                    "max_dlogp_top20_median": statistics.median(v.max_dlogp for v in vs),
                },
                "cost": {
                    "seconds_median": median_seconds,
                    "seconds_min": min(seconds),
                    "seconds_max": max(seconds),
                    "prefilled_median": _median([r.costs[arm].prefilled for r in results]),
                    "reused_median": _median([r.costs[arm].reused for r in results]),
                    "speedup_vs_early": None
                    if not median_seconds or early_seconds is None
                    else early_seconds / median_seconds,
                    "paths": sorted({r.costs[arm].path for r in results}),
                },
            }
        )
    return rows


def by_length(results: Sequence[ItemResult], arms: Sequence[str]) -> list[dict[str, Any]]:
    """Accuracy per arm for each requested trajectory length."""
    rows = []
    for budget in sorted({r.item.budget for r in results}):
        mine = [r for r in results if r.item.budget == budget]
        rows.append(
            {
                "budget": budget,
                "items": len(mine),
                "trajectory_tokens_mean": statistics.fmean(len(r.item.trajectory) for r in mine),
                "arms": {
                    arm: _rate(
                        sum(s.correct for r in mine for s in r.scores[arm]),
                        sum(len(r.scores[arm]) for r in mine),
                    )
                    for arm in arms
                },
                "seconds_median": {
                    arm: _median([r.costs[arm].seconds for r in mine]) for arm in arms
                },
                "prefilled_median": {
                    arm: _median([r.costs[arm].prefilled for r in mine]) for arm in arms
                },
            }
        )
    return rows


def setup(results: Sequence[ItemResult]) -> dict[str, Any]:
    def spread(values: Sequence[float]) -> dict[str, float]:
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    items = [r.item for r in results]
    return {
        "items": len(items),
        "questions": sum(len(i.questions) for i in items),
        "changed_questions": sum(q.changed for i in items for q in i.questions),
        "choices": len(items[0].questions[0].candidates),
        "facts": len(items[0].new.facts),
        "profile_tokens": spread([len(i.profile) for i in items]),
        "system_tokens": spread([len(i.system) for i in items]),
        "trajectory_tokens": spread([len(i.trajectory) for i in items]),
        "question_tokens": spread([len(q.tokens) for i in items for q in i.questions]),
        "early_reused_tokens": spread(
            [r.costs[EARLY].reused for r in results]
        ),  # system prompt + the profile's first line up to the version
        "compile_seconds": spread([r.compile_seconds for r in results]),
        "base_prefill_seconds": spread([r.base_seconds for r in results]),
        "profile_kv_bytes": spread([r.profile_nbytes for r in results]),
    }
