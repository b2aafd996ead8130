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

#endif /* TP_COMM_REF_H */
