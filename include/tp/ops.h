/*
 * tp/ops.h - differentiable ops on plain tensors and DTensors (CPU, CUDA).
 *
 * Dtypes: every op takes f32, bf16 and f16 (as its device's engine does; f64
 * and integer dtypes are TP_ERR_NOT_SUPPORTED naming the argument and the
 * engine). All differentiable inputs of one op (x, weights, biases, both
 * operands) share one dtype, else TP_ERR_INVALID_ARG "... the dtypes must
 * match" (indices and targets stay integer; cross entropy's class weights
 * have the logits' dtype). The output has that dtype (cross entropy's loss
 * too, as PyTorch) and each input's gradient has its input's dtype. Arithmetic
 * runs in f32 (products with f32 accumulation) and each stored value is
 * rounded once; what the ops save for the backward (norm mean and rstd,
 * cross-entropy row max and sums) stays f32. A reduced bf16/f16 cross entropy
 * sums f32 per-row losses and rounds once. Collectives are the same as for
 * f32 (Partial reductions run in the dtype unless
 * tp_set_partial_reduce_f32(true)). Error bounds: docs/API.md "Precision".
 *
 * Every op takes either only plain tensors or only DTensors on one mesh;
 * mixing is TP_ERR_INVALID_ARG naming the argument. On DTensors the op picks,
 * per mesh dim, the sharding strategy that accepts the inputs' placements, or
 * else the one that is cheapest to redistribute them to (fewest bytes moved,
 * collectives counted by the comm-debug counter); an op with no strategy for
 * the layouts fails with TP_ERR_NOT_SUPPORTED naming the op and the layouts.
 * Outputs record a backward node when an input requires grad (and recording
 * is on). Ops are collective over the mesh when they redistribute.
 */
#ifndef TP_OPS_H
#define TP_OPS_H

#include <stdbool.h>
#include <stdint.h>

#include "tp/dtensor.h"
#include "tp/status.h"
#include "tp/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* y[..., out] = x[..., in] W[out, in]^T + b[out] (b may be NULL).
 * Strategies per mesh dim: x R, W S(0), b S(0) -> y S(-1) (colwise);
 * x S(-1), W S(1), b R -> y P(sum), bias added once (rowwise);
 * x S(d) (a batch dim), W R, b R -> y S(d); x P, W R, b R -> y P; all R -> R. */
TP_API tp_status tp_linear(tp_tensor *x, tp_tensor *w, tp_tensor *b, tp_tensor **y);

/* y[..., m, n] = a[..., m, k] b[k, n] (b is 2-D). Strategies as linear with
 * b read as W^T: a R, b S(1) -> S(-1); a S(-1), b S(0) -> P; a S(batch), b R;
 * a P, b R -> P; all R. */
TP_API tp_status tp_matmul(tp_tensor *a, tp_tensor *b, tp_tensor **y);

/* ---- elementwise (ops_elementwise.c) --------------------------------------
 * add/mul broadcast by NumPy rules: the shapes align on the right and a dim
 * that one operand lacks or has with size 1 stretches to the other's size
 * (either operand, any ranks, 0-d scalars; y has the broadcast shape). Shapes
 * that do not broadcast are TP_ERR_INVALID_ARG naming both shapes and the
 * clashing dim (counted from the right, -1 the last), before any
 * communication. a and b may be non-contiguous views. The gradient of an
 * operand is y's gradient summed over the dims it was broadcast along.
 * Strategies per mesh dim: y Shard(d) takes each operand that has dim d with
 * y's size sharded on its matching dim and each operand broadcast along d
 * Replicate, with no communication ([B,S,D] S(1) + [S,D] S(0), [B,S,D] S(2) +
 * [D] S(0), [B,S,D] S(0) + [S,D] R); the gradient of an operand broadcast
 * along the sharded dim is then Partial(sum), as in PyTorch (an optimizer
 * step reduces it to the parameter's layout). All Replicate -> Replicate; for
 * add a Partial(sum) pairs with a Partial(sum) (a Replicate operand becomes
 * Partial locally, added once); for mul one Partial operand with a Replicate
 * one gives Partial. relu, gelu, dropout: Shard and Replicate pass through,
 * Partial is reduced first. */
