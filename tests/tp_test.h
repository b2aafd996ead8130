/* Shared helpers for the Criterion tests.
 *
 * Rank threads never call cr_assert (Criterion's failure path longjmps to the
 * test's main thread). Each rank records its first failed expectation in its
 * own slot; the main thread asserts on the slots after tp_run_local returns. */
#ifndef TP_TEST_H
#define TP_TEST_H

#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <tp.h>

#define TP_TEST_MAX_RANKS 16

typedef struct tp_test_slot {
    int failed;
    char msg[512];
} tp_test_slot;

/* Inside a rank: records the first failure of `cond` with a message. */
#define RANK_EXPECT(slot, cond, ...)                                            \
    do {                                                                        \
        if (!(cond) && !(slot)->failed) {                                       \
            (slot)->failed = 1;                                                 \
            snprintf((slot)->msg, sizeof (slot)->msg, __VA_ARGS__);             \
        }                                                                       \
    } while (0)

/* Inside a rank: a tp_status call that must succeed; on failure records it and
 * returns the status from the rank function. */
#define RANK_OK(slot, expr)                                                     \
    do {                                                                        \
        tp_status rank_ok_st_ = (expr);                                         \
        if (rank_ok_st_ != TP_OK) {                                             \
            RANK_EXPECT(slot, 0, "%s failed: %s (%s)", #expr,                   \
                        tp_status_name(rank_ok_st_), tp_last_error());          \
            return rank_ok_st_;                                                 \
        }                                                                       \
    } while (0)

/* In a helper returning tp_status: propagate a failure. */
#define TP_TEST_TRY(expr)                                                       \
    do {                                                                        \
        tp_status try_st_ = (expr);                                             \
        if (try_st_ != TP_OK)                                                   \
            return try_st_;                                                     \
    } while (0)

/* Main thread only: a call that must succeed. */
#define CHECK_OK(expr)                                                          \
    do {                                                                        \
        tp_status check_ok_st_ = (expr);                                        \
        cr_assert_eq(check_ok_st_, TP_OK, "%s -> %s (%s)", #expr,               \
                     tp_status_name(check_ok_st_), tp_last_error());            \
    } while (0)

