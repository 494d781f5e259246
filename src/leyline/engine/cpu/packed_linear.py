"""Linear layers on oneDNN's prepacked weights: the matrix products of a CPU forward.

:func:`pack_linear_layers` swaps every ``nn.Linear`` of a CPU model in fp32 or bf16 for a
:class:`PackedLinear` holding only the weight reordered once into oneDNN's blocked layout
(what torch's CPU inductor does for frozen weights), faster at every row count measured
(docs/perf.md); products of few rows read the same buffer with ``linear_kernel``. Results
are the plain product's within fp32 rounding. It packs by default where torch runs AVX-512
kernels (measured slower on AVX2); ``switches.override(packed_linear="on")`` packs wherever
oneDNN takes the dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from leyline.engine.cpu import linear_kernel, switches
from leyline.engine.cpu.linear_kernel import DirectLinear, LinearKernel

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
    setting = switches.setting("packed_linear")
    if setting == "off":
        return switches.refusal("packed_linear")
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
    if setting != "on" and torch.backends.cpu.get_cpu_capability() != "AVX512":
        return "measured faster on AVX-512 CPUs only"
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
