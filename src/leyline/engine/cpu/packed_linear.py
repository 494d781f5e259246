"""Linear layers on oneDNN's prepacked weights: the matrix products of a CPU forward.

A forward of a few tokens is one matrix product per linear layer with 1 to a few dozen
rows. torch's default CPU path (``F.linear`` on a row-major weight) streams the weights at
about 9 GB/s for one row on this machine, against 25-33 GB/s for a plain read, and reaches
about 45 GFLOP/s for 17 rows. The same products on a weight reordered once into oneDNN's
blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, what torch's own CPU inductor
uses for frozen weights) run 1.3-2x faster at every row count measured, prefill chunks of
512 rows included (``docs/perf.md``, "Linear layers on packed weights"). Products of at most
:data:`KERNEL_MAX_ROWS` rows or a few dozen (a decode step, a batched decode of a few
sessions, a delete's last token, a splice's pass) read the same packed buffer with
``linear_kernel`` instead, at memory speed.

:func:`pack_linear_layers` swaps every ``nn.Linear`` of a CPU model in fp32 or bf16 for a
:class:`PackedLinear` holding only the packed weight: no second copy of the weights stays
behind, except for an output head tied to the input embedding (the embedding keeps the
shared matrix, the head packs its own copy). The results are the plain product's within
fp32 rounding (a different summation order); ``tests/engine/test_packed_linear.py``
checks them against fp64.

Where it packs: measured faster on an AVX-512 CPU (AMD EPYC, Zen 4 class), so by default it
packs where torch reports AVX-512 kernels; on an AVX2-only CPU an earlier oneDNN path
(``torch.utils.mkldnn``) was measured slower than the default on these shapes, so it stays
off there unless forced. ``LEYLINE_PACKED_LINEAR=1`` packs wherever oneDNN takes the dtype,
``=0`` never packs (for A/B runs, or where oneDNN misbehaves).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from leyline.engine.cpu import linear_kernel
from leyline.engine.cpu.linear_kernel import DirectLinear, LinearKernel

SWITCH = "LEYLINE_PACKED_LINEAR"
ROWS_HINT = 64
"""The row count oneDNN is told to expect when it picks the packed layout; measured best
or tied for 1-512 rows on this machine (``src/leyline/evals/bench_packed_linear.py``)."""
KERNEL_MAX_ROWS = linear_kernel.FEW_ROWS
"""Most rows a bf16 product sends to ``linear_kernel`` where the CPU has neither a bf16 dot
product nor the tile unit (``linear_kernel.FEW_ROWS``). Elsewhere more, a splice's one pass
of 17 rows included: fp32 up to ``linear_kernel.F32_ROWS``, bf16 up to
``linear_kernel.BF16_DOT_ROWS`` (dot product) or ``linear_kernel.AMX_ROWS`` (tile unit)."""


class PackedLinear(nn.Module):
    """``y = x Wᵀ + b`` with ``W`` held in oneDNN's packed layout (inference only)."""

    def __init__(
        self,
        linear: nn.Linear,
        rows_hint: int = ROWS_HINT,
        kernel: LinearKernel | None = None,
    ) -> None:
        """``kernel``: run products of few rows on it (``DirectLinear.max_rows``), when the
        packed buffer has its layout (checked bitwise here)."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.dtype = weight.dtype
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows_hint)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), False)
        self.direct: DirectLinear | None = (
            None if kernel is None else kernel.bind(self.packed, weight, self.bias)
        )
        self.kernel_rows = 0 if self.direct is None else self.direct.max_rows
        """Most rows a product sends to the kernel (0: none)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.dtype:
            raise TypeError(f"PackedLinear holds {self.dtype} weights, got {x.dtype} input")
        if (
            self.direct is not None
            and x.shape[-1] == self.in_features  # else oneDNN's product says what is wrong
            and x.numel() <= self.kernel_rows * self.in_features
            and x.is_contiguous()
        ):
            return self.direct(x)
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x, self.packed, self.bias, "none", [], ""
        )
        return out

    @property
    def weight(self) -> torch.Tensor:
        """The weight in its plain layout (a fresh copy: for inspection, not the hot path)."""
        dense: torch.Tensor = self.packed.to_dense()
        return dense

    def extra_repr(self) -> str:
        kernel = f", rows <= {self.kernel_rows} on linear_kernel" * (self.direct is not None)
        shape = f"in={self.in_features}, out={self.out_features}, {self.dtype}"
        return f"{shape}, oneDNN-packed{kernel}"


def linear_weight_bytes(model: nn.Module) -> int:
    """Bytes of every linear layer's weight, packed or not (the output head included, tied
    or not): what a forward of a few tokens streams."""
    total = 0
    for m in model.modules():
        if isinstance(m, nn.Linear):
            total += m.weight.numel() * m.weight.element_size()
        elif isinstance(m, PackedLinear):
            total += m.in_features * m.out_features * m.dtype.itemsize
    return total


@dataclass(frozen=True, slots=True)
class PackReport:
    """What :func:`pack_linear_layers` did, for ``leyline info`` and benchmarks."""

    packed: int
    reason: str
    """Why nothing was packed (empty when some layers were)."""
    direct: int = 0
    """Packed layers whose few-row products run on ``linear_kernel``."""
    kernel: str = ""
    """The kernel's library, or why it is not used."""
    tiles: int = 0
    """Of those, layers whose products run on the CPU's tile unit (AMX)."""

    def describe(self) -> str:
        """One line for logs and benchmark headers."""
        if not self.packed:
            return f"linear layers unpacked ({self.reason})"
        few = f", {self.direct} with few-row products on linear_kernel" if self.direct else ""
        tiles = f" ({self.tiles} on the tile unit)" if self.tiles else ""
        return f"{self.packed} linear layers on oneDNN-packed weights{few}{tiles}"


def packing_refusal(model: nn.Module) -> str:
    """Why this model's linear layers stay on torch's default path; empty if they can pack."""
    switch = os.environ.get(SWITCH, "").strip()
    if switch == "0":
        return f"{SWITCH}=0"
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return "torch was built without oneDNN"
    params = list(model.parameters())
    if not params or params[0].device.type != "cpu":
        return "the model is not on the CPU"
    dtype = params[0].dtype
    if dtype not in (torch.float32, torch.bfloat16):
        return f"{dtype} weights"
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "this CPU has no native bf16 products for oneDNN"
    if switch != "1" and torch.backends.cpu.get_cpu_capability() != "AVX512":
        return f"measured faster on AVX-512 CPUs only; {SWITCH}=1 packs here too"
    return ""


@torch.no_grad()
def pack_linear_layers(model: nn.Module, rows_hint: int = ROWS_HINT) -> PackReport:
    """Replace every ``nn.Linear`` of ``model`` by a :class:`PackedLinear`, in place."""
    reason = packing_refusal(model)
    if reason:
        return PackReport(0, reason)
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
    ]
    kernel = linear_kernel.load()
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child, rows_hint, kernel))
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]  # earlier calls too
    direct = sum(m.direct is not None for m in layers)
    tiles = sum(m.direct is not None and m.direct.amx_rows > 0 for m in layers)
    reason = "" if layers else "no nn.Linear layers"
    return PackReport(len(layers), reason, direct, linear_kernel.status().detail, tiles)
