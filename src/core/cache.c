/* The CPU caching allocator: tensor storage freed by one op is kept and handed
 * to the next op that asks for the same size class, so steady-state steps do
 * not fault fresh pages in or give them back to the system.
 *
 * Every block starts with a 64-byte header (so the storage after it keeps the
 * 64-byte alignment) recording its capacity and how it was obtained:
 *  - CACHED blocks come from aligned_alloc while the default allocator is
 *    installed and the cache limit is not 0. Small blocks (up to
 *    TP__SMALL_MAX, four size classes per power of two) go back, when freed
 *    on the thread that allocated them, to that thread's lock-free lists;
 *    freed on another thread, to a shared pool (mutex). Large blocks (page
 *    multiples) go to a shared pool searched best fit, taking a block at
 *    most a quarter larger than the request (a looser fit served a
 *    sharded parameter from its freed unsharded block: twice the memory
 *    held at 2 ranks). The bytes held idle, all pools together, stay
 *    under the process-wide limit; a free that would pass it gives the
 *    shared pools back first, then the block itself.
 *  - DIRECT blocks come from the installed allocator (tp__aligned_alloc) and
 *    go straight back to it: with a user allocator there is no caching, so
 *    every tensor allocation reaches it and nothing is held past release.
 * A thread's lists are released when it exits; tp_memory_empty_cache frees
 * the shared pools and the caller's lists at once and every other thread's
 * at its next allocation or free. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "core/cache.h"
#include "core/core.h"
#include "core/device.h"

#define TP__HDR 64
#define TP__SMALL_MAX ((size_t)1 << 20)
#define TP__NCLASS 57 /* 64, then 4 per power of two up to 1 MiB */
#define TP__PAGE ((size_t)4096)
#define TP__MAGIC 0x7470626cu
#define TP__DEFAULT_LIMIT ((size_t)1 << 30)

enum { TP__BLK_CACHED = 1, TP__BLK_DIRECT = 2 };

typedef struct tp__blk {
    size_t cap;           /* usable bytes after the header */
    void *owner;          /* the thread cache that allocated it (compared only) */
    struct tp__blk *next; /* in a free list */
    uint32_t magic;
    int16_t cls; /* size class; -1: large */
    uint8_t kind;
} tp__blk;
_Static_assert(sizeof(tp__blk) <= TP__HDR, "block header fits its 64 bytes");

typedef struct tp__tcache {
    tp__blk *lists[TP__NCLASS];
    unsigned epoch;
    struct tp__tcache *reg_next, *reg_prev; /* registry (keeps idle blocks reachable) */
} tp__tcache;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static tp__blk *g_small[TP__NCLASS]; /* blocks freed off their owner thread */
static tp__blk *g_large;
static tp__tcache *g_registry;
static atomic_size_t g_shared_small; /* blocks in g_small: lets the fast path skip the lock */
static atomic_uint g_epoch;

static atomic_size_t g_limit;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static pthread_key_t g_key;

static atomic_size_t st_allocated, st_cached, st_peak;
static atomic_uint_least64_t st_allocs, st_hits;

static _Thread_local tp__tcache *t_cache;

/* ---- limit and thread caches --------------------------------------------- */

/* "1073741824", "512M", "2G", "64k": bytes with an optional K/M/G suffix. */
static bool tp__parse_size(const char *s, size_t *out)
{
    char *end;
    if (!s || !*s || *s == '-')
        return false;
    unsigned long long v = strtoull(s, &end, 10);
    if (end == s)
        return false;
    unsigned shift = 0;
    switch (*end) {
    case 'k': case 'K': shift = 10; end++; break;
    case 'm': case 'M': shift = 20; end++; break;
    case 'g': case 'G': shift = 30; end++; break;
    default: break;
    }
    if (*end == 'b' || *end == 'B')
        end++;
    if (*end || (shift && v > (SIZE_MAX >> shift)))
        return false;
    *out = (size_t)v << shift;
    return true;
}

static void tp__tcache_flush(tp__tcache *tc);

