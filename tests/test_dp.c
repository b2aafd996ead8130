/* Data parallelism (tp/dp.h), after the seeds test_c10d_pypg.py (DDP over a
 * user-written process group) and test_spmd_transformation.py (bucketed,
 * overlapped gradient collectives through ordered passes):
 *
 *   - DDP over the shm world at every world size, with every valid pass
 *     sequence, equals the plain module trained on the whole batch, step by
 *     step, with SGD and Adam; all_reduces per step = buckets;
 *   - over a user backend of one rank whose work objects count how often
 *     they are waited on and polled;
 *   - the pass ordering rules and the built-in passes' schedules;
 *   - DP x TP on a 2-D mesh;
 *   - errors. */
#include <stdio.h>
#include <stdlib.h>

#include "tp_test.h"

enum { IN = 8, HID = 16, OUT = 4, BATCH = 24, STEPS = 3, NPARAM = 4 };
#define LR 0.05
#define SEED 2024

static const char *const pnames[NPARAM] = {"net1.weight", "net1.bias", "net2.weight",
                                           "net2.bias"};

/* Sequential(net1 = Linear(8, 16), relu, net2 = Linear(16, 4)) */
static tp_status make_mlp(tp_module **out)
{
    tp_module *m = NULL, *a = NULL, *r = NULL, *b = NULL;
    TP_TEST_TRY(tp_nn_sequential_create(&m));
    tp_status st = tp_nn_linear_create(IN, HID, true, &a);
    if (st == TP_OK && (st = tp_module_add_child(m, "net1", a)) != TP_OK)
        tp_module_free(a);
    if (st == TP_OK && (st = tp_nn_relu_create(&r)) == TP_OK &&
        (st = tp_module_add_child(m, "relu", r)) != TP_OK)
        tp_module_free(r);
    if (st == TP_OK && (st = tp_nn_linear_create(HID, OUT, true, &b)) == TP_OK &&
        (st = tp_module_add_child(m, "net2", b)) != TP_OK)
        tp_module_free(b);
    if (st == TP_OK)
        st = tp_module_init(m, SEED);
    if (st != TP_OK) {
        tp_module_free(m);
        return st;
    }
    *out = m;
    return TP_OK;
}

/* The global batch of step s: [24, 8]. */
static tp_status batch(int s, tp_tensor **out)
{
    TP_TEST_TRY(tp_tensor_empty(TP_F32, TP_CPU, 2, (int64_t[]){BATCH, IN}, out));
    return tp_tensor_fill_random(*out, TP_RNG_NORMAL, 0.0, 1.0, 100 + (uint64_t)s, NULL, NULL);
}

/* loss = mean(module(x)): the mean over each rank's rows, averaged over the
 * ranks by DDP, is the mean over the whole batch. */
static tp_status loss_of(tp_module *m, tp_tensor *x, tp_tensor **loss)
{
    tp_tensor *y = NULL;
    TP_TEST_TRY(tp_module_call(m, x, &y));
    tp_status st = tp_mean_all(y, loss);
    tp_tensor_release(y);
    return st;
}

static tp_tensor *param(tp_module *m, int i)
{
    return tp_module_parameter(tp_module_child(m, i < 2 ? "net1" : "net2"),
                               i % 2 ? "bias" : "weight");
}

/* ---- the reference: the plain module on the whole batch ---------------------- */

typedef struct ref_run {
    tp_tensor *grad[STEPS][NPARAM];    /* gradients of each step */
    tp_tensor *after[STEPS][NPARAM];   /* parameters after each step */
} ref_run;

static void ref_free(ref_run *r)
{
    for (int i = 0; i < NPARAM; i++) {
        for (int s = 0; s < STEPS; s++) {
            tp_tensor_release(r->grad[s][i]);
            tp_tensor_release(r->after[s][i]);
        }
    }
}

static void reference(bool adam, ref_run *r)
{
    tp_module *m = NULL;
    tp_adam *opt = NULL;
    CHECK_OK(make_mlp(&m));
    if (adam)
        CHECK_OK(tp_adam_create(m, LR, 0.9, 0.999, 1e-8, &opt));
    for (int s = 0; s < STEPS; s++) {
        tp_tensor *x = NULL, *loss = NULL;
        CHECK_OK(batch(s, &x));
        CHECK_OK(loss_of(m, x, &loss));
        CHECK_OK(tp_backward(loss, NULL));
        for (int i = 0; i < NPARAM; i++)
            CHECK_OK(tp_tensor_clone(tp_tensor_grad(param(m, i)), &r->grad[s][i]));
        CHECK_OK(adam ? tp_adam_step(opt) : tp_sgd_step(m, LR));
        tp_module_zero_grad(m);
        for (int i = 0; i < NPARAM; i++)
            CHECK_OK(tp_tensor_clone(param(m, i), &r->after[s][i]));
        tp_tensor_release(loss);
        tp_tensor_release(x);
    }
    tp_adam_free(opt);
    tp_module_free(m);
}

/* ---- pass configurations ------------------------------------------------------ */

typedef enum {
    CFG_PLAIN,         /* manual, no pass: one blocking all_reduce per gradient */
    CFG_FUSION,        /* bucket_fusion */
    CFG_LATE,          /* late_waits alone: per gradient, waited at the step */
    CFG_FUSION_LATE,   /* bucket_fusion, late_waits */
    CFG_VIEWS,         /* bucket_fusion, remove_copies, late_waits */
    CFG_DEFAULT,       /* tp_ddp_create's defaults (one 25 MiB bucket) */
    CFG_DEFAULT_VIEWS, /* defaults with gradient_as_bucket_view */
    CFG_ONE_IN_FLIGHT  /* defaults at 300 bytes, one bucket in flight at a time */
} dp_cfg;

static const char *const cfg_name[] = {"plain", "fusion", "late", "fusion+late", "views",
                                       "default", "default+views", "one in flight"};

static tp_status configure(tp_module *m, tp_comm *c, dp_cfg cfg, tp_ddp **out)
{
    tp_ddp_options o = {.bucket_cap_bytes = 300, .manual_passes = true};
    if (cfg == CFG_DEFAULT || cfg == CFG_DEFAULT_VIEWS)
        o = (tp_ddp_options){.gradient_as_bucket_view = cfg == CFG_DEFAULT_VIEWS};
    if (cfg == CFG_ONE_IN_FLIGHT)
        o = (tp_ddp_options){.bucket_cap_bytes = 300, .max_in_flight = 1};
    TP_TEST_TRY(tp_ddp_create(m, c, &o, out));
    tp_step_graph *g = tp_ddp_graph(*out);
    tp_status st = TP_OK;
    if (cfg == CFG_FUSION || cfg == CFG_FUSION_LATE || cfg == CFG_VIEWS)
        st = tp_pass_apply(tp_pass_bucket_fusion(), g);
    if (st == TP_OK && cfg == CFG_VIEWS)
        st = tp_pass_apply(tp_pass_remove_copies(), g);
    if (st == TP_OK && (cfg == CFG_LATE || cfg == CFG_FUSION_LATE || cfg == CFG_VIEWS))
        st = tp_pass_apply(tp_pass_late_waits(), g);
    return st;
}

/* ---- DDP over the shm world ------------------------------------------------------ */

typedef struct dp_ctx {
    tp_test_slot slot[TP_TEST_MAX_RANKS];
    const ref_run *ref;
    dp_cfg cfg;
    bool adam;
} dp_ctx;

static void expect_close(tp_test_slot *s, const tp_tensor *got, const tp_tensor *want,
                         const char *what, const char *name, int step)
{
    bool close = false;
    double d = -1;
    tp_status st = tp_tensor_allclose(got, want, 1e-5, 1e-6, &close);
    if (st == TP_OK)
        st = tp_tensor_max_abs_diff(got, want, &d);
    RANK_EXPECT(s, st == TP_OK && close, "%s of %s at step %d differs from the whole-batch "
                "run by %g (%s)", what, name, step, d, st == TP_OK ? "" : tp_last_error());
}

