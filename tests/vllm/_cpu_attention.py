"""vLLM's CPU attention layer as the forward uses it for cache writes: the real backend
impl, and the attributes its write reads from the ``Attention`` layer (ISA, scales)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl, _get_attn_isa

from leyline.vllm.kv_layout import RowShape


def cpu_attention_layer(dtype: torch.dtype, rows: RowShape) -> SimpleNamespace:
    config = VllmConfig()
    # The impl reads only the model dtype from the model config (no model needed here).
    config.model_config = SimpleNamespace(dtype=dtype)
    with set_current_vllm_config(config):
        impl = CPUAttentionBackendImpl(
            num_heads=2 * rows.num_kv_heads,
            head_size=rows.head_size,
            scale=rows.head_size**-0.5,
            num_kv_heads=rows.num_kv_heads,
            alibi_slopes=None,
            sliding_window=None,
            kv_cache_dtype="auto",
        )
    return SimpleNamespace(
        impl=impl,
        isa=_get_attn_isa(dtype, rows.block_size, rows.head_size, "auto"),
        _k_scale_float=1.0,
        _v_scale_float=1.0,
    )


def kv_cache(num_blocks: int, rows: RowShape, dtype: torch.dtype) -> torch.Tensor:
    """One layer's tensor as vLLM's CPU backend allocates it."""
    shape = (num_blocks, rows.num_kv_heads, rows.block_size, 2 * rows.head_size)
    return torch.zeros(shape, dtype=dtype)
