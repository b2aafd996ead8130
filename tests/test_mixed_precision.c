/* Mixed precision: casting modules (param_dtype), f32 master weights in the
 * optimizers, DDP gradients reduced in another dtype (reduce_dtype), and the
 * grad scaler (loss scaling). References are computed here in double, with
 * their own round-to-nearest-even to bf16/f16. */
#include <math.h>

#include "tp_test.h"
#include "tp_test_dtensor.h"

/* ---- references ---------------------------------------------------------------- */

/* Significand bits (with the implicit one). */
static int sig_bits(tp_dtype dt)
{
    return dt == TP_BF16 ? 8 : dt == TP_F16 ? 11 : dt == TP_F32 ? 24 : 53;
}

/* x rounded to nearest even in dt, computed from the exact double (f16:
 * subnormals below 2^-14 and overflow past 65504 to inf). */
static double round_to(double x, tp_dtype dt)
{
    if (dt == TP_F64 || x == 0 || !isfinite(x))
        return x;
    int e;
    frexp(x, &e); /* |x| in [2^(e-1), 2^e) */
    int q = e - sig_bits(dt);
    int qmin = dt == TP_F16 ? -24 : dt == TP_BF16 ? -133 : -149;
    if (q < qmin)
        q = qmin;
    double r = ldexp(nearbyint(ldexp(x, -q)), q);
    double max = dt == TP_F16 ? 65504.0 : dt == TP_BF16 ? 0x1.FEp127 : 0x1.FFFFFEp127;
    return fabs(r) > max ? copysign(INFINITY, r) : r;
}

/* Element i of a 1-D or 2-D CPU tensor (row-major index). */
static double elem(const tp_tensor *t, int64_t i)
{
    int64_t idx[2] = {0, i};
    if (tp_tensor_ndim(t) == 2) {
        idx[0] = i / tp_tensor_size(t, 1);
        idx[1] = i % tp_tensor_size(t, 1);
    }
    double v = NAN;
    tp_status st = tp_tensor_get(t, tp_tensor_ndim(t) == 2 ? idx : &idx[1], &v);
    return st == TP_OK ? v : NAN;
}

/* A CPU tensor of dtype dt holding vals (already representable). */
static tp_status tensor_of(tp_dtype dt, int nd, const int64_t *shape, const double *vals,
                           tp_tensor **out)
{
    TP_TEST_TRY(tp_tensor_empty(dt, TP_CPU, nd, shape, out));
    int64_t n = tp_tensor_numel(*out);
    for (int64_t i = 0; i < n; i++) {
        int64_t idx[2] = {0, i};
        if (nd == 2) {
            idx[0] = i / shape[1];
            idx[1] = i % shape[1];
        }
        TP_TEST_TRY(tp_tensor_set(*out, nd == 2 ? idx : &idx[1], vals[i]));
    }
    return TP_OK;
}

/* Main thread: every element of got equals round_to(element of from, dt). */
static void assert_rounded(const tp_tensor *got, const tp_tensor *from, tp_dtype dt,
                           const char *what)
{
    cr_assert_eq(tp_tensor_dtype(got), dt, "%s: dtype %s, expected %s", what,
                 tp_dtype_name(tp_tensor_dtype(got)), tp_dtype_name(dt));
    cr_assert_eq(tp_tensor_numel(got), tp_tensor_numel(from), "%s: numel", what);
    for (int64_t i = 0; i < tp_tensor_numel(got); i++) {
        double want = round_to(elem(from, i), dt), have = elem(got, i);
        cr_assert(have == want, "%s[%lld]: %.9g, expected %.9g (from %.9g)", what, (long long)i,
                  have, want, elem(from, i));
    }
}

/* ---- modules ---------------------------------------------------------------- */

static tp_status linear_fwd(tp_module *self, int nargs, tp_tensor *const *args, int nkw,
                            const tp_kwarg *kw, tp_tensor **out)
{
    (void)nargs, (void)nkw, (void)kw;
    return tp_linear(args[0], tp_module_parameter(self, "w"), NULL, out);
}

/* A custom module with one parameter "w" (retained by the module; the
 * caller keeps its own reference to w). */
static tp_status holder(tp_tensor *w, tp_module **out)
{
    TP_TEST_TRY(tp_nn_custom_create("Holder", linear_fwd, NULL, NULL, out));
    return tp_module_register_parameter(*out, "w", w);
}

/* ---- tp_module_to_dtype ------------------------------------------------------ */

typedef struct cast_model {
    tp_module *root, *l1, *l2, *tie;
    tp_tensor *old[5]; /* l1.weight, l1.bias, l2.weight, l2.bias, tie.alias (retained) */
    tp_tensor *old_grad;
} cast_model;

/* root { l1: Linear(5,4), l2: Linear(4,3), tie: { w = l1.weight (the same
 * tensor), alias = another handle over l2.weight's storage } }, with a
 * gradient on l1.weight. */
static void cast_model_make(cast_model *cm)
{
    CHECK_OK(tp_nn_container_create(&cm->root));
    CHECK_OK(tp_nn_linear_create(5, 4, true, &cm->l1));
    CHECK_OK(tp_nn_linear_create(4, 3, true, &cm->l2));
    CHECK_OK(tp_module_add_child(cm->root, "l1", cm->l1));
    CHECK_OK(tp_module_add_child(cm->root, "l2", cm->l2));
    CHECK_OK(tp_module_init(cm->root, 11));
    tp_tensor *w2 = tp_module_parameter(cm->l2, "weight"), *alias = NULL;
    CHECK_OK(tp_tensor_view(w2, 2, (int64_t[]){3, 4}, &alias));
    CHECK_OK(holder(tp_module_parameter(cm->l1, "weight"), &cm->tie));
    CHECK_OK(tp_module_register_parameter(cm->tie, "alias", alias));
    CHECK_OK(tp_module_add_child(cm->root, "tie", cm->tie));
    const char *names[] = {"weight", "bias"};
    for (int i = 0; i < 4; i++)
        cm->old[i] = tp_tensor_retain(tp_module_parameter(i < 2 ? cm->l1 : cm->l2, names[i % 2]));
    cm->old[4] = alias;
    CHECK_OK(tp_tensor_zeros(TP_F32, TP_CPU, 2, (int64_t[]){4, 5}, &cm->old_grad));
    CHECK_OK(tp_tensor_fill_random(cm->old_grad, TP_RNG_NORMAL, 0, 3, 5, NULL, NULL));
    CHECK_OK(tp_tensor_set_grad(cm->old[0], cm->old_grad));
}

static void cast_model_free(cast_model *cm)
{
    for (int i = 0; i < 5; i++)
        tp_tensor_release(cm->old[i]);
    tp_tensor_release(cm->old_grad);
    tp_module_free(cm->root);
}

