/*
 * transformer.c - a small decoder-only transformer trained with tensor
 * parallelism and sequence parallelism, checked against one rank.
 *
 * Model (vocab 64, dim 32, 4 heads of 8, ffn 64, 2 layers, seq 8, batch 4):
 *
 *   Transformer                   custom, forward(tokens [B,S], positions [B,S])
 *     tok_embeddings              Embedding(64, 32)
 *     pos_embeddings              Embedding(8, 32)
 *     layers                      Sequential
 *       0, 1                      TransformerBlock (custom)
 *         attention_norm          LayerNorm(32)
 *         attention               Attention (custom): wq, wk, wv, wo = Linear(32, 32, no bias)
 *         ffn_norm                LayerNorm(32)
 *         feed_forward            FeedForward (custom): w1 = Linear(32, 64), gelu, w2 = Linear(64, 32)
 *     norm                        LayerNorm(32)
 *     output                      Linear(32, 64, no bias)
 *
 *   h = tok_embeddings(tokens) + pos_embeddings(positions)
 *   per layer: h = h + attention(attention_norm(h)); h = h + feed_forward(ffn_norm(h))
 *   logits = output(norm(h)) flattened to [B*S, 64]; loss = cross_entropy(logits, targets)
 *
 * Attention computes on this rank's heads: wq/wk/wv are colwise, so q, k and
 * v come out as local [B, S, local_heads * 8] tensors, and the same code runs
 * on any rank count that divides the 4 heads.
 *
 * Plans (those of PyTorch's TP tutorial):
 *   TP     tok_embeddings Rowwise(input R); attention.w[qkv] and feed_forward.w1
 *          Colwise; attention.wo and feed_forward.w2 Rowwise; output
 *          Colwise(output S(-1), DTensor output) so the loss is the
 *          vocab-parallel cross entropy
 *   TP+SP  the same, with the activations between the parallel regions sharded
 *          on the sequence dim: tok_embeddings, wo and w2 leave S(1); the norms
 *          are SequenceParallel; attention and feed_forward gather their input
 *          (PrepareModuleInput S(1) -> R); output takes S(1). pos_embeddings is
 *          SequenceParallel too and gets the positions as an S(1) DTensor, so
 *          the residual stream is an S(1) DTensor from the first add on.
 *
 * Each plan trains 3 steps of Adam (lr 1e-2) on fixed random tokens (targets
 * are the tokens shifted by one) on 1, 2 and 4 ranks; the losses and the final
 * parameters must equal the 1-rank run without TP within rtol 1e-4, atol 1e-5.
 *
 * Data parallel x tensor parallel (-d DP): the ranks form a ("dp", "tp") mesh
 * of [DP, ranks / DP]; the plan is applied on this rank's "tp" slice
 * (tp_mesh_slice) and the model wrapped with tp_ddp_create over the "dp" dim's
 * communicator. Each dp group trains on its share of the batch (rows split by
 * dp coordinate), its loss the mean over its own tokens; the DDP averages the
 * gradients over the groups (bucketed all_reduces launched during backward,
 * waited for in the Adam step's pre-hook), which with equal shares gives the
 * whole batch's gradient, so the runs again equal the 1-rank run on the whole
 * batch. The printed losses are the mean over the dp groups.
 *
 * --dtype bf16|f16 trains in low precision, mixed precision as PyTorch users
 * know it: param_dtype (tp_module_to_dtype after the initialisation), f32
 * master weights and Adam states (tp_adam keeps them for bf16/f16
 * parameters), reduce_dtype f32 for the DDP's gradient all_reduces (-d), and
 * for f16 loss scaling (tp_grad_scaler, initial scale 2^10, its found-inf
 * flag agreed over the world). The runs are compared with the 1-rank run of
 * the same dtype within that dtype's tolerance, and the 1-rank run's final
 * loss with an f32 1-rank run's (figures in examples/README.md).
 *
 * --device cuda (-D cuda) runs every run on the GPU: the model is moved with
 * tp_module_to after the initialisation (before the DDP and Adam exist), the
 * tokens, positions and targets with tp_tensor_to; rank r of the shm backend
 * runs on cuda:(r % device count) (on one GPU every rank shares it), of the
 * nccl backend (-b nccl) on cuda:r. The runs are compared as on the CPU, and
 * the 1-rank run once more with the same run on the CPU, within the
 * tolerances above (rtol 1e-4, atol 1e-5 in f32: the CUDA engine agrees with
 * the CPU to float rounding, docs/API.md, CUDA). The end prints each device's
 * peak tensor memory (tp_memory_stats) and the tokens trained per second.
 * Without a CUDA device it exits 77.
 *
 * Usage: tp-example-transformer [-r RANKS] [-d DP] [-s STEPS] [-t] [-b shm|mpi|nccl]
 *                               [--dtype f32|bf16|f16] [--device cpu|cuda]
 *   -b mpi    run under mpirun: the TP plans use the MPI world, one process
 *             per rank (the process count / DP must divide the 4 heads); the
 *             reference runs on each process, the first process prints
 *   -b nccl   with --device cuda: the TP runs' ranks are threads on one GPU
 *             each (an nccl world over the shm one), so RANKS GPUs are needed
 *   -r RANKS  run the TP plans on this many ranks only (default 1, 2 and 4,
 *             times DP with -d)
 *   -d DP     data parallel x tensor parallel on a [DP, RANKS / DP] mesh; DP
 *             divides the rank count and the batch of 4
 *   -s STEPS  Adam steps (default 3)
 *   -t        also print tp_comm_debug_write_table's full table of every run
 * Exit status 0 when every run matches the reference, 1 otherwise, 2 for bad
 * options, 77 for --device cuda without a CUDA device (meson's skip).
 */
#include <ftw.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <tp.h>

enum {
    VOCAB = 64,
    DIM = 32,
    HEADS = 4,
    HEAD_DIM = 8,
    FFN = 64,
    LAYERS = 2,
    SEQ = 8,
    BATCH = 4,
};
enum { MAX_STEPS = 100, MAX_PARAMS = 64, MAX_RUNS = 32 };

#define LR 1e-2
#define NORM_EPS 1e-5
/* --dtype: what the model is in. */
static tp_dtype g_dtype = TP_F32;
/* -b nccl: the TP runs communicate through an nccl world, one GPU per rank. */
static bool g_nccl = false;
/* --fsdp: with -d, fully sharded data parallel (tp_fully_shard of every
 * block, then of the model) instead of the DDP */
static bool g_fsdp = false;

/* A TP run vs the 1-rank run of the same dtype: f32 agrees to rounding; in
 * bf16/f16 the Partial sums of the row-wise layers are rounded per rank
 * before their all_reduce, where the 1-rank GEMM rounds once, and the runs
 * drift apart by a few ulps of the dtype. */
static double rtol_of(tp_dtype dt)
{
    return dt == TP_BF16 ? 2e-2 : dt == TP_F16 ? 4e-3 : 1e-4;
}

static double atol_of(tp_dtype dt)
{
    return dt == TP_BF16 ? 8e-3 : dt == TP_F16 ? 1e-3 : 1e-5;
}

/* The 1-rank run's final loss in bf16/f16 vs in f32: relative tolerance. */
static double final_rtol_of(tp_dtype dt)
{
    return dt == TP_BF16 ? 1e-2 : 2e-3;
}

#define RTOL rtol_of(g_dtype)
#define ATOL atol_of(g_dtype)

/* Parameters after `steps` Adam steps. In bf16/f16 two runs whose gradients
 * differ by rounding differ most where a gradient is near zero: Adam
 * normalises it, so its sign (set by rounding) moves the parameter by about
 * lr either way. Hence 2 lr per step on top of the dtype's tolerance. */
static double param_atol(int steps)
{
    return g_dtype == TP_F32 ? ATOL : ATOL + 2 * LR * steps;
}
#define PARAM_SEED 7
#define TOKEN_SEED 11

typedef enum run_mode { MODE_NONE = 0, MODE_TP, MODE_SP } run_mode;

static const char *const mode_name[] = {"no TP", "TP", "TP+SP"};

typedef struct param_value {
    char fqn[96];
    tp_tensor *full;
} param_value;

/* One run: its configuration, and what rank 0 recorded. */
typedef struct run {
    run_mode mode;
    tp_dtype dtype;
    bool cuda; /* --device cuda: rank r on cuda:(r % device count) */
    int ranks;
    int dp; /* -d: a ("dp", "tp") mesh [dp, ranks / dp] and a DDP over "dp"; 0: 1-D TP mesh */
    int steps;
    const char *load_dir; /* --load: resume from this checkpoint (its "step" first) */
    const char *save_dir; /* --save: checkpoint after the steps */
    int start_step;       /* the step the run began at: the loaded checkpoint's, or 0 */
    double seconds; /* the training steps' wall time on rank 0 */
    double loss[MAX_STEPS];
    int nparams;
    param_value params[MAX_PARAMS];
    tp_comm_debug *debug; /* the collectives of training step 0 on rank 0 */
    int dp_buckets;       /* the DDP's buckets in step 0: its all_reduces */
    tp_status status;
    double loss_diff, param_diff; /* max |run - reference| */
    bool ok;
} run;

/* ---- error reporting ------------------------------------------------------ */

/* Prints a failed call with the library's message; a rank that was only
 * aborted by a failing peer stays quiet. */
static void report(tp_status st, const char *call, int line)
{
    if (st == TP_ERR_ABORTED)
        return;
    char msg[512];
    snprintf(msg, sizeof msg, "%s", tp_last_error());
    fprintf(stderr, "transformer.c:%d: %s failed: %s: %s\n", line, call, tp_status_name(st), msg);
}

