/*
 * mlp.c - tensor parallelism on a 2-layer MLP, checked against one rank.
 *
 * The model is a custom module "MLP" with the children net1 = Linear(16, 64),
 * relu and net2 = Linear(64, 16). It trains for a few SGD steps (lr 0.05) on
 * a fixed synthetic regression batch, loss = mean((y - t)^2), three ways:
 *
 *   no TP   plain tensors, 1 rank: the reference
 *   TP      {"net1": Colwise, "net2": Rowwise}
 *   TP+SP   {"net1": Colwise(input_layouts=S(0)), "net2": Rowwise(output_layouts=S(0))}
 *           (sequence parallel: every rank feeds only its rows of the batch)
 *
 * on 1, 2 and 4 ranks (threads of this process, tp_run_local). Parameters are
 * initialised with tp_module_init after parallelizing, so every run starts
 * from the same global values; each run's losses and final parameters must
 * equal the reference's within rtol 1e-5, atol 1e-6 (in f32; see --dtype). The collectives of one
 * training step are printed per run with tp_comm_debug_write_table, and
 * checked per scope (module FQNs as in the plans) against the plan's.
 *
 * --dtype bf16|f16 trains in low precision (mixed precision as in PyTorch): the
 * model is cast with tp_module_to_dtype after its initialisation, the batch is
 * cast, and SGD runs through tp_sgd, which keeps f32 master weights; f16 also
 * scales the loss (tp_grad_scaler, initial scale 2^10: the f16 loss could not
 * hold 2^16). The TP runs are then compared with the 1-rank run of the same
 * dtype within that dtype's tolerance, and the 1-rank run's final loss with
 * an f32 1-rank run's (see examples/README.md for the figures).
 *
 * --device cuda (-D cuda) runs every run on the GPU: the model is moved with
 * tp_module_to and the batch with tp_tensor_to after the initialisation, rank
 * r of the shm backend on cuda:(r % device count) (on one GPU every rank
 * shares it), of the nccl backend (-b nccl) on cuda:r. The runs are compared
 * as on the CPU, and the 1-rank run once more with the same run on the CPU,
 * within rtol max(1e-4, the dtype's), atol max(1e-5, the dtype's) (the CUDA
 * engine agrees with the CPU to float rounding: docs/API.md, CUDA). The end
 * prints each device's peak tensor memory (tp_memory_stats) and the rows of
 * the batch trained per second. Without a CUDA device it exits 77.
 *
 * Usage: tp-example-mlp [-r RANKS] [-s STEPS] [-b shm|mpi|nccl] [--dtype f32|bf16|f16]
 *                       [--device cpu|cuda]
 *   -b mpi    run under mpirun: the TP and TP+SP plans use the MPI world, one
 *             process per rank (the process count must divide 64); the
 *             reference runs on each process, the first process prints
 *   -b nccl   with --device cuda: the TP runs' ranks are threads on one GPU
 *             each (an nccl world over the shm one), so RANKS GPUs are needed
 *   -r RANKS  run the TP and TP+SP plans on this many ranks only, a divisor of
 *             the hidden size 64 (default 1, 2 and 4; the 1-rank reference
 *             always runs)
 *   -s STEPS  training steps (default 5)
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

enum { BATCH = 8, IN = 16, HIDDEN = 64, OUT = 16 };
enum { MAX_STEPS = 100, MAX_PARAMS = 8, MAX_RUNS = 32 };

#define LR 0.05
#define PARAM_SEED 2024
#define INPUT_SEED 1
#define TARGET_SEED 2

typedef enum run_mode { MODE_NONE = 0, MODE_TP, MODE_SP } run_mode;

/* --dtype: what the model and the batch are in. */
static tp_dtype g_dtype = TP_F32;
/* -b nccl: the TP runs communicate through an nccl world, one GPU per rank. */
static bool g_nccl = false;

/* A TP run vs the 1-rank run of the same dtype: f32 agrees to rounding; in
 * bf16/f16 net2's Partial sums are rounded per rank before their all_reduce,
 * where the 1-rank GEMM rounds once, so the runs drift apart by a few ulps
 * of the dtype. */
static double rtol_of(tp_dtype dt)
{
    return dt == TP_BF16 ? 2e-2 : dt == TP_F16 ? 4e-3 : 1e-5;
}

static double atol_of(tp_dtype dt)
{
    return dt == TP_BF16 ? 8e-3 : dt == TP_F16 ? 1e-3 : 1e-6;
}

/* The 1-rank run's final loss in bf16/f16 vs in f32: relative tolerance
 * (the measured gaps are in examples/README.md). */
static double final_rtol_of(tp_dtype dt)
{
    return dt == TP_BF16 ? 1e-2 : 2e-3;
}

