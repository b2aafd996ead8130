/* The CUDA engine's core half: error text, device switching, a compute
 * stream per thread and device, and the CUDA memory table (core/device.h).
 * Built only with CUDA; cuda_stub.c stands in for it otherwise. */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "core/cuda_rt.h"
#include "core/device.h"

typedef struct tp__cuda_streams {
    cudaStream_t s[TP__CUDA_MAX_DEVICES];
} tp__cuda_streams;

static pthread_key_t tp__stream_key;
static pthread_once_t tp__stream_once = PTHREAD_ONCE_INIT;

static void tp__blocks_forget_stream(cudaStream_t s);

static void tp__streams_destroy(void *p)
{
    tp__cuda_streams *ts = p;
    int prev = 0;
    bool have_prev = cudaGetDevice(&prev) == cudaSuccess;
    for (int i = 0; i < TP__CUDA_MAX_DEVICES; i++) {
        if (!ts->s[i])
            continue;
        if (cudaSetDevice(i) == cudaSuccess) {
            /* the stream's work finishes first, and blocks it allocated stop
             * naming it (the caching allocator's free rule) */
            (void)cudaStreamSynchronize(ts->s[i]);
            tp__blocks_forget_stream(ts->s[i]);
            (void)cudaStreamDestroy(ts->s[i]);
        }
    }
    if (have_prev)
        (void)cudaSetDevice(prev);
    (void)cudaGetLastError();
    tp__free(ts);
}

static void tp__stream_key_init(void) { (void)pthread_key_create(&tp__stream_key, tp__streams_destroy); }

tp_status tp__cuda_fail(const char *fn, const char *what, cudaError_t err)
{
    (void)cudaGetLastError();
    return tp__error(err == cudaErrorMemoryAllocation ? TP_ERR_NO_MEMORY : TP_ERR_BACKEND,
                     "%s: %s failed: %s", fn, what, cudaGetErrorString(err));
}

tp_status tp__cuda_enter(const char *fn, int index, int *prev)
{
    cudaError_t err = cudaGetDevice(prev);
    if (err == cudaSuccess && *prev != index)
        err = cudaSetDevice(index);
    if (err != cudaSuccess)
        return tp__cuda_fail(fn, "cudaSetDevice", err);
    return TP_OK;
}

void tp__cuda_leave(int prev, int index)
{
    if (prev != index)
        (void)cudaSetDevice(prev);
}

tp_status tp__cuda_stream(const char *fn, int index, cudaStream_t *out)
{
    if (index < 0 || index >= TP__CUDA_MAX_DEVICES)
        return tp__error(TP_ERR_INVALID_ARG, "%s: CUDA device %d outside [0, %d)", fn, index,
                         TP__CUDA_MAX_DEVICES);
    (void)pthread_once(&tp__stream_once, tp__stream_key_init);
    tp__cuda_streams *ts = pthread_getspecific(tp__stream_key);
    if (!ts) {
        ts = tp__calloc(1, sizeof *ts);
        if (!ts)
            return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory for the stream table", fn);
        if (pthread_setspecific(tp__stream_key, ts) != 0) {
            tp__free(ts);
            return tp__error(TP_ERR_NO_MEMORY, "%s: pthread_setspecific failed", fn);
        }
    }
    if (!ts->s[index]) {
        int prev;
        TP_CHECK(tp__cuda_enter(fn, index, &prev));
        cudaError_t err = cudaStreamCreate(&ts->s[index]);
        tp__cuda_leave(prev, index);
        if (err != cudaSuccess) {
            ts->s[index] = NULL;
            return tp__cuda_fail(fn, "cudaStreamCreate", err);
        }
    }
    *out = ts->s[index];
    return TP_OK;
}

tp_status tp__cuda_stream_sync(const char *fn, int index)
{
    cudaStream_t s = NULL;
    TP_CHECK(tp__cuda_stream(fn, index, &s));
    TP_CUDA_CHECK(fn, "cudaStreamSynchronize", cudaStreamSynchronize(s));
    return TP_OK;
}

const char *tp__cuda_unavailable_reason(void) { return "no CUDA device"; }

/* ---- the CUDA memory table -------------------------------------------------- */