static tp_status dp_body(tp_comm *w, void *arg)
{
    dp_ctx *c = arg;
    int rank = tp_comm_rank(w), n = tp_comm_size(w);
    tp_test_slot *s = &c->slot[rank];
    tp_module *m = NULL;
    tp_ddp *ddp = NULL;
    tp_adam *opt = NULL;
    tp_comm_debug *dbg = NULL;
    RANK_OK(s, make_mlp(&m));
    RANK_OK(s, configure(m, w, c->cfg, &ddp));
    if (c->adam)
        RANK_OK(s, tp_adam_create(m, LR, 0.9, 0.999, 1e-8, &opt));
    RANK_OK(s, tp_comm_debug_create(&dbg));
    char grad_what[64], param_what[64];
    snprintf(grad_what, sizeof grad_what, "%s, %s: the gradient", cfg_name[c->cfg],
             c->adam ? "Adam" : "SGD");
    snprintf(param_what, sizeof param_what, "%s, %s: the parameter", cfg_name[c->cfg],
             c->adam ? "Adam" : "SGD");
    const int64_t rows = BATCH / n;
    for (int step = 0; step < STEPS; step++) {
        tp_tensor *x = NULL, *mine = NULL, *loss = NULL;
        RANK_OK(s, batch(step, &x));
        RANK_OK(s, tp_tensor_narrow(x, 0, rank * rows, rows, &mine));
        RANK_OK(s, tp_comm_debug_begin(dbg));
        RANK_OK(s, loss_of(m, mine, &loss));
        RANK_OK(s, tp_backward(loss, NULL));
        /* the averaged gradients, read right after backward: a read waits
         * for its bucket's all_reduce (and copy out) first; step 1 reads
         * them after an explicit sync */
        if (step == 1)
            RANK_OK(s, tp_ddp_sync(ddp));
        for (int i = 0; i < NPARAM; i++)
            expect_close(s, tp_tensor_grad(param(m, i)), c->ref->grad[step][i], grad_what,
                         pnames[i], step);
        RANK_OK(s, c->adam ? tp_adam_step(opt) : tp_sgd_step(m, LR));
        RANK_OK(s, tp_comm_debug_end(dbg));
        /* one all_reduce per bucket of the schedule this step ran (the
         * schedule is rebuilt in the first step's ready order after it) */
        if (step > 0) {
            int64_t want = tp_step_graph_num_buckets(tp_ddp_graph(ddp));
            int64_t got = tp_comm_debug_count(dbg, TP_COLL_ALL_REDUCE);
            RANK_EXPECT(s, got == want && tp_comm_debug_total(dbg) == want,
                        "%s: step %d: %lld all_reduces (%lld collectives), %lld buckets",
                        cfg_name[c->cfg], step,
                        (long long)got, (long long)tp_comm_debug_total(dbg), (long long)want);
        }
        if (step == 1 && (c->cfg == CFG_VIEWS || c->cfg == CFG_DEFAULT_VIEWS)) {
            /* gradients live in their bucket: net2's two share it */
            tp_tensor *gw = tp_tensor_grad(param(m, 2)), *gb = tp_tensor_grad(param(m, 3));
            RANK_EXPECT(s, gw && gb && tp_tensor_shares_storage(gw, gb),
                        "%s: net2's gradients are not views of one bucket", cfg_name[c->cfg]);
        }
        tp_module_zero_grad(m);
        for (int i = 0; i < NPARAM; i++)
            expect_close(s, param(m, i), c->ref->after[step][i], param_what, pnames[i],
                         step);
        tp_tensor_release(loss);
        tp_tensor_release(mine);
        tp_tensor_release(x);
    }
    tp_comm_debug_free(dbg);
    tp_adam_free(opt);
    tp_ddp_free(ddp);
    tp_module_free(m);
    return TP_OK;
}

typedef struct dp_param {
    int world;
    dp_cfg cfg;
} dp_param;

ParameterizedTestParameters(dp, equals_whole_batch_training)
{
    static dp_param p[5 * 8];
    static const int worlds[] = TP_TEST_WORLD_SIZES;
    int k = 0;
    for (int w = 0; w < TP_TEST_N_WORLD_SIZES; w++)
        for (int c = CFG_PLAIN; c <= CFG_ONE_IN_FLIGHT; c++)
            p[k++] = (dp_param){worlds[w], (dp_cfg)c};
    return cr_make_param_array(dp_param, p, (size_t)k);
}

ParameterizedTest(dp_param *p, dp, equals_whole_batch_training, .timeout = 120)
{
    for (int adam = 0; adam <= 1; adam++) {
        ref_run ref = {0};
        reference(adam, &ref);
        dp_ctx c = {.ref = &ref, .cfg = p->cfg, .adam = adam};
        tp_test_run(p->world, dp_body, &c, c.slot);
        ref_free(&ref);
    }
}

/* Dropping the gradients while the step's all_reduces are in flight
 * (tp_module_zero_grad right after backward) waits for them first and drops
 * the gradients for good: the step that follows has nothing to apply (the
 * schedule's late copy out does not bring them back), and the next step
 * trains as the first would have. */
static tp_status zero_pending_body(tp_comm *w, void *arg)
{
    dp_ctx *c = arg;
    int rank = tp_comm_rank(w), n = tp_comm_size(w);
    tp_test_slot *s = &c->slot[rank];
    tp_module *m = NULL;
    tp_ddp *ddp = NULL;
    tp_tensor *init[NPARAM] = {0};
    RANK_OK(s, make_mlp(&m));
    RANK_OK(s, configure(m, w, c->cfg, &ddp));
    for (int i = 0; i < NPARAM; i++)
        RANK_OK(s, tp_tensor_clone(param(m, i), &init[i]));
    const int64_t rows = BATCH / n;
    for (int step = 0; step < 2; step++) {
        tp_tensor *x = NULL, *mine = NULL, *loss = NULL;
        RANK_OK(s, batch(0, &x));
        RANK_OK(s, tp_tensor_narrow(x, 0, rank * rows, rows, &mine));
        RANK_OK(s, loss_of(m, mine, &loss));
        RANK_OK(s, tp_backward(loss, NULL));
        if (step == 0) {
            tp_module_zero_grad(m);
            for (int i = 0; i < NPARAM; i++)
                RANK_EXPECT(s, tp_tensor_grad(param(m, i)) == NULL,
                            "%s: %s has a gradient after zero_grad", cfg_name[c->cfg], pnames[i]);
        }
        RANK_OK(s, tp_sgd_step(m, LR));
        for (int i = 0; i < NPARAM; i++) {
            if (step == 0) {
                bool same = false;
                RANK_OK(s, tp_tensor_equal(param(m, i), init[i], &same));
                RANK_EXPECT(s, same && tp_tensor_grad(param(m, i)) == NULL,
                            "%s: the step after zero_grad changed %s or gave it a gradient",
                            cfg_name[c->cfg], pnames[i]);
            } else {
                expect_close(s, param(m, i), c->ref->after[0][i], "after a dropped step",
                             pnames[i], step);
            }
        }
        tp_module_zero_grad(m);
        tp_tensor_release(loss);
        tp_tensor_release(mine);
        tp_tensor_release(x);
    }
    for (int i = 0; i < NPARAM; i++)
        tp_tensor_release(init[i]);
    tp_ddp_free(ddp);
    tp_module_free(m);
    return TP_OK;
}

ParameterizedTestParameters(dp, zero_grad_during_a_pending_step)
{
    static dp_param p[3 * 8];
    int k = 0;
    for (int w = 2; w <= 4; w++)
        for (int c = CFG_PLAIN; c <= CFG_ONE_IN_FLIGHT; c++)
            p[k++] = (dp_param){w, (dp_cfg)c};
    return cr_make_param_array(dp_param, p, (size_t)k);
}

ParameterizedTest(dp_param *p, dp, zero_grad_during_a_pending_step, .timeout = 60)
{
    ref_run ref = {0};
    reference(false, &ref);
    dp_ctx c = {.ref = &ref, .cfg = p->cfg};
    tp_test_run(p->world, zero_pending_body, &c, c.slot);
    ref_free(&ref);
}

/* ---- DP x TP on a 2-D mesh ----------------------------------------------------- */

/* A ("dp", "tp") mesh: the MLP is Colwise/Rowwise on the "tp" slice, DDP
 * averages over the "dp" dim, each dp group trains on its share of the batch
 * (the tp ranks of a group on the same rows). Equals the whole-batch run. */
typedef struct dptp_ctx {
    tp_test_slot slot[TP_TEST_MAX_RANKS];
    const ref_run *ref;
    int dp, tp;
    bool views;
} dptp_ctx;

typedef struct full_check {
    tp_test_slot *s;
    const ref_run *ref;
    int step, seen;
} full_check;

static tp_status check_full(const char *fqn, tp_tensor *full, void *arg)
{
    full_check *k = arg;
    for (int i = 0; i < NPARAM; i++) {
        if (strcmp(fqn, pnames[i]) != 0)
            continue;
        expect_close(k->s, full, k->ref->after[k->step][i], "the parameter", fqn, k->step);
        k->seen++;
    }
    return TP_OK;
}

