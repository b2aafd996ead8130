/* embedding and cross_entropy.
 *
 * embedding on DTensors equals the single-rank op exactly (integer data), for
 * every strategy (column-sharded table, row-sharded table with its Partial
 * output, sharded indices, replicated) and for layouts that redistribute, on
 * 1-D meshes of 1-4 ranks and on 2x2 meshes, with uneven shapes (7 rows and 5
 * features over 2-4 ranks). Out-of-range indices are rejected with their
 * global position.
 *
 * cross_entropy: hand-computed values and gradients on plain tensors
 * (PyTorch's weighted mean); on DTensors the vocab-parallel form (logits
 * sharded on the class dim, C = 13 over 1-4 ranks) equals the single-rank op
 * within rtol 1e-5, atol 1e-6 for every reduction, with and without class
 * weights and ignored rows, and issues exactly 3 all_reduces forward and no
 * collective backward; Replicate and Partial logits compute locally; logits
 * sharded on the batch dim are refused. */
#include <math.h>

#include "tp_test.h"

#define CE_RTOL 1e-5
#define CE_ATOL 1e-6

typedef struct {
    int ndim;
    int64_t shape[2];
    int sd; /* the mesh dim that shards in the cases ("inner"); the other is "outer" */
} loss_mesh;

typedef struct {
    loss_mesh lm;
    tp_test_slot slot[TP_TEST_MAX_RANKS];
} loss_ctx;

static const tp_placement R = {TP_PLACEMENT_REPLICATE, 0, TP_SUM};
static const tp_placement S0 = {TP_PLACEMENT_SHARD, 0, TP_SUM};
static const tp_placement S1 = {TP_PLACEMENT_SHARD, 1, TP_SUM};
static const tp_placement S2 = {TP_PLACEMENT_SHARD, 2, TP_SUM};
static const tp_placement P = {TP_PLACEMENT_PARTIAL, 0, TP_SUM};

static tp_status randint_f32(int nd, const int64_t *shape, double lo, double hi, uint64_t seed,
                             tp_tensor **t)
{
    TP_TEST_TRY(tp_tensor_zeros(TP_F32, TP_CPU, nd, shape, t));
    return tp_tensor_fill_random(*t, TP_RNG_RANDINT, lo, hi, seed, NULL, NULL);
}

/* Placements with `inner` on the sharding mesh dim and `outer` on the other. */
static void place(const loss_mesh *lm, tp_placement inner, tp_placement outer, tp_placement *out)
{
    if (lm->ndim == 1) {
        out[0] = inner;
        return;
    }
    out[lm->sd] = inner;
    out[1 - lm->sd] = outer;
}

static int64_t inner_size(const loss_mesh *lm) { return lm->shape[lm->ndim == 1 ? 0 : lm->sd]; }

static bool pl_eq(tp_placement a, tp_placement b)
{
    return a.kind == b.kind && (a.kind != TP_PLACEMENT_SHARD || a.dim == b.dim) &&
           (a.kind != TP_PLACEMENT_PARTIAL || a.op == b.op);
}

static bool pls_eq(int m, const tp_placement *a, const tp_placement *b)
{
    for (int i = 0; i < m; i++)
        if (!pl_eq(a[i], b[i]))
            return false;
    return true;
}

/* ---- embedding ------------------------------------------------------------ */

typedef struct {
    const char *label;
    tp_placement idx_in, w_in, idx_out, w_out; /* inputs: inner, outer mesh dim */
    tp_placement y_in, y_out;                  /* expected output placements */
    bool exact; /* the inputs match a strategy: no collective in forward or backward */
    bool two_d; /* only on 2-D meshes (on 1-D it repeats another case) */
} emb_case;

static tp_status emb_check(tp_test_slot *s, tp_mesh *mesh, const loss_mesh *lm,
                           const emb_case *k, tp_dtype idt, tp_comm_debug *dbg)
{
    const int m = tp_mesh_ndim(mesh);
    const int64_t ishape[2] = {3, 5}, wshape[2] = {7, 5}, yshape[3] = {3, 5, 5};
    char label[160];
    snprintf(label, sizeof label, "embedding %s (%s indices)", k->label, tp_dtype_name(idt));
    tp_tensor *idx = NULL, *w = NULL, *g = NULL, *yp = NULL, *di = NULL, *dw = NULL, *yd = NULL,
              *yfull = NULL, *gw = NULL;
    RANK_OK(s, tp_tensor_zeros(idt, TP_CPU, 2, ishape, &idx));
    RANK_OK(s, tp_tensor_fill_random(idx, TP_RNG_RANDINT, 0, 7, 31, NULL, NULL));
    RANK_OK(s, randint_f32(2, wshape, -4, 5, 32, &w));
    RANK_OK(s, randint_f32(3, yshape, -3, 4, 33, &g));
    RANK_OK(s, tp_tensor_set_requires_grad(w, true));
    RANK_OK(s, tp_embedding(idx, w, &yp));
    RANK_OK(s, tp_backward(yp, g));

    tp_placement pi[2], pw[2], py[2];
    place(lm, k->idx_in, k->idx_out, pi);
    place(lm, k->w_in, k->w_out, pw);
    place(lm, k->y_in, k->y_out, py);
    RANK_OK(s, tp_dtensor_distribute(mesh, idx, m, pi, -1, &di));
    RANK_OK(s, tp_dtensor_distribute(mesh, w, m, pw, -1, &dw));
    RANK_OK(s, tp_tensor_set_requires_grad(dw, true));
    RANK_OK(s, tp_comm_debug_begin(dbg));
    tp_status st = tp_embedding(di, dw, &yd);
    RANK_OK(s, tp_comm_debug_end(dbg));
    RANK_OK(s, st);
    if (k->exact) {
        RANK_EXPECT(s, tp_comm_debug_total(dbg) == 0, "%s: forward issued %lld collectives",
                    label, (long long)tp_comm_debug_total(dbg));
        char b1[64], b2[64];
        RANK_EXPECT(s, pls_eq(m, tp_dtensor_placements(yd), py),
                    "%s: output placements %s, expected %s", label,
                    tp_placements_str(m, tp_dtensor_placements(yd), b1, sizeof b1),
                    tp_placements_str(m, py, b2, sizeof b2));
    }
    RANK_EXPECT(s, tp_tensor_ndim(yd) == 3 && tp_tensor_size(yd, 2) == 5,
                "%s: output global shape wrong", label);
    RANK_OK(s, tp_dtensor_full_tensor(yd, &yfull));
    bool eq = false;
    RANK_OK(s, tp_tensor_equal(yfull, yp, &eq));
    RANK_EXPECT(s, eq, "%s: output differs from the single-rank result", label);

    RANK_OK(s, tp_comm_debug_begin(dbg));
    st = tp_backward(yfull, g);
    RANK_OK(s, tp_comm_debug_end(dbg));
    RANK_OK(s, st);
    if (k->exact)
        RANK_EXPECT(s, tp_comm_debug_module_count(dbg, "Global", TP_PHASE_BACKWARD, TP_COLL_ANY) == 0,
                    "%s: backward issued %lld collectives", label,
                    (long long)tp_comm_debug_module_count(dbg, "Global", TP_PHASE_BACKWARD,
                                                          TP_COLL_ANY));
    tp_tensor *gd = tp_tensor_grad(dw);
    RANK_EXPECT(s, gd != NULL, "%s: the weight got no gradient", label);
    RANK_EXPECT(s, tp_tensor_grad(di) == NULL, "%s: the indices got a gradient", label);
    if (gd) {
        RANK_OK(s, tp_dtensor_full_tensor(gd, &gw));
        RANK_OK(s, tp_tensor_equal(gw, tp_tensor_grad(w), &eq));
        RANK_EXPECT(s, eq, "%s: weight gradient differs from the single-rank one", label);
    }
    tp_tensor *all[] = {idx, w, g, yp, di, dw, yd, yfull, gw};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        tp_tensor_release(all[i]);
    return TP_OK;
}

