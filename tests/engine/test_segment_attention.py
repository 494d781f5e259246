"""Attention over key segments merged by log-sum-exp (``segment_attention``), against one
softmax over every key computed in fp64."""

from __future__ import annotations

import itertools

import pytest
import torch

from leyline.engine.cpu import attention_kernel
from leyline.engine.rope import delta_rotate
from leyline.engine.segment_attention import attend_part, merge_parts

HEADS, KV_HEADS, D = 6, 2, 32


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """fp64 softmax attention with grouped heads expanded."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, 1)
    v = v.double().repeat_interleave(group, 1)
    scores = q.double() @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if mask is not None:
        scores = scores + mask.double()
    return torch.softmax(scores, -1) @ v


def _qkv(m: int, n: int, seed: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, HEADS, m, D, generator=g).to(dtype)
    k = torch.randn(1, KV_HEADS, n, D, generator=g).to(dtype)
    v = torch.randn(1, KV_HEADS, n, D, generator=g).to(dtype)
    return q, k, v


@pytest.mark.parametrize("m", [1, 5])
def test_merged_segments_equal_one_softmax_over_all_keys(m: int) -> None:
    q, k, v = _qkv(m, 1400, seed=1)
    cuts = [0, 700, 1390, 1400]
    parts = [
        attend_part(q, k[:, :, a:b], v[:, :, a:b], None, None) for a, b in itertools.pairwise(cuts)
    ]
    got = merge_parts(parts)
    assert got.dtype == torch.float32
    assert float((got.double() - _reference(q, k, v, None)).abs().max()) <= 2e-6


def test_a_masked_segment_merges_as_the_mask_says() -> None:
    q, k, v = _qkv(4, 300, seed=2)
    side_mask = torch.zeros(4, 20)
    for i in range(4):
        side_mask[i, 17 + i :] = torch.finfo(torch.float32).min  # query i sees 17 + i entries
    parts = [
        attend_part(q, k[:, :, :280], v[:, :, :280], None, None),
        attend_part(q, k[:, :, 280:], v[:, :, 280:], side_mask[None, None], None),
    ]
    full_mask = torch.cat([torch.zeros(4, 280), side_mask], dim=1)[None, None]
    want = _reference(q, k, v, full_mask)
    assert float((merge_parts(parts).double() - want).abs().max()) <= 2e-6


@pytest.mark.skipif(attention_kernel.load() is None, reason="no C compiler on this machine")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_log_sum_exp_is_the_softmax_normaliser(dtype: torch.dtype) -> None:
    kernel = attention_kernel.load()
    assert kernel is not None
    q, k, v = _qkv(1, 900, seed=3, dtype=dtype)
    out, lse = kernel.attend_segments([(q, k, v)], None, with_lse=True)
    assert lse is not None
    group = HEADS // KV_HEADS
    scores = (q.double().reshape(KV_HEADS, group, D) @ k[0].double().transpose(-1, -2)) * D**-0.5
    want = torch.logsumexp(scores, -1).reshape(1, HEADS, 1)
    assert float((lse.double() - want).abs().max()) <= 1e-4
    assert torch.equal(out.to(dtype), kernel.attend(q, k, v, None))


def test_a_counter_rotated_query_scores_as_the_moved_keys_do() -> None:
    """RoPE depends on relative position: the query rotated by -delta against keys where
    they are gives the attention of the query against the keys rotated by +delta."""
    q, k, v = _qkv(1, 64, seed=4)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    delta = -37
    moved = delta_rotate(k, delta, inv_freq, "half")
    want = _reference(q, moved, v, None)
    got = merge_parts([attend_part(delta_rotate(q, -delta, inv_freq, "half"), k, v, None, None)])
    assert float((got.double() - want).abs().max()) <= 1e-5
