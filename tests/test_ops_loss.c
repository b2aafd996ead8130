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
 * sharded on the batch dim are refused.
 *
 * N-D cross_entropy (logits (C), (N, C), (N, C, d1), (N, C, d1, d2), C = 10
 * over 1-4 and 8 ranks and on 2-D meshes with a batch or spatial dim sharded
 * on the other mesh dim): values and gradients against the definition in
 * double and the single-rank op, loss placements as PyTorch 2.15's
 * loss_parallel, 3 all_reduces forward and none backward; one case against
 * numbers from torch.nn.functional.cross_entropy (tests/gen_ce_nd_fixture.py);
 * refused layouts, bad target shapes, dtypes and values with exact messages. */
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
        /* class-sharded on one mesh dim, batch-sharded on the other: the mean
         * would divide by a per-rank count (PyTorch's loss_parallel refuses
         * it too); sum and none work (cross_entropy_nd) */
        place(lm, S1, S0, px);
        RANK_OK(s, tp_dtensor_distribute(mesh, x, m, px, -1, &dx));
        st = tp_cross_entropy(dx, dt, NULL, &loss);
        char want[320], pls[64];
        snprintf(want, sizeof want,
                 "cross_entropy: reduction mean with logits sharded on dim 0 by mesh dim %d "
                 "(placements %s): each rank would divide by its own count; use reduction sum "
                 "or none and divide by the global count (as PyTorch's loss_parallel)",
                 1 - lm->sd, tp_placements_str(m, px, pls, sizeof pls));
        RANK_EXPECT(s, st == TP_ERR_NOT_SUPPORTED && loss == NULL &&
                           strcmp(tp_last_error(), want) == 0,
                    "logits (S(1), S(0)), mean: %s (%s)", tp_status_name(st), tp_last_error());
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

/* ---- cross entropy on N-D logits ------------------------------------------- */

/* Logits (C), (N, C), (N, C, d1) and (N, C, d1, d2) with C = 10: uneven class
 * shards over 3, 4 and 8 ranks (on 8, three ranks hold no class). */
#define ND_SHAPES 4
static const int ND_NDIM[ND_SHAPES] = {1, 2, 3, 4};
static const int64_t ND_SHAPE[ND_SHAPES][4] = {{10}, {6, 10}, {3, 10, 5}, {2, 10, 3, 4}};

static int64_t prod(int nd, const int64_t *shape)
{
    int64_t n = 1;
    for (int d = 0; d < nd; d++)
        n *= shape[d];
    return n;
}

/* The targets' shape: the logits' without the class dim (1, or 0 for 1-D). */
static int nd_tshape(int nd, const int64_t *xs, int64_t *ts)
{
    const int cd = nd == 1 ? 0 : 1;
    for (int d = 0, k = 0; d < nd; d++)
        if (d != cd)
            ts[k++] = xs[d];
    return nd - 1;
}

/* The loss and the logits gradient in double, straight from the definition:
 * loss per target element for none, else loss[0]; gx for the loss gradient g
 * (one per target element for none, g[0] otherwise). */
static void ce_ref(int nd, const int64_t *xs, const float *x, const int64_t *t, const float *w,
                   int64_t ign, tp_reduction red, const float *g, double *loss, double *gx)
{
    const int cd = nd == 1 ? 0 : 1;
    const int64_t outer = cd ? xs[0] : 1, c = xs[cd], inner = prod(nd - cd - 1, xs + cd + 1);
    double wsum = 0, sum = 0;
    for (int pass = 0; pass < 2; pass++)
        for (int64_t r = 0; r < outer * inner; r++) {
            const int64_t base = r / inner * c * inner + r % inner;
            if (t[r] == ign) {
                if (pass == 0 && red == TP_REDUCTION_NONE)
                    loss[r] = 0;
                for (int64_t k = 0; pass == 1 && k < c; k++)
                    gx[base + k * inner] = 0;
                continue;
            }
            double mx = -INFINITY, se = 0, wt = w ? w[t[r]] : 1.0;
            for (int64_t k = 0; k < c; k++)
                mx = fmax(mx, x[base + k * inner]);
            for (int64_t k = 0; k < c; k++)
                se += exp(x[base + k * inner] - mx);
            if (pass == 0) {
                double l = wt * (log(se) + mx - x[base + t[r] * inner]);
                if (red == TP_REDUCTION_NONE)
                    loss[r] = l;
                sum += l;
                wsum += wt;
                continue;
            }
            double sc = red == TP_REDUCTION_NONE ? g[r] : red == TP_REDUCTION_MEAN ? g[0] / wsum
                                                                                   : g[0];
            for (int64_t k = 0; k < c; k++)
                gx[base + k * inner] =
                    sc * wt * (exp(x[base + k * inner] - mx) / se - (k == t[r] ? 1.0 : 0.0));
        }
    if (red != TP_REDUCTION_NONE)
        loss[0] = red == TP_REDUCTION_SUM ? sum : sum / wsum;
}

/* Whether every |a - b| <= atol + rtol |b|; *maxd the largest |a - b|. */
static bool arr_close(const float *a, const double *b, int64_t n, double rtol, double atol,
                      double *maxd)
{
    bool ok = true;
    *maxd = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        *maxd = fmax(*maxd, d);
        ok = ok && d <= atol + rtol * fabs(b[i]);
    }
    return ok;
}