/* A bad index in a sharded indices tensor: the rank holding it reports its
 * global position; the others (no collective needed) succeed. */
static tp_status emb_bad_sharded(tp_test_slot *s, tp_mesh *mesh, const loss_mesh *lm)
{
    const int m = tp_mesh_ndim(mesh);
    const int64_t ishape[2] = {3, 5}, wshape[2] = {7, 5};
    tp_tensor *idx = NULL, *w = NULL, *di = NULL, *dw = NULL, *y = NULL;
    RANK_OK(s, tp_tensor_zeros(TP_I64, TP_CPU, 2, ishape, &idx));
    RANK_OK(s, tp_tensor_fill_random(idx, TP_RNG_RANDINT, 0, 7, 41, NULL, NULL));
    RANK_OK(s, tp_tensor_set(idx, (int64_t[]){2, 4}, 7));
    RANK_OK(s, randint_f32(2, wshape, -4, 5, 42, &w));
    tp_placement pi[2], pw[2] = {R, R};
    place(lm, S0, R, pi);
    RANK_OK(s, tp_dtensor_distribute(mesh, idx, m, pi, -1, &di));
    RANK_OK(s, tp_dtensor_distribute(mesh, w, m, pw, -1, &dw));
    int64_t lshape[2], off[2];
    RANK_OK(s, tp_dtensor_shard_extent(mesh, 2, ishape, m, pi, NULL, lshape, off));
    bool owner = off[0] <= 2 && 2 < off[0] + lshape[0];
    tp_clear_error();
    tp_status st = tp_embedding(di, dw, &y);
    if (owner)
        RANK_EXPECT(s, st == TP_ERR_INVALID_ARG && y == NULL &&
                           strstr(tp_last_error(), "index 7 at position [2, 4]") &&
                           strstr(tp_last_error(), "7 rows"),
                    "sharded bad index: %s (%s)", tp_status_name(st), tp_last_error());
    else
        RANK_EXPECT(s, st == TP_OK, "sharded bad index on a rank without it: %s (%s)",
                    tp_status_name(st), tp_last_error());
    tp_tensor_release(y);
    /* plain and distributed tensors do not mix */
    st = tp_embedding(idx, dw, &y);
    RANK_EXPECT(s, st == TP_ERR_INVALID_ARG && y == NULL &&
                       strstr(tp_last_error(), "indices is a plain tensor but weight is a DTensor"),
                "mixing: %s (%s)", tp_status_name(st), tp_last_error());
    tp_tensor_release(idx);
    tp_tensor_release(w);
    tp_tensor_release(di);
    tp_tensor_release(dw);
    return TP_OK;
}

static tp_status emb_body(tp_comm *world, void *arg)
{
    loss_ctx *c = arg;
    tp_test_slot *s = &c->slot[tp_comm_rank(world)];
    tp_mesh *mesh = NULL;
    tp_comm_debug *dbg = NULL;
    RANK_OK(s, tp_mesh_create(world, c->lm.ndim, c->lm.shape, NULL, &mesh));
    RANK_OK(s, tp_comm_debug_create(&dbg));
    const emb_case cases[] = {
        {"colwise (weight S(1))", R, S1, R, R, S2, R, true, false},
        {"rowwise (weight S(0), masked lookup)", R, S0, R, R, P, R, true, false},
        {"indices S(0)", S0, R, R, R, S0, R, true, false},
        {"indices S(1)", S1, R, R, R, S1, R, true, false},
        {"replicated", R, R, R, R, R, R, true, false},
        {"mixed: indices S(0), weight S(0)", S0, S0, R, R, R, R, false, false},
        {"mixed: indices S(1), weight S(1)", S1, S1, R, R, R, R, false, false},
        {"colwise, indices S(0) on the other mesh dim", R, S1, S0, R, S2, S0, true, true},
        {"rowwise, indices S(0) on the other mesh dim", R, S0, S0, R, P, S0, true, true},
        {"rowwise on both mesh dims (nested row shards)", R, S0, R, S0, P, P, true, true},
        {"colwise on both mesh dims", R, S1, R, S1, S2, S2, true, true},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        if (cases[k].two_d && c->lm.ndim == 1)
            continue;
        TP_TEST_TRY(emb_check(s, mesh, &c->lm, &cases[k], TP_I64, dbg));
        TP_TEST_TRY(emb_check(s, mesh, &c->lm, &cases[k], TP_I32, dbg));
    }
    TP_TEST_TRY(emb_bad_sharded(s, mesh, &c->lm));
    tp_comm_debug_free(dbg);
    tp_mesh_free(mesh);
    return TP_OK;
}