TP_API tp_status tp_add(tp_tensor *a, tp_tensor *b, tp_tensor **y);
TP_API tp_status tp_mul(tp_tensor *a, tp_tensor *b, tp_tensor **y);
/* y = s * x (any placement passes through; Partial stays Partial). */
TP_API tp_status tp_scale(tp_tensor *x, double s, tp_tensor **y);
TP_API tp_status tp_relu(tp_tensor *x, tp_tensor **y);

typedef enum tp_gelu_approx { TP_GELU_EXACT = 0, TP_GELU_TANH = 1 } tp_gelu_approx;
TP_API tp_status tp_gelu(tp_tensor *x, tp_gelu_approx approx, tp_tensor **y);

/* y = gelu(x W^T + b) as one op: the colwise half of a Megatron MLP
 * (Linear, then GELU) fused, as apex's FusedDenseGeLU. Shapes, dtypes and
 * errors as tp_linear. Strategies per mesh dim: linear's whose output is not
 * a partial sum: x R, W S(0), b S(0) -> y S(-1) (colwise); x S(d) (a batch
 * dim), W R, b R -> y S(d); all R -> R. A rowwise layout (x S(-1), W S(1))
 * is therefore redistributed to one of these first; tp_nn_linear_fuse_gelu
 * refuses RowwiseParallel for that reason. The backward keeps the
 * pre-activation, as the unfused pair keeps the linear's output, and keeps
 * nothing under tp_no_grad.
 * On CUDA in bf16/f16 with TP_GELU_TANH the bias and the GELU ride in the
 * product (cuBLASLt's GELU_AUX_BIAS epilogue: the GELU of the f32
 * accumulator, one rounding, where the pair rounds twice), and the
 * backward's activation gradient and bias gradient share one pass. When y's
 * only consumer is a tp_linear (the MLP's net2, also through the styles'
 * to_local / from_local) and no other gradient reaches y, that linear's
 * backward takes this GELU's backward and bias gradient into its
 * input-gradient product (CUDA bf16/f16 tanh: cuBLASLt's DGELU_BGRAD
 * epilogue). On the CPU, and on CUDA in f32 or for TP_GELU_EXACT, the
 * result is the unfused pair's bit for bit. */
TP_API tp_status tp_linear_gelu(tp_tensor *x, tp_tensor *w, tp_tensor *b, tp_gelu_approx approx,
                                tp_tensor **y);

/* ---- silu and swiglu (ops_elementwise.c) ------------------------------------
 * The Llama / Mistral / Qwen2 MLP, down_proj(silu(gate_proj(x)) * up_proj(x)).
 *
 * tp_silu: y = x * sigmoid(x) (torch.nn.functional.silu), new tensor of x's
 * shape and dtype. The sigmoid is computed from exp(-|x|): no overflow at any
 * x (silu(100) = 100, silu(-100) is -0 up to a subnormal), +inf -> inf, -inf
 * -> -0, NaN -> NaN.
 *
 * tp_swiglu: y = silu(gate) * up, fused: one kernel forward, and one kernel
 * backward that writes both gradients (d gate = gy up sig (1 + gate (1 -
 * sig)), d up = gy silu(gate), sig = sigmoid(gate)). gate and up must have
 * the same shape (no broadcasting: a mismatch is TP_ERR_INVALID_ARG naming
 * both shapes, before any communication) and one dtype; both contiguous.
 *
 * Both take plain tensors or DTensors (not a mix). Strategies per mesh dim:
 * Shard(d) and Replicate pass through with no collective, forward or
 * backward (swiglu: gate and up with the same placement, as colwise
 * gate_proj and up_proj give them, Shard(-1); where they differ, the
 * cheapest redistribution to a common one: a Replicate operand is chunked
 * locally to the other's shard, two different shards cost one all_to_all).
 * Partial is reduced first (to a Shard when that moves fewer bytes than an
 * all_reduce: one reduce_scatter forward and its all_gather backward). */
