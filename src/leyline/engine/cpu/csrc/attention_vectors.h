/* Part of attention_kernel.c (included once, after its defines): widening, dot products
   and the chunk loops that score keys and accumulate weighted values, portable C and, where
   built for them, AVX2 + FMA and AVX-512 intrinsics. */
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

/* ll_exp on the lanes of one vector (the same polynomial, multiply-adds fused): NAME over
   vectors V (integer lanes VI) of W bits, intrinsics prefixed P. */
#define LL_DEFINE_EXP(NAME, V, VI, P, W)                                                  \
    LL_INLINE V NAME(V x) {                                                               \
        const V shift = P##_set1_ps(12582912.0f);                                         \
        x = P##_max_ps(x, P##_set1_ps(-87.0f));                                           \
        V n = P##_fmadd_ps(x, P##_set1_ps(1.44269504088896341f), shift);                  \
        n = P##_sub_ps(n, shift); /* round to nearest, as ll_exp */                       \
        V r = P##_fnmadd_ps(n, P##_set1_ps(0.693359375f), x);                             \
        r = P##_fnmadd_ps(n, P##_set1_ps(-2.12194440e-4f), r);                            \
        V p = P##_set1_ps(1.9875691500e-4f);                                              \
        p = P##_fmadd_ps(p, r, P##_set1_ps(1.3981999507e-3f));                            \
        p = P##_fmadd_ps(p, r, P##_set1_ps(8.3334519073e-3f));                            \
        p = P##_fmadd_ps(p, r, P##_set1_ps(4.1665795894e-2f));                            \
        p = P##_fmadd_ps(p, r, P##_set1_ps(1.6666665459e-1f));                            \
        p = P##_fmadd_ps(p, r, P##_set1_ps(5.0000001201e-1f));                            \
        p = P##_fmadd_ps(P##_mul_ps(p, r), r, P##_add_ps(r, P##_set1_ps(1.0f)));          \
        VI e = P##_add_epi32(P##_cvtps_epi32(n), P##_set1_epi32(127));                    \
        return P##_mul_ps(p, P##_castsi##W##_ps(P##_slli_epi32(e, 23)));                  \
    }

LL_DEFINE_EXP(ll_exp8, __m256, __m256i, _mm256, 256)

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
