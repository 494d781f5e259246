"""RoPE algebra: frequencies from transformers, delta rotation against transformers' own rope."""

from __future__ import annotations

import pytest
import torch
from transformers.models.deepseek_v2.modeling_deepseek_v2 import (
    DeepseekV2RotaryEmbedding,
    apply_rotary_emb,
)
from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from leyline.core.errors import SpliceUnsupportedError
from leyline.engine.models import tiny_mla_config
from leyline.engine.rope import delta_rotate, rope_spec
from leyline.protocol.fallback import FallbackReason

from ._helpers import YARN, rel_err, tiny_llama

LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}
LINEAR = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}


@pytest.mark.parametrize(
    "params", [None, YARN, LLAMA3, LINEAR], ids=["default", "yarn", "llama3", "linear"]
)
def test_inv_freq_is_the_models_own_buffer(params: dict | None) -> None:
    model = tiny_llama(params).model
    spec = rope_spec(model)
    assert torch.equal(spec.inv_freq, model.model.rotary_emb.inv_freq.float())
    assert spec.rope_type == (params or {"rope_type": "default"})["rope_type"]


def test_yarn_scaling_is_reported_but_never_applied() -> None:
    spec = rope_spec(tiny_llama(YARN).model)
    assert spec.attention_scaling > 1.05  # YaRN's mscale, baked into cos/sin by transformers
    x = torch.randn(1, 2, 5, 32)
    # A rotation preserves norms: any re-applied scaling would show here.
    out = delta_rotate(x, 123, spec.inv_freq, "half")
    assert torch.allclose(out.norm(dim=-1), x.norm(dim=-1), rtol=1e-5)


def test_dynamic_ntk_is_refused_with_a_typed_reason() -> None:
    model = tiny_llama({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}).model
    with pytest.raises(SpliceUnsupportedError) as info:
        rope_spec(model)
    assert info.value.reason is FallbackReason.unsupported_rope


def test_delta_zero_is_the_identity_bitwise() -> None:
    x = torch.randn(1, 3, 7, 64).to(torch.bfloat16)
    inv_freq = rope_spec(tiny_llama().model).inv_freq
    for pairing in ("half", "interleaved"):
        out = delta_rotate(x, 0, inv_freq, pairing)
        assert torch.equal(out, x) and out.data_ptr() != x.data_ptr()


def test_rotations_compose_and_invert() -> None:
    x = torch.randn(2, 3, 11, 32, dtype=torch.float64).float()
    f = rope_spec(tiny_llama().model).inv_freq
    for pairing in ("half", "interleaved"):
        twice = delta_rotate(delta_rotate(x, 40, f, pairing), -15, f, pairing)
        assert rel_err(twice, delta_rotate(x, 25, f, pairing)) < 1e-6
        assert rel_err(delta_rotate(delta_rotate(x, 300, f, pairing), -300, f, pairing), x) < 1e-6


def test_partial_band_leaves_other_dims_bitwise() -> None:
    x = torch.randn(1, 2, 4, 48)
    f = torch.rand(8)  # a 16-dim band
    out = delta_rotate(x, 9, f, "half", offset=32)
    assert torch.equal(out[..., :32], x[..., :32])
    assert not torch.equal(out[..., 32:], x[..., 32:])


def test_half_split_matches_llama_rope_at_the_new_position() -> None:
    model = tiny_llama(YARN).model
    rotary: LlamaRotaryEmbedding = model.model.rotary_emb
    k = torch.randn(1, 2, 6, 32)
    old = torch.arange(100, 106).unsqueeze(0)
    cos0, sin0 = rotary(k, old)
    cos1, sin1 = rotary(k, old + 57)
    at_old = apply_rotary_pos_emb(k, k, cos0, sin0)[1]
    at_new = apply_rotary_pos_emb(k, k, cos1, sin1)[1]
    spec = rope_spec(model)
    assert rel_err(delta_rotate(at_old, 57, spec.inv_freq, "half"), at_new) < 1e-5
    # The wrong pairing, or no rotation, is detectably wrong.
    assert rel_err(delta_rotate(at_old, 57, spec.inv_freq, "interleaved"), at_new) > 0.05
    assert rel_err(at_old, at_new) > 0.05


def test_interleaved_matches_deepseek_v2_complex_rope() -> None:
    config = tiny_mla_config("v2")
    rotary = DeepseekV2RotaryEmbedding(config)
    k = torch.randn(1, 1, 6, config.qk_rope_head_dim)
    old = torch.arange(10, 16).unsqueeze(0)
    at_old = apply_rotary_emb(k, k, rotary(k, old))[1]
    at_new = apply_rotary_emb(k, k, rotary(k, old - 7))[1]
    inv_freq = rotary.inv_freq.float()
    assert rel_err(delta_rotate(at_old, -7, inv_freq, "interleaved"), at_new) < 1e-5
    assert rel_err(delta_rotate(at_old, -7, inv_freq, "half"), at_new) > 0.05


def test_half_split_matches_deepseek_v3_interleaved_weights() -> None:
    """V3 reads interleaved weights but caches the rope band half-split."""
    config = tiny_mla_config("v3")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    rotary = DeepseekV3RotaryEmbedding(config)
    k = torch.randn(1, 1, 6, config.qk_rope_head_dim)
    old = torch.arange(30, 36).unsqueeze(0)
    at_old = apply_rotary_pos_emb_interleave(k, k, *rotary(k, old))[1]
    at_new = apply_rotary_pos_emb_interleave(k, k, *rotary(k, old + 200))[1]
    inv_freq = rotary.inv_freq.float()
    assert rel_err(delta_rotate(at_old, 200, inv_freq, "half"), at_new) < 1e-5
    assert rel_err(delta_rotate(at_old, 200, inv_freq, "interleaved"), at_new) > 0.05


def test_bf16_cache_rotates_in_fp32_and_casts_back() -> None:
    f = rope_spec(tiny_llama().model).inv_freq
    x = torch.randn(1, 2, 8, 32)
    out = delta_rotate(x.to(torch.bfloat16), 77, f, "half")
    assert out.dtype == torch.bfloat16
    assert rel_err(out.float(), delta_rotate(x, 77, f, "half")) < 1e-2


def test_fast_paths_agree_with_the_plain_formula() -> None:
    """Complex-view (interleaved), chunked (large bands) and strided fallbacks all match."""
    f = rope_spec(tiny_llama().model).inv_freq  # 16 frequencies: a 32-dim band
    big = torch.randn(1, 4, 3000, 32)  # > 1 MiB of band: rotated in token chunks
    strided = torch.randn(1, 4, 32, 50).transpose(-1, -2)  # last dim not contiguous
    for x in (big, strided):
        for pairing in ("half", "interleaved"):
            got = delta_rotate(x, 91, f, pairing)
            ang = f.double() * 91
            cos, sin = ang.cos(), ang.sin()
            xd = x.double()
            if pairing == "half":
                x1, x2 = xd[..., :16], xd[..., 16:]
                want = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)
            else:
                x1, x2 = xd[..., 0::2], xd[..., 1::2]
                want = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).flatten(-2)
            assert rel_err(got, want) < 1e-6, (pairing, x.shape)
