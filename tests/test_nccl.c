/* The nccl backend: ranks are tp_run_local threads, one GPU each, whose
 * NCCL communicators are bootstrapped over the shm world. Every collective,
 * reduce op and dtype is compared with values each rank computes itself.
 *
 * Tests that need GPUs skip visibly (cr_skip_test) when the machine has
 * fewer than they need or libtp was built without NCCL; the error cases that
 * need no device run everywhere. */
#include <math.h>
#include <stdlib.h>
#include <time.h>

#include "tp_test.h"

/* ---- helpers ----------------------------------------------------------------- */

/* Main thread: skips the test unless NCCL is built in and n GPUs exist. */
static void need_gpus(int n)
{
#if !TP_HAVE_NCCL
    cr_skip_test("no CUDA device: libtp was built without NCCL (needs %d GPU%s)", n,
                 n == 1 ? "" : "s");
#else
    int have = tp_cuda_device_count();
    if (have == 0)
        cr_skip_test("no CUDA device: this test needs %d GPU%s", n, n == 1 ? "" : "s");
    if (have < n)
        cr_skip_test("not enough CUDA devices: this test needs %d, the machine has %d", n, have);
#endif
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Inside a rank: the nccl communicator of this rank, on cuda:rank. */
static tp_status nccl_world(tp_comm *boot, tp_comm **out)
{
    tp_nccl_options o = {.bootstrap = boot, .device = tp_comm_rank(boot)};
    return tp_comm_create_world("nccl", &o, out);
}

/* A 1-D tensor on cuda:dev holding vals (converted to dt). */
static tp_status dev_tensor(tp_dtype dt, int dev, int64_t n, const double *vals, tp_tensor **out)
{
    tp_tensor *h = NULL;
    TP_TEST_TRY(tp_tensor_empty(dt, TP_CPU, 1, &n, &h));
    tp_status st = TP_OK;
    for (int64_t i = 0; i < n && st == TP_OK; i++)
        st = tp_tensor_set(h, &i, vals[i]);
    if (st == TP_OK)
        st = tp_tensor_to(h, dt, TP_CUDA(dev), out);
    tp_tensor_release(h);
    return st;
}

/* Copies t's n elements back to the host as doubles. */
static tp_status dev_read(const tp_tensor *t, int64_t n, double *vals)
{
    tp_tensor *h = NULL;
    TP_TEST_TRY(tp_tensor_to(t, tp_tensor_dtype(t), TP_CPU, &h));
    tp_status st = TP_OK;
    for (int64_t i = 0; i < n && st == TP_OK; i++)
        st = tp_tensor_get(h, &i, &vals[i]);
    tp_tensor_release(h);
    return st;
}

static const tp_dtype all_dtypes[] = {TP_F32, TP_F64, TP_F16, TP_BF16, TP_I32, TP_I64};
#define N_DTYPES 6

/* Reduction inputs exact in every dtype: small integers, products of 1s and
 * 2s (at most 2^8 at 8 ranks, exact in bf16). */
static double red_in(tp_reduce_op op, int r, int64_t i)
{
    if (op == TP_PRODUCT)
        return (double)((r + i) % 2 + 1);
    return (double)(r + 1 + i % 5);
}

static double red_out(tp_reduce_op op, int n, int64_t i, tp_dtype dt)
{
    double acc = red_in(op, 0, i);
    for (int r = 1; r < n; r++) {
        double v = red_in(op, r, i);
        switch (op) {
        case TP_SUM:
        case TP_AVG: acc += v; break;
        case TP_PRODUCT: acc *= v; break;
        case TP_MAX: acc = v > acc ? v : acc; break;
        case TP_MIN: acc = v < acc ? v : acc; break;
        default: break;
        }
    }
    if (op == TP_AVG)
        acc = tp_dtype_is_float(dt) ? acc / n : (double)(int64_t)(acc / n);
    return acc;
}

/* avg on floats may be a multiply by 1/n, rounded in the dtype */
static bool close_to(double got, double want, tp_reduce_op op, tp_dtype dt)
{
    if (op != TP_AVG || !tp_dtype_is_float(dt))
        return got == want;
    double tol = dt == TP_BF16 ? 1.0 / 32 : dt == TP_F16 ? 1.0 / 256 : 1e-5;
    return fabs(got - want) <= tol * fabs(want);
}

typedef struct run_ctx {
    tp_test_slot slots[TP_TEST_MAX_RANKS];
} run_ctx;

/* ---- everywhere: errors that need no device ------------------------------------ */

Test(nccl, null_options_and_build, .timeout = 30)
{
    tp_comm *c = (tp_comm *)&c;
#if TP_HAVE_NCCL
    const tp_backend *b = tp_backend_find("nccl");
    cr_assert_not_null(b, "built with NCCL but no 'nccl' backend is registered");
    cr_assert_eq(b->device_mask, 1u << TP_DEVICE_CUDA);
    cr_assert_not_null(b->init_world);
    CHECK_ERR(tp_comm_create_world("nccl", NULL, &c), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "options are NULL") != NULL, "%s", tp_last_error());
    cr_assert_null(c);
    tp_nccl_options bad = {.bootstrap = NULL, .device = -2};
    CHECK_ERR(tp_comm_create_world("nccl", &bad, &c), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "device -2") != NULL, "%s", tp_last_error());
    cr_assert_null(c);
