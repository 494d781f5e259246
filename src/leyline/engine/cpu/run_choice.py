"""Which runs a replacement's queries faster on this CPU, the attention kernel's query runs or
torch's flash kernel: measured once per shape and key-count bucket.

Neither CPU flag nor dtype says which wins (on a Xeon with AMX torch's bf16 kernel often
does, and the order flips with the number of keys: docs/perf.md), so the first run of each
shape and bucket (the next power of two, :data:`MIN_BUCKET_KEYS` to :data:`MAX_BUCKET_KEYS`)
times both on random data, a few interleaved calls each, and later runs take the faster.
Runs over several key segments are measured apart, both arms doing what
``segment_attention`` does. Both paths compute the same attention to fp32 rounding.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Literal, Protocol

import torch

RunMode = Literal["auto", "kernel", "torch"]
MIN_BUCKET_KEYS = 512
"""The smallest key-count bucket (``attention_kernel.RUN_MIN_KEYS``: shorter runs stay on
torch's kernel)."""
MAX_BUCKET_KEYS = 16384
"""The largest: longer runs share its measurement."""
CALIBRATION_CALLS = 7
"""Timed calls per arm, interleaved after one warm-up each (medians compared)."""

ShapeKey = tuple[torch.dtype, int, int, int, int, int, int, int]
"""dtype, query heads, kv heads, queries in the run, key width, value width, key-count
bucket (:func:`key_bucket`), key segments (1, or 2 for several: :func:`parts_key`)."""


def parts_key(parts: int) -> int:
    """The segment count a run's measurement is taken at: 1, or 2 for any more."""
    return 1 if parts <= 1 else 2


def key_bucket(keys: int) -> int:
    """The keys a measurement for a run over ``keys`` keys is taken at: the next power of
    two, within :data:`MIN_BUCKET_KEYS` .. :data:`MAX_BUCKET_KEYS`."""
    bucket = MIN_BUCKET_KEYS
    while bucket < keys and bucket < MAX_BUCKET_KEYS:
        bucket *= 2
    return bucket


class RunsKernel(Protocol):
    def attend_runs(
        self,
        segments: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]],
        scale: float | None,
    ) -> torch.Tensor: ...


class RunChooser:
    """Per shape, whether the kernel's runs beat torch's flash kernel (module docstring)."""

    def __init__(self, kernel: RunsKernel, mode: RunMode = "auto") -> None:
        self.kernel = kernel
        self.mode: RunMode = mode
        """``auto`` measures; ``kernel`` and ``torch`` decide without measuring (benchmarks)."""
        self.measured: dict[ShapeKey, tuple[float, float]] = {}
        """Per shape: the kernel's and torch's median seconds."""

    def kernel_wins(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
        """Whether a run of ``query [1, heads, m, d]`` over ``key``/``value`` should go to
        the kernel (the caller has checked the kernel takes it)."""
        return self.kernel_wins_over(query, key, value, key.shape[2])

    def kernel_wins_over(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        keys: int,
        parts: int = 1,
    ) -> bool:
        """:meth:`kernel_wins` for a run that sees ``keys`` keys over all its ``parts``
        segments (``key``/``value``: one of them, for the shape)."""
        if self.mode != "auto":
            return self.mode == "kernel"
        bucket = key_bucket(keys)
        shape: ShapeKey = (
            key.dtype, query.shape[1], key.shape[1], query.shape[2], key.shape[3], value.shape[3],
            bucket, parts_key(parts),
        )  # fmt: skip
        times = self.measured.get(shape)
        if times is None:
            times = self.measured[shape] = self.measure(shape)
        return times[0] < times[1]

    def measure(self, shape: ShapeKey) -> tuple[float, float]:
        """Median seconds of the kernel's and torch's path for one run of ``shape``."""
        dtype, heads, kv_heads, m, d, dv, n, parts = shape
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, heads, m, d, generator=g).to(dtype)
        k = torch.randn(1, kv_heads, n, d, generator=g).to(dtype)
        v = torch.randn(1, kv_heads, n, dv, generator=g).to(dtype)
        seen = [n - m + 1 + j for j in range(m)]  # causal, as a replacement
        mask = torch.zeros(1, 1, m, n, dtype=dtype)
        for j, s in enumerate(seen):
            mask[..., j, s:] = float("-inf")
        arms: dict[str, Callable[[], object]] = {
            "kernel": lambda: self.kernel.attend_runs([(q, k, v, seen)], None),
            "torch": lambda: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, False, attn_mask=mask
            ),
        }
        if parts > 1:
            arms = self._segmented_arms(q, k, v, m)
        samples: dict[str, list[float]] = {name: [] for name in arms}
        for fn in arms.values():
            fn()  # warm-up: first-call allocations, thread pools
        for _ in range(CALIBRATION_CALLS):
            for name, fn in arms.items():
                t0 = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - t0)
        return statistics.median(samples["kernel"]), statistics.median(samples["torch"])

    def _segmented_arms(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: int
    ) -> dict[str, Callable[[], object]]:
        """Both paths for a run over two segments, as ``segment_attention`` runs them: the
        first ``n - m`` keys seen whole, the last ``m`` (the run's own) causally."""
        from leyline.engine.segment_attention import attend_part, merge_parts

        n = k.shape[2]
        head = (k[:, :, : n - m], v[:, :, : n - m])
        own = (k[:, :, n - m :], v[:, :, n - m :])
        causal = torch.zeros(1, 1, m, m, dtype=q.dtype)
        causal.masked_fill_(torch.ones(m, m, dtype=torch.bool).triu(1), float("-inf"))
        segments = [(q, *head, [n - m] * m), (q, *own, [j + 1 for j in range(m)])]

        def by_torch() -> object:
            return merge_parts(
                [attend_part(q, *head, None, None), attend_part(q, *own, causal, None)]
            )

        return {"kernel": lambda: self.kernel.attend_runs(segments, None), "torch": by_torch}
