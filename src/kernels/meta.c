/* The meta engine's kernel table (kernels.h): every entry takes the dtypes
 * the CPU engine takes, touches no buffer and returns TP_OK, so an op on meta
 * tensors runs its shape and placement logic, allocates its (meta) outputs
 * and issues its collectives exactly as on the CPU, with no arithmetic. An
 * entry answers a dtype the CPU engine refuses as the CPU does, so a meta run
 * fails where a real one would. */
#include "core/core.h"
#include "kernels/kernels.h"

/* ---- plan traces (tp/plan.h): each entry records its work in the calling
 * thread's active trace, if any (src/plan/trace.c); a call with a dtype
 * refused fails its op (and so the traced step) anyway.
 * Element-wise work counts elems x arrays x the dtype's size bytes, arrays
 * being the inputs and outputs of that length. */
#include "plan/trace_internal.h"

#define META_GEMM(dtype, m, n, k) tp__plan_gemm(dtype, m, n, k)
#define META_EW(dtype, elems, arrays) tp__plan_elementwise(dtype, elems, arrays, false)
#define META_OPT(dtype, elems, arrays) tp__plan_elementwise(dtype, elems, arrays, true)

static int64_t meta_numel(int ndim, const int64_t *shape)
{
    int64_t n = 1;
    for (int i = 0; i < ndim; i++)
        n *= shape[i];
    return n;
}
/* ---- end of plan traces ---- */

static bool meta_supports(tp__kop op, tp_dtype dtype)
{
    return tp__kernels_cpu.supports(op, dtype);
}

static tp_status meta_ok(tp__kop op, tp_dtype dtype)
{
    return meta_supports(op, dtype) ? TP_OK : tp__kernels_unsupported(&tp__kernels_meta, op, dtype);
}

static tp_status meta_gemm(tp_device dev, tp_dtype dtype, bool trans_a, bool trans_b, int64_t m,
                           int64_t n, int64_t k, float alpha, const void *a, int64_t lda,
                           const void *b, int64_t ldb, float beta, void *c, int64_t ldc)
{
    META_GEMM(dtype, m, n, k);
    return meta_ok(TP__KOP_GEMM, dtype);
}

static tp_status meta_linear_fwd(tp_device dev, tp_dtype dtype, const void *x, const void *w,
                                 const void *bias, void *y, int64_t rows, int64_t in, int64_t out)
{
    META_GEMM(dtype, rows, out, in);
    return meta_ok(TP__KOP_LINEAR_FWD, dtype);
}

static tp_status meta_linear_bwd(tp_device dev, tp_dtype dtype, const void *x, const void *w,
                                 const void *gy, void *gx, void *gw, void *gb, int64_t rows,
                                 int64_t in, int64_t out, bool accumulate)
{
    if (gx)
        META_GEMM(dtype, rows, in, out);
    if (gw)
        META_GEMM(dtype, out, in, rows);
    return meta_ok(TP__KOP_LINEAR_BWD, dtype);
}

static tp_status meta_linear_gelu_fwd(tp_device dev, tp_dtype dtype, const void *x,
                                      const void *w, const void *bias, void *y, void *aux,
                                      int64_t rows, int64_t in, int64_t out, bool tanh_approx)
{
    META_GEMM(dtype, rows, out, in);
    META_EW(dtype, rows * out, 2);
    return meta_ok(TP__KOP_LINEAR_GELU_FWD, dtype);
}

static tp_status meta_linear_gelu_bwd(tp_device dev, tp_dtype dtype, const void *x,
                                      const void *w, const void *aux, const void *gy, void *gz,
                                      void *gx, void *gw, void *gb, int64_t rows, int64_t in,
                                      int64_t out, bool tanh_approx)
{
    META_EW(dtype, rows * out, 3);
    if (gx)
        META_GEMM(dtype, rows, in, out);
    if (gw)
        META_GEMM(dtype, out, in, rows);
    return meta_ok(TP__KOP_LINEAR_GELU_BWD, dtype);
}

static tp_status meta_linear_bwd_dgelu(tp_device dev, tp_dtype dtype, const void *x,
                                       const void *w, const void *gy, const void *aux, void *gz,
                                       void *gb_act, void *gw, void *gb, int64_t rows, int64_t in,
                                       int64_t out, bool tanh_approx)
{
    /* the GELU's input read beside the product (cuBLASLt's epilogue) */
    META_GEMM(dtype, rows, in, out);
    META_EW(dtype, rows * in, 1);
    if (gw)
        META_GEMM(dtype, out, in, rows);
    return meta_ok(TP__KOP_LINEAR_BWD_DGELU, dtype);
}

