/* The CUDA engine's kernel table (kernels.h): cuBLAS for the matrix
 * products, plain grid-stride kernels for the rest. Meson builds this file
 * only with CUDA (cuda_none.c stands in otherwise).
 *
 * Every kernel runs on the calling thread's compute stream for the device
 * (one per rank thread, tp__cuda_stream), and so does every cuBLAS call: the
 * cuBLAS handle is per thread and device and bound to that stream once.
 * Sizes and indices are int64 throughout; grids are capped and every loop is
 * grid-stride (or block-stride over rows), so any size runs with a bounded
 * grid. Reductions accumulate in double like the CPU engine, so results agree
 * with it to float rounding (the order of the additions differs).
 *
 * Every entry takes f32, bf16 (__nv_bfloat16) and f16 (__half): the kernels
 * are templates on the element type, load into f32 registers, compute in f32
 * (double where the f32 kernel does) and round each stored output once; the
 * products are cublasGemmEx with f32 accumulation. */
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "core/cuda_rt.h"
#include "core/philox.h"
#include "kernels/cuda_elem.cuh"
#include "kernels/cuda_flash.h"
#include "kernels/kernels.h"

#define TP__KC_MAX_DEVICES 64 /* as core/cuda_rt.c */

namespace {

const int kThreads = 256;   /* elementwise and row kernels */
const int64_t kMaxGrid = 65535;

/* ---- launch plumbing ---------------------------------------------------------- */

struct Launch {
    const char *fn;
    int dev;
    int prev;
    cudaStream_t s;
};

tp_status begin(const char *fn, int dev, Launch *L)
{
    L->fn = fn;
    L->dev = dev;
    tp_status st = tp__cuda_enter(fn, dev, &L->prev);
    if (st != TP_OK)
        return st;
    st = tp__cuda_stream(fn, dev, &L->s);
    if (st != TP_OK)
        tp__cuda_leave(L->prev, dev);
    return st;
}

/* Checks the launches issued since begin() and restores the caller's device. */
tp_status end(Launch *L)
{
    cudaError_t err = cudaGetLastError();
    tp__cuda_leave(L->prev, L->dev);
    return err == cudaSuccess ? TP_OK : tp__cuda_fail(L->fn, "kernel launch", err);
}

/* Leaves after a failure that is already recorded. */
tp_status fail(Launch *L, tp_status st)
{
    (void)cudaGetLastError();
    tp__cuda_leave(L->prev, L->dev);
    return st;
}

unsigned grid_for(int64_t n, int threads)
{
    int64_t b = (n + threads - 1) / threads;
    if (b < 1)
        b = 1;
    return (unsigned)(b < kMaxGrid ? b : kMaxGrid);
}

unsigned grid_rows(int64_t rows)
{
    return (unsigned)(rows < kMaxGrid ? (rows > 0 ? rows : 1) : kMaxGrid);
}

/* Every entry takes f32, bf16 and f16 (kernels.h; f32 arithmetic, one
 * rounding per stored element). */
bool cuda_supports(tp__kop op, tp_dtype dtype)
{
    if (op <= TP__KOP_NONE || op >= TP__KOP_COUNT)
        return false;
    return dtype == TP_F32 || dtype == TP_BF16 || dtype == TP_F16;
}

/* The start of every entry: false, with *st set, when it ends before any
 * launch (a dtype this engine does not take for op, no work, or a device
 * that cannot be made current); true with dev current and its stream in L,
 * which end() or fail() then leave. */
bool enter(const char *fn, tp__kop op, tp_dtype dtype, tp_device dev, bool work, Launch *L,
           tp_status *st)
{
    *st = TP_OK;
    if (!cuda_supports(op, dtype)) {
        *st = tp__kernels_unsupported(tp__kernels_cuda, op, dtype);
        return false;
    }
    if (!work)
        return false;
    *st = begin(fn, dev.index, L);
    return *st == TP_OK;
}

/* An entry that is one kernel over n elements (per_row: one block per row,
 * rows beyond the grid strided; else grid-stride over elements). */
template <class... P, class... A>
tp_status launch(const char *fn, tp__kop op, tp_dtype dtype, tp_device dev, int64_t n,
                 bool per_row, void (*kernel)(P...), A... args)
{
    Launch L;
    tp_status st;
    if (!enter(fn, op, dtype, dev, n > 0, &L, &st))
        return st;
    unsigned grid = per_row ? grid_rows(n) : grid_for(n, kThreads);
    kernel<<<grid, kThreads, 0, L.s>>>(args...);
    return end(&L);
}

/* GRID_STRIDE(i, n): cuda_elem.cuh */

/* ---- block reductions (blockDim.x a multiple of 32, at most 1024) ------------ */

__device__ double block_sum(double v, double *sh)
{
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_down_sync(0xffffffffu, v, o);
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    __syncthreads(); /* earlier readers of sh[0] are done */
    if (lane == 0)
        sh[wid] = v;
    __syncthreads();
    if (wid == 0) {
        v = lane < nw ? sh[lane] : 0.0;
        for (int o = 16; o > 0; o >>= 1)
            v += __shfl_down_sync(0xffffffffu, v, o);
        if (lane == 0)
            sh[0] = v;
    }
    __syncthreads();
    return sh[0];
}

/* Max ignoring NaN, as the CPU's `x > m ? x : m` from -inf. */
__device__ float block_max(float v, float *sh)
{
    for (int o = 16; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_down_sync(0xffffffffu, v, o));
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    __syncthreads();
    if (lane == 0)
        sh[wid] = v;
    __syncthreads();
    if (wid == 0) {
        v = lane < nw ? sh[lane] : -INFINITY;
        for (int o = 16; o > 0; o >>= 1)
            v = fmaxf(v, __shfl_down_sync(0xffffffffu, v, o));
        if (lane == 0)
            sh[0] = v;
    }
    __syncthreads();
    return sh[0];
}

/* ---- dtype helpers --------------------------------------------------------------
 *
 * Every kernel is a template on T, the element type of the op's dtype (float,
 * __nv_bfloat16 or __half). Values are loaded into f32 registers with ldf,
 * all arithmetic is f32 (or double where the f32 kernel uses double), and
 * each stored output is rounded once to T, to nearest even: stf from a float
 * result, std_ from a double one. Statistics (norm mean and rstd,
 * cross-entropy row max, sums and picked logits) and Adam's m and v stay
 * float whatever T is. */

using tp_cuda::ldf; /* cuda_elem.cuh */
using tp_cuda::stf;
/* from double in one rounding (not through float) */
template <class T> __device__ __forceinline__ T std_(double v);
template <> __device__ __forceinline__ float std_<float>(double v)
{
    return (float)v;
}
template <> __device__ __forceinline__ __half std_<__half>(double v)
{
    return __double2half(v);
}
template <> __device__ __forceinline__ __nv_bfloat16 std_<__nv_bfloat16>(double v)
{
    return __double2bfloat16(v);
}

/* *p += v: read the stored value, add in f32, round once. 16-bit types swap
 * the aligned 32-bit word that holds the element (the allocation granularity
 * keeps that word inside the buffer's mapping; the other half is written back
 * as read, and a concurrent change to it makes the swap retry). */
__device__ __forceinline__ unsigned short bits16(__half v)
{
    return __half_as_ushort(v);
}
__device__ __forceinline__ unsigned short bits16(__nv_bfloat16 v)
{
    return __bfloat16_as_ushort(v);
}
template <class T> __device__ __forceinline__ T from_bits16(unsigned short b);
template <> __device__ __forceinline__ __half from_bits16<__half>(unsigned short b)
{
    return __ushort_as_half(b);
}
template <> __device__ __forceinline__ __nv_bfloat16 from_bits16<__nv_bfloat16>(unsigned short b)
{
    return __ushort_as_bfloat16(b);
}

__device__ __forceinline__ void atomic_addf(float *p, float v)
{
    atomicAdd(p, v);
}
template <class T> __device__ __forceinline__ void atomic_addf(T *p, float v)
{
    unsigned int *word = (unsigned int *)((uintptr_t)p & ~(uintptr_t)3);
    unsigned shift = ((uintptr_t)p & 2) ? 16u : 0u;
    unsigned int old = *word, assumed;
    do {
        assumed = old;
        T cur = from_bits16<T>((unsigned short)(assumed >> shift));
        unsigned int nb = bits16(stf<T>(ldf(cur) + v));
        unsigned int nw = (assumed & ~(0xffffu << shift)) | (nb << shift);
        old = atomicCAS(word, assumed, nw);
    } while (old != assumed);
}

/* The typed view of an entry's buffer. */
template <class T> const T *cp(const void *p)
{
    return static_cast<const T *>(p);
}
template <class T> T *mp(void *p)
{
    return static_cast<T *>(p);
}

/* (tp_cuda::by_dtype, cuda_elem.cuh: the one place a tp_dtype becomes a
 * C++ type; enter() turns refused dtypes away before any launch) */
using tp_cuda::by_dtype;

/* An entry's body with T the element type of `dtype`. */
#define TYPED(dtype, ...)                           \
    by_dtype((dtype), [&](auto tag_) -> tp_status { \
        using T = decltype(tag_);                   \
        (void)tag_;                                 \
        return __VA_ARGS__;                         \
    })

/* ---- elementwise kernels ---------------------------------------------------------- */

template <class T> __global__ void k_fill(T *y, float v, int64_t n)
{
    T t = stf<T>(v);
    GRID_STRIDE(i, n) y[i] = t;
}

template <class T> __global__ void k_add(const T *a, const T *b, T *y, int64_t n)
{
    GRID_STRIDE(i, n) y[i] = stf<T>(ldf(a[i]) + ldf(b[i]));
}

template <class T> __global__ void k_mul(const T *a, const T *b, T *y, int64_t n)
{
    GRID_STRIDE(i, n) y[i] = stf<T>(ldf(a[i]) * ldf(b[i]));
}

template <class T> __global__ void k_scale(const T *a, float s, T *y, int64_t n)
{
    GRID_STRIDE(i, n) y[i] = stf<T>(ldf(a[i]) * s);
}

template <class T> __global__ void k_accumulate(T *y, const T *a, int64_t n)
{
    GRID_STRIDE(i, n) y[i] = stf<T>(ldf(y[i]) + ldf(a[i]));
}

template <class T, bool MUL>
__global__ void k_binary_row_bcast(const T *a, const T *b, T *y, int64_t rows, int64_t cols)
{
    GRID_STRIDE(i, rows * cols)
    {
        float u = ldf(a[i]), v = ldf(b[i % cols]);
        y[i] = stf<T>(MUL ? u * v : u + v);
    }
}

/* Broadcasting in general: element strides of a and b per dim of y (0 along
 * broadcast dims), y contiguous. */
struct BcastGeom {
    int ndim;
    int64_t shape[TP_MAX_DIMS];
    int64_t sa[TP_MAX_DIMS];
    int64_t sb[TP_MAX_DIMS];
};

template <class T, bool MUL>
__global__ void k_binary_bcast(const T *a, const T *b, T *y, int64_t n, BcastGeom g)
{
    GRID_STRIDE(i, n)
    {
        int64_t rem = i, oa = 0, ob = 0;
        for (int d = g.ndim - 1; d >= 0; d--) {
            int64_t k = rem % g.shape[d];
            rem /= g.shape[d];
            oa += k * g.sa[d];
            ob += k * g.sb[d];
        }
        float u = ldf(a[oa]), v = ldf(b[ob]);
        y[i] = stf<T>(MUL ? u * v : u + v);
    }
}

/* The backward of a broadcast when the summed dims are not one block: one
 * thread per element of y, walking the summed dims with an odometer. */
struct SumGeom {
    int nk, nr;
    int64_t kshape[TP_MAX_DIMS], kst[TP_MAX_DIMS]; /* kept dims, strides in x */
    int64_t rshape[TP_MAX_DIMS], rst[TP_MAX_DIMS]; /* summed dims */
};

template <class T> __global__ void k_sum_bcast(const T *x, T *y, int64_t yn, int64_t rn, SumGeom g)
{
    GRID_STRIDE(e, yn)
    {
        int64_t rem = e, base = 0;
        for (int d = g.nk - 1; d >= 0; d--) {
            base += (rem % g.kshape[d]) * g.kst[d];
            rem /= g.kshape[d];
        }
        int64_t idx[TP_MAX_DIMS] = {0}, off = 0;
        double acc = 0;
        for (int64_t r = 0; r < rn; r++) {
            acc += (double)ldf(x[base + off]);
            for (int d = g.nr - 1; d >= 0; d--) {
                off += g.rst[d];
                if (++idx[d] < g.rshape[d])
                    break;
                off -= g.rst[d] * g.rshape[d];
                idx[d] = 0;
            }
        }
        y[e] = std_<T>(acc);
    }
}

struct GatherGeom {
    int ndim;
    int64_t shape[TP_MAX_DIMS];
    int64_t stride[TP_MAX_DIMS];
};

template <class T> __global__ void k_gather(T *y, const T *x, int64_t n, GatherGeom geo)
{
    GRID_STRIDE(i, n)
    {
        int64_t rem = i, off = 0;
        for (int d = geo.ndim - 1; d >= 0; d--) {
            off += (rem % geo.shape[d]) * geo.stride[d];
            rem /= geo.shape[d];
        }
        y[i] = x[off];
    }
}

/* y[r, c] = b[c]: the bias a linear's product then adds onto (beta = 1).
 * Columns over x (each thread keeps its b[c] in a register), rows over y:
 * no division per element. */
template <class T> __global__ void k_bcast_row(T *y, const T *b, int64_t rows, int64_t cols)
{
    for (int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; c < cols;
         c += (int64_t)blockDim.x * gridDim.x) {
        T v = b[c];
        for (int64_t r = blockIdx.y; r < rows; r += gridDim.y)
            y[r * cols + c] = v;
    }
}

/* C[m, n] (row length ldc) = beta * C; beta 0 overwrites (even NaN) */
template <class T> __global__ void k_scale_mat(T *c, int64_t m, int64_t n, int64_t ldc, float beta)
{
    GRID_STRIDE(i, m * n)
    {
        T *p = c + (i / n) * ldc + i % n;
        *p = beta == 0.0f ? stf<T>(0.0f) : stf<T>(ldf(*p) * beta);
    }
}

template <class T> __global__ void k_relu_fwd(const T *x, T *y, int64_t n)
{
    GRID_STRIDE(i, n) y[i] = ldf(x[i]) > 0.0f ? x[i] : stf<T>(0.0f);
}

template <class T> __global__ void k_relu_bwd(const T *x, const T *gy, T *gx, int64_t n)
{
    GRID_STRIDE(i, n) gx[i] = ldf(x[i]) > 0.0f ? gy[i] : stf<T>(0.0f);
}

#define TP__SQRT1_2 0.70710678118654752440f    /* 1/sqrt(2) */
#define TP__INV_SQRT2PI 0.39894228040143267794f /* 1/sqrt(2 pi) */
#define TP__SQRT2_PI 0.79788456080286535588f   /* sqrt(2/pi) */
#define TP__GELU_C 0.044715f

__device__ __forceinline__ float gelu_f(float v, bool tanh_approx)
{
    if (tanh_approx) {
        float u = TP__SQRT2_PI * (v + TP__GELU_C * v * v * v);
        return 0.5f * v * (1.0f + tanhf(u));
    }
    return 0.5f * v * (1.0f + erff(v * TP__SQRT1_2));
}

__device__ __forceinline__ float gelu_grad(float v, float g, bool tanh_approx)
{
    if (tanh_approx) {
        float u = TP__SQRT2_PI * (v + TP__GELU_C * v * v * v);
        float t = tanhf(u);
        float du = TP__SQRT2_PI * (1.0f + 3.0f * TP__GELU_C * v * v);
        return g * (0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * du);
    }
    float cdf = 0.5f * (1.0f + erff(v * TP__SQRT1_2));
    float pdf = TP__INV_SQRT2PI * expf(-0.5f * v * v);
    return g * (cdf + v * pdf);
}

/* 16 bytes of elements: one vector load or store (the buffers' start
 * 16-byte aligned, which vec_ok checks before such a kernel is chosen). */
template <class T> struct alignas(16) Pack {
    static const int N = 16 / sizeof(T);
    T v[N];
};

bool vec_ok(const void *a, const void *b, const void *c = NULL)
{
    return (((uintptr_t)a | (uintptr_t)b | (uintptr_t)c) & 15u) == 0;
}

/* The scalar tail after the packs: elements [head, n), one per thread. */
#define TAIL_STRIDE(i, head, n)                                                        \
    for (int64_t i = (head) + (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (int64_t)blockDim.x * gridDim.x)

template <class T> __global__ void k_gelu_fwd(const T *x, T *y, int64_t n, bool tanh_approx)
{
    GRID_STRIDE(i, n) y[i] = stf<T>(gelu_f(ldf(x[i]), tanh_approx));
}

template <class T> __global__ void k_gelu_fwd_vec(const T *x, T *y, int64_t n, bool tanh_approx)
{
    const int N = Pack<T>::N;
    int64_t packs = n / N;
    GRID_STRIDE(i, packs)
    {
        Pack<T> a = reinterpret_cast<const Pack<T> *>(x)[i], o;
#pragma unroll
        for (int k = 0; k < N; k++)
            o.v[k] = stf<T>(gelu_f(ldf(a.v[k]), tanh_approx));
        reinterpret_cast<Pack<T> *>(y)[i] = o;
    }
    TAIL_STRIDE(i, packs * N, n) y[i] = stf<T>(gelu_f(ldf(x[i]), tanh_approx));
}

template <class T>
__global__ void k_gelu_bwd(const T *x, const T *gy, T *gx, int64_t n, bool tanh_approx)
{
    GRID_STRIDE(i, n) gx[i] = stf<T>(gelu_grad(ldf(x[i]), ldf(gy[i]), tanh_approx));
}

template <class T>
__global__ void k_gelu_bwd_vec(const T *x, const T *gy, T *gx, int64_t n, bool tanh_approx)
{
    const int N = Pack<T>::N;
    int64_t packs = n / N;
    GRID_STRIDE(i, packs)
    {
        Pack<T> a = reinterpret_cast<const Pack<T> *>(x)[i];
        Pack<T> g = reinterpret_cast<const Pack<T> *>(gy)[i], o;
#pragma unroll
        for (int k = 0; k < N; k++)
            o.v[k] = stf<T>(gelu_grad(ldf(a.v[k]), ldf(g.v[k]), tanh_approx));
        reinterpret_cast<Pack<T> *>(gx)[i] = o;
    }
    TAIL_STRIDE(i, packs * N, n) gx[i] = stf<T>(gelu_grad(ldf(x[i]), ldf(gy[i]), tanh_approx));
}

/* ---- column sums: 32 columns per block, 8 row lanes, double accumulators ---- */

enum { COL_PLAIN = 0, COL_NORM = 1, COL_DGELU_TANH = 2, COL_DGELU_ERF = 3 };
const int kColW = 32, kColH = 8;

/* Column sums of term(r, c): PLAIN: y[r, c]; NORM: y[r, c] * ((x[r, c] -
 * mean[r]) * rstd[r]) with mean NULL meaning 0 (the norm weight gradients);
 * DGELU_*: z[r, c] = y[r, c] gelu'(x[r, c]) rounded to T, stored as it is
 * summed (a GELU's input gradient and its linear's bias gradient in one
 * pass); over the rows of chunk blockIdx.y (chunk_rows each), in double.
 * With part NULL (one chunk of every row) into g: g[c] (+)= the sum,
 * divided by div first when overwriting (not accumulate); else into
 * part[chunk, c]. */
template <class T, int MODE>
__global__ void k_colsum(const T *y, const T *x, const float *mean, const float *rstd, T *g,
                         double *part, int64_t rows, int64_t cols, int64_t chunk_rows,
                         bool accumulate, double div, T *z)
{
    __shared__ double sh[kColH][kColW + 1];
    int64_t r0 = (int64_t)blockIdx.y * chunk_rows;
    int64_t r1 = r0 + chunk_rows < rows ? r0 + chunk_rows : rows;
    for (int64_t c0 = (int64_t)blockIdx.x * kColW; c0 < cols; c0 += (int64_t)gridDim.x * kColW) {
        int64_t c = c0 + threadIdx.x;
        double acc = 0;
        if (c < cols) {
            int64_t r = r0 + threadIdx.y;
            if (MODE == COL_PLAIN)
                /* four rows' loads in flight, added in row order all the same */
                for (; r + 3 * kColH < r1; r += 4 * kColH) {
                    float a = ldf(y[r * cols + c]), b = ldf(y[(r + kColH) * cols + c]);
                    float d = ldf(y[(r + 2 * kColH) * cols + c]);
                    float e = ldf(y[(r + 3 * kColH) * cols + c]);
                    acc += (double)a;
                    acc += (double)b;
                    acc += (double)d;
                    acc += (double)e;
                }
            if (MODE == COL_DGELU_TANH || MODE == COL_DGELU_ERF)
                /* likewise: four rows' two loads each in flight */
                for (; r + 3 * kColH < r1; r += 4 * kColH) {
                    float v[4], a[4];
#pragma unroll
                    for (int j = 0; j < 4; j++) {
                        v[j] = ldf(y[(r + j * kColH) * cols + c]);
                        a[j] = ldf(x[(r + j * kColH) * cols + c]);
                    }
#pragma unroll
                    for (int j = 0; j < 4; j++) {
                        T t = stf<T>(gelu_grad(a[j], v[j], MODE == COL_DGELU_TANH));
                        z[(r + j * kColH) * cols + c] = t;
                        acc += (double)ldf(t);
                    }
                }
            for (; r < r1; r += kColH) {
                float v = ldf(y[r * cols + c]);
                if (MODE == COL_PLAIN) {
                    acc += (double)v;
                } else if (MODE == COL_DGELU_TANH || MODE == COL_DGELU_ERF) {
                    T t = stf<T>(gelu_grad(ldf(x[r * cols + c]), v, MODE == COL_DGELU_TANH));
                    z[r * cols + c] = t;
                    acc += (double)ldf(t);
                } else {
                    float m = mean ? mean[r] : 0.0f;
                    acc += (double)(v * ((ldf(x[r * cols + c]) - m) * rstd[r]));
                }
            }
        }
        sh[threadIdx.y][threadIdx.x] = acc;
        __syncthreads();
        if (threadIdx.y == 0 && c < cols) {
            double s = 0;
            for (int j = 0; j < kColH; j++)
                s += sh[j][threadIdx.x];
            if (part)
                part[(int64_t)blockIdx.y * cols + c] = s;
            else
                g[c] = accumulate ? std_<T>((double)ldf(g[c]) + s) : std_<T>(s / div);
        }
        __syncthreads();
    }
}

/* g[c] (+)= the chunks' partial sums of column c, added in chunk order */
template <class T>
__global__ void k_colsum_finish(const double *part, int64_t chunks, T *g, int64_t cols,
                                bool accumulate, double div)
{
    GRID_STRIDE(c, cols)
    {
        double s = 0;
        for (int64_t k = 0; k < chunks; k++)
            s += part[k * cols + c];
        g[c] = accumulate ? std_<T>((double)ldf(g[c]) + s) : std_<T>(s / div);
    }
}

/* Blocks that keep the GPU busy (a few per multiprocessor of a large GPU);
 * fewer rows than kChunkRows per chunk are not worth a second kernel. */
const int64_t kBusyBlocks = 1024, kChunkRows = 256;

/* One block per 32 columns covering every row while that fills the GPU;
 * else the rows split into chunks (kernel scratch for their partial sums,
 * the split a function of the shape alone, so the result is deterministic). */
template <class T, int MODE>
tp_status launch_colsum(Launch *L, const T *y, const T *x, const float *mean, const float *rstd,
                        T *g, int64_t rows, int64_t cols, bool accumulate, double div = 1.0,
                        T *z = NULL)
{
    if (cols <= 0)
        return TP_OK;
    int64_t tiles = (cols + kColW - 1) / kColW;
    unsigned gx = (unsigned)(tiles < kMaxGrid ? tiles : kMaxGrid);
    dim3 block(kColW, kColH);
    int64_t chunks = (kBusyBlocks + tiles - 1) / tiles, by_rows = rows / kChunkRows;
    if (chunks > by_rows)
        chunks = by_rows;
    if (chunks < 2) {
        k_colsum<T, MODE><<<gx, block, 0, L->s>>>(y, x, mean, rstd, g, (double *)NULL, rows, cols,
                                                  rows, accumulate, div, z);
        return TP_OK;
    }
    int64_t chunk_rows = (rows + chunks - 1) / chunks;
    chunks = (rows + chunk_rows - 1) / chunk_rows;
    void *part = NULL;
    TP_CHECK(
        tp__cuda_scratch(L->fn, L->dev, L->s, (size_t)(chunks * cols) * sizeof(double), &part));
    k_colsum<T, MODE><<<dim3(gx, (unsigned)chunks), block, 0, L->s>>>(
        y, x, mean, rstd, g, (double *)part, rows, cols, chunk_rows, accumulate, div, z);
    k_colsum_finish<T><<<grid_for(cols, kThreads), kThreads, 0, L->s>>>(
        (const double *)part, chunks, g, cols, accumulate, div);
    tp__cuda_scratch_free(part, L->s);
    return TP_OK;
}

/* ---- reductions ------------------------------------------------------------------ */

/* inner == 1: one block per row of [outer, size] */
template <class T>
__global__ void k_sum_rowwise(const T *x, T *y, int64_t outer, int64_t size, double div)
{
    __shared__ double sh[32];
    for (int64_t o = blockIdx.x; o < outer; o += gridDim.x) {
        const T *xo = x + o * size;
        double acc = 0;
        for (int64_t s = threadIdx.x; s < size; s += blockDim.x)
            acc += (double)ldf(xo[s]);
        acc = block_sum(acc, sh);
        if (threadIdx.x == 0)
            y[o] = std_<T>(acc / div);
    }
}

/* inner > 1: one thread per output, walking the reduced dim (coalesced over inner) */
template <class T>
__global__ void k_sum_strided(const T *x, T *y, int64_t outer, int64_t size, int64_t inner,
                              double div)
{
    GRID_STRIDE(e, outer * inner)
    {
        int64_t o = e / inner, i = e % inner;
        const T *p = x + o * size * inner + i;
        double acc = 0;
        for (int64_t s = 0; s < size; s++)
            acc += (double)ldf(p[s * inner]);
        y[e] = std_<T>(acc / div);
    }
}

/* the gradient of a whole sum: every element gets gy[0] * scale, in
 * 16-byte stores (gx 16-byte aligned; else k_sum_dim_bwd) */
template <class T> __global__ void k_sum_all_bwd_vec(const T *gy, T *gx, int64_t n, float scale)
{
    const int N = Pack<T>::N;
    T v = stf<T>(ldf(gy[0]) * scale);
    Pack<T> p;
#pragma unroll
    for (int k = 0; k < N; k++)
        p.v[k] = v;
    int64_t packs = n / N;
    GRID_STRIDE(i, packs) reinterpret_cast<Pack<T> *>(gx)[i] = p;
    TAIL_STRIDE(i, packs * N, n) gx[i] = v;
}

template <class T>
__global__ void k_sum_dim_bwd(const T *gy, T *gx, int64_t outer, int64_t size, int64_t inner,
                              float scale)
{
    GRID_STRIDE(e, outer * size * inner)
    {
        int64_t o = e / (size * inner), i = e % inner;
        gx[e] = stf<T>(ldf(gy[o * inner + i]) * scale);
    }
}

/* one block: deterministic, and a single write of the result */
template <class T> __global__ void k_sum_all(const T *x, int64_t n, T *y, double div)
{
    __shared__ double sh[32];
    double acc = 0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
        acc += (double)ldf(x[i]);
    acc = block_sum(acc, sh);
    if (threadIdx.x == 0)
        y[0] = std_<T>(acc / div);
}

/* part[b] = block b's grid-stride share of the sum of x, in double */
template <class T> __global__ void k_sum_part(const T *x, int64_t n, double *part)
{
    __shared__ double sh[32];
    double acc = 0;
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, S = (int64_t)blockDim.x * gridDim.x;
    /* four loads in flight, added in the grid-stride order all the same */
    for (; i + 3 * S < n; i += 4 * S) {
        float a = ldf(x[i]), b = ldf(x[i + S]), c = ldf(x[i + 2 * S]), d = ldf(x[i + 3 * S]);
        acc += (double)a;
        acc += (double)b;
        acc += (double)c;
        acc += (double)d;
    }
    for (; i < n; i += S)
        acc += (double)ldf(x[i]);
    acc = block_sum(acc, sh);
    if (threadIdx.x == 0)
        part[blockIdx.x] = acc;
}

/* y[0] = the parts' sum / div: one block, so deterministic */
template <class T> __global__ void k_sum_parts(const double *part, int np, T *y, double div)
{
    __shared__ double sh[32];
    double acc = 0;
    for (int i = threadIdx.x; i < np; i += blockDim.x)
        acc += part[i];
    acc = block_sum(acc, sh);
    if (threadIdx.x == 0)
        y[0] = std_<T>(acc / div);
}

/* ---- softmax ---------------------------------------------------------------------- */

template <class T> __global__ void k_softmax_fwd(const T *x, T *y, int64_t rows, int64_t cols)
{
    __shared__ double shd[32];
    __shared__ float shf[32];
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const T *xr = x + r * cols;
        T *yr = y + r * cols;
        float m = -INFINITY;
        for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
            m = fmaxf(m, ldf(xr[c]));
        m = block_max(m, shf);
        double s = 0;
        for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
            s += (double)expf(ldf(xr[c]) - m);
        s = block_sum(s, shd);
        float inv = (float)(1.0 / s);
        /* each thread rewrites only the columns it read: in place is safe */
        for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
            yr[c] = stf<T>(expf(ldf(xr[c]) - m) * inv);
        __syncthreads();
    }
}

template <class T>
__global__ void k_softmax_bwd(const T *y, const T *gy, T *gx, int64_t rows, int64_t cols)
{
    __shared__ double sh[32];
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const T *yr = y + r * cols, *gr = gy + r * cols;
        T *gxr = gx + r * cols;
        double d = 0;
        for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
            d += (double)ldf(yr[c]) * (double)ldf(gr[c]);
        float dot = (float)block_sum(d, sh);
        for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
            gxr[c] = stf<T>(ldf(yr[c]) * (ldf(gr[c]) - dot));
        __syncthreads();
    }
}

