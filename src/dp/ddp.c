/* The data-parallel wrapper: gradient hooks drive the step graph's schedule
 * during backward (launching each bucket's all_reduce once its gradients are
 * final), the optimizers' step pre-hook finishes it, and a forward pre-hook
 * installs the bucket views of gradient_as_bucket_view.
 *
 * From a bucket's launch until it is settled (waited for and, for fused
 * buckets without views, copied out) its parameters carry a pending-gradient
 * callback (dtensor/grad_pending.h): a user reading, replacing or dropping
 * one of their gradients, or a second backward adding into one, first
 * settles that bucket, so nobody sees a half-reduced or unreduced gradient
 * while the waits stay late. The DDP's own accesses go through tp__grad_peek
 * and never trigger it. */
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "collectives/comm_ref.h"
#include "dp/dp_internal.h"
#include "dtensor/grad_pending.h"

typedef struct tp__dparam {
    struct tp_ddp *ddp;
    int index;
    tp_tensor *t;   /* the parameter (retained) */
    char *fqn;
    int hook;       /* grad hook handle */
    bool ready;     /* this step */
    tp_tensor *view; /* the installed bucket view (a DTensor for DTensor params) */
    /* the gradient's placements, seen at the end of a step (DTensor params) */
    bool have_layout;
    tp_placement layout[TP_MESH_MAX_DIMS];
} tp__dparam;

typedef struct tp__dbucket {
    tp_tensor *buf;  /* fused buckets: the buffer; NULL for a lone in-place one */
    tp_work *work;
    bool launched;
    bool settled;    /* this step: waited for and copied out (its gradients final) */
} tp__dbucket;

/* The module's hooks stay when the DDP is freed (the module may be freed
 * first, or replicated, so the DDP cannot tell whether removing them is
 * safe): they hold this, which outlives the DDP and goes quiet when it is
 * freed. */
typedef struct tp__shim {
    atomic_int refs;
    struct tp_ddp *ddp;
} tp__shim;

struct tp_ddp {
    tp_module *module;
    tp_comm *comm; /* holds a reference */
    tp_ddp_options opts;
    tp_step_graph *g;
    int built_version;
    tp__dparam *p;
    int n;
    tp__dbucket *b;
    int nb;
    int pc;          /* next node of the schedule */
    bool in_step;
    bool order_recorded;
    int *seen;       /* ready order of the first step */
    int n_seen;
    tp_status failed; /* sticky: an earlier step failed */
    char failure[256];
    tp__shim *shim;
};

bool tp__ddp_in_step(const tp_ddp *ddp) { return ddp->in_step; }

static void tp__shim_release(void *ctx)
{
    tp__shim *s = ctx;
    if (atomic_fetch_sub(&s->refs, 1) == 1)
        tp__free(s);
}

/* ---- failure --------------------------------------------------------------- */

/* Records a failure: the comm is aborted so peers stop waiting, and every
 * later call returns TP_ERR_STATE naming it. */
static tp_status tp__ddp_fail(tp_ddp *d, tp_status st)
{
    if (d->failed == TP_OK) {
        d->failed = st;
        snprintf(d->failure, sizeof d->failure, "%s", tp_last_error());
        tp_comm_abort(d->comm, "data parallel step failed");
    }
    return st;
}

static tp_status tp__ddp_check(const tp_ddp *d, const char *fn)
{
    if (d->failed != TP_OK)
        return tp__error(TP_ERR_STATE, "%s: an earlier step of this DDP failed (%s: %s)", fn,
                         tp_status_name(d->failed), d->failure);
    return TP_OK;
}

/* ---- gradients ------------------------------------------------------------- */

static tp_tensor *tp__local(tp_tensor *t) { return tp_tensor_is_dtensor(t) ? tp_dtensor_local(t) : t; }

/* Wraps `local` as a gradient for parameter p (a DTensor with the observed
 * gradient layout, or the parameter's, for DTensor parameters). */