#define RTOL rtol_of(g_dtype)
#define ATOL atol_of(g_dtype)
/* --device cuda: the 1-rank run on the GPU vs on the CPU. The CUDA engine
 * agrees with the CPU to float rounding (docs/API.md, CUDA: ops within
 * 1e-5 + 1e-4 |cpu| in f32); in bf16/f16 a rounding may go the other way,
 * as between TP and 1 rank, hence the dtype's tolerance where it is larger. */
#define DEV_RTOL fmax(RTOL, 1e-4)
#define DEV_ATOL fmax(ATOL, 1e-5)

static const char *const mode_name[] = {"no TP", "TP", "TP+SP"};
static const char *const mode_plan[] = {
    "(not parallelized)",
    "{\"net1\": Colwise, \"net2\": Rowwise}",
    "{\"net1\": Colwise(input_layouts=S(0)), \"net2\": Rowwise(output_layouts=S(0))}",
};

/* A parameter's full value at the end of a run, gathered by rank 0. */
typedef struct param_value {
    char fqn[64];
    tp_tensor *full;
} param_value;

/* One run: its configuration, and what rank 0 recorded. */
typedef struct run {
    run_mode mode;
    tp_dtype dtype;
    bool cuda; /* --device cuda: rank r on cuda:(r % device count) */
    int ranks;
    int steps;
    const char *load_dir; /* --load: resume from this checkpoint (its "step" first) */
    const char *save_dir; /* --save: checkpoint after the steps */
    int start_step;       /* the step the run began at: the loaded checkpoint's, or 0 */
    double seconds; /* the training steps' wall time on rank 0 */
    double loss[MAX_STEPS];
    int nparams;
    param_value params[MAX_PARAMS];
    tp_comm_debug *debug; /* the collectives of training step 0 on rank 0 */
    tp_status status;
    double loss_diff, param_diff; /* max |run - reference| */
    bool ok;
} run;

/* ---- error reporting ------------------------------------------------------ */

/* Prints a failed call with the library's message. A rank that only returns
 * TP_ERR_ABORTED because a peer failed stays quiet: the peer reports. */
static void report(tp_status st, const char *call, int line)
{
    if (st == TP_ERR_ABORTED)
        return;
    char msg[512];
    snprintf(msg, sizeof msg, "%s", tp_last_error());
    fprintf(stderr, "mlp.c:%d: %s failed: %s: %s\n", line, call, tp_status_name(st), msg);
}

/* Runs a call returning tp_status; on failure reports it and jumps to `out`
 * (the function declares `tp_status st`). */
