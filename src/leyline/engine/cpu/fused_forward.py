"""A few rows through a Llama model whose layers are all fused, without transformers' forward.

With every decoder layer fused (``layer_kernel``) and the attention on the kernel, what was
left of a few-row forward (a splice's pass, a delete's last token, a decode step) was
Python around the C calls. :meth:`FusedModel.logits` runs the same modules and kernels on
the same values in the same order as a loop over the layers' ``pre`` and ``post`` calls,
the attention supplied by the caller, so logits and KV are bitwise the model's forward's.
:func:`fused_model` returns None for a model it does not take whole (or while
``switches`` has ``fused_forward`` off); callers then run the model's own forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast
from weakref import WeakKeyDictionary

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.models.llama import modeling_llama as llama

from leyline.engine.cpu import attention_kernel, switches
from leyline.engine.cpu.layer_kernel import FusedLayer, hooked
from leyline.engine.decode_attention import KERNEL_MIN_KEYS
from leyline.engine.lean_layers import FUSED

if TYPE_CHECKING:
    from leyline.engine.forward import KVBuffers

LayerAttention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``(layer, queries, keys, values)`` -> the attention's output at that layer: queries
``[B, m, heads, d]``, keys and values ``[B, m, kv_heads, d]`` of the forward's rows (rotary
applied; the callee keeps the keys and values where its cache wants them), the output
``[B, m, heads * dv]`` contiguous in the model's dtype."""


@dataclass(frozen=True, slots=True)
class FusedModel:
    """A ``LlamaForCausalLM`` whose decoder layers are all fused: the parts a forward of a
    few rows calls."""

    model: PreTrainedModel
    layers: tuple[FusedLayer, ...]
    scale: float
    """The attention's softmax scale (every layer's)."""

    @property
    def heads(self) -> int:
        return self.layers[0].heads

    @property
    def max_rows(self) -> int:
        """Most rows a forward takes here (every layer fused at that row count)."""
        return min(layer.max_rows for layer in self.layers)

    @torch.no_grad()
    def logits(
        self,
        tokens: Sequence[Sequence[int]],
        positions: Sequence[Sequence[int]],
        attend: LayerAttention,
    ) -> torch.Tensor:
        """fp32 next-token logits ``[B, vocab]`` after the last token of each of the ``B``
        sequences ``tokens`` (equal lengths, at ``positions``; at most :attr:`max_rows` in
        all), each layer's attention computed by ``attend``."""
        rows = sum(len(t) for t in tokens)
        shape = [len(t) for t in tokens]
        if not 0 < rows <= self.max_rows or len(set(shape)) != 1:
            raise ValueError(
                f"a fused forward takes 1 to {self.max_rows} tokens, in sequences of one length"
            )
        if [len(p) for p in positions] != shape:
            raise ValueError("a fused forward takes one position per token")
        decoder, device = self.model.model, self.model.device
        ids = torch.tensor([list(t) for t in tokens], dtype=torch.long, device=device)
        pos = torch.tensor([list(p) for p in positions], dtype=torch.long, device=device)
        h = decoder.embed_tokens(ids)
        cos, sin = decoder.rotary_emb(h, pos)
        for i, layer in enumerate(self.layers):
            q, k, v = layer.pre(h, cos, sin)
            h = layer.post(h, attend(i, q, k, v))
        h = decoder.norm(h)  # every row, as the model's forward (a norm is row by row)
        logits: torch.Tensor = self.model.lm_head(h[:, -1:])
        return logits[:, -1].float()


def fused_model(model: PreTrainedModel) -> FusedModel | None:
    """``model`` as a :class:`FusedModel`, or None where it cannot run so: not exactly
    transformers' ``LlamaForCausalLM`` of lean layers, a layer not fused, a forward hook the
    loop would not fire (transformers' output-capturing hooks aside), a config asking for
    attention weights, or ``fused_forward`` switched off. Called on every pass: what only
    changes with the fused layers is worked out once per set of them; the switch, the
    config and the hooks are looked at each time."""
    if switches.setting("fused_forward") == "off":
        return None
    if type(model) is not llama.LlamaForCausalLM or type(model.model) is not llama.LlamaModel:
        return None
    if getattr(model.config, "output_attentions", False):
        return None
    layers = tuple(vars(layer).get(FUSED) for layer in model.model.layers)
    cached = _BUILT.get(model)
    if (
        cached is None
        or len(cached[0]) != len(layers)
        or any(a is not b for a, b in zip(cached[0], layers, strict=True))
    ):
        cached = _BUILT[model] = (layers, _build(model, layers))
    built = cached[1]
    if built is None or _skips_a_hook(built):
        return None
    return built[0]


