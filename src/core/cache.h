/* The CPU caching allocator behind the CPU memory table (tensor storage only;
 * internal objects go straight to tp__malloc). See cache.c. Not installed. */
#ifndef TP_CORE_CACHE_H
#define TP_CORE_CACHE_H

#include "base.h"

/* nbytes of 64-byte aligned tensor storage, zeroed when `zero`; NULL when out
 * of memory (the caller reports it). */
void *tp__cpu_cache_alloc(size_t nbytes, bool zero);
/* The bytes a tensor storage of nbytes takes in the statistics: its block's
 * capacity (SIZE_MAX past the largest block). Meta accounting rounds so. */
size_t tp__cpu_block_size(size_t nbytes);
/* Frees what tp__cpu_cache_alloc returned (NULL ignored). */
void tp__cpu_cache_free(void *p);
/* Called by tp_set_allocator before the allocator changes: idle cached blocks
 * go back to the system. */
void tp__cpu_cache_on_allocator_change(void);
/* alloc.c: true while the default allocator (no user allocator) is installed. */
bool tp__allocator_is_default(void);

#endif /* TP_CORE_CACHE_H */
