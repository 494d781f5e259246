"""A linear layer on a few rows, reading oneDNN's packed weight in place, in C
(``csrc/linear_kernel.c``, which says how).

A decode step or a splice's pass multiplies a handful of rows by every weight: one read of
the weights, which this kernel makes at memory speed, with fp32 sums, where oneDNN's packed
product does not. :func:`packed_view` reads a packed buffer under the kernel's layout, and
``PackedLinear`` uses the kernel for a layer only where that view equals the weight bitwise.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from leyline.engine.cpu import kernel_build
from leyline.engine.cpu.kernel_build import KernelStatus

__all__ = [
    "AMX_ROWS",
    "BLOCKS",
    "DirectLinear",
    "KernelStatus",
    "LinearKernel",
    "load",
    "packed_block",
    "packed_view",
    "status",
]

BLOCKS = (64, 32)
"""Output columns per packed block that the kernel reads, tried in this order."""
FEW_ROWS = 8
"""Most rows a product sends to the kernel: faster than oneDNN's up to here in both dtypes
(``bench_packed_linear``, docs/perf.md)."""
F32_ROWS = 32
"""Most rows an fp32 product sends to the kernel: from 9 rows it ties oneDNN's, and a layer
whose products all run here runs fused (``layer_kernel``), which is faster (docs/perf.md)."""
BF16_DOT_ROWS = 32
"""The same for bf16 where the kernel runs on the CPU's bf16 dot product (faster than
oneDNN's there, docs/perf.md). Not on oneDNN's AMX packing (blocks
of 32 columns): there oneDNN's tile products are as fast as the dot product from about 8
rows, so the kernel takes them on the tile unit itself (:data:`AMX_ROWS`), or, built
without it, stops at :data:`FEW_ROWS`."""
AMX_BLOCK = 32
"""The block width of oneDNN's bf16 packing for AMX, which the kernel's tile path reads."""
AMX_ROWS = 32
"""Most rows a bf16 product on that packing sends to the kernel, where it runs them on the
tile unit (every row count, one included), where it beats oneDNN's product (docs/perf.md)."""
_MIN_COLUMNS_PER_THREAD = 256
"""A layer with fewer output columns per thread runs on fewer threads (a fork costs more)."""


