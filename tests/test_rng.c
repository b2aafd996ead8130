/* Counter-based RNG: Philox known answers, distribution sanity, and the shard
 * property that makes parallel initialisation match serial initialisation. */
#include <math.h>
#include <time.h>

#include "tp_test.h"
/* tp__philox4x32_10 (static inline) takes the full 128-bit counter that the
 * Random123 known-answer vectors use. */
#include "../src/core/core.h"



static const tp_dtype all_dtypes[] = {TP_F32, TP_F64, TP_F16, TP_BF16, TP_I32, TP_I64};
#define N_DTYPES 6

static void expect_block(const uint32_t got[4], const uint32_t want[4])
{
    for (int i = 0; i < 4; i++)
        cr_assert_eq(got[i], want[i], "word %d: %08x != %08x", i, got[i], want[i]);
}

Test(rng, philox_known_answers, .timeout = 30)
{
    /* Random123 kat_vectors, philox4x32 10 */
    uint32_t out[4];
    tp_philox4x32(0, 0, out);
    expect_block(out, (uint32_t[]){0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u});

    tp__philox4x32_10((uint32_t[]){0, 0, 0, 0}, (uint32_t[]){0, 0}, out);
    expect_block(out, (uint32_t[]){0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u});
    tp__philox4x32_10((uint32_t[]){0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu},
                      (uint32_t[]){0xffffffffu, 0xffffffffu}, out);
    expect_block(out, (uint32_t[]){0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu});
    tp__philox4x32_10((uint32_t[]){0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u},
                      (uint32_t[]){0xa4093822u, 0x299f31d0u}, out);
    expect_block(out, (uint32_t[]){0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u});

    /* the public mapping: key = (seed lo, seed hi), counter = (g lo, g hi, 0, 0) */
    uint64_t seed = 0x299f31d0a4093822ull, g = 0x85a308d3243f6a88ull;
    uint32_t ref[4];
    tp_philox4x32(seed, g, out);
    tp__philox4x32_10((uint32_t[]){0x243f6a88u, 0x85a308d3u, 0, 0},
                      (uint32_t[]){0xa4093822u, 0x299f31d0u}, ref);
    expect_block(out, ref);
    tp_philox4x32(1, 2, NULL); /* NULL out is ignored */
}

Test(rng, uniform_and_normal_moments, .timeout = 30)
{
    const int n = 100000;
    double su = 0, su2 = 0, sn = 0, sn2 = 0;
    double umin = 1, umax = 0;
    for (int i = 0; i < n; i++) {
        double u = tp_rng_uniform(1234, (uint64_t)i);
        cr_assert(u >= 0.0 && u < 1.0, "u = %g", u);
        su += u;
        su2 += u * u;
        umin = fmin(umin, u);
        umax = fmax(umax, u);
        double z = tp_rng_normal(1234, (uint64_t)i);
        cr_assert(isfinite(z));
        sn += z;
        sn2 += z * z;
    }
    double mu = su / n, vu = su2 / n - mu * mu;
    double mn = sn / n, vn = sn2 / n - mn * mn;
    cr_assert(fabs(mu - 0.5) < 0.01, "uniform mean %g", mu);
    cr_assert(fabs(vu - 1.0 / 12) < 0.005, "uniform variance %g", vu);
    cr_assert(umin < 0.001 && umax > 0.999, "range [%g, %g]", umin, umax);
    cr_assert(fabs(mn) < 0.02, "normal mean %g", mn);
    cr_assert(fabs(vn - 1.0) < 0.03, "normal variance %g", vn);
}

Test(rng, fill_matches_scalar_functions, .timeout = 30)
{
    int64_t shape[2] = {13, 17};
    tp_tensor *u = NULL, *z = NULL, *s = NULL;
    CHECK_OK(tp_tensor_empty(TP_F64, TP_CPU, 2, shape, &u));
    CHECK_OK(tp_tensor_empty(TP_F64, TP_CPU, 2, shape, &z));
    CHECK_OK(tp_tensor_empty(TP_F64, TP_CPU, 2, shape, &s));
    CHECK_OK(tp_tensor_fill_random(u, TP_RNG_UNIFORM, 0, 1, 77, NULL, NULL));
    CHECK_OK(tp_tensor_fill_random(z, TP_RNG_NORMAL, 0, 1, 77, NULL, NULL));
    CHECK_OK(tp_tensor_fill_random(s, TP_RNG_UNIFORM, -2, 6, 77, NULL, NULL));
    const double *pu = tp_tensor_data(u), *pz = tp_tensor_data(z), *ps = tp_tensor_data(s);
    for (int64_t g = 0; g < 13 * 17; g++) {
        cr_assert_eq(pu[g], tp_rng_uniform(77, (uint64_t)g));
        cr_assert_eq(pz[g], tp_rng_normal(77, (uint64_t)g));
        cr_assert_eq(ps[g], -2 + 8 * tp_rng_uniform(77, (uint64_t)g));
    }
    /* normal with mean and std */
    CHECK_OK(tp_tensor_fill_random(z, TP_RNG_NORMAL, 3, 0.5, 77, NULL, NULL));
    for (int64_t g = 0; g < 13 * 17; g++)
        cr_assert_eq(pz[g], 3 + 0.5 * tp_rng_normal(77, (uint64_t)g));

    /* a scalar is global element 0 */
    tp_tensor *sc = NULL;
    double v;
    CHECK_OK(tp_tensor_empty(TP_F64, TP_CPU, 0, NULL, &sc));
    CHECK_OK(tp_tensor_fill_random(sc, TP_RNG_UNIFORM, 0, 1, 5, NULL, NULL));
    CHECK_OK(tp_tensor_get(sc, NULL, &v));
    cr_assert_eq(v, tp_rng_uniform(5, 0));
    tp_tensor_release(sc);
    tp_tensor_release(u);
    tp_tensor_release(z);
    tp_tensor_release(s);
}

