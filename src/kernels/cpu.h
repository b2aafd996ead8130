/* The CPU engine's kernels (cpu.c): OpenBLAS sgemm and plain loops on
 * contiguous row-major f32 buffers. The op layer reaches them through the CPU
 * kernel table (cpu_table.c, kernels.h), which adds the dtype check; the
 * kernel test calls them directly. Not installed.
 *
 * The contracts are those of the table's entries (kernels.h) on f32, less
 * the device and dtype arguments; the differences are noted below. Kernels
 * never allocate and never fail. In place: as the table's entries. */
#ifndef TP_KERNELS_CPU_H
#define TP_KERNELS_CPU_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* C[m,n] = alpha * op(A) op(B) + beta * C, op = transpose when trans_*.
 * A is [m,k] (or [k,m] when trans_a), B is [k,n] (or [n,k] when trans_b).
 * Leading dimensions are the row lengths of the stored matrices. Sizes and
 * leading dimensions must fit in a BLAS int; k == 0 gives C = beta * C. */
void tp__k_gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                const float *a, int64_t lda, const float *b, int64_t ldb, float beta, float *c,
                int64_t ldc);

/* y[rows, out] = x[rows, in] W[out, in]^T (+ bias[out] when non-NULL). */
void tp__k_linear_fwd(const float *x, const float *w, const float *bias, float *y, int64_t rows,
                      int64_t in, int64_t out);
/* gx[rows,in] (+)= gy W; gw[out,in] (+)= gy^T x; gb[out] (+)= sum_rows gy.
 * Any of gx, gw, gb may be NULL (not needed). accumulate: add into them. */
void tp__k_linear_bwd(const float *x, const float *w, const float *gy, float *gx, float *gw,
                      float *gb, int64_t rows, int64_t in, int64_t out, bool accumulate);

/* Elementwise on n elements. */
void tp__k_add(const float *a, const float *b, float *y, int64_t n);
void tp__k_mul(const float *a, const float *b, float *y, int64_t n);
void tp__k_scale(const float *a, float s, float *y, int64_t n);
/* y += a (n elements) */
void tp__k_accumulate(float *y, const float *a, int64_t n);
/* y[r, c] += b[c] for a [rows, cols] y: the row broadcast of a bias-like add */
void tp__k_add_row(float *y, const float *b, int64_t rows, int64_t cols);

/* Elementwise with broadcasting: y (contiguous, ndim dims of `shape`) =
 * a + b or a * b, where element i reads a at sum_d i_d astride[d] and b at
 * sum_d i_d bstride[d] (element strides; 0 along the dims an operand is
 * broadcast over; any other strides too, so non-contiguous views work).
 * ndim 0 is one element. The op layer drops size-1 dims and merges dims that
 * are contiguous in both operands first (same-shape operands collapse to one
 * dim); the fast paths key on that form: a contiguous run per innermost row
 * for both (same shape, row broadcast) or for one with the other fixed along
 * the row (column broadcast, scalars). y may be a or b when that operand has
 * y's shape and contiguous strides. */
void tp__k_add_bcast(const float *a, const float *b, float *y, int ndim, const int64_t *shape,
                     const int64_t *astride, const int64_t *bstride);
void tp__k_mul_bcast(const float *a, const float *b, float *y, int ndim, const int64_t *shape,
                     const int64_t *astride, const int64_t *bstride);
/* The backward of a broadcast: y (contiguous, yshape) = x (contiguous, shape)
 * summed over the dims d where yshape[d] is 1 and shape[d] is not (double
 * accumulation; a sum over an empty dim is 0). yshape[d] is shape[d] or 1; y
 * is overwritten. */
void tp__k_sum_bcast(const float *x, float *y, int ndim, const int64_t *shape,
                     const int64_t *yshape);

void tp__k_relu_fwd(const float *x, float *y, int64_t n);
/* gx = gy * (x > 0) */
void tp__k_relu_bwd(const float *x, const float *gy, float *gx, int64_t n);
/* GELU, tanh approximation when `tanh_approx`, else exact (erf). */
void tp__k_gelu_fwd(const float *x, float *y, int64_t n, bool tanh_approx);
void tp__k_gelu_bwd(const float *x, const float *gy, float *gx, int64_t n, bool tanh_approx);