#define CHECK(call)                                                                          \
    do {                                                                                     \
        st = (call);                                                                         \
        if (st != TP_OK) {                                                                   \
            report(st, #call, __LINE__);                                                     \
            goto out;                                                                        \
        }                                                                                    \
    } while (0)

/* ---- the model ------------------------------------------------------------ */

/* MLP.forward(x) = net2(relu(net1(x))). */
static tp_status mlp_forward(tp_module *self, int nargs, tp_tensor *const *args, int nkw,
                             const tp_kwarg *kw, tp_tensor **out)
{
    (void)kw;
    if (nargs != 1 || nkw != 0) {
        fprintf(stderr, "MLP.forward takes one input, got %d and %d keywords\n", nargs, nkw);
        return TP_ERR_INVALID_ARG;
    }
    tp_status st;
    tp_tensor *h = NULL, *a = NULL;
    CHECK(tp_module_call(tp_module_child(self, "net1"), args[0], &h));
    CHECK(tp_module_call(tp_module_child(self, "relu"), h, &a));
    CHECK(tp_module_call(tp_module_child(self, "net2"), a, out));
out:
    tp_tensor_release(a);
    tp_tensor_release(h);
    return st;
}

/* Hangs child under parent; frees it when the parent does not take it. */
static tp_status adopt(tp_module *parent, const char *name, tp_module *child)
{
    tp_status st = tp_module_add_child(parent, name, child);
    if (st != TP_OK)
        tp_module_free(child);
    return st;
}

static tp_status build_mlp(tp_module **out)
{
    tp_status st;
    tp_module *m = NULL, *c = NULL;
    *out = NULL;
    CHECK(tp_nn_custom_create("MLP", mlp_forward, NULL, NULL, &m));
    CHECK(tp_nn_linear_create(IN, HIDDEN, true, &c));
    CHECK(adopt(m, "net1", c));
    CHECK(tp_nn_relu_create(&c));
    CHECK(adopt(m, "relu", c));
    CHECK(tp_nn_linear_create(HIDDEN, OUT, true, &c));
    CHECK(adopt(m, "net2", c));
    *out = m;
    m = NULL;
out:
    tp_module_free(m);
    return st;
}

static tp_status parallelize_mlp(tp_module *m, tp_mesh *mesh, run_mode mode)
{
    tp_status st;
    tp_style *col = NULL, *row = NULL;
    tp_colwise_options co = {0};
    tp_rowwise_options ro = {0};
    if (mode == MODE_SP) {
        /* the batch rows arrive sharded, and leave sharded again */
        co.input_layouts = tp_layout_of(tp_shard(0));
        ro.output_layouts = tp_layout_of(tp_shard(0));
    }
    CHECK(tp_colwise_parallel_create(&co, &col));
    CHECK(tp_rowwise_parallel_create(&ro, &row));
    const tp_plan_entry plan[] = {{"net1", col}, {"net2", row}};
    /* tp_module_init overwrites every parameter right after, so nothing needs
     * to be sent from rank 0 */
    tp_parallelize_options po = {.src_data_rank = TP_SRC_DATA_RANK_NONE};
    CHECK(tp_parallelize_module(m, mesh, 2, plan, &po));
out:
    tp_style_free(col);
    tp_style_free(row);
    return st;
}

/* ---- training --------------------------------------------------------------- */

/*
 * loss = mean((y - t)^2) of one forward pass. Without sequence parallelism x
 * and t are the whole batch and so is the output. With it they hold this
 * rank's rows only, and so does the output: the squared errors become a
 * Shard(0) DTensor of the global [BATCH, OUT] shape, whose mean over every
 * element is a Partial(sum) (each rank's sum divided by the global count);
 * full_tensor adds the terms up (one all_reduce) into the value the 1-rank
 * run computes, and its backward hands every rank 1 / (BATCH * OUT) per local
 * element, without communication.
 */
static tp_status mse_loss(tp_tensor *y, tp_tensor *t, tp_mesh *mesh, run_mode mode,
                          tp_tensor **loss)
{
    tp_status st;
    tp_tensor *neg = NULL, *diff = NULL, *sq = NULL, *sq_dt = NULL, *mean = NULL;
    CHECK(tp_scale(t, -1.0, &neg));
    CHECK(tp_add(y, neg, &diff));
    CHECK(tp_mul(diff, diff, &sq));
    if (mode == MODE_SP) {
        const tp_placement s0 = tp_shard(0);
        const int64_t global[2] = {BATCH, OUT};
        const tp_from_local_options fo = {.global_shape = global};
        CHECK(tp_dtensor_from_local(mesh, sq, 1, &s0, &fo, &sq_dt));
        CHECK(tp_mean_all(sq_dt, &mean));
        CHECK(tp_dtensor_full_tensor(mean, loss));
    } else {
        CHECK(tp_mean_all(sq, loss));
    }
out:
    tp_tensor_release(mean);
    tp_tensor_release(sq_dt);
    tp_tensor_release(sq);
    tp_tensor_release(diff);
    tp_tensor_release(neg);
    return st;
}

/* The optimizer of a run: tp_sgd_step in f32; in bf16/f16 tp_sgd (f32
 * master weights), and for f16 a grad scaler. */
typedef struct trainer {
    tp_sgd *sgd;
    tp_grad_scaler *scaler;
} trainer;

static tp_status trainer_create(tp_module *model, tp_comm *world, tp_dtype dtype, trainer *tr)
{
    tp_status st = TP_OK;
    *tr = (trainer){0};
    if (dtype != TP_F32)
        CHECK(tp_sgd_create(model, LR, &tr->sgd));
    if (dtype == TP_F16) {
        /* the flag is agreed over the TP ranks, whose gradients are shards */
        const tp_grad_scaler_options o = {.init_scale = 1024};
        CHECK(tp_grad_scaler_create(world && tp_comm_size(world) > 1 ? world : NULL, &o,
                                    &tr->scaler));
    }
out:
    return st;
}

static void trainer_free(trainer *tr)
{
    tp_grad_scaler_free(tr->scaler);
    tp_sgd_free(tr->sgd);
}

/* backward, then the step (through the scaler in f16: an overflowing step
 * is skipped on every rank) */
static tp_status backward_and_step(tp_module *model, trainer *tr, tp_tensor *loss)
{
    tp_status st;
    tp_tensor *scaled = NULL;
    if (tr->scaler) {
        CHECK(tp_grad_scaler_scale(tr->scaler, loss, &scaled));
        CHECK(tp_backward(scaled, NULL));
    } else {
        CHECK(tp_backward(loss, NULL));
    }
    CHECK(tp_comm_debug_push_scope("SGD"));
    st = tr->scaler ? tp_grad_scaler_step_sgd(tr->scaler, tr->sgd, NULL)
         : tr->sgd  ? tp_sgd_opt_step(tr->sgd)
                    : tp_sgd_step(model, LR);
    if (st == TP_OK && tr->scaler)
        st = tp_grad_scaler_update(tr->scaler);
    tp_status pop = tp_comm_debug_pop_scope();
    CHECK(st != TP_OK ? st : pop);
out:
    tp_tensor_release(scaled);
    return st;
}

/* One SGD step on (x, t); *loss_value receives the loss before the update.
 * The loss and the SGD step run in comm-debug scopes of their own ("loss",
 * "SGD"), so that the tables attribute their collectives. */
static tp_status train_step(tp_module *model, trainer *tr, tp_mesh *mesh, run_mode mode,
                            tp_tensor *x, tp_tensor *t, double *loss_value)
{
    tp_status st;
    tp_tensor *y = NULL, *loss = NULL;
    CHECK(tp_module_call(model, x, &y));
    CHECK(tp_comm_debug_push_scope("loss"));
    st = mse_loss(y, t, mesh, mode, &loss);
    tp_status pop = tp_comm_debug_pop_scope();
    CHECK(st != TP_OK ? st : pop);
    CHECK(tp_tensor_get(loss, NULL, loss_value));
    CHECK(backward_and_step(model, tr, loss));
    tp_module_zero_grad(model);
out:
    tp_tensor_release(loss);
    tp_tensor_release(y);
    return st;
}

/* tp_module_state_dict callback: rank 0 keeps a copy of every full value. */
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

/* The body of every rank of a run. */
/* ---- checkpoints (--save, --load, --resume-check) -------------------------------- */

/* The model (and tp_sgd's f32 masters in bf16/f16) as a sharded checkpoint,
 * with the step reached; or loaded back, on any rank count and plan. */
static tp_status checkpoint(const char *save, const char *load, tp_module *m, trainer *tr,
                            int *step)
{
    tp_checkpoint_meta meta = {.key = "step", .value = *step};
    const tp_checkpoint_options o = {.n_meta = 1, .meta = &meta};
    const tp_checkpoint_optim opt = {.sgd = tr->sgd};
    if (save)
        return tp_checkpoint_save(save, m, &opt, &o);
    tp_status st = tp_checkpoint_load(load, m, &opt, &o);
    *step = st == TP_OK && meta.found && meta.value >= 0 && meta.value < MAX_STEPS ? (int)meta.value
                                                                                   : 0;
    return st;
}

static tp_status mlp_rank(tp_comm *world, void *arg)
{
    run *r = arg;
    const int rank = tp_comm_rank(world);
    const tp_device dev = r->cuda ? TP_CUDA(rank % tp_cuda_device_count()) : TP_CPU;
    tp_status st;
    tp_comm *nccl = NULL;
    tp_mesh *mesh = NULL;
    tp_module *model = NULL;
    tp_tensor *x = NULL, *t = NULL, *x_rows = NULL, *x_in = NULL, *t_in = NULL;
    tp_comm_debug *debug = NULL;
    trainer tr = {0};

    if (g_nccl && r->mode != MODE_NONE) {
        /* the shm world of the threads carries the NCCL id; rank r uses
         * cuda:r (main checked that there are enough devices) */
        tp_nccl_options no = {.bootstrap = world, .device = rank};
        CHECK(tp_comm_create_world("nccl", &no, &nccl));
        world = nccl;
    }
    if (r->mode != MODE_NONE) {
        const int64_t size = tp_comm_size(world);
        const char *const names[1] = {"tp"};
        CHECK(tp_mesh_create(world, 1, &size, names, &mesh));
    }
    CHECK(build_mlp(&model));
    if (r->mode != MODE_NONE)
        CHECK(parallelize_mlp(model, mesh, r->mode));
    CHECK(tp_module_init(model, PARAM_SEED));
    /* param_dtype: the f32 initial values rounded once, before any optimizer
     * exists (the masters start from the rounded values) */
    if (r->dtype != TP_F32)
        CHECK(tp_module_to_dtype(model, r->dtype));
    /* --device cuda: the same values, moved before the optimizer exists */
    if (r->cuda)
        CHECK(tp_module_to(model, dev));
    CHECK(trainer_create(model, r->mode == MODE_NONE ? NULL : world, r->dtype, &tr));
    int start_step = 0;
    if (r->load_dir)
        CHECK(checkpoint(NULL, r->load_dir, model, &tr, &start_step));

    /* the global batch: every rank generates the same values */
    const int64_t xshape[2] = {BATCH, IN}, tshape[2] = {BATCH, OUT};
    CHECK(tp_tensor_empty(r->dtype, TP_CPU, 2, xshape, &x));
    CHECK(tp_tensor_fill_random(x, TP_RNG_NORMAL, 0.0, 1.0, INPUT_SEED, NULL, NULL));
    CHECK(tp_tensor_empty(r->dtype, TP_CPU, 2, tshape, &t));
    CHECK(tp_tensor_fill_random(t, TP_RNG_NORMAL, 0.0, 1.0, TARGET_SEED, NULL, NULL));
    CHECK(to_device(&x, dev));
    CHECK(to_device(&t, dev));
    if (r->mode == MODE_SP) {
        /* this rank's rows: its Shard(0) block of the batch */
        const tp_placement s0 = tp_shard(0);
        int64_t local[2], offset[2];
        CHECK(tp_dtensor_shard_extent(mesh, 2, xshape, 1, &s0, NULL, local, offset));
        CHECK(tp_tensor_narrow(x, 0, offset[0], local[0], &x_rows));
        CHECK(tp_tensor_narrow(t, 0, offset[0], local[0], &t_in));
        /* The rows go in as a Shard(0) DTensor that knows the global shape. A
         * plain tensor would do when the ranks divide the batch evenly, but
         * the style wraps it with tp_dtensor_from_local without a global
         * shape, which assumes even shards (BATCH 8 on 3 ranks holds 3, 3
         * and 2 rows, and the all_gather would fail) */
        const tp_from_local_options fo = {.global_shape = xshape};
        CHECK(tp_dtensor_from_local(mesh, x_rows, 1, &s0, &fo, &x_in));
    } else {
        x_in = tp_tensor_retain(x);
        t_in = tp_tensor_retain(t);
    }

    CHECK(tp_comm_debug_create(&debug));
    /* each step reads its loss on the host, which waits for the device */
    const double start = now_seconds();
    for (int step = 0; step < r->steps; step++) {
        double loss = 0.0;
        if (step == 0)
            CHECK(tp_comm_debug_begin(debug));
        CHECK(train_step(model, &tr, mesh, r->mode, x_in, t_in, &loss));
        if (step == 0)
            CHECK(tp_comm_debug_end(debug));
        if (rank == 0)
            r->loss[step] = loss;
    }
    if (rank == 0) {
        r->seconds = now_seconds() - start;
        r->start_step = start_step;
    }
    if (r->save_dir) {
        int reached = start_step + r->steps;
        CHECK(checkpoint(r->save_dir, NULL, model, &tr, &reached));
    }
    CHECK(tp_module_state_dict(model, keep_param, rank == 0 ? r : NULL));
    if (rank == 0) {
        r->debug = debug; /* main reads it after tp_run_local joined the ranks */
        debug = NULL;
    }
out:
    trainer_free(&tr);
    tp_comm_debug_free(debug);
    tp_tensor_release(t_in);
    tp_tensor_release(x_in);
    tp_tensor_release(x_rows);
    tp_tensor_release(t);
    tp_tensor_release(x);
    tp_mesh_free(mesh); /* any order: the model's DTensors and hooks hold the mesh */
    tp_module_free(model);
    tp_comm_free(nccl); /* the mesh and the model held their own references */
    return st;
}

/* ---- comparing runs --------------------------------------------------------- */

static bool close_to(double a, double ref, double rtol, double atol)
{
    return fabs(a - ref) <= atol + rtol * fabs(ref);
}

/* Compares r with the reference: losses per step, then every parameter,
 * within rtol, atol. */
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
            tp_tensor_allclose(got->full, want->full, rtol, atol, &close) != TP_OK || !close) {
            fprintf(stderr, "  parameter %s differs from the reference (max |diff| %.3g)%s\n",
                    want->fqn, d, got ? "" : ": missing");
            r->ok = false;
        }
        r->param_diff = d > r->param_diff ? d : r->param_diff;
    }
}

