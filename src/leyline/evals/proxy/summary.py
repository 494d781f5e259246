"""Per-arm figures from the task records: accuracy with Wilson intervals, tokens, agreement.

Works on the JSON records (``TaskResult.to_json()``), so a saved ``report.json`` can be
summarised again and the tests can check that the summary matches the records.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from leyline.evals.common.stats import wilson

ARMS: tuple[str, ...] = ("none", "reprefill", "splice")
OPTIONAL_ARMS: tuple[str, ...] = ("summarize",)


def summarize(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The summary of ``report.json``: ``arms``, ``by_stale``, ``paired``, ``agreement``."""
    present = ARMS + tuple(a for a in OPTIONAL_ARMS if records and a in records[0]["arms"])
    arms = {arm: _arm(records, arm) for arm in present}
    levels = sorted({r["stale"] for r in records})
    by_stale = {
        arm: {
            str(level): _rate([r for r in records if r["stale"] == level], arm) for level in levels
        }
        for arm in present
    }
    chance = [1 / len(r["candidates"]) for r in records]
    return {
        "tasks": len(records),
        "chance": sum(chance) / len(chance) if chance else None,
        "arms": arms,
        "by_stale": by_stale,
        "paired": {arm: _paired(records, arm, "none") for arm in present if arm != "none"},
        "agreement": _agreement(records),
    }


def rate(successes: int, trials: int) -> dict[str, Any]:
    """``successes`` of ``trials``, the rate and its 95% Wilson interval, as JSON."""
    low, high = wilson(successes, trials)
    value = successes / trials if trials else None
    return {"successes": successes, "trials": trials, "rate": value, "ci95": [low, high]}


def _rate(records: Sequence[dict[str, Any]], arm: str) -> dict[str, Any]:
    return rate(sum(r["arms"][arm]["correct"] for r in records), len(records))


def _arm(records: Sequence[dict[str, Any]], arm: str) -> dict[str, Any]:
    runs = [r["arms"][arm] for r in records]
    paths = Counter(p for run in runs for p in run["paths"])
    return {
        "accuracy": _rate(records, arm),
        "unscored": sum(run["choice"] is None for run in runs),
        "prefilled": sum(run["prefilled"] for run in runs),
        "reused": sum(run["reused"] for run in runs),
        "rotated": sum(run["rotated"] for run in runs),
        "requests": sum(len(run["paths"]) for run in runs),
        "paths": {str(k): v for k, v in sorted(paths.items(), key=lambda kv: str(kv[0]))},
        "leyline": all(run["leyline"] for run in runs),
        "resyncs": sum(len(run["resyncs"]) for run in runs),
        "fallbacks": sum(len(run["fallbacks"]) for run in runs),
        "score_methods": dict(Counter(run["score_call"]["method"] for run in runs)),
        "wrong_picks": _wrong_picks(records, arm),
    }


def _wrong_picks(records: Sequence[dict[str, Any]], arm: str) -> dict[str, int]:
    """Which value a wrong choice picked; with several distractors, the first or last shown."""
    keys = ("single_distractor", "first_value", "last_stale_value", "other_value", "unscored")
    picks = dict.fromkeys(keys, 0)
    for r in records:
        choice, values = r["arms"][arm]["choice"], r["values"]
        if r["arms"][arm]["correct"]:
            continue
        if choice is None:
            picks["unscored"] += 1
        elif len(set(values[:-1])) == 1:
            picks["single_distractor"] += 1
        elif choice == values[0]:
            picks["first_value"] += 1
        elif choice == values[-2]:
            picks["last_stale_value"] += 1
        else:
            picks["other_value"] += 1
    return picks


def _paired(records: Sequence[dict[str, Any]], arm: str, base: str) -> dict[str, int]:
    """Discordant pairs: the tasks one arm got right and the other wrong (same tasks)."""
    gained = sum(r["arms"][arm]["correct"] and not r["arms"][base]["correct"] for r in records)
    lost = sum(r["arms"][base]["correct"] and not r["arms"][arm]["correct"] for r in records)
    return {"right_only_here": gained, f"right_only_{base}": lost}


def _agreement(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Splice arm vs re-prefill arm (the reference: its cache is a fresh prefill)."""
    kls = [r["kl"] for r in records if r["kl"] is not None]
    known = [r["same_tokens"] for r in records if r["same_tokens"] is not None]
    return {
        "same_choice": rate(sum(r["choices_agree"] for r in records), len(records)),
        "same_tokens": sum(known) if known else None,
        "tokens_compared": len(known),
        "kl_mean": sum(kls) / len(kls) if kls else None,
        "kl_max": max(kls) if kls else None,
    }
