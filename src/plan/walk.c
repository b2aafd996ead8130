/* The step-time model (tp/plan.h): walks a plan trace on a compute lane and
 * a communication lane and times each event with the hardware description's
 * cost model (tp/hw.h). Formulas: docs/plan.md, "The walk". */
#include <string.h>

#include "core/core.h"
#include "plan/hw_internal.h"
#include "plan/trace_internal.h"

/* One timed event: its lane (0 compute, 1 communication) and span. */
typedef struct {
    int lane;
    double start, dur;
} tp__plan_span;

typedef void (*tp__plan_visit)(const tp_plan_event *e, const tp__plan_span *s, void *ctx);

typedef struct {
    double compute, comm; /* when each lane is free */
    double *async_end;    /* per event index: end of an asynchronous collective */
    double *deferred;     /* per event index: the time of an asynchronous collective on a
                           * link without async progress, until its wait charges it */
} tp__plan_lanes;

static tp_status tp__plan_event_time(const tp_hw *hw, const tp_plan_event *e, double *t,
                                     bool *defer)
{
    *t = 0;
    *defer = false;
    if (e->kind == TP_PLAN_GEMM)
        return tp_hw_gemm_time(hw, e->dtype, e->m, e->n, e->k, t);
    if (e->kind == TP_PLAN_ELEMENTWISE)
        return tp_hw_elementwise_time(hw, e->bytes, t);
    if (e->kind != TP_PLAN_COLLECTIVE)
        return TP_OK;
    int64_t ranks[2] = {e->first_rank, e->first_rank + (e->group_size - 1) * e->rank_stride};
    if (ranks[1] > INT32_MAX)
        return tp__error(TP_ERR_INVALID_ARG, "global rank %lld is out of range",
                         (long long)ranks[1]);
    /* node index r / devices_per_node grows with r: the two ends decide */
    int r[2] = {(int)ranks[0], (int)ranks[1]};
    tp_link_class link;
    TP_CHECK(tp_hw_group_link(hw, r, 2, &link));
    *defer = e->async && !hw->link[link].async_progress;
    return tp_hw_collective_time(hw, e->coll, e->group_size, link, e->bytes, t);
}

/* A collective moves its data on the communication lane from when both
 * lanes are free: the compute lane waits for it (a synchronous one) or goes
 * on. */
static double tp__plan_comm(tp__plan_lanes *l, double t, tp_plan_result *r)
{
    double start = l->compute > l->comm ? l->compute : l->comm;
    l->comm = start + t;
    r->exposed_comm_s += l->comm - l->compute;
    l->compute = l->comm;
    return start;
}

static void tp__plan_step(tp__plan_lanes *l, const tp_plan_event *e, double t, bool defer, size_t i,
                          tp_plan_result *r, tp__plan_span *s)
{
    if (e->kind == TP_PLAN_GEMM || e->kind == TP_PLAN_ELEMENTWISE) {
        *s = (tp__plan_span){0, l->compute, t};
        l->compute += t;
        r->compute_s += t;
        r->phase_s[e->phase] += t;
        if (e->kind == TP_PLAN_GEMM) {
            r->gemms++;
            if (e->phase != TP_PLAN_RECOMPUTE)
                r->gemm_flops += 2.0 * (double)e->m * (double)e->n * (double)e->k;
        } else {
            r->elementwise++;
        }
        return;
    }
    r->comm_s += t;
    r->collectives++;
    r->coll_count[e->coll]++;
    r->coll_bytes[e->coll] += e->bytes;
    r->coll_s[e->coll] += t;
    if (defer) {
        /* nothing moves it until its wait (or the step's end) */
        *s = (tp__plan_span){1, l->compute, 0};
        l->deferred[i] = t;
        return;
    }
    /* a collective starts when both the data (compute) and the link are ready */
    double start = l->compute > l->comm ? l->compute : l->comm;
    *s = (tp__plan_span){1, start, t};
    if (e->async) {
        l->comm = start + t;
        l->async_end[i] = l->comm;
    } else {
        tp__plan_comm(l, t, r);
    }
}