#else
    tp_nccl_options o = {.bootstrap = NULL, .device = -1};
    CHECK_ERR(tp_comm_create_world("nccl", &o, &c), TP_ERR_NOT_SUPPORTED);
    cr_assert(strstr(tp_last_error(), "built without NCCL") != NULL, "%s", tp_last_error());
    cr_assert_null(c);
    cr_assert_null(tp_backend_find("nccl"));
#endif
    CHECK_ERR(tp_comm_create_world("nccl", NULL, NULL), TP_ERR_INVALID_ARG);
}

#if TP_HAVE_NCCL && !TP_HAVE_MPI
Test(nccl, null_bootstrap_needs_mpi, .timeout = 30)
{
    tp_nccl_options o = {.bootstrap = NULL, .device = -1};
    tp_comm *c = NULL;
    CHECK_ERR(tp_comm_create_world("nccl", &o, &c), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "without MPI") != NULL, "%s", tp_last_error());
}
#endif

/* Rank 1 asks for a device that does not exist: every rank fails, none
 * enters NCCL's init (which would wait for the missing rank). With no GPU
 * at all every rank fails locally instead, and without NCCL every rank is
 * told so. */
static tp_status bad_device_rank(tp_comm *boot, void *arg)
{
    run_ctx *ctx = arg;
    int r = tp_comm_rank(boot);
    tp_test_slot *s = &ctx->slots[r];
    tp_nccl_options o = {.bootstrap = boot, .device = r == 1 ? 999 : -1};
    tp_comm *c = NULL;
    tp_clear_error();
    tp_status st = tp_comm_create_world("nccl", &o, &c);
    RANK_EXPECT(s, c == NULL, "rank %d got a communicator", r);
    tp_comm_free(c);
    if (!TP_HAVE_NCCL) {
        RANK_EXPECT(s, st == TP_ERR_NOT_SUPPORTED, "rank %d: %s (%s)", r, tp_status_name(st),
                    tp_last_error());
        RANK_EXPECT(s, strstr(tp_last_error(), "built without NCCL") != NULL, "rank %d: %s", r,
                    tp_last_error());
    } else if (tp_cuda_device_count() == 0) {
        RANK_EXPECT(s, st == TP_ERR_NOT_SUPPORTED, "rank %d: %s (%s)", r, tp_status_name(st),
                    tp_last_error());
        RANK_EXPECT(s, strstr(tp_last_error(), "no CUDA device") != NULL, "rank %d: %s", r,
                    tp_last_error());
    } else if (r == 1) {
        RANK_EXPECT(s, st == TP_ERR_INVALID_ARG, "rank 1: %s (%s)", tp_status_name(st),
                    tp_last_error());
        RANK_EXPECT(s, strstr(tp_last_error(), "cuda:999") != NULL, "rank 1: %s",
                    tp_last_error());
    } else {
        RANK_EXPECT(s, st == TP_ERR_STATE, "rank %d: %s (%s)", r, tp_status_name(st),
                    tp_last_error());
        RANK_EXPECT(s, strstr(tp_last_error(), "rank 1") != NULL, "rank %d: %s", r,
                    tp_last_error());
    }
    return TP_OK;
}

Test(nccl, bad_device_fails_on_every_rank, .timeout = 60)
{
    run_ctx ctx = {0};
    tp_test_run(2, bad_device_rank, &ctx, ctx.slots);
}

/* ---- world of one and larger worlds: every collective -------------------------- */

#define K 7 /* elements per block */

static tp_status check_all_reduce(tp_comm *c, tp_test_slot *s, int dev, tp_dtype dt,
                                  tp_reduce_op op, bool in_place)
{
    int r = tp_comm_rank(c), n = tp_comm_size(c);
    double in[K], out[K];
    for (int64_t i = 0; i < K; i++)
        in[i] = red_in(op, r, i);
    tp_tensor *x = NULL, *y = NULL;
    RANK_OK(s, dev_tensor(dt, dev, K, in, &x));
    if (in_place) {
        y = tp_tensor_retain(x);
    } else {
        int64_t k = K;
        tp_status st = tp_tensor_zeros(dt, TP_CUDA(dev), 1, &k, &y);
        if (st != TP_OK) {
            tp_tensor_release(x);
            RANK_OK(s, st);
        }
    }
    tp_status st = tp_all_reduce(c, x, y, op, NULL);
    if (st == TP_OK)
        st = dev_read(y, K, out);
    tp_tensor_release(x);
    tp_tensor_release(y);
    RANK_OK(s, st);
    for (int64_t i = 0; i < K; i++)
        RANK_EXPECT(s, close_to(out[i], red_out(op, n, i, dt), op, dt),
                    "all_reduce(%s, %s%s) at %d ranks: element %lld is %g, expected %g",
                    tp_dtype_name(dt), tp_reduce_op_name(op), in_place ? ", in place" : "", n,
                    (long long)i, out[i], red_out(op, n, i, dt));
    return TP_OK;
}

