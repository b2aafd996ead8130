/* The CPU engine of the local kernels (kernels.h): OpenBLAS sgemm for the
 * matrix products, plain loops for the rest.
 *
 * Reductions accumulate in double and store float. Column sums over rows (the
 * bias and norm-weight gradients, sum over a non-innermost dim) go through a
 * block of double accumulators on the stack, so they stay row-major and
 * vectorizable without allocating (kernels never allocate).
 *
 * This file may use only public libtp symbols and header-only internals
 * (core/philox.h): the kernel test compiles it into its own executable,
 * which links the shared library, where everything not TP_API is hidden. */
#include <cblas.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "core/philox.h"
#include "kernels/cpu.h"
#include "tp/tensor.h"

/* The exp-heavy element-wise kernels below (GELU, softmax, cross entropy,
 * dropout; not the norms, whose backward ran 1.6x slower in the AVX-512
 * copy here) are compiled three times, for
 * x86-64-v4 (AVX-512), x86-64-v3 (AVX2) and the baseline (SSE2), and the
 * loader picks the widest the CPU has (GCC's target_clones, an ifunc): the
 * build targets the baseline, whose 4-wide loops ran the tanh GELU 3-4x
 * slower than the AVX-512 copy. The results are the same in every copy: the
 * loops are not reductions and C11 mode does not contract a * b + c into an
 * FMA (-ffp-contract=off), so each element gets the same operations. */
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12 && defined(__x86_64__) && \
    defined(__ELF__) && !defined(__SANITIZE_THREAD__)
/* (not under ThreadSanitizer: an ifunc resolver runs before TSan's runtime
 * is up and the process dies at load) */
#define TP__VEC_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define TP__VEC_CLONES
#endif
/* TP__CLONED(name, (params), (args)) { body }: the kernel `name` runs body
 * in its three copies. The copies live in a static function (name_v): GCC
 * 12 gives the ifunc of an external target_clones function default
 * visibility whatever is asked, which would export the kernel from
 * libtp.so; a static one stays local. */
#define TP__CLONED(name, params, args)          \
    static TP__VEC_CLONES void name##_v params; \
    void name params                            \
    {                                           \
        name##_v args;                          \
    }                                           \
    static TP__VEC_CLONES void name##_v params

/* Column block of the double accumulators: 4 KiB of stack. */
#define TP__KCOLS 512

/* ---- helpers ---------------------------------------------------------------- */

/* Sum of n floats in double. Eight independent lanes break the dependency
 * chain so the compiler can vectorize without reassociating a single sum. */
