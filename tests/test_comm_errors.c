/* Every error path of the collectives layer: bad arguments, a failing rank,
 * an explicit abort, a timeout, a rank that never joins, mismatched calls,
 * allocation failures. Nothing may hang: the Criterion timeouts are the
 * backstop, every wait in the library has its own. */
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>

#include "tp_test.h"

typedef struct {
    tp_test_slot slot[TP_TEST_MAX_RANKS];
    tp_status got[TP_TEST_MAX_RANKS];
    char msg[TP_TEST_MAX_RANKS][512];
    bool scatter; /* abort and timeout: a scatter from rank 0 instead of an all_reduce */
} err_ctx;

static void record(err_ctx *c, int r, tp_status st)
{
    c->got[r] = st;
    snprintf(c->msg[r], sizeof c->msg[r], "%s", tp_last_error());
}

/* The collective of the abort and timeout tests: an all_reduce of x, or a
 * scatter from rank 0 into x. */
static tp_status one_collective(tp_comm *w, tp_tensor *x, bool scatter)
{
    if (!scatter)
        return tp_all_reduce(w, x, x, TP_SUM, NULL);
    int64_t kn = tp_tensor_numel(x) * tp_comm_size(w);
    tp_tensor *send = NULL;
    tp_status st = tp_comm_rank(w) == 0 ? tp_tensor_zeros(TP_F32, TP_CPU, 1, &kn, &send) : TP_OK;
    if (st == TP_OK)
        st = tp_scatter(w, send, x, 0, NULL);
    tp_tensor_release(send);
    return st;
}

static void sleep_s(double s)
{
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    nanosleep(&ts, NULL);
}

/* ---- argument validation -------------------------------------------------- */

