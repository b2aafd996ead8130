/* The shm backend's CUDA side (see shm_cuda.h): per-rank events, and the
 * copies and reductions a rank enqueues on its own stream. */
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include "collectives/shm_cuda.h"
#include "core/cuda_rt.h"

struct tp__shm_cuda {
    int device;
    int nslots;
    cudaEvent_t *ready; /* nslots each, created on first use */
    cudaEvent_t *done;
};

namespace
{

const char *const FN = "backend 'shm' (CUDA)";

/* ---- reductions ---------------------------------------------------------- */

/* Per dtype: the stored type S, the accumulator A and the type W sums and
 * products are computed in (unsigned for integers, so overflow wraps as on
 * the CPU backend). */
struct F32T {
    typedef float S;
    typedef float A;
    typedef float W;
    static __device__ A ld(S v)
    {
        return v;
    }
    static __device__ S st(A a)
    {
        return a;
    }
};
struct F64T {
    typedef double S;
    typedef double A;
    typedef double W;
    static __device__ A ld(S v)
    {
        return v;
    }
    static __device__ S st(A a)
    {
        return a;
    }
};
struct I32T {
    typedef int32_t S;
    typedef int32_t A;
    typedef uint32_t W;
    static __device__ A ld(S v)
    {
        return v;
    }
    static __device__ S st(A a)
    {
        return a;
    }
};
struct I64T {
    typedef int64_t S;
    typedef int64_t A;
    typedef uint64_t W;
    static __device__ A ld(S v)
    {
        return v;
    }
    static __device__ S st(A a)
    {
        return a;
    }
};
struct F16T {
    typedef uint16_t S;
    typedef float A;
    typedef float W;
    static __device__ A ld(S v)
    {
        return tp__f16_to_f32(v);
    }
    static __device__ S st(A a)
    {
        return tp__f32_to_f16(a);
    }
};
struct BF16T {
    typedef uint16_t S;
    typedef float A;
    typedef float W;
    static __device__ A ld(S v)
    {
        return tp__bf16_to_f32(v);
    }
    static __device__ S st(A a)
    {
        return tp__f32_to_bf16(a);
    }
};

struct ReduceArgs {
    const void *src[TP__SHM_CUDA_MAX_PEERS];
    void *dst[TP__SHM_CUDA_MAX_PEERS];
    int nsrc, ndst, op, divisor;
    size_t soff, doff; /* elements */
};

template <class T>
__device__ __forceinline__ typename T::A combine(int op, typename T::A a, typename T::A b)
{
    typedef typename T::A A;
    typedef typename T::W W;
    switch (op) {
    case TP_PRODUCT:
        return (A)((W)a * (W)b);
    case TP_MAX:
        return (b > a || b != b) ? b : a;
    case TP_MIN:
        return (b < a || b != b) ? b : a;
    default: /* sum, avg */
        return (A)((W)a + (W)b);
    }
}

/* V elements from p + off: one 16-byte load when V > 1 (the caller checked
 * the alignment), else one element. */
template <class T, int V>
__device__ __forceinline__ void load_vec(const void *p, size_t off, typename T::A *out)
{
    typedef typename T::S S;
    S v[V];
    if (V > 1) {
        uint4 u = *reinterpret_cast<const uint4 *>(static_cast<const S *>(p) + off);
        memcpy(v, &u, sizeof v);
    } else {
        v[0] = static_cast<const S *>(p)[off];
    }
#pragma unroll
    for (int i = 0; i < V; i++)
        out[i] = T::ld(v[i]);
}

template <class T, int V>
__device__ __forceinline__ void store_vec(void *p, size_t off, const typename T::S *v)
{
    typedef typename T::S S;
    if (V > 1) {
        uint4 u;
        memcpy(&u, v, sizeof u);
        *reinterpret_cast<uint4 *>(static_cast<S *>(p) + off) = u;
    } else {
        static_cast<S *>(p)[off] = v[0];
    }
}

/* Element e of every destination = the combination of element e of every
 * source, in source order: each element is read from every source before it
 * is written anywhere, so in-place reductions are safe. nvec chunks of V. */
template <class T, int V> __global__ void reduce_kernel(ReduceArgs a, size_t nvec)
{
    typedef typename T::A A;
    typedef typename T::S S;
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < nvec; i += stride) {
        size_t e = i * V;
        A acc[V], b[V];
        load_vec<T, V>(a.src[0], a.soff + e, acc);
        for (int q = 1; q < a.nsrc; q++) {
            load_vec<T, V>(a.src[q], a.soff + e, b);
#pragma unroll
            for (int k = 0; k < V; k++)
                acc[k] = combine<T>(a.op, acc[k], b[k]);
        }
        S out[V];
#pragma unroll
        for (int k = 0; k < V; k++)
            out[k] = T::st(a.op == TP_AVG ? (A)(acc[k] / (A)a.divisor) : acc[k]);
        for (int j = 0; j < a.ndst; j++)
            store_vec<T, V>(a.dst[j], a.doff + e, out);
    }
}

