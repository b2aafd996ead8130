/* Local CPU kernels (src/kernels/cpu.c): every kernel against a naive
 * double-precision reference, every backward kernel against central finite
 * differences of the reference forward and against an analytic reference, and
 * the properties the op layer builds on (accumulate vs overwrite, dropout masks
 * per global element, the vocab-parallel cross-entropy pieces).
 *
 * Single-threaded: no ranks here. Inputs come from tp_rng_uniform with fixed
 * seeds; sizes are odd (1, 3, 17, 129) so no vector width divides them. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tp_test.h"

/* The kernels are internal: libtp.so is built with hidden visibility, so this
 * test cannot link them from the library. It compiles the kernel source into
 * its own executable instead, which therefore needs OpenBLAS and `-I src`
 * (tests/meson.build); the public tp_rng_uniform the dropout tests compare the
 * kernel's inlined Philox with still comes from libtp. */
#include "../src/kernels/cpu.c"

/* ---- helpers ------------------------------------------------------------------ */

static float *falloc(int64_t n)
{
    float *p = malloc((size_t)(n > 0 ? n : 1) * sizeof *p);
    cr_assert_not_null(p);
    return p;
}

static double *dalloc(int64_t n)
{
    double *p = calloc((size_t)(n > 0 ? n : 1), sizeof *p);
    cr_assert_not_null(p);
    return p;
}

/* x[i] uniform in [lo, hi) from (seed, i) */
static void fill(float *x, int64_t n, uint64_t seed, double lo, double hi)
{
    for (int64_t i = 0; i < n; i++)
        x[i] = (float)(lo + (hi - lo) * tp_rng_uniform(seed, (uint64_t)i));
}

static void fill_const(float *x, int64_t n, float v)
{
    for (int64_t i = 0; i < n; i++)
        x[i] = v;
}

static void to_double(const float *x, double *d, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        d[i] = (double)x[i];
}

static double maxabs(const double *x, int64_t n)
{
    double m = 0;
    for (int64_t i = 0; i < n; i++)
        m = fmax(m, fabs(x[i]));
    return m;
}

/* |got - want| <= atol + rtol * |want| for every element (NaN fails). */
static void check_close(const char *what, const float *got, const double *want, int64_t n,
                        double rtol, double atol)
{
    for (int64_t i = 0; i < n; i++) {
        double err = fabs((double)got[i] - want[i]);
        cr_assert(err <= atol + rtol * fabs(want[i]),
                  "%s: element %lld: got %.9g, want %.9g (err %.3g)", what, (long long)i,
                  (double)got[i], want[i], err);
    }
}

/* Gradient-style check: the absolute part of the bound scales with the
 * largest expected magnitude, so entries that cancel to ~0 are judged on the
 * scale of the whole gradient. */
static void check_grad(const char *what, const float *got, const double *want, int64_t n,
                       double tol)
{
    check_close(what, got, want, n, tol, tol * maxabs(want, n) + 1e-30);
}

/* The same with a floor on the scale: where the exact gradient is much smaller
 * than the terms it is computed from (cancellation), float rounding is judged
 * against those terms. */
static void check_grad_scaled(const char *what, const float *got, const double *want, int64_t n,
                              double tol, double scale)
{
    check_close(what, got, want, n, tol, tol * fmax(maxabs(want, n), scale) + 1e-30);
}

static void check_same(const char *what, const float *got, const float *want, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        cr_assert(got[i] == want[i] || (isnan(got[i]) && isnan(want[i])),
                  "%s: element %lld: got %.9g, want %.9g", what, (long long)i, (double)got[i],
                  (double)want[i]);
}

/* ---- finite differences ------------------------------------------------------------
 * A loss is sum_i R_i y_i(params) computed by a double reference forward; its
 * gradient is what the backward kernel returns for gy = R. */

typedef double (*loss_fn)(void *ctx);

#define FD_H 1e-5

/* Central differences of loss(ctx) in each element of `param` (which the loss
 * reads through ctx) against the kernel's gradient: |fd - grad| <= tol (|fd| +
 * max(max |grad|, scale)) + 1e-7, scale as in check_grad_scaled. */
static void check_fd_scaled(const char *what, loss_fn loss, void *ctx, double *param, int64_t n,
                            const float *grad, double tol, double scale)
{
    double gmax = scale;
    for (int64_t i = 0; i < n; i++)
        gmax = fmax(gmax, fabs((double)grad[i]));
    for (int64_t i = 0; i < n; i++) {
        double save = param[i];
        param[i] = save + FD_H;
        double lp = loss(ctx);
        param[i] = save - FD_H;
        double lm = loss(ctx);
        param[i] = save;
        double fd = (lp - lm) / (2 * FD_H);
        double err = fabs(fd - (double)grad[i]);
        cr_assert(err <= tol * (fabs(fd) + gmax) + 1e-7,
                  "%s: finite difference at %lld: kernel %.9g, fd %.9g (err %.3g)", what,
                  (long long)i, (double)grad[i], fd, err);
    }
}

static void check_fd(const char *what, loss_fn loss, void *ctx, double *param, int64_t n,
                     const float *grad, double tol)
{
    check_fd_scaled(what, loss, ctx, param, n, grad, tol, 0.0);
}

static double dot_d(const double *a, const double *b, int64_t n)
{
    double s = 0;
    for (int64_t i = 0; i < n; i++)
        s += a[i] * b[i];
    return s;
}

/* ---- gemm / linear ------------------------------------------------------------------ */

static const int64_t odd_sizes[] = {1, 3, 17, 129};
#define N_ODD 4

/* c = alpha op(a) op(b) + beta c0 in double; bound = the sum of magnitudes */
static void ref_gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, double alpha,
                     const float *a, int64_t lda, const float *b, int64_t ldb, double beta,
                     const float *c0, int64_t ldc, double *c, double *bound)
{
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++) {
            double s = 0, sb = 0;
            for (int64_t p = 0; p < k; p++) {
                double av = ta ? a[p * lda + i] : a[i * lda + p];
                double bv = tb ? b[j * ldb + p] : b[p * ldb + j];
                s += av * bv;
                sb += fabs(av * bv);
            }
            double cv = beta != 0.0 ? beta * c0[i * ldc + j] : 0.0;
            c[i * n + j] = alpha * s + cv;
            bound[i * n + j] = fabs(alpha) * sb + fabs(cv);
        }
}

Test(kernels, gemm_all_transposes_and_leading_dims, .timeout = 60)
{
    static const int64_t mnk[][3] = {
        {1, 1, 1}, {3, 17, 5}, {17, 3, 129}, {129, 17, 3}, {1, 129, 17}, {17, 1, 1},
        {1, 1000, 300}, {300, 1, 40}, {1, 7, 1}, /* matrix-vector products (sgemv) */
    };
    for (size_t s = 0; s < sizeof mnk / sizeof mnk[0]; s++)
        for (int t = 0; t < 4; t++)
            for (int bi = 0; bi < 2; bi++) {
                bool ta = t & 1, tb = t & 2;
                int64_t m = mnk[s][0], n = mnk[s][1], k = mnk[s][2];
                /* stored shapes, each row padded by 2 to exercise the leading dims */
                int64_t ar = ta ? k : m, ac = ta ? m : k, br = tb ? n : k, bc = tb ? k : n;
                int64_t lda = ac + 2, ldb = bc + 2, ldc = n + 2;
                float alpha = 0.5f, beta = bi ? 1.5f : 0.0f;
                float *a = falloc(ar * lda), *b = falloc(br * ldb), *c = falloc(m * ldc);
                float *c0 = falloc(m * ldc);
                double *want = dalloc(m * n), *bound = dalloc(m * n);
                fill(a, ar * lda, 1 + s, -1, 1);
                fill(b, br * ldb, 2 + s, -1, 1);
                fill(c0, m * ldc, 3 + s, -1, 1);
                if (!bi) /* beta == 0 overwrites: garbage in C must not leak */
                    for (int64_t i = 0; i < m; i++)
                        for (int64_t j = 0; j < n; j++)
                            c0[i * ldc + j] = NAN;
                memcpy(c, c0, (size_t)(m * ldc) * sizeof *c);
                tp__k_gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
                ref_gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c0, ldc, want, bound);
                for (int64_t i = 0; i < m; i++) {
                    for (int64_t j = 0; j < n; j++) {
                        double err = fabs((double)c[i * ldc + j] - want[i * n + j]);
                        cr_assert(err <= 1e-5 * bound[i * n + j] + 1e-7,
                                  "gemm ta=%d tb=%d m=%lld n=%lld k=%lld beta=%g: C[%lld,%lld] "
                                  "= %.9g, want %.9g",
                                  ta, tb, (long long)m, (long long)n, (long long)k, beta,
                                  (long long)i, (long long)j, (double)c[i * ldc + j],
                                  want[i * n + j]);
                    }
                    for (int64_t j = n; j < ldc; j++) /* padding untouched */
                        cr_assert(memcmp(&c[i * ldc + j], &c0[i * ldc + j], sizeof *c) == 0);
                }
                free(a), free(b), free(c), free(c0), free(want), free(bound);
            }
}

Test(kernels, gemm_empty_inner_dim_scales_c, .timeout = 30)
{
    float c[6] = {1, 2, 3, 4, 5, 6};
    tp__k_gemm(false, false, 2, 3, 0, 1.0f, NULL, 0, NULL, 3, 2.0f, c, 3);
    for (int i = 0; i < 6; i++)
        cr_assert_eq(c[i], 2.0f * (float)(i + 1));
    c[4] = NAN;
    tp__k_gemm(true, true, 2, 3, 0, 1.0f, NULL, 2, NULL, 0, 0.0f, c, 3);
    for (int i = 0; i < 6; i++)
        cr_assert_eq(c[i], 0.0f);
    tp__k_gemm(false, false, 0, 3, 4, 1.0f, NULL, 4, NULL, 3, 0.0f, NULL, 3); /* no rows */
}

static void ref_linear(const double *x, const double *w, const double *b, double *y, int64_t rows,
                       int64_t in, int64_t out)
{
    for (int64_t r = 0; r < rows; r++)
        for (int64_t o = 0; o < out; o++) {
            double s = b ? b[o] : 0.0;
            for (int64_t i = 0; i < in; i++)
                s += x[r * in + i] * w[o * in + i];
            y[r * out + o] = s;
        }
}

Test(kernels, linear_fwd_matches_reference, .timeout = 60)
{
    for (int ri = 0; ri < 3; ri++)
        for (int ii = 0; ii < N_ODD; ii++)
            for (int oi = 0; oi < 3; oi++)
                for (int hb = 0; hb < 2; hb++) {
                    int64_t rows = odd_sizes[ri], in = odd_sizes[ii], out = odd_sizes[oi];
                    float *x = falloc(rows * in), *w = falloc(out * in), *b = falloc(out);
                    float *y = falloc(rows * out);
                    double *xd = dalloc(rows * in), *wd = dalloc(out * in), *bd = dalloc(out);
                    double *yd = dalloc(rows * out);
                    fill(x, rows * in, 10, -1, 1);
                    fill(w, out * in, 11, -1, 1);
                    fill(b, out, 12, -1, 1);
                    fill_const(y, rows * out, NAN);
                    to_double(x, xd, rows * in);
                    to_double(w, wd, out * in);
                    to_double(b, bd, out);
                    tp__k_linear_fwd(x, w, hb ? b : NULL, y, rows, in, out);
                    ref_linear(xd, wd, hb ? bd : NULL, yd, rows, in, out);
                    char what[96];
                    snprintf(what, sizeof what, "linear_fwd rows=%lld in=%lld out=%lld bias=%d",
                             (long long)rows, (long long)in, (long long)out, hb);
                    /* |x|,|w| <= 1: the error bound grows with in */
                    check_close(what, y, yd, rows * out, 1e-5, 1e-6 * (double)(in + 1));
                    free(x), free(w), free(b), free(y), free(xd), free(wd), free(bd), free(yd);
                }
}

typedef struct linear_ctx {
    int64_t rows, in, out;
    double *x, *w, *b, *r, *y;
} linear_ctx;

static double linear_loss(void *p)
{
    linear_ctx *c = p;
    ref_linear(c->x, c->w, c->b, c->y, c->rows, c->in, c->out);
    return dot_d(c->r, c->y, c->rows * c->out);
}

static void ref_linear_bwd(const double *x, const double *w, const double *gy, double *gx,
                           double *gw, double *gb, int64_t rows, int64_t in, int64_t out)
{
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < in; i++) {
            double s = 0;
            for (int64_t o = 0; o < out; o++)
                s += gy[r * out + o] * w[o * in + i];
            gx[r * in + i] = s;
        }
    for (int64_t o = 0; o < out; o++) {
        double sb = 0;
        for (int64_t i = 0; i < in; i++) {
            double s = 0;
            for (int64_t r = 0; r < rows; r++)
                s += gy[r * out + o] * x[r * in + i];
            gw[o * in + i] = s;
        }
        for (int64_t r = 0; r < rows; r++)
            sb += gy[r * out + o];
        gb[o] = sb;
    }
}