TP_API tp_status tp_silu(tp_tensor *x, tp_tensor **y);
TP_API tp_status tp_swiglu(tp_tensor *gate, tp_tensor *up, tp_tensor **y);

/* Inverted dropout with probability p in [0, 1). The keep mask of element g
 * (global row-major index) depends only on (seed, g), so it is identical at
 * every parallel degree. training false (or p == 0): y = x. */
TP_API tp_status tp_dropout(tp_tensor *x, double p, uint64_t seed, bool training, tp_tensor **y);

/* ---- views (ops_view.c) ----------------------------------------------------
 * Sharding follows PyTorch's view rules, in the form of its reshape (which
 * redistributes where its view would refuse). Reshape, flatten and unflatten
 * group the dims into consecutive runs of input and output dims holding as
 * many elements (size-1 dims appear or vanish on their own):
 *  - a dim that maps to one dim of its size keeps its shard, even or uneven,
 *    renumbered (S(2) of [B, S, V] is S(1) of [B*S, V]);
 *  - a dim split into several keeps its shard on the outermost piece, and
 *    dims merged into one keep a shard of the outermost of them, when the
 *    shard boundaries fall on whole rows: the outermost input and output
 *    sizes are divisible by the mesh dim's size (times the sizes of the
 *    earlier mesh dims kept sharding the same dim). [B, S, H*Dh] S(2) ->
 *    [B, S, H, Dh] S(2) when the mesh size divides H, and back.
 *  - any other shard is replicated first on its mesh dim (an all_gather);
 *    Replicate and Partial pass through untouched.
 * transpose and permute move shards with their dims and never communicate.
 * All are differentiable; the backward is the inverse view of the gradient,
 * with the input's placements (Partial read as Replicate), no communication.
 * Negative dims count from the end. There is no separate view op: reshape's
 * local result is always a view of the (contiguous) local input, and where
 * PyTorch's DTensor view would raise because the layout needs
 * redistribution, tp_reshape redistributes as PyTorch's reshape does. */

/* Same elements, new shape (one size may be -1, inferred). The local output
 * is a view of the local input (of the gathered one where a shard had to be
 * replicated first): no copy. */
TP_API tp_status tp_reshape(tp_tensor *x, int ndim, const int64_t *shape, tp_tensor **y);
/* Merges dims start_dim..end_dim (inclusive) into one (a 0-d x gives [1]). */
TP_API tp_status tp_flatten(tp_tensor *x, int start_dim, int end_dim, tp_tensor **y);
/* Splits dim into n dims of the given sizes (one may be -1, inferred); their
 * product must be dim's size. */
TP_API tp_status tp_unflatten(tp_tensor *x, int dim, int n, const int64_t *sizes, tp_tensor **y);
/* Swaps dims d0 and d1 (a contiguous copy). */
TP_API tp_status tp_transpose(tp_tensor *x, int d0, int d1, tp_tensor **y);
/* Reorders the dims: dim k of y is dim dims[k] of x (ndim entries, each dim
 * once; a contiguous copy). */
TP_API tp_status tp_permute(tp_tensor *x, int ndim, const int *dims, tp_tensor **y);

/* `length` entries of `dim` from `start` (torch.narrow), as a contiguous
 * copy; [start, start + length) must lie within the dim (else
 * TP_ERR_INVALID_ARG naming the range and the size). Strategies: a shard of
 * another dim, Replicate and Partial pass through; a shard of `dim` is
 * replicated first (an all_gather). The backward writes the gradient into
 * zeros of x's shape, with no communication. */
TP_API tp_status tp_narrow(tp_tensor *x, int dim, int64_t start, int64_t length, tp_tensor **y);

