/*
 * The mpi backend's direct path. OpenMPI's non-blocking collectives (libnbc)
 * build and run a schedule per call, which costs a few microseconds more
 * than its blocking ones (tuned) on small messages; libtp needs non-blocking
 * calls to keep its timeouts. A small collective (below TP_MPI_DIRECT_BYTES
 * sent per rank, 32 KiB by default; 0 turns the path off) therefore goes as
 * one round of MPI_Isend/MPI_Irecv between every pair of ranks that
 * exchange data, on libtp's own duplicate communicator (so under a tag no
 * other traffic uses), completed with MPI_Testall (MPI_Test for one) like
 * any other request.
 * On two ranks an all_gather, all_to_all or broadcast takes this path at any
 * size: it is one message each way, what MPI's blocking algorithms send for
 * two ranks too, without libnbc's schedule.
 * Reductions gather every rank's contribution and reduce them locally in
 * rank order with MPI_Reduce_local (MPI's ops and libtp's f16/bf16 user ops
 * alike), so every rank computes the same bits; rank 0's contribution lands
 * in the result straight from the wire when the call is out of place, so
 * nothing is copied but rank 0's own. MPI keeps messages between
 * two ranks on one tag and communicator in order, and every rank issues
 * libtp's collectives in the same order, so each message meets the receive
 * of its own collective. Set TP_MPI_DIRECT_BYTES alike on every rank (mpirun
 * -x passes it).
 */
#include "collectives/mpi_direct.h"
#include "core/log.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { DIRECT_TAG = 0x7470 }; /* "tp" */

/* A message of more than SPLIT_FROM and at most SPLIT_TO bytes may go as
 * two halves (tp__mpi_direct_decide_split): OpenMPI's shared-memory
 * transport (vader) sends a message eagerly only when it fits 4 KiB with
 * its header, so a 4 KiB block waits for a rendezvous round trip where two
 * 2 KiB halves do not. Whether that pays depends on the machine: a 4 KiB
 * exchange took 0.9 us as halves against 1.2 us whole on an AMD EPYC, and
 * 2.45 us against 2.15 us on an Intel Xeon, where the single-copy read is
 * cheaper than a second eager message; over TCP (eager up to 64 KiB) the
 * halves only cost one more header. */
enum { SPLIT_FROM = 2048, SPLIT_TO = 4096 };

size_t tp__mpi_direct_limit(void)
{
    const char *env = getenv("TP_MPI_DIRECT_BYTES");
    if (env && *env) {
        char *end = NULL;
        unsigned long long v = strtoull(env, &end, 10);
        if (end && *end == '\0')
            return (size_t)v;
    }
    return 32768;
}

/* Whether a message of k elements (b bytes) goes as two halves when the
 * communicator's answer is `split`: when it would just miss the eager size. */
static bool as_halves(bool split, size_t b, int k)
{
    return split && b > SPLIT_FROM && b <= SPLIT_TO && k > 1;
}

/* How a message is posted: a receive or a send, started now or made as a
 * persistent request (MPI_Recv_init / MPI_Send_init) for MPI_Startall. */
enum { POST_RECV = 0, POST_SEND = 1, POST_RECV_INIT = 2, POST_SEND_INIT = 3 };

static int post_one(int how, void *buf, int k, MPI_Datatype dt, int j, MPI_Comm comm,
                    MPI_Request *req)
{
    switch (how) {
    case POST_SEND:
        return MPI_Isend(buf, k, dt, j, DIRECT_TAG, comm, req);
    case POST_RECV_INIT:
        return MPI_Recv_init(buf, k, dt, j, DIRECT_TAG, comm, req);
    case POST_SEND_INIT:
        return MPI_Send_init(buf, k, dt, j, DIRECT_TAG, comm, req);
    default:
        return MPI_Irecv(buf, k, dt, j, DIRECT_TAG, comm, req);
    }
}

/* Out of line: the rare case, kept off the loop that posts the messages. */
__attribute__((noinline)) static int post_halves(int how, char *buf, int k, size_t b,
                                                 MPI_Datatype dt, int j, MPI_Comm comm,
                                                 MPI_Request *reqs, int *n)
{
    int h = k / 2;
    int rc = post_one(how, buf, h, dt, j, comm, &reqs[(*n)++]);
    if (rc == MPI_SUCCESS)
        rc = post_one(how, buf + b / (size_t)k * (size_t)h, k - h, dt, j, comm, &reqs[(*n)++]);
    return rc;
}

