"""The few-row linear kernel (``linear_kernel``) reading oneDNN's packed weights: its reading
of the layout against the dense weight, its products against fp64, and where
``PackedLinear`` sends a product."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from leyline.engine.cpu import kernel_build, linear_kernel
from leyline.engine.cpu.linear_kernel import (
    AMX_ROWS,
    BLOCKS,
    F32_ROWS,
    DirectLinear,
    LinearKernel,
    packed_view,
)
from leyline.engine.cpu.packed_linear import (
    KERNEL_MAX_ROWS,
    PackedLinear,
    pack_linear_layers,
)
from leyline.engine.cpu.switches import OVERRIDES

from ._helpers import rel_err, tiny_llama
from ._kernels import exact_linear, needs_onednn

pytestmark = needs_onednn
AVX512 = torch.backends.cpu.get_cpu_capability() == "AVX512"
AMX_BF16 = "amx_bf16" in kernel_build.cpu_flags()


def layout_known(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs ``dtype`` weights in a layout the kernel reads on this CPU: on
    AVX-512 (bf16 where the CPU has AMX in blocks of 32 columns, else of 64)."""
    return AVX512


def expected_block(dtype: torch.dtype) -> int:
    """The block width oneDNN was seen to pack ``dtype`` in on an AVX-512 CPU: 32 for bf16
    on a CPU with AMX (for the tile unit: a Xeon with AMX, 2026-12-05), else 64."""
    return 32 if dtype == torch.bfloat16 and AMX_BF16 else 64


SHAPES = [(576, 576), (192, 576), (100, 70), (3, 1000), (1000, 3), (64, 64), (130, 71)]


@pytest.fixture(scope="module")
def kernel() -> LinearKernel:
    loaded = linear_kernel.load()
    if loaded is None:  # only without a C compiler; then nothing may claim to use it
        assert kernel_build.compiler() is None, linear_kernel.status().detail
        pytest.skip("no C compiler: the kernel cannot be built here")
    return loaded


def _linear(out_features: int, in_features: int, bias: bool, dtype: torch.dtype) -> nn.Linear:
    torch.manual_seed(out_features * 7 + in_features)
    return nn.Linear(in_features, out_features, bias=bias).eval().to(dtype)


def _packed(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, 64)


def _bound(kernel: LinearKernel, linear: nn.Linear) -> DirectLinear:
    """``linear`` packed and bound to the kernel. Where the layout is known
    (:func:`layout_known`) the binding must succeed; elsewhere oneDNN may pack otherwise,
    and then the kernel has nothing to run."""
    weight = linear.weight.detach()
    direct = kernel.bind(_packed(weight), weight, linear.bias)
    if direct is None:
        assert not layout_known(weight.dtype), "the kernel refused a layer in its known layout"
        pytest.skip("oneDNN packs these weights in another layout on this CPU")
    return direct


needs_bf16 = pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="oneDNN has no bf16 on this CPU"
)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16)])
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_the_layout_read_is_onednns_packing_of_the_weight(
    kernel: LinearKernel, dtype: torch.dtype, out_features: int, in_features: int
) -> None:
    weight = torch.randn(out_features, in_features).to(dtype)
    packed = _packed(weight)
    reads = {block: packed_view(packed, out_features, in_features, block) for block in BLOCKS}
    matching = [b for b, view in reads.items() if view is not None and torch.equal(view, weight)]
    if layout_known(dtype):  # where it was measured: the layout must be read exactly
        assert matching == [expected_block(dtype)]
    # Anywhere: the kernel binds a layer exactly when its buffer reads back bitwise, and
    # reads it with the block width it reads back under.
    direct = kernel.bind(packed, weight, None)
    assert (direct is not None) == bool(matching)
    assert direct is None or direct.block == matching[0]


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9])
@pytest.mark.parametrize(("out_features", "in_features", "bias"), [(576, 576, False),
                                                                   (100, 70, True),
                                                                   (130, 71, True)])  # fmt: skip
def test_fp32_products_are_as_close_to_fp64_as_torchs(
    kernel: LinearKernel, rows: int, out_features: int, in_features: int, bias: bool
) -> None:
    linear = _linear(out_features, in_features, bias, torch.float32)
    direct = _bound(kernel, linear)
    x = torch.randn(1, rows, in_features)
    with torch.no_grad():
        got, plain = direct(x), linear(x)
        exact = exact_linear(x, linear)
    assert got.shape == plain.shape and got.dtype == torch.float32
    err = float((got.double() - exact).abs().max() / exact.abs().max())
    plain_err = float((plain.double() - exact).abs().max() / exact.abs().max())
    assert err <= 4 * plain_err + 1e-6