static tp_status tp__as_grad(tp__dparam *p, tp_tensor *local, tp_tensor **out)
{
    if (!tp_tensor_is_dtensor(p->t)) {
        *out = tp_tensor_retain(local);
        return TP_OK;
    }
    tp_mesh *mesh = tp_dtensor_mesh(p->t);
    /* the layout the backward produces (Partial for a Replicate parameter
     * fed sharded rows), else the parameter's */
    tp_tensor *cur = tp__grad_peek(p->t);
    const tp_placement *pl = cur && tp_tensor_is_dtensor(cur) ? tp_dtensor_placements(cur)
                             : p->have_layout              ? p->layout
                                                           : tp_dtensor_placements(p->t);
    tp_from_local_options o = {.global_shape = tp_tensor_shape(p->t)};
    return tp_dtensor_from_local(mesh, local, tp_mesh_ndim(mesh), pl, &o, out);
}

/* Gives p a zero gradient when it has none. */
static tp_status tp__ensure_grad(tp__dparam *p)
{
    if (tp__grad_peek(p->t))
        return TP_OK;
    tp_tensor *l = tp__local(p->t), *z = NULL, *g = NULL;
    TP_CHECK(tp_tensor_zeros(tp_tensor_dtype(l), tp_tensor_device(l), tp_tensor_ndim(l),
                             tp_tensor_shape(l), &z));
    tp_status st = tp__as_grad(p, z, &g);
    if (st == TP_OK)
        st = tp_tensor_set_grad(p->t, g);
    tp_tensor_release(g);
    tp_tensor_release(z);
    return st;
}

/* The slice of bucket b's buffer that holds parameter i, shaped like it. */
static tp_status tp__slice(tp_ddp *d, int i, tp_tensor **out)
{
    const tp_step_graph *g = d->g;
    tp_tensor *flat = NULL, *l = tp__local(d->p[i].t);
    TP_CHECK(tp_tensor_narrow(d->b[g->bucket_of[i]].buf, 0, g->offset[i], g->numel[i], &flat));
    tp_status st = tp_tensor_view(flat, tp_tensor_ndim(l), tp_tensor_shape(l), out);
    tp_tensor_release(flat);
    return st;
}

/* Makes p's gradient the view into its bucket, carrying over what it held. */
static tp_status tp__install_view(tp_ddp *d, int i)
{
    tp__dparam *p = &d->p[i];
    tp_tensor *cur = tp__grad_peek(p->t);
    if (p->view && cur == p->view)
        return TP_OK;
    tp_tensor *s = NULL;
    TP_CHECK(tp__slice(d, i, &s));
    tp_status st = cur ? tp_tensor_copy(s, tp__local(cur)) : tp_tensor_fill(s, 0.0);
    tp_tensor *v = NULL;
    if (st == TP_OK)
        st = tp__as_grad(p, s, &v);
    if (st == TP_OK)
        st = tp_tensor_set_grad(p->t, v);
    tp_tensor_release(s);
    if (st == TP_OK) {
        tp_tensor_release(p->view);
        p->view = v;
    } else {
        tp_tensor_release(v);
    }
    return st;
}

/* ---- buckets --------------------------------------------------------------- */

static void tp__free_buckets(tp_ddp *d)
{
    for (int b = 0; b < d->nb; b++) {
        tp_work_free(d->b[b].work);
        tp_tensor_release(d->b[b].buf);
    }
    tp__free(d->b);
    d->b = NULL;
    d->nb = 0;
    for (int i = 0; i < d->n; i++) {
        tp_tensor_release(d->p[i].view);
        d->p[i].view = NULL;
    }
}

/* (Re)allocates the buffers after the schedule changed. Between steps. */
static tp_status tp__build(tp_ddp *d)
{
    const char *fn = "tp_ddp";
    if (d->built_version == d->g->version && d->b)
        return TP_OK;
    tp__free_buckets(d);
    const tp_step_graph *g = d->g;
    d->b = tp__calloc((size_t)g->nb, sizeof *d->b);
    if (!d->b)
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory for %d buckets", fn, g->nb);
    d->nb = g->nb;
    /* fused buckets, and lone gradients converted for their all_reduce
     * (reduce_dtype), have a buffer of the bucket dtype */
    for (int b = 0; b < g->nb; b++) {
        int first = g->order[g->buckets[b].first];
        if (!g->fused && !g->converts[first])
            continue;
        tp_tensor *l = tp__local(d->p[first].t);
        int64_t n = g->buckets[b].numel;
        TP_CHECK(tp_tensor_zeros(g->dtype[first], tp_tensor_device(l), 1, &n, &d->b[b].buf));
    }
    d->built_version = g->version;
    return TP_OK;
}

