/* The shm backend on CUDA tensors: ranks as threads sharing one GPU.
 *
 * Every collective kind, dtype and reduction, in place and not, at world
 * sizes 1, 2, 3, 4 and 8 and at sizes that exercise the vectorized body and the tail,
 * gives bit for bit the CPU backend's result (the reduction kernel combines
 * sources in the CPU's order and rounds bf16/f16 once, as the CPU does).
 * Then what the protocol adds on a GPU: work issued on a rank's stream just
 * before a collective is what the peers read, and work issued just after
 * sees the result, with no synchronization by the caller; mismatched device
 * types, timeouts and aborts fail on every rank without a hang; async handles
 * and split groups. World sizes up to 8 all share the one GPU.
 *
 * Without a GPU every test skips with "no CUDA device: ...". */
#include <math.h>
#include <time.h>

#include "tp_test.h"

#define DEV TP_CUDA(0)

static void need_cuda(void)
{
    if (tp_cuda_device_count() > 0)
        return;
    cr_skip_test("no CUDA device: %s", TP_HAVE_CUDA
                                           ? "libtp has CUDA but the machine shows no device"
                                           : "libtp was built without CUDA");
}

/* ---- every collective, CPU against CUDA ------------------------------------ */

enum { MAX_CASES = 512 };

static const tp_dtype dtypes[] = {TP_F32, TP_F64, TP_F16, TP_BF16, TP_I32, TP_I64};
static const tp_reduce_op rops[] = {TP_SUM, TP_AVG, TP_MAX, TP_MIN, TP_PRODUCT};
static const int64_t counts[] = {1037, (1 << 16) + 5};

typedef struct sweep_ctx {
    tp_device dev;
    tp_test_slot slots[TP_TEST_MAX_RANKS];
    /* per rank, per case: the received bytes, copied to the host */
    void *out[TP_TEST_MAX_RANKS][MAX_CASES];
    size_t bytes[TP_TEST_MAX_RANKS][MAX_CASES];
    char name[MAX_CASES][96];
    int ncases;
} sweep_ctx;

/* A tensor of n elements on `dev`: element i of rank r's input is exact in
 * every dtype (small multiples of 1/8, or integers). */
static tp_status pattern(tp_dtype dt, tp_device dev, int64_t n, int rank, int salt, tp_tensor **out)
{
    tp_tensor *h = NULL;
    TP_TEST_TRY(tp_tensor_empty(TP_F64, TP_CPU, 1, &n, &h));
    double *p = tp_tensor_data(h);
    bool flt = tp_dtype_is_float(dt);
    for (int64_t i = 0; i < n; i++) {
        int64_t v = (i * 131 + rank * 17 + salt * 7) % 97;
        p[i] = flt ? (double)(v - 48) / 8.0 : (double)(v - 48);
    }
    tp_status st = tp_tensor_to(h, dt, dev, out);
    tp_tensor_release(h);
    return st;
}

static tp_status keep(sweep_ctx *c, int rank, int idx, const tp_tensor *t)
{
    tp_tensor *h = NULL;
    TP_TEST_TRY(tp_tensor_to(t, tp_tensor_dtype(t), TP_CPU, &h));
    size_t b = tp_tensor_nbytes(h);
    c->out[rank][idx] = malloc(b ? b : 1);
    if (!c->out[rank][idx]) {
        tp_tensor_release(h);
        return TP_ERR_NO_MEMORY;
    }
    memcpy(c->out[rank][idx], tp_tensor_data(h), b);
    c->bytes[rank][idx] = b;
    tp_tensor_release(h);
    return TP_OK;
}