/* One message of k elements of dt (b bytes) from or to peer j, as two halves
 * when `halves` (as_halves). */
static inline int post_msg(int how, void *buf, int k, size_t b, MPI_Datatype dt, int j,
                           MPI_Comm comm, bool halves, MPI_Request *reqs, int *n)
{
    if (halves)
        return post_halves(how, buf, k, b, dt, j, comm, reqs, n);
    return post_one(how, buf, k, dt, j, comm, &reqs[(*n)++]);
}

/* One exchange of a SPLIT_TO-byte message each way between this rank and
 * `peer`, whole or as halves; its time in seconds, or -1 when MPI failed. */
static double time_exchange(MPI_Comm comm, int peer, char *buf, bool split)
{
    MPI_Request reqs[4];
    int n = 0;
    double t0 = MPI_Wtime();
    bool halves = as_halves(split, SPLIT_TO, SPLIT_TO);
    int rc = post_msg(POST_RECV, buf, SPLIT_TO, SPLIT_TO, MPI_BYTE, peer, comm, halves, reqs, &n);
    if (rc == MPI_SUCCESS)
        rc = post_msg(POST_SEND, buf + SPLIT_TO, SPLIT_TO, SPLIT_TO, MPI_BYTE, peer, comm, halves,
                      reqs, &n);
    if (n > 0 && MPI_Waitall(n, reqs, MPI_STATUSES_IGNORE) != MPI_SUCCESS)
        rc = MPI_ERR_OTHER;
    return rc == MPI_SUCCESS ? MPI_Wtime() - t0 : -1;
}

int tp__mpi_direct_decide_split(MPI_Comm comm, int rank, int size, bool *split)
{
    enum { WARMUP = 2, ROUNDS = 16 };
    *split = false;
    /* rank 0's TP_MPI_SPLIT, else a measurement: every rank follows rank 0,
     * so that no rank sends halves to one that expects a whole message */
    const char *env = rank == 0 ? getenv("TP_MPI_SPLIT") : NULL;
    int mode = env && strcmp(env, "1") == 0 ? 1 : env && strcmp(env, "0") == 0 ? 0 : -1;
    int rc = MPI_Bcast(&mode, 1, MPI_INT, 0, comm);
    if (rc != MPI_SUCCESS || size < 2)
        return rc;
    int answer = mode;
    if (mode < 0 && rank < 2) {
        static char buf[2 * SPLIT_TO]; /* callers hold the backend's lock */
        double best[2] = {HUGE_VAL, HUGE_VAL};
        for (int i = 0; i < 2 * (WARMUP + ROUNDS); i++) {
            bool halves = i & 1;
            double t = time_exchange(comm, 1 - rank, buf, halves);
            if (t < 0)
                return MPI_ERR_OTHER;
            if (i >= 2 * WARMUP && t < best[halves])
                best[halves] = t;
        }
        answer = best[1] < 0.9 * best[0];
        if (rank == 0 && TP_LOG_ON(TP_LOG_INFO))
            tp__log(TP_LOG_INFO,
                    "mpi: a 4 KiB exchange with rank 1 took %.2f us whole, %.2f us as two "
                    "halves: 2-4 KiB messages go %s",
                    best[0] * 1e6, best[1] * 1e6, answer ? "as halves" : "whole");
    } else if (rank == 0 && mode >= 0 && TP_LOG_ON(TP_LOG_INFO)) {
        tp__log(TP_LOG_INFO, "mpi: TP_MPI_SPLIT=%d: 2-4 KiB messages go %s", mode,
                mode ? "as halves" : "whole");
    }
    rc = MPI_Bcast(&answer, 1, MPI_INT, 0, comm);
    *split = rc == MPI_SUCCESS && answer == 1;
    return rc;
}

/* A reduction's own contribution: its whole send buffer (all_reduce) or
 * the block of its own rank (reduce_scatter). */
