/* Internal collectives definitions shared by the dispatch layer, the backends
 * and the comm-debug counter. Not installed. */
#ifndef TP_COLL_H
#define TP_COLL_H

#include <stdatomic.h>

#include "collectives/comm_ref.h"
#include "core/core.h"
#include "tp/comm.h"
#include "tp/comm_debug.h"

struct tp_comm {
    tp_backend ops; /* copy of the backend table */
    void *state;    /* backend state for this rank */
    int rank;
    int size;
    double timeout_s;
    bool check;
    bool owned_by_run; /* the world handed out by tp_run_local */
    uint64_t check_seq;
    uint32_t id, nsplits; /* TP_DEBUG's comm id (the same on every rank) and splits so far */
    bool aborted; /* known to this rank: abort called or a collective reported it */
    char abort_reason[256];
    /* References: the creator's (dropped by tp_comm_free), one per mesh that
     * uses the communicator, one per work handle, one per DDP. The backend
     * state is freed with the last one. */
    atomic_int refs;
    atomic_int pending; /* async work handed out and not yet freed */
    /* Plan traces (src/plan): this rank's rank in the world the group was
     * split from, and the world-rank distance between consecutive members
     * (set by meshes; 1 for a world, 0 for a split of unknown layout). */
    int64_t global_rank, global_stride;
};

struct tp_work {
    tp_comm *comm; /* holds a reference */
    void *impl; /* backend work; NULL once completed */
    tp_status status;
    bool done;
    tp_coll_kind kind;
    uint64_t plan_id; /* the plan trace's id of the collective (0: none) */
};

/* Records one collective in the calling thread's active counter (no-op when
 * none is active). Called by the dispatch layer after validation. */
void tp__comm_debug_record(tp_coll_kind kind, size_t bytes);

/* "all_reduce(f32, 16 elements, sum)" from a packed descriptor (comm.c). */
void tp__desc_string(const int64_t *w, char *buf, size_t len);

/* Built-in backends. */
extern const tp_backend tp__shm_backend;
extern const tp_backend tp__sim_backend;
#if TP_HAVE_MPI
extern const tp_backend tp__mpi_backend;
#endif
#if TP_HAVE_NCCL
extern const tp_backend tp__nccl_backend;
#endif

/* Default timeout from TP_COMM_TIMEOUT, else 300 s; check from TP_COMM_CHECK. */
double tp__default_timeout(void);
bool tp__default_check(void);

#endif /* TP_COLL_H */
