/* The stash of selective activation recomputation (nn/recompute.c): while a
 * module set to TP_RECOMPUTE_SELECTIVE runs its forward, the outputs of the
 * ops worth keeping (GEMMs: linear and matmul; redistributions, which issue
 * the collectives) are appended to its stash; when backward runs the
 * forward again, those ops take their outputs back from the stash, in the
 * same order, instead of computing them (no GEMM, no collective), and
 * record their autograd nodes as usual. Everything else is recomputed.
 *
 * One stash is active per thread at a time (recording or replaying). The
 * recompute layer (nn) drives it; the op layer only calls the two points
 * below. Not installed. */
#ifndef TP_DTENSOR_STASH_H
#define TP_DTENSOR_STASH_H

#include <stdbool.h>

#include "core/core.h"

typedef struct tp__stash tp__stash;

tp_status tp__stash_create(tp__stash **out);
void tp__stash_free(tp__stash *s); /* NULL is a no-op */

/* Whether a stash is active on this thread (recording or replaying). */
bool tp__stash_active(void);
/* Makes s the thread's recording stash; false (nothing changed) when a
 * stash is active already. */
bool tp__stash_record_begin(tp__stash *s);
void tp__stash_record_end(tp__stash *s);
/* Makes s the thread's replaying stash from its first entry; false when a
 * stash is active already. */
bool tp__stash_replay_begin(tp__stash *s);
/* Ends the replay. st is the recompute's status: when TP_OK and entries
 * were left untaken, the forward did not run again as it ran first, and the
 * result is TP_ERR_STATE. */
tp_status tp__stash_replay_end(tp__stash *s, tp_status st);

/* ---- the points ops call ------------------------------------------------------ */

/* true while the thread's stash replays: the op takes its output. */
bool tp__stash_replaying(void);
/* While recording: keeps y (and the n tensors of saved, NULL entries
 * allowed) under tag (a static string). A no-op otherwise. */
tp_status tp__stash_put(const char *tag, tp_tensor *y, tp_tensor *const *saved, int n);
/* While replaying: the next entry's y and saved (new references); an entry
 * with another tag, or none left, is TP_ERR_STATE naming both. */
tp_status tp__stash_take(const char *tag, tp_tensor **y, tp_tensor **saved, int n);

#endif /* TP_DTENSOR_STASH_H */
