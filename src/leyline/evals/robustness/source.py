"""Where the fuzzer's choices come from: a seeded ``random.Random`` (the eval) or Hypothesis
(the test, which wraps ``st.data()`` in the same interface and so shrinks a failure).

Every choice is an integer in a closed range; options are listed simplest first, so a
shrinking source tends toward the plain valid request. Ranges never depend on the server's
state (a session's length): Hypothesis requires the same draws for the same choices, so a
position is drawn from a fixed range and scaled (``below``).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol, TypeVar

T = TypeVar("T")


class Source(Protocol):
    def integer(self, low: int, high: int) -> int:
        """An integer in ``[low, high]``."""
        ...


class RandomSource:
    def __init__(self, seed: int) -> None:
        self._random = random.Random(seed)

    def integer(self, low: int, high: int) -> int:
        return self._random.randint(low, high)


def pick(source: Source, options: Sequence[T]) -> T:
    """One of a fixed list of options."""
    return options[source.integer(0, len(options) - 1)]


def below(source: Source, n: int) -> int:
    """An integer in ``[0, n)`` (0 when ``n <= 0``), from a range that does not depend on ``n``."""
    return source.integer(0, SCALE - 1) * max(n, 0) // SCALE


SCALE = 4096


def chance(source: Source, percent: int) -> bool:
    """True about ``percent`` times in 100 (False is the simple case, for shrinking)."""
    return source.integer(0, 99) >= 100 - percent
