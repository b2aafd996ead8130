/* embedding and cross entropy.
 *
 * embedding runs through the strategy dispatcher (ops.c): its indices are
 * validated against the global table and converted to contiguous i64 first.
 *
 * cross_entropy takes logits (N, C, d1, ..., dk) or (C), class dim 1 (0 for
 * 1-D); the kernels see them as [outer, C, inner] with the classes at stride
 * inner, one row per target element. Two forms:
 *  - plain tensors and Replicate logits: a dispatcher op with one all-R
 *    strategy that computes locally (the cross_entropy_fwd/bwd kernels);
 *  - logits sharded on the class dim on one mesh dim (loss parallel), other
 *    dims possibly sharded on other mesh dims: its own path below, because
 *    its forward issues collectives. Three all_reduces on the class mesh
 *    dim's communicator (row max, sum of exp rescaled to the global max,
 *    picked target logit) over this rank's rows; the targets in the logits'
 *    placements less the class dim; a backward node of its own that issues
 *    no collective and hands back the logits' placements.
 *
 * Targets and class weights never get gradients. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "dtensor/ops_internal.h"

/* ---- shared helpers ------------------------------------------------------- */

/* An integer tensor (i64 or i32, plain, any device) as a contiguous i64 CPU
 * tensor without autograd state, for validation on the host: a view when it
 * already is one, else a converted copy. */
static tp_status tp__as_i64(tp_tensor *t, tp_tensor **out)
{
    if (t->dtype == TP_I64 && tp_tensor_is_contiguous(t) &&
        tp_tensor_device(t).type == TP_DEVICE_CPU)
        return tp_tensor_view(t, t->ndim, t->shape, out);
    if (tp_tensor_is_meta(t)) /* no values: an i64 meta tensor of its shape */
        return tp_tensor_to(t, TP_I64, TP_META, out);
    return tp_tensor_to(t, TP_I64, TP_CPU, out);
}

/* The values of tp__as_i64's result, or NULL for a meta tensor, which has
 * none: the range checks and the weight sums over them are skipped, every
 * row counting with weight 1 (docs/sim.md). */
static const int64_t *tp__i64_values(const tp_tensor *t64)
{
    return tp_tensor_is_meta(t64) ? NULL : tp_tensor_data(t64);
}

/* The validated host i64 tensor `host` as the kernels' argument on `dev`:
 * itself on the CPU; on a CUDA device the caller's original when that is a
 * contiguous i64 tensor there (no second copy), else an upload. */
static tp_status tp__i64_on(tp_tensor *host, tp_tensor *orig, tp_device dev, tp_tensor **out)
{
    if (dev.type == TP_DEVICE_CPU) {
        *out = tp_tensor_retain(host);
        return TP_OK;
    }
    tp_device od = tp_tensor_device(orig);
    if (orig->dtype == TP_I64 && tp_tensor_is_contiguous(orig) && tp__device_eq(od, dev))
        return tp_tensor_view(orig, orig->ndim, orig->shape, out);
    return tp_tensor_to(host, TP_I64, dev, out);
}

/* A plain tensor as a contiguous tensor of the same values without autograd
 * state (a view, or a copy when t is strided). */
static tp_status tp__detached(tp_tensor *t, tp_tensor **out)
{
    if (tp_tensor_is_contiguous(t))
        return tp_tensor_view(t, t->ndim, t->shape, out);
    return tp_tensor_clone(t, out);
}

static tp_tensor *tp__local_of(tp_tensor *t) { return t ? tp__tensor_local(t) : t; }

/* Both plain or both DTensors on one mesh; the message names both. */
static tp_status tp__same_kind(const char *fn, const char *an, const tp_tensor *a, const char *bn,
                               const tp_tensor *b)
{
    if (!a || !b)
        return TP_OK;
    if ((tp__dist_of(a) != NULL) != (tp__dist_of(b) != NULL))
        return tp__error(TP_ERR_INVALID_ARG, "%s: %s is %s but %s is %s", fn, an,
                         tp__dist_of(a) ? "a DTensor" : "a plain tensor", bn,
                         tp__dist_of(b) ? "a DTensor" : "a plain tensor");
    if (tp__dist_of(a) && tp_dtensor_mesh(a) != tp_dtensor_mesh(b))
        return tp__error(TP_ERR_INVALID_ARG, "%s: %s and %s are on different meshes", fn, an, bn);
    return TP_OK;
}

static tp_status tp__check_int(const char *fn, const char *what, const tp_tensor *t)
{
    if (t->dtype != TP_I64 && t->dtype != TP_I32)
        return tp__error(TP_ERR_INVALID_ARG, "%s: %s must be i64 or i32, got %s", fn, what,
                         tp_dtype_name(t->dtype));
    return TP_OK;
}

static tp_status tp__no_partial(const char *fn, const char *what, const tp_tensor *t)
{
    if (!t || !tp__dist_of(t))
        return TP_OK;
    const tp_placement *p = tp_dtensor_placements(t);
    for (int d = 0; d < tp_mesh_ndim(tp_dtensor_mesh(t)); d++)
        if (p[d].kind == TP_PLACEMENT_PARTIAL) {
            char buf[128];
            return tp__error(TP_ERR_INVALID_ARG,
                             "%s: %s is Partial on mesh dim %d (placements %s); integer %s must "
                             "be Shard or Replicate",
                             fn, what, d,
                             tp_placements_str(tp_mesh_ndim(tp_dtensor_mesh(t)), p, buf,
                                               sizeof buf),
                             what);
        }
    return TP_OK;
}

/* "[1, 2]" for the multi-index of element k of a contiguous local block
 * (shape) placed at `offset` in the global tensor. */
static const char *tp__position(int ndim, const int64_t *shape, const int64_t *offset, int64_t k,
                                char *buf, size_t len)
{
    int64_t idx[TP_MAX_DIMS];
    for (int d = ndim - 1; d >= 0; d--) {
        int64_t s = shape[d] > 0 ? shape[d] : 1;
        idx[d] = k % s + (offset ? offset[d] : 0);
        k /= s;
    }
    return tp__shape_str(ndim, idx, buf, len);
}