static tp_status meta_copy(tp_device dev, tp_dtype dtype, void *dst, const void *src, int64_t n)
{
    META_EW(dtype, n, 2);
    return meta_ok(TP__KOP_COPY, dtype);
}

static tp_status meta_fill(tp_device dev, tp_dtype dtype, void *y, float value, int64_t n)
{
    META_EW(dtype, n, 1);
    return meta_ok(TP__KOP_FILL, dtype);
}

static tp_status meta_add(tp_device dev, tp_dtype dtype, const void *a, const void *b, void *y,
                          int64_t n)
{
    META_EW(dtype, n, 3);
    return meta_ok(TP__KOP_ADD, dtype);
}

static tp_status meta_mul(tp_device dev, tp_dtype dtype, const void *a, const void *b, void *y,
                          int64_t n)
{
    META_EW(dtype, n, 3);
    return meta_ok(TP__KOP_MUL, dtype);
}

static tp_status meta_scale(tp_device dev, tp_dtype dtype, const void *a, float s, void *y,
                            int64_t n)
{
    META_EW(dtype, n, 2);
    return meta_ok(TP__KOP_SCALE, dtype);
}

static tp_status meta_accumulate(tp_device dev, tp_dtype dtype, void *y, const void *a, int64_t n)
{
    META_EW(dtype, n, 2);
    return meta_ok(TP__KOP_ACCUMULATE, dtype);
}

static tp_status meta_add_bcast(tp_device dev, tp_dtype dtype, const void *a, const void *b,
                                void *y, int ndim, const int64_t *shape, const int64_t *astride,
                                const int64_t *bstride)
{
    META_EW(dtype, meta_numel(ndim, shape), 3);
    return meta_ok(TP__KOP_ADD_BCAST, dtype);
}

static tp_status meta_mul_bcast(tp_device dev, tp_dtype dtype, const void *a, const void *b,
                                void *y, int ndim, const int64_t *shape, const int64_t *astride,
                                const int64_t *bstride)
{
    META_EW(dtype, meta_numel(ndim, shape), 3);
    return meta_ok(TP__KOP_MUL_BCAST, dtype);
}

static tp_status meta_sum_bcast(tp_device dev, tp_dtype dtype, const void *x, void *y, int ndim,
                                const int64_t *shape, const int64_t *yshape)
{
    META_EW(dtype, meta_numel(ndim, shape), 1);
    return meta_ok(TP__KOP_SUM_BCAST, dtype);
}

static tp_status meta_gather(tp_device dev, tp_dtype dtype, void *y, const void *x, int ndim,
                             const int64_t *shape, const int64_t *stride)
{
    META_EW(dtype, meta_numel(ndim, shape), 2);
    return meta_ok(TP__KOP_GATHER, dtype);
}

static tp_status meta_relu_fwd(tp_device dev, tp_dtype dtype, const void *x, void *y, int64_t n)
{
    META_EW(dtype, n, 2);
    return meta_ok(TP__KOP_RELU_FWD, dtype);
}

static tp_status meta_relu_bwd(tp_device dev, tp_dtype dtype, const void *x, const void *gy,
                               void *gx, int64_t n)
{
    META_EW(dtype, n, 3);
    return meta_ok(TP__KOP_RELU_BWD, dtype);
}

static tp_status meta_gelu_fwd(tp_device dev, tp_dtype dtype, const void *x, void *y, int64_t n,
                               bool tanh_approx)
{
    META_EW(dtype, n, 2);
    return meta_ok(TP__KOP_GELU_FWD, dtype);
}

static tp_status meta_gelu_bwd(tp_device dev, tp_dtype dtype, const void *x, const void *gy,
                               void *gx, int64_t n, bool tanh_approx)
{
    META_EW(dtype, n, 3);
    return meta_ok(TP__KOP_GELU_BWD, dtype);
}

static tp_status meta_sum_dim(tp_device dev, tp_dtype dtype, const void *x, void *y, int64_t outer,
                              int64_t size, int64_t inner, double div)
{
    META_EW(dtype, outer * size * inner, 1);
    return meta_ok(TP__KOP_SUM_DIM, dtype);
}