static tp_status args_body(tp_comm *w, void *arg)
{
    err_ctx *c = arg;
    int r = tp_comm_rank(w);
    tp_test_slot *s = &c->slot[r];
    int64_t four = 4, eight = 8, three = 3, sh2[2] = {4, 4};
    tp_tensor *a = NULL, *b = NULL, *d = NULL, *i32 = NULL, *m = NULL, *nc = NULL, *odd = NULL;
    RANK_OK(s, tp_tensor_zeros(TP_F32, TP_CPU, 1, &four, &a));
    RANK_OK(s, tp_tensor_zeros(TP_F32, TP_CPU, 1, &eight, &b));
    RANK_OK(s, tp_tensor_zeros(TP_F32, TP_CPU, 1, &four, &d));
    RANK_OK(s, tp_tensor_zeros(TP_I32, TP_CPU, 1, &four, &i32));
    RANK_OK(s, tp_tensor_zeros(TP_F32, TP_CPU, 2, sh2, &m));
    RANK_OK(s, tp_tensor_zeros(TP_F32, TP_CPU, 1, &three, &odd));
    RANK_OK(s, tp_tensor_narrow(m, 1, 0, 2, &nc)); /* 4x2 view of 4x4: not contiguous */
    tp_work *wk = (tp_work *)&four;                 /* must be reset to NULL on failure */

#define EXPECT_ERR(call, code, needle)                                                         \
    do {                                                                                       \
        tp_status st_ = (call);                                                                \
        RANK_EXPECT(s, st_ == (code), "%s returned %s, expected %s (%s)", #call,               \
                    tp_status_name(st_), tp_status_name(code), tp_last_error());               \
        RANK_EXPECT(s, strstr(tp_last_error(), needle) != NULL,                                \
                    "%s: message '%s' lacks '%s'", #call, tp_last_error(), needle);            \
    } while (0)

    EXPECT_ERR(tp_all_reduce(NULL, a, d, TP_SUM, NULL), TP_ERR_INVALID_ARG, "comm is NULL");
    EXPECT_ERR(tp_all_reduce(w, NULL, d, TP_SUM, &wk), TP_ERR_INVALID_ARG, "send is NULL");
    RANK_EXPECT(s, wk == NULL, "work not reset to NULL on failure");
    EXPECT_ERR(tp_all_reduce(w, a, NULL, TP_SUM, NULL), TP_ERR_INVALID_ARG, "recv is NULL");
    EXPECT_ERR(tp_all_reduce(w, a, b, TP_SUM, NULL), TP_ERR_INVALID_ARG,
               "send has 4 elements but recv has 8");
    EXPECT_ERR(tp_all_reduce(w, a, i32, TP_SUM, NULL), TP_ERR_INVALID_ARG,
               "send is f32 but recv is i32");
    EXPECT_ERR(tp_all_reduce(w, a, d, (tp_reduce_op)42, NULL), TP_ERR_INVALID_ARG,
               "invalid reduce op");
    EXPECT_ERR(tp_all_reduce(w, nc, nc, TP_SUM, NULL), TP_ERR_INVALID_ARG, "not contiguous");
    EXPECT_ERR(tp_all_gather(w, a, a, NULL), tp_comm_size(w) == 1 ? TP_OK : TP_ERR_INVALID_ARG,
               tp_comm_size(w) == 1 ? "" : "recv has 4 elements, expected");
    EXPECT_ERR(tp_reduce_scatter(w, a, b, TP_SUM, NULL), TP_ERR_INVALID_ARG,
               "send has 4 elements, expected");
    EXPECT_ERR(tp_broadcast(w, a, tp_comm_size(w), NULL), TP_ERR_INVALID_ARG,
               "root");
    EXPECT_ERR(tp_broadcast(w, a, -1, NULL), TP_ERR_INVALID_ARG, "out of range");
    /* scatter: the root is checked on every rank, send on root only; with
     * root = this rank every rank is root in its own view, so every rank
     * fails alike */
    EXPECT_ERR(tp_scatter(w, b, a, tp_comm_size(w), &wk), TP_ERR_INVALID_ARG,
               "root");
    RANK_EXPECT(s, wk == NULL, "scatter: work not reset to NULL on failure");
    EXPECT_ERR(tp_scatter(w, b, a, -1, NULL), TP_ERR_INVALID_ARG, "out of range");
    EXPECT_ERR(tp_scatter(w, b, NULL, 0, NULL), TP_ERR_INVALID_ARG, "recv is NULL");
    EXPECT_ERR(tp_scatter(w, NULL, a, r, NULL), TP_ERR_INVALID_ARG, "send is NULL on root");
    EXPECT_ERR(tp_scatter(w, nc, a, r, NULL), TP_ERR_INVALID_ARG, "not contiguous");
    if (tp_comm_size(w) > 1) {
        char want[96];
        snprintf(want, sizeof want, "send has 4 elements, expected %d (recv 4 x %d ranks)",
                 4 * tp_comm_size(w), tp_comm_size(w));
        EXPECT_ERR(tp_scatter(w, a, d, r, NULL), TP_ERR_INVALID_ARG, want);
    }
    if (tp_comm_size(w) == 2) {
        EXPECT_ERR(tp_scatter(w, b, i32, r, NULL), TP_ERR_INVALID_ARG,
                   "send is f32 but recv is i32");
        /* recv inside send but not at root's block */
        tp_tensor *shifted = NULL;
        RANK_OK(s, tp_tensor_narrow(b, 0, 1, 4, &shifted));
        EXPECT_ERR(tp_scatter(w, b, shifted, r, NULL), TP_ERR_INVALID_ARG, "overlap");
        tp_tensor_release(shifted);
    }
    if (tp_comm_size(w) == 2) {
        EXPECT_ERR(tp_all_to_all(w, odd, odd, NULL), TP_ERR_INVALID_ARG,
                   "do not split into 2 equal blocks");
        /* recv overlapping send other than in the documented in-place form */
        tp_tensor *half = NULL, *shifted = NULL;
        RANK_OK(s, tp_tensor_narrow(b, 0, 0, 4, &half));
        RANK_OK(s, tp_tensor_narrow(b, 0, 1, 4, &shifted));
        EXPECT_ERR(tp_all_reduce(w, half, shifted, TP_SUM, NULL), TP_ERR_INVALID_ARG, "overlap");
        EXPECT_ERR(tp_all_to_all(w, b, b, NULL), TP_ERR_INVALID_ARG, "overlap");
        tp_tensor_release(half);
        tp_tensor_release(shifted);
    }
    tp_comm *out = (tp_comm *)&four;
    EXPECT_ERR(tp_comm_split(NULL, 0, 0, &out), TP_ERR_INVALID_ARG, "comm is NULL");
    RANK_EXPECT(s, out == NULL, "split out not reset");
    EXPECT_ERR(tp_comm_set_timeout(w, 0), TP_ERR_INVALID_ARG, "positive");
    EXPECT_ERR(tp_comm_set_timeout(w, -1), TP_ERR_INVALID_ARG, "positive");
    EXPECT_ERR(tp_work_wait(NULL), TP_ERR_INVALID_ARG, "work is NULL");
    bool done = true;
    EXPECT_ERR(tp_work_test(NULL, &done), TP_ERR_INVALID_ARG, "work is NULL");
    tp_work_free(NULL);
    /* failed validation issued nothing: the ranks are still in step */
    RANK_OK(s, tp_all_reduce(w, a, d, TP_SUM, NULL));
    tp_tensor_release(a);
    tp_tensor_release(b);
    tp_tensor_release(d);
    tp_tensor_release(i32);
    tp_tensor_release(m);
    tp_tensor_release(nc);
    tp_tensor_release(odd);
    return TP_OK;
}

Test(comm_errors, bad_arguments, .timeout = 60)
{
    for (int n = 1; n <= 4; n++) {
        err_ctx c = {0};
        tp_status st = tp_run_local(n, args_body, &c);
        tp_test_assert_slots(c.slot, n);
        cr_assert_eq(st, TP_OK, "%s", tp_last_error());
    }
}

Test(comm_errors, run_local_arguments, .timeout = 10)
{
    cr_assert_eq(tp_run_local(0, args_body, NULL), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "rank count") != NULL, "%s", tp_last_error());
    cr_assert_eq(tp_run_local(2, NULL, NULL), TP_ERR_INVALID_ARG);
    tp_run_options o = {.timeout_s = -1};
    cr_assert_eq(tp_run_local_opts(2, args_body, NULL, &o), TP_ERR_INVALID_ARG);
    tp_comm_free(NULL);
    tp_comm_abort(NULL, "nothing");
    cr_assert_eq(tp_comm_rank(NULL), -1);
    cr_assert_eq(tp_comm_size(NULL), -1);
}