/* ---- embedding ------------------------------------------------------------ */

static int emb_strategies(const tp__op *op, int mesh_dim, tp__strategy *s)
{
    (void)mesh_dim;
    int nd = tp__op_gndim(op, 0), n = 0; /* indices dims; the output has nd + 1 */
    /* the table's features are split: each rank looks up its slice */
    s[n++] = (tp__strategy){{tp__R(), tp__S(1)}, tp__S(nd), {tp__R(), tp__S(1)}};
    /* the table's rows are split: a masked lookup, the ranks' rows add up */
    s[n++] = (tp__strategy){{tp__R(), tp__S(0)}, tp__P(), {tp__R(), tp__S(0)}};
    /* the indices are split, the table replicated: its gradient is a partial sum */
    for (int d = 0; d < nd; d++)
        s[n++] = (tp__strategy){{tp__S(d), tp__R()}, tp__S(d), {tp__S(d), tp__P()}};
    s[n++] = (tp__strategy){{tp__R(), tp__R()}, tp__R(), {tp__R(), tp__R()}};
    return n;
}

static tp_status emb_shape(const tp__op *op, int *ndim, int64_t *shape)
{
    int nd = tp__op_gndim(op, 0);
    memcpy(shape, tp__op_gshape(op, 0), sizeof(int64_t) * (size_t)nd);
    shape[nd] = tp__op_gshape(op, 1)[1];
    *ndim = nd + 1;
    return TP_OK;
}

static tp_status emb_fwd(tp__op *op, tp_tensor *const *in, tp_tensor **out)
{
    tp_tensor *idx = in[0], *w = in[1];
    int nd = idx->ndim;
    int64_t shape[TP_MAX_DIMS], off[TP_MAX_DIMS];
    memcpy(shape, idx->shape, sizeof(int64_t) * (size_t)nd);
    shape[nd] = w->shape[1];
    TP_CHECK(tp__new(op->dt, op->dev, nd + 1, shape, false, out));
    tp__op_offset(op, 1, off); /* the first global row this rank's table holds */
    return op->k->embedding_fwd(op->dev, op->dt, tp_tensor_data(idx), tp_tensor_numel(idx),
                                tp_tensor_data(w), w->shape[0], w->shape[1], off[0],
                                tp_tensor_data(*out));
}

static tp_status emb_bwd(tp__op *op, tp_tensor *const *in, tp_tensor *gy, tp_tensor **g)
{
    tp_tensor *idx = in[0], *w = in[1];
    if (!op->need_grad[1])
        return TP_OK;
    int64_t off[TP_MAX_DIMS];
    tp__op_offset(op, 1, off);
    TP_CHECK(tp__new(op->dt, op->dev, 2, w->shape, true, &g[1]));
    return op->k->embedding_bwd(op->dev, op->dt, tp_tensor_data(idx), tp_tensor_numel(idx),
                                tp_tensor_data(gy), w->shape[0], w->shape[1], off[0],
                                tp_tensor_data(g[1]));
}

static const tp__op_def emb_def = {
    .name = "embedding",
    .n_inputs = 2,
    .input_names = {"indices", "weight"},
    .nondiff_mask = 1u << 0,
    .dtype_kernel = TP__KOP_EMBEDDING_FWD,
    .strategies = emb_strategies,
    .out_shape = emb_shape,
    .forward = emb_fwd,
    .backward = emb_bwd,
};

tp_status tp_embedding(tp_tensor *indices, tp_tensor *weight, tp_tensor **y)
{
    const char *fn = "embedding";
    TP_ARG_CHECK(y, "%s: y is NULL", fn);
    *y = NULL;
    TP_ARG_CHECK(indices, "%s: indices is NULL", fn);
    TP_ARG_CHECK(weight, "%s: weight is NULL", fn);
    TP_CHECK(tp__same_kind(fn, "indices", indices, "weight", weight));
    TP_CHECK(tp__same_device(fn, "indices", indices, "weight", weight));
    TP_CHECK(tp__check_int(fn, "indices", indices));
    TP_ARG_CHECK(weight->ndim == 2, "%s: weight must be 2-d [num, dim], got %d dims", fn,
                 weight->ndim);
    TP_ARG_CHECK(indices->ndim < TP_MAX_DIMS,
                 "%s: indices have %d dims; the output would exceed %d dims", fn, indices->ndim,
                 TP_MAX_DIMS);
    TP_CHECK(tp__no_partial(fn, "indices", indices));

    /* every index against the global table, before any communication. Each
     * rank checks the indices it holds: with sharded indices a bad index fails
     * on the ranks holding it only (like any argument invalid on some ranks) */
    const bool dist = tp__dist_of(indices) != NULL;
    tp_tensor *local = tp__local_of(indices), *idx64 = NULL, *arg = NULL;
    TP_CHECK(tp__as_i64(local, &idx64));
    int64_t lshape[TP_MAX_DIMS], off[TP_MAX_DIMS];
    for (int d = 0; d < local->ndim; d++) {
        lshape[d] = local->shape[d];
        off[d] = 0;
    }
    if (dist)
        tp__shard_extent(tp_dtensor_mesh(indices), indices->ndim, indices->shape,
                         tp_dtensor_placements(indices), NULL, lshape, off);
    const int64_t num = weight->shape[0], n = tp_tensor_numel(idx64);
    const int64_t *v = tp__i64_values(idx64);
    for (int64_t k = 0; v && k < n; k++)
        if (v[k] < 0 || v[k] >= num) {
            char pos[128];
            tp_status st = tp__error(
                TP_ERR_INVALID_ARG,
                "%s: index %lld at position %s of indices is out of range for a table of %lld "
                "rows (valid: [0, %lld))",
                fn, (long long)v[k], tp__position(local->ndim, lshape, off, k, pos, sizeof pos),
                (long long)num, (long long)num);
            tp_tensor_release(idx64);
            return st;
        }

    tp_tensor *idxd = NULL;
    tp_status st = tp__i64_on(idx64, local, tp_tensor_device(weight), &idxd);
    tp_tensor_release(idx64);
    if (st != TP_OK)
        return st;
    if (dist)
        st = tp__dtensor_wrap(tp_dtensor_mesh(indices), idxd, tp_dtensor_placements(indices),
                              indices->ndim, indices->shape, &arg);
    else
        arg = tp_tensor_retain(idxd);
    tp_tensor_release(idxd);
    if (st != TP_OK)
        return st;
    tp_tensor *args[2] = {arg, weight};
    st = tp__op_run(&emb_def, args, NULL, 0, y);
    tp_tensor_release(arg);
    return st;
}

