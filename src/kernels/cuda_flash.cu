/* Fused causal attention on CUDA (kernels.h flash_attn_fwd / _bwd): flash
 * attention as FlashAttention-2 lays it out (Dao, 2023), written for libtp.
 *
 * Two forms:
 *  - the tensor-core forward for bf16 and f16 with a head dim of 64 or 128
 *    (q/k and v alike) and 16-byte aligned rows: a block of 4 warps takes 64
 *    query rows of a group, each warp 16 of them; the keys come in tiles of
 *    64 through shared memory; S = Q K^T and O += P V are mma.sync
 *    m16n8k16 products with f32 accumulators, and P goes from S's
 *    accumulator registers to the second product's operand registers
 *    without touching memory. The softmax is online in the log2 domain:
 *    each row keeps its running max and sum, and O is rescaled when the
 *    max grows. When the row blocks are too few to fill the GPU (decoding:
 *    a few query rows per kv head), the keys are split over more blocks
 *    whose normalized shares a combine pass weighs by their log-sum-exps
 *    (flash-decoding).
 *    The backward on tensor cores takes the same geometries (below).
 *  - the general form (every dtype, any head dim up to
 *    TP__FLASH_MAX_HEAD_DIM, any stride): one warp per query row for the
 *    forward and the query gradient, one warp per key for the key and
 *    value gradients; each lane holds D / 32 of a row's elements.
 *
 * Both accumulate in f32. The general form rounds only its outputs; the
 * tensor-core one also rounds the unnormalized probabilities (and in the
 * backward dS) to the dtype as operands of their products, as
 * FlashAttention does. Neither holds more than one tile of scores, so
 * memory is linear in the sequence. Masking is
 * the geometry's (causal diagonal moved by key_offset, key padding); a row
 * with no visible key gets 0 and lse -inf, as PyTorch's safe softmax. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include <atomic>
#include <type_traits>

#include "core/cuda_rt.h"
#include "kernels/cuda_elem.cuh"
#include "kernels/cuda_flash.h"
#include "kernels/kernels.h"

namespace {

using tp_cuda::ldf; /* cuda_elem.cuh */
using tp_cuda::stf;

/* Whether padding hides key j from group b. */
__device__ __forceinline__ bool padded(const tp__attn_geom &g, int64_t b, int64_t j)
{
    if (!g.pad)
        return false;
    const int64_t e = b / g.pad_div * g.pad_ld + j;
    return g.pad_dtype == TP_I32 ? static_cast<const int32_t *>(g.pad)[e] == 0
                                 : static_cast<const int64_t *>(g.pad)[e] == 0;
}

/* The keys [0, lim) query position i may see on the causal diagonal. */
__device__ __forceinline__ int64_t causal_limit(const tp__attn_geom &g, int64_t i)
{
    if (!g.causal)
        return g.Sk;
    const int64_t lim = i + g.key_offset + 1;
    return lim < g.Sk ? lim : g.Sk;
}