static tp_status dptp_body(tp_comm *w, void *arg)
{
    dptp_ctx *c = arg;
    int rank = tp_comm_rank(w);
    tp_test_slot *s = &c->slot[rank];
    tp_mesh *mesh = NULL, *tpm = NULL;
    tp_module *m = NULL;
    tp_style *col = NULL, *row = NULL;
    tp_ddp *ddp = NULL;
    tp_comm_debug *dbg = NULL;
    const char *const names[2] = {"dp", "tp"};
    RANK_OK(s, tp_mesh_create(w, 2, (int64_t[]){c->dp, c->tp}, names, &mesh));
    RANK_OK(s, tp_mesh_slice(mesh, 1, (const char *const[]){"tp"}, &tpm));
    RANK_OK(s, make_mlp(&m));
    RANK_OK(s, tp_colwise_parallel_create(NULL, &col));
    RANK_OK(s, tp_rowwise_parallel_create(NULL, &row));
    const tp_plan_entry plan[] = {{"net1", col}, {"net2", row}};
    RANK_OK(s, tp_parallelize_module(m, tpm, 2, plan, NULL));
    RANK_OK(s, tp_module_init(m, SEED));
    tp_comm *dpc = tp_mesh_comm(mesh, tp_mesh_dim_index(mesh, "dp"));
    tp_ddp_options o = {.bucket_cap_bytes = 300, .gradient_as_bucket_view = c->views};
    RANK_OK(s, tp_ddp_create(m, dpc, &o, &ddp));
    {
        /* a gradient must be a DTensor on the parameter's own mesh */
        tp_tensor *w1 = param(m, 0), *full = NULL, *other = NULL;
        tp_status st = tp_tensor_zeros(TP_F32, TP_CPU, 2, (int64_t[]){HID, IN}, &full);
        const tp_placement rep[2] = {tp_replicate(), tp_replicate()};
        if (st == TP_OK)
            st = tp_dtensor_distribute(mesh, full, 2, rep, -1, &other);
        RANK_OK(s, st);
        st = tp_tensor_set_grad(w1, other);
        RANK_EXPECT(s, st == TP_ERR_INVALID_ARG && strstr(tp_last_error(), "another mesh"),
                    "a gradient on the 2-D mesh: %s (%s)", tp_status_name(st), tp_last_error());
        st = tp_tensor_set_grad(w1, full);
        RANK_EXPECT(s, st == TP_ERR_INVALID_ARG && strstr(tp_last_error(), "plain"),
                    "a plain gradient for a DTensor: %s (%s)", tp_status_name(st),
                    tp_last_error());
        RANK_EXPECT(s, tp_tensor_grad(w1) == NULL, "a refused gradient was installed");
        tp_tensor_release(other);
        tp_tensor_release(full);
    }
    RANK_OK(s, tp_comm_debug_create(&dbg));
    const int64_t rows = BATCH / c->dp, coord = tp_mesh_coord(mesh, 0);
    for (int step = 0; step < STEPS; step++) {
        tp_tensor *x = NULL, *mine = NULL, *loss = NULL;
        RANK_OK(s, batch(step, &x));
        RANK_OK(s, tp_tensor_narrow(x, 0, coord * rows, rows, &mine));
        RANK_OK(s, tp_comm_debug_begin(dbg));
        RANK_OK(s, loss_of(m, mine, &loss));
        RANK_OK(s, tp_backward(loss, NULL));
        RANK_OK(s, tp_sgd_step(m, LR));
        RANK_OK(s, tp_comm_debug_end(dbg));
        /* TP: one all_reduce in forward (net2), when tp > 1; DP: one per
         * bucket, in backward */
        if (step > 0) {
            int64_t nb = tp_step_graph_num_buckets(tp_ddp_graph(ddp));
            int64_t fwd = tp_comm_debug_module_count(dbg, TP_COMM_DEBUG_GLOBAL, TP_PHASE_FORWARD,
                                                     TP_COLL_ALL_REDUCE);
            int64_t bwd = tp_comm_debug_module_count(dbg, TP_COMM_DEBUG_GLOBAL, TP_PHASE_BACKWARD,
                                                     TP_COLL_ALL_REDUCE);
            RANK_EXPECT(s, fwd == (c->tp > 1 ? 1 : 0) && bwd == nb,
                        "step %d: all_reduces forward %lld (want %d), backward %lld (want %lld "
                        "buckets)", step, (long long)fwd, c->tp > 1 ? 1 : 0, (long long)bwd,
                        (long long)nb);
            /* the TP all_reduce is net2's; the buckets' run from gradient
             * hooks, outside any module scope */
            tp_test_scope_count_is(s, dbg, "net2", TP_PHASE_FORWARD, TP_COLL_ALL_REDUCE,
                                   c->tp > 1 ? 1 : 0, "dp x tp");
            tp_test_scope_count_is(s, dbg, TP_COMM_DEBUG_ROOT, TP_PHASE_BACKWARD,
                                   TP_COLL_ALL_REDUCE, 0, "dp x tp");
        }
        tp_module_zero_grad(m);
        full_check k = {.s = s, .ref = c->ref, .step = step};
        RANK_OK(s, tp_module_state_dict(m, check_full, &k));
        RANK_EXPECT(s, k.seen == NPARAM, "state dict had %d of the %d parameters", k.seen, NPARAM);
        tp_tensor_release(loss);
        tp_tensor_release(mine);
        tp_tensor_release(x);
    }
    tp_comm_debug_free(dbg);
    tp_ddp_free(ddp);
    tp_module_free(m);
    tp_style_free(col);
    tp_style_free(row);
    tp_mesh_free(tpm);
    tp_mesh_free(mesh);
    return TP_OK;
}

typedef struct dptp_param {
    int dp, tp;
    bool views;
} dptp_param;

ParameterizedTestParameters(dp, dp_x_tp_equals_whole_batch)
{
    static dptp_param p[] = {{2, 2, false}, {2, 2, true}, {1, 4, false}, {4, 1, true},
                             {2, 4, false}, {4, 2, true}, {3, 2, false}, {2, 3, true}};
    return cr_make_param_array(dptp_param, p, sizeof p / sizeof p[0]);
}

ParameterizedTest(dptp_param *p, dp, dp_x_tp_equals_whole_batch, .timeout = 120)
{
    ref_run ref = {0};
    reference(false, &ref);
    dptp_ctx c = {.ref = &ref, .dp = p->dp, .tp = p->tp, .views = p->views};
    tp_test_run(p->dp * p->tp, dptp_body, &c, c.slot);
    ref_free(&ref);
}

/* ---- tied weights ------------------------------------------------------------ */

/* logits = head(emb(idx)) with head.weight = emb.weight (GPT-style tying);
 * TIE_ONE is the same model written with one parameter (no head: the
 * forward applies emb.weight with tp_linear); TIE_VIEW ties through a second
 * handle over the same storage. */
enum { TV = 6, TD = 4, TN = 24 };
typedef enum { TIE_ONE, TIE_SAME, TIE_VIEW } tie_kind;

static tp_status tied_fwd(tp_module *self, int nargs, tp_tensor *const *args, int nkw,
                          const tp_kwarg *kw, tp_tensor **out)
{
    (void)nargs, (void)nkw, (void)kw;
    tp_module *emb = tp_module_child(self, "emb"), *head = tp_module_child(self, "head");
    tp_tensor *h = NULL;
    TP_TEST_TRY(tp_module_call(emb, args[0], &h));
    tp_status st = head ? tp_module_call(head, h, out)
                        : tp_linear(h, tp_module_parameter(emb, "weight"), NULL, out);
    tp_tensor_release(h);
    return st;
}

static tp_status tied_model(tie_kind kind, tp_module **out)
{
    tp_module *m = NULL, *emb = NULL, *head = NULL;
    TP_TEST_TRY(tp_nn_custom_create("Tied", tied_fwd, NULL, NULL, &m));
    tp_status st = tp_nn_embedding_create(TV, TD, &emb);
    if (st == TP_OK && (st = tp_module_add_child(m, "emb", emb)) != TP_OK)
        tp_module_free(emb);
    if (st == TP_OK && kind != TIE_ONE &&
        (st = tp_nn_linear_create(TD, TV, false, &head)) == TP_OK &&
        (st = tp_module_add_child(m, "head", head)) != TP_OK)
        tp_module_free(head);
    if (st == TP_OK && kind != TIE_ONE) {
        tp_tensor *w = tp_module_parameter(emb, "weight"), *v = NULL;
        if (kind == TIE_VIEW)
            st = tp_tensor_view(w, 2, (int64_t[]){TV, TD}, &v);
        if (st == TP_OK)
            st = tp_module_set_parameter(head, "weight", v ? v : w);
        tp_tensor_release(v);
    }
    if (st == TP_OK)
        st = tp_module_init(m, SEED);
    if (st != TP_OK) {
        tp_module_free(m);
        return st;
    }
    *out = m;
    return TP_OK;
}