/* ---- cross entropy: the shared arithmetic ----------------------------------- */

typedef struct {
    tp_reduction reduction;
    int64_t ignore_index;
    double wsum; /* the weights of the counted rows, summed on the host */
} ce_params;

/* The class dim: 1, or 0 for unbatched [C] logits (as PyTorch). */
static int ce_class_dim(int ndim) { return ndim == 1 ? 0 : 1; }

/* Contiguous logits (C), (N, C) or (N, C, d1, ..., dk) as the kernels'
 * [outer, classes, inner]; a row is one (n, d1, ..., dk) position, and the
 * rows are the targets' elements in order. */
static void ce_dims(const tp_tensor *x, int64_t *outer, int64_t *classes, int64_t *inner)
{
    const int cd = ce_class_dim(x->ndim);
    int64_t in = 1;
    for (int d = cd + 1; d < x->ndim; d++)
        in *= x->shape[d];
    *outer = cd ? x->shape[0] : 1;
    *classes = x->shape[cd];
    *inner = in;
}

/* The loss tensor from the per-row losses (consumed; shaped like the
 * targets): themselves for none, else a 0-d sum, or sum / wsum for mean (NaN
 * when wsum is 0, as PyTorch), in the rows' dtype (double accumulation). */
static tp_status ce_reduce(tp_tensor *rows, tp_reduction red, double wsum, tp_tensor **out)
{
    if (red == TP_REDUCTION_NONE) {
        *out = rows;
        return TP_OK;
    }
    tp_device dev = tp_tensor_device(rows);
    const tp__kernels *k = NULL;
    tp_tensor *s = NULL;
    tp_status st = tp__kernels_for(dev, &k);
    if (st == TP_OK)
        st = tp__new(rows->dtype, dev, 0, NULL, false, &s);
    if (st == TP_OK)
        st = k->sum_all(dev, rows->dtype, tp_tensor_data(rows), tp_tensor_numel(rows),
                        tp_tensor_data(s), red == TP_REDUCTION_MEAN ? wsum : 1.0);
    if (st == TP_OK)
        *out = s;
    else
        tp_tensor_release(s);
    tp_tensor_release(rows);
    return st;
}

/* The gradient of every row's loss from the loss gradient gy (contiguous;
 * `rows` elements for none, one otherwise), in gy's dtype. */
static tp_status ce_gloss(const tp_tensor *gy, int64_t rows, tp_reduction red, double wsum,
                          tp_tensor **out)
{
    tp_device dev = tp_tensor_device(gy);
    const tp__kernels *k = NULL;
    TP_CHECK(tp__kernels_for(dev, &k));
    TP_CHECK(tp__new(gy->dtype, dev, 1, &rows, false, out));
    return k->ce_gloss(dev, gy->dtype, tp_tensor_data(gy), tp_tensor_data(*out), rows,
                       red != TP_REDUCTION_NONE, red == TP_REDUCTION_MEAN ? wsum : 1.0);
}

/* The f32 per-row losses (consumed) as the loss in dtype dt: reduced in
 * f32 (double accumulation), then rounded once to dt. A bf16/f16 loss over
 * many rows so rounds once, not once per row and again for the sum. */
static tp_status ce_finish(tp_tensor *rows, tp_reduction red, double wsum, tp_dtype dt,
                           tp_tensor **out)
{
    tp_tensor *l32 = NULL;
    TP_CHECK(ce_reduce(rows, red, wsum, &l32));
    if (dt == TP_F32) {
        *out = l32;
        return TP_OK;
    }
    tp_status st = tp_tensor_to(l32, dt, tp_tensor_device(l32), out);
    tp_tensor_release(l32);
    return st;
}

/* The class weights (NULL: none) as f32 on dev for the f32 loss entry (a
 * view when they are so already). */
static tp_status ce_weight_f32(tp_tensor *w, tp_device dev, tp_tensor **out)
{
    *out = NULL;
    if (!w)
        return TP_OK;
    if (w->dtype == TP_F32 && tp__device_eq(tp_tensor_device(w), dev))
        return tp_tensor_view(w, w->ndim, w->shape, out);
    return tp_tensor_to(w, TP_F32, dev, out);
}

/* The f32 per-row losses of contiguous logits x (any dtype, one engine
 * call per statistic, no communication: the vocab-parallel pieces with this
 * rank owning every class) into *rows (targets' shape t). */