template <class T> __global__ void k_causal_mask(T *s, int64_t batch, int64_t S)
{
    T ninf = stf<T>(-INFINITY);
    GRID_STRIDE(e, batch * S * S)
    {
        int64_t ij = e % (S * S);
        if (ij % S > ij / S)
            s[e] = ninf;
    }
}

/* Whether key j of a row is visible: inside the causal prefix (lim) and not
 * padding (p32 / p64: the row's padding, at most one non-NULL). */
__device__ __forceinline__ bool attn_visible(int64_t j, int64_t lim, const int32_t *p32,
                                             const int64_t *p64)
{
    return j < lim && (p32 ? p32[j] != 0 : p64 ? p64[j] != 0 : true);
}

/* One block per row of the [nrows = batch * rows, Sk] scores (kernels.h
 * attn_softmax): the max and the sum over the visible keys, then every key
 * written (0 where masked). m is the block's reduction, so `empty` is the
 * same in every thread and block_sum runs in all of them. */
template <class T>
__global__ void k_attn_softmax(T *s, int64_t nrows, int64_t rows, int64_t Sq, int64_t Sk,
                               int64_t key_offset, bool causal, const void *pad, bool pad_i32,
                               int64_t pad_div)
{
    __shared__ double shd[32];
    __shared__ float shf[32];
    for (int64_t r = blockIdx.x; r < nrows; r += gridDim.x) {
        T *sr = s + r * Sk;
        int64_t b = r / rows, i = r % rows % Sq;
        int64_t lim = causal && key_offset < Sk - i - 1 ? key_offset + i + 1 : Sk;
        const int32_t *p32 = pad && pad_i32 ? (const int32_t *)pad + b / pad_div * Sk : NULL;
        const int64_t *p64 = pad && !pad_i32 ? (const int64_t *)pad + b / pad_div * Sk : NULL;
        float m = -INFINITY;
        for (int64_t c = threadIdx.x; c < lim; c += blockDim.x)
            if (attn_visible(c, lim, p32, p64))
                m = fmaxf(m, ldf(sr[c]));
        m = block_max(m, shf);
        bool empty = m == -INFINITY;
        double sum = 0;
        for (int64_t c = threadIdx.x; c < lim && !empty; c += blockDim.x)
            if (attn_visible(c, lim, p32, p64))
                sum += (double)expf(ldf(sr[c]) - m);
        sum = block_sum(sum, shd);
        float inv = empty ? 0.0f : (float)(1.0 / sum);
        /* each thread rewrites only the columns it read: in place is safe */
        for (int64_t c = threadIdx.x; c < Sk; c += blockDim.x)
            sr[c] = stf<T>(!empty && attn_visible(c, lim, p32, p64) ? expf(ldf(sr[c]) - m) * inv
                                                                     : 0.0f);
        __syncthreads();
    }
}

