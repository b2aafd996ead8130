/*
 * The nccl backend: one GPU per rank; every collective is an NCCL operation
 * on a communication stream of the communicator, completed through a CUDA
 * event.
 *
 * World. tp_comm_create_world("nccl", &opts, &comm) (tp_nccl_options in comm.h) is
 * collective over the bootstrap communicator: rank 0 creates the
 * ncclUniqueId, tp_broadcast carries it to the others, and an all_reduce of
 * a "ready" flag makes every rank agree that all of them found their device
 * before any enters ncclCommInitRankConfig (so a bad device on one rank is an
 * error everywhere rather than a hang). Without a bootstrap the world comes
 * from a temporary "mpi" communicator that this state keeps until it is
 * freed: freeing it earlier could finalize MPI under the program.
 *
 * Streams. A communicator owns a non-blocking communication stream on its
 * device. Each collective first makes that stream wait (cudaStreamWaitEvent)
 * on an event recorded on the calling thread's compute stream
 * (tp__cuda_stream), so NCCL reads finished inputs, then records a completion
 * event after the NCCL call. Waiting polls that event together with
 * ncclCommGetAsyncError until completion, an NCCL error, an abort or the
 * timeout; on completion the waiting thread's compute stream is made to wait
 * on the event as well, so later libtp kernels are ordered after the result
 * even from the device's point of view.
 *
 * Failure. Communicators are created non-blocking (ncclConfig_t.blocking = 0,
 * NCCL >= 2.14) so that no NCCL call can hang: calls that answer
 * ncclInProgress are polled under the timeout. A timeout, an NCCL error or
 * tp_comm_abort calls ncclCommAbort, which also stops the kernels still
 * running; later calls return TP_ERR_ABORTED. NCCL has no cross-rank abort
 * notification: peers of an aborted rank learn of it through their own
 * timeouts (as with mpi). Every NCCL call on a communicator happens under
 * its mutex, so an abort from another thread never races a call on the
 * freed communicator.
 */
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

/* nccl.h declares ncclGroupStart() and ncclGroupEnd() without prototypes */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wstrict-prototypes"
#include <nccl.h>
#pragma GCC diagnostic pop

#include "collectives/abort.h"
#include "collectives/check.h"
#include "collectives/coll.h"
#include "collectives/poll.h"
#include "core/cuda_rt.h"

#if NCCL_VERSION_CODE < NCCL_VERSION(2, 10, 0)
#error "libtp's nccl backend needs NCCL >= 2.10 (ncclAvg, ncclBfloat16)"
#endif
#define NCCL_HAS_LAST_ERROR (NCCL_VERSION_CODE >= NCCL_VERSION(2, 13, 0))
#define NCCL_HAS_CONFIG (NCCL_VERSION_CODE >= NCCL_VERSION(2, 14, 0))
#define NCCL_HAS_SPLIT (NCCL_VERSION_CODE >= NCCL_VERSION(2, 18, 0))

/* ---- type and op translation ---------------------------------------------- */

static const ncclDataType_t nccl_dtypes[TP_DTYPE_COUNT] = {
    [TP_F32] = ncclFloat32, [TP_F64] = ncclFloat64, [TP_F16] = ncclFloat16,
    [TP_BF16] = ncclBfloat16, [TP_I32] = ncclInt32, [TP_I64] = ncclInt64,
};

static const ncclRedOp_t nccl_ops[TP_REDUCE_OP_COUNT] = {
    [TP_SUM] = ncclSum, [TP_AVG] = ncclAvg, [TP_MAX] = ncclMax, [TP_MIN] = ncclMin,
    [TP_PRODUCT] = ncclProd,
};

static const char *const nccl_call_names[TP_COLL_KIND_COUNT] = {
    [TP_COLL_ALL_REDUCE] = "ncclAllReduce",
    [TP_COLL_ALL_GATHER] = "ncclAllGather",
    [TP_COLL_REDUCE_SCATTER] = "ncclReduceScatter",
    [TP_COLL_ALL_TO_ALL] = "ncclSend/ncclRecv (all_to_all)",
    [TP_COLL_BROADCAST] = "ncclBroadcast",
    [TP_COLL_BARRIER] = "ncclAllReduce (barrier)",
    [TP_COLL_SCATTER] = "ncclSend/ncclRecv (scatter)",
};

/* Between two polls: spin for the first stretch (small collectives finish in
 * microseconds and a sleep would dominate them), then sleep briefly. */
static const tp__pace nccl_pace = {.spin_s = 1e-3, .yield_s = 1e-3, .sleep_ns = 50000L};

/* ---- states and work ------------------------------------------------------ */

typedef struct nccl_work nccl_work;

typedef struct nccl_state {
    ncclComm_t comm; /* NULL once aborted or destroyed */
    int device;
    int rank, size;
    cudaStream_t stream; /* communication stream, non-blocking */
    cudaEvent_t ready;   /* recorded on the caller's compute stream */
    float *scratch;      /* one device element for barrier */
    tp_comm *mpi_world;  /* temporary MPI bootstrap kept alive, or NULL */
    void *stage_dev;     /* host collectives (the descriptor check): device side */
    void *stage_host;    /* and pinned host side, stage_bytes each */
    size_t stage_bytes;
    tp__abort_state abort;
    pthread_mutex_t mu; /* every NCCL call on comm, active */
    nccl_work *active; /* work handed out and not yet freed */
    /* ncclCommSplit's out handle. In non-blocking mode NCCL writes it from
     * its own thread once the child is fully initialized, so it lives as
     * long as the state, never on a stack that a timeout could unwind. */
    ncclComm_t split_child;
} nccl_state;