static tp_status ce_rows_f32(tp__op *op, tp_tensor *x, tp_tensor *t, tp_tensor *w, int64_t n,
                             int64_t c, int64_t inner, int64_t ignore, tp_tensor **rows)
{
    tp_tensor *mx = NULL, *se = NULL, *pk = NULL, *wf = NULL;
    const void *xd = tp_tensor_data(x);
    const int64_t *td = tp_tensor_data(t);
    tp_status st;
    TP_CHECK_GOTO(tp__f32(op->dev, 1, &n, false, &mx), st, done);
    TP_CHECK_GOTO(tp__f32(op->dev, 1, &n, false, &se), st, done);
    TP_CHECK_GOTO(tp__f32(op->dev, 1, &n, false, &pk), st, done);
    TP_CHECK_GOTO(tp__f32(op->dev, t->ndim, t->shape, false, rows), st, done);
    TP_CHECK_GOTO(ce_weight_f32(w, op->dev, &wf), st, done);
    TP_CHECK_GOTO(op->k->row_max(op->dev, op->dt, xd, tp_tensor_data(mx), n, c, inner), st, done);
    TP_CHECK_GOTO(
        op->k->row_sumexp(op->dev, op->dt, xd, tp_tensor_data(mx), tp_tensor_data(se), n, c, inner),
        st, done);
    TP_CHECK_GOTO(
        op->k->pick_target(op->dev, op->dt, xd, td, tp_tensor_data(pk), n, c, inner, 0, ignore), st,
        done);
    st = op->k->vocab_ce_loss(op->dev, TP_F32, td, wf ? tp_tensor_data(wf) : NULL,
                              tp_tensor_data(mx), tp_tensor_data(se), tp_tensor_data(pk),
                              tp_tensor_data(*rows), n, ignore);
done:
    if (st != TP_OK) {
        tp_tensor_release(*rows);
        *rows = NULL;
    }
    tp_tensor_release(wf);
    tp_tensor_release(pk);
    tp_tensor_release(se);
    tp_tensor_release(mx);
    return st;
}

/* ---- cross entropy: local (plain or Replicate) ------------------------------ */

static int ce_strategies(const tp__op *op, int mesh_dim, tp__strategy *s)
{
    (void)op;
    (void)mesh_dim;
    s[0] = (tp__strategy){{tp__R(), tp__R(), tp__R()}, tp__R(), {tp__R(), tp__R(), tp__R()}};
    return 1;
}

/* none: the targets' shape; else 0-d */
static tp_status ce_shape(const tp__op *op, int *ndim, int64_t *shape)
{
    const ce_params *p = (const ce_params *)(const void *)op->params;
    *ndim = 0;
    if (p->reduction == TP_REDUCTION_NONE) {
        *ndim = tp__op_gndim(op, 1);
        memcpy(shape, tp__op_gshape(op, 1), sizeof(int64_t) * (size_t)*ndim);
    }
    return TP_OK;
}

static tp_status ce_fwd(tp__op *op, tp_tensor *const *in, tp_tensor **out)
{
    ce_params *p = TP__OP_PARAMS(op, ce_params);
    tp_tensor *x = in[0], *t = in[1], *w = in[2], *rows = NULL;
    int64_t outer, c, inner;
    ce_dims(x, &outer, &c, &inner);
    const int64_t n = outer * inner;
    if (op->dt != TP_F32 && p->reduction != TP_REDUCTION_NONE) {
        /* f32 rows, reduced and rounded once */
        TP_CHECK(ce_rows_f32(op, x, t, w, n, c, inner, p->ignore_index, &rows));
        return ce_finish(rows, p->reduction, p->wsum, op->dt, out);
    }
    TP_CHECK(tp__new(op->dt, op->dev, t->ndim, t->shape, false, &rows));
    tp_status st = op->k->cross_entropy_fwd(op->dev, op->dt, tp_tensor_data(x), tp_tensor_data(t),
                                            w ? tp_tensor_data(w) : NULL, tp_tensor_data(rows), n,
                                            c, inner, p->ignore_index);
    if (st != TP_OK) {
        tp_tensor_release(rows);
        return st;
    }
    return ce_reduce(rows, p->reduction, p->wsum, out);
}

static tp_status ce_bwd(tp__op *op, tp_tensor *const *in, tp_tensor *gy, tp_tensor **g)
{
    const ce_params *p = TP__OP_PARAMS(op, ce_params);
    if (!op->need_grad[0])
        return TP_OK;
    tp_tensor *x = in[0], *t = in[1], *w = in[2], *gl = NULL;
    int64_t outer, c, inner;
    ce_dims(x, &outer, &c, &inner);
    const int64_t n = outer * inner;
    TP_CHECK(ce_gloss(gy, n, p->reduction, p->wsum, &gl));
    tp_status st = tp__new(op->dt, op->dev, x->ndim, x->shape, false, &g[0]);
    if (st == TP_OK)
        st = op->k->cross_entropy_bwd(op->dev, op->dt, tp_tensor_data(x), tp_tensor_data(t),
                                      w ? tp_tensor_data(w) : NULL, tp_tensor_data(gl),
                                      tp_tensor_data(g[0]), n, c, inner, p->ignore_index);
    tp_tensor_release(gl);
    return st;
}

static const tp__op_def ce_def = {
    .name = "cross_entropy",
    .n_inputs = 3,
    .input_names = {"logits", "target", "weight"},
    .optional_mask = 1u << 2,
    .nondiff_mask = (1u << 1) | (1u << 2),
    .dtype_kernel = TP__KOP_CROSS_ENTROPY_FWD,
    .strategies = ce_strategies,
    .out_shape = ce_shape,
    .forward = ce_fwd,
    .backward = ce_bwd,
};

/* ---- cross entropy: vocab parallel ------------------------------------------ */

typedef struct {
    tp_mesh *mesh;
    int ndim;                            /* the logits' dims */
    int64_t gshape[TP_MAX_DIMS];         /* the logits' global shape */
    tp_placement pl[TP_MESH_MAX_DIMS];   /* the logits' placements */
    tp_placement gy_pl[TP_MESH_MAX_DIMS]; /* what the loss gradient is turned into */
    tp_tensor *x, *target, *weight;      /* local logits and targets, full weight */
    tp_tensor *mx, *sumexp;              /* global row max and sum of exp(x - max) */
    int64_t offset;                      /* first class this rank holds */
    int64_t ignore_index;
    tp_reduction reduction;
    double wsum;
} ce_vocab_saved;

static void ce_vocab_free(tp__node *node)
{
    ce_vocab_saved *sv = node->saved;
    if (!sv)
        return;
    tp_tensor_release(sv->x);
    tp_tensor_release(sv->target);
    tp_tensor_release(sv->weight);
    tp_tensor_release(sv->mx);
    tp_tensor_release(sv->sumexp);
    tp__free(sv);
}

