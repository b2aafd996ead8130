/*
 * The mpi backend under mpirun: a plain C program, one process per rank (not
 * Criterion, whose forking does not mix with MPI).
 *
 *   mpirun -np N test_mpi_comm                libtp initializes and finalizes MPI
 *   mpirun -np N test_mpi_comm --user-init    the program initializes MPI itself and
 *                                             hands libtp a communicator of its own
 *
 * Checks, with integer-valued data so every expected value is exact: every
 * collective x reduce op x dtype, in and out of place, blocking, async with
 * tp_work_wait and async with tp_work_test polling, several collectives in
 * flight at once; splits (parity colors, reversed keys, color -1, a split of
 * a split); aborts (local abort, pending work, a peer that learns of it by
 * timing out, a rank out of memory); meshes with per-dim all_reduce / all_gather and a slice; the
 * same buffers passed again and again (the persistent requests of a
 * two-rank world), the
 * descriptor check (a mismatched count or op on the last rank gives every
 * rank TP_ERR_MISMATCH); DTensor redistribution; a Colwise + Rowwise MLP
 * against the plain module, with the comm-debug counts of DESIGN.md.
 *
 * Each failed check prints a line on stderr. At the end rank 0 prints
 * "mpi: N passed, N failed" summed over the ranks; the exit status is
 * non-zero on any failure.
 */
#if !defined(_GNU_SOURCE) && !defined(_POSIX_C_SOURCE)
#define _POSIX_C_SOURCE 200809L /* clock_gettime, nanosleep, posix_memalign */
#endif
#include <mpi.h>

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <tp.h>

static int g_rank = -1, g_size = 0;
/* two ranks on two nodes: the backend's direct path takes their reductions
 * up to 4 MiB per rank (mpi_direct.h), as scripts/multihost-check.sh runs
 * them */
static bool g_apart;
static long g_pass, g_fail;

