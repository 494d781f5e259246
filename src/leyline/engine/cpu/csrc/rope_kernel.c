/* The delta rotation of cached keys, loaded by rope_kernel.py: y1 = x1 cos - x2 sin,
   y2 = x2 cos + x1 sin per pair, in fp32 from fp32 or bf16 storage (bf16 widened exactly,
   rounded back to nearest even), one read and one write of each row; rows split over
   OpenMP threads. The move entry shifts rows inside one buffer, source and destination
   overlapping: each outer slice (a layer's head) is swept in the order that reads every
   row before it is overwritten, its rotary band rotated and the rest copied (or the whole
   row copied bitwise: values). Both arithmetic orders of the eager path are built in
   (`fused`): x1 c rounded then one fused multiply-add for the cross term (torch.addcmul on
   AVX2/NEON), or every product rounded (torch's complex multiply). */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LL_MAX_HALF 512
#define LL_MAX_THREADS 256

/* One band: 11 int64 (src address, dst address, 3 sizes, 3 src strides, 3 dst strides;
   strides in elements, outermost first). */
typedef struct {
    const void *src;
    void *dst;
    int64_t size[3];
    int64_t src_stride[3];
    int64_t dst_stride[3];
} ll_band;

#define LL_DESC 11

typedef struct ll_task ll_task;
typedef void (*ll_rows_fn)(const ll_task *t, const ll_band *b, int64_t lo, int64_t hi);

struct ll_task {
    const ll_band *bands;
    int64_t nbands;
    const float *cos;
    const float *sin;
    int32_t half;
    ll_rows_fn rows;
    int64_t begin;
    int64_t end;
};

/* bf16 <-> fp32: widening is exact; narrowing rounds to nearest even, as torch does (a NaN
   stays a NaN). */
