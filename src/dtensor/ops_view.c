/* View ops: reshape (flatten and unflatten are reshapes under names of their
 * own), transpose and permute. Each is a tp__op_def (see ops_internal.h).
 *
 * Sharding follows PyTorch's view rules (the reshape form, which
 * redistributes where its view form would refuse):
 *  - reshape: the dims fall into consecutive groups of input and output dims
 *    holding as many elements (size-1 dims outside a group appear or vanish
 *    on their own). A dim that maps to one dim of the same size keeps its
 *    shard, even or not. A group that splits or merges dims keeps a shard of
 *    its outermost input dim, on its outermost output dim, when the shard
 *    boundaries fall on whole rows of both: both sizes divisible by the mesh
 *    dim's size times that of every earlier mesh dim kept sharding the same
 *    dim (nested sharding). Any other shard is first replicated on its mesh
 *    dim (an all_gather).
 *  - transpose and permute: shards follow their dims; nothing moves.
 *  - Replicate and Partial pass through untouched.
 * One strategy per mesh dim, so the op never picks among layouts. The
 * backward is the inverse view of the gradient with the input's placements
 * (Partial read as Replicate), so it adds no communication. */
#include <string.h>

#include "dtensor/ops_internal.h"

/* The placement of the gradient of an input that had placement p. */
static tp_placement grad_placement(tp_placement p)
{
    return p.kind == TP_PLACEMENT_PARTIAL ? tp__R() : p;
}

/* ---- reshape, flatten, unflatten ------------------------------------------------
 * The forward is a view of the (contiguous) local input: no copy. */

typedef struct {
    int ndim;
    int64_t shape[TP_MAX_DIMS]; /* resolved: no -1 */
} reshape_params;

/* Where the shard of each input dim can go. */
typedef struct {
    int to[TP_MAX_DIMS];    /* the output dim it lands on; -1: nowhere (replicate first) */
    bool even[TP_MAX_DIMS]; /* it leads a group that splits or merges: survives only if even */
} view_map;

static void view_map_build(int nin, const int64_t *in, int nout, const int64_t *out, view_map *m)
{
    int64_t numel = 1;
    for (int d = 0; d < nin; d++) {
        m->to[d] = -1;
        m->even[d] = false;
        numel *= in[d];
    }
    if (numel == 0) {
        /* element counts say nothing: a shard survives where the leading
         * dims are the same */
        for (int d = 0; d < nin && d < nout && in[d] == out[d]; d++)
            m->to[d] = d;
        return;
    }
    int i = 0, j = 0;
    while (i < nin || j < nout) {
        bool in1 = i < nin && in[i] == 1, out1 = j < nout && out[j] == 1;
        if (in1 && out1) {
            m->to[i++] = j++;
            continue;
        }
        if (in1 || out1) { /* a size-1 dim vanishes or appears */
            i += in1;
            j += out1;
            continue;
        }
        /* both sides have a dim > 1 left, since the products are equal */
        TP_ASSERT(i < nin && j < nout);
        int gi = i, gj = j;
        int64_t f = in[i++], t = out[j++];
        while (f != t) {
            if (f < t) {
                TP_ASSERT(i < nin);
                f *= in[i++];
            } else {
                TP_ASSERT(j < nout);
                t *= out[j++];
            }
        }
        m->to[gi] = gj;
        m->even[gi] = i - gi > 1 || j - gj > 1;
    }
}

/* The placements the input must have (in) and the output then has (out), on
 * every mesh dim, from the input's placements. */
