/* Elementwise ops: add, mul, scale, relu, gelu, dropout, silu, swiglu (the view ops are in
 * ops_view.c). Each is a tp__op_def (see ops_internal.h); the dispatcher picks
 * the strategy per mesh dim, redistributes, records the node and wraps the
 * local gradients in the strategy's grad placements. */
#include <string.h>

#include "dtensor/ops_internal.h"

/* ---- shared helpers -------------------------------------------------------- */

/* The placement of input i on mesh dim d as the caller passed it. */
static tp_placement arg_placement(const tp__op *op, int i, int d)
{
    return tp_dtensor_placements(op->arg[i])[d];
}

/* Whether input i's local value contributes to this rank's term of the
 * output: an operand that is not Partial on a mesh dim where the output is
 * Partial joins the partial sum once, on coordinate 0 of that dim. Plain
 * tensors always contribute. */
static bool contributes(const tp__op *op, int i)
{
    if (!op->distributed)
        return true;
    for (int d = 0; d < op->mesh_ndim; d++)
        if (op->out_pl[d].kind == TP_PLACEMENT_PARTIAL &&
            op->in_pl[i][d].kind != TP_PLACEMENT_PARTIAL && tp_mesh_coord(op->mesh, d) != 0)
            return false;
    return true;
}

/* A new contiguous tensor with t's dtype and shape, on t's device. */
static tp_status like(const tp_tensor *t, bool zero, tp_tensor **out)
{
    return tp__new(t->dtype, tp_tensor_device(t), t->ndim, t->shape, zero, out);
}

/* Strategies of an op that maps every element independently (Shard(d) and
 * Replicate pass through). partial: the op commutes with the input's Partial
 * reduction, so Partial(op) passes through too (the output is `pout` when that
 * is a Partial, else the input's Partial); its gradient is Replicate. */
static int unary_strategies(const tp__op *op, int mesh_dim, bool partial, tp_placement pout,
                            tp__strategy *s)
{
    int nd = tp__op_gndim(op, 0), n = 0;
    for (int d = 0; d < nd && n + 2 < TP__OP_MAX_STRATS; d++)
        s[n++] = (tp__strategy){{tp__S(d)}, tp__S(d), {tp__S(d)}};
    s[n++] = (tp__strategy){{tp__R()}, tp__R(), {tp__R()}};
    if (partial) {
        tp_placement cur = arg_placement(op, 0, mesh_dim);
        tp_placement pin = cur.kind == TP_PLACEMENT_PARTIAL ? cur : tp__P();
        if (pout.kind != TP_PLACEMENT_PARTIAL)
            pout = pin;
        s[n++] = (tp__strategy){{pin}, pout, {tp__R()}};
    }
    return n;
}

static tp_status same_shape(const tp__op *op, int *ndim, int64_t *shape)
{
    *ndim = tp__op_gndim(op, 0);
    memcpy(shape, tp__op_gshape(op, 0), sizeof(int64_t) * (size_t)*ndim);
    return TP_OK;
}

/* ---- add and mul ------------------------------------------------------------
 * NumPy broadcasting: the shapes align on the right, and a dim an operand
 * lacks or has with size 1 stretches to the other's size. Sharding follows
 * PyTorch's pointwise rule: the output sharded on dim d takes every operand
 * that has d (with the output's size) sharded on its matching dim and every
 * operand broadcast along d replicated; that operand's gradient, a sum over
 * the sharded dim, is then a partial sum. */

typedef struct {
    bool mul;
} binary_params;

/* The broadcast of shapes a and b into y (*ndy dims), or TP_ERR_INVALID_ARG
 * naming both shapes and the first dim (from the right) where they clash. */
static tp_status broadcast_shapes(const char *fn, int nda, const int64_t *a, int ndb,
                                  const int64_t *b, int *ndy, int64_t *y)
{
    int nd = nda > ndb ? nda : ndb;
    for (int k = 1; k <= nd; k++) {
        int64_t sa = k <= nda ? a[nda - k] : 1, sb = k <= ndb ? b[ndb - k] : 1;
        if (sa != sb && sa != 1 && sb != 1) {
            char s1[128], s2[128];
            return tp__error(TP_ERR_INVALID_ARG,
                             "%s: a of shape %s and b of shape %s do not broadcast: dim %d is "
                             "%lld in a but %lld in b",
                             fn, tp__shape_str(nda, a, s1, sizeof s1),
                             tp__shape_str(ndb, b, s2, sizeof s2), -k, (long long)sa,
                             (long long)sb);
        }
        y[nd - k] = sa == 1 ? sb : sa;
    }
    *ndy = nd;
    return TP_OK;
}