static inline float ll_widen(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t ll_narrow(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return f != f ? (uint16_t)0x7FC0u : (uint16_t)r;
}

/* The next row of a band, innermost index fastest (a macro: a function taking the indices'
   addresses compiled the loops with other registers). */
#define LL_NEXT_ROW(i0, i1, i2, n1, n2) \
    do {                                \
        if (++(i2) == (n2)) {           \
            (i2) = 0;                   \
            if (++(i1) == (n1)) {       \
                (i1) = 0;               \
                ++(i0);                 \
            }                           \
        }                               \
    } while (0)

#define LL_LOAD_f32(p, i) ((p)[i])
#define LL_STORE_f32(p, i, v) ((p)[i] = (v))
#define LL_LOAD_bf16(p, i) ll_widen((p)[i])
#define LL_STORE_bf16(p, i, v) ((p)[i] = ll_narrow(v))
typedef float ll_f32;
typedef uint16_t ll_bf16;

/* Pair members: half-split (i, i + h), interleaved (2i, 2i + 1). */
#define LL_A_half(i, h) (i)
#define LL_B_half(i, h) ((i) + (h))
#define LL_A_inter(i, h) (2 * (i))
#define LL_B_inter(i, h) (2 * (i) + 1)

/* Rounding orders: "fused" rounds x1*c, then one fma adds the cross term (torch's addcmul
   on AVX2/NEON); "plain" rounds every product (torch's complex multiply). */
#define LL_Y1_fused(x1, x2, c, s) fmaf(-(x2), (s), (x1) * (c))
#define LL_Y2_fused(x1, x2, c, s) fmaf((x1), (s), (x2) * (c))
#define LL_Y1_plain(x1, x2, c, s) ((x1) * (c) - (x2) * (s))
#define LL_Y2_plain(x1, x2, c, s) ((x2) * (c) + (x1) * (s))

/* DEF(pairing, rounding order, storage) for every pairing and order. */
#define LL_EACH_ROTATION(DEF, T) \
    DEF(half, fused, T) DEF(half, plain, T) DEF(inter, fused, T) DEF(inter, plain, T)

/* bf16 rows gain from 512-bit vectors where the build allows AVX-512 (widening and
   rounding are integer work on twice the lanes), fp32 rows do not (see _flags): functions
   defined between LL_WIDE_BEGIN and LL_WIDE_END prefer them. */
#if defined(__GNUC__) && !defined(__clang__)
#define LL_WIDE_BEGIN \
    _Pragma("GCC push_options") _Pragma("GCC target(\"prefer-vector-width=512\")")
#define LL_WIDE_END _Pragma("GCC pop_options")
#else
#define LL_WIDE_BEGIN
#define LL_WIDE_END
#endif

/* One row, inlined into a loop over rows; a constant h unrolls it. */
#define LL_DEFINE(PAIR, ORDER, T)                                                            \
    static inline void ll_row_##PAIR##_##ORDER##_##T(const ll_##T *restrict x,             \
                                                     ll_##T *restrict y,                   \
                                                     const float *restrict c,              \
                                                     const float *restrict s, int32_t h) { \
        for (int32_t i = 0; i < h; i++) {                                                  \
            float x1 = LL_LOAD_##T(x, LL_A_##PAIR(i, h));                                  \
            float x2 = LL_LOAD_##T(x, LL_B_##PAIR(i, h));                                  \
            float y1 = LL_Y1_##ORDER(x1, x2, c[i], s[i]);                                  \
            float y2 = LL_Y2_##ORDER(x1, x2, c[i], s[i]);                                  \
            LL_STORE_##T(y, LL_A_##PAIR(i, h), y1);                                        \
            LL_STORE_##T(y, LL_B_##PAIR(i, h), y2);                                        \
        }                                                                                  \
    }                                                                                      \
    static void ll_rows_##PAIR##_##ORDER##_##T(const ll_task *t, const ll_band *b,         \
                                               int64_t lo, int64_t hi) {                   \
        const int64_t n1 = b->size[1], n2 = b->size[2];                                    \
        int64_t i2 = lo % n2, i1 = (lo / n2) % n1, i0 = lo / (n2 * n1);                    \
        const ll_##T *src = (const ll_##T *)b->src;                                         \
        ll_##T *dst = (ll_##T *)b->dst;                                                     \
        const float *c = t->cos, *s = t->sin;                                               \
        const int32_t h = t->half;                                                          \
        for (int64_t r = lo; r < hi; r++) {                                                 \
            const ll_##T *x = src + i0 * b->src_stride[0] + i1 * b->src_stride[1] +         \
                              i2 * b->src_stride[2];                                        \
            ll_##T *y = dst + i0 * b->dst_stride[0] + i1 * b->dst_stride[1] +               \
                        i2 * b->dst_stride[2];                                              \
            if (h == 32)                                                                    \
                ll_row_##PAIR##_##ORDER##_##T(x, y, c, s, 32);                              \
            else if (h == 64)                                                               \
                ll_row_##PAIR##_##ORDER##_##T(x, y, c, s, 64);                              \
            else                                                                            \
                ll_row_##PAIR##_##ORDER##_##T(x, y, c, s, h);                               \
            LL_NEXT_ROW(i0, i1, i2, n1, n2);                                                \
        }                                                                                   \
    }

LL_EACH_ROTATION(LL_DEFINE, f32)
LL_WIDE_BEGIN
LL_EACH_ROTATION(LL_DEFINE, bf16)

/* Interleaved bf16, pairs 4-byte aligned: one uint32 holds a pair, widened by a shift and a
   mask and put back together without any packing across lanes. Otherwise: the above. */