Test(mixed, module_to_dtype_casts_parameters_gradients_and_keeps_ties, .timeout = 30)
{
    const tp_dtype dts[] = {TP_BF16, TP_F16};
    for (int k = 0; k < 2; k++) {
        tp_dtype dt = dts[k];
        cast_model cm = {0};
        cast_model_make(&cm);
        CHECK_OK(tp_module_to_dtype(cm.root, dt));
        tp_tensor *now[5] = {
            tp_module_parameter(cm.l1, "weight"), tp_module_parameter(cm.l1, "bias"),
            tp_module_parameter(cm.l2, "weight"), tp_module_parameter(cm.l2, "bias"),
            tp_module_parameter(cm.tie, "alias")};
        for (int i = 0; i < 5; i++) {
            char what[64];
            snprintf(what, sizeof what, "%s parameter %d", tp_dtype_name(dt), i);
            cr_assert_neq(now[i], cm.old[i], "%s was not replaced", what);
            cr_assert(tp_tensor_requires_grad(now[i]), "%s does not require grad", what);
            assert_rounded(now[i], cm.old[i], dt, what);
            cr_assert_eq(tp_tensor_dtype(cm.old[i]), TP_F32, "%s: the old tensor changed", what);
        }
        /* ties: the same tensor stays one, the alias a handle over the copy */
        cr_assert_eq(tp_module_parameter(cm.tie, "w"), now[0], "the tied weight was split");
        cr_assert(tp_tensor_shares_storage(now[4], now[2]), "the alias lost its storage");
        /* the gradient is cast too; parameters without one stay without */
        tp_tensor *g = tp_tensor_grad(now[0]);
        cr_assert(g, "l1.weight lost its gradient");
        assert_rounded(g, cm.old_grad, dt, "l1.weight's gradient");
        cr_assert_null(tp_tensor_grad(now[2]), "l2.weight got a gradient");
        /* back to f32: exactly the low-precision values; f32 again: nothing */
        tp_tensor *lowp = tp_tensor_retain(now[2]);
        CHECK_OK(tp_module_to_dtype(cm.root, TP_F32));
        tp_tensor *back = tp_module_parameter(cm.l2, "weight");
        assert_rounded(back, lowp, TP_F32, "l2.weight back in f32");
        CHECK_OK(tp_module_to_dtype(cm.root, TP_F32));
        cr_assert_eq(tp_module_parameter(cm.l2, "weight"), back, "a no-op cast replaced it");
        tp_tensor_release(lowp);
        cast_model_free(&cm);
    }
}

Test(mixed, module_to_dtype_refuses_other_dtypes, .timeout = 30)
{
    tp_module *lin = NULL;
    CHECK_OK(tp_nn_linear_create(3, 2, true, &lin));
    tp_tensor *w = tp_module_parameter(lin, "weight");
    const tp_dtype bad[] = {TP_F64, TP_I32, TP_I64, TP_DTYPE_COUNT, (tp_dtype)-1};
    for (int i = 0; i < 5; i++) {
        CHECK_ERR(tp_module_to_dtype(lin, bad[i]), TP_ERR_INVALID_ARG);
        cr_assert(strstr(tp_last_error(), "tp_module_to_dtype") &&
                      strstr(tp_last_error(), "use f32, bf16 or f16"),
                  "unclear message: %s", tp_last_error());
        cr_assert_eq(tp_module_parameter(lin, "weight"), w, "a refused cast changed the module");
    }
    CHECK_ERR(tp_module_to_dtype(NULL, TP_BF16), TP_ERR_INVALID_ARG);
    tp_module_free(lin);
}

/* DTensor parameters keep their mesh, placements and global shape. */
typedef struct dt_ctx {
    tp_test_slot slot[TP_TEST_MAX_RANKS];
} dt_ctx;

static tp_status cast_dtensor_body(tp_comm *w, void *arg)
{
    dt_ctx *c = arg;
    tp_test_slot *s = &c->slot[tp_comm_rank(w)];
    tp_mesh *mesh = NULL;
    tp_module *lin = NULL;
    tp_tensor *full_w = NULL, *full_g = NULL, *dw = NULL, *dg = NULL, *db = NULL;
    RANK_OK(s, tp_mesh_create(w, 1, (int64_t[]){tp_comm_size(w)}, NULL, &mesh));
    RANK_OK(s, tp_nn_linear_create(6, 5, true, &lin));
    RANK_OK(s, tp_module_init(lin, 3));
    const tp_placement sh0[] = {tp_shard(0)}, rep[] = {tp_replicate()};
    RANK_OK(s, tp_dtensor_distribute(mesh, tp_module_parameter(lin, "weight"), 1, sh0, -1, &dw));
    RANK_OK(s, tp_dtensor_distribute(mesh, tp_module_parameter(lin, "bias"), 1, rep, -1, &db));
    RANK_OK(s, tp_module_set_parameter(lin, "weight", dw));
    RANK_OK(s, tp_module_set_parameter(lin, "bias", db));
    RANK_OK(s, tp_test_global_tensor(2, (int64_t[]){5, 6}, 9, &full_g));
    RANK_OK(s, tp_tensor_fill_random(full_g, TP_RNG_NORMAL, 0, 1, 9, NULL, NULL));
    RANK_OK(s, tp_dtensor_distribute(mesh, full_g, 1, sh0, -1, &dg));
    RANK_OK(s, tp_tensor_set_grad(dw, dg));
    RANK_OK(s, tp_module_to_dtype(lin, TP_BF16));
    tp_tensor *nw = tp_module_parameter(lin, "weight"), *nb = tp_module_parameter(lin, "bias");
    tp_tensor *olds[2] = {dw, db}, *news[2] = {nw, nb};
    const tp_placement *want[2] = {sh0, rep};
    for (int k = 0; k < 2; k++) {
        tp_tensor *o = olds[k], *n = news[k];
        RANK_EXPECT(s,
                    tp_tensor_is_dtensor(n) && tp_dtensor_mesh(n) == mesh &&
                        tp_test_placement_eq(tp_dtensor_placements(n)[0], want[k][0]),
                    "parameter %d lost its mesh or placement", k);
        RANK_EXPECT(s,
                    tp_tensor_ndim(n) == tp_tensor_ndim(o) &&
                        !memcmp(tp_tensor_shape(n), tp_tensor_shape(o),
                                (size_t)tp_tensor_ndim(o) * sizeof(int64_t)),
                    "parameter %d changed its global shape", k);
        tp_tensor *nl = tp_dtensor_local(n), *ol = tp_dtensor_local(o);
        RANK_EXPECT(s, tp_tensor_dtype(nl) == TP_BF16, "parameter %d's shard is %s", k,
                    tp_dtype_name(tp_tensor_dtype(nl)));
        for (int64_t i = 0; i < tp_tensor_numel(ol); i++)
            RANK_EXPECT(s, elem(nl, i) == round_to(elem(ol, i), TP_BF16),
                        "parameter %d shard[%lld]: %g, expected %g", k, (long long)i, elem(nl, i),
                        round_to(elem(ol, i), TP_BF16));
    }
    tp_tensor *g = tp_tensor_grad(nw);
    RANK_EXPECT(s,
                g && tp_tensor_is_dtensor(g) &&
                    tp_test_placement_eq(tp_dtensor_placements(g)[0], sh0[0]) &&
                    tp_tensor_dtype(tp_dtensor_local(g)) == TP_BF16,
                "the weight's gradient is not a bf16 Shard(0) DTensor");
    for (int64_t i = 0; g && i < tp_tensor_numel(tp_dtensor_local(dg)); i++)
        RANK_EXPECT(
            s, elem(tp_dtensor_local(g), i) == round_to(elem(tp_dtensor_local(dg), i), TP_BF16),
            "gradient shard[%lld] not rounded", (long long)i);
    tp_tensor_release(dw);
    tp_tensor_release(db);
    tp_tensor_release(dg);
    tp_tensor_release(full_g);
    tp_tensor_release(full_w);
    tp_module_free(lin);
    tp_mesh_free(mesh);
    return TP_OK;
}