/* ---- reductions and normalizations (ops_reduce.c) --------------------------
 * sum/mean over dim (keepdim keeps it with size 1) or over everything (a 0-d
 * result). A dim sharded by the input gives a Partial(sum) output (mean
 * divides by the global count, so the partial sums add up); other shards pass
 * through with their dim renumbered. */
TP_API tp_status tp_sum(tp_tensor *x, int dim, bool keepdim, tp_tensor **y);
TP_API tp_status tp_sum_all(tp_tensor *x, tp_tensor **y);
TP_API tp_status tp_mean(tp_tensor *x, int dim, bool keepdim, tp_tensor **y);
TP_API tp_status tp_mean_all(tp_tensor *x, tp_tensor **y);
/* Softmax along dim (only the last dim; -1 accepted). A shard of another dim
 * passes through; the softmax dim is replicated first. */
TP_API tp_status tp_softmax(tp_tensor *x, int dim, tp_tensor **y);
/* LayerNorm / RMSNorm over the last dim; weight and bias (1-D, last-dim size)
 * may be NULL. Shards of other dims pass through with the affine parameters
 * replicated, and then the parameters' gradients are Partial(sum) (the
 * sequence-parallel case). */
TP_API tp_status tp_layer_norm(tp_tensor *x, tp_tensor *weight, tp_tensor *bias, double eps,
                               tp_tensor **y);
TP_API tp_status tp_rms_norm(tp_tensor *x, tp_tensor *weight, double eps, tp_tensor **y);

/* ---- embedding and loss (ops_loss.c) ---------------------------------------
 * y[..., dim] = weight[indices[...], :]; indices are i64 (or i32) and never
 * get a gradient. Strategies: weight S(1) -> y S(-1); weight S(0) -> y
 * P(sum), rows outside this rank's range read as zeros; indices S(d) with
 * weight R -> y S(d); all R -> R. An index outside [0, num) is
 * TP_ERR_INVALID_ARG, checked before any communication; with sharded indices
 * only the ranks holding the bad index fail (their peers then wait for them
 * until an abort or the timeout, as for any argument that is invalid on some
 * ranks only). */
TP_API tp_status tp_embedding(tp_tensor *indices, tp_tensor *weight, tp_tensor **y);

typedef enum tp_reduction {
    TP_REDUCTION_MEAN = 0, /* sum of weighted losses / sum of the weights used */
    TP_REDUCTION_SUM,
    TP_REDUCTION_NONE
} tp_reduction;

typedef struct tp_cross_entropy_options {
    tp_reduction reduction;
    tp_tensor *weight;    /* per-class weights [classes], or NULL */
    int64_t ignore_index; /* targets equal to it contribute nothing */
} tp_cross_entropy_options;

/* Defaults: mean, no weights, ignore_index -100 (as PyTorch). */
#define TP_CROSS_ENTROPY_DEFAULTS ((tp_cross_entropy_options){TP_REDUCTION_MEAN, NULL, -100})

