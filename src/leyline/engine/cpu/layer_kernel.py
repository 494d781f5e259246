"""A Llama decoder layer's few-row work in one foreign call on each side of its attention.

A decode step, a splice's pass and a delete's last token run a few rows through 30 layers.
After ``linear_kernel`` and the attention kernels, most of such a step was glue: per layer
two RMSNorms, RoPE on queries and keys, the gated activation, two residual adds and seven
module calls, some 40 small torch ops at a few microseconds each (perf on a bf16 decode
step at 512 tokens, 2 cores: about 20 of its 29 ms in Python and libtorch). Here each side
of the attention is one call into C:

- :meth:`FusedLayer.pre`: ``RMSNorm -> q, k, v products -> RoPE on q and k``;
- :meth:`FusedLayer.post`: ``x + o(attn) -> RMSNorm -> x + down(silu(gate) * up)``.

The products are ``linear_kernel``'s own (this library is its source plus the glue, so the
glue calls ``leyline_packed_linear`` on the packed weights in place). The arithmetic follows
transformers' Llama layer op by op, rounding to bf16 where its bf16 forward rounds (each
product's output, RoPE's two products and their sum, the norm before its weight, the
activation, each residual add); only the order of the norm's sum of squares differs, so
results equal the lean forward's to fp32 rounding (fp32) or within bf16 rounding noise
(tested against transformers' forward, ``tests/engine/test_layer_kernel.py``).

It applies where ``lean_layers`` does, to a layer whose seven products all run on
``linear_kernel`` at the call's row count (bf16 on the tile unit: up to 32 rows; fp32: up to
32), rows counted over the batch (a batched decode step's rows are independent here: only
the attention, left to the lean path, reads them per row). ``LEYLINE_LAYER_KERNEL=0``
turns it off.
"""

from __future__ import annotations

import ctypes
from array import array
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers.models.llama import modeling_llama as llama

from leyline.engine.cpu import kernel_build, linear_kernel
from leyline.engine.cpu.packed_linear import PackedLinear

__all__ = ["FusedLayer", "LayerKernel", "bind", "load", "status"]

_ENV_SWITCH = "LEYLINE_LAYER_KERNEL"
PRODUCTS = ("q", "k", "v", "o", "gate", "up", "down")
"""The order of the seven products in a layer's descriptor table."""

