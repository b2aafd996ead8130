/* Bare kernels for the benchmarks; see bench_cuda.h. */
#include "bench_cuda.h"

namespace
{

const int kThreads = 256;

__global__ void k_add(const float *a, const float *b, float *y, int64_t n)
{
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n)
        y[i] = a[i] + b[i];
}

__global__ void k_gelu(const float *x, float *y, int64_t n)
{
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float v = x[i];
        y[i] = 0.5f * v * (1.0f + tanhf(0.7978845608f * (v + 0.044715f * v * v * v)));
    }
}

unsigned blocks(int64_t n)
{
    return (unsigned)((n + kThreads - 1) / kThreads);
}

} // namespace

extern "C" cudaError_t bench_cuda_add_f32(const float *a, const float *b, float *y, int64_t n,
                                          cudaStream_t s)
{
    k_add<<<blocks(n), kThreads, 0, s>>>(a, b, y, n);
    return cudaGetLastError();
}

extern "C" cudaError_t bench_cuda_gelu_f32(const float *x, float *y, int64_t n, cudaStream_t s)
{
    k_gelu<<<blocks(n), kThreads, 0, s>>>(x, y, n);
    return cudaGetLastError();
}
