/* Fully sharded data parallel (tp/dp.h, "fully sharded data parallel").
 *
 * A unit keeps, per parameter, the sharded parameter the module shows
 * between steps (a DTensor whose local rows are a view into the unit's flat
 * shard buffer) and an unsharded tensor (the TP shard the module computes
 * with) whose storage is allocated while gathered and dropped when
 * resharded (core's tp__storage_drop: the header stays, so the autograd
 * graph's saved references see the bytes again after the next gather).
 *
 * Hooks on the unit's module: a forward pre-hook gathers (and prefetches the
 * next unit), a forward hook reshards and puts a custom autograd function
 * on the output whose backward gathers again (and prefetches the unit
 * before), a gradient hook on every unsharded parameter counts the
 * gradients in and, with the last, reduce_scatters them into the sharded
 * parameters' gradients, and a step pre-hook finishes what is still due. */
#include <string.h>

#include "nn/nn_ext.h"
#include "tp/dp.h"
#include "tp/dtensor.h"

#define FSDP_MAX_TIES 4

typedef struct fsdp_unit fsdp_unit;

typedef struct fsdp_param {
    fsdp_unit *unit;
    int n_slots; /* the module slots holding it (a tied parameter: several) */
    tp_module *owner[FSDP_MAX_TIES];
    char *name[FSDP_MAX_TIES];
    char fqn[160];
    /* the parameter before sharding, for identity only (a tie with an outer
     * unit's slot, which then still holds it alive): not a reference */
    const tp_tensor *orig;
    tp_mesh *tp_mesh;      /* retained; NULL for a plain parameter */
    tp_placement q;        /* its placement on tp (Replicate when plain) */
    int ndim;
    int64_t gshape[TP_MAX_DIMS]; /* global */
    int64_t lshape[TP_MAX_DIMS]; /* the TP shard's */
    int64_t rows, rn, c, my_rows, off;
    tp_tensor *sharded;   /* the module's parameter between steps */
    tp_tensor *u_local;   /* the unsharded TP shard; storage dropped while resharded */
    tp_tensor *unsharded; /* u_local as the module computes with it (a DTensor on tp_mesh) */
    bool got_grad;
} fsdp_param;

typedef enum { FSDP_SHARDED, FSDP_GATHERING, FSDP_UNSHARDED } fsdp_state;

struct fsdp_unit {
    tp_module *module;
    fsdp_unit *root; /* the outermost unit around it (itself at the top) */
    tp_mesh *mesh;   /* the sharded parameters' mesh: (tp, dp) or dp; retained */
    tp_comm *dp;     /* borrowed from mesh */
    int dp_dim;      /* its index in mesh */
    int tp_dim;      /* -1: no tp dim */
    int rep_dim;     /* HSDP's dp_replicate dim, -1: none */
    tp_comm *rep;    /* its communicator (borrowed), NULL without */
    int64_t D;
    int n;
    fsdp_param *p;
    tp_dtype dtype, param_dtype, reduce_dtype;
    tp_device dev;
    int64_t shard_numel;
    tp_tensor *shard; /* [shard_numel]: the sharded parameters' rows, padded */
    tp_tensor *send, *recv;
    tp_work *work;
    fsdp_state state;
    bool keep, prefetch;
    int pending;      /* parameters whose gradient of this backward is still due */
    bool reduce_due;  /* a forward ran with grad: a reduce_scatter is owed */
    /* the root's: units in the order of the first forward */
    fsdp_unit **order;
    int n_order;
    size_t cap_order;
    bool order_done, recording;
    int index; /* in the root's order, -1 before */
};

static const char fsdp_key = 0;

/* ---- helpers ------------------------------------------------------------------- */

/* A [rows, lshape[1:]] view of `flat` (1-D contiguous) at element `at`. */
static tp_status flat_rows(tp_tensor *flat, int64_t at, const fsdp_param *p, int64_t rows,
                           tp_tensor **out)
{
    tp_tensor *n = NULL;
    TP_CHECK(tp_tensor_narrow(flat, 0, at, rows * p->rn, &n));
    int64_t shape[TP_MAX_DIMS];
    memcpy(shape, p->lshape, sizeof shape);
    shape[0] = rows;
    tp_status st = tp_tensor_view(n, p->ndim, shape, out);
    tp_tensor_release(n);
    return st;
}

