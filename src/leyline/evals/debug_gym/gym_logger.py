"""One quiet debug-gym logger for the whole harness process."""

from __future__ import annotations

import functools
import logging

from debug_gym.logger import DebugGymLogger


class QuietLogger(DebugGymLogger):
    """Warnings only on the console; progress reports dropped.

    debug-gym's agents report progress into a multiprocessing queue that only its own
    runner drains; undrained, the queue fills (30k entries) and every step then waits
    seconds. The harness shows its own progress bar instead.
    """

    def report_progress(self, *args: object, **kwargs: object) -> None:
        return None


@functools.cache
def quiet_logger() -> QuietLogger:
    # The first DebugGymLogger of a process becomes the "main" one (it owns a listener
    # thread); later ones forward records to it. One shared instance avoids both.
    return QuietLogger("leyline-debug-gym", level=logging.WARNING)
