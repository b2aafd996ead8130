/* linear and matmul. */
#include <string.h>

#include "dtensor/ops_internal.h"

/* ---- linear: y = x W^T + b ------------------------------------------------- */

static int linear_strategies(const tp__op *op, int mesh_dim, tp__strategy *s)
{
    (void)mesh_dim;
    int nd = tp__op_gndim(op, 0), n = 0;
    /* colwise: the weight's rows (output features) are split */
    s[n++] = (tp__strategy){{tp__R(), tp__S(0), tp__S(0)}, tp__S(nd - 1),
                            {tp__P(), tp__S(0), tp__S(0)}};
    /* rowwise: the contraction is split, the output is a partial sum */
    s[n++] = (tp__strategy){{tp__S(nd - 1), tp__S(1), tp__R()}, tp__P(),
                            {tp__S(nd - 1), tp__S(1), tp__R()}};
    /* a batch dim is split, the weight replicated */
    for (int d = 0; d + 1 < nd; d++)
        s[n++] = (tp__strategy){{tp__S(d), tp__R(), tp__R()}, tp__S(d),
                                {tp__S(d), tp__P(), tp__P()}};
    /* linear in x: a partial input gives a partial output */
    s[n++] = (tp__strategy){{tp__P(), tp__R(), tp__R()}, tp__P(), {tp__R(), tp__P(), tp__R()}};
    s[n++] = (tp__strategy){{tp__R(), tp__R(), tp__R()}, tp__R(), {tp__R(), tp__R(), tp__R()}};
    return n;
}

/* The shape of a product of input 0 (at least 1-d) with the 2-d input 1,
 * whose dim kdim contracts with input 0's last: input 0's shape with its last
 * dim replaced by input 1's other dim. what1 describes a 2-d input 1 in the
 * message; the caller checks the contracted sizes. */
static tp_status product_shape(const tp__op *op, int kdim, const char *what1, int *ndim,
                               int64_t *shape)
{
    const char *fn = op->def->name;
    int nd = tp__op_gndim(op, 0);
    TP_ARG_CHECK(nd >= 1, "%s: %s must have at least 1 dim", fn, op->def->input_names[0]);
    TP_ARG_CHECK(tp__op_gndim(op, 1) == 2, "%s: %s must be %s, got %d dims", fn,
                 op->def->input_names[1], what1, tp__op_gndim(op, 1));
    *ndim = nd;
    memcpy(shape, tp__op_gshape(op, 0), sizeof(int64_t) * (size_t)nd);
    shape[nd - 1] = tp__op_gshape(op, 1)[1 - kdim];
    return TP_OK;
}

static tp_status linear_shape(const tp__op *op, int *ndim, int64_t *shape)
{
    const char *fn = op->def->name;
    TP_CHECK(product_shape(op, 1, "2-d [out, in]", ndim, shape));
    const int64_t *x = tp__op_gshape(op, 0), *w = tp__op_gshape(op, 1);
    TP_ARG_CHECK(x[*ndim - 1] == w[1], "%s: input has %lld features, weight expects %lld", fn,
                 (long long)x[*ndim - 1], (long long)w[1]);
    if (op->in[2])
        TP_ARG_CHECK(tp__op_gndim(op, 2) == 1 && tp__op_gshape(op, 2)[0] == w[0],
                     "%s: bias must be [%lld]", fn, (long long)w[0]);
    return TP_OK;
}

/* A new contiguous tensor of t's dtype (the op's: f32, bf16 or f16) on the
 * op's device. */
static tp_status out_like(const tp__op *op, const tp_tensor *t, int ndim, const int64_t *shape,
                          tp_tensor **out)
{
    return tp_tensor_empty(t->dtype, op->dev, ndim, shape, out);
}

/* C = A B with the op's engine (in any dtype its products take). */
static tp_status gemm(const tp__op *op, tp_dtype dtype, bool ta, bool tb, int64_t m, int64_t n,
                      int64_t k, const void *a, int64_t lda, const void *b, int64_t ldb, void *c,
                      int64_t ldc)
{
    return op->k->gemm(op->dev, dtype, ta, tb, m, n, k, 1.0f, a, lda, b, ldb, 0.0f, c, ldc);
}

static tp_status linear_fwd(tp__op *op, tp_tensor *const *in, tp_tensor **out)
{
    tp_tensor *x = in[0], *w = in[1], *b = in[2];
    int nd = x->ndim;
    int64_t shape[TP_MAX_DIMS];
    memcpy(shape, x->shape, sizeof(int64_t) * (size_t)nd);
    shape[nd - 1] = w->shape[0];
    TP_CHECK(out_like(op, x, nd, shape, out));
    /* a bias joins a partial sum once, on the leader */
    const void *bias = b && tp__op_partial_leader(op) ? tp_tensor_data(b) : NULL;
    return op->k->linear_fwd(op->dev, x->dtype, tp_tensor_data(x), tp_tensor_data(w), bias,
                             tp_tensor_data(*out), tp__rows(x), w->shape[1], w->shape[0]);
}

