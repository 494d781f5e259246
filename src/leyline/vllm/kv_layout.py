"""Rows of vLLM's per-layer KV cache tensor, addressed by (block, offset).

vLLM's CPU attention allocates ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``
per layer, but its write op packs a block differently per ISA (the "vec" one stores K
transposed, then V row-major). So nothing here assumes a packing: ``calibrate`` writes
coded rows with the backend's own cache write into a scratch block and reads back where
each (token, head, dim) of K and of V landed. Every later read and write is an index
into a block's elements through those maps.

A layout the calibration cannot decode (values transformed, e.g. a quantized cache;
writes outside the addressed block; lost or duplicated elements) is refused with
``unsupported_layout``. No vLLM import: the write op is passed in.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from leyline.core.errors import SpliceUnsupportedError
from leyline.engine.rope import rotate_into
from leyline.engine.rope_band import RopeBand
from leyline.protocol.fallback import FallbackReason

CacheWrite = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
"""``write(key, value, kv_cache, slot_mapping)``: rows ``[n, heads, head_size]`` into one
layer's tensor at slots ``block * block_size + offset`` (int64 ``[n]``), as the forward does."""

# Small integers are exact in each of these; quantized caches are refused before decoding.
_ROTATABLE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_DIGIT_BASE = 16


def backend_cache_write(layer: Any) -> CacheWrite:
    """The attention layer's own cache write (``layer.impl.do_kv_cache_update``, which reads
    the layer's ISA and scales), the op vLLM's forward writes new tokens with."""
    return functools.partial(layer.impl.do_kv_cache_update, layer)


def _refuse(message: str) -> SpliceUnsupportedError:
    return SpliceUnsupportedError(FallbackReason.unsupported_layout, message)


