/* The CUDA engine of the local kernels (cuda.cu): the same contracts as the
 * CPU kernels in kernels.h, on device pointers of CUDA device `dev`. Not
 * installed.
 *
 * Every function makes `dev` current for the call (restoring the caller's
 * device), issues its work on the calling thread's compute stream for `dev`
 * (tp__cuda_stream: one per rank thread and device) and returns without
 * waiting for it, except where a comment says it reads a result back. Launch
 * errors come back as TP_ERR_BACKEND with CUDA's text (TP_ERR_NO_MEMORY for
 * allocation failures). Sizes are int64; every kernel loops grid-stride, so
 * any n works with a bounded grid.
 *
 * Differences from kernels.h: the fallible kernels return tp_status; the
 * matrix products take a dtype (f32, f16 or bf16, f32 accumulation); sums
 * that the CPU returns (sum_all) are written to device memory; cross entropy
 * does not compute the weight sum (the op layer has it from the host copy of
 * the targets); a few kernels exist only here (gather, ce_gloss,
 * vocab_ce_loss, sgd/adam steps) where the CPU path uses plain loops in the op
 * layer. */
#ifndef TP_KERNELS_CUDA_H
#define TP_KERNELS_CUDA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tp/config.h"
#include "tp/status.h"
#include "tp/tensor.h"

#if TP_HAVE_CUDA

