/* DTensors: layouts, creation from full or local tensors, conversion back. */
#include <stdio.h>
#include <string.h>

#include "dtensor/dtensor_internal.h"

/* ---- placements ----------------------------------------------------------- */

const char *tp_placement_str(tp_placement p, char *buf, size_t len)
{
    switch (p.kind) {
    case TP_PLACEMENT_REPLICATE: snprintf(buf, len, "R"); break;
    case TP_PLACEMENT_SHARD: snprintf(buf, len, "S(%d)", p.dim); break;
    case TP_PLACEMENT_PARTIAL: snprintf(buf, len, "P(%s)", tp_reduce_op_name(p.op)); break;
    default: snprintf(buf, len, "invalid"); break;
    }
    return buf;
}

const char *tp_placements_str(int n, const tp_placement *p, char *buf, size_t len)
{
    size_t used = 0;
    if (!len)
        return buf;
    buf[0] = '\0';
    used += (size_t)snprintf(buf, len, "(");
    for (int i = 0; i < n && used < len; i++) {
        char one[32];
        used += (size_t)snprintf(buf + used, len - used, "%s%s", i ? ", " : "",
                                 tp_placement_str(p[i], one, sizeof one));
    }
    if (used < len)
        snprintf(buf + used, len - used, ")");
    return buf;
}

bool tp__placement_eq(tp_placement a, tp_placement b)
{
    if (a.kind != b.kind)
        return false;
    if (a.kind == TP_PLACEMENT_SHARD)
        return a.dim == b.dim;
    if (a.kind == TP_PLACEMENT_PARTIAL)
        return a.op == b.op;
    return true;
}

tp_status tp__placements_check(const char *fn, const tp_mesh *mesh, int ndim, int n,
                               const tp_placement *in, bool allow_partial, tp_placement *out)
{
    TP_ARG_CHECK(mesh, "%s: mesh is NULL", fn);
    int m = tp_mesh_ndim(mesh);
    TP_ARG_CHECK(n == m, "%s: %d placements for a %d-d mesh (one per mesh dim)", fn, n, m);
    TP_ARG_CHECK(in, "%s: placements is NULL", fn);
    for (int i = 0; i < m; i++) {
        tp_placement p = in[i];
        switch (p.kind) {
        case TP_PLACEMENT_REPLICATE:
            p = tp_replicate();
            break;
        case TP_PLACEMENT_SHARD: {
            int d = tp__wrap_dim(p.dim, ndim);
            if (d < 0)
                return tp__error(TP_ERR_INVALID_ARG,
                                 "%s: placement %d is Shard(%d) but the tensor has %d dims", fn,
                                 i, p.dim, ndim);
            p.dim = d;
            p.op = TP_SUM;
            break;
        }
        case TP_PLACEMENT_PARTIAL:
            if (!allow_partial)
                return tp__error(TP_ERR_INVALID_ARG, "%s: placement %d is Partial, not allowed here",
                                 fn, i);
            if (p.op != TP_SUM && p.op != TP_AVG && p.op != TP_MAX && p.op != TP_MIN)
                return tp__error(TP_ERR_INVALID_ARG,
                                 "%s: placement %d is Partial(%s); only sum, avg, max, min", fn, i,
                                 tp_reduce_op_name(p.op));
            p.dim = 0;
            break;
        default:
            return tp__error(TP_ERR_INVALID_ARG, "%s: placement %d has an invalid kind %d", fn, i,
                             (int)p.kind);
        }
        out[i] = p;
    }
    return TP_OK;
}

/* ---- shard geometry ------------------------------------------------------- */

void tp__shard_extent(const tp_mesh *mesh, int ndim, const int64_t *global_shape,
                      const tp_placement *placements, const int64_t *coord, int64_t *local_shape,
                      int64_t *offset)
{
    for (int d = 0; d < ndim; d++) {
        local_shape[d] = global_shape[d];
        if (offset)
            offset[d] = 0;
    }
    int m = tp_mesh_ndim(mesh);
    for (int i = 0; i < m; i++) {
        if (placements[i].kind != TP_PLACEMENT_SHARD)
            continue;
        int d = placements[i].dim;
        int64_t c = coord ? coord[i] : tp_mesh_coord(mesh, i);
        int64_t start = 0, len = 0;
        tp_chunk_range(local_shape[d], tp_mesh_size(mesh, i), c, &start, &len);
        local_shape[d] = len;
        if (offset)
            offset[d] += start;
    }
}

