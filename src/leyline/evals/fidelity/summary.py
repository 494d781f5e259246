"""Aggregates of the per-prompt records, key errors and drift curves (plain dicts for JSON)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from .agreement import PromptRecord
from .drift import DriftResult
from .keys import KeyErrors
from .measures import loglog_slope, quantiles

KL_FIELDS = (
    "kl_splice_vs_full",
    "kl_splice_vs_reprefill",
    "kl_reprefill_vs_full",
    "kl_control_vs_reprefill",
)
DRIFT_CHECKPOINTS = (0, 1, 2, 5, 10, 20, 50, 100)


def agreement_counts(records: Sequence[PromptRecord]) -> dict[str, int]:
    return {
        "prompts": len(records),
        "splice_eq_full": sum(r.argmax_splice == r.argmax_full for r in records),
        "splice_eq_reprefill": sum(r.argmax_splice == r.argmax_reprefill for r in records),
        "full_eq_reprefill": sum(r.argmax_full == r.argmax_reprefill for r in records),
        "control_eq_reprefill": sum(r.argmax_control == r.argmax_reprefill for r in records),
        "fallbacks": sum(r.path != "splice" for r in records),
    }


def summarize_agreement(records: Sequence[PromptRecord]) -> dict[str, Any]:
    kinds = sorted({r.kind for r in records})
    divergent = [r for r in records if r.diverges]
    follows = Counter(r.follows for r in divergent)
    return {
        "counts": agreement_counts(records),
        "kl": {f: quantiles([getattr(r, f) for r in records]) for f in KL_FIELDS},
        "by_kind": {
            k: {
                **agreement_counts([r for r in records if r.kind == k]),
                "kl_splice_vs_full_median": quantiles(
                    [r.kl_splice_vs_full for r in records if r.kind == k]
                )["median"],
                "kl_splice_vs_reprefill_median": quantiles(
                    [r.kl_splice_vs_reprefill for r in records if r.kind == k]
                )["median"],
            }
            for k in kinds
        },
        "divergent": {
            "prompts": len(divergent),
            "splice_follows_full": follows["full"],
            "splice_follows_reprefill": follows["reprefill"],
            "splice_follows_neither": follows["neither"],
            "by_kind": {
                k: dict(Counter(r.follows for r in divergent if r.kind == k)) for k in kinds
            },
        },
        "answers": _answers(records),
    }


def _answers(records: Sequence[PromptRecord]) -> dict[str, dict[str, int]]:
    """Per kind: how often each arm's argmax is the first token of the asked-for fact."""
    out: dict[str, dict[str, int]] = {}
    for kind in ("removed", "kept"):
        rs = [r for r in records if r.kind == kind and r.answer_token is not None]
        if rs:
            out[kind] = {
                "prompts": len(rs),
                "full": sum(r.argmax_full == r.answer_token for r in rs),
                "reprefill": sum(r.argmax_reprefill == r.answer_token for r in rs),
                "splice": sum(r.argmax_splice == r.answer_token for r in rs),
            }
    return out


def summarize_keys(errors: Sequence[KeyErrors]) -> dict[str, Any]:
    layers = len(errors[0].rotated) if errors else 0

    def column(field: str, layer: int) -> list[float]:
        return [getattr(e, field)[layer] for e in errors]

    return {
        "prompts": [e.id for e in errors],
        "deltas": [e.delta for e in errors],
        "rotated_max": [max(column("rotated", i)) for i in range(layers)],
        "rotated_median": [quantiles(column("rotated", i))["median"] for i in range(layers)],
        "unrotated_min": [min(column("unrotated", i)) for i in range(layers)],
        "prefill_vs_reference_max": [
            max(column("prefill_vs_reference_run", i)) for i in range(layers)
        ],
        "rest_bitwise": all(e.rest_bitwise for e in errors),
        "worst": max((max(e.rotated) for e in errors), default=float("nan")),
    }


def summarize_drift(result: DriftResult) -> dict[str, Any]:
    slopes: dict[str, dict[str, float]] = {}
    points: dict[str, dict[str, dict[int, float]]] = {}
    for pattern, arms in result.errors.items():
        slopes[pattern], points[pattern] = {}, {}
        for arm, errs in arms.items():
            k = list(range(1, len(errs)))
            slopes[pattern][arm] = loglog_slope(k, errs[1:]) if len(k) > 1 else float("nan")
            counts = sorted({c for c in DRIFT_CHECKPOINTS if c < len(errs)} | {len(errs) - 1})
            points[pattern][arm] = {c: errs[c] for c in counts}
    return {"slopes": slopes, "checkpoints": points, "elements": result.elements}
