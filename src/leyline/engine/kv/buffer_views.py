"""Views of the start of a KV buffer: how many positions it holds, and a view of more of them.

The engine's KV tensors are ``[1, heads, length, d]`` views of the start of contiguous
``[1, heads, capacity, d]`` buffers (``forward.new_buffers``). A session that owns its
buffers may use the positions past its length without allocating: an in-place edit that
grows the sequence (``in_place_edit``), a generation decoding into room a prefill reserved
(``generation.Decoder``).
"""

from __future__ import annotations

import torch

from leyline.engine.kv.kv_blocks import KVCache


def capacity(t: torch.Tensor) -> int | None:
    """Positions the buffer behind ``t`` (a ``[1, heads, length, d]`` view of the start of a
    contiguous ``[1, heads, capacity, d]`` tensor) holds, or None for any other view."""
    if t.dim() != 4 or t.shape[0] != 1 or t.storage_offset() != 0:
        return None
    heads, d = int(t.shape[1]), int(t.shape[3])
    if t.stride(3) != 1 or t.stride(2) != d:
        return None
    cap = (
        int(t.stride(1)) // d
        if heads > 1
        else int(t.untyped_storage().nbytes()) // (d * t.element_size())
    )
    if cap < t.shape[2] or heads * cap * d * t.element_size() > t.untyped_storage().nbytes():
        return None
    return cap


def resized(t: torch.Tensor, length: int) -> torch.Tensor:
    """The view of the first ``length`` positions of ``t``'s buffer (within its capacity)."""
    shape = (*t.shape[:2], length, t.shape[3])
    stride = (t.stride(0), t.stride(1) if t.shape[1] > 1 else length * t.shape[3], *t.stride()[2:])
    return t.as_strided(shape, stride, 0)


def has_room(kv: KVCache, length: int) -> bool:
    """Whether every tensor of ``kv`` is a view of a buffer holding ``length`` positions."""
    caps = [capacity(t) for layer in kv for t in layer]
    return bool(caps) and all(c is not None and c >= length for c in caps)
