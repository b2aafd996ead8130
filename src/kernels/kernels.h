/* The compute interface: one kernel table per device type (as ggml's backend
 * interface and UCC's component vtables). The op layer, autograd and the
 * optimizers call every local kernel through the table of their tensors'
 * device and never ask which engine that is. Not installed.
 *
 * Engines: the CPU one (cpu_table.c over the f32 loops and OpenBLAS of
 * cpu.c) and the CUDA one (cuda.cu: grid-stride kernels and cuBLAS), which
 * exists only in a CUDA build (cuda_none.c otherwise). Every entry takes
 * f32, bf16 and f16 (docs/API.md "Precision"): arithmetic in f32 (or double
 * where the f32 kernel uses double, the GEMMs accumulating in f32) and each
 * stored output rounded once to the dtype, round to nearest even; the
 * `accumulate` forms read the dtype value, add in f32 and round once. f64 and
 * the integer dtypes are TP_ERR_NOT_SUPPORTED. (CPU: cpu_lowp.c runs the f32
 * kernels on f32 scratch copies.)
 *
 * Every entry has the same signature on every engine: the device it runs on
 * (a CUDA entry makes dev current for the call and restores the caller's
 * device; the CPU ignores it), the dtype of its float buffers, then the
 * operands. Buffers of the op's dtype are void pointers; the statistics a
 * kernel saves for a backward (norm mean and rstd, cross-entropy row max and
 * sums, picked logits) and the Adam moments are f32; indices and targets are
 * int64, dropout masks one byte per element.
 *
 * Every entry returns a tp_status: TP_ERR_NOT_SUPPORTED naming the op and
 * the dtype when supports(op, dtype) is false. On the CPU, f32 entries do not
 * fail; bf16 and f16 entries other than the elementwise ones (which convert
 * in chunks on the stack) may take f32 scratch from the caching allocator and
 * return TP_ERR_NO_MEMORY, having written nothing, when it fails. A CUDA entry queues its work on the calling thread's
 * compute stream for dev and returns without waiting; launch and cuBLAS
 * failures are TP_ERR_BACKEND with CUDA's text (TP_ERR_NO_MEMORY for
 * allocation failures). Kernels allocate no buffers other than that scratch
 * (the CUDA engine makes a thread's cuBLAS handle at its first product) and
 * never check their arguments (the op layer does).
 *
 * Shapes are passed explicitly and every buffer is contiguous row-major
 * unless an entry takes strides. "rows" is the product of all leading dims,
 * "cols" the last dim. Entries that take `accumulate` add into their output
 * instead of overwriting it.
 *
 * In place: the elementwise entries (add, mul, scale, accumulate, relu, gelu,
 * silu, swiglu, dropout, softmax fwd/bwd) accept an output equal to one of their inputs
 * (the same pointer, not a partial overlap); so do add_bcast and mul_bcast
 * for an operand with the output's shape and contiguous strides. Every other
 * entry's outputs must not overlap its inputs. */
#ifndef TP_KERNELS_H
#define TP_KERNELS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tp/status.h"
#include "tp/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The entries of a table, for supports() and messages. */
typedef enum tp__kop {
    TP__KOP_NONE = 0, /* no kernel: supported by no engine */
    TP__KOP_GEMM,
    TP__KOP_LINEAR_FWD,
    TP__KOP_LINEAR_BWD,
    TP__KOP_LINEAR_GELU_FWD,
    TP__KOP_LINEAR_GELU_BWD,
    TP__KOP_LINEAR_BWD_DGELU,
    TP__KOP_COPY,
    TP__KOP_FILL,
    TP__KOP_ADD,
    TP__KOP_MUL,
    TP__KOP_SCALE,
    TP__KOP_ACCUMULATE,
    TP__KOP_ADD_BCAST,
    TP__KOP_MUL_BCAST,
    TP__KOP_SUM_BCAST,
    TP__KOP_GATHER,
    TP__KOP_RELU_FWD,
    TP__KOP_RELU_BWD,
    TP__KOP_GELU_FWD,
    TP__KOP_GELU_BWD,
    TP__KOP_SUM_DIM,
    TP__KOP_SUM_DIM_BWD,
    TP__KOP_SUM_ALL,
    TP__KOP_SOFTMAX_FWD,
    TP__KOP_SOFTMAX_BWD,
    TP__KOP_CAUSAL_MASK,
    TP__KOP_TRANSPOSE_LAST2,
    TP__KOP_EMBEDDING_FWD,
    TP__KOP_EMBEDDING_BWD,
    TP__KOP_LAYER_NORM_FWD,
    TP__KOP_LAYER_NORM_BWD,
    TP__KOP_RMS_NORM_FWD,
    TP__KOP_RMS_NORM_BWD,
    TP__KOP_DROPOUT_FWD,
    TP__KOP_DROPOUT_BWD,
    TP__KOP_CROSS_ENTROPY_FWD,
    TP__KOP_CROSS_ENTROPY_BWD,
    TP__KOP_CE_GLOSS,
    TP__KOP_ROW_MAX,
    TP__KOP_ROW_SUMEXP,
    TP__KOP_PICK_TARGET,
    TP__KOP_VOCAB_CE_LOSS,
    TP__KOP_VOCAB_CE_BWD,
    TP__KOP_SGD_STEP,
    TP__KOP_ADAM_STEP,
    TP__KOP_SILU_FWD,
    TP__KOP_SILU_BWD,
    TP__KOP_SWIGLU_FWD,
    TP__KOP_SWIGLU_BWD,
    TP__KOP_ATTN_SOFTMAX,
    TP__KOP_FLASH_ATTN_FWD,
    TP__KOP_FLASH_ATTN_BWD,
    TP__KOP_ROPE_FWD,
    TP__KOP_ROPE_BWD,
    TP__KOP_ROPE_COS_SIN,
    TP__KOP_COUNT
} tp__kop;