ParameterizedTestParameters(mixed, module_to_dtype_dtensor_parameters)
{
    static int sizes[] = {1, 2, 3};
    return cr_make_param_array(int, sizes, 3);
}

ParameterizedTest(int *n, mixed, module_to_dtype_dtensor_parameters, .timeout = 60)
{
    dt_ctx c = {0};
    tp_test_run(*n, cast_dtensor_body, &c, c.slot);
}

/* ---- master weights ------------------------------------------------------------ */

/* A module holding one [1, n] parameter of dtype dt with values vals. */
static void param_module(tp_dtype dt, int64_t n, const double *vals, tp_module **m)
{
    tp_tensor *w = NULL;
    CHECK_OK(tensor_of(dt, 2, (int64_t[]){1, n}, vals, &w));
    CHECK_OK(tp_tensor_set_requires_grad(w, true));
    CHECK_OK(holder(w, m));
    tp_tensor_release(w);
}

static void set_grad(tp_module *m, const double *vals)
{
    tp_tensor *w = tp_module_parameter(m, "w"), *g = NULL;
    CHECK_OK(tensor_of(tp_tensor_dtype(w), 2, tp_tensor_shape(w), vals, &g));
    CHECK_OK(tp_tensor_set_grad(w, g));
    tp_tensor_release(g);
}

#define NW 4

/* Updates below half an ulp: lost by the stateless tp_sgd_step, accumulated
 * by tp_sgd's master (exact: every master value is a short f32). */
Test(mixed, sgd_master_accumulates_what_a_lowp_update_loses, .timeout = 30)
{
    const tp_dtype dts[] = {TP_BF16, TP_F16};
    for (int k = 0; k < 2; k++) {
        tp_dtype dt = dts[k];
        /* (i+1) lr below half an ulp under 1 (2^-p) */
        double lr = ldexp(1.0, -sig_bits(dt) - 4);
        double ones[NW] = {1, 1, 1, 1}, g[NW] = {1, 2, 3, 4};
        tp_module *plain = NULL, *master = NULL;
        tp_sgd *opt = NULL;
        param_module(dt, NW, ones, &plain);
        param_module(dt, NW, ones, &master);
        CHECK_OK(tp_sgd_create(master, lr, &opt));
        for (int step = 1; step <= 24; step++) {
            set_grad(plain, g);
            set_grad(master, g);
            CHECK_OK(tp_sgd_step(plain, lr));
            CHECK_OK(tp_sgd_opt_step(opt));
            tp_tensor *pw = tp_module_parameter(plain, "w"), *mw = tp_module_parameter(master, "w");
            for (int i = 0; i < NW; i++) {
                cr_assert(elem(pw, i) == 1.0, "%s plain SGD step %d [%d]: %.9g moved",
                          tp_dtype_name(dt), step, i, elem(pw, i));
                double want = round_to(1.0 - step * g[i] * lr, dt);
                cr_assert(elem(mw, i) == want, "%s master SGD step %d [%d]: %.9g, expected %.9g",
                          tp_dtype_name(dt), step, i, elem(mw, i), want);
            }
        }
        tp_tensor *mw = tp_module_parameter(master, "w");
        for (int i = 0; i < NW; i++)
            cr_assert(elem(mw, i) < 1.0, "%s: the master did not accumulate [%d]",
                      tp_dtype_name(dt), i);
        tp_sgd_free(opt);
        tp_module_free(plain);
        tp_module_free(master);
    }
}

/* Adam in double with a double master; lowp_only: the parameter itself is
 * rounded to dt after every step (no master). */
static void adam_reference(tp_dtype dt, bool lowp_only, int n, const double *p0, int steps,
                           const double *grads /* steps x n */, double lr, double *p)
{
    const double b1 = 0.9, b2 = 0.999, eps = 1e-8;
    double m[64] = {0}, v[64] = {0};
    for (int i = 0; i < n; i++)
        p[i] = p0[i];
    for (int t = 1; t <= steps; t++) {
        double bc1 = 1 - pow(b1, t), bc2 = 1 - pow(b2, t);
        for (int i = 0; i < n; i++) {
            double g = grads[(t - 1) * n + i];
            m[i] = b1 * m[i] + (1 - b1) * g;
            v[i] = b2 * v[i] + (1 - b2) * g * g;
            p[i] -= lr / bc1 * m[i] / (sqrt(v[i]) / sqrt(bc2) + eps);
            if (lowp_only)
                p[i] = round_to(p[i], dt);
        }
    }
}

#define NA 32
#define ASTEPS 6

Test(mixed, adam_master_weights_match_reference, .timeout = 30)
{
    const tp_dtype dts[] = {TP_BF16, TP_F16};
    for (int k = 0; k < 2; k++) {
        tp_dtype dt = dts[k];
        double p0[NA], grads[ASTEPS * NA], ref[NA];
        for (int i = 0; i < NA; i++)
            p0[i] = round_to(2 * tp_rng_uniform(21, (uint64_t)i) - 1, dt);
        for (int i = 0; i < ASTEPS * NA; i++)
            grads[i] = round_to(tp_rng_normal(22, (uint64_t)i) * ldexp(1, (i % 7) - 4), dt);
        tp_module *m = NULL;
        tp_adam *opt = NULL;
        param_module(dt, NA, p0, &m);
        CHECK_OK(tp_adam_create(m, 1e-2, 0, 0, 0, &opt));
        for (int step = 1; step <= ASTEPS; step++) {
            set_grad(m, &grads[(step - 1) * NA]);
            CHECK_OK(tp_adam_step(opt));
            adam_reference(dt, false, NA, p0, step, grads, 1e-2, ref);
            tp_tensor *w = tp_module_parameter(m, "w");
            cr_assert_eq(tp_tensor_dtype(w), dt);
            for (int i = 0; i < NA; i++) {
                /* the master's rounding to dt, plus its f32 drift */
                double tol = ldexp(fabs(ref[i]), -sig_bits(dt)) + 1e-6;
                cr_assert(fabs(elem(w, i) - ref[i]) <= tol,
                          "%s Adam step %d [%d]: %.9g, reference %.9g (tolerance %g)",
                          tp_dtype_name(dt), step, i, elem(w, i), ref[i], tol);
            }
        }
        tp_adam_free(opt);
        tp_module_free(m);
    }
}