tp_status tp_dtensor_shard_extent(const tp_mesh *mesh, int ndim, const int64_t *global_shape,
                                  int nplacements, const tp_placement *placements,
                                  const int64_t *coord, int64_t *local_shape, int64_t *offset)
{
    const char *fn = "tp_dtensor_shard_extent";
    TP_ARG_CHECK(ndim >= 0 && ndim <= TP_MAX_DIMS, "%s: ndim %d out of range", fn, ndim);
    TP_ARG_CHECK(global_shape || ndim == 0, "%s: global_shape is NULL", fn);
    TP_ARG_CHECK(local_shape || ndim == 0, "%s: local_shape is NULL", fn);
    for (int d = 0; d < ndim; d++)
        TP_ARG_CHECK(global_shape[d] >= 0, "%s: global size %lld of dim %d is negative", fn,
                     (long long)global_shape[d], d);
    tp_placement p[TP_MESH_MAX_DIMS];
    TP_CHECK(tp__placements_check(fn, mesh, ndim, nplacements, placements, true, p));
    if (coord)
        for (int i = 0; i < tp_mesh_ndim(mesh); i++)
            TP_ARG_CHECK(coord[i] >= 0 && coord[i] < tp_mesh_size(mesh, i),
                         "%s: coordinate %lld out of range for mesh dim %d of size %lld", fn,
                         (long long)coord[i], i, (long long)tp_mesh_size(mesh, i));
    tp__shard_extent(mesh, ndim, global_shape, p, coord, local_shape, offset);
    return TP_OK;
}

/* ---- the tensor extension (dtensor_internal.h) ------------------------------ */

/* Node release lives in autograd.c; the finalize hook only drops references. */
void tp__node_release(tp__node *n);

static void tp__ext_finalize(tp_tensor *t)
{
    tp__ext *e = t->ext;
    if (e->dist.local) {
        tp_tensor_release(e->dist.local);
        tp_mesh_free(e->dist.mesh); /* may be the last reference */
    }
    tp__autograd *ag = &e->ag;
    while (ag->hooks) {
        tp__grad_hook *h = ag->hooks;
        ag->hooks = h->next;
        tp__free(h);
    }
    tp_tensor_release(ag->grad);
    if (ag->grad_fn)
        tp__node_release(ag->grad_fn);
    tp__free(e);
    t->ext = NULL;
    t->ext_ops = NULL;
}

static tp_tensor *tp__ext_local(const tp_tensor *t) { return ((tp__ext *)t->ext)->dist.local; }

static tp_status tp__ext_refuse(const tp_tensor *t, const char *fn, const char *what)
{
    return tp__error(TP_ERR_INVALID_ARG,
                     "%s: %s is a DTensor; use tp_dtensor_local, tp_dtensor_to_local or "
                     "tp_dtensor_full_tensor",
                     fn, what);
}

const tp__tensor_ext_ops tp__ext_ops = {
    .finalize = tp__ext_finalize,
    .local = tp__ext_local,
    .refuse = tp__ext_refuse,
};

tp__ext *tp__ext_get(tp_tensor *t)
{
    if (!t->ext) {
        t->ext = tp__calloc(1, sizeof(tp__ext));
        if (t->ext)
            t->ext_ops = &tp__ext_ops;
    }
    return t->ext;
}

/* ---- wrapping ------------------------------------------------------------- */

tp_status tp__dtensor_wrap(tp_mesh *mesh, tp_tensor *local, const tp_placement *placements,
                           int ndim, const int64_t *global_shape, tp_tensor **out)
{
    tp__ext *e = tp__calloc(1, sizeof *e);
    tp_tensor *t = tp__calloc(1, sizeof *t);
    if (!e || !t) {
        tp__free(e);
        tp__free(t);
        return tp__error(TP_ERR_NO_MEMORY, "out of memory for a DTensor");
    }
    atomic_init(&t->refcount, 1);
    t->storage = NULL;
    t->dtype = local->dtype;
    t->ndim = ndim;
    for (int i = 0; i < ndim; i++)
        t->shape[i] = global_shape[i];
    tp__dist *d = &e->dist;
    d->local = tp_tensor_retain(local);
    d->mesh = tp_mesh_retain(mesh);
    d->mesh_ndim = tp_mesh_ndim(mesh);
    memcpy(d->placements, placements, sizeof(tp_placement) * (size_t)d->mesh_ndim);
    t->ext_ops = &tp__ext_ops;
    t->ext = e;
    *out = t;
    return TP_OK;
}

