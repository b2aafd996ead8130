/* Device-side strided copies and dtype conversions: the CUDA memory table's
 * strided_copy and convert (core/device.h), so tp_tensor_copy stages neither
 * through the host. */
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include "core/cuda_rt.h"

namespace {

struct Geom {
    int ndim;
    int64_t shape[TP_MAX_DIMS];
    int64_t dstride[TP_MAX_DIMS];
    int64_t sstride[TP_MAX_DIMS];
};

/* The layout the kernels walk: size-1 dims dropped, and a dim merged into
 * the one outside it where both views lay the two out as one run, so a
 * contiguous pair becomes one dim and needs no index arithmetic. Returns the
 * element count (0 for an empty shape). */
int64_t make_geom(Geom *g, int ndim, const int64_t *shape, const int64_t *dstride,
                  const int64_t *sstride)
{
    int64_t n = 1;
    g->ndim = 0;
    for (int d = 0; d < ndim; d++) {
        n *= shape[d];
        if (shape[d] == 1)
            continue;
        int k = g->ndim;
        if (k > 0 && g->dstride[k - 1] == dstride[d] * shape[d] &&
            g->sstride[k - 1] == sstride[d] * shape[d]) {
            g->shape[k - 1] *= shape[d];
            g->dstride[k - 1] = dstride[d];
            g->sstride[k - 1] = sstride[d];
            continue;
        }
        g->shape[k] = shape[d];
        g->dstride[k] = dstride[d];
        g->sstride[k] = sstride[d];
        g->ndim = k + 1;
    }
    return n;
}

/* element i's offsets (in elements) in the source and destination views:
 * its row-major multi-index mapped through both views' strides */
__host__ __device__ __forceinline__ void offsets(const Geom &g, int64_t i, int64_t *so,
                                                 int64_t *dof)
{
    if (g.ndim == 1) {
        *so = i * g.sstride[0];
        *dof = i * g.dstride[0];
        return;
    }
    int64_t rem = i, s = 0, d = 0;
    for (int k = g.ndim - 1; k >= 0; k--) {
        int64_t q = rem % g.shape[k];
        rem /= g.shape[k];
        s += q * g.sstride[k];
        d += q * g.dstride[k];
    }
    *so = s;
    *dof = d;
}

template <class T> __global__ void k_strided_copy(T *dst, const T *src, int64_t n, Geom g)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)blockDim.x * gridDim.x) {
        int64_t so, dof;
        offsets(g, i, &so, &dof);
        dst[dof] = src[so];
    }
}

/* ---- one element's conversion, bit for bit as the CPU path's ---------------
 *
 * The CPU path (core/dtype_elem.h, tensor.c) loads a float source as a float
 * widened to double and an integer source as an int64, and stores from that
 * value (core/base.h states the rules). The f16/bf16 and float -> integer
 * rules are core/convert.h's, compiled here for the device; the float <->
 * double steps below handle NaN explicitly, as x86 and AArch64 do (payload
 * kept, made quiet), rather than leave it to the GPU's canonical NaN.
 * __host__ as well so they are the same code on either side. */
#define TP__CV __host__ __device__ __forceinline__

struct H16 { /* an f16 element */
    uint16_t bits;
};
struct B16 { /* a bf16 element */
    uint16_t bits;
};

TP__CV double f32_to_f64(float f)
{
    uint32_t x = tp__f32_bits(f);
    if ((x & 0x7fffffffu) <= 0x7f800000u)
        return (double)f;
    uint64_t b =
        (uint64_t)(x >> 31) << 63 | 0x7ff8000000000000ull | (uint64_t)(x & 0x7fffffu) << 29;
    double d;
    memcpy(&d, &b, sizeof d);
    return d;
}

TP__CV float f64_to_f32(double v)
{
    if (v == v)
        return (float)v; /* round to nearest even, subnormals kept */
    uint64_t b;
    memcpy(&b, &v, sizeof b);
    return tp__bits_f32((uint32_t)(b >> 63) << 31 | 0x7fc00000u | (uint32_t)(b >> 29) & 0x7fffffu);
}

