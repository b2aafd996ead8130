/* Data-movement kernels of the shm backend.
 *
 * Reductions work through an L1-sized accumulator tile: every source is read
 * once into the tile, then the tile is written to every destination. That
 * keeps the traffic at (sources read + destinations written) and makes the
 * in-place case safe element for element. Large outputs use non-temporal
 * stores so that writing a destination does not first read it into the cache
 * (write-allocate), which would add a third of the memory traffic. */
#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "collectives/shm_kernels.h"
#include "core/core.h"

#define TILE_BYTES 8192

void tp__shm_store_fence(void)
{
#if defined(__SSE2__)
    _mm_sfence();
#else
    atomic_thread_fence(memory_order_seq_cst);
#endif
}

void tp__shm_copy(void *dst, const void *src, size_t bytes, bool stream)
{
#if defined(__SSE2__)
    if (stream && bytes >= 256) {
        char *d = dst;
        const char *s = src;
        size_t head = (16 - ((uintptr_t)d & 15)) & 15;
        memcpy(d, s, head);
        d += head;
        s += head;
        bytes -= head;
        size_t body = bytes & ~(size_t)63;
        for (size_t i = 0; i < body; i += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
            __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
            __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
            _mm_stream_si128((__m128i *)(d + i), a);
            _mm_stream_si128((__m128i *)(d + i + 16), b);
            _mm_stream_si128((__m128i *)(d + i + 32), c);
            _mm_stream_si128((__m128i *)(d + i + 48), e);
        }
        memcpy(d + body, s + body, bytes - body);
        return;
    }
#endif
    (void)stream;
    memcpy(dst, src, bytes);
}

/* One accumulator type per dtype: f16/bf16 accumulate in f32 and round once. */
#define APPLY_LOOP(ACC, n, expr)                                                \
    for (size_t i = 0; i < (n); i++) {                                          \
        ACC a_ = acc[i], b_ = v[i];                                             \
        acc[i] = (expr);                                                        \
    }

/* W is the type sums and products are computed in: the unsigned twin for
 * integers, so that overflow wraps (as in NCCL) instead of being undefined. */
#define COMBINE(ACC, W, op, n)                                                  \
    switch (op) {                                                               \
    case TP_SUM:                                                                \
    case TP_AVG:                                                                \
        APPLY_LOOP(ACC, n, (ACC)((W)a_ + (W)b_)) break;                         \
    case TP_PRODUCT:                                                            \
        APPLY_LOOP(ACC, n, (ACC)((W)a_ * (W)b_)) break;                         \
    case TP_MAX:                                                                \
        APPLY_LOOP(ACC, n, (b_ > a_ || b_ != b_) ? b_ : a_) break;              \
    case TP_MIN:                                                                \
        APPLY_LOOP(ACC, n, (b_ < a_ || b_ != b_) ? b_ : a_) break;              \
    default:                                                                    \
        break;                                                                  \
    }

/* Native dtypes: the accumulator has the element type. */
#define DEFINE_REDUCE_NATIVE(NAME, T, W)                                         \
    static void reduce_##NAME(tp_reduce_op op, int divisor, int nsrc,           \
                              const void *const *src, size_t soff, int ndst,    \
                              void *const *dst, size_t doff, size_t len,        \
                              bool stream)                                      \
    {                                                                           \
        enum { TN = TILE_BYTES / sizeof(T) };                                   \
        T acc[TN];                                                              \
        for (size_t base = 0; base < len; base += TN) {                         \
            size_t n = len - base < TN ? len - base : TN;                       \
            memcpy(acc, (const T *)src[0] + soff + base, n * sizeof(T));        \
            for (int q = 1; q < nsrc; q++) {                                    \
                const T *v = (const T *)src[q] + soff + base;                   \
                COMBINE(T, W, op, n)                                            \
            }                                                                   \
            if (op == TP_AVG)                                                   \
                for (size_t i = 0; i < n; i++)                                  \
                    acc[i] = (T)(acc[i] / (T)divisor);                          \
            for (int j = 0; j < ndst; j++)                                      \
                tp__shm_copy((T *)dst[j] + doff + base, acc, n * sizeof(T),     \
                             stream);                                           \
        }                                                                       \
    }

DEFINE_REDUCE_NATIVE(f32, float, float)
DEFINE_REDUCE_NATIVE(f64, double, double)
DEFINE_REDUCE_NATIVE(i32, int32_t, uint32_t)
DEFINE_REDUCE_NATIVE(i64, int64_t, uint64_t)

/* Half types: widen to f32, reduce, round to nearest even once. */
#define DEFINE_REDUCE_HALF(NAME, TO_F32, FROM_F32)                              \
    static void reduce_##NAME(tp_reduce_op op, int divisor, int nsrc,           \
                              const void *const *src, size_t soff, int ndst,    \
                              void *const *dst, size_t doff, size_t len,        \
                              bool stream)                                      \
    {                                                                           \
        enum { TN = TILE_BYTES / sizeof(float) / 2 };                           \
        float acc[TN], v[TN];                                                   \
        uint16_t out[TN];                                                       \
        for (size_t base = 0; base < len; base += TN) {                         \
            size_t n = len - base < TN ? len - base : TN;                       \
            const uint16_t *s0 = (const uint16_t *)src[0] + soff + base;        \
            for (size_t i = 0; i < n; i++)                                      \
                acc[i] = TO_F32(s0[i]);                                         \
            for (int q = 1; q < nsrc; q++) {                                    \
                const uint16_t *sq = (const uint16_t *)src[q] + soff + base;    \
                for (size_t i = 0; i < n; i++)                                  \
                    v[i] = TO_F32(sq[i]);                                       \
                COMBINE(float, float, op, n)                                    \
            }                                                                   \
            if (op == TP_AVG)                                                   \
                for (size_t i = 0; i < n; i++)                                  \
                    acc[i] /= (float)divisor;                                   \
            for (size_t i = 0; i < n; i++)                                      \
                out[i] = FROM_F32(acc[i]);                                      \
            for (int j = 0; j < ndst; j++)                                      \
                tp__shm_copy((uint16_t *)dst[j] + doff + base, out,             \
                             n * sizeof(uint16_t), stream);                     \
        }                                                                       \
    }