/* 32 x 32 tiles through shared memory: coalesced reads and writes (the tile
 * holds floats: every T converts to float and back exactly) */
template <class T>
__global__ void k_transpose(const T *x, T *y, int64_t batch, int64_t R, int64_t C)
{
    __shared__ float tile[32][33];
    for (int64_t b = blockIdx.z; b < batch; b += gridDim.z)
        for (int64_t i0 = (int64_t)blockIdx.y * 32; i0 < R; i0 += (int64_t)gridDim.y * 32)
            for (int64_t j0 = (int64_t)blockIdx.x * 32; j0 < C; j0 += (int64_t)gridDim.x * 32) {
                const T *xb = x + b * R * C;
                T *yb = y + b * R * C;
                for (int k = threadIdx.y; k < 32; k += blockDim.y) {
                    int64_t i = i0 + k, j = j0 + threadIdx.x;
                    if (i < R && j < C)
                        tile[k][threadIdx.x] = ldf(xb[i * C + j]);
                }
                __syncthreads();
                for (int k = threadIdx.y; k < 32; k += blockDim.y) {
                    int64_t j = j0 + k, i = i0 + threadIdx.x;
                    if (i < R && j < C)
                        yb[j * R + i] = stf<T>(tile[threadIdx.x][k]);
                }
                __syncthreads();
            }
}

/* ---- embedding ------------------------------------------------------------------ */

template <class T>
__global__ void k_embedding_fwd(const int64_t *idx, int64_t n, const T *w, int64_t rows_local,
                                int64_t dim, int64_t offset, T *y)
{
    GRID_STRIDE(e, n * dim)
    {
        int64_t i = e / dim, c = e % dim, t = idx[i];
        /* compare before subtracting: defined for any int64 index */
        y[e] = (t >= offset && t - offset < rows_local) ? w[(t - offset) * dim + c] : stf<T>(0.0f);
    }
}

template <class T>
__global__ void k_embedding_bwd(const int64_t *idx, int64_t n, const T *gy, int64_t rows_local,
                                int64_t dim, int64_t offset, T *gw)
{
    GRID_STRIDE(e, n * dim)
    {
        int64_t i = e / dim, c = e % dim, t = idx[i];
        if (t >= offset && t - offset < rows_local)
            atomic_addf(gw + (t - offset) * dim + c, ldf(gy[e]));
    }
}

/* ---- normalization ------------------------------------------------------------- */

template <class T>
__global__ void k_layer_norm_fwd(const T *x, const T *w, const T *b, T *y, float *mean, float *rstd,
                                 int64_t rows, int64_t cols, float eps)
{
    __shared__ double sh[32];
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const T *xr = x + r * cols;
        T *yr = y + r * cols;
        double s = 0;
        for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
            s += (double)ldf(xr[c]);
        s = block_sum(s, sh);
        double mu = cols > 0 ? s / (double)cols : 0.0;
        /* two-pass variance, as the CPU */
        double v = 0;
        for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
            double d = (double)ldf(xr[c]) - mu;
            v += d * d;
        }
        v = block_sum(v, sh);
        double var = cols > 0 ? v / (double)cols : 0.0;
        float m = (float)mu, rs = (float)(1.0 / sqrt(var + (double)eps));
        if (threadIdx.x == 0) {
            mean[r] = m;
            rstd[r] = rs;
        }
        for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
            float t = (ldf(xr[c]) - m) * rs;
            if (w)
                t *= ldf(w[c]);
            if (b)
                t += ldf(b[c]);
            yr[c] = stf<T>(t);
        }
    }
}

template <class T>
__global__ void k_layer_norm_bwd_x(const T *x, const T *w, const float *mean, const float *rstd,
                                   const T *gy, T *gx, int64_t rows, int64_t cols)
{
    __shared__ double sh[32];
    double inv_n = cols > 0 ? 1.0 / (double)cols : 0.0;
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const T *xr = x + r * cols, *gr = gy + r * cols;
        T *gxr = gx + r * cols;
        float m = mean[r], rs = rstd[r];
        double sa = 0, sb = 0;
        for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
            double g = w ? (double)ldf(gr[c]) * (double)ldf(w[c]) : (double)ldf(gr[c]);
            sa += g;
            sb += g * (double)((ldf(xr[c]) - m) * rs);
        }
        sa = block_sum(sa, sh);
        sb = block_sum(sb, sh);
        float a = (float)(sa * inv_n), bb = (float)(sb * inv_n);
        for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
            float g = w ? ldf(gr[c]) * ldf(w[c]) : ldf(gr[c]);
            gxr[c] = stf<T>(rs * (g - a - (ldf(xr[c]) - m) * rs * bb));
        }
    }
}

template <class T>
__global__ void k_rms_norm_fwd(const T *x, const T *w, T *y, float *rstd, int64_t rows,
                               int64_t cols, float eps)
{
    __shared__ double sh[32];
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const T *xr = x + r * cols;
        T *yr = y + r * cols;
        double s = 0;
        for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
            double v = (double)ldf(xr[c]);
            s += v * v;
        }
        s = block_sum(s, sh);
        double ms = cols > 0 ? s / (double)cols : 0.0;
        float rs = (float)(1.0 / sqrt(ms + (double)eps));
        if (threadIdx.x == 0)
            rstd[r] = rs;
        for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
            yr[c] = stf<T>(w ? ldf(xr[c]) * rs * ldf(w[c]) : ldf(xr[c]) * rs);
    }
}

template <class T>
__global__ void k_rms_norm_bwd_x(const T *x, const T *w, const float *rstd, const T *gy, T *gx,
                                 int64_t rows, int64_t cols)
{
    __shared__ double sh[32];
    double inv_n = cols > 0 ? 1.0 / (double)cols : 0.0;
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const T *xr = x + r * cols, *gr = gy + r * cols;
        T *gxr = gx + r * cols;
        float rs = rstd[r];
        double sb = 0;
        for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
            sb += w ? (double)ldf(gr[c]) * (double)ldf(w[c]) * (double)(ldf(xr[c]) * rs)
                    : (double)ldf(gr[c]) * (double)ldf(xr[c]);
        sb = block_sum(sb, sh);
        if (!w)
            sb *= (double)rs;
        float bb = (float)(sb * inv_n);
        for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
            float g = w ? ldf(gr[c]) * ldf(w[c]) : ldf(gr[c]);
            gxr[c] = stf<T>(rs * (g - ldf(xr[c]) * rs * bb));
        }
    }
}

/* ---- dropout ------------------------------------------------------------------- */

struct DropGeom {
    int ndim;
    int64_t shape[TP_MAX_DIMS];
    uint64_t gstride[TP_MAX_DIMS];
    uint64_t g0; /* counter of the block's first element */
};

template <class T>
__global__ void k_dropout_fwd(const T *x, T *y, uint8_t *mask, int64_t n, DropGeom geo, double p,
                              float scale, uint64_t seed)
{
    GRID_STRIDE(i, n)
    {
        /* the global counter of local element i: unravel in the block's
         * shape, ravel in the global one */
        uint64_t g = geo.g0;
        int64_t rem = i;
        for (int d = geo.ndim - 1; d >= 0; d--) {
            int64_t s = geo.shape[d];
            g += (uint64_t)(rem % s) * geo.gstride[d];
            rem /= s;
        }
        bool keep = tp__rng_uniform53(seed, g) >= p;
        y[i] = stf<T>(keep ? ldf(x[i]) * scale : 0.0f);
        if (mask)
            mask[i] = (uint8_t)keep;
    }
}

template <class T>
__global__ void k_dropout_bwd(const T *gy, const uint8_t *mask, T *gx, int64_t n, float scale)
{
    GRID_STRIDE(i, n) gx[i] = stf<T>(mask[i] ? ldf(gy[i]) * scale : 0.0f);
}

__global__ void k_fill_u8(uint8_t *m, uint8_t v, int64_t n)
{
    GRID_STRIDE(i, n) m[i] = v;
}

/* ---- cross entropy ---------------------------------------------------------------- */

__device__ __forceinline__ bool ce_counted(int64_t t, int64_t classes, int64_t ignore_index)
{
    return t != ignore_index && t >= 0 && t < classes;
}

/* The first element of row r of logits laid out [outer, classes, inner]; the
 * row's classes follow at stride inner. */
__device__ __forceinline__ int64_t ce_row(int64_t r, int64_t classes, int64_t inner)
{
    return inner == 1 ? r * classes : (r / inner) * classes * inner + r % inner;
}

/* A class weight (1 without weights). */
template <class T> __device__ __forceinline__ float ce_weight(const T *weight, int64_t t)
{
    return weight ? ldf(weight[t]) : 1.0f;
}

/* The row's max and sum of exp(x - max) over classes at stride st, reduced
 * over the block (every thread gets both). */
template <class T>
__device__ void row_max_sumexp(const T *xr, int64_t classes, int64_t st, float *shf, double *shd,
                               float *m_out, double *s_out)
{
    float m = -INFINITY;
    for (int64_t c = threadIdx.x; c < classes; c += blockDim.x)
        m = fmaxf(m, ldf(xr[c * st]));
    m = block_max(m, shf);
    double s = 0;
    for (int64_t c = threadIdx.x; c < classes; c += blockDim.x)
        s += (double)expf(ldf(xr[c * st]) - m);
    *m_out = m;
    *s_out = block_sum(s, shd);
}

template <class T>
__global__ void k_ce_fwd(const T *x, const int64_t *target, const T *weight, T *loss, int64_t rows,
                         int64_t classes, int64_t inner, int64_t ignore_index)
{
    __shared__ double shd[32];
    __shared__ float shf[32];
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        int64_t t = target[r];
        if (!ce_counted(t, classes, ignore_index)) { /* uniform across the block */
            if (threadIdx.x == 0)
                loss[r] = stf<T>(0.0f);
            continue;
        }
        const T *xr = x + ce_row(r, classes, inner);
        float m;
        double s;
        row_max_sumexp(xr, classes, inner, shf, shd, &m, &s);
        if (threadIdx.x == 0) {
            double lse = log(s) + (double)m;
            double wt = (double)ce_weight(weight, t);
            loss[r] = std_<T>(wt * (lse - (double)ldf(xr[t * inner])));
        }
    }
}

template <class T>
__global__ void k_ce_bwd(const T *x, const int64_t *target, const T *weight, const T *gloss, T *gx,
                         int64_t rows, int64_t classes, int64_t inner, int64_t ignore_index)
{
    __shared__ double shd[32];
    __shared__ float shf[32];
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        int64_t t = target[r], base = ce_row(r, classes, inner);
        T *gxr = gx + base;
        if (!ce_counted(t, classes, ignore_index)) {
            for (int64_t c = threadIdx.x; c < classes; c += blockDim.x)
                gxr[c * inner] = stf<T>(0.0f);
            continue;
        }
        const T *xr = x + base;
        float m;
        double s;
        row_max_sumexp(xr, classes, inner, shf, shd, &m, &s);
        float g = ldf(gloss[r]) * ce_weight(weight, t);
        float k = (float)((double)g / s);
        for (int64_t c = threadIdx.x; c < classes; c += blockDim.x) {
            float v = k * expf(ldf(xr[c * inner]) - m);
            gxr[c * inner] = stf<T>(c == t ? v - g : v);
        }
    }
}

template <class T>
__global__ void k_ce_gloss(const T *g, T *gl, int64_t rows, bool broadcast, double div)
{
    GRID_STRIDE(r, rows) gl[r] = broadcast ? std_<T>((double)ldf(g[0]) / div) : g[r];
}

template <class T>
__global__ void k_row_max(const T *x, float *mx, int64_t rows, int64_t cols, int64_t inner)
{
    __shared__ float sh[32];
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const T *xr = x + ce_row(r, cols, inner);
        float m = -INFINITY;
        for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
            m = fmaxf(m, ldf(xr[c * inner]));
        m = block_max(m, sh);
        if (threadIdx.x == 0)
            mx[r] = m;
    }
}

template <class T>
__global__ void k_row_sumexp(const T *x, const float *mx, float *out, int64_t rows, int64_t cols,
                             int64_t inner)
{
    __shared__ double sh[32];
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const T *xr = x + ce_row(r, cols, inner);
        float m = mx[r];
        double s = 0;
        for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
            s += (double)expf(ldf(xr[c * inner]) - m);
        s = block_sum(s, sh);
        if (threadIdx.x == 0)
            out[r] = (float)s;
    }
}

template <class T>
__global__ void k_pick_target(const T *x, const int64_t *target, float *picked, int64_t rows,
                              int64_t cols, int64_t inner, int64_t offset, int64_t ignore_index)
{
    GRID_STRIDE(r, rows)
    {
        int64_t t = target[r];
        bool owned = t != ignore_index && t >= offset && t - offset < cols;
        picked[r] = owned ? ldf(x[ce_row(r, cols, inner) + (t - offset) * inner]) : 0.0f;
    }
}

