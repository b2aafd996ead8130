/* Device-side strided copies: the CUDA memory table's strided_copy
 * (core/cuda_rt.h), so tp_tensor_copy does not stage them through the host. */
#include <cuda_runtime.h>
#include <stdint.h>

#include "core/cuda_rt.h"

namespace {

struct Geom {
    int ndim;
    int64_t shape[TP_MAX_DIMS];
    int64_t dstride[TP_MAX_DIMS];
    int64_t sstride[TP_MAX_DIMS];
};

/* one thread per element: unravel its row-major index, map it through both
 * views' strides */
template <class T> __global__ void k_strided_copy(T *dst, const T *src, int64_t n, Geom g)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)blockDim.x * gridDim.x) {
        int64_t rem = i, so = 0, dof = 0;
        for (int d = g.ndim - 1; d >= 0; d--) {
            int64_t k = rem % g.shape[d];
            rem /= g.shape[d];
            so += k * g.sstride[d];
            dof += k * g.dstride[d];
        }
        dst[dof] = src[so];
    }
}

} /* namespace */

extern "C" tp_status tp__cuda_strided_copy(const char *fn, int dev, size_t elem_size, int ndim,
                                           const int64_t *shape, void *dst,
                                           const int64_t *dstride, const void *src,
                                           const int64_t *sstride)
{
    if (ndim < 0 || ndim > TP_MAX_DIMS)
        return tp__error(TP_ERR_INVALID_ARG, "%s: %d dims", fn, ndim);
    Geom g;
    g.ndim = ndim;
    int64_t n = 1;
    for (int d = 0; d < ndim; d++) {
        g.shape[d] = shape[d];
        g.dstride[d] = dstride[d];
        g.sstride[d] = sstride[d];
        n *= shape[d];
    }
    if (n <= 0)
        return TP_OK;
    int prev = 0;
    TP_CHECK(tp__cuda_enter(fn, dev, &prev));
    cudaStream_t s;
    tp_status st = TP_OK;
    TP_CHECK_GOTO(tp__cuda_stream(fn, dev, &s), st, done);
    { /* scoped: the gotos above jump past it */
        const int threads = 256;
        int64_t blocks = (n + threads - 1) / threads;
        unsigned grid = (unsigned)(blocks < 65535 ? blocks : 65535);
        switch (elem_size) {
        case 1:
            k_strided_copy<uint8_t><<<grid, threads, 0, s>>>((uint8_t *)dst,
                                                             (const uint8_t *)src, n, g);
            break;
        case 2:
            k_strided_copy<uint16_t><<<grid, threads, 0, s>>>((uint16_t *)dst,
                                                              (const uint16_t *)src, n, g);
            break;
        case 4:
            k_strided_copy<uint32_t><<<grid, threads, 0, s>>>((uint32_t *)dst,
                                                              (const uint32_t *)src, n, g);
            break;
        default:
            k_strided_copy<uint64_t><<<grid, threads, 0, s>>>((uint64_t *)dst,
                                                              (const uint64_t *)src, n, g);
            break;
        }
    }
    TP_CUDA_CHECK_GOTO(fn, "strided copy kernel", cudaGetLastError(), st, done);
    /* tp_tensor_copy is complete on return */
    TP_CUDA_CHECK_GOTO(fn, "strided copy kernel", cudaStreamSynchronize(s), st, done);
done:
    tp__cuda_leave(prev, dev);
    return st;
}