__device__ __forceinline__ float warp_sum(float v)
{
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* ---- the general form ------------------------------------------------------------ */

const int kRowWarps = 8;                          /* rows (or keys) per block */
const int kPer = TP__FLASH_MAX_HEAD_DIM / 32;    /* a row's elements per lane */

/* A row of n elements spread over the warp: lane l holds elements l, l + 32, ... */
template <class T>
__device__ __forceinline__ void load_row(const T *p, int64_t n, int lane, float s, float *r)
{
#pragma unroll
    for (int t = 0; t < kPer; t++) {
        const int64_t d = lane + 32 * t;
        r[t] = d < n ? ldf(p[d]) * s : 0.0f;
    }
}

template <class T>
__device__ __forceinline__ float dot_row(const float *r, const T *p, int64_t n, int lane)
{
    float s = 0.0f;
#pragma unroll
    for (int t = 0; t < kPer; t++) {
        const int64_t d = lane + 32 * t;
        if (d < n)
            s += r[t] * ldf(p[d]);
    }
    return warp_sum(s);
}

template <class T>
__device__ __forceinline__ void store_row(T *p, int64_t n, int lane, const float *r, float s)
{
#pragma unroll
    for (int t = 0; t < kPer; t++) {
        const int64_t d = lane + 32 * t;
        if (d < n)
            p[d] = stf<T>(r[t] * s);
    }
}

/* One warp per query row: the online softmax key by key. */
template <class T>
__global__ void k_flash_fwd_rows(tp__attn_geom g, const T *q, const T *k, const T *v, T *out,
                                 float *lse)
{
    const int lane = threadIdx.x & 31;
    const int64_t row = (int64_t)blockIdx.x * kRowWarps + (threadIdx.x >> 5);
    if (row >= g.M)
        return;
    for (int64_t b = blockIdx.y; b < g.G; b += gridDim.y) {
        float qr[kPer], acc[kPer];
        load_row(q + (b * g.M + row) * g.D, g.D, lane, g.scale, qr);
#pragma unroll
        for (int t = 0; t < kPer; t++)
            acc[t] = 0.0f;
        float m = -INFINITY, l = 0.0f;
        const int64_t lim = causal_limit(g, row % g.Sq);
        for (int64_t j = 0; j < lim; j++) {
            if (padded(g, b, j))
                continue;
            const float s = dot_row(qr, k + b * g.k_gs + j * g.k_ld, g.D, lane);
            if (s == -INFINITY)
                continue;
            const float mn = fmaxf(m, s), corr = expf(m - mn), p = expf(s - mn);
            const T *vr = v + b * g.v_gs + j * g.v_ld;
            l = l * corr + p;
#pragma unroll
            for (int t = 0; t < kPer; t++) {
                const int64_t d = lane + 32 * t;
                acc[t] = acc[t] * corr + (d < g.Dv ? p * ldf(vr[d]) : 0.0f);
            }
            m = mn;
        }
        store_row(out + (b * g.M + row) * g.Dv, g.Dv, lane, acc, l > 0.0f ? 1.0f / l : 0.0f);
        if (lane == 0)
            lse[b * g.M + row] = l > 0.0f ? m + logf(l) : -INFINITY;
    }
}

/* One warp per query row: delta = gout . out, and gq. */
template <class T>
__global__ void k_flash_bwd_rows(tp__attn_geom g, const T *q, const T *k, const T *v,
                                 const T *out, const float *lse, const T *gout, float *delta,
                                 T *gq)
{
    const int lane = threadIdx.x & 31;
    const int64_t row = (int64_t)blockIdx.x * kRowWarps + (threadIdx.x >> 5);
    if (row >= g.M)
        return;
    for (int64_t b = blockIdx.y; b < g.G; b += gridDim.y) {
        const int64_t r = b * g.M + row;
        float go[kPer], qr[kPer], acc[kPer];
        load_row(gout + r * g.Dv, g.Dv, lane, 1.0f, go);
        const float dl = dot_row(go, out + r * g.Dv, g.Dv, lane);
        if (lane == 0)
            delta[r] = dl;
        if (!gq)
            continue;
        load_row(q + r * g.D, g.D, lane, g.scale, qr);
#pragma unroll
        for (int t = 0; t < kPer; t++)
            acc[t] = 0.0f;
        const float ls = lse[r];
        const int64_t lim = ls == -INFINITY ? 0 : causal_limit(g, row % g.Sq);
        for (int64_t j = 0; j < lim; j++) {
            if (padded(g, b, j))
                continue;
            const T *kr = k + b * g.k_gs + j * g.k_ld;
            const float p = expf(dot_row(qr, kr, g.D, lane) - ls);
            const float ds = p * (dot_row(go, v + b * g.v_gs + j * g.v_ld, g.Dv, lane) - dl);
#pragma unroll
            for (int t = 0; t < kPer; t++) {
                const int64_t d = lane + 32 * t;
                if (d < g.D)
                    acc[t] += ds * ldf(kr[d]);
            }
        }
        store_row(gq + r * g.D, g.D, lane, acc, g.scale);
    }
}

/* One warp per key: gk and gv over the rows that see it. */
template <class T>
__global__ void k_flash_bwd_keys(tp__attn_geom g, const T *q, const T *k, const T *v,
                                 const float *lse, const T *gout, const float *delta, T *gk,
                                 T *gv)
{
    const int lane = threadIdx.x & 31;
    const int64_t j = (int64_t)blockIdx.x * kRowWarps + (threadIdx.x >> 5);
    if (j >= g.Sk)
        return;
    for (int64_t b = blockIdx.y; b < g.G; b += gridDim.y) {
        float kr[kPer], vr[kPer], ak[kPer], av[kPer];
        load_row(k + b * g.k_gs + j * g.k_ld, g.D, lane, g.scale, kr);
        load_row(v + b * g.v_gs + j * g.v_ld, g.Dv, lane, 1.0f, vr);
#pragma unroll
        for (int t = 0; t < kPer; t++)
            ak[t] = av[t] = 0.0f;
        const bool hidden = padded(g, b, j);
        for (int64_t row = 0; row < g.M && !hidden; row++) {
            if (g.causal && j > row % g.Sq + g.key_offset)
                continue;
            const int64_t r = b * g.M + row;
            const float ls = lse[r];
            if (ls == -INFINITY)
                continue;
            const T *qr = q + r * g.D, *go = gout + r * g.Dv;
            const float p = expf(dot_row(kr, qr, g.D, lane) - ls);
            const float ds = p * (dot_row(vr, go, g.Dv, lane) - delta[r]);
#pragma unroll
            for (int t = 0; t < kPer; t++) {
                const int64_t d = lane + 32 * t;
                if (d < g.Dv)
                    av[t] += p * ldf(go[d]);
                if (d < g.D)
                    ak[t] += ds * ldf(qr[d]);
            }
        }
        if (gk)
            store_row(gk + (b * g.Sk + j) * g.D, g.D, lane, ak, g.scale);
        if (gv)
            store_row(gv + (b * g.Sk + j) * g.Dv, g.Dv, lane, av, 1.0f);
    }
}

/* ---- the tensor-core forward ------------------------------------------------------ */

const int kBr = 64, kBc = 64, kMmaThreads = 128;

template <class T> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi)
{
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&h);
}
template <> __device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi)
{
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&h);
}

/* c += a b: A 16x16 row-major, B 16x8 column-major, C 16x8 f32 (the PTX
 * ISA's m16n8k16 fragment layouts). */
template <class T> __device__ __forceinline__ void mma(float *c, const uint32_t *a, const uint32_t *b);
template <>
__device__ __forceinline__ void mma<__nv_bfloat16>(float *c, const uint32_t *a, const uint32_t *b)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <>
__device__ __forceinline__ void mma<__half>(float *c, const uint32_t *a, const uint32_t *b)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

/* Four 8x8 matrices of 16-bit elements from shared memory: lane l gives the
 * address of row l % 8 of matrix l / 8; r[i] receives matrix i's elements
 * (row l / 4, columns 2 (l % 4) and + 1), or with .trans its transpose's. */