struct nccl_work {
    cudaEvent_t done;
    nccl_work *next;
    tp_coll_kind kind;
    bool finished; /* status final */
    tp_status status;
};

tp_status tp__nccl_error(ncclComm_t comm, int res, const char *what)
{
    const char *last = "";
#if NCCL_HAS_LAST_ERROR
    last = ncclGetLastError(comm);
    if (!last)
        last = "";
#else
    (void)comm;
#endif
    tp_status st = res == ncclInvalidArgument || res == ncclInvalidUsage ? TP_ERR_INVALID_ARG
                                                                          : TP_ERR_BACKEND;
    return tp__error(st, "%s failed: %s%s%s", what, ncclGetErrorString((ncclResult_t)res),
                     last[0] ? ": " : "", last);
}

/* The communicator's asynchronous state: ncclInProgress while an operation
 * settles, an error once one failed (or the query itself did). With S->mu
 * held when comm is a state's. */
static ncclResult_t nccl_async(ncclComm_t comm)
{
    ncclResult_t async = ncclSuccess;
    ncclResult_t res = ncclCommGetAsyncError(comm, &async);
    return res != ncclSuccess ? res : async;
}

/* Aborts the NCCL communicator (once); with S->mu held. */
static void state_abort_locked(nccl_state *S, const char *reason)
{
    tp__abort_set(&S->abort, reason);
    if (S->comm) {
        int prev = 0;
        bool entered = tp__cuda_enter("nccl abort", S->device, &prev) == TP_OK;
        (void)ncclCommAbort(S->comm);
        if (entered)
            tp__cuda_leave(prev, S->device);
        S->comm = NULL;
    }
}

static void state_abort(nccl_state *S, const char *reason)
{
    pthread_mutex_lock(&S->mu);
    state_abort_locked(S, reason);
    pthread_mutex_unlock(&S->mu);
}

/* This rank failed a step its peers may have taken: it is out of step with
 * them now, so the communicator goes. `st` is the error already recorded. */
static tp_status state_fail(nccl_state *S, tp_status st)
{
    char why[TP__ABORT_REASON_LEN];
    state_abort(S, tp__abort_fail_reason(S->rank, why, sizeof why));
    return st;
}

typedef struct settle_ctx {
    nccl_state *S; /* NULL for a communicator no state holds yet */
    ncclComm_t *commp;
    const char *what;
} settle_ctx;

/* One query of the communicator's asynchronous state (a tp__poll_fn); takes
 * S->mu for it. */
static tp_status settle_poll(void *ctx, bool *done)
{
    settle_ctx *c = ctx;
    nccl_state *S = c->S;
    if (S)
        pthread_mutex_lock(&S->mu);
    if (S && (tp__abort_is_set(&S->abort) || !*c->commp)) {
        pthread_mutex_unlock(&S->mu);
        return tp__abort_error(&S->abort);
    }
    tp_status st = TP_OK;
    ncclResult_t async = nccl_async(*c->commp);
    TP_NCCL_CHECK_GOTO(*c->commp, c->what, async, st, unlock);
    *done = async == ncclSuccess;
unlock:
    if (S)
        pthread_mutex_unlock(&S->mu);
    return st;
}

/* Polls comm's asynchronous state until it leaves ncclInProgress (the
 * non-blocking mode's answer to init, split, finalize and enqueue), an
 * error, an abort of S (when S is given) or the timeout. Called without the
 * lock. */
static tp_status nccl_settle(nccl_state *S, ncclComm_t *commp, double timeout_s,
                             const char *what)
{
    settle_ctx c = {.S = S, .commp = commp, .what = what};
    tp_status st = tp__poll_until(settle_poll, &c, timeout_s, &nccl_pace);
    if (st == TP_ERR_TIMEOUT)
        tp__error(TP_ERR_TIMEOUT, "%s did not complete within %.3g s", what, timeout_s);
    return st;
}

/* Stream, events and scratch of a new state on S->device (current). */
static tp_status state_cuda_create(nccl_state *S, const char *fn)
{
    cudaError_t err = cudaStreamCreateWithFlags(&S->stream, cudaStreamNonBlocking);
    if (err != cudaSuccess) {
        S->stream = NULL;
        return tp__cuda_fail(fn, "cudaStreamCreateWithFlags", err);
    }
    err = cudaEventCreateWithFlags(&S->ready, cudaEventDisableTiming);
    if (err != cudaSuccess) {
        S->ready = NULL;
        return tp__cuda_fail(fn, "cudaEventCreateWithFlags", err);
    }
    void *p = NULL;
    err = cudaMalloc(&p, sizeof(float));
    if (err != cudaSuccess)
        return tp__cuda_fail(fn, "cudaMalloc (barrier scratch)", err);
    S->scratch = p;
    return TP_OK;
}