/* The collectives training step 0 issues on rank 0, per scope (module FQNs
 * as in the plans, "" the root MLP, and the "loss" and "SGD" scopes), as the
 * README describes each plan: nothing on one rank; TP: net2's all_reduce;
 * TP+SP: net1's all_gather, net2's reduce_scatter and, in backward, its
 * all_gather, and the loss's all_reduce. The checked query makes a scope
 * that never ran an error rather than a 0. Prints what differs. */
typedef struct expected_count {
    const char *scope;
    tp_phase phase;
    tp_coll_kind kind;
    int64_t n;
} expected_count;

static bool counts_as_described(const run *r)
{
    const int64_t c = r->ranks > 1 && r->mode != MODE_NONE;
    const bool sp = r->mode == MODE_SP;
    /* f16: the grad scaler's found-inf flag, agreed over the TP ranks */
    const int64_t f = r->dtype == TP_F16 ? c : 0;
    const expected_count want[] = {
        {TP_COMM_DEBUG_GLOBAL, TP_PHASE_COUNT, TP_COLL_ANY, (sp ? 4 * c : c) + f},
        {TP_COMM_DEBUG_ROOT, TP_PHASE_COUNT, TP_COLL_ANY, sp ? 3 * c : c},
        {"net1", TP_PHASE_FORWARD, TP_COLL_ALL_GATHER, sp ? c : 0},
        {"net1", TP_PHASE_COUNT, TP_COLL_ANY, sp ? c : 0},
        {"relu", TP_PHASE_COUNT, TP_COLL_ANY, 0},
        {"net2", TP_PHASE_FORWARD, TP_COLL_ALL_REDUCE, sp ? 0 : c},
        {"net2", TP_PHASE_FORWARD, TP_COLL_REDUCE_SCATTER, sp ? c : 0},
        {"net2", TP_PHASE_BACKWARD, TP_COLL_ALL_GATHER, sp ? c : 0},
        {"net2", TP_PHASE_COUNT, TP_COLL_ANY, sp ? 2 * c : c},
        {"loss", TP_PHASE_FORWARD, TP_COLL_ALL_REDUCE, sp ? c : 0},
        {"loss", TP_PHASE_COUNT, TP_COLL_ANY, sp ? c : 0},
        {"SGD", TP_PHASE_COUNT, TP_COLL_ALL_REDUCE, f},
        {"SGD", TP_PHASE_COUNT, TP_COLL_ANY, f},
    };
    static const char *const phase[] = {"forward", "backward", "in all"};
    bool ok = true;
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        const expected_count *w = &want[i];
        int64_t got = -1;
        if (tp_comm_debug_scope_count(r->debug, w->scope, w->phase, w->kind, &got) != TP_OK) {
            fprintf(stderr, "   %s\n", tp_last_error());
            ok = false;
        } else if (got != w->n) {
            fprintf(stderr, "   scope \"%s\": %lld %s %s, the plan issues %lld\n", w->scope,
                    (long long)got,
                    w->kind == TP_COLL_ANY ? "collectives" : tp_coll_kind_name(w->kind),
                    phase[w->phase], (long long)w->n);
            ok = false;
        }
    }
    return ok;
}

