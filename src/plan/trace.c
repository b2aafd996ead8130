/* Plan traces (tp/plan.h): storage, the per-thread active trace, and the
 * recording entry points of trace_internal.h. */
#include "plan/trace_internal.h"

#include "collectives/observer.h"
#include "core/core.h"
#include "core/log.h"
#include "core/meta_mem.h"
#include "tp/comm_debug.h"

static _Thread_local tp_plan_trace *tp__plan_active;

/* The dispatch layer's view of this file: registered by the first begin and
 * kept (each entry does nothing on a thread with no active trace). */
static const tp__coll_observer tp__plan_observer = {tp__plan_collective, tp__plan_wait};

tp_status tp_plan_trace_create(tp_plan_trace **out)
{
    TP_ARG_CHECK(out, "tp_plan_trace_create: out is NULL");
    *out = tp__calloc(1, sizeof **out);
    if (!*out)
        return tp__error(TP_ERR_NO_MEMORY, "tp_plan_trace_create: out of memory");
    (*out)->next_id = 1;
    return TP_OK;
}

void tp_plan_trace_free(tp_plan_trace *trace)
{
    if (!trace)
        return;
    if (tp__plan_active == trace)
        tp__plan_active = NULL;
    tp__free(trace->ev);
    tp__free(trace);
}

/* A copy onto a meta tensor (core's tp_tensor_copy): read and written. */
static void tp__plan_meta_copy(tp_dtype dtype, int64_t elems)
{
    tp__plan_elementwise(dtype, elems, 2, false);
}

tp_status tp_plan_trace_begin(tp_plan_trace *trace)
{
    TP_ARG_CHECK(trace, "tp_plan_trace_begin: trace is NULL");
    TP_ARG_CHECK(!tp__plan_active, "tp_plan_trace_begin: a trace is active on this thread already");
    TP_ARG_CHECK(!trace->active, "tp_plan_trace_begin: the trace is active on another thread");
    trace->active = true;
    trace->lost = false;
    tp__plan_active = trace;
    tp__comm_set_observer(&tp__plan_observer);
    tp__meta_set_copy_observer(tp__plan_meta_copy);
    return TP_OK;
}

tp_status tp_plan_trace_end(tp_plan_trace *trace)
{
    TP_ARG_CHECK(trace, "tp_plan_trace_end: trace is NULL");
    TP_ARG_CHECK(tp__plan_active == trace,
                 "tp_plan_trace_end: the trace is not the active one of this thread");
    tp__plan_active = NULL;
    trace->active = false;
    if (trace->lost)
        return tp__error(TP_ERR_NO_MEMORY,
                         "tp_plan_trace_end: out of memory: events of the step were not recorded");
    return TP_OK;
}

/* Index of the collective `id` (ids increase along the trace), or -1. */
static ptrdiff_t tp__plan_find(const tp_plan_trace *t, uint64_t id)
{
    for (size_t i = t->n; i-- > 0;)
        if (t->ev[i].kind == TP_PLAN_COLLECTIVE && t->ev[i].id == id)
            return (ptrdiff_t)i;
    return -1;
}

static tp_status tp__plan_check(const tp_plan_trace *t, const tp_plan_event *e)
{
    const char *fn = "tp_plan_trace_add";
    TP_ARG_CHECK((unsigned)e->phase < TP_PLAN_PHASE_COUNT, "%s: phase %d is not a tp_plan_phase",
                 fn, (int)e->phase);
    switch (e->kind) {
    case TP_PLAN_GEMM:
        TP_ARG_CHECK((unsigned)e->dtype < TP_DTYPE_COUNT, "%s: GEMM dtype is invalid", fn);
        TP_ARG_CHECK(e->m >= 0 && e->n >= 0 && e->k >= 0,
                     "%s: GEMM sizes m, n, k must be >= 0, got %lld, %lld, %lld", fn,
                     (long long)e->m, (long long)e->n, (long long)e->k);
        return TP_OK;
    case TP_PLAN_ELEMENTWISE:
        return TP_OK;
    case TP_PLAN_COLLECTIVE:
        TP_ARG_CHECK((unsigned)e->coll < TP_COLL_KIND_COUNT, "%s: collective kind %d is invalid",
                     fn, (int)e->coll);
        TP_ARG_CHECK(e->group_size >= 1, "%s: group_size must be >= 1, got %d", fn, e->group_size);
        TP_ARG_CHECK(e->first_rank >= 0 && e->rank_stride >= 1,
                     "%s: first_rank must be >= 0 and rank_stride >= 1, got %lld and %lld", fn,
                     (long long)e->first_rank, (long long)e->rank_stride);
        TP_ARG_CHECK(e->id > t->last_id,
                     "%s: collective id %llu must be > the previous collective's (%llu)", fn,
                     (unsigned long long)e->id, (unsigned long long)t->last_id);
        return TP_OK;
    case TP_PLAN_WAIT:
        TP_ARG_CHECK(tp__plan_find(t, e->id) >= 0 && t->ev[tp__plan_find(t, e->id)].async,
                     "%s: wait on id %llu: no earlier asynchronous collective has it", fn,
                     (unsigned long long)e->id);
        return TP_OK;
    }
    return tp__error(TP_ERR_INVALID_ARG, "%s: event kind %d is not a tp_plan_event_kind", fn,
                     (int)e->kind);
}