static void reshape_plan(const tp__op *op, tp_placement *in, tp_placement *out)
{
    const reshape_params *rp = TP__OP_PARAMS(op, const reshape_params);
    const int64_t *ishape = tp__op_gshape(op, 0);
    view_map m;
    view_map_build(tp__op_gndim(op, 0), ishape, rp->ndim, rp->shape, &m);
    int64_t split[TP_MAX_DIMS]; /* product of the mesh dims kept sharding each dim so far */
    for (int d = 0; d < TP_MAX_DIMS; d++)
        split[d] = 1;
    for (int md = 0; md < op->mesh_ndim; md++) {
        tp_placement p = tp_dtensor_placements(op->arg[0])[md];
        in[md] = out[md] = p;
        if (p.kind != TP_PLACEMENT_SHARD)
            continue;
        int d = p.dim, t = m.to[d];
        int64_t w = split[d] * tp_mesh_size(op->mesh, md);
        if (t >= 0 && (!m.even[d] || (ishape[d] % w == 0 && rp->shape[t] % w == 0))) {
            split[d] = w;
            out[md] = tp__S(t);
        } else {
            in[md] = out[md] = tp__R();
        }
    }
}

static int reshape_strategies(const tp__op *op, int mesh_dim, tp__strategy *s)
{
    tp_placement in[TP_MESH_MAX_DIMS], out[TP_MESH_MAX_DIMS];
    reshape_plan(op, in, out);
    s[0] = (tp__strategy){{in[mesh_dim]}, out[mesh_dim], {grad_placement(in[mesh_dim])}};
    return 1;
}

static tp_status reshape_shape(const tp__op *op, int *ndim, int64_t *shape)
{
    const reshape_params *rp = TP__OP_PARAMS(op, const reshape_params);
    *ndim = rp->ndim;
    memcpy(shape, rp->shape, sizeof(int64_t) * (size_t)rp->ndim);
    return TP_OK;
}

static tp_status reshape_fwd(tp__op *op, tp_tensor *const *in, tp_tensor **out)
{
    int64_t shape[TP_MAX_DIMS], offset[TP_MAX_DIMS];
    memcpy(shape, op->out_shape, sizeof(int64_t) * (size_t)op->out_ndim);
    if (op->distributed)
        tp__shard_extent(op->mesh, op->out_ndim, op->out_shape, op->out_pl, NULL, shape, offset);
    int64_t n = 1;
    for (int d = 0; d < op->out_ndim; d++)
        n *= shape[d];
    TP_ASSERT(n == tp_tensor_numel(in[0])); /* the plan keeps only shards that line up */
    return tp_tensor_view(in[0], op->out_ndim, shape, out);
}

static tp_status reshape_bwd(tp__op *op, tp_tensor *const *in, tp_tensor *gy, tp_tensor **g)
{
    if (!op->need_grad[0])
        return TP_OK;
    /* a copy, so that the input's gradient never aliases the caller's gy */
    int64_t n = tp_tensor_numel(in[0]);
    TP_ASSERT(tp_tensor_numel(gy) == n);
    TP_CHECK(tp__new(op->dt, op->dev, in[0]->ndim, in[0]->shape, false, &g[0]));
    return tp__op_copy(op->dev, op->dt, tp_tensor_data(g[0]), tp_tensor_data(gy), n);
}

#define RESHAPE_DEF(n)                                                                        \
    {                                                                                         \
        .name = n, .n_inputs = 1, .input_names = {"x"}, .dtype_kernel = TP__KOP_COPY,         \
        .strategies = reshape_strategies, .out_shape = reshape_shape, .forward = reshape_fwd, \
        .backward = reshape_bwd,                                                              \
    }

static const tp__op_def reshape_def = RESHAPE_DEF("reshape");
static const tp__op_def flatten_def = RESHAPE_DEF("flatten");
static const tp__op_def unflatten_def = RESHAPE_DEF("unflatten");

