/* Collectives of the shm backend: exact results for every collective, reduce
 * op and dtype on world sizes 1, 2, 3, 4, 8, in place and out of place,
 * blocking and async, and communicator splits. Inputs are small integers so
 * that every reduction is exact and each rank can compute the expected value
 * of every element itself. */
#include <math.h>
#include <sched.h>
#include <stdlib.h>

#include "tp_test.h"

static const tp_dtype all_dtypes[] = {TP_F32, TP_F64, TP_F16, TP_BF16, TP_I32, TP_I64};
enum { N_DTYPES = 6 };

/* Input element i of rank q for a reduction with op. */
static double input_value(tp_reduce_op op, int q, int64_t i)
{
    if (op == TP_PRODUCT)
        return (double)((q + i) % 2 + 1); /* products stay <= 2^8 */
    return (double)(q + 1 + (i % 13));
}

static double expected_reduce(tp_reduce_op op, tp_dtype dt, int n, int64_t i)
{
    double acc = input_value(op, 0, i);
    for (int q = 1; q < n; q++) {
        double v = input_value(op, q, i);
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
        acc = tp_dtype_is_float(dt) ? acc / n : (double)((int64_t)acc / n);
    return acc;
}

static tp_status make(tp_dtype dt, int64_t n, tp_tensor **t)
{
    return tp_tensor_zeros(dt, TP_CPU, 1, &n, t);
}

/* ---- all_reduce ----------------------------------------------------------- */

typedef struct {
    int64_t count;
    bool in_place;
    tp_test_slot slot[TP_TEST_MAX_RANKS];
} ar_ctx;

static tp_status ar_body(tp_comm *w, void *arg)
{
    ar_ctx *c = arg;
    int r = tp_comm_rank(w), n = tp_comm_size(w);
    tp_test_slot *s = &c->slot[r];
    for (int d = 0; d < N_DTYPES; d++) {
        for (int op = 0; op < TP_REDUCE_OP_COUNT; op++) {
            tp_tensor *x = NULL, *y = NULL;
            RANK_OK(s, make(all_dtypes[d], c->count, &x));
            for (int64_t i = 0; i < c->count; i++)
                RANK_OK(s, tp_tensor_set(x, &i, input_value(op, r, i)));
            if (c->in_place)
                y = tp_tensor_retain(x);
            else
                RANK_OK(s, make(all_dtypes[d], c->count, &y));
            RANK_OK(s, tp_all_reduce(w, x, y, (tp_reduce_op)op, NULL));
            int64_t bad = 0, first = -1;
            for (int64_t i = 0; i < c->count; i++) {
                double v = 0;
                tp_tensor_get(y, &i, &v);
                if (v != expected_reduce(op, all_dtypes[d], n, i) && bad++ == 0)
                    first = i;
            }
            RANK_EXPECT(s, bad == 0, "all_reduce %s %s count %lld: %lld wrong, first at %lld",
                        tp_dtype_name(all_dtypes[d]), tp_reduce_op_name(op),
                        (long long)c->count, (long long)bad, (long long)first);
            if (!c->in_place) { /* the input is untouched */
                for (int64_t i = 0; i < c->count && bad == 0; i++) {
                    double v = 0;
                    tp_tensor_get(x, &i, &v);
                    if (v != input_value(op, r, i))
                        bad++;
                }
                RANK_EXPECT(s, bad == 0, "all_reduce modified its send buffer");
            }
            tp_tensor_release(x);
            tp_tensor_release(y);
        }
    }
    return TP_OK;
}

TP_TEST_WORLD_SIZE_PARAMS(comm, all_reduce)

ParameterizedTest(int *n, comm, all_reduce, .timeout = 120)
{
    static const int64_t counts[] = {1, 7, 16, 1000, 4099};
    for (size_t k = 0; k < sizeof counts / sizeof counts[0]; k++) {
        for (int ip = 0; ip < 2; ip++) {
            ar_ctx c = {.count = counts[k], .in_place = ip};
            tp_status st = tp_run_local(*n, ar_body, &c);
            tp_test_assert_slots(c.slot, *n);
            cr_assert_eq(st, TP_OK, "%s", tp_last_error());
        }
    }
}

/* ---- all_gather, reduce_scatter, all_to_all, broadcast -------------------- */

typedef struct {
    int64_t k;
    bool in_place;
    tp_test_slot slot[TP_TEST_MAX_RANKS];
} coll_ctx;

/* at most 86: exact in every dtype, bf16's 8-bit significand included */
static double gval(int q, int64_t i) { return (double)((q + 1) * 10 + (i % 7)); }

static tp_status ag_body(tp_comm *w, void *arg)
{
    coll_ctx *c = arg;
    int r = tp_comm_rank(w), n = tp_comm_size(w);
    tp_test_slot *s = &c->slot[r];
    for (int d = 0; d < N_DTYPES; d++) {
        tp_tensor *x = NULL, *y = NULL;
        RANK_OK(s, make(all_dtypes[d], c->k * n, &y));
        if (c->in_place)
            RANK_OK(s, tp_tensor_narrow(y, 0, r * c->k, c->k, &x));
        else
            RANK_OK(s, make(all_dtypes[d], c->k, &x));
        for (int64_t i = 0; i < c->k; i++)
            RANK_OK(s, tp_tensor_set(x, &i, gval(r, i)));
        RANK_OK(s, tp_all_gather(w, x, y, NULL));
        int64_t bad = 0;
        for (int q = 0; q < n; q++)
            for (int64_t i = 0; i < c->k; i++) {
                int64_t g = q * c->k + i;
                double v = 0;
                tp_tensor_get(y, &g, &v);
                bad += v != gval(q, i);
            }
        RANK_EXPECT(s, bad == 0, "all_gather %s k=%lld in_place=%d: %lld wrong",
                    tp_dtype_name(all_dtypes[d]), (long long)c->k, c->in_place, (long long)bad);
        tp_tensor_release(x);
        tp_tensor_release(y);
    }
    return TP_OK;
}

static tp_status rs_body(tp_comm *w, void *arg)
{
    coll_ctx *c = arg;
    int r = tp_comm_rank(w), n = tp_comm_size(w);
    tp_test_slot *s = &c->slot[r];
    for (int d = 0; d < N_DTYPES; d++) {
        for (int op = 0; op < TP_REDUCE_OP_COUNT; op++) {
            tp_tensor *x = NULL, *y = NULL;
            RANK_OK(s, make(all_dtypes[d], c->k * n, &x));
            for (int64_t i = 0; i < c->k * n; i++)
                RANK_OK(s, tp_tensor_set(x, &i, input_value(op, r, i)));
            if (c->in_place)
                RANK_OK(s, tp_tensor_narrow(x, 0, r * c->k, c->k, &y));
            else
                RANK_OK(s, make(all_dtypes[d], c->k, &y));
            RANK_OK(s, tp_reduce_scatter(w, x, y, (tp_reduce_op)op, NULL));
            int64_t bad = 0;
            for (int64_t i = 0; i < c->k; i++) {
                double v = 0;
                tp_tensor_get(y, &i, &v);
                bad += v != expected_reduce(op, all_dtypes[d], n, r * c->k + i);
            }
            RANK_EXPECT(s, bad == 0, "reduce_scatter %s %s k=%lld in_place=%d: %lld wrong",
                        tp_dtype_name(all_dtypes[d]), tp_reduce_op_name(op), (long long)c->k,
                        c->in_place, (long long)bad);
            tp_tensor_release(x);
            tp_tensor_release(y);
        }
    }
    return TP_OK;
}

static double a2a_val(int from, int to, int64_t i) { return from * 1000 + to * 10 + (i % 7); }

static tp_status a2a_body(tp_comm *w, void *arg)
{
    coll_ctx *c = arg;
    int r = tp_comm_rank(w), n = tp_comm_size(w);
    tp_test_slot *s = &c->slot[r];
    for (int d = 0; d < N_DTYPES; d++) {
        if (all_dtypes[d] == TP_F16 || all_dtypes[d] == TP_BF16)
            continue; /* values above exceed their exact integer range */
        tp_tensor *x = NULL, *y = NULL;
        RANK_OK(s, make(all_dtypes[d], c->k * n, &x));
        RANK_OK(s, make(all_dtypes[d], c->k * n, &y));
        for (int q = 0; q < n; q++)
            for (int64_t i = 0; i < c->k; i++) {
                int64_t g = q * c->k + i;
                RANK_OK(s, tp_tensor_set(x, &g, a2a_val(r, q, i)));
            }
        RANK_OK(s, tp_all_to_all(w, x, y, NULL));
        int64_t bad = 0;
        for (int q = 0; q < n; q++)
            for (int64_t i = 0; i < c->k; i++) {
                int64_t g = q * c->k + i;
                double v = 0;
                tp_tensor_get(y, &g, &v);
                bad += v != a2a_val(q, r, i);
            }
        RANK_EXPECT(s, bad == 0, "all_to_all %s k=%lld: %lld wrong", tp_dtype_name(all_dtypes[d]),
                    (long long)c->k, (long long)bad);
        tp_tensor_release(x);
        tp_tensor_release(y);
    }
    return TP_OK;
}

static tp_status bc_body(tp_comm *w, void *arg)
{
    coll_ctx *c = arg;
    int r = tp_comm_rank(w), n = tp_comm_size(w);
    tp_test_slot *s = &c->slot[r];
    for (int root = 0; root < n; root++) {
        tp_tensor *x = NULL;
        RANK_OK(s, make(TP_I32, c->k, &x));
        for (int64_t i = 0; i < c->k; i++)
            RANK_OK(s, tp_tensor_set(x, &i, r == root ? gval(root, i) : -1));
        RANK_OK(s, tp_broadcast(w, x, root, NULL));
        int64_t bad = 0;
        for (int64_t i = 0; i < c->k; i++) {
            double v = 0;
            tp_tensor_get(x, &i, &v);
            bad += v != gval(root, i);
        }
        RANK_EXPECT(s, bad == 0, "broadcast root %d k=%lld: %lld wrong", root, (long long)c->k,
                    (long long)bad);
        tp_tensor_release(x);
        RANK_OK(s, tp_barrier(w, NULL));
    }
    return TP_OK;
}

/* at most 82: exact in every dtype */
static double sc_val(int root, int64_t g) { return (double)((root * 11 + g) % 83); }

/* Every root, every dtype; blocking, async wait and async test. Root's send
 * holds block j for rank j; non-root ranks pass no send (NULL), in place root
 * receives into its own block. */
static tp_status sc_body(tp_comm *w, void *arg)
{
    coll_ctx *c = arg;
    int r = tp_comm_rank(w), n = tp_comm_size(w);
    tp_test_slot *s = &c->slot[r];
    for (int d = 0; d < N_DTYPES; d++) {
        tp_dtype dt = all_dtypes[d];
        for (int root = 0; root < n; root++) {
            for (int mode = 0; mode < 3; mode++) {
                tp_tensor *x = NULL, *y = NULL;
                if (r == root) {
                    RANK_OK(s, make(dt, c->k * n, &x));
                    for (int64_t g = 0; g < c->k * n; g++)
                        RANK_OK(s, tp_tensor_set(x, &g, sc_val(root, g)));
                }
                if (c->in_place && r == root) {
                    RANK_OK(s, tp_tensor_narrow(x, 0, r * c->k, c->k, &y));
                } else {
                    RANK_OK(s, make(dt, c->k, &y));
                    RANK_OK(s, tp_tensor_fill(y, -1));
                }
                tp_work *wk = NULL;
                RANK_OK(s, tp_scatter(w, x, y, root, mode ? &wk : NULL));
                RANK_EXPECT(s, (mode != 0) == (wk != NULL), "scatter mode %d: work handle %p",
                            mode, (void *)wk);
                if (mode == 1) {
                    RANK_OK(s, tp_work_wait(wk));
                } else if (mode == 2) {
                    bool done = false;
                    /* yield between polls: 8 ranks share 2 cores here, and the
                     * root may still be filling its buffer */
                    for (long spin = 0; !done && spin < 100000000; spin++) {
                        RANK_OK(s, tp_work_test(wk, &done));
                        if (!done)
                            sched_yield();
                    }
                    RANK_EXPECT(s, done, "scatter: tp_work_test never reported completion");
                }
                tp_work_free(wk);
                int64_t bad = 0;
                for (int64_t i = 0; i < c->k; i++) {
                    double v = 0;
                    tp_tensor_get(y, &i, &v);
                    bad += v != sc_val(root, r * c->k + i);
                }
                RANK_EXPECT(s, bad == 0, "scatter %s k=%lld root %d mode %d in_place=%d: %lld "
                            "wrong", tp_dtype_name(dt), (long long)c->k, root, mode, c->in_place,
                            (long long)bad);
                for (int64_t g = 0; r == root && g < c->k * n; g++) {
                    double v = 0;
                    tp_tensor_get(x, &g, &v);
                    bad += v != sc_val(root, g);
                }
                RANK_EXPECT(s, bad == 0, "scatter %s root %d: the send buffer changed",
                            tp_dtype_name(dt), root);
                tp_tensor_release(x);
                tp_tensor_release(y);
            }
        }
    }
    return TP_OK;
}

TP_TEST_WORLD_SIZE_PARAMS(comm, gather_scatter_bcast)

ParameterizedTest(int *n, comm, gather_scatter_bcast, .timeout = 120)
{
    static const int64_t ks[] = {1, 5, 64, 1001};
    tp_rank_fn bodies[] = {ag_body, rs_body, a2a_body, bc_body, sc_body};
    const char *names[] = {"all_gather", "reduce_scatter", "all_to_all", "broadcast", "scatter"};
    for (int b = 0; b < 5; b++)
        for (size_t k = 0; k < sizeof ks / sizeof ks[0]; k++)
            for (int ip = 0; ip < 2; ip++) {
                coll_ctx c = {.k = ks[k], .in_place = ip};
                tp_status st = tp_run_local(*n, bodies[b], &c);
                tp_test_assert_slots(c.slot, *n);
                cr_assert_eq(st, TP_OK, "%s: %s", names[b], tp_last_error());
            }
}

/* ---- large buffers (streaming stores, uneven parts) ----------------------- */

typedef struct {
    tp_test_slot slot[TP_TEST_MAX_RANKS];
} big_ctx;

static tp_status big_body(tp_comm *w, void *arg)
{
    big_ctx *c = arg;
    int r = tp_comm_rank(w), n = tp_comm_size(w);
    tp_test_slot *s = &c->slot[r];
    int64_t count = (int64_t)3 << 20 | 5; /* 12 MiB of f32, not a multiple of n */
    tp_tensor *x = NULL, *g = NULL;
    RANK_OK(s, make(TP_F32, count, &x));
    float *p = tp_tensor_data(x);
    for (int64_t i = 0; i < count; i++)
        p[i] = (float)(r + 1 + i % 13);
    RANK_OK(s, tp_all_reduce(w, x, x, TP_SUM, NULL));
    int64_t bad = 0;
    for (int64_t i = 0; i < count; i++)
        bad += p[i] != (float)(n * (n + 1) / 2 + n * (i % 13));
    RANK_EXPECT(s, bad == 0, "large all_reduce: %lld wrong", (long long)bad);
    RANK_OK(s, make(TP_F32, count * n, &g));
    RANK_OK(s, tp_all_gather(w, x, g, NULL));
    const float *pg = tp_tensor_data(g);
    bad = 0;
    for (int64_t i = 0; i < count * n; i++)
        bad += pg[i] != p[i % count];
    RANK_EXPECT(s, bad == 0, "large all_gather: %lld wrong", (long long)bad);
    /* scatter the gathered blocks back from the last rank, into a fresh x */
    tp_tensor *y = NULL;
    RANK_OK(s, make(TP_F32, count, &y));
    RANK_OK(s, tp_scatter(w, r == n - 1 ? g : NULL, y, n - 1, NULL));
    const float *py = tp_tensor_data(y);
    bad = 0;
    for (int64_t i = 0; i < count; i++)
        bad += py[i] != p[i];
    RANK_EXPECT(s, bad == 0, "large scatter: %lld wrong", (long long)bad);
    tp_tensor_release(y);
    tp_tensor_release(x);
    tp_tensor_release(g);
    return TP_OK;
}

Test(comm, large_buffers, .timeout = 120)
{
    for (int n = 2; n <= 3; n++) {
        big_ctx c = {0};
        tp_status st = tp_run_local(n, big_body, &c);
        tp_test_assert_slots(c.slot, n);
        cr_assert_eq(st, TP_OK, "%s", tp_last_error());
    }
}

/* ---- async work ----------------------------------------------------------- */

typedef struct {
    tp_test_slot slot[TP_TEST_MAX_RANKS];
} async_ctx;

static tp_status async_body(tp_comm *w, void *arg)
{
    async_ctx *c = arg;
    int r = tp_comm_rank(w), n = tp_comm_size(w);
    tp_test_slot *s = &c->slot[r];
    enum { K = 6 };
    tp_tensor *t[K] = {0};
    tp_work *wk[K] = {0};
    for (int j = 0; j < K; j++) {
        RANK_OK(s, make(TP_F32, 100 + j, &t[j]));
        RANK_OK(s, tp_tensor_fill(t[j], r + j));
        RANK_OK(s, tp_all_reduce(w, t[j], t[j], TP_SUM, &wk[j]));
        RANK_EXPECT(s, wk[j] != NULL, "async all_reduce gave no work handle");
    }
    /* wait in reverse order: completion is in issue order underneath */
    for (int j = K - 1; j >= 0; j--) {
        if (j % 2) {
            RANK_OK(s, tp_work_wait(wk[j]));
            RANK_OK(s, tp_work_wait(wk[j])); /* waiting again is fine */
        } else {
            bool done = false;
            for (int spin = 0; !done && spin < 10000000; spin++)
                RANK_OK(s, tp_work_test(wk[j], &done));
            RANK_EXPECT(s, done, "tp_work_test never reported completion");
        }
        double v = 0;
        int64_t i0 = 0;
        tp_tensor_get(t[j], &i0, &v);
        RANK_EXPECT(s, v == n * (n - 1) / 2 + n * j, "async all_reduce %d gave %g", j, v);
        tp_work_free(wk[j]);
        tp_tensor_release(t[j]);
    }
    /* freeing without waiting waits first */
    tp_tensor *x = NULL;
    tp_work *wx = NULL;
    RANK_OK(s, make(TP_I64, 33, &x));
    RANK_OK(s, tp_tensor_fill(x, 1));
    RANK_OK(s, tp_all_reduce(w, x, x, TP_SUM, &wx));
    tp_work_free(wx);
    double v = 0;
    int64_t i = 32;
    tp_tensor_get(x, &i, &v);
    RANK_EXPECT(s, v == n, "work freed before wait: got %g", v);
    tp_tensor_release(x);
    /* many collectives: wraps the descriptor ring several times */
    RANK_OK(s, make(TP_I32, 3, &x));
    for (int j = 0; j < 400; j++) {
        RANK_OK(s, tp_tensor_fill(x, 1));
        RANK_OK(s, tp_all_reduce(w, x, x, TP_SUM, NULL));
    }
    i = 2;
    tp_tensor_get(x, &i, &v);
    RANK_EXPECT(s, v == n, "400th all_reduce gave %g", v);
    tp_tensor_release(x);
    return TP_OK;
}

TP_TEST_WORLD_SIZE_PARAMS(comm, async_work)

ParameterizedTest(int *n, comm, async_work, .timeout = 120)
{
    async_ctx c = {0};
    tp_test_run(*n, async_body, &c, c.slot);
}

/* ---- split ------------------------------------------------------------------ */

typedef struct {
    tp_test_slot slot[TP_TEST_MAX_RANKS];
} split_ctx;

static tp_status split_body(tp_comm *w, void *arg)
{
    split_ctx *c = arg;
    int r = tp_comm_rank(w), n = tp_comm_size(w);
    tp_test_slot *s = &c->slot[r];
    /* colors by parity; keys reverse the order; rank 2 opts out */
    int color = (r == 2) ? TP_COMM_NO_COLOR : r % 2;
    tp_comm *sub = NULL;
    RANK_OK(s, tp_comm_split(w, color, n - r, &sub));
    if (color < 0) {
        RANK_EXPECT(s, sub == NULL, "color < 0 must give no communicator");
        RANK_OK(s, tp_barrier(w, NULL));
        return TP_OK;
    }
    int members[TP_TEST_MAX_RANKS], m = 0;
    for (int q = n - 1; q >= 0; q--) /* descending world rank = ascending key */
        if (q != 2 && q % 2 == color)
            members[m++] = q;
    int me = -1;
    for (int i = 0; i < m; i++)
        if (members[i] == r)
            me = i;
    RANK_EXPECT(s, sub && tp_comm_size(sub) == m && tp_comm_rank(sub) == me,
                "split: size %d rank %d, expected %d %d", tp_comm_size(sub), tp_comm_rank(sub),
                m, me);
    RANK_EXPECT(s, tp_comm_timeout(sub) == tp_comm_timeout(w), "split did not inherit timeout");
    /* all_gather of world ranks follows the new order */
    int64_t one = 1, mm = m;
    tp_tensor *x = NULL, *y = NULL;
    RANK_OK(s, tp_tensor_zeros(TP_I32, TP_CPU, 1, &one, &x));
    RANK_OK(s, tp_tensor_zeros(TP_I32, TP_CPU, 1, &mm, &y));
    RANK_OK(s, tp_tensor_fill(x, r));
    RANK_OK(s, tp_all_gather(sub, x, y, NULL));
    for (int64_t i = 0; i < m; i++) {
        double v = 0;
        tp_tensor_get(y, &i, &v);
        RANK_EXPECT(s, v == members[i], "split all_gather[%lld] = %g, expected %d",
                    (long long)i, v, members[i]);
    }
    /* split again: everyone in one group, same order */
    tp_comm *sub2 = NULL;
    RANK_OK(s, tp_comm_split(sub, 7, 0, &sub2));
    RANK_EXPECT(s, tp_comm_rank(sub2) == tp_comm_rank(sub), "nested split reordered ranks");
    RANK_OK(s, tp_all_reduce(sub2, x, x, TP_MAX, NULL));
    double v = 0;
    int64_t i0 = 0;
    tp_tensor_get(x, &i0, &v);
    RANK_EXPECT(s, v == members[0], "nested split all_reduce max = %g", v);
    /* the world still works while sub-communicators exist */
    RANK_OK(s, tp_barrier(w, NULL));
    tp_comm_free(sub2);
    tp_comm_free(sub);
    tp_tensor_release(x);
    tp_tensor_release(y);
    return TP_OK;
}

TP_TEST_WORLD_SIZE_PARAMS(comm, split)

ParameterizedTest(int *n, comm, split, .timeout = 60)
{
    split_ctx c = {0};
    tp_test_run(*n, split_body, &c, c.slot);
}

/* ---- properties ----------------------------------------------------------- */

static tp_status props_body(tp_comm *w, void *arg)
{
    tp_test_slot *s = &((split_ctx *)arg)->slot[tp_comm_rank(w)];
    RANK_EXPECT(s, strcmp(tp_comm_backend(w), "shm") == 0, "backend is %s", tp_comm_backend(w));
    RANK_EXPECT(s, tp_comm_timeout(w) > 0, "no default timeout");
    RANK_OK(s, tp_comm_set_timeout(w, 12.5));
    RANK_EXPECT(s, tp_comm_timeout(w) == 12.5, "timeout not set");
    RANK_EXPECT(s, !tp_comm_is_aborted(w), "fresh comm reports aborted");
    tp_comm_free(w); /* the run's world: must be a no-op */
    RANK_OK(s, tp_barrier(w, NULL));
    return TP_OK;
}

Test(comm, properties, .timeout = 30)
{
    split_ctx c = {0};
    cr_assert_str_eq(tp_coll_kind_name(TP_COLL_REDUCE_SCATTER), "reduce_scatter");
    cr_assert_str_eq(tp_coll_kind_name(TP_COLL_SCATTER), "scatter");
    /* appended: the earlier kinds keep their values */
    cr_assert_eq(TP_COLL_BARRIER, 5);
    cr_assert_eq(TP_COLL_SCATTER, 6);
    cr_assert_str_eq(tp_coll_kind_name(TP_COLL_KIND_COUNT), "invalid");
    cr_assert_str_eq(tp_coll_kind_name((tp_coll_kind)99), "invalid");
    cr_assert_str_eq(tp_reduce_op_name(TP_PRODUCT), "product");
    tp_status st = tp_run_local(3, props_body, &c);
    tp_test_assert_slots(c.slot, 3);
    cr_assert_eq(st, TP_OK, "%s", tp_last_error());
}
