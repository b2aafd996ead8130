/* The one poll-until-done-or-timeout loop of the backends: a wait calls a
 * test of its own until that reports completion or failure, pausing between
 * tests as its pace says, and gives up once the communicator's timeout has
 * passed. Not installed. */
#ifndef TP_COLL_POLL_H
#define TP_COLL_POLL_H

#include <stdbool.h>

#include "core/core.h"

/* One look at a pending operation, without blocking: sets *done once it is
 * over. A status other than TP_OK ends the wait too (the operation failed,
 * or the communicator was aborted). Never TP_ERR_TIMEOUT: that is the
 * wait's own answer. */
typedef tp_status (*tp__poll_fn)(void *ctx, bool *done);

/* What a wait does between two tests, by how long it has waited so far:
 * tests back to back (with a CPU pause hint, unless no_pause) below spin_s,
 * yields the core below yield_s, then sleeps: sleep(ctx) when set (which may
 * return early, e.g. on a wake-up), else sleep_ns nanoseconds. The clock is
 * read on every `every`-th test only (0 means 1); the tests between spin.
 * no_pause suits a test that is itself a progress engine (MPI_Test): a
 * pause only delays the next step of the protocol. */
typedef struct tp__pace {
    double spin_s;
    double yield_s;
    long sleep_ns;
    void (*sleep)(void *ctx);
    unsigned every;
    bool no_pause;
} tp__pace;

/* Calls poll(ctx, &done) until it reports done or fails, and returns its
 * status then. Returns TP_ERR_TIMEOUT, recording no message, once
 * timeout_s have passed since the first test: the caller words the
 * timeout and aborts what must not wait any longer. The clock is first read
 * at the `every`-th test, and the waiting counts from there (the tests
 * before it take microseconds): an operation that completes within them
 * costs no clock read at all. */
tp_status tp__poll_until(tp__poll_fn poll, void *ctx, double timeout_s, const tp__pace *pace);

#endif /* TP_COLL_POLL_H */