/* The dim of an operand (nd dims of shape) that output dim d (of ndy dims of
 * y) reads along, or -1 where the operand is broadcast (lacks d, or has size
 * 1 where the output does not). */
static int operand_dim(int ndy, const int64_t *y, int nd, const int64_t *shape, int d)
{
    int k = d - (ndy - nd);
    return k >= 0 && shape[k] == y[d] ? k : -1;
}

static int binary_strategies(const tp__op *op, int mesh_dim, tp__strategy *s)
{
    (void)mesh_dim;
    bool mul = TP__OP_PARAMS(op, binary_params)->mul;
    int ndy = 0, n = 0;
    int64_t y[TP_MAX_DIMS];
    if (broadcast_shapes(op->def->name, tp__op_gndim(op, 0), tp__op_gshape(op, 0),
                         tp__op_gndim(op, 1), tp__op_gshape(op, 1), &ndy, y) != TP_OK)
        return 0; /* binary_run checked the shapes already */
    const tp_placement R = tp__R(), P = tp__P();
    for (int d = 0; d < ndy; d++) {
        tp__strategy t = {.out = tp__S(d)};
        for (int i = 0; i < 2; i++) {
            int k = operand_dim(ndy, y, tp__op_gndim(op, i), tp__op_gshape(op, i), d);
            t.in[i] = k >= 0 ? tp__S(k) : R;
            /* a broadcast operand's gradient sums gy over the sharded dim */
            t.grad[i] = k >= 0 ? tp__S(k) : P;
        }
        s[n++] = t;
    }
    s[n++] = (tp__strategy){{R, R}, R, {R, R}};
    if (mul) {
        /* linear in each operand: one Partial factor, the other Replicate */
        s[n++] = (tp__strategy){{P, R}, P, {R, P}};
        s[n++] = (tp__strategy){{R, P}, P, {P, R}};
    } else {
        s[n++] = (tp__strategy){{P, P}, P, {R, R}};
        /* the Replicate operand joins the partial sum once, on the leader */
        s[n++] = (tp__strategy){{P, R}, P, {R, R}};
        s[n++] = (tp__strategy){{R, P}, P, {R, R}};
    }
    TP_ASSERT(n <= TP__OP_MAX_STRATS);
    return n;
}

static tp_status binary_shape(const tp__op *op, int *ndim, int64_t *shape)
{
    return broadcast_shapes(op->def->name, tp__op_gndim(op, 0), tp__op_gshape(op, 0),
                            tp__op_gndim(op, 1), tp__op_gshape(op, 1), ndim, shape);
}

/* The local output shape: the broadcast of the local operands (a dim the
 * output is sharded on has the same local size in every operand that has
 * it; the others are broadcast there). */
static tp_status local_shape(const tp__op *op, const tp_tensor *a, const tp_tensor *b, int *nd,
                             int64_t *shape)
{
    return broadcast_shapes(op->def->name, a->ndim, a->shape, b->ndim, b->shape, nd, shape);
}

static bool has_shape(const tp_tensor *t, int nd, const int64_t *shape)
{
    return t->ndim == nd && !memcmp(t->shape, shape, sizeof(int64_t) * (size_t)nd);
}

/* Element strides of t read over an output of nd dims of `shape`: t's own
 * strides, 0 along the dims t is broadcast over. */
static void bcast_strides(const tp_tensor *t, int nd, const int64_t *shape, int64_t *st)
{
    for (int d = 0; d < nd; d++) {
        int k = operand_dim(nd, shape, t->ndim, t->shape, d);
        st[d] = k >= 0 && shape[d] != 1 ? t->stride[k] : 0;
    }
}

/* Drops size-1 dims and merges each dim into the one before it where both
 * stride arrays step across them as one dim (contiguous, or both
 * broadcast), so that the kernels see as few and as long runs as possible.
 * Returns the new dim count. */
static int collapse_dims(int nd, int64_t *shape, int64_t *s0, int64_t *s1)
{
    int m = 0;
    for (int d = 0; d < nd; d++) {
        if (shape[d] == 1)
            continue;
        if (m > 0 && s0[m - 1] == s0[d] * shape[d] && s1[m - 1] == s1[d] * shape[d]) {
            shape[m - 1] *= shape[d];
            s0[m - 1] = s0[d];
            s1[m - 1] = s1[d];
            continue;
        }
        shape[m] = shape[d];
        s0[m] = s0[d];
        s1[m] = s1[d];
        m++;
    }
    return m;
}

