"""The compiled single-query attention (``attention_kernel``) against an fp64 computation of
the same softmax, and against torch's SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from leyline.engine import cpu, decode_attention
from leyline.engine.cpu import attention_kernel
from leyline.engine.cpu.attention_kernel import AttentionKernel
from leyline.engine.cpu.switches import OVERRIDES

from ._kernels import portable_attention_kernel


@pytest.fixture(scope="module")
def kernel() -> AttentionKernel:
    loaded = attention_kernel.load()
    if loaded is None:
        pytest.skip(f"attention kernel unavailable: {attention_kernel.status().detail}")
    return loaded


def _inputs(
    heads: int, kv_heads: int, dim: int, value_dim: int, n: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    capacity = n + 13  # the cache is a view of the first n positions of a bigger buffer
    keys = torch.randn(1, kv_heads, capacity, dim, generator=g).to(dtype)[:, :, :n]
    values = torch.randn(1, kv_heads, capacity, value_dim, generator=g).to(dtype)[:, :, :n]
    query = torch.randn(1, 1, heads, dim, generator=g).to(dtype).transpose(1, 2)
    return query, keys, values


def _reference(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """softmax(q k^T * scale) v in fp64, grouped heads expanded explicitly."""
    heads, kv_heads, dim = query.shape[1], keys.shape[1], query.shape[-1]
    k = keys.double().repeat_interleave(heads // kv_heads, dim=1)
    v = values.double().repeat_interleave(heads // kv_heads, dim=1)
    scores = query.double() @ k.transpose(-1, -2) * (dim**-0.5 if scale is None else scale)
    return torch.softmax(scores, dim=-1) @ v


SHAPES = [
    (9, 3, 64, 64, 4096),  # SmolLM2-135M
    (9, 3, 64, 64, 5000),  # segments of unequal length
    (8, 8, 24, 16, 300),  # no grouping, widths that are not multiples of 16
    (4, 1, 32, 32, 1),  # one key
    (6, 2, 8, 8, 77),
    (6, 2, 32, 48, 129),  # 512-bit rows: a value width off 64 columns, an odd key tail
    (4, 2, 20, 12, 333),  # widths off the 8-lane paths: scalar scores, a value tail of 4
    (16, 16, 192, 128, 600),  # MLA's decompressed heads: key 192 (nope 128 + rope 64), value 128
    (10, 2, 32, 32, 300),  # groups of 5: four heads a pass over the rows, then one
    (14, 2, 64, 80, 700),  # groups of 7: four, then three; a value width off 64 columns
]


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "value_dim", "n"), SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_fp32_equals_an_fp64_softmax(
    kernel: AttentionKernel, heads: int, kv_heads: int, dim: int, value_dim: int, n: int,
    threads: int,
) -> None:  # fmt: skip
    query, keys, values = _inputs(heads, kv_heads, dim, value_dim, n, torch.float32, n)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for scale in (None, 0.3, 4.0):  # 4.0: peaked scores, the running max moves a lot
            got = kernel.attend(query, keys, values, scale)
            want = _reference(query, keys, values, scale)
            assert got.shape == (1, heads, 1, value_dim) and got.dtype == torch.float32
            # fp32 scores round by ~|score| * 2^-24 whoever computes them, so peaked softmaxes
            # (scale 4) drift to ~7e-6 in SDPA too: the kernel may be no worse than SDPA
            sdpa = F.scaled_dot_product_attention(
                query, keys, values, scale=scale, enable_gqa=heads != kv_heads
            )
            sdpa_error = (sdpa.double() - want).abs().max().item()
            assert (got.double() - want).abs().max().item() <= 3 * sdpa_error + 1e-6
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "value_dim", "n"), SHAPES)
def test_bf16_is_the_fp64_softmax_of_its_inputs_rounded_once(
    kernel: AttentionKernel, heads: int, kv_heads: int, dim: int, value_dim: int, n: int
) -> None:
    """bf16 inputs are widened exactly and summed in fp32: the result is the exact softmax of
    the bf16 values within one bf16 rounding (torch's AVX2 SDPA misses that bound here)."""
    query, keys, values = _inputs(heads, kv_heads, dim, value_dim, n, torch.bfloat16, n + 1)
    got = kernel.attend(query, keys, values, None)
    assert got.dtype == torch.bfloat16
    want = _reference(query, keys, values, None)
    ulp = 2.0**-8 * want.abs() + 1e-6  # one bf16 rounding of the exact value, plus fp32 sums
    assert ((got.double() - want).abs() <= ulp).all()


@pytest.fixture(scope="module")
def portable_kernel() -> AttentionKernel:
    return portable_attention_kernel()


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "value_dim", "n"), SHAPES)
def test_the_portable_build_agrees_in_both_dtypes(
    portable_kernel: AttentionKernel, heads: int, kv_heads: int, dim: int, value_dim: int, n: int
) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        query, keys, values = _inputs(heads, kv_heads, dim, value_dim, n, dtype, n + 2)
        want = _reference(query, keys, values, None)
        got = portable_kernel.attend(query, keys, values, None).double()
        if dtype == torch.float32:
            assert (got - want).abs().max() < 2e-6
        else:
            assert ((got - want).abs() <= 2.0**-8 * want.abs() + 1e-6).all()


