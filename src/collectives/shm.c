/*
 * The shm backend: the ranks of a group are threads of one process and read
 * each other's buffers directly.
 *
 * Protocol. Every collective gets the next sequence number s of its group.
 * A rank publishes a descriptor of its buffers in ring entry s of its slot and
 * stores `arrived = s`. Once every rank has arrived, each rank does its share
 * of the data movement (reading and writing peers' buffers through their
 * descriptors), then stores `done = s`. The collective is complete for a rank
 * when every rank is done, because only then are its buffers no longer read
 * or written by peers. Data phases run in sequence order and only after the
 * previous collective completed everywhere, which gives the ordering of a
 * single stream: a later collective may consume what an earlier one wrote.
 *
 * Because every rank sees every descriptor, mismatched calls (kind, dtype,
 * count, op, root) are detected on every collective and reported as
 * TP_ERR_MISMATCH by all ranks alike, before any data moves.
 *
 * CUDA tensors: the same protocol moves device buffers. The data phase
 * enqueues copies and reduction kernels on the rank's own CUDA stream instead
 * of touching memory itself, ordered against the peers' streams with events
 * (shm_cuda.h), so no rank blocks on its GPU. All ranks of a collective pass
 * CPU buffers or all pass CUDA buffers; they may share one GPU.
 *
 * Waiting spins briefly, then yields, then sleeps on a futex, so eight ranks
 * on two cores still make progress. Every wait honours the timeout, an abort
 * (of the group or of the whole run), and notices a peer that returned from
 * its rank function without joining.
 */
#include <errno.h>
#include <stdlib.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "collectives/abort.h"
#include "collectives/coll.h"
#include "collectives/poll.h"
#include "collectives/shm_cuda.h"
#include "collectives/shm_kernels.h"
#include "core/log.h"
#include "tp/config.h"

#define SHM_RING 128 /* collectives a rank may have outstanding on a group */

enum { SHM_SPLIT_EXCHANGE = 100, SHM_SPLIT_PUBLISH = 101 };

typedef struct shm_op {
    int kind; /* tp_coll_kind or SHM_SPLIT_* */
    tp_dtype dtype;
    tp_reduce_op op;
    int root;
    size_t count;
    const void *send;
    void *recv;
    int color, key;   /* SPLIT_EXCHANGE */
    void *new_group;  /* SPLIT_PUBLISH: the leader's new group */
    bool on_cuda;     /* the buffers are CUDA memory (else CPU memory) */
    int cuda_dev;     /* on_cuda: their device */
    void *ready, *done; /* CUDA: the poster's events for this collective */
    int failed;         /* CUDA: the poster's data phase failed (set before `done`) */
} shm_op;

typedef struct shm_slot {
    _Alignas(64) _Atomic uint64_t arrived;
    _Alignas(64) _Atomic uint64_t done;
    _Atomic uint64_t busy; /* s while in the data phase of s, else 0 */
    _Alignas(64) shm_op ring[SHM_RING];
} shm_slot;

/* The kinds of failure a rank's wait or abort can record (see run_fail). */
enum {
    FAIL_TIMEOUT, /* one of its waits timed out */
    FAIL_ABORTED, /* it saw a group or the run aborted */
    FAIL_GAVE_UP, /* it aborted a group itself */
    FAIL_KINDS
};

typedef struct shm_run {
    _Atomic uint32_t epoch; /* futex word: bumped when a waiter may need waking */
    _Atomic int sleepers;
    _Atomic int refs;
    tp__abort_state abort;
    pthread_mutex_t mu; /* the first failure below */
    int n;
    _Atomic int *exited; /* per world rank */
    /* When each world rank first failed, by kind: tickets of `clock` (0:
     * never) taken at the moment itself, so that the failure that came first
     * is known however late its rank function returns. n * FAIL_KINDS. */
    _Atomic uint64_t clock;
    _Atomic uint64_t *fail_at;
    /* first failure, by ticket */
    int fail_rank;
    uint64_t fail_ticket;
    tp_status fail_status;
    char fail_msg[1024];
} shm_run;

typedef struct shm_group {
    int n;
    shm_run *run;
    _Atomic int refs;
    tp__abort_state abort;
    int *world; /* group rank -> world rank of the run */
    shm_slot *slots;
    /* per group rank: its CUDA events, made on its first CUDA collective.
     * Peers wait on them after the rank may have returned, so they go with
     * the group, not with the rank. */
    tp__shm_cuda **cuda;
} shm_group;

typedef struct shm_work {
    uint64_t seq;
    tp_status status;
    bool retired;
    char msg[400];
} shm_work;

typedef struct shm_rank {
    shm_group *g;
    int rank;
    uint64_t posted, progressed, completed;
    const void **srcs; /* scratch of n pointers for the kernels */
    void **dsts;
    int *split_colors, *split_keys; /* SPLIT_EXCHANGE results */
    void *split_result;             /* SPLIT_PUBLISH result */
    shm_work works[SHM_RING];
} shm_rank;

static size_t tp__stream_bytes(void)
{
    static _Atomic size_t cached;
    size_t v = atomic_load_explicit(&cached, memory_order_relaxed);
    if (v)
        return v;
    v = (size_t)8 << 20;
    const char *env = getenv("TP_SHM_STREAM_BYTES");
    if (env && *env)
        v = (size_t)strtoull(env, NULL, 10) + 1;
    atomic_store_explicit(&cached, v, memory_order_relaxed);
    return v;
}

static int tp__ncpu(void)
{
    static _Atomic int cached;
    int v = atomic_load_explicit(&cached, memory_order_relaxed);
    if (!v) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        v = n > 0 ? (int)n : 1;
        atomic_store_explicit(&cached, v, memory_order_relaxed);
    }
    return v;
}

/* ---- waking and sleeping -------------------------------------------------- */

