/*
 * bench_cuda.h: bare CUDA work for the benchmarks to hold libtp's GPU path
 * against (CUDA builds only): one kernel launch doing an elementwise add or a
 * tanh GELU of f32 vectors, as a hand-written program would; a list of
 * matrix products by cuBLAS by hand, timed with CUDA events; and the helpers
 * to turn a CUDA error into a message.
 */
#ifndef TP_BENCH_CUDA_H
#define TP_BENCH_CUDA_H

#include <stdbool.h>
#include <stddef.h>
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

/* One product of bench_cuda_gemms, row-major as libtp's tensors: C[m, n] =
 * op(A) op(B), A stored [m, k] ([k, m] when ta), B stored [k, n] ([n, k]
 * when tb). A Linear's forward y = x W^T is {T, out, in, false, true}; its
 * dX = dY W {T, in, out, false, false}; its dW = dY^T X {out, in, T, true,
 * false}. */
typedef struct bench_gemm {
    int m, n, k;
    bool ta, tb;
} bench_gemm;

/* The products g[0..count) issued back to back, as a hand-written program
 * would, on CUDA device `device`: cublasGemmEx with dtype in and out
 * (bf16: CUDA_R_16BF, f16: CUDA_R_16F, f32: CUDA_R_32F), alpha 1, beta 0,
 * CUBLAS_COMPUTE_32F (f32: the TF32 form when tp_cuda_allow_tf32(), as
 * libtp's products), CUBLAS_GEMM_DEFAULT, on a stream and cuBLAS handle of
 * their own. The operands: three device buffers (cudaMalloc) of the largest
 * A, B and C of the list, filled with small pseudo-random values once,
 * before any timing. `warmup` untimed runs of the whole list, then `reps`
 * timed ones, each between two CUDA events on the stream: times[0..reps)
 * (may be NULL) their seconds. Returns the median of the timed runs; -1 on
 * failure, with the failing call in err[0..errlen) (everything freed). */
double bench_cuda_gemms(int device, tp_dtype dtype, const bench_gemm *g, int count, int warmup,
                        int reps, double *times, char *err, size_t errlen);

/* The name of CUDA device `device` (cudaGetDeviceProperties) into
 * buf[0..n); false (and "unknown") when it cannot be read. */
bool bench_cuda_device_name(int device, char *buf, size_t n);

#ifdef __cplusplus
}
#endif
#endif

#endif