/* New buffers for the gradients of x, W and (with bias) b that op's
 * backward is asked for, in x's dtype on the op's device. */
static tp_status linear_grads(const tp__op *op, tp_tensor *const *in, bool bias, tp_tensor **g)
{
    tp_tensor *x = in[0];
    if (op->need_grad[0])
        TP_CHECK(out_like(op, x, x->ndim, x->shape, &g[0]));
    if (op->need_grad[1])
        TP_CHECK(out_like(op, x, 2, in[1]->shape, &g[1]));
    if (bias && op->need_grad[2])
        TP_CHECK(out_like(op, x, 1, in[2]->shape, &g[2]));
    return TP_OK;
}

typedef struct linear_gelu_params {
    tp_gelu_approx approx;
    /* set by the consumer's backward that took this op's GELU backward
     * into its product (linear_bwd): the gradient arriving is the GELU's
     * input's, and saved[1] holds the bias gradient */
    bool taken;
} linear_gelu_params;

/* The backward of a linear whose input x came out of a tp_linear_gelu that
 * expects no other gradient (tp__op_gelu_source): the product that makes
 * x's gradient applies the GELU's backward too, and sums that layer's bias
 * gradient (on CUDA one cuBLASLt product); that layer's backward then
 * starts from the GELU's input's gradient. false (nothing done) when x's
 * gradient has no such source. */
static tp_status linear_bwd_through_gelu(tp__op *op, tp_tensor *const *in, tp_tensor *gy,
                                         tp_tensor **g, bool *done)
{
    *done = false;
    tp__node *src = tp__op_gelu_source(op, 0);
    if (!src)
        return TP_OK;
    tp__op *q = src->saved;
    tp_tensor *x = in[0], *w = in[1], *aux = q->saved[0], *gb_act = NULL;
    if (aux->ndim != x->ndim || memcmp(aux->shape, x->shape, sizeof(int64_t) * (size_t)x->ndim))
        return TP_OK; /* not the layout it would be handed on in */
    linear_gelu_params *qp = TP__OP_PARAMS(q, linear_gelu_params);
    TP_CHECK(linear_grads(op, in, true, g));
    tp_tensor *qb = src->inputs[2] ? tp__tensor_local(q->in[2]) : NULL;
    if (qb)
        TP_CHECK(out_like(op, x, 1, qb->shape, &gb_act));
    tp_status st = op->k->linear_bwd_dgelu(
        op->dev, x->dtype, tp_tensor_data(x), tp_tensor_data(w), tp_tensor_data(gy),
        tp_tensor_data(aux), tp_tensor_data(g[0]), gb_act ? tp_tensor_data(gb_act) : NULL,
        g[1] ? tp_tensor_data(g[1]) : NULL, g[2] ? tp_tensor_data(g[2]) : NULL, tp__rows(x),
        w->shape[1], w->shape[0], qp->approx == TP_GELU_TANH);
    if (st != TP_OK) {
        tp_tensor_release(gb_act);
        return st;
    }
    tp_tensor_release(q->saved[1]);
    q->saved[1] = gb_act;
    qp->taken = true;
    *done = true;
    return TP_OK;
}

static tp_status linear_bwd(tp__op *op, tp_tensor *const *in, tp_tensor *gy, tp_tensor **g)
{
    tp_tensor *x = in[0], *w = in[1];
    if (op->need_grad[0]) {
        bool done = false;
        TP_CHECK(linear_bwd_through_gelu(op, in, gy, g, &done));
        if (done)
            return TP_OK;
    }
    TP_CHECK(linear_grads(op, in, true, g));
    void *gx = g[0] ? tp_tensor_data(g[0]) : NULL, *gw = g[1] ? tp_tensor_data(g[1]) : NULL,
         *gb = g[2] ? tp_tensor_data(g[2]) : NULL;
    return op->k->linear_bwd(op->dev, x->dtype, tp_tensor_data(x), tp_tensor_data(w),
                             tp_tensor_data(gy), gx, gw, gb, tp__rows(x), w->shape[1], w->shape[0],
                             false);
}

static const tp__op_def linear_def = {
    .name = "linear",
    .n_inputs = 3,
    .input_names = {"x", "weight", "bias"},
    .optional_mask = 1u << 2,
    .dtype_kernel = TP__KOP_LINEAR_FWD,
    .recompute_keep = true,
    .strategies = linear_strategies,
    .out_shape = linear_shape,
    .forward = linear_fwd,
    .backward = linear_bwd,
};

