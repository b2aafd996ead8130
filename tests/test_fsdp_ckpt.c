/* What sits around a fully sharded (tp_fully_shard) model: gradient
 * clipping and the grad scaler on its local shards, sharded checkpoints
 * saved from FSDP x TP and loaded into other dp and tp sizes (parameters and
 * Adam's state resharded), and the Hugging Face saver writing full tensors
 * from the shards. The Llama-family fixture models, against the same model
 * on one rank and under DDP x TP. */
#include <dirent.h>
#include <math.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tp_test.h"
#include "tp_test_fs.h"
#include "llm_fixture.h"

enum { BATCH = 12, SEQ = 8, MAX_PARAMS = 64 };

/* How a model is laid out over the ranks (M_FSDP_BLOCKS: only the blocks
 * are fully sharded units, the rest stays on the tp mesh). */
enum { M_ONE, M_DDP, M_FSDP, M_FSDP_BLOCKS };

typedef struct {
    int mode;
    int dp, tp;
} layout;

static int layout_ranks(layout l)
{
    return l.mode == M_ONE ? 1 : l.dp * l.tp;
}

/* ---- a model, its optimizer and its rows of the batch ------------------------ */

typedef struct {
    tp_llm_config cfg;
    layout l;
    tp_module *model;
    tp_mesh *mesh, *tpm;
    tp_ddp *ddp;
    tp_adam *opt;
    tp_tensor *ids;
} trainer;

static const tp_adam_options adam_opts = {.lr = 1e-3, .weight_decay = 0.01, .decoupled = true};

static void trainer_close(trainer *t)
{
    tp_tensor_release(t->ids);
    tp_adam_free(t->opt);
    tp_ddp_free(t->ddp);
    tp_module_free(t->model);
    tp_mesh_free(t->tpm);
    tp_mesh_free(t->mesh);
    memset(t, 0, sizeof *t);
}

/* The fixture model laid out as l (its weights loaded when `load`), with
 * AdamW (adam_lr: its learning rate) created after the wrapping. */
static tp_status trainer_open(tp_comm *world, int model, layout l, bool load, double adam_lr,
                              trainer *t)
{
    memset(t, 0, sizeof *t);
    t->l = l;
    char dir[512];
    model_dir(model, dir, sizeof dir);
    TP_TEST_TRY(tp_llm_config_load(dir, &t->cfg));
    TP_TEST_TRY(tp_llm_create(&t->cfg, &t->model));
    if (l.mode != M_ONE) {
        tp_llm_plan *plan = NULL;
        TP_TEST_TRY(tp_mesh_create(world, 2, (int64_t[]){l.dp, l.tp},
                                   (const char *[]){"dp", "tp"}, &t->mesh));
        TP_TEST_TRY(tp_mesh_slice(t->mesh, 1, (const char *[]){"tp"}, &t->tpm));
        TP_TEST_TRY(tp_llm_plan_create(&(tp_llm_plan_options){0}, &plan));
        tp_status st = tp_llm_parallelize(
            t->model, t->tpm, tp_llm_plan_size(plan), tp_llm_plan_entries(plan),
            &(tp_parallelize_options){.src_data_rank = TP_SRC_DATA_RANK_NONE});
        tp_llm_plan_free(plan);
        TP_TEST_TRY(st);
    }
    if (load)
        TP_TEST_TRY(tp_llm_load(t->model, dir));
    if (l.mode == M_DDP) {
        const tp_ddp_options o = {.params_everywhere = true};
        TP_TEST_TRY(tp_ddp_create(t->model, tp_mesh_comm(t->mesh, 0), &o, &t->ddp));
    } else if (l.mode == M_FSDP || l.mode == M_FSDP_BLOCKS) {
        tp_module *layers = tp_module_find(t->model, "model.layers");
        for (int i = 0; i < tp_module_num_children(layers); i++)
            TP_TEST_TRY(tp_fully_shard(tp_module_child_at(layers, i, NULL), t->mesh, NULL));
        if (l.mode == M_FSDP)
            TP_TEST_TRY(tp_fully_shard(t->model, t->mesh, NULL));
    }
    tp_adam_options ao = adam_opts;
    ao.lr = adam_lr;
    TP_TEST_TRY(tp_adam_create_with(t->model, &ao, &t->opt));
    const int64_t rows = BATCH / (l.mode == M_ONE ? 1 : l.dp);
    const int64_t first = l.mode == M_ONE ? 0 : tp_mesh_coord(t->mesh, 0) * rows;
    return fixture_batch_ids(t->cfg.vocab_size, first, rows, SEQ, &t->ids);
}

