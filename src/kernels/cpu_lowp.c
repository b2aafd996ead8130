/* bf16 and f16 on the CPU engine: f32 scratch around the f32 kernels
 * (cpu_lowp.h). */
#include <stdatomic.h>
#include <string.h>

#include "core/cache.h"
#include "core/core.h"
#include "kernels/cpu_lowp.h"

/* ---- conversions --------------------------------------------------------------------
 * Bit for bit those of core/dtype.c (tp__f32_to_bf16 and friends; the test
 * compares them exhaustively at every rounding boundary), written so that
 * they vectorize: bf16 in plain integer C, f16 with the F16C instructions
 * where the CPU has them (checked once at run time), else core's functions.
 * F16C rounds to nearest even like core; it quiets a signaling NaN that core
 * keeps, which no output can show (every f16 store makes NaNs quiet). */

static inline uint32_t f32_bits(float f)
{
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    return x;
}

static void bf16_load(float *restrict dst, const uint16_t *restrict src, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        uint32_t x = (uint32_t)src[i] << 16;
        memcpy(&dst[i], &x, sizeof x);
    }
}

static void bf16_store(uint16_t *restrict dst, const float *restrict src, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        uint32_t x = f32_bits(src[i]);
        uint32_t nan = (x >> 16) | 0x0040u, rnd = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
        dst[i] = (uint16_t)((x & 0x7fffffffu) > 0x7f800000u ? nan : rnd);
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <immintrin.h>
#define LP_F16C 1

__attribute__((target("avx,f16c"))) static int64_t f16_load_f16c(float *dst, const uint16_t *src,
                                                                 int64_t n)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
    return i;
}

__attribute__((target("avx,f16c"))) static int64_t f16_store_f16c(uint16_t *dst, const float *src,
                                                                  int64_t n)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    return i;
}

static bool have_f16c(void)
{
    static atomic_int have = -1; /* -1: not asked yet; every thread finds the same */
    int h = atomic_load_explicit(&have, memory_order_relaxed);
    if (h < 0) {
        /* F16C from cpuid itself: clang 14's __builtin_cpu_supports does not
         * know "f16c"; "avx" says the OS saves the ymm registers */
        unsigned a, b, c, d;
        h = __builtin_cpu_supports("avx") && __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
        atomic_store_explicit(&have, h, memory_order_relaxed);
    }
    return h;
}
#else
#define LP_F16C 0
#endif

static void f16_load(float *dst, const uint16_t *src, int64_t n)
{
    int64_t i = 0;
#if LP_F16C
    if (have_f16c())
        i = f16_load_f16c(dst, src, n);
#endif
    for (; i < n; i++)
        dst[i] = tp__f16_to_f32(src[i]);
}

static void f16_store(uint16_t *dst, const float *src, int64_t n)
{
    int64_t i = 0;
#if LP_F16C
    if (have_f16c())
        i = f16_store_f16c(dst, src, n);
#endif
    for (; i < n; i++)
        dst[i] = tp__f32_to_f16(src[i]);
}

void tp__lp_load(tp_dtype dtype, float *dst, const void *src, int64_t n)
{
    if (dtype == TP_BF16)
        bf16_load(dst, src, n);
    else if (dtype == TP_F16)
        f16_load(dst, src, n);
    else if (n > 0)
        memcpy(dst, src, (size_t)n * sizeof *dst);
}

void tp__lp_store(tp_dtype dtype, void *dst, const float *src, int64_t n)
{
    if (dtype == TP_BF16)
        bf16_store(dst, src, n);
    else if (dtype == TP_F16)
        f16_store(dst, src, n);
    else if (n > 0)
        memcpy(dst, src, (size_t)n * sizeof *src);
}

/* ---- frames ------------------------------------------------------------------------- */

void tp__lp_begin(tp__lp *f, tp__kop op, tp_dtype dtype)
{
    f->op = op;
    f->dtype = dtype;
    f->status = TP_OK;
    f->nblk = 0;
    f->nout = 0;
    f->arena_used = 0;
}