/* No collective for the usual gradient (Replicate for a scalar loss, the
 * loss's own placements for none): the logits gradient is computed on the
 * local block and keeps the logits' placements. */
static tp_status ce_vocab_bwd(tp__node *node, tp_tensor *gy, tp_tensor **gin)
{
    ce_vocab_saved *sv = node->saved;
    if (!node->inputs[0])
        return TP_OK;
    tp_tensor *gyr = NULL, *gyc = NULL, *gl = NULL, *gx = NULL;
    tp_status st = TP_OK;
    if (tp__dist_of(gy))
        TP_CHECK(tp__redistribute(gy, sv->gy_pl, false, &gyr));
    else
        gyr = tp_tensor_retain(gy);
    tp_tensor *gyl = tp__local_of(gyr);
    tp_device xd = tp_tensor_device(sv->x), gd = tp_tensor_device(gyl);
    if (!tp__device_eq(gd, xd)) {
        st = tp_tensor_to(gyl, gyl->dtype, xd, &gyc);
        gyl = gyc;
    } else if (!tp_tensor_is_contiguous(gyl)) {
        st = tp_tensor_clone(gyl, &gyc);
        gyl = gyc;
    }
    int64_t outer, cols, inner;
    ce_dims(sv->x, &outer, &cols, &inner);
    const int64_t rows = outer * inner;
    if (st == TP_OK)
        st = ce_gloss(gyl, rows, sv->reduction, sv->wsum, &gl);
    if (st == TP_OK)
        st = tp__new(sv->x->dtype, xd, sv->x->ndim, sv->x->shape, false, &gx);
    const tp__kernels *k = NULL;
    if (st == TP_OK)
        st = tp__kernels_for(xd, &k);
    if (st == TP_OK)
        st = k->vocab_ce_bwd(xd, sv->x->dtype, tp_tensor_data(sv->x), tp_tensor_data(sv->target),
                             sv->weight ? tp_tensor_data(sv->weight) : NULL, tp_tensor_data(sv->mx),
                             tp_tensor_data(sv->sumexp), tp_tensor_data(gl), tp_tensor_data(gx),
                             rows, cols, inner, sv->offset, sv->ignore_index);
    if (st == TP_OK)
        st = tp__dtensor_wrap(sv->mesh, gx, sv->pl, sv->ndim, sv->gshape, &gin[0]);
    tp_tensor_release(gx);
    tp_tensor_release(gl);
    tp_tensor_release(gyc);
    tp_tensor_release(gyr);
    return st;
}

/* Records ce_vocab's backward on res: what it saves of the forward (the
 * local logits x, the device targets, the weights, the row maxima and sums of
 * exponentials), offset the first class of this rank's shard, gy_pl the
 * placements the loss's gradient is brought to. */
static tp_status ce_vocab_record(tp_tensor *res, tp_tensor *logits, tp_tensor *x,
                                 tp_tensor *tdev, tp_tensor *weight, tp_tensor *mx,
                                 tp_tensor *se, const ce_params *p, int64_t offset, double wsum,
                                 const tp_placement *gy_pl)
{
    const char *fn = "cross_entropy";
    tp_mesh *mesh = tp_dtensor_mesh(logits);
    const int m = tp_mesh_ndim(mesh), nd = logits->ndim;
    ce_vocab_saved *sv = tp__calloc(1, sizeof *sv);
    tp__node *node = NULL;
    tp_status st = sv ? tp__node_attach(res, fn, ce_vocab_bwd, 1, &logits, &node)
                      : tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
    if (st != TP_OK) {
        tp__free(sv);
        return st;
    }
    sv->mesh = mesh;
    sv->ndim = nd;
    memcpy(sv->gshape, logits->shape, sizeof(int64_t) * (size_t)nd);
    memcpy(sv->pl, tp_dtensor_placements(logits), sizeof(tp_placement) * (size_t)m);
    memcpy(sv->gy_pl, gy_pl, sizeof(tp_placement) * (size_t)m);
    sv->x = tp_tensor_retain(x);
    sv->target = tp_tensor_retain(tdev);
    sv->weight = tp_tensor_retain(weight);
    sv->mx = tp_tensor_retain(mx);
    sv->sumexp = tp_tensor_retain(se);
    sv->offset = offset;
    sv->ignore_index = p->ignore_index;
    sv->reduction = p->reduction;
    sv->wsum = wsum;
    node->saved = sv;
    node->free_saved = ce_vocab_free;
    return TP_OK;
}

/* logits: a DTensor sharded on the class dim by mesh dim cdim only, Shard on
 * other dims or Replicate on the other mesh dims (no Partial); target: the
 * targets' DTensor in tpl (the logits' placements less the class dim), with
 * t64 its local block as contiguous host i64 (validated); weight: the full
 * class weights (contiguous, the logits' dtype, on the logits' device) or
 * NULL. */
