/*
 * The mpi backend: one rank per process, started by mpirun; every collective
 * is one of MPI's non-blocking collectives behind a tp_work, or, when small,
 * one round of point-to-point messages (mpi_direct.c), cheaper than
 * OpenMPI's non-blocking collectives there, or, for a large reduce_scatter
 * and a large all_reduce that OpenMPI would reduce to one rank, a ring of
 * point-to-point steps (mpi_ring.c) that libtp drives from its tests and
 * waits (stale rings from every later call: see mpi_stale).
 *
 * World. tp_comm_create_world("mpi", options, &world) initializes MPI with
 * MPI_THREAD_MULTIPLE unless the program already did; libtp then finalizes
 * MPI itself, once, when the last communicator of this backend is freed
 * (normally the world, after the meshes built on it), but only once every
 * process got there: MPI_Finalize waits for every process of the job and
 * cannot time out, so a non-blocking barrier on a communicator of its own
 * comes first, waited for up to the default timeout (TP_COMM_TIMEOUT), or
 * 5 s once this process saw a fault. When it times out libtp leaves MPI
 * unfinalized (one line on stderr; tp_last_error keeps the fault), the
 * process exits, and mpirun, seeing a rank end without MPI_Finalize, ends
 * the whole job (stopped ranks included). If the program
 * initialized MPI, libtp never finalizes it. Either way libtp works on a
 * duplicate (MPI_Comm_dup) of MPI_COMM_WORLD, or of the MPI_Comm that
 * `options` points to when it is not NULL, so its traffic never matches the
 * program's own messages. Errors return (MPI_ERRORS_RETURN on every
 * communicator libtp creates) and are reported as TP_ERR_BACKEND with MPI's
 * error string. Free every communicator before the program exits: a process
 * that ends without MPI_Finalize makes mpirun fail the job.
 *
 * Waiting. tp_work_wait polls MPI_Test, which is also what drives MPI's
 * progress, until completion or the timeout: busy, like MPI_Wait, yielding
 * the core when the node runs more ranks than cores and MPI does not yield
 * by itself. A blocking call (work == NULL) waits inside `collective`, its
 * work object on the stack (run_blocking), and hands back no work. tp_comm_split first waits (with the communicator's timeout, as
 * shm does) on a non-blocking barrier, so that a missing peer is a timeout
 * rather than a hang inside MPI_Comm_split.
 *
 * Types. f32, f64, i32, i64 map to MPI's predefined types and ops. MPI has no
 * 16-bit floats: f16 and bf16 travel as a contiguous 2-byte type, and their
 * reductions are user-defined ops that widen each pair of operands to float,
 * combine them and round to nearest even (so a reduction over n ranks rounds
 * n - 1 times; integer-valued data within the type's exact range is exact).
 * avg is a sum divided by the group size when the collective completes
 * (integers truncate toward zero, as in shm). max/min of f32/f64 are MPI's
 * own, whose NaN handling is the MPI library's; for f16/bf16 a NaN operand
 * wins, as in shm.
 *
 * Failure semantics, and where they are weaker than shm's:
 *  - MPI cannot cancel a collective. A wait that runs past the timeout
 *    returns TP_ERR_TIMEOUT and the communicator is aborted (unusable): the
 *    request stays posted inside MPI, which may still write the receive
 *    buffer should the peers join later, so do not reuse the buffers of a
 *    collective that did not complete. Freeing a communicator with such a
 *    request (or an aborted one) does not wait and does not call
 *    MPI_Comm_free: MPI progresses the request whenever a late peer's data
 *    arrives, at any later MPI call (MPI_Finalize included), and then sends
 *    on its communicator, so the communicator, the request and its buffers
 *    (libtp keeps the tensors alive) are left to MPI until MPI_Finalize, or
 *    for good when the program finalizes MPI itself. MPI_Finalize accepts
 *    the pending request; a peer that joins late may even complete.
 *  - tp_comm_abort is local. Later calls on this rank return TP_ERR_ABORTED
 *    at once (pending work too), but the peers learn of it only through
 *    their own timeouts: MPI has no cross-process abort short of MPI_Abort,
 *    which ends the whole job. Set TP_MPI_ABORT_ON_FAILURE=1 to get exactly
 *    that: any abort (tp_comm_abort, a timeout, a failed MPI call) calls
 *    MPI_Abort, and mpirun stops every rank.
 *  - Element counts per collective (k of comm.h) must fit in an int.
 *  - A thread level below MPI_THREAD_MULTIPLE (MPI initialized by the
 *    program with MPI_Init) makes libtp serialize its own MPI calls; calling
 *    libtp from several threads then also needs MPI_THREAD_SERIALIZED.
 */
#include <mpi.h>

#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "collectives/abort.h"
#include "collectives/check.h"
#include "collectives/coll.h"
#include "collectives/mpi_direct.h"
#include "collectives/mpi_ring.h"
#include "collectives/poll.h"
#include "core/cache.h"
#include "core/log.h"

/* ---- process-wide MPI state ----------------------------------------------- */

static pthread_mutex_t mpi_mu = PTHREAD_MUTEX_INITIALIZER; /* guards the fields below */
static int mpi_live;         /* states of this backend alive (worlds and split groups) */
static bool mpi_owned;       /* libtp called MPI_Init_thread, so it finalizes */
static bool mpi_types_ready; /* mpi_half and mpi_half_ops exist */
static bool mpi_serialize;   /* thread level below MULTIPLE: one libtp MPI call at a time */
static bool mpi_yield;       /* more ranks on this node than cores: yield while waiting */

static pthread_mutex_t mpi_call_mu = PTHREAD_MUTEX_INITIALIZER;

static MPI_Datatype mpi_half = MPI_DATATYPE_NULL; /* 2 bytes: f16 and bf16 */
static struct mpi_work *mpi_orphans; /* work MPI never completed, of freed communicators */
/* Rings libtp gave up waiting for (timeout, abort, freed early). MPI drives
 * its own schedules at any later call, so a peer that joins late can still
 * complete with a stale request; a ring's later steps are libtp's to post,
 * so every later libtp test or wait (any communicator) and the exit barrier
 * drive these. Order: mpi_mu, then mpi_stale_mu, then mpi_call_mu. */
static pthread_mutex_t mpi_stale_mu = PTHREAD_MUTEX_INITIALIZER;
static struct mpi_work *mpi_stale;
static atomic_int mpi_nstale;
static int mpi_faulted; /* communicators left to MPI unfreed, their requests still posted */
/* A duplicate of MPI_COMM_WORLD that carries nothing but the exit barrier
 * (mpi_exit_barrier), so no stale request of a faulted communicator can
 * match it; made when libtp initializes MPI. */
static MPI_Comm mpi_exit_comm = MPI_COMM_NULL;
static bool mpi_abandoned;         /* libtp left MPI unfinalized after a fault */
static atomic_bool mpi_fault_seen; /* some communicator of this process was aborted */
enum { HALF_F16 = 0, HALF_BF16 = 1 };
static MPI_Op mpi_half_ops[2][TP_REDUCE_OP_COUNT];

static void mpi_lock(void)
{
    if (mpi_serialize)
        pthread_mutex_lock(&mpi_call_mu);
}

static void mpi_unlock(void)
{
    if (mpi_serialize)
        pthread_mutex_unlock(&mpi_call_mu);
}

/* ---- type and op translation ---------------------------------------------- */

/* f16/bf16 have no MPI type: MPI_DATATYPE_NULL here means mpi_half. */
static const MPI_Datatype mpi_dtypes[TP_DTYPE_COUNT] = {
    [TP_F32] = MPI_FLOAT,        [TP_F64] = MPI_DOUBLE,
    [TP_I32] = MPI_INT32_T,      [TP_I64] = MPI_INT64_T,
    [TP_F16] = MPI_DATATYPE_NULL, [TP_BF16] = MPI_DATATYPE_NULL,
};

