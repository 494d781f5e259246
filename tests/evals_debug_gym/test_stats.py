"""Wilson and Newcombe intervals against published values; spreads."""

from __future__ import annotations

import pytest

from leyline.evals.common.stats import wilson
from leyline.evals.debug_gym.stats import Rate, Spread, difference


@pytest.mark.parametrize(
    ("k", "n", "low", "high"),
    [
        (5, 10, 0.236593, 0.763407),  # statsmodels proportion_confint(method="wilson")
        (0, 10, 0.0, 0.277533),
        (10, 10, 0.722467, 1.0),
    ],
)
def test_wilson_matches_reference_values(k: int, n: int, low: float, high: float) -> None:
    got = wilson(k, n)
    assert got == pytest.approx((low, high), abs=1e-5)


def test_wilson_is_symmetric_and_stays_in_the_unit_interval() -> None:
    for n in (1, 2, 7, 40):
        for k in range(n + 1):
            low, high = wilson(k, n)
            mirror_low, mirror_high = wilson(n - k, n)
            assert 0.0 <= low <= k / n <= high <= 1.0
            assert low == pytest.approx(1 - mirror_high) and high == pytest.approx(1 - mirror_low)


def test_wilson_without_trials_is_the_whole_interval_and_bad_counts_raise() -> None:
    assert wilson(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError, match="successes"):
        wilson(3, 2)


def test_newcombe_difference_matches_the_published_example() -> None:
    # Newcombe (1998), method 10: 56/70 - 48/80 = 0.2000, 95% CI 0.0524 to 0.3339.
    diff = difference(Rate.of(56, 70), Rate.of(48, 80))
    assert diff is not None
    assert (diff.value, diff.low, diff.high) == pytest.approx((0.2, 0.0524, 0.3339), abs=1e-4)


def test_difference_needs_trials_on_both_sides() -> None:
    assert difference(Rate.of(0, 0), Rate.of(1, 2)) is None


def test_rate_and_spread_serialise() -> None:
    assert Rate.of(1, 4).to_json() == {
        "successes": 1,
        "trials": 4,
        "rate": 0.25,
        "ci95": list(wilson(1, 4)),
    }
    spread = Spread.of([3.0, 5.0, 10.0])
    assert (spread.mean, spread.median, spread.low, spread.high) == (6.0, 5.0, 3.0, 10.0)
    assert Spread.of([]).to_json()["mean"] is None
