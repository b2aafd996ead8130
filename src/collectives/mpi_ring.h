/* The mpi backend's ring path (mpi_ring.c): a large reduce_scatter, and a
 * large all_reduce where OpenMPI's non-blocking one would reduce to one rank
 * and broadcast, as a ring of point-to-point steps. Internal, not installed. */
#ifndef TP_COLL_MPI_RING_H
#define TP_COLL_MPI_RING_H

#include <mpi.h>
#include <stdbool.h>
#include <stddef.h>

#include "collectives/coll.h"

typedef struct tp__mpi_ring tp__mpi_ring;

/* TP_MPI_RING: false when set to 0 (libnbc's schedules instead), read when
 * a communicator is made rather than on every call. */
bool tp__mpi_ring_enabled(void);

/* Whether `d` on `size` ranks takes the ring (not the direct path, and the
 * ring `enabled`): every rank decides alike from what every rank passes
 * alike. */
bool tp__mpi_ring_fits(const tp_coll_desc *d, int size, bool direct, bool enabled);

/* A ring for `d` on `comm` as rank `rank` of `size`, whose messages carry
 * tag `tag` (distinct for every collective in flight on comm), or NULL when
 * out of memory. Nothing is posted yet. */
tp__mpi_ring *tp__mpi_ring_new(const tp_coll_desc *d, MPI_Comm comm, int rank, int size,
                               MPI_Datatype dt, MPI_Op op, int tag);

/* The current step's two requests (receive, send; MPI_REQUEST_NULL when
 * none is posted): what MPI owns while the ring is not done. */
MPI_Request *tp__mpi_ring_requests(tp__mpi_ring *g);

/* Drives the ring: tests the current step's messages and, each time a step
 * completes, reduces what arrived and posts the next one (the first call
 * posts step 0). *done once the last step completed and the result is in
 * place. Returns MPI's code; the caller holds libtp's MPI call lock. */
int tp__mpi_ring_progress(tp__mpi_ring *g, bool *done);

/* Frees g (its requests must be complete or never posted). */
void tp__mpi_ring_free(tp__mpi_ring *g);

/* Tags of ring messages: [0, TP__MPI_RING_TAGS), apart from the direct
 * path's. */
#define TP__MPI_RING_TAGS 16384

#endif /* TP_COLL_MPI_RING_H */
