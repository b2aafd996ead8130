/* The CPU engine's kernel table (kernels.h): each entry answers a dtype other
 * than f32, bf16 and f16 with TP_ERR_NOT_SUPPORTED, else runs the f32 kernel
 * of cpu.c. For bf16 and f16 the kernel runs on f32 copies of the buffers of
 * the op's dtype and each output is rounded once into the dtype (cpu_lowp.h):
 * elementwise entries chunk by chunk through a stack buffer (no allocation),
 * row-like entries unit by unit through cache-sized scratch, the others on
 * whole f32 scratch buffers; scratch may fail (TP_ERR_NO_MEMORY, nothing
 * written). Data movement without arithmetic (copy, fill, the embedding
 * lookup) moves the dtype's bits directly. For f32 the same code hands the
 * kernel the caller's buffers.
 * Kept apart from cpu.c, which the kernel test compiles into its own
 * executable and which therefore may use only public symbols. */
#include <string.h>

#include "core/core.h"
#include "kernels/cpu.h"
#include "kernels/cpu_lowp.h"
#include "kernels/kernels.h"

static bool cpu_supports(tp__kop op, tp_dtype dtype)
{
    return op > TP__KOP_NONE && op < TP__KOP_COUNT &&
           (dtype == TP_F32 || dtype == TP_BF16 || dtype == TP_F16);
}

/* The table's TP_ERR_NOT_SUPPORTED naming op and dtype: each entry's answer
 * for a dtype it does not take, before its kernel. */
static tp_status unsupported(tp__kop op, tp_dtype dtype)
{
    return tp__kernels_unsupported(&tp__kernels_cpu, op, dtype);
}

