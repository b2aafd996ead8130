/* The CPU engine's kernel table (kernels.h): each entry answers anything but
 * f32 (all the CPU takes) with TP_ERR_NOT_SUPPORTED, else runs the kernel of
 * cpu.c, which cannot fail, and returns TP_OK.
 * Kept apart from cpu.c, which the kernel test compiles into its own
 * executable and which therefore may use only public symbols. */
#include <string.h>

#include "core/core.h"
#include "kernels/cpu.h"
#include "kernels/kernels.h"

static bool cpu_supports(tp__kop op, tp_dtype dtype)
{
    return op > TP__KOP_NONE && op < TP__KOP_COUNT && dtype == TP_F32;
}

/* The table's TP_ERR_NOT_SUPPORTED naming op and dtype: each entry's answer
 * for anything but f32, before its kernel. */
static tp_status unsupported(tp__kop op, tp_dtype dtype)
{
    return tp__kernels_unsupported(&tp__kernels_cpu, op, dtype);
}

/* ---- matrix products ---------------------------------------------------------- */

static tp_status cpu_gemm(tp_device dev, tp_dtype dtype, bool trans_a, bool trans_b, int64_t m,
                          int64_t n, int64_t k, float alpha, const void *a, int64_t lda,
                          const void *b, int64_t ldb, float beta, void *c, int64_t ldc)
{
    return dtype != TP_F32 ? unsupported(TP__KOP_GEMM, dtype)
                           : (tp__k_gemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c,
                                         ldc),
                              TP_OK);
}

static tp_status cpu_linear_fwd(tp_device dev, tp_dtype dtype, const void *x, const void *w,
                                const void *bias, void *y, int64_t rows, int64_t in, int64_t out)
{
    return dtype != TP_F32 ? unsupported(TP__KOP_LINEAR_FWD, dtype)
                           : (tp__k_linear_fwd(x, w, bias, y, rows, in, out), TP_OK);
}

static tp_status cpu_linear_bwd(tp_device dev, tp_dtype dtype, const void *x, const void *w,
                                const void *gy, void *gx, void *gw, void *gb, int64_t rows,
                                int64_t in, int64_t out, bool accumulate)
{
    return dtype != TP_F32 ? unsupported(TP__KOP_LINEAR_BWD, dtype)
                           : (tp__k_linear_bwd(x, w, gy, gx, gw, gb, rows, in, out, accumulate),
                              TP_OK);
}

/* ---- elementwise ---------------------------------------------------------------- */

static tp_status cpu_copy(tp_device dev, tp_dtype dtype, void *dst, const void *src, int64_t n)
{
    if (dtype != TP_F32)
        return unsupported(TP__KOP_COPY, dtype);
    if (n > 0 && dst != src)
        memcpy(dst, src, (size_t)n * sizeof(float));
    return TP_OK;
}

static tp_status cpu_fill(tp_device dev, tp_dtype dtype, void *y, float value, int64_t n)
{
    return dtype == TP_F32 ? (tp__k_fill(y, value, n), TP_OK) : unsupported(TP__KOP_FILL, dtype);
}

static tp_status cpu_add(tp_device dev, tp_dtype dtype, const void *a, const void *b, void *y,
                         int64_t n)
{
    return dtype == TP_F32 ? (tp__k_add(a, b, y, n), TP_OK) : unsupported(TP__KOP_ADD, dtype);
}

static tp_status cpu_scale(tp_device dev, tp_dtype dtype, const void *a, float s, void *y,
                           int64_t n)
{
    return dtype == TP_F32 ? (tp__k_scale(a, s, y, n), TP_OK) : unsupported(TP__KOP_SCALE, dtype);
}

static tp_status cpu_mul(tp_device dev, tp_dtype dtype, const void *a, const void *b, void *y,
                         int64_t n)
{
    return dtype == TP_F32 ? (tp__k_mul(a, b, y, n), TP_OK) : unsupported(TP__KOP_MUL, dtype);
}

static tp_status cpu_accumulate(tp_device dev, tp_dtype dtype, void *y, const void *a, int64_t n)
{
    return dtype != TP_F32 ? unsupported(TP__KOP_ACCUMULATE, dtype)
                           : (tp__k_accumulate(y, a, n), TP_OK);
}

static tp_status cpu_add_bcast(tp_device dev, tp_dtype dtype, const void *a, const void *b,
                               void *y, int ndim, const int64_t *shape, const int64_t *astride,
                               const int64_t *bstride)
{
    return dtype != TP_F32 ? unsupported(TP__KOP_ADD_BCAST, dtype)
                           : (tp__k_add_bcast(a, b, y, ndim, shape, astride, bstride), TP_OK);
}

