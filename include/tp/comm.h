/*
 * tp/comm.h - process groups, collectives, async work, backends.
 *
 * A tp_comm is a process group: this rank's index, the group size, and a
 * backend. Collective calls are collective: every rank of the group must make
 * them, in the same order, with matching arguments (kind, dtype, element count,
 * op, root). A rank that fails aborts its communicator so that its peers'
 * pending and later collectives return TP_ERR_ABORTED instead of hanging; every
 * wait honours the communicator's timeout (TP_ERR_TIMEOUT, after which the
 * communicator is aborted too).
 *
 * Buffers are contiguous tensors on a device the backend supports; send and
 * recv have the same dtype and device. Element counts per collective (n is the
 * group size):
 *
 *   all_reduce      send k,    recv k      in place: send == recv
 *   all_gather      send k,    recv n*k    in place: send is recv's rank-th block
 *   reduce_scatter  send n*k,  recv k      in place: recv is send's rank-th block
 *   all_to_all      send n*k,  recv n*k    never in place; block j of send goes to rank j
 *   broadcast       buffer k               root's buffer is copied to every rank
 *   scatter         send n*k (root only),  block j of root's send goes to rank j;
 *                   recv k                 other ranks pass send NULL; in place:
 *                                          root's recv is its own block of send
 *
 * Any other overlap between send and recv is TP_ERR_INVALID_ARG. Blocks are in
 * rank order, so gathering k-element blocks is concatenation along dim 0 of the
 * flattened buffers.
 *
 * Every collective takes `tp_work **work`: NULL makes the call blocking (it
 * returns once this rank's part is complete and its buffers may be reused);
 * otherwise *work receives a handle, and the buffers must stay untouched until
 * tp_work_wait() returns or tp_work_test() reports completion. Collectives
 * issued while a tp_comm_debug counter is active on the calling thread are
 * recorded there.
 */
#ifndef TP_COMM_H
#define TP_COMM_H

#include <stdbool.h>
#include <stdint.h>

#include "tp/status.h"
#include "tp/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * tp_comm: this rank's handle on a process group. Reference-counted.
 *   Made by tp_comm_create (wrapping a backend state, which it then owns),
 *   tp_comm_create_world and tp_comm_split, each with one reference, the
 *   caller's, dropped by tp_comm_free (refused while work handles are
 *   outstanding); the world a tp_run_local rank gets belongs to the run.
 *   Held (a reference each) by the meshes built on it (tp_mesh_create), a
 *   DDP over it and every work handle issued on it, so these may outlive the
 *   caller's handle. It keeps its backend state, freed through backend->free
 *   on the thread that drops the last reference; it keeps nothing of the
 *   communicator it was split from, and no tensor of its collectives.
 *
 * tp_work: one collective issued with a work handle. Made by the collective,
 *   freed by tp_work_free, which the caller must call (it waits first if the
 *   work is pending). Holds a reference on its communicator; holds no
 *   reference on the buffers, which the caller keeps alive and untouched
 *   until the work completes (a backend may keep its own, as mpi does).
 */
typedef struct tp_comm tp_comm;
typedef struct tp_work tp_work;

typedef enum tp_reduce_op {
    TP_SUM = 0,
    TP_AVG,     /* sum / n; integer dtypes truncate toward zero */
    TP_MAX,
    TP_MIN,
    TP_PRODUCT,
    TP_REDUCE_OP_COUNT
} tp_reduce_op;

typedef enum tp_coll_kind {
    TP_COLL_ALL_REDUCE = 0,
    TP_COLL_ALL_GATHER,
    TP_COLL_REDUCE_SCATTER,
    TP_COLL_ALL_TO_ALL,
    TP_COLL_BROADCAST,
    TP_COLL_BARRIER,
    TP_COLL_SCATTER, /* appended: the kinds above keep their values */
    TP_COLL_KIND_COUNT
} tp_coll_kind;