static tp_status tp__cuda_check(const char *fn, int index)
{
    if (index < 0)
        return tp__error(TP_ERR_INVALID_ARG, "%s: CUDA device index %d is negative", fn,
                         index);
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess) {
        (void)cudaGetLastError();
        return tp__error(TP_ERR_NOT_SUPPORTED, "%s: CUDA device %d unavailable: %s", fn, index,
                         cudaGetErrorString(err));
    }
    if (count == 0)
        return tp__error(TP_ERR_NOT_SUPPORTED, "%s: CUDA device %d unavailable: no device", fn,
                         index);
    if (index >= count)
        return tp__error(TP_ERR_INVALID_ARG, "%s: CUDA device %d out of range (%d devices)", fn,
                         index, count);
    return TP_OK;
}

static int tp__cuda_count(void)
{
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return count;
}

/* ---- the caching allocator ------------------------------------------------------
 *
 * Tensor storage on a CUDA device comes from a stream-ordered memory pool
 * that libtp creates per device (cudaMemPoolCreate, not the device's default
 * pool, so the reserved bytes are libtp's alone): cudaMallocFromPoolAsync and
 * cudaFreeAsync on the calling thread's compute stream. The pool's release
 * threshold (the cache limit, unlimited by default) keeps freed memory
 * reserved through synchronizations, so later allocations reuse it without
 * cudaMalloc's and cudaFree's device-wide synchronization.
 *
 * The free rule. The pool hands freed memory out again only after the free
 * in stream order (at once to the freeing stream; to another stream once the
 * free has completed or behind an inserted dependency), so a block must be
 * freed on a stream ordered after every use of it. A block is freed on the
 * freeing thread's compute stream, which that thread's own work on it
 * precedes. When the block was allocated on another thread's stream that
 * still exists, an event recorded on that stream is waited for by the
 * freeing stream first, so the allocating thread's work on the block is done
 * before the memory can be reused. A thread's stream is synchronized before
 * it is destroyed at the thread's exit, and its blocks then name no stream.
 * Work on a block queued by a thread that neither allocated nor frees it
 * must be complete before the free (tp_cuda_synchronize, as for handing
 * tensors between threads): nothing records which streams used a block.
 *
 * Every block has a host record (pointer, counted size, allocating stream)
 * in one table; records come from tp__malloc, so the allocation-failure hook
 * (tp_set_allocator) fails CUDA allocations as well. */

#define TP__CUDA_BUCKETS 4096
#define TP__CUDA_GRAIN 512 /* allocated bytes are counted in multiples of this */

typedef struct tp__cuda_block {
    void *p;
    size_t size;
    int dev;
    cudaStream_t stream; /* the allocating stream; NULL once it is destroyed */
    struct tp__cuda_block *next;
} tp__cuda_block;

typedef struct tp__cuda_pool {
    pthread_mutex_t lock; /* the pool's creation and settings, and allocations
                             (so "reserved did not grow" is this call's) */
    cudaMemPool_t pool;   /* NULL until the device's first allocation */
    size_t limit;         /* the release threshold */
    /* under tp__blocks_lock: */
    size_t allocated, peak;
    uint64_t allocs, hits;
} tp__cuda_pool;

static tp__cuda_pool tp__pools[TP__CUDA_MAX_DEVICES];
static pthread_once_t tp__pools_once = PTHREAD_ONCE_INIT;
static tp__cuda_block *tp__blocks[TP__CUDA_BUCKETS];
static pthread_mutex_t tp__blocks_lock = PTHREAD_MUTEX_INITIALIZER;

static void tp__pools_init(void)
{
    for (int i = 0; i < TP__CUDA_MAX_DEVICES; i++) {
        (void)pthread_mutex_init(&tp__pools[i].lock, NULL);
        tp__pools[i].limit = SIZE_MAX;
    }
}

static size_t tp__bucket(const void *p)
{
    uintptr_t x = (uintptr_t)p;
    return (size_t)((x >> 9) ^ (x >> 21)) % TP__CUDA_BUCKETS;
}

static void tp__blocks_forget_stream(cudaStream_t s)
{
    pthread_mutex_lock(&tp__blocks_lock);
    for (size_t i = 0; i < TP__CUDA_BUCKETS; i++)
        for (tp__cuda_block *b = tp__blocks[i]; b; b = b->next)
            if (b->stream == s)
                b->stream = NULL;
    pthread_mutex_unlock(&tp__blocks_lock);
}

