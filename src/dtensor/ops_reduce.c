/* Reductions and normalizations: sum, mean, softmax, layer_norm, rms_norm.
 *
 * Strategies (per mesh dim):
 *   sum/mean over dim k: x S(k) -> P(sum) (the shard's sum; mean divides by
 *     the global count so the partial sums add up); x S(j), j != k -> S(j')
 *     (j' = j - 1 when the dim is dropped and j > k); R -> R; P(sum) -> P(sum).
 *   sum_all/mean_all: x S(any) -> P(sum); R -> R; P(sum) -> P(sum).
 *   softmax (last dim): x S(j), j not last -> S(j); R -> R.
 *   layer_norm/rms_norm (last dim): x S(j), j not last, weight/bias R -> S(j),
 *     the weight/bias gradients are the local rows' sums, Partial(sum) (the
 *     sequence-parallel case); all R -> R.
 * Anything else is redistributed by the dispatcher. */
#include <math.h>
#include <string.h>

#include "dtensor/ops_internal.h"

/* ---- shared argument checks ------------------------------------------------ */

static tp_status red_check_out(const char *fn, tp_tensor **y)
{
    TP_ARG_CHECK(y, "%s: y is NULL", fn);
    *y = NULL;
    return TP_OK;
}

/* Normalizes dim against x's rank (a 0-d tensor accepts 0 and -1). */
static tp_status red_norm_dim(const char *fn, const tp_tensor *x, int dim, int *out)
{
    int nd = tp_tensor_ndim(x);
    int d = tp__wrap_dim(dim, nd > 0 ? nd : 1);
    if (d < 0)
        return tp__error(TP_ERR_INVALID_ARG, "%s: dim %d is out of range for a %d-d tensor "
                         "(valid: [%d, %d])", fn, dim, nd, nd > 0 ? -nd : -1, nd > 0 ? nd - 1 : 0);
    *out = d;
    return TP_OK;
}

/* ---- sum / mean ----------------------------------------------------------- */

typedef struct {
    int dim;      /* normalized reduced dim; -1: every dim (a 0-d result) */
    bool keepdim; /* keep the reduced dim with size 1 */
    bool mean;    /* divide by the global count */
} red_params;

static int sum_strategies(const tp__op *op, int mesh_dim, tp__strategy *s)
{
    (void)mesh_dim;
    const red_params *p = TP__OP_PARAMS(op, const red_params);
    int nd = tp__op_gndim(op, 0), n = 0;
    for (int j = 0; j < nd; j++) {
        tp_placement out;
        if (p->dim < 0 || j == p->dim)
            out = tp__P(); /* the reduced dim is split: partial sums */
        else
            out = tp__S(!p->keepdim && j > p->dim ? j - 1 : j);
        s[n++] = (tp__strategy){{tp__S(j)}, out, {tp__S(j)}};
    }
    s[n++] = (tp__strategy){{tp__R()}, tp__R(), {tp__R()}};
    /* linear: a partial input gives a partial output; each term's gradient is
     * the whole (replicated) output gradient */
    s[n++] = (tp__strategy){{tp__P()}, tp__P(), {tp__R()}};
    return n;
}

/* The output shape for a given input shape (global or local). */
static void sum_shape_of(const red_params *p, int nd, const int64_t *x, int *ndim,
                         int64_t *shape)
{
    if (p->dim < 0) {
        *ndim = 0;
        return;
    }
    int o = 0;
    for (int d = 0; d < nd; d++) {
        if (d != p->dim)
            shape[o++] = x[d];
        else if (p->keepdim)
            shape[o++] = 1;
    }
    *ndim = o;
}

static tp_status sum_shape(const tp__op *op, int *ndim, int64_t *shape)
{
    sum_shape_of(TP__OP_PARAMS(op, const red_params), tp__op_gndim(op, 0), tp__op_gshape(op, 0),
                 ndim, shape);
    return TP_OK;
}