/* The geometry of a fused attention (flash_attn_fwd / _bwd): G groups (a
 * leading index and kv head) of M = n_rep * Sq query rows, the query rows of
 * the group's n_rep query heads one after the other (row r is query r % Sq),
 * against Sk keys. Query i sees key j iff (!causal or j <= key_offset + i)
 * and (pad NULL or pad[(b / pad_div) * pad_ld + j] != 0 in group b; pad of
 * pad_dtype, TP_I64 or TP_I32, on the device). Group b's key j lies at
 * element b * k_gs + j * k_ld of k (likewise v): a KV cache's prefix is read
 * in place. */
typedef struct tp__attn_geom {
    int64_t G, M, Sq, Sk, D, Dv;
    int64_t k_gs, k_ld, v_gs, v_ld;
    int64_t key_offset;
    const void *pad;
    tp_dtype pad_dtype;
    int64_t pad_div, pad_ld;
    float scale;
    bool causal;
} tp__attn_geom;

/* The widest head the fused attention takes (q/k and v alike). */
#define TP__FLASH_MAX_HEAD_DIM 256

typedef struct tp__kernels {
    const char *name; /* "cpu", "cuda", "meta" */

    /* Whether the entry for op takes buffers of dtype (the one question the
     * op layer asks before it runs an op on an engine). */
    bool (*supports)(tp__kop op, tp_dtype dtype);

    /* ---- matrix products ------------------------------------------------- */

    /* C[m,n] = alpha * op(A) op(B) + beta * C, op = transpose when trans_*.
     * A is [m,k] (or [k,m] when trans_a), B is [k,n] (or [n,k] when
     * trans_b); leading dimensions are the row lengths of the stored
     * matrices and must fit in a BLAS int, like the sizes. k == 0 gives
     * C = beta * C (beta 0 overwrites, even NaN). */
    tp_status (*gemm)(tp_device dev, tp_dtype dtype, bool trans_a, bool trans_b, int64_t m,
                      int64_t n, int64_t k, float alpha, const void *a, int64_t lda,
                      const void *b, int64_t ldb, float beta, void *c, int64_t ldc);
    /* y[rows, out] = x[rows, in] W[out, in]^T (+ bias[out] when non-NULL). */
    tp_status (*linear_fwd)(tp_device dev, tp_dtype dtype, const void *x, const void *w,
                            const void *bias, void *y, int64_t rows, int64_t in, int64_t out);
    /* gx[rows,in] (+)= gy W; gw[out,in] (+)= gy^T x; gb[out] (+)= sum_rows gy.
     * Any of gx, gw, gb may be NULL (not needed). */
    tp_status (*linear_bwd)(tp_device dev, tp_dtype dtype, const void *x, const void *w,
                            const void *gy, void *gx, void *gw, void *gb, int64_t rows,
                            int64_t in, int64_t out, bool accumulate);
    /* The linear + GELU of a colwise layer (tp_linear_gelu): aux[rows, out] =
     * x W^T (+ bias), the pre-activation the backward reads (NULL when no
     * backward follows: not kept), and y = gelu(aux) (tanh approximation
     * when tanh_approx, else erf). Where the
     * engine fuses the activation into the product (CUDA, bf16/f16, tanh: cuBLASLt's
     * GELU_AUX_BIAS epilogue) y is gelu of the f32 accumulator, one rounding;
     * elsewhere it is gelu of the rounded aux, as the two unfused ops give. */
    tp_status (*linear_gelu_fwd)(tp_device dev, tp_dtype dtype, const void *x, const void *w,
                                 const void *bias, void *y, void *aux, int64_t rows, int64_t in,
                                 int64_t out, bool tanh_approx);
    /* Its backward: gz[rows, out] = gy * gelu'(aux) (scratch of the caller's,
     * overwritten; rounded to the dtype), then gx = gz W, gw = gz^T x and gb
     * = the column sums of the rounded gz in double, each overwritten, each
     * NULL when not wanted. On CUDA gz and gb come from one pass. */
    tp_status (*linear_gelu_bwd)(tp_device dev, tp_dtype dtype, const void *x, const void *w,
                                 const void *aux, const void *gy, void *gz, void *gx, void *gw,
                                 void *gb, int64_t rows, int64_t in, int64_t out,
                                 bool tanh_approx);
    /* The backward of a linear whose input came out of a GELU (net2 of the
     * Megatron MLP, when tp_linear_gelu produced its input): gz[rows, in] =
     * (gy W) * gelu'(aux) (aux [rows, in], the GELU's input; gz rounded
     * once where the engine fuses it, else gy W rounded, then the GELU
     * gradient rounded, as the two backward kernels give), gb_act[in] =
     * the column sums of gz (the GELU's linear's bias gradient; NULL: not
     * wanted), and the linear's own gw = gy^T x, gb = the column sums of gy
     * (each NULL when not wanted); all overwritten. CUDA, bf16/f16, tanh:
     * gz and gb_act from one cuBLASLt product (DGELU_BGRAD epilogue). */
    tp_status (*linear_bwd_dgelu)(tp_device dev, tp_dtype dtype, const void *x, const void *w,
                                  const void *gy, const void *aux, void *gz, void *gb_act,
                                  void *gw, void *gb, int64_t rows, int64_t in, int64_t out,
                                  bool tanh_approx);

    /* ---- elementwise on n elements ------------------------------------------ */

    /* dst = src (nothing for n <= 0 or dst == src) */
    tp_status (*copy)(tp_device dev, tp_dtype dtype, void *dst, const void *src, int64_t n);
    tp_status (*fill)(tp_device dev, tp_dtype dtype, void *y, float value, int64_t n);
    tp_status (*add)(tp_device dev, tp_dtype dtype, const void *a, const void *b, void *y,
                     int64_t n);
    tp_status (*mul)(tp_device dev, tp_dtype dtype, const void *a, const void *b, void *y,
                     int64_t n);
    tp_status (*scale)(tp_device dev, tp_dtype dtype, const void *a, float s, void *y,
                       int64_t n);
    /* y += a */
    tp_status (*accumulate)(tp_device dev, tp_dtype dtype, void *y, const void *a, int64_t n);

    /* Elementwise with broadcasting: y (contiguous, ndim dims of `shape`) =
     * a + b or a * b, where element i reads a at sum_d i_d astride[d] and b
     * at sum_d i_d bstride[d] (element strides; 0 along the dims an operand
     * is broadcast over; any other strides too, so non-contiguous views
     * work). ndim 0 is one element. The op layer drops size-1 dims and
     * merges dims that are contiguous in both operands first (same-shape
     * operands collapse to one dim); the fast paths key on that form. */
    tp_status (*add_bcast)(tp_device dev, tp_dtype dtype, const void *a, const void *b, void *y,
                           int ndim, const int64_t *shape, const int64_t *astride,
                           const int64_t *bstride);
    tp_status (*mul_bcast)(tp_device dev, tp_dtype dtype, const void *a, const void *b, void *y,
                           int ndim, const int64_t *shape, const int64_t *astride,
                           const int64_t *bstride);
    /* The backward of a broadcast: y (contiguous, yshape) = x (contiguous,
     * shape) summed over the dims d where yshape[d] is 1 and shape[d] is not
     * (double accumulation; a sum over an empty dim is 0). yshape[d] is
     * shape[d] or 1; y is overwritten. */
    tp_status (*sum_bcast)(tp_device dev, tp_dtype dtype, const void *x, void *y, int ndim,
                           const int64_t *shape, const int64_t *yshape);
    /* y (contiguous, `shape`) = the elements of x at the element strides
     * `stride` (ndim <= TP_MAX_DIMS): a permuted or strided view made
     * contiguous. */
    tp_status (*gather)(tp_device dev, tp_dtype dtype, void *y, const void *x, int ndim,
                        const int64_t *shape, const int64_t *stride);

    tp_status (*relu_fwd)(tp_device dev, tp_dtype dtype, const void *x, void *y, int64_t n);
    /* gx = gy * (x > 0) */
    tp_status (*relu_bwd)(tp_device dev, tp_dtype dtype, const void *x, const void *gy, void *gx,
                          int64_t n);
    /* GELU, tanh approximation when `tanh_approx`, else exact (erf). */
    tp_status (*gelu_fwd)(tp_device dev, tp_dtype dtype, const void *x, void *y, int64_t n,
                          bool tanh_approx);
    tp_status (*gelu_bwd)(tp_device dev, tp_dtype dtype, const void *x, const void *gy,
                          void *gx, int64_t n, bool tanh_approx);

    /* ---- reductions ------------------------------------------------------------ */

    /* x viewed as [outer, size, inner], reduced over size: y[outer, inner] =
     * sum_s x[outer, s, inner] / div, accumulated in double and rounded once
     * (size 0 gives 0 / div). */
    tp_status (*sum_dim)(tp_device dev, tp_dtype dtype, const void *x, void *y, int64_t outer,
                         int64_t size, int64_t inner, double div);
    /* gx[outer, s, inner] = gy[outer, inner] * scale (the backward of sum and
     * mean) */
    tp_status (*sum_dim_bwd)(tp_device dev, tp_dtype dtype, const void *gy, void *gx,
                             int64_t outer, int64_t size, int64_t inner, float scale);
    /* y[0] = sum of the n elements / div, accumulated in double and rounded
     * once; y is a buffer on dev. */
    tp_status (*sum_all)(tp_device dev, tp_dtype dtype, const void *x, int64_t n, void *y,
                         double div);

    /* Softmax along the last dim of [rows, cols] (max-subtracted). */
    tp_status (*softmax_fwd)(tp_device dev, tp_dtype dtype, const void *x, void *y, int64_t rows,
                             int64_t cols);
    /* gx = y * (gy - sum(gy * y)) per row */
    tp_status (*softmax_bwd)(tp_device dev, tp_dtype dtype, const void *y, const void *gy,
                             void *gx, int64_t rows, int64_t cols);
    /* s[b, i, j] = -inf for j > i in `batch` [S, S] score matrices */
    tp_status (*causal_mask)(tp_device dev, tp_dtype dtype, void *s, int64_t batch, int64_t S);
    /* The transpose of the last two dims of [batch, r, c] into [batch, c, r]. */
    tp_status (*transpose_last2)(tp_device dev, tp_dtype dtype, const void *x, void *y,
                                 int64_t batch, int64_t r, int64_t c);

    /* ---- embedding, norms, dropout ---------------------------------------------- */

    /* y[i, :] = w[idx[i] - offset, :] when offset <= idx[i] < offset +
     * rows_local, else zeros (the row-sharded masked lookup; offset 0 and
     * rows_local = num for a whole table). */
    tp_status (*embedding_fwd)(tp_device dev, tp_dtype dtype, const int64_t *idx, int64_t n,
                               const void *w, int64_t rows_local, int64_t dim, int64_t offset,
                               void *y);
    /* gw[idx[i] - offset, :] += gy[i, :] for the indices in range (the order
     * of the additions to one row is not fixed on CUDA). */
    tp_status (*embedding_bwd)(tp_device dev, tp_dtype dtype, const int64_t *idx, int64_t n,
                               const void *gy, int64_t rows_local, int64_t dim, int64_t offset,
                               void *gw);
    /* LayerNorm over the last dim of [rows, cols]: y = (x - mean) * rstd * w
     * + b (w, b may be NULL: no affine); saves mean[rows] and rstd[rows]. */
    tp_status (*layer_norm_fwd)(tp_device dev, tp_dtype dtype, const void *x, const void *w,
                                const void *b, void *y, float *mean, float *rstd, int64_t rows,
                                int64_t cols, float eps);
    /* gx overwritten; gw and gb accumulated (+=) when non-NULL. */
    tp_status (*layer_norm_bwd)(tp_device dev, tp_dtype dtype, const void *x, const void *w,
                                const float *mean, const float *rstd, const void *gy, void *gx,
                                void *gw, void *gb, int64_t rows, int64_t cols);
    /* RMSNorm: y = x * rstd * w, rstd = 1/sqrt(mean(x^2) + eps). w may be
     * NULL. Backward as layer_norm_bwd's. */
    tp_status (*rms_norm_fwd)(tp_device dev, tp_dtype dtype, const void *x, const void *w,
                              void *y, float *rstd, int64_t rows, int64_t cols, float eps);
    tp_status (*rms_norm_bwd)(tp_device dev, tp_dtype dtype, const void *x, const void *w,
                              const float *rstd, const void *gy, void *gx, void *gw,
                              int64_t rows, int64_t cols);
    /* Dropout with a counter-based mask: the element at GLOBAL linear index g
     * is kept iff tp_rng_uniform(seed, g) >= p, and scaled by 1/(1-p). The
     * buffer is the block of a global tensor (global_shape/offset as in
     * tp_tensor_fill_random, ndim <= TP_MAX_DIMS dims; NULL: the block is the
     * whole tensor), so the mask is the same at every parallel degree and on
     * every engine. mask (optional, n bytes) receives 1 for kept elements.
     * p <= 0: y = x, p >= 1: y = 0. Backward: gx = mask ? gy / (1-p) : 0;
     * mask may be NULL only when p <= 0 or p >= 1. */
    tp_status (*dropout_fwd)(tp_device dev, tp_dtype dtype, const void *x, void *y,
                             uint8_t *mask, int ndim, const int64_t *shape,
                             const int64_t *global_shape, const int64_t *offset, float p,
                             uint64_t seed);
    tp_status (*dropout_bwd)(tp_device dev, tp_dtype dtype, const void *gy, const uint8_t *mask,
                             void *gx, int64_t n, float p);

    /* ---- cross entropy ------------------------------------------------------------ */

    /* Logits laid out [outer, classes, inner] (row-major; inner = 1 is [rows,
     * classes]) and targets [outer, inner]: row r = o * inner + i holds the
     * classes x[o, :, i] (stride inner); rows = outer * inner.
     * loss[r] = weight[t] * (logsumexp(x[r]) - x[r, t]); rows whose target is
     * ignore_index get 0 loss. weight may be NULL (all 1). Targets outside
     * [0, classes) are the op layer's to reject; the kernels treat them like
     * ignore_index rather than read out of bounds. */
    tp_status (*cross_entropy_fwd)(tp_device dev, tp_dtype dtype, const void *x,
                                   const int64_t *target, const void *weight, void *loss,
                                   int64_t rows, int64_t classes, int64_t inner,
                                   int64_t ignore_index);
    /* gx[r, c] = gloss[r] * weight[t] * (softmax(x[r])[c] - (c == t)), gx
     * laid out as x. */
    tp_status (*cross_entropy_bwd)(tp_device dev, tp_dtype dtype, const void *x,
                                   const int64_t *target, const void *weight, const void *gloss,
                                   void *gx, int64_t rows, int64_t classes, int64_t inner,
                                   int64_t ignore_index);
    /* gl[r] = broadcast ? g[0] / div : g[r] (every row's loss gradient from
     * the reduced or unreduced loss gradient) */
    tp_status (*ce_gloss)(tp_device dev, tp_dtype dtype, const void *g, void *gl, int64_t rows,
                          bool broadcast, double div);
    /* The vocab-parallel pieces (logits sharded on the class dim, this rank
     * owning classes [offset, offset + cols), laid out [outer, cols, inner]
     * as above):
     *   1. row max of the local logits           -> all_reduce(max)
     *   2. row sum of exp(x - max)               -> all_reduce(sum)
     *   3. the target logit where owned, else 0  -> all_reduce(sum)
     * then vocab_ce_loss: loss[r] = w_t (log(sumexp[r]) + mx[r] - picked[r]),
     * 0 where t == ignore_index. target holds GLOBAL class ids; weight (NULL:
     * all 1) is the whole [classes_global] class-weight vector. row_sumexp
     * takes the all-reduced (global) max; vocab_ce_bwd the global max and
     * sumexp: gx[r, c] = gloss[r] w_t (exp(x[r,c] - mx[r]) / sumexp[r] -
     * (c + offset == t)), 0 for rows with target ignore_index (or negative). */
    tp_status (*row_max)(tp_device dev, tp_dtype dtype, const void *x, float *mx, int64_t rows,
                         int64_t cols, int64_t inner);
    tp_status (*row_sumexp)(tp_device dev, tp_dtype dtype, const void *x, const float *mx,
                            float *s, int64_t rows, int64_t cols, int64_t inner);
    tp_status (*pick_target)(tp_device dev, tp_dtype dtype, const void *x, const int64_t *target,
                             float *picked, int64_t rows, int64_t cols, int64_t inner,
                             int64_t offset, int64_t ignore_index);
    tp_status (*vocab_ce_loss)(tp_device dev, tp_dtype dtype, const int64_t *target,
                               const void *weight, const float *mx, const float *sumexp,
                               const float *picked, void *loss, int64_t rows,
                               int64_t ignore_index);
    tp_status (*vocab_ce_bwd)(tp_device dev, tp_dtype dtype, const void *x, const int64_t *target,
                              const void *weight, const float *mx, const float *sumexp,
                              const void *gloss, void *gx, int64_t rows, int64_t cols,
                              int64_t inner, int64_t offset, int64_t ignore_index);

    /* ---- optimizers (in double, rounded once per stored value) -------------------- */

    /* p -= lr * g */
    tp_status (*sgd_step)(tp_device dev, tp_dtype dtype, void *p, const void *g, int64_t n,
                          double lr);
    /* torch.optim.Adam without weight decay: m = b1 m + (1-b1) g, v = b2 v +
     * (1-b2) g^2, p -= step_size m / (sqrt(v) / bc2_sqrt + eps); m and v f32 */
    tp_status (*adam_step)(tp_device dev, tp_dtype dtype, void *p, float *m, float *v,
                           const void *g, int64_t n, double beta1, double beta2,
                           double step_size, double bc2_sqrt, double eps);

    /* ---- SiLU and the SwiGLU gate (elementwise on n elements) -------------------- */

    /* y = x sigmoid(x), the sigmoid from exp(-|x|) (no overflow at any x:
     * silu(-100) is -0 or a subnormal, silu(100) = 100). */
    tp_status (*silu_fwd)(tp_device dev, tp_dtype dtype, const void *x, void *y, int64_t n);
    /* gx = gy sig (1 + x (1 - sig)), sig = sigmoid(x) */
    tp_status (*silu_bwd)(tp_device dev, tp_dtype dtype, const void *x, const void *gy,
                          void *gx, int64_t n);
    /* y = silu(gate) * up */
    tp_status (*swiglu_fwd)(tp_device dev, tp_dtype dtype, const void *gate, const void *up,
                            void *y, int64_t n);
    /* ggate = gy up sig (1 + gate (1 - sig)), gup = gy silu(gate), in one pass;
     * either output may be NULL (not needed). */
    tp_status (*swiglu_bwd)(tp_device dev, tp_dtype dtype, const void *gate, const void *up,
                            const void *gy, void *ggate, void *gup, int64_t n);
    /* ---- attention (ops_attention.c) ------------------------------------------------ */

    /* The attention probabilities in place over `batch` blocks of [rows, Sk]
     * scores, rows = n_rep * Sq: the query rows of n_rep heads one after the
     * other, so row r of a block is query i = r % Sq. Query i sees key j iff
     * (!causal or j <= key_offset + i) and (pad NULL or pad[b / pad_div, j]
     * != 0 for block b; pad is [batch / pad_div, Sk] of pad_dtype, TP_I64 or
     * TP_I32, on dev). Each row becomes the softmax (max-subtracted, f32,
     * the sum in double) of its visible scores, 0 at every other key; a row
     * with no visible key, or whose visible scores are all -inf, becomes 0
     * (PyTorch's _safe_softmax), never NaN. softmax_bwd is its backward (a
     * zero row gets zero gradients). */
    tp_status (*attn_softmax)(tp_device dev, tp_dtype dtype, void *s, int64_t batch,
                              int64_t rows, int64_t Sq, int64_t Sk, int64_t key_offset,
                              bool causal, const void *pad, tp_dtype pad_dtype, int64_t pad_div);

    /* Fused attention (flash attention): the output and each query row's
     * log-sum-exp without the [rows, Sk] scores in memory, tiled over keys
     * with an online softmax; the backward recomputes the probabilities
     * from lse. Same masking as attn_softmax (tp__attn_geom); a row with no
     * visible key gets out 0 and lse -inf (and zero gradients).
     *   fwd: out[b, r] = sum_j p_rj v_j, p = softmax_j(scale q_r . k_j)
     *        lse[b * M + r] = log sum_j exp(scale q_r . k_j), f32
     *   bwd: gq, gk, gv (each may be NULL: not wanted; overwritten) from
     *        gout, with out and lse of the forward; gk, gv [G, Sk, D(v)]
     *        contiguous, gq like q. delta is f32 scratch of G * M.
     * q, out, gout and gq are contiguous [G, M, D(v)]; k and v are read at
     * the geometry's strides. f32 accumulation throughout; only the outputs
     * are rounded to the dtype. D and Dv at most TP__FLASH_MAX_HEAD_DIM. */
    tp_status (*flash_attn_fwd)(tp_device dev, tp_dtype dtype, const tp__attn_geom *g,
                                const void *q, const void *k, const void *v, void *out,
                                float *lse);
    tp_status (*flash_attn_bwd)(tp_device dev, tp_dtype dtype, const tp__attn_geom *g,
                                const void *q, const void *k, const void *v, const void *out,
                                const float *lse, const void *gout, float *delta, void *gq,
                                void *gk, void *gv);

    /* ---- rotary position embedding (HF transformers' apply_rotary_pos_emb) -------- */

    /* x, y [B, H, S, D] (D even, h = D/2); cos, sin [*, S, D] whose batch b
     * starts at element b * cos_batch_stride (0: one [S, D] block for every
     * b). Per row, for i < h (c, s: the row of cos and sin at (b, s)):
     *   y[i]     = x[i] c[i]         - x[i + h] s[i]
     *   y[i + h] = x[i + h] c[i + h] + x[i] s[i + h]
     * each product and the sum rounded to f32 in turn, as PyTorch's
     * x * cos + rotate_half(x) * sin in f32 (no fused multiply-add). The
     * backward (gx from gy, the transpose):
     *   gx[i]     = gy[i] c[i]         + gy[i + h] s[i + h]
     *   gx[i + h] = gy[i + h] c[i + h] - gy[i] s[i]
     * y may be x (gx may be gy): each pair is read before it is written. */
    tp_status (*rope_fwd)(tp_device dev, tp_dtype dtype, const void *x, const void *cos,
                          const void *sin, void *y, int64_t B, int64_t H, int64_t S, int64_t D,
                          int64_t cos_batch_stride);
    tp_status (*rope_bwd)(tp_device dev, tp_dtype dtype, const void *gy, const void *cos,
                          const void *sin, void *gx, int64_t B, int64_t H, int64_t S, int64_t D,
                          int64_t cos_batch_stride);
    /* cos, sin [n, D] of dtype from int64 positions pos[n] and f32
     * inv_freq[D/2], both on dev: for i < D/2, f = (float)pos[r] *
     * inv_freq[i] (one f32 product), cos[r, i] = cos[r, i + D/2] = cos(f) *
     * scaling in f32, rounded once to dtype (the CPU evaluates cos in double,
     * CUDA with sincosf; both within 2 ulp of f32), likewise sin. */
    tp_status (*rope_cos_sin)(tp_device dev, tp_dtype dtype, const int64_t *pos,
                              const float *inv_freq, void *cos, void *sin, int64_t n, int64_t D,
                              float scaling);
} tp__kernels;

