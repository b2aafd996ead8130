/* linear and matmul on DTensors equal the single-rank computation, forward and
 * gradients, for every strategy and for layouts that need redistribution, on
 * 1-D and 2-D meshes with uneven shapes. Inputs are small integers, so every
 * sum is exact in f32 and the comparison is exact. */
#include "tp_test_dtensor.h"

typedef struct {
    int mesh_ndim;
    int64_t mesh_shape[3];
    tp_test_slot slot[TP_TEST_MAX_RANKS];
} lin_ctx;

/* Runs op on plain tensors and on DTensors, compares y and every gradient. */
typedef tp_status (*op3_fn)(tp_tensor *, tp_tensor *, tp_tensor *, tp_tensor **);

static tp_status lin3(tp_tensor *a, tp_tensor *b, tp_tensor *c, tp_tensor **y)
{
    return tp_linear(a, b, c, y);
}
static tp_status mm2(tp_tensor *a, tp_tensor *b, tp_tensor *c, tp_tensor **y)
{
    (void)c;
    return tp_matmul(a, b, y);
}

static tp_status check_case(tp_test_slot *s, tp_mesh *mesh, op3_fn op, int n_in,
                            const int *nds, const int64_t (*shapes)[3],
                            const tp_placement (*pl)[3], const char *label)
{
    int m = tp_mesh_ndim(mesh);
    tp_tensor *full[3] = {0}, *dt[3] = {0}, *yp = NULL, *yd = NULL, *yfull = NULL, *g = NULL;
    for (int i = 0; i < n_in; i++) {
        RANK_OK(s, tp_test_global_tensor(nds[i], shapes[i], 100 + (uint64_t)i, &full[i]));
        RANK_OK(s, tp_dtensor_distribute(mesh, full[i], m, pl[i], -1, &dt[i]));
        RANK_OK(s, tp_tensor_set_requires_grad(full[i], true));
        RANK_OK(s, tp_tensor_set_requires_grad(dt[i], true));
    }
    /* reference */
    RANK_OK(s, op(full[0], full[1], n_in > 2 ? full[2] : NULL, &yp));
    RANK_OK(s, tp_test_global_tensor(tp_tensor_ndim(yp), tp_tensor_shape(yp), 7, &g));
    RANK_OK(s, tp_backward(yp, g));
    /* distributed */
    RANK_OK(s, op(dt[0], dt[1], n_in > 2 ? dt[2] : NULL, &yd));
    RANK_OK(s, tp_dtensor_full_tensor(yd, &yfull));
    RANK_OK(s, tp_backward(yfull, g));
    bool eq = false;
    RANK_OK(s, tp_tensor_equal(yfull, yp, &eq));
    RANK_EXPECT(s, eq, "%s: output differs from the single-rank result", label);
    for (int i = 0; i < n_in; i++) {
        tp_tensor *gd = tp_tensor_grad(dt[i]), *gf = NULL;
        RANK_EXPECT(s, gd != NULL, "%s: input %d got no gradient", label, i);
        if (!gd)
            continue;
        RANK_OK(s, tp_dtensor_full_tensor(gd, &gf));
        RANK_OK(s, tp_tensor_equal(gf, tp_tensor_grad(full[i]), &eq));
        RANK_EXPECT(s, eq, "%s: gradient of input %d differs", label, i);
        tp_tensor_release(gf);
    }
    for (int i = 0; i < 3; i++) {
        tp_tensor_release(full[i]);
        tp_tensor_release(dt[i]);
    }
    tp_tensor_release(yp);
    tp_tensor_release(yd);
    tp_tensor_release(yfull);
    tp_tensor_release(g);
    return TP_OK;
}

