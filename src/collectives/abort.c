/* The abort state shared by the backends (abort.h). */
#include <stdio.h>

#include "collectives/abort.h"

void tp__abort_init(tp__abort_state *a)
{
    atomic_init(&a->aborted, 0);
    pthread_mutex_init(&a->mu, NULL);
    a->reason[0] = '\0';
}

void tp__abort_destroy(tp__abort_state *a) { pthread_mutex_destroy(&a->mu); }

bool tp__abort_set(tp__abort_state *a, const char *reason)
{
    bool first = false;
    pthread_mutex_lock(&a->mu);
    if (!atomic_load(&a->aborted)) {
        snprintf(a->reason, sizeof a->reason, "%s", reason ? reason : "");
        /* after the reason, so that whoever sees the flag finds the reason */
        atomic_store(&a->aborted, 1);
        first = true;
    }
    pthread_mutex_unlock(&a->mu);
    return first;
}

tp_status tp__abort_error(tp__abort_state *a)
{
    pthread_mutex_lock(&a->mu);
    tp_status st = tp__error(TP_ERR_ABORTED, "communicator aborted: %s", a->reason);
    pthread_mutex_unlock(&a->mu);
    return st;
}

const char *tp__abort_fail_reason(int rank, char *buf, size_t len)
{
    snprintf(buf, len, "rank %d: %s", rank, tp_last_error());
    return buf;
}
