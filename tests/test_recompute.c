/* Activation recomputation (tp_module_set_recompute) and the autograd seams
 * it is built on (tp_function_attach, tp_autograd_grad, tp_tensor_detach,
 * tp_enable_grad_begin): gradients bit-identical to a run without it, on
 * plain modules and on the Llama-family fixture models at tp 1 to 4;
 * Dropout masks replayed; comm-debug counts per phase; the activation
 * memory each mode keeps; refusals. */
#include "tp_test.h"
#include "llm_fixture.h"

/* ---- helpers ---------------------------------------------------------------- */

/* Every parameter's local gradient bytes, in named_parameters order. */
typedef struct {
    int n;
    size_t bytes[64];
    unsigned char *data[64];
    char fqn[64][96];
} grads_t;

static void grads_free(grads_t *g)
{
    for (int i = 0; i < g->n; i++)
        free(g->data[i]);
    memset(g, 0, sizeof *g);
}

static tp_status grab_grad(const char *fqn, tp_tensor *p, void *ctx)
{
    grads_t *g = ctx;
    if (g->n == 64)
        return TP_ERR_STATE;
    tp_tensor *gr = tp_tensor_grad(p);
    int i = g->n++;
    snprintf(g->fqn[i], sizeof g->fqn[i], "%s", fqn);
    if (!gr)
        return TP_OK;
    tp_tensor *loc = tp_tensor_is_dtensor(gr) ? tp_dtensor_local(gr) : gr, *c = NULL;
    TP_TEST_TRY(tp_tensor_to(loc, tp_tensor_dtype(loc), TP_CPU, &c));
    g->bytes[i] = (size_t)tp_tensor_numel(c) * tp_dtype_size(tp_tensor_dtype(c));
    g->data[i] = malloc(g->bytes[i] ? g->bytes[i] : 1);
    memcpy(g->data[i], tp_tensor_data(c), g->bytes[i]);
    tp_tensor_release(c);
    return TP_OK;
}

/* NULL when a and b hold the same bytes, else the first parameter that
 * differs. */
static const char *grads_differ(const grads_t *a, const grads_t *b)
{
    if (a->n != b->n)
        return "(the parameter count)";
    for (int i = 0; i < a->n; i++)
        if (!a->data[i] != !b->data[i] || a->bytes[i] != b->bytes[i] ||
            (a->data[i] && memcmp(a->data[i], b->data[i], a->bytes[i])))
            return a->fqn[i];
    return NULL;
}

static bool same_bytes(const tp_tensor *a, const tp_tensor *b)
{
    return tp_tensor_numel(a) == tp_tensor_numel(b) &&
           !memcmp(tp_tensor_data(a), tp_tensor_data(b),
                   (size_t)tp_tensor_numel(a) * tp_dtype_size(tp_tensor_dtype(a)));
}

/* ---- plain modules ------------------------------------------------------------ */

/* Sequential(Linear 16->32, GELU, Dropout 0.3, Linear 32->8), seeded;
 * fused: the GELU fused into fc1 (tp_nn_linear_fuse_gelu) and act an
 * Identity, the same parameters. */
static tp_module *mlp_of(double p, bool fused)
{
    tp_module *seq = NULL, *l1 = NULL, *act = NULL, *drop = NULL, *l2 = NULL;
    CHECK_OK(tp_nn_sequential_create(&seq));
    CHECK_OK(tp_nn_linear_create(16, 32, true, &l1));
    if (fused) {
        CHECK_OK(tp_nn_linear_fuse_gelu(l1, TP_GELU_TANH));
        CHECK_OK(tp_nn_identity_create(&act));
    } else {
        CHECK_OK(tp_nn_gelu_create(TP_GELU_TANH, &act));
    }
    CHECK_OK(tp_nn_dropout_create(p, 7, &drop));
    CHECK_OK(tp_nn_linear_create(32, 8, true, &l2));
    CHECK_OK(tp_module_add_child(seq, "fc1", l1));
    CHECK_OK(tp_module_add_child(seq, "act", act));
    CHECK_OK(tp_module_add_child(seq, "drop", drop));
    CHECK_OK(tp_module_add_child(seq, "fc2", l2));
    CHECK_OK(tp_module_init(seq, 3));
    return seq;
}