template <class T>
__global__ void k_vocab_ce_loss(const int64_t *target, const T *weight, const float *mx,
                                const float *sumexp, const float *picked, T *loss, int64_t rows,
                                int64_t ignore_index)
{
    GRID_STRIDE(r, rows)
    {
        int64_t t = target[r];
        if (t == ignore_index) {
            loss[r] = stf<T>(0.0f);
        } else {
            double wt = (double)ce_weight(weight, t);
            loss[r] = std_<T>(wt * (log((double)sumexp[r]) + (double)mx[r] - (double)picked[r]));
        }
    }
}

template <class T>
__global__ void k_vocab_ce_bwd(const T *x, const int64_t *target, const T *weight, const float *mx,
                               const float *sumexp, const T *gloss, T *gx, int64_t rows,
                               int64_t cols, int64_t inner, int64_t offset, int64_t ignore_index)
{
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        int64_t t = target[r], base = ce_row(r, cols, inner);
        T *gxr = gx + base;
        if (t == ignore_index || t < 0) {
            for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
                gxr[c * inner] = stf<T>(0.0f);
            continue;
        }
        const T *xr = x + base;
        float g = ldf(gloss[r]) * ce_weight(weight, t);
        float k = (float)((double)g / (double)sumexp[r]);
        float m = mx[r];
        for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
            float v = k * expf(ldf(xr[c * inner]) - m);
            gxr[c * inner] = stf<T>(c + offset == t ? v - g : v);
        }
    }
}

/* ---- optimizers (double, p rounded once per step) --------------------------------- */

template <class T> __global__ void k_sgd(T *p, const T *g, int64_t n, double lr)
{
    GRID_STRIDE(i, n) p[i] = std_<T>((double)ldf(p[i]) - lr * (double)ldf(g[i]));
}

template <class T>
__global__ void k_adam(T *p, float *m, float *v, const T *g, int64_t n, double b1, double b2,
                       double step_size, double bc2_sqrt, double eps)
{
    GRID_STRIDE(i, n)
    {
        double gk = ldf(g[i]);
        float mi = (float)(b1 * m[i] + (1.0 - b1) * gk);
        float vi = (float)(b2 * v[i] + (1.0 - b2) * gk * gk);
        m[i] = mi;
        v[i] = vi;
        double denom = sqrt((double)vi) / bc2_sqrt + eps;
        p[i] = std_<T>((double)ldf(p[i]) - step_size * (double)mi / denom);
    }
}

/* ---- rotary position embedding ------------------------------------------------------ */

/* One thread per pair (i, i + D/2) of a row of [B, H, S, D]: both elements
 * are read before either is written (y may be x). __fmul_rn / __fadd_rn keep
 * the products and the sum separately rounded, as PyTorch's x * cos +
 * rotate_half(x) * sin and the CPU engine: no contraction into an FMA, so f32
 * results equal the CPU's bit for bit. */
template <class T, bool BWD>
__global__ void k_rope(const T *x, const T *cosb, const T *sinb, T *y, int64_t B, int64_t H,
                       int64_t S, int64_t D, int64_t cbs)
{
    const int64_t h = D / 2;
    GRID_STRIDE(e, B * H * S * h)
    {
        int64_t i = e % h, row = e / h, s = row % S, b = row / (H * S);
        const T *xr = x + row * D, *cr = cosb + b * cbs + s * D, *sr = sinb + b * cbs + s * D;
        float a = ldf(xr[i]), c = ldf(xr[i + h]);
        float y1, y2;
        if (!BWD) {
            y1 = __fsub_rn(__fmul_rn(a, ldf(cr[i])), __fmul_rn(c, ldf(sr[i])));
            y2 = __fadd_rn(__fmul_rn(c, ldf(cr[i + h])), __fmul_rn(a, ldf(sr[i + h])));
        } else {
            y1 = __fadd_rn(__fmul_rn(a, ldf(cr[i])), __fmul_rn(c, ldf(sr[i + h])));
            y2 = __fsub_rn(__fmul_rn(c, ldf(cr[i + h])), __fmul_rn(a, ldf(sr[i])));
        }
        y[row * D + i] = stf<T>(y1);
        y[row * D + i + h] = stf<T>(y2);
    }
}

/* One thread per (position, frequency): the f32 angle, then sincosf (the
 * accurate one: this file is not built with fast math) and the scaling,
 * stored to both halves of the row. */
template <class T>
__global__ void k_rope_cos_sin(const int64_t *pos, const float *inv_freq, T *cosb, T *sinb,
                               int64_t n, int64_t D, float scaling)
{
    const int64_t h = D / 2;
    GRID_STRIDE(e, n * h)
    {
        int64_t r = e / h, i = e % h;
        float f = __fmul_rn((float)pos[r], inv_freq[i]), sv, cv;
        sincosf(f, &sv, &cv);
        T ct = stf<T>(__fmul_rn(cv, scaling)), st = stf<T>(__fmul_rn(sv, scaling));
        cosb[r * D + i] = ct;
        cosb[r * D + i + h] = ct;
        sinb[r * D + i] = st;
        sinb[r * D + i + h] = st;
    }
}

/* ---- cuBLAS handles: one per thread and device, bound to the thread's stream -- */

/* A product with an epilogue, as cuBLASLt's heuristic chose its algorithm
 * (or found none: `none`). */
struct LtPlan {
    bool used, none;
    int dev;
    tp_dtype dtype;
    cublasComputeType_t ct;
    cublasLtEpilogue_t epi;
    cublasOperation_t opa, opb;
    int m, n, k;
    unsigned align; /* of A, B and D, 9 bits each */
    cublasLtMatmulAlgo_t algo;
    size_t ws;
};

const int kLtPlans = 16;

struct Handles {
    cublasHandle_t h[TP__KC_MAX_DEVICES];
    cublasLtHandle_t lt[TP__KC_MAX_DEVICES];
    LtPlan plans[kLtPlans]; /* the thread's last products with an epilogue */
    int next_plan;
};

pthread_key_t handle_key;
pthread_once_t handle_once = PTHREAD_ONCE_INIT;

void handles_destroy(void *p)
{
    Handles *hs = (Handles *)p;
    int prev = 0;
    bool have_prev = cudaGetDevice(&prev) == cudaSuccess;
    for (int i = 0; i < TP__KC_MAX_DEVICES; i++) {
        if (!hs->h[i])
            continue;
        if (cudaSetDevice(i) == cudaSuccess) {
            /* the thread's stream may already be gone (key destructors run
             * in no fixed order): unbind before destroying */
            (void)cublasSetStream(hs->h[i], 0);
            (void)cublasDestroy(hs->h[i]);
        }
    }
    for (int i = 0; i < TP__KC_MAX_DEVICES; i++) {
        if (hs->lt[i] && cudaSetDevice(i) == cudaSuccess)
            (void)cublasLtDestroy(hs->lt[i]);
    }
    if (have_prev)
        (void)cudaSetDevice(prev);
    (void)cudaGetLastError();
    free(hs);
}

void handle_key_init(void) { (void)pthread_key_create(&handle_key, handles_destroy); }

tp_status cublas_fail(const char *fn, const char *what, cublasStatus_t s)
{
    (void)cudaGetLastError();
    return tp__error(s == CUBLAS_STATUS_ALLOC_FAILED ? TP_ERR_NO_MEMORY : TP_ERR_BACKEND,
                     "%s: %s failed: %s", fn, what, cublasGetStatusString(s));
}

/* The calling thread's handle table (made at its first product). */
tp_status get_handles(Launch *L, Handles **out)
{
    (void)pthread_once(&handle_once, handle_key_init);
    Handles *hs = (Handles *)pthread_getspecific(handle_key);
    if (!hs) {
        hs = (Handles *)calloc(1, sizeof *hs);
        if (!hs)
            return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory for the cuBLAS handle table",
                             L->fn);
        if (pthread_setspecific(handle_key, hs) != 0) {
            free(hs);
            return tp__error(TP_ERR_NO_MEMORY, "%s: pthread_setspecific failed", L->fn);
        }
    }
    if (L->dev < 0 || L->dev >= TP__KC_MAX_DEVICES)
        return tp__error(TP_ERR_INVALID_ARG, "%s: CUDA device %d outside [0, %d)", L->fn, L->dev,
                         TP__KC_MAX_DEVICES);
    *out = hs;
    return TP_OK;
}

/* The calling thread's cuBLAS handle for L->dev (current), on L->s. */
tp_status get_handle(Launch *L, cublasHandle_t *out)
{
    Handles *hs;
    tp_status st = get_handles(L, &hs);
    if (st != TP_OK)
        return st;
    if (!hs->h[L->dev]) {
        cublasHandle_t h = NULL;
        cublasStatus_t s = cublasCreate(&h);
        if (s != CUBLAS_STATUS_SUCCESS)
            return cublas_fail(L->fn, "cublasCreate", s);
        s = cublasSetStream(h, L->s);
        if (s != CUBLAS_STATUS_SUCCESS) {
            (void)cublasDestroy(h);
            return cublas_fail(L->fn, "cublasSetStream", s);
        }
        hs->h[L->dev] = h;
    }
    *out = hs->h[L->dev];
    return TP_OK;
}

cudaDataType_t cuda_type(tp_dtype d)
{
    return d == TP_F16 ? CUDA_R_16F : d == TP_BF16 ? CUDA_R_16BF : CUDA_R_32F;
}

template <class T>
tp_status scale_mat_on(cudaStream_t s, unsigned grid, T *c, int64_t m, int64_t n, int64_t ldc,
                       float beta)
{
    k_scale_mat<T><<<grid, kThreads, 0, s>>>(c, m, n, ldc, beta);
    return TP_OK;
}

/* The product on a current device and stream (inside begin/end). */
tp_status gemm_on(Launch *L, tp_dtype dtype, bool ta, bool tb, int64_t m, int64_t n, int64_t k,
                  float alpha, const void *a, int64_t lda, const void *b, int64_t ldb, float beta,
                  void *c, int64_t ldc)
{
    if (m <= 0 || n <= 0)
        return TP_OK;
    if (k <= 0) { /* C = beta C; cuBLAS would reject the leading dims of empty A, B */
        unsigned g = grid_for(m * n, kThreads);
        return TYPED(dtype, scale_mat_on<T>(L->s, g, mp<T>(c), m, n, ldc, beta));
    }
    if (m > INT_MAX || n > INT_MAX || k > INT_MAX || lda > INT_MAX || ldb > INT_MAX ||
        ldc > INT_MAX)
        return tp__error(TP_ERR_NOT_SUPPORTED,
                         "%s: matrix product %lld x %lld x %lld exceeds cuBLAS's int sizes", L->fn,
                         (long long)m, (long long)n, (long long)k);
    cublasHandle_t h;
    tp_status st = get_handle(L, &h);
    if (st != TP_OK)
        return st;
    cublasComputeType_t ct = dtype == TP_F32 && tp_cuda_allow_tf32() ? CUBLAS_COMPUTE_32F_FAST_TF32
                                                                      : CUBLAS_COMPUTE_32F;
    cudaDataType_t t = cuda_type(dtype);
    /* row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: the
     * stored row-major B read column-major is B^T, so B goes first with its
     * own transpose flag, then A */
    cublasStatus_t s = cublasGemmEx(h, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N,
                                    (int)n, (int)m, (int)k, &alpha, b, t, (int)ldb, a, t, (int)lda,
                                    &beta, c, t, (int)ldc, ct, CUBLAS_GEMM_DEFAULT);
    if (s != CUBLAS_STATUS_SUCCESS)
        return cublas_fail(L->fn, "cublasGemmEx", s);
    return TP_OK;
}

/* ---- products with an epilogue (cuBLASLt) ------------------------------------
 *
 * A linear forward's bias rides in the product (CUBLASLT_EPILOGUE_BIAS: added
 * to the f32 accumulator before the one rounding), instead of a broadcast
 * kernel that writes the whole output and a product that reads it back
 * (beta 1). Only for outputs of at least kLtMinElems elements: below that
 * the broadcast costs less than cuBLASLt's host work per call. cuBLASLt's
 * heuristic picks each shape's algorithm once per thread (the last kLtPlans
 * shapes are kept); where it has none, and under TP_CUDA_EPILOGUE=0, the
 * broadcast and cublasGemmEx run as before. tp_linear_gelu's bf16/f16 tanh
 * GELU rides there too (GELU_AUX_BIAS: the pre-activation into a second
 * output for the backward; GELU_BIAS without one).
 *
 * The bias gradient stays the column-sum kernel: cuBLASLt's BGRADB epilogue
 * ran as a reduction kernel of its own on the H200, slower than that one
 * (78 against 70 us for an 8192 x 8192 bf16 gradient), and f16 weight
 * gradients from that product came out more than one rounding off. */

const int64_t kLtMinElems = (int64_t)1 << 18;
const size_t kLtWorkspace = (size_t)4 << 20;

bool lt_enabled()
{
    static int on = -1; /* process-wide, read at the first product that could use it */
    int v = __atomic_load_n(&on, __ATOMIC_RELAXED);
    if (v < 0) {
        const char *e = getenv("TP_CUDA_EPILOGUE");
        v = !(e && strcmp(e, "0") == 0);
        __atomic_store_n(&on, v, __ATOMIC_RELAXED);
    }
    return v != 0;
}

/* The largest power of two up to 256 that divides p's address. */
unsigned align_of(const void *p)
{
    uintptr_t a = (uintptr_t)p;
    unsigned al = 256;
    while (al > 1 && a % al)
        al >>= 1;
    return al;
}

/* The thread's plan for this product: found, or a free (oldest) slot for it. */
LtPlan *lt_plan(Handles *hs, const LtPlan *key, bool *found)
{
    for (int i = 0; i < kLtPlans; i++) {
        LtPlan *p = &hs->plans[i];
        if (p->used && p->dev == key->dev && p->dtype == key->dtype && p->ct == key->ct &&
            p->epi == key->epi && p->opa == key->opa && p->opb == key->opb && p->m == key->m &&
            p->n == key->n && p->k == key->k && p->align == key->align) {
            *found = true;
            return p;
        }
    }
    *found = false;
    LtPlan *p = &hs->plans[hs->next_plan];
    hs->next_plan = (hs->next_plan + 1) % kLtPlans;
    return p;
}

/* D[m, n] = op(A) op(B), column-major and contiguous (leading dims: the
 * stored rows), beta 0, with epilogue epi on its vector (NULL: none) and,
 * for the *_AUX epilogues, aux: a second [m, n] output of D's type and
 * leading dim (the activation's input). *ran is false, with TP_OK and
 * nothing queued, when cuBLASLt has no algorithm for it. Sizes fit an int
 * (the caller checks). */