/* Forward and backward on this rank's rows (the loss scaled by gs when
 * given); *loss: the batch's loss (this rank's averaged over dp). */
static tp_status trainer_backward(trainer *t, tp_grad_scaler *gs, double *loss)
{
    tp_tensor *logits = NULL, *l = NULL, *scaled = NULL, *lf = NULL;
    tp_status st = tp_llm_forward(t->model, t->ids, NULL, NULL, &logits);
    if (st == TP_OK)
        st = tp_llm_loss(logits, t->ids, &l);
    if (st == TP_OK && gs)
        st = tp_grad_scaler_scale(gs, l, &scaled);
    if (st == TP_OK)
        st = tp_backward(scaled ? scaled : l, NULL);
    if (st == TP_OK)
        st = full_f32(l, &lf);
    if (st == TP_OK)
        *loss = *(const float *)tp_tensor_data(lf);
    tp_tensor_release(lf);
    tp_tensor_release(scaled);
    tp_tensor_release(l);
    tp_tensor_release(logits);
    TP_TEST_TRY(st);
    if (t->l.mode != M_ONE && t->l.dp > 1) {
        tp_tensor *v = NULL;
        TP_TEST_TRY(tp_tensor_empty(TP_F64, TP_CPU, 1, (int64_t[]){1}, &v));
        *(double *)tp_tensor_data(v) = *loss;
        st = tp_all_reduce(tp_mesh_comm(t->mesh, 0), v, v, TP_AVG, NULL);
        *loss = *(const double *)tp_tensor_data(v);
        tp_tensor_release(v);
    }
    return st;
}

/* ---- full copies of the parameters or gradients, by FQN ------------------------ */

typedef struct {
    int n;
    char fqn[MAX_PARAMS][96];
    tp_tensor *t[MAX_PARAMS];
} snap_t;

static void snap_free(snap_t *s)
{
    for (int i = 0; i < s->n; i++)
        tp_tensor_release(s->t[i]);
    memset(s, 0, sizeof *s);
}

typedef struct {
    snap_t *s;
    bool grads;
} snap_ctx;

static tp_status snap_one(const char *fqn, tp_tensor *p, void *ctx)
{
    snap_ctx *c = ctx;
    snap_t *s = c->s;
    if (s->n == MAX_PARAMS)
        return TP_ERR_STATE;
    snprintf(s->fqn[s->n], sizeof s->fqn[0], "%s", fqn);
    tp_tensor *v = c->grads ? tp_tensor_grad(p) : p;
    if (!v)
        return TP_ERR_STATE; /* every parameter has a gradient here */
    TP_TEST_TRY(full_f32(v, &s->t[s->n]));
    s->n++;
    return TP_OK;
}

static tp_status snap(tp_module *m, bool grads, snap_t *s)
{
    snap_free(s);
    snap_ctx c = {s, grads};
    return tp_module_named_parameters(m, snap_one, &c);
}

/* Main thread: b against a, each tensor within tol of its largest entry
 * (tol 0: bit for bit). */
static void snap_check(const snap_t *a, const snap_t *b, double tol, const char *what)
{
    cr_assert_eq(a->n, b->n, "%s: %d tensors, expected %d", what, b->n, a->n);
    for (int i = 0; i < a->n; i++) {
        cr_assert_str_eq(a->fqn[i], b->fqn[i], "%s", what);
        cr_assert_eq(tp_tensor_numel(a->t[i]), tp_tensor_numel(b->t[i]), "%s: %s's size", what,
                     a->fqn[i]);
        double d = 0, scale = 0;
        max_diff(a->t[i], b->t[i], &d, &scale);
        if (tol == 0)
            cr_assert(d == 0, "%s: %s differs by %g (expected bit for bit)", what, a->fqn[i], d);
        else
            cr_assert(d <= tol * scale, "%s: %s differs by %g of %g (tolerance %g)", what,
                      a->fqn[i], d, scale, tol);
    }
}

/* Runs fn on the ranks of layout l (the one-rank layout also under mpirun:
 * in every process). */
static void run_on(layout l, tp_rank_fn fn, void *arg, tp_test_slot *slots)
{
    if (l.mode == M_ONE) {
        CHECK_OK(tp_run_local(1, fn, arg));
        tp_test_assert_slots(slots, 1);
        return;
    }
    tp_test_run(layout_ranks(l), fn, arg, slots);
}