/* A float source's value. The CPU path widens it to double, but its host
 * compiler folds float -> double -> float away, so between f32, f16 and bf16
 * a signaling NaN is not quieted there; nor is it here. */
struct F {
    float v;
};

/* loads: the value the CPU path carries (float, double or int64) */
TP__CV F ld(const float *p)
{
    return F{*p};
}
TP__CV double ld(const double *p)
{
    return *p;
}
TP__CV F ld(const H16 *p)
{
    return F{tp__f16_to_f32(p->bits)};
}
TP__CV F ld(const B16 *p)
{
    return F{tp__bf16_to_f32(p->bits)};
}
TP__CV int64_t ld(const int32_t *p)
{
    return *p;
}
TP__CV int64_t ld(const int64_t *p)
{
    return *p;
}

/* stores from a float source */
TP__CV void st(float *p, double v)
{
    *p = f64_to_f32(v);
}
TP__CV void st(double *p, double v)
{
    *p = v;
}
TP__CV void st(H16 *p, double v)
{
    p->bits = tp__f32_to_f16(f64_to_f32(v));
}
TP__CV void st(B16 *p, double v)
{
    p->bits = tp__f32_to_bf16(f64_to_f32(v));
}
TP__CV void st(int32_t *p, double v)
{
    *p = tp__f64_to_i32(v);
}
TP__CV void st(int64_t *p, double v)
{
    *p = tp__f64_to_i64(v);
}
TP__CV void st(float *p, F v)
{
    *p = v.v;
}
TP__CV void st(H16 *p, F v)
{
    p->bits = tp__f32_to_f16(v.v);
}
TP__CV void st(B16 *p, F v)
{
    p->bits = tp__f32_to_bf16(v.v);
}
template <class D> TP__CV void st(D *p, F v)
{
    st(p, f32_to_f64(v.v));
}
/* stores from an integer source: int64 -> float rounds once, to nearest
 * even; i64 -> i32 keeps the low 32 bits, as the CPU's cast does */
TP__CV void st(float *p, int64_t v)
{
    *p = (float)v;
}
TP__CV void st(double *p, int64_t v)
{
    *p = (double)v;
}
TP__CV void st(H16 *p, int64_t v)
{
    p->bits = tp__f32_to_f16((float)v);
}
TP__CV void st(B16 *p, int64_t v)
{
    p->bits = tp__f32_to_bf16((float)v);
}
TP__CV void st(int32_t *p, int64_t v)
{
    *p = (int32_t)(uint32_t)(uint64_t)v;
}
TP__CV void st(int64_t *p, int64_t v)
{
    *p = v;
}

template <class D, class S> __global__ void k_convert(D *dst, const S *src, int64_t n, Geom g)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)blockDim.x * gridDim.x) {
        int64_t so, dof;
        offsets(g, i, &so, &dof);
        st(dst + dof, ld(src + so));
    }
}

/* ---- launches ----------------------------------------------------------------- */

const int kThreads = 256;

struct Launch {
    int64_t n;
    Geom g;
    unsigned grid;
    cudaStream_t s;
};

template <class D, class S> void launch_convert(void *dst, const void *src, const Launch &L)
{
    k_convert<D, S><<<L.grid, kThreads, 0, L.s>>>((D *)dst, (const S *)src, L.n, L.g);
}

template <class S> void launch_convert_to(tp_dtype dd, void *dst, const void *src, const Launch &L)
{
    switch (dd) {
    case TP_F32:
        launch_convert<float, S>(dst, src, L);
        break;
    case TP_F64:
        launch_convert<double, S>(dst, src, L);
        break;
    case TP_F16:
        launch_convert<H16, S>(dst, src, L);
        break;
    case TP_BF16:
        launch_convert<B16, S>(dst, src, L);
        break;
    case TP_I32:
        launch_convert<int32_t, S>(dst, src, L);
        break;
    default:
        launch_convert<int64_t, S>(dst, src, L);
        break;
    }
}