static tp_status meta_sum_dim_bwd(tp_device dev, tp_dtype dtype, const void *gy, void *gx,
                                  int64_t outer, int64_t size, int64_t inner, float scale)
{
    META_EW(dtype, outer * size * inner, 1);
    return meta_ok(TP__KOP_SUM_DIM_BWD, dtype);
}

static tp_status meta_sum_all(tp_device dev, tp_dtype dtype, const void *x, int64_t n, void *y,
                              double div)
{
    META_EW(dtype, n, 1);
    return meta_ok(TP__KOP_SUM_ALL, dtype);
}

static tp_status meta_softmax_fwd(tp_device dev, tp_dtype dtype, const void *x, void *y,
                                  int64_t rows, int64_t cols)
{
    META_EW(dtype, rows * cols, 2);
    return meta_ok(TP__KOP_SOFTMAX_FWD, dtype);
}

static tp_status meta_softmax_bwd(tp_device dev, tp_dtype dtype, const void *y, const void *gy,
                                  void *gx, int64_t rows, int64_t cols)
{
    META_EW(dtype, rows * cols, 3);
    return meta_ok(TP__KOP_SOFTMAX_BWD, dtype);
}

static tp_status meta_causal_mask(tp_device dev, tp_dtype dtype, void *s, int64_t batch, int64_t S)
{
    META_EW(dtype, batch * S * S, 1);
    return meta_ok(TP__KOP_CAUSAL_MASK, dtype);
}

static tp_status meta_transpose_last2(tp_device dev, tp_dtype dtype, const void *x, void *y,
                                      int64_t batch, int64_t r, int64_t c)
{
    META_EW(dtype, batch * r * c, 2);
    return meta_ok(TP__KOP_TRANSPOSE_LAST2, dtype);
}

static tp_status meta_embedding_fwd(tp_device dev, tp_dtype dtype, const int64_t *idx, int64_t n,
                                    const void *w, int64_t rows_local, int64_t dim, int64_t offset,
                                    void *y)
{
    META_EW(dtype, n * dim, 2);
    return meta_ok(TP__KOP_EMBEDDING_FWD, dtype);
}

static tp_status meta_embedding_bwd(tp_device dev, tp_dtype dtype, const int64_t *idx, int64_t n,
                                    const void *gy, int64_t rows_local, int64_t dim, int64_t offset,
                                    void *gw)
{
    META_EW(dtype, n * dim, 2);
    return meta_ok(TP__KOP_EMBEDDING_BWD, dtype);
}

static tp_status meta_layer_norm_fwd(tp_device dev, tp_dtype dtype, const void *x, const void *w,
                                     const void *b, void *y, float *mean, float *rstd, int64_t rows,
                                     int64_t cols, float eps)
{
    META_EW(dtype, rows * cols, 2);
    return meta_ok(TP__KOP_LAYER_NORM_FWD, dtype);
}

static tp_status meta_layer_norm_bwd(tp_device dev, tp_dtype dtype, const void *x, const void *w,
                                     const float *mean, const float *rstd, const void *gy, void *gx,
                                     void *gw, void *gb, int64_t rows, int64_t cols)
{
    META_EW(dtype, rows * cols, 3);
    return meta_ok(TP__KOP_LAYER_NORM_BWD, dtype);
}

static tp_status meta_rms_norm_fwd(tp_device dev, tp_dtype dtype, const void *x, const void *w,
                                   void *y, float *rstd, int64_t rows, int64_t cols, float eps)
{
    META_EW(dtype, rows * cols, 2);
    return meta_ok(TP__KOP_RMS_NORM_FWD, dtype);
}

static tp_status meta_rms_norm_bwd(tp_device dev, tp_dtype dtype, const void *x, const void *w,
                                   const float *rstd, const void *gy, void *gx, void *gw,
                                   int64_t rows, int64_t cols)
{
    META_EW(dtype, rows * cols, 3);
    return meta_ok(TP__KOP_RMS_NORM_BWD, dtype);
}

static tp_status meta_dropout_fwd(tp_device dev, tp_dtype dtype, const void *x, void *y,
                                  uint8_t *mask, int ndim, const int64_t *shape,
                                  const int64_t *global_shape, const int64_t *offset, float p,
                                  uint64_t seed)
{
    META_EW(dtype, meta_numel(ndim, shape), 2);
    return meta_ok(TP__KOP_DROPOUT_FWD, dtype);
}

