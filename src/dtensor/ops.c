/* The op dispatcher (see ops_internal.h). */
#include <stdio.h>
#include <string.h>

#include "core/meta_mem.h"
#include "dtensor/debug_log.h"
#include "dtensor/ops_internal.h"

tp_status tp__new(tp_dtype dt, tp_device dev, int ndim, const int64_t *shape, bool zero,
                  tp_tensor **out)
{
    TP_CHECK(tp_tensor_empty(dt, dev, ndim, shape, out));
    if (!zero)
        return TP_OK;
    /* zeroed by the device's engine: on a GPU in order with the kernels that
     * use it, on this thread's stream, rather than by a memset and a
     * device-wide wait */
    const tp__kernels *k = NULL;
    tp_status st = tp__kernels_for(dev, &k);
    if (st == TP_OK)
        st = k->fill(dev, dt, tp_tensor_data(*out), 0.0f, tp_tensor_numel(*out));
    if (st != TP_OK) {
        tp_tensor_release(*out);
        *out = NULL;
    }
    return st;
}

tp_status tp__f32(tp_device dev, int ndim, const int64_t *shape, bool zero, tp_tensor **out)
{
    return tp__new(TP_F32, dev, ndim, shape, zero, out);
}

tp_status tp__op_copy(tp_device dev, tp_dtype dt, void *dst, const void *src, int64_t n)
{
    const tp__kernels *k = NULL;
    TP_CHECK(tp__kernels_for(dev, &k));
    return k->copy(dev, dt, dst, src, n);
}

const char *tp__device_str(tp_device dev, char *buf, size_t len)
{
    if (dev.type == TP_DEVICE_CPU)
        snprintf(buf, len, "cpu");
    else
        snprintf(buf, len, "cuda:%d", dev.index);
    return buf;
}

tp_status tp__same_device(const char *fn, const char *an, const tp_tensor *a, const char *bn,
                          const tp_tensor *b)
{
    if (!a || !b)
        return TP_OK;
    tp_device da = tp_tensor_device(a), db = tp_tensor_device(b);
    if (tp__device_eq(da, db))
        return TP_OK;
    char b1[32], b2[32];
    return tp__error(TP_ERR_INVALID_ARG, "%s: %s is on %s but %s is on %s", fn, an,
                     tp__device_str(da, b1, sizeof b1), bn, tp__device_str(db, b2, sizeof b2));
}

int64_t tp__rows(const tp_tensor *t)
{
    int64_t r = 1;
    for (int i = 0; i + 1 < t->ndim; i++)
        r *= t->shape[i];
    return r;
}

/* TP_ERR_NOT_SUPPORTED: what of dtype dt is not taken by engine k. */
static tp_status tp__dtype_refused(const char *fn, const char *what, tp_dtype dt,
                                   const tp__kernels *k)
{
    return tp__error(TP_ERR_NOT_SUPPORTED,
                     "%s: %s is %s, which the %s kernels do not take (ops take f32, bf16 and f16)",
                     fn, what, tp_dtype_name(dt), k->name);
}

tp_status tp__check_dtypes(tp__op *op)
{
    const tp__op_def *def = op->def;
    const tp__kop kop = def->dtype_kernel != TP__KOP_NONE ? def->dtype_kernel : TP__KOP_COPY;
    int first = -1;
    op->dt = TP_F32;
    for (int i = 0; i < def->n_inputs; i++) {
        const tp_tensor *t = op->arg[i];
        if (!t || (def->nondiff_mask & (1u << i)))
            continue;
        if (first < 0) {
            first = i;
            op->dt = t->dtype;
        } else if (t->dtype != op->dt) {
            return tp__error(TP_ERR_INVALID_ARG, "%s: %s is %s but %s is %s; the dtypes must match",
                             def->name, def->input_names[first], tp_dtype_name(op->dt),
                             def->input_names[i], tp_dtype_name(t->dtype));
        }
    }
    if (first >= 0 && !op->k->supports(kop, op->dt))
        return tp__dtype_refused(def->name, def->input_names[first], op->dt, op->k);
    return TP_OK;
}