static bool tp__plan_push(tp_plan_trace *t, const tp_plan_event *e)
{
    if (t->n == t->cap && !tp__grow_array((void **)&t->ev, t->n, &t->cap, sizeof *t->ev))
        return false;
    t->ev[t->n++] = *e;
    if (e->kind == TP_PLAN_COLLECTIVE) {
        t->last_id = e->id;
        if (e->id >= t->next_id)
            t->next_id = e->id + 1;
    }
    return true;
}

tp_status tp_plan_trace_add(tp_plan_trace *trace, const tp_plan_event *event)
{
    TP_ARG_CHECK(trace && event, "tp_plan_trace_add: trace or event is NULL");
    TP_CHECK(tp__plan_check(trace, event));
    if (!tp__plan_push(trace, event))
        return tp__error(TP_ERR_NO_MEMORY, "tp_plan_trace_add: out of memory");
    return TP_OK;
}

size_t tp_plan_trace_count(const tp_plan_trace *trace)
{
    return trace ? trace->n : 0;
}

const tp_plan_event *tp_plan_trace_event(const tp_plan_trace *trace, size_t i)
{
    return trace && i < trace->n ? &trace->ev[i] : NULL;
}

/* ---- recording (trace_internal.h) ---------------------------------------- */

static void tp__plan_record(tp_plan_event *e)
{
    tp_plan_trace *t = tp__plan_active;
    if (e->phase != TP_PLAN_OPTIMIZER)
        e->phase = tp_comm_debug_phase() == TP_PHASE_FORWARD     ? TP_PLAN_FORWARD
                   : tp_comm_debug_phase() == TP_PHASE_RECOMPUTE ? TP_PLAN_RECOMPUTE
                                                                 : TP_PLAN_BACKWARD;
    if (!tp__plan_push(t, e))
        t->lost = true;
}

void tp__plan_gemm(tp_dtype dtype, int64_t m, int64_t n, int64_t k)
{
    if (TP_LIKELY(!tp__plan_active))
        return;
    tp_plan_event e = {.kind = TP_PLAN_GEMM, .dtype = dtype, .m = m, .n = n, .k = k};
    tp__plan_record(&e);
}

void tp__plan_elementwise(tp_dtype dtype, int64_t elems, int arrays, bool optimizer)
{
    if (TP_LIKELY(!tp__plan_active))
        return;
    tp_plan_event e = {.kind = TP_PLAN_ELEMENTWISE,
                       .phase = optimizer ? TP_PLAN_OPTIMIZER : TP_PLAN_FORWARD,
                       .dtype = dtype,
                       .bytes = (uint64_t)(elems > 0 ? elems : 0) * (uint64_t)arrays *
                                tp_dtype_size(dtype)};
    tp__plan_record(&e);
}

uint64_t tp__plan_collective(tp_coll_kind kind, int size, int rank, int64_t global_rank,
                             int64_t stride, uint64_t bytes, bool async)
{
    tp_plan_trace *t = tp__plan_active;
    if (TP_LIKELY(!t))
        return 0;
    if (stride < 1)
        stride = 1;
    int64_t first = global_rank - (int64_t)rank * stride;
    tp_plan_event e = {.kind = TP_PLAN_COLLECTIVE,
                       .coll = kind,
                       .group_size = size,
                       .first_rank = first >= 0 ? first : 0,
                       .rank_stride = stride,
                       .bytes = bytes,
                       .async = async,
                       .id = t->next_id};
    tp__plan_record(&e);
    return t->n && t->ev[t->n - 1].id == e.id && t->ev[t->n - 1].kind == TP_PLAN_COLLECTIVE ? e.id
                                                                                            : 0;
}

void tp__plan_wait(uint64_t id)
{
    if (TP_LIKELY(!tp__plan_active) || id == 0)
        return;
    tp_plan_event e = {.kind = TP_PLAN_WAIT, .id = id};
    tp__plan_record(&e);
}