tp_status tp_reshape(tp_tensor *x, int ndim, const int64_t *shape, tp_tensor **y)
{
    const char *fn = "reshape";
    TP_ARG_CHECK(y, "%s: out is NULL", fn);
    *y = NULL;
    TP_ARG_CHECK(x, "%s: x is NULL", fn);
    TP_ARG_CHECK(ndim >= 0 && ndim <= TP_MAX_DIMS, "%s: ndim %d is outside [0, %d]", fn, ndim,
                 TP_MAX_DIMS);
    TP_ARG_CHECK(ndim == 0 || shape, "%s: shape is NULL for ndim %d", fn, ndim);
    reshape_params rp = {.ndim = ndim};
    int64_t numel = tp_tensor_numel(x), known = 1;
    TP_CHECK(tp__infer_sizes(fn, numel, ndim, shape, 0, rp.shape, &known));
    char sx[128], sy[128];
    TP_ARG_CHECK(known == numel, "%s: cannot reshape %s (%lld elements) into %s (%lld elements)",
                 fn, tp__shape_str(tp_tensor_ndim(x), tp_tensor_shape(x), sx, sizeof sx),
                 (long long)numel, tp__shape_str(ndim, shape, sy, sizeof sy), (long long)known);
    tp_tensor *args[1] = {x};
    return tp__op_run(&reshape_def, args, &rp, sizeof rp, y);
}

tp_status tp_flatten(tp_tensor *x, int start_dim, int end_dim, tp_tensor **y)
{
    const char *fn = "flatten";
    TP_ARG_CHECK(y, "%s: out is NULL", fn);
    *y = NULL;
    TP_ARG_CHECK(x, "%s: x is NULL", fn);
    int nd = tp_tensor_ndim(x), vnd = nd > 0 ? nd : 1; /* a 0-d tensor flattens to [1] */
    int s = tp__wrap_dim(start_dim, vnd), e = tp__wrap_dim(end_dim, vnd);
    TP_ARG_CHECK(s >= 0, "%s: start_dim %d is out of range for %d dims", fn, start_dim, nd);
    TP_ARG_CHECK(e >= 0, "%s: end_dim %d is out of range for %d dims", fn, end_dim, nd);
    TP_ARG_CHECK(s <= e, "%s: start_dim %d comes after end_dim %d", fn, start_dim, end_dim);
    const int64_t *in = tp_tensor_shape(x);
    reshape_params rp = {.ndim = vnd - (e - s)};
    int k = 0;
    for (int d = 0; d < s; d++)
        rp.shape[k++] = in[d];
    int64_t merged = 1;
    for (int d = s; d <= e && nd > 0; d++)
        merged *= in[d];
    rp.shape[k++] = merged;
    for (int d = e + 1; d < nd; d++)
        rp.shape[k++] = in[d];
    tp_tensor *args[1] = {x};
    return tp__op_run(&flatten_def, args, &rp, sizeof rp, y);
}

tp_status tp_unflatten(tp_tensor *x, int dim, int n, const int64_t *sizes, tp_tensor **y)
{
    const char *fn = "unflatten";
    TP_ARG_CHECK(y, "%s: out is NULL", fn);
    *y = NULL;
    TP_ARG_CHECK(x, "%s: x is NULL", fn);
    int nd = tp_tensor_ndim(x), d = tp__wrap_dim(dim, nd);
    TP_ARG_CHECK(d >= 0, "%s: dim %d is out of range for %d dims", fn, dim, nd);
    TP_ARG_CHECK(n >= 1, "%s: sizes must hold at least one size (n = %d)", fn, n);
    TP_ARG_CHECK(sizes, "%s: sizes is NULL", fn);
    TP_ARG_CHECK(nd - 1 + n <= TP_MAX_DIMS, "%s: the result would have %d dims; at most %d", fn,
                 nd - 1 + n, TP_MAX_DIMS);
    const int64_t *in = tp_tensor_shape(x);
    reshape_params rp = {.ndim = nd - 1 + n};
    memcpy(rp.shape, in, sizeof(int64_t) * (size_t)d);
    int64_t known = 1;
    TP_CHECK(tp__infer_sizes(fn, in[d], n, sizes, d, rp.shape + d, &known));
    char sb[128];
    TP_ARG_CHECK(known == in[d], "%s: sizes %s hold %lld elements but dim %d has size %lld", fn,
                 tp__shape_str(n, sizes, sb, sizeof sb), (long long)known, d,
                 (long long)in[d]);
    memcpy(rp.shape + d + n, in + d + 1, sizeof(int64_t) * (size_t)(nd - d - 1));
    tp_tensor *args[1] = {x};
    return tp__op_run(&unflatten_def, args, &rp, sizeof rp, y);
}