tp_status tp__op_check_dtype(const char *fn, const char *what, const tp_tensor *t, tp__kop kop)
{
    const tp__kernels *k = NULL;
    TP_CHECK(tp__kernels_for(tp_tensor_device(t), &k));
    if (!k->supports(kop, t->dtype))
        return tp__dtype_refused(fn, what, t->dtype, k);
    return TP_OK;
}

bool tp__op_partial_leader(const tp__op *op)
{
    if (!op->distributed)
        return true;
    for (int d = 0; d < op->mesh_ndim; d++)
        if (op->out_pl[d].kind == TP_PLACEMENT_PARTIAL && tp_mesh_coord(op->mesh, d) != 0)
            return false;
    return true;
}

void tp__op_offset(const tp__op *op, int i, int64_t *offset)
{
    int nd = op->arg_ndim[i];
    if (!op->distributed) {
        for (int d = 0; d < nd; d++)
            offset[d] = 0;
        return;
    }
    int64_t shape[TP_MAX_DIMS];
    tp__shard_extent(op->mesh, nd, op->arg_shape[i], op->in_pl[i], NULL, shape, offset);
}

/* Bytes the redistribution of one input on one mesh dim moves (per the
 * nccl-tests size of the collective it needs); -1 when impossible. */
static double tp__cost(tp_placement from, tp_placement to, double bytes, int64_t w)
{
    if (tp__placement_eq(from, to) || w == 1)
        return 0;
    double f = (double)(w - 1) / (double)w;
    switch (from.kind) {
    case TP_PLACEMENT_REPLICATE:
        if (to.kind == TP_PLACEMENT_PARTIAL && to.op != TP_SUM && to.op != TP_AVG &&
            to.op != TP_MAX && to.op != TP_MIN)
            return -1;
        return 0; /* local chunk or local partial */
    case TP_PLACEMENT_SHARD:
        if (to.kind == TP_PLACEMENT_PARTIAL)
            return -1;
        return bytes * f; /* all_gather or all_to_all */
    case TP_PLACEMENT_PARTIAL:
        if (to.kind == TP_PLACEMENT_PARTIAL)
            return -1;
        return to.kind == TP_PLACEMENT_REPLICATE ? 2 * bytes * f : bytes * f;
    }
    return -1;
}

static tp_status tp__choose(tp__op *op)
{
    const tp__op_def *def = op->def;
    int n = def->n_inputs;
    for (int d = 0; d < op->mesh_ndim; d++) {
        tp__strategy s[TP__OP_MAX_STRATS];
        int ns = def->strategies ? def->strategies(op, d, s) : 0;
        int64_t w = tp_mesh_size(op->mesh, d);
        int best = -1;
        double best_cost = 0;
        for (int k = 0; k < ns; k++) {
            /* bytes moved, plus a little per change (more for larger inputs) so
             * that an exact match wins over an equally cheap local re-chunking,
             * and a tie keeps the larger input where it is */
            double cost = 0;
            bool ok = true;
            for (int i = 0; i < n && ok; i++) {
                if (!op->arg[i])
                    continue;
                const tp_placement cur = tp_dtensor_placements(op->arg[i])[d];
                double bytes = (double)tp_tensor_numel(op->arg[i]) *
                               (double)tp_dtype_size(op->arg[i]->dtype);
                double c = tp__cost(cur, s[k].in[i], bytes, w);
                ok = c >= 0;
                cost += c + (tp__placement_eq(cur, s[k].in[i]) ? 0.0 : 1e-3 + 1e-12 * bytes);
            }
            if (ok && (best < 0 || cost < best_cost)) {
                best = k;
                best_cost = cost;
            }
        }
        if (best < 0) {
            char buf[512];
            int used = snprintf(buf, sizeof buf, "%s: no sharding strategy on mesh dim %d for",
                                def->name, d);
            for (int i = 0; i < n && used > 0 && (size_t)used < sizeof buf; i++) {
                if (!op->arg[i])
                    continue;
                char ps[128];
                used += snprintf(buf + used, sizeof buf - (size_t)used, " %s %s",
                                 def->input_names[i],
                                 tp_placements_str(op->mesh_ndim, tp_dtensor_placements(op->arg[i]),
                                                   ps, sizeof ps));
            }
            return tp__error(TP_ERR_NOT_SUPPORTED, "%s", buf);
        }
        for (int i = 0; i < n; i++) {
            op->in_pl[i][d] = s[best].in[i];
            op->grad_pl[i][d] = s[best].grad[i];
        }
        op->out_pl[d] = s[best].out;
    }
    return TP_OK;
}