static tp_status check_gather_scatter(tp_comm *c, tp_test_slot *s, int dev, tp_dtype dt,
                                      bool in_place)
{
    int r = tp_comm_rank(c), n = tp_comm_size(c);
    int64_t nk = (int64_t)n * K;
    double *buf = calloc((size_t)nk, sizeof(double));
    if (!buf)
        return TP_ERR_NO_MEMORY;
    tp_tensor *big = NULL, *blk = NULL, *own = NULL;
    tp_status st = TP_OK;

    /* all_gather: block j holds 10 j + i (exact in bf16 up to 8 ranks) */
    for (int64_t i = 0; i < nk; i++)
        buf[i] = in_place && i / K == r ? (double)(10 * r + i % K) : -1.0;
    st = dev_tensor(dt, dev, nk, buf, &big);
    if (st == TP_OK && in_place) {
        st = tp_tensor_narrow(big, 0, (int64_t)r * K, K, &own);
    } else if (st == TP_OK) {
        double b[K];
        for (int i = 0; i < K; i++)
            b[i] = 10 * r + i;
        st = dev_tensor(dt, dev, K, b, &own);
    }
    if (st == TP_OK)
        st = tp_all_gather(c, own, big, NULL);
    if (st == TP_OK)
        st = dev_read(big, nk, buf);
    for (int64_t i = 0; st == TP_OK && i < nk; i++)
        RANK_EXPECT(s, buf[i] == (double)(10 * (i / K) + i % K),
                    "all_gather(%s%s) at %d ranks: element %lld is %g", tp_dtype_name(dt),
                    in_place ? ", in place" : "", n, (long long)i, buf[i]);
    tp_tensor_release(own);
    tp_tensor_release(big);
    own = big = NULL;

    /* reduce_scatter(sum): rank q contributes q + 1 + i at global index i */
    for (int64_t i = 0; st == TP_OK && i < nk; i++)
        buf[i] = (double)(r + 1) + (double)(i % 11);
    if (st == TP_OK)
        st = dev_tensor(dt, dev, nk, buf, &big);
    if (st == TP_OK && in_place) {
        st = tp_tensor_narrow(big, 0, (int64_t)r * K, K, &blk);
    } else if (st == TP_OK) {
        int64_t k = K;
        st = tp_tensor_zeros(dt, TP_CUDA(dev), 1, &k, &blk);
    }
    if (st == TP_OK)
        st = tp_reduce_scatter(c, big, blk, TP_SUM, NULL);
    double got[K];
    if (st == TP_OK)
        st = dev_read(blk, K, got);
    for (int i = 0; st == TP_OK && i < K; i++) {
        int64_t g = (int64_t)r * K + i;
        double want = (double)n * (n + 1) / 2 + (double)n * (double)(g % 11);
        RANK_EXPECT(s, got[i] == want, "reduce_scatter(%s%s) at %d ranks: element %d is %g, "
                    "expected %g", tp_dtype_name(dt), in_place ? ", in place" : "", n, i, got[i],
                    want);
    }
    tp_tensor_release(blk);
    tp_tensor_release(big);
    free(buf);
    RANK_OK(s, st);
    return TP_OK;
}

static tp_status check_all_to_all_broadcast(tp_comm *c, tp_test_slot *s, int dev, tp_dtype dt)
{
    int r = tp_comm_rank(c), n = tp_comm_size(c);
    int64_t nk = (int64_t)n * K;
    double *buf = calloc((size_t)nk, sizeof(double));
    if (!buf)
        return TP_ERR_NO_MEMORY;
    tp_tensor *x = NULL, *y = NULL;
    /* block j of rank q's send is 3 (q n + j) mod 240 + i: distinct blocks, exact in bf16 */
    for (int64_t i = 0; i < nk; i++)
        buf[i] = (double)((r * n + i / K) * 3 % 240 + i % K);
    tp_status st = dev_tensor(dt, dev, nk, buf, &x);
    if (st == TP_OK)
        st = tp_tensor_zeros(dt, TP_CUDA(dev), 1, &nk, &y);
    if (st == TP_OK)
        st = tp_all_to_all(c, x, y, NULL);
    if (st == TP_OK)
        st = dev_read(y, nk, buf);
    for (int64_t i = 0; st == TP_OK && i < nk; i++) {
        int64_t q = i / K; /* block q came from rank q, its block r */
        double want = (double)((q * n + r) * 3 % 240 + i % K);
        RANK_EXPECT(s, buf[i] == want, "all_to_all(%s) at %d ranks: element %lld is %g, "
                    "expected %g", tp_dtype_name(dt), n, (long long)i, buf[i], want);
    }
    tp_tensor_release(x);
    tp_tensor_release(y);
    x = y = NULL;

    int root = n - 1;
    for (int64_t i = 0; i < K; i++)
        buf[i] = r == root ? (double)(50 + i) : -1.0;
    if (st == TP_OK)
        st = dev_tensor(dt, dev, K, buf, &x);
    if (st == TP_OK)
        st = tp_broadcast(c, x, root, NULL);
    if (st == TP_OK)
        st = dev_read(x, K, buf);
    for (int64_t i = 0; st == TP_OK && i < K; i++)
        RANK_EXPECT(s, buf[i] == (double)(50 + i), "broadcast(%s, root %d) at %d ranks: "
                    "element %lld is %g", tp_dtype_name(dt), root, n, (long long)i, buf[i]);
    tp_tensor_release(x);
    free(buf);
    RANK_OK(s, st);
    RANK_OK(s, tp_barrier(c, NULL));
    return TP_OK;
}

/* Every root, in and out of place, blocking and async: block j of root's
 * send reaches rank j; the other ranks pass no send. */
