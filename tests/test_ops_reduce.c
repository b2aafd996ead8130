/* sum, sum_all, mean, mean_all, softmax, layer_norm and rms_norm.
 *
 * Plain tensors are checked against naive double-precision loops written
 * here. DTensors (1-D meshes of 1..4 ranks, 2x2 and 2x3 meshes, uneven shapes
 * with a dim smaller than the mesh) are checked against the same op on plain
 * tensors: the forward (full_tensor) and every input gradient (full_tensor
 * of the gradient, which reduces a Partial one), for every strategy and for
 * layouts that need redistribution, plus the output / gradient placements of
 * the key strategies and the collectives the sequence-parallel norm issues.
 *
 * Inputs are small integers (RANDINT in [-4, 5)), so sums, and the gradients
 * of sum and mean, are exact and compared exactly. Everything else (mean's
 * value, softmax, the norms) is compared with |a - b| <= ATOL + RTOL * |b|,
 * RTOL = 1e-5 and ATOL = 1e-5, in f32. */
#include <math.h>

#include "tp_test.h"

#define RTOL 1e-5
#define ATOL 1e-5
#define EPS 1e-5

enum { OP_SUM, OP_SUM_ALL, OP_MEAN, OP_MEAN_ALL, OP_SOFTMAX, OP_LN, OP_RMS };

static const char *const op_names[] = {"sum",     "sum_all",    "mean",    "mean_all",
                                       "softmax", "layer_norm", "rms_norm"};

typedef struct {
    int kind;
    int dim;
    bool keepdim;
} red_op;

static tp_status apply(const red_op *o, tp_tensor *const *in, tp_tensor **y)
{
    switch (o->kind) {
    case OP_SUM:
        return tp_sum(in[0], o->dim, o->keepdim, y);
    case OP_SUM_ALL:
        return tp_sum_all(in[0], y);
    case OP_MEAN:
        return tp_mean(in[0], o->dim, o->keepdim, y);
    case OP_MEAN_ALL:
        return tp_mean_all(in[0], y);
    case OP_SOFTMAX:
        return tp_softmax(in[0], o->dim, y);
    case OP_LN:
        return tp_layer_norm(in[0], in[1], in[2], EPS, y);
    default:
        return tp_rms_norm(in[0], in[1], EPS, y);
    }
}

static bool exact_op(int kind) { return kind == OP_SUM || kind == OP_SUM_ALL; }

/* ---- helpers ----------------------------------------------------------------- */

static tp_status randint(int nd, const int64_t *shape, uint64_t seed, tp_tensor **t)
{
    TP_TEST_TRY(tp_tensor_zeros(TP_F32, TP_CPU, nd, shape, t));
    return tp_tensor_fill_random(*t, TP_RNG_RANDINT, -4, 5, seed, NULL, NULL);
}

static bool pl_eq(tp_placement a, tp_placement b)
{
    if (a.kind != b.kind)
        return false;
    if (a.kind == TP_PLACEMENT_SHARD)
        return a.dim == b.dim;
    if (a.kind == TP_PLACEMENT_PARTIAL)
        return a.op == b.op;
    return true;
}

static bool pls_eq(int n, const tp_placement *a, const tp_placement *b)
{
    for (int i = 0; i < n; i++)
        if (!pl_eq(a[i], b[i]))
            return false;
    return true;
}

/* The seed of the term of a Partial input held by coordinate c. */
static uint64_t term_seed(uint64_t seed, int64_t c) { return seed * 131 + 7 + (uint64_t)c; }

/* An input: the plain global tensor and the DTensor with placements pl. A
 * Partial placement (on at most one mesh dim, of size W) makes coordinate c
 * of that mesh dim hold term c (a RANDINT tensor of its own); the global
 * value is the sum of the W terms. */
static tp_status make_input(tp_mesh *mesh, int nd, const int64_t *shape, const tp_placement *pl,
                            uint64_t seed, tp_tensor **full, tp_tensor **dt)
{
    int m = tp_mesh_ndim(mesh), pd = -1;
    for (int d = 0; d < m; d++)
        if (pl[d].kind == TP_PLACEMENT_PARTIAL)
            pd = d;
    if (pd < 0) {
        TP_TEST_TRY(randint(nd, shape, seed, full));
        return tp_dtensor_distribute(mesh, *full, m, pl, -1, dt);
    }
    /* the global value: the sum of the terms */
    int64_t w = tp_mesh_size(mesh, pd);
    TP_TEST_TRY(tp_tensor_zeros(TP_F32, TP_CPU, nd, shape, full));
    float *f = tp_tensor_data(*full);
    int64_t n = tp_tensor_numel(*full);
    for (int64_t c = 0; c < w; c++) {
        tp_tensor *t = NULL;
        TP_TEST_TRY(randint(nd, shape, term_seed(seed, c), &t));
        const float *td = tp_tensor_data(t);
        for (int64_t i = 0; i < n; i++)
            f[i] += td[i];
        tp_tensor_release(t);
    }
    /* this rank's block of its term */
    tp_placement np[2];
    for (int d = 0; d < m; d++)
        np[d] = d == pd ? tp_replicate() : pl[d];
    int64_t lshape[8], off[8];
    TP_TEST_TRY(tp_dtensor_shard_extent(mesh, nd, shape, m, np, NULL, lshape, off));
    tp_tensor *local = NULL;
    TP_TEST_TRY(tp_tensor_zeros(TP_F32, TP_CPU, nd, lshape, &local));
    tp_status st = tp_tensor_fill_random(local, TP_RNG_RANDINT, -4, 5,
                                         term_seed(seed, tp_mesh_coord(mesh, pd)), shape, off);
    tp_from_local_options o = {.global_shape = shape};
    if (st == TP_OK)
        st = tp_dtensor_from_local(mesh, local, m, pl, &o, dt);
    tp_tensor_release(local);
    return st;
}

static tp_status compare(tp_test_slot *s, const tp_tensor *got, const tp_tensor *want,
                         bool exact, const char *label, const char *what)
{
    bool ok = false;
    if (exact)
        TP_TEST_TRY(tp_tensor_equal(got, want, &ok));
    else
        TP_TEST_TRY(tp_tensor_allclose(got, want, RTOL, ATOL, &ok));
    if (!ok) {
        double diff = -1;
        if (tp_tensor_ndim(got) == tp_tensor_ndim(want))
            (void)tp_tensor_max_abs_diff(got, want, &diff);
        RANK_EXPECT(s, 0, "%s: %s differs from the single-rank result (max |diff| %g)", label,
                    what, diff);
    }
    return TP_OK;
}

/* ---- one distributed case -------------------------------------------------------- */

typedef struct {
    bool present;
    bool requires_grad;
    int nd;
    int64_t shape[3];
    tp_placement pl[2];
} arg_desc;

typedef struct {
    red_op op;
    int n_in;
    arg_desc in[3];
    const tp_placement *want_out;   /* expected output placements, or NULL */
    const tp_placement *want_wgrad; /* expected placements of weight's gradient, or NULL */
} red_case;

