"""Which runs a replacement's queries faster on this CPU: the attention kernel's query runs or
torch's flash kernel, measured once per shape.

The kernel's runs (``AttentionKernel.attend_runs``) were written for and measured on an
AVX-512 CPU without AMX, where they beat torch's CPU flash kernel 1.3-2.1x for 16 queries
over 600 keys and more. On a Xeon with AMX, torch's bf16 flash kernel runs its products on
the tile unit and the order flips (16 queries over 1,040 keys: torch 353 us against the
kernel's 650; ``evals/bench_run_attention.py``, docs/perf.md). Neither CPU flag nor dtype
alone says which wins, so the first run of each shape times both on random data of that
shape (a few interleaved calls each, about 10-20 ms once per process) and every later run
of that shape takes the faster. Both paths compute the same attention to fp32 rounding;
only the time differs.

``LEYLINE_ATTENTION_RUNS`` overrides: ``kernel`` (always the kernel where it takes the run),
``torch`` (never), ``auto`` (the default: measured).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Literal, Protocol

import torch

SWITCH = "LEYLINE_ATTENTION_RUNS"
RunMode = Literal["auto", "kernel", "torch"]
MODES: tuple[RunMode, ...] = ("auto", "kernel", "torch")
CALIBRATION_KEYS = 1024
"""Keys the timed run sees (past ``attention_kernel.RUN_MIN_KEYS``: a replacement's
typical prefix)."""
CALIBRATION_CALLS = 7
"""Timed calls per arm, interleaved after one warm-up each (medians compared)."""

ShapeKey = tuple[torch.dtype, int, int, int, int, int]
"""dtype, query heads, kv heads, queries in the run, key width, value width."""


class RunsKernel(Protocol):
    def attend_runs(
        self,
        segments: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]],
        scale: float | None,
    ) -> torch.Tensor: ...


def mode_from_env() -> RunMode:
    """The override in :data:`SWITCH`; raises ``ValueError`` naming a bad value."""
    value = os.environ.get(SWITCH, "auto").strip().lower() or "auto"
    for mode in MODES:
        if value == mode:
            return mode
    raise ValueError(f"{SWITCH} must be one of {', '.join(MODES)}, not {value!r}")


class RunChooser:
    """Per shape, whether the kernel's runs beat torch's flash kernel (module docstring)."""

    def __init__(self, kernel: RunsKernel, mode: RunMode | None = None) -> None:
        self.kernel = kernel
        self.mode: RunMode = mode_from_env() if mode is None else mode
        """``auto`` measures; ``kernel`` and ``torch`` decide without measuring."""
        self.measured: dict[ShapeKey, tuple[float, float]] = {}
        """Per shape: the kernel's and torch's median seconds."""

    def kernel_wins(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
        """Whether a run of ``query [1, heads, m, d]`` over ``key``/``value`` should go to
        the kernel (the caller has checked the kernel takes it)."""
        if self.mode != "auto":
            return self.mode == "kernel"
        shape: ShapeKey = (
            key.dtype, query.shape[1], key.shape[1], query.shape[2], key.shape[3], value.shape[3]
        )  # fmt: skip
        times = self.measured.get(shape)
        if times is None:
            times = self.measured[shape] = self.measure(shape)
        return times[0] < times[1]

    def measure(self, shape: ShapeKey) -> tuple[float, float]:
        """Median seconds of the kernel's and torch's path for one run of ``shape``."""
        dtype, heads, kv_heads, m, d, dv = shape
        g = torch.Generator().manual_seed(0)
        n = CALIBRATION_KEYS
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
        samples: dict[str, list[float]] = {name: [] for name in arms}
        for fn in arms.values():
            fn()  # warm-up: first-call allocations, thread pools
        for _ in range(CALIBRATION_CALLS):
            for name, fn in arms.items():
                t0 = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - t0)
        return statistics.median(samples["kernel"]), statistics.median(samples["torch"])