/* ---- transpose and permute --------------------------------------------------------
 * A copy into the new dim order (ops take contiguous inputs). */

typedef struct {
    int ndim;
    int perm[TP_MAX_DIMS]; /* output dim k is input dim perm[k] */
} permute_params;

static int permute_strategies(const tp__op *op, int mesh_dim, tp__strategy *s)
{
    const permute_params *pp = TP__OP_PARAMS(op, const permute_params);
    tp_placement cur = tp_dtensor_placements(op->arg[0])[mesh_dim], out = cur;
    for (int k = 0; cur.kind == TP_PLACEMENT_SHARD && k < pp->ndim; k++)
        if (pp->perm[k] == cur.dim)
            out = tp__S(k);
    s[0] = (tp__strategy){{cur}, out, {grad_placement(cur)}};
    return 1;
}

static tp_status permute_shape(const tp__op *op, int *ndim, int64_t *shape)
{
    const permute_params *pp = TP__OP_PARAMS(op, const permute_params);
    const int64_t *in = tp__op_gshape(op, 0);
    *ndim = pp->ndim;
    for (int k = 0; k < pp->ndim; k++)
        shape[k] = in[pp->perm[k]];
    return TP_OK;
}

/* A new contiguous tensor holding x (contiguous) with its dims reordered:
 * dim k of the result is dim perm[k] of x. */
static tp_status permute_local(tp_tensor *x, const int *perm, tp_tensor **out)
{
    int nd = x->ndim;
    int64_t shape[TP_MAX_DIMS], stride[TP_MAX_DIMS];
    bool identity = true, last2 = nd >= 2;
    for (int k = 0; k < nd; k++) {
        shape[k] = x->shape[perm[k]];
        stride[k] = x->stride[perm[k]];
        identity = identity && perm[k] == k;
        if (k < nd - 2)
            last2 = last2 && perm[k] == k;
    }
    last2 = last2 && perm[nd - 2] == nd - 1 && perm[nd - 1] == nd - 2;
    tp_device dev = tp_tensor_device(x);
    const tp__kernels *kern = NULL;
    TP_CHECK(tp__kernels_for(dev, &kern));
    TP_CHECK(tp__new(x->dtype, dev, nd, shape, false, out));
    int64_t n = tp_tensor_numel(x);
    void *y = tp_tensor_data(*out);
    tp_status st;
    if (identity || n == 0)
        st = kern->copy(dev, x->dtype, y, tp_tensor_data(x), n);
    else if (!last2) /* x read through its strides in the new dim order */
        st = kern->gather(dev, x->dtype, y, tp_tensor_data(x), nd, shape, stride);
    else {
        int64_t r = x->shape[nd - 2], c = x->shape[nd - 1];
        st = kern->transpose_last2(dev, x->dtype, tp_tensor_data(x), y, n / (r * c), r, c);
    }
    if (st != TP_OK) {
        tp_tensor_release(*out);
        *out = NULL;
    }
    return st;
}

static tp_status permute_fwd(tp__op *op, tp_tensor *const *in, tp_tensor **out)
{
    return permute_local(in[0], TP__OP_PARAMS(op, const permute_params)->perm, out);
}

static tp_status permute_bwd(tp__op *op, tp_tensor *const *in, tp_tensor *gy, tp_tensor **g)
{
    (void)in;
    if (!op->need_grad[0])
        return TP_OK;
    const permute_params *pp = TP__OP_PARAMS(op, const permute_params);
    int inv[TP_MAX_DIMS];
    for (int k = 0; k < pp->ndim; k++)
        inv[pp->perm[k]] = k;
    return permute_local(gy, inv, &g[0]);
}

