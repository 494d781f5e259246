"""The fused CPU rotation (``rope_kernel``) against the eager rotation and a formula here.

Two checks per case: (1) ``rotate_into`` (fused kernel) is within 1 ulp of
``rotate_into_eager``, the rotation as it was before the kernel (in practice bitwise: the
kernel reproduces its rounding order); (2) both are within 1 ulp of this file's own
computation, the pair formula evaluated in fp64 from the same fp32 inputs in the eager
path's rounding order. bf16 storage: widened, rotated in fp32, rounded to nearest even;
compared in bf16 ulps.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from leyline.engine import rope
from leyline.engine.cpu import rope_kernel
from leyline.engine.cpu.switches import OVERRIDES
from leyline.engine.rope import Pairing, rotate_into, rotate_into_eager

HEAD_DIM = 64  # SmolLM2: 3 KV heads of 64 dims, all rotated, half-split
MLA_ROPE = 64  # DeepSeek-V2's qk_rope_head_dim (interleaved), V3's (half-split)


@pytest.fixture(autouse=True)
def _kernel() -> Iterator[None]:
    if not rope_kernel.status().available:
        pytest.skip(f"fused rope kernel unavailable: {rope_kernel.status().detail}")
    yield


def freqs(half: int, base: float = 10000.0) -> torch.Tensor:
    return (base ** (-torch.arange(half, dtype=torch.float64) / half)).float()


def ordered(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns mapped to integers that count ulps (fp32 or bf16), -0 equal to +0."""
    bits = t.view(torch.int32 if t.dtype == torch.float32 else torch.int16).long()
    sign = 1 << (31 if t.dtype == torch.float32 else 15)
    bits = bits & (2 * sign - 1)
    return torch.where(bits >= sign, sign - bits, bits)


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    assert a.dtype == b.dtype and a.shape == b.shape
    both_nan = a.isnan() & b.isnan()
    diff = (ordered(a) - ordered(b)).abs()
    return int(diff.masked_fill(both_nan, 0).max()) if diff.numel() else 0


def reference(
    x: torch.Tensor, delta: int, inv_freq: torch.Tensor, pairing: Pairing, offset: int, fused: bool
) -> torch.Tensor:
    """The rotation computed here, independently: cos/sin of fp64 angles rounded to fp32;
    per pair ``x1·c - x2·s`` and ``x2·c + x1·s`` in fp64 from the fp32 values (every product
    exact), in the eager path's rounding order: a fused multiply-add for the cross term
    (``torch.addcmul`` on AVX2/NEON) or every product rounded (its complex multiply),
    as the kernel found torch to do. bf16 is widened first and rounded back."""
    half = inv_freq.numel()
    angles = inv_freq.double() * delta
    c, s = angles.cos().float().double(), angles.sin().float().double()
    band = x[..., offset : offset + 2 * half].float().double()
    if pairing == "half":
        x1, x2 = band[..., :half], band[..., half:]
    else:
        x1, x2 = band[..., 0::2], band[..., 1::2]

    def r(t: torch.Tensor) -> torch.Tensor:  # round to fp32, keep computing in fp64
        return t.float().double()

    if fused:
        y1, y2 = r(x1 * c) - x2 * s, r(x2 * c) + x1 * s
    else:
        y1, y2 = r(x1 * c) - r(x2 * s), r(x2 * c) + r(x1 * s)
    pairs = torch.stack((y1, y2), -1)  # [..., half, 2]
    y = pairs.transpose(-1, -2).flatten(-2) if pairing == "half" else pairs.flatten(-2)
    out = x.clone()
    out[..., offset : offset + 2 * half] = y.float().to(x.dtype)
    return out


def check(
    x: torch.Tensor, delta: int, inv_freq: torch.Tensor, pairing: Pairing, offset: int = 0
) -> torch.Tensor:
    """Fused vs eager vs :func:`reference`, each pair within 1 ulp; returns the fused one.
    Where the kernel declines a width (no rounding order of its matches torch's there), the
    result is the eager one, bitwise."""
    fast = rotate_into(torch.empty_like(x), x, delta, inv_freq, pairing, offset=offset)
    eager = rotate_into_eager(torch.empty_like(x), x, delta, inv_freq, pairing, offset=offset)
    assert ulps(fast, eager) <= 1, (pairing, x.dtype, delta)
    formula = "addcmul" if pairing == "half" else "complex"
    fused = rope._kernel_mode(formula, inv_freq.numel())
    if fused is None:
        assert torch.equal(fast, eager)
        return fast
    want = reference(x, delta, inv_freq, pairing, offset, fused)
    assert ulps(fast, want) <= 1, (pairing, x.dtype, delta)
    assert ulps(eager, want) <= 1, (pairing, x.dtype, delta)
    return fast