tp_status tp_linear(tp_tensor *x, tp_tensor *w, tp_tensor *b, tp_tensor **y)
{
    tp_tensor *args[3] = {x, w, b};
    return tp__op_run(&linear_def, args, NULL, 0, y);
}

/* ---- linear + GELU: y = gelu(x W^T + b) -------------------------------------- */

/* linear's strategies whose output is not a partial sum (a GELU of partial
 * sums is not the GELU of their total): colwise, a batch dim split, and
 * everything replicated. */
static int linear_gelu_strategies(const tp__op *op, int mesh_dim, tp__strategy *s)
{
    int n = linear_strategies(op, mesh_dim, s), kept = 0;
    for (int i = 0; i < n; i++)
        if (s[i].out.kind != TP_PLACEMENT_PARTIAL)
            s[kept++] = s[i];
    return kept;
}

static tp_status linear_gelu_fwd(tp__op *op, tp_tensor *const *in, tp_tensor **out)
{
    tp_tensor *x = in[0], *w = in[1], *b = in[2];
    bool tanh_approx = TP__OP_PARAMS(op, linear_gelu_params)->approx == TP_GELU_TANH;
    int nd = x->ndim;
    int64_t shape[TP_MAX_DIMS];
    memcpy(shape, x->shape, sizeof(int64_t) * (size_t)nd);
    shape[nd - 1] = w->shape[0];
    TP_CHECK(out_like(op, x, nd, shape, out));
    /* the pre-activation is kept for a backward only (op->in: the inputs
     * the node will hold, whose autograd state says whether it is recorded),
     * and for the one that replays this forward from a selective
     * recomputation's stash (recorded under no-grad) */
    if (tp__needs_grad(3, op->in) || tp__stash_active())
        TP_CHECK(out_like(op, x, nd, shape, &op->saved[0]));
    return op->k->linear_gelu_fwd(op->dev, x->dtype, tp_tensor_data(x), tp_tensor_data(w),
                                  b ? tp_tensor_data(b) : NULL, tp_tensor_data(*out),
                                  op->saved[0] ? tp_tensor_data(op->saved[0]) : NULL, tp__rows(x),
                                  w->shape[1], w->shape[0], tanh_approx);
}

static tp_status linear_gelu_bwd(tp__op *op, tp_tensor *const *in, tp_tensor *gy, tp_tensor **g)
{
    tp_tensor *x = in[0], *w = in[1], *aux = op->saved[0], *gz = NULL;
    TP_ASSERT(aux);
    const linear_gelu_params *p = TP__OP_PARAMS(op, linear_gelu_params);
    bool tanh_approx = p->approx == TP_GELU_TANH;
    if (p->taken) {
        /* the consumer's product applied the GELU's backward: gy is the
         * pre-activation's gradient, saved[1] the bias gradient */
        if (op->need_grad[2])
            g[2] = tp_tensor_retain(op->saved[1]);
        TP_CHECK(linear_grads(op, in, false, g));
        return op->k->linear_bwd(op->dev, x->dtype, tp_tensor_data(x), tp_tensor_data(w),
                                 tp_tensor_data(gy), g[0] ? tp_tensor_data(g[0]) : NULL,
                                 g[1] ? tp_tensor_data(g[1]) : NULL, NULL, tp__rows(x),
                                 w->shape[1], w->shape[0], false);
    }
    TP_CHECK(linear_grads(op, in, true, g));
    TP_CHECK(out_like(op, x, aux->ndim, aux->shape, &gz));
    void *gx = g[0] ? tp_tensor_data(g[0]) : NULL, *gw = g[1] ? tp_tensor_data(g[1]) : NULL,
         *gb = g[2] ? tp_tensor_data(g[2]) : NULL;
    tp_status st = op->k->linear_gelu_bwd(
        op->dev, x->dtype, tp_tensor_data(x), tp_tensor_data(w), tp_tensor_data(aux),
        tp_tensor_data(gy), tp_tensor_data(gz), gx, gw, gb, tp__rows(x), w->shape[1],
        w->shape[0], tanh_approx);
    tp_tensor_release(gz);
    return st;
}

static const tp__op_def linear_gelu_def = {
    .name = "linear_gelu",
    .n_inputs = 3,
    .input_names = {"x", "weight", "bias"},
    .optional_mask = 1u << 2,
    .dtype_kernel = TP__KOP_LINEAR_GELU_FWD,
    .recompute_keep = true,
    .gelu_output = true,
    .strategies = linear_gelu_strategies,
    .out_shape = linear_shape,
    .forward = linear_gelu_fwd,
    .backward = linear_gelu_bwd,
};

