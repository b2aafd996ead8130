/* The mpi backend's direct path (mpi_direct.c): a small collective as one
 * round of point-to-point messages. Internal, not installed. */
#ifndef TP_COLL_MPI_DIRECT_H
#define TP_COLL_MPI_DIRECT_H

#include <mpi.h>
#include <stdbool.h>
#include <stddef.h>

#include "collectives/coll.h"

/* Whether the collective `d` on `size` ranks takes the direct path: every
 * rank decides alike from what every rank passes alike (kind, count, dtype,
 * group size). */
bool tp__mpi_direct_fits(const tp_coll_desc *d, int size);

/* Messages this rank posts for `d`, at most: the length of the request array
 * tp__mpi_direct_post fills. */
int tp__mpi_direct_max_requests(int size);

/* Bytes of the scratch buffer a reduction needs (0 for the others): the
 * contributions of all ranks, in rank order. */
size_t tp__mpi_direct_scratch(const tp_coll_desc *d, int size);

/* Posts the receives and sends of `d` on `comm` as rank `rank` of `size`
 * (type dt) into reqs, setting *nreq to how many were posted (even when a
 * call failed), and copies this rank's own block. Returns MPI's code. */
int tp__mpi_direct_post(const tp_coll_desc *d, MPI_Comm comm, int rank, int size, MPI_Datatype dt,
                        void *scratch, MPI_Request *reqs, int *nreq);

/* Once every request completed: the reduction of the contributions in
 * scratch, in rank order (so every rank computes the same bits), into
 * result (count elements). */
int tp__mpi_direct_reduce(const void *scratch, void *result, int count, size_t elem_size,
                          MPI_Datatype dt, MPI_Op op, int size);

#endif /* TP_COLL_MPI_DIRECT_H */