static double tp__dsum(const float *restrict x, int64_t n)
{
    double acc[8] = {0};
    int64_t n8 = n - n % 8;
    for (int64_t i = 0; i < n8; i += 8)
        for (int j = 0; j < 8; j++)
            acc[j] += (double)x[i + j];
    double s = 0;
    for (int64_t i = n8; i < n; i++)
        s += (double)x[i];
    return s + ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

/* Sum of a[i] * b[i] in double. */
static double tp__ddot(const float *restrict a, const float *restrict b, int64_t n)
{
    double acc[8] = {0};
    int64_t n8 = n - n % 8;
    for (int64_t i = 0; i < n8; i += 8)
        for (int j = 0; j < 8; j++)
            acc[j] += (double)a[i + j] * (double)b[i + j];
    double s = 0;
    for (int64_t i = n8; i < n; i++)
        s += (double)a[i] * (double)b[i];
    return s + ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

/* Sum of (x[i] - mu)^2 in double, in eight lanes as tp__dsum. */
static double tp__dsumsq_dev(const float *restrict x, double mu, int64_t n)
{
    double acc[8] = {0};
    int64_t n8 = n - n % 8;
    for (int64_t i = 0; i < n8; i += 8)
        for (int j = 0; j < 8; j++) {
            double d = (double)x[i + j] - mu;
            acc[j] += d * d;
        }
    double s = 0;
    for (int64_t i = n8; i < n; i++)
        s += ((double)x[i] - mu) * ((double)x[i] - mu);
    return s + ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

/* sum g[i] w[i] xhat[i] in double, xhat = (x - m) rs rounded to float as
 * the forward's (m 0 for the RMS norm), in eight lanes as tp__dsum; w NULL:
 * 1 (a loop of its own, so that neither has a branch and both vectorize). */
static double tp__norm_gxhat(const float *restrict g, const float *restrict w,
                             const float *restrict x, float m, float rs, int64_t n)
{
    double b[8] = {0};
    int64_t n8 = n - n % 8;
    if (w)
        for (int64_t i = 0; i < n8; i += 8)
            for (int j = 0; j < 8; j++)
                b[j] += (double)g[i + j] * (double)w[i + j] * (double)((x[i + j] - m) * rs);
    else
        for (int64_t i = 0; i < n8; i += 8)
            for (int j = 0; j < 8; j++)
                b[j] += (double)g[i + j] * (double)((x[i + j] - m) * rs);
    for (int64_t i = n8; i < n; i++)
        b[0] += (double)g[i] * (w ? (double)w[i] : 1.0) * (double)((x[i] - m) * rs);
    return ((b[0] + b[1]) + (b[2] + b[3])) + ((b[4] + b[5]) + (b[6] + b[7]));
}

/* g[c] (+)= sum_r y[r * ld + c] for a [rows, cols] matrix with row length ld;
 * overwriting, the sum is divided by div before its one rounding. */
static void tp__colsum(const float *restrict y, int64_t rows, int64_t cols, int64_t ld,
                       float *restrict g, bool accumulate, double div)
{
    double acc[TP__KCOLS];
    for (int64_t c0 = 0; c0 < cols; c0 += TP__KCOLS) {
        int64_t nc = cols - c0 < TP__KCOLS ? cols - c0 : TP__KCOLS;
        for (int64_t j = 0; j < nc; j++)
            acc[j] = 0;
        for (int64_t r = 0; r < rows; r++) {
            const float *restrict yr = y + r * ld + c0;
            for (int64_t j = 0; j < nc; j++)
                acc[j] += (double)yr[j];
        }
        if (accumulate)
            for (int64_t j = 0; j < nc; j++)
                g[c0 + j] = (float)((double)g[c0 + j] + acc[j]);
        else
            for (int64_t j = 0; j < nc; j++)
                g[c0 + j] = (float)(acc[j] / div);
    }
}

static float tp__rowmax(const float *restrict x, int64_t n)
{
    float m = -INFINITY;
    for (int64_t i = 0; i < n; i++)
        m = x[i] > m ? x[i] : m;
    return m;
}

/* ---- matrix products -------------------------------------------------------- */

void tp__k_gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                const float *a, int64_t lda, const float *b, int64_t ldb, float beta, float *c,
                int64_t ldc)
{
    if (m <= 0 || n <= 0)
        return;
    if (k <= 0) {
        /* C = beta * C; BLAS would reject the zero leading dimensions of
         * empty A and B, and beta == 0 must overwrite (even NaN) */
        for (int64_t i = 0; i < m; i++) {
            float *restrict ci = c + i * ldc;
            if (beta == 0.0f)
                memset(ci, 0, (size_t)n * sizeof *ci);
            else
                for (int64_t j = 0; j < n; j++)
                    ci[j] *= beta;
        }
        return;
    }
    if (m == 1 || n == 1) {
        /* a matrix-vector product (a decode step's projections: one row per
         * sequence): sgemv streams the matrix at the memory's rate, where
         * sgemm with one row runs at about half of it (OpenBLAS 0.3) */
        if (beta == 0.0f) /* overwrite, NaN included, as sgemm does */
            for (int64_t i = 0; i < (m == 1 ? n : m); i++)
                c[m == 1 ? i : i * ldc] = 0.0f;
        if (m == 1) /* c[1, n] = op(A)[1, k] op(B)[k, n] */
            cblas_sgemv(CblasRowMajor, trans_b ? CblasNoTrans : CblasTrans,
                        (int)(trans_b ? n : k), (int)(trans_b ? k : n), alpha, b, (int)ldb, a,
                        trans_a ? (int)lda : 1, beta, c, 1);
        else /* c[m, 1] = op(A)[m, k] op(B)[k, 1] */
            cblas_sgemv(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
                        (int)(trans_a ? k : m), (int)(trans_a ? m : k), alpha, a, (int)lda, b,
                        trans_b ? 1 : (int)ldb, beta, c, (int)ldc);
        return;
    }
    cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
                trans_b ? CblasTrans : CblasNoTrans, (int)m, (int)n, (int)k, alpha, a, (int)lda,
                b, (int)ldb, beta, c, (int)ldc);
}

void tp__k_linear_fwd(const float *x, const float *w, const float *bias, float *y, int64_t rows,
                      int64_t in, int64_t out)
{
    tp__k_gemm(false, true, rows, out, in, 1.0f, x, in, w, in, 0.0f, y, out);
    if (bias)
        tp__k_add_row(y, bias, rows, out);
}

void tp__k_linear_bwd(const float *x, const float *w, const float *gy, float *gx, float *gw,
                      float *gb, int64_t rows, int64_t in, int64_t out, bool accumulate)
{
    float beta = accumulate ? 1.0f : 0.0f;
    if (gx) /* gx[rows, in] = gy[rows, out] W[out, in] */
        tp__k_gemm(false, false, rows, in, out, 1.0f, gy, out, w, in, beta, gx, in);
    if (gw) /* gw[out, in] = gy^T x[rows, in] */
        tp__k_gemm(true, false, out, in, rows, 1.0f, gy, out, x, in, beta, gw, in);
    if (gb)
        tp__colsum(gy, rows, out, out, gb, accumulate, 1.0);
}

/* ---- elementwise -------------------------------------------------------------
 * No restrict here: the output may be one of the inputs (in place, kernels.h);
 * the compiler vectorizes behind a runtime overlap check. */

void tp__k_add(const float *a, const float *b, float *y, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        y[i] = a[i] + b[i];
}

void tp__k_mul(const float *a, const float *b, float *y, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        y[i] = a[i] * b[i];
}

void tp__k_scale(const float *a, float s, float *y, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        y[i] = a[i] * s;
}

void tp__k_accumulate(float *y, const float *a, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        y[i] += a[i];
}

void tp__k_fill(float *y, float value, int64_t n)
{
    if (n <= 0)
        return;
    if (value == 0.0f && !signbit(value)) {
        memset(y, 0, (size_t)n * sizeof *y);
        return;
    }
    for (int64_t i = 0; i < n; i++)
        y[i] = value;
}

void tp__k_add_row(float *y, const float *b, int64_t rows, int64_t cols)
{
    for (int64_t r = 0; r < rows; r++) {
        float *restrict yr = y + r * cols;
        for (int64_t c = 0; c < cols; c++)
            yr[c] += b[c];
    }
}

/* ---- broadcasting ------------------------------------------------------------ */

/* Steps an odometer over the n dims of shape (idx starts at zeros), moving two
 * offsets by their strides; false once it wraps around. */
static inline bool tp__odo_next(int n, const int64_t *shape, int64_t *idx, const int64_t *s0,
                                int64_t *o0, const int64_t *s1, int64_t *o1)
{
    for (int d = n - 1; d >= 0; d--) {
        *o0 += s0[d];
        *o1 += s1[d];
        if (++idx[d] < shape[d])
            return true;
        *o0 -= s0[d] * shape[d];
        *o1 -= s1[d] * shape[d];
        idx[d] = 0;
    }
    return false;
}

/* y = a OP b over rows of the innermost dim, in y's (contiguous) order. The
 * unit/zero-stride rows are the ones the op layer's dim merging leaves, and
 * vectorize (contiguous rows through the flat kernel); one function per
 * operator keeps the row loops inline. */
#define TP__BCAST_KERNEL(name, OP, flat)                                        \
    void name(const float *a, const float *b, float *y, int ndim, const int64_t *shape,    \
              const int64_t *as, const int64_t *bs)                            \
    {                                                                           \
        int64_t total = 1;                                                      \
        for (int d = 0; d < ndim; d++)                                          \
            total *= shape[d];                                                  \
        if (total <= 0)                                                         \
            return;                                                             \
        if (ndim == 0) {                                                        \
            y[0] = a[0] OP b[0];                                                \
            return;                                                             \
        }                                                                       \
        int outer = ndim - 1;                                                   \
        int64_t n = shape[outer], sa = as[outer], sb = bs[outer];              \
        int64_t idx[TP_MAX_DIMS] = {0}, oa = 0, ob = 0;                         \
        do {                                                                    \
            const float *ar = a + oa, *br = b + ob;                             \
            if (sa == 1 && sb == 1) {                                           \
                flat(ar, br, y, n);                                             \
            } else if (sa == 1 && sb == 0) {                                    \
                const float v = *br;                                            \
                for (int64_t i = 0; i < n; i++)                                 \
                    y[i] = ar[i] OP v;                                          \
            } else if (sa == 0 && sb == 1) {                                    \
                const float v = *ar;                                            \
                for (int64_t i = 0; i < n; i++)                                 \
                    y[i] = v OP br[i];                                          \
            } else {                                                            \
                for (int64_t i = 0; i < n; i++)                                 \
                    y[i] = ar[i * sa] OP br[i * sb];                            \
            }                                                                   \
            y += n;                                                             \
        } while (tp__odo_next(outer, shape, idx, as, &oa, bs, &ob));            \
    }
TP__BCAST_KERNEL(tp__k_add_bcast, +, tp__k_add)
TP__BCAST_KERNEL(tp__k_mul_bcast, *, tp__k_mul)
#undef TP__BCAST_KERNEL

void tp__k_gather(float *y, const float *x, int ndim, const int64_t *shape,
                  const int64_t *stride)
{
    int64_t n = 1;
    for (int d = 0; d < ndim; d++)
        n *= shape[d];
    if (n <= 0)
        return;
    if (ndim == 0) {
        y[0] = x[0];
        return;
    }
    /* the innermost dim a run, the outer ones an odometer */
    int outer = ndim - 1;
    int64_t len = shape[outer], st = stride[outer];
    int64_t idx[TP_MAX_DIMS] = {0}, off = 0, unused = 0;
    do {
        const float *restrict xr = x + off;
        if (st == 1)
            memcpy(y, xr, (size_t)len * sizeof *y);
        else
            for (int64_t i = 0; i < len; i++)
                y[i] = xr[i * st];
        y += len;
    } while (tp__odo_next(outer, shape, idx, stride, &off, stride, &unused));
}

void tp__k_sum_bcast(const float *x, float *y, int ndim, const int64_t *shape,
                     const int64_t *yshape)
{
    int64_t yn = 1, xn = 1;
    for (int d = 0; d < ndim; d++) {
        yn *= yshape[d];
        xn *= shape[d];
    }
    if (yn <= 0)
        return;
    if (xn <= 0) { /* a summed dim is empty */
        memset(y, 0, (size_t)yn * sizeof *y);
        return;
    }
    /* the kept and the summed dims, in order, with their strides in x; size-1
     * dims index nothing and are left out */
    int64_t xs[TP_MAX_DIMS], ksh[TP_MAX_DIMS], kst[TP_MAX_DIMS], rsh[TP_MAX_DIMS],
        rst[TP_MAX_DIMS];
    int nk = 0, nr = 0;
    bool inner_kept = true;
    int64_t stride = 1;
    for (int d = ndim - 1; d >= 0; d--) {
        xs[d] = stride;
        stride *= shape[d];
    }
    for (int d = 0; d < ndim; d++) {
        if (shape[d] == 1)
            continue;
        inner_kept = yshape[d] == shape[d];
        if (inner_kept) {
            ksh[nk] = shape[d];
            kst[nk++] = xs[d];
        } else {
            rsh[nr] = shape[d];
            rst[nr++] = xs[d];
        }
    }
    if (nr == 0) { /* nothing summed: the same elements */
        memcpy(y, x, (size_t)yn * sizeof *y);
        return;
    }
    int64_t ki[TP_MAX_DIMS] = {0}, ri[TP_MAX_DIMS] = {0}, xo = 0, ro = 0, unused = 0;
    if (inner_kept) {
        /* y's rows are contiguous runs of x: column sums over the summed
         * dims, through a block of double accumulators */
        int64_t len = ksh[nk - 1];
        double acc[TP__KCOLS];
        do {
            for (int64_t c0 = 0; c0 < len; c0 += TP__KCOLS) {
                int64_t nc = len - c0 < TP__KCOLS ? len - c0 : TP__KCOLS;
                for (int64_t j = 0; j < nc; j++)
                    acc[j] = 0;
                do {
                    const float *restrict xr = x + xo + ro + c0;
                    for (int64_t j = 0; j < nc; j++)
                        acc[j] += (double)xr[j];
                } while (tp__odo_next(nr, rsh, ri, rst, &ro, rst, &unused));
                for (int64_t j = 0; j < nc; j++)
                    y[c0 + j] = (float)acc[j];
            }
            y += len;
        } while (tp__odo_next(nk - 1, ksh, ki, kst, &xo, kst, &unused));
        return;
    }
    /* the innermost summed dim is a contiguous run of x: one double sum per
     * element of y, over runs */
    int64_t len = rsh[nr - 1];
    do {
        double s = 0;
        do {
            s += tp__dsum(x + xo + ro, len);
        } while (tp__odo_next(nr - 1, rsh, ri, rst, &ro, rst, &unused));
        *y++ = (float)s;
    } while (tp__odo_next(nk, ksh, ki, kst, &xo, kst, &unused));
}

void tp__k_relu_fwd(const float *x, float *y, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        y[i] = x[i] > 0.0f ? x[i] : 0.0f;
}

void tp__k_relu_bwd(const float *x, const float *gy, float *gx, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        gx[i] = x[i] > 0.0f ? gy[i] : 0.0f;
}

#define TP__SQRT1_2 0.70710678118654752440f    /* 1/sqrt(2) */
#define TP__INV_SQRT2PI 0.39894228040143267794f /* 1/sqrt(2 pi) */
#define TP__SQRT2_PI 0.79788456080286535588f   /* sqrt(2/pi) */
#define TP__GELU_C 0.044715f

/* ---- vectorizable exp and GELU ------------------------------------------------
 *
 * The element-wise loops below call no libm function, so GCC vectorizes them
 * at -O3 (checked with -fopt-info-vec). Every branch is a select both of whose
 * sides are computed; integer work on float bits goes through memcpy.
 *
 * tp__expf: exp(x) = 2^n exp(r), n = round(x / ln 2) by the 1.5 * 2^23 trick
 * (no float-to-int conversion), r = x - n ln 2 in two Cody-Waite steps,
 * exp(r) = 1 + r + r^2 Q(r) with Q a degree-4 least-squares fit on
 * |r| <= ln2 / 2; 2^n is applied as two factors so subnormal results and
 * overflow to inf come out right. Max relative error against exp in double:
 * 2.5e-7 (about 2 ulp) over the whole float range; exp(-inf) = 0,
 * exp(+inf) = inf, NaN gives NaN. */
/* c ? a : b on the bits: GCC (with the default -ftrapping-math) does not
 * if-convert float selects in these loops, so they would not vectorize. */
static inline float tp__sel(int c, float a, float b)
{
    int32_t ia, ib, m = -c, r;
    memcpy(&ia, &a, sizeof ia);
    memcpy(&ib, &b, sizeof ib);
    r = (ia & m) | (ib & ~m);
    float f;
    memcpy(&f, &r, sizeof f);
    return f;
}

static inline float tp__expf(float x)
{
    const float magic = 12582912.0f; /* 1.5 * 2^23 */
    float x0 = x;
    x = tp__sel(x < -104.0f, -104.0f, x);
    x = tp__sel(x > 89.0f, 89.0f, x);
    float k = x * 1.44269504088896341f + magic;
    float n = k - magic;
    int32_t ki, mi;
    memcpy(&ki, &k, sizeof ki);
    float m = magic;
    memcpy(&mi, &m, sizeof mi);
    int32_t e = ki - mi;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float q = 0.0013751407f;
    q = q * r + 0.0083689159f;
    q = q * r + 0.0416695327f;
    q = q * r + 0.1666651815f;
    q = q * r + 0.4999998808f;
    float p = 1.0f + r + r * r * q;
    int32_t e1 = e >> 1, e2 = e - e1;
    /* unsigned: a NaN x makes e garbage (the result is x0 then), and a
     * negative int must not be shifted */
    uint32_t b1 = ((uint32_t)e1 + 127u) << 23, b2 = ((uint32_t)e2 + 127u) << 23;
    float s1, s2;
    memcpy(&s1, &b1, sizeof s1);
    memcpy(&s2, &b2, sizeof s2);
    return tp__sel(x0 != x0, x0, p * s1 * s2);
}

/* Block of the exp helpers below: 1 KiB of stack. */
#define TP__EXPBLK 256

/* Sum of exp(x[i * st] - mx) over n elements, in double: exp on blocks of
 * floats (a loop that vectorizes, strided elements gathered first), each
 * block summed in double. */
static double tp__sumexp(const float *restrict x, float mx, int64_t n, int64_t st)
{
    float buf[TP__EXPBLK];
    double s = 0;
    for (int64_t i0 = 0; i0 < n; i0 += TP__EXPBLK) {
        int64_t nb = n - i0 < TP__EXPBLK ? n - i0 : TP__EXPBLK;
        const float *restrict xb = x + i0 * st;
        if (st == 1) {
            for (int64_t k = 0; k < nb; k++)
                buf[k] = tp__expf(xb[k] - mx);
        } else {
            for (int64_t k = 0; k < nb; k++)
                buf[k] = xb[k * st];
            for (int64_t k = 0; k < nb; k++)
                buf[k] = tp__expf(buf[k] - mx);
        }
        s += tp__dsum(buf, nb);
    }
    return s;
}

/* Phi(x) = P(X <= x) for a standard normal X, without the cancellation of
 * 1 + erf(z) for negative x: |z| = |x| / sqrt 2 <= 1 uses erf(z) = z P(z^2)
 * (degree 6 in z^2); beyond, erfc(t) = exp(-t^2) s R(s), s = 1 / (1 + t / 2),
 * R of degree 9 (both least-squares fits); Phi = 0 below x = -10.18. */
static inline float tp__phif(float x)
{
    float z = x * 0.70710678118654752440f;
    float t = fabsf(z);
    float z2 = z * z;
    float pe = 7.8982019e-05f;
    pe = pe * z2 + -8.0243516e-04f;
    pe = pe * z2 + 5.1900530e-03f;
    pe = pe * z2 + -2.6854808e-02f;
    pe = pe * z2 + 1.1283612e-01f;
    pe = pe * z2 + -3.7612629e-01f;
    pe = pe * z2 + 1.1283792e+00f;
    float small = 0.5f + 0.5f * (z * pe);
    float tc = tp__sel(t > 7.2f, 7.2f, t);
    float s = 1.0f / (1.0f + 0.5f * tc);
    float pc = -0.050177258f;
    pc = pc * s + 0.14176859f;
    pc = pc * s + -0.058744691f;
    pc = pc * s + -0.16080126f;
    pc = pc * s + 0.089829482f;
    pc = pc * s + 0.040682141f;
    pc = pc * s + 0.18810152f;
    pc = pc * s + 0.24487288f;
    pc = pc * s + 0.28227782f;
    pc = pc * s + 0.28208742f;
    float half_erfc = 0.5f * tp__expf(-tc * tc) * s * pc; /* erfc(t) / 2 */
    half_erfc = tp__sel(t > 7.2f, 0.0f, half_erfc);
    float big = tp__sel(z < 0.0f, half_erfc, 1.0f - half_erfc);
    return tp__sel(t <= 1.0f, small, big);
}

TP__CLONED(tp__k_gelu_fwd, (const float *x, float *y, int64_t n, bool tanh_approx),
           (x, y, n, tanh_approx))
{
    if (tanh_approx) {
        /* 0.5 (1 + tanh u) = 1 / (1 + exp(-2u)): no cancellation, no tanhf */
        for (int64_t i = 0; i < n; i++) {
            float v = x[i];
            float vc = tp__sel(v < -20.0f, -20.0f, tp__sel(v > 20.0f, 20.0f, v));
            float u = TP__SQRT2_PI * (vc + TP__GELU_C * vc * vc * vc);
            float a = -2.0f * u;
            a = tp__sel(a > 88.0f, 88.0f, a);
            float yv = v / (1.0f + tp__expf(a));
            y[i] = tp__sel(v < -20.0f, -0.0f, yv);
        }
    } else {
        for (int64_t i = 0; i < n; i++) {
            float v = x[i];
            float yv = v * tp__phif(v);
            y[i] = tp__sel(v < -20.0f, -0.0f, yv);
        }
    }
}

TP__CLONED(tp__k_gelu_bwd,
           (const float *x, const float *gy, float *gx, int64_t n, bool tanh_approx),
           (x, gy, gx, n, tanh_approx))
{
    if (tanh_approx) {
        /* d/dx 0.5 x (1 + tanh u) = 0.5 (1 + t) + 0.5 x (1 - t^2) u',
         * u' = sqrt(2/pi) (1 + 3 c x^2); with e = exp(-2u), d = 1 / (1 + e):
         * 0.5 (1 + t) = d and 1 - t^2 = 4 d (e d). Beyond |x| = 20 the
         * derivative is 0 or 1 in float, so x is clamped there. */
        for (int64_t i = 0; i < n; i++) {
            float v = x[i];
            v = tp__sel(v < -20.0f, -20.0f, tp__sel(v > 20.0f, 20.0f, v));
            float u = TP__SQRT2_PI * (v + TP__GELU_C * v * v * v);
            float a = -2.0f * u;
            a = tp__sel(a > 88.0f, 88.0f, a);
            float e = tp__expf(a);
            float d = 1.0f / (1.0f + e);
            float du = TP__SQRT2_PI * (1.0f + 3.0f * TP__GELU_C * v * v);
            gx[i] = gy[i] * (d + 2.0f * v * d * (e * d) * du);
        }
    } else {
        /* d/dx x Phi(x) = Phi(x) + x phi(x) */
        for (int64_t i = 0; i < n; i++) {
            float v = x[i];
            float vc = tp__sel(v < -20.0f, -20.0f, tp__sel(v > 20.0f, 20.0f, v));
            float pdf = TP__INV_SQRT2PI * tp__expf(-0.5f * vc * vc);
            gx[i] = gy[i] * (tp__phif(v) + vc * pdf);
        }
    }
}

/* ---- reductions ------------------------------------------------------------- */

void tp__k_sum_dim_div(const float *x, float *y, int64_t outer, int64_t size, int64_t inner,
                       double div)
{
    for (int64_t o = 0; o < outer; o++) {
        const float *xo = x + o * size * inner;
        if (inner == 1)
            y[o] = (float)(tp__dsum(xo, size) / div);
        else
            tp__colsum(xo, size, inner, inner, y + o * inner, false, div);
    }
}

void tp__k_sum_dim(const float *x, float *y, int64_t outer, int64_t size, int64_t inner)
{
    tp__k_sum_dim_div(x, y, outer, size, inner, 1.0);
}

void tp__k_sum_dim_bwd(const float *gy, float *gx, int64_t outer, int64_t size, int64_t inner,
                       float scale)
{
    for (int64_t o = 0; o < outer; o++) {
        const float *restrict go = gy + o * inner;
        for (int64_t s = 0; s < size; s++) {
            float *restrict gxs = gx + (o * size + s) * inner;
            for (int64_t i = 0; i < inner; i++)
                gxs[i] = go[i] * scale;
        }
    }
}

double tp__k_sum_all(const float *x, int64_t n)
{
    return n > 0 ? tp__dsum(x, n) : 0.0;
}

/* ---- softmax ------------------------------------------------------------------ */

TP__CLONED(tp__k_softmax_fwd, (const float *x, float *y, int64_t rows, int64_t cols),
           (x, y, rows, cols))
{
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * cols;
        float *yr = y + r * cols;
        float mx = tp__rowmax(xr, cols);
        for (int64_t c = 0; c < cols; c++)
            yr[c] = tp__expf(xr[c] - mx);
        double s = tp__dsum(yr, cols);
        float inv = (float)(1.0 / s);
        for (int64_t c = 0; c < cols; c++)
            yr[c] *= inv;
    }
}