/* outer/size/inner of x viewed around the reduced dim (everything: 1/n/1). */
static void sum_split(const red_params *p, const tp_tensor *x, int64_t *outer, int64_t *size,
                      int64_t *inner)
{
    *outer = 1;
    *inner = 1;
    if (p->dim < 0) {
        *size = tp_tensor_numel(x);
        return;
    }
    *size = x->shape[p->dim];
    for (int d = 0; d < p->dim; d++)
        *outer *= x->shape[d];
    for (int d = p->dim + 1; d < x->ndim; d++)
        *inner *= x->shape[d];
}

/* The global number of elements averaged over. */
static int64_t sum_count(const tp__op *op)
{
    const red_params *p = TP__OP_PARAMS(op, const red_params);
    int nd = tp__op_gndim(op, 0);
    const int64_t *g = tp__op_gshape(op, 0);
    if (p->dim >= 0)
        return g[p->dim];
    int64_t n = 1;
    for (int d = 0; d < nd; d++)
        n *= g[d];
    return n;
}

static tp_status sum_fwd(tp__op *op, tp_tensor *const *in, tp_tensor **out)
{
    const red_params *p = TP__OP_PARAMS(op, const red_params);
    tp_tensor *x = in[0];
    int ndim = 0;
    int64_t shape[TP_MAX_DIMS], outer, size, inner;
    sum_shape_of(p, x->ndim, x->shape, &ndim, shape);
    TP_CHECK(tp__new(op->dt, op->dev, ndim, shape, false, out));
    sum_split(p, x, &outer, &size, &inner);
    /* mean: the global count, so that the partial sums of shards add up to
     * the mean (0 elements: 0/0, NaN, as PyTorch); divided before the one
     * rounding */
    double div = p->mean ? (double)sum_count(op) : 1.0;
    if (p->dim < 0)
        return op->k->sum_all(op->dev, op->dt, tp_tensor_data(x), size, tp_tensor_data(*out), div);
    return op->k->sum_dim(op->dev, op->dt, tp_tensor_data(x), tp_tensor_data(*out), outer, size,
                          inner, div);
}

static tp_status sum_bwd(tp__op *op, tp_tensor *const *in, tp_tensor *gy, tp_tensor **g)
{
    const red_params *p = TP__OP_PARAMS(op, const red_params);
    tp_tensor *x = in[0];
    if (!op->need_grad[0])
        return TP_OK;
    int64_t outer, size, inner;
    TP_CHECK(tp__new(op->dt, op->dev, x->ndim, x->shape, false, &g[0]));
    sum_split(p, x, &outer, &size, &inner);
    float scale = p->mean ? (float)(1.0 / (double)sum_count(op)) : 1.0f;
    return op->k->sum_dim_bwd(op->dev, op->dt, tp_tensor_data(gy), tp_tensor_data(g[0]), outer,
                              size, inner, scale);
}

/* sum, sum_all, mean and mean_all share one implementation; only the name
 * (in messages) differs, the rest comes from the params. */
#define TP__SUM_DEF(var, nm)                                        \
    static const tp__op_def var = {.name = nm,                      \
                                   .n_inputs = 1,                   \
                                   .input_names = {"x"},            \
                                   .dtype_kernel = TP__KOP_SUM_DIM, \
                                   .strategies = sum_strategies,    \
                                   .out_shape = sum_shape,          \
                                   .forward = sum_fwd,              \
                                   .backward = sum_bwd}
TP__SUM_DEF(sum_def, "sum");
TP__SUM_DEF(sum_all_def, "sum_all");
TP__SUM_DEF(mean_def, "mean");
TP__SUM_DEF(mean_all_def, "mean_all");

static tp_status red_run(const tp__op_def *def, tp_tensor *x, bool all, int dim, bool keepdim,
                         bool mean, tp_tensor **y)
{
    const char *fn = def->name;
    TP_CHECK(red_check_out(fn, y));
    TP_ARG_CHECK(x, "%s: x is NULL", fn);
    red_params p = {.dim = -1, .keepdim = false, .mean = mean};
    if (!all) {
        TP_CHECK(red_norm_dim(fn, x, dim, &p.dim));
        p.keepdim = keepdim;
        if (tp_tensor_ndim(x) == 0)
            p.dim = -1; /* the one element of a 0-d tensor: a 0-d result */
    }
    tp_tensor *args[1] = {x};
    return tp__op_run(def, args, &p, sizeof p, y);
}

