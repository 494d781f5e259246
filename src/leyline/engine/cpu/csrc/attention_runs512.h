/* Part of attention_kernel.c (included once): query runs on AVX-512 (rows across the
   vector lanes) and, where built with AMX, bf16 products on the tile unit. */
#if defined(__AVX512F__) && LL_AVX2
/* Query runs with widths that are multiples of 16, up to 128. Every row of a run reads the
   same keys, so the rows go across the vector lanes: the scores of 16 rows against a key
   are one register, built from the rows' queries transposed once per task ([d][rows]) and
   the key's entries broadcast (no lane reductions, no transposed keys); the softmax's max,
   exponentials and sums run 16 rows at a time, the causal limits as lane masks; the
   weighted values of two rows share each value row's load. */
#define LL_RUN512 1
#define LL_RCHUNK 64

LL_DEFINE_EXP(ll_exp16, __m512, __m512i, _mm512, 512) /* ll_exp on 16 lanes */

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

/* 1 when this process may use the tile unit (Linux grants it on request, per process);
   the kernel then uses it. */
int32_t leyline_attention_amx_ready(void) {
    ll_amx = kb_amx_request();
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