/* "all_reduce", "all_gather", ..., "scatter"; "invalid" otherwise. */
TP_API const char *tp_coll_kind_name(tp_coll_kind kind);
/* "sum", "avg", "max", "min", "product"; "invalid" otherwise. */
TP_API const char *tp_reduce_op_name(tp_reduce_op op);

/* ---- process groups ------------------------------------------------------ */

TP_API int tp_comm_rank(const tp_comm *comm);
TP_API int tp_comm_size(const tp_comm *comm);
/* Name of the backend ("shm", "mpi", "nccl", or a user backend's name). */
TP_API const char *tp_comm_backend(const tp_comm *comm);

/* Wait limit for this rank's collectives on comm, in seconds (> 0). The
 * default is 300 s, or TP_COMM_TIMEOUT from the environment. Local setting:
 * ranks may differ. Sub-communicators inherit it. */
TP_API tp_status tp_comm_set_timeout(tp_comm *comm, double seconds);
TP_API double tp_comm_timeout(const tp_comm *comm);

/* Opt-in debug check: before each collective the ranks exchange a descriptor
 * (kind, dtype, element count, op, root, sequence number) and every rank
 * returns TP_ERR_MISMATCH, with a message naming both sides, if any rank
 * disagrees. Every rank must set the same value (it changes the traffic).
 * Default off, or on when TP_COMM_CHECK=1. Backends that already compare
 * descriptors on every call (shm) need no extra exchange. Inherited by
 * sub-communicators. */
TP_API tp_status tp_comm_set_check(tp_comm *comm, bool enabled);
TP_API bool tp_comm_check(const tp_comm *comm);

/*
 * Collective: splits comm into disjoint groups, one per non-negative color;
 * within a group ranks are ordered by (key, old rank). A rank passing
 * color < 0 (TP_COMM_NO_COLOR) takes part but gets *out = NULL. The new
 * communicator inherits timeout and check settings. The split waits for the
 * peers up to comm's timeout, as a collective does: past it, TP_ERR_TIMEOUT
 * and comm is aborted.
 */
#define TP_COMM_NO_COLOR (-1)
TP_API tp_status tp_comm_split(tp_comm *comm, int color, int key, tp_comm **out);

/* Aborts comm: this rank's and every peer's pending and later collectives on
 * it return TP_ERR_ABORTED. `reason` is recorded in the peers' error text.
 * Local, never blocks. */
TP_API void tp_comm_abort(tp_comm *comm, const char *reason);
/* true once comm (or, for shm, its run) was aborted. */
TP_API bool tp_comm_is_aborted(const tp_comm *comm);

/*
 * Releases the caller's handle. Refused with TP_ERR_STATE (the message says
 * how many) while work handles of this communicator are not freed yet: the
 * communicator stays usable, and may be freed once they are. Otherwise
 * returns TP_OK; the communicator itself goes once nothing uses it any more:
 * a mesh built on it (tp_mesh_create) or a DDP over it keeps it alive until
 * that is freed too, so these may be freed in any order. The last release
 * waits for this rank's part of posted collectives (up to the timeout; nccl:
 * also for the peers to release theirs) and frees the backend state, on the
 * thread that makes it. NULL is a no-op (TP_OK). The world communicator
 * handed to a tp_run_local() rank function belongs to tp_run_local: freeing
 * it is a no-op (TP_OK).
 */
TP_API tp_status tp_comm_free(tp_comm *comm);

/* ---- collectives --------------------------------------------------------- */

TP_API tp_status tp_all_reduce(tp_comm *comm, const tp_tensor *send, tp_tensor *recv,
                               tp_reduce_op op, tp_work **work);
TP_API tp_status tp_all_gather(tp_comm *comm, const tp_tensor *send, tp_tensor *recv,
                               tp_work **work);
TP_API tp_status tp_reduce_scatter(tp_comm *comm, const tp_tensor *send, tp_tensor *recv,
                                   tp_reduce_op op, tp_work **work);