static tp_status tp__pool_reserved(const char *fn, cudaMemPool_t pool, uint64_t *out)
{
    TP_CUDA_CHECK(fn, "cudaMemPoolGetAttribute(reserved)",
                  cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, out));
    return TP_OK;
}

/* The release threshold, and access for every peer that can reach the
 * device (NCCL and cudaMemcpyPeer read pool memory from peers). */
static tp_status tp__pool_setup(const char *fn, int index, cudaMemPool_t pool, size_t limit)
{
    uint64_t thr = limit;
    TP_CUDA_CHECK(fn, "cudaMemPoolSetAttribute(release threshold)",
                  cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &thr));
    int count = 0;
    TP_CUDA_CHECK(fn, "cudaGetDeviceCount", cudaGetDeviceCount(&count));
    for (int d = 0; d < count; d++) {
        int can = 0;
        if (d == index)
            continue;
        TP_CUDA_CHECK(fn, "cudaDeviceCanAccessPeer", cudaDeviceCanAccessPeer(&can, d, index));
        if (!can)
            continue;
        struct cudaMemAccessDesc desc;
        memset(&desc, 0, sizeof desc);
        desc.location.type = cudaMemLocationTypeDevice;
        desc.location.id = d;
        desc.flags = cudaMemAccessFlagsProtReadWrite;
        TP_CUDA_CHECK(fn, "cudaMemPoolSetAccess", cudaMemPoolSetAccess(pool, &desc, 1));
    }
    return TP_OK;
}

/* Device index's pool, made at its first use; P->lock held, index current. */
static tp_status tp__pool_get(const char *fn, int index, cudaMemPool_t *out)
{
    tp__cuda_pool *P = &tp__pools[index];
    if (!P->pool) {
        int supported = 0;
        TP_CUDA_CHECK(fn, "cudaDeviceGetAttribute(memory pools)",
                      cudaDeviceGetAttribute(&supported, cudaDevAttrMemoryPoolsSupported, index));
        if (!supported)
            return tp__error(TP_ERR_NOT_SUPPORTED,
                             "%s: CUDA device %d has no stream-ordered memory pools", fn, index);
        struct cudaMemPoolProps props;
        memset(&props, 0, sizeof props);
        props.allocType = cudaMemAllocationTypePinned;
        props.handleTypes = cudaMemHandleTypeNone;
        props.location.type = cudaMemLocationTypeDevice;
        props.location.id = index;
        cudaMemPool_t pool = NULL;
        TP_CUDA_CHECK(fn, "cudaMemPoolCreate", cudaMemPoolCreate(&pool, &props));
        tp_status st = tp__pool_setup(fn, index, pool, P->limit);
        if (st != TP_OK) {
            (void)cudaMemPoolDestroy(pool);
            (void)cudaGetLastError();
            return st;
        }
        P->pool = pool;
    }
    *out = P->pool;
    return TP_OK;
}

/* size bytes on stream s from device index's pool (index current); *hit
 * when the pool's reserved memory did not grow for it. */
static tp_status tp__pool_alloc(const char *fn, int index, cudaStream_t s, size_t size, void **p,
                                bool *hit)
{
    tp__cuda_pool *P = &tp__pools[index];
    cudaMemPool_t pool = NULL;
    uint64_t r0 = 0, r1 = 0;
    pthread_mutex_lock(&P->lock);
    tp_status st = tp__pool_get(fn, index, &pool);
    if (st == TP_OK)
        st = tp__pool_reserved(fn, pool, &r0);
    if (st == TP_OK) {
        cudaError_t err = cudaMallocFromPoolAsync(p, size, pool, s);
        if (err != cudaSuccess)
            st = tp__cuda_fail(fn, "cudaMallocFromPoolAsync", err);
        else if ((st = tp__pool_reserved(fn, pool, &r1)) != TP_OK)
            (void)cudaFreeAsync(*p, s);
    }
    pthread_mutex_unlock(&P->lock);
    *hit = r1 <= r0;
    return st;
}