#define LL_DEFINE_PAIRS(ORDER)                                                               \
    static inline void ll_pairs_##ORDER(const uint32_t *restrict x, uint32_t *restrict y,   \
                                        const float *restrict c, const float *restrict s,   \
                                        int32_t h) {                                        \
        for (int32_t i = 0; i < h; i++) {                                                   \
            uint32_t u1 = x[i] << 16, u2 = x[i] & 0xFFFF0000u;                              \
            float x1, x2;                                                                   \
            memcpy(&x1, &u1, sizeof x1);                                                    \
            memcpy(&x2, &u2, sizeof x2);                                                    \
            float y1 = LL_Y1_##ORDER(x1, x2, c[i], s[i]);                                   \
            float y2 = LL_Y2_##ORDER(x1, x2, c[i], s[i]);                                   \
            y[i] = (uint32_t)ll_narrow(y1) | ((uint32_t)ll_narrow(y2) << 16);               \
        }                                                                                   \
    }                                                                                       \
    static void ll_rows_inter_##ORDER##_bf16p(const ll_task *t, const ll_band *b,          \
                                              int64_t lo, int64_t hi) {                     \
        int aligned = (uintptr_t)b->src % 4 == 0 && (uintptr_t)b->dst % 4 == 0;             \
        for (int d = 0; d < 3; d++)                                                         \
            aligned = aligned && b->src_stride[d] % 2 == 0 && b->dst_stride[d] % 2 == 0;    \
        if (!aligned) {                                                                     \
            ll_rows_inter_##ORDER##_bf16(t, b, lo, hi);                                     \
            return;                                                                         \
        }                                                                                   \
        const int64_t n1 = b->size[1], n2 = b->size[2];                                     \
        int64_t i2 = lo % n2, i1 = (lo / n2) % n1, i0 = lo / (n2 * n1);                     \
        const uint16_t *src = (const uint16_t *)b->src;                                     \
        uint16_t *dst = (uint16_t *)b->dst;                                                 \
        const float *c = t->cos, *s = t->sin;                                               \
        const int32_t h = t->half;                                                          \
        for (int64_t r = lo; r < hi; r++) {                                                 \
            const uint32_t *x = (const uint32_t *)(src + i0 * b->src_stride[0] +            \
                                                   i1 * b->src_stride[1] +                  \
                                                   i2 * b->src_stride[2]);                  \
            uint32_t *y = (uint32_t *)(dst + i0 * b->dst_stride[0] + i1 * b->dst_stride[1] + \
                                       i2 * b->dst_stride[2]);                              \
            if (h == 32)                                                                    \
                ll_pairs_##ORDER(x, y, c, s, 32);                                           \
            else                                                                            \
                ll_pairs_##ORDER(x, y, c, s, h);                                            \
            LL_NEXT_ROW(i0, i1, i2, n1, n2);                                                \
        }                                                                                   \
    }

LL_DEFINE_PAIRS(fused)
LL_DEFINE_PAIRS(plain)
LL_WIDE_END

/* The caller's descriptors (LL_DESC int64 each) into bands; -1 on a size below 1. */
static int ll_parse_bands(const int64_t *desc, int64_t nbands, ll_band *bands) {
    for (int64_t k = 0; k < nbands; k++) {
        const int64_t *d = desc + k * LL_DESC;
        bands[k].src = (const void *)(intptr_t)d[0];
        bands[k].dst = (void *)(intptr_t)d[1];
        for (int j = 0; j < 3; j++) {
            bands[k].size[j] = d[2 + j];
            bands[k].src_stride[j] = d[5 + j];
            bands[k].dst_stride[j] = d[8 + j];
            if (d[2 + j] <= 0) return -1;
        }
    }
    return 0;
}

static void run_task(const ll_task *t) {
    int64_t base = 0;
    for (int64_t k = 0; k < t->nbands && base < t->end; k++) {
        const ll_band *b = &t->bands[k];
        int64_t rows = b->size[0] * b->size[1] * b->size[2];
        int64_t lo = t->begin > base ? t->begin - base : 0;
        int64_t hi = t->end - base < rows ? t->end - base : rows;
        if (lo < hi) t->rows(t, b, lo, hi);
        base += rows;
    }
}

/* dst band <- src band rotated, for every row of every band, over `threads` threads.
   Returns 0, or -1 on bad arguments (nothing written). */
