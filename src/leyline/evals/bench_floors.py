"""The floors a splice is measured against (``bench_splice``): what this machine's memory
bandwidth and matrix-product rate allow a splice with logits at best.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from leyline.engine.cpu.packed_linear import PackedLinear, linear_weight_bytes
from leyline.engine.engine import Engine
from leyline.evals.bench_common import interleaved_medians


@dataclass(frozen=True)
class Bandwidth:
    """Measured on this machine, medians of interleaved runs (GB/s, ms)."""

    weight_bytes: int
    read_GBps: float
    """Summing an fp32 buffer the size of the weights: how fast a forward can stream them
    (in fp32 whatever the weights' dtype: a bf16 sum measures arithmetic, not memory)."""
    copy_GBps: float
    """Copying a buffer the size of the weights (bytes copied per second)."""
    linear_rows: int
    linear_ms: float
    """Every linear layer of the model on ``linear_rows`` rows (the output head on one):
    what a splice's one pass spends in matrix products at this thread count, which the
    bandwidth floor assumes hidden behind the weight stream."""
    linear_flops: int = 0
    """FLOPs of those products (2 x rows x weights, the head on one row)."""
    gemm_GFLOPs: float = 0.0
    """The best matrix-product rate measured here: a 2048^3 product in the model's dtype."""

    def floor_ms(self, rotated_bytes: int) -> float:
        return (self.weight_bytes / self.read_GBps + rotated_bytes / self.copy_GBps) / 1e6

    def compute_floor_ms(self, rotated_bytes: int) -> float:
        """The floor with the matrix products' measured time when they take longer than
        streaming the weights."""
        stream = self.weight_bytes / self.read_GBps / 1e6
        return max(stream, self.linear_ms) + rotated_bytes / self.copy_GBps / 1e6

    def peak_compute_floor_ms(self, rotated_bytes: int) -> float:
        """The floor with the products at the machine's best matrix-product rate: what no
        kernel for few rows can beat (0 when the rate was not measured)."""
        if not self.gemm_GFLOPs:
            return 0.0
        stream = self.weight_bytes / self.read_GBps / 1e6
        products = self.linear_flops / self.gemm_GFLOPs / 1e6
        return max(stream, products) + rotated_bytes / self.copy_GBps / 1e6

    def kv_floor_ms(self, rotated_bytes: int, attended_bytes: int, moved_bytes: int) -> float:
        """The floor plus the KV traffic it leaves out: ``attended_bytes`` read once (the last
        query over the new context) and ``moved_bytes`` copied (what moves unrotated)."""
        extra = attended_bytes / self.read_GBps + moved_bytes / self.copy_GBps
        return self.floor_ms(rotated_bytes) + extra / 1e6


def linear_layers(engine: Engine, rows: int) -> Callable[[], object]:
    """One call of every linear layer of the model on ``rows`` random rows (the output head
    on one row, as ``logits_to_keep=1`` runs it), through the modules the engine runs: on
    oneDNN's packed weights where it packed them (``packed_linear``)."""
    head = engine.model.get_output_embeddings()
    calls = []
    for module in engine.model.modules():
        if isinstance(module, torch.nn.Linear | PackedLinear):
            n = 1 if module is head else rows
            dtype = module.dtype if isinstance(module, PackedLinear) else module.weight.dtype
            calls.append((module, torch.randn(1, n, module.in_features, dtype=dtype)))

    def run() -> None:
        with torch.no_grad():
            for module, x in calls:
                module(x)

    return run


GEMM_SIZE = 2048


def linear_flops(engine: Engine, rows: int) -> int:
    """FLOPs of every linear layer on ``rows`` rows, the output head on one."""
    head = engine.model.get_output_embeddings()
    return sum(
        2 * (1 if m is head else rows) * m.in_features * m.out_features
        for m in engine.model.modules()
        if isinstance(m, torch.nn.Linear | PackedLinear)
    )


def measure_bandwidth(engine: Engine, runs: int, rows: int) -> Bandwidth:
    nbytes = linear_weight_bytes(engine.model)
    src = torch.empty(nbytes // 4, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    a, b = (torch.randn(GEMM_SIZE, GEMM_SIZE).to(engine.model.dtype) for _ in range(2))
    arms: dict[str, Callable[[], object]] = {
        "read": src.sum,
        "copy": lambda: dst.copy_(src),
        "linear": linear_layers(engine, rows),
        "gemm": lambda: a @ b,
    }
    med = interleaved_medians(arms, runs)
    return Bandwidth(
        nbytes, nbytes / med["read"] / 1e6, nbytes / med["copy"] / 1e6, rows, med["linear"],
        linear_flops(engine, rows), 2 * GEMM_SIZE**3 / med["gemm"] / 1e6,
    )  # fmt: skip


def key_bytes_per_token(engine: Engine, kv: tuple) -> int:  # type: ignore[type-arg]
    """Bytes of one token's keys (the rotated slot) over all layers."""
    if engine.layout is None or not kv:
        return 0
    n = kv[0][engine.layout.slot].shape[-2]
    return sum(
        layer[engine.layout.slot].numel() * layer[engine.layout.slot].element_size() for layer in kv
    ) // max(n, 1)