TP_API tp_status tp_all_to_all(tp_comm *comm, const tp_tensor *send, tp_tensor *recv,
                               tp_work **work);
TP_API tp_status tp_broadcast(tp_comm *comm, tp_tensor *buffer, int root, tp_work **work);
TP_API tp_status tp_barrier(tp_comm *comm, tp_work **work);
/* Block j of root's `send` (n*k elements) to rank j's `recv` (k elements).
 * `send` is read on root only: the other ranks pass NULL (a tensor there is
 * ignored). Every rank passes the same root and k; root's recv may be its own
 * block of send (in place: nothing is copied for root). */
TP_API tp_status tp_scatter(tp_comm *comm, const tp_tensor *send, tp_tensor *recv, int root,
                            tp_work **work);

/* ---- async work ---------------------------------------------------------- */

/* Waits for completion up to the communicator's timeout. Returns the
 * collective's status (TP_ERR_ABORTED, TP_ERR_MISMATCH, ...). Waiting again on
 * completed work returns the same status. */
TP_API tp_status tp_work_wait(tp_work *work);
/* Makes progress without blocking; *done tells whether the work completed.
 * Returns the collective's status once done, TP_OK while pending. */
TP_API tp_status tp_work_test(tp_work *work, bool *done);
/* Frees the handle, waiting for pending work first. NULL is a no-op. A work
 * handle keeps its communicator alive: it may be freed after the mesh that
 * owned the communicator. */
TP_API void tp_work_free(tp_work *work);

/* ---- ranks as threads (the shm backend) ---------------------------------- */

/* A rank's body: runs on its own thread with its world communicator. */
typedef tp_status (*tp_rank_fn)(tp_comm *world, void *arg);

typedef struct tp_run_options {
    double timeout_s;        /* 0: default (300 s or TP_COMM_TIMEOUT) */
    bool check;              /* tp_comm_set_check on the world */
    tp_status *rank_status;  /* optional: receives each rank's return value */
} tp_run_options;

/*
 * Runs fn on n threads (n >= 1), one rank each, with a world communicator of
 * the "shm" backend: ranks read each other's buffers directly. Returns once
 * every rank has returned: TP_OK, or the status of the first rank to fail (by
 * time); the failing rank's message is copied into the caller's
 * tp_last_error() prefixed with "rank R: ". A rank's failure counts from the
 * moment it happened, not from when its function returned: when a wait of
 * its first timed out for TP_ERR_TIMEOUT, when it first saw an abort for
 * TP_ERR_ABORTED, otherwise when it first aborted a communicator itself,
 * timed out or saw an abort, or else on return. So a timeout is reported
 * rather than the TP_ERR_ABORTED it causes on the peers, whichever rank
 * returns first, and a rank that aborts and then fails with its own error
 * is reported rather than the peers that saw its abort. A failing rank
 * aborts the run's communicators, so the others return TP_ERR_ABORTED rather
 * than hang; a rank that returns while a peer still waits for it also aborts
 * the run.
 */
TP_API tp_status tp_run_local(int n, tp_rank_fn fn, void *arg);
TP_API tp_status tp_run_local_opts(int n, tp_rank_fn fn, void *arg,
                                   const tp_run_options *opts);

/* ---- backends ------------------------------------------------------------ */

/* One collective as seen by a backend. Validation has already happened: the
 * pointers and counts follow the table at the top of this file. */
typedef struct tp_coll_desc {
    tp_coll_kind kind;
    tp_dtype dtype;
    tp_device device;
    size_t count;         /* k in the table above; 0 for barrier */
    tp_reduce_op op;      /* reductions only */
    int root;             /* broadcast and scatter only */
    const void *sendbuf;  /* NULL for barrier, and for scatter on ranks other than
                           * root; broadcast: == recvbuf */
    void *recvbuf;        /* NULL for barrier */
    const tp_tensor *send;
    tp_tensor *recv;
    double timeout_s;     /* the communicator's wait limit */
} tp_coll_desc;