static void tp__tcache_destroy(void *arg)
{
    tp__tcache *tc = arg;
    tp__tcache_flush(tc);
    pthread_mutex_lock(&g_lock);
    if (tc->reg_prev)
        tc->reg_prev->reg_next = tc->reg_next;
    else
        g_registry = tc->reg_next;
    if (tc->reg_next)
        tc->reg_next->reg_prev = tc->reg_prev;
    pthread_mutex_unlock(&g_lock);
    if (t_cache == tc)
        t_cache = NULL;
    free(tc);
}

static void tp__cache_init(void)
{
    size_t limit = TP__DEFAULT_LIMIT;
    size_t v;
    if (tp__parse_size(getenv("TP_CPU_CACHE_LIMIT"), &v))
        limit = v;
    atomic_store(&g_limit, limit);
    pthread_key_create(&g_key, tp__tcache_destroy);
}

/* The calling thread's cache, created on first use; NULL when that fails
 * (blocks then go through the shared pools). */
static tp__tcache *tp__tcache_get(void)
{
    tp__tcache *tc = t_cache;
    if (!tc) {
        tc = calloc(1, sizeof *tc);
        if (!tc)
            return NULL;
        tc->epoch = atomic_load(&g_epoch);
        pthread_mutex_lock(&g_lock);
        tc->reg_next = g_registry;
        if (g_registry)
            g_registry->reg_prev = tc;
        g_registry = tc;
        pthread_mutex_unlock(&g_lock);
        if (pthread_setspecific(g_key, tc) != 0) {
            tp__tcache_destroy(tc);
            return NULL;
        }
        t_cache = tc;
    }
    unsigned e = atomic_load_explicit(&g_epoch, memory_order_relaxed);
    if (tc->epoch != e) { /* tp_memory_empty_cache ran since: give ours back */
        tp__tcache_flush(tc);
        tc->epoch = e;
    }
    return tc;
}

static void tp__blk_release(tp__blk *b)
{
    atomic_fetch_sub(&st_cached, b->cap);
    free(b);
}

static void tp__tcache_flush(tp__tcache *tc)
{
    for (int c = 0; c < TP__NCLASS; c++) {
        while (tc->lists[c]) {
            tp__blk *b = tc->lists[c];
            tc->lists[c] = b->next;
            tp__blk_release(b);
        }
    }
}

/* Frees shared-pool blocks (large first) until `need` more idle bytes fit
 * under the limit, or all of them when need is SIZE_MAX. Holds g_lock. */
static void tp__shared_trim_locked(size_t need)
{
    size_t limit = atomic_load(&g_limit);
    bool all = need == SIZE_MAX;
#define TP__FITS() (!all && need <= limit && atomic_load(&st_cached) <= limit - need)
    while (g_large && !TP__FITS()) {
        tp__blk *b = g_large;
        g_large = b->next;
        tp__blk_release(b);
    }
    for (int c = TP__NCLASS - 1; c >= 0; c--) {
        while (g_small[c] && !TP__FITS()) {
            tp__blk *b = g_small[c];
            g_small[c] = b->next;
            atomic_fetch_sub(&g_shared_small, 1);
            tp__blk_release(b);
        }
    }
#undef TP__FITS
}

/* ---- size classes --------------------------------------------------------- */

/* The class of an n-byte request (n >= 1) and its capacity; -1 for large. */
static int tp__class_of(size_t n, size_t *cap)
{
    if (n <= 64) {
        *cap = 64;
        return 0;
    }
    if (n > TP__SMALL_MAX) {
        if (n > SIZE_MAX - TP__PAGE - TP__HDR)
            return -2;
        *cap = (n + TP__PAGE - 1) & ~(TP__PAGE - 1);
        return -1;
    }
    int p = 63 - __builtin_clzll((unsigned long long)(n - 1)); /* 2^p < n <= 2^(p+1) */
    size_t step = (size_t)1 << (p - 2);
    size_t k = (n + step - 1) / step; /* 5..8 */
    /* aligned_alloc wants the whole size (header + cap) a multiple of 64 */
    *cap = (k * step + TP__ALIGN - 1) & ~(size_t)(TP__ALIGN - 1);
    return 1 + (p - 6) * 4 + (int)(k - 5);
}