/* ---- cross entropy on DTensors -------------------------------------------- */

/* LOGITS_VOCAB_POUTER: class-sharded on the inner mesh dim, Partial on the
 * other (2-D meshes): the Partial dim is reduced first, then vocab parallel. */
enum { LOGITS_VOCAB, LOGITS_REPLICATE, LOGITS_PARTIAL, LOGITS_VOCAB_POUTER };

typedef struct {
    tp_reduction red;
    bool weighted;
    int ignore; /* 0: no row ignored; 1: two rows at -100 (the default); 2: ignore_index 7 */
    tp_dtype tdtype;
    int logits;          /* LOGITS_* */
    bool target_sharded; /* target S(0) on the inner mesh dim (gathered first) */
} ce_cfg;

static const char *red_name(tp_reduction r)
{
    return r == TP_REDUCTION_MEAN ? "mean" : r == TP_REDUCTION_SUM ? "sum" : "none";
}

static tp_status close_or_equal(const tp_tensor *a, const tp_tensor *b, bool exact, bool *ok)
{
    if (exact)
        return tp_tensor_equal(a, b, ok);
    return tp_tensor_allclose(a, b, CE_RTOL, CE_ATOL, ok);
}

static tp_status ce_check(tp_test_slot *s, tp_mesh *mesh, const loss_mesh *lm, const ce_cfg *cf,
                          tp_comm_debug *dbg)
{
    const int m = tp_mesh_ndim(mesh);
    const int64_t n = 6, cls = 13, xshape[2] = {6, 13};
    const int64_t w_in = inner_size(lm);
    char label[192];
    static const char *const kinds[] = {"vocab-parallel", "Replicate", "Partial",
                                        "vocab-parallel, Partial on the other mesh dim,"};
    snprintf(label, sizeof label, "cross_entropy %s logits, %s%s, ignore mode %d, %s target%s",
             kinds[cf->logits],
             red_name(cf->red), cf->weighted ? " weighted" : "", cf->ignore,
             tp_dtype_name(cf->tdtype), cf->target_sharded ? " (sharded)" : "");
    int64_t tv[6] = {3, 12, 0, 7, 11, 5}, ign = -100;
    if (cf->ignore == 1)
        tv[2] = tv[4] = -100;
    if (cf->ignore == 2) {
        ign = 7;
        tv[1] = 7; /* rows 1 and 3 */
    }
    tp_tensor *t64 = NULL, *t = NULL, *x = NULL, *w = NULL, *g = NULL, *lp = NULL, *dx = NULL,
              *xl = NULL, *dt = NULL, *dw = NULL, *ld = NULL, *ll = NULL, *gfull = NULL;
    RANK_OK(s, tp_tensor_from_data(TP_I64, 1, &n, tv, &t64));
    RANK_OK(s, tp_tensor_to(t64, cf->tdtype, TP_CPU, &t));
    RANK_OK(s, randint_f32(2, xshape, -4, 5, 11, &x));
    RANK_OK(s, randint_f32(1, &cls, 1, 4, 12, &w));
    if (cf->red == TP_REDUCTION_NONE)
        RANK_OK(s, randint_f32(1, &n, -3, 4, 13, &g));
    else
        RANK_OK(s, tp_tensor_from_data(TP_F32, 0, NULL, (float[]){3.0f}, &g));

    /* single rank */
    RANK_OK(s, tp_tensor_set_requires_grad(x, true));
    tp_cross_entropy_options o = {cf->red, cf->weighted ? w : NULL, ign};
    RANK_OK(s, tp_cross_entropy(x, t, &o, &lp));
    RANK_OK(s, tp_backward(lp, g));

    /* distributed */
    tp_placement px[2], pt[2], rr[2] = {R, R};
    int64_t want_ar = 0, want_ag = 0;
    switch (cf->logits) {
    case LOGITS_VOCAB:
        place(lm, S1, R, px);
        want_ar = w_in > 1 ? 3 : 0;
        break;
    case LOGITS_REPLICATE:
        place(lm, R, R, px);
        break;
    case LOGITS_PARTIAL:
        place(lm, P, R, px);
        want_ar = w_in > 1 ? 1 : 0;
        break;
    default:
        place(lm, S1, P, px);
        want_ar = 1 + (w_in > 1 ? 3 : 0);
        break;
    }
    place(lm, cf->target_sharded ? S0 : R, R, pt);
    if (cf->target_sharded && w_in > 1)
        want_ag = 1;
    if (cf->logits == LOGITS_PARTIAL) {
        /* one rank per group of the inner mesh dim holds the logits, the others zeros */
        int inner = lm->ndim == 1 ? 0 : lm->sd;
        if (tp_mesh_coord(mesh, inner) == 0)
            RANK_OK(s, tp_tensor_clone(x, &xl));
        else
            RANK_OK(s, tp_tensor_zeros(TP_F32, TP_CPU, 2, xshape, &xl));
        RANK_OK(s, tp_tensor_set_requires_grad(xl, true));
        RANK_OK(s, tp_dtensor_from_local(mesh, xl, m, px, NULL, &dx));
    } else if (cf->logits == LOGITS_VOCAB_POUTER) {
        /* this rank's class shard on coordinate 0 of the other mesh dim, zeros elsewhere */
        tp_placement ps[2];
        tp_tensor *tmp = NULL, *loc = NULL;
        place(lm, S1, R, ps);
        RANK_OK(s, tp_dtensor_distribute(mesh, x, m, ps, -1, &tmp));
        RANK_OK(s, tp_dtensor_to_local(tmp, 0, NULL, &loc));
        if (tp_mesh_coord(mesh, 1 - lm->sd) == 0)
            RANK_OK(s, tp_tensor_clone(loc, &xl));
        else
            RANK_OK(s, tp_tensor_zeros(TP_F32, TP_CPU, 2, tp_tensor_shape(loc), &xl));
        tp_tensor_release(loc);
        tp_tensor_release(tmp);
        RANK_OK(s, tp_tensor_set_requires_grad(xl, true));
        tp_from_local_options fo = {xshape, false};
        RANK_OK(s, tp_dtensor_from_local(mesh, xl, m, px, &fo, &dx));
    } else {
        RANK_OK(s, tp_dtensor_distribute(mesh, x, m, px, -1, &dx));
        RANK_OK(s, tp_tensor_set_requires_grad(dx, true));
    }
    RANK_OK(s, tp_dtensor_distribute(mesh, t, m, pt, -1, &dt));
    if (cf->weighted)
        RANK_OK(s, tp_dtensor_distribute(mesh, w, m, rr, -1, &dw));
    tp_cross_entropy_options od = {cf->red, dw, ign};

    RANK_OK(s, tp_comm_debug_begin(dbg));
    tp_status st = tp_cross_entropy(dx, dt, &od, &ld);
    RANK_OK(s, tp_comm_debug_end(dbg));
    RANK_OK(s, st);
    int64_t ar = tp_comm_debug_module_count(dbg, "Global", TP_PHASE_FORWARD, TP_COLL_ALL_REDUCE);
    int64_t ag = tp_comm_debug_module_count(dbg, "Global", TP_PHASE_FORWARD, TP_COLL_ALL_GATHER);
    RANK_EXPECT(s, ar == want_ar && ag == want_ag && tp_comm_debug_total(dbg) == want_ar + want_ag,
                "%s: forward issued %lld all_reduce, %lld all_gather, %lld in all; expected %lld, "
                "%lld",
                label, (long long)ar, (long long)ag, (long long)tp_comm_debug_total(dbg),
                (long long)want_ar, (long long)want_ag);
    RANK_EXPECT(s, pls_eq(m, tp_dtensor_placements(ld), rr), "%s: the loss is not Replicate",
                label);
    RANK_EXPECT(s, tp_tensor_ndim(ld) == (cf->red == TP_REDUCTION_NONE ? 1 : 0),
                "%s: loss has %d dims", label, tp_tensor_ndim(ld));
    RANK_OK(s, tp_dtensor_to_local(ld, 0, NULL, &ll));
    const bool exact = cf->logits == LOGITS_REPLICATE || cf->logits == LOGITS_PARTIAL;
    bool ok = false;
    RANK_OK(s, close_or_equal(ll, lp, exact, &ok));
    if (!ok) {
        double diff = 0;
        RANK_OK(s, tp_tensor_max_abs_diff(ll, lp, &diff));
        RANK_EXPECT(s, 0, "%s: loss differs from the single-rank one (max |diff| %g)", label,
                    diff);
    }

    /* backward through the local loss: no collective at all */
    RANK_OK(s, tp_comm_debug_begin(dbg));
    st = tp_backward(ll, g);
    RANK_OK(s, tp_comm_debug_end(dbg));
    RANK_OK(s, st);
    RANK_EXPECT(s, tp_comm_debug_total(dbg) == 0 &&
                       tp_comm_debug_module_count(dbg, "Global", TP_PHASE_BACKWARD,
                                                  TP_COLL_ANY) == 0,
                "%s: backward issued %lld collectives", label,
                (long long)tp_comm_debug_total(dbg));
    if (cf->logits == LOGITS_PARTIAL) {
        tp_tensor *gl = tp_tensor_grad(xl);
        RANK_EXPECT(s, gl != NULL, "%s: the local logits got no gradient", label);
        if (gl) {
            RANK_OK(s, tp_tensor_equal(gl, tp_tensor_grad(x), &ok));
            RANK_EXPECT(s, ok, "%s: logits gradient differs", label);
        }
    } else if (cf->logits == LOGITS_VOCAB_POUTER) {
        /* the local leaf's gradient is this rank's class shard of the gradient */
        tp_tensor *gl = tp_tensor_grad(xl), *gref = NULL, *gshard = NULL;
        tp_placement ps[2];
        place(lm, S1, R, ps);
        RANK_EXPECT(s, gl != NULL, "%s: the local logits got no gradient", label);
        RANK_OK(s, tp_dtensor_distribute(mesh, tp_tensor_grad(x), m, ps, -1, &gref));
        RANK_OK(s, tp_dtensor_to_local(gref, 0, NULL, &gshard));
        if (gl) {
            RANK_OK(s, tp_tensor_allclose(gl, gshard, CE_RTOL, CE_ATOL, &ok));
            RANK_EXPECT(s, ok, "%s: logits gradient differs", label);
        }
        tp_tensor_release(gshard);
        tp_tensor_release(gref);
    } else {
        tp_tensor *gd = tp_tensor_grad(dx);
        RANK_EXPECT(s, gd != NULL, "%s: the logits got no gradient", label);
        if (gd) {
            RANK_EXPECT(s, pls_eq(m, tp_dtensor_placements(gd), px),
                        "%s: logits gradient has other placements than the logits", label);
            RANK_OK(s, tp_dtensor_full_tensor(gd, &gfull));
            RANK_OK(s, close_or_equal(gfull, tp_tensor_grad(x), exact, &ok));
            if (!ok) {
                double diff = 0;
                RANK_OK(s, tp_tensor_max_abs_diff(gfull, tp_tensor_grad(x), &diff));
                RANK_EXPECT(s, 0, "%s: logits gradient differs (max |diff| %g)", label, diff);
            }
        }
    }
    RANK_EXPECT(s, !dw || tp_tensor_grad(dw) == NULL, "%s: class weights got a gradient",
                label);
    tp_tensor *all[] = {t64, t, x, w, g, lp, dx, xl, dt, dw, ld, ll, gfull};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        tp_tensor_release(all[i]);
    return TP_OK;
}

