"""Attention of one query over a long cache, at the speed of reading the cache.

A decode step, a batched decode row and the last token a splice runs again are one query
per head against every cached key and value. Two paths beat torch's CPU flash kernel there
(``bench_decode_attention``, docs/perf.md): the compiled kernel (``attention_kernel``, fp32
or bf16) and, without it, two batched matrix products over the grouped heads for fp32 over
:data:`MIN_KEYS` keys (bf16 keeps torch's kernel). Grouped-query heads are read in place.
"""

from __future__ import annotations

import torch

from leyline.engine.cpu import attention_kernel

MIN_KEYS = 3072
"""Shortest cache the matrix-product path runs on (the crossover at one thread)."""
KERNEL_MIN_KEYS = {torch.float32: 512, torch.bfloat16: 64}
"""Shortest cache the compiled kernel runs on, by dtype (below, torch's kernel is as fast:
fp32 0.93x of its time at 512 keys, 1.39x at 256, on an AMD EPYC 7003 with AVX2)."""


def takes_single_query(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether :func:`single_query_attention` runs this call (one row, one query, query
    heads a multiple of key/value heads): the kernel's tensors past its shortest cache, or
    fp32 past :data:`MIN_KEYS` for the matrix products."""
    if query.shape[0] != 1 or query.shape[2] != 1 or query.shape[1] % key.shape[1]:
        return False
    n = key.shape[2]
    if n >= KERNEL_MIN_KEYS.get(key.dtype, n + 1) and attention_kernel.eligible(query, key, value):
        return attention_kernel.load() is not None or _matmul_takes(query, key)
    return _matmul_takes(query, key)


def _matmul_takes(query: torch.Tensor, key: torch.Tensor) -> bool:
    return key.shape[2] >= MIN_KEYS and query.dtype == torch.float32 and key.dtype == torch.float32


def single_query_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """``softmax(q k^T * scale) v`` for ``query [1, heads, 1, d]`` over ``key [1, kv, n, d]``
    and ``value [1, kv, n, dv]``; returns ``[1, heads, 1, dv]`` (SDPA's layout), with no mask
    (the query sees all ``n`` positions). The compiled kernel where it loads and takes the
    tensors (never slower than the products), else :func:`matmul_attention`."""
    kernel = attention_kernel.load()
    if kernel is not None and attention_kernel.eligible(query, key, value):
        return kernel.attend(query, key, value, scale, checked=True)
    return matmul_attention(query, key, value, scale)


def matmul_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """:func:`single_query_attention` as two batched matrix products over the grouped heads."""
    heads, kv_heads = query.shape[1], key.shape[1]
    group = heads // kv_heads
    q = query.reshape(kv_heads, group, query.shape[-1])
    scores = torch.matmul(q, key[0].transpose(-1, -2))  # [kv, group, n]
    scores.mul_(query.shape[-1] ** -0.5 if scale is None else scale)
    weights = torch.softmax(scores, dim=-1)
    out = torch.matmul(weights, value[0])  # [kv, group, dv]
    return out.reshape(1, heads, 1, value.shape[-1])
