"""Decisions from margins, recovery rates with Wilson intervals, and the run's summary.

The decision is calibrated per template: SmolLM2-135M prefers " no" on every prompt (its
raw argmax never flips), but its yes/no margin moves with the field in the rule's
direction. The threshold is the midpoint between the mean margins of the two rule classes
on the *clean* prompts (no-edit with the old value, oracle with the new one): a
nearest-centroid classifier fitted on full recomputes only, then applied unchanged to
every arm. The raw argmax (threshold 0) is reported next to it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from leyline.evals.common.stats import wilson

from .arms import CaseResult, Request

RECOVERY_ARMS = ("field_only", "erratum", "erratum_control", "no_edit")


@dataclass(frozen=True, slots=True)
class Rate:
    successes: int
    trials: int

    @property
    def value(self) -> float | None:
        return self.successes / self.trials if self.trials else None

    def to_json(self) -> dict[str, Any]:
        low, high = wilson(self.successes, self.trials)
        return {"k": self.successes, "n": self.trials, "rate": self.value, "low": low, "high": high}

    def text(self) -> str:
        if not self.trials:
            return "-"
        low, high = wilson(self.successes, self.trials)
        return f"{self.successes}/{self.trials} = {self.value:.2f} [{low:.2f}, {high:.2f}]"


def fit_threshold(results: Sequence[CaseResult]) -> float:
    """Midpoint of the clean margins' class means (rule yes vs rule no); 0 if a class is empty."""
    yes = [r.margins["no_edit"] for r in results if r.rule_old]
    yes += [r.margins["oracle"] for r in results if r.rule_new]
    no = [r.margins["no_edit"] for r in results if not r.rule_old]
    no += [r.margins["oracle"] for r in results if not r.rule_new]
    if not yes or not no:
        return 0.0
    return (statistics.fmean(yes) + statistics.fmean(no)) / 2


def decisions(result: CaseResult, threshold: float) -> dict[str, bool]:
    """Arm -> decision (True = yes), every arm read with the same threshold."""
    return {arm: margin > threshold for arm, margin in result.margins.items()}


def qualifies(result: CaseResult, threshold: float) -> bool:
    """The oracle's decision differs between the old and the new value: recovery is defined."""
    made = decisions(result, threshold)
    return made["no_edit"] != made["oracle"]


# Arm -> the arm it is compared with for threshold-free figures. The erratum is also
# compared with the same note restating the old value: appending any note shifts the
# margin of a small model, and only the difference is the note's content.
REFERENCES = {
    "field_only": "no_edit",
    "erratum": "no_edit",
    "erratum_vs_control": "erratum_control",
    "erratum_control": "no_edit",
}


def _arm(name: str) -> str:
    return "erratum" if name == "erratum_vs_control" else name


def shift_recovered(result: CaseResult, name: str) -> float:
    """(arm - reference) / (oracle - no_edit) in margin: 1 = moved as far as a full recompute."""
    span = result.margins["oracle"] - result.margins["no_edit"]
    moved = result.margins[_arm(name)] - result.margins[REFERENCES[name]]
    return moved / span if span else math.nan


def same_direction(result: CaseResult, name: str) -> bool:
    """The arm moved the margin the way the oracle did (relative to its reference)."""
    return shift_recovered(result, name) > 0


def _median(values: Sequence[float]) -> float | None:
    finite = [v for v in values if not math.isnan(v)]
    return statistics.median(finite) if finite else None


def _hit(results: Sequence[CaseResult], which: str) -> dict[str, Any]:
    return hit_summary([getattr(r, which) for r in results])


def hit_summary(requests: Sequence[Request]) -> dict[str, Any]:
    """Hit rate summed over requests (reused / prompt tokens), prefilled mean, spread, time."""
    reused, tokens = sum(q.reused for q in requests), sum(q.tokens for q in requests)
    rates = [q.hit_rate for q in requests]
    return {
        "hit_rate": reused / tokens if tokens else None,
        "reused": reused,
        "tokens": tokens,
        "prefilled_mean": statistics.fmean(q.prefilled for q in requests) if requests else None,
        "min": min(rates, default=None),
        "max": max(rates, default=None),
        "median_ms": _median([q.seconds * 1e3 for q in requests]),
    }