static tp_status cpu_sum_bcast(tp_device dev, tp_dtype dtype, const void *x, void *y, int ndim,
                               const int64_t *shape, const int64_t *yshape)
{
    return dtype != TP_F32 ? unsupported(TP__KOP_SUM_BCAST, dtype)
                           : (tp__k_sum_bcast(x, y, ndim, shape, yshape), TP_OK);
}

static tp_status cpu_mul_bcast(tp_device dev, tp_dtype dtype, const void *a, const void *b,
                               void *y, int ndim, const int64_t *shape, const int64_t *astride,
                               const int64_t *bstride)
{
    return dtype != TP_F32 ? unsupported(TP__KOP_MUL_BCAST, dtype)
                           : (tp__k_mul_bcast(a, b, y, ndim, shape, astride, bstride), TP_OK);
}

static tp_status cpu_gather(tp_device dev, tp_dtype dtype, void *y, const void *x, int ndim,
                            const int64_t *shape, const int64_t *stride)
{
    return dtype != TP_F32 ? unsupported(TP__KOP_GATHER, dtype)
                           : (tp__k_gather(y, x, ndim, shape, stride), TP_OK);
}

static tp_status cpu_relu_fwd(tp_device dev, tp_dtype dtype, const void *x, void *y, int64_t n)
{
    return dtype != TP_F32 ? unsupported(TP__KOP_RELU_FWD, dtype)
                           : (tp__k_relu_fwd(x, y, n), TP_OK);
}

static tp_status cpu_relu_bwd(tp_device dev, tp_dtype dtype, const void *x, const void *gy,
                              void *gx, int64_t n)
{
    return dtype != TP_F32 ? unsupported(TP__KOP_RELU_BWD, dtype)
                           : (tp__k_relu_bwd(x, gy, gx, n), TP_OK);
}

static tp_status cpu_gelu_fwd(tp_device dev, tp_dtype dtype, const void *x, void *y, int64_t n,
                              bool tanh_approx)
{
    return dtype != TP_F32 ? unsupported(TP__KOP_GELU_FWD, dtype)
                           : (tp__k_gelu_fwd(x, y, n, tanh_approx), TP_OK);
}

static tp_status cpu_gelu_bwd(tp_device dev, tp_dtype dtype, const void *x, const void *gy,
                              void *gx, int64_t n, bool tanh_approx)
{
    return dtype != TP_F32 ? unsupported(TP__KOP_GELU_BWD, dtype)
                           : (tp__k_gelu_bwd(x, gy, gx, n, tanh_approx), TP_OK);
}

/* ---- reductions ------------------------------------------------------------------ */

static tp_status cpu_sum_dim(tp_device dev, tp_dtype dtype, const void *x, void *y,
                             int64_t outer, int64_t size, int64_t inner, double div)
{
    if (dtype != TP_F32)
        return unsupported(TP__KOP_SUM_DIM, dtype);
    if (size > 0)
        tp__k_sum_dim_div(x, y, outer, size, inner, div);
    else /* nothing to read: 0 / div (NaN for the mean of nothing) */
        tp__k_fill(y, (float)(0.0 / div), outer * inner);
    return TP_OK;
}

static tp_status cpu_sum_dim_bwd(tp_device dev, tp_dtype dtype, const void *gy, void *gx,
                                 int64_t outer, int64_t size, int64_t inner, float scale)
{
    return dtype != TP_F32 ? unsupported(TP__KOP_SUM_DIM_BWD, dtype)
                           : (tp__k_sum_dim_bwd(gy, gx, outer, size, inner, scale), TP_OK);
}

static tp_status cpu_sum_all(tp_device dev, tp_dtype dtype, const void *x, int64_t n, void *y,
                             double div)
{
    if (dtype != TP_F32)
        return unsupported(TP__KOP_SUM_ALL, dtype);
    *(float *)y = (float)(tp__k_sum_all(x, n) / div);
    return TP_OK;
}

static tp_status cpu_softmax_fwd(tp_device dev, tp_dtype dtype, const void *x, void *y,
                                 int64_t rows, int64_t cols)
{
    return dtype != TP_F32 ? unsupported(TP__KOP_SOFTMAX_FWD, dtype)
                           : (tp__k_softmax_fwd(x, y, rows, cols), TP_OK);
}

static tp_status cpu_softmax_bwd(tp_device dev, tp_dtype dtype, const void *y, const void *gy,
                                 void *gx, int64_t rows, int64_t cols)
{
    return dtype != TP_F32 ? unsupported(TP__KOP_SOFTMAX_BWD, dtype)
                           : (tp__k_softmax_bwd(y, gy, gx, rows, cols), TP_OK);
}

