"""A Llama decoder layer's few-row work in one foreign call on each side of its attention
(``csrc/layer_kernel.c``: ``linear_kernel``'s source plus the glue), where a few rows'
forward was mostly small torch ops and Python around the products.

:meth:`FusedLayer.pre` runs ``RMSNorm -> q, k, v products -> RoPE``; :meth:`FusedLayer.post`
``x + o(attn) -> RMSNorm -> x + down(silu(gate) * up)``, rounding to bf16 where
transformers' bf16 forward rounds (results within rounding of it: the norm sums in another
order). It applies where ``lean_layers`` does and all seven products run on ``linear_kernel``.
"""

from __future__ import annotations

import ctypes
from array import array
from dataclasses import dataclass

import torch
from torch import nn
from transformers.models.llama import modeling_llama as llama

from leyline.engine.cpu import kernel_build, linear_kernel
from leyline.engine.cpu.packed_linear import PackedLinear

__all__ = ["FusedLayer", "LayerKernel", "bind", "load", "status"]

PRODUCTS = ("q", "k", "v", "o", "gate", "up", "down")
"""The order of the seven products in a layer's descriptor table."""


class LayerKernel(kernel_build.Library):
    """The loaded shared library (``linear_kernel``'s products and the glue)."""

    def setup(self, lib: ctypes.CDLL) -> None:
        self._pre = kernel_build.bind(lib, "leyline_layer_pre", "ppqqpfppqqqppp ii")
        self._post = kernel_build.bind(lib, "leyline_layer_post", "pppqqqpfp ii")
        lib.leyline_linear_amx_ready()  # its products may use the tile unit: ask for it here too
        self._exp = kernel_build.bind(lib, "leyline_layer_exp", "ppq", None)

    def exp(self, x: torch.Tensor) -> torch.Tensor:
        """``kb_exp`` (``csrc/kb_exp.h``, SiLU's exp here) on an fp32 tensor: for tests."""
        x = x.to(torch.float32).contiguous()
        y = torch.empty_like(x)
        self._exp(x.data_ptr(), y.data_ptr(), x.numel())
        return y


def hooked(modules: tuple[nn.Module, ...]) -> bool:
    """Whether a forward hook would see any of ``modules`` called: their own, or torch's
    module-wide ones (kept under private names in ``torch.nn.modules.module``)."""
    everywhere = torch.nn.modules.module
    if getattr(everywhere, "_global_forward_hooks", None) or getattr(
        everywhere, "_global_forward_pre_hooks", None
    ):
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)


def _raise(rc: int, side: str) -> None:
    if rc == -1:
        raise MemoryError(f"layer kernel ({side}): out of memory")
    raise ValueError(f"layer kernel ({side}) refused its arguments (rc {rc})")


