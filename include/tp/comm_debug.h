/*
 * tp/comm_debug.h - the comm-debug counter.
 *
 * A counter records every collective issued on the calling thread (one rank)
 * while it is active, including collectives issued inside redistribute and
 * backward. Each record carries the collective kind, its size in bytes, the
 * phase (forward or backward) and the module scope: a count is added to the
 * current scope and to every enclosing scope up to "Global".
 *
 * Bytes per record follow nccl-tests' size convention: all_reduce and
 * broadcast the buffer, all_gather the (whole) recv buffer, reduce_scatter,
 * all_to_all and scatter the (whole) send buffer (for scatter: n times recv,
 * on every rank), barrier 0.
 *
 * Phase and scope are per-thread state kept whether or not a counter is
 * active, so modules and autograd can set them unconditionally.
 *
 * Read a counter (queries, writers) on the thread it is active on, or after
 * tp_comm_debug_end() once that end happens-before the read (a thread join,
 * a mutex); the writers return TP_ERR_STATE while it is active on another
 * thread. If memory for a newly seen scope cannot be allocated, the
 * collective still counts in the totals and in "Global", and
 * tp_comm_debug_write_table() ends with a note saying per-scope counts are
 * incomplete.
 */
#ifndef TP_COMM_DEBUG_H
#define TP_COMM_DEBUG_H

#include <stdint.h>
#include <stdio.h>

#include "tp/comm.h"
#include "tp/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tp_comm_debug tp_comm_debug;

typedef enum tp_phase { TP_PHASE_FORWARD = 0, TP_PHASE_BACKWARD = 1, TP_PHASE_COUNT } tp_phase;

/* Special kind for queries: every kind. */
#define TP_COLL_ANY TP_COLL_KIND_COUNT

/* The root scope every count also goes to. */
#define TP_COMM_DEBUG_GLOBAL "Global"

TP_API tp_status tp_comm_debug_create(tp_comm_debug **out);
/* NULL is a no-op. Ends it first if it is active on the calling thread. A
 * counter active on another thread is not freed (that thread still records
 * into it): the call leaves it allocated and sets tp_last_error(). */
TP_API void tp_comm_debug_free(tp_comm_debug *debug);

/* Clears the counts and makes debug the calling thread's active counter.
 * TP_ERR_STATE if another counter is active on this thread or debug is
 * active on another thread. */
TP_API tp_status tp_comm_debug_begin(tp_comm_debug *debug);
/* Stops recording; counts stay readable. TP_ERR_STATE if debug is not the
 * calling thread's active counter. */
TP_API tp_status tp_comm_debug_end(tp_comm_debug *debug);
/* The calling thread's active counter, or NULL. */
TP_API tp_comm_debug *tp_comm_debug_active(void);

/* ---- phase and scopes (per thread) --------------------------------------- */

/* Values other than TP_PHASE_FORWARD / TP_PHASE_BACKWARD are ignored. */
TP_API void tp_comm_debug_set_phase(tp_phase phase);
TP_API tp_phase tp_comm_debug_phase(void);

/* Enters a scope named `name` (copied), nested in the current one: the FQN of
 * the new scope is "<current FQN>.<name>", or just "<name>" at the top level
 * (the root module's name). Names are non-empty and contain no '.'; "Global"
 * is reserved at the top level. At most 32 levels and 255 characters of FQN.
 * Otherwise TP_ERR_INVALID_ARG, and the stack is unchanged. Scopes entered
 * while a counter is active (or open when it begins) are listed by the
 * writers even if they issue no collective. */
TP_API tp_status tp_comm_debug_push_scope(const char *name);
/* Leaves the innermost scope. TP_ERR_STATE when no scope is open. */
TP_API tp_status tp_comm_debug_pop_scope(void);
/* FQN of the innermost scope, or "Global" when none is open. Valid until the
 * thread's next push or pop. */
TP_API const char *tp_comm_debug_current_scope(void);

/* ---- queries ------------------------------------------------------------- */

/* Collectives of `kind` (or TP_COLL_ANY), both phases. */
TP_API int64_t tp_comm_debug_count(const tp_comm_debug *debug, tp_coll_kind kind);
/* All collectives recorded. */
TP_API int64_t tp_comm_debug_total(const tp_comm_debug *debug);
/* Bytes recorded for `kind` (or TP_COLL_ANY). */
TP_API int64_t tp_comm_debug_bytes(const tp_comm_debug *debug, tp_coll_kind kind);
/* Count of `kind` (or TP_COLL_ANY) in phase `phase` (or TP_PHASE_COUNT for
 * both) attributed to scope `fqn` ("Global", "mlp", "mlp.net1", ...),
 * including its nested scopes. 0 for a scope never seen. */
TP_API int64_t tp_comm_debug_module_count(const tp_comm_debug *debug, const char *fqn,
                                          tp_phase phase, tp_coll_kind kind);

/* Writes the per-scope counts as JSON:
 * {"Global": {"forward": {"all_reduce": 1}, "backward": {...}}, "mlp": ...}
 * in the order scopes were first seen; kinds with a zero count are left out.
 * TP_ERR_BACKEND if writing to f fails. */
TP_API tp_status tp_comm_debug_write_json(const tp_comm_debug *debug, FILE *f);
/* Writes a readable table in the layout of PyTorch's CommDebugMode: one
 * indented line per scope (depth by FQN), then its non-zero counts per kind
 * under "FORWARD PASS" / "BACKWARD PASS". TP_ERR_BACKEND if writing fails. */
TP_API tp_status tp_comm_debug_write_table(const tp_comm_debug *debug, FILE *f);

#ifdef __cplusplus
}
#endif

#endif /* TP_COMM_DEBUG_H */