static tp_status ce_vocab(tp_tensor *logits, int cdim, tp_tensor *target, tp_tensor *t64,
                          tp_tensor *weight, const ce_params *p, tp_tensor **out)
{
    tp_mesh *mesh = tp_dtensor_mesh(logits);
    tp_comm *comm = tp_mesh_comm(mesh, cdim);
    const int m = tp_mesh_ndim(mesh), nd = logits->ndim, cd = ce_class_dim(nd);
    const tp_placement *lpl = tp_dtensor_placements(logits), *tpl = tp_dtensor_placements(target);
    const bool multi = tp_comm_size(comm) > 1;
    tp_tensor *x = NULL, *mx = NULL, *se = NULL, *pk = NULL, *rows = NULL, *lossl = NULL,
              *res = NULL, *tdev = NULL, *whost = NULL, *wf = NULL;
    tp_status st = tp__detached(tp_dtensor_local(logits), &x);
    if (st != TP_OK)
        return st;
    const tp_device dev = tp_tensor_device(x);
    const bool cuda = dev.type == TP_DEVICE_CUDA;
    int64_t outer, cols, inner;
    ce_dims(x, &outer, &cols, &inner);
    const int64_t n = outer * inner;
    int64_t lshape[TP_MAX_DIMS], off[TP_MAX_DIMS];
    tp__shard_extent(mesh, nd, logits->shape, lpl, NULL, lshape, off);

    /* the loss's placements: none keeps the targets' (Shard on the other
     * sharded dims, Replicate on the class mesh dim); a scalar is Replicate
     * on the class mesh dim and a partial sum on the mesh dims that shard
     * other dims (as PyTorch's loss_parallel) */
    tp_placement out_pl[TP_MESH_MAX_DIMS], rep[TP_MESH_MAX_DIMS];
    for (int d = 0; d < m; d++) {
        rep[d] = tp_replicate();
        if (p->reduction == TP_REDUCTION_NONE)
            out_pl[d] = tpl[d];
        else
            out_pl[d] = d != cdim && lpl[d].kind == TP_PLACEMENT_SHARD ? tp_partial(TP_SUM)
                                                                      : tp_replicate();
    }

    /* every allocation before the first collective: a rank failing between
     * them would leave its peers waiting */
    TP_CHECK_GOTO(tp__f32(dev, 1, &n, false, &mx), st, done);
    TP_CHECK_GOTO(tp__f32(dev, 1, &n, false, &se), st, done);
    TP_CHECK_GOTO(tp__f32(dev, 1, &n, false, &pk), st, done);
    TP_CHECK_GOTO(tp__f32(dev, t64->ndim, t64->shape, false, &rows), st, done);
    /* on a GPU the kernels read a device copy of the targets, the weight sum
     * reads a host copy of the weights */
    if (cuda)
        TP_CHECK_GOTO(tp_tensor_to(t64, TP_I64, dev, &tdev), st, done);
    else
        tdev = tp_tensor_retain(t64);
    const int64_t *t = tp__i64_values(t64);
    if (t)
        TP_CHECK_GOTO(ce_weight_f32(weight, TP_CPU, &whost), st, done);
    /* the per-row losses are f32 (rounded to the logits' dtype once, after
     * the reduction), so the loss entry runs in f32 with f32 weights */
    TP_CHECK_GOTO(ce_weight_f32(weight, dev, &wf), st, done);

    const tp__kernels *k = NULL;
    TP_CHECK_GOTO(tp__kernels_for(dev, &k), st, done);
    const void *xd = tp_tensor_data(x);
    const int64_t *td = tp_tensor_data(tdev);
    TP_CHECK_GOTO(k->row_max(dev, x->dtype, xd, tp_tensor_data(mx), n, cols, inner), st, done);
    if (multi)
        TP_CHECK_GOTO(tp_all_reduce(comm, mx, mx, TP_MAX, NULL), st, done);
    TP_CHECK_GOTO(
        k->row_sumexp(dev, x->dtype, xd, tp_tensor_data(mx), tp_tensor_data(se), n, cols, inner),
        st, done);
    if (multi)
        TP_CHECK_GOTO(tp_all_reduce(comm, se, se, TP_SUM, NULL), st, done);
    TP_CHECK_GOTO(k->pick_target(dev, x->dtype, xd, td, tp_tensor_data(pk), n, cols, inner, off[cd],
                                 p->ignore_index),
                  st, done);
    if (multi)
        TP_CHECK_GOTO(tp_all_reduce(comm, pk, pk, TP_SUM, NULL), st, done);

    /* loss[r] = w_t (log(sumexp) + max - x_t), 0 for ignored rows; the weight
     * sum is over this rank's rows, all of them when mean is allowed */
    const float *w = whost ? tp_tensor_data(whost) : NULL;
    double wsum = t ? 0 : (double)n;
    for (int64_t r = 0; t && r < n; r++)
        if (t[r] != p->ignore_index)
            wsum += w ? (double)w[t[r]] : 1.0;
    TP_CHECK_GOTO(k->vocab_ce_loss(dev, TP_F32, td, wf ? tp_tensor_data(wf) : NULL,
                                   tp_tensor_data(mx), tp_tensor_data(se), tp_tensor_data(pk),
                                   tp_tensor_data(rows), n, p->ignore_index),
                  st, done);
    st = ce_finish(rows, p->reduction, wsum, x->dtype, &lossl);
    rows = NULL; /* consumed */
    if (st != TP_OK)
        goto done;
    if (p->reduction == TP_REDUCTION_NONE)
        st = tp__dtensor_wrap(mesh, lossl, out_pl, target->ndim, target->shape, &res);
    else
        st = tp__dtensor_wrap(mesh, lossl, out_pl, 0, NULL, &res);
    if (st != TP_OK)
        goto done;

    if (tp__needs_grad(1, &logits))
        TP_CHECK_GOTO(ce_vocab_record(res, logits, x, tdev, weight, mx, se, p, off[cd], wsum,
                                      p->reduction == TP_REDUCTION_NONE ? tpl : rep),
                      st, done);
    *out = res;
    res = NULL;
done:
    tp_tensor_release(wf);
    tp_tensor_release(whost);
    tp_tensor_release(tdev);
    tp_tensor_release(res);
    tp_tensor_release(lossl);
    tp_tensor_release(rows);
    tp_tensor_release(pk);
    tp_tensor_release(se);
    tp_tensor_release(mx);
    tp_tensor_release(x);
    return st;
}

/* ---- cross entropy: the entry point ----------------------------------------- */

/* TP_ERR_INVALID_ARG for target value v at local element k (of a block of
 * shape lshape at offset off in the global targets of tnd dims). */