bool aligned16(const ReduceArgs &a, size_t es)
{
    for (int q = 0; q < a.nsrc; q++)
        if ((uintptr_t)((const char *)a.src[q] + a.soff * es) & 15)
            return false;
    for (int j = 0; j < a.ndst; j++)
        if ((uintptr_t)((char *)a.dst[j] + a.doff * es) & 15)
            return false;
    return true;
}

template <class T, int V> void launch(const ReduceArgs &a, size_t nvec, cudaStream_t s)
{
    const unsigned threads = 256;
    size_t blocks = (nvec + threads - 1) / threads;
    if (blocks > 4096)
        blocks = 4096; /* grid-stride beyond: every SM is busy long before */
    reduce_kernel<T, V><<<(unsigned)blocks, threads, 0, s>>>(a, nvec);
}

/* Vectorized body (16-byte accesses) where every pointer allows it, then the
 * tail element by element. */
template <class T> void reduce_launch(ReduceArgs a, size_t len, cudaStream_t s)
{
    const int V = 16 / (int)sizeof(typename T::S);
    size_t body = aligned16(a, sizeof(typename T::S)) ? len / V * V : 0;
    if (body)
        launch<T, V>(a, body / V, s);
    if (body < len) {
        a.soff += body;
        a.doff += body;
        launch<T, 1>(a, len - body, s);
    }
}

tp_status enter(const tp__shm_cuda *c, int *prev, cudaStream_t *stream)
{
    TP_CHECK(tp__cuda_enter(FN, c->device, prev));
    tp_status st = tp__cuda_stream(FN, c->device, stream);
    if (st != TP_OK)
        tp__cuda_leave(*prev, c->device);
    return st;
}

/* The slot's event in `arr`, created on first use (device current). */
tp_status slot_event(cudaEvent_t *arr, int slot, cudaEvent_t *out)
{
    if (!arr[slot])
        TP_CUDA_CHECK(FN, "cudaEventCreateWithFlags",
                      cudaEventCreateWithFlags(&arr[slot], cudaEventDisableTiming));
    *out = arr[slot];
    return TP_OK;
}

} // namespace

