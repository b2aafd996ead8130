/* Internal to libtp: the recording side of plan traces (tp/plan.h), called
 * by the meta engine (src/kernels/meta.c) and, through the observer that
 * tp_plan_trace_begin registers (collectives/observer.h), the dispatch layer
 * (src/collectives/comm.c). Every function is a no-op (returning 0) when no
 * trace is active on the calling thread. */
#ifndef TP_PLAN_TRACE_INTERNAL_H
#define TP_PLAN_TRACE_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>

#include "tp/plan.h"

struct tp_plan_trace {
    tp_plan_event *ev;
    size_t n, cap;
    uint64_t next_id; /* the id the next recorded collective gets */
    uint64_t last_id; /* the largest collective id so far */
    bool active;      /* on some thread */
    bool lost;        /* a recording failed for lack of memory */
};

/* A GEMM of [m, k] x [k, n] in dtype. */
void tp__plan_gemm(tp_dtype dtype, int64_t m, int64_t n, int64_t k);
/* Element-wise work over `elems` elements of dtype touching `arrays` arrays
 * of that many elements (inputs and outputs), i.e. elems * arrays * size
 * bytes; `optimizer` puts it in the optimizer phase. */
void tp__plan_elementwise(tp_dtype dtype, int64_t elems, int arrays, bool optimizer);
/* A collective over a group of `size` ranks of which this rank is `rank`;
 * `global_rank` and `stride` place the group in the world. Returns its id
 * (for the wait of asynchronous work), 0 when nothing was recorded. */
uint64_t tp__plan_collective(tp_coll_kind kind, int size, int rank, int64_t global_rank,
                             int64_t stride, uint64_t bytes, bool async);
/* A wait on the asynchronous collective `id` (0: nothing). */
void tp__plan_wait(uint64_t id);

#endif /* TP_PLAN_TRACE_INTERNAL_H */
