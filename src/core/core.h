/* Internal core definitions: error reporting, allocation, check macros and
 * the tensor layout. Not installed. */
#ifndef TP_CORE_H
#define TP_CORE_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tp/status.h"
#include "tp/tensor.h"

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
/* Makes room for element n of the growing array *v (n elements used, *cap
 * allocated, elem bytes each), doubling it through the allocator; false when
 * out of memory (the array is unchanged). */
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

/* ---- tensors -------------------------------------------------------------- */

typedef struct tp_storage {
    atomic_long refcount;
    void *data;
    size_t nbytes;
    tp_device device;
    void (*deleter)(void *data, void *ctx); /* NULL: freed by libtp */
    void *deleter_ctx;
    bool owned; /* false for blobs without deleter */
} tp_storage;

struct tp_tensor {
    atomic_long refcount;
    tp_storage *storage;
    tp_dtype dtype;
    int ndim;
    int64_t shape[TP_MAX_DIMS];
    int64_t stride[TP_MAX_DIMS]; /* elements */
    int64_t offset;              /* elements from storage->data */
    /* State of the upper layers, freed through tp__tensor_finalizer when the
     * last reference goes. A DTensor has storage == NULL, shape = the global
     * shape, and dist set; the dtensor layer's struct begins with the local
     * shard (struct tp__dist_head). */
    void *autograd;
    struct tp__dist_head *dist;
};

struct tp__dist_head {
    tp_tensor *local;
};

/* Installed by the dtensor layer before it hangs state on any tensor (rank
 * threads race to install the same value, hence atomic). */
typedef void (*tp__finalizer_fn)(tp_tensor *t);
extern _Atomic(tp__finalizer_fn) tp__tensor_finalizer;

/* Refuses a DTensor where core needs a plain tensor. */
#define TP_PLAIN_CHECK(fn, t, what)                                             \
    do {                                                                        \
        if ((t) && (t)->dist)                                                   \
            return tp__error(TP_ERR_INVALID_ARG,                                \
                             "%s: %s is a DTensor; use tp_dtensor_local, "      \
                             "tp_dtensor_to_local or tp_dtensor_full_tensor",   \
                             (fn), (what));                                     \
    } while (0)

/* Normalizes a possibly negative dim against ndim; -1 if out of range. */
static inline int tp__wrap_dim(int dim, int ndim)
{
    if (dim < 0)
        dim += ndim;
    return (dim >= 0 && dim < ndim) ? dim : -1;
}

/* "[2, 3, 4]" into buf; returns buf. */
const char *tp__shape_str(int ndim, const int64_t *shape, char *buf, size_t len);
/* out = the n sizes (each >= 0, or one -1) with the -1 replaced by total /
 * (the product of the others); *numel = the product of out, which the caller
 * compares with total when there was no -1. TP_ERR_INVALID_ARG naming fn for
 * a size below -1, two -1s, sizes other than 0 whose product passes
 * INT64_MAX (even beside a 0, as a tensor's shape) or a -1 that cannot be
 * inferred; messages number sizes[i] as dim first + i (sizes may be a slice
 * of a shape). */
tp_status tp__infer_sizes(const char *fn, int64_t total, int n, const int64_t *sizes, int first,
                          int64_t *out, int64_t *numel);

/* f16 / bf16 conversions (round to nearest even). */
float tp__f16_to_f32(uint16_t h);
uint16_t tp__f32_to_f16(float f);
float tp__bf16_to_f32(uint16_t h);
uint16_t tp__f32_to_bf16(float f);

/* Reads/writes element i of a contiguous buffer of dtype as a double. */
double tp__load_f64(const void *base, tp_dtype dtype, int64_t i);
void tp__store_f64(void *base, tp_dtype dtype, int64_t i, double v);

/* double -> integer truncating toward zero like a C cast, but defined where the
 * cast is not: NaN gives 0, out-of-range values saturate. */
static inline int32_t tp__f64_to_i32(double v)
{
    if (v != v)
        return 0;
    if (v >= 2147483647.0)
        return INT32_MAX;
    if (v <= -2147483648.0)
        return INT32_MIN;
    return (int32_t)v;
}

static inline int64_t tp__f64_to_i64(double v)
{
    if (v != v)
        return 0;
    if (v >= 9223372036854775808.0)
        return INT64_MAX;
    if (v <= -9223372036854775808.0)
        return INT64_MIN;
    return (int64_t)v;
}

/* tp__philox4x32_10 (shared with the CUDA kernels) */
#include "philox.h"

/* Monotonic clock in seconds. */
double tp__now(void);

#endif /* TP_CORE_H */
