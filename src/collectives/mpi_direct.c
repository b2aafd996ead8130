/*
 * The mpi backend's direct path. OpenMPI's non-blocking collectives (libnbc)
 * build and run a schedule per call, which costs a few microseconds more
 * than its blocking ones (tuned) on small messages; libtp needs non-blocking
 * calls to keep its timeouts. A small collective (below TP_MPI_DIRECT_BYTES
 * sent per rank, 32 KiB by default; 0 turns the path off) therefore goes as
 * one round of MPI_Isend/MPI_Irecv between every pair of ranks that
 * exchange data, on libtp's own duplicate communicator (so under a tag no
 * other traffic uses), completed with MPI_Testall like any other request.
 * Reductions gather every rank's contribution and reduce them locally in
 * rank order with MPI_Reduce_local (MPI's ops and libtp's f16/bf16 user ops
 * alike), so every rank computes the same bits. MPI keeps messages between
 * two ranks on one tag and communicator in order, and every rank issues
 * libtp's collectives in the same order, so each message meets the receive
 * of its own collective. Set TP_MPI_DIRECT_BYTES alike on every rank (mpirun
 * -x passes it).
 */
#include "collectives/mpi_direct.h"

#include <stdlib.h>
#include <string.h>

enum { DIRECT_TAG = 0x7470 }; /* "tp" */

static size_t direct_limit(void)
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

static bool is_reduction(tp_coll_kind k)
{
    return k == TP_COLL_ALL_REDUCE || k == TP_COLL_REDUCE_SCATTER;
}

bool tp__mpi_direct_fits(const tp_coll_desc *d, int size)
{
    switch (d->kind) {
    case TP_COLL_ALL_REDUCE:
    case TP_COLL_ALL_GATHER:
    case TP_COLL_REDUCE_SCATTER:
    case TP_COLL_ALL_TO_ALL:
    case TP_COLL_BROADCAST:
        break;
    default:
        return false;
    }
    /* every rank sends (size - 1) blocks of count elements (broadcast: root) */
    size_t block = d->count * tp_dtype_size(d->dtype);
    return size >= 2 && block > 0 && (size_t)(size - 1) * block <= direct_limit();
}

int tp__mpi_direct_max_requests(int size)
{
    return 2 * (size - 1);
}

size_t tp__mpi_direct_scratch(const tp_coll_desc *d, int size)
{
    return is_reduction(d->kind) ? (size_t)size * d->count * tp_dtype_size(d->dtype) : 0;
}

int tp__mpi_direct_post(const tp_coll_desc *d, MPI_Comm comm, int rank, int size, MPI_Datatype dt,
                        void *scratch, MPI_Request *reqs, int *nreq)
{
    size_t b = d->count * tp_dtype_size(d->dtype);
    int k = (int)d->count, n = 0, rc = MPI_SUCCESS;
    const char *sb = d->sendbuf;
    char *rb = d->recvbuf, *t = scratch;
    for (int j = 0; j < size && rc == MPI_SUCCESS; j++) {
        if (j == rank)
            continue;
        void *into = NULL;
        const void *from = NULL;
        switch (d->kind) {
        case TP_COLL_ALL_REDUCE:
            into = t + (size_t)j * b;
            from = sb;
            break;
        case TP_COLL_ALL_GATHER:
            into = rb + (size_t)j * b;
            from = sb;
            break;
        case TP_COLL_REDUCE_SCATTER:
            into = t + (size_t)j * b;
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
            rc = MPI_Irecv(into, k, dt, j, DIRECT_TAG, comm, &reqs[n++]);
        if (from && rc == MPI_SUCCESS)
            rc = MPI_Isend(from, k, dt, j, DIRECT_TAG, comm, &reqs[n++]);
    }
    *nreq = n;
    if (rc != MPI_SUCCESS)
        return rc;
    size_t own = (size_t)rank * b;
    switch (d->kind) {
    case TP_COLL_ALL_REDUCE:
        memcpy(t + own, sb, b);
        break;
    case TP_COLL_ALL_GATHER:
        if (sb != rb + own)
            memcpy(rb + own, sb, b);
        break;
    case TP_COLL_REDUCE_SCATTER:
        memcpy(t + own, sb + own, b);
        break;
    case TP_COLL_ALL_TO_ALL:
        memcpy(rb + own, sb + own, b);
        break;
    default:
        break;
    }
    return MPI_SUCCESS;
}

int tp__mpi_direct_reduce(const void *scratch, void *result, int count, size_t elem_size,
                          MPI_Datatype dt, MPI_Op op, int size)
{
    size_t b = (size_t)count * elem_size;
    const char *t = scratch;
    memcpy(result, t, b);
    int rc = MPI_SUCCESS;
    for (int q = 1; q < size && rc == MPI_SUCCESS; q++)
        rc = MPI_Reduce_local(t + (size_t)q * b, result, count, dt, op);
    return rc;
}
