/* Internal to libtp: an observer of the collectives the dispatch layer
 * issues, for the layers above it (src/plan's traces) to register, so that
 * this layer never calls them by name. Not installed. */
#ifndef TP_COLL_OBSERVER_H
#define TP_COLL_OBSERVER_H

#include <stdbool.h>
#include <stdint.h>

#include "tp/comm.h"

typedef struct tp__coll_observer {
    /* A collective over a group of `size` ranks of which this rank is
     * `rank` (global_rank and stride place the group in the world), issued
     * and counted; returns an id for its wait (0: nothing recorded). */
    uint64_t (*collective)(tp_coll_kind kind, int size, int rank, int64_t global_rank,
                           int64_t stride, uint64_t bytes, bool async);
    /* A wait on asynchronous work whose collective returned `id` (not 0). */
    void (*wait)(uint64_t id);
} tp__coll_observer;

/* Sets the observer (NULL: none), for every thread from the next
 * collective on; obs must stay valid while set. */
void tp__comm_set_observer(const tp__coll_observer *obs);

#endif /* TP_COLL_OBSERVER_H */