/* One collective of the sweep: inputs made, run, output kept. */
static tp_status one_case(tp_comm *w, sweep_ctx *c, int idx, tp_coll_kind kind, tp_dtype dt,
                          tp_reduce_op op, int64_t k, bool in_place)
{
    int r = tp_comm_rank(w), n = tp_comm_size(w);
    int64_t nk = k * n;
    tp_tensor *send = NULL, *recv = NULL;
    tp_status st = TP_OK;
    switch (kind) {
    case TP_COLL_ALL_REDUCE:
        st = pattern(dt, c->dev, k, r, idx, &send);
        if (st == TP_OK && in_place)
            recv = tp_tensor_retain(send);
        else if (st == TP_OK)
            st = tp_tensor_zeros(dt, c->dev, 1, &k, &recv);
        if (st == TP_OK)
            st = tp_all_reduce(w, send, recv, op, NULL);
        break;
    case TP_COLL_REDUCE_SCATTER:
        st = pattern(dt, c->dev, nk, r, idx, &send);
        if (st == TP_OK)
            st = tp_tensor_zeros(dt, c->dev, 1, &k, &recv);
        if (st == TP_OK)
            st = tp_reduce_scatter(w, send, recv, op, NULL);
        break;
    case TP_COLL_ALL_GATHER:
        st = pattern(dt, c->dev, k, r, idx, &send);
        if (st == TP_OK)
            st = tp_tensor_zeros(dt, c->dev, 1, &nk, &recv);
        if (st == TP_OK)
            st = tp_all_gather(w, send, recv, NULL);
        break;
    case TP_COLL_ALL_TO_ALL:
        st = pattern(dt, c->dev, nk, r, idx, &send);
        if (st == TP_OK)
            st = tp_tensor_zeros(dt, c->dev, 1, &nk, &recv);
        if (st == TP_OK)
            st = tp_all_to_all(w, send, recv, NULL);
        break;
    case TP_COLL_BROADCAST:
        st = pattern(dt, c->dev, k, r, idx, &recv);
        if (st == TP_OK)
            st = tp_broadcast(w, recv, n - 1, NULL);
        break;
    case TP_COLL_SCATTER:
        st = pattern(dt, c->dev, nk, r, idx, &send);
        if (st == TP_OK)
            st = tp_tensor_zeros(dt, c->dev, 1, &k, &recv);
        if (st == TP_OK)
            st = tp_scatter(w, send, recv, 0, NULL);
        break;
    default:
        st = TP_ERR_INVALID_ARG;
    }
    if (st == TP_OK)
        st = keep(c, r, idx, recv);
    if (r == 0)
        snprintf(c->name[idx], sizeof c->name[idx], "%s(%s, %lld, %s%s)", tp_coll_kind_name(kind),
                 tp_dtype_name(dt), (long long)k,
                 kind == TP_COLL_ALL_REDUCE || kind == TP_COLL_REDUCE_SCATTER
                     ? tp_reduce_op_name(op)
                     : "-",
                 in_place ? ", in place" : "");
    tp_tensor_release(send);
    tp_tensor_release(recv);
    return st;
}

static tp_status sweep_rank(tp_comm *w, void *arg)
{
    sweep_ctx *c = arg;
    int r = tp_comm_rank(w);
    tp_test_slot *s = &c->slots[r];
    int idx = 0;
    for (size_t ci = 0; ci < sizeof counts / sizeof *counts; ci++) {
        for (size_t di = 0; di < sizeof dtypes / sizeof *dtypes; di++) {
            tp_dtype dt = dtypes[di];
            int64_t k = counts[ci];
            for (size_t oi = 0; oi < sizeof rops / sizeof *rops; oi++) {
                for (int ip = 0; ip < 2; ip++)
                    RANK_OK(s, one_case(w, c, idx++, TP_COLL_ALL_REDUCE, dt, rops[oi], k, ip));
                RANK_OK(s, one_case(w, c, idx++, TP_COLL_REDUCE_SCATTER, dt, rops[oi], k, false));
            }
            const tp_coll_kind moves[] = {TP_COLL_ALL_GATHER, TP_COLL_ALL_TO_ALL, TP_COLL_BROADCAST,
                                          TP_COLL_SCATTER};
            for (size_t mi = 0; mi < 4; mi++)
                RANK_OK(s, one_case(w, c, idx++, moves[mi], dt, TP_SUM, k, false));
        }
    }
    if (r == 0)
        c->ncases = idx;
    return TP_OK;
}

static void sweep_free(sweep_ctx *c, int n)
{
    for (int r = 0; r < n; r++)
        for (int i = 0; i < MAX_CASES; i++)
            free(c->out[r][i]);
}

TP_TEST_WORLD_SIZE_PARAMS(shm_cuda, collectives_equal_the_cpu_backend_bit_for_bit)
ParameterizedTest(int *n, shm_cuda, collectives_equal_the_cpu_backend_bit_for_bit, .timeout = 300)
{
    need_cuda();
    static sweep_ctx cpu, gpu;
    memset(&cpu, 0, sizeof cpu);
    memset(&gpu, 0, sizeof gpu);
    cpu.dev = TP_CPU;
    gpu.dev = DEV;
    tp_test_run(*n, sweep_rank, &cpu, cpu.slots);
    tp_test_run(*n, sweep_rank, &gpu, gpu.slots);
    cr_assert_eq(cpu.ncases, gpu.ncases);
    cr_assert_gt(gpu.ncases, 100);
    int bad = 0;
    char first[256] = "";
    for (int r = 0; r < *n; r++)
        for (int i = 0; i < gpu.ncases; i++) {
            bool same = cpu.bytes[r][i] == gpu.bytes[r][i] &&
                        memcmp(cpu.out[r][i], gpu.out[r][i], cpu.bytes[r][i]) == 0;
            if (!same && !bad++)
                snprintf(first, sizeof first, "rank %d: %s", r, gpu.name[i]);
        }
    sweep_free(&cpu, *n);
    sweep_free(&gpu, *n);
    cr_assert_eq(bad, 0, "%d results differ from the CPU backend's; first: %s", bad, first);
}