/* Frees the staging buffers of host collectives (stage_reserve). */
static void stage_free(nccl_state *S)
{
    if (S->stage_dev)
        (void)cudaFree(S->stage_dev);
    if (S->stage_host)
        (void)cudaFreeHost(S->stage_host);
    S->stage_dev = S->stage_host = NULL;
    S->stage_bytes = 0;
}

/* Frees what state_cuda_create and stage_reserve made (current device
 * S->device). */
static void state_cuda_destroy(nccl_state *S)
{
    stage_free(S);
    if (S->scratch)
        (void)cudaFree(S->scratch);
    if (S->ready)
        (void)cudaEventDestroy(S->ready);
    if (S->stream)
        (void)cudaStreamDestroy(S->stream);
    (void)cudaGetLastError();
    S->scratch = NULL;
    S->ready = NULL;
    S->stream = NULL;
}

static nccl_state *state_new(int device)
{
    nccl_state *S = tp__calloc(1, sizeof *S);
    if (!S)
        return NULL;
    S->device = device;
    pthread_mutex_init(&S->mu, NULL);
    tp__abort_init(&S->abort);
    return S;
}

/* A state that never got a communicator, or whose communicator is gone. */
static void state_delete(nccl_state *S)
{
    int prev = 0;
    bool entered = tp__cuda_enter("nccl free", S->device, &prev) == TP_OK;
    state_cuda_destroy(S);
    if (entered)
        tp__cuda_leave(prev, S->device);
    tp_comm *boot = S->mpi_world;
    pthread_mutex_destroy(&S->mu);
    tp__abort_destroy(&S->abort);
    tp__free(S);
    tp__comm_release(boot);
}

static ncclConfig_t *nccl_config(ncclConfig_t *c)
{
#if NCCL_HAS_CONFIG
    ncclConfig_t init = NCCL_CONFIG_INITIALIZER;
    *c = init;
    c->blocking = 0;
    return c;
#else
    (void)c;
    return NULL;
#endif
}

/* ---- the backend ---------------------------------------------------------- */

/* Enqueues the NCCL operation(s) of d on S->stream; with S->mu held. */
static ncclResult_t nccl_enqueue(nccl_state *S, const tp_coll_desc *d)
{
    ncclDataType_t dt = nccl_dtypes[d->dtype];
    size_t k = d->count;
    switch (d->kind) {
    case TP_COLL_ALL_REDUCE:
        return ncclAllReduce(d->sendbuf, d->recvbuf, k, dt, nccl_ops[d->op], S->comm, S->stream);
    case TP_COLL_ALL_GATHER:
        return ncclAllGather(d->sendbuf, d->recvbuf, k, dt, S->comm, S->stream);
    case TP_COLL_REDUCE_SCATTER:
        return ncclReduceScatter(d->sendbuf, d->recvbuf, k, dt, nccl_ops[d->op], S->comm,
                                 S->stream);
    case TP_COLL_BROADCAST:
        return ncclBroadcast(d->sendbuf, d->recvbuf, k, dt, d->root, S->comm, S->stream);
    case TP_COLL_BARRIER:
        return ncclAllReduce(S->scratch, S->scratch, 1, ncclFloat32, ncclSum, S->comm, S->stream);
    case TP_COLL_ALL_TO_ALL: {
        size_t bytes = k * tp_dtype_size(d->dtype);
        const char *sb = d->sendbuf;
        char *rb = d->recvbuf;
        ncclResult_t res = ncclGroupStart();
        if (res != ncclSuccess)
            return res;
        for (int p = 0; p < S->size && res == ncclSuccess; p++) {
            res = ncclSend(sb + (size_t)p * bytes, k, dt, p, S->comm, S->stream);
            if (res == ncclSuccess)
                res = ncclRecv(rb + (size_t)p * bytes, k, dt, p, S->comm, S->stream);
        }
        ncclResult_t end = ncclGroupEnd();
        return res != ncclSuccess ? res : end;
    }
    case TP_COLL_SCATTER: {
        /* root sends block p to rank p (to itself too unless in place) */
        size_t bytes = k * tp_dtype_size(d->dtype);
        const char *sb = d->sendbuf;
        char *rb = d->recvbuf;
        bool root = S->rank == d->root;
        ncclResult_t res = ncclGroupStart();
        if (res != ncclSuccess)
            return res;
        for (int p = 0; root && p < S->size && res == ncclSuccess; p++)
            if (p != S->rank || rb != sb + (size_t)p * bytes)
                res = ncclSend(sb + (size_t)p * bytes, k, dt, p, S->comm, S->stream);
        if (res == ncclSuccess && (!root || rb != sb + (size_t)S->rank * bytes))
            res = ncclRecv(rb, k, dt, d->root, S->comm, S->stream);
        ncclResult_t end = ncclGroupEnd();
        return res != ncclSuccess ? res : end;
    }
    default:
        return ncclInvalidArgument;
    }
}

/* Enqueues d and waits out ncclInProgress. Any failure leaves this rank out
 * of step with peers that enqueued their part, so the communicator goes. */