_GLUE = r"""
#include <math.h>

/* A product's descriptor: weight, out, in, padded in, bias, block, tile-unit rows. */
enum { LD_W, LD_N, LD_K, LD_KP, LD_BIAS, LD_BLOCK, LD_AMX, LD_FIELDS };

/* The element loops below take `bf16` as a constant: each is written once as an
   always-inlined body and called from a branch per dtype, so the compiler sees two loops
   without a branch inside and vectorises both (with a branch per element they ran scalar
   on the main thread while the worker waited: about a third of a 17-row bf16 layer). */
#define LK_INLINE static inline __attribute__((always_inline))
#define LK_BY_DTYPE(call) \
    do {                  \
        if (bf16) {       \
            enum { B = 1 }; \
            call;         \
        } else {          \
            enum { B = 0 }; \
            call;         \
        }                 \
    } while (0)

LK_INLINE float lk_get(const void *p, int64_t i, int bf16) {
    return bf16 ? ll_bf16(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}
/* The value stored in the model's dtype: rounded to bf16 (nearest even) or kept. */
LK_INLINE float lk_round(float f, int bf16) { return bf16 ? ll_bf16(ll_to_bf16(f)) : f; }
LK_INLINE void lk_put(void *p, int64_t i, float f, int bf16) {
    if (bf16) ((uint16_t *)p)[i] = ll_to_bf16(f);
    else ((float *)p)[i] = f;
}

/* Exported for the tests: kb_exp (kernel_build.EXP_C) on n values. */
void leyline_layer_exp(const float *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = kb_exp(x[i]);
}

/* The threads a product takes: one per 256 output columns, at most `threads`. */
static int32_t lk_threads(const int64_t *d, int32_t threads) {
    int64_t per = d[LD_N] / 256 > 0 ? d[LD_N] / 256 : 1;
    return threads < per ? threads : (int32_t)per;
}

static int32_t lk_product(const int64_t *d, const void *x, int64_t rows, void *y, int bf16,
                          int32_t threads) {
    int64_t n = d[LD_N];
    int32_t t = lk_threads(d, threads);
    return leyline_packed_linear((const void *)d[LD_W], n, d[LD_K], d[LD_KP], x, rows, d[LD_K],
                                 (const void *)d[LD_BIAS], y, n, bf16, t, (int32_t)d[LD_BLOCK],
                                 (int32_t)d[LD_AMX]);
}

/* out = weight * (x / rms(x)), as LlamaRMSNorm: fp32 inside, x / rms rounded to the model's
   dtype before the weight, the product rounded again. */
LK_INLINE void lk_rms_norm_body(const void *x, int64_t rows, int64_t hidden, const void *w,
                                float eps, void *out, const int bf16) {
    for (int64_t r = 0; r < rows; r++) {
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < hidden; j++) {
            float v = lk_get(x, r * hidden + j, bf16);
            sum += v * v;
        }
        float inv = 1.0f / sqrtf(sum / (float)hidden + eps);
        for (int64_t j = 0; j < hidden; j++) {
            float h = lk_round(lk_get(x, r * hidden + j, bf16) * inv, bf16);
            lk_put(out, r * hidden + j, lk_get(w, j, bf16) * h, bf16);
        }
    }
}
static void lk_rms_norm(const void *x, int64_t rows, int64_t hidden, const void *w, float eps,
                        void *out, int bf16) {
    LK_BY_DTYPE(lk_rms_norm_body(x, rows, hidden, w, eps, out, B));
}

/* RoPE in place on rows of `heads` heads of width hd (rotate-half pairing), as
   apply_rotary_pos_emb: x cos + rotate_half(x) sin, each product and the sum rounded. */
LK_INLINE void lk_rope_body(void *x, int64_t rows, int64_t heads, int64_t hd, const void *cos,
                            const void *sin, const int bf16) {
    int64_t half = hd / 2;
    float tmp[1024];
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < heads; h++) {
            int64_t base = (r * heads + h) * hd;
            for (int64_t i = 0; i < hd; i++) tmp[i] = lk_get(x, base + i, bf16);
            for (int64_t i = 0; i < half; i++) {
                float a = lk_round(tmp[i] * lk_get(cos, r * hd + i, bf16), bf16);
                float b = lk_round(-tmp[i + half] * lk_get(sin, r * hd + i, bf16), bf16);
                lk_put(x, base + i, a + b, bf16);
            }
            for (int64_t i = half; i < hd; i++) {
                float a = lk_round(tmp[i] * lk_get(cos, r * hd + i, bf16), bf16);
                float b = lk_round(tmp[i - half] * lk_get(sin, r * hd + i, bf16), bf16);
                lk_put(x, base + i, a + b, bf16);
            }
        }
}
static void lk_rope(void *x, int64_t rows, int64_t heads, int64_t hd, const void *cos,
                    const void *sin, int bf16) {
    LK_BY_DTYPE(lk_rope_body(x, rows, heads, hd, cos, sin, B));
}

/* y[i] = a[i] + y[i] over n values (a residual add), rounded to the dtype. */
LK_INLINE void lk_add_body(const void *a, void *y, int64_t n, const int bf16) {
    for (int64_t i = 0; i < n; i++) lk_put(y, i, lk_get(a, i, bf16) + lk_get(y, i, bf16), bf16);
}
static void lk_add(const void *a, void *y, int64_t n, int bf16) {
    LK_BY_DTYPE(lk_add_body(a, y, n, B));
}

/* g[i] = silu(g[i]) * u[i] over n values, SiLU (x / (1 + exp(-x))) rounded first. */
LK_INLINE void lk_gate_body(void *g, const void *u, int64_t n, const int bf16) {
    for (int64_t i = 0; i < n; i++) {
        float a = lk_get(g, i, bf16);
        float s = lk_round(a / (1.0f + kb_exp(-a)), bf16);
        lk_put(g, i, s * lk_get(u, i, bf16), bf16);
    }
}
static void lk_gate(void *g, const void *u, int64_t n, int bf16) {
    LK_BY_DTYPE(lk_gate_body(g, u, n, B));
}

/* q [rows][heads * hd], k and v [rows][kv * hd] of the rows x [rows][hidden]: norm, the
   three products, RoPE on q and k (cos, sin: [rows][hd]). Returns 0, or the failing
   product's code (-1: no memory). */
int32_t leyline_layer_pre(const int64_t *desc, const void *x, int64_t rows, int64_t hidden,
                          const void *ln, float eps, const void *cos, const void *sin,
                          int64_t heads, int64_t kv, int64_t hd, void *q, void *k, void *v,
                          int32_t bf16, int32_t threads) {
    if (hd > 1024 || hd % 2) return -3;
    float *h = kb_scratch(rows * hidden);
    if (!h) return -1;
    lk_rms_norm(x, rows, hidden, ln, eps, h, bf16);
    int32_t rc = lk_product(desc, h, rows, q, bf16, threads);
    if (rc) return rc;
    if (threads > 1 && lk_threads(desc + LD_FIELDS, threads) == 1 &&
        lk_threads(desc + 2 * LD_FIELDS, threads) == 1) {
        /* k and v too narrow to split (GQA): one thread each, side by side */
        int32_t rk = 0, rv = 0;
#pragma omp parallel sections num_threads(2)
        {
#pragma omp section
            rk = lk_product(desc + LD_FIELDS, h, rows, k, bf16, 1);
#pragma omp section
            rv = lk_product(desc + 2 * LD_FIELDS, h, rows, v, bf16, 1);
        }
        rc = rk ? rk : rv;
    } else {
        rc = lk_product(desc + LD_FIELDS, h, rows, k, bf16, threads);
        if (!rc) rc = lk_product(desc + 2 * LD_FIELDS, h, rows, v, bf16, threads);
    }
    if (rc) return rc;
    lk_rope(q, rows, heads, hd, cos, sin, bf16);
    lk_rope(k, rows, kv, hd, cos, sin, bf16);
    return 0;
}

/* out [rows][hidden] = y + down(silu(gate(n)) * up(n)), n = norm(y), y = x + o(attn);
   attn [rows][heads * hd]. Returns 0, or the failing product's code (-1: no memory). */
int32_t leyline_layer_post(const int64_t *desc, const void *x, const void *attn, int64_t rows,
                           int64_t hidden, int64_t inter, const void *ln, float eps, void *out,
                           int32_t bf16, int32_t threads) {
    const int64_t es = bf16 ? 2 : 4, per = (hidden + 2 * inter) * es / 4 + 1;
    float *scratch = kb_scratch(rows * per * 2);
    if (!scratch) return -1;
    char *y = (char *)scratch, *n = y + rows * hidden * es, *g = n + rows * hidden * es;
    char *u = g + rows * inter * es;
    int32_t rc = lk_product(desc + 3 * LD_FIELDS, attn, rows, y, bf16, threads);
    if (rc) return rc;
    lk_add(x, y, rows * hidden, bf16);
    lk_rms_norm(y, rows, hidden, ln, eps, n, bf16);
    rc = lk_product(desc + 4 * LD_FIELDS, n, rows, g, bf16, threads);
    if (!rc) rc = lk_product(desc + 5 * LD_FIELDS, n, rows, u, bf16, threads);
    if (rc) return rc;
    lk_gate(g, u, rows * inter, bf16);
    rc = lk_product(desc + 6 * LD_FIELDS, g, rows, out, bf16, threads);
    if (rc) return rc;
    lk_add(y, out, rows * hidden, bf16);
    return 0;
}
"""

