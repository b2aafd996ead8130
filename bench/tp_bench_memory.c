/*
 * tp-bench-memory: what a tensor-parallel model holds per rank, measured with
 * tp_memory_stats, at every rank count of -g (default 1,2,4).
 *
 * Models (-m):
 *   mlp    the Megatron MLP block Linear(H, 4H) -> GELU(tanh) -> Linear(4H, H),
 *          ColwiseParallel + RowwiseParallel (as tp-bench-layers -l mlp)
 *   block  a pre-norm transformer block, the construction of
 *          examples/transformer.c's TransformerBlock at a larger size:
 *          x + attention(LayerNorm(x)), then h + FeedForward(LayerNorm(h));
 *          attention.w[qkv] (no bias) and feed_forward.w1 ColwiseParallel,
 *          attention.wo and feed_forward.w2 RowwiseParallel, the norms
 *          replicated (the TP plan of PyTorch's tutorial, without SP)
 *
 * A run (one per rank count, ranks as threads): every rank builds the model,
 * takes its input (replicated) and an Adam optimizer, then makes -s training
 * steps (forward, loss = sum, backward, Adam step, zero_grad). Counted on rank
 * 0: its local parameter bytes and, after the last backward, its local
 * gradient bytes. Measured process-wide (tp_memory_stats; the ranks are
 * threads of this process, so the figures are summed over them and divided by
 * W for a rank's share): `allocated` after the build, after the first step
 * (parameters + Adam's two moments per parameter + the input), and the peak
 * of `allocated` over the last step (the steady state: gradients and
 * activations on top). Sharded parameters, gradients and Adam moments are 1/W
 * per rank; what is replicated (the rowwise biases, the norms, the input and
 * the activations between the parallel regions) is not.
 *
 * tp-bench-memory --help lists the options.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <tp.h>

#include "bench_util.h"

enum { M_MLP, M_BLOCK, M_COUNT };
static const char *model_names[M_COUNT] = {"mlp", "block"};

#define MAX_W 8
#define MIB (1024.0 * 1024.0)

typedef struct mem_point {
    int model;
    int64_t tokens, hidden, heads, head_dim, steps;
    /* out (rank 0) */
    size_t params, grads;                  /* rank 0's local bytes, counted */
    size_t built, stepped, peak, baseline; /* process-wide allocated bytes */
    double step_s;                         /* the last step, slowest rank */
} mem_point;

/* ---- the transformer block (examples/transformer.c's, sized by the options) */

typedef struct block_cfg {
    int64_t head_dim;
} block_cfg;

/* [B, S, lh * hd] -> [B, lh, S, hd] */
static tp_status split_heads(tp_tensor *x, int64_t hd, tp_tensor **out)
{
    tp_tensor *v = NULL;
    const int64_t shape[4] = {tp_tensor_size(x, 0), tp_tensor_size(x, 1), tp_tensor_size(x, 2) / hd,
                              hd};
    tp_status st = tp_reshape(x, 4, shape, &v);
    if (st == TP_OK)
        st = tp_transpose(v, 1, 2, out);
    tp_tensor_release(v);
    return st;
}

/* Attention over this rank's heads: wq, wk, wv return local [B, S, lh * hd]. */
static tp_status attention_forward(tp_module *self, int nargs, tp_tensor *const *args, int nkw,
                                   const tp_kwarg *kw, tp_tensor **out)
{
    (void)nargs, (void)nkw, (void)kw;
    const block_cfg *cfg = tp_module_ctx(self);
    tp_tensor *t[9] = {0}; /* q k v qh kh vh o ot merged */
    tp_status st = TP_OK;
    const char *w[3] = {"wq", "wk", "wv"};
    for (int i = 0; i < 3 && st == TP_OK; i++)
        st = tp_module_call(tp_module_child(self, w[i]), args[0], &t[i]);
    for (int i = 0; i < 3 && st == TP_OK; i++)
        st = split_heads(t[i], cfg->head_dim, &t[3 + i]);
    if (st == TP_OK)
        st = tp_scaled_dot_product_attention(t[3], t[4], t[5], true, 0.0, &t[6]);
    if (st == TP_OK)
        st = tp_transpose(t[6], 1, 2, &t[7]);
    if (st == TP_OK) {
        const int64_t shape[3] = {tp_tensor_size(t[0], 0), tp_tensor_size(t[0], 1),
                                  tp_tensor_size(t[0], 2)};
        st = tp_reshape(t[7], 3, shape, &t[8]);
    }
    if (st == TP_OK)
        st = tp_module_call(tp_module_child(self, "wo"), t[8], out);
    for (int i = 0; i < 9; i++)
        tp_tensor_release(t[i]);
    return st;
}