static tp_status enqueue_settled(nccl_state *S, const tp_coll_desc *d)
{
    tp_status st = TP_OK;
    pthread_mutex_lock(&S->mu);
    if (tp__abort_is_set(&S->abort) || !S->comm) {
        pthread_mutex_unlock(&S->mu);
        return tp__abort_error(&S->abort);
    }
    ncclResult_t res = nccl_enqueue(S, d);
    TP_NCCL_CHECK_GOTO(S->comm, nccl_call_names[d->kind], res, st, unlock);
unlock:
    pthread_mutex_unlock(&S->mu);
    if (st == TP_OK && res == ncclInProgress)
        st = nccl_settle(S, &S->comm, d->timeout_s, nccl_call_names[d->kind]);
    if (st != TP_OK && st != TP_ERR_ABORTED)
        st = state_fail(S, st);
    return st;
}

static tp_status work_wait_entered(nccl_state *S, nccl_work *w, double timeout_s);

/* Grows the staging buffers of host collectives to `bytes` each. */
static tp_status stage_reserve(nccl_state *S, size_t bytes)
{
    if (bytes <= S->stage_bytes)
        return TP_OK;
    stage_free(S);
    cudaError_t err = cudaMalloc(&S->stage_dev, bytes);
    if (err == cudaSuccess)
        err = cudaMallocHost(&S->stage_host, bytes);
    if (err != cudaSuccess) {
        if (S->stage_dev)
            (void)cudaFree(S->stage_dev);
        S->stage_dev = S->stage_host = NULL;
        return tp__cuda_fail("backend 'nccl'", "staging buffers for host data", err);
    }
    S->stage_bytes = bytes;
    return TP_OK;
}

/*
 * A collective on CPU buffers. The public entry points never pass them (the
 * backend's device mask is CUDA only); libtp's own descriptor check
 * (tp_comm_set_check) all-gathers small CPU descriptors, which travel
 * through pinned and device staging buffers here. Blocking; device entered.
 */
static tp_status nccl_host_collective(nccl_state *S, const tp_coll_desc *d)
{
    /* only the descriptor check's all_gather comes here; the copies below
     * could not do a scatter, whose send buffer exists on root only */
    TP_ASSERT(d->kind != TP_COLL_SCATTER);
    size_t es = tp_dtype_size(d->dtype), n = (size_t)S->size, k = d->count, sb, rb;
    switch (d->kind) {
    case TP_COLL_ALL_GATHER: sb = k * es; rb = n * k * es; break;
    case TP_COLL_REDUCE_SCATTER: sb = n * k * es; rb = k * es; break;
    case TP_COLL_ALL_TO_ALL: sb = rb = n * k * es; break;
    default: sb = rb = k * es; break;
    }
    const char *hs = d->sendbuf;
    char *hr = d->recvbuf;
    bool same = hs == hr && (d->kind == TP_COLL_ALL_REDUCE || d->kind == TP_COLL_BROADCAST);
    if (!same && hs < hr + rb && hr < hs + sb)
        return tp__error(TP_ERR_NOT_SUPPORTED,
                         "backend 'nccl' moves CUDA tensors only (in-place %s on CPU buffers)",
                         tp_coll_kind_name(d->kind));
    size_t rofs = same ? 0 : sb;
    TP_CHECK(stage_reserve(S, same ? sb : sb + rb));
    char *dev = S->stage_dev, *host = S->stage_host;
    memcpy(host, hs, sb);
    tp_coll_desc g = *d;
    g.sendbuf = dev;
    g.recvbuf = dev + rofs;
    nccl_work w = {.kind = d->kind};
    cudaError_t err = cudaEventCreateWithFlags(&w.done, cudaEventDisableTiming);
    if (err != cudaSuccess)
        return state_fail(S, tp__cuda_fail("backend 'nccl'", "cudaEventCreateWithFlags", err));
    tp_status st = TP_OK;
    if ((err = cudaMemcpyAsync(dev, host, sb, cudaMemcpyHostToDevice, S->stream)) != cudaSuccess)
        st = state_fail(S, tp__cuda_fail("backend 'nccl'", "cudaMemcpyAsync (host data)", err));
    if (st == TP_OK)
        st = enqueue_settled(S, &g);
    if (st == TP_OK &&
        ((err = cudaMemcpyAsync(host + rofs, dev + rofs, rb, cudaMemcpyDeviceToHost,
                                S->stream)) != cudaSuccess ||
         (err = cudaEventRecord(w.done, S->stream)) != cudaSuccess))
        st = state_fail(S, tp__cuda_fail("backend 'nccl'", "copying the host result", err));
    if (st == TP_OK)
        st = work_wait_entered(S, &w, d->timeout_s);
    if (st == TP_OK)
        memcpy(hr, host + rofs, rb);
    (void)cudaEventDestroy(w.done);
    return st;
}

