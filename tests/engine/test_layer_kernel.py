"""The fused few-row decoder layer (``layer_kernel``) against transformers' own layer forward:
one layer's queries, keys, values and output on random rows, and every kind of forward the
engine runs (``test_lean_layers._engine_ops``), in fp32 and bf16."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from transformers.models.llama import modeling_llama as llama

from leyline.engine.cpu import kernel_build, layer_kernel
from leyline.engine.cpu.layer_kernel import FusedLayer
from leyline.engine.cpu.linear_kernel import F32_ROWS
from leyline.engine.cpu.switches import OVERRIDES
from leyline.engine.engine import Engine
from leyline.engine.lean_layers import FUSED, transformers_layers
from leyline.engine.session import SessionCache

from ._helpers import fused_dtypes, needs_fused, random_tokens, tiny_llama
from .test_lean_layers import _engine_ops


def _engine(dtype: torch.dtype) -> Engine:
    loaded = tiny_llama(seed=2)
    loaded.model.to(dtype)
    return Engine(loaded)


def _fused(engine: Engine) -> list[FusedLayer]:
    return [layer.__dict__[FUSED] for layer in engine.model.model.layers if FUSED in vars(layer)]


@pytest.fixture(autouse=True)
def kernel() -> layer_kernel.LayerKernel:
    """The kernel: it must build wherever there is a C compiler (the skip is for machines
    without one, where the engine keeps the lean path)."""
    loaded = layer_kernel.load()
    if loaded is None:
        assert kernel_build.compiler() is None, layer_kernel.status().detail
        pytest.skip("no C compiler: the layer kernel cannot be built")
    return loaded


def _reference_layer(
    layer: llama.LlamaDecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """transformers' own modules and functions, op by op: q, k (rotated), v and the output
    for an attention output of ``attn`` (here: the values repeated, any fixed tensor)."""
    attn = layer.self_attn
    h = layer.input_layernorm(x)
    shape = (*x.shape[:-1], -1, attn.head_dim)
    q = attn.q_proj(h).view(shape).transpose(1, 2)
    k = attn.k_proj(h).view(shape).transpose(1, 2)
    v = attn.v_proj(h).view(shape).transpose(1, 2)
    q, k = llama.apply_rotary_pos_emb(q, k, cos, sin)
    groups = q.shape[1] // v.shape[1]
    fixed = v.repeat_interleave(groups, 1).transpose(1, 2).reshape(*x.shape[:-1], -1)
    y = x + attn.o_proj(fixed)
    out = y + layer.mlp(layer.post_attention_layernorm(y))
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), fixed, out


@pytest.mark.parametrize("dtype", fused_dtypes())
@pytest.mark.parametrize(("batch", "rows"), [(1, 1), (1, 3), (1, 17), (1, 32), (4, 1), (3, 2)])
def test_one_layer_equals_transformers_ops_within_rounding(
    dtype: torch.dtype, batch: int, rows: int
) -> None:
    """A sequence's rows, or a batch's (a batched decode step: each row at its own
    position)."""
    engine = _engine(dtype)
    layer = engine.model.model.layers[1]
    fused = layer.__dict__[FUSED]
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(batch, rows, fused.hidden, generator=g).to(dtype)
    positions = torch.arange(5, 5 + rows)[None] + 7 * torch.arange(batch)[:, None]
    cos, sin = engine.model.model.rotary_emb(x, positions)
    assert fused.takes(x, cos)
    with torch.no_grad():
        want = _reference_layer(layer, x, cos, sin)
        q, k, v = fused.pre(x, cos, sin)
        out = fused.post(x, want[3].contiguous())
    # fp32: the norm's sum runs in another order; bf16: a value may land one rounding apart
    tol = 1e-5 if dtype == torch.float32 else 2.0**-7
    for got, exact in zip((q, k, v, out), (*want[:3], want[4]), strict=True):
        assert got.shape == exact.shape and got.dtype == dtype
        err = (got.float() - exact.float()).abs().max() / exact.float().abs().max()
        assert err <= tol


@pytest.mark.parametrize("dtype", fused_dtypes())
def test_the_engine_on_fused_layers_agrees_with_transformers(dtype: torch.dtype) -> None:
    """Chunked prefill (not fused: too many rows), splices in place and by copy, FORGET,
    decode steps and a batched step: logits and KV within rounding of transformers'."""
    engine = _engine(dtype)
    assert len(_fused(engine)) == engine.fused_layers == 2
    with transformers_layers(engine.model):
        want = _engine_ops(engine)
    got = _engine_ops(engine)
    tol = 1e-4 if dtype == torch.float32 else 0.05
    for a, b in zip(got, want, strict=True):
        assert (a.float() - b.float()).abs().max() <= tol * max(1.0, float(b.abs().max()))


def test_the_activations_exp_is_within_a_ulp_and_clamped(
    kernel: layer_kernel.LayerKernel,
) -> None:
    """The kernels' exp (``csrc/kb_exp.h``: SiLU's here, the softmax's in attention)
    against fp64 over its whole range, dense and random; past it, the clamped values (SiLU
    is x or 0 there)."""
    g = torch.Generator().manual_seed(0)
    x = torch.cat(
        [torch.linspace(-87, 88, 400_001), (20 * torch.randn(200_000, generator=g)).clamp(-87, 88),
         torch.tensor([0.0, -0.0, 1e-30, -1e-30])]
    )  # fmt: skip
    got = kernel.exp(x).double()
    exact = torch.exp(x.double())
    ulp = (torch.nextafter(exact.float(), torch.tensor(float("inf"))) - exact.float()).double()
    assert float(((got - exact).abs() / ulp).max()) <= 1.05  # 1.014 measured
    edges = kernel.exp(torch.tensor([-100.0, 100.0, float("nan")]))
    assert edges[0] < 2e-38 and edges[1] > 1e38 and torch.isnan(edges[2])
    assert torch.equal(
        kernel.exp(torch.tensor([-100.0, 100.0])), kernel.exp(torch.tensor([-87.0, 88.0]))
    )


