/* The abort state every backend keeps: an aborted flag that waits and posts
 * read without a lock, and the first reason, which the peers' and this
 * rank's later calls quote. One per communicator state (mpi, nccl), per group
 * and per run (shm). Not installed. */
#ifndef TP_COLL_ABORT_H
#define TP_COLL_ABORT_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>

#include "core/core.h"

#define TP__ABORT_REASON_LEN 512

typedef struct tp__abort_state {
    _Atomic int aborted;
    pthread_mutex_t mu; /* guards reason; taken for short copies only */
    char reason[TP__ABORT_REASON_LEN];
} tp__abort_state;

void tp__abort_init(tp__abort_state *a);
void tp__abort_destroy(tp__abort_state *a);

/* Whether a was aborted. Lock-free, for the polls and posts that only ask. */
static inline bool tp__abort_is_set(const tp__abort_state *a)
{
    return atomic_load(&a->aborted) != 0;
}

/* Marks a aborted with `reason`, unless it was already: the first reason
 * stays. Returns true for the call that aborted it. Thread-safe. */
bool tp__abort_set(tp__abort_state *a, const char *reason);

/* Records TP_ERR_ABORTED "communicator aborted: <reason>" as the calling
 * thread's error and returns it. For an aborted a only. */
tp_status tp__abort_error(tp__abort_state *a);

/* The reason a rank gives when a step of its own failed, leaving it out of
 * step with its peers: "rank R: <the calling thread's last error>", written
 * into buf (truncated to len). Returns buf. */
const char *tp__abort_fail_reason(int rank, char *buf, size_t len);

#endif /* TP_COLL_ABORT_H */