/* y (contiguous, nd dims of shape) = a + b or a * b with broadcasting; a and
 * b may be strided views. */
static tp_status bcast_apply(const tp__op *op, bool mul, const tp_tensor *a, const tp_tensor *b,
                             int nd, const int64_t *shape, void *y)
{
    const tp__kernels *k = op->k;
    const void *pa = tp_tensor_data(a), *pb = tp_tensor_data(b);
    if (has_shape(a, nd, shape) && has_shape(b, nd, shape) && tp_tensor_is_contiguous(a) &&
        tp_tensor_is_contiguous(b)) {
        int64_t n = tp_tensor_numel(a);
        return (mul ? k->mul : k->add)(op->dev, op->dt, pa, pb, y, n);
    }
    int64_t sh[TP_MAX_DIMS], sa[TP_MAX_DIMS], sb[TP_MAX_DIMS];
    memcpy(sh, shape, sizeof(int64_t) * (size_t)nd);
    bcast_strides(a, nd, shape, sa);
    bcast_strides(b, nd, shape, sb);
    int m = collapse_dims(nd, sh, sa, sb);
    return (mul ? k->mul_bcast : k->add_bcast)(op->dev, op->dt, pa, pb, y, m, sh, sa, sb);
}

/* g (contiguous, t's shape) = x (contiguous, nd dims of shape) summed over
 * the dims t is broadcast along. */
static tp_status sum_to(const tp__op *op, const tp_tensor *x, int nd, const int64_t *shape,
                        const tp_tensor *t, void *g)
{
    const void *px = tp_tensor_data(x);
    if (has_shape(t, nd, shape))
        return op->k->copy(op->dev, op->dt, g, px, tp_tensor_numel(x));
    /* strides of x and of a contiguous g (0 where summed), merged as in the
     * forward; the merged g shape is 1 where the strides say summed */
    int64_t sh[TP_MAX_DIMS], sx[TP_MAX_DIMS], sg[TP_MAX_DIMS], gshape[TP_MAX_DIMS];
    int64_t stx = 1, stg = 1;
    for (int d = nd - 1; d >= 0; d--) {
        int k = operand_dim(nd, shape, t->ndim, t->shape, d);
        sh[d] = shape[d];
        sx[d] = stx;
        stx *= shape[d];
        sg[d] = k >= 0 ? stg : 0;
        stg *= k >= 0 ? shape[d] : 1;
    }
    int m = collapse_dims(nd, sh, sx, sg);
    for (int d = 0; d < m; d++)
        gshape[d] = sg[d] == 0 ? 1 : sh[d];
    return op->k->sum_bcast(op->dev, op->dt, px, g, m, sh, gshape);
}

static tp_status binary_fwd(tp__op *op, tp_tensor *const *in, tp_tensor **out)
{
    bool mul = TP__OP_PARAMS(op, binary_params)->mul;
    tp_tensor *a = in[0], *b = in[1];
    int nd;
    int64_t shape[TP_MAX_DIMS];
    TP_CHECK(local_shape(op, a, b, &nd, shape));
    bool ca = mul || contributes(op, 0), cb = mul || contributes(op, 1);
    /* add on a rank where one operand (or none) joins the partial sum: that
     * operand alone, broadcast onto zeros unless it has the output's shape */
    tp_tensor *only = ca == cb ? NULL : ca ? a : b;
    bool copy = only && has_shape(only, nd, shape) && tp_tensor_is_contiguous(only);
    TP_CHECK(tp__new(op->dt, op->dev, nd, shape, !(ca && cb) && !copy, out));
    void *y = tp_tensor_data(*out);
    if (ca && cb)
        return bcast_apply(op, mul, a, b, nd, shape, y);
    if (copy)
        return tp__op_copy(op->dev, op->dt, y, tp_tensor_data(only), tp_tensor_numel(only));
    if (only)
        return bcast_apply(op, false, *out, only, nd, shape, y);
    return TP_OK;
}