/* Gradient views for the coming backward (gradient_as_bucket_view): only for
 * parameters whose gradient layout is known, i.e. from the second step on for
 * DTensor parameters. */
static tp_status tp__prepare(tp_ddp *d)
{
    TP_CHECK(tp__build(d));
    if (!d->g->views)
        return TP_OK;
    for (int i = 0; i < d->n; i++)
        if (!tp_tensor_is_dtensor(d->p[i].t) || d->p[i].have_layout)
            TP_CHECK(tp__install_view(d, i));
    return TP_OK;
}

static tp_status tp__wait(tp_ddp *d, int b);
static tp_status tp__copy_in(tp_ddp *d, int b);

static tp_status tp__grad_pending(tp_tensor *t, const char *fn, void *ctx);

/* Installs (or removes) the pending-gradient callback on bucket b's
 * parameters. */
static void tp__mark_pending(tp_ddp *d, int b, bool on)
{
    const tp__gbucket *bk = &d->g->buckets[b];
    for (int k = bk->first; k < bk->first + bk->count; k++) {
        tp__dparam *p = &d->p[d->g->order[k]];
        tp__grad_pending_set(p->t, on ? tp__grad_pending : NULL, p);
    }
}

static tp_status tp__launch(tp_ddp *d, int b)
{
    const tp_step_graph *g = d->g;
    if (d->opts.max_in_flight > 0) {
        /* buckets launch in index order: the oldest pending has the lowest */
        int pending = 0;
        for (int k = 0; k < d->nb; k++)
            pending += d->b[k].work != NULL;
        for (int k = 0; k < d->nb && pending >= d->opts.max_in_flight; k++) {
            if (d->b[k].work) {
                TP_CHECK(tp__wait(d, k));
                pending--;
            }
        }
    }
    const tp__gbucket *bk = &g->buckets[b];
    tp_tensor *buf = d->b[b].buf;
    if (!g->fused && buf) {
        /* a lone gradient converted into its buffer (reduce_dtype) */
        TP_CHECK(tp__ensure_grad(&d->p[g->order[bk->first]]));
        TP_CHECK(tp__copy_in(d, b));
    } else if (!g->fused) {
        /* a lone gradient, reduced in place */
        tp__dparam *p = &d->p[g->order[bk->first]];
        TP_CHECK(tp__ensure_grad(p));
        tp_tensor *l = tp__local(tp__grad_peek(p->t));
        if (!tp_tensor_is_contiguous(l)) {
            tp_tensor *c = NULL, *gc = NULL;
            TP_CHECK(tp_tensor_clone(l, &c));
            tp_status st = tp__as_grad(p, c, &gc);
            if (st == TP_OK)
                st = tp_tensor_set_grad(p->t, gc);
            tp_tensor_release(gc);
            tp_tensor_release(c);
            TP_CHECK(st);
            l = tp__local(tp__grad_peek(p->t));
        }
        buf = l;
    } else if (g->views) {
        /* a gradient that is not its view (first step, a fallback) joins now */
        for (int k = bk->first; k < bk->first + bk->count; k++)
            TP_CHECK(tp__install_view(d, g->order[k]));
    }
    TP_CHECK(tp_all_reduce(d->comm, buf, buf, TP_AVG, &d->b[b].work));
    d->b[b].launched = true;
    d->b[b].settled = false;
    tp__mark_pending(d, b, true);
    return TP_OK;
}

