"""Layout-agnostic per-layer KV, cut into fixed-size token blocks and joined back.

A cache is a tuple over layers of tuples of tensors that share one sequence dim (GQA/MHA
``(keys, values)``, MLA ``(latent, rope_band)``, anything else); nothing looks inside a
layer beyond that dim, so every architecture's layout works unchanged. The helpers are
pure, and blocks are copies, never views: an in-place edit of a caller's cache (a splice
rotating keys) can never reach a cached block.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

LayerKV = tuple[torch.Tensor, ...]
"""One layer's tensors, e.g. ``(keys, values)`` of shape ``[1, heads, tokens, dim]`` for
GQA/MHA or ``(latent, rope_band)`` for MLA."""
KVCache = tuple[LayerKV, ...]
"""Per-layer KV of one token range: one ``LayerKV`` per layer. A transformers
``DynamicCache`` converts with ``tuple((layer.keys, layer.values) for layer in
cache.layers)``."""


class PrefixCacheError(ValueError):
    """Base of the prefix cache's typed errors (a ValueError, so broad handlers still work)."""


class KVLayoutError(PrefixCacheError):
    """The KV does not have the layout the cache holds (layers, tensors, shape, dtype)."""


class TensorSpec(NamedTuple):
    """What must agree between blocks so that they can be concatenated."""

    shape: tuple[int, ...]
    """The tensor's shape with the sequence dim removed."""
    seq_dim: int
    """The sequence dim, made non-negative for this tensor."""
    dtype: torch.dtype
    device: torch.device


KVLayout = tuple[tuple[TensorSpec, ...], ...]


def _seq_dim_of(tensor: torch.Tensor, seq_dim: int) -> int:
    if not -tensor.dim() <= seq_dim < tensor.dim():
        raise KVLayoutError(
            f"seq_dim={seq_dim} is out of range for a tensor of shape {tuple(tensor.shape)}"
        )
    return seq_dim % tensor.dim()


def kv_layout(kv: Sequence[Sequence[torch.Tensor]], seq_dim: int) -> KVLayout:
    """Shape (sequence dim removed), dtype and device of every tensor. Raises
    ``KVLayoutError`` if ``seq_dim`` is out of range for a tensor."""
    layers: list[tuple[TensorSpec, ...]] = []
    for layer in kv:
        specs = []
        for t in layer:
            d = _seq_dim_of(t, seq_dim)
            shape = tuple(t.shape[:d]) + tuple(t.shape[d + 1 :])
            specs.append(TensorSpec(shape, d, t.dtype, t.device))
        layers.append(tuple(specs))
    return tuple(layers)


def kv_seq_len(kv: Sequence[Sequence[torch.Tensor]], seq_dim: int) -> int:
    """The length all tensors share along ``seq_dim``. Raises ``KVLayoutError`` if the
    cache is empty or its tensors disagree."""
    lengths = {int(t.shape[_seq_dim_of(t, seq_dim)]) for layer in kv for t in layer}
    if len(lengths) != 1:
        found = sorted(lengths) if lengths else "no tensors"
        raise KVLayoutError(f"KV tensors must share one length along seq_dim, got {found}")
    return lengths.pop()


def kv_nbytes(kv: Sequence[Sequence[torch.Tensor]]) -> int:
    """Bytes of all tensors (``numel * element_size``)."""
    return sum(t.numel() * t.element_size() for layer in kv for t in layer)


def slice_block(
    kv: Sequence[Sequence[torch.Tensor]], start: int, length: int, seq_dim: int
) -> KVCache:
    """A contiguous copy of ``[start, start + length)`` along ``seq_dim``."""
    # clone(): a view would pin the caller's whole tensor (bytes we do not account for)
    # and would see the caller's later in-place edits.
    return tuple(
        tuple(
            t.narrow(seq_dim, start, length).clone(memory_format=torch.contiguous_format)
            for t in layer
        )
        for layer in kv
    )


def split_blocks(
    kv: Sequence[Sequence[torch.Tensor]], block_size: int, seq_dim: int
) -> list[KVCache]:
    """Every full block, in order; a trailing partial block is left out."""
    n = kv_seq_len(kv, seq_dim) // block_size
    return [slice_block(kv, i * block_size, block_size, seq_dim) for i in range(n)]


def concat_blocks(blocks: Sequence[KVCache], seq_dim: int) -> KVCache:
    """The blocks joined along ``seq_dim`` (a new tensor per layer and slot). Raises
    ``KVLayoutError`` for an empty list."""
    if not blocks:
        raise KVLayoutError("concat_blocks needs at least one block")
    first = blocks[0]
    return tuple(
        tuple(
            torch.cat([block[layer][slot] for block in blocks], dim=seq_dim)
            for slot in range(len(first[layer]))
        )
        for layer in range(len(first))
    )