static tp_status nccl_collective(void *state, const tp_coll_desc *d, void **work)
{
    nccl_state *S = state;
    *work = NULL;
    if (tp__abort_is_set(&S->abort))
        return tp__abort_error(&S->abort);
    bool host = false;
    if (d->kind != TP_COLL_BARRIER) {
        if (d->count == 0)
            return TP_OK; /* every rank has the same count (comm.h): nothing moves */
        host = d->device.type == TP_DEVICE_CPU;
        if (!host && d->device.index != S->device)
            return tp__error(TP_ERR_INVALID_ARG,
                             "backend 'nccl': buffers are on cuda:%d but this rank's "
                             "communicator uses cuda:%d",
                             d->device.index, S->device);
    }

    int prev = 0;
    tp_status st = tp__cuda_enter("backend 'nccl'", S->device, &prev);
    if (st != TP_OK)
        return state_fail(S, st);
    if (host) {
        st = nccl_host_collective(S, d);
        tp__cuda_leave(prev, S->device);
        return st;
    }
    cudaStream_t compute = NULL;
    cudaError_t err = cudaSuccess;
    nccl_work *w = tp__calloc(1, sizeof *w);
    if (!w) {
        st = state_fail(S, tp__error(TP_ERR_NO_MEMORY,
                                     "backend 'nccl': out of memory for the work object"));
        goto out;
    }
    w->kind = d->kind;
    if ((err = cudaEventCreateWithFlags(&w->done, cudaEventDisableTiming)) != cudaSuccess) {
        w->done = NULL;
        st = state_fail(S, tp__cuda_fail("backend 'nccl'", "cudaEventCreateWithFlags", err));
        goto out;
    }
    /* the collective starts once the inputs the caller's kernels write are done */
    if ((st = tp__cuda_stream("backend 'nccl'", S->device, &compute)) != TP_OK) {
        st = state_fail(S, st);
        goto out;
    }
    if ((err = cudaEventRecord(S->ready, compute)) != cudaSuccess ||
        (err = cudaStreamWaitEvent(S->stream, S->ready, 0)) != cudaSuccess) {
        st = state_fail(S, tp__cuda_fail("backend 'nccl'", "ordering after the compute stream",
                                         err));
        goto out;
    }
    if ((st = enqueue_settled(S, d)) != TP_OK)
        goto out;
    if ((err = cudaEventRecord(w->done, S->stream)) != cudaSuccess) {
        st = state_fail(S, tp__cuda_fail("backend 'nccl'", "cudaEventRecord", err));
        goto out;
    }
    pthread_mutex_lock(&S->mu);
    w->next = S->active;
    S->active = w;
    pthread_mutex_unlock(&S->mu);
    *work = w;
    w = NULL;
out:
    if (w) {
        if (w->done)
            (void)cudaEventDestroy(w->done);
        tp__free(w);
    }
    tp__cuda_leave(prev, S->device);
    return st;
}

/* One look at w: *done once its event completed; errors are final. With the
 * device entered. */
static tp_status work_poll(nccl_state *S, nccl_work *w, bool *done)
{
    char why[TP__ABORT_REASON_LEN];
    *done = false;
    pthread_mutex_lock(&S->mu);
    if (tp__abort_is_set(&S->abort) || !S->comm) {
        pthread_mutex_unlock(&S->mu);
        *done = true;
        return tp__abort_error(&S->abort);
    }
    tp_status st = TP_OK;
    TP_NCCL_CHECK_GOTO(S->comm, tp_coll_kind_name(w->kind), nccl_async(S->comm), st, failed);
    pthread_mutex_unlock(&S->mu);
    cudaError_t err = cudaEventQuery(w->done);
    if (err == cudaErrorNotReady) {
        (void)cudaGetLastError();
        return TP_OK;
    }
    *done = true;
    if (err != cudaSuccess)
        return state_fail(S, tp__cuda_fail("backend 'nccl'", "cudaEventQuery", err));
    /* later kernels of this thread come after the result on the device too */
    cudaStream_t compute = NULL;
    st = tp__cuda_stream("backend 'nccl'", S->device, &compute);
    if (st == TP_OK && (err = cudaStreamWaitEvent(compute, w->done, 0)) != cudaSuccess)
        st = tp__cuda_fail("backend 'nccl'", "cudaStreamWaitEvent", err);
    return st;
failed:
    /* NCCL failed the communicator: this rank is out of step with its peers */
    state_abort_locked(S, tp__abort_fail_reason(S->rank, why, sizeof why));
    pthread_mutex_unlock(&S->mu);
    *done = true;
    return st;
}

static tp_status nccl_work_test(void *state, void *work, bool *done)
{
    nccl_state *S = state;
    nccl_work *w = work;
    *done = false;
    if (w->finished) {
        *done = true;
        return w->status;
    }
    int prev = 0;
    TP_CHECK(tp__cuda_enter("tp_work_test", S->device, &prev));
    tp_status st = work_poll(S, w, done);
    tp__cuda_leave(prev, S->device);
    if (*done) {
        w->finished = true;
        w->status = st;
    }
    return st;
}

typedef struct work_wait_ctx {
    nccl_state *S;
    nccl_work *w;
} work_wait_ctx;

static tp_status work_wait_poll(void *ctx, bool *done)
{
    work_wait_ctx *c = ctx;
    return work_poll(c->S, c->w, done);
}

/* Polls w until it completes, fails, the state is aborted or timeout_s
 * passes (then the communicator is aborted, which stops its kernels). */
