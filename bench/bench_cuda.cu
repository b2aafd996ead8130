/* Bare kernels and cuBLAS by hand for the benchmarks; see bench_cuda.h. */
#include "bench_cuda.h"

#include <algorithm>
#include <cstdio>
#include <vector>

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

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

__device__ inline void store(float *p, float v)
{
    *p = v;
}
__device__ inline void store(__half *p, float v)
{
    *p = __float2half(v);
}
__device__ inline void store(__nv_bfloat16 *p, float v)
{
    *p = __float2bfloat16(v);
}

/* p[i] = a pseudo-random value in [-0.05, 0.05) of i and seed: operands as
 * a model's (zeros would draw less power and run faster). */
template <typename T> __global__ void k_fill(T *p, int64_t n, uint32_t seed)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        uint32_t x = (uint32_t)i * 2654435761u ^ (uint32_t)(i >> 32) ^ seed;
        x ^= x >> 15;
        x *= 2246822519u;
        x ^= x >> 13;
        store(p + i, ((float)(x & 0xffffu) * (1.0f / 65536.0f) - 0.5f) * 0.1f);
    }
}

cudaError_t fill(void *p, tp_dtype dt, int64_t n, uint32_t seed, cudaStream_t s)
{
    const unsigned g = std::min<unsigned>(blocks(n), 4096u);
    if (dt == TP_BF16)
        k_fill<<<g, kThreads, 0, s>>>((__nv_bfloat16 *)p, n, seed);
    else if (dt == TP_F16)
        k_fill<<<g, kThreads, 0, s>>>((__half *)p, n, seed);
    else
        k_fill<<<g, kThreads, 0, s>>>((float *)p, n, seed);
    return cudaGetLastError();
}

/* Row-major C[m,n] = op(A) op(B) as column-major C^T = op(B)^T op(A)^T (B
 * first), as libtp's CUDA kernel table issues it. */
cublasStatus_t rm_gemm(cublasHandle_t h, cudaDataType_t t, cublasComputeType_t ct,
                       const bench_gemm &g, const void *a, const void *b, void *c)
{
    const float one = 1, zero = 0;
    const int lda = g.ta ? g.m : g.k, ldb = g.tb ? g.k : g.n;
    return cublasGemmEx(h, g.tb ? CUBLAS_OP_T : CUBLAS_OP_N, g.ta ? CUBLAS_OP_T : CUBLAS_OP_N,
                        g.n, g.m, g.k, &one, b, t, ldb, a, t, lda, &zero, c, t, g.n, ct,
                        CUBLAS_GEMM_DEFAULT);
}

struct gemm_state {
    int prev = -1;
    cudaStream_t s = nullptr;
    cublasHandle_t h = nullptr;
    cudaEvent_t e0 = nullptr, e1 = nullptr;
    void *buf[3] = {nullptr, nullptr, nullptr};

    ~gemm_state()
    {
        if (s)
            cudaStreamSynchronize(s);
        for (void *p : buf)
            if (p)
                cudaFree(p);
        if (e0)
            cudaEventDestroy(e0);
        if (e1)
            cudaEventDestroy(e1);
        if (h)
            cublasDestroy(h);
        if (s)
            cudaStreamDestroy(s);
        if (prev >= 0)
            cudaSetDevice(prev);
    }
};

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