/* ---- a failing rank ----------------------------------------------------------- */

/* A genuine library failure: TP_ERR_INVALID_ARG with a known message. */
static tp_status fail_like_a_user(void)
{
    tp_tensor *t = NULL;
    return tp_tensor_empty(TP_F32, TP_CPU, 9, NULL, &t);
}

static tp_status failing_body(tp_comm *w, void *arg)
{
    err_ctx *c = arg;
    int r = tp_comm_rank(w);
    if (r == 1)
        return fail_like_a_user();
    int64_t n = 16;
    tp_tensor *x = NULL;
    tp_status st = tp_tensor_zeros(TP_F32, TP_CPU, 1, &n, &x);
    for (int i = 0; st == TP_OK && i < 3; i++)
        st = tp_all_reduce(w, x, x, TP_SUM, NULL);
    record(c, r, st);
    tp_tensor_release(x);
    return st;
}

Test(comm_errors, failing_rank_aborts_the_run, .timeout = 30)
{
    for (int n = 2; n <= 8; n *= 2) {
        err_ctx c = {0};
        tp_status ranks[8];
        tp_run_options o = {.rank_status = ranks};
        tp_status st = tp_run_local_opts(n, failing_body, &c, &o);
        cr_assert_eq(st, TP_ERR_INVALID_ARG, "run returned %s", tp_status_name(st));
        cr_assert(strncmp(tp_last_error(), "rank 1: ", 8) == 0, "%s", tp_last_error());
        cr_assert_eq(ranks[1], TP_ERR_INVALID_ARG);
        for (int r = 0; r < n; r++) {
            if (r == 1)
                continue;
            cr_assert_eq(c.got[r], TP_ERR_ABORTED, "rank %d got %s", r, tp_status_name(c.got[r]));
            cr_assert_eq(ranks[r], TP_ERR_ABORTED);
            cr_assert(strstr(c.msg[r], "rank 1 failed with TP_ERR_INVALID_ARG") != NULL, "%s",
                      c.msg[r]);
        }
    }
}

/* ---- explicit abort ------------------------------------------------------------ */

static tp_status abort_body(tp_comm *w, void *arg)
{
    err_ctx *c = arg;
    int r = tp_comm_rank(w);
    int64_t n = 8;
    tp_tensor *x = NULL;
    tp_status st = tp_tensor_zeros(TP_F32, TP_CPU, 1, &n, &x);
    if (st == TP_OK)
        st = one_collective(w, x, c->scatter); /* one good collective first */
    if (st == TP_OK && r == 0) {
        tp_comm_abort(w, "giving up on purpose");
        RANK_EXPECT(&c->slot[r], tp_comm_is_aborted(w), "abort not visible to the aborter");
    }
    if (st == TP_OK)
        st = one_collective(w, x, c->scatter);
    record(c, r, st);
    tp_tensor_release(x);
    return TP_OK; /* the test reads c->got */
}

