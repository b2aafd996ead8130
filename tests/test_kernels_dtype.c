/* The CPU kernel table's dtypes (src/kernels/cpu_table.c, cpu_lowp.c): every
 * entry on bf16 and f16, with f32 as the control, against double references
 * computed here from the same inputs, within the tolerances of docs/API.md
 * "Precision": with inputs exactly representable in the dtype, each output y
 * against its reference r satisfies
 *     |y - r| <= eps_d |r| + K 2^-23 sum|terms| + tiny
 * (eps_d = 2^-8 bf16, 2^-11 f16, 2^-24 f32; the K-term part for reductions,
 * products, norms, softmax and losses; tiny covers the f32 kernels' own
 * polynomial exp/erf, 2^-20 |r| + 2^-26 (relative to the terms where GELU's
 * gradient cancels), plus half the dtype's smallest subnormal). Also the
 * conversions against core's, the accumulate and in-place forms, the chunked
 * drivers at several chunk sizes, supports() and its error, and scratch
 * allocation failure through the allocator hook (TP_ERR_NO_MEMORY, nothing
 * leaked, nothing written, the exact allocation count).
 *
 * The inputs are k/128 (times a power of two) for integers |k| < 256: eight
 * significant bits, exact in bf16, f16 and f32 alike, so one reference serves
 * the three dtypes. Links libtp's objects (the tables are hidden in libtp). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tp_test.h"

#include "core/base.h"
#include "kernels/cpu_lowp.h"
#include "kernels/kernels.h"

static const tp__kernels *const K = &tp__kernels_cpu;
static const tp_device CPU = {TP_DEVICE_CPU, 0};
static const tp_dtype DT[3] = {TP_F32, TP_BF16, TP_F16};

/* The dtypes each test runs: f32, and bf16 and f16 with the unit driver's
 * chunks at their default size, at one unit, and at 700 elements (several
 * units, a tail). */
static const struct {
    tp_dtype dt;
    int64_t chunk;
} RUNS[7] = {{TP_F32, 16384}, {TP_BF16, 16384}, {TP_F16, 16384}, {TP_BF16, 1},
             {TP_F16, 1},     {TP_BF16, 700},   {TP_F16, 700}};
