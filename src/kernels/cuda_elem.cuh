/* What the CUDA engine's translation units (cuda.cu, cuda_flash.cu) share:
 * the grid-stride loop, loading a value of the op's dtype into f32, storing
 * an f32 result rounded once to nearest even, and the one place a tp_dtype
 * becomes a C++ type. Not installed. */
#ifndef TP_KERNELS_CUDA_ELEM_CUH
#define TP_KERNELS_CUDA_ELEM_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "tp/tensor.h"

/* for (i over [0, n)) spread over the whole grid, each thread striding by
 * the grid's size. */
#define GRID_STRIDE(i, n)                                                       \
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n);   \
         i += (int64_t)blockDim.x * gridDim.x)

namespace tp_cuda {

__device__ __forceinline__ float ldf(float v) { return v; }
__device__ __forceinline__ float ldf(__half v) { return __half2float(v); }
__device__ __forceinline__ float ldf(__nv_bfloat16 v) { return __bfloat162float(v); }

template <class T> __device__ __forceinline__ T stf(float v);
template <> __device__ __forceinline__ float stf<float>(float v) { return v; }
template <> __device__ __forceinline__ __half stf<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 stf<__nv_bfloat16>(float v)
{
    return __float2bfloat16_rn(v);
}

/* Calls f with a value of the element type of dtype (float for f32 and for
 * the dtypes the engine refuses, which its entries turn away before any
 * launch) and returns what f returns. */
template <class F> auto by_dtype(tp_dtype dtype, F &&f) -> decltype(f(0.0f))
{
    switch (dtype) {
    case TP_BF16:
        return f(__nv_bfloat16());
    case TP_F16:
        return f(__half());
    default:
        return f(0.0f);
    }
}

} /* namespace tp_cuda */

#endif /* TP_KERNELS_CUDA_ELEM_CUH */
