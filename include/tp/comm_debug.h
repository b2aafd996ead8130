/*
 * tp/comm_debug.h - the comm-debug counter.
 *
 * A counter records every collective issued on the calling thread (one rank)
 * while it is active, including collectives issued inside redistribute and
 * backward. Each record carries the collective kind, its size in bytes, the
 * phase (forward, backward, or a forward recomputed in backward) and the
 * scopes open on the thread: a count is added to every open scope (the
 * current one and those that enclose it, each once) and to "Global".
 *
 * Scope names. "Global" is the root of everything: it holds every record,
 * and collectives outside any scope count only there. tp_module_forward
 * enters the module's scope, whose name is the module's FQN in its module
 * tree, spelled as plans, tp_module_find and tp_module_named_parameters spell
 * it from the root: "net1", "layers.0.attention.wq". The root module's scope
 * is "" (TP_COMM_DEBUG_ROOT; tp_module_find(root, "") is the root), shown in
 * the table as the root's type name. The name does not depend on the caller:
 * a module called directly, not through its root, counts under the same
 * FQN, and not in its ancestors' scopes, which did not run. Module scopes
 * do not nest in the current scope: inside a user scope "step", the root's
 * child is still "net1" (and "step" counts it too). Scopes pushed with
 * tp_comm_debug_push_scope nest in the current scope: "attn" inside the
 * module "layers.0" is "layers.0.attn"; inside the root or at the top level
 * it is "attn". Different module trees with the same FQNs (two models, or a
 * standalone Linear besides an MLP: both are roots, "") share those scopes;
 * count them in separate counter sessions to tell them apart.
 *
 * How this differs from PyTorch 2.15's CommDebugMode: its module tracker
 * names the root by its class name and children under it ("MLP.net1"), and
 * a module reached first without its root by its own class name ("Linear"
 * for net1 called directly), so one module's name depends on who called it
 * and different Linears share one. Here a module's scope is the FQN users
 * write in plans and read in state dicts, whoever calls it, so a count can
 * be asserted under the name the plan used.
 *
 * Seen and never seen: a scope is seen by a counter when it was entered while
 * the counter was active (or was open when it began), whether or not it
 * issued a collective. tp_comm_debug_scope_count() tells a seen scope with 0
 * collectives from a name the counter never saw (an error naming it and the
 * scopes seen); tp_comm_debug_module_count() returns 0 for both, so an
 * assertion of 0 with it passes for a misspelled name too.
 *
 * Bytes per record follow nccl-tests' size convention: all_reduce and
 * broadcast the buffer, all_gather the (whole) recv buffer, reduce_scatter,
 * all_to_all and scatter the (whole) send buffer (for scatter: n times recv,
 * on every rank), barrier 0.
 *
 * Phase and scope are per-thread state kept whether or not a counter is
 * active, so modules and autograd can set them unconditionally. Every op
 * autograd records keeps the scopes open at the time (so a backward counted
 * on its own still counts in its forward's scopes); that costs the op a
 * pointer, the stacks of scopes being interned per thread.
 *
 * To see each collective as it is issued (its communicator, dtype, shape,
 * count, bytes as counted here, and duration), with the sharding strategy
 * of every op and each redistribute step before it, set TP_DEBUG=TRACE (or
 * INFO without the collectives) and TP_DEBUG_FILE=/tmp/tp-%r.log for one
 * file per rank: docs/API.md, "Debugging: TP_DEBUG".
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

/* TP_PHASE_RECOMPUTE: a forward run again during backward by activation
 * recomputation (tp_module_set_recompute): what it issues is counted there,
 * not in forward or backward, so those two read as without recomputation.
 * TP_PHASE_COUNT in a query means every phase. */
typedef enum tp_phase {
    TP_PHASE_FORWARD = 0,
    TP_PHASE_BACKWARD = 1,
    TP_PHASE_RECOMPUTE = 2,
    TP_PHASE_COUNT
} tp_phase;

/* Special kind for queries: every kind. */
#define TP_COLL_ANY TP_COLL_KIND_COUNT

/* The root scope every count also goes to. */
#define TP_COMM_DEBUG_GLOBAL "Global"
/* The scope of a root module (the top of a module tree): its FQN, "". */
#define TP_COMM_DEBUG_ROOT ""

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

