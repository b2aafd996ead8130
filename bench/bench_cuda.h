/*
 * bench_cuda.h: bare CUDA work for the benchmarks to hold libtp's GPU path
 * against (CUDA builds only): one kernel launch doing an elementwise add or a
 * tanh GELU of f32 vectors, as a hand-written program would, and the helpers
 * to turn a CUDA error into a message.
 */
#ifndef TP_BENCH_CUDA_H
#define TP_BENCH_CUDA_H

#include <stdint.h>

#include <tp.h>

#if TP_HAVE_CUDA
#include <cuda_runtime.h>

#ifdef __cplusplus
extern "C" {
#endif

/* y[i] = a[i] + b[i], i < n, one launch on s; the launch's error. */
cudaError_t bench_cuda_add_f32(const float *a, const float *b, float *y, int64_t n, cudaStream_t s);
/* y[i] = gelu_tanh(x[i]), i < n, one launch on s; the launch's error. */
cudaError_t bench_cuda_gelu_f32(const float *x, float *y, int64_t n, cudaStream_t s);

#ifdef __cplusplus
}
#endif
#endif

#endif