/* ---- 1. gradient clipping ------------------------------------------------------- */

typedef struct {
    int model;
    int dp, tp;
} model_case;

typedef struct {
    int model;
    layout l;
    double inf_norm[TP_TEST_MAX_RANKS], norm[TP_TEST_MAX_RANKS], after[TP_TEST_MAX_RANKS];
    snap_t grads[TP_TEST_MAX_RANKS];
    tp_test_slot slot[TP_TEST_MAX_RANKS];
} clip_run;

#define MAX_NORM 0.05

static tp_status clip_body(tp_comm *world, void *arg)
{
    clip_run *c = arg;
    const int rank = tp_comm_rank(world);
    tp_test_slot *slot = &c->slot[rank];
    trainer t;
    double loss = 0;
    RANK_OK(slot, trainer_open(world, c->model, c->l, true, adam_opts.lr, &t));
    RANK_OK(slot, trainer_backward(&t, NULL, &loss));
    /* the infinity norm with nothing to clip, then the 2-norm clipping, and
     * the norm of what the clipping left (max_norm, to 1e-6 relative) */
    RANK_OK(slot, tp_clip_grad_norm(t.model, 1e30, INFINITY, &c->inf_norm[rank]));
    RANK_OK(slot, tp_clip_grad_norm(t.model, MAX_NORM, 2.0, &c->norm[rank]));
    RANK_OK(slot, tp_clip_grad_norm(t.model, 1e30, 2.0, &c->after[rank]));
    RANK_OK(slot, snap(t.model, true, &c->grads[rank]));
    /* the step takes the clipped gradients */
    RANK_OK(slot, tp_adam_step(t.opt));
    trainer_close(&t);
    return TP_OK;
}

static void clip_free(clip_run *c)
{
    for (int r = 0; r < TP_TEST_MAX_RANKS; r++)
        snap_free(&c->grads[r]);
}

ParameterizedTestParameters(fsdp_ckpt, clip_grad_norm)
{
    static model_case cases[] = {{LLAMA, 2, 2}, {QWEN2, 2, 2}, {LLAMA, 4, 1}};
    return cr_make_param_array(model_case, cases, sizeof cases / sizeof cases[0]);
}

/* tp_clip_grad_norm on FSDP x TP: the total norm (2 and infinity) is the one
 * rank's and DDP x TP's, and every rank's clipped gradients are theirs. */
ParameterizedTest(model_case *mc, fsdp_ckpt, clip_grad_norm, .timeout = 300)
{
    static clip_run one, ddp, fsdp;
    const layout lo = {M_ONE, 1, 1}, ld = {M_DDP, mc->dp, mc->tp}, lf = {M_FSDP, mc->dp, mc->tp};
    clip_run *runs[] = {&one, &ddp, &fsdp};
    const layout ls[] = {lo, ld, lf};
    for (int k = 0; k < 3; k++) {
        memset(runs[k], 0, sizeof *runs[k]);
        runs[k]->model = mc->model;
        runs[k]->l = ls[k];
        run_on(ls[k], clip_body, runs[k], runs[k]->slot);
    }
    const char *name = model_names[mc->model];
    cr_assert(one.norm[0] > 4 * MAX_NORM, "%s: the norm %g is too small to clip", name,
              one.norm[0]);
    for (int r = 0; r < mc->dp * mc->tp; r++) {
        if (!tp_test_rank_is_local(r))
            continue;
        char what[160];
        const double *ref[] = {&one.inf_norm[0], &one.norm[0], &one.after[0]};
        const double *dd[] = {&ddp.inf_norm[r], &ddp.norm[r], &ddp.after[r]};
        const double *got[] = {&fsdp.inf_norm[r], &fsdp.norm[r], &fsdp.after[r]};
        const char *which[] = {"infinity norm", "2-norm", "2-norm after clipping"};
        for (int k = 0; k < 3; k++) {
            cr_assert(fabs(*got[k] - *ref[k]) <= 1e-5 * *ref[k],
                      "%s dp %d tp %d rank %d: %s %.9g, one rank %.9g", name, mc->dp, mc->tp, r,
                      which[k], *got[k], *ref[k]);
            cr_assert(fabs(*got[k] - *dd[k]) <= 1e-6 * *dd[k],
                      "%s dp %d tp %d rank %d: %s %.9g, DDP %.9g", name, mc->dp, mc->tp, r,
                      which[k], *got[k], *dd[k]);
        }
        cr_assert(fabs(fsdp.after[r] - MAX_NORM) <= 1e-5 * MAX_NORM,
                  "rank %d: the clipped gradients' norm is %.9g, not %g", r, fsdp.after[r],
                  MAX_NORM);
        snprintf(what, sizeof what, "%s dp %d tp %d rank %d: clipped gradients against one rank",
                 name, mc->dp, mc->tp, r);
        snap_check(&one.grads[0], &fsdp.grads[r], 1e-5, what);
        snprintf(what, sizeof what, "%s dp %d tp %d rank %d: clipped gradients against DDP", name,
                 mc->dp, mc->tp, r);
        snap_check(&ddp.grads[r], &fsdp.grads[r], 1e-6, what);
    }
    clip_free(&one);
    clip_free(&ddp);
    clip_free(&fsdp);
}