static void run_free(run *r)
{
    for (int i = 0; i < r->nparams; i++)
        tp_tensor_release(r->params[i].full);
    r->nparams = 0;
    tp_comm_debug_free(r->debug);
    r->debug = NULL;
}

/* --dtype bf16/f16: the 1-rank run's final loss vs the same training in f32
 * (one more 1-rank run), within final_rtol_of. */
static bool final_loss_vs_f32(const run *lowp)
{
    run f32 = {
        .mode = MODE_NONE, .dtype = TP_F32, .cuda = lowp->cuda, .ranks = 1, .steps = lowp->steps};
    f32.status = tp_run_local(1, mlp_rank, &f32);
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
 * match in losses and parameters within DEV_RTOL, DEV_ATOL. */
static bool gpu_vs_cpu(run *gpu)
{
    run cpu = {.mode = MODE_NONE, .dtype = gpu->dtype, .ranks = 1, .steps = gpu->steps};
    cpu.status = tp_run_local(1, mlp_rank, &cpu);
    bool ok = cpu.status == TP_OK;
    if (!ok) {
        fprintf(stderr, "the CPU run failed: %s: %s\n", tp_status_name(cpu.status),
                tp_last_error());
    } else {
        compare(gpu, &cpu, DEV_RTOL, DEV_ATOL);
        ok = gpu->ok;
        printf("\n1-rank run on cuda vs the same run on the CPU: max |diff| loss %.3g, "
               "parameters %.3g (rtol %g, atol %g)  %s\n",
               gpu->loss_diff, gpu->param_diff, DEV_RTOL, DEV_ATOL, ok ? "ok" : "MISMATCH");
    }
    run_free(&cpu);
    return ok;
}

/* --device cuda: each device's peak tensor memory over the whole program
 * (tp_memory_stats), and each run's training throughput in rows of the batch
 * per second (rank 0's wall time of the steps, the first included). */
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
        if (r->status == TP_OK && r->seconds > 0)
            printf("%-6s on %d rank%s: %d steps in %.2f ms, %.0f tokens/s (rows of the batch)\n",
                   mode_name[r->mode], r->ranks, r->ranks > 1 ? "s" : "", r->steps,
                   1e3 * r->seconds, (double)BATCH * r->steps / r->seconds);
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

/* ---- main ------------------------------------------------------------------- */

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

static void usage(FILE *f)
{
    fprintf(f,
            "usage: tp-example-mlp [-r RANKS] [-s STEPS] [-b shm|mpi|nccl] [--dtype f32|bf16|f16]\n"
            "                      [--device cpu|cuda] [--save DIR] [--load DIR] [--resume-check]\n"
            "  -r RANKS  rank count of the TP runs, dividing %d (default: 1, 2 and 4)\n"
            "  -b mpi    under mpirun: the TP runs use one process per rank\n"
            "  -b nccl   with --device cuda: one GPU per rank (threads, an nccl world)\n"
            "  -s STEPS  SGD steps (default 5)\n"
            "  --dtype   train in f32 (default), bf16 or f16 (f32 master weights;\n"
            "            f16 with loss scaling), and compare with an f32 run\n"
            "  --device cpu|cuda, -D cpu|cuda\n"
            "            run on the CPU (default) or the GPU: with -b shm rank r on\n"
            "            cuda:(r %% device count), so the ranks share one GPU; the\n"
            "            1-rank run is checked against the CPU too. Exit 77 without\n"
            "            a CUDA device\n"
            "  --save DIR  train one TP run (RANKS, or the largest count) and save it\n"
            "            (and tp_sgd's f32 masters) as a sharded checkpoint\n"
            "  --load DIR  resume that run from a checkpoint, on any rank count (it\n"
            "            reshards); the steps are numbered on from the saved one\n"
            "  --resume-check  check that 2 x STEPS steps equal STEPS steps, --save,\n"
            "            --load on another rank count and STEPS more (exit 1 if not)\n",
            HIDDEN);
}

/* ---- --save, --load, --resume-check ---------------------------------------------- */

/* A TP run on the MPI world when there is one, else on `ranks` threads. */
static tp_status run_one(tp_comm *world, run *r)
{
    return world ? mlp_rank(world, r) : tp_run_local(r->ranks, mlp_rank, r);
}

static void print_losses(const char *label, const run *r)
{
    printf("%-22s %5d ", label, r->ranks);
    for (int s = 0; s < r->steps; s++)
        printf("  %d: %.6f", r->start_step + s, r->loss[s]);
    printf("\n");
}

static int remove_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb, (void)flag, (void)ftw;
    return remove(path);
}

