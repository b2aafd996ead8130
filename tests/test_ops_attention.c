/* scaled_dot_product_attention: the plain op against a double-precision
 * reference (forward and gradients), the distributed op against the plain one
 * with heads or batch sharded, on 1-4 ranks and a 2x2 mesh. Tolerance: f32
 * softmax and GEMMs, rtol 1e-4, atol 1e-5. */
#include <math.h>

#include "tp_test.h"

#define RTOL 1e-4
#define ATOL 1e-5

static tp_status rand_tensor(int nd, const int64_t *shape, uint64_t seed, tp_tensor **t)
{
    TP_TEST_TRY(tp_tensor_zeros(TP_F32, TP_CPU, nd, shape, t));
    return tp_tensor_fill_random(*t, TP_RNG_UNIFORM, -1, 1, seed, NULL, NULL);
}

/* out and dq, dk, dv for loss = sum(out * g), in double, one (b) slice */
static void reference(int64_t B, int64_t S, int64_t D, const float *q, const float *k,
                      const float *v, const float *g, bool causal, double *out, double *dq,
                      double *dk, double *dv)
{
    double scale = 1.0 / sqrt((double)D);
    for (int64_t b = 0; b < B; b++) {
        const float *qb = q + b * S * D, *kb = k + b * S * D, *vb = v + b * S * D,
                    *gb = g + b * S * D;
        double p[16][16], dp[16][16];
        for (int64_t i = 0; i < S; i++) {
            double mx = -INFINITY, sum = 0;
            for (int64_t j = 0; j < S; j++) {
                double s = 0;
                for (int64_t d = 0; d < D; d++)
                    s += (double)qb[i * D + d] * kb[j * D + d];
                p[i][j] = (causal && j > i) ? -INFINITY : s * scale;
                mx = fmax(mx, p[i][j]);
            }
            for (int64_t j = 0; j < S; j++)
                sum += (p[i][j] = exp(p[i][j] - mx));
            for (int64_t j = 0; j < S; j++)
                p[i][j] /= sum;
            for (int64_t d = 0; d < D; d++) {
                double o = 0;
                for (int64_t j = 0; j < S; j++)
                    o += p[i][j] * vb[j * D + d];
                out[b * S * D + i * D + d] = o;
            }
        }
        for (int64_t i = 0; i < S; i++)
            for (int64_t j = 0; j < S; j++) {
                double s = 0;
                for (int64_t d = 0; d < D; d++)
                    s += (double)gb[i * D + d] * vb[j * D + d];
                dp[i][j] = s;
            }
        for (int64_t j = 0; j < S; j++)
            for (int64_t d = 0; d < D; d++) {
                double s = 0;
                for (int64_t i = 0; i < S; i++)
                    s += p[i][j] * gb[i * D + d];
                dv[b * S * D + j * D + d] = s;
            }
        for (int64_t i = 0; i < S; i++) {
            double dot = 0;
            for (int64_t j = 0; j < S; j++)
                dot += dp[i][j] * p[i][j];
            for (int64_t j = 0; j < S; j++)
                dp[i][j] = p[i][j] * (dp[i][j] - dot) * scale;
        }
        for (int64_t i = 0; i < S; i++)
            for (int64_t d = 0; d < D; d++) {
                double s = 0, t = 0;
                for (int64_t j = 0; j < S; j++) {
                    s += dp[i][j] * kb[j * D + d];
                    t += dp[j][i] * qb[j * D + d];
                }
                dq[b * S * D + i * D + d] = s;
                dk[b * S * D + i * D + d] = t;
            }
    }
}

static bool close_to(const tp_tensor *t, const double *want, int64_t n)
{
    const float *x = tp_tensor_data(t);
    for (int64_t i = 0; i < n; i++)
        if (fabs(x[i] - want[i]) > ATOL + RTOL * fabs(want[i]))
            return false;
    return true;
}

Test(ops_attention, plain_matches_reference, .timeout = 30)
{
    int64_t shape[4] = {2, 3, 5, 4}, n = 2 * 3 * 5 * 4;
    for (int causal = 0; causal < 2; causal++) {
        tp_tensor *q = NULL, *k = NULL, *v = NULL, *g = NULL, *out = NULL;
        CHECK_OK(rand_tensor(4, shape, 1, &q));
        CHECK_OK(rand_tensor(4, shape, 2, &k));
        CHECK_OK(rand_tensor(4, shape, 3, &v));
        CHECK_OK(rand_tensor(4, shape, 4, &g));
        CHECK_OK(tp_tensor_set_requires_grad(q, true));
        CHECK_OK(tp_tensor_set_requires_grad(k, true));
        CHECK_OK(tp_tensor_set_requires_grad(v, true));
        CHECK_OK(tp_scaled_dot_product_attention(q, k, v, causal, 0, &out));
        CHECK_OK(tp_backward(out, g));
        static double ro[120], rq[120], rk[120], rv[120];
        reference(6, 5, 4, tp_tensor_data(q), tp_tensor_data(k), tp_tensor_data(v),
                  tp_tensor_data(g), causal, ro, rq, rk, rv);
        cr_assert(close_to(out, ro, n), "causal=%d: output differs from the reference", causal);
        cr_assert(close_to(tp_tensor_grad(q), rq, n), "causal=%d: dq differs", causal);
        cr_assert(close_to(tp_tensor_grad(k), rk, n), "causal=%d: dk differs", causal);
        cr_assert(close_to(tp_tensor_grad(v), rv, n), "causal=%d: dv differs", causal);
        tp_tensor *all[] = {q, k, v, g, out};
        for (size_t i = 0; i < 5; i++)
            tp_tensor_release(all[i]);
    }
    tp_tensor *a = NULL, *b = NULL, *out = NULL;
    int64_t s1[3] = {2, 5, 4}, s2[3] = {2, 5, 3};
    CHECK_OK(rand_tensor(3, s1, 1, &a));
    CHECK_OK(rand_tensor(3, s2, 1, &b));
    CHECK_ERR(tp_scaled_dot_product_attention(a, b, a, false, 0, &out), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "same shape"), "%s", tp_last_error());
    tp_tensor_release(a);
    tp_tensor_release(b);
}