/*
 * Cross entropy as torch.nn.functional.cross_entropy with class-index
 * targets (options NULL: the defaults): logits (N, C, d1, ..., dk), k >= 0,
 * against i64 or i32 targets (N, d1, ..., dk), or unbatched logits (C)
 * against a 0-d target; the class dim is 1 (0 for 1-D logits). The loss is
 * the targets' shape for reduction none, else 0-d. Targets equal to
 * ignore_index count for nothing; any other outside [0, C) is
 * TP_ERR_INVALID_ARG naming its position.
 *
 * Loss parallel: logits sharded on the class dim by one mesh dim compute
 * there with 3 all_reduces forward (row max, sum of exp, target logit) on
 * that mesh dim and none backward; the logits' gradient keeps their
 * placements. Other dims may be sharded on the other mesh dims: the targets
 * are taken in the logits' placements less the class dim (redistributed to
 * them if passed otherwise); the loss is Replicate on the class mesh dim and
 * for none keeps the targets' shards, for sum is Partial(sum) on the mesh
 * dims that shard other dims; mean there is TP_ERR_NOT_SUPPORTED (each rank
 * would divide by its own count; PyTorch 2.15's loss_parallel refuses it
 * too): use sum and divide. Logits sharded on other dims but not on the
 * class dim, or on the class dim by two mesh dims, are TP_ERR_NOT_SUPPORTED
 * (the message says to shard the class dim, dim 1, or replicate). Partial
 * logits are reduced first; Replicate logits compute locally. [B, S, V]
 * logits go in flattened to [B*S, V], the targets to [B*S]
 * (tp_flatten(logits, 0, 1, ...): a shard of V stays a shard of the class
 * dim, with no communication), as PyTorch's TP examples do; [B, V, S]
 * (tp_transpose) works too. Targets and class weights (Replicate, [C])
 * never get gradients.
 */
TP_API tp_status tp_cross_entropy(tp_tensor *logits, tp_tensor *target,
                                  const tp_cross_entropy_options *options, tp_tensor **loss);

/* ---- attention (ops_attention.c) -------------------------------------------
 * out[..., s, :] = softmax(q k^T * scale (+ causal mask)) v over the last two
 * dims [seq, head_dim]; scale 0 means 1/sqrt(head_dim). The same as
 * tp_scaled_dot_product_attention_with (below) with {causal, scale} and no
 * key offset or padding: q, k, v of the same shape as before, and everything
 * that function takes (grouped kv heads, Sq != Sk with the causal diagonal
 * at the top left, as PyTorch's is_causal). */
TP_API tp_status tp_scaled_dot_product_attention(tp_tensor *q, tp_tensor *k, tp_tensor *v,
                                                 bool causal, double scale, tp_tensor **out);

/* ---- attention for the Llama family: GQA, KV-cache offsets, padding ----------
 * How the attention is computed (PyTorch's sdpa_kernel backends):
 *   MATH   the scores as a [Sq, Sk] matrix per head, their softmax kept for
 *          the backward: PyTorch's math attention, to the rounding.
 *   FLASH  fused (flash attention): tiles of keys with an online softmax,
 *          only the output and one f32 log-sum-exp per query row kept; the
 *          backward recomputes the probabilities. Memory linear in Sk.
 *          Head dims up to 256 (else TP_ERR_NOT_SUPPORTED). CUDA runs it on
 *          tensor cores in bf16 and f16 for head dims 64 and 128.
 *   AUTO   FLASH where it is the faster form: on the CPU (1.4x in f32,
 *          1.9x in bf16 at seq 1-2k, bench/README.md) and on CUDA in bf16
 *          and f16; MATH on CUDA in f32 (cuBLAS) and for head dims over 256.
 *          The environment variable TP_SDPA_BACKEND (math, flash, auto;
 *          read at the first call) overrides AUTO.
 * Both agree within the dtype's rounding (f32 accumulation throughout). */
typedef enum tp_sdpa_backend {
    TP_SDPA_BACKEND_AUTO = 0,
    TP_SDPA_BACKEND_MATH,
    TP_SDPA_BACKEND_FLASH
} tp_sdpa_backend;

/* Options of tp_scaled_dot_product_attention_with; all zero (or a NULL
 * pointer) is the default: not causal, scale 1/sqrt(head_dim), no offset, no
 * padding, backend AUTO. */
typedef struct tp_sdpa_options {
    bool causal;            /* query i sees keys j <= key_offset + i */
    double scale;           /* 0: 1/sqrt(head_dim); negative: TP_ERR_INVALID_ARG */
    int64_t key_offset;     /* keys cached before the first query (the causal
                             * diagonal's shift); 0 for self-attention with Sq == Sk.
                             * Only the causal mask reads it. >= 0. */
    tp_tensor *key_padding; /* optional [B, Sk] i64 or i32 (HF's attention_mask):
                             * key j of batch b is never attended where it is 0;
                             * borrowed for the call (kept by autograd). NULL: none */
    tp_sdpa_backend backend; /* AUTO (0), MATH or FLASH, above */
} tp_sdpa_options;