Test(kernels, linear_bwd_reference_fd_and_accumulate, .timeout = 60)
{
    static const int64_t dims[][3] = {{1, 1, 1}, {3, 17, 3}, {17, 3, 129}, {129, 17, 1}, {5, 4, 3}};
    for (size_t s = 0; s < sizeof dims / sizeof dims[0]; s++) {
        int64_t rows = dims[s][0], in = dims[s][1], out = dims[s][2];
        int64_t nx = rows * in, nw = out * in, ny = rows * out;
        float *x = falloc(nx), *w = falloc(nw), *gy = falloc(ny);
        float *gx = falloc(nx), *gw = falloc(nw), *gb = falloc(out);
        float *px = falloc(nx), *pw = falloc(nw), *pb = falloc(out);
        double *xd = dalloc(nx), *wd = dalloc(nw), *bd = dalloc(out), *rd = dalloc(ny);
        double *yd = dalloc(ny), *gxd = dalloc(nx), *gwd = dalloc(nw), *gbd = dalloc(out);
        fill(x, nx, 20 + s, -1, 1);
        fill(w, nw, 21 + s, -1, 1);
        fill(gy, ny, 22 + s, -1, 1);
        fill(px, nx, 23, -5, 5);
        fill(pw, nw, 24, -5, 5);
        fill(pb, out, 25, -5, 5);
        to_double(x, xd, nx);
        to_double(w, wd, nw);
        to_double(gy, rd, ny);
        ref_linear_bwd(xd, wd, rd, gxd, gwd, gbd, rows, in, out);
        char what[96];

        /* overwrite: NaN garbage in the outputs must not survive */
        fill_const(gx, nx, NAN);
        fill_const(gw, nw, NAN);
        fill_const(gb, out, NAN);
        tp__k_linear_bwd(x, w, gy, gx, gw, gb, rows, in, out, false);
        snprintf(what, sizeof what, "linear_bwd rows=%lld in=%lld out=%lld", (long long)rows,
                 (long long)in, (long long)out);
        check_grad(what, gx, gxd, nx, 1e-5);
        check_grad(what, gw, gwd, nw, 1e-5);
        check_grad(what, gb, gbd, out, 1e-5);

        if (nx * nw <= 4096) {
            linear_ctx c = {rows, in, out, xd, wd, bd, rd, yd};
            check_fd("linear_bwd gx vs fd", linear_loss, &c, xd, nx, gx, 1e-4);
            check_fd("linear_bwd gw vs fd", linear_loss, &c, wd, nw, gw, 1e-4);
            check_fd("linear_bwd gb vs fd", linear_loss, &c, bd, out, gb, 1e-4);
        }

        /* accumulate: added onto what was there */
        memcpy(gx, px, (size_t)nx * sizeof *gx);
        memcpy(gw, pw, (size_t)nw * sizeof *gw);
        memcpy(gb, pb, (size_t)out * sizeof *gb);
        tp__k_linear_bwd(x, w, gy, gx, gw, gb, rows, in, out, true);
        for (int64_t i = 0; i < nx; i++)
            gxd[i] += px[i];
        for (int64_t i = 0; i < nw; i++)
            gwd[i] += pw[i];
        for (int64_t i = 0; i < out; i++)
            gbd[i] += pb[i];
        check_grad("linear_bwd accumulate gx", gx, gxd, nx, 1e-5);
        check_grad("linear_bwd accumulate gw", gw, gwd, nw, 1e-5);
        check_grad("linear_bwd accumulate gb", gb, gbd, out, 1e-5);

        /* NULL outputs are skipped, the others still computed */
        float *gx2 = falloc(nx), *gb2 = falloc(out);
        tp__k_linear_bwd(x, w, gy, gx2, NULL, NULL, rows, in, out, false);
        ref_linear_bwd(xd, wd, rd, gxd, gwd, gbd, rows, in, out);
        check_grad("linear_bwd gx only", gx2, gxd, nx, 1e-5);
        tp__k_linear_bwd(x, w, gy, NULL, NULL, gb2, rows, in, out, false);
        check_grad("linear_bwd gb only", gb2, gbd, out, 1e-5);

        free(x), free(w), free(gy), free(gx), free(gw), free(gb), free(px), free(pw), free(pb);
        free(xd), free(wd), free(bd), free(rd), free(yd), free(gxd), free(gwd), free(gbd);
        free(gx2), free(gb2);
    }
}

/* ---- elementwise ------------------------------------------------------------------- */

Test(kernels, elementwise_add_mul_scale_accumulate, .timeout = 30)
{
    for (int si = 0; si < N_ODD; si++) {
        int64_t n = odd_sizes[si];
        float *a = falloc(n), *b = falloc(n), *y = falloc(n), *want = falloc(n);
        fill(a, n, 30, -3, 3);
        fill(b, n, 31, -3, 3);
        /* single float operations: the results are exact */
        tp__k_add(a, b, y, n);
        for (int64_t i = 0; i < n; i++)
            want[i] = a[i] + b[i];
        check_same("add", y, want, n);
        tp__k_mul(a, b, y, n);
        for (int64_t i = 0; i < n; i++)
            want[i] = a[i] * b[i];
        check_same("mul", y, want, n);
        tp__k_scale(a, -0.375f, y, n);
        for (int64_t i = 0; i < n; i++)
            want[i] = a[i] * -0.375f;
        check_same("scale", y, want, n);
        memcpy(y, b, (size_t)n * sizeof *y);
        tp__k_accumulate(y, a, n);
        for (int64_t i = 0; i < n; i++)
            want[i] = b[i] + a[i];
        check_same("accumulate", y, want, n);

        /* in place: the output is one of the inputs */
        memcpy(y, a, (size_t)n * sizeof *y);
        tp__k_add(y, b, y, n);
        for (int64_t i = 0; i < n; i++)
            want[i] = a[i] + b[i];
        check_same("add in place", y, want, n);
        memcpy(y, b, (size_t)n * sizeof *y);
        tp__k_mul(a, y, y, n);
        for (int64_t i = 0; i < n; i++)
            want[i] = a[i] * b[i];
        check_same("mul in place", y, want, n);
        memcpy(y, a, (size_t)n * sizeof *y);
        tp__k_scale(y, 2.0f, y, n);
        for (int64_t i = 0; i < n; i++)
            want[i] = a[i] * 2.0f;
        check_same("scale in place", y, want, n);
        free(a), free(b), free(y), free(want);
    }
    tp__k_add(NULL, NULL, NULL, 0); /* n == 0 touches nothing */
}

Test(kernels, add_row, .timeout = 30)
{
    for (int ri = 0; ri < N_ODD; ri++)
        for (int ci = 0; ci < N_ODD; ci++) {
            int64_t rows = odd_sizes[ri], cols = odd_sizes[ci];
            float *y = falloc(rows * cols), *b = falloc(cols), *y0 = falloc(rows * cols);
            float *want = falloc(rows * cols);
            fill(y0, rows * cols, 40, -1, 1);
            fill(b, cols, 41, -1, 1);
            memcpy(y, y0, (size_t)(rows * cols) * sizeof *y);
            tp__k_add_row(y, b, rows, cols);
            for (int64_t r = 0; r < rows; r++)
                for (int64_t c = 0; c < cols; c++)
                    want[r * cols + c] = y0[r * cols + c] + b[c];
            check_same("add_row", y, want, rows * cols);
            free(y), free(b), free(y0), free(want);
        }
}

/* ---- broadcasting ------------------------------------------------------------------ */

/* One layout of the broadcast kernels: y's shape and the operands' element
 * strides (0: broadcast), as the op layer passes them (merged or not). */
typedef struct bcast_layout {
    const char *name;
    int ndim;
    int64_t shape[4], as[4], bs[4];
} bcast_layout;

/* The largest offset + 1 a layout reads through strides st. */
static int64_t span(const bcast_layout *l, const int64_t *st)
{
    int64_t m = 0;
    for (int d = 0; d < l->ndim; d++)
        if (l->shape[d] > 0)
            m += (l->shape[d] - 1) * st[d];
    return m + 1;
}

Test(kernels, add_mul_bcast_every_layout, .timeout = 30)
{
    static const bcast_layout layouts[] = {
        {"same shape, merged", 1, {129}, {1}, {1}},
        {"same shape, unmerged", 3, {3, 5, 17}, {85, 17, 1}, {85, 17, 1}},
        {"row broadcast [17,129] + [129]", 2, {17, 129}, {129, 1}, {0, 1}},
        {"row broadcast, a the row", 2, {17, 3}, {0, 1}, {3, 1}},
        {"column broadcast [17,129] + [17,1]", 2, {17, 129}, {129, 1}, {1, 0}},
        {"scalar b", 1, {129}, {1}, {0}},
        {"scalar a", 1, {17}, {0}, {1}},
        {"outer broadcast [3,85] + [85]", 2, {3, 85}, {85, 1}, {0, 1}},
        {"[3,1,17] * [1,5,1]", 3, {3, 5, 17}, {17, 0, 1}, {0, 1, 0}},
        {"[3,5,1] + [1,1,17] unmerged", 3, {3, 5, 17}, {5, 1, 0}, {0, 0, 1}},
        {"a transposed (strided)", 2, {5, 17}, {1, 5}, {17, 1}},
        {"every other element, b strided", 2, {3, 17}, {34, 2}, {0, 3}},
        {"4 dims, mixed", 4, {2, 3, 1, 5}, {15, 5, 5, 1}, {0, 1, 0, 3}},
        {"one element (0 dims)", 0, {0}, {0}, {0}},
        {"size-1 dims", 3, {1, 1, 7}, {7, 7, 1}, {0, 0, 1}},
    };
    for (size_t k = 0; k < sizeof layouts / sizeof layouts[0]; k++) {
        const bcast_layout *l = &layouts[k];
        int64_t n = 1;
        for (int d = 0; d < l->ndim; d++)
            n *= l->shape[d];
        int64_t na = span(l, l->as), nb = span(l, l->bs);
        float *a = falloc(na), *b = falloc(nb), *y = falloc(n), *want = falloc(n);
        fill(a, na, 50 + k, -3, 3);
        fill(b, nb, 60 + k, -3, 3);
        for (int mul = 0; mul < 2; mul++) {
            for (int64_t i = 0; i < n; i++) {
                int64_t rem = i, oa = 0, ob = 0;
                for (int d = l->ndim - 1; d >= 0; d--) {
                    oa += (rem % l->shape[d]) * l->as[d];
                    ob += (rem % l->shape[d]) * l->bs[d];
                    rem /= l->shape[d];
                }
                want[i] = mul ? a[oa] * b[ob] : a[oa] + b[ob];
            }
            fill_const(y, n, NAN);
            if (mul)
                tp__k_mul_bcast(a, b, y, l->ndim, l->shape, l->as, l->bs);
            else
                tp__k_add_bcast(a, b, y, l->ndim, l->shape, l->as, l->bs);
            char what[96];
            snprintf(what, sizeof what, "%s %s", mul ? "mul" : "add", l->name);
            check_same(what, y, want, n); /* one float operation: exact */
        }
        free(a), free(b), free(y), free(want);
    }
    /* in place: y is a (same shape, contiguous), b a broadcast row */
    int64_t shape[2] = {17, 129}, as[2] = {129, 1}, bs[2] = {0, 1}, n = 17 * 129;
    float *a = falloc(n), *b = falloc(129), *want = falloc(n);
    fill(a, n, 80, -3, 3);
    fill(b, 129, 81, -3, 3);
    for (int64_t i = 0; i < n; i++)
        want[i] = a[i] + b[i % 129];
    tp__k_add_bcast(a, b, a, 2, shape, as, bs);
    check_same("add_bcast in place", a, want, n);
    free(a), free(b), free(want);
    /* an empty dim writes nothing */
    float sentinel = 42.0f, one = 1.0f;
    int64_t zshape[3] = {3, 0, 2}, zs[3] = {0, 0, 0};
    tp__k_mul_bcast(&one, &one, &sentinel, 3, zshape, zs, zs);
    cr_assert_eq(sentinel, 42.0f, "an empty broadcast wrote an element");
}

