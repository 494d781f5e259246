"""Per concurrency level and arm: latency percentiles, cache-hit rate, argmax agreement."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .replay import ARMS, Sample


def pct(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100); NaN for no values."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def arm_figures(samples: Sequence[Sample]) -> dict[str, Any]:
    reused = sum(s.reused for s in samples)
    total = reused + sum(s.prefilled for s in samples)
    edited = [s for s in samples if s.reusable is not None]  # a revision was cached
    reusable = sum(s.reusable or 0 for s in edited)
    e2e = [s.e2e_s * 1e3 for s in samples]
    ttft = [s.ttft_s * 1e3 for s in samples]
    queued = [s.queued_s * 1e3 for s in samples if s.queued_s is not None]
    service = [s.service_s * 1e3 for s in samples if s.service_s is not None]
    decode = [s.decode_s * 1e3 for s in samples if s.decode_s is not None]
    return {
        "requests": len(samples),
        "e2e_p50_ms": pct(e2e, 50),
        "e2e_p90_ms": pct(e2e, 90),
        "e2e_mean_ms": sum(e2e) / len(e2e) if e2e else float("nan"),
        "ttft_p50_ms": pct(ttft, 50),
        "ttft_p90_ms": pct(ttft, 90),
        "queued_p50_ms": pct(queued, 50),
        "service_p50_ms": pct(service, 50),
        "decode_p50_ms": pct(decode, 50),
        "service_ms_total": sum(service),
        "hit_rate": reused / total if total else float("nan"),
        "prompt_tokens": total,
        "prefilled_tokens": total - reused,
        "rotated_tokens": sum(s.rotated for s in samples),
        "splice_paths": sum(s.path == "splice" for s in samples),
        "reusable_tokens": reusable,
        "reuse_of_reusable": (
            sum(s.reused for s in edited) / reusable if reusable else float("nan")
        ),
    }


def agreement(samples: Sequence[Sample]) -> dict[str, int]:
    """First-token argmax agreement of the splice arm with the warm-prefix re-prefill arm.

    Pairs are the two arms' requests of one client turn (same edited messages). ``spliced``
    counts the pairs whose splice request really ran as a splice on the server.
    """
    by_turn: dict[tuple[int, int, int], dict[str, Sample]] = {}
    for s in samples:
        by_turn.setdefault((s.level, s.client, s.turn), {})[s.arm] = s
    pairs = [p for p in by_turn.values() if all(p.get(a) and p[a].first_token for a in ARMS)]
    spliced = [p for p in pairs if p["splice"].path == "splice"]
    return {
        "pairs": len(pairs),
        "agree": sum(p["splice"].first_token == p["reprefill"].first_token for p in pairs),
        "spliced_pairs": len(spliced),
        "spliced_agree": sum(
            p["splice"].first_token == p["reprefill"].first_token for p in spliced
        ),
    }


def throughput(samples: Sequence[Sample]) -> float:
    """Requests completed per second over the span from the first sent to the last done
    (both arms, which share the server; one arm's alone when the arms ran apart)."""
    if not samples:
        return float("nan")
    wall = max(s.started_s + s.e2e_s for s in samples) - min(s.started_s for s in samples)
    return len(samples) / wall if wall > 0 else float("nan")


Counters = Mapping[int, Mapping[str, float]]
"""A server counter's growth by level and arm (``--server-counter``)."""


def ratio(a: float, b: float) -> float:
    """a / b, NaN where b is 0 (an arm that counted nothing)."""
    return a / b if b else float("nan")


def summarize(samples: Sequence[Sample], counter: Counters | None = None) -> dict[str, Any]:
    """Per level: each arm's figures, the re-prefill / splice p50 ratios, the agreement;
    with ``counter``, each arm's growth of the server's counter and their splice /
    re-prefill ratio."""
    table: dict[str, Any] = {}
    for level in sorted({s.level for s in samples}):
        mine = [s for s in samples if s.level == level]
        row: dict[str, Any] = {arm: arm_figures([s for s in mine if s.arm == arm]) for arm in ARMS}
        for key in ("e2e_p50_ms", "ttft_p50_ms"):
            row[f"ratio_{key}"] = row["reprefill"][key] / row["splice"][key]
        row["hit_rate_gain_pp"] = 100 * (row["splice"]["hit_rate"] - row["reprefill"]["hit_rate"])
        row["agreement"] = agreement(mine)
        row["throughput_rps"] = throughput(mine)
        # With a fixed set of clients the mean over all requests is set by throughput
        # (Little's law): what a scheduling order gives one arm, the other pays.
        row["e2e_mean_all_ms"] = 1e3 * sum(s.e2e_s for s in mine) / len(mine)
        row["throughput_rps_by_arm"] = {
            arm: throughput([s for s in mine if s.arm == arm]) for arm in ARMS
        }
        if counter is not None and level in counter:
            grown = counter[level]
            for arm in ARMS:
                row[arm]["server_counter"] = grown[arm]
            row["ratio_server_counter"] = ratio(grown["splice"], grown["reprefill"])
        table[str(level)] = row
    return table


def overall(samples: Sequence[Sample], counter: Counters | None = None) -> dict[str, Any]:
    """All levels together: hit rates, their gain and the agreement (and the counter's
    growth by arm, and its splice / re-prefill ratio)."""
    arms = {arm: arm_figures([s for s in samples if s.arm == arm]) for arm in ARMS}
    facts: dict[str, Any] = {
        "hit_rate": {arm: arms[arm]["hit_rate"] for arm in ARMS},
        "reuse_of_reusable": {arm: arms[arm]["reuse_of_reusable"] for arm in ARMS},
        "hit_rate_gain_pp": 100 * (arms["splice"]["hit_rate"] - arms["reprefill"]["hit_rate"]),
        "prefilled_tokens": {arm: arms[arm]["prefilled_tokens"] for arm in ARMS},
        "agreement": agreement(samples),
    }
    if counter is not None:
        grown = {arm: sum(by_arm[arm] for by_arm in counter.values()) for arm in ARMS}
        facts["server_counter"] = grown
        facts["ratio_server_counter"] = ratio(grown["splice"], grown["reprefill"])
    return facts
