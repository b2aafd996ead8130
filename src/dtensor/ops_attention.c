/* Scaled dot-product attention over the last two dims, with an optional
 * causal mask: out = softmax(q k^T * scale + mask) v, per leading index. */
#include <math.h>
#include <string.h>

#include "dtensor/ops_internal.h"

typedef struct {
    bool causal;
    double scale; /* 0: 1/sqrt(D) */
} sdpa_params;

static int sdpa_strategies(const tp__op *op, int mesh_dim, tp__strategy *s)
{
    (void)mesh_dim;
    int nd = tp__op_gndim(op, 0), n = 0;
    /* any leading (batch or head) dim may be sharded, the same on q, k, v */
    for (int d = 0; d + 2 < nd; d++)
        s[n++] = (tp__strategy){{tp__S(d), tp__S(d), tp__S(d)}, tp__S(d),
                                {tp__S(d), tp__S(d), tp__S(d)}};
    s[n++] = (tp__strategy){{tp__R(), tp__R(), tp__R()}, tp__R(), {tp__R(), tp__R(), tp__R()}};
    return n;
}

static tp_status sdpa_shape(const tp__op *op, int *ndim, int64_t *shape)
{
    const char *fn = op->def->name;
    int nd = tp__op_gndim(op, 0);
    TP_ARG_CHECK(nd >= 2, "%s: q must have at least 2 dims [..., seq, head_dim]", fn);
    for (int i = 1; i < 3; i++) {
        TP_ARG_CHECK(tp__op_gndim(op, i) == nd, "%s: %s has %d dims, q has %d", fn,
                     op->def->input_names[i], tp__op_gndim(op, i), nd);
        TP_ARG_CHECK(!memcmp(tp__op_gshape(op, i), tp__op_gshape(op, 0),
                             sizeof(int64_t) * (size_t)nd),
                     "%s: q, k and v must have the same shape", fn);
    }
    *ndim = nd;
    memcpy(shape, tp__op_gshape(op, 0), sizeof(int64_t) * (size_t)nd);
    return TP_OK;
}

static float sdpa_scale(const tp__op *op, int64_t d)
{
    const sdpa_params *p = TP__OP_PARAMS(op, const sdpa_params);
    return p->scale != 0 ? (float)p->scale : (float)(1.0 / sqrt((double)d));
}

/* The element e of a buffer of the op's dtype. */
static void *at(const tp__op *op, const void *base, int64_t e)
{
    return (char *)base + e * (int64_t)tp_dtype_size(op->dt);
}

/* C = alpha op(A) op(B) (beta 0) with the op's engine, in the op's dtype
 * (f32 accumulation) */
static tp_status gemm(const tp__op *op, bool ta, bool tb, int64_t m, int64_t n, int64_t k,
                      float alpha, const void *a, int64_t lda, const void *b, int64_t ldb, void *c,
                      int64_t ldc)
{
    return op->k->gemm(op->dev, op->dt, ta, tb, m, n, k, alpha, a, lda, b, ldb, 0.0f, c, ldc);
}

/* B (the product of the leading dims), S and D of q */
static void sdpa_dims(const tp_tensor *q, int64_t *B, int64_t *S, int64_t *D)
{
    int nd = q->ndim;
    *S = q->shape[nd - 2];
    *D = q->shape[nd - 1];
    *B = 1;
    for (int i = 0; i + 2 < nd; i++)
        *B *= q->shape[i];
}

/* The probabilities (the softmax of the scores, in the op's dtype, as
 * PyTorch's math attention keeps them) are saved for the backward. */
static tp_status sdpa_fwd(tp__op *op, tp_tensor *const *in, tp_tensor **out)
{
    const sdpa_params *p = TP__OP_PARAMS(op, const sdpa_params);
    tp_tensor *q = in[0], *k = in[1], *v = in[2];
    int64_t B, S, D;
    sdpa_dims(q, &B, &S, &D);
    float scale = sdpa_scale(op, D);
    int64_t pshape[2] = {B * S, S};
    tp_tensor *probs = NULL;
    TP_CHECK(tp__new(op->dt, op->dev, q->ndim, q->shape, false, out));
    tp_status st = tp__new(op->dt, op->dev, 2, pshape, false, &probs);
    const void *qd = tp_tensor_data(q), *kd = tp_tensor_data(k), *vd = tp_tensor_data(v);
    void *od = tp_tensor_data(*out), *pd = probs ? tp_tensor_data(probs) : NULL;
    for (int64_t b = 0; b < B && st == TP_OK; b++) {
        void *sc = at(op, pd, b * S * S);
        int64_t o = b * S * D;
        st = gemm(op, false, true, S, S, D, scale, at(op, qd, o), D, at(op, kd, o), D, sc, S);
        if (st == TP_OK && p->causal)
            st = op->k->causal_mask(op->dev, op->dt, sc, 1, S);
        if (st == TP_OK && S > 0)
            st = op->k->softmax_fwd(op->dev, op->dt, sc, sc, S, S);
        if (st == TP_OK)
            st = gemm(op, false, false, S, D, S, 1.0f, sc, S, at(op, vd, o), D, at(op, od, o), D);
    }
    if (st != TP_OK) {
        tp_tensor_release(probs);
        tp_tensor_release(*out);
        *out = NULL;
        return st;
    }
    op->saved[0] = probs;
    return TP_OK;
}

