/* The Llama-shaped decoder of plan_model.h and the simulated step that
 * tp-plan and tp-bench-sim run. */
#include "plan_model.h"

#include <stdio.h>
#include <time.h>

#define PM_TRY(expr)               \
    do {                           \
        tp_status pm_st_ = (expr); \
        if (pm_st_ != TP_OK)       \
            return pm_st_;         \
    } while (0)

static double pm_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Sizes of at least `min`: NULL, else msg naming the first that is not. */
typedef struct {
    const char *name;
    int64_t v, min;
} pm_size;

static const char *check_sizes(const pm_size *f, size_t nf, char *msg, size_t n)
{
    for (size_t i = 0; i < nf; i++)
        if (f[i].v < f[i].min) {
            snprintf(msg, n, "%s must be >= %lld, got %lld", f[i].name, (long long)f[i].min,
                     (long long)f[i].v);
            return msg;
        }
    return NULL;
}

/* The decoder's sizes and their divisibility. */
static const char *decoder_check(const plan_cfg *c, char *msg, size_t n)
{
    const pm_size f[] = {{"layers", c->layers, 1}, {"hidden", c->hidden, 1},
                         {"ffn", c->ffn, 1},       {"heads", c->heads, 1},
                         {"vocab", c->vocab, 0},   {"seq", c->seq, 1},
                         {"batch", c->batch, 1},   {"dp", c->dp, 1},
                         {"tp", c->tp, 1}};
    if (check_sizes(f, sizeof f / sizeof *f, msg, n))
        return msg;
    const struct {
        const char *a, *b;
        int64_t x, y;
    } d[] = {{"hidden", "heads", c->hidden, c->heads},
             {"heads", "tp", c->heads, c->tp},
             {"ffn", "tp", c->ffn, c->tp},
             {"seq", "tp", c->seq, c->tp}};
    for (size_t i = 0; i < sizeof d / sizeof *d; i++)
        if (d[i].x % d[i].y) {
            snprintf(msg, n, "%s (%lld) must be divisible by %s (%lld)", d[i].a,
                     (long long)d[i].x, d[i].b, (long long)d[i].y);
            return msg;
        }
    if (c->vocab && c->vocab % c->tp) {
        snprintf(msg, n, "vocab (%lld) must be divisible by tp (%lld)", (long long)c->vocab,
                 (long long)c->tp);
        return msg;
    }
    if (c->loss_parallel && !c->vocab)
        return "loss parallel needs a vocabulary (vocab > 0)";
    return NULL;
}

/* A config's model: its own sizes were checked when it was read
 * (tp_llm_config_parse); these are what tp_llm_parallelize and the step
 * would refuse of the layout, named as the config names them. Vocabulary
 * and intermediate size need not divide by tp (the last shard is smaller). */
static const char *llm_check(const plan_cfg *c, char *msg, size_t n)
{
    const pm_size f[] = {{"seq", c->seq, 2}, {"batch", c->batch, 1}, {"dp", c->dp, 1},
                         {"tp", c->tp, 1}};
    if (check_sizes(f, sizeof f / sizeof *f, msg, n)) /* seq 2: the loss predicts the next token */
        return msg;
    const tp_llm_config *m = c->llm;
    const long long tp = c->tp, hq = m->num_attention_heads, hkv = m->num_key_value_heads,
                    seq = c->seq;
    if (hq % tp)
        snprintf(msg, n, "num_attention_heads (%lld) must be divisible by tp (%lld)", hq, tp);
    else if (hkv % tp && tp % hkv)
        snprintf(msg, n,
                 "num_key_value_heads (%lld) must be divisible by tp (%lld), or tp by it "
                 "(each rank then keeps the kv head its query heads read)",
                 hkv, tp);
    else if (c->sp && seq % tp)
        snprintf(msg, n, "seq (%lld) must be divisible by tp (%lld) with sequence parallelism",
                 seq, tp);
    else if (m->sliding_window > 0 && seq > m->sliding_window)
        snprintf(msg, n,
                 "seq (%lld) exceeds the config's sliding_window (%lld), which libtp does not "
                 "apply",
                 seq, (long long)m->sliding_window);
    else
        return NULL;
    return msg;
}