/* gy * other broadcast, summed to t's shape, into g. */
static tp_status mul_grad(tp__op *op, tp_tensor *gy, tp_tensor *other, const tp_tensor *t, int nd,
                          const int64_t *shape, void *g)
{
    if (has_shape(t, nd, shape))
        return bcast_apply(op, true, gy, other, nd, shape, g);
    tp_tensor *prod = NULL;
    TP_CHECK(like(gy, false, &prod));
    tp_status st = bcast_apply(op, true, gy, other, nd, shape, tp_tensor_data(prod));
    if (st == TP_OK)
        st = sum_to(op, prod, nd, shape, t, g);
    tp_tensor_release(prod);
    return st;
}

/* add: g_a = gy, g_b = gy; mul: g_a = gy * b, g_b = gy * a; each summed over
 * the dims its operand was broadcast along. */
static tp_status binary_bwd(tp__op *op, tp_tensor *const *in, tp_tensor *gy, tp_tensor **g)
{
    bool mul = TP__OP_PARAMS(op, binary_params)->mul;
    int nd;
    int64_t shape[TP_MAX_DIMS];
    TP_CHECK(local_shape(op, in[0], in[1], &nd, shape));
    TP_ASSERT(has_shape(gy, nd, shape));
    for (int i = 0; i < 2; i++) {
        if (!op->need_grad[i])
            continue;
        TP_CHECK(like(in[i], false, &g[i]));
        void *gi = tp_tensor_data(g[i]);
        if (mul)
            TP_CHECK(mul_grad(op, gy, in[1 - i], in[i], nd, shape, gi));
        else
            TP_CHECK(sum_to(op, gy, nd, shape, in[i], gi));
    }
    return TP_OK;
}

/* add and mul share everything but the name (the params say which) */
#define BINARY_DEF(n, kop)                                                              \
    {                                                                                   \
        .name = n, .n_inputs = 2, .input_names = {"a", "b"}, .dtype_kernel = kop,       \
        .strided_ok = true, .strategies = binary_strategies, .out_shape = binary_shape, \
        .forward = binary_fwd, .backward = binary_bwd,                                  \
    }

static const tp__op_def add_def = BINARY_DEF("add", TP__KOP_ADD_BCAST);
static const tp__op_def mul_def = BINARY_DEF("mul", TP__KOP_MUL_BCAST);

static tp_status binary_run(const tp__op_def *def, bool mul, tp_tensor *a, tp_tensor *b,
                            tp_tensor **y)
{
    TP_ARG_CHECK(y, "%s: out is NULL", def->name);
    *y = NULL;
    /* shapes first, so that a mismatch fails before any redistribution */
    if (a && b) {
        int nd;
        int64_t shape[TP_MAX_DIMS];
        TP_CHECK(broadcast_shapes(def->name, tp_tensor_ndim(a), tp_tensor_shape(a),
                                  tp_tensor_ndim(b), tp_tensor_shape(b), &nd, shape));
    }
    tp_tensor *args[2] = {a, b};
    binary_params p = {mul};
    return tp__op_run(def, args, &p, sizeof p, y);
}

tp_status tp_add(tp_tensor *a, tp_tensor *b, tp_tensor **y)
{
    return binary_run(&add_def, false, a, b, y);
}

tp_status tp_mul(tp_tensor *a, tp_tensor *b, tp_tensor **y)
{
    return binary_run(&mul_def, true, a, b, y);
}

/* ---- scale ----------------------------------------------------------------- */

typedef struct {
    double s;
} scale_params;

static int scale_strategies(const tp__op *op, int mesh_dim, tp__strategy *s)
{
    double k = TP__OP_PARAMS(op, scale_params)->s;
    tp_placement cur = arg_placement(op, 0, mesh_dim), pout = tp_replicate();
    /* a negative factor turns a partial max into a partial min and back */
    if (cur.kind == TP_PLACEMENT_PARTIAL && k < 0 && (cur.op == TP_MAX || cur.op == TP_MIN))
        pout = tp_partial(cur.op == TP_MAX ? TP_MIN : TP_MAX);
    return unary_strategies(op, mesh_dim, true, pout, s);
}

static tp_status scale_fwd(tp__op *op, tp_tensor *const *in, tp_tensor **out)
{
    TP_CHECK(like(in[0], false, out));
    return op->k->scale(op->dev, op->dt, tp_tensor_data(in[0]),
                        (float)TP__OP_PARAMS(op, scale_params)->s, tp_tensor_data(*out),
                        tp_tensor_numel(in[0]));
}