TP__CLONED(tp__k_softmax_bwd,
           (const float *y, const float *gy, float *gx, int64_t rows, int64_t cols),
           (y, gy, gx, rows, cols))
{
    for (int64_t r = 0; r < rows; r++) {
        const float *yr = y + r * cols, *gr = gy + r * cols;
        float *gxr = gx + r * cols;
        float dot = (float)tp__ddot(yr, gr, cols);
        for (int64_t c = 0; c < cols; c++)
            gxr[c] = yr[c] * (gr[c] - dot);
    }
}

void tp__k_causal_mask(float *s, int64_t batch, int64_t S)
{
    for (int64_t b = 0; b < batch; b++) {
        float *sb = s + b * S * S;
        for (int64_t i = 0; i < S; i++)
            for (int64_t j = i + 1; j < S; j++)
                sb[i * S + j] = -INFINITY;
    }
}

/* Masked keys become -inf (the pad loops branch-free, so they vectorize),
 * then the softmax of the visible prefix [0, lim); keys past it are 0. A
 * row whose maximum is -inf (nothing visible) is all 0: PyTorch's
 * _safe_softmax, where softmax_fwd would give NaN. */
TP__CLONED(tp__k_attn_softmax,
           (float *s, int64_t r0, int64_t nr, int64_t rows, int64_t Sq, int64_t Sk,
            int64_t key_offset, bool causal, const void *pad, bool pad_i32, int64_t pad_div),
           (s, r0, nr, rows, Sq, Sk, key_offset, causal, pad, pad_i32, pad_div))
{
    for (int64_t u = 0; u < nr; u++) {
        int64_t r = r0 + u, b = r / rows, i = r % rows % Sq;
        float *restrict x = s + u * Sk;
        int64_t lim = Sk;
        if (causal && key_offset < Sk - i - 1)
            lim = key_offset + i + 1;
        if (pad && pad_i32) {
            const int32_t *restrict p = (const int32_t *)pad + b / pad_div * Sk;
            for (int64_t j = 0; j < lim; j++)
                x[j] = tp__sel(p[j] != 0, x[j], -INFINITY);
        } else if (pad) {
            const int64_t *restrict p = (const int64_t *)pad + b / pad_div * Sk;
            for (int64_t j = 0; j < lim; j++)
                x[j] = tp__sel(p[j] != 0, x[j], -INFINITY);
        }
        float mx = tp__rowmax(x, lim);
        if (mx == -INFINITY)
            lim = 0;
        for (int64_t j = 0; j < lim; j++)
            x[j] = tp__expf(x[j] - mx);
        for (int64_t j = lim; j < Sk; j++)
            x[j] = 0.0f;
        if (lim > 0) {
            float inv = (float)(1.0 / tp__dsum(x, lim));
            for (int64_t j = 0; j < lim; j++)
                x[j] *= inv;
        }
    }
}