/* Copies between the rank-major flat buffer `flat` ([D, shard_numel]: rank
 * k's shard of p at k * shard_numel + p->off, c rows, padded) and p's whole
 * TP shard `full` (p->rows rows, contiguous): into full when to_full, else
 * out of it. At most two copies: the full chunks as one strided copy, the
 * short last one apart. */
static tp_status copy_chunks(fsdp_unit *u, fsdp_param *p, tp_tensor *flat, tp_tensor *full,
                             bool to_full)
{
    const int64_t whole = p->c ? p->rows / p->c : 0, tail = p->rows - whole * p->c;
    tp_tensor *fl2 = NULL, *a = NULL, *b = NULL, *bv = NULL;
    tp_status st = tp_tensor_view(flat, 2, (int64_t[]){u->D, u->shard_numel}, &fl2);
    if (st == TP_OK && whole) { /* chunks 0 .. whole-1: [whole, c * rn] both ways */
        st = tp_tensor_narrow(fl2, 1, p->off, p->c * p->rn, &a);
        tp_tensor *a2 = NULL;
        if (st == TP_OK)
            st = tp_tensor_narrow(a, 0, 0, whole, &a2);
        tp_tensor_release(a);
        a = a2;
        if (st == TP_OK)
            st = tp_tensor_narrow(full, 0, 0, whole * p->c, &b);
        if (st == TP_OK)
            st = tp_tensor_view(b, 2, (int64_t[]){whole, p->c * p->rn}, &bv);
        if (st == TP_OK)
            st = to_full ? tp_tensor_copy(bv, a) : tp_tensor_copy(a, bv);
        tp_tensor_release(a);
        tp_tensor_release(b);
        tp_tensor_release(bv);
        a = b = bv = NULL;
    }
    if (st == TP_OK && tail) { /* chunk `whole`: the short one */
        st = flat_rows(flat, whole * u->shard_numel + p->off, p, tail, &a);
        if (st == TP_OK)
            st = tp_tensor_narrow(full, 0, whole * p->c, tail, &b);
        if (st == TP_OK)
            st = to_full ? tp_tensor_copy(b, a) : tp_tensor_copy(a, b);
        tp_tensor_release(a);
        tp_tensor_release(b);
    }
    tp_tensor_release(fl2);
    return st;
}

/* Rows of chunk k of the TP shard's dim 0 (torch.chunk over D). */
static int64_t chunk_rows(const fsdp_param *p, int64_t k)
{
    int64_t r = p->rows - k * p->c;
    return r < 0 ? 0 : r < p->c ? r : p->c;
}

static tp_status set_slots(fsdp_param *p, tp_tensor *t)
{
    for (int s = 0; s < p->n_slots; s++)
        TP_CHECK(tp_module_set_parameter(p->owner[s], p->name[s], t));
    return TP_OK;
}

/* A sharded parameter's (or gradient's) placements on u->mesh: q on tp,
 * Shard(0) on dp, Replicate on dp_replicate. */
static void placements_of(const fsdp_unit *u, tp_placement q, tp_placement *pl)
{
    for (int d = 0; d < tp_mesh_ndim(u->mesh); d++)
        pl[d] = d == u->dp_dim ? tp_shard(0) : d == u->tp_dim ? q : tp_replicate();
}

/* ---- gather ------------------------------------------------------------------- */

static tp_status gather_start(fsdp_unit *u, bool async)
{
    tp_tensor *send = u->shard;
    if (u->param_dtype != u->dtype) {
        TP_CHECK(tp_tensor_empty(u->param_dtype, u->dev, 1, &u->shard_numel, &u->send));
        TP_CHECK(tp_tensor_copy(u->send, u->shard));
        send = u->send;
    }
    const int64_t n = u->D * u->shard_numel;
    TP_CHECK(tp_tensor_empty(u->param_dtype, u->dev, 1, &n, &u->recv));
    TP_CHECK(tp_all_gather(u->dp, send, u->recv, async ? &u->work : NULL));
    u->state = FSDP_GATHERING;
    return TP_OK;
}

