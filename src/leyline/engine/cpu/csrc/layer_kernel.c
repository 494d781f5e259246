/* A Llama decoder layer's few-row work on each side of its attention, loaded by
   layer_kernel.py: leyline_layer_pre (RMSNorm, q/k/v products, RoPE) and leyline_layer_post
   (o product, residual, RMSNorm, gated MLP, residual), the products linear_kernel.c's own. */
#include "linear_kernel.c"
#include "kb_scratch.h"
#include "kb_exp.h"
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

/* Exported for the tests: kb_exp (kb_exp.h) on n values. */
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
