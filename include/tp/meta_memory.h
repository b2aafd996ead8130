/*
 * tp/meta_memory.h - memory accounting on the meta device.
 *
 * A meta tensor has no memory, but the meta device counts the bytes its
 * storage would take, so a program run on TP_META (with a sim world, one
 * rank of any size: docs/sim.md) says how much memory that rank needs:
 * tp_memory_stats(TP_META, &info) and tp_memory_reset_peak(TP_META) work as
 * on the CPU (allocated, peak_allocated, num_allocs; reserved equals
 * allocated, there is no cache; num_cache_hits and cache_limit are 0), and
 * the functions below break the bytes down by category and by module scope.
 *
 * What is counted: every meta storage allocation (tensors, views share
 * their storage's bytes), rounded as tp_meta_memory_set_rounding says. The
 * counters are process-wide, like the CPU's: a sim rank is one thread, and
 * with several threads on meta at once their bytes add up (run one sim rank
 * at a time to read one rank's numbers, as tp_sim_each_rank does).
 *
 * Categories: the library tags a storage when it learns what it holds:
 * parameters when registered (tp_module_register_parameter,
 * tp_module_set_parameter) and again at each forward of their module,
 * gradients when autograd accumulates them into a leaf, optimizer states
 * (Adam's m and v) and f32 master copies of bf16/f16 parameters when the
 * optimizer creates them, activations when an op's autograd node keeps them
 * for the backward (its inputs and saved tensors). Everything else (outputs
 * not kept, gradients of non-leaves, DDP buckets, temporaries) is "other".
 * A storage keeps the highest category it was tagged with, in the order
 * other < activations < gradients < optimizer < master < parameters (a
 * parameter an op saves stays a parameter).
 *
 * Scopes: a storage belongs to the comm-debug scope open on the allocating
 * thread (tp/comm_debug.h: the module FQN inside tp_module_forward, and in
 * the backward the scope of the forward that recorded the op; "Global"
 * outside every scope), except that a parameter belongs to its module's
 * scope once the module has run a forward, and an optimizer state or master
 * copy to its parameter's module.
 *
 * Three views of the bytes: LIVE (now), AT_PEAK (the live set when
 * peak_allocated was reached; the per-scope and per-category split of that
 * one moment) and TOTAL (every allocation since the last
 * tp_memory_reset_peak(TP_META), or the process start, by where it was
 * allocated and what it was tagged as). tp_memory_reset_peak(TP_META) sets
 * the peak to the live bytes, AT_PEAK to LIVE and TOTAL to 0.
 *
 * These signatures are stable for tools built on them (tp-plan):
 *   tp_meta_memory_set_rounding, tp_meta_memory_rounding,
 *   tp_mem_category_name, tp_meta_memory_bytes, tp_meta_memory_scope_count,
 *   tp_meta_memory_scope_name, tp_meta_memory_write_report.
 * All are thread-safe.
 */
#ifndef TP_META_MEMORY_H
#define TP_META_MEMORY_H

#include <stddef.h>
#include <stdio.h>

#include "tp/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum tp_mem_category {
    TP_MEM_PARAMETERS = 0,
    TP_MEM_GRADIENTS,
    TP_MEM_OPTIMIZER,   /* optimizer states: Adam's m and v, SGD momentum */
    TP_MEM_MASTER,      /* f32 master copies of bf16/f16 parameters */
    TP_MEM_ACTIVATIONS, /* tensors autograd keeps for the backward */
    TP_MEM_OTHER,
    TP_MEM_CATEGORY_COUNT,
    TP_MEM_ANY = -1 /* every category, in queries */
} tp_mem_category;

/* "parameters", "gradients", "optimizer", "master", "activations", "other";
 * "any" for TP_MEM_ANY; NULL for anything else. */
TP_API const char *tp_mem_category_name(tp_mem_category c);

/* How a storage of n bytes is counted: as asked, or as the allocator of a
 * real device would hand it out, so that meta and a real run compare. */
typedef enum tp_meta_rounding {
    TP_META_ROUND_EXACT = 0, /* n bytes (the default) */
    TP_META_ROUND_CPU,       /* the CPU caching allocator's block for n (tp/tensor.h) */
    TP_META_ROUND_CUDA,      /* max(n, 1) rounded up to 512, as CUDA statistics count */
} tp_meta_rounding;

/* Sets how later allocations are counted (live ones keep what they were
 * counted as). TP_ERR_INVALID_ARG for a value not in the enum. */
TP_API tp_status tp_meta_memory_set_rounding(tp_meta_rounding r);
TP_API tp_meta_rounding tp_meta_memory_rounding(void);

typedef enum tp_meta_mem_view {
    TP_META_MEM_LIVE = 0,
    TP_META_MEM_AT_PEAK,
    TP_META_MEM_TOTAL,
} tp_meta_mem_view;

/* Bytes of category c (TP_MEM_ANY: all) in scope `scope` (its FQN as
 * comm-debug names it, "Global" outside every scope; NULL: every scope) in
 * `view`. 0 for a scope never seen or an invalid view or category. */
TP_API size_t tp_meta_memory_bytes(tp_meta_mem_view view, const char *scope, tp_mem_category c);

/* Number of scopes seen since the process started, and the FQN of scope i
 * (0 <= i < count; NULL otherwise), in the order first seen. The string
 * stays valid until the process ends. */
TP_API int tp_meta_memory_scope_count(void);
TP_API const char *tp_meta_memory_scope_name(int i);

typedef enum tp_meta_report_format {
    TP_META_REPORT_TABLE = 0, /* aligned text, one row per scope */
    TP_META_REPORT_JSON,      /* one JSON object (docs/sim.md) */
} tp_meta_report_format;

/* Writes the counters and the breakdown to f: allocated, peak and number of
 * allocations, then per category and per scope the bytes at the peak and in
 * total (scopes with no bytes in either are left out), and a last row or
 * key for all scopes. TP_ERR_INVALID_ARG for a NULL f or an unknown format,
 * TP_ERR_BACKEND when writing fails. */
TP_API tp_status tp_meta_memory_write_report(FILE *f, tp_meta_report_format format);

#ifdef __cplusplus
}
#endif

#endif /* TP_META_MEMORY_H */