static tp_module *mlp(double p) { return mlp_of(p, false); }

static tp_tensor *input(uint64_t seed, bool requires_grad)
{
    tp_tensor *x = NULL;
    CHECK_OK(tp_tensor_empty(TP_F32, TP_CPU, 2, (int64_t[]){6, 16}, &x));
    float *d = tp_tensor_data(x);
    for (int i = 0; i < 96; i++)
        d[i] = (float)((i * 37 + (int)seed * 11) % 23) / 7.0f - 1.5f;
    if (requires_grad)
        CHECK_OK(tp_tensor_set_requires_grad(x, true));
    return x;
}

/* Two training steps' gradients (of the parameters and of x) under `mode`
 * on the Sequential (or on a Sequential inside a container, outer). */
static void mlp_steps(tp_recompute_mode mode, bool nested, bool fused, grads_t g[2],
                      tp_tensor *gx[2])
{
    tp_module *m = mlp_of(0.3, fused);
    CHECK_OK(tp_module_set_recompute(m, mode));
    if (nested)
        CHECK_OK(tp_module_set_recompute(tp_module_find(m, "fc1"), TP_RECOMPUTE_FULL));
    for (int step = 0; step < 2; step++) {
        tp_tensor *x = input((uint64_t)step, true), *y = NULL, *loss = NULL;
        CHECK_OK(tp_module_call(m, x, &y));
        cr_assert(tp_tensor_requires_grad(y));
        CHECK_OK(tp_mean_all(y, &loss));
        CHECK_OK(tp_backward(loss, NULL));
        CHECK_OK(tp_module_named_parameters(m, grab_grad, &g[step]));
        CHECK_OK(tp_tensor_to(tp_tensor_grad(x), TP_F32, TP_CPU, &gx[step]));
        tp_module_zero_grad(m);
        tp_tensor_release(loss);
        tp_tensor_release(y);
        tp_tensor_release(x);
    }
    tp_module_free(m);
}

Test(recompute, plain_module_bit_identical, .timeout = 60)
{
    grads_t ref[2] = {0};
    tp_tensor *rx[2] = {0};
    mlp_steps(TP_RECOMPUTE_NONE, false, false, ref, rx);
    /* and with the GELU fused into fc1 (on the CPU the fused op is the pair
     * bit for bit): its pre-activation must reach the replay through the
     * stash, which records under no-grad */
    const tp_recompute_mode modes[] = {TP_RECOMPUTE_FULL,   TP_RECOMPUTE_SELECTIVE,
                                       TP_RECOMPUTE_FULL,   TP_RECOMPUTE_NONE,
                                       TP_RECOMPUTE_FULL,   TP_RECOMPUTE_SELECTIVE};
    for (int k = 0; k < 6; k++) {
        grads_t g[2] = {0};
        tp_tensor *gx[2] = {0};
        bool fused = k >= 3;
        mlp_steps(modes[k], k == 2, fused, g, gx);
        for (int step = 0; step < 2; step++) {
            /* the second step draws the Dropout masks that follow the first
             * step's: the recompute must leave the counter as it found it */
            const char *bad = grads_differ(&g[step], &ref[step]);
            cr_assert(!bad, "mode %d%s%s, step %d: the gradient of %s differs", (int)modes[k],
                      k == 2 ? " nested" : "", fused ? " fused" : "", step, bad);
            cr_assert(same_bytes(gx[step], rx[step]), "mode %d step %d: x's gradient differs",
                      (int)modes[k], step);
            grads_free(&g[step]);
            tp_tensor_release(gx[step]);
        }
    }
    for (int step = 0; step < 2; step++) {
        grads_free(&ref[step]);
        tp_tensor_release(rx[step]);
    }
}

/* Without grad nothing is recorded; without anything to differentiate the
 * module runs plainly. */
