/* Check macros for the calls the mpi and nccl backends make into MPI and
 * NCCL, as NCCL's own NCCLCHECK: evaluate the call once, translate a foreign
 * failure into a tp_status with a message naming the call, and propagate it.
 * Include after <mpi.h> or <nccl.h>: the macros compare against MPI_SUCCESS,
 * ncclSuccess and ncclInProgress where they are used. CUDA calls have
 * TP_CUDA_CHECK (core/cuda_rt.h). Not installed. */
#ifndef TP_COLL_CHECK_H
#define TP_COLL_CHECK_H

#include "core/core.h"

/* ---- MPI (mpi.c) ---------------------------------------------------------- */

/* Records TP_ERR_BACKEND "<what> failed: <MPI's error string>" for the error
 * code rc and returns it. libtp sets MPI_ERRORS_RETURN on every communicator
 * it makes, so MPI reports errors this way rather than ending the job. */
tp_status tp__mpi_error(int rc, const char *what);

/* `call` is an MPI call, or an error code an MPI call returned under a lock. */
#define TP_MPI_CHECK(what, call)                                                \
    do {                                                                        \
        int tp__rc = (call);                                                    \
        if (tp__rc != MPI_SUCCESS)                                              \
            return tp__mpi_error(tp__rc, (what));                               \
    } while (0)
#define TP_MPI_CHECK_GOTO(what, call, st, label)                                \
    do {                                                                        \
        int tp__rc = (call);                                                    \
        if (tp__rc != MPI_SUCCESS) {                                            \
            (st) = tp__mpi_error(tp__rc, (what));                               \
            goto label;                                                         \
        }                                                                       \
    } while (0)

/* ---- NCCL (nccl.c) -------------------------------------------------------- */

struct ncclComm;

/* Records "<what> failed: <ncclGetErrorString>: <ncclGetLastError(comm)>"
 * for the ncclResult_t res and returns it: TP_ERR_INVALID_ARG for NCCL's
 * invalid argument or usage, TP_ERR_BACKEND otherwise. comm may be NULL;
 * when not, the caller holds the lock under which it is used (a concurrent
 * abort would free it). */
tp_status tp__nccl_error(struct ncclComm *comm, int res, const char *what);

/* `call` is an NCCL call, or a result an NCCL call returned under a lock.
 * ncclInProgress is no failure: a non-blocking communicator answers it until
 * the operation settles, which the caller then waits for. `comm` is read
 * after the call (an init or split fills it in). */
#define TP_NCCL_CHECK(comm, what, call)                                         \
    do {                                                                        \
        int tp__res = (int)(call);                                              \
        if (tp__res != ncclSuccess && tp__res != ncclInProgress)                \
            return tp__nccl_error((comm), tp__res, (what));                     \
    } while (0)
#define TP_NCCL_CHECK_GOTO(comm, what, call, st, label)                         \
    do {                                                                        \
        int tp__res = (int)(call);                                              \
        if (tp__res != ncclSuccess && tp__res != ncclInProgress) {              \
            (st) = tp__nccl_error((comm), tp__res, (what));                     \
            goto label;                                                         \
        }                                                                       \
    } while (0)

#endif /* TP_COLL_CHECK_H */
