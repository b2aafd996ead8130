/* The element conversion rules, written once for the host (C) and the CUDA
 * device (nvcc compiles them __host__ __device__): f16 / bf16 <-> f32 round to
 * nearest even with NaN kept quiet, and float -> integer truncates like a C
 * cast where that is defined (NaN gives 0, out of range saturates). core's
 * dtype traits, the CPU kernels' conversions and the CUDA conversion kernel
 * all call these. Included by base.h. Not installed. */
#ifndef TP_CORE_CONVERT_H
#define TP_CORE_CONVERT_H

#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define TP__CONVERT_FN static __host__ __device__ __forceinline__
#else
#define TP__CONVERT_FN static inline
#endif

TP__CONVERT_FN uint32_t tp__f32_bits(float f)
{
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    return x;
}

TP__CONVERT_FN float tp__bits_f32(uint32_t x)
{
    float f;
    memcpy(&f, &x, sizeof f);
    return f;
}

TP__CONVERT_FN float tp__f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;

    if (exp == 0x1f) /* Inf, or NaN with its payload kept */
        return tp__bits_f32(sign | 0x7f800000u | (man << 13));
    if (exp == 0) {
        if (man == 0)
            return tp__bits_f32(sign);
        /* Subnormal m * 2^-24: every one is a normal f32, so shift the leading
         * one up to the implicit-bit position and lower the exponent to match. */
        uint32_t e = 113; /* f32 biased exponent of 2^-14 */
        while (!(man & 0x400u)) {
            man <<= 1;
            e--;
        }
        return tp__bits_f32(sign | (e << 23) | ((man & 0x3ffu) << 13));
    }
    return tp__bits_f32(sign | ((exp + 112) << 23) | (man << 13));
}

TP__CONVERT_FN uint16_t tp__f32_to_f16(float f)
{
    uint32_t x = tp__f32_bits(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t abs = x & 0x7fffffffu;

    if (abs > 0x7f800000u) /* NaN: keep the top payload bits, force quiet so it cannot become Inf */
        return (uint16_t)(sign | 0x7e00u | ((abs >> 13) & 0x3ffu));
    /* 65520 is halfway between 65504 (max f16, odd mantissa) and 2^16, so it
     * and everything above rounds to Inf under round-half-even. */
    if (abs >= 0x477ff000u)
        return (uint16_t)(sign | 0x7c00u);
    if (abs >= 0x38800000u) { /* normal f16 range: >= 2^-14 */
        uint32_t h = ((abs >> 23) - 112) << 10 | ((abs >> 13) & 0x3ffu);
        uint32_t rem = abs & 0x1fffu;
        /* a carry out of the mantissa correctly bumps the exponent */
        if (rem > 0x1000u || (rem == 0x1000u && (h & 1u)))
            h++;
        return (uint16_t)(sign | h);
    }
    /* Subnormal f16 (or zero): result = round(value / 2^-24). With the implicit
     * bit, value = m * 2^(e-150), so value / 2^-24 = m >> (126 - e). Below
     * e = 102 the value is under half of 2^-24 and rounds to zero. */
    uint32_t e = abs >> 23;
    if (e < 102)
        return sign;
    uint32_t m = (abs & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126 - e; /* 14..24 */
    uint32_t h = m >> shift;
    uint32_t rem = m & ((1u << shift) - 1);
    uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (h & 1u)))
        h++; /* may carry into 0x400, the smallest normal: still the right encoding */
    return (uint16_t)(sign | h);
}

TP__CONVERT_FN float tp__bf16_to_f32(uint16_t h)
{
    return tp__bits_f32((uint32_t)h << 16);
}

TP__CONVERT_FN uint16_t tp__f32_to_bf16(float f)
{
    uint32_t x = tp__f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) /* NaN: truncating could clear the payload into Inf */
        return (uint16_t)((x >> 16) | 0x0040u);
    /* Round half to even on the 16 dropped bits; overflow carries into the
     * exponent and ends at Inf exactly when it should. */
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

/* double -> integer truncating toward zero like a C cast, but defined where the
 * cast is not: NaN gives 0, out-of-range values saturate. */
TP__CONVERT_FN int32_t tp__f64_to_i32(double v)
{
    if (v != v)
        return 0;
    if (v >= 2147483647.0)
        return INT32_MAX;
    if (v <= -2147483648.0)
        return INT32_MIN;
    return (int32_t)v;
}

TP__CONVERT_FN int64_t tp__f64_to_i64(double v)
{
    if (v != v)
        return 0;
    if (v >= 9223372036854775808.0)
        return INT64_MAX;
    if (v <= -9223372036854775808.0)
        return INT64_MIN;
    return (int64_t)v;
}

#endif /* TP_CORE_CONVERT_H */
