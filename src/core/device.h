/* The per-device memory interface: one table per device type, with the same
 * signatures for every device. Core's tensor code reaches device memory only
 * through it (allocation, zeroing, byte and strided copies, waiting); the
 * CPU's table is core's own (tensor.c), the CUDA table belongs to the CUDA
 * engine (cuda_rt.c, or cuda_stub.c in a build without CUDA, whose entries
 * refuse). Compiles as C and C++. Not installed. */
#ifndef TP_CORE_DEVICE_H
#define TP_CORE_DEVICE_H

#include "base.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tp__device_mem {
    const char *name; /* "cpu", "cuda", "meta" */
    /* TP_OK when device `index` of this type can hold tensors; otherwise the
     * reason, recorded under fn (TP_ERR_NOT_SUPPORTED: no such device in
     * this process or build; TP_ERR_INVALID_ARG: an index out of range). */
    tp_status (*check)(const char *fn, int index);
    /* Devices of this type usable by libtp; 0 when none (never an error). */
    int (*count)(void);
    /* nbytes on device `index` (0 bytes still gives a real pointer), zeroed
     * when `zero`; complete on return. */
    tp_status (*alloc)(const char *fn, int index, size_t nbytes, bool zero, void **out);
    /* Frees what alloc returned. Cannot report errors: a device that is gone
     * took the memory with it. */
    void (*free)(int index, void *p);
    /* nbytes at p set to zero bytes; complete on return. */
    tp_status (*zero)(const char *fn, int index, void *p, size_t nbytes);
    /* n bytes from src on sd to dst on dd: at least one side is of this
     * type, the other of this type or the CPU. Complete on return. */
    tp_status (*copy)(const char *fn, void *dst, tp_device dd, const void *src, tp_device sd,
                      size_t n);
    /* dst[i] = src[i] for every multi-index i of `shape` (numel > 0), elements
     * of elem_size bytes (1, 2, 4 or 8) at the element strides dstride /
     * sstride, both on device `index`. The views must not overlap. Complete
     * on return. */
    tp_status (*strided_copy)(const char *fn, int index, size_t elem_size, int ndim,
                              const int64_t *shape, void *dst, const int64_t *dstride,
                              const void *src, const int64_t *sstride);
    /* dst[i] = src[i] converted from sdtype to ddtype for every multi-index i
     * of `shape` (numel > 0), at the element strides dstride / sstride, both
     * on device `index`, with tp_tensor_copy's rules bit for bit (core/base.h,
     * core/dtype_elem.h); equal dtypes move raw bytes as strided_copy does.
     * The views must not overlap. Complete on return. NULL for the CPU, whose
     * conversions core runs itself (tensor.c). */
    tp_status (*convert)(const char *fn, int index, int ndim, const int64_t *shape, void *dst,
                         tp_dtype ddtype, const int64_t *dstride, const void *src, tp_dtype sdtype,
                         const int64_t *sstride);
    /* Waits for the work the calling thread issued on device `index`. */
    tp_status (*sync)(const char *fn, int index);
    /* tp_memory_stats, tp_memory_reset_peak, tp_memory_empty_cache and
     * tp_memory_set_cache_limit for device `index` of this type (checked
     * with `check` first); NULL for the CPU, whose caching allocator core's
     * cache.c answers for itself. */
    tp_status (*memory_stats)(const char *fn, int index, tp_memory_info *out);
    tp_status (*reset_peak)(const char *fn, int index);
    tp_status (*empty_cache)(const char *fn, int index);
    tp_status (*set_cache_limit)(const char *fn, int index, size_t bytes);
} tp__device_mem;

extern const tp__device_mem tp__cpu_mem;  /* core (tensor.c) */
extern const tp__device_mem tp__cuda_mem; /* the CUDA engine (cuda_rt.c / cuda_stub.c) */
extern const tp__device_mem tp__meta_mem; /* shapes without memory (meta.c) */

/* TP_ERR_INVALID_ARG: "fn: what is a meta tensor: it has ... no data". The
 * answer of every core function that would read a meta tensor's elements. */
tp_status tp__meta_refuse(const char *fn, const char *what);

/* The table of a device type; NULL for an invalid type. */
static inline const tp__device_mem *tp__device_mem_of(tp_device_type type)
{
    switch (type) {
    case TP_DEVICE_CPU:
        return &tp__cpu_mem;
    case TP_DEVICE_CUDA:
        return &tp__cuda_mem;
    case TP_DEVICE_META:
        return &tp__meta_mem;
    }
    return NULL;
}

#ifdef __cplusplus
}
#endif

#endif /* TP_CORE_DEVICE_H */