/* ---- 2. the grad scaler ------------------------------------------------------------ */

enum { SCALER_STEPS = 5 };

typedef struct {
    int model;
    layout l;
    bool stepped[TP_TEST_MAX_RANKS][SCALER_STEPS];
    double scale[TP_TEST_MAX_RANKS][SCALER_STEPS];
    snap_t params[TP_TEST_MAX_RANKS];
    tp_test_slot slot[TP_TEST_MAX_RANKS];
} scaler_run;

static tp_status scaler_body(tp_comm *world, void *arg)
{
    scaler_run *c = arg;
    const int rank = tp_comm_rank(world);
    tp_test_slot *slot = &c->slot[rank];
    trainer t;
    RANK_OK(slot, trainer_open(world, c->model, c->l, true, adam_opts.lr, &t));
    /* 1e38: the scaled f32 loss overflows; the scaler backs off until the
     * gradients are finite, then grows every other step */
    const tp_grad_scaler_options so = {.init_scale = 1e38, .growth_interval = 2};
    tp_grad_scaler *gs = NULL;
    RANK_OK(slot, tp_grad_scaler_create(world, &so, &gs));
    for (int s = 0; s < SCALER_STEPS; s++) {
        double loss = 0;
        RANK_OK(slot, trainer_backward(&t, gs, &loss));
        RANK_OK(slot, tp_grad_scaler_step_adam(gs, t.opt, &c->stepped[rank][s]));
        RANK_OK(slot, tp_grad_scaler_update(gs));
        c->scale[rank][s] = tp_grad_scaler_get_scale(gs);
        tp_module_zero_grad(t.model);
    }
    RANK_OK(slot, snap(t.model, false, &c->params[rank]));
    tp_grad_scaler_free(gs);
    trainer_close(&t);
    return TP_OK;
}

ParameterizedTestParameters(fsdp_ckpt, grad_scaler)
{
    static model_case cases[] = {{LLAMA, 2, 2}, {QWEN2, 4, 1}};
    return cr_make_param_array(model_case, cases, sizeof cases / sizeof cases[0]);
}

/* The grad scaler steps FSDP x TP as it steps DDP x TP: the same steps
 * skipped (an overflow found on any rank's shard skips it everywhere), the
 * same scales, the same parameters after the steps. */
ParameterizedTest(model_case *mc, fsdp_ckpt, grad_scaler, .timeout = 300)
{
    static scaler_run ddp, fsdp;
    memset(&ddp, 0, sizeof ddp);
    memset(&fsdp, 0, sizeof fsdp);
    ddp.model = fsdp.model = mc->model;
    ddp.l = (layout){M_DDP, mc->dp, mc->tp};
    fsdp.l = (layout){M_FSDP, mc->dp, mc->tp};
    run_on(ddp.l, scaler_body, &ddp, ddp.slot);
    run_on(fsdp.l, scaler_body, &fsdp, fsdp.slot);
    const char *name = model_names[mc->model];
    for (int r = 0; r < mc->dp * mc->tp; r++) {
        if (!tp_test_rank_is_local(r))
            continue;
        int skipped = 0;
        for (int s = 0; s < SCALER_STEPS; s++) {
            cr_assert_eq(fsdp.stepped[r][s], ddp.stepped[r][s],
                         "%s rank %d step %d: FSDP %s, DDP %s", name, r, s,
                         fsdp.stepped[r][s] ? "stepped" : "skipped",
                         ddp.stepped[r][s] ? "stepped" : "skipped");
            cr_assert_eq(fsdp.scale[r][s], ddp.scale[r][s], "%s rank %d step %d: scale %g, DDP %g",
                         name, r, s, fsdp.scale[r][s], ddp.scale[r][s]);
            skipped += !fsdp.stepped[r][s];
        }
        cr_assert(skipped > 0 && skipped < SCALER_STEPS,
                  "%s: %d of %d steps skipped; the test wants both kinds", name, skipped,
                  SCALER_STEPS);
        char what[160];
        snprintf(what, sizeof what, "%s dp %d tp %d rank %d: parameters against DDP", name,
                 mc->dp, mc->tp, r);
        snap_check(&ddp.params[r], &fsdp.params[r], 1e-6, what);
    }
    for (int r = 0; r < TP_TEST_MAX_RANKS; r++) {
        snap_free(&ddp.params[r]);
        snap_free(&fsdp.params[r]);
    }
}