/* FeedForward = w2(gelu(w1(x))); TransformerBlock: the two residual branches. */
static tp_status feed_forward_forward(tp_module *self, int nargs, tp_tensor *const *args, int nkw,
                                      const tp_kwarg *kw, tp_tensor **out)
{
    (void)nargs, (void)nkw, (void)kw;
    tp_tensor *h = NULL, *a = NULL;
    tp_status st = tp_module_call(tp_module_child(self, "w1"), args[0], &h);
    if (st == TP_OK)
        st = tp_module_call(tp_module_child(self, "gelu"), h, &a);
    if (st == TP_OK)
        st = tp_module_call(tp_module_child(self, "w2"), a, out);
    tp_tensor_release(a);
    tp_tensor_release(h);
    return st;
}

static tp_status block_forward(tp_module *self, int nargs, tp_tensor *const *args, int nkw,
                               const tp_kwarg *kw, tp_tensor **out)
{
    (void)nargs, (void)nkw, (void)kw;
    tp_tensor *t[5] = {0}; /* n1 a h n2 f */
    tp_status st = tp_module_call(tp_module_child(self, "attention_norm"), args[0], &t[0]);
    if (st == TP_OK)
        st = tp_module_call(tp_module_child(self, "attention"), t[0], &t[1]);
    if (st == TP_OK)
        st = tp_add(args[0], t[1], &t[2]);
    if (st == TP_OK)
        st = tp_module_call(tp_module_child(self, "ffn_norm"), t[2], &t[3]);
    if (st == TP_OK)
        st = tp_module_call(tp_module_child(self, "feed_forward"), t[3], &t[4]);
    if (st == TP_OK)
        st = tp_add(t[2], t[4], out);
    for (int i = 0; i < 5; i++)
        tp_tensor_release(t[i]);
    return st;
}

/* Creates `child` with st's status and hangs it under parent (freed when not taken). */
static tp_status adopt(tp_status st, tp_module *parent, const char *name, tp_module *child)
{
    if (st == TP_OK)
        st = tp_module_add_child(parent, name, child);
    if (st != TP_OK)
        tp_module_free(child);
    return st;
}

static tp_status build_block(const mem_point *p, tp_module **out)
{
    int64_t D = p->hidden, A = p->heads * p->head_dim;
    tp_module *b = NULL, *attn = NULL, *ff = NULL, *m = NULL;
    block_cfg *cfg = malloc(sizeof *cfg);
    if (!cfg)
        return TP_ERR_NO_MEMORY;
    cfg->head_dim = p->head_dim;
    tp_status st = tp_nn_custom_create("TransformerBlock", block_forward, NULL, NULL, &b);
    if (st == TP_OK)
        st = tp_nn_custom_create("Attention", attention_forward, cfg, free, &attn);
    if (st != TP_OK) { /* cfg is ours until attn takes it */
        if (!attn)
            free(cfg);
        tp_module_free(b);
        return st;
    }
    st = tp_nn_layer_norm_create(D, true, 1e-5, &m), st = adopt(st, b, "attention_norm", m);
    const char *w[4] = {"wq", "wk", "wv", "wo"};
    for (int i = 0; i < 4; i++)
        if (st == TP_OK)
            st = tp_nn_linear_create(i < 3 ? D : A, i < 3 ? A : D, false, &m),
            st = adopt(st, attn, w[i], m);
    st = adopt(st, b, "attention", attn);
    if (st == TP_OK)
        st = tp_nn_layer_norm_create(D, true, 1e-5, &m), st = adopt(st, b, "ffn_norm", m);
    if (st == TP_OK)
        st = tp_nn_custom_create("FeedForward", feed_forward_forward, NULL, NULL, &ff);
    if (st == TP_OK)
        st = tp_nn_linear_create(D, 4 * D, true, &m), st = adopt(st, ff, "w1", m);
    if (st == TP_OK)
        st = tp_nn_gelu_create(TP_GELU_TANH, &m), st = adopt(st, ff, "gelu", m);
    if (st == TP_OK)
        st = tp_nn_linear_create(4 * D, D, true, &m), st = adopt(st, ff, "w2", m);
    if (st == TP_OK || ff)
        st = adopt(st, b, "feed_forward", ff);
    if (st != TP_OK) {
        tp_module_free(b);
        return st;
    }
    *out = b;
    return TP_OK;
}