#ifdef __cplusplus
extern "C" {
#endif

/* ---- matrix products (cuBLAS, column-major: C^T = op(B)^T op(A)^T) ------- */

/* Row-major C[m,n] = alpha op(A) op(B) + beta C, as tp__k_gemm, for dtype
 * f32, f16 or bf16 (A, B, C all of it), accumulating in f32. */
tp_status tp__kc_gemm(int dev, tp_dtype dtype, bool trans_a, bool trans_b, int64_t m, int64_t n,
                      int64_t k, float alpha, const void *a, int64_t lda, const void *b,
                      int64_t ldb, float beta, void *c, int64_t ldc);
/* As tp__k_linear_fwd / _bwd, in dtype (bias and grads in the same dtype). */
tp_status tp__kc_linear_fwd(int dev, tp_dtype dtype, const void *x, const void *w,
                            const void *bias, void *y, int64_t rows, int64_t in, int64_t out);
tp_status tp__kc_linear_bwd(int dev, tp_dtype dtype, const void *x, const void *w,
                            const void *gy, void *gx, void *gw, void *gb, int64_t rows,
                            int64_t in, int64_t out, bool accumulate);

/* ---- elementwise (f32) ---------------------------------------------------- */

/* dst = src, n floats, on the stream (no-op for n == 0 or dst == src). */
tp_status tp__kc_copy(int dev, float *dst, const float *src, int64_t n);
tp_status tp__kc_fill(int dev, float *y, float value, int64_t n);
tp_status tp__kc_add(int dev, const float *a, const float *b, float *y, int64_t n);
tp_status tp__kc_mul(int dev, const float *a, const float *b, float *y, int64_t n);
tp_status tp__kc_scale(int dev, const float *a, float s, float *y, int64_t n);
tp_status tp__kc_accumulate(int dev, float *y, const float *a, int64_t n);
/* As tp__k_add_bcast / _mul_bcast (y contiguous, operands through element
 * strides, 0 along broadcast dims). */
tp_status tp__kc_add_bcast(int dev, const float *a, const float *b, float *y, int ndim,
                           const int64_t *shape, const int64_t *astride, const int64_t *bstride);
tp_status tp__kc_mul_bcast(int dev, const float *a, const float *b, float *y, int ndim,
                           const int64_t *shape, const int64_t *astride, const int64_t *bstride);
tp_status tp__kc_relu_fwd(int dev, const float *x, float *y, int64_t n);
tp_status tp__kc_relu_bwd(int dev, const float *x, const float *gy, float *gx, int64_t n);
tp_status tp__kc_gelu_fwd(int dev, const float *x, float *y, int64_t n, bool tanh_approx);
tp_status tp__kc_gelu_bwd(int dev, const float *x, const float *gy, float *gx, int64_t n,
                          bool tanh_approx);

/* ---- reductions ----------------------------------------------------------- */

/* y[outer, inner] = sum_s x[outer, s, inner] / div (double accumulation;
 * size 0 gives 0 / div). */
tp_status tp__kc_sum_dim(int dev, const float *x, float *y, int64_t outer, int64_t size,
                         int64_t inner, double div);
tp_status tp__kc_sum_dim_bwd(int dev, const float *gy, float *gx, int64_t outer, int64_t size,
                             int64_t inner, float scale);
/* As tp__k_sum_bcast: x summed over the dims where yshape is 1 (one block of
 * summed dims goes through sum_dim's kernels). */
tp_status tp__kc_sum_bcast(int dev, const float *x, float *y, int ndim, const int64_t *shape,
                           const int64_t *yshape);
/* y[0] = (float)(sum of n elements / div), y a device pointer. */
tp_status tp__kc_sum_all(int dev, const float *x, int64_t n, float *y, double div);

tp_status tp__kc_softmax_fwd(int dev, const float *x, float *y, int64_t rows, int64_t cols);
tp_status tp__kc_softmax_bwd(int dev, const float *y, const float *gy, float *gx, int64_t rows,
                             int64_t cols);
/* s[b, i, j] = -inf for j > i, over `batch` [S, S] score matrices */
tp_status tp__kc_causal_mask(int dev, float *s, int64_t batch, int64_t S);

tp_status tp__kc_transpose_last2(int dev, const float *x, float *y, int64_t batch, int64_t r,
                                 int64_t c);

/* y (contiguous, `shape`) = the f32 elements of x at the element strides
 * `stride` (ndim <= TP_MAX_DIMS): a permuted or strided view made contiguous. */
tp_status tp__kc_gather(int dev, float *y, const float *x, int ndim, const int64_t *shape,
                        const int64_t *stride);

/* ---- embedding, norms, dropout ---------------------------------------------- */

tp_status tp__kc_embedding_fwd(int dev, const int64_t *idx, int64_t n, const float *w,
                               int64_t rows_local, int64_t dim, int64_t offset, float *y);
/* atomicAdd into gw: the order of additions to a row is not fixed */
tp_status tp__kc_embedding_bwd(int dev, const int64_t *idx, int64_t n, const float *gy,
                               int64_t rows_local, int64_t dim, int64_t offset, float *gw);

tp_status tp__kc_layer_norm_fwd(int dev, const float *x, const float *w, const float *b, float *y,
                                float *mean, float *rstd, int64_t rows, int64_t cols, float eps);
tp_status tp__kc_layer_norm_bwd(int dev, const float *x, const float *w, const float *mean,
                                const float *rstd, const float *gy, float *gx, float *gw,
                                float *gb, int64_t rows, int64_t cols);
tp_status tp__kc_rms_norm_fwd(int dev, const float *x, const float *w, float *y, float *rstd,
                              int64_t rows, int64_t cols, float eps);
tp_status tp__kc_rms_norm_bwd(int dev, const float *x, const float *w, const float *rstd,
                              const float *gy, float *gx, float *gw, int64_t rows, int64_t cols);

/* The CPU mask exactly: keep iff tp_rng_uniform(seed, global index) >= p. */
tp_status tp__kc_dropout_fwd(int dev, const float *x, float *y, uint8_t *mask, int ndim,
                             const int64_t *shape, const int64_t *global_shape,
                             const int64_t *offset, float p, uint64_t seed);
tp_status tp__kc_dropout_bwd(int dev, const float *gy, const uint8_t *mask, float *gx, int64_t n,
                             float p);

/* ---- cross entropy ---------------------------------------------------------- */

/* Logits laid out [outer, classes, inner], rows = outer * inner, as the CPU
 * kernels in kernels.h. */
tp_status tp__kc_cross_entropy_fwd(int dev, const float *x, const int64_t *target,
                                   const float *weight, float *loss, int64_t rows,
                                   int64_t classes, int64_t inner, int64_t ignore_index);
tp_status tp__kc_cross_entropy_bwd(int dev, const float *x, const int64_t *target,
                                   const float *weight, const float *gloss, float *gx,
                                   int64_t rows, int64_t classes, int64_t inner,
                                   int64_t ignore_index);
/* gl[r] = broadcast ? g[0] / div : g[r] (the per-row loss gradient) */
tp_status tp__kc_ce_gloss(int dev, const float *g, float *gl, int64_t rows, bool broadcast,
                          double div);
tp_status tp__kc_row_max(int dev, const float *x, float *mx, int64_t rows, int64_t cols,
                         int64_t inner);
tp_status tp__kc_row_sumexp(int dev, const float *x, const float *mx, float *s, int64_t rows,
                            int64_t cols, int64_t inner);
tp_status tp__kc_pick_target(int dev, const float *x, const int64_t *target, float *picked,
                             int64_t rows, int64_t cols, int64_t inner, int64_t offset,
                             int64_t ignore_index);
/* loss[r] = w_t (log(sumexp[r]) + mx[r] - picked[r]), 0 where t == ignore_index */
tp_status tp__kc_vocab_ce_loss(int dev, const int64_t *target, const float *weight,
                               const float *mx, const float *sumexp, const float *picked,
                               float *loss, int64_t rows, int64_t ignore_index);
tp_status tp__kc_vocab_ce_bwd(int dev, const float *x, const int64_t *target, const float *weight,
                              const float *mx, const float *sumexp, const float *gloss,
                              float *gx, int64_t rows, int64_t cols, int64_t inner,
                              int64_t offset, int64_t ignore_index);

/* ---- optimizers (the CPU loops of src/nn/optim.c, in double) ---------------- */

tp_status tp__kc_sgd_step(int dev, float *p, const float *g, int64_t n, double lr);
tp_status tp__kc_adam_step(int dev, float *p, float *m, float *v, const float *g, int64_t n,
                           double beta1, double beta2, double step_size, double bc2_sqrt,
                           double eps);

#ifdef __cplusplus
}
#endif

/* Runs kernel `name` of the engine of device `d` (a tp_device): the CUDA one
 * when d is a CUDA device, else the CPU one, which cannot fail. The
 * arguments are those of tp__k_<name>. Evaluates to a tp_status. */
#define TP__K(d, name, ...)                                                     \
    ((d).type == TP_DEVICE_CUDA ? tp__kc_##name((d).index, __VA_ARGS__)         \
                                : (tp__k_##name(__VA_ARGS__), TP_OK))

#else /* !TP_HAVE_CUDA: no tensor can live on a CUDA device */

#define TP__K(d, name, ...) ((void)(d), tp__k_##name(__VA_ARGS__), TP_OK)

#endif

#endif /* TP_KERNELS_CUDA_H */