/* ND_VOCAB: the class dim sharded on the inner mesh dim, the other mesh dim
 * Replicate; ND_BATCH / ND_SPATIAL (2-D meshes): the other mesh dim shards
 * dim 0 / the last dim; ND_REPLICATE: no shard at all. */
enum { ND_VOCAB, ND_BATCH, ND_SPATIAL, ND_REPLICATE, ND_LAYOUTS };

typedef struct {
    int shape; /* index into ND_SHAPE */
    int layout;
    tp_reduction red;
    bool weighted;
    int ignore;      /* 0: none; 1: some targets -100 (the default); 2: ignore_index 7 */
    bool target_rep; /* the target passed Replicate (split locally) */
} nd_cfg;

/* The logits' placements of a layout, and the targets' (the logits' less the
 * class dim). */
static void nd_layout(const loss_mesh *lm, int nd, int layout, tp_placement *px,
                      tp_placement *pt)
{
    const int cd = nd == 1 ? 0 : 1;
    tp_placement other = layout == ND_BATCH ? S0 : layout == ND_SPATIAL ? tp_shard(nd - 1) : R;
    place(lm, layout == ND_REPLICATE ? R : tp_shard(cd), other, px);
    for (int d = 0; d < lm->ndim; d++)
        pt[d] = px[d].kind == TP_PLACEMENT_SHARD && px[d].dim != cd
                    ? tp_shard(px[d].dim > cd ? px[d].dim - 1 : px[d].dim)
                    : R;
}