/* Fills the global tensor at once and every torch.chunk shard separately (with
 * global_shape/offset); each shard must equal its block of the global. */
static void check_shards(tp_dtype dt, tp_rng_dist dist, double a, double b, int dim,
                         int64_t chunks)
{
    int64_t gshape[2] = {7, 5};
    tp_tensor *global = NULL;
    CHECK_OK(tp_tensor_empty(dt, TP_CPU, 2, gshape, &global));
    CHECK_OK(tp_tensor_fill_random(global, dist, a, b, 42, gshape, NULL));
    for (int64_t i = 0; i < chunks; i++) {
        int64_t start, len;
        tp_chunk_range(gshape[dim], chunks, i, &start, &len);
        int64_t shape[2] = {gshape[0], gshape[1]}, off[2] = {0, 0};
        shape[dim] = len;
        off[dim] = start;
        tp_tensor *shard = NULL, *expect = NULL;
        CHECK_OK(tp_tensor_empty(dt, TP_CPU, 2, shape, &shard));
        CHECK_OK(tp_tensor_fill_random(shard, dist, a, b, 42, gshape, off));
        CHECK_OK(tp_tensor_chunk(global, chunks, dim, i, &expect));
        bool eq = false;
        CHECK_OK(tp_tensor_equal(shard, expect, &eq));
        cr_assert(eq, "%s dist %d dim %d chunks %lld shard %lld", tp_dtype_name(dt), (int)dist,
                  dim, (long long)chunks, (long long)i);
        tp_tensor_release(shard);
        tp_tensor_release(expect);
    }
    tp_tensor_release(global);
}

Test(rng, shard_property, .timeout = 30)
{
    const int64_t chunk_counts[] = {1, 2, 3, 4, 8};
    for (int k = 0; k < N_DTYPES; k++)
        for (int dim = 0; dim < 2; dim++)
            for (int c = 0; c < 5; c++) {
                check_shards(all_dtypes[k], TP_RNG_UNIFORM, -1, 1, dim, chunk_counts[c]);
                check_shards(all_dtypes[k], TP_RNG_NORMAL, 0, 2, dim, chunk_counts[c]);
                check_shards(all_dtypes[k], TP_RNG_RANDINT, -50, 50, dim, chunk_counts[c]);
            }
}

Test(rng, shard_property_2d_and_strided, .timeout = 30)
{
    /* shards along both dims at once, written into strided views of a buffer */
    int64_t gshape[3] = {6, 7, 5};
    tp_tensor *global = NULL, *buf = NULL;
    CHECK_OK(tp_tensor_empty(TP_F32, TP_CPU, 3, gshape, &global));
    CHECK_OK(tp_tensor_fill_random(global, TP_RNG_NORMAL, 0, 1, 9, NULL, NULL));
    CHECK_OK(tp_tensor_zeros(TP_F32, TP_CPU, 3, gshape, &buf));
    for (int64_t i = 0; i < 3; i++)
        for (int64_t j = 0; j < 4; j++) {
            tp_tensor *a = NULL, *blk = NULL;
            CHECK_OK(tp_tensor_chunk(buf, 3, 1, i, &a));
            CHECK_OK(tp_tensor_chunk(a, 4, 2, j, &blk));
            int64_t s1, s2;
            tp_chunk_range(7, 3, i, &s1, NULL);
            tp_chunk_range(5, 4, j, &s2, NULL);
            int64_t off[3] = {0, s1, s2};
            CHECK_OK(tp_tensor_fill_random(blk, TP_RNG_NORMAL, 0, 1, 9, gshape, off));
            tp_tensor_release(blk);
            tp_tensor_release(a);
        }
    bool eq = false;
    CHECK_OK(tp_tensor_equal(global, buf, &eq));
    cr_assert(eq);
    tp_tensor_release(buf);
    tp_tensor_release(global);
}