static tp_status make_unsharded(fsdp_unit *u, fsdp_param *p);

static tp_status gather_finish(fsdp_unit *u)
{
    tp_status st = TP_OK;
    if (u->work) {
        st = tp_work_wait(u->work);
        tp_work_free(u->work);
        u->work = NULL;
    }
    for (int i = 0; i < u->n && st == TP_OK; i++) {
        fsdp_param *p = &u->p[i];
        if (!p->u_local)
            st = make_unsharded(u, p);
        else
            st = tp__storage_restore(p->u_local);
        if (st == TP_OK)
            st = copy_chunks(u, p, u->recv, p->u_local, true);
        if (st == TP_OK)
            st = set_slots(p, p->unsharded);
    }
    tp_tensor_release(u->send);
    tp_tensor_release(u->recv);
    u->send = u->recv = NULL;
    if (st != TP_OK) {
        tp__error_prefix("tp_fully_shard: gathering the parameters of unit '%s'",
                         tp_module_name(u->module));
        return st;
    }
    u->state = FSDP_UNSHARDED;
    return TP_OK;
}

static tp_status unshard(fsdp_unit *u)
{
    if (!u->n) { /* a unit whose parameters all went to inner units */
        u->state = FSDP_UNSHARDED;
        return TP_OK;
    }
    if (u->state == FSDP_SHARDED)
        TP_CHECK(gather_start(u, false));
    return u->state == FSDP_GATHERING ? gather_finish(u) : TP_OK;
}

/* Issues the all_gather of the unit `step` places from u in the root's
 * forward order (+1 in forward, -1 in backward), if it is resharded. */
static tp_status prefetch(fsdp_unit *u, int step)
{
    fsdp_unit *r = u->root;
    if (!u->prefetch || !r->order_done || u->index < 0)
        return TP_OK;
    const int k = u->index + step;
    if (k < 0 || k >= r->n_order || r->order[k]->state != FSDP_SHARDED || !r->order[k]->n)
        return TP_OK;
    /* in backward, only a unit whose gradients are still to come (the
     * root's may all be in already, its parameters used at the end of the
     * forward) */
    if (step < 0 && !r->order[k]->reduce_due)
        return TP_OK;
    return gather_start(r->order[k], true);
}

static void reshard(fsdp_unit *u)
{
    for (int i = 0; i < u->n; i++) {
        fsdp_param *p = &u->p[i];
        if (p->u_local)
            tp__storage_drop(p->u_local);
        (void)set_slots(p, p->sharded); /* replacing a slot with a tensor it held cannot fail */
    }
    u->state = FSDP_SHARDED;
}

/* ---- reduce_scatter of the gradients ----------------------------------------------- */

