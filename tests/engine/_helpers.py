"""Small builders and measures shared by the engine tests."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PhiConfig,
    PhiForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
)

from leyline.engine.kv.kv_blocks import KVCache
from leyline.engine.models import LoadedModel

YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 8.0,  # = max_position_embeddings / original, as transformers expects
    "original_max_position_embeddings": 256,
}


# What the tiny random models share; ``initializer_range`` high enough that attention is
# not uniform.
_TINY: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 2048,
    "initializer_range": 0.1,
}


def _random_model(
    model_class: type[PreTrainedModel], config: PretrainedConfig, name: str, seed: int
) -> LoadedModel:
    torch.manual_seed(seed)
    model = model_class(config).eval()
    return LoadedModel(model, None, name, "random", random_weights=True)


def tiny_llama(rope_parameters: dict[str, Any] | None = None, *, seed: int = 0) -> LoadedModel:
    """A random 2-layer GQA Llama (label says random)."""
    rope = rope_parameters or {"rope_type": "default", "rope_theta": 10000.0}
    config = LlamaConfig(**_TINY, num_key_value_heads=2, rope_parameters=rope)
    return _random_model(LlamaForCausalLM, config, "tiny-llama", seed)


def tiny_phi(*, seed: int = 0) -> LoadedModel:
    """A random Phi with partial rotary (half of each head rotated)."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    config = PhiConfig(**_TINY, rope_parameters=rope)
    return _random_model(PhiForCausalLM, config, "tiny-phi", seed)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """KL(P || Q) of two next-token distributions given as logits."""
    p = torch.log_softmax(p_logits.double(), -1)
    q = torch.log_softmax(q_logits.double(), -1)
    return float((p.exp() * (p - q)).sum())


def kv_bitwise_equal(a: KVCache, b: KVCache) -> bool:
    return len(a) == len(b) and all(
        len(la) == len(lb) and all(torch.equal(x, y) for x, y in zip(la, lb, strict=True))
        for la, lb in zip(a, b, strict=True)
    )


def snapshot(kv: KVCache) -> KVCache:
    """Deep copies, to compare against after an operation that must not change anything."""
    return tuple(tuple(t.clone() for t in layer) for layer in kv)


def random_tokens(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


@functools.cache
def fused_refusal(dtype: torch.dtype = torch.float32) -> str:
    """Why the engine's fused layers (``layer_kernel`` over ``linear_kernel``) do not run on
    this CPU in ``dtype``; empty where they do. They read oneDNN's packed weights directly,
    which the engine packs by default on AVX-512 CPUs only and which oneDNN lays out as
    ``linear_kernel`` reads them only there: elsewhere (an AVX2 CPU) the engine keeps the
    lean path, and the tests of the fused path have nothing to run."""
    from leyline.engine.cpu.fused_forward import fused_model
    from leyline.engine.engine import Engine

    loaded = tiny_llama(seed=2)
    loaded.model.to(dtype)
    if fused_model(Engine(loaded).model) is not None:
        return ""
    capability = torch.backends.cpu.get_cpu_capability()
    return (
        f"the fused layers do not run on this CPU ({capability}, {dtype}): the engine "
        "packs linear weights in linear_kernel's layout on AVX-512 CPUs only"
    )


def needs_fused(dtype: torch.dtype = torch.float32) -> pytest.MarkDecorator:
    """Skip (saying why) where the fused layers cannot run in ``dtype``."""
    reason = fused_refusal(dtype)
    return pytest.mark.skipif(bool(reason), reason=reason or "runs")


def fused_dtypes() -> list[Any]:
    """fp32 and bf16 as parameters, each skipped where the fused layers cannot run in it."""
    return [pytest.param(d, marks=needs_fused(d)) for d in (torch.float32, torch.bfloat16)]
