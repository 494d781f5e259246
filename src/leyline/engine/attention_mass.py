"""Attention that also sums the weight its queries give a range of key positions.

COMPOSE's ``attention`` recompute (``attention_recompute``) ranks a block's tokens by how
much the tokens after it read them. torch's fused kernels never materialise the weights, so
a forward that must see them passes an :class:`AttentionMass` under
:data:`ATTENTION_MASS_KWARG`; the engine's attention function (``attention``) then runs
this explicit softmax attention instead, in fp32, and adds each layer's weights on keys
``[lo, hi)`` to the collector. The keyword travels with the call, so a model shared with
other forwards is never switched to another attention implementation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

ATTENTION_MASS_KWARG = "leyline_attention_mass"
"""The model-forward keyword carrying an :class:`AttentionMass` to the engine's attention."""


@dataclass(slots=True)
class AttentionMass:
    """Per key position in ``[lo, hi)``: the attention weight every query of every head of
    every layer gave it, summed (fp64)."""

    lo: int
    hi: int
    total: torch.Tensor = field(init=False)
    layers: int = field(default=0, init=False)
    """Layers that added their weights (a check that the forward went through here)."""

    def __post_init__(self) -> None:
        if not 0 <= self.lo <= self.hi:
            raise ValueError(f"key range [{self.lo}, {self.hi}) is empty or reversed")
        self.total = torch.zeros(self.hi - self.lo, dtype=torch.float64)

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | None,
        scaling: float | None,
    ) -> torch.Tensor:
        """Softmax attention of ``query [b, hq, q, d]`` over ``key``/``value [b, hkv, k, d]``
        (grouped heads shared in order), returned as ``[b, q, hq, dv]`` like the engine's
        attention function; the weights on ``[lo, hi)`` are added to :attr:`total`.

        ``mask``: boolean (True: visible) or additive, broadcastable to the scores; None
        means causal with the queries at the last ``q`` key positions (one query: all)."""
        q_len, k_len = query.shape[-2], key.shape[-2]
        if self.hi > k_len:
            raise ValueError(f"key range ends at {self.hi}; the layer has {k_len} keys")
        group = query.shape[1] // key.shape[1]
        keys = key.float().repeat_interleave(group, dim=1)
        values = value.float().repeat_interleave(group, dim=1)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        scores = (query.float() @ keys.transpose(-1, -2)) * scale
        if mask is None:
            seen = torch.arange(k_len - q_len, k_len, device=query.device).unsqueeze(1)
            visible = torch.arange(k_len, device=query.device).unsqueeze(0) <= seen
            scores = scores.masked_fill(~visible, float("-inf"))
        elif mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask[..., :q_len, :k_len], float("-inf"))
        else:
            scores = scores + mask[..., :q_len, :k_len].float()
        weights = torch.softmax(scores, dim=-1)
        self.total += weights[..., self.lo : self.hi].double().sum((0, 1, 2)).cpu()
        self.layers += 1
        out = (weights @ values).to(query.dtype)
        return out.transpose(1, 2).contiguous()
