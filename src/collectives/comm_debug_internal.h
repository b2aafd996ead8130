/* Internal comm-debug scope entry points for modules (src/nn) and autograd
 * (src/dtensor). Not installed. */
#ifndef TP_COMM_DEBUG_INTERNAL_H
#define TP_COMM_DEBUG_INTERNAL_H

#include "core/core.h"
#include "tp/comm_debug.h"

/* Longest scope FQN, in characters. */
#define TP__CD_MAX_FQN 255

/* Enters the scope of a module: its FQN in its module tree ("" for a root)
 * has `len` characters, of which `fqn` holds at least the first
 * min(len, TP__CD_MAX_FQN + 1) (a longer one is refused, with its length, so
 * the caller may cut it); it is taken as it is rather than nested in the
 * current scope, so a module has one scope whoever calls it. `root_type` is
 * the type name the table shows for the root scope "" (NULL for other
 * modules). The limits of tp_comm_debug_push_scope apply, and "Global" is
 * refused: TP_ERR_INVALID_ARG, stack unchanged. */
tp_status tp__comm_debug_push_module(const char *fqn, size_t len, const char *root_type);

/* The calling thread's open scopes, saved to re-enter later (a backward
 * re-enters the scopes its node was created in). */
typedef struct tp__cd_saved tp__cd_saved;

/* *out is NULL when no scope is open (the backward then counts in "Global"
 * only). Saving is cheap, counter or not: open scopes are interned, once per
 * distinct stack of scopes and thread, and every save under the same open
 * scope returns the same immutable record, so an op recorded by autograd
 * neither copies nor allocates (see comm_debug.c). TP_ERR_NO_MEMORY when a
 * record cannot be allocated. */
tp_status tp__comm_debug_save(tp__cd_saved **out);
/* Releases what a save returned (interned records stay; NULL is a no-op). */
void tp__comm_debug_saved_free(tp__cd_saved *saved);
/* Pushes the saved scopes, outermost first, on top of the current ones;
 * returns how many it pushed (all of them unless the stack is full). */
int tp__comm_debug_enter(const tp__cd_saved *saved);
/* Number of open scopes, and popping n of them. */
int tp__comm_debug_depth(void);
void tp__comm_debug_leave(int n);

/* TP_DEBUG (core/log.h): a communicator's id, the same on every rank of its
 * group (a split's is derived from its parent's, the parent's split count
 * and the color); and the TRACE line of a collective the dispatch layer
 * issued (bytes as the counter records them; seconds < 0: not completed
 * yet, handed out as work). */
uint32_t tp__comm_debug_comm_id(uint32_t parent, uint32_t seq, int color);
void tp__comm_debug_trace(const tp_comm *comm, const tp_coll_desc *d, size_t bytes,
                          double seconds);

#endif /* TP_COMM_DEBUG_INTERNAL_H */
