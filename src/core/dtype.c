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
    return tp__dtype_size(dtype);
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