/* --resume-check: 2 x STEPS steps on RANKS ranks, against STEPS steps, a
 * checkpoint, a load on another rank count (the checkpoint reshards) and
 * STEPS more steps: losses and final parameters within the run-to-run
 * tolerances. */
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
    resumed.ranks = base->ranks > 1 ? base->ranks / 2 : 2; /* both divide HIDDEN */
    run *order[3] = {&whole, &first, &resumed};
    const char *label[3] = {"straight through", "first half, saved", "loaded, second half"};
    bool ok = true;
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
        printf("\n%s: %d steps on %d rank(s) == %d steps, saved, loaded on %d rank(s) (step %d), "
               "%d more: max |diff| loss %.2e, parameters %.2e (rtol %g, atol %g)\n",
               ok ? "PASS" : "FAIL", 2 * base->steps, whole.ranks, base->steps, resumed.ranks,
               resumed.start_step, base->steps, resumed.loss_diff, resumed.param_diff, RTOL, ATOL);
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
    int rank_counts[3] = {1, 2, 4}, n_counts = 3, steps = 5;
    bool check_resume = false;
    const char *save_dir = NULL, *load_dir = NULL;
    bool use_mpi = false, use_cuda = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(argv[i], "-r")) {
            rank_counts[0] = parse_int(i + 1 < argc ? argv[++i] : NULL, 1, HIDDEN, "-r RANKS");
            n_counts = 1;
            if (rank_counts[0] < 0)
                return 2;
            /* net1's local output reaches net2 as a plain tensor, which
             * RowwiseParallel wraps assuming even shards of the hidden dim */
            if (HIDDEN % rank_counts[0]) {
                fprintf(stderr, "-r RANKS must divide the hidden size %d\n", HIDDEN);
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
        } else if (!strcmp(argv[i], "-s")) {
            steps = parse_int(i + 1 < argc ? argv[++i] : NULL, 1, MAX_STEPS, "-s STEPS");
            if (steps < 0)
                return 2;
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
        if (HIDDEN % tp_comm_size(world)) {
            fprintf(stderr, "the MPI world size %d must divide the hidden size %d\n",
                    tp_comm_size(world), HIDDEN);
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

    if (check_resume && (use_mpi || save_dir || load_dir || 2 * steps > MAX_STEPS)) {
        fprintf(stderr,
                "--resume-check runs threads and a checkpoint of its own (not with -b "
                "mpi, --save or --load) for 2 x STEPS <= %d steps\n",
                MAX_STEPS);
        tp_comm_free(world);
        return 2;
    }
    if (check_resume || save_dir || load_dir) {
        /* the TP plan at the (largest) rank count */
        const run base = {.mode = MODE_TP,
                          .dtype = g_dtype,
                          .cuda = use_cuda,
                          .ranks = rank_counts[n_counts - 1],
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
                                  .steps = steps};

    printf("libtp example: MLP (net1 = Linear(%d, %d), ReLU, net2 = Linear(%d, %d)), batch %d,\n"
           "loss mean((y - t)^2), SGD lr %g, %d steps, %s on %s%s; every run must match the\n"
           "1-rank run within rtol %g, atol %g\n",
           IN, HIDDEN, HIDDEN, OUT, BATCH, LR, steps, tp_dtype_name(g_dtype),
           use_cuda ? "cuda" : "the cpu", g_nccl ? " (nccl)" : "", RTOL, ATOL);
    if (use_cuda)
        printf("(%d CUDA device%s: rank r on cuda:(r %% %d); the 1-rank run also against the "
               "CPU)\n",
               tp_cuda_device_count(), tp_cuda_device_count() > 1 ? "s" : "",
               tp_cuda_device_count());

    bool all_ok = true;
    double worst_loss = 0.0, worst_param = 0.0;
    for (int i = 0; i < nruns; i++) {
        run *r = &runs[i];
        printf("\n== %s on %d rank%s: %s\n", mode_name[r->mode], r->ranks, r->ranks > 1 ? "s" : "",
               mode_plan[r->mode]);
        fflush(stdout);
        r->status = world && r->mode != MODE_NONE ? mlp_rank(world, r)
                                                    : tp_run_local(r->ranks, mlp_rank, r);
        if (r->status != TP_OK) {
            fprintf(stderr, "run failed: %s: %s\n", tp_status_name(r->status), tp_last_error());
            all_ok = false;
            if (i == 0)
                break; /* nothing to compare with */
            continue;
        }
        printf("   loss per step:");
        for (int s = 0; s < steps; s++)
            printf(" %.6f", r->loss[s]);
        printf("\n");
        if (i > 0) {
            if (reporter) /* the other processes hold no parameters */
                compare(r, &runs[0], RTOL, ATOL);
            else
                r->ok = true;
            printf("   max |diff| vs the 1-rank run: loss %.3g, parameters %.3g  %s\n",
                   r->loss_diff, r->param_diff, r->ok ? "ok" : "MISMATCH");
            all_ok = all_ok && r->ok;
            worst_loss = r->loss_diff > worst_loss ? r->loss_diff : worst_loss;
            worst_param = r->param_diff > worst_param ? r->param_diff : worst_param;
        }
        printf("   collectives of training step 0 (rank 0; forward, backward, SGD step):\n");
        fflush(stdout);
        if (reporter && tp_comm_debug_write_table(r->debug, stdout) != TP_OK) {
            fprintf(stderr, "tp_comm_debug_write_table: %s\n", tp_last_error());
            all_ok = false;
        }
        if (reporter) {
            bool as_described = counts_as_described(r);
            printf("   collectives per scope as the plan describes: %s\n",
                   as_described ? "yes" : "NO");
            all_ok = all_ok && as_described;
        }
    }

    /* the losses side by side, one column per run */
    if (runs[0].status == TP_OK) {
        printf("\nloss per step\nstep");
        for (int i = 0; i < nruns; i++) {
            char head[32];
            snprintf(head, sizeof head, "%s/%d", mode_name[runs[i].mode], runs[i].ranks);
            printf("  %10s", head);
        }
        printf("\n");
        for (int s = 0; s < steps; s++) {
            printf("%4d", s);
            for (int i = 0; i < nruns; i++) {
                if (runs[i].status == TP_OK)
                    printf("  %10.6f", runs[i].loss[s]);
                else
                    printf("  %10s", "failed");
            }
            printf("\n");
        }
    }

    if (g_dtype != TP_F32 && runs[0].status == TP_OK && reporter)
        all_ok = final_loss_vs_f32(&runs[0]) && all_ok;
    if (use_cuda && runs[0].status == TP_OK) {
        all_ok = gpu_vs_cpu(&runs[0]) && all_ok;
        print_device_summary(runs, nruns);
    }

    printf("\n%s: %d runs; max |diff| vs the 1-rank run: loss %.3g, parameters %.3g "
           "(rtol %g, atol %g)\n",
           all_ok ? "PASS" : "FAIL", nruns, worst_loss, worst_param, RTOL, ATOL);
    for (int i = 0; i < nruns; i++)
        run_free(&runs[i]);
    tp_comm_free(world); /* the last mpi communicator: finalizes MPI */
    return all_ok ? 0 : 1;
}
