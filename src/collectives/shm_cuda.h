/* The shm backend's CUDA side: what a rank thread enqueues on its own CUDA
 * stream when the buffers of a collective are CUDA tensors (shm_cuda.cu;
 * shm_cuda_none.c in a build without CUDA, where no CUDA tensor exists).
 *
 * Ordering. At post, a rank records its `ready` event for the collective on
 * its stream: everything it issued before the collective. In the data phase
 * it makes its stream wait for the ready events of the peers whose buffers it
 * touches, enqueues its share of the data movement (copies and reduction
 * kernels, reading and writing peers' device buffers directly), and records
 * its `done` event. When the collective completes, the rank's stream waits
 * for every peer's done event, so what it issues afterwards (reading its
 * output, reusing or freeing its buffers) comes after all the data movement
 * that reads or writes them. Nothing blocks the host. Compiles as C and C++.
 * Not installed. */
#ifndef TP_SHM_CUDA_H
#define TP_SHM_CUDA_H

#include "core/base.h"
#include "tp/comm.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The most ranks one CUDA reduction reads from and writes to. */
#define TP__SHM_CUDA_MAX_PEERS 64

/* A rank's events on one device: a (ready, done) pair per ring entry,
 * created on first use. */
typedef struct tp__shm_cuda tp__shm_cuda;

tp_status tp__shm_cuda_create(int device, int nslots, tp__shm_cuda **out);
/* Destroys the events (pending work that uses them is not waited for). */
void tp__shm_cuda_destroy(tp__shm_cuda *c);
int tp__shm_cuda_device(const tp__shm_cuda *c);

/* Records slot's ready event on the calling thread's stream; returns the
 * slot's two events for the descriptor. */
tp_status tp__shm_cuda_post(tp__shm_cuda *c, int slot, void **ready, void **done);

/* The calling thread's stream on c's device waits for `event` (another
 * rank's, possibly of another device). */
tp_status tp__shm_cuda_wait(tp__shm_cuda *c, void *event);

/* Records slot's done event on the calling thread's stream. */
tp_status tp__shm_cuda_done(tp__shm_cuda *c, int slot);

/* Enqueue on the calling thread's stream. reduce: as tp__shm_reduce
 * (shm_kernels.h), with the same order of combination (sources in order,
 * bf16/f16 in f32 rounded once), so results equal the CPU backend's bit for
 * bit; nsrc and ndst at most TP__SHM_CUDA_MAX_PEERS. copy: bytes between
 * any two device buffers. */
tp_status tp__shm_cuda_reduce(tp__shm_cuda *c, tp_dtype dtype, tp_reduce_op op, int divisor,
                              int nsrc, const void *const *src, size_t src_off, int ndst,
                              void *const *dst, size_t dst_off, size_t len);
tp_status tp__shm_cuda_copy(tp__shm_cuda *c, void *dst, const void *src, size_t bytes);

/* Lets c's device read and write `peer`'s memory (reductions over buffers of
 * several GPUs); TP_ERR_NOT_SUPPORTED where the two cannot. Idempotent. */
tp_status tp__shm_cuda_enable_peer(tp__shm_cuda *c, int peer);

#ifdef __cplusplus
}
#endif

#endif /* TP_SHM_CUDA_H */