static tp_status reduce_grads(fsdp_unit *u)
{
    u->reduce_due = false;
    u->pending = 0;
    tp_tensor *send = NULL, *recv = NULL;
    const int64_t n = u->D * u->shard_numel;
    tp_status st = tp_tensor_empty(u->reduce_dtype, u->dev, 1, &n, &send);
    if (st == TP_OK)
        st = tp_tensor_empty(u->reduce_dtype, u->dev, 1, &u->shard_numel, &recv);
    for (int i = 0; i < u->n && st == TP_OK; i++) {
        fsdp_param *p = &u->p[i];
        tp_tensor *g = tp_tensor_grad(p->unsharded);
        /* zeros where no gradient goes: the padding of short chunks, and a
         * parameter that got none its whole share */
        for (int64_t k = 0; k < u->D && st == TP_OK; k++) {
            const int64_t from = g ? chunk_rows(p, k) : 0;
            tp_tensor *pad = NULL;
            if (from == p->c)
                continue;
            st = tp_tensor_narrow(send, 0, k * u->shard_numel + p->off + from * p->rn,
                                  (p->c - from) * p->rn, &pad);
            if (st == TP_OK)
                st = tp_tensor_fill(pad, 0.0);
            tp_tensor_release(pad);
        }
        if (!g || st != TP_OK)
            continue;
        tp_tensor *gl = tp_tensor_is_dtensor(g) ? tp_dtensor_local(g) : g, *gc = NULL;
        /* a gradient the backward left strided is copied whole first */
        st = tp_tensor_is_contiguous(gl) ? TP_OK : tp_tensor_to(gl, u->reduce_dtype, u->dev, &gc);
        if (st == TP_OK)
            st = copy_chunks(u, p, send, gc ? gc : gl, false);
        tp_tensor_release(gc);
    }
    if (st == TP_OK)
        st = tp_reduce_scatter(u->dp, send, recv, TP_AVG, NULL);
    if (st == TP_OK && u->rep) /* HSDP: the shards' replicas average theirs */
        st = tp_all_reduce(u->rep, recv, recv, TP_AVG, NULL);
    tp_tensor_release(send);
    for (int i = 0; i < u->n && st == TP_OK; i++) {
        fsdp_param *p = &u->p[i];
        tp_tensor *g = tp_tensor_grad(p->unsharded);
        if (!g)
            continue;
        tp_placement pl[TP_MESH_MAX_DIMS];
        placements_of(u, p->tp_mesh ? tp_dtensor_placements(g)[0] : tp_replicate(), pl);
        tp_tensor *view = NULL, *local = NULL, *dg = NULL;
        st = flat_rows(recv, p->off, p, p->my_rows, &view);
        /* the gradient is its rows of recv, in the shards' dtype: no copy
         * when the reduction ran in it */
        if (st == TP_OK && u->reduce_dtype == u->dtype)
            local = tp_tensor_retain(view);
        else if (st == TP_OK)
            st = tp_tensor_to(view, u->dtype, u->dev, &local);
        if (st == TP_OK) {
            tp_from_local_options fo = {.global_shape = p->gshape};
            st = tp_dtensor_from_local(u->mesh, local, tp_mesh_ndim(u->mesh), pl, &fo, &dg);
        }
        tp_tensor *prev = st == TP_OK ? tp_tensor_grad(p->sharded) : NULL;
        if (st == TP_OK && prev) { /* gradient accumulation over several backwards */
            tp_tensor *sum = NULL;
            st = tp_add(prev, dg, &sum);
            tp_tensor_release(dg);
            dg = sum;
        }
        if (st == TP_OK)
            st = tp_tensor_set_grad(p->sharded, dg);
        tp_tensor_release(dg);
        tp_tensor_release(local);
        tp_tensor_release(view);
        tp_tensor_zero_grad(p->unsharded);
    }
    tp_tensor_release(recv);
    reshard(u);
    if (st != TP_OK)
        tp__error_prefix("tp_fully_shard: reducing the gradients of unit '%s'",
                         tp_module_name(u->module));
    return st;
}

/* ---- hooks --------------------------------------------------------------------------- */

static tp_status on_grad(tp_tensor *t, void *ctx)
{
    fsdp_param *p = ctx;
    fsdp_unit *u = p->unit;
    (void)t;
    if (!u->reduce_due || p->got_grad)
        return TP_OK;
    p->got_grad = true;
    return --u->pending == 0 ? reduce_grads(u) : TP_OK;
}

static tp_status pre_backward(void *ctx, tp_tensor *grad_out, int n, tp_tensor **grad_in)
{
    fsdp_unit *u = ctx;
    (void)n;
    TP_CHECK(unshard(u));
    TP_CHECK(prefetch(u, -1));
    grad_in[0] = tp_tensor_retain(grad_out);
    return TP_OK;
}

static tp_status pre_forward(tp_module *m, int nargs, tp_tensor **args, int nkw, tp_kwarg *kw,
                             void *ctx)
{
    fsdp_unit *u = ctx, *r = u->root;
    (void)m, (void)nargs, (void)args, (void)nkw, (void)kw;
    if (u == r && !r->order_done) { /* the first forward records the units' order */
        r->recording = true;
        r->n_order = 0;
    }
    if (r->recording) {
        if (!tp__grow_array((void **)&r->order, (size_t)r->n_order, &r->cap_order,
                            sizeof *r->order))
            return tp__error(TP_ERR_NO_MEMORY, "tp_fully_shard: out of memory");
        u->index = r->n_order;
        r->order[r->n_order++] = u;
    }
    TP_CHECK(unshard(u));
    if (tp_grad_enabled()) {
        u->reduce_due = true;
        u->pending = u->n;
        for (int i = 0; i < u->n; i++)
            u->p[i].got_grad = false;
    }
    return prefetch(u, +1);
}