#define PERMUTE_DEF(n)                                                                        \
    {                                                                                         \
        .name = n, .n_inputs = 1, .input_names = {"x"}, .dtype_kernel = TP__KOP_GATHER,       \
        .strategies = permute_strategies, .out_shape = permute_shape, .forward = permute_fwd, \
        .backward = permute_bwd,                                                              \
    }

static const tp__op_def transpose_def = PERMUTE_DEF("transpose");
static const tp__op_def permute_def = PERMUTE_DEF("permute");

tp_status tp_transpose(tp_tensor *x, int d0, int d1, tp_tensor **y)
{
    const char *fn = "transpose";
    TP_ARG_CHECK(y, "%s: out is NULL", fn);
    *y = NULL;
    TP_ARG_CHECK(x, "%s: x is NULL", fn);
    int nd = tp_tensor_ndim(x), a = tp__wrap_dim(d0, nd), b = tp__wrap_dim(d1, nd);
    TP_ARG_CHECK(a >= 0 && b >= 0, "%s: dims (%d, %d) out of range for %d dims", fn, d0, d1, nd);
    permute_params pp = {.ndim = nd};
    for (int k = 0; k < nd; k++)
        pp.perm[k] = k == a ? b : k == b ? a : k;
    tp_tensor *args[1] = {x};
    return tp__op_run(&transpose_def, args, &pp, sizeof pp, y);
}

tp_status tp_permute(tp_tensor *x, int ndim, const int *dims, tp_tensor **y)
{
    const char *fn = "permute";
    TP_ARG_CHECK(y, "%s: out is NULL", fn);
    *y = NULL;
    TP_ARG_CHECK(x, "%s: x is NULL", fn);
    int nd = tp_tensor_ndim(x);
    TP_ARG_CHECK(ndim == nd, "%s: %d dims given for a tensor of %d dims", fn, ndim, nd);
    TP_ARG_CHECK(nd == 0 || dims, "%s: dims is NULL", fn);
    permute_params pp = {.ndim = nd};
    bool seen[TP_MAX_DIMS] = {false};
    for (int k = 0; k < nd; k++) {
        int d = tp__wrap_dim(dims[k], nd);
        TP_ARG_CHECK(d >= 0, "%s: dim %d is out of range for %d dims", fn, dims[k], nd);
        TP_ARG_CHECK(!seen[d], "%s: dim %d appears twice", fn, d);
        seen[d] = true;
        pp.perm[k] = d;
    }
    tp_tensor *args[1] = {x};
    return tp__op_run(&permute_def, args, &pp, sizeof pp, y);
}

/* ---- narrow ---------------------------------------------------------------------
 * torch.narrow: `length` entries of `dim` from `start`, as a contiguous copy
 * (ops take contiguous inputs). A shard of another dim passes through; a
 * shard of `dim` is replicated first (the slice crosses shard boundaries);
 * Replicate and Partial pass (narrow is linear). The backward writes the
 * gradient into zeros of the input's shape: no communication. */

typedef struct {
    int dim;
    int64_t start, length;
} narrow_params;

static int narrow_strategies(const tp__op *op, int mesh_dim, tp__strategy *s)
{
    const narrow_params *np = TP__OP_PARAMS(op, const narrow_params);
    tp_placement cur = tp_dtensor_placements(op->arg[0])[mesh_dim];
    if (cur.kind == TP_PLACEMENT_SHARD && cur.dim == np->dim)
        cur = tp__R();
    s[0] = (tp__strategy){{cur}, cur, {grad_placement(cur)}};
    return 1;
}

static tp_status narrow_shape(const tp__op *op, int *ndim, int64_t *shape)
{
    const narrow_params *np = TP__OP_PARAMS(op, const narrow_params);
    *ndim = tp__op_gndim(op, 0);
    memcpy(shape, tp__op_gshape(op, 0), sizeof(int64_t) * (size_t)*ndim);
    shape[np->dim] = np->length;
    return TP_OK;
}

