/*
 * The mpi backend's ring path. OpenMPI's non-blocking collectives (libnbc,
 * which libtp needs to keep its timeouts) reduce a reduce_scatter_block to
 * one rank and scatter it, and reduce an all_reduce to one rank and
 * broadcast it when the group has fewer than 4 ranks or the call is in
 * place: every byte crosses the root's links twice, where its blocking
 * collectives (tuned) send each rank's (W-1)/W share once each way. Above the
 * direct path's size (mpi_direct.c) such a collective goes here instead, as
 * the bandwidth-optimal ring:
 *
 *  - reduce-scatter: W-1 steps; at step s rank r sends the partial sum of
 *    block (r-s-1) mod W to rank r+1 (step 0: its own contribution),
 *    receives the partial sum of block (r-s-2) mod W from rank r-1 and adds
 *    its own contribution to it (MPI_Reduce_local: MPI's ops and libtp's
 *    f16/bf16 ops alike). After the last step rank r holds block r summed
 *    over every rank: reduce_scatter's result.
 *  - all_reduce: the same over W blocks of the vector (the first count % W
 *    one element longer), then an all-gather of W-1 steps: at step t rank r
 *    sends block (r-t) mod W to rank r+1 and receives block (r-t-1) mod W
 *    from rank r-1, straight into the result.
 *
 * Each step is one MPI_Irecv and one MPI_Isend, tested like any request;
 * the next is posted when both completed (tp__mpi_ring_progress, called by
 * the backend's test and wait), so a timeout or abort leaves at most one
 * step's two messages with MPI. Each block is summed once, by a chain that
 * is the same for every rank's copy of it, so every rank ends with the same
 * bits (in another order than the direct path's rank order). Every
 * collective in flight on a communicator has its own tag (the backend numbers
 * them), so the steps of two collectives never meet each other's receives.
 */
#include "collectives/mpi_ring.h"

#include <stdlib.h>
#include <string.h>

#include "core/cache.h"
#include "core/core.h"

struct tp__mpi_ring {
    MPI_Request req[2]; /* the current step's receive and send */
    MPI_Comm comm;
    MPI_Datatype dt;
    MPI_Op op;
    int rank, size, tag;
    int step, nsteps, rs_steps; /* reduce-scatter steps come first */
    bool posted;                /* the current step's messages are out */
    bool all_reduce;
    size_t es;
    int64_t n;        /* all_reduce: elements in all; reduce_scatter: per block */
    const char *send; /* every rank's block of this rank's contribution */
    char *recv;       /* all_reduce: the whole result; reduce_scatter: block rank's */
    char *final;      /* where the last reduce step's sum goes: this rank's block of
                       * the result (out of place), or a buf, then copied there */
    char *buf[2];     /* partial sums going round: one block each */
    int cur;          /* buf[cur]: the partial sum the last step completed */
};

bool tp__mpi_ring_enabled(void)
{
    const char *env = getenv("TP_MPI_RING");
    return !(env && strcmp(env, "0") == 0);
}

bool tp__mpi_ring_fits(const tp_coll_desc *d, int size, bool direct, bool enabled)
{
    if (direct || size < 2 || d->count == 0 || !enabled)
        return false;
    if (d->kind == TP_COLL_REDUCE_SCATTER)
        return true;
    /* all_reduce: where libnbc reduces to a root; from 4 ranks, out of
     * place, it runs a reduce-scatter and all-gather of its own */
    return d->kind == TP_COLL_ALL_REDUCE && (size < 4 || d->sendbuf == d->recvbuf);
}

static int mod(int a, int m)
{
    return ((a % m) + m) % m;
}

/* Block b: its first element and its length. */
static int64_t block_off(const tp__mpi_ring *g, int b)
{
    if (!g->all_reduce)
        return (int64_t)b * g->n;
    int64_t q = g->n / g->size, rem = g->n % g->size;
    return (int64_t)b * q + (b < rem ? b : rem);
}

static int64_t block_len(const tp__mpi_ring *g, int b)
{
    if (!g->all_reduce)
        return g->n;
    return g->n / g->size + (b < g->n % g->size ? 1 : 0);
}