/* ---- layout ------------------------------------------------------------------- */

void tp__k_transpose_last2(const float *x, float *y, int64_t batch, int64_t r, int64_t c)
{
    /* square tiles so that both the reads and the writes stay in cache lines */
    enum { TB = 32 };
    for (int64_t b = 0; b < batch; b++) {
        const float *restrict xb = x + b * r * c;
        float *restrict yb = y + b * r * c;
        for (int64_t i0 = 0; i0 < r; i0 += TB) {
            int64_t i1 = i0 + TB < r ? i0 + TB : r;
            for (int64_t j0 = 0; j0 < c; j0 += TB) {
                int64_t j1 = j0 + TB < c ? j0 + TB : c;
                for (int64_t i = i0; i < i1; i++)
                    for (int64_t j = j0; j < j1; j++)
                        yb[j * r + i] = xb[i * c + j];
            }
        }
    }
}

/* ---- embedding ---------------------------------------------------------------- */

void tp__k_embedding_fwd(const int64_t *idx, int64_t n, const float *w, int64_t rows_local,
                         int64_t dim, int64_t offset, float *y)
{
    for (int64_t i = 0; i < n; i++) {
        float *yi = y + i * dim;
        /* compare before subtracting: defined for any int64 index */
        if (idx[i] >= offset && idx[i] - offset < rows_local)
            memcpy(yi, w + (idx[i] - offset) * dim, (size_t)dim * sizeof *yi);
        else
            memset(yi, 0, (size_t)dim * sizeof *yi);
    }
}

void tp__k_embedding_bwd(const int64_t *idx, int64_t n, const float *gy, int64_t rows_local,
                         int64_t dim, int64_t offset, float *gw)
{
    for (int64_t i = 0; i < n; i++) {
        if (idx[i] < offset || idx[i] - offset >= rows_local)
            continue;
        float *restrict gr = gw + (idx[i] - offset) * dim;
        const float *restrict gi = gy + i * dim;
        for (int64_t c = 0; c < dim; c++)
            gr[c] += gi[c];
    }
}

/* ---- normalization ------------------------------------------------------------ */