int leyline_rope_rotate(const int64_t *desc, int64_t nbands, const float *cos,
                        const float *sin, int32_t half, int32_t bf16, int32_t interleaved,
                        int32_t fused, int32_t threads) {
    enum { LL_MAX_BANDS = 256 };
    ll_band bands[LL_MAX_BANDS];
    if (half <= 0 || half > LL_MAX_HALF || nbands < 0 || nbands > LL_MAX_BANDS) return -1;
    if (ll_parse_bands(desc, nbands, bands) != 0) return -1;
    int64_t total = 0;
    for (int64_t k = 0; k < nbands; k++)
        total += bands[k].size[0] * bands[k].size[1] * bands[k].size[2];
    if (total == 0) return 0;
    static const ll_rows_fn table[2][2][2] = {
        {{ll_rows_half_plain_f32, ll_rows_half_fused_f32},
         {ll_rows_inter_plain_f32, ll_rows_inter_fused_f32}},
        {{ll_rows_half_plain_bf16, ll_rows_half_fused_bf16},
         {ll_rows_inter_plain_bf16p, ll_rows_inter_fused_bf16p}}};
    ll_rows_fn rows = table[bf16 != 0][interleaved != 0][fused != 0];
    if (threads < 1) threads = 1;
    if (threads > LL_MAX_THREADS) threads = LL_MAX_THREADS;
    /* Rows in chunks of about 64 KiB, handed out dynamically: a thread the OS runs late
       (a busy machine) just takes fewer chunks instead of holding the others up. */
    int64_t row_bytes = (int64_t)2 * half * (bf16 ? 2 : 4);
    int64_t chunk = (int64_t)65536 / row_bytes > 0 ? (int64_t)65536 / row_bytes : 1;
    int64_t nchunks = (total + chunk - 1) / chunk;
    if (threads > nchunks) threads = (int32_t)nchunks;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (threads > 1)
    for (int64_t k = 0; k < nchunks; k++) {
        int64_t begin = k * chunk, end = begin + chunk < total ? begin + chunk : total;
        ll_task t = {bands, nbands, cos, sin, half, rows, begin, end};
        run_task(&t);
    }
    return 0;
}

/* Moves inside one buffer. A band here is whole rows of `dim` elements; for each outer slice
   (i0, i1) its rows are taken one by one in the order that never overwrites a row not yet
   read (ascending where dst lies below src, descending otherwise), the rotary band
   [off, off + 2h) of each rotated and the rest copied bitwise (rotate == 0: the whole row
   copied). Distinct rows never overlap, so a row is read and written directly. Slices are
   independent (the caller vouches that no slice's dst meets another slice's src), so the
   threads take whole slices. */