static tp_status work_wait_entered(nccl_state *S, nccl_work *w, double timeout_s)
{
    work_wait_ctx c = {.S = S, .w = w};
    tp_status st = tp__poll_until(work_wait_poll, &c, timeout_s, &nccl_pace);
    if (st == TP_ERR_TIMEOUT) {
        char why[300];
        snprintf(why, sizeof why,
                 "rank %d (cuda:%d) timed out after %.3g s waiting for %s; the NCCL "
                 "communicator was aborted",
                 S->rank, S->device, timeout_s, tp_coll_kind_name(w->kind));
        state_abort(S, why);
        st = tp__error(TP_ERR_TIMEOUT, "%s", why);
    }
    w->finished = true;
    w->status = st;
    return st;
}

static tp_status nccl_work_wait(void *state, void *work, double timeout_s)
{
    nccl_state *S = state;
    nccl_work *w = work;
    if (w->finished)
        return w->status;
    int prev = 0;
    TP_CHECK(tp__cuda_enter("tp_work_wait", S->device, &prev));
    tp_status st = work_wait_entered(S, w, timeout_s);
    tp__cuda_leave(prev, S->device);
    return st;
}

static void nccl_work_free(void *state, void *work)
{
    nccl_state *S = state;
    nccl_work *w = work;
    if (!w)
        return;
    pthread_mutex_lock(&S->mu);
    for (nccl_work **p = &S->active; *p; p = &(*p)->next) {
        if (*p == w) {
            *p = w->next;
            break;
        }
    }
    pthread_mutex_unlock(&S->mu);
    /* an event still pending is released by CUDA once it completes */
    (void)cudaEventDestroy(w->done);
    (void)cudaGetLastError();
    tp__free(w);
}

static void nccl_abort(void *state, const char *reason)
{
    nccl_state *S = state;
    char why[TP__ABORT_REASON_LEN];
    snprintf(why, sizeof why, "rank %d aborted: %s", S->rank, reason ? reason : "");
    state_abort(S, why);
}

static void nccl_free(void *state)
{
    nccl_state *S = state;
    if (!S)
        return;
    int prev = 0;
    bool entered = tp__cuda_enter("tp_comm_free", S->device, &prev) == TP_OK;
    double timeout = tp__default_timeout();
    /* pending work is waited for first (comm.h), unless the communicator is
     * unusable anyway; work_free still owns the work objects */
    for (nccl_work *w = S->active; w && entered && !tp__abort_is_set(&S->abort); w = w->next)
        if (!w->finished)
            (void)work_wait_entered(S, w, timeout);
    if (entered && !tp__abort_is_set(&S->abort) && S->comm) {
        /* finalize flushes what is still queued and waits for the peers to
         * be quiescent; a peer that never frees its handle makes it a
         * timeout, then an abort */
        tp_status st = TP_OK;
        pthread_mutex_lock(&S->mu);
        ncclResult_t res = ncclCommFinalize(S->comm);
        TP_NCCL_CHECK_GOTO(S->comm, "ncclCommFinalize", res, st, finalized);
finalized:
        pthread_mutex_unlock(&S->mu);
        if (st == TP_OK && res == ncclInProgress)
            st = nccl_settle(S, &S->comm, timeout, "ncclCommFinalize");
        pthread_mutex_lock(&S->mu);
        if (S->comm) {
            if (st == TP_OK)
                (void)ncclCommDestroy(S->comm);
            else
                (void)ncclCommAbort(S->comm);
            S->comm = NULL;
        }
        pthread_mutex_unlock(&S->mu);
    } else {
        state_abort(S, "communicator freed");
    }
    /* any work the caller did not free is not ours to free; unlink it */
    S->active = NULL;
    if (entered)
        tp__cuda_leave(prev, S->device);
    state_delete(S);
}

/* Creates the NCCL communicator of a new state from an id (init) and waits
 * for it; device entered. */
static tp_status state_comm_init(nccl_state *S, const ncclUniqueId *id, double timeout_s)
{
    ncclConfig_t cfg;
    ncclConfig_t *cp = nccl_config(&cfg);
    ncclComm_t comm = NULL;
    ncclResult_t res;
    tp_status st = TP_OK;
#if NCCL_HAS_CONFIG
    res = ncclCommInitRankConfig(&comm, S->size, *id, S->rank, cp);
#else
    (void)cp;
    res = ncclCommInitRank(&comm, S->size, *id, S->rank);
#endif
    TP_NCCL_CHECK_GOTO(comm, "ncclCommInitRank", res, st, fail);
    if (res == ncclInProgress)
        TP_CHECK_GOTO(nccl_settle(NULL, &comm, timeout_s, "ncclCommInitRank"), st, fail);
    S->comm = comm;
    return TP_OK;
fail:
    if (comm)
        (void)ncclCommAbort(comm);
    return st;
}

#if NCCL_HAS_SPLIT
/* Whether ncclCommSplit has handed out the child (a tp__poll_fn). */
static tp_status split_child_poll(void *ctx, bool *done)
{
    nccl_state *S = ctx;
    if (tp__abort_is_set(&S->abort))
        return tp__abort_error(&S->abort);
    *done = __atomic_load_n(&S->split_child, __ATOMIC_ACQUIRE) != NULL;
    return TP_OK;
}
#endif