def assert_fused(
    x: torch.Tensor, delta: int, inv_freq: torch.Tensor, pairing: Pairing, offset: int = 0
) -> None:
    """``rotate_into`` takes the kernel for this band (rather than falling back)."""
    band = x[..., offset : offset + 2 * inv_freq.numel()]
    assert rope._fused_plan(torch.empty_like(band), band, pairing) is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("pairing", ["half", "interleaved"])
def test_gqa_keys_smollm2_shapes(dtype: torch.dtype, pairing: Pairing) -> None:
    g = torch.Generator().manual_seed(1)
    keys = (torch.randn(1, 3, 700, HEAD_DIM, generator=g) * 3).to(dtype)
    f = freqs(HEAD_DIM // 2, 100000.0)  # SmolLM2's rope_theta
    for delta in (-284, 1, -1, 300, 65_000):
        assert_fused(keys, delta, f, pairing)
        check(keys, delta, f, pairing)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("pairing", ["half", "interleaved"], ids=["v3-half", "v2-interleaved"])
def test_mla_rope_band(
    dtype: torch.dtype, pairing: Pairing, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both MLA layouts: the shared rope band ``[B, 1, T, dr]`` (transformers >= 5.15), and
    the band as the last ``dr`` dims of full per-head keys (older transformers)."""
    g = torch.Generator().manual_seed(2)
    f = freqs(MLA_ROPE // 2)
    band = torch.randn(1, 1, 333, MLA_ROPE, generator=g).to(dtype)
    full_keys = torch.randn(1, 4, 129, 128 + MLA_ROPE, generator=g).to(dtype)
    assert_fused(band, -77, f, pairing)
    assert_fused(full_keys, 4242, f, pairing, offset=128)
    check(band, -77, f, pairing)
    out = check(full_keys, 4242, f, pairing, offset=128)
    assert torch.equal(out[..., :128], full_keys[..., :128])  # nope dims bitwise


@pytest.mark.parametrize("half", [4, 8, 12, 16, 24, 32, 40, 64])
@pytest.mark.parametrize("pairing", ["half", "interleaved"])
def test_other_widths_fused_or_eager(half: int, pairing: Pairing) -> None:
    """Any width: the kernel where its rounding order matches torch's, eager otherwise."""
    g = torch.Generator().manual_seed(half)
    x = torch.randn(2, 2, 50, 2 * half, generator=g)
    check(x, -123, freqs(half), pairing)
    check(x.bfloat16(), 99, freqs(half), pairing)


def test_views_as_the_splice_writes_them() -> None:
    """A run of tokens of a bigger cache into a slice of another (``run_executor._place``),
    rows as SGLang's pools hold them ``[N, heads, dim]``, and a partial-rotary band."""
    g = torch.Generator().manual_seed(3)
    f = freqs(HEAD_DIM // 2)
    old = torch.randn(1, 3, 900, HEAD_DIM, generator=g)
    new = torch.zeros(1, 3, 700, HEAD_DIM)
    src, dst = old[..., 500:900, :], new[..., 300:700, :]
    assert_fused(src, -200, f, "half")
    rotate_into(dst, src, -200, f, "half")
    want = rotate_into_eager(torch.empty_like(src), src, -200, f, "half")
    assert torch.equal(dst, want) and torch.equal(new[..., :300, :], torch.zeros(1, 3, 300, 64))
    rows = torch.randn(64, 8, HEAD_DIM, generator=g)[::2]  # strided rows
    check(rows, 17, f, "half")
    partial = torch.randn(1, 4, 40, 96, generator=g)
    out = check(partial, 31, freqs(16), "half")  # first 32 of 96 dims rotated
    assert torch.equal(out[..., 32:], partial[..., 32:])
    odd = torch.randn(1, 2, 30, 67, generator=g).bfloat16()  # band at dims [1, 65): pairs
    for pairing in ("half", "interleaved"):  # not 4-byte aligned, the kernel's general path
        assert_fused(odd, 12, f, pairing, offset=1)
        out = check(odd, 12, f, pairing, offset=1)
        assert torch.equal(out[..., :1], odd[..., :1]) and torch.equal(out[..., 65:], odd[..., 65:])


def test_many_bands_and_threads_in_one_call() -> None:
    """Uneven bands in one call, split over threads across band boundaries."""
    kernel = rope_kernel.load()
    assert kernel is not None
    g = torch.Generator().manual_seed(4)
    f = freqs(32)
    cos, sin = rope.delta_cos_sin(f, -555)
    srcs = [torch.randn(1, 3, n, 64, generator=g) for n in (1, 777, 5, 2048, 31)]
    dsts = [torch.empty_like(s) for s in srcs]
    fused = rope._kernel_mode("addcmul", 32)
    assert fused is not None
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(max(threads, 3))
        kernel.rotate(list(zip(dsts, srcs, strict=True)), cos, sin, interleaved=False, fused=fused)
    finally:
        torch.set_num_threads(threads)
    for d, s in zip(dsts, srcs, strict=True):
        assert torch.equal(d, rotate_into_eager(torch.empty_like(s), s, -555, f, "half"))


@pytest.mark.parametrize("pairing", ["half", "interleaved"])
def test_rotate_many_into_is_rotate_into_per_pair(pairing: Pairing) -> None:
    """Mixed dtypes (fp32, bf16 fused; fp16 eager), a partial band, one call per group."""
    g = torch.Generator().manual_seed(6)
    f = freqs(32)
    srcs = [
        torch.randn(1, 3, n, 96, generator=g).to(dt)
        for n, dt in [(300, torch.float32), (7, torch.bfloat16), (50, torch.float16)] * 3
    ]
    dsts = [torch.empty_like(s) for s in srcs]
    rope.rotate_many_into(list(zip(dsts, srcs, strict=True)), -321, f, pairing, offset=32)
    for d, s in zip(dsts, srcs, strict=True):
        want = rotate_into(torch.empty_like(s), s, -321, f, pairing, offset=32)
        assert torch.equal(d, want), s.dtype
    rope.rotate_many_into(list(zip(dsts, srcs, strict=True)), 0, f, pairing, offset=32)
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs, strict=True))


def test_nan_and_inf_stay_in_their_pair() -> None:
    x = torch.randn(1, 1, 4, 16)
    x[0, 0, 1, 3] = float("nan")
    x[0, 0, 2, 10] = float("inf")
    f = freqs(8)
    for pairing in ("half", "interleaved"):
        for dtype in (torch.float32, torch.bfloat16):
            xs = x.to(dtype)
            fast = rotate_into(torch.empty_like(xs), xs, 7, f, pairing)
            eager = rotate_into_eager(torch.empty_like(xs), xs, 7, f, pairing)
            assert torch.equal(fast.isnan(), eager.isnan()), (pairing, dtype)
            assert torch.equal(fast.nan_to_num(), eager.nan_to_num()), (pairing, dtype)
            assert int(fast.isnan().sum() + fast.isinf().sum()) <= 4


def test_what_the_kernel_does_not_take_runs_eager() -> None:
    """fp16/fp64, a non-unit last stride, in place, too many row dims: the eager path."""
    g = torch.Generator().manual_seed(5)
    f = freqs(8)
    x = torch.randn(2, 3, 5, 16, generator=g)
    assert rope_kernel.describe(torch.empty_like(x), x) is not None
    cases = [
        x.half(),
        x.double(),
        torch.randn(2, 3, 16, 5, generator=g).transpose(-1, -2),
        torch.randn(5, 4, 3, 2, 16, generator=g).permute(3, 2, 1, 0, 4),  # 4 row dims
    ]
    for t in cases:
        assert rope_kernel.describe(torch.empty_like(t), t) is None
        for pairing in ("half", "interleaved"):
            got = rotate_into(torch.empty_like(t), t, 9, f, pairing)
            assert torch.equal(got, rotate_into_eager(torch.empty_like(t), t, 9, f, pairing))
    assert rope_kernel.describe(x, x) is None  # same storage


def test_disabled_kernel_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(OVERRIDES, "rope_kernel", "off")
    rope._kernel_mode.cache_clear()
    try:
        assert rope_kernel.load() is None
        assert rope_kernel.status().detail == "rope_kernel switched off in process"
        x = torch.randn(1, 3, 10, 64)
        f = freqs(32)
        got = rotate_into(torch.empty_like(x), x, 5, f, "half")
        assert torch.equal(got, rotate_into_eager(torch.empty_like(x), x, 5, f, "half"))
    finally:
        rope._kernel_mode.cache_clear()


def test_built_once_into_the_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LEYLINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(rope_kernel._kernel, "_status", None)
    monkeypatch.setattr(rope_kernel._kernel, "_loaded", None)
    assert rope_kernel.load() is not None
    built = list((tmp_path / "kernels").glob("rope_kernel-*.so"))
    assert len(built) == 1 and rope_kernel.status().detail.startswith(str(built[0]))
    mtime = built[0].stat().st_mtime_ns
    monkeypatch.setattr(rope_kernel._kernel, "_status", None)
    assert rope_kernel.load() is not None and built[0].stat().st_mtime_ns == mtime


def test_rotation_benchmark_runs_end_to_end(capsys: pytest.CaptureFixture[str]) -> None:
    """``src/leyline/evals/bench_rotation.py`` smoke run (no timing asserted)."""
    from leyline.evals.bench_rotation import main

    results = main(["--quick", "--runs", "1", "--contexts", "32", "--json", "/dev/null"])
    rows = results["rows"]
    assert isinstance(rows, list) and len(rows) == 6  # 3 layouts x 2 dtypes
    assert all(r["fused_ratio"] > 0 and r["fused_1call_ms"] > 0 for r in rows)
    assert "gqa-half" in capsys.readouterr().out