/* ---- properties ----------------------------------------------------------- */

bool tp_tensor_is_dtensor(const tp_tensor *t) { return tp__dist_of(t) != NULL; }

tp_mesh *tp_dtensor_mesh(const tp_tensor *dt)
{
    tp__dist *d = tp__dist_of(dt);
    return d ? d->mesh : NULL;
}

const tp_placement *tp_dtensor_placements(const tp_tensor *dt)
{
    tp__dist *d = tp__dist_of(dt);
    return d ? d->placements : NULL;
}

tp_tensor *tp_dtensor_local(const tp_tensor *dt)
{
    tp__dist *d = tp__dist_of(dt);
    return d ? d->local : NULL;
}

/* ---- creation ------------------------------------------------------------- */

/* A contiguous copy of t's block [offset, offset + shape), in storage of its
 * own even where the block is contiguous in t: a view would keep the whole of
 * t alive under the shard, and a sharded parameter would hold W times its
 * share. */
static tp_status tp__block(tp_tensor *t, const int64_t *shape, const int64_t *offset,
                           tp_tensor **out)
{
    tp_tensor *v = tp_tensor_retain(t), *next = NULL;
    tp_status st = TP_OK;
    for (int d = 0; d < t->ndim && st == TP_OK; d++) {
        if (offset[d] == 0 && shape[d] == v->shape[d])
            continue;
        st = tp_tensor_narrow(v, d, offset[d], shape[d], &next);
        tp_tensor_release(v);
        v = next;
    }
    if (st == TP_OK)
        st = tp_tensor_clone(v, out);
    tp_tensor_release(v);
    return st;
}

/*
 * src_rank's value, sent mesh dim by mesh dim (0 first) over the per-dim
 * communicators from the rank whose coordinate on that dim is src's: a Shard
 * dim scatters (each rank receives its chunk only), a Replicate dim
 * broadcasts. After step i the ranks whose coordinates equal src's on every
 * dim after i hold their right block, so only their groups take part in
 * step i; the others have nothing to send yet.
 */
static tp_status tp__distribute_from(tp_mesh *mesh, const tp_tensor *full, const tp_placement *p,
                                     int src_rank, tp_tensor **out)
{
    int m = tp_mesh_ndim(mesh), nd = full->ndim;
    int64_t sc[TP_MESH_MAX_DIMS], rest = src_rank;
    for (int i = m - 1; i >= 0; i--) {
        sc[i] = rest % tp_mesh_size(mesh, i);
        rest /= tp_mesh_size(mesh, i);
    }
    int64_t shape[TP_MAX_DIMS];
    memcpy(shape, full->shape, sizeof(int64_t) * (size_t)nd);
    tp_status st = TP_OK;
    tp_tensor *cur = NULL; /* this rank's block before step i, once it holds it */
    if (tp_mesh_rank(mesh) == src_rank)
        st = tp_tensor_is_contiguous(full) ? (cur = tp_tensor_retain((tp_tensor *)full), TP_OK)
                                           : tp_tensor_clone(full, &cur);
    for (int i = 0; i < m && st == TP_OK; i++) {
        bool part = true;
        for (int j = i + 1; j < m; j++)
            part = part && tp_mesh_coord(mesh, j) == sc[j];
        int64_t w = tp_mesh_size(mesh, i), c = tp_mesh_coord(mesh, i);
        int k = p[i].kind == TP_PLACEMENT_SHARD ? p[i].dim : -1;
        tp_tensor *next = NULL;
        if (part && k >= 0) {
            st = tp__scatter_dim(tp_mesh_comm(mesh, i), cur, shape, nd, full->dtype,
                                 tp_tensor_device(full), k, (int)sc[i], &next);
        } else if (part) {
            /* the root's buffer is only read: the caller's full may be it */
            next = cur ? tp_tensor_retain(cur) : NULL;
            if (!next)
                st = tp_tensor_empty(full->dtype, tp_tensor_device(full), nd, shape, &next);
            if (st == TP_OK)
                st = tp_broadcast(tp_mesh_comm(mesh, i), next, (int)sc[i], NULL);
        }
        tp_tensor_release(cur);
        cur = next;
        if (k >= 0) {
            int64_t start = 0, len = 0;
            tp_chunk_range(shape[k], w, c, &start, &len);
            shape[k] = len;
        }
    }
    if (st == TP_OK && cur == full) {
        /* never alias the caller's tensor: a DTensor owns its shard */
        tp_tensor *copy = NULL;
        st = tp_tensor_clone(cur, &copy);
        tp_tensor_release(cur);
        cur = copy;
    }
    if (st != TP_OK) {
        tp_tensor_release(cur);
        return st;
    }
    *out = cur;
    return TP_OK;
}

