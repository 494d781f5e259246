/* A linear layer on a few rows reading oneDNN's packed weight in place:
   leyline_packed_linear, loaded by linear_kernel.py (and part of layer_kernel.c).

   An output block of 64 (or 32) columns of up to four (or eight) rows is held in registers
   while the reduction dimension is walked, prefetching LL_AHEAD bytes ahead, so every
   weight byte comes from memory once per call whatever the row count. With three row
   groups or more on a slice of the reduction (fp32, a splice's pass), the prefetch goes two
   slices ahead into L2 instead (LL_FAR).

   The layout is the one oneDNN picks for these weights with a row hint of 64 on an AVX-512
   CPU (measured, not documented): output blocks of B columns, each [K_pad][B] for fp32 and
   [K_pad / 2][B][2] for bf16 (pairs of reduction indices interleaved, VNNI style), K_pad
   the reduction length rounded up with zeros, blocks in order. B is 64, except bf16 on a
   CPU with AMX, where oneDNN packs for the tile unit in blocks of 32.

   Sums are fp32 for both dtypes; a bf16 output is rounded to nearest even. bf16 weights
   are widened exactly or, with AVX512_BF16, multiplied a pair at a time by vdpbf16ps, as
   oneDNN does. On the AMX packing, built with AMX and where Linux grants the tile unit, up
   to 32 rows run as two 16-row A tiles against the block's two 16-column B tiles, loaded
   from the packed buffer as it lies; outputs written 16 lanes at a time, bias added, bf16
   rounded as the scalar code rounds. */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif
#include "kb_amx.h"


/* A block is 16 * J output columns (J = 4: 64, J = 2: 32); a group of R <= 16 / J rows
   keeps R * J accumulators, at most 16 vector registers. */
#define LL_ACC 16
/* Bytes of a block read ahead by software prefetch: the hardware prefetcher alone leaves
   a few-row product 15-20% short of what it reaches with it (measured, bf16, 1-8 rows). */
#define LL_AHEAD 8192
/* fp32 with three row groups or more on each slice: bytes ahead prefetched into L2 instead,
   two slices of a 64-column block. The first group of a slice then finds it in L2 rather
   than stalling on memory while the others compute: 17-32 rows 1.1x faster over SmolLM2's
   layers on a Xeon with AMX; with one or two groups the near L1 prefetch is as fast or
   faster (measured, 2026-12-06, docs/perf.md). */
#define LL_FAR (2 * LL_KSLICE * 64 * 4)
/* Reduction entries per slice when several row groups share a block (even: bf16 pairs). */
#ifndef LL_KSLICE
#define LL_KSLICE 64
#endif

static inline float ll_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* fp32 -> bf16, nearest even, NaN kept quiet; a select rather than a branch, so that loops
   calling it vectorise. */
static inline uint16_t ll_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16, quiet = (u >> 16) | 0x40u;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
}

/* y[0..cols) = out[0..cols) + bias[0..cols), fp32 or rounded to nearest even bf16 (as
   ll_to_bf16, NaN included), 16 lanes at a time. */
static void ll_store_row(const float *out, int64_t cols, const void *bias, void *y, int bf16) {
#ifdef __AVX512F__
    const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7fff);
    const __m512i abs = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
    const __m512i quiet = _mm512_set1_epi32(0x40);
    for (int64_t c = 0; c < cols; c += 16) {
        __mmask16 m = cols - c >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (cols - c)) - 1);
        __m512 v = _mm512_maskz_loadu_ps(m, out + c);
        if (bias) {
            __m512 b = bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                  _mm256_maskz_loadu_epi16(m, (const uint16_t *)bias + c)), 16))
                            : _mm512_maskz_loadu_ps(m, (const float *)bias + c);
            v = _mm512_add_ps(v, b);
        }
        if (!bf16) {
            _mm512_mask_storeu_ps((float *)y + c, m, v);
            continue;
        }
        __m512i u = _mm512_castps_si512(v);
        __m512i up = _mm512_srli_epi32(u, 16);
        __m512i r = _mm512_srli_epi32(
            _mm512_add_epi32(u, _mm512_add_epi32(half, _mm512_and_si512(up, one))), 16);
        __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, abs), inf);
        r = _mm512_mask_or_epi32(r, nan, up, quiet);
        _mm256_mask_storeu_epi16((uint16_t *)y + c, m, _mm512_cvtepi32_epi16(r));
    }