/* Layouts the vocab-parallel form refuses, bad targets, mixing. */
static tp_status ce_errors(tp_test_slot *s, tp_mesh *mesh, const loss_mesh *lm)
{
    const int m = tp_mesh_ndim(mesh);
    const int64_t n = 6, xshape[2] = {6, 13};
    int64_t tv[6] = {3, 12, 0, 7, 11, 5};
    tp_tensor *x = NULL, *t = NULL, *dx = NULL, *dt = NULL, *loss = NULL;
    RANK_OK(s, randint_f32(2, xshape, -4, 5, 11, &x));
    RANK_OK(s, tp_tensor_from_data(TP_I64, 1, &n, tv, &t));
    tp_placement rr[2] = {R, R}, px[2];
    RANK_OK(s, tp_dtensor_distribute(mesh, t, m, rr, -1, &dt));

    /* batch-sharded logits */
    place(lm, S0, R, px);
    RANK_OK(s, tp_dtensor_distribute(mesh, x, m, px, -1, &dx));
    tp_status st = tp_cross_entropy(dx, dt, NULL, &loss);
    RANK_EXPECT(s, st == TP_ERR_NOT_SUPPORTED && loss == NULL &&
                       strstr(tp_last_error(), "shard the class dim") &&
                       strstr(tp_last_error(), "replicate"),
                "logits S(0): %s (%s)", tp_status_name(st), tp_last_error());
    tp_tensor_release(dx);
    dx = NULL;
    if (lm->ndim == 2) {
        /* class-sharded on one mesh dim, batch-sharded on the other */
        place(lm, S1, S0, px);
        RANK_OK(s, tp_dtensor_distribute(mesh, x, m, px, -1, &dx));
        st = tp_cross_entropy(dx, dt, NULL, &loss);
        RANK_EXPECT(s, st == TP_ERR_NOT_SUPPORTED && strstr(tp_last_error(), "shard the class dim"),
                    "logits (S(1), S(0)): %s (%s)", tp_status_name(st), tp_last_error());
        tp_tensor_release(dx);
        dx = NULL;
        /* class-sharded on both mesh dims */
        place(lm, S1, S1, px);
        RANK_OK(s, tp_dtensor_distribute(mesh, x, m, px, -1, &dx));
        st = tp_cross_entropy(dx, dt, NULL, &loss);
        RANK_EXPECT(s, st == TP_ERR_NOT_SUPPORTED && strstr(tp_last_error(), "by mesh dims 0 and 1"),
                    "logits (S(1), S(1)): %s (%s)", tp_status_name(st), tp_last_error());
        tp_tensor_release(dx);
        dx = NULL;
    }
    /* a target out of range, found on the full (Replicate) targets */
    place(lm, S1, R, px);
    RANK_OK(s, tp_dtensor_distribute(mesh, x, m, px, -1, &dx));
    tp_tensor *bad = NULL, *dbad = NULL;
    tv[4] = 13;
    RANK_OK(s, tp_tensor_from_data(TP_I64, 1, &n, tv, &bad));
    RANK_OK(s, tp_dtensor_distribute(mesh, bad, m, rr, -1, &dbad));
    st = tp_cross_entropy(dx, dbad, NULL, &loss);
    RANK_EXPECT(s, st == TP_ERR_INVALID_ARG && loss == NULL &&
                       strstr(tp_last_error(), "target 13 at row 4"),
                "target out of range: %s (%s)", tp_status_name(st), tp_last_error());
    /* a Partial target is meaningless */
    tp_tensor *dtp = NULL;
    tp_placement pp[2];
    place(lm, P, R, pp);
    RANK_OK(s, tp_dtensor_from_local(mesh, t, m, pp, NULL, &dtp));
    st = tp_cross_entropy(dx, dtp, NULL, &loss);
    RANK_EXPECT(s, st == TP_ERR_INVALID_ARG && loss == NULL &&
                       strstr(tp_last_error(), "target is Partial"),
                "Partial target: %s (%s)", tp_status_name(st), tp_last_error());
    tp_tensor_release(dtp);
    /* plain logits with a DTensor target */
    st = tp_cross_entropy(x, dt, NULL, &loss);
    RANK_EXPECT(s, st == TP_ERR_INVALID_ARG &&
                       strstr(tp_last_error(), "logits is a plain tensor but target is a DTensor"),
                "mixing: %s (%s)", tp_status_name(st), tp_last_error());

    /* every row ignored: the mean is NaN (0 / 0), as in PyTorch */
    int64_t all_ign[6] = {-100, -100, -100, -100, -100, -100};
    tp_tensor *ti = NULL, *dti = NULL, *ll = NULL;
    RANK_OK(s, tp_tensor_from_data(TP_I64, 1, &n, all_ign, &ti));
    RANK_OK(s, tp_dtensor_distribute(mesh, ti, m, rr, -1, &dti));
    RANK_OK(s, tp_cross_entropy(dx, dti, NULL, &loss));
    RANK_OK(s, tp_dtensor_to_local(loss, 0, NULL, &ll));
    double v = 0;
    RANK_OK(s, tp_tensor_get(ll, NULL, &v));
    RANK_EXPECT(s, isnan(v), "all rows ignored: mean is %g, expected NaN", v);

    tp_tensor *all[] = {x, t, dx, dt, bad, dbad, ti, dti, loss, ll};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        tp_tensor_release(all[i]);
    return TP_OK;
}

