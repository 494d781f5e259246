"""Solve rates with Wilson score intervals, their differences (Newcombe), and spreads.

Wilson rather than the normal approximation: with tens of episodes and rates near 0 or 1
the Wald interval collapses to a point or leaves [0, 1]; Wilson does neither.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

Z95 = 1.959963984540054
"""The two-sided 95% normal quantile."""


def wilson(successes: int, trials: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion; (0, 1) when there are no trials."""
    if not 0 <= successes <= trials:
        raise ValueError(f"need 0 <= successes <= trials, got {successes}/{trials}")
    if trials == 0:
        return 0.0, 1.0
    p = successes / trials
    z2 = z * z
    centre = (p + z2 / (2 * trials)) / (1 + z2 / trials)
    half = z * math.sqrt(p * (1 - p) / trials + z2 / (4 * trials * trials)) / (1 + z2 / trials)
    # At p = 0 (or 1) the exact bound is 0 (or 1); floating point leaves ~1e-17 off.
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == trials else min(1.0, centre + half)
    return low, high


@dataclass(frozen=True, slots=True)
class Rate:
    """``successes`` of ``trials`` with its 95% Wilson interval."""

    successes: int
    trials: int
    low: float
    high: float

    @classmethod
    def of(cls, successes: int, trials: int) -> Rate:
        low, high = wilson(successes, trials)
        return cls(successes, trials, low, high)

    @property
    def value(self) -> float | None:
        return self.successes / self.trials if self.trials else None

    def to_json(self) -> dict[str, object]:
        return {
            "successes": self.successes,
            "trials": self.trials,
            "rate": self.value,
            "ci95": [self.low, self.high],
        }


@dataclass(frozen=True, slots=True)
class Difference:
    """``a - b`` of two rates with Newcombe's hybrid score interval (method 10)."""

    value: float
    low: float
    high: float

    def to_json(self) -> dict[str, object]:
        return {"difference": self.value, "ci95": [self.low, self.high]}


def difference(a: Rate, b: Rate) -> Difference | None:
    """Newcombe's interval for ``a - b``, treating the two samples as independent.

    Episodes of two arms on the same tasks are paired, so this interval is conservative
    when task difficulty dominates the variance. None when either rate has no trials.
    """
    if a.value is None or b.value is None:
        return None
    d = a.value - b.value
    low = d - math.sqrt((a.value - a.low) ** 2 + (b.high - b.value) ** 2)
    high = d + math.sqrt((a.high - a.value) ** 2 + (b.value - b.low) ** 2)
    return Difference(d, max(-1.0, low), min(1.0, high))


@dataclass(frozen=True, slots=True)
class Spread:
    """Mean, median and range of a sample (all None when it is empty)."""

    n: int
    mean: float | None
    median: float | None
    low: float | None
    high: float | None

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        if not values:
            return cls(0, None, None, None, None)
        return cls(
            len(values),
            statistics.fmean(values),
            statistics.median(values),
            min(values),
            max(values),
        )

    def to_json(self) -> dict[str, object]:
        return {
            "n": self.n,
            "mean": self.mean,
            "median": self.median,
            "min": self.low,
            "max": self.high,
        }