/* Reductions over a dim: the tensor viewed as [outer, size, inner], reduced
 * over `size`: y[outer, inner] = sum_s x[outer, s, inner] (double accumulation). */
void tp__k_sum_dim(const float *x, float *y, int64_t outer, int64_t size, int64_t inner);
/* gx[outer, s, inner] = gy[outer, inner] * scale (the backward of sum / mean) */
void tp__k_sum_dim_bwd(const float *gy, float *gx, int64_t outer, int64_t size, int64_t inner,
                       float scale);
/* Sum of all n elements, accumulated in double. */
double tp__k_sum_all(const float *x, int64_t n);

/* Softmax along the last dim of [rows, cols] (max-subtracted). */
void tp__k_softmax_fwd(const float *x, float *y, int64_t rows, int64_t cols);
/* gx = y * (gy - sum(gy * y)) per row */
void tp__k_softmax_bwd(const float *y, const float *gy, float *gx, int64_t rows, int64_t cols);

/* s[b, i, j] = -inf for j > i in `batch` [S, S] score matrices (causal mask) */
void tp__k_causal_mask(float *s, int64_t batch, int64_t S);

/* Transpose of the last two dims of [batch, r, c] into [batch, c, r]. */
void tp__k_transpose_last2(const float *x, float *y, int64_t batch, int64_t r, int64_t c);

/* Embedding lookup: y[i, :] = w[idx[i] - offset, :] when offset <= idx[i] <
 * offset + rows_local, else zeros (the row-sharded masked lookup; offset 0 and
 * rows_local = num for a whole table). idx are int64. */
void tp__k_embedding_fwd(const int64_t *idx, int64_t n, const float *w, int64_t rows_local,
                         int64_t dim, int64_t offset, float *y);
/* gw[idx[i] - offset, :] += gy[i, :] for indices in range (others skipped). */
void tp__k_embedding_bwd(const int64_t *idx, int64_t n, const float *gy, int64_t rows_local,
                         int64_t dim, int64_t offset, float *gw);

/* LayerNorm over the last dim of [rows, cols]: y = (x - mean) * rstd * w + b
 * (w, b may be NULL: no affine). Saves mean[rows] and rstd[rows]. */
void tp__k_layer_norm_fwd(const float *x, const float *w, const float *b, float *y, float *mean,
                          float *rstd, int64_t rows, int64_t cols, float eps);
/* gx (overwritten), gw and gb accumulated (+=) when non-NULL. */
void tp__k_layer_norm_bwd(const float *x, const float *w, const float *mean, const float *rstd,
                          const float *gy, float *gx, float *gw, float *gb, int64_t rows,
                          int64_t cols);
/* RMSNorm: y = x * rstd * w, rstd = 1/sqrt(mean(x^2) + eps). w may be NULL. */
void tp__k_rms_norm_fwd(const float *x, const float *w, float *y, float *rstd, int64_t rows,
                        int64_t cols, float eps);
void tp__k_rms_norm_bwd(const float *x, const float *w, const float *rstd, const float *gy,
                        float *gx, float *gw, int64_t rows, int64_t cols);

/* Dropout with a counter-based mask: element at GLOBAL linear index g is kept
 * iff tp_rng_uniform(seed, g) >= p, and scaled by 1/(1-p). The buffer is the
 * block of a global tensor (global_shape/offset as in tp_tensor_fill_random,
 * ndim dims), so the mask is identical at every parallel degree. mask
 * (optional, n bytes) receives 1 for kept elements, 0 for dropped ones.
 * ndim <= TP_MAX_DIMS; global_shape and offset may be NULL (the block is the
 * whole tensor). p <= 0: y = x, p >= 1: y = 0.
 * Backward: gx = mask ? gy / (1-p) : 0; mask may be NULL only when p <= 0 or
 * p >= 1. */
void tp__k_dropout_fwd(const float *x, float *y, uint8_t *mask, int ndim, const int64_t *shape,
                       const int64_t *global_shape, const int64_t *offset, float p,
                       uint64_t seed);