static void run_wake(shm_run *run)
{
    if (atomic_load(&run->sleepers) > 0) {
        atomic_fetch_add(&run->epoch, 1);
        syscall(SYS_futex, &run->epoch, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    }
}

static void run_sleep(shm_run *run, uint32_t seen, double seconds)
{
    struct timespec ts = {(time_t)seconds, (long)((seconds - (double)(time_t)seconds) * 1e9)};
    syscall(SYS_futex, &run->epoch, FUTEX_WAIT_PRIVATE, seen, &ts, NULL, 0);
}

/* ---- aborts --------------------------------------------------------------- */

/* Records that world rank `wr` failed now, in the given kind's slot, unless
 * it failed that way before: the first ticket stays. Taken before the
 * failure becomes visible to any peer (before the abort it causes), so a
 * failure that follows from it always gets a later ticket. */
static void run_note_failure(shm_run *run, int wr, int kind)
{
    _Atomic uint64_t *at = &run->fail_at[(size_t)wr * FAIL_KINDS + (size_t)kind];
    if (atomic_load(at))
        return;
    uint64_t none = 0, t = atomic_fetch_add(&run->clock, 1) + 1;
    atomic_compare_exchange_strong(at, &none, t);
}

static void rank_note_failure(shm_rank *R, int kind)
{
    run_note_failure(R->g->run, R->g->world[R->rank], kind);
}

static void run_release(shm_run *run);

/* Wakes every sleeper, whether or not it registered (an abort, an exit). */
static void run_wake_all(shm_run *run)
{
    atomic_fetch_add(&run->epoch, 1);
    syscall(SYS_futex, &run->epoch, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

static void group_abort(shm_group *g, const char *reason)
{
    tp__abort_set(&g->abort, reason);
    run_wake_all(g->run);
}

static void run_abort(shm_run *run, const char *reason)
{
    tp__abort_set(&run->abort, reason);
    run_wake_all(run);
}

static bool group_is_aborted(const shm_group *g)
{
    return tp__abort_is_set(&g->abort) || tp__abort_is_set(&g->run->abort);
}

/* Makes sure no peer is still inside a data phase that touches this rank's
 * outstanding buffers: data phases never block, so this wait is short. */
static void rank_quiesce(shm_rank *R)
{
    shm_group *g = R->g;
    for (int q = 0; q < g->n; q++) {
        for (;;) {
            uint64_t b = atomic_load(&g->slots[q].busy);
            if (b == 0 || b <= R->completed || b > R->posted)
                break;
            sched_yield();
        }
    }
}

/* Returns TP_ERR_ABORTED with the reason once rank_quiesce is done. */
static tp_status rank_aborted(shm_rank *R)
{
    shm_group *g = R->g;
    rank_note_failure(R, FAIL_ABORTED);
    rank_quiesce(R);
    return tp__abort_error(tp__abort_is_set(&g->abort) ? &g->abort : &g->run->abort);
}

/* ---- the data phase ------------------------------------------------------- */

static void op_pack(const shm_op *o, int64_t w[7])
{
    bool red = o->kind == TP_COLL_ALL_REDUCE || o->kind == TP_COLL_REDUCE_SCATTER;
    bool bar = o->kind == TP_COLL_BARRIER || o->kind >= SHM_SPLIT_EXCHANGE;
    w[0] = 0;
    w[1] = o->kind;
    w[2] = bar ? -1 : (int64_t)o->dtype;
    w[3] = bar ? 0 : (int64_t)o->count;
    w[4] = red ? (int64_t)o->op : -1;
    w[5] = o->kind == TP_COLL_BROADCAST || o->kind == TP_COLL_SCATTER ? o->root : -1;
    w[6] = 0;
}

static void op_describe(const shm_op *o, char *buf, size_t len)
{
    if (o->kind >= SHM_SPLIT_EXCHANGE) {
        snprintf(buf, len, "comm_split");
        return;
    }
    int64_t w[7];
    op_pack(o, w);
    tp__desc_string(w, buf, len);
}

/* Same verdict on every rank: all compare every descriptor with rank 0's. */
static bool ops_match(shm_rank *R, uint64_t s, shm_work *wk)
{
    shm_group *g = R->g;
    const shm_op *a = &g->slots[0].ring[s % SHM_RING];
    int64_t wa[7], wb[7];
    op_pack(a, wa);
    for (int q = 1; q < g->n; q++) {
        const shm_op *b = &g->slots[q].ring[s % SHM_RING];
        op_pack(b, wb);
        if (memcmp(wa, wb, sizeof wa) != 0) {
            char da[160], db[160];
            op_describe(a, da, sizeof da);
            op_describe(b, db, sizeof db);
            snprintf(wk->msg, sizeof wk->msg,
                     "ranks disagree at collective #%llu: rank 0 issued %.150s, rank %d issued %.150s",
                     (unsigned long long)s, da, q, db);
            return false;
        }
        if ((a->on_cuda) != (b->on_cuda)) {
            snprintf(wk->msg, sizeof wk->msg,
                     "ranks disagree at collective #%llu: rank 0 passed %s tensors, rank %d "
                     "passed %s tensors",
                     (unsigned long long)s, a->on_cuda ? "CUDA" : "CPU", q,
                     b->on_cuda ? "CUDA" : "CPU");
            return false;
        }
    }
    return true;
}

/* The elements [*lo, *hi) that rank r of n reduces in an all_reduce of k:
 * equal parts in 64-byte multiples; false when r's part is empty. */
static bool allreduce_part(size_t k, int n, int r, size_t es, size_t *lo, size_t *hi)
{
    size_t align = 64 / es;
    size_t part = (k + (size_t)n - 1) / (size_t)n;
    part = (part + align - 1) / align * align;
    *lo = (size_t)r * part;
    *hi = *lo + part < k ? *lo + part : k;
    return *lo < *hi;
}

/* Reductions read and write peers' buffers from this rank's GPU: those on
 * other GPUs must be reachable (peer access). */
static tp_status cuda_reach_peers(shm_rank *R, uint64_t s)
{
    shm_group *g = R->g;
    tp__shm_cuda *c = g->cuda[R->rank];
    for (int q = 0; q < g->n; q++)
        TP_CHECK(tp__shm_cuda_enable_peer(c, g->slots[q].ring[s % SHM_RING].cuda_dev));
    return TP_OK;
}

/* The data phase of a collective on CUDA buffers: this rank's share, as in
 * data_phase, enqueued on its stream after the peers' ready events. */
static tp_status data_phase_cuda(shm_rank *R, uint64_t s)
{
    shm_group *g = R->g;
    int n = g->n, r = R->rank;
#define PEER(q) (&g->slots[(q)].ring[s % SHM_RING])
    const shm_op *me = PEER(r);
    tp__shm_cuda *c = g->cuda[r];
    size_t es = tp_dtype_size(me->dtype), k = me->count, bytes = k * es;
    for (int q = 0; q < n; q++)
        if (q != r)
            TP_CHECK(tp__shm_cuda_wait(c, PEER(q)->ready));
    switch (me->kind) {
    case TP_COLL_ALL_REDUCE: {
        /* rank r reduces part r of every input and writes it to every output */
        size_t lo, hi;
        if (!allreduce_part(k, n, r, es, &lo, &hi))
            break;
        TP_CHECK(cuda_reach_peers(R, s));
        for (int q = 0; q < n; q++) {
            R->srcs[q] = PEER(q)->send;
            R->dsts[q] = PEER(q)->recv;
        }
        TP_CHECK(
            tp__shm_cuda_reduce(c, me->dtype, me->op, n, n, R->srcs, lo, n, R->dsts, lo, hi - lo));
        break;
    }
    case TP_COLL_ALL_GATHER:
        /* push this rank's block to every output, staggered */
        for (int j = 0; j < n; j++) {
            int q = (r + j) % n;
            TP_CHECK(
                tp__shm_cuda_copy(c, (char *)PEER(q)->recv + (size_t)r * bytes, me->send, bytes));
        }
        break;
    case TP_COLL_REDUCE_SCATTER:
        TP_CHECK(cuda_reach_peers(R, s));
        for (int q = 0; q < n; q++)
            R->srcs[q] = PEER(q)->send;
        R->dsts[0] = me->recv;
        TP_CHECK(tp__shm_cuda_reduce(c, me->dtype, me->op, n, n, R->srcs, (size_t)r * k, 1, R->dsts,
                                     0, k));
        break;
    case TP_COLL_ALL_TO_ALL:
        for (int j = 0; j < n; j++) {
            int q = (r + j) % n;
            TP_CHECK(tp__shm_cuda_copy(c, (char *)me->recv + (size_t)q * bytes,
                                       (const char *)PEER(q)->send + (size_t)r * bytes, bytes));
        }
        break;
    case TP_COLL_BROADCAST:
        if (r != me->root)
            TP_CHECK(tp__shm_cuda_copy(c, me->recv, PEER(me->root)->send, bytes));
        break;
    case TP_COLL_SCATTER:
        TP_CHECK(tp__shm_cuda_copy(c, me->recv,
                                   (const char *)PEER(me->root)->send + (size_t)r * bytes, bytes));
        break;
    default:
        break;
    }
#undef PEER
    return tp__shm_cuda_done(c, (int)(s % SHM_RING));
}

/* A rank that could not do its share of collective s on its GPU: the others'
 * results depend on it, so the collective fails on every rank (each sees
 * `failed` in this rank's entry when it completes) and the group aborts. */
static void cuda_phase_failed(shm_rank *R, uint64_t s, shm_work *wk, tp_status st)
{
    shm_group *g = R->g;
    g->slots[R->rank].ring[s % SHM_RING].failed = 1;
    wk->status = st;
    snprintf(wk->msg, sizeof wk->msg, "%s", tp_last_error());
    char why[512];
    snprintf(why, sizeof why, "rank %d failed its part of collective #%llu on the GPU: %.400s",
             R->rank, (unsigned long long)s, tp_last_error());
    rank_note_failure(R, FAIL_GAVE_UP);
    group_abort(g, why);
}

/* Collective s completed on every rank: this rank's stream waits for every
 * peer's share of the data movement, or the collective fails here too when
 * a peer's share failed. */
static void cuda_complete(shm_rank *R, uint64_t s, shm_work *wk)
{
    shm_group *g = R->g;
    for (int q = 0; q < g->n && wk->status == TP_OK; q++) {
        const shm_op *p = &g->slots[q].ring[s % SHM_RING];
        if (p->failed) {
            wk->status = TP_ERR_ABORTED;
            snprintf(wk->msg, sizeof wk->msg,
                     "rank %d failed its part of collective #%llu on the GPU", q,
                     (unsigned long long)s);
        } else if (q != R->rank) {
            tp_status st = tp__shm_cuda_wait(g->cuda[R->rank], p->done);
            if (st != TP_OK) {
                wk->status = st;
                snprintf(wk->msg, sizeof wk->msg, "%s", tp_last_error());
            }
        }
    }
}

static void data_phase(shm_rank *R, uint64_t s, shm_work *wk)
{
    shm_group *g = R->g;
    int n = g->n, r = R->rank;
    const shm_op *me = &g->slots[r].ring[s % SHM_RING];
    const shm_op *ops[1]; /* silence unused warnings in some branches */
    (void)ops;
#define PEER(q) (&g->slots[(q)].ring[s % SHM_RING])
    size_t es = tp_dtype_size(me->dtype);
    size_t k = me->count;
    size_t limit = tp__stream_bytes();

    switch (me->kind) {
    case TP_COLL_ALL_REDUCE: {
        /* rank r reduces part r of every input and writes it to every output */
        size_t lo, hi;
        if (!allreduce_part(k, n, r, es, &lo, &hi))
            break;
        for (int q = 0; q < n; q++) {
            R->srcs[q] = PEER(q)->send;
            R->dsts[q] = PEER(q)->recv;
        }
        bool stream = (hi - lo) * es * (size_t)n >= limit;
        tp__shm_reduce(me->dtype, me->op, n, n, R->srcs, lo, n, R->dsts, lo, hi - lo, stream);
        break;
    }
    case TP_COLL_ALL_GATHER: {
        /* push: this rank's block is read once per tile and written to all */
        const char *src = me->send;
        size_t bytes = k * es, tile = 64 << 10;
        bool stream = bytes * (size_t)n >= limit;
        for (size_t off = 0; off < bytes; off += tile) {
            size_t len = bytes - off < tile ? bytes - off : tile;
            for (int j = 0; j < n; j++) {
                int q = (r + j) % n; /* stagger so ranks do not hit one buffer */
                char *dst = (char *)PEER(q)->recv + (size_t)r * bytes;
                if (dst != src)
                    tp__shm_copy(dst + off, src + off, len, stream);
            }
        }
        break;
    }
    case TP_COLL_REDUCE_SCATTER: {
        for (int q = 0; q < n; q++)
            R->srcs[q] = PEER(q)->send;
        R->dsts[0] = me->recv;
        bool stream = k * es >= limit;
        tp__shm_reduce(me->dtype, me->op, n, n, R->srcs, (size_t)r * k, 1, R->dsts, 0, k,
                       stream);
        break;
    }
    case TP_COLL_ALL_TO_ALL: {
        size_t bytes = k * es;
        bool stream = bytes * (size_t)n >= limit;
        for (int j = 0; j < n; j++) {
            int q = (r + j) % n;
            tp__shm_copy((char *)me->recv + (size_t)q * bytes,
                         (const char *)PEER(q)->send + (size_t)r * bytes, bytes, stream);
        }
        break;
    }
    case TP_COLL_BROADCAST:
        if (r != me->root && me->recv != PEER(me->root)->send)
            tp__shm_copy(me->recv, PEER(me->root)->send, k * es, k * es >= limit);
        break;
    case TP_COLL_SCATTER: {
        /* pull: this rank's block straight from root's send buffer */
        const char *src = (const char *)PEER(me->root)->send + (size_t)r * k * es;
        if (me->recv != src)
            tp__shm_copy(me->recv, src, k * es, k * es >= limit);
        break;
    }
    case TP_COLL_BARRIER:
        break;
    case SHM_SPLIT_EXCHANGE:
        for (int q = 0; q < n; q++) {
            R->split_colors[q] = PEER(q)->color;
            R->split_keys[q] = PEER(q)->key;
        }
        break;
    case SHM_SPLIT_PUBLISH: {
        /* me->root holds the leader of this rank's new group (or -1). The
         * reference is taken here, while the leader's creation reference is
         * certainly alive: the leader drops it only after this phase ended
         * on every rank, or after an abort that no data phase outlives. */
        shm_group *ng = me->root >= 0 ? PEER(me->root)->new_group : NULL;
        if (ng)
            atomic_fetch_add(&ng->refs, 1);
        R->split_result = ng;
        break;
    }
    default:
        TP_ASSERT(!"unknown shm op");
    }
#undef PEER
}

/* Advances this rank's outstanding collectives as far as possible without
 * blocking. */
static void rank_progress(shm_rank *R)
{
    shm_group *g = R->g;
    int n = g->n;
    shm_slot *mine = &g->slots[R->rank];
    while (R->completed < R->posted) {
        uint64_t s = R->completed + 1;
        if (R->progressed < s) {
            for (int q = 0; q < n; q++)
                if (atomic_load_explicit(&g->slots[q].arrived, memory_order_acquire) < s)
                    return;
            shm_work *wk = &R->works[s % SHM_RING];
            atomic_store(&mine->busy, s);
            if (group_is_aborted(g)) {
                /* peers may already be gone: touch nothing */
                atomic_store(&mine->busy, 0);
                return;
            }
            if (ops_match(R, s, wk)) {
                wk->status = TP_OK;
                if (!mine->ring[s % SHM_RING].on_cuda) {
                    data_phase(R, s, wk);
                } else {
                    tp_status st = data_phase_cuda(R, s);
                    if (st != TP_OK)
                        cuda_phase_failed(R, s, wk, st);
                }
            } else {
                wk->status = TP_ERR_MISMATCH;
            }
            tp__shm_store_fence();
            atomic_store_explicit(&mine->done, s, memory_order_seq_cst);
            atomic_store(&mine->busy, 0);
            R->progressed = s;
            run_wake(g->run);
        }
        for (int q = 0; q < n; q++)
            if (atomic_load_explicit(&g->slots[q].done, memory_order_acquire) < s)
                return;
        shm_work *wk = &R->works[s % SHM_RING];
        if (mine->ring[s % SHM_RING].on_cuda && wk->status == TP_OK)
            cuda_complete(R, s, wk);
        R->completed = s;
    }
}

/* A peer that returned from its rank function cannot join any more. */
static bool peer_gone(shm_rank *R, uint64_t s, char *why, size_t len)
{
    shm_group *g = R->g;
    for (int q = 0; q < g->n; q++) {
        if (!atomic_load(&g->run->exited[g->world[q]]))
            continue;
        if (atomic_load(&g->slots[q].done) < s) {
            snprintf(why, len, "rank %d returned without joining collective #%llu", q,
                     (unsigned long long)s);
            return true;
        }
    }
    return false;
}

/* A wait for collective s of rank R. */
typedef struct shm_wait {
    shm_rank *R;
    uint64_t s;
    uint32_t seen; /* the run's epoch before the latest test: no wake-up after it is missed */
} shm_wait;

/* One test (a tp__poll_fn): makes what progress it can without blocking. */
static tp_status wait_poll(void *ctx, bool *done)
{
    shm_wait *w = ctx;
    shm_rank *R = w->R;
    w->seen = atomic_load(&R->g->run->epoch);
    rank_progress(R);
    *done = R->completed >= w->s;
    if (*done || !group_is_aborted(R->g))
        return TP_OK;
    /* the abort may have come after every rank finished s: then s is
     * complete here too, as it is for the ranks that saw it first */
    rank_progress(R);
    *done = true;
    return R->completed >= w->s ? TP_OK : rank_aborted(R);
}

/* Between two tests once yielding did not do: a peer that returned without
 * joining aborts the group (the next test reports it); otherwise sleep on
 * the run's futex until a peer's progress wakes this rank, 10 ms at most. */
static void wait_sleep(void *ctx)
{
    shm_wait *w = ctx;
    shm_rank *R = w->R;
    shm_group *g = R->g;
    shm_run *run = g->run;
    char why[256];
    if (peer_gone(R, w->s, why, sizeof why)) {
        group_abort(g, why);
        return;
    }
    atomic_fetch_add(&run->sleepers, 1);
    rank_progress(R);
    if (R->completed < w->s && !group_is_aborted(g))
        run_sleep(run, w->seen, 0.01);
    atomic_fetch_sub(&run->sleepers, 1);
}

/* Makes progress without blocking; *done once collective s completed for
 * this rank. */
static tp_status rank_test(shm_rank *R, uint64_t s, bool *done)
{
    shm_wait w = {.R = R, .s = s};
    return wait_poll(&w, done);
}

/* Waits until collective s completed for this rank: spins briefly, then
 * yields, then sleeps on the futex; with more ranks than cores it yields at
 * once, and it reads the clock only every 64th test while spinning. */
static tp_status rank_wait(shm_rank *R, uint64_t s, double timeout)
{
    shm_group *g = R->g;
    bool crowded = g->n > tp__ncpu();
    const tp__pace pace = {.spin_s = crowded ? 0 : 50e-6, .yield_s = crowded ? 200e-6 : 1e-3,
                           .sleep = wait_sleep, .every = crowded ? 1 : 64};
    shm_wait w = {.R = R, .s = s};
    tp_status st = tp__poll_until(wait_poll, &w, timeout, &pace);
    if (st != TP_ERR_TIMEOUT)
        return st;
    char why[256];
    snprintf(why, sizeof why,
             "rank %d (world rank %d) timed out after %.3g s waiting for collective #%llu",
             R->rank, g->world[R->rank], timeout, (unsigned long long)s);
    rank_note_failure(R, FAIL_TIMEOUT); /* before any peer can see the abort */
    group_abort(g, why);
    rank_quiesce(R);
    return tp__error(TP_ERR_TIMEOUT, "%s", why);
}

/* ---- posting -------------------------------------------------------------- */

/* This rank failed before joining a collective its peers will wait in (st
 * recorded): the group aborts, so they fail at once rather than time out. */
static tp_status rank_gave_up(shm_rank *R, tp_status st)
{
    char why[512];
    snprintf(why, sizeof why, "rank %d gave up: %.480s", R->rank, tp_last_error());
    rank_note_failure(R, FAIL_GAVE_UP);
    group_abort(R->g, why);
    return st;
}

static tp_status rank_post(shm_rank *R, const shm_op *op, double timeout, shm_work **out)
{
    shm_group *g = R->g;
    if (group_is_aborted(g))
        return rank_aborted(R);
    uint64_t s = R->posted + 1;
    shm_work *wk = &R->works[s % SHM_RING];
    if (!wk->retired)
        return tp__error(TP_ERR_STATE,
                         "more than %d collectives outstanding on one communicator: wait on "
                         "or free earlier work first",
                         SHM_RING - 1);
    if (s > SHM_RING && R->completed < s - SHM_RING) {
        /* the ring entry is still readable by peers until that op completed */
        TP_CHECK(rank_wait(R, s - SHM_RING, timeout));
    }
    shm_slot *mine = &g->slots[R->rank];
    shm_op o = *op;
    if (o.on_cuda) {
        /* what this rank issued so far on its stream, for the peers to wait on */
        tp_status st = tp__shm_cuda_post(g->cuda[R->rank], (int)(s % SHM_RING), &o.ready, &o.done);
        if (st != TP_OK)
            return rank_gave_up(R, st);
    }
    mine->ring[s % SHM_RING] = o;
    wk->seq = s;
    wk->status = TP_OK;
    wk->retired = false;
    wk->msg[0] = '\0';
    R->posted = s;
    atomic_store_explicit(&mine->arrived, s, memory_order_seq_cst);
    run_wake(g->run);
    *out = wk;
    return TP_OK;
}

static tp_status work_result(shm_work *wk)
{
    if (wk->status != TP_OK && wk->msg[0])
        return tp__error(wk->status, "%s", wk->msg);
    return wk->status;
}

/* This rank's CUDA events for the group, made on its first CUDA collective
 * there; a failure aborts the group so that no peer waits for this rank. */
static tp_status rank_cuda(shm_rank *R, int dev)
{
    shm_group *g = R->g;
    tp__shm_cuda **c = &g->cuda[R->rank];
    if (*c && tp__shm_cuda_device(*c) == dev)
        return TP_OK;
    if (*c)
        return rank_gave_up(
            R, tp__error(TP_ERR_INVALID_ARG,
                         "backend 'shm': rank %d passed tensors of CUDA device %d, but it moves "
                         "CUDA device %d's on this communicator (one GPU per rank and "
                         "communicator; split or create another communicator for another GPU)",
                         R->rank, dev, tp__shm_cuda_device(*c)));
    tp_status st = tp__shm_cuda_create(dev, SHM_RING, c);
    return st == TP_OK ? TP_OK : rank_gave_up(R, st);
}

/* The one-rank group on CUDA buffers: the result is a copy on the rank's
 * stream (a reduction over one source is that source). */
static tp_status solo_cuda(shm_rank *R, const tp_coll_desc *d)
{
    TP_CHECK(rank_cuda(R, d->device.index));
    bool moves = d->kind == TP_COLL_ALL_REDUCE || d->kind == TP_COLL_REDUCE_SCATTER ||
                 d->kind == TP_COLL_ALL_GATHER || d->kind == TP_COLL_ALL_TO_ALL ||
                 d->kind == TP_COLL_SCATTER;
    if (!moves || d->sendbuf == d->recvbuf || !d->count)
        return TP_OK;
    return tp__shm_cuda_copy(R->g->cuda[R->rank], d->recvbuf, d->sendbuf,
                             d->count * tp_dtype_size(d->dtype));
}

static tp_status shm_collective(void *state, const tp_coll_desc *d, void **work)
{
    shm_rank *R = state;
    bool cuda = d->kind != TP_COLL_BARRIER && d->device.type == TP_DEVICE_CUDA;
    shm_op op = {.kind = d->kind,
                 .dtype = d->dtype,
                 .op = d->op,
                 .root = d->root,
                 .count = d->count,
                 .send = d->sendbuf,
                 .recv = d->recvbuf,
                 .on_cuda = cuda,
                 .cuda_dev = cuda ? d->device.index : 0};
    if (R->g->n == 1) {
        /* nothing to wait for; still honour the copy and op semantics */
        if (group_is_aborted(R->g))
            return rank_aborted(R);
        *work = NULL;
        if (cuda)
            return solo_cuda(R, d);
        size_t es = tp_dtype_size(d->dtype);
        if (d->kind == TP_COLL_ALL_REDUCE || d->kind == TP_COLL_REDUCE_SCATTER) {
            const void *src[1] = {d->sendbuf};
            void *dst[1] = {d->recvbuf};
            tp__shm_reduce(d->dtype, d->op, 1, 1, src, 0, 1, dst, 0, d->count, false);
        } else if (d->kind == TP_COLL_ALL_GATHER || d->kind == TP_COLL_ALL_TO_ALL ||
                   d->kind == TP_COLL_SCATTER) {
            if (d->sendbuf != d->recvbuf && d->count)
                memcpy(d->recvbuf, d->sendbuf, d->count * es);
        }
        return TP_OK;
    }
    if (cuda && !group_is_aborted(R->g))
        TP_CHECK(rank_cuda(R, d->device.index));
    shm_work *wk = NULL;
    TP_CHECK(rank_post(R, &op, d->timeout_s, &wk));
    *work = wk;
    return TP_OK;
}

static tp_status shm_work_test(void *state, void *work, bool *done)
{
    shm_rank *R = state;
    shm_work *wk = work;
    TP_CHECK(rank_test(R, wk->seq, done));
    return *done ? work_result(wk) : TP_OK;
}

static tp_status shm_work_wait(void *state, void *work, double timeout_s)
{
    shm_rank *R = state;
    shm_work *wk = work;
    TP_CHECK(rank_wait(R, wk->seq, timeout_s));
    return work_result(wk);
}

static void shm_work_free(void *state, void *work)
{
    (void)state;
    ((shm_work *)work)->retired = true;
}

/* ---- groups and ranks ----------------------------------------------------- */

static void group_release(shm_group *g)
{
    if (atomic_fetch_sub(&g->refs, 1) != 1)
        return;
    shm_run *run = g->run;
    for (int i = 0; i < g->n; i++)
        tp__shm_cuda_destroy(g->cuda[i]);
    tp__free(g->cuda);
    tp__abort_destroy(&g->abort);
    tp__free(g->slots);
    tp__free(g->world);
    tp__free(g);
    run_release(run);
}

static shm_group *group_create(shm_run *run, int n, const int *world)
{
    shm_group *g = tp__calloc(1, sizeof *g);
    if (!g)
        return NULL;
    g->n = n;
    g->run = run;
    atomic_init(&g->refs, 1); /* the creator's; members add their own */
    tp__abort_init(&g->abort);
    g->world = tp__malloc(sizeof(int) * (size_t)n);
    g->slots = tp__aligned_alloc(sizeof(shm_slot) * (size_t)n, 64);
    g->cuda = tp__calloc((size_t)n, sizeof *g->cuda);
    if (!g->world || !g->slots || !g->cuda) {
        tp__abort_destroy(&g->abort);
        tp__free(g->world);
        tp__free(g->slots);
        tp__free(g->cuda);
        tp__free(g);
        return NULL;
    }
    memset(g->slots, 0, sizeof(shm_slot) * (size_t)n);
    memcpy(g->world, world, sizeof(int) * (size_t)n);
    atomic_fetch_add(&run->refs, 1);
    return g;
}

static void rank_destroy(shm_rank *R)
{
    tp__free(R->srcs);
    tp__free(R->dsts);
    tp__free(R->split_colors);
    tp__free(R->split_keys);
    tp__free(R);
}

static shm_rank *rank_create(shm_group *g, int rank)
{
    shm_rank *R = tp__calloc(1, sizeof *R);
    if (!R)
        return NULL;
    R->g = g;
    R->rank = rank;
    R->srcs = tp__calloc((size_t)g->n, sizeof *R->srcs);
    R->dsts = tp__calloc((size_t)g->n, sizeof *R->dsts);
    if (!R->srcs || !R->dsts) {
        rank_destroy(R);
        return NULL;
    }
    for (int i = 0; i < SHM_RING; i++)
        R->works[i].retired = true;
    return R;
}

static void shm_free(void *state)
{
    shm_rank *R = state;
    if (!R)
        return;
    /* peers may still read this rank's buffers for posted collectives */
    if (R->completed < R->posted && !group_is_aborted(R->g))
        (void)rank_wait(R, R->posted, tp__default_timeout());
    shm_group *g = R->g;
    rank_destroy(R);
    group_release(g);
}

static void shm_abort(void *state, const char *reason)
{
    shm_rank *R = state;
    char why[512];
    snprintf(why, sizeof why, "rank %d aborted: %s", R->rank, reason);
    rank_note_failure(R, FAIL_GAVE_UP);
    group_abort(R->g, why);
}

static tp_status split_wait(shm_rank *R, const shm_op *op, double timeout)
{
    shm_work *wk = NULL;
    TP_CHECK(rank_post(R, op, timeout, &wk));
    tp_status st = rank_wait(R, wk->seq, timeout);
    if (st == TP_OK)
        st = work_result(wk);
    wk->retired = true;
    return st;
}

static tp_status shm_split(void *state, int color, int key, double timeout_s, void **new_state,
                           int *new_rank, int *new_size)
{
    shm_rank *R = state;
    shm_group *g = R->g;
    int n = g->n;
    *new_state = NULL;
    tp_status st = TP_OK;
    int *members = NULL, *world = NULL;
    shm_group *ng = NULL;
    if (!R->split_colors) {
        R->split_colors = tp__malloc(sizeof(int) * (size_t)n);
        R->split_keys = tp__malloc(sizeof(int) * (size_t)n);
    }
    members = tp__malloc(sizeof(int) * (size_t)n);
    world = tp__malloc(sizeof(int) * (size_t)n);
    if (!R->split_colors || !R->split_keys || !members || !world) {
        rank_note_failure(R, FAIL_GAVE_UP);
        group_abort(g, "a rank ran out of memory in tp_comm_split");
        st = tp__error(TP_ERR_NO_MEMORY, "out of memory");
        goto out;
    }
    shm_op ex = {.kind = SHM_SPLIT_EXCHANGE, .color = color, .key = key};
    if ((st = split_wait(R, &ex, timeout_s)) != TP_OK)
        goto out;

    /* members of this rank's color, ordered by (key, old rank) */
    int m = 0, me = -1;
    if (color >= 0) {
        for (int q = 0; q < n; q++) {
            if (R->split_colors[q] != color)
                continue;
            int pos = m++;
            while (pos > 0 && (R->split_keys[members[pos - 1]] > R->split_keys[q]))
                members[pos] = members[pos - 1], pos--;
            members[pos] = q;
        }
        for (int i = 0; i < m; i++) {
            world[i] = g->world[members[i]];
            if (members[i] == R->rank)
                me = i;
        }
    }
    if (me == 0)
        ng = group_create(g->run, m, world);
    R->split_result = NULL;
    shm_op pub = {.kind = SHM_SPLIT_PUBLISH, .root = color >= 0 ? members[0] : -1,
                  .new_group = ng};
    st = split_wait(R, &pub, timeout_s);
    if (ng)
        group_release(ng); /* creation reference: every member holds its own now */
    ng = R->split_result;
    R->split_result = NULL;
    if (st != TP_OK) {
        if (ng)
            group_release(ng);
        goto out;
    }
    if (color < 0)
        goto out;
    if (!ng) {
        st = tp__error(TP_ERR_NO_MEMORY, "the new group of color %d could not be allocated",
                       color);
        goto out;
    }
    shm_rank *NR = rank_create(ng, me);
    if (!NR) {
        rank_note_failure(R, FAIL_GAVE_UP);
        group_abort(ng, "a rank ran out of memory joining the group in tp_comm_split");
        group_release(ng);
        st = tp__error(TP_ERR_NO_MEMORY, "out of memory");
        goto out;
    }
    *new_state = NR;
    *new_rank = me;
    *new_size = m;
out:
    tp__free(members);
    tp__free(world);
    return st;
}

/* No world of its own (init_world): tp_run_local makes it. */
const tp_backend tp__shm_backend = {
    .name = "shm",
    .device_mask = (1u << TP_DEVICE_CPU) | (TP_HAVE_CUDA ? 1u << TP_DEVICE_CUDA : 0u),
    .checks_descriptors = true,
    .collective = shm_collective,
    .work_test = shm_work_test,
    .work_wait = shm_work_wait,
    .work_free = shm_work_free,
    .split = shm_split,
    .abort = shm_abort,
    .free = shm_free,
};

/* ---- tp_run_local --------------------------------------------------------- */

static void run_release(shm_run *run)
{
    if (atomic_fetch_sub(&run->refs, 1) != 1)
        return;
    pthread_mutex_destroy(&run->mu);
    tp__abort_destroy(&run->abort);
    tp__free((void *)run->exited);
    tp__free((void *)run->fail_at);
    tp__free(run);
}

typedef struct shm_thread {
    shm_run *run;
    shm_group *world;
    int rank;
    tp_rank_fn fn;
    void *arg;
    const tp_run_options *opts;
    tp_status status;
    pthread_t tid;
} shm_thread;

/* World rank `rank` returned st != TP_OK. Its failure happened when its
 * wait first timed out (TP_ERR_TIMEOUT) or it first saw an abort
 * (TP_ERR_ABORTED), or else at its earliest recorded failure of any kind,
 * or else now; the run keeps the earliest. The first rank to return aborts
 * the run, so no peer waits for a rank that is gone. */
static void run_fail(shm_run *run, int rank, tp_status st, const char *msg)
{
    char why[1200];
    const _Atomic uint64_t *at = &run->fail_at[(size_t)rank * FAIL_KINDS];
    uint64_t t = st == TP_ERR_TIMEOUT   ? atomic_load(&at[FAIL_TIMEOUT])
                 : st == TP_ERR_ABORTED ? atomic_load(&at[FAIL_ABORTED])
                                        : 0;
    if (!t) {
        for (int k = 0; k < FAIL_KINDS; k++) {
            uint64_t tk = atomic_load(&at[k]);
            if (tk && (!t || tk < t))
                t = tk;
        }
    }
    if (!t)
        t = atomic_fetch_add(&run->clock, 1) + 1;
    pthread_mutex_lock(&run->mu);
    bool first = run->fail_status == TP_OK;
    if (first || t < run->fail_ticket) {
        run->fail_rank = rank;
        run->fail_ticket = t;
        run->fail_status = st;
        snprintf(run->fail_msg, sizeof run->fail_msg, "%s", msg);
    }
    pthread_mutex_unlock(&run->mu);
    if (first) {
        snprintf(why, sizeof why, "rank %d failed with %s: %.1000s", rank, tp_status_name(st), msg);
        run_abort(run, why);
    }
}

static void *shm_thread_main(void *p)
{
    shm_thread *t = p;
    shm_run *run = t->run;
    tp_comm *comm = NULL;
    tp__log_set_thread_rank(t->rank); /* TP_DEBUG lines carry the world rank */
    shm_rank *R = rank_create(t->world, t->rank);
    tp_status st = R ? tp_comm_create(&tp__shm_backend, R, t->rank, run->n, &comm)
                     : tp__error(TP_ERR_NO_MEMORY, "tp_run_local: out of memory for rank %d",
                                 t->rank);
    if (st == TP_OK) {
        comm->owned_by_run = true;
        if (t->opts && t->opts->timeout_s > 0)
            comm->timeout_s = t->opts->timeout_s;
        if (t->opts && t->opts->check)
            comm->check = true;
        tp_clear_error();
        st = t->fn(comm, t->arg);
        if (st != TP_OK)
            run_fail(run, t->rank, st, tp_last_error());
        comm->owned_by_run = false;
        /* the run's reference: a mesh or work handle the rank left behind
         * keeps the world alive (and the run's groups with it) until freed;
         * the last release waits for this rank's outstanding work */
        tp__comm_release(comm);
    } else {
        run_fail(run, t->rank, st, tp_last_error());
        if (R)
            shm_free(R);
        else
            group_release(t->world);
    }
    atomic_store(&run->exited[t->rank], 1);
    run_wake_all(run);
    t->status = st;
    return NULL;
}

tp_status tp_run_local_opts(int n, tp_rank_fn fn, void *arg, const tp_run_options *opts)
{
    TP_ARG_CHECK(n >= 1 && n <= 4096, "tp_run_local: rank count must be in [1, 4096], got %d",
                 n);
    TP_ARG_CHECK(fn, "tp_run_local: rank function is NULL");
    if (opts && opts->timeout_s < 0)
        return tp__error(TP_ERR_INVALID_ARG, "tp_run_local: negative timeout %g s",
                         opts->timeout_s);
    tp_status st = TP_OK;
    shm_run *run = tp__calloc(1, sizeof *run);
    shm_thread *th = tp__calloc((size_t)n, sizeof *th);
    int *ids = tp__malloc(sizeof(int) * (size_t)n);
    shm_group *world = NULL;
    int started = 0;
    if (!run || !th || !ids)
        goto oom;
    run->exited = tp__calloc((size_t)n, sizeof *run->exited);
    run->fail_at = tp__calloc((size_t)n * FAIL_KINDS, sizeof *run->fail_at);
    if (!run->exited || !run->fail_at)
        goto oom;
    run->n = n;
    atomic_init(&run->refs, 1);
    pthread_mutex_init(&run->mu, NULL);
    tp__abort_init(&run->abort);
    for (int i = 0; i < n; i++)
        ids[i] = i;
    world = group_create(run, n, ids);
    if (!world) {
        run_release(run);
        run = NULL;
        goto oom;
    }
    atomic_store(&world->refs, n); /* one per rank thread */
    for (int i = 0; i < n; i++) {
        th[i] = (shm_thread){.run = run, .world = world, .rank = i, .fn = fn, .arg = arg,
                             .opts = opts};
        if (pthread_create(&th[i].tid, NULL, shm_thread_main, &th[i]) != 0) {
            /* ranks never started cannot take part: fail the others cleanly */
            run_fail(run, i, TP_ERR_BACKEND, "could not start the rank thread");
            for (int j = i; j < n; j++) {
                atomic_store(&run->exited[j], 1);
                group_release(world);
            }
            break;
        }
        started++;
    }
    for (int i = 0; i < started; i++)
        pthread_join(th[i].tid, NULL);
    if (opts && opts->rank_status)
        for (int i = 0; i < n; i++)
            opts->rank_status[i] = i < started ? th[i].status : TP_ERR_BACKEND;
    if (run->fail_status != TP_OK) {
        char msg[1200];
        snprintf(msg, sizeof msg, "rank %d: %s", run->fail_rank, run->fail_msg);
        tp__error_set_text(msg);
        st = run->fail_status;
    }
    run_release(run);
    tp__free(th);
    tp__free(ids);
    return st;
oom:
    if (run) {
        tp__free((void *)run->exited);
        tp__free((void *)run->fail_at);
        tp__free(run);
    }
    tp__free(th);
    tp__free(ids);
    return tp__error(TP_ERR_NO_MEMORY, "tp_run_local: out of memory for %d ranks", n);
}

tp_status tp_run_local(int n, tp_rank_fn fn, void *arg)
{
    return tp_run_local_opts(n, fn, arg, NULL);
}