tp_status tp_sum(tp_tensor *x, int dim, bool keepdim, tp_tensor **y)
{
    return red_run(&sum_def, x, false, dim, keepdim, false, y);
}

tp_status tp_sum_all(tp_tensor *x, tp_tensor **y)
{
    return red_run(&sum_all_def, x, true, 0, false, false, y);
}

tp_status tp_mean(tp_tensor *x, int dim, bool keepdim, tp_tensor **y)
{
    return red_run(&mean_def, x, false, dim, keepdim, true, y);
}

tp_status tp_mean_all(tp_tensor *x, tp_tensor **y)
{
    return red_run(&mean_all_def, x, true, 0, false, true, y);
}

/* ---- row-wise ops over the last dim: shared strategies --------------------- */

/* all R -> R; x S(j), j not last, parameters R -> S(j) with Partial
 * parameter gradients. The last dim sharded, or a Partial x, is left to the
 * dispatcher to redistribute. Replicate comes first so that, of equally
 * cheap redistributions (S(last) -> R by all_gather or -> S(j) by
 * all_to_all), a sharded normalized dim is replicated, as PyTorch does. */
static int rowwise_strategies(const tp__op *op, int mesh_dim, tp__strategy *s)
{
    (void)mesh_dim;
    int nd = tp__op_gndim(op, 0), n = 0;
    s[n++] = (tp__strategy){{tp__R(), tp__R(), tp__R()}, tp__R(), {tp__R(), tp__R(), tp__R()}};
    for (int j = 0; j + 1 < nd; j++)
        s[n++] = (tp__strategy){{tp__S(j), tp__R(), tp__R()}, tp__S(j),
                                {tp__S(j), tp__P(), tp__P()}};
    return n;
}

static tp_status same_shape(const tp__op *op, int *ndim, int64_t *shape)
{
    *ndim = tp__op_gndim(op, 0);
    memcpy(shape, tp__op_gshape(op, 0), sizeof(int64_t) * (size_t)*ndim);
    return TP_OK;
}

/* rows x cols of a contiguous tensor reduced over its last dim (0-d: 1 x 1). */
static void rows_cols(const tp_tensor *t, int64_t *rows, int64_t *cols)
{
    *rows = tp__rows(t);
    *cols = t->ndim > 0 ? t->shape[t->ndim - 1] : 1;
}

/* ---- softmax --------------------------------------------------------------- */

static tp_status softmax_fwd(tp__op *op, tp_tensor *const *in, tp_tensor **out)
{
    tp_tensor *x = in[0];
    int64_t rows, cols;
    rows_cols(x, &rows, &cols);
    TP_CHECK(tp__new(op->dt, op->dev, x->ndim, x->shape, false, out));
    if (rows > 0 && cols > 0)
        TP_CHECK(op->k->softmax_fwd(op->dev, op->dt, tp_tensor_data(x), tp_tensor_data(*out), rows,
                                    cols));
    return tp__op_save_output(*out, &op->saved[0]);
}

static tp_status softmax_bwd(tp__op *op, tp_tensor *const *in, tp_tensor *gy, tp_tensor **g)
{
    tp_tensor *x = in[0];
    if (!op->need_grad[0])
        return TP_OK;
    int64_t rows, cols;
    rows_cols(x, &rows, &cols);
    TP_CHECK(tp__new(op->dt, op->dev, x->ndim, x->shape, false, &g[0]));
    if (rows > 0 && cols > 0)
        return op->k->softmax_bwd(op->dev, op->dt, tp_tensor_data(op->saved[0]), tp_tensor_data(gy),
                                  tp_tensor_data(g[0]), rows, cols);
    return TP_OK;
}

static const tp__op_def softmax_def = {
    .name = "softmax",
    .n_inputs = 1,
    .input_names = {"x"},
    .dtype_kernel = TP__KOP_SOFTMAX_FWD,
    .strategies = rowwise_strategies,
    .out_shape = same_shape,
    .forward = softmax_fwd,
    .backward = softmax_bwd,
};

