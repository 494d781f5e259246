"""A progress bar over episodes (tqdm when installed, one line per episode otherwise)."""

from __future__ import annotations

import importlib.util
import sys
from typing import Any, Self

from .records import EpisodeResult


class Progress:
    def __init__(self, total: int, *, enabled: bool = True) -> None:
        self.total, self.enabled = total, enabled
        self.done = self.solved = self.errors = 0
        self._bar: Any = None
        if enabled and importlib.util.find_spec("tqdm") is not None:
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="episode", dynamic_ncols=True)

    def advance(self, result: EpisodeResult) -> None:
        self.done += 1
        self.solved += result.resolved
        self.errors += result.error is not None
        status = f"solved {self.solved}/{self.done}, errors {self.errors}"
        if self._bar is not None:
            self._bar.set_postfix_str(f"{status}; last {result.arm}/{result.task}")
            self._bar.update(1)
        elif self.enabled:
            mark = "solved" if result.resolved else result.stop_reason
            print(
                f"[{self.done}/{self.total}] {result.arm}/{result.task} run {result.run}: "
                f"{mark} in {result.steps} steps ({status})",
                file=sys.stderr,
            )

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.close()
