/* Internal CUDA runtime helpers of the CUDA engine, shared by its core half
 * (cuda_rt.c: the CUDA memory table; cuda_copy.cu), the CUDA kernels and the
 * NCCL backend. Compiles as C and C++; only files built with CUDA include
 * it. Not installed. */
#ifndef TP_CUDA_RT_H
#define TP_CUDA_RT_H

#include <cuda_runtime_api.h>

#include "base.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TP__CUDA_MAX_DEVICES 64 /* ordinals the per-thread stream table covers */

/* Records "fn: what failed: <CUDA's text>" and drains the non-sticky error so
 * a later unrelated check does not report it. cudaErrorMemoryAllocation maps
 * to TP_ERR_NO_MEMORY, everything else to TP_ERR_BACKEND. */
tp_status tp__cuda_fail(const char *fn, const char *what, cudaError_t err);

/* Check macros for CUDA runtime calls (as NCCL's CUDACHECK): evaluate `call`
 * once; on failure return (or set st and goto label with) tp__cuda_fail(fn,
 * what, err). */
#define TP_CUDA_CHECK(fn, what, call)                                           \
    do {                                                                        \
        cudaError_t tp__ce = (call);                                            \
        if (tp__ce != cudaSuccess)                                              \
            return tp__cuda_fail((fn), (what), tp__ce);                         \
    } while (0)
#define TP_CUDA_CHECK_GOTO(fn, what, call, st, label)                           \
    do {                                                                        \
        cudaError_t tp__ce = (call);                                            \
        if (tp__ce != cudaSuccess) {                                            \
            (st) = tp__cuda_fail((fn), (what), tp__ce);                         \
            goto label;                                                         \
        }                                                                       \
    } while (0)

/* Makes device `index` current, remembering the caller's device in *prev so
 * libtp never changes the current device behind the caller's back; pair with
 * tp__cuda_leave(prev, index). */
tp_status tp__cuda_enter(const char *fn, int index, int *prev);
void tp__cuda_leave(int prev, int index);

/* The calling thread's compute stream on device `index` (a rank is a thread,
 * so this is "the stream per rank"). Created on first use as a blocking
 * stream: it orders with the legacy default stream, so plain cudaMemcpy on
 * the host side still sees every kernel issued on it. Destroyed when the
 * thread exits. Every libtp kernel, cuBLAS call and collective a rank issues
 * on device `index` goes on this stream. */
tp_status tp__cuda_stream(const char *fn, int index, cudaStream_t *out);

/* Waits for everything issued on this thread's stream on device `index`. */
tp_status tp__cuda_stream_sync(const char *fn, int index);

/* Kernel scratch: nbytes on stream s of device `index` (current) from
 * libtp's pool, stream-ordered. Free it with tp__cuda_scratch_free on the
 * same stream once the kernels that use it are issued: the pool hands the
 * bytes out again without waiting for the device. Not counted as a tensor's
 * bytes (tp_memory_stats' allocated), though the pool's reserved bytes hold
 * it while it lives. */
tp_status tp__cuda_scratch(const char *fn, int index, cudaStream_t s, size_t nbytes, void **out);
void tp__cuda_scratch_free(void *p, cudaStream_t s);

/* The CUDA memory table's strided copy (cuda_copy.cu; tp__device_mem in
 * core/device.h): runs on the calling thread's stream and waits for it. */
tp_status tp__cuda_strided_copy(const char *fn, int dev, size_t elem_size, int ndim,
                                const int64_t *shape, void *dst, const int64_t *dstride,
                                const void *src, const int64_t *sstride);

/* The CUDA memory table's convert (cuda_copy.cu; tp__device_mem in
 * core/device.h): one kernel templated on the two element types, with the
 * CPU path's rules bit for bit, on the calling thread's stream; waits for it.
 * Equal dtypes go to tp__cuda_strided_copy. */
tp_status tp__cuda_convert(const char *fn, int dev, int ndim, const int64_t *shape, void *dst,
                           tp_dtype ddtype, const int64_t *dstride, const void *src,
                           tp_dtype sdtype, const int64_t *sstride);

#ifdef __cplusplus
}
#endif

#endif /* TP_CUDA_RT_H */