const char *plan_cfg_check(const plan_cfg *c)
{
    static char msg[200];
    const char *bad = c->llm ? llm_check(c, msg, sizeof msg) : decoder_check(c, msg, sizeof msg);
    if (bad)
        return bad;
    if (c->dp > 65536 || c->tp > 65536 || c->dp * c->tp > 65536)
        return "dp x tp must be <= 65536 (the sim backend's largest world)";
    if (c->rank < 0 || c->rank >= c->dp * c->tp)
        return "rank must be in [0, dp x tp)";
    return NULL;
}

/* [b, s, h/tp] local -> [b, nh/tp, s, hd] */
static tp_status heads_of(tp_tensor *x, int64_t hd, tp_tensor **out)
{
    const int64_t *s = tp_tensor_shape(x);
    int64_t sh[4] = {s[0], s[1], s[2] / hd, hd};
    tp_tensor *r = NULL;
    PM_TRY(tp_reshape(x, 4, sh, &r));
    tp_status st = tp_transpose(r, 1, 2, out);
    tp_tensor_release(r);
    return st;
}

static tp_status call(tp_module *self, const char *name, tp_tensor *x, tp_tensor **out)
{
    return tp_module_call(tp_module_child(self, name), x, out);
}

static void release_all(tp_tensor **t, size_t n)
{
    for (size_t i = 0; i < n; i++)
        tp_tensor_release(t[i]);
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
    if (st == TP_OK) {
        const int64_t *s = tp_tensor_shape(p[0]);
        st = tp_reshape(t, 3, (int64_t[]){s[0], s[1], s[2]}, &f);
    }
    if (st == TP_OK)
        st = call(self, "wo", f, &o);
    if (st == TP_OK)
        st = tp_add(x, o, out);
    tp_tensor *all[] = {n, p[0], p[1], p[2], h[0], h[1], h[2], a, t, f, o};
    release_all(all, sizeof all / sizeof *all);
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
    release_all(all, sizeof all / sizeof *all);
    return st;
}