static tp_status nccl_split(void *state, int color, int key, double timeout_s, void **new_state,
                            int *new_rank, int *new_size)
{
    nccl_state *S = state;
    *new_state = NULL;
#if !NCCL_HAS_SPLIT
    (void)color;
    (void)key;
    (void)timeout_s;
    (void)new_rank;
    (void)new_size;
    return tp__error(TP_ERR_NOT_SUPPORTED,
                     "backend 'nccl': ncclCommSplit needs NCCL >= 2.18 (this libtp was built "
                     "with %d.%d)",
                     NCCL_MAJOR, NCCL_MINOR);
#else
    if (tp__abort_is_set(&S->abort))
        return tp__abort_error(&S->abort);
    int prev = 0;
    TP_CHECK(tp__cuda_enter("backend 'nccl'", S->device, &prev));
    tp_status st = TP_OK;
    nccl_state *N = NULL;
    ncclComm_t nc = NULL;
    ncclConfig_t cfg;
    ncclConfig_t *cp = nccl_config(&cfg);

    pthread_mutex_lock(&S->mu);
    if (tp__abort_is_set(&S->abort) || !S->comm) {
        pthread_mutex_unlock(&S->mu);
        st = tp__abort_error(&S->abort);
        goto out;
    }
    __atomic_store_n(&S->split_child, NULL, __ATOMIC_RELAXED);
    ncclResult_t res = ncclCommSplit(S->comm, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key,
                                     &S->split_child, cp);
    TP_NCCL_CHECK_GOTO(S->comm, "ncclCommSplit", res, st, unlock);
unlock:
    pthread_mutex_unlock(&S->mu);
    if (st != TP_OK) {
        st = state_fail(S, st);
        goto out;
    }
    /* The parent is busy until the split is done. The child handle appears
     * only once the child is initialized, from NCCL's own thread (NCCL >=
     * 2.27 keeps it NULL until then, even where ncclCommSplit returned
     * ncclSuccess), so a rank that joins a group waits for it. */
    if (res == ncclInProgress)
        st = nccl_settle(S, &S->comm, timeout_s, "ncclCommSplit");
    if (st == TP_OK && color >= 0) {
        st = tp__poll_until(split_child_poll, S, timeout_s, &nccl_pace);
        if (st == TP_ERR_TIMEOUT)
            tp__error(TP_ERR_TIMEOUT,
                      "ncclCommSplit: the new communicator was not ready within %.3g s",
                      timeout_s);
    }
    nc = __atomic_load_n(&S->split_child, __ATOMIC_ACQUIRE);
    if (st == TP_OK && nc)
        st = nccl_settle(NULL, &nc, timeout_s, "ncclCommSplit (new communicator)");
    if (st != TP_OK) {
        if (nc)
            (void)ncclCommAbort(nc);
        __atomic_store_n(&S->split_child, NULL, __ATOMIC_RELAXED);
        if (st != TP_ERR_ABORTED)
            st = state_fail(S, st);
        goto out;
    }
    nc = __atomic_load_n(&S->split_child, __ATOMIC_ACQUIRE);
    __atomic_store_n(&S->split_child, NULL, __ATOMIC_RELAXED);
    if (!nc)
        goto out; /* color < 0 */
    N = state_new(S->device);
    if (!N) {
        st = tp__error(TP_ERR_NO_MEMORY, "backend 'nccl': out of memory for the communicator");
        goto abort_new;
    }
    TP_NCCL_CHECK_GOTO(nc, "ncclCommUserRank", ncclCommUserRank(nc, &N->rank), st, abort_new);
    TP_NCCL_CHECK_GOTO(nc, "ncclCommCount", ncclCommCount(nc, &N->size), st, abort_new);
    TP_CHECK_GOTO(state_cuda_create(N, "tp_comm_split"), st, abort_new);
    N->comm = nc;
    *new_state = N;
    *new_rank = N->rank;
    *new_size = N->size;
    goto out;
abort_new:
    /* the new group's peers must not wait for this rank */
    (void)ncclCommAbort(nc);
    if (N)
        state_delete(N);
out:
    tp__cuda_leave(prev, S->device);
    return st;
#endif
}

/* ---- world ---------------------------------------------------------------- */

enum { ID_WORDS = NCCL_UNIQUE_ID_BYTES / 4 };

/* Broadcasts rank 0's id over boot, then agrees on readiness: *first_bad is
 * the lowest rank that is not ready, or INT_MAX. */
static tp_status bootstrap_exchange(tp_comm *boot, ncclUniqueId *id, bool ready, int *first_bad)
{
    int32_t words[ID_WORDS], flag = ready ? INT_MAX : tp_comm_rank(boot);
    memcpy(words, id->internal, sizeof words);
    int64_t nw = ID_WORDS, one = 1;
    tp_tensor *tid = NULL, *tflag = NULL;
    tp_status st = tp_tensor_from_blob(TP_I32, TP_CPU, 1, &nw, words, NULL, NULL, &tid);
    if (st == TP_OK)
        st = tp_tensor_from_blob(TP_I32, TP_CPU, 1, &one, &flag, NULL, NULL, &tflag);
    if (st == TP_OK)
        st = tp_broadcast(boot, tid, 0, NULL);
    if (st == TP_OK)
        st = tp_all_reduce(boot, tflag, tflag, TP_MIN, NULL);
    tp_tensor_release(tid);
    tp_tensor_release(tflag);
    if (st != TP_OK)
        return st;
    memcpy(id->internal, words, sizeof words);
    *first_bad = flag;
    return TP_OK;
}

