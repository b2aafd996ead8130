/* Elementwise ops: add, mul, scale, relu, gelu, dropout (the view ops are in
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

/* A new contiguous f32 tensor with t's shape, on t's device. */
static tp_status like(const tp_tensor *t, bool zero, tp_tensor **out)
{
    return tp__f32(tp_tensor_device(t), t->ndim, t->shape, zero, out);
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
 * b has a's shape, or is 1-D with a's last dim (broadcast over a's rows). */

typedef struct {
    bool mul;
} binary_params;

/* Validates the shapes of a binary op; *bcast tells whether b broadcasts. */
static tp_status binary_shapes(const char *fn, int nda, const int64_t *a, int ndb,
                               const int64_t *b, bool *bcast)
{
    *bcast = false;
    if (nda == ndb && !memcmp(a, b, sizeof(int64_t) * (size_t)nda))
        return TP_OK;
    char sa[128], sb[128];
    if (ndb == 1 && nda >= 1) {
        TP_ARG_CHECK(b[0] == a[nda - 1], "%s: b has shape %s but a's last dim is %lld", fn,
                     tp__shape_str(ndb, b, sb, sizeof sb), (long long)a[nda - 1]);
        *bcast = true;
        return TP_OK;
    }
    return tp__error(TP_ERR_INVALID_ARG,
                     "%s: a has shape %s but b has shape %s; b must have a's shape or be 1-d "
                     "with a's last dim",
                     fn, tp__shape_str(nda, a, sa, sizeof sa),
                     tp__shape_str(ndb, b, sb, sizeof sb));
}

static bool is_bcast(const tp__op *op)
{
    bool bc = false;
    (void)binary_shapes(op->def->name, tp__op_gndim(op, 0), tp__op_gshape(op, 0),
                        tp__op_gndim(op, 1), tp__op_gshape(op, 1), &bc);
    return bc;
}

static int binary_strategies(const tp__op *op, int mesh_dim, tp__strategy *s)
{
    (void)mesh_dim;
    bool mul = TP__OP_PARAMS(op, binary_params)->mul;
    int nd = tp__op_gndim(op, 0), n = 0;
    const tp_placement R = tp__R(), P = tp__P();
    if (is_bcast(op)) {
        int last = nd - 1;
        /* rows split: b replicated, its gradient (a column sum) a partial sum */
        for (int d = 0; d < last && n + 5 < TP__OP_MAX_STRATS; d++)
            s[n++] = (tp__strategy){{tp__S(d), R}, tp__S(d), {tp__S(d), P}};
        /* columns split: b split alike */
        s[n++] = (tp__strategy){{tp__S(last), tp__S(0)}, tp__S(last), {tp__S(last), tp__S(0)}};
    } else {
        for (int d = 0; d < nd && n + 4 < TP__OP_MAX_STRATS; d++)
            s[n++] = (tp__strategy){{tp__S(d), tp__S(d)}, tp__S(d), {tp__S(d), tp__S(d)}};
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
    return n;
}

static tp_status binary_shape(const tp__op *op, int *ndim, int64_t *shape)
{
    bool bc;
    TP_CHECK(binary_shapes(op->def->name, tp__op_gndim(op, 0), tp__op_gshape(op, 0),
                           tp__op_gndim(op, 1), tp__op_gshape(op, 1), &bc));
    return same_shape(op, ndim, shape);
}

static tp_status add_fwd(tp__op *op, tp_tensor *const *in, tp_tensor **out)
{
    tp_tensor *a = in[0], *b = in[1];
    bool ca = contributes(op, 0), cb = contributes(op, 1), bc = is_bcast(op);
    /* zeros where nothing (or only the broadcast b, added below) is written */
    TP_CHECK(like(a, !ca && (!cb || bc), out));
    float *y = tp_tensor_data(*out);
    const float *pa = tp_tensor_data(a), *pb = tp_tensor_data(b);
    int64_t n = tp_tensor_numel(a);
    if (!bc) {
        if (ca && cb)
            return TP__K(op->dev, add, pa, pb, y, n);
        if (ca || cb)
            return tp__copy_f32(op->dev, y, ca ? pa : pb, n);
        return TP_OK;
    }
    int64_t cols = a->shape[a->ndim - 1], rows = tp__rows(a);
    if (ca && !cb)
        return tp__copy_f32(op->dev, y, pa, n);
    if (ca)
        return TP__K(op->dev, add_bcast, pa, pb, y, rows, cols);
    /* y is zeros: the broadcast b alone */
    return cb ? TP__K(op->dev, add_row, y, pb, rows, cols) : TP_OK;
}

static tp_status mul_fwd(tp__op *op, tp_tensor *const *in, tp_tensor **out)
{
    tp_tensor *a = in[0], *b = in[1];
    TP_CHECK(like(a, false, out));
    float *y = tp_tensor_data(*out);
    const float *pa = tp_tensor_data(a), *pb = tp_tensor_data(b);
    if (!is_bcast(op))
        return TP__K(op->dev, mul, pa, pb, y, tp_tensor_numel(a));
    int64_t cols = a->shape[a->ndim - 1], rows = tp__rows(a);
    return TP__K(op->dev, mul_bcast, pa, pb, y, rows, cols);
}

static tp_status binary_fwd(tp__op *op, tp_tensor *const *in, tp_tensor **out)
{
    return TP__OP_PARAMS(op, binary_params)->mul ? mul_fwd(op, in, out) : add_fwd(op, in, out);
}

/* add: ga = gy, gb = gy (or its column sums when b broadcasts).
 * mul: ga = gy * b, gb = gy * a (column sums when b broadcasts). */
static tp_status binary_bwd(tp__op *op, tp_tensor *const *in, tp_tensor *gy, tp_tensor **g)
{
    bool mul = TP__OP_PARAMS(op, binary_params)->mul, bc = is_bcast(op);
    tp_tensor *a = in[0], *b = in[1];
    const float *pa = tp_tensor_data(a), *pb = tp_tensor_data(b), *pg = tp_tensor_data(gy);
    int64_t n = tp_tensor_numel(a);
    int64_t cols = bc ? a->shape[a->ndim - 1] : 0, rows = bc ? tp__rows(a) : 0;
    if (op->need_grad[0]) {
        TP_CHECK(like(a, false, &g[0]));
        float *ga = tp_tensor_data(g[0]);
        if (!mul)
            TP_CHECK(tp__copy_f32(op->dev, ga, pg, n));
        else if (!bc)
            TP_CHECK(TP__K(op->dev, mul, pg, pb, ga, n));
        else
            TP_CHECK(TP__K(op->dev, mul_bcast, pg, pb, ga, rows, cols));
    }
    if (op->need_grad[1]) {
        TP_CHECK(like(b, bc, &g[1]));
        float *gb = tp_tensor_data(g[1]);
        if (!bc) {
            if (mul)
                TP_CHECK(TP__K(op->dev, mul, pg, pa, gb, n));
            else
                TP_CHECK(tp__copy_f32(op->dev, gb, pg, n));
        } else if (!mul) {
            if (n > 0)
                TP_CHECK(TP__K(op->dev, sum_rows, pg, gb, rows, cols));
        } else if (n > 0) {
            tp_tensor *t = NULL;
            TP_CHECK(like(a, false, &t));
            tp_status st = TP__K(op->dev, mul, pg, pa, tp_tensor_data(t), n);
            if (st == TP_OK)
                st = TP__K(op->dev, sum_rows, tp_tensor_data(t), gb, rows, cols);
            tp_tensor_release(t);
            return st;
        }
    }
    return TP_OK;
}

static const tp__op_def add_def = {
    .name = "add",
    .n_inputs = 2,
    .input_names = {"a", "b"},
    .strategies = binary_strategies,
    .out_shape = binary_shape,
    .forward = binary_fwd,
    .backward = binary_bwd,
};

static const tp__op_def mul_def = {
    .name = "mul",
    .n_inputs = 2,
    .input_names = {"a", "b"},
    .strategies = binary_strategies,
    .out_shape = binary_shape,
    .forward = binary_fwd,
    .backward = binary_bwd,
};

static tp_status binary_run(const tp__op_def *def, bool mul, tp_tensor *a, tp_tensor *b,
                            tp_tensor **y)
{
    TP_ARG_CHECK(y, "%s: out is NULL", def->name);
    *y = NULL;
    /* shapes first, so that a mismatch fails before any redistribution */
    if (a && b) {
        bool bc;
        TP_CHECK(binary_shapes(def->name, tp_tensor_ndim(a), tp_tensor_shape(a),
                               tp_tensor_ndim(b), tp_tensor_shape(b), &bc));
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
    return TP__K(op->dev, scale, tp_tensor_data(in[0]), (float)TP__OP_PARAMS(op, scale_params)->s,
                 tp_tensor_data(*out), tp_tensor_numel(in[0]));
}

static tp_status scale_bwd(tp__op *op, tp_tensor *const *in, tp_tensor *gy, tp_tensor **g)
{
    if (!op->need_grad[0])
        return TP_OK;
    TP_CHECK(like(in[0], false, &g[0]));
    return TP__K(op->dev, scale, tp_tensor_data(gy), (float)TP__OP_PARAMS(op, scale_params)->s,
                 tp_tensor_data(g[0]), tp_tensor_numel(in[0]));
}

static const tp__op_def scale_def = {
    .name = "scale",
    .n_inputs = 1,
    .input_names = {"x"},
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
    return TP__K(op->dev, relu_fwd, tp_tensor_data(in[0]), tp_tensor_data(*out),
                 tp_tensor_numel(in[0]));
}

static tp_status relu_bwd(tp__op *op, tp_tensor *const *in, tp_tensor *gy, tp_tensor **g)
{
    if (!op->need_grad[0])
        return TP_OK;
    TP_CHECK(like(in[0], false, &g[0]));
    return TP__K(op->dev, relu_bwd, tp_tensor_data(in[0]), tp_tensor_data(gy),
                 tp_tensor_data(g[0]), tp_tensor_numel(in[0]));
}

static const tp__op_def relu_def = {
    .name = "relu",
    .n_inputs = 1,
    .input_names = {"x"},
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
    return TP__K(op->dev, gelu_fwd, tp_tensor_data(in[0]), tp_tensor_data(*out),
                 tp_tensor_numel(in[0]), TP__OP_PARAMS(op, gelu_params)->tanh_approx);
}

static tp_status gelu_bwd(tp__op *op, tp_tensor *const *in, tp_tensor *gy, tp_tensor **g)
{
    if (!op->need_grad[0])
        return TP_OK;
    TP_CHECK(like(in[0], false, &g[0]));
    return TP__K(op->dev, gelu_bwd, tp_tensor_data(in[0]), tp_tensor_data(gy),
                 tp_tensor_data(g[0]), tp_tensor_numel(in[0]),
                 TP__OP_PARAMS(op, gelu_params)->tanh_approx);
}

static const tp__op_def gelu_def = {
    .name = "gelu",
    .n_inputs = 1,
    .input_names = {"x"},
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
        return tp__copy_f32(op->dev, tp_tensor_data(*out), tp_tensor_data(x), n);
    uint8_t *mask = NULL;
    if (tp__needs_grad(1, op->in) && n > 0) {
        int64_t words = (n + 3) / 4;
        TP_CHECK(tp_tensor_empty(TP_I32, op->dev, 1, &words, &op->saved[0]));
        mask = tp_tensor_data(op->saved[0]);
    }
    int64_t offset[TP_MAX_DIMS];
    tp__op_offset(op, 0, offset);
    return TP__K(op->dev, dropout_fwd, tp_tensor_data(x), tp_tensor_data(*out), mask, x->ndim,
                 x->shape, tp__op_gshape(op, 0), offset, prm->p, prm->seed);
}

static tp_status dropout_bwd(tp__op *op, tp_tensor *const *in, tp_tensor *gy, tp_tensor **g)
{
    if (!op->need_grad[0])
        return TP_OK;
    const dropout_params *prm = TP__OP_PARAMS(op, dropout_params);
    int64_t n = tp_tensor_numel(in[0]);
    TP_CHECK(like(in[0], false, &g[0]));
    if (prm->p <= 0.0f || n == 0)
        return tp__copy_f32(op->dev, tp_tensor_data(g[0]), tp_tensor_data(gy), n);
    TP_ASSERT(op->saved[0]);
    return TP__K(op->dev, dropout_bwd, tp_tensor_data(gy), tp_tensor_data(op->saved[0]),
                 tp_tensor_data(g[0]), n, prm->p);
}

static const tp__op_def dropout_def = {
    .name = "dropout",
    .n_inputs = 1,
    .input_names = {"x"},
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
