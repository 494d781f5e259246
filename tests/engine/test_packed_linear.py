"""Linear layers on oneDNN's packed weights (``packed_linear``) against an fp64 product and
against the unpacked model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from leyline.engine.cpu import linear_kernel
from leyline.engine.cpu.packed_linear import (
    PackedLinear,
    PackReport,
    pack_linear_layers,
    packing_refusal,
)
from leyline.engine.cpu.switches import OVERRIDES
from leyline.engine.engine import Engine

from ._helpers import rel_err, tiny_llama
from ._kernels import exact_linear, needs_onednn

pytestmark = needs_onednn


def _linear(out_features: int, in_features: int, bias: bool, seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias).eval()


@torch.no_grad()
def _max_err(got: torch.Tensor, x: torch.Tensor, linear: nn.Linear) -> float:
    """Largest error against the fp64 product, relative to the output's largest entry."""
    exact = exact_linear(x, linear)
    return float((got.double() - exact).abs().max() / exact.abs().max())


@pytest.mark.parametrize("rows", [1, 3, 17, 64, 512])
@pytest.mark.parametrize(("out_features", "in_features", "bias"), [(576, 576, False),
                                                                   (192, 576, True),
                                                                   (100, 36, True)])  # fmt: skip
def test_fp32_matches_an_fp64_product_like_the_plain_one(
    rows: int, out_features: int, in_features: int, bias: bool
) -> None:
    linear = _linear(out_features, in_features, bias, seed=rows)
    x = torch.randn(1, rows, in_features)  # the model's [batch, tokens, features]
    with torch.no_grad():
        got, plain = PackedLinear(linear)(x), linear(x)
    assert got.shape == plain.shape and got.dtype == torch.float32
    # A different summation order: as close to the exact product as torch's own, give or
    # take fp32 rounding of the output.
    assert _max_err(got, x, linear) <= 4 * _max_err(plain, x, linear) + 1e-6


@pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="no native bf16 on this CPU"
)
@pytest.mark.parametrize("rows", [1, 17, 512])
def test_bf16_stays_within_bf16_rounding_of_the_exact_product(rows: int) -> None:
    linear = _linear(576, 576, True, seed=rows).to(torch.bfloat16)
    x = torch.randn(rows, 576).to(torch.bfloat16)
    with torch.no_grad():
        got = PackedLinear(linear)(x)
    assert got.dtype == torch.bfloat16
    assert _max_err(got, x, linear) <= 2**-8  # one bf16 rounding of the largest output


def test_a_non_contiguous_input_and_the_plain_weight_come_back() -> None:
    linear = _linear(48, 40, True, seed=1)
    packed = PackedLinear(linear)
    x = torch.randn(5, 80)[:, ::2]
    with torch.no_grad():
        assert rel_err(packed(x), linear(x)) <= 1e-6
    assert torch.equal(packed.weight, linear.weight.detach())


def test_an_input_of_another_dtype_is_refused() -> None:
    packed = PackedLinear(_linear(8, 8, False, seed=2))
    with pytest.raises(TypeError, match=r"float32 weights, got torch\.bfloat16"):
        packed(torch.randn(2, 8).to(torch.bfloat16))


def test_a_packed_model_gives_the_unpacked_models_logits_and_holds_no_second_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(OVERRIDES, "packed_linear", "on")
    plain, packed = tiny_llama(seed=3).model, tiny_llama(seed=3).model
    linears = sum(type(m) is nn.Linear for m in plain.modules())
    before = sum(p.numel() for p in packed.parameters())
    report = pack_linear_layers(packed)
    assert report.packed == linears and not report.reason
    assert not any(type(m) is nn.Linear for m in packed.modules())
    # The weights moved into the packed tensors: only embeddings, norms and biases remain
    # as parameters (the tiny model's head is not tied to its embedding).
    linear_params = sum(m.weight.numel() for m in plain.modules() if type(m) is nn.Linear)
    assert sum(p.numel() for p in packed.parameters()) == before - linear_params
    ids = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = packed(ids).logits, plain(ids).logits
    assert rel_err(got, want) <= 1e-5
    assert pack_linear_layers(packed).packed == linears  # a second call changes nothing


def test_the_switch_keeps_torchs_default_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LEYLINE_CPU_KERNELS", "0")  # the whole wing off
    engine = Engine(tiny_llama(seed=4))
    assert engine.packing.packed == 0 and engine.packing.reason == "LEYLINE_CPU_KERNELS=0"
    assert any(type(m) is nn.Linear for m in engine.model.modules())


def test_the_engine_packs_by_default_on_avx512_and_says_why_not_where_it_cannot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delitem(OVERRIDES, "packed_linear", raising=False)
    engine = Engine(tiny_llama(seed=5))
    if torch.backends.cpu.get_cpu_capability() == "AVX512":
        assert engine.packing.packed > 0 and not engine.packing.reason
    else:
        assert engine.packing.packed == 0 and "AVX-512" in engine.packing.reason
    monkeypatch.setitem(OVERRIDES, "packed_linear", "on")
    assert Engine(tiny_llama(seed=5)).packing.packed > 0
    half = tiny_llama(seed=5).model.to(torch.float16)
    assert packing_refusal(half) == "torch.float16 weights"


def test_the_report_describes_itself_in_one_line() -> None:
    assert PackReport(0, "LEYLINE_CPU_KERNELS=0").describe() == (
        "linear layers unpacked (LEYLINE_CPU_KERNELS=0)"
    )
    assert PackReport(211, "").describe() == "211 linear layers on oneDNN-packed weights"
    assert PackReport(211, "", 200, "lib.so", 30).describe() == (
        "211 linear layers on oneDNN-packed weights, 200 with few-row products on linear_kernel"
        " (30 on the tile unit)"
    )
    assert PackReport(211, "", 200, "lib.so").describe() == (
        "211 linear layers on oneDNN-packed weights, 200 with few-row products on linear_kernel"
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_report_counts_the_layers_on_the_tile_unit(dtype: torch.dtype) -> None:
    """bf16 layers on oneDNN's AMX packing run on the tiles where the kernel has them;
    fp32 layers never do."""
    kernel = linear_kernel.load()
    loaded = tiny_llama(seed=6)
    loaded.model.to(dtype)
    report = Engine(loaded).packing
    layers = [m for m in loaded.model.modules() if isinstance(m, PackedLinear)]
    on_tiles = [m for m in layers if m.direct is not None and m.direct.amx_rows]
    assert report.tiles == len(on_tiles)
    if dtype == torch.float32 or kernel is None or not kernel.amx:
        assert report.tiles == 0
    else:  # every bf16 layer bound to the kernel reads the AMX packing here
        assert report.tiles == report.direct > 0
        assert all(m.kernel_rows == linear_kernel.AMX_ROWS for m in on_tiles)