static tp_status check_scatter(tp_comm *c, tp_test_slot *s, int dev, tp_dtype dt)
{
    int r = tp_comm_rank(c), n = tp_comm_size(c);
    int64_t nk = (int64_t)n * K;
    double *buf = calloc((size_t)nk, sizeof(double));
    if (!buf)
        return TP_ERR_NO_MEMORY;
    tp_status st = TP_OK;
    for (int root = 0; root < n && st == TP_OK; root++) {
        for (int mode = 0; mode < 4 && st == TP_OK; mode++) {
            bool in_place = mode & 1, async = mode & 2;
            tp_tensor *x = NULL, *y = NULL;
            for (int64_t g = 0; g < nk; g++)
                buf[g] = (double)((root * 7 + g) % 240);
            if (r == root)
                st = dev_tensor(dt, dev, nk, buf, &x);
            if (st == TP_OK && in_place && r == root)
                st = tp_tensor_narrow(x, 0, (int64_t)r * K, K, &y);
            else if (st == TP_OK)
                st = tp_tensor_zeros(dt, TP_CUDA(dev), 1, &(int64_t){K}, &y);
            tp_work *w = NULL;
            if (st == TP_OK)
                st = tp_scatter(c, x, y, root, async ? &w : NULL);
            if (st == TP_OK && w)
                st = tp_work_wait(w);
            tp_work_free(w);
            if (st == TP_OK)
                st = dev_read(y, K, buf);
            for (int64_t i = 0; st == TP_OK && i < K; i++) {
                double want = (double)((root * 7 + r * K + i) % 240);
                RANK_EXPECT(s, buf[i] == want, "scatter(%s, root %d, %s, %s) at %d ranks: "
                            "element %lld is %g, expected %g", tp_dtype_name(dt), root,
                            in_place ? "in place" : "out of place", async ? "async" : "blocking",
                            n, (long long)i, buf[i], want);
            }
            tp_tensor_release(x);
            tp_tensor_release(y);
        }
    }
    free(buf);
    RANK_OK(s, st);
    return TP_OK;
}

/* Async: a handle, polled with tp_work_test, then waited on (twice). */
static tp_status check_async(tp_comm *c, tp_test_slot *s, int dev)
{
    int n = tp_comm_size(c);
    double in[K], out[K];
    for (int i = 0; i < K; i++)
        in[i] = 2.0 + i;
    tp_tensor *x = NULL;
    RANK_OK(s, dev_tensor(TP_F32, dev, K, in, &x));
    tp_work *w = NULL;
    tp_status st = tp_all_reduce(c, x, x, TP_SUM, &w);
    bool done = false;
    for (int spins = 0; st == TP_OK && !done && spins < 10000000; spins++)
        st = tp_work_test(w, &done);
    if (st == TP_OK)
        st = tp_work_wait(w);
    if (st == TP_OK)
        st = tp_work_wait(w);
    tp_work_free(w);
    /* an async barrier too */
    w = NULL;
    if (st == TP_OK)
        st = tp_barrier(c, &w);
    if (st == TP_OK)
        st = tp_work_wait(w);
    tp_work_free(w);
    if (st == TP_OK)
        st = dev_read(x, K, out);
    tp_tensor_release(x);
    RANK_OK(s, st);
    RANK_EXPECT(s, done, "tp_work_test never reported completion");
    for (int i = 0; i < K; i++)
        RANK_EXPECT(s, out[i] == n * (2.0 + i), "async all_reduce: element %d is %g", i, out[i]);
    return TP_OK;
}

static tp_status collectives_rank(tp_comm *boot, void *arg)
{
    run_ctx *ctx = arg;
    int r = tp_comm_rank(boot), n = tp_comm_size(boot);
    tp_test_slot *s = &ctx->slots[r];
    tp_comm *c = NULL;
    RANK_OK(s, nccl_world(boot, &c));
    RANK_EXPECT(s, tp_comm_rank(c) == r && tp_comm_size(c) == n, "rank/size %d/%d, expected %d/%d",
                tp_comm_rank(c), tp_comm_size(c), r, n);
    RANK_EXPECT(s, strcmp(tp_comm_backend(c), "nccl") == 0, "backend '%s'", tp_comm_backend(c));
    tp_status st = TP_OK;
    for (int d = 0; d < N_DTYPES && st == TP_OK && !s->failed; d++)
        for (int op = 0; op < TP_REDUCE_OP_COUNT && st == TP_OK && !s->failed; op++)
            st = check_all_reduce(c, s, r, all_dtypes[d], (tp_reduce_op)op, d == 0 && op == 0);
    if (st == TP_OK && !s->failed)
        st = check_all_reduce(c, s, r, TP_F32, TP_MAX, true);
    for (int d = 0; d < N_DTYPES && st == TP_OK && !s->failed; d++) {
        st = check_gather_scatter(c, s, r, all_dtypes[d], false);
        if (st == TP_OK)
            st = check_gather_scatter(c, s, r, all_dtypes[d], true);
        if (st == TP_OK)
            st = check_all_to_all_broadcast(c, s, r, all_dtypes[d]);
        if (st == TP_OK)
            st = check_scatter(c, s, r, all_dtypes[d]);
    }
    if (st == TP_OK && !s->failed)
        st = check_async(c, s, r);
    tp_comm_free(c);
    return st;
}

TP_TEST_WORLD_SIZE_PARAMS(nccl, collectives)
ParameterizedTest(int *n, nccl, collectives, .timeout = 300)
{
    need_gpus(*n);
    run_ctx ctx = {0};
    tp_test_run(*n, collectives_rank, &ctx, ctx.slots);
}

