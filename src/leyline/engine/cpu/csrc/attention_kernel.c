/* One query's attention over a long KV cache (and a short run of queries), fp32 or bf16:
   leyline_single_query_segments and leyline_query_run_segments, loaded by attention_kernel.py.

   K and V are streamed once, bf16 widened to fp32 on the fly (exact), every sum in fp32;
   keys are split over threads flash-decoding style (per task a running max, sum and
   weighted values for a segment of one key/value head, merged at the end); grouped query
   heads share their key/value head's read. With AVX2 + FMA (AVX-512) and widths that are
   multiples of 8 (16) the inner loops are intrinsics; other widths and CPUs run portable C.
   A run of queries (compute-bound) puts its rows across the vector lanes on AVX-512, the
   causal limits as lane masks; built with AMX, where Linux grants the tile state, bf16
   products run on the tile unit, each weight split into two bf16 parts (hi + lo) so the
   sums keep fp32 grade. docs/perf.md has the figures. */
#define _GNU_SOURCE
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include "kb_amx.h"
#include "kb_scratch.h"
#include "kb_exp.h"

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

#include "attention_vectors.h"

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

/* Both entries split the keys alike: every head's segments (n[i] keys each) cut into tasks
   of `seg` keys, about LL_TASKS_PER_THREAD a thread over all heads and segments and none
   shorter than 256 keys, each taken by the next thread free. tasks < 0: a segment without
   keys. */
typedef struct {
    int64_t seg, tasks;
} ll_split;

static ll_split ll_split_keys(int32_t s, const int64_t *n, int64_t kv, int32_t threads) {
    int64_t total = 0;
    for (int32_t i = 0; i < s; i++) {
        if (n[i] <= 0) return (ll_split){0, -1};
        total += n[i];
    }
    int64_t per = ((int64_t)threads * LL_TASKS_PER_THREAD + kv - 1) / kv;
    int64_t seg = (total + per - 1) / per;
    if (seg < 256) seg = 256;
    int64_t tasks = 0;
    for (int32_t i = 0; i < s; i++) tasks += kv * ((n[i] + seg - 1) / seg);
    return (ll_split){seg, tasks};
}

/* Those tasks, head by head, as (segment, head, first key) triples. */
static void ll_list_tasks(int64_t *task_of, int32_t s, const int64_t *n, int64_t kv,
                          int64_t seg) {
    int64_t t = 0;
    for (int64_t h = 0; h < kv; h++)
        for (int32_t i = 0; i < s; i++)
            for (int64_t lo = 0; lo < n[i]; lo += seg, t++) {
                task_of[3 * t] = i;
                task_of[3 * t + 1] = h;
                task_of[3 * t + 2] = lo;
            }
}

/* The end of head h's tasks, which start at `first` (tasks are listed head by head). */
static int64_t ll_head_end(const int64_t *task_of, int64_t tasks, int64_t first, int64_t h) {
    int64_t last = first;
    while (last < tasks && task_of[3 * last + 1] == h) last++;
    return last;
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
    int64_t group = heads / kv;
    if (group > LL_MAX_GROUP) return 2;
    const ll_split split = ll_split_keys(s, n, kv, threads);
    if (split.tasks < 0) return 1;
    if (split.tasks > LL_MAX_TASKS) return 3;
    int64_t seg = split.seg, tasks = split.tasks;
    size_t es = bf16 ? 2 : 4;
    ll_stats *st = malloc(sizeof(ll_stats) * (size_t)tasks);
    float *acc = malloc(sizeof(float) * (size_t)(tasks * group * dv));
    int64_t *task_of = malloc(sizeof(int64_t) * (size_t)tasks * 3); /* segment, head, lo */
    if (!st || !acc || !task_of) {
        free(st);
        free(acc);
        free(task_of);
        return 4;
    }
    ll_list_tasks(task_of, s, n, kv, seg);
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
        int64_t last = ll_head_end(task_of, tasks, first, h);
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


#include "attention_runs512.h"

#if !LL_TILES
int32_t leyline_attention_amx_ready(void) { return 0; }
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
    int64_t group = heads / kv, rows = group * m;
    for (int64_t j = 0; j < m; j++) {
        int64_t seen = 0;
        for (int32_t i = 0; i < s; i++) {
            if (lim[i * m + j] < 0 || lim[i * m + j] > n[i]) return 1;
            seen += lim[i * m + j];
        }
        if (seen <= 0) return 5;
    }
    const ll_split split = ll_split_keys(s, n, kv, threads);
    if (split.tasks < 0) return 1;
    if (split.tasks > LL_MAX_TASKS) return 3;
    int64_t seg = split.seg, tasks = split.tasks;
    size_t es = bf16 ? 2 : 4;
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
    ll_list_tasks(task_of, s, n, kv, seg);
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
        int64_t last = ll_head_end(task_of, tasks, first, h);
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
