"""A CPU kernel for one query's attention over a long KV cache, fp32 or bf16 (and for a
short run of queries).

A decode step, a batched decode row and a splice's last token each attend with one query
per head over every cached key and value: the work is one read of K and V, so it should
run at memory speed. torch's CPU flash-attention kernel does not for bf16 caches: at 4k
tokens on SmolLM2 it takes 2.5-3.0 ms a layer for 3 MB of keys and values (about 1 GB/s),
which made attention most of a bf16 decode step. This kernel streams K and V once, widens
bf16 to fp32 on the fly (exact), keeps every sum in fp32 (SDPA's own accumulation type) and
splits the keys over threads flash-decoding style: each task holds a running max, sum and
weighted values for a segment of one key/value head, merged at the end. Grouped query
heads share the key/value head's read (``h // (heads / kv_heads)``, as ``enable_gqa``).

Where the compiler targets AVX2 + FMA and the widths are multiples of 8, the inner loops
are intrinsics: eight keys' scores at a time with one transposing reduction (a lone
64-wide dot product spends as long reducing lanes as multiplying), the weighted values of
64 columns held in registers over a chunk of keys, bf16 widened in registers, exp on eight
lanes: 2.2x (bf16) and 2.8x (fp32) faster at 4k keys than the portable C, vectorised by the
compiler, that other widths and other CPUs run (``src/leyline/evals/bench_decode_attention.py``).
On AVX-512, widths that are multiples of 16 take the same loops on 512-bit rows (half the
multiply-adds and loads; the eight scores folded by one tree across the lanes): a lone fp32
query 1.05-1.1x faster at 2-8k keys, streaming its keys from memory.

The same library runs a run of several queries at consecutive positions (a splice's
replacement: each sees the prefix and the run up to itself) over segments of keys, each
with its own queries and per-query limits (``AttentionKernel.attend_runs``). That work is
compute-bound (16 queries x 3 grouped heads read every key), so on AVX-512 the run's rows
go across the vector lanes instead: queries transposed once per task, each key's entries
broadcast against them for up to 64 rows at once (no lane reductions, no transposed keys),
the online softmax 16 rows at a time with the causal limits as lane masks, four rows'
weighted values per value load. Other CPUs get a row-by-row path, correct but slower than
torch's flash kernel, so ``AttentionKernel.takes_run`` leaves their runs to it; and on a
CPU with AMX torch's bf16 flash kernel runs on the tile unit, so each run shape and
key-count bucket goes to whichever measured faster here (``run_choice``).

Built with AMX where the CPU and compiler have it, and where Linux grants the process the
tile state (``AttentionKernel.amx``), bf16 products run on the tile unit: a run's scores
(the keys as A tiles as they lie in the cache, the rows' queries transposed into B tiles),
and a lone query's scores and weighted values in two passes over its keys, each weight
split into two bf16 parts (hi + lo) so the sums keep fp32 grade: 1.5-1.6x the vector path,
14-23 GB/s at 4-8k keys here. ``AttentionKernel.use_tiles(False)`` runs the vector paths.

Built and loaded by ``kernel_build`` (``LEYLINE_ATTENTION_KERNEL=0`` turns it off; without
a compiler :func:`load` returns None and ``decode_attention`` keeps torch's kernels).
"""

from __future__ import annotations

import ctypes
import warnings
from array import array
from collections.abc import Sequence
from pathlib import Path

import torch

from leyline.engine.cpu import kernel_build, run_choice
from leyline.engine.cpu.kernel_build import KernelStatus

__all__ = ["AttentionKernel", "KernelStatus", "eligible", "load", "status"]

MAX_DIM = 512
"""Widest key or value head the kernel takes (rows are widened on the stack)."""
MAX_GROUP = 16
"""Most query heads per key/value head."""
MAX_RUN_ROWS = 512
"""Most query rows (queries times query heads per key/value head) one run call takes."""
RUN_MIN_KEYS = 512
"""Fewest keys a run sees (all segments) for the engine to send it here: below about 600,
torch's flash kernel was as fast or faster (0.73-0.96x of its time at 128-300 keys,
1.16-1.98x from 600 on; ``src/leyline/evals/bench_run_attention.py``)."""
_MIN_BYTES_PER_THREAD = 1 << 18
_MIN_RUN_WORK_PER_THREAD = 1 << 20
_ENV_SWITCH = "LEYLINE_ATTENTION_KERNEL"