tp__mpi_ring *tp__mpi_ring_new(const tp_coll_desc *d, MPI_Comm comm, int rank, int size,
                               MPI_Datatype dt, MPI_Op op, int tag)
{
    tp__mpi_ring *g = tp__calloc(1, sizeof *g);
    if (!g)
        return NULL;
    g->req[0] = g->req[1] = MPI_REQUEST_NULL;
    g->comm = comm;
    g->dt = dt;
    g->op = op;
    g->rank = rank;
    g->size = size;
    g->tag = tag;
    g->all_reduce = d->kind == TP_COLL_ALL_REDUCE;
    g->rs_steps = size - 1;
    g->nsteps = g->all_reduce ? 2 * (size - 1) : size - 1;
    g->es = tp_dtype_size(d->dtype);
    g->n = (int64_t)d->count;
    g->send = d->sendbuf;
    g->recv = d->recvbuf;
    /* both blocks in one allocation from the CPU caching allocator: a large
     * ring's blocks are fresh pages from the kernel each time otherwise, and
     * faulting them in cost 10% of a 64 MiB all_reduce */
    size_t block = (size_t)block_len(g, 0) * g->es; /* block 0 is a longest */
    block = block ? (block + 63) / 64 * 64 : 64;    /* each block on its own lines */
    g->buf[0] = tp__cpu_cache_alloc(2 * block, false);
    if (!g->buf[0]) {
        tp__free(g);
        return NULL;
    }
    g->buf[1] = g->buf[0] + block;
    /* out of place, the last reduce step receives its partial sum straight
     * into this rank's block of the result and adds this rank's
     * contribution there: no copy of the block afterwards. In place, that
     * block still holds the contribution the sum needs, so the sum goes
     * through a buf. */
    char *mine = g->all_reduce ? g->recv + (size_t)block_off(g, rank) * g->es : g->recv;
    const char *own = g->send + (size_t)block_off(g, rank) * g->es;
    size_t bytes = (size_t)block_len(g, rank) * g->es;
    bool overlap = own < mine + bytes && mine < own + bytes;
    g->final = overlap ? NULL : mine;
    return g;
}

MPI_Request *tp__mpi_ring_requests(tp__mpi_ring *g)
{
    return g->req;
}

/* Posts the current step's receive and send. */
static int post_step(tp__mpi_ring *g)
{
    int p = g->size, r = g->rank, s = g->step;
    int left = mod(r - 1, p), right = mod(r + 1, p);
    const char *src;
    char *dst;
    int sb, rb;
    if (s < g->rs_steps) {
        sb = mod(r - s - 1, p);
        rb = mod(r - s - 2, p);
        src = s == 0 ? g->send + (size_t)block_off(g, sb) * g->es : g->buf[g->cur];
        dst = s == g->rs_steps - 1 && g->final ? g->final : g->buf[s == 0 ? 0 : 1 - g->cur];
    } else {
        int t = s - g->rs_steps;
        sb = mod(r - t, p);
        rb = mod(r - t - 1, p);
        src = g->recv + (size_t)block_off(g, sb) * g->es;
        dst = g->recv + (size_t)block_off(g, rb) * g->es;
    }
    g->posted = true;
    int rc = MPI_Irecv(dst, (int)block_len(g, rb), g->dt, left, g->tag, g->comm, &g->req[0]);
    if (rc == MPI_SUCCESS)
        rc = MPI_Isend(src, (int)block_len(g, sb), g->dt, right, g->tag, g->comm, &g->req[1]);
    return rc;
}

/* The current step's messages arrived: add this rank's contribution to the
 * partial sum received, and place the result after the last reduce step. */
static int finish_step(tp__mpi_ring *g)
{
    int p = g->size, r = g->rank, s = g->step;
    if (s >= g->rs_steps)
        return MPI_SUCCESS; /* all-gather: the block is in place */
    int rb = mod(r - s - 2, p);
    bool last = s == g->rs_steps - 1;
    int in = s == 0 ? 0 : 1 - g->cur;
    char *sum = last && g->final ? g->final : g->buf[in];
    int rc = MPI_Reduce_local(g->send + (size_t)block_off(g, rb) * g->es, sum,
                              (int)block_len(g, rb), g->dt, g->op);
    if (rc != MPI_SUCCESS)
        return rc;
    g->cur = in;
    if (last && !g->final) {
        /* buf[cur] is block r, summed over every rank */
        size_t bytes = (size_t)block_len(g, r) * g->es;
        char *to = g->all_reduce ? g->recv + (size_t)block_off(g, r) * g->es : g->recv;
        memcpy(to, g->buf[g->cur], bytes);
    }
    return MPI_SUCCESS;
}

int tp__mpi_ring_progress(tp__mpi_ring *g, bool *done)
{
    *done = false;
    for (;;) {
        if (g->step == g->nsteps) {
            *done = true;
            return MPI_SUCCESS;
        }
        int rc = MPI_SUCCESS;
        if (!g->posted && (rc = post_step(g)) != MPI_SUCCESS)
            return rc;
        int flag = 0;
        rc = MPI_Testall(2, g->req, &flag, MPI_STATUSES_IGNORE);
        if (rc != MPI_SUCCESS || !flag)
            return rc;
        if ((rc = finish_step(g)) != MPI_SUCCESS)
            return rc;
        g->posted = false;
        g->step++;
    }
}

void tp__mpi_ring_free(tp__mpi_ring *g)
{
    if (!g)
        return;
    tp__cpu_cache_free(g->buf[0]);
    tp__free(g);
}