/* The tokens of step s, rows [first, first + n) of TN. */
static tp_status tied_tokens(int s, int64_t first, int64_t n, tp_tensor **out)
{
    tp_tensor *all = NULL;
    TP_TEST_TRY(tp_tensor_zeros(TP_I64, TP_CPU, 1, (int64_t[]){TN}, &all));
    tp_status st = tp_tensor_fill_random(all, TP_RNG_RANDINT, 0, TV, 300 + (uint64_t)s, NULL, NULL);
    tp_tensor *v = NULL;
    if (st == TP_OK)
        st = tp_tensor_narrow(all, 0, first, n, &v);
    if (st == TP_OK)
        st = tp_tensor_clone(v, out);
    tp_tensor_release(v);
    tp_tensor_release(all);
    return st;
}

/* loss = mean(logits * logits) over this rank's tokens */
static tp_status tied_loss(tp_module *m, tp_tensor *idx, tp_tensor **loss)
{
    tp_tensor *y = NULL, *sq = NULL;
    TP_TEST_TRY(tp_module_call(m, idx, &y));
    tp_status st = tp_mul(y, y, &sq);
    if (st == TP_OK)
        st = tp_mean_all(sq, loss);
    tp_tensor_release(sq);
    tp_tensor_release(y);
    return st;
}

typedef struct tied_ctx {
    tp_test_slot slot[TP_TEST_MAX_RANKS];
    tp_tensor *after[STEPS][2]; /* the one-parameter model on the whole batch: SGD, Adam */
    tie_kind kind;
    dp_cfg cfg;
} tied_ctx;

static tp_status tied_body(tp_comm *w, void *arg)
{
    tied_ctx *c = arg;
    int rank = tp_comm_rank(w), n = tp_comm_size(w);
    tp_test_slot *s = &c->slot[rank];
    for (int adam = 0; adam <= 1; adam++) {
        tp_module *m = NULL;
        tp_ddp *ddp = NULL;
        tp_adam *opt = NULL;
        tp_comm_debug *dbg = NULL;
        RANK_OK(s, tied_model(c->kind, &m));
        RANK_OK(s, configure(m, w, c->cfg, &ddp));
        if (adam)
            RANK_OK(s, tp_adam_create(m, LR, 0.9, 0.999, 1e-8, &opt));
        RANK_OK(s, tp_comm_debug_create(&dbg));
        /* a tied tensor is one parameter of the step graph; two handles over
         * one storage are two (each holds its own gradient) */
        int want_params = c->kind == TIE_SAME ? 1 : 2;
        RANK_EXPECT(s, tp_step_graph_num_params(tp_ddp_graph(ddp)) == want_params,
                    "%s: the step graph has %d parameters, want %d", cfg_name[c->cfg],
                    tp_step_graph_num_params(tp_ddp_graph(ddp)), want_params);
        tp_tensor *we = tp_module_parameter(tp_module_child(m, "emb"), "weight");
        tp_tensor *wh = tp_module_parameter(tp_module_child(m, "head"), "weight");
        for (int step = 0; step < STEPS; step++) {
            tp_tensor *idx = NULL, *loss = NULL;
            RANK_OK(s, tied_tokens(step, rank * (TN / n), TN / n, &idx));
            RANK_OK(s, tp_comm_debug_begin(dbg));
            RANK_OK(s, tied_loss(m, idx, &loss));
            RANK_OK(s, tp_backward(loss, NULL));
            RANK_OK(s, adam ? tp_adam_step(opt) : tp_sgd_step(m, LR));
            RANK_OK(s, tp_comm_debug_end(dbg));
            /* the tied weight is bucketed and all_reduced once: one
             * all_reduce per bucket, its bytes those of one [TV, TD] weight */
            int64_t nb = tp_step_graph_num_buckets(tp_ddp_graph(ddp));
            int64_t got = tp_comm_debug_count(dbg, TP_COLL_ALL_REDUCE);
            int64_t bytes = tp_comm_debug_bytes(dbg, TP_COLL_ALL_REDUCE);
            int64_t want_bytes = n > 1 ? (int64_t)want_params * TV * TD * 4 : bytes;
            if (step > 0)
                RANK_EXPECT(s, got == nb && bytes == want_bytes,
                            "%s, step %d: %lld all_reduces of %lld bytes, want %lld of %lld",
                            cfg_name[c->cfg], step, (long long)got, (long long)bytes,
                            (long long)nb, (long long)want_bytes);
            tp_module_zero_grad(m);
            const char *what = adam ? "Adam: the tied weight" : "SGD: the tied weight";
            expect_close(s, we, c->after[step][adam], what, "emb.weight", step);
            expect_close(s, wh, c->after[step][adam], what, "head.weight", step);
            tp_tensor_release(loss);
            tp_tensor_release(idx);
        }
        tp_comm_debug_free(dbg);
        tp_adam_free(opt);
        tp_ddp_free(ddp);
        tp_module_free(m);
    }
    return TP_OK;
}

typedef struct tied_param {
    int world;
    tie_kind kind;
    dp_cfg cfg;
} tied_param;

ParameterizedTestParameters(dp, tied_weights_equal_one_parameter)
{
    static tied_param p[5 * 2 * 3];
    static const int worlds[] = TP_TEST_WORLD_SIZES;
    static const dp_cfg cfgs[] = {CFG_PLAIN, CFG_DEFAULT, CFG_DEFAULT_VIEWS};
    int k = 0;
    for (int w = 0; w < TP_TEST_N_WORLD_SIZES; w++)
        for (int t = TIE_SAME; t <= TIE_VIEW; t++)
            for (int c = 0; c < 3; c++)
                p[k++] = (tied_param){worlds[w], (tie_kind)t, cfgs[c]};
    return cr_make_param_array(tied_param, p, (size_t)k);
}

/* DDP over a tied model equals the one-parameter model trained on the whole
 * batch, with SGD and Adam, step by step. */
ParameterizedTest(tied_param *p, dp, tied_weights_equal_one_parameter, .timeout = 120)
{
    tied_ctx c = {.kind = p->kind, .cfg = p->cfg};
    for (int adam = 0; adam <= 1; adam++) {
        tp_module *one = NULL;
        tp_adam *opt = NULL;
        CHECK_OK(tied_model(TIE_ONE, &one));
        if (adam)
            CHECK_OK(tp_adam_create(one, LR, 0.9, 0.999, 1e-8, &opt));
        for (int step = 0; step < STEPS; step++) {
            tp_tensor *idx = NULL, *loss = NULL;
            CHECK_OK(tied_tokens(step, 0, TN, &idx));
            CHECK_OK(tied_loss(one, idx, &loss));
            CHECK_OK(tp_backward(loss, NULL));
            CHECK_OK(adam ? tp_adam_step(opt) : tp_sgd_step(one, LR));
            tp_module_zero_grad(one);
            CHECK_OK(tp_tensor_clone(tp_module_parameter(tp_module_child(one, "emb"), "weight"),
                                     &c.after[step][adam]));
            tp_tensor_release(loss);
            tp_tensor_release(idx);
        }
        tp_adam_free(opt);
        tp_module_free(one);
    }
    tp_test_run(p->world, tied_body, &c, c.slot);
    for (int step = 0; step < STEPS; step++)
        for (int a = 0; a < 2; a++)
            tp_tensor_release(c.after[step][a]);
}

/* ---- a user-written process group of one rank (seed test_c10d_pypg) ------------ */

typedef struct {
    int collectives, waits, tests;
    int polls;     /* polls before a work reports done (0: 1) */
    int fail_from; /* collectives from this number on fail (0: none) */
    bool fail_waits; /* waits fail */
} lonely_state;

typedef struct {
    lonely_state *st;
    int polls_left;
} lonely_work;