_BUILT: WeakKeyDictionary[PreTrainedModel, tuple[tuple[FusedLayer | None, ...], _Built | None]]
_BUILT = WeakKeyDictionary()
"""Per model, its fused layers when last seen and what :func:`_build` made of them."""

_Built = tuple[FusedModel, tuple[nn.Module, ...], tuple[nn.Module, ...]]
"""The model, the modules the loop skips (their hooks would not fire) and the products
(a hooked one runs as a module: the lean path)."""


def _build(model: PreTrainedModel, layers: tuple[FusedLayer | None, ...]) -> _Built | None:
    decoder_layers = cast(list[llama.LlamaDecoderLayer], list(model.model.layers))
    fused = tuple(layer for layer in layers if layer is not None)
    if not fused or len(fused) != len(layers):
        return None
    scales = {float(layer.self_attn.scaling) for layer in decoder_layers}
    shapes = {(f.heads, f.kv_heads, f.head_dim, f.dtype) for f in fused}
    if len(scales) != 1 or len(shapes) != 1:
        return None
    if model.model.embed_tokens.weight.dtype != fused[0].dtype:
        return None
    skipped = (model, model.model, *decoder_layers)
    products = tuple(m for layer in fused for m in layer.keep)
    return FusedModel(model, fused, scales.pop()), skipped, products


def _skips_a_hook(built: _Built) -> bool:
    """Whether a forward hook would not fire that the model's forward fires: one on a module
    the loop does not call (the model, its decoder, each decoder layer; the lean layers call
    none of their submodules but the products either), one on a product, or a module-wide
    one. transformers' output-capturing hooks do not count: they record only inside a
    forward asked for hidden states or attention weights (which this loop never is), and
    once installed by such a forward they stay on the model."""
    _, skipped, products = built
    if hooked(products):  # module-wide hooks too
        return True
    return any(
        not _capturing(hook)
        for module in skipped
        if module._forward_hooks or module._forward_pre_hooks
        for hook in (*module._forward_hooks.values(), *module._forward_pre_hooks.values())
    )


def _capturing(hook: object) -> bool:
    return (
        getattr(hook, "__module__", None) == _CAPTURING_MODULE
        and getattr(hook, "__name__", None) == "output_capturing_hook"
    )


_CAPTURING_MODULE = "transformers.utils.output_capturing"


DecodeRow = tuple["KVBuffers", int, int]
"""One generation's decode step: its buffers (per layer ``[keys, values]``, room past
``length``), the position ``length`` its token runs at, and the token."""


def decode_rows(model: PreTrainedModel, rows: Sequence[DecodeRow]) -> torch.Tensor | None:
    """One decode step of each row (a single generation's, or a batched step's) through the
    fused loop: each row's key and value written at its position, its query on the
    single-query kernel over its own buffer, every row's call checked and tabled once for
    all layers; fp32 logits ``[rows, vocab]``. The model's forward makes the same calls on
    the same values (its attention function sends such queries to the same kernel:
    ``decode_attention``, ``batched_decode.rows_attention``), so logits and KV are bitwise
    its. None, having written nothing, where the loop does not apply: no fused model, more
    rows than the fused layers take, a row's cache too short for the kernel (the model's
    forward takes other products there) or its buffers without room."""
    fused = fused_model(model)
    kernel = attention_kernel.load()
    if fused is None or kernel is None or not 0 < len(rows) <= fused.max_rows:
        return None
    shortest = KERNEL_MIN_KEYS.get(fused.layers[0].dtype)
    calls = []
    for buffers, length, _ in rows:
        n = length + 1
        if shortest is None or n < shortest or len(buffers) != len(fused.layers):
            return None
        if any(len(s) != 2 or s[0].shape[-2] < n or s[1].shape[-2] < n for s in buffers):
            return None
        try:
            layers = [[(k[:, :, :n], v[:, :, :n])] for k, v in buffers]
            calls.append(kernel.prepare(layers, fused.heads, 1, fused.scale))
        except ValueError:
            return None  # buffers the kernel does not take: the model's forward decides

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        outs = []
        for b, ((buffers, length, _), call) in enumerate(zip(rows, calls, strict=True)):
            keys, values = buffers[layer]
            keys[:, :, length : length + 1].copy_(k[b : b + 1].transpose(1, 2))
            values[:, :, length : length + 1].copy_(v[b : b + 1].transpose(1, 2))
            outs.append(call(layer, q[b : b + 1].transpose(1, 2).to(torch.float32).contiguous()))
        return torch.stack(outs).to(q.dtype).reshape(len(rows), 1, -1)

    return fused.logits([[token] for _, _, token in rows], [[length] for _, length, _ in rows],
                        attend)  # fmt: skip