#else
    for (int64_t c = 0; c < cols; c++) {
        float v = out[c];
        if (bias) v += bf16 ? ll_bf16(((const uint16_t *)bias)[c]) : ((const float *)bias)[c];
        if (bf16) ((uint16_t *)y)[c] = ll_to_bf16(v);
        else ((float *)y)[c] = v;
    }
#endif
}

/* out[i][0..16J) = sum_k x[i][k] * W[k][block col] for R rows; x rows are fp32, kp apart. */
static inline __attribute__((always_inline)) void ll_block_f32(
    const float *w, int64_t k, const float *x, int64_t kp, float *out, const int R,
    const int J, int more, int line, int far) {
    const int B = 16 * J;
#ifdef __AVX512F__
    __m512 a[LL_ACC];
    for (int i = 0; i < R; i++)
        for (int j = 0; j < J; j++)
            a[i * J + j] = more ? _mm512_loadu_ps(out + i * B + 16 * j) : _mm512_setzero_ps();
    for (int64_t t = 0; t < k; t++) {
        const float *wt = w + t * B;
        if (far)
            _mm_prefetch((const char *)wt + LL_FAR + line, _MM_HINT_T1);
        else
            _mm_prefetch((const char *)wt + LL_AHEAD + line, _MM_HINT_T0);
        __m512 wv[4];
        for (int j = 0; j < J; j++) wv[j] = _mm512_loadu_ps(wt + 16 * j);
        for (int i = 0; i < R; i++) {
            __m512 xb = _mm512_set1_ps(x[i * kp + t]);
            for (int j = 0; j < J; j++) a[i * J + j] = _mm512_fmadd_ps(xb, wv[j], a[i * J + j]);
        }
    }
    for (int i = 0; i < R; i++)
        for (int j = 0; j < J; j++) _mm512_storeu_ps(out + i * B + 16 * j, a[i * J + j]);
#else
    (void)line;
    (void)far;
    for (int i = 0; i < R; i++) {
        float acc[64] = {0};
        if (more) memcpy(acc, out + i * B, (size_t)B * sizeof(float));
        for (int64_t t = 0; t < k; t++) {
            float xv = x[i * kp + t];
            for (int c = 0; c < B; c++) acc[c] += xv * w[t * B + c];
        }
        memcpy(out + i * B, acc, (size_t)B * sizeof(float));
    }
#endif
}

/* The same for bf16 weights [kp/2][16J][2]: lane c of a pair row holds W[2p][c] in its low
   half and W[2p+1][c] in its high half; both widen to fp32 exactly. x rows are fp32, zero
   past k, so a padded odd tail adds nothing. */
static inline __attribute__((always_inline)) void ll_block_bf16(
    const uint16_t *w, int64_t k, const float *x, int64_t kp, float *out, const int R,
    const int J, int more, int line) {
    const int B = 16 * J;
    int64_t pairs = (k + 1) / 2;
#ifdef __AVX512F__
    __m512 a[LL_ACC];
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    for (int i = 0; i < R; i++)
        for (int j = 0; j < J; j++)
            a[i * J + j] = more ? _mm512_loadu_ps(out + i * B + 16 * j) : _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        const uint16_t *wp = w + p * 2 * B;
        _mm_prefetch((const char *)wp + LL_AHEAD + line, _MM_HINT_T0);
        __m512 lo[4], hi[4];
        for (int j = 0; j < J; j++) {
            __m512i v = _mm512_loadu_si512((const void *)(wp + 32 * j));
            lo[j] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
            hi[j] = _mm512_castsi512_ps(_mm512_and_si512(v, high));
        }
        for (int i = 0; i < R; i++) {
            __m512 x0 = _mm512_set1_ps(x[i * kp + 2 * p]);
            __m512 x1 = _mm512_set1_ps(x[i * kp + 2 * p + 1]);
            for (int j = 0; j < J; j++) {
                a[i * J + j] = _mm512_fmadd_ps(x0, lo[j], a[i * J + j]);
                a[i * J + j] = _mm512_fmadd_ps(x1, hi[j], a[i * J + j]);
            }
        }
    }
    for (int i = 0; i < R; i++)
        for (int j = 0; j < J; j++) _mm512_storeu_ps(out + i * B + 16 * j, a[i * J + j]);