Test(kernels, sum_bcast_every_pattern, .timeout = 30)
{
    /* x's shape and y's (1 where summed) */
    static const struct {
        int ndim;
        int64_t shape[4], yshape[4];
    } cases[] = {
        {2, {129, 17}, {1, 17}},         /* bias: column sums */
        {2, {17, 129}, {17, 1}},         /* row sums */
        {2, {17, 129}, {1, 1}},          /* everything */
        {1, {129}, {1}},                 /* everything, 1 dim */
        {3, {3, 5, 17}, {1, 5, 1}},      /* two summed blocks */
        {3, {3, 5, 17}, {3, 1, 17}},     /* the middle dim */
        {3, {3, 5, 17}, {1, 1, 17}},     /* the two outer dims */
        {3, {3, 5, 17}, {3, 5, 1}},      /* the inner dim */
        {3, {3, 5, 17}, {1, 5, 17}},     /* the outer dim */
        {3, {3, 5, 17}, {3, 5, 17}},     /* nothing: a copy */
        {3, {3, 1, 17}, {1, 1, 17}},     /* a size-1 dim between */
        {4, {2, 3, 5, 7}, {2, 1, 5, 1}}, /* kept, summed, kept, summed */
        {4, {2, 3, 5, 7}, {1, 3, 1, 7}}, /* summed, kept, summed, kept */
        {2, {3, 1300}, {1, 1300}},       /* wider than one accumulator block */
        {3, {2, 3, 1300}, {2, 1, 1300}},
        {0, {0}, {0}},                   /* one element */
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        int nd = cases[k].ndim;
        const int64_t *sh = cases[k].shape, *ys = cases[k].yshape;
        int64_t n = 1, ny = 1;
        for (int d = 0; d < nd; d++) {
            n *= sh[d];
            ny *= ys[d];
        }
        float *x = falloc(n), *y = falloc(ny);
        double *want = dalloc(ny);
        fill(x, n, 90 + k, -1, 1);
        for (int64_t i = 0; i < n; i++) {
            int64_t rem = i, j = 0, st = 1;
            for (int d = nd - 1; d >= 0; d--) {
                int64_t id = rem % sh[d];
                rem /= sh[d];
                j += (ys[d] == 1 ? 0 : id) * st;
                st *= ys[d];
            }
            want[j] += x[i];
        }
        fill_const(y, ny, NAN); /* overwritten */
        tp__k_sum_bcast(x, y, nd, sh, ys);
        char what[64];
        snprintf(what, sizeof what, "sum_bcast case %zu", k);
        check_close(what, y, want, ny, 1e-6, 1e-6);
        free(x), free(y), free(want);
    }
    /* a summed dim of size 0 gives zeros; an empty y is not written */
    float y[12], x0 = 0.0f;
    fill_const(y, 12, NAN);
    tp__k_sum_bcast(&x0, y, 3, (int64_t[]){3, 0, 4}, (int64_t[]){3, 1, 4});
    for (int i = 0; i < 12; i++)
        cr_assert_eq(y[i], 0.0f, "sum over an empty dim: y[%d] = %g", i, (double)y[i]);
    y[0] = 42.0f;
    tp__k_sum_bcast(&x0, y, 2, (int64_t[]){0, 4}, (int64_t[]){0, 1});
    cr_assert_eq(y[0], 42.0f, "an empty sum_bcast wrote an element");
}

typedef struct act_ctx {
    int64_t n;
    int kind; /* 0 relu, 1 gelu exact, 2 gelu tanh */
    double *x, *r;
} act_ctx;

static double ref_gelu(double v, bool tanh_approx)
{
    if (tanh_approx)
        return 0.5 * v * (1.0 + tanh(sqrt(2.0 / M_PI) * (v + 0.044715 * v * v * v)));
    return 0.5 * v * (1.0 + erf(v / sqrt(2.0)));
}

static double ref_gelu_grad(double v, bool tanh_approx)
{
    if (tanh_approx) {
        double k = sqrt(2.0 / M_PI), u = k * (v + 0.044715 * v * v * v), t = tanh(u);
        return 0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * v * v);
    }
    return 0.5 * (1.0 + erf(v / sqrt(2.0))) + v * exp(-0.5 * v * v) / sqrt(2.0 * M_PI);
}

static double act_loss(void *p)
{
    act_ctx *c = p;
    double s = 0;
    for (int64_t i = 0; i < c->n; i++) {
        double v = c->x[i];
        double y = c->kind == 0 ? (v > 0 ? v : 0) : ref_gelu(v, c->kind == 2);
        s += c->r[i] * y;
    }
    return s;
}

Test(kernels, relu_fwd_bwd, .timeout = 30)
{
    for (int si = 0; si < N_ODD; si++) {
        int64_t n = odd_sizes[si];
        float *x = falloc(n), *y = falloc(n), *gy = falloc(n), *gx = falloc(n), *want = falloc(n);
        double *xd = dalloc(n), *rd = dalloc(n);
        fill(x, n, 50, -2, 2);
        /* keep |x| >= 0.1: the finite difference is not taken across the kink */
        for (int64_t i = 0; i < n; i++)
            if (fabsf(x[i]) < 0.1f)
                x[i] = x[i] < 0 ? -0.5f : 0.5f;
        if (n > 2)
            x[1] = 0.0f; /* relu(0) = 0, gradient 0 (x > 0 is false) */
        fill(gy, n, 51, -1, 1);
        tp__k_relu_fwd(x, y, n);
        for (int64_t i = 0; i < n; i++)
            want[i] = x[i] > 0 ? x[i] : 0.0f;
        check_same("relu_fwd", y, want, n);
        tp__k_relu_bwd(x, gy, gx, n);
        for (int64_t i = 0; i < n; i++)
            want[i] = x[i] > 0 ? gy[i] : 0.0f;
        check_same("relu_bwd", gx, want, n);
        if (n > 2) { /* the finite difference away from the kink */
            x[1] = 0.5f;
            tp__k_relu_bwd(x, gy, gx, n);
        }
        to_double(x, xd, n);
        to_double(gy, rd, n);
        act_ctx c = {n, 0, xd, rd};
        check_fd("relu_bwd vs fd", act_loss, &c, xd, n, gx, 1e-6);
        memcpy(y, x, (size_t)n * sizeof *y); /* in place */
        tp__k_relu_fwd(y, y, n);
        tp__k_relu_fwd(x, want, n);
        check_same("relu_fwd in place", y, want, n);
        free(x), free(y), free(gy), free(gx), free(want), free(xd), free(rd);
    }
}

Test(kernels, gelu_exact_and_tanh_fwd_bwd, .timeout = 30)
{
    for (int approx = 0; approx < 2; approx++)
        for (int si = 0; si < N_ODD; si++) {
            int64_t n = odd_sizes[si] + 4;
            float *x = falloc(n), *y = falloc(n), *gy = falloc(n), *gx = falloc(n);
            double *xd = dalloc(n), *rd = dalloc(n), *want = dalloc(n);
            fill(x, n, 60 + approx, -6, 6);
            x[0] = 0.0f, x[1] = -10.0f, x[2] = 10.0f, x[3] = -1e-3f; /* edges */
            fill(gy, n, 62, -1, 1);
            to_double(x, xd, n);
            to_double(gy, rd, n);
            char what[64];
            tp__k_gelu_fwd(x, y, n, approx);
            for (int64_t i = 0; i < n; i++)
                want[i] = ref_gelu(xd[i], approx);
            snprintf(what, sizeof what, "gelu_fwd approx=%d n=%lld", approx, (long long)n);
            check_close(what, y, want, n, 1e-5, 1e-6);
            tp__k_gelu_bwd(x, gy, gx, n, approx);
            for (int64_t i = 0; i < n; i++)
                want[i] = rd[i] * ref_gelu_grad(xd[i], approx);
            snprintf(what, sizeof what, "gelu_bwd approx=%d n=%lld", approx, (long long)n);
            check_close(what, gx, want, n, 1e-5, 1e-6);
            act_ctx c = {n, approx ? 2 : 1, xd, rd};
            check_fd(what, act_loss, &c, xd, n, gx, 1e-5);
            /* in place: gx over gy */
            float *g2 = falloc(n);
            memcpy(g2, gy, (size_t)n * sizeof *g2);
            tp__k_gelu_bwd(x, g2, g2, n, approx);
            check_same("gelu_bwd in place", g2, gx, n);
            free(x), free(y), free(gy), free(gx), free(xd), free(rd), free(want), free(g2);
        }
}

/* ---- reductions ----------------------------------------------------------------------- */

Test(kernels, sum_dim_all_layouts, .timeout = 30)
{
    static const int64_t shapes[][3] = {
        {1, 1, 1}, {1, 129, 1}, {3, 17, 1}, {1, 17, 3}, {3, 1, 17}, {17, 3, 129}, {2, 5, 1300},
    };
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        int64_t outer = shapes[s][0], size = shapes[s][1], inner = shapes[s][2];
        int64_t n = outer * size * inner, ny = outer * inner;
        float *x = falloc(n), *y = falloc(ny), *gy = falloc(ny), *gx = falloc(n);
        float *wantf = falloc(n);
        double *want = dalloc(ny);
        fill(x, n, 70 + s, -1, 1);
        fill_const(y, ny, NAN); /* overwritten */
        tp__k_sum_dim(x, y, outer, size, inner);
        for (int64_t o = 0; o < outer; o++)
            for (int64_t i = 0; i < inner; i++) {
                double acc = 0;
                for (int64_t k = 0; k < size; k++)
                    acc += x[(o * size + k) * inner + i];
                want[o * inner + i] = acc;
            }
        char what[80];
        snprintf(what, sizeof what, "sum_dim [%lld,%lld,%lld]", (long long)outer,
                 (long long)size, (long long)inner);
        check_close(what, y, want, ny, 1e-6, 1e-6);

        /* backward of mean: gy / size broadcast over the reduced dim */
        float scale = 1.0f / (float)size;
        fill(gy, ny, 71, -1, 1);
        tp__k_sum_dim_bwd(gy, gx, outer, size, inner, scale);
        for (int64_t o = 0; o < outer; o++)
            for (int64_t k = 0; k < size; k++)
                for (int64_t i = 0; i < inner; i++)
                    wantf[(o * size + k) * inner + i] = gy[o * inner + i] * scale;
        check_same("sum_dim_bwd", gx, wantf, n);
        free(x), free(y), free(gy), free(gx), free(wantf), free(want);
    }
}

typedef struct sumdim_ctx {
    int64_t outer, size, inner;
    double scale;
    double *x, *r;
} sumdim_ctx;

static double sumdim_loss(void *p)
{
    sumdim_ctx *c = p;
    double l = 0;
    for (int64_t o = 0; o < c->outer; o++)
        for (int64_t i = 0; i < c->inner; i++) {
            double acc = 0;
            for (int64_t k = 0; k < c->size; k++)
                acc += c->x[(o * c->size + k) * c->inner + i];
            l += c->r[o * c->inner + i] * c->scale * acc;
        }
    return l;
}

Test(kernels, sum_dim_bwd_vs_fd, .timeout = 30)
{
    int64_t outer = 3, size = 5, inner = 4, n = outer * size * inner, ny = outer * inner;
    float *gy = falloc(ny), *gx = falloc(n), *x = falloc(n);
    double *xd = dalloc(n), *rd = dalloc(ny);
    fill(x, n, 72, -1, 1);
    fill(gy, ny, 73, -1, 1);
    to_double(x, xd, n);
    to_double(gy, rd, ny);
    tp__k_sum_dim_bwd(gy, gx, outer, size, inner, 0.25f);
    sumdim_ctx c = {outer, size, inner, 0.25, xd, rd};
    check_fd("sum_dim_bwd vs fd", sumdim_loss, &c, xd, n, gx, 1e-6);
    free(gy), free(gx), free(x), free(xd), free(rd);
}

Test(kernels, sum_all_accumulates_in_double, .timeout = 30)
{
    cr_assert_eq(tp__k_sum_all(NULL, 0), 0.0);
    for (int si = 0; si < N_ODD; si++) {
        int64_t n = odd_sizes[si];
        float *x = falloc(n);
        fill(x, n, 80, -1, 1);
        double want = 0;
        for (int64_t i = 0; i < n; i++)
            want += x[i];
        double got = tp__k_sum_all(x, n);
        cr_assert(fabs(got - want) <= 1e-12 * (double)n, "sum_all n=%lld: %.17g vs %.17g",
                  (long long)n, got, want);
        free(x);
    }
    /* 2^20 copies of 0.1f: a float accumulator drifts by ~1e-3 relative */
    int64_t n = 1 << 20;
    float *x = falloc(n);
    fill_const(x, n, 0.1f);
    double want = (double)n * (double)0.1f, got = tp__k_sum_all(x, n);
    cr_assert(fabs(got - want) <= 1e-12 * want, "sum_all 2^20 x 0.1f: %.17g vs %.17g", got, want);
    free(x);
}

/* ---- softmax ---------------------------------------------------------------------------- */

static void ref_softmax(const double *x, double *y, int64_t rows, int64_t cols)
{
    for (int64_t r = 0; r < rows; r++) {
        const double *xr = x + r * cols;
        double mx = -INFINITY, s = 0;
        for (int64_t c = 0; c < cols; c++)
            mx = fmax(mx, xr[c]);
        for (int64_t c = 0; c < cols; c++)
            s += exp(xr[c] - mx);
        for (int64_t c = 0; c < cols; c++)
            y[r * cols + c] = exp(xr[c] - mx) / s;
    }
}

typedef struct softmax_ctx {
    int64_t rows, cols;
    double *x, *r, *y;
} softmax_ctx;