void tp__k_dropout_bwd(const float *gy, const uint8_t *mask, float *gx, int64_t n, float p);

/* Cross entropy on logits laid out [outer, classes, inner] (row-major; inner
 * = 1 is [rows, classes]) and int64 targets [outer, inner]: row
 * r = o * inner + i holds the classes x[o, :, i] (stride inner), so logits
 * (N, C, d1, ..., dk) are outer = N, inner = d1 * ... * dk and the targets
 * (N, d1, ..., dk) are their rows in order. rows = outer * inner; inner >= 1.
 * loss[r] = weight[t] * (logsumexp(x[r]) - x[r, t]); rows whose target equals
 * ignore_index get 0 loss and 0 weight. weight may be NULL (all 1).
 * wsum (optional) receives (overwrites) the sum of the weights of counted
 * rows. Targets outside [0, classes) are the op layer's to reject; the kernels
 * treat them like ignore_index (0 loss, 0 gradient) rather than read out of
 * bounds. */
void tp__k_cross_entropy_fwd(const float *x, const int64_t *target, const float *weight,
                             float *loss, int64_t rows, int64_t classes, int64_t inner,
                             int64_t ignore_index, double *wsum);
/* gx[r, c] = gloss[r] * weight[t] * (softmax(x[r])[c] - (c == t)), gx laid out
 * as x. */
void tp__k_cross_entropy_bwd(const float *x, const int64_t *target, const float *weight,
                             const float *gloss, float *gx, int64_t rows, int64_t classes,
                             int64_t inner, int64_t ignore_index);

/* The vocab-parallel pieces (logits sharded on the class dim, this rank owns
 * classes [offset, offset + cols); the local logits laid out [outer, cols,
 * inner] as above, rows = outer * inner):
 *   1. row max of the local logits           -> all_reduce(max)
 *   2. row sum of exp(x - max)               -> all_reduce(sum)
 *   3. the target logit where owned, else 0  -> all_reduce(sum)
 * loss[r] = log(sumexp[r]) + max[r] - target_logit[r] (times the weight).
 * target holds GLOBAL class ids; weight (NULL: all 1) is the whole
 * [classes_global] class-weight vector, indexed by the global target.
 * row_sumexp takes the all-reduced (global) max; vocab_ce_bwd the global max
 * and sumexp. Rows with target == ignore_index (or negative) get 0 gradient. */
void tp__k_row_max(const float *x, float *mx, int64_t rows, int64_t cols, int64_t inner);
void tp__k_row_sumexp(const float *x, const float *mx, float *s, int64_t rows, int64_t cols,
                      int64_t inner);
void tp__k_pick_target(const float *x, const int64_t *target, float *picked, int64_t rows,
                       int64_t cols, int64_t inner, int64_t offset, int64_t ignore_index);
/* gx[r, c] = gloss[r] * w_r * (exp(x[r,c] - max[r]) / sumexp[r] - (c + offset == t)). */
void tp__k_vocab_ce_bwd(const float *x, const int64_t *target, const float *weight,
                        const float *mx, const float *sumexp, const float *gloss, float *gx,
                        int64_t rows, int64_t cols, int64_t inner, int64_t offset,
                        int64_t ignore_index);

/* y[0..n) = value */
void tp__k_fill(float *y, float value, int64_t n);
/* y (contiguous, `shape`) = the elements of x at element strides `stride`. */
void tp__k_gather(float *y, const float *x, int ndim, const int64_t *shape,
                  const int64_t *stride);
/* y[outer, inner] = sum_s x[outer, s, inner] / div, rounded once. */
void tp__k_sum_dim_div(const float *x, float *y, int64_t outer, int64_t size, int64_t inner,
                       double div);
/* gl[r] = broadcast ? g[0] / div : g[r] */
void tp__k_ce_gloss(const float *g, float *gl, int64_t rows, bool broadcast, double div);
/* loss[r] = w_t (log(sumexp[r]) + mx[r] - picked[r]), 0 where t == ignore_index */
void tp__k_vocab_ce_loss(const int64_t *target, const float *weight, const float *mx,
                         const float *sumexp, const float *picked, float *loss, int64_t rows,
                         int64_t ignore_index);