static tp_status lonely_collective(void *state, const tp_coll_desc *d, void **work)
{
    lonely_state *s = state;
    if (++s->collectives >= s->fail_from && s->fail_from > 0)
        return TP_ERR_BACKEND;
    if (d->sendbuf != d->recvbuf && d->kind != TP_COLL_BARRIER)
        memcpy(d->recvbuf, d->sendbuf, d->count * tp_dtype_size(d->dtype));
    lonely_work *w = calloc(1, sizeof *w);
    if (!w)
        return TP_ERR_NO_MEMORY;
    w->st = s;
    w->polls_left = s->polls ? s->polls : 1;
    *work = w;
    return TP_OK;
}

static tp_status lonely_test(void *state, void *work, bool *done)
{
    (void)state;
    lonely_work *w = work;
    w->st->tests++;
    *done = w->polls_left-- <= 0;
    return TP_OK;
}

static tp_status lonely_wait(void *state, void *work, double timeout_s)
{
    (void)state, (void)timeout_s;
    lonely_state *s = ((lonely_work *)work)->st;
    s->waits++;
    return s->fail_waits ? TP_ERR_BACKEND : TP_OK;
}

static void lonely_free(void *state, void *work)
{
    (void)state;
    free(work);
}

static const tp_backend lonely_backend = {
    .name = "lonely-pg",
    .device_mask = 1u << TP_DEVICE_CPU,
    .collective = lonely_collective,
    .work_test = lonely_test,
    .work_wait = lonely_wait,
    .work_free = lonely_free,
};

Test(dp, user_process_group_counts_waits_and_polls, .timeout = 30)
{
    /* registered by name, as a user's own backend is */
    CHECK_OK(tp_backend_register(&lonely_backend));
    const tp_backend *be = tp_backend_find("lonely-pg");
    cr_assert_not_null(be);
    for (int views = 0; views <= 1; views++) {
        lonely_state ls = {0};
        tp_comm *pg = NULL;
        CHECK_OK(tp_comm_create(be, &ls, 0, 1, &pg));
        tp_module *m = NULL, *plain = NULL;
        tp_ddp *ddp = NULL;
        CHECK_OK(make_mlp(&m));
        CHECK_OK(make_mlp(&plain));
        tp_ddp_options o = {.gradient_as_bucket_view = views, .bucket_cap_bytes = 300};
        CHECK_OK(tp_ddp_create(m, pg, &o, &ddp));
        cr_assert_str_eq(tp_comm_backend(tp_ddp_comm(ddp)), "lonely-pg");
        cr_assert_eq(tp_ddp_module(ddp), m);
        tp_tensor *x = NULL, *loss = NULL, *loss2 = NULL;
        CHECK_OK(batch(0, &x));
        for (int step = 0; step < 2; step++) { /* the second uses the views */
            tp_module_zero_grad(m);
            tp_module_zero_grad(plain);
            CHECK_OK(loss_of(m, x, &loss));
            int c0 = ls.collectives, w0 = ls.waits;
            CHECK_OK(tp_backward(loss, NULL));
            /* every bucket's all_reduce was launched inside backward; none
             * was waited for yet (late waits): that happens at the sync */
            int nb = tp_step_graph_num_buckets(tp_ddp_graph(ddp));
            cr_assert_eq(ls.collectives - c0, nb, "step %d: %d all_reduces launched in "
                         "backward, %d buckets", step, ls.collectives - c0, nb);
            cr_assert_eq(ls.waits, w0, "step %d: a bucket was waited for inside backward", step);
            CHECK_OK(tp_ddp_sync(ddp));
            /* (buckets the polls during backward found complete need no wait) */
            cr_assert(ls.waits - w0 >= 1 && ls.waits - w0 <= nb,
                      "step %d: %d waits at the sync for %d buckets", step, ls.waits - w0, nb);
            CHECK_OK(loss_of(plain, x, &loss2));
            CHECK_OK(tp_backward(loss2, NULL));
            for (int i = 0; i < NPARAM; i++) {
                bool same = false;
                CHECK_OK(tp_tensor_allclose(tp_tensor_grad(param(m, i)),
                                            tp_tensor_grad(param(plain, i)), 0, 0, &same));
                cr_assert(same, "views %d step %d: %s's gradient differs from the plain "
                          "module's", views, step, pnames[i]);
            }
            tp_tensor_release(loss);
            tp_tensor_release(loss2);
        }
        cr_assert(ls.waits > 0 && ls.tests > 0, "waits %d, polls %d", ls.waits, ls.tests);
        cr_assert_geq(ls.collectives, 3, "wrap's agreement, broadcasts and the buckets");
        tp_tensor_release(x);
        tp_ddp_free(ddp);
        tp_module_free(plain);
        tp_module_free(m);
        tp_comm_free(pg);
    }
}

/* max_in_flight = 1: launching a bucket first waits for the one before, so
 * a backward of nb buckets waits nb - 1 times and the sync once. */
Test(dp, one_bucket_in_flight, .timeout = 30)
{
    lonely_state ls = {.polls = 1 << 30}; /* polling never completes a work */
    tp_comm *pg = NULL;
    tp_module *m = NULL;
    tp_ddp *ddp = NULL;
    CHECK_OK(tp_comm_create(&lonely_backend, &ls, 0, 1, &pg));
    CHECK_OK(make_mlp(&m));
    CHECK_OK(
        tp_ddp_create(m, pg, &(tp_ddp_options){.bucket_cap_bytes = 300, .max_in_flight = 1}, &ddp));
    tp_tensor *x = NULL, *loss = NULL;
    CHECK_OK(batch(0, &x));
    for (int step = 0; step < 2; step++) {
        CHECK_OK(loss_of(m, x, &loss));
        int w0 = ls.waits;
        CHECK_OK(tp_backward(loss, NULL));
        int nb = tp_step_graph_num_buckets(tp_ddp_graph(ddp));
        cr_assert_geq(nb, 2);
        cr_assert_eq(ls.waits - w0, nb - 1, "step %d: %d waits in backward for %d buckets", step,
                     ls.waits - w0, nb);
        CHECK_OK(tp_sgd_step(m, LR));
        /* (+1 in the first step: the blocking broadcast of rank 0's ready order) */
        cr_assert_eq(ls.waits - w0, nb + (step == 0), "step %d: %d waits for %d buckets", step,
                     ls.waits - w0, nb);
        tp_module_zero_grad(m);
        tp_tensor_release(loss);
    }
    tp_tensor_release(x);
    tp_ddp_free(ddp);
    tp_module_free(m);
    tp_comm_free(pg);
}

/* Late waits stay late when gradients are read before the step: reading one
 * waits for its own bucket only (once), the step waits for the rest, and no
 * collective is issued again. */
Test(dp, gradient_read_waits_for_its_bucket_only, .timeout = 60)
{
    static const dp_cfg cfgs[] = {CFG_LATE, CFG_FUSION_LATE, CFG_VIEWS};
    for (size_t k = 0; k < sizeof cfgs / sizeof cfgs[0]; k++) {
        lonely_state ls = {.polls = 1 << 30}; /* polling never completes a work */
        tp_comm *pg = NULL;
        tp_module *m = NULL, *plain = NULL;
        tp_ddp *ddp = NULL;
        CHECK_OK(tp_comm_create(&lonely_backend, &ls, 0, 1, &pg));
        CHECK_OK(make_mlp(&m));
        CHECK_OK(make_mlp(&plain));
        CHECK_OK(configure(m, pg, cfgs[k], &ddp));
        tp_tensor *x = NULL;
        CHECK_OK(batch(0, &x));
        for (int step = 0; step < 2; step++) {
            tp_tensor *loss = NULL, *loss2 = NULL;
            CHECK_OK(loss_of(m, x, &loss));
            int w0 = ls.waits;
            CHECK_OK(tp_backward(loss, NULL));
            const tp_step_graph *g = tp_ddp_graph(ddp);
            int nb = tp_step_graph_num_buckets(g), c0 = ls.collectives;
            cr_assert_eq(ls.waits, w0, "%s, step %d: a bucket was waited for inside backward",
                         cfg_name[cfgs[k]], step);
            CHECK_OK(loss_of(plain, x, &loss2));
            CHECK_OK(tp_backward(loss2, NULL));
            bool seen[NPARAM] = {false};
            int waited = 0;
            for (int i = NPARAM - 1; i >= 0; i--) {
                int b = tp_step_graph_bucket_of(g, i), before = ls.waits;
                tp_tensor *gr = tp_tensor_grad(param(m, i));
                cr_assert_not_null(gr, "%s: %s: %s", cfg_name[cfgs[k]], pnames[i],
                                   tp_last_error());
                cr_assert_eq(ls.waits - before, seen[b] ? 0 : 1,
                             "%s, step %d: reading %s (bucket %d) waited %d times",
                             cfg_name[cfgs[k]], step, pnames[i], b, ls.waits - before);
                cr_assert_eq(tp_tensor_grad(param(m, i)), gr);
                cr_assert_eq(ls.waits - before, seen[b] ? 0 : 1, "a second read waited again");
                waited += !seen[b];
                seen[b] = true;
                bool same = false;
                CHECK_OK(tp_tensor_allclose(gr, tp_tensor_grad(param(plain, i)), 0, 0, &same));
                cr_assert(same, "%s: %s's gradient differs from the plain module's",
                          cfg_name[cfgs[k]], pnames[i]);
            }
            cr_assert_eq(waited, nb, "%s: %d buckets waited for by the reads, %d buckets",
                         cfg_name[cfgs[k]], waited, nb);
            int before = ls.waits;
            CHECK_OK(tp_sgd_step(m, LR));
            /* (step 0: the blocking broadcast of rank 0's ready order) */
            cr_assert_eq(ls.waits - before, step == 0, "%s, step %d: the step waited %d times "
                         "after every bucket was read", cfg_name[cfgs[k]], step,
                         ls.waits - before);
            cr_assert_eq(ls.collectives - c0, step == 0, "%s, step %d: %d collectives issued "
                         "after backward", cfg_name[cfgs[k]], step, ls.collectives - c0);
            CHECK_OK(tp_sgd_step(plain, LR));
            tp_module_zero_grad(m);
            tp_module_zero_grad(plain);
            tp_tensor_release(loss);
            tp_tensor_release(loss2);
        }
        tp_tensor_release(x);
        tp_ddp_free(ddp);
        tp_module_free(plain);
        tp_module_free(m);
        tp_comm_free(pg);
    }
}