/* Adam's steps (about lr each) below half an ulp of 1: a parameter rounded
 * every step stays at 1; the master walks down. */
Test(mixed, adam_master_accumulates_what_a_lowp_update_loses, .timeout = 30)
{
    const tp_dtype dts[] = {TP_BF16, TP_F16};
    for (int k = 0; k < 2; k++) {
        tp_dtype dt = dts[k];
        double lr = ldexp(1.0, -sig_bits(dt) - 2), ones[NW] = {1, 1, 1, 1};
        double grads[16 * NW], ref[NW], lowp[NW];
        for (int i = 0; i < 16 * NW; i++)
            grads[i] = 1.0;
        tp_module *m = NULL;
        tp_adam *opt = NULL;
        param_module(dt, NW, ones, &m);
        CHECK_OK(tp_adam_create(m, lr, 0, 0, 0, &opt));
        for (int step = 1; step <= 16; step++) {
            set_grad(m, grads);
            CHECK_OK(tp_adam_step(opt));
        }
        adam_reference(dt, false, NW, ones, 16, grads, lr, ref);
        adam_reference(dt, true, NW, ones, 16, grads, lr, lowp);
        tp_tensor *w = tp_module_parameter(m, "w");
        for (int i = 0; i < NW; i++) {
            cr_assert(lowp[i] == 1.0, "the %s-only reference moved: %.9g", tp_dtype_name(dt),
                      lowp[i]);
            double tol = ldexp(fabs(ref[i]), -sig_bits(dt)) + 1e-6;
            cr_assert(elem(w, i) < 1.0 && fabs(elem(w, i) - ref[i]) <= tol,
                      "%s Adam with master [%d]: %.9g, reference %.9g", tp_dtype_name(dt), i,
                      elem(w, i), ref[i]);
        }
        tp_adam_free(opt);
        tp_module_free(m);
    }
}

Test(mixed, optimizers_refuse_replaced_and_f64_parameters, .timeout = 30)
{
    double ones[NW] = {1, 1, 1, 1};
    tp_module *m = NULL;
    tp_sgd *sgd = NULL;
    param_module(TP_BF16, NW, ones, &m);
    CHECK_OK(tp_sgd_create(m, 0.5, &sgd));
    set_grad(m, ones);
    CHECK_OK(tp_sgd_opt_step(sgd)); /* makes the master */
    CHECK_OK(tp_module_to_dtype(m, TP_F16));
    set_grad(m, ones);
    CHECK_ERR(tp_sgd_opt_step(sgd), TP_ERR_STATE);
    cr_assert(strstr(tp_last_error(), "replaced"), "unclear message: %s", tp_last_error());
    tp_sgd_free(sgd);
    CHECK_ERR(tp_sgd_create(m, -1, &sgd), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_sgd_create(NULL, 1, &sgd), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_sgd_opt_step(NULL), TP_ERR_INVALID_ARG);
    tp_sgd_free(NULL);
    tp_module_free(m);

    param_module(TP_F64, NW, ones, &m);
    set_grad(m, ones);
    CHECK_ERR(tp_sgd_step(m, 0.5), TP_ERR_NOT_SUPPORTED);
    cr_assert(strstr(tp_last_error(), "'w'") && strstr(tp_last_error(), "f64"),
              "unclear message: %s", tp_last_error());
    tp_module_free(m);
}

/* Every allocation of a cast and of a master step fails in turn: a clean
 * TP_ERR_NO_MEMORY, nothing leaked, and the module unchanged by a failed
 * cast. */
Test(mixed, allocation_failures_are_clean, .timeout = 60)
{
    for (long fail = 0;; fail++) {
        tp_test_alloc a = {.fail_at = -1};
        tp_set_allocator(&(tp_allocator){tp_test_alloc_fn, tp_test_free_fn, &a});
        double ones[NW] = {1, 1, 1, 1};
        tp_module *m = NULL;
        tp_adam *opt = NULL;
        param_module(TP_F32, NW, ones, &m);
        set_grad(m, ones);
        CHECK_OK(tp_adam_create(m, 0, 0, 0, 0, &opt));
        tp_tensor *before = tp_module_parameter(m, "w");
        a.fail_at = a.count + fail;
        tp_status st = tp_module_to_dtype(m, TP_BF16);
        if (st == TP_OK)
            st = tp_adam_step(opt);
        bool reached = a.count <= a.fail_at; /* the failure point was never hit */
        cr_assert(st == TP_OK || st == TP_ERR_NO_MEMORY, "allocation %ld: %s (%s)", fail,
                  tp_status_name(st), tp_last_error());
        if (st != TP_OK && tp_module_parameter(m, "w") == before)
            cr_assert_eq(tp_tensor_dtype(before), TP_F32);
        a.fail_at = -1;
        tp_adam_free(opt);
        tp_module_free(m);
        tp_set_allocator(NULL);
        cr_assert_eq(a.live, 0, "allocation %ld: %ld blocks leaked", fail, a.live);
        if (reached) {
            cr_assert_eq(st, TP_OK);
            break;
        }
    }
}

/* ---- DDP reduce_dtype ------------------------------------------------------------ */

#define KD 12

static tp_status two_linear_fwd(tp_module *self, int nargs, tp_tensor *const *args, int nkw,
                                const tp_kwarg *kw, tp_tensor **out)
{
    (void)nargs, (void)nkw, (void)kw;
    tp_tensor *y1 = NULL, *y2 = NULL, *s1 = NULL, *s2 = NULL;
    tp_status st = tp_linear(args[0], tp_module_parameter(self, "w"), NULL, &y1);
    if (st == TP_OK)
        st = tp_linear(args[0], tp_module_parameter(self, "u"), NULL, &y2);
    if (st == TP_OK)
        st = tp_sum_all(y1, &s1);
    if (st == TP_OK)
        st = tp_sum_all(y2, &s2);
    if (st == TP_OK)
        st = tp_add(s1, s2, out);
    tp_tensor_release(y1);
    tp_tensor_release(y2);
    tp_tensor_release(s1);
    tp_tensor_release(s2);
    return st;
}

/* Rank r's input x[k] = (r+1)(1 + 2^-12 ((k%3)+1)), rounded to dt: the loss
 * sum(x w^T) + sum(x u^T) has gradients w: x, u: [x; x]. In bf16 each
 * rank's x[k] rounds to r+1. */