Test(recompute, no_grad_runs_plainly, .timeout = 30)
{
    tp_module *m = mlp(0.0);
    CHECK_OK(tp_module_set_recompute(m, TP_RECOMPUTE_FULL));
    tp_tensor *x = input(0, true), *y = NULL;
    tp_no_grad_begin();
    CHECK_OK(tp_module_call(m, x, &y));
    tp_no_grad_end();
    cr_assert(!tp_tensor_requires_grad(y), "a forward without grad records nothing");
    tp_tensor_release(y);
    /* inputs without grad and a frozen module: nothing to differentiate */
    tp_tensor *x2 = input(0, false);
    tp_module *m2 = mlp(0.0);
    CHECK_OK(tp_module_set_recompute(m2, TP_RECOMPUTE_FULL));
    tp_tensor *p = tp_module_parameter(tp_module_find(m2, "fc1"), "weight");
    cr_assert(tp_tensor_requires_grad(p));
    CHECK_OK(tp_module_call(m2, x2, &y));
    cr_assert(tp_tensor_has_grad_fn(y));
    tp_tensor_release(y);
    tp_tensor_release(x2);
    tp_tensor_release(x);
    tp_module_free(m2);
    tp_module_free(m);
}

Test(recompute, settings, .timeout = 30)
{
    tp_module *m = mlp(0.0);
    cr_assert_eq(tp_module_recompute(m), TP_RECOMPUTE_NONE);
    CHECK_OK(tp_module_set_recompute(m, TP_RECOMPUTE_SELECTIVE));
    cr_assert_eq(tp_module_recompute(m), TP_RECOMPUTE_SELECTIVE);
    CHECK_ERR(tp_module_set_recompute(NULL, TP_RECOMPUTE_FULL), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_module_set_recompute(m, (tp_recompute_mode)3), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "mode 3"), "%s", tp_last_error());
    cr_assert_eq(tp_module_recompute(m), TP_RECOMPUTE_SELECTIVE, "a refusal changes nothing");
    cr_assert_eq(tp_module_recompute(NULL), TP_RECOMPUTE_NONE);
    CHECK_OK(tp_module_set_recompute_every(m, 2, TP_RECOMPUTE_FULL));
    const char *kids[] = {"fc1", "act", "drop", "fc2"};
    for (int i = 0; i < 4; i++)
        cr_assert_eq(tp_module_recompute(tp_module_find(m, kids[i])),
                     i % 2 ? TP_RECOMPUTE_NONE : TP_RECOMPUTE_FULL, "child %d", i);
    CHECK_ERR(tp_module_set_recompute_every(m, 0, TP_RECOMPUTE_FULL), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "every 0"), "%s", tp_last_error());
    CHECK_ERR(tp_module_set_recompute_every(NULL, 1, TP_RECOMPUTE_FULL), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_module_set_recompute_every(m, 1, (tp_recompute_mode)-1), TP_ERR_INVALID_ARG);
    cr_assert_eq(tp_module_recompute(tp_module_find(m, "act")), TP_RECOMPUTE_NONE);
    tp_module_free(m);
}

/* ---- the autograd seams ------------------------------------------------------- */

/* y = sum_i c_i x_i over n inputs, with its own backward: grad_in[i] = c_i g */
typedef struct {
    int calls;
    int freed;
} weighted_ctx;

static tp_status weighted_bwd(void *ctx, tp_tensor *g, int n, tp_tensor **gin)
{
    weighted_ctx *w = ctx;
    w->calls++;
    for (int i = 0; i < n; i++)
        TP_TEST_TRY(tp_scale(g, (double)(i + 1), &gin[i]));
    return TP_OK;
}

static void weighted_free(void *ctx) { ((weighted_ctx *)ctx)->freed++; }