/* n floats of scratch: the arena when they fit, else the cache; NULL (and the
 * frame's status set) when out of memory. */
static float *lp_grab(tp__lp *f, int64_t n)
{
    size_t want = ((size_t)n + 15) & ~(size_t)15; /* whole cache lines */
    if (want <= TP__LP_ARENA - f->arena_used) {
        float *p = f->arena + f->arena_used;
        f->arena_used += want;
        return p;
    }
    float *p = f->nblk < TP__LP_MAX ? tp__cpu_cache_alloc((size_t)n * sizeof(float), false) : NULL;
    if (!p) {
        f->status = tp__error(
            TP_ERR_NO_MEMORY, "cpu kernels: %s on %s: out of memory for %lld bytes of f32 scratch",
            tp__kop_name(f->op), tp_dtype_name(f->dtype), (long long)n * (long long)sizeof(float));
        return NULL;
    }
    f->blk[f->nblk++] = p;
    return p;
}

void *tp__lp_scratch(tp__lp *f, size_t nbytes)
{
    if (f->status != TP_OK)
        return NULL;
    return lp_grab(f, (int64_t)((nbytes + sizeof(float) - 1) / sizeof(float)));
}

/* Scratch for a rows x cols buffer of the op's dtype at leading dimension ld,
 * its current values converted in when `load`; NULL for a NULL p or a failed
 * frame. */
static float *lp_scratch(tp__lp *f, const void *p, int64_t rows, int64_t cols, int64_t ld,
                         bool load)
{
    if (!p || f->status != TP_OK)
        return NULL;
    if (rows <= 0 || cols <= 0)
        return f->arena; /* nothing to read or write; non-NULL */
    float *s = lp_grab(f, rows * cols);
    if (s && load) {
        const uint16_t *src = p;
        for (int64_t r = 0; r < rows; r++)
            tp__lp_load(f->dtype, s + r * cols, src + r * ld, cols);
    }
    return s;
}

static int64_t lp_ld(int64_t cols)
{
    return cols > 1 ? cols : 1;
}

const float *tp__lp_in_mat(tp__lp *f, const void *p, int64_t rows, int64_t cols, int64_t ld,
                           int64_t *ldf)
{
    if (f->dtype == TP_F32) {
        *ldf = ld;
        return p;
    }
    *ldf = lp_ld(cols);
    return lp_scratch(f, p, rows, cols, ld, true);
}

const float *tp__lp_in(tp__lp *f, const void *p, int64_t n)
{
    int64_t ld;
    return tp__lp_in_mat(f, p, 1, n, n, &ld);
}

const float *tp__lp_in_span(tp__lp *f, const void *p, int64_t lo, int64_t n)
{
    if (f->dtype == TP_F32 || !p)
        return f->status == TP_OK ? p : NULL;
    const float *s = tp__lp_in(f, (const uint16_t *)p + lo, n);
    return s && n > 0 ? s - lo : s;
}

float *tp__lp_out_mat(tp__lp *f, void *p, int64_t rows, int64_t cols, int64_t ld, bool read,
                      int64_t *ldf)
{
    if (f->dtype == TP_F32) {
        *ldf = ld;
        return p;
    }
    *ldf = lp_ld(cols);
    float *s = lp_scratch(f, p, rows, cols, ld, read);
    if (s && rows > 0 && cols > 0)
        f->out[f->nout++] = (tp__lp_out_rec){p, s, rows, cols, ld};
    return s;
}

float *tp__lp_out(tp__lp *f, void *p, int64_t n, bool read)
{
    int64_t ld;
    return tp__lp_out_mat(f, p, 1, n, n, read, &ld);
}

tp_status tp__lp_end(tp__lp *f)
{
    if (f->status == TP_OK)
        for (int i = 0; i < f->nout; i++) {
            const tp__lp_out_rec *o = &f->out[i];
            for (int64_t r = 0; r < o->rows; r++)
                tp__lp_store(f->dtype, (uint16_t *)o->dst + r * o->ld, o->src + r * o->cols,
                             o->cols);
        }
    for (int i = 0; i < f->nblk; i++)
        tp__cpu_cache_free(f->blk[i]);
    f->nblk = 0;
    f->nout = 0;
    return f->status;
}