/* ---- stream ordering -------------------------------------------------------- */

typedef struct order_ctx {
    tp_test_slot slots[TP_TEST_MAX_RANKS];
    int rounds;
} order_ctx;

/* Each round: fill (a kernel on the rank's stream), all_reduce in place,
 * all_gather of the result, then read back, with no synchronization by the
 * caller. 64 MiB per rank so that a missing wait shows as stale data. */
static tp_status order_rank(tp_comm *w, void *arg)
{
    order_ctx *c = arg;
    int r = tp_comm_rank(w), n = tp_comm_size(w);
    tp_test_slot *s = &c->slots[r];
    int64_t k = 16 << 20, nk = k * n;
    tp_tensor *x = NULL, *g = NULL, *h = NULL;
    tp_status st = tp_tensor_empty(TP_F32, DEV, 1, &k, &x);
    if (st == TP_OK)
        st = tp_tensor_empty(TP_F32, DEV, 1, &nk, &g);
    for (int round = 0; st == TP_OK && round < c->rounds; round++) {
        double v = (double)(r + 1) * (round + 1);
        st = tp_tensor_fill(x, v);
        if (st == TP_OK)
            st = tp_all_reduce(w, x, x, TP_SUM, NULL);
        if (st == TP_OK)
            st = tp_all_gather(w, x, g, NULL);
        if (st == TP_OK)
            st = tp_tensor_to(g, TP_F32, TP_CPU, &h);
        if (st != TP_OK)
            break;
        double want = (double)n * (n + 1) / 2 * (round + 1);
        const float *p = tp_tensor_data(h);
        int64_t wrong = 0, at = -1;
        for (int64_t i = 0; i < nk; i++)
            if (p[i] != (float)want && !wrong++)
                at = i;
        RANK_EXPECT(s, wrong == 0,
                    "round %d: %lld of %lld elements stale (first at %lld: %g, want %g)", round,
                    (long long)wrong, (long long)nk, (long long)at, at >= 0 ? p[at] : 0.0, want);
        tp_tensor_release(h);
        h = NULL;
    }
    tp_tensor_release(x);
    tp_tensor_release(g);
    RANK_OK(s, st);
    return TP_OK;
}

TP_TEST_WORLD_SIZE_PARAMS(shm_cuda, work_before_and_after_is_ordered_without_a_sync)
ParameterizedTest(int *n, shm_cuda, work_before_and_after_is_ordered_without_a_sync, .timeout = 300)
{
    need_cuda();
    order_ctx c = {.rounds = 5};
    tp_test_run(*n, order_rank, &c, c.slots);
}

/* ---- failures ----------------------------------------------------------------- */

typedef struct fail_ctx {
    int mode;
    tp_status st[TP_TEST_MAX_RANKS];
    char msg[TP_TEST_MAX_RANKS][512];
    double seconds[TP_TEST_MAX_RANKS];
} fail_ctx;

enum { MIXED_DEVICES, SILENT_PEER, ABORTING_PEER, MISMATCHED_COUNT };

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static tp_status fail_rank(tp_comm *w, void *arg)
{
    fail_ctx *c = arg;
    int r = tp_comm_rank(w);
    int64_t k = 4096 + (c->mode == MISMATCHED_COUNT ? r : 0);
    tp_tensor *x = NULL;
    tp_comm_set_timeout(w, 0.5);
    tp_device dev = c->mode == MIXED_DEVICES && r == 1 ? TP_CPU : DEV;
    tp_status st = tp_tensor_zeros(TP_F32, dev, 1, &k, &x);
    double t0 = now_s();
    if (st == TP_OK) {
        if (c->mode == SILENT_PEER && r == 1)
            nanosleep(&(struct timespec){1, 0}, NULL); /* alive, never joins */
        else if (c->mode == ABORTING_PEER && r == 1)
            tp_comm_abort(w, "rank 1 stops on purpose");
        else
            st = tp_all_reduce(w, x, x, TP_SUM, NULL);
    }
    c->seconds[r] = now_s() - t0;
    c->st[r] = st;
    snprintf(c->msg[r], sizeof c->msg[r], "%s", st == TP_OK ? "" : tp_last_error());
    tp_tensor_release(x);
    return TP_OK;
}

