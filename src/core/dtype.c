/* Dtype properties, f16/bf16 <-> f32 conversion and element load/store as
 * double. The half-precision conversions are pure integer bit manipulation so
 * that they behave identically on every C11 compiler and FPU mode (no
 * _Float16, no F16C, no dependence on the current rounding mode). */
#include <string.h>

#include "core/core.h"

static const size_t tp__dtype_sizes[TP_DTYPE_COUNT] = {
    [TP_F32] = 4, [TP_F64] = 8, [TP_F16] = 2, [TP_BF16] = 2, [TP_I32] = 4, [TP_I64] = 8,
};

static const char *const tp__dtype_names[TP_DTYPE_COUNT] = {
    [TP_F32] = "f32", [TP_F64] = "f64", [TP_F16] = "f16",
    [TP_BF16] = "bf16", [TP_I32] = "i32", [TP_I64] = "i64",
};

/* The cast to unsigned also rejects negative values of the enum. */
static bool tp__dtype_valid(tp_dtype dtype) { return (unsigned)dtype < TP_DTYPE_COUNT; }

size_t tp_dtype_size(tp_dtype dtype)
{
    return tp__dtype_valid(dtype) ? tp__dtype_sizes[dtype] : 0;
}

const char *tp_dtype_name(tp_dtype dtype)
{
    return tp__dtype_valid(dtype) ? tp__dtype_names[dtype] : "invalid";
}

bool tp_dtype_is_float(tp_dtype dtype)
{
    return dtype == TP_F32 || dtype == TP_F64 || dtype == TP_F16 || dtype == TP_BF16;
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
    const char *p = (const char *)base + (size_t)i * tp_dtype_size(dtype);
    switch (dtype) {
    case TP_F32: {
        float v;
        memcpy(&v, p, sizeof v);
        return v;
    }
    case TP_F64: {
        double v;
        memcpy(&v, p, sizeof v);
        return v;
    }
    case TP_F16: {
        uint16_t v;
        memcpy(&v, p, sizeof v);
        return tp__f16_to_f32(v);
    }
    case TP_BF16: {
        uint16_t v;
        memcpy(&v, p, sizeof v);
        return tp__bf16_to_f32(v);
    }
    case TP_I32: {
        int32_t v;
        memcpy(&v, p, sizeof v);
        return v;
    }
    case TP_I64: {
        int64_t v;
        memcpy(&v, p, sizeof v);
        return (double)v;
    }
    case TP_DTYPE_COUNT:
        break;
    }
    return 0.0;
}

/*
 * Conversion rules for a double stored into dtype:
 * - f32/f64: C conversion (round to nearest even).
 * - f16/bf16: double -> f32 -> f16/bf16, each rounding to nearest even. The
 *   double rounding is harmless: f32 carries more than 2p+2 bits for both
 *   targets (24 >= 2*11+2 and 24 >= 2*8+2), so the result equals a direct
 *   correctly rounded conversion.
 * - i32/i64: truncation toward zero, as a C cast does. Where the C cast would
 *   be undefined the result is defined instead: NaN stores 0 and values
 *   outside the range saturate to the type's min/max.
 */
void tp__store_f64(void *base, tp_dtype dtype, int64_t i, double v)
{
    char *p = (char *)base + (size_t)i * tp_dtype_size(dtype);
    switch (dtype) {
    case TP_F32: {
        float x = (float)v;
        memcpy(p, &x, sizeof x);
        return;
    }
    case TP_F64:
        memcpy(p, &v, sizeof v);
        return;
    case TP_F16: {
        uint16_t x = tp__f32_to_f16((float)v);
        memcpy(p, &x, sizeof x);
        return;
    }
    case TP_BF16: {
        uint16_t x = tp__f32_to_bf16((float)v);
        memcpy(p, &x, sizeof x);
        return;
    }
    case TP_I32: {
        int32_t x = tp__f64_to_i32(v);
        memcpy(p, &x, sizeof x);
        return;
    }
    case TP_I64: {
        int64_t x = tp__f64_to_i64(v);
        memcpy(p, &x, sizeof x);
        return;
    }
    case TP_DTYPE_COUNT:
        break;
    }
}