tp_status tp_softmax(tp_tensor *x, int dim, tp_tensor **y)
{
    const char *fn = softmax_def.name;
    TP_CHECK(red_check_out(fn, y));
    TP_ARG_CHECK(x, "%s: x is NULL", fn);
    int d = 0, nd = tp_tensor_ndim(x);
    TP_CHECK(red_norm_dim(fn, x, dim, &d));
    if (nd > 0 && d != nd - 1)
        return tp__error(TP_ERR_NOT_SUPPORTED,
                         "%s: only the last dim is supported (dim -1 or %d of a %d-d tensor), "
                         "got dim %d",
                         fn, nd - 1, nd, dim);
    tp_tensor *args[1] = {x};
    return tp__op_run(&softmax_def, args, NULL, 0, y);
}

/* ---- layer_norm / rms_norm -------------------------------------------------- */

typedef struct {
    double eps;
} norm_params;

/* Checks the arguments every norm shares: x at least 1-d, weight/bias 1-d of
 * x's last dim, eps finite and >= 0 (the dispatcher checks the dtypes). */
static tp_status norm_check(const char *fn, tp_tensor *x, tp_tensor *weight, tp_tensor *bias,
                            double eps, tp_tensor **y)
{
    TP_CHECK(red_check_out(fn, y));
    TP_ARG_CHECK(x, "%s: x is NULL", fn);
    int nd = tp_tensor_ndim(x);
    TP_ARG_CHECK(nd >= 1, "%s: x must have at least 1 dim (it normalizes the last), got a 0-d "
                 "tensor", fn);
    int64_t n = tp_tensor_shape(x)[nd - 1];
    const tp_tensor *p[2] = {weight, bias};
    const char *pn[2] = {"weight", "bias"};
    for (int i = 0; i < 2; i++) {
        if (!p[i])
            continue;
        TP_ARG_CHECK(tp_tensor_ndim(p[i]) == 1, "%s: %s must be 1-d [%lld], got %d dims", fn,
                     pn[i], (long long)n, tp_tensor_ndim(p[i]));
        TP_ARG_CHECK(tp_tensor_shape(p[i])[0] == n,
                     "%s: %s has %lld elements but x's last dim is %lld", fn, pn[i],
                     (long long)tp_tensor_shape(p[i])[0], (long long)n);
    }
    TP_ARG_CHECK(isfinite(eps) && eps >= 0, "%s: eps must be finite and >= 0, got %g", fn, eps);
    return TP_OK;
}

static const void *data_or_null(const tp_tensor *t)
{
    return t ? tp_tensor_data(t) : NULL;
}

static tp_status layer_norm_fwd(tp__op *op, tp_tensor *const *in, tp_tensor **out)
{
    const norm_params *p = TP__OP_PARAMS(op, const norm_params);
    tp_tensor *x = in[0];
    int64_t rows, cols;
    rows_cols(x, &rows, &cols);
    TP_CHECK(tp__f32(op->dev, 1, &rows, false, &op->saved[0])); /* mean */
    TP_CHECK(tp__f32(op->dev, 1, &rows, false, &op->saved[1])); /* rstd */
    TP_CHECK(tp__new(op->dt, op->dev, x->ndim, x->shape, false, out));
    return op->k->layer_norm_fwd(op->dev, op->dt, tp_tensor_data(x), data_or_null(in[1]),
                                 data_or_null(in[2]), tp_tensor_data(*out),
                                 tp_tensor_data(op->saved[0]), tp_tensor_data(op->saved[1]), rows,
                                 cols, (float)p->eps);
}

/* The gradient buffers of a norm's backward: gx is always written by the
 * kernels (a scratch when x needs none); gw/gb are accumulated into zeros. */
static tp_status norm_grads(tp__op *op, tp_tensor *const *in, tp_tensor **g, tp_tensor **gx)
{
    tp_tensor *x = in[0];
    TP_CHECK(tp__new(op->dt, op->dev, x->ndim, x->shape, false, gx));
    if (op->need_grad[0])
        g[0] = tp_tensor_retain(*gx);
    for (int i = 1; i < op->def->n_inputs; i++)
        if (in[i] && op->need_grad[i])
            TP_CHECK(tp__new(op->dt, op->dev, 1, in[i]->shape, true, &g[i]));
    return TP_OK;
}

