/* The shm backend on CUDA tensors (ranks as threads sharing TP_CUDA(0)),
 * against the same programs on the CPU: every public collective in every
 * dtype and reduce op, in place and out of place, blocking and async, on
 * the world and on split subgroups; the error semantics (mismatch, mixed
 * devices, timeout, abort); every redistribute transition of the placement
 * table on 1-D meshes and on a 2x2 mesh, forward and backward.
 *
 * Each case is one program (tests/tp_test_cuda_dist.h) run on the CPU, then
 * on CUDA; outputs, gradients and comm-debug counts must agree within the
 * tolerances of docs/API.md, "CUDA against CPU". Without a GPU the CPU run
 * is still checked and the test then skips ("no CUDA device: ..."). */
#include <time.h>

#include "tp_test_cuda_dist.h"
#include "tp_test_dtensor.h"

static const tp_dtype DTYPES[] = {TP_F32, TP_F64, TP_BF16, TP_F16, TP_I32, TP_I64};
#define N_DTYPES 6
static const int WORLDS[] = {1, 2, 3, 4};
#define N_WORLDS 4

static const char *dev_name(tp_device d)
{
    return d.type == TP_DEVICE_CPU ? "cpu" : "cuda";
}

/* ==== collectives ============================================================= */

#define K 5 /* elements per block */

/* The rank's send tensor of `count` elements (seeded by rank and salt). */
static tp_status send_of(dist_io *io, int rank, int64_t count, uint64_t salt, tp_tensor **t)
{
    return dist_rand(1, &count, io->dtype, io->dev, 1000 * salt + (uint64_t)rank, t);
}

static tp_status empty_of(dist_io *io, int64_t count, tp_tensor **t)
{
    return tp_tensor_zeros(io->dtype, io->dev, 1, &count, t);
}

/* all_reduce and reduce_scatter with `op`: out of place, in place, async. */
static tp_status reductions(tp_comm *c, dist_io *io, tp_reduce_op op, const char *tag)
{
    int r = tp_comm_rank(c), n = tp_comm_size(c);
    const dist_tol tol = DIST_EXACT; /* docs/API.md: collectives are bit-identical */
    tp_tensor *x = NULL, *y = NULL, *big = NULL, *blk = NULL;
    tp_work *wk = NULL;
    char name[64];
    TP_TEST_TRY(send_of(io, r, K, 1 + (uint64_t)op, &x));
    TP_TEST_TRY(empty_of(io, K, &y));
    TP_TEST_TRY(tp_all_reduce(c, x, y, op, NULL));
    snprintf(name, sizeof name, "%s all_reduce(%s)", tag, tp_reduce_op_name(op));
    TP_TEST_TRY(dist_keep(io, name, y, tol));
    TP_TEST_TRY(tp_all_reduce(c, x, x, op, NULL));
    snprintf(name, sizeof name, "%s all_reduce(%s) in place", tag, tp_reduce_op_name(op));
    TP_TEST_TRY(dist_keep(io, name, x, tol));
    /* async: polled to completion, then waited on (same status) */
    TP_TEST_TRY(tp_all_reduce(c, x, y, op, &wk));
    bool done = false;
    tp_status st = TP_OK;
    for (int i = 0; i < 2000000 && st == TP_OK && !done; i++)
        st = tp_work_test(wk, &done);
    if (st == TP_OK)
        st = tp_work_wait(wk);
    tp_work_free(wk);
    TP_TEST_TRY(st);
    snprintf(name, sizeof name, "%s async all_reduce(%s)", tag, tp_reduce_op_name(op));
    TP_TEST_TRY(dist_keep(io, name, y, tol));

    TP_TEST_TRY(send_of(io, r, (int64_t)n * K, 20 + (uint64_t)op, &big));
    TP_TEST_TRY(tp_reduce_scatter(c, big, y, op, NULL));
    snprintf(name, sizeof name, "%s reduce_scatter(%s)", tag, tp_reduce_op_name(op));
    TP_TEST_TRY(dist_keep(io, name, y, tol));
    TP_TEST_TRY(tp_tensor_narrow(big, 0, (int64_t)r * K, K, &blk));
    TP_TEST_TRY(tp_reduce_scatter(c, big, blk, op, &wk));
    st = tp_work_wait(wk);
    tp_work_free(wk);
    TP_TEST_TRY(st);
    snprintf(name, sizeof name, "%s async reduce_scatter(%s) in place", tag, tp_reduce_op_name(op));
    TP_TEST_TRY(dist_keep(io, name, blk, tol));
    tp_tensor_release(x);
    tp_tensor_release(y);
    tp_tensor_release(big);
    tp_tensor_release(blk);
    return TP_OK;
}

