"""Read the rope band from vLLM's own rotary embedding module (the classes ``get_rope`` builds).

The cached keys were rotated by that module, so a shift must use exactly its frequencies
(its own ``_compute_inv_freq``, fp32) and its pairing (``is_neox_style``: half-split; else
GPT-J's interleaved pairs). The band is then checked against the module's ``cos_sin_cache``,
the table its forward reads: a module that rotates with anything else is refused. Its
attention scaling (YaRN's mscale, baked into that table) is never applied: it is already in
every cached key.

Exact classes only: default, llama3, YaRN and DeepSeek-YaRN. Everything else is refused with
``unsupported_rope``: frequencies that depend on the sequence length (dynamic NTK,
dual-chunk), positions that are not one integer (M-RoPE), a band elsewhere than the leading
dims (DeepSeek-V4), tables this module does not read (longrope's short and long sets, linear
scaling's tables behind offsets), other formulas (NTK, Fourier, Gemma 4's proportional).
"""

from __future__ import annotations

from typing import Any

import torch

from leyline.core.errors import SpliceUnsupportedError
from leyline.engine.rope_band import RopeBand, band_of_rotary, common_band
from leyline.protocol.fallback import FallbackReason

#: Rows of the cos/sin table compared with the band (evenly spread, the last included).
_CHECKED_POSITIONS = 257
#: Allowed difference from the table, in units of its dtype's epsilon times the scaling:
#: cos and sin of the same fp32 angles, from two code paths, then cast.
_TABLE_TOLERANCE_EPS = 4


def _shiftable() -> dict[type, str]:
    """Exact classes -> the attribute passed to their ``_compute_inv_freq``."""
    from vllm.model_executor.layers.rotary_embedding import (
        DeepseekScalingRotaryEmbedding,
        Llama3RotaryEmbedding,
        RotaryEmbedding,
        YaRNScalingRotaryEmbedding,
    )

    return {
        RotaryEmbedding: "base",
        Llama3RotaryEmbedding: "base",
        YaRNScalingRotaryEmbedding: "scaling_factor",
        DeepseekScalingRotaryEmbedding: "scaling_factor",
    }


def _refuse(message: str) -> SpliceUnsupportedError:
    return SpliceUnsupportedError(FallbackReason.unsupported_rope, message)


def _check_table(rotary: Any, band: RopeBand) -> None:
    """Refuse unless the module's cos/sin table is the band's, at vLLM's own fp32 angles."""
    table = getattr(rotary, "cos_sin_cache", None)
    if not isinstance(table, torch.Tensor) or table.dim() != 2 or table.shape[1] != band.width:
        raise _refuse(f"{type(rotary).__name__} has no cos/sin table of the band's width")
    last = int(table.shape[0]) - 1
    positions = torch.linspace(0, last, _CHECKED_POSITIONS).round().long()
    angles = positions.float()[:, None] * band.inv_freq[None, :]  # as vLLM forms them
    scale = float(getattr(rotary, "mscale", 1.0))
    want = torch.cat((angles.cos() * scale, angles.sin() * scale), dim=-1).to(table.dtype)
    got = table[positions.to(table.device)].cpu()
    tolerance = _TABLE_TOLERANCE_EPS * torch.finfo(table.dtype).eps * max(1.0, abs(scale))
    if not torch.allclose(got.float(), want.float(), rtol=0.0, atol=tolerance):
        raise _refuse(f"{type(rotary).__name__}'s cos/sin table differs from its frequencies")


def band_of(rotary: Any) -> RopeBand:
    """The band of one vLLM rotary module, or ``unsupported_rope``."""
    band = band_of_rotary(rotary, _shiftable())
    _check_table(rotary, band)
    return band


def _is_rotary(module: torch.nn.Module) -> bool:
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase

    # Longrope and dual-chunk derive from no common base; their names give them away.
    return isinstance(module, RotaryEmbeddingBase) or type(module).__name__.endswith(
        "RotaryEmbedding"
    )


def band_of_model(model: torch.nn.Module) -> RopeBand:
    """The one band every rotary module of ``model`` uses (vLLM shares one module between
    layers with the same rope); refused when they differ or one cannot be shifted."""
    return common_band(band_of(m) for m in model.modules() if _is_rotary(m))