Test(comm_errors, abort, .timeout = 30)
{
    for (int n = 2; n <= 4; n++) {
        for (int sc = 0; sc < 2; sc++) {
            err_ctx c = {.scatter = sc};
            tp_status st = tp_run_local(n, abort_body, &c);
            tp_test_assert_slots(c.slot, n);
            cr_assert_eq(st, TP_OK, "%s", tp_last_error());
            for (int r = 0; r < n; r++) {
                cr_assert_eq(c.got[r], TP_ERR_ABORTED, "%s n=%d rank %d: %s",
                             sc ? "scatter" : "all_reduce", n, r, tp_status_name(c.got[r]));
                cr_assert(strstr(c.msg[r], "giving up on purpose") != NULL, "%s", c.msg[r]);
            }
        }
    }
}

/* ---- timeout --------------------------------------------------------------------- */

static tp_status timeout_body(tp_comm *w, void *arg)
{
    err_ctx *c = arg;
    int r = tp_comm_rank(w);
    int64_t n = 8;
    tp_tensor *x = NULL;
    tp_status st = tp_tensor_zeros(TP_F32, TP_CPU, 1, &n, &x);
    if (r == 0)
        tp_comm_set_timeout(w, 0.2);
    else
        sleep_s(1.0); /* late: rank 0 gives up first */
    double t0 = 0;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    t0 = (double)ts.tv_sec + ts.tv_nsec * 1e-9;
    if (st == TP_OK)
        st = one_collective(w, x, c->scatter);
    clock_gettime(CLOCK_MONOTONIC, &ts);
    double waited = (double)ts.tv_sec + ts.tv_nsec * 1e-9 - t0;
    if (r == 0)
        RANK_EXPECT(&c->slot[r], waited < 0.9, "rank 0 waited %.2f s with a 0.2 s timeout", waited);
    record(c, r, st);
    tp_tensor_release(x);
    return TP_OK;
}

Test(comm_errors, timeout, .timeout = 30)
{
    for (int sc = 0; sc < 2; sc++) {
        err_ctx c = {.scatter = sc};
        tp_status st = tp_run_local(3, timeout_body, &c);
        tp_test_assert_slots(c.slot, 3);
        cr_assert_eq(st, TP_OK, "%s", tp_last_error());
        cr_assert_eq(c.got[0], TP_ERR_TIMEOUT, "%s", tp_status_name(c.got[0]));
        cr_assert(strstr(c.msg[0], "timed out after 0.2 s") != NULL, "%s", c.msg[0]);
        for (int r = 1; r < 3; r++) {
            cr_assert_eq(c.got[r], TP_ERR_ABORTED, "%s rank %d: %s",
                         sc ? "scatter" : "all_reduce", r, tp_status_name(c.got[r]));
            cr_assert(strstr(c.msg[r], "timed out") != NULL, "%s", c.msg[r]);
        }
    }
}

/* ---- a split waits no longer than its communicator's timeout ---------------------- */

typedef struct {
    tp_test_slot slot[TP_TEST_MAX_RANKS];
    atomic_int released;
} split_late_ctx;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Rank 0 splits with a 0.2 s timeout; the others stay alive (a rank that
 * returned would be noticed as gone) but join nothing until it gave up. The
 * split must give up after 0.2 s, not after the default timeout (60 s under
 * meson), and leave the communicator aborted, as a collective would. */