static tp_status post_forward(tp_module *m, int nargs, tp_tensor *const *args, tp_tensor **out,
                              void *ctx)
{
    fsdp_unit *u = ctx;
    (void)m, (void)nargs, (void)args;
    if (u == u->root && u->recording) {
        u->recording = false;
        u->order_done = true;
    }
    if (tp_grad_enabled() && *out && tp_tensor_requires_grad(*out)) {
        tp_tensor *d = NULL;
        TP_CHECK(tp_tensor_detach(*out, &d));
        tp_status st = tp_function_attach(d, "fsdp_pre_backward", 1, out, pre_backward, u, NULL);
        if (st != TP_OK) {
            tp_tensor_release(d);
            return st;
        }
        tp_tensor_release(*out);
        *out = d;
    }
    if (!u->keep && u != u->root)
        reshard(u);
    return TP_OK;
}

static tp_status before_step(tp_module *m, void *ctx)
{
    fsdp_unit *u = ctx;
    (void)m;
    if (u->state == FSDP_GATHERING) /* a prefetch nobody used */
        TP_CHECK(gather_finish(u));
    if (u->reduce_due) {
        bool any = false;
        for (int i = 0; i < u->n; i++)
            any = any || tp_tensor_grad(u->p[i].unsharded);
        if (any)
            return reduce_grads(u);
        u->reduce_due = false;
    }
    if (u->state == FSDP_UNSHARDED)
        reshard(u);
    return TP_OK;
}

/* ---- the unsharded tensors -------------------------------------------------------- */

static tp_status make_unsharded(fsdp_unit *u, fsdp_param *p)
{
    TP_CHECK(tp_tensor_empty(u->param_dtype, u->dev, p->ndim, p->lshape, &p->u_local));
    tp_status st = TP_OK;
    tp_no_grad_begin();
    if (p->tp_mesh) {
        tp_from_local_options fo = {.global_shape = p->gshape};
        st = tp_dtensor_from_local(p->tp_mesh, p->u_local, 1, &p->q, &fo, &p->unsharded);
    } else {
        p->unsharded = tp_tensor_retain(p->u_local);
    }
    tp_no_grad_end();
    if (st == TP_OK)
        st = tp_tensor_set_requires_grad(p->unsharded, true);
    if (st == TP_OK)
        st = tp_tensor_add_grad_hook(p->unsharded, on_grad, p, NULL);
    return st;
}

/* ---- the unit --------------------------------------------------------------------- */

static void unit_free(void *ptr)
{
    fsdp_unit *u = ptr;
    if (!u)
        return;
    tp_work_free(u->work);
    for (int i = 0; i < u->n; i++) {
        fsdp_param *p = &u->p[i];
        for (int s = 0; s < p->n_slots; s++)
            tp__free(p->name[s]);
        tp_tensor_release(p->sharded);
        tp_tensor_release(p->unsharded);
        tp_tensor_release(p->u_local);
        tp_mesh_free(p->tp_mesh);
    }
    tp_tensor_release(u->shard);
    tp_tensor_release(u->send);
    tp_tensor_release(u->recv);
    tp_mesh_free(u->mesh);
    tp__free(u->order);
    tp__free(u->p);
    tp__free(u);
}

typedef struct {
    fsdp_unit *u;
    size_t cap;
    tp_module *top;
} walk_ctx;

/* Whether t is the parameter, before sharding, of a unit inside m. */
static bool tied_inside(tp_module *m, const tp_tensor *t)
{
    fsdp_unit *in = tp__module_attached(m, &fsdp_key);
    if (in) {
        for (int i = 0; i < in->n; i++)
            if (in->p[i].orig == t)
                return true;
    }
    for (int c = 0; c < tp_module_num_children(m); c++)
        if (tied_inside(tp_module_child_at(m, c, NULL), t))
            return true;
    return false;
}