void launch_convert_any(tp_dtype dd, tp_dtype sd, void *dst, const void *src, const Launch &L)
{
    switch (sd) {
    case TP_F32:
        launch_convert_to<float>(dd, dst, src, L);
        break;
    case TP_F64:
        launch_convert_to<double>(dd, dst, src, L);
        break;
    case TP_F16:
        launch_convert_to<H16>(dd, dst, src, L);
        break;
    case TP_BF16:
        launch_convert_to<B16>(dd, dst, src, L);
        break;
    case TP_I32:
        launch_convert_to<int32_t>(dd, dst, src, L);
        break;
    default:
        launch_convert_to<int64_t>(dd, dst, src, L);
        break;
    }
}

template <class T> void launch_copy(void *dst, const void *src, const Launch &L)
{
    k_strided_copy<T><<<L.grid, kThreads, 0, L.s>>>((T *)dst, (const T *)src, L.n, L.g);
}

/* Runs `launch` (given the Launch: geometry, grid, the calling thread's
 * stream on dev) and waits for it: tp_tensor_copy is complete on return. */
template <class F>
tp_status run(const char *fn, int dev, const char *what, int ndim, const int64_t *shape,
              const int64_t *dstride, const int64_t *sstride, F launch)
{
    if (ndim < 0 || ndim > TP_MAX_DIMS)
        return tp__error(TP_ERR_INVALID_ARG, "%s: %d dims", fn, ndim);
    Launch L;
    L.n = make_geom(&L.g, ndim, shape, dstride, sstride);
    if (L.n <= 0)
        return TP_OK;
    int64_t blocks = (L.n + kThreads - 1) / kThreads;
    L.grid = (unsigned)(blocks < 65535 ? blocks : 65535);
    int prev = 0;
    TP_CHECK(tp__cuda_enter(fn, dev, &prev));
    tp_status st = TP_OK;
    TP_CHECK_GOTO(tp__cuda_stream(fn, dev, &L.s), st, done);
    launch(L);
    TP_CUDA_CHECK_GOTO(fn, what, cudaGetLastError(), st, done);
    TP_CUDA_CHECK_GOTO(fn, what, cudaStreamSynchronize(L.s), st, done);
done:
    tp__cuda_leave(prev, dev);
    return st;
}

} /* namespace */

extern "C" tp_status tp__cuda_strided_copy(const char *fn, int dev, size_t elem_size, int ndim,
                                           const int64_t *shape, void *dst, const int64_t *dstride,
                                           const void *src, const int64_t *sstride)
{
    return run(fn, dev, "strided copy kernel", ndim, shape, dstride, sstride, [&](const Launch &L) {
        switch (elem_size) {
        case 1:
            launch_copy<uint8_t>(dst, src, L);
            break;
        case 2:
            launch_copy<uint16_t>(dst, src, L);
            break;
        case 4:
            launch_copy<uint32_t>(dst, src, L);
            break;
        default:
            launch_copy<uint64_t>(dst, src, L);
            break;
        }
    });
}

extern "C" tp_status tp__cuda_convert(const char *fn, int dev, int ndim, const int64_t *shape,
                                      void *dst, tp_dtype ddtype, const int64_t *dstride,
                                      const void *src, tp_dtype sdtype, const int64_t *sstride)
{
    if ((unsigned)ddtype >= TP_DTYPE_COUNT || (unsigned)sdtype >= TP_DTYPE_COUNT)
        return tp__error(TP_ERR_INVALID_ARG, "%s: invalid dtype (%d to %d)", fn, (int)sdtype,
                         (int)ddtype);
    if (ddtype == sdtype) /* raw bytes, so f16/bf16 NaN payloads survive */
        return tp__cuda_strided_copy(fn, dev, tp_dtype_size(ddtype), ndim, shape, dst, dstride, src,
                                     sstride);
    return run(fn, dev, "dtype conversion kernel", ndim, shape, dstride, sstride,
               [&](const Launch &L) { launch_convert_any(ddtype, sdtype, dst, src, L); });
}
