/* Counter-based random numbers: Philox-4x32-10 and fills indexed by global
 * element, so that any shard of a global random tensor can be generated on its
 * own and matches the corresponding block of the whole. */
#include <math.h>
#include <string.h>

#include "core/core.h"

void tp_philox4x32(uint64_t seed, uint64_t counter, uint32_t out[4])
{
    if (!out)
        return;
    const uint32_t ctr[4] = {(uint32_t)counter, (uint32_t)(counter >> 32), 0, 0};
    const uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
    tp__philox4x32_10(ctr, key, out);
}

/* 53 random bits -> [0, 1): every value is a multiple of 2^-53, so it is exact
 * in a double and 1.0 is never produced. */
static inline double tp__u53(uint32_t hi, uint32_t lo)
{
    return (double)((((uint64_t)hi << 32) | lo) >> 11) * 0x1.0p-53;
}

/* Box-Muller on one block: u1 from words 0-1 shifted into (0, 1] so log(u1)
 * is finite, u2 from words 2-3. Only the cosine branch is used, which keeps
 * one counter per element. */
static inline double tp__normal(const uint32_t r[4])
{
    double u1 = ((double)((((uint64_t)r[0] << 32) | r[1]) >> 11) + 1.0) * 0x1.0p-53;
    double u2 = tp__u53(r[2], r[3]);
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586476925286766559 * u2);
}

double tp_rng_uniform(uint64_t seed, uint64_t g)
{
    uint32_t r[4];
    tp_philox4x32(seed, g, r);
    return tp__u53(r[0], r[1]);
}

double tp_rng_normal(uint64_t seed, uint64_t g)
{
    uint32_t r[4];
    tp_philox4x32(seed, g, r);
    return tp__normal(r);
}

typedef struct tp__rng_params {
    tp_rng_dist dist;
    double a, b;
    uint32_t key[2];
} tp__rng_params;

static inline double tp__rng_value(const tp__rng_params *p, uint64_t g)
{
    const uint32_t ctr[4] = {(uint32_t)g, (uint32_t)(g >> 32), 0, 0};
    uint32_t r[4];
    tp__philox4x32_10(ctr, p->key, r);
    switch (p->dist) {
    case TP_RNG_UNIFORM:
        return p->a + (p->b - p->a) * tp__u53(r[0], r[1]);
    case TP_RNG_NORMAL:
        return p->a + p->b * tp__normal(r);
    case TP_RNG_RANDINT:
    default: {
        double span = p->b - p->a;
        double k = floor(tp__u53(r[0], r[1]) * span);
        if (k >= span) /* u * span can round up to span when span is large */
            k = span - 1;
        return p->a + k;
    }
    }
}

/* n elements of global counters g, g+1, ..., at p advancing `step` bytes.
 * Values are produced in batches so the store stays out of the generator
 * loop. */
static void tp__rng_run(char *p, int64_t step, tp_dtype dtype, uint64_t g, int64_t n,
                        const tp__rng_params *prm)
{
    void (*store)(void *, double) = tp__dtype_traits_table[dtype].store_f64;
    double buf[256];
    while (n > 0) {
        int m = n < 256 ? (int)n : 256;
        for (int i = 0; i < m; i++)
            buf[i] = tp__rng_value(prm, g + (uint64_t)i);
        for (int i = 0; i < m; i++, p += step)
            store(p, buf[i]);
        g += (uint64_t)m;
        n -= m;
    }
}

/* Walks t's elements in row-major order; the innermost dim is one run of
 * consecutive global counters, outer dims step an odometer (no divisions). */
static void tp__fill_random_cpu(tp_tensor *t, const tp__rng_params *prm, uint64_t g0,
                                const int64_t *gstride)
{
    size_t es = tp_dtype_size(t->dtype);
    char *p = tp_tensor_data(t);
    int nd = t->ndim;
    if (nd == 0) {
        tp__rng_run(p, 0, t->dtype, g0, 1, prm);
        return;
    }
    int64_t mstride[TP_MAX_DIMS], idx[TP_MAX_DIMS];
    for (int i = 0; i < nd; i++) {
        mstride[i] = t->stride[i] * (int64_t)es;
        idx[i] = 0;
    }
    int inner = nd - 1;
    uint64_t g = g0;
    for (;;) {
        tp__rng_run(p, mstride[inner], t->dtype, g, t->shape[inner], prm);
        int k = inner - 1;
        for (; k >= 0; k--) {
            p += mstride[k];
            g += (uint64_t)gstride[k];
            if (++idx[k] < t->shape[k])
                break;
            p -= mstride[k] * t->shape[k];
            g -= (uint64_t)(gstride[k] * t->shape[k]);
            idx[k] = 0;
        }
        if (k < 0)
            return;
    }
}