static tp_status split_late_body(tp_comm *w, void *arg)
{
    split_late_ctx *c = arg;
    int r = tp_comm_rank(w);
    tp_test_slot *s = &c->slot[r];
    if (r != 0) {
        for (int i = 0; i < 10000 && !atomic_load(&c->released); i++)
            sleep_s(0.002);
        RANK_EXPECT(s, atomic_load(&c->released), "rank 0's split did not return in 20 s");
        return TP_OK;
    }
    RANK_OK(s, tp_comm_set_timeout(w, 0.2));
    tp_comm *sub = w; /* must be reset to NULL */
    double t0 = now_s();
    tp_status st = tp_comm_split(w, 0, 0, &sub);
    double waited = now_s() - t0;
    atomic_store(&c->released, 1);
    RANK_EXPECT(s, st == TP_ERR_TIMEOUT, "split -> %s (%s), expected TP_ERR_TIMEOUT",
                tp_status_name(st), tp_last_error());
    RANK_EXPECT(s, strncmp(tp_last_error(), "tp_comm_split: ", 15) == 0 &&
                       strstr(tp_last_error(), "timed out after 0.2 s"),
                "split message: %s", tp_last_error());
    RANK_EXPECT(s, waited < 5, "split waited %.2f s with a 0.2 s timeout", waited);
    RANK_EXPECT(s, sub == NULL, "split out not reset");
    RANK_EXPECT(s, tp_comm_is_aborted(w), "communicator not aborted after the split timed out");
    st = tp_barrier(w, NULL);
    RANK_EXPECT(s, st == TP_ERR_ABORTED, "barrier after the split's timeout -> %s",
                tp_status_name(st));
    return TP_OK;
}

Test(comm_errors, split_honours_the_timeout, .timeout = 30)
{
    static const int sizes[] = {2, 3, 8};
    for (int i = 0; i < 3; i++) {
        split_late_ctx c = {0};
        tp_status st = tp_run_local(sizes[i], split_late_body, &c);
        tp_test_assert_slots(c.slot, sizes[i]);
        cr_assert_eq(st, TP_OK, "%d ranks: %s", sizes[i], tp_last_error());
    }
}

/* ---- a rank that returns without joining ------------------------------------------ */

static tp_status deserter_body(tp_comm *w, void *arg)
{
    err_ctx *c = arg;
    int r = tp_comm_rank(w);
    if (r == tp_comm_size(w) - 1)
        return TP_OK; /* skips the collective the others make */
    int64_t n = 8;
    tp_tensor *x = NULL;
    tp_status st = tp_tensor_zeros(TP_F32, TP_CPU, 1, &n, &x);
    if (st == TP_OK)
        st = tp_barrier(w, NULL);
    record(c, r, st);
    tp_tensor_release(x);
    return TP_OK;
}

Test(comm_errors, rank_returns_without_joining, .timeout = 30)
{
    err_ctx c = {0};
    tp_status st = tp_run_local(3, deserter_body, &c);
    cr_assert_eq(st, TP_OK, "%s", tp_last_error());
    for (int r = 0; r < 2; r++) {
        cr_assert_eq(c.got[r], TP_ERR_ABORTED, "rank %d: %s", r, tp_status_name(c.got[r]));
        cr_assert(strstr(c.msg[r], "rank 2 returned without joining collective #1") != NULL,
                  "%s", c.msg[r]);
    }
}

/* ---- the first failure by time ------------------------------------------------------ */

/* The last rank stays alive but skips the barrier (a rank that returned would
 * be noticed as gone), until every other rank gave up; the others wait on it.
 * `same`: every waiter has the 0.05 s timeout, so whichever times out first
 * aborts the group for the rest. Otherwise only rank 0 has it and the others
 * learn of the failure only through the abort. */
typedef struct {
    bool same;
    atomic_int gave_up;
} first_ctx;

static tp_status first_failure_body(tp_comm *w, void *arg)
{
    first_ctx *c = arg;
    int r = tp_comm_rank(w), n = tp_comm_size(w);
    if (r == n - 1) {
        for (int i = 0; i < 4000 && atomic_load(&c->gave_up) < n - 1; i++)
            sleep_s(0.002);
        return TP_OK;
    }
    tp_status st = tp_comm_set_timeout(w, c->same || r == 0 ? 0.05 : 60);
    if (st == TP_OK)
        st = tp_barrier(w, NULL);
    atomic_fetch_add(&c->gave_up, 1);
    return st;
}

/* tp_run_local returns the failure that happened first (comm.h), not the
 * one whose rank function returned first: the timeout, never the abort it
 * caused on the peers, however the threads are scheduled. The race shows in
 * a few of every ten runs, so many runs make a wrong order certain to show. */