static tp_status build_mlp(const mem_point *p, tp_module **out)
{
    int64_t H = p->hidden;
    tp_module *s = NULL, *m = NULL;
    tp_status st = tp_nn_sequential_create(&s);
    if (st == TP_OK)
        st = tp_nn_linear_create(H, 4 * H, true, &m), st = adopt(st, s, "0", m);
    if (st == TP_OK)
        st = tp_nn_gelu_create(TP_GELU_TANH, &m), st = adopt(st, s, "1", m);
    if (st == TP_OK)
        st = tp_nn_linear_create(4 * H, H, true, &m), st = adopt(st, s, "2", m);
    if (st != TP_OK) {
        tp_module_free(s);
        return st;
    }
    *out = s;
    return TP_OK;
}

/* The model, parallelized over mesh when W > 1, initialized from seed 42. */
static tp_status build(const mem_point *p, tp_mesh *mesh, int W, tp_module **out)
{
    tp_module *m = NULL;
    tp_style *col = NULL, *row = NULL;
    tp_status st = p->model == M_MLP ? build_mlp(p, &m) : build_block(p, &m);
    if (st == TP_OK && W > 1) {
        st = tp_colwise_parallel_create(NULL, &col);
        if (st == TP_OK)
            st = tp_rowwise_parallel_create(NULL, &row);
        const tp_plan_entry mlp[] = {{"0", col}, {"2", row}};
        const tp_plan_entry blk[] = {{"attention.w[qkv]", col},
                                     {"attention.wo", row},
                                     {"feed_forward.w1", col},
                                     {"feed_forward.w2", row}};
        const tp_parallelize_options po = {.src_data_rank = TP_SRC_DATA_RANK_NONE};
        if (st == TP_OK)
            st = p->model == M_MLP ? tp_parallelize_module(m, mesh, 2, mlp, &po)
                                   : tp_parallelize_module(m, mesh, 4, blk, &po);
    }
    if (st == TP_OK)
        st = tp_module_init(m, 42);
    tp_style_free(col);
    tp_style_free(row);
    if (st != TP_OK) {
        tp_module_free(m);
        return st;
    }
    *out = m;
    return TP_OK;
}

/* ---- a run ------------------------------------------------------------------ */

static tp_status count_local(const char *fqn, tp_tensor *param, void *ctx)
{
    (void)fqn;
    size_t *sum = ctx;
    tp_tensor *g = tp_tensor_grad(param);
    if (sum[2] == 0) { /* parameters */
        tp_tensor *l = tp_tensor_is_dtensor(param) ? tp_dtensor_local(param) : param;
        sum[0] += tp_tensor_nbytes(l);
    } else if (g) { /* gradients */
        tp_tensor *l = tp_tensor_is_dtensor(g) ? tp_dtensor_local(g) : g;
        sum[1] += tp_tensor_nbytes(l);
    }
    return TP_OK;
}

