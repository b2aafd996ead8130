/* The mpi backend's direct path (mpi_direct.c): a small collective as one
 * round of point-to-point messages. Internal, not installed. */
#ifndef TP_COLL_MPI_DIRECT_H
#define TP_COLL_MPI_DIRECT_H

#include <mpi.h>
#include <stdbool.h>
#include <stddef.h>

#include "collectives/coll.h"

/* TP_MPI_DIRECT_BYTES (32768 when unset; 0 turns the path off), read when
 * a communicator is made rather than on every call. */
size_t tp__mpi_direct_limit(void);

/* The questions below are asked on every collective of the mpi backend:
 * inline, as the dispatch layer's checks are. */

static inline bool tp__mpi_direct_is_reduction(tp_coll_kind k)
{
    return k == TP_COLL_ALL_REDUCE || k == TP_COLL_REDUCE_SCATTER;
}

/* The largest reduction (bytes per rank) that two ranks on two nodes send
 * as one exchange (tp__mpi_direct_fits). */
#define TP__MPI_APART_DIRECT_MAX ((size_t)4 << 20)

/* Whether the collective `d` on `size` ranks takes the direct path under
 * `limit` (tp__mpi_direct_limit), `apart` when the two ranks of a two-rank
 * group share no node: every rank decides alike from what every rank
 * passes alike (kind, count, dtype, group size, where the ranks are). */
static inline bool tp__mpi_direct_fits(const tp_coll_desc *d, int size, size_t limit, bool apart)
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
    size_t block = d->count * tp__dtype_size(d->dtype);
    if (size < 2 || block == 0 || limit == 0)
        return false;
    /* two ranks: an all_gather, all_to_all or broadcast is one exchange
     * (one message) at any size, which is what MPI's own algorithms do too */
    if (size == 2 && !tp__mpi_direct_is_reduction(d->kind))
        return true;
    /* a reduction too, up to TP__MPI_APART_DIRECT_MAX, when the two share
     * no node: a link, not memory, is the bottleneck there, and one exchange
     * of the whole vector moves the bytes the ring's two steps of halves
     * move, without the pause between the steps; above it the reduction
     * after the exchange, which nothing overlaps, costs more than the pause
     * (1 Gbit/s TCP, all_reduce against MPI_Allreduce, direct / ring: 1 MiB
     * 0.87-0.93 / 1.00-1.045, 4 MiB 0.99-1.06 / 0.93-1.01, 16 MiB 0.95-0.99
     * / 0.96-0.98, the ring 2% faster); between ranks that share memory the
     * ring's half-sized reductions win at every size */
    if (size == 2 && apart && block <= TP__MPI_APART_DIRECT_MAX)
        return true;
    /* every rank sends (size - 1) blocks of count elements (broadcast: root) */
    return (size_t)(size - 1) * block <= limit;
}

/* Messages this rank posts for `d`, at most: the length of the request array
 * tp__mpi_direct_post fills. */
static inline int tp__mpi_direct_max_requests(int size)
{
    return 4 * (size - 1); /* a receive and a send per peer, each maybe as halves */
}

/* Bytes of the scratch buffer a reduction needs (0 for the others): a slot
 * per rank, in rank order, for the contributions that cannot go straight
 * into the result. */
static inline size_t tp__mpi_direct_scratch(const tp_coll_desc *d, int size)
{
    return tp__mpi_direct_is_reduction(d->kind) ? (size_t)size * d->count * tp__dtype_size(d->dtype)
                                                : 0;
}

/* The copy of this rank's own block into an all_gather's or all_to_all's
 * result, made once MPI has completed the exchange, as MPI's own
 * algorithms do: copying while the messages travel, even a chunk between
 * two tests, slows MPI's progress where the transport itself is CPU-bound
 * (TCP between two hosts: a 4-16 MiB all_gather took 1.05-1.08 of MPI's
 * blocking call copying 64 KiB between tests, 0.98-1.00 copying after),
 * and before posting it delays the peer (20% of a 4 MiB all_gather over
 * shared memory). */
typedef struct tp__mpi_copy {
    const char *from;
    char *to;
    size_t left; /* bytes still to copy */
} tp__mpi_copy;

/* Whether a message of just over 2 KiB to 4 KiB goes as two halves on
 * `comm` (rank `rank` of `size`), the same answer on every rank: rank 0's
 * TP_MPI_SPLIT when it is "0" or "1", else measured by ranks 0 and 1 (a
 * 4 KiB exchange, whole and as halves, 16 times each, interleaved; halves
 * when their fastest is 10% below the whole message's) and broadcast by
 * rank 0. Collective over comm, blocking, about 40 exchanges; call it once,
 * before comm carries anything else, under the backend's lock. Returns
 * MPI's code (*split false on failure). */
int tp__mpi_direct_decide_split(MPI_Comm comm, int rank, int size, bool *split);

/* Posts the receives and sends of `d` on `comm` as rank `rank` of `size`
 * (type dt; a message of 2-4 KiB as two halves when `split`) into reqs,
 * setting *nreq to how many were posted (even when a call failed); with
 * `persistent`, makes them as persistent requests instead, inactive, for
 * MPI_Startall (a reduction's own contribution is then not copied: only
 * the other collectives take that form). This
 * rank's own block of an all_gather or all_to_all is left in *copy for the
 * caller, to copy once the requests completed; a
 * reduction's own contribution is copied here where it needs to be. A
 * reduction receives rank 0's contribution straight into the result where
 * the call is out of place (rank 0 copies its own there). Returns MPI's
 * code. */
int tp__mpi_direct_post(const tp_coll_desc *d, MPI_Comm comm, int rank, int size, MPI_Datatype dt,
                        bool split, bool persistent, void *scratch, MPI_Request *reqs, int *nreq,
                        tp__mpi_copy *copy);

/* Once every request of `d` completed: the reduction of the contributions,
 * in rank order (every rank computes the same expression, so the same
 * bits), into d->recvbuf. Reads d's kind, dtype, count, sendbuf and
 * recvbuf only. */
int tp__mpi_direct_reduce(const tp_coll_desc *d, const void *scratch, int rank, int size,
                          MPI_Datatype dt, MPI_Op op);

#endif /* TP_COLL_MPI_DIRECT_H */