tp_status lt_gemm(Launch *L, tp_dtype dtype, cublasOperation_t opa, cublasOperation_t opb, int m,
                  int n, int k, const void *a, const void *b, void *d, cublasLtEpilogue_t epi,
                  const void *vec, void *aux, bool *ran)
{
    *ran = false;
    Handles *hs;
    tp_status st = get_handles(L, &hs);
    if (st != TP_OK)
        return st;
    if (!hs->lt[L->dev]) {
        cublasLtHandle_t h = NULL;
        cublasStatus_t s = cublasLtCreate(&h);
        if (s != CUBLAS_STATUS_SUCCESS)
            return cublas_fail(L->fn, "cublasLtCreate", s);
        hs->lt[L->dev] = h;
    }
    cublasLtHandle_t h = hs->lt[L->dev];
    LtPlan key;
    memset(&key, 0, sizeof key);
    key.dev = L->dev;
    key.dtype = dtype;
    key.ct =
        dtype == TP_F32 && tp_cuda_allow_tf32() ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    key.epi = epi;
    key.opa = opa;
    key.opb = opb;
    key.m = m;
    key.n = n;
    key.k = k;
    unsigned al_a = align_of(a), al_b = align_of(b), al_d = align_of(d);
    if (aux && align_of(aux) < al_d) /* the heuristic sees D's; aux's is never above it */
        al_d = align_of(aux);
    key.align = al_a | al_b << 9 | al_d << 18;
    bool found;
    LtPlan *plan = lt_plan(hs, &key, &found);
    if (found && plan->none)
        return TP_OK;

    cudaDataType_t t = cuda_type(dtype);
    int lda = opa == CUBLAS_OP_N ? m : k, ldb = opb == CUBLAS_OP_N ? k : n;
    cublasLtMatmulDesc_t desc = NULL;
    cublasLtMatrixLayout_t la = NULL, lb = NULL, ld = NULL;
    cublasLtMatmulPreference_t pref = NULL;
    const char *what = "cublasLtMatmulDescCreate";
    cublasStatus_t s = cublasLtMatmulDescCreate(&desc, key.ct, CUDA_R_32F);
    /* each step runs while the ones before it succeeded, and names itself */
#define LT_STEP(name, call)               \
    do {                                  \
        if (s == CUBLAS_STATUS_SUCCESS) { \
            what = name;                  \
            s = (call);                   \
        }                                 \
    } while (0)
    LT_STEP("cublasLtMatmulDescSetAttribute",
            cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa));
    LT_STEP("cublasLtMatmulDescSetAttribute",
            cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb));
    LT_STEP("cublasLtMatmulDescSetAttribute",
            cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi));
    if (vec) {
        LT_STEP("cublasLtMatmulDescSetAttribute",
                cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &vec,
                                               sizeof vec));
        LT_STEP("cublasLtMatmulDescSetAttribute",
                cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &t,
                                               sizeof t));
    }
    if (aux) {
        int64_t aux_ld = m;
        LT_STEP("cublasLtMatmulDescSetAttribute",
                cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                                               &aux, sizeof aux));
        LT_STEP("cublasLtMatmulDescSetAttribute",
                cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD,
                                               &aux_ld, sizeof aux_ld));
        LT_STEP("cublasLtMatmulDescSetAttribute",
                cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE,
                                               &t, sizeof t));
    }
    LT_STEP("cublasLtMatrixLayoutCreate",
            cublasLtMatrixLayoutCreate(&la, t, opa == CUBLAS_OP_N ? m : k,
                                       opa == CUBLAS_OP_N ? k : m, lda));
    LT_STEP("cublasLtMatrixLayoutCreate",
            cublasLtMatrixLayoutCreate(&lb, t, opb == CUBLAS_OP_N ? k : n,
                                       opb == CUBLAS_OP_N ? n : k, ldb));
    LT_STEP("cublasLtMatrixLayoutCreate", cublasLtMatrixLayoutCreate(&ld, t, m, n, m));
    if (!found) {
        /* the heuristic sees the operands' alignment, as PyTorch tells it */
        size_t ws = kLtWorkspace;
        uint32_t al[4] = {al_a, al_b, al_d, al_d};
        const cublasLtMatmulPreferenceAttributes_t which[4] = {
            CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
            CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
        LT_STEP("cublasLtMatmulPreferenceCreate", cublasLtMatmulPreferenceCreate(&pref));
        LT_STEP("cublasLtMatmulPreferenceSetAttribute",
                cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                     &ws, sizeof ws));
        for (int i = 0; i < 4; i++)
            LT_STEP("cublasLtMatmulPreferenceSetAttribute",
                    cublasLtMatmulPreferenceSetAttribute(pref, which[i], &al[i], sizeof al[i]));
        cublasLtMatmulHeuristicResult_t res;
        int got = 0;
        LT_STEP("cublasLtMatmulAlgoGetHeuristic",
                cublasLtMatmulAlgoGetHeuristic(h, desc, la, lb, ld, ld, pref, 1, &res, &got));
        if (s == CUBLAS_STATUS_SUCCESS || s == CUBLAS_STATUS_NOT_SUPPORTED) {
            *plan = key;
            plan->used = true;
            plan->none = s != CUBLAS_STATUS_SUCCESS || got < 1;
            if (!plan->none) {
                plan->algo = res.algo;
                plan->ws = res.workspaceSize;
            }
            s = CUBLAS_STATUS_SUCCESS;
        }
    }
    void *ws = NULL;
    if (s == CUBLAS_STATUS_SUCCESS && !plan->none) {
        if (plan->ws > 0)
            st = tp__cuda_scratch(L->fn, L->dev, L->s, plan->ws, &ws);
        if (st == TP_OK) {
            const float one = 1.0f, zero = 0.0f;
            LT_STEP("cublasLtMatmul", cublasLtMatmul(h, desc, &one, a, la, b, lb, &zero, d, ld, d,
                                                     ld, &plan->algo, ws, plan->ws, L->s));
            if (ws)
                tp__cuda_scratch_free(ws, L->s);
            *ran = s == CUBLAS_STATUS_SUCCESS;
            if (s == CUBLAS_STATUS_NOT_SUPPORTED) { /* nothing queued: run without it */
                plan->none = true;
                s = CUBLAS_STATUS_SUCCESS;
            }
        }
    }
#undef LT_STEP
    if (pref)
        (void)cublasLtMatmulPreferenceDestroy(pref);
    if (ld)
        (void)cublasLtMatrixLayoutDestroy(ld);
    if (lb)
        (void)cublasLtMatrixLayoutDestroy(lb);
    if (la)
        (void)cublasLtMatrixLayoutDestroy(la);
    if (desc)
        (void)cublasLtMatmulDescDestroy(desc);
    if (st != TP_OK)
        return st;
    return s == CUBLAS_STATUS_SUCCESS ? TP_OK : cublas_fail(L->fn, what, s);
}

/* Whether a linear's product with its bias may go to cuBLASLt: large
 * enough, within cuBLAS's int sizes, and the bias 16-byte aligned. */
bool lt_wanted(int64_t rows, int64_t in, int64_t out, const void *vec)
{
    return rows > 0 && in > 0 && out > 0 && rows * out >= kLtMinElems && rows <= INT_MAX &&
           in <= INT_MAX && out <= INT_MAX && (uintptr_t)vec % 16 == 0 && lt_enabled();
}

/* Same-shape operands and the row broadcast (b a contiguous row repeated
 * over a's rows) take the flat kernels; the rest the general one. */
template <class T, bool MUL>
tp_status binary_bcast_on(Launch *L, const T *a, const T *b, T *y, int64_t n, int ndim,
                          const int64_t *shape, const int64_t *as, const int64_t *bs)
{
    cudaStream_t s = L->s;
    unsigned grid = grid_for(n, kThreads);
    if (ndim == 1 && as[0] == 1 && bs[0] == 1) {
        if (MUL)
            k_mul<T><<<grid, kThreads, 0, s>>>(a, b, y, n);
        else
            k_add<T><<<grid, kThreads, 0, s>>>(a, b, y, n);
    } else if (ndim == 2 && as[0] == shape[1] && as[1] == 1 && bs[0] == 0 && bs[1] == 1) {
        k_binary_row_bcast<T, MUL><<<grid, kThreads, 0, s>>>(a, b, y, shape[0], shape[1]);
    } else {
        BcastGeom g;
        g.ndim = ndim;
        for (int d = 0; d < ndim; d++) {
            g.shape[d] = shape[d];
            g.sa[d] = as[d];
            g.sb[d] = bs[d];
        }
        k_binary_bcast<T, MUL><<<grid, kThreads, 0, s>>>(a, b, y, n, g);
    }
    return end(L);
}

template <bool MUL>
tp_status binary_bcast(const char *fn, tp__kop op, tp_dtype dtype, tp_device dev, const void *a,
                       const void *b, void *y, int ndim, const int64_t *shape, const int64_t *as,
                       const int64_t *bs)
{
    int64_t n = 1;
    for (int d = 0; d < ndim; d++)
        n *= shape[d];
    Launch L;
    tp_status st;
    if (!enter(fn, op, dtype, dev, n > 0, &L, &st))
        return st;
    return TYPED(dtype,
                 binary_bcast_on<T, MUL>(&L, cp<T>(a), cp<T>(b), mp<T>(y), n, ndim, shape, as, bs));
}

/* ---- the table's entries ------------------------------------------------------------ */

/* matrix products */