static tp_status ce_body(tp_comm *world, void *arg)
{
    loss_ctx *c = arg;
    tp_test_slot *s = &c->slot[tp_comm_rank(world)];
    tp_mesh *mesh = NULL;
    tp_comm_debug *dbg = NULL;
    RANK_OK(s, tp_mesh_create(world, c->lm.ndim, c->lm.shape, NULL, &mesh));
    RANK_OK(s, tp_comm_debug_create(&dbg));
    const tp_reduction reds[3] = {TP_REDUCTION_MEAN, TP_REDUCTION_SUM, TP_REDUCTION_NONE};
    for (int r = 0; r < 3; r++)
        for (int wtd = 0; wtd < 2; wtd++)
            for (int ig = 0; ig < 3; ig++) {
                ce_cfg cf = {reds[r], wtd != 0, ig, TP_I64, LOGITS_VOCAB, false};
                TP_TEST_TRY(ce_check(s, mesh, &c->lm, &cf, dbg));
            }
    /* i32 targets, a sharded target (gathered first), Replicate and Partial logits */
    ce_cfg extra[] = {
        {TP_REDUCTION_MEAN, true, 1, TP_I32, LOGITS_VOCAB, false},
        {TP_REDUCTION_MEAN, true, 1, TP_I64, LOGITS_VOCAB, true},
        {TP_REDUCTION_NONE, false, 2, TP_I32, LOGITS_VOCAB, true},
        {TP_REDUCTION_MEAN, true, 1, TP_I64, LOGITS_REPLICATE, false},
        {TP_REDUCTION_NONE, true, 2, TP_I64, LOGITS_REPLICATE, false},
        {TP_REDUCTION_SUM, false, 0, TP_I32, LOGITS_REPLICATE, true},
        {TP_REDUCTION_MEAN, true, 1, TP_I64, LOGITS_PARTIAL, false},
        {TP_REDUCTION_NONE, false, 0, TP_I64, LOGITS_PARTIAL, false},
    };
    for (size_t k = 0; k < sizeof extra / sizeof extra[0]; k++)
        TP_TEST_TRY(ce_check(s, mesh, &c->lm, &extra[k], dbg));
    if (c->lm.ndim == 2) {
        ce_cfg pouter[] = {
            {TP_REDUCTION_MEAN, true, 1, TP_I64, LOGITS_VOCAB_POUTER, false},
            {TP_REDUCTION_NONE, false, 2, TP_I64, LOGITS_VOCAB_POUTER, false},
        };
        for (size_t k = 0; k < sizeof pouter / sizeof pouter[0]; k++)
            TP_TEST_TRY(ce_check(s, mesh, &c->lm, &pouter[k], dbg));
    }
    TP_TEST_TRY(ce_errors(s, mesh, &c->lm));
    tp_comm_debug_free(dbg);
    tp_mesh_free(mesh);
    return TP_OK;
}