static tp_status cpu_causal_mask(tp_device dev, tp_dtype dtype, void *s, int64_t batch,
                                 int64_t S)
{
    return dtype != TP_F32 ? unsupported(TP__KOP_CAUSAL_MASK, dtype)
                           : (tp__k_causal_mask(s, batch, S), TP_OK);
}

static tp_status cpu_transpose_last2(tp_device dev, tp_dtype dtype, const void *x, void *y,
                                     int64_t batch, int64_t r, int64_t c)
{
    return dtype != TP_F32 ? unsupported(TP__KOP_TRANSPOSE_LAST2, dtype)
                           : (tp__k_transpose_last2(x, y, batch, r, c), TP_OK);
}

/* ---- embedding, norms, dropout ------------------------------------------------------ */

static tp_status cpu_embedding_fwd(tp_device dev, tp_dtype dtype, const int64_t *idx, int64_t n,
                                   const void *w, int64_t rows_local, int64_t dim,
                                   int64_t offset, void *y)
{
    return dtype != TP_F32 ? unsupported(TP__KOP_EMBEDDING_FWD, dtype)
                           : (tp__k_embedding_fwd(idx, n, w, rows_local, dim, offset, y), TP_OK);
}

static tp_status cpu_embedding_bwd(tp_device dev, tp_dtype dtype, const int64_t *idx, int64_t n,
                                   const void *gy, int64_t rows_local, int64_t dim,
                                   int64_t offset, void *gw)
{
    return dtype != TP_F32 ? unsupported(TP__KOP_EMBEDDING_BWD, dtype)
                           : (tp__k_embedding_bwd(idx, n, gy, rows_local, dim, offset, gw), TP_OK);
}

static tp_status cpu_layer_norm_fwd(tp_device dev, tp_dtype dtype, const void *x, const void *w,
                                    const void *b, void *y, float *mean, float *rstd,
                                    int64_t rows, int64_t cols, float eps)
{
    return dtype != TP_F32 ? unsupported(TP__KOP_LAYER_NORM_FWD, dtype)
                           : (tp__k_layer_norm_fwd(x, w, b, y, mean, rstd, rows, cols, eps), TP_OK);
}

static tp_status cpu_layer_norm_bwd(tp_device dev, tp_dtype dtype, const void *x, const void *w,
                                    const float *mean, const float *rstd, const void *gy,
                                    void *gx, void *gw, void *gb, int64_t rows, int64_t cols)
{
    return dtype != TP_F32 ? unsupported(TP__KOP_LAYER_NORM_BWD, dtype)
                           : (tp__k_layer_norm_bwd(x, w, mean, rstd, gy, gx, gw, gb, rows, cols),
                              TP_OK);
}

static tp_status cpu_rms_norm_fwd(tp_device dev, tp_dtype dtype, const void *x, const void *w,
                                  void *y, float *rstd, int64_t rows, int64_t cols, float eps)
{
    return dtype != TP_F32 ? unsupported(TP__KOP_RMS_NORM_FWD, dtype)
                           : (tp__k_rms_norm_fwd(x, w, y, rstd, rows, cols, eps), TP_OK);
}

static tp_status cpu_rms_norm_bwd(tp_device dev, tp_dtype dtype, const void *x, const void *w,
                                  const float *rstd, const void *gy, void *gx, void *gw,
                                  int64_t rows, int64_t cols)
{
    return dtype != TP_F32 ? unsupported(TP__KOP_RMS_NORM_BWD, dtype)
                           : (tp__k_rms_norm_bwd(x, w, rstd, gy, gx, gw, rows, cols), TP_OK);
}

static tp_status cpu_dropout_fwd(tp_device dev, tp_dtype dtype, const void *x, void *y,
                                 uint8_t *mask, int ndim, const int64_t *shape,
                                 const int64_t *global_shape, const int64_t *offset, float p,
                                 uint64_t seed)
{
    return dtype != TP_F32 ? unsupported(TP__KOP_DROPOUT_FWD, dtype)
                           : (tp__k_dropout_fwd(x, y, mask, ndim, shape, global_shape, offset, p,
                                                seed),
                              TP_OK);
}

static tp_status cpu_dropout_bwd(tp_device dev, tp_dtype dtype, const void *gy,
                                 const uint8_t *mask, void *gx, int64_t n, float p)
{
    return dtype != TP_F32 ? unsupported(TP__KOP_DROPOUT_BWD, dtype)
                           : (tp__k_dropout_bwd(gy, mask, gx, n, p), TP_OK);
}

/* ---- cross entropy ---------------------------------------------------------------- */

static tp_status cpu_cross_entropy_fwd(tp_device dev, tp_dtype dtype, const void *x,
                                       const int64_t *target, const void *weight, void *loss,
                                       int64_t rows, int64_t classes, int64_t inner,
                                       int64_t ignore_index)
{
    return dtype != TP_F32 ? unsupported(TP__KOP_CROSS_ENTROPY_FWD, dtype)
                           : (tp__k_cross_entropy_fwd(x, target, weight, loss, rows, classes,
                                                      inner, ignore_index, NULL),
                              TP_OK);
}

