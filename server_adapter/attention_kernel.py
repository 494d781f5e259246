"""A CPU kernel for one query's attention over a long KV cache, fp32 or bf16.

A decode step, a batched decode row and a splice's last token each attend with one query
per head over every cached key and value: the work is one read of K and V, so it should
run at memory speed. torch's CPU flash-attention kernel does not for bf16 caches: at 4k
tokens on SmolLM2 it takes 2.5-3.0 ms a layer for 3 MB of keys and values (about 1 GB/s),
which made attention most of a bf16 decode step. This kernel streams K and V once, widens
bf16 to fp32 on the fly (exact), keeps every sum in fp32 (SDPA's own accumulation type) and
splits the keys over threads flash-decoding style: each task holds a running max, sum and
weighted values for a segment of one key/value head, merged at the end. Grouped query
heads share the key/value head's read (``h // (heads / kv_heads)``, as ``enable_gqa``).

Built and loaded by ``kernel_build`` (``LEYLINE_ATTENTION_KERNEL=0`` turns it off; without
a compiler :func:`load` returns None and ``decode_attention`` keeps torch's kernels).
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import torch

from . import kernel_build
from .kernel_build import KernelStatus

__all__ = ["AttentionKernel", "KernelStatus", "eligible", "load", "status"]

MAX_DIM = 512
"""Widest key or value head the kernel takes (rows are widened on the stack)."""
MAX_GROUP = 16
"""Most query heads per key/value head."""
_MIN_BYTES_PER_THREAD = 1 << 18
_ENV_SWITCH = "LEYLINE_ATTENTION_KERNEL"

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LL_MAX_DIM 512
#define LL_MAX_GROUP 16
#define LL_CHUNK 128
#define LL_MAX_TASKS 4096
#define LL_STAGE (LL_CHUNK * 128)

static inline float ll_widen(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* e^x for x <= 0 (a score minus the running max): Cephes' expf polynomial, within 2 ulp,
   branch-free so that the loops calling it vectorise. */
static inline float ll_exp(float x) {
    x = x < -87.0f ? -87.0f : x;
    float t = x * 1.44269504088896341f + 12582912.0f; /* round to nearest via 1.5 * 2^23 */
    float n = t - 12582912.0f;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float s;
    memcpy(&s, &e, 4);
    return p * s;
}

static inline void ll_widen_n(const uint16_t *src, int64_t n, float *dst) {
    for (int64_t j = 0; j < n; j++) dst[j] = ll_widen(src[j]);
}

static inline const float *ll_row(const char *base, int bf16, int64_t d, float *staged) {
    if (!bf16) return (const float *)base;
    const uint16_t *s = (const uint16_t *)base;
    for (int64_t j = 0; j < d; j++) staged[j] = ll_widen(s[j]);
    return staged;
}

typedef struct {
    float m[LL_MAX_GROUP]; /* running max of the scores */
    float l[LL_MAX_GROUP]; /* sum of e^(score - m) */
} ll_stats;

/* Keys [lo, hi) of one key/value head for its `group` query heads: the segment's max,
   sum and unnormalised weighted values (acc, [group][dv]). */
static void ll_segment(const float *q, int64_t group, int64_t d, int64_t dv, float scale,
                       const char *k, int64_t k_tok, const char *v, int64_t v_tok, int bf16,
                       int64_t lo, int64_t hi, ll_stats *st, float *acc) {
    size_t es = bf16 ? 2 : 4;
    float kr[LL_MAX_DIM], vr[LL_MAX_DIM];
    float s[LL_MAX_GROUP][LL_CHUNK];
    /* bf16 rows that follow each other in memory are widened a chunk at a time: one loop
       instead of one per row (a row is only 64-256 elements) */
    float staged[LL_STAGE];
    int k_dense = bf16 && k_tok == d && (int64_t)LL_CHUNK * d <= LL_STAGE;
    int v_dense = bf16 && v_tok == dv && (int64_t)LL_CHUNK * dv <= LL_STAGE;
    for (int64_t i = 0; i < group; i++) {
        st->m[i] = -INFINITY;
        st->l[i] = 0.0f;
        for (int64_t j = 0; j < dv; j++) acc[i * dv + j] = 0.0f;
    }
    for (int64_t c0 = lo; c0 < hi; c0 += LL_CHUNK) {
        int64_t cn = hi - c0 < LL_CHUNK ? hi - c0 : LL_CHUNK;
        if (k_dense) ll_widen_n((const uint16_t *)k + c0 * d, cn * d, staged);
        for (int64_t t = 0; t < cn; t++) {
            const float *kf =
                k_dense ? staged + t * d : ll_row(k + (c0 + t) * k_tok * es, bf16, d, kr);
            for (int64_t i = 0; i < group; i++) {
                const float *qi = q + i * d;
                float lane[16] = {0}; /* 16 independent partial sums: vectorises exactly */
                int64_t j = 0;
                for (; j + 16 <= d; j += 16)
                    for (int u = 0; u < 16; u++) lane[u] += qi[j + u] * kf[j + u];
                float dot = 0.0f;
                for (; j < d; j++) dot += qi[j] * kf[j];
                for (int u = 0; u < 8; u++) lane[u] += lane[u + 8]; /* a tree, not a chain */
                for (int u = 0; u < 4; u++) lane[u] += lane[u + 4];
                dot += (lane[0] + lane[2]) + (lane[1] + lane[3]);
                s[i][t] = dot * scale;
            }
        }
        for (int64_t i = 0; i < group; i++) {
            float cm = -INFINITY;
            for (int64_t t = 0; t < cn; t++) cm = s[i][t] > cm ? s[i][t] : cm;
            if (cm > st->m[i]) { /* a new max: rescale what the segment holds so far */
                float f = st->m[i] == -INFINITY ? 0.0f : ll_exp(st->m[i] - cm);
                st->l[i] *= f;
                for (int64_t j = 0; j < dv; j++) acc[i * dv + j] *= f;
                st->m[i] = cm;
            }
            float m = st->m[i], l = 0.0f;
            for (int64_t t = 0; t < cn; t++) s[i][t] = ll_exp(s[i][t] - m);
            for (int64_t t = 0; t < cn; t++) l += s[i][t];
            st->l[i] += l;
        }
        if (v_dense) ll_widen_n((const uint16_t *)v + c0 * dv, cn * dv, staged);
        for (int64_t t = 0; t < cn; t++) {
            const float *vf =
                v_dense ? staged + t * dv : ll_row(v + (c0 + t) * v_tok * es, bf16, dv, vr);
            for (int64_t i = 0; i < group; i++) {
                float p = s[i][t];
                float *a = acc + i * dv;
                for (int64_t j = 0; j < dv; j++) a[j] += p * vf[j];
            }
        }
    }
}

/* q: fp32 [heads][d], contiguous; k, v: [kv][n][d] and [kv][n][dv] (fp32, or bf16 when
   `bf16`), head and token strides in elements, last dim contiguous; out: fp32 [heads][dv].
   Returns 0, or a positive code for arguments it does not take. */
int leyline_single_query(const float *q, int64_t heads, int64_t kv, int64_t n, int64_t d,
                         int64_t dv, float scale, const void *k, int64_t k_head,
                         int64_t k_tok, const void *v, int64_t v_head, int64_t v_tok,
                         int32_t bf16, float *out, int32_t threads) {
    if (kv <= 0 || heads % kv || d <= 0 || dv <= 0 || d > LL_MAX_DIM || dv > LL_MAX_DIM ||
        n <= 0 || threads <= 0)
        return 1;
    int64_t group = heads / kv;
    if (group > LL_MAX_GROUP) return 2;
    size_t es = bf16 ? 2 : 4;
    /* about two segments per thread over all heads, none shorter than 256 keys */
    int64_t per = ((int64_t)threads * 2 + kv - 1) / kv;
    int64_t seg = (n + per - 1) / per;
    if (seg < 256) seg = 256;
    per = (n + seg - 1) / seg;
    int64_t tasks = kv * per;
    if (tasks > LL_MAX_TASKS) return 3;
    ll_stats *st = malloc(sizeof(ll_stats) * (size_t)tasks);
    float *acc = malloc(sizeof(float) * (size_t)(tasks * group * dv));
    if (!st || !acc) {
        free(st);
        free(acc);
        return 4;
    }
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t task = 0; task < tasks; task++) {
        int64_t h = task / per, lo = (task % per) * seg;
        int64_t hi = lo + seg < n ? lo + seg : n;
        ll_segment(q + h * group * d, group, d, dv, scale, (const char *)k + h * k_head * es,
                   k_tok, (const char *)v + h * v_head * es, v_tok, bf16, lo, hi, &st[task],
                   acc + task * group * dv);
    }
    for (int64_t h = 0; h < kv; h++) {
        for (int64_t i = 0; i < group; i++) {
            float m = -INFINITY, l = 0.0f;
            for (int64_t p = 0; p < per; p++) {
                float x = st[h * per + p].m[i];
                m = x > m ? x : m;
            }
            float *o = out + (h * group + i) * dv;
            for (int64_t j = 0; j < dv; j++) o[j] = 0.0f;
            for (int64_t p = 0; p < per; p++) {
                const ll_stats *sp = &st[h * per + p];
                float f = ll_exp(sp->m[i] - m);
                const float *a = acc + ((h * per + p) * group + i) * dv;
                l += sp->l[i] * f;
                for (int64_t j = 0; j < dv; j++) o[j] += a[j] * f;
            }
            float inv = 1.0f / l;
            for (int64_t j = 0; j < dv; j++) o[j] *= inv;
        }
    }
    free(st);
    free(acc);
    return 0;
}
"""