static size_t allocated_now(void)
{
    tp_memory_info mi = {0};
    return tp_memory_stats(TP_CPU, &mi) == TP_OK ? mi.allocated : 0;
}

static size_t peak_now(void)
{
    tp_memory_info mi = {0};
    return tp_memory_stats(TP_CPU, &mi) == TP_OK ? mi.peak_allocated : 0;
}

/* forward, loss = sum, backward (counting rank 0's gradients when asked),
 * Adam step, zero_grad */
static tp_status train_step(tp_module *m, tp_adam *adam, tp_tensor *x, size_t *count)
{
    tp_tensor *y = NULL, *loss = NULL;
    tp_status st = tp_module_call(m, x, &y);
    if (st == TP_OK)
        st = tp_sum_all(y, &loss);
    if (st == TP_OK && tp_tensor_is_dtensor(loss)) {
        tp_tensor *l = NULL;
        st = tp_dtensor_to_local(loss, 0, NULL, &l);
        tp_tensor_release(loss);
        loss = l;
    }
    if (st == TP_OK)
        st = tp_backward(loss, NULL);
    if (st == TP_OK && count)
        st = tp_module_named_parameters(m, count_local, count);
    if (st == TP_OK)
        st = tp_adam_step(adam);
    tp_module_zero_grad(m);
    tp_tensor_release(loss);
    tp_tensor_release(y);
    return st;
}

static tp_status run_rank(tp_comm *w, void *arg)
{
    mem_point *p = arg;
    int W = tp_comm_size(w), r = tp_comm_rank(w);
    int64_t Wl = W;
    tp_status st = TP_OK;
    tp_mesh *mesh = NULL;
    tp_module *m = NULL;
    tp_adam *adam = NULL;
    tp_tensor *x = NULL;
    size_t count[3] = {0};
    TRY(tp_barrier(w, NULL));
    if (r == 0) {
        p->baseline = allocated_now();
        TRY(tp_memory_reset_peak(TP_CPU));
    }
    TRY(tp_barrier(w, NULL)); /* the other ranks wait while rank 0 reads the process */
    TRY(tp_mesh_create(w, 1, &Wl, (const char *[]){"tp"}, &mesh));
    TRY(build(p, mesh, W, &m));
    TRY(tp_module_named_parameters(m, count_local, count));
    TRY(tp_barrier(w, NULL));
    if (r == 0)
        p->built = allocated_now();
    TRY(tp_barrier(w, NULL));
    int64_t xs[3] = {1, p->tokens, p->hidden}; /* mlp: [T, H]; block: [1, T, H] */
    int nd = p->model == M_MLP ? 2 : 3;
    TRY(tp_tensor_zeros(TP_F32, TP_CPU, nd, xs + 3 - nd, &x));
    TRY(tp_tensor_fill_random(x, TP_RNG_UNIFORM, -1, 1, 7, NULL, NULL));
    TRY(tp_adam_create(m, 1e-4, 0, 0, 0, &adam));
    for (int64_t s = 0; s < p->steps; s++) {
        bool last = s == p->steps - 1;
        TRY(tp_barrier(w, NULL));
        if (r == 0 && s == 1) {
            p->stepped = allocated_now();
            TRY(tp_memory_reset_peak(TP_CPU));
        }
        TRY(tp_barrier(w, NULL));
        double t0 = bench_now_s();
        count[2] = 1;
        TRY(train_step(m, adam, x, last && r == 0 ? count : NULL));
        TRY(tp_barrier(w, NULL));
        double dt = bench_now_s() - t0;
        if (r == 0 && last) {
            p->peak = peak_now();
            p->step_s = dt;
        }
        TRY(tp_barrier(w, NULL));
    }
    if (r == 0) {
        p->params = count[0];
        p->grads = count[1];
        if (p->steps == 1) /* no steady step: the first one's figures */
            p->stepped = allocated_now();
    }
out:
    tp_adam_free(adam);
    tp_tensor_release(x);
    tp_module_free(m);
    tp_mesh_free(mesh);
    return st;
}