static tp_status cpu_cross_entropy_bwd(tp_device dev, tp_dtype dtype, const void *x,
                                       const int64_t *target, const void *weight,
                                       const void *gloss, void *gx, int64_t rows,
                                       int64_t classes, int64_t inner, int64_t ignore_index)
{
    return dtype != TP_F32 ? unsupported(TP__KOP_CROSS_ENTROPY_BWD, dtype)
                           : (tp__k_cross_entropy_bwd(x, target, weight, gloss, gx, rows, classes,
                                                      inner, ignore_index),
                              TP_OK);
}

static tp_status cpu_ce_gloss(tp_device dev, tp_dtype dtype, const void *g, void *gl,
                              int64_t rows, bool broadcast, double div)
{
    return dtype != TP_F32 ? unsupported(TP__KOP_CE_GLOSS, dtype)
                           : (tp__k_ce_gloss(g, gl, rows, broadcast, div), TP_OK);
}

static tp_status cpu_row_max(tp_device dev, tp_dtype dtype, const void *x, float *mx,
                             int64_t rows, int64_t cols, int64_t inner)
{
    return dtype != TP_F32 ? unsupported(TP__KOP_ROW_MAX, dtype)
                           : (tp__k_row_max(x, mx, rows, cols, inner), TP_OK);
}

static tp_status cpu_row_sumexp(tp_device dev, tp_dtype dtype, const void *x, const float *mx,
                                float *s, int64_t rows, int64_t cols, int64_t inner)
{
    return dtype != TP_F32 ? unsupported(TP__KOP_ROW_SUMEXP, dtype)
                           : (tp__k_row_sumexp(x, mx, s, rows, cols, inner), TP_OK);
}

static tp_status cpu_pick_target(tp_device dev, tp_dtype dtype, const void *x,
                                 const int64_t *target, float *picked, int64_t rows,
                                 int64_t cols, int64_t inner, int64_t offset, int64_t ignore_index)
{
    return dtype != TP_F32 ? unsupported(TP__KOP_PICK_TARGET, dtype)
                           : (tp__k_pick_target(x, target, picked, rows, cols, inner, offset,
                                                ignore_index),
                              TP_OK);
}

static tp_status cpu_vocab_ce_loss(tp_device dev, tp_dtype dtype, const int64_t *target,
                                   const void *weight, const float *mx, const float *sumexp,
                                   const float *picked, void *loss, int64_t rows,
                                   int64_t ignore_index)
{
    return dtype != TP_F32 ? unsupported(TP__KOP_VOCAB_CE_LOSS, dtype)
                           : (tp__k_vocab_ce_loss(target, weight, mx, sumexp, picked, loss, rows,
                                                  ignore_index),
                              TP_OK);
}

static tp_status cpu_vocab_ce_bwd(tp_device dev, tp_dtype dtype, const void *x,
                                  const int64_t *target, const void *weight, const float *mx,
                                  const float *sumexp, const void *gloss, void *gx, int64_t rows,
                                  int64_t cols, int64_t inner, int64_t offset,
                                  int64_t ignore_index)
{
    return dtype != TP_F32 ? unsupported(TP__KOP_VOCAB_CE_BWD, dtype)
                           : (tp__k_vocab_ce_bwd(x, target, weight, mx, sumexp, gloss, gx, rows,
                                                 cols, inner, offset, ignore_index),
                              TP_OK);
}

/* ---- optimizers -------------------------------------------------------------------- */

static tp_status cpu_sgd_step(tp_device dev, tp_dtype dtype, void *p, const void *g, int64_t n,
                              double lr)
{
    return dtype != TP_F32 ? unsupported(TP__KOP_SGD_STEP, dtype)
                           : (tp__k_sgd_step(p, g, n, lr), TP_OK);
}

static tp_status cpu_adam_step(tp_device dev, tp_dtype dtype, void *p, float *m, float *v,
                               const void *g, int64_t n, double beta1, double beta2,
                               double step_size, double bc2_sqrt, double eps)
{
    return dtype != TP_F32 ? unsupported(TP__KOP_ADAM_STEP, dtype)
                           : (tp__k_adam_step(p, m, v, g, n, beta1, beta2, step_size, bc2_sqrt,
                                              eps),
                              TP_OK);
}

#define CPU_ENTRY(NAME, field) .field = cpu_##field,
const tp__kernels tp__kernels_cpu = {
    .name = "cpu",
    .supports = cpu_supports,
    TP__KERNEL_ENTRIES(CPU_ENTRY)
};
