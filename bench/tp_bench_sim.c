/*
 * tp-bench-sim: one training step of a Llama-shaped decoder (RMSNorm,
 * attention with colwise wq/wk/wv and rowwise wo, a gated GELU MLP with
 * colwise w1/w3 and rowwise w2, residuals; sequence parallel) played as one
 * rank of a simulated dp x tp world on meta tensors (docs/sim.md): the
 * model is built on the meta device, parallelized over the "tp" dim of a
 * 2-D mesh, wrapped in a DDP over "dp", run forward and backward and
 * stepped with Adam. Prints the time of each phase, the collectives the
 * step issued (count and bytes per kind, as comm-debug records them) and
 * the process's peak RSS.
 *
 *   tp-bench-sim [--layers 80] [--hidden 8192] [--ffn 28672] [--heads 64]
 *                [--seq 4096] [--batch 1] [--dp 64] [--tp 8] [--rank 0]
 *
 * The defaults are the 70B configuration of issue 19. The loss is the mean
 * of the last block's output (no vocabulary).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "bench_util.h"

typedef struct cfg {
    int layers, hidden, ffn, heads, seq, batch, dp, tp, rank;
} cfg;

#define SIM_TRY(expr)                                                                      \
    do {                                                                                   \
        tp_status try_st_ = (expr);                                                        \
        if (try_st_ != TP_OK) {                                                            \
            fprintf(stderr, "tp-bench-sim: %s: %s (%s)\n", #expr, tp_status_name(try_st_), \
                    tp_last_error());                                                      \
            return try_st_;                                                                \
        }                                                                                  \
    } while (0)

/* [b, s, h/tp] local -> [b, nh/tp, s, hd] */
static tp_status heads_of(tp_tensor *x, int64_t hd, tp_tensor **out)
{
    const int64_t *s = tp_tensor_shape(x);
    int64_t sh[4] = {s[0], s[1], s[2] / hd, hd};
    tp_tensor *r = NULL;
    SIM_TRY(tp_reshape(x, 4, sh, &r));
    tp_status st = tp_transpose(r, 1, 2, out);
    tp_tensor_release(r);
    return st;
}

static tp_status call(tp_module *self, const char *name, tp_tensor *x, tp_tensor **out)
{
    return tp_module_call(tp_module_child(self, name), x, out);
}

/* x + wo(sdpa(wq(n), wk(n), wv(n))), n = attention_norm(x) */
static tp_status attention(tp_module *self, tp_tensor *x, int64_t hd, tp_tensor **out)
{
    tp_tensor *n = NULL, *p[3] = {NULL}, *h[3] = {NULL}, *a = NULL, *t = NULL, *f = NULL, *o = NULL;
    static const char *const names[3] = {"wq", "wk", "wv"};
    tp_status st = call(self, "attention_norm", x, &n);
    for (int i = 0; i < 3 && st == TP_OK; i++) {
        st = call(self, names[i], n, &p[i]);
        if (st == TP_OK)
            st = heads_of(p[i], hd, &h[i]);
    }
    if (st == TP_OK)
        st = tp_scaled_dot_product_attention(h[0], h[1], h[2], true, 0.0, &a);
    if (st == TP_OK)
        st = tp_transpose(a, 1, 2, &t);
    const int64_t *s = tp_tensor_shape(p[0]);
    if (st == TP_OK)
        st = tp_reshape(t, 3, (int64_t[]){s[0], s[1], s[2]}, &f);
    if (st == TP_OK)
        st = call(self, "wo", f, &o);
    if (st == TP_OK)
        st = tp_add(x, o, out);
    tp_tensor *all[] = {n, p[0], p[1], p[2], h[0], h[1], h[2], a, t, f, o};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        tp_tensor_release(all[i]);
    return st;
}

/* x + w2(gelu(w1(n)) * w3(n)), n = ffn_norm(x) */
static tp_status feed_forward(tp_module *self, tp_tensor *x, tp_tensor **out)
{
    tp_tensor *n = NULL, *a = NULL, *g = NULL, *b = NULL, *m = NULL, *o = NULL;
    tp_status st = call(self, "ffn_norm", x, &n);
    if (st == TP_OK)
        st = call(self, "w1", n, &a);
    if (st == TP_OK)
        st = tp_gelu(a, TP_GELU_TANH, &g);
    if (st == TP_OK)
        st = call(self, "w3", n, &b);
    if (st == TP_OK)
        st = tp_mul(g, b, &m);
    if (st == TP_OK)
        st = call(self, "w2", m, &o);
    if (st == TP_OK)
        st = tp_add(x, o, out);
    tp_tensor *all[] = {n, a, g, b, m, o};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        tp_tensor_release(all[i]);
    return st;
}

