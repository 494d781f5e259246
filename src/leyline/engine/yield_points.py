"""Where long model work may pause so the scheduler can run other work in between.

A prefill runs chunk by chunk (``forward``); between two chunks it calls
:func:`chunk_boundary`. On a scheduler's job thread (``scheduler``) that hands the model to
other jobs and to a batched decode step of the running generations, then resumes; anywhere
else (benchmarks, evals, tests driving the engine directly) it does nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_local = threading.local()


def chunk_boundary() -> None:
    """Called by model work between chunks: pause here if the running job may."""
    hook: Callable[[], None] | None = getattr(_local, "hook", None)
    if hook is not None:
        hook()


@contextmanager
def pausing_with(hook: Callable[[], None]) -> Iterator[None]:
    """Run the block with ``hook`` as this thread's chunk boundary."""
    previous = getattr(_local, "hook", None)
    _local.hook = hook
    try:
        yield
    finally:
        _local.hook = previous