static tp_status scale_bwd(tp__op *op, tp_tensor *const *in, tp_tensor *gy, tp_tensor **g)
{
    if (!op->need_grad[0])
        return TP_OK;
    TP_CHECK(like(in[0], false, &g[0]));
    return op->k->scale(op->dev, op->dt, tp_tensor_data(gy),
                        (float)TP__OP_PARAMS(op, scale_params)->s, tp_tensor_data(g[0]),
                        tp_tensor_numel(in[0]));
}

static const tp__op_def scale_def = {
    .name = "scale",
    .n_inputs = 1,
    .input_names = {"x"},
    .dtype_kernel = TP__KOP_SCALE,
    .strategies = scale_strategies,
    .out_shape = same_shape,
    .forward = scale_fwd,
    .backward = scale_bwd,
};

tp_status tp_scale(tp_tensor *x, double s, tp_tensor **y)
{
    tp_tensor *args[1] = {x};
    scale_params p = {s};
    return tp__op_run(&scale_def, args, &p, sizeof p, y);
}

/* ---- relu and gelu ---------------------------------------------------------- */

static int pointwise_strategies(const tp__op *op, int mesh_dim, tp__strategy *s)
{
    return unary_strategies(op, mesh_dim, false, tp_replicate(), s);
}

static tp_status relu_fwd(tp__op *op, tp_tensor *const *in, tp_tensor **out)
{
    (void)op;
    TP_CHECK(like(in[0], false, out));
    return op->k->relu_fwd(op->dev, op->dt, tp_tensor_data(in[0]), tp_tensor_data(*out),
                           tp_tensor_numel(in[0]));
}

static tp_status relu_bwd(tp__op *op, tp_tensor *const *in, tp_tensor *gy, tp_tensor **g)
{
    if (!op->need_grad[0])
        return TP_OK;
    TP_CHECK(like(in[0], false, &g[0]));
    return op->k->relu_bwd(op->dev, op->dt, tp_tensor_data(in[0]), tp_tensor_data(gy),
                           tp_tensor_data(g[0]), tp_tensor_numel(in[0]));
}

static const tp__op_def relu_def = {
    .name = "relu",
    .n_inputs = 1,
    .input_names = {"x"},
    .dtype_kernel = TP__KOP_RELU_FWD,
    .strategies = pointwise_strategies,
    .out_shape = same_shape,
    .forward = relu_fwd,
    .backward = relu_bwd,
};

tp_status tp_relu(tp_tensor *x, tp_tensor **y)
{
    tp_tensor *args[1] = {x};
    return tp__op_run(&relu_def, args, NULL, 0, y);
}

typedef struct {
    bool tanh_approx;
} gelu_params;

static tp_status gelu_fwd(tp__op *op, tp_tensor *const *in, tp_tensor **out)
{
    TP_CHECK(like(in[0], false, out));
    return op->k->gelu_fwd(op->dev, op->dt, tp_tensor_data(in[0]), tp_tensor_data(*out),
                           tp_tensor_numel(in[0]), TP__OP_PARAMS(op, gelu_params)->tanh_approx);
}

static tp_status gelu_bwd(tp__op *op, tp_tensor *const *in, tp_tensor *gy, tp_tensor **g)
{
    if (!op->need_grad[0])
        return TP_OK;
    TP_CHECK(like(in[0], false, &g[0]));
    return op->k->gelu_bwd(op->dev, op->dt, tp_tensor_data(in[0]), tp_tensor_data(gy),
                           tp_tensor_data(g[0]), tp_tensor_numel(in[0]),
                           TP__OP_PARAMS(op, gelu_params)->tanh_approx);
}

static const tp__op_def gelu_def = {
    .name = "gelu",
    .n_inputs = 1,
    .input_names = {"x"},
    .dtype_kernel = TP__KOP_GELU_FWD,
    .strategies = pointwise_strategies,
    .out_shape = same_shape,
    .forward = gelu_fwd,
    .backward = gelu_bwd,
};

tp_status tp_gelu(tp_tensor *x, tp_gelu_approx approx, tp_tensor **y)
{
    TP_ARG_CHECK(y, "gelu: out is NULL");
    *y = NULL;
    TP_ARG_CHECK(approx == TP_GELU_EXACT || approx == TP_GELU_TANH,
                 "gelu: approx %d is neither TP_GELU_EXACT nor TP_GELU_TANH", (int)approx);
    tp_tensor *args[1] = {x};
    gelu_params p = {approx == TP_GELU_TANH};
    return tp__op_run(&gelu_def, args, &p, sizeof p, y);
}