/* ---- command line and table ---------------------------------------------------- */

typedef struct opts {
    bool models[M_COUNT];
    int64_t ranks[MAX_W];
    int nr, steps;
    int64_t tokens, hidden, heads, head_dim;
    bool tokens_given, hidden_given;
    const char *csv;
} opts;

static void usage(FILE *f)
{
    fprintf(f,
            "usage: tp-bench-memory [-m LIST] [-g LIST] [-t T] [-H H] [--heads N] [--head-dim D]\n"
            "                       [-s STEPS] [--csv FILE]\n"
            "\n"
            "Memory a tensor-parallel model holds per rank (tp_memory_stats): parameters,\n"
            "gradients, Adam moments and the peak of a training step, at each rank count.\n"
            "\n"
            "  -m LIST       mlp (Linear H->4H, GELU, Linear 4H->H), block (a     mlp,block\n"
            "                transformer block: attention + MLP, pre-norm)\n"
            "  -g LIST       rank counts (ranks as threads), each dividing 4H     1,2,4\n"
            "                (and the heads for block)\n"
            "  -t T          tokens                                               mlp 2048,\n"
            "                                                                     block 512\n"
            "  -H H          hidden size                                          mlp 2048,\n"
            "                                                                     block 1024\n"
            "  --heads N     attention heads of block                             16\n"
            "  --head-dim D  their size (heads x D need not be H)                 64\n"
            "  -s STEPS      training steps per run; the peak is the last one's   2\n"
            "  --csv FILE    also write the rows as CSV (one header row)\n"
            "  -h, --help    this text\n"
            "\n"
            "Exit status: 0 done; 2 a libtp call failed; 64 bad command line.\n");
}

static int parse_args(int argc, char **argv, opts *o)
{
    *o = (opts){.models = {true, true},
                .ranks = {1, 2, 4},
                .nr = 3,
                .steps = 2,
                .heads = 16,
                .head_dim = 64};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int n = 0;
        bool ok = v != NULL;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "-m") && v) {
            o->models[M_MLP] = o->models[M_BLOCK] = false;
            for (const char *s = v; ok && *s;) {
                size_t len = strcspn(s, ",");
                int k = 0;
                while (k < M_COUNT &&
                       (strlen(model_names[k]) != len || strncmp(s, model_names[k], len)))
                    k++;
                ok = k < M_COUNT;
                if (ok)
                    o->models[k] = true;
                s += len + (s[len] == ',');
            }
        } else if (!strcmp(a, "-g") && v) {
            o->nr = 0;
            for (const char *s = v; ok && *s;) {
                char *end;
                long long g = strtoll(s, &end, 10);
                ok = end != s && g >= 1 && g <= 64 && o->nr < MAX_W && (*end == ',' || !*end);
                if (ok)
                    o->ranks[o->nr++] = g;
                s = *end ? end + 1 : end;
            }
        } else if ((!strcmp(a, "-t") || !strcmp(a, "-H") || !strcmp(a, "--heads") ||
                    !strcmp(a, "--head-dim") || !strcmp(a, "-s")) &&
                   v) {
            ok = bench_parse_int(v, 1, 1 << 20, &n);
            if (!strcmp(a, "-t"))
                o->tokens = n, o->tokens_given = true;
            else if (!strcmp(a, "-H"))
                o->hidden = n, o->hidden_given = true;
            else if (!strcmp(a, "--heads"))
                o->heads = n;
            else if (!strcmp(a, "--head-dim"))
                o->head_dim = n;
            else
                o->steps = n;
        } else if (!strcmp(a, "--csv") && v) {
            o->csv = v;
        } else {
            fprintf(stderr, "tp-bench-memory: unknown option or missing value: '%s'\n", a);
            return 64;
        }
        if (!ok) {
            fprintf(stderr, "tp-bench-memory: %s '%s': bad value\n", a, v);
            return 64;
        }
        i++;
    }
    return -1;
}