#define CHECK(call)                                                                          \
    do {                                                                                     \
        st = (call);                                                                         \
        if (st != TP_OK) {                                                                   \
            report(st, #call, __LINE__);                                                     \
            goto out;                                                                        \
        }                                                                                    \
    } while (0)

static tp_status one_input(const char *module, int nargs, int nkw)
{
    if (nargs == 1 && nkw == 0)
        return TP_OK;
    fprintf(stderr, "%s.forward takes one input, got %d and %d keywords\n", module, nargs, nkw);
    return TP_ERR_INVALID_ARG;
}

/* ---- the model's forwards --------------------------------------------------- */

/* Splits [B, S, H*8] into heads: [B, H, S, 8]. */
static tp_status split_heads(tp_tensor *x, tp_tensor **out)
{
    tp_status st;
    tp_tensor *v = NULL;
    const int64_t shape[4] = {tp_tensor_size(x, 0), tp_tensor_size(x, 1),
                              tp_tensor_size(x, 2) / HEAD_DIM, HEAD_DIM};
    CHECK(tp_reshape(x, 4, shape, &v));
    CHECK(tp_transpose(v, 1, 2, out));
out:
    tp_tensor_release(v);
    return st;
}

/*
 * Attention.forward(x): causal self-attention over the heads this rank holds.
 * wq, wk and wv return this rank's columns as plain tensors [B, S, lh * 8]
 * (colwise, use_local_output), so lh = local heads = last dim / 8 (all 4 heads
 * without TP); wo takes the local [B, S, lh * 8] back as its Shard(-1) input.
 */
static tp_status attention_forward(tp_module *self, int nargs, tp_tensor *const *args, int nkw,
                                   const tp_kwarg *kw, tp_tensor **out)
{
    (void)kw;
    tp_status st = one_input("Attention", nargs, nkw);
    if (st != TP_OK)
        return st;
    tp_tensor *q = NULL, *k = NULL, *v = NULL, *qh = NULL, *kh = NULL, *vh = NULL, *o = NULL,
              *ot = NULL, *merged = NULL;
    CHECK(tp_module_call(tp_module_child(self, "wq"), args[0], &q));
    CHECK(tp_module_call(tp_module_child(self, "wk"), args[0], &k));
    CHECK(tp_module_call(tp_module_child(self, "wv"), args[0], &v));
    CHECK(split_heads(q, &qh));
    CHECK(split_heads(k, &kh));
    CHECK(split_heads(v, &vh));
    CHECK(tp_scaled_dot_product_attention(qh, kh, vh, true, 0.0, &o)); /* [B, lh, S, 8] */
    CHECK(tp_transpose(o, 1, 2, &ot));                                 /* [B, S, lh, 8] */
    const int64_t shape[3] = {tp_tensor_size(q, 0), tp_tensor_size(q, 1), tp_tensor_size(q, 2)};
    CHECK(tp_reshape(ot, 3, shape, &merged));
    CHECK(tp_module_call(tp_module_child(self, "wo"), merged, out));
out:
    tp_tensor_release(merged);
    tp_tensor_release(ot);
    tp_tensor_release(o);
    tp_tensor_release(vh);
    tp_tensor_release(kh);
    tp_tensor_release(qh);
    tp_tensor_release(v);
    tp_tensor_release(k);
    tp_tensor_release(q);
    return st;
}

/* FeedForward.forward(x) = w2(gelu(w1(x))). */
static tp_status feed_forward_forward(tp_module *self, int nargs, tp_tensor *const *args,
                                      int nkw, const tp_kwarg *kw, tp_tensor **out)
{
    (void)kw;
    tp_status st = one_input("FeedForward", nargs, nkw);
    if (st != TP_OK)
        return st;
    tp_tensor *h = NULL, *a = NULL;
    CHECK(tp_module_call(tp_module_child(self, "w1"), args[0], &h));
    CHECK(tp_module_call(tp_module_child(self, "gelu"), h, &a));
    CHECK(tp_module_call(tp_module_child(self, "w2"), a, out));
out:
    tp_tensor_release(a);
    tp_tensor_release(h);
    return st;
}

/* TransformerBlock.forward(x): the two pre-norm residual branches. */
static tp_status block_forward(tp_module *self, int nargs, tp_tensor *const *args, int nkw,
                               const tp_kwarg *kw, tp_tensor **out)
{
    (void)kw;
    tp_status st = one_input("TransformerBlock", nargs, nkw);
    if (st != TP_OK)
        return st;
    tp_tensor *n1 = NULL, *a = NULL, *h = NULL, *n2 = NULL, *f = NULL;
    CHECK(tp_module_call(tp_module_child(self, "attention_norm"), args[0], &n1));
    CHECK(tp_module_call(tp_module_child(self, "attention"), n1, &a));
    CHECK(tp_add(args[0], a, &h));
    CHECK(tp_module_call(tp_module_child(self, "ffn_norm"), h, &n2));
    CHECK(tp_module_call(tp_module_child(self, "feed_forward"), n2, &f));
    CHECK(tp_add(h, f, out));
out:
    tp_tensor_release(f);
    tp_tensor_release(n2);
    tp_tensor_release(h);
    tp_tensor_release(a);
    tp_tensor_release(n1);
    return st;
}

/* [B, S, V] -> [B*S, V] for the loss. With the vocab dim sharded the shard
 * moves from dim 2 to dim 1 without communication (the dims before it merge),
 * so the cross entropy takes its vocab-parallel form. */
static tp_status flatten_logits(tp_tensor *logits, tp_tensor **out)
{
    const int64_t rows = tp_tensor_size(logits, 0) * tp_tensor_size(logits, 1);
    const int64_t global[2] = {rows, tp_tensor_size(logits, 2)};
    return tp_reshape(logits, 2, global, out);
}

/* Transformer.forward(tokens, positions) -> logits [B*S, V]. */
static tp_status transformer_forward(tp_module *self, int nargs, tp_tensor *const *args,
                                     int nkw, const tp_kwarg *kw, tp_tensor **out)
{
    (void)kw;
    if (nargs != 2 || nkw != 0) {
        fprintf(stderr, "Transformer.forward takes (tokens, positions), got %d inputs and %d "
                        "keywords\n", nargs, nkw);
        return TP_ERR_INVALID_ARG;
    }
    tp_status st;
    tp_tensor *tok = NULL, *pos = NULL, *h = NULL, *hl = NULL, *n = NULL, *logits = NULL;
    CHECK(tp_module_call(tp_module_child(self, "tok_embeddings"), args[0], &tok));
    CHECK(tp_module_call(tp_module_child(self, "pos_embeddings"), args[1], &pos));
    CHECK(tp_add(tok, pos, &h));
    CHECK(tp_module_call(tp_module_child(self, "layers"), h, &hl));
    CHECK(tp_module_call(tp_module_child(self, "norm"), hl, &n));
    CHECK(tp_module_call(tp_module_child(self, "output"), n, &logits));
    CHECK(flatten_logits(logits, out));
out:
    tp_tensor_release(logits);
    tp_tensor_release(n);
    tp_tensor_release(hl);
    tp_tensor_release(h);
    tp_tensor_release(pos);
    tp_tensor_release(tok);
    return st;
}

/* ---- building the model ------------------------------------------------------ */

/* Hangs child under parent; frees it when the parent does not take it. */
static tp_status adopt(tp_module *parent, const char *name, tp_module *child)
{
    tp_status st = tp_module_add_child(parent, name, child);
    if (st != TP_OK)
        tp_module_free(child);
    return st;
}

static tp_status add_linear(tp_module *parent, const char *name, int64_t in, int64_t out,
                            bool bias)
{
    tp_module *m = NULL;
    tp_status st = tp_nn_linear_create(in, out, bias, &m);
    return st == TP_OK ? adopt(parent, name, m) : st;
}

static tp_status add_norm(tp_module *parent, const char *name)
{
    tp_module *m = NULL;
    tp_status st = tp_nn_layer_norm_create(DIM, true, NORM_EPS, &m);
    return st == TP_OK ? adopt(parent, name, m) : st;
}

static tp_status add_embedding(tp_module *parent, const char *name, int64_t num)
{
    tp_module *m = NULL;
    tp_status st = tp_nn_embedding_create(num, DIM, &m);
    return st == TP_OK ? adopt(parent, name, m) : st;
}

static tp_status build_block(tp_module **out)
{
    tp_status st;
    tp_module *b = NULL, *attn = NULL, *ff = NULL, *gelu = NULL;
    *out = NULL;
    CHECK(tp_nn_custom_create("TransformerBlock", block_forward, NULL, NULL, &b));
    CHECK(add_norm(b, "attention_norm"));
    CHECK(tp_nn_custom_create("Attention", attention_forward, NULL, NULL, &attn));
    CHECK(add_linear(attn, "wq", DIM, HEADS * HEAD_DIM, false));
    CHECK(add_linear(attn, "wk", DIM, HEADS * HEAD_DIM, false));
    CHECK(add_linear(attn, "wv", DIM, HEADS * HEAD_DIM, false));
    CHECK(add_linear(attn, "wo", HEADS * HEAD_DIM, DIM, false));
    st = adopt(b, "attention", attn);
    attn = NULL;
    CHECK(st);
    CHECK(add_norm(b, "ffn_norm"));
    CHECK(tp_nn_custom_create("FeedForward", feed_forward_forward, NULL, NULL, &ff));
    CHECK(add_linear(ff, "w1", DIM, FFN, true));
    CHECK(tp_nn_gelu_create(TP_GELU_EXACT, &gelu));
    st = adopt(ff, "gelu", gelu);
    CHECK(st);
    CHECK(add_linear(ff, "w2", FFN, DIM, true));
    st = adopt(b, "feed_forward", ff);
    ff = NULL;
    CHECK(st);
    *out = b;
    b = NULL;
out:
    tp_module_free(ff);
    tp_module_free(attn);
    tp_module_free(b);
    return st;
}

static tp_status build_transformer(tp_module **out)
{
    tp_status st;
    tp_module *m = NULL, *layers = NULL, *block = NULL;
    *out = NULL;
    CHECK(tp_nn_custom_create("Transformer", transformer_forward, NULL, NULL, &m));
    CHECK(add_embedding(m, "tok_embeddings", VOCAB));
    CHECK(add_embedding(m, "pos_embeddings", SEQ));
    CHECK(tp_nn_sequential_create(&layers));
    for (int i = 0; i < LAYERS; i++) {
        char name[16];
        snprintf(name, sizeof name, "%d", i);
        CHECK(build_block(&block));
        st = adopt(layers, name, block);
        block = NULL;
        CHECK(st);
    }
    st = adopt(m, "layers", layers);
    layers = NULL;
    CHECK(st);
    CHECK(add_norm(m, "norm"));
    CHECK(add_linear(m, "output", DIM, VOCAB, false));
    *out = m;
    m = NULL;
out:
    tp_module_free(layers);
    tp_module_free(m);
    return st;
}

/* ---- the plans ----------------------------------------------------------------- */

/* The styles a plan refers to; freed after parallelizing. */
enum { ST_COL, ST_ROW, ST_EMB, ST_OUT, ST_SEQ, ST_GATHER, ST_ROW_SP, N_STYLES };

static tp_status parallelize_transformer(tp_module *m, tp_mesh *mesh, run_mode mode)
{
    tp_status st;
    tp_style *s[N_STYLES] = {0};
    const bool sp = mode == MODE_SP;
    const tp_layout R = tp_layout_of(tp_replicate()), S1 = tp_layout_of(tp_shard(1));

    CHECK(tp_colwise_parallel_create(NULL, &s[ST_COL]));
    CHECK(tp_rowwise_parallel_create(NULL, &s[ST_ROW]));
    /* tok_embeddings: the token ids arrive replicated; with SP the sum leaves
     * reduce-scattered on the sequence dim, as a DTensor for the residual adds */
    tp_rowwise_options emb = {.input_layouts = R};
    if (sp) {
        emb.output_layouts = S1;
        emb.use_local_output = TP_FLAG_FALSE;
    }
    CHECK(tp_rowwise_parallel_create(&emb, &s[ST_EMB]));
    /* output: the logits stay a DTensor sharded on the vocab dim, for the
     * vocab-parallel cross entropy */
    tp_colwise_options out_opts = {.output_layouts = tp_layout_of(tp_shard(-1)),
                                   .use_local_output = TP_FLAG_FALSE};
    if (sp)
        out_opts.input_layouts = S1;
    CHECK(tp_colwise_parallel_create(&out_opts, &s[ST_OUT]));

    if (!sp) {
        const tp_plan_entry plan[] = {
            {"tok_embeddings", s[ST_EMB]},
            {"layers.*.attention.w[qkv]", s[ST_COL]},
            {"layers.*.attention.wo", s[ST_ROW]},
            {"layers.*.feed_forward.w1", s[ST_COL]},
            {"layers.*.feed_forward.w2", s[ST_ROW]},
            {"output", s[ST_OUT]},
        };
        /* tp_module_init sets every parameter right after: nothing to send */
        const tp_parallelize_options po = {.src_data_rank = TP_SRC_DATA_RANK_NONE};
        CHECK(tp_parallelize_module(m, mesh, (int)(sizeof plan / sizeof plan[0]), plan, &po));
        goto out;
    }

    CHECK(tp_sequence_parallel_create(NULL, &s[ST_SEQ]));
    /* attention and feed_forward: gather the sequence-sharded input */
    tp_prepare_input_options gather = {.n_inputs = 1, .n_desired = 1};
    gather.input_layouts[0] = S1;
    gather.desired_input_layouts[0] = R;
    CHECK(tp_prepare_module_input_create(&gather, &s[ST_GATHER]));
    /* wo, w2: reduce-scatter back onto the sequence dim, kept a DTensor so
     * that the residual adds take two S(1) DTensors */
    const tp_rowwise_options row_sp = {.output_layouts = S1, .use_local_output = TP_FLAG_FALSE};
    CHECK(tp_rowwise_parallel_create(&row_sp, &s[ST_ROW_SP]));
    const tp_plan_entry plan[] = {
        {"tok_embeddings", s[ST_EMB]},
        /* replicated weight; the positions come in as an S(1) DTensor */
        {"pos_embeddings", s[ST_SEQ]},
        {"layers.*.attention_norm", s[ST_SEQ]},
        {"layers.*.attention", s[ST_GATHER]},
        {"layers.*.attention.w[qkv]", s[ST_COL]},
        {"layers.*.attention.wo", s[ST_ROW_SP]},
        {"layers.*.ffn_norm", s[ST_SEQ]},
        {"layers.*.feed_forward", s[ST_GATHER]},
        {"layers.*.feed_forward.w1", s[ST_COL]},
        {"layers.*.feed_forward.w2", s[ST_ROW_SP]},
        {"norm", s[ST_SEQ]},
        {"output", s[ST_OUT]},
    };
    const tp_parallelize_options po = {.src_data_rank = TP_SRC_DATA_RANK_NONE};
    CHECK(tp_parallelize_module(m, mesh, (int)(sizeof plan / sizeof plan[0]), plan, &po));
out:
    for (int i = 0; i < N_STYLES; i++)
        tp_style_free(s[i]);
    return st;
}

/* ---- data ------------------------------------------------------------------------- */

/* tokens [B, S] and targets [B*S] (the next token) from one random [B, S+1]
 * sequence; positions [B, S] = 0..S-1 per row. Every rank builds the same. */
static tp_status make_data(tp_tensor **tokens, tp_tensor **targets, tp_tensor **positions)
{
    tp_status st;
    tp_tensor *seq = NULL, *view = NULL, *shifted = NULL;
    const int64_t seq_shape[2] = {BATCH, SEQ + 1}, tok_shape[2] = {BATCH, SEQ},
                  tgt_shape[1] = {BATCH * SEQ};
    CHECK(tp_tensor_empty(TP_I64, TP_CPU, 2, seq_shape, &seq));
    CHECK(tp_tensor_fill_random(seq, TP_RNG_RANDINT, 0, VOCAB, TOKEN_SEED, NULL, NULL));
    CHECK(tp_tensor_empty(TP_I64, TP_CPU, 2, tok_shape, tokens));
    CHECK(tp_tensor_narrow(seq, 1, 0, SEQ, &view));
    CHECK(tp_tensor_copy(*tokens, view));
    tp_tensor_release(view);
    view = NULL;
    CHECK(tp_tensor_empty(TP_I64, TP_CPU, 1, tgt_shape, targets));
    CHECK(tp_tensor_view(*targets, 2, tok_shape, &view));
    CHECK(tp_tensor_narrow(seq, 1, 1, SEQ, &shifted));
    CHECK(tp_tensor_copy(view, shifted));
    CHECK(tp_tensor_empty(TP_I64, TP_CPU, 2, tok_shape, positions));
    for (int64_t b = 0; b < BATCH; b++)
        for (int64_t s = 0; s < SEQ; s++)
            CHECK(tp_tensor_set(*positions, (const int64_t[2]){b, s}, (double)s));
out:
    tp_tensor_release(shifted);
    tp_tensor_release(view);
    tp_tensor_release(seq);
    return st;
}

/* ---- training ----------------------------------------------------------------------- */

/* The optimizer of a run: Adam (f32 master weights and states for bf16/f16
 * parameters), and for f16 a grad scaler. */
typedef struct trainer {
    tp_adam *adam;
    tp_grad_scaler *scaler;
} trainer;

/* backward, then the Adam step (through the scaler in f16: an overflowing
 * step is skipped on every rank) */
static tp_status backward_and_step(trainer *tr, tp_tensor *loss)
{
    tp_status st;
    tp_tensor *scaled = NULL;
    if (tr->scaler) {
        CHECK(tp_grad_scaler_scale(tr->scaler, loss, &scaled));
        CHECK(tp_backward(scaled, NULL));
    } else {
        CHECK(tp_backward(loss, NULL));
    }
    CHECK(tp_comm_debug_push_scope("Adam"));
    st = tr->scaler ? tp_grad_scaler_step_adam(tr->scaler, tr->adam, NULL) : tp_adam_step(tr->adam);
    if (st == TP_OK && tr->scaler)
        st = tp_grad_scaler_update(tr->scaler);
    tp_status pop = tp_comm_debug_pop_scope();
    CHECK(st != TP_OK ? st : pop);
out:
    tp_tensor_release(scaled);
    return st;
}

/* One Adam step; *loss_value receives the loss before the update. The loss
 * and the optimizer step run in comm-debug scopes of their own ("loss",
 * "Adam"), so that the tables attribute their collectives. */
static tp_status train_step(tp_module *model, trainer *tr, tp_tensor *tokens, tp_tensor *positions,
                            tp_tensor *targets, double *loss_value)
{
    tp_status st;
    tp_tensor *logits = NULL, *loss = NULL;
    tp_tensor *args[2] = {tokens, positions};
    CHECK(tp_module_forward(model, 2, args, 0, NULL, &logits));
    CHECK(tp_comm_debug_push_scope("loss"));
    st = tp_cross_entropy(logits, targets, NULL, &loss);
    tp_status pop = tp_comm_debug_pop_scope();
    CHECK(st != TP_OK ? st : pop);
    /* the loss is plain without TP, a Replicate DTensor with it */
    tp_tensor *value = tp_tensor_is_dtensor(loss) ? tp_dtensor_local(loss) : loss;
    CHECK(tp_tensor_get(value, NULL, loss_value));
    CHECK(backward_and_step(tr, loss));
    tp_module_zero_grad(model);
out:
    tp_tensor_release(loss);
    tp_tensor_release(logits);
    return st;
}

static tp_status keep_param(const char *fqn, tp_tensor *full, void *ctx)
{
    run *r = ctx;
    if (!r)
        return TP_OK; /* not rank 0 */
    if (r->nparams == MAX_PARAMS) {
        fprintf(stderr, "more than %d parameters\n", MAX_PARAMS);
        return TP_ERR_NO_MEMORY;
    }
    param_value *p = &r->params[r->nparams];
    snprintf(p->fqn, sizeof p->fqn, "%s", fqn);
    /* a CPU copy: main compares it after the rank threads are gone */
    tp_status st = tp_tensor_to(full, tp_tensor_dtype(full), TP_CPU, &p->full);
    if (st == TP_OK)
        r->nparams++;
    return st;
}

/* This dp group's share of a batch-major tensor: `rows_per_batch` rows per
 * batch element, share `index` of `shares` (a copy). */
static tp_status batch_share(tp_tensor *t, int64_t rows_per_batch, int64_t index, int64_t shares,
                             tp_tensor **out)
{
    tp_tensor *view = NULL;
    const int64_t rows = BATCH / shares * rows_per_batch;
    tp_status st = tp_tensor_narrow(t, 0, index * rows, rows, &view);
    if (st == TP_OK)
        st = tp_tensor_clone(view, out);
    tp_tensor_release(view);
    return st;
}

/* Replaces *t with a copy on `device` (same dtype); a no-op on the CPU. */
static tp_status to_device(tp_tensor **t, tp_device device)
{
    if (device.type == TP_DEVICE_CPU)
        return TP_OK;
    tp_tensor *moved = NULL;
    tp_status st = tp_tensor_to(*t, tp_tensor_dtype(*t), device, &moved);
    if (st == TP_OK) {
        tp_tensor_release(*t);
        *t = moved;
    }
    return st;
}

static double now_seconds(void)
{
    struct timespec ts;
    timespec_get(&ts, TIME_UTC);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The mean of each step's loss over the dp groups (one all_reduce, after the
 * counted step): each group's loss is the mean over its own tokens, and the
 * shares are equal, so this is the whole batch's mean, the reference's loss. */
static tp_status dp_mean_losses(tp_comm *dp, tp_device dev, int64_t steps, double *loss)
{
    tp_status st;
    tp_tensor *t = NULL;
    CHECK(tp_tensor_from_data(TP_F64, 1, &steps, loss, &t));
    CHECK(to_device(&t, dev)); /* where the comm's buffers live */
    CHECK(tp_all_reduce(dp, t, t, TP_AVG, NULL));
    for (int64_t s = 0; s < steps; s++)
        CHECK(tp_tensor_get(t, &s, &loss[s]));
out:
    tp_tensor_release(t);
    return st;
}

/* ---- checkpoints (--save, --load, --resume-check) -------------------------------- */

/* Saves the model and Adam's state (moments, step count, the f32 masters of
 * bf16/f16 parameters) as a sharded checkpoint, with the step reached. */
static tp_status save_checkpoint(const char *dir, tp_module *m, trainer *tr, int64_t step)
{
    tp_checkpoint_meta meta = {.key = "step", .value = step};
    const tp_checkpoint_options o = {.n_meta = 1, .meta = &meta};
    const tp_checkpoint_optim opt = {.adam = tr->adam};
    return tp_checkpoint_save(dir, m, &opt, &o);
}

/* Loads into the model and Adam as they are now (any rank count and plan:
 * the checkpoint reshards); *step is the step it was saved at. */
static tp_status load_checkpoint(const char *dir, tp_module *m, trainer *tr, int *step)
{
    tp_checkpoint_meta meta = {.key = "step"};
    const tp_checkpoint_options o = {.n_meta = 1, .meta = &meta};
    const tp_checkpoint_optim opt = {.adam = tr->adam};
    tp_status st = tp_checkpoint_load(dir, m, &opt, &o);
    *step = st == TP_OK && meta.found && meta.value >= 0 && meta.value < MAX_STEPS ? (int)meta.value
                                                                                   : 0;
    return st;
}

static tp_status transformer_rank(tp_comm *world, void *arg)
{
    const run *cfg = arg;
    const int rank = tp_comm_rank(world);
    const tp_device dev = cfg->cuda ? TP_CUDA(rank % tp_cuda_device_count()) : TP_CPU;
    double loss[MAX_STEPS], seconds = 0.0;
    tp_status st;
    tp_comm *nccl = NULL;
    tp_mesh *mesh = NULL, *tpmesh = NULL;
    tp_comm *dp_comm = NULL;
    int64_t dp_coord = 0;
    int dp_buckets = 0;
    tp_module *model = NULL;
    tp_ddp *ddp = NULL;
    trainer tr = {0};
    tp_tensor *tokens = NULL, *targets = NULL, *positions = NULL, *tgt = NULL, *pos = NULL;
    tp_comm_debug *debug = NULL;

    if (g_nccl && cfg->mode != MODE_NONE) {
        /* the shm world of the threads carries the NCCL id; rank r uses
         * cuda:r (main checked that there are enough devices) */
        tp_nccl_options no = {.bootstrap = world, .device = rank};
        CHECK(tp_comm_create_world("nccl", &no, &nccl));
        world = nccl;
    }
    if (cfg->mode != MODE_NONE && cfg->dp) {
        /* DP x TP: world rank = dp * (ranks / dp) + tp; the TP plan lives on
         * this rank's "tp" row, the DDP averages over its "dp" column */
        const int64_t shape[2] = {cfg->dp, tp_comm_size(world) / cfg->dp};
        const char *const names[2] = {"dp", "tp"}, *const tp_only[1] = {"tp"};
        CHECK(tp_mesh_create(world, 2, shape, names, &mesh));
        CHECK(tp_mesh_slice(mesh, 1, tp_only, &tpmesh));
        dp_comm = tp_mesh_comm(mesh, tp_mesh_dim_index(mesh, "dp"));
        dp_coord = tp_mesh_coord(mesh, tp_mesh_dim_index(mesh, "dp"));
    } else if (cfg->mode != MODE_NONE) {
        const int64_t size = tp_comm_size(world);
        const char *const names[1] = {"tp"};
        CHECK(tp_mesh_create(world, 1, &size, names, &tpmesh));
    }
    CHECK(build_transformer(&model));
    if (cfg->mode != MODE_NONE)
        CHECK(parallelize_transformer(model, tpmesh, cfg->mode));
    CHECK(tp_module_init(model, PARAM_SEED));
    /* param_dtype: cast before the DDP and the optimizer see the parameters */
    if (cfg->dtype != TP_F32)
        CHECK(tp_module_to_dtype(model, cfg->dtype));
    /* --device cuda: the same values, moved before the DDP and Adam exist */
    if (cfg->cuda)
        CHECK(tp_module_to(model, dev));
    if (dp_comm && g_fsdp) {
        /* each block a unit, then the model (the embeddings, the final norm
         * and the output projection): parameters, gradients and Adam's state
         * sharded over "dp", gathered around each unit's forward and
         * backward. Low-precision parameters are gathered as they are, their
         * gradients reduce_scattered in f32 */
        const tp_fsdp_options fo = {.has_reduce_dtype = cfg->dtype != TP_F32,
                                    .reduce_dtype = TP_F32};
        tp_module *layers = tp_module_child(model, "layers");
        for (int i = 0; i < tp_module_num_children(layers); i++)
            CHECK(tp_fully_shard(tp_module_child_at(layers, i, NULL), mesh, &fo));
        CHECK(tp_fully_shard(model, mesh, &fo));
    } else if (dp_comm) {
        /* every dp group initialized the same parameters: nothing to send.
         * Buckets of 16 KiB (PyTorch's 25 MiB default would hold this whole
         * model): a few all_reduces, launched as they fill during backward.
         * Low-precision gradients are averaged in f32 (reduce_dtype); the
         * buckets are sized in f32 bytes, so the all_reduces are the f32
         * run's */
        const tp_ddp_options dpo = {.bucket_cap_bytes = 16 << 10,
                                    .params_everywhere = true,
                                    .has_reduce_dtype = cfg->dtype != TP_F32,
                                    .reduce_dtype = TP_F32};
        CHECK(tp_ddp_create(model, dp_comm, &dpo, &ddp));
        /* the buckets of step 0's schedule; each is one all_reduce per step
         * (tp/dp.h). After step 0 the DDP may regroup them in the order the
         * gradients became ready */
        dp_buckets = tp_step_graph_num_buckets(tp_ddp_graph(ddp));
    }
    CHECK(tp_adam_create(model, LR, 0.0, 0.0, 0.0, &tr.adam));
    if (cfg->dtype == TP_F16) {
        /* the flag is agreed over every rank: tp shards and dp replicas */
        const tp_grad_scaler_options gso = {.init_scale = 1024};
        CHECK(tp_grad_scaler_create(
            cfg->mode != MODE_NONE && tp_comm_size(world) > 1 ? world : NULL, &gso, &tr.scaler));
    }

    /* --load: parameters, moments, masters and the step count; after the
     * DDP (which only hooks the parameters) and before any step */
    int start_step = 0;
    if (cfg->load_dir)
        CHECK(load_checkpoint(cfg->load_dir, model, &tr, &start_step));

    CHECK(make_data(&tokens, &targets, &positions));
    CHECK(to_device(&tokens, dev));
    CHECK(to_device(&targets, dev));
    CHECK(to_device(&positions, dev));
    if (dp_comm) {
        /* this dp group trains on its share of the batch: the loss is the mean
         * over its tokens, and the DDP's average over the equal shares makes
         * the gradients those of the whole batch's mean */
        tp_tensor *full[3] = {tokens, targets, positions};
        const int64_t per_batch[3] = {1, SEQ, 1};
        tokens = targets = positions = NULL;
        st = TP_OK;
        for (int i = 0; i < 3 && st == TP_OK; i++)
            st = batch_share(full[i], per_batch[i], dp_coord, cfg->dp,
                             i == 0 ? &tokens : i == 1 ? &targets : &positions);
        for (int i = 0; i < 3; i++)
            tp_tensor_release(full[i]);
        CHECK(st);
    }
    if (cfg->mode == MODE_NONE) {
        tgt = tp_tensor_retain(targets);
        pos = tp_tensor_retain(positions);
    } else {
        /* the vocab-parallel cross entropy takes DTensor logits, so the
         * targets become a Replicate DTensor (every rank holds them all) */
        const tp_placement rep = tp_replicate();
        CHECK(tp_dtensor_from_local(tpmesh, targets, 1, &rep, NULL, &tgt));
        if (cfg->mode == MODE_SP) {
            /* every rank holds all positions: no communication, each keeps its
             * S(1) block, which the SequenceParallel pos_embeddings embeds */
            const tp_placement s1 = tp_shard(1);
            CHECK(tp_dtensor_distribute(tpmesh, positions, 1, &s1, -1, &pos));
        } else {
            pos = tp_tensor_retain(positions);
        }
    }

    CHECK(tp_comm_debug_create(&debug));
    /* each step reads its loss on the host, which waits for the device */
    const double start = now_seconds();
    for (int step = 0; step < cfg->steps; step++) {
        if (step == 0)
            CHECK(tp_comm_debug_begin(debug));
        CHECK(train_step(model, &tr, tokens, pos, tgt, &loss[step]));
        if (step == 0)
            CHECK(tp_comm_debug_end(debug));
    }
    seconds = now_seconds() - start;
    if (dp_comm)
        CHECK(dp_mean_losses(dp_comm, dev, cfg->steps, loss));
    /* --save: the dp replicas hold the same model; the first one's "tp"
     * ranks write it (the checkpoint is collective over its mesh) */
    if (cfg->save_dir && dp_coord == 0)
        CHECK(save_checkpoint(cfg->save_dir, model, &tr, start_step + cfg->steps));
    /* rank 0 records the run; main reads it after the ranks joined */
    run *r = rank == 0 ? arg : NULL;
    CHECK(tp_module_state_dict(model, keep_param, r));
    if (r) {
        memcpy(r->loss, loss, (size_t)cfg->steps * sizeof loss[0]);
        r->seconds = seconds;
        r->start_step = start_step;
        r->dp_buckets = dp_buckets;
        r->debug = debug;
        debug = NULL;
    }
out:
    tp_comm_debug_free(debug);
    tp_tensor_release(pos);
    tp_tensor_release(tgt);
    tp_tensor_release(positions);
    tp_tensor_release(targets);
    tp_tensor_release(tokens);
    tp_grad_scaler_free(tr.scaler);
    tp_adam_free(tr.adam);
    /* any order: each holds what it uses */
    tp_ddp_free(ddp);
    tp_module_free(model);
    tp_mesh_free(tpmesh);
    tp_mesh_free(mesh);
    tp_comm_free(nccl); /* the meshes and the DDP held their own references */
    return st;
}

/* ---- comparing runs ------------------------------------------------------------------ */

static bool close_to(double a, double ref, double rtol, double atol)
{
    return fabs(a - ref) <= atol + rtol * fabs(ref);
}

/* Compares r with the reference: losses per step within rtol, atol, then
 * every parameter within rtol, param_atol(steps). */
static void compare(run *r, const run *ref, double rtol, double atol)
{
    r->ok = r->status == TP_OK && r->nparams == ref->nparams;
    r->loss_diff = r->param_diff = 0.0;
    if (r->status != TP_OK)
        return;
    for (int s = 0; s < r->steps; s++) {
        double d = fabs(r->loss[s] - ref->loss[s]);
        r->loss_diff = d > r->loss_diff ? d : r->loss_diff;
        if (!close_to(r->loss[s], ref->loss[s], rtol, atol))
            r->ok = false;
    }
    for (int i = 0; i < ref->nparams; i++) {
        const param_value *want = &ref->params[i];
        const param_value *got = NULL;
        for (int j = 0; j < r->nparams && !got; j++)
            if (!strcmp(r->params[j].fqn, want->fqn))
                got = &r->params[j];
        double d = 0.0;
        bool close = false;
        if (!got || tp_tensor_max_abs_diff(got->full, want->full, &d) != TP_OK ||
            tp_tensor_allclose(got->full, want->full, rtol, param_atol(r->start_step + r->steps),
                               &close) != TP_OK ||
            !close) {
            fprintf(stderr, "  %s/%d: parameter %s differs from the reference (max |diff| "
                            "%.3g)%s\n", mode_name[r->mode], r->ranks, want->fqn, d,
                    got ? "" : ": missing");
            r->ok = false;
        }
        r->param_diff = d > r->param_diff ? d : r->param_diff;
    }
}

static void run_free(run *r)
{
    for (int i = 0; i < r->nparams; i++)
        tp_tensor_release(r->params[i].full);
    r->nparams = 0;
    tp_comm_debug_free(r->debug);
    r->debug = NULL;
}

/* A run's ranks: "4", or "2x2" (dp x tp) with -d. */
static const char *ranks_str(const run *r, char *buf, size_t len)
{
    if (r->dp)
        snprintf(buf, len, "%dx%d", r->dp, r->ranks / r->dp);
    else
        snprintf(buf, len, "%d", r->ranks);
    return buf;
}

/* The scope of the collectives issued outside the model, loss and optimizer
 * scopes (for kinds_str): with -d, the DDP's bucket all_reduces, which its
 * gradient hooks launch during backward. */
#define UNSCOPED NULL

/* Set when a scope the table names was never entered during the counted
 * step: a wrong name, or a module that did not run, instead of a silent 0. */
static bool scope_missing;

/* Count of `kind` that scope `fqn` (or UNSCOPED) issued in `phase`, through
 * the checked query; -1 (and a message) for a scope never seen. 0 without a
 * counter (under mpirun, only rank 0's process keeps one). */
static int64_t scope_count(const tp_comm_debug *d, const char *fqn, tp_phase phase,
                           tp_coll_kind kind)
{
    if (!d)
        return 0;
    static const char *const top[] = {TP_COMM_DEBUG_ROOT, "loss", "Adam"};
    const char *scope = fqn != UNSCOPED ? fqn : TP_COMM_DEBUG_GLOBAL;
    int64_t c = 0, sub = 0;
    for (size_t i = 0; i <= (fqn != UNSCOPED ? 0 : sizeof top / sizeof top[0]); i++) {
        if (i > 0)
            scope = top[i - 1];
        if (tp_comm_debug_scope_count(d, scope, phase, kind, &sub) != TP_OK) {
            if (!scope_missing)
                fprintf(stderr, "%s\n", tp_last_error());
            scope_missing = true;
            return -1;
        }
        c += i == 0 ? sub : -sub;
    }
    return c;
}

/* The collectives scope `fqn` issued in `phase`, as "ar 3, ag 2" (all_reduce,
 * all_gather, reduce_scatter, ...), or "-". */
static const char *kinds_str(const tp_comm_debug *d, const char *fqn, tp_phase phase, char *buf,
                             size_t len)
{
    static const char *const abbrev[TP_COLL_KIND_COUNT] = {"ar", "ag", "rs",  "a2a",
                                                           "bc", "bar", "sc"};
    size_t n = 0;
    buf[0] = '\0';
    for (int k = 0; k < TP_COLL_KIND_COUNT && n < len; k++) {
        int64_t c = scope_count(d, fqn, phase, (tp_coll_kind)k);
        if (c < 0) {
            snprintf(buf, len, "(not seen)");
            return buf;
        }
        if (c) {
            int w = snprintf(buf + n, len - n, "%s%s %lld", n ? ", " : "", abbrev[k],
                             (long long)c);
            n += w > 0 ? (size_t)w : 0;
        }
    }
    if (!n)
        snprintf(buf, len, "-");
    return buf;
}

/* Width of the table's forward column: 20, or wider for a longer Global
 * entry (the longest: it counts everything). */
static int fwd_width = 20;

static void print_scope(const tp_comm_debug *d, const char *fqn, const char *label, int depth)
{
    char f[96], b[96];
    printf("  %*s%-*s %-*s %s\n", 2 * depth, "", 34 - 2 * depth, label, fwd_width,
           kinds_str(d, fqn, TP_PHASE_FORWARD, f, sizeof f),
           kinds_str(d, fqn, TP_PHASE_BACKWARD, b, sizeof b));
}

/* One line per module below m, depth first; the scope of a module is its FQN,
 * as in the plans ("layers.0.attention"; the root's is ""). */
static void print_module_scopes(const tp_comm_debug *d, const tp_module *m, const char *fqn,
                                int depth)
{
    for (int i = 0; i < tp_module_num_children(m); i++) {
        const char *name = NULL;
        const tp_module *c = tp_module_child_at(m, i, &name);
        char cfqn[256]; /* comm-debug FQNs have at most 255 characters */
        int n = snprintf(cfqn, sizeof cfqn, "%s%s%s", fqn, fqn[0] ? "." : "", name);
        if (n < 0 || (size_t)n >= sizeof cfqn)
            continue;
        print_scope(d, cfqn, name, depth);
        print_module_scopes(d, c, cfqn, depth + 1);
    }
}

/* A compact per-module table of one run's counter (the full layout is
 * tp_comm_debug_write_table's, printed with -t). */
static tp_status print_comm_table(const run *r)
{
    tp_status st;
    tp_module *model = NULL;
    char rk[16], g[96];
    CHECK(build_transformer(&model)); /* for the module names only */
    const int w = (int)strlen(kinds_str(r->debug, TP_COMM_DEBUG_GLOBAL, TP_PHASE_FORWARD, g,
                                        sizeof g));
    fwd_width = w > 20 ? w : 20;
    printf("\nCollectives per module in training step 0, %s on %s rank%s%s (rank 0;\n"
           "ar = all_reduce, ag = all_gather, rs = reduce_scatter%s):\n"
           "  %-34s %-*s %s\n",
           mode_name[r->mode], ranks_str(r, rk, sizeof rk), r->ranks > 1 ? "s" : "",
           r->dp ? " (dp x tp)" : "", r->dp ? ", bc = broadcast" : "", "scope", fwd_width,
           "forward", "backward");
    print_scope(r->debug, TP_COMM_DEBUG_GLOBAL, TP_COMM_DEBUG_GLOBAL, 0);
    print_scope(r->debug, TP_COMM_DEBUG_ROOT, tp_module_type_name(model), 1);
    print_module_scopes(r->debug, model, TP_COMM_DEBUG_ROOT, 2);
    print_scope(r->debug, "loss", "loss (cross entropy)", 1);
    print_scope(r->debug, "Adam", "Adam (optimizer step)", 1);
    if (r->dp && !g_fsdp)
        print_scope(r->debug, UNSCOPED, "DDP gradient hooks (dp)", 1);
    if (scope_missing) { /* the query printed which scope and those seen */
        fprintf(stderr, "the table names a scope training step 0 never entered\n");
        st = TP_ERR_INVALID_ARG;
        goto out;
    }
    if (scope_count(r->debug, "Adam", TP_PHASE_COUNT, TP_COLL_ALL_REDUCE) > 0)
        printf("  (the optimizer step counts as forward: it sums the Partial gradients of the\n"
               "  replicated sequence-parallel parameters, the norms and pos_embeddings)\n");
    if (r->dp && g_fsdp)
        printf("  (dp, fully sharded: a unit's all_gather over dp counts in the scope of\n"
               "  the unit whose hook issued it: its own, or the unit before when it was\n"
               "  prefetched; its reduce_scatter of the gradients in the backward of the op\n"
               "  that produced its last gradient)\n");
    else if (r->dp)
        printf("  (dp: the DDP's gradient hooks launch one all_reduce per bucket during\n"
               "  backward, outside any module scope; the Adam step waits for them in its\n"
               "  pre-hook. Its broadcast is first-step only: rank 0's gradient-ready order,\n"
               "  which fixes the buckets for the later steps)\n");
out:
    tp_module_free(model);
    return st;
}

/* ---- main ---------------------------------------------------------------------------- */

static int parse_int(const char *s, int lo, int hi, const char *what)
{
    char *end = NULL;
    long v = s ? strtol(s, &end, 10) : 0;
    if (!s || *end || v < lo || v > hi) {
        fprintf(stderr, "%s must be an integer in [%d, %d]\n", what, lo, hi);
        return -1;
    }
    return (int)v;
}

static int parse_dtype(const char *s, tp_dtype *out)
{
    static const tp_dtype dts[] = {TP_F32, TP_BF16, TP_F16};
    for (int i = 0; s && i < 3; i++)
        if (!strcmp(s, tp_dtype_name(dts[i]))) {
            *out = dts[i];
            return 0;
        }
    fprintf(stderr, "--dtype must be f32, bf16 or f16, got '%s'\n", s ? s : "");
    return -1;
}

/* --dtype bf16/f16: the 1-rank run's final loss vs the same training in f32
 * (one more 1-rank run), within final_rtol_of. */
static bool final_loss_vs_f32(const run *lowp)
{
    static run f32; /* static: a run is large */
    f32 = (run){
        .mode = MODE_NONE, .dtype = TP_F32, .cuda = lowp->cuda, .ranks = 1, .steps = lowp->steps};
    f32.status = tp_run_local(1, transformer_rank, &f32);
    bool ok = f32.status == TP_OK;
    if (!ok) {
        fprintf(stderr, "the f32 run failed: %s: %s\n", tp_status_name(f32.status),
                tp_last_error());
    } else {
        double a = lowp->loss[lowp->steps - 1], b = f32.loss[f32.steps - 1];
        double rel = fabs(a - b) / fabs(b);
        ok = rel <= final_rtol_of(lowp->dtype);
        printf("\nfinal loss after %d steps: %s %.6f, f32 %.6f: relative difference %.3g "
               "(tolerance %g)  %s\n",
               lowp->steps, tp_dtype_name(lowp->dtype), a, b, rel, final_rtol_of(lowp->dtype),
               ok ? "ok" : "TOO FAR");
    }
    run_free(&f32);
    return ok;
}

/* --device cuda: the 1-rank run once more on the CPU, which the GPU's must
 * match in losses and parameters within the dtype's tolerances (in f32
 * rtol 1e-4, atol 1e-5: the CUDA engine's agreement with the CPU per op). */
static bool gpu_vs_cpu(run *gpu)
{
    static run cpu; /* static: a run is large */
    cpu = (run){.mode = MODE_NONE, .dtype = gpu->dtype, .ranks = 1, .steps = gpu->steps};
    cpu.status = tp_run_local(1, transformer_rank, &cpu);
    bool ok = cpu.status == TP_OK;
    if (!ok) {
        fprintf(stderr, "the CPU run failed: %s: %s\n", tp_status_name(cpu.status),
                tp_last_error());
    } else {
        compare(gpu, &cpu, RTOL, ATOL);
        ok = gpu->ok;
        printf("\n1-rank run on cuda vs the same run on the CPU: max |diff| loss %.2e, "
               "parameters %.2e (rtol %g, atol %g; parameters: atol %g)  %s\n",
               gpu->loss_diff, gpu->param_diff, RTOL, ATOL, param_atol(gpu->steps),
               ok ? "ok" : "MISMATCH");
    }
    run_free(&cpu);
    return ok;
}

/* --device cuda: each device's peak tensor memory over the whole program
 * (tp_memory_stats), and each run's tokens trained per second (the global
 * batch of BATCH x SEQ tokens per step, rank 0's wall time of the steps, the
 * first included). */
static void print_device_summary(const run *runs, int nruns)
{
    printf("\n");
    for (int d = 0; d < tp_cuda_device_count(); d++) {
        tp_memory_info mi;
        if (tp_memory_stats(TP_CUDA(d), &mi) == TP_OK && mi.num_allocs > 0)
            printf("cuda:%d: peak tensor memory %.1f KiB (%zu bytes, every run)\n", d,
                   (double)mi.peak_allocated / 1024.0, mi.peak_allocated);
    }
    for (int i = 0; i < nruns; i++) {
        const run *r = &runs[i];
        char rk[16];
        if (r->status == TP_OK && r->seconds > 0)
            printf("%-6s on %s rank%s: %d steps in %.2f ms, %.0f tokens/s\n", mode_name[r->mode],
                   ranks_str(r, rk, sizeof rk), r->ranks > 1 ? "s" : "", r->steps, 1e3 * r->seconds,
                   (double)BATCH * SEQ * r->steps / r->seconds);
    }
}

/* The checks of --device and -b before anything runs: 0 to go on, else the
 * exit status (2: a bad combination; 77: no CUDA device, meson's skip). */
static int check_device(bool cuda, bool mpi, int max_ranks)
{
    if (cuda && mpi) {
        fprintf(stderr, "--device cuda needs -b shm or -b nccl: the mpi backend moves CPU "
                        "tensors only (with -b shm the ranks, threads, share the GPUs)\n");
        return 2;
    }
    if (g_nccl && !cuda) {
        fprintf(stderr, "-b nccl moves CUDA tensors only: add --device cuda\n");
        return 2;
    }
    const int ndev = tp_cuda_device_count();
    if (cuda && ndev == 0) {
        fprintf(stderr, "no CUDA device: tp_cuda_device_count() is 0 (libtp built without "
                        "CUDA, or no GPU visible); --device cuda skipped\n");
        return 77;
    }
    if (g_nccl && ndev < max_ranks) {
        fprintf(stderr,
                "-b nccl puts each rank on a GPU of its own: %d ranks need %d CUDA devices, "
                "this machine has %d; use -b shm, whose ranks share the GPUs\n",
                max_ranks, max_ranks, ndev);
        return 2;
    }
    return 0;
}

static void usage(FILE *f)
{
    fprintf(f,
            "usage: tp-example-transformer [-r RANKS] [-d DP] [-s STEPS] [-t] [-b shm|mpi|nccl]\n"
            "                              [--dtype f32|bf16|f16] [--device cpu|cuda]\n"
            "                              [--save DIR] [--load DIR] [--resume-check] [--fsdp]\n"
            "  -b mpi    under mpirun: the TP runs use one process per rank\n"
            "  -b nccl   with --device cuda: one GPU per rank (threads, an nccl world)\n"
            "  -r RANKS  rank count of the TP runs; RANKS / DP must divide the %d heads\n"
            "            (default: 1, 2 and 4 times DP)\n"
            "  -d DP     data parallel x tensor parallel: a (\"dp\", \"tp\") mesh of\n"
            "            [DP, RANKS / DP], the batch of %d split over dp (DP divides both)\n"
            "  --fsdp    with -d: fully sharded data parallel over \"dp\" (every block a\n"
            "            unit, then the model: tp_fully_shard) instead of the DDP\n"
            "  -s STEPS  Adam steps (default 3)\n"
            "  -t        also print the full comm-debug table of every run\n"
            "  --dtype   train in f32 (default), bf16 or f16 (f32 master weights and\n"
            "            states, f32 gradient reduction; f16 with loss scaling), and\n"
            "            compare with an f32 run\n"
            "  --device cpu|cuda, -D cpu|cuda\n"
            "            run on the CPU (default) or the GPU: with -b shm rank r on\n"
            "            cuda:(r %% device count), so the ranks share one GPU; the\n"
            "            1-rank run is checked against the CPU too. Exit 77 without\n"
            "            a CUDA device\n"
            "  --save DIR  train one TP run (RANKS, or the largest count) and save it,\n"
            "            model and Adam state, as a sharded checkpoint (tp/checkpoint.h)\n"
            "  --load DIR  resume that run from a checkpoint, on any rank count (it\n"
            "            reshards); the steps are numbered on from the saved one\n"
            "  --resume-check  check that 2 x STEPS steps equal STEPS steps, --save,\n"
            "            --load on another rank count and STEPS more (exit 1 if not)\n",
            HEADS, BATCH);
}

/* The reason `ranks` cannot run as a [dp, ranks / dp] mesh (dp 0: a 1-D TP
 * mesh), or NULL when it can. */
static const char *bad_layout(int ranks, int dp, char *buf, size_t len)
{
    const int d = dp ? dp : 1;
    if (ranks % d)
        snprintf(buf, len, "-d DP (%d) must divide the rank count (%d)", dp, ranks);
    else if (HEADS % (ranks / d) && !dp)
        snprintf(buf, len, "the rank count (%d) must divide the %d heads", ranks, HEADS);
    else if (HEADS % (ranks / d))
        snprintf(buf, len, "the tp size %d (ranks %d / dp %d) must divide the %d heads",
                 ranks / d, ranks, d, HEADS);
    else
        return NULL;
    return buf;
}

/* ---- --save, --load, --resume-check ---------------------------------------------- */

/* A TP run on the MPI world when there is one, else on `ranks` threads. */
static tp_status run_one(tp_comm *world, run *r)
{
    return world ? transformer_rank(world, r) : tp_run_local(r->ranks, transformer_rank, r);
}

static void print_losses(const char *label, const run *r)
{
    char rk[16];
    printf("%-22s %5s ", label, ranks_str(r, rk, sizeof rk));
    for (int s = 0; s < r->steps; s++)
        printf("  %d: %.6f", r->start_step + s, r->loss[s]);
    printf("\n");
}

/* The rank count the resumed run of --resume-check uses: another that fits
 * the heads (and -d), or 0. */
static int other_rank_count(int ranks, int dp)
{
    const int cand[] = {ranks / 2, ranks * 2, 1, 2, 4, 8};
    char why[128];
    for (size_t i = 0; i < sizeof cand / sizeof cand[0]; i++)
        if (cand[i] >= 1 && cand[i] != ranks && cand[i] <= BATCH * HEADS &&
            !bad_layout(cand[i], dp, why, sizeof why))
            return cand[i];
    return 0;
}

static int remove_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb, (void)flag, (void)ftw;
    return remove(path);
}