static tp_status check_case(tp_test_slot *s, tp_mesh *mesh, const red_case *c, const char *label)
{
    int m = tp_mesh_ndim(mesh);
    tp_tensor *full[3] = {0}, *dt[3] = {0}, *yp = NULL, *yd = NULL, *yfull = NULL, *g = NULL;
    for (int i = 0; i < c->n_in; i++) {
        const arg_desc *a = &c->in[i];
        if (!a->present)
            continue;
        RANK_OK(s, make_input(mesh, a->nd, a->shape, a->pl, 100 + (uint64_t)i, &full[i], &dt[i]));
        RANK_OK(s, tp_tensor_set_requires_grad(full[i], a->requires_grad));
        RANK_OK(s, tp_tensor_set_requires_grad(dt[i], a->requires_grad));
    }
    bool exact = exact_op(c->op.kind);
    /* reference */
    RANK_OK(s, apply(&c->op, full, &yp));
    RANK_OK(s, randint(tp_tensor_ndim(yp), tp_tensor_shape(yp), 7, &g));
    RANK_OK(s, tp_backward(yp, g));
    /* distributed */
    RANK_OK(s, apply(&c->op, dt, &yd));
    if (c->want_out) {
        char b1[96], b2[96];
        RANK_EXPECT(s, pls_eq(m, tp_dtensor_placements(yd), c->want_out),
                    "%s: output placements %s, expected %s", label,
                    tp_placements_str(m, tp_dtensor_placements(yd), b1, sizeof b1),
                    tp_placements_str(m, c->want_out, b2, sizeof b2));
    }
    RANK_OK(s, tp_dtensor_full_tensor(yd, &yfull));
    RANK_OK(s, tp_backward(yfull, g));
    TP_TEST_TRY(compare(s, yfull, yp, exact, label, "output"));
    for (int i = 0; i < c->n_in; i++) {
        if (!dt[i])
            continue;
        tp_tensor *gd = tp_tensor_grad(dt[i]), *gf = NULL;
        if (!c->in[i].requires_grad) {
            RANK_EXPECT(s, gd == NULL, "%s: input %d does not require grad but got one", label, i);
            continue;
        }
        RANK_EXPECT(s, gd != NULL, "%s: input %d got no gradient", label, i);
        if (!gd)
            continue;
        if (i == 1 && c->want_wgrad) {
            char b1[96], b2[96];
            RANK_EXPECT(s, pls_eq(m, tp_dtensor_placements(gd), c->want_wgrad),
                        "%s: weight gradient placements %s, expected %s", label,
                        tp_placements_str(m, tp_dtensor_placements(gd), b1, sizeof b1),
                        tp_placements_str(m, c->want_wgrad, b2, sizeof b2));
        }
        RANK_OK(s, tp_dtensor_full_tensor(gd, &gf));
        char what[32];
        snprintf(what, sizeof what, "gradient of input %d", i);
        /* the gradients of sum and mean are copies of g (times 1/N) */
        bool gexact = c->op.kind <= OP_MEAN_ALL;
        tp_status st = compare(s, gf, tp_tensor_grad(full[i]), gexact, label, what);
        tp_tensor_release(gf);
        TP_TEST_TRY(st);
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

/* ---- the layouts --------------------------------------------------------------- */

#define PR {TP_PLACEMENT_REPLICATE, 0, TP_SUM}
#define PS(d) {TP_PLACEMENT_SHARD, d, TP_SUM}
#define PP {TP_PLACEMENT_PARTIAL, 0, TP_SUM}

/* x [5, 3, 7]: 5 and 7 uneven on 2, 3 and 4 ranks, 3 smaller than 4. Layouts
 * as (outer, inner): a 1-D mesh uses `inner` (each once), a 2-D mesh both. */
static const tp_placement x_layouts[][2] = {
    {PR, PS(0)},    {PR, PS(1)},    {PR, PS(2)},    {PR, PR},    {PR, PP},
    {PS(0), PS(0)}, {PS(0), PS(2)}, {PS(1), PS(1)}, {PS(2), PP}, {PP, PS(0)},
};
#define N_X_LAYOUTS ((int)(sizeof x_layouts / sizeof x_layouts[0]))

static const int64_t X_SHAPE[3] = {5, 3, 7};

/* The layouts this mesh runs: indices into x_layouts. */
static int mesh_layouts(int mesh_ndim, int *idx)
{
    int n = 0;
    for (int k = 0; k < N_X_LAYOUTS; k++) {
        bool dup = false;
        for (int j = 0; j < k && mesh_ndim == 1; j++)
            dup = dup || pl_eq(x_layouts[j][1], x_layouts[k][1]);
        if (!dup)
            idx[n++] = k;
    }
    return n;
}

static void layout_of(int mesh_ndim, int k, tp_placement *pl)
{
    if (mesh_ndim == 1) {
        pl[0] = x_layouts[k][1];
    } else {
        pl[0] = x_layouts[k][0];
        pl[1] = x_layouts[k][1];
    }
}

static arg_desc x_arg(int mesh_ndim, int k)
{
    arg_desc a = {.present = true, .requires_grad = true, .nd = 3};
    memcpy(a.shape, X_SHAPE, sizeof a.shape);
    layout_of(mesh_ndim, k, a.pl);
    return a;
}

static arg_desc param_arg(int mesh_ndim, int64_t n, tp_placement outer, tp_placement inner)
{
    arg_desc a = {.present = true, .requires_grad = true, .nd = 1, .shape = {n}};
    if (mesh_ndim == 1) {
        a.pl[0] = inner;
    } else {
        a.pl[0] = outer;
        a.pl[1] = inner;
    }
    return a;
}

static const char *pls_label(int m, const tp_placement *pl, char *buf, size_t len)
{
    return tp_placements_str(m, pl, buf, len);
}

typedef struct {
    int mesh_ndim;
    int64_t mesh_shape[2];
    tp_test_slot slot[TP_TEST_MAX_RANKS];
} red_ctx;

static tp_status open_mesh(tp_comm *w, red_ctx *c, tp_test_slot **s, tp_mesh **mesh)
{
    *s = &c->slot[tp_comm_rank(w)];
    return tp_mesh_create(w, c->mesh_ndim, c->mesh_shape, NULL, mesh);
}

/* ---- sum / mean / sum_all / mean_all ------------------------------------------------ */

static tp_status reductions_body(tp_comm *w, void *arg)
{
    red_ctx *c = arg;
    tp_test_slot *s = NULL;
    tp_mesh *mesh = NULL;
    RANK_OK(&c->slot[tp_comm_rank(w)], open_mesh(w, c, &s, &mesh));
    int m = c->mesh_ndim, idx[N_X_LAYOUTS];
    int nl = mesh_layouts(m, idx);
    for (int li = 0; li < nl; li++) {
        red_case rc = {.n_in = 1};
        rc.in[0] = x_arg(m, idx[li]);
        const tp_placement *xp = rc.in[0].pl;
        char pls[64];
        pls_label(m, xp, pls, sizeof pls);
        for (int kind = OP_SUM; kind <= OP_MEAN_ALL; kind++) {
            bool all = kind == OP_SUM_ALL || kind == OP_MEAN_ALL;
            for (int dim = all ? 0 : -3; dim < (all ? 1 : 3); dim++) {
                for (int keep = 0; keep < (all ? 1 : 2); keep++) {
                    /* every layout here is accepted as is: S(k) -> P,
                     * S(j) -> S(j'), R -> R, P -> P */
                    int k = all ? -1 : (dim + 3) % 3;
                    tp_placement want[2];
                    for (int d = 0; d < m; d++) {
                        tp_placement p = xp[d];
                        if (p.kind == TP_PLACEMENT_SHARD && (all || p.dim == k))
                            want[d] = tp_partial(TP_SUM);
                        else if (p.kind == TP_PLACEMENT_SHARD && !keep && p.dim > k)
                            want[d] = tp_shard(p.dim - 1);
                        else
                            want[d] = p;
                    }
                    rc.op = (red_op){kind, dim, keep != 0};
                    rc.want_out = want;
                    char label[128];
                    snprintf(label, sizeof label, "%s dim %d keepdim %d, x %s", op_names[kind],
                             dim, keep, pls);
                    TP_TEST_TRY(check_case(s, mesh, &rc, label));
                }
            }
        }
    }
    /* a 1-D x [7] sharded (uneven, and empty shards on 4 ranks) and a 0-d x */
    {
        red_case rc = {.n_in = 1};
        rc.in[0] = (arg_desc){.present = true, .requires_grad = true, .nd = 1, .shape = {7}};
        rc.in[0].pl[0] = tp_shard(0);
        rc.in[0].pl[1] = tp_shard(0);
        tp_placement pp[2] = {tp_partial(TP_SUM), tp_partial(TP_SUM)};
        for (int kind = OP_SUM; kind <= OP_MEAN_ALL; kind++) {
            rc.op = (red_op){kind, 0, false};
            rc.want_out = pp;
            char label[64];
            snprintf(label, sizeof label, "%s of a sharded 1-d x", op_names[kind]);
            TP_TEST_TRY(check_case(s, mesh, &rc, label));
        }
        rc.in[0] = (arg_desc){.present = true, .requires_grad = true, .nd = 0};
        rc.in[0].pl[0] = tp_replicate();
        rc.in[0].pl[1] = tp_partial(TP_SUM);
        for (int kind = OP_SUM; kind <= OP_MEAN_ALL; kind++) {
            rc.op = (red_op){kind, -1, true};
            rc.want_out = rc.in[0].pl;
            char label[64];
            snprintf(label, sizeof label, "%s of a 0-d x", op_names[kind]);
            TP_TEST_TRY(check_case(s, mesh, &rc, label));
        }
    }
    tp_mesh_free(mesh);
    return TP_OK;
}

/* ---- softmax / layer_norm / rms_norm ------------------------------------------------ */

/* true when x's layout is accepted as is by a row-wise op (no mesh dim
 * shards the last dim or is Partial). */
static bool rowwise_direct(int m, const tp_placement *xp, int last)
{
    for (int d = 0; d < m; d++)
        if (xp[d].kind == TP_PLACEMENT_PARTIAL ||
            (xp[d].kind == TP_PLACEMENT_SHARD && xp[d].dim == last))
            return false;
    return true;
}

/* The output layout of a row-wise op on x without Partial placements: a
 * sharded last dim is replicated, other placements pass through. false when
 * x has a Partial placement (the dispatcher picks the cheapest fix). */
static bool rowwise_out(int m, const tp_placement *xp, int last, tp_placement *out)
{
    for (int d = 0; d < m; d++) {
        if (xp[d].kind == TP_PLACEMENT_PARTIAL)
            return false;
        out[d] = xp[d].kind == TP_PLACEMENT_SHARD && xp[d].dim == last ? tp_replicate() : xp[d];
    }
    return true;
}

static tp_status rowwise_body(tp_comm *w, void *arg)
{
    red_ctx *c = arg;
    tp_test_slot *s = NULL;
    tp_mesh *mesh = NULL;
    RANK_OK(&c->slot[tp_comm_rank(w)], open_mesh(w, c, &s, &mesh));
    int m = c->mesh_ndim, idx[N_X_LAYOUTS];
    int nl = mesh_layouts(m, idx);
    const tp_placement R = tp_replicate(), S0 = tp_shard(0);
    for (int li = 0; li < nl; li++) {
        arg_desc x = x_arg(m, idx[li]);
        char pls[64];
        pls_label(m, x.pl, pls, sizeof pls);
        bool direct = rowwise_direct(m, x.pl, 2);
        tp_placement yp[2];
        const tp_placement *want_y = rowwise_out(m, x.pl, 2, yp) ? yp : NULL;
        /* weight gradients: Partial where x is sharded, else Replicate */
        tp_placement wg[2];
        for (int d = 0; d < m; d++)
            wg[d] = x.pl[d].kind == TP_PLACEMENT_SHARD ? tp_partial(TP_SUM) : R;
        char label[128];
        /* softmax, dim given both ways */
        for (int dim = -1; dim <= 2; dim += 3) {
            red_case rc = {.op = {OP_SOFTMAX, dim, false}, .n_in = 1, .in = {x}};
            rc.want_out = want_y;
            snprintf(label, sizeof label, "softmax dim %d, x %s", dim, pls);
            TP_TEST_TRY(check_case(s, mesh, &rc, label));
        }
        /* layer_norm: no affine, weight only, weight and bias */
        for (int np = 0; np <= 2; np++) {
            red_case rc = {.op = {OP_LN, 0, false}, .n_in = 3, .in = {x}};
            for (int i = 1; i <= np; i++)
                rc.in[i] = param_arg(m, 7, R, R);
            rc.want_out = want_y;
            rc.want_wgrad = direct && np ? wg : NULL;
            snprintf(label, sizeof label, "layer_norm with %d affine params, x %s", np, pls);
            TP_TEST_TRY(check_case(s, mesh, &rc, label));
        }
        /* rms_norm: with and without weight */
        for (int np = 0; np <= 1; np++) {
            red_case rc = {.op = {OP_RMS, 0, false}, .n_in = 2, .in = {x}};
            if (np)
                rc.in[1] = param_arg(m, 7, R, R);
            rc.want_out = want_y;
            rc.want_wgrad = direct && np ? wg : NULL;
            snprintf(label, sizeof label, "rms_norm with%s weight, x %s", np ? "" : "out", pls);
            TP_TEST_TRY(check_case(s, mesh, &rc, label));
        }
        /* only the parameters require grad (the backward's gx is scratch) */
        {
            red_case rc = {.op = {OP_LN, 0, false}, .n_in = 3, .in = {x}};
            rc.in[0].requires_grad = false;
            rc.in[1] = param_arg(m, 7, R, R);
            rc.in[2] = param_arg(m, 7, R, R);
            rc.want_wgrad = direct ? wg : NULL;
            snprintf(label, sizeof label, "layer_norm, x not requiring grad, x %s", pls);
            TP_TEST_TRY(check_case(s, mesh, &rc, label));
            rc.op.kind = OP_RMS;
            rc.n_in = 2;
            snprintf(label, sizeof label, "rms_norm, x not requiring grad, x %s", pls);
            TP_TEST_TRY(check_case(s, mesh, &rc, label));
        }
    }
    /* sharded parameters are replicated first */
    {
        red_case rc = {.op = {OP_LN, 0, false}, .n_in = 3, .in = {x_arg(m, 0)}};
        rc.in[1] = param_arg(m, 7, R, S0);
        rc.in[2] = param_arg(m, 7, S0, R);
        TP_TEST_TRY(check_case(s, mesh, &rc, "layer_norm with sharded weight and bias"));
        rc.op.kind = OP_RMS;
        rc.n_in = 2;
        TP_TEST_TRY(check_case(s, mesh, &rc, "rms_norm with sharded weight"));
    }
    /* 1-d x [7] sharded on its only (the normalized) dim; 2-d x [5, 6] */
    {
        arg_desc x1 = {.present = true, .requires_grad = true, .nd = 1, .shape = {7}};
        x1.pl[0] = S0;
        x1.pl[1] = S0;
        tp_placement rr[2] = {R, R};
        red_case rc = {.op = {OP_SOFTMAX, 0, false}, .n_in = 1, .in = {x1}, .want_out = rr};
        TP_TEST_TRY(check_case(s, mesh, &rc, "softmax of a sharded 1-d x"));
        rc = (red_case){.op = {OP_LN, 0, false}, .n_in = 3, .in = {x1}, .want_out = rr};
        rc.in[1] = param_arg(m, 7, R, R);
        rc.in[2] = param_arg(m, 7, R, R);
        TP_TEST_TRY(check_case(s, mesh, &rc, "layer_norm of a sharded 1-d x"));
        rc.op.kind = OP_RMS;
        rc.n_in = 2;
        TP_TEST_TRY(check_case(s, mesh, &rc, "rms_norm of a sharded 1-d x"));

        arg_desc x2 = {.present = true, .requires_grad = true, .nd = 2, .shape = {5, 6}};
        x2.pl[0] = S0;
        x2.pl[1] = S0;
        tp_placement pp[2] = {tp_partial(TP_SUM), tp_partial(TP_SUM)};
        rc = (red_case){.op = {OP_LN, 0, false}, .n_in = 3, .in = {x2}};
        rc.in[1] = param_arg(m, 6, R, R);
        rc.in[2] = param_arg(m, 6, R, R);
        rc.want_out = x2.pl;
        rc.want_wgrad = pp;
        TP_TEST_TRY(check_case(s, mesh, &rc, "layer_norm of a row-sharded 2-d x"));
        rc.op.kind = OP_RMS;
        rc.n_in = 2;
        TP_TEST_TRY(check_case(s, mesh, &rc, "rms_norm of a row-sharded 2-d x"));
        rc = (red_case){.op = {OP_SOFTMAX, -1, false}, .n_in = 1, .in = {x2}, .want_out = x2.pl};
        TP_TEST_TRY(check_case(s, mesh, &rc, "softmax of a row-sharded 2-d x"));
    }
    tp_mesh_free(mesh);
    return TP_OK;
}

/* ---- collectives: the sequence-parallel norm and a sharded sum issue none ---------- */

static tp_status comm_body(tp_comm *w, void *arg)
{
    red_ctx *c = arg;
    tp_test_slot *s = NULL;
    tp_mesh *mesh = NULL;
    RANK_OK(&c->slot[tp_comm_rank(w)], open_mesh(w, c, &s, &mesh));
    int m = c->mesh_ndim;
    /* x [5, 3, 7] S(0) (2-D: (S(0), S(1))), weight/bias R */
    tp_placement xp[2] = {tp_shard(0), tp_shard(1)}, rr[2] = {tp_replicate(), tp_replicate()};
    tp_placement pp[2] = {tp_partial(TP_SUM), tp_partial(TP_SUM)};
    tp_tensor *xf = NULL, *x = NULL, *wf = NULL, *wt = NULL, *bf = NULL, *b = NULL;
    tp_tensor *gf = NULL, *g = NULL, *y = NULL, *sm = NULL;
    RANK_OK(s, randint(3, X_SHAPE, 1, &xf));
    RANK_OK(s, randint(1, (int64_t[]){7}, 2, &wf));
    RANK_OK(s, randint(1, (int64_t[]){7}, 3, &bf));
    RANK_OK(s, tp_dtensor_distribute(mesh, xf, m, xp, -1, &x));
    RANK_OK(s, tp_dtensor_distribute(mesh, wf, m, rr, -1, &wt));
    RANK_OK(s, tp_dtensor_distribute(mesh, bf, m, rr, -1, &b));
    RANK_OK(s, tp_tensor_set_requires_grad(x, true));
    RANK_OK(s, tp_tensor_set_requires_grad(wt, true));
    RANK_OK(s, tp_tensor_set_requires_grad(b, true));
    RANK_OK(s, randint(3, X_SHAPE, 4, &gf));
    RANK_OK(s, tp_dtensor_distribute(mesh, gf, m, xp, -1, &g));
    tp_comm_debug *dbg = NULL;
    RANK_OK(s, tp_comm_debug_create(&dbg));
    RANK_OK(s, tp_comm_debug_begin(dbg));
    tp_status st = tp_layer_norm(x, wt, b, EPS, &y);
    if (st == TP_OK)
        st = tp_backward(y, g);
    if (st == TP_OK) /* sum over a sharded dim: a Partial result, no collective */
        st = tp_sum(x, 0, false, &sm);
    RANK_OK(s, tp_comm_debug_end(dbg));
    RANK_OK(s, st);
    RANK_EXPECT(s, tp_comm_debug_total(dbg) == 0,
                "sequence-parallel layer_norm forward+backward and a sharded sum issued %lld "
                "collectives, expected 0",
                (long long)tp_comm_debug_total(dbg));
    RANK_EXPECT(s, pls_eq(m, tp_dtensor_placements(y), xp), "layer_norm output placement");
    RANK_EXPECT(s, tp_tensor_grad(wt) && pls_eq(m, tp_dtensor_placements(tp_tensor_grad(wt)), pp),
                "layer_norm weight gradient is not Partial(sum)");
    RANK_EXPECT(s, tp_tensor_grad(b) && pls_eq(m, tp_dtensor_placements(tp_tensor_grad(b)), pp),
                "layer_norm bias gradient is not Partial(sum)");
    tp_placement sp[2] = {tp_partial(TP_SUM), tp_shard(0)};
    RANK_EXPECT(s, pls_eq(m, tp_dtensor_placements(sm), sp), "sum over S(0) is not P(sum)");
    /* reducing the Partial sum is one all_reduce per Partial mesh dim */
    tp_tensor *smf = NULL;
    RANK_OK(s, tp_comm_debug_begin(dbg));
    st = tp_dtensor_full_tensor(sm, &smf);
    RANK_OK(s, tp_comm_debug_end(dbg));
    RANK_OK(s, st);
    int64_t want_ar = tp_mesh_size(mesh, 0) > 1 ? 1 : 0; /* a size-1 mesh dim: nothing */
    RANK_EXPECT(s, tp_comm_debug_count(dbg, TP_COLL_ALL_REDUCE) == want_ar,
                "full_tensor of the sum issued %lld all_reduces, expected %lld",
                (long long)tp_comm_debug_count(dbg, TP_COLL_ALL_REDUCE), (long long)want_ar);
    tp_comm_debug_free(dbg);
    tp_tensor *list[] = {xf, x, wf, wt, bf, b, gf, g, y, sm, smf};
    for (size_t i = 0; i < sizeof list / sizeof list[0]; i++)
        tp_tensor_release(list[i]);
    tp_mesh_free(mesh);
    return TP_OK;
}

/* ---- errors on DTensors ----------------------------------------------------------- */

static tp_status distributed_errors_body(tp_comm *w, void *arg)
{
    red_ctx *c = arg;
    tp_test_slot *s = NULL;
    tp_mesh *mesh = NULL;
    RANK_OK(&c->slot[tp_comm_rank(w)], open_mesh(w, c, &s, &mesh));
    int m = c->mesh_ndim;
    tp_placement xp[2] = {tp_shard(0), tp_shard(0)}, rr[2] = {tp_replicate(), tp_replicate()};
    tp_tensor *xf = NULL, *x = NULL, *wf = NULL, *wd = NULL, *y = NULL;
    RANK_OK(s, randint(3, X_SHAPE, 1, &xf));
    RANK_OK(s, randint(1, (int64_t[]){7}, 2, &wf));
    RANK_OK(s, tp_dtensor_distribute(mesh, xf, m, xp, -1, &x));
    RANK_OK(s, tp_dtensor_distribute(mesh, wf, m, rr, -1, &wd));
    tp_status st = tp_softmax(x, 1, &y);
    RANK_EXPECT(s, st == TP_ERR_NOT_SUPPORTED && y == NULL &&
                       strstr(tp_last_error(), "softmax: only the last dim is supported"),
                "softmax dim 1: %s %s", tp_status_name(st), tp_last_error());
    st = tp_layer_norm(x, wf, NULL, EPS, &y);
    RANK_EXPECT(s, st == TP_ERR_INVALID_ARG && y == NULL &&
                       strstr(tp_last_error(), "x is a DTensor but weight is a plain tensor"),
                "mixing: %s %s", tp_status_name(st), tp_last_error());
    st = tp_rms_norm(xf, wd, EPS, &y);
    RANK_EXPECT(s, st == TP_ERR_INVALID_ARG && y == NULL &&
                       strstr(tp_last_error(), "x is a plain tensor but weight is a DTensor"),
                "mixing: %s %s", tp_status_name(st), tp_last_error());
    st = tp_sum(x, 3, false, &y);
    RANK_EXPECT(s, st == TP_ERR_INVALID_ARG && y == NULL &&
                       strstr(tp_last_error(), "sum: dim 3 is out of range for a 3-d tensor"),
                "sum dim 3: %s %s", tp_status_name(st), tp_last_error());
    tp_tensor_release(xf);
    tp_tensor_release(x);
    tp_tensor_release(wf);
    tp_tensor_release(wd);
    tp_mesh_free(mesh);
    return TP_OK;
}

/* ---- plain tensors against naive loops (main thread) -------------------------------- */

static tp_tensor *plain_randint(int nd, const int64_t *shape, uint64_t seed)
{
    tp_tensor *t = NULL;
    CHECK_OK(randint(nd, shape, seed, &t));
    return t;
}

static const float *fdata(const tp_tensor *t) { return tp_tensor_data(t); }

static void assert_shape(const tp_tensor *t, int nd, const int64_t *shape, const char *what)
{
    cr_assert_eq(tp_tensor_ndim(t), nd, "%s: ndim %d, expected %d", what, tp_tensor_ndim(t), nd);
    for (int d = 0; d < nd; d++)
        cr_assert_eq(tp_tensor_shape(t)[d], shape[d], "%s: size %lld of dim %d, expected %lld",
                     what, (long long)tp_tensor_shape(t)[d], d, (long long)shape[d]);
}

/* got[i] vs want[i] (double) within the stated tolerance (exact: equal). */
static void assert_values(const tp_tensor *got, const double *want, int64_t n, bool exact,
                          const char *what)
{
    cr_assert_eq(tp_tensor_numel(got), n, "%s: %lld elements, expected %lld", what,
                 (long long)tp_tensor_numel(got), (long long)n);
    const float *g = fdata(got);
    for (int64_t i = 0; i < n; i++) {
        if (isnan(want[i])) {
            cr_assert(isnan(g[i]), "%s[%lld] = %g, expected NaN", what, (long long)i, g[i]);
            continue;
        }
        double tol = exact ? 0 : ATOL + RTOL * fabs(want[i]);
        cr_assert(fabs((double)g[i] - want[i]) <= tol, "%s[%lld] = %.9g, expected %.9g", what,
                  (long long)i, g[i], want[i]);
    }
}

static const int64_t P_SHAPE[3] = {4, 3, 5};

Test(ops_reduce, plain_sum_mean_match_loops, .timeout = 30)
{
    for (int mean = 0; mean < 2; mean++) {
        for (int dim = 0; dim < 3; dim++) {
            for (int keep = 0; keep < 2; keep++) {
                tp_tensor *x = plain_randint(3, P_SHAPE, 21), *y = NULL, *g = NULL;
                CHECK_OK(tp_tensor_set_requires_grad(x, true));
                CHECK_OK(mean ? tp_mean(x, dim, keep, &y) : tp_sum(x, dim, keep, &y));
                int64_t outer = 1, inner = 1, size = P_SHAPE[dim], oshape[3];
                int ond = 0;
                for (int d = 0; d < 3; d++) {
                    if (d < dim)
                        outer *= P_SHAPE[d];
                    if (d > dim)
                        inner *= P_SHAPE[d];
                    if (d != dim || keep)
                        oshape[ond++] = d == dim ? 1 : P_SHAPE[d];
                }
                assert_shape(y, ond, oshape, mean ? "mean" : "sum");
                double want[60] = {0};
                const float *xd = fdata(x);
                for (int64_t o = 0; o < outer; o++)
                    for (int64_t k = 0; k < size; k++)
                        for (int64_t i = 0; i < inner; i++)
                            want[o * inner + i] += xd[(o * size + k) * inner + i];
                if (mean)
                    for (int64_t i = 0; i < outer * inner; i++)
                        want[i] /= (double)size;
                assert_values(y, want, outer * inner, !mean, mean ? "mean" : "sum");
                /* backward: g broadcast over the reduced dim (times 1/size) */
                CHECK_OK(randint(ond, oshape, 5, &g));
                CHECK_OK(tp_backward(y, g));
                double gwant[60];
                for (int64_t o = 0; o < outer; o++)
                    for (int64_t k = 0; k < size; k++)
                        for (int64_t i = 0; i < inner; i++)
                            gwant[(o * size + k) * inner + i] =
                                fdata(g)[o * inner + i] / (mean ? (double)size : 1.0);
                assert_values(tp_tensor_grad(x), gwant, 60, !mean, "sum/mean gradient");
                tp_tensor_release(x);
                tp_tensor_release(y);
                tp_tensor_release(g);
            }
        }
    }
    /* over everything */
    for (int mean = 0; mean < 2; mean++) {
        tp_tensor *x = plain_randint(3, P_SHAPE, 22), *y = NULL;
        CHECK_OK(tp_tensor_set_requires_grad(x, true));
        CHECK_OK(mean ? tp_mean_all(x, &y) : tp_sum_all(x, &y));
        assert_shape(y, 0, NULL, "sum_all");
        double want = 0, gwant[60];
        for (int i = 0; i < 60; i++)
            want += fdata(x)[i];
        if (mean)
            want /= 60;
        assert_values(y, &want, 1, !mean, "sum_all/mean_all");
        CHECK_OK(tp_backward(y, NULL)); /* a 0-d output: grad NULL means 1 */
        for (int i = 0; i < 60; i++)
            gwant[i] = mean ? 1.0 / 60 : 1.0;
        assert_values(tp_tensor_grad(x), gwant, 60, false, "sum_all/mean_all gradient");
        tp_tensor_release(x);
        tp_tensor_release(y);
    }
}

Test(ops_reduce, plain_scalar_and_empty, .timeout = 30)
{
    /* a 0-d x: sum over dim 0 / -1 and sum_all are x itself */
    tp_tensor *x = NULL, *y = NULL, *g = NULL;
    CHECK_OK(tp_tensor_empty(TP_F32, TP_CPU, 0, NULL, &x));
    CHECK_OK(tp_tensor_fill(x, 3.0));
    CHECK_OK(tp_tensor_set_requires_grad(x, true));
    CHECK_OK(tp_sum(x, -1, true, &y));
    assert_shape(y, 0, NULL, "sum of 0-d");
    double three = 3, one = 1, zero = 0, two = 2;
    assert_values(y, &three, 1, true, "sum of 0-d");
    CHECK_OK(tp_tensor_empty(TP_F32, TP_CPU, 0, NULL, &g));
    CHECK_OK(tp_tensor_fill(g, 2.0));
    CHECK_OK(tp_backward(y, g));
    assert_values(tp_tensor_grad(x), &two, 1, true, "sum of 0-d gradient");
    tp_tensor_release(y);
    CHECK_OK(tp_mean_all(x, &y));
    assert_values(y, &three, 1, true, "mean_all of 0-d");
    tp_tensor_release(y);
    /* softmax of a 0-d tensor is 1, its gradient 0 */
    tp_tensor_zero_grad(x);
    CHECK_OK(tp_softmax(x, 0, &y));
    assert_values(y, &one, 1, true, "softmax of 0-d");
    CHECK_OK(tp_backward(y, g));
    assert_values(tp_tensor_grad(x), &zero, 1, true, "softmax of 0-d gradient");
    tp_tensor_release(y);
    tp_tensor_release(g);
    tp_tensor_release(x);

    /* empty: sums are 0, means NaN (0/0, as PyTorch) */
    x = NULL;
    CHECK_OK(tp_tensor_zeros(TP_F32, TP_CPU, 2, (int64_t[]){0, 3}, &x));
    CHECK_OK(tp_sum(x, 0, false, &y));
    double z3[3] = {0, 0, 0}, nan3[3] = {NAN, NAN, NAN};
    assert_values(y, z3, 3, true, "sum over an empty dim");
    tp_tensor_release(y);
    CHECK_OK(tp_mean(x, 0, false, &y));
    assert_values(y, nan3, 3, true, "mean over an empty dim");
    tp_tensor_release(y);
    CHECK_OK(tp_sum(x, 1, true, &y));
    assert_shape(y, 2, (int64_t[]){0, 1}, "sum of [0, 3] over dim 1");
    tp_tensor_release(y);
    CHECK_OK(tp_sum_all(x, &y));
    assert_values(y, &zero, 1, true, "sum_all of empty");
    tp_tensor_release(y);
    CHECK_OK(tp_mean_all(x, &y));
    assert_values(y, nan3, 1, true, "mean_all of empty");
    tp_tensor_release(y);
    CHECK_OK(tp_softmax(x, -1, &y));
    assert_shape(y, 2, (int64_t[]){0, 3}, "softmax of [0, 3]");
    tp_tensor_release(y);
    CHECK_OK(tp_layer_norm(x, NULL, NULL, EPS, &y));
    assert_shape(y, 2, (int64_t[]){0, 3}, "layer_norm of [0, 3]");
    tp_tensor_release(y);
    tp_tensor_release(x);
}

Test(ops_reduce, plain_softmax_matches_loops, .timeout = 30)
{
    int64_t rows = 12, cols = 5;
    tp_tensor *x = plain_randint(3, P_SHAPE, 23), *y = NULL, *g = plain_randint(3, P_SHAPE, 24);
    CHECK_OK(tp_tensor_set_requires_grad(x, true));
    CHECK_OK(tp_softmax(x, -1, &y));
    assert_shape(y, 3, P_SHAPE, "softmax");
    double want[60], gwant[60];
    const float *xd = fdata(x), *gd = fdata(g);
    for (int64_t r = 0; r < rows; r++) {
        double mx = -INFINITY, sum = 0, dot = 0;
        for (int64_t c = 0; c < cols; c++)
            mx = fmax(mx, xd[r * cols + c]);
        for (int64_t c = 0; c < cols; c++)
            sum += exp(xd[r * cols + c] - mx);
        for (int64_t c = 0; c < cols; c++) {
            want[r * cols + c] = exp(xd[r * cols + c] - mx) / sum;
            dot += want[r * cols + c] * gd[r * cols + c];
        }
        for (int64_t c = 0; c < cols; c++)
            gwant[r * cols + c] = want[r * cols + c] * (gd[r * cols + c] - dot);
    }
    assert_values(y, want, 60, false, "softmax");
    CHECK_OK(tp_backward(y, g));
    assert_values(tp_tensor_grad(x), gwant, 60, false, "softmax gradient");
    tp_tensor_release(x);
    tp_tensor_release(y);
    tp_tensor_release(g);
}

/* Naive layer_norm (rms false) / rms_norm over the last dim in double, with
 * its gradients. w, b may be NULL. */
static void naive_norm(bool rms, const float *x, const float *w, const float *b, const float *g,
                       int64_t rows, int64_t cols, double *y, double *gx, double *gw, double *gb)
{
    for (int64_t c = 0; c < cols; c++)
        gw[c] = gb[c] = 0;
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * cols, *gr = g + r * cols;
        double mu = 0, var = 0, xh[16], gh[16], sa = 0, sb = 0;
        if (!rms) {
            for (int64_t c = 0; c < cols; c++)
                mu += xr[c];
            mu /= (double)cols;
        }
        for (int64_t c = 0; c < cols; c++)
            var += (xr[c] - mu) * (xr[c] - mu);
        double rstd = 1.0 / sqrt(var / (double)cols + EPS);
        for (int64_t c = 0; c < cols; c++) {
            xh[c] = (xr[c] - mu) * rstd;
            y[r * cols + c] = xh[c] * (w ? w[c] : 1.0) + (b ? b[c] : 0.0);
            gh[c] = gr[c] * (w ? w[c] : 1.0);
            sa += gh[c];
            sb += gh[c] * xh[c];
            gw[c] += gr[c] * xh[c];
            gb[c] += gr[c];
        }
        sa /= (double)cols;
        sb /= (double)cols;
        for (int64_t c = 0; c < cols; c++)
            gx[r * cols + c] = rstd * (gh[c] - (rms ? 0.0 : sa) - xh[c] * sb);
    }
}

Test(ops_reduce, plain_norms_match_loops, .timeout = 30)
{
    int64_t rows = 12, cols = 5;
    for (int rms = 0; rms < 2; rms++) {
        for (int np = 0; np <= (rms ? 1 : 2); np++) {
            tp_tensor *x = plain_randint(3, P_SHAPE, 25), *g = plain_randint(3, P_SHAPE, 26);
            tp_tensor *w = np >= 1 ? plain_randint(1, &cols, 27) : NULL;
            tp_tensor *b = np >= 2 ? plain_randint(1, &cols, 28) : NULL, *y = NULL;
            CHECK_OK(tp_tensor_set_requires_grad(x, true));
            if (w)
                CHECK_OK(tp_tensor_set_requires_grad(w, true));
            if (b)
                CHECK_OK(tp_tensor_set_requires_grad(b, true));
            CHECK_OK(rms ? tp_rms_norm(x, w, EPS, &y) : tp_layer_norm(x, w, b, EPS, &y));
            assert_shape(y, 3, P_SHAPE, rms ? "rms_norm" : "layer_norm");
            double yw[60], gxw[60], gww[5], gbw[5];
            naive_norm(rms, fdata(x), w ? fdata(w) : NULL, b ? fdata(b) : NULL, fdata(g), rows,
                       cols, yw, gxw, gww, gbw);
            assert_values(y, yw, 60, false, rms ? "rms_norm" : "layer_norm");
            CHECK_OK(tp_backward(y, g));
            assert_values(tp_tensor_grad(x), gxw, 60, false, "norm gradient of x");
            if (w)
                assert_values(tp_tensor_grad(w), gww, 5, false, "norm gradient of weight");
            if (b)
                assert_values(tp_tensor_grad(b), gbw, 5, false, "norm gradient of bias");
            tp_tensor_release(x);
            tp_tensor_release(g);
            tp_tensor_release(w);
            tp_tensor_release(b);
            tp_tensor_release(y);
        }
    }
}

Test(ops_reduce, graph_without_backward_is_freed, .timeout = 30)
{
    /* the saved outputs and statistics go with the graph (ASan checks the
     * leaks), and ops on inputs not requiring grad record nothing */
    tp_tensor *x = plain_randint(3, P_SHAPE, 29), *w = plain_randint(1, (int64_t[]){5}, 30);
    tp_tensor *y = NULL;
    CHECK_OK(tp_softmax(x, -1, &y));
    cr_assert(!tp_tensor_has_grad_fn(y));
    tp_tensor_release(y);
    CHECK_OK(tp_tensor_set_requires_grad(x, true));
    CHECK_OK(tp_softmax(x, -1, &y));
    cr_assert(tp_tensor_has_grad_fn(y));
    tp_tensor_release(y);
    CHECK_OK(tp_layer_norm(x, w, NULL, EPS, &y));
    tp_tensor_release(y);
    CHECK_OK(tp_rms_norm(x, w, EPS, &y));
    tp_tensor_release(y);
    CHECK_OK(tp_mean(x, 1, false, &y));
    tp_tensor_release(y);
    tp_no_grad_begin();
    CHECK_OK(tp_layer_norm(x, w, NULL, EPS, &y));
    cr_assert(!tp_tensor_has_grad_fn(y));
    tp_tensor_release(y);
    tp_no_grad_end();
    tp_tensor_release(x);
    tp_tensor_release(w);
}

/* A call that must fail with `code`, a message containing `msg`, and *y NULL. */
#define CHECK_FAILS(call, code, msg)                                                   \
    do {                                                                               \
        tp_tensor *y_ = (tp_tensor *)&y_sentinel;                                      \
        tp_tensor **y = &y_;                                                           \
        tp_clear_error();                                                              \
        tp_status st_ = (call);                                                        \
        cr_assert_eq(st_, (code), "%s -> %s, expected %s (%s)", #call,                 \
                     tp_status_name(st_), tp_status_name(code), tp_last_error());      \
        cr_assert(strstr(tp_last_error(), (msg)), "%s: message \"%s\" lacks \"%s\"",   \
                  #call, tp_last_error(), (msg));                                      \
        cr_assert(y_ == NULL, "%s left its output set", #call);                        \
    } while (0)

static int y_sentinel;

Test(ops_reduce, errors, .timeout = 30)
{
    int64_t xs[3] = {2, 3, 6};
    tp_tensor *x = plain_randint(3, xs, 31), *w5 = plain_randint(1, (int64_t[]){5}, 32);
    tp_tensor *w6 = plain_randint(1, (int64_t[]){6}, 33), *b4 = plain_randint(1, (int64_t[]){4}, 34);
    tp_tensor *w2d = plain_randint(2, (int64_t[]){1, 6}, 35), *s0 = NULL, *xi = NULL;
    CHECK_OK(tp_tensor_zeros(TP_F32, TP_CPU, 0, NULL, &s0));
    CHECK_OK(tp_tensor_zeros(TP_I64, TP_CPU, 3, xs, &xi));

    CHECK_FAILS(tp_sum(NULL, 0, false, y), TP_ERR_INVALID_ARG, "sum: x is NULL");
    CHECK_ERR(tp_sum(x, 0, false, NULL), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "sum: y is NULL"), "%s", tp_last_error());
    CHECK_FAILS(tp_sum(x, 3, false, y), TP_ERR_INVALID_ARG,
                "sum: dim 3 is out of range for a 3-d tensor");
    CHECK_FAILS(tp_mean(x, -4, true, y), TP_ERR_INVALID_ARG,
                "mean: dim -4 is out of range for a 3-d tensor");
    CHECK_FAILS(tp_sum(s0, 1, false, y), TP_ERR_INVALID_ARG,
                "sum: dim 1 is out of range for a 0-d tensor");
    CHECK_FAILS(tp_sum_all(NULL, y), TP_ERR_INVALID_ARG, "sum_all: x is NULL");
    CHECK_FAILS(tp_mean_all(xi, y), TP_ERR_NOT_SUPPORTED,
                "mean_all: x is i64, which the cpu kernels do not take");
    CHECK_FAILS(tp_sum(xi, 0, false, y), TP_ERR_NOT_SUPPORTED, "sum: x is i64");

    CHECK_FAILS(tp_softmax(x, 0, y), TP_ERR_NOT_SUPPORTED,
                "softmax: only the last dim is supported (dim -1 or 2 of a 3-d tensor), got dim 0");
    CHECK_FAILS(tp_softmax(x, -2, y), TP_ERR_NOT_SUPPORTED, "softmax: only the last dim");
    CHECK_FAILS(tp_softmax(x, 3, y), TP_ERR_INVALID_ARG,
                "softmax: dim 3 is out of range for a 3-d tensor");
    CHECK_FAILS(tp_softmax(NULL, -1, y), TP_ERR_INVALID_ARG, "softmax: x is NULL");

    CHECK_FAILS(tp_layer_norm(x, w5, NULL, EPS, y), TP_ERR_INVALID_ARG,
                "layer_norm: weight has 5 elements but x's last dim is 6");
    CHECK_FAILS(tp_layer_norm(x, w6, b4, EPS, y), TP_ERR_INVALID_ARG,
                "layer_norm: bias has 4 elements but x's last dim is 6");
    CHECK_FAILS(tp_layer_norm(x, NULL, b4, EPS, y), TP_ERR_INVALID_ARG,
                "layer_norm: bias has 4 elements but x's last dim is 6");
    CHECK_FAILS(tp_layer_norm(x, w2d, NULL, EPS, y), TP_ERR_INVALID_ARG,
                "layer_norm: weight must be 1-d [6], got 2 dims");
    CHECK_FAILS(tp_layer_norm(x, w6, NULL, -1.0, y), TP_ERR_INVALID_ARG,
                "layer_norm: eps must be finite and >= 0, got -1");
    CHECK_FAILS(tp_layer_norm(x, w6, NULL, NAN, y), TP_ERR_INVALID_ARG,
                "layer_norm: eps must be finite and >= 0");
    CHECK_FAILS(tp_layer_norm(s0, NULL, NULL, EPS, y), TP_ERR_INVALID_ARG,
                "layer_norm: x must have at least 1 dim");
    CHECK_FAILS(tp_layer_norm(NULL, w6, NULL, EPS, y), TP_ERR_INVALID_ARG, "layer_norm: x is NULL");
    CHECK_FAILS(tp_layer_norm(xi, NULL, NULL, EPS, y), TP_ERR_NOT_SUPPORTED,
                "layer_norm: x is i64, which the cpu kernels do not take");
    CHECK_ERR(tp_layer_norm(x, w6, NULL, EPS, NULL), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "layer_norm: y is NULL"), "%s", tp_last_error());

    CHECK_FAILS(tp_rms_norm(x, w5, EPS, y), TP_ERR_INVALID_ARG,
                "rms_norm: weight has 5 elements but x's last dim is 6");
    CHECK_FAILS(tp_rms_norm(x, w6, INFINITY, y), TP_ERR_INVALID_ARG,
                "rms_norm: eps must be finite and >= 0");
    CHECK_FAILS(tp_rms_norm(NULL, NULL, EPS, y), TP_ERR_INVALID_ARG, "rms_norm: x is NULL");

    /* the valid calls still work after all that */
    tp_tensor *y = NULL;
    CHECK_OK(tp_layer_norm(x, w6, NULL, 0.0, &y));
    tp_tensor_release(y);
    CHECK_OK(tp_rms_norm(x, NULL, EPS, &y));
    tp_tensor_release(y);

    tp_tensor *list[] = {x, w5, w6, b4, w2d, s0, xi};
    for (size_t i = 0; i < sizeof list / sizeof list[0]; i++)
        tp_tensor_release(list[i]);
}

typedef struct {
    int ndim;
    int64_t shape[2];
} red_mesh;

ParameterizedTestParameters(ops_reduce, reductions_equal_single_rank)
{
    static red_mesh meshes[] = {{1, {1}}, {1, {2}}, {1, {3}}, {1, {4}}, {1, {8}}, {2, {2, 2}}, {2, {4, 2}}, {2, {2, 3}}};
    return cr_make_param_array(red_mesh, meshes, sizeof meshes / sizeof meshes[0]);
}

static void run_on(const red_mesh *rm, tp_rank_fn fn)
{
    red_ctx c = {.mesh_ndim = rm->ndim, .mesh_shape = {rm->shape[0], rm->shape[1]}};
    tp_test_run((int)(rm->shape[0] * (rm->ndim > 1 ? rm->shape[1] : 1)), fn, &c, c.slot);
}

ParameterizedTest(red_mesh *rm, ops_reduce, reductions_equal_single_rank, .timeout = 120)
{
    run_on(rm, reductions_body);
}

ParameterizedTestParameters(ops_reduce, rowwise_equal_single_rank)
{
    static red_mesh meshes[] = {{1, {1}}, {1, {2}}, {1, {3}}, {1, {4}}, {1, {8}}, {2, {2, 2}}, {2, {4, 2}}, {2, {2, 3}}};
    return cr_make_param_array(red_mesh, meshes, sizeof meshes / sizeof meshes[0]);
}

ParameterizedTest(red_mesh *rm, ops_reduce, rowwise_equal_single_rank, .timeout = 120)
{
    run_on(rm, rowwise_body);
}

ParameterizedTestParameters(ops_reduce, sequence_parallel_collectives)
{
    static red_mesh meshes[] = {{1, {1}}, {1, {2}}, {1, {3}}, {1, {4}}, {1, {8}}, {2, {2, 2}}, {2, {4, 2}}, {2, {2, 3}}};
    return cr_make_param_array(red_mesh, meshes, sizeof meshes / sizeof meshes[0]);
}

ParameterizedTest(red_mesh *rm, ops_reduce, sequence_parallel_collectives, .timeout = 60)
{
    run_on(rm, comm_body);
}

ParameterizedTestParameters(ops_reduce, distributed_errors)
{
    static red_mesh meshes[] = {{1, {2}}, {2, {2, 2}}};
    return cr_make_param_array(red_mesh, meshes, sizeof meshes / sizeof meshes[0]);
}

ParameterizedTest(red_mesh *rm, ops_reduce, distributed_errors, .timeout = 60)
{
    run_on(rm, distributed_errors_body);
}