static tp_status nccl_init_world(void *options, void **state, int *rank, int *size)
{
    const tp_nccl_options *o = options;
    TP_ARG_CHECK(o, "tp_comm_create_world(\"nccl\"): options are NULL; pass a tp_nccl_options "
                    "(bootstrap communicator or NULL for the MPI world, device or -1)");
    TP_ARG_CHECK(o->device >= -1,
                 "tp_comm_create_world(\"nccl\"): device %d is invalid (a CUDA ordinal, or -1 for "
                 "bootstrap rank %% device count)",
                 o->device);
    tp_comm *boot = o->bootstrap, *owned = NULL;
    if (!boot) {
#if TP_HAVE_MPI
        tp_status st = tp_comm_create_world("mpi", NULL, &owned);
        if (st != TP_OK) {
            tp__error_prefix(
                "tp_comm_create_world(\"nccl\"): no bootstrap given, and the MPI world "
                "could not be created");
            return st;
        }
        boot = owned;
#else
        return tp__error(
            TP_ERR_INVALID_ARG,
            "tp_comm_create_world(\"nccl\"): bootstrap is NULL and libtp was built without "
            "MPI; pass an existing communicator of the same ranks (such as the "
            "tp_run_local world)");
#endif
    }
    int brank = tp_comm_rank(boot), bsize = tp_comm_size(boot);

    /* local readiness: a device to use and, on rank 0, an id */
    tp_status local = TP_OK;
    char local_msg[512] = "";
    int device = o->device, count = tp_cuda_device_count();
    if (count <= 0)
        local = tp__error(TP_ERR_NOT_SUPPORTED,
                          "tp_comm_create_world(\"nccl\"): rank %d sees no CUDA device", brank);
    else if (device >= count)
        local = tp__error(TP_ERR_INVALID_ARG,
                          "tp_comm_create_world(\"nccl\"): rank %d asked for cuda:%d but sees %d "
                          "device%s",
                          brank, device, count, count == 1 ? "" : "s");
    if (local == TP_OK && device < 0)
        device = brank % count;
    ncclUniqueId id;
    memset(&id, 0, sizeof id);
    if (local == TP_OK && brank == 0) {
        int prev = 0;
        local = tp__cuda_enter("tp_comm_create_world(\"nccl\")", device, &prev);
        if (local == TP_OK) {
            TP_NCCL_CHECK_GOTO(NULL, "ncclGetUniqueId", ncclGetUniqueId(&id), local, have_id);
have_id:
            tp__cuda_leave(prev, device);
        }
    }
    if (local != TP_OK)
        snprintf(local_msg, sizeof local_msg, "%s", tp_last_error());

    int first_bad = INT_MAX;
    tp_status st = bootstrap_exchange(boot, &id, local == TP_OK, &first_bad);
    if (st != TP_OK) {
        tp__error_prefix(
            "tp_comm_create_world(\"nccl\"): exchanging the NCCL id over the bootstrap "
            "communicator");
        goto fail;
    }
    if (local != TP_OK) {
        tp__error_set_text(local_msg);
        st = local;
        goto fail;
    }
    if (first_bad != INT_MAX) {
        st = tp__error(
            TP_ERR_STATE,
            "tp_comm_create_world(\"nccl\"): rank %d of the bootstrap communicator could not "
            "prepare (see its error); no NCCL communicator was created",
            first_bad);
        goto fail;
    }

    nccl_state *S = state_new(device);
    if (!S) {
        st = tp__error(TP_ERR_NO_MEMORY, "tp_comm_create_world(\"nccl\"): out of memory");
        goto fail;
    }
    S->rank = brank;
    S->size = bsize;
    int prev = 0;
    if ((st = tp__cuda_enter("tp_comm_create_world(\"nccl\")", device, &prev)) != TP_OK) {
        state_delete(S);
        goto fail;
    }
    st = state_cuda_create(S, "tp_comm_create_world(\"nccl\")");
    if (st == TP_OK)
        st = state_comm_init(S, &id, tp_comm_timeout(boot));
    tp__cuda_leave(prev, device);
    if (st != TP_OK) {
        tp__error_prefix("tp_comm_create_world(\"nccl\") on cuda:%d, rank %d of %d", device, brank,
                         bsize);
        state_delete(S);
        goto fail;
    }
    S->mpi_world = owned;
    *state = S;
    *rank = brank;
    *size = bsize;
    return TP_OK;
fail:
    tp__comm_release(owned);
    return st;
}

/* No descriptor comparison of its own (checks_descriptors). */
const tp_backend tp__nccl_backend = {
    .name = "nccl",
    .device_mask = 1u << TP_DEVICE_CUDA,
    .collective = nccl_collective,
    .work_test = nccl_work_test, .work_wait = nccl_work_wait, .work_free = nccl_work_free,
    .split = nccl_split, .abort = nccl_abort, .free = nccl_free,
    .init_world = nccl_init_world,
};
