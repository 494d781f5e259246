"""Per-layer error of the splice's rotated keys against keys recomputed at the new positions.

After a splice the downstream keys are the ORIGINAL keys (computed with the removed span in
context) rotated by delta. A fresh prefill of the edited text would give other keys (other
context), so it cannot isolate the rotation. The reference here keeps the context and
changes only the position:

    one forward of the original sequence; at every attention module a hook runs the same
    module again on the SAME input hidden states, with transformers' own rotary embedding
    for positions ``p + delta`` and a side cache. What that second call caches is exactly
    what transformers would store for these hidden states at the new positions.

So ``rel_l2(splice's downstream band, side cache's band)`` is the rotation error alone
(the engine's ``R(delta)·R(p)`` in fp32 with fp64 angles vs transformers' ``R(p + delta)``),
per layer. The original forward's own keys are checked equal to the engine's prefill too,
and the non-rotated parts (values, MLA latents) must come through the splice bitwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from leyline.engine.engine import Engine
from leyline.engine.kv.kv_blocks import KVCache
from leyline.engine.lean_layers import transformers_layers

from .measures import rel_l2
from .tokens import TokenizedPrompt


@dataclass(frozen=True, slots=True)
class KeyErrors:
    """One prompt's figures, one entry per layer."""

    id: str
    delta: int
    rotated: list[float]
    """splice's downstream rope band vs the band recomputed at the new positions."""
    unrotated: list[float]
    """the original band (not moved) vs the same reference: the scale of the effect."""
    prefill_vs_reference_run: list[float]
    """the engine's prefill keys vs the hooked forward's own keys (same positions): ~0."""
    rest_bitwise: bool
    """values / MLA latents of the downstream tokens unchanged by the splice, bitwise."""


def _attention_modules(model: Any) -> list[nn.Module]:
    return [layer.self_attn for layer in model.model.layers]


def _as_kv(cache: DynamicCache) -> KVCache:
    out = []
    for layer in cache.layers:
        assert isinstance(layer, DynamicLayer) and layer.keys is not None
        assert layer.values is not None
        out.append((layer.keys, layer.values))
    return tuple(out)


def shifted_reference(
    engine: Engine, tokens: tuple[int, ...], delta: int
) -> tuple[KVCache, KVCache]:
    """(keys at positions ``0..n-1``, keys of the same hidden states at ``delta..n-1+delta``)."""
    model = engine.model
    n = len(tokens)
    pos = torch.arange(n, device=model.device).unsqueeze(0)
    rotary = model.model.rotary_emb
    side = DynamicCache()

    def rerun(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        shifted = rotary(hidden, pos + delta)
        extra = {k: v for k, v in kwargs.items() if k not in ("hidden_states", "cache")}
        extra["position_embeddings"] = shifted
        module.forward(hidden, cache=side, **extra)  # .forward: no hook recursion

    hooks = [m.register_forward_hook(rerun, with_kwargs=True) for m in _attention_modules(model)]
    main = DynamicCache()
    try:
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=model.device)
        with transformers_layers(model):  # the hooks need the attention modules' own calls
            model(input_ids=ids, position_ids=pos, cache=main, use_cache=True, logits_to_keep=1)
    finally:
        for h in hooks:
            h.remove()
    return _as_kv(main), _as_kv(side)


def key_errors(engine: Engine, tp: TokenizedPrompt, before: KVCache, after: KVCache) -> KeyErrors:
    """``before`` / ``after``: the engine's KV of the original sequence and after the splice.

    The last position is left out: the engine runs the last token again in the new context
    to get next-token logits, so its KV is recomputed, not rotated.
    """
    layout, delta, end, last = engine.layout, tp.delta, tp.end, len(tp.tokens) - 1
    assert layout is not None
    band = slice(layout.offset, layout.offset + layout.width)
    unshifted, shifted = shifted_reference(engine, tp.tokens, delta)
    rotated, unrotated, prefill, bitwise = [], [], [], True
    s = layout.slot
    for old, new, ref0, ref in zip(before, after, unshifted, shifted, strict=True):
        want = ref[s][..., end:last, band]
        rotated.append(rel_l2(new[s][..., end + delta : last + delta, band], want))
        unrotated.append(rel_l2(old[s][..., end:last, band], want))
        prefill.append(rel_l2(old[s], ref0[s]))
        for j, (o, t) in enumerate(zip(old, new, strict=True)):
            o, t = o[..., end:last, :], t[..., end + delta : last + delta, :]
            if j == s:
                o, t = _outside(o, band), _outside(t, band)
            bitwise &= torch.equal(o, t)
    return KeyErrors(tp.prompt.id, delta, rotated, unrotated, prefill, bitwise)


def _outside(t: torch.Tensor, band: slice) -> torch.Tensor:
    """The dims of ``t`` outside the rope band (possibly none)."""
    return torch.cat([t[..., : band.start], t[..., band.stop :]], dim=-1)