tp_status tp_dtensor_distribute(tp_mesh *mesh, const tp_tensor *full, int nplacements,
                                const tp_placement *placements, int src_rank, tp_tensor **out)
{
    const char *fn = "tp_dtensor_distribute";
    TP_ARG_CHECK(out, "%s: out is NULL", fn);
    *out = NULL;
    TP_ARG_CHECK(mesh, "%s: mesh is NULL", fn);
    TP_ARG_CHECK(full, "%s: full is NULL", fn);
    TP_CHECK(tp__need_storage(full, fn, "full"));
    tp_placement p[TP_MESH_MAX_DIMS];
    TP_CHECK(tp__placements_check(fn, mesh, full->ndim, nplacements, placements, false, p));
    TP_ARG_CHECK(src_rank < (int)tp_mesh_numel(mesh),
                 "%s: src_rank %d out of range for a mesh of %lld ranks", fn, src_rank,
                 (long long)tp_mesh_numel(mesh));
    tp_status st = TP_OK;
    tp_tensor *local = NULL;
    if (src_rank >= 0) {
        st = tp__distribute_from(mesh, full, p, src_rank, &local);
        if (st != TP_OK) {
            tp__error_prefix("%s", fn);
            return st;
        }
    } else {
        /* every rank holds the value: its own block, no communication */
        int64_t shape[TP_MAX_DIMS], off[TP_MAX_DIMS];
        tp__shard_extent(mesh, full->ndim, full->shape, p, NULL, shape, off);
        /* a copy: a DTensor owns its shard and never aliases the caller's tensor */
        st = tp__block((tp_tensor *)full, shape, off, &local);
    }
    if (st == TP_OK)
        st = tp__dtensor_wrap(mesh, local, p, full->ndim, full->shape, out);
    tp_tensor_release(local);
    return st;
}

/* Differentiable identity between a DTensor and its local shard: the node of
 * from_local turns the DTensor gradient into this rank's shard. */
typedef struct {
    tp_placement src[TP_MESH_MAX_DIMS];
    int mesh_ndim;
} tp__from_local_saved;

static tp_status tp__from_local_bwd(tp__node *node, tp_tensor *g, tp_tensor **gin)
{
    tp__from_local_saved *sv = node->saved;
    tp_placement want[TP_MESH_MAX_DIMS];
    tp__dist *d = tp__dist_of(g);
    for (int i = 0; i < d->mesh_ndim; i++)
        want[i] = sv->src[i].kind == TP_PLACEMENT_PARTIAL ? tp_replicate() : sv->src[i];
    tp_tensor *r = NULL;
    TP_CHECK(tp__redistribute(g, want, false, &r));
    gin[0] = tp_tensor_retain(tp_dtensor_local(r));
    tp_tensor_release(r);
    return TP_OK;
}

/* The DTensor gradient passes when it already has the placements the
 * backward asks for: the local shard is handed on as it is. */
static bool tp__from_local_passes(const tp__node *node, const tp_placement *in, tp_placement *out,
                                  tp_mesh **mesh, bool *plain)
{
    const tp__from_local_saved *sv = node->saved;
    (void)out;
    (void)mesh;
    if (!in || !sv)
        return false;
    for (int i = 0; i < sv->mesh_ndim; i++) {
        tp_placement want = sv->src[i].kind == TP_PLACEMENT_PARTIAL ? tp_replicate() : sv->src[i];
        if (!tp__placement_eq(in[i], want))
            return false;
    }
    *plain = true;
    return true;
}