/* avg is a sum here; the division happens when the collective completes. */
static const MPI_Op mpi_ops[TP_REDUCE_OP_COUNT] = {
    [TP_SUM] = MPI_SUM, [TP_AVG] = MPI_SUM, [TP_MAX] = MPI_MAX, [TP_MIN] = MPI_MIN,
    [TP_PRODUCT] = MPI_PROD,
};

static MPI_Datatype mpi_dtype(tp_dtype d)
{
    return (d == TP_F16 || d == TP_BF16) ? mpi_half : mpi_dtypes[d];
}

static MPI_Op mpi_op(tp_dtype d, tp_reduce_op op)
{
    if (d == TP_F16)
        return mpi_half_ops[HALF_F16][op];
    if (d == TP_BF16)
        return mpi_half_ops[HALF_BF16][op];
    return mpi_ops[op];
}

/* User ops for the half types: inout[i] = in[i] (op) inout[i] in float,
 * rounded back to nearest even. The comparisons follow shm's: a NaN operand
 * wins. */
#define HALF_USER_OP(NAME, TO_F32, FROM_F32, EXPR)                              \
    static void NAME(void *in, void *inout, int *len, MPI_Datatype *type)       \
    {                                                                           \
        (void)type;                                                             \
        const uint16_t *a = in;                                                 \
        uint16_t *b = inout;                                                    \
        for (int i = 0; i < *len; i++) {                                        \
            float x = TO_F32(a[i]), y = TO_F32(b[i]);                           \
            b[i] = FROM_F32(EXPR);                                              \
        }                                                                       \
    }