static double ddp_x(int rank, int k, tp_dtype dt)
{
    return round_to((rank + 1) * (1 + ldexp((k % 3) + 1, -12)), dt);
}

typedef enum { RD_DEFAULT, RD_NO_PASSES, RD_FUSION, RD_N } rd_cfg;
static const char *const rd_name[] = {"default passes", "no passes", "bucket fusion"};

typedef struct rd_ctx {
    tp_test_slot slot[TP_TEST_MAX_RANKS];
    tp_dtype pdt; /* parameter dtype */
    bool has_reduce;
    tp_dtype rdt; /* reduce dtype */
    rd_cfg cfg;
    int64_t all_reduces[TP_TEST_MAX_RANKS], bytes[TP_TEST_MAX_RANKS];
} rd_ctx;

static tp_status rd_module(tp_dtype dt, tp_module **out)
{
    double zeros[2 * KD] = {0};
    tp_tensor *w = NULL, *u = NULL;
    TP_TEST_TRY(tensor_of(dt, 2, (int64_t[]){1, KD}, zeros, &w));
    TP_TEST_TRY(tensor_of(dt, 2, (int64_t[]){2, KD}, zeros, &u));
    TP_TEST_TRY(tp_tensor_set_requires_grad(w, true));
    TP_TEST_TRY(tp_tensor_set_requires_grad(u, true));
    TP_TEST_TRY(tp_nn_custom_create("TwoLinear", two_linear_fwd, NULL, NULL, out));
    TP_TEST_TRY(tp_module_register_parameter(*out, "w", w));
    TP_TEST_TRY(tp_module_register_parameter(*out, "u", u));
    tp_tensor_release(w);
    tp_tensor_release(u);
    return TP_OK;
}

static tp_status rd_body(tp_comm *world, void *arg)
{
    rd_ctx *c = arg;
    int rank = tp_comm_rank(world), n = tp_comm_size(world);
    tp_test_slot *s = &c->slot[rank];
    tp_module *m = NULL;
    tp_ddp *ddp = NULL;
    tp_comm_debug *dbg = NULL;
    tp_tensor *x = NULL, *loss = NULL;
    RANK_OK(s, rd_module(c->pdt, &m));
    tp_ddp_options o = {.has_reduce_dtype = c->has_reduce,
                        .reduce_dtype = c->rdt,
                        .manual_passes = c->cfg != RD_DEFAULT};
    RANK_OK(s, tp_ddp_create(m, world, &o, &ddp));
    if (c->cfg == RD_FUSION)
        RANK_OK(s, tp_pass_apply(tp_pass_bucket_fusion(), tp_ddp_graph(ddp)));
    double xv[KD];
    for (int k = 0; k < KD; k++)
        xv[k] = ddp_x(rank, k, c->pdt);
    RANK_OK(s, tensor_of(c->pdt, 2, (int64_t[]){1, KD}, xv, &x));
    RANK_OK(s, tp_comm_debug_create(&dbg));
    for (int step = 0; step < 2; step++) {
        if (step == 1)
            RANK_OK(s, tp_comm_debug_begin(dbg)); /* step 0 also agrees on the order */
        RANK_OK(s, tp_module_call(m, x, &loss));
        RANK_OK(s, tp_backward(loss, NULL));
        RANK_OK(s, tp_ddp_sync(ddp));
        if (step == 1)
            RANK_OK(s, tp_comm_debug_end(dbg));
        tp_tensor_release(loss);
        loss = NULL;
        tp_tensor *gw = tp_tensor_grad(tp_module_parameter(m, "w"));
        tp_tensor *gu = tp_tensor_grad(tp_module_parameter(m, "u"));
        RANK_EXPECT(s, gw && gu && tp_tensor_dtype(gw) == c->pdt && tp_tensor_dtype(gu) == c->pdt,
                    "%s: gradients missing or of another dtype", rd_name[c->cfg]);
        for (int k = 0; gw && gu && k < KD; k++) {
            /* the reference: each rank's gradient in the reduce dtype,
             * averaged, back in the parameter dtype */
            tp_dtype red = c->has_reduce ? c->rdt : c->pdt;
            double sum = 0;
            for (int r = 0; r < n; r++)
                sum += round_to(ddp_x(r, k, c->pdt), red);
            double mean = sum / n, want = round_to(round_to(mean, red), c->pdt);
            /* exact where the mean is representable in the reduce dtype */
            double tol = round_to(mean, red) == mean ? 0 : ldexp(fabs(mean), -sig_bits(red));
            double got[3] = {elem(gw, k), elem(gu, k), elem(gu, KD + k)};
            for (int j = 0; j < 3; j++)
                RANK_EXPECT(s, fabs(got[j] - want) <= tol,
                            "%s step %d: gradient %d[%d] = %.9g, reference %.9g (tol %g)",
                            rd_name[c->cfg], step, j, k, got[j], want, tol);
        }
        tp_module_zero_grad(m);
    }
    c->all_reduces[rank] = tp_comm_debug_count(dbg, TP_COLL_ALL_REDUCE);
    c->bytes[rank] = tp_comm_debug_bytes(dbg, TP_COLL_ALL_REDUCE);
    RANK_EXPECT(s, tp_comm_debug_total(dbg) == c->all_reduces[rank],
                "%s: collectives besides the all_reduces", rd_name[c->cfg]);
    tp_comm_debug_free(dbg);
    tp_tensor_release(x);
    tp_ddp_free(ddp);
    tp_module_free(m);
    return TP_OK;
}

typedef struct rd_param {
    int world;
    tp_dtype pdt, rdt;
} rd_param;

/* Runs the model with and without reduce_dtype; both reduce the same
 * number of times; the reduced one moves 3 KD elements of rdt per step. */
static void rd_check(const rd_param *p)
{
    for (int cfg = 0; cfg < RD_N; cfg++) {
        rd_ctx with = {.pdt = p->pdt, .has_reduce = true, .rdt = p->rdt, .cfg = (rd_cfg)cfg};
        rd_ctx without = {.pdt = p->pdt, .cfg = (rd_cfg)cfg};
        tp_test_run(p->world, rd_body, &with, with.slot);
        tp_test_run(p->world, rd_body, &without, without.slot);
        int64_t want = cfg == RD_NO_PASSES ? 2 : 1; /* one bucket fused, else one per parameter */
        for (int r = 0; r < p->world; r++) {
            if (!tp_test_rank_is_local(r))
                continue;
            cr_assert_eq(with.all_reduces[r], want, "%s: %lld all_reduces with reduce_dtype",
                         rd_name[cfg], (long long)with.all_reduces[r]);
            cr_assert_eq(without.all_reduces[r], want, "%s: %lld all_reduces without", rd_name[cfg],
                         (long long)without.all_reduces[r]);
            cr_assert_eq(with.bytes[r], 3 * KD * (int64_t)tp_dtype_size(p->rdt),
                         "%s: %lld bytes all_reduced in %s", rd_name[cfg], (long long)with.bytes[r],
                         tp_dtype_name(p->rdt));
        }
    }
}