/* all_gather (both forms), all_to_all, broadcast, scatter (both forms),
 * barrier: data movement, bit-identical. */
static tp_status movements(tp_comm *c, dist_io *io, const char *tag)
{
    int r = tp_comm_rank(c), n = tp_comm_size(c);
    int64_t nk = (int64_t)n * K;
    tp_tensor *x = NULL, *big = NULL, *blk = NULL, *a2a = NULL, *y = NULL;
    tp_work *wk = NULL;
    char name[64];
    TP_TEST_TRY(send_of(io, r, K, 40, &x));
    TP_TEST_TRY(empty_of(io, nk, &big));
    TP_TEST_TRY(tp_all_gather(c, x, big, NULL));
    snprintf(name, sizeof name, "%s all_gather", tag);
    TP_TEST_TRY(dist_keep(io, name, big, DIST_EXACT));
    tp_tensor_release(big);
    TP_TEST_TRY(send_of(io, r, nk, 41, &big));
    TP_TEST_TRY(tp_tensor_narrow(big, 0, (int64_t)r * K, K, &blk));
    TP_TEST_TRY(tp_all_gather(c, blk, big, &wk));
    tp_status st = tp_work_wait(wk);
    tp_work_free(wk);
    TP_TEST_TRY(st);
    snprintf(name, sizeof name, "%s async all_gather in place", tag);
    TP_TEST_TRY(dist_keep(io, name, big, DIST_EXACT));
    TP_TEST_TRY(empty_of(io, nk, &a2a));
    TP_TEST_TRY(tp_all_to_all(c, big, a2a, NULL));
    snprintf(name, sizeof name, "%s all_to_all", tag);
    TP_TEST_TRY(dist_keep(io, name, a2a, DIST_EXACT));
    TP_TEST_TRY(tp_broadcast(c, x, n - 1, NULL));
    snprintf(name, sizeof name, "%s broadcast", tag);
    TP_TEST_TRY(dist_keep(io, name, x, DIST_EXACT));
    TP_TEST_TRY(empty_of(io, K, &y));
    TP_TEST_TRY(tp_scatter(c, r == 0 ? a2a : NULL, y, 0, NULL));
    snprintf(name, sizeof name, "%s scatter", tag);
    TP_TEST_TRY(dist_keep(io, name, y, DIST_EXACT));
    tp_tensor_release(blk);
    blk = NULL;
    if (r == n - 1)
        TP_TEST_TRY(tp_tensor_narrow(a2a, 0, (int64_t)r * K, K, &blk));
    TP_TEST_TRY(tp_scatter(c, r == n - 1 ? a2a : NULL, blk ? blk : y, n - 1, NULL));
    snprintf(name, sizeof name, "%s scatter in place at root", tag);
    TP_TEST_TRY(dist_keep(io, name, blk ? blk : y, DIST_EXACT));
    TP_TEST_TRY(tp_barrier(c, &wk));
    st = tp_work_wait(wk);
    tp_work_free(wk);
    TP_TEST_TRY(st);
    tp_tensor *all[] = {x, big, blk, a2a, y};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        tp_tensor_release(all[i]);
    return TP_OK;
}

/* Every collective and op on the world, then on a split: two subgroups by
 * rank parity, ordered by descending rank. */
static tp_status coll_prog(tp_comm *w, dist_io *io)
{
    for (int op = 0; op < TP_REDUCE_OP_COUNT; op++)
        RANK_OK(io->s, reductions(w, io, (tp_reduce_op)op, "world"));
    RANK_OK(io->s, movements(w, io, "world"));
    int r = tp_comm_rank(w);
    tp_comm *sub = NULL;
    RANK_OK(io->s, tp_comm_split(w, r % 2, -r, &sub));
    RANK_OK(io->s, dist_keep_int(io, "subgroup rank", tp_comm_rank(sub)));
    RANK_OK(io->s, reductions(sub, io, TP_SUM, "subgroup"));
    RANK_OK(io->s, reductions(sub, io, TP_MAX, "subgroup"));
    RANK_OK(io->s, movements(sub, io, "subgroup"));
    RANK_OK(io->s, tp_comm_free(sub));
    return TP_OK;
}