#ifndef TP_TEST_MPI /* the tests below share a directory between the ranks */

/* One AdamW step on this rank's rows. */
static tp_status trainer_step(trainer *t, double *loss)
{
    TP_TEST_TRY(trainer_backward(t, NULL, loss));
    TP_TEST_TRY(tp_adam_step(t->opt));
    tp_module_zero_grad(t->model);
    return TP_OK;
}

/* ---- 3. sharded checkpoints across layouts ------------------------------------------ */

static const char *const mode_names[] = {"one rank", "DDP x TP", "FSDP x TP",
                                         "FSDP (blocks) x TP"};

typedef struct {
    int model;
    layout src, dst;
} ckpt_case;

typedef struct {
    ckpt_case c;
    char dir[256];
    bool load_side;
    /* the saving run's: its parameters as saved (after one step), then
     * the second step's loss and parameters */
    snap_t saved, next;
    double next_loss;
    /* the loading run's, per rank */
    snap_t loaded[TP_TEST_MAX_RANKS], lnext[TP_TEST_MAX_RANKS];
    double lnext_loss[TP_TEST_MAX_RANKS];
    tp_test_slot slot[TP_TEST_MAX_RANKS];
} ckpt_run;

static tp_status ckpt_body(tp_comm *world, void *arg)
{
    ckpt_run *c = arg;
    const int rank = tp_comm_rank(world);
    tp_test_slot *slot = &c->slot[rank];
    trainer t;
    if (!c->load_side) {
        double loss = 0;
        RANK_OK(slot, trainer_open(world, c->c.model, c->c.src, true, adam_opts.lr, &t));
        RANK_OK(slot, trainer_step(&t, &loss));
        /* DDP: the checkpoint is collective over the tp mesh; one replica
         * saves it */
        if (c->c.src.mode != M_DDP || tp_mesh_coord(t.mesh, 0) == 0)
            RANK_OK(slot, tp_checkpoint_save(c->dir, t.model,
                                             &(tp_checkpoint_optim){.adam = t.opt}, NULL));
        snap_t s = {0};
        RANK_OK(slot, snap(t.model, false, &s));
        if (rank == 0) {
            c->saved = s;
            memset(&s, 0, sizeof s);
        }
        RANK_OK(slot, trainer_step(&t, &loss));
        RANK_OK(slot, snap(t.model, false, &s));
        if (rank == 0) {
            c->next = s;
            c->next_loss = loss;
        } else {
            snap_free(&s);
        }
        trainer_close(&t);
        return TP_OK;
    }
    /* a fresh model (zeros), and AdamW at another rate: the checkpoint's
     * rate is restored with the state */
    RANK_OK(slot, trainer_open(world, c->c.model, c->c.dst, false, 0.5, &t));
    RANK_OK(slot, tp_checkpoint_load(c->dir, t.model, &(tp_checkpoint_optim){.adam = t.opt},
                                     NULL));
    RANK_EXPECT(slot, tp_adam_lr(t.opt) == adam_opts.lr, "the loaded learning rate is %g",
                tp_adam_lr(t.opt));
    RANK_OK(slot, snap(t.model, false, &c->loaded[rank]));
    RANK_OK(slot, trainer_step(&t, &c->lnext_loss[rank]));
    RANK_OK(slot, snap(t.model, false, &c->lnext[rank]));
    trainer_close(&t);
    return TP_OK;
}

static const char *layout_str(layout l, char *buf, size_t n)
{
    if (l.mode == M_ONE)
        snprintf(buf, n, "%s", mode_names[l.mode]);
    else
        snprintf(buf, n, "%s dp %d x tp %d", mode_names[l.mode], l.dp, l.tp);
    return buf;
}