/* f32 parameters reduced in bf16: each rank's gradient (r+1)(1+eps) rounds
 * to r+1 before the average, which is then exact: (W+1)/2. */
ParameterizedTestParameters(mixed, ddp_reduce_dtype_f32_params_in_bf16)
{
    static rd_param p[] = {{1, TP_F32, TP_BF16}, {2, TP_F32, TP_BF16}, {3, TP_F32, TP_BF16}};
    return cr_make_param_array(rd_param, p, 3);
}

ParameterizedTest(rd_param *p, mixed, ddp_reduce_dtype_f32_params_in_bf16, .timeout = 120)
{
    rd_check(p);
}

static tp_status rd_views_body(tp_comm *world, void *arg)
{
    rd_ctx *c = arg;
    tp_test_slot *s = &c->slot[tp_comm_rank(world)];
    tp_module *m = NULL;
    tp_ddp *ddp = NULL;
    RANK_OK(s, rd_module(TP_F32, &m));
    tp_ddp_options o = {
        .has_reduce_dtype = true, .reduce_dtype = TP_BF16, .gradient_as_bucket_view = true};
    tp_status st = tp_ddp_create(m, world, &o, &ddp);
    RANK_EXPECT(s, st == TP_ERR_NOT_SUPPORTED && strstr(tp_last_error(), "reduce_dtype") && !ddp,
                "views with a converting reduce_dtype: %s (%s)", tp_status_name(st),
                tp_last_error());
    o = (tp_ddp_options){.has_reduce_dtype = true, .reduce_dtype = TP_F64};
    st = tp_ddp_create(m, world, &o, &ddp);
    RANK_EXPECT(s, st == TP_ERR_INVALID_ARG && strstr(tp_last_error(), "f64") && !ddp,
                "reduce_dtype f64: %s (%s)", tp_status_name(st), tp_last_error());
    /* reduce_dtype equal to the parameters' dtype: views allowed */
    o = (tp_ddp_options){
        .has_reduce_dtype = true, .reduce_dtype = TP_F32, .gradient_as_bucket_view = true};
    RANK_OK(s, tp_ddp_create(m, world, &o, &ddp));
    tp_ddp_free(ddp);
    tp_module_free(m);
    return TP_OK;
}

Test(mixed, ddp_reduce_dtype_refusals, .timeout = 60)
{
    for (int n = 1; n <= 2; n++) {
        rd_ctx c = {0};
        tp_test_run(n, rd_views_body, &c, c.slot);
    }
}

/* ---- grad scaler ----------------------------------------------------------------- */

static void scaler_check(tp_grad_scaler *gs, double scale, int tracker, const char *when)
{
    cr_assert(tp_grad_scaler_get_scale(gs) == scale, "%s: scale %g, expected %g", when,
              tp_grad_scaler_get_scale(gs), scale);
    cr_assert_eq(tp_grad_scaler_growth_tracker(gs), tracker, "%s: tracker %d, expected %d", when,
                 tp_grad_scaler_growth_tracker(gs), tracker);
}

/* One check-and-update with a finite or an infinite gradient. */
static void scaler_round(tp_grad_scaler *gs, tp_module *m, bool inf)
{
    double g[NW] = {1, 2, 3, inf ? INFINITY : 4};
    set_grad(m, g);
    bool found = !inf;
    CHECK_OK(tp_grad_scaler_unscale(gs, m, &found));
    cr_assert_eq(found, inf, "found_inf %d, expected %d", found, inf);
    CHECK_OK(tp_grad_scaler_update(gs));
}

Test(mixed, grad_scaler_schedule_is_exact, .timeout = 60)
{
    double ones[NW] = {1, 1, 1, 1};
    tp_module *m = NULL;
    tp_grad_scaler *gs = NULL;
    param_module(TP_F32, NW, ones, &m);
    /* torch.amp.GradScaler's defaults */
    CHECK_OK(tp_grad_scaler_create(NULL, NULL, &gs));
    scaler_check(gs, 65536, 0, "created");
    for (int i = 1; i < 2000; i++)
        scaler_round(gs, m, false);
    scaler_check(gs, 65536, 1999, "1999 good steps");
    scaler_round(gs, m, false);
    scaler_check(gs, 131072, 0, "2000 good steps");
    scaler_round(gs, m, false);
    scaler_round(gs, m, true);
    scaler_check(gs, 65536, 0, "an overflow");
    scaler_round(gs, m, true);
    scaler_check(gs, 32768, 0, "two overflows");
    tp_grad_scaler_free(gs);
    /* other factors, and NaN counts as inf */
    tp_grad_scaler_options o = {
        .init_scale = 8, .growth_factor = 3, .backoff_factor = 0.25, .growth_interval = 2};
    CHECK_OK(tp_grad_scaler_create(NULL, &o, &gs));
    scaler_round(gs, m, false);
    scaler_check(gs, 8, 1, "custom, 1 good");
    scaler_round(gs, m, false);
    scaler_check(gs, 24, 0, "custom, 2 good");
    double nan_g[NW] = {1, NAN, 1, 1};
    set_grad(m, nan_g);
    bool found = false;
    CHECK_OK(tp_grad_scaler_unscale(gs, m, &found));
    cr_assert(found, "a NaN gradient was not found");
    /* once per step; update needs a check */
    CHECK_ERR(tp_grad_scaler_unscale(gs, m, &found), TP_ERR_STATE);
    CHECK_OK(tp_grad_scaler_update(gs));
    scaler_check(gs, 6, 0, "custom, NaN");
    CHECK_ERR(tp_grad_scaler_update(gs), TP_ERR_STATE);
    tp_grad_scaler_free(gs);
    /* options */
    const tp_grad_scaler_options bad[] = {{.init_scale = -1},       {.init_scale = INFINITY},
                                          {.growth_factor = 0.5},   {.backoff_factor = 1},
                                          {.backoff_factor = -0.5}, {.growth_interval = -3}};
    for (int i = 0; i < 6; i++) {
        CHECK_ERR(tp_grad_scaler_create(NULL, &bad[i], &gs), TP_ERR_INVALID_ARG);
        cr_assert_null(gs);
    }
    CHECK_ERR(tp_grad_scaler_create(NULL, NULL, NULL), TP_ERR_INVALID_ARG);
    tp_grad_scaler_free(NULL);
    tp_module_free(m);
}

#define SSTEPS 6

typedef struct gs_ctx {
    tp_test_slot slot[TP_TEST_MAX_RANKS];
    bool adam;
} gs_ctx;