@needs_bf16
@pytest.mark.parametrize("path", ["tiles", "vectors"])
@pytest.mark.parametrize("rows", [1, 3, 6, 17, 32, 40])
@pytest.mark.parametrize(("out_features", "in_features", "bias"), [(576, 576, True),
                                                                   (130, 71, True),
                                                                   (192, 576, False)])  # fmt: skip
def test_bf16_products_are_one_rounding_of_the_exact_one(
    kernel: LinearKernel, path: str, rows: int, out_features: int, in_features: int, bias: bool
) -> None:
    """On either path: the tile unit (where the kernel runs bf16 on it) and the vector
    code (the bf16 dot product or the widening loop); 40 rows: two groups of 32 tiles."""
    linear = _linear(out_features, in_features, bias, torch.bfloat16)
    direct = _bound(kernel, linear)
    if path == "tiles" and not direct.amx_rows:
        assert not (kernel.amx and direct.block == linear_kernel.AMX_BLOCK)
        pytest.skip("the kernel has no tile unit for this layout here")
    if path == "vectors":
        direct.amx_rows = 0
    x = torch.randn(rows, in_features).to(torch.bfloat16)
    got = direct(x)
    with torch.no_grad():
        exact = exact_linear(x, linear)
    # fp32 sums, then one round to nearest bf16: within half a bf16 step of each entry
    # (8 significant bits: at most 2^-8 relative), plus the fp32 summation's error on
    # entries that nearly cancel.
    bound = 2**-8 * exact.abs() + 1e-5 * exact.abs().max()
    assert bool(((got.double() - exact).abs() <= bound).all())


