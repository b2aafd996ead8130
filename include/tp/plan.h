/*
 * tp/plan.h - the step trace and the step-time model that walks it.
 *
 * A plan trace is the ordered list of what one rank does in a step: each
 * kernel (a GEMM with its m, n, k, or element-wise work with the bytes it
 * reads and writes), each collective (kind, group, bytes as comm-debug counts
 * them, synchronous or handed out as work) and each wait on such work. While
 * a trace is active on a thread (tp_plan_trace_begin), the meta engine's
 * kernels and the dispatch layer's collectives called on that thread are
 * appended to it, so a step run on meta tensors in a simulated world
 * (docs/sim.md) records itself. A trace can also be built by hand
 * (tp_plan_trace_add), as the tests do.
 *
 * tp_plan_walk times a trace with a hardware description (tp/hw.h): one
 * compute lane and one communication lane per rank. A kernel runs on the
 * compute lane; a synchronous collective waits for both lanes and blocks
 * both; an asynchronous one (DDP buckets) starts when the communication lane
 * is free and compute goes on beside it until the work is waited on (or the
 * step ends). Step time = compute time + exposed communication time, the
 * part of communication that compute did not hide (formulas: docs/plan.md).
 *
 * A trace belongs to the thread that uses it; distinct traces may be used on
 * distinct threads at once.
 */
#ifndef TP_PLAN_H
#define TP_PLAN_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "tp/comm.h"
#include "tp/hw.h"
#include "tp/status.h"
#include "tp/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum tp_plan_event_kind {
    TP_PLAN_GEMM = 0,        /* m, n, k in dtype */
    TP_PLAN_ELEMENTWISE = 1, /* bytes read and written */
    TP_PLAN_COLLECTIVE = 2,  /* coll, group_size, first_rank, rank_stride, bytes, async, id */
    TP_PLAN_WAIT = 3,        /* id: the asynchronous collective waited on */
} tp_plan_event_kind;

typedef enum tp_plan_phase {
    TP_PLAN_FORWARD = 0,
    TP_PLAN_BACKWARD = 1,
    TP_PLAN_OPTIMIZER = 2, /* optimizer kernels (SGD, Adam updates) */
    TP_PLAN_RECOMPUTE = 3, /* a forward run again in backward (activation recomputation):
                            * timed like backward, its GEMMs not model FLOPs */
    TP_PLAN_PHASE_COUNT
} tp_plan_phase;

typedef struct tp_plan_event {
    tp_plan_event_kind kind;
    tp_plan_phase phase;
    tp_dtype dtype;      /* kernels */
    int64_t m, n, k;     /* TP_PLAN_GEMM: a [m, k] x [k, n] product */
    uint64_t bytes;      /* element-wise: read + written; collective: as comm-debug counts */
    tp_coll_kind coll;   /* collective kind */
    int group_size;      /* collective: ranks in its group */
    int64_t first_rank;  /* collective: the global rank of the group's rank 0 */
    int64_t rank_stride; /* collective: global rank distance between consecutive members */
    bool async;          /* collective handed out as work */
    uint64_t id;         /* collective: its id (> 0, unique in the trace); wait: the id waited on */
} tp_plan_event;

typedef struct tp_plan_trace tp_plan_trace;

/* An empty trace. */
TP_API tp_status tp_plan_trace_create(tp_plan_trace **out);
/* Frees a trace (it must not be active on any thread; NULL is a no-op). */
TP_API void tp_plan_trace_free(tp_plan_trace *trace);
/* Makes `trace` the calling thread's active trace: the meta engine's kernels
 * and the collectives this thread issues are appended to it until
 * tp_plan_trace_end. TP_ERR_INVALID_ARG when a trace is active on this thread
 * already. */
TP_API tp_status tp_plan_trace_begin(tp_plan_trace *trace);
/* Ends the calling thread's active trace, which must be `trace`
 * (TP_ERR_INVALID_ARG otherwise). A recording that could not be stored (out
 * of memory) is reported here as TP_ERR_NO_MEMORY. */
TP_API tp_status tp_plan_trace_end(tp_plan_trace *trace);
/* Appends a copy of *event. TP_ERR_INVALID_ARG for an event that cannot be
 * timed (negative sizes, a group of < 1 rank, a collective id of 0, a wait on
 * an id no earlier asynchronous collective of the trace has), naming the
 * field. */
TP_API tp_status tp_plan_trace_add(tp_plan_trace *trace, const tp_plan_event *event);
/* Number of events, and event i (borrowed, valid until the trace changes;
 * NULL out of range). */
TP_API size_t tp_plan_trace_count(const tp_plan_trace *trace);
TP_API const tp_plan_event *tp_plan_trace_event(const tp_plan_trace *trace, size_t i);

/* What a walk found, in seconds unless noted. */
typedef struct tp_plan_result {
    double step_s;                       /* compute_s + exposed_comm_s */
    double compute_s;                    /* every kernel, one after another */
    double comm_s;                       /* every collective, one after another */
    double exposed_comm_s;               /* the part of comm_s compute did not hide */
    double phase_s[TP_PLAN_PHASE_COUNT]; /* compute time by phase */
    double gemm_flops;                   /* 2 m n k summed over the GEMMs, recomputed
                                          * ones left out (model FLOPs) */
    double model_flops_per_s;            /* gemm_flops / step_s */
    double mfu; /* model_flops_per_s / the peak of the GEMMs' dtype (the most used) */
    int64_t gemms, elementwise, collectives, waits; /* event counts */
    /* per collective kind: count, bytes (as comm-debug counts them), time */
    int64_t coll_count[TP_COLL_KIND_COUNT];
    uint64_t coll_bytes[TP_COLL_KIND_COUNT];
    double coll_s[TP_COLL_KIND_COUNT];
} tp_plan_result;

/* Times `trace` on `hw` into *out (model: the header comment, docs/plan.md).
 * The link of a collective is tp_hw_group_link of its group's global ranks
 * (first_rank + i * rank_stride). Errors of the cost model (a dtype the
 * description has no peak for) are returned with the event's index. */
TP_API tp_status tp_plan_walk(const tp_plan_trace *trace, const tp_hw *hw, tp_plan_result *out);

/* Writes the walked trace as a Chrome trace-event file (JSON, the format
 * Perfetto and chrome://tracing open): process `rank`, thread 0 the compute
 * lane and thread 1 the communication lane, one complete ("X") event per
 * kernel and collective with its start and duration in microseconds.
 * TP_ERR_BACKEND when writing fails. */
TP_API tp_status tp_plan_write_chrome_trace(const tp_plan_trace *trace, const tp_hw *hw,
                                            int64_t rank, FILE *f);

#ifdef __cplusplus
}
#endif

#endif /* TP_PLAN_H */