size_t tp__cpu_block_size(size_t nbytes)
{
    size_t cap = 0;
    return tp__class_of(nbytes ? nbytes : 1, &cap) == -2 ? SIZE_MAX : cap;
}

/* ---- allocation ----------------------------------------------------------- */

static void tp__stats_add(size_t cap, bool hit)
{
    size_t now = atomic_fetch_add(&st_allocated, cap) + cap;
    size_t peak = atomic_load(&st_peak);
    while (now > peak && !atomic_compare_exchange_weak(&st_peak, &peak, now)) {
    }
    atomic_fetch_add_explicit(&st_allocs, 1, memory_order_relaxed);
    if (hit)
        atomic_fetch_add_explicit(&st_hits, 1, memory_order_relaxed);
}

void *tp__cpu_cache_alloc(size_t nbytes, bool zero)
{
    pthread_once(&g_once, tp__cache_init);
    size_t n = nbytes ? nbytes : 1;
    size_t cap;
    int cls = tp__class_of(n, &cap);
    if (cls == -2)
        return NULL;
    tp__blk *b = NULL;
    bool hit = false;
    if (!tp__allocator_is_default() || atomic_load(&g_limit) == 0) {
        b = tp__aligned_alloc(TP__HDR + cap, TP__ALIGN);
        if (!b)
            return NULL;
        b->kind = TP__BLK_DIRECT;
        b->owner = NULL;
    } else {
        tp__tcache *tc = tp__tcache_get();
        if (cls >= 0) {
            if (tc && tc->lists[cls]) {
                b = tc->lists[cls];
                tc->lists[cls] = b->next;
            } else if (atomic_load_explicit(&g_shared_small, memory_order_relaxed)) {
                pthread_mutex_lock(&g_lock);
                if ((b = g_small[cls])) {
                    g_small[cls] = b->next;
                    atomic_fetch_sub(&g_shared_small, 1);
                }
                pthread_mutex_unlock(&g_lock);
            }
        } else {
            pthread_mutex_lock(&g_lock);
            tp__blk **best = NULL;
            for (tp__blk **pp = &g_large; *pp; pp = &(*pp)->next) {
                size_t c = (*pp)->cap;
                if (c >= cap && c - cap <= cap / 4 && (!best || c < (*best)->cap))
                    best = pp;
            }
            if (best) {
                b = *best;
                *best = b->next;
            }
            pthread_mutex_unlock(&g_lock);
        }
        if (b) {
            atomic_fetch_sub(&st_cached, b->cap);
            hit = true;
        } else {
            b = aligned_alloc(TP__ALIGN, TP__HDR + cap);
            if (!b)
                return NULL;
            b->cap = cap;
            b->kind = TP__BLK_CACHED;
        }
        b->owner = tc;
    }
    if (!hit)
        b->cap = cap;
    b->magic = TP__MAGIC;
    b->cls = (int16_t)cls;
    b->next = NULL;
    tp__stats_add(b->cap, hit);
    void *p = (char *)b + TP__HDR;
    if (zero)
        memset(p, 0, nbytes);
    return p;
}

void tp__cpu_cache_free(void *p)
{
    if (!p)
        return;
    tp__blk *b = (tp__blk *)((char *)p - TP__HDR);
    TP_ASSERT(b->magic == TP__MAGIC);
    atomic_fetch_sub(&st_allocated, b->cap);
    if (b->kind == TP__BLK_DIRECT) {
        tp__free(b);
        return;
    }
    size_t limit = atomic_load(&g_limit);
    if (!tp__allocator_is_default() || b->cap > limit) {
        free(b); /* caching is off (or the block can never fit): back to the system */
        return;
    }
    if (atomic_fetch_add(&st_cached, b->cap) + b->cap > limit) {
        pthread_mutex_lock(&g_lock);
        atomic_fetch_sub(&st_cached, b->cap);
        tp__shared_trim_locked(b->cap);
        bool fits = atomic_load(&st_cached) <= limit - b->cap;
        if (fits)
            atomic_fetch_add(&st_cached, b->cap);
        pthread_mutex_unlock(&g_lock);
        if (!fits) {
            free(b);
            return;
        }
    }
    tp__tcache *tc = tp__tcache_get();
    if (b->cls >= 0 && tc && b->owner == tc) {
        b->next = tc->lists[b->cls];
        tc->lists[b->cls] = b;
        return;
    }
    pthread_mutex_lock(&g_lock);
    if (b->cls >= 0) {
        b->next = g_small[b->cls];
        g_small[b->cls] = b;
        atomic_fetch_add(&g_shared_small, 1);
    } else {
        b->next = g_large;
        g_large = b;
    }
    pthread_mutex_unlock(&g_lock);
}

