/* The CUDA memory table of a build without CUDA (in place of cuda_rt.c): no
 * CUDA device exists, so `check` refuses every one and nothing else is ever
 * reached; the other entries refuse as well rather than trust that. */
#include "core/device.h"

const char *tp__cuda_unavailable_reason(void) { return "libtp was built without CUDA"; }

static tp_status tp__no_cuda(const char *fn)
{
    return tp__error(TP_ERR_NOT_SUPPORTED, "%s: built without CUDA", fn);
}

static tp_status tp__nocuda_check(const char *fn, int index)
{
    return tp__error(TP_ERR_NOT_SUPPORTED,
                     "%s: CUDA device %d requested but libtp was built without CUDA", fn, index);
}

static int tp__nocuda_count(void) { return 0; }

static tp_status tp__nocuda_alloc(const char *fn, int index, size_t nbytes, bool zero, void **out)
{
    return tp__no_cuda(fn);
}

static void tp__nocuda_free(int index, void *p) {}

static tp_status tp__nocuda_zero(const char *fn, int index, void *p, size_t nbytes)
{
    return tp__no_cuda(fn);
}

static tp_status tp__nocuda_copy(const char *fn, void *dst, tp_device dd, const void *src,
                                 tp_device sd, size_t n)
{
    return tp__no_cuda(fn);
}

static tp_status tp__nocuda_strided_copy(const char *fn, int index, size_t elem_size, int ndim,
                                         const int64_t *shape, void *dst, const int64_t *dstride,
                                         const void *src, const int64_t *sstride)
{
    return tp__no_cuda(fn);
}

static tp_status tp__nocuda_convert(const char *fn, int index, int ndim, const int64_t *shape,
                                    void *dst, tp_dtype ddtype, const int64_t *dstride,
                                    const void *src, tp_dtype sdtype, const int64_t *sstride)
{
    return tp__no_cuda(fn);
}

static tp_status tp__nocuda_sync(const char *fn, int index)
{
    return tp__no_cuda(fn);
}

static tp_status tp__nocuda_memory_stats(const char *fn, int index, tp_memory_info *out)
{
    return tp__nocuda_check(fn, index);
}

static tp_status tp__nocuda_reset_peak(const char *fn, int index)
{
    return tp__nocuda_check(fn, index);
}

static tp_status tp__nocuda_empty_cache(const char *fn, int index)
{
    return tp__nocuda_check(fn, index);
}

static tp_status tp__nocuda_set_cache_limit(const char *fn, int index, size_t bytes)
{
    return tp__nocuda_check(fn, index);
}

const tp__device_mem tp__cuda_mem = {
    .name = "cuda",
    .check = tp__nocuda_check,
    .count = tp__nocuda_count,
    .alloc = tp__nocuda_alloc,
    .free = tp__nocuda_free,
    .zero = tp__nocuda_zero,
    .copy = tp__nocuda_copy,
    .strided_copy = tp__nocuda_strided_copy,
    .convert = tp__nocuda_convert,
    .sync = tp__nocuda_sync,
    .memory_stats = tp__nocuda_memory_stats,
    .reset_peak = tp__nocuda_reset_peak,
    .empty_cache = tp__nocuda_empty_cache,
    .set_cache_limit = tp__nocuda_set_cache_limit,
};
