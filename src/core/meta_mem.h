/* Memory accounting on the meta device (meta_mem.c, tp/meta_memory.h):
 * meta.c reports allocations and frees; the library's hooks tag storages. */
#ifndef TP_CORE_META_MEM_H
#define TP_CORE_META_MEM_H

#include "core/core.h"
#include "tp/meta_memory.h"

/* Longest scope an owner FQN gives (tp__meta_mem_tag_owner), with its NUL. */
#define TP__META_MEM_MAX_SCOPE 512

/* Where the calling thread's current scope comes from: comm-debug (a layer
 * above core) registers tp_comm_debug_current_scope when it opens its first
 * scope; until then every storage counts in the root, TP_COMM_DEBUG_GLOBAL. */
void tp__meta_mem_set_scope_source(const char *(*current_scope)(void));

/* Who hears of a copy onto a meta tensor (tp_tensor_copy and the like,
 * which move no data there): the step recorder (tp/plan.h, a layer above
 * core) registers itself when a trace begins, so that a copy costs its
 * element-wise time in a simulated step (DDP's bucket copies) as the meta
 * kernels' copies do. NULL: nobody. */
void tp__meta_set_copy_observer(void (*observer)(tp_dtype dtype, int64_t elems));
/* Tells the observer of a copy of elems elements of dtype onto meta. */
void tp__meta_note_copy(tp_dtype dtype, int64_t elems);

/* Counts a meta storage at addr of nbytes, in the calling thread's current
 * comm-debug scope. TP_ERR_NO_MEMORY naming fn when the table cannot grow. */
tp_status tp__meta_mem_alloc(const char *fn, uintptr_t addr, size_t nbytes);
/* Uncounts it (an address never counted is ignored). */
void tp__meta_mem_free(uintptr_t addr);

/* Tags the storage of t (a plain tensor or a DTensor, whose local one is
 * meant) with category c, kept if it ranks above the current one, and moves
 * it to scope `scope` when not NULL. Does nothing for NULL, for tensors not
 * on the meta device, and when memory for a new scope cannot be had (the
 * scope is then kept). */
void tp__meta_mem_tag(const tp_tensor *t, tp_mem_category c, const char *scope);
/* The same with the scope of the module owning a parameter of FQN `fqn`
 * ("w1.weight": "w1"; "bias": the root ""); NULL keeps the scope. */
void tp__meta_mem_tag_owner(const tp_tensor *t, tp_mem_category c, const char *fqn);

/* The device table's statistics entries (meta.c). */
tp_status tp__meta_mem_stats(const char *fn, int index, tp_memory_info *out);
tp_status tp__meta_mem_reset_peak(const char *fn, int index);

#endif /* TP_CORE_META_MEM_H */
