/* The meta device's memory table (device.h): tensors with a shape and no
 * memory. alloc hands out addresses from a counter in a range no process maps
 * (above the 47-bit user address space of x86-64 and arm64), each storage
 * its own range, so views keep their offsets and the overlap checks of
 * tp_tensor_copy and the collectives see distinct storages as distinct;
 * nothing is ever read or written there. Moving bytes into meta memory does
 * nothing; moving them out of it is refused: a meta tensor has no data. */
#include <stdatomic.h>

#include "core/core.h"
#include "core/meta_mem.h"

/* 2^52: past every user address space we run on, and 2^63 - 2^52 bytes of
 * room before the counter could wrap. */
#define TP__META_BASE ((uint64_t)1 << 52)

static _Atomic uint64_t tp__meta_next = TP__META_BASE;

tp_status tp__meta_refuse(const char *fn, const char *what)
{
    return tp__error(TP_ERR_INVALID_ARG,
                     "%s: %s is a meta tensor: it has a shape but no data to read (move the "
                     "model off the meta device first, e.g. tp_module_to)",
                     fn, what);
}

static tp_status meta_check(const char *fn, int index)
{
    TP_ARG_CHECK(index == 0, "%s: meta device index must be 0, got %d", fn, index);
    return TP_OK;
}

static int meta_count(void)
{
    return 1;
}

static tp_status meta_alloc(const char *fn, int index, size_t nbytes, bool zero, void **out)
{
    uint64_t span = ((uint64_t)nbytes + 63) / 64 * 64 + 64; /* never 0, 64-byte aligned */
    uint64_t a = atomic_fetch_add_explicit(&tp__meta_next, span, memory_order_relaxed);
    /* memory accounting (meta_mem.c): the bytes this storage would take */
    TP_CHECK(tp__meta_mem_alloc(fn, (uintptr_t)a, nbytes));
    *out = (void *)(uintptr_t)a;
    return TP_OK;
}

static void meta_free(int index, void *p)
{
    tp__meta_mem_free((uintptr_t)p);
}

/* tp_memory_empty_cache: nothing is cached; tp_memory_set_cache_limit: no
 * cache to limit. */
static tp_status meta_empty_cache(const char *fn, int index)
{
    return TP_OK;
}

static tp_status meta_set_cache_limit(const char *fn, int index, size_t bytes)
{
    return tp__error(TP_ERR_NOT_SUPPORTED, "%s: the meta device has no cache to limit", fn);
}

static tp_status meta_zero(const char *fn, int index, void *p, size_t nbytes)
{
    return TP_OK;
}

/* Into meta memory: nothing to do. Out of it: there is nothing to read. */
static tp_status meta_copy(const char *fn, void *dst, tp_device dd, const void *src, tp_device sd,
                           size_t n)
{
    if (dd.type != TP_DEVICE_META)
        return tp__meta_refuse(fn, "src");
    return TP_OK;
}

static tp_status meta_strided_copy(const char *fn, int index, size_t elem_size, int ndim,
                                   const int64_t *shape, void *dst, const int64_t *dstride,
                                   const void *src, const int64_t *sstride)
{
    return TP_OK;
}

static tp_status meta_convert(const char *fn, int index, int ndim, const int64_t *shape, void *dst,
                              tp_dtype ddtype, const int64_t *dstride, const void *src,
                              tp_dtype sdtype, const int64_t *sstride)
{
    return TP_OK;
}

static tp_status meta_sync(const char *fn, int index)
{
    return TP_OK;
}

const tp__device_mem tp__meta_mem = {
    .name = "meta",
    .check = meta_check,
    .count = meta_count,
    .alloc = meta_alloc,
    .free = meta_free,
    .zero = meta_zero,
    .copy = meta_copy,
    .strided_copy = meta_strided_copy,
    .convert = meta_convert,
    .sync = meta_sync,
    /* memory statistics: the accounting of meta_mem.c */
    .memory_stats = tp__meta_mem_stats,
    .reset_peak = tp__meta_mem_reset_peak,
    .empty_cache = meta_empty_cache,
    .set_cache_limit = meta_set_cache_limit,
};