extern "C" {

tp_status tp__shm_cuda_create(int device, int nslots, tp__shm_cuda **out)
{
    *out = NULL;
    tp__shm_cuda *c = (tp__shm_cuda *)tp__calloc(1, sizeof *c);
    cudaEvent_t *ready = (cudaEvent_t *)tp__calloc((size_t)nslots, sizeof(cudaEvent_t));
    cudaEvent_t *done = (cudaEvent_t *)tp__calloc((size_t)nslots, sizeof(cudaEvent_t));
    if (!c || !ready || !done) {
        tp__free(c);
        tp__free(ready);
        tp__free(done);
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory for a rank's events", FN);
    }
    c->device = device;
    c->nslots = nslots;
    c->ready = ready;
    c->done = done;
    *out = c;
    return TP_OK;
}

void tp__shm_cuda_destroy(tp__shm_cuda *c)
{
    if (!c)
        return;
    int prev = 0;
    bool entered = tp__cuda_enter(FN, c->device, &prev) == TP_OK;
    for (int i = 0; i < c->nslots; i++) {
        if (c->ready[i])
            (void)cudaEventDestroy(c->ready[i]);
        if (c->done[i])
            (void)cudaEventDestroy(c->done[i]);
    }
    if (entered)
        tp__cuda_leave(prev, c->device);
    tp__free(c->ready);
    tp__free(c->done);
    tp__free(c);
}

int tp__shm_cuda_device(const tp__shm_cuda *c)
{
    return c->device;
}

tp_status tp__shm_cuda_post(tp__shm_cuda *c, int slot, void **ready, void **done)
{
    int prev = 0;
    cudaStream_t s = NULL;
    TP_CHECK(enter(c, &prev, &s));
    cudaEvent_t r = NULL, d = NULL;
    tp_status st = slot_event(c->ready, slot, &r);
    if (st == TP_OK)
        st = slot_event(c->done, slot, &d);
    if (st == TP_OK) {
        cudaError_t err = cudaEventRecord(r, s);
        if (err != cudaSuccess)
            st = tp__cuda_fail(FN, "cudaEventRecord (ready)", err);
    }
    tp__cuda_leave(prev, c->device);
    *ready = r;
    *done = d;
    return st;
}

tp_status tp__shm_cuda_wait(tp__shm_cuda *c, void *event)
{
    int prev = 0;
    cudaStream_t s = NULL;
    TP_CHECK(enter(c, &prev, &s));
    cudaError_t err = cudaStreamWaitEvent(s, (cudaEvent_t)event, 0);
    tp__cuda_leave(prev, c->device);
    if (err != cudaSuccess)
        return tp__cuda_fail(FN, "cudaStreamWaitEvent", err);
    return TP_OK;
}

tp_status tp__shm_cuda_done(tp__shm_cuda *c, int slot)
{
    int prev = 0;
    cudaStream_t s = NULL;
    TP_CHECK(enter(c, &prev, &s));
    cudaError_t err = cudaEventRecord(c->done[slot], s);
    tp__cuda_leave(prev, c->device);
    if (err != cudaSuccess)
        return tp__cuda_fail(FN, "cudaEventRecord (done)", err);
    return TP_OK;
}

tp_status tp__shm_cuda_reduce(tp__shm_cuda *c, tp_dtype dtype, tp_reduce_op op, int divisor,
                              int nsrc, const void *const *src, size_t src_off, int ndst,
                              void *const *dst, size_t dst_off, size_t len)
{
    if (nsrc > TP__SHM_CUDA_MAX_PEERS || ndst > TP__SHM_CUDA_MAX_PEERS)
        return tp__error(TP_ERR_NOT_SUPPORTED,
                         "%s: a reduction over %d ranks; CUDA tensors on shm take at most %d", FN,
                         nsrc > ndst ? nsrc : ndst, TP__SHM_CUDA_MAX_PEERS);
    if (len == 0)
        return TP_OK;
    ReduceArgs a;
    memset(&a, 0, sizeof a);
    for (int q = 0; q < nsrc; q++)
        a.src[q] = src[q];
    for (int j = 0; j < ndst; j++)
        a.dst[j] = dst[j];
    a.nsrc = nsrc;
    a.ndst = ndst;
    a.op = (int)op;
    a.divisor = divisor;
    a.soff = src_off;
    a.doff = dst_off;
    int prev = 0;
    cudaStream_t s = NULL;
    TP_CHECK(enter(c, &prev, &s));
    switch (dtype) {
    case TP_F32:
        reduce_launch<F32T>(a, len, s);
        break;
    case TP_F64:
        reduce_launch<F64T>(a, len, s);
        break;
    case TP_F16:
        reduce_launch<F16T>(a, len, s);
        break;
    case TP_BF16:
        reduce_launch<BF16T>(a, len, s);
        break;
    case TP_I32:
        reduce_launch<I32T>(a, len, s);
        break;
    case TP_I64:
        reduce_launch<I64T>(a, len, s);
        break;
    default:
        break;
    }
    cudaError_t err = cudaGetLastError();
    tp__cuda_leave(prev, c->device);
    if (err != cudaSuccess)
        return tp__cuda_fail(FN, "reduction kernel launch", err);
    return TP_OK;
}

tp_status tp__shm_cuda_copy(tp__shm_cuda *c, void *dst, const void *src, size_t bytes)
{
    if (bytes == 0 || dst == src)
        return TP_OK;
    int prev = 0;
    cudaStream_t s = NULL;
    TP_CHECK(enter(c, &prev, &s));
    cudaError_t err = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s);
    tp__cuda_leave(prev, c->device);
    if (err != cudaSuccess)
        return tp__cuda_fail(FN, "cudaMemcpyAsync", err);
    return TP_OK;
}

tp_status tp__shm_cuda_enable_peer(tp__shm_cuda *c, int peer)
{
    if (peer == c->device)
        return TP_OK;
    int can = 0;
    TP_CUDA_CHECK(FN, "cudaDeviceCanAccessPeer", cudaDeviceCanAccessPeer(&can, c->device, peer));
    if (!can)
        return tp__error(TP_ERR_NOT_SUPPORTED,
                         "%s: GPU %d cannot access GPU %d's memory (no peer access), so ranks "
                         "on these two GPUs cannot reduce through shm; use the nccl backend",
                         FN, c->device, peer);
    int prev = 0;
    TP_CHECK(tp__cuda_enter(FN, c->device, &prev));
    cudaError_t err = cudaDeviceEnablePeerAccess(peer, 0);
    tp__cuda_leave(prev, c->device);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
        (void)cudaGetLastError();
        return TP_OK;
    }
    if (err != cudaSuccess)
        return tp__cuda_fail(FN, "cudaDeviceEnablePeerAccess", err);
    return TP_OK;
}

} // extern "C"