#define FOR_DT(dt)                                                                            \
    for (int dt##_i = 0; dt##_i < 7 && (tp__lp_unit_elems = RUNS[dt##_i].chunk, 1); dt##_i++) \
        for (tp_dtype dt = RUNS[dt##_i].dt, *dt##_once = &dt; dt##_once; dt##_once = NULL)

#define U23 0x1p-23 /* the f32 accumulation's unit, per term */
#define TINY_REL 0x1p-20
#define TINY_ABS 0x1p-26

/* ---- buffers ------------------------------------------------------------------------- */

/* Everything a test allocates, freed after it. */
static void *bag[2048];
static int nbag;

static void *keep(void *p)
{
    cr_assert_not_null(p);
    cr_assert_lt(nbag, 2048);
    return bag[nbag++] = p;
}

/* Each test starts at the default chunk and leaves no allocator hook and no
 * buffer behind (tests may share a process: tests/shim). */
static void suite_init(void)
{
    tp__lp_unit_elems = 16384;
}

static void suite_fini(void)
{
    tp_set_allocator(NULL);
    tp__lp_unit_elems = 16384;
    while (nbag > 0)
        free(bag[--nbag]);
}

TestSuite(kernels_dtype, .init = suite_init, .fini = suite_fini, .timeout = 60);

static double eps_of(tp_dtype dt)
{
    return dt == TP_BF16 ? 0x1p-8 : dt == TP_F16 ? 0x1p-11 : 0x1p-24;
}

/* Half the dtype's smallest subnormal: the absolute rounding error of results
 * below its normal range (f16: under 2^-14). */
static double sub_of(tp_dtype dt)
{
    return dt == TP_F16 ? 0x1p-25 : dt == TP_BF16 ? 0x1p-134 : 0x1p-150;
}

/* n values k / 128 * scale, |k| <= 255: exact in every float dtype for a
 * power-of-two scale (in f16's range). */
static double *gen(int64_t n, uint64_t seed, double scale)
{
    double *x = keep(malloc((size_t)(n > 0 ? n : 1) * sizeof *x));
    for (int64_t i = 0; i < n; i++) {
        double k = floor(tp_rng_uniform(seed, (uint64_t)i) * 511.0) - 255.0;
        x[i] = k / 128.0 * scale;
    }
    return x;
}

static double *dzeros(int64_t n)
{
    return keep(calloc((size_t)(n > 0 ? n : 1), sizeof(double)));
}

/* A buffer of dtype holding x (n elements; x NULL: zeros). */
static void *mk(tp_dtype dt, const double *x, int64_t n)
{
    void *p = keep(calloc((size_t)(n > 0 ? n : 1), tp_dtype_size(dt)));
    for (int64_t i = 0; x && i < n; i++)
        tp__store_f64(p, dt, i, x[i]);
    return p;
}

static double at(const void *p, tp_dtype dt, int64_t i)
{
    return tp__load_f64(p, dt, i);
}

/* The dtype's value of v (rounded once). */
static double rnd_dt(tp_dtype dt, double v)
{
    unsigned char b[8];
    tp__store_f64(b, dt, 0, v);
    return tp__load_f64(b, dt, 0);
}

/* Asserts |y[i] - r[i]| <= eps_d |r[i]| + slack[i] + tiny for n elements
 * (slack NULL: 0); infinities must match exactly. */
static void expect_close(const char *what, tp_dtype dt, const void *y, const double *r,
                         const double *slack, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        double v = at(y, dt, i), want = r[i];
        if (isinf(want) || isnan(want)) {
            cr_assert(v == want || (isnan(v) && isnan(want)), "%s %s [%lld]: %.9g, want %.9g", what,
                      tp_dtype_name(dt), (long long)i, v, want);
            continue;
        }
        double tol =
            (eps_of(dt) + TINY_REL) * fabs(want) + (slack ? slack[i] : 0) + TINY_ABS + sub_of(dt);
        cr_assert(fabs(v - want) <= tol,
                  "%s %s [%lld]: %.9g, want %.9g (tolerance %.3g, chunk %lld)", what,
                  tp_dtype_name(dt), (long long)i, v, want, tol, (long long)tp__lp_unit_elems);
    }
}

/* Exact equality with the reference (data movement, selections). */
static void expect_exact(const char *what, tp_dtype dt, const void *y, const double *r, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        cr_assert(at(y, dt, i) == r[i] || (isnan(r[i]) && isnan(at(y, dt, i))),
                  "%s %s [%lld]: %.9g, want %.9g (chunk %lld)", what, tp_dtype_name(dt),
                  (long long)i, at(y, dt, i), r[i], (long long)tp__lp_unit_elems);
}

#define OK(expr) CHECK_OK(expr)

/* ---- the conversions ----------------------------------------------------------------- */

static float f32_of(uint32_t x)
{
    float f;
    memcpy(&f, &x, sizeof f);
    return f;
}

/* tp__lp_store against core's one-element conversions on f32 inputs xs[0..n) */
static void expect_stores_match_core(const uint32_t *xs, int64_t n, float *f, uint16_t *h)
{
    for (int64_t i = 0; i < n; i++)
        f[i] = f32_of(xs[i]);
    tp__lp_store(TP_BF16, h, f, n);
    for (int64_t i = 0; i < n; i++)
        cr_assert_eq(h[i], tp__f32_to_bf16(f[i]), "bf16 of 0x%08x: 0x%04x, core 0x%04x", xs[i],
                     h[i], tp__f32_to_bf16(f[i]));
    tp__lp_store(TP_F16, h, f, n);
    for (int64_t i = 0; i < n; i++)
        cr_assert_eq(h[i], tp__f32_to_f16(f[i]), "f16 of 0x%08x: 0x%04x, core 0x%04x", xs[i], h[i],
                     tp__f32_to_f16(f[i]));
}

/* The vectorized conversions are core's bit for bit: every bf16 and f16 value
 * loaded (a NaN may come back quieted, as its store makes it anyway), and
 * stores of every f32 at and next to each rounding boundary of both dtypes
 * (the midpoints between neighbouring values, +-1 ulp), of both signs, plus
 * a sweep of the whole f32 range. */
Test(kernels_dtype, conversions_are_cores_bit_for_bit, .timeout = 60)
{
    enum { NB = 1 << 16 };
    uint16_t *h = keep(malloc(NB * 3 * sizeof *h)), *h2 = keep(malloc(NB * 3 * sizeof *h2));
    float *f = keep(malloc(NB * 3 * sizeof *f));
    uint32_t *xs = keep(malloc(NB * 3 * sizeof *xs));
    for (int d = 1; d < 3; d++) {
        tp_dtype dt = DT[d];
        for (uint32_t i = 0; i < NB; i++)
            h[i] = (uint16_t)i;
        tp__lp_load(dt, f, h, NB);
        for (uint32_t i = 0; i < NB; i++) {
            float want = dt == TP_BF16 ? tp__bf16_to_f32(h[i]) : tp__f16_to_f32(h[i]);
            uint32_t a, b;
            memcpy(&a, &f[i], 4);
            memcpy(&b, &want, 4);
            cr_assert(a == b || (isnan(want) && (a | 0x400000u) == (b | 0x400000u)),
                      "%s 0x%04x: 0x%08x, core 0x%08x", tp_dtype_name(dt), i, a, b);
        }
        /* round trip: every value but NaN comes back, NaN stays NaN */
        tp__lp_store(dt, h2, f, NB);
        for (uint32_t i = 0; i < NB; i++)
            cr_assert(h2[i] == i || isnan(f[i]), "%s round trip 0x%04x -> 0x%04x",
                      tp_dtype_name(dt), i, h2[i]);
        /* the midpoints between value i and i + 1 (as f32 bits), -1, +0, +1 */
        for (uint32_t i = 0; i < NB; i++) {
            float lo = dt == TP_BF16 ? tp__bf16_to_f32((uint16_t)i) : tp__f16_to_f32((uint16_t)i);
            float hi = dt == TP_BF16 ? tp__bf16_to_f32((uint16_t)(i + 1))
                                     : tp__f16_to_f32((uint16_t)(i + 1));
            float mid = (float)(((double)lo + (double)hi) / 2);
            uint32_t m;
            memcpy(&m, &mid, 4);
            xs[3 * i] = m - 1;
            xs[3 * i + 1] = m;
            xs[3 * i + 2] = m + 1;
        }
        expect_stores_match_core(xs, NB * 3, f, h);
    }
    /* f32 bit patterns spread over the whole range, an odd stride */
    for (uint64_t x0 = 0; x0 < (1ull << 32); x0 += (uint64_t)NB * 3 * 4099) {
        for (uint32_t i = 0; i < NB * 3; i++)
            xs[i] = (uint32_t)(x0 + (uint64_t)i * 4099);
        expect_stores_match_core(xs, NB * 3, f, h);
    }
}

/* ---- supports() ---------------------------------------------------------------------- */

Test(kernels_dtype, supports_f32_bf16_f16_and_refuses_the_rest, .timeout = 60)
{
    for (int op = TP__KOP_NONE + 1; op < TP__KOP_COUNT; op++) {
        FOR_DT(dt)
        cr_assert(K->supports((tp__kop)op, dt), "%s %s", tp__kop_name((tp__kop)op),
                  tp_dtype_name(dt));
        cr_assert(!K->supports((tp__kop)op, TP_F64));
        cr_assert(!K->supports((tp__kop)op, TP_I32));
        cr_assert(!K->supports((tp__kop)op, TP_I64));
    }
    double a[4] = {1, 2, 3, 4};
    cr_assert_eq(K->gelu_fwd(CPU, TP_F64, a, a, 4, false), TP_ERR_NOT_SUPPORTED);
    cr_assert_str_eq(tp_last_error(), "cpu kernels: gelu_fwd does not take f64");
    cr_assert_eq(K->layer_norm_fwd(CPU, TP_I64, a, NULL, NULL, a, NULL, NULL, 1, 4, 0),
                 TP_ERR_NOT_SUPPORTED);
    cr_assert_str_eq(tp_last_error(), "cpu kernels: layer_norm_fwd does not take i64");
    cr_assert_eq(K->adam_step(CPU, TP_I32, a, NULL, NULL, a, 4, 0, 0, 0, 0, 0),
                 TP_ERR_NOT_SUPPORTED);
    cr_assert_str_eq(tp_last_error(), "cpu kernels: adam_step does not take i32");
    cr_assert_eq(K->silu_bwd(CPU, TP_F64, a, a, a, 4), TP_ERR_NOT_SUPPORTED);
    cr_assert_str_eq(tp_last_error(), "cpu kernels: silu_bwd does not take f64");
    cr_assert_eq(K->swiglu_fwd(CPU, TP_I32, a, a, a, 4), TP_ERR_NOT_SUPPORTED);
    cr_assert_str_eq(tp_last_error(), "cpu kernels: swiglu_fwd does not take i32");
    cr_assert(a[0] == 1 && a[3] == 4, "a refused entry wrote");
}

/* ---- elementwise --------------------------------------------------------------------- */

enum { NE = 2500 }; /* crosses the elementwise chunks (1024) twice, with a tail */

Test(kernels_dtype, add_mul_scale_accumulate_and_in_place, .timeout = 60)
{
    double *a = gen(NE, 1, 1), *b = gen(NE, 2, 1), *r = dzeros(NE);
    FOR_DT(dt)
    {
        void *da = mk(dt, a, NE), *db = mk(dt, b, NE), *y = mk(dt, NULL, NE);
        OK(K->add(CPU, dt, da, db, y, NE));
        for (int i = 0; i < NE; i++)
            r[i] = a[i] + b[i];
        expect_close("add", dt, y, r, NULL, NE);
        OK(K->mul(CPU, dt, da, db, y, NE));
        for (int i = 0; i < NE; i++)
            r[i] = a[i] * b[i];
        expect_close("mul", dt, y, r, NULL, NE);
        OK(K->scale(CPU, dt, da, 0.3f, y, NE));
        for (int i = 0; i < NE; i++)
            r[i] = a[i] * (double)0.3f;
        expect_close("scale", dt, y, r, NULL, NE);
        /* y = a (rounded), then y += b: read, added in f32, rounded once */
        OK(K->copy(CPU, dt, y, da, NE));
        OK(K->accumulate(CPU, dt, y, db, NE));
        for (int i = 0; i < NE; i++)
            r[i] = a[i] + b[i];
        expect_close("accumulate", dt, y, r, NULL, NE);
        /* in place: the output is one of the inputs */
        OK(K->mul(CPU, dt, da, db, da, NE));
        for (int i = 0; i < NE; i++)
            r[i] = a[i] * b[i];
        expect_close("mul in place", dt, da, r, NULL, NE);
        OK(K->add(CPU, dt, da, db, db, NE));
        for (int i = 0; i < NE; i++)
            r[i] = rnd_dt(dt, a[i] * b[i]) + b[i];
        expect_close("add in place", dt, db, r, NULL, NE);
        OK(K->accumulate(CPU, dt, db, db, NE));
        for (int i = 0; i < NE; i++)
            r[i] = 2 * rnd_dt(dt, r[i]);
        expect_close("accumulate y += y", dt, db, r, NULL, NE);
    }
}

Test(kernels_dtype, copy_and_fill, .timeout = 60)
{
    double *a = gen(NE, 3, 1), *r = dzeros(NE);
    FOR_DT(dt)
    {
        void *da = mk(dt, a, NE), *y = mk(dt, NULL, NE);
        OK(K->copy(CPU, dt, y, da, NE));
        cr_assert(!memcmp(y, da, NE * tp_dtype_size(dt)), "copy %s", tp_dtype_name(dt));
        OK(K->fill(CPU, dt, y, 0.1f, NE - 1));
        for (int i = 0; i < NE; i++)
            r[i] = i < NE - 1 ? rnd_dt(dt, 0.1f) : a[i];
        expect_exact("fill", dt, y, r, NE);
        for (int i = 0; i < NE - 1; i++)
            r[i] = 0.1f;
        expect_close("fill", dt, y, r, NULL, NE);
        OK(K->fill(CPU, dt, y, -0.0f, 3));
        cr_assert(at(y, dt, 0) == 0 && signbit(at(y, dt, 0)), "fill -0 %s", tp_dtype_name(dt));
    }
}

static double gelu_ref(double x, bool tanh_approx)
{
    if (tanh_approx)
        return 0.5 * x * (1 + tanh(sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
    return 0.5 * x * (1 + erf(x / sqrt(2)));
}

/* GELU's derivative, the sum of two terms; *abs receives the sum of their
 * magnitudes (the derivative cancels for negative x, and the f32 kernel's
 * error is relative to the terms). */
static double gelu_grad_ref(double x, bool tanh_approx, double *abs)
{
    double t1, t2;
    if (tanh_approx) {
        double k = sqrt(2 / M_PI), u = k * (x + 0.044715 * x * x * x), t = tanh(u);
        t1 = 0.5 * (1 + t);
        t2 = 0.5 * x * (1 - t * t) * k * (1 + 3 * 0.044715 * x * x);
    } else {
        t1 = 0.5 * (1 + erf(x / sqrt(2)));
        t2 = x * exp(-0.5 * x * x) / sqrt(2 * M_PI);
    }
    *abs = fabs(t1) + fabs(t2);
    return t1 + t2;
}

Test(kernels_dtype, relu_and_gelu, .timeout = 60)
{
    double *x = gen(NE, 4, 4), *gy = gen(NE, 5, 1), *r = dzeros(NE), *s = dzeros(NE);
    FOR_DT(dt)
    {
        void *dx = mk(dt, x, NE), *dg = mk(dt, gy, NE), *y = mk(dt, NULL, NE);
        OK(K->relu_fwd(CPU, dt, dx, y, NE));
        for (int i = 0; i < NE; i++)
            r[i] = x[i] > 0 ? x[i] : 0;
        expect_exact("relu_fwd", dt, y, r, NE);
        OK(K->relu_bwd(CPU, dt, dx, dg, y, NE));
        for (int i = 0; i < NE; i++)
            r[i] = x[i] > 0 ? gy[i] : 0;
        expect_exact("relu_bwd", dt, y, r, NE);
        for (int t = 0; t < 2; t++) {
            OK(K->gelu_fwd(CPU, dt, dx, y, NE, t));
            for (int i = 0; i < NE; i++)
                r[i] = gelu_ref(x[i], t);
            expect_close(t ? "gelu_fwd tanh" : "gelu_fwd", dt, y, r, NULL, NE);
            OK(K->gelu_bwd(CPU, dt, dx, dg, y, NE, t));
            for (int i = 0; i < NE; i++) {
                r[i] = gy[i] * gelu_grad_ref(x[i], t, &s[i]);
                s[i] *= TINY_REL * fabs(gy[i]);
            }
            expect_close(t ? "gelu_bwd tanh" : "gelu_bwd", dt, y, r, s, NE);
        }
        /* in place */
        OK(K->gelu_fwd(CPU, dt, dx, dx, NE, false));
        for (int i = 0; i < NE; i++)
            r[i] = gelu_ref(x[i], false);
        expect_close("gelu_fwd in place", dt, dx, r, NULL, NE);
    }
}

/* sigmoid and 1 - sigmoid in double from exp(-|x|) */
static void sig_ref(double x, double *s, double *om)
{
    double e = exp(-fabs(x)), d = 1.0 / (1.0 + e);
    *s = x >= 0 ? d : e * d;
    *om = x >= 0 ? e * d : d;
}

/* silu'(x) = s + x s (1 - s); *abs: |s| + |x s (1 - s)| (it cancels near
 * x = -1.28, and the f32 kernel's error is relative to the terms) */
static double silu_grad_ref(double x, double *abs)
{
    double s, om;
    sig_ref(x, &s, &om);
    *abs = s + fabs(x * s * om);
    return s + x * s * om;
}

/* SiLU and SwiGLU forward and backward (both gradients, each alone, and in
 * place), each output rounded once: swiglu_bwd's five buffers go through
 * the elementwise driver's smaller chunks (608 elements), which NE crosses
 * four times. */
Test(kernels_dtype, silu_and_swiglu, .timeout = 60)
{
    double *x = gen(NE, 61, 8), *u = gen(NE, 62, 2), *gy = gen(NE, 63, 1), *r = dzeros(NE),
           *sl = dzeros(NE), *r2 = dzeros(NE);
    FOR_DT(dt)
    {
        void *dx = mk(dt, x, NE), *du = mk(dt, u, NE), *dg = mk(dt, gy, NE), *y = mk(dt, NULL, NE),
             *y2 = mk(dt, NULL, NE), *y3 = mk(dt, NULL, NE);
        OK(K->silu_fwd(CPU, dt, dx, y, NE));
        for (int i = 0; i < NE; i++) {
            double s, om;
            sig_ref(x[i], &s, &om);
            r[i] = x[i] * s;
        }
        expect_close("silu_fwd", dt, y, r, NULL, NE);
        OK(K->silu_bwd(CPU, dt, dx, dg, y, NE));
        for (int i = 0; i < NE; i++) {
            r[i] = gy[i] * silu_grad_ref(x[i], &sl[i]);
            sl[i] *= TINY_REL * fabs(gy[i]);
        }
        expect_close("silu_bwd", dt, y, r, sl, NE);
        OK(K->swiglu_fwd(CPU, dt, dx, du, y, NE));
        for (int i = 0; i < NE; i++) {
            double s, om;
            sig_ref(x[i], &s, &om);
            r[i] = x[i] * s * u[i];
        }
        expect_close("swiglu_fwd", dt, y, r, NULL, NE);
        OK(K->swiglu_bwd(CPU, dt, dx, du, dg, y, y2, NE));
        for (int i = 0; i < NE; i++) {
            double s, om;
            sig_ref(x[i], &s, &om);
            r[i] = gy[i] * u[i] * silu_grad_ref(x[i], &sl[i]);
            sl[i] *= TINY_REL * fabs(gy[i] * u[i]);
            r2[i] = gy[i] * x[i] * s;
        }
        expect_close("swiglu_bwd gate", dt, y, r, sl, NE);
        expect_close("swiglu_bwd up", dt, y2, r2, NULL, NE);
        size_t nb = NE * tp_dtype_size(dt);
        OK(K->swiglu_bwd(CPU, dt, dx, du, dg, y3, NULL, NE));
        cr_assert(!memcmp(y3, y, nb), "swiglu_bwd gate alone %s", tp_dtype_name(dt));
        OK(K->swiglu_bwd(CPU, dt, dx, du, dg, NULL, y3, NE));
        cr_assert(!memcmp(y3, y2, nb), "swiglu_bwd up alone %s", tp_dtype_name(dt));
        /* in place: the gradients over gate and up */
        OK(K->swiglu_bwd(CPU, dt, dx, du, dg, dx, du, NE));
        cr_assert(!memcmp(dx, y, nb) && !memcmp(du, y2, nb), "swiglu_bwd in place %s",
                  tp_dtype_name(dt));
        void *dx2 = mk(dt, x, NE);
        OK(K->silu_fwd(CPU, dt, dx2, dx2, NE));
        for (int i = 0; i < NE; i++) {
            double s, om;
            sig_ref(x[i], &s, &om);
            r[i] = x[i] * s;
        }
        expect_close("silu_fwd in place", dt, dx2, r, NULL, NE);
    }
}

/* ---- matrix products ------------------------------------------------------------------ */

/* C = alpha op(A) op(B) + beta C0 in double, and the K-term slack. */
static void gemm_ref(bool ta, bool tb, int m, int n, int k, double alpha, const double *a, int lda,
                     const double *b, int ldb, double beta, const double *c0, int ldc, double *r,
                     double *s)
{
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) {
            double acc = 0, abs = 0;
            for (int l = 0; l < k; l++) {
                double p =
                    (ta ? a[l * lda + i] : a[i * lda + l]) * (tb ? b[j * ldb + l] : b[l * ldb + j]);
                acc += p;
                abs += fabs(p);
            }
            double cv = c0[i * ldc + j];
            r[i * ldc + j] = alpha * acc + (beta != 0 ? beta * cv : 0);
            s[i * ldc + j] = (k + 1) * U23 * (fabs(alpha) * abs + fabs(beta * cv));
        }
}

Test(kernels_dtype, gemm_transposes_leading_dims_and_beta, .timeout = 60)
{
    enum { M = 5, N = 7, KK = 33, LD = 40 };
    double *a = gen(LD * LD, 6, 1), *b = gen(LD * LD, 7, 1), *c0 = gen(M * LD, 8, 1);
    double *r = dzeros(M * LD), *s = dzeros(M * LD);
    FOR_DT(dt)
    {
        for (int t = 0; t < 8; t++) {
            bool ta = t & 1, tb = t & 2;
            float beta = t & 4 ? 0.5f : 0.0f;
            void *da = mk(dt, a, LD * LD), *db = mk(dt, b, LD * LD), *dc = mk(dt, c0, M * LD);
            if (!beta) /* beta 0 overwrites, even NaN */
                tp__store_f64(dc, dt, 0, NAN);
            OK(K->gemm(CPU, dt, ta, tb, M, N, KK, 1.5f, da, LD, db, LD, beta, dc, LD));
            gemm_ref(ta, tb, M, N, KK, 1.5, a, LD, b, LD, beta, c0, LD, r, s);
            for (int i = 0; i < M; i++) {
                expect_close("gemm", dt, (char *)dc + (size_t)i * LD * tp_dtype_size(dt),
                             r + i * LD, s + i * LD, N);
                /* the padding past n columns is untouched */
                expect_exact("gemm padding", dt,
                             (char *)dc + (size_t)(i * LD + N) * tp_dtype_size(dt), c0 + i * LD + N,
                             LD - N);
            }
        }
    }
}

Test(kernels_dtype, linear_fwd_and_bwd_with_accumulate, .timeout = 60)
{
    enum { R = 6, IN = 40, OUT = 9 };
    double *x = gen(R * IN, 9, 1), *w = gen(OUT * IN, 10, 1), *bias = gen(OUT, 11, 1);
    double *gy = gen(R * OUT, 12, 1), *g0 = gen(OUT * IN, 13, 1);
    double *r = dzeros(OUT * IN), *s = dzeros(OUT * IN), *zero = dzeros(OUT * IN);
    FOR_DT(dt)
    {
        void *dx = mk(dt, x, R * IN), *dw = mk(dt, w, OUT * IN), *db = mk(dt, bias, OUT);
        void *dgy = mk(dt, gy, R * OUT), *y = mk(dt, NULL, R * OUT);
        for (int hb = 0; hb < 2; hb++) {
            OK(K->linear_fwd(CPU, dt, dx, dw, hb ? db : NULL, y, R, IN, OUT));
            gemm_ref(false, true, R, OUT, IN, 1, x, IN, w, IN, 0, zero, OUT, r, s);
            for (int i = 0; hb && i < R * OUT; i++) {
                r[i] += bias[i % OUT];
                s[i] += U23 * (IN + 1) * fabs(bias[i % OUT]);
            }
            expect_close("linear_fwd", dt, y, r, s, R * OUT);
        }
        for (int acc = 0; acc < 2; acc++) {
            const double *init = acc ? g0 : zero;
            void *gx = mk(dt, init, R * IN), *gw = mk(dt, init, OUT * IN), *gb = mk(dt, init, OUT);
            OK(K->linear_bwd(CPU, dt, dx, dw, dgy, gx, gw, gb, R, IN, OUT, acc));
            gemm_ref(false, false, R, IN, OUT, 1, gy, OUT, w, IN, acc, init, IN, r, s);
            expect_close("linear_bwd gx", dt, gx, r, s, R * IN);
            gemm_ref(true, false, OUT, IN, R, 1, gy, OUT, x, IN, acc, init, IN, r, s);
            expect_close("linear_bwd gw", dt, gw, r, s, OUT * IN);
            for (int o = 0; o < OUT; o++) {
                double sum = init[o], abs = fabs(init[o]);
                for (int i = 0; i < R; i++) {
                    sum += gy[i * OUT + o];
                    abs += fabs(gy[i * OUT + o]);
                }
                r[o] = sum;
                s[o] = (R + 1) * U23 * abs;
            }
            expect_close("linear_bwd gb", dt, gb, r, s, OUT);
            /* only gw asked for: x and gy are all it reads */
            void *gw2 = mk(dt, init, OUT * IN);
            OK(K->linear_bwd(CPU, dt, dx, NULL, dgy, NULL, gw2, NULL, R, IN, OUT, acc));
            cr_assert(!memcmp(gw, gw2, OUT * IN * tp_dtype_size(dt)));
        }
    }
}

/* ---- broadcasting, layout --------------------------------------------------------------- */

/* y[i] = a . b over [2, 3, 4] with a broadcast along dim 1 (stride 0) and b a
 * permuted view (strides of a [4, 3, 2] tensor read transposed); then in place
 * with a contiguous operand */
Test(kernels_dtype, add_and_mul_bcast_strided_and_in_place, .timeout = 60)
{
    const int64_t shape[3] = {2, 3, 4}, ast[3] = {4, 0, 1}, bst[3] = {1, 2, 6}, cst[3] = {12, 4, 1};
    double *a = gen(8, 14, 1), *b = gen(24, 15, 1), *r = dzeros(24);
    FOR_DT(dt)
    {
        for (int op = 0; op < 2; op++) {
            void *da = mk(dt, a, 8), *db = mk(dt, b, 24), *y = mk(dt, NULL, 24);
            OK((op ? K->mul_bcast : K->add_bcast)(CPU, dt, da, db, y, 3, shape, ast, bst));
            for (int i = 0, e = 0; i < 2; i++)
                for (int j = 0; j < 3; j++)
                    for (int k = 0; k < 4; k++, e++) {
                        double av = a[i * 4 + k], bv = b[i + j * 2 + k * 6];
                        r[e] = op ? av * bv : av + bv;
                    }
            expect_close(op ? "mul_bcast" : "add_bcast", dt, y, r, NULL, 24);
            /* in place: y is b, contiguous with y's shape */
            OK((op ? K->mul_bcast : K->add_bcast)(CPU, dt, da, db, db, 3, shape, ast, cst));
            for (int i = 0, e = 0; i < 2; i++)
                for (int j = 0; j < 3; j++)
                    for (int k = 0; k < 4; k++, e++)
                        r[e] = op ? a[i * 4 + k] * b[e] : a[i * 4 + k] + b[e];
            expect_close("bcast in place", dt, db, r, NULL, 24);
        }
    }
}

/* The forms the op layer hands over most: same-shape operands collapsed to one
 * dim, a row (bias) broadcast [R, C] + [C], a column broadcast [R, C] * [R, 1]
 * and a scalar, each against index loops */
Test(kernels_dtype, bcast_common_forms, .timeout = 60)
{
    enum { R = 37, C = 70 };
    double *a = gen(R * C, 48, 1), *b = gen(R * C, 49, 1), *r = dzeros(R * C);
    const int64_t shape1[1] = {R * C}, one[1] = {1}, zero[1] = {0};
    const int64_t shape2[2] = {R, C}, full[2] = {C, 1}, row[2] = {0, 1}, col[2] = {1, 0},
                  scal[2] = {0, 0};
    FOR_DT(dt)
    {
        void *da = mk(dt, a, R * C), *db = mk(dt, b, R * C), *y = mk(dt, NULL, R * C);
        for (int op = 0; op < 2; op++) {
            tp_status (*fn)(tp_device, tp_dtype, const void *, const void *, void *, int,
                            const int64_t *, const int64_t *, const int64_t *) =
                op ? K->mul_bcast : K->add_bcast;
            const char *name = op ? "mul_bcast" : "add_bcast";
            /* same shape, and a scalar, as one dim */
            OK(fn(CPU, dt, da, db, y, 1, shape1, one, one));
            for (int i = 0; i < R * C; i++)
                r[i] = op ? a[i] * b[i] : a[i] + b[i];
            expect_close(name, dt, y, r, NULL, R * C);
            OK(fn(CPU, dt, da, db, y, 1, shape1, one, zero));
            for (int i = 0; i < R * C; i++)
                r[i] = op ? a[i] * b[0] : a[i] + b[0];
            expect_close(name, dt, y, r, NULL, R * C);
            /* [R, C] with b a row, a column, a scalar */
            const int64_t *bs[3] = {row, col, scal};
            for (int k = 0; k < 3; k++) {
                OK(fn(CPU, dt, da, db, y, 2, shape2, full, bs[k]));
                for (int i = 0; i < R; i++)
                    for (int j = 0; j < C; j++) {
                        double bv = b[i * bs[k][0] + j * bs[k][1]];
                        r[i * C + j] = op ? a[i * C + j] * bv : a[i * C + j] + bv;
                    }
                expect_close(name, dt, y, r, NULL, R * C);
            }
        }
    }
}

Test(kernels_dtype, sum_bcast_gather_transpose, .timeout = 60)
{
    const int64_t shape[3] = {4, 5, 6}, yshape[3] = {4, 1, 6};
    double *x = gen(120, 16, 1), *r = dzeros(120), *s = dzeros(120);
    for (int i = 0; i < 4; i++)
        for (int k = 0; k < 6; k++) {
            double acc = 0, abs = 0;
            for (int j = 0; j < 5; j++) {
                acc += x[(i * 5 + j) * 6 + k];
                abs += fabs(x[(i * 5 + j) * 6 + k]);
            }
            r[i * 6 + k] = acc;
            s[i * 6 + k] = 5 * U23 * abs;
        }
    FOR_DT(dt)
    {
        void *dx = mk(dt, x, 120), *y = mk(dt, NULL, 120);
        OK(K->sum_bcast(CPU, dt, dx, y, 3, shape, yshape));
        expect_close("sum_bcast", dt, y, r, s, 24);
    }
    /* gather of the permutation (2, 0, 1) of [4, 5, 6], and transpose_last2 */
    const int64_t gsh[3] = {6, 4, 5}, gst[3] = {1, 30, 6};
    double *g = dzeros(120), *t = dzeros(120);
    for (int i = 0, e = 0; i < 6; i++)
        for (int j = 0; j < 4; j++)
            for (int k = 0; k < 5; k++, e++)
                g[e] = x[i * gst[0] + j * gst[1] + k * gst[2]];
    for (int b = 0; b < 4; b++)
        for (int i = 0; i < 5; i++)
            for (int j = 0; j < 6; j++)
                t[b * 30 + j * 5 + i] = x[b * 30 + i * 6 + j];
    FOR_DT(dt)
    {
        void *dx = mk(dt, x, 120), *y = mk(dt, NULL, 120);
        OK(K->gather(CPU, dt, y, dx, 3, gsh, gst));
        expect_exact("gather", dt, y, g, 120);
        /* a negative stride: the last dim read backwards from its last element */
        const int64_t nst[1] = {-1}, nsh[1] = {7};
        OK(K->gather(CPU, dt, y, (char *)dx + 9 * tp_dtype_size(dt), 1, nsh, nst));
        for (int i = 0; i < 7; i++)
            cr_assert_eq(at(y, dt, i), x[9 - i], "gather backwards %s", tp_dtype_name(dt));
        OK(K->transpose_last2(CPU, dt, dx, y, 4, 5, 6));
        expect_exact("transpose_last2", dt, y, t, 120);
    }
}

/* ---- reductions ------------------------------------------------------------------------ */

Test(kernels_dtype, sum_dim_sum_dim_bwd_sum_all, .timeout = 60)
{
    enum { NO = 3, NS = 50, NI = 4 };
    double *x = gen(NO * NS * NI, 17, 1), *r = dzeros(NO * NS * NI), *s = dzeros(NO * NS * NI);
    for (int o = 0; o < NO; o++)
        for (int i = 0; i < NI; i++) {
            double acc = 0, abs = 0;
            for (int j = 0; j < NS; j++) {
                acc += x[(o * NS + j) * NI + i];
                abs += fabs(x[(o * NS + j) * NI + i]);
            }
            r[o * NI + i] = acc / 3.0;
            s[o * NI + i] = NS * U23 * abs / 3.0;
        }
    double all = 0, alls = 0;
    for (int i = 0; i < NO * NS * NI; i++) {
        all += x[i];
        alls += fabs(x[i]);
    }
    all /= 7.0;
    alls *= NO * NS * NI * U23 / 7.0;
    FOR_DT(dt)
    {
        void *dx = mk(dt, x, NO * NS * NI), *y = mk(dt, NULL, NO * NS * NI);
        OK(K->sum_dim(CPU, dt, dx, y, NO, NS, NI, 3.0));
        expect_close("sum_dim", dt, y, r, s, NO * NI);
        OK(K->sum_dim(CPU, dt, dx, y, NO, 0, NI, 0.0));
        for (int i = 0; i < NO * NI; i++)
            cr_assert(isnan(at(y, dt, i)), "the mean over nothing is NaN");
        OK(K->sum_all(CPU, dt, dx, NO * NS * NI, y, 7.0));
        expect_close("sum_all", dt, y, &all, &alls, 1);
        /* sum_dim_bwd: gx[o, s, i] = gy[o, i] * scale */
        OK(K->sum_dim_bwd(CPU, dt, dx, y, NO, NS, NI, 0.3f));
        double *rb = dzeros(NO * NS * NI);
        for (int o = 0; o < NO; o++)
            for (int j = 0; j < NS; j++)
                for (int i = 0; i < NI; i++)
                    rb[(o * NS + j) * NI + i] = x[o * NI + i] * (double)0.3f;
        expect_close("sum_dim_bwd", dt, y, rb, NULL, NO * NS * NI);
    }
}

Test(kernels_dtype, softmax_fwd_bwd_and_causal_mask, .timeout = 60)
{
    enum { R = 7, C = 300 };
    double *x = gen(R * C, 18, 4), *gy = gen(R * C, 19, 1), *p = gen(R * C, 20, 0.0078125);
    double *r = dzeros(R * C), *s = dzeros(R * C);
    for (int i = 0; i < R; i++) {
        const double *xr = x + i * C;
        double mx = -INFINITY, sum = 0;
        for (int j = 0; j < C; j++)
            mx = xr[j] > mx ? xr[j] : mx;
        for (int j = 0; j < C; j++)
            sum += exp(xr[j] - mx);
        for (int j = 0; j < C; j++) {
            r[i * C + j] = exp(xr[j] - mx) / sum;
            s[i * C + j] = C * U23 * r[i * C + j];
        }
    }
    FOR_DT(dt)
    {
        void *dx = mk(dt, x, R * C), *y = mk(dt, NULL, R * C);
        OK(K->softmax_fwd(CPU, dt, dx, y, R, C));
        expect_close("softmax_fwd", dt, y, r, s, R * C);
        OK(K->softmax_fwd(CPU, dt, dx, dx, R, C));
        expect_close("softmax_fwd in place", dt, dx, r, s, R * C);
    }
    /* gx = y (gy - sum(gy y)) for y = p (any values: the formula is all that counts) */
    for (int i = 0; i < R; i++) {
        double dot = 0, abs = 0;
        for (int j = 0; j < C; j++) {
            dot += gy[i * C + j] * p[i * C + j];
            abs += fabs(gy[i * C + j] * p[i * C + j]);
        }
        for (int j = 0; j < C; j++) {
            double pj = p[i * C + j], gj = gy[i * C + j];
            r[i * C + j] = pj * (gj - dot);
            s[i * C + j] = (C + 2) * U23 * fabs(pj) * (fabs(gj) + abs);
        }
    }
    FOR_DT(dt)
    {
        void *dp = mk(dt, p, R * C), *dg = mk(dt, gy, R * C), *gx = mk(dt, NULL, R * C);
        OK(K->softmax_bwd(CPU, dt, dp, dg, gx, R, C));
        expect_close("softmax_bwd", dt, gx, r, s, R * C);
        OK(K->softmax_bwd(CPU, dt, dp, dg, dg, R, C));
        expect_close("softmax_bwd in place", dt, dg, r, s, R * C);
    }
    /* causal_mask: -inf above the diagonal of each [S, S], the rest untouched */
    enum { B = 2, S = 9 };
    double *m = gen(B * S * S, 21, 1), *rm = dzeros(B * S * S);
    for (int b = 0; b < B; b++)
        for (int i = 0; i < S; i++)
            for (int j = 0; j < S; j++)
                rm[(b * S + i) * S + j] = j > i ? -INFINITY : m[(b * S + i) * S + j];
    FOR_DT(dt)
    {
        void *dm = mk(dt, m, B * S * S);
        OK(K->causal_mask(CPU, dt, dm, B, S));
        expect_exact("causal_mask", dt, dm, rm, B * S * S);
    }
}

/* ---- embedding, norms, dropout --------------------------------------------------------------- */

Test(kernels_dtype, embedding_fwd_and_bwd_accumulate, .timeout = 60)
{
    enum { ROWS = 10, D = 12, N = 8, OFF = 5 };
    const int64_t idx[N] = {5, 7, 14, 3, 7, 15, 9, 7}; /* 3 and 15 outside [5, 15) */
    double *w = gen(ROWS * D, 22, 1), *gy = gen(N * D, 23, 1), *g0 = gen(ROWS * D, 24, 1);
    double *r = dzeros(ROWS * D), *s = dzeros(ROWS * D);
    for (int i = 0; i < N; i++)
        for (int c = 0; c < D; c++) {
            bool in = idx[i] >= OFF && idx[i] < OFF + ROWS;
            r[i * D + c] = in ? w[(idx[i] - OFF) * D + c] : 0;
        }
    FOR_DT(dt)
    {
        void *dw = mk(dt, w, ROWS * D), *y = mk(dt, NULL, N * D);
        OK(K->embedding_fwd(CPU, dt, idx, N, dw, ROWS, D, OFF, y));
        expect_exact("embedding_fwd", dt, y, r, N * D);
    }
    double *rb = dzeros(ROWS * D);
    for (int i = 0; i < ROWS * D; i++) {
        rb[i] = g0[i];
        s[i] = fabs(g0[i]);
    }
    for (int i = 0; i < N; i++)
        for (int c = 0; idx[i] >= OFF && idx[i] < OFF + ROWS && c < D; c++) {
            rb[(idx[i] - OFF) * D + c] += gy[i * D + c];
            s[(idx[i] - OFF) * D + c] += fabs(gy[i * D + c]);
        }
    for (int i = 0; i < ROWS * D; i++)
        s[i] *= (N + 1) * U23;
    FOR_DT(dt)
    {
        void *dg = mk(dt, gy, N * D), *gw = mk(dt, g0, ROWS * D);
        OK(K->embedding_bwd(CPU, dt, idx, N, dg, ROWS, D, OFF, gw));
        expect_close("embedding_bwd", dt, gw, rb, s, ROWS * D);
    }
}

/* The f32 statistics of a layer norm (mean NULL: RMS norm) of one row. */
static void norm_stats(const double *x, int cols, double eps, bool rms, double *mean, double *rstd)
{
    double mu = 0, var = 0;
    for (int c = 0; !rms && c < cols; c++)
        mu += x[c];
    mu /= cols;
    for (int c = 0; c < cols; c++)
        var += (x[c] - mu) * (x[c] - mu);
    *mean = mu;
    *rstd = 1 / sqrt(var / cols + eps);
}

enum { NR = 5, NC = 64 };

/* y = (x - mean) rstd w + b, gx, gw (+= from g0), gb (+= from g0) in double,
 * from the kernel's saved f32 statistics; slack over the row's NC terms. */
static void norm_ref(bool rms, const double *x, const double *w, const double *b, const double *gy,
                     const float *mean, const float *rstd, double *y, double *gx, double *gw,
                     double *gb, double *sy, double *sx)
{
    for (int r = 0; r < NR; r++) {
        double m = rms ? 0 : mean[r], rs = rstd[r], sa = 0, sb = 0, abs = 0;
        for (int c = 0; c < NC; c++) {
            double xh = (x[r * NC + c] - m) * rs, g = gy[r * NC + c] * w[c];
            y[r * NC + c] = xh * w[c] + (b ? b[c] : 0);
            sy[r * NC + c] = NC * U23 * (fabs(xh * w[c]) + (b ? fabs(b[c]) : 0));
            sa += g;
            sb += g * xh;
            abs += fabs(g) * (1 + fabs(xh));
            gw[c] += gy[r * NC + c] * xh;
            if (gb)
                gb[c] += gy[r * NC + c];
        }
        for (int c = 0; c < NC; c++) {
            double xh = (x[r * NC + c] - m) * rs;
            gx[r * NC + c] = rs * (gy[r * NC + c] * w[c] - (rms ? 0 : sa / NC) - xh * sb / NC);
            sx[r * NC + c] =
                NC * U23 * rs * (fabs(gy[r * NC + c] * w[c]) + abs / NC * (1 + fabs(xh)));
        }
    }
}

static void check_norm(bool rms)
{
    const float eps = 1e-5f;
    double *x = gen(NR * NC, 25, 2), *w = gen(NC, 26, 1), *b = gen(NC, 27, 1);
    double *gy = gen(NR * NC, 28, 1), *g0 = gen(NC, 29, 1);
    double *ry = dzeros(NR * NC), *rgx = dzeros(NR * NC), *sy = dzeros(NR * NC),
           *sx = dzeros(NR * NC), *rgw = dzeros(NC), *rgb = dzeros(NC), *sw = dzeros(NC),
           *sb = dzeros(NC);
    float mean[NR] = {0}, rstd[NR] = {0};
    FOR_DT(dt)
    {
        void *dx = mk(dt, x, NR * NC), *dw = mk(dt, w, NC), *db = mk(dt, b, NC);
        void *dg = mk(dt, gy, NR * NC), *y = mk(dt, NULL, NR * NC), *gx = mk(dt, NULL, NR * NC);
        void *gw = mk(dt, g0, NC), *gb = mk(dt, g0, NC);
        if (rms)
            OK(K->rms_norm_fwd(CPU, dt, dx, dw, y, rstd, NR, NC, eps));
        else
            OK(K->layer_norm_fwd(CPU, dt, dx, dw, db, y, mean, rstd, NR, NC, eps));
        for (int r = 0; r < NR; r++) { /* the saved statistics, f32 whatever the dtype */
            double m, rs;
            norm_stats(x + r * NC, NC, eps, rms, &m, &rs);
            cr_assert(rms || fabs(mean[r] - m) <= 0x1p-23 * fabs(m) + 1e-7, "mean %d", r);
            cr_assert(fabs(rstd[r] - rs) <= 0x1p-22 * rs, "rstd %d: %g, want %g", r, rstd[r], rs);
        }
        for (int c = 0; c < NC; c++) {
            rgw[c] = g0[c];
            rgb[c] = g0[c];
        }
        norm_ref(rms, x, w, rms ? NULL : b, gy, mean, rstd, ry, rgx, rgw, rms ? NULL : rgb, sy, sx);
        expect_close(rms ? "rms_norm_fwd" : "layer_norm_fwd", dt, y, ry, sy, NR * NC);
        if (rms)
            OK(K->rms_norm_bwd(CPU, dt, dx, dw, rstd, dg, gx, gw, NR, NC));
        else
            OK(K->layer_norm_bwd(CPU, dt, dx, dw, mean, rstd, dg, gx, gw, gb, NR, NC));
        expect_close(rms ? "rms_norm_bwd gx" : "layer_norm_bwd gx", dt, gx, rgx, sx, NR * NC);
        /* gw = g0 + sum_r gy xhat and gb = g0 + sum_r gy: NR + 1 terms each */
        for (int c = 0; c < NC; c++) {
            double aw = fabs(g0[c]), ab = fabs(g0[c]);
            for (int r = 0; r < NR; r++) {
                double xh = (x[r * NC + c] - (rms ? 0 : mean[r])) * rstd[r];
                aw += fabs(gy[r * NC + c] * xh);
                ab += fabs(gy[r * NC + c]);
            }
            sw[c] = (NR + 1) * U23 * aw;
            sb[c] = (NR + 1) * U23 * ab;
        }
        expect_close("norm_bwd gw (+=)", dt, gw, rgw, sw, NC);
        if (!rms)
            expect_close("layer_norm_bwd gb (+=)", dt, gb, rgb, sb, NC);
    }
}

Test(kernels_dtype, layer_norm_fwd_bwd, .timeout = 60)
{
    check_norm(false);
}

Test(kernels_dtype, rms_norm_fwd_bwd, .timeout = 60)
{
    check_norm(true);
}

Test(kernels_dtype, dropout_fwd_bwd_block_and_in_place, .timeout = 60)
{
    const int64_t shape[2] = {4, 6}, gshape[2] = {8, 10}, off[2] = {2, 3};
    const float p = 0.25f;
    const uint64_t seed = 99;
    double *x = gen(24, 30, 1), *r = dzeros(24);
    uint8_t mask[24], want[24];
    double scale = (double)(1.0f / (1.0f - p));
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 6; j++) {
            uint64_t g = (uint64_t)((i + 2) * 10 + j + 3);
            want[i * 6 + j] = tp_rng_uniform(seed, g) >= p;
            r[i * 6 + j] = want[i * 6 + j] ? x[i * 6 + j] * scale : 0;
        }
    FOR_DT(dt)
    {
        void *dx = mk(dt, x, 24), *y = mk(dt, NULL, 24), *gx = mk(dt, NULL, 24);
        memset(mask, 7, sizeof mask);
        OK(K->dropout_fwd(CPU, dt, dx, y, mask, 2, shape, gshape, off, p, seed));
        cr_assert(!memcmp(mask, want, sizeof mask), "dropout mask %s", tp_dtype_name(dt));
        expect_close("dropout_fwd", dt, y, r, NULL, 24);
        OK(K->dropout_bwd(CPU, dt, dx, mask, gx, 24, p));
        expect_close("dropout_bwd", dt, gx, r, NULL, 24);
        OK(K->dropout_fwd(CPU, dt, dx, dx, NULL, 2, shape, gshape, off, p, seed));
        expect_close("dropout_fwd in place", dt, dx, r, NULL, 24);
    }
}

/* ---- cross entropy -------------------------------------------------------------------------- */

enum { CO = 3, CC = 20, CI = 2, CR = CO * CI, IGN = -100 };
static const int64_t ce_target[CR] = {4, IGN, 19, 0, 7, 4};

/* Row r of logits [CO, CC, CI]: element c at x[ce_at(r, c)]. */
static int ce_at(int r, int c)
{
    return (r / CI) * CC * CI + c * CI + r % CI;
}

/* logsumexp of row r and the softmax of its class c */
static double ce_lse(const double *x, int r)
{
    double mx = -INFINITY, s = 0;
    for (int c = 0; c < CC; c++)
        mx = x[ce_at(r, c)] > mx ? x[ce_at(r, c)] : mx;
    for (int c = 0; c < CC; c++)
        s += exp(x[ce_at(r, c)] - mx);
    return mx + log(s);
}

Test(kernels_dtype, cross_entropy_fwd_bwd_weighted_ignored_and_nd, .timeout = 60)
{
    double *x = gen(CR * CC, 31, 4), *w = gen(CC, 32, 1), *gl = gen(CR, 33, 1);
    double *rl = dzeros(CR), *sl = dzeros(CR), *rg = dzeros(CR * CC), *sg = dzeros(CR * CC);
    for (int weighted = 0; weighted < 2; weighted++) {
        for (int r = 0; r < CR; r++) {
            int64_t t = ce_target[r];
            double lse = ce_lse(x, r), wt = t == IGN ? 0 : weighted ? w[t] : 1;
            double xt = t == IGN ? 0 : x[ce_at(r, (int)t)];
            rl[r] = wt * (lse - xt);
            sl[r] = CC * U23 * fabs(wt) * (fabs(lse) + fabs(xt) + 1);
            for (int c = 0; c < CC; c++) {
                double sm = exp(x[ce_at(r, c)] - lse);
                rg[ce_at(r, c)] = gl[r] * wt * (sm - (c == t));
                sg[ce_at(r, c)] = CC * U23 * fabs(gl[r] * wt) * (sm + (c == t));
            }
        }
        FOR_DT(dt)
        {
            void *dx = mk(dt, x, CR * CC), *dw = mk(dt, w, CC), *dgl = mk(dt, gl, CR);
            void *loss = mk(dt, NULL, CR), *gx = mk(dt, NULL, CR * CC);
            const void *wp = weighted ? dw : NULL;
            OK(K->cross_entropy_fwd(CPU, dt, dx, ce_target, wp, loss, CR, CC, CI, IGN));
            expect_close("cross_entropy_fwd", dt, loss, rl, sl, CR);
            OK(K->cross_entropy_bwd(CPU, dt, dx, ce_target, wp, dgl, gx, CR, CC, CI, IGN));
            expect_close("cross_entropy_bwd", dt, gx, rg, sg, CR * CC);
        }
    }
    /* ce_gloss: each row its own gradient, or g[0] / div for all */
    FOR_DT(dt)
    {
        void *dgl = mk(dt, gl, CR), *out = mk(dt, NULL, CR);
        OK(K->ce_gloss(CPU, dt, dgl, out, CR, false, 5.0));
        expect_exact("ce_gloss", dt, out, gl, CR);
        OK(K->ce_gloss(CPU, dt, dgl, out, CR, true, 3.0));
        for (int r = 0; r < CR; r++)
            rl[r] = gl[0] / 3.0;
        expect_close("ce_gloss broadcast", dt, out, rl, NULL, CR);
    }
}

/* The vocab-parallel pieces on the classes [OFFV, OFFV + CC) of 50: row max,
 * sum of exp, the picked logit (f32 outputs), then the loss and gradient of
 * the dtype from the global statistics. */
Test(kernels_dtype, vocab_parallel_pieces, .timeout = 60)
{
    enum { OFFV = 10, GLOBAL = 50 };
    const int64_t tgt[CR] = {12, IGN, 29, 3, 45, 10};
    double *x = gen(CR * CC, 34, 4), *w = gen(GLOBAL, 35, 1), *gl = gen(CR, 36, 1);
    float mx[CR], se[CR], pk[CR];
    /* global statistics as the all-reduces would give them: made up, in f32 */
    const float gmx[CR] = {3.5f, 2, 4, 3.75f, 3, 2.5f}, gse[CR] = {30, 20, 41.5f, 25, 33, 27};
    double *rl = dzeros(CR), *sl = dzeros(CR), *rg = dzeros(CR * CC), *sg = dzeros(CR * CC);
    FOR_DT(dt)
    {
        void *dx = mk(dt, x, CR * CC);
        OK(K->row_max(CPU, dt, dx, mx, CR, CC, CI));
        OK(K->row_sumexp(CPU, dt, dx, gmx, se, CR, CC, CI));
        OK(K->pick_target(CPU, dt, dx, tgt, pk, CR, CC, CI, OFFV, IGN));
        for (int r = 0; r < CR; r++) {
            double m = -INFINITY, s = 0;
            for (int c = 0; c < CC; c++) {
                m = x[ce_at(r, c)] > m ? x[ce_at(r, c)] : m;
                s += exp(x[ce_at(r, c)] - gmx[r]);
            }
            bool own = tgt[r] != IGN && tgt[r] >= OFFV && tgt[r] < OFFV + CC;
            cr_assert_eq(mx[r], (float)m, "row_max %s %d", tp_dtype_name(dt), r);
            cr_assert(fabs(se[r] - s) <= (CC * U23 + TINY_REL) * s, "row_sumexp %d", r);
            cr_assert_eq(pk[r], own ? (float)x[ce_at(r, (int)(tgt[r] - OFFV))] : 0.0f,
                         "pick_target %d", r);
        }
    }
    for (int weighted = 0; weighted < 2; weighted++) {
        for (int r = 0; r < CR; r++) {
            int64_t t = tgt[r];
            double wt = t == IGN ? 0 : weighted ? w[t] : 1, lg = log((double)gse[r]);
            rl[r] = wt * (lg + gmx[r] - pk[r]);
            sl[r] = 4 * U23 * fabs(wt) * (fabs(lg) + fabs(gmx[r]) + fabs(pk[r]));
            for (int c = 0; c < CC; c++) {
                double e = exp(x[ce_at(r, c)] - gmx[r]) / gse[r];
                bool is_t = c + OFFV == t;
                rg[ce_at(r, c)] = gl[r] * wt * (e - is_t);
                sg[ce_at(r, c)] = 4 * U23 * fabs(gl[r] * wt) * (e + is_t);
            }
        }
        FOR_DT(dt)
        {
            void *dx = mk(dt, x, CR * CC), *dw = mk(dt, w, GLOBAL), *dgl = mk(dt, gl, CR);
            void *loss = mk(dt, NULL, CR), *gx = mk(dt, NULL, CR * CC);
            const void *wp = weighted ? dw : NULL;
            OK(K->vocab_ce_loss(CPU, dt, tgt, wp, gmx, gse, pk, loss, CR, IGN));
            expect_close("vocab_ce_loss", dt, loss, rl, sl, CR);
            OK(K->vocab_ce_bwd(CPU, dt, dx, tgt, wp, gmx, gse, dgl, gx, CR, CC, CI, OFFV, IGN));
            expect_close("vocab_ce_bwd", dt, gx, rg, sg, CR * CC);
        }
    }
}

/* ---- optimizers ------------------------------------------------------------------------------ */

Test(kernels_dtype, sgd_and_adam_round_p_once, .timeout = 60)
{
    double *p = gen(NE, 37, 1), *g = gen(NE, 38, 1), *r = dzeros(NE);
    double *m0 = gen(NE, 39, 0.125), *v0 = gen(NE, 40, 0.0078125);
    float *m = keep(malloc(NE * sizeof *m)), *v = keep(malloc(NE * sizeof *v));
    const double b1 = 0.9, b2 = 0.999, step = 0.01, bc2 = sqrt(1 - 0.999 * 0.999), eps = 1e-8;
    FOR_DT(dt)
    {
        void *dp = mk(dt, p, NE), *dg = mk(dt, g, NE);
        OK(K->sgd_step(CPU, dt, dp, dg, NE, 0.125));
        for (int i = 0; i < NE; i++)
            r[i] = p[i] - 0.125 * g[i];
        expect_close("sgd_step", dt, dp, r, NULL, NE);
        dp = mk(dt, p, NE);
        for (int i = 0; i < NE; i++) {
            m[i] = (float)m0[i];
            v[i] = (float)fabs(v0[i]);
        }
        OK(K->adam_step(CPU, dt, dp, m, v, dg, NE, b1, b2, step, bc2, eps));
        for (int i = 0; i < NE; i++) {
            /* m and v are f32 whatever the dtype: rounded once each, as for f32 */
            float mi = (float)(b1 * m0[i] + (1 - b1) * g[i]);
            float vi = (float)(b2 * fabs(v0[i]) + (1 - b2) * g[i] * g[i]);
            cr_assert(m[i] == mi && v[i] == vi, "adam m, v %s [%d]", tp_dtype_name(dt), i);
            r[i] = p[i] - step * (double)mi / (sqrt((double)vi) / bc2 + eps);
        }
        expect_close("adam_step", dt, dp, r, NULL, NE);
    }
}

/* ---- scratch allocation failure --------------------------------------------------------------- */

typedef struct failing_alloc {
    long live, count, fail_at;
} failing_alloc;

static failing_alloc FA;

static void *fa_alloc(void *ctx, size_t size, size_t alignment)
{
    failing_alloc *c = ctx;
    if (c->count++ == c->fail_at)
        return NULL;
    size_t rounded = (size + alignment - 1) / alignment * alignment;
    void *p = aligned_alloc(alignment, rounded ? rounded : alignment);
    c->live += p != NULL;
    return p;
}

static void fa_free(void *ctx, void *ptr)
{
    ((failing_alloc *)ctx)->live--;
    free(ptr);
}

typedef tp_status (*entry_run)(void *const *b);

/* Runs `run` on buffers b (outputs b[first], ..., b[first + nout - 1] of
 * nbytes[j] bytes, which it may read) with its k-th scratch allocation
 * failing, k = 0, 1, ... until it succeeds: each failure TP_ERR_NO_MEMORY
 * naming the op, its outputs untouched, nothing leaked; the success takes
 * exactly `allocs` allocations and gives the unhooked run's result. */
static void fail_each_scratch(const char *name, entry_run run, void *const *b, int first, int nout,
                              const size_t *nbytes, long allocs)
{
    void *init[3], *want[3];
    for (int j = 0; j < nout; j++) {
        init[j] = keep(malloc(nbytes[j]));
        want[j] = keep(malloc(nbytes[j]));
        memcpy(init[j], b[first + j], nbytes[j]);
    }
    OK(run(b));
    for (int j = 0; j < nout; j++) {
        memcpy(want[j], b[first + j], nbytes[j]);
        memcpy(b[first + j], init[j], nbytes[j]);
    }
    FA = (failing_alloc){0, 0, -1};
    tp_allocator a = {fa_alloc, fa_free, &FA};
    OK(tp_set_allocator(&a));
    for (long k = 0;; k++) {
        cr_assert_leq(k, allocs, "%s: still failing after %ld allocations", name, allocs);
        FA.count = 0;
        FA.fail_at = k;
        tp_status st = run(b);
        long attempted = FA.count;
        FA.fail_at = -1;
        cr_assert_eq(FA.live, 0, "%s, allocation %ld failing: %ld blocks leaked", name, k, FA.live);
        if (st == TP_OK) {
            cr_assert_eq(attempted, allocs, "%s: %ld allocations, expected %ld", name, attempted,
                         allocs);
            cr_assert_eq(k, allocs, "%s succeeded although allocation %ld failed", name, k);
            for (int j = 0; j < nout; j++)
                cr_assert(!memcmp(b[first + j], want[j], nbytes[j]), "%s: output %d differs", name,
                          j);
            break;
        }
        cr_assert_eq(st, TP_ERR_NO_MEMORY, "%s, allocation %ld failing: %s", name, k,
                     tp_status_name(st));
        cr_assert(strstr(tp_last_error(), name) && strstr(tp_last_error(), "out of memory"),
                  "message: %s", tp_last_error());
        for (int j = 0; j < nout; j++)
            cr_assert(!memcmp(b[first + j], init[j], nbytes[j]),
                      "%s, allocation %ld failing, wrote output %d", name, k, j);
    }
    tp_set_allocator(NULL);
}

enum { FR = 64, FC = 64, FN = 2048, FROWS = 4096, FD = 8 }; /* each past the frame's arena */

static tp_status run_linear_bwd(void *const *b)
{
    return K->linear_bwd(CPU, TP_BF16, b[0], b[1], b[2], b[3], NULL, NULL, FR, FC, FC, true);
}

static tp_status run_layer_norm_bwd(void *const *b)
{
    return K->layer_norm_bwd(CPU, TP_F16, b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], FR, FC);
}

static tp_status run_embedding_bwd(void *const *b)
{
    return K->embedding_bwd(CPU, TP_BF16, b[0], FN, b[1], FROWS, FD, 3, b[2]);
}

/* Scratch allocation failure through the allocator hook, for an entry with an
 * accumulating output (linear_bwd into gx: scratch for w, gy and gx), one
 * with three outputs, two of them accumulated (layer_norm_bwd: x, gy, gx
 * past the arena, w, gw, gb in it), and the embedding backward (row map,
 * index map, row list, gy, the touched rows). */
Test(kernels_dtype, scratch_allocation_failure_is_no_memory_and_leaks_nothing, .timeout = 60)
{
    double *x = gen(FR * FC, 41, 1), *w = gen(FC * FC, 42, 1), *gy = gen(FR * FC, 43, 1);
    double *g0 = gen(FR * FC, 44, 1);
    void *lb[4] = {NULL, mk(TP_BF16, w, FC * FC), mk(TP_BF16, gy, FR * FC),
                   mk(TP_BF16, g0, FR * FC)};
    const size_t lbytes[1] = {FR * FC * 2};
    fail_each_scratch("linear_bwd", run_linear_bwd, lb, 3, 1, lbytes, 3);

    float *mean = keep(malloc(FR * sizeof *mean)), *rstd = keep(malloc(FR * sizeof *rstd));
    void *nb[8] = {mk(TP_F16, x, FR * FC),
                   mk(TP_F16, w, FC),
                   mean,
                   rstd,
                   mk(TP_F16, gy, FR * FC),
                   mk(TP_F16, NULL, FR * FC),
                   mk(TP_F16, g0, FC),
                   mk(TP_F16, g0 + FC, FC)};
    void *ny = mk(TP_F16, NULL, FR * FC);
    OK(K->layer_norm_fwd(CPU, TP_F16, nb[0], nb[1], NULL, ny, mean, rstd, FR, FC, 1e-5f));
    const size_t nbytes[3] = {FR * FC * 2, FC * 2, FC * 2};
    fail_each_scratch("layer_norm_bwd", run_layer_norm_bwd, nb, 5, 3, nbytes, 3);

    int64_t *idx = keep(malloc(FN * sizeof *idx));
    for (int i = 0; i < FN; i++) /* some out of [3, 3 + FROWS), many repeated */
        idx[i] = (int64_t)(tp_rng_uniform(45, (uint64_t)i) * (FROWS + 6));
    void *eb[3] = {idx, mk(TP_BF16, gen(FN * FD, 46, 1), FN * FD),
                   mk(TP_BF16, gen(FROWS * FD, 47, 1), FROWS * FD)};
    const size_t ebytes[1] = {FROWS * FD * 2};
    fail_each_scratch("embedding_bwd", run_embedding_bwd, eb, 2, 1, ebytes, 5);

    /* the elementwise entries convert on the stack: no allocation at all,
     * also for swiglu_bwd's five buffers (smaller chunks) */
    FA = (failing_alloc){0, 0, 0};
    tp_allocator a = {fa_alloc, fa_free, &FA};
    OK(tp_set_allocator(&a));
    tp_status st = K->gelu_fwd(CPU, TP_F16, nb[0], nb[5], FR * FC, false);
    if (st == TP_OK)
        st = K->swiglu_bwd(CPU, TP_F16, nb[0], nb[4], nb[4], nb[5], ny, FR * FC);
    long attempted = FA.count;
    tp_set_allocator(NULL);
    cr_assert_eq(st, TP_OK);
    cr_assert_eq(attempted, 0);
}

/* attn_softmax in every dtype and chunking (the unit driver hands the kernel
 * row ranges; each row must still find its query and its pad row): 3 blocks
 * of 2 heads x 4 queries over 70 keys, causal with key offset 66; block 1
 * left-padded by 68 keys (its first two queries see nothing), block 2 all
 * padding. */
Test(kernels_dtype, attn_softmax_masks_and_empty_rows, .timeout = 60)
{
    enum { B = 3, NREP = 2, SQ = 4, SK = 70, OFF = 66, ROWS = NREP * SQ };
    double *x = gen(B * ROWS * SK, 48, 4), *r = dzeros(B * ROWS * SK), *s = dzeros(B * ROWS * SK);
    int64_t pad[B * SK];
    for (int b = 0; b < B; b++)
        for (int j = 0; j < SK; j++)
            pad[b * SK + j] = b == 2 ? 0 : b == 1 ? j >= 68 : 1;
    for (int b = 0; b < B; b++)
        for (int q = 0; q < ROWS; q++) {
            const double *xr = x + (b * ROWS + q) * SK;
            double *rr = r + (b * ROWS + q) * SK, mx = -INFINITY, sum = 0;
            for (int j = 0; j < SK; j++)
                if (j <= OFF + q % SQ && pad[b * SK + j])
                    mx = fmax(mx, xr[j]);
            for (int j = 0; j < SK; j++)
                if (j <= OFF + q % SQ && pad[b * SK + j])
                    sum += exp(xr[j] - mx);
            for (int j = 0; j < SK; j++) {
                bool vis = j <= OFF + q % SQ && pad[b * SK + j];
                rr[j] = vis ? exp(xr[j] - mx) / sum : 0;
                s[(b * ROWS + q) * SK + j] = SK * U23 * rr[j];
            }
        }
    FOR_DT(dt)
    {
        void *dx = mk(dt, x, B * ROWS * SK);
        OK(K->attn_softmax(CPU, dt, dx, B, ROWS, SQ, SK, OFF, true, pad, TP_I64, 1));
        expect_close("attn_softmax", dt, dx, r, s, B * ROWS * SK);
    }
}

/* ---- rotary position embedding ------------------------------------------------------------ */

/* y (or, bwd, gx) of the rotary embedding in double and the sums of the
 * absolute terms times 2 U23 (two f32 roundings before the dtype's one). */
static void rope_ref(const double *x, const double *c, const double *s, double *y, double *slack,
                     int64_t B, int64_t H, int64_t S, int64_t D, int64_t cbs, bool bwd)
{
    const int64_t h = D / 2;
    for (int64_t b = 0; b < B; b++)
        for (int64_t r = 0; r < H * S; r++) {
            const int64_t e = (b * H * S + r) * D, ce = b * cbs + (r % S) * D;
            for (int64_t i = 0; i < D; i++) {
                double o = i < h ? (bwd ? x[e + i + h] * s[ce + i + h] : -x[e + i + h] * s[ce + i])
                                 : (bwd ? -x[e + i - h] * s[ce + i - h] : x[e + i - h] * s[ce + i]);
                y[e + i] = x[e + i] * c[ce + i] + o;
                slack[e + i] = 2 * U23 * (fabs(x[e + i] * c[ce + i]) + fabs(o));
            }
        }
}

/* Whole rows through the stack (head dim 16: 64 rows a chunk, S = 70 leaves
 * a tail), a head dim wider than the stack chunk (2200: pairs 512 at a time,
 * a tail of 76), cos per batch and broadcast, in place; no allocation. */
Test(kernels_dtype, rope_fwd_bwd_rows_wide_rows_and_in_place, .timeout = 60)
{
    static const int64_t shapes[2][4] = {{2, 3, 70, 16}, {2, 2, 3, 2200}};
    for (int k = 0; k < 2; k++) {
        const int64_t B = shapes[k][0], H = shapes[k][1], S = shapes[k][2], D = shapes[k][3];
        const int64_t n = B * H * S * D, nc = B * S * D;
        double *x = gen(n, 61, 1), *c = gen(nc, 62, 1), *s = gen(nc, 63, 1);
        double *r = dzeros(n), *sl = dzeros(n);
        FOR_DT(dt)
        {
            for (int bwd = 0; bwd < 2; bwd++)
                for (int bc = 0; bc < 2; bc++) {
                    const int64_t cbs = bc ? 0 : S * D;
                    void *dx = mk(dt, x, n), *dc = mk(dt, c, nc), *ds = mk(dt, s, nc);
                    void *y = mk(dt, NULL, n);
                    FA = (failing_alloc){0, 0, -1};
                    tp_allocator a = {fa_alloc, fa_free, &FA};
                    OK(tp_set_allocator(&a));
                    tp_status st = bwd ? K->rope_bwd(CPU, dt, dx, dc, ds, y, B, H, S, D, cbs)
                                       : K->rope_fwd(CPU, dt, dx, dc, ds, y, B, H, S, D, cbs);
                    tp_set_allocator(NULL);
                    OK(st);
                    cr_assert_eq(FA.count, 0, "the rotary embedding allocated");
                    rope_ref(x, c, s, r, sl, B, H, S, D, cbs, bwd);
                    expect_close(bwd ? "rope_bwd" : "rope_fwd", dt, y, r, sl, n);
                    OK(bwd ? K->rope_bwd(CPU, dt, dx, dc, ds, dx, B, H, S, D, cbs)
                           : K->rope_fwd(CPU, dt, dx, dc, ds, dx, B, H, S, D, cbs));
                    cr_assert(!memcmp(dx, y, (size_t)n * tp_dtype_size(dt)), "in place differs");
                }
        }
    }
}

/* cos and sin of the f32 angle, rounded to f32 and then once to the dtype,
 * both halves, for angles up to 1e5 rad; a head dim past the stack chunk. */
Test(kernels_dtype, rope_cos_sin_both_halves, .timeout = 60)
{
    enum { N = 9, D = 1030, H2 = D / 2 };
    int64_t pos[N];
    float inv[H2];
    for (int i = 0; i < N; i++)
        pos[i] = (int64_t)(tp_rng_uniform(64, (uint64_t)i) * 100001.0);
    for (int i = 0; i < H2; i++)
        inv[i] = (float)pow(10000.0, -2.0 * i / D);
    double *rc = dzeros(N * D), *rs = dzeros(N * D), *slc = dzeros(N * D), *sls = dzeros(N * D);
    for (int r = 0; r < N; r++)
        for (int i = 0; i < D; i++) {
            float f = (float)pos[r] * inv[i % H2];
            rc[r * D + i] = 0.75 * cos((double)f);
            rs[r * D + i] = 0.75 * sin((double)f);
            slc[r * D + i] = 0x1p-23 * fabs(rc[r * D + i]); /* the f32 value's roundings */
            sls[r * D + i] = 0x1p-23 * fabs(rs[r * D + i]);
        }
    FOR_DT(dt)
    {
        void *co = mk(dt, NULL, N * D), *si = mk(dt, NULL, N * D);
        OK(K->rope_cos_sin(CPU, dt, pos, inv, co, si, N, D, 0.75f));
        expect_close("rope_cos_sin cos", dt, co, rc, slc, N * D);
        expect_close("rope_cos_sin sin", dt, si, rs, sls, N * D);
        for (int r = 0; r < N; r++)
            cr_assert(!memcmp((char *)co + (size_t)(r * D) * tp_dtype_size(dt),
                              (char *)co + (size_t)(r * D + H2) * tp_dtype_size(dt),
                              (size_t)H2 * tp_dtype_size(dt)),
                      "%s: the halves of row %d differ", tp_dtype_name(dt), r);
    }
}