/* Values other than TP_PHASE_FORWARD, TP_PHASE_BACKWARD and
 * TP_PHASE_RECOMPUTE are ignored. */
TP_API void tp_comm_debug_set_phase(tp_phase phase);
TP_API tp_phase tp_comm_debug_phase(void);

/* Enters a scope named `name` (copied), nested in the current one: the FQN of
 * the new scope is "<current FQN>.<name>", or just "<name>" at the top level
 * and inside a root module (whose FQN is ""). Names are non-empty and contain
 * no '.'; the FQN "Global" is reserved. At most 32 open scopes (module scopes
 * included) and 255 characters of FQN. Otherwise TP_ERR_INVALID_ARG, and the
 * stack is unchanged. Scopes entered while a counter is active (or open when
 * it begins) are seen: listed by the writers even if they issue no
 * collective. */
TP_API tp_status tp_comm_debug_push_scope(const char *name);
/* Leaves the innermost scope. TP_ERR_STATE when no scope is open. */
TP_API tp_status tp_comm_debug_pop_scope(void);
/* FQN of the innermost scope ("" inside a root module), or "Global" when
 * none is open. Valid until the thread's next push or pop. */
TP_API const char *tp_comm_debug_current_scope(void);

/* ---- queries ------------------------------------------------------------- */

/* Collectives of `kind` (or TP_COLL_ANY), every phase. */
TP_API int64_t tp_comm_debug_count(const tp_comm_debug *debug, tp_coll_kind kind);
/* All collectives recorded. */
TP_API int64_t tp_comm_debug_total(const tp_comm_debug *debug);
/* Bytes recorded for `kind` (or TP_COLL_ANY). */
TP_API int64_t tp_comm_debug_bytes(const tp_comm_debug *debug, tp_coll_kind kind);
/* The checked query: *count = collectives of `kind` (or TP_COLL_ANY) in
 * phase `phase` (or TP_PHASE_COUNT for all) counted in scope `fqn`
 * ("Global", "" for the root module, "net1", "layers.0.attention.wq", ...),
 * which includes what ran inside it. TP_OK with 0 for a scope seen without
 * collectives; TP_ERR_INVALID_ARG (*count 0) for a scope the counter never
 * saw, with a message naming it and listing the scopes seen, and for a NULL
 * argument or an out-of-range phase or kind; TP_ERR_STATE while the counter
 * is active on another thread. Use it to assert counts. */
TP_API tp_status tp_comm_debug_scope_count(const tp_comm_debug *debug, const char *fqn,
                                           tp_phase phase, tp_coll_kind kind, int64_t *count);
/* The same count, unchecked: 0 for a scope never seen (or a NULL argument, or
 * an out-of-range phase or kind), so "module_count(d, name, ...) == 0" also
 * holds for a misspelled name or a scope that never ran. Prefer
 * tp_comm_debug_scope_count() for assertions. */
TP_API int64_t tp_comm_debug_module_count(const tp_comm_debug *debug, const char *fqn,
                                          tp_phase phase, tp_coll_kind kind);

/* Writes the per-scope counts as JSON:
 * {"Global": {"forward": {"all_reduce": 1}, "backward": {...}}, "": ...,
 * "net1": ...} ("recompute": {...} after backward where a scope has
 * recomputed collectives) with scopes by FQN ("" the root module) in the order they
 * were first seen; kinds with a zero count are left out. TP_ERR_BACKEND if
 * writing to f fails. */
TP_API tp_status tp_comm_debug_write_json(const tp_comm_debug *debug, FILE *f);
/* Writes a readable table in the layout of PyTorch's CommDebugMode: one line
 * per scope in first-seen order, indented by how deeply it was nested when
 * first entered ("Global" at 0), then its non-zero counts per kind under
 * "FORWARD PASS" / "BACKWARD PASS". Scopes show their FQN, the root scope ""
 * the type name of its root module (the names joined by ", " when roots of
 * several types entered it). TP_ERR_BACKEND if writing fails. */
TP_API tp_status tp_comm_debug_write_table(const tp_comm_debug *debug, FILE *f);

#ifdef __cplusplus
}
#endif

#endif /* TP_COMM_DEBUG_H */