/* Step s: rank s % W puts an inf in its gradient on odd steps. Every rank
 * skips those steps (one found-inf all_reduce each), and steps the others
 * with the gradient divided by the scale: equal to an optimizer fed the
 * unscaled gradient. */
static tp_status gs_body(tp_comm *w, void *arg)
{
    gs_ctx *c = arg;
    int rank = tp_comm_rank(w), n = tp_comm_size(w);
    tp_test_slot *s = &c->slot[rank];
    double p0[NW] = {1, -2, 0.5, 4};
    tp_module *m = NULL, *ref = NULL;
    tp_grad_scaler *gs = NULL;
    tp_sgd *sgd = NULL, *sgd_ref = NULL;
    tp_adam *adam = NULL, *adam_ref = NULL;
    tp_comm_debug *dbg = NULL;
    param_module(TP_F32, NW, p0, &m);
    param_module(TP_F32, NW, p0, &ref);
    tp_grad_scaler_options o = {.init_scale = 1024, .growth_interval = 2};
    RANK_OK(s, tp_grad_scaler_create(w, &o, &gs));
    if (c->adam) {
        RANK_OK(s, tp_adam_create(m, 0.1, 0, 0, 0, &adam));
        RANK_OK(s, tp_adam_create(ref, 0.1, 0, 0, 0, &adam_ref));
    } else {
        RANK_OK(s, tp_sgd_create(m, 0.25, &sgd));
        RANK_OK(s, tp_sgd_create(ref, 0.25, &sgd_ref));
    }
    RANK_OK(s, tp_comm_debug_create(&dbg));
    double scale = 1024;
    int good = 0;
    for (int step = 0; step < SSTEPS; step++) {
        bool overflow = step % 2 == 1;
        double g[NW], gref[NW];
        for (int i = 0; i < NW; i++) {
            gref[i] = (i + 1) * 0.5 * (step + 1);
            g[i] = gref[i] * scale; /* exact: powers of two apart */
        }
        if (overflow && rank == step % n)
            g[step % NW] = INFINITY;
        set_grad(m, g);
        bool stepped = !overflow;
        RANK_OK(s, tp_comm_debug_begin(dbg));
        RANK_OK(s, c->adam ? tp_grad_scaler_step_adam(gs, adam, &stepped)
                           : tp_grad_scaler_step_sgd(gs, sgd, &stepped));
        RANK_OK(s, tp_comm_debug_end(dbg));
        RANK_EXPECT(
            s, tp_comm_debug_count(dbg, TP_COLL_ALL_REDUCE) == 1 && tp_comm_debug_total(dbg) == 1,
            "step %d: %lld all_reduces, %lld collectives (one found-inf flag expected)", step,
            (long long)tp_comm_debug_count(dbg, TP_COLL_ALL_REDUCE),
            (long long)tp_comm_debug_total(dbg));
        RANK_EXPECT(s, stepped == !overflow, "step %d: stepped %d", step, stepped);
        RANK_OK(s, tp_grad_scaler_update(gs));
        if (!overflow) {
            set_grad(ref, gref);
            RANK_OK(s, c->adam ? tp_adam_step(adam_ref) : tp_sgd_opt_step(sgd_ref));
            if (++good == 2) {
                scale *= 2;
                good = 0;
            }
        } else {
            scale *= 0.5;
            good = 0;
        }
        RANK_EXPECT(s, tp_grad_scaler_get_scale(gs) == scale, "step %d: scale %g, expected %g",
                    step, tp_grad_scaler_get_scale(gs), scale);
        tp_tensor *pw = tp_module_parameter(m, "w"), *rw = tp_module_parameter(ref, "w");
        for (int i = 0; i < NW; i++)
            RANK_EXPECT(s, elem(pw, i) == elem(rw, i), "step %d [%d]: %.9g, reference %.9g", step,
                        i, elem(pw, i), elem(rw, i));
    }
    tp_comm_debug_free(dbg);
    tp_sgd_free(sgd);
    tp_sgd_free(sgd_ref);
    tp_adam_free(adam);
    tp_adam_free(adam_ref);
    tp_grad_scaler_free(gs);
    tp_module_free(m);
    tp_module_free(ref);
    return TP_OK;
}

ParameterizedTestParameters(mixed, grad_scaler_skips_overflowing_steps_on_every_rank)
{
    static int sizes[] = {1, 2, 3};
    return cr_make_param_array(int, sizes, 3);
}

ParameterizedTest(int *n, mixed, grad_scaler_skips_overflowing_steps_on_every_rank, .timeout = 60)
{
    for (int adam = 0; adam <= 1; adam++) {
        gs_ctx c = {.adam = adam};
        tp_test_run(*n, gs_body, &c, c.slot);
    }
}

/* f16 gradients scaled by 2^16: the true gradient 2^-26 is below f16's
 * smallest subnormal (2^-24), so it survives only if unscaled in f32; with
 * lr 2^14 and tp_sgd's f32 master, two steps move the parameter from 1 to
 * 1 - 2^-11 (one step: 1 - 2^-12, a tie that rounds back to 1). */
Test(mixed, grad_scaler_unscales_f16_gradients_in_f32, .timeout = 30)
{
    double ones[NW] = {1, 1, 1, 1}, g[NW];
    for (int i = 0; i < NW; i++)
        g[i] = ldexp(1, -10); /* 2^-26 * 2^16 */
    tp_module *m = NULL;
    tp_sgd *opt = NULL;
    tp_grad_scaler *gs = NULL;
    param_module(TP_F16, NW, ones, &m);
    CHECK_OK(tp_sgd_create(m, ldexp(1, 14), &opt));
    CHECK_OK(tp_grad_scaler_create(NULL, NULL, &gs));
    for (int step = 1; step <= 2; step++) {
        set_grad(m, g);
        bool stepped = false;
        CHECK_OK(tp_grad_scaler_step_sgd(gs, opt, &stepped));
        cr_assert(stepped);
        CHECK_OK(tp_grad_scaler_update(gs));
        tp_tensor *w = tp_module_parameter(m, "w");
        double want = step == 1 ? 1.0 : 1.0 - ldexp(1, -11);
        for (int i = 0; i < NW; i++)
            cr_assert(elem(w, i) == want, "step %d [%d]: %.9g, expected %.9g", step, i, elem(w, i),
                      want);
        /* the gradient itself stays scaled */
        cr_assert(elem(tp_tensor_grad(w), 0) == ldexp(1, -10));
    }
    tp_grad_scaler_free(gs);
    tp_sgd_free(opt);
    tp_module_free(m);
}

/* Low-precision parameters reduced in f32 (real backward in bf16/f16): the
 * gradients are the f32 average rounded once, the all_reduces those of the
 * f32 model (one bucket, or one per parameter), moving f32 bytes. */