static const char *own_contribution(const tp_coll_desc *d, int rank)
{
    size_t b = d->count * tp__dtype_size(d->dtype);
    return d->kind == TP_COLL_ALL_REDUCE ? d->sendbuf : (const char *)d->sendbuf + (size_t)rank * b;
}

int tp__mpi_direct_post(const tp_coll_desc *d, MPI_Comm comm, int rank, int size, MPI_Datatype dt,
                        bool split, bool persistent, void *scratch, MPI_Request *reqs, int *nreq,
                        tp__mpi_copy *copy)
{
    int recv = persistent ? POST_RECV_INIT : POST_RECV,
        send = persistent ? POST_SEND_INIT : POST_SEND;
    *copy = (tp__mpi_copy){0};
    size_t b = d->count * tp__dtype_size(d->dtype);
    int k = (int)d->count, n = 0, rc = MPI_SUCCESS;
    const char *sb = d->sendbuf;
    char *rb = d->recvbuf, *t = scratch;
    /* a reduction adds the contributions in rank order into the result:
     * rank 0's goes there first, straight from the wire where it can */
    bool red = tp__mpi_direct_is_reduction(d->kind);
    const char *own = red ? own_contribution(d, rank) : NULL;
    bool in_place = red && own == rb;
    bool halves = as_halves(split, b, k);
    for (int j = 0; j < size && rc == MPI_SUCCESS; j++) {
        if (j == rank)
            continue;
        void *into = NULL;
        const void *from = NULL;
        switch (d->kind) {
        case TP_COLL_ALL_REDUCE:
            into = j == 0 && !in_place ? rb : t + (size_t)j * b;
            from = sb;
            break;
        case TP_COLL_ALL_GATHER:
            into = rb + (size_t)j * b;
            from = sb;
            break;
        case TP_COLL_REDUCE_SCATTER:
            into = j == 0 && !in_place ? rb : t + (size_t)j * b;
            from = sb + (size_t)j * b;
            break;
        case TP_COLL_ALL_TO_ALL:
            into = rb + (size_t)j * b;
            from = sb + (size_t)j * b;
            break;
        default: /* broadcast */
            into = rank != d->root && j == d->root ? rb : NULL;
            from = rank == d->root ? rb : NULL;
            break;
        }
        if (into)
            rc = post_msg(recv, into, k, b, dt, j, comm, halves, reqs, &n);
        if (from && rc == MPI_SUCCESS)
            rc = post_msg(send, (void *)from, k, b, dt, j, comm, halves, reqs, &n);
    }
    *nreq = n;
    if (rc != MPI_SUCCESS)
        return rc;
    size_t mine = (size_t)rank * b;
    switch (d->kind) {
    case TP_COLL_ALL_REDUCE:
    case TP_COLL_REDUCE_SCATTER:
        if (rank == 0 && !in_place)
            memcpy(rb, own, b); /* the sum starts from rank 0's contribution */
        else if (rank != 0 && in_place)
            memcpy(t + mine, own, b); /* the result takes rank 0's first */
        break;
    case TP_COLL_ALL_GATHER:
        if (sb != rb + mine)
            *copy = (tp__mpi_copy){.from = sb, .to = rb + mine, .left = b};
        break;
    case TP_COLL_ALL_TO_ALL:
        *copy = (tp__mpi_copy){.from = sb + mine, .to = rb + mine, .left = b};
        break;
    default:
        break;
    }
    return MPI_SUCCESS;
}

int tp__mpi_direct_reduce(const tp_coll_desc *d, const void *scratch, int rank, int size,
                          MPI_Datatype dt, MPI_Op op)
{
    size_t b = d->count * tp__dtype_size(d->dtype);
    const char *t = scratch, *own = own_contribution(d, rank);
    char *result = d->recvbuf;
    bool in_place = own == result;
    if (rank != 0 && in_place) {
        memcpy(result, t, b); /* rank 0's contribution; this rank's is in t */
        own = t + (size_t)rank * b;
    }
    int rc = MPI_SUCCESS;
    for (int q = 1; q < size && rc == MPI_SUCCESS; q++)
        rc = MPI_Reduce_local(q == rank ? own : t + (size_t)q * b, result, (int)d->count, dt, op);
    return rc;
}