#define HALF_USER_OPS(P, TO_F32, FROM_F32)                                      \
    HALF_USER_OP(P##_sum, TO_F32, FROM_F32, x + y)                              \
    HALF_USER_OP(P##_prod, TO_F32, FROM_F32, x * y)                             \
    HALF_USER_OP(P##_max, TO_F32, FROM_F32, (x > y || x != x) ? x : y)          \
    HALF_USER_OP(P##_min, TO_F32, FROM_F32, (x < y || x != x) ? x : y)

HALF_USER_OPS(f16, tp__f16_to_f32, tp__f32_to_f16)
HALF_USER_OPS(bf16, tp__bf16_to_f32, tp__f32_to_bf16)

static MPI_User_function *const mpi_half_fns[2][TP_REDUCE_OP_COUNT] = {
    [HALF_F16] = {[TP_SUM] = f16_sum, [TP_AVG] = f16_sum, [TP_MAX] = f16_max,
                  [TP_MIN] = f16_min, [TP_PRODUCT] = f16_prod},
    [HALF_BF16] = {[TP_SUM] = bf16_sum, [TP_AVG] = bf16_sum, [TP_MAX] = bf16_max,
                   [TP_MIN] = bf16_min, [TP_PRODUCT] = bf16_prod},
};

tp_status tp__mpi_error(int rc, const char *what)
{
    char text[MPI_MAX_ERROR_STRING + 1];
    int len = 0;
    if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS)
        len = snprintf(text, sizeof text, "MPI error code %d", rc);
    text[len < 0 ? 0 : (len > MPI_MAX_ERROR_STRING ? MPI_MAX_ERROR_STRING : len)] = '\0';
    return tp__error(TP_ERR_BACKEND, "%s failed: %s", what, text);
}

/* Called with mpi_mu held, MPI initialized. */
static tp_status mpi_types_create(void)
{
    if (mpi_types_ready)
        return TP_OK;
    tp_status st = TP_OK;
    for (int h = 0; h < 2; h++)
        for (int op = 0; op < TP_REDUCE_OP_COUNT; op++)
            mpi_half_ops[h][op] = MPI_OP_NULL;
    TP_MPI_CHECK("MPI_Type_contiguous (f16/bf16)", MPI_Type_contiguous(2, MPI_BYTE, &mpi_half));
    TP_MPI_CHECK_GOTO("MPI_Type_commit (f16/bf16)", MPI_Type_commit(&mpi_half), st, fail);
    for (int h = 0; h < 2; h++) {
        for (int op = 0; op < TP_REDUCE_OP_COUNT; op++) {
            if (op == TP_AVG)
                continue; /* shares the sum op */
            MPI_Op made = MPI_OP_NULL;
            TP_MPI_CHECK_GOTO("MPI_Op_create (f16/bf16)",
                              MPI_Op_create(mpi_half_fns[h][op], 1, &made), st, fail);
            mpi_half_ops[h][op] = made;
        }
    }
    for (int h = 0; h < 2; h++)
        mpi_half_ops[h][TP_AVG] = mpi_half_ops[h][TP_SUM];
    mpi_types_ready = true;
    return TP_OK;
fail:
    for (int h = 0; h < 2; h++)
        for (int op = 0; op < TP_REDUCE_OP_COUNT; op++)
            if (op != TP_AVG && mpi_half_ops[h][op] != MPI_OP_NULL)
                MPI_Op_free(&mpi_half_ops[h][op]);
    MPI_Type_free(&mpi_half);
    return st;
}

/* ---- states and work ------------------------------------------------------ */

typedef struct mpi_work mpi_work;

/* A blocking two-rank exchange's messages (all_gather, all_to_all,
 * broadcast) kept as persistent requests for the buffers they name: made
 * the first time those buffers come, started again (MPI_Startall) every
 * time they come back, inactive in between. The last MPI_PERSIST_SLOTS sets
 * of buffers are kept, the least recently used made over; freed with the
 * communicator. TP_MPI_PERSISTENT=0 posts them afresh every time. */
enum { MPI_PERSIST_SLOTS = 4, MPI_PERSIST_REQS = 4 /* a receive and a send, each maybe halves */ };

typedef struct mpi_persist {
    int nreq;      /* 0: a free slot */
    unsigned used; /* the state's clock at its last start */
    tp_coll_kind kind;
    tp_dtype dtype;
    int root;
    size_t count;
    const void *send;
    void *recv;
    tp__mpi_copy copy; /* the own block's copy, as posting found it */
    MPI_Request reqs[MPI_PERSIST_REQS];
} mpi_persist;

typedef struct mpi_state {
    MPI_Comm comm;
    int rank, size;
    int world_rank; /* in MPI_COMM_WORLD, for messages */
    tp__abort_state abort;
    pthread_mutex_t mu; /* the work lists, timeout_s */
    double timeout_s;   /* the communicator's, as its latest collective passed it */
    mpi_work *active;  /* work handed out and not yet freed */
    mpi_work *zombies; /* freed before MPI completed it (after a timeout or abort) */
    unsigned ring_seq; /* ring collectives issued (their tags; every rank counts alike) */
    size_t direct_bytes;       /* TP_MPI_DIRECT_BYTES, TP_MPI_RING and TP_MPI_PERSISTENT as */
    bool ring_on;              /* they were when the communicator was made (not read again */
    bool persist_on;           /* per call) */
    bool split;                /* 2-4 KiB direct messages go as halves: the world's
                                * measured answer (tp__mpi_direct_decide_split),
                                * which its splits inherit */
    bool apart;                /* two ranks on two nodes (pair_apart) */
    unsigned persist_clock;
    mpi_persist persist[MPI_PERSIST_SLOTS];
} mpi_state;

/* Requests a direct collective keeps inside its work object: up to
 * 4 (size - 1) (mpi_direct.c), for up to 8 ranks; larger groups allocate
 * them. */
enum { MPI_INLINE_REQS = 28 };

struct mpi_work {
    MPI_Request req;   /* a collective's one request */
    MPI_Request *reqs; /* &req, the direct path's messages (mpi_direct.c: inl or
                        * allocated) or the ring's current step's (mpi_ring.c) */
    tp__mpi_copy copy; /* direct path: the own block's copy, done by work_finish */
    mpi_persist *persist; /* reqs are this slot's, started (post_persistent) */
    int nreq;
    bool direct;        /* reductions: tmp holds every rank's contribution */
    tp__mpi_ring *ring; /* the ring path's schedule (reqs points into it), or NULL */
    bool stale;         /* a ring libtp no longer waits for, on the stale list */
    bool ring_done;     /* the stale ring ran to its end (MPI owns nothing of it) */
    mpi_work *stale_next;
    mpi_work *next;
    tp_coll_kind kind;
    tp_dtype dtype;
    tp_reduce_op op;
    size_t count;  /* elements of the result on this rank */
    const void *send; /* the send buffer (direct reductions read this rank's part) */
    void *result;  /* where they end up (avg divides them there) */
    void *tmp;     /* in-place reduce_scatter: MPI writes here, copied to result;
                    * direct reductions: the contributions */
    bool complete; /* MPI finished the request */
    bool finished; /* post-processing done, status final */
    tp_status status;
    /* the caller's tensors, kept alive until MPI lets go of the request: a
     * request MPI never completes (abort, timeout) may still write into them
     * after the caller freed its handles */
    tp_tensor *keep[2];
    MPI_Request inl[MPI_INLINE_REQS]; /* last: not cleared, filled as posted */
};

static bool abort_on_failure(void)
{
    const char *env = getenv("TP_MPI_ABORT_ON_FAILURE");
    return env && strcmp(env, "1") == 0;
}

static void state_abort(mpi_state *S, const char *reason)
{
    tp__abort_set(&S->abort, reason);
    atomic_store(&mpi_fault_seen, true);
    if (abort_on_failure()) {
        fprintf(stderr,
                "libtp: MPI rank %d: communicator aborted (%s); TP_MPI_ABORT_ON_FAILURE=1: "
                "calling MPI_Abort\n",
                S->world_rank, reason);
        fflush(stderr);
        MPI_Abort(S->comm, 1);
    }
}

/* An MPI call failed, or this rank skipped a collective its peers may have
 * posted: it is out of step with them now. `st` is the error already
 * recorded. */
static tp_status state_fail(mpi_state *S, tp_status st)
{
    char why[TP__ABORT_REASON_LEN];
    state_abort(S, tp__abort_fail_reason(S->rank, why, sizeof why));
    return st;
}

static void list_remove(mpi_work **head, mpi_work *w)
{
    for (mpi_work **p = head; *p; p = &(*p)->next) {
        if (*p == w) {
            *p = w->next;
            w->next = NULL;
            return;
        }
    }
}

/* Frees what w holds, not w itself (a blocking call's work is on the stack). */
static void work_clear(mpi_work *w)
{
    if (w->ring)
        tp__mpi_ring_free(w->ring); /* w->reqs is its */
    else if (w->reqs != &w->req && w->reqs != w->inl && !w->persist)
        tp__free(w->reqs);
    /* a blocking call's work holds none of these: no calls for it */
    if (w->keep[0])
        tp_tensor_release(w->keep[0]);
    if (w->keep[1])
        tp_tensor_release(w->keep[1]);
    if (w->tmp)
        tp__cpu_cache_free(w->tmp);
}

static void work_destroy(mpi_work *w)
{
    work_clear(w);
    tp__free(w);
}

/* Puts w (an unfinished ring) on the stale list (mpi_stale_mu held). */
static void stale_add_locked(mpi_work *w)
{
    if (!w->ring || w->stale || w->complete)
        return;
    w->stale = true;
    w->stale_next = mpi_stale;
    mpi_stale = w;
    atomic_fetch_add(&mpi_nstale, 1);
}

static void stale_add(mpi_work *w)
{
    pthread_mutex_lock(&mpi_stale_mu);
    stale_add_locked(w);
    pthread_mutex_unlock(&mpi_stale_mu);
}

/* Takes w off the stale list (mpi_stale_mu held). */
static void stale_remove_locked(mpi_work *w)
{
    if (!w->stale)
        return;
    for (mpi_work **p = &mpi_stale; *p; p = &(*p)->stale_next)
        if (*p == w) {
            *p = w->stale_next;
            break;
        }
    w->stale = false;
    w->stale_next = NULL;
    atomic_fetch_sub(&mpi_nstale, 1);
}

/* One step of progress for every stale ring (mpi_stale_mu held; the MPI
 * call lock too when call_locked). A ring that ends, or whose messages MPI
 * fails, leaves the list. */
static void stale_progress_locked(bool call_locked)
{
    for (mpi_work *w = mpi_stale, *next = NULL; w; w = next) {
        next = w->stale_next;
        bool done = false;
        if (!call_locked)
            mpi_lock();
        int rc = tp__mpi_ring_progress(w->ring, &done);
        if (!call_locked)
            mpi_unlock();
        if (rc == MPI_SUCCESS && !done)
            continue;
        w->ring_done = done;
        stale_remove_locked(w);
    }
}

/* The same from a test or wait: skipped when another thread is at it. */
static void stale_progress(void)
{
    if (atomic_load_explicit(&mpi_nstale, memory_order_relaxed) == 0)
        return;
    if (pthread_mutex_trylock(&mpi_stale_mu) != 0)
        return;
    stale_progress_locked(false);
    pthread_mutex_unlock(&mpi_stale_mu);
}

/* Seconds the exit barrier waits once this process saw a fault: the peers
 * of a faulted job either reach the end soon or never. */
#define MPI_EXIT_GRACE_S 5.0

/* One test of the exit barrier's request (a tp__poll_fn); records no
 * message, so tp_last_error keeps the fault. */
static tp_status exit_poll(void *ctx, bool *done)
{
    int flag = 0;
    stale_progress_locked(true); /* a late peer may still need this rank's steps */
    if (MPI_Test(ctx, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS)
        return TP_ERR_BACKEND;
    *done = flag != 0;
    return TP_OK;
}

/* Before MPI_Finalize, which cannot time out: a non-blocking barrier of
 * every process on mpi_exit_comm, polled up to the default timeout (or
 * MPI_EXIT_GRACE_S after a fault). True when every process reached it, so
 * that MPI_Finalize returns; false (with a line on stderr, tp_last_error
 * untouched: it keeps the fault) when some did not. Called with mpi_mu
 * held. */
static bool mpi_exit_barrier(void)
{
    if (mpi_exit_comm == MPI_COMM_NULL)
        return true;
    double limit = tp__default_timeout();
    bool fault = atomic_load(&mpi_fault_seen);
    if (fault && limit > MPI_EXIT_GRACE_S)
        limit = MPI_EXIT_GRACE_S;
    MPI_Request req = MPI_REQUEST_NULL;
    const tp__pace pace = {.spin_s = mpi_yield ? 0 : HUGE_VAL, .yield_s = HUGE_VAL};
    tp_status st = TP_ERR_BACKEND;
    if (MPI_Ibarrier(mpi_exit_comm, &req) == MPI_SUCCESS)
        st = tp__poll_until(exit_poll, &req, limit, &pace);
    if (st == TP_OK) {
        MPI_Comm_free(&mpi_exit_comm);
        return true;
    }
    int wr = -1;
    MPI_Comm_rank(MPI_COMM_WORLD, &wr);
    fprintf(stderr,
            "libtp: MPI rank %d: %s within %.3g s; not calling MPI_Finalize, which would wait "
            "for them: this process can exit, and mpirun then ends the job\n",
            wr,
            fault ? "after a fault, not every rank freed its last libtp communicator"
                  : "not every rank freed its last libtp communicator",
            limit);
    fflush(stderr);
    return false;
}

/* Called with mpi_mu held when the last state goes: frees what libtp created
 * and finalizes MPI if libtp initialized it. */
static void mpi_teardown_locked(void)
{
    int fin = 0;
    MPI_Finalized(&fin);
    if (fin)
        return;
    /* a request MPI never completed may still reduce with the half ops once a
     * late peer's data arrives (MPI_Finalize progresses it too): keep them */
    if (mpi_types_ready && !mpi_faulted && !mpi_orphans) {
        for (int h = 0; h < 2; h++)
            for (int op = 0; op < TP_REDUCE_OP_COUNT; op++)
                if (op != TP_AVG)
                    MPI_Op_free(&mpi_half_ops[h][op]);
        MPI_Type_free(&mpi_half);
        mpi_types_ready = false;
    }
    if (mpi_owned && !mpi_exit_barrier()) {
        /* MPI_Finalize waits for every process of the job (OpenMPI fences
         * through its runtime): with a peer stopped, dead or cut off it
         * never returns. Leave MPI as it is; the process can exit, and
         * mpirun, seeing a rank end without MPI_Finalize, ends the job. */
        mpi_owned = false;
        mpi_abandoned = true;
        return;
    }
    if (mpi_owned) {
        MPI_Finalize();
        mpi_owned = false;
        /* MPI is gone, and with it the requests that could still write */
        while (mpi_orphans) {
            struct mpi_work *w = mpi_orphans;
            mpi_orphans = w->next;
            stale_remove_locked(w);
            work_destroy(w);
        }
    }
}

static void avg_divide(void *buf, tp_dtype dt, size_t n, int size)
{
    switch (dt) {
    case TP_F32: {
        float *p = buf;
        for (size_t i = 0; i < n; i++)
            p[i] /= (float)size;
        break;
    }
    case TP_F64: {
        double *p = buf;
        for (size_t i = 0; i < n; i++)
            p[i] /= (double)size;
        break;
    }
    case TP_I32: {
        int32_t *p = buf;
        for (size_t i = 0; i < n; i++)
            p[i] /= size;
        break;
    }
    case TP_I64: {
        int64_t *p = buf;
        for (size_t i = 0; i < n; i++)
            p[i] /= size;
        break;
    }
    case TP_F16: {
        uint16_t *p = buf;
        for (size_t i = 0; i < n; i++)
            p[i] = tp__f32_to_f16(tp__f16_to_f32(p[i]) / (float)size);
        break;
    }
    case TP_BF16: {
        uint16_t *p = buf;
        for (size_t i = 0; i < n; i++)
            p[i] = tp__f32_to_bf16(tp__bf16_to_f32(p[i]) / (float)size);
        break;
    }
    default:
        TP_ASSERT(!"invalid dtype");
    }
}

/* The reductions' part of work_finish: out of line, so that an all_gather
 * or all_to_all, which has none of it, finishes with its copy. */
__attribute__((noinline)) static void work_finish_reduce(mpi_state *S, mpi_work *w)
{
    if (w->direct && w->tmp) {
        tp_coll_desc d = {.kind = w->kind,
                          .dtype = w->dtype,
                          .count = w->count,
                          .sendbuf = w->send,
                          .recvbuf = w->result};
        mpi_lock();
        int rc = tp__mpi_direct_reduce(&d, w->tmp, S->rank, S->size, mpi_dtype(w->dtype),
                                       mpi_op(w->dtype, w->op));
        mpi_unlock();
        tp__cpu_cache_free(w->tmp);
        w->tmp = NULL;
        if (rc != MPI_SUCCESS) {
            w->finished = true;
            w->status = state_fail(S, tp__mpi_error(rc, "MPI_Reduce_local"));
            return;
        }
    } else if (w->tmp) {
        memcpy(w->result, w->tmp, w->count * tp_dtype_size(w->dtype));
        tp__cpu_cache_free(w->tmp);
        w->tmp = NULL;
    }
    if (w->op == TP_AVG && (w->kind == TP_COLL_ALL_REDUCE || w->kind == TP_COLL_REDUCE_SCATTER))
        avg_divide(w->result, w->dtype, w->count, S->size);
    w->finished = true;
    w->status = TP_OK;
}

/* MPI completed the request: copy a direct all_gather's or all_to_all's own
 * block, move an in-place reduce_scatter result into place, finish avg. */
static inline void work_finish(mpi_state *S, mpi_work *w)
{
    if (w->copy.left) { /* the own block of a direct all_gather or all_to_all */
        memcpy(w->copy.to, w->copy.from, w->copy.left);
        w->copy.left = 0;
    }
    if (w->tmp || w->op == TP_AVG) {
        work_finish_reduce(S, w);
        return;
    }
    w->finished = true;
    w->status = TP_OK;
}

/* MPI_Testall, or MPI_Test for one request: OpenMPI's MPI_Test looks at the
 * request again after the progress it makes, MPI_Testall only on its next
 * call, one call later than a blocking wait would notice. */
static inline int test_all(int n, MPI_Request *reqs, int *flag)
{
    return n == 1 ? MPI_Test(reqs, flag, MPI_STATUS_IGNORE)
                  : MPI_Testall(n, reqs, flag, MPI_STATUSES_IGNORE);
}

/* One MPI_Test of the requests, or with a ring one step of its progress
 * (which posts the next step's messages once the current ones completed);
 * *done once everything completed. */
static tp_status req_test(mpi_state *S, tp__mpi_ring *ring, int n, MPI_Request *reqs, bool *done,
                          const char *what)
{
    int flag = 0;
    bool fin = false;
    tp_status st = TP_OK;
    mpi_lock();
    int rc = ring ? tp__mpi_ring_progress(ring, &fin) : test_all(n, reqs, &flag);
    mpi_unlock();
    stale_progress();
    *done = true; /* an error is final */
    TP_MPI_CHECK_GOTO(what, rc, st, fail);
    *done = ring ? fin : flag != 0;
    return TP_OK;
fail:
    return state_fail(S, st);
}

/* OpenMPI yields inside its progress loop when mpirun says the node is
 * oversubscribed (or when told to): a second yield here only adds latency. */
static bool mpi_library_yields(void)
{
    const char *y = getenv("OMPI_MCA_mpi_yield_when_idle");
    if (y && *y)
        return strcmp(y, "0") != 0 && strcmp(y, "false") != 0;
    const char *o = getenv("OMPI_MCA_mpi_oversubscribe");
    return o && (strcmp(o, "1") == 0 || strcmp(o, "true") == 0);
}

typedef struct req_wait_ctx {
    mpi_state *S;
    tp__mpi_ring *ring;
    int n;
    MPI_Request *reqs;
    const char *what;
    bool done; /* MPI completed the request, or reported an error for it */
} req_wait_ctx;

/* One test of the request (a tp__poll_fn); an abort of S ends the wait. */
static tp_status req_poll(void *ctx, bool *done)
{
    req_wait_ctx *q = ctx;
    TP_CHECK(req_test(q->S, q->ring, q->n, q->reqs, &q->done, q->what));
    *done = q->done;
    if (!q->done && tp__abort_is_set(&q->S->abort))
        return tp__abort_error(&q->S->abort);
    return TP_OK;
}

/* Polls a request until it completes, the state is aborted or timeout_s
 * passes (then the state is aborted: MPI cannot cancel the request). *done
 * tells whether MPI is done with the request (completed, or failed it).
 * MPI_Test is the progress engine (OpenMPI moves one fragment of a large
 * message per call), so any sleep or pause between tests costs bandwidth
 * or latency: poll as MPI_Wait does, back to back, but yield the core when
 * this node runs more ranks than it has cores and MPI does not yield by
 * itself. The clock is read every 64th
 * test only (a test costs 0.05-0.1 us, the clock 0.02-0.05 us: 7% of a
 * 4 KiB all_gather's profile when read on every test, 4% on every 16th). */
static tp_status req_wait(mpi_state *S, tp__mpi_ring *ring, int n, MPI_Request *reqs,
                          double timeout_s, const char *what, bool *done)
{
    /* the first tests, where a small exchange completes: MPI_Testall alone,
     * while nothing else needs a turn (no ring, no stale ring, no lock) */
    if (!ring && !mpi_serialize && atomic_load_explicit(&mpi_nstale, memory_order_relaxed) == 0) {
        for (int i = 0; i < 64 && !tp__abort_is_set(&S->abort); i++) {
            int flag = 0;
            int rc = test_all(n, reqs, &flag);
            if (rc != MPI_SUCCESS || flag) {
                *done = true; /* an error is final, as in req_test */
                return rc == MPI_SUCCESS ? TP_OK : state_fail(S, tp__mpi_error(rc, what));
            }
        }
    }
    const tp__pace pace = {
        .spin_s = mpi_yield ? 0 : HUGE_VAL, .yield_s = HUGE_VAL, .every = 64, .no_pause = true};
    req_wait_ctx q = {.S = S, .ring = ring, .n = n, .reqs = reqs, .what = what};
    tp_status st = tp__poll_until(req_poll, &q, timeout_s, &pace);
    *done = q.done;
    if (st != TP_ERR_TIMEOUT)
        return st;
    char why[300];
    snprintf(why, sizeof why,
             "rank %d (MPI_COMM_WORLD rank %d) timed out after %.3g s waiting for %s "
             "(MPI cannot cancel it: the communicator is unusable now)",
             S->rank, S->world_rank, timeout_s, what);
    state_abort(S, why);
    return tp__error(TP_ERR_TIMEOUT, "%s", why);
}

/* ---- the backend ---------------------------------------------------------- */

static const char *const mpi_call_names[TP_COLL_KIND_COUNT] = {
    [TP_COLL_ALL_REDUCE] = "MPI_Iallreduce",
    [TP_COLL_ALL_GATHER] = "MPI_Iallgather",
    [TP_COLL_REDUCE_SCATTER] = "MPI_Ireduce_scatter_block",
    [TP_COLL_ALL_TO_ALL] = "MPI_Ialltoall",
    [TP_COLL_BROADCAST] = "MPI_Ibcast",
    [TP_COLL_BARRIER] = "MPI_Ibarrier",
    [TP_COLL_SCATTER] = "MPI_Iscatter",
};

/* post_nbc and post_direct's answers besides MPI's codes (all positive) */
enum { POST_NO_MEMORY = -1, POST_INVALID = -2 };

/* One of MPI's non-blocking collectives for `d` into w->req. Returns MPI's
 * code, or POST_NO_MEMORY / POST_INVALID. */
static int post_nbc(mpi_state *S, const tp_coll_desc *d, mpi_work *w)
{
    int k = (int)d->count;
    size_t es = tp_dtype_size(d->dtype);
    MPI_Datatype dt = d->kind == TP_COLL_BARRIER ? MPI_DATATYPE_NULL : mpi_dtype(d->dtype);
    bool red = d->kind == TP_COLL_ALL_REDUCE || d->kind == TP_COLL_REDUCE_SCATTER;
    MPI_Op op = red ? mpi_op(d->dtype, d->op) : MPI_OP_NULL;
    const char *rbuf = d->recvbuf, *sbuf = d->sendbuf;
    size_t block = (size_t)S->rank * d->count * es;
    int rc = MPI_SUCCESS;

    mpi_lock();
    switch (d->kind) {
    case TP_COLL_ALL_REDUCE:
        rc = MPI_Iallreduce(sbuf == rbuf ? MPI_IN_PLACE : d->sendbuf, d->recvbuf, k, dt, op,
                            S->comm, &w->req);
        break;
    case TP_COLL_ALL_GATHER:
        if (sbuf == rbuf + block)
            rc = MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, d->recvbuf, k, dt, S->comm,
                                &w->req);
        else
            rc = MPI_Iallgather(d->sendbuf, k, dt, d->recvbuf, k, dt, S->comm, &w->req);
        break;
    case TP_COLL_REDUCE_SCATTER:
        if (rbuf == sbuf + block) {
            /* MPI's in-place form reduces the whole send buffer into its first
             * block and leaves the rest undefined; the comm.h form is a
             * result in this rank's block with the others untouched, so the
             * result goes through a temporary */
            w->tmp = tp__cpu_cache_alloc(d->count * es, false);
            if (!w->tmp) {
                mpi_unlock();
                return POST_NO_MEMORY;
            }
            rc = MPI_Ireduce_scatter_block(d->sendbuf, w->tmp, k, dt, op, S->comm, &w->req);
        } else {
            rc = MPI_Ireduce_scatter_block(d->sendbuf, d->recvbuf, k, dt, op, S->comm,
                                           &w->req);
        }
        break;
    case TP_COLL_ALL_TO_ALL:
        rc = MPI_Ialltoall(d->sendbuf, k, dt, d->recvbuf, k, dt, S->comm, &w->req);
        break;
    case TP_COLL_BROADCAST:
        rc = MPI_Ibcast(d->recvbuf, k, dt, d->root, S->comm, &w->req);
        break;
    case TP_COLL_BARRIER:
        rc = MPI_Ibarrier(S->comm, &w->req);
        break;
    case TP_COLL_SCATTER:
        /* the send arguments matter on root only; root's block is `block` */
        if (S->rank == d->root && rbuf == sbuf + block)
            rc = MPI_Iscatter(d->sendbuf, k, dt, MPI_IN_PLACE, k, dt, d->root, S->comm,
                              &w->req);
        else
            rc = MPI_Iscatter(d->sendbuf, k, dt, d->recvbuf, k, dt, d->root, S->comm, &w->req);
        break;
    default:
        rc = POST_INVALID;
        break;
    }
    mpi_unlock();
    return rc;
}

/* The direct path (mpi_direct.c): point-to-point messages into w->reqs. */
/* Frees a slot's requests (inactive: MPI owns nothing of them), under the
 * lock. */
static void persist_free(mpi_persist *p)
{
    for (int i = 0; i < p->nreq; i++)
        if (p->reqs[i] != MPI_REQUEST_NULL)
            (void)MPI_Request_free(&p->reqs[i]);
    p->nreq = 0;
}

/* A blocking call whose persistent requests MPI may still hold (its wait
 * failed, or MPI_Startall did): the work takes the handles into its own
 * array, as any other work's requests, and the slot forgets them (the
 * communicator is failed: the requests are left to MPI, never freed). */
static void persist_detach(mpi_work *w)
{
    if (!w->persist)
        return;
    memcpy(w->inl, w->reqs, (size_t)w->nreq * sizeof *w->inl);
    w->reqs = w->inl;
    w->persist->nreq = 0;
    w->persist = NULL;
}

/* Whether a blocking call `d` goes through a persistent slot: an
 * all_gather, all_to_all or broadcast on two ranks, the slots on. */
static inline bool persist_applies(const mpi_state *S, const tp_coll_desc *d, bool blocking)
{
    return blocking && S->size == 2 && S->persist_on && !tp__mpi_direct_is_reduction(d->kind);
}

/* w takes slot p's requests (started, or about to be). */
static void persist_attach(mpi_work *w, mpi_persist *p)
{
    w->direct = true;
    w->persist = p;
    w->reqs = p->reqs;
    w->nreq = p->nreq;
    w->copy = p->copy;
}

static bool persist_matches(const mpi_persist *q, const tp_coll_desc *d)
{
    return q->nreq && q->send == d->sendbuf && q->recv == d->recvbuf && q->count == d->count &&
           q->kind == d->kind && q->dtype == d->dtype && q->root == d->root;
}

/* The slot that holds the buffers of `d`, or NULL. */
static inline mpi_persist *persist_find(mpi_state *S, const tp_coll_desc *d)
{
    for (int i = 0; i < MPI_PERSIST_SLOTS; i++)
        if (persist_matches(&S->persist[i], d))
            return &S->persist[i];
    return NULL;
}

/* A blocking exchange on two ranks through the slot of its buffers (made
 * over, the least recently used one, when none has them), started. Returns
 * MPI's code; w->nreq is 0 when nothing was started. */
static int post_persistent(mpi_state *S, const tp_coll_desc *d, mpi_work *w)
{
    mpi_persist *p = persist_find(S, d), *lru = &S->persist[0];
    for (int i = 1; !p && i < MPI_PERSIST_SLOTS; i++) {
        mpi_persist *q = &S->persist[i];
        if (lru->nreq && (!q->nreq || q->used < lru->used))
            lru = q;
    }
    w->direct = true;
    w->nreq = 0;
    int rc = MPI_SUCCESS;
    mpi_lock();
    if (!p) {
        p = lru;
        persist_free(p);
        int n = 0;
        rc = tp__mpi_direct_post(d, S->comm, S->rank, S->size, mpi_dtype(d->dtype), S->split, true,
                                 NULL, p->reqs, &n, &p->copy);
        p->nreq = n;
        if (rc != MPI_SUCCESS) {
            persist_free(p); /* made, never started */
            mpi_unlock();
            return rc;
        }
        p->kind = d->kind;
        p->dtype = d->dtype;
        p->root = d->root;
        p->count = d->count;
        p->send = d->sendbuf;
        p->recv = d->recvbuf;
    }
    p->used = ++S->persist_clock;
    persist_attach(w, p);
    rc = p->nreq ? MPI_Startall(p->nreq, p->reqs) : MPI_SUCCESS;
    mpi_unlock();
    return rc;
}

static int post_direct(mpi_state *S, const tp_coll_desc *d, mpi_work *w, bool blocking)
{
    if (persist_applies(S, d, blocking))
        return post_persistent(S, d, w);
    int max = tp__mpi_direct_max_requests(S->size);
    size_t scratch = tp__mpi_direct_scratch(d, S->size);
    w->nreq = 0; /* nothing posted: a failure below leaves MPI nothing */
    w->reqs = max <= MPI_INLINE_REQS ? w->inl : tp__calloc((size_t)max, sizeof *w->reqs);
    w->tmp = scratch ? tp__cpu_cache_alloc(scratch, false) : NULL;
    if (!w->reqs || (scratch && !w->tmp))
        return POST_NO_MEMORY;
    w->direct = true;
    mpi_lock();
    int rc = tp__mpi_direct_post(d, S->comm, S->rank, S->size, mpi_dtype(d->dtype), S->split, false,
                                 w->tmp, w->reqs, &w->nreq, &w->copy);
    mpi_unlock();
    return rc;
}

/* The ring path (mpi_ring.c): its schedule in w->ring, step 0 posted. */
static int post_ring(mpi_state *S, const tp_coll_desc *d, mpi_work *w)
{
    int tag = (int)(S->ring_seq++ % TP__MPI_RING_TAGS);
    w->ring = tp__mpi_ring_new(d, S->comm, S->rank, S->size, mpi_dtype(d->dtype),
                               mpi_op(d->dtype, d->op), tag);
    if (!w->ring)
        return POST_NO_MEMORY;
    w->reqs = tp__mpi_ring_requests(w->ring);
    w->nreq = 2;
    bool done = false;
    mpi_lock();
    int rc = tp__mpi_ring_progress(w->ring, &done);
    mpi_unlock();
    return rc;
}

/* A blocking call's work (on the stack) that MPI still owns after a failed
 * wait moves to the heap, onto S's zombies, holding references on the
 * caller's tensors: MPI may still write them, and a ring goes on driving
 * itself for peers that join late. Without memory for the move the tensors
 * are kept for good rather than ever freed under MPI. */
static void work_abandon_local(mpi_state *S, mpi_work *local, const tp_coll_desc *d)
{
    tp_tensor *send = tp_tensor_retain((tp_tensor *)d->send);
    tp_tensor *recv = d->recv != d->send ? tp_tensor_retain(d->recv) : NULL;
    mpi_work *w = tp__malloc(sizeof *w);
    if (!w)
        return; /* the references above are never dropped */
    *w = *local;
    if (local->reqs == &local->req)
        w->reqs = &w->req;
    else if (local->reqs == local->inl)
        w->reqs = w->inl;
    w->keep[0] = send;
    w->keep[1] = recv;
    pthread_mutex_lock(&S->mu);
    w->next = S->zombies;
    S->zombies = w;
    stale_add(w);
    pthread_mutex_unlock(&S->mu);
}

/* A blocking call (tp__comm_blocking_call) runs to its end here, its work
 * on the stack: no allocation, no work list, no tensor references, which
 * are a tenth of a 4 KiB exchange's time. */
static tp_status run_blocking(mpi_state *S, mpi_work *w, const tp_coll_desc *d)
{
    bool fin = false;
    tp_status st =
        req_wait(S, w->ring, w->nreq, w->reqs, d->timeout_s, tp_coll_kind_name(w->kind), &fin);
    if (st == TP_OK) {
        w->complete = true;
        work_finish(S, w);
        st = w->status;
    }
    if (st != TP_OK)
        persist_detach(w); /* the communicator is failed: its slots go with it */
    if (st == TP_OK || fin)
        work_clear(w); /* MPI is done with the requests */
    else
        work_abandon_local(S, w, d);
    return st;
}

static void work_init(mpi_work *w, const tp_coll_desc *d)
{
    memset(w, 0, offsetof(mpi_work, inl));
    w->req = MPI_REQUEST_NULL;
    w->reqs = &w->req;
    w->nreq = 1;
    w->kind = d->kind;
    w->dtype = d->dtype;
    w->op = d->op;
    w->count = d->count;
    w->send = d->sendbuf;
    w->result = d->recvbuf;
}

/* A blocking two-rank exchange whose buffers slot p holds (its requests
 * inactive): started and waited for with no work object, the general
 * path's on a failure only (`local`, set up then for run_blocking's and
 * mpi_collective's failure handling). The work object's setup was a fifth
 * of libtp's own instructions in a 4 KiB broadcast. */
static tp_status run_persist_hit(mpi_state *S, mpi_persist *p, const tp_coll_desc *d,
                                 mpi_work *local)
{
    mpi_lock();
    p->used = ++S->persist_clock;
    int rc = MPI_Startall(p->nreq, p->reqs);
    mpi_unlock();
    tp_status st = TP_OK;
    bool fin = false;
    if (rc == MPI_SUCCESS) {
        st = req_wait(S, NULL, p->nreq, p->reqs, d->timeout_s, tp_coll_kind_name(d->kind), &fin);
        if (st == TP_OK) {
            if (p->copy.left)
                memcpy(p->copy.to, p->copy.from, p->copy.left);
            return TP_OK;
        }
    }
    work_init(local, d);
    persist_attach(local, p);
    persist_detach(local); /* the communicator is failed: its slots go with it */
    if (rc != MPI_SUCCESS) {
        st = tp__mpi_error(rc, "MPI_Startall");
        fin = false;
    }
    if (fin)
        work_clear(local); /* MPI is done with the requests */
    else
        work_abandon_local(S, local, d);
    return rc != MPI_SUCCESS ? state_fail(S, st) : st;
}

static tp_status mpi_collective(void *state, const tp_coll_desc *d, void **work)
{
    mpi_state *S = state;
    *work = NULL;
    if (tp__abort_is_set(&S->abort))
        return tp__abort_error(&S->abort);
    if (d->device.type != TP_DEVICE_CPU)
        return tp__error(TP_ERR_NOT_SUPPORTED, "backend 'mpi' moves CPU tensors only");
    if (d->kind != TP_COLL_BARRIER && d->count == 0)
        return TP_OK; /* every rank has the same count (comm.h), so none moves data */
    if (d->count > INT_MAX)
        return tp__error(TP_ERR_NOT_SUPPORTED,
                         "backend 'mpi': %zu elements per rank exceed MPI's int count", d->count);

    bool blocking = tp__comm_blocking_call(d);
    mpi_work local;
    if (persist_applies(S, d, blocking)) {
        mpi_persist *p = persist_find(S, d);
        if (p)
            return run_persist_hit(S, p, d, &local);
    }
    mpi_work *w = blocking ? &local : tp__malloc(sizeof *w);
    if (!w)
        return state_fail(
            S, tp__error(TP_ERR_NO_MEMORY, "backend 'mpi': out of memory for the work object"));
    work_init(w, d);
    if (!blocking) {
        w->keep[0] = tp_tensor_retain((tp_tensor *)d->send);
        w->keep[1] = d->recv != d->send ? tp_tensor_retain(d->recv) : NULL;
    }

    bool direct = tp__mpi_direct_fits(d, S->size, S->direct_bytes, S->apart);
    bool ring = !direct && tp__mpi_ring_fits(d, S->size, direct, S->ring_on);
    int rc = direct ? post_direct(S, d, w, blocking)
             : ring ? post_ring(S, d, w)
                    : post_nbc(S, d, w);
    tp_status st = TP_OK;
    if (rc == POST_INVALID) {
        work_clear(w);
        if (!blocking)
            tp__free(w);
        return tp__error(TP_ERR_INVALID_ARG, "backend 'mpi': invalid collective kind");
    }
    if (rc == POST_NO_MEMORY) {
        st = tp__error(TP_ERR_NO_MEMORY, "backend 'mpi': out of memory for the %s",
                       direct ? "direct path's messages"
                       : ring ? "ring's blocks"
                              : "in-place reduce_scatter");
        goto fail;
    }
    TP_MPI_CHECK_GOTO(direct || ring ? "MPI_Isend/MPI_Irecv" : mpi_call_names[d->kind], rc, st,
                      fail);
    if (blocking)
        return run_blocking(S, w, d);
    pthread_mutex_lock(&S->mu);
    w->next = S->active;
    S->active = w;
    S->timeout_s = d->timeout_s;
    pthread_mutex_unlock(&S->mu);
    *work = w;
    return TP_OK;
fail:
    persist_detach(w);
    if ((direct || w->ring) && w->nreq > 0) {
        /* some messages went out: MPI owns them and their buffers now */
        if (blocking) {
            work_abandon_local(S, w, d);
        } else {
            pthread_mutex_lock(&S->mu);
            w->next = S->zombies;
            S->zombies = w;
            pthread_mutex_unlock(&S->mu);
        }
    } else {
        work_clear(w);
        if (!blocking)
            tp__free(w);
    }
    return state_fail(S, st);
}

static tp_status mpi_work_test(void *state, void *work, bool *done)
{
    mpi_state *S = state;
    mpi_work *w = work;
    *done = false;
    if (w->finished) {
        *done = true;
        return w->status;
    }
    bool fin = false;
    tp_status st = req_test(S, w->ring, w->nreq, w->reqs, &fin, mpi_call_names[w->kind]);
    if (st != TP_OK) {
        w->complete = w->finished = true;
        w->status = st;
        *done = true;
        return st;
    }
    if (fin) {
        w->complete = true;
        work_finish(S, w);
        *done = true;
        return TP_OK;
    }
    if (tp__abort_is_set(&S->abort)) {
        *done = true;
        return tp__abort_error(&S->abort);
    }
    return TP_OK;
}

static tp_status mpi_work_wait(void *state, void *work, double timeout_s)
{
    mpi_state *S = state;
    mpi_work *w = work;
    if (w->finished)
        return w->status;
    bool fin = false;
    tp_status st =
        req_wait(S, w->ring, w->nreq, w->reqs, timeout_s, tp_coll_kind_name(w->kind), &fin);
    if (st == TP_OK) {
        w->complete = true;
        work_finish(S, w);
        return TP_OK;
    }
    if (fin) {
        /* MPI reported an error for the request */
        w->complete = w->finished = true;
        w->status = st;
    }
    return st;
}

static void mpi_work_free(void *state, void *work)
{
    mpi_state *S = state;
    mpi_work *w = work;
    if (!w)
        return;
    pthread_mutex_lock(&S->mu);
    list_remove(&S->active, w);
    if (!w->complete) {
        /* MPI still owns the request and may write w->tmp: keep both (a
         * ring goes on driving itself, for peers that join late) */
        w->next = S->zombies;
        S->zombies = w;
        stale_add(w);
        w = NULL;
    }
    pthread_mutex_unlock(&S->mu);
    if (w)
        work_destroy(w);
}

static tp_status state_create(MPI_Comm comm, mpi_state **out)
{
    mpi_state *S = tp__calloc(1, sizeof *S);
    if (!S)
        return tp__error(TP_ERR_NO_MEMORY, "backend 'mpi': out of memory for the communicator");
    S->comm = comm;
    tp_status st = TP_OK;
    TP_MPI_CHECK_GOTO("MPI_Comm_set_errhandler", MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN),
                      st, fail);
    TP_MPI_CHECK_GOTO("MPI_Comm_rank", MPI_Comm_rank(comm, &S->rank), st, fail);
    TP_MPI_CHECK_GOTO("MPI_Comm_size", MPI_Comm_size(comm, &S->size), st, fail);
    TP_MPI_CHECK_GOTO("MPI_Comm_rank (MPI_COMM_WORLD)",
                      MPI_Comm_rank(MPI_COMM_WORLD, &S->world_rank), st, fail);
    pthread_mutex_init(&S->mu, NULL);
    tp__abort_init(&S->abort);
    S->direct_bytes = tp__mpi_direct_limit();
    S->ring_on = tp__mpi_ring_enabled();
    const char *persist = getenv("TP_MPI_PERSISTENT");
    S->persist_on = !(persist && strcmp(persist, "0") == 0);
    *out = S;
    return TP_OK;
fail:
    tp__free(S);
    return st;
}

static void mpi_free(void *state)
{
    mpi_state *S = state;
    if (!S)
        return;
    int fin = 0;
    MPI_Finalized(&fin);
    /* pending work is waited for first (comm.h), up to the communicator's
     * timeout, unless the communicator is unusable anyway */
    pthread_mutex_lock(&S->mu);
    double timeout = S->timeout_s > 0 ? S->timeout_s : tp__default_timeout();
    pthread_mutex_unlock(&S->mu);
    for (mpi_work *w = S->active; w && !fin && !tp__abort_is_set(&S->abort); w = w->next) {
        if (w->complete)
            continue;
        bool done = false;
        if (req_wait(S, w->ring, w->nreq, w->reqs, timeout, tp_coll_kind_name(w->kind), &done) ==
            TP_OK) {
            w->complete = true;
            work_finish(S, w);
        } else if (done) {
            w->complete = w->finished = true;
        }
    }
    pthread_mutex_lock(&mpi_mu);
    pthread_mutex_lock(&mpi_stale_mu);
    mpi_lock();
    /* A communicator with a request MPI may never complete is faulted: an
     * abort or timeout (including a split's barrier, whose request is not
     * kept), or work still pending. */
    bool faulted = tp__abort_is_set(&S->abort);
    for (mpi_work *w = S->active; w; w = w->next)
        faulted = faulted || !w->complete;
    /* zombies MPI finished since can go; the rest stay with MPI, buffers and
     * all, until it is finalized */
    for (mpi_work *w = S->zombies, *next = NULL; w; w = next) {
        next = w->next;
        int flag = 0;
        /* a ring is done when its last step is (it drives itself while
         * stale: an orphan stays on the stale list) */
        bool gone = fin || (w->ring ? !w->stale && w->ring_done
                                    : MPI_Testall(w->nreq, w->reqs, &flag, MPI_STATUSES_IGNORE) ==
                                              MPI_SUCCESS &&
                                          flag);
        if (gone) {
            stale_remove_locked(w);
            work_destroy(w);
        } else {
            w->next = mpi_orphans;
            mpi_orphans = w;
            faulted = true;
        }
    }
    /* MPI cannot cancel a collective request (MPI_Cancel is for point-to-point
     * only), and a peer that joins late makes MPI progress it at any later
     * MPI call, MPI_Finalize's own progress loop included: the next round's
     * sends go out on this communicator. Freeing it under the request crashes
     * OpenMPI there (mca_pml_ob1_isend on a freed communicator), so a faulted
     * communicator is left to MPI, deliberately unfreed; MPI_Finalize tolerates
     * the pending request, and a late peer's collective may even complete. */
    for (int i = 0; i < MPI_PERSIST_SLOTS && !fin; i++)
        persist_free(&S->persist[i]); /* inactive: every blocking call completed or detached */
    if (!fin && !faulted)
        MPI_Comm_free(&S->comm);
    else if (!fin)
        mpi_faulted++;
    pthread_mutex_destroy(&S->mu);
    tp__abort_destroy(&S->abort);
    tp__free(S);
    if (--mpi_live == 0)
        mpi_teardown_locked();
    mpi_unlock();
    pthread_mutex_unlock(&mpi_stale_mu);
    pthread_mutex_unlock(&mpi_mu);
}

static void mpi_abort(void *state, const char *reason)
{
    mpi_state *S = state;
    char why[TP__ABORT_REASON_LEN];
    snprintf(why, sizeof why, "rank %d aborted: %s", S->rank, reason ? reason : "");
    state_abort(S, why);
}

/* Whether the two ranks of `comm` share no node, from the size of this
 * rank's MPI_COMM_TYPE_SHARED part of it (`local`: 1 when apart); the same
 * answer on both ranks. */
static bool pair_apart(int size, int local)
{
    bool apart = size == 2 && local == 1;
    if (apart && TP_LOG_ON(TP_LOG_INFO))
        tp__log(TP_LOG_INFO,
                "mpi: the two ranks are on two nodes: their collectives go as one exchange (the "
                "direct path), reductions up to %zu MiB per rank",
                TP__MPI_APART_DIRECT_MAX >> 20);
    return apart;
}

/* The size of this rank's MPI_COMM_TYPE_SHARED part of `comm` (its ranks
 * on this node). Collective over comm. Returns MPI's code. */
static int node_ranks(MPI_Comm comm, int *local)
{
    MPI_Comm node = MPI_COMM_NULL;
    int rc = MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
    if (rc == MPI_SUCCESS) {
        rc = MPI_Comm_size(node, local);
        MPI_Comm_free(&node);
    }
    return rc;
}

static tp_status mpi_split(void *state, int color, int key, double timeout_s, void **new_state,
                           int *new_rank, int *new_size)
{
    mpi_state *S = state;
    *new_state = NULL;
    if (tp__abort_is_set(&S->abort))
        return tp__abort_error(&S->abort);
    /* MPI_Comm_split cannot time out: a non-blocking barrier first makes a
     * peer that never joins a timeout here instead of a hang there */
    MPI_Request req = MPI_REQUEST_NULL;
    mpi_lock();
    int rc = MPI_Ibarrier(S->comm, &req);
    mpi_unlock();
    tp_status st = TP_OK;
    TP_MPI_CHECK_GOTO("MPI_Ibarrier (split)", rc, st, fail);
    bool fin = false;
    st = req_wait(S, NULL, 1, &req, timeout_s, "comm_split", &fin);
    if (st != TP_OK)
        return st; /* the barrier request stays with MPI; S is aborted */

    MPI_Comm nc = MPI_COMM_NULL;
    mpi_lock();
    rc = MPI_Comm_split(S->comm, color < 0 ? MPI_UNDEFINED : color, key, &nc);
    mpi_unlock();
    TP_MPI_CHECK_GOTO("MPI_Comm_split", rc, st, fail);
    if (nc == MPI_COMM_NULL)
        return TP_OK;
    /* a two-rank split asks whether its ranks share a node (both ask) */
    int nsize = 0, local = 0;
    mpi_lock();
    rc = MPI_Comm_size(nc, &nsize);
    if (rc == MPI_SUCCESS && nsize == 2)
        rc = node_ranks(nc, &local);
    if (rc != MPI_SUCCESS)
        MPI_Comm_free(&nc);
    mpi_unlock();
    TP_MPI_CHECK_GOTO("MPI_Comm_split_type (split)", rc, st, fail);
    mpi_state *N = NULL;
    pthread_mutex_lock(&mpi_mu);
    mpi_lock();
    st = state_create(nc, &N);
    if (st == TP_OK) {
        N->timeout_s = timeout_s;
        N->split = S->split;
        N->apart = pair_apart(N->size, local);
        mpi_live++;
    }
    else
        MPI_Comm_free(&nc);
    mpi_unlock();
    pthread_mutex_unlock(&mpi_mu);
    if (st != TP_OK)
        return st;
    *new_state = N;
    *new_rank = N->rank;
    *new_size = N->size;
    return TP_OK;
fail:
    return state_fail(S, st);
}

static int ncpu(void)
{
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

static tp_status mpi_init_world(void *options, void **state, int *rank, int *size)
{
    tp_status st = TP_OK;
    MPI_Comm parent = options ? *(const MPI_Comm *)options : MPI_COMM_WORLD;
    MPI_Comm comm = MPI_COMM_NULL;
    mpi_state *S = NULL;
    pthread_mutex_lock(&mpi_mu);
    int inited = 0, fin = 0, level = MPI_THREAD_SINGLE;
    MPI_Initialized(&inited);
    MPI_Finalized(&fin);
    if (fin) {
        st = tp__error(TP_ERR_STATE,
                       "tp_comm_create_world: MPI was finalized already (libtp finalizes MPI when "
                       "the last 'mpi' communicator is freed if it initialized MPI) and "
                       "cannot be initialized again");
        goto out;
    }
    if (mpi_abandoned) {
        st = tp__error(TP_ERR_STATE,
                       "tp_comm_create_world: libtp left MPI unfinalized after a fault (a peer "
                       "did not reach the end); MPI cannot be used again in this process");
        goto out;
    }
    if (!inited) {
        TP_MPI_CHECK_GOTO("MPI_Init_thread",
                          MPI_Init_thread(NULL, NULL, MPI_THREAD_MULTIPLE, &level), st, out);
        mpi_owned = true;
        atomic_store(&mpi_fault_seen, false);
        if (MPI_Comm_dup(MPI_COMM_WORLD, &mpi_exit_comm) == MPI_SUCCESS)
            MPI_Comm_set_errhandler(mpi_exit_comm, MPI_ERRORS_RETURN);
        else
            mpi_exit_comm = MPI_COMM_NULL;
    } else {
        MPI_Query_thread(&level);
    }
    mpi_serialize = level < MPI_THREAD_MULTIPLE;
    mpi_lock();
    if ((st = mpi_types_create()) != TP_OK)
        goto fail;
    if (parent == MPI_COMM_NULL) {
        st = tp__error(TP_ERR_INVALID_ARG, "tp_comm_create_world: options point to MPI_COMM_NULL");
        goto fail;
    }
    TP_MPI_CHECK_GOTO("MPI_Comm_dup", MPI_Comm_dup(parent, &comm), st, fail);
    if ((st = state_create(comm, &S)) != TP_OK) {
        MPI_Comm_free(&comm);
        goto fail;
    }
    TP_MPI_CHECK_GOTO("measuring the 2-4 KiB message split",
                      tp__mpi_direct_decide_split(comm, S->rank, S->size, &S->split), st,
                      fail_state);
    /* ranks sharing this node's cores decide how politely to wait, and two
     * ranks whether they share a node at all */
    int local = 0;
    TP_MPI_CHECK_GOTO("MPI_Comm_split_type", node_ranks(comm, &local), st, fail_state);
    mpi_yield = local > ncpu() && !mpi_library_yields();
    S->apart = pair_apart(S->size, local);
    mpi_live++;
    *state = S;
    *rank = S->rank;
    *size = S->size;
    mpi_unlock();
    goto out;
fail_state:
    pthread_mutex_destroy(&S->mu);
    tp__abort_destroy(&S->abort);
    tp__free(S);
    MPI_Comm_free(&comm);
fail:
    if (mpi_live == 0)
        mpi_teardown_locked();
    mpi_unlock();
out:
    pthread_mutex_unlock(&mpi_mu);
    return st;
}

/* No descriptor comparison of its own (checks_descriptors). */
const tp_backend tp__mpi_backend = {
    .name = "mpi",
    .device_mask = 1u << TP_DEVICE_CPU,
    .collective = mpi_collective,
    .work_test = mpi_work_test, .work_wait = mpi_work_wait, .work_free = mpi_work_free,
    .split = mpi_split, .abort = mpi_abort, .free = mpi_free,
    .init_world = mpi_init_world,
};