static tp_status ce_bad_target(const char *fn, int64_t v, int tnd, const int64_t *lshape,
                               const int64_t *off, int64_t k, int64_t classes, int64_t ignore)
{
    char pos[128] = "";
    if (tnd == 1)
        snprintf(pos, sizeof pos, " at row %lld", (long long)(k + off[0]));
    else if (tnd > 1) {
        char idx[112];
        snprintf(pos, sizeof pos, " at position %s",
                 tp__position(tnd, lshape, off, k, idx, sizeof idx));
    }
    return tp__error(TP_ERR_INVALID_ARG,
                     "%s: target %lld%s is outside [0, %lld) and is not ignore_index (%lld)", fn,
                     (long long)v, pos, (long long)classes, (long long)ignore);
}

/* The shapes and dtypes cross_entropy takes: logits (C), (N, C) or
 * (N, C, d1, ..., dk) in f32, bf16 or f16; targets the logits' shape without
 * the class dim (into tshape); weight [C] in the logits' dtype. */
static tp_status ce_check_shapes(const char *fn, const tp_tensor *logits, const tp_tensor *target,
                                 const tp_tensor *weight, int64_t *tshape)
{
    TP_CHECK(tp__op_check_dtype(fn, "logits", logits, TP__KOP_CROSS_ENTROPY_FWD));
    TP_ARG_CHECK(logits->ndim >= 1,
                 "%s: logits must be [C], [N, C] or [N, C, d1, ..., dk], got a 0-d tensor", fn);
    const int nd = logits->ndim, cd = ce_class_dim(nd), tnd = nd - 1;
    const int64_t c = logits->shape[cd];
    for (int d = 0, k = 0; d < nd; d++)
        if (d != cd)
            tshape[k++] = logits->shape[d];
    TP_CHECK(tp__check_int(fn, "target", target));
    if (target->ndim != tnd ||
        memcmp(target->shape, tshape, sizeof(int64_t) * (size_t)tnd) != 0) {
        char want[96], have[96], lg[96];
        return tp__error(TP_ERR_INVALID_ARG,
                         "%s: target must be %s (the logits' shape %s without the class dim "
                         "%d), got shape %s",
                         fn, tp__shape_str(tnd, tshape, want, sizeof want),
                         tp__shape_str(nd, logits->shape, lg, sizeof lg), cd,
                         tp__shape_str(target->ndim, target->shape, have, sizeof have));
    }
    if (weight) {
        if (weight->ndim != 1 || weight->shape[0] != c) {
            char buf[96];
            return tp__error(TP_ERR_INVALID_ARG,
                             "%s: weight must be [%lld] (one per class), got shape %s", fn,
                             (long long)c,
                             tp__shape_str(weight->ndim, weight->shape, buf, sizeof buf));
        }
        if (weight->dtype != logits->dtype)
            return tp__error(TP_ERR_INVALID_ARG,
                             "%s: logits is %s but weight is %s; the dtypes must match", fn,
                             tp_dtype_name(logits->dtype), tp_dtype_name(weight->dtype));
    }
    return TP_OK;
}

/* How cross_entropy's logits are laid out over the mesh. */
typedef struct ce_layout {
    tp_mesh *mesh;  /* NULL for plain logits */
    int m;          /* mesh dims */
    int cdim;       /* the mesh dim sharding the classes (loss parallel), or -1 */
    bool partial;   /* a mesh dim holds Partial logits */
    tp_placement rep[TP_MESH_MAX_DIMS]; /* all Replicate */
    tp_placement tpl[TP_MESH_MAX_DIMS]; /* the targets': the logits' without the class dim */
} ce_layout;

/* Which mesh dim (if any) shards the classes, which shard other dims; the
 * targets' placements follow the logits' (the class dim removed), as
 * PyTorch's loss_parallel. Refuses what loss parallel does not take. */
static tp_status ce_plan_layout(const char *fn, tp_tensor *logits, tp_tensor *target,
                                tp_reduction reduction, ce_layout *L)
{
    const int cd = ce_class_dim(logits->ndim);
    const bool dist = tp__dist_of(logits) != NULL;
    L->mesh = dist ? tp_dtensor_mesh(logits) : NULL;
    L->m = dist ? tp_mesh_ndim(L->mesh) : 0;
    L->cdim = -1;
    L->partial = false;
    for (int d = 0; d < TP_MESH_MAX_DIMS; d++)
        L->rep[d] = L->tpl[d] = tp_replicate();
    if (!dist)
        return TP_OK;
    const int m = L->m;
    int bdim = -1;
    const tp_placement *pl = tp_dtensor_placements(logits);
    char buf[128];
    for (int d = 0; d < m; d++) {
        if (pl[d].kind == TP_PLACEMENT_PARTIAL)
            L->partial = true;
        if (pl[d].kind != TP_PLACEMENT_SHARD)
            continue;
        if (pl[d].dim != cd) {
            L->tpl[d] = tp_shard(pl[d].dim > cd ? pl[d].dim - 1 : pl[d].dim);
            if (bdim < 0)
                bdim = d;
            continue;
        }
        if (L->cdim >= 0)
            return tp__error(TP_ERR_NOT_SUPPORTED,
                             "%s: logits are sharded on the class dim by mesh dims %d and %d "
                             "(placements %s); loss parallel shards it on one mesh dim",
                             fn, L->cdim, d, tp_placements_str(m, pl, buf, sizeof buf));
        L->cdim = d;
    }
    if (bdim >= 0 && L->cdim < 0)
        return tp__error(TP_ERR_NOT_SUPPORTED,
                         "%s: logits are sharded on dim %d by mesh dim %d (placements %s) "
                         "but not on the class dim; shard the class dim (dim 1) for loss "
                         "parallel, or replicate the logits",
                         fn, pl[bdim].dim, bdim, tp_placements_str(m, pl, buf, sizeof buf));
    if (bdim >= 0 && reduction == TP_REDUCTION_MEAN)
        return tp__error(TP_ERR_NOT_SUPPORTED,
                         "%s: reduction mean with logits sharded on dim %d by mesh dim %d "
                         "(placements %s): each rank would divide by its own count; use "
                         "reduction sum or none and divide by the global count (as "
                         "PyTorch's loss_parallel)",
                         fn, pl[bdim].dim, bdim, tp_placements_str(m, pl, buf, sizeof buf));
    return tp__no_partial(fn, "target", target);
}