static tp_status tp__check_dist(const char *fn, tp_rng_dist dist, double a, double b)
{
    switch (dist) {
    case TP_RNG_UNIFORM:
        TP_ARG_CHECK(isfinite(a) && isfinite(b) && a <= b,
                     "%s: uniform bounds [%g, %g) must be finite with a <= b", fn, a, b);
        return TP_OK;
    case TP_RNG_NORMAL:
        TP_ARG_CHECK(isfinite(a) && isfinite(b) && b >= 0,
                     "%s: normal mean %g and std %g must be finite with std >= 0", fn, a, b);
        return TP_OK;
    case TP_RNG_RANDINT:
        TP_ARG_CHECK(isfinite(a) && isfinite(b) && a == floor(a) && b == floor(b) && a < b,
                     "%s: randint bounds [%g, %g) must be integers with a < b", fn, a, b);
        /* beyond 2^53 doubles no longer hold every integer of the range */
        TP_ARG_CHECK(fabs(a) <= 0x1.0p53 && fabs(b) <= 0x1.0p53,
                     "%s: randint bounds [%g, %g) exceed 2^53 in magnitude", fn, a, b);
        return TP_OK;
    }
    return tp__error(TP_ERR_INVALID_ARG, "%s: invalid distribution %d", fn, (int)dist);
}

tp_status tp_tensor_fill_random(tp_tensor *t, tp_rng_dist dist, double a, double b, uint64_t seed,
                                const int64_t *global_shape, const int64_t *offset)
{
    const char *fn = "tp_tensor_fill_random";
    TP_ARG_CHECK(t, "%s: t is NULL", fn);
    TP_CHECK(tp__need_storage(t, fn, "t"));
    TP_CHECK(tp__check_dist(fn, dist, a, b));

    int nd = t->ndim;
    int64_t gshape[TP_MAX_DIMS], off[TP_MAX_DIMS], gstride[TP_MAX_DIMS];
    for (int i = 0; i < nd; i++) {
        gshape[i] = global_shape ? global_shape[i] : t->shape[i];
        off[i] = offset ? offset[i] : 0;
        TP_ARG_CHECK(gshape[i] >= 0, "%s: global size %lld of dim %d is negative", fn,
                     (long long)gshape[i], i);
        TP_ARG_CHECK(off[i] >= 0, "%s: offset %lld of dim %d is negative", fn,
                     (long long)off[i], i);
        TP_ARG_CHECK(t->shape[i] <= gshape[i] && off[i] <= gshape[i] - t->shape[i],
                     "%s: offset %lld + size %lld exceeds global size %lld of dim %d", fn,
                     (long long)off[i], (long long)t->shape[i], (long long)gshape[i], i);
    }
    int64_t numel = tp_tensor_numel(t);
    if (numel == 0 || tp_tensor_device(t).type == TP_DEVICE_META)
        return TP_OK; /* a meta tensor: the arguments are checked, nothing is drawn */

    /* Non-empty block inside the global shape: every global size is >= 1. */
    int64_t s = 1;
    for (int i = nd - 1; i >= 0; i--) {
        gstride[i] = s;
        TP_ARG_CHECK(s <= INT64_MAX / gshape[i], "%s: global shape has too many elements", fn);
        s *= gshape[i];
    }
    uint64_t g0 = 0;
    for (int i = 0; i < nd; i++)
        g0 += (uint64_t)(off[i] * gstride[i]);

    tp__rng_params prm = {dist, a, b, {(uint32_t)seed, (uint32_t)(seed >> 32)}};
    if (tp_tensor_device(t).type == TP_DEVICE_CPU) {
        tp__fill_random_cpu(t, &prm, g0, gstride);
        return TP_OK;
    }
    /* Device tensors: generate the block on the host, then one copy. */
    tp_tensor *host = NULL;
    TP_CHECK(tp_tensor_empty(t->dtype, TP_CPU, nd, t->shape, &host));
    tp__fill_random_cpu(host, &prm, g0, gstride);
    tp_status st = tp_tensor_copy(t, host);
    tp_tensor_release(host);
    if (st != TP_OK)
        tp__error_prefix("%s", fn);
    return st;
}