/* Copies the `length` rows of dim between a tensor with `size` of them
 * (base, at `start`) and one holding just those (part), per outer index:
 * into part when `to_part`, else back into base. */
static tp_status narrow_copy(tp__op *op, void *base, void *part, const int64_t *shape, int dim,
                             bool to_part)
{
    const narrow_params *np = TP__OP_PARAMS(op, const narrow_params);
    int64_t outer = 1, inner = 1;
    for (int d = 0; d < dim; d++)
        outer *= shape[d];
    for (int d = dim + 1; d < op->in[0]->ndim; d++)
        inner *= shape[d];
    const size_t es = tp_dtype_size(op->dt);
    const int64_t size = shape[dim], block = np->length * inner;
    tp_status st = TP_OK;
    for (int64_t o = 0; o < outer && st == TP_OK && block > 0; o++) {
        char *b = (char *)base + (size_t)((o * size + np->start) * inner) * es;
        char *p = (char *)part + (size_t)(o * block) * es;
        st = to_part ? op->k->copy(op->dev, op->dt, p, b, block)
                     : op->k->copy(op->dev, op->dt, b, p, block);
    }
    return st;
}

static tp_status narrow_fwd(tp__op *op, tp_tensor *const *in, tp_tensor **out)
{
    const narrow_params *np = TP__OP_PARAMS(op, const narrow_params);
    int64_t shape[TP_MAX_DIMS];
    memcpy(shape, in[0]->shape, sizeof(int64_t) * (size_t)in[0]->ndim);
    shape[np->dim] = np->length;
    TP_CHECK(tp__new(op->dt, op->dev, in[0]->ndim, shape, false, out));
    tp_status st = narrow_copy(op, tp_tensor_data(in[0]), tp_tensor_data(*out), in[0]->shape,
                               np->dim, true);
    if (st != TP_OK) {
        tp_tensor_release(*out);
        *out = NULL;
    }
    return st;
}

static tp_status narrow_bwd(tp__op *op, tp_tensor *const *in, tp_tensor *gy, tp_tensor **g)
{
    if (!op->need_grad[0])
        return TP_OK;
    const narrow_params *np = TP__OP_PARAMS(op, const narrow_params);
    TP_CHECK(tp__new(op->dt, op->dev, in[0]->ndim, in[0]->shape, true, &g[0]));
    return narrow_copy(op, tp_tensor_data(g[0]), tp_tensor_data(gy), in[0]->shape, np->dim,
                       false);
}

static const tp__op_def narrow_def = {
    .name = "narrow",
    .n_inputs = 1,
    .input_names = {"x"},
    .dtype_kernel = TP__KOP_COPY,
    .strategies = narrow_strategies,
    .out_shape = narrow_shape,
    .forward = narrow_fwd,
    .backward = narrow_bwd,
};

tp_status tp_narrow(tp_tensor *x, int dim, int64_t start, int64_t length, tp_tensor **y)
{
    const char *fn = "narrow";
    TP_ARG_CHECK(y, "%s: out is NULL", fn);
    *y = NULL;
    TP_ARG_CHECK(x, "%s: x is NULL", fn);
    const int nd = tp_tensor_ndim(x), d = tp__wrap_dim(dim, nd);
    TP_ARG_CHECK(d >= 0, "%s: dim %d is out of range for %d dims", fn, dim, nd);
    const int64_t size = tp_tensor_size(x, d);
    TP_ARG_CHECK(start >= 0 && length >= 0 && start <= size - length,
                 "%s: [%lld, %lld) is not within dim %d of size %lld", fn, (long long)start,
                 (long long)(start + length), d, (long long)size);
    narrow_params np = {d, start, length};
    tp_tensor *args[1] = {x};
    return tp__op_run(&narrow_def, args, &np, sizeof np, y);
}