static tp_status collect(walk_ctx *w, tp_module *m, const char *fqn)
{
    fsdp_unit *u = w->u;
    for (int i = 0; i < tp__module_num_params(m); i++) {
        const char *name = NULL;
        tp_tensor *t = tp__module_param_at(m, i, &name);
        if (!t || !tp_tensor_requires_grad(t))
            continue;
        char full[160];
        snprintf(full, sizeof full, "%s%s%s", fqn, fqn[0] ? "." : "", name);
        if (tied_inside(w->top, t))
            return tp__error(TP_ERR_INVALID_ARG,
                             "tp_fully_shard: parameter '%s' is tied to a parameter of a unit "
                             "inside this one; shard the module that holds both as one unit",
                             full);
        fsdp_param *p = NULL;
        for (int k = 0; k < u->n && !p; k++)
            if (u->p[k].orig == t)
                p = &u->p[k];
        if (p && p->n_slots == FSDP_MAX_TIES)
            return tp__error(TP_ERR_NOT_SUPPORTED,
                             "tp_fully_shard: parameter '%s' is tied under more than %d names",
                             full, FSDP_MAX_TIES);
        if (!p) {
            if (!tp__grow_array((void **)&u->p, (size_t)u->n, &w->cap, sizeof *u->p))
                return tp__error(TP_ERR_NO_MEMORY, "tp_fully_shard: out of memory");
            p = &u->p[u->n++];
            memset(p, 0, sizeof *p);
            p->unit = u;
            p->orig = t;
            snprintf(p->fqn, sizeof p->fqn, "%s", full);
        }
        char *copy = tp__strdup(name);
        if (!copy)
            return tp__error(TP_ERR_NO_MEMORY, "tp_fully_shard: out of memory");
        p->owner[p->n_slots] = m;
        p->name[p->n_slots++] = copy;
    }
    for (int c = 0; c < tp_module_num_children(m); c++) {
        const char *name = NULL;
        tp_module *ch = tp_module_child_at(m, c, &name);
        if (tp__module_attached(ch, &fsdp_key))
            continue; /* a unit of its own */
        char sub[160];
        snprintf(sub, sizeof sub, "%s%s%s", fqn, fqn[0] ? "." : "", name);
        TP_CHECK(collect(w, ch, sub));
    }
    return TP_OK;
}

/* Checks p's layout against the mesh and fills its shapes. */
static tp_status describe(fsdp_unit *u, fsdp_param *p, const tp_mesh *user, int tp_dim)
{
    const char *fn = "tp_fully_shard";
    const tp_tensor *t = p->orig;
    tp_tensor *local = (tp_tensor *)t;
    if (tp_tensor_is_dtensor(t)) {
        tp_mesh *pm = tp_dtensor_mesh(t);
        TP_ARG_CHECK(tp_dim >= 0,
                     "%s: parameter '%s' is a DTensor but the mesh has no \"tp\" dim: pass "
                     "the 2-D (dp, tp) mesh its TP mesh was sliced from", fn, p->fqn);
        TP_ARG_CHECK(tp_mesh_ndim(pm) == 1 && tp_mesh_size(pm, 0) == tp_mesh_size(user, tp_dim) &&
                         tp_mesh_coord(pm, 0) == tp_mesh_coord(user, tp_dim),
                     "%s: parameter '%s' lives on a mesh that is not the mesh's \"tp\" dim "
                     "(sizes %lld and %lld)", fn, p->fqn, (long long)tp_mesh_size(pm, 0),
                     (long long)tp_mesh_size(user, tp_dim));
        p->q = tp_dtensor_placements(t)[0];
        TP_ARG_CHECK(p->q.kind != TP_PLACEMENT_PARTIAL, "%s: parameter '%s' is Partial", fn,
                     p->fqn);
        p->tp_mesh = tp_mesh_retain(pm);
        local = tp_dtensor_local(t);
    } else {
        p->q = tp_replicate();
    }
    TP_ARG_CHECK(t->ndim >= 1, "%s: parameter '%s' is a scalar: nothing to shard on dim 0", fn,
                 p->fqn);
    const tp_dtype dt = tp_tensor_dtype(t);
    const tp_device dev = tp_tensor_device(local);
    if (p == &u->p[0]) {
        u->dtype = dt;
        u->dev = dev;
    }
    TP_ARG_CHECK(dt == u->dtype, "%s: parameter '%s' is %s, '%s' %s: a unit's parameters share "
                 "one dtype", fn, p->fqn, tp_dtype_name(dt), u->p[0].fqn, tp_dtype_name(u->dtype));
    TP_ARG_CHECK(dev.type == u->dev.type && dev.index == u->dev.index,
                 "%s: parameter '%s' is on another device than '%s'", fn, p->fqn, u->p[0].fqn);
    p->ndim = t->ndim;
    memcpy(p->gshape, t->shape, sizeof(int64_t) * (size_t)t->ndim);
    memcpy(p->lshape, local->shape, sizeof(int64_t) * (size_t)t->ndim);
    p->rows = p->lshape[0];
    p->rn = 1;
    for (int d = 1; d < p->ndim; d++)
        p->rn *= p->lshape[d];
    p->c = (p->rows + u->D - 1) / u->D;
    return TP_OK;
}

