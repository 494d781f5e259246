"""Drift of the rope band over 1..K repeated splices: bf16 storage, fp32 vs bf16 rotation.

A token downstream of many edits is rotated once per edit. Its stored key is rounded to
the cache dtype after every rotation, so errors can accumulate. Starting from real keys
(the rope band of one prompt's downstream tokens, every layer), each arm applies the same
sequence of deltas and is compared after every step with the EXACT result: the original
fp32 band rotated once by the cumulative delta in fp64 (angles and products, written here
independently of the engine's rotation code).

Arms:
- ``bf16 store, fp32 rotate``: the engine's ``rotate_into`` on a bf16 band (it upcasts,
  rotates in fp32 with fp64 angles, casts back): what Leyline does with a bf16 cache;
- ``bf16 store, bf16 rotate``: cos/sin rounded to bf16 and every product and sum in bf16,
  as a kernel working in the cache dtype would;
- ``fp32 store, fp32 rotate``: the engine on an fp32 band (the floor).

Step 0 is the storage cast alone (bf16 rounding of the original keys). Delta patterns:
``chain`` (seeded deltas in [-300, 300]: edits of both signs, as an agent's splices) and
``alternating`` (+137, -137, ...: back to the original position every second step).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from leyline.engine.rope import Pairing, rotate_into

Rotate = Callable[[torch.Tensor, int], torch.Tensor]
ARMS = ("bf16 store, fp32 rotate", "bf16 store, bf16 rotate", "fp32 store, fp32 rotate")
PATTERNS = ("chain", "alternating")
ALTERNATING_DELTA = 137


@dataclass(frozen=True, slots=True)
class DriftResult:
    deltas: dict[str, list[int]]
    errors: dict[str, dict[str, list[float]]]
    """pattern -> arm -> relative L2 vs exact after 0..K splices (index = splice count)."""
    elements: int
    """Numbers in the band (all layers, heads, tokens, rope dims)."""


def deltas_for(pattern: str, count: int, seed: int) -> list[int]:
    if pattern == "alternating":
        return [ALTERNATING_DELTA * (1 if k % 2 == 0 else -1) for k in range(count)]
    r = random.Random(f"drift:{seed}")
    return [r.choice((-1, 1)) * r.randrange(1, 301) for _ in range(count)]


def _pairs(x: torch.Tensor, pairing: Pairing) -> tuple[torch.Tensor, torch.Tensor]:
    half = x.shape[-1] // 2
    if pairing == "half":
        return x[..., :half], x[..., half:]
    return x[..., 0::2], x[..., 1::2]


def _join(y1: torch.Tensor, y2: torch.Tensor, pairing: Pairing) -> torch.Tensor:
    if pairing == "half":
        return torch.cat([y1, y2], dim=-1)
    return torch.stack([y1, y2], dim=-1).flatten(-2)


def rotate_exact(
    x: torch.Tensor, delta: int, inv_freq: torch.Tensor, pairing: Pairing
) -> torch.Tensor:
    """fp64 rotation of the whole band by ``delta`` (the reference)."""
    angles = inv_freq.double() * float(delta)
    c, s = angles.cos(), angles.sin()
    x1, x2 = _pairs(x.double(), pairing)
    return _join(x1 * c - x2 * s, x2 * c + x1 * s, pairing)


def rotate_bf16(
    x: torch.Tensor, delta: int, inv_freq: torch.Tensor, pairing: Pairing
) -> torch.Tensor:
    """Rotation computed in bf16: cos/sin rounded to bf16, each product and sum in bf16."""
    angles = inv_freq.double() * float(delta)
    c, s = angles.cos().bfloat16(), angles.sin().bfloat16()
    x1, x2 = _pairs(x, pairing)
    return _join(x1 * c - x2 * s, x2 * c + x1 * s, pairing)


def rotate_engine(
    x: torch.Tensor, delta: int, inv_freq: torch.Tensor, pairing: Pairing
) -> torch.Tensor:
    out: torch.Tensor = rotate_into(torch.empty_like(x), x, delta, inv_freq, pairing)
    return out


def drift(
    bands: Sequence[torch.Tensor],
    inv_freq: torch.Tensor,
    pairing: Pairing,
    max_splices: int,
    seed: int,
) -> DriftResult:
    """``bands``: per layer, the fp32 rope band ``[..., tokens, width]`` of real keys."""
    # One tensor for all layers: every arm then rotates all of them in one call.
    band = torch.cat([b.reshape(-1, b.shape[-1]) for b in bands]).float().contiguous()
    arms: dict[str, tuple[torch.dtype, Callable[..., torch.Tensor]]] = {
        ARMS[0]: (torch.bfloat16, rotate_engine),
        ARMS[1]: (torch.bfloat16, rotate_bf16),
        ARMS[2]: (torch.float32, rotate_engine),
    }
    deltas: dict[str, list[int]] = {}
    errors: dict[str, dict[str, list[float]]] = {}
    for pattern in PATTERNS:
        steps = deltas_for(pattern, max_splices, seed)
        deltas[pattern] = steps
        exact, total = [band.double()], 0
        for d in steps:
            total += d
            exact.append(rotate_exact(band, total, inv_freq, pairing))
        norms = [e.norm() for e in exact]
        errors[pattern] = {}
        for arm, (dtype, rotate) in arms.items():
            x = band.to(dtype)
            errs = [float((x.double() - exact[0]).norm() / norms[0])]
            for k, d in enumerate(steps, start=1):
                x = rotate(x, d, inv_freq, pairing)
                errs.append(float((x.double() - exact[k]).norm() / norms[k]))
            errors[pattern][arm] = errs
    return DriftResult(deltas, errors, int(band.numel()))