DEFINE_REDUCE_HALF(f16, tp__f16_to_f32, tp__f32_to_f16)
DEFINE_REDUCE_HALF(bf16, tp__bf16_to_f32, tp__f32_to_bf16)

#if defined(__SSE2__)
/* The large-buffer f32 sum/avg/product: one pass, accumulating 16 elements in
 * registers over every source and streaming them to every destination, which
 * keeps the memory traffic at exactly one read per source and one write per
 * destination with no round trip through an L1 tile. Destinations must be
 * 16-byte aligned (callers check). */
static void reduce_f32_stream(tp_reduce_op op, int divisor, int nsrc, const void *const *src,
                              size_t soff, int ndst, void *const *dst, size_t doff, size_t len)
{
    size_t body = len & ~(size_t)15;
    __m128 div = _mm_set1_ps((float)divisor);
    for (size_t i = 0; i < body; i += 16) {
        const float *s0 = (const float *)src[0] + soff + i;
        __m128 a0 = _mm_loadu_ps(s0), a1 = _mm_loadu_ps(s0 + 4);
        __m128 a2 = _mm_loadu_ps(s0 + 8), a3 = _mm_loadu_ps(s0 + 12);
        for (int q = 1; q < nsrc; q++) {
            const float *sq = (const float *)src[q] + soff + i;
            __m128 b0 = _mm_loadu_ps(sq), b1 = _mm_loadu_ps(sq + 4);
            __m128 b2 = _mm_loadu_ps(sq + 8), b3 = _mm_loadu_ps(sq + 12);
            if (op == TP_PRODUCT) {
                a0 = _mm_mul_ps(a0, b0), a1 = _mm_mul_ps(a1, b1);
                a2 = _mm_mul_ps(a2, b2), a3 = _mm_mul_ps(a3, b3);
            } else {
                a0 = _mm_add_ps(a0, b0), a1 = _mm_add_ps(a1, b1);
                a2 = _mm_add_ps(a2, b2), a3 = _mm_add_ps(a3, b3);
            }
        }
        if (op == TP_AVG) {
            a0 = _mm_div_ps(a0, div), a1 = _mm_div_ps(a1, div);
            a2 = _mm_div_ps(a2, div), a3 = _mm_div_ps(a3, div);
        }
        for (int j = 0; j < ndst; j++) {
            float *d = (float *)dst[j] + doff + i;
            _mm_stream_ps(d, a0);
            _mm_stream_ps(d + 4, a1);
            _mm_stream_ps(d + 8, a2);
            _mm_stream_ps(d + 12, a3);
        }
    }
    if (body < len)
        reduce_f32(op, divisor, nsrc, src, soff + body, ndst, dst, doff + body, len - body,
                   false);
}

static bool dsts_aligned16(int ndst, void *const *dst, size_t doff, size_t es)
{
    for (int j = 0; j < ndst; j++)
        if (((uintptr_t)((char *)dst[j] + doff * es)) & 15)
            return false;
    return true;
}
#endif

void tp__shm_reduce(tp_dtype dtype, tp_reduce_op op, int divisor, int nsrc,
                    const void *const *src, size_t src_off, int ndst, void *const *dst,
                    size_t dst_off, size_t len, bool stream)
{
#if defined(__SSE2__)
    if (stream && dtype == TP_F32 && (op == TP_SUM || op == TP_AVG || op == TP_PRODUCT) &&
        dsts_aligned16(ndst, dst, dst_off, sizeof(float))) {
        reduce_f32_stream(op, divisor, nsrc, src, src_off, ndst, dst, dst_off, len);
        return;
    }
#endif
    switch (dtype) {
    case TP_F32:
        reduce_f32(op, divisor, nsrc, src, src_off, ndst, dst, dst_off, len, stream);
        break;
    case TP_F64:
        reduce_f64(op, divisor, nsrc, src, src_off, ndst, dst, dst_off, len, stream);
        break;
    case TP_I32:
        reduce_i32(op, divisor, nsrc, src, src_off, ndst, dst, dst_off, len, stream);
        break;
    case TP_I64:
        reduce_i64(op, divisor, nsrc, src, src_off, ndst, dst, dst_off, len, stream);
        break;
    case TP_F16:
        reduce_f16(op, divisor, nsrc, src, src_off, ndst, dst, dst_off, len, stream);
        break;
    case TP_BF16:
        reduce_bf16(op, divisor, nsrc, src, src_off, ndst, dst, dst_off, len, stream);
        break;
    default:
        TP_ASSERT(!"invalid dtype");
    }
}