static double softmax_loss(void *p)
{
    softmax_ctx *c = p;
    ref_softmax(c->x, c->y, c->rows, c->cols);
    return dot_d(c->r, c->y, c->rows * c->cols);
}

Test(kernels, softmax_fwd_bwd_including_large_logits, .timeout = 60)
{
    for (int big = 0; big < 2; big++)
        for (int ri = 0; ri < 3; ri++)
            for (int ci = 0; ci < N_ODD; ci++) {
                int64_t rows = odd_sizes[ri], cols = odd_sizes[ci], n = rows * cols;
                float *x = falloc(n), *y = falloc(n), *gy = falloc(n), *gx = falloc(n);
                double *xd = dalloc(n), *yd = dalloc(n), *rd = dalloc(n), *gd = dalloc(n);
                fill(x, n, 90 + big, -4, 4);
                if (big) /* logits of +-80: exp overflows float without the max shift */
                    for (int64_t i = 0; i < n; i++)
                        x[i] = (i % 3 == 0) ? 80.0f - (float)(i % 7) : (i % 3 == 1 ? -80.0f : x[i]);
                fill(gy, n, 92, -1, 1);
                to_double(x, xd, n);
                to_double(gy, rd, n);
                char what[80];
                snprintf(what, sizeof what, "softmax big=%d [%lld,%lld]", big, (long long)rows,
                         (long long)cols);
                tp__k_softmax_fwd(x, y, rows, cols);
                ref_softmax(xd, yd, rows, cols);
                check_close(what, y, yd, n, 1e-5, 1e-7);

                /* analytic: gx = y (gy - <gy, y>) from the double softmax */
                tp__k_softmax_bwd(y, gy, gx, rows, cols);
                for (int64_t r = 0; r < rows; r++) {
                    double d = dot_d(rd + r * cols, yd + r * cols, cols);
                    for (int64_t c = 0; c < cols; c++)
                        gd[r * cols + c] = yd[r * cols + c] * (rd[r * cols + c] - d);
                }
                check_grad(what, gx, gd, n, 1e-5);
                if (n <= 17 * 17) {
                    softmax_ctx c = {rows, cols, xd, rd, dalloc(n)};
                    check_fd(what, softmax_loss, &c, xd, n, gx, 1e-4);
                    free(c.y);
                }
                /* in place */
                float *z = falloc(n);
                memcpy(z, x, (size_t)n * sizeof *z);
                tp__k_softmax_fwd(z, z, rows, cols);
                check_same("softmax_fwd in place", z, y, n);
                memcpy(z, gy, (size_t)n * sizeof *z);
                tp__k_softmax_bwd(y, z, z, rows, cols);
                check_same("softmax_bwd in place", z, gx, n);
                free(x), free(y), free(gy), free(gx), free(xd), free(yd), free(rd), free(gd);
                free(z);
            }
}

/* ---- transpose ---------------------------------------------------------------------- */

Test(kernels, transpose_last2, .timeout = 30)
{
    static const int64_t dims[] = {1, 3, 17, 40, 129};
    for (int64_t batch = 1; batch <= 3; batch += 2)
        for (int ri = 0; ri < 5; ri++)
            for (int ci = 0; ci < 5; ci++) {
                int64_t r = dims[ri], c = dims[ci], n = batch * r * c;
                float *x = falloc(n), *y = falloc(n);
                for (int64_t i = 0; i < n; i++)
                    x[i] = (float)i;
                tp__k_transpose_last2(x, y, batch, r, c);
                for (int64_t b = 0; b < batch; b++)
                    for (int64_t i = 0; i < r; i++)
                        for (int64_t j = 0; j < c; j++)
                            cr_assert_eq(y[(b * c + j) * r + i], x[(b * r + i) * c + j],
                                         "transpose [%lld,%lld,%lld] at (%lld,%lld,%lld)",
                                         (long long)batch, (long long)r, (long long)c,
                                         (long long)b, (long long)i, (long long)j);
                free(x), free(y);
            }
}

/* ---- embedding ----------------------------------------------------------------------- */

typedef struct emb_ctx {
    const int64_t *idx;
    int64_t n, rows, dim, offset;
    double *w, *r;
} emb_ctx;

static double emb_loss(void *p)
{
    emb_ctx *c = p;
    double l = 0;
    for (int64_t i = 0; i < c->n; i++) {
        int64_t k = c->idx[i];
        if (k < c->offset || k >= c->offset + c->rows)
            continue;
        for (int64_t d = 0; d < c->dim; d++)
            l += c->r[i * c->dim + d] * c->w[(k - c->offset) * c->dim + d];
    }
    return l;
}

Test(kernels, embedding_masked_rows_and_offset, .timeout = 30)
{
    /* a shard owning global rows [5, 12); the rest are masked to zero rows */
    static const int64_t idx[] = {5, -1, 0, 4, 11, 12, 100, 7, 7, 8, INT64_MAX, INT64_MIN, 5, 6};
    const int64_t n = (int64_t)(sizeof idx / sizeof idx[0]), rows = 7, offset = 5;
    for (int di = 0; di < 3; di++) {
        int64_t dim = odd_sizes[di];
        float *w = falloc(rows * dim), *y = falloc(n * dim), *gy = falloc(n * dim);
        float *gw = falloc(rows * dim), *want = falloc(n * dim), *p = falloc(rows * dim);
        double *wd = dalloc(rows * dim), *rd = dalloc(n * dim), *gwd = dalloc(rows * dim);
        fill(w, rows * dim, 100, -1, 1);
        fill_const(y, n * dim, NAN);
        tp__k_embedding_fwd(idx, n, w, rows, dim, offset, y);
        for (int64_t i = 0; i < n; i++)
            for (int64_t d = 0; d < dim; d++) {
                bool own = idx[i] >= offset && idx[i] < offset + rows;
                want[i * dim + d] = own ? w[(idx[i] - offset) * dim + d] : 0.0f;
            }
        check_same("embedding_fwd", y, want, n * dim);

        /* whole table: offset 0, rows_local = num */
        static const int64_t idx2[] = {6, 0, 3};
        tp__k_embedding_fwd(idx2, 3, w, rows, dim, 0, y);
        for (int64_t i = 0; i < 3; i++)
            check_same("embedding_fwd whole", y + i * dim, w + idx2[i] * dim, dim);

        /* backward accumulates; duplicates add up; masked rows are skipped */
        fill(gy, n * dim, 101, -1, 1);
        fill(p, rows * dim, 102, -1, 1);
        memcpy(gw, p, (size_t)(rows * dim) * sizeof *gw);
        tp__k_embedding_bwd(idx, n, gy, rows, dim, offset, gw);
        for (int64_t k = 0; k < rows * dim; k++)
            gwd[k] = p[k];
        for (int64_t i = 0; i < n; i++)
            if (idx[i] >= offset && idx[i] < offset + rows)
                for (int64_t d = 0; d < dim; d++)
                    gwd[(idx[i] - offset) * dim + d] += gy[i * dim + d];
        check_close("embedding_bwd", gw, gwd, rows * dim, 1e-6, 1e-6);

        fill_const(gw, rows * dim, 0.0f);
        tp__k_embedding_bwd(idx, n, gy, rows, dim, offset, gw);
        to_double(w, wd, rows * dim);
        to_double(gy, rd, n * dim);
        emb_ctx c = {idx, n, rows, dim, offset, wd, rd};
        check_fd("embedding_bwd vs fd", emb_loss, &c, wd, rows * dim, gw, 1e-6);
        free(w), free(y), free(gy), free(gw), free(want), free(p), free(wd), free(rd), free(gwd);
    }
}

/* ---- layer norm / rms norm ---------------------------------------------------------- */

static void ref_layer_norm(const double *x, const double *w, const double *b, double *y,
                           double *mean, double *rstd, int64_t rows, int64_t cols, double eps)
{
    for (int64_t r = 0; r < rows; r++) {
        const double *xr = x + r * cols;
        double mu = 0, var = 0;
        for (int64_t c = 0; c < cols; c++)
            mu += xr[c];
        mu /= (double)cols;
        for (int64_t c = 0; c < cols; c++)
            var += (xr[c] - mu) * (xr[c] - mu);
        var /= (double)cols;
        double rs = 1.0 / sqrt(var + eps);
        mean[r] = mu, rstd[r] = rs;
        for (int64_t c = 0; c < cols; c++)
            y[r * cols + c] = (xr[c] - mu) * rs * (w ? w[c] : 1.0) + (b ? b[c] : 0.0);
    }
}

/* gx overwritten, gw/gb accumulated */
static void ref_layer_norm_bwd(const double *x, const double *w, const double *mean,
                               const double *rstd, const double *gy, double *gx, double *gw,
                               double *gb, int64_t rows, int64_t cols)
{
    for (int64_t r = 0; r < rows; r++) {
        double a = 0, b = 0;
        for (int64_t c = 0; c < cols; c++) {
            double xh = (x[r * cols + c] - mean[r]) * rstd[r];
            double g = gy[r * cols + c] * (w ? w[c] : 1.0);
            a += g, b += g * xh;
            gw[c] += gy[r * cols + c] * xh;
            gb[c] += gy[r * cols + c];
        }
        a /= (double)cols, b /= (double)cols;
        for (int64_t c = 0; c < cols; c++) {
            double xh = (x[r * cols + c] - mean[r]) * rstd[r];
            double g = gy[r * cols + c] * (w ? w[c] : 1.0);
            gx[r * cols + c] = rstd[r] * (g - a - xh * b);
        }
    }
}

static void ref_rms_norm(const double *x, const double *w, double *y, double *rstd, int64_t rows,
                         int64_t cols, double eps)
{
    for (int64_t r = 0; r < rows; r++) {
        double ms = 0;
        for (int64_t c = 0; c < cols; c++)
            ms += x[r * cols + c] * x[r * cols + c];
        double rs = 1.0 / sqrt(ms / (double)cols + eps);
        rstd[r] = rs;
        for (int64_t c = 0; c < cols; c++)
            y[r * cols + c] = x[r * cols + c] * rs * (w ? w[c] : 1.0);
    }
}

static void ref_rms_norm_bwd(const double *x, const double *w, const double *rstd,
                             const double *gy, double *gx, double *gw, int64_t rows, int64_t cols)
{
    for (int64_t r = 0; r < rows; r++) {
        double b = 0;
        for (int64_t c = 0; c < cols; c++) {
            double xh = x[r * cols + c] * rstd[r];
            b += gy[r * cols + c] * (w ? w[c] : 1.0) * xh;
            gw[c] += gy[r * cols + c] * xh;
        }
        b /= (double)cols;
        for (int64_t c = 0; c < cols; c++) {
            double xh = x[r * cols + c] * rstd[r];
            gx[r * cols + c] = rstd[r] * (gy[r * cols + c] * (w ? w[c] : 1.0) - xh * b);
        }
    }
}

typedef struct norm_ctx {
    int64_t rows, cols;
    bool rms;
    double eps;
    double *x, *w, *b, *r, *y, *mean, *rstd;
} norm_ctx;

static double norm_loss(void *p)
{
    norm_ctx *c = p;
    if (c->rms)
        ref_rms_norm(c->x, c->w, c->y, c->rstd, c->rows, c->cols, c->eps);
    else
        ref_layer_norm(c->x, c->w, c->b, c->y, c->mean, c->rstd, c->rows, c->cols, c->eps);
    return dot_d(c->r, c->y, c->rows * c->cols);
}

/* One norm case: forward vs reference, backward vs analytic reference
 * (gx overwrite, gw/gb accumulate), and vs finite differences when small. */