/*
 * A backend is a table of functions registered by name. Ownership:
 * tp_backend_register copies the table and keeps it for the life of the
 * program, its name string borrowed (it must stay valid as long); each
 * tp_comm keeps its own copy. A backend state (from init_world, split, or
 * passed to tp_comm_create) belongs to the one communicator wrapping it,
 * which calls free(state) after its last reference; a work object returned
 * by `collective` belongs to its tp_work, which calls work_free(state, work)
 * before the communicator can go. `collective` starts a
 * collective; if it completes before returning it sets *work = NULL, otherwise
 * it returns a backend work object that libtp drives through work_test /
 * work_wait / work_free. A slot left NULL makes the matching calls return
 * TP_ERR_NOT_SUPPORTED. A backend returns TP_ERR_NOT_SUPPORTED from
 * `collective` for a kind it does not implement (kinds may be added to
 * tp_coll_kind over time, e.g. TP_COLL_SCATTER). User-written backends are
 * first-class: register one and create communicators on it with
 * tp_comm_create().
 */
typedef struct tp_backend {
    const char *name;
    /* device types this backend moves (bit 1 << tp_device_type) */
    unsigned device_mask;
    /* true if the backend compares descriptors across ranks on every call, so
     * tp_comm_set_check needs no extra exchange */
    bool checks_descriptors;
    tp_status (*collective)(void *state, const tp_coll_desc *desc, void **work);
    tp_status (*work_test)(void *state, void *work, bool *done);
    tp_status (*work_wait)(void *state, void *work, double timeout_s);
    void (*work_free)(void *state, void *work);
    /* split: creates the state of the new group this rank joins; color < 0
     * must still take part and return *new_state = NULL. timeout_s is the
     * parent communicator's wait limit: no wait inside split may last longer
     * (a peer that never joins is TP_ERR_TIMEOUT, and state aborted, rather
     * than a hang). The new communicator gets the same limit (tp_comm_split
     * sets it); a backend that keeps one in its state starts the new state
     * with it. */
    tp_status (*split)(void *state, int color, int key, double timeout_s, void **new_state,
                       int *new_rank, int *new_size);
    void (*abort)(void *state, const char *reason);
    void (*free)(void *state);
    /* creates a world group for this process (MPI: MPI_COMM_WORLD); optional */
    tp_status (*init_world)(void *options, void **state, int *rank, int *size);
} tp_backend;

/* Registers a backend (the table is copied; its name must stay valid). A
 * second registration under the same name is TP_ERR_INVALID_ARG. Built-in
 * backends are registered already. Thread-safe. */
TP_API tp_status tp_backend_register(const tp_backend *backend);
/* The registered table with this name, or NULL. */
TP_API const tp_backend *tp_backend_find(const char *name);

/* Wraps a backend state in a communicator. On success the communicator owns
 * `state` and calls backend->free(state) when freed; on failure the caller
 * keeps it. */
TP_API tp_status tp_comm_create(const tp_backend *backend, void *state, int rank, int size,
                                tp_comm **out);
/* World communicator of a registered backend that implements init_world. */
TP_API tp_status tp_comm_create_world(const char *backend_name, void *options, tp_comm **out);

/* ---- the nccl backend ---------------------------------------------------- */

/*
 * Options of tp_comm_create_world("nccl", &opts, &comm): one GPU per rank.
 *
 * Collective over `bootstrap`: every rank of it must call. `bootstrap` is any
 * existing communicator of the same ranks (the shm world of tp_run_local
 * threads, or an "mpi" world); rank 0 creates the ncclUniqueId and it travels
 * to the others through tp_broadcast on `bootstrap` (a 128-byte CPU tensor).
 * The new communicator has the bootstrap's rank and size, and its own timeout
 * (default, as every new communicator); the bootstrap stays the caller's and
 * may be freed afterwards. A NULL `bootstrap` means the MPI world when libtp
 * is built with MPI: a temporary tp_comm_create_world("mpi", NULL, ...) world is
 * created and freed around the exchange (MPI stays initialized while the
 * nccl communicator lives).
 *
 * `device` is this rank's CUDA ordinal, or -1 for (bootstrap rank % number of
 * visible devices). Buffers of every collective on the communicator must be
 * CUDA tensors on that device.
 *
 * Declared in every build; without NCCL, tp_comm_create_world("nccl", ...) returns
 * TP_ERR_NOT_SUPPORTED saying libtp was built without NCCL.
 */
