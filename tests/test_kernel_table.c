/* The CPU engine's kernel table (src/kernels/cpu_table.c, kernels.h): every
 * entry present and named, supports() true for f32, bf16 and f16 alone, every
 * entry answering another dtype with TP_ERR_NOT_SUPPORTED naming the op and
 * the dtype (and writing nothing), the device lookup, and the entries whose CPU
 * kernels are new (copy, fill, gather, the divided sums, the loss-gradient
 * spread, the vocab-parallel loss, the optimizer steps, SiLU and SwiGLU,
 * the rotary embedding) against double references. The kernels themselves
 * are tested in test_kernels.c.
 *
 * The bf16 and f16 forms of every entry are tested in test_kernels_dtype.c.
 *
 * This links libtp's objects rather than the library (everything internal
 * is hidden in libtp); the CUDA registration is the build's, whose lookup
 * this file checks too. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tp_test.h"

#include "kernels/kernels.h"
#include "tp/config.h"

static const tp__kernels *const K = &tp__kernels_cpu;
static const tp_device CPU = {TP_DEVICE_CPU, 0};

#define EXPECT_MSG(want)                                                           \
    cr_assert(!strcmp(tp_last_error(), (want)), "message \"%s\", expected \"%s\"", \
              tp_last_error(), (want))

static void rnd(float *x, int64_t n, uint64_t seed)
{
    for (int64_t i = 0; i < n; i++)
        x[i] = (float)(2.0 * tp_rng_uniform(seed, (uint64_t)i) - 1.0);
}

/* ---- the table ------------------------------------------------------------------------- */