Test(recompute, custom_function_many_inputs, .timeout = 30)
{
    enum { N = 7 }; /* more than an op node holds inline */
    tp_tensor *x[N], *y = NULL, *loss = NULL;
    for (int i = 0; i < N; i++)
        x[i] = input((uint64_t)i, true);
    tp_tensor *frozen = input(9, false);
    x[3] = (tp_tensor_release(x[3]), frozen); /* no gradient flows to it */
    tp_no_grad_begin();
    CHECK_OK(tp_tensor_detach(x[0], &y));
    tp_no_grad_end();
    weighted_ctx w = {0};
    CHECK_OK(tp_function_attach(y, "weighted", N, x, weighted_bwd, &w, weighted_free));
    cr_assert(tp_tensor_has_grad_fn(y));
    CHECK_OK(tp_sum_all(y, &loss));
    CHECK_OK(tp_backward(loss, NULL));
    cr_assert_eq(w.calls, 1);
    cr_assert_eq(w.freed, 1, "the graph frees ctx once it ran");
    for (int i = 0; i < N; i++) {
        tp_tensor *g = tp_tensor_grad(x[i]);
        if (i == 3) {
            cr_assert_null(g);
            continue;
        }
        cr_assert_not_null(g, "input %d", i);
        const float *d = tp_tensor_data(g);
        for (int e = 0; e < 96; e++)
            cr_assert_eq(d[e], (float)(i + 1), "input %d element %d: %g", i, e, d[e]);
    }
    /* nothing needs grad: nothing attached, ctx freed at once */
    tp_tensor *z = NULL;
    CHECK_OK(tp_tensor_detach(frozen, &z));
    weighted_ctx w2 = {0};
    CHECK_OK(tp_function_attach(z, "weighted", 1, &frozen, weighted_bwd, &w2, weighted_free));
    cr_assert(!tp_tensor_has_grad_fn(z));
    cr_assert_eq(w2.freed, 1);
    /* refusals leave ctx with the caller */
    weighted_ctx w3 = {0};
    CHECK_ERR(tp_function_attach(y, "weighted", 1, x, weighted_bwd, &w3, weighted_free),
              TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "already requires grad"), "%s", tp_last_error());
    CHECK_ERR(tp_function_attach(z, "weighted", 1, (tp_tensor *[]){NULL}, weighted_bwd, &w3,
                                 weighted_free),
              TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "inputs[0] is NULL"), "%s", tp_last_error());
    CHECK_ERR(tp_function_attach(z, "weighted", 1, x, NULL, &w3, weighted_free),
              TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_function_attach(z, NULL, 1, x, weighted_bwd, &w3, weighted_free),
              TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_function_attach(z, "weighted", -1, x, weighted_bwd, &w3, weighted_free),
              TP_ERR_INVALID_ARG);
    cr_assert_eq(w3.freed, 0);
    tp_tensor_release(z);
    tp_tensor_release(loss);
    tp_tensor_release(y);
    for (int i = 0; i < N; i++)
        tp_tensor_release(x[i]);
}

static tp_status count_hook(tp_tensor *t, void *ctx)
{
    (void)t;
    ++*(int *)ctx;
    return TP_OK;
}