static tp_status block_forward(tp_module *self, int nargs, tp_tensor *const *args, int nkw,
                               const tp_kwarg *kw, tp_tensor **out)
{
    const cfg *c = tp_module_ctx(self);
    tp_tensor *h = NULL;
    SIM_TRY(attention(self, args[0], c->hidden / c->heads, &h));
    tp_status st = feed_forward(self, h, out);
    tp_tensor_release(h);
    return st;
}

static tp_status add(tp_module *m, const char *name, tp_status made, tp_module **c)
{
    if (made != TP_OK)
        return made;
    tp_status st = tp_module_add_child(m, name, *c);
    if (st != TP_OK)
        tp_module_free(*c);
    return st;
}

static tp_status make_block(cfg *c, tp_module **out)
{
    tp_module *b = NULL, *m[9] = {NULL};
    int64_t h = c->hidden, f = c->ffn;
    SIM_TRY(tp_nn_custom_create("TransformerBlock", block_forward, c, NULL, &b));
    tp_status st = add(b, "attention_norm", tp_nn_rms_norm_create(h, true, 1e-5, &m[0]), &m[0]);
    const char *lin[7] = {"wq", "wk", "wv", "wo", "w1", "w3", "w2"};
    const int64_t in[7] = {h, h, h, h, h, h, f}, outf[7] = {h, h, h, h, f, f, h};
    for (int i = 0; i < 7 && st == TP_OK; i++)
        st = add(b, lin[i], tp_nn_linear_create(in[i], outf[i], false, &m[1 + i]), &m[1 + i]);
    if (st == TP_OK)
        st = add(b, "ffn_norm", tp_nn_rms_norm_create(h, true, 1e-5, &m[8]), &m[8]);
    if (st != TP_OK) {
        tp_module_free(b);
        return st;
    }
    *out = b;
    return TP_OK;
}

static tp_status make_model(cfg *c, tp_module **out)
{
    tp_module *seq = NULL;
    SIM_TRY(tp_nn_sequential_create(&seq));
    tp_status st = TP_OK;
    for (int l = 0; l < c->layers && st == TP_OK; l++) {
        char name[16];
        tp_module *b = NULL;
        snprintf(name, sizeof name, "%d", l);
        st = add(seq, name, make_block(c, &b), &b);
    }
    if (st != TP_OK) {
        tp_module_free(seq);
        return st;
    }
    *out = seq;
    return TP_OK;
}

/* Megatron-style sequence parallel plan for every block */
static tp_status parallelize(tp_module *model, tp_mesh *tpm)
{
    tp_style *col = NULL, *row = NULL, *sp = NULL;
    tp_colwise_options co = {.input_layouts = tp_layout_of(tp_shard(1))};
    tp_rowwise_options ro = {.output_layouts = tp_layout_of(tp_shard(1))};
    tp_status st = tp_colwise_parallel_create(&co, &col);
    if (st == TP_OK)
        st = tp_rowwise_parallel_create(&ro, &row);
    if (st == TP_OK)
        st = tp_sequence_parallel_create(NULL, &sp);
    if (st == TP_OK) {
        tp_plan_entry plan[] = {
            {"*.attention_norm", sp}, {"*.wq", col}, {"*.wk", col}, {"*.wv", col}, {"*.wo", row},
            {"*.ffn_norm", sp},       {"*.w1", col}, {"*.w3", col}, {"*.w2", row}};
        st = tp_parallelize_module(model, tpm, (int)(sizeof plan / sizeof *plan), plan, NULL);
    }
    tp_style_free(col);
    tp_style_free(row);
    tp_style_free(sp);
    return st;
}

static void report(const tp_comm_debug *dbg)
{
    for (int k = 0; k < TP_COLL_KIND_COUNT; k++) {
        int64_t n = tp_comm_debug_count(dbg, (tp_coll_kind)k);
        if (n)
            printf("  %-15s %8lld  %14.3f MiB\n", tp_coll_kind_name((tp_coll_kind)k), (long long)n,
                   (double)tp_comm_debug_bytes(dbg, (tp_coll_kind)k) / (1024.0 * 1024.0));
    }
}

