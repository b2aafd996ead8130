/* References on communicators, for the layers that keep one (meshes, DDP,
 * work handles). Not installed. */
#ifndef TP_COMM_REF_H
#define TP_COMM_REF_H

#include "tp/comm.h"

/* Adds a reference; returns comm. NULL is a no-op. Thread-safe. */
tp_comm *tp__comm_retain(tp_comm *comm);
/* Drops a reference; the last one frees the backend state and the handle, on
 * the calling thread. Unlike tp_comm_free it never refuses: outstanding work
 * handles hold references of their own. NULL is a no-op. Thread-safe. */
void tp__comm_release(tp_comm *comm);

/* tp_comm_split by a caller that knows the size of the group this rank
 * joins (a mesh: the size of its dim or slice) and that its key is its rank
 * there. The backend may read it during the call through
 * tp__comm_split_size_hint: the sim backend, which plays one rank and
 * cannot ask the others which color they chose, needs it. */
tp_status tp__comm_split_sized(tp_comm *comm, int color, int key, int size, tp_comm **out);
/* The size given to the tp__comm_split_sized running on this thread; 0
 * outside one. */
int tp__comm_split_size_hint(void);

/* Whether `desc` is the descriptor of a blocking call (work == NULL) that
 * the dispatch layer is issuing on this thread. `collective` may complete
 * such a call before returning (*work = NULL, as the backend contract
 * allows), and a built-in backend that knows it is blocking can then keep
 * its work on the stack: no allocation, no work list, no references. A
 * descriptor of anyone else (a user calling a backend table directly, the
 * descriptor check's own exchange) never matches. */
bool tp__comm_blocking_call(const tp_coll_desc *desc);

/* Plan traces (tp/plan.h) place a group in the world by the world-rank
 * distance between its consecutive members: a mesh knows it for its dims'
 * groups (the product of the later dims' sizes, times its own group's
 * stride) and sets it; 0 means unknown. */
int64_t tp__comm_global_stride(const tp_comm *comm);
void tp__comm_set_global_stride(tp_comm *comm, int64_t stride);

#endif /* TP_COMM_REF_H */