#else
    (void)line;
    for (int i = 0; i < R; i++) {
        float acc[64] = {0};
        if (more) memcpy(acc, out + i * B, (size_t)B * sizeof(float));
        for (int64_t p = 0; p < pairs; p++) {
            float x0 = x[i * kp + 2 * p], x1 = x[i * kp + 2 * p + 1];
            const uint16_t *wp = w + p * 2 * B;
            for (int c = 0; c < B; c++)
                acc[c] += x0 * ll_bf16(wp[2 * c]) + x1 * ll_bf16(wp[2 * c + 1]);
        }
        memcpy(out + i * B, acc, (size_t)B * sizeof(float));
    }
#endif
}

#ifdef __AVX512BF16__
/* bf16 on the CPU's bf16 dot product: each instruction adds both products of a pair
   (x[2p] W[2p][c] + x[2p+1] W[2p+1][c]) to fp32 lane c, so the weights are never widened.
   xb holds the rows in bf16, kp apart, zero past k. */
static inline __attribute__((always_inline)) void ll_block_dpbf16(
    const uint16_t *w, int64_t k, const uint16_t *xb, int64_t kp, float *out, const int R,
    const int J, int more, int line) {
    const int B = 16 * J;
    int64_t pairs = (k + 1) / 2;
    __m512 a[LL_ACC];
    for (int i = 0; i < R; i++)
        for (int j = 0; j < J; j++)
            a[i * J + j] = more ? _mm512_loadu_ps(out + i * B + 16 * j) : _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        const uint16_t *wp = w + p * 2 * B;
        _mm_prefetch((const char *)wp + LL_AHEAD + line, _MM_HINT_T0);
        __m512bh v[4];
        for (int j = 0; j < J; j++)
            v[j] = (__m512bh)_mm512_loadu_si512((const void *)(wp + 32 * j));
        for (int i = 0; i < R; i++) {
            int32_t pair;
            memcpy(&pair, xb + i * kp + 2 * p, 4);
            __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            for (int j = 0; j < J; j++) a[i * J + j] = _mm512_dpbf16_ps(a[i * J + j], v[j], xv);
        }
    }
    for (int i = 0; i < R; i++)
        for (int j = 0; j < J; j++) _mm512_storeu_ps(out + i * B + 16 * j, a[i * J + j]);
}
#endif

/* One group of r rows (1 <= r <= 16 / J) against one block: R and J become constants, so
   the accumulators stay in registers. */
#define LL_ROWS4(CALL, J) \
    switch (r) { case 1: CALL(1, J); break; case 2: CALL(2, J); break; \
                 case 3: CALL(3, J); break; default: CALL(4, J); break; }
#define LL_ROWS8(CALL, J) \
    switch (r) { case 1: CALL(1, J); break; case 2: CALL(2, J); break; \
                 case 3: CALL(3, J); break; case 4: CALL(4, J); break; \
                 case 5: CALL(5, J); break; case 6: CALL(6, J); break; \
                 case 7: CALL(7, J); break; default: CALL(8, J); break; }
#define LL_DISPATCH(CALL) \
    if (J == 4) { LL_ROWS4(CALL, 4) } else { LL_ROWS8(CALL, 2) }

static void ll_block(int bf16, const void *w, int64_t k, const float *x, const uint16_t *xb,
                     int64_t kp, float *out, int r, int J, int more, int line, int far) {
    if (bf16) {
        const uint16_t *wb = (const uint16_t *)w;
#ifdef __AVX512BF16__
        (void)x;
#define LL_DOT(R, JJ) ll_block_dpbf16(wb, k, xb, kp, out, R, JJ, more, line)
        LL_DISPATCH(LL_DOT)
        return;
#else
        (void)xb;
#endif
#define LL_WIDE(R, JJ) ll_block_bf16(wb, k, x, kp, out, R, JJ, more, line)
        LL_DISPATCH(LL_WIDE)
    } else {
        const float *wf = (const float *)w;
#define LL_F32(R, JJ) ll_block_f32(wf, k, x, kp, out, R, JJ, more, line, far)
        LL_DISPATCH(LL_F32)
    }
}