static void tp__empty_all(void)
{
    pthread_once(&g_once, tp__cache_init);
    atomic_fetch_add(&g_epoch, 1);
    if (t_cache)
        tp__tcache_get(); /* sees the new epoch: flushes */
    pthread_mutex_lock(&g_lock);
    tp__shared_trim_locked(SIZE_MAX);
    pthread_mutex_unlock(&g_lock);
}

void tp__cpu_cache_on_allocator_change(void) { tp__empty_all(); }

/* ---- public API ----------------------------------------------------------- */

/* TP_OK for the CPU (index 0), whose statistics this file keeps; a CUDA
 * device and the meta device (index 0: meta_mem.c's accounting) answer
 * through their memory tables (*other set); anything else is
 * TP_ERR_INVALID_ARG. */
static tp_status tp__memory_device(const char *fn, tp_device device, const tp__device_mem **other)
{
    *other = NULL;
    if (device.type == TP_DEVICE_CUDA || device.type == TP_DEVICE_META) {
        *other = device.type == TP_DEVICE_CUDA ? &tp__cuda_mem : &tp__meta_mem;
        return device.type == TP_DEVICE_CUDA ? TP_OK : tp__meta_mem.check(fn, device.index);
    }
    TP_ARG_CHECK(device.type == TP_DEVICE_CPU, "%s: invalid device type %d", fn, (int)device.type);
    return tp__cpu_mem.check(fn, device.index);
}

tp_status tp_memory_stats(tp_device device, tp_memory_info *out)
{
    TP_ARG_CHECK(out, "tp_memory_stats: out is NULL");
    const tp__device_mem *other;
    TP_CHECK(tp__memory_device("tp_memory_stats", device, &other));
    if (other)
        return other->memory_stats("tp_memory_stats", device.index, out);
    pthread_once(&g_once, tp__cache_init);
    size_t allocated = atomic_load(&st_allocated);
    *out = (tp_memory_info){
        .allocated = allocated,
        .reserved = allocated + atomic_load(&st_cached),
        .peak_allocated = atomic_load(&st_peak),
        .cache_limit = atomic_load(&g_limit),
        .num_allocs = atomic_load(&st_allocs),
        .num_cache_hits = atomic_load(&st_hits),
    };
    return TP_OK;
}

tp_status tp_memory_reset_peak(tp_device device)
{
    const tp__device_mem *other;
    TP_CHECK(tp__memory_device("tp_memory_reset_peak", device, &other));
    if (other)
        return other->reset_peak("tp_memory_reset_peak", device.index);
    atomic_store(&st_peak, atomic_load(&st_allocated));
    return TP_OK;
}

tp_status tp_memory_empty_cache(tp_device device)
{
    const tp__device_mem *other;
    TP_CHECK(tp__memory_device("tp_memory_empty_cache", device, &other));
    if (other)
        return other->empty_cache("tp_memory_empty_cache", device.index);
    tp__empty_all();
    return TP_OK;
}

tp_status tp_memory_set_cache_limit(tp_device device, size_t bytes)
{
    const tp__device_mem *other;
    TP_CHECK(tp__memory_device("tp_memory_set_cache_limit", device, &other));
    if (other)
        return other->set_cache_limit("tp_memory_set_cache_limit", device.index, bytes);
    pthread_once(&g_once, tp__cache_init);
    atomic_store(&g_limit, bytes);
    if (atomic_load(&st_cached) > bytes)
        tp__empty_all();
    return TP_OK;
}
