"""Figures of the report from the per-item results: fidelity per (kind, length, arm), TTFT
per length, memory per skill, and the issue's targets."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

from leyline.evals.common.stats import wilson

from .arms import FULL, NO_SKILL, ArmSet, ItemResult, compose_arm, control_arm
from .measures import Agreement

TARGET_SEAM = 16
TARGET_KL = {"policy": 0.04, "passage": 0.015, "tools": 0.08}
TARGET_CENTRED_COSINE = 0.997
TARGET_CONTROL_RATIO = 4.0
TARGET_SPEEDUP = 12.0
TARGET_SPEEDUP_LENGTH = 4096


def _stats(values: Sequence[float]) -> dict[str, float]:
    v = sorted(values)
    p95 = v[min(len(v) - 1, round(0.95 * (len(v) - 1)))]
    return {"mean": statistics.fmean(v), "median": statistics.median(v), "p95": p95, "max": v[-1]}


def _rate(flags: Sequence[bool]) -> dict[str, Any]:
    low, high = wilson(sum(flags), len(flags))
    return {
        "count": sum(flags),
        "n": len(flags),
        "rate": sum(flags) / len(flags),
        "ci95": [low, high],
    }


def arm_figures(agreements: Sequence[Agreement]) -> dict[str, Any]:
    answered = [a for a in agreements if a.p_answer is not None]
    p_answer = [a.p_answer for a in answered if a.p_answer is not None]
    return {
        "kl": _stats([a.kl for a in agreements]),
        "cosine_mean": statistics.fmean(a.cosine for a in agreements),
        "centred_cosine": {
            "mean": statistics.fmean(a.centred_cosine for a in agreements),
            "min": min(a.centred_cosine for a in agreements),
        },
        "argmax_agrees": _rate([a.argmax_agrees for a in agreements]),
        "p_answer_mean": statistics.fmean(p_answer) if p_answer else None,
        "answer_is_argmax": _rate([bool(a.answer_is_argmax) for a in answered])
        if answered
        else None,
        "finite": all(a.finite for a in agreements),
    }


def _groups(
    results: Sequence[ItemResult], key: Callable[[ItemResult], Any]
) -> dict[Any, list[ItemResult]]:
    out: dict[Any, list[ItemResult]] = {}
    for r in results:
        out.setdefault(key(r), []).append(r)
    return out


def cells(results: Sequence[ItemResult], arms: Sequence[str]) -> list[dict[str, Any]]:
    """One entry per (kind, requested length): every arm's figures against ``full``."""
    out = []
    for (kind, requested), group in _groups(
        results, lambda r: (r.item.kind, r.item.requested)
    ).items():
        out.append(
            {
                "kind": kind,
                "requested": requested,
                "tokens": group[0].skill_length,
                "items": len(group),
                "prefix_tokens_mean": statistics.fmean(len(r.item.prefix) for r in group),
                "arms": {a: arm_figures([r.agreement[a] for r in group]) for a in arms},
            }
        )
    return out


def ttft(
    results: Sequence[ItemResult], seams: Sequence[int], arms: ArmSet | None = None
) -> list[dict[str, Any]]:
    """Per requested length, over every kind's items (each item one interleaved repeat):
    medians with the prefix cached and cold (its prefill added to both arms); the
    selective-recompute arms under ``recompute``, by arm name."""
    out = []
    for requested, group in sorted(_groups(results, lambda r: r.item.requested).items()):

        def medians(arm: str, group: list[ItemResult] = group) -> dict[str, float]:
            return {
                "cached": statistics.median(r.seconds[arm] for r in group),
                "cold": statistics.median(r.seconds[arm] + r.prefix_seconds for r in group),
            }

        full = medians(FULL)

        def against_full(arm: str, full: dict[str, float] = full) -> dict[str, float]:
            m = medians(arm)
            m["speedup_cached"] = full["cached"] / m["cached"]
            m["speedup_cold"] = full["cold"] / m["cold"]
            return m

        composes = {str(seam): against_full(compose_arm(seam)) for seam in seams}
        recompute = {name: against_full(name) for name in (arms.recompute_arms() if arms else [])}
        out.append(
            {
                "requested": requested,
                "tokens_mean": statistics.fmean(r.skill_length for r in group),
                "repeats": len(group),
                "prefix_seconds_median": statistics.median(r.prefix_seconds for r in group),
                "full": full,
                "compose": composes,
                "recompute": recompute,
            }
        )
    return out