static tp_status meta_dropout_bwd(tp_device dev, tp_dtype dtype, const void *gy,
                                  const uint8_t *mask, void *gx, int64_t n, float p)
{
    META_EW(dtype, n, 2);
    return meta_ok(TP__KOP_DROPOUT_BWD, dtype);
}

static tp_status meta_cross_entropy_fwd(tp_device dev, tp_dtype dtype, const void *x,
                                        const int64_t *target, const void *weight, void *loss,
                                        int64_t rows, int64_t classes, int64_t inner,
                                        int64_t ignore_index)
{
    META_EW(dtype, rows * classes * inner, 1);
    return meta_ok(TP__KOP_CROSS_ENTROPY_FWD, dtype);
}

static tp_status meta_cross_entropy_bwd(tp_device dev, tp_dtype dtype, const void *x,
                                        const int64_t *target, const void *weight,
                                        const void *gloss, void *gx, int64_t rows, int64_t classes,
                                        int64_t inner, int64_t ignore_index)
{
    META_EW(dtype, rows * classes * inner, 2);
    return meta_ok(TP__KOP_CROSS_ENTROPY_BWD, dtype);
}

static tp_status meta_ce_gloss(tp_device dev, tp_dtype dtype, const void *g, void *gl, int64_t rows,
                               bool broadcast, double div)
{
    META_EW(dtype, rows, 2);
    return meta_ok(TP__KOP_CE_GLOSS, dtype);
}

static tp_status meta_row_max(tp_device dev, tp_dtype dtype, const void *x, float *mx, int64_t rows,
                              int64_t cols, int64_t inner)
{
    META_EW(dtype, rows * cols * inner, 1);
    return meta_ok(TP__KOP_ROW_MAX, dtype);
}

static tp_status meta_row_sumexp(tp_device dev, tp_dtype dtype, const void *x, const float *mx,
                                 float *s, int64_t rows, int64_t cols, int64_t inner)
{
    META_EW(dtype, rows * cols * inner, 1);
    return meta_ok(TP__KOP_ROW_SUMEXP, dtype);
}

static tp_status meta_pick_target(tp_device dev, tp_dtype dtype, const void *x,
                                  const int64_t *target, float *picked, int64_t rows, int64_t cols,
                                  int64_t inner, int64_t offset, int64_t ignore_index)
{
    META_EW(dtype, rows * inner, 1);
    return meta_ok(TP__KOP_PICK_TARGET, dtype);
}

static tp_status meta_vocab_ce_loss(tp_device dev, tp_dtype dtype, const int64_t *target,
                                    const void *weight, const float *mx, const float *sumexp,
                                    const float *picked, void *loss, int64_t rows,
                                    int64_t ignore_index)
{
    META_EW(dtype, rows, 1);
    return meta_ok(TP__KOP_VOCAB_CE_LOSS, dtype);
}

static tp_status meta_vocab_ce_bwd(tp_device dev, tp_dtype dtype, const void *x,
                                   const int64_t *target, const void *weight, const float *mx,
                                   const float *sumexp, const void *gloss, void *gx, int64_t rows,
                                   int64_t cols, int64_t inner, int64_t offset,
                                   int64_t ignore_index)
{
    META_EW(dtype, rows * cols * inner, 2);
    return meta_ok(TP__KOP_VOCAB_CE_BWD, dtype);
}

static tp_status meta_sgd_step(tp_device dev, tp_dtype dtype, void *p, const void *g, int64_t n,
                               double lr)
{
    META_OPT(dtype, n, 3);
    return meta_ok(TP__KOP_SGD_STEP, dtype);
}

static tp_status meta_adam_step(tp_device dev, tp_dtype dtype, void *p, float *m, float *v,
                                const void *g, int64_t n, double beta1, double beta2,
                                double step_size, double bc2_sqrt, double eps)
{
    META_OPT(dtype, n, 7);
    return meta_ok(TP__KOP_ADAM_STEP, dtype);
}

static tp_status meta_silu_fwd(tp_device dev, tp_dtype dtype, const void *x, void *y, int64_t n)
{
    META_EW(dtype, n, 2);
    return meta_ok(TP__KOP_SILU_FWD, dtype);
}

static tp_status meta_silu_bwd(tp_device dev, tp_dtype dtype, const void *x, const void *gy,
                               void *gx, int64_t n)
{
    META_EW(dtype, n, 3);
    return meta_ok(TP__KOP_SILU_BWD, dtype);
}