#define LL_DEFINE_MOVE(PAIR, ORDER, T)                                                       \
    static void ll_move_##PAIR##_##ORDER##_##T(const ll_task *t, const ll_band *b,          \
                                               int64_t slice, int32_t dim, int32_t off) {   \
        const int64_t n1 = b->size[1], n2 = b->size[2];                                     \
        const int64_t i0 = slice / n1, i1 = slice % n1;                                     \
        const ll_##T *src = (const ll_##T *)b->src + i0 * b->src_stride[0] +                \
                            i1 * b->src_stride[1];                                          \
        ll_##T *dst = (ll_##T *)b->dst + i0 * b->dst_stride[0] + i1 * b->dst_stride[1];     \
        const int64_t ss = b->src_stride[2], ds = b->dst_stride[2];                         \
        const int ascending = (uintptr_t)b->dst < (uintptr_t)b->src;                        \
        const float *c = t->cos, *s = t->sin;                                               \
        const int32_t h = t->half, stop = off + 2 * h;                                      \
        for (int64_t k = 0; k < n2; k++) {                                                  \
            const int64_t i2 = ascending ? k : n2 - 1 - k;                                  \
            const ll_##T *x = src + i2 * ss;                                                \
            ll_##T *y = dst + i2 * ds;                                                      \
            if (off > 0) memcpy(y, x, (size_t)off * sizeof(ll_##T));                        \
            if (stop < dim) memcpy(y + stop, x + stop, (size_t)(dim - stop) * sizeof(ll_##T)); \
            if (h == 32)                                                                    \
                ll_row_##PAIR##_##ORDER##_##T(x + off, y + off, c, s, 32);                  \
            else if (h == 64)                                                               \
                ll_row_##PAIR##_##ORDER##_##T(x + off, y + off, c, s, 64);                  \
            else                                                                            \
                ll_row_##PAIR##_##ORDER##_##T(x + off, y + off, c, s, h);                   \
        }                                                                                   \
    }

typedef void (*ll_move_fn)(const ll_task *t, const ll_band *b, int64_t slice, int32_t dim,
                           int32_t off);

LL_EACH_ROTATION(LL_DEFINE_MOVE, f32)
LL_WIDE_BEGIN
LL_EACH_ROTATION(LL_DEFINE_MOVE, bf16)
LL_WIDE_END

static void ll_move_copy(const ll_band *b, int64_t slice, int64_t row_bytes, int64_t elem) {
    const int64_t n1 = b->size[1], n2 = b->size[2];
    const int64_t i0 = slice / n1, i1 = slice % n1;
    const char *src = (const char *)b->src + (i0 * b->src_stride[0] + i1 * b->src_stride[1]) * elem;
    char *dst = (char *)b->dst + (i0 * b->dst_stride[0] + i1 * b->dst_stride[1]) * elem;
    const int64_t ss = b->src_stride[2] * elem, ds = b->dst_stride[2] * elem;
    const int ascending = (uintptr_t)b->dst < (uintptr_t)b->src;
    for (int64_t k = 0; k < n2; k++) {
        const int64_t i2 = ascending ? k : n2 - 1 - k;
        memcpy(dst + i2 * ds, src + i2 * ss, (size_t)row_bytes);
    }
}

/* Every band's rows moved (see above) over `threads` threads; rotate == 0 copies them
   bitwise (cos, sin and half unused). Returns 0, or -1 on bad arguments (nothing written). */
int leyline_rope_move(const int64_t *desc, int64_t nbands, const float *cos, const float *sin,
                      int32_t half, int32_t dim, int32_t off, int32_t bf16,
                      int32_t interleaved, int32_t fused, int32_t rotate, int32_t threads) {
    enum { LL_MAX_BANDS = 256 };
    ll_band bands[LL_MAX_BANDS];
    int64_t first[LL_MAX_BANDS + 1];
    if (nbands < 0 || nbands > LL_MAX_BANDS || dim <= 0 || off < 0) return -1;
    if (rotate && (half <= 0 || half > LL_MAX_HALF || off + 2 * (int64_t)half > dim)) return -1;
    if (ll_parse_bands(desc, nbands, bands) != 0) return -1;
    first[0] = 0;
    for (int64_t k = 0; k < nbands; k++)
        first[k + 1] = first[k] + bands[k].size[0] * bands[k].size[1];
    const int64_t slices = first[nbands];
    if (slices == 0) return 0;
    static const ll_move_fn table[2][2][2] = {
        {{ll_move_half_plain_f32, ll_move_half_fused_f32},
         {ll_move_inter_plain_f32, ll_move_inter_fused_f32}},
        {{ll_move_half_plain_bf16, ll_move_half_fused_bf16},
         {ll_move_inter_plain_bf16, ll_move_inter_fused_bf16}}};
    ll_move_fn move = table[bf16 != 0][interleaved != 0][fused != 0];
    const int64_t elem = bf16 ? 2 : 4;
    ll_task t = {bands, nbands, cos, sin, half, 0, 0, 0};
    if (threads < 1) threads = 1;
    if (threads > LL_MAX_THREADS) threads = LL_MAX_THREADS;
    if (threads > slices) threads = (int32_t)slices;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (threads > 1)
    for (int64_t u = 0; u < slices; u++) {
        int64_t k = 0;
        while (first[k + 1] <= u) k++;
        if (rotate)
            move(&t, &bands[k], u - first[k], dim, off);
        else
            ll_move_copy(&bands[k], u - first[k], (int64_t)dim * elem, elem);
    }
    return 0;
}