tp_status tp__cuda_scratch(const char *fn, int index, cudaStream_t s, size_t nbytes, void **out)
{
    if (index < 0 || index >= TP__CUDA_MAX_DEVICES)
        return tp__error(TP_ERR_INVALID_ARG, "%s: CUDA device %d outside [0, %d)", fn, index,
                         TP__CUDA_MAX_DEVICES);
    (void)pthread_once(&tp__pools_once, tp__pools_init);
    bool hit = false;
    return tp__pool_alloc(fn, index, s, nbytes ? nbytes : 1, out, &hit);
}

void tp__cuda_scratch_free(void *p, cudaStream_t s)
{
    if (p && cudaFreeAsync(p, s) != cudaSuccess)
        (void)cudaGetLastError(); /* the context is gone, and the memory with it */
}

static tp_status tp__cuda_alloc(const char *fn, int index, size_t nbytes, bool zero, void **out)
{
    if (index < 0 || index >= TP__CUDA_MAX_DEVICES)
        return tp__error(TP_ERR_INVALID_ARG, "%s: CUDA device %d outside [0, %d)", fn, index,
                         TP__CUDA_MAX_DEVICES);
    (void)pthread_once(&tp__pools_once, tp__pools_init);
    tp__cuda_block *b = tp__malloc(sizeof *b);
    if (!b)
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory for the CUDA block record", fn);
    int prev = 0;
    tp_status st = tp__cuda_enter(fn, index, &prev);
    if (st != TP_OK) {
        tp__free(b);
        return st;
    }
    cudaStream_t s = NULL;
    void *p = NULL;
    bool hit = false;
    st = tp__cuda_stream(fn, index, &s);
    /* 0 bytes still gives a real pointer */
    if (st == TP_OK)
        st = tp__pool_alloc(fn, index, s, nbytes ? nbytes : 1, &p, &hit);
    if (st == TP_OK && zero && nbytes) {
        /* complete on return: a copy on another stream may come next */
        cudaError_t err = cudaMemsetAsync(p, 0, nbytes, s);
        if (err == cudaSuccess)
            err = cudaStreamSynchronize(s);
        if (err != cudaSuccess) {
            st = tp__cuda_fail(fn, "cudaMemsetAsync", err);
            (void)cudaFreeAsync(p, s);
            (void)cudaGetLastError();
        }
    }
    tp__cuda_leave(prev, index);
    if (st != TP_OK) {
        tp__free(b);
        return st;
    }
    size_t counted = nbytes ? nbytes : 1;
    b->p = p;
    b->size = (counted + TP__CUDA_GRAIN - 1) / TP__CUDA_GRAIN * TP__CUDA_GRAIN;
    b->dev = index;
    b->stream = s;
    tp__cuda_pool *P = &tp__pools[index];
    pthread_mutex_lock(&tp__blocks_lock);
    size_t k = tp__bucket(p);
    b->next = tp__blocks[k];
    tp__blocks[k] = b;
    P->allocated += b->size;
    if (P->allocated > P->peak)
        P->peak = P->allocated;
    P->allocs++;
    P->hits += hit;
    pthread_mutex_unlock(&tp__blocks_lock);
    *out = p;
    return TP_OK;
}

/* p's record, taken out of the table and off its device's count (lock held). */
static tp__cuda_block *tp__blocks_take(void *p)
{
    for (tp__cuda_block **link = &tp__blocks[tp__bucket(p)]; *link; link = &(*link)->next) {
        tp__cuda_block *b = *link;
        if (b->p == p) {
            *link = b->next;
            tp__pools[b->dev].allocated -= b->size;
            return b;
        }
    }
    return NULL;
}

/* An event recorded on s now (NULL when that fails). */
static cudaEvent_t tp__record_on(cudaStream_t s)
{
    cudaEvent_t ev = NULL;
    if (cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) != cudaSuccess)
        return NULL;
    if (cudaEventRecord(ev, s) != cudaSuccess) {
        (void)cudaEventDestroy(ev);
        return NULL;
    }
    return ev;
}

/* Frees by the rule above; when the stream-ordered free cannot be set up
 * (no stream for this thread, no event), cudaFree, which waits for the
 * device. A failing free means the context is gone, and the memory with it. */