/* One leading index's backward: dv = p^T dout; dp = dout v^T; ds = softmax
 * backward; dq = ds k * scale; dk = ds^T q * scale. o: the element offset of
 * this index's [S, D] blocks. */
static tp_status sdpa_bwd_one(tp__op *op, tp_tensor *const *in, tp_tensor *gy, tp_tensor **g,
                              void *dpd, int64_t b, int64_t S, int64_t D, float scale)
{
    int64_t o = b * S * D;
    const void *pb = at(op, tp_tensor_data(op->saved[0]), b * S * S);
    const void *gob = at(op, tp_tensor_data(gy), o);
    tp_status st =
        gemm(op, true, false, S, D, S, 1.0f, pb, S, gob, D, at(op, tp_tensor_data(g[2]), o), D);
    if (st == TP_OK)
        st = gemm(op, false, true, S, S, D, 1.0f, gob, D, at(op, tp_tensor_data(in[2]), o), D, dpd,
                  S);
    if (st == TP_OK && S > 0)
        st = op->k->softmax_bwd(op->dev, op->dt, pb, dpd, dpd, S, S);
    if (st == TP_OK)
        st = gemm(op, false, false, S, D, S, scale, dpd, S, at(op, tp_tensor_data(in[1]), o), D,
                  at(op, tp_tensor_data(g[0]), o), D);
    if (st == TP_OK)
        st = gemm(op, true, false, S, D, S, scale, dpd, S, at(op, tp_tensor_data(in[0]), o), D,
                  at(op, tp_tensor_data(g[1]), o), D);
    return st;
}

static tp_status sdpa_bwd(tp__op *op, tp_tensor *const *in, tp_tensor *gy, tp_tensor **g)
{
    tp_tensor *q = in[0];
    int64_t B, S, D;
    sdpa_dims(q, &B, &S, &D);
    float scale = sdpa_scale(op, D);
    for (int i = 0; i < 3; i++)
        TP_CHECK(tp__new(op->dt, op->dev, q->ndim, q->shape, false, &g[i]));
    int64_t ss[2] = {S, S};
    tp_tensor *dp = NULL;
    TP_CHECK(tp__new(op->dt, op->dev, 2, ss, false, &dp));
    tp_status st = TP_OK;
    for (int64_t b = 0; b < B && st == TP_OK; b++)
        st = sdpa_bwd_one(op, in, gy, g, tp_tensor_data(dp), b, S, D, scale);
    tp_tensor_release(dp);
    /* only the inputs that need a gradient keep one */
    for (int i = 0; i < 3; i++)
        if (!op->need_grad[i]) {
            tp_tensor_release(g[i]);
            g[i] = NULL;
        }
    return st;
}

static const tp__op_def sdpa_def = {
    .name = "scaled_dot_product_attention",
    .n_inputs = 3,
    .input_names = {"q", "k", "v"},
    .dtype_kernel = TP__KOP_SOFTMAX_FWD,
    .strategies = sdpa_strategies,
    .out_shape = sdpa_shape,
    .forward = sdpa_fwd,
    .backward = sdpa_bwd,
};

tp_status tp_scaled_dot_product_attention(tp_tensor *q, tp_tensor *k, tp_tensor *v, bool causal,
                                          double scale, tp_tensor **out)
{
    TP_ARG_CHECK(scale >= 0, "scaled_dot_product_attention: scale %g is negative", scale);
    sdpa_params p = {causal, scale};
    tp_tensor *args[3] = {q, k, v};
    return tp__op_run(&sdpa_def, args, &p, sizeof p, out);
}