Test(recompute, autograd_grad_leaves_grads_alone, .timeout = 30)
{
    tp_module *m = mlp(0.0);
    tp_tensor *x = input(1, true), *y = NULL, *loss = NULL, *y2 = NULL, *loss2 = NULL;
    tp_tensor *w = tp_module_parameter(tp_module_find(m, "fc1"), "weight");
    int hooks = 0;
    CHECK_OK(tp_tensor_add_grad_hook(w, count_hook, &hooks, NULL));
    CHECK_OK(tp_module_call(m, x, &y));
    CHECK_OK(tp_mean_all(y, &loss));
    tp_tensor *g[2] = {0};
    CHECK_OK(tp_autograd_grad(loss, NULL, 2, (tp_tensor *[]){x, w}, g));
    cr_assert_not_null(g[0]);
    cr_assert_not_null(g[1]);
    cr_assert_null(tp_tensor_grad(x), "tp_autograd_grad adds into no leaf");
    cr_assert_null(tp_tensor_grad(w));
    cr_assert_eq(hooks, 0, "and runs no hook");
    /* the same values tp_backward gives */
    CHECK_OK(tp_module_call(m, x, &y2));
    CHECK_OK(tp_mean_all(y2, &loss2));
    CHECK_OK(tp_backward(loss2, NULL));
    cr_assert_eq(hooks, 1);
    cr_assert(same_bytes(g[0], tp_tensor_grad(x)));
    cr_assert(same_bytes(g[1], tp_tensor_grad(w)));
    /* refusals */
    tp_tensor *out[1] = {(tp_tensor *)0x1};
    CHECK_ERR(tp_autograd_grad(loss2, NULL, 1, (tp_tensor *[]){y2}, out), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "inputs[0] is the output of a recorded op"), "%s",
              tp_last_error());
    cr_assert_null(out[0], "grads are NULL on failure");
    tp_tensor *frozen = input(2, false);
    CHECK_ERR(tp_autograd_grad(loss2, NULL, 1, &frozen, out), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "does not require grad"), "%s", tp_last_error());
    CHECK_ERR(tp_autograd_grad(loss2, NULL, 1, &x, NULL), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_autograd_grad(y2, NULL, 1, &x, out), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "pass grad"), "%s", tp_last_error());
    tp_tensor_release(frozen);
    tp_tensor_release(g[0]);
    tp_tensor_release(g[1]);
    tp_tensor_release(loss2);
    tp_tensor_release(y2);
    tp_tensor_release(loss);
    tp_tensor_release(y);
    tp_tensor_release(x);
    tp_module_free(m);
}

Test(recompute, detach_and_enable_grad, .timeout = 30)
{
    tp_tensor *x = input(0, true), *y = NULL, *d = NULL;
    CHECK_OK(tp_scale(x, 2.0, &y));
    CHECK_OK(tp_tensor_detach(y, &d));
    cr_assert(!tp_tensor_requires_grad(d) && !tp_tensor_has_grad_fn(d));
    cr_assert_eq(tp_tensor_data(d), tp_tensor_data(y), "the same data");
    tp_tensor *none = NULL;
    CHECK_ERR(tp_tensor_detach(NULL, &none), TP_ERR_INVALID_ARG);
    cr_assert_null(none);
    tp_tensor_release(d);
    tp_no_grad_begin();
    tp_no_grad_begin();
    cr_assert(!tp_grad_enabled());
    int token = tp_enable_grad_begin();
    cr_assert(tp_grad_enabled());
    tp_no_grad_begin(); /* nests inside */
    cr_assert(!tp_grad_enabled());
    tp_no_grad_end();
    tp_enable_grad_end(token);
    cr_assert(!tp_grad_enabled());
    tp_no_grad_end();
    tp_no_grad_end();
    cr_assert(tp_grad_enabled());
    tp_tensor_release(y);
    tp_tensor_release(x);
}

/* A forward that computes something else when run again: selective
 * recompute notices that the ops it kept were not run again. */
static tp_status fickle_forward(tp_module *self, int nargs, tp_tensor *const *args, int nkw,
                                const tp_kwarg *kw, tp_tensor **out)
{
    int *calls = tp_module_ctx(self);
    tp_module *fc = tp_module_child(self, "fc");
    tp_tensor *h = NULL;
    TP_TEST_TRY(tp_module_call(fc, args[0], &h));
    if ((*calls)++ == 0) { /* the first run applies fc twice */
        tp_tensor *h2 = NULL;
        tp_status st = tp_module_call(fc, h, &h2);
        tp_tensor_release(h);
        TP_TEST_TRY(st);
        h = h2;
    }
    *out = h;
    return TP_OK;
}

