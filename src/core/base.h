/* Core declarations shared by the C files and the CUDA (C++) files: error
 * reporting, allocation, check macros, dtype traits, element conversions,
 * device comparison. Compiles as C11 and as C++ (no atomics here: the tensor
 * layout, which needs them, is in core.h). Declared once, here; .cu files
 * include this header (or core/cuda_rt.h) instead of redeclaring any of it.
 * Not installed. */
#ifndef TP_CORE_BASE_H
#define TP_CORE_BASE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tp/status.h"
#include "tp/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TP__ALIGN 64 /* storage alignment: a cache line, enough for AVX-512 */

/* Records `status` and a printf-style message as the calling thread's last
 * error; returns status so callers can `return tp__error(...)`. */
tp_status tp__error(tp_status status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Prefixes the current last-error text with "<prefix>: " (for context). */
void tp__error_prefix(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Copies another thread's message into the caller's last error. */
void tp__error_set_text(const char *text);

/* Allocation through the installed tp_allocator. */
void *tp__malloc(size_t size);
void *tp__calloc(size_t n, size_t size);
void *tp__aligned_alloc(size_t size, size_t alignment);
void tp__free(void *ptr);
char *tp__strdup(const char *s);
/* The growable array: makes room for element n of the array *v (n elements
 * used, *cap allocated, elem bytes each), doubling it through the allocator;
 * false when out of memory (the array is unchanged). */
bool tp__grow_array(void **v, size_t n, size_t *cap, size_t elem);

/* Check macros: evaluate a tp_status expression once, propagate failures. */
#define TP_CHECK(expr)                                                          \
    do {                                                                        \
        tp_status tp__s = (expr);                                               \
        if (tp__s != TP_OK)                                                     \
            return tp__s;                                                       \
    } while (0)
#define TP_CHECK_GOTO(expr, st, label)                                          \
    do {                                                                        \
        (st) = (expr);                                                          \
        if ((st) != TP_OK)                                                      \
            goto label;                                                         \
    } while (0)
#define TP_ARG_CHECK(cond, ...)                                                 \
    do {                                                                        \
        if (!(cond))                                                            \
            return tp__error(TP_ERR_INVALID_ARG, __VA_ARGS__);                  \
    } while (0)

/* Internal invariants only (never user input). */
void tp__assert_fail(const char *expr, const char *file, int line) __attribute__((noreturn));
#define TP_ASSERT(cond) ((cond) ? (void)0 : tp__assert_fail(#cond, __FILE__, __LINE__))

/* Normalizes a possibly negative dim against ndim; -1 if out of range. */
static inline int tp__wrap_dim(int dim, int ndim)
{
    if (dim < 0)
        dim += ndim;
    return (dim >= 0 && dim < ndim) ? dim : -1;
}

/* "[2, 3, 4]" into buf; returns buf. */
const char *tp__shape_str(int ndim, const int64_t *shape, char *buf, size_t len);

/* ---- devices -------------------------------------------------------------- */

/* true when a and b name the same device. */
static inline bool tp__device_eq(tp_device a, tp_device b)
{
    return a.type == b.type && a.index == b.index;
}

/* Why no CUDA device can be used when tp_cuda_device_count() is 0: "no CUDA
 * device", or "libtp was built without CUDA". */
const char *tp__cuda_unavailable_reason(void);

/* ---- dtypes --------------------------------------------------------------- */

/*
 * The dtype traits, one row per tp_dtype: size, name, float or not, and one
 * element's load/store as f32 and as f64 (p: the element's address, any
 * alignment). Every per-dtype property of core reads this table.
 *
 * Stores convert as tp_tensor_copy does: f32/f64 round to nearest even;
 * f16/bf16 go through f32, each step rounding to nearest even (harmless: f32
 * carries more than 2p+2 bits for both, so the result equals a direct
 * correctly rounded conversion); i32/i64 truncate toward zero like a C cast,
 * with NaN -> 0 and out-of-range values saturating where the cast would be
 * undefined.
 */
typedef struct tp__dtype_traits {
    const char *name;
    size_t size;
    bool is_float;
    float (*load_f32)(const void *p);
    void (*store_f32)(void *p, float v);
    double (*load_f64)(const void *p);
    void (*store_f64)(void *p, double v);
} tp__dtype_traits;

/* Indexed by a valid dtype (check (unsigned)dtype < TP_DTYPE_COUNT first). */
extern const tp__dtype_traits tp__dtype_traits_table[TP_DTYPE_COUNT];

/* The row of dtype, NULL for an invalid one. */
static inline const tp__dtype_traits *tp__dtype_traits_of(tp_dtype dtype)
{
    return (unsigned)dtype < TP_DTYPE_COUNT ? &tp__dtype_traits_table[dtype] : NULL;
}

/* tp_dtype_size without the call: 0 for an invalid dtype. */
static inline size_t tp__dtype_size(tp_dtype dtype)
{
    const tp__dtype_traits *tr = tp__dtype_traits_of(dtype);
    return tr ? tr->size : 0;
}

#include "convert.h"

/* Reads/writes element i of a contiguous buffer of dtype as a double (the
 * traits' load_f64/store_f64 at element i; 0 / nothing for an invalid dtype). */
double tp__load_f64(const void *base, tp_dtype dtype, int64_t i);
void tp__store_f64(void *base, tp_dtype dtype, int64_t i, double v);

/* Monotonic clock in seconds. */
double tp__now(void);

#ifdef __cplusplus
}
#endif

/* tp__philox4x32_10 (shared with the CUDA kernels) */
#include "philox.h"

#endif /* TP_CORE_BASE_H */