void tp__k_layer_norm_fwd(const float *x, const float *w, const float *b, float *y, float *mean,
                          float *rstd, int64_t rows, int64_t cols, float eps)
{
    for (int64_t r = 0; r < rows; r++) {
        const float *restrict xr = x + r * cols;
        float *restrict yr = y + r * cols;
        double mu = cols > 0 ? tp__dsum(xr, cols) / (double)cols : 0.0;
        /* two-pass variance: no cancellation when |mean| >> std */
        double var = cols > 0 ? tp__dsumsq_dev(xr, mu, cols) / (double)cols : 0.0;
        float m = (float)mu, rs = (float)(1.0 / sqrt(var + (double)eps));
        mean[r] = m;
        rstd[r] = rs;
        /* y from the stored (float) statistics, the ones backward sees */
        if (w && b)
            for (int64_t c = 0; c < cols; c++)
                yr[c] = (xr[c] - m) * rs * w[c] + b[c];
        else if (w)
            for (int64_t c = 0; c < cols; c++)
                yr[c] = (xr[c] - m) * rs * w[c];
        else if (b)
            for (int64_t c = 0; c < cols; c++)
                yr[c] = (xr[c] - m) * rs + b[c];
        else
            for (int64_t c = 0; c < cols; c++)
                yr[c] = (xr[c] - m) * rs;
    }
}

/* gw[c] += sum_r gy[r,c] * (x[r,c] - mean[r]) * rstd[r] (mean NULL: 0, RMS norm),
 * accumulated in double over row-major column blocks. */
static void tp__norm_wgrad(const float *restrict x, const float *restrict mean,
                           const float *restrict rstd, const float *restrict gy,
                           float *restrict gw, int64_t rows, int64_t cols)
{
    double acc[TP__KCOLS];
    for (int64_t c0 = 0; c0 < cols; c0 += TP__KCOLS) {
        int64_t nc = cols - c0 < TP__KCOLS ? cols - c0 : TP__KCOLS;
        for (int64_t j = 0; j < nc; j++)
            acc[j] = 0;
        for (int64_t r = 0; r < rows; r++) {
            const float *restrict xr = x + r * cols + c0, *restrict gr = gy + r * cols + c0;
            float m = mean ? mean[r] : 0.0f, rs = rstd[r];
            for (int64_t j = 0; j < nc; j++)
                acc[j] += (double)(gr[j] * ((xr[j] - m) * rs));
        }
        for (int64_t j = 0; j < nc; j++)
            gw[c0 + j] = (float)((double)gw[c0 + j] + acc[j]);
    }
}

void tp__k_layer_norm_bwd(const float *x, const float *w, const float *mean, const float *rstd,
                          const float *gy, float *gx, float *gw, float *gb, int64_t rows,
                          int64_t cols)
{
    double inv_n = cols > 0 ? 1.0 / (double)cols : 0.0;
    for (int64_t r = 0; r < rows; r++) {
        const float *restrict xr = x + r * cols, *restrict gr = gy + r * cols;
        float *restrict gxr = gx + r * cols;
        float m = mean[r], rs = rstd[r];
        /* a = mean(gy w), b = mean(gy w xhat) */
        double sa = w ? tp__ddot(gr, w, cols) : tp__dsum(gr, cols);
        double sb = tp__norm_gxhat(gr, w, xr, m, rs, cols);
        float a = (float)(sa * inv_n), bb = (float)(sb * inv_n);
        if (w)
            for (int64_t c = 0; c < cols; c++)
                gxr[c] = rs * (gr[c] * w[c] - a - (xr[c] - m) * rs * bb);
        else
            for (int64_t c = 0; c < cols; c++)
                gxr[c] = rs * (gr[c] - a - (xr[c] - m) * rs * bb);
    }
    if (gw)
        tp__norm_wgrad(x, mean, rstd, gy, gw, rows, cols);
    if (gb)
        tp__colsum(gy, rows, cols, cols, gb, true, 1.0);
}

void tp__k_rms_norm_fwd(const float *x, const float *w, float *y, float *rstd, int64_t rows,
                        int64_t cols, float eps)
{
    for (int64_t r = 0; r < rows; r++) {
        const float *restrict xr = x + r * cols;
        float *restrict yr = y + r * cols;
        double ms = cols > 0 ? tp__ddot(xr, xr, cols) / (double)cols : 0.0;
        float rs = (float)(1.0 / sqrt(ms + (double)eps));
        rstd[r] = rs;
        if (w)
            for (int64_t c = 0; c < cols; c++)
                yr[c] = xr[c] * rs * w[c];
        else
            for (int64_t c = 0; c < cols; c++)
                yr[c] = xr[c] * rs;
    }
}

void tp__k_rms_norm_bwd(const float *x, const float *w, const float *rstd, const float *gy,
                        float *gx, float *gw, int64_t rows, int64_t cols)
{
    double inv_n = cols > 0 ? 1.0 / (double)cols : 0.0;
    for (int64_t r = 0; r < rows; r++) {
        const float *restrict xr = x + r * cols, *restrict gr = gy + r * cols;
        float *restrict gxr = gx + r * cols;
        float rs = rstd[r];
        double sb; /* sum gy w xhat */
        if (w)
            sb = tp__norm_gxhat(gr, w, xr, 0.0f, rs, cols);
        else
            sb = tp__ddot(gr, xr, cols) * (double)rs;
        float bb = (float)(sb * inv_n);
        if (w)
            for (int64_t c = 0; c < cols; c++)
                gxr[c] = rs * (gr[c] * w[c] - xr[c] * rs * bb);
        else
            for (int64_t c = 0; c < cols; c++)
                gxr[c] = rs * (gr[c] - xr[c] * rs * bb);
    }
    if (gw)
        tp__norm_wgrad(x, NULL, rstd, gy, gw, rows, cols);
}

/* ---- dropout ------------------------------------------------------------------ */

/* One run of n consecutive global counters starting at g: element i is
 * kept iff tp_rng_uniform(seed, g + i) >= p, i.e. iff its 53 random bits
 * (core/philox.h, inline here so the loop has no call) are >= thr =
 * ceil(p 2^53): the same test on integers. */
static void tp__dropout_run(const float *x, float *y, uint8_t *mask, int64_t n, uint64_t g,
                            uint64_t thr, float scale, uint64_t seed)
{
    const uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
    uint8_t keep[TP__EXPBLK];
    for (int64_t i0 = 0; i0 < n; i0 += TP__EXPBLK) {
        int64_t nb = n - i0 < TP__EXPBLK ? n - i0 : TP__EXPBLK;
        for (int64_t i = 0; i < nb; i++) {
            uint64_t c = g + (uint64_t)(i0 + i);
            const uint32_t ctr[4] = {(uint32_t)c, (uint32_t)(c >> 32), 0, 0};
            uint32_t r[4];
            tp__philox4x32_10(ctr, key, r);
            keep[i] = ((((uint64_t)r[0] << 32) | r[1]) >> 11) >= thr;
        }
        for (int64_t i = 0; i < nb; i++)
            y[i0 + i] = tp__sel(keep[i], x[i0 + i] * scale, 0.0f);
        if (mask)
            memcpy(mask + i0, keep, (size_t)nb);
    }
}

TP__CLONED(tp__k_dropout_fwd,
           (const float *x, float *y, uint8_t *mask, int ndim, const int64_t *shape,
            const int64_t *global_shape, const int64_t *offset, float p, uint64_t seed),
           (x, y, mask, ndim, shape, global_shape, offset, p, seed))
{
    int64_t n = 1;
    for (int d = 0; d < ndim; d++)
        n *= shape[d];
    if (n <= 0)
        return;
    if (p <= 0.0f) {
        if (y != x)
            memmove(y, x, (size_t)n * sizeof *y);
        if (mask)
            memset(mask, 1, (size_t)n);
        return;
    }
    if (p >= 1.0f) {
        memset(y, 0, (size_t)n * sizeof *y);
        if (mask)
            memset(mask, 0, (size_t)n);
        return;
    }
    float scale = 1.0f / (1.0f - p);
    /* p 2^53 is exact (a float times a power of two); 0 < p < 1 */
    uint64_t thr = (uint64_t)ceil((double)p * 0x1.0p53);
    if (ndim == 0) {
        tp__dropout_run(x, y, mask, 1, 0, thr, scale, seed);
        return;
    }

    /* global strides and the counter of the block's first element */
    uint64_t gstride[TP_MAX_DIMS], g = 0;
    int64_t idx[TP_MAX_DIMS];
    uint64_t s = 1;
    for (int d = ndim - 1; d >= 0; d--) {
        gstride[d] = s;
        s *= (uint64_t)(global_shape ? global_shape[d] : shape[d]);
    }
    for (int d = 0; d < ndim; d++) {
        g += (uint64_t)(offset ? offset[d] : 0) * gstride[d];
        idx[d] = 0;
    }
    /* innermost dim: one run of consecutive counters; outer dims: an odometer */
    int inner = ndim - 1;
    int64_t run = shape[inner];
    for (int64_t pos = 0;;) {
        tp__dropout_run(x + pos, y + pos, mask ? mask + pos : NULL, run, g, thr, scale, seed);
        pos += run;
        int k = inner - 1;
        for (; k >= 0; k--) {
            g += gstride[k];
            if (++idx[k] < shape[k])
                break;
            g -= gstride[k] * (uint64_t)shape[k];
            idx[k] = 0;
        }
        if (k < 0)
            return;
    }
}