/* The unit's flat shard and the sharded parameters over it. */
static tp_status build_shards(fsdp_unit *u, int64_t dp_rank)
{
    u->shard_numel = 0;
    for (int i = 0; i < u->n; i++) {
        fsdp_param *p = &u->p[i];
        p->off = u->shard_numel;
        p->my_rows = chunk_rows(p, dp_rank);
        u->shard_numel += p->c * p->rn;
    }
    TP_CHECK(tp_tensor_zeros(u->dtype, u->dev, 1, &u->shard_numel, &u->shard));
    for (int i = 0; i < u->n; i++) {
        fsdp_param *p = &u->p[i];
        tp_tensor *view = NULL, *src = NULL;
        const tp_tensor *t = p->orig;
        tp_tensor *local = tp_tensor_is_dtensor(t) ? tp_dtensor_local(t) : (tp_tensor *)t;
        tp_status st = flat_rows(u->shard, p->off, p, p->my_rows, &view);
        if (st == TP_OK)
            st = tp_tensor_narrow(local, 0, dp_rank * p->c, p->my_rows, &src);
        if (st == TP_OK)
            st = tp_tensor_copy(view, src);
        tp_tensor_release(src);
        if (st == TP_OK) {
            tp_placement pl[TP_MESH_MAX_DIMS];
            placements_of(u, p->q, pl);
            tp_from_local_options fo = {.global_shape = p->gshape};
            tp_no_grad_begin();
            st = tp_dtensor_from_local(u->mesh, view, tp_mesh_ndim(u->mesh), pl, &fo,
                                       &p->sharded);
            tp_no_grad_end();
        }
        tp_tensor_release(view);
        if (st == TP_OK)
            st = tp_tensor_set_requires_grad(p->sharded, true);
        if (st != TP_OK)
            return st;
    }
    return TP_OK;
}

/* This unit is the root of every unit inside it. */
static void set_root(tp_module *m, fsdp_unit *root)
{
    fsdp_unit *in = tp__module_attached(m, &fsdp_key);
    if (in)
        in->root = root;
    for (int c = 0; c < tp_module_num_children(m); c++)
        set_root(tp_module_child_at(m, c, NULL), root);
}