/* ---- split ---------------------------------------------------------------------- */

static tp_status split_rank(tp_comm *boot, void *arg)
{
    run_ctx *ctx = arg;
    int r = tp_comm_rank(boot), n = tp_comm_size(boot);
    tp_test_slot *s = &ctx->slots[r];
    tp_comm *c = NULL, *sub = NULL;
    RANK_OK(s, nccl_world(boot, &c));
    /* the last rank of odd worlds sits out; the others split by parity,
     * ordered by descending old rank */
    bool out = n % 2 == 1 && n > 1 && r == n - 1;
    tp_status st = tp_comm_split(c, out ? TP_COMM_NO_COLOR : r % 2, -r, &sub);
    if (st == TP_OK && out) {
        RANK_EXPECT(s, sub == NULL, "rank %d passed no color but joined a group", r);
    } else if (st == TP_OK) {
        int members = 0, pos = 0;
        for (int q = 0; q < n; q++) {
            bool q_out = n % 2 == 1 && n > 1 && q == n - 1;
            if (!q_out && q % 2 == r % 2) {
                members++;
                if (q > r)
                    pos++;
            }
        }
        RANK_EXPECT(s, sub && tp_comm_size(sub) == members && tp_comm_rank(sub) == pos,
                    "rank %d: sub-communicator %d of %d, expected %d of %d", r,
                    tp_comm_rank(sub), tp_comm_size(sub), pos, members);
        RANK_EXPECT(s, sub && strcmp(tp_comm_backend(sub), "nccl") == 0, "split backend");
        double in[K], got[K];
        for (int i = 0; i < K; i++)
            in[i] = r + i;
        tp_tensor *x = NULL;
        st = dev_tensor(TP_I64, r, K, in, &x);
        if (st == TP_OK)
            st = tp_all_reduce(sub, x, x, TP_SUM, NULL);
        if (st == TP_OK)
            st = dev_read(x, K, got);
        tp_tensor_release(x);
        double rsum = 0;
        for (int q = 0; q < n; q++)
            if (!(n % 2 == 1 && n > 1 && q == n - 1) && q % 2 == r % 2)
                rsum += q;
        for (int i = 0; st == TP_OK && i < K; i++)
            RANK_EXPECT(s, got[i] == rsum + members * i, "split all_reduce: element %d is %g",
                        i, got[i]);
    }
    /* the parent still works after the split */
    if (st == TP_OK)
        st = tp_barrier(c, NULL);
    tp_comm_free(sub);
    tp_comm_free(c);
    RANK_OK(s, st);
    return TP_OK;
}

TP_TEST_WORLD_SIZE_PARAMS(nccl, split)
ParameterizedTest(int *n, nccl, split, .timeout = 300)
{
    need_gpus(*n);
    run_ctx ctx = {0};
    tp_test_run(*n, split_rank, &ctx, ctx.slots);
}

/* ---- errors, abort, timeout, descriptor check ------------------------------------ */

static tp_status errors_rank(tp_comm *boot, void *arg)
{
    run_ctx *ctx = arg;
    int r = tp_comm_rank(boot);
    tp_test_slot *s = &ctx->slots[r];
    tp_comm *c = NULL;
    RANK_OK(s, nccl_world(boot, &c));
    int64_t k = K;
    tp_tensor *cpu = NULL, *gpu = NULL;
    tp_status st = tp_tensor_zeros(TP_F32, TP_CPU, 1, &k, &cpu);
    if (st == TP_OK)
        st = tp_tensor_zeros(TP_F32, TP_CUDA(r), 1, &k, &gpu);
    if (st == TP_OK) {
        tp_clear_error();
        tp_status e = tp_all_reduce(c, cpu, cpu, TP_SUM, NULL);
        RANK_EXPECT(s, e == TP_ERR_NOT_SUPPORTED, "CPU buffers: %s", tp_status_name(e));
        RANK_EXPECT(s, strstr(tp_last_error(), "CPU") != NULL, "CPU buffers: %s",
                    tp_last_error());
        e = tp_all_reduce(c, gpu, cpu, TP_SUM, NULL);
        RANK_EXPECT(s, e == TP_ERR_NOT_SUPPORTED || e == TP_ERR_INVALID_ARG,
                    "mixed devices: %s", tp_status_name(e));
        e = tp_all_reduce(c, NULL, gpu, TP_SUM, NULL);
        RANK_EXPECT(s, e == TP_ERR_INVALID_ARG, "NULL send: %s", tp_status_name(e));
        e = tp_broadcast(c, gpu, 99, NULL);
        RANK_EXPECT(s, e == TP_ERR_INVALID_ARG, "bad root: %s", tp_status_name(e));
        e = tp_scatter(c, NULL, gpu, -1, NULL);
        RANK_EXPECT(s, e == TP_ERR_INVALID_ARG, "scatter bad root: %s", tp_status_name(e));
        e = tp_scatter(c, NULL, cpu, 0, NULL);
        RANK_EXPECT(s, e == TP_ERR_NOT_SUPPORTED, "scatter into CPU buffers: %s",
                    tp_status_name(e));
        /* argument errors leave the communicator usable */
        RANK_EXPECT(s, !tp_comm_is_aborted(c), "an argument error aborted the communicator");
        st = tp_all_reduce(c, gpu, gpu, TP_SUM, NULL);
    }
    /* the descriptor check goes through the backend with CPU descriptors */
    if (st == TP_OK)
        st = tp_comm_set_check(c, true);
    if (st == TP_OK)
        st = tp_all_reduce(c, gpu, gpu, TP_SUM, NULL);
    if (st == TP_OK && tp_comm_size(c) > 1) {
        tp_tensor *half = NULL;
        st = tp_tensor_narrow(gpu, 0, 0, r == 0 ? 3 : K, &half);
        if (st == TP_OK) {
            tp_status e = tp_all_reduce(c, half, half, TP_SUM, NULL);
            RANK_EXPECT(s, e == TP_ERR_MISMATCH, "mismatched counts under the check: %s (%s)",
                        tp_status_name(e), tp_last_error());
        }
        tp_tensor_release(half);
        /* the last rank names another scatter root */
        int n = tp_comm_size(c);
        int64_t kn = (int64_t)n * K;
        tp_tensor *xs = NULL;
        if (st == TP_OK)
            st = tp_tensor_zeros(TP_F32, TP_CUDA(r), 1, &kn, &xs);
        if (st == TP_OK) {
            tp_status e = tp_scatter(c, xs, gpu, r == n - 1 ? n - 1 : 0, NULL);
            RANK_EXPECT(s, e == TP_ERR_MISMATCH && strstr(tp_last_error(), "scatter"),
                        "mismatched scatter roots under the check: %s (%s)", tp_status_name(e),
                        tp_last_error());
        }
        tp_tensor_release(xs);
    }
    if (st == TP_OK)
        st = tp_comm_set_check(c, false);
    /* abort is local and final */
    if (st == TP_OK) {
        tp_comm_abort(c, "test abort");
        RANK_EXPECT(s, tp_comm_is_aborted(c), "not aborted after tp_comm_abort");
        tp_status e = tp_all_reduce(c, gpu, gpu, TP_SUM, NULL);
        RANK_EXPECT(s, e == TP_ERR_ABORTED, "after abort: %s", tp_status_name(e));
        tp_comm *sub = NULL;
        e = tp_comm_split(c, 0, 0, &sub);
        RANK_EXPECT(s, e == TP_ERR_ABORTED && sub == NULL, "split after abort: %s",
                    tp_status_name(e));
    }
    tp_tensor_release(cpu);
    tp_tensor_release(gpu);
    tp_comm_free(c);
    RANK_OK(s, st);
    return TP_OK;
}