ParameterizedTestParameters(fsdp_ckpt, reshard)
{
    const layout f22 = {M_FSDP, 2, 2}, f41 = {M_FSDP, 4, 1}, f31 = {M_FSDP, 3, 1},
                 d22 = {M_DDP, 2, 2}, d12 = {M_DDP, 1, 2}, one = {M_ONE, 1, 1};
    static ckpt_case cases[12];
    int n = 0;
    cases[n++] = (ckpt_case){LLAMA, f22, f41};
    cases[n++] = (ckpt_case){LLAMA, f22, d22};
    cases[n++] = (ckpt_case){LLAMA, f22, one};
    cases[n++] = (ckpt_case){LLAMA, f22, f22};
    cases[n++] = (ckpt_case){QWEN2, f22, f41};
    cases[n++] = (ckpt_case){QWEN2, f22, d12};
    cases[n++] = (ckpt_case){LLAMA, one, f22};
    cases[n++] = (ckpt_case){LLAMA, d22, f31};
    cases[n++] = (ckpt_case){LLAMA, f41, f22};
    cases[n++] = (ckpt_case){LLAMA_BF16, f22, f41}; /* bf16 with f32 masters, tied */
    cases[n++] = (ckpt_case){LLAMA_BF16, f22, one};
    return cr_make_param_array(ckpt_case, cases, (size_t)n);
}

/* A sharded checkpoint of a model and its AdamW state after one step,
 * saved from one layout and loaded into a fresh model in another: the
 * parameters come back bit for bit, and the second step (the optimizer
 * state resharded with them) gives the saving run's loss and parameters:
 * bit for bit in the same layout, else within the tolerances of
 * test_fsdp (another summation order, magnified by Adam's division). */
ParameterizedTest(ckpt_case *cc, fsdp_ckpt, reshard, .timeout = 300)
{
    static ckpt_run c;
    memset(&c, 0, sizeof c);
    c.c = *cc;
    char base[64];
    snprintf(base, sizeof base, "/tmp/tp_fsdp_ckpt_XXXXXX");
    cr_assert_not_null(mkdtemp(base));
    snprintf(c.dir, sizeof c.dir, "%s/ckpt", base);
    run_on(cc->src, ckpt_body, &c, c.slot);
    memset(c.slot, 0, sizeof c.slot);
    c.load_side = true;
    run_on(cc->dst, ckpt_body, &c, c.slot);
    tp_test_rm_tree(base);
    char s[64], d[64], what[256];
    layout_str(cc->src, s, sizeof s);
    layout_str(cc->dst, d, sizeof d);
    const bool same = !memcmp(&cc->src, &cc->dst, sizeof cc->src);
    /* bf16 parameters round each update: a last-bit difference in the f32
     * master is one bf16 ulp (2^-8 of the entry) in the parameter */
    const bool bf16 = cc->model == LLAMA_BF16;
    const double tol_loss = same ? 0 : bf16 ? 1e-3 : 1e-5, tol = same ? 0 : bf16 ? 1e-2 : 1e-4;
    for (int r = 0; r < layout_ranks(cc->dst); r++) {
        snprintf(what, sizeof what, "%s saved from %s, loaded into %s, rank %d",
                 model_names[cc->model], s, d, r);
        snap_check(&c.saved, &c.loaded[r], 0, what);
        cr_assert(fabs(c.lnext_loss[r] - c.next_loss) <= tol_loss * fabs(c.next_loss),
                  "%s: the next step's loss %.9g, the saving run's %.9g", what, c.lnext_loss[r],
                  c.next_loss);
        snprintf(what, sizeof what, "%s saved from %s, loaded into %s, rank %d, after a step",
                 model_names[cc->model], s, d, r);
        snap_check(&c.next, &c.lnext[r], tol, what);
        snap_free(&c.loaded[r]);
        snap_free(&c.lnext[r]);
    }
    snap_free(&c.saved);
    snap_free(&c.next);
}

typedef struct {
    char dir[256];
    tp_test_slot slot[TP_TEST_MAX_RANKS];
} refuse_run;