Test(rng, every_dtype_matches_f64_converted, .timeout = 30)
{
    int64_t shape[2] = {9, 11};
    tp_tensor *ref = NULL;
    CHECK_OK(tp_tensor_empty(TP_F64, TP_CPU, 2, shape, &ref));
    const tp_rng_dist dists[3] = {TP_RNG_UNIFORM, TP_RNG_NORMAL, TP_RNG_RANDINT};
    for (int d = 0; d < 3; d++) {
        CHECK_OK(tp_tensor_fill_random(ref, dists[d], -20, 20, 3, NULL, NULL));
        for (int k = 0; k < N_DTYPES; k++) {
            tp_tensor *t = NULL, *conv = NULL;
            CHECK_OK(tp_tensor_empty(all_dtypes[k], TP_CPU, 2, shape, &t));
            CHECK_OK(tp_tensor_fill_random(t, dists[d], -20, 20, 3, NULL, NULL));
            CHECK_OK(tp_tensor_to(ref, all_dtypes[k], TP_CPU, &conv));
            bool eq = false;
            CHECK_OK(tp_tensor_equal(t, conv, &eq));
            cr_assert(eq, "%s dist %d", tp_dtype_name(all_dtypes[k]), d);
            tp_tensor_release(t);
            tp_tensor_release(conv);
        }
    }
    tp_tensor_release(ref);
}

Test(rng, randint_bounds, .timeout = 30)
{
    int64_t n = 20000;
    tp_tensor *t = NULL;
    CHECK_OK(tp_tensor_empty(TP_F32, TP_CPU, 1, &n, &t));
    CHECK_OK(tp_tensor_fill_random(t, TP_RNG_RANDINT, -3, 5, 11, NULL, NULL));
    const float *p = tp_tensor_data(t);
    int seen[8] = {0};
    for (int64_t i = 0; i < n; i++) {
        cr_assert(p[i] >= -3 && p[i] < 5, "value %g", (double)p[i]);
        cr_assert_eq(p[i], floorf(p[i]), "value %g is not an integer", (double)p[i]);
        seen[(int)p[i] + 3]++;
    }
    for (int v = 0; v < 8; v++)
        cr_assert(seen[v] > n / 8 * 0.8 && seen[v] < n / 8 * 1.2, "value %d seen %d times",
                  v - 3, seen[v]);
    tp_tensor_release(t);

    /* a large range into i64 */
    tp_tensor *big = NULL;
    CHECK_OK(tp_tensor_empty(TP_I64, TP_CPU, 1, &n, &big));
    double hi = 0x1.0p53;
    CHECK_OK(tp_tensor_fill_random(big, TP_RNG_RANDINT, 0, hi, 11, NULL, NULL));
    const int64_t *q = tp_tensor_data(big);
    int64_t maxv = 0;
    for (int64_t i = 0; i < n; i++) {
        cr_assert(q[i] >= 0 && q[i] < (1LL << 53));
        if (q[i] > maxv)
            maxv = q[i];
    }
    cr_assert(maxv > (1LL << 52), "uses the whole range");
    /* a single-value range */
    CHECK_OK(tp_tensor_fill_random(big, TP_RNG_RANDINT, 7, 8, 11, NULL, NULL));
    for (int64_t i = 0; i < n; i++)
        cr_assert_eq(q[i], 7);
    tp_tensor_release(big);
}

Test(rng, seeds_differ, .timeout = 30)
{
    int64_t shape[2] = {16, 16};
    tp_tensor *a = NULL, *b = NULL, *c = NULL;
    CHECK_OK(tp_tensor_empty(TP_F32, TP_CPU, 2, shape, &a));
    CHECK_OK(tp_tensor_empty(TP_F32, TP_CPU, 2, shape, &b));
    CHECK_OK(tp_tensor_empty(TP_F32, TP_CPU, 2, shape, &c));
    CHECK_OK(tp_tensor_fill_random(a, TP_RNG_UNIFORM, 0, 1, 1, NULL, NULL));
    CHECK_OK(tp_tensor_fill_random(b, TP_RNG_UNIFORM, 0, 1, 2, NULL, NULL));
    CHECK_OK(tp_tensor_fill_random(c, TP_RNG_UNIFORM, 0, 1, 1, NULL, NULL));
    bool eq = true;
    CHECK_OK(tp_tensor_equal(a, b, &eq));
    cr_assert(!eq);
    CHECK_OK(tp_tensor_equal(a, c, &eq));
    cr_assert(eq, "same seed, same values");
    /* high seed bits matter too */
    CHECK_OK(tp_tensor_fill_random(b, TP_RNG_UNIFORM, 0, 1, 1 | (1ull << 40), NULL, NULL));
    CHECK_OK(tp_tensor_equal(a, b, &eq));
    cr_assert(!eq);
    int same = 0;
    const float *pa = tp_tensor_data(a), *pb = tp_tensor_data(b);
    for (int i = 0; i < 256; i++)
        same += pa[i] == pb[i];
    cr_assert(same < 4, "%d of 256 equal", same);
    tp_tensor_release(a);
    tp_tensor_release(b);
    tp_tensor_release(c);
}