def eligible(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether the kernel takes ``query [1, heads, 1, d]`` over ``key [1, kv, n, d]`` and
    ``value [1, kv, n, dv]``: CPU, all fp32 or all bf16, heads a multiple of kv heads (at
    most :data:`MAX_GROUP` per kv head), widths up to :data:`MAX_DIM`, K and V with a
    contiguous last dim."""
    return (
        query.dim() == 4
        and key.dim() == 4
        and value.dim() == 4
        and query.shape[0] == key.shape[0] == value.shape[0] == 1
        and query.shape[2] == 1
        and key.shape[2] == value.shape[2] > 0
        and key.shape[1] == value.shape[1] > 0
        and query.shape[1] % key.shape[1] == 0
        and query.shape[1] // key.shape[1] <= MAX_GROUP
        and query.shape[3] == key.shape[3]
        and 0 < key.shape[3] <= MAX_DIM
        and 0 < value.shape[3] <= MAX_DIM
        and query.dtype == key.dtype == value.dtype
        and key.dtype in (torch.float32, torch.bfloat16)
        and query.is_cpu
        and key.is_cpu
        and value.is_cpu
        and key.stride(-1) == 1
        and value.stride(-1) == 1
    )


class AttentionKernel:
    """The loaded shared library."""

    def __init__(self, lib: ctypes.CDLL, path: Path, *, threaded: bool) -> None:
        self.path = path
        self.threaded = threaded
        """Built with OpenMP: calls split their keys over ``torch.get_num_threads()``."""
        fn = lib.leyline_single_query
        i64 = ctypes.c_int64
        fn.argtypes = [
            ctypes.c_void_p,
            *(i64,) * 5,
            ctypes.c_float,
            ctypes.c_void_p,
            i64,
            i64,
            ctypes.c_void_p,
            i64,
            i64,
            ctypes.c_int32,
            ctypes.c_void_p,
            ctypes.c_int32,
        ]
        fn.restype = ctypes.c_int32
        self._fn = fn

    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None
    ) -> torch.Tensor:
        """``softmax(q k^T * scale) v`` over every key (no mask), ``[1, heads, 1, dv]`` in
        the query's dtype (SDPA's layout); ``scale`` defaults to ``d ** -0.5``. Raises
        ``ValueError`` for tensors :func:`eligible` refuses."""
        if not eligible(query, key, value):
            raise ValueError("tensors not eligible for the attention kernel")
        heads, d = query.shape[1], query.shape[3]
        kv_heads, n, dv = key.shape[1], key.shape[2], value.shape[3]
        q = query.reshape(heads, d).to(torch.float32).contiguous()
        out = torch.empty(heads, dv, dtype=torch.float32)
        nbytes = n * kv_heads * (d + dv) * key.element_size()
        threads = max(1, min(torch.get_num_threads(), nbytes // _MIN_BYTES_PER_THREAD))
        rc = self._fn(
            q.data_ptr(),
            heads,
            kv_heads,
            n,
            d,
            dv,
            d**-0.5 if scale is None else scale,
            key.data_ptr(),
            key.stride(1),
            key.stride(2),
            value.data_ptr(),
            value.stride(1),
            value.stride(2),
            int(key.dtype == torch.bfloat16),
            out.data_ptr(),
            threads if self.threaded else 1,
        )
        if rc != 0:
            raise ValueError(f"attention kernel refused its arguments (rc={rc})")
        return out.reshape(1, heads, 1, dv).to(query.dtype)


def _flags(openmp: bool) -> list[str]:
    # 512-bit vectors and contracted multiply-adds: 1.1-1.3x faster than 256-bit here
    # (nothing in this kernel promises bitwise equality with an eager path).
    flags = [*kernel_build.base_flags(openmp), "-ffp-contract=fast"]
    if "-mavx512f" in flags:
        flags.append("-mprefer-vector-width=512")
    return flags


_lock = threading.Lock()
_loaded: AttentionKernel | None = None
_status: KernelStatus | None = None


def _load_uncached() -> tuple[AttentionKernel | None, KernelStatus]:
    return kernel_build.load_kernel(
        "attention_kernel",
        _SOURCE,
        _flags,
        lambda lib, path, threaded: AttentionKernel(lib, path, threaded=threaded),
        switch=_ENV_SWITCH,
    )


def load() -> AttentionKernel | None:
    """The kernel, compiled and loaded on first use (once per process); None if unusable."""
    global _loaded, _status
    if _status is None:
        with _lock:
            if _status is None:
                _loaded, _status = _load_uncached()
    return _loaded


def status() -> KernelStatus:
    """Whether :func:`load` found a kernel, and the library's path or the reason."""
    load()
    assert _status is not None
    return _status