Test(kernel_table, every_entry_is_there_and_named, .timeout = 30)
{
    cr_assert_str_eq(K->name, "cpu");
    cr_assert(K->supports);
#define CHECK_ENTRY(NAME, field)                                                              \
    cr_assert(K->field, "the cpu table lacks " #field);                                       \
    cr_assert_str_eq(tp__kop_name(TP__KOP_##NAME), #field);
    TP__KERNEL_ENTRIES(CHECK_ENTRY)
#undef CHECK_ENTRY
    cr_assert_str_eq(tp__kop_name(TP__KOP_NONE), "?");
    cr_assert_str_eq(tp__kop_name(TP__KOP_COUNT), "?");
}

Test(kernel_table, supports_the_float_dtypes_alone, .timeout = 30)
{
    const tp_dtype others[] = {TP_F64, TP_I32, TP_I64};
    for (int op = TP__KOP_NONE + 1; op < TP__KOP_COUNT; op++) {
        cr_assert(K->supports((tp__kop)op, TP_F32), "%s f32", tp__kop_name((tp__kop)op));
        cr_assert(K->supports((tp__kop)op, TP_BF16), "%s bf16", tp__kop_name((tp__kop)op));
        cr_assert(K->supports((tp__kop)op, TP_F16), "%s f16", tp__kop_name((tp__kop)op));
        for (size_t d = 0; d < sizeof others / sizeof others[0]; d++)
            cr_assert(!K->supports((tp__kop)op, others[d]), "%s %s", tp__kop_name((tp__kop)op),
                      tp_dtype_name(others[d]));
    }
    cr_assert(!K->supports(TP__KOP_NONE, TP_F32));
    cr_assert(!K->supports(TP__KOP_COUNT, TP_F32));
    cr_assert(!K->supports(TP__KOP_NONE, TP_BF16));
    cr_assert(!K->supports(TP__KOP_COUNT, TP_F16));
}

Test(kernel_table, other_dtypes_are_not_supported_and_write_nothing, .timeout = 30)
{
    float a[4] = {1, 2, 3, 4}, b[4] = {5, 6, 7, 8}, y[4] = {-1, -1, -1, -1};
    const float untouched[4] = {-1, -1, -1, -1};
    int64_t shape[1] = {4}, one[1] = {1};
    cr_assert_eq(K->add(CPU, TP_F64, a, b, y, 4), TP_ERR_NOT_SUPPORTED);
    EXPECT_MSG("cpu kernels: add does not take f64");
    cr_assert_eq(K->gemm(CPU, TP_I32, false, false, 2, 2, 2, 1.0f, a, 2, b, 2, 0.0f, y, 2),
                 TP_ERR_NOT_SUPPORTED);
    EXPECT_MSG("cpu kernels: gemm does not take i32");
    cr_assert_eq(K->linear_fwd(CPU, TP_I64, a, b, NULL, y, 2, 2, 2), TP_ERR_NOT_SUPPORTED);
    EXPECT_MSG("cpu kernels: linear_fwd does not take i64");
    cr_assert_eq(K->sum_all(CPU, TP_F64, a, 4, y, 1.0), TP_ERR_NOT_SUPPORTED);
    EXPECT_MSG("cpu kernels: sum_all does not take f64");
    cr_assert_eq(K->sum_dim(CPU, TP_I32, a, y, 1, 4, 1, 1.0), TP_ERR_NOT_SUPPORTED);
    EXPECT_MSG("cpu kernels: sum_dim does not take i32");
    cr_assert_eq(K->copy(CPU, TP_I64, y, a, 4), TP_ERR_NOT_SUPPORTED);
    EXPECT_MSG("cpu kernels: copy does not take i64");
    cr_assert_eq(K->mul_bcast(CPU, TP_F64, a, b, y, 1, shape, one, one), TP_ERR_NOT_SUPPORTED);
    EXPECT_MSG("cpu kernels: mul_bcast does not take f64");
    cr_assert_eq(K->sgd_step(CPU, TP_I32, y, a, 4, 0.5), TP_ERR_NOT_SUPPORTED);
    EXPECT_MSG("cpu kernels: sgd_step does not take i32");
    cr_assert_eq(K->silu_fwd(CPU, TP_F64, a, y, 4), TP_ERR_NOT_SUPPORTED);
    EXPECT_MSG("cpu kernels: silu_fwd does not take f64");
    cr_assert_eq(K->swiglu_bwd(CPU, TP_I64, a, b, a, y, y, 4), TP_ERR_NOT_SUPPORTED);
    EXPECT_MSG("cpu kernels: swiglu_bwd does not take i64");
    cr_assert(!memcmp(y, untouched, sizeof y), "a refused entry wrote its output");
    cr_assert_eq(K->add(CPU, TP_F32, a, b, y, 4), TP_OK);
    for (int i = 0; i < 4; i++)
        cr_assert_eq(y[i], a[i] + b[i]);
}

Test(kernel_table, devices_find_their_engine, .timeout = 30)
{
    const tp__kernels *k = NULL;
    cr_assert_eq(tp__kernels_for(CPU, &k), TP_OK);
    cr_assert_eq(k, &tp__kernels_cpu);
#if TP_HAVE_CUDA
    /* the CUDA engine's table, whether or not a device is present */
    k = NULL;
    cr_assert_eq(tp__kernels_for(TP_CUDA(1), &k), TP_OK);
    cr_assert_eq(k, tp__kernels_cuda);
    cr_assert_str_eq(k->name, "cuda");
#else
    /* the CUDA registration is cuda_none.c's: no table */
    k = NULL;
    cr_assert_eq(tp__kernels_for(TP_CUDA(1), &k), TP_ERR_NOT_SUPPORTED);
    cr_assert_null(k);
    EXPECT_MSG("no kernels for cuda:1: libtp was built without CUDA");
#endif
}

/* ---- the entries new to the CPU ----------------------------------------------------------- */

Test(kernel_table, copy_and_fill, .timeout = 30)
{
    float x[7], y[7];
    rnd(x, 7, 1);
    cr_assert_eq(K->copy(CPU, TP_F32, y, x, 7), TP_OK);
    cr_assert(!memcmp(x, y, sizeof x));
    cr_assert_eq(K->copy(CPU, TP_F32, y, y, 7), TP_OK); /* dst == src: nothing */
    cr_assert_eq(K->copy(CPU, TP_F32, NULL, NULL, 0), TP_OK);
    cr_assert_eq(K->fill(CPU, TP_F32, y, 0.0f, 7), TP_OK);
    for (int i = 0; i < 7; i++)
        cr_assert(y[i] == 0.0f && !signbit(y[i]));
    cr_assert_eq(K->fill(CPU, TP_F32, y, -0.0f, 7), TP_OK);
    for (int i = 0; i < 7; i++)
        cr_assert(y[i] == 0.0f && signbit(y[i]), "-0 is filled as -0");
    cr_assert_eq(K->fill(CPU, TP_F32, y, 2.5f, 5), TP_OK);
    for (int i = 0; i < 7; i++)
        cr_assert_eq(y[i], i < 5 ? 2.5f : -0.0f);
}

/* gather: y = x through element strides, against index loops, for a
 * permutation of [3, 4, 5] (inner run strided), one with a contiguous inner
 * run, a 0-d view and an empty one */
Test(kernel_table, gather, .timeout = 30)
{
    float x[60], y[60];
    rnd(x, 60, 2);
    const int64_t xst[3] = {20, 5, 1}, xsh[3] = {3, 4, 5};
    const int perms[2][3] = {{2, 0, 1}, {1, 0, 2}};
    for (int p = 0; p < 2; p++) {
        int64_t sh[3], st[3];
        for (int k = 0; k < 3; k++) {
            sh[k] = xsh[perms[p][k]];
            st[k] = xst[perms[p][k]];
        }
        cr_assert_eq(K->gather(CPU, TP_F32, y, x, 3, sh, st), TP_OK);
        int64_t e = 0;
        for (int64_t i = 0; i < sh[0]; i++)
            for (int64_t j = 0; j < sh[1]; j++)
                for (int64_t l = 0; l < sh[2]; l++, e++)
                    cr_assert_eq(y[e], x[i * st[0] + j * st[1] + l * st[2]],
                                 "perm %d element %lld", p, (long long)e);
    }
    y[0] = 0;
    cr_assert_eq(K->gather(CPU, TP_F32, y, x + 7, 0, NULL, NULL), TP_OK);
    cr_assert_eq(y[0], x[7]);
    y[0] = -3;
    cr_assert_eq(K->gather(CPU, TP_F32, y, x, 2, (int64_t[]){0, 4}, (int64_t[]){1, 3}), TP_OK);
    cr_assert_eq(y[0], -3.0f, "an empty gather wrote");
}

/* sum_dim and sum_all divide before their one rounding (as the CUDA engine);
 * over nothing they give 0 / div (NaN for a mean) */
Test(kernel_table, sums_divide_before_rounding, .timeout = 30)
{
    enum { NO = 3, NS = 129, NI = 5 };
    static float x[NO * NS * NI];
    float y[NO * NI], s;
    rnd(x, NO * NS * NI, 3);
    const double divs[3] = {1.0, 3.0, 129.0};
    for (int k = 0; k < 3; k++) {
        for (int inner = 1; inner <= NI; inner += NI - 1) {
            cr_assert_eq(K->sum_dim(CPU, TP_F32, x, y, NO, NS, inner, divs[k]), TP_OK);
            for (int o = 0; o < NO; o++)
                for (int i = 0; i < inner; i++) {
                    double acc = 0;
                    for (int j = 0; j < NS; j++)
                        acc += (double)x[(o * NS + j) * inner + i];
                    float want = (float)(acc / divs[k]);
                    cr_assert(fabsf(y[o * inner + i] - want) <= 1e-6f * fabsf(want) + 1e-7f,
                              "sum_dim div %g inner %d [%d, %d]: %.9g, want %.9g", divs[k],
                              inner, o, i, (double)y[o * inner + i], (double)want);
                }
        }
        cr_assert_eq(K->sum_all(CPU, TP_F32, x, NO * NS * NI, &s, divs[k]), TP_OK);
        double acc = 0;
        for (int i = 0; i < NO * NS * NI; i++)
            acc += (double)x[i];
        cr_assert(fabsf(s - (float)(acc / divs[k])) <= 1e-6f * fabsf(s) + 1e-7f, "sum_all");
    }
    cr_assert_eq(K->sum_dim(CPU, TP_F32, x, y, 2, 0, 3, 0.0), TP_OK);
    for (int i = 0; i < 6; i++)
        cr_assert(isnan(y[i]), "the mean over an empty dim is NaN");
    cr_assert_eq(K->sum_dim(CPU, TP_F32, x, y, 2, 0, 3, 1.0), TP_OK);
    for (int i = 0; i < 6; i++)
        cr_assert_eq(y[i], 0.0f, "the sum over an empty dim is 0");
    cr_assert_eq(K->sum_all(CPU, TP_F32, x, 0, &s, 0.0), TP_OK);
    cr_assert(isnan(s));
}

Test(kernel_table, ce_gloss_and_vocab_ce_loss, .timeout = 30)
{
    float g[5] = {0.5f, 1, 2, 3, 4}, gl[5];
    cr_assert_eq(K->ce_gloss(CPU, TP_F32, g, gl, 5, false, 7.0), TP_OK);
    cr_assert(!memcmp(g, gl, sizeof g), "unreduced: each row its own gradient");
    cr_assert_eq(K->ce_gloss(CPU, TP_F32, g, gl, 5, true, 3.0), TP_OK);
    for (int r = 0; r < 5; r++)
        cr_assert_eq(gl[r], (float)(0.5 / 3.0));
    /* loss[r] = w_t (log(sumexp) + max - picked); ignored rows 0 */
    const int64_t t[4] = {2, -100, 0, 1};
    const float w[3] = {0.5f, 2.0f, 1.5f}, mx[4] = {1, 2, 3, 4}, se[4] = {1.5f, 2, 3, 9},
                pk[4] = {0.25f, 9, -1, 2};
    float loss[4];
    for (int weighted = 0; weighted < 2; weighted++) {
        const float *wp = weighted ? w : NULL;
        cr_assert_eq(K->vocab_ce_loss(CPU, TP_F32, t, wp, mx, se, pk, loss, 4, -100), TP_OK);
        for (int r = 0; r < 4; r++) {
            double want = t[r] == -100 ? 0.0
                                       : (wp ? wp[t[r]] : 1.0) *
                                             (log((double)se[r]) + mx[r] - (double)pk[r]);
            cr_assert_eq(loss[r], (float)want, "row %d: %.9g, want %.9g", r, (double)loss[r],
                         want);
        }
    }
}

/* the optimizer steps, in double and rounded once per stored value */
Test(kernel_table, sgd_and_adam_steps, .timeout = 30)
{
    enum { N = 17 };
    float p[N], g[N], m[N], v[N], p0[N], m0[N], v0[N];
    rnd(p, N, 4);
    rnd(g, N, 5);
    memcpy(p0, p, sizeof p);
    cr_assert_eq(K->sgd_step(CPU, TP_F32, p, g, N, 0.125), TP_OK);
    for (int i = 0; i < N; i++)
        cr_assert_eq(p[i], (float)((double)p0[i] - 0.125 * (double)g[i]));
    rnd(m, N, 6);
    rnd(v, N, 7);
    for (int i = 0; i < N; i++)
        v[i] = fabsf(v[i]);
    memcpy(p0, p, sizeof p);
    memcpy(m0, m, sizeof m);
    memcpy(v0, v, sizeof v);
    const double b1 = 0.9, b2 = 0.999, step = 0.01, bc2 = sqrt(1 - 0.999 * 0.999), eps = 1e-8;
    cr_assert_eq(K->adam_step(CPU, TP_F32, p, m, v, g, N, b1, b2, step, bc2, eps), TP_OK);
    for (int i = 0; i < N; i++) {
        float mi = (float)(b1 * m0[i] + (1 - b1) * g[i]);
        float vi = (float)(b2 * v0[i] + (1 - b2) * (double)g[i] * g[i]);
        float pi = (float)((double)p0[i] - step * (double)mi / (sqrt((double)vi) / bc2 + eps));
        cr_assert(m[i] == mi && v[i] == vi && p[i] == pi, "element %d", i);
    }
}

/* SiLU and SwiGLU in f32 through the table against double formulas (the
 * sigmoid from exp(-|x|) in both): over [-12, 12] and far out, zeros,
 * infinities and NaN; swiglu_bwd with either gradient NULL writing the same
 * bits as with both, and in place. */
static void sig_ref(double x, double *s, double *om)
{
    double e = exp(-fabs(x)), d = 1.0 / (1.0 + e);
    *s = x >= 0 ? d : e * d;
    *om = x >= 0 ? e * d : d;
}

static void expect_near(const char *what, int64_t i, float got, double want, double scale)
{
    cr_assert(fabs((double)got - want) <= 2e-6 * scale + 1e-37,
              "%s[%lld] = %.9g, want %.9g", what, (long long)i, (double)got, want);
}

Test(kernel_table, silu_and_swiglu, .timeout = 30)
{
    enum { N = 1037 }; /* a vector tail */
    static float x[N], u[N], gy[N], y[N], gx[N], gg[N], gu[N], gg1[N], gu1[N];
    for (int i = 0; i < N; i++) {
        x[i] = -12.0f + 24.0f * (float)i / (float)(N - 1);
        u[i] = (float)((i * 7) % 11) * 0.5f - 2.5f;
        gy[i] = 1.0f - 0.001f * (float)i;
    }
    const float far[10] = {-1000.0f, -104.5f, -100.0f, -90.0f, 0.0f, -0.0f, 90.0f, 1000.0f,
                           3e38f, -3e38f};
    memcpy(x, far, sizeof far);
    cr_assert_eq(K->silu_fwd(CPU, TP_F32, x, y, N), TP_OK);
    cr_assert_eq(K->silu_bwd(CPU, TP_F32, x, gy, gx, N), TP_OK);
    for (int i = 0; i < N; i++) {
        double s, om;
        sig_ref(x[i], &s, &om);
        double d = s + (double)x[i] * s * om, terms = s + fabs((double)x[i] * s * om);
        expect_near("silu", i, y[i], (double)x[i] * s, fabs((double)x[i] * s));
        expect_near("silu_bwd", i, gx[i], gy[i] * d, fabs(gy[i]) * terms);
        cr_assert(!isnan(y[i]) && !isnan(gx[i]), "NaN at x = %g", x[i]);
    }
    cr_assert(y[0] == 0.0f && signbit(y[0]), "silu(-1000) = %g", y[0]);
    cr_assert(y[4] == 0.0f && gx[4] == 0.5f * gy[4]);
    cr_assert(y[7] == 1000.0f && gx[7] == gy[7]);
    cr_assert(y[8] == 3e38f && y[9] == 0.0f);
    cr_assert_eq(K->swiglu_fwd(CPU, TP_F32, x, u, y, N), TP_OK);
    cr_assert_eq(K->swiglu_bwd(CPU, TP_F32, x, u, gy, gg, gu, N), TP_OK);
    for (int i = 0; i < N; i++) {
        if (fabsf(x[i]) > 1e4f) /* silu(3e38) * up overflows */
            continue;
        double s, om;
        sig_ref(x[i], &s, &om);
        double silu = (double)x[i] * s, d = s + (double)x[i] * s * om,
               terms = s + fabs((double)x[i] * s * om);
        expect_near("swiglu", i, y[i], silu * u[i], fabs(silu * u[i]));
        expect_near("swiglu_bwd gate", i, gg[i], (double)gy[i] * u[i] * d,
                    fabs((double)gy[i] * u[i]) * terms);
        expect_near("swiglu_bwd up", i, gu[i], (double)gy[i] * silu, fabs((double)gy[i] * silu));
    }
    /* one gradient alone: the same bits */
    memset(gg1, 0x7f, sizeof gg1);
    memset(gu1, 0x7f, sizeof gu1);
    cr_assert_eq(K->swiglu_bwd(CPU, TP_F32, x, u, gy, gg1, NULL, N), TP_OK);
    cr_assert_eq(K->swiglu_bwd(CPU, TP_F32, x, u, gy, NULL, gu1, N), TP_OK);
    cr_assert(!memcmp(gg, gg1, sizeof gg) && !memcmp(gu, gu1, sizeof gu));
    cr_assert_eq(K->swiglu_bwd(CPU, TP_F32, x, u, gy, NULL, NULL, N), TP_OK);
    cr_assert_eq(K->swiglu_bwd(CPU, TP_F32, NULL, NULL, NULL, NULL, NULL, 0), TP_OK);
    /* in place: the gradients over gate and up, silu over x */
    memcpy(gg1, x, sizeof x);
    memcpy(gu1, u, sizeof u);
    cr_assert_eq(K->swiglu_bwd(CPU, TP_F32, gg1, gu1, gy, gg1, gu1, N), TP_OK);
    cr_assert(!memcmp(gg, gg1, sizeof gg) && !memcmp(gu, gu1, sizeof gu), "in place");
    memcpy(gg1, x, sizeof x);
    cr_assert_eq(K->swiglu_fwd(CPU, TP_F32, gg1, u, gg1, N), TP_OK);
    cr_assert(!memcmp(y, gg1, sizeof y), "swiglu_fwd in place");
    /* infinities and NaN */
    const float sp[3] = {INFINITY, -INFINITY, NAN}, one[3] = {1, 1, 1};
    float sy[3], sg[3];
    cr_assert_eq(K->silu_fwd(CPU, TP_F32, sp, sy, 3), TP_OK);
    cr_assert_eq(K->silu_bwd(CPU, TP_F32, sp, one, sg, 3), TP_OK);
    cr_assert(sy[0] == INFINITY && sg[0] == 1.0f, "silu(inf) = %g, grad %g", sy[0], sg[0]);
    cr_assert(sy[1] == 0.0f && signbit(sy[1]) && fabsf(sg[1]) < 1e-40f, "silu(-inf) = %g, %g",
              sy[1], sg[1]);
    cr_assert(isnan(sy[2]) && isnan(sg[2]));
}

/* attn_softmax: refuses the dtypes the others refuse, writing nothing; on
 * f32 a padded causal block against hand-worked rows */
Test(kernel_table, attn_softmax_refusals_and_a_small_block, .timeout = 30)
{
    float s[6] = {1, 2, 3, 4, 5, 6};
    const float kept[6] = {1, 2, 3, 4, 5, 6};
    const int64_t pad[3] = {0, 1, 1};
    cr_assert_eq(K->attn_softmax(CPU, TP_F64, s, 1, 2, 2, 3, 0, true, pad, TP_I64, 1),
                 TP_ERR_NOT_SUPPORTED);
    EXPECT_MSG("cpu kernels: attn_softmax does not take f64");
    cr_assert_eq(K->attn_softmax(CPU, TP_I64, s, 1, 2, 2, 3, 0, true, pad, TP_I64, 1),
                 TP_ERR_NOT_SUPPORTED);
    EXPECT_MSG("cpu kernels: attn_softmax does not take i64");
    cr_assert(!memcmp(s, kept, sizeof s), "a refused entry wrote its scores");
    /* query 0 sees key 0 only, which is padding: all 0; query 1 sees key 1 */
    cr_assert_eq(K->attn_softmax(CPU, TP_F32, s, 1, 2, 2, 3, 0, true, pad, TP_I64, 1), TP_OK);
    const float want[6] = {0, 0, 0, 0, 1, 0};
    for (int i = 0; i < 6; i++)
        cr_assert_eq(s[i], want[i], "[%d] %g, want %g", i, (double)s[i], (double)want[i]);
    /* key_offset 1: query 0 sees keys 0 and 1 (key 1 only, key 0 padded) */
    float t[3] = {0.5f, -1, 7};
    cr_assert_eq(K->attn_softmax(CPU, TP_F32, t, 1, 1, 1, 3, 1, true, pad, TP_I64, 1), TP_OK);
    cr_assert(t[0] == 0 && t[1] == 1 && t[2] == 0, "%g %g %g", (double)t[0], (double)t[1],
              (double)t[2]);
}

/* The rotary embedding, forward and backward, against the formulas in double
 * (one f32 rounding per product and sum: within 2^-23 of the absolute
 * terms), with cos/sin per batch and broadcast over it, halves that differ,
 * in place; cos/sin of the f32 angle against double; other dtypes refused. */
static void rope_ref(const float *x, const float *c, const float *s, double *y, int64_t B,
                     int64_t H, int64_t S, int64_t D, int64_t cbs, bool bwd, double *abs)
{
    const int64_t h = D / 2;
    for (int64_t b = 0; b < B; b++)
        for (int64_t r = 0; r < H * S; r++) {
            const float *xr = x + (b * H * S + r) * D;
            const float *cr = c + b * cbs + (r % S) * D, *sr = s + b * cbs + (r % S) * D;
            double *yr = y + (b * H * S + r) * D, *ar = abs + (b * H * S + r) * D;
            for (int64_t i = 0; i < D; i++) {
                /* forward: y = x c + rotate_half(x) s; backward: the transpose */
                double other = i < h ? (bwd ? (double)xr[i + h] * sr[i + h]
                                            : -(double)xr[i + h] * sr[i])
                                     : (bwd ? -(double)xr[i - h] * sr[i - h]
                                            : (double)xr[i - h] * sr[i]);
                yr[i] = (double)xr[i] * cr[i] + other;
                ar[i] = fabs((double)xr[i] * cr[i]) + fabs(other);
            }
        }
}

Test(kernel_table, rope_fwd_bwd_and_cos_sin, .timeout = 30)
{
    enum { B = 2, H = 3, S = 5, D = 12, N = B * H * S * D, NC = B * S * D };
    static float x[N], c[NC], s[NC], y[N], yi[N];
    static double r[N], a[N];
    rnd(x, N, 11);
    rnd(c, NC, 12);
    rnd(s, NC, 13);
    for (int bwd = 0; bwd < 2; bwd++)
        for (int64_t cbs = 0; cbs <= S * D; cbs += S * D) {
            tp_status st = bwd ? K->rope_bwd(CPU, TP_F32, x, c, s, y, B, H, S, D, cbs)
                               : K->rope_fwd(CPU, TP_F32, x, c, s, y, B, H, S, D, cbs);
            cr_assert_eq(st, TP_OK);
            rope_ref(x, c, s, r, B, H, S, D, cbs, bwd, a);
            for (int i = 0; i < N; i++)
                cr_assert(fabs(y[i] - r[i]) <= 0x1p-23 * a[i], "%s cbs %lld [%d]: %.9g, want %.17g",
                          bwd ? "rope_bwd" : "rope_fwd", (long long)cbs, i, (double)y[i], r[i]);
            memcpy(yi, x, sizeof x); /* in place: the same values */
            st = bwd ? K->rope_bwd(CPU, TP_F32, yi, c, s, yi, B, H, S, D, cbs)
                     : K->rope_fwd(CPU, TP_F32, yi, c, s, yi, B, H, S, D, cbs);
            cr_assert_eq(st, TP_OK);
            cr_assert(!memcmp(yi, y, sizeof y), "%s in place differs", bwd ? "bwd" : "fwd");
        }

    const int64_t pos[4] = {0, 3, 4097, 100000};
    const float inv[3] = {1.0f, 0.0316227749f, 0.001f};
    float co[24], si[24];
    cr_assert_eq(K->rope_cos_sin(CPU, TP_F32, pos, inv, co, si, 4, 6, 0.5f), TP_OK);
    for (int p = 0; p < 4; p++)
        for (int i = 0; i < 6; i++) {
            float f = (float)pos[p] * inv[i % 3];
            cr_assert_eq(co[p * 6 + i], (float)cos((double)f) * 0.5f, "cos [%d, %d]", p, i);
            cr_assert_eq(si[p * 6 + i], (float)sin((double)f) * 0.5f, "sin [%d, %d]", p, i);
        }
    cr_assert_eq(K->rope_fwd(CPU, TP_F64, x, c, s, y, B, H, S, D, 0), TP_ERR_NOT_SUPPORTED);
    EXPECT_MSG("cpu kernels: rope_fwd does not take f64");
    cr_assert_eq(K->rope_bwd(CPU, TP_I32, x, c, s, y, B, H, S, D, 0), TP_ERR_NOT_SUPPORTED);
    EXPECT_MSG("cpu kernels: rope_bwd does not take i32");
    cr_assert_eq(K->rope_cos_sin(CPU, TP_I64, pos, inv, co, si, 4, 6, 1.0f), TP_ERR_NOT_SUPPORTED);
    EXPECT_MSG("cpu kernels: rope_cos_sin does not take i64");
}