static tp_status tp__copy_in(tp_ddp *d, int b)
{
    const tp__gbucket *bk = &d->g->buckets[b];
    for (int k = bk->first; k < bk->first + bk->count; k++) {
        int i = d->g->order[k];
        tp_tensor *s = NULL, *gr = tp__grad_peek(d->p[i].t);
        TP_CHECK(tp__slice(d, i, &s));
        tp_status st = gr ? tp_tensor_copy(s, tp__local(gr)) : tp_tensor_fill(s, 0.0);
        tp_tensor_release(s);
        TP_CHECK(st);
    }
    return TP_OK;
}

static tp_status tp__copy_out(tp_ddp *d, int b)
{
    const tp__gbucket *bk = &d->g->buckets[b];
    for (int k = bk->first; k < bk->first + bk->count; k++) {
        int i = d->g->order[k];
        TP_CHECK(tp__ensure_grad(&d->p[i]));
        tp_tensor *s = NULL;
        TP_CHECK(tp__slice(d, i, &s));
        tp_status st = tp_tensor_copy(tp__local(tp__grad_peek(d->p[i].t)), s);
        tp_tensor_release(s);
        TP_CHECK(st);
    }
    return TP_OK;
}

static tp_status tp__wait(tp_ddp *d, int b)
{
    if (!d->b[b].work)
        return TP_OK; /* waited for already, to launch a later bucket */
    tp_status st = tp_work_wait(d->b[b].work);
    tp_work_free(d->b[b].work);
    d->b[b].work = NULL;
    return st;
}

/* Whether the schedule copies fused buckets back into the gradients. */
static bool tp__copies_out(const tp_step_graph *g) { return g->fused && !g->views; }

/* Whether bucket b's result goes back into its gradients at its settling:
 * fused buckets without views, and lone gradients converted for their
 * all_reduce (reduce_dtype), whose schedule has no copy-out node. */
static bool tp__settle_copies(const tp_ddp *d, int b)
{
    return tp__copies_out(d->g) || (!d->g->fused && d->b[b].buf);
}

/* Bucket b's gradients final: waited for, copied out where the schedule
 * does, its parameters' callbacks removed. Once per step: the schedule's
 * own wait / copy out and an earlier read of one of its gradients meet
 * here. On failure the callbacks stay (the DDP then fails: they return its
 * sticky error). */
static tp_status tp__settle(tp_ddp *d, int b)
{
    if (d->b[b].settled)
        return TP_OK;
    TP_CHECK(tp__wait(d, b));
    tp__mark_pending(d, b, false); /* copy out installs gradients: not a user's access */
    if (tp__settle_copies(d, b)) {
        tp_status st = tp__copy_out(d, b);
        if (st != TP_OK) {
            tp__mark_pending(d, b, true);
            return st;
        }
    }
    d->b[b].settled = true;
    return TP_OK;
}

/* The callback of a parameter whose bucket is in flight: a read (or
 * replacement, or accumulation) of its gradient by fn settles the bucket
 * first. */
static tp_status tp__grad_pending(tp_tensor *t, const char *fn, void *ctx)
{
    (void)t;
    tp__dparam *p = ctx;
    tp_ddp *d = p->ddp;
    TP_CHECK(tp__ddp_check(d, fn));
    tp_status st = tp__settle(d, d->g->bucket_of[p->index]);
    if (st != TP_OK) {
        tp__error_prefix("%s: waiting for the data-parallel all_reduce of the gradient of '%s'",
                         fn, p->fqn);
        return tp__ddp_fail(d, st);
    }
    return TP_OK;
}

/* Polls the collectives in flight: backends without a progress engine of
 * their own (shm, MPI) advance them here, during backward. */
static void tp__progress(tp_ddp *d)
{
    for (int b = 0; b < d->nb; b++) {
        if (!d->b[b].work)
            continue;
        bool done = false;
        (void)tp_work_test(d->b[b].work, &done);
    }
}

static tp_status tp__small(tp_ddp *d, int64_t *v, int64_t n, bool broadcast);

/* ---- the schedule ---------------------------------------------------------- */

static void tp__end_step(tp_ddp *d)
{
    d->pc = 0;
    d->in_step = false;
    for (int i = 0; i < d->n; i++)
        d->p[i].ready = false;
}