TP__CLONED(tp__k_dropout_bwd, (const float *gy, const uint8_t *mask, float *gx, int64_t n, float p),
           (gy, mask, gx, n, p))
{
    if (n <= 0)
        return;
    if (p <= 0.0f) {
        if (gx != gy)
            memmove(gx, gy, (size_t)n * sizeof *gx);
        return;
    }
    if (p >= 1.0f) {
        memset(gx, 0, (size_t)n * sizeof *gx);
        return;
    }
    float scale = 1.0f / (1.0f - p);
    for (int64_t i = 0; i < n; i++)
        gx[i] = tp__sel(mask[i] != 0, gy[i] * scale, 0.0f);
}

/* ---- cross entropy ------------------------------------------------------------ */

/* Whether a row with target t counts. Out-of-range targets are rejected by the
 * op layer; here they are skipped like ignore_index so nothing reads outside x. */
static inline bool tp__ce_counted(int64_t t, int64_t classes, int64_t ignore_index)
{
    return t != ignore_index && t >= 0 && t < classes;
}

/* The first element of row r of logits laid out [outer, classes, inner]; the
 * row's classes follow at stride inner. */
static inline int64_t tp__ce_row(int64_t r, int64_t classes, int64_t inner)
{
    return inner == 1 ? r * classes : (r / inner) * classes * inner + r % inner;
}

/* Max of n floats at stride st (the contiguous helper when st is 1). */
static float tp__ce_max(const float *restrict x, int64_t n, int64_t st)
{
    if (st == 1)
        return tp__rowmax(x, n);
    float m = -INFINITY;
    for (int64_t i = 0; i < n; i++)
        m = x[i * st] > m ? x[i * st] : m;
    return m;
}

/* gx[i * st] = k * exp(x[i * st] - mx) for n classes at stride st; x NULL:
 * zeros. */
static void tp__ce_grad_row(const float *restrict x, float *restrict gx, int64_t n, int64_t st,
                            float k, float mx)
{
    if (st == 1) {
        if (!x) {
            memset(gx, 0, (size_t)n * sizeof *gx);
            return;
        }
        for (int64_t i = 0; i < n; i++)
            gx[i] = k * tp__expf(x[i] - mx);
        return;
    }
    if (!x) {
        for (int64_t i = 0; i < n; i++)
            gx[i * st] = 0.0f;
        return;
    }
    for (int64_t i = 0; i < n; i++)
        gx[i * st] = k * tp__expf(x[i * st] - mx);
}

TP__CLONED(tp__k_cross_entropy_fwd,
           (const float *x, const int64_t *target, const float *weight, float *loss, int64_t rows,
            int64_t classes, int64_t inner, int64_t ignore_index, double *wsum),
           (x, target, weight, loss, rows, classes, inner, ignore_index, wsum))
{
    double ws = 0;
    for (int64_t r = 0; r < rows; r++) {
        int64_t t = target[r];
        if (!tp__ce_counted(t, classes, ignore_index)) {
            loss[r] = 0.0f;
            continue;
        }
        const float *xr = x + tp__ce_row(r, classes, inner);
        float mx = tp__ce_max(xr, classes, inner);
        double lse = log(tp__sumexp(xr, mx, classes, inner)) + (double)mx;
        double wt = weight ? (double)weight[t] : 1.0;
        loss[r] = (float)(wt * (lse - (double)xr[t * inner]));
        ws += wt;
    }
    if (wsum)
        *wsum = ws;
}

TP__CLONED(tp__k_cross_entropy_bwd,
           (const float *x, const int64_t *target, const float *weight, const float *gloss,
            float *gx, int64_t rows, int64_t classes, int64_t inner, int64_t ignore_index),
           (x, target, weight, gloss, gx, rows, classes, inner, ignore_index))
{
    for (int64_t r = 0; r < rows; r++) {
        int64_t t = target[r], base = tp__ce_row(r, classes, inner);
        float *restrict gxr = gx + base;
        if (!tp__ce_counted(t, classes, ignore_index)) {
            tp__ce_grad_row(NULL, gxr, classes, inner, 0.0f, 0.0f);
            continue;
        }
        const float *restrict xr = x + base;
        float mx = tp__ce_max(xr, classes, inner);
        double s = tp__sumexp(xr, mx, classes, inner);
        float g = gloss[r] * (weight ? weight[t] : 1.0f);
        float k = (float)((double)g / s);
        tp__ce_grad_row(xr, gxr, classes, inner, k, mx);
        gxr[t * inner] -= g;
    }
}

void tp__k_ce_gloss(const float *g, float *gl, int64_t rows, bool broadcast, double div)
{
    if (!broadcast) {
        if (rows > 0 && gl != g)
            memcpy(gl, g, (size_t)rows * sizeof *gl);
        return;
    }
    float v = (float)((double)g[0] / div);
    for (int64_t r = 0; r < rows; r++)
        gl[r] = v;
}

void tp__k_row_max(const float *x, float *mx, int64_t rows, int64_t cols, int64_t inner)
{
    for (int64_t r = 0; r < rows; r++)
        mx[r] = tp__ce_max(x + tp__ce_row(r, cols, inner), cols, inner);
}

TP__CLONED(tp__k_row_sumexp,
           (const float *x, const float *mx, float *s, int64_t rows, int64_t cols, int64_t inner),
           (x, mx, s, rows, cols, inner))
{
    for (int64_t r = 0; r < rows; r++)
        s[r] = (float)tp__sumexp(x + tp__ce_row(r, cols, inner), mx[r], cols, inner);
}

void tp__k_pick_target(const float *x, const int64_t *target, float *picked, int64_t rows,
                       int64_t cols, int64_t inner, int64_t offset, int64_t ignore_index)
{
    for (int64_t r = 0; r < rows; r++) {
        int64_t t = target[r];
        bool owned = t != ignore_index && t >= offset && t - offset < cols;
        picked[r] = owned ? x[tp__ce_row(r, cols, inner) + (t - offset) * inner] : 0.0f;
    }
}

void tp__k_vocab_ce_loss(const int64_t *target, const float *weight, const float *mx,
                         const float *sumexp, const float *picked, float *loss, int64_t rows,
                         int64_t ignore_index)
{
    for (int64_t r = 0; r < rows; r++) {
        int64_t t = target[r];
        if (t == ignore_index) {
            loss[r] = 0.0f;
            continue;
        }
        double wt = weight ? (double)weight[t] : 1.0;
        loss[r] = (float)(wt * (log((double)sumexp[r]) + (double)mx[r] - (double)picked[r]));
    }
}

TP__CLONED(tp__k_vocab_ce_bwd,
           (const float *x, const int64_t *target, const float *weight, const float *mx,
            const float *sumexp, const float *gloss, float *gx, int64_t rows, int64_t cols,
            int64_t inner, int64_t offset, int64_t ignore_index),
           (x, target, weight, mx, sumexp, gloss, gx, rows, cols, inner, offset, ignore_index))
{
    for (int64_t r = 0; r < rows; r++) {
        int64_t t = target[r], base = tp__ce_row(r, cols, inner);
        float *restrict gxr = gx + base;
        /* the global class count is not known here: negative targets other
         * than ignore_index are skipped, the op layer rejects the rest */
        if (t == ignore_index || t < 0) {
            tp__ce_grad_row(NULL, gxr, cols, inner, 0.0f, 0.0f);
            continue;
        }
        const float *restrict xr = x + base;
        float g = gloss[r] * (weight ? weight[t] : 1.0f);
        float k = (float)((double)g / (double)sumexp[r]);
        float m = mx[r];
        tp__ce_grad_row(xr, gxr, cols, inner, k, m);
        if (t >= offset && t - offset < cols)
            gxr[(t - offset) * inner] -= g;
    }
}