static void tp__cuda_free(int index, void *p)
{
    const char *fn = "tp_tensor_release";
    int prev = 0;
    bool entered = tp__cuda_enter(fn, index, &prev) == TP_OK;
    cudaStream_t s = NULL;
    if (entered && tp__cuda_stream(fn, index, &s) != TP_OK)
        s = NULL;
    cudaEvent_t ev = NULL;
    bool ordered = false;
    pthread_mutex_lock(&tp__blocks_lock);
    tp__cuda_block *b = tp__blocks_take(p);
    if (b && s) {
        if (!b->stream || b->stream == s)
            ordered = true;
        else if ((ev = tp__record_on(b->stream)) != NULL) /* b->stream lives: lock held */
            ordered = true;
    }
    pthread_mutex_unlock(&tp__blocks_lock);
    tp__free(b);
    if (!entered) {
        (void)cudaGetLastError();
        return;
    }
    cudaError_t err = cudaSuccess;
    if (ev)
        err = cudaStreamWaitEvent(s, ev, 0);
    if (ordered && err == cudaSuccess) {
        (void)cudaFreeAsync(p, s);
    } else {
        /* no stream order to rely on: after everything on the device */
        (void)cudaDeviceSynchronize();
        (void)cudaFree(p);
    }
    if (ev)
        (void)cudaEventDestroy(ev);
    (void)cudaGetLastError();
    tp__cuda_leave(prev, index);
}

/* ---- statistics and cache control (tp_memory_* for CUDA devices) ---------------- */

static tp_status tp__pool_check(const char *fn, int index)
{
    TP_CHECK(tp__cuda_check(fn, index));
    if (index >= TP__CUDA_MAX_DEVICES)
        return tp__error(TP_ERR_INVALID_ARG, "%s: CUDA device %d outside [0, %d)", fn, index,
                         TP__CUDA_MAX_DEVICES);
    (void)pthread_once(&tp__pools_once, tp__pools_init);
    return TP_OK;
}

static tp_status tp__cuda_memory_stats(const char *fn, int index, tp_memory_info *out)
{
    TP_CHECK(tp__pool_check(fn, index));
    tp__cuda_pool *P = &tp__pools[index];
    uint64_t reserved = 0;
    tp_status st = TP_OK;
    pthread_mutex_lock(&P->lock);
    if (P->pool)
        st = tp__pool_reserved(fn, P->pool, &reserved);
    size_t limit = P->limit;
    pthread_mutex_unlock(&P->lock);
    TP_CHECK(st);
    pthread_mutex_lock(&tp__blocks_lock);
    *out = (tp_memory_info){
        .allocated = P->allocated,
        .reserved = (size_t)reserved,
        .peak_allocated = P->peak,
        .cache_limit = limit,
        .num_allocs = P->allocs,
        .num_cache_hits = P->hits,
    };
    pthread_mutex_unlock(&tp__blocks_lock);
    return TP_OK;
}

static tp_status tp__cuda_reset_peak(const char *fn, int index)
{
    TP_CHECK(tp__pool_check(fn, index));
    pthread_mutex_lock(&tp__blocks_lock);
    tp__pools[index].peak = tp__pools[index].allocated;
    pthread_mutex_unlock(&tp__blocks_lock);
    return TP_OK;
}

/* Trims device index's pool to keep bytes after waiting for the device when
 * `sync` (frees still queued on streams are not idle yet). */
static tp_status tp__pool_trim(const char *fn, int index, size_t keep, bool sync)
{
    tp__cuda_pool *P = &tp__pools[index];
    int prev = 0;
    TP_CHECK(tp__cuda_enter(fn, index, &prev));
    tp_status st = TP_OK;
    /* not under P->lock: a rank blocked on it in an allocation could be one
     * whose collective the device's queued work waits for */
    cudaError_t err = sync ? cudaDeviceSynchronize() : cudaSuccess;
    if (err != cudaSuccess)
        st = tp__cuda_fail(fn, "cudaDeviceSynchronize", err);
    pthread_mutex_lock(&P->lock);
    if (st == TP_OK && P->pool && (err = cudaMemPoolTrimTo(P->pool, keep)) != cudaSuccess)
        st = tp__cuda_fail(fn, "cudaMemPoolTrimTo", err);
    pthread_mutex_unlock(&P->lock);
    tp__cuda_leave(prev, index);
    return st;
}