extern "C" double bench_cuda_gemms(int device, tp_dtype dtype, const bench_gemm *g, int count,
                                   int warmup, int reps, double *times, char *err, size_t errlen)
{
#define FAIL_CUDA(call)                                                                        \
    do {                                                                                       \
        cudaError_t e_ = (call);                                                               \
        if (e_ != cudaSuccess) {                                                               \
            snprintf(err, errlen, "%s: %s", #call, cudaGetErrorString(e_));                    \
            return -1;                                                                         \
        }                                                                                      \
    } while (0)
#define FAIL_BLAS(call)                                                                        \
    do {                                                                                       \
        cublasStatus_t b_ = (call);                                                            \
        if (b_ != CUBLAS_STATUS_SUCCESS) {                                                     \
            snprintf(err, errlen, "%s: %s", #call, cublasGetStatusString(b_));                 \
            return -1;                                                                         \
        }                                                                                      \
    } while (0)
    if (errlen)
        err[0] = 0;
    if (count <= 0 || reps <= 0 || warmup < 0 ||
        (dtype != TP_BF16 && dtype != TP_F16 && dtype != TP_F32)) {
        snprintf(err, errlen, "bench_cuda_gemms: %d products, %d reps, dtype %s", count, reps,
                 tp_dtype_name(dtype));
        return -1;
    }
    size_t na = 1, nb = 1, nc = 1;
    for (int i = 0; i < count; i++) {
        if (g[i].m <= 0 || g[i].n <= 0 || g[i].k <= 0) {
            snprintf(err, errlen, "bench_cuda_gemms: product %d is %dx%dx%d", i, g[i].m, g[i].n,
                     g[i].k);
            return -1;
        }
        na = std::max(na, (size_t)g[i].m * (size_t)g[i].k);
        nb = std::max(nb, (size_t)g[i].k * (size_t)g[i].n);
        nc = std::max(nc, (size_t)g[i].m * (size_t)g[i].n);
    }
    const cudaDataType_t t = dtype == TP_BF16 ? CUDA_R_16BF : dtype == TP_F16 ? CUDA_R_16F
                                                                             : CUDA_R_32F;
    const cublasComputeType_t ct = dtype == TP_F32 && tp_cuda_allow_tf32()
                                       ? CUBLAS_COMPUTE_32F_FAST_TF32
                                       : CUBLAS_COMPUTE_32F;
    const size_t es = tp_dtype_size(dtype);
    gemm_state st;
    int prev = 0;
    FAIL_CUDA(cudaGetDevice(&prev));
    st.prev = prev;
    FAIL_CUDA(cudaSetDevice(device));
    FAIL_CUDA(cudaStreamCreateWithFlags(&st.s, cudaStreamNonBlocking));
    FAIL_BLAS(cublasCreate(&st.h));
    FAIL_BLAS(cublasSetStream(st.h, st.s));
    FAIL_CUDA(cudaEventCreate(&st.e0));
    FAIL_CUDA(cudaEventCreate(&st.e1));
    const size_t n[3] = {na, nb, nc};
    for (int i = 0; i < 3; i++) {
        FAIL_CUDA(cudaMalloc(&st.buf[i], n[i] * es));
        FAIL_CUDA(fill(st.buf[i], dtype, (int64_t)n[i], 0x9e3779b9u * (uint32_t)(i + 1), st.s));
    }
    FAIL_CUDA(cudaStreamSynchronize(st.s));
    std::vector<double> v((size_t)reps);
    for (int it = -warmup; it < reps; it++) {
        if (it >= 0)
            FAIL_CUDA(cudaEventRecord(st.e0, st.s));
        for (int i = 0; i < count; i++)
            FAIL_BLAS(rm_gemm(st.h, t, ct, g[i], st.buf[0], st.buf[1], st.buf[2]));
        if (it < 0)
            continue;
        FAIL_CUDA(cudaEventRecord(st.e1, st.s));
        FAIL_CUDA(cudaEventSynchronize(st.e1));
        float ms = 0;
        FAIL_CUDA(cudaEventElapsedTime(&ms, st.e0, st.e1));
        v[(size_t)it] = ms * 1e-3;
    }
    FAIL_CUDA(cudaStreamSynchronize(st.s));
    if (times)
        std::copy(v.begin(), v.end(), times);
    std::sort(v.begin(), v.end());
    const size_t h = v.size() / 2;
    return v.size() % 2 ? v[h] : 0.5 * (v[h - 1] + v[h]);
#undef FAIL_CUDA
#undef FAIL_BLAS
}

extern "C" bool bench_cuda_device_name(int device, char *buf, size_t n)
{
    cudaDeviceProp p;
    const bool ok = cudaGetDeviceProperties(&p, device) == cudaSuccess;
    snprintf(buf, n, "%s", ok ? p.name : "unknown");
    return ok;
}