@dataclass(frozen=True, slots=True)
class FusedLayer:
    """One decoder layer bound to the kernel: its seven products' descriptors and norms."""

    kernel: LayerKernel
    table: array  # type: ignore[type-arg]
    """``PRODUCTS`` x the C side's seven fields, int64 (kept alive: the C side reads it)."""
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    input_eps: float
    post_eps: float
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    inter: int
    max_rows: int
    """Most rows every product runs on ``linear_kernel`` (more: the lean forward)."""
    dtype: torch.dtype
    keep: tuple[nn.Module, ...]
    """The packed layers whose buffers the table points into."""

    def takes(self, x: torch.Tensor, cos: torch.Tensor) -> bool:
        """Whether ``x [batch, seq, hidden]`` goes through the fused calls (every row on
        its own: a batched decode step's ``[B, 1]`` as one sequence's few tokens): few rows
        in all, ``cos`` the position embeddings of each, and no forward hook on a product
        (a hooked layer runs its modules, so the hooks fire)."""
        return (
            x.dim() == 3
            and 0 < x.shape[0] * x.shape[1] <= self.max_rows
            and x.dtype == self.dtype
            and x.is_contiguous()
            and cos.shape[:2] == x.shape[:2]
            and not hooked(self.keep)
        )

    def _threads(self) -> int:
        return torch.get_num_threads() if self.kernel.threaded else 1

    def pre(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys (both rotated) and values of ``x [batch, seq, hidden]`` as
        ``[batch, seq, heads, head_dim]``; ``cos``/``sin``: the model's position embeddings
        ``[batch, seq, head_dim]`` (:meth:`takes`)."""
        (batch, seq), hd = x.shape[:2], self.head_dim
        rows = batch * seq
        q = torch.empty(batch, seq, self.heads, hd, dtype=x.dtype)
        k = torch.empty(batch, seq, self.kv_heads, hd, dtype=x.dtype)
        v = torch.empty(batch, seq, self.kv_heads, hd, dtype=x.dtype)
        cos, sin = cos.to(x.dtype).contiguous(), sin.to(x.dtype).contiguous()
        rc = self.kernel._pre(
            self.table.buffer_info()[0], x.data_ptr(), rows, self.hidden,
            self.input_norm.data_ptr(), self.input_eps, cos.data_ptr(), sin.data_ptr(),
            self.heads, self.kv_heads, hd, q.data_ptr(), k.data_ptr(), v.data_ptr(),
            int(x.dtype == torch.bfloat16), self._threads(),
        )  # fmt: skip
        if rc:
            _raise(rc, "pre")
        return q, k, v

    def post(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The layer's output for its input ``x [batch, seq, hidden]`` and attention
        output ``attn [batch, seq, heads * head_dim]`` (contiguous)."""
        out = torch.empty_like(x)
        rc = self.kernel._post(
            self.table.buffer_info()[0], x.data_ptr(), attn.data_ptr(), x.shape[0] * x.shape[1],
            self.hidden, self.inter, self.post_norm.data_ptr(), self.post_eps, out.data_ptr(),
            int(x.dtype == torch.bfloat16), self._threads(),
        )  # fmt: skip
        if rc:
            _raise(rc, "post")
        return out


def bind(layer: llama.LlamaDecoderLayer) -> FusedLayer | None:
    """``layer`` (a Llama decoder layer that ``lean_layers`` takes) bound to the kernel, or
    None: no kernel, a product not on ``linear_kernel``, or widths that do not fit
    together."""
    kernel = load()
    if kernel is None:
        return None
    attn, mlp = layer.self_attn, layer.mlp
    found = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
             mlp.gate_proj, mlp.up_proj, mlp.down_proj)  # fmt: skip
    modules = [m for m in found if isinstance(m, PackedLinear) and m.direct is not None]
    if len(modules) != len(PRODUCTS):
        return None
    dtype = modules[0].dtype
    fields: list[int] = []
    for m in modules:
        direct = m.direct
        assert direct is not None  # filtered above
        if m.dtype != dtype:
            return None
        bias = 0 if direct.bias is None else direct.bias.data_ptr()
        fields += [int(torch.ops.mkldnn.data_ptr(m.packed)), m.out_features, m.in_features,
                   direct.k_pad, bias, direct.block, direct.amx_rows]  # fmt: skip
    config = attn.config
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    hd, hidden, inter = int(attn.head_dim), modules[0].in_features, modules[4].out_features
    widths = [(m.out_features, m.in_features) for m in modules]
    if widths != [
        (heads * hd, hidden),
        (kv_heads * hd, hidden),
        (kv_heads * hd, hidden),
        (hidden, heads * hd),
        (inter, hidden),
        (inter, hidden),
        (hidden, inter),
    ]:
        return None
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if any(n.weight.dtype != dtype or n.weight.numel() != hidden for n in norms):
        return None
    return FusedLayer(
        kernel, array("q", fields),
        norms[0].weight.detach().contiguous(), norms[1].weight.detach().contiguous(),
        float(norms[0].variance_epsilon), float(norms[1].variance_epsilon),
        heads, kv_heads, hd, hidden, inter, min(m.kernel_rows for m in modules), dtype,
        tuple(modules),
    )  # fmt: skip


_kernel = kernel_build.LazyKernel("layer_kernel", linear_kernel._flags, LayerKernel)
load = _kernel.load
"""The kernel, compiled and loaded on first use (once per process); None if unusable."""
status = _kernel.status
"""Whether :func:`load` finds a kernel, and the library's path or the reason."""