/* One line per failure, written at once so the ranks' lines do not mix. */
static void fail_line(int line, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define EXPECT(cond, ...)                                                       \
    do {                                                                        \
        if (cond)                                                               \
            g_pass++;                                                           \
        else                                                                    \
            fail_line(__LINE__, __VA_ARGS__);                                   \
    } while (0)

/* A call that must succeed; on failure the enclosing function returns. */
#define REQUIRE(expr)                                                           \
    do {                                                                        \
        tp_status req_st_ = (expr);                                             \
        if (req_st_ != TP_OK) {                                                 \
            EXPECT(0, "%s -> %s (%s)", #expr, tp_status_name(req_st_), tp_last_error()); \
            return;                                                             \
        }                                                                       \
    } while (0)

/* A call whose status is checked and counted. */
#define EXPECT_STATUS(expr, want, label)                                        \
    do {                                                                        \
        tp_status exp_st_ = (expr);                                             \
        EXPECT(exp_st_ == (want), "%s: %s -> %s, expected %s (%s)", (label), #expr, \
               tp_status_name(exp_st_), tp_status_name(want), tp_last_error()); \
    } while (0)

static void fail_line(int line, const char *fmt, ...)
{
    char msg[1024];
    int p = snprintf(msg, sizeof msg, "[rank %d] FAIL test_mpi_comm.c:%d: ", g_rank, line);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg + p, sizeof msg - (size_t)p, fmt, ap);
    va_end(ap);
    g_fail++;
    fprintf(stderr, "%s\n", msg);
    fflush(stderr);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static const tp_dtype all_dtypes[] = {TP_F32, TP_F64, TP_F16, TP_BF16, TP_I32, TP_I64};
#define NDTYPES ((int)(sizeof all_dtypes / sizeof all_dtypes[0]))
static const char *const mode_names[] = {"blocking", "async wait", "async test"};

/* ---- tensors from and to doubles -------------------------------------------- */

/* A 1-D tensor of dtype holding v[0..n) (exact for the values used here). */
static tp_status from_doubles(tp_dtype dt, int64_t n, const double *v, tp_tensor **out)
{
    tp_tensor *t = NULL;
    tp_status st = tp_tensor_from_data(TP_F64, 1, &n, v, &t);
    if (st == TP_OK)
        st = tp_tensor_to(t, dt, TP_CPU, out);
    tp_tensor_release(t);
    return st;
}

/* Copies t's elements (any dtype, contiguous) into v as doubles. */
static tp_status to_doubles(const tp_tensor *t, double *v)
{
    tp_tensor *d = NULL;
    tp_status st = tp_tensor_to(t, TP_F64, TP_CPU, &d);
    if (st == TP_OK)
        memcpy(v, tp_tensor_data(d), sizeof(double) * (size_t)tp_tensor_numel(d));
    tp_tensor_release(d);
    return st;
}

/* One check: t equals want[0..n) exactly. */
static void expect_values(const tp_tensor *t, const double *want, int64_t n, const char *label)
{
    if (tp_tensor_numel(t) != n) {
        EXPECT(0, "%s: %lld elements, expected %lld", label, (long long)tp_tensor_numel(t),
               (long long)n);
        return;
    }
    double *got = malloc(sizeof(double) * (size_t)(n ? n : 1));
    tp_status st = to_doubles(t, got);
    int64_t bad = -1;
    for (int64_t i = 0; st == TP_OK && i < n && bad < 0; i++)
        if (!(got[i] == want[i]))
            bad = i;
    EXPECT(st == TP_OK && bad < 0, "%s: element %lld is %g, expected %g%s", label,
           (long long)bad, bad >= 0 ? got[bad] : 0.0, bad >= 0 ? want[bad] : 0.0,
           st == TP_OK ? "" : " (conversion failed)");
    free(got);
}

/* Completes a collective in the given mode: 0 blocking (work is NULL),
 * 1 tp_work_wait (twice: the second returns the same status), 2 tp_work_test
 * polling. Returns the collective's status. */
static tp_status complete(tp_status issued, tp_work *w, int mode, const char *label)
{
    if (issued != TP_OK || !w)
        return issued;
    tp_status st = TP_OK;
    if (mode == 1) {
        st = tp_work_wait(w);
        tp_status again = tp_work_wait(w);
        EXPECT(again == st, "%s: a second tp_work_wait returned %s after %s", label,
               tp_status_name(again), tp_status_name(st));
    } else {
        bool done = false;
        double t0 = now_s();
        while (!done) {
            st = tp_work_test(w, &done);
            if (st != TP_OK)
                break;
            if (!done && now_s() - t0 > 60) {
                EXPECT(0, "%s: tp_work_test did not report completion within 60 s", label);
                st = tp_work_wait(w);
                break;
            }
        }
    }
    tp_work_free(w);
    return st;
}

/* ---- reductions -------------------------------------------------------------- */

/* Rank r's element g for reduce op `op`: small integers whose sums, products,
 * maxima and minima are exact in every dtype (bf16 holds integers up to 256
 * exactly). For avg of float dtypes, rank 0 compensates so that the sum is a
 * multiple of n; integer avg uses data whose sums are not, negative ones too,
 * to check the truncation toward zero. */
static double red_value(tp_reduce_op op, tp_dtype dt, int r, int64_t g, int n)
{
    switch (op) {
    case TP_PRODUCT:
        return (double)(1 + (r + g) % 3) * (((r + g) % 5 == 0) ? -1 : 1);
    case TP_AVG:
        if (tp_dtype_is_float(dt))
            return (double)(g % 7 - 3) + (r == 0 ? n - 1 : -1);
        return (double)((r * 7 + g * 3) % 9 - 4);
    default:
        return (double)((r * 7 + g * 3) % 9 - 4);
    }
}

static double red_expected(tp_reduce_op op, tp_dtype dt, int64_t g, int n)
{
    double acc = red_value(op, dt, 0, g, n);
    for (int r = 1; r < n; r++) {
        double v = red_value(op, dt, r, g, n);
        switch (op) {
        case TP_SUM:
        case TP_AVG:
            acc += v;
            break;
        case TP_PRODUCT:
            acc *= v;
            break;
        case TP_MAX:
            acc = v > acc ? v : acc;
            break;
        case TP_MIN:
            acc = v < acc ? v : acc;
            break;
        default:
            break;
        }
    }
    if (op == TP_AVG) {
        if (tp_dtype_is_float(dt))
            acc /= n;
        else
            acc = (double)((int64_t)acc / n); /* C division truncates toward zero */
    }
    return acc;
}

static void check_all_reduce(tp_comm *c, tp_dtype dt, tp_reduce_op op, int64_t k, bool in_place,
                             int mode)
{
    int n = tp_comm_size(c), r = tp_comm_rank(c);
    char label[160];
    snprintf(label, sizeof label, "all_reduce(%s, %s, k=%lld, %s, %s)", tp_dtype_name(dt),
             tp_reduce_op_name(op), (long long)k, in_place ? "in place" : "out of place",
             mode_names[mode]);
    double *v = malloc(sizeof(double) * (size_t)k), *want = malloc(sizeof(double) * (size_t)k);
    for (int64_t i = 0; i < k; i++) {
        v[i] = red_value(op, dt, r, i, n);
        want[i] = red_expected(op, dt, i, n);
    }
    tp_tensor *send = NULL, *recv = NULL;
    tp_work *w = NULL;
    if (from_doubles(dt, k, v, &send) == TP_OK &&
        (in_place ? (recv = tp_tensor_retain(send)) != NULL
                  : tp_tensor_zeros(dt, TP_CPU, 1, &k, &recv) == TP_OK)) {
        tp_status st = tp_all_reduce(c, send, recv, op, mode ? &w : NULL);
        st = complete(st, w, mode, label);
        EXPECT(st == TP_OK, "%s -> %s (%s)", label, tp_status_name(st), tp_last_error());
        if (st == TP_OK)
            expect_values(recv, want, k, label);
    } else {
        EXPECT(0, "%s: could not build the buffers (%s)", label, tp_last_error());
    }
    tp_tensor_release(send);
    tp_tensor_release(recv);
    free(v);
    free(want);
}

static void check_reduce_scatter(tp_comm *c, tp_dtype dt, tp_reduce_op op, int64_t k,
                                 bool in_place, int mode)
{
    int n = tp_comm_size(c), r = tp_comm_rank(c);
    int64_t nk = k * n;
    char label[160];
    snprintf(label, sizeof label, "reduce_scatter(%s, %s, k=%lld, %s, %s)", tp_dtype_name(dt),
             tp_reduce_op_name(op), (long long)k, in_place ? "in place" : "out of place",
             mode_names[mode]);
    double *v = malloc(sizeof(double) * (size_t)nk), *want = malloc(sizeof(double) * (size_t)k);
    for (int64_t g = 0; g < nk; g++)
        v[g] = red_value(op, dt, r, g, n);
    for (int64_t i = 0; i < k; i++)
        want[i] = red_expected(op, dt, (int64_t)r * k + i, n);
    tp_tensor *send = NULL, *recv = NULL;
    tp_work *w = NULL;
    tp_status st = from_doubles(dt, nk, v, &send);
    if (st == TP_OK)
        st = in_place ? tp_tensor_narrow(send, 0, (int64_t)r * k, k, &recv)
                      : tp_tensor_zeros(dt, TP_CPU, 1, &k, &recv);
    if (st == TP_OK) {
        st = tp_reduce_scatter(c, send, recv, op, mode ? &w : NULL);
        st = complete(st, w, mode, label);
        EXPECT(st == TP_OK, "%s -> %s (%s)", label, tp_status_name(st), tp_last_error());
        if (st == TP_OK) {
            expect_values(recv, want, k, label);
            if (in_place) {
                /* the other blocks of send are left as they were */
                for (int64_t g = 0; g < nk; g++)
                    if (g / k == r)
                        v[g] = want[g - (int64_t)r * k];
                char l2[200];
                snprintf(l2, sizeof l2, "%s: whole send buffer", label);
                expect_values(send, v, nk, l2);
            }
        }
    } else {
        EXPECT(0, "%s: could not build the buffers (%s)", label, tp_last_error());
    }
    tp_tensor_release(send);
    tp_tensor_release(recv);
    free(v);
    free(want);
}

/* ---- copying collectives ------------------------------------------------------ */

static double gather_value(int r, int64_t i) { return (double)((r * 37 + i) % 251); }

static void check_all_gather(tp_comm *c, tp_dtype dt, int64_t k, bool in_place, int mode)
{
    int n = tp_comm_size(c), r = tp_comm_rank(c);
    int64_t nk = k * n;
    char label[160];
    snprintf(label, sizeof label, "all_gather(%s, k=%lld, %s, %s)", tp_dtype_name(dt),
             (long long)k, in_place ? "in place" : "out of place", mode_names[mode]);
    double *v = malloc(sizeof(double) * (size_t)nk), *want = malloc(sizeof(double) * (size_t)nk);
    for (int64_t g = 0; g < nk; g++) {
        want[g] = gather_value((int)(g / k), g % k);
        v[g] = g / k == r ? want[g] : -1; /* in place: only this rank's block is set */
    }
    tp_tensor *send = NULL, *recv = NULL;
    tp_work *w = NULL;
    tp_status st;
    if (in_place) {
        st = from_doubles(dt, nk, v, &recv);
        if (st == TP_OK)
            st = tp_tensor_narrow(recv, 0, (int64_t)r * k, k, &send);
    } else {
        st = from_doubles(dt, k, want + (int64_t)r * k, &send);
        if (st == TP_OK)
            st = from_doubles(dt, nk, v, &recv);
    }
    if (st == TP_OK) {
        st = tp_all_gather(c, send, recv, mode ? &w : NULL);
        st = complete(st, w, mode, label);
        EXPECT(st == TP_OK, "%s -> %s (%s)", label, tp_status_name(st), tp_last_error());
        if (st == TP_OK)
            expect_values(recv, want, nk, label);
    } else {
        EXPECT(0, "%s: could not build the buffers (%s)", label, tp_last_error());
    }
    tp_tensor_release(send);
    tp_tensor_release(recv);
    free(v);
    free(want);
}

static double a2a_value(int from, int to, int64_t i)
{
    return (double)((from * 31 + to * 17 + i) % 251);
}

static void check_all_to_all(tp_comm *c, tp_dtype dt, int64_t k, int mode)
{
    int n = tp_comm_size(c), r = tp_comm_rank(c);
    int64_t nk = k * n;
    char label[160];
    snprintf(label, sizeof label, "all_to_all(%s, k=%lld, %s)", tp_dtype_name(dt), (long long)k,
             mode_names[mode]);
    double *v = malloc(sizeof(double) * (size_t)nk), *want = malloc(sizeof(double) * (size_t)nk);
    for (int64_t g = 0; g < nk; g++) {
        v[g] = a2a_value(r, (int)(g / k), g % k);
        want[g] = a2a_value((int)(g / k), r, g % k);
    }
    tp_tensor *send = NULL, *recv = NULL;
    tp_work *w = NULL;
    tp_status st = from_doubles(dt, nk, v, &send);
    if (st == TP_OK)
        st = tp_tensor_zeros(dt, TP_CPU, 1, &nk, &recv);
    if (st == TP_OK) {
        st = tp_all_to_all(c, send, recv, mode ? &w : NULL);
        st = complete(st, w, mode, label);
        EXPECT(st == TP_OK, "%s -> %s (%s)", label, tp_status_name(st), tp_last_error());
        if (st == TP_OK)
            expect_values(recv, want, nk, label);
    } else {
        EXPECT(0, "%s: could not build the buffers (%s)", label, tp_last_error());
    }
    tp_tensor_release(send);
    tp_tensor_release(recv);
    free(v);
    free(want);
}

static void check_broadcast(tp_comm *c, tp_dtype dt, int64_t k, int root, int mode)
{
    int r = tp_comm_rank(c);
    char label[160];
    snprintf(label, sizeof label, "broadcast(%s, k=%lld, root %d, %s)", tp_dtype_name(dt),
             (long long)k, root, mode_names[mode]);
    double *v = malloc(sizeof(double) * (size_t)k), *want = malloc(sizeof(double) * (size_t)k);
    for (int64_t i = 0; i < k; i++) {
        want[i] = (double)((root * 13 + i) % 251);
        v[i] = r == root ? want[i] : -1;
    }
    tp_tensor *buf = NULL;
    tp_work *w = NULL;
    tp_status st = from_doubles(dt, k, v, &buf);
    if (st == TP_OK) {
        st = tp_broadcast(c, buf, root, mode ? &w : NULL);
        st = complete(st, w, mode, label);
        EXPECT(st == TP_OK, "%s -> %s (%s)", label, tp_status_name(st), tp_last_error());
        if (st == TP_OK)
            expect_values(buf, want, k, label);
    } else {
        EXPECT(0, "%s: could not build the buffer (%s)", label, tp_last_error());
    }
    tp_tensor_release(buf);
    free(v);
    free(want);
}

/* Root's send holds block j for rank j; the other ranks pass NULL; in place
 * root receives into its own block. */
static void check_scatter(tp_comm *c, tp_dtype dt, int64_t k, int root, bool in_place, int mode)
{
    int r = tp_comm_rank(c), n = tp_comm_size(c);
    char label[160];
    snprintf(label, sizeof label, "scatter(%s, k=%lld, root %d, %s, %s)", tp_dtype_name(dt),
             (long long)k, root, in_place ? "in place" : "out of place", mode_names[mode]);
    int64_t nk = k * n;
    double *v = malloc(sizeof(double) * (size_t)(nk ? nk : 1));
    double *want = malloc(sizeof(double) * (size_t)(k ? k : 1));
    for (int64_t g = 0; g < nk; g++)
        v[g] = (double)((root * 29 + g) % 251);
    for (int64_t i = 0; i < k; i++)
        want[i] = v[r * k + i];
    tp_tensor *send = NULL, *recv = NULL;
    tp_work *w = NULL;
    tp_status st = r == root ? from_doubles(dt, nk, v, &send) : TP_OK;
    if (st == TP_OK && in_place && r == root) {
        st = tp_tensor_narrow(send, 0, r * k, k, &recv);
    } else if (st == TP_OK) {
        for (int64_t i = 0; i < k; i++)
            v[i] = -1;
        st = from_doubles(dt, k, v, &recv);
    }
    if (st == TP_OK) {
        st = tp_scatter(c, send, recv, root, mode ? &w : NULL);
        st = complete(st, w, mode, label);
        EXPECT(st == TP_OK, "%s -> %s (%s)", label, tp_status_name(st), tp_last_error());
        if (st == TP_OK)
            expect_values(recv, want, k, label);
    } else {
        EXPECT(0, "%s: could not build the buffers (%s)", label, tp_last_error());
    }
    tp_tensor_release(send);
    tp_tensor_release(recv);
    free(v);
    free(want);
}

static void test_collectives(tp_comm *world)
{
    static const int64_t ks[] = {1, 37, 1001};
    for (int d = 0; d < NDTYPES; d++) {
        tp_dtype dt = all_dtypes[d];
        for (size_t ki = 0; ki < sizeof ks / sizeof ks[0]; ki++) {
            for (int mode = 0; mode < 3; mode++) {
                for (int ip = 0; ip < 2; ip++) {
                    for (int op = 0; op < TP_REDUCE_OP_COUNT; op++) {
                        check_all_reduce(world, dt, (tp_reduce_op)op, ks[ki], ip, mode);
                        check_reduce_scatter(world, dt, (tp_reduce_op)op, ks[ki], ip, mode);
                    }
                    check_all_gather(world, dt, ks[ki], ip, mode);
                }
                check_all_to_all(world, dt, ks[ki], mode);
                for (int root = 0; root < tp_comm_size(world); root++) {
                    check_broadcast(world, dt, ks[ki], root, mode);
                    for (int ip = 0; ip < 2; ip++)
                        check_scatter(world, dt, ks[ki], root, ip, mode);
                }
            }
        }
    }
    /* large buffers: MPI switches algorithms with the size */
    int64_t big = 1 << 18;
    for (int ip = 0; ip < 2; ip++) {
        check_all_reduce(world, TP_F32, TP_SUM, big, ip, 1);
        check_all_reduce(world, TP_BF16, TP_AVG, big, ip, 0);
        check_reduce_scatter(world, TP_F32, TP_SUM, big / tp_comm_size(world), ip, 0);
        check_reduce_scatter(world, TP_F16, TP_MAX, big / tp_comm_size(world), ip, 1);
        check_all_gather(world, TP_I64, big / tp_comm_size(world), ip, 2);
    }
    check_all_to_all(world, TP_F64, big / tp_comm_size(world), 1);
    check_broadcast(world, TP_I32, big, tp_comm_size(world) - 1, 0);
    check_scatter(world, TP_F32, big / tp_comm_size(world), tp_comm_size(world) - 1, false, 1);
    check_scatter(world, TP_BF16, big / tp_comm_size(world), 0, true, 0);
}

/* Every rank gets the same bits from a reduction of values that round
 * (1 / (rank + i + 1)), small (point-to-point, mpi_direct.c, where rank 0's
 * contribution goes straight into the result out of place) and large (the
 * ring, or MPI's collective), in place and out of place, checked by
 * gathering every rank's result; and the result is within float rounding of
 * the sum in double. */
static void check_same_bits(tp_comm *world, tp_dtype dt, tp_reduce_op op, int64_t k, bool in_place)
{
    int n = tp_comm_size(world), r = tp_comm_rank(world);
    char label[120];
    snprintf(label, sizeof label, "same bits: all_reduce(%s, %s, k=%lld, %s)", tp_dtype_name(dt),
             tp_reduce_op_name(op), (long long)k, in_place ? "in place" : "out of place");
    double *v = malloc(sizeof(double) * (size_t)k);
    for (int64_t i = 0; i < k; i++)
        v[i] = 1.0 / (double)(r + i % 1000 + 1);
    tp_tensor *in = NULL, *x = NULL, *all = NULL;
    int64_t nk = k * n;
    if (from_doubles(dt, k, v, &in) == TP_OK &&
        (in_place ? (x = tp_tensor_retain(in)) != NULL
                  : tp_tensor_zeros(dt, TP_CPU, 1, &k, &x) == TP_OK) &&
        tp_tensor_zeros(dt, TP_CPU, 1, &nk, &all) == TP_OK) {
        tp_status st = tp_all_reduce(world, in, x, op, NULL);
        EXPECT(st == TP_OK, "%s -> %s (%s)", label, tp_status_name(st), tp_last_error());
        st = tp_all_gather(world, x, all, NULL);
        EXPECT(st == TP_OK, "%s: all_gather -> %s", label, tp_status_name(st));
        size_t bytes = (size_t)k * tp_dtype_size(dt);
        const char *mine = tp_tensor_data(x), *every = tp_tensor_data(all);
        for (int q = 0; q < n && st == TP_OK; q++)
            EXPECT(memcmp(every + (size_t)q * bytes, mine, bytes) == 0,
                   "%s: rank %d's result differs from rank %d's", label, q, r);
        if (dt == TP_F32 && op == TP_SUM) {
            const float *got = tp_tensor_data(x);
            double worst = 0;
            for (int64_t i = 0; i < k; i++) {
                double want = 0;
                for (int q = 0; q < n; q++)
                    want += 1.0 / (double)(q + i % 1000 + 1);
                double e = ((double)got[i] - want) / want;
                e = e < 0 ? -e : e;
                worst = e > worst ? e : worst;
            }
            EXPECT(worst < 1e-6 * n, "%s: relative error %.3g vs the f64 sum", label, worst);
        }
    } else {
        EXPECT(0, "%s: could not build the buffers (%s)", label, tp_last_error());
    }
    tp_tensor_release(in);
    tp_tensor_release(x);
    tp_tensor_release(all);
    free(v);
}

static void test_same_bits(tp_comm *world)
{
    static const int64_t ks[] = {37, 1 << 17};
    for (size_t i = 0; i < sizeof ks / sizeof ks[0]; i++) {
        for (int ip = 0; ip < 2; ip++) {
            check_same_bits(world, TP_F32, TP_SUM, ks[i], ip);
            check_same_bits(world, TP_BF16, TP_SUM, ks[i], ip);
            check_same_bits(world, TP_F64, TP_PRODUCT, ks[i], ip);
        }
    }
}

/* A value every rank can compute: what rank q writes at element i of set s
 * in round t (exact in f32). */
static float persist_value(int q, int s, int t, int64_t i)
{
    return (float)((q * 1009 + s * 101 + t * 13 + i) % 4093);
}

/* Whether the k-element block of got equals rank q's values; counts wrong
 * elements into *bad. */
static void persist_block(const float *got, int q, int s, int t, int64_t k, long *bad)
{
    for (int64_t i = 0; i < k; i++)
        *bad += got[i] != persist_value(q, s, t, i);
}

/* The same buffers again and again, as a training loop passes them: on two
 * ranks a blocking all_gather, all_to_all or broadcast keeps its messages as
 * persistent requests per set of buffers (mpi.c keeps 4 sets), started again
 * each time the buffers come back. Each round writes new values into 6 sets
 * taken in turn (more than are kept, so sets come back after being made
 * over) and checks every result: in place and not, the broadcast's root
 * moving, messages whole, as halves (3 KiB, where the world splits) and of
 * 16 KiB; then every tensor is freed and made again, where the allocator may
 * hand the same addresses back. Any world size (the persistent path is for
 * two ranks; the others check the same results). */
static void test_persistent(tp_comm *world)
{
    enum { SETS = 6, ROUNDS = 3 };
    static const int64_t ks[] = {5, 768, 4096};
    int n = tp_comm_size(world), r = tp_comm_rank(world);
    for (size_t ki = 0; ki < sizeof ks / sizeof ks[0]; ki++) {
        for (int again = 0; again < 2; again++) {
            int64_t k = ks[ki], nk = k * n;
            tp_tensor *ag_s[SETS] = {0}, *ag_r[SETS] = {0}, *ip_r[SETS] = {0}, *ip_s[SETS] = {0};
            tp_tensor *a2a_s[SETS] = {0}, *a2a_r[SETS] = {0}, *bc[SETS] = {0};
            tp_status st = TP_OK;
            for (int s = 0; s < SETS && st == TP_OK; s++) {
                st = tp_tensor_zeros(TP_F32, TP_CPU, 1, &k, &ag_s[s]);
                if (st == TP_OK)
                    st = tp_tensor_zeros(TP_F32, TP_CPU, 1, &nk, &ag_r[s]);
                if (st == TP_OK)
                    st = tp_tensor_zeros(TP_F32, TP_CPU, 1, &nk, &ip_r[s]);
                if (st == TP_OK)
                    st = tp_tensor_narrow(ip_r[s], 0, (int64_t)r * k, k, &ip_s[s]);
                if (st == TP_OK)
                    st = tp_tensor_zeros(TP_F32, TP_CPU, 1, &nk, &a2a_s[s]);
                if (st == TP_OK)
                    st = tp_tensor_zeros(TP_F32, TP_CPU, 1, &nk, &a2a_r[s]);
                if (st == TP_OK)
                    st = tp_tensor_zeros(TP_F32, TP_CPU, 1, &k, &bc[s]);
            }
            EXPECT(st == TP_OK, "persistent: buffers: %s", tp_last_error());
            for (int t = 0; t < ROUNDS && st == TP_OK; t++) {
                for (int s = 0; s < SETS; s++) {
                    char label[120];
                    snprintf(label, sizeof label, "persistent (k=%lld, pass %d, round %d, set %d)",
                             (long long)k, again, t, s);
                    long bad = 0;
                    /* all_gather, out of place */
                    float *x = tp_tensor_data(ag_s[s]), *y = tp_tensor_data(ag_r[s]);
                    for (int64_t i = 0; i < k; i++)
                        x[i] = persist_value(r, s, t, i);
                    for (int64_t i = 0; i < nk; i++)
                        y[i] = -1;
                    st = tp_all_gather(world, ag_s[s], ag_r[s], NULL);
                    EXPECT(st == TP_OK, "%s: all_gather -> %s (%s)", label, tp_status_name(st),
                           tp_last_error());
                    for (int q = 0; q < n && st == TP_OK; q++)
                        persist_block(y + (int64_t)q * k, q, s, t, k, &bad);
                    EXPECT(bad == 0, "%s: all_gather: %ld elements wrong", label, bad);
                    /* all_gather, in place */
                    bad = 0;
                    y = tp_tensor_data(ip_r[s]);
                    for (int64_t i = 0; i < nk; i++)
                        y[i] = i / k == r ? persist_value(r, s, t + 1, i % k) : -1;
                    st = tp_all_gather(world, ip_s[s], ip_r[s], NULL);
                    EXPECT(st == TP_OK, "%s: in-place all_gather -> %s (%s)", label,
                           tp_status_name(st), tp_last_error());
                    for (int q = 0; q < n && st == TP_OK; q++)
                        persist_block(y + (int64_t)q * k, q, s, t + 1, k, &bad);
                    EXPECT(bad == 0, "%s: in-place all_gather: %ld elements wrong", label, bad);
                    /* all_to_all: block q goes to rank q, which finds rank r's
                     * values of set s + q there */
                    bad = 0;
                    x = tp_tensor_data(a2a_s[s]);
                    y = tp_tensor_data(a2a_r[s]);
                    for (int64_t i = 0; i < nk; i++) {
                        x[i] = persist_value(r, s + (int)(i / k), t, i % k);
                        y[i] = -1;
                    }
                    st = tp_all_to_all(world, a2a_s[s], a2a_r[s], NULL);
                    EXPECT(st == TP_OK, "%s: all_to_all -> %s (%s)", label, tp_status_name(st),
                           tp_last_error());
                    for (int q = 0; q < n && st == TP_OK; q++)
                        persist_block(y + (int64_t)q * k, q, s + r, t, k, &bad);
                    EXPECT(bad == 0, "%s: all_to_all: %ld elements wrong", label, bad);
                    /* broadcast from a root that moves with the round */
                    bad = 0;
                    int root = (s + t) % n;
                    x = tp_tensor_data(bc[s]);
                    for (int64_t i = 0; i < k; i++)
                        x[i] = r == root ? persist_value(root, s, t, i) : -1;
                    st = tp_broadcast(world, bc[s], root, NULL);
                    EXPECT(st == TP_OK, "%s: broadcast -> %s (%s)", label, tp_status_name(st),
                           tp_last_error());
                    if (st == TP_OK)
                        persist_block(x, root, s, t, k, &bad);
                    EXPECT(bad == 0, "%s: broadcast from %d: %ld elements wrong", label, root, bad);
                    if (st != TP_OK)
                        break;
                }
            }
            for (int s = 0; s < SETS; s++) {
                tp_tensor_release(ag_s[s]);
                tp_tensor_release(ag_r[s]);
                tp_tensor_release(ip_s[s]);
                tp_tensor_release(ip_r[s]);
                tp_tensor_release(a2a_s[s]);
                tp_tensor_release(a2a_r[s]);
                tp_tensor_release(bc[s]);
            }
        }
    }
}

/* Barriers, zero-element collectives, argument errors, many in flight. */
static void test_misc(tp_comm *world)
{
    int n = tp_comm_size(world), r = tp_comm_rank(world);
    EXPECT_STATUS(tp_barrier(world, NULL), TP_OK, "blocking barrier");
    for (int mode = 1; mode < 3; mode++) {
        tp_work *w = NULL;
        tp_status st = tp_barrier(world, &w);
        EXPECT_STATUS(complete(st, w, mode, "barrier"), TP_OK, mode_names[mode]);
    }
    /* a barrier waits for the last rank to arrive */
    if (n > 1) {
        if (r == n - 1) {
            struct timespec ts = {0, 200 * 1000 * 1000};
            nanosleep(&ts, NULL);
        }
        double t0 = now_s();
        EXPECT_STATUS(tp_barrier(world, NULL), TP_OK, "barrier after a late rank");
        double waited = now_s() - t0;
        if (r != n - 1)
            EXPECT(waited > 0.1, "barrier returned after %.3f s, before the late rank arrived",
                   waited);
    }

    /* zero elements: nothing moves, every form completes */
    int64_t zero = 0, zn = 0;
    tp_tensor *z = NULL, *zr = NULL;
    REQUIRE(tp_tensor_zeros(TP_F32, TP_CPU, 1, &zero, &z));
    REQUIRE(tp_tensor_zeros(TP_F32, TP_CPU, 1, &zn, &zr));
    EXPECT_STATUS(tp_all_reduce(world, z, zr, TP_SUM, NULL), TP_OK, "empty all_reduce");
    tp_work *zw = NULL;
    tp_status zst = tp_all_gather(world, z, zr, &zw);
    EXPECT_STATUS(complete(zst, zw, 1, "empty all_gather"), TP_OK, "empty all_gather");
    tp_tensor_release(z);
    tp_tensor_release(zr);

    /* argument errors are local: every rank gets them, no traffic */
    int64_t four = 4, five = 5;
    tp_tensor *a = NULL, *b = NULL;
    REQUIRE(tp_tensor_zeros(TP_F32, TP_CPU, 1, &four, &a));
    REQUIRE(tp_tensor_zeros(TP_F32, TP_CPU, 1, &five, &b));
    EXPECT_STATUS(tp_all_reduce(world, a, b, TP_SUM, NULL), TP_ERR_INVALID_ARG,
                  "all_reduce of 4 into 5 elements");
    EXPECT_STATUS(tp_broadcast(world, a, n, NULL), TP_ERR_INVALID_ARG, "broadcast root n");
    EXPECT_STATUS(tp_scatter(world, NULL, a, n, NULL), TP_ERR_INVALID_ARG, "scatter root n");
    /* every rank root in its own view: the send checks fail everywhere */
    EXPECT_STATUS(tp_scatter(world, NULL, a, r, NULL), TP_ERR_INVALID_ARG,
                  "scatter without send on root");
    if (n > 1)
        EXPECT_STATUS(tp_scatter(world, a, a, r, NULL), TP_ERR_INVALID_ARG,
                      "scatter of 4 elements to 4 per rank");
    /* zero elements per rank */
    tp_tensor *z0 = NULL, *zs = NULL;
    REQUIRE(tp_tensor_zeros(TP_F32, TP_CPU, 1, &zero, &z0));
    REQUIRE(tp_tensor_zeros(TP_F32, TP_CPU, 1, &zero, &zs));
    EXPECT_STATUS(tp_scatter(world, r == 0 ? zs : NULL, z0, 0, NULL), TP_OK, "empty scatter");
    tp_tensor_release(z0);
    tp_tensor_release(zs);
    tp_tensor_release(a);
    tp_tensor_release(b);

    /* many collectives in flight, completed in reverse order */
    enum { NF = 12 };
    int64_t k = 33, nk = k * n;
    tp_tensor *s[NF] = {0}, *d[NF] = {0};
    tp_work *w[NF] = {0};
    double *v = malloc(sizeof(double) * (size_t)nk), *want = malloc(sizeof(double) * (size_t)nk);
    bool built = true;
    for (int i = 0; i < NF && built; i++) {
        for (int64_t g = 0; g < nk; g++)
            v[g] = (double)(r + i + g % 5);
        tp_status st = from_doubles(TP_F32, nk, v, &s[i]);
        if (st == TP_OK)
            st = tp_tensor_zeros(TP_F32, TP_CPU, 1, i % 3 == 1 ? &k : &nk, &d[i]);
        if (st == TP_OK) {
            tp_tensor *part = NULL;
            switch (i % 3) {
            case 0:
                st = tp_all_reduce(world, s[i], d[i], TP_SUM, &w[i]);
                break;
            case 1:
                st = tp_reduce_scatter(world, s[i], d[i], TP_MAX, &w[i]);
                break;
            default:
                st = tp_tensor_narrow(s[i], 0, 0, k, &part);
                if (st == TP_OK)
                    st = tp_all_gather(world, part, d[i], &w[i]);
                tp_tensor_release(part);
                break;
            }
        }
        EXPECT(st == TP_OK, "in-flight collective %d -> %s (%s)", i, tp_status_name(st),
               tp_last_error());
        built = st == TP_OK;
    }
    for (int i = NF - 1; i >= 0 && built; i--) {
        char label[64];
        snprintf(label, sizeof label, "in-flight collective %d", i);
        tp_status st = tp_work_wait(w[i]);
        EXPECT(st == TP_OK, "%s -> %s (%s)", label, tp_status_name(st), tp_last_error());
        int64_t cnt = i % 3 == 1 ? k : nk;
        for (int64_t g = 0; g < cnt; g++) {
            switch (i % 3) {
            case 0: /* sum over ranks of (q + i + g % 5) */
                want[g] = (double)(n * (n - 1) / 2 + n * (i + g % 5));
                break;
            case 1: /* max over ranks of block r: q + i + (r k + g) % 5 */
                want[g] = (double)(n - 1 + i + ((int64_t)r * k + g) % 5);
                break;
            default: /* block q is rank q's first k elements */
                want[g] = (double)(g / k + i + (g % k) % 5);
                break;
            }
        }
        if (st == TP_OK)
            expect_values(d[i], want, cnt, label);
    }
    for (int i = 0; i < NF; i++) {
        tp_work_free(w[i]);
        tp_tensor_release(s[i]);
        tp_tensor_release(d[i]);
    }
    free(v);
    free(want);
}

/* ---- split ----------------------------------------------------------------- */

/* all_gather of an i64 value per rank of c; want[q] for rank q. */
static void expect_gathered(tp_comm *c, int64_t mine, const int64_t *want, const char *label)
{
    int n = tp_comm_size(c);
    int64_t one = 1, nn = n;
    tp_tensor *s = NULL, *g = NULL;
    tp_status st = tp_tensor_from_data(TP_I64, 1, &one, &mine, &s);
    if (st == TP_OK)
        st = tp_tensor_zeros(TP_I64, TP_CPU, 1, &nn, &g);
    if (st == TP_OK)
        st = tp_all_gather(c, s, g, NULL);
    EXPECT(st == TP_OK, "%s: all_gather -> %s (%s)", label, tp_status_name(st), tp_last_error());
    if (st == TP_OK) {
        double *w = malloc(sizeof(double) * (size_t)n);
        for (int q = 0; q < n; q++)
            w[q] = (double)want[q];
        expect_values(g, w, n, label);
        free(w);
    }
    tp_tensor_release(s);
    tp_tensor_release(g);
}

static void test_split(tp_comm *world)
{
    int n = tp_comm_size(world), r = tp_comm_rank(world);
    int64_t *want = malloc(sizeof(int64_t) * (size_t)n);

    /* parity colors: ranks of one parity, in world order */
    tp_comm *par = NULL;
    REQUIRE(tp_comm_split(world, r % 2, r, &par));
    EXPECT(par && tp_comm_size(par) == (n - r % 2 + 1) / 2 && tp_comm_rank(par) == r / 2,
           "parity split: rank %d of %d, expected %d of %d", tp_comm_rank(par),
           tp_comm_size(par), r / 2, (n - r % 2 + 1) / 2);
    EXPECT(par && strcmp(tp_comm_backend(par), "mpi") == 0, "split comm backend is %s",
           par ? tp_comm_backend(par) : "(null)");
    EXPECT(par && tp_comm_timeout(par) == tp_comm_timeout(world),
           "split comm does not inherit the timeout");
    if (par) {
        for (int q = 0; q < tp_comm_size(par); q++)
            want[q] = 2 * q + r % 2;
        expect_gathered(par, r, want, "parity split: world ranks");
        check_all_reduce(par, TP_I64, TP_SUM, 5, false, 1);
        check_reduce_scatter(par, TP_BF16, TP_AVG, 3, true, 2);

        /* a split of a split: everyone in one group, reversed */
        tp_comm *rev = NULL;
        tp_status st = tp_comm_split(par, 7, -tp_comm_rank(par), &rev);
        EXPECT(st == TP_OK && rev && tp_comm_rank(rev) == tp_comm_size(par) - 1 - tp_comm_rank(par),
               "split of a split -> %s (%s)", tp_status_name(st), tp_last_error());
        if (rev) {
            for (int q = 0; q < tp_comm_size(rev); q++)
                want[q] = 2 * (tp_comm_size(rev) - 1 - q) + r % 2;
            expect_gathered(rev, r, want, "split of a split: world ranks");
        }
        tp_comm_free(rev);
    }
    tp_comm_free(par);

    /* reversed keys: new rank n - 1 - r */
    tp_comm *rv = NULL;
    REQUIRE(tp_comm_split(world, 0, n - r, &rv));
    EXPECT(rv && tp_comm_rank(rv) == n - 1 - r && tp_comm_size(rv) == n,
           "reversed split: rank %d, expected %d", tp_comm_rank(rv), n - 1 - r);
    if (rv) {
        for (int q = 0; q < n; q++)
            want[q] = n - 1 - q;
        expect_gathered(rv, r, want, "reversed split: world ranks");
        check_all_to_all(rv, TP_I32, 3, 0);
    }
    tp_comm_free(rv);

    /* color -1 on rank 0: it takes part and gets NULL */
    tp_comm *nc = world; /* tp_comm_split must overwrite it */
    REQUIRE(tp_comm_split(world, r == 0 ? TP_COMM_NO_COLOR : 3, 0, &nc));
    if (r == 0) {
        EXPECT(nc == NULL, "color -1: got a communicator");
    } else {
        EXPECT(nc && tp_comm_size(nc) == n - 1 && tp_comm_rank(nc) == r - 1,
               "color -1 split: rank %d of %d, expected %d of %d", tp_comm_rank(nc),
               tp_comm_size(nc), r - 1, n - 1);
        if (nc) {
            for (int q = 0; q < n - 1; q++)
                want[q] = q + 1;
            expect_gathered(nc, r, want, "color -1 split: world ranks");
            check_broadcast(nc, TP_F16, 9, 0, 1);
        }
        tp_comm_free(nc);
    }
    free(want);
}

/* ---- aborts ---------------------------------------------------------------- */

/* An allocator that fails while g_fail_alloc is set, or for sizes of at
 * least g_fail_from bytes when that is not 0; its memory is plain malloc
 * memory, like the default allocator's. */
static bool g_fail_alloc;
static size_t g_fail_from;

static void *test_alloc(void *ctx, size_t size, size_t alignment)
{
    (void)ctx;
    void *p = NULL;
    if (g_fail_alloc || (g_fail_from && size >= g_fail_from))
        return NULL;
    if (alignment < sizeof(void *))
        alignment = sizeof(void *);
    return posix_memalign(&p, alignment, size ? size : 1) == 0 ? p : NULL;
}

static void test_free(void *ctx, void *ptr)
{
    (void)ctx;
    free(ptr);
}

static void test_abort(tp_comm *world)
{
    int n = tp_comm_size(world), r = tp_comm_rank(world);
    const char *env = getenv("TP_MPI_ABORT_ON_FAILURE");
    if (env && strcmp(env, "1") == 0)
        return; /* aborting would end the job */
    int64_t k = 4;
    tp_tensor *x = NULL;
    REQUIRE(tp_tensor_zeros(TP_F32, TP_CPU, 1, &k, &x));

    /* pending work on a communicator this rank aborts returns TP_ERR_ABORTED;
     * only rank 0 posts, so nothing completes it */
    tp_comm *a = NULL;
    REQUIRE(tp_comm_split(world, 0, r, &a));
    if (r == 0 && n > 1) {
        tp_work *w = NULL;
        EXPECT_STATUS(tp_all_reduce(a, x, x, TP_SUM, &w), TP_OK, "posting before the abort");
        tp_comm_abort(a, "abort test");
        EXPECT(tp_comm_is_aborted(a), "tp_comm_is_aborted after tp_comm_abort");
        if (w) {
            EXPECT_STATUS(tp_work_wait(w), TP_ERR_ABORTED, "pending work after an abort");
            EXPECT(strstr(tp_last_error(), "abort test") != NULL,
                   "the abort reason is not in the message: %s", tp_last_error());
            tp_work_free(w);
        }
        EXPECT_STATUS(tp_barrier(a, NULL), TP_ERR_ABORTED, "a collective after an abort");
        tp_comm *sub = NULL;
        EXPECT_STATUS(tp_comm_split(a, 0, 0, &sub), TP_ERR_ABORTED, "split after an abort");
    }
    tp_comm_free(a);

    /* a peer learns of an abort only by timing out */
    REQUIRE(tp_comm_split(world, 0, r, &a));
    if (n > 1) {
        if (r == 0) {
            tp_comm_abort(a, "rank 0 gave up");
            EXPECT_STATUS(tp_all_reduce(a, x, x, TP_SUM, NULL), TP_ERR_ABORTED,
                          "all_reduce on the aborting rank");
        } else {
            REQUIRE(tp_comm_set_timeout(a, 1.0));
            double t0 = now_s();
            EXPECT_STATUS(tp_all_reduce(a, x, x, TP_SUM, NULL), TP_ERR_TIMEOUT,
                          "all_reduce without rank 0");
            double waited = now_s() - t0;
            EXPECT(waited >= 0.9 && waited < 30, "timed out after %.2f s, limit 1 s", waited);
            EXPECT(tp_comm_is_aborted(a), "a timed-out communicator is not aborted");
            EXPECT_STATUS(tp_barrier(a, NULL), TP_ERR_ABORTED, "a collective after a timeout");
        }
    }
    tp_comm_free(a);

    /* a scatter whose root aborted and never posts: the others time out */
    REQUIRE(tp_comm_split(world, 0, r, &a));
    if (n > 1) {
        if (r == 0) {
            int64_t kn = k * n;
            tp_tensor *xs = NULL;
            REQUIRE(tp_tensor_zeros(TP_F32, TP_CPU, 1, &kn, &xs));
            tp_comm_abort(a, "the root gave up");
            EXPECT_STATUS(tp_scatter(a, xs, x, 0, NULL), TP_ERR_ABORTED,
                          "scatter on the aborting root");
            EXPECT(strstr(tp_last_error(), "the root gave up") != NULL,
                   "the abort reason is not in the message: %s", tp_last_error());
            tp_tensor_release(xs);
        } else {
            REQUIRE(tp_comm_set_timeout(a, 1.0));
            double t0 = now_s();
            EXPECT_STATUS(tp_scatter(a, NULL, x, 0, NULL), TP_ERR_TIMEOUT,
                          "scatter without its root");
            double waited = now_s() - t0;
            EXPECT(waited >= 0.9 && waited < 30, "scatter timed out after %.2f s, limit 1 s",
                   waited);
            EXPECT(tp_comm_is_aborted(a), "a timed-out communicator is not aborted");
        }
    }
    tp_comm_free(a);

    /* a blocking call keeps its work on the stack: where it needs no
     * scratch (MPI's own collective: one rank, or the direct path and the
     * ring off) it allocates nothing at all */
    const char *dbe = getenv("TP_MPI_DIRECT_BYTES"), *rge = getenv("TP_MPI_RING");
    bool own_mpi = n == 1 || (dbe && strcmp(dbe, "0") == 0 && rge && strcmp(rge, "0") == 0);
    tp_allocator failing = {test_alloc, test_free, NULL};
    tp_status st = TP_OK;
    if (own_mpi) {
        REQUIRE(tp_comm_split(world, 0, r, &a));
        REQUIRE(tp_set_allocator(&failing));
        g_fail_alloc = true;
        st = tp_all_reduce(a, x, x, TP_SUM, NULL);
        g_fail_alloc = false;
        REQUIRE(tp_set_allocator(NULL));
        EXPECT(st == TP_OK, "a blocking all_reduce allocated: %s (%s)", tp_status_name(st),
               tp_last_error());
        tp_comm_free(a);
    }

    /* a rank that runs out of memory skips the collective: its communicator
     * is out of step and aborted (every rank fails here, so none waits).
     * Here the backend's work object of an async call fails (it is larger
     * than 128 bytes; the handle tp_all_reduce allocates first is not) */
    REQUIRE(tp_comm_split(world, 0, r, &a));
    REQUIRE(tp_set_allocator(&failing));
    g_fail_from = 128;
    tp_work *wk = NULL;
    st = tp_all_reduce(a, x, x, TP_SUM, &wk);
    g_fail_from = 0;
    REQUIRE(tp_set_allocator(NULL));
    EXPECT(st == TP_ERR_NO_MEMORY && strstr(tp_last_error(), "out of memory for the work object"),
           "async all_reduce without memory -> %s (%s)", tp_status_name(st), tp_last_error());
    EXPECT(wk == NULL, "a failed call handed out work");
    EXPECT_STATUS(tp_barrier(a, NULL), TP_ERR_ABORTED, "a collective after an allocation failed");
    tp_comm_free(a);

    /* the work object allocates, buffers of a ring block's size (64 Ki
     * floats over n) and more do not: an in-place all_reduce fails where
     * libtp needs scratch of its own (the ring's blocks, the direct path's
     * contributions) and completes through MPI's own call otherwise */
    if (n > 1) {
        int64_t big = 65536;
        tp_tensor *z = NULL;
        REQUIRE(tp_tensor_zeros(TP_F32, TP_CPU, 1, &big, &z));
        const char *de = getenv("TP_MPI_DIRECT_BYTES"), *re = getenv("TP_MPI_RING");
        unsigned long long lim = de && *de ? strtoull(de, NULL, 10) : 32768;
        bool direct = lim > 0 && ((g_apart && big * 4 <= (4 << 20)) ||
                                  (unsigned long long)(n - 1) * (unsigned long long)big * 4 <= lim);
        bool ring = !direct && !(re && strcmp(re, "0") == 0);
        REQUIRE(tp_comm_split(world, 0, r, &a));
        REQUIRE(tp_set_allocator(&failing));
        g_fail_from = (size_t)((big + n - 1) / n) * 4;
        st = tp_all_reduce(a, z, z, TP_SUM, NULL);
        g_fail_from = 0;
        REQUIRE(tp_set_allocator(NULL));
        const char *what = direct ? "out of memory for the direct path's messages"
                           : ring ? "out of memory for the ring's blocks"
                                  : NULL;
        if (what) {
            EXPECT(st == TP_ERR_NO_MEMORY && strstr(tp_last_error(), what),
                   "large all_reduce without scratch -> %s (%s), expected '%s'", tp_status_name(st),
                   tp_last_error(), what);
            EXPECT_STATUS(tp_barrier(a, NULL), TP_ERR_ABORTED,
                          "a collective after the scratch allocation failed");
        } else {
            EXPECT_STATUS(st, TP_OK, "large all_reduce through MPI's call, scratch refused");
        }
        tp_comm_free(a);
        tp_tensor_release(z);
    }

    tp_tensor_release(x);
    /* the world is unaffected */
    check_all_reduce(world, TP_F32, TP_SUM, 7, false, 0);
}

/* ---- descriptor check ---------------------------------------------------------- */

static void test_check(tp_comm *world)
{
    int n = tp_comm_size(world), r = tp_comm_rank(world);
    REQUIRE(tp_comm_set_check(world, true));
    check_all_reduce(world, TP_F32, TP_SUM, 8, false, 0);
    check_all_gather(world, TP_BF16, 5, true, 1);
    int64_t k = 8, k1 = 9;
    tp_tensor *x = NULL, *y = NULL;
    REQUIRE(tp_tensor_zeros(TP_F32, TP_CPU, 1, &k, &x));
    REQUIRE(tp_tensor_zeros(TP_F32, TP_CPU, 1, &k1, &y));
    tp_status want = n > 1 ? TP_ERR_MISMATCH : TP_OK;
    /* the last rank's count differs */
    tp_tensor *mine = r == n - 1 ? y : x;
    tp_status st = tp_all_reduce(world, mine, mine, TP_SUM, NULL);
    EXPECT(st == want, "mismatched count -> %s, expected %s (%s)", tp_status_name(st),
           tp_status_name(want), tp_last_error());
    if (n > 1)
        EXPECT(strstr(tp_last_error(), "disagree") && strstr(tp_last_error(), "9 elements"),
               "mismatch message: %s", tp_last_error());
    /* the last rank's op differs, async */
    tp_work *w = NULL;
    st = tp_all_reduce(world, x, x, r == n - 1 ? TP_MAX : TP_SUM, &w);
    st = complete(st, w, 1, "mismatched op");
    EXPECT(st == want, "mismatched op -> %s, expected %s (%s)", tp_status_name(st),
           tp_status_name(want), tp_last_error());
    EXPECT(!tp_comm_is_aborted(world), "a mismatch aborted the communicator");
    /* the last rank names another scatter root (send is read on root only) */
    int64_t kn = k * n;
    tp_tensor *xs = NULL;
    REQUIRE(tp_tensor_zeros(TP_F32, TP_CPU, 1, &kn, &xs));
    st = tp_scatter(world, xs, x, r == n - 1 ? n - 1 : 0, NULL);
    tp_status want_root = n > 1 ? TP_ERR_MISMATCH : TP_OK;
    EXPECT(st == want_root, "mismatched scatter root -> %s, expected %s (%s)",
           tp_status_name(st), tp_status_name(want_root), tp_last_error());
    if (n > 1) {
        char root_needle[64];
        snprintf(root_needle, sizeof root_needle, "scatter(f32, 8 elements, root %d)", n - 1);
        EXPECT(strstr(tp_last_error(), root_needle), "scatter mismatch message: %s",
               tp_last_error());
    }
    tp_tensor_release(xs);
    /* still usable */
    check_reduce_scatter(world, TP_I32, TP_MIN, 4, false, 2);
    REQUIRE(tp_comm_set_check(world, false));
    tp_tensor_release(x);
    tp_tensor_release(y);
}

/* ---- meshes ------------------------------------------------------------------ */

static void check_mesh(tp_comm *world, int ndim, const int64_t *shape)
{
    int r = tp_comm_rank(world);
    char label[96];
    int p = snprintf(label, sizeof label, "mesh (");
    for (int d = 0; d < ndim; d++)
        p += snprintf(label + p, sizeof label - (size_t)p, "%s%lld", d ? ", " : "",
                      (long long)shape[d]);
    snprintf(label + p, sizeof label - (size_t)p, ")");
    static const char *const names[] = {"dp", "tp", "pp"};
    tp_mesh *mesh = NULL;
    REQUIRE(tp_mesh_create(world, ndim, shape, names, &mesh));
    /* coordinates, row-major */
    int64_t coord[3], rem = r;
    for (int d = ndim - 1; d >= 0; d--) {
        coord[d] = rem % shape[d];
        rem /= shape[d];
    }
    for (int d = 0; d < ndim; d++)
        EXPECT(tp_mesh_coord(mesh, d) == coord[d], "%s: coord %d is %lld, expected %lld", label,
               d, (long long)tp_mesh_coord(mesh, d), (long long)coord[d]);
    for (int d = 0; d < ndim; d++) {
        tp_comm *c = tp_mesh_comm(mesh, d);
        EXPECT(c && tp_comm_size(c) == shape[d] && tp_comm_rank(c) == coord[d],
               "%s: dim %d comm has rank %d of %d", label, d, tp_comm_rank(c),
               tp_comm_size(c));
        if (!c)
            continue;
        /* world ranks along dim d, in coordinate order */
        int64_t stride = 1;
        for (int e = d + 1; e < ndim; e++)
            stride *= shape[e];
        int64_t base = r - coord[d] * stride, sum = 0;
        int64_t *want = malloc(sizeof(int64_t) * (size_t)shape[d]);
        for (int64_t q = 0; q < shape[d]; q++) {
            want[q] = base + q * stride;
            sum += want[q] + 1;
        }
        char l2[128];
        snprintf(l2, sizeof l2, "%s dim %s: world ranks", label, names[d]);
        expect_gathered(c, r, want, l2);
        /* all_reduce sum of (world rank + 1) along the dim */
        int64_t one = 1, mine = r + 1;
        tp_tensor *t = NULL;
        tp_status st = tp_tensor_from_data(TP_I64, 1, &one, &mine, &t);
        if (st == TP_OK)
            st = tp_all_reduce(c, t, t, TP_SUM, NULL);
        double got = 0, wantd = (double)sum;
        if (st == TP_OK)
            st = to_doubles(t, &got);
        EXPECT(st == TP_OK && got == wantd, "%s dim %s: all_reduce gave %g, expected %g (%s)",
               label, names[d], got, wantd, tp_status_name(st));
        tp_tensor_release(t);
        free(want);
    }
    /* the slice of the last dim is a 1-D mesh of its own */
    tp_mesh *sl = NULL;
    const char *last = names[ndim - 1];
    tp_status st = tp_mesh_slice(mesh, 1, &last, &sl);
    EXPECT(st == TP_OK && sl && tp_mesh_size(sl, 0) == shape[ndim - 1],
           "%s: slice %s -> %s (%s)", label, last, tp_status_name(st), tp_last_error());
    if (sl)
        check_all_reduce(tp_mesh_group(sl), TP_F16, TP_SUM, 6, true, 2);
    tp_mesh_free(sl);
    tp_mesh_free(mesh);
}

static void test_mesh(tp_comm *world)
{
    int64_t n = tp_comm_size(world);
    check_mesh(world, 1, (int64_t[]){n});
    check_mesh(world, 2, (int64_t[]){n, 1});
    check_mesh(world, 2, (int64_t[]){1, n});
    if (n % 2 == 0 && n > 2)
        check_mesh(world, 2, (int64_t[]){2, n / 2});
    if (n == 4)
        check_mesh(world, 3, (int64_t[]){2, 1, 2});
}

/* ---- DTensor ----------------------------------------------------------------- */

static void expect_equal_tensors(const tp_tensor *a, const tp_tensor *b, const char *label)
{
    bool eq = false;
    tp_status st = a && b ? tp_tensor_equal(a, b, &eq) : TP_ERR_INVALID_ARG;
    EXPECT(st == TP_OK && eq, "%s: tensors differ (%s)", label, tp_status_name(st));
}

static void check_dtensor(tp_mesh *mesh, int64_t rows, int64_t cols)
{
    int n = (int)tp_mesh_size(mesh, 0), r = (int)tp_mesh_coord(mesh, 0);
    char label[96];
    snprintf(label, sizeof label, "dtensor %lldx%lld", (long long)rows, (long long)cols);
    int64_t shape[2] = {rows, cols};
    tp_tensor *full = NULL, *src = NULL, *dt = NULL, *dt1 = NULL, *back = NULL, *ch = NULL;
    tp_comm_debug *dbg = NULL;
    REQUIRE(tp_tensor_zeros(TP_F32, TP_CPU, 2, shape, &full));
    float *f = tp_tensor_data(full);
    for (int64_t i = 0; i < rows * cols; i++)
        f[i] = (float)i;
    /* only rank 0's value counts: the others pass zeros */
    if (r == 0)
        src = tp_tensor_retain(full);
    else
        REQUIRE(tp_tensor_zeros(TP_F32, TP_CPU, 2, shape, &src));
    tp_placement s0 = tp_shard(0), s1 = tp_shard(1);
    REQUIRE(tp_dtensor_distribute(mesh, src, 1, &s0, 0, &dt));
    REQUIRE(tp_tensor_chunk(full, n, 0, r, &ch));
    expect_equal_tensors(tp_dtensor_local(dt), ch, label);
    tp_tensor_release(ch);
    ch = NULL;
    REQUIRE(tp_dtensor_full_tensor(dt, &back));
    expect_equal_tensors(back, full, "S(0) full_tensor");
    tp_tensor_release(back);
    back = NULL;

    /* S(0) -> S(1): one all_to_all */
    REQUIRE(tp_comm_debug_create(&dbg));
    REQUIRE(tp_comm_debug_begin(dbg));
    tp_status st = tp_dtensor_redistribute(dt, 1, &s1, &dt1);
    REQUIRE(tp_comm_debug_end(dbg));
    REQUIRE(st);
    EXPECT(tp_comm_debug_count(dbg, TP_COLL_ALL_TO_ALL) == (n > 1) &&
               tp_comm_debug_total(dbg) == (n > 1),
           "%s: S(0) -> S(1) issued %lld all_to_all of %lld collectives", label,
           (long long)tp_comm_debug_count(dbg, TP_COLL_ALL_TO_ALL),
           (long long)tp_comm_debug_total(dbg));
    REQUIRE(tp_tensor_chunk(full, n, 1, r, &ch));
    tp_tensor *chc = NULL;
    REQUIRE(tp_tensor_clone(ch, &chc));
    expect_equal_tensors(tp_dtensor_local(dt1), chc, "S(1) local shard");
    tp_tensor_release(chc);
    REQUIRE(tp_dtensor_full_tensor(dt1, &back));
    expect_equal_tensors(back, full, "S(1) full_tensor");

    /* Partial(sum) -> Replicate: an all_reduce */
    tp_tensor *loc = NULL, *pd = NULL, *rep = NULL, *want = NULL;
    REQUIRE(tp_tensor_zeros(TP_F32, TP_CPU, 2, shape, &loc));
    REQUIRE(tp_tensor_fill(loc, r + 1));
    tp_placement p = tp_partial(TP_SUM), rr = tp_replicate();
    REQUIRE(tp_dtensor_from_local(mesh, loc, 1, &p, NULL, &pd));
    REQUIRE(tp_dtensor_redistribute(pd, 1, &rr, &rep));
    REQUIRE(tp_tensor_zeros(TP_F32, TP_CPU, 2, shape, &want));
    REQUIRE(tp_tensor_fill(want, n * (n + 1) / 2));
    expect_equal_tensors(tp_dtensor_local(rep), want, "P(sum) -> R");
    tp_tensor_release(loc);
    tp_tensor_release(pd);
    tp_tensor_release(rep);
    tp_tensor_release(want);

    tp_comm_debug_free(dbg);
    tp_tensor_release(ch);
    tp_tensor_release(back);
    tp_tensor_release(dt1);
    tp_tensor_release(dt);
    tp_tensor_release(src);
    tp_tensor_release(full);
}

static void test_dtensor(tp_comm *world)
{
    int64_t n = tp_comm_size(world);
    tp_mesh *mesh = NULL;
    REQUIRE(tp_mesh_create(world, 1, &n, NULL, &mesh));
    check_dtensor(mesh, 4 * n, 2 * n);
    check_dtensor(mesh, 2 * n + 1, 3 * n - 1); /* uneven shards on both dims */
    tp_mesh_free(mesh);
}

/* ---- parallel styles ---------------------------------------------------------- */

/* Linear(10, 16) -> ReLU -> Linear(16, 10), parallelized on mesh unless NULL
 * (net1 Colwise, net2 Rowwise; sequence parallel: input S(0), output S(0)). */
static tp_status make_mlp(tp_mesh *mesh, bool seq, tp_module **out)
{
    tp_module *m = NULL, *a = NULL, *relu = NULL, *b = NULL;
    tp_status st = tp_nn_sequential_create(&m);
    if (st != TP_OK)
        return st;
    if ((st = tp_nn_linear_create(10, 16, true, &a)) == TP_OK &&
        (st = tp_module_add_child(m, "net1", a)) != TP_OK)
        tp_module_free(a);
    if (st == TP_OK && (st = tp_nn_relu_create(&relu)) == TP_OK &&
        (st = tp_module_add_child(m, "relu", relu)) != TP_OK)
        tp_module_free(relu);
    if (st == TP_OK && (st = tp_nn_linear_create(16, 10, true, &b)) == TP_OK &&
        (st = tp_module_add_child(m, "net2", b)) != TP_OK)
        tp_module_free(b);
    if (st == TP_OK)
        st = tp_module_init(m, 5);
    if (st == TP_OK && mesh) {
        tp_style *cs = NULL, *rs = NULL;
        tp_colwise_options co = {0};
        tp_rowwise_options ro = {0};
        if (seq) {
            co.input_layouts = tp_layout_of(tp_shard(0));
            ro.output_layouts = tp_layout_of(tp_shard(0));
        }
        st = tp_colwise_parallel_create(&co, &cs);
        if (st == TP_OK)
            st = tp_rowwise_parallel_create(&ro, &rs);
        if (st == TP_OK) {
            tp_plan_entry plan[2] = {{"net1", cs}, {"net2", rs}};
            st = tp_parallelize_module(m, mesh, 2, plan, NULL);
        }
        tp_style_free(cs);
        tp_style_free(rs);
    }
    if (st != TP_OK) {
        tp_module_free(m);
        return st;
    }
    *out = m;
    return TP_OK;
}

static void expect_close(const tp_tensor *a, const tp_tensor *b, const char *label)
{
    bool ok = false;
    double diff = -1;
    tp_status st = a && b ? tp_tensor_allclose(a, b, 1e-4, 1e-5, &ok) : TP_ERR_INVALID_ARG;
    if (st == TP_OK)
        tp_tensor_max_abs_diff(a, b, &diff);
    EXPECT(st == TP_OK && ok, "%s differs from the plain module (max |diff| %g, %s)", label,
           diff, tp_status_name(st));
}

static void test_styles(tp_comm *world)
{
    int64_t n = tp_comm_size(world), w = n;
    tp_mesh *mesh = NULL;
    tp_module *ref = NULL, *par = NULL;
    tp_tensor *x = NULL, *yr = NULL, *yp = NULL, *lr = NULL, *lp = NULL;
    tp_comm_debug *dbg = NULL;
    REQUIRE(tp_mesh_create(world, 1, &n, NULL, &mesh));
    REQUIRE(tp_comm_debug_create(&dbg));
    REQUIRE(tp_tensor_zeros(TP_F32, TP_CPU, 2, (int64_t[]){8, 10}, &x));
    REQUIRE(tp_tensor_fill_random(x, TP_RNG_UNIFORM, -1, 1, 12, NULL, NULL));
    REQUIRE(make_mlp(NULL, false, &ref));
    REQUIRE(make_mlp(mesh, false, &par));

    REQUIRE(tp_module_call(ref, x, &yr));
    REQUIRE(tp_sum_all(yr, &lr));
    REQUIRE(tp_backward(lr, NULL));

    REQUIRE(tp_comm_debug_begin(dbg));
    tp_status st = tp_module_call(par, x, &yp);
    if (st == TP_OK)
        st = tp_sum_all(yp, &lp);
    if (st == TP_OK)
        st = tp_backward(lp, NULL);
    REQUIRE(tp_comm_debug_end(dbg));
    REQUIRE(st);
    expect_close(yp, yr, "MLP forward output");
    /* DESIGN.md: forward + backward = all_reduce 1 */
    EXPECT(tp_comm_debug_count(dbg, TP_COLL_ALL_REDUCE) == (w > 1) &&
               tp_comm_debug_total(dbg) == (w > 1) &&
               tp_comm_debug_module_count(dbg, TP_COMM_DEBUG_GLOBAL, TP_PHASE_FORWARD,
                                          TP_COLL_ALL_REDUCE) == (w > 1),
           "MLP comm counts: %lld all_reduce of %lld collectives",
           (long long)tp_comm_debug_count(dbg, TP_COLL_ALL_REDUCE),
           (long long)tp_comm_debug_total(dbg));
    /* by plan FQN, checked: a scope never seen would be an error, not 0 */
    int64_t net2_ar = -1;
    tp_status net2_st = tp_comm_debug_scope_count(dbg, "net2", TP_PHASE_COUNT,
                                                  TP_COLL_ALL_REDUCE, &net2_ar);
    EXPECT(net2_st == TP_OK && net2_ar == (w > 1),
           "MLP: net2's all_reduce count is %lld (%s: %s), expected %d", (long long)net2_ar,
           tp_status_name(net2_st), tp_last_error(), (int)(w > 1));
    static const char *const mods[] = {"net1", "net2"}, *const params[] = {"weight", "bias"};
    for (int i = 0; i < 2; i++) {
        for (int j = 0; j < 2; j++) {
            tp_tensor *pr = tp_module_parameter(tp_module_child(ref, mods[i]), params[j]);
            tp_tensor *pp = tp_module_parameter(tp_module_child(par, mods[i]), params[j]);
            tp_tensor *gp = pp ? tp_tensor_grad(pp) : NULL, *gf = NULL;
            char label[64];
            snprintf(label, sizeof label, "MLP %s.%s gradient", mods[i], params[j]);
            if (!gp || !pr || !tp_tensor_grad(pr)) {
                EXPECT(0, "%s: missing", label);
                continue;
            }
            st = tp_tensor_is_dtensor(gp) ? tp_dtensor_full_tensor(gp, &gf)
                                          : tp_tensor_clone(gp, &gf);
            EXPECT(st == TP_OK, "%s: full_tensor -> %s", label, tp_status_name(st));
            if (st == TP_OK)
                expect_close(gf, tp_tensor_grad(pr), label);
            tp_tensor_release(gf);
        }
    }
    tp_tensor_release(yp);
    tp_tensor_release(lp);
    yp = lp = NULL;
    tp_module_free(par);
    par = NULL;

    /* sequence parallel: all_gather 2, reduce_scatter 1 */
    REQUIRE(make_mlp(mesh, true, &par));
    REQUIRE(tp_comm_debug_begin(dbg));
    st = tp_module_call(par, x, &yp);
    if (st == TP_OK)
        st = tp_sum_all(yp, &lp);
    if (st == TP_OK)
        st = tp_backward(lp, NULL);
    REQUIRE(tp_comm_debug_end(dbg));
    REQUIRE(st);
    EXPECT(tp_comm_debug_count(dbg, TP_COLL_ALL_GATHER) == 2 * (w > 1) &&
               tp_comm_debug_count(dbg, TP_COLL_REDUCE_SCATTER) == (w > 1) &&
               tp_comm_debug_total(dbg) == 3 * (w > 1),
           "sequence-parallel MLP: %lld all_gather, %lld reduce_scatter of %lld",
           (long long)tp_comm_debug_count(dbg, TP_COLL_ALL_GATHER),
           (long long)tp_comm_debug_count(dbg, TP_COLL_REDUCE_SCATTER),
           (long long)tp_comm_debug_total(dbg));

    tp_tensor_release(yp);
    tp_tensor_release(lp);
    tp_tensor_release(yr);
    tp_tensor_release(lr);
    tp_tensor_release(x);
    tp_module_free(par);
    tp_module_free(ref);
    tp_comm_debug_free(dbg);
    tp_mesh_free(mesh);
}

/* ---- main -------------------------------------------------------------------- */

int main(int argc, char **argv)
{
    bool user_init = argc > 1 && strcmp(argv[1], "--user-init") == 0;
    MPI_Comm mine = MPI_COMM_NULL;
    MPI_Request probe = MPI_REQUEST_NULL;
    int probe_buf = 0, mpi_rank = 0, mpi_size = 0;
    if (user_init) {
        /* the program owns MPI and gives libtp a communicator of its own,
         * with the ranks reversed */
        int provided = 0;
        MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
        MPI_Comm_rank(MPI_COMM_WORLD, &mpi_rank);
        MPI_Comm_size(MPI_COMM_WORLD, &mpi_size);
        MPI_Comm_split(MPI_COMM_WORLD, 0, mpi_size - 1 - mpi_rank, &mine);
        /* libtp's traffic must never match the program's receives */
        MPI_Irecv(&probe_buf, 1, MPI_INT, MPI_ANY_SOURCE, MPI_ANY_TAG, mine, &probe);
    }
    tp_comm *world = NULL;
    tp_status st = tp_comm_create_world("mpi", user_init ? &mine : NULL, &world);
    if (st != TP_OK) {
        fprintf(stderr, "tp_comm_create_world(\"mpi\") -> %s (%s)\n", tp_status_name(st),
                tp_last_error());
        return 1;
    }
    g_rank = tp_comm_rank(world);
    g_size = tp_comm_size(world);
    int inited = 0;
    MPI_Initialized(&inited);
    EXPECT(inited, "MPI is not initialized after tp_comm_create_world");
    if (!user_init) {
        MPI_Comm_rank(MPI_COMM_WORLD, &mpi_rank);
        MPI_Comm_size(MPI_COMM_WORLD, &mpi_size);
    }
    EXPECT(g_size == mpi_size, "world size %d, MPI says %d", g_size, mpi_size);
    MPI_Comm node = MPI_COMM_NULL;
    int on_node = 0;
    if (MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node) ==
        MPI_SUCCESS) {
        MPI_Comm_size(node, &on_node);
        MPI_Comm_free(&node);
    }
    g_apart = g_size == 2 && on_node == 1;
    int want_rank = user_init ? mpi_size - 1 - mpi_rank : mpi_rank;
    EXPECT(g_rank == want_rank, "world rank %d, expected %d", g_rank, want_rank);
    EXPECT(strcmp(tp_comm_backend(world), "mpi") == 0, "backend %s", tp_comm_backend(world));
    EXPECT_STATUS(tp_comm_set_timeout(world, 60), TP_OK, "timeout");

    double t0 = now_s();
    test_collectives(world);
    test_same_bits(world);
    test_persistent(world);
    test_misc(world);
    test_split(world);
    test_abort(world);
    test_check(world);
    test_mesh(world);
    test_dtensor(world);
    test_styles(world);
    double secs = now_s() - t0;

    if (user_init) {
        int flag = 0;
        MPI_Test(&probe, &flag, MPI_STATUS_IGNORE);
        EXPECT(!flag, "the program's MPI_Irecv matched a message of libtp");
        if (!flag) {
            MPI_Cancel(&probe);
            MPI_Wait(&probe, MPI_STATUS_IGNORE);
        }
    }
    long local[2] = {g_pass, g_fail}, total[2] = {0, 0};
    MPI_Allreduce(local, total, 2, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
    if (mpi_rank == 0) {
        fprintf(stderr, "(%d ranks, %s, %.2f s)\n", mpi_size,
                user_init ? "MPI initialized by the program" : "MPI initialized by libtp", secs);
        printf("mpi: %ld passed, %ld failed\n", total[0], total[1]);
        fflush(stdout);
    }
    tp_comm_free(world);
    int fin = 0;
    MPI_Finalized(&fin);
    int rc = total[1] != 0;
    if (user_init) {
        if (fin) {
            fprintf(stderr, "[rank %d] FAIL: libtp finalized the program's MPI\n", g_rank);
            rc = 1;
        } else {
            MPI_Comm_free(&mine);
            MPI_Finalize();
        }
    } else if (!fin) {
        fprintf(stderr, "[rank %d] FAIL: MPI is not finalized after the world was freed\n",
                g_rank);
        MPI_Finalize();
        rc = 1;
    }
    return rc;
}
