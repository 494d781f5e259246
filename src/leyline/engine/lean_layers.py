"""A leaner forward for transformers' Llama decoder layers: the same operations, fewer calls.

:func:`lean_forward` replaces ``LlamaDecoderLayer.forward`` on a model's layer instances
with one function that runs the layer's own submodules and weights in the same order with
the same operations, skipping the wrappers and small ops a few-row forward paid for in every
layer; results are bitwise transformers' (``tests/engine/test_lean_layers.py``). A forward
asked for attention weights, or inside :func:`transformers_layers`, runs transformers' own.
Where a layer is bound to ``layer_kernel`` (:class:`~.layer_kernel.FusedLayer`), a forward
of few rows runs each side of the attention as one foreign call instead. Only exactly
transformers' Llama layers go lean; ``switches`` can turn it off.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama import modeling_llama as llama

from leyline.engine.cpu import layer_kernel, switches
from leyline.engine.cpu.layer_kernel import FusedLayer

FUSED = "leyline_fused"
"""A lean layer's attribute holding its :class:`~.layer_kernel.FusedLayer`, where bound."""


def _rms_norm(x: torch.Tensor, norm: llama.LlamaRMSNorm) -> torch.Tensor:
    """``LlamaRMSNorm.forward``'s arithmetic, without its no-op casts on fp32 input."""
    fp32 = x.dtype == torch.float32
    h = x if fp32 else x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * (h if fp32 else h.to(x.dtype))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rotary_pos_emb`` for one tensor: ``x cos + rotate_half(x) sin``."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def lean_forward(
    self: llama.LlamaDecoderLayer,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cache: object | None = None,
    use_cache: bool | None = False,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    **kwargs: object,
) -> torch.Tensor:
    """``LlamaDecoderLayer.forward`` (with ``LlamaAttention.forward`` and ``LlamaMLP``
    inlined) for inference; bound to a layer instance by :func:`use_lean_layers`."""
    if kwargs.get("output_attentions") or getattr(
        self.self_attn.config, "output_attentions", False
    ):
        # transformers records attention weights from the attention module's own call
        forward = type(self).forward
        return forward(  # type: ignore[no-any-return]
            self, hidden_states, attention_mask=attention_mask, position_ids=position_ids,
            cache=cache, use_cache=use_cache, position_embeddings=position_embeddings, **kwargs,
        )  # fmt: skip
    if cache is None:
        cache = kwargs.pop("past_key_values", None)
    if position_embeddings is None:
        raise ValueError("a lean decoder layer needs the model's position embeddings")
    attn, mlp = self.self_attn, self.mlp
    fused: FusedLayer | None = self.__dict__.get(FUSED)
    if fused is not None and fused.takes(hidden_states, position_embeddings[0]):  # few rows
        q, k, v = fused.pre(hidden_states, *position_embeddings)
        query, key, value = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    else:
        fused = None
        h = _rms_norm(hidden_states, self.input_layernorm)
        shape = (*h.shape[:-1], -1, attn.head_dim)
        query = attn.q_proj(h).view(shape).transpose(1, 2)
        key = attn.k_proj(h).view(shape).transpose(1, 2)
        value = attn.v_proj(h).view(shape).transpose(1, 2)
        cos, sin = (t.unsqueeze(1) for t in position_embeddings)
        query, key = _rope(query, cos, sin), _rope(key, cos, sin)
    if cache is not None:
        key, value = cache.update(key, value, attn.layer_idx, kwargs=kwargs)  # type: ignore[attr-defined]
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(
        attn.config._attn_implementation, llama.eager_attention_forward
    )
    out, _ = attend(
        attn, query, key, value, attention_mask, dropout=0.0, scaling=attn.scaling, **kwargs
    )
    out = out.reshape(*hidden_states.shape[:-1], -1).contiguous()
    if fused is not None:
        return fused.post(hidden_states, out)
    hidden_states = hidden_states + attn.o_proj(out)
    h = _rms_norm(hidden_states, self.post_attention_layernorm)
    gated = F.silu(mlp.gate_proj(h)) * mlp.up_proj(h)
    result: torch.Tensor = hidden_states + mlp.down_proj(gated)
    return result


def _takes(layer: torch.nn.Module) -> bool:
    """Whether ``layer`` is transformers' Llama decoder layer, built of its own parts."""
    if type(layer) is not llama.LlamaDecoderLayer:
        return False
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    norms = (
        getattr(layer, "input_layernorm", None),
        getattr(layer, "post_attention_layernorm", None),
    )
    return (
        type(attn) is llama.LlamaAttention
        and type(mlp) is llama.LlamaMLP
        and getattr(mlp.config, "hidden_act", None) == "silu"
        and all(type(n) is llama.LlamaRMSNorm for n in norms)
        and not layer.training
    )


def lean_refusal(model: PreTrainedModel) -> str:
    """Why this model's decoder layers keep transformers' forward; empty if they can go lean."""
    if switches.refusal("lean_layers"):
        return switches.refusal("lean_layers")
    decoder = getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        return "no decoder layers found"
    if not all(_takes(layer) for layer in layers):
        return "not transformers' Llama decoder layers"
    return ""


def use_lean_layers(model: PreTrainedModel) -> int:
    """Bind :func:`lean_forward` to every decoder layer of ``model`` where it applies
    (:func:`lean_refusal`); returns how many layers it bound (0: none)."""
    if lean_refusal(model):
        return 0
    layers = model.model.layers
    for layer in layers:
        layer.forward = types.MethodType(lean_forward, layer)
        fused = layer_kernel.bind(layer)
        if fused is not None:
            layer.__dict__[FUSED] = fused
    return len(layers)


def drop_lean_layers(model: PreTrainedModel) -> int:
    """Give every decoder layer its class's forward back (A/B runs, references); returns
    how many were lean."""
    dropped = 0
    for layer in getattr(getattr(model, "model", None), "layers", ()):
        dropped += layer.__dict__.pop("forward", None) is not None
        layer.__dict__.pop(FUSED, None)
    return dropped


def fused_layers(model: PreTrainedModel) -> int:
    """How many decoder layers run their few-row forwards fused (``layer_kernel``)."""
    layers = getattr(getattr(model, "model", None), "layers", ())
    return sum(FUSED in vars(layer) for layer in layers)


@contextmanager
def transformers_layers(model: PreTrainedModel) -> Iterator[None]:
    """Run ``model`` on transformers' own decoder-layer forward inside the block (an
    independent reference that hooks the attention modules, say), lean again after."""
    dropped = drop_lean_layers(model)
    try:
        yield
    finally:
        if dropped:
            use_lean_layers(model)
