/* Internal CUDA runtime helpers shared by the tensor layer, the CUDA kernels
 * and the NCCL backend. Only meaningful when TP_HAVE_CUDA; not installed. */
#ifndef TP_CUDA_RT_H
#define TP_CUDA_RT_H

#include "core/core.h"

#if TP_HAVE_CUDA
#include <cuda_runtime_api.h>

/* Records "fn: what failed: <CUDA's text>" and drains the non-sticky error so
 * a later unrelated check does not report it. cudaErrorMemoryAllocation maps
 * to TP_ERR_NO_MEMORY, everything else to TP_ERR_BACKEND. */
tp_status tp__cuda_fail(const char *fn, const char *what, cudaError_t err);

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
#endif

#endif /* TP_CUDA_RT_H */
