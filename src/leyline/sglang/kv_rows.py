"""Copy KV rows of SGLang's token pools between slots, the rope band rotated by delta.

Two pool layouts, read from the real pool objects:

* ``MLATokenToKVPool``: per layer ``kv_buffer[l]`` of shape ``[size + page, 1, r + dr]``,
  the latent (``r = kv_lora_rank``) first and the rope band (``dr = qk_rope_head_dim``)
  last, stored already rotated. Only the band moves; the latent is copied bitwise.
* ``MHATokenToKVPool`` (MHA/GQA): ``k_buffer[l]`` / ``v_buffer[l]`` of shape
  ``[size + page, heads, head_dim]``; SGLang rotates the first ``rotary_dim`` dims of each
  key head. Values are copied bitwise.

The rotation is ``leyline.engine.rope.rotate_into``: fp32 math (angles in fp64),
cast back to the storage dtype, no attention scaling (YaRN's mscale is already in the key).
Other pools (fp8 storage, DSA, SWA/hybrid, quantized) are refused: ``unsupported_layout``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Protocol

import torch

from leyline.core.errors import SpliceUnsupportedError
from leyline.engine.rope import rotate_into
from leyline.engine.rope_band import RopeBand
from leyline.protocol.fallback import FallbackReason

Layout = Literal["mla", "gqa"]


class KVRows(Protocol):
    """Row operations on one pool; slots are int64 index tensors of equal length."""

    layout: Layout

    def copy(self, src: torch.Tensor, dst: torch.Tensor, delta: int) -> None:
        """Write rows ``src`` into ``dst``, the rope band rotated by ``delta``."""

    def write(self, dst: torch.Tensor, rows: Sequence[Sequence[torch.Tensor]]) -> None:
        """Write caller-computed rows (per layer, the pool's tensors) into ``dst``."""

    def read(self, slots: torch.Tensor) -> list[list[torch.Tensor]]:
        """Copies of the rows at ``slots``: per layer, the pool's tensors."""


def _rotated_rows(rows: torch.Tensor, delta: int, band: RopeBand, offset: int) -> torch.Tensor:
    if delta == 0:
        return rows
    return rotate_into(
        torch.empty_like(rows), rows, delta, band.inv_freq, band.pairing, offset=offset
    )


class MlaRows:
    layout: Layout = "mla"

    def __init__(self, buffers: Sequence[torch.Tensor], kv_lora_rank: int, band: RopeBand) -> None:
        dim = int(buffers[0].shape[-1])
        if kv_lora_rank + band.width != dim:
            raise SpliceUnsupportedError(
                FallbackReason.unsupported_layout,
                f"MLA rows are {dim} wide; latent {kv_lora_rank} + rope band {band.width} "
                "does not fill them",
            )
        self.buffers = list(buffers)
        self.kv_lora_rank = kv_lora_rank
        self.band = band

    def copy(self, src: torch.Tensor, dst: torch.Tensor, delta: int) -> None:
        for buf in self.buffers:
            buf[dst] = _rotated_rows(buf[src], delta, self.band, self.kv_lora_rank)

    def write(self, dst: torch.Tensor, rows: Sequence[Sequence[torch.Tensor]]) -> None:
        for buf, (layer_rows,) in zip(self.buffers, rows, strict=True):
            buf[dst] = layer_rows.to(buf.dtype)

    def read(self, slots: torch.Tensor) -> list[list[torch.Tensor]]:
        return [[buf[slots].clone()] for buf in self.buffers]


class GqaRows:
    layout: Layout = "gqa"

    def __init__(
        self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], band: RopeBand
    ) -> None:
        if band.width > int(keys[0].shape[-1]):
            raise SpliceUnsupportedError(
                FallbackReason.unsupported_layout,
                f"rotary dim {band.width} exceeds the key head dim {keys[0].shape[-1]}",
            )
        self.keys, self.values, self.band = list(keys), list(values), band

    def copy(self, src: torch.Tensor, dst: torch.Tensor, delta: int) -> None:
        for k, v in zip(self.keys, self.values, strict=True):
            k[dst] = _rotated_rows(k[src], delta, self.band, 0)
            v[dst] = v[src]

    def write(self, dst: torch.Tensor, rows: Sequence[Sequence[torch.Tensor]]) -> None:
        for k, v, (k_rows, v_rows) in zip(self.keys, self.values, rows, strict=True):
            k[dst] = k_rows.to(k.dtype)
            v[dst] = v_rows.to(v.dtype)

    def read(self, slots: torch.Tensor) -> list[list[torch.Tensor]]:
        return [
            [k[slots].clone(), v[slots].clone()]
            for k, v in zip(self.keys, self.values, strict=True)
        ]


def kv_rows_for(pool: Any, band: RopeBand) -> KVRows:
    """Wrap a real SGLang pool, or refuse (``unsupported_layout``) what it cannot rotate."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    name = type(pool).__name__
    # Exact classes only: subclasses (DSA, fp4, host mirrors...) change what a row holds.
    if type(pool) is MLATokenToKVPool:
        if pool.use_dsa or pool.store_dtype != pool.dtype:
            raise SpliceUnsupportedError(
                FallbackReason.unsupported_layout,
                f"{name} with DSA or {pool.dtype} packed as {pool.store_dtype} is not rotated",
            )
        return MlaRows(pool.kv_buffer, int(pool.kv_lora_rank), band)
    if type(pool) is MHATokenToKVPool:
        if getattr(pool, "is_quantized_kv_cache", False) or pool.store_dtype != pool.dtype:
            raise SpliceUnsupportedError(
                FallbackReason.unsupported_layout, f"{name} with a quantized cache is not rotated"
            )
        return GqaRows(pool.k_buffer, pool.v_buffer, band)
    raise SpliceUnsupportedError(
        FallbackReason.unsupported_layout, f"KV pool {name} is not one the plugin can rotate"
    )