static void tp__op_free(tp__node *node)
{
    tp__op *op = node->saved;
    if (!op)
        return;
    for (int i = 0; i < TP__OP_MAX_IN; i++)
        tp_tensor_release(op->in[i]);
    for (int i = 0; i < TP__OP_MAX_SAVED; i++)
        tp_tensor_release(op->saved[i]);
    tp__free(op);
}

static tp_tensor *tp__local(tp_tensor *t) { return t ? tp__tensor_local(t) : t; }

static tp_status tp__op_backward(tp__node *node, tp_tensor *gy, tp_tensor **gin)
{
    tp__op *op = node->saved;
    const tp__op_def *def = op->def;
    tp_tensor *gyr = NULL, *locals[TP__OP_MAX_IN] = {0}, *g[TP__OP_MAX_IN] = {0};
    tp_status st = TP_OK;
    if (op->distributed) {
        if (TP_LOG_ON(TP_LOG_INFO))
            tp__log_op(op, node, gy);
        tp_placement want[TP_MESH_MAX_DIMS];
        for (int d = 0; d < op->mesh_ndim; d++)
            want[d] = op->out_pl[d].kind == TP_PLACEMENT_PARTIAL ? tp_replicate() : op->out_pl[d];
        TP_CHECK(tp__redistribute(gy, want, false, &gyr));
    } else {
        gyr = tp_tensor_retain(gy);
    }
    tp_tensor *gyl = tp__local(gyr), *gyc = NULL;
    tp_device gd = tp_tensor_device(gyl);
    if (!tp__device_eq(gd, op->dev) || gyl->dtype != op->dt) {
        /* a gradient handed to tp_backward from another device (or, defensively,
         * in another dtype than the op's) */
        st = tp_tensor_to(gyl, op->dt, op->dev, &gyc);
        gyl = gyc;
    } else if (!tp_tensor_is_contiguous(gyl)) {
        st = tp_tensor_clone(gyl, &gyc);
        gyl = gyc;
    }
    for (int i = 0; i < def->n_inputs; i++) {
        locals[i] = tp__local(op->in[i]);
        op->need_grad[i] = node->inputs[i] != NULL;
    }
    if (st == TP_OK)
        st = def->backward(op, locals, gyl, g);
    for (int i = 0; i < def->n_inputs && st == TP_OK; i++) {
        if (!g[i] || !node->inputs[i])
            continue;
        if (op->distributed) {
            tp_tensor *w = NULL;
            st = tp__dtensor_wrap(op->mesh, g[i], op->grad_pl[i], op->arg_ndim[i],
                                  op->arg_shape[i], &w);
            gin[i] = w;
        } else {
            gin[i] = tp_tensor_retain(g[i]);
        }
    }
    for (int i = 0; i < TP__OP_MAX_IN; i++)
        tp_tensor_release(g[i]);
    tp_tensor_release(gyc);
    tp_tensor_release(gyr);
    return st;
}

