"""The rope band of a serving engine's cached keys (SGLang, vLLM): frequencies and pairing,
read from the engine's own rotary module, so a backend can move its keys by a shift."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from leyline.core.errors import SpliceUnsupportedError
from leyline.engine.rope import Pairing
from leyline.protocol.fallback import FallbackReason


@dataclass(frozen=True, slots=True)
class RopeBand:
    """The frequencies a serving engine (SGLang, vLLM) rotated its cached keys with, and how
    it paired the dims of the band (``width`` dims; where they sit is the cache layout's)."""

    inv_freq: torch.Tensor
    """fp32, ``[rotary_dim // 2]``."""
    pairing: Pairing

    @property
    def width(self) -> int:
        return 2 * int(self.inv_freq.numel())


def band_of_rotary(rotary: Any, shiftable: Mapping[type, str]) -> RopeBand:
    """The band of a rotary module of vLLM's lineage (vLLM's classes and SGLang's forks of
    them): its own ``_compute_inv_freq`` fed the attribute ``shiftable`` names for its exact
    class (subclasses change the frequencies), and ``is_neox_style`` (half-split, else
    interleaved). Any other class: ``unsupported_rope``."""
    arg = shiftable.get(type(rotary))
    if arg is None:
        names = ", ".join(sorted(cls.__name__ for cls in shiftable))
        raise SpliceUnsupportedError(
            FallbackReason.unsupported_rope,
            f"{type(rotary).__name__} cannot be shifted exactly (only {names})",
        )
    with torch.no_grad():
        inv_freq = rotary._compute_inv_freq(getattr(rotary, arg))
    inv_freq = inv_freq.detach().to(device="cpu", dtype=torch.float32)
    return RopeBand(inv_freq, "half" if rotary.is_neox_style else "interleaved")


def common_band(bands: Iterable[RopeBand]) -> RopeBand:
    """The one band all of a model's rotary modules use; ``unsupported_rope`` when there is
    none or they differ (one shift must fit every layer's keys)."""
    found = list(bands)
    if not found:
        raise SpliceUnsupportedError(FallbackReason.unsupported_rope, "the model has no RoPE")
    first = found[0]
    for band in found[1:]:
        if band.pairing != first.pairing or not torch.equal(band.inv_freq, first.inv_freq):
            raise SpliceUnsupportedError(
                FallbackReason.unsupported_rope, "the model's layers use different RoPEs"
            )
    return first