static void check_norm(bool rms, int64_t rows, int64_t cols, bool has_w, bool has_b, uint64_t seed)
{
    const float eps = 1e-5f;
    int64_t n = rows * cols;
    float *x = falloc(n), *w = falloc(cols), *b = falloc(cols), *y = falloc(n);
    float *mean = falloc(rows), *rstd = falloc(rows), *gy = falloc(n), *gx = falloc(n);
    float *gw = falloc(cols), *gb = falloc(cols), *pw = falloc(cols), *pb = falloc(cols);
    double *xd = dalloc(n), *wd = dalloc(cols), *bd = dalloc(cols), *yd = dalloc(n);
    double *md = dalloc(rows), *rsd = dalloc(rows), *rd = dalloc(n), *gxd = dalloc(n);
    double *gwd = dalloc(cols), *gbd = dalloc(cols);
    fill(x, n, seed, -2, 2);
    for (int64_t i = 0; i < n; i++) /* a mean far from 0 for layer norm */
        x[i] += rms ? 0.0f : 3.0f;
    fill(w, cols, seed + 1, 0.5, 1.5);
    fill(b, cols, seed + 2, -1, 1);
    fill(gy, n, seed + 3, -1, 1);
    fill(pw, cols, seed + 4, -1, 1);
    fill(pb, cols, seed + 5, -1, 1);
    to_double(x, xd, n);
    to_double(w, wd, cols);
    to_double(b, bd, cols);
    to_double(gy, rd, n);
    const float *wp = has_w ? w : NULL, *bp = has_b ? b : NULL;
    const double *wdp = has_w ? wd : NULL, *bdp = has_b ? bd : NULL;
    char what[96];
    snprintf(what, sizeof what, "%s [%lld,%lld] w=%d b=%d", rms ? "rms_norm" : "layer_norm",
             (long long)rows, (long long)cols, has_w, has_b);

    if (rms) {
        tp__k_rms_norm_fwd(x, wp, y, rstd, rows, cols, eps);
        ref_rms_norm(xd, wdp, yd, rsd, rows, cols, eps);
    } else {
        tp__k_layer_norm_fwd(x, wp, bp, y, mean, rstd, rows, cols, eps);
        ref_layer_norm(xd, wdp, bdp, yd, md, rsd, rows, cols, eps);
        check_close(what, mean, md, rows, 1e-6, 1e-6);
    }
    check_close(what, rstd, rsd, rows, 1e-5, 0);
    check_close(what, y, yd, n, 1e-5, 1e-5);

    fill_const(gx, n, NAN); /* gx is overwritten */
    memcpy(gw, pw, (size_t)cols * sizeof *gw);
    memcpy(gb, pb, (size_t)cols * sizeof *gb);
    to_double(pw, gwd, cols);
    to_double(pb, gbd, cols);
    if (rms) {
        tp__k_rms_norm_bwd(x, wp, rstd, gy, gx, has_w ? gw : NULL, rows, cols);
        ref_rms_norm_bwd(xd, wdp, rsd, rd, gxd, gwd, rows, cols);
    } else {
        tp__k_layer_norm_bwd(x, wp, mean, rstd, gy, gx, has_w ? gw : NULL, has_b ? gb : NULL,
                             rows, cols);
        ref_layer_norm_bwd(xd, wdp, md, rsd, rd, gxd, gwd, gbd, rows, cols);
    }
    /* the natural scale of gx: rstd |gy w| (rms norm with one column cancels
     * to ~eps / x^2 of it) */
    double gscale = 0;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++)
            gscale = fmax(gscale, rsd[r] * fabs(rd[r * cols + c] * (has_w ? wd[c] : 1.0)));
    check_grad_scaled(what, gx, gxd, n, 1e-4, gscale);
    if (has_w)
        check_grad(what, gw, gwd, cols, 1e-5);
    else /* NULL gw: nothing written to the (unused) buffer */
        check_same(what, gw, pw, cols);
    if (!rms && has_b)
        check_grad(what, gb, gbd, cols, 1e-5);

    if (n <= 3 * 17) {
        norm_ctx c = {rows, cols, rms, eps, xd, has_w ? wd : NULL, has_b ? bd : NULL, rd, yd, md,
                      rsd};
        check_fd_scaled(what, norm_loss, &c, xd, n, gx, 1e-4, gscale);
        /* gw and gb against fd: recompute them from zero */
        if (has_w || (!rms && has_b)) {
            fill_const(gw, cols, 0.0f);
            fill_const(gb, cols, 0.0f);
            if (rms)
                tp__k_rms_norm_bwd(x, wp, rstd, gy, gx, gw, rows, cols);
            else
                tp__k_layer_norm_bwd(x, wp, mean, rstd, gy, gx, gw, gb, rows, cols);
            if (has_w)
                check_fd(what, norm_loss, &c, wd, cols, gw, 1e-4);
            if (!rms && has_b)
                check_fd(what, norm_loss, &c, bd, cols, gb, 1e-4);
        }
    }
    free(x), free(w), free(b), free(y), free(mean), free(rstd), free(gy), free(gx), free(gw);
    free(gb), free(pw), free(pb), free(xd), free(wd), free(bd), free(yd), free(md), free(rsd);
    free(rd), free(gxd), free(gwd), free(gbd);
}

Test(kernels, layer_norm_affine_and_plain, .timeout = 60)
{
    for (int ri = 0; ri < 3; ri++)
        for (int ci = 0; ci < N_ODD; ci++)
            for (int aff = 0; aff < 4; aff++)
                check_norm(false, odd_sizes[ri], odd_sizes[ci], aff & 1, aff & 2,
                           (uint64_t)(110 + 10 * ci));
    check_norm(false, 3, 1300, true, true, 190); /* wider than one accumulator block */
}

Test(kernels, rms_norm_affine_and_plain, .timeout = 60)
{
    for (int ri = 0; ri < 3; ri++)
        for (int ci = 0; ci < N_ODD; ci++)
            for (int aff = 0; aff < 2; aff++)
                check_norm(true, odd_sizes[ri], odd_sizes[ci], aff, false,
                           (uint64_t)(210 + 10 * ci));
    check_norm(true, 3, 1300, true, false, 290);
}

/* ---- dropout ------------------------------------------------------------------------- */

Test(kernels, dropout_mask_scale_and_extremes, .timeout = 30)
{
    const int64_t shape[2] = {17, 129}, n = 17 * 129;
    const uint64_t seed = 4242;
    float *x = falloc(n), *y = falloc(n), *gy = falloc(n), *gx = falloc(n), *want = falloc(n);
    uint8_t *mask = malloc((size_t)n);
    cr_assert_not_null(mask);
    fill(x, n, 300, -1, 1);
    fill(gy, n, 301, -1, 1);

    /* p = 0: identity, everything kept */
    tp__k_dropout_fwd(x, y, mask, 2, shape, NULL, NULL, 0.0f, seed);
    check_same("dropout p=0", y, x, n);
    for (int64_t i = 0; i < n; i++)
        cr_assert_eq(mask[i], 1);
    tp__k_dropout_bwd(gy, NULL, gx, n, 0.0f);
    check_same("dropout_bwd p=0", gx, gy, n);

    /* p = 1: all dropped */
    tp__k_dropout_fwd(x, y, mask, 2, shape, NULL, NULL, 1.0f, seed);
    for (int64_t i = 0; i < n; i++)
        cr_assert(y[i] == 0.0f && mask[i] == 0, "p=1 element %lld", (long long)i);
    tp__k_dropout_bwd(gy, NULL, gx, n, 1.0f);
    for (int64_t i = 0; i < n; i++)
        cr_assert_eq(gx[i], 0.0f);

    /* 0 < p < 1: keep iff u(seed, g) >= p, scaled by 1/(1-p) */
    const float p = 0.3f, scale = 1.0f / (1.0f - p);
    tp__k_dropout_fwd(x, y, mask, 2, shape, NULL, NULL, p, seed);
    int64_t kept = 0;
    for (int64_t i = 0; i < n; i++) {
        bool keep = tp_rng_uniform(seed, (uint64_t)i) >= (double)p;
        cr_assert_eq(mask[i], keep, "mask at %lld", (long long)i);
        want[i] = keep ? x[i] * scale : 0.0f;
        kept += keep;
    }
    check_same("dropout p=0.3", y, want, n);
    double rate = (double)kept / (double)n;
    cr_assert(fabs(rate - 0.7) < 0.05, "keep rate %g for p = 0.3", rate);
    /* mask is optional */
    float *y2 = falloc(n);
    tp__k_dropout_fwd(x, y2, NULL, 2, shape, NULL, NULL, p, seed);
    check_same("dropout no mask", y2, y, n);
    /* in place */
    memcpy(y2, x, (size_t)n * sizeof *y2);
    tp__k_dropout_fwd(y2, y2, NULL, 2, shape, NULL, NULL, p, seed);
    check_same("dropout in place", y2, y, n);
    /* another seed, another mask */
    tp__k_dropout_fwd(x, y2, NULL, 2, shape, NULL, NULL, p, seed + 1);
    cr_assert(memcmp(y, y2, (size_t)n * sizeof *y) != 0);

    tp__k_dropout_bwd(gy, mask, gx, n, p);
    for (int64_t i = 0; i < n; i++)
        want[i] = mask[i] ? gy[i] * scale : 0.0f;
    check_same("dropout_bwd", gx, want, n);

    /* a 0-d tensor is global element 0 */
    float xs = 2.0f, ys;
    uint8_t ms;
    tp__k_dropout_fwd(&xs, &ys, &ms, 0, NULL, NULL, NULL, 0.5f, seed);
    bool keep0 = tp_rng_uniform(seed, 0) >= 0.5;
    cr_assert(ms == keep0 && ys == (keep0 ? 4.0f : 0.0f));
    free(x), free(y), free(gy), free(gx), free(want), free(mask), free(y2);
}

typedef struct dropout_ctx {
    int64_t n;
    double scale;
    const uint8_t *mask;
    double *x, *r;
} dropout_ctx;

static double dropout_loss(void *p)
{
    dropout_ctx *c = p;
    double l = 0;
    for (int64_t i = 0; i < c->n; i++)
        l += c->r[i] * (c->mask[i] ? c->x[i] * c->scale : 0.0);
    return l;
}

Test(kernels, dropout_bwd_vs_fd, .timeout = 30)
{
    const int64_t shape[1] = {17}, n = 17;
    float x[17], y[17], gy[17], gx[17];
    uint8_t mask[17];
    double xd[17], rd[17];
    fill(x, n, 310, -1, 1);
    fill(gy, n, 311, -1, 1);
    tp__k_dropout_fwd(x, y, mask, 1, shape, NULL, NULL, 0.5f, 99);
    tp__k_dropout_bwd(gy, mask, gx, n, 0.5f);
    to_double(x, xd, n);
    to_double(gy, rd, n);
    dropout_ctx c = {n, 2.0, mask, xd, rd};
    check_fd("dropout_bwd vs fd", dropout_loss, &c, xd, n, gx, 1e-6);
}

/* Runs dropout on the block [off, off + shape) of a global tensor (ndim <= 3)
 * and compares it with the same block of the whole run. */
static void check_dropout_block(int ndim, const int64_t *gshape, const int64_t *shape,
                                const int64_t *off, const float *x, const float *y_whole,
                                const uint8_t *m_whole, float p, uint64_t seed)
{
    int64_t g3[3] = {1, 1, 1}, s3[3] = {1, 1, 1}, o3[3] = {0, 0, 0};
    for (int d = 0; d < ndim; d++) {
        g3[3 - ndim + d] = gshape[d];
        s3[3 - ndim + d] = shape[d];
        o3[3 - ndim + d] = off[d];
    }
    int64_t n = s3[0] * s3[1] * s3[2];
    float *xs = falloc(n), *ys = falloc(n), *want = falloc(n);
    uint8_t *ms = malloc((size_t)n), *mwant = malloc((size_t)n);
    cr_assert(ms && mwant);
    int64_t k = 0;
    for (int64_t i = 0; i < s3[0]; i++)
        for (int64_t j = 0; j < s3[1]; j++)
            for (int64_t l = 0; l < s3[2]; l++, k++) {
                int64_t g = ((o3[0] + i) * g3[1] + (o3[1] + j)) * g3[2] + (o3[2] + l);
                xs[k] = x[g];
                want[k] = y_whole[g];
                mwant[k] = m_whole[g];
            }
    tp__k_dropout_fwd(xs, ys, ms, ndim, shape, gshape, off, p, seed);
    check_same("dropout block", ys, want, n);
    cr_assert(memcmp(ms, mwant, (size_t)n) == 0, "dropout block mask differs");
    free(xs), free(ys), free(want), free(ms), free(mwant);
}

Test(kernels, dropout_shards_match_whole, .timeout = 30)
{
    const float p = 0.4f;
    const uint64_t seed = 777;
    /* [6, 10]: row halves, column halves, an uneven column split, an inner block */
    {
        const int64_t gshape[2] = {6, 10}, n = 60;
        float x[60], y[60], y2[60];
        uint8_t m[60], m2[60];
        fill(x, n, 320, -1, 1);
        tp__k_dropout_fwd(x, y, m, 2, gshape, NULL, NULL, p, seed);
        const int64_t zero[2] = {0, 0};
        tp__k_dropout_fwd(x, y2, m2, 2, gshape, gshape, zero, p, seed); /* explicit whole */
        check_same("dropout explicit whole", y2, y, n);
        cr_assert(memcmp(m, m2, sizeof m) == 0);
        static const int64_t blocks[][4] = {
            /* shape, offset */
            {3, 10, 0, 0}, {3, 10, 3, 0}, {6, 5, 0, 0}, {6, 5, 0, 5},
            {6, 3, 0, 0}, {6, 7, 0, 3}, {2, 4, 2, 3}, {1, 1, 5, 9},
        };
        for (size_t b = 0; b < sizeof blocks / sizeof blocks[0]; b++)
            check_dropout_block(2, gshape, blocks[b], blocks[b] + 2, x, y, m, p, seed);
    }
    /* [2, 3, 5]: a block in all three dims */
    {
        const int64_t gshape[3] = {2, 3, 5}, n = 30;
        const int64_t shape[3] = {1, 2, 3}, off[3] = {1, 1, 2};
        const int64_t shape2[3] = {2, 1, 5}, off2[3] = {0, 2, 0};
        float x[30], y[30];
        uint8_t m[30];
        fill(x, n, 321, -1, 1);
        tp__k_dropout_fwd(x, y, m, 3, gshape, NULL, NULL, p, seed);
        check_dropout_block(3, gshape, shape, off, x, y, m, p, seed);
        check_dropout_block(3, gshape, shape2, off2, x, y, m, p, seed);
    }
}