static void *grad_or_null(tp_tensor *const *g, int i)
{
    return g[i] ? tp_tensor_data(g[i]) : NULL;
}

static tp_status layer_norm_bwd(tp__op *op, tp_tensor *const *in, tp_tensor *gy, tp_tensor **g)
{
    tp_tensor *x = in[0], *gx = NULL;
    int64_t rows, cols;
    rows_cols(x, &rows, &cols);
    tp_status st = norm_grads(op, in, g, &gx);
    if (st == TP_OK)
        st = op->k->layer_norm_bwd(op->dev, op->dt, tp_tensor_data(x), data_or_null(in[1]),
                                   tp_tensor_data(op->saved[0]), tp_tensor_data(op->saved[1]),
                                   tp_tensor_data(gy), tp_tensor_data(gx), grad_or_null(g, 1),
                                   grad_or_null(g, 2), rows, cols);
    tp_tensor_release(gx);
    return st;
}

static const tp__op_def layer_norm_def = {
    .name = "layer_norm",
    .n_inputs = 3,
    .input_names = {"x", "weight", "bias"},
    .optional_mask = (1u << 1) | (1u << 2),
    .dtype_kernel = TP__KOP_LAYER_NORM_FWD,
    .strategies = rowwise_strategies,
    .out_shape = same_shape,
    .forward = layer_norm_fwd,
    .backward = layer_norm_bwd,
};

tp_status tp_layer_norm(tp_tensor *x, tp_tensor *weight, tp_tensor *bias, double eps,
                        tp_tensor **y)
{
    TP_CHECK(norm_check(layer_norm_def.name, x, weight, bias, eps, y));
    norm_params p = {eps};
    tp_tensor *args[3] = {x, weight, bias};
    return tp__op_run(&layer_norm_def, args, &p, sizeof p, y);
}

static tp_status rms_norm_fwd(tp__op *op, tp_tensor *const *in, tp_tensor **out)
{
    const norm_params *p = TP__OP_PARAMS(op, const norm_params);
    tp_tensor *x = in[0];
    int64_t rows, cols;
    rows_cols(x, &rows, &cols);
    TP_CHECK(tp__f32(op->dev, 1, &rows, false, &op->saved[0])); /* rstd */
    TP_CHECK(tp__new(op->dt, op->dev, x->ndim, x->shape, false, out));
    return op->k->rms_norm_fwd(op->dev, op->dt, tp_tensor_data(x), data_or_null(in[1]),
                               tp_tensor_data(*out), tp_tensor_data(op->saved[0]), rows, cols,
                               (float)p->eps);
}

static tp_status rms_norm_bwd(tp__op *op, tp_tensor *const *in, tp_tensor *gy, tp_tensor **g)
{
    tp_tensor *x = in[0], *gx = NULL;
    int64_t rows, cols;
    rows_cols(x, &rows, &cols);
    tp_status st = norm_grads(op, in, g, &gx);
    if (st == TP_OK)
        st = op->k->rms_norm_bwd(op->dev, op->dt, tp_tensor_data(x), data_or_null(in[1]),
                                 tp_tensor_data(op->saved[0]), tp_tensor_data(gy),
                                 tp_tensor_data(gx), grad_or_null(g, 1), rows, cols);
    tp_tensor_release(gx);
    return st;
}

static const tp__op_def rms_norm_def = {
    .name = "rms_norm",
    .n_inputs = 2,
    .input_names = {"x", "weight"},
    .optional_mask = 1u << 1,
    .dtype_kernel = TP__KOP_RMS_NORM_FWD,
    .strategies = rowwise_strategies,
    .out_shape = same_shape,
    .forward = rms_norm_fwd,
    .backward = rms_norm_bwd,
};

tp_status tp_rms_norm(tp_tensor *x, tp_tensor *weight, double eps, tp_tensor **y)
{
    TP_CHECK(norm_check(rms_norm_def.name, x, weight, NULL, eps, y));
    norm_params p = {eps};
    tp_tensor *args[2] = {x, weight};
    return tp__op_run(&rms_norm_def, args, &p, sizeof p, y);
}