tp_status tp_dtensor_from_local(tp_mesh *mesh, tp_tensor *local, int nplacements,
                                const tp_placement *placements,
                                const tp_from_local_options *options, tp_tensor **out)
{
    const char *fn = "tp_dtensor_from_local";
    TP_ARG_CHECK(out, "%s: out is NULL", fn);
    *out = NULL;
    TP_ARG_CHECK(mesh, "%s: mesh is NULL", fn);
    TP_ARG_CHECK(local, "%s: local is NULL", fn);
    TP_CHECK(tp__need_storage(local, fn, "local"));
    tp_placement p[TP_MESH_MAX_DIMS];
    TP_CHECK(tp__placements_check(fn, mesh, local->ndim, nplacements, placements, true, p));
    int nd = local->ndim, m = tp_mesh_ndim(mesh);
    int64_t global[TP_MAX_DIMS];
    if (options && options->global_shape) {
        int64_t want[TP_MAX_DIMS];
        for (int d = 0; d < nd; d++)
            TP_ARG_CHECK(options->global_shape[d] >= 0, "%s: global size %lld of dim %d", fn,
                         (long long)options->global_shape[d], d);
        tp__shard_extent(mesh, nd, options->global_shape, p, NULL, want, NULL);
        for (int d = 0; d < nd; d++)
            if (want[d] != local->shape[d]) {
                char b1[96], b2[96], b3[96];
                return tp__error(TP_ERR_INVALID_ARG,
                                 "%s: local shape %s is not this rank's shard %s of global %s", fn,
                                 tp__shape_str(nd, local->shape, b1, sizeof b1),
                                 tp__shape_str(nd, want, b2, sizeof b2),
                                 tp__shape_str(nd, options->global_shape, b3, sizeof b3));
            }
        memcpy(global, options->global_shape, sizeof(int64_t) * (size_t)nd);
    } else {
        memcpy(global, local->shape, sizeof(int64_t) * (size_t)nd);
        for (int i = 0; i < m; i++)
            if (p[i].kind == TP_PLACEMENT_SHARD)
                global[p[i].dim] *= tp_mesh_size(mesh, i);
    }
    /* meta (a plan): no values to compare, so no check and no collectives */
    if (options && options->check && !tp_tensor_is_meta(local)) {
        /* every rank's global shape and the replicated values must agree */
        int64_t n = nd + 1;
        tp_tensor *mine = NULL, *mx = NULL;
        tp_status st = tp_tensor_empty(TP_I64, TP_CPU, 1, &n, &mine);
        if (st == TP_OK)
            st = tp_tensor_empty(TP_I64, TP_CPU, 1, &n, &mx);
        if (st == TP_OK) {
            int64_t *v = tp_tensor_data(mine);
            for (int d = 0; d < nd; d++)
                v[d] = global[d];
            v[nd] = local->dtype;
            st = tp_all_reduce(tp_mesh_group(mesh), mine, mx, TP_MAX, NULL);
            if (st == TP_OK && memcmp(tp_tensor_data(mine), tp_tensor_data(mx),
                                      sizeof(int64_t) * (size_t)n) != 0)
                st = tp__error(TP_ERR_MISMATCH, "%s: ranks disagree on the global shape or dtype",
                               fn);
        }
        tp_tensor_release(mine);
        tp_tensor_release(mx);
        for (int i = 0; i < m && st == TP_OK; i++) {
            if (p[i].kind != TP_PLACEMENT_REPLICATE || tp_mesh_size(mesh, i) == 1)
                continue;
            tp_tensor *lo = NULL, *hi = NULL;
            st = tp_tensor_clone(local, &lo);
            if (st == TP_OK)
                st = tp_tensor_clone(local, &hi);
            if (st == TP_OK)
                st = tp_all_reduce(tp_mesh_comm(mesh, i), lo, lo, TP_MIN, NULL);
            if (st == TP_OK)
                st = tp_all_reduce(tp_mesh_comm(mesh, i), hi, hi, TP_MAX, NULL);
            bool eq = false;
            if (st == TP_OK)
                st = tp_tensor_equal(lo, hi, &eq);
            if (st == TP_OK && !eq)
                st = tp__error(TP_ERR_MISMATCH,
                               "%s: mesh dim %d is Replicate but the ranks hold different values",
                               fn, i);
            tp_tensor_release(lo);
            tp_tensor_release(hi);
        }
        if (st != TP_OK)
            return st;
    }
    tp_tensor *dt = NULL;
    TP_CHECK(tp__dtensor_wrap(mesh, local, p, nd, global, &dt));
    if (tp__needs_grad(1, &local)) {
        tp__node *node = NULL;
        tp_status st = tp__node_attach(dt, "from_local", tp__from_local_bwd, 1, &local, &node);
        tp__from_local_saved *sv = st == TP_OK ? tp__malloc(sizeof *sv) : NULL;
        if (st == TP_OK && !sv)
            st = tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
        if (st != TP_OK) {
            tp_tensor_release(dt);
            return st;
        }
        memcpy(sv->src, p, sizeof sv->src);
        sv->mesh_ndim = m;
        node->saved = sv;
        node->free_saved = tp__node_free_saved;
        node->grad_passes = tp__from_local_passes;
    }
    *out = dt;
    return TP_OK;
}