__device__ __forceinline__ void ldsm4(uint32_t *r, const void *p)
{
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
__device__ __forceinline__ void ldsm4_t(uint32_t *r, const void *p)
{
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

/* rows [0, n) of a tile of kRows rows of D elements from src (row r at src +
 * r * ld) into shared memory at row stride LD, 16 bytes at a time; rows past
 * n are zero. */
template <class T, int D, int LD, int kRows>
__device__ __forceinline__ void load_tile(T *dst, const T *src, int64_t ld, int64_t n)
{
    constexpr int kChunks = D / 8; /* 16-byte chunks per row */
    for (int c = threadIdx.x; c < kRows * kChunks; c += kMmaThreads) {
        const int r = c / kChunks, e = (c % kChunks) * 8;
        uint4 val = make_uint4(0, 0, 0, 0);
        if (r < n)
            val = *reinterpret_cast<const uint4 *>(src + r * ld + e);
        *reinterpret_cast<uint4 *>(dst + r * LD + e) = val;
    }
}

/* Fragment addresses (elements into a row-major shared tile of row stride
 * LD), lane by lane, for ldmatrix.x4:
 *   a_at:  the A operand of rows [r0, r0 + 16), columns [c0, c0 + 16)
 *   b_at:  the B operand of two n8 tiles, n = tile rows [n0, n0 + 16),
 *          k = columns [k0, k0 + 16) (S = Q K^T: K's rows are S's columns)
 *   bt_at: the B operand with k = tile rows [k0, k0 + 16) and n = columns
 *          [n0, n0 + 16), through ldmatrix .trans (O = P V: V's rows are k) */
template <int LD> __device__ __forceinline__ int a_at(int lane, int r0, int c0)
{
    return (r0 + (lane & 15)) * LD + c0 + (lane >> 4) * 8;
}
template <int LD> __device__ __forceinline__ int b_at(int lane, int n0, int k0)
{
    return (n0 + (lane & 7) + ((lane >> 4) & 1) * 8) * LD + k0 + ((lane >> 3) & 1) * 8;
}
template <int LD> __device__ __forceinline__ int bt_at(int lane, int k0, int n0)
{
    return (k0 + (lane & 15)) * LD + n0 + (lane >> 4) * 8;
}

template <int N> __device__ __forceinline__ void zero(float (*acc)[4])
{
#pragma unroll
    for (int i = 0; i < N; i++)
        acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
}

/* acc[N][4] += A B^T: A the warp's 16 rows at row `ar` of sA, B the first
 * N * 8 rows of sB, both D wide (S = Q K^T, dP = dO V^T, and transposed). */
template <class T, int D, int N>
__device__ __forceinline__ void mma_abt(float (*acc)[4], const T *sA, int ar, const T *sB,
                                        int lane)
{
    constexpr int LD = D + 8;
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
        uint32_t a[4];
        ldsm4(a, sA + a_at<LD>(lane, ar, kk * 16));
#pragma unroll
        for (int nt = 0; nt < N / 2; nt++) {
            uint32_t bb[4];
            ldsm4(bb, sB + b_at<LD>(lane, nt * 16, kk * 16));
            mma<T>(acc[2 * nt], a, bb);
            mma<T>(acc[2 * nt + 1], a, bb + 2);
        }
    }
}

/* acc[D / 8][4] += P B: P the warp's 16 x (N * 8) accumulators p[N][4]
 * (rounded to T and handed over as A operands: a C fragment's layout is the
 * A fragment's), B the first N * 8 rows of sB, D wide (O = P V, dQ = dS K,
 * dV = P^T dO, dK = dS^T Q). */
template <class T, int D, int N>
__device__ __forceinline__ void mma_pb(float (*acc)[4], const float (*p)[4], const T *sB,
                                       int lane)
{
    constexpr int LD = D + 8;
#pragma unroll
    for (int kc = 0; kc < N / 2; kc++) {
        const uint32_t a[4] = {pack2<T>(p[2 * kc][0], p[2 * kc][1]),
                               pack2<T>(p[2 * kc][2], p[2 * kc][3]),
                               pack2<T>(p[2 * kc + 1][0], p[2 * kc + 1][1]),
                               pack2<T>(p[2 * kc + 1][2], p[2 * kc + 1][3])};
#pragma unroll
        for (int dt = 0; dt < D / 16; dt++) {
            uint32_t bb[4];
            ldsm4_t(bb, sB + bt_at<LD>(lane, kc * 16, dt * 16));
            mma<T>(acc[2 * dt], a, bb);
            mma<T>(acc[2 * dt + 1], a, bb + 2);
        }
    }
}

/* The keys [0, lim) any of the rows [r0, r0 + nr) may see (their positions
 * r % Sq, the causal diagonal moved by key_offset). */
__device__ __forceinline__ int64_t block_key_limit(const tp__attn_geom &g, int64_t r0,
                                                   int64_t nr)
{
    if (!g.causal)
        return g.Sk;
    const int64_t first = r0 % g.Sq;
    const int64_t imax = nr >= g.Sq || first + nr > g.Sq ? g.Sq - 1 : first + nr - 1;
    return imax + g.key_offset + 1 < g.Sk ? imax + g.key_offset + 1 : g.Sk;
}

/* Rows ra and ra + 8 of a [rows, D] output from the warp's accumulators
 * acc[D / 8][4] (columns 2 ti, 2 ti + 1 of each n8 tile), times sa and sb;
 * rows at or past `rows` are not stored. */
template <class T, int D>
__device__ __forceinline__ void store_rows(T *out, int64_t rows, int64_t ra, const float (*acc)[4],
                                           float sa, float sb, int ti)
{
#pragma unroll
    for (int i = 0; i < D / 8; i++) {
        const int col = i * 8 + 2 * ti;
        if (ra < rows)
            *reinterpret_cast<uint32_t *>(out + ra * D + col) =
                pack2<T>(acc[i][0] * sa, acc[i][1] * sa);
        if (ra + 8 < rows)
            *reinterpret_cast<uint32_t *>(out + (ra + 8) * D + col) =
                pack2<T>(acc[i][2] * sb, acc[i][3] * sb);
    }
}

/* The key tile [c0, c0 + kBc) of group b into sK and sV (zero past Sk),
 * and which of its keys the padding leaves visible. */
template <class T, int D>
__device__ __forceinline__ void load_keys(const tp__attn_geom &g, int64_t b, int64_t c0,
                                          const T *k, const T *v, T *sK, T *sV,
                                          unsigned char *visible)
{
    const int64_t nc = g.Sk - c0 < kBc ? g.Sk - c0 : kBc;
    load_tile<T, D, D + 8, kBc>(sK, k + b * g.k_gs + c0 * g.k_ld, g.k_ld, nc);
    load_tile<T, D, D + 8, kBc>(sV, v + b * g.v_gs + c0 * g.v_ld, g.v_ld, nc);
    if (threadIdx.x < kBc)
        visible[threadIdx.x] = threadIdx.x < nc && !padded(g, b, c0 + threadIdx.x);
}

template <int D> constexpr size_t mma_smem_bytes()
{
    return (size_t)(kBr + 2 * kBc) * (D + 8) * 2;
}

/* Split over keys (flash-decoding): blockIdx.z takes keys [z kchunk,
 * (z + 1) kchunk) and writes its rows' output normalized over those keys,
 * in f32, to opart[z] and their log-sum-exp to lpart[z]; k_flash_combine
 * weighs the splits by exp(lse_z - lse). Without a split (opart NULL) the
 * block covers every key and writes out and lse itself. */
template <class T, int D>
__global__ void __launch_bounds__(kMmaThreads)
    k_flash_fwd_mma(tp__attn_geom g, const T *q, const T *k, const T *v, T *out, float *lse,
                    int64_t kchunk, float *opart, float *lpart)
{
    constexpr int LD = D + 8; /* 16 bytes of padding: ldmatrix rows hit distinct banks */
    extern __shared__ __align__(16) unsigned char smem[];
    T *sQ = reinterpret_cast<T *>(smem), *sK = sQ + kBr * LD, *sV = sK + kBc * LD;
    __shared__ unsigned char visible[kBc];

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int gi = lane >> 2, ti = lane & 3; /* the fragment's row group and column pair */
    const int64_t b = blockIdx.y, r0 = (int64_t)blockIdx.x * kBr;
    const int64_t nr = g.M - r0 < kBr ? g.M - r0 : kBr;
    load_tile<T, D, LD, kBr>(sQ, q + (b * g.M + r0) * D, D, nr);

    const int64_t rowA = r0 + warp * 16 + gi, rowB = rowA + 8;
    const int64_t iA = rowA % g.Sq, iB = rowB % g.Sq;
    int64_t lim = block_key_limit(g, r0, nr), cbeg = 0;
    if (opart) {
        cbeg = blockIdx.z * kchunk;
        lim = cbeg + kchunk < lim ? cbeg + kchunk : lim;
    }
    const float sl2 = g.scale * 1.4426950408889634f; /* scores in the log2 domain */
    float o[D / 8][4];
    zero<D / 8>(o);
    float mA = -INFINITY, mB = -INFINITY, lA = 0.0f, lB = 0.0f;

    for (int64_t c0 = cbeg; c0 < lim; c0 += kBc) {
        __syncthreads(); /* the previous tile's readers are done */
        load_keys<T, D>(g, b, c0, k, v, sK, sV, visible);
        __syncthreads();

        float s[kBc / 8][4];
        zero<kBc / 8>(s);
        mma_abt<T, D, kBc / 8>(s, sQ, warp * 16, sK, lane);
        /* scale into the log2 domain and mask; the row max */
        float xA = mA, xB = mB;
#pragma unroll
        for (int nt = 0; nt < kBc / 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int kj = nt * 8 + 2 * ti + (e & 1);
                const int64_t key = c0 + kj, i = e < 2 ? iA : iB;
                float x = s[nt][e] * sl2;
                if (!visible[kj] || (g.causal && key > i + g.key_offset))
                    x = -INFINITY;
                s[nt][e] = x;
                if (e < 2)
                    xA = fmaxf(xA, x);
                else
                    xB = fmaxf(xB, x);
            }
        xA = fmaxf(xA, __shfl_xor_sync(0xffffffffu, xA, 1));
        xA = fmaxf(xA, __shfl_xor_sync(0xffffffffu, xA, 2));
        xB = fmaxf(xB, __shfl_xor_sync(0xffffffffu, xB, 1));
        xB = fmaxf(xB, __shfl_xor_sync(0xffffffffu, xB, 2));
        /* a row with nothing visible so far keeps max -inf: its p are 0 */
        const float baseA = xA == -INFINITY ? 0.0f : xA, baseB = xB == -INFINITY ? 0.0f : xB;
        const float cA = xA == -INFINITY ? 1.0f : exp2f(mA - xA);
        const float cB = xB == -INFINITY ? 1.0f : exp2f(mB - xB);
        float sumA = 0.0f, sumB = 0.0f;
#pragma unroll
        for (int nt = 0; nt < kBc / 8; nt++) {
            s[nt][0] = exp2f(s[nt][0] - baseA);
            s[nt][1] = exp2f(s[nt][1] - baseA);
            s[nt][2] = exp2f(s[nt][2] - baseB);
            s[nt][3] = exp2f(s[nt][3] - baseB);
            sumA += s[nt][0] + s[nt][1];
            sumB += s[nt][2] + s[nt][3];
        }
        lA = lA * cA + sumA; /* this lane's share; the quad's are summed at the end */
        lB = lB * cB + sumB;
        mA = xA;
        mB = xB;
#pragma unroll
        for (int i = 0; i < D / 8; i++) {
            o[i][0] *= cA;
            o[i][1] *= cA;
            o[i][2] *= cB;
            o[i][3] *= cB;
        }
        mma_pb<T, D, kBc / 8>(o, s, sV, lane); /* O += P V */
    }
    lA += __shfl_xor_sync(0xffffffffu, lA, 1);
    lA += __shfl_xor_sync(0xffffffffu, lA, 2);
    lB += __shfl_xor_sync(0xffffffffu, lB, 1);
    lB += __shfl_xor_sync(0xffffffffu, lB, 2);
    const float invA = lA > 0.0f ? 1.0f / lA : 0.0f, invB = lB > 0.0f ? 1.0f / lB : 0.0f;
    float *ls = lse;
    if (opart) { /* this split's share, in f32 */
        const size_t rows = (size_t)g.G * g.M, at = (size_t)blockIdx.z * rows + b * g.M;
        float *op = opart + at * D;
        ls = lpart + (size_t)blockIdx.z * rows;
#pragma unroll
        for (int i = 0; i < D / 8; i++) {
            const int col = i * 8 + 2 * ti;
            if (rowA < g.M) {
                op[rowA * D + col] = o[i][0] * invA;
                op[rowA * D + col + 1] = o[i][1] * invA;
            }
            if (rowB < g.M) {
                op[rowB * D + col] = o[i][2] * invB;
                op[rowB * D + col + 1] = o[i][3] * invB;
            }
        }
    } else {
        store_rows<T, D>(out + b * g.M * D, g.M, rowA, o, invA, invB, ti);
    }
    if (ti == 0) {
        const float ln2 = 0.6931471805599453f;
        if (rowA < g.M)
            ls[b * g.M + rowA] = lA > 0.0f ? mA * ln2 + logf(lA) : -INFINITY;
        if (rowB < g.M)
            ls[b * g.M + rowB] = lB > 0.0f ? mB * ln2 + logf(lB) : -INFINITY;
    }
}

/* The splits' shares of each row into out and lse: one thread per (row,
 * column); a row no split saw gets 0 and -inf. */
template <class T>
__global__ void k_flash_combine(const float *opart, const float *lpart, int splits, int64_t rows,
                                int64_t D, T *out, float *lse)
{
    GRID_STRIDE(e, rows * D)
    {
        const int64_t r = e / D, d = e % D;
        float mx = -INFINITY;
        for (int z = 0; z < splits; z++)
            mx = fmaxf(mx, lpart[z * rows + r]);
        float acc = 0.0f, wsum = 0.0f;
        if (mx != -INFINITY)
            for (int z = 0; z < splits; z++) {
                const float w = expf(lpart[z * rows + r] - mx);
                wsum += w;
                acc += w * opart[(z * rows + r) * D + d];
            }
        out[e] = stf<T>(wsum > 0.0f ? acc / wsum : 0.0f);
        if (d == 0)
            lse[r] = wsum > 0.0f ? mx + logf(wsum) : -INFINITY;
    }
}

/* ---- the tensor-core backward ------------------------------------------------------
 *
 * Two kernels, neither with atomics: the rows' (dQ) recomputes S = Q K^T
 * and dP = dO V^T tile by tile as the forward does, dS = P (dP - delta),
 * and accumulates dQ += dS K in registers; the keys' (dK, dV) holds a block
 * of 64 keys (16 per warp) and walks the query rows 32 at a time:
 * S^T = K Q^T and dP^T = V dO^T, then dV += P^T dO and dK += dS^T Q with
 * P^T and dS^T handed from the accumulators to the operands in registers.
 * Seven products where FlashAttention-2's single kernel has five (it adds
 * dQ with atomics): deterministic, and no f32 dQ scratch. */

const int kKeyRows = 32; /* query rows per step of the keys' kernel */

template <int D> constexpr size_t dq_smem_bytes()
{
    return (size_t)(2 * kBr + 2 * kBc) * (D + 8) * 2;
}
template <int D> constexpr size_t dkv_smem_bytes()
{
    return (size_t)(2 * kBc + 2 * kKeyRows) * (D + 8) * 2;
}

template <class T, int D>
__global__ void __launch_bounds__(kMmaThreads)
    k_flash_bwd_dq_mma(tp__attn_geom g, const T *q, const T *k, const T *v, const float *lse,
                       const T *gout, const float *delta, T *gq)
{
    constexpr int LD = D + 8;
    extern __shared__ __align__(16) unsigned char smem[];
    T *sQ = reinterpret_cast<T *>(smem), *sO = sQ + kBr * LD, *sK = sO + kBr * LD,
      *sV = sK + kBc * LD;
    __shared__ unsigned char visible[kBc];

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int gi = lane >> 2, ti = lane & 3;
    const int64_t b = blockIdx.y, r0 = (int64_t)blockIdx.x * kBr;
    const int64_t nr = g.M - r0 < kBr ? g.M - r0 : kBr;
    load_tile<T, D, LD, kBr>(sQ, q + (b * g.M + r0) * D, D, nr);
    load_tile<T, D, LD, kBr>(sO, gout + (b * g.M + r0) * D, D, nr);

    const float log2e = 1.4426950408889634f, sl2 = g.scale * log2e;
    const int64_t rowA = r0 + warp * 16 + gi, rowB = rowA + 8;
    const int64_t iA = rowA % g.Sq, iB = rowB % g.Sq;
    /* -inf (no row, or no visible key) makes every p of the row 0 */
    const float lA = rowA < g.M ? lse[b * g.M + rowA] * log2e : -INFINITY;
    const float lB = rowB < g.M ? lse[b * g.M + rowB] * log2e : -INFINITY;
    const float dA = rowA < g.M ? delta[b * g.M + rowA] : 0.0f;
    const float dB = rowB < g.M ? delta[b * g.M + rowB] : 0.0f;
    const int64_t lim = block_key_limit(g, r0, nr);
    float dq[D / 8][4];
    zero<D / 8>(dq);

    for (int64_t c0 = 0; c0 < lim; c0 += kBc) {
        __syncthreads();
        load_keys<T, D>(g, b, c0, k, v, sK, sV, visible);
        __syncthreads();
        float s[kBc / 8][4], dp[kBc / 8][4];
        zero<kBc / 8>(s);
        zero<kBc / 8>(dp);
        mma_abt<T, D, kBc / 8>(s, sQ, warp * 16, sK, lane);
        mma_abt<T, D, kBc / 8>(dp, sO, warp * 16, sV, lane);
        /* ds = p (dp - delta), p = exp(s scale - lse); 0 where masked */
#pragma unroll
        for (int nt = 0; nt < kBc / 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int kj = nt * 8 + 2 * ti + (e & 1);
                const bool a = e < 2;
                const int64_t key = c0 + kj, i = a ? iA : iB;
                const float l = a ? lA : lB;
                const bool vis =
                    visible[kj] && l != -INFINITY && !(g.causal && key > i + g.key_offset);
                const float p = vis ? exp2f(s[nt][e] * sl2 - l) : 0.0f;
                s[nt][e] = p * (dp[nt][e] - (a ? dA : dB));
            }
        mma_pb<T, D, kBc / 8>(dq, s, sK, lane); /* dQ += dS K */
    }
    store_rows<T, D>(gq + b * g.M * D, g.M, rowA, dq, g.scale, g.scale, ti);
}

template <class T, int D>
__global__ void __launch_bounds__(kMmaThreads)
    k_flash_bwd_dkv_mma(tp__attn_geom g, const T *q, const T *k, const T *v, const float *lse,
                        const T *gout, const float *delta, T *gk, T *gv)
{
    constexpr int LD = D + 8;
    extern __shared__ __align__(16) unsigned char smem[];
    T *sK = reinterpret_cast<T *>(smem), *sV = sK + kBc * LD, *sQ = sV + kBc * LD,
      *sO = sQ + kKeyRows * LD;
    __shared__ unsigned char visible[kBc];
    __shared__ float sL[kKeyRows], sD[kKeyRows];

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int gi = lane >> 2, ti = lane & 3;
    const int64_t b = blockIdx.y, c0 = (int64_t)blockIdx.x * kBc;
    load_keys<T, D>(g, b, c0, k, v, sK, sV, visible);

    const float log2e = 1.4426950408889634f, sl2 = g.scale * log2e;
    /* this thread's keys: rows gi and gi + 8 of the warp's 16 */
    const int kjA = warp * 16 + gi, kjB = kjA + 8;
    const int64_t keyA = c0 + kjA, keyB = c0 + kjB;
    float dk[D / 8][4], dv[D / 8][4];
    zero<D / 8>(dk);
    zero<D / 8>(dv);

    for (int64_t r0 = 0; r0 < g.M; r0 += kKeyRows) {
        const int64_t nr = g.M - r0 < kKeyRows ? g.M - r0 : kKeyRows;
        if (block_key_limit(g, r0, nr) <= c0)
            continue; /* these rows' diagonals end before this key block */
        __syncthreads(); /* the previous rows' readers are done */
        load_tile<T, D, LD, kKeyRows>(sQ, q + (b * g.M + r0) * D, D, nr);
        load_tile<T, D, LD, kKeyRows>(sO, gout + (b * g.M + r0) * D, D, nr);
        if (threadIdx.x < kKeyRows) {
            const bool in = threadIdx.x < nr;
            sL[threadIdx.x] = in ? lse[b * g.M + r0 + threadIdx.x] * log2e : -INFINITY;
            sD[threadIdx.x] = in ? delta[b * g.M + r0 + threadIdx.x] : 0.0f;
        }
        __syncthreads();

        /* S^T = K Q^T and dP^T = V dO^T: this warp's 16 keys by 32 rows */
        float st[kKeyRows / 8][4], dpt[kKeyRows / 8][4];
        zero<kKeyRows / 8>(st);
        zero<kKeyRows / 8>(dpt);
        mma_abt<T, D, kKeyRows / 8>(st, sK, warp * 16, sQ, lane);
        mma_abt<T, D, kKeyRows / 8>(dpt, sV, warp * 16, sO, lane);
        /* P^T and dS^T in place */
#pragma unroll
        for (int nt = 0; nt < kKeyRows / 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int rl = nt * 8 + 2 * ti + (e & 1);
                const bool a = e < 2;
                const int kj = a ? kjA : kjB;
                const int64_t key = a ? keyA : keyB, row = r0 + rl;
                const float l = sL[rl];
                const bool vis = visible[kj] && l != -INFINITY &&
                                 !(g.causal && key > row % g.Sq + g.key_offset);
                const float p = vis ? exp2f(st[nt][e] * sl2 - l) : 0.0f;
                st[nt][e] = p;
                dpt[nt][e] = p * (dpt[nt][e] - sD[rl]);
            }
        mma_pb<T, D, kKeyRows / 8>(dv, st, sO, lane);  /* dV += P^T dO */
        mma_pb<T, D, kKeyRows / 8>(dk, dpt, sQ, lane); /* dK += dS^T Q */
    }
    if (gk)
        store_rows<T, D>(gk + b * g.Sk * D, g.Sk, keyA, dk, g.scale, g.scale, ti);
    if (gv)
        store_rows<T, D>(gv + b * g.Sk * D, g.Sk, keyA, dv, 1.0f, 1.0f, ti);
}

/* ---- the entries ----------------------------------------------------------------- */

using tp_cuda::by_dtype;

bool aligned16(const void *p)
{
    return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

/* The tensor-core forward takes the geometry. */
bool mma_fits(tp_dtype dtype, const tp__attn_geom *g, const void *q, const void *k,
              const void *v, const void *out)
{
    return (dtype == TP_BF16 || dtype == TP_F16) && g->D == g->Dv &&
           (g->D == 64 || g->D == 128) && g->G <= 65535 && aligned16(q) && aligned16(k) &&
           aligned16(v) && aligned16(out) && g->k_gs % 8 == 0 && g->k_ld % 8 == 0 &&
           g->v_gs % 8 == 0 && g->v_ld % 8 == 0 && (g->M + kBr - 1) / kBr <= INT32_MAX;
}

struct Scope {
    const char *fn;
    int dev, prev;
    cudaStream_t s;
};

tp_status scope_begin(Scope *sc, const char *fn, tp_device dev)
{
    sc->fn = fn;
    sc->dev = dev.index;
    tp_status st = tp__cuda_enter(fn, dev.index, &sc->prev);
    if (st != TP_OK)
        return st;
    st = tp__cuda_stream(fn, dev.index, &sc->s);
    if (st != TP_OK)
        tp__cuda_leave(sc->prev, dev.index);
    return st;
}

tp_status scope_end(Scope *sc, cudaError_t err)
{
    if (err == cudaSuccess)
        err = cudaGetLastError();
    else
        (void)cudaGetLastError();
    tp__cuda_leave(sc->prev, sc->dev);
    return err == cudaSuccess ? TP_OK : tp__cuda_fail(sc->fn, "kernel launch", err);
}

/* Lets `kernel` take `bytes` of dynamic shared memory (past the default
 * 48 KiB) on device dev, once per device: the attribute is the function's
 * on that device for the process's life, and setting it is a driver call
 * each launch would otherwise pay. */
template <class K>
cudaError_t allow_smem(K kernel, size_t bytes, int dev, std::atomic<uint64_t> &done)
{
    const uint64_t bit = dev >= 0 && dev < 64 ? (uint64_t)1 << dev : 0;
    if (bit && (done.load(std::memory_order_relaxed) & bit))
        return cudaSuccess;
    cudaError_t e =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
    if (e == cudaSuccess && bit)
        done.fetch_or(bit, std::memory_order_relaxed);
    return e;
}

/* Blocks that fill an H100/H200 twice over: fewer row blocks than this
 * (decoding: a few rows per group) split the keys. */
const int64_t kFillBlocks = 264;

template <class T, int D>
cudaError_t launch_mma(const Scope &sc, const tp__attn_geom *g, const void *q, const void *k,
                       const void *v, void *out, float *lse, tp_status *st)
{
    const size_t bytes = mma_smem_bytes<D>();
    static std::atomic<uint64_t> done;
    cudaError_t e = allow_smem(k_flash_fwd_mma<T, D>, bytes, sc.dev, done);
    if (e != cudaSuccess)
        return e;
    const int64_t blocks = (g->M + kBr - 1) / kBr * g->G;
    /* splits of at least two key tiles each, while the blocks do not fill the GPU */
    int64_t splits = 1, kchunk = g->Sk;
    if (blocks < kFillBlocks && g->Sk > 2 * kBc) {
        splits = (g->Sk + 2 * kBc - 1) / (2 * kBc);
        const int64_t room = kFillBlocks / blocks > 1 ? kFillBlocks / blocks : 1;
        splits = splits < room ? splits : room;
        splits = splits < 65535 ? splits : 65535;
        kchunk = ((g->Sk + splits - 1) / splits + kBc - 1) / kBc * kBc;
        splits = (g->Sk + kchunk - 1) / kchunk;
    }
    dim3 grid((unsigned)((g->M + kBr - 1) / kBr), (unsigned)g->G, (unsigned)splits);
    const T *tq = static_cast<const T *>(q), *tk = static_cast<const T *>(k),
            *tv = static_cast<const T *>(v);
    if (splits == 1) {
        k_flash_fwd_mma<T, D><<<grid, kMmaThreads, bytes, sc.s>>>(
            *g, tq, tk, tv, static_cast<T *>(out), lse, kchunk, nullptr, nullptr);
        return cudaGetLastError();
    }
    const size_t rows = (size_t)g->G * g->M;
    void *part = NULL;
    *st = tp__cuda_scratch(sc.fn, sc.dev, sc.s, (size_t)splits * rows * (D + 1) * sizeof(float),
                           &part);
    if (*st != TP_OK)
        return cudaSuccess;
    float *opart = static_cast<float *>(part), *lpart = opart + (size_t)splits * rows * D;
    k_flash_fwd_mma<T, D><<<grid, kMmaThreads, bytes, sc.s>>>(
        *g, tq, tk, tv, static_cast<T *>(out), lse, kchunk, opart, lpart);
    e = cudaGetLastError();
    if (e == cudaSuccess) {
        const int64_t n = (int64_t)rows * D;
        const unsigned cg = (unsigned)((n + 255) / 256 < 65535 ? (n + 255) / 256 : 65535);
        k_flash_combine<T><<<cg, 256, 0, sc.s>>>(opart, lpart, (int)splits, (int64_t)rows, D,
                                                 static_cast<T *>(out), lse);
        e = cudaGetLastError();
    }
    tp__cuda_scratch_free(part, sc.s);
    return e;
}

template <class T, int D>
cudaError_t launch_bwd_dq(const Scope &sc, const tp__attn_geom *g, const T *q, const T *k,
                          const T *v, const float *lse, const T *gout, const float *delta,
                          void *gq)
{
    const size_t bytes = dq_smem_bytes<D>();
    static std::atomic<uint64_t> done;
    cudaError_t e = allow_smem(k_flash_bwd_dq_mma<T, D>, bytes, sc.dev, done);
    if (e != cudaSuccess)
        return e;
    dim3 grid((unsigned)((g->M + kBr - 1) / kBr), (unsigned)g->G);
    k_flash_bwd_dq_mma<T, D><<<grid, kMmaThreads, bytes, sc.s>>>(*g, q, k, v, lse, gout, delta,
                                                                 static_cast<T *>(gq));
    return cudaGetLastError();
}

template <class T, int D>
cudaError_t launch_bwd_dkv(const Scope &sc, const tp__attn_geom *g, const T *q, const T *k,
                           const T *v, const float *lse, const T *gout, const float *delta,
                           void *gk, void *gv)
{
    const size_t bytes = dkv_smem_bytes<D>();
    static std::atomic<uint64_t> done;
    cudaError_t e = allow_smem(k_flash_bwd_dkv_mma<T, D>, bytes, sc.dev, done);
    if (e != cudaSuccess)
        return e;
    dim3 grid((unsigned)((g->Sk + kBc - 1) / kBc), (unsigned)g->G);
    k_flash_bwd_dkv_mma<T, D><<<grid, kMmaThreads, bytes, sc.s>>>(
        *g, q, k, v, lse, gout, delta, static_cast<T *>(gk), static_cast<T *>(gv));
    return cudaGetLastError();
}

dim3 rows_grid(int64_t n, int64_t G)
{
    int64_t x = (n + kRowWarps - 1) / kRowWarps;
    return dim3((unsigned)(x > 0 ? x : 1), (unsigned)(G < 65535 ? (G > 0 ? G : 1) : 65535));
}

bool takes(tp_dtype dtype)
{
    return dtype == TP_F32 || dtype == TP_BF16 || dtype == TP_F16;
}

} /* namespace */

extern "C" tp_status tp__cuda_flash_attn_fwd(tp_device dev, tp_dtype dtype,
                                             const tp__attn_geom *g, const void *q,
                                             const void *k, const void *v, void *out,
                                             float *lse)
{
    if (!takes(dtype))
        return tp__kernels_unsupported(tp__kernels_cuda, TP__KOP_FLASH_ATTN_FWD, dtype);
    if (g->G <= 0 || g->M <= 0)
        return TP_OK;
    Scope sc;
    TP_CHECK(scope_begin(&sc, "flash attention (CUDA)", dev));
    tp_status st = TP_OK; /* a scratch allocation's failure (already recorded) */
    cudaError_t err = by_dtype(dtype, [&](auto tag) -> cudaError_t {
        using T = decltype(tag);
        if constexpr (!std::is_same<T, float>::value) {
            if (mma_fits(dtype, g, q, k, v, out))
                return g->D == 64 ? launch_mma<T, 64>(sc, g, q, k, v, out, lse, &st)
                                  : launch_mma<T, 128>(sc, g, q, k, v, out, lse, &st);
        }
        k_flash_fwd_rows<T><<<rows_grid(g->M, g->G), kRowWarps * 32, 0, sc.s>>>(
            *g, static_cast<const T *>(q), static_cast<const T *>(k), static_cast<const T *>(v),
            static_cast<T *>(out), lse);
        return cudaGetLastError();
    });
    if (st != TP_OK) {
        (void)scope_end(&sc, cudaSuccess);
        return st;
    }
    return scope_end(&sc, err);
}

extern "C" tp_status tp__cuda_flash_attn_bwd(tp_device dev, tp_dtype dtype,
                                             const tp__attn_geom *g, const void *q,
                                             const void *k, const void *v, const void *out,
                                             const float *lse, const void *gout, float *delta,
                                             void *gq, void *gk, void *gv)
{
    if (!takes(dtype))
        return tp__kernels_unsupported(tp__kernels_cuda, TP__KOP_FLASH_ATTN_BWD, dtype);
    if (g->G <= 0)
        return TP_OK;
    Scope sc;
    TP_CHECK(scope_begin(&sc, "flash attention backward (CUDA)", dev));
    cudaError_t err = by_dtype(dtype, [&](auto tag) -> cudaError_t {
        using T = decltype(tag);
        const T *tq = static_cast<const T *>(q), *tk = static_cast<const T *>(k),
                *tv = static_cast<const T *>(v), *to = static_cast<const T *>(out),
                *tg = static_cast<const T *>(gout);
        if constexpr (!std::is_same<T, float>::value) {
            if (mma_fits(dtype, g, q, k, v, out) && aligned16(gout) && aligned16(gq) &&
                aligned16(gk) && aligned16(gv) && (g->Sk + kBc - 1) / kBc <= INT32_MAX) {
                /* delta first (the rows' kernel without gq), then the two */
                if (g->M > 0)
                    k_flash_bwd_rows<T><<<rows_grid(g->M, g->G), kRowWarps * 32, 0, sc.s>>>(
                        *g, tq, tk, tv, to, lse, tg, delta, static_cast<T *>(nullptr));
                cudaError_t e = cudaGetLastError();
                if (e == cudaSuccess && gq && g->M > 0)
                    e = g->D == 64 ? launch_bwd_dq<T, 64>(sc, g, tq, tk, tv, lse, tg, delta, gq)
                                   : launch_bwd_dq<T, 128>(sc, g, tq, tk, tv, lse, tg, delta,
                                                           gq);
                if (e == cudaSuccess && (gk || gv) && g->Sk > 0)
                    e = g->D == 64
                            ? launch_bwd_dkv<T, 64>(sc, g, tq, tk, tv, lse, tg, delta, gk, gv)
                            : launch_bwd_dkv<T, 128>(sc, g, tq, tk, tv, lse, tg, delta, gk,
                                                     gv);
                return e;
            }
        }
        if (g->M > 0)
            k_flash_bwd_rows<T><<<rows_grid(g->M, g->G), kRowWarps * 32, 0, sc.s>>>(
                *g, tq, tk, tv, to, lse, tg, delta, static_cast<T *>(gq));
        if (g->Sk > 0 && (gk || gv))
            k_flash_bwd_keys<T><<<rows_grid(g->Sk, g->G), kRowWarps * 32, 0, sc.s>>>(
                *g, tq, tk, tv, lse, tg, delta, static_cast<T *>(gk), static_cast<T *>(gv));
        return cudaGetLastError();
    });
    return scope_end(&sc, err);
}