tp__node *tp__op_gelu_source(const tp__op *op, int i)
{
    tp_tensor *t = op->in[i];
    bool plain = !op->distributed;
    tp_placement pl[TP_MESH_MAX_DIMS];
    tp_mesh *mesh = op->mesh;
    memcpy(pl, op->grad_pl[i], sizeof pl);
    for (int hop = 0; t && hop < 8; hop++) {
        tp__autograd *ag = tp__ag_of(t);
        tp__node *p = ag ? ag->grad_fn : NULL;
        /* p must expect this gradient alone: none delivered, none to come */
        if (!p || p->released || p->pending != 1 || p->grad_acc)
            return NULL;
        if (p->backward == tp__op_backward) {
            const tp__op *q = p->saved;
            if (!q || !q->def->gelu_output || !q->saved[0] || !tp__device_eq(q->dev, op->dev) ||
                q->dt != op->dt || q->distributed == plain)
                return NULL;
            if (q->distributed) {
                if (q->mesh != mesh)
                    return NULL;
                /* its backward would redistribute any other layout */
                for (int d = 0; d < q->mesh_ndim; d++) {
                    tp_placement want = q->out_pl[d].kind == TP_PLACEMENT_PARTIAL
                                            ? tp_replicate()
                                            : q->out_pl[d];
                    if (!tp__placement_eq(pl[d], want))
                        return NULL;
                }
            }
            return p;
        }
        tp_placement next[TP_MESH_MAX_DIMS];
        bool next_plain = false;
        tp_mesh *next_mesh = mesh;
        if (!p->grad_passes || !p->grad_passes(p, plain ? NULL : pl, next, &next_mesh, &next_plain))
            return NULL;
        t = p->n_inputs > 0 ? p->inputs[0] : NULL;
        plain = next_plain;
        mesh = next_mesh;
        if (!plain)
            memcpy(pl, next, sizeof pl);
    }
    return NULL;
}