TP_TEST_WORLD_SIZE_PARAMS(nccl, errors_and_abort)
ParameterizedTest(int *n, nccl, errors_and_abort, .timeout = 300)
{
    need_gpus(*n);
    run_ctx ctx = {0};
    tp_test_run(*n, errors_rank, &ctx, ctx.slots);
}

static tp_status wrong_device_rank(tp_comm *boot, void *arg)
{
    run_ctx *ctx = arg;
    int r = tp_comm_rank(boot);
    tp_test_slot *s = &ctx->slots[r];
    tp_nccl_options o = {.bootstrap = boot, .device = 0};
    tp_comm *c = NULL;
    RANK_OK(s, tp_comm_create_world("nccl", &o, &c));
    int64_t k = K;
    tp_tensor *other = NULL;
    tp_status st = tp_tensor_zeros(TP_F32, TP_CUDA(1), 1, &k, &other);
    if (st == TP_OK) {
        tp_clear_error();
        tp_status e = tp_all_reduce(c, other, other, TP_SUM, NULL);
        RANK_EXPECT(s, e == TP_ERR_INVALID_ARG && strstr(tp_last_error(), "cuda:1"),
                    "buffers on another device: %s (%s)", tp_status_name(e), tp_last_error());
    }
    tp_tensor_release(other);
    tp_comm_free(c);
    RANK_OK(s, st);
    return TP_OK;
}

Test(nccl, buffers_on_another_device, .timeout = 120)
{
    need_gpus(2);
    run_ctx ctx = {0};
    tp_test_run(1, wrong_device_rank, &ctx, ctx.slots);
}

/* Rank 0 issues an all_reduce that rank 1 never joins: rank 0 times out,
 * its communicator is aborted, and later calls say so. Rank 1 waits on the
 * bootstrap until then and aborts its own handle (its peer is gone). */
static tp_status timeout_rank(tp_comm *boot, void *arg)
{
    run_ctx *ctx = arg;
    int r = tp_comm_rank(boot);
    tp_test_slot *s = &ctx->slots[r];
    tp_comm *c = NULL;
    RANK_OK(s, nccl_world(boot, &c));
    int64_t k = K;
    tp_tensor *x = NULL;
    tp_status st = tp_tensor_zeros(TP_F32, TP_CUDA(r), 1, &k, &x);
    if (st == TP_OK)
        st = tp_comm_set_timeout(c, 0.5);
    if (st == TP_OK && r == 0) {
        double t0 = now_s();
        tp_status e = tp_all_reduce(c, x, x, TP_SUM, NULL);
        double took = now_s() - t0;
        RANK_EXPECT(s, e == TP_ERR_TIMEOUT, "unmatched all_reduce: %s (%s)", tp_status_name(e),
                    tp_last_error());
        RANK_EXPECT(s, took < 30, "the timeout took %.1f s", took);
        RANK_EXPECT(s, tp_comm_is_aborted(c), "not aborted after a timeout");
        e = tp_all_reduce(c, x, x, TP_SUM, NULL);
        RANK_EXPECT(s, e == TP_ERR_ABORTED, "after the timeout: %s", tp_status_name(e));
    }
    if (st == TP_OK)
        st = tp_barrier(boot, NULL);
    if (r != 0)
        tp_comm_abort(c, "peer timed out");
    tp_tensor_release(x);
    tp_comm_free(c);
    RANK_OK(s, st);
    return TP_OK;
}