ParameterizedTestParameters(cuda_dist, collectives)
{
    static dist_param p[N_WORLDS * N_DTYPES];
    for (int i = 0; i < N_WORLDS; i++)
        for (int d = 0; d < N_DTYPES; d++)
            p[i * N_DTYPES + d] = (dist_param){WORLDS[i], DTYPES[d], 0};
    return cr_make_param_array(dist_param, p, N_WORLDS * N_DTYPES);
}

ParameterizedTest(dist_param *p, cuda_dist, collectives, .timeout = 120)
{
    char label[64];
    snprintf(label, sizeof label, "collectives, %s, world %d", tp_dtype_name(p->dtype), p->n);
    dist_compare(p->n, coll_prog, p->dtype, 0, label);
}

/* ==== error semantics ========================================================== */

static void sleep_s(double s)
{
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    nanosleep(&ts, NULL);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* The last rank disagrees: arg 0 with the count, 1 with the dtype. Every
 * rank gets TP_ERR_MISMATCH naming both sides; the next collective works. */
static tp_status mismatch_prog(tp_comm *w, dist_io *io)
{
    int r = tp_comm_rank(w), n = tp_comm_size(w);
    bool odd = r == n - 1;
    int64_t count = odd && io->arg == 0 ? 2 * K : K;
    tp_dtype dt = odd && io->arg == 1 ? TP_F64 : TP_F32;
    tp_tensor *x = NULL, *y = NULL;
    RANK_OK(io->s, tp_tensor_zeros(dt, io->dev, 1, &count, &x));
    tp_clear_error();
    tp_status st = tp_all_reduce(w, x, x, TP_SUM, NULL);
    const char *want =
        io->arg == 0 ? "all_reduce(f32, 10 elements, sum)" : "all_reduce(f64, 5 elements, sum)";
    RANK_EXPECT(io->s, st == TP_ERR_MISMATCH && strstr(tp_last_error(), want),
                "%s: a disagreeing rank: %s (%s), expected TP_ERR_MISMATCH naming '%s'",
                dev_name(io->dev), tp_status_name(st), tp_last_error(), want);
    RANK_OK(io->s, dist_keep_int(io, "mismatch status", st));
    RANK_OK(io->s, dist_rand(1, (int64_t[]){K}, TP_F32, io->dev, 7 + (uint64_t)r, &y));
    RANK_OK(io->s, tp_all_reduce(w, y, y, TP_SUM, NULL));
    RANK_OK(io->s, dist_keep(io, "all_reduce after the mismatch", y, DIST_EXACT));
    tp_tensor_release(x);
    tp_tensor_release(y);
    return TP_OK;
}

/* Rank 0 aborts (arg 2) or times out after 0.3 s waiting for late peers
 * (arg 3): ranks get TP_ERR_ABORTED / TP_ERR_TIMEOUT within a bound, never
 * hang. */
static tp_status fault_prog(tp_comm *w, dist_io *io)
{
    int r = tp_comm_rank(w);
    bool timeout = io->arg == 3;
    tp_tensor *x = NULL;
    RANK_OK(io->s, dist_rand(1, (int64_t[]){K}, TP_F32, io->dev, 3, &x));
    if (r == 0 && timeout)
        RANK_OK(io->s, tp_comm_set_timeout(w, 0.3));
    if (r == 0 && !timeout)
        tp_comm_abort(w, "giving up on purpose");
    if (r != 0 && timeout)
        sleep_s(1.0); /* late: rank 0 gives up first */
    double t0 = now_s();
    tp_clear_error();
    tp_status st = tp_all_reduce(w, x, x, TP_SUM, NULL);
    double waited = now_s() - t0;
    tp_status want = timeout && r == 0 ? TP_ERR_TIMEOUT : TP_ERR_ABORTED;
    const char *why = timeout ? "timed out" : "giving up on purpose";
    RANK_EXPECT(io->s, st == want && strstr(tp_last_error(), why),
                "%s: %s (%s), expected %s mentioning '%s'", dev_name(io->dev), tp_status_name(st),
                tp_last_error(), tp_status_name(want), why);
    RANK_EXPECT(io->s, waited < 5, "%s: the failing collective took %.2f s", dev_name(io->dev),
                waited);
    RANK_OK(io->s, dist_keep_int(io, "fault status", st));
    tp_tensor_release(x);
    return TP_OK;
}

static tp_status error_prog(tp_comm *w, dist_io *io)
{
    return io->arg < 2 ? mismatch_prog(w, io) : fault_prog(w, io);
}

ParameterizedTestParameters(cuda_dist, errors)
{
    static dist_param p[3 * 4];
    for (int n = 2; n <= 4; n++)
        for (int a = 0; a < 4; a++)
            p[(n - 2) * 4 + a] = (dist_param){n, TP_F32, a};
    return cr_make_param_array(dist_param, p, 12);
}

ParameterizedTest(dist_param *p, cuda_dist, errors, .timeout = 60)
{
    static const char *const what[] = {"count mismatch", "dtype mismatch", "abort", "timeout"};
    char label[64];
    snprintf(label, sizeof label, "%s, world %d", what[p->arg], p->n);
    dist_compare(p->n, error_prog, p->dtype, p->arg, label);
}

/* Rank 0 passes CPU buffers, the others CUDA ones: TP_ERR_MISMATCH on every
 * rank naming both device types. Needs a GPU by nature. */
typedef struct {
    tp_status got[TP_TEST_MAX_RANKS];
    char msg[TP_TEST_MAX_RANKS][512];
    tp_test_slot slot[TP_TEST_MAX_RANKS];
} mixed_ctx;

static tp_status mixed_prog(tp_comm *w, void *arg)
{
    mixed_ctx *c = arg;
    int r = tp_comm_rank(w);
    tp_tensor *x = NULL;
    RANK_OK(&c->slot[r],
            tp_tensor_zeros(TP_F32, r == 0 ? TP_CPU : TP_CUDA(0), 1, (int64_t[]){K}, &x));
    tp_clear_error();
    c->got[r] = tp_all_reduce(w, x, x, TP_SUM, NULL);
    snprintf(c->msg[r], sizeof c->msg[r], "%s", tp_last_error());
    tp_tensor_release(x);
    return TP_OK;
}

Test(cuda_dist, mixed_devices_mismatch, .timeout = 60)
{
    dist_need_cuda();
    for (int n = 2; n <= 4; n++) {
        mixed_ctx c = {0};
        tp_test_run(n, mixed_prog, &c, c.slot);
        for (int r = 0; r < n; r++) {
            cr_assert_eq(c.got[r], TP_ERR_MISMATCH, "world %d rank %d: %s (%s)", n, r,
                         tp_status_name(c.got[r]), c.msg[r]);
            cr_assert(strcasestr(c.msg[r], "cpu") && strcasestr(c.msg[r], "cuda"),
                      "world %d rank %d: the message names neither device: %s", n, r, c.msg[r]);
        }
    }
}

/* ==== redistribute ============================================================= */

/* A DTensor with placements pl over integer-valued data (tp_test_dtensor.h:
 * Partial values split into integer terms), moved to io->dev in io->dtype,
 * a leaf requiring grad through its local shard *local. */
static tp_status make_input(tp_mesh *mesh, dist_io *io, const int64_t *shape,
                            const tp_placement *pl, tp_tensor **local, tp_tensor **dt)
{
    tp_tensor *full = NULL, *cpu = NULL;
    TP_TEST_TRY(tp_test_global_tensor(2, shape, 31, &full));
    TP_TEST_TRY(tp_test_make_dtensor(mesh, full, pl, 32, &cpu));
    TP_TEST_TRY(tp_tensor_to(tp_dtensor_local(cpu), io->dtype, io->dev, local));
    TP_TEST_TRY(tp_tensor_set_requires_grad(*local, true));
    tp_from_local_options o = {.global_shape = shape};
    TP_TEST_TRY(tp_dtensor_from_local(mesh, *local, tp_mesh_ndim(mesh), pl, &o, dt));
    tp_tensor_release(full);
    tp_tensor_release(cpu);
    return TP_OK;
}

/* src -> dst forward (the local result) and backward (the gradient reaching
 * the source's shard from a seeded integer gradient; Replicate when dst has
 * a Partial dim). A transition the library refuses must be refused alike. */
static tp_status transition(tp_mesh *mesh, dist_io *io, const tp_placement *src,
                            const tp_placement *dst)
{
    int m = tp_mesh_ndim(mesh);
    int64_t W = tp_mesh_numel(mesh), shape[2] = {2 * W + 1, 3 * W};
    tp_tensor *local = NULL, *dt = NULL, *out = NULL, *ol = NULL, *g = NULL;
    char a[64], b[64], name[160];
    tp_placements_str(m, src, a, sizeof a);
    tp_placements_str(m, dst, b, sizeof b);
    TP_TEST_TRY(make_input(mesh, io, shape, src, &local, &dt));
    tp_status st = tp_dtensor_redistribute(dt, m, dst, &out);
    snprintf(name, sizeof name, "%s -> %s status", a, b);
    TP_TEST_TRY(dist_keep_int(io, name, st));
    if (st == TP_OK) {
        bool partial = false;
        tp_placement rep[TP_MESH_MAX_DIMS];
        for (int d = 0; d < m; d++) {
            rep[d] = tp_replicate();
            partial = partial || dst[d].kind == TP_PLACEMENT_PARTIAL;
        }
        snprintf(name, sizeof name, "%s -> %s forward", a, b);
        TP_TEST_TRY(dist_keep(io, name, out, DIST_EXACT));
        TP_TEST_TRY(tp_dtensor_to_local(out, partial ? m : 0, partial ? rep : NULL, &ol));
        TP_TEST_TRY(tp_test_global_tensor(2, tp_tensor_shape(ol), 33, &g));
        tp_tensor *gd = NULL;
        TP_TEST_TRY(tp_tensor_to(g, io->dtype, io->dev, &gd));
        TP_TEST_TRY(tp_backward(ol, gd));
        tp_tensor_release(gd);
        snprintf(name, sizeof name, "%s -> %s backward", a, b);
        TP_TEST_TRY(dist_keep(io, name, tp_tensor_grad(local), DIST_EXACT));
    }
    tp_tensor *all[] = {local, dt, out, ol, g};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        tp_tensor_release(all[i]);
    return TP_OK;
}

/* The placements of one mesh dim the table covers. */
static tp_placement pick(int i)
{
    switch (i) {
    case 0:
        return tp_replicate();
    case 1:
        return tp_shard(0);
    case 2:
        return tp_shard(1);
    case 3:
        return tp_partial(TP_SUM);
    default:
        return tp_partial(TP_MAX);
    }
}
#define N_PICK 5

/* arg 0: a 1-D mesh over the world, every (src, dst) pair; arg 1: the 2x2
 * mesh, every pair of 2-D placements with at most one Partial dim. */
static tp_status redist_prog(tp_comm *w, dist_io *io)
{
    tp_mesh *mesh = NULL;
    int64_t n = tp_comm_size(w);
    if (io->arg == 0)
        RANK_OK(io->s, tp_mesh_create(w, 1, &n, NULL, &mesh));
    else
        RANK_OK(io->s, tp_mesh_create(w, 2, (int64_t[]){2, 2}, NULL, &mesh));
    int m = tp_mesh_ndim(mesh), combos = m == 1 ? N_PICK : N_PICK * N_PICK;
    for (int i = 0; i < combos; i++)
        for (int j = 0; j < combos; j++) {
            tp_placement src[2] = {pick(i % N_PICK), pick(i / N_PICK)};
            tp_placement dst[2] = {pick(j % N_PICK), pick(j / N_PICK)};
            if (m == 2 &&
                ((src[0].kind == TP_PLACEMENT_PARTIAL && src[1].kind == TP_PLACEMENT_PARTIAL) ||
                 (dst[0].kind == TP_PLACEMENT_PARTIAL && dst[1].kind == TP_PLACEMENT_PARTIAL)))
                continue; /* tp_test_make_dtensor splits one Partial dim */
            RANK_OK(io->s, transition(mesh, io, src, dst));
        }
    tp_mesh_free(mesh);
    return TP_OK;
}

ParameterizedTestParameters(cuda_dist, redistribute)
{
    /* 1-D at every world size in f32 and bf16; the 2x2 mesh at world 4 */
    static dist_param p[2 * N_WORLDS + 2];
    for (int i = 0; i < N_WORLDS; i++) {
        p[2 * i] = (dist_param){WORLDS[i], TP_F32, 0};
        p[2 * i + 1] = (dist_param){WORLDS[i], TP_BF16, 0};
    }
    p[2 * N_WORLDS] = (dist_param){4, TP_F32, 1};
    p[2 * N_WORLDS + 1] = (dist_param){4, TP_BF16, 1};
    return cr_make_param_array(dist_param, p, 2 * N_WORLDS + 2);
}

ParameterizedTest(dist_param *p, cuda_dist, redistribute, .timeout = 300)
{
    char label[64];
    snprintf(label, sizeof label, "redistribute %s, %s, world %d", p->arg ? "2x2" : "1-D",
             tp_dtype_name(p->dtype), p->n);
    dist_compare(p->n, redist_prog, p->dtype, p->arg, label);
}
