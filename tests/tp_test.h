/* Shared helpers for the Criterion tests.
 *
 * Rank threads never call cr_assert (Criterion's failure path longjmps to the
 * test's main thread). Each rank records its first failed expectation in its
 * own slot; the main thread asserts on the slots after tp_run_local returns. */
#ifndef TP_TEST_H
#define TP_TEST_H

#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <stdio.h>
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

static inline void tp_test_run(int n, tp_rank_fn fn, void *arg, const tp_test_slot *slots)
{
    tp_status st = tp_run_local(n, fn, arg);
    tp_test_assert_slots(slots, n);
    cr_assert_eq(st, TP_OK, "%s", tp_last_error());
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