static tp_status tp__cuda_empty_cache(const char *fn, int index)
{
    TP_CHECK(tp__pool_check(fn, index));
    return tp__pool_trim(fn, index, 0, true);
}

static tp_status tp__cuda_set_cache_limit(const char *fn, int index, size_t bytes)
{
    TP_CHECK(tp__pool_check(fn, index));
    tp__cuda_pool *P = &tp__pools[index];
    tp_status st = TP_OK;
    pthread_mutex_lock(&P->lock);
    P->limit = bytes;
    if (P->pool) {
        uint64_t thr = bytes;
        cudaError_t err = cudaMemPoolSetAttribute(P->pool, cudaMemPoolAttrReleaseThreshold, &thr);
        if (err != cudaSuccess)
            st = tp__cuda_fail(fn, "cudaMemPoolSetAttribute(release threshold)", err);
    }
    pthread_mutex_unlock(&P->lock);
    TP_CHECK(st);
    /* what is idle beyond the new limit goes now, not at the next sync */
    return tp__pool_trim(fn, index, bytes, false);
}

static tp_status tp__cuda_zero(const char *fn, int index, void *p, size_t nbytes)
{
    int prev = 0;
    TP_CHECK(tp__cuda_enter(fn, index, &prev));
    tp_status st = TP_OK;
    TP_CUDA_CHECK_GOTO(fn, "cudaMemset", cudaMemset(p, 0, nbytes), st, done);
    TP_CUDA_CHECK_GOTO(fn, "cudaMemset", cudaDeviceSynchronize(), st, done);
done:
    tp__cuda_leave(prev, index);
    return st;
}

/* Blocking byte copy where at least one side is a CUDA device. D2D copies are
 * asynchronous to the host in CUDA; libtp synchronizes so every copy is
 * complete on return, whichever stream the caller uses next. */
static tp_status tp__cuda_memcpy(const char *fn, void *dst, tp_device dd, const void *src,
                                 tp_device sd, size_t n)
{
    int dev = dd.type == TP_DEVICE_CUDA ? dd.index : sd.index, prev = 0;
    TP_CHECK(tp__cuda_enter(fn, dev, &prev));
    cudaError_t err;
    const char *what;
    if (dd.type == TP_DEVICE_CUDA && sd.type == TP_DEVICE_CUDA) {
        if (tp__device_eq(dd, sd)) {
            what = "cudaMemcpy(device to device)";
            err = cudaMemcpy(dst, src, n, cudaMemcpyDeviceToDevice);
        } else {
            what = "cudaMemcpyPeer";
            err = cudaMemcpyPeer(dst, dd.index, src, sd.index, n);
        }
        if (err == cudaSuccess)
            err = cudaDeviceSynchronize();
    } else if (dd.type == TP_DEVICE_CUDA) {
        what = "cudaMemcpy(host to device)";
        err = cudaMemcpy(dst, src, n, cudaMemcpyHostToDevice);
    } else {
        what = "cudaMemcpy(device to host)";
        err = cudaMemcpy(dst, src, n, cudaMemcpyDeviceToHost);
    }
    tp_status st = err == cudaSuccess ? TP_OK : tp__cuda_fail(fn, what, err);
    tp__cuda_leave(prev, dev);
    return st;
}

static tp_status tp__cuda_sync(const char *fn, int index)
{
    int prev = 0;
    TP_CHECK(tp__cuda_enter(fn, index, &prev));
    tp_status st = tp__cuda_stream_sync(fn, index);
    tp__cuda_leave(prev, index);
    return st;
}

const tp__device_mem tp__cuda_mem = {
    .name = "cuda",
    .check = tp__cuda_check,
    .count = tp__cuda_count,
    .alloc = tp__cuda_alloc,
    .free = tp__cuda_free,
    .zero = tp__cuda_zero,
    .copy = tp__cuda_memcpy,
    .strided_copy = tp__cuda_strided_copy,
    .convert = tp__cuda_convert,
    .sync = tp__cuda_sync,
    .memory_stats = tp__cuda_memory_stats,
    .reset_peak = tp__cuda_reset_peak,
    .empty_cache = tp__cuda_empty_cache,
    .set_cache_limit = tp__cuda_set_cache_limit,
};
