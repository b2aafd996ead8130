/* The allocator hook: every host allocation of the library goes through it. */
#include <stdlib.h>
#include <string.h>

#include "core/cache.h"
#include "core/core.h"

static void *tp__default_alloc(void *ctx, size_t size, size_t alignment)
{
    (void)ctx;
    if (alignment < sizeof(void *))
        alignment = sizeof(void *);
    /* aligned_alloc wants a size that is a multiple of the alignment */
    size_t rounded = (size + alignment - 1) & ~(alignment - 1);
    if (rounded < size)
        return NULL;
    return aligned_alloc(alignment, rounded ? rounded : alignment);
}

static void tp__default_free(void *ctx, void *ptr)
{
    (void)ctx;
    free(ptr);
}

static tp_allocator tp__alloc = {tp__default_alloc, tp__default_free, NULL};

bool tp__allocator_is_default(void) { return tp__alloc.alloc == tp__default_alloc; }

tp_status tp_set_allocator(const tp_allocator *allocator)
{
    if (allocator && (!allocator->alloc || !allocator->free))
        return tp__error(TP_ERR_INVALID_ARG, "tp_set_allocator: alloc and free must be non-NULL");
    /* idle blocks of the CPU tensor cache go back to the system first */
    tp__cpu_cache_on_allocator_change();
    if (!allocator) {
        tp__alloc = (tp_allocator){tp__default_alloc, tp__default_free, NULL};
        return TP_OK;
    }
    tp__alloc = *allocator;
    return TP_OK;
}

tp_allocator tp_get_allocator(void) { return tp__alloc; }

void *tp__aligned_alloc(size_t size, size_t alignment)
{
    return tp__alloc.alloc(tp__alloc.ctx, size ? size : 1, alignment);
}

void *tp__malloc(size_t size) { return tp__aligned_alloc(size, _Alignof(max_align_t)); }

void *tp__calloc(size_t n, size_t size)
{
    if (size && n > SIZE_MAX / size)
        return NULL;
    void *p = tp__malloc(n * size);
    if (p)
        memset(p, 0, n * size);
    return p;
}

void tp__free(void *ptr)
{
    if (ptr)
        tp__alloc.free(tp__alloc.ctx, ptr);
}

char *tp__strdup(const char *s)
{
    size_t n = strlen(s) + 1;
    char *p = tp__malloc(n);
    if (p)
        memcpy(p, s, n);
    return p;
}

bool tp__grow_array(void **v, size_t n, size_t *cap, size_t elem)
{
    if (n < *cap)
        return true;
    size_t c = *cap ? 2 * *cap : 16;
    void *nv = tp__malloc(c * elem);
    if (!nv)
        return false;
    if (n)
        memcpy(nv, *v, n * elem);
    tp__free(*v);
    *v = nv;
    *cap = c;
    return true;
}