_SOURCE = (
    r"""
#define _GNU_SOURCE
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
"""
    + kernel_build.AMX_C
    + kernel_build.SCRATCH_C
    + kernel_build.EXP_C
    + r"""
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LL_AVX2 1
#else
#define LL_AVX2 0
#endif
/* bf16 products on the tile unit (AMX): query runs' scores, and a lone query's scores and
   weighted values. */
#if defined(__AMX_BF16__) && defined(__AVX512F__) && LL_AVX2
#define LL_TILES 1
static int ll_amx; /* the OS granted this process the tile state */
#else
#define LL_TILES 0
#endif

#define LL_MAX_DIM 512
#define LL_MAX_GROUP 16
#define LL_CHUNK 128
#define LL_MAX_TASKS 4096
/* Tasks a call cuts per thread, taken dynamically: segments of unequal length (a splice's
   prefix, moved downstream and side entries) cut into about two per thread and split
   statically left one thread with twice the other's keys in a replacement's runs. */
#define LL_TASKS_PER_THREAD 4
#define LL_STAGE (LL_CHUNK * 128)

static inline float ll_widen(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#define ll_exp kb_exp /* e^x for x <= 0 (a score minus the running max) */

static inline void ll_widen_n(const uint16_t *src, int64_t n, float *dst) {
    for (int64_t j = 0; j < n; j++) dst[j] = ll_widen(src[j]);
}

/* Rows [c0, c0 + cn) of one K or V head as fp32 rows `*stride` floats apart: the cache
   itself for fp32, else widened into `staged` (in one loop where the rows are dense). */
static inline const float *ll_rows(const char *head, int bf16, int64_t tok, int64_t width,
                                   int64_t c0, int64_t cn, float *staged, int64_t *stride) {
    if (!bf16) {
        *stride = tok;
        return (const float *)head + c0 * tok;
    }
    const uint16_t *h = (const uint16_t *)head;
    if (tok == width)
        ll_widen_n(h + c0 * width, cn * width, staged);
    else
        for (int64_t t = 0; t < cn; t++) ll_widen_n(h + (c0 + t) * tok, width, staged + t * width);
    *stride = width;
    return staged;
}

static inline float ll_dot(const float *a, const float *b, int64_t d) {
    float lane[16] = {0}; /* 16 independent partial sums: vectorises exactly */
    int64_t j = 0;
    for (; j + 16 <= d; j += 16)
        for (int u = 0; u < 16; u++) lane[u] += a[j + u] * b[j + u];
    float dot = 0.0f;
    for (; j < d; j++) dot += a[j] * b[j];
    for (int u = 0; u < 8; u++) lane[u] += lane[u + 8]; /* a tree, not a chain */
    for (int u = 0; u < 4; u++) lane[u] += lane[u + 4];
    return dot + ((lane[0] + lane[2]) + (lane[1] + lane[3]));
}

/* The portable chunk: out[t] = scale * q . row t; acc[j] += sum over t of p[t] * row t [j]. */
static void ll_scores(const float *q, int64_t d, const float *rows, int64_t stride, int64_t cn,
                      float scale, float *out) {
    for (int64_t t = 0; t < cn; t++) out[t] = ll_dot(q, rows + t * stride, d) * scale;
}

static void ll_accumulate(const float *p, const float *rows, int64_t stride, int64_t cn,
                          int64_t dv, float *acc) {
    for (int64_t t = 0; t < cn; t++) {
        const float *r = rows + t * stride;
        for (int64_t j = 0; j < dv; j++) acc[j] += p[t] * r[j];
    }
}

#if LL_AVX2
/* Widths that are multiples of 8, read straight from the cache: bf16 is widened in
   registers (zero-extend, shift left 16: exact), so nothing is staged in memory. */
#define LL_INLINE static inline __attribute__((always_inline))

LL_INLINE __m256 ll_load8(const char *row, int64_t j, int bf16) {
    if (bf16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + j));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)row + j);
}

LL_INLINE float ll_hsum8(__m256 a) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_shuffle_ps(x, x, 1)));
}

/* ll_exp on eight lanes (the same polynomial, multiply-adds fused). */
LL_INLINE __m256 ll_exp8(__m256 x) {
    const __m256 shift = _mm256_set1_ps(12582912.0f);
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), shift);
    n = _mm256_sub_ps(n, shift); /* round to nearest, as ll_exp */
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(e, 23)));
}

/* Eight rows at a time: eight accumulators of independent multiply-adds and one transposing
   reduction for all eight, where a dot product alone would spend as long reducing its
   lanes as multiplying. `rows` is row 0; rows are `bytes` apart. */
LL_INLINE void ll_scores8(const float *q, int64_t d, const char *rows, int64_t bytes,
                          int64_t cn, float scale, float *out, int bf16) {
    const __m256 sc = _mm256_set1_ps(scale);
    int64_t t = 0;
    for (; t + 8 <= cn; t += 8) {
        const char *r = rows + t * bytes;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        __m256 a4 = a0, a5 = a0, a6 = a0, a7 = a0;
        for (int64_t j = 0; j < d; j += 8) {
            __m256 qv = _mm256_loadu_ps(q + j);
            a0 = _mm256_fmadd_ps(qv, ll_load8(r, j, bf16), a0);
            a1 = _mm256_fmadd_ps(qv, ll_load8(r + bytes, j, bf16), a1);
            a2 = _mm256_fmadd_ps(qv, ll_load8(r + 2 * bytes, j, bf16), a2);
            a3 = _mm256_fmadd_ps(qv, ll_load8(r + 3 * bytes, j, bf16), a3);
            a4 = _mm256_fmadd_ps(qv, ll_load8(r + 4 * bytes, j, bf16), a4);
            a5 = _mm256_fmadd_ps(qv, ll_load8(r + 5 * bytes, j, bf16), a5);
            a6 = _mm256_fmadd_ps(qv, ll_load8(r + 6 * bytes, j, bf16), a6);
            a7 = _mm256_fmadd_ps(qv, ll_load8(r + 7 * bytes, j, bf16), a7);
        }
        /* hadd pairs lanes within 128-bit halves: after two rounds the low halves hold
           rows 0-3 (then 4-7) summed over lanes 0-3, the high halves over lanes 4-7 */
        __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
        __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
        __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20),
                                   _mm256_permute2f128_ps(h0, h1, 0x31));
        _mm256_storeu_ps(out + t, _mm256_mul_ps(sum, sc));
    }
    for (; t < cn; t++) {
        __m256 a = _mm256_setzero_ps();
        for (int64_t j = 0; j < d; j += 8)
            a = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), ll_load8(rows + t * bytes, j, bf16), a);
        out[t] = ll_hsum8(a) * scale;
    }
}

/* 64 columns at a time held in eight registers over all cn rows, then 8 at a time. */
LL_INLINE void ll_accumulate8(const float *p, const char *rows, int64_t bytes, int64_t cn,
                              int64_t dv, float *acc, int bf16) {
    int64_t j = 0;
    for (; j + 64 <= dv; j += 64) {
        __m256 a[8];
        for (int u = 0; u < 8; u++) a[u] = _mm256_loadu_ps(acc + j + 8 * u);
        for (int64_t t = 0; t < cn; t++) {
            const char *r = rows + t * bytes;
            __m256 pt = _mm256_set1_ps(p[t]);
            for (int u = 0; u < 8; u++)
                a[u] = _mm256_fmadd_ps(pt, ll_load8(r, j + 8 * u, bf16), a[u]);
        }
        for (int u = 0; u < 8; u++) _mm256_storeu_ps(acc + j + 8 * u, a[u]);
    }
    for (; j < dv; j += 8) {
        __m256 a = _mm256_loadu_ps(acc + j);
        for (int64_t t = 0; t < cn; t++)
            a = _mm256_fmadd_ps(_mm256_set1_ps(p[t]), ll_load8(rows + t * bytes, j, bf16), a);
        _mm256_storeu_ps(acc + j, a);
    }
}

#ifdef __AVX512F__
#define LL_V512 1
LL_INLINE __m512 ll_load16(const char *row, int64_t j, int bf16) {
    if (bf16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + j));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)row + j);
}

/* ll_scores8 on 512-bit vectors (d a multiple of 16): half the multiply-adds and loads.
   The eight keys' lane sums fold in one tree: pairs and quads inside each 128-bit lane,
   then across the four lanes, leaving the eight scores in the low half. */
LL_INLINE void ll_scores16(const float *q, int64_t d, const char *rows, int64_t bytes,
                           int64_t cn, float scale, float *out, int bf16) {
    const __m256 sc = _mm256_set1_ps(scale);
    int64_t t = 0;
    for (; t + 8 <= cn; t += 8) {
        const char *r = rows + t * bytes;
        __m512 k[8];
        for (int u = 0; u < 8; u++) k[u] = _mm512_setzero_ps();
        for (int64_t j = 0; j < d; j += 16) {
            __m512 qv = _mm512_loadu_ps(q + j);
            for (int u = 0; u < 8; u++)
                k[u] = _mm512_fmadd_ps(qv, ll_load16(r + u * bytes, j, bf16), k[u]);
        }
        __m512d x[4]; /* pairs of keys: within each 128-bit lane [a02 b02 a13 b13] */
        for (int u = 0; u < 4; u++)
            x[u] = _mm512_castps_pd(_mm512_add_ps(_mm512_unpacklo_ps(k[2 * u], k[2 * u + 1]),
                                                  _mm512_unpackhi_ps(k[2 * u], k[2 * u + 1])));
        /* quads: each 128-bit lane holds keys 0-3 (c0) or 4-7 (c1), summed over its lanes */
        __m512 c0 = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x[0], x[1])),
                                  _mm512_castpd_ps(_mm512_unpackhi_pd(x[0], x[1])));
        __m512 c1 = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x[2], x[3])),
                                  _mm512_castpd_ps(_mm512_unpackhi_pd(x[2], x[3])));
        __m512 e = _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(c0, c1, _MM_SHUFFLE(3, 1, 3, 1)));
        __m512 f = _mm512_add_ps(_mm512_shuffle_f32x4(e, e, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(e, e, _MM_SHUFFLE(3, 1, 3, 1)));
        _mm256_storeu_ps(out + t, _mm256_mul_ps(_mm512_castps512_ps256(f), sc));
    }
    for (; t < cn; t++) {
        __m512 a = _mm512_setzero_ps();
        for (int64_t j = 0; j < d; j += 16)
            a = _mm512_fmadd_ps(_mm512_loadu_ps(q + j), ll_load16(rows + t * bytes, j, bf16), a);
        out[t] = _mm512_reduce_add_ps(a) * scale;
    }
}

/* ll_accumulate8 on 512-bit vectors (dv a multiple of 16): 64 columns at a time, even and
   odd keys into separate registers (two chains a column: one would wait on each sum). */
LL_INLINE void ll_accumulate16(const float *p, const char *rows, int64_t bytes, int64_t cn,
                               int64_t dv, float *acc, int bf16) {
    int64_t j = 0;
    for (; j + 64 <= dv; j += 64) {
        __m512 a[4], b[4];
        for (int u = 0; u < 4; u++) {
            a[u] = _mm512_loadu_ps(acc + j + 16 * u);
            b[u] = _mm512_setzero_ps();
        }
        int64_t t = 0;
        for (; t + 2 <= cn; t += 2) {
            const char *r = rows + t * bytes;
            __m512 p0 = _mm512_set1_ps(p[t]), p1 = _mm512_set1_ps(p[t + 1]);
            for (int u = 0; u < 4; u++) {
                a[u] = _mm512_fmadd_ps(p0, ll_load16(r, j + 16 * u, bf16), a[u]);
                b[u] = _mm512_fmadd_ps(p1, ll_load16(r + bytes, j + 16 * u, bf16), b[u]);
            }
        }
        for (; t < cn; t++) {
            __m512 pt = _mm512_set1_ps(p[t]);
            for (int u = 0; u < 4; u++)
                a[u] = _mm512_fmadd_ps(pt, ll_load16(rows + t * bytes, j + 16 * u, bf16), a[u]);
        }
        for (int u = 0; u < 4; u++) _mm512_storeu_ps(acc + j + 16 * u, _mm512_add_ps(a[u], b[u]));
    }
    for (; j < dv; j += 16) {
        __m512 a = _mm512_loadu_ps(acc + j);
        for (int64_t t = 0; t < cn; t++)
            a = _mm512_fmadd_ps(_mm512_set1_ps(p[t]), ll_load16(rows + t * bytes, j, bf16), a);
        _mm512_storeu_ps(acc + j, a);
    }
}
#else
#define LL_V512 0
#endif
#endif

static inline float ll_max(const float *x, int64_t n) {
#if LL_AVX2
    if (n >= 8) {
        __m256 mv = _mm256_loadu_ps(x);
        int64_t t = 8;
        for (; t + 8 <= n; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(x + t));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        float m = _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
        for (; t < n; t++) m = x[t] > m ? x[t] : m;
        return m;
    }
#endif
    float lane[8];
    for (int u = 0; u < 8; u++) lane[u] = -INFINITY;
    int64_t t = 0;
    for (; t + 8 <= n; t += 8)
        for (int u = 0; u < 8; u++) lane[u] = x[t + u] > lane[u] ? x[t + u] : lane[u];
    for (; t < n; t++) lane[0] = x[t] > lane[0] ? x[t] : lane[0];
    float m = lane[0];
    for (int u = 1; u < 8; u++) m = lane[u] > m ? lane[u] : m;
    return m;
}

/* x[t] = e^(x[t] - m) in place; returns their sum. */
static inline float ll_weights(float *x, int64_t n, float m) {
    int64_t t = 0;
#if LL_AVX2
    __m256 sum = _mm256_setzero_ps(), mv = _mm256_set1_ps(m);
    for (; t + 8 <= n; t += 8) {
        __m256 w = ll_exp8(_mm256_sub_ps(_mm256_loadu_ps(x + t), mv));
        _mm256_storeu_ps(x + t, w);
        sum = _mm256_add_ps(sum, w);
    }
    float total = ll_hsum8(sum);
#else
    float total = 0.0f;
#endif
    int64_t rest = t;
    for (; t < n; t++) x[t] = ll_exp(x[t] - m);
    for (t = rest; t < n; t++) total += x[t];
    return total;
}

typedef struct {
    float m[LL_MAX_GROUP]; /* running max of the scores */
    float l[LL_MAX_GROUP]; /* sum of e^(score - m) */
} ll_stats;

/* Softmax bookkeeping for one chunk's scores s[i][0..cn): fold the chunk's max into the
   running one (rescaling what the segment holds), turn scores into weights, add their sum. */
static inline void ll_fold_row(float *m, float *l, float *s, int64_t cn, int64_t dv,
                               float *acc) {
    float cm = ll_max(s, cn);
    if (cm > *m) {
        float f = *m == -INFINITY ? 0.0f : ll_exp(*m - cm);
        *l *= f;
        for (int64_t j = 0; j < dv; j++) acc[j] *= f;
        *m = cm;
    }
    *l += ll_weights(s, cn, *m);
}

static void ll_fold(ll_stats *st, float (*s)[LL_CHUNK], int64_t group, int64_t cn,
                    int64_t dv, float *acc) {
    for (int64_t i = 0; i < group; i++)
        ll_fold_row(&st->m[i], &st->l[i], s[i], cn, dv, acc + i * dv);
}

/* Keys [lo, hi) of one key/value head for its `group` query heads: the segment's max,
   sum and unnormalised weighted values (acc, [group][dv]), a chunk of keys at a time. */
#if LL_TILES
static int ll_segment_tiles(const float *q, int64_t group, int64_t d, int64_t dv, float scale,
                            const uint16_t *k, int64_t k_tok, const uint16_t *v, int64_t v_tok,
                            int64_t lo, int64_t hi, ll_stats *st, float *acc);
#endif

/* One chunk's scores, softmax fold and weighted values, on SCORES / ACCUMULATE (bf16 as a
   constant, so each inlines its own loads). */
#define LL_CHUNK_PASS(SCORES, ACCUMULATE)                                                    \
    do {                                                                                    \
        for (int64_t i = 0; i < group; i++) {                                               \
            if (bf16)                                                                       \
                SCORES(q + i * d, d, k + c0 * kb, kb, cn, scale, s[i], 1);                  \
            else                                                                            \
                SCORES(q + i * d, d, k + c0 * kb, kb, cn, scale, s[i], 0);                  \
        }                                                                                   \
        ll_fold(st, s, group, cn, dv, acc);                                                 \
        for (int64_t i = 0; i < group; i++) {                                               \
            if (bf16)                                                                       \
                ACCUMULATE(s[i], v + c0 * vb, vb, cn, dv, acc + i * dv, 1);                 \
            else                                                                            \
                ACCUMULATE(s[i], v + c0 * vb, vb, cn, dv, acc + i * dv, 0);                 \
        }                                                                                   \
    } while (0)

static void ll_segment(const float *q, int64_t group, int64_t d, int64_t dv, float scale,
                       const char *k, int64_t k_tok, const char *v, int64_t v_tok, int bf16,
                       int64_t lo, int64_t hi, ll_stats *st, float *acc) {
#if LL_TILES
    if (bf16 && ll_amx && d % 32 == 0 && dv % 16 == 0 &&
        ll_segment_tiles(q, group, d, dv, scale, (const uint16_t *)k, k_tok,
                         (const uint16_t *)v, v_tok, lo, hi, st, acc))
        return;
#endif
    float s[LL_MAX_GROUP][LL_CHUNK];
    for (int64_t i = 0; i < group; i++) {
        st->m[i] = -INFINITY;
        st->l[i] = 0.0f;
        for (int64_t j = 0; j < dv; j++) acc[i * dv + j] = 0.0f;
    }
#if LL_AVX2
    if (d % 8 == 0 && dv % 8 == 0) {
        int64_t es = bf16 ? 2 : 4, kb = k_tok * es, vb = v_tok * es;
        /* 512-bit rows where both widths take them (LL_V512) */
        const int wide = LL_V512 && d % 16 == 0 && dv % 16 == 0;
        (void)wide;
        for (int64_t c0 = lo; c0 < hi; c0 += LL_CHUNK) {
            int64_t cn = hi - c0 < LL_CHUNK ? hi - c0 : LL_CHUNK;
            /* the next chunk's rows on their way while this one is scored: 4-9% here */
            int64_t next = hi - c0 - cn < LL_CHUNK ? hi - c0 - cn : LL_CHUNK;
            for (int64_t b = 0; b < next * kb; b += 64)
                _mm_prefetch(k + (c0 + cn) * kb + b, _MM_HINT_T0);
            for (int64_t b = 0; b < next * vb; b += 64)
                _mm_prefetch(v + (c0 + cn) * vb + b, _MM_HINT_T0);
#if LL_V512
            if (wide) {
                LL_CHUNK_PASS(ll_scores16, ll_accumulate16);
                continue;
            }
#endif
            LL_CHUNK_PASS(ll_scores8, ll_accumulate8);
        }
        return;
    }
#endif
    /* bf16 rows widened a chunk at a time (as many as `staged` holds, a multiple of 8) */
    float staged[LL_STAGE];
    int64_t chunk = LL_STAGE / (d > dv ? d : dv);
    chunk = chunk > LL_CHUNK ? LL_CHUNK : chunk - chunk % 8;
    for (int64_t c0 = lo; c0 < hi; c0 += chunk) {
        int64_t cn = hi - c0 < chunk ? hi - c0 : chunk, stride;
        const float *rows = ll_rows(k, bf16, k_tok, d, c0, cn, staged, &stride);
        for (int64_t i = 0; i < group; i++) ll_scores(q + i * d, d, rows, stride, cn, scale, s[i]);
        ll_fold(st, s, group, cn, dv, acc);
        rows = ll_rows(v, bf16, v_tok, dv, c0, cn, staged, &stride);
        for (int64_t i = 0; i < group; i++) ll_accumulate(s[i], rows, stride, cn, dv, acc + i * dv);
    }
}

/* Segments of keys, each with its own query (a query rotated for the segment, say): the
   softmax over the union of their keys. s: the segment count; q: fp32 [s][heads][d],
   contiguous; k[i], v[i]: segment i's [kv][n[i]][d] and [kv][n[i]][dv] (fp32, or bf16 when
   `bf16`), with head and token strides strides[4i..4i+3] = k_head, k_tok, v_head, v_tok in
   elements, last dim contiguous; out: fp32 [heads][dv]; lse: NULL, or fp32 [heads] for
   each head's log-sum-exp of its scaled scores. Returns 0, or a positive code for
   arguments it does not take. */
int leyline_single_query_segments(int32_t s, const float *q, int64_t heads, int64_t kv,
                                  const int64_t *n, int64_t d, int64_t dv, float scale,
                                  const void *const *k, const void *const *v,
                                  const int64_t *strides, int32_t bf16, float *out,
                                  float *lse, int32_t threads) {
    if (s <= 0 || kv <= 0 || heads % kv || d <= 0 || dv <= 0 || d > LL_MAX_DIM ||
        dv > LL_MAX_DIM || threads <= 0)
        return 1;
    int64_t group = heads / kv, total = 0;
    if (group > LL_MAX_GROUP) return 2;
    for (int32_t i = 0; i < s; i++) {
        if (n[i] <= 0) return 1;
        total += n[i];
    }
    size_t es = bf16 ? 2 : 4;
    /* about four tasks per thread over all heads and segments, none shorter than 256 keys,
       each taken by the next thread free (LL_TASKS_PER_THREAD) */
    int64_t per = ((int64_t)threads * LL_TASKS_PER_THREAD + kv - 1) / kv;
    int64_t seg = (total + per - 1) / per;
    if (seg < 256) seg = 256;
    int64_t tasks = 0;
    for (int32_t i = 0; i < s; i++) tasks += kv * ((n[i] + seg - 1) / seg);
    if (tasks > LL_MAX_TASKS) return 3;
    ll_stats *st = malloc(sizeof(ll_stats) * (size_t)tasks);
    float *acc = malloc(sizeof(float) * (size_t)(tasks * group * dv));
    int64_t *task_of = malloc(sizeof(int64_t) * (size_t)tasks * 3); /* segment, head, lo */
    if (!st || !acc || !task_of) {
        free(st);
        free(acc);
        free(task_of);
        return 4;
    }
    int64_t t = 0;
    for (int64_t h = 0; h < kv; h++)
        for (int32_t i = 0; i < s; i++)
            for (int64_t lo = 0; lo < n[i]; lo += seg, t++) {
                task_of[3 * t] = i;
                task_of[3 * t + 1] = h;
                task_of[3 * t + 2] = lo;
            }
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (threads > 1)
    for (int64_t task = 0; task < tasks; task++) {
        int64_t i = task_of[3 * task], h = task_of[3 * task + 1], lo = task_of[3 * task + 2];
        int64_t hi = lo + seg < n[i] ? lo + seg : n[i];
        const int64_t *sd = strides + 4 * i;
        ll_segment(q + (i * heads + h * group) * d, group, d, dv, scale,
                   (const char *)k[i] + h * sd[0] * es, sd[1],
                   (const char *)v[i] + h * sd[2] * es, sd[3], bf16, lo, hi, &st[task],
                   acc + task * group * dv);
    }
    /* tasks are ordered by head: each head's are one contiguous range */
    int64_t first = 0;
    for (int64_t h = 0; h < kv; h++) {
        int64_t last = first;
        while (last < tasks && task_of[3 * last + 1] == h) last++;
        for (int64_t g = 0; g < group; g++) {
            float m = -INFINITY, l = 0.0f;
            for (int64_t p = first; p < last; p++) {
                float x = st[p].m[g];
                m = x > m ? x : m;
            }
            float *o = out + (h * group + g) * dv;
            for (int64_t j = 0; j < dv; j++) o[j] = 0.0f;
            for (int64_t p = first; p < last; p++) {
                float f = ll_exp(st[p].m[g] - m);
                const float *a = acc + (p * group + g) * dv;
                l += st[p].l[g] * f;
                for (int64_t j = 0; j < dv; j++) o[j] += a[j] * f;
            }
            float inv = 1.0f / l;
            for (int64_t j = 0; j < dv; j++) o[j] *= inv;
            if (lse) lse[h * group + g] = m + logf(l);
        }
        first = last;
    }
    free(st);
    free(acc);
    free(task_of);
    return 0;
}

#if defined(__AVX512F__) && LL_AVX2
/* Query runs with widths that are multiples of 16, up to 128. Every row of a run reads the
   same keys, so the rows go across the vector lanes: the scores of 16 rows against a key
   are one register, built from the rows' queries transposed once per task ([d][rows]) and
   the key's entries broadcast (no lane reductions, no transposed keys); the softmax's max,
   exponentials and sums run 16 rows at a time, the causal limits as lane masks; the
   weighted values of two rows share each value row's load. */
#define LL_RUN512 1
#define LL_RCHUNK 64

LL_INLINE __m512 ll_exp16(__m512 x) { /* ll_exp on 16 lanes */
    const __m512 shift = _mm512_set1_ps(12582912.0f);
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), shift);
    n = _mm512_sub_ps(n, shift);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
    return _mm512_mul_ps(p, _mm512_castsi512_ps(_mm512_slli_epi32(e, 23)));
}

/* Scores of RB blocks of 16 rows (lanes) against TN keys: s[t][rows] for keys t0 .. t0 + TN,
   rows qb .. qb + 16 RB. Each key entry is broadcast once for all RB blocks, so a step is
   RB + TN loads for RB * TN multiply-adds. */
#define LL_QK(RB, TN)                                                                      \
    do {                                                                                   \
        __m512 c[RB][TN];                                                                  \
        for (int b = 0; b < RB; b++)                                                       \
            for (int u = 0; u < TN; u++) c[b][u] = _mm512_setzero_ps();                    \
        for (int64_t j = 0; j < d; j++) {                                                  \
            __m512 qa[RB];                                                                 \
            for (int b = 0; b < RB; b++) qa[b] = _mm512_loadu_ps(qt + j * rp + qb + 16 * b); \
            for (int u = 0; u < TN; u++) {                                                 \
                __m512 kb = _mm512_set1_ps(kr[(t0 + u) * ks + j]);                         \
                for (int b = 0; b < RB; b++) c[b][u] = _mm512_fmadd_ps(kb, qa[b], c[b][u]);  \
            }                                                                              \
        }                                                                                  \
        for (int b = 0; b < RB; b++)                                                       \
            for (int u = 0; u < TN; u++)                                                   \
                _mm512_storeu_ps(sc + (t0 + u) * rp + qb + 16 * b, c[b][u]);                \
    } while (0)

/* Every row's scores against the chunk's cn keys, up to 4 blocks of 16 rows at a time. */
LL_INLINE void ll_qk(const float *qt, int64_t rp, int64_t d, const float *kr, int64_t ks,
                     int64_t cn, float *sc) {
    for (int64_t qb = 0; qb < rp; qb += 64) {
        int64_t blocks = (rp - qb) / 16, t0 = 0;
        switch (blocks) {
        case 1: for (; t0 + 8 <= cn; t0 += 8) LL_QK(1, 8); for (; t0 < cn; t0++) LL_QK(1, 1); break;
        case 2: for (; t0 + 8 <= cn; t0 += 8) LL_QK(2, 8); for (; t0 < cn; t0++) LL_QK(2, 1); break;
        case 3: for (; t0 + 8 <= cn; t0 += 8) LL_QK(3, 8); for (; t0 < cn; t0++) LL_QK(3, 1); break;
        default: for (; t0 + 6 <= cn; t0 += 6) LL_QK(4, 6); for (; t0 < cn; t0++) LL_QK(4, 1);
        }
    }
}

/* Columns [j, j + 16 * W) of R rows' weighted values over cn keys, weights ps apart: each
   value row's load serves all R rows. */
#define LL_PV(R, W)                                                                        \
    do {                                                                                   \
        __m512 x[R][W];                                                                    \
        for (int i = 0; i < R; i++)                                                        \
            for (int u = 0; u < W; u++) x[i][u] = _mm512_loadu_ps(a[i] + j + 16 * u);      \
        for (int64_t t = 0; t < cn; t++) {                                                 \
            const float *r = vr + t * vs + j;                                              \
            __m512 vv[W];                                                                  \
            for (int u = 0; u < W; u++) vv[u] = _mm512_loadu_ps(r + 16 * u);               \
            for (int i = 0; i < R; i++) {                                                  \
                __m512 w = _mm512_set1_ps(p[i][t * ps]);                                   \
                for (int u = 0; u < W; u++) x[i][u] = _mm512_fmadd_ps(w, vv[u], x[i][u]);  \
            }                                                                              \
        }                                                                                  \
        for (int i = 0; i < R; i++)                                                        \
            for (int u = 0; u < W; u++) _mm512_storeu_ps(a[i] + j + 16 * u, x[i][u]);      \
    } while (0)

/* Rows p[0 .. R) (R = 4; unused rows point at zero weights and junk accumulators). */
LL_INLINE void ll_pv4(const float *const p[4], int64_t ps, const float *vr, int64_t vs,
                      int64_t cn, int64_t dv, float *const a[4]) {
    int64_t j = 0;
    for (; j + 64 <= dv; j += 64) LL_PV(4, 4);
    for (; j < dv; j += 16) LL_PV(4, 1);
}

/* Floats of scratch ll_run_task512 needs for `rows` rows (the tile unit's operands too). */
static inline int64_t ll_run512_scratch(int64_t rows, int64_t d, int64_t dv) {
    int64_t rp = (rows + 15) / 16 * 16;
    return d * rp + LL_RCHUNK * rp + LL_RCHUNK * (d + dv) + 4 * rp + rp * d / 2 + 8 * d + 16;
}

#if LL_TILES
/* bf16 scores on the tile unit (AMX). A chunk's keys are the A tiles as they lie in the
   cache (16 keys x 32 dims, one row per key), the rows' queries transposed into B tiles
   (16 dim pairs x 16 rows x 2), so each C tile holds 16 keys' scores for 16 rows: the
   s[t][rows] layout the softmax below reads. Sums are fp32 as on the vector path; only
   their order differs. */

static int ll_amx_granted;

/* 1 when this process may use the tile unit (Linux grants it on request, per process);
   the kernel then uses it. */
int32_t leyline_attention_amx_ready(void) {
    ll_amx_granted = kb_amx_request();
    ll_amx = ll_amx_granted;
    return ll_amx;
}

/* Whether bf16 products use the tile unit from now on (where granted): for A/B runs and
   tests. Returns the setting in force. */
int32_t leyline_attention_use_tiles(int32_t on) {
    ll_amx = on && ll_amx_granted;
    return ll_amx;
}

/* The B tiles of q [rows][d] (fp32 holding bf16 values, rows past `rows` zero): tile (b, h)
   at qv + (b * d / 32 + h) * 512 holds rows 16b .. 16b + 16, dims 32h .. 32h + 32. Returns 0
   when some entry is not a bf16 value (the caller then keeps the fp32 path). */
static int ll_qv_tiles(const float *q, int64_t rows, int64_t rp, int64_t d, uint16_t *qv) {
    for (int64_t b = 0; b < rp / 16; b++)
        for (int64_t h = 0; h < d / 32; h++) {
            uint16_t *tile = qv + (b * (d / 32) + h) * 512;
            for (int r = 0; r < 16; r++)
                for (int c = 0; c < 16; c++)
                    for (int e = 0; e < 2; e++) {
                        int64_t row = b * 16 + c;
                        uint32_t u = 0;
                        if (row < rows) memcpy(&u, q + row * d + 32 * h + 2 * r + e, 4);
                        if (u & 0xffffu) return 0;
                        tile[r * 32 + c * 2 + e] = (uint16_t)(u >> 16);
                    }
        }
    return 1;
}

/* Unscaled scores s[t][rows] of cn keys (bf16, tok apart) against every row, in C tiles of
   16 keys by up to 4 x 16 rows; a last partial group of keys is read from `tail` (16 rows of
   d, zero past the chunk) so that no read goes past the chunk's keys. */
static void ll_qk_tiles(const uint16_t *qv, int64_t rp, int64_t d, const uint16_t *k,
                        int64_t tok, int64_t cn, uint16_t *tail, float *sc) {
    const int64_t dh = d / 32, blocks = rp / 16, cs = rp * 4;
    for (int64_t t0 = 0; t0 < cn; t0 += 16) {
        const uint16_t *kt = k + t0 * tok;
        int64_t ks = tok * 2;
        if (cn - t0 < 16) {
            memset(tail, 0, (size_t)(16 * d) * 2);
            for (int64_t t = 0; t < cn - t0; t++) memcpy(tail + t * d, kt + t * tok, (size_t)d * 2);
            kt = tail;
            ks = d * 2;
        }
        for (int64_t b0 = 0; b0 < blocks; b0 += 4) {
            const int64_t nb = blocks - b0 < 4 ? blocks - b0 : 4;
            _tile_zero(0);
            if (nb > 1) _tile_zero(1);
            if (nb > 2) _tile_zero(2);
            if (nb > 3) _tile_zero(3);
            for (int64_t h = 0; h < dh; h++) {
                const uint16_t *qb = qv + (b0 * dh + h) * 512;
                _tile_loadd(4, kt + 32 * h, ks);
                _tile_loadd(5, qb, 64);
                _tile_dpbf16ps(0, 4, 5);
                if (nb > 1) {
                    _tile_loadd(6, qb + dh * 512, 64);
                    _tile_dpbf16ps(1, 4, 6);
                }
                if (nb > 2) {
                    _tile_loadd(7, qb + 2 * dh * 512, 64);
                    _tile_dpbf16ps(2, 4, 7);
                }
                if (nb > 3) {
                    _tile_loadd(5, qb + 3 * dh * 512, 64);
                    _tile_dpbf16ps(3, 4, 5);
                }
            }
            float *o = sc + t0 * rp + b0 * 16;
            _tile_stored(0, o, cs);
            if (nb > 1) _tile_stored(1, o + 16, cs);
            if (nb > 2) _tile_stored(2, o + 32, cs);
            if (nb > 3) _tile_stored(3, o + 48, cs);
        }
    }
}
#endif

static void ll_run_task512(const float *q, int64_t rows, int64_t m, const int64_t *lim,
                           int64_t d, int64_t dv, float scale, const char *k, int64_t k_tok,
                           const char *v, int64_t v_tok, int bf16, int64_t lo, int64_t hi,
                           float *mx, float *l, float *acc, float *scratch) {
    int64_t rp = (rows + 15) / 16 * 16;
    float *qt = scratch, *sc = qt + d * rp, *kw = sc + LL_RCHUNK * rp, *vw = kw + LL_RCHUNK * d;
    float *mv = vw + LL_RCHUNK * dv, *lv = mv + rp, *fac = lv + rp;
    int32_t *lr = (int32_t *)(fac + rp);
    float junk[LL_MAX_DIM];
    int64_t top = 0;
    for (int64_t r = 0; r < rp; r++) {
        for (int64_t j = 0; j < d; j++) qt[j * rp + r] = r < rows ? q[r * d + j] * scale : 0.0f;
        lr[r] = r < rows ? (int32_t)lim[r % m] : 0;
        top = lr[r] > top ? lr[r] : top;
        mv[r] = -INFINITY;
        lv[r] = 0.0f;
    }
    int tiles = 0; /* scores on the tile unit, scaled in the softmax's first pass */
#if LL_TILES
    uint16_t *qv = (uint16_t *)(lr + rp), *tail = qv + rp * d;
    tiles = ll_amx && bf16 && d % 32 == 0 && ll_qv_tiles(q, rows, rp, d, qv);
    if (tiles) kb_tiles_configure(kb_full_tiles);
#endif
    const __m512 post = _mm512_set1_ps(tiles ? scale : 1.0f);
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    for (int64_t c0 = lo; c0 < hi && c0 < top; c0 += LL_RCHUNK) {
        int64_t cn = hi - c0 < LL_RCHUNK ? hi - c0 : LL_RCHUNK, ks, vs;
        const float *vr = ll_rows(v, bf16, v_tok, dv, c0, cn, vw, &vs);
#if LL_TILES
        if (tiles)
            ll_qk_tiles(qv, rp, d, (const uint16_t *)k + c0 * k_tok, k_tok, cn, tail, sc);
        else
#endif
        {
            const float *kr = ll_rows(k, bf16, k_tok, d, c0, cn, kw, &ks);
            ll_qk(qt, rp, d, kr, ks, cn, sc);
        }
        for (int64_t rb = 0; rb < rp; rb += 16) {
            __m512i limv = _mm512_loadu_si512((const void *)(lr + rb));
            __m512 cm = ninf;
            for (int64_t t = 0; t < cn; t++) {
                __mmask16 ok = _mm512_cmpgt_epi32_mask(limv, _mm512_set1_epi32((int32_t)(c0 + t)));
                __m512 x = _mm512_mask_blend_ps(
                    ok, ninf, _mm512_mul_ps(_mm512_loadu_ps(sc + t * rp + rb), post));
                _mm512_storeu_ps(sc + t * rp + rb, x);
                cm = _mm512_max_ps(cm, x);
            }
            __m512 old = _mm512_loadu_ps(mv + rb), now = _mm512_max_ps(old, cm);
            __mmask16 had = _mm512_cmp_ps_mask(old, ninf, _CMP_NEQ_OQ);
            __m512 f = _mm512_maskz_mov_ps(had, ll_exp16(_mm512_sub_ps(old, now)));
            __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(lv + rb), f);
            for (int64_t t = 0; t < cn; t++) {
                __m512 x = _mm512_loadu_ps(sc + t * rp + rb);
                __mmask16 ok = _mm512_cmp_ps_mask(x, ninf, _CMP_NEQ_OQ);
                __m512 w = _mm512_maskz_mov_ps(ok, ll_exp16(_mm512_sub_ps(x, now)));
                _mm512_storeu_ps(sc + t * rp + rb, w);
                sum = _mm512_add_ps(sum, w);
            }
            _mm512_storeu_ps(mv + rb, now);
            _mm512_storeu_ps(lv + rb, sum);
            _mm512_storeu_ps(fac + rb, f);
        }
        for (int64_t r = 0; r < rows; r += 4) { /* rows past `rows` (up to rp) weigh 0 */
            int64_t most = 0;
            const float *p[4];
            float *a[4];
            for (int64_t x = r; x < r + 4; x++) {
                int64_t seen = x < rows ? lr[x] - c0 : 0;
                most = seen > most ? seen : most;
                p[x - r] = sc + x;
                a[x - r] = x < rows ? acc + x * dv : junk;
            }
            if (most <= 0) continue;
            if (most > cn) most = cn;
            for (int64_t x = r; x < r + 4 && x < rows; x++) /* rescale to the new max */
                if (fac[x] != 1.0f)
                    for (int64_t j = 0; j < dv; j++) acc[x * dv + j] *= fac[x];
            ll_pv4(p, rp, vr, vs, most, dv, a);
        }
    }
#if LL_TILES
    if (tiles) _tile_release();
#endif
    for (int64_t r = 0; r < rows; r++) {
        mx[r] = mv[r];
        l[r] = lv[r];
    }
}


#if LL_TILES
/* fp32 lanes rounded to bf16, nearest even (finite values: weights in [0, 1]). */
LL_INLINE __m256i ll_round_bf16(__m512 x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
}

LL_INLINE __m512 ll_widen16(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* vpermt2w indices pairing two value rows' columns 0-15 (then 16-31) for a B tile row. */
static const int16_t ll_pair_idx[2][32] = {
    {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
     8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47},
    {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
     24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63}};

#define LL_PV_TILE(B)                                                                      \
    do {                                                                                   \
        _tile_loadd(6, vp + (B) * 512, 64);                                                \
        _tile_dpbf16ps(B, 4, 6);                                                           \
        _tile_dpbf16ps(B, 5, 6);                                                           \
    } while (0)

/* One query's `group` heads over keys [lo, hi) of one key/value head on the tile unit, in
   two passes. Scores: the keys as A tiles as they lie in the cache (16 keys x 32 dims),
   the heads' queries as one B tile per 32 dims. Weighted values: each weight split into two
   bf16 parts (hi + lo: 16 bits of it) as A tiles of `group` rows, against value rows paired
   for B tiles, so the sums keep fp32 grade where one bf16 weight would not. Fills st and
   acc as ll_segment does; returns 0, touching neither, when q holds a non-bf16 value. */
static int ll_segment_tiles(const float *q, int64_t group, int64_t d, int64_t dv, float scale,
                            const uint16_t *k, int64_t k_tok, const uint16_t *v, int64_t v_tok,
                            int64_t lo, int64_t hi, ll_stats *st, float *acc) {
    const int64_t n = hi - lo, np = (n + 31) / 32 * 32, dh = d / 32;
    /* scores [np][16] fp32; weights hi, lo [group][np] bf16; query tiles [dh][512] bf16;
       a 16-key tail [16][d]; a 32-key value tail [32][dv]; paired values [4][512] bf16 */
    float *sc = kb_scratch(np * 16 + group * np + dh * 256 + 8 * d + 16 * dv + 1024 + 64);
    if (!sc) return 0;
    uint16_t *ph = (uint16_t *)(sc + np * 16), *pl = ph + group * np;
    uint16_t *qb = pl + group * np, *kt = qb + dh * 512, *vt = kt + 16 * d, *vp = vt + 32 * dv;
    for (int64_t h = 0; h < dh; h++)
        for (int r = 0; r < 16; r++)
            for (int c = 0; c < 16; c++)
                for (int e = 0; e < 2; e++) {
                    uint32_t u = 0;
                    if (c < group) memcpy(&u, q + c * d + 32 * h + 2 * r + e, 4);
                    if (u & 0xffffu) return 0;
                    qb[h * 512 + r * 32 + c * 2 + e] = (uint16_t)(u >> 16);
                }
    kb_tiles_configure(kb_full_tiles);
    for (int64_t t0 = 0; t0 < n; t0 += 16) {
        const uint16_t *kr = k + (lo + t0) * k_tok;
        int64_t ks = k_tok * 2;
        if (n - t0 < 16) { /* no read past the segment's keys */
            memset(kt, 0, (size_t)(16 * d) * 2);
            for (int64_t t = 0; t < n - t0; t++) memcpy(kt + t * d, kr + t * k_tok, (size_t)d * 2);
            kr = kt;
            ks = d * 2;
        }
        _tile_zero(0);
        for (int64_t h = 0; h < dh; h++) {
            _tile_loadd(4, kr + 32 * h, ks);
            _tile_loadd(5, qb + h * 512, 64);
            _tile_dpbf16ps(0, 4, 5);
        }
        _tile_stored(0, sc + t0 * 16, 64);
    }
    const __m512i idx = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(16));
    const __m512 sv = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
    for (int64_t g = 0; g < group; g++) {
        __m512 mv = ninf;
        for (int64_t t0 = 0; t0 < n; t0 += 16) {
            __mmask16 in = n - t0 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - t0)) - 1);
            __m512 x = _mm512_mask_i32gather_ps(ninf, in, idx, sc + t0 * 16 + g, 4);
            mv = _mm512_max_ps(mv, _mm512_mask_mul_ps(ninf, in, x, sv));
        }
        const float m = _mm512_reduce_max_ps(mv);
        const __m512 mb = _mm512_set1_ps(m);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t t0 = 0; t0 < np; t0 += 16) {
            __mmask16 in = t0 >= n            ? (__mmask16)0
                           : n - t0 >= 16     ? (__mmask16)0xffff
                                              : (__mmask16)((1u << (n - t0)) - 1);
            __m512 x = _mm512_mask_i32gather_ps(mb, in, idx, sc + t0 * 16 + g, 4);
            __m512 w = _mm512_maskz_mov_ps(in, ll_exp16(_mm512_sub_ps(_mm512_mul_ps(x, sv), mb)));
            sum = _mm512_add_ps(sum, w);
            __m256i whi = ll_round_bf16(w);
            __m256i wlo = ll_round_bf16(_mm512_sub_ps(w, ll_widen16(whi)));
            _mm256_storeu_si256((__m256i *)(ph + g * np + t0), whi);
            _mm256_storeu_si256((__m256i *)(pl + g * np + t0), wlo);
        }
        st->m[g] = m;
        st->l[g] = _mm512_reduce_add_ps(sum);
    }
    const uint8_t g8 = (uint8_t)group; /* C tiles 0-3 and the weights' A tiles 4-5 */
    const uint8_t rows[8] = {g8, g8, g8, g8, g8, g8, 16, 16};
    kb_tiles_configure(rows);
    const __m512i pair0 = _mm512_loadu_si512((const void *)ll_pair_idx[0]);
    const __m512i pair1 = _mm512_loadu_si512((const void *)ll_pair_idx[1]);
    for (int64_t c0 = 0; c0 < dv; c0 += 64) {
        const int64_t nb = (dv - c0) / 16 < 4 ? (dv - c0) / 16 : 4;
        _tile_zero(0);
        if (nb > 1) _tile_zero(1);
        if (nb > 2) _tile_zero(2);
        if (nb > 3) _tile_zero(3);
        for (int64_t t0 = 0; t0 < np; t0 += 32) {
            const uint16_t *vr = v + (lo + t0) * v_tok;
            int64_t vs = v_tok;
            if (n - t0 < 32) { /* no read past the segment's values */
                memset(vt, 0, (size_t)(32 * dv) * 2);
                for (int64_t t = 0; t < n - t0; t++)
                    memcpy(vt + t * dv, vr + t * v_tok, (size_t)dv * 2);
                vr = vt;
                vs = dv;
            }
            for (int p = 0; p < 16; p++) {
                const uint16_t *r0 = vr + 2 * p * vs + c0, *r1 = r0 + vs;
                for (int64_t b = 0; b < nb; b += 2) {
                    __mmask32 m = nb - b == 1 ? (__mmask32)0xffff : (__mmask32)0xffffffff;
                    __m512i a = _mm512_maskz_loadu_epi16(m, r0 + 16 * b);
                    __m512i c = _mm512_maskz_loadu_epi16(m, r1 + 16 * b);
                    _mm512_storeu_si512((void *)(vp + b * 512 + p * 32),
                                        _mm512_permutex2var_epi16(a, pair0, c));
                    if (nb - b > 1)
                        _mm512_storeu_si512((void *)(vp + (b + 1) * 512 + p * 32),
                                            _mm512_permutex2var_epi16(a, pair1, c));
                }
            }
            _tile_loadd(4, ph + t0, np * 2);
            _tile_loadd(5, pl + t0, np * 2);
            LL_PV_TILE(0);
            if (nb > 1) LL_PV_TILE(1);
            if (nb > 2) LL_PV_TILE(2);
            if (nb > 3) LL_PV_TILE(3);
        }
        _tile_stored(0, acc + c0, dv * 4);
        if (nb > 1) _tile_stored(1, acc + c0 + 16, dv * 4);
        if (nb > 2) _tile_stored(2, acc + c0 + 32, dv * 4);
        if (nb > 3) _tile_stored(3, acc + c0 + 48, dv * 4);
    }
    _tile_release();
    return 1;
}
#endif
#endif

#if !LL_TILES
int32_t leyline_attention_amx_ready(void) { return 0; }
int32_t leyline_attention_use_tiles(int32_t on) { return 0 * on; }
#endif

/* Whether query runs take the vectorised path above (where the widths allow it). */
int leyline_query_runs_vectorised(void) {
#ifdef LL_RUN512
    return 1;
#else
    return 0;
#endif
}

/* One task of a query run: keys [lo, hi) of one key/value head, for `rows` query rows
   (row r = group head r / m, query r % m, fp32 [rows][d]); row r sees the keys below
   lim[r % m] only. Fills each row's running max, sum and unnormalised weighted values. */
static void ll_run_task(const float *q, int64_t rows, int64_t m, const int64_t *lim, int64_t d,
                        int64_t dv, float scale, const char *k, int64_t k_tok, const char *v,
                        int64_t v_tok, int bf16, int64_t lo, int64_t hi, float *mx, float *l,
                        float *acc, float *staged) {
    float s[LL_CHUNK];
    for (int64_t r = 0; r < rows; r++) {
        mx[r] = -INFINITY;
        l[r] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)(rows * dv));
    int64_t es = bf16 ? 2 : 4, kb = k_tok * es, vb = v_tok * es;
#ifdef LL_RUN512
    if (d % 16 == 0 && dv % 16 == 0 && d <= 128 && dv <= 128) {
        float *scratch = kb_scratch(ll_run512_scratch(rows, d, dv));
        if (scratch) {
            ll_run_task512(q, rows, m, lim, d, dv, scale, k, k_tok, v, v_tok, bf16, lo, hi, mx,
                           l, acc, scratch);
            return;
        }
    }
#endif
    int64_t chunk = LL_CHUNK;
#if LL_AVX2
    int direct = d % 8 == 0 && dv % 8 == 0;
#else
    int direct = 0;
#endif
    if (!direct) { /* as many widened rows as `staged` holds, a multiple of 8 */
        chunk = LL_STAGE / (d > dv ? d : dv);
        chunk = chunk > LL_CHUNK ? LL_CHUNK : chunk - chunk % 8;
    }
    for (int64_t c0 = lo; c0 < hi; c0 += chunk) {
        int64_t cn = hi - c0 < chunk ? hi - c0 : chunk, ks = 0, vs = 0;
        const float *krows = NULL, *vrows = NULL;
        if (!direct) { /* the chunk's keys and values, widened once for every row */
            krows = ll_rows(k, bf16, k_tok, d, c0, cn, staged, &ks);
            vrows = ll_rows(v, bf16, v_tok, dv, c0, cn, staged + LL_STAGE, &vs);
        }
        for (int64_t r = 0; r < rows; r++) {
            int64_t seen = lim[r % m] - c0;
            if (seen <= 0) continue;
            if (seen > cn) seen = cn;
            const float *qr = q + r * d;
            float *a = acc + r * dv;
#if LL_AVX2
            if (direct) {
                if (bf16)
                    ll_scores8(qr, d, k + c0 * kb, kb, seen, scale, s, 1);
                else
                    ll_scores8(qr, d, k + c0 * kb, kb, seen, scale, s, 0);
                ll_fold_row(&mx[r], &l[r], s, seen, dv, a);
                if (bf16)
                    ll_accumulate8(s, v + c0 * vb, vb, seen, dv, a, 1);
                else
                    ll_accumulate8(s, v + c0 * vb, vb, seen, dv, a, 0);
                continue;
            }
#endif
            ll_scores(qr, d, krows, ks, seen, scale, s);
            ll_fold_row(&mx[r], &l[r], s, seen, dv, a);
            ll_accumulate(s, vrows, vs, seen, dv, a);
        }
    }
}

/* A run of m queries over segments of keys, each segment with its own queries (a query
   rotated for the segment, say) and its own visible prefix per query: the softmax, per
   query, over the union of the keys it sees. s: the segment count; q: fp32
   [s][heads][m][d], contiguous; lim: [s][m], how many of segment i's first keys query j
   sees (0 to n[i]; every query sees one key at least); k, v, strides as for
   leyline_single_query_segments; out: fp32 [heads][m][dv]. Returns 0, or a positive
   code for arguments it does not take. */
int leyline_query_run_segments(int32_t s, const float *q, int64_t heads, int64_t kv, int64_t m,
                               const int64_t *n, const int64_t *lim, int64_t d, int64_t dv,
                               float scale, const void *const *k, const void *const *v,
                               const int64_t *strides, int32_t bf16, float *out,
                               int32_t threads) {
    if (s <= 0 || kv <= 0 || m <= 0 || heads % kv || d <= 0 || dv <= 0 || d > LL_MAX_DIM ||
        dv > LL_MAX_DIM || threads <= 0)
        return 1;
    int64_t group = heads / kv, rows = group * m, total = 0;
    for (int64_t j = 0; j < m; j++) {
        int64_t seen = 0;
        for (int32_t i = 0; i < s; i++) {
            if (lim[i * m + j] < 0 || lim[i * m + j] > n[i]) return 1;
            seen += lim[i * m + j];
        }
        if (seen <= 0) return 5;
    }
    for (int32_t i = 0; i < s; i++) {
        if (n[i] <= 0) return 1;
        total += n[i];
    }
    size_t es = bf16 ? 2 : 4;
    int64_t per = ((int64_t)threads * LL_TASKS_PER_THREAD + kv - 1) / kv;
    int64_t seg = (total + per - 1) / per;
    if (seg < 256) seg = 256;
    int64_t tasks = 0;
    for (int32_t i = 0; i < s; i++) tasks += kv * ((n[i] + seg - 1) / seg);
    if (tasks > LL_MAX_TASKS) return 3;
    size_t stats = (size_t)(tasks * rows);
    float *mx = malloc(sizeof(float) * stats * 2);
    float *acc = malloc(sizeof(float) * stats * (size_t)dv);
    /* widened rows for the row-by-row path only: 2 x 64 KB a thread, an mmap and its page
       faults on every call were they allocated for the vectorised path too */
    int staging = 1;
#ifdef LL_RUN512
    staging = !(d % 16 == 0 && dv % 16 == 0 && d <= 128 && dv <= 128);
#endif
    float *staged = staging ? malloc(sizeof(float) * (size_t)threads * 2 * LL_STAGE) : NULL;
    int64_t *task_of = malloc(sizeof(int64_t) * (size_t)tasks * 3); /* segment, head, lo */
    if (!mx || !acc || (staging && !staged) || !task_of) {
        free(mx);
        free(acc);
        free(staged);
        free(task_of);
        return 4;
    }
    float *l = mx + stats;
    int64_t t = 0;
    for (int64_t h = 0; h < kv; h++)
        for (int32_t i = 0; i < s; i++)
            for (int64_t lo = 0; lo < n[i]; lo += seg, t++) {
                task_of[3 * t] = i;
                task_of[3 * t + 1] = h;
                task_of[3 * t + 2] = lo;
            }
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#ifdef _OPENMP
        float *mine = staged ? staged + (size_t)omp_get_thread_num() * 2 * LL_STAGE : NULL;
#else
        float *mine = staged;
#endif
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            int64_t i = task_of[3 * task], h = task_of[3 * task + 1], lo = task_of[3 * task + 2];
            int64_t hi = lo + seg < n[i] ? lo + seg : n[i];
            const int64_t *sd = strides + 4 * i;
            ll_run_task(q + (i * heads + h * group) * m * d, rows, m, lim + i * m, d, dv, scale,
                        (const char *)k[i] + h * sd[0] * es, sd[1],
                        (const char *)v[i] + h * sd[2] * es, sd[3], bf16, lo, hi,
                        mx + task * rows, l + task * rows, acc + task * rows * dv, mine);
        }
    }
    /* tasks are ordered by head; a task that saw none of a row's keys holds max -inf */
    int64_t first = 0;
    for (int64_t h = 0; h < kv; h++) {
        int64_t last = first;
        while (last < tasks && task_of[3 * last + 1] == h) last++;
        for (int64_t r = 0; r < rows; r++) {
            float top = -INFINITY, sum = 0.0f;
            for (int64_t p = first; p < last; p++)
                top = mx[p * rows + r] > top ? mx[p * rows + r] : top;
            float *o = out + (h * rows + r) * dv; /* [heads][m] order: head h*group + r/m */
            for (int64_t j = 0; j < dv; j++) o[j] = 0.0f;
            for (int64_t p = first; p < last; p++) {
                if (mx[p * rows + r] == -INFINITY) continue;
                float f = ll_exp(mx[p * rows + r] - top);
                const float *a = acc + (p * rows + r) * dv;
                sum += l[p * rows + r] * f;
                for (int64_t j = 0; j < dv; j++) o[j] += a[j] * f;
            }
            float inv = 1.0f / sum;
            for (int64_t j = 0; j < dv; j++) o[j] *= inv;
        }
        first = last;
    }
    free(mx);
    free(acc);
    free(staged);
    free(task_of);
    return 0;
}
"""
)