ParameterizedTestParameters(ops_loss, embedding_equals_single_rank)
{
    static loss_mesh meshes[] = {{1, {1, 1}, 0}, {1, {2, 1}, 0}, {1, {3, 1}, 0},
                                 {1, {4, 1}, 0}, {1, {8, 1}, 0}, {2, {2, 2}, 1},
                                 {2, {2, 2}, 0}, {2, {4, 2}, 1}, {2, {2, 3}, 0}};
    return cr_make_param_array(loss_mesh, meshes, sizeof meshes / sizeof meshes[0]);
}

ParameterizedTest(loss_mesh *lm, ops_loss, embedding_equals_single_rank, .timeout = 120)
{
    loss_ctx c = {.lm = *lm};
    tp_test_run((int)(lm->shape[0] * (lm->ndim > 1 ? lm->shape[1] : 1)), emb_body, &c, c.slot);
}

ParameterizedTestParameters(ops_loss, cross_entropy_vocab_parallel)
{
    static loss_mesh meshes[] = {{1, {1, 1}, 0}, {1, {2, 1}, 0}, {1, {3, 1}, 0},
                                 {1, {4, 1}, 0}, {1, {8, 1}, 0}, {2, {2, 2}, 1},
                                 {2, {2, 2}, 0}, {2, {4, 2}, 1}, {2, {2, 3}, 0}};
    return cr_make_param_array(loss_mesh, meshes, sizeof meshes / sizeof meshes[0]);
}

ParameterizedTest(loss_mesh *lm, ops_loss, cross_entropy_vocab_parallel, .timeout = 120)
{
    loss_ctx c = {.lm = *lm};
    tp_test_run((int)(lm->shape[0] * (lm->ndim > 1 ? lm->shape[1] : 1)), ce_body, &c, c.slot);
}

/* ---- plain tensors (main thread) ------------------------------------------- */

static float at(tp_tensor *t, int64_t i, int64_t j)
{
    double v = 0;
    int64_t idx[2] = {i, j};
    CHECK_OK(tp_tensor_get(t, tp_tensor_ndim(t) == 0 ? NULL : idx, &v));
    return (float)v;
}