/* Main thread only: a call that must fail with `code` and leave a message. */
#define CHECK_ERR(expr, code)                                                   \
    do {                                                                        \
        tp_clear_error();                                                       \
        tp_status check_err_st_ = (expr);                                       \
        cr_assert_eq(check_err_st_, (code), "%s -> %s, expected %s (%s)", #expr, \
                     tp_status_name(check_err_st_), tp_status_name(code),       \
                     tp_last_error());                                          \
        cr_assert_neq(tp_last_error()[0], '\0', "%s left no message", #expr);   \
    } while (0)

/* Runs `fn` on n rank threads, then asserts every slot and the run's status. */
static inline void tp_test_run(int n, tp_rank_fn fn, void *arg, const tp_test_slot *slots);

/* Main thread: every slot passed. */
static inline void tp_test_assert_slots(const tp_test_slot *slots, int n)
{
    for (int r = 0; r < n; r++)
        cr_assert(!slots[r].failed, "rank %d: %s", r, slots[r].msg);
}

#ifndef TP_TEST_MPI
static inline void tp_test_run(int n, tp_rank_fn fn, void *arg, const tp_test_slot *slots)
{
    tp_status st = tp_run_local(n, fn, arg);
    tp_test_assert_slots(slots, n);
    cr_assert_eq(st, TP_OK, "%s", tp_last_error());
}

/* Ranks whose state lives in this process: all of them as threads. */
static inline bool tp_test_rank_is_local(int r)
{
    (void)r;
    return true;
}
#else
/*
 * The same tests as MPI programs (tests/meson.build builds them with
 * -DTP_TEST_MPI against tests/shim and runs them under mpirun): every process
 * runs every test, and tp_test_run(n, ...) runs fn once per process on a group
 * of the first n processes of the "mpi" world (a tp_comm_split), instead of on
 * n threads. A test needing more ranks than mpirun started is skipped, with a
 * message. Each process only holds its own rank's slot, so the ranks agree on
 * the outcome through the world: every process then fails (or passes) the
 * test with the first failing rank's message, and all of them go on to the
 * next test together.
 */
static tp_comm *tp_test_mpi_world_;

static inline void tp_test_mpi_fini_(void)
{
    tp_comm_free(tp_test_mpi_world_); /* the last mpi comm: libtp finalizes MPI */
    tp_test_mpi_world_ = NULL;
}

static inline tp_comm *tp_test_mpi_world(void)
{
    if (!tp_test_mpi_world_) {
        tp_status st = tp_comm_create_world("mpi", NULL, &tp_test_mpi_world_);
        cr_assert_eq(st, TP_OK, "tp_comm_create_world(\"mpi\") -> %s (%s)", tp_status_name(st),
                     tp_last_error());
        atexit(tp_test_mpi_fini_);
    }
    return tp_test_mpi_world_;
}

/* All-reduces two ints (max) over the world; the test fails if that fails. */
static inline void tp_test_mpi_max2_(tp_comm *w, int32_t v[2])
{
    tp_tensor *t = NULL;
    int64_t two = 2;
    tp_status st = tp_tensor_from_blob(TP_I32, TP_CPU, 1, &two, v, NULL, NULL, &t);
    if (st == TP_OK)
        st = tp_all_reduce(w, t, t, TP_MAX, NULL);
    tp_tensor_release(t);
    cr_assert_eq(st, TP_OK, "agreeing on the outcome over the mpi world: %s (%s)",
                 tp_status_name(st), tp_last_error());
}

static inline void tp_test_run(int n, tp_rank_fn fn, void *arg, const tp_test_slot *slots)
{
    tp_comm *w = tp_test_mpi_world();
    int rank = tp_comm_rank(w), size = tp_comm_size(w);
    if (n > size)
        cr_skip_test("needs %d ranks; mpirun started %d processes", n, size);
    tp_comm *g = NULL;
    tp_status st = tp_comm_split(w, rank < n ? 0 : TP_COMM_NO_COLOR, rank, &g);
    cr_assert_eq(st, TP_OK, "tp_comm_split -> %s (%s)", tp_status_name(st), tp_last_error());
    _Alignas(int32_t) char msg[600] = "";
    if (g) {
        cr_assert_str_eq(tp_comm_backend(g), "mpi");
        st = fn(g, arg);
        if (st != TP_OK)
            tp_comm_abort(g, "the rank function failed"); /* peers time out, not hang */
        if (slots[rank].failed)
            snprintf(msg, sizeof msg, "rank %d: %s", rank, slots[rank].msg);
        else if (st != TP_OK)
            snprintf(msg, sizeof msg, "rank %d: %s (%s)", rank, tp_status_name(st),
                     tp_last_error());
        tp_comm_free(g);
    }
    /* v[0]: somebody failed; v[1]: the lowest failing rank, as size - rank */
    int32_t v[2] = {msg[0] != '\0', msg[0] ? size - rank : 0};
    tp_test_mpi_max2_(w, v);
    if (!v[0])
        return;
    int first = size - v[1];
    tp_tensor *t = NULL;
    int64_t len = sizeof msg;
    st = tp_tensor_from_blob(TP_I32, TP_CPU, 1, (int64_t[]){len / 4}, msg, NULL, NULL, &t);
    if (st == TP_OK)
        st = tp_broadcast(w, t, first, NULL);
    tp_tensor_release(t);
    msg[sizeof msg - 1] = '\0';
    cr_assert(0, "%s%s", st == TP_OK ? msg : "a rank failed; its message was lost: ",
              st == TP_OK ? "" : tp_last_error());
}

/* Ranks whose state lives in this process: only this process's own rank. */
static inline bool tp_test_rank_is_local(int r)
{
    return r == tp_comm_rank(tp_test_mpi_world());
}
#endif

/* A counting allocator for allocation-failure tests (tp_set_allocator with
 * {tp_test_alloc_fn, tp_test_free_fn, &state}): call number fail_at (from 0;
 * -1: none) fails, `live` counts the blocks not freed yet. */
typedef struct tp_test_alloc {
    long live, count, fail_at;
} tp_test_alloc;

static inline void *tp_test_alloc_fn(void *ctx, size_t size, size_t alignment)
{
    tp_test_alloc *c = ctx;
    if (c->count++ == c->fail_at)
        return NULL;
    if (alignment < sizeof(void *))
        alignment = sizeof(void *);
    size_t rounded = (size + alignment - 1) / alignment * alignment;
    void *p = aligned_alloc(alignment, rounded ? rounded : alignment);
    if (p)
        c->live++;
    return p;
}

static inline void tp_test_free_fn(void *ctx, void *ptr)
{
    ((tp_test_alloc *)ctx)->live--;
    free(ptr);
}

/* Inside a rank: expects the comm-debug count of `kind` (or TP_COLL_ANY) in
 * `phase` (or TP_PHASE_COUNT) for scope `fqn` to be `want`, through the
 * checked query, so that a scope the counter never saw (a misspelled name, a
 * module that never ran) fails instead of reading 0. Returns whether it
 * held. */
static inline bool tp_test_scope_count_is(tp_test_slot *slot, const tp_comm_debug *d,
                                          const char *fqn, tp_phase phase, tp_coll_kind kind,
                                          int64_t want, const char *what)
{
    static const char *const phases[] = {"forward", "backward", "recompute", "every phase"};
    const char *ph = (unsigned)phase <= TP_PHASE_COUNT ? phases[phase] : "?";
    const char *k = kind == TP_COLL_ANY ? "collectives" : tp_coll_kind_name(kind);
    int64_t got = -1;
    tp_status st = tp_comm_debug_scope_count(d, fqn, phase, kind, &got);
    RANK_EXPECT(slot, st == TP_OK, "%s: scope \"%s\": %s (%s)", what, fqn, tp_status_name(st),
                tp_last_error());
    RANK_EXPECT(slot, st != TP_OK || got == want, "%s: scope \"%s\", %s, %s: %lld, expected %lld",
                what, fqn, ph, k, (long long)got, (long long)want);
    return st == TP_OK && got == want;
}

/* The parameter of root named by its FQN ("layers.0.attn.weight", or
 * "weight" for root's own), as named_parameters reports it; NULL if none. */
static inline tp_tensor *tp_test_param(tp_module *root, const char *fqn)
{
    const char *dot = strrchr(fqn, '.');
    if (!dot)
        return tp_module_parameter(root, fqn);
    char mod[256];
    snprintf(mod, sizeof mod, "%.*s", (int)(dot - fqn), fqn);
    tp_module *m = tp_module_find(root, mod);
    return m ? tp_module_parameter(m, dot + 1) : NULL;
}

/* World sizes every distributed test covers. */
#define TP_TEST_WORLD_SIZES {1, 2, 3, 4, 8}
#define TP_TEST_N_WORLD_SIZES 5

/* The parameters of a test run on every world size: `int *n` in the test. */
#define TP_TEST_WORLD_SIZE_PARAMS(suite, name)                                  \
    ParameterizedTestParameters(suite, name)                                    \
    {                                                                           \
        static int sizes[] = TP_TEST_WORLD_SIZES;                               \
        return cr_make_param_array(int, sizes, TP_TEST_N_WORLD_SIZES);          \
    }

#endif /* TP_TEST_H */