def group_summary(results: Sequence[CaseResult], thresholds: dict[str, float]) -> dict[str, Any]:
    """Recovery, shift, hit rates and engine checks over ``results`` (one template or all)."""
    ok = [r for r in results if qualifies(r, thresholds[r.template])]
    raw = [r for r in results if qualifies(r, 0.0)]
    recovery, raw_recovery, shift = {}, {}, {}
    for arm in RECOVERY_ARMS:
        hits = sum(
            decisions(r, thresholds[r.template])[arm]
            == decisions(r, thresholds[r.template])["oracle"]
            for r in ok
        )
        recovery[arm] = Rate(hits, len(ok))
        raw_hits = sum(decisions(r, 0.0)[arm] == decisions(r, 0.0)["oracle"] for r in raw)
        raw_recovery[arm] = Rate(raw_hits, len(raw))
    direction = {}
    for name in REFERENCES:
        shift[name] = _median([shift_recovered(r, name) for r in ok])
        direction[name] = Rate(sum(same_direction(r, name) for r in ok), len(ok))
    clean = [(r.margins["no_edit"], r.rule_old, r.template) for r in results]
    clean += [(r.margins["oracle"], r.rule_new, r.template) for r in results]
    follows = sum((m > thresholds[name]) == rule for m, rule, name in clean)
    return {
        "cases": len(results),
        "qualifying": len(ok),
        "qualifying_raw_argmax": len(raw),
        "oracle_follows_rule": Rate(follows, len(clean)).to_json(),
        "recovery": {arm: rate.to_json() for arm, rate in recovery.items()},
        "recovery_raw_argmax": {arm: rate.to_json() for arm, rate in raw_recovery.items()},
        "median_shift_recovered": shift,
        "direction": {name: rate.to_json() for name, rate in direction.items()},
        "hit_rate": {
            "first_request": _hit(results, "first_request"),
            "erratum": _hit(results, "erratum_request"),
            "in_prefix_edit": _hit(results, "edit_request"),
        },
        "field_position": _median([r.field_start / r.prompt_tokens["oracle"] for r in results]),
        "prompt_tokens": _median([r.edit_request.tokens for r in results]),
        "checks": {
            "splice_paths": sorted({str(r.splice["path"]) for r in results}),
            "field_kv_changed": all(r.field_kv_change > 0 for r in results),
            "max_field_kv_vs_oracle": max((r.field_kv_vs_oracle for r in results), default=None),
            "downstream_kept_bitwise": all(r.downstream_kept for r in results),
            "min_downstream_vs_oracle": min(
                (r.downstream_vs_oracle for r in results), default=None
            ),
            "max_erratum_directive_vs_request": max(
                (abs(r.margins["erratum"] - r.erratum_request_margin) for r in results),
                default=None,
            ),
            "max_no_edit_vs_first_request": max(
                (abs(r.margins["no_edit"] - r.first_request_margin) for r in results),
                default=None,
            ),
            "max_oracle_vs_edit_request": max(
                (abs(r.margins["oracle"] - r.edit_request_margin) for r in results),
                default=None,
            ),
        },
    }


def summarize(results: Sequence[CaseResult]) -> dict[str, Any]:
    names = list(dict.fromkeys(r.template for r in results))
    thresholds = {name: fit_threshold([r for r in results if r.template == name]) for name in names}
    return {
        "thresholds": thresholds,
        "templates": {
            name: group_summary([r for r in results if r.template == name], thresholds)
            for name in names
        },
        "overall": group_summary(results, thresholds),
    }


def rate_text(entry: dict[str, Any]) -> str:
    """A summary's rate entry as ``k/n = r [lo, hi]``."""
    return Rate(int(entry["k"]), int(entry["n"])).text()
