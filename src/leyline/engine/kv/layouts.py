"""Where the rotated dims live in a cache layer, detected from the cache rather than assumed.

:func:`detect_layout` probes the model once and finds the one tensor, offset and pairing
that a rotation explains; a layout it cannot pin down is refused, so splices fall back to
re-prefill instead of rotating the wrong dims.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from transformers import PreTrainedModel

from leyline.core.errors import SpliceUnsupportedError
from leyline.engine.forward import prefill_at
from leyline.engine.kv.kv_blocks import LayerKV
from leyline.engine.rope import Pairing, RopeSpec, delta_rotate
from leyline.protocol.fallback import FallbackReason

LayoutKind = Literal["gqa", "mla-latent", "mla-full-keys"]
"""The known layouts; every ``KVCache`` layer is ``(tensor0, tensor1)``, sequence on dim -2.

- ``gqa`` (GQA/MHA): ``(keys, values)``; the rotary band is the first ``rotary_dim`` dims
  of every key head (all of them unless partial rotary), half-split in HF models.
- ``mla-latent`` (MLA, transformers >= 5.15): ``(latent, rope_band)``: the normalised
  latent ``[B, 1, T, kv_lora_rank]`` is position-free; the shared rope key
  ``[B, 1, T, rope_dim]`` is stored already rotated (interleaved pairs in DeepSeek-V2,
  half-split in V3).
- ``mla-full-keys`` (MLA, older transformers): full per-head keys ``[B, H, T, nope + rope]``
  with the band last.
"""

_PROBE_LEN = 8
_PROBE_SHIFT = 5


@dataclass(frozen=True, slots=True)
class CacheLayout:
    """The rotary band of a cache layer: tensor ``slot``, dims ``[offset, offset + width)``."""

    kind: LayoutKind
    slot: int
    offset: int
    width: int
    pairing: Pairing


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def match_layouts(
    unshifted: LayerKV, shifted: LayerKV, shift: int, rope: RopeSpec, *, tol: float
) -> list[tuple[int, int, Pairing]]:
    """Every (slot, offset, pairing) that maps ``unshifted`` onto ``shifted`` by rotation.

    Pure function of two layer-0 probe caches; the unit tests feed it synthetic layouts.
    """
    width = rope.rotary_dim
    found: list[tuple[int, int, Pairing]] = []
    for slot, tensor in enumerate(unshifted):
        others_equal = all(
            _rel_err(unshifted[j], shifted[j]) <= tol for j in range(len(unshifted)) if j != slot
        )
        dim = tensor.shape[-1]
        if not others_equal or width > dim:
            continue
        for offset in sorted({0, dim - width}):
            for pairing in ("half", "interleaved"):
                moved = delta_rotate(tensor, shift, rope.inv_freq, pairing, offset=offset)
                if _rel_err(moved, shifted[slot]) <= tol:
                    found.append((slot, offset, pairing))
    return found


def _kind(model: PreTrainedModel, slot: int) -> LayoutKind:
    if getattr(model.config, "kv_lora_rank", None) is None:
        return "gqa"
    return "mla-latent" if slot == 1 else "mla-full-keys"


def _refuse_sliding(model: PreTrainedModel) -> None:
    layer_types = getattr(model.config, "layer_types", None) or ()
    if any(t != "full_attention" for t in layer_types):
        raise SpliceUnsupportedError(
            FallbackReason.unsupported_layout,
            f"layer types {sorted(set(layer_types))}: only full-attention layers can be spliced",
        )


def detect_layout(model: PreTrainedModel, rope: RopeSpec) -> CacheLayout:
    """Probe ``model`` and return the layout of its cache.

    The same few tokens are prefilled at positions ``0..n`` and ``s..s+n``. At layer 0 a
    key depends only on its token and position, so exactly one (tensor, offset, pairing)
    must turn the first cache into the second when rotated by ``s``, while everything
    outside the band stays equal (:func:`match_layouts`).

    Raises:
        SpliceUnsupportedError: ``unsupported_layout`` when no single band explains the probe.
    """
    _refuse_sliding(model)
    vocab = int(model.config.vocab_size)
    probe = [(17 + 31 * i) % vocab for i in range(_PROBE_LEN)]
    a = prefill_at(model, probe, 0)[0]
    b = prefill_at(model, probe, _PROBE_SHIFT)[0]
    tol = 1e-4 if a[0].dtype == torch.float32 else 3e-2
    found = match_layouts(a, b, _PROBE_SHIFT, rope, tol=tol)
    if len(found) != 1:
        shapes = [tuple(t.shape) for t in a]
        raise SpliceUnsupportedError(
            FallbackReason.unsupported_layout,
            f"cache layer shapes {shapes}: {len(found)} rotary layouts fit the probe "
            f"({found}); expected exactly one",
        )
    slot, offset, pairing = found[0]
    return CacheLayout(_kind(model, slot), slot, offset, rope.rotary_dim, pairing)
