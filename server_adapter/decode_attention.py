"""Attention of one query over a long cache, at the speed of reading the cache.

A decode step, and the last token a splice runs again for its next-token logits, is one
query per head against every cached key and value. torch's CPU flash-attention kernel
tiles such a call like a prefill's and streams K and V at about 9-13 GB/s on this machine
(fp32, 4k-8k tokens, 2 threads); two batched matrix products over the grouped heads
(scores, softmax, weighted values) read them at 14-16 GB/s: 0.39 against 0.49 ms a layer
at 4k and 0.88 against 1.27 ms at 8k (``evals/bench_decode_attention.py``). Below about
3k keys (1k at 2 threads, 3k at 1) the flash kernel is as fast or faster, and in bf16 it
is 2.6-4x faster at every length, so only fp32 calls over :data:`MIN_KEYS` or more keys
take this path.

Grouped-query heads are read in place: query head ``h`` attends with key/value head
``h // (heads / kv_heads)``, as ``enable_gqa`` does.
"""

from __future__ import annotations

import torch

MIN_KEYS = 3072
"""Shortest cache the matrix-product path runs on (the crossover at one thread)."""


def takes_single_query(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether :func:`single_query_attention` runs this call: one row, one query, fp32,
    at least :data:`MIN_KEYS` keys, query heads a multiple of key/value heads."""
    return (
        query.shape[0] == 1
        and query.shape[2] == 1
        and key.shape[2] >= MIN_KEYS
        and query.dtype == torch.float32
        and key.dtype == torch.float32
        and query.shape[1] % key.shape[1] == 0
    )


def single_query_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """``softmax(q k^T * scale) v`` for ``query [1, heads, 1, d]`` over ``key [1, kv, n, d]``
    and ``value [1, kv, n, dv]``; returns ``[1, heads, 1, dv]`` (SDPA's layout), with no mask
    (the query sees all ``n`` positions)."""
    heads, kv_heads = query.shape[1], key.shape[1]
    group = heads // kv_heads
    q = query.reshape(kv_heads, group, query.shape[-1])
    scores = torch.matmul(q, key[0].transpose(-1, -2))  # [kv, group, n]
    scores.mul_(query.shape[-1] ** -0.5 if scale is None else scale)
    weights = torch.softmax(scores, dim=-1)
    out = torch.matmul(weights, value[0])  # [kv, group, dv]
    return out.reshape(1, heads, 1, value.shape[-1])
