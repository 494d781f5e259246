"""Read the rope band from the SGLang model itself: its rotary module's own frequencies.

The cached keys were rotated by SGLang's rotary embedding, so the delta rotation must use
exactly its inverse frequencies (``_compute_inv_freq``, fp32) and its pairing
(``is_neox_style``: half-split; else interleaved, as DeepSeek's ``rope_interleave``). The
module's attention scaling (YaRN mscale, baked into its cos/sin cache) is never used: it is
already in every cached key. Rope variants whose frequencies depend on the sequence length
or position (dynamic NTK, longrope, dual-chunk, M-RoPE) are refused: ``unsupported_rope``.
"""

from __future__ import annotations

from typing import Any

import torch

from leyline.engine.rope_band import RopeBand, band_of_rotary, common_band


def band_of(rotary: Any) -> RopeBand:
    """The band of one SGLang rotary module, or ``unsupported_rope``."""
    from sglang.srt.layers.rotary_embedding import base as rope_base
    from sglang.srt.layers.rotary_embedding import rope_variant, yarn

    # Exact classes -> the attribute passed to their ``_compute_inv_freq``.
    shiftable: dict[type, str] = {
        rope_base.RotaryEmbedding: "base",
        rope_variant.Llama3RotaryEmbedding: "base",
        rope_variant.DeepseekScalingRotaryEmbedding: "scaling_factor",
        yarn.YaRNScalingRotaryEmbedding: "scaling_factor",
    }
    return band_of_rotary(rotary, shiftable)


def band_of_model(model: torch.nn.Module) -> RopeBand:
    """The one band every attention layer of ``model`` uses; refused when layers differ."""
    from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding

    # Every SGLang rope module keeps a cos/sin cache; the refusals above name the odd ones.
    rotaries = [
        m for m in model.modules() if isinstance(m, RotaryEmbedding) or hasattr(m, "cos_sin_cache")
    ]
    return common_band(band_of(m) for m in rotaries)