static tp_status nd_check(tp_test_slot *s, tp_mesh *mesh, const loss_mesh *lm, const nd_cfg *cf,
                          tp_comm_debug *dbg)
{
    const int m = tp_mesh_ndim(mesh), nd = ND_NDIM[cf->shape], cd = nd == 1 ? 0 : 1;
    const int64_t *xs = ND_SHAPE[cf->shape];
    int64_t ts[4];
    const int tnd = nd_tshape(nd, xs, ts);
    const int64_t nx = prod(nd, xs), nt = prod(tnd, ts), cls = xs[cd];
    tp_placement px[2], pt[2], pl[2], rr[2] = {R, R};
    nd_layout(lm, nd, cf->layout, px, pt);
    char label[224], shp[48] = "", pls[64];
    for (int d = 0, len = 0; d < nd; d++)
        len += snprintf(shp + len, sizeof shp - (size_t)len, d ? ", %lld" : "[%lld",
                        (long long)xs[d]);
    snprintf(label, sizeof label, "cross_entropy logits %s] %s, %s%s, ignore mode %d%s", shp,
             tp_placements_str(m, px, pls, sizeof pls), red_name(cf->red),
             cf->weighted ? " weighted" : "", cf->ignore,
             cf->target_rep ? ", Replicate target" : "");
    tp_tensor *x = NULL, *t = NULL, *w = NULL, *g = NULL, *lp = NULL, *dx = NULL, *dt = NULL,
              *dw = NULL, *dg = NULL, *ld = NULL, *lfull = NULL, *gfull = NULL;
    RANK_OK(s, tp_tensor_zeros(TP_F32, TP_CPU, nd, xs, &x));
    RANK_OK(s, tp_tensor_fill_random(x, TP_RNG_UNIFORM, -4, 4, 61 + (uint64_t)cf->shape, NULL,
                                     NULL));
    RANK_OK(s, tp_tensor_zeros(TP_I64, TP_CPU, tnd, ts, &t));
    RANK_OK(s, tp_tensor_fill_random(t, TP_RNG_RANDINT, 0, (double)cls, 62, NULL, NULL));
    RANK_OK(s, tp_tensor_zeros(TP_F32, TP_CPU, 1, &cls, &w));
    RANK_OK(s, tp_tensor_fill_random(w, TP_RNG_UNIFORM, 0.5, 2, 63, NULL, NULL));
    int64_t ign = cf->ignore == 2 ? 7 : -100, *tv = tp_tensor_data(t);
    for (int64_t k = 0; k < nt; k++) {
        if (tnd == 0) /* one target: ignored only where the mean stays defined */
            tv[k] = cf->ignore == 1 && cf->red != TP_REDUCTION_MEAN ? -100 : 3;
        else if (cf->ignore == 1 && k % 3 == 1)
            tv[k] = -100;
        else if (cf->ignore == 2 && k % 4 == 2)
            tv[k] = 7;
    }
    if (cf->red == TP_REDUCTION_NONE) {
        RANK_OK(s, tp_tensor_zeros(TP_F32, TP_CPU, tnd, ts, &g));
        RANK_OK(s, tp_tensor_fill_random(g, TP_RNG_UNIFORM, -1, 1, 64, NULL, NULL));
    }

    /* single rank, against the definition */
    RANK_OK(s, tp_tensor_set_requires_grad(x, true));
    tp_cross_entropy_options o = {cf->red, cf->weighted ? w : NULL, ign};
    RANK_OK(s, tp_cross_entropy(x, t, &o, &lp));
    RANK_OK(s, tp_backward(lp, g));
    double *lref = calloc((size_t)nt, sizeof *lref), *gref = calloc((size_t)nx, sizeof *gref);
    RANK_EXPECT(s, lref && gref, "%s: out of memory", label);
    if (!lref || !gref) {
        free(lref);
        free(gref);
        return TP_ERR_NO_MEMORY;
    }
    const float one = 1.0f;
    ce_ref(nd, xs, tp_tensor_data(x), tv, cf->weighted ? tp_tensor_data(w) : NULL, ign, cf->red,
           g ? tp_tensor_data(g) : &one, lref, gref);
    double dl = 0, dgx = 0;
    bool okl = arr_close(tp_tensor_data(lp), lref, tp_tensor_numel(lp), CE_RTOL, CE_ATOL, &dl);
    bool okg = tp_tensor_grad(x) &&
               arr_close(tp_tensor_data(tp_tensor_grad(x)), gref, nx, CE_RTOL, CE_ATOL, &dgx);
    free(lref);
    free(gref);
    RANK_EXPECT(s, okl && tp_tensor_numel(lp) == (cf->red == TP_REDUCTION_NONE ? nt : 1),
                "%s: single-rank loss differs from the definition (max |diff| %g)", label, dl);
    RANK_EXPECT(s, okg, "%s: single-rank gradient differs from the definition (max |diff| %g)",
                label, dgx);

    /* distributed */
    for (int d = 0; d < m; d++)
        pl[d] = cf->red == TP_REDUCTION_NONE ? pt[d]
                : cf->red == TP_REDUCTION_SUM && px[d].kind == TP_PLACEMENT_SHARD &&
                        px[d].dim != cd
                    ? P
                    : R;
    RANK_OK(s, tp_dtensor_distribute(mesh, x, m, px, -1, &dx));
    RANK_OK(s, tp_tensor_set_requires_grad(dx, true));
    RANK_OK(s, tp_dtensor_distribute(mesh, t, m, cf->target_rep ? rr : pt, -1, &dt));
    if (cf->weighted)
        RANK_OK(s, tp_dtensor_distribute(mesh, w, m, rr, -1, &dw));
    if (g)
        RANK_OK(s, tp_dtensor_distribute(mesh, g, m, pl, -1, &dg));
    tp_cross_entropy_options od = {cf->red, dw, ign};
    RANK_OK(s, tp_comm_debug_begin(dbg));
    tp_status st = tp_cross_entropy(dx, dt, &od, &ld);
    RANK_OK(s, tp_comm_debug_end(dbg));
    RANK_OK(s, st);
    const int64_t want_ar = cf->layout != ND_REPLICATE && inner_size(lm) > 1 ? 3 : 0;
    const int64_t ar =
        tp_comm_debug_module_count(dbg, "Global", TP_PHASE_FORWARD, TP_COLL_ALL_REDUCE);
    RANK_EXPECT(s, ar == want_ar && tp_comm_debug_total(dbg) == want_ar,
                "%s: forward issued %lld all_reduce, %lld collectives in all; expected %lld "
                "all_reduce only",
                label, (long long)ar, (long long)tp_comm_debug_total(dbg), (long long)want_ar);
    char b1[64], b2[64];
    RANK_EXPECT(s, pls_eq(m, tp_dtensor_placements(ld), pl),
                "%s: loss placements %s, expected %s", label,
                tp_placements_str(m, tp_dtensor_placements(ld), b1, sizeof b1),
                tp_placements_str(m, pl, b2, sizeof b2));
    const int want_nd = cf->red == TP_REDUCTION_NONE ? tnd : 0;
    RANK_EXPECT(s, tp_tensor_ndim(ld) == want_nd &&
                       !memcmp(tp_tensor_shape(ld), ts, sizeof(int64_t) * (size_t)want_nd),
                "%s: loss has %d dims, expected %d", label, tp_tensor_ndim(ld), want_nd);
    RANK_OK(s, tp_dtensor_full_tensor(ld, &lfull));
    bool ok = false;
    RANK_OK(s, tp_tensor_allclose(lfull, lp, CE_RTOL, CE_ATOL, &ok));
    if (!ok) {
        double diff = 0;
        RANK_OK(s, tp_tensor_max_abs_diff(lfull, lp, &diff));
        RANK_EXPECT(s, 0, "%s: loss differs from the single-rank one (max |diff| %g)", label,
                    diff);
    }

    /* backward from the loss itself: no collective at all */
    RANK_OK(s, tp_comm_debug_begin(dbg));
    st = tp_backward(ld, dg);
    RANK_OK(s, tp_comm_debug_end(dbg));
    RANK_OK(s, st);
    RANK_EXPECT(s, tp_comm_debug_total(dbg) == 0, "%s: backward issued %lld collectives", label,
                (long long)tp_comm_debug_total(dbg));
    tp_tensor *gd = tp_tensor_grad(dx);
    RANK_EXPECT(s, gd != NULL, "%s: the logits got no gradient", label);
    if (gd) {
        RANK_EXPECT(s, pls_eq(m, tp_dtensor_placements(gd), px),
                    "%s: logits gradient placements %s, expected the logits' %s", label,
                    tp_placements_str(m, tp_dtensor_placements(gd), b1, sizeof b1),
                    tp_placements_str(m, px, b2, sizeof b2));
        RANK_OK(s, tp_dtensor_full_tensor(gd, &gfull));
        RANK_OK(s, tp_tensor_allclose(gfull, tp_tensor_grad(x), CE_RTOL, CE_ATOL, &ok));
        if (!ok) {
            double diff = 0;
            RANK_OK(s, tp_tensor_max_abs_diff(gfull, tp_tensor_grad(x), &diff));
            RANK_EXPECT(s, 0, "%s: logits gradient differs (max |diff| %g)", label, diff);
        }
    }
    RANK_EXPECT(s, !dw || tp_tensor_grad(dw) == NULL, "%s: class weights got a gradient",
                label);
    tp_tensor *all[] = {x, t, w, g, lp, dx, dt, dw, dg, ld, lfull, gfull};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        tp_tensor_release(all[i]);
    return TP_OK;
}