typedef struct {
    tp_mesh *mesh;
    int ndim;
    int64_t global[TP_MAX_DIMS];
    tp_placement grad[TP_MESH_MAX_DIMS];
} tp__to_local_saved;

static tp_status tp__to_local_bwd(tp__node *node, tp_tensor *g, tp_tensor **gin)
{
    tp__to_local_saved *sv = node->saved;
    return tp__dtensor_wrap(sv->mesh, g, sv->grad, sv->ndim, sv->global, &gin[0]);
}

/* A plain gradient is wrapped as it is, with the grad placements. */
static bool tp__to_local_passes(const tp__node *node, const tp_placement *in, tp_placement *out,
                                tp_mesh **mesh, bool *plain)
{
    const tp__to_local_saved *sv = node->saved;
    if (in || !sv)
        return false;
    memcpy(out, sv->grad, sizeof sv->grad);
    *mesh = sv->mesh;
    *plain = false;
    return true;
}

tp_status tp_dtensor_to_local(tp_tensor *dt, int ngrad, const tp_placement *grad_placements,
                              tp_tensor **out)
{
    const char *fn = "tp_dtensor_to_local";
    TP_ARG_CHECK(out, "%s: out is NULL", fn);
    *out = NULL;
    TP_ARG_CHECK(dt, "%s: dt is NULL", fn);
    TP_ARG_CHECK(tp__dist_of(dt), "%s: dt is not a DTensor", fn);
    tp__dist *d = tp__dist_of(dt);
    tp_placement gp[TP_MESH_MAX_DIMS];
    if (grad_placements)
        TP_CHECK(tp__placements_check(fn, d->mesh, dt->ndim, ngrad, grad_placements, true, gp));
    else
        memcpy(gp, d->placements, sizeof gp);
    tp_tensor *a = NULL;
    TP_CHECK(tp__tensor_alias(d->local, &a));
    if (tp__needs_grad(1, &dt)) {
        tp__node *node = NULL;
        tp_status st = tp__node_attach(a, "to_local", tp__to_local_bwd, 1, &dt, &node);
        tp__to_local_saved *sv = st == TP_OK ? tp__malloc(sizeof *sv) : NULL;
        if (st == TP_OK && !sv)
            st = tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
        if (st != TP_OK) {
            tp_tensor_release(a);
            return st;
        }
        sv->mesh = d->mesh;
        sv->ndim = dt->ndim;
        memcpy(sv->global, dt->shape, sizeof sv->global);
        memcpy(sv->grad, gp, sizeof sv->grad);
        node->saved = sv;
        node->free_saved = tp__node_free_saved;
        node->grad_passes = tp__to_local_passes;
    }
    *out = a;
    return TP_OK;
}

tp_status tp_dtensor_full_tensor(tp_tensor *dt, tp_tensor **out)
{
    const char *fn = "tp_dtensor_full_tensor";
    TP_ARG_CHECK(out, "%s: out is NULL", fn);
    *out = NULL;
    TP_ARG_CHECK(dt, "%s: dt is NULL", fn);
    TP_ARG_CHECK(tp__dist_of(dt), "%s: dt is not a DTensor", fn);
    tp_placement rep[TP_MESH_MAX_DIMS];
    for (int i = 0; i < TP_MESH_MAX_DIMS; i++)
        rep[i] = tp_replicate();
    tp_tensor *r = NULL;
    tp_status st = tp__redistribute(dt, rep, true, &r);
    if (st != TP_OK) {
        tp__error_prefix("%s", fn);
        return st;
    }
    st = tp_dtensor_to_local(r, tp__dist_of(dt)->mesh_ndim, rep, out);
    tp_tensor_release(r);
    return st;
}