Test(recompute, selective_refuses_a_forward_that_changed, .timeout = 30)
{
    int calls = 0;
    tp_module *m = NULL, *fc = NULL;
    CHECK_OK(tp_nn_custom_create("Fickle", fickle_forward, &calls, NULL, &m));
    CHECK_OK(tp_nn_linear_create(16, 16, false, &fc));
    CHECK_OK(tp_module_add_child(m, "fc", fc));
    CHECK_OK(tp_module_init(m, 1));
    CHECK_OK(tp_module_set_recompute(m, TP_RECOMPUTE_SELECTIVE));
    tp_tensor *x = input(0, true), *y = NULL, *loss = NULL;
    CHECK_OK(tp_module_call(m, x, &y));
    CHECK_OK(tp_mean_all(y, &loss));
    CHECK_ERR(tp_backward(loss, NULL), TP_ERR_STATE);
    cr_assert(strstr(tp_last_error(), "did not run the same ops again"), "%s", tp_last_error());
    cr_assert(strstr(tp_last_error(), "recomputing Fickle"), "%s", tp_last_error());
    tp_tensor_release(loss);
    tp_tensor_release(y);
    tp_tensor_release(x);
    tp_module_free(m);
}

/* ---- the fixture models ---------------------------------------------------- */

typedef struct {
    int model, tp;
    bool sp;
} model_case;

typedef struct {
    model_case c;
    int64_t layers; /* the fixture's blocks */
    tp_test_slot slot[TP_TEST_MAX_RANKS];
} model_state;

/* forward, loss and backward under `mode` (every `every`-th block) with a
 * comm-debug counter; the gradients into *g, the counts per phase into
 * counts[phase] and the bytes kept for backward (allocated after the
 * forward less before it) into *kept. */
static tp_status model_step(tp_comm *world, const model_case *c, tp_recompute_mode mode,
                            int every, tp_test_slot *slot, grads_t *g, int64_t counts[3],
                            size_t *kept)
{
    fixture_model f;
    RANK_OK(slot, fixture_open(world, c->model, c->sp, TP_F32, TP_CPU, true, &f));
    RANK_OK(slot, tp_module_set_recompute_every(tp_module_find(f.model, "model.layers"), every,
                                                mode));
    tp_tensor *ids = NULL, *logits = NULL, *loss = NULL;
    RANK_OK(slot, ref_tensor(c->model, "input_ids", &ids));
    tp_comm_debug *dbg = NULL;
    RANK_OK(slot, tp_comm_debug_create(&dbg));
    tp_memory_info before, after;
    RANK_OK(slot, tp_memory_stats(TP_CPU, &before));
    RANK_OK(slot, tp_comm_debug_begin(dbg));
    tp_status st = tp_llm_forward(f.model, ids, NULL, NULL, &logits);
    if (st == TP_OK)
        st = tp_llm_loss(logits, ids, &loss);
    tp_memory_stats(TP_CPU, &after);
    tp_comm_debug_set_phase(TP_PHASE_FORWARD);
    if (st == TP_OK)
        st = tp_backward(loss, NULL);
    tp_comm_debug_end(dbg);
    RANK_OK(slot, st);
    *kept = after.allocated - before.allocated;
    for (int p = 0; p < 3; p++)
        RANK_OK(slot, tp_comm_debug_scope_count(dbg, TP_COMM_DEBUG_GLOBAL, (tp_phase)p,
                                                TP_COLL_ANY, &counts[p]));
    RANK_OK(slot, tp_module_named_parameters(f.model, grab_grad, g));
    tp_comm_debug_free(dbg);
    tp_tensor_release(loss);
    tp_tensor_release(logits);
    tp_tensor_release(ids);
    fixture_close(&f);
    return TP_OK;
}