/* Layouts loss parallel refuses, bad target shapes and dtypes, a bad target
 * in a sharded target (reported by its holders with its global position). */
static tp_status nd_errors(tp_test_slot *s, tp_mesh *mesh, const loss_mesh *lm)
{
    const int m = tp_mesh_ndim(mesh);
    const int64_t xs[4] = {2, 10, 3, 4}, ts[3] = {2, 3, 4}, ts_bad[2] = {2, 3}, x2s[2] = {6, 10};
    const int64_t t2s = 6;
    tp_tensor *x = NULL, *x2 = NULL, *t = NULL, *t2 = NULL, *tb = NULL, *tf = NULL, *dx = NULL,
              *dt = NULL, *loss = NULL;
    RANK_OK(s, randint_f32(4, xs, -4, 5, 71, &x));
    RANK_OK(s, randint_f32(2, x2s, -4, 5, 72, &x2));
    RANK_OK(s, tp_tensor_zeros(TP_I64, TP_CPU, 3, ts, &t));
    RANK_OK(s, tp_tensor_fill_random(t, TP_RNG_RANDINT, 0, 10, 73, NULL, NULL));
    RANK_OK(s, tp_tensor_zeros(TP_I64, TP_CPU, 1, &t2s, &t2));
    RANK_OK(s, tp_tensor_zeros(TP_I64, TP_CPU, 2, ts_bad, &tb));
    RANK_OK(s, tp_tensor_zeros(TP_F32, TP_CPU, 3, ts, &tf));
    tp_placement rr[2] = {R, R}, px[2];
    char want[400], pls[64];
    tp_cross_entropy_options sum = TP_CROSS_ENTROPY_DEFAULTS;
    sum.reduction = TP_REDUCTION_SUM;

    /* sharded on a dim other than the class dim, the class dim not sharded:
     * refused for every reduction, before any communication */
    struct {
        tp_tensor *x, *t;
        tp_placement p;
        int dim;
    } other[] = {{x, t, S2, 2}, {x, t, S0, 0}, {x, t, tp_shard(3), 3}, {x2, t2, S0, 0}};
    for (size_t k = 0; k < sizeof other / sizeof other[0]; k++)
        for (int red = 0; red < 3; red++) {
            place(lm, other[k].p, R, px);
            tp_tensor *dtk = NULL;
            RANK_OK(s, tp_dtensor_distribute(mesh, other[k].x, m, px, -1, &dx));
            RANK_OK(s, tp_dtensor_distribute(mesh, other[k].t, m, rr, -1, &dtk));
            tp_cross_entropy_options o = TP_CROSS_ENTROPY_DEFAULTS;
            o.reduction = (tp_reduction)red;
            snprintf(want, sizeof want,
                     "cross_entropy: logits are sharded on dim %d by mesh dim %d (placements %s) "
                     "but not on the class dim; shard the class dim (dim 1) for loss parallel, "
                     "or replicate the logits",
                     other[k].dim, lm->ndim == 1 ? 0 : lm->sd,
                     tp_placements_str(m, px, pls, sizeof pls));
            tp_clear_error();
            tp_status st = tp_cross_entropy(dx, dtk, &o, &loss);
            RANK_EXPECT(s, st == TP_ERR_NOT_SUPPORTED && loss == NULL &&
                               strcmp(tp_last_error(), want) == 0,
                        "logits %s, %s: %s (%s)", pls, red_name(o.reduction),
                        tp_status_name(st), tp_last_error());
            tp_tensor_release(dtk);
            tp_tensor_release(dx);
            dx = NULL;
        }
    if (lm->ndim == 2) {
        /* the mean with another mesh dim sharding the spatial dims */
        place(lm, S1, S2, px);
        RANK_OK(s, tp_dtensor_distribute(mesh, x, m, px, -1, &dx));
        RANK_OK(s, tp_dtensor_distribute(mesh, t, m, rr, -1, &dt));
        snprintf(want, sizeof want,
                 "cross_entropy: reduction mean with logits sharded on dim 2 by mesh dim %d "
                 "(placements %s): each rank would divide by its own count; use reduction sum "
                 "or none and divide by the global count (as PyTorch's loss_parallel)",
                 1 - lm->sd, tp_placements_str(m, px, pls, sizeof pls));
        tp_status st = tp_cross_entropy(dx, dt, NULL, &loss);
        RANK_EXPECT(s, st == TP_ERR_NOT_SUPPORTED && loss == NULL &&
                           strcmp(tp_last_error(), want) == 0,
                    "logits %s, mean: %s (%s)", pls, tp_status_name(st), tp_last_error());
        tp_tensor_release(dx);
        tp_tensor_release(dt);
        dx = dt = NULL;
    }

    /* bad target shapes and dtypes */
    place(lm, S1, R, px);
    RANK_OK(s, tp_dtensor_distribute(mesh, x, m, px, -1, &dx));
    RANK_OK(s, tp_dtensor_distribute(mesh, tb, m, rr, -1, &dt));
    tp_status st = tp_cross_entropy(dx, dt, &sum, &loss);
    RANK_EXPECT(s, st == TP_ERR_INVALID_ARG && loss == NULL &&
                       strcmp(tp_last_error(),
                              "cross_entropy: target must be [2, 3, 4] (the logits' shape "
                              "[2, 10, 3, 4] without the class dim 1), got shape [2, 3]") == 0,
                "target [2, 3]: %s (%s)", tp_status_name(st), tp_last_error());
    tp_tensor_release(dt);
    RANK_OK(s, tp_dtensor_distribute(mesh, tf, m, rr, -1, &dt));
    st = tp_cross_entropy(dx, dt, &sum, &loss);
    RANK_EXPECT(s, st == TP_ERR_INVALID_ARG && loss == NULL &&
                       strcmp(tp_last_error(), "cross_entropy: target must be i64 or i32, got "
                                               "f32") == 0,
                "f32 target: %s (%s)", tp_status_name(st), tp_last_error());
    tp_tensor_release(dt);
    dt = NULL;
    tp_tensor_release(dx);
    dx = NULL;

    /* a target out of range at [1, 2, 3]: with the batch dim sharded on the
     * other mesh dim only its holders see it (and fail together: they are
     * the ranks that would all_reduce with each other); the rest go on */
    RANK_OK(s, tp_tensor_set(t, (int64_t[]){1, 2, 3}, 10));
    tp_placement pt[2];
    place(lm, S1, S0, px);
    place(lm, R, S0, pt);
    RANK_OK(s, tp_dtensor_distribute(mesh, x, m, px, -1, &dx));
    RANK_OK(s, tp_dtensor_distribute(mesh, t, m, pt, -1, &dt));
    int64_t lshape[3], off[3];
    RANK_OK(s, tp_dtensor_shard_extent(mesh, 3, ts, m, pt, NULL, lshape, off));
    const bool holder = off[0] <= 1 && 1 < off[0] + lshape[0];
    tp_clear_error();
    st = tp_cross_entropy(dx, dt, &sum, &loss);
    if (holder)
        RANK_EXPECT(s, st == TP_ERR_INVALID_ARG && loss == NULL &&
                           strcmp(tp_last_error(), "cross_entropy: target 10 at position "
                                                   "[1, 2, 3] is outside [0, 10) and is not "
                                                   "ignore_index (-100)") == 0,
                    "target 10 at [1, 2, 3]: %s (%s)", tp_status_name(st), tp_last_error());
    else
        RANK_EXPECT(s, st == TP_OK, "target 10 at [1, 2, 3] on a rank without it: %s (%s)",
                    tp_status_name(st), tp_last_error());
    tp_tensor *all[] = {x, x2, t, t2, tb, tf, dx, dt, loss};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        tp_tensor_release(all[i]);
    return TP_OK;
}