Test(comm_errors, run_reports_the_first_failure, .timeout = 120)
{
    static const int sizes[] = {3, 4, 8};
    for (int si = 0; si < 3; si++) {
        int n = sizes[si];
        for (int run = 0; run < 24; run++) {
            first_ctx c = {.same = run % 4 == 3};
            tp_status ranks[8];
            tp_run_options o = {.rank_status = ranks};
            tp_status st = tp_run_local_opts(n, first_failure_body, &c, &o);
            cr_assert_eq(st, TP_ERR_TIMEOUT, "%d ranks, run %d%s: %s (%s)", n, run,
                         c.same ? " (one timeout)" : "", tp_status_name(st), tp_last_error());
            cr_assert(strstr(tp_last_error(), "timed out after 0.05 s waiting for collective #1"),
                      "%d ranks, run %d: %s", n, run, tp_last_error());
            cr_assert_eq(ranks[n - 1], TP_OK);
            if (c.same)
                continue;
            cr_assert(strncmp(tp_last_error(), "rank 0: ", 8) == 0 &&
                          strstr(tp_last_error(), "rank 0 (world rank 0) timed out"),
                      "%d ranks, run %d: %s", n, run, tp_last_error());
            cr_assert_eq(ranks[0], TP_ERR_TIMEOUT);
            for (int r = 1; r < n - 1; r++)
                cr_assert_eq(ranks[r], TP_ERR_ABORTED, "%d ranks, run %d, rank %d: %s", n, run,
                             r, tp_status_name(ranks[r]));
        }
    }
}

/* Rank 0 aborts the world with an async barrier pending, waits until every
 * peer has seen the abort (and failed with TP_ERR_ABORTED), then frees the
 * pending work, which sees the abort too, and fails with an error of its own.
 * Its first failure is the abort it issued, before any peer's: so the run
 * reports rank 0's TP_ERR_INVALID_ARG, not a peer's TP_ERR_ABORTED, although
 * rank 0 also saw the abort after the peers did. */
typedef struct {
    tp_test_slot slot[TP_TEST_MAX_RANKS];
    atomic_int aborted; /* rank 0 aborted the world */
    atomic_int seen;    /* peers that failed on the abort */
} abort_first_ctx;

static tp_status abort_first_body(tp_comm *w, void *arg)
{
    abort_first_ctx *c = arg;
    int r = tp_comm_rank(w), n = tp_comm_size(w);
    tp_test_slot *s = &c->slot[r];
    if (r != 0) {
        for (int i = 0; i < 10000 && !atomic_load(&c->aborted); i++)
            sleep_s(0.001);
        tp_status st = tp_barrier(w, NULL);
        RANK_EXPECT(s, st == TP_ERR_ABORTED, "barrier after the abort -> %s",
                    tp_status_name(st));
        atomic_fetch_add(&c->seen, 1);
        return st;
    }
    tp_work *wk = NULL;
    RANK_OK(s, tp_barrier(w, &wk)); /* pending: the peers never join */
    tp_comm_abort(w, "giving up on purpose");
    atomic_store(&c->aborted, 1);
    for (int i = 0; i < 10000 && atomic_load(&c->seen) < n - 1; i++)
        sleep_s(0.001);
    RANK_EXPECT(s, atomic_load(&c->seen) == n - 1, "the peers did not see the abort");
    tp_work_free(wk);
    return fail_like_a_user();
}

Test(comm_errors, run_reports_a_rank_that_aborted_first, .timeout = 60)
{
    static const int sizes[] = {2, 3, 4, 8};
    for (int si = 0; si < 4; si++) {
        int n = sizes[si];
        for (int run = 0; run < 5; run++) {
            abort_first_ctx c = {0};
            tp_status ranks[8];
            tp_run_options o = {.rank_status = ranks};
            tp_status st = tp_run_local_opts(n, abort_first_body, &c, &o);
            tp_test_assert_slots(c.slot, n);
            cr_assert_eq(st, TP_ERR_INVALID_ARG, "%d ranks, run %d: %s (%s)", n, run,
                         tp_status_name(st), tp_last_error());
            cr_assert(strncmp(tp_last_error(), "rank 0: ", 8) == 0, "%d ranks, run %d: %s", n,
                      run, tp_last_error());
            for (int r = 1; r < n; r++)
                cr_assert_eq(ranks[r], TP_ERR_ABORTED, "%d ranks, run %d, rank %d: %s", n, run,
                             r, tp_status_name(ranks[r]));
        }
    }
}

/* ---- mismatched collectives ----------------------------------------------------- */

typedef struct {
    err_ctx e;
    int scenario;
} mm_ctx;

