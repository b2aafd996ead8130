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

/* Main thread: every slot passed. */
static inline void tp_test_assert_slots(const tp_test_slot *slots, int n)
{
    for (int r = 0; r < n; r++)
        cr_assert(!slots[r].failed, "rank %d: %s", r, slots[r].msg);
}

/* World sizes every distributed test covers. */
#define TP_TEST_WORLD_SIZES {1, 2, 3, 4, 8}
#define TP_TEST_N_WORLD_SIZES 5

#endif /* TP_TEST_H */