/* A collective that fails inside backward fails the backward; the DDP then
 * refuses every later step (and the optimizer step it guards) naming the
 * failure, leaves the parameters alone, and still frees cleanly. */
Test(dp, failed_step_is_sticky, .timeout = 30)
{
    lonely_state ls = {0};
    tp_comm *pg = NULL;
    tp_module *m = NULL;
    tp_ddp *ddp = NULL;
    CHECK_OK(tp_comm_create(&lonely_backend, &ls, 0, 1, &pg));
    CHECK_OK(make_mlp(&m));
    CHECK_OK(tp_ddp_create(m, pg, &(tp_ddp_options){.bucket_cap_bytes = 300}, &ddp));
    ls.fail_from = ls.collectives + 1; /* the first bucket's all_reduce */
    tp_tensor *x = NULL, *loss = NULL, *before = NULL;
    CHECK_OK(tp_tensor_clone(param(m, 0), &before));
    CHECK_OK(batch(0, &x));
    CHECK_OK(loss_of(m, x, &loss));
    CHECK_ERR(tp_backward(loss, NULL), TP_ERR_BACKEND);
    CHECK_ERR(tp_ddp_sync(ddp), TP_ERR_STATE);
    cr_assert(strstr(tp_last_error(), "earlier step"), "%s", tp_last_error());
    CHECK_ERR(tp_sgd_step(m, LR), TP_ERR_STATE);
    bool same = false;
    CHECK_OK(tp_tensor_allclose(param(m, 0), before, 0, 0, &same));
    cr_assert(same, "a refused step changed net1.weight");
    tp_tensor_release(loss);
    loss = NULL;
    CHECK_OK(loss_of(m, x, &loss)); /* forward still works; the DDP stays quiet */
    CHECK_ERR(tp_backward(loss, NULL), TP_ERR_STATE);
    tp_tensor_release(loss);
    tp_tensor_release(before);
    tp_tensor_release(x);
    tp_ddp_free(ddp);
    tp_module_free(m);
    tp_comm_free(pg);
}

/* A read of a gradient whose bucket's wait fails returns NULL with the
 * failure in tp_last_error and fails the DDP (sticky): the sync, the step
 * and later reads say so; dropping the gradients still works, and once the
 * DDP is freed the parameters' gradients are plain again. */
Test(dp, failed_gradient_read_is_sticky, .timeout = 30)
{
    lonely_state ls = {.polls = 1 << 30};
    tp_comm *pg = NULL;
    tp_module *m = NULL;
    tp_ddp *ddp = NULL;
    CHECK_OK(tp_comm_create(&lonely_backend, &ls, 0, 1, &pg));
    CHECK_OK(make_mlp(&m));
    CHECK_OK(tp_ddp_create(m, pg, &(tp_ddp_options){.bucket_cap_bytes = 300}, &ddp));
    tp_tensor *x = NULL, *loss = NULL, *before = NULL;
    CHECK_OK(tp_tensor_clone(param(m, 3), &before));
    CHECK_OK(batch(0, &x));
    CHECK_OK(loss_of(m, x, &loss));
    CHECK_OK(tp_backward(loss, NULL));
    ls.fail_waits = true;
    tp_clear_error();
    cr_assert_null(tp_tensor_grad(param(m, 3)), "a failed wait returned a gradient");
    cr_assert(strstr(tp_last_error(), "waiting for the data-parallel all_reduce of the gradient "
                                      "of 'net2.bias'"), "%s", tp_last_error());
    tp_clear_error();
    cr_assert_null(tp_tensor_grad(param(m, 0)), "a read after the failure returned a gradient");
    cr_assert(strstr(tp_last_error(), "an earlier step of this DDP failed"), "%s",
              tp_last_error());
    CHECK_ERR(tp_ddp_sync(ddp), TP_ERR_STATE);
    CHECK_ERR(tp_sgd_step(m, LR), TP_ERR_STATE);
    bool same = false;
    CHECK_OK(tp_tensor_allclose(param(m, 3), before, 0, 0, &same));
    cr_assert(same, "a refused step changed net2.bias");
    CHECK_ERR(tp_tensor_set_grad(param(m, 3), before), TP_ERR_STATE);
    tp_module_zero_grad(m);
    tp_ddp_free(ddp);
    cr_assert_null(tp_tensor_grad(param(m, 3)));
    CHECK_OK(tp_tensor_set_grad(param(m, 3), before));
    cr_assert_eq(tp_tensor_grad(param(m, 3)), before);
    tp_tensor_release(loss);
    tp_tensor_release(before);
    tp_tensor_release(x);
    tp_module_free(m);
    tp_comm_free(pg);
}

/* A failed settle names the function that reached the gradient: a
 * replacement (tp_tensor_set_grad) whose wait fails says so, not
 * tp_tensor_grad, and so do the refusals after it. */
Test(dp, failed_settle_names_its_caller, .timeout = 30)
{
    lonely_state ls = {.polls = 1 << 30};
    tp_comm *pg = NULL;
    tp_module *m = NULL;
    tp_ddp *ddp = NULL;
    CHECK_OK(tp_comm_create(&lonely_backend, &ls, 0, 1, &pg));
    CHECK_OK(make_mlp(&m));
    CHECK_OK(tp_ddp_create(m, pg, &(tp_ddp_options){.bucket_cap_bytes = 300}, &ddp));
    tp_tensor *x = NULL, *loss = NULL, *g = NULL;
    CHECK_OK(tp_tensor_clone(param(m, 3), &g));
    CHECK_OK(batch(0, &x));
    CHECK_OK(loss_of(m, x, &loss));
    CHECK_OK(tp_backward(loss, NULL));
    ls.fail_waits = true;
    tp_clear_error();
    CHECK_ERR(tp_tensor_set_grad(param(m, 3), g), TP_ERR_BACKEND);
    const char *e = tp_last_error();
    cr_assert(strstr(e, "tp_tensor_set_grad: waiting for the data-parallel all_reduce of the "
                        "gradient of 'net2.bias'") == e && !strstr(e, "tp_tensor_grad"),
              "%s", e);
    tp_clear_error();
    cr_assert_null(tp_tensor_grad(param(m, 0)));
    e = tp_last_error();
    cr_assert(strstr(e, "tp_tensor_grad: an earlier step of this DDP failed") == e, "%s", e);
    tp_clear_error();
    CHECK_ERR(tp_tensor_set_grad(param(m, 3), g), TP_ERR_STATE);
    e = tp_last_error();
    cr_assert(strstr(e, "tp_tensor_set_grad: an earlier step of this DDP failed") == e &&
                  !strstr(e, "tp_tensor_grad"),
              "%s", e);
    tp_module_zero_grad(m);
    tp_ddp_free(ddp);
    tp_tensor_release(loss);
    tp_tensor_release(g);
    tp_tensor_release(x);
    tp_module_free(m);
    tp_comm_free(pg);
}