/* ---- the elementwise driver ----------------------------------------------------------- */

void tp__lp_elementwise(tp_dtype dtype, int64_t n, int nbuf, void *const *p, const char *modes,
                        tp__lp_ew_fn fn, const void *ctx)
{
    if (dtype == TP_F32) {
        if (n > 0)
            fn((float *const *)p, 0, n, ctx);
        return;
    }
    tp__lp f;
    float *buf[TP__LP_MAXBUF];
    /* whole cache lines per buffer, all of them in the arena */
    const int64_t chunk = nbuf * TP__LP_CHUNK <= TP__LP_ARENA
                              ? TP__LP_CHUNK
                              : (int64_t)(TP__LP_ARENA / nbuf) & ~(int64_t)15;
    for (int64_t off = 0; off < n; off += chunk) {
        int64_t len = n - off < chunk ? n - off : chunk;
        tp__lp_begin(&f, TP__KOP_NONE, dtype);
        for (int i = 0; i < nbuf; i++) {
            uint16_t *q = p[i] ? (uint16_t *)p[i] + off : NULL;
            buf[i] = modes[i] == 'i' ? (float *)tp__lp_in(&f, q, len)
                                     : tp__lp_out(&f, q, len, modes[i] == 'u');
        }
        fn(buf, off, len, ctx);
        tp__lp_end(&f);
    }
}

/* ---- the unit driver -------------------------------------------------------------------- */

int64_t tp__lp_unit_elems = 16384;

tp_status tp__lp_units(tp__kop op, tp_dtype dtype, int64_t nunits, int nbuf, const tp__lp_buf *b,
                       tp__lp_ew_fn fn, const void *ctx)
{
    float *buf[TP__LP_MAX], *scr[TP__LP_MAX];
    if (dtype == TP_F32) {
        for (int i = 0; i < nbuf; i++)
            buf[i] = b[i].p;
        fn(buf, 0, nunits, ctx);
        return TP_OK;
    }
    int64_t maxper = 1;
    for (int i = 0; i < nbuf; i++)
        maxper = b[i].per > maxper ? b[i].per : maxper;
    int64_t cu = tp__lp_unit_elems / maxper; /* units per chunk */
    cu = cu < 1 ? 1 : cu > nunits ? nunits : cu;
    tp__lp f;
    tp__lp_begin(&f, op, dtype);
    for (int i = 0; i < nbuf; i++) {
        if (b[i].per == 0) /* whole: converted now, rounded by tp__lp_end */
            buf[i] = b[i].mode == 'i' ? (float *)tp__lp_in(&f, b[i].p, b[i].len)
                                      : tp__lp_out(&f, b[i].p, b[i].len, b[i].mode == 'u');
        else
            scr[i] = b[i].p ? tp__lp_scratch(&f, (size_t)(cu * b[i].per) * sizeof(float)) : NULL;
    }
    size_t es = tp_dtype_size(dtype);
    for (int64_t u0 = 0; tp__lp_ok(&f) && u0 < nunits; u0 += cu) {
        int64_t nu = nunits - u0 < cu ? nunits - u0 : cu;
        for (int i = 0; i < nbuf; i++) {
            if (b[i].per == 0)
                continue;
            buf[i] = scr[i];
            if (scr[i] && b[i].mode != 'o')
                tp__lp_load(dtype, scr[i], (const char *)b[i].p + (size_t)(u0 * b[i].per) * es,
                            nu * b[i].per);
        }
        fn(buf, u0, nu, ctx);
        for (int i = 0; i < nbuf; i++)
            if (b[i].per > 0 && scr[i] && b[i].mode != 'i')
                tp__lp_store(dtype, (char *)b[i].p + (size_t)(u0 * b[i].per) * es, scr[i],
                             nu * b[i].per);
    }
    return tp__lp_end(&f);
}