/* Runs nodes until one cannot run yet: a parameter not ready (during
 * backward) or the step (unless finishing). */
static tp_status tp__run(tp_ddp *d, bool finish)
{
    const tp_step_graph *g = d->g;
    while (d->pc < g->nn) {
        const tp__gnode *nd = &g->nodes[d->pc];
        switch (nd->kind) {
        case TP__G_READY:
            if (!d->p[nd->arg].ready && !finish)
                return TP_OK;
            break;
        case TP__G_COPY_IN: TP_CHECK(tp__copy_in(d, nd->arg)); break;
        case TP__G_ALL_REDUCE: TP_CHECK(tp__launch(d, nd->arg)); break;
        case TP__G_WAIT:
        case TP__G_COPY_OUT:
            /* late waits belong to the step: backward goes on meanwhile */
            if (g->late && !finish)
                return TP_OK;
            /* a wait followed by a copy out settles at the copy out */
            TP_CHECK(nd->kind == TP__G_WAIT && tp__copies_out(g) ? tp__wait(d, nd->arg)
                                                                 : tp__settle(d, nd->arg));
            break;
        case TP__G_STEP:
            if (!finish)
                return TP_OK;
            tp__end_step(d);
            return TP_OK;
        }
        d->pc++;
    }
    return TP_OK;
}

static tp_status tp__begin_step(tp_ddp *d)
{
    if (d->in_step)
        return TP_OK;
    TP_CHECK(tp__build(d));
    d->in_step = true;
    d->pc = 0;
    return TP_OK;
}

static tp_status tp__on_grad(tp_tensor *t, void *ctx)
{
    (void)t;
    tp__dparam *p = ctx;
    tp_ddp *d = p->ddp;
    TP_CHECK(tp__ddp_check(d, "tp_ddp (gradient hook)"));
    tp_status st = tp__begin_step(d);
    if (st == TP_OK && !p->ready) {
        p->ready = true;
        if (!d->order_recorded)
            d->seen[d->n_seen++] = p->index;
    }
    if (st == TP_OK)
        st = tp__run(d, false);
    if (st != TP_OK)
        return tp__ddp_fail(d, st);
    tp__progress(d);
    return TP_OK;
}

tp_status tp_ddp_sync(tp_ddp *d)
{
    const char *fn = "tp_ddp_sync";
    TP_ARG_CHECK(d, "%s: ddp is NULL", fn);
    TP_CHECK(tp__ddp_check(d, fn));
    if (!d->in_step)
        return TP_OK; /* nothing since the last sync */
    tp_status st = tp__run(d, true);
    if (st != TP_OK) {
        tp__error_prefix("%s", fn);
        return tp__ddp_fail(d, st);
    }
    /* gradient layouts of DTensor parameters, for the views of later steps */
    for (int i = 0; i < d->n; i++) {
        tp__dparam *p = &d->p[i];
        tp_tensor *gr = tp__grad_peek(p->t);
        if (gr && tp_tensor_is_dtensor(gr) && !p->have_layout) {
            memcpy(p->layout, tp_dtensor_placements(gr),
                   (size_t)tp_mesh_ndim(tp_dtensor_mesh(gr)) * sizeof(tp_placement));
            p->have_layout = true;
        }
    }
    /* the first step's ready order becomes the schedule's (parameters that
     * never got a gradient keep their place at the end) */
    if (!d->order_recorded) {
        d->order_recorded = true;
        int *order = tp__malloc((size_t)d->n * sizeof *order);
        if (!order)
            return tp__ddp_fail(d, tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn));
        int k = 0;
        for (int j = 0; j < d->n_seen; j++)
            order[k++] = d->seen[j];
        for (int j = 0; j < d->n; j++) {
            int i = d->g->order[j];
            bool seen = false;
            for (int s = 0; s < d->n_seen && !seen; s++)
                seen = d->seen[s] == i;
            if (!seen)
                order[k++] = i;
        }
        /* the ranks' backward orders may differ: rank 0's decides, or the
         * buckets would not match */
        int64_t *o64 = tp__malloc((size_t)d->n * sizeof *o64);
        if (!o64)
            st = tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
        for (int j = 0; st == TP_OK && j < d->n; j++)
            o64[j] = order[j];
        if (st == TP_OK)
            st = tp__small(d, o64, d->n, true);
        for (int j = 0; st == TP_OK && j < d->n; j++)
            order[j] = (int)o64[j];
        tp__free(o64);
        if (st == TP_OK && memcmp(order, d->g->order, (size_t)d->n * sizeof *order) != 0)
            st = tp__graph_set_order(d->g, order);
        tp__free(order);
        if (st != TP_OK)
            return tp__ddp_fail(d, st);
    }
    return TP_OK;
}

