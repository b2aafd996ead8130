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

/* C = alpha op(A) op(B) (beta 0) with the op's engine */
static tp_status sgemm(const tp__op *op, bool ta, bool tb, int64_t m, int64_t n, int64_t k,
                       float alpha, const float *a, int64_t lda, const float *b, int64_t ldb,
                       float *c, int64_t ldc)
{
    return op->k->gemm(op->dev, TP_F32, ta, tb, m, n, k, alpha, a, lda, b, ldb, 0.0f, c, ldc);
}

static tp_status sdpa_fwd(tp__op *op, tp_tensor *const *in, tp_tensor **out)
{
    const sdpa_params *p = TP__OP_PARAMS(op, const sdpa_params);
    tp_tensor *q = in[0], *k = in[1], *v = in[2];
    int nd = q->ndim;
    int64_t S = q->shape[nd - 2], D = q->shape[nd - 1], B = 1;
    for (int i = 0; i + 2 < nd; i++)
        B *= q->shape[i];
    float scale = sdpa_scale(op, D);
    int64_t pshape[2] = {B * S, S};
    tp_tensor *probs = NULL;
    TP_CHECK(tp__f32(op->dev, nd, q->shape, false, out));
    tp_status st = tp__f32(op->dev, 2, pshape, false, &probs);
    const float *qd = tp_tensor_data(q), *kd = tp_tensor_data(k), *vd = tp_tensor_data(v);
    float *od = tp_tensor_data(*out), *pd = probs ? tp_tensor_data(probs) : NULL;
    for (int64_t b = 0; b < B && st == TP_OK; b++) {
        float *sc = pd + b * S * S;
        st = sgemm(op, false, true, S, S, D, scale, qd + b * S * D, D, kd + b * S * D, D, sc, S);
        if (st == TP_OK && p->causal)
            st = op->k->causal_mask(op->dev, TP_F32, sc, 1, S);
        if (st == TP_OK && S > 0)
            st = op->k->softmax_fwd(op->dev, TP_F32, sc, sc, S, S);
        if (st == TP_OK)
            st = sgemm(op, false, false, S, D, S, 1.0f, sc, S, vd + b * S * D, D, od + b * S * D,
                       D);
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

static tp_status sdpa_bwd(tp__op *op, tp_tensor *const *in, tp_tensor *gy, tp_tensor **g)
{
    tp_tensor *q = in[0], *k = in[1], *v = in[2], *probs = op->saved[0];
    int nd = q->ndim;
    int64_t S = q->shape[nd - 2], D = q->shape[nd - 1], B = 1;
    for (int i = 0; i + 2 < nd; i++)
        B *= q->shape[i];
    float scale = sdpa_scale(op, D);
    for (int i = 0; i < 3; i++)
        TP_CHECK(tp__f32(op->dev, nd, q->shape, false, &g[i]));
    int64_t ss[2] = {S, S};
    tp_tensor *dp = NULL;
    TP_CHECK(tp__f32(op->dev, 2, ss, false, &dp));
    const float *qd = tp_tensor_data(q), *kd = tp_tensor_data(k), *vd = tp_tensor_data(v);
    const float *pd = tp_tensor_data(probs), *go = tp_tensor_data(gy);
    float *gq = tp_tensor_data(g[0]), *gk = tp_tensor_data(g[1]), *gv = tp_tensor_data(g[2]);
    float *dpd = tp_tensor_data(dp);
    tp_status st = TP_OK;
    for (int64_t b = 0; b < B && st == TP_OK; b++) {
        const float *pb = pd + b * S * S, *gob = go + b * S * D;
        /* dv = p^T dout; dp = dout v^T; ds = softmax backward; dq, dk */
        st = sgemm(op, true, false, S, D, S, 1.0f, pb, S, gob, D, gv + b * S * D, D);
        if (st == TP_OK)
            st = sgemm(op, false, true, S, S, D, 1.0f, gob, D, vd + b * S * D, D, dpd, S);
        if (st == TP_OK && S > 0)
            st = op->k->softmax_bwd(op->dev, TP_F32, pb, dpd, dpd, S, S);
        if (st == TP_OK)
            st = sgemm(op, false, false, S, D, S, scale, dpd, S, kd + b * S * D, D,
                       gq + b * S * D, D);
        if (st == TP_OK)
            st = sgemm(op, true, false, S, D, S, scale, dpd, S, qd + b * S * D, D,
                       gk + b * S * D, D);
    }
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