/* --resume-check: 2 x STEPS steps on RANKS ranks, against STEPS steps, a
 * checkpoint, a load on another rank count (the checkpoint reshards) and
 * STEPS more steps: the losses of the last STEPS steps and the final
 * parameters must agree within the run-to-run tolerances. */
static int resume_check(const run *base)
{
    char tmp[] = "/tmp/tp-example-ckpt-XXXXXX", dir[64];
    if (!mkdtemp(tmp)) {
        perror("mkdtemp");
        return 1;
    }
    snprintf(dir, sizeof dir, "%s/ckpt", tmp);
    static run whole, first, resumed, ref;
    whole = first = resumed = *base;
    whole.steps = 2 * base->steps;
    first.save_dir = dir;
    resumed.load_dir = dir;
    resumed.ranks = other_rank_count(base->ranks, base->dp);
    bool ok = resumed.ranks > 0;
    if (!ok)
        fprintf(stderr, "no other rank count fits %d heads\n", HEADS);
    run *order[3] = {&whole, &first, &resumed};
    const char *label[3] = {"straight through", "first half, saved", "loaded, second half"};
    for (int i = 0; ok && i < 3; i++) {
        order[i]->status = run_one(NULL, order[i]);
        if (order[i]->status != TP_OK) {
            fprintf(stderr, "%s failed: %s: %s\n", label[i], tp_status_name(order[i]->status),
                    tp_last_error());
            ok = false;
            break;
        }
        print_losses(label[i], order[i]);
    }
    if (ok) {
        /* the whole run's second half, as the reference of the resumed one */
        ref = whole;
        ref.steps = base->steps;
        memcpy(ref.loss, whole.loss + base->steps, (size_t)base->steps * sizeof ref.loss[0]);
        compare(&resumed, &ref, RTOL, ATOL);
        ok = resumed.ok && resumed.start_step == base->steps;
        char a[16], b[16];
        printf(
            "\n%s: %d steps on %s rank(s) == %d steps, saved, loaded on %s rank(s) (step %d), %d "
            "more: max |diff| loss %.2e, parameters %.2e (rtol %g, atol %g)\n",
            ok ? "PASS" : "FAIL", 2 * base->steps, ranks_str(&whole, a, sizeof a), base->steps,
            ranks_str(&resumed, b, sizeof b), resumed.start_step, base->steps, resumed.loss_diff,
            resumed.param_diff, RTOL, ATOL);
    }
    nftw(tmp, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
    run_free(&whole);
    run_free(&first);
    run_free(&resumed);
    return ok ? 0 : 1;
}

/* --save / --load without --resume-check: one TP run. */
static int checkpoint_run(tp_comm *world, const run *base)
{
    static run r;
    r = *base;
    r.status = run_one(world, &r);
    if (r.status != TP_OK) {
        fprintf(stderr, "training failed: %s: %s\n", tp_status_name(r.status), tp_last_error());
        run_free(&r);
        return 1;
    }
    print_losses(r.load_dir ? "TP, resumed" : "TP", &r);
    if (r.save_dir)
        printf("saved step %d to %s\n", r.start_step + r.steps, r.save_dir);
    run_free(&r);
    return 0;
}

int main(int argc, char **argv)
{
    int rank_counts[3] = {1, 2, 4}, n_counts = 3, steps = 3, dp = 0;
    bool use_mpi = false, use_cuda = false;
    bool all_tables = false, check_resume = false;
    const char *save_dir = NULL, *load_dir = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(argv[i], "-r")) {
            rank_counts[0] = parse_int(i + 1 < argc ? argv[++i] : NULL, 1, BATCH * HEADS,
                                       "-r RANKS");
            n_counts = 1;
            if (rank_counts[0] < 0)
                return 2;
        } else if (!strcmp(argv[i], "-d")) {
            dp = parse_int(i + 1 < argc ? argv[++i] : NULL, 1, BATCH, "-d DP");
            if (dp < 0)
                return 2;
            if (BATCH % dp) {
                fprintf(stderr, "-d DP (%d) must divide the batch (%d)\n", dp, BATCH);
                return 2;
            }
        } else if (!strcmp(argv[i], "-b")) {
            const char *b = i + 1 < argc ? argv[++i] : "";
            if (strcmp(b, "shm") && strcmp(b, "mpi") && strcmp(b, "nccl")) {
                fprintf(stderr, "-b BACKEND must be shm, mpi or nccl, got '%s'\n", b);
                return 2;
            }
            use_mpi = !strcmp(b, "mpi");
            g_nccl = !strcmp(b, "nccl");
        } else if (!strcmp(argv[i], "-s")) {
            steps = parse_int(i + 1 < argc ? argv[++i] : NULL, 1, MAX_STEPS, "-s STEPS");
            if (steps < 0)
                return 2;
        } else if (!strcmp(argv[i], "-t")) {
            all_tables = true;
        } else if (!strcmp(argv[i], "--save") || !strcmp(argv[i], "--load")) {
            const char *d = i + 1 < argc ? argv[i + 1] : NULL;
            if (!d || !*d) {
                fprintf(stderr, "%s needs a directory\n", argv[i]);
                return 2;
            }
            *(argv[i][2] == 's' ? &save_dir : &load_dir) = d;
            i++;
        } else if (!strcmp(argv[i], "--resume-check")) {
            check_resume = true;
        } else if (!strcmp(argv[i], "--fsdp")) {
            g_fsdp = true;
        } else if (!strcmp(argv[i], "--dtype")) {
            if (parse_dtype(i + 1 < argc ? argv[++i] : NULL, &g_dtype) != 0)
                return 2;
        } else if (!strcmp(argv[i], "--device") || !strcmp(argv[i], "-D")) {
            const char *d = i + 1 < argc ? argv[++i] : "";
            if (strcmp(d, "cpu") && strcmp(d, "cuda")) {
                fprintf(stderr, "--device must be cpu or cuda, got '%s'\n", d);
                return 2;
            }
            use_cuda = !strcmp(d, "cuda");
        } else {
            usage(stderr);
            return 2;
        }
    }
    char why[128];
    if (dp && n_counts == 3) /* default: tp sizes 1, 2 and 4 */
        for (int c = 0; c < n_counts; c++)
            rank_counts[c] *= dp;
    if (!use_mpi && bad_layout(rank_counts[0], dp, why, sizeof why)) {
        fprintf(stderr, "%s\n", why);
        return 2;
    }
    int max_ranks = 1;
    for (int c = 0; c < n_counts; c++)
        max_ranks = rank_counts[c] > max_ranks ? rank_counts[c] : max_ranks;
    const int device_check = check_device(use_cuda, use_mpi, max_ranks);
    if (device_check != 0)
        return device_check;

    /* -b mpi: this process is one rank of the MPI world (under mpirun); the
     * TP runs use every process, the reference runs on one thread of each,
     * and the first process prints and compares */
    tp_comm *world = NULL;
    bool reporter = true;
    if (use_mpi) {
        tp_status st = tp_comm_create_world("mpi", NULL, &world);
        if (st != TP_OK) {
            fprintf(stderr, "tp_comm_create_world(\"mpi\"): %s: %s\n", tp_status_name(st),
                    tp_last_error());
            return 1;
        }
        if (bad_layout(tp_comm_size(world), dp, why, sizeof why)) {
            fprintf(stderr, "MPI world of %d processes: %s\n", tp_comm_size(world), why);
            tp_comm_free(world);
            return 2;
        }
        rank_counts[0] = tp_comm_size(world);
        n_counts = 1;
        reporter = tp_comm_rank(world) == 0;
        if (!reporter && !freopen("/dev/null", "w", stdout)) {
            fprintf(stderr, "cannot silence stdout on rank %d\n", tp_comm_rank(world));
            tp_comm_free(world);
            return 1;
        }
    }

    if (g_fsdp && !dp) {
        fprintf(stderr, "--fsdp shards over the \"dp\" dim: add -d DP\n");
        return 2;
    }
    if (check_resume && (use_mpi || save_dir || load_dir || 2 * steps > MAX_STEPS)) {
        fprintf(stderr,
                "--resume-check runs threads and a checkpoint of its own (not with -b "
                "mpi, --save or --load) for 2 x STEPS <= %d steps\n",
                MAX_STEPS);
        tp_comm_free(world);
        return 2;
    }
    if (check_resume || save_dir || load_dir) {
        /* one TP plan at the (largest) rank count */
        const run base = {.mode = MODE_TP,
                          .dtype = g_dtype,
                          .cuda = use_cuda,
                          .ranks = rank_counts[n_counts - 1],
                          .dp = dp,
                          .steps = steps,
                          .save_dir = save_dir,
                          .load_dir = load_dir};
        int rc = check_resume ? resume_check(&base) : checkpoint_run(world, &base);
        tp_comm_free(world);
        return rc;
    }

    static run runs[MAX_RUNS];
    int nruns = 0;
    runs[nruns++] =
        (run){.mode = MODE_NONE, .dtype = g_dtype, .cuda = use_cuda, .ranks = 1, .steps = steps};
    for (int c = 0; c < n_counts; c++)
        for (int m = MODE_TP; m <= MODE_SP; m++)
            runs[nruns++] = (run){.mode = (run_mode)m,
                                  .dtype = g_dtype,
                                  .cuda = use_cuda,
                                  .ranks = rank_counts[c],
                                  .dp = dp,
                                  .steps = steps};

    printf("libtp example: decoder-only transformer, tensor + sequence parallel\n"
           "vocab %d, dim %d, %d heads x %d, ffn %d, %d layers, seq %d, batch %d; "
           "Adam lr %g, %d steps, %s on %s%s\n"
           "every run must match the 1-rank run without TP (rtol %g, atol %g; parameters: atol "
           "%g)\n\n",
           VOCAB, DIM, HEADS, HEAD_DIM, FFN, LAYERS, SEQ, BATCH, LR, steps, tp_dtype_name(g_dtype),
           use_cuda ? "cuda" : "the cpu", g_nccl ? " (nccl)" : "", RTOL, ATOL, param_atol(steps));
    if (use_cuda)
        printf("(%d CUDA device%s: rank r on cuda:(r %% %d); the 1-rank run also against the "
               "CPU)\n\n",
               tp_cuda_device_count(), tp_cuda_device_count() > 1 ? "s" : "",
               tp_cuda_device_count());
    printf("%-6s %5s ", "plan", dp ? "dpxtp" : "ranks");
    for (int s = 0; s < steps; s++)
        printf(" %6s %-2d", "loss", s);
    printf("  %-10s %-11s collectives in step 0 (rank 0)\n", "max|dloss|", "max|dparam|");

    bool all_ok = true;
    double worst_loss = 0.0, worst_param = 0.0;
    int table_run = -1;
    for (int i = 0; i < nruns; i++) {
        run *r = &runs[i];
        r->status = world && r->mode != MODE_NONE ? transformer_rank(world, r)
                                                    : tp_run_local(r->ranks, transformer_rank, r);
        if (r->status != TP_OK) {
            char rk[16];
            fprintf(stderr, "%s on %s ranks failed: %s: %s\n", mode_name[r->mode],
                    ranks_str(r, rk, sizeof rk), tp_status_name(r->status), tp_last_error());
            all_ok = false;
            if (i == 0)
                break; /* nothing to compare with */
            continue;
        }
        char rk[16];
        printf("%-6s %5s ", mode_name[r->mode], ranks_str(r, rk, sizeof rk));
        for (int s = 0; s < steps; s++)
            printf(" %9.6f", r->loss[s]);
        if (i > 0) {
            if (reporter) /* the other processes hold no parameters */
                compare(r, &runs[0], RTOL, ATOL);
            else
                r->ok = true;
            printf("  %-10.2e %-11.2e", r->loss_diff, r->param_diff);
            all_ok = all_ok && r->ok;
            worst_loss = r->loss_diff > worst_loss ? r->loss_diff : worst_loss;
            worst_param = r->param_diff > worst_param ? r->param_diff : worst_param;
        } else {
            printf("  %-10s %-11s", "(reference)", "");
        }
        char fwd[96], bwd[96];
        printf(" fwd %s; bwd %s", kinds_str(r->debug, TP_COMM_DEBUG_GLOBAL, TP_PHASE_FORWARD,
                                              fwd, sizeof fwd),
               kinds_str(r->debug, TP_COMM_DEBUG_GLOBAL, TP_PHASE_BACKWARD, bwd, sizeof bwd));
        if (r->dp && !g_fsdp) {
            /* the DDP's all_reduces, as the counter saw them: one per bucket */
            const int64_t dp_ar =
                scope_count(r->debug, UNSCOPED, TP_PHASE_BACKWARD, TP_COLL_ALL_REDUCE);
            printf(" (dp: ar %lld)", (long long)dp_ar);
            if (dp_ar != r->dp_buckets) {
                printf(" != the DDP's %d buckets", r->dp_buckets);
                r->ok = false;
                all_ok = false;
            }
        }
        printf("%s\n", i > 0 && !r->ok ? "  MISMATCH" : "");
        fflush(stdout);
        table_run = i;
    }

    if (table_run >= 0 && print_comm_table(&runs[table_run]) != TP_OK)
        all_ok = false;
    for (int i = 0; all_tables && i < nruns; i++) {
        if (!runs[i].debug)
            continue;
        char rk[16];
        printf("\ntp_comm_debug_write_table of training step 0, %s on %s rank%s (rank 0):\n",
               mode_name[runs[i].mode], ranks_str(&runs[i], rk, sizeof rk),
               runs[i].ranks > 1 ? "s" : "");
        fflush(stdout);
        if (tp_comm_debug_write_table(runs[i].debug, stdout) != TP_OK) {
            fprintf(stderr, "tp_comm_debug_write_table: %s\n", tp_last_error());
            all_ok = false;
        }
    }

    if (g_dtype != TP_F32 && runs[0].status == TP_OK && reporter)
        all_ok = final_loss_vs_f32(&runs[0]) && all_ok;
    if (use_cuda && runs[0].status == TP_OK) {
        all_ok = gpu_vs_cpu(&runs[0]) && all_ok;
        print_device_summary(runs, nruns);
    }

    printf("\n%s: %d runs; max |diff| vs the 1-rank run: loss %.2e, parameters %.2e "
           "(rtol %g, atol %g)\n",
           all_ok ? "PASS" : "FAIL", nruns, worst_loss, worst_param, RTOL, ATOL);
    for (int i = 0; i < nruns; i++)
        run_free(&runs[i]);
    tp_comm_free(world); /* the last mpi communicator: finalizes MPI */
    return all_ok ? 0 : 1;
}