static tp_status tp__step_hook(tp_module *m, void *ctx)
{
    (void)m;
    tp__shim *s = ctx;
    return s->ddp ? tp_ddp_sync(s->ddp) : TP_OK;
}

static tp_status tp__forward_hook(tp_module *m, int nargs, tp_tensor **args, int nkw,
                                  tp_kwarg *kw, void *ctx)
{
    (void)m, (void)nargs, (void)args, (void)nkw, (void)kw;
    tp__shim *s = ctx;
    tp_ddp *d = s->ddp;
    if (!d || d->in_step || !tp_grad_enabled())
        return TP_OK; /* accumulating over several backwards: views stay */
    TP_CHECK(tp__ddp_check(d, "tp_ddp (forward)"));
    tp_status st = tp__prepare(d);
    return st == TP_OK ? TP_OK : tp__ddp_fail(d, st);
}

/* ---- wrap ------------------------------------------------------------------ */

typedef struct {
    tp_ddp *d;
    size_t cap;
} tp__collect;

static tp_status tp__collect_param(const char *fqn, tp_tensor *t, void *ctx)
{
    tp__collect *c = ctx;
    tp_ddp *d = c->d;
    if (!tp_tensor_requires_grad(t))
        return TP_OK; /* a tied tensor comes once: named_parameters reports it once */
    if (!tp__grow_array((void **)&d->p, (size_t)d->n, &c->cap, sizeof *d->p))
        return tp__error(TP_ERR_NO_MEMORY, "tp_ddp_create: out of memory");
    tp__dparam *p = &d->p[d->n];
    memset(p, 0, sizeof *p);
    p->fqn = tp__strdup(fqn);
    if (!p->fqn)
        return tp__error(TP_ERR_NO_MEMORY, "tp_ddp_create: out of memory");
    p->t = tp_tensor_retain(t);
    p->index = d->n++;
    p->hook = -1;
    return TP_OK;
}

void tp_ddp_free(tp_ddp *d)
{
    if (!d)
        return;
    if (d->in_step && d->failed == TP_OK)
        (void)tp__run(d, true); /* wait for what is in flight; results dropped */
    tp__free_buckets(d);
    for (int i = 0; i < d->n; i++) {
        /* after a failure some gradients were never settled: they become
         * plain gradients again (their values undefined) */
        tp__grad_pending_set(d->p[i].t, NULL, NULL);
        if (d->p[i].hook >= 0)
            tp_tensor_remove_grad_hook(d->p[i].t, d->p[i].hook);
        tp_tensor_release(d->p[i].t);
        tp__free(d->p[i].fqn);
    }
    tp__free(d->p);
    tp__free(d->seen);
    if (d->g)
        d->g->owner = NULL; /* the DDP's own: free it */
    tp_step_graph_free(d->g);
    tp__comm_release(d->comm);
    if (d->shim) {
        d->shim->ddp = NULL;
        tp__shim_release(d->shim);
    }
    tp__free(d);
}

/* A small int64 all_reduce (max) or broadcast from rank 0 of v[0..n), on the
 * parameters' device (a GPU backend moves only device memory, the sim
 * backend only meta tensors). */