tp_status tp__op_run(const tp__op_def *def, tp_tensor *const *args, const void *params,
                     size_t plen, tp_tensor **out)
{
    const char *fn = def->name;
    TP_ARG_CHECK(out, "%s: out is NULL", fn);
    *out = NULL;
    tp__op op;
    memset(&op, 0, sizeof op);
    op.def = def;
    TP_ASSERT(plen <= sizeof op.params);
    if (plen)
        memcpy(op.params, params, plen);
    int first = -1;
    for (int i = 0; i < def->n_inputs; i++) {
        op.arg[i] = args[i];
        if (!args[i]) {
            TP_ARG_CHECK(def->optional_mask & (1u << i), "%s: %s is NULL", fn,
                         def->input_names[i]);
            continue;
        }
        if (first < 0) {
            first = i;
            op.distributed = tp__dist_of(args[i]) != NULL;
            op.mesh = tp_dtensor_mesh(args[i]);
            continue;
        }
        if ((tp__dist_of(args[i]) != NULL) != op.distributed)
            return tp__error(TP_ERR_INVALID_ARG, "%s: %s is %s but %s is %s", fn,
                             def->input_names[first],
                             op.distributed ? "a DTensor" : "a plain tensor", def->input_names[i],
                             tp__dist_of(args[i]) ? "a DTensor" : "a plain tensor");
        if (op.distributed && tp_dtensor_mesh(args[i]) != op.mesh)
            return tp__error(TP_ERR_INVALID_ARG, "%s: %s and %s are on different meshes", fn,
                             def->input_names[first], def->input_names[i]);
        TP_CHECK(tp__same_device(fn, def->input_names[first], args[first], def->input_names[i],
                                 args[i]));
    }
    if (first >= 0)
        op.dev = tp_tensor_device(args[first]);
    TP_CHECK(tp__kernels_for(op.dev, &op.k));
    TP_CHECK(tp__check_dtypes(&op));
    for (int i = 0; i < def->n_inputs; i++) {
        if (!args[i])
            continue;
        op.arg_ndim[i] = args[i]->ndim;
        memcpy(op.arg_shape[i], args[i]->shape, sizeof op.arg_shape[i]);
    }
    tp_status st = TP_OK;
    if (op.distributed) {
        op.mesh_ndim = tp_mesh_ndim(op.mesh);
        TP_CHECK(tp__choose(&op));
        if (TP_LOG_ON(TP_LOG_INFO))
            tp__log_op(&op, NULL, NULL);
        for (int i = 0; i < def->n_inputs && st == TP_OK; i++) {
            if (!args[i])
                continue;
            if (!memcmp(tp_dtensor_placements(args[i]), op.in_pl[i],
                        sizeof(tp_placement) * (size_t)op.mesh_ndim))
                op.in[i] = tp_tensor_retain(args[i]);
            else
                st = tp__redistribute(args[i], op.in_pl[i], true, &op.in[i]);
        }
    } else {
        for (int i = 0; i < def->n_inputs; i++)
            op.in[i] = tp_tensor_retain(args[i]);
    }
    tp_tensor *locals[TP__OP_MAX_IN] = {0}, *y = NULL, *res = NULL;
    for (int i = 0; i < def->n_inputs && st == TP_OK; i++) {
        locals[i] = tp__local(op.in[i]);
        if (locals[i] && !def->strided_ok && !tp_tensor_is_contiguous(locals[i]))
            st = tp__error(TP_ERR_INVALID_ARG, "%s: %s is not contiguous", fn,
                           def->input_names[i]);
    }
    if (st == TP_OK)
        st = def->out_shape(&op, &op.out_ndim, op.out_shape);
    if (st == TP_OK && def->recompute_keep && tp__stash_replaying()) {
        st = tp__stash_take(fn, &y, op.saved, TP__OP_MAX_SAVED); /* selective recompute */
    } else if (st == TP_OK) {
        st = def->forward(&op, locals, &y);
        if (st == TP_OK && def->recompute_keep)
            st = tp__stash_put(fn, y, op.saved, TP__OP_MAX_SAVED);
    }
    if (st == TP_OK && op.distributed)
        st = tp__dtensor_wrap(op.mesh, y, op.out_pl, op.out_ndim, op.out_shape, &res);
    else if (st == TP_OK)
        res = tp_tensor_retain(y);
    tp_tensor_release(y);
    if (st == TP_OK && tp__needs_grad(def->n_inputs, op.in)) {
        tp_tensor *diff[TP__OP_MAX_IN] = {0};
        for (int i = 0; i < def->n_inputs; i++)
            if (!(def->nondiff_mask & (1u << i)))
                diff[i] = op.in[i];
        tp__op *saved = tp__malloc(sizeof *saved);
        tp__node *node = NULL;
        st = saved ? tp__node_attach(res, fn, tp__op_backward, def->n_inputs, diff, &node)
                   : tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
        if (st == TP_OK) {
            memcpy(saved, &op, sizeof op);
            for (int i = 0; i < TP__OP_MAX_IN; i++)
                saved->arg[i] = NULL; /* borrowed for the call only */
            memset(&op, 0, sizeof op); /* the node owns the references now */
            node->saved = saved;
            node->free_saved = tp__op_free;
            /* memory accounting on meta: what the node keeps for the backward */
            for (int i = 0; i < TP__OP_MAX_IN; i++)
                tp__meta_mem_tag(saved->in[i], TP_MEM_ACTIVATIONS, NULL);
            for (int i = 0; i < TP__OP_MAX_SAVED; i++)
                tp__meta_mem_tag(saved->saved[i], TP_MEM_ACTIVATIONS, NULL);
        } else {
            tp__free(saved);
        }
    }
    for (int i = 0; i < TP__OP_MAX_IN; i++)
        tp_tensor_release(op.in[i]);
    for (int i = 0; i < TP__OP_MAX_SAVED; i++)
        tp_tensor_release(op.saved[i]);
    if (st != TP_OK) {
        tp_tensor_release(res);
        return st;
    }
    *out = res;
    return TP_OK;
}