tp_status tp_fully_shard(tp_module *unit, tp_mesh *mesh, const tp_fsdp_options *opts)
{
    const char *fn = "tp_fully_shard";
    TP_ARG_CHECK(unit, "%s: unit is NULL", fn);
    TP_ARG_CHECK(mesh, "%s: mesh is NULL", fn);
    if (tp__module_attached(unit, &fsdp_key))
        return tp__error(TP_ERR_STATE, "%s: '%s' is fully sharded already", fn,
                         tp_module_name(unit));
    const tp_fsdp_options o = opts ? *opts : (tp_fsdp_options){0};
    const int nd = tp_mesh_ndim(mesh);
    const int dp_dim = nd == 1 ? 0 : tp_mesh_dim_index(mesh, "dp");
    const int tp_dim = nd == 1 ? -1 : tp_mesh_dim_index(mesh, "tp");
    const int rep_dim = nd == 1 ? -1 : tp_mesh_dim_index(mesh, "dp_replicate");
    TP_ARG_CHECK(nd == 1 || (dp_dim >= 0 && nd == 1 + (tp_dim >= 0) + (rep_dim >= 0)),
                 "%s: the mesh has %d dims; pass a 1-D dp mesh, or a mesh of a \"dp\" dim "
                 "with a \"tp\" dim, a \"dp_replicate\" dim (HSDP) or both", fn, nd);
    for (int k = 0; k < 2; k++) {
        const bool has = k ? o.has_reduce_dtype : o.has_param_dtype;
        const tp_dtype d = k ? o.reduce_dtype : o.param_dtype;
        TP_ARG_CHECK(!has || d == TP_F32 || d == TP_BF16 || d == TP_F16,
                     "%s: %s %s is not f32, bf16 or f16", fn, k ? "reduce_dtype" : "param_dtype",
                     (unsigned)d < TP_DTYPE_COUNT ? tp_dtype_name(d) : "?");
    }
    fsdp_unit *u = tp__calloc(1, sizeof *u);
    if (!u)
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
    u->module = unit;
    u->root = u;
    u->index = -1;
    u->keep = o.keep_after_forward;
    u->prefetch = !o.no_prefetch;
    u->D = tp_mesh_size(mesh, dp_dim);
    walk_ctx w = {.u = u, .top = unit};
    tp_status st = collect(&w, unit, "");
    for (int i = 0; i < u->n && st == TP_OK; i++)
        st = describe(u, &u->p[i], mesh, tp_dim);
    /* collective from here: every rank has validated the same module. The
     * sharded parameters' mesh: (dp_replicate, tp, dp), those present */
    const char *names[3];
    int nn = 0;
    u->rep_dim = u->tp_dim = -1;
    if (rep_dim >= 0)
        u->rep_dim = nn, names[nn++] = "dp_replicate";
    if (tp_dim >= 0)
        u->tp_dim = nn, names[nn++] = "tp";
    u->dp_dim = nn;
    names[nn++] = "dp";
    if (st == TP_OK && nd > 1)
        st = tp_mesh_slice(mesh, nn, names, &u->mesh);
    else if (st == TP_OK)
        u->mesh = tp_mesh_retain(mesh);
    if (st == TP_OK) {
        u->dp = tp_mesh_comm(u->mesh, u->dp_dim);
        u->rep = u->rep_dim >= 0 ? tp_mesh_comm(u->mesh, u->rep_dim) : NULL;
        u->param_dtype = o.has_param_dtype ? o.param_dtype : u->dtype;
        u->reduce_dtype = o.has_reduce_dtype ? o.reduce_dtype : u->param_dtype;
        if (u->n)
            st = build_shards(u, tp_mesh_coord(u->mesh, u->dp_dim));
    }
    int h[3] = {0};
    if (st == TP_OK)
        st = tp_module_add_forward_pre_hook(unit, pre_forward, u, NULL, &h[0]);
    if (st == TP_OK)
        st = tp_module_add_forward_hook(unit, post_forward, u, NULL, &h[1]);
    if (st == TP_OK)
        st = tp_module_add_step_pre_hook(unit, before_step, u, NULL, &h[2]);
    if (st == TP_OK)
        st = tp__module_attach(unit, &fsdp_key, u, unit_free);
    if (st != TP_OK) {
        for (int k = 0; k < 3; k++)
            tp_module_remove_hook(unit, h[k]);
        unit_free(u);
        return st;
    }
    for (int i = 0; i < u->n; i++) /* the module shows the shards from here on */
        (void)set_slots(&u->p[i], u->p[i].sharded);
    set_root(unit, u);
    return TP_OK;
}

bool tp_module_is_fully_sharded(const tp_module *m)
{
    return m && tp__module_attached(m, &fsdp_key);
}