static tp_status mismatch_body(tp_comm *w, void *arg)
{
    mm_ctx *c = arg;
    int r = tp_comm_rank(w), n = tp_comm_size(w);
    int64_t k = 8, k2 = 16, kn = 8 * n;
    tp_tensor *x = NULL, *y = NULL, *g = NULL;
    tp_status st = tp_tensor_zeros(TP_F32, TP_CPU, 1, &k, &x);
    if (st == TP_OK)
        st = tp_tensor_zeros(TP_F32, TP_CPU, 1, &k2, &y);
    if (st == TP_OK)
        st = tp_tensor_zeros(TP_F32, TP_CPU, 1, &kn, &g);
    if (st != TP_OK)
        return st;
    bool odd = r == n - 1;
    switch (c->scenario) {
    case 0: /* element counts differ */
        st = odd ? tp_all_reduce(w, y, y, TP_SUM, NULL) : tp_all_reduce(w, x, x, TP_SUM, NULL);
        break;
    case 1: /* kinds differ */
        st = odd ? tp_all_gather(w, x, g, NULL) : tp_all_reduce(w, x, x, TP_SUM, NULL);
        break;
    case 2: /* reduce ops differ */
        st = tp_all_reduce(w, x, x, odd ? TP_MAX : TP_SUM, NULL);
        break;
    case 3: /* roots differ */
        st = tp_broadcast(w, x, odd ? 1 : 0, NULL);
        break;
    case 4: /* barrier against a collective */
        st = odd ? tp_barrier(w, NULL) : tp_all_reduce(w, x, x, TP_SUM, NULL);
        break;
    case 5: /* scatter roots differ (send is read on root only) */
        st = tp_scatter(w, g, x, odd ? 1 : 0, NULL);
        break;
    case 6: /* scatter counts differ: the last rank expects 16 elements */
        st = tp_scatter(w, r == 0 ? g : NULL, odd ? y : x, 0, NULL);
        break;
    case 7: /* scatter against a broadcast */
        st = odd ? tp_broadcast(w, x, 0, NULL) : tp_scatter(w, g, x, 0, NULL);
        break;
    }
    record(&c->e, r, st);
    /* a mismatch moves no data and keeps the ranks in step */
    tp_status st2 = tp_all_reduce(w, x, x, TP_SUM, NULL);
    RANK_EXPECT(&c->e.slot[r], st2 == TP_OK, "collective after a mismatch: %s",
                tp_status_name(st2));
    tp_tensor_release(x);
    tp_tensor_release(y);
    tp_tensor_release(g);
    return TP_OK;
}

static void expected_mismatch(int scenario, int odd, char *buf, size_t len)
{
    switch (scenario) {
    case 0:
        snprintf(buf, len, "rank 0 issued all_reduce(f32, 8 elements, sum), rank %d issued "
                           "all_reduce(f32, 16 elements, sum)", odd);
        break;
    case 1:
        snprintf(buf, len, "rank 0 issued all_reduce(f32, 8 elements, sum), rank %d issued "
                           "all_gather(f32, 8 elements)", odd);
        break;
    case 2:
        snprintf(buf, len, "rank %d issued all_reduce(f32, 8 elements, max)", odd);
        break;
    case 3:
        snprintf(buf, len, "rank %d issued broadcast(f32, 8 elements, root 1)", odd);
        break;
    case 4:
        snprintf(buf, len, "rank %d issued barrier", odd);
        break;
    case 5:
        snprintf(buf, len, "rank 0 issued scatter(f32, 8 elements, root 0), rank %d issued "
                           "scatter(f32, 8 elements, root 1)", odd);
        break;
    case 6:
        snprintf(buf, len, "rank %d issued scatter(f32, 16 elements, root 0)", odd);
        break;
    default:
        snprintf(buf, len, "rank 0 issued scatter(f32, 8 elements, root 0), rank %d issued "
                           "broadcast(f32, 8 elements, root 0)", odd);
        break;
    }
}

Test(comm_errors, mismatch, .timeout = 60)
{
    for (int n = 2; n <= 4; n++) {
        for (int sc = 0; sc < 8; sc++) {
            mm_ctx c = {.scenario = sc};
            tp_status st = tp_run_local(n, mismatch_body, &c);
            tp_test_assert_slots(c.e.slot, n);
            cr_assert_eq(st, TP_OK, "%s", tp_last_error());
            char needle[256];
            expected_mismatch(sc, n - 1, needle, sizeof needle);
            for (int r = 0; r < n; r++) {
                cr_assert_eq(c.e.got[r], TP_ERR_MISMATCH, "n=%d scenario %d rank %d: %s", n, sc,
                             r, tp_status_name(c.e.got[r]));
                cr_assert(strstr(c.e.msg[r], needle) != NULL, "'%s' lacks '%s'", c.e.msg[r],
                          needle);
            }
        }
    }
}