/* ---- optimizers ----------------------------------------------------------------- */

void tp__k_sgd_step(float *p, const float *g, int64_t n, double lr)
{
    for (int64_t k = 0; k < n; k++)
        p[k] = (float)((double)p[k] - lr * (double)g[k]);
}

/* In double, element by element, in every copy alike (cloned like the
 * kernels above: the sqrt and the division vectorize, with -fno-math-errno,
 * 5x faster than the scalar loop on AVX-512; an Adam step over a model's
 * parameters took 20% of a small transformer's training step). */
TP__CLONED(tp__k_adam_step,
           (float *restrict p, float *restrict m, float *restrict v, const float *restrict g,
            int64_t n, double beta1, double beta2, double step_size, double bc2_sqrt, double eps),
           (p, m, v, g, n, beta1, beta2, step_size, bc2_sqrt, eps))
{
    for (int64_t k = 0; k < n; k++) {
        double gk = g[k];
        m[k] = (float)(beta1 * m[k] + (1.0 - beta1) * gk);
        v[k] = (float)(beta2 * v[k] + (1.0 - beta2) * gk * gk);
        double denom = sqrt((double)v[k]) / bc2_sqrt + eps;
        p[k] = (float)((double)p[k] - step_size * (double)m[k] / denom);
    }
}

/* ---- SiLU and SwiGLU -------------------------------------------------------------
 * sigmoid(v) = 1 / (1 + e) for v >= 0 and e / (1 + e) below, e = exp(-|v|) in
 * (0, 1]: nothing overflows, and 1 - sigmoid comes out as the other of the two
 * (no cancellation). v is clamped to [-104, 104] first (exp(-104) is below
 * float's smallest subnormal), so the gradient's v (1 - sig) stays finite at
 * +-inf; silu itself is -0 below -104 (|silu| < 1e-43 there, and -inf * 0 would
 * be NaN) and v * 1 = v above. NaN gives NaN. Cloned like GELU. */

#define TP__SILU_CLAMP 104.0f

/* sigmoid(v) into *s and 1 - sigmoid(v) into *om, for a clamped v */
static inline void tp__sigmoid2(float v, float *s, float *om)
{
    float e = tp__expf(-fabsf(v));
    float d = 1.0f / (1.0f + e);
    float de = e * d;
    int pos = v >= 0.0f;
    *s = tp__sel(pos, d, de);
    *om = tp__sel(pos, de, d);
}

static inline float tp__silu_clamp(float v)
{
    return tp__sel(v < -TP__SILU_CLAMP, -TP__SILU_CLAMP,
                   tp__sel(v > TP__SILU_CLAMP, TP__SILU_CLAMP, v));
}

/* silu(v) given sigmoid(clamped v) */
static inline float tp__silu_of(float v, float s)
{
    return tp__sel(v < -TP__SILU_CLAMP, -0.0f, v * s);
}

TP__CLONED(tp__k_silu_fwd, (const float *x, float *y, int64_t n), (x, y, n))
{
    for (int64_t i = 0; i < n; i++) {
        float v = x[i], s, om;
        tp__sigmoid2(tp__silu_clamp(v), &s, &om);
        y[i] = tp__silu_of(v, s);
    }
}

TP__CLONED(tp__k_silu_bwd, (const float *x, const float *gy, float *gx, int64_t n),
           (x, gy, gx, n))
{
    for (int64_t i = 0; i < n; i++) {
        float vc = tp__silu_clamp(x[i]), s, om;
        tp__sigmoid2(vc, &s, &om);
        gx[i] = gy[i] * (s * (1.0f + vc * om));
    }
}

TP__CLONED(tp__k_swiglu_fwd, (const float *gate, const float *up, float *y, int64_t n),
           (gate, up, y, n))
{
    for (int64_t i = 0; i < n; i++) {
        float v = gate[i], s, om;
        tp__sigmoid2(tp__silu_clamp(v), &s, &om);
        y[i] = tp__silu_of(v, s) * up[i];
    }
}

/* one loop per set of wanted outputs, so that each vectorizes */
TP__CLONED(tp__k_swiglu_bwd,
           (const float *gate, const float *up, const float *gy, float *ggate, float *gup,
            int64_t n),
           (gate, up, gy, ggate, gup, n))
{
    if (ggate && gup) {
        for (int64_t i = 0; i < n; i++) {
            float v = gate[i], vc = tp__silu_clamp(v), u = up[i], g = gy[i], s, om;
            tp__sigmoid2(vc, &s, &om);
            ggate[i] = g * u * (s * (1.0f + vc * om));
            gup[i] = g * tp__silu_of(v, s);
        }
    } else if (ggate) {
        for (int64_t i = 0; i < n; i++) {
            float vc = tp__silu_clamp(gate[i]), s, om;
            tp__sigmoid2(vc, &s, &om);
            ggate[i] = gy[i] * up[i] * (s * (1.0f + vc * om));
        }
    } else if (gup) {
        for (int64_t i = 0; i < n; i++) {
            float v = gate[i], s, om;
            tp__sigmoid2(tp__silu_clamp(v), &s, &om);
            gup[i] = gy[i] * tp__silu_of(v, s);
        }
    }
}

/* ---- rotary position embedding ---------------------------------------------------- */

/* One row's pairs (i, i + h): each pair is loaded before either element is
 * stored, so y may be x. The products and the sum round to f32 one by one
 * (C11 does not contract them into an FMA), as PyTorch's x * cos +
 * rotate_half(x) * sin does in f32. */
static void tp__rope_row(const float *x, const float *c, const float *s, float *y, int64_t h,
                         bool bwd)
{
    if (!bwd)
        for (int64_t i = 0; i < h; i++) {
            float a = x[i], b = x[i + h];
            y[i] = a * c[i] - b * s[i];
            y[i + h] = b * c[i + h] + a * s[i + h];
        }
    else
        for (int64_t i = 0; i < h; i++) {
            float a = x[i], b = x[i + h];
            y[i] = a * c[i] + b * s[i + h];
            y[i + h] = b * c[i + h] - a * s[i];
        }
}

void tp__k_rope(const float *x, const float *cosb, const float *sinb, float *y, int64_t B,
                int64_t H, int64_t S, int64_t D, int64_t cos_batch_stride, bool bwd)
{
    for (int64_t b = 0; b < B; b++)
        for (int64_t hd = 0; hd < H; hd++)
            for (int64_t s = 0; s < S; s++) {
                int64_t row = ((b * H + hd) * S + s) * D, cs = b * cos_batch_stride + s * D;
                tp__rope_row(x + row, cosb + cs, sinb + cs, y + row, D / 2, bwd);
            }
}

/* cos and sin of the f32 angle evaluated in double and rounded to f32: the
 * nearest f32 value but for a rare double rounding, at any angle (glibc
 * reduces large arguments exactly: positions up to 1e5 and beyond). */
void tp__k_rope_cos_sin(const int64_t *pos, const float *inv_freq, float *cosb, float *sinb,
                        int64_t n, int64_t D, float scaling)
{
    const int64_t h = D / 2;
    for (int64_t r = 0; r < n; r++) {
        const float p = (float)pos[r];
        float *cr = cosb + r * D, *sr = sinb + r * D;
        for (int64_t i = 0; i < h; i++) {
            const float f = p * inv_freq[i];
            const float c = (float)cos((double)f) * scaling,
                        s = (float)sin((double)f) * scaling;
            cr[i] = cr[i + h] = c;
            sr[i] = sr[i + h] = s;
        }
    }
}

/* ---- fused attention ------------------------------------------------------------
 *
 * Flash attention's algorithm on the CPU (Dao et al., FlashAttention-2): a
 * block of query rows meets the keys block by block; each row keeps its
 * running maximum m and sum l, and its output is rescaled by exp(m_old -
 * m_new) whenever the maximum grows, so only one [TP__FLASH_BR,
 * TP__FLASH_BC] block of scores exists at a time. The backward recomputes
 * each block's probabilities from the row's lse = m + log l. */