/* ---- dropout ------------------------------------------------------------------
 * The keep mask comes from the counter-based RNG at the element's global index,
 * so each rank draws exactly its shard's part of the single-rank mask. The
 * backward reuses the mask the forward saved (1 byte per element, kept in an
 * i32 tensor of ceil(n/4) elements: there is no byte dtype). */

typedef struct {
    float p; /* effective probability: 0 when not training */
    uint64_t seed;
} dropout_params;

static int dropout_strategies(const tp__op *op, int mesh_dim, tp__strategy *s)
{
    /* the identity is linear: a Partial input then passes through */
    bool identity = TP__OP_PARAMS(op, dropout_params)->p <= 0.0f;
    return unary_strategies(op, mesh_dim, identity, tp_replicate(), s);
}

static tp_status dropout_fwd(tp__op *op, tp_tensor *const *in, tp_tensor **out)
{
    const dropout_params *prm = TP__OP_PARAMS(op, dropout_params);
    tp_tensor *x = in[0];
    int64_t n = tp_tensor_numel(x);
    TP_CHECK(like(x, false, out));
    if (prm->p <= 0.0f)
        return tp__op_copy(op->dev, op->dt, tp_tensor_data(*out), tp_tensor_data(x), n);
    uint8_t *mask = NULL;
    if (tp__needs_grad(1, op->in) && n > 0) {
        int64_t words = (n + 3) / 4;
        TP_CHECK(tp_tensor_empty(TP_I32, op->dev, 1, &words, &op->saved[0]));
        mask = tp_tensor_data(op->saved[0]);
    }
    int64_t offset[TP_MAX_DIMS];
    tp__op_offset(op, 0, offset);
    return op->k->dropout_fwd(op->dev, op->dt, tp_tensor_data(x), tp_tensor_data(*out), mask,
                              x->ndim, x->shape, tp__op_gshape(op, 0), offset, prm->p, prm->seed);
}

static tp_status dropout_bwd(tp__op *op, tp_tensor *const *in, tp_tensor *gy, tp_tensor **g)
{
    if (!op->need_grad[0])
        return TP_OK;
    const dropout_params *prm = TP__OP_PARAMS(op, dropout_params);
    int64_t n = tp_tensor_numel(in[0]);
    TP_CHECK(like(in[0], false, &g[0]));
    if (prm->p <= 0.0f || n == 0)
        return tp__op_copy(op->dev, op->dt, tp_tensor_data(g[0]), tp_tensor_data(gy), n);
    TP_ASSERT(op->saved[0]);
    return op->k->dropout_bwd(op->dev, op->dt, tp_tensor_data(gy), tp_tensor_data(op->saved[0]),
                              tp_tensor_data(g[0]), n, prm->p);
}

static const tp__op_def dropout_def = {
    .name = "dropout",
    .n_inputs = 1,
    .input_names = {"x"},
    .dtype_kernel = TP__KOP_DROPOUT_FWD,
    .strategies = dropout_strategies,
    .out_shape = same_shape,
    .forward = dropout_fwd,
    .backward = dropout_bwd,
};

tp_status tp_dropout(tp_tensor *x, double p, uint64_t seed, bool training, tp_tensor **y)
{
    TP_ARG_CHECK(y, "dropout: out is NULL");
    *y = NULL;
    /* checked even when not training: a bad p is a bug either way */
    TP_ARG_CHECK(p >= 0.0 && p < 1.0 && (float)p < 1.0f,
                 "dropout: p = %g is outside [0, 1)", p);
    tp_tensor *args[1] = {x};
    dropout_params prm = {training ? (float)p : 0.0f, seed};
    return tp__op_run(&dropout_def, args, &prm, sizeof prm, y);
}

/* ---- silu and swiglu ------------------------------------------------------------
 * The Llama/Mistral/Qwen2 MLP: down_proj(silu(gate_proj(x)) * up_proj(x)).
 * swiglu fuses silu(gate) * up into one kernel forward and one backward that
 * writes both gradients. Neither commutes with a Partial reduction (silu is not
 * linear; swiglu is linear in up alone, which a Partial up could use, but its
 * output would then be Partial before down_proj's rowwise input wants S(-1)), so
 * Partial inputs are reduced first, as gelu's are. */