static void print_row(FILE *csv, const mem_point *p, int64_t W, const mem_point *base)
{
    double w = (double)W, peak = (double)(p->peak - p->baseline) / w;
    double base_peak = base ? (double)(base->peak - base->baseline) : 0;
    double built = (double)(p->built - p->baseline) / w;
    double adam = (double)(p->stepped - p->built) / w;
    printf("%-6s %5lld %5lld %5lld %10.1f %10.1f %12.1f %12.1f %12.1f %9.3f %6.3f %8.0f\n",
           model_names[p->model], (long long)p->tokens, (long long)p->hidden, (long long)W,
           (double)p->params / MIB, (double)p->grads / MIB, built / MIB, adam / MIB, peak / MIB,
           base ? peak / base_peak : 1.0, 1.0 / w, p->step_s * 1e3);
    if (csv)
        fprintf(csv, "%s,%lld,%lld,%lld,%lld,%zu,%zu,%.0f,%.0f,%.0f,%.0f,%.4f,%.4f\n",
                model_names[p->model], (long long)p->tokens, (long long)p->hidden,
                (long long)(p->model == M_BLOCK ? p->heads : 0), (long long)W, p->params, p->grads,
                built, adam, peak, (double)(p->peak - p->baseline), base ? peak / base_peak : 1.0,
                p->step_s * 1e3);
}

int main(int argc, char **argv)
{
    opts o;
    int rc = parse_args(argc, argv, &o);
    if (rc >= 0)
        return rc;
    FILE *csv = NULL;
    if (o.csv) {
        csv = fopen(o.csv, "w");
        if (!csv) {
            perror(o.csv);
            return 64;
        }
        fprintf(csv,
                "model,tokens,hidden,heads,ranks,params_bytes,grads_bytes,built_bytes_per_rank,"
                "adam_bytes_per_rank,peak_bytes_per_rank,peak_bytes_total,peak_vs_1_rank,"
                "step_ms\n");
    }
    double load[3] = {0};
    bench_loadavg(load);
    printf("# tp-bench-memory: per rank = process-wide tp_memory_stats (ranks are threads) / W; "
           "load %.2f\n",
           load[0]);
    printf("# params, grads: rank 0's local tensors; built: allocated after building; adam: "
           "allocated after the first step minus built (moments + input); peak: the last step's "
           "peak allocated, above the run's start\n");
    printf("%-6s %5s %5s %5s %10s %10s %12s %12s %12s %9s %6s %8s\n", "model", "T", "H", "W",
           "params MiB", "grads MiB", "built MiB/rk", "adam MiB/rk", "peak MiB/rk", "peak/W=1",
           "1/W", "step ms");
    int status = 0;
    for (int mi = 0; mi < M_COUNT; mi++) {
        if (!o.models[mi])
            continue;
        mem_point base = {0};
        bool have_base = false;
        for (int ri = 0; ri < o.nr; ri++) {
            int64_t W = o.ranks[ri];
            mem_point p = {.model = mi, .steps = o.steps, .heads = o.heads, .head_dim = o.head_dim};
            p.tokens = o.tokens_given ? o.tokens : (mi == M_MLP ? 2048 : 512);
            p.hidden = o.hidden_given ? o.hidden : (mi == M_MLP ? 2048 : 1024);
            if ((4 * p.hidden) % W || (mi == M_BLOCK && p.heads % W)) {
                printf("# %s: %lld ranks skipped: they do not divide 4H%s\n", model_names[mi],
                       (long long)W, mi == M_BLOCK ? " and the heads" : "");
                continue;
            }
            tp_status st = tp_run_local((int)W, run_rank, &p);
            if (st != TP_OK) {
                fprintf(stderr, "tp-bench-memory: %s on %lld ranks: %s (%s)\n", model_names[mi],
                        (long long)W, tp_status_name(st), tp_last_error());
                status = 2;
                continue;
            }
            if (W == 1)
                base = p, have_base = true;
            print_row(csv, &p, W, have_base ? &base : NULL);
            fflush(stdout);
        }
    }
    if (csv)
        fclose(csv);
    return status;
}