/*
 * out = safe_softmax(q k^T * scale + mask) v, PyTorch's math attention
 * (scaled_dot_product_attention with enable_gqa) as HF Llama calls it.
 *   q [..., Hq, Sq, D], k [..., Hkv, Sk, D], v [..., Hkv, Sk, Dv] ->
 *   out [..., Hq, Sq, Dv]  (Dv may differ from D; the leading dims "..."
 *   must be equal on q, k and v).
 * Grouped-query / multi-query attention: Hq must be a multiple of Hkv; query
 * head h uses kv head h / (Hq / Hkv), as HF's repeat_kv (Hkv == Hq: plain
 * multi-head attention; Hkv == 1: multi-query). With 2-D or 3-D inputs there
 * is no head dim: every leading dim must match.
 * Masks: with causal, query i (0-based in q) sees key j iff j <= key_offset +
 * i: a KV cache of key_offset earlier tokens puts the queries at positions
 * key_offset .. key_offset + Sq - 1 of the keys (decode: Sq 1, key_offset
 * Sk - 1; chunked prefill: key_offset = tokens before the chunk). key_padding
 * (needs 4-D q [B, H, Sq, D]) hides the keys where it is 0, for every head
 * and query of batch b (left or right padding alike).
 * A row whose keys are all masked (a padded query under causal left padding,
 * say) outputs 0 and passes zero gradients, as PyTorch >= 2.5's math
 * attention (_safe_softmax) does; tp_softmax of an all -inf row is still NaN.
 * Gradients: q, k, v (f32, bf16, f16, one dtype); key_padding never gets one.
 * What the backward needs (MATH: the probabilities; FLASH: the output and
 * the log-sum-exps) is kept only when a gradient is wanted.
 * Errors (TP_ERR_INVALID_ARG naming the counts and shapes): Hq not a multiple
 * of Hkv ("12 query heads are not a multiple of 5 key/value heads"),
 * different leading dims, head_dim of q and k, key counts of k and v, or kv
 * heads of k and v, negative scale or key_offset, a key_padding that is not
 * [B, Sk] i64/i32 or with q not 4-D; mixed dtypes as every op.
 * Strategies, per mesh dim: a leading dim (before the head dim) sharded alike
 * on q, k, v -> out sharded on it (key_padding Shard(0) when it is the batch
 * dim, else Replicate); the head dim sharded alike on q, k, v -> out sharded
 * on it, when Hq == Hkv (any mesh size, uneven chunks included) or when the
 * mesh dim's size divides the heads left on each rank (Hkv, and so Hq, after
 * earlier mesh dims), so that each rank's local group mapping is the global
 * one; all Replicate -> Replicate. Inputs already in one of these layouts
 * move nothing; others are redistributed to the cheapest (counted).
 * Collective: on DTensors every rank of the mesh must call.
 */
TP_API tp_status tp_scaled_dot_product_attention_with(tp_tensor *q, tp_tensor *k, tp_tensor *v,
                                                      const tp_sdpa_options *opts,
                                                      tp_tensor **out);
/* ---- end of attention for the Llama family ---- */

/* ---- rotary position embedding (ops_rope.c) --------------------------------
 * RoPE exactly as Hugging Face transformers 5.x computes it for Llama,
 * Mistral and Qwen2 (modeling_llama.py: LlamaRotaryEmbedding, rotate_half,
 * apply_rotary_pos_emb; modeling_rope_utils.py: the rope types below). The
 * whole head dim rotates (partial_rotary_factor 1), in the half-split layout
 * of rotate_half: element i pairs with element i + head_dim/2. */