_SOURCE = linear_kernel._SOURCE + kernel_build.SCRATCH_C + kernel_build.EXP_C + _GLUE


class LayerKernel:
    """The loaded shared library (``linear_kernel``'s products and the glue)."""

    def __init__(self, lib: ctypes.CDLL, path: Path, threaded: bool) -> None:
        self.path = path
        self.threaded = threaded
        i64, ptr, i32, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int32, ctypes.c_float
        pre = lib.leyline_layer_pre
        pre.argtypes = [ptr, ptr, i64, i64, ptr, f32, ptr, ptr, i64, i64, i64, ptr, ptr, ptr]
        pre.argtypes += [i32, i32]
        pre.restype = i32
        post = lib.leyline_layer_post
        post.argtypes = [ptr, ptr, ptr, i64, i64, i64, ptr, f32, ptr, i32, i32]
        post.restype = i32
        self._pre, self._post = pre, post
        lib.leyline_linear_amx_ready()  # its products may use the tile unit: ask for it here too
        exp = lib.leyline_layer_exp
        exp.argtypes, exp.restype = [ptr, ptr, i64], None
        self._exp = exp

    def exp(self, x: torch.Tensor) -> torch.Tensor:
        """``kb_exp`` (``kernel_build.EXP_C``, SiLU's exp here) on an fp32 tensor: for tests."""
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


_kernel = kernel_build.LazyKernel(
    "layer_kernel", _SOURCE, linear_kernel._flags, LayerKernel, switch=_ENV_SWITCH
)
load = _kernel.load
"""The kernel, compiled and loaded on first use (once per process); None if unusable."""
status = _kernel.status
"""Whether :func:`load` found a kernel, and the library's path or the reason."""