/* The last key (exclusive) any row of [r0, r0 + nr) may see. */
static int64_t flash_key_limit(const tp__flash_group *g, int64_t r0, int64_t nr)
{
    if (!g->causal)
        return g->Sk;
    int64_t first = r0 % g->Sq, imax = nr >= g->Sq || first + nr > g->Sq ? g->Sq - 1
                                                                        : first + nr - 1;
    int64_t lim = imax + g->key_offset + 1;
    return lim < g->Sk ? lim : g->Sk;
}

/* exp(s[j] - m) in place, and their sum (vectorized: tp__expf). */
static TP__VEC_CLONES float flash_exp(float *restrict s, int64_t n, float m)
{
    float acc[8] = {0};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        for (int l = 0; l < 8; l++) {
            s[j + l] = tp__expf(s[j + l] - m);
            acc[l] += s[j + l];
        }
    for (; j < n; j++) {
        s[j] = tp__expf(s[j] - m);
        acc[0] += s[j];
    }
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

/* The scores of rows [r0, r0 + nr) against keys [c0, c0 + nc) into s
 * (ld TP__FLASH_BC), masked keys -inf: past each row's causal diagonal, and
 * where the padding is 0 (added as a 0 / -inf bias row). */
static void flash_scores(const tp__flash_group *g, const float *q, const float *k, int64_t r0,
                         int64_t nr, int64_t c0, int64_t nc, float *s)
{
    tp__k_gemm(false, true, nr, nc, g->D, g->scale, q + r0 * g->D, g->D, k + c0 * g->k_ld,
               g->k_ld, 0.0f, s, TP__FLASH_BC);
    if (g->pad) {
        float bias[TP__FLASH_BC];
        for (int64_t j = 0; j < nc; j++) {
            bool hide = g->pad_i32 ? ((const int32_t *)g->pad)[c0 + j] == 0
                                   : ((const int64_t *)g->pad)[c0 + j] == 0;
            bias[j] = hide ? -INFINITY : 0.0f;
        }
        for (int64_t u = 0; u < nr; u++)
            for (int64_t j = 0; j < nc; j++)
                s[u * TP__FLASH_BC + j] += bias[j];
    }
    if (g->causal)
        for (int64_t u = 0; u < nr; u++) {
            int64_t first = (r0 + u) % g->Sq + g->key_offset + 1 - c0; /* first hidden key */
            for (int64_t j = first < 0 ? 0 : first; j < nc; j++)
                s[u * TP__FLASH_BC + j] = -INFINITY;
        }
}

void tp__k_flash_fwd(const tp__flash_group *g, const float *q, const float *k, const float *v,
                     float *out, float *lse, float *scratch)
{
    float *s = scratch, *mx = scratch + 2 * TP__FLASH_BR * TP__FLASH_BC, *l = mx + TP__FLASH_BR;
    const int64_t Dv = g->Dv;
    for (int64_t r0 = 0; r0 < g->M; r0 += TP__FLASH_BR) {
        const int64_t nr = g->M - r0 < TP__FLASH_BR ? g->M - r0 : TP__FLASH_BR;
        float *o = out + r0 * Dv;
        memset(o, 0, (size_t)(nr * Dv) * sizeof *o);
        for (int64_t u = 0; u < nr; u++) {
            mx[u] = -INFINITY;
            l[u] = 0.0f;
        }
        const int64_t lim = flash_key_limit(g, r0, nr);
        for (int64_t c0 = 0; c0 < lim; c0 += TP__FLASH_BC) {
            const int64_t nc = lim - c0 < TP__FLASH_BC ? lim - c0 : TP__FLASH_BC;
            flash_scores(g, q, k, r0, nr, c0, nc, s);
            for (int64_t u = 0; u < nr; u++) {
                float *su = s + u * TP__FLASH_BC, bm = -INFINITY;
                for (int64_t j = 0; j < nc; j++)
                    bm = su[j] > bm ? su[j] : bm;
                const float mn = bm > mx[u] ? bm : mx[u];
                if (mn == -INFINITY) { /* nothing visible yet: p = 0 */
                    memset(su, 0, (size_t)nc * sizeof *su);
                    continue;
                }
                const float corr = expf(mx[u] - mn); /* 0 when mx was -inf */
                l[u] = l[u] * corr + flash_exp(su, nc, mn);
                mx[u] = mn;
                if (corr != 1.0f)
                    for (int64_t d = 0; d < Dv; d++)
                        o[u * Dv + d] *= corr;
            }
            tp__k_gemm(false, false, nr, Dv, nc, 1.0f, s, TP__FLASH_BC, v + c0 * g->v_ld,
                       g->v_ld, 1.0f, o, Dv);
        }
        for (int64_t u = 0; u < nr; u++) {
            if (l[u] == 0.0f) { /* no visible key: PyTorch's safe softmax gives 0 */
                memset(o + u * Dv, 0, (size_t)Dv * sizeof *o);
                lse[r0 + u] = -INFINITY;
                continue;
            }
            const float inv = 1.0f / l[u];
            for (int64_t d = 0; d < Dv; d++)
                o[u * Dv + d] *= inv;
            lse[r0 + u] = mx[u] + logf(l[u]);
        }
    }
}

void tp__k_flash_bwd(const tp__flash_group *g, const float *q, const float *k, const float *v,
                     const float *out, const float *lse, const float *gout, float *delta,
                     float *gq, float *gk, float *gv, float *scratch)
{
    float *p = scratch, *dp = scratch + TP__FLASH_BR * TP__FLASH_BC;
    const int64_t M = g->M, D = g->D, Dv = g->Dv;
    for (int64_t r = 0; r < M; r++) {
        float acc = 0.0f;
        for (int64_t d = 0; d < Dv; d++)
            acc += gout[r * Dv + d] * out[r * Dv + d];
        delta[r] = acc;
    }
    if (gq)
        memset(gq, 0, (size_t)(M * D) * sizeof *gq);
    if (gk)
        memset(gk, 0, (size_t)(g->Sk * D) * sizeof *gk);
    if (gv)
        memset(gv, 0, (size_t)(g->Sk * Dv) * sizeof *gv);
    for (int64_t c0 = 0; c0 < g->Sk; c0 += TP__FLASH_BC) {
        const int64_t nc = g->Sk - c0 < TP__FLASH_BC ? g->Sk - c0 : TP__FLASH_BC;
        for (int64_t r0 = 0; r0 < M; r0 += TP__FLASH_BR) {
            const int64_t nr = M - r0 < TP__FLASH_BR ? M - r0 : TP__FLASH_BR;
            if (flash_key_limit(g, r0, nr) <= c0)
                continue; /* every key of the block is past every row's diagonal */
            flash_scores(g, q, k, r0, nr, c0, nc, p);
            for (int64_t u = 0; u < nr; u++) {
                float *pu = p + u * TP__FLASH_BC;
                const float ls = lse[r0 + u];
                if (ls == -INFINITY) /* no visible key: p = 0 */
                    memset(pu, 0, (size_t)nc * sizeof *pu);
                else
                    (void)flash_exp(pu, nc, ls);
            }
            const float *go = gout + r0 * Dv;
            if (gv)
                tp__k_gemm(true, false, nc, Dv, nr, 1.0f, p, TP__FLASH_BC, go, Dv, 1.0f,
                           gv + c0 * Dv, Dv);
            if (!gq && !gk)
                continue;
            tp__k_gemm(false, true, nr, nc, Dv, 1.0f, go, Dv, v + c0 * g->v_ld, g->v_ld, 0.0f,
                       dp, TP__FLASH_BC);
            for (int64_t u = 0; u < nr; u++) {
                float *pu = p + u * TP__FLASH_BC;
                const float *du = dp + u * TP__FLASH_BC;
                const float dl = delta[r0 + u];
                for (int64_t j = 0; j < nc; j++)
                    pu[j] *= du[j] - dl; /* p becomes ds */
            }
            if (gq)
                tp__k_gemm(false, false, nr, D, nc, g->scale, p, TP__FLASH_BC, k + c0 * g->k_ld,
                           g->k_ld, 1.0f, gq + r0 * D, D);
            if (gk)
                tp__k_gemm(true, false, nc, D, nr, g->scale, p, TP__FLASH_BC, q + r0 * D, D,
                           1.0f, gk + c0 * D, D);
        }
    }
}