Test(rng, invalid_arguments, .timeout = 30)
{
    int64_t shape[2] = {3, 4};
    tp_tensor *t = NULL;
    CHECK_OK(tp_tensor_empty(TP_F32, TP_CPU, 2, shape, &t));
    CHECK_ERR(tp_tensor_fill_random(NULL, TP_RNG_UNIFORM, 0, 1, 0, NULL, NULL),
               TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_fill_random(t, (tp_rng_dist)9, 0, 1, 0, NULL, NULL), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_fill_random(t, TP_RNG_UNIFORM, 2, 1, 0, NULL, NULL), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_fill_random(t, TP_RNG_UNIFORM, 0, INFINITY, 0, NULL, NULL),
               TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_fill_random(t, TP_RNG_NORMAL, 0, -1, 0, NULL, NULL), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_fill_random(t, TP_RNG_NORMAL, NAN, 1, 0, NULL, NULL), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_fill_random(t, TP_RNG_RANDINT, 0, 1.5, 0, NULL, NULL),
               TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_fill_random(t, TP_RNG_RANDINT, 3, 3, 0, NULL, NULL), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_fill_random(t, TP_RNG_RANDINT, 0, 0x1.0p60, 0, NULL, NULL),
               TP_ERR_INVALID_ARG);
    int64_t g[2] = {3, 6};
    CHECK_ERR(tp_tensor_fill_random(t, TP_RNG_UNIFORM, 0, 1, 0, g, (int64_t[]){0, 3}),
               TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "offset 3 + size 4 exceeds global size 6 of dim 1"), "%s",
              tp_last_error());
    CHECK_ERR(tp_tensor_fill_random(t, TP_RNG_UNIFORM, 0, 1, 0, g, (int64_t[]){-1, 0}),
               TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_fill_random(t, TP_RNG_UNIFORM, 0, 1, 0, (int64_t[]){2, 4}, NULL),
               TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_fill_random(t, TP_RNG_UNIFORM, 0, 1, 0, (int64_t[]){-3, 4}, NULL),
               TP_ERR_INVALID_ARG);
    CHECK_OK(tp_tensor_fill_random(t, TP_RNG_UNIFORM, 0, 1, 0, g, (int64_t[]){0, 2}));
    tp_tensor_release(t);

    /* empty blocks are fine, including at the very end of a dim */
    tp_tensor *e = NULL;
    CHECK_OK(tp_tensor_empty(TP_F32, TP_CPU, 2, (int64_t[]){0, 4}, &e));
    CHECK_OK(tp_tensor_fill_random(e, TP_RNG_UNIFORM, 0, 1, 0, (int64_t[]){7, 4}, (int64_t[]){7, 0}));
    tp_tensor_release(e);
}

Test(rng, fills_millions_quickly, .timeout = 30)
{
    int64_t gshape[2] = {4096, 1024}; /* 4 Mi elements */
    tp_tensor *t = NULL, *half = NULL;
    CHECK_OK(tp_tensor_empty(TP_F32, TP_CPU, 2, gshape, &t));
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    CHECK_OK(tp_tensor_fill_random(t, TP_RNG_NORMAL, 0, 0.02, 123, NULL, NULL));
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double secs = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    cr_log_info("normal fill: %.1f M elements/s", 4.194304 / secs);
    cr_assert(secs < 10.0, "4 Mi normals took %.2f s", secs);

    /* column shard of the same global tensor */
    CHECK_OK(tp_tensor_empty(TP_F32, TP_CPU, 2, (int64_t[]){4096, 512}, &half));
    CHECK_OK(tp_tensor_fill_random(half, TP_RNG_NORMAL, 0, 0.02, 123, gshape, (int64_t[]){0, 512}));
    tp_tensor *expect = NULL;
    CHECK_OK(tp_tensor_chunk(t, 2, 1, 1, &expect));
    bool eq = false;
    CHECK_OK(tp_tensor_equal(half, expect, &eq));
    cr_assert(eq);
    tp_tensor_release(expect);
    tp_tensor_release(half);
    tp_tensor_release(t);
}