/* ---- cross entropy --------------------------------------------------------------------- */

#define IGNORE (-100)

static bool ce_counted(int64_t t, int64_t classes)
{
    return t != IGNORE && t >= 0 && t < classes;
}

static double ref_ce(const double *x, const int64_t *t, const double *w, double *loss,
                     int64_t rows, int64_t classes)
{
    double ws = 0;
    for (int64_t r = 0; r < rows; r++) {
        if (!ce_counted(t[r], classes)) {
            loss[r] = 0;
            continue;
        }
        const double *xr = x + r * classes;
        double mx = -INFINITY, s = 0;
        for (int64_t c = 0; c < classes; c++)
            mx = fmax(mx, xr[c]);
        for (int64_t c = 0; c < classes; c++)
            s += exp(xr[c] - mx);
        double wt = w ? w[t[r]] : 1.0;
        loss[r] = wt * (log(s) + mx - xr[t[r]]);
        ws += wt;
    }
    return ws;
}

static void ref_ce_bwd(const double *x, const int64_t *t, const double *w, const double *gloss,
                       double *gx, int64_t rows, int64_t classes)
{
    for (int64_t r = 0; r < rows; r++) {
        const double *xr = x + r * classes;
        double *gr = gx + r * classes;
        if (!ce_counted(t[r], classes)) {
            for (int64_t c = 0; c < classes; c++)
                gr[c] = 0;
            continue;
        }
        double mx = -INFINITY, s = 0;
        for (int64_t c = 0; c < classes; c++)
            mx = fmax(mx, xr[c]);
        for (int64_t c = 0; c < classes; c++)
            s += exp(xr[c] - mx);
        double g = gloss[r] * (w ? w[t[r]] : 1.0);
        for (int64_t c = 0; c < classes; c++)
            gr[c] = g * (exp(xr[c] - mx) / s - (c == t[r] ? 1.0 : 0.0));
    }
}

typedef struct ce_ctx {
    int64_t rows, classes;
    const int64_t *t;
    double *x, *w, *gloss, *loss;
} ce_ctx;

static double ce_loss(void *p)
{
    ce_ctx *c = p;
    ref_ce(c->x, c->t, c->w, c->loss, c->rows, c->classes);
    return dot_d(c->gloss, c->loss, c->rows);
}

/* Logits in [-4, 4); with `big`, every third logit is near +80 and every
 * third one -80. */
static void fill_logits(float *x, int64_t n, uint64_t seed, bool big)
{
    fill(x, n, seed, -4, 4);
    if (big)
        for (int64_t i = 0; i < n; i++)
            x[i] = i % 3 == 0 ? 80.0f - (float)(i % 5) : (i % 3 == 1 ? -80.0f : x[i]);
}

Test(kernels, cross_entropy_fwd_bwd_weights_and_ignore, .timeout = 60)
{
    for (int big = 0; big < 2; big++)
        for (int weighted = 0; weighted < 2; weighted++)
            for (int ri = 0; ri < 3; ri++)
                for (int ci = 0; ci < N_ODD; ci++) {
                    int64_t rows = odd_sizes[ri], classes = odd_sizes[ci], n = rows * classes;
                    float *x = falloc(n), *w = falloc(classes), *loss = falloc(rows);
                    float *gl = falloc(rows), *gx = falloc(n);
                    int64_t *t = malloc((size_t)rows * sizeof *t);
                    cr_assert_not_null(t);
                    double *xd = dalloc(n), *wd = dalloc(classes), *ld = dalloc(rows);
                    double *gld = dalloc(rows), *gxd = dalloc(n);
                    fill_logits(x, n, 400 + (uint64_t)big, big);
                    fill(w, classes, 401, 0.5, 2.0);
                    fill(gl, rows, 402, 0.1, 1.0);
                    for (int64_t r = 0; r < rows; r++) /* every 3rd row ignored (not row 0) */
                        t[r] = r % 3 == 2 ? IGNORE
                                          : (int64_t)(tp_rng_uniform(403, (uint64_t)r) *
                                                      (double)classes);
                    to_double(x, xd, n);
                    to_double(w, wd, classes);
                    to_double(gl, gld, rows);
                    const float *wp = weighted ? w : NULL;
                    double *wdp = weighted ? wd : NULL;
                    char what[96];
                    snprintf(what, sizeof what, "cross_entropy big=%d weighted=%d [%lld,%lld]",
                             big, weighted, (long long)rows, (long long)classes);

                    double wsum = -1;
                    fill_const(loss, rows, NAN);
                    tp__k_cross_entropy_fwd(x, t, wp, loss, rows, classes, 1, IGNORE, &wsum);
                    double wsum_ref = ref_ce(xd, t, wdp, ld, rows, classes);
                    check_close(what, loss, ld, rows, 1e-5, 1e-5);
                    cr_assert(fabs(wsum - wsum_ref) <= 1e-9 * wsum_ref, "%s: wsum %.17g vs %.17g",
                              what, wsum, wsum_ref);
                    tp__k_cross_entropy_fwd(x, t, wp, loss, rows, classes, 1, IGNORE, NULL);

                    fill_const(gx, n, NAN);
                    tp__k_cross_entropy_bwd(x, t, wp, gl, gx, rows, classes, 1, IGNORE);
                    ref_ce_bwd(xd, t, wdp, gld, gxd, rows, classes);
                    check_grad(what, gx, gxd, n, 1e-5);
                    if (n <= 17 * 17) {
                        ce_ctx c = {rows, classes, t, xd, wdp, gld, ld};
                        check_fd(what, ce_loss, &c, xd, n, gx, 1e-4);
                    }
                    free(x), free(w), free(loss), free(gl), free(gx), free(t), free(xd);
                    free(wd), free(ld), free(gld), free(gxd);
                }
}

Test(kernels, cross_entropy_out_of_range_targets_count_as_ignored, .timeout = 30)
{
    enum { R = 4, C = 3 };
    float x[R * C], w[C] = {1.0f, 2.0f, 3.0f}, loss[R], gl[R] = {1, 1, 1, 1}, gx[R * C];
    const int64_t t[R] = {1, C, -5, 7};
    fill(x, R * C, 410, -1, 1);
    double wsum = -1;
    tp__k_cross_entropy_fwd(x, t, w, loss, R, C, 1, 7, &wsum);
    cr_assert(loss[0] > 0.0f && loss[1] == 0.0f && loss[2] == 0.0f && loss[3] == 0.0f);
    cr_assert_eq(wsum, 2.0); /* only row 0, weight[1] */
    tp__k_cross_entropy_bwd(x, t, w, gl, gx, R, C, 1, 7);
    for (int i = C; i < R * C; i++)
        cr_assert_eq(gx[i], 0.0f, "row %d", i / C);
    /* all rows ignored: wsum is 0 */
    const int64_t ti[R] = {7, 7, 7, 7};
    tp__k_cross_entropy_fwd(x, ti, NULL, loss, R, C, 1, 7, &wsum);
    cr_assert_eq(wsum, 0.0);
}

/* ---- vocab parallel ----------------------------------------------------------------- */

Test(kernels, vocab_parallel_pieces_individually, .timeout = 30)
{
    enum { R = 3, C = 17 };
    float x[R * C], mx[R], s[R], picked[R];
    fill_logits(x, R * C, 500, false);
    tp__k_row_max(x, mx, R, C, 1);
    for (int r = 0; r < R; r++) {
        float m = -INFINITY;
        for (int c = 0; c < C; c++)
            m = fmaxf(m, x[r * C + c]);
        cr_assert_eq(mx[r], m);
    }
    const float gmx[R] = {5.0f, 4.0f, 10.0f}; /* a max from elsewhere */
    tp__k_row_sumexp(x, gmx, s, R, C, 1);
    for (int r = 0; r < R; r++) {
        double want = 0;
        for (int c = 0; c < C; c++)
            want += exp((double)x[r * C + c] - gmx[r]);
        cr_assert(fabs(s[r] - want) <= 1e-6 * want, "sumexp row %d: %g vs %g", r, s[r], want);
    }
    /* this shard owns classes [20, 37) */
    const int64_t t[R] = {25, 19, IGNORE};
    tp__k_pick_target(x, t, picked, R, C, 1, 20, IGNORE);
    cr_assert_eq(picked[0], x[0 * C + 5]);
    cr_assert_eq(picked[1], 0.0f);
    cr_assert_eq(picked[2], 0.0f);
    const int64_t t2[R] = {37, 20, 36};
    tp__k_pick_target(x, t2, picked, R, C, 1, 20, IGNORE);
    cr_assert(picked[0] == 0.0f && picked[1] == x[1 * C + 0] && picked[2] == x[2 * C + 16]);
}

/* The whole-logits loss as a function of the class shards: reassembles the
 * [rows, classes] logits from the shards, then the reference cross entropy. */
typedef struct vocab_ctx {
    int64_t rows, classes, nshards;
    const int64_t *width, *off, *t;
    double **xs, *x, *w, *gloss, *loss;
} vocab_ctx;

static double vocab_loss(void *p)
{
    vocab_ctx *c = p;
    for (int64_t s = 0; s < c->nshards; s++)
        for (int64_t r = 0; r < c->rows; r++)
            for (int64_t k = 0; k < c->width[s]; k++)
                c->x[r * c->classes + c->off[s] + k] = c->xs[s][r * c->width[s] + k];
    ref_ce(c->x, c->t, c->w, c->loss, c->rows, c->classes);
    return dot_d(c->gloss, c->loss, c->rows);
}

/* Logits [5, 13] split on the class dim into uneven shards 4 | 6 | 3: the
 * pieces combined as the all_reduces would (max, sum, sum) give the loss of
 * the whole, and each shard's backward is its columns of the whole backward. */
Test(kernels, vocab_parallel_matches_whole, .timeout = 30)
{
    enum { R = 5, C = 13, NS = 3 };
    const int64_t width[NS] = {4, 6, 3}, off[NS] = {0, 4, 10};
    /* targets in every shard, on shard edges, and an ignored row */
    const int64_t t[R] = {2, 4, IGNORE, 12, 9};
    for (int big = 0; big < 2; big++)
        for (int weighted = 0; weighted < 2; weighted++) {
            float x[R * C], w[C], gl[R], loss[R], gx[R * C];
            fill_logits(x, R * C, 510 + (uint64_t)big, big);
            fill(w, C, 511, 0.5, 2.0);
            fill(gl, R, 512, 0.1, 1.0);
            const float *wp = weighted ? w : NULL;
            double wsum;
            tp__k_cross_entropy_fwd(x, t, wp, loss, R, C, 1, IGNORE, &wsum);
            tp__k_cross_entropy_bwd(x, t, wp, gl, gx, R, C, 1, IGNORE);

            float xs[NS][R * C], M[R], S[R] = {0}, P[R] = {0}, piece[R];
            for (int s = 0; s < NS; s++)
                for (int r = 0; r < R; r++)
                    for (int64_t c = 0; c < width[s]; c++)
                        xs[s][r * width[s] + c] = x[r * C + off[s] + c];
            for (int r = 0; r < R; r++)
                M[r] = -INFINITY;
            for (int s = 0; s < NS; s++) { /* all_reduce(max) */
                tp__k_row_max(xs[s], piece, R, width[s], 1);
                for (int r = 0; r < R; r++)
                    M[r] = fmaxf(M[r], piece[r]);
            }
            for (int s = 0; s < NS; s++) { /* all_reduce(sum) */
                tp__k_row_sumexp(xs[s], M, piece, R, width[s], 1);
                for (int r = 0; r < R; r++)
                    S[r] += piece[r];
            }
            for (int s = 0; s < NS; s++) { /* all_reduce(sum) */
                tp__k_pick_target(xs[s], t, piece, R, width[s], 1, off[s], IGNORE);
                for (int r = 0; r < R; r++)
                    P[r] += piece[r];
            }
            double combined[R], xsd[NS][R * C], xd[R * C], wd[C], gld[R], ld[R];
            double *xsp[NS] = {xsd[0], xsd[1], xsd[2]};
            for (int s = 0; s < NS; s++)
                to_double(xs[s], xsd[s], R * width[s]);
            to_double(w, wd, C);
            to_double(gl, gld, R);
            vocab_ctx vc = {R, C, NS, width, off, t, xsp, xd, weighted ? wd : NULL, gld, ld};
            for (int r = 0; r < R; r++)
                combined[r] = t[r] == IGNORE ? 0.0
                                             : (weighted ? (double)w[t[r]] : 1.0) *
                                                   (log((double)S[r]) + M[r] - P[r]);
            char what[80];
            snprintf(what, sizeof what, "vocab parallel loss big=%d weighted=%d", big, weighted);
            check_close(what, loss, combined, R, 1e-5, 1e-5);

            for (int s = 0; s < NS; s++) {
                float gs[R * C];
                double want[R * C];
                for (int r = 0; r < R; r++)
                    for (int64_t c = 0; c < width[s]; c++)
                        want[r * width[s] + c] = gx[r * C + off[s] + c];
                fill_const(gs, R * width[s], NAN);
                tp__k_vocab_ce_bwd(xs[s], t, wp, M, S, gl, gs, R, width[s], 1, off[s], IGNORE);
                snprintf(what, sizeof what, "vocab_ce_bwd shard %d big=%d weighted=%d", s, big,
                         weighted);
                check_close(what, gs, want, R * width[s], 1e-5, 1e-6);
                check_fd(what, vocab_loss, &vc, xsd[s], R * width[s], gs, 1e-4);
            }
        }
}

