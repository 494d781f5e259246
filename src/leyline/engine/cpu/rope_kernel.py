"""The delta rotation of cached keys (``rope.rotate_into``) as one fused loop in C
(``csrc/rope_kernel.c``), at memory speed where eager torch takes three passes.

:meth:`RopeKernel.move` also shifts rows inside one buffer, source and destination
overlapping (an in-place edit's kept runs). Both arithmetic orders the eager path can take
are built in (``fused``); ``rope._kernel_mode`` picks the one that matches it bitwise.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from leyline.engine.cpu import kernel_build
from leyline.engine.cpu.kernel_build import KernelStatus

__all__ = ["KernelStatus", "RopeKernel", "describe", "describe_move", "load", "status"]

MAX_HALF = 512
"""Widest band the kernel takes: 1024 dims (rows are staged on the stack in bf16)."""
_MIN_BYTES_PER_THREAD = 1 << 18

MAX_BANDS = 256
"""Most bands one call takes."""

Band = tuple[int, ...]
"""What the kernel reads for one band, 11 ints: src and dst addresses, then 3 row-dim
sizes, their src strides and their dst strides (elements, outermost first)."""


class RopeKernel(kernel_build.Library):
    """The loaded shared library."""

    def setup(self, lib: ctypes.CDLL) -> None:
        # (descriptors, band count, cos, sin, then int32 arguments) -> int32
        self._fn = kernel_build.bind(lib, "leyline_rope_rotate", "pqpp iiiii")
        self._move = kernel_build.bind(lib, "leyline_rope_move", "pqpp iiiiiiii")

    def run(
        self,
        bands: Sequence[Band],
        cos: torch.Tensor,
        sin: torch.Tensor,
        *,
        bf16: bool,
        interleaved: bool,
        fused: bool,
        nbytes: int,
    ) -> None:
        """Rotate every band (from :func:`describe`; all of one dtype and width) in one
        call, split over up to ``torch.get_num_threads()`` threads by ``nbytes`` of work.
        ``cos``/``sin``: contiguous fp32 CPU tensors, one value per pair."""
        if not bands:
            return
        half = _check_cos_sin(cos, sin)
        if len(bands) > MAX_BANDS:
            raise ValueError(f"at most {MAX_BANDS} bands per call")
        desc = (ctypes.c_int64 * (11 * len(bands)))(*(v for band in bands for v in band))
        threads = max(1, min(torch.get_num_threads(), nbytes // _MIN_BYTES_PER_THREAD))
        rc = self._fn(
            desc,
            len(bands),
            cos.data_ptr(),
            sin.data_ptr(),
            half,
            int(bf16),
            int(interleaved),
            int(fused),
            threads,
        )
        if rc != 0:
            raise ValueError(f"rope kernel refused its arguments (rc={rc})")

    def move(
        self,
        bands: Sequence[Band],
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        *,
        dim: int,
        offset: int,
        bf16: bool,
        interleaved: bool = False,
        fused: bool = False,
        nbytes: int,
    ) -> None:
        """Move every band's rows (from :func:`describe_move`; all of one dtype and row
        width ``dim``) inside their buffers in one call, over up to
        ``torch.get_num_threads()`` threads: the band ``[offset, offset + 2·len(cos))`` of
        each row rotated, the rest copied bitwise; ``cos`` None moves the rows bitwise."""
        if not bands:
            return
        if len(bands) > MAX_BANDS:
            raise ValueError(f"at most {MAX_BANDS} bands per call")
        half = 0 if cos is None else _check_cos_sin(cos, sin)
        desc = (ctypes.c_int64 * (11 * len(bands)))(*(v for band in bands for v in band))
        threads = max(1, min(torch.get_num_threads(), nbytes // _MIN_BYTES_PER_THREAD))
        rc = self._move(
            desc,
            len(bands),
            0 if cos is None else cos.data_ptr(),
            0 if sin is None else sin.data_ptr(),
            half,
            dim,
            offset,
            int(bf16),
            int(interleaved),
            int(fused),
            int(cos is not None),
            threads,
        )
        if rc != 0:
            raise ValueError(f"rope kernel refused its arguments (rc={rc})")

    def rotate(
        self,
        pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
        cos: torch.Tensor,
        sin: torch.Tensor,
        *,
        interleaved: bool,
        fused: bool,
    ) -> None:
        """``dst <- src`` rotated for each ``(dst, src)`` band (all of one dtype, width
        ``2·len(cos)``); raises ``ValueError`` for a band :func:`describe` refuses."""
        bands: list[Band] = []
        for dst, src in pairs:
            band = describe(dst, src)
            if band is None or src.shape[-1] != 2 * cos.numel() or src.dtype != pairs[0][1].dtype:
                raise ValueError("band not eligible for the fused rotation")
            bands.append(band)
        self.run(
            bands,
            cos,
            sin,
            bf16=bool(pairs) and pairs[0][1].dtype == torch.bfloat16,
            interleaved=interleaved,
            fused=fused,
            nbytes=sum(src.numel() * src.element_size() for _, src in pairs),
        )


def _check_cos_sin(cos: torch.Tensor, sin: torch.Tensor | None) -> int:
    """The pair count of a valid cos/sin (contiguous fp32 CPU tensors of one value per pair)."""
    half = cos.numel()
    for t in (cos, sin):
        if t is None or t.dtype != torch.float32 or not t.is_contiguous() or t.numel() != half:
            raise ValueError("cos/sin must be contiguous fp32, one value per pair")
        if t.device.type != "cpu":
            raise ValueError("cos/sin must be on the CPU")
    return half


def _outer(
    shape: Sequence[int], src_strides: Sequence[int], dst_strides: Sequence[int]
) -> list[int] | None:
    """The row dims (all but the last) as 3 sizes, 3 src strides, 3 dst strides, outermost
    first: size-1 dims dropped, adjacent dims merged where both strides allow, padded with
    size-1 dims; None when more than 3 remain."""
    sizes: list[int] = []
    ss: list[int] = []
    ds: list[int] = []
    for i in range(len(shape) - 1):
        n = shape[i]
        if n == 1:
            continue
        if sizes and ss[-1] == n * src_strides[i] and ds[-1] == n * dst_strides[i]:
            sizes[-1] *= n
            ss[-1], ds[-1] = src_strides[i], dst_strides[i]
        else:
            sizes.append(n)
            ss.append(src_strides[i])
            ds.append(dst_strides[i])
    pad = 3 - len(sizes)
    if pad < 0:
        return None
    return [1] * pad + sizes + [0] * pad + ss + [0] * pad + ds


def describe(dst: torch.Tensor, src: torch.Tensor, *, disjoint: bool = False) -> Band | None:
    """The kernel's description of rotating ``src``'s band into ``dst``'s, or None when the
    kernel cannot: it needs the same shape, CPU, fp32 or bf16 (both the same), unit stride
    on the last dim (an even width of at most ``2·MAX_HALF``), at most 3 row dims once
    merged, and separate storages (it never rotates in place), unless the caller vouches
    (``disjoint``) that the two views share no element though they share a storage."""
    shape = src.shape
    if (
        not src.is_cpu
        or not dst.is_cpu
        or src.dtype not in (torch.float32, torch.bfloat16)
        or dst.dtype != src.dtype
        or dst.shape != shape
        or len(shape) == 0
        or shape[-1] % 2
        or not 0 < shape[-1] <= 2 * MAX_HALF
        or src.numel() == 0
    ):
        return None
    s_st, d_st = src.stride(), dst.stride()
    if s_st[-1] != 1 or d_st[-1] != 1:
        return None
    if not disjoint and src.untyped_storage().data_ptr() == dst.untyped_storage().data_ptr():
        return None
    outer = _outer(shape, s_st, d_st)
    if outer is None:
        return None
    return (src.data_ptr(), dst.data_ptr(), *outer)


def describe_move(dst: torch.Tensor, src: torch.Tensor) -> Band | None:
    """The kernel's description of moving ``src``'s rows to ``dst``'s inside one buffer
    (:meth:`RopeKernel.move`), or None when the kernel cannot: two views of one CPU storage
    (fp32 or bf16) with the same shape and strides, whole rows (unit stride on the last dim),
    at most 3 row dims once merged, ``dst`` shifted from ``src`` by a whole number of rows
    along the innermost row dim, and every outer slice's reach (its rows at both places)
    clear of the next slice's, so threads can take slices apart."""
    shape, strides = src.shape, src.stride()
    if (
        not src.is_cpu
        or src.dtype not in (torch.float32, torch.bfloat16)
        or dst.dtype != src.dtype
        or dst.shape != shape
        or dst.stride() != strides
        or len(shape) < 2
        or src.numel() == 0
        or strides[-1] != 1
        or any(st <= 0 for st in strides)
        or src.untyped_storage().data_ptr() != dst.untyped_storage().data_ptr()
    ):
        return None
    outer = _outer(shape, strides, strides)
    if outer is None:
        return None
    sizes, st = outer[0:3], outer[3:6]
    shift, rem = divmod(dst.data_ptr() - src.data_ptr(), src.element_size())
    if sizes[2] == 1:  # one row: apart if the shift clears it
        if rem or abs(shift) < shape[-1]:
            return None
    elif rem or shift == 0 or shift % st[2] or st[2] < shape[-1]:
        return None
    reach = (sizes[2] - 1) * st[2] + shape[-1] + abs(shift)
    if sizes[1] > 1 and reach > st[1]:
        return None
    if sizes[0] > 1 and (sizes[1] - 1) * st[1] + reach > st[0]:
        return None
    return (src.data_ptr(), dst.data_ptr(), *outer)


def _flags(openmp: bool) -> list[str]:
    flags = [*kernel_build.base_flags(openmp), "-ffp-contract=off"]
    if "-mavx512f" in flags:
        # AVX-512 instructions at 256 bits by default (fp32 rows ran faster so); the bf16
        # rows opt into 512 bits in the source (docs/perf.md).
        flags.append("-mprefer-vector-width=256")
    return flags


_kernel = kernel_build.LazyKernel("rope_kernel", _flags, RopeKernel)
load = _kernel.load
"""The kernel, compiled and loaded on first use (once per process); None if unusable."""
status = _kernel.status
"""Whether :func:`load` finds a kernel, and the library's path or the reason."""