typedef enum tp_rope_type {
    TP_ROPE_DEFAULT = 0, /* "default": inv_freq[i] = 1 / theta^(2i / head_dim) */
    TP_ROPE_LINEAR,      /* "linear": the default's inv_freq / factor */
    TP_ROPE_DYNAMIC,     /* "dynamic" (NTK): theta grows with the sequence length */
    TP_ROPE_LLAMA3       /* "llama3" (Llama 3.1+): low frequencies / factor, smoothed band */
} tp_rope_type;

/* HF's rope_parameters (or the 4.x rope_theta / rope_scaling) of a config.
 * Fields a type does not use are ignored. */
typedef struct tp_rope_config {
    tp_rope_type type;
    int64_t head_dim;        /* the rotary dim: the whole head_dim, positive and even */
    double theta;            /* rope_theta (> 0); 0 means 10000 */
    double factor;           /* linear, dynamic, llama3: >= 1 (default: unused) */
    double low_freq_factor;  /* llama3: > 0 */
    double high_freq_factor; /* llama3: > low_freq_factor */
    int64_t original_max_position_embeddings; /* llama3: > 0 */
    int64_t max_position_embeddings;          /* dynamic: > 0 */
} tp_rope_config;

/*
 * inv_freq[head_dim / 2] (caller's buffer) and the attention scaling
 * (*attention_scaling, may be NULL: 1 for these four types) that HF's
 * rope init function of cfg->type gives, computed in f32 step by step as
 * torch does on the CPU: e = (float)(2i) / head_dim, p = theta^e (in double,
 * rounded to f32), inv = 1.0f / p; linear divides by (float)factor; llama3
 * then applies its wavelength thresholds and smoothing in f32 (torch.where),
 * so every step but the power is bit for bit torch's. torch's CPU power (SLEEF,
 * 1 ulp) and its CUDA one both differ from the correctly rounded one by an
 * ulp now and then, so inv_freq agrees with HF's to 1-2 ulp (exactly in most
 * elements; tests/fixtures/rope_hf_fixture.h).
 *
 * seq_len (>= 0) matters only for dynamic: at seq_len <= max_position_
 * embeddings, the inv_freq LlamaRotaryEmbedding is built with (HF's
 * _compute_dynamic_ntk_parameters without seq_len: theta unchanged); above
 * it, the one its forward recomputes with the tensor seq_len it passes
 * (theta * ((factor * seq_len / max_position_embeddings) - (factor - 1))
 * ^ (head_dim / (head_dim - 2)), in f32 as torch computes it on that
 * tensor). dynamic needs head_dim > 2 (HF divides by head_dim - 2).
 *
 * Errors: TP_ERR_INVALID_ARG naming the field and its value (cfg or
 * inv_freq NULL, an unknown type, head_dim odd or <= 0, theta < 0 or not
 * finite, factor < 1 for a scaled type, llama3 with low_freq_factor <= 0,
 * high_freq_factor <= low_freq_factor or original_max_position_embeddings
 * <= 0, dynamic with max_position_embeddings <= 0 or head_dim 2, seq_len <
 * 0). Nothing is written on error. Not collective.
 */
TP_API tp_status tp_rope_inv_freq(const tp_rope_config *cfg, int64_t seq_len, float *inv_freq,
                                  double *attention_scaling);