def _k_pad(packed: torch.Tensor, out_features: int, in_features: int, block: int) -> int | None:
    """Reduction entries per block if the buffer's size fits blocks of ``block`` columns."""
    pair = 2 if packed.dtype == torch.bfloat16 else 1
    blocks = -(-out_features // block)
    count, rest = divmod(int(torch.ops.mkldnn._nbytes(packed)), packed.dtype.itemsize)
    k_pad = count // (blocks * block)
    if rest or k_pad * blocks * block != count or k_pad < in_features or k_pad % pair:
        return None
    return k_pad


def packed_view(
    packed: torch.Tensor, out_features: int, in_features: int, block: int = BLOCKS[0]
) -> torch.Tensor | None:
    """The ``[out, in]`` weight a packed buffer holds under this kernel's layout with blocks
    of ``block`` columns (a new tensor: the blocks are gathered), or None when the buffer's
    size cannot be that layout."""
    k_pad = _k_pad(packed, out_features, in_features, block)
    if k_pad is None:
        return None
    pair = 2 if packed.dtype == torch.bfloat16 else 1
    nbytes = int(torch.ops.mkldnn._nbytes(packed))
    raw = (ctypes.c_char * nbytes).from_address(int(torch.ops.mkldnn.data_ptr(packed)))
    flat = torch.frombuffer(raw, dtype=packed.dtype)  # shares the packed memory: read only
    blocks = -(-out_features // block)
    tiles = flat.view(blocks, k_pad // pair, block, pair).permute(0, 2, 1, 3)
    return tiles.reshape(blocks * block, k_pad)[:out_features, :in_features]


def packed_block(packed: torch.Tensor, weight: torch.Tensor) -> int | None:
    """The block width (of :data:`BLOCKS`) under which ``packed`` holds ``weight`` bitwise,
    or None when it holds it under none of them."""
    out_features, in_features = weight.shape
    for block in BLOCKS:
        view = packed_view(packed, out_features, in_features, block)
        if view is not None and torch.equal(view, weight):
            return block
    return None


class DirectLinear:
    """One packed layer bound to the kernel: its arguments worked out once, so that a call
    costs one allocation and one foreign call (a decode step makes 211 of them)."""

    __slots__ = ("_bf16", "_bias", "_block", "_fn", "_in", "_k_pad", "_out", "_ptr",
                 "_threads", "amx_rows", "max_rows", "packed")  # fmt: skip

    def __init__(
        self,
        fn: Callable[..., int],
        packed: torch.Tensor,
        k_pad: int,
        out_features: int,
        in_features: int,
        bias: torch.Tensor | None,
        threads: int,
        max_rows: int = FEW_ROWS,
        block: int = BLOCKS[0],
        amx_rows: int = 0,
    ) -> None:
        self.packed = packed  # keeps the buffer alive
        self.max_rows = max_rows
        """Most rows worth sending here rather than to oneDNN."""
        self._fn, self._ptr, self._k_pad = fn, int(torch.ops.mkldnn.data_ptr(packed)), k_pad
        self._out, self._in, self._threads = out_features, in_features, threads
        self._bias = None if bias is None else bias.contiguous()
        self._bf16 = int(packed.dtype == torch.bfloat16)
        self._block = block
        self.amx_rows = amx_rows
        """Products of at least this many rows run on the tile unit (0: never)."""

    @property
    def block(self) -> int:
        """Output columns per block of the packed layout it reads."""
        return self._block

    @property
    def k_pad(self) -> int:
        """Reduction entries per block (the input width, padded)."""
        return self._k_pad

    @property
    def bias(self) -> torch.Tensor | None:
        """The bias the kernel adds (contiguous), or None."""
        return self._bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in] @ Wᵀ + bias``; ``x`` contiguous, in the weight's dtype."""
        rows = x.numel() // self._in
        y = torch.empty((*x.shape[:-1], self._out), dtype=x.dtype)
        threads = max(1, min(torch.get_num_threads(), self._threads))
        rc = self._fn(
            self._ptr, self._out, self._in, self._k_pad, x.data_ptr(), rows, self._in,
            None if self._bias is None else self._bias.data_ptr(), y.data_ptr(), self._out,
            self._bf16, threads, self._block, self.amx_rows,
        )  # fmt: skip
        if rc == -1:
            raise MemoryError("linear kernel: no memory for the widened rows")
        if rc != 0:
            raise ValueError(f"linear kernel: no {self._block}-column blocks (rc {rc})")
        return y


class LinearKernel(kernel_build.Library):
    """The loaded shared library."""

    def setup(self, lib: ctypes.CDLL) -> None:
        self._fn = kernel_build.bind(lib, "leyline_packed_linear", "pqqqpqqppq iiii")
        self.bf16_dot = bool(lib.leyline_linear_bf16_dot())
        """bf16 products run on the CPU's bf16 dot product (AVX512_BF16)."""
        self.amx = bool(lib.leyline_linear_amx_ready())
        """bf16 products on oneDNN's AMX packing may run on the tile unit (built with AMX,
        and the OS lets this process use it)."""

    def bind(
        self, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> DirectLinear | None:
        """The layer ``packed`` (oneDNN's packing of ``weight``, ``[out, in]``) bound to the
        kernel, or None when the buffer does not hold ``weight`` bitwise under this
        kernel's layout with any block width of :data:`BLOCKS` (then only oneDNN may read
        it)."""
        if packed.dtype not in (torch.float32, torch.bfloat16) or weight.dtype != packed.dtype:
            return None
        out_features, in_features = weight.shape
        block = packed_block(packed, weight)
        k_pad = None if block is None else _k_pad(packed, out_features, in_features, block)
        if block is None or k_pad is None:
            return None
        threads = out_features // _MIN_COLUMNS_PER_THREAD if self.threaded else 1
        bf16 = packed.dtype == torch.bfloat16
        tiles = bf16 and self.amx and block == AMX_BLOCK
        dot = bf16 and self.bf16_dot and block == BLOCKS[0]
        rows = AMX_ROWS if tiles else BF16_DOT_ROWS if dot else FEW_ROWS if bf16 else F32_ROWS
        return DirectLinear(
            self._fn, packed, k_pad, out_features, in_features, bias, threads, rows, block,
            amx_rows=1 if tiles else 0,
        )  # fmt: skip


def _flags(openmp: bool) -> list[str]:
    flags = [*kernel_build.base_flags(openmp), "-ffp-contract=fast"]
    if "-mavx512f" in flags and "avx512_bf16" in kernel_build.cpu_flags():
        flags.append("-mavx512bf16")  # bf16 products on the CPU's bf16 dot product
    return flags + kernel_build.amx_flags(flags)  # bf16 products on the tile unit


_kernel = kernel_build.LazyKernel("linear_kernel", _flags, LinearKernel)
load = _kernel.load
"""The kernel, compiled and loaded on first use (once per process); None if unusable."""
status = _kernel.status
"""Whether :func:`load` finds a kernel, and the library's path or the reason."""