static tp_status meta_swiglu_fwd(tp_device dev, tp_dtype dtype, const void *gate, const void *up,
                                 void *y, int64_t n)
{
    META_EW(dtype, n, 3);
    return meta_ok(TP__KOP_SWIGLU_FWD, dtype);
}

/* the gradients wanted: one or two outputs besides the three inputs */
static tp_status meta_swiglu_bwd(tp_device dev, tp_dtype dtype, const void *gate, const void *up,
                                 const void *gy, void *ggate, void *gup, int64_t n)
{
    META_EW(dtype, n, 3 + (ggate != NULL) + (gup != NULL));
    return meta_ok(TP__KOP_SWIGLU_BWD, dtype);
}

static tp_status meta_attn_softmax(tp_device dev, tp_dtype dtype, void *s, int64_t batch,
                                   int64_t rows, int64_t Sq, int64_t Sk, int64_t key_offset,
                                   bool causal, const void *pad, tp_dtype pad_dtype,
                                   int64_t pad_div)
{
    META_EW(dtype, batch * rows * Sk, 2);
    return meta_ok(TP__KOP_ATTN_SOFTMAX, dtype);
}

/* Fused attention: the products of the math form (scores, probabilities
 * times values; the backward also recomputes the scores), the elementwise
 * work on the inputs and outputs only. */
static tp_status meta_flash_attn_fwd(tp_device dev, tp_dtype dtype, const tp__attn_geom *g,
                                     const void *q, const void *k, const void *v, void *out,
                                     float *lse)
{
    for (int64_t b = 0; b < g->G; b++) {
        META_GEMM(dtype, g->M, g->Sk, g->D);
        META_GEMM(dtype, g->M, g->Dv, g->Sk);
    }
    META_EW(dtype, g->G * (g->M * (g->D + g->Dv) + g->Sk * (g->D + g->Dv)), 1);
    return meta_ok(TP__KOP_FLASH_ATTN_FWD, dtype);
}

static tp_status meta_flash_attn_bwd(tp_device dev, tp_dtype dtype, const tp__attn_geom *g,
                                     const void *q, const void *k, const void *v,
                                     const void *out, const float *lse, const void *gout,
                                     float *delta, void *gq, void *gk, void *gv)
{
    for (int64_t b = 0; b < g->G; b++) {
        META_GEMM(dtype, g->M, g->Sk, g->D);
        META_GEMM(dtype, g->M, g->Sk, g->Dv);
        if (gv)
            META_GEMM(dtype, g->Sk, g->Dv, g->M);
        if (gq)
            META_GEMM(dtype, g->M, g->D, g->Sk);
        if (gk)
            META_GEMM(dtype, g->Sk, g->D, g->M);
    }
    META_EW(dtype, g->G * (2 * g->M * (g->D + g->Dv) + 2 * g->Sk * (g->D + g->Dv)), 1);
    return meta_ok(TP__KOP_FLASH_ATTN_BWD, dtype);
}

static tp_status meta_rope_fwd(tp_device dev, tp_dtype dtype, const void *x, const void *cos,
                               const void *sin, void *y, int64_t B, int64_t H, int64_t S, int64_t D,
                               int64_t cos_batch_stride)
{
    META_EW(dtype, B * H * S * D, 4);
    return meta_ok(TP__KOP_ROPE_FWD, dtype);
}

static tp_status meta_rope_bwd(tp_device dev, tp_dtype dtype, const void *gy, const void *cos,
                               const void *sin, void *gx, int64_t B, int64_t H, int64_t S,
                               int64_t D, int64_t cos_batch_stride)
{
    META_EW(dtype, B * H * S * D, 4);
    return meta_ok(TP__KOP_ROPE_BWD, dtype);
}

static tp_status meta_rope_cos_sin(tp_device dev, tp_dtype dtype, const int64_t *pos,
                                   const float *inv_freq, void *cos, void *sin, int64_t n,
                                   int64_t D, float scaling)
{
    META_EW(dtype, n * D, 2);
    return meta_ok(TP__KOP_ROPE_COS_SIN, dtype);
}

#define TP__META_ENTRY(NAME, field) .field = meta_##field,
const tp__kernels tp__kernels_meta = {
    .name = "meta", .supports = meta_supports, TP__KERNEL_ENTRIES(TP__META_ENTRY)};
#undef TP__META_ENTRY