/* Logits laid out [outer, classes, inner] (the class dim of (N, C, d1, ...))
 * give, row by row, what the same rows laid out contiguously [rows, classes]
 * give: every cross-entropy kernel, the vocab pieces on a class shard too. */
Test(kernels, cross_entropy_strided_classes_match_contiguous, .timeout = 30)
{
    enum { O = 3, C = 7, IN = 5, R = O * IN, N = O * C * IN };
    float x[N], xt[R * C], w[C], gl[R], l1[R], l2[R], g1[N], g2[R * C], back[N];
    double want[N];
    int64_t t[R];
    fill_logits(x, N, 520, false);
    fill(w, C, 521, 0.5, 2.0);
    fill(gl, R, 522, 0.1, 1.0);
    for (int r = 0; r < R; r++) /* row r = o * IN + i holds x[o, :, i] */
        for (int c = 0; c < C; c++)
            xt[r * C + c] = x[(r / IN * C + c) * IN + r % IN];
    for (int r = 0; r < R; r++)
        t[r] = r % 4 == 3 ? IGNORE : (int64_t)(tp_rng_uniform(523, (uint64_t)r) * C);
    double ws1 = -1, ws2 = -2;
    tp__k_cross_entropy_fwd(x, t, w, l1, R, C, IN, IGNORE, &ws1);
    tp__k_cross_entropy_fwd(xt, t, w, l2, R, C, 1, IGNORE, &ws2);
    to_double(l2, want, R);
    check_close("strided cross_entropy loss", l1, want, R, 1e-6, 0);
    cr_assert_eq(ws1, ws2);
    fill_const(g1, N, NAN);
    tp__k_cross_entropy_bwd(x, t, w, gl, g1, R, C, IN, IGNORE);
    tp__k_cross_entropy_bwd(xt, t, w, gl, g2, R, C, 1, IGNORE);
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            back[(r / IN * C + c) * IN + r % IN] = g2[r * C + c];
    to_double(back, want, N);
    check_close("strided cross_entropy gradient", g1, want, N, 1e-6, 0);

    /* a class shard holding global classes [2, 6), its local logits the first 4 of x */
    enum { W = 4, OFF = 2 };
    float xs[O * W * IN], xst[R * W], m1[R], m2[R], s1[R], s2[R], p1[R], p2[R];
    float v1[O * W * IN], v2[R * W];
    for (int o = 0; o < O; o++)
        for (int c = 0; c < W; c++)
            for (int i = 0; i < IN; i++)
                xs[(o * W + c) * IN + i] = x[(o * C + c) * IN + i];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < W; c++)
            xst[r * W + c] = xs[(r / IN * W + c) * IN + r % IN];
    tp__k_row_max(xs, m1, R, W, IN);
    tp__k_row_max(xst, m2, R, W, 1);
    tp__k_row_sumexp(xs, m2, s1, R, W, IN);
    tp__k_row_sumexp(xst, m2, s2, R, W, 1);
    tp__k_pick_target(xs, t, p1, R, W, IN, OFF, IGNORE);
    tp__k_pick_target(xst, t, p2, R, W, 1, OFF, IGNORE);
    for (int r = 0; r < R; r++)
        cr_assert(m1[r] == m2[r] && p1[r] == p2[r], "row %d: max %g vs %g, picked %g vs %g", r,
                  m1[r], m2[r], p1[r], p2[r]);
    to_double(s2, want, R);
    check_close("strided row_sumexp", s1, want, R, 1e-6, 0);
    fill_const(v1, O * W * IN, NAN);
    tp__k_vocab_ce_bwd(xs, t, w, m2, s2, gl, v1, R, W, IN, OFF, IGNORE);
    tp__k_vocab_ce_bwd(xst, t, w, m2, s2, gl, v2, R, W, 1, OFF, IGNORE);
    for (int r = 0; r < R; r++)
        for (int c = 0; c < W; c++)
            back[(r / IN * W + c) * IN + r % IN] = v2[r * W + c];
    to_double(back, want, O * W * IN);
    check_close("strided vocab_ce_bwd", v1, want, O * W * IN, 1e-6, 0);
}

/* The vectorized GELU (no libm in the loop) against the f64 formulas over a
 * dense sweep of [-10, 10], to the bound docs/API.md states (1e-6 absolute,
 * forward and gradient), and its values at the edges. */
Test(kernels, gelu_dense_sweep_and_edges, .timeout = 60)
{
    const int64_t n = 1 << 21;
    float *x = falloc(n), *y = falloc(n), *one = falloc(n), *gx = falloc(n);
    for (int64_t i = 0; i < n; i++) {
        x[i] = (float)(-10.0 + 20.0 * (double)i / (double)(n - 1));
        one[i] = 1.0f;
    }
    for (int approx = 0; approx < 2; approx++) {
        tp__k_gelu_fwd(x, y, n, approx);
        tp__k_gelu_bwd(x, one, gx, n, approx);
        double ef = 0, eb = 0;
        for (int64_t i = 0; i < n; i++) {
            ef = fmax(ef, fabs((double)y[i] - ref_gelu(x[i], approx)));
            eb = fmax(eb, fabs((double)gx[i] - ref_gelu_grad(x[i], approx)));
        }
        cr_assert(ef <= 1e-6, "gelu_fwd approx=%d: max abs error %.3g over [-10, 10]", approx, ef);
        cr_assert(eb <= 1e-6, "gelu_bwd approx=%d: max abs error %.3g over [-10, 10]", approx, eb);
        /* edges: +inf -> inf (gradient 1), -inf and large negative -> -0
         * (gradient ~0), large positive -> x, NaN -> NaN, 0 -> 0 (gradient 1/2) */
        float e[] = {INFINITY, -INFINITY, NAN, 1e30f, -1e30f, 0.0f, 30.0f, -30.0f};
        float ey[8], eg[8], e1[8] = {1, 1, 1, 1, 1, 1, 1, 1};
        tp__k_gelu_fwd(e, ey, 8, approx);
        tp__k_gelu_bwd(e, e1, eg, 8, approx);
        cr_assert(ey[0] == INFINITY && eg[0] == 1.0f, "gelu(+inf) = %g, grad %g", ey[0], eg[0]);
        cr_assert(ey[1] == 0.0f && fabsf(eg[1]) < 1e-30f, "gelu(-inf) = %g, grad %g", ey[1], eg[1]);
        cr_assert(isnan(ey[2]) && isnan(eg[2]), "gelu(NaN) = %g, grad %g", ey[2], eg[2]);
        cr_assert(ey[3] == 1e30f && eg[3] == 1.0f, "gelu(1e30) = %g, grad %g", ey[3], eg[3]);
        cr_assert(ey[4] == 0.0f && fabsf(eg[4]) < 1e-30f, "gelu(-1e30) = %g, grad %g", ey[4], eg[4]);
        cr_assert(ey[5] == 0.0f && eg[5] == 0.5f, "gelu(0) = %g, grad %g", ey[5], eg[5]);
        cr_assert(ey[6] == 30.0f && eg[6] == 1.0f, "gelu(30) = %g, grad %g", ey[6], eg[6]);
        cr_assert(ey[7] == 0.0f && fabsf(eg[7]) < 1e-30f, "gelu(-30) = %g, grad %g", ey[7], eg[7]);
    }
    free(x), free(y), free(one), free(gx);
}

/* Softmax's exp is the same approximation: one row sweeping [-104, 0] in
 * steps of 1/64 against the f64 softmax, 1e-6 relative plus 1e-30. */
Test(kernels, softmax_exp_dense_sweep, .timeout = 30)
{
    const int64_t n = 104 * 64 + 1;
    float *x = falloc(n), *y = falloc(n);
    double *xd = dalloc(n), *yd = dalloc(n);
    for (int64_t i = 0; i < n; i++)
        x[i] = -(float)i / 64.0f;
    to_double(x, xd, n);
    tp__k_softmax_fwd(x, y, 1, n);
    ref_softmax(xd, yd, 1, n);
    check_close("softmax exp sweep", y, yd, n, 1e-6, 1e-30);
    free(x), free(y), free(xd), free(yd);
}

/* Cross entropy's exp is tp__expf too (vectorized in blocks, each summed in
 * double): rows of 104 * 64 + 1 logits sweeping [-104, 0] in steps of 1/64,
 * contiguous and with the classes at stride 3 (inner 3), plus -inf logits,
 * against the f64 loss and gradient. Bound: 1e-6 relative on the loss (plus
 * 1e-6 absolute, a loss near 0), 1e-6 of the gradient's largest entry plus
 * 1e-6 relative per entry; -inf logits get exactly 0 gradient. The vocab
 * pieces' row_sumexp and vocab_ce_bwd on the same rows: 1e-6 relative. */
Test(kernels, cross_entropy_exp_dense_sweep, .timeout = 60)
{
    enum { C = 104 * 64 + 1, R = 3 };
    const int64_t inners[2] = {1, 3};
    for (int li = 0; li < 2; li++) {
        int64_t inner = inners[li], rows = R * inner, n = (int64_t)R * C * inner;
        float *x = falloc(n), *loss = falloc(rows), *gl = falloc(rows), *gx = falloc(n);
        double *xd = dalloc((int64_t)rows * C), *ld = dalloc(rows), *gld = dalloc(rows);
        double *gxd = dalloc((int64_t)rows * C);
        int64_t t[R * 3];
        /* row r = o * inner + i holds x[o, :, i]; its classes sweep [-104, 0]
         * shifted by r, and every 7th class of row 1 is -inf */
        for (int64_t r = 0; r < rows; r++) {
            int64_t o = r / inner, i = r % inner;
            for (int64_t c = 0; c < C; c++) {
                float v = -(float)((c * 37 + r * 11) % C) / 64.0f + (float)r;
                if (r == 1 && c % 7 == 0)
                    v = -INFINITY;
                x[(o * C + c) * inner + i] = v;
                xd[r * C + c] = v;
            }
            t[r] = (r * 1234 + 5) % C;
            if (r == 1 && t[r] % 7 == 0)
                t[r]++;
            gl[r] = 0.5f + 0.25f * (float)r;
            gld[r] = gl[r];
        }
        char what[64];
        snprintf(what, sizeof what, "cross_entropy sweep inner=%lld", (long long)inner);
        tp__k_cross_entropy_fwd(x, t, NULL, loss, rows, C, inner, IGNORE, NULL);
        ref_ce(xd, t, NULL, ld, rows, C);
        check_close(what, loss, ld, rows, 1e-6, 1e-6);
        tp__k_cross_entropy_bwd(x, t, NULL, gl, gx, rows, C, inner, IGNORE);
        ref_ce_bwd(xd, t, NULL, gld, gxd, rows, C);
        float *gxr = falloc((int64_t)rows * C); /* gx in row order */
        for (int64_t r = 0; r < rows; r++)
            for (int64_t c = 0; c < C; c++)
                gxr[r * C + c] = gx[((r / inner) * C + c) * inner + r % inner];
        check_close(what, gxr, gxd, (int64_t)rows * C, 1e-6, 1e-6 * maxabs(gxd, rows * C));
        for (int64_t c = 0; c < C; c += 7)
            cr_assert(gxr[1 * C + c] == 0.0f, "%s: -inf logit %lld: gradient %g", what,
                      (long long)c, (double)gxr[1 * C + c]);

        /* the vocab-parallel pieces on the same rows, one shard of all classes */
        float *mx = falloc(rows), *se = falloc(rows), *gv = falloc(n);
        tp__k_row_max(x, mx, rows, C, inner);
        tp__k_row_sumexp(x, mx, se, rows, C, inner);
        for (int64_t r = 0; r < rows; r++) {
            double want = 0;
            for (int64_t c = 0; c < C; c++)
                want += exp(xd[r * C + c] - (double)mx[r]);
            cr_assert(fabs(se[r] - want) <= 1e-6 * want, "%s: sumexp row %lld: %.9g vs %.9g", what,
                      (long long)r, (double)se[r], want);
        }
        tp__k_vocab_ce_bwd(x, t, NULL, mx, se, gl, gv, rows, C, inner, 0, IGNORE);
        for (int64_t r = 0; r < rows; r++)
            for (int64_t c = 0; c < C; c++)
                gxr[r * C + c] = gv[((r / inner) * C + c) * inner + r % inner];
        check_close(what, gxr, gxd, (int64_t)rows * C, 1e-6, 1e-6 * maxabs(gxd, rows * C));
        free(x), free(loss), free(gl), free(gx), free(xd), free(ld), free(gld), free(gxd);
        free(gxr), free(mx), free(se), free(gv);
    }
}