Test(nccl, timeout_aborts, .timeout = 120)
{
    need_gpus(2);
    run_ctx ctx = {0};
    tp_test_run(2, timeout_rank, &ctx, ctx.slots);
}

/* ---- end to end: a parallelized MLP on GPUs over nccl ----------------------------
 *
 * Sequential(net1 = Linear(10, 16), relu, net2 = Linear(16, 10)) with
 * {"net1": Colwise, "net2": Rowwise} on n GPUs (n = 1 is the world of one):
 * parameters moved to cuda:rank, parallelized over an nccl mesh, forward,
 * sum, backward and one SGD step. The output and the updated full parameters
 * must equal the same steps on the CPU without parallelism, and the
 * collectives must be those of the DESIGN table (one all_reduce forward when
 * n > 1, none backward). */

enum { E2E_BATCH = 8, E2E_IN = 10, E2E_HIDDEN = 16, E2E_SEED = 77 };
#define E2E_LR 0.1

typedef struct e2e_ref {
    char fqn[32];
    tp_tensor *value; /* CPU, after the SGD step */
} e2e_ref;

typedef struct e2e_ctx {
    tp_test_slot slots[TP_TEST_MAX_RANKS];
    tp_tensor *x;         /* CPU input [8, 10] */
    tp_tensor *y_ref;     /* CPU output of the unparallelized MLP */
    e2e_ref ref[4];       /* net1/net2 weight and bias after one step */
    int nref;
} e2e_ctx;

static tp_status e2e_mlp(tp_module **out)
{
    tp_module *m = NULL, *a = NULL, *relu = NULL, *b = NULL;
    TP_TEST_TRY(tp_nn_sequential_create(&m));
    tp_status st = tp_nn_linear_create(E2E_IN, E2E_HIDDEN, true, &a);
    if (st == TP_OK && (st = tp_module_add_child(m, "net1", a)) != TP_OK)
        tp_module_free(a);
    if (st == TP_OK && (st = tp_nn_relu_create(&relu)) == TP_OK &&
        (st = tp_module_add_child(m, "relu", relu)) != TP_OK)
        tp_module_free(relu);
    if (st == TP_OK && (st = tp_nn_linear_create(E2E_HIDDEN, E2E_IN, true, &b)) == TP_OK &&
        (st = tp_module_add_child(m, "net2", b)) != TP_OK)
        tp_module_free(b);
    if (st != TP_OK) {
        tp_module_free(m);
        return st;
    }
    *out = m;
    return TP_OK;
}

/* forward, sum, backward, one SGD step; *y gets the forward output */
static tp_status e2e_step(tp_module *m, tp_tensor *x, tp_tensor **y)
{
    tp_tensor *out = NULL, *loss = NULL;
    TP_TEST_TRY(tp_module_call(m, x, &out));
    tp_status st = tp_sum_all(out, &loss);
    if (st == TP_OK)
        st = tp_backward(loss, NULL);
    if (st == TP_OK)
        st = tp_sgd_step(m, E2E_LR);
    tp_tensor_release(loss);
    if (st != TP_OK) {
        tp_tensor_release(out);
        return st;
    }
    *y = out;
    return TP_OK;
}

static tp_status e2e_keep_ref(const char *fqn, tp_tensor *full, void *arg)
{
    e2e_ctx *c = arg;
    if (c->nref == 4)
        return TP_ERR_STATE;
    snprintf(c->ref[c->nref].fqn, sizeof c->ref[c->nref].fqn, "%s", fqn);
    return tp_tensor_to(full, TP_F32, TP_CPU, &c->ref[c->nref++].value);
}

typedef struct e2e_check {
    e2e_ctx *c;
    tp_test_slot *s;
    int seen;
} e2e_check;

static tp_status e2e_compare_param(const char *fqn, tp_tensor *full, void *arg)
{
    e2e_check *k = arg;
    const e2e_ref *want = NULL;
    for (int i = 0; i < k->c->nref; i++)
        if (!strcmp(k->c->ref[i].fqn, fqn))
            want = &k->c->ref[i];
    RANK_EXPECT(k->s, want != NULL, "parameter %s is not in the CPU reference", fqn);
    if (!want)
        return TP_OK;
    RANK_EXPECT(k->s, tp_tensor_device(full).type == TP_DEVICE_CUDA,
                "the full value of %s left the GPU", fqn);
    tp_tensor *h = NULL;
    TP_TEST_TRY(tp_tensor_to(full, TP_F32, TP_CPU, &h));
    bool close = false;
    double d = 0.0;
    tp_status st = tp_tensor_allclose(h, want->value, 1e-4, 1e-5, &close);
    if (st == TP_OK)
        st = tp_tensor_max_abs_diff(h, want->value, &d);
    RANK_EXPECT(k->s, st != TP_OK || close, "%s after one SGD step differs from the CPU by %g",
                fqn, d);
    tp_tensor_release(h);
    k->seen++;
    return st;
}