def kl_by_seam(
    cell_list: Sequence[dict[str, Any]], seams: Sequence[int], arms: ArmSet
) -> dict[str, Any]:
    """Mean KL per kind and K over every length (the plot's lines), the selective-recompute
    arms' and the control's."""
    out: dict[str, Any] = {}
    for kind, group in _groups_cells(cell_list).items():
        n = sum(c["items"] for c in group)

        def pooled(arm: str, group: list[dict[str, Any]] = group, n: int = n) -> float:
            return float(sum(c["arms"][arm]["kl"]["mean"] * c["items"] for c in group)) / n

        control = control_arm(arms.control_seam)
        out[kind] = {
            "by_seam": {str(s): pooled(compose_arm(s)) for s in seams},
            "recompute": {name: pooled(name) for name in arms.recompute_arms()},
            "control": {"arm": control, "kl_mean": pooled(control)},
            "no_skill": pooled(NO_SKILL),
        }
    return out


def p_answer(cell_list: Sequence[dict[str, Any]], arms: Sequence[str]) -> list[dict[str, Any]]:
    """Per (kind, length): each arm's mean probability of the answer token, and its ratio
    to ``full``'s (how much of the answer the arm keeps)."""
    rows = []
    for c in cell_list:
        full = c["arms"][FULL]["p_answer_mean"]
        by_arm = {}
        for arm in arms:
            p = c["arms"][arm]["p_answer_mean"]
            kept = None if p is None or not full else p / full
            by_arm[arm] = {"mean": p, "of_full": kept}
        rows.append({"kind": c["kind"], "tokens": c["tokens"], "arms": by_arm})
    return rows


def _groups_cells(cell_list: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for c in cell_list:
        out.setdefault(c["kind"], []).append(c)
    return out


def targets(
    cell_list: Sequence[dict[str, Any]],
    ttft_rows: Sequence[dict[str, Any]],
    control_seam: int,
    arm: str = compose_arm(TARGET_SEAM),
) -> list[dict[str, Any]]:
    """The issue's targets at K = 16 for ``arm`` (the plain compose by default; the anchored
    arm is judged the same way); ``met`` is None when this run did not measure one."""
    have = bool(cell_list) and arm in cell_list[0]["arms"]
    label = "K=16" if arm == compose_arm(TARGET_SEAM) else arm
    rows: list[dict[str, Any]] = []
    for kind, bound in TARGET_KL.items():
        group = [c for c in cell_list if c["kind"] == kind]
        worst = max((c["arms"][arm]["kl"]["mean"] for c in group), default=None) if have else None
        rows.append(_row(f"{kind}: mean KL at {label}, worst length", "<=", bound, worst))
    cc = min((c["arms"][arm]["centred_cosine"]["mean"] for c in cell_list), default=None)
    rows.append(
        _row(
            f"mean centred cosine at {label}, worst cell",
            ">=",
            TARGET_CENTRED_COSINE,
            cc if have else None,
        )
    )
    ratio = None
    if have and control_seam == TARGET_SEAM:
        control = control_arm(control_seam)
        ratio = min(
            c["arms"][control]["kl"]["mean"] / max(c["arms"][arm]["kl"]["mean"], 1e-12)
            for c in cell_list
        )
    rows.append(
        _row(f"no-rotation / {label} mean KL, worst cell", ">=", TARGET_CONTROL_RATIO, ratio)
    )
    speedup = None
    for row in ttft_rows:
        timed = {compose_arm(int(k)): v for k, v in row["compose"].items()} | row["recompute"]
        if row["requested"] == TARGET_SPEEDUP_LENGTH and arm in timed:
            speedup = timed[arm]["speedup_cached"]
    rows.append(
        _row(
            f"TTFT speedup at {TARGET_SPEEDUP_LENGTH} tokens, prefix cached, {label}",
            ">=",
            TARGET_SPEEDUP,
            speedup,
        )
    )
    return rows


def _row(name: str, op: str, bound: float, measured: float | None) -> dict[str, Any]:
    met = None if measured is None else (measured <= bound if op == "<=" else measured >= bound)
    return {"target": name, "op": op, "bound": bound, "measured": measured, "met": met}