typedef struct {
    int mesh_ndim;
    int64_t mesh_shape[2];
    tp_test_slot slot[TP_TEST_MAX_RANKS];
} attn_ctx;

static tp_status attn_body(tp_comm *w, void *arg)
{
    attn_ctx *c = arg;
    tp_test_slot *s = &c->slot[tp_comm_rank(w)];
    tp_mesh *mesh = NULL;
    RANK_OK(s, tp_mesh_create(w, c->mesh_ndim, c->mesh_shape, NULL, &mesh));
    int m = c->mesh_ndim;
    int64_t shape[4] = {3, 5, 6, 4}; /* batch 3, heads 5: uneven over the meshes */
    tp_placement layouts[][2] = {{tp_shard(1), tp_shard(0)}, {tp_shard(0), tp_shard(1)},
                                 {tp_replicate(), tp_shard(1)}, {tp_shard(2), tp_replicate()}};
    for (size_t L = 0; L < sizeof layouts / sizeof layouts[0]; L++) {
        tp_tensor *f[4] = {0}, *d[3] = {0}, *po = NULL, *dout = NULL, *full = NULL;
        for (int i = 0; i < 4; i++)
            RANK_OK(s, rand_tensor(4, shape, 10 + (uint64_t)i, &f[i]));
        tp_placement pl[2] = {layouts[L][0], layouts[L][1]};
        for (int i = 0; i < 3; i++) {
            RANK_OK(s, tp_dtensor_distribute(mesh, f[i], m, pl, -1, &d[i]));
            RANK_OK(s, tp_tensor_set_requires_grad(f[i], true));
            RANK_OK(s, tp_tensor_set_requires_grad(d[i], true));
        }
        RANK_OK(s, tp_scaled_dot_product_attention(f[0], f[1], f[2], true, 0, &po));
        RANK_OK(s, tp_backward(po, f[3]));
        RANK_OK(s, tp_scaled_dot_product_attention(d[0], d[1], d[2], true, 0, &dout));
        RANK_OK(s, tp_dtensor_full_tensor(dout, &full));
        RANK_OK(s, tp_backward(full, f[3]));
        bool ok = false;
        RANK_OK(s, tp_tensor_allclose(full, po, RTOL, ATOL, &ok));
        RANK_EXPECT(s, ok, "layout %zu: output differs", L);
        for (int i = 0; i < 3; i++) {
            tp_tensor *gf = NULL;
            RANK_OK(s, tp_dtensor_full_tensor(tp_tensor_grad(d[i]), &gf));
            RANK_OK(s, tp_tensor_allclose(gf, tp_tensor_grad(f[i]), RTOL, ATOL, &ok));
            RANK_EXPECT(s, ok, "layout %zu: gradient of input %d differs", L, i);
            tp_tensor_release(gf);
        }
        for (int i = 0; i < 4; i++)
            tp_tensor_release(f[i]);
        for (int i = 0; i < 3; i++)
            tp_tensor_release(d[i]);
        tp_tensor_release(po);
        tp_tensor_release(dout);
        tp_tensor_release(full);
    }
    tp_mesh_free(mesh);
    return TP_OK;
}

typedef struct {
    int ndim;
    int64_t shape[2];
} attn_mesh;

ParameterizedTestParameters(ops_attention, equals_single_rank)
{
    static attn_mesh meshes[] = {{1, {1}}, {1, {2}}, {1, {3}}, {1, {4}}, {2, {2, 2}}};
    return cr_make_param_array(attn_mesh, meshes, sizeof meshes / sizeof meshes[0]);
}

ParameterizedTest(attn_mesh *am, ops_attention, equals_single_rank, .timeout = 60)
{
    attn_ctx c = {.mesh_ndim = am->ndim, .mesh_shape = {am->shape[0], am->shape[1]}};
    tp_test_run((int)(am->shape[0] * (am->ndim > 1 ? am->shape[1] : 1)), attn_body, &c, c.slot);
}
