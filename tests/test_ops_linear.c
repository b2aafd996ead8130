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
static tp_status lin_gelu_tanh(tp_tensor *a, tp_tensor *b, tp_tensor *c, tp_tensor **y)
{
    return tp_linear_gelu(a, b, c, TP_GELU_TANH, y);
}
static tp_status lin_gelu_erf(tp_tensor *a, tp_tensor *b, tp_tensor *c, tp_tensor **y)
{
    return tp_linear_gelu(a, b, c, TP_GELU_EXACT, y);
}

/* Exact (the products of small integers), or within 1e-5 relative for the
 * GELU, whose values are not integers (the gradient sums then run in
 * another order on each layout). */
static tp_status same(const tp_tensor *a, const tp_tensor *b, bool exact, bool *eq)
{
    return exact ? tp_tensor_equal(a, b, eq) : tp_tensor_allclose(a, b, 1e-5, 1e-4, eq);
}

static tp_status check_case(tp_test_slot *s, tp_mesh *mesh, op3_fn op, int n_in,
                            const int *nds, const int64_t (*shapes)[3],
                            const tp_placement (*pl)[3], const char *label)
{
    bool exact = op == lin3 || op == mm2;
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
    RANK_OK(s, same(yfull, yp, exact, &eq));
    RANK_EXPECT(s, eq, "%s: output differs from the single-rank result", label);
    for (int i = 0; i < n_in; i++) {
        tp_tensor *gd = tp_tensor_grad(dt[i]), *gf = NULL;
        RANK_EXPECT(s, gd != NULL, "%s: input %d got no gradient", label, i);
        if (!gd)
            continue;
        RANK_OK(s, tp_dtensor_full_tensor(gd, &gf));
        RANK_OK(s, same(gf, tp_tensor_grad(full[i]), exact, &eq));
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

/* x, W, b's placements per mesh dim: the last mesh dim takes the case; on
 * N-D meshes mesh dim 0 shards x's batch (data parallel) and the others
 * replicate. */
static void case_placements(int mesh_ndim, tp_placement x, tp_placement w, tp_placement b,
                            tp_placement pl[3][3])
{
    for (int d = 0; d < 3; d++) {
        bool inner = d == mesh_ndim - 1;
        pl[0][d] = inner ? x : d == 0 ? tp_shard(0) : tp_replicate();
        pl[1][d] = inner ? w : tp_replicate();
        pl[2][d] = inner ? b : tp_replicate();
    }
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
            case_placements(c->mesh_ndim, cases[k].x, cases[k].w, cases[k].b, pl);
            char label[96];
            snprintf(label, sizeof label, "linear %s%s", cases[k].label,
                     with_bias ? " with bias" : "");
            TP_TEST_TRY(check_case(s, mesh, lin3, with_bias ? 3 : 2, nds, shapes,
                                (const tp_placement(*)[3])pl, label));
        }
    }
    /* linear + GELU: the same layouts; a rowwise one is moved to a layout
     * whose output is not a partial sum first */
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        for (int v = 0; v < 4; v++) {
            bool with_bias = v & 1, tanh_approx = v & 2;
            tp_placement pl[3][3];
            case_placements(c->mesh_ndim, cases[k].x, cases[k].w, cases[k].b, pl);
            char label[128];
            snprintf(label, sizeof label, "linear_gelu (%s) %s%s", tanh_approx ? "tanh" : "erf",
                     cases[k].label, with_bias ? " with bias" : "");
            TP_TEST_TRY(check_case(s, mesh, tanh_approx ? lin_gelu_tanh : lin_gelu_erf,
                                   with_bias ? 3 : 2, nds, shapes, (const tp_placement(*)[3])pl,
                                   label));
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

/* ---- linear_gelu against the unfused pair ---------------------------------------- */

/* x [5, 3, 7], W [6, 7], b [6] of dtype, uniform in [-2, 2), requiring grad. */
static void gelu_inputs(tp_dtype dt, tp_tensor *t[3])
{
    const int64_t shapes[3][3] = {{5, 3, 7}, {6, 7}, {6}};
    const int nds[3] = {3, 2, 1};
    for (int i = 0; i < 3; i++) {
        tp_tensor *f = NULL;
        CHECK_OK(tp_tensor_zeros(TP_F32, TP_CPU, nds[i], shapes[i], &f));
        CHECK_OK(tp_tensor_fill_random(f, TP_RNG_UNIFORM, -2, 2, 40 + (uint64_t)i, NULL, NULL));
        CHECK_OK(tp_tensor_to(f, dt, TP_CPU, &t[i]));
        CHECK_OK(tp_tensor_set_requires_grad(t[i], true));
        tp_tensor_release(f);
    }
}

static bool bytes_equal(const tp_tensor *a, const tp_tensor *b)
{
    return a && b && tp_tensor_numel(a) == tp_tensor_numel(b) &&
           tp_tensor_dtype(a) == tp_tensor_dtype(b) &&
           !memcmp(tp_tensor_data(a), tp_tensor_data(b),
                   (size_t)tp_tensor_numel(a) * tp_dtype_size(tp_tensor_dtype(a)));
}

/* On the CPU the fused op is the pair linear -> gelu bit for bit, forward
 * and every gradient, in each dtype, approximation and with or without a
 * bias (the contract tp/ops.h states; CUDA's tanh form differs by design). */
Test(ops_linear, linear_gelu_equals_unfused_pair, .timeout = 30)
{
    const tp_dtype dts[3] = {TP_F32, TP_BF16, TP_F16};
    for (int d = 0; d < 3; d++) {
        for (int v = 0; v < 4; v++) {
            tp_gelu_approx ap = v & 1 ? TP_GELU_TANH : TP_GELU_EXACT;
            bool with_bias = v & 2;
            tp_tensor *a[3] = {0}, *b[3] = {0}, *ya = NULL, *yl = NULL, *yb = NULL, *g = NULL,
                      *gf = NULL;
            gelu_inputs(dts[d], a);
            gelu_inputs(dts[d], b);
            CHECK_OK(tp_linear_gelu(a[0], a[1], with_bias ? a[2] : NULL, ap, &ya));
            CHECK_OK(tp_linear(b[0], b[1], with_bias ? b[2] : NULL, &yl));
            CHECK_OK(tp_gelu(yl, ap, &yb));
            cr_assert(bytes_equal(ya, yb), "%s approx %d bias %d: output differs",
                      tp_dtype_name(dts[d]), (int)ap, (int)with_bias);
            CHECK_OK(tp_tensor_zeros(TP_F32, TP_CPU, 3, (int64_t[]){5, 3, 6}, &gf));
            CHECK_OK(tp_tensor_fill_random(gf, TP_RNG_UNIFORM, -1, 1, 9, NULL, NULL));
            CHECK_OK(tp_tensor_to(gf, dts[d], TP_CPU, &g));
            CHECK_OK(tp_backward(ya, g));
            CHECK_OK(tp_backward(yb, g));
            for (int i = 0; i < (with_bias ? 3 : 2); i++)
                cr_assert(bytes_equal(tp_tensor_grad(a[i]), tp_tensor_grad(b[i])),
                          "%s approx %d bias %d: the gradient of input %d differs",
                          tp_dtype_name(dts[d]), (int)ap, (int)with_bias, i);
            cr_assert(with_bias || !tp_tensor_grad(a[2]), "an absent bias got a gradient");
            for (int i = 0; i < 3; i++) {
                tp_tensor_release(a[i]);
                tp_tensor_release(b[i]);
            }
            tp_tensor_release(ya);
            tp_tensor_release(yl);
            tp_tensor_release(yb);
            tp_tensor_release(g);
            tp_tensor_release(gf);
        }
    }
}

/* The pre-activation is kept only for a backward: under no-grad (and with
 * no input requiring grad) the op leaves its output alone in memory. */
Test(ops_linear, linear_gelu_keeps_pre_activation_only_for_backward, .timeout = 30)
{
    tp_tensor *t[3] = {0}, *y = NULL, *probe = NULL;
    gelu_inputs(TP_F32, t);
    tp_memory_info m0, m1, m2;
    /* the bytes of one output-sized block */
    CHECK_OK(tp_memory_stats(TP_CPU, &m0));
    CHECK_OK(tp_tensor_empty(TP_F32, TP_CPU, 3, (int64_t[]){5, 3, 6}, &probe));
    CHECK_OK(tp_memory_stats(TP_CPU, &m1));
    size_t block = m1.allocated - m0.allocated;
    tp_tensor_release(probe);
    cr_assert_gt(block, 0);

    CHECK_OK(tp_memory_stats(TP_CPU, &m0));
    tp_no_grad_begin();
    tp_status st = tp_linear_gelu(t[0], t[1], t[2], TP_GELU_TANH, &y);
    tp_no_grad_end();
    CHECK_OK(st);
    CHECK_OK(tp_memory_stats(TP_CPU, &m1));
    cr_assert_eq(m1.allocated - m0.allocated, block, "no-grad kept %zu bytes beyond y's %zu",
                 m1.allocated - m0.allocated - block, block);
    cr_assert(!tp_tensor_requires_grad(y));
    tp_tensor_release(y);

    CHECK_OK(tp_memory_stats(TP_CPU, &m0));
    CHECK_OK(tp_linear_gelu(t[0], t[1], t[2], TP_GELU_TANH, &y));
    CHECK_OK(tp_memory_stats(TP_CPU, &m2));
    cr_assert_geq(m2.allocated - m0.allocated, 2 * block,
                  "with grad the pre-activation is kept beside y");
    tp_tensor_release(y); /* frees the graph, and the pre-activation with it */
    CHECK_OK(tp_memory_stats(TP_CPU, &m1));
    cr_assert_eq(m1.allocated, m0.allocated, "%zu bytes left after the output was released",
                 m1.allocated - m0.allocated);
    for (int i = 0; i < 3; i++)
        tp_tensor_release(t[i]);
}

Test(ops_linear, linear_gelu_refusals, .timeout = 30)
{
    tp_tensor *t[3] = {0}, *y = NULL, *x5 = NULL, *b4 = NULL;
    gelu_inputs(TP_F32, t);
    tp_status st = tp_linear_gelu(t[0], t[1], t[2], TP_GELU_TANH, NULL);
    cr_assert(st == TP_ERR_INVALID_ARG && strstr(tp_last_error(), "linear_gelu: out is NULL"),
              "%s", tp_last_error());
    st = tp_linear_gelu(t[0], t[1], t[2], (tp_gelu_approx)7, &y);
    cr_assert(st == TP_ERR_INVALID_ARG && !y &&
                  strstr(tp_last_error(),
                         "linear_gelu: approx 7 is neither TP_GELU_EXACT nor TP_GELU_TANH"),
              "%s", tp_last_error());
    CHECK_OK(tp_tensor_zeros(TP_F32, TP_CPU, 2, (int64_t[]){4, 5}, &x5));
    st = tp_linear_gelu(x5, t[1], NULL, TP_GELU_TANH, &y);
    cr_assert(st == TP_ERR_INVALID_ARG && !y &&
                  strstr(tp_last_error(), "linear_gelu: input has 5 features, weight expects 7"),
              "%s", tp_last_error());
    CHECK_OK(tp_tensor_zeros(TP_F32, TP_CPU, 1, (int64_t[]){4}, &b4));
    st = tp_linear_gelu(t[0], t[1], b4, TP_GELU_TANH, &y);
    cr_assert(st == TP_ERR_INVALID_ARG && !y &&
                  strstr(tp_last_error(), "linear_gelu: bias must be [6]"),
              "%s", tp_last_error());
    st = tp_linear_gelu(NULL, t[1], NULL, TP_GELU_TANH, &y);
    cr_assert(st == TP_ERR_INVALID_ARG && !y, "a NULL x: %s", tp_status_name(st));
    tp_tensor *i64 = NULL;
    CHECK_OK(tp_tensor_zeros(TP_I64, TP_CPU, 2, (int64_t[]){4, 7}, &i64));
    st = tp_linear_gelu(i64, t[1], NULL, TP_GELU_TANH, &y);
    cr_assert(st != TP_OK && !y, "an i64 x was taken");
    tp_tensor_release(i64);
    tp_tensor_release(x5);
    tp_tensor_release(b4);
    for (int i = 0; i < 3; i++)
        tp_tensor_release(t[i]);
}

/* ---- a linear after linear_gelu takes the GELU's backward into its product ---- */

/* The MLP x -> linear_gelu(W1, b1) -> linear(W2, b2), fused, against
 * linear -> gelu -> linear; extra: y1 also feeds the loss directly (a second
 * consumer of its gradient, which rules the hand-over out). f32 on the CPU:
 * every gradient equal bit for bit, and the backward's peak above its start
 * (a block of [rows, F] is `act`). */
typedef struct {
    tp_tensor *g[5];
    size_t peak;
} mlp_run;

static void mlp_backward(tp_dtype dt, bool fused, bool extra, mlp_run *out)
{
    const int64_t shapes[5][2] = {{256, 8}, {64, 8}, {64, 1}, {8, 64}, {8, 1}};
    tp_tensor *t[5] = {0}, *y1 = NULL, *pre = NULL, *y2 = NULL, *loss = NULL, *s = NULL,
              *tot = NULL;
    for (int i = 0; i < 5; i++) {
        tp_tensor *f = NULL;
        CHECK_OK(tp_tensor_zeros(TP_F32, TP_CPU, shapes[i][1] == 1 ? 1 : 2, shapes[i], &f));
        CHECK_OK(tp_tensor_fill_random(f, TP_RNG_UNIFORM, -1, 1, 60 + (uint64_t)i, NULL, NULL));
        CHECK_OK(tp_tensor_to(f, dt, TP_CPU, &t[i]));
        tp_tensor_release(f);
        CHECK_OK(tp_tensor_set_requires_grad(t[i], true));
    }
    if (fused) {
        CHECK_OK(tp_linear_gelu(t[0], t[1], t[2], TP_GELU_TANH, &y1));
    } else {
        CHECK_OK(tp_linear(t[0], t[1], t[2], &pre));
        CHECK_OK(tp_gelu(pre, TP_GELU_TANH, &y1));
    }
    CHECK_OK(tp_linear(y1, t[3], t[4], &y2));
    CHECK_OK(tp_sum_all(y2, &loss));
    if (extra) {
        CHECK_OK(tp_sum_all(y1, &s));
        CHECK_OK(tp_add(loss, s, &tot));
    }
    tp_memory_info m0, m1;
    CHECK_OK(tp_memory_reset_peak(TP_CPU));
    CHECK_OK(tp_memory_stats(TP_CPU, &m0));
    CHECK_OK(tp_backward(extra ? tot : loss, NULL));
    CHECK_OK(tp_memory_stats(TP_CPU, &m1));
    out->peak = m1.peak_allocated - m0.allocated;
    for (int i = 0; i < 5; i++) {
        CHECK_OK(tp_tensor_clone(tp_tensor_grad(t[i]), &out->g[i]));
        tp_tensor_release(t[i]);
    }
    tp_tensor_release(y1);
    tp_tensor_release(pre);
    tp_tensor_release(y2);
    tp_tensor_release(loss);
    tp_tensor_release(s);
    tp_tensor_release(tot);
}

Test(ops_linear, linear_after_linear_gelu_takes_its_backward, .timeout = 30)
{
    /* one [rows, F] = [256, 64] f32 block */
    tp_memory_info a, b;
    tp_tensor *probe = NULL;
    CHECK_OK(tp_memory_stats(TP_CPU, &a));
    CHECK_OK(tp_tensor_empty(TP_F32, TP_CPU, 2, (int64_t[]){256, 64}, &probe));
    CHECK_OK(tp_memory_stats(TP_CPU, &b));
    size_t act = b.allocated - a.allocated;
    tp_tensor_release(probe);
    for (int v = 0; v < 4; v++) {
        bool extra = v & 1;
        tp_dtype dt = v & 2 ? TP_BF16 : TP_F32;
        mlp_run f = {0}, u = {0};
        mlp_backward(dt, true, extra, &f);
        mlp_backward(dt, false, extra, &u);
        for (int i = 0; i < 5; i++)
            cr_assert(bytes_equal(f.g[i], u.g[i]), "%s, %s: the gradient of input %d differs",
                      tp_dtype_name(dt), extra ? "a second consumer" : "alone", i);
        if (dt != TP_F32) { /* the memory figures below are f32's (no f32 scratch) */
            for (int i = 0; i < 5; i++) {
                tp_tensor_release(f.g[i]);
                tp_tensor_release(u.g[i]);
            }
            continue;
        }
        if (extra)
            /* no hand-over: the fused layer computes its own GELU backward,
             * beside the incoming gradient, as the unfused pair does */
            cr_assert_eq(f.peak, u.peak, "with a second consumer: peak %zu, unfused %zu", f.peak,
                         u.peak);
        else
            /* handed over: the GELU's gradient is made in place of x's, so
             * the two [rows, F] blocks of the unfused GELU backward (its
             * incoming gradient and its own) are one; the peak moves to
             * net1's backward, which adds its small gradients beside it */
            cr_assert_leq(f.peak + act * 3 / 4, u.peak, "alone: peak %zu, unfused %zu, a block %zu",
                          f.peak, u.peak, act);
        for (int i = 0; i < 5; i++) {
            tp_tensor_release(f.g[i]);
            tp_tensor_release(u.g[i]);
        }
    }
}