/* The entries of a table in its order, X(NAME, field) for TP__KOP_NAME and
 * the field: the engines' tables and the op names are built from it, so an
 * engine that lacks an entry does not compile. */
#define TP__KERNEL_ENTRIES(X)                                                   \
    X(GEMM, gemm)                                                              \
    X(LINEAR_FWD, linear_fwd)                                                  \
    X(LINEAR_BWD, linear_bwd)                                                  \
    X(LINEAR_GELU_FWD, linear_gelu_fwd)                                        \
    X(LINEAR_GELU_BWD, linear_gelu_bwd)                                        \
    X(LINEAR_BWD_DGELU, linear_bwd_dgelu)                                      \
    X(COPY, copy)                                                              \
    X(FILL, fill)                                                              \
    X(ADD, add)                                                                \
    X(MUL, mul)                                                                \
    X(SCALE, scale)                                                            \
    X(ACCUMULATE, accumulate)                                                  \
    X(ADD_BCAST, add_bcast)                                                    \
    X(MUL_BCAST, mul_bcast)                                                    \
    X(SUM_BCAST, sum_bcast)                                                    \
    X(GATHER, gather)                                                          \
    X(RELU_FWD, relu_fwd)                                                      \
    X(RELU_BWD, relu_bwd)                                                      \
    X(GELU_FWD, gelu_fwd)                                                      \
    X(GELU_BWD, gelu_bwd)                                                      \
    X(SUM_DIM, sum_dim)                                                        \
    X(SUM_DIM_BWD, sum_dim_bwd)                                                \
    X(SUM_ALL, sum_all)                                                        \
    X(SOFTMAX_FWD, softmax_fwd)                                                \
    X(SOFTMAX_BWD, softmax_bwd)                                                \
    X(CAUSAL_MASK, causal_mask)                                                \
    X(TRANSPOSE_LAST2, transpose_last2)                                        \
    X(EMBEDDING_FWD, embedding_fwd)                                            \
    X(EMBEDDING_BWD, embedding_bwd)                                            \
    X(LAYER_NORM_FWD, layer_norm_fwd)                                          \
    X(LAYER_NORM_BWD, layer_norm_bwd)                                          \
    X(RMS_NORM_FWD, rms_norm_fwd)                                              \
    X(RMS_NORM_BWD, rms_norm_bwd)                                              \
    X(DROPOUT_FWD, dropout_fwd)                                                \
    X(DROPOUT_BWD, dropout_bwd)                                                \
    X(CROSS_ENTROPY_FWD, cross_entropy_fwd)                                    \
    X(CROSS_ENTROPY_BWD, cross_entropy_bwd)                                    \
    X(CE_GLOSS, ce_gloss)                                                      \
    X(ROW_MAX, row_max)                                                        \
    X(ROW_SUMEXP, row_sumexp)                                                  \
    X(PICK_TARGET, pick_target)                                                \
    X(VOCAB_CE_LOSS, vocab_ce_loss)                                            \
    X(VOCAB_CE_BWD, vocab_ce_bwd)                                              \
    X(SGD_STEP, sgd_step)                                                      \
    X(ADAM_STEP, adam_step)                                                    \
    X(SILU_FWD, silu_fwd)                                                      \
    X(SILU_BWD, silu_bwd)                                                      \
    X(SWIGLU_FWD, swiglu_fwd)                                                  \
    X(SWIGLU_BWD, swiglu_bwd)                                                  \
    X(ATTN_SOFTMAX, attn_softmax)                                              \
    X(FLASH_ATTN_FWD, flash_attn_fwd)                                          \
    X(FLASH_ATTN_BWD, flash_attn_bwd)                                          \
    X(ROPE_FWD, rope_fwd)                                                      \
    X(ROPE_BWD, rope_bwd)                                                      \
    X(ROPE_COS_SIN, rope_cos_sin)