Test(ops_loss, embedding_plain_values, .timeout = 30)
{
    /* weight rows r = [10 r, 10 r + 1]; indices [[2, 0, 2], [1, 2, 3]] */
    float wv[8] = {0, 1, 10, 11, 20, 21, 30, 31};
    int32_t iv[6] = {2, 0, 2, 1, 2, 3};
    tp_tensor *w = NULL, *idx = NULL, *y = NULL, *g = NULL;
    CHECK_OK(tp_tensor_from_data(TP_F32, 2, (int64_t[]){4, 2}, wv, &w));
    CHECK_OK(tp_tensor_from_data(TP_I32, 2, (int64_t[]){2, 3}, iv, &idx));
    CHECK_OK(tp_tensor_set_requires_grad(w, true));
    CHECK_OK(tp_embedding(idx, w, &y));
    cr_assert(tp_tensor_ndim(y) == 3 && tp_tensor_size(y, 0) == 2 && tp_tensor_size(y, 1) == 3 &&
                  tp_tensor_size(y, 2) == 2,
              "embedding output shape");
    for (int i = 0; i < 6; i++)
        for (int d = 0; d < 2; d++) {
            double v = 0;
            CHECK_OK(tp_tensor_get(y, (int64_t[]){i / 3, i % 3, d}, &v));
            cr_assert(v == 10.0 * iv[i] + d, "y[%d][%d] = %g", i, d, v);
        }
    /* gradient: rows accumulate once per use (row 2 three times) */
    CHECK_OK(tp_tensor_zeros(TP_F32, TP_CPU, 3, (int64_t[]){2, 3, 2}, &g));
    CHECK_OK(tp_tensor_fill(g, 1.0));
    CHECK_OK(tp_backward(y, g));
    tp_tensor *gw = tp_tensor_grad(w);
    cr_assert(gw != NULL, "no weight gradient");
    const float uses[4] = {1, 1, 3, 1};
    for (int r = 0; r < 4; r++)
        for (int d = 0; d < 2; d++)
            cr_assert(at(gw, r, d) == uses[r], "gw[%d][%d] = %g", r, d, (double)at(gw, r, d));
    tp_tensor_release(g);
    tp_tensor_release(y);
    tp_tensor_release(idx);
    tp_tensor_release(w);
}

Test(ops_loss, embedding_plain_errors, .timeout = 30)
{
    tp_tensor *w = NULL, *idx = NULL, *y = NULL, *fidx = NULL, *w1 = NULL;
    int64_t iv[6] = {0, 1, 2, 3, 7, 6};
    CHECK_OK(tp_tensor_zeros(TP_F32, TP_CPU, 2, (int64_t[]){7, 3}, &w));
    CHECK_OK(tp_tensor_from_data(TP_I64, 2, (int64_t[]){2, 3}, iv, &idx));
    CHECK_ERR(tp_embedding(idx, w, &y), TP_ERR_INVALID_ARG);
    cr_assert(y == NULL);
    cr_assert(strstr(tp_last_error(), "index 7 at position [1, 1]") &&
                  strstr(tp_last_error(), "7 rows"),
              "%s", tp_last_error());
    iv[4] = 1;
    iv[2] = -1;
    tp_tensor_release(idx);
    CHECK_OK(tp_tensor_from_data(TP_I64, 2, (int64_t[]){2, 3}, iv, &idx));
    CHECK_ERR(tp_embedding(idx, w, &y), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "index -1 at position [0, 2]"), "%s", tp_last_error());
    CHECK_OK(tp_tensor_zeros(TP_F32, TP_CPU, 1, (int64_t[]){3}, &fidx));
    CHECK_ERR(tp_embedding(fidx, w, &y), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "indices must be i64 or i32"), "%s", tp_last_error());
    CHECK_OK(tp_tensor_zeros(TP_F32, TP_CPU, 1, (int64_t[]){7}, &w1));
    CHECK_ERR(tp_embedding(idx, w1, &y), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "weight must be 2-d"), "%s", tp_last_error());
    CHECK_ERR(tp_embedding(NULL, w, &y), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_embedding(idx, NULL, &y), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_embedding(idx, w, NULL), TP_ERR_INVALID_ARG);
    tp_tensor_release(w1);
    tp_tensor_release(fidx);
    tp_tensor_release(idx);
    tp_tensor_release(w);
}