static tp_status run(cfg *c)
{
    double t0 = bench_now_s();
    tp_comm *world = NULL;
    tp_mesh *mesh = NULL, *tpm = NULL;
    tp_module *model = NULL;
    tp_ddp *ddp = NULL;
    tp_adam *opt = NULL;
    tp_comm_debug *dbg = NULL;
    tp_tensor *x = NULL, *y = NULL, *loss = NULL;
    const char *names[2] = {"dp", "tp"}, *tpn = "tp";
    tp_sim_options so = {.world_size = c->dp * c->tp, .rank = c->rank};
    SIM_TRY(tp_comm_create_world("sim", &so, &world));
    SIM_TRY(tp_mesh_create(world, 2, (int64_t[]){c->dp, c->tp}, names, &mesh));
    SIM_TRY(tp_mesh_slice(mesh, 1, &tpn, &tpm));
    SIM_TRY(tp_nn_set_default_device(TP_META));
    SIM_TRY(make_model(c, &model));
    SIM_TRY(tp_nn_set_default_device(TP_CPU));
    SIM_TRY(tp_module_init(model, 1));
    double t1 = bench_now_s();
    SIM_TRY(parallelize(model, tpm));
    tp_ddp_options dopt = {.params_everywhere = true};
    if (c->dp > 1)
        SIM_TRY(tp_ddp_create(model, tp_mesh_comm(mesh, 0), &dopt, &ddp));
    SIM_TRY(tp_adam_create(model, 1e-4, 0.9, 0.95, 1e-8, &opt));
    int64_t xs[3] = {c->batch, c->seq / c->tp, c->hidden};
    SIM_TRY(tp_tensor_empty(TP_F32, TP_META, 3, xs, &x));
    double t2 = bench_now_s();
    SIM_TRY(tp_comm_debug_create(&dbg));
    SIM_TRY(tp_comm_debug_begin(dbg));
    SIM_TRY(tp_module_call(model, x, &y));
    SIM_TRY(tp_mean_all(y, &loss));
    double t3 = bench_now_s();
    SIM_TRY(tp_backward(loss, NULL));
    double t4 = bench_now_s();
    SIM_TRY(tp_adam_step(opt));
    double t5 = bench_now_s();
    SIM_TRY(tp_comm_debug_end(dbg));
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    printf("sim step: %d layers, hidden %d, ffn %d, heads %d, seq %d, batch %d; dp %d x tp %d, "
           "rank %d of %d\n",
           c->layers, c->hidden, c->ffn, c->heads, c->seq, c->batch, c->dp, c->tp, c->rank,
           c->dp * c->tp);
    printf("  build %.3f s, parallelize+ddp %.3f s, forward %.3f s, backward %.3f s, "
           "step %.3f s; total %.3f s\n",
           t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t5 - t0);
    printf("  peak RSS %.1f MiB\n", (double)ru.ru_maxrss / 1024.0);
    printf("collectives of the step (this rank):\n");
    report(dbg);
    tp_comm_debug_free(dbg);
    tp_tensor_release(loss);
    tp_tensor_release(y);
    tp_tensor_release(x);
    tp_adam_free(opt);
    tp_ddp_free(ddp);
    tp_module_free(model);
    tp_mesh_free(tpm);
    tp_mesh_free(mesh);
    return tp_comm_free(world);
}

int main(int argc, char **argv)
{
    cfg c = {80, 8192, 28672, 64, 4096, 1, 64, 8, 0};
    struct {
        const char *flag;
        int *v;
    } opts[] = {{"--layers", &c.layers}, {"--hidden", &c.hidden}, {"--ffn", &c.ffn},
                {"--heads", &c.heads},   {"--seq", &c.seq},       {"--batch", &c.batch},
                {"--dp", &c.dp},         {"--tp", &c.tp},         {"--rank", &c.rank}};
    for (int i = 1; i < argc; i++) {
        size_t k = 0;
        while (k < sizeof opts / sizeof *opts && strcmp(argv[i], opts[k].flag) != 0)
            k++;
        if (k == sizeof opts / sizeof *opts || i + 1 == argc ||
            !bench_parse_int(argv[++i], 0, 1 << 30, opts[k].v)) {
            fprintf(stderr, "usage: tp-bench-sim [--layers N] [--hidden N] [--ffn N] [--heads N] "
                            "[--seq N] [--batch N] [--dp N] [--tp N] [--rank R]\n");
            return 2;
        }
    }
    if (c.heads <= 0 || c.tp <= 0 || c.hidden % c.heads || c.heads % c.tp || c.seq % c.tp) {
        fprintf(stderr, "tp-bench-sim: heads must divide hidden, tp heads and seq\n");
        return 2;
    }
    return run(&c) == TP_OK ? 0 : 1;
}