static tp_status nd_body(tp_comm *world, void *arg)
{
    loss_ctx *c = arg;
    tp_test_slot *s = &c->slot[tp_comm_rank(world)];
    tp_mesh *mesh = NULL;
    tp_comm_debug *dbg = NULL;
    RANK_OK(s, tp_mesh_create(world, c->lm.ndim, c->lm.shape, NULL, &mesh));
    RANK_OK(s, tp_comm_debug_create(&dbg));
    const tp_reduction reds[3] = {TP_REDUCTION_MEAN, TP_REDUCTION_SUM, TP_REDUCTION_NONE};
    for (int sh = 0; sh < ND_SHAPES; sh++)
        for (int lay = 0; lay < ND_LAYOUTS; lay++) {
            const int nd = ND_NDIM[sh];
            if ((lay == ND_BATCH || lay == ND_SPATIAL) && c->lm.ndim == 1)
                continue; /* no other mesh dim */
            if ((lay == ND_BATCH && nd < 2) || (lay == ND_SPATIAL && nd < 3))
                continue; /* no such dim */
            for (int r = 0; r < 3; r++) {
                if (reds[r] == TP_REDUCTION_MEAN && (lay == ND_BATCH || lay == ND_SPATIAL))
                    continue; /* refused: nd_errors */
                for (int wtd = 0; wtd < 2; wtd++)
                    for (int ig = 0; ig < 3; ig++) {
                        nd_cfg cf = {sh, lay, reds[r], wtd != 0, ig, false};
                        TP_TEST_TRY(nd_check(s, mesh, &c->lm, &cf, dbg));
                    }
            }
        }
    /* a Replicate target split locally to the loss's layout: still no more
     * than the 3 all_reduces */
    const nd_cfg rep[] = {
        {3, ND_VOCAB, TP_REDUCTION_MEAN, true, 1, true},
        {3, ND_SPATIAL, TP_REDUCTION_NONE, true, 2, true},
        {2, ND_BATCH, TP_REDUCTION_SUM, false, 1, true},
    };
    for (size_t k = 0; k < sizeof rep / sizeof rep[0]; k++)
        if (c->lm.ndim == 2 || rep[k].layout == ND_VOCAB)
            TP_TEST_TRY(nd_check(s, mesh, &c->lm, &rep[k], dbg));
    TP_TEST_TRY(nd_errors(s, mesh, &c->lm));
    tp_comm_debug_free(dbg);
    tp_mesh_free(mesh);
    return TP_OK;
}