typedef struct tp_nccl_options {
    tp_comm *bootstrap; /* NULL: the MPI world (builds with MPI only) */
    int device;         /* CUDA ordinal, or -1: bootstrap rank % device count */
} tp_nccl_options;

/* ---- the sim backend: one rank of a simulated world -------------------- */

/*
 * Options of tp_comm_create_world("sim", &opts, &world): this process plays
 * rank `rank` of a world of `world_size` ranks (1 .. TP_SIM_MAX_WORLD) on
 * meta tensors (TP_META, tp/tensor.h), to plan a parallel layout at any
 * scale on one machine (docs/sim.md). Every collective completes at once
 * without moving data, after the validation every backend gets (counts,
 * dtypes, in-place forms), and is recorded by an active comm-debug counter
 * exactly as the same call on a real world of that size would be (kind,
 * bytes, scope, phase). Buffers must be meta tensors: a CPU or CUDA tensor is
 * TP_ERR_NOT_SUPPORTED ("backend 'sim' cannot move CPU tensors").
 * Meshes (tp_mesh_create, tp_mesh_slice, any number of dims) build on a sim
 * world unchanged; a direct tp_comm_split is TP_ERR_NOT_SUPPORTED, since one
 * rank cannot know which colors the others chose. Abort and timeouts never
 * apply (nothing waits). The world is freed with tp_comm_free.
 */
#define TP_SIM_MAX_WORLD 65536

typedef struct tp_sim_options {
    int world_size; /* 1 .. TP_SIM_MAX_WORLD */
    int rank;       /* 0 .. world_size - 1 */
} tp_sim_options;

/* Per collective kind, the largest count and byte total any played rank
 * recorded, and the first rank (lowest) that recorded it. */
typedef struct tp_sim_report {
    int ranks_played;
    int64_t max_count[TP_COLL_KIND_COUNT];
    int max_count_rank[TP_COLL_KIND_COUNT];
    int64_t max_bytes[TP_COLL_KIND_COUNT];
    int max_bytes_rank[TP_COLL_KIND_COUNT];
    int64_t max_total; /* collectives of every kind */
    int max_total_rank;
} tp_sim_report;

/*
 * Plays several ranks of a simulated world of world_size ranks, one after
 * the other on the calling thread: for each rank r of `ranks` (nranks
 * entries, each in [0, world_size), or NULL: every rank 0 .. world_size-1)
 * a fresh sim world of rank r is made, fn(world, arg) runs with a comm-debug
 * counter active (fn must not begin one of its own) and the world is freed
 * after it. *out gets the maxima over the ranks played. With uneven shards
 * the ranks issue collectives of different sizes; pass one rank of each
 * kind that differs (e.g. every coordinate along the dims that shard
 * unevenly) rather than all of a large world. Stops at the first rank whose
 * fn fails, returning its status with "sim rank R: " before its message;
 * *out then holds the ranks played so far. TP_ERR_INVALID_ARG for a NULL
 * fn or out, world_size out of range, nranks < 1 with ranks, or a rank
 * out of range (before anything runs).
 */
TP_API tp_status tp_sim_each_rank(int world_size, int nranks, const int *ranks, tp_rank_fn fn,
                                  void *arg, tp_sim_report *out);

#ifdef __cplusplus
}
#endif

#endif /* TP_COMM_H */