static void run_fail(fail_ctx *c, int n)
{
    tp_status st = tp_run_local(n, fail_rank, c);
    (void)st; /* the ranks' own statuses are what is asserted */
}

Test(shm_cuda, cpu_and_cuda_buffers_in_one_collective_are_a_mismatch, .timeout = 60)
{
    need_cuda();
    fail_ctx c = {.mode = MIXED_DEVICES};
    run_fail(&c, 2);
    for (int r = 0; r < 2; r++) {
        cr_assert_eq(c.st[r], TP_ERR_MISMATCH, "rank %d: %s (%s)", r, tp_status_name(c.st[r]),
                     c.msg[r]);
        cr_assert(strstr(c.msg[r], "CUDA") && strstr(c.msg[r], "CPU"), "rank %d: %s", r, c.msg[r]);
    }
}

Test(shm_cuda, ranks_that_disagree_fail_alike, .timeout = 60)
{
    need_cuda();
    fail_ctx c = {.mode = MISMATCHED_COUNT};
    run_fail(&c, 3);
    for (int r = 0; r < 3; r++)
        cr_assert_eq(c.st[r], TP_ERR_MISMATCH, "rank %d: %s (%s)", r, tp_status_name(c.st[r]),
                     c.msg[r]);
}

Test(shm_cuda, a_silent_peer_is_a_timeout_not_a_hang, .timeout = 60)
{
    need_cuda();
    fail_ctx c = {.mode = SILENT_PEER};
    run_fail(&c, 2);
    cr_assert_eq(c.st[0], TP_ERR_TIMEOUT, "%s (%s)", tp_status_name(c.st[0]), c.msg[0]);
    cr_assert(c.seconds[0] >= 0.45 && c.seconds[0] < 5.0, "waited %.3f s", c.seconds[0]);
}

Test(shm_cuda, an_abort_reaches_every_rank, .timeout = 60)
{
    need_cuda();
    fail_ctx c = {.mode = ABORTING_PEER};
    run_fail(&c, 3);
    for (int r = 0; r < 3; r += 2) {
        cr_assert_eq(c.st[r], TP_ERR_ABORTED, "rank %d: %s (%s)", r, tp_status_name(c.st[r]),
                     c.msg[r]);
        cr_assert(strstr(c.msg[r], "stops on purpose"), "rank %d: %s", r, c.msg[r]);
    }
}

/* ---- async handles and split groups --------------------------------------------- */

typedef struct group_ctx {
    tp_test_slot slots[TP_TEST_MAX_RANKS];
} group_ctx;

/* Two groups by parity; in each, eight async all_reduces in flight at once,
 * then every handle waited in reverse order. */
static tp_status group_rank(tp_comm *w, void *arg)
{
    group_ctx *c = arg;
    int r = tp_comm_rank(w);
    tp_test_slot *s = &c->slots[r];
    tp_comm *sub = NULL;
    RANK_OK(s, tp_comm_split(w, r % 2, r, &sub));
    int m = tp_comm_size(sub);
    enum { NW = 8 };
    int64_t k = 1 << 16;
    tp_tensor *x[NW] = {0};
    tp_work *work[NW] = {0};
    tp_status st = TP_OK;
    for (int i = 0; i < NW && st == TP_OK; i++) {
        st = tp_tensor_empty(TP_BF16, DEV, 1, &k, &x[i]);
        if (st == TP_OK)
            st = tp_tensor_fill(x[i], (double)(i + 1));
        if (st == TP_OK)
            st = tp_all_reduce(sub, x[i], x[i], TP_SUM, &work[i]);
    }
    for (int i = NW - 1; i >= 0; i--) {
        if (work[i]) {
            tp_status ws = tp_work_wait(work[i]);
            if (st == TP_OK)
                st = ws;
            tp_work_free(work[i]);
        }
    }
    for (int i = 0; i < NW && st == TP_OK; i++) {
        double got = 0;
        st = tp_tensor_get(x[i], (int64_t[]){k - 1}, &got);
        RANK_EXPECT(s, st != TP_OK || got == (double)m * (i + 1),
                    "handle %d: last element %g, want %g", i, got, (double)m * (i + 1));
    }
    for (int i = 0; i < NW; i++)
        tp_tensor_release(x[i]);
    tp_comm_free(sub);
    RANK_OK(s, st);
    return TP_OK;
}

Test(shm_cuda, async_handles_in_split_groups, .timeout = 120)
{
    need_cuda();
    for (int n = 2; n <= 4; n++) {
        group_ctx c = {0};
        tp_test_run(n, group_rank, &c, c.slots);
    }
}