static tp_status tp__small(tp_ddp *d, int64_t *v, int64_t n, bool broadcast)
{
    tp_device dev = tp_tensor_device(tp__local(d->p[0].t));
    tp_tensor *h = NULL, *t = NULL;
    TP_CHECK(tp_tensor_from_blob(TP_I64, TP_CPU, 1, &n, v, NULL, NULL, &h));
    tp_status st = dev.type == TP_DEVICE_CPU ? (t = tp_tensor_retain(h), TP_OK)
                                             : tp_tensor_to(h, TP_I64, dev, &t);
    if (st == TP_OK)
        st = broadcast ? tp_broadcast(d->comm, t, 0, NULL) : tp_all_reduce(d->comm, t, t, TP_MAX, NULL);
    /* meta (a simulated world): nothing moved, v keeps this rank's values,
     * which is what ranks that agree get back */
    if (st == TP_OK && t != h && dev.type != TP_DEVICE_META)
        st = tp_tensor_copy(h, t);
    tp_tensor_release(t);
    tp_tensor_release(h);
    return st;
}

/* One all_reduce (max) over [n, total, -n, -total]: every rank must wrap the
 * same number of parameters with the same number of elements. */
static tp_status tp__agree(tp_ddp *d, const char *fn)
{
    int64_t total = 0;
    for (int i = 0; i < d->n; i++)
        total += tp_tensor_numel(tp__local(d->p[i].t));
    int64_t v[4] = {d->n, total, -(int64_t)d->n, -total};
    tp_status st = tp__small(d, v, 4, false);
    if (st != TP_OK) {
        tp__error_prefix("%s: comparing the ranks' parameters", fn);
        return st;
    }
    if (v[0] != d->n || v[1] != total || -v[2] != d->n || -v[3] != total)
        return tp__error(TP_ERR_MISMATCH,
                         "%s: the ranks disagree on the module: this rank has %d parameters "
                         "(%lld elements), others between %lld and %lld parameters (%lld to "
                         "%lld elements)",
                         fn, d->n, (long long)total, (long long)-v[2], (long long)v[0],
                         (long long)-v[3], (long long)v[1]);
    return TP_OK;
}

/* The dtype a float gradient of local parameter l is all_reduced in. */
static tp_dtype tp__bucket_dtype(const tp_ddp *d, const tp_tensor *l)
{
    tp_dtype dt = tp_tensor_dtype(l);
    return d->opts.has_reduce_dtype && tp_dtype_is_float(dt) ? d->opts.reduce_dtype : dt;
}