/* 1 when bf16 products run on the CPU's bf16 dot product (built with AVX512_BF16). */
int32_t leyline_linear_bf16_dot(void) {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

#ifdef __AMX_BF16__
/* The tile unit on oneDNN's AMX packing of bf16 weights ([kp/2][32][2] per block of 32
   columns, kp a multiple of 32). Rows go 32 at a time, as two 16-row A tiles; a block's
   32 columns are two B tiles (16 pairs x 16 columns: 64 of each pair row's 128 bytes), so
   the 8 tiles hold C 2x2, A 2 and B 2. x rows are bf16, kp apart, zero past k and past
   the last row up to a multiple of 16 (rows_pad). */
/* 1 when this process may use the tile unit (Linux grants it on request, per process). */
int32_t leyline_linear_amx_ready(void) { return kb_amx_request(); }

static void ll_amx_block(const char *wb, int64_t kp, const uint16_t *xb, int64_t rows_pad,
                         float *out) {
    for (int64_t g0 = 0; g0 < rows_pad; g0 += 32) {
        const int two = rows_pad - g0 > 16;
        const uint16_t *x0 = xb + g0 * kp, *x1 = x0 + 16 * kp;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t t = 0; t < kp / 32; t++) {
            const char *bt = wb + t * 16 * 128;
            for (int line = 0; line < 2048; line += 64)
                _mm_prefetch(bt + LL_AHEAD + line, _MM_HINT_T0);
            _tile_loadd(6, bt, 128);
            _tile_loadd(7, bt + 64, 128);
            _tile_loadd(4, x0 + 32 * t, kp * 2);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            if (two) {
                _tile_loadd(5, x1 + 32 * t, kp * 2);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        float *o = out + g0 * 32;
        _tile_stored(0, o, 128);
        _tile_stored(1, o + 16, 128);
        if (two) {
            _tile_stored(2, o + 16 * 32, 128);
            _tile_stored(3, o + 16 * 32 + 16, 128);
        }
    }
}
#else
int32_t leyline_linear_amx_ready(void) { return 0; }
#endif

/* y[rows][n] = x[rows][k] W^T (+ bias): W packed as above, n output columns in
   ceil(n / block) blocks of kp reduction entries each (block = 64 or 32). x, bias and y
   are fp32 or bf16 like W (bf16 = 1), rows contiguous (x_stride / y_stride elements
   apart). Returns 0, -1 when memory for the widened rows runs out, -2 for another block. */
int32_t leyline_packed_linear(const void *w, int64_t n, int64_t k, int64_t kp,
                              const void *x, int64_t rows, int64_t x_stride,
                              const void *bias, void *y, int64_t y_stride, int32_t bf16,
                              int32_t threads, int32_t block, int32_t amx_rows) {
    if (block != 64 && block != 32) return -2;
#ifdef __AMX_BF16__
    if (bf16 && block == 32 && amx_rows > 0 && rows >= amx_rows && kp % 32 == 0) {
        int64_t rows_pad = (rows + 15) / 16 * 16;
        int64_t blocks = (n + 31) / 32;
        uint16_t *xb = (uint16_t *)calloc((size_t)(rows_pad * kp), sizeof(uint16_t));
        float *outs = (float *)malloc((size_t)threads * (size_t)(rows_pad * 32) * sizeof(float));
        if (!xb || !outs) {
            free(xb);
            free(outs);
            return -1;
        }
        for (int64_t i = 0; i < rows; i++)
            memcpy(xb + i * kp, (const uint16_t *)x + i * x_stride, (size_t)k * 2);
        /* Up to 32 rows (one group), A and C tiles as tall as the rows they hold (the
           second's: the rows past 16), so the tile unit does no work on padding: over
           SmolLM2's products 17 rows 1.06-1.11x, 1-8 rows 1.07x. */
        uint8_t shape[8] = {16, 16, 16, 16, 16, 16, 16, 16};
        int first = rows < 16 ? (int)rows : 16;
        int second = rows > 16 && rows <= 32 ? (int)(rows - 16) : 16;
        shape[0] = shape[1] = shape[4] = (uint8_t)first;
        shape[2] = shape[3] = shape[5] = (uint8_t)second;
#pragma omp parallel num_threads(threads) if (threads > 1)
        {
            kb_tiles_configure(shape);
            int me = 0;
#ifdef _OPENMP
            me = omp_get_thread_num();
#endif
            float *out = outs + (int64_t)me * rows_pad * 32;
#pragma omp for schedule(static)
            for (int64_t b = 0; b < blocks; b++) {
                ll_amx_block((const char *)w + b * kp * 32 * 2, kp, xb, rows_pad, out);
                int64_t c0 = b * 32, cols = n - c0 < 32 ? n - c0 : 32;
                for (int64_t i = 0; i < rows; i++)
                    ll_store_row(out + i * 32, cols, bias ? (const uint16_t *)bias + c0 : NULL,
                                 (uint16_t *)y + i * y_stride + c0, 1);
            }
            _tile_release();
        }
        free(xb);
        free(outs);
        return 0;
    }
#else
    (void)amx_rows;
#endif
    const int J = block / 16, group = LL_ACC / J;
    int64_t blocks = (n + block - 1) / block;
    int64_t es = bf16 ? 2 : 4;
    float *xf = (float *)calloc((size_t)(rows * kp + 1), sizeof(float));
    uint16_t *xb = (uint16_t *)calloc((size_t)(rows * kp + 2), sizeof(uint16_t));
    if (!xf || !xb) {
        free(xf);
        free(xb);
        return -1;
    }
    for (int64_t i = 0; i < rows; i++)
        for (int64_t t = 0; t < k; t++) {
            if (bf16) xb[i * kp + t] = ((const uint16_t *)x)[i * x_stride + t];
            xf[i * kp + t] = bf16 ? ll_bf16(((const uint16_t *)x)[i * x_stride + t])
                                  : ((const float *)x)[i * x_stride + t];
        }
    /* More rows than one group: every group runs over a slice of LL_KSLICE reduction
       entries before the next slice, so the slice's weights, read from memory once, serve
       the other groups from L1 while the next slice streams in, and the groups split
       the prefetching of its cache lines. The sums run in the same order either way. */
    const int64_t slice = rows > group ? LL_KSLICE : k;
    const int lines = block * (int)es / 64; /* cache lines per reduction entry (pair) */
    const int far = !bf16 && block == 64 && rows > 2 * group; /* LL_FAR */
    float *outs = (float *)malloc((size_t)threads * (size_t)(rows * block) * sizeof(float));
    if (!outs) {
        free(xf);
        free(xb);
        return -1;
    }
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int me = 0;
#ifdef _OPENMP
        me = omp_get_thread_num();
#endif
        float *out = outs + (int64_t)me * rows * block;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            const char *wb = (const char *)w + b * kp * block * es;
            int64_t c0 = b * block;
            int64_t cols = n - c0 < block ? n - c0 : block;
            for (int64_t t0 = 0; t0 < k; t0 += slice) {
                int64_t tn = k - t0 < slice ? k - t0 : slice;
                for (int64_t i0 = 0; i0 < rows; i0 += group) {
                    int r = rows - i0 < group ? (int)(rows - i0) : group;
                    int line = (int)((i0 / group) % lines) * 64;
                    ll_block(bf16, wb + t0 * block * es, tn, xf + i0 * kp + t0,
                             xb + i0 * kp + t0, kp, out + i0 * block, r, J, t0 > 0, line,
                             far);
                }
            }
            for (int64_t i = 0; i < rows; i++)
                ll_store_row(out + i * block, cols, bias ? (const char *)bias + c0 * es : NULL,
                             (char *)y + (i * y_stride + c0) * es, bf16);
        }
    }
    free(outs);
    free(xf);
    free(xb);
    return 0;
}