/* A DDP's step graph belongs to the DDP: tp_step_graph_free on it is a no-op
 * (as tp_module_free on a child), the DDP keeps working, and tp_ddp_free
 * frees it. */
static tp_test_alloc graph_alloc;

Test(dp, ddp_graph_is_the_ddps, .timeout = 30)
{
    tp_allocator a = {tp_test_alloc_fn, tp_test_free_fn, &graph_alloc};
    graph_alloc = (tp_test_alloc){0, 0, -1};
    CHECK_OK(tp_set_allocator(&a));
    lonely_state ls = {0};
    tp_comm *pg = NULL;
    tp_module *m = NULL;
    tp_ddp *ddp = NULL;
    CHECK_OK(tp_comm_create(&lonely_backend, &ls, 0, 1, &pg));
    long before = graph_alloc.live;
    CHECK_OK(make_mlp(&m));
    CHECK_OK(tp_ddp_create(m, pg, &(tp_ddp_options){.bucket_cap_bytes = 300}, &ddp));
    long with = graph_alloc.live;
    tp_step_graph *g = tp_ddp_graph(ddp);
    int nb = tp_step_graph_num_buckets(g);
    tp_step_graph_free(g);
    cr_assert_eq(graph_alloc.live, with, "freeing the DDP's graph freed %ld blocks",
                 with - graph_alloc.live);
    cr_assert_eq(tp_ddp_graph(ddp), g);
    cr_assert_eq(tp_step_graph_num_buckets(g), nb);
    tp_tensor *x = NULL, *loss = NULL;
    CHECK_OK(batch(0, &x));
    CHECK_OK(loss_of(m, x, &loss));
    CHECK_OK(tp_backward(loss, NULL));
    CHECK_OK(tp_sgd_step(m, LR));
    tp_tensor_release(loss);
    tp_tensor_release(x);
    tp_ddp_free(ddp);
    tp_module_free(m); /* with the hooks the DDP left on it */
    cr_assert_eq(graph_alloc.live, before, "%ld blocks left", graph_alloc.live - before);
    tp_comm_free(pg);
    tp_set_allocator(NULL);
}

/* ---- passes ---------------------------------------------------------------------- */

static tp_status noop_pass(tp_step_graph *g, void *ctx)
{
    (void)g;
    ++*(int *)ctx;
    return TP_OK;
}

static int runs1, runs2, runs3;
extern const tp_pass my_pass1, my_pass2, my_pass3;
static const tp_pass *const needs1[] = {&my_pass1, NULL};
const tp_pass my_pass1 = {"my_pass1", NULL, NULL, noop_pass, &runs1};
const tp_pass my_pass2 = {"my_pass2", needs1, NULL, noop_pass, &runs2};
const tp_pass my_pass3 = {"my_pass3", NULL, needs1, noop_pass, &runs3};

static tp_step_graph *graph(void)
{
    tp_step_graph *g = NULL;
    /* sizes in floats: 100, 10, 200, 20, 50 */
    CHECK_OK(tp_step_graph_create(5, (int64_t[]){100, 10, 200, 20, 50}, TP_F32, 480, &g));
    return g;
}

Test(dp, pass_order, .timeout = 10)
{
    /* happy: 1, 3, 2 */
    tp_step_graph *g = graph();
    CHECK_OK(tp_pass_apply(&my_pass1, g));
    CHECK_OK(tp_pass_apply(&my_pass3, g));
    CHECK_OK(tp_pass_apply(&my_pass2, g));
    cr_assert_eq(runs1 + runs2 + runs3, 3);
    cr_assert_eq(tp_step_graph_num_applied(g), 3);
    cr_assert_str_eq(tp_step_graph_applied(g, 1), "my_pass3");
    tp_step_graph_free(g);

    /* prerequisites missing */
    g = graph();
    CHECK_ERR(tp_pass_apply(&my_pass2, g), TP_ERR_STATE);
    cr_assert(strstr(tp_last_error(), "[my_pass1] are the prerequisites of my_pass2"),
              "%s", tp_last_error());
    cr_assert_eq(tp_step_graph_num_applied(g), 0, "a refused pass is not recorded");
    tp_step_graph_free(g);

    /* run order wrong: 3 then 1 */
    g = graph();
    CHECK_OK(tp_pass_apply(&my_pass3, g));
    CHECK_ERR(tp_pass_apply(&my_pass1, g), TP_ERR_STATE);
    cr_assert(strstr(tp_last_error(), "my_pass3 must be applied after my_pass1"), "%s",
              tp_last_error());
    CHECK_ERR(tp_pass_apply(NULL, g), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_pass_apply(&my_pass1, NULL), TP_ERR_INVALID_ARG);
    tp_step_graph_free(g);

    /* the built-in ones follow the same rules */
    g = graph();
    CHECK_ERR(tp_pass_apply(tp_pass_remove_copies(), g), TP_ERR_STATE);
    cr_assert(strstr(tp_last_error(), "[bucket_fusion] are the prerequisites of remove_copies"),
              "%s", tp_last_error());
    CHECK_OK(tp_pass_apply(tp_pass_late_waits(), g));
    CHECK_ERR(tp_pass_apply(tp_pass_bucket_fusion(), g), TP_ERR_STATE);
    cr_assert(strstr(tp_last_error(), "late_waits must be applied after bucket_fusion"), "%s",
              tp_last_error());
    tp_step_graph_free(g);
}

static char *schedule(const tp_step_graph *g)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    cr_assert_not_null(f);
    CHECK_OK(tp_step_graph_write(g, f));
    fclose(f);
    return buf;
}

Test(dp, builtin_pass_schedules, .timeout = 10)
{
    tp_step_graph *g = graph();
    /* plain: every parameter on its own, in reverse registration order */
    cr_assert_eq(tp_step_graph_num_buckets(g), 5);
    char *s = schedule(g);
    cr_assert_str_eq(s, "ready param4\nall_reduce b0 (1 params, 50 elements)\n"
                        "wait b0 (1 params, 50 elements)\n"
                        "ready param3\nall_reduce b1 (1 params, 20 elements)\n"
                        "wait b1 (1 params, 20 elements)\n"
                        "ready param2\nall_reduce b2 (1 params, 200 elements)\n"
                        "wait b2 (1 params, 200 elements)\n"
                        "ready param1\nall_reduce b3 (1 params, 10 elements)\n"
                        "wait b3 (1 params, 10 elements)\n"
                        "ready param0\nall_reduce b4 (1 params, 100 elements)\n"
                        "wait b4 (1 params, 100 elements)\nstep\n");
    free(s);
    /* fusion at 480 bytes = 120 floats: {50, 20}, {200}, {10, 100} */
    CHECK_OK(tp_pass_apply(tp_pass_bucket_fusion(), g));
    cr_assert_eq(tp_step_graph_num_buckets(g), 3);
    cr_assert(tp_step_graph_bucket_of(g, 4) == 0 && tp_step_graph_bucket_of(g, 3) == 0 &&
              tp_step_graph_bucket_of(g, 2) == 1 && tp_step_graph_bucket_of(g, 1) == 2 &&
              tp_step_graph_bucket_of(g, 0) == 2);
    cr_assert_eq(tp_step_graph_bucket_of(g, 5), -1);
    CHECK_OK(tp_pass_apply(tp_pass_late_waits(), g));
    CHECK_OK(tp_pass_apply(tp_pass_remove_copies(), g));
    s = schedule(g);
    cr_assert_str_eq(s, "ready param4\nready param3\nall_reduce b0 (2 params, 70 elements)\n"
                        "ready param2\nall_reduce b1 (1 params, 200 elements)\n"
                        "ready param1\nready param0\nall_reduce b2 (2 params, 110 elements)\n"
                        "wait b0 (2 params, 70 elements)\nwait b1 (1 params, 200 elements)\n"
                        "wait b2 (2 params, 110 elements)\nstep\n");
    free(s);
    tp_step_graph_free(g);

    /* fusion alone copies in and out around each all_reduce */
    g = graph();
    CHECK_OK(tp_pass_apply(tp_pass_bucket_fusion(), g));
    s = schedule(g);
    cr_assert(strstr(s, "ready param3\ncopy_in b0 (2 params, 70 elements)\n"
                        "all_reduce b0 (2 params, 70 elements)\nwait b0 (2 params, 70 elements)\n"
                        "copy_out b0 (2 params, 70 elements)\n"), "%s", s);
    free(s);
    tp_step_graph_free(g);

    CHECK_ERR(tp_step_graph_create(0, (int64_t[]){1}, TP_F32, 0, &g), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_step_graph_create(1, NULL, TP_F32, 0, &g), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_step_graph_create(1, (int64_t[]){-1}, TP_F32, 0, &g), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_step_graph_write(NULL, stdout), TP_ERR_INVALID_ARG);
}