@dataclass(frozen=True, slots=True)
class RowShape:
    """What one cached token holds, from the layer's KV cache spec."""

    block_size: int
    num_kv_heads: int
    head_size: int


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Where a block's rows live inside its elements (dims after the block dim)."""

    rows: RowShape
    block_shape: tuple[int, ...]
    """One block's shape in the layer tensor (every dim after the first)."""
    keys: torch.Tensor
    """int64 ``[block_size, heads, head_size]``: the element of a block holding K."""
    values: torch.Tensor
    """int64, the same for V."""

    def _per_block(self, cache: torch.Tensor) -> torch.Tensor:
        """``cache`` as ``[num_blocks, elements]``, a view (never a copy) so writes land."""
        if tuple(cache.shape[1:]) != self.block_shape:
            raise _refuse(
                f"KV tensor blocks are {tuple(cache.shape[1:])}, calibrated on {self.block_shape}"
            )
        try:
            return cache.view(cache.shape[0], -1)
        except RuntimeError as exc:
            raise _refuse(f"a block of the KV tensor is not contiguous: {exc}") from exc

    def gather(
        self, cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of K and V (each ``[n, heads, head_size]``) at ``(blocks[i], offsets[i])``."""
        flat, at = self._per_block(cache), blocks.view(-1, 1, 1)
        return flat[at, self.keys[offsets]], flat[at, self.values[offsets]]

    def scatter(
        self,
        cache: torch.Tensor,
        blocks: torch.Tensor,
        offsets: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
    ) -> None:
        """Write rows ``[n, heads, head_size]`` at ``(blocks[i], offsets[i])``, exactly where
        the backend's write op would have put them."""
        flat, at = self._per_block(cache), blocks.view(-1, 1, 1)
        flat[at, self.keys[offsets]] = keys.to(cache.dtype)
        flat[at, self.values[offsets]] = values.to(cache.dtype)


def shift_keys(keys: torch.Tensor, shifts: torch.Tensor, band: RopeBand) -> torch.Tensor:
    """``keys`` ``[n, heads, head_size]`` with row ``i`` moved by ``shifts[i]`` positions: the
    leading ``band.width`` dims of each head (where vLLM's rotary embedding puts the band)
    rotated by ``leyline.engine.rope``, the rest copied bitwise."""
    out = keys.clone()
    for shift in torch.unique(shifts).tolist():
        if shift != 0:
            rows = (shifts == shift).nonzero().squeeze(1)
            moved = keys[rows]
            out[rows] = rotate_into(
                torch.empty_like(moved), moved, int(shift), band.inv_freq, band.pairing
            )
    return out


def _write_or_refuse(
    write: CacheWrite, key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor
) -> None:
    slots = torch.arange(key.shape[0], 2 * key.shape[0], device=cache.device)
    try:
        write(key, value, cache, slots)
    except Exception as exc:  # any failure of a foreign op means: cannot calibrate
        raise _refuse(f"the attention backend's cache write failed: {exc!r}") from exc
    if bool(cache[0].any()):
        raise _refuse("the cache write touched a block it was not addressed to")


def _decoded_codes(
    write: CacheWrite, codes: torch.Tensor, scratch: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write ``codes`` (int64 ``[2, block_size, heads, head_size]``, K then V) one base-16
    digit per pass into block 1 of ``scratch``; returns (positions written, their codes)."""
    total = codes.numel()
    passes = 1
    while _DIGIT_BASE**passes < total:
        passes += 1
    found = torch.zeros(scratch[1].numel(), dtype=torch.int64, device=scratch.device)
    written: torch.Tensor | None = None
    for n in range(passes):
        digit = (codes // _DIGIT_BASE**n % _DIGIT_BASE + 1).to(scratch.dtype)
        scratch.zero_()
        _write_or_refuse(write, digit[0], digit[1], scratch)
        got = scratch[1].flatten().double()
        if written is None:
            written = got != 0
        exact = (got == got.round()) & (got >= 1) & (got <= _DIGIT_BASE)
        if not bool(torch.all(exact[written])) or bool(got[~written].any()):
            raise _refuse("the cache write stores values other than the rows it was given")
        found += (got.long() - 1).clamp(min=0) * _DIGIT_BASE**n
    assert written is not None
    positions = written.nonzero().squeeze(1)
    return positions, found[positions]


def calibrate(write: CacheWrite, like: torch.Tensor, rows: RowShape) -> KVLayout:
    """Learn where ``write`` puts each element of K and V inside a block of a tensor shaped
    like ``like`` (one layer's KV cache), checked by a bitwise round trip of random rows.

    Raises:
        SpliceUnsupportedError: ``unsupported_layout`` when the layout cannot be decoded.
    """
    if like.dtype not in _ROTATABLE_DTYPES:
        raise _refuse(f"a {like.dtype} KV cache is quantized: its keys cannot be rotated")
    bs, heads, dim = rows.block_size, rows.num_kv_heads, rows.head_size
    scratch = like.new_zeros((2, *like.shape[1:]))
    codes = torch.arange(2 * bs * heads * dim, device=like.device).view(2, bs, heads, dim)
    positions, decoded = _decoded_codes(write, codes, scratch)
    if not torch.equal(decoded.sort().values, codes.flatten()):
        raise _refuse("the cache write loses or duplicates elements of a block")
    where = torch.empty_like(positions)
    where[decoded] = positions
    where = where.view(2, bs, heads, dim)
    layout = KVLayout(rows, tuple(like.shape[1:]), where[0], where[1])
    _check_round_trip(write, layout, scratch)
    return layout


def _check_round_trip(write: CacheWrite, layout: KVLayout, scratch: torch.Tensor) -> None:
    rows = layout.rows
    generator = torch.Generator().manual_seed(0)
    shape = (rows.block_size, rows.num_kv_heads, rows.head_size)
    key, value = (torch.randn(shape, generator=generator).to(scratch) for _ in range(2))
    scratch.zero_()
    _write_or_refuse(write, key, value, scratch)
    blocks = torch.ones(rows.block_size, dtype=torch.int64, device=scratch.device)
    offsets = torch.arange(rows.block_size, device=scratch.device)
    got_key, got_value = layout.gather(scratch, blocks, offsets)
    if not (torch.equal(got_key, key) and torch.equal(got_value, value)):
        raise _refuse("rows read through the calibrated layout differ from those written")