@pytest.mark.parametrize("dtype", fused_dtypes())
def test_k_and_v_side_by_side_equal_them_in_turn(dtype: torch.dtype) -> None:
    """With two threads a GQA layer's narrow k and v products run one per thread at once;
    each still runs alone on its thread, so the results are bitwise those of one thread. (A
    build without OpenMP runs both calls on one thread: the same equality, trivially.)"""
    engine = _engine(dtype)
    fused = _fused(engine)[0]
    assert fused.kv_heads * fused.head_dim < 256  # k and v take one thread each
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 17, fused.hidden, generator=g).to(dtype)
    cos, sin = engine.model.model.rotary_emb(x, torch.arange(17)[None])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = fused.pre(x, cos, sin)
        torch.set_num_threads(2)
        side_by_side = fused.pre(x, cos, sin)
    finally:
        torch.set_num_threads(before)
    for a, b in zip(alone, side_by_side, strict=True):
        assert torch.equal(a, b)


@needs_fused()
def test_more_rows_than_the_kernel_takes_run_the_lean_forward() -> None:
    engine = _engine(torch.float32)
    fused = _fused(engine)[0]
    assert fused.max_rows == F32_ROWS  # fp32 products of up to 32 rows on linear_kernel

    def takes(batch: int, seq: int, dtype: torch.dtype = torch.float32) -> bool:
        cos = torch.zeros(batch, seq, fused.head_dim)
        return fused.takes(torch.zeros(batch, seq, fused.hidden, dtype=dtype), cos)

    assert takes(1, F32_ROWS) and takes(F32_ROWS, 1) and takes(4, 8)
    assert not takes(1, F32_ROWS + 1) and not takes(F32_ROWS + 1, 1)
    assert not takes(1, 4, torch.bfloat16)
    x = torch.zeros(3, 1, fused.hidden)  # position embeddings broadcast over the batch
    assert not fused.takes(x, torch.zeros(1, 1, fused.head_dim))


@needs_fused()
def test_a_hooked_product_runs_its_module_so_the_hook_fires() -> None:
    engine = _engine(torch.float32)
    layer = engine.model.model.layers[0]
    fused = layer.__dict__[FUSED]
    seen: list[int] = []
    hook = layer.self_attn.k_proj.register_forward_hook(lambda *_a: seen.append(1))
    try:
        assert not fused.takes(torch.zeros(1, 1, fused.hidden), torch.zeros(1, 1, 32))
        session = SessionCache(engine)
        session.prefill(random_tokens(5, engine.vocab_size, seed=1))
    finally:
        hook.remove()
    assert seen == [1] and fused.takes(torch.zeros(1, 1, fused.hidden), torch.zeros(1, 1, 32))


@contextmanager
def _switched_off(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setitem(OVERRIDES, "layer_kernel", "off")
    yield


def test_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    with _switched_off(monkeypatch):
        engine = _engine(torch.float32)
        assert engine.lean_layers == 2 and not _fused(engine) and engine.fused_layers == 0
        assert layer_kernel.status().detail == "layer_kernel switched off in process"


def _kl(p: torch.Tensor, q: torch.Tensor) -> float:
    lp, lq = torch.log_softmax(p.double(), -1), torch.log_softmax(q.double(), -1)
    return float((lp.exp() * (lp - lq)).sum(-1).max())


def _logits(engine: Engine, *, transformers: bool) -> list[torch.Tensor]:
    if transformers:
        with transformers_layers(engine.model):
            return _engine_ops(engine)[:5]
    return _engine_ops(engine)[:5]


@pytest.mark.slow
@needs_fused()
def test_smollm2_fp32_on_fused_layers_gives_transformers_next_tokens() -> None:
    engine = Engine.load("smollm2", dtype=torch.float32)
    assert len(_fused(engine)) == 30
    want, got = _logits(engine, transformers=True), _logits(engine, transformers=False)
    for a, b in zip(got, want, strict=True):
        assert _kl(b, a) <= 1e-8 and torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.slow
@needs_fused(torch.bfloat16)
def test_smollm2_bf16_on_fused_layers_is_as_near_fp32_as_transformers_bf16() -> None:
    """Two bf16 forwards round differently, so neither is the other's reference: both are
    measured against the fp32 model, and the fused one may be no further from it than
    twice the distance of transformers' own bf16 forward (measured: 1.0-1.4x)."""
    exact = _logits(Engine.load("smollm2", dtype=torch.float32), transformers=True)
    engine = Engine.load("smollm2", dtype=torch.bfloat16)
    assert len(_fused(engine)) == 30
    plain, fused = _logits(engine, transformers=True), _logits(engine, transformers=False)
    plain_kl = max(_kl(e, p) for e, p in zip(exact, plain, strict=True))
    fused_kl = max(_kl(e, f) for e, f in zip(exact, fused, strict=True))
    assert 0 < fused_kl <= 2 * plain_kl