#define CPU_CHECK(OP)                                \
    do {                                             \
        if (!cpu_supports(TP__KOP_##OP, dtype))      \
            return unsupported(TP__KOP_##OP, dtype); \
    } while (0)

/* The buffers of an elementwise entry, for tp__lp_elementwise. */
#define CPU_BUFS(...) ((void *const[]){__VA_ARGS__})

/* A buffer of the unit driver: per unit ('i', 'o', 'u'), or whole. */
#define PER(p, per, mode) ((tp__lp_buf){(void *)(p), (per), 0, (mode)})
#define WHOLE(p, len, mode) ((tp__lp_buf){(void *)(p), 0, (len), (mode)})
#define UNITS(op, n, c, fn, ...)                                           \
    tp__lp_units(TP__KOP_##op, dtype, (n),                                 \
                 sizeof((tp__lp_buf[]){__VA_ARGS__}) / sizeof(tp__lp_buf), \
                 (tp__lp_buf[]){__VA_ARGS__}, (fn), (c))

/* What the unit entries' kernels take besides their buffers; per-row arrays
 * (f0, f1: f32 statistics; target) are offset by the chunk's first row. */
typedef struct unit_ctx {
    const int64_t *target;
    float *f0, *f1;
    int64_t cols, inner, size, offset, ignore;
    float eps, scale;
    double div;
} unit_ctx;

/* ---- matrix products ---------------------------------------------------------- */

static tp_status cpu_gemm(tp_device dev, tp_dtype dtype, bool trans_a, bool trans_b, int64_t m,
                          int64_t n, int64_t k, float alpha, const void *a, int64_t lda,
                          const void *b, int64_t ldb, float beta, void *c, int64_t ldc)
{
    CPU_CHECK(GEMM);
    if (m <= 0 || n <= 0)
        return TP_OK;
    tp__lp f;
    tp__lp_begin(&f, TP__KOP_GEMM, dtype);
    int64_t la, lb, lc;
    const float *fa = tp__lp_in_mat(&f, a, trans_a ? k : m, trans_a ? m : k, lda, &la);
    const float *fb = tp__lp_in_mat(&f, b, trans_b ? n : k, trans_b ? k : n, ldb, &lb);
    float *fc = tp__lp_out_mat(&f, c, m, n, ldc, beta != 0.0f, &lc);
    if (tp__lp_ok(&f))
        tp__k_gemm(trans_a, trans_b, m, n, k, alpha, fa, la, fb, lb, beta, fc, lc);
    return tp__lp_end(&f);
}

static tp_status cpu_linear_fwd(tp_device dev, tp_dtype dtype, const void *x, const void *w,
                                const void *bias, void *y, int64_t rows, int64_t in, int64_t out)
{
    CPU_CHECK(LINEAR_FWD);
    tp__lp f;
    tp__lp_begin(&f, TP__KOP_LINEAR_FWD, dtype);
    const float *fx = tp__lp_in(&f, x, rows * in), *fw = tp__lp_in(&f, w, out * in);
    const float *fb = tp__lp_in(&f, bias, out);
    float *fy = tp__lp_out(&f, y, rows * out, false);
    if (tp__lp_ok(&f))
        tp__k_linear_fwd(fx, fw, fb, fy, rows, in, out);
    return tp__lp_end(&f);
}

static tp_status cpu_linear_bwd(tp_device dev, tp_dtype dtype, const void *x, const void *w,
                                const void *gy, void *gx, void *gw, void *gb, int64_t rows,
                                int64_t in, int64_t out, bool accumulate)
{
    CPU_CHECK(LINEAR_BWD);
    tp__lp f;
    tp__lp_begin(&f, TP__KOP_LINEAR_BWD, dtype);
    /* x only for gw, w only for gx */
    const float *fx = tp__lp_in(&f, gw ? x : NULL, rows * in);
    const float *fw = tp__lp_in(&f, gx ? w : NULL, out * in);
    const float *fgy = tp__lp_in(&f, gy, rows * out);
    float *fgx = tp__lp_out(&f, gx, rows * in, accumulate);
    float *fgw = tp__lp_out(&f, gw, out * in, accumulate);
    float *fgb = tp__lp_out(&f, gb, out, accumulate);
    if (tp__lp_ok(&f))
        tp__k_linear_bwd(fx, fw, fgy, fgx, fgw, fgb, rows, in, out, accumulate);
    return tp__lp_end(&f);
}

/* The linear + GELU pair composes the unfused entries: on the CPU the
 * products dominate, and a pass that fused the activation or its gradient
 * with the bias gradient would save one sweep over [rows, out] of the
 * work's (in + 2) sweeps. The results are the unfused layers' bit for bit. */
static tp_status cpu_gelu_fwd(tp_device dev, tp_dtype dtype, const void *x, void *y, int64_t n,
                              bool tanh_approx);
static tp_status cpu_gelu_bwd(tp_device dev, tp_dtype dtype, const void *x, const void *gy,
                              void *gx, int64_t n, bool tanh_approx);

static tp_status cpu_linear_gelu_fwd(tp_device dev, tp_dtype dtype, const void *x,
                                     const void *w, const void *bias, void *y, void *aux,
                                     int64_t rows, int64_t in, int64_t out, bool tanh_approx)
{
    CPU_CHECK(LINEAR_GELU_FWD);
    void *pre = aux ? aux : y; /* the GELU may run in place */
    TP_CHECK(cpu_linear_fwd(dev, dtype, x, w, bias, pre, rows, in, out));
    return cpu_gelu_fwd(dev, dtype, pre, y, rows * out, tanh_approx);
}

static tp_status cpu_linear_gelu_bwd(tp_device dev, tp_dtype dtype, const void *x,
                                     const void *w, const void *aux, const void *gy, void *gz,
                                     void *gx, void *gw, void *gb, int64_t rows, int64_t in,
                                     int64_t out, bool tanh_approx)
{
    CPU_CHECK(LINEAR_GELU_BWD);
    TP_CHECK(cpu_gelu_bwd(dev, dtype, aux, gy, gz, rows * out, tanh_approx));
    return cpu_linear_bwd(dev, dtype, x, w, gz, gx, gw, gb, rows, in, out, false);
}

static tp_status cpu_linear_bwd_dgelu(tp_device dev, tp_dtype dtype, const void *x,
                                      const void *w, const void *gy, const void *aux, void *gz,
                                      void *gb_act, void *gw, void *gb, int64_t rows, int64_t in,
                                      int64_t out, bool tanh_approx)
{
    CPU_CHECK(LINEAR_BWD_DGELU);
    TP_CHECK(cpu_linear_bwd(dev, dtype, x, w, gy, gz, gw, gb, rows, in, out, false));
    TP_CHECK(cpu_gelu_bwd(dev, dtype, aux, gz, gz, rows * in, tanh_approx));
    if (!gb_act)
        return TP_OK;
    /* the column sums as the GELU's linear sums its bias gradient */
    return cpu_linear_bwd(dev, dtype, NULL, NULL, gz, NULL, NULL, gb_act, rows, 0, in, false);
}

/* ---- elementwise ---------------------------------------------------------------- */

static tp_status cpu_copy(tp_device dev, tp_dtype dtype, void *dst, const void *src, int64_t n)
{
    CPU_CHECK(COPY);
    if (n > 0 && dst != src) /* bit for bit, whatever the dtype */
        memcpy(dst, src, (size_t)n * tp_dtype_size(dtype));
    return TP_OK;
}

static tp_status cpu_fill(tp_device dev, tp_dtype dtype, void *y, float value, int64_t n)
{
    CPU_CHECK(FILL);
    if (dtype == TP_F32) {
        tp__k_fill(y, value, n);
        return TP_OK;
    }
    uint16_t h, *yh = y; /* the value rounded once */
    tp__lp_store(dtype, &h, &value, 1);
    for (int64_t i = 0; i < n; i++)
        yh[i] = h;
    return TP_OK;
}

static void ew_add(float *const *b, int64_t off, int64_t n, const void *ctx)
{
    tp__k_add(b[0], b[1], b[2], n);
}

static tp_status cpu_add(tp_device dev, tp_dtype dtype, const void *a, const void *b, void *y,
                         int64_t n)
{
    CPU_CHECK(ADD);
    tp__lp_elementwise(dtype, n, 3, CPU_BUFS((void *)a, (void *)b, y), "iio", ew_add, NULL);
    return TP_OK;
}

static void ew_mul(float *const *b, int64_t off, int64_t n, const void *ctx)
{
    tp__k_mul(b[0], b[1], b[2], n);
}

static tp_status cpu_mul(tp_device dev, tp_dtype dtype, const void *a, const void *b, void *y,
                         int64_t n)
{
    CPU_CHECK(MUL);
    tp__lp_elementwise(dtype, n, 3, CPU_BUFS((void *)a, (void *)b, y), "iio", ew_mul, NULL);
    return TP_OK;
}

static void ew_scale(float *const *b, int64_t off, int64_t n, const void *ctx)
{
    tp__k_scale(b[0], *(const float *)ctx, b[1], n);
}

static tp_status cpu_scale(tp_device dev, tp_dtype dtype, const void *a, float s, void *y,
                           int64_t n)
{
    CPU_CHECK(SCALE);
    tp__lp_elementwise(dtype, n, 2, CPU_BUFS((void *)a, y), "io", ew_scale, &s);
    return TP_OK;
}

static void ew_accumulate(float *const *b, int64_t off, int64_t n, const void *ctx)
{
    tp__k_accumulate(b[0], b[1], n);
}

static tp_status cpu_accumulate(tp_device dev, tp_dtype dtype, void *y, const void *a, int64_t n)
{
    CPU_CHECK(ACCUMULATE);
    tp__lp_elementwise(dtype, n, 2, CPU_BUFS(y, (void *)a), "ui", ew_accumulate, NULL);
    return TP_OK;
}

/* The element-offset span [*lo, *lo + n) that ndim dims of `shape` at element
 * strides `stride` read; n is 0 for an empty shape. */
static int64_t span_of(int ndim, const int64_t *shape, const int64_t *stride, int64_t *lo)
{
    int64_t l = 0, h = 0;
    for (int d = 0; d < ndim; d++) {
        if (shape[d] <= 0)
            return *lo = 0, 0;
        int64_t e = (shape[d] - 1) * stride[d];
        l += e < 0 ? e : 0;
        h += e > 0 ? e : 0;
    }
    *lo = l;
    return h - l + 1;
}

static int64_t numel(int ndim, const int64_t *shape)
{
    int64_t n = 1;
    for (int d = 0; d < ndim; d++)
        n *= shape[d];
    return n;
}

typedef void (*bcast_fn)(const float *a, const float *b, float *y, int ndim, const int64_t *shape,
                         const int64_t *astride, const int64_t *bstride);

typedef struct bcast_ctx {
    bcast_fn fn;
    int ndim;
    const int64_t *shape, *astride, *bstride;
} bcast_ctx;

static void u_bcast(float *const *b, int64_t u0, int64_t nu, const void *ctx)
{
    const bcast_ctx *c = ctx;
    int64_t shape[TP_MAX_DIMS];
    memcpy(shape, c->shape, (size_t)c->ndim * sizeof *shape);
    shape[0] = nu;
    c->fn(b[0], b[1], b[2], c->ndim, shape, c->astride, c->bstride);
}

/* An operand as a buffer of the unit driver over dim 0: whole when broadcast
 * along it, per unit when its units tile (stride[0] is the span of the rest,
 * read forwards); false otherwise. */
static bool bcast_operand(const void *p, int ndim, const int64_t *shape, const int64_t *stride,
                          tp__lp_buf *out)
{
    int64_t lo, n = span_of(ndim - 1, shape + 1, stride + 1, &lo);
    if (lo != 0)
        return false;
    if (stride[0] == 0)
        *out = WHOLE(p, n, 'i');
    else if (stride[0] == n)
        *out = PER(p, n, 'i');
    else
        return false;
    return true;
}

static tp_status cpu_bcast(tp__kop op, bcast_fn fn, tp_dtype dtype, const void *a, const void *b,
                           void *y, int ndim, const int64_t *shape, const int64_t *astride,
                           const int64_t *bstride)
{
    if (!cpu_supports(op, dtype))
        return unsupported(op, dtype);
    tp__lp_buf bufs[3];
    if (dtype != TP_F32 && ndim > 0 && shape[0] > 0 && numel(ndim, shape) > 0 &&
        bcast_operand(a, ndim, shape, astride, &bufs[0]) &&
        bcast_operand(b, ndim, shape, bstride, &bufs[1])) {
        /* chunk by chunk along dim 0 (same-shape operands: elementwise) */
        bufs[2] = PER(y, numel(ndim - 1, shape + 1), 'o');
        bcast_ctx c = {fn, ndim, shape, astride, bstride};
        return tp__lp_units(op, dtype, shape[0], 3, bufs, u_bcast, &c);
    }
    tp__lp f;
    tp__lp_begin(&f, op, dtype);
    int64_t alo, blo, an = span_of(ndim, shape, astride, &alo);
    int64_t bn = span_of(ndim, shape, bstride, &blo);
    const float *fa = tp__lp_in_span(&f, a, alo, an), *fb = tp__lp_in_span(&f, b, blo, bn);
    float *fy = tp__lp_out(&f, y, numel(ndim, shape), false);
    if (tp__lp_ok(&f))
        fn(fa, fb, fy, ndim, shape, astride, bstride);
    return tp__lp_end(&f);
}

static tp_status cpu_add_bcast(tp_device dev, tp_dtype dtype, const void *a, const void *b, void *y,
                               int ndim, const int64_t *shape, const int64_t *astride,
                               const int64_t *bstride)
{
    return cpu_bcast(TP__KOP_ADD_BCAST, tp__k_add_bcast, dtype, a, b, y, ndim, shape, astride,
                     bstride);
}

static tp_status cpu_mul_bcast(tp_device dev, tp_dtype dtype, const void *a, const void *b,
                               void *y, int ndim, const int64_t *shape, const int64_t *astride,
                               const int64_t *bstride)
{
    return cpu_bcast(TP__KOP_MUL_BCAST, tp__k_mul_bcast, dtype, a, b, y, ndim, shape, astride,
                     bstride);
}

static tp_status cpu_sum_bcast(tp_device dev, tp_dtype dtype, const void *x, void *y, int ndim,
                               const int64_t *shape, const int64_t *yshape)
{
    CPU_CHECK(SUM_BCAST);
    tp__lp f;
    tp__lp_begin(&f, TP__KOP_SUM_BCAST, dtype);
    const float *fx = tp__lp_in(&f, x, numel(ndim, shape));
    float *fy = tp__lp_out(&f, y, numel(ndim, yshape), false);
    if (tp__lp_ok(&f))
        tp__k_sum_bcast(fx, fy, ndim, shape, yshape);
    return tp__lp_end(&f);
}

static tp_status cpu_gather(tp_device dev, tp_dtype dtype, void *y, const void *x, int ndim,
                            const int64_t *shape, const int64_t *stride)
{
    CPU_CHECK(GATHER);
    tp__lp f;
    tp__lp_begin(&f, TP__KOP_GATHER, dtype);
    int64_t lo, n = span_of(ndim, shape, stride, &lo);
    const float *fx = tp__lp_in_span(&f, x, lo, n);
    float *fy = tp__lp_out(&f, y, numel(ndim, shape), false);
    if (tp__lp_ok(&f))
        tp__k_gather(fy, fx, ndim, shape, stride);
    return tp__lp_end(&f);
}

static void ew_relu_fwd(float *const *b, int64_t off, int64_t n, const void *ctx)
{
    tp__k_relu_fwd(b[0], b[1], n);
}

static tp_status cpu_relu_fwd(tp_device dev, tp_dtype dtype, const void *x, void *y, int64_t n)
{
    CPU_CHECK(RELU_FWD);
    tp__lp_elementwise(dtype, n, 2, CPU_BUFS((void *)x, y), "io", ew_relu_fwd, NULL);
    return TP_OK;
}

static void ew_relu_bwd(float *const *b, int64_t off, int64_t n, const void *ctx)
{
    tp__k_relu_bwd(b[0], b[1], b[2], n);
}

static tp_status cpu_relu_bwd(tp_device dev, tp_dtype dtype, const void *x, const void *gy,
                              void *gx, int64_t n)
{
    CPU_CHECK(RELU_BWD);
    tp__lp_elementwise(dtype, n, 3, CPU_BUFS((void *)x, (void *)gy, gx), "iio", ew_relu_bwd, NULL);
    return TP_OK;
}

static void ew_gelu_fwd(float *const *b, int64_t off, int64_t n, const void *ctx)
{
    tp__k_gelu_fwd(b[0], b[1], n, *(const bool *)ctx);
}

static tp_status cpu_gelu_fwd(tp_device dev, tp_dtype dtype, const void *x, void *y, int64_t n,
                              bool tanh_approx)
{
    CPU_CHECK(GELU_FWD);
    tp__lp_elementwise(dtype, n, 2, CPU_BUFS((void *)x, y), "io", ew_gelu_fwd, &tanh_approx);
    return TP_OK;
}

static void ew_gelu_bwd(float *const *b, int64_t off, int64_t n, const void *ctx)
{
    tp__k_gelu_bwd(b[0], b[1], b[2], n, *(const bool *)ctx);
}

static tp_status cpu_gelu_bwd(tp_device dev, tp_dtype dtype, const void *x, const void *gy,
                              void *gx, int64_t n, bool tanh_approx)
{
    CPU_CHECK(GELU_BWD);
    tp__lp_elementwise(dtype, n, 3, CPU_BUFS((void *)x, (void *)gy, gx), "iio", ew_gelu_bwd,
                       &tanh_approx);
    return TP_OK;
}

/* ---- reductions ------------------------------------------------------------------ */

static void u_sum_dim(float *const *b, int64_t u0, int64_t nu, const void *ctx)
{
    const unit_ctx *c = ctx;
    tp__k_sum_dim_div(b[0], b[1], nu, c->size, c->inner, c->div);
}

static void u_fill(float *const *b, int64_t u0, int64_t nu, const void *ctx)
{
    tp__k_fill(b[0], *(const float *)ctx, nu);
}

static tp_status cpu_sum_dim(tp_device dev, tp_dtype dtype, const void *x, void *y,
                             int64_t outer, int64_t size, int64_t inner, double div)
{
    CPU_CHECK(SUM_DIM);
    if (size <= 0) { /* nothing to read: 0 / div (NaN for the mean of nothing) */
        float v = (float)(0.0 / div);
        return UNITS(SUM_DIM, outer * inner, &v, u_fill, PER(y, 1, 'o'));
    }
    unit_ctx c = {.size = size, .inner = inner, .div = div};
    return UNITS(SUM_DIM, outer, &c, u_sum_dim, PER(x, size * inner, 'i'), PER(y, inner, 'o'));
}

static void u_sum_dim_bwd(float *const *b, int64_t u0, int64_t nu, const void *ctx)
{
    const unit_ctx *c = ctx;
    tp__k_sum_dim_bwd(b[0], b[1], nu, c->size, c->inner, c->scale);
}

static tp_status cpu_sum_dim_bwd(tp_device dev, tp_dtype dtype, const void *gy, void *gx,
                                 int64_t outer, int64_t size, int64_t inner, float scale)
{
    CPU_CHECK(SUM_DIM_BWD);
    unit_ctx c = {.size = size, .inner = inner, .scale = scale};
    return UNITS(SUM_DIM_BWD, outer, &c, u_sum_dim_bwd, PER(gy, inner, 'i'),
                 PER(gx, size * inner, 'o'));
}

static tp_status cpu_sum_all(tp_device dev, tp_dtype dtype, const void *x, int64_t n, void *y,
                             double div)
{
    CPU_CHECK(SUM_ALL);
    tp__lp f;
    tp__lp_begin(&f, TP__KOP_SUM_ALL, dtype);
    const float *fx = tp__lp_in(&f, x, n);
    float *fy = tp__lp_out(&f, y, 1, false);
    if (tp__lp_ok(&f))
        *fy = (float)(tp__k_sum_all(fx, n) / div);
    return tp__lp_end(&f);
}

static void u_softmax_fwd(float *const *b, int64_t u0, int64_t nu, const void *ctx)
{
    tp__k_softmax_fwd(b[0], b[1], nu, ((const unit_ctx *)ctx)->cols);
}

static tp_status cpu_softmax_fwd(tp_device dev, tp_dtype dtype, const void *x, void *y,
                                 int64_t rows, int64_t cols)
{
    CPU_CHECK(SOFTMAX_FWD);
    unit_ctx c = {.cols = cols};
    return UNITS(SOFTMAX_FWD, rows, &c, u_softmax_fwd, PER(x, cols, 'i'), PER(y, cols, 'o'));
}

static void u_softmax_bwd(float *const *b, int64_t u0, int64_t nu, const void *ctx)
{
    tp__k_softmax_bwd(b[0], b[1], b[2], nu, ((const unit_ctx *)ctx)->cols);
}

static tp_status cpu_softmax_bwd(tp_device dev, tp_dtype dtype, const void *y, const void *gy,
                                 void *gx, int64_t rows, int64_t cols)
{
    CPU_CHECK(SOFTMAX_BWD);
    unit_ctx c = {.cols = cols};
    return UNITS(SOFTMAX_BWD, rows, &c, u_softmax_bwd, PER(y, cols, 'i'), PER(gy, cols, 'i'),
                 PER(gx, cols, 'o'));
}

static void u_causal_mask(float *const *b, int64_t u0, int64_t nu, const void *ctx)
{
    tp__k_causal_mask(b[0], nu, ((const unit_ctx *)ctx)->cols);
}

static tp_status cpu_causal_mask(tp_device dev, tp_dtype dtype, void *s, int64_t batch,
                                 int64_t S)
{
    CPU_CHECK(CAUSAL_MASK);
    unit_ctx c = {.cols = S};
    return UNITS(CAUSAL_MASK, batch, &c, u_causal_mask, PER(s, S * S, 'u'));
}

static void u_transpose_last2(float *const *b, int64_t u0, int64_t nu, const void *ctx)
{
    const unit_ctx *c = ctx;
    tp__k_transpose_last2(b[0], b[1], nu, c->size, c->cols);
}

static tp_status cpu_transpose_last2(tp_device dev, tp_dtype dtype, const void *x, void *y,
                                     int64_t batch, int64_t r, int64_t c)
{
    CPU_CHECK(TRANSPOSE_LAST2);
    unit_ctx u = {.size = r, .cols = c};
    return UNITS(TRANSPOSE_LAST2, batch, &u, u_transpose_last2, PER(x, r * c, 'i'),
                 PER(y, r * c, 'o'));
}

/* ---- embedding, norms, dropout ------------------------------------------------------ */

static tp_status cpu_embedding_fwd(tp_device dev, tp_dtype dtype, const int64_t *idx, int64_t n,
                                   const void *w, int64_t rows_local, int64_t dim,
                                   int64_t offset, void *y)
{
    CPU_CHECK(EMBEDDING_FWD);
    if (dtype == TP_F32) {
        tp__k_embedding_fwd(idx, n, w, rows_local, dim, offset, y);
        return TP_OK;
    }
    /* the rows' bits themselves: no conversion, no scratch */
    size_t row = (size_t)dim * tp_dtype_size(dtype);
    for (int64_t i = 0; i < n; i++) {
        char *yi = (char *)y + (size_t)i * row;
        if (idx[i] >= offset && idx[i] - offset < rows_local)
            memcpy(yi, (const char *)w + (size_t)(idx[i] - offset) * row, row);
        else
            memset(yi, 0, row);
    }
    return TP_OK;
}

/* bf16/f16 embedding backward on the rows it touches alone (not the whole
 * table): their f32 copies, compacted, take the f32 kernel with the indices
 * renumbered, then each touched row is rounded once. */
static tp_status embedding_bwd_lowp(tp_dtype dtype, const int64_t *idx, int64_t n, const void *gy,
                                    int64_t rows_local, int64_t dim, int64_t offset, void *gw)
{
    tp__lp f;
    tp__lp_begin(&f, TP__KOP_EMBEDDING_BWD, dtype);
    int64_t *slot = tp__lp_scratch(&f, (size_t)rows_local * sizeof *slot); /* row -> slot */
    int64_t *sidx = tp__lp_scratch(&f, (size_t)n * sizeof *sidx);          /* i -> slot */
    int64_t *srow = tp__lp_scratch(&f, (size_t)n * sizeof *srow);          /* slot -> row */
    const float *fgy = tp__lp_in(&f, gy, n * dim);
    if (!tp__lp_ok(&f))
        return tp__lp_end(&f);
    int64_t k = 0;
    for (int64_t r = 0; r < rows_local; r++)
        slot[r] = -1;
    for (int64_t i = 0; i < n; i++) {
        sidx[i] = -1;
        if (idx[i] < offset || idx[i] - offset >= rows_local)
            continue;
        int64_t r = idx[i] - offset;
        if (slot[r] < 0) {
            slot[r] = k;
            srow[k++] = r;
        }
        sidx[i] = slot[r];
    }
    float *g = tp__lp_scratch(&f, (size_t)(k * dim) * sizeof *g);
    if (!tp__lp_ok(&f))
        return tp__lp_end(&f);
    size_t es = tp_dtype_size(dtype);
    for (int64_t j = 0; j < k; j++)
        tp__lp_load(dtype, g + j * dim, (const char *)gw + (size_t)(srow[j] * dim) * es, dim);
    tp__k_embedding_bwd(sidx, n, fgy, k, dim, 0, g);
    for (int64_t j = 0; j < k; j++)
        tp__lp_store(dtype, (char *)gw + (size_t)(srow[j] * dim) * es, g + j * dim, dim);
    return tp__lp_end(&f);
}

static tp_status cpu_embedding_bwd(tp_device dev, tp_dtype dtype, const int64_t *idx, int64_t n,
                                   const void *gy, int64_t rows_local, int64_t dim,
                                   int64_t offset, void *gw)
{
    CPU_CHECK(EMBEDDING_BWD);
    if (dtype != TP_F32)
        return embedding_bwd_lowp(dtype, idx, n, gy, rows_local, dim, offset, gw);
    tp__k_embedding_bwd(idx, n, gy, rows_local, dim, offset, gw);
    return TP_OK;
}

static void u_layer_norm_fwd(float *const *b, int64_t u0, int64_t nu, const void *ctx)
{
    const unit_ctx *c = ctx;
    tp__k_layer_norm_fwd(b[0], b[1], b[2], b[3], c->f0 + u0, c->f1 + u0, nu, c->cols, c->eps);
}

static tp_status cpu_layer_norm_fwd(tp_device dev, tp_dtype dtype, const void *x, const void *w,
                                    const void *b, void *y, float *mean, float *rstd,
                                    int64_t rows, int64_t cols, float eps)
{
    CPU_CHECK(LAYER_NORM_FWD);
    unit_ctx c = {.f0 = mean, .f1 = rstd, .cols = cols, .eps = eps};
    return UNITS(LAYER_NORM_FWD, rows, &c, u_layer_norm_fwd, PER(x, cols, 'i'), WHOLE(w, cols, 'i'),
                 WHOLE(b, cols, 'i'), PER(y, cols, 'o'));
}

static void u_layer_norm_bwd(float *const *b, int64_t u0, int64_t nu, const void *ctx)
{
    const unit_ctx *c = ctx;
    tp__k_layer_norm_bwd(b[0], b[1], c->f0 + u0, c->f1 + u0, b[2], b[3], b[4], b[5], nu, c->cols);
}

static tp_status cpu_layer_norm_bwd(tp_device dev, tp_dtype dtype, const void *x, const void *w,
                                    const float *mean, const float *rstd, const void *gy,
                                    void *gx, void *gw, void *gb, int64_t rows, int64_t cols)
{
    CPU_CHECK(LAYER_NORM_BWD);
    unit_ctx c = {.f0 = (float *)mean, .f1 = (float *)rstd, .cols = cols};
    return UNITS(LAYER_NORM_BWD, rows, &c, u_layer_norm_bwd, PER(x, cols, 'i'), WHOLE(w, cols, 'i'),
                 PER(gy, cols, 'i'), PER(gx, cols, 'o'), WHOLE(gw, cols, 'u'),
                 WHOLE(gb, cols, 'u'));
}

static void u_rms_norm_fwd(float *const *b, int64_t u0, int64_t nu, const void *ctx)
{
    const unit_ctx *c = ctx;
    tp__k_rms_norm_fwd(b[0], b[1], b[2], c->f1 + u0, nu, c->cols, c->eps);
}

static tp_status cpu_rms_norm_fwd(tp_device dev, tp_dtype dtype, const void *x, const void *w,
                                  void *y, float *rstd, int64_t rows, int64_t cols, float eps)
{
    CPU_CHECK(RMS_NORM_FWD);
    unit_ctx c = {.f1 = rstd, .cols = cols, .eps = eps};
    return UNITS(RMS_NORM_FWD, rows, &c, u_rms_norm_fwd, PER(x, cols, 'i'), WHOLE(w, cols, 'i'),
                 PER(y, cols, 'o'));
}

static void u_rms_norm_bwd(float *const *b, int64_t u0, int64_t nu, const void *ctx)
{
    const unit_ctx *c = ctx;
    tp__k_rms_norm_bwd(b[0], b[1], c->f1 + u0, b[2], b[3], b[4], nu, c->cols);
}

static tp_status cpu_rms_norm_bwd(tp_device dev, tp_dtype dtype, const void *x, const void *w,
                                  const float *rstd, const void *gy, void *gx, void *gw,
                                  int64_t rows, int64_t cols)
{
    CPU_CHECK(RMS_NORM_BWD);
    unit_ctx c = {.f1 = (float *)rstd, .cols = cols};
    return UNITS(RMS_NORM_BWD, rows, &c, u_rms_norm_bwd, PER(x, cols, 'i'), WHOLE(w, cols, 'i'),
                 PER(gy, cols, 'i'), PER(gx, cols, 'o'), WHOLE(gw, cols, 'u'));
}

static tp_status cpu_dropout_fwd(tp_device dev, tp_dtype dtype, const void *x, void *y,
                                 uint8_t *mask, int ndim, const int64_t *shape,
                                 const int64_t *global_shape, const int64_t *offset, float p,
                                 uint64_t seed)
{
    CPU_CHECK(DROPOUT_FWD);
    tp__lp f;
    tp__lp_begin(&f, TP__KOP_DROPOUT_FWD, dtype);
    int64_t n = numel(ndim, shape);
    const float *fx = tp__lp_in(&f, x, n);
    float *fy = tp__lp_out(&f, y, n, false);
    if (tp__lp_ok(&f))
        tp__k_dropout_fwd(fx, fy, mask, ndim, shape, global_shape, offset, p, seed);
    return tp__lp_end(&f);
}

typedef struct dropout_ctx {
    const uint8_t *mask;
    float p;
} dropout_ctx;

static void ew_dropout_bwd(float *const *b, int64_t off, int64_t n, const void *ctx)
{
    const dropout_ctx *c = ctx;
    tp__k_dropout_bwd(b[0], c->mask ? c->mask + off : NULL, b[1], n, c->p);
}

static tp_status cpu_dropout_bwd(tp_device dev, tp_dtype dtype, const void *gy,
                                 const uint8_t *mask, void *gx, int64_t n, float p)
{
    CPU_CHECK(DROPOUT_BWD);
    dropout_ctx c = {mask, p};
    tp__lp_elementwise(dtype, n, 2, CPU_BUFS((void *)gy, gx), "io", ew_dropout_bwd, &c);
    return TP_OK;
}

/* ---- cross entropy ---------------------------------------------------------------- */

/* Logits [outer, classes, inner] go unit by unit of outer: a unit holds
 * `inner` rows (row r of unit u is u * inner + r). */
static int64_t outer_of(int64_t rows, int64_t inner)
{
    return inner > 0 ? rows / inner : 0;
}

static void u_ce_fwd(float *const *b, int64_t u0, int64_t nu, const void *ctx)
{
    const unit_ctx *c = ctx;
    tp__k_cross_entropy_fwd(b[0], c->target + u0 * c->inner, b[1], b[2], nu * c->inner, c->cols,
                            c->inner, c->ignore, NULL);
}

static tp_status cpu_cross_entropy_fwd(tp_device dev, tp_dtype dtype, const void *x,
                                       const int64_t *target, const void *weight, void *loss,
                                       int64_t rows, int64_t classes, int64_t inner,
                                       int64_t ignore_index)
{
    CPU_CHECK(CROSS_ENTROPY_FWD);
    unit_ctx c = {.target = target, .cols = classes, .inner = inner, .ignore = ignore_index};
    return UNITS(CROSS_ENTROPY_FWD, outer_of(rows, inner), &c, u_ce_fwd,
                 PER(x, classes * inner, 'i'), WHOLE(weight, classes, 'i'), PER(loss, inner, 'o'));
}

static void u_ce_bwd(float *const *b, int64_t u0, int64_t nu, const void *ctx)
{
    const unit_ctx *c = ctx;
    tp__k_cross_entropy_bwd(b[0], c->target + u0 * c->inner, b[1], b[2], b[3], nu * c->inner,
                            c->cols, c->inner, c->ignore);
}

static tp_status cpu_cross_entropy_bwd(tp_device dev, tp_dtype dtype, const void *x,
                                       const int64_t *target, const void *weight,
                                       const void *gloss, void *gx, int64_t rows,
                                       int64_t classes, int64_t inner, int64_t ignore_index)
{
    CPU_CHECK(CROSS_ENTROPY_BWD);
    unit_ctx c = {.target = target, .cols = classes, .inner = inner, .ignore = ignore_index};
    return UNITS(CROSS_ENTROPY_BWD, outer_of(rows, inner), &c, u_ce_bwd,
                 PER(x, classes * inner, 'i'), WHOLE(weight, classes, 'i'), PER(gloss, inner, 'i'),
                 PER(gx, classes * inner, 'o'));
}

static tp_status cpu_ce_gloss(tp_device dev, tp_dtype dtype, const void *g, void *gl,
                              int64_t rows, bool broadcast, double div)
{
    CPU_CHECK(CE_GLOSS);
    tp__lp f;
    tp__lp_begin(&f, TP__KOP_CE_GLOSS, dtype);
    const float *fg = tp__lp_in(&f, g, broadcast ? 1 : rows);
    float *fgl = tp__lp_out(&f, gl, rows, false);
    if (tp__lp_ok(&f))
        tp__k_ce_gloss(fg, fgl, rows, broadcast, div);
    return tp__lp_end(&f);
}

static void u_row_max(float *const *b, int64_t u0, int64_t nu, const void *ctx)
{
    const unit_ctx *c = ctx;
    tp__k_row_max(b[0], c->f0 + u0 * c->inner, nu * c->inner, c->cols, c->inner);
}

static tp_status cpu_row_max(tp_device dev, tp_dtype dtype, const void *x, float *mx,
                             int64_t rows, int64_t cols, int64_t inner)
{
    CPU_CHECK(ROW_MAX);
    unit_ctx c = {.f0 = mx, .cols = cols, .inner = inner};
    return UNITS(ROW_MAX, outer_of(rows, inner), &c, u_row_max, PER(x, cols * inner, 'i'));
}

static void u_row_sumexp(float *const *b, int64_t u0, int64_t nu, const void *ctx)
{
    const unit_ctx *c = ctx;
    tp__k_row_sumexp(b[0], c->f0 + u0 * c->inner, c->f1 + u0 * c->inner, nu * c->inner, c->cols,
                     c->inner);
}

static tp_status cpu_row_sumexp(tp_device dev, tp_dtype dtype, const void *x, const float *mx,
                                float *s, int64_t rows, int64_t cols, int64_t inner)
{
    CPU_CHECK(ROW_SUMEXP);
    unit_ctx c = {.f0 = (float *)mx, .f1 = s, .cols = cols, .inner = inner};
    return UNITS(ROW_SUMEXP, outer_of(rows, inner), &c, u_row_sumexp, PER(x, cols * inner, 'i'));
}

static void u_pick_target(float *const *b, int64_t u0, int64_t nu, const void *ctx)
{
    const unit_ctx *c = ctx;
    tp__k_pick_target(b[0], c->target + u0 * c->inner, c->f0 + u0 * c->inner, nu * c->inner,
                      c->cols, c->inner, c->offset, c->ignore);
}

static tp_status cpu_pick_target(tp_device dev, tp_dtype dtype, const void *x,
                                 const int64_t *target, float *picked, int64_t rows,
                                 int64_t cols, int64_t inner, int64_t offset, int64_t ignore_index)
{
    CPU_CHECK(PICK_TARGET);
    unit_ctx c = {.target = target,
                  .f0 = picked,
                  .cols = cols,
                  .inner = inner,
                  .offset = offset,
                  .ignore = ignore_index};
    return UNITS(PICK_TARGET, outer_of(rows, inner), &c, u_pick_target, PER(x, cols * inner, 'i'));
}

/* The length of the global class-weight vector the vocab-parallel entries
 * read: one past the largest target they look up (they know no class count). */
static int64_t weight_len(const int64_t *target, int64_t rows, int64_t ignore_index)
{
    int64_t n = 0;
    for (int64_t r = 0; r < rows; r++)
        if (target[r] != ignore_index && target[r] >= n)
            n = target[r] + 1;
    return n;
}

static tp_status cpu_vocab_ce_loss(tp_device dev, tp_dtype dtype, const int64_t *target,
                                   const void *weight, const float *mx, const float *sumexp,
                                   const float *picked, void *loss, int64_t rows,
                                   int64_t ignore_index)
{
    CPU_CHECK(VOCAB_CE_LOSS);
    tp__lp f;
    tp__lp_begin(&f, TP__KOP_VOCAB_CE_LOSS, dtype);
    int64_t nw = weight && dtype != TP_F32 ? weight_len(target, rows, ignore_index) : 0;
    const float *fw = tp__lp_in(&f, weight, nw);
    float *fl = tp__lp_out(&f, loss, rows, false);
    if (tp__lp_ok(&f))
        tp__k_vocab_ce_loss(target, fw, mx, sumexp, picked, fl, rows, ignore_index);
    return tp__lp_end(&f);
}

static void u_vocab_ce_bwd(float *const *b, int64_t u0, int64_t nu, const void *ctx)
{
    const unit_ctx *c = ctx;
    int64_t r0 = u0 * c->inner;
    tp__k_vocab_ce_bwd(b[0], c->target + r0, b[1], c->f0 + r0, c->f1 + r0, b[2], b[3],
                       nu * c->inner, c->cols, c->inner, c->offset, c->ignore);
}

static tp_status cpu_vocab_ce_bwd(tp_device dev, tp_dtype dtype, const void *x,
                                  const int64_t *target, const void *weight, const float *mx,
                                  const float *sumexp, const void *gloss, void *gx, int64_t rows,
                                  int64_t cols, int64_t inner, int64_t offset,
                                  int64_t ignore_index)
{
    CPU_CHECK(VOCAB_CE_BWD);
    int64_t nw = weight && dtype != TP_F32 ? weight_len(target, rows, ignore_index) : 0;
    unit_ctx c = {.target = target,
                  .f0 = (float *)mx,
                  .f1 = (float *)sumexp,
                  .cols = cols,
                  .inner = inner,
                  .offset = offset,
                  .ignore = ignore_index};
    return UNITS(VOCAB_CE_BWD, outer_of(rows, inner), &c, u_vocab_ce_bwd, PER(x, cols * inner, 'i'),
                 WHOLE(weight, nw, 'i'), PER(gloss, inner, 'i'), PER(gx, cols * inner, 'o'));
}

/* ---- optimizers -------------------------------------------------------------------- */

static void ew_sgd(float *const *b, int64_t off, int64_t n, const void *ctx)
{
    tp__k_sgd_step(b[0], b[1], n, *(const double *)ctx);
}

static tp_status cpu_sgd_step(tp_device dev, tp_dtype dtype, void *p, const void *g, int64_t n,
                              double lr)
{
    CPU_CHECK(SGD_STEP);
    tp__lp_elementwise(dtype, n, 2, CPU_BUFS(p, (void *)g), "ui", ew_sgd, &lr);
    return TP_OK;
}

typedef struct adam_ctx {
    float *m, *v;
    double beta1, beta2, step_size, bc2_sqrt, eps;
} adam_ctx;

static void ew_adam(float *const *b, int64_t off, int64_t n, const void *ctx)
{
    const adam_ctx *c = ctx;
    tp__k_adam_step(b[0], c->m + off, c->v + off, b[1], n, c->beta1, c->beta2, c->step_size,
                    c->bc2_sqrt, c->eps);
}

static tp_status cpu_adam_step(tp_device dev, tp_dtype dtype, void *p, float *m, float *v,
                               const void *g, int64_t n, double beta1, double beta2,
                               double step_size, double bc2_sqrt, double eps)
{
    CPU_CHECK(ADAM_STEP);
    adam_ctx c = {m, v, beta1, beta2, step_size, bc2_sqrt, eps};
    tp__lp_elementwise(dtype, n, 2, CPU_BUFS(p, (void *)g), "ui", ew_adam, &c);
    return TP_OK;
}

/* ---- SiLU and SwiGLU -------------------------------------------------------------- */

static void ew_silu_fwd(float *const *b, int64_t off, int64_t n, const void *ctx)
{
    tp__k_silu_fwd(b[0], b[1], n);
}

static tp_status cpu_silu_fwd(tp_device dev, tp_dtype dtype, const void *x, void *y, int64_t n)
{
    CPU_CHECK(SILU_FWD);
    tp__lp_elementwise(dtype, n, 2, CPU_BUFS((void *)x, y), "io", ew_silu_fwd, NULL);
    return TP_OK;
}

static void ew_silu_bwd(float *const *b, int64_t off, int64_t n, const void *ctx)
{
    tp__k_silu_bwd(b[0], b[1], b[2], n);
}

static tp_status cpu_silu_bwd(tp_device dev, tp_dtype dtype, const void *x, const void *gy,
                              void *gx, int64_t n)
{
    CPU_CHECK(SILU_BWD);
    tp__lp_elementwise(dtype, n, 3, CPU_BUFS((void *)x, (void *)gy, gx), "iio", ew_silu_bwd, NULL);
    return TP_OK;
}

static void ew_swiglu_fwd(float *const *b, int64_t off, int64_t n, const void *ctx)
{
    tp__k_swiglu_fwd(b[0], b[1], b[2], n);
}

static tp_status cpu_swiglu_fwd(tp_device dev, tp_dtype dtype, const void *gate, const void *up,
                                void *y, int64_t n)
{
    CPU_CHECK(SWIGLU_FWD);
    tp__lp_elementwise(dtype, n, 3, CPU_BUFS((void *)gate, (void *)up, y), "iio", ew_swiglu_fwd,
                       NULL);
    return TP_OK;
}

static void ew_swiglu_bwd(float *const *b, int64_t off, int64_t n, const void *ctx)
{
    tp__k_swiglu_bwd(b[0], b[1], b[2], b[3], b[4], n);
}

/* five buffers: the driver's chunks shrink to fit its stack arena */
static tp_status cpu_swiglu_bwd(tp_device dev, tp_dtype dtype, const void *gate, const void *up,
                                const void *gy, void *ggate, void *gup, int64_t n)
{
    CPU_CHECK(SWIGLU_BWD);
    tp__lp_elementwise(dtype, n, 5, CPU_BUFS((void *)gate, (void *)up, (void *)gy, ggate, gup),
                       "iiioo", ew_swiglu_bwd, NULL);
    return TP_OK;
}

/* ---- attention ----------------------------------------------------------------------- */

typedef struct attn_ctx {
    int64_t rows, Sq, Sk, key_offset, pad_div;
    const void *pad;
    bool causal, pad_i32;
} attn_ctx;

static void u_attn_softmax(float *const *b, int64_t u0, int64_t nu, const void *ctx)
{
    const attn_ctx *c = ctx;
    tp__k_attn_softmax(b[0], u0, nu, c->rows, c->Sq, c->Sk, c->key_offset, c->causal, c->pad,
                       c->pad_i32, c->pad_div);
}

static tp_status cpu_attn_softmax(tp_device dev, tp_dtype dtype, void *s, int64_t batch,
                                  int64_t rows, int64_t Sq, int64_t Sk, int64_t key_offset,
                                  bool causal, const void *pad, tp_dtype pad_dtype,
                                  int64_t pad_div)
{
    CPU_CHECK(ATTN_SOFTMAX);
    attn_ctx c = {rows, Sq, Sk, key_offset, pad_div, pad, causal, pad_dtype == TP_I32};
    return UNITS(ATTN_SOFTMAX, batch * rows, &c, u_attn_softmax, PER(s, Sk, 'u'));
}

/* ---- fused attention: one group at a time through cpu.c's f32 kernel; for
 * bf16 and f16 the group's q, k, v (out, gout) are f32 copies and its outputs
 * rounded once at the group's end. */

static const void *flash_at(tp_dtype dt, const void *p, int64_t e)
{
    return (const char *)p + e * (int64_t)tp_dtype_size(dt);
}

static tp__flash_group flash_group(const tp__attn_geom *g, int64_t b)
{
    tp__flash_group fg = {g->M, g->Sq, g->Sk, g->D, g->Dv, g->k_ld, g->v_ld, g->key_offset,
                          NULL, g->pad_dtype == TP_I32, g->causal, g->scale};
    if (g->pad)
        fg.pad = flash_at(g->pad_dtype, g->pad, b / g->pad_div * g->pad_ld);
    return fg;
}

static tp_status cpu_flash_attn_fwd(tp_device dev, tp_dtype dtype, const tp__attn_geom *g,
                                    const void *q, const void *k, const void *v, void *out,
                                    float *lse)
{
    CPU_CHECK(FLASH_ATTN_FWD);
    for (int64_t b = 0; b < g->G; b++) {
        tp__flash_group fg = flash_group(g, b);
        tp__lp f;
        tp__lp_begin(&f, TP__KOP_FLASH_ATTN_FWD, dtype);
        int64_t ld;
        const float *fq = tp__lp_in_mat(&f, flash_at(dtype, q, b * g->M * g->D), g->M, g->D,
                                        g->D, &ld);
        const float *fk =
            tp__lp_in_mat(&f, flash_at(dtype, k, b * g->k_gs), g->Sk, g->D, g->k_ld, &fg.k_ld);
        const float *fv =
            tp__lp_in_mat(&f, flash_at(dtype, v, b * g->v_gs), g->Sk, g->Dv, g->v_ld, &fg.v_ld);
        float *fo = tp__lp_out_mat(&f, (void *)flash_at(dtype, out, b * g->M * g->Dv), g->M,
                                   g->Dv, g->Dv, false, &ld);
        float *scratch =
            tp__lp_scratch(&f, (size_t)tp__flash_scratch_floats() * sizeof(float));
        if (tp__lp_ok(&f))
            tp__k_flash_fwd(&fg, fq, fk, fv, fo, lse + b * g->M, scratch);
        TP_CHECK(tp__lp_end(&f));
    }
    return TP_OK;
}

static tp_status cpu_flash_attn_bwd(tp_device dev, tp_dtype dtype, const tp__attn_geom *g,
                                    const void *q, const void *k, const void *v,
                                    const void *out, const float *lse, const void *gout,
                                    float *delta, void *gq, void *gk, void *gv)
{
    CPU_CHECK(FLASH_ATTN_BWD);
    const int64_t M = g->M, D = g->D, Dv = g->Dv, Sk = g->Sk;
    for (int64_t b = 0; b < g->G; b++) {
        tp__flash_group fg = flash_group(g, b);
        tp__lp f;
        tp__lp_begin(&f, TP__KOP_FLASH_ATTN_BWD, dtype);
        int64_t ld;
        const float *fq = tp__lp_in_mat(&f, flash_at(dtype, q, b * M * D), M, D, D, &ld);
        const float *fk =
            tp__lp_in_mat(&f, flash_at(dtype, k, b * g->k_gs), Sk, D, g->k_ld, &fg.k_ld);
        const float *fv =
            tp__lp_in_mat(&f, flash_at(dtype, v, b * g->v_gs), Sk, Dv, g->v_ld, &fg.v_ld);
        const float *fo = tp__lp_in_mat(&f, flash_at(dtype, out, b * M * Dv), M, Dv, Dv, &ld);
        const float *fgo = tp__lp_in_mat(&f, flash_at(dtype, gout, b * M * Dv), M, Dv, Dv, &ld);
        float *fgq = gq ? tp__lp_out_mat(&f, (void *)flash_at(dtype, gq, b * M * D), M, D, D,
                                         false, &ld)
                        : NULL;
        float *fgk = gk ? tp__lp_out_mat(&f, (void *)flash_at(dtype, gk, b * Sk * D), Sk, D, D,
                                         false, &ld)
                        : NULL;
        float *fgv = gv ? tp__lp_out_mat(&f, (void *)flash_at(dtype, gv, b * Sk * Dv), Sk, Dv,
                                         Dv, false, &ld)
                        : NULL;
        float *scratch =
            tp__lp_scratch(&f, (size_t)tp__flash_scratch_floats() * sizeof(float));
        if (tp__lp_ok(&f))
            tp__k_flash_bwd(&fg, fq, fk, fv, fo, lse + b * M, fgo, delta + b * M, fgq, fgk, fgv,
                            scratch);
        TP_CHECK(tp__lp_end(&f));
    }
    return TP_OK;
}

/* ---- rotary position embedding ------------------------------------------------------ */

/* bf16 and f16 go through f32 copies on the stack, like the elementwise
 * entries (no allocation, cannot fail): rows of a (b, h) run of up to
 * ROPE_CHUNK elements, or, for a head dim wider than that, a row's pairs
 * (i, i + D/2) ROPE_CHUNK / 2 at a time. cos and sin are converted once per
 * chunk of positions and serve every head. */
enum { ROPE_CHUNK = 1024 };

typedef struct rope_bufs {
    float x[ROPE_CHUNK], c[ROPE_CHUNK], s[ROPE_CHUNK], y[ROPE_CHUNK];
} rope_bufs;

static const void *rope_at(const void *p, tp_dtype dtype, int64_t e)
{
    return (const char *)p + e * (int64_t)tp_dtype_size(dtype);
}

/* Positions [s0, s0 + r) of batch b, whole rows (D <= ROPE_CHUNK). */
static void rope_rows(tp_dtype dtype, const void *x, const void *cosb, const void *sinb, void *y,
                      int64_t b, int64_t H, int64_t S, int64_t D, int64_t cbs, int64_t s0,
                      int64_t r, bool bwd, rope_bufs *f)
{
    tp__lp_load(dtype, f->c, rope_at(cosb, dtype, b * cbs + s0 * D), r * D);
    tp__lp_load(dtype, f->s, rope_at(sinb, dtype, b * cbs + s0 * D), r * D);
    for (int64_t hd = 0; hd < H; hd++) {
        int64_t e = ((b * H + hd) * S + s0) * D;
        tp__lp_load(dtype, f->x, rope_at(x, dtype, e), r * D);
        tp__k_rope(f->x, f->c, f->s, f->y, 1, 1, r, D, 0, bwd);
        tp__lp_store(dtype, (char *)y + e * (int64_t)tp_dtype_size(dtype), f->y, r * D);
    }
}

/* One row's pairs [j, j + m) and [h + j, h + j + m) as a row of 2m. */
static void rope_pairs(tp_dtype dtype, const void *x, const void *cosb, const void *sinb, void *y,
                       int64_t e, int64_t ce, int64_t h, int64_t j, int64_t m, bool bwd,
                       rope_bufs *f)
{
    const void *src[3] = {x, cosb, sinb};
    float *dst[3] = {f->x, f->c, f->s};
    const int64_t at[3] = {e, ce, ce};
    for (int k = 0; k < 3; k++) {
        tp__lp_load(dtype, dst[k], rope_at(src[k], dtype, at[k] + j), m);
        tp__lp_load(dtype, dst[k] + m, rope_at(src[k], dtype, at[k] + h + j), m);
    }
    tp__k_rope(f->x, f->c, f->s, f->y, 1, 1, 1, 2 * m, 0, bwd);
    tp__lp_store(dtype, (char *)y + (e + j) * (int64_t)tp_dtype_size(dtype), f->y, m);
    tp__lp_store(dtype, (char *)y + (e + h + j) * (int64_t)tp_dtype_size(dtype), f->y + m, m);
}

static tp_status cpu_rope(tp__kop op, tp_dtype dtype, const void *x, const void *cosb,
                          const void *sinb, void *y, int64_t B, int64_t H, int64_t S, int64_t D,
                          int64_t cbs, bool bwd)
{
    if (!cpu_supports(op, dtype))
        return unsupported(op, dtype);
    if (dtype == TP_F32) {
        tp__k_rope(x, cosb, sinb, y, B, H, S, D, cbs, bwd);
        return TP_OK;
    }
    if (B <= 0 || H <= 0 || S <= 0 || D <= 0)
        return TP_OK;
    rope_bufs f;
    const int64_t h = D / 2;
    for (int64_t b = 0; b < B; b++) {
        if (D <= ROPE_CHUNK) {
            const int64_t per = ROPE_CHUNK / D;
            for (int64_t s0 = 0; s0 < S; s0 += per)
                rope_rows(dtype, x, cosb, sinb, y, b, H, S, D, cbs, s0,
                          S - s0 < per ? S - s0 : per, bwd, &f);
            continue;
        }
        for (int64_t hd = 0; hd < H; hd++)
            for (int64_t s = 0; s < S; s++)
                for (int64_t j = 0; j < h; j += ROPE_CHUNK / 2)
                    rope_pairs(dtype, x, cosb, sinb, y, ((b * H + hd) * S + s) * D,
                               b * cbs + s * D, h, j,
                               h - j < ROPE_CHUNK / 2 ? h - j : ROPE_CHUNK / 2, bwd, &f);
    }
    return TP_OK;
}

static tp_status cpu_rope_fwd(tp_device dev, tp_dtype dtype, const void *x, const void *cos,
                              const void *sin, void *y, int64_t B, int64_t H, int64_t S, int64_t D,
                              int64_t cos_batch_stride)
{
    return cpu_rope(TP__KOP_ROPE_FWD, dtype, x, cos, sin, y, B, H, S, D, cos_batch_stride, false);
}

static tp_status cpu_rope_bwd(tp_device dev, tp_dtype dtype, const void *gy, const void *cos,
                              const void *sin, void *gx, int64_t B, int64_t H, int64_t S,
                              int64_t D, int64_t cos_batch_stride)
{
    return cpu_rope(TP__KOP_ROPE_BWD, dtype, gy, cos, sin, gx, B, H, S, D, cos_batch_stride, true);
}

/* bf16 and f16: a row's pairs ROPE_CHUNK / 2 at a time through the f32
 * kernel on the stack (its [1, 2m] result holds each value twice), each
 * value stored to both halves. */
static tp_status cpu_rope_cos_sin(tp_device dev, tp_dtype dtype, const int64_t *pos,
                                  const float *inv_freq, void *cos, void *sin, int64_t n,
                                  int64_t D, float scaling)
{
    CPU_CHECK(ROPE_COS_SIN);
    if (dtype == TP_F32) {
        tp__k_rope_cos_sin(pos, inv_freq, cos, sin, n, D, scaling);
        return TP_OK;
    }
    float c[ROPE_CHUNK], s[ROPE_CHUNK];
    const int64_t h = D / 2, es = (int64_t)tp_dtype_size(dtype);
    for (int64_t r = 0; r < n; r++)
        for (int64_t j = 0; j < h; j += ROPE_CHUNK / 2) {
            const int64_t m = h - j < ROPE_CHUNK / 2 ? h - j : ROPE_CHUNK / 2;
            tp__k_rope_cos_sin(pos + r, inv_freq + j, c, s, 1, 2 * m, scaling);
            for (int64_t half = 0; half < 2; half++) {
                int64_t e = r * D + half * h + j;
                tp__lp_store(dtype, (char *)cos + e * es, c, m);
                tp__lp_store(dtype, (char *)sin + e * es, s, m);
            }
        }
    return TP_OK;
}

#define CPU_ENTRY(NAME, field) .field = cpu_##field,
const tp__kernels tp__kernels_cpu = {
    .name = "cpu",
    .supports = cpu_supports,
    TP__KERNEL_ENTRIES(CPU_ENTRY)
};