static tp_status refuse_body(tp_comm *world, void *arg)
{
    refuse_run *c = arg;
    tp_test_slot *slot = &c->slot[tp_comm_rank(world)];
    trainer t;
    /* a checkpoint of the model with its root sharded, to load from */
    RANK_OK(slot, trainer_open(world, LLAMA, (layout){M_FSDP, 2, 2}, true, adam_opts.lr, &t));
    RANK_OK(slot, tp_checkpoint_save(c->dir, t.model, NULL, NULL));
    trainer_close(&t);
    RANK_OK(slot, trainer_open(world, LLAMA, (layout){M_FSDP_BLOCKS, 2, 2}, true, adam_opts.lr,
                               &t));
    const tp_checkpoint_optim o = {.adam = t.opt};
    for (int k = 0; k < 2; k++) {
        tp_clear_error();
        tp_status st = k ? tp_checkpoint_load(c->dir, t.model, &o, NULL)
                         : tp_checkpoint_save(c->dir, t.model, &o, NULL);
        RANK_EXPECT(slot, st == TP_ERR_INVALID_ARG && strstr(tp_last_error(), "root fully sharded"),
                    "%s -> %s (%s)", k ? "load" : "save", tp_status_name(st), tp_last_error());
    }
    trainer_close(&t);
    return TP_OK;
}

/* The blocks fully sharded and the root not: the parameters live on the
 * (tp, dp) meshes and on the tp mesh, which a checkpoint does not mix (the
 * root's are replicated over dp): save and load refused by name, the
 * checkpoint there kept. */
Test(fsdp_ckpt, refuses_root_not_sharded, .timeout = 60)
{
    static refuse_run c;
    memset(&c, 0, sizeof c);
    char base[64];
    snprintf(base, sizeof base, "/tmp/tp_fsdp_ckpt_XXXXXX");
    cr_assert_not_null(mkdtemp(base));
    snprintf(c.dir, sizeof c.dir, "%s/ckpt", base);
    tp_test_run(4, refuse_body, &c, c.slot);
    /* the refused save kept the checkpoint there and added nothing */
    char meta[300];
    snprintf(meta, sizeof meta, "%s/metadata.json", c.dir);
    struct stat sb;
    cr_assert(stat(meta, &sb) == 0, "the refused save removed %s", meta);
    DIR *d = opendir(base);
    int n = 0;
    for (struct dirent *e; d && (e = readdir(d));)
        n += e->d_name[0] != '.';
    if (d)
        closedir(d);
    cr_assert_eq(n, 1, "%d entries in %s after the refused save", n, base);
    tp_test_rm_tree(base);
}

/* ---- 4. the Hugging Face saver -------------------------------------------------------- */

typedef struct {
    int model;
    layout l;
    int steps;
    char dir[256];
    bool save; /* false: load dir into the model instead */
    snap_t params[TP_TEST_MAX_RANKS];
    tp_test_slot slot[TP_TEST_MAX_RANKS];
} hf_run;

static tp_status hf_body(tp_comm *world, void *arg)
{
    hf_run *c = arg;
    const int rank = tp_comm_rank(world);
    tp_test_slot *slot = &c->slot[rank];
    trainer t;
    RANK_OK(slot, trainer_open(world, c->model, c->l, c->save, adam_opts.lr, &t));
    for (int s = 0; s < c->steps; s++) {
        double loss = 0;
        RANK_OK(slot, trainer_step(&t, &loss));
    }
    if (c->save)
        RANK_OK(slot, tp_llm_save(t.model, c->dir, 0));
    else
        RANK_OK(slot, tp_llm_load(t.model, c->dir));
    RANK_OK(slot, snap(t.model, false, &c->params[rank]));
    trainer_close(&t);
    return TP_OK;
}

/* Every parameter of s, read from the directory's model.safetensors, is
 * s's bit for bit. */
static void check_file(const snap_t *s, const char *dir, const char *what)
{
    char path[400];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    for (int i = 0; i < s->n; i++) {
        tp_tensor *t = NULL, *f = NULL;
        CHECK_OK(tp_safetensors_read(path, s->fqn[i], &t));
        CHECK_OK(tp_tensor_to(t, TP_F32, TP_CPU, &f));
        cr_assert_eq(tp_tensor_ndim(f), tp_tensor_ndim(s->t[i]));
        for (int d = 0; d < tp_tensor_ndim(f); d++)
            cr_assert_eq(tp_tensor_shape(f)[d], tp_tensor_shape(s->t[i])[d],
                         "%s: %s's dim %d in the file", what, s->fqn[i], d);
        double diff = 0, scale = 0;
        max_diff(s->t[i], f, &diff, &scale);
        cr_assert(diff == 0, "%s: %s in the file differs by %g", what, s->fqn[i], diff);
        tp_tensor_release(t);
        tp_tensor_release(f);
    }
}

typedef struct {
    int model;
    layout l;
} hf_case;

