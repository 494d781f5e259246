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

from leyline.core.errors import SpliceUnsupportedError
from leyline.protocol.fallback import FallbackReason
from leyline.sglang.kv_rows import RopeBand

#: class name -> the attribute passed to its ``_compute_inv_freq``. Exact classes only.
_SHIFTABLE = {
    "RotaryEmbedding": "base",
    "Llama3RotaryEmbedding": "base",
    "DeepseekScalingRotaryEmbedding": "scaling_factor",
    "YaRNScalingRotaryEmbedding": "scaling_factor",
}


def band_of(rotary: Any) -> RopeBand:
    """The band of one SGLang rotary module, or ``unsupported_rope``."""
    from sglang.srt.layers.rotary_embedding import base as rope_base
    from sglang.srt.layers.rotary_embedding import rope_variant, yarn

    name = type(rotary).__name__
    known = {
        "RotaryEmbedding": rope_base.RotaryEmbedding,
        "Llama3RotaryEmbedding": rope_variant.Llama3RotaryEmbedding,
        "DeepseekScalingRotaryEmbedding": rope_variant.DeepseekScalingRotaryEmbedding,
        "YaRNScalingRotaryEmbedding": yarn.YaRNScalingRotaryEmbedding,
    }
    if name not in _SHIFTABLE or type(rotary) is not known[name]:
        raise SpliceUnsupportedError(
            FallbackReason.unsupported_rope,
            f"{name} cannot be shifted exactly (only {', '.join(sorted(_SHIFTABLE))})",
        )
    with torch.no_grad():
        inv_freq = rotary._compute_inv_freq(getattr(rotary, _SHIFTABLE[name]))
    inv_freq = inv_freq.detach().to(device="cpu", dtype=torch.float32)
    return RopeBand(inv_freq, "half" if rotary.is_neox_style else "interleaved")


def band_of_model(model: torch.nn.Module) -> RopeBand:
    """The one band every attention layer of ``model`` uses; refused when layers differ."""
    from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding

    # Every SGLang rope module keeps a cos/sin cache; the refusals above name the odd ones.
    rotaries = [
        m for m in model.modules() if isinstance(m, RotaryEmbedding) or hasattr(m, "cos_sin_cache")
    ]
    if not rotaries:
        raise SpliceUnsupportedError(FallbackReason.unsupported_rope, "the model has no RoPE")
    bands = [band_of(m) for m in rotaries]
    first = bands[0]
    for band in bands[1:]:
        if band.pairing != first.pairing or not torch.equal(band.inv_freq, first.inv_freq):
            raise SpliceUnsupportedError(
                FallbackReason.unsupported_rope, "the model's layers use different RoPEs"
            )
    return first