static tp_status silu_fwd(tp__op *op, tp_tensor *const *in, tp_tensor **out)
{
    TP_CHECK(like(in[0], false, out));
    return op->k->silu_fwd(op->dev, op->dt, tp_tensor_data(in[0]), tp_tensor_data(*out),
                           tp_tensor_numel(in[0]));
}

static tp_status silu_bwd(tp__op *op, tp_tensor *const *in, tp_tensor *gy, tp_tensor **g)
{
    if (!op->need_grad[0])
        return TP_OK;
    TP_CHECK(like(in[0], false, &g[0]));
    return op->k->silu_bwd(op->dev, op->dt, tp_tensor_data(in[0]), tp_tensor_data(gy),
                           tp_tensor_data(g[0]), tp_tensor_numel(in[0]));
}

static const tp__op_def silu_def = {
    .name = "silu",
    .n_inputs = 1,
    .input_names = {"x"},
    .dtype_kernel = TP__KOP_SILU_FWD,
    .strategies = pointwise_strategies,
    .out_shape = same_shape,
    .forward = silu_fwd,
    .backward = silu_bwd,
};

tp_status tp_silu(tp_tensor *x, tp_tensor **y)
{
    tp_tensor *args[1] = {x};
    return tp__op_run(&silu_def, args, NULL, 0, y);
}

/* gate and up with one placement: Shard(d) for every dim d, or Replicate;
 * their gradients keep it. Inputs that differ move to the cheapest of these
 * (a Replicate operand is chunked locally to the other's shard). */
static int swiglu_strategies(const tp__op *op, int mesh_dim, tp__strategy *s)
{
    (void)mesh_dim;
    int nd = tp__op_gndim(op, 0), n = 0;
    for (int d = 0; d < nd && n + 1 < TP__OP_MAX_STRATS; d++)
        s[n++] = (tp__strategy){{tp__S(d), tp__S(d)}, tp__S(d), {tp__S(d), tp__S(d)}};
    s[n++] = (tp__strategy){{tp__R(), tp__R()}, tp__R(), {tp__R(), tp__R()}};
    return n;
}

static tp_status swiglu_fwd(tp__op *op, tp_tensor *const *in, tp_tensor **out)
{
    TP_ASSERT(has_shape(in[1], in[0]->ndim, in[0]->shape));
    TP_CHECK(like(in[0], false, out));
    return op->k->swiglu_fwd(op->dev, op->dt, tp_tensor_data(in[0]), tp_tensor_data(in[1]),
                             tp_tensor_data(*out), tp_tensor_numel(in[0]));
}

static tp_status swiglu_bwd(tp__op *op, tp_tensor *const *in, tp_tensor *gy, tp_tensor **g)
{
    for (int i = 0; i < 2; i++)
        if (op->need_grad[i])
            TP_CHECK(like(in[i], false, &g[i]));
    if (!g[0] && !g[1])
        return TP_OK;
    return op->k->swiglu_bwd(op->dev, op->dt, tp_tensor_data(in[0]), tp_tensor_data(in[1]),
                             tp_tensor_data(gy), g[0] ? tp_tensor_data(g[0]) : NULL,
                             g[1] ? tp_tensor_data(g[1]) : NULL, tp_tensor_numel(in[0]));
}

static const tp__op_def swiglu_def = {
    .name = "swiglu",
    .n_inputs = 2,
    .input_names = {"gate", "up"},
    .dtype_kernel = TP__KOP_SWIGLU_FWD,
    .strategies = swiglu_strategies,
    .out_shape = same_shape,
    .forward = swiglu_fwd,
    .backward = swiglu_bwd,
};

tp_status tp_swiglu(tp_tensor *gate, tp_tensor *up, tp_tensor **y)
{
    TP_ARG_CHECK(y, "swiglu: out is NULL");
    *y = NULL;
    /* shapes first, so that a mismatch fails before any redistribution */
    if (gate && up && !has_shape(up, gate->ndim, gate->shape)) {
        char s1[128], s2[128];
        return tp__error(TP_ERR_INVALID_ARG,
                         "swiglu: gate of shape %s and up of shape %s differ (swiglu does not "
                         "broadcast)",
                         tp__shape_str(gate->ndim, gate->shape, s1, sizeof s1),
                         tp__shape_str(up->ndim, up->shape, s2, sizeof s2));
    }
    tp_tensor *args[2] = {gate, up};
    return tp__op_run(&swiglu_def, args, NULL, 0, y);
}