/* Rows longer than the vector blocks and not a multiple of 8 (the eight
 * double lanes of the norms' sums and their tails): the bounds of
 * check_norm (y 1e-5, gx 1e-4 of its scale, gw/gb 1e-5 of their largest). */
Test(kernels, norms_long_rows, .timeout = 60)
{
    const int64_t cols[] = {8, 9, 1031, 4099};
    for (int ci = 0; ci < 4; ci++)
        for (int aff = 0; aff < 4; aff++) {
            check_norm(false, 3, cols[ci], aff & 1, aff & 2, 700 + (uint64_t)ci);
            check_norm(true, 3, cols[ci], aff & 1, false, 710 + (uint64_t)ci);
        }
}

/* The dropout kernel's inlined Philox and integer keep test against the
 * public tp_rng_uniform(seed, g) >= p, bit for bit: runs longer than its
 * 256-element blocks, a block of a global tensor (offsets), and p at the
 * edges of the float range (tiny, just below 1, a power of two whose
 * threshold p 2^53 is an integer). */
Test(kernels, dropout_long_runs_match_rng_exactly, .timeout = 60)
{
    const int64_t gshape[2] = {5, 1000}, shape[2] = {3, 777}, off[2] = {1, 201};
    const int64_t n = 3 * 777;
    const float ps[] = {1e-9f, 0x1.0p-30f, 0.25f, 0.5f, 0.7f, 0.999f, 0x1.fffffep-1f};
    const uint64_t seed = 0x123456789abcdefull;
    float *x = falloc(n), *y = falloc(n), *gx = falloc(n);
    uint8_t *mask = malloc((size_t)n);
    cr_assert_not_null(mask);
    fill(x, n, 800, -1, 1);
    for (int pi = 0; pi < (int)(sizeof ps / sizeof ps[0]); pi++) {
        float p = ps[pi], scale = 1.0f / (1.0f - p);
        tp__k_dropout_fwd(x, y, mask, 2, shape, gshape, off, p, seed);
        tp__k_dropout_bwd(x, mask, gx, n, p);
        for (int64_t r = 0; r < shape[0]; r++)
            for (int64_t c = 0; c < shape[1]; c++) {
                int64_t i = r * shape[1] + c;
                uint64_t g = (uint64_t)((r + off[0]) * gshape[1] + c + off[1]);
                bool keep = tp_rng_uniform(seed, g) >= (double)p;
                cr_assert_eq(mask[i], keep, "p %a: mask at (%lld, %lld)", (double)p, (long long)r,
                             (long long)c);
                float want = keep ? x[i] * scale : 0.0f;
                cr_assert(y[i] == want && gx[i] == want, "p %a: at %lld: y %a gx %a, want %a",
                          (double)p, (long long)i, (double)y[i], (double)gx[i], (double)want);
            }
    }
    free(x), free(y), free(gx), free(mask);
}

/* The vectorized SiLU and SwiGLU (the sigmoid from the polynomial exp of
 * -|x|) against the f64 formulas over a dense sweep of [-20, 20]: relative
 * error at most 1e-6 for silu (of the terms s + |x s (1 - s)| for its
 * gradient, which cancels near x = -1.28); swiglu's three outputs are
 * silu's values times up and gy, in f32. */
static double ref_sig(double x, double *om)
{
    double e = exp(-fabs(x)), d = 1.0 / (1.0 + e);
    *om = x >= 0 ? e * d : d;
    return x >= 0 ? d : e * d;
}

Test(kernels, silu_swiglu_dense_sweep, .timeout = 60)
{
    const int64_t n = 1 << 21;
    float *x = falloc(n), *y = falloc(n), *g = falloc(n), *gx = falloc(n), *u = falloc(n),
          *gu = falloc(n);
    for (int64_t i = 0; i < n; i++) {
        x[i] = (float)(-20.0 + 40.0 * (double)i / (double)(n - 1));
        g[i] = 1.0f - (float)(i % 7) * 0.25f;
        u[i] = 0.5f + (float)(i % 5) * 0.75f;
    }
    tp__k_silu_fwd(x, y, n);
    tp__k_silu_bwd(x, g, gx, n);
    double ef = 0, eb = 0;
    for (int64_t i = 0; i < n; i++) {
        double om, s = ref_sig(x[i], &om), terms = s + fabs(x[i] * s * om);
        double wy = x[i] * s, wg = g[i] * (s + x[i] * s * om);
        ef = fmax(ef, fabs((double)y[i] - wy) / fmax(fabs(wy), 1e-30));
        if (g[i] != 0.0f)
            eb = fmax(eb, fabs((double)gx[i] - wg) / (fabs(g[i]) * terms));
    }
    cr_log_info("silu: max relative error %.3g forward, %.3g gradient (of its terms)", ef, eb);
    cr_assert(ef <= 1e-6, "silu_fwd: max relative error %.3g over [-20, 20]", ef);
    cr_assert(eb <= 1e-6, "silu_bwd: max relative error %.3g over [-20, 20]", eb);
    float *sy = falloc(n), *sgg = falloc(n);
    tp__k_swiglu_fwd(x, u, sy, n);
    tp__k_swiglu_bwd(x, u, g, sgg, gu, n);
    for (int64_t i = 0; i < n; i++) {
        cr_assert(sy[i] == y[i] * u[i], "swiglu(%g, %g) = %.9g, silu * up = %.9g", x[i], u[i],
                  sy[i], y[i] * u[i]);
        cr_assert(gu[i] == g[i] * y[i], "d up at %g", x[i]);
        double om, s = ref_sig(x[i], &om), terms = s + fabs(x[i] * s * om);
        double wgg = (double)g[i] * u[i] * (s + x[i] * s * om);
        cr_assert(fabs((double)sgg[i] - wgg) <= 2e-6 * fabs((double)g[i] * u[i]) * terms,
                  "d gate at (%g, %g) = %.9g, want %.9g", x[i], u[i], sgg[i], wgg);
    }
    free(x), free(y), free(g), free(gx), free(u), free(gu), free(sy), free(sgg);
}

/* ---- attention softmax ---------------------------------------------------------------- */

/* The masked safe softmax in double: `batch` blocks of [rows, Sk], row r of
 * a block being query r % Sq; key j visible iff (!causal or j <= off + i)
 * and the block's pad row (b / pad_div) is not 0 there; a row with nothing
 * visible (or only -inf) is 0. */
static void ref_attn_softmax(const double *x, double *y, int64_t batch, int64_t rows, int64_t Sq,
                             int64_t Sk, int64_t off, bool causal, const int64_t *pad,
                             int64_t pad_div)
{
    for (int64_t b = 0; b < batch; b++)
        for (int64_t r = 0; r < rows; r++) {
            const double *xr = x + (b * rows + r) * Sk;
            double *yr = y + (b * rows + r) * Sk, mx = -INFINITY, sum = 0;
            int64_t i = r % Sq;
            for (int64_t j = 0; j < Sk; j++) {
                bool vis = (!causal || j <= off + i) && (!pad || pad[b / pad_div * Sk + j] != 0);
                yr[j] = vis ? xr[j] : -INFINITY;
                mx = fmax(mx, yr[j]);
            }
            for (int64_t j = 0; j < Sk; j++)
                sum += (yr[j] = mx == -INFINITY ? 0 : exp(yr[j] - mx));
            for (int64_t j = 0; j < Sk; j++)
                yr[j] = sum > 0 ? yr[j] / sum : 0;
        }
}

typedef struct {
    int64_t batch, n_rep, Sq, Sk, off;
    bool causal, pad;
    int64_t pad_div;
} attn_geo;

/* Every geometry the attention op hands the kernel: none, square causal,
 * grouped rows with a key offset (chunked prefill), decode (Sq 1), an
 * offset past the keys, padding alone and with causal; the pads (left
 * padding of b % 4 keys, one pad row all 0) leave rows with no key. Against
 * the double reference; without masks bit for bit softmax_fwd, square causal
 * causal_mask + softmax_fwd to an ulp; i32 pads as i64; a call on rows
 * [r0, r0 + nr) as the same rows of a whole call. */
Test(kernels, attn_softmax_masks_offsets_groups_and_empty_rows, .timeout = 60)
{
    const attn_geo geos[] = {
        {2, 1, 7, 7, 0, false, false, 1}, {3, 1, 17, 17, 0, true, false, 1},
        {4, 3, 5, 9, 4, true, true, 2},   {4, 4, 1, 17, 16, true, true, 1},
        {2, 2, 3, 9, 30, true, false, 1}, {6, 1, 4, 6, 0, false, true, 3},
        {4, 2, 6, 6, 0, true, true, 1},
    };
    for (size_t gi = 0; gi < sizeof geos / sizeof geos[0]; gi++) {
        const attn_geo *g = &geos[gi];
        int64_t rows = g->n_rep * g->Sq, n = g->batch * rows * g->Sk;
        int64_t npad = g->batch / g->pad_div * g->Sk;
        float *x = falloc(n), *y = falloc(n), *z = falloc(n);
        double *xd = dalloc(n), *yd = dalloc(n);
        int64_t *pad = calloc((size_t)npad, sizeof *pad);
        int32_t *pad32 = calloc((size_t)npad, sizeof *pad32);
        fill(x, n, 900 + gi, -6, 6);
        x[1] = -INFINITY; /* a visible -inf key (0 after the softmax) */
        for (int64_t p = 0; p < npad; p++) {
            int64_t b = p / g->Sk, j = p % g->Sk;
            pad[p] = b == 1 ? 0 : j >= b % 4 ? 1 + (p % 3) : 0;
            pad32[p] = (int32_t)pad[p];
        }
        to_double(x, xd, n);
        const int64_t *pp = g->pad ? pad : NULL;
        char what[96];
        snprintf(what, sizeof what, "attn_softmax geometry %zu", gi);
        memcpy(y, x, (size_t)n * sizeof *y);
        tp__k_attn_softmax(y, 0, g->batch * rows, rows, g->Sq, g->Sk, g->off, g->causal, pp,
                           false, g->pad_div);
        ref_attn_softmax(xd, yd, g->batch, rows, g->Sq, g->Sk, g->off, g->causal, pp, g->pad_div);
        check_close(what, y, yd, n, 1e-5, 1e-7);
        bool empty_row = false;
        for (int64_t r = 0; r < g->batch * rows; r++) {
            double s = 0;
            for (int64_t j = 0; j < g->Sk; j++)
                s += y[r * g->Sk + j];
            empty_row |= s == 0;
        }
        cr_assert(empty_row == g->pad, "%s: rows with no key %s", what,
                  g->pad ? "missing" : "where none should be");
        if (g->pad) {
            memcpy(z, x, (size_t)n * sizeof *z);
            tp__k_attn_softmax(z, 0, g->batch * rows, rows, g->Sq, g->Sk, g->off, g->causal,
                               pad32, true, g->pad_div);
            check_same("attn_softmax i32 pad", z, y, n);
        }
        if (!g->pad && !g->causal) {
            tp__k_softmax_fwd(x, z, g->batch * rows, g->Sk);
            check_same("attn_softmax without masks vs softmax_fwd", y, z, n);
        }
        if (!g->pad && g->causal && g->off == 0 && g->Sq == g->Sk && g->n_rep == 1) {
            memcpy(z, x, (size_t)n * sizeof *z);
            tp__k_causal_mask(z, g->batch, g->Sq);
            tp__k_softmax_fwd(z, z, g->batch * rows, g->Sk);
            /* the same exps; the double sums may differ in their last bit */
            double *zd = dalloc(n);
            to_double(z, zd, n);
            check_close("attn_softmax causal vs causal_mask + softmax_fwd", y, zd, n, 0x1p-22, 0);
            free(zd);
        }
        int64_t r0 = rows + 1, nr = g->batch * rows - r0; /* a block's tail onwards */
        if (nr > 0) {
            memcpy(z, x, (size_t)n * sizeof *z);
            tp__k_attn_softmax(z + r0 * g->Sk, r0, nr, rows, g->Sq, g->Sk, g->off, g->causal, pp,
                               false, g->pad_div);
            check_same("attn_softmax on a row range", z + r0 * g->Sk, y + r0 * g->Sk,
                       nr * g->Sk);
        }
        free(x), free(y), free(z), free(xd), free(yd), free(pad), free(pad32);
    }
}