static tp_status e2e_rank(tp_comm *boot, void *arg)
{
    e2e_ctx *c = arg;
    int rank = tp_comm_rank(boot), n = tp_comm_size(boot);
    tp_test_slot *s = &c->slots[rank];
    tp_comm *nc = NULL;
    tp_mesh *mesh = NULL;
    tp_module *m = NULL;
    tp_style *cs = NULL, *rs = NULL;
    tp_comm_debug *dbg = NULL;
    tp_tensor *x = NULL, *y = NULL, *yh = NULL;
    tp_status st;

#define E2E_TRY(expr)                                                           \
    do {                                                                        \
        st = (expr);                                                            \
        if (st != TP_OK) {                                                      \
            RANK_EXPECT(s, 0, "%s failed: %s (%s)", #expr, tp_status_name(st),  \
                        tp_last_error());                                       \
            goto out;                                                           \
        }                                                                       \
    } while (0)

    E2E_TRY(nccl_world(boot, &nc));
    RANK_EXPECT(s, !strcmp(tp_comm_backend(nc), "nccl"), "backend %s", tp_comm_backend(nc));
    const int64_t size = n;
    E2E_TRY(tp_mesh_create(nc, 1, &size, (const char *const[]){"tp"}, &mesh));
    E2E_TRY(e2e_mlp(&m));
    E2E_TRY(tp_module_to(m, TP_CUDA(rank)));
    E2E_TRY(tp_colwise_parallel_create(NULL, &cs));
    E2E_TRY(tp_rowwise_parallel_create(NULL, &rs));
    const tp_plan_entry plan[] = {{"net1", cs}, {"net2", rs}};
    E2E_TRY(tp_parallelize_module(m, mesh, 2, plan, NULL));
    E2E_TRY(tp_module_init(m, E2E_SEED));
    E2E_TRY(tp_tensor_to(c->x, TP_F32, TP_CUDA(rank), &x));

    E2E_TRY(tp_comm_debug_create(&dbg));
    E2E_TRY(tp_comm_debug_begin(dbg));
    st = e2e_step(m, x, &y);
    tp_status end = tp_comm_debug_end(dbg);
    E2E_TRY(st);
    E2E_TRY(end);
    const int64_t ar = n > 1 ? 1 : 0;
    RANK_EXPECT(s, tp_comm_debug_module_count(dbg, TP_COMM_DEBUG_GLOBAL, TP_PHASE_FORWARD, TP_COLL_ALL_REDUCE) == ar &&
                       tp_comm_debug_total(dbg) == ar,
                "%lld collectives (%lld forward all_reduces), expected %lld all_reduce",
                (long long)tp_comm_debug_total(dbg),
                (long long)tp_comm_debug_module_count(dbg, TP_COMM_DEBUG_GLOBAL, TP_PHASE_FORWARD, TP_COLL_ALL_REDUCE),
                (long long)ar);

    RANK_EXPECT(s, tp_tensor_device(y).type == TP_DEVICE_CUDA && tp_tensor_device(y).index == rank,
                "the output is not on cuda:%d", rank);
    E2E_TRY(tp_tensor_to(y, TP_F32, TP_CPU, &yh));
    bool close = false;
    E2E_TRY(tp_tensor_allclose(yh, c->y_ref, 1e-4, 1e-5, &close));
    RANK_EXPECT(s, close, "the MLP output on %d GPU%s differs from the CPU", n, n > 1 ? "s" : "");

    e2e_check k = {.c = c, .s = s};
    E2E_TRY(tp_module_state_dict(m, e2e_compare_param, &k));
    RANK_EXPECT(s, k.seen == 4, "compared %d parameters, expected 4", k.seen);
#undef E2E_TRY
out:
    tp_tensor_release(yh);
    tp_tensor_release(y);
    tp_tensor_release(x);
    tp_comm_debug_free(dbg);
    tp_style_free(cs);
    tp_style_free(rs);
    tp_module_free(m);
    tp_mesh_free(mesh);
    tp_comm_free(nc);
    return st;
}

ParameterizedTestParameters(nccl, mlp_end_to_end)
{
    static int sizes[] = {1, 2, 4};
    return cr_make_param_array(int, sizes, 3);
}

ParameterizedTest(int *n, nccl, mlp_end_to_end, .timeout = 300)
{
    need_gpus(*n);
    e2e_ctx c = {0};
    tp_module *ref = NULL;
    CHECK_OK(tp_tensor_empty(TP_F32, TP_CPU, 2, (int64_t[]){E2E_BATCH, E2E_IN}, &c.x));
    CHECK_OK(tp_tensor_fill_random(c.x, TP_RNG_NORMAL, 0.0, 1.0, 5, NULL, NULL));
    CHECK_OK(e2e_mlp(&ref));
    CHECK_OK(tp_module_init(ref, E2E_SEED));
    CHECK_OK(e2e_step(ref, c.x, &c.y_ref));
    CHECK_OK(tp_module_state_dict(ref, e2e_keep_ref, &c));
    cr_assert_eq(c.nref, 4);
    tp_status st = tp_run_local(*n, e2e_rank, &c);
    for (int i = 0; i < c.nref; i++)
        tp_tensor_release(c.ref[i].value);
    tp_tensor_release(c.y_ref);
    tp_tensor_release(c.x);
    tp_module_free(ref);
    tp_test_assert_slots(c.slots, *n);
    cr_assert_eq(st, TP_OK, "%s", tp_last_error());
}