/* The optimizer updates, in double, rounded once per stored value. */
void tp__k_sgd_step(float *p, const float *g, int64_t n, double lr);
void tp__k_adam_step(float *p, float *m, float *v, const float *g, int64_t n, double beta1,
                     double beta2, double step_size, double bc2_sqrt, double eps);

/* SiLU, y = x sigmoid(x), and its gradient gx = gy sig (1 + x (1 - sig)). */
void tp__k_silu_fwd(const float *x, float *y, int64_t n);
void tp__k_silu_bwd(const float *x, const float *gy, float *gx, int64_t n);
/* SwiGLU: y = silu(gate) * up; backward ggate = gy up silu'(gate), gup = gy
 * silu(gate) in one pass, either output NULL when not needed. */
void tp__k_swiglu_fwd(const float *gate, const float *up, float *y, int64_t n);
void tp__k_swiglu_bwd(const float *gate, const float *up, const float *gy, float *ggate,
                      float *gup, int64_t n);
/* The attention probabilities (kernels.h attn_softmax) of rows r0 .. r0 + nr
 * - 1 of the blocks of [rows, Sk] scores, in place, s pointing at row r0
 * (block b = r / rows, query (r % rows) % Sq); pad (NULL: none) int32 when
 * pad_i32, else int64. */
void tp__k_attn_softmax(float *s, int64_t r0, int64_t nr, int64_t rows, int64_t Sq, int64_t Sk,
                        int64_t key_offset, bool causal, const void *pad, bool pad_i32,
                        int64_t pad_div);

/* Fused attention (the flash_attn_fwd / _bwd entries) over one group:
 * q [M, D], out and gout [M, Dv], gq [M, D] contiguous; group key j at k + j
 * * k_ld (v + j * v_ld); gk [Sk, D] and gv [Sk, Dv] contiguous; pad the
 * group's row of the padding mask (NULL: none; int32 when pad_i32, else
 * int64); lse and delta the group's M rows. Query blocks of TP__FLASH_BR rows
 * against key blocks of TP__FLASH_BC keys, each product one sgemm; scratch
 * holds tp__flash_scratch_floats() floats. The backward's outputs may be
 * NULL (not wanted); it overwrites those it is given. */
enum { TP__FLASH_BR = 64, TP__FLASH_BC = 128 };
typedef struct tp__flash_group {
    int64_t M, Sq, Sk, D, Dv, k_ld, v_ld, key_offset;
    const void *pad;
    bool pad_i32, causal;
    float scale;
} tp__flash_group;
static inline int64_t tp__flash_scratch_floats(void)
{
    return 2 * TP__FLASH_BR * TP__FLASH_BC + 2 * TP__FLASH_BR;
}
void tp__k_flash_fwd(const tp__flash_group *g, const float *q, const float *k, const float *v,
                     float *out, float *lse, float *scratch);
void tp__k_flash_bwd(const tp__flash_group *g, const float *q, const float *k, const float *v,
                     const float *out, const float *lse, const float *gout, float *delta,
                     float *gq, float *gk, float *gv, float *scratch);

/* Rotary position embedding (the rope_fwd / rope_bwd entries): x, y [B, H,
 * S, D], cos, sin [*, S, D] with batch stride cos_batch_stride (0:
 * broadcast over B); bwd: gx from gy by the transpose. y may be x. */
void tp__k_rope(const float *x, const float *cosb, const float *sinb, float *y, int64_t B,
                int64_t H, int64_t S, int64_t D, int64_t cos_batch_stride, bool bwd);
/* cos, sin [n, D] from positions pos[n] and inv_freq[D/2] (the rope_cos_sin
 * entry): cos(f) with f = (float)pos * inv_freq[i] in f32, evaluated in
 * double and rounded to f32, times scaling in f32. */
void tp__k_rope_cos_sin(const int64_t *pos, const float *inv_freq, float *cosb, float *sinb,
                        int64_t n, int64_t D, float scaling);

#endif /* TP_KERNELS_CPU_H */
