"""Keep freed memory in the process so large KV buffers are reused, not page-faulted again.

glibc hands allocations above 128 KiB back to the kernel when freed (``mmap``), so every new
KV buffer of a splice or a generation pays first-touch page faults (docs/perf.md). Raising
the mmap threshold and the trim threshold keeps freed blocks in the heap for the next buffer.

Process-wide, so it is opt-in: ``leyline serve`` (unless ``--release-freed-memory``) and the
benchmarks call it once at start; a library embedding the engine decides for itself.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def retain_freed_memory(limit_bytes: int = 1 << 30) -> bool:
    """Serve allocations up to ``limit_bytes`` from the heap and keep freed memory; returns
    False (and changes nothing) where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    limit = min(limit_bytes, 2**31 - 1)
    return bool(mallopt(_M_MMAP_THRESHOLD, limit)) and bool(mallopt(_M_TRIM_THRESHOLD, limit))