ParameterizedTestParameters(fsdp_ckpt, hf_save)
{
    static hf_case cases[] = {
        {LLAMA, {M_FSDP, 2, 2}},      {QWEN2, {M_FSDP, 2, 2}},
        {MISTRAL, {M_FSDP, 4, 1}},    {LLAMA_BF16, {M_FSDP, 2, 2}},
        {LLAMA, {M_FSDP_BLOCKS, 2, 2}},
    };
    return cr_make_param_array(hf_case, cases, sizeof cases / sizeof cases[0]);
}

/* tp_llm_save from FSDP x TP writes the full tensors: untrained, the one-rank
 * model's bit for bit; after a step, the FSDP model's own full values, and
 * the one-rank model's after the same step within test_fsdp's tolerance.
 * tp_llm_load reads the directory back into one rank and into FSDP x TP. */
ParameterizedTest(hf_case *mc, fsdp_ckpt, hf_save, .timeout = 300)
{
    static hf_run one, fsdp, back_one, back_fsdp;
    const layout lo = {M_ONE, 1, 1}, lf = mc->l;
    const char *name = model_names[mc->model];
    char base[64], what[200];
    snprintf(base, sizeof base, "/tmp/tp_fsdp_hf_XXXXXX");
    cr_assert_not_null(mkdtemp(base));
    for (int steps = 0; steps < 2; steps++) {
        hf_run *runs[] = {&one, &fsdp, &back_one, &back_fsdp};
        one = (hf_run){.model = mc->model, .l = lo, .steps = steps, .save = true};
        fsdp = (hf_run){.model = mc->model, .l = lf, .steps = steps, .save = true};
        back_one = (hf_run){.model = mc->model, .l = lo};
        back_fsdp = (hf_run){.model = mc->model, .l = lf};
        snprintf(one.dir, sizeof one.dir, "%s/one%d", base, steps);
        snprintf(fsdp.dir, sizeof fsdp.dir, "%s/fsdp%d", base, steps);
        snprintf(back_one.dir, sizeof back_one.dir, "%s", fsdp.dir);
        snprintf(back_fsdp.dir, sizeof back_fsdp.dir, "%s", fsdp.dir);
        run_on(lo, hf_body, &one, one.slot);
        run_on(lf, hf_body, &fsdp, fsdp.slot);
        /* the file holds the FSDP model's full values, the config reads back */
        char ls[64];
        layout_str(lf, ls, sizeof ls);
        snprintf(what, sizeof what, "%s %s, %d steps", name, ls, steps);
        check_file(&fsdp.params[0], fsdp.dir, what);
        char fixture[512];
        tp_llm_config cfg, ref;
        CHECK_OK(tp_llm_config_load(fsdp.dir, &cfg));
        CHECK_OK(tp_llm_config_load(model_dir(mc->model, fixture, sizeof fixture), &ref));
        cr_assert(cfg.arch == ref.arch && cfg.vocab_size == ref.vocab_size &&
                      cfg.hidden_size == ref.hidden_size &&
                      cfg.num_hidden_layers == ref.num_hidden_layers &&
                      cfg.tie_word_embeddings == ref.tie_word_embeddings,
                  "%s: the saved config.json is not the fixture's", what);
        for (int r = 0; r < layout_ranks(lf); r++) {
            snprintf(what, sizeof what, "%s %s rank %d, %d steps: against one rank", name, ls, r,
                     steps);
            snap_check(&one.params[0], &fsdp.params[r],
                       !steps ? 0 : mc->model == LLAMA_BF16 ? 1e-2 : 1e-4, what);
        }
        run_on(lo, hf_body, &back_one, back_one.slot);
        run_on(lf, hf_body, &back_fsdp, back_fsdp.slot);
        snprintf(what, sizeof what, "%s, %d steps: saved from %s, loaded on one rank", name,
                 steps, ls);
        snap_check(&fsdp.params[0], &back_one.params[0], 0, what);
        for (int r = 0; r < layout_ranks(lf); r++) {
            snprintf(what, sizeof what, "%s, %d steps: saved from %s, loaded into it, rank %d",
                     name, steps, ls, r);
            snap_check(&fsdp.params[0], &back_fsdp.params[r], 0, what);
        }
        for (int k = 0; k < 4; k++)
            for (int r = 0; r < TP_TEST_MAX_RANKS; r++)
                snap_free(&runs[k]->params[r]);
    }
    tp_test_rm_tree(base);
}

#endif /* TP_TEST_MPI */