/* The engines' tables: the CPU's always; the CUDA one is NULL in a build
 * without CUDA (cuda_none.c). */
extern const tp__kernels tp__kernels_cpu;
extern const tp__kernels *const tp__kernels_cuda;
/* The meta engine (meta.c): no arithmetic, the CPU's dtypes. */
extern const tp__kernels tp__kernels_meta;

/* TP_ERR_NOT_SUPPORTED for a device whose engine this build lacks (out of
 * line: the cold half of tp__kernels_for). */
tp_status tp__kernels_missing(tp_device dev);

/* The table of dev's engine into *out: one load, no call. An engine this
 * build lacks is TP_ERR_NOT_SUPPORTED ("libtp was built without CUDA"). */
static inline tp_status tp__kernels_for(tp_device dev, const tp__kernels **out)
{
    const tp__kernels *k = dev.type == TP_DEVICE_CPU    ? &tp__kernels_cpu
                           : dev.type == TP_DEVICE_CUDA ? tp__kernels_cuda
                           : dev.type == TP_DEVICE_META ? &tp__kernels_meta
                                                        : NULL;
    if (k) {
        *out = k;
        return TP_OK;
    }
    return tp__kernels_missing(dev);
}

/* "linear_fwd" for TP__KOP_LINEAR_FWD ("?" outside the enum). */
const char *tp__kop_name(tp__kop op);

/* TP_ERR_NOT_SUPPORTED: "<engine> kernels: <op> does not take <dtype>". The
 * entries' answer when supports(op, dtype) is false. */
tp_status tp__kernels_unsupported(const tp__kernels *k, tp__kop op, tp_dtype dtype);

#ifdef __cplusplus
}
#endif

#endif /* TP_KERNELS_H */