static tp_status tp__plan_walk(const tp_plan_trace *tr, const tp_hw *hw, tp_plan_result *r,
                               tp__plan_visit visit, void *ctx)
{
    memset(r, 0, sizeof *r);
    tp__plan_lanes l = {0, 0, tp__calloc(tr->n ? tr->n : 1, sizeof(double)),
                        tp__calloc(tr->n ? tr->n : 1, sizeof(double))};
    if (!l.async_end || !l.deferred) {
        tp__free(l.async_end);
        tp__free(l.deferred);
        return tp__error(TP_ERR_NO_MEMORY, "tp_plan_walk: out of memory");
    }
    tp_status st = TP_OK;
    tp_dtype most = TP_F32;
    double most_flops = -1, by_dtype[TP_DTYPE_COUNT] = {0};
    for (size_t i = 0; i < tr->n && st == TP_OK; i++) {
        const tp_plan_event *e = &tr->ev[i];
        double t = 0;
        bool defer = false;
        st = tp__plan_event_time(hw, e, &t, &defer);
        if (st != TP_OK) {
            tp__error_prefix("tp_plan_walk: event %zu", i);
            break;
        }
        if (e->kind == TP_PLAN_WAIT) {
            size_t j = i;
            while (j-- > 0 && !(tr->ev[j].kind == TP_PLAN_COLLECTIVE && tr->ev[j].id == e->id))
                ;
            double before = l.compute;
            if (j < i && l.deferred[j] > 0) {
                /* the wait moves the data now */
                tp__plan_comm(&l, l.deferred[j], r);
                l.deferred[j] = 0;
            } else {
                double end = j < i ? l.async_end[j] : 0;
                if (end > l.compute) {
                    r->exposed_comm_s += end - l.compute;
                    l.compute = end;
                }
            }
            tp__plan_span s = {0, before, l.compute - before};
            r->waits++;
            if (visit)
                visit(e, &s, ctx);
            continue;
        }
        tp__plan_span s;
        tp__plan_step(&l, e, t, defer, i, r, &s);
        if (e->kind == TP_PLAN_GEMM)
            by_dtype[e->dtype] += 2.0 * (double)e->m * (double)e->n * (double)e->k;
        if (visit)
            visit(e, &s, ctx);
    }
    /* work never waited on moves at the step's end (without async progress)
     * and ends the step when it completes */
    for (size_t i = 0; st == TP_OK && i < tr->n; i++)
        if (l.deferred[i] > 0) {
            double start = l.compute > l.comm ? l.compute : l.comm;
            l.comm = start + l.deferred[i];
        }
    tp__free(l.async_end);
    tp__free(l.deferred);
    if (st != TP_OK)
        return st;
    /* work never waited on ends the step when it completes */
    if (l.comm > l.compute)
        r->exposed_comm_s += l.comm - l.compute;
    r->step_s = r->compute_s + r->exposed_comm_s;
    for (int d = 0; d < TP_DTYPE_COUNT; d++)
        if (by_dtype[d] > most_flops) {
            most_flops = by_dtype[d];
            most = (tp_dtype)d;
        }
    r->model_flops_per_s = r->step_s > 0 ? r->gemm_flops / r->step_s : 0;
    double peak = hw->peak_flops[most];
    r->mfu = peak > 0 ? r->model_flops_per_s / peak : 0;
    return TP_OK;
}

tp_status tp_plan_walk(const tp_plan_trace *trace, const tp_hw *hw, tp_plan_result *out)
{
    TP_ARG_CHECK(trace && hw && out, "tp_plan_walk: trace, hw or out is NULL");
    return tp__plan_walk(trace, hw, out, NULL, NULL);
}

/* ---- Chrome trace-event output ------------------------------------------- */

typedef struct {
    FILE *f;
    int64_t rank;
    size_t n;
} tp__plan_chrome;

static const char *tp__plan_event_name(const tp_plan_event *e)
{
    switch (e->kind) {
    case TP_PLAN_GEMM:
        return "gemm";
    case TP_PLAN_ELEMENTWISE:
        return "elementwise";
    case TP_PLAN_COLLECTIVE:
        return tp_coll_kind_name(e->coll);
    default:
        return "wait";
    }
}

static void tp__plan_chrome_visit(const tp_plan_event *e, const tp__plan_span *s, void *ctx)
{
    static const char *const phase[TP_PLAN_PHASE_COUNT] = {"forward", "backward", "optimizer",
                                                            "recompute"};
    tp__plan_chrome *c = ctx;
    if (e->kind == TP_PLAN_WAIT && s->dur <= 0)
        return;
    fprintf(c->f,
            ",\n{\"name\":\"%s\",\"cat\":\"%s\",\"ph\":\"X\",\"pid\":%lld,\"tid\":%d,"
            "\"ts\":%.3f,\"dur\":%.3f,\"args\":{",
            tp__plan_event_name(e), phase[e->phase], (long long)c->rank, s->lane, s->start * 1e6,
            s->dur * 1e6);
    if (e->kind == TP_PLAN_GEMM)
        fprintf(c->f, "\"m\":%lld,\"n\":%lld,\"k\":%lld}}", (long long)e->m, (long long)e->n,
                (long long)e->k);
    else if (e->kind == TP_PLAN_COLLECTIVE)
        fprintf(c->f, "\"bytes\":%llu,\"group\":%d,\"async\":%s}}", (unsigned long long)e->bytes,
                e->group_size, e->async ? "true" : "false");
    else
        fprintf(c->f, "\"bytes\":%llu}}", (unsigned long long)e->bytes);
    c->n++;
}

tp_status tp_plan_write_chrome_trace(const tp_plan_trace *trace, const tp_hw *hw, int64_t rank,
                                     FILE *f)
{
    TP_ARG_CHECK(trace && hw && f, "tp_plan_write_chrome_trace: trace, hw or f is NULL");
    tp__plan_chrome c = {f, rank, 0};
    fprintf(f,
            "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n"
            "{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%lld,\"tid\":0,"
            "\"args\":{\"name\":\"compute\"}},\n"
            "{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%lld,\"tid\":1,"
            "\"args\":{\"name\":\"communication\"}}",
            (long long)rank, (long long)rank);
    tp_plan_result r;
    TP_CHECK(tp__plan_walk(trace, hw, &r, tp__plan_chrome_visit, &c));
    fprintf(f, "\n]}\n");
    if (fflush(f) != 0 || ferror(f))
        return tp__error(TP_ERR_BACKEND, "tp_plan_write_chrome_trace: writing failed");
    return TP_OK;
}
