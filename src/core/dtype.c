/* The dtype traits (core/base.h), f16/bf16 <-> f32 conversion and element
 * load/store as double. The half-precision conversions are pure integer bit
 * manipulation so that they behave identically on every C11 compiler and FPU
 * mode (no _Float16, no F16C, no dependence on the current rounding mode). */
#include <string.h>

#include "core/dtype_elem.h"

/* One element of dtype D through the inline primitives (dtype_elem.h); the
 * f32 entry points widen or narrow through double, which is exact for every
 * float a dtype holds and rounds once where it must. */
#define TP__ELEM_FNS(D)                                                         \
    static float tp__##D##_load_f32(const void *p) { return (float)tp__ld_##D(p); }            \
    static double tp__##D##_load_f64(const void *p) { return (double)tp__ld_##D(p); }          \
    static void tp__##D##_store_f32(void *p, float v) { tp__st_##D##_d(p, v); }               \
    static void tp__##D##_store_f64(void *p, double v) { tp__st_##D##_d(p, v); }
TP__ELEM_FNS(f32)
TP__ELEM_FNS(f64)
TP__ELEM_FNS(f16)
TP__ELEM_FNS(bf16)
TP__ELEM_FNS(i32)
TP__ELEM_FNS(i64)

#define TP__TRAITS(D, size, is_float)                                           \
    {#D, size, is_float, tp__##D##_load_f32, tp__##D##_store_f32, tp__##D##_load_f64,          \
     tp__##D##_store_f64}

const tp__dtype_traits tp__dtype_traits_table[TP_DTYPE_COUNT] = {
    [TP_F32] = TP__TRAITS(f32, 4, true),   [TP_F64] = TP__TRAITS(f64, 8, true),
    [TP_F16] = TP__TRAITS(f16, 2, true),   [TP_BF16] = TP__TRAITS(bf16, 2, true),
    [TP_I32] = TP__TRAITS(i32, 4, false),  [TP_I64] = TP__TRAITS(i64, 8, false),
};

size_t tp_dtype_size(tp_dtype dtype)
{
    const tp__dtype_traits *tr = tp__dtype_traits_of(dtype);
    return tr ? tr->size : 0;
}

const char *tp_dtype_name(tp_dtype dtype)
{
    const tp__dtype_traits *tr = tp__dtype_traits_of(dtype);
    return tr ? tr->name : "invalid";
}

bool tp_dtype_is_float(tp_dtype dtype)
{
    const tp__dtype_traits *tr = tp__dtype_traits_of(dtype);
    return tr && tr->is_float;
}

static uint32_t tp__f32_bits(float f)
{
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    return x;
}

static float tp__bits_f32(uint32_t x)
{
    float f;
    memcpy(&f, &x, sizeof f);
    return f;
}

float tp__f16_to_f32(uint16_t h)
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

uint16_t tp__f32_to_f16(float f)
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

float tp__bf16_to_f32(uint16_t h) { return tp__bits_f32((uint32_t)h << 16); }

uint16_t tp__f32_to_bf16(float f)
{
    uint32_t x = tp__f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) /* NaN: truncating could clear the payload into Inf */
        return (uint16_t)((x >> 16) | 0x0040u);
    /* Round half to even on the 16 dropped bits; overflow carries into the
     * exponent and ends at Inf exactly when it should. */
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

double tp__load_f64(const void *base, tp_dtype dtype, int64_t i)
{
    const tp__dtype_traits *tr = tp__dtype_traits_of(dtype);
    return tr ? tr->load_f64((const char *)base + (size_t)i * tr->size) : 0.0;
}

void tp__store_f64(void *base, tp_dtype dtype, int64_t i, double v)
{
    const tp__dtype_traits *tr = tp__dtype_traits_of(dtype);
    if (tr)
        tr->store_f64((char *)base + (size_t)i * tr->size, v);
}