/*
 * cos and sin [B, S, head_dim] of dtype (f32, bf16, f16) on position_ids'
 * device from i64 position_ids [B, S] (>= 0), as LlamaRotaryEmbedding.forward:
 * freqs = (float)position * inv_freq[i] (one f32 product), emb =
 * cat(freqs, freqs), cos = cos(emb) * attention_scaling in f32, rounded
 * once to dtype (HF's .to(x.dtype)); likewise sin. The angle is HF's f32
 * product bit for bit where inv_freq is (positions up to 2^24 convert to
 * f32 exactly; the angle's own rounding at large positions, 0.004 rad at
 * 1e5, is HF's too), and its cos and sin are within an f32 ulp of HF's.
 *
 * dynamic: seq_len = max(position_ids) + 1 of this call (stateless).
 * HF's module keeps state: it recomputes inv_freq when a call's seq_len
 * exceeds the largest seen so far (max_seq_len_cached, initially
 * max_position_embeddings) and keeps that inv_freq for later, shorter calls
 * until one falls below max_position_embeddings, which restores the
 * original. So after a long sequence, a shorter one that is still above
 * max_position_embeddings gets the longer one's frequencies from HF (those
 * of tp_rope_inv_freq at max_seq_len_cached) but its own here. On the meta
 * device (no values) seq_len counts as 0.
 *
 * The positions are read on the host (a device-to-host copy for CUDA
 * position_ids, as tp_embedding does) to check them and for dynamic's
 * maximum; inv_freq (head_dim / 2 floats) is computed there and copied to
 * the device, whose kernel (rope_cos_sin) computes cos and sin.
 *
 * DTensor position_ids: cos and sin are DTensors with the same placements
 * (Shard(0): batch, Shard(1): sequence, Replicate), each rank computing its
 * block, no communication. Partial position_ids are TP_ERR_NOT_SUPPORTED,
 * and so is dynamic with sharded position_ids (the maximum would need the
 * whole tensor: pass them Replicate).
 *
 * Outputs: two new tensors (or DTensors), not requiring grad; both NULL on
 * error. Errors: as tp_rope_inv_freq for cfg; TP_ERR_INVALID_ARG for a
 * NULL argument, position_ids not i64 or not 2-D, a negative position
 * (naming its index and value); TP_ERR_NOT_SUPPORTED for a dtype the
 * device's engine does not take.
 */
TP_API tp_status tp_rope_cos_sin(const tp_rope_config *cfg, tp_tensor *position_ids, tp_dtype dtype,
                                 tp_tensor **cos, tp_tensor **sin);

/*
 * y = x * cos + rotate_half(x) * sin (HF apply_rotary_pos_emb for one of q
 * or k), rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2]). x [B, H, S, D]
 * (HF's layout after transpose(1, 2)), D even; cos and sin [B, S, D] or
 * [1, S, D] (broadcast over B), broadcast over H, of x's dtype and device
 * (from tp_rope_cos_sin). In f32 every product and the sum round as in
 * PyTorch (results equal HF's f32 ones bit for bit); in bf16/f16 each
 * element is computed in f32 and rounded once (PyTorch rounds each of its
 * four steps to the dtype).
 *
 * Differentiable in x: gx = gy * cos + rotate_half^T(gy * sin). cos and sin
 * never get gradients.
 *
 * Strategies per mesh dim (no communication for any of them):
 *   x Shard(1) (heads: tensor parallel), cos, sin Replicate -> y Shard(1);
 *   x Shard(0) (batch), cos, sin Shard(0) when their batch dim is B
 *     (Replicate when it is 1) -> y Shard(0);
 *   x Shard(2) (sequence), cos, sin Shard(1) -> y Shard(2);
 *   x Partial, cos, sin Replicate -> y Partial (y is linear in x);
 *   all Replicate -> Replicate.
 * Other layouts are redistributed to the cheapest of these (a Shard(3) of
 * x, the head dim, costs one collective forward).
 *
 * Errors: TP_ERR_INVALID_ARG, before any communication, for a NULL
 * argument, x not 4-D or with an odd last dim, cos or sin not 3-D, their
 * shapes differing, a seq or head dim other than x's, a batch dim other
 * than 1 or B, dtypes or devices that differ, plain and DTensor arguments
 * mixed; TP_ERR_NOT_SUPPORTED for a dtype the engine does not take.
 */
TP_API tp_status tp_rotary_embedding(tp_tensor *x, tp_tensor *cos, tp_tensor *sin, tp_tensor **y);

#ifdef __cplusplus
}
#endif

#endif /* TP_OPS_H */