static tp_status model_body(tp_comm *world, void *arg)
{
    model_state *s = arg;
    const int r = tp_comm_rank(world);
    tp_test_slot *slot = &s->slot[r];
    grads_t ref = {0};
    int64_t ref_counts[3];
    size_t ref_kept = 0;
    tp_status st = model_step(world, &s->c, TP_RECOMPUTE_NONE, 1, slot, &ref, ref_counts,
                              &ref_kept);
    if (st != TP_OK)
        return st;
    RANK_EXPECT(slot, ref_counts[TP_PHASE_RECOMPUTE] == 0, "no recompute, %lld recomputed",
                (long long)ref_counts[TP_PHASE_RECOMPUTE]);
    const struct {
        tp_recompute_mode mode;
        int every;
    } runs[] = {{TP_RECOMPUTE_FULL, 1}, {TP_RECOMPUTE_SELECTIVE, 1}, {TP_RECOMPUTE_FULL, 2}};
    const char *name = model_names[s->c.model];
    size_t kept_by[3] = {0};
    for (int k = 0; k < 3 && st == TP_OK; k++) {
        grads_t g = {0};
        int64_t counts[3];
        size_t kept = 0;
        st = model_step(world, &s->c, runs[k].mode, runs[k].every, slot, &g, counts, &kept);
        if (st != TP_OK)
            break;
        const char *bad = grads_differ(&g, &ref);
        RANK_EXPECT(slot, !bad, "%s tp %d%s mode %d every %d rank %d: the gradient of %s differs",
                    name, s->c.tp, s->c.sp ? " sp" : "", (int)runs[k].mode, runs[k].every, r,
                    bad);
        RANK_EXPECT(slot, counts[0] == ref_counts[0] && counts[1] == ref_counts[1],
                    "%s tp %d mode %d: forward %lld backward %lld collectives, without "
                    "recompute %lld and %lld", name, s->c.tp, (int)runs[k].mode,
                    (long long)counts[0], (long long)counts[1], (long long)ref_counts[0],
                    (long long)ref_counts[1]);
        /* full recompute issues each recomputed block's forward collectives
         * again (at tp > 1: two all_reduces, or with SP two all_gathers and
         * two reduce_scatters); selective reuses them and issues none */
        const int64_t per_block = s->c.tp == 1 ? 0 : s->c.sp ? 4 : 2,
                      blocks = (s->layers + runs[k].every - 1) / runs[k].every,
                      want = runs[k].mode == TP_RECOMPUTE_FULL ? per_block * blocks : 0;
        RANK_EXPECT(slot, counts[TP_PHASE_RECOMPUTE] == want,
                    "%s tp %d%s mode %d every %d: %lld recomputed collectives, expected %lld",
                    name, s->c.tp, s->c.sp ? " sp" : "", (int)runs[k].mode, runs[k].every,
                    (long long)counts[TP_PHASE_RECOMPUTE], (long long)want);
        kept_by[k] = kept;
        grads_free(&g);
    }
    /* what the forward leaves allocated for backward (logits and loss
     * included): full < selective < none, and full on every other block
     * between full and none */
    if (st == TP_OK && getenv("TP_TEST_PRINT_MEMORY"))
        printf("%s tp %d%s rank %d kept for backward: none %zu, full %zu, selective %zu, "
               "full every 2 %zu\n", name, s->c.tp, s->c.sp ? " sp" : "", r, ref_kept,
               kept_by[0], kept_by[1], kept_by[2]);
    RANK_EXPECT(slot, st != TP_OK || (kept_by[0] < kept_by[1] && kept_by[1] < ref_kept &&
                                      kept_by[0] < kept_by[2] && kept_by[2] < ref_kept),
                "%s tp %d rank %d kept for backward: none %zu, full %zu, selective %zu, full "
                "every 2 %zu", name, s->c.tp, r, ref_kept, kept_by[0], kept_by[1], kept_by[2]);
    grads_free(&ref);
    return st;
}

ParameterizedTestParameters(recompute, models_bit_identical)
{
    static model_case cases[] = {
        {LLAMA, 1, false}, {LLAMA, 2, false}, {LLAMA, 2, true}, {LLAMA, 4, false},
        {MISTRAL, 2, false}, {QWEN2, 4, true}, {LLAMA_BF16, 8, false},
    };
    return cr_make_param_array(model_case, cases, sizeof cases / sizeof cases[0]);
}

ParameterizedTest(model_case *c, recompute, models_bit_identical, .timeout = 180)
{
    model_state s = {.c = *c};
    char dir[512];
    tp_llm_config cfg;
    CHECK_OK(tp_llm_config_load(model_dir(c->model, dir, sizeof dir), &cfg));
    s.layers = cfg.num_hidden_layers;
    tp_test_run(c->tp, model_body, &s, s.slot);
}