tp_status cuda_gemm(tp_device dev, tp_dtype dtype, bool trans_a, bool trans_b, int64_t m,
                    int64_t n, int64_t k, float alpha, const void *a, int64_t lda, const void *b,
                    int64_t ldb, float beta, void *c, int64_t ldc)
{
    Launch L;
    tp_status st;
    if (!enter("gemm (CUDA)", TP__KOP_GEMM, dtype, dev, true, &L, &st))
        return st;
    st = gemm_on(&L, dtype, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return st == TP_OK ? end(&L) : fail(&L, st);
}

template <class T>
tp_status bcast_row_on(cudaStream_t s, T *y, const T *b, int64_t rows, int64_t cols)
{
    unsigned gx = grid_for(cols, kThreads);
    int64_t gy = (kBusyBlocks * 4 + gx - 1) / gx; /* enough blocks; each thread a few rows */
    if (gy > rows)
        gy = rows;
    if (gy > kMaxGrid)
        gy = kMaxGrid;
    k_bcast_row<T><<<dim3(gx, (unsigned)(gy > 0 ? gy : 1)), kThreads, 0, s>>>(y, b, rows, cols);
    return TP_OK;
}

tp_status cuda_linear_fwd(tp_device dev, tp_dtype dtype, const void *x, const void *w,
                          const void *bias, void *y, int64_t rows, int64_t in, int64_t out)
{
    Launch L;
    tp_status st;
    if (!enter("linear (CUDA)", TP__KOP_LINEAR_FWD, dtype, dev, true, &L, &st))
        return st;
    if (bias && lt_wanted(rows, in, out, bias)) {
        /* column-major y^T[out, rows] = W x^T + bias */
        bool ran;
        st = lt_gemm(&L, dtype, CUBLAS_OP_T, CUBLAS_OP_N, (int)out, (int)rows, (int)in, w, x, y,
                     CUBLASLT_EPILOGUE_BIAS, bias, NULL, &ran);
        if (st != TP_OK || ran)
            return st == TP_OK ? end(&L) : fail(&L, st);
    }
    float beta = 0.0f;
    if (bias && rows > 0 && out > 0) {
        /* the bias first, then y = x W^T + y (cuBLAS may round a bf16/f16
         * product before it adds y: the epilogue above avoids that) */
        (void)TYPED(dtype, bcast_row_on<T>(L.s, mp<T>(y), cp<T>(bias), rows, out));
        beta = 1.0f;
    }
    st = gemm_on(&L, dtype, false, true, rows, out, in, 1.0f, x, in, w, in, beta, y, out);
    return st == TP_OK ? end(&L) : fail(&L, st);
}

/* g[c] (+)= sum_r y[r, c], or sum_r y[r, c] ((x[r, c] - mean[r]) rstd[r])
 * with x given (mean NULL: 0) */
template <class T>
tp_status colsum_on(Launch *L, const T *y, const T *x, const float *mean, const float *rstd, T *g,
                    int64_t rows, int64_t cols, bool accumulate, double div = 1.0)
{
    if (x)
        return launch_colsum<T, COL_NORM>(L, y, x, mean, rstd, g, rows, cols, accumulate, div);
    return launch_colsum<T, COL_PLAIN>(L, y, x, mean, rstd, g, rows, cols, accumulate, div);
}

tp_status cuda_linear_bwd(tp_device dev, tp_dtype dtype, const void *x, const void *w,
                          const void *gy, void *gx, void *gw, void *gb, int64_t rows, int64_t in,
                          int64_t out, bool accumulate)
{
    Launch L;
    tp_status st;
    if (!enter("linear backward (CUDA)", TP__KOP_LINEAR_BWD, dtype, dev, true, &L, &st))
        return st;
    float beta = accumulate ? 1.0f : 0.0f;
    if (gx) /* gx[rows, in] = gy[rows, out] W[out, in] */
        st = gemm_on(&L, dtype, false, false, rows, in, out, 1.0f, gy, out, w, in, beta, gx, in);
    if (st == TP_OK && gw) /* gw[out, in] = gy^T x */
        st = gemm_on(&L, dtype, true, false, out, in, rows, 1.0f, gy, out, x, in, beta, gw, in);
    if (st == TP_OK && gb)
        st = TYPED(dtype, colsum_on<T>(&L, cp<T>(gy), (const T *)NULL, NULL, NULL, mp<T>(gb), rows,
                                       out, accumulate));
    return st == TP_OK ? end(&L) : fail(&L, st);
}

/* The linear + GELU pair. Forward, tanh, bf16/f16: one cuBLASLt product whose epilogue
 * adds the bias, keeps the sum in aux and writes its GELU (computed on the
 * f32 accumulator) into y (without aux when no backward follows); that
 * epilogue's GELU is the tanh form, evaluated to the accuracy a 16-bit
 * output needs (not documented to f32's), so f32, erf,
 * a shape below kLtMinElems, an aux or bias not 16-byte aligned, an aux
 * leading dim (out) not a multiple of 8, or TP_CUDA_EPILOGUE=0 take the
 * linear forward into aux and the GELU kernel. Backward: gz = gy gelu'(aux)
 * and the bias gradient in one column pass (unfused under
 * TP_CUDA_EPILOGUE=0: the GELU backward kernel, then the column sum), then
 * the two products. */
tp_status cuda_gelu_fwd(tp_device dev, tp_dtype dtype, const void *x, void *y, int64_t n,
                        bool tanh_approx);
tp_status cuda_gelu_bwd(tp_device dev, tp_dtype dtype, const void *x, const void *gy, void *gx,
                        int64_t n, bool tanh_approx);

tp_status cuda_linear_gelu_fwd(tp_device dev, tp_dtype dtype, const void *x, const void *w,
                               const void *bias, void *y, void *aux, int64_t rows, int64_t in,
                               int64_t out, bool tanh_approx)
{
    if (tanh_approx && dtype != TP_F32 && lt_wanted(rows, in, out, bias) && out % 8 == 0 &&
        (uintptr_t)aux % 16 == 0) {
        /* without aux (no backward follows) the epilogue writes y alone */
        cublasLtEpilogue_t epi = aux ? (bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS
                                             : CUBLASLT_EPILOGUE_GELU_AUX)
                                     : (bias ? CUBLASLT_EPILOGUE_GELU_BIAS : CUBLASLT_EPILOGUE_GELU);
        Launch L;
        tp_status st;
        if (!enter("linear + gelu (CUDA)", TP__KOP_LINEAR_GELU_FWD, dtype, dev, true, &L, &st))
            return st;
        bool ran;
        st = lt_gemm(&L, dtype, CUBLAS_OP_T, CUBLAS_OP_N, (int)out, (int)rows, (int)in, w, x, y,
                     epi, bias, aux, &ran);
        if (st != TP_OK || ran)
            return st == TP_OK ? end(&L) : fail(&L, st);
        (void)end(&L);
    }
    if (!cuda_supports(TP__KOP_LINEAR_GELU_FWD, dtype))
        return tp__kernels_unsupported(tp__kernels_cuda, TP__KOP_LINEAR_GELU_FWD, dtype);
    void *pre = aux ? aux : y; /* the GELU may run in place */
    TP_CHECK(cuda_linear_fwd(dev, dtype, x, w, bias, pre, rows, in, out));
    return cuda_gelu_fwd(dev, dtype, pre, y, rows * out, tanh_approx);
}

/* gz[rows, cols] = gy gelu'(aux) and, when gb is non-NULL, gb = its column
 * sums: one column pass (the GELU backward kernel, then the column sum,
 * under TP_CUDA_EPILOGUE=0). gz may be gy (each element is read, then
 * written, by one thread). fn, op: the entry's, for its messages. */
tp_status dgelu_bgrad(const char *fn, tp__kop op, tp_device dev, tp_dtype dtype, const void *gy,
                      const void *aux, void *gz, void *gb, int64_t rows, int64_t cols,
                      bool tanh_approx)
{
    if (!gb || !lt_enabled() || rows <= 0 || cols <= 0) {
        TP_CHECK(cuda_gelu_bwd(dev, dtype, aux, gy, gz, rows * cols, tanh_approx));
        return gb ? cuda_linear_bwd(dev, dtype, NULL, NULL, gz, NULL, NULL, gb, rows, 0, cols,
                                    false)
                  : TP_OK;
    }
    Launch L;
    tp_status st;
    if (!enter(fn, op, dtype, dev, true, &L, &st))
        return st;
    st = tanh_approx ? TYPED(dtype, (launch_colsum<T, COL_DGELU_TANH>(
                                        &L, cp<T>(gy), cp<T>(aux), NULL, NULL, mp<T>(gb), rows,
                                        cols, false, 1.0, mp<T>(gz))))
                     : TYPED(dtype, (launch_colsum<T, COL_DGELU_ERF>(
                                        &L, cp<T>(gy), cp<T>(aux), NULL, NULL, mp<T>(gb), rows,
                                        cols, false, 1.0, mp<T>(gz))));
    return st == TP_OK ? end(&L) : fail(&L, st);
}

tp_status cuda_linear_gelu_bwd(tp_device dev, tp_dtype dtype, const void *x, const void *w,
                               const void *aux, const void *gy, void *gz, void *gx, void *gw,
                               void *gb, int64_t rows, int64_t in, int64_t out, bool tanh_approx)
{
    if (!cuda_supports(TP__KOP_LINEAR_GELU_BWD, dtype))
        return tp__kernels_unsupported(tp__kernels_cuda, TP__KOP_LINEAR_GELU_BWD, dtype);
    TP_CHECK(dgelu_bgrad("linear + gelu backward (CUDA)", TP__KOP_LINEAR_GELU_BWD, dev, dtype, gy,
                         aux, gz, gb, rows, out, tanh_approx));
    return cuda_linear_bwd(dev, dtype, x, w, gz, gx, gw, NULL, rows, in, out, false);
}

/* A linear's backward whose input came out of a GELU. bf16/f16, tanh: gz =
 * (gy W) gelu'(aux) and its column sums from one cuBLASLt product
 * (DGELU_BGRAD; DGELU without the sums), under the conditions of the
 * forward's epilogue (kLtMinElems, in a multiple of 8, 16-byte aligned
 * buffers, TP_CUDA_EPILOGUE); else the product into gz and dgelu_bgrad
 * over it in place. The linear's gw and gb as linear_bwd's. */
tp_status cuda_linear_bwd_dgelu(tp_device dev, tp_dtype dtype, const void *x, const void *w,
                                const void *gy, const void *aux, void *gz, void *gb_act, void *gw,
                                void *gb, int64_t rows, int64_t in, int64_t out, bool tanh_approx)
{
    if (!cuda_supports(TP__KOP_LINEAR_BWD_DGELU, dtype))
        return tp__kernels_unsupported(tp__kernels_cuda, TP__KOP_LINEAR_BWD_DGELU, dtype);
    bool done = false;
    if (tanh_approx && dtype != TP_F32 && lt_wanted(rows, out, in, gb_act) && in % 8 == 0 &&
        (uintptr_t)aux % 16 == 0 && (uintptr_t)gz % 16 == 0) {
        Launch L;
        tp_status st;
        if (!enter("linear backward + gelu (CUDA)", TP__KOP_LINEAR_BWD_DGELU, dtype, dev, true, &L,
                   &st))
            return st;
        /* column-major gz^T[in, rows] = W^T-as-stored[in, out] gy^T[out, rows] */
        st = lt_gemm(&L, dtype, CUBLAS_OP_N, CUBLAS_OP_N, (int)in, (int)rows, (int)out, w, gy, gz,
                     gb_act ? CUBLASLT_EPILOGUE_DGELU_BGRAD : CUBLASLT_EPILOGUE_DGELU, gb_act,
                     (void *)aux, &done);
        st = st == TP_OK ? end(&L) : fail(&L, st);
        if (st != TP_OK)
            return st;
    }
    if (!done) {
        TP_CHECK(cuda_linear_bwd(dev, dtype, NULL, w, gy, gz, NULL, NULL, rows, in, out, false));
        TP_CHECK(dgelu_bgrad("linear backward + gelu (CUDA)", TP__KOP_LINEAR_BWD_DGELU, dev, dtype,
                             gz, aux, gz, gb_act, rows, in, tanh_approx));
    }
    if (!gw && !gb)
        return TP_OK;
    return cuda_linear_bwd(dev, dtype, x, NULL, gy, NULL, gw, gb, rows, in, out, false);
}

/* elementwise */

tp_status cuda_copy(tp_device dev, tp_dtype dtype, void *dst, const void *src, int64_t n)
{
    Launch L;
    tp_status st;
    if (!enter("copy (CUDA)", TP__KOP_COPY, dtype, dev, n > 0 && dst != src, &L, &st))
        return st;
    cudaError_t err =
        cudaMemcpyAsync(dst, src, (size_t)n * tp_dtype_size(dtype), cudaMemcpyDeviceToDevice, L.s);
    if (err != cudaSuccess)
        return fail(&L, tp__cuda_fail(L.fn, "cudaMemcpyAsync", err));
    return end(&L);
}

tp_status cuda_fill(tp_device dev, tp_dtype dtype, void *y, float value, int64_t n)
{
    return TYPED(dtype, launch("fill (CUDA)", TP__KOP_FILL, dtype, dev, n, false, k_fill<T>,
                               mp<T>(y), value, n));
}

tp_status cuda_add(tp_device dev, tp_dtype dtype, const void *a, const void *b, void *y,
                   int64_t n)
{
    return TYPED(dtype, launch("add (CUDA)", TP__KOP_ADD, dtype, dev, n, false, k_add<T>, cp<T>(a),
                               cp<T>(b), mp<T>(y), n));
}

tp_status cuda_mul(tp_device dev, tp_dtype dtype, const void *a, const void *b, void *y,
                   int64_t n)
{
    return TYPED(dtype, launch("mul (CUDA)", TP__KOP_MUL, dtype, dev, n, false, k_mul<T>, cp<T>(a),
                               cp<T>(b), mp<T>(y), n));
}

tp_status cuda_scale(tp_device dev, tp_dtype dtype, const void *a, float s, void *y, int64_t n)
{
    return TYPED(dtype, launch("scale (CUDA)", TP__KOP_SCALE, dtype, dev, n, false, k_scale<T>,
                               cp<T>(a), s, mp<T>(y), n));
}

tp_status cuda_accumulate(tp_device dev, tp_dtype dtype, void *y, const void *a, int64_t n)
{
    return TYPED(dtype, launch("accumulate (CUDA)", TP__KOP_ACCUMULATE, dtype, dev, n, false,
                               k_accumulate<T>, mp<T>(y), cp<T>(a), n));
}

tp_status cuda_add_bcast(tp_device dev, tp_dtype dtype, const void *a, const void *b, void *y,
                         int ndim, const int64_t *shape, const int64_t *astride,
                         const int64_t *bstride)
{
    return binary_bcast<false>("add (CUDA)", TP__KOP_ADD_BCAST, dtype, dev, a, b, y, ndim, shape,
                               astride, bstride);
}

tp_status cuda_mul_bcast(tp_device dev, tp_dtype dtype, const void *a, const void *b, void *y,
                         int ndim, const int64_t *shape, const int64_t *astride,
                         const int64_t *bstride)
{
    return binary_bcast<true>("mul (CUDA)", TP__KOP_MUL_BCAST, dtype, dev, a, b, y, ndim, shape,
                              astride, bstride);
}

tp_status cuda_gather(tp_device dev, tp_dtype dtype, void *y, const void *x, int ndim,
                      const int64_t *shape, const int64_t *stride)
{
    int64_t n = 1;
    GatherGeom geo;
    geo.ndim = ndim;
    for (int d = 0; d < ndim; d++) {
        geo.shape[d] = shape[d];
        geo.stride[d] = stride[d];
        n *= shape[d];
    }
    return TYPED(dtype, launch("transpose (CUDA)", TP__KOP_GATHER, dtype, dev, n, false,
                               k_gather<T>, mp<T>(y), cp<T>(x), n, geo));
}

tp_status cuda_relu_fwd(tp_device dev, tp_dtype dtype, const void *x, void *y, int64_t n)
{
    return TYPED(dtype, launch("relu (CUDA)", TP__KOP_RELU_FWD, dtype, dev, n, false, k_relu_fwd<T>,
                               cp<T>(x), mp<T>(y), n));
}

tp_status cuda_relu_bwd(tp_device dev, tp_dtype dtype, const void *x, const void *gy, void *gx,
                        int64_t n)
{
    return TYPED(dtype, launch("relu backward (CUDA)", TP__KOP_RELU_BWD, dtype, dev, n, false,
                               k_relu_bwd<T>, cp<T>(x), cp<T>(gy), mp<T>(gx), n));
}

tp_status cuda_gelu_fwd(tp_device dev, tp_dtype dtype, const void *x, void *y, int64_t n,
                        bool tanh_approx)
{
    if (vec_ok(x, y))
        return TYPED(dtype, launch("gelu (CUDA)", TP__KOP_GELU_FWD, dtype, dev,
                                   n > 0 ? n / Pack<T>::N + 1 : 0, false, k_gelu_fwd_vec<T>,
                                   cp<T>(x), mp<T>(y), n, tanh_approx));
    return TYPED(dtype, launch("gelu (CUDA)", TP__KOP_GELU_FWD, dtype, dev, n, false, k_gelu_fwd<T>,
                               cp<T>(x), mp<T>(y), n, tanh_approx));
}

tp_status cuda_gelu_bwd(tp_device dev, tp_dtype dtype, const void *x, const void *gy, void *gx,
                        int64_t n, bool tanh_approx)
{
    if (vec_ok(x, gy, gx))
        return TYPED(dtype, launch("gelu backward (CUDA)", TP__KOP_GELU_BWD, dtype, dev,
                                   n > 0 ? n / Pack<T>::N + 1 : 0, false, k_gelu_bwd_vec<T>,
                                   cp<T>(x), cp<T>(gy), mp<T>(gx), n, tanh_approx));
    return TYPED(dtype, launch("gelu backward (CUDA)", TP__KOP_GELU_BWD, dtype, dev, n, false,
                               k_gelu_bwd<T>, cp<T>(x), cp<T>(gy), mp<T>(gx), n, tanh_approx));
}

/* reductions */

template <class T>
tp_status sum_dim_on(Launch *L, const T *x, T *y, int64_t outer, int64_t size, int64_t inner,
                     double div)
{
    if (inner == 1) /* rows: a block each */
        k_sum_rowwise<T><<<grid_rows(outer), kThreads, 0, L->s>>>(x, y, outer, size, div);
    else if (outer == 1) { /* columns of a [size, inner] matrix: 8 row lanes per column */
        tp_status st = colsum_on<T>(L, x, NULL, NULL, NULL, y, size, inner, false, div);
        if (st != TP_OK)
            return fail(L, st);
    } else
        k_sum_strided<T><<<grid_for(outer * inner, kThreads), kThreads, 0, L->s>>>(
            x, y, outer, size, inner, div);
    return end(L);
}

tp_status cuda_sum_dim(tp_device dev, tp_dtype dtype, const void *x, void *y, int64_t outer,
                       int64_t size, int64_t inner, double div)
{
    Launch L;
    tp_status st;
    if (!enter("sum (CUDA)", TP__KOP_SUM_DIM, dtype, dev, outer > 0 && inner > 0, &L, &st))
        return st;
    return TYPED(dtype, sum_dim_on<T>(&L, cp<T>(x), mp<T>(y), outer, size, inner, div));
}

tp_status cuda_sum_dim_bwd(tp_device dev, tp_dtype dtype, const void *gy, void *gx, int64_t outer,
                           int64_t size, int64_t inner, float scale)
{
    if (outer == 1 && inner == 1 && vec_ok(gx, gx)) /* no index arithmetic; 16-byte stores */
        return TYPED(dtype, launch("sum backward (CUDA)", TP__KOP_SUM_DIM_BWD, dtype, dev,
                                   size > 0 ? size / Pack<T>::N + 1 : 0, false,
                                   k_sum_all_bwd_vec<T>, cp<T>(gy), mp<T>(gx), size, scale));
    return TYPED(dtype, launch("sum backward (CUDA)", TP__KOP_SUM_DIM_BWD, dtype, dev,
                               outer * size * inner, false, k_sum_dim_bwd<T>, cp<T>(gy), mp<T>(gx),
                               outer, size, inner, scale));
}

tp_status cuda_sum_bcast(tp_device dev, tp_dtype dtype, const void *x, void *y, int ndim,
                         const int64_t *shape, const int64_t *yshape)
{
    if (!cuda_supports(TP__KOP_SUM_BCAST, dtype))
        return tp__kernels_unsupported(tp__kernels_cuda, TP__KOP_SUM_BCAST, dtype);
    int64_t yn = 1, rn = 1, xs[TP_MAX_DIMS], stride = 1;
    for (int d = ndim - 1; d >= 0; d--) {
        xs[d] = stride;
        stride *= shape[d];
        yn *= yshape[d];
    }
    if (yn <= 0)
        return TP_OK;
    /* kept and summed dims in order (size-1 dims index nothing); `runs`
     * counts the blocks of consecutive summed dims */
    SumGeom g;
    g.nk = g.nr = 0;
    int runs = 0, first = -1, last = -1;
    bool prev_summed = false;
    for (int d = 0; d < ndim; d++) {
        if (shape[d] == 1)
            continue;
        bool summed = yshape[d] != shape[d];
        if (summed) {
            g.rshape[g.nr] = shape[d];
            g.rst[g.nr++] = xs[d];
            rn *= shape[d];
            runs += !prev_summed;
            first = first < 0 ? d : first;
            last = d;
        } else {
            g.kshape[g.nk] = shape[d];
            g.kst[g.nk++] = xs[d];
        }
        prev_summed = summed;
    }
    if (g.nr == 0)
        return cuda_copy(dev, dtype, y, x, yn);
    if (runs == 1) {
        /* x viewed as [outer, size, inner] around the one summed block */
        int64_t outer = 1, inner = 1;
        for (int d = 0; d < first; d++)
            outer *= shape[d];
        for (int d = last + 1; d < ndim; d++)
            inner *= shape[d];
        return cuda_sum_dim(dev, dtype, x, y, outer, rn, inner, 1.0);
    }
    return TYPED(dtype, launch("sum (CUDA)", TP__KOP_SUM_BCAST, dtype, dev, yn, false,
                               k_sum_bcast<T>, cp<T>(x), mp<T>(y), yn, rn, g));
}

/* Up to kSumOneBlock elements one block adds alone; more are split over up
 * to kBusyBlocks blocks (their count a function of n alone: deterministic)
 * whose partial sums one block then adds. */
const int64_t kSumOneBlock = 1 << 16;

template <class T> tp_status sum_all_on(Launch *L, const T *x, int64_t n, T *y, double div)
{
    if (n <= kSumOneBlock) {
        k_sum_all<T><<<1, 1024, 0, L->s>>>(x, n < 0 ? 0 : n, y, div);
        return end(L);
    }
    int64_t nb = (n + 8 * kThreads - 1) / (8 * kThreads); /* at least 8 elements a thread */
    if (nb > kBusyBlocks)
        nb = kBusyBlocks;
    void *part = NULL;
    tp_status st = tp__cuda_scratch(L->fn, L->dev, L->s, (size_t)nb * sizeof(double), &part);
    if (st != TP_OK)
        return fail(L, st);
    k_sum_part<T><<<(unsigned)nb, kThreads, 0, L->s>>>(x, n, (double *)part);
    k_sum_parts<T><<<1, 1024, 0, L->s>>>((const double *)part, (int)nb, y, div);
    tp__cuda_scratch_free(part, L->s);
    return end(L);
}

tp_status cuda_sum_all(tp_device dev, tp_dtype dtype, const void *x, int64_t n, void *y,
                       double div)
{
    Launch L;
    tp_status st;
    if (!enter("sum (CUDA)", TP__KOP_SUM_ALL, dtype, dev, true, &L, &st))
        return st;
    return TYPED(dtype, sum_all_on<T>(&L, cp<T>(x), n, mp<T>(y), div));
}

tp_status cuda_softmax_fwd(tp_device dev, tp_dtype dtype, const void *x, void *y, int64_t rows,
                           int64_t cols)
{
    return TYPED(dtype, launch("softmax (CUDA)", TP__KOP_SOFTMAX_FWD, dtype, dev, rows, true,
                               k_softmax_fwd<T>, cp<T>(x), mp<T>(y), rows, cols));
}

tp_status cuda_softmax_bwd(tp_device dev, tp_dtype dtype, const void *y, const void *gy, void *gx,
                           int64_t rows, int64_t cols)
{
    return TYPED(dtype, launch("softmax backward (CUDA)", TP__KOP_SOFTMAX_BWD, dtype, dev, rows,
                               true, k_softmax_bwd<T>, cp<T>(y), cp<T>(gy), mp<T>(gx), rows, cols));
}

tp_status cuda_causal_mask(tp_device dev, tp_dtype dtype, void *s, int64_t batch, int64_t S)
{
    return TYPED(dtype, launch("causal mask (CUDA)", TP__KOP_CAUSAL_MASK, dtype, dev, batch * S * S,
                               false, k_causal_mask<T>, mp<T>(s), batch, S));
}

template <class T>
tp_status transpose_on(Launch *L, const T *x, T *y, int64_t batch, int64_t r, int64_t c)
{
    int64_t gx = (c + 31) / 32, gy = (r + 31) / 32;
    dim3 grid((unsigned)(gx < kMaxGrid ? gx : kMaxGrid), (unsigned)(gy < kMaxGrid ? gy : kMaxGrid),
              (unsigned)(batch < kMaxGrid ? batch : kMaxGrid));
    k_transpose<T><<<grid, dim3(32, 8), 0, L->s>>>(x, y, batch, r, c);
    return end(L);
}

tp_status cuda_transpose_last2(tp_device dev, tp_dtype dtype, const void *x, void *y,
                               int64_t batch, int64_t r, int64_t c)
{
    Launch L;
    tp_status st;
    if (!enter("transpose (CUDA)", TP__KOP_TRANSPOSE_LAST2, dtype, dev,
               batch > 0 && r > 0 && c > 0, &L, &st))
        return st;
    return TYPED(dtype, transpose_on<T>(&L, cp<T>(x), mp<T>(y), batch, r, c));
}

/* embedding, norms, dropout */

tp_status cuda_embedding_fwd(tp_device dev, tp_dtype dtype, const int64_t *idx, int64_t n,
                             const void *w, int64_t rows_local, int64_t dim, int64_t offset,
                             void *y)
{
    return TYPED(dtype,
                 launch("embedding (CUDA)", TP__KOP_EMBEDDING_FWD, dtype, dev, n * dim, false,
                        k_embedding_fwd<T>, idx, n, cp<T>(w), rows_local, dim, offset, mp<T>(y)));
}

tp_status cuda_embedding_bwd(tp_device dev, tp_dtype dtype, const int64_t *idx, int64_t n,
                             const void *gy, int64_t rows_local, int64_t dim, int64_t offset,
                             void *gw)
{
    return TYPED(dtype, launch("embedding backward (CUDA)", TP__KOP_EMBEDDING_BWD, dtype, dev,
                               n * dim, false, k_embedding_bwd<T>, idx, n, cp<T>(gy), rows_local,
                               dim, offset, mp<T>(gw)));
}

tp_status cuda_layer_norm_fwd(tp_device dev, tp_dtype dtype, const void *x, const void *w,
                              const void *b, void *y, float *mean, float *rstd, int64_t rows,
                              int64_t cols, float eps)
{
    return TYPED(dtype, launch("layer_norm (CUDA)", TP__KOP_LAYER_NORM_FWD, dtype, dev, rows, true,
                               k_layer_norm_fwd<T>, cp<T>(x), cp<T>(w), cp<T>(b), mp<T>(y), mean,
                               rstd, rows, cols, eps));
}

/* The norms' backward: gx, then the weight gradient (+=) and, for the
 * layer norm, the bias gradient (+=). mean NULL: the RMS norm. */
template <class T>
tp_status norm_bwd_on(Launch *L, const T *x, const T *w, const float *mean, const float *rstd,
                      const T *gy, T *gx, T *gw, T *gb, int64_t rows, int64_t cols)
{
    unsigned grid = grid_rows(rows);
    if (mean)
        k_layer_norm_bwd_x<T><<<grid, kThreads, 0, L->s>>>(x, w, mean, rstd, gy, gx, rows, cols);
    else
        k_rms_norm_bwd_x<T><<<grid, kThreads, 0, L->s>>>(x, w, rstd, gy, gx, rows, cols);
    tp_status st = TP_OK;
    if (gw)
        st = colsum_on<T>(L, gy, x, mean, rstd, gw, rows, cols, true);
    if (st == TP_OK && gb)
        st = colsum_on<T>(L, gy, NULL, NULL, NULL, gb, rows, cols, true);
    return st == TP_OK ? end(L) : fail(L, st);
}

tp_status cuda_layer_norm_bwd(tp_device dev, tp_dtype dtype, const void *x, const void *w,
                              const float *mean, const float *rstd, const void *gy, void *gx,
                              void *gw, void *gb, int64_t rows, int64_t cols)
{
    Launch L;
    tp_status st;
    if (!enter("layer_norm backward (CUDA)", TP__KOP_LAYER_NORM_BWD, dtype, dev,
               rows > 0 && cols > 0, &L, &st))
        return st;
    return TYPED(dtype, norm_bwd_on<T>(&L, cp<T>(x), cp<T>(w), mean, rstd, cp<T>(gy), mp<T>(gx),
                                       mp<T>(gw), mp<T>(gb), rows, cols));
}

tp_status cuda_rms_norm_fwd(tp_device dev, tp_dtype dtype, const void *x, const void *w, void *y,
                            float *rstd, int64_t rows, int64_t cols, float eps)
{
    return TYPED(dtype,
                 launch("rms_norm (CUDA)", TP__KOP_RMS_NORM_FWD, dtype, dev, rows, true,
                        k_rms_norm_fwd<T>, cp<T>(x), cp<T>(w), mp<T>(y), rstd, rows, cols, eps));
}

tp_status cuda_rms_norm_bwd(tp_device dev, tp_dtype dtype, const void *x, const void *w,
                            const float *rstd, const void *gy, void *gx, void *gw, int64_t rows,
                            int64_t cols)
{
    Launch L;
    tp_status st;
    if (!enter("rms_norm backward (CUDA)", TP__KOP_RMS_NORM_BWD, dtype, dev, rows > 0 && cols > 0,
               &L, &st))
        return st;
    return TYPED(dtype, norm_bwd_on<T>(&L, cp<T>(x), cp<T>(w), NULL, rstd, cp<T>(gy), mp<T>(gx),
                                       mp<T>(gw), (T *)NULL, rows, cols));
}

template <class T>
tp_status dropout_on(Launch *L, const T *x, T *y, uint8_t *mask, int64_t n, const DropGeom &geo,
                     float p, uint64_t seed)
{
    unsigned grid = grid_for(n, kThreads);
    if (p <= 0.0f) {
        if (y != x) {
            cudaError_t err =
                cudaMemcpyAsync(y, x, (size_t)n * sizeof(T), cudaMemcpyDeviceToDevice, L->s);
            if (err != cudaSuccess)
                return fail(L, tp__cuda_fail(L->fn, "cudaMemcpyAsync", err));
        }
        if (mask)
            k_fill_u8<<<grid, kThreads, 0, L->s>>>(mask, 1, n);
        return end(L);
    }
    if (p >= 1.0f) {
        k_fill<T><<<grid, kThreads, 0, L->s>>>(y, 0.0f, n);
        if (mask)
            k_fill_u8<<<grid, kThreads, 0, L->s>>>(mask, 0, n);
        return end(L);
    }
    float scale = 1.0f / (1.0f - p);
    k_dropout_fwd<T><<<grid, kThreads, 0, L->s>>>(x, y, mask, n, geo, (double)p, scale, seed);
    return end(L);
}

tp_status cuda_dropout_fwd(tp_device dev, tp_dtype dtype, const void *x, void *y, uint8_t *mask,
                           int ndim, const int64_t *shape, const int64_t *global_shape,
                           const int64_t *offset, float p, uint64_t seed)
{
    int64_t n = 1;
    for (int d = 0; d < ndim; d++)
        n *= shape[d];
    Launch L;
    tp_status st;
    if (!enter("dropout (CUDA)", TP__KOP_DROPOUT_FWD, dtype, dev, n > 0, &L, &st))
        return st;
    DropGeom geo;
    geo.ndim = ndim;
    geo.g0 = 0;
    uint64_t s = 1;
    for (int d = ndim - 1; d >= 0; d--) {
        geo.shape[d] = shape[d];
        geo.gstride[d] = s;
        s *= (uint64_t)(global_shape ? global_shape[d] : shape[d]);
    }
    for (int d = 0; d < ndim; d++)
        geo.g0 += (uint64_t)(offset ? offset[d] : 0) * geo.gstride[d];
    return TYPED(dtype, dropout_on<T>(&L, cp<T>(x), mp<T>(y), mask, n, geo, p, seed));
}

tp_status cuda_dropout_bwd(tp_device dev, tp_dtype dtype, const void *gy, const uint8_t *mask,
                           void *gx, int64_t n, float p)
{
    if (!cuda_supports(TP__KOP_DROPOUT_BWD, dtype))
        return tp__kernels_unsupported(tp__kernels_cuda, TP__KOP_DROPOUT_BWD, dtype);
    if (p <= 0.0f)
        return cuda_copy(dev, dtype, gx, gy, n);
    if (p >= 1.0f)
        return cuda_fill(dev, dtype, gx, 0.0f, n);
    return TYPED(dtype, launch("dropout backward (CUDA)", TP__KOP_DROPOUT_BWD, dtype, dev, n, false,
                               k_dropout_bwd<T>, cp<T>(gy), mask, mp<T>(gx), n, 1.0f / (1.0f - p)));
}

/* cross entropy */

tp_status cuda_cross_entropy_fwd(tp_device dev, tp_dtype dtype, const void *x,
                                 const int64_t *target, const void *weight, void *loss,
                                 int64_t rows, int64_t classes, int64_t inner,
                                 int64_t ignore_index)
{
    return TYPED(dtype, launch("cross_entropy (CUDA)", TP__KOP_CROSS_ENTROPY_FWD, dtype, dev, rows,
                               true, k_ce_fwd<T>, cp<T>(x), target, cp<T>(weight), mp<T>(loss),
                               rows, classes, inner, ignore_index));
}

tp_status cuda_cross_entropy_bwd(tp_device dev, tp_dtype dtype, const void *x,
                                 const int64_t *target, const void *weight, const void *gloss,
                                 void *gx, int64_t rows, int64_t classes, int64_t inner,
                                 int64_t ignore_index)
{
    return TYPED(dtype, launch("cross_entropy backward (CUDA)", TP__KOP_CROSS_ENTROPY_BWD, dtype,
                               dev, rows, true, k_ce_bwd<T>, cp<T>(x), target, cp<T>(weight),
                               cp<T>(gloss), mp<T>(gx), rows, classes, inner, ignore_index));
}

tp_status cuda_ce_gloss(tp_device dev, tp_dtype dtype, const void *g, void *gl, int64_t rows,
                        bool broadcast, double div)
{
    return TYPED(dtype, launch("cross_entropy backward (CUDA)", TP__KOP_CE_GLOSS, dtype, dev, rows,
                               false, k_ce_gloss<T>, cp<T>(g), mp<T>(gl), rows, broadcast, div));
}

tp_status cuda_row_max(tp_device dev, tp_dtype dtype, const void *x, float *mx, int64_t rows,
                       int64_t cols, int64_t inner)
{
    return TYPED(dtype, launch("cross_entropy (CUDA)", TP__KOP_ROW_MAX, dtype, dev, rows, true,
                               k_row_max<T>, cp<T>(x), mx, rows, cols, inner));
}

tp_status cuda_row_sumexp(tp_device dev, tp_dtype dtype, const void *x, const float *mx, float *s,
                          int64_t rows, int64_t cols, int64_t inner)
{
    return TYPED(dtype, launch("cross_entropy (CUDA)", TP__KOP_ROW_SUMEXP, dtype, dev, rows, true,
                               k_row_sumexp<T>, cp<T>(x), mx, s, rows, cols, inner));
}

tp_status cuda_pick_target(tp_device dev, tp_dtype dtype, const void *x, const int64_t *target,
                           float *picked, int64_t rows, int64_t cols, int64_t inner,
                           int64_t offset, int64_t ignore_index)
{
    return TYPED(dtype, launch("cross_entropy (CUDA)", TP__KOP_PICK_TARGET, dtype, dev, rows, false,
                               k_pick_target<T>, cp<T>(x), target, picked, rows, cols, inner,
                               offset, ignore_index));
}

tp_status cuda_vocab_ce_loss(tp_device dev, tp_dtype dtype, const int64_t *target,
                             const void *weight, const float *mx, const float *sumexp,
                             const float *picked, void *loss, int64_t rows, int64_t ignore_index)
{
    return TYPED(dtype, launch("cross_entropy (CUDA)", TP__KOP_VOCAB_CE_LOSS, dtype, dev, rows,
                               false, k_vocab_ce_loss<T>, target, cp<T>(weight), mx, sumexp, picked,
                               mp<T>(loss), rows, ignore_index));
}

tp_status cuda_vocab_ce_bwd(tp_device dev, tp_dtype dtype, const void *x, const int64_t *target,
                            const void *weight, const float *mx, const float *sumexp,
                            const void *gloss, void *gx, int64_t rows, int64_t cols,
                            int64_t inner, int64_t offset, int64_t ignore_index)
{
    return TYPED(dtype,
                 launch("cross_entropy backward (CUDA)", TP__KOP_VOCAB_CE_BWD, dtype, dev, rows,
                        true, k_vocab_ce_bwd<T>, cp<T>(x), target, cp<T>(weight), mx, sumexp,
                        cp<T>(gloss), mp<T>(gx), rows, cols, inner, offset, ignore_index));
}

/* optimizers */

tp_status cuda_sgd_step(tp_device dev, tp_dtype dtype, void *p, const void *g, int64_t n,
                        double lr)
{
    return TYPED(dtype, launch("tp_sgd_step (CUDA)", TP__KOP_SGD_STEP, dtype, dev, n, false,
                               k_sgd<T>, mp<T>(p), cp<T>(g), n, lr));
}

tp_status cuda_adam_step(tp_device dev, tp_dtype dtype, void *p, float *m, float *v,
                         const void *g, int64_t n, double beta1, double beta2, double step_size,
                         double bc2_sqrt, double eps)
{
    return TYPED(dtype,
                 launch("tp_adam_step (CUDA)", TP__KOP_ADAM_STEP, dtype, dev, n, false, k_adam<T>,
                        mp<T>(p), m, v, cp<T>(g), n, beta1, beta2, step_size, bc2_sqrt, eps));
}

/* ---- SiLU and SwiGLU ------------------------------------------------------------
 * The CPU engine's formulas (cpu.c): v clamped to [-104, 104], e = exp(-|v|),
 * sigmoid and 1 - sigmoid as 1 / (1 + e) and e / (1 + e) by the sign of v (no
 * overflow, no cancellation), silu -0 below -104. The gradient of the gate is
 * gy up sig (1 + v (1 - sig)), of up gy silu(gate). */

__device__ __forceinline__ float silu_clamp(float v)
{
    return v < -104.0f ? -104.0f : (v > 104.0f ? 104.0f : v); /* NaN stays NaN */
}

/* sigmoid(vc) into s, 1 - sigmoid(vc) into om, for a clamped vc */
__device__ __forceinline__ void sigmoid2(float vc, float &s, float &om)
{
    float e = expf(-fabsf(vc));
    float d = 1.0f / (1.0f + e);
    float de = e * d;
    bool pos = vc >= 0.0f;
    s = pos ? d : de;
    om = pos ? de : d;
}

__device__ __forceinline__ float silu_f(float v)
{
    float s, om;
    sigmoid2(silu_clamp(v), s, om);
    return v < -104.0f ? -0.0f : v * s;
}

/* d silu / dv */
__device__ __forceinline__ float silu_d(float v)
{
    float vc = silu_clamp(v), s, om;
    sigmoid2(vc, s, om);
    return s * (1.0f + vc * om);
}

template <class T> __global__ void k_silu_fwd(const T *x, T *y, int64_t n)
{
    GRID_STRIDE(i, n) y[i] = stf<T>(silu_f(ldf(x[i])));
}

template <class T> __global__ void k_silu_fwd_vec(const T *x, T *y, int64_t n)
{
    const int N = Pack<T>::N;
    int64_t packs = n / N;
    GRID_STRIDE(i, packs)
    {
        Pack<T> a = reinterpret_cast<const Pack<T> *>(x)[i], o;
#pragma unroll
        for (int k = 0; k < N; k++)
            o.v[k] = stf<T>(silu_f(ldf(a.v[k])));
        reinterpret_cast<Pack<T> *>(y)[i] = o;
    }
    TAIL_STRIDE(i, packs * N, n) y[i] = stf<T>(silu_f(ldf(x[i])));
}

template <class T> __global__ void k_silu_bwd(const T *x, const T *gy, T *gx, int64_t n)
{
    GRID_STRIDE(i, n) gx[i] = stf<T>(ldf(gy[i]) * silu_d(ldf(x[i])));
}

template <class T> __global__ void k_silu_bwd_vec(const T *x, const T *gy, T *gx, int64_t n)
{
    const int N = Pack<T>::N;
    int64_t packs = n / N;
    GRID_STRIDE(i, packs)
    {
        Pack<T> a = reinterpret_cast<const Pack<T> *>(x)[i];
        Pack<T> g = reinterpret_cast<const Pack<T> *>(gy)[i], o;
#pragma unroll
        for (int k = 0; k < N; k++)
            o.v[k] = stf<T>(ldf(g.v[k]) * silu_d(ldf(a.v[k])));
        reinterpret_cast<Pack<T> *>(gx)[i] = o;
    }
    TAIL_STRIDE(i, packs * N, n) gx[i] = stf<T>(ldf(gy[i]) * silu_d(ldf(x[i])));
}

template <class T> __global__ void k_swiglu_fwd(const T *gate, const T *up, T *y, int64_t n)
{
    GRID_STRIDE(i, n) y[i] = stf<T>(silu_f(ldf(gate[i])) * ldf(up[i]));
}

template <class T> __global__ void k_swiglu_fwd_vec(const T *gate, const T *up, T *y, int64_t n)
{
    const int N = Pack<T>::N;
    int64_t packs = n / N;
    GRID_STRIDE(i, packs)
    {
        Pack<T> a = reinterpret_cast<const Pack<T> *>(gate)[i];
        Pack<T> b = reinterpret_cast<const Pack<T> *>(up)[i], o;
#pragma unroll
        for (int k = 0; k < N; k++)
            o.v[k] = stf<T>(silu_f(ldf(a.v[k])) * ldf(b.v[k]));
        reinterpret_cast<Pack<T> *>(y)[i] = o;
    }
    TAIL_STRIDE(i, packs * N, n) y[i] = stf<T>(silu_f(ldf(gate[i])) * ldf(up[i]));
}

/* one element's two gradients (ggate, gup), from f32 gate, up and gy */
__device__ __forceinline__ void swiglu_grads(float v, float u, float g, float &gg, float &gu)
{
    float vc = silu_clamp(v), s, om;
    sigmoid2(vc, s, om);
    gg = g * u * (s * (1.0f + vc * om));
    gu = g * (v < -104.0f ? -0.0f : v * s);
}

/* ggate or gup NULL: not written (the branch is uniform over the grid) */
template <class T>
__global__ void k_swiglu_bwd(const T *gate, const T *up, const T *gy, T *ggate, T *gup, int64_t n)
{
    GRID_STRIDE(i, n)
    {
        float gg, gu;
        swiglu_grads(ldf(gate[i]), ldf(up[i]), ldf(gy[i]), gg, gu);
        if (ggate)
            ggate[i] = stf<T>(gg);
        if (gup)
            gup[i] = stf<T>(gu);
    }
}

template <class T>
__global__ void k_swiglu_bwd_vec(const T *gate, const T *up, const T *gy, T *ggate, T *gup,
                                 int64_t n)
{
    const int N = Pack<T>::N;
    int64_t packs = n / N;
    GRID_STRIDE(i, packs)
    {
        Pack<T> a = reinterpret_cast<const Pack<T> *>(gate)[i];
        Pack<T> b = reinterpret_cast<const Pack<T> *>(up)[i];
        Pack<T> g = reinterpret_cast<const Pack<T> *>(gy)[i], og, ou;
#pragma unroll
        for (int k = 0; k < N; k++) {
            float gg, gu;
            swiglu_grads(ldf(a.v[k]), ldf(b.v[k]), ldf(g.v[k]), gg, gu);
            og.v[k] = stf<T>(gg);
            ou.v[k] = stf<T>(gu);
        }
        if (ggate)
            reinterpret_cast<Pack<T> *>(ggate)[i] = og;
        if (gup)
            reinterpret_cast<Pack<T> *>(gup)[i] = ou;
    }
    TAIL_STRIDE(i, packs * N, n)
    {
        float gg, gu;
        swiglu_grads(ldf(gate[i]), ldf(up[i]), ldf(gy[i]), gg, gu);
        if (ggate)
            ggate[i] = stf<T>(gg);
        if (gup)
            gup[i] = stf<T>(gu);
    }
}

tp_status cuda_silu_fwd(tp_device dev, tp_dtype dtype, const void *x, void *y, int64_t n)
{
    if (vec_ok(x, y))
        return TYPED(dtype, launch("silu (CUDA)", TP__KOP_SILU_FWD, dtype, dev,
                                   n > 0 ? n / Pack<T>::N + 1 : 0, false, k_silu_fwd_vec<T>,
                                   cp<T>(x), mp<T>(y), n));
    return TYPED(dtype, launch("silu (CUDA)", TP__KOP_SILU_FWD, dtype, dev, n, false,
                               k_silu_fwd<T>, cp<T>(x), mp<T>(y), n));
}

tp_status cuda_silu_bwd(tp_device dev, tp_dtype dtype, const void *x, const void *gy, void *gx,
                        int64_t n)
{
    if (vec_ok(x, gy, gx))
        return TYPED(dtype, launch("silu backward (CUDA)", TP__KOP_SILU_BWD, dtype, dev,
                                   n > 0 ? n / Pack<T>::N + 1 : 0, false, k_silu_bwd_vec<T>,
                                   cp<T>(x), cp<T>(gy), mp<T>(gx), n));
    return TYPED(dtype, launch("silu backward (CUDA)", TP__KOP_SILU_BWD, dtype, dev, n, false,
                               k_silu_bwd<T>, cp<T>(x), cp<T>(gy), mp<T>(gx), n));
}

tp_status cuda_swiglu_fwd(tp_device dev, tp_dtype dtype, const void *gate, const void *up,
                          void *y, int64_t n)
{
    if (vec_ok(gate, up, y))
        return TYPED(dtype, launch("swiglu (CUDA)", TP__KOP_SWIGLU_FWD, dtype, dev,
                                   n > 0 ? n / Pack<T>::N + 1 : 0, false, k_swiglu_fwd_vec<T>,
                                   cp<T>(gate), cp<T>(up), mp<T>(y), n));
    return TYPED(dtype, launch("swiglu (CUDA)", TP__KOP_SWIGLU_FWD, dtype, dev, n, false,
                               k_swiglu_fwd<T>, cp<T>(gate), cp<T>(up), mp<T>(y), n));
}

tp_status cuda_swiglu_bwd(tp_device dev, tp_dtype dtype, const void *gate, const void *up,
                          const void *gy, void *ggate, void *gup, int64_t n)
{
    if (!ggate && !gup) /* nothing wanted: only the dtype check */
        n = 0;
    if (vec_ok(gate, up, gy) && vec_ok(ggate, gup)) /* NULL is aligned */
        return TYPED(dtype, launch("swiglu backward (CUDA)", TP__KOP_SWIGLU_BWD, dtype, dev,
                                   n > 0 ? n / Pack<T>::N + 1 : 0, false, k_swiglu_bwd_vec<T>,
                                   cp<T>(gate), cp<T>(up), cp<T>(gy), mp<T>(ggate), mp<T>(gup),
                                   n));
    return TYPED(dtype, launch("swiglu backward (CUDA)", TP__KOP_SWIGLU_BWD, dtype, dev, n, false,
                               k_swiglu_bwd<T>, cp<T>(gate), cp<T>(up), cp<T>(gy), mp<T>(ggate),
                               mp<T>(gup), n));
}

/* attention */

tp_status cuda_attn_softmax(tp_device dev, tp_dtype dtype, void *s, int64_t batch, int64_t rows,
                            int64_t Sq, int64_t Sk, int64_t key_offset, bool causal,
                            const void *pad, tp_dtype pad_dtype, int64_t pad_div)
{
    return TYPED(dtype, launch("attention softmax (CUDA)", TP__KOP_ATTN_SOFTMAX, dtype, dev,
                               Sk > 0 ? batch * rows : 0, true, k_attn_softmax<T>, mp<T>(s),
                               batch * rows, rows, Sq, Sk, key_offset, causal, pad,
                               pad_dtype == TP_I32, pad_div));
}

tp_status cuda_flash_attn_fwd(tp_device dev, tp_dtype dtype, const tp__attn_geom *g,
                              const void *q, const void *k, const void *v, void *out, float *lse)
{
    return tp__cuda_flash_attn_fwd(dev, dtype, g, q, k, v, out, lse);
}

tp_status cuda_flash_attn_bwd(tp_device dev, tp_dtype dtype, const tp__attn_geom *g,
                              const void *q, const void *k, const void *v, const void *out,
                              const float *lse, const void *gout, float *delta, void *gq,
                              void *gk, void *gv)
{
    return tp__cuda_flash_attn_bwd(dev, dtype, g, q, k, v, out, lse, gout, delta, gq, gk, gv);
}

/* rotary position embedding */

tp_status cuda_rope_fwd(tp_device dev, tp_dtype dtype, const void *x, const void *cos,
                        const void *sin, void *y, int64_t B, int64_t H, int64_t S, int64_t D,
                        int64_t cos_batch_stride)
{
    return TYPED(dtype, launch("rotary_embedding (CUDA)", TP__KOP_ROPE_FWD, dtype, dev,
                               B * H * S * (D / 2), false, k_rope<T, false>, cp<T>(x), cp<T>(cos),
                               cp<T>(sin), mp<T>(y), B, H, S, D, cos_batch_stride));
}

tp_status cuda_rope_bwd(tp_device dev, tp_dtype dtype, const void *gy, const void *cos,
                        const void *sin, void *gx, int64_t B, int64_t H, int64_t S, int64_t D,
                        int64_t cos_batch_stride)
{
    return TYPED(dtype, launch("rotary_embedding backward (CUDA)", TP__KOP_ROPE_BWD, dtype, dev,
                               B * H * S * (D / 2), false, k_rope<T, true>, cp<T>(gy),
                               cp<T>(cos), cp<T>(sin), mp<T>(gx), B, H, S, D, cos_batch_stride));
}

tp_status cuda_rope_cos_sin(tp_device dev, tp_dtype dtype, const int64_t *pos,
                            const float *inv_freq, void *cos, void *sin, int64_t n, int64_t D,
                            float scaling)
{
    return TYPED(dtype, launch("rope_cos_sin (CUDA)", TP__KOP_ROPE_COS_SIN, dtype, dev,
                               n * (D / 2), false, k_rope_cos_sin<T>, pos, inv_freq, mp<T>(cos),
                               mp<T>(sin), n, D, scaling));
}

#define CUDA_ENTRY(NAME, field) .field = cuda_##field,
const tp__kernels cuda_table = {
    .name = "cuda",
    .supports = cuda_supports,
    TP__KERNEL_ENTRIES(CUDA_ENTRY)
};

} /* namespace */

/* The registration: the table tp__kernels_for hands out for CUDA devices. */
extern "C" const tp__kernels *const tp__kernels_cuda = &cuda_table;