/* ---- too many outstanding async collectives ------------------------------------ */

static tp_status flood_body(tp_comm *w, void *arg)
{
    err_ctx *c = arg;
    int r = tp_comm_rank(w);
    tp_test_slot *s = &c->slot[r];
    enum { M = 200 };
    static _Thread_local tp_work *wk[M];
    int64_t one = 1;
    tp_tensor *x = NULL;
    RANK_OK(s, tp_tensor_zeros(TP_F32, TP_CPU, 1, &one, &x));
    int issued = 0;
    tp_status st = TP_OK;
    for (; issued < M; issued++) {
        st = tp_barrier(w, &wk[issued]);
        if (st != TP_OK)
            break;
    }
    RANK_EXPECT(s, st == TP_ERR_STATE, "flooding gave %s after %d", tp_status_name(st), issued);
    RANK_EXPECT(s, strstr(tp_last_error(), "outstanding") != NULL, "%s", tp_last_error());
    for (int i = 0; i < issued; i++) {
        RANK_OK(s, tp_work_wait(wk[i]));
        tp_work_free(wk[i]);
    }
    RANK_OK(s, tp_all_reduce(w, x, x, TP_SUM, NULL));
    tp_tensor_release(x);
    return TP_OK;
}

Test(comm_errors, too_many_outstanding, .timeout = 30)
{
    err_ctx c = {0};
    tp_status st = tp_run_local(2, flood_body, &c);
    tp_test_assert_slots(c.slot, 2);
    cr_assert_eq(st, TP_OK, "%s", tp_last_error());
}

/* ---- allocation failures ---------------------------------------------------------- */

static atomic_long live_allocs;
static atomic_long alloc_budget; /* allocations left before failing; < 0: unlimited */

static void *counting_alloc(void *ctx, size_t size, size_t alignment)
{
    (void)ctx;
    if (atomic_load(&alloc_budget) >= 0 && atomic_fetch_sub(&alloc_budget, 1) <= 0)
        return NULL;
    void *p = aligned_alloc(alignment, (size + alignment - 1) / alignment * alignment);
    if (p)
        atomic_fetch_add(&live_allocs, 1);
    return p;
}

static void counting_free(void *ctx, void *p)
{
    (void)ctx;
    atomic_fetch_sub(&live_allocs, 1);
    free(p);
}

static tp_status oom_body(tp_comm *w, void *arg)
{
    (void)arg;
    int64_t k = 64;
    tp_tensor *x = NULL;
    tp_comm *sub = NULL;
    tp_work *wk = NULL;
    tp_status st = tp_tensor_zeros(TP_F32, TP_CPU, 1, &k, &x);
    if (st == TP_OK)
        st = tp_all_reduce(w, x, x, TP_SUM, &wk);
    if (st == TP_OK)
        st = tp_work_wait(wk);
    tp_work_free(wk);
    if (st == TP_OK)
        st = tp_comm_split(w, tp_comm_rank(w) % 2, 0, &sub);
    if (st == TP_OK && sub)
        st = tp_all_reduce(sub, x, x, TP_SUM, NULL);
    tp_comm_free(sub);
    tp_tensor_release(x);
    return st;
}

Test(comm_errors, allocation_failures, .timeout = 120)
{
    tp_allocator a = {counting_alloc, counting_free, NULL};
    cr_assert_eq(tp_set_allocator(&a), TP_OK);
    bool succeeded = false;
    for (long budget = 0; budget < 400 && !succeeded; budget++) {
        atomic_store(&live_allocs, 0);
        atomic_store(&alloc_budget, budget);
        tp_status st = tp_run_local(3, oom_body, NULL);
        atomic_store(&alloc_budget, -1);
        cr_assert(st == TP_OK || st == TP_ERR_NO_MEMORY || st == TP_ERR_ABORTED,
                  "budget %ld: %s (%s)", budget, tp_status_name(st), tp_last_error());
        cr_assert_eq(atomic_load(&live_allocs), 0, "budget %ld: %ld allocations leaked", budget,
                     atomic_load(&live_allocs));
        succeeded = st == TP_OK;
    }
    tp_set_allocator(NULL);
    cr_assert(succeeded, "never succeeded within the allocation budget");
}