def test_one_and_two_threads_agree(kernel: AttentionKernel) -> None:
    query, keys, values = _inputs(9, 3, 64, 64, 8192, torch.float32, 3)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel.attend(query, keys, values, None)
        torch.set_num_threads(2)
        two = kernel.attend(query, keys, values, None)
    finally:
        torch.set_num_threads(previous)
    assert (one - two).abs().max() < 1e-6


def test_refuses_what_it_does_not_take(kernel: AttentionKernel) -> None:
    query, keys, values = _inputs(9, 3, 64, 64, 100, torch.float32, 0)
    assert attention_kernel.eligible(query, keys, values)
    refused = [
        (query, keys.double(), values.double()),  # dtype
        (query.to(torch.bfloat16), keys, values),  # mixed dtypes
        (query[:, :8], keys, values),  # heads not a multiple of kv heads
        (torch.cat([query, query], dim=2), keys, values),  # two queries
        (query, keys.transpose(-1, -2).contiguous().transpose(-1, -2), values),  # last dim strided
        (torch.zeros(1, 34, 1, 64), torch.zeros(1, 2, 5, 64), torch.zeros(1, 2, 5, 64)),  # group 17
        (torch.zeros(1, 1, 1, 1024), torch.zeros(1, 1, 5, 1024), torch.zeros(1, 1, 5, 8)),  # wide
        (query, keys[:, :, :0], values[:, :, :0]),  # no keys
    ]
    for q, k, v in refused:
        assert not attention_kernel.eligible(q, k, v)
        with pytest.raises(ValueError, match="not eligible"):
            kernel.attend(q, k, v, None)


def test_the_engine_path_takes_bf16_with_the_kernel_and_not_without(
    kernel: AttentionKernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``decode_attention`` sends one bf16 query to the kernel past its shortest cache; with
    no kernel bf16 stays on torch's SDPA and fp32 falls back to the matrix products."""
    n = decode_attention.MIN_KEYS
    query, keys, values = _inputs(9, 3, 64, 64, n, torch.bfloat16, 5)
    assert decode_attention.takes_single_query(query, keys, values)
    short = decode_attention.KERNEL_MIN_KEYS[torch.bfloat16] - 1
    assert not decode_attention.takes_single_query(query, keys[:, :, :short], values[:, :, :short])
    got = decode_attention.single_query_attention(query, keys, values, None)
    assert torch.equal(got, kernel.attend(query, keys, values, None))

    monkeypatch.setattr(attention_kernel, "load", lambda: None)
    assert not decode_attention.takes_single_query(query, keys, values)
    q32, k32, v32 = query.float(), keys.float(), values.float()
    assert decode_attention.takes_single_query(q32, k32, v32)
    fallback = decode_attention.single_query_attention(q32, k32, v32, None)
    assert torch.equal(fallback, decode_attention.matmul_attention(q32, k32, v32, None))


def test_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(OVERRIDES, "attention_kernel", "off")
    assert attention_kernel.load() is None
    assert attention_kernel.status().detail == "attention_kernel switched off in process"
    assert cpu.status()["attention_kernel"] == "off: attention_kernel switched off in process"
    monkeypatch.setenv("LEYLINE_CPU_KERNELS", "0")
    monkeypatch.delitem(OVERRIDES, "attention_kernel")
    assert attention_kernel.load() is None
    assert set(cpu.status().values()) == {"off: LEYLINE_CPU_KERNELS=0"}
    monkeypatch.delenv("LEYLINE_CPU_KERNELS")
    assert attention_kernel.load() is not None
