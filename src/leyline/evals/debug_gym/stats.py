"""Solve rates with Wilson score intervals, their differences (Newcombe), and spreads."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from leyline.evals.common.report import json_fields
from leyline.evals.common.stats import wilson


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
        return json_fields(self, "successes", "trials", rate=self.value, ci95=[self.low, self.high])


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
        return json_fields(self, "n", "mean", "median", min=self.low, max=self.high)