/* Sizes whose byte counts overflow, alone or summed over the parameters (a
 * fused bucket may hold them all): refused, naming the parameter, rather than
 * wrapping into small buckets. */
Test(dp, graph_sizes_that_overflow, .timeout = 10)
{
    tp_step_graph *g = NULL;
    const int64_t big = INT64_MAX / 4; /* f32: INT64_MAX - 3 bytes, the most that fits */
#define EXPECT_SIZE_ERR(n, numel, dtype, needle)                                \
    do {                                                                        \
        CHECK_ERR(tp_step_graph_create((n), (numel), (dtype), 0, &g), TP_ERR_INVALID_ARG); \
        cr_assert_null(g);                                                      \
        cr_assert(strstr(tp_last_error(), "tp_step_graph_create: ") &&          \
                      strstr(tp_last_error(), (needle)),                        \
                  "%s", tp_last_error());                                       \
    } while (0)
    EXPECT_SIZE_ERR(1, ((int64_t[]){INT64_MAX}), TP_F32,
                    "parameter 0 (param0): 9223372036854775807 elements of f32 (4 bytes each) "
                    "overflow a byte count");
    /* 2^62 f32 elements are 2^64 bytes, 0 in a 64-bit size_t */
    EXPECT_SIZE_ERR(2, ((int64_t[]){10, INT64_C(1) << 62}), TP_F32,
                    "parameter 1 (param1): 4611686018427387904 elements of f32");
    EXPECT_SIZE_ERR(1, ((int64_t[]){big + 1}), TP_F32, "parameter 0 (param0)");
    EXPECT_SIZE_ERR(1, ((int64_t[]){INT64_MAX / 8 + 1}), TP_F64, "elements of f64 (8 bytes each)");
    /* each fits, the sum does not */
    EXPECT_SIZE_ERR(3, ((int64_t[]){big / 2, big / 2, 2}), TP_F32,
                    "parameter 2 (param2): its 8 bytes take the parameters' total past "
                    "9223372036854775807 bytes");
    EXPECT_SIZE_ERR(3, ((int64_t[]){big, big, big}), TP_BF16, "parameter 2 (param2)");
    EXPECT_SIZE_ERR(2, ((int64_t[]){3, -5}), TP_F32, "parameter 1 (param1): numel -5 is negative");
#undef EXPECT_SIZE_ERR
    /* the largest sizes that fit are accepted, in one bucket when fused */
    CHECK_OK(tp_step_graph_create(1, (int64_t[]){big}, TP_F32, 0, &g));
    tp_step_graph_free(g);
    CHECK_OK(tp_step_graph_create(3, (int64_t[]){big / 2, big / 2, 1}, TP_F32, SIZE_MAX, &g));
    CHECK_OK(tp_pass_apply(tp_pass_bucket_fusion(), g));
    cr_assert_eq(tp_step_graph_num_buckets(g), 1);
    tp_step_graph_free(g);
}

/* ---- errors ---------------------------------------------------------------------- */

typedef struct err_ctx {
    tp_test_slot slot[TP_TEST_MAX_RANKS];
} err_ctx;

static tp_status errors_body(tp_comm *w, void *arg)
{
    err_ctx *c = arg;
    int rank = tp_comm_rank(w);
    tp_test_slot *s = &c->slot[rank];
    tp_module *m = NULL, *extra = NULL;
    tp_ddp *ddp = NULL;
    RANK_OK(s, make_mlp(&m));
    /* rank 1 has one more layer: every rank learns the ranks disagree */
    if (rank == 1) {
        RANK_OK(s, tp_nn_linear_create(4, 4, true, &extra));
        RANK_OK(s, tp_module_add_child(m, "extra", extra));
    }
    tp_status st = tp_ddp_create(m, w, NULL, &ddp);
    RANK_EXPECT(s, st == TP_ERR_MISMATCH && ddp == NULL, "disagreeing ranks: %s (%s)",
                tp_status_name(st), tp_last_error());
    RANK_EXPECT(s, strstr(tp_last_error(), "disagree") != NULL, "message: %s", tp_last_error());
    tp_module_free(m);

    /* a pass during a step is refused; after the sync it is fine */
    RANK_OK(s, make_mlp(&m));
    RANK_OK(s, tp_ddp_create(m, w, &(tp_ddp_options){.manual_passes = true}, &ddp));
    tp_tensor *x = NULL, *loss = NULL;
    RANK_OK(s, batch(0, &x));
    RANK_OK(s, loss_of(m, x, &loss));
    RANK_OK(s, tp_backward(loss, NULL));
    st = tp_pass_apply(tp_pass_bucket_fusion(), tp_ddp_graph(ddp));
    RANK_EXPECT(s, st == TP_ERR_STATE && strstr(tp_last_error(), "in progress"),
                "a pass during a step: %s (%s)", tp_status_name(st), tp_last_error());
    RANK_OK(s, tp_ddp_sync(ddp));
    RANK_OK(s, tp_ddp_sync(ddp)); /* idempotent */
    RANK_OK(s, tp_pass_apply(tp_pass_bucket_fusion(), tp_ddp_graph(ddp)));
    tp_tensor_release(loss);
    tp_tensor_release(x);
    tp_ddp_free(ddp);
    tp_module_free(m);
    return TP_OK;
}

static tp_status huge_forward(tp_module *self, int nargs, tp_tensor *const *args, int nkw,
                              const tp_kwarg *kw, tp_tensor **out)
{
    (void)self, (void)nargs, (void)args, (void)nkw, (void)kw, (void)out;
    return TP_ERR_NOT_SUPPORTED;
}

Test(dp, errors, .timeout = 60)
{
    err_ctx c = {0};
    tp_test_run(2, errors_body, &c, c.slot);

    tp_module *m = NULL, *empty = NULL;
    tp_ddp *ddp = NULL;
    tp_comm *pg = NULL;
    lonely_state ls = {0};
    CHECK_OK(tp_comm_create(&lonely_backend, &ls, 0, 1, &pg));
    CHECK_OK(make_mlp(&m));
    CHECK_ERR(tp_ddp_create(NULL, pg, NULL, &ddp), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_ddp_create(m, NULL, NULL, &ddp), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_ddp_create(m, pg, NULL, NULL), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_ddp_create(m, pg, &(tp_ddp_options){.max_in_flight = -1}, &ddp),
              TP_ERR_INVALID_ARG);
    CHECK_OK(tp_nn_relu_create(&empty));
    CHECK_ERR(tp_ddp_create(empty, pg, NULL, &ddp), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "no parameter"), "%s", tp_last_error());
    cr_assert_null(ddp);
    /* parameters whose bytes add up past a 64-bit count (tensors wrapping
     * memory they only claim: the sizes are refused before any is touched) */
    tp_module *huge = NULL;
    tp_tensor *ha = NULL, *hb = NULL;
    static float cell[1];
    int64_t half = INT64_MAX / 4; /* 2^63 - 4 bytes of f32 each: the most a tensor holds */
    CHECK_OK(tp_nn_custom_create("Huge", huge_forward, NULL, NULL, &huge));
    CHECK_OK(tp_tensor_from_blob(TP_F32, TP_CPU, 1, &half, cell, NULL, NULL, &ha));
    CHECK_OK(tp_tensor_from_blob(TP_F32, TP_CPU, 1, &half, cell, NULL, NULL, &hb));
    CHECK_OK(tp_module_register_parameter(huge, "a", ha));
    CHECK_OK(tp_module_register_parameter(huge, "b", hb));
    CHECK_ERR(tp_ddp_create(huge, pg, NULL, &ddp), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "tp_ddp_create: parameter 1 (b): its 9223372036854775804 "
                                      "bytes take the parameters' total past"),
              "%s", tp_last_error());
    cr_assert_null(ddp);
    tp_tensor_release(ha);
    tp_tensor_release(hb);
    tp_module_free(huge);
    CHECK_ERR(tp_ddp_sync(NULL), TP_ERR_INVALID_ARG);
    cr_assert_null(tp_ddp_graph(NULL));
    tp_ddp_free(NULL);
    tp_module_free(empty);
    tp_module_free(m);
    tp_comm_free(pg);
}