def eligible(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether the kernel takes ``query [1, heads, 1, d]`` over ``key [1, kv, n, d]`` and
    ``value [1, kv, n, dv]``: CPU, all fp32 or all bf16, heads a multiple of kv heads (at
    most :data:`MAX_GROUP` per kv head), widths up to :data:`MAX_DIM`, K and V with a
    contiguous last dim."""
    return query.dim() == 4 and query.shape[2] == 1 and _takes(query, key, value, MAX_GROUP)


def run_eligible(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether :meth:`AttentionKernel.attend_runs` takes a run ``query [1, heads, m, d]``
    over ``key``/``value`` as :func:`eligible` says, with ``m`` queries times the query
    heads per kv head at most :data:`MAX_RUN_ROWS`."""
    if query.dim() != 4 or query.shape[2] < 1 or key.dim() != 4 or key.shape[1] == 0:
        return False
    rows = query.shape[2] * (query.shape[1] // key.shape[1])
    return rows <= MAX_RUN_ROWS and _takes(query, key, value, MAX_RUN_ROWS)


def _takes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: int) -> bool:
    return (
        query.dim() == 4
        and key.dim() == 4
        and value.dim() == 4
        and query.shape[0] == key.shape[0] == value.shape[0] == 1
        and key.shape[2] == value.shape[2] > 0
        and key.shape[1] == value.shape[1] > 0
        and query.shape[1] % key.shape[1] == 0
        and query.shape[1] // key.shape[1] <= group
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


def _check_seen(m: int, lengths: Sequence[int], seen: Sequence[Sequence[int]]) -> None:
    """``seen`` (per segment, per query) fits the segments' ``lengths``, and every query
    sees a key."""
    for n, counts in zip(lengths, seen, strict=True):
        if len(counts) != m or not all(0 <= x <= n for x in counts):
            raise ValueError(f"seen: {m} counts within the segment's {n} keys")
    if any(sum(c) == 0 for c in zip(*seen, strict=True)):
        raise ValueError("every query of a run must see at least one key")


def _geometry(t: torch.Tensor) -> tuple[object, ...]:
    return (tuple(t.shape), t.stride(), t.dtype, t.device)


class _SegmentTable:
    """The key/value segments of one call as the C functions take them, in one int64 array
    (a ctypes array per argument cost ~20 us a call, a decode step makes 30):
    lengths, key pointers, value pointers, then four strides per segment."""

    __slots__ = ("_table", "key_ptrs", "keys", "kv_heads", "lengths", "strides", "value_ptrs")

    def __init__(self, segments: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        count = len(segments)
        self.kv_heads = segments[0][0].shape[1]
        values: list[int] = [k.shape[2] for k, _ in segments]
        self.keys = sum(values)
        """Keys over all segments."""
        values += [k.data_ptr() for k, _ in segments]
        values += [v.data_ptr() for _, v in segments]
        for k, v in segments:
            values += (k.stride(1), k.stride(2), v.stride(1), v.stride(2))
        self._table = array("q", values)  # kept alive with the addresses below
        base = self._table.buffer_info()[0]
        self.lengths, self.key_ptrs = base, base + 8 * count
        self.value_ptrs, self.strides = base + 16 * count, base + 24 * count


class PreparedCall:
    """One call of the kernel, a lone query's or a run's, over the same key segments in each
    layer of a forward (an in-place edit's layers read the same positions of their own
    buffers): checked and tabled once (:meth:`AttentionKernel.prepare`), so that a call
    costs the C function and its output alone. :meth:`AttentionKernel.attend_segments` and
    :meth:`~AttentionKernel.attend_runs` are one layer's such call. Their checks and tables
    on every call were part of the 6-7 ms of Python that a 4k bf16 splice spent around its
    attention's 60 calls (docs/perf.md)."""

    __slots__ = ("_fn", "_qshape", "_scale", "_seen", "_tables", "_threads", "bf16", "dv")

    def __init__(
        self,
        kernel: AttentionKernel,
        layers: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]],
        heads: int,
        m: int,
        scale: float | None,
        seen: Sequence[Sequence[int]] | None,
    ) -> None:
        """``layers``: per layer, the segments' ``(key, value)``, already checked alike;
        ``seen``: per segment, how many of its first keys each of the ``m`` queries sees (a
        run), or None for a lone query (``m == 1``, every key)."""
        key, value = layers[0][0]
        kv_heads, d, self.dv = key.shape[1], key.shape[3], value.shape[3]
        self._tables = [_SegmentTable(segments) for segments in layers]
        self._qshape = (len(layers[0]), heads, m, d)
        self._scale = d**-0.5 if scale is None else scale
        self.bf16 = key.dtype == torch.bfloat16
        threads = torch.get_num_threads() if kernel.threaded else 1
        keys = self._tables[0].keys
        if seen is None:
            self._fn, self._seen = kernel._fn, None
            work = keys * kv_heads * (d + self.dv) * key.element_size() // _MIN_BYTES_PER_THREAD
        else:  # compute-bound where a lone query is bandwidth-bound: threads by multiply-adds
            self._fn, self._seen = kernel._runs, array("q", [x for c in seen for x in c])
            work = keys * heads * m * (d + self.dv) // _MIN_RUN_WORK_PER_THREAD
        self._threads = max(1, min(threads, work))

    def __call__(
        self, layer: int, queries: torch.Tensor, lse: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Attention at ``layer`` of ``queries``, fp32 ``[segments, heads, m, d]``
        contiguous (each segment's own), as fp32 ``[heads, m, dv]``; a lone query's call
        also writes the log-sum-exp into ``lse`` (fp32 ``[heads]``) when given."""
        if (
            tuple(queries.shape) != self._qshape
            or queries.dtype != torch.float32
            or not queries.is_contiguous()
        ):
            raise ValueError(f"queries: fp32 {list(self._qshape)} contiguous expected")
        count, heads, m, d = self._qshape
        if lse is not None and (
            self._seen is not None
            or lse.numel() != heads
            or lse.dtype != torch.float32
            or not lse.is_contiguous()
        ):
            raise ValueError(f"lse: a lone query's call writes fp32 [{heads}] contiguous")
        t = self._tables[layer]
        out = torch.empty(heads, m, self.dv, dtype=torch.float32)
        if self._seen is None:
            rc = self._fn(
                count, queries.data_ptr(), heads, t.kv_heads, t.lengths, d, self.dv,
                self._scale, t.key_ptrs, t.value_ptrs, t.strides, int(self.bf16),
                out.data_ptr(), None if lse is None else lse.data_ptr(), self._threads,
            )  # fmt: skip
        else:
            rc = self._fn(
                count, queries.data_ptr(), heads, t.kv_heads, m, t.lengths,
                self._seen.buffer_info()[0], d, self.dv, self._scale, t.key_ptrs,
                t.value_ptrs, t.strides, int(self.bf16), out.data_ptr(), self._threads,
            )  # fmt: skip
        if rc != 0:
            raise ValueError(f"attention kernel refused its arguments (rc={rc})")
        return out


class AttentionKernel:
    """The loaded shared library."""

    def __init__(self, lib: ctypes.CDLL, path: Path, *, threaded: bool) -> None:
        self.path = path
        self.threaded = threaded
        """Built with OpenMP: calls split their keys over ``torch.get_num_threads()``."""
        fn = lib.leyline_single_query_segments
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ctypes.c_int32, ptr, i64, i64, ptr, i64, i64, ctypes.c_float]
        fn.argtypes += [ptr, ptr, ptr, ctypes.c_int32, ptr, ptr, ctypes.c_int32]
        fn.restype = ctypes.c_int32
        self._fn = fn
        runs = lib.leyline_query_run_segments
        runs.argtypes = [ctypes.c_int32, ptr, i64, i64, i64, ptr, ptr, i64, i64, ctypes.c_float]
        runs.argtypes += [ptr, ptr, ptr, ctypes.c_int32, ptr, ctypes.c_int32]
        runs.restype = ctypes.c_int32
        self._runs = runs
        self.amx = bool(lib.leyline_attention_amx_ready())
        """bf16 products run on the CPU's tile unit (built with AMX, and the OS lets this
        process use it): query runs' scores, a lone query's scores and weighted values."""
        self._use_tiles = lib.leyline_attention_use_tiles
        self._use_tiles.argtypes = [ctypes.c_int32]
        self._use_tiles.restype = ctypes.c_int32
        self.runs_vectorised = bool(lib.leyline_query_runs_vectorised())
        """Query runs of widths that are multiples of 16 (up to 128) run on AVX-512 code:
        1.4-2.1x torch's flash kernel for 16 queries on an AVX-512 CPU without AMX.
        Elsewhere (portable, AVX2 row by row) they measured slower than it, so
        :meth:`takes_run` says no."""
        try:
            mode = run_choice.mode_from_env()
        except ValueError as exc:
            warnings.warn(f"{exc}; measuring (auto)", stacklevel=2)
            mode = "auto"
        self.run_choice = run_choice.RunChooser(self, mode)
        """Where vectorised, whether the runs beat torch's flash kernel on this CPU, per
        shape (measured once: on a Xeon with AMX torch's bf16 kernel wins)."""

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float | None,
        *,
        checked: bool = False,
    ) -> torch.Tensor:
        """``softmax(q k^T * scale) v`` over every key (no mask), ``[1, heads, 1, dv]`` in
        the query's dtype (SDPA's layout); ``scale`` defaults to ``d ** -0.5``. Raises
        ``ValueError`` for tensors :func:`eligible` refuses (``checked``: the caller has
        just asked :func:`eligible`, so it is not asked again)."""
        out, _ = self.attend_segments([(query, key, value)], scale, checked=checked)
        return out.to(query.dtype)

    def use_tiles(self, on: bool) -> bool:
        """Whether bf16 products use the tile unit from now on, where :attr:`amx` allows
        (the default where it does); returns the setting in force. For A/B runs and tests:
        both paths compute the same attention to fp32 sums."""
        return bool(self._use_tiles(int(on)))

    def attend_segments(
        self,
        segments: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        scale: float | None,
        *,
        with_lse: bool = False,
        checked: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One query's attention over the union of several key segments, each ``(query,
        key, value)`` with its own query (e.g. rotated for that segment), in one call:
        fp32 ``[1, heads, 1, dv]`` and, ``with_lse``, the log-sum-exp ``[1, heads, 1]``.
        Every segment must be :func:`eligible` (``checked``: the caller has just asked, so
        it is not asked again), all with the same heads, widths and dtype."""
        first_q, first_k, first_v = segments[0]
        heads, d = first_q.shape[1], first_q.shape[3]
        kv_heads, dv, dtype = first_k.shape[1], first_v.shape[3], first_k.dtype
        for q, k, v in segments:
            if not (checked or eligible(q, k, v)) or (
                q.shape[1], k.shape[1], v.shape[3], k.dtype
            ) != (
                heads, kv_heads, dv, dtype
            ):  # fmt: skip
                raise ValueError("tensors not eligible for the attention kernel")
        qs = torch.stack([q.reshape(heads, 1, d) for q, _, _ in segments]).to(torch.float32)
        call = PreparedCall(self, [[(k, v) for _, k, v in segments]], heads, 1, scale, None)
        lse = torch.empty(heads, dtype=torch.float32) if with_lse else None
        out = call(0, qs, lse).reshape(1, heads, 1, dv)
        return out, None if lse is None else lse.reshape(1, heads, 1)

    def takes_run(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        keys: int | None = None,
        parts: int = 1,
    ) -> bool:
        """Whether a run of queries is worth sending here rather than to torch's flash
        kernel: :func:`run_eligible`, on the vectorised path, at least two queries, and
        measured faster than torch's for this shape and number of keys on this CPU
        (``run_choice``); ``keys``: all the run sees over its ``parts`` segments (default:
        ``key``'s, one segment)."""
        d, dv = query.shape[-1], value.shape[-1]
        return (
            self.runs_vectorised
            and query.dim() == 4
            and query.shape[2] >= 2
            and d % 16 == 0
            and dv % 16 == 0
            and d <= 128
            and dv <= 128
            and run_eligible(query, key, value)
            and self.run_choice.kernel_wins_over(
                query, key, value, key.shape[2] if keys is None else keys, parts
            )
        )

    def attend_runs(
        self,
        segments: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, Sequence[int]]],
        scale: float | None,
        *,
        checked: bool = False,
    ) -> torch.Tensor:
        """A run of ``m`` queries over several key segments, each ``(query [1, heads, m, d],
        key, value, seen)`` with its own query and ``seen[j]``, how many of the segment's
        first keys query ``j`` sees (0 to its length): per query, the softmax over the union
        of what it sees, in one call; fp32 ``[1, heads, m, dv]``. A causal run of queries at
        the last ``m`` positions of a cache of ``n`` sees ``n - m + 1 + j``. Every segment
        must be :func:`run_eligible` (``checked``: the caller has just asked, through
        :meth:`takes_run`), all alike, and every query must see a key."""
        first_q, first_k, first_v, _ = segments[0]
        heads, m = first_q.shape[1], first_q.shape[2]
        kv_heads, dv, dtype = first_k.shape[1], first_v.shape[3], first_k.dtype
        for q, k, v, _ in segments:
            if not (checked or run_eligible(q, k, v)) or (
                q.shape[1:3],
                k.shape[1],
                v.shape[3],
                k.dtype,
            ) != ((heads, m), kv_heads, dv, dtype):
                raise ValueError("tensors not eligible for the attention kernel")
        _check_seen(m, [seg[1].shape[2] for seg in segments], [seg[3] for seg in segments])
        qs = torch.stack([q[0] for q, _, _, _ in segments]).to(torch.float32).contiguous()
        layer = [(k, v) for _, k, v, _ in segments]
        call = PreparedCall(self, [layer], heads, m, scale, [seg[3] for seg in segments])
        return call(0, qs).unsqueeze(0)

    def prepare(
        self,
        layers: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]],
        heads: int,
        m: int,
        scale: float | None,
        seen: Sequence[Sequence[int]] | None = None,
    ) -> PreparedCall:
        """The call at every layer ``i`` of :meth:`attend_segments` (``seen`` None, one
        query) or :meth:`attend_runs` (``m`` queries, ``seen`` per segment) over the
        segments ``layers[i]``, each ``(key, value)``: layer 0's are checked as those
        methods check them, every other layer's must lie alike (the same shapes, strides
        and dtype). Raises ``ValueError`` otherwise."""
        first = layers[0]
        key = first[0][0]
        query = torch.empty(1, heads, m, key.shape[3], dtype=key.dtype)
        ok = eligible if seen is None else run_eligible
        dv = first[0][1].shape[3]
        for k, v in first:
            if not ok(query, k, v) or (k.shape[1], v.shape[3], k.dtype) != (
                key.shape[1],
                dv,
                key.dtype,
            ):
                raise ValueError("tensors not eligible for the attention kernel")
        if seen is not None:
            _check_seen(m, [k.shape[2] for k, _ in first], seen)
        shape = [_geometry(t) for segment in first for t in segment]
        if any([_geometry(t) for segment in other for t in segment] != shape for other in layers):
            raise ValueError("every layer's segments must lie as the first layer's do")
        return PreparedCall(self, layers, heads, m, scale, seen)


def _flags(openmp: bool) -> list[str]:
    # 512-bit vectors and contracted multiply-adds: 1.1-1.3x faster than 256-bit here
    # (nothing in this kernel promises bitwise equality with an eager path).
    flags = [*kernel_build.base_flags(openmp), "-ffp-contract=fast"]
    if "-mavx512f" in flags:
        flags.append("-mprefer-vector-width=512")
    return flags + kernel_build.amx_flags(flags)  # query runs' bf16 scores on the tile unit


_kernel = kernel_build.LazyKernel(
    "attention_kernel",
    _SOURCE,
    _flags,
    lambda lib, path, threaded: AttentionKernel(lib, path, threaded=threaded),
    switch=_ENV_SWITCH,
)


def load() -> AttentionKernel | None:
    """The kernel, compiled and loaded on first use (once per process); None if unusable."""
    return _kernel.load()


def status() -> KernelStatus:
    """Whether :func:`load` found a kernel, and the library's path or the reason."""
    return _kernel.status()