static tp_status lin_body(tp_comm *w, void *arg)
{
    lin_ctx *c = arg;
    tp_test_slot *s = &c->slot[tp_comm_rank(w)];
    tp_mesh *mesh = NULL;
    RANK_OK(s, tp_mesh_create(w, c->mesh_ndim, c->mesh_shape, NULL, &mesh));
    const tp_placement R = tp_replicate(), S0 = tp_shard(0), S1 = tp_shard(1),
                       Sm1 = tp_shard(-1);
    /* x [5, 3, 7] (uneven everywhere), W [6, 7], b [6] */
    const int nds[3] = {3, 2, 1};
    const int64_t shapes[3][3] = {{5, 3, 7}, {6, 7}, {6}};
    struct {
        const char *label;
        tp_placement x, w, b;
    } cases[] = {
        {"colwise", R, S0, S0},       {"rowwise", Sm1, S1, R},  {"batch-sharded", S0, R, R},
        {"replicated", R, R, R},      {"mixed (needs redistribution)", S1, S0, R},
        {"seq-sharded input, rowwise weight", S1, S1, R},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        for (int with_bias = 0; with_bias < 2; with_bias++) {
            tp_placement pl[3][3];
            for (int d = 0; d < 3; d++) {
                /* the last mesh dim takes the case; on N-D meshes mesh dim 0
                 * shards x's batch (data parallel) and the others replicate */
                bool inner = d == c->mesh_ndim - 1;
                pl[0][d] = inner ? cases[k].x : d == 0 ? S0 : R;
                pl[1][d] = inner ? cases[k].w : R;
                pl[2][d] = inner ? cases[k].b : R;
            }
            char label[96];
            snprintf(label, sizeof label, "linear %s%s", cases[k].label,
                     with_bias ? " with bias" : "");
            TP_TEST_TRY(check_case(s, mesh, lin3, with_bias ? 3 : 2, nds, shapes,
                                (const tp_placement(*)[3])pl, label));
        }
    }
    /* matmul: a [5, 3, 7] b [7, 6] */
    const int mnds[2] = {3, 2};
    const int64_t mshapes[2][3] = {{5, 3, 7}, {7, 6}};
    struct {
        const char *label;
        tp_placement a, b;
    } mcases[] = {{"colwise", R, S1}, {"rowwise", Sm1, S0}, {"batch", S0, R}, {"mixed", S1, S1}};
    for (size_t k = 0; k < sizeof mcases / sizeof mcases[0]; k++) {
        tp_placement pl[3][3];
        for (int d = 0; d < 3; d++) {
            bool inner = d == c->mesh_ndim - 1;
            pl[0][d] = inner ? mcases[k].a : d == 0 ? S0 : R;
            pl[1][d] = inner ? mcases[k].b : R;
            pl[2][d] = R;
        }
        char label[64];
        snprintf(label, sizeof label, "matmul %s", mcases[k].label);
        TP_TEST_TRY(check_case(s, mesh, mm2, 2, mnds, mshapes, (const tp_placement(*)[3])pl, label));
    }
    /* mixing plain and distributed tensors names the argument */
    tp_tensor *x = NULL, *wp = NULL, *y = NULL, *wd = NULL;
    RANK_OK(s, tp_test_global_tensor(2, (int64_t[]){4, 7}, 1, &x));
    RANK_OK(s, tp_test_global_tensor(2, (int64_t[]){6, 7}, 2, &wp));
    tp_placement rr[3] = {R, R, R};
    RANK_OK(s, tp_dtensor_distribute(mesh, wp, c->mesh_ndim, rr, -1, &wd));
    tp_status st = tp_linear(x, wd, NULL, &y);
    RANK_EXPECT(s, st == TP_ERR_INVALID_ARG &&
                       strstr(tp_last_error(), "x is a plain tensor but weight is a DTensor"),
                "mixing: %s %s", tp_status_name(st), tp_last_error());
    st = tp_linear(x, wp, NULL, &y); /* x has 7 features, fine */
    RANK_EXPECT(s, st == TP_OK, "plain linear failed: %s", tp_last_error());
    tp_tensor_release(y);
    tp_tensor *x5 = NULL;
    RANK_OK(s, tp_test_global_tensor(2, (int64_t[]){4, 5}, 1, &x5));
    st = tp_linear(x5, wp, NULL, &y);
    RANK_EXPECT(s, st == TP_ERR_INVALID_ARG &&
                       strstr(tp_last_error(), "linear: input has 5 features, weight expects 7"),
                "shape mismatch: %s %s", tp_status_name(st), tp_last_error());
    tp_tensor_release(x);
    tp_tensor_release(x5);
    tp_tensor_release(wp);
    tp_tensor_release(wd);
    tp_mesh_free(mesh);
    return TP_OK;
}

typedef struct {
    int ndim;
    int64_t shape[3];
} lin_mesh;

ParameterizedTestParameters(ops_linear, equals_single_rank)
{
    static lin_mesh meshes[] = {{1, {1}},    {1, {2}},    {1, {3}},    {1, {4}},      {1, {8}},
                                {2, {2, 2}}, {2, {4, 2}}, {2, {2, 3}}, {3, {2, 2, 2}}};
    return cr_make_param_array(lin_mesh, meshes, sizeof meshes / sizeof meshes[0]);
}

ParameterizedTest(lin_mesh *lm, ops_linear, equals_single_rank, .timeout = 120)
{
    lin_ctx c = {.mesh_ndim = lm->ndim};
    int n = 1;
    for (int d = 0; d < lm->ndim; d++) {
        c.mesh_shape[d] = lm->shape[d];
        n *= (int)lm->shape[d];
    }
    tp_test_run(n, lin_body, &c, c.slot);
}