tp_status tp_linear_gelu(tp_tensor *x, tp_tensor *w, tp_tensor *b, tp_gelu_approx approx,
                         tp_tensor **y)
{
    TP_ARG_CHECK(y, "linear_gelu: out is NULL");
    *y = NULL;
    TP_ARG_CHECK(approx == TP_GELU_EXACT || approx == TP_GELU_TANH,
                 "linear_gelu: approx %d is neither TP_GELU_EXACT nor TP_GELU_TANH", (int)approx);
    tp_tensor *args[3] = {x, w, b};
    linear_gelu_params p = {approx, false};
    return tp__op_run(&linear_gelu_def, args, &p, sizeof p, y);
}

/* ---- matmul: y = a b, b 2-D ----------------------------------------------- */

static int matmul_strategies(const tp__op *op, int mesh_dim, tp__strategy *s)
{
    (void)mesh_dim;
    int nd = tp__op_gndim(op, 0), n = 0;
    s[n++] = (tp__strategy){{tp__R(), tp__S(1)}, tp__S(nd - 1), {tp__P(), tp__S(1)}};
    s[n++] = (tp__strategy){{tp__S(nd - 1), tp__S(0)}, tp__P(), {tp__S(nd - 1), tp__S(0)}};
    for (int d = 0; d + 1 < nd; d++)
        s[n++] = (tp__strategy){{tp__S(d), tp__R()}, tp__S(d), {tp__S(d), tp__P()}};
    s[n++] = (tp__strategy){{tp__P(), tp__R()}, tp__P(), {tp__R(), tp__P()}};
    s[n++] = (tp__strategy){{tp__R(), tp__R()}, tp__R(), {tp__R(), tp__R()}};
    return n;
}

static tp_status matmul_shape(const tp__op *op, int *ndim, int64_t *shape)
{
    TP_CHECK(product_shape(op, 0, "2-d", ndim, shape));
    const int64_t *a = tp__op_gshape(op, 0), *b = tp__op_gshape(op, 1);
    TP_ARG_CHECK(a[*ndim - 1] == b[0], "%s: a has %lld columns but b has %lld rows",
                 op->def->name, (long long)a[*ndim - 1], (long long)b[0]);
    return TP_OK;
}

static tp_status matmul_fwd(tp__op *op, tp_tensor *const *in, tp_tensor **out)
{
    tp_tensor *a = in[0], *b = in[1];
    int nd = a->ndim;
    int64_t shape[TP_MAX_DIMS], m = tp__rows(a), k = b->shape[0], n = b->shape[1];
    memcpy(shape, a->shape, sizeof(int64_t) * (size_t)nd);
    shape[nd - 1] = n;
    TP_CHECK(out_like(op, a, nd, shape, out));
    return gemm(op, a->dtype, false, false, m, n, k, tp_tensor_data(a), k, tp_tensor_data(b), n,
                tp_tensor_data(*out), n);
}

static tp_status matmul_bwd(tp__op *op, tp_tensor *const *in, tp_tensor *gy, tp_tensor **g)
{
    tp_tensor *a = in[0], *b = in[1];
    int64_t m = tp__rows(a), k = b->shape[0], n = b->shape[1];
    if (op->need_grad[0]) { /* ga = gy b^T */
        TP_CHECK(out_like(op, a, a->ndim, a->shape, &g[0]));
        TP_CHECK(gemm(op, a->dtype, false, true, m, k, n, tp_tensor_data(gy), n,
                      tp_tensor_data(b), n, tp_tensor_data(g[0]), k));
    }
    if (op->need_grad[1]) { /* gb = a^T gy */
        TP_CHECK(out_like(op, a, 2, b->shape, &g[1]));
        TP_CHECK(gemm(op, a->dtype, true, false, k, n, m, tp_tensor_data(a), k,
                      tp_tensor_data(gy), n, tp_tensor_data(g[1]), n));
    }
    return TP_OK;
}

static const tp__op_def matmul_def = {
    .name = "matmul",
    .n_inputs = 2,
    .input_names = {"a", "b"},
    .dtype_kernel = TP__KOP_GEMM,
    .recompute_keep = true,
    .strategies = matmul_strategies,
    .out_shape = matmul_shape,
    .forward = matmul_fwd,
    .backward = matmul_bwd,
};

tp_status tp_matmul(tp_tensor *a, tp_tensor *b, tp_tensor **y)
{
    tp_tensor *args[2] = {a, b};
    return tp__op_run(&matmul_def, args, NULL, 0, y);
}