@pytest.mark.parametrize("rows", [3, 17])
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16)])
def test_the_thread_count_does_not_change_a_bit(
    kernel: LinearKernel, dtype: torch.dtype, rows: int
) -> None:
    linear = _linear(1000, 576, True, dtype)
    direct = _bound(kernel, linear)
    x = torch.randn(rows, 576).to(dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = direct(x)
        torch.set_num_threads(max(2, threads))
        many = direct(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)  # every output block is summed by one thread, in order


class _Counting:
    def __init__(self, inner: object) -> None:
        self.inner, self.calls = inner, 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.inner(x)  # type: ignore[operator, no-any-return]


def test_packed_linear_sends_only_few_contiguous_rows_to_the_kernel(kernel: LinearKernel) -> None:
    linear = _linear(192, 576, True, torch.float32)
    layer = PackedLinear(linear, kernel=kernel)
    if layer.direct is None:
        assert not layout_known(torch.float32), "PackedLinear left a layer off the kernel"
        pytest.skip("oneDNN packs these weights in another layout on this CPU")
    spy = _Counting(layer.direct)
    layer.direct = spy  # type: ignore[assignment]
    with torch.no_grad():
        for rows in (1, F32_ROWS):
            x = torch.randn(1, rows, 576)
            assert rel_err(layer(x), linear(x)) <= 1e-6
        assert spy.calls == 2
        layer(torch.randn(1, F32_ROWS + 1, 576))
        layer(torch.randn(2, 1152)[:, ::2])  # two rows, not contiguous: oneDNN reads it
        assert spy.calls == 2
    assert "linear_kernel" in layer.extra_repr()
    with pytest.raises(RuntimeError):  # a wrong width is oneDNN's error, never a wrong read
        layer(torch.randn(1, 1, 500))
    assert spy.calls == 2


@needs_bf16
def test_bf16_products_of_a_splices_pass_go_to_the_kernel(kernel: LinearKernel) -> None:
    """bf16 products of up to 32 rows (a splice's 17 among them) go to the kernel: on the
    tile unit where oneDNN packs for AMX and the kernel has it, else on the bf16 dot
    product where oneDNN packs in blocks of 64; otherwise up to 8. fp32: up to 32."""
    assert kernel.bf16_dot == ("avx512_bf16" in kernel_build.cpu_flags() and AVX512)
    if AVX512 and AMX_BF16:  # Linux grants the tile unit: measured on this Xeon
        assert kernel.amx
    bf16 = PackedLinear(_linear(192, 576, True, torch.bfloat16), kernel=kernel)
    fp32 = PackedLinear(_linear(192, 576, True, torch.float32), kernel=kernel)
    if bf16.direct is None or fp32.direct is None:
        assert not layout_known(torch.bfloat16), "PackedLinear left a layer off the kernel"
        pytest.skip("oneDNN packs these weights in another layout on this CPU")
    tiles = kernel.amx and bf16.direct.block == linear_kernel.AMX_BLOCK
    dot = kernel.bf16_dot and bf16.direct.block == 64
    most = AMX_ROWS if tiles else linear_kernel.BF16_DOT_ROWS if dot else KERNEL_MAX_ROWS
    assert (bf16.kernel_rows, fp32.kernel_rows) == (most, F32_ROWS)
    assert bf16.direct.amx_rows == (1 if tiles else 0) and fp32.direct.amx_rows == 0
    spy = _Counting(bf16.direct)
    bf16.direct = spy  # type: ignore[assignment]
    with torch.no_grad():
        bf16(torch.randn(1, most, 576).to(torch.bfloat16))
        bf16(torch.randn(1, most + 1, 576).to(torch.bfloat16))
    assert spy.calls == 1
    assert f"rows <= {most} on linear_kernel" in bf16.extra_repr()


def test_a_packed_models_decode_step_gives_the_unpacked_models_logits(
    monkeypatch: pytest.MonkeyPatch, kernel: LinearKernel
) -> None:
    monkeypatch.setitem(OVERRIDES, "packed_linear", "on")
    plain, packed = tiny_llama(seed=6).model, tiny_llama(seed=6).model
    report = pack_linear_layers(packed)
    linears = sum(type(m) is nn.Linear for m in plain.modules())
    if AVX512:
        assert report.direct == report.packed == linears
    ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cache_a, cache_b = plain(ids[:, :-1]).past_key_values, packed(ids[:, :-1]).past_key_values
        want = plain(ids[:, -1:], cache=cache_a).logits  # one row per linear layer
        got = packed(ids[:, -1:], cache=cache_b).logits
    assert rel_err(got, want) <= 1e-5


def test_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(OVERRIDES, "linear_kernel", "off")
    monkeypatch.setitem(OVERRIDES, "packed_linear", "on")
    assert linear_kernel.load() is None
    assert linear_kernel.status().detail == "linear_kernel switched off in process"
    report = pack_linear_layers(tiny_llama(seed=7).model)
    assert report.packed > 0 and report.direct == 0
    assert "switched off" in report.kernel


@pytest.mark.parametrize("amx", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16)])
def test_non_finite_inputs_give_what_the_exact_product_gives(
    kernel: LinearKernel, dtype: torch.dtype, amx: bool
) -> None:
    """A NaN row gives NaN outputs and an infinite one infinities or NaN, as in fp64: the
    vectorised store rounds them as the scalar code does (a NaN stays a NaN in bf16)."""
    linear = _linear(130, 71, True, dtype)
    direct = _bound(kernel, linear)
    if not amx:
        direct.amx_rows = 0
    x = torch.randn(4, 71).to(dtype)
    x[1, 5], x[2, 9] = float("nan"), float("inf")
    got = direct(x).double()
    with torch.no_grad():
        exact = exact_linear(x, linear)
    assert torch.equal(got.isnan(), exact.isnan()) and bool(got[1].isnan().all())
    assert torch.equal(got.isinf(), exact.isinf()) and bool(got[2].isfinite().sum() == 0)
    finite = exact.isfinite()
    scale = exact[finite].abs().max()
    assert bool((got[finite] - exact[finite]).abs().max() <= 2**-7 * scale)


def test_the_compiler_probe_tells_known_flags_from_unknown_ones() -> None:
    """``compiler_accepts`` gates the AMX flags: a flag the compiler rejects is refused (so
    the kernel builds without it), one it knows is accepted."""
    if kernel_build.compiler() is None:
        assert not kernel_build.compiler_accepts("-O2")
        return
    assert kernel_build.compiler_accepts("-O2")
    assert not kernel_build.compiler_accepts("-mleyline-no-such-extension")


def test_the_kernel_is_built_with_the_tile_unit_where_the_cpu_has_it() -> None:
    """The AMX flags are in the build exactly where the CPU lists AMX-BF16 (on AVX-512) and
    the compiler takes them."""
    flags = linear_kernel._flags(True)
    amx = AVX512 and AMX_BF16 and kernel_build.compiler_accepts("-mamx-tile", "-mamx-bf16")
    assert ("-mamx-bf16" in flags) == amx and ("-mamx-tile" in flags) == amx