static tp_status block_forward(tp_module *self, int nargs, tp_tensor *const *args, int nkw,
                               const tp_kwarg *kw, tp_tensor **out)
{
    const plan_cfg *c = tp_module_ctx(self);
    tp_tensor *h = NULL;
    PM_TRY(attention(self, args[0], c->hidden / c->heads, &h));
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

static tp_status make_block(const plan_cfg *c, tp_module **out)
{
    tp_module *b = NULL, *m[9] = {NULL};
    int64_t h = c->hidden, f = c->ffn;
    PM_TRY(tp_nn_custom_create("TransformerBlock", block_forward, (void *)c, NULL, &b));
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

static tp_status make_layers(const plan_cfg *c, tp_module **out)
{
    tp_module *seq = NULL;
    PM_TRY(tp_nn_sequential_create(&seq));
    tp_status st = TP_OK;
    for (int64_t l = 0; l < c->layers && st == TP_OK; l++) {
        char name[24];
        tp_module *b = NULL;
        snprintf(name, sizeof name, "%lld", (long long)l);
        st = add(seq, name, make_block(c, &b), &b);
    }
    if (st != TP_OK) {
        tp_module_free(seq);
        return st;
    }
    *out = seq;
    return TP_OK;
}

/* tokens -> tok_embeddings -> layers -> norm -> output: the logits */
static tp_status lm_forward(tp_module *self, int nargs, tp_tensor *const *args, int nkw,
                            const tp_kwarg *kw, tp_tensor **out)
{
    tp_tensor *e = NULL, *h = NULL, *n = NULL;
    tp_status st = call(self, "tok_embeddings", args[0], &e);
    if (st == TP_OK)
        st = call(self, "layers", e, &h);
    if (st == TP_OK)
        st = call(self, "norm", h, &n);
    tp_tensor *o = NULL;
    if (st == TP_OK)
        st = call(self, "output", n, &o);
    if (st == TP_OK) { /* [b, s, V] -> [b * s, V] for the cross entropy */
        const int64_t *sh = tp_tensor_shape(o);
        st = tp_reshape(o, 2, (int64_t[]){sh[0] * sh[1], sh[2]}, out);
    }
    tp_tensor *all[] = {e, h, n, o};
    release_all(all, 4);
    return st;
}

/* The whole model: the blocks alone (vocab 0) or within the language model. */
static tp_status make_model(const plan_cfg *c, tp_module **out)
{
    tp_module *layers = NULL, *lm = NULL, *m[3] = {NULL};
    PM_TRY(make_layers(c, &layers));
    if (!c->vocab) {
        *out = layers;
        return TP_OK;
    }
    tp_status st = tp_nn_custom_create("Transformer", lm_forward, NULL, NULL, &lm);
    if (st != TP_OK) {
        tp_module_free(layers);
        return st;
    }
    st = add(lm, "tok_embeddings", tp_nn_embedding_create(c->vocab, c->hidden, &m[0]), &m[0]);
    if (st == TP_OK)
        st = add(lm, "layers", TP_OK, &layers);
    else
        tp_module_free(layers);
    if (st == TP_OK)
        st = add(lm, "norm", tp_nn_rms_norm_create(c->hidden, true, 1e-5, &m[1]), &m[1]);
    if (st == TP_OK)
        st = add(lm, "output", tp_nn_linear_create(c->hidden, c->vocab, false, &m[2]), &m[2]);
    if (st != TP_OK) {
        tp_module_free(lm);
        return st;
    }
    *out = lm;
    return TP_OK;
}

enum { S_COL, S_ROW, S_SEQ, S_EMB, S_OUT, S_COUNT };

static tp_status make_styles(const plan_cfg *c, tp_style **s)
{
    const tp_layout R = tp_layout_of(tp_replicate()), S1 = tp_layout_of(tp_shard(1));
    tp_colwise_options co = {0}, oo = {0};
    tp_rowwise_options ro = {0}, eo = {.input_layouts = R};
    if (c->sp) {
        co.input_layouts = S1;
        ro.output_layouts = S1;
        eo.output_layouts = S1;
        oo.input_layouts = S1;
    }
    if (c->loss_parallel) {
        oo.output_layouts = tp_layout_of(tp_shard(-1));
        oo.use_local_output = TP_FLAG_FALSE;
    } else {
        oo.output_layouts = R;
    }
    PM_TRY(tp_colwise_parallel_create(&co, &s[S_COL]));
    PM_TRY(tp_rowwise_parallel_create(&ro, &s[S_ROW]));
    PM_TRY(tp_sequence_parallel_create(NULL, &s[S_SEQ]));
    PM_TRY(tp_rowwise_parallel_create(&eo, &s[S_EMB]));
    return tp_colwise_parallel_create(&oo, &s[S_OUT]);
}

/* The TP plan (Megatron-style; with sp the norms are sequence parallel and
 * the activations between the regions sharded on the sequence dim). */
static tp_status parallelize(const plan_cfg *c, tp_module *model, tp_mesh *tpm)
{
    tp_style *s[S_COUNT] = {NULL};
    tp_status st = make_styles(c, s);
    static const struct {
        const char *name;
        int style;
        bool sp_only;
    } rows[] = {{"attention_norm", S_SEQ, true},
                {"wq", S_COL, false},
                {"wk", S_COL, false},
                {"wv", S_COL, false},
                {"wo", S_ROW, false},
                {"ffn_norm", S_SEQ, true},
                {"w1", S_COL, false},
                {"w3", S_COL, false},
                {"w2", S_ROW, false}};
    char names[9][40];
    tp_plan_entry plan[12];
    int n = 0;
    for (size_t i = 0; i < 9; i++) {
        if (rows[i].sp_only && !c->sp)
            continue;
        snprintf(names[n], sizeof names[n], "%s*.%s", c->vocab ? "layers." : "", rows[i].name);
        plan[n] = (tp_plan_entry){names[n], s[rows[i].style]};
        n++;
    }
    if (c->vocab) {
        plan[n++] = (tp_plan_entry){"tok_embeddings", s[S_EMB]};
        plan[n++] = (tp_plan_entry){"output", s[S_OUT]};
        if (c->sp)
            plan[n++] = (tp_plan_entry){"norm", s[S_SEQ]};
    }
    if (st == TP_OK)
        st = tp_parallelize_module(model, tpm, n, plan, NULL);
    for (int i = 0; i < S_COUNT; i++)
        tp_style_free(s[i]);
    return st;
}

/* A config's model under the standard plan, SP and loss parallelism as c
 * asks. */
static tp_status parallelize_llm(const plan_cfg *c, tp_module *model, tp_mesh *tpm)
{
    const tp_llm_plan_options po = {.sequence_parallel = c->sp,
                                    .loss_parallel =
                                        c->loss_parallel ? TP_FLAG_TRUE : TP_FLAG_FALSE};
    tp_llm_plan *plan = NULL;
    PM_TRY(tp_llm_plan_create(&po, &plan));
    tp_status st = tp_llm_parallelize(model, tpm, tp_llm_plan_size(plan),
                                      tp_llm_plan_entries(plan), NULL);
    tp_llm_plan_free(plan);
    return st;
}

static tp_status count_param(const char *fqn, tp_tensor *p, void *ctx)
{
    plan_step *s = ctx;
    const tp_tensor *l = tp_tensor_is_dtensor(p) ? tp_dtensor_local(p) : p;
    s->params += tp_tensor_numel(l);
    s->params_total += tp_tensor_numel(p); /* a DTensor's numel is the global one */
    s->param_bytes += (uint64_t)tp_tensor_numel(l) * tp_dtype_size(tp_tensor_dtype(l));
    return TP_OK;
}

/* The step's input (tokens, or activations) and, with a vocabulary, targets.
 * A config's model takes the tokens twice: on the device for its forward,
 * on the CPU for tp_llm_loss, which shifts them into the labels. */
static tp_status make_inputs(const plan_cfg *c, tp_device dev, tp_tensor **x, tp_tensor **target)
{
    if (c->llm) {
        PM_TRY(tp_tensor_zeros(TP_I64, dev, 2, (int64_t[]){c->batch, c->seq}, x));
        return tp_tensor_zeros(TP_I64, TP_CPU, 2, (int64_t[]){c->batch, c->seq}, target);
    }
    if (c->vocab) {
        PM_TRY(tp_tensor_zeros(TP_I64, dev, 2, (int64_t[]){c->batch, c->seq}, x));
        return tp_tensor_zeros(TP_I64, dev, 1, (int64_t[]){c->batch * c->seq}, target);
    }
    int64_t xs[3] = {c->batch, c->sp ? c->seq / c->tp : c->seq, c->hidden};
    return tp_tensor_zeros(c->dtype, dev, 3, xs, x);
}

typedef struct {
    tp_comm *world;
    tp_mesh *mesh, *tpm;
    tp_module *model;
    tp_ddp *ddp;
    tp_adam *opt;
    tp_tensor *x, *target, *y, *loss;
} pm_run;

static void pm_run_free(pm_run *r)
{
    tp_tensor *all[] = {r->loss, r->y, r->target, r->x};
    release_all(all, 4);
    tp_adam_free(r->opt);
    tp_ddp_free(r->ddp);
    tp_module_free(r->model);
    tp_mesh_free(r->tpm);
    tp_mesh_free(r->mesh);
    *r = (pm_run){.world = r->world};
}

static tp_status pm_setup(const plan_cfg *c, tp_device dev, pm_run *r, plan_step *out)
{
    const char *names[2] = {"dp", "tp"}, *tpn = "tp";
    double t0 = pm_now();
    PM_TRY(tp_mesh_create(r->world, 2, (int64_t[]){c->dp, c->tp}, names, &r->mesh));
    PM_TRY(tp_mesh_slice(r->mesh, 1, &tpn, &r->tpm));
    PM_TRY(tp_nn_set_default_device(dev));
    tp_status st = c->llm ? tp_llm_create(c->llm, &r->model) : make_model(c, &r->model);
    tp_nn_set_default_device(TP_CPU);
    PM_TRY(st);
    if (c->dtype != TP_F32)
        PM_TRY(tp_module_to_dtype(r->model, c->dtype));
    PM_TRY(tp_module_init(r->model, 1));
    out->t_build = pm_now() - t0;
    t0 = pm_now();
    PM_TRY(c->llm ? parallelize_llm(c, r->model, r->tpm) : parallelize(c, r->model, r->tpm));
    /* the blocks' container */
    tp_module *blocks = c->llm ? tp_module_find(r->model, "model.layers")
                        : c->vocab ? tp_module_find(r->model, "layers")
                                   : r->model;
    if (c->ac != TP_RECOMPUTE_NONE)
        PM_TRY(tp_module_set_recompute_every(blocks, c->ac_every > 1 ? (int)c->ac_every : 1,
                                             c->ac));
    const tp_fsdp_options fo = {.keep_after_forward = c->keep_after_forward};
    if (c->fsdp && c->llm) { /* the model's own: blocks, embed_tokens, lm_head, root */
        PM_TRY(tp_llm_fully_shard(r->model, r->mesh, &fo));
    } else if (c->fsdp) { /* every block a unit, then the root */
        for (int i = 0; i < tp_module_num_children(blocks); i++)
            PM_TRY(tp_fully_shard(tp_module_child_at(blocks, i, NULL), r->mesh, &fo));
        if (blocks != r->model)
            PM_TRY(tp_fully_shard(r->model, r->mesh, &fo));
    } else if (c->dp > 1) {
        tp_ddp_options dopt = {.params_everywhere = true};
        PM_TRY(tp_ddp_create(r->model, tp_mesh_comm(r->mesh, 0), &dopt, &r->ddp));
    }
    PM_TRY(tp_adam_create(r->model, 1e-4, 0.9, 0.95, 1e-8, &r->opt));
    PM_TRY(tp_module_named_parameters(r->model, count_param, out));
    PM_TRY(make_inputs(c, dev, &r->x, &r->target));
    if (c->loss_parallel && !c->llm) { /* the vocabulary-parallel loss takes a replicated
                                         * DTensor target (tp_llm_loss makes its own) */
        tp_placement rep = tp_replicate();
        tp_tensor *t = NULL;
        PM_TRY(tp_dtensor_from_local(r->tpm, r->target, 1, &rep, NULL, &t));
        tp_tensor_release(r->target);
        r->target = t;
    }
    out->t_setup = pm_now() - t0;
    /* the peak of the step, not of the build (which holds the whole model
     * before tp_parallelize_module shards it, and an f32 copy before the
     * cast): from the live set the step starts with */
    if (tp_memory_reset_peak(dev) != TP_OK)
        tp_clear_error();
    return TP_OK;
}

static tp_status pm_step(const plan_cfg *c, pm_run *r, plan_step *out)
{
    double t0 = pm_now();
    if (c->llm) {
        PM_TRY(tp_llm_forward(r->model, r->x, NULL, NULL, &r->y));
        PM_TRY(tp_llm_loss(r->y, r->target, &r->loss));
    } else {
        PM_TRY(tp_module_call(r->model, r->x, &r->y));
        if (c->vocab)
            PM_TRY(tp_cross_entropy(r->y, r->target, NULL, &r->loss));
        else
            PM_TRY(tp_mean_all(r->y, &r->loss));
    }
    double t1 = pm_now();
    PM_TRY(tp_backward(r->loss, NULL));
    double t2 = pm_now();
    PM_TRY(tp_adam_step(r->opt));
    out->t_forward = t1 - t0;
    out->t_backward = t2 - t1;
    out->t_optim = pm_now() - t2;
    return TP_OK;
}

/* The per-rank peak as the meta device's accounting reports it (0: not
 * known). The one place that reads it, to adapt to tp_memory_stats. */
static uint64_t pm_peak_bytes(void)
{
    tp_memory_info mi;
    if (tp_memory_stats(TP_META, &mi) != TP_OK) {
        tp_clear_error();
        return 0;
    }
    return mi.peak_allocated;
}

tp_status plan_run_step(const plan_cfg *c, plan_step *out)
{
    *out = (plan_step){0};
    const char *bad = plan_cfg_check(c);
    if (bad) {
        fprintf(stderr, "invalid configuration: %s\n", bad);
        return TP_ERR_INVALID_ARG;
    }
    pm_run r = {0};
    tp_sim_options so = {.world_size = (int)(c->dp * c->tp), .rank = (int)c->rank};
    tp_status st = tp_comm_create_world("sim", &so, &r.world);
    if (st == TP_OK)
        st = pm_setup(c, TP_META, &r, out);
    if (st == TP_OK)
        st = tp_comm_debug_create(&out->dbg);
    if (st == TP_OK)
        st = tp_plan_trace_create(&out->trace);
    if (st == TP_OK)
        st = tp_comm_debug_begin(out->dbg);
    if (st == TP_OK) {
        st = tp_plan_trace_begin(out->trace);
        if (st == TP_OK) {
            st = pm_step(c, &r, out);
            tp_status e = tp_plan_trace_end(out->trace);
            st = st != TP_OK ? st : e;
        }
        tp_status e = tp_comm_debug_end(out->dbg);
        st = st != TP_OK ? st : e;
    }
    if (st == TP_OK)
        out->peak_bytes = pm_peak_bytes();
    pm_run_free(&r);
    tp_comm_free(r.world);
    if (st != TP_OK)
        plan_step_free(out);
    return st;
}

void plan_step_free(plan_step *s)
{
    tp_comm_debug_free(s->dbg);
    tp_plan_trace_free(s->trace);
    s->dbg = NULL;
    s->trace = NULL;
}

/* ---- measuring the same step on this machine ----------------------------- */

typedef struct {
    const plan_cfg *c;
    int steps;
    double *seconds; /* per step, rank 0's */
} pm_measure;

static tp_status pm_measure_rank(tp_comm *world, void *arg)
{
    pm_measure *m = arg;
    pm_run r = {.world = world};
    plan_step info = {0};
    tp_status st = pm_setup(m->c, TP_CPU, &r, &info);
    for (int i = -1; i < m->steps && st == TP_OK; i++) { /* -1: the warm-up */
        tp_tensor_release(r.y);
        tp_tensor_release(r.loss);
        r.y = r.loss = NULL;
        tp_module_zero_grad(r.model);
        st = tp_barrier(world, NULL);
        double t0 = pm_now();
        if (st == TP_OK)
            st = pm_step(m->c, &r, &info);
        if (st == TP_OK)
            st = tp_barrier(world, NULL);
        if (i >= 0 && tp_comm_rank(world) == 0)
            m->seconds[i] = pm_now() - t0;
    }
    pm_run_free(&r);
    return st;
}

tp_status plan_measure_steps(const plan_cfg *c, int steps, double *seconds)
{
    const char *bad = plan_cfg_check(c);
    if (bad) {
        fprintf(stderr, "invalid configuration: %s\n", bad);
        return TP_ERR_INVALID_ARG;
    }
    pm_measure m = {c, steps, seconds};
    return tp_run_local((int)(c->dp * c->tp), pm_measure_rank, &m);
}

tp_status plan_measure_steps_on(const plan_cfg *c, tp_comm *world, int steps, double *seconds)
{
    const char *bad = plan_cfg_check(c);
    if (bad) {
        fprintf(stderr, "invalid configuration: %s\n", bad);
        return TP_ERR_INVALID_ARG;
    }
    if (tp_comm_size(world) != c->dp * c->tp) {
        fprintf(stderr, "the world has %d ranks, the layout dp %lld x tp %lld\n",
                tp_comm_size(world), (long long)c->dp, (long long)c->tp);
        return TP_ERR_INVALID_ARG;
    }
    pm_measure m = {c, steps, seconds};
    return pm_measure_rank(world, &m);
}