ParameterizedTestParameters(mixed, ddp_reduce_dtype_lowp_params_in_f32)
{
    static rd_param p[] = {{1, TP_BF16, TP_F32},
                           {2, TP_BF16, TP_F32},
                           {3, TP_BF16, TP_F32},
                           {2, TP_F16, TP_F32},
                           {3, TP_F16, TP_F32}};
    return cr_make_param_array(rd_param, p, 5);
}

ParameterizedTest(rd_param *p, mixed, ddp_reduce_dtype_lowp_params_in_f32, .timeout = 120)
{
    rd_check(p);
}

/* ---- training in low precision ----------------------------------------------------- */

enum { TB = 16, TIN = 8, THID = 32, TOUT = 4, TSTEPS = 30 };

static tp_status mlp_fwd(tp_module *self, int nargs, tp_tensor *const *args, int nkw,
                         const tp_kwarg *kw, tp_tensor **out)
{
    (void)nargs, (void)nkw, (void)kw;
    tp_tensor *h = NULL, *a = NULL;
    tp_status st = tp_module_call(tp_module_child(self, "net1"), args[0], &h);
    if (st == TP_OK)
        st = tp_relu(h, &a);
    if (st == TP_OK)
        st = tp_module_call(tp_module_child(self, "net2"), a, out);
    tp_tensor_release(h);
    tp_tensor_release(a);
    return st;
}

/* loss = mean((mlp(x) - t)^2) */
static tp_status mse(tp_module *m, tp_tensor *x, tp_tensor *t, tp_tensor **loss)
{
    tp_tensor *y = NULL, *neg = NULL, *d = NULL, *sq = NULL;
    tp_status st = tp_module_call(m, x, &y);
    if (st == TP_OK)
        st = tp_scale(t, -1.0, &neg);
    if (st == TP_OK)
        st = tp_add(y, neg, &d);
    if (st == TP_OK)
        st = tp_mul(d, d, &sq);
    if (st == TP_OK)
        st = tp_mean_all(sq, loss);
    tp_tensor_release(y);
    tp_tensor_release(neg);
    tp_tensor_release(d);
    tp_tensor_release(sq);
    return st;
}

typedef struct train_run {
    tp_dtype dt;
    bool adam;
    double loss[TSTEPS];
    int skipped; /* steps the scaler skipped (f16) */
} train_run;

/* Trains the MLP TSTEPS steps in run->dt: cast after init, Adam or tp_sgd
 * (f32 masters), f16 through a default grad scaler. */
static void train(train_run *run)
{
    tp_module *m = NULL, *c = NULL;
    CHECK_OK(tp_nn_custom_create("MLP", mlp_fwd, NULL, NULL, &m));
    CHECK_OK(tp_nn_linear_create(TIN, THID, true, &c));
    CHECK_OK(tp_module_add_child(m, "net1", c));
    CHECK_OK(tp_nn_linear_create(THID, TOUT, true, &c));
    CHECK_OK(tp_module_add_child(m, "net2", c));
    CHECK_OK(tp_module_init(m, 5));
    CHECK_OK(tp_module_to_dtype(m, run->dt));
    tp_tensor *x = NULL, *t = NULL;
    CHECK_OK(tp_tensor_empty(run->dt, TP_CPU, 2, (int64_t[]){TB, TIN}, &x));
    CHECK_OK(tp_tensor_fill_random(x, TP_RNG_NORMAL, 0, 1, 6, NULL, NULL));
    CHECK_OK(tp_tensor_empty(run->dt, TP_CPU, 2, (int64_t[]){TB, TOUT}, &t));
    CHECK_OK(tp_tensor_fill_random(t, TP_RNG_NORMAL, 0, 1, 7, NULL, NULL));
    tp_adam *adam = NULL;
    tp_sgd *sgd = NULL;
    tp_grad_scaler *gs = NULL;
    if (run->adam)
        CHECK_OK(tp_adam_create(m, 1e-2, 0, 0, 0, &adam));
    else
        CHECK_OK(tp_sgd_create(m, 0.1, &sgd));
    if (run->dt == TP_F16) /* 2^16 times a loss near 1 would overflow f16 */
        CHECK_OK(tp_grad_scaler_create(NULL, &(tp_grad_scaler_options){.init_scale = 1024}, &gs));
    for (int step = 0; step < TSTEPS; step++) {
        tp_tensor *loss = NULL, *scaled = NULL;
        CHECK_OK(mse(m, x, t, &loss));
        cr_assert_eq(tp_tensor_dtype(loss), run->dt, "the loss is %s",
                     tp_dtype_name(tp_tensor_dtype(loss)));
        CHECK_OK(tp_tensor_get(loss, NULL, &run->loss[step]));
        if (gs) {
            bool stepped = false;
            CHECK_OK(tp_grad_scaler_scale(gs, loss, &scaled));
            CHECK_OK(tp_backward(scaled, NULL));
            CHECK_OK(run->adam ? tp_grad_scaler_step_adam(gs, adam, &stepped)
                               : tp_grad_scaler_step_sgd(gs, sgd, &stepped));
            CHECK_OK(tp_grad_scaler_update(gs));
            run->skipped += !stepped;
        } else {
            CHECK_OK(tp_backward(loss, NULL));
            CHECK_OK(run->adam ? tp_adam_step(adam) : tp_sgd_opt_step(sgd));
        }
        tp_module_zero_grad(m);
        tp_tensor_release(scaled);
        tp_tensor_release(loss);
    }
    tp_grad_scaler_free(gs);
    tp_adam_free(adam);
    tp_sgd_free(sgd);
    tp_tensor_release(x);
    tp_tensor_release(t);
    tp_module_free(m);
}

/* The low-precision run's loss follows the f32 run's: every step within
 * tol (relative), no step skipped, and the training actually reduced the
 * loss. */
Test(mixed, lowp_mlp_training_follows_f32, .timeout = 120)
{
    const tp_dtype dts[] = {TP_BF16, TP_F16};
    const double tol[] = {2e-2, 5e-3};
    for (int adam = 0; adam <= 1; adam++) {
        train_run ref = {.dt = TP_F32, .adam = adam};
        train(&ref);
        cr_assert(ref.loss[TSTEPS - 1] < 0.8 * ref.loss[0], "f32 did not train: %g -> %g",
                  ref.loss[0], ref.loss[TSTEPS - 1]);
        for (int k = 0; k < 2; k++) {
            train_run lp = {.dt = dts[k], .adam = adam};
            train(&lp);
            cr_assert_eq(lp.skipped, 0, "%s: %d steps skipped", tp_dtype_name(dts[k]), lp.skipped);
            for (int s = 0; s < TSTEPS; s++) {
                double want = ref.loss[s], rel = fabs(lp.loss[s] - want) / want;
                cr_assert(rel <= tol[k], "%s %s step %d: loss %.6f, f32 %.6f (relative %.3g > %g)",
                          tp_dtype_name(dts[k]), adam ? "Adam" : "SGD", s, lp.loss[s], want, rel,
                          tol[k]);
            }
        }
    }
}