tp_status tp_ddp_create(tp_module *module, tp_comm *comm, const tp_ddp_options *opts, tp_ddp **out)
{
    const char *fn = "tp_ddp_create";
    TP_ARG_CHECK(out, "%s: out is NULL", fn);
    *out = NULL;
    TP_ARG_CHECK(module, "%s: module is NULL", fn);
    TP_ARG_CHECK(comm, "%s: comm is NULL", fn);
    tp_ddp *d = tp__calloc(1, sizeof *d);
    if (!d)
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
    d->module = module;
    d->comm = tp__comm_retain(comm); /* the caller may free comm first */
    if (opts)
        d->opts = *opts;
    tp__collect c = {d, 0};
    tp_status st = tp_module_named_parameters(module, tp__collect_param, &c);
    if (st == TP_OK && d->n == 0)
        st = tp__error(TP_ERR_INVALID_ARG, "%s: the module has no parameter that requires grad",
                       fn);
    if (st == TP_OK && d->opts.max_in_flight < 0)
        st = tp__error(TP_ERR_INVALID_ARG, "%s: max_in_flight %d is negative", fn,
                       d->opts.max_in_flight);
    tp_dtype rd = d->opts.reduce_dtype;
    if (st == TP_OK && d->opts.has_reduce_dtype && rd != TP_F32 && rd != TP_BF16 && rd != TP_F16)
        st = tp__error(TP_ERR_INVALID_ARG,
                       "%s: reduce_dtype %s (%d) is not a reduction dtype: use f32, bf16 or "
                       "f16",
                       fn, tp_dtype_name(rd), (int)rd);
    if (st != TP_OK)
        goto fail;
    int64_t *numel = tp__calloc((size_t)d->n, sizeof *numel);
    tp_dtype *dt = tp__calloc((size_t)d->n, sizeof *dt);
    int *devkey = tp__calloc((size_t)d->n, sizeof *devkey);
    const char **names = tp__calloc((size_t)d->n, sizeof *names);
    d->seen = tp__calloc((size_t)d->n, sizeof *d->seen);
    if (!numel || !dt || !devkey || !names || !d->seen) {
        st = tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
    } else {
        for (int i = 0; i < d->n; i++) {
            tp_tensor *l = tp__local(d->p[i].t);
            tp_device dev = tp_tensor_device(l);
            numel[i] = tp_tensor_numel(l);
            dt[i] = tp__bucket_dtype(d, l);
            devkey[i] = (int)dev.type * 65536 + dev.index;
            names[i] = d->p[i].fqn;
        }
        st = tp__graph_new(fn, d->n, numel, dt, devkey, names, d->opts.bucket_cap_bytes,
                           &d->g);
    }
    tp__free(numel);
    tp__free(dt);
    tp__free(devkey);
    tp__free(names);
    if (st != TP_OK)
        goto fail;
    for (int i = 0; i < d->n; i++)
        d->g->converts[i] = d->g->dtype[i] != tp_tensor_dtype(tp__local(d->p[i].t));
    d->g->owner = d;
    if (!d->opts.manual_passes) {
        st = tp_pass_apply(tp_pass_bucket_fusion(), d->g);
        if (st == TP_OK)
            st = tp_pass_apply(tp_pass_late_waits(), d->g);
        if (st == TP_OK && d->opts.gradient_as_bucket_view)
            st = tp_pass_apply(tp_pass_remove_copies(), d->g);
        if (st != TP_OK)
            goto fail;
    }
    /* collective from here on: every rank reaches these calls */
    if ((st = tp__agree(d, fn)) != TP_OK)
        goto fail;
    if (!d->opts.params_everywhere) {
        for (int i = 0; i < d->n && st == TP_OK; i++) {
            tp_tensor *l = tp__local(d->p[i].t);
            if (!tp_tensor_is_contiguous(l))
                st = tp__error(TP_ERR_INVALID_ARG, "%s: parameter %s is not contiguous", fn,
                               d->p[i].fqn);
            else
                st = tp_broadcast(comm, l, 0, NULL);
            if (st != TP_OK)
                tp__error_prefix("%s: broadcasting %s from rank 0", fn, d->p[i].fqn);
        }
        if (st != TP_OK)
            goto fail;
    }
    for (int i = 0; i < d->n && st == TP_OK; i++)
        st = tp_tensor_add_grad_hook(d->p[i].t, tp__on_grad, &d->p[i], &d->p[i].hook);
    if (st != TP_OK)
        goto fail;
    for (int i = 0; i < d->n; i++)
        d->p[i].ddp = d;
    d->shim = tp__calloc(1, sizeof *d->shim);
    if (!d->shim) {
        st = tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
        goto fail;
    }
    atomic_init(&d->shim->refs, 1);
    d->shim->ddp = d;
    /* each hook holds a reference on the shim (released by the module) */
    atomic_fetch_add(&d->shim->refs, 1);
    st = tp_module_add_step_pre_hook(module, tp__step_hook, d->shim, tp__shim_release, NULL);
    if (st != TP_OK) {
        atomic_fetch_sub(&d->shim->refs, 1);
        goto fail;
    }
    atomic_fetch_add(&d->shim->refs, 1);
    st = tp_module_add_forward_pre_hook(module, tp__forward_hook, d->shim, tp__shim_release,
                                        NULL);
    if (st != TP_OK) {
        atomic_fetch_sub(&d->shim->refs, 1);
        goto fail;
    }
    if ((st = tp__prepare(d)) != TP_OK)
        goto fail;
    *out = d;
    return TP_OK;
fail:
    tp_ddp_free(d);
    return st;
}

tp_step_graph *tp_ddp_graph(tp_ddp *d) { return d ? d->g : NULL; }
tp_comm *tp_ddp_comm(const tp_ddp *d) { return d ? d->comm : NULL; }
tp_module *tp_ddp_module(const tp_ddp *d) { return d ? d->module : NULL; }