/* loss = sum_r w_t (lse(x_r) - x_r,t) / sum_r w_t over counted rows. */
Test(ops_loss, cross_entropy_plain_values, .timeout = 30)
{
    const float xv[9] = {1, 2, 3, 0, 0, 0, -1, 4, 2};
    const int64_t tv[3] = {2, 0, -100};
    const float wv[3] = {1, 2, 3};
    tp_tensor *t = NULL, *w = NULL;
    CHECK_OK(tp_tensor_from_data(TP_I64, 1, (int64_t[]){3}, tv, &t));
    CHECK_OK(tp_tensor_from_data(TP_F32, 1, (int64_t[]){3}, wv, &w));
    /* expected, in double */
    double lse0 = log(exp(1.0) + exp(2.0) + exp(3.0)), lse1 = log(3.0);
    double l0 = 3.0 * (lse0 - 3.0), l1 = 1.0 * lse1, wsum = 4.0;
    for (int red = 0; red < 3; red++) {
        for (int weighted = 0; weighted < 2; weighted++) {
            tp_tensor *x = NULL, *loss = NULL;
            CHECK_OK(tp_tensor_from_data(TP_F32, 2, (int64_t[]){3, 3}, xv, &x));
            CHECK_OK(tp_tensor_set_requires_grad(x, true));
            tp_cross_entropy_options o = TP_CROSS_ENTROPY_DEFAULTS;
            o.reduction = (tp_reduction)red;
            o.weight = weighted ? w : NULL;
            CHECK_OK(tp_cross_entropy(x, t, &o, &loss));
            double a0 = weighted ? l0 : l0 / 3.0, a1 = l1, ws = weighted ? wsum : 2.0;
            if (red == TP_REDUCTION_NONE) {
                cr_assert(tp_tensor_ndim(loss) == 1 && tp_tensor_size(loss, 0) == 3);
                double v[3];
                for (int64_t i = 0; i < 3; i++)
                    CHECK_OK(tp_tensor_get(loss, &i, &v[i]));
                cr_assert(fabs(v[0] - a0) < 1e-5 && fabs(v[1] - a1) < 1e-5 && v[2] == 0,
                          "none: %g %g %g, expected %g %g 0", v[0], v[1], v[2], a0, a1);
            } else {
                cr_assert(tp_tensor_ndim(loss) == 0);
                double v = 0, want = red == TP_REDUCTION_SUM ? a0 + a1 : (a0 + a1) / ws;
                CHECK_OK(tp_tensor_get(loss, NULL, &v));
                cr_assert(fabs(v - want) < 1e-5, "%s%s: %g, expected %g", red_name(o.reduction),
                          weighted ? " weighted" : "", v, want);
            }
            /* gradient: d/dx[r,c] = s_r w_t (softmax_c - [c == t]), s_r the loss
             * gradient per row (1 for sum, 1/wsum for mean, g_r for none) */
            if (red == TP_REDUCTION_NONE) {
                tp_tensor *g = NULL;
                CHECK_OK(tp_tensor_from_data(TP_F32, 1, (int64_t[]){3}, (float[]){1, 1, 1}, &g));
                CHECK_OK(tp_backward(loss, g));
                tp_tensor_release(g);
            } else {
                CHECK_OK(tp_backward(loss, NULL));
            }
            tp_tensor *gx = tp_tensor_grad(x);
            cr_assert(gx != NULL);
            double scale = red == TP_REDUCTION_MEAN ? 1.0 / ws : 1.0;
            for (int r = 0; r < 3; r++) {
                double lse = r == 0 ? lse0 : r == 1 ? lse1 : 0;
                double wt = r == 2 ? 0 : weighted ? wv[tv[r]] : 1.0;
                for (int cc = 0; cc < 3; cc++) {
                    double want =
                        r == 2 ? 0
                               : scale * wt * (exp(xv[r * 3 + cc] - lse) - (cc == tv[r] ? 1 : 0));
                    cr_assert(fabs(at(gx, r, cc) - want) < 1e-6, "grad[%d][%d] = %g, expected %g",
                              r, cc, (double)at(gx, r, cc), want);
                }
            }
            tp_tensor_release(loss);
            tp_tensor_release(x);
        }
    }
    /* all rows ignored: the mean is NaN (as PyTorch), the sum 0 */
    tp_tensor *x = NULL, *ti = NULL, *loss = NULL;
    CHECK_OK(tp_tensor_from_data(TP_F32, 2, (int64_t[]){3, 3}, xv, &x));
    CHECK_OK(tp_tensor_from_data(TP_I64, 1, (int64_t[]){3}, (int64_t[]){-100, -100, -100}, &ti));
    CHECK_OK(tp_cross_entropy(x, ti, NULL, &loss));
    double v = 0;
    CHECK_OK(tp_tensor_get(loss, NULL, &v));
    cr_assert(isnan(v), "mean over no rows: %g", v);
    tp_tensor_release(loss);
    tp_cross_entropy_options o = TP_CROSS_ENTROPY_DEFAULTS;
    o.reduction = TP_REDUCTION_SUM;
    CHECK_OK(tp_cross_entropy(x, ti, &o, &loss));
    CHECK_OK(tp_tensor_get(loss, NULL, &v));
    cr_assert(v == 0, "sum over no rows: %g", v);
    tp_tensor_release(loss);
    tp_tensor_release(ti);
    tp_tensor_release(x);
    tp_tensor_release(w);
    tp_tensor_release(t);
}

Test(ops_loss, cross_entropy_plain_errors, .timeout = 30)
{
    tp_tensor *x = NULL, *x3 = NULL, *t = NULL, *t2 = NULL, *tf = NULL, *w2 = NULL, *loss = NULL;
    CHECK_OK(tp_tensor_zeros(TP_F32, TP_CPU, 2, (int64_t[]){3, 4}, &x));
    CHECK_OK(tp_tensor_zeros(TP_F32, TP_CPU, 3, (int64_t[]){3, 4, 1}, &x3));
    CHECK_OK(tp_tensor_from_data(TP_I64, 1, (int64_t[]){3}, (int64_t[]){0, 4, 1}, &t));
    CHECK_OK(tp_tensor_zeros(TP_I64, TP_CPU, 1, (int64_t[]){2}, &t2));
    CHECK_OK(tp_tensor_zeros(TP_F32, TP_CPU, 1, (int64_t[]){3}, &tf));
    CHECK_OK(tp_tensor_zeros(TP_F32, TP_CPU, 1, (int64_t[]){3}, &w2));

    CHECK_ERR(tp_cross_entropy(x, t, NULL, &loss), TP_ERR_INVALID_ARG);
    cr_assert(loss == NULL);
    cr_assert(strstr(tp_last_error(), "target 4 at row 1 is outside [0, 4)"), "%s",
              tp_last_error());
    /* a custom ignore_index makes the same target legal */
    tp_cross_entropy_options o = TP_CROSS_ENTROPY_DEFAULTS;
    o.ignore_index = 4;
    CHECK_OK(tp_cross_entropy(x, t, &o, &loss));
    tp_tensor_release(loss);
    loss = NULL;
    CHECK_ERR(tp_cross_entropy(x3, t, &o, &loss), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "logits must be 2-d"), "%s", tp_last_error());
    CHECK_ERR(tp_cross_entropy(x, t2, &o, &loss), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "target must be [3]"), "%s", tp_last_error());
    CHECK_ERR(tp_cross_entropy(x, tf, &o, &loss), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "target must be i64 or i32"), "%s", tp_last_error());
    o.weight = w2;
    CHECK_ERR(tp_cross_entropy(x, t, &o, &loss), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "weight must be [4]"), "%s", tp_last_error());
    o.weight = NULL;
    o.reduction = (tp_reduction)7;
    CHECK_ERR(tp_cross_entropy(x, t, &o, &loss), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "invalid reduction"), "%s", tp_last_error());
    CHECK_ERR(tp_cross_entropy(NULL, t, NULL, &loss), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_cross_entropy(x, NULL, NULL, &loss), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_cross_entropy(x, t, NULL, NULL), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_cross_entropy(t, t, NULL, &loss), TP_ERR_NOT_SUPPORTED);
    tp_tensor *all[] = {x, x3, t, t2, tf, w2};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        tp_tensor_release(all[i]);
}