tp_status tp_cross_entropy(tp_tensor *logits, tp_tensor *target,
                           const tp_cross_entropy_options *options, tp_tensor **loss)
{
    const char *fn = "cross_entropy";
    TP_ARG_CHECK(loss, "%s: loss is NULL", fn);
    *loss = NULL;
    TP_ARG_CHECK(logits, "%s: logits is NULL", fn);
    TP_ARG_CHECK(target, "%s: target is NULL", fn);
    const tp_cross_entropy_options o = options ? *options : TP_CROSS_ENTROPY_DEFAULTS;
    tp_tensor *weight = o.weight;
    TP_ARG_CHECK(o.reduction == TP_REDUCTION_MEAN || o.reduction == TP_REDUCTION_SUM ||
                     o.reduction == TP_REDUCTION_NONE,
                 "%s: invalid reduction %d", fn, (int)o.reduction);
    TP_CHECK(tp__same_kind(fn, "logits", logits, "target", target));
    TP_CHECK(tp__same_kind(fn, "logits", logits, "weight", weight));
    TP_CHECK(tp__same_device(fn, "logits", logits, "target", target));
    TP_CHECK(tp__same_device(fn, "logits", logits, "weight", weight));
    int64_t tshape[TP_MAX_DIMS];
    TP_CHECK(ce_check_shapes(fn, logits, target, weight, tshape));
    ce_layout L;
    TP_CHECK(ce_plan_layout(fn, logits, target, o.reduction, &L));
    const int tnd = logits->ndim - 1, m = L.m, cdim = L.cdim;
    const int64_t c = logits->shape[ce_class_dim(logits->ndim)];
    const bool dist = L.mesh != NULL;
    tp_mesh *mesh = L.mesh;
    const tp_placement *rep = L.rep, *tpl = L.tpl;

    /* the targets in their placements and the full class weights on every
     * rank (no communication when they are so already); then this rank's
     * target values. Ranks that communicate below (along the class mesh dim
     * or a Partial one) hold the same targets, so they agree on an error. */
    tp_tensor *tr = NULL, *wr = NULL, *t64 = NULL, *w32 = NULL, *lg = NULL, *targ = NULL,
              *warg = NULL, *wh = NULL, *td = NULL;
    tp_status st = TP_OK;
    if (dist) {
        TP_CHECK_GOTO(tp__redistribute(target, tpl, false, &tr), st, done);
        if (weight)
            TP_CHECK_GOTO(tp__redistribute(weight, rep, false, &wr), st, done);
    } else {
        tr = tp_tensor_retain(target);
        wr = tp_tensor_retain(weight);
    }
    TP_CHECK_GOTO(tp__as_i64(tp__local_of(tr), &t64), st, done);
    if (wr)
        TP_CHECK_GOTO(tp__detached(tp__local_of(wr), &w32), st, done);
    int64_t lshape[TP_MAX_DIMS], off[TP_MAX_DIMS];
    for (int d = 0; d < tnd; d++) {
        lshape[d] = t64->shape[d];
        off[d] = 0;
    }
    if (dist)
        tp__shard_extent(mesh, tnd, tshape, tpl, NULL, lshape, off);
    const int64_t *tv = tp__i64_values(t64), nt = tp_tensor_numel(t64);
    for (int64_t r = 0; tv && r < nt; r++)
        if (tv[r] != o.ignore_index && (tv[r] < 0 || tv[r] >= c)) {
            st = ce_bad_target(fn, tv[r], tnd, lshape, off, r, c, o.ignore_index);
            goto done;
        }

    /* a Partial logits dim is reduced first (differentiably, counted) */
    if (L.partial) {
        tp_placement want[TP_MESH_MAX_DIMS];
        const tp_placement *pl = tp_dtensor_placements(logits);
        for (int d = 0; d < m; d++)
            want[d] = pl[d].kind == TP_PLACEMENT_PARTIAL ? tp_replicate() : pl[d];
        TP_CHECK_GOTO(tp__redistribute(logits, want, true, &lg), st, done);
    } else {
        lg = tp_tensor_retain(logits);
    }

    ce_params p = {o.reduction, o.ignore_index, 0.0};
    if (cdim >= 0) {
        st = ce_vocab(lg, cdim, tr, t64, w32, &p, loss);
        goto done;
    }
    /* the weight sum of the counted rows from the host targets (and host
     * weights); the kernels read the targets on the logits' device */
    const tp_device dev = tp_tensor_device(logits);
    if (tv)
        TP_CHECK_GOTO(ce_weight_f32(w32, TP_CPU, &wh), st, done);
    const float *wv = wh ? tp_tensor_data(wh) : NULL;
    for (int64_t r = 0; tv && r < nt; r++)
        if (tv[r] != o.ignore_index && tv[r] >= 0 && tv[r] < c)
            p.wsum += wv ? (double)wv[tv[r]] : 1.0;
    if (!tv)
        p.wsum = (double)nt;
    TP_CHECK_GOTO(tp__i64_on(t64, tp__local_of(tr), dev, &td), st, done);
    if (dist) {
        TP_CHECK_GOTO(tp__dtensor_wrap(mesh, td, rep, tnd, tshape, &targ), st, done);
        if (w32)
            TP_CHECK_GOTO(tp__dtensor_wrap(mesh, w32, rep, 1, weight->shape, &warg), st, done);
    } else {
        targ = tp_tensor_retain(td);
        warg = tp_tensor_retain(w32);
    }
    tp_tensor *args[3] = {lg, targ, warg};
    st = tp__op_run(&ce_def, args, &p, sizeof p, loss);
done:
    tp_tensor_release(td);
    tp_tensor_release(wh);
    tp_tensor_release(warg);
    tp_tensor_release(targ);
    tp_tensor_release(lg);
    tp_tensor_release(w32);
    tp_tensor_release(t64);
    tp_tensor_release(wr);
    tp_tensor_release(tr);
    return st;
}