ParameterizedTestParameters(ops_loss, cross_entropy_nd)
{
    static loss_mesh meshes[] = {{1, {1, 1}, 0}, {1, {2, 1}, 0}, {1, {3, 1}, 0},
                                 {1, {4, 1}, 0}, {1, {8, 1}, 0}, {2, {2, 2}, 1},
                                 {2, {2, 2}, 0}, {2, {4, 2}, 0}, {2, {2, 4}, 1},
                                 {2, {2, 3}, 1}, {2, {3, 2}, 0}};
    return cr_make_param_array(loss_mesh, meshes, sizeof meshes / sizeof meshes[0]);
}

/* Logits (C), (N, C), (N, C, d1), (N, C, d1, d2): every reduction, class
 * weights, ignored targets; class-sharded (C = 10 over 1-4 and 8 ranks),
 * with a batch or spatial dim sharded on the other mesh dim, or replicated.
 * Values and gradients equal the single-rank op (itself checked against the
 * definition in double); exactly 3 all_reduces forward and none backward. */
ParameterizedTest(loss_mesh *lm, ops_loss, cross_entropy_nd, .timeout = 240)
{
    loss_ctx c = {.lm = *lm};
    tp_test_run((int)(lm->shape[0] * (lm->ndim > 1 ? lm->shape[1] : 1)), nd_body, &c, c.slot);
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
    cr_assert_str_eq(tp_last_error(), "cross_entropy: target must be [3, 1] (the logits' shape "
                                      "[3, 4, 1] without the class dim 1), got shape [3]");
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

/* torch.nn.functional.cross_entropy on logits (2, 4, 2, 3) (float64, from
 * tests/gen_ce_nd_fixture.py): x[i] = ((7 i) % 19 - 9) / 4 over the flat
 * index, targets (2, 2, 3) with one -100, weights [0.5, 1, 2, 1.5]; and an
 * unbatched (4,) case, target 2. */
static const double PT_LOSS_NONE_W[12] = {
    1.7200948492805976, 6.2596947169832102, 0.37522927652142152, 2.8803793971223906, 0,
    2.9731187251283391, 3.9820791500855592, 2.4401896985611953, 0.68761463826071079,
    2.9731187251283391, 2.8803793971223906, 0.68761463826071079,
};
static const double PT_LOSS_SUM[1] = {
    24.005813885387862,
};
static const double PT_LOSS_MEAN_W[1] = {
    2.1430394778811435,
};
static const double PT_GRAD_MEAN_W[48] = {
    -0.037228515258458272, 0.010228124382213251, 0.019444740943602757, 0.0049320928123207678, 0,
    0.091486542004259278, 0.0033517045670012529, 0.027802924647389177, -0.024066790956987966,
    0.013406818268005011, 0, 0.0021515572441012719, 0.0091108776188426992, 0.075576184847014102,
    0.0012430607002430209, -0.11740264337078306, 0, 0.005848538959529909, 0.024765933072614321,
    -0.11360723387661655, 0.0033789893131421812, 0.099063732290457285, 0, -0.099486638207890471,
    0.060991028002839523, 0.0024660464061603839, -0.028739167989737087, 0.091486542004259278,
    0.0049320928123207678, -0.028739167989737087, -0.075488705427009417, -0.070219667789074416,
    0.026428142983044481, 0.0021515572441012719, 0.013406818268005011, 0.026428142983044481,
    0.0038990259730199393, 0.018221755237685398, 0.00062153035012151047, 0.005848538959529909,
    -0.11740264337078306, 0.00062153035012151047, 0.010598651451149948, 0.049531866145228642,
    0.0016894946565710906, -0.099486638207890471, 0.099063732290457285, 0.0016894946565710906,
};
static const double PT_GRAD_SUM[48] = {
    -0.96794139671991497, 0.088643744645848163, 0.25278163226683581, 0.032058603280084988, 0,
    0.79288336403691373, 0.087144318742032573, 0.24095868027737286, -0.31286828244084353,
    0.087144318742032573, 0, 0.018646829448877689, 0.23688281808991016, 0.65499360200745549,
    0.01615978910315927, -0.76311718191008981, 0, 0.050687337649259208, 0.64391425988797235,
    -0.98459602693067672, 0.043926861070848353, 0.64391425988797235, 0, -0.86221753113505062,
    0.79288336403691373, 0.032058603280084988, -0.74721836773316419, 0.79288336403691373,
    0.032058603280084988, -0.74721836773316419, -0.98135317055112226, -0.91285568125796746,
    0.68713171755915647, 0.018646829448877689, 0.087144318742032573, 0.68713171755915647,
    0.050687337649259208, 0.23688281808991016, 0.01615978910315927, 0.050687337649259208,
    -0.76311718191008981, 0.01615978910315927, 0.13778246886494933, 0.64391425988797235,
    0.043926861070848353, -0.86221753113505062, 0.64391425988797235, 0.043926861070848353,
};
static const double PT_LOSS_UNBATCHED_W[1] = {
    0.22614575637577886,
};
static const double PT_GRAD_UNBATCHED_W[4] = {
    0.024085488509548822, 0.1386024166299549, -0.20239816236040031, 0.039710257220896668,
};

static void expect_near(const char *what, tp_tensor *got, const double *want, int64_t n)
{
    cr_assert(tp_tensor_numel(got) == n, "%s: %lld values, expected %lld", what,
              (long long)tp_tensor_numel(got), (long long)n);
    double maxd = 0;
    bool ok = arr_close(tp_tensor_data(got), want, n, 1e-6, 1e-6, &maxd);
    cr_assert(ok, "%s: differs from PyTorch by up to %g", what, maxd);
}

Test(ops_loss, cross_entropy_nd_matches_pytorch, .timeout = 30)
{
    const int64_t xs[4] = {2, 4, 2, 3}, ts[3] = {2, 2, 3}, cs = 4;
    float xv[48];
    for (int i = 0; i < 48; i++)
        xv[i] = (float)((7 * i) % 19 - 9) / 4.0f;
    const int64_t tv[12] = {0, 3, 1, 2, -100, 3, 1, 1, 0, 3, 2, 0};
    const float wv[4] = {0.5f, 1.0f, 2.0f, 1.5f};
    tp_tensor *t = NULL, *w = NULL, *t0 = NULL;
    CHECK_OK(tp_tensor_from_data(TP_I64, 3, ts, tv, &t));
    CHECK_OK(tp_tensor_from_data(TP_F32, 1, &cs, wv, &w));
    struct {
        const char *name;
        tp_reduction red;
        bool weighted;
        const double *loss, *grad;
        int64_t nloss;
    } cases[] = {
        {"none, weighted", TP_REDUCTION_NONE, true, PT_LOSS_NONE_W, NULL, 12},
        {"sum", TP_REDUCTION_SUM, false, PT_LOSS_SUM, PT_GRAD_SUM, 1},
        {"mean, weighted", TP_REDUCTION_MEAN, true, PT_LOSS_MEAN_W, PT_GRAD_MEAN_W, 1},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        tp_tensor *x = NULL, *loss = NULL;
        CHECK_OK(tp_tensor_from_data(TP_F32, 4, xs, xv, &x));
        CHECK_OK(tp_tensor_set_requires_grad(x, true));
        tp_cross_entropy_options o = {cases[k].red, cases[k].weighted ? w : NULL, -100};
        CHECK_OK(tp_cross_entropy(x, t, &o, &loss));
        char what[80];
        snprintf(what, sizeof what, "logits (2, 4, 2, 3), %s: loss", cases[k].name);
        expect_near(what, loss, cases[k].loss, cases[k].nloss);
        if (cases[k].grad) {
            CHECK_OK(tp_backward(loss, NULL));
            snprintf(what, sizeof what, "logits (2, 4, 2, 3), %s: gradient", cases[k].name);
            expect_near(what, tp_tensor_grad(x), cases[k].grad, 48);
        }
        tp_tensor_release(loss);
        tp_tensor_release(x);
    }
    /* unbatched: logits (4,), a 0-d target */
    tp_tensor *xu = NULL, *lu = NULL;
    CHECK_OK(tp_tensor_from_data(TP_F32, 1, &cs, xv, &xu));
    CHECK_OK(tp_tensor_from_data(TP_I64, 0, NULL, (int64_t[]){2}, &t0));
    CHECK_OK(tp_tensor_set_requires_grad(xu, true));
    tp_cross_entropy_options o = {TP_REDUCTION_MEAN, w, -100};
    CHECK_OK(tp_cross_entropy(xu, t0, &o, &lu));
    cr_assert(tp_tensor_ndim(lu) == 0, "unbatched loss has %d dims", tp_tensor_ndim(lu));
    expect_near("unbatched, weighted mean: loss", lu, PT_LOSS_UNBATCHED_W, 1);
    CHECK_OK(tp_backward(lu, NULL));
    expect_near("unbatched, weighted mean: gradient", tp_tensor_grad(xu), PT_GRAD_UNBATCHED_W, 4);
    tp_tensor_release(lu);
    tp_tensor_release(xu);
    tp_tensor_release(t0);
    tp_tensor_release(w);
    tp_tensor_release(t);
}

/* Unbatched logits whose one target is ignored: mean NaN (0 / 0, as
 * PyTorch), sum and none 0 (none: a 0-d loss), gradient 0. */
Test(ops_loss, cross_entropy_unbatched_ignored, .timeout = 30)
{
    const int64_t c = 5;
    tp_tensor *t = NULL;
    CHECK_OK(tp_tensor_from_data(TP_I32, 0, NULL, (int32_t[]){-100}, &t));
    for (int red = 0; red < 3; red++) {
        tp_tensor *x = NULL, *loss = NULL;
        CHECK_OK(tp_tensor_from_data(TP_F32, 1, &c, (float[]){1, 2, 3, 4, 5}, &x));
        CHECK_OK(tp_tensor_set_requires_grad(x, true));
        tp_cross_entropy_options o = TP_CROSS_ENTROPY_DEFAULTS;
        o.reduction = (tp_reduction)red;
        CHECK_OK(tp_cross_entropy(x, t, &o, &loss));
        cr_assert(tp_tensor_ndim(loss) == 0, "%s: loss has %d dims", red_name(o.reduction),
                  tp_tensor_ndim(loss));
        double v = 0;
        CHECK_OK(tp_tensor_get(loss, NULL, &v));
        cr_assert(red == TP_REDUCTION_MEAN ? isnan(v) : v == 0, "%s: loss %g",
                  red_name(o.reduction), v);
        if (red != TP_REDUCTION_MEAN) {
            CHECK_OK(tp_backward(loss, NULL));
            for (int64_t i = 0; i < c; i++) {
                CHECK_OK(tp_tensor_get(tp_tensor_grad(x), &i, &v));
                cr_assert(v == 0, "%s: gradient[%lld] = %g", red_name(o.reduction),
                          (long long)i, v);
            }
        }
        tp_tensor_release(loss);
        tp_tensor_release(x);
    }
    tp_tensor_release(t);
}

/* Bad N-D shapes and targets on plain tensors: the message names the
 * expected shape or the target's position. */
Test(ops_loss, cross_entropy_nd_plain_errors, .timeout = 30)
{
    tp_tensor *x0 = NULL, *x1 = NULL, *x4 = NULL, *t0 = NULL, *t1 = NULL, *t3 = NULL, *tt = NULL,
              *ti = NULL, *loss = NULL;
    CHECK_OK(tp_tensor_zeros(TP_F32, TP_CPU, 0, NULL, &x0));
    CHECK_OK(tp_tensor_zeros(TP_F32, TP_CPU, 1, (int64_t[]){5}, &x1));
    CHECK_OK(tp_tensor_zeros(TP_F32, TP_CPU, 4, (int64_t[]){2, 5, 3, 4}, &x4));
    CHECK_OK(tp_tensor_zeros(TP_I64, TP_CPU, 0, NULL, &t0));
    CHECK_OK(tp_tensor_zeros(TP_I64, TP_CPU, 1, (int64_t[]){1}, &t1));
    CHECK_OK(tp_tensor_zeros(TP_I64, TP_CPU, 3, (int64_t[]){2, 3, 4}, &t3));
    CHECK_OK(tp_tensor_zeros(TP_I64, TP_CPU, 3, (int64_t[]){2, 4, 3}, &tt));

    CHECK_ERR(tp_cross_entropy(x0, t0, NULL, &loss), TP_ERR_INVALID_ARG);
    cr_assert_str_eq(tp_last_error(), "cross_entropy: logits must be [C], [N, C] or "
                                      "[N, C, d1, ..., dk], got a 0-d tensor");
    CHECK_ERR(tp_cross_entropy(x1, t1, NULL, &loss), TP_ERR_INVALID_ARG);
    cr_assert_str_eq(tp_last_error(), "cross_entropy: target must be [] (the logits' shape [5] "
                                      "without the class dim 0), got shape [1]");
    CHECK_ERR(tp_cross_entropy(x4, tt, NULL, &loss), TP_ERR_INVALID_ARG);
    cr_assert_str_eq(tp_last_error(), "cross_entropy: target must be [2, 3, 4] (the logits' "
                                      "shape [2, 5, 3, 4] without the class dim 1), got shape "
                                      "[2, 4, 3]");
    CHECK_ERR(tp_cross_entropy(x4, t0, NULL, &loss), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "target must be [2, 3, 4]") &&
                  strstr(tp_last_error(), "got shape []"),
              "%s", tp_last_error());
    CHECK_ERR(tp_cross_entropy(x4, x4, NULL, &loss), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "target must be i64 or i32, got f32"), "%s",
              tp_last_error());
    /* out of range, found with its position; negative too */
    CHECK_OK(tp_tensor_set(t3, (int64_t[]){1, 0, 2}, 5));
    CHECK_ERR(tp_cross_entropy(x4, t3, NULL, &loss), TP_ERR_INVALID_ARG);
    cr_assert_str_eq(tp_last_error(), "cross_entropy: target 5 at position [1, 0, 2] is outside "
                                      "[0, 5) and is not ignore_index (-100)");
    CHECK_OK(tp_tensor_set(t3, (int64_t[]){1, 0, 2}, -1));
    CHECK_ERR(tp_cross_entropy(x4, t3, NULL, &loss), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "target -1 at position [1, 0, 2]"), "%s", tp_last_error());
    CHECK_OK(tp_tensor_set(t0, NULL, 5));
    CHECK_ERR(tp_cross_entropy(x1, t0, NULL, &loss), TP_ERR_INVALID_ARG);
    cr_assert_str_eq(tp_last_error(), "cross_entropy: target 5 is outside [0, 5) and is not "
                                      "ignore_index (-100)");
    cr_assert(loss == NULL);
    /* i32 targets of N-D logits */
    CHECK_OK(tp_tensor_set(t3, (int64_t[]){1, 0, 2}, 4));
    CHECK_OK(tp_tensor_to(t3, TP_I32, TP_CPU, &ti));
    CHECK_OK(tp_cross_entropy(x4, ti, NULL, &loss));
    double v = 0;
    CHECK_OK(tp_tensor_get(loss, NULL, &v));
    cr_assert(fabs(v - log(5.0)) < 1e-6, "uniform logits: mean %g, expected log 5", v);
    tp_tensor *all[] = {x0, x1, x4, t0, t1, t3, tt, ti, loss};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        tp_tensor_release(all[i]);
}
