/* View ops: reshape, flatten, unflatten, transpose, permute.
 *
 * On DTensors every op equals the single-rank computation on plain tensors,
 * forward (full_tensor) and gradient, on 1-D meshes of 1, 2, 3, 4 and 8 ranks
 * and on 2x2, 2x3 and 4x2 meshes. Views only move values and the inputs are
 * small integers, so the comparisons are exact. Each case also checks the
 * output placements and the exact collectives: none when the shards survive,
 * one all_gather per mesh dim whose shard must be replicated first, and none
 * in the backward. The plain ops are checked against index loops.
 *
 * The expected layouts come from the rule of PyTorch 2.15's view ops in their
 * reshape form (torch/distributed/tensor/_ops/_view_ops.py, non-strict), as
 * each case's `div` states it. Cases marked "PyTorch:" were run there on
 * DTensors (aten.view_copy, which takes the non-strict rule, under
 * CommDebugMode, on the same mesh), with the counts noted; where PyTorch's
 * own local reshape fails on nested or split-and-merged uneven layouts, the
 * note says so and the expectation is the correct layout.
 *
 * Then the headline: a DTensor attention block whose q, k, v stay DTensors
 * sharded on the heads from the colwise projections to the rowwise one costs
 * what PyTorch's does (forward 1 all_reduce, backward 1 all_reduce) and
 * equals the single-rank run. */
#include <math.h>

#include "tp_test_dtensor.h"

#define NCASES(a) (sizeof(a) / sizeof((a)[0]))

/* ---- one case ----------------------------------------------------------------------- */

typedef enum { V_RESHAPE, V_FLATTEN, V_UNFLATTEN, V_TRANSPOSE, V_PERMUTE } view_kind;

static const char *const kind_name[] = {"reshape", "flatten", "unflatten", "transpose",
                                        "permute"};

typedef struct view_case {
    const char *label;
    view_kind kind;
    int nd;
    int64_t shape[6];
    /* [mesh dim]: 2-D meshes use both, 1-D meshes the second */
    tp_placement pl[2];
    tp_placement out[2]; /* where a surviving shard lands (Replicate/Partial: as pl) */
    /* whether a Shard survives, per mesh dim: 0 always (a dim that keeps its
     * size); N > 0 when the mesh dim's size times the sizes of the earlier
     * mesh dims kept sharding the same dim divides N (the gcd of the split or
     * merged outermost sizes); -1 never (replicated first) */
    int64_t div[2];
    /* op parameters */
    int rnd;           /* reshape ndim; unflatten n */
    int64_t rsizes[6]; /* reshape shape; unflatten sizes */
    int a, b;          /* flatten start/end; unflatten dim (a); transpose dims */
    int perm[6];       /* permute */
} view_case;

static tp_status apply(const view_case *c, tp_tensor *x, tp_tensor **y)
{
    switch (c->kind) {
    case V_RESHAPE: return tp_reshape(x, c->rnd, c->rsizes, y);
    case V_FLATTEN: return tp_flatten(x, c->a, c->b, y);
    case V_UNFLATTEN: return tp_unflatten(x, c->a, c->rnd, c->rsizes, y);
    case V_TRANSPOSE: return tp_transpose(x, c->a, c->b, y);
    case V_PERMUTE: return tp_permute(x, c->nd, c->perm, y);
    }
    return TP_ERR_INVALID_ARG;
}

/* The output placements the rule gives on this mesh, and the all_gathers the
 * forward then issues: one per mesh dim (of size > 1) whose shard is
 * replicated, plus one per later mesh dim that keeps sharding a dim an earlier
 * mesh dim had to replicate (the nested shard is undone and re-chunked
 * locally, as in PyTorch). *bwd: the collectives of the backward, one per such
 * re-chunk: the gradient goes back to the input's layout, and that means
 * undoing the later mesh dim's shard again (PyTorch 2.15 instead leaves the
 * input's gradient in the redistributed layout: 2x3 [24] [S(0), S(0)] ->
 * [3, 8] gives x.grad [R, S(0)] and no backward collective). */
static int64_t expected_layout(const tp_mesh *mesh, const view_case *c, tp_placement *want,
                               int64_t *bwd)
{
    int m = tp_mesh_ndim(mesh), first = m == 1 ? 1 : 0;
    int64_t prod[TP_MAX_DIMS], ag = 0;
    bool dropped[TP_MAX_DIMS] = {false};
    for (int d = 0; d < TP_MAX_DIMS; d++)
        prod[d] = 1;
    for (int md = 0; md < m; md++) {
        tp_placement p = c->pl[first + md];
        int64_t w = tp_mesh_size(mesh, md), n = c->div[first + md];
        want[md] = p;
        if (p.kind != TP_PLACEMENT_SHARD)
            continue;
        if (n == 0 || (n > 0 && n % (prod[p.dim] * w) == 0)) {
            want[md] = c->out[first + md];
            prod[p.dim] *= w;
            ag += dropped[p.dim] && w > 1;
            *bwd += dropped[p.dim] && w > 1;
        } else {
            want[md] = tp_replicate();
            ag += w > 1;
            dropped[p.dim] = dropped[p.dim] || w > 1;
        }
    }
    return ag;
}

/* Runs the case on plain tensors and on DTensors; compares y and the grads. */
static tp_status check_case(tp_test_slot *s, tp_mesh *mesh, const view_case *c)
{
    int m = tp_mesh_ndim(mesh), first = m == 1 ? 1 : 0;
    char label[200];
    if (m == 1)
        snprintf(label, sizeof label, "%s %s (mesh %lld)", kind_name[c->kind], c->label,
                 (long long)tp_mesh_size(mesh, 0));
    else
        snprintf(label, sizeof label, "%s %s (mesh %lldx%lld)", kind_name[c->kind], c->label,
                 (long long)tp_mesh_size(mesh, 0), (long long)tp_mesh_size(mesh, 1));
    tp_tensor *full = NULL, *dt = NULL, *yp = NULL, *yd = NULL, *yfull = NULL, *g = NULL,
              *gd = NULL, *gf = NULL;
    RANK_OK(s, tp_test_global_tensor(c->nd, c->shape, 100, &full));
    RANK_OK(s, tp_test_make_dtensor(mesh, full, &c->pl[first], 200, &dt));
    RANK_OK(s, tp_tensor_set_requires_grad(full, true));
    RANK_OK(s, tp_tensor_set_requires_grad(dt, true));
    /* reference */
    RANK_OK(s, apply(c, full, &yp));
    RANK_OK(s, tp_test_global_tensor(tp_tensor_ndim(yp), tp_tensor_shape(yp), 7, &g));
    RANK_OK(s, tp_backward(yp, g));
    /* distributed forward */
    tp_placement want[2];
    int64_t bwd = 0, ag = expected_layout(mesh, c, want, &bwd);
    tp_comm_debug *dbg = NULL;
    RANK_OK(s, tp_comm_debug_create(&dbg));
    RANK_OK(s, tp_comm_debug_begin(dbg));
    tp_status st = apply(c, dt, &yd);
    RANK_OK(s, tp_comm_debug_end(dbg));
    RANK_OK(s, st);
    int64_t got_ag = tp_comm_debug_count(dbg, TP_COLL_ALL_GATHER),
            total = tp_comm_debug_count(dbg, TP_COLL_ANY);
    RANK_EXPECT(s, got_ag == ag && total == ag,
                "%s: the forward issued %lld collectives (%lld all_gathers), expected %lld "
                "all_gathers",
                label, (long long)total, (long long)got_ag, (long long)ag);
    const tp_placement *got = tp_dtensor_placements(yd);
    for (int d = 0; d < m; d++) {
        char b1[32], b2[32];
        RANK_EXPECT(s, tp_test_placement_eq(got[d], want[d]),
                    "%s: output placement on mesh dim %d is %s, expected %s", label, d,
                    tp_placement_str(got[d], b1, sizeof b1),
                    tp_placement_str(want[d], b2, sizeof b2));
    }
    /* reshapes are views of the local shard when nothing moved */
    tp_tensor *lx = tp_dtensor_local(dt), *ly = tp_dtensor_local(yd);
    if (c->kind <= V_UNFLATTEN && total == 0 && tp_tensor_numel(lx) > 0)
        RANK_EXPECT(s, tp_tensor_data(ly) == tp_tensor_data(lx),
                    "%s: the local result is a copy, not a view", label);
    /* backward: the gradient with the output's placements (Partial read as
     * Replicate) needs no communication, but for bringing a re-chunked nested
     * shard back (see expected_layout) */
    tp_placement gpl[2];
    for (int d = 0; d < m; d++)
        gpl[d] = got[d].kind == TP_PLACEMENT_PARTIAL ? tp_replicate() : got[d];
    RANK_OK(s, tp_dtensor_distribute(mesh, g, m, gpl, -1, &gd));
    tp_no_grad_begin();
    st = tp_dtensor_full_tensor(yd, &yfull);
    tp_no_grad_end();
    RANK_OK(s, st);
    tp_comm_debug_free(dbg);
    dbg = NULL;
    RANK_OK(s, tp_comm_debug_create(&dbg));
    RANK_OK(s, tp_comm_debug_begin(dbg));
    st = tp_backward(yd, gd);
    RANK_OK(s, tp_comm_debug_end(dbg));
    RANK_OK(s, st);
    total = tp_comm_debug_count(dbg, TP_COLL_ANY);
    tp_comm_debug_free(dbg);
    RANK_EXPECT(s, total == bwd, "%s: the backward issued %lld collectives, expected %lld",
                label, (long long)total, (long long)bwd);
    bool ok = false;
    RANK_OK(s, tp_tensor_equal(yfull, yp, &ok));
    RANK_EXPECT(s, ok, "%s: output differs from the single-rank result", label);
    tp_tensor *gx = tp_tensor_grad(dt);
    RANK_EXPECT(s, gx != NULL, "%s: the input got no gradient", label);
    if (gx) {
        const tp_placement *gp = tp_dtensor_placements(gx), *xp = tp_dtensor_placements(dt);
        for (int d = 0; d < m; d++) {
            tp_placement w = xp[d].kind == TP_PLACEMENT_PARTIAL ? tp_replicate() : xp[d];
            char b1[32], b2[32];
            RANK_EXPECT(s, tp_test_placement_eq(gp[d], w),
                        "%s: gradient placement on mesh dim %d is %s, expected %s", label, d,
                        tp_placement_str(gp[d], b1, sizeof b1), tp_placement_str(w, b2, sizeof b2));
        }
        RANK_OK(s, tp_dtensor_full_tensor(gx, &gf));
        RANK_OK(s, tp_tensor_equal(gf, tp_tensor_grad(full), &ok));
        RANK_EXPECT(s, ok, "%s: gradient differs from the single-rank result", label);
    }
    tp_tensor_release(gf);
    tp_tensor_release(gd);
    tp_tensor_release(full);
    tp_tensor_release(dt);
    tp_tensor_release(yp);
    tp_tensor_release(yd);
    tp_tensor_release(yfull);
    tp_tensor_release(g);
    return TP_OK;
}

/* ---- the mesh runner ------------------------------------------------------------------ */

typedef struct view_ctx view_ctx;
typedef tp_status (*view_body_fn)(tp_test_slot *s, tp_mesh *mesh);

struct view_ctx {
    int mesh_ndim;
    int64_t mesh_shape[2];
    view_body_fn body;
    tp_test_slot slot[TP_TEST_MAX_RANKS];
};

static tp_status view_rank(tp_comm *w, void *arg)
{
    view_ctx *c = arg;
    tp_test_slot *s = &c->slot[tp_comm_rank(w)];
    tp_mesh *mesh = NULL;
    RANK_OK(s, tp_mesh_create(w, c->mesh_ndim, c->mesh_shape, NULL, &mesh));
    tp_status st = c->body(s, mesh);
    tp_mesh_free(mesh);
    return st;
}

typedef struct {
    int ndim;
    int64_t shape[2];
} view_mesh;

static void run_on_mesh(const view_mesh *vm, view_body_fn body)
{
    view_ctx c = {.mesh_ndim = vm->ndim, .mesh_shape = {vm->shape[0], vm->shape[1]}, .body = body};
    memset(c.slot, 0, sizeof c.slot);
    tp_test_run((int)(vm->shape[0] * (vm->ndim > 1 ? vm->shape[1] : 1)), view_rank, &c, c.slot);
}

static tp_status run_cases(tp_test_slot *s, tp_mesh *mesh, const view_case *cases, size_t n)
{
    for (size_t k = 0; k < n; k++)
        TP_TEST_TRY(check_case(s, mesh, &cases[k]));
    return TP_OK;
}

#define R_ tp_replicate()
#define P_ tp_partial(TP_SUM)
#define PMAX_ tp_partial(TP_MAX)
#define S_(d) tp_shard(d)

/* ---- reshape ---------------------------------------------------------------------------- */

static tp_status reshape_body(tp_test_slot *s, tp_mesh *mesh)
{
    const view_case cases[] = {
        /* [B, S, H*Dh] -> [B, S, H, Dh]: the shard stays on the heads when the
         * mesh divides H. PyTorch: mesh 2, 4: no collective; mesh 3 and H = 4:
         * all_gather 1. */
        {"heads split [2,3,24]->[2,3,4,6]", V_RESHAPE, 3, {2, 3, 24}, {S_(0), S_(2)},
         {S_(0), S_(2)}, {0, 4}, .rnd = 4, .rsizes = {2, 3, 4, 6}},
        {"heads split (H=6) [2,3,24]->[2,3,6,4]", V_RESHAPE, 3, {2, 3, 24}, {R_, S_(2)},
         {R_, S_(2)}, {0, 6}, .rnd = 4, .rsizes = {2, 3, 6, 4}},
        {"heads split, -1 [2,3,24]->[2,3,-1,6]", V_RESHAPE, 3, {2, 3, 24}, {S_(1), S_(2)},
         {S_(1), S_(2)}, {0, 4}, .rnd = 4, .rsizes = {2, 3, -1, 6}},
        /* both mesh dims on the same dim: the product must divide H. PyTorch
         * 2x3: [S(2), R], all_gather 1 (as here); 2x2 and 4x2: none. */
        {"nested heads split [2,3,24]->[2,3,4,6]", V_RESHAPE, 3, {2, 3, 24}, {S_(2), S_(2)},
         {S_(2), S_(2)}, {4, 4}, .rnd = 4, .rsizes = {2, 3, 4, 6}},
        /* the merge back: the shard of the outer merged dim stays. PyTorch
         * mesh 3 and H = 4: all_gather 1; H = 6 on mesh 4: all_gather 1. */
        {"heads merge [2,3,4,6]->[2,3,24]", V_RESHAPE, 4, {2, 3, 4, 6}, {S_(0), S_(2)},
         {S_(0), S_(2)}, {0, 4}, .rnd = 3, .rsizes = {2, 3, 24}},
        {"heads merge (H=6) [2,3,6,4]->[2,3,24]", V_RESHAPE, 4, {2, 3, 6, 4}, {R_, S_(2)},
         {R_, S_(2)}, {0, 6}, .rnd = 3, .rsizes = {2, 3, 24}},
        /* a shard of an inner merged dim is replicated (PyTorch's view keeps a
         * strided shard there; its reshape form all_gathers, 1 on mesh 2) */
        {"inner merged dim [2,3,4,6]->[2,3,24]", V_RESHAPE, 4, {2, 3, 4, 6}, {S_(3), S_(3)},
         {R_, R_}, {-1, -1}, .rnd = 3, .rsizes = {2, 3, 24}},
        /* PyTorch 4x2: [R, S(2)], all_gather 1; 2x3: [R, R], all_gather 2 */
        {"inner merged on mesh dim 0 [2,3,4,6]->[2,3,24]", V_RESHAPE, 4, {2, 3, 4, 6},
         {S_(3), S_(2)}, {R_, S_(2)}, {-1, 4}, .rnd = 3, .rsizes = {2, 3, 24}},
        /* dims before the shard merge, the shard's dim keeps its size (uneven
         * everywhere: 7 rows). PyTorch mesh 2, 3, 4: no collective. */
        {"[5,3,7]->[15,7] S(2)", V_RESHAPE, 3, {5, 3, 7}, {S_(2), S_(2)}, {S_(1), S_(1)},
         {0, 0}, .rnd = 2, .rsizes = {15, 7}},
        {"uneven kept dim [5,3,7]->[5,21]", V_RESHAPE, 3, {5, 3, 7}, {S_(0), S_(0)},
         {S_(0), S_(0)}, {0, 0}, .rnd = 2, .rsizes = {5, 21}},
        /* an uneven outer merged dim. PyTorch mesh 2, 3, 4: all_gather 1;
         * 2x2, 2x3: all_gather 2 */
        {"uneven merge [5,3,7]->[15,7] S(0)", V_RESHAPE, 3, {5, 3, 7}, {S_(0), S_(0)},
         {S_(0), S_(0)}, {5, 5}, .rnd = 2, .rsizes = {15, 7}},
        /* split and merge in one group: both outer sizes must divide. PyTorch
         * [4,6]->[6,4] mesh 2: no collective; [6,4]->[4,6] and [4,3]->[2,6]
         * with sizes that do not divide both fail in PyTorch's local reshape;
         * here they replicate first. */
        {"split+merge [4,6]->[6,4]", V_RESHAPE, 2, {4, 6}, {S_(1), S_(0)}, {R_, S_(0)},
         {-1, 2}, .rnd = 2, .rsizes = {6, 4}},
        {"split+merge [12,2]->[4,6]", V_RESHAPE, 2, {12, 2}, {S_(0), S_(0)}, {S_(0), S_(0)},
         {4, 4}, .rnd = 2, .rsizes = {4, 6}},
        {"split+merge [2,3]->[3,2]", V_RESHAPE, 2, {2, 3}, {R_, S_(0)}, {R_, S_(0)}, {0, 1},
         .rnd = 2, .rsizes = {3, 2}},
        /* nested split of one dim. PyTorch 2x3 [48]->[8,6]: [S(0), R], all_gather
         * 1; [24]->[3,8]: [R, S(0)], all_gather 2; 2x2 [48]->[12,4]: none;
         * 4x2 [48]->[12,4] fails in PyTorch's local reshape */
        {"nested split [48]->[12,4]", V_RESHAPE, 1, {48}, {S_(0), S_(0)}, {S_(0), S_(0)},
         {12, 12}, .rnd = 2, .rsizes = {12, 4}},
        {"nested split [48]->[8,6]", V_RESHAPE, 1, {48}, {S_(0), S_(0)}, {S_(0), S_(0)},
         {8, 8}, .rnd = 2, .rsizes = {8, 6}},
        {"nested split [24]->[3,8]", V_RESHAPE, 1, {24}, {S_(0), S_(0)}, {S_(0), S_(0)},
         {3, 3}, .rnd = 2, .rsizes = {3, 8}},
        /* PyTorch 2x3: no collective; 4x2: [R, R], all_gather 2 (here [R, S(0)],
         * also 2); 2x2 fails in PyTorch's local reshape */
        {"nested merge [6,8]->[48]", V_RESHAPE, 2, {6, 8}, {S_(0), S_(0)}, {S_(0), S_(0)},
         {6, 6}, .rnd = 1, .rsizes = {48}},
        /* size-1 dims appear and vanish; a shard of a vanishing dim is
         * replicated. PyTorch mesh 2, 3, 4: [1,6] S(0) -> [6]: all_gather 1;
         * the others none. */
        {"[1,6] S(1)->[6]", V_RESHAPE, 2, {1, 6}, {R_, S_(1)}, {R_, S_(0)}, {0, 0}, .rnd = 1,
         .rsizes = {6}},
        {"[1,6] S(0)->[6]", V_RESHAPE, 2, {1, 6}, {S_(1), S_(0)}, {S_(0), R_}, {0, -1},
         .rnd = 1, .rsizes = {6}},
        {"[6]->[6,1]", V_RESHAPE, 1, {6}, {S_(0), S_(0)}, {S_(0), S_(0)}, {0, 0}, .rnd = 2,
         .rsizes = {6, 1}},
        {"[6]->[1,6]", V_RESHAPE, 1, {6}, {R_, S_(0)}, {R_, S_(1)}, {0, 0}, .rnd = 2,
         .rsizes = {1, 6}},
        {"[2,1,12]->[2,4,3]", V_RESHAPE, 3, {2, 1, 12}, {S_(0), S_(2)}, {S_(0), S_(1)},
         {0, 4}, .rnd = 3, .rsizes = {2, 4, 3}},
        {"[1]->[] (0-d)", V_RESHAPE, 1, {1}, {S_(0), R_}, {R_, R_}, {-1, 0}, .rnd = 0},
        /* Partial passes untouched (PyTorch: no collective, Partial(sum)) */
        {"Partial [2,3,24]->[2,3,4,6]", V_RESHAPE, 3, {2, 3, 24}, {S_(2), P_}, {S_(2), P_},
         {4, 0}, .rnd = 4, .rsizes = {2, 3, 4, 6}},
        {"Partial on mesh dim 0 [2,3,24]->[2,3,4,6]", V_RESHAPE, 3, {2, 3, 24}, {P_, S_(2)},
         {P_, S_(2)}, {0, 4}, .rnd = 4, .rsizes = {2, 3, 4, 6}},
        {"Replicate [2,3,24]->[144]", V_RESHAPE, 3, {2, 3, 24}, {R_, R_}, {R_, R_}, {0, 0},
         .rnd = 1, .rsizes = {144}},
        /* no elements: a shard survives where the leading dims agree */
        {"empty [0,6]->[0,2,3]", V_RESHAPE, 2, {0, 6}, {S_(0), S_(1)}, {S_(0), R_}, {0, -1},
         .rnd = 3, .rsizes = {0, 2, 3}},
    };
    return run_cases(s, mesh, cases, NCASES(cases));
}

/* ---- flatten and unflatten ---------------------------------------------------------------- */

static tp_status flatten_body(tp_test_slot *s, tp_mesh *mesh)
{
    const view_case cases[] = {
        {"(2,3) heads", V_FLATTEN, 4, {2, 3, 4, 6}, {S_(0), S_(2)}, {S_(0), S_(2)}, {0, 4},
         .a = 2, .b = 3},
        {"(-2,-1) heads (H=6)", V_FLATTEN, 4, {2, 3, 6, 4}, {S_(2), S_(2)}, {S_(2), S_(2)},
         {6, 6}, .a = -2, .b = -1},
        {"(0,1) before the shard", V_FLATTEN, 3, {5, 3, 7}, {S_(2), S_(2)}, {S_(1), S_(1)},
         {0, 0}, .a = 0, .b = 1},
        {"(0,1) uneven outer", V_FLATTEN, 3, {5, 3, 7}, {R_, S_(0)}, {R_, S_(0)}, {0, 5},
         .a = 0, .b = 1},
        {"(0,-1) inner shard", V_FLATTEN, 3, {4, 3, 2}, {S_(1), S_(0)}, {R_, S_(0)}, {-1, 4},
         .a = 0, .b = -1},
        {"(1,1) nothing merges", V_FLATTEN, 3, {5, 3, 7}, {S_(1), S_(1)}, {S_(1), S_(1)},
         {0, 0}, .a = 1, .b = 1},
        {"Partial", V_FLATTEN, 3, {2, 3, 8}, {R_, P_}, {R_, P_}, {0, 0}, .a = 0, .b = 2},
        {"0-d", V_FLATTEN, 0, {0}, {R_, P_}, {R_, P_}, {0, 0}, .a = 0, .b = -1},
    };
    return run_cases(s, mesh, cases, NCASES(cases));
}

static tp_status unflatten_body(tp_test_slot *s, tp_mesh *mesh)
{
    const view_case cases[] = {
        /* PyTorch [2,12] S(1) -> (4, 3) on mesh 2, 4: none; mesh 3: all_gather 1 */
        {"heads (4,6)", V_UNFLATTEN, 3, {2, 3, 24}, {S_(0), S_(2)}, {S_(0), S_(2)}, {0, 4},
         .rnd = 2, .rsizes = {4, 6}, .a = 2},
        {"heads (-1,4) at -1", V_UNFLATTEN, 3, {2, 3, 24}, {S_(2), S_(2)}, {S_(2), S_(2)},
         {6, 6}, .rnd = 2, .rsizes = {-1, 4}, .a = -1},
        {"(2,2,6) nested", V_UNFLATTEN, 2, {3, 24}, {S_(1), S_(1)}, {S_(1), S_(1)}, {2, 2},
         .rnd = 3, .rsizes = {2, 2, 6}, .a = 1},
        {"another dim's shard passes", V_UNFLATTEN, 3, {5, 3, 24}, {S_(0), S_(1)},
         {S_(0), S_(1)}, {0, 0}, .rnd = 2, .rsizes = {4, 6}, .a = 2},
        {"shard after the split dim moves", V_UNFLATTEN, 3, {2, 12, 7}, {S_(2), S_(2)},
         {S_(3), S_(3)}, {0, 0}, .rnd = 2, .rsizes = {3, 4}, .a = 1},
        {"(3,1) keeps the dim", V_UNFLATTEN, 2, {3, 7}, {S_(0), S_(0)}, {S_(0), S_(0)},
         {0, 0}, .rnd = 2, .rsizes = {3, 1}, .a = 0},
        {"Partial", V_UNFLATTEN, 2, {3, 8}, {P_, S_(0)}, {P_, S_(0)}, {0, 0}, .rnd = 2,
         .rsizes = {2, 4}, .a = 1},
    };
    return run_cases(s, mesh, cases, NCASES(cases));
}

/* ---- transpose and permute ------------------------------------------------------------------ */

static tp_status permute_body(tp_test_slot *s, tp_mesh *mesh)
{
    /* PyTorch: transpose(1, 2) of [2,4,3,5] S(2) -> S(1), permute(3,0,2,1)
     * S(2) -> S(2), and 2x2 [S(2), S(0)] -> [S(1), S(0)]: no collective */
    const view_case cases[] = {
        {"(1,2) heads", V_TRANSPOSE, 4, {2, 5, 3, 4}, {S_(0), S_(2)}, {S_(0), S_(1)}, {0, 0},
         .a = 1, .b = 2},
        {"(-3,-2) nested", V_TRANSPOSE, 4, {2, 5, 3, 4}, {S_(1), S_(1)}, {S_(2), S_(2)},
         {0, 0}, .a = -3, .b = -2},
        {"(0,3)", V_TRANSPOSE, 4, {2, 5, 3, 4}, {S_(3), S_(0)}, {S_(0), S_(3)}, {0, 0}, .a = 0,
         .b = 3},
        {"(2,3) last two", V_TRANSPOSE, 4, {2, 5, 3, 4}, {S_(2), S_(3)}, {S_(3), S_(2)},
         {0, 0}, .a = 2, .b = 3},
        {"(1,1)", V_TRANSPOSE, 3, {5, 3, 7}, {R_, S_(1)}, {R_, S_(1)}, {0, 0}, .a = 1, .b = 1},
        {"(0,1) Partial", V_TRANSPOSE, 3, {5, 3, 7}, {S_(2), P_}, {S_(2), P_}, {0, 0}, .a = 0,
         .b = 1},
        {"(0,1) Partial(max)", V_TRANSPOSE, 2, {5, 3}, {PMAX_, S_(0)}, {PMAX_, S_(1)}, {0, 0},
         .a = 0, .b = 1},
        {"(3,0,2,1)", V_PERMUTE, 4, {2, 5, 3, 4}, {S_(0), S_(2)}, {S_(1), S_(2)}, {0, 0},
         .perm = {3, 0, 2, 1}},
        {"(-1,0,-2,1)", V_PERMUTE, 4, {2, 5, 3, 4}, {S_(3), S_(1)}, {S_(0), S_(3)}, {0, 0},
         .perm = {-1, 0, -2, 1}},
        {"(2,0,1) Partial", V_PERMUTE, 3, {5, 3, 7}, {P_, S_(0)}, {P_, S_(1)}, {0, 0},
         .perm = {2, 0, 1}},
        {"identity", V_PERMUTE, 3, {5, 3, 7}, {S_(1), S_(0)}, {S_(1), S_(0)}, {0, 0},
         .perm = {0, 1, 2}},
        {"small (1,0)", V_PERMUTE, 2, {2, 9}, {S_(1), S_(0)}, {S_(0), S_(1)}, {0, 0},
         .perm = {1, 0}},
    };
    return run_cases(s, mesh, cases, NCASES(cases));
}

/* ---- distributed errors ------------------------------------------------------------------- */

static void expect_err(tp_test_slot *s, tp_status st, const tp_tensor *y, const char *msg)
{
    RANK_EXPECT(s, st == TP_ERR_INVALID_ARG && y == NULL && strstr(tp_last_error(), msg),
                "%s: %s (%s)", msg, tp_status_name(st), tp_last_error());
}

/* Bad arguments fail on every rank before any collective. Sizes other than 0
 * whose product passes INT64_MAX are refused in any order, even beside the 0
 * that makes the element count match (an empty e), as core's tp_tensor_view
 * refuses them: by the op, before the all_gather its sharded dim 1 needs. */
static tp_status errors_body(tp_test_slot *s, tp_mesh *mesh)
{
    int m = tp_mesh_ndim(mesh);
    tp_placement ss[2] = {S_(0), S_(1)}, s1[2] = {S_(1), S_(1)};
    tp_tensor *a = NULL, *da = NULL, *e = NULL, *de = NULL, *y = NULL;
    RANK_OK(s, tp_test_global_tensor(2, (int64_t[]){4, 6}, 1, &a));
    RANK_OK(s, tp_dtensor_distribute(mesh, a, m, ss + (2 - m), -1, &da));
    RANK_OK(s, tp_tensor_zeros(TP_F32, TP_CPU, 2, (int64_t[]){0, 6}, &e));
    RANK_OK(s, tp_dtensor_distribute(mesh, e, m, s1, -1, &de));
    tp_comm_debug *dbg = NULL;
    RANK_OK(s, tp_comm_debug_create(&dbg));
    RANK_OK(s, tp_comm_debug_begin(dbg));
    expect_err(s, tp_reshape(da, 2, (int64_t[]){5, 5}, &y), y,
               "reshape: cannot reshape [4, 6] (24 elements) into [5, 5] (25 elements)");
    expect_err(s, tp_unflatten(da, 1, 2, (int64_t[]){4, 4}, &y), y,
               "unflatten: sizes [4, 4] hold 16 elements but dim 1 has size 6");
    expect_err(s, tp_flatten(da, 1, 0, &y), y, "flatten: start_dim 1 comes after end_dim 0");
    expect_err(s, tp_permute(da, 2, (int[]){1, 1}, &y), y, "permute: dim 1 appears twice");
    expect_err(s, tp_transpose(da, 0, 2, &y), y,
               "transpose: dims (0, 2) out of range for 2 dims");
    expect_err(s, tp_reshape(de, 3, (int64_t[]){0, INT64_MAX, 2}, &y), y,
               "reshape: shape [0, 9223372036854775807, 2] has too many elements");
    expect_err(s, tp_reshape(de, 3, (int64_t[]){INT64_MAX, 2, 0}, &y), y,
               "reshape: shape [9223372036854775807, 2, 0] has too many elements");
    RANK_OK(s, tp_comm_debug_end(dbg));
    RANK_EXPECT(s, tp_comm_debug_total(dbg) == 0, "failed views issued %lld collectives",
                (long long)tp_comm_debug_total(dbg));
    tp_comm_debug_free(dbg);
    tp_tensor_release(a);
    tp_tensor_release(da);
    tp_tensor_release(e);
    tp_tensor_release(de);
    return TP_OK;
}

/* ---- the distributed tests ------------------------------------------------------------------- */

#define VIEW_MESHES                                                                           \
    static view_mesh meshes[] = {{1, {1}},    {1, {2}},    {1, {3}},    {1, {4}},             \
                                 {1, {8}},    {2, {2, 2}}, {2, {2, 3}}, {2, {4, 2}}};          \
    return cr_make_param_array(view_mesh, meshes, NCASES(meshes))

ParameterizedTestParameters(ops_view, reshape) { VIEW_MESHES; }
ParameterizedTest(view_mesh *vm, ops_view, reshape, .timeout = 120)
{
    run_on_mesh(vm, reshape_body);
}

ParameterizedTestParameters(ops_view, flatten) { VIEW_MESHES; }
ParameterizedTest(view_mesh *vm, ops_view, flatten, .timeout = 120)
{
    run_on_mesh(vm, flatten_body);
}

ParameterizedTestParameters(ops_view, unflatten) { VIEW_MESHES; }
ParameterizedTest(view_mesh *vm, ops_view, unflatten, .timeout = 120)
{
    run_on_mesh(vm, unflatten_body);
}

ParameterizedTestParameters(ops_view, transpose_permute) { VIEW_MESHES; }
ParameterizedTest(view_mesh *vm, ops_view, transpose_permute, .timeout = 120)
{
    run_on_mesh(vm, permute_body);
}

ParameterizedTestParameters(ops_view, distributed_errors)
{
    static view_mesh meshes[] = {{1, {1}}, {1, {3}}, {2, {2, 2}}};
    return cr_make_param_array(view_mesh, meshes, NCASES(meshes));
}
ParameterizedTest(view_mesh *vm, ops_view, distributed_errors, .timeout = 60)
{
    run_on_mesh(vm, errors_body);
}

/* ---- plain ops against index loops (main thread) ------------------------------------------- */

static tp_tensor *rand_t(int nd, const int64_t *shape, uint64_t seed)
{
    tp_tensor *t = NULL;
    CHECK_OK(tp_test_global_tensor(nd, shape, seed, &t));
    return t;
}

static void expect_shape(const tp_tensor *t, int nd, const int64_t *shape, const char *what)
{
    cr_assert_eq(tp_tensor_ndim(t), nd, "%s: %d dims, expected %d", what, tp_tensor_ndim(t), nd);
    for (int d = 0; d < nd; d++)
        cr_assert_eq(tp_tensor_size(t, d), shape[d], "%s: dim %d has size %lld, expected %lld",
                     what, d, (long long)tp_tensor_size(t, d), (long long)shape[d]);
}

/* reshape, flatten, unflatten: y is a view of x with the given shape (same
 * elements in the same order); the gradient is g's elements in a new buffer */
static void check_plain_reshape(tp_tensor *x, tp_tensor *y, int nd, const int64_t *shape,
                                const char *what)
{
    expect_shape(y, nd, shape, what);
    cr_assert(tp_tensor_is_contiguous(y), "%s: not contiguous", what);
    cr_assert(tp_tensor_data(y) == tp_tensor_data(x), "%s: not a view of x", what);
    tp_tensor *g = rand_t(nd, shape, 21);
    tp_tensor_zero_grad(x);
    CHECK_OK(tp_backward(y, g));
    tp_tensor *gx = tp_tensor_grad(x);
    cr_assert(gx, "%s: no gradient", what);
    expect_shape(gx, tp_tensor_ndim(x), tp_tensor_shape(x), what);
    cr_assert(tp_tensor_data(gx) != tp_tensor_data(g), "%s: the gradient aliases g", what);
    cr_assert(memcmp(tp_tensor_data(gx), tp_tensor_data(g),
                     (size_t)tp_tensor_numel(x) * sizeof(float)) == 0,
              "%s: gradient differs", what);
    tp_tensor_release(g);
}

Test(ops_view, plain_reshape_flatten_unflatten, .timeout = 30)
{
    const int64_t sh[4] = {2, 3, 4, 5};
    tp_tensor *x = rand_t(4, sh, 6), *y = NULL;
    CHECK_OK(tp_tensor_set_requires_grad(x, true));
    CHECK_OK(tp_reshape(x, 3, (int64_t[]){6, -1, 2}, &y));
    check_plain_reshape(x, y, 3, (int64_t[]){6, 10, 2}, "reshape [6, -1, 2]");
    tp_tensor_release(y);
    CHECK_OK(tp_flatten(x, 1, 2, &y));
    check_plain_reshape(x, y, 3, (int64_t[]){2, 12, 5}, "flatten(1, 2)");
    tp_tensor_release(y);
    CHECK_OK(tp_flatten(x, -3, -1, &y));
    check_plain_reshape(x, y, 2, (int64_t[]){2, 60}, "flatten(-3, -1)");
    tp_tensor_release(y);
    CHECK_OK(tp_flatten(x, 0, -1, &y));
    check_plain_reshape(x, y, 1, (int64_t[]){120}, "flatten(0, -1)");
    tp_tensor_release(y);
    CHECK_OK(tp_flatten(x, 3, 3, &y));
    check_plain_reshape(x, y, 4, sh, "flatten(3, 3)");
    tp_tensor_release(y);
    CHECK_OK(tp_unflatten(x, 2, 2, (int64_t[]){2, 2}, &y));
    check_plain_reshape(x, y, 5, (int64_t[]){2, 3, 2, 2, 5}, "unflatten(2, (2, 2))");
    tp_tensor_release(y);
    CHECK_OK(tp_unflatten(x, -1, 3, (int64_t[]){1, -1, 1}, &y));
    check_plain_reshape(x, y, 6, (int64_t[]){2, 3, 4, 1, 5, 1}, "unflatten(-1, (1, -1, 1))");
    tp_tensor_release(y);
    CHECK_OK(tp_unflatten(x, 0, 1, (int64_t[]){2}, &y));
    check_plain_reshape(x, y, 4, sh, "unflatten(0, (2))");
    tp_tensor_release(y);
    tp_tensor_release(x);
    /* a 0-d tensor flattens to [1] */
    tp_tensor *s0 = NULL;
    CHECK_OK(tp_tensor_zeros(TP_F32, TP_CPU, 0, NULL, &s0));
    CHECK_OK(tp_tensor_fill(s0, 3.0));
    CHECK_OK(tp_tensor_set_requires_grad(s0, true));
    CHECK_OK(tp_flatten(s0, 0, -1, &y));
    check_plain_reshape(s0, y, 1, (int64_t[]){1}, "flatten of a 0-d tensor");
    tp_tensor_release(y);
    tp_tensor_release(s0);
}

/* y = x with its dims reordered by perm (dim k of y is dim perm[k] of x);
 * checks every element and the gradient of x (g reordered back). */
static void check_plain_permute(tp_tensor *x, tp_tensor *y, const int *perm, const char *what)
{
    int nd = tp_tensor_ndim(x);
    int64_t ysh[4];
    for (int k = 0; k < nd; k++)
        ysh[k] = tp_tensor_size(x, perm[k]);
    expect_shape(y, nd, ysh, what);
    cr_assert(tp_tensor_is_contiguous(y), "%s: not contiguous", what);
    tp_tensor *g = rand_t(nd, ysh, 31);
    tp_tensor_zero_grad(x);
    CHECK_OK(tp_backward(y, g));
    tp_tensor *gx = tp_tensor_grad(x);
    cr_assert(gx, "%s: no gradient", what);
    int64_t i[4] = {0}, j[4];
    for (int64_t n = 0; n < tp_tensor_numel(x); n++) {
        int64_t r = n;
        for (int d = nd - 1; d >= 0; d--) {
            i[d] = r % tp_tensor_size(x, d);
            r /= tp_tensor_size(x, d);
        }
        for (int k = 0; k < nd; k++)
            j[k] = i[perm[k]];
        double vx, vy, vg, vgx;
        CHECK_OK(tp_tensor_get(x, i, &vx));
        CHECK_OK(tp_tensor_get(y, j, &vy));
        CHECK_OK(tp_tensor_get(g, j, &vg));
        CHECK_OK(tp_tensor_get(gx, i, &vgx));
        cr_assert_eq(vx, vy, "%s: element %lld moved wrongly", what, (long long)n);
        cr_assert_eq(vg, vgx, "%s: gradient of element %lld wrong", what, (long long)n);
    }
    tp_tensor_release(g);
}

Test(ops_view, plain_transpose_permute, .timeout = 30)
{
    const int64_t sh[4] = {2, 3, 4, 5};
    tp_tensor *x = rand_t(4, sh, 6), *y = NULL;
    CHECK_OK(tp_tensor_set_requires_grad(x, true));
    const int perms[][4] = {{0, 2, 1, 3}, {3, 0, 2, 1}, {1, 0, 3, 2}, {0, 1, 3, 2},
                            {3, 2, 1, 0}, {0, 1, 2, 3}, {2, 3, 0, 1}};
    for (size_t k = 0; k < NCASES(perms); k++) {
        char what[64];
        snprintf(what, sizeof what, "permute(%d, %d, %d, %d)", perms[k][0], perms[k][1],
                 perms[k][2], perms[k][3]);
        CHECK_OK(tp_permute(x, 4, perms[k], &y));
        check_plain_permute(x, y, perms[k], what);
        tp_tensor_release(y);
    }
    /* negative dims name the same permutation */
    CHECK_OK(tp_permute(x, 4, (int[]){-1, 0, -2, 1}, &y));
    check_plain_permute(x, y, (int[]){3, 0, 2, 1}, "permute(-1, 0, -2, 1)");
    tp_tensor_release(y);
    const int pairs[][2] = {{1, 2}, {0, 3}, {-1, -2}, {2, 2}};
    for (size_t k = 0; k < NCASES(pairs); k++) {
        int a = pairs[k][0] < 0 ? pairs[k][0] + 4 : pairs[k][0];
        int b = pairs[k][1] < 0 ? pairs[k][1] + 4 : pairs[k][1];
        int perm[4] = {0, 1, 2, 3};
        perm[a] = b;
        perm[b] = a;
        char what[64];
        snprintf(what, sizeof what, "transpose(%d, %d)", pairs[k][0], pairs[k][1]);
        CHECK_OK(tp_transpose(x, pairs[k][0], pairs[k][1], &y));
        check_plain_permute(x, y, perm, what);
        tp_tensor_release(y);
    }
    tp_tensor_release(x);
    /* 1-d and 0-d tensors */
    tp_tensor *v = rand_t(1, (int64_t[]){7}, 8);
    CHECK_OK(tp_tensor_set_requires_grad(v, true));
    CHECK_OK(tp_permute(v, 1, (int[]){0}, &y));
    check_plain_permute(v, y, (int[]){0}, "permute of a 1-d tensor");
    tp_tensor_release(y);
    tp_tensor_release(v);
    tp_tensor *s0 = NULL;
    CHECK_OK(tp_tensor_zeros(TP_F32, TP_CPU, 0, NULL, &s0));
    CHECK_OK(tp_permute(s0, 0, NULL, &y));
    cr_assert_eq(tp_tensor_ndim(y), 0);
    tp_tensor_release(y);
    tp_tensor_release(s0);
}

/* ---- argument errors (plain tensors) ---------------------------------------------------------- */

#define CHECK_MSG(substr)                                                                     \
    cr_assert(strstr(tp_last_error(), (substr)), "message \"%s\" lacks \"%s\"",                \
              tp_last_error(), (substr))

Test(ops_view, errors, .timeout = 30)
{
    tp_tensor *a = rand_t(2, (int64_t[]){3, 4}, 1), *y = (tp_tensor *)&y;
    /* NULLs */
    CHECK_ERR(tp_flatten(NULL, 0, 1, &y), TP_ERR_INVALID_ARG);
    CHECK_MSG("flatten: x is NULL");
    cr_assert_null(y);
    CHECK_ERR(tp_flatten(a, 0, 1, NULL), TP_ERR_INVALID_ARG);
    CHECK_MSG("flatten: out is NULL");
    CHECK_ERR(tp_unflatten(NULL, 0, 1, (int64_t[]){3}, &y), TP_ERR_INVALID_ARG);
    CHECK_MSG("unflatten: x is NULL");
    CHECK_ERR(tp_unflatten(a, 0, 1, NULL, &y), TP_ERR_INVALID_ARG);
    CHECK_MSG("unflatten: sizes is NULL");
    CHECK_ERR(tp_permute(NULL, 2, (int[]){1, 0}, &y), TP_ERR_INVALID_ARG);
    CHECK_MSG("permute: x is NULL");
    CHECK_ERR(tp_permute(a, 2, NULL, &y), TP_ERR_INVALID_ARG);
    CHECK_MSG("permute: dims is NULL");
    CHECK_ERR(tp_transpose(a, 0, 1, NULL), TP_ERR_INVALID_ARG);
    CHECK_MSG("transpose: out is NULL");
    CHECK_ERR(tp_reshape(a, 2, NULL, &y), TP_ERR_INVALID_ARG);
    CHECK_MSG("reshape: shape is NULL for ndim 2");
    /* reshape */
    CHECK_ERR(tp_reshape(a, 2, (int64_t[]){5, 2}, &y), TP_ERR_INVALID_ARG);
    CHECK_MSG("reshape: cannot reshape [3, 4] (12 elements) into [5, 2] (10 elements)");
    CHECK_ERR(tp_reshape(a, 2, (int64_t[]){-1, -1}, &y), TP_ERR_INVALID_ARG);
    CHECK_MSG("reshape: only one size may be -1 (dims 0 and 1 are)");
    CHECK_ERR(tp_reshape(a, 2, (int64_t[]){-1, 5}, &y), TP_ERR_INVALID_ARG);
    CHECK_MSG("reshape: cannot infer the size of dim 0: 12 elements into [-1, 5]");
    CHECK_ERR(tp_reshape(a, 3, (int64_t[]){0, -1, 2}, &y), TP_ERR_INVALID_ARG);
    CHECK_MSG("reshape: cannot infer the size of dim 1");
    CHECK_ERR(tp_reshape(a, 2, (int64_t[]){-3, 4}, &y), TP_ERR_INVALID_ARG);
    CHECK_MSG("reshape: size -3 of dim 0 is invalid");
    CHECK_ERR(tp_reshape(a, -1, (int64_t[]){12}, &y), TP_ERR_INVALID_ARG);
    CHECK_MSG("reshape: ndim -1 is outside [0, 8]");
    CHECK_ERR(tp_reshape(a, 9, (int64_t[]){1, 1, 1, 1, 1, 1, 1, 1, 12}, &y), TP_ERR_INVALID_ARG);
    CHECK_MSG("reshape: ndim 9 is outside [0, 8]");
    /* flatten */
    CHECK_ERR(tp_flatten(a, 2, 1, &y), TP_ERR_INVALID_ARG);
    CHECK_MSG("flatten: start_dim 2 is out of range for 2 dims");
    CHECK_ERR(tp_flatten(a, 0, -3, &y), TP_ERR_INVALID_ARG);
    CHECK_MSG("flatten: end_dim -3 is out of range for 2 dims");
    CHECK_ERR(tp_flatten(a, -1, 0, &y), TP_ERR_INVALID_ARG);
    CHECK_MSG("flatten: start_dim -1 comes after end_dim 0");
    /* unflatten */
    CHECK_ERR(tp_unflatten(a, 2, 2, (int64_t[]){2, 2}, &y), TP_ERR_INVALID_ARG);
    CHECK_MSG("unflatten: dim 2 is out of range for 2 dims");
    CHECK_ERR(tp_unflatten(a, -3, 2, (int64_t[]){2, 2}, &y), TP_ERR_INVALID_ARG);
    CHECK_MSG("unflatten: dim -3 is out of range for 2 dims");
    CHECK_ERR(tp_unflatten(a, 1, 0, (int64_t[]){4}, &y), TP_ERR_INVALID_ARG);
    CHECK_MSG("unflatten: sizes must hold at least one size (n = 0)");
    CHECK_ERR(tp_unflatten(a, -1, 2, (int64_t[]){3, 2}, &y), TP_ERR_INVALID_ARG);
    CHECK_MSG("unflatten: sizes [3, 2] hold 6 elements but dim 1 has size 4");
    CHECK_ERR(tp_unflatten(a, 1, 2, (int64_t[]){-1, 3}, &y), TP_ERR_INVALID_ARG);
    CHECK_MSG("unflatten: cannot infer the size of dim 1: 4 elements into [-1, 3]");
    CHECK_ERR(tp_unflatten(a, 1, 2, (int64_t[]){-1, -1}, &y), TP_ERR_INVALID_ARG);
    CHECK_MSG("unflatten: only one size may be -1 (dims 1 and 2 are)");
    CHECK_ERR(tp_unflatten(a, 0, 2, (int64_t[]){-2, 3}, &y), TP_ERR_INVALID_ARG);
    CHECK_MSG("unflatten: size -2 of dim 0 is invalid");
    CHECK_ERR(tp_unflatten(a, 1, 8, (int64_t[]){1, 1, 1, 1, 1, 1, 1, 4}, &y),
              TP_ERR_INVALID_ARG);
    CHECK_MSG("unflatten: the result would have 9 dims; at most 8");
    /* transpose */
    CHECK_ERR(tp_transpose(a, 0, 2, &y), TP_ERR_INVALID_ARG);
    CHECK_MSG("transpose: dims (0, 2) out of range for 2 dims");
    CHECK_ERR(tp_transpose(a, -3, 0, &y), TP_ERR_INVALID_ARG);
    CHECK_MSG("transpose: dims (-3, 0) out of range for 2 dims");
    /* permute */
    CHECK_ERR(tp_permute(a, 3, (int[]){0, 1, 2}, &y), TP_ERR_INVALID_ARG);
    CHECK_MSG("permute: 3 dims given for a tensor of 2 dims");
    CHECK_ERR(tp_permute(a, 2, (int[]){0, 2}, &y), TP_ERR_INVALID_ARG);
    CHECK_MSG("permute: dim 2 is out of range for 2 dims");
    CHECK_ERR(tp_permute(a, 2, (int[]){-1, 1}, &y), TP_ERR_INVALID_ARG);
    CHECK_MSG("permute: dim 1 appears twice");
    /* dtype and layout */
    tp_tensor *ai = NULL, *nc = NULL;
    CHECK_OK(tp_tensor_zeros(TP_I64, TP_CPU, 2, (int64_t[]){3, 4}, &ai));
    CHECK_ERR(tp_permute(ai, 2, (int[]){1, 0}, &y), TP_ERR_NOT_SUPPORTED);
    CHECK_MSG("permute: x is i64");
    CHECK_OK(tp_tensor_narrow(a, 1, 1, 2, &nc));
    CHECK_ERR(tp_flatten(nc, 0, 1, &y), TP_ERR_INVALID_ARG);
    CHECK_MSG("flatten: x is not contiguous");
    CHECK_ERR(tp_permute(nc, 2, (int[]){1, 0}, &y), TP_ERR_INVALID_ARG);
    CHECK_MSG("permute: x is not contiguous");
    cr_assert_null(y);
    tp_tensor_release(ai);
    tp_tensor_release(nc);
    tp_tensor_release(a);
}

/* ---- the attention block -----------------------------------------------------------------------
 * x [B, S, D] (plain, requires grad) enters as one Replicate DTensor
 * (tp_dtensor_from_local); wq, wk, wv are colwise Linears whose outputs stay
 * DTensors S(-1); each is reshaped to [B, S, H, Dh] (the shard lands on H)
 * and transposed to [B, H, S, Dh]; causal attention runs on this rank's
 * heads; the output is transposed back and reshaped to [B, S, D] (the shard
 * lands on D), and the rowwise wo returns the Replicate result.
 *
 * PyTorch 2.15 on the same block (ColwiseParallel(use_local_output=False),
 * RowwiseParallel(input_layouts=Shard(-1)), DTensor.from_local(x, [R]),
 * reshape/transpose on DTensors, scaled_dot_product_attention with the math
 * backend and a Replicate causal mask; CommDebugMode): forward all_reduce 1,
 * backward all_reduce 1, nothing else, at W = 2, 4 (H = 4) and W = 3 (H = 3
 * and 6); none at W = 1. (At W = 2 with H = 3 its view refuses the split;
 * here the reshape would all_gather.) */

enum { AB = 2, AS = 5, ADH = 4 };

#define ATT_RTOL 1e-4
#define ATT_ATOL 1e-5

static tp_status attn_forward(tp_module *self, int nargs, tp_tensor *const *args, int nkw,
                              const tp_kwarg *kw, tp_tensor **out)
{
    (void)kw;
    if (nargs != 1 || nkw != 0)
        return TP_ERR_INVALID_ARG;
    const int64_t h = *(const int *)tp_module_ctx(self), d = h * ADH;
    const char *const proj[3] = {"wq", "wk", "wv"};
    tp_tensor *p[3] = {0}, *v[3] = {0}, *t[3] = {0}, *o = NULL, *ot = NULL, *merged = NULL;
    tp_status st = TP_OK;
    for (int i = 0; i < 3 && st == TP_OK; i++) {
        st = tp_module_call(tp_module_child(self, proj[i]), args[0], &p[i]);
        if (st == TP_OK)
            st = tp_reshape(p[i], 4, (int64_t[]){AB, AS, h, ADH}, &v[i]);
        if (st == TP_OK)
            st = tp_transpose(v[i], 1, 2, &t[i]);
    }
    if (st == TP_OK)
        st = tp_scaled_dot_product_attention(t[0], t[1], t[2], true, 0.0, &o);
    if (st == TP_OK)
        st = tp_transpose(o, 1, 2, &ot);
    if (st == TP_OK)
        st = tp_reshape(ot, 3, (int64_t[]){AB, AS, d}, &merged);
    if (st == TP_OK)
        st = tp_module_call(tp_module_child(self, "wo"), merged, out);
    for (int i = 0; i < 3; i++) {
        tp_tensor_release(p[i]);
        tp_tensor_release(v[i]);
        tp_tensor_release(t[i]);
    }
    tp_tensor_release(o);
    tp_tensor_release(ot);
    tp_tensor_release(merged);
    return st;
}

static tp_status attn_build(int *heads, tp_module **out)
{
    tp_module *m = NULL;
    TP_TEST_TRY(tp_nn_custom_create("Attention", attn_forward, heads, NULL, &m));
    const char *const names[4] = {"wq", "wk", "wv", "wo"};
    int64_t d = *heads * ADH;
    for (int i = 0; i < 4; i++) {
        tp_module *l = NULL;
        tp_status st = tp_nn_linear_create(d, d, false, &l);
        if (st == TP_OK) {
            st = tp_module_add_child(m, names[i], l);
            if (st != TP_OK)
                tp_module_free(l);
        }
        if (st != TP_OK) {
            tp_module_free(m);
            return st;
        }
    }
    *out = m;
    return TP_OK;
}

typedef struct {
    int w, heads;
} attn_param;

typedef struct {
    attn_param p;
    tp_test_slot slot[TP_TEST_MAX_RANKS];
} attn_ctx;

static const char *const coll_names[] = {"all_reduce", "all_gather", "reduce_scatter",
                                         "all_to_all", "broadcast",  "barrier"};

static tp_status attn_rank(tp_comm *world, void *arg)
{
    attn_ctx *c = arg;
    tp_test_slot *s = &c->slot[tp_comm_rank(world)];
    int heads = c->p.heads, w = c->p.w;
    const int64_t d = heads * ADH, xs[3] = {AB, AS, d};
    tp_mesh *mesh = NULL;
    tp_module *ref = NULL, *par = NULL;
    tp_tensor *x = NULL, *xr = NULL, *g = NULL, *yr = NULL, *xd = NULL, *y = NULL;
    RANK_OK(s, tp_mesh_create(world, 1, (int64_t[]){w}, NULL, &mesh));
    /* the single-rank block */
    RANK_OK(s, attn_build(&heads, &ref));
    RANK_OK(s, tp_module_init(ref, 5));
    RANK_OK(s, tp_test_global_tensor(3, xs, 1, &x));
    RANK_OK(s, tp_tensor_clone(x, &xr));
    RANK_OK(s, tp_test_global_tensor(3, xs, 2, &g));
    RANK_OK(s, tp_tensor_set_requires_grad(xr, true));
    RANK_OK(s, tp_module_call(ref, xr, &yr));
    RANK_OK(s, tp_backward(yr, g));
    /* the parallel one */
    RANK_OK(s, attn_build(&heads, &par));
    tp_style *col = NULL, *row = NULL;
    tp_colwise_options co = {.use_local_output = TP_FLAG_FALSE};
    RANK_OK(s, tp_colwise_parallel_create(&co, &col));
    RANK_OK(s, tp_rowwise_parallel_create(NULL, &row));
    tp_plan_entry plan[2] = {{"w[qkv]", col}, {"wo", row}};
    tp_parallelize_options po = {.src_data_rank = TP_SRC_DATA_RANK_NONE};
    tp_status st = tp_parallelize_module(par, mesh, 2, plan, &po);
    tp_style_free(col);
    tp_style_free(row);
    RANK_OK(s, st);
    RANK_OK(s, tp_module_init(par, 5));
    RANK_OK(s, tp_tensor_set_requires_grad(x, true));
    tp_comm_debug *dbg = NULL;
    RANK_OK(s, tp_comm_debug_create(&dbg));
    RANK_OK(s, tp_comm_debug_begin(dbg));
    st = tp_dtensor_from_local(mesh, x, 1, (tp_placement[]){tp_replicate()}, NULL, &xd);
    if (st == TP_OK)
        st = tp_module_call(par, xd, &y);
    if (st == TP_OK)
        st = tp_backward(y, g);
    RANK_OK(s, tp_comm_debug_end(dbg));
    RANK_OK(s, st);
    for (int ph = 0; ph < 2; ph++)
        for (int k = 0; k < TP_COLL_KIND_COUNT; k++) {
            int64_t want = (w > 1 && k == TP_COLL_ALL_REDUCE) ? 1 : 0;
            int64_t got = tp_comm_debug_module_count(dbg, TP_COMM_DEBUG_GLOBAL, (tp_phase)ph,
                                                     (tp_coll_kind)k);
            RANK_EXPECT(s, got == want, "W=%d H=%d %s: %lld %s, expected %lld", w, heads,
                        ph == TP_PHASE_FORWARD ? "forward" : "backward", (long long)got,
                        coll_names[k], (long long)want);
        }
    tp_comm_debug_free(dbg);
    /* values: the output is the plain Replicate result */
    bool ok = false;
    RANK_EXPECT(s, !tp_tensor_is_dtensor(y), "W=%d: the output is a DTensor", w);
    RANK_OK(s, tp_tensor_allclose(y, yr, ATT_RTOL, ATT_ATOL, &ok));
    RANK_EXPECT(s, ok, "W=%d H=%d: output differs from the single-rank block", w, heads);
    RANK_OK(s, tp_tensor_allclose(tp_tensor_grad(x), tp_tensor_grad(xr), ATT_RTOL, ATT_ATOL,
                                  &ok));
    RANK_EXPECT(s, ok, "W=%d H=%d: x's gradient differs", w, heads);
    const char *const names[4] = {"wq", "wk", "wv", "wo"};
    for (int i = 0; i < 4; i++) {
        tp_tensor *pw = tp_module_parameter(tp_module_child(par, names[i]), "weight");
        tp_tensor *rw = tp_module_parameter(tp_module_child(ref, names[i]), "weight");
        tp_tensor *gf = NULL;
        RANK_EXPECT(s, tp_tensor_grad(pw) != NULL, "W=%d: %s got no gradient", w, names[i]);
        if (!tp_tensor_grad(pw))
            continue;
        RANK_OK(s, tp_dtensor_full_tensor(tp_tensor_grad(pw), &gf));
        RANK_OK(s, tp_tensor_allclose(gf, tp_tensor_grad(rw), ATT_RTOL, ATT_ATOL, &ok));
        RANK_EXPECT(s, ok, "W=%d H=%d: %s's gradient differs", w, heads, names[i]);
        tp_tensor_release(gf);
    }
    tp_tensor_release(x);
    tp_tensor_release(xr);
    tp_tensor_release(xd);
    tp_tensor_release(g);
    tp_tensor_release(y);
    tp_tensor_release(yr);
    tp_module_free(par);
    tp_module_free(ref);
    tp_mesh_free(mesh);
    return TP_OK;
}

ParameterizedTestParameters(ops_view, attention_block)
{
    static attn_param params[] = {{1, 4}, {2, 4}, {4, 4}, {3, 3}, {3, 6}, {8, 8}};
    return cr_make_param_array(attn_param, params, NCASES(params));
}

ParameterizedTest(attn_param *ap, ops_view, attention_block, .timeout = 120)
{
    attn_ctx c;
    memset(&c, 0, sizeof c);
    c.p = *ap;
    tp_test_run(ap->w, attn_rank, &c, c.slot);
}

/* ---- narrow ------------------------------------------------------------------------- */

/* y = x[..., start:start+len, ...] along dim, and the gradient: g in the
 * slice, zeros elsewhere (index loops) */
Test(ops_view, plain_narrow, .timeout = 30)
{
    const int64_t shape[3] = {3, 5, 4};
    for (int dim = 0; dim < 3; dim++) {
        const int64_t start = 1, len = shape[dim] - 2;
        tp_tensor *x = rand_t(3, shape, 11), *y = NULL, *g = NULL;
        CHECK_OK(tp_tensor_set_requires_grad(x, true));
        CHECK_OK(tp_narrow(x, dim - 3, start, len, &y)); /* negative dims count from the end */
        int64_t ys[3] = {shape[0], shape[1], shape[2]};
        ys[dim] = len;
        expect_shape(y, 3, ys, "narrow");
        CHECK_OK(tp_test_global_tensor(3, ys, 12, &g));
        CHECK_OK(tp_backward(y, g));
        const float *xv = tp_tensor_data(x), *yv = tp_tensor_data(y), *gv = tp_tensor_data(g),
                    *gx = tp_tensor_data(tp_tensor_grad(x));
        for (int64_t i = 0; i < shape[0]; i++)
            for (int64_t j = 0; j < shape[1]; j++)
                for (int64_t k = 0; k < shape[2]; k++) {
                    int64_t idx[3] = {i, j, k}, o = idx[dim] - start;
                    bool in = o >= 0 && o < len;
                    idx[dim] = o;
                    int64_t yi = (idx[0] * ys[1] + idx[1]) * ys[2] + idx[2],
                            xi = (i * shape[1] + j) * shape[2] + k;
                    if (in)
                        cr_assert_eq(yv[yi], xv[xi], "dim %d: y at %lld", dim, (long long)yi);
                    cr_assert_eq(gx[xi], in ? gv[yi] : 0.0f, "dim %d: dx at %lld", dim,
                                 (long long)xi);
                }
        tp_tensor_release(g);
        tp_tensor_release(y);
        tp_tensor_release(x);
    }
    tp_tensor *x = rand_t(3, shape, 1), *y = NULL;
    CHECK_ERR(tp_narrow(x, 1, 3, 3, &y), TP_ERR_INVALID_ARG);
    cr_assert_not_null(strstr(tp_last_error(), "[3, 6)"), "%s", tp_last_error());
    CHECK_ERR(tp_narrow(x, 3, 0, 1, &y), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_narrow(x, 0, -1, 1, &y), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_narrow(NULL, 0, 0, 1, &y), TP_ERR_INVALID_ARG);
    cr_assert_null(y);
    CHECK_OK(tp_narrow(x, 2, 4, 0, &y)); /* an empty slice */
    cr_assert_eq(tp_tensor_numel(y), 0);
    tp_tensor_release(y);
    tp_tensor_release(x);
}

/* On DTensors: a shard of another dim passes with no collective; a shard of
 * the narrowed dim is gathered first (one all_gather forward, none
 * backward: the gather's backward takes the local chunk); values and
 * gradients equal the plain op's. */
typedef struct {
    int n;
    tp_test_slot slot[TP_TEST_MAX_RANKS];
} narrow_run;

static tp_status narrow_rank(tp_comm *w, void *arg)
{
    narrow_run *run = arg;
    tp_test_slot *s = &run->slot[tp_comm_rank(w)];
    tp_mesh *mesh = NULL;
    const int64_t n = run->n, shape[3] = {6, 7, 4}, ys[3] = {6, 3, 4};
    RANK_OK(s, tp_mesh_create(w, 1, &n, NULL, &mesh));
    for (int sd = 0; sd < 3; sd++) {
        tp_tensor *full = NULL, *x = NULL, *y = NULL, *yf = NULL, *ref = NULL, *g = NULL,
                  *dg = NULL, *gxf = NULL, *px = NULL;
        RANK_OK(s, tp_test_global_tensor(3, shape, 21, &full));
        const tp_placement pl[1] = {sd == 2 ? tp_replicate() : tp_shard(sd == 0 ? 0 : 1)};
        RANK_OK(s, tp_dtensor_distribute(mesh, full, 1, pl, -1, &x));
        RANK_OK(s, tp_tensor_set_requires_grad(x, true));
        tp_comm_debug *dbg = NULL;
        RANK_OK(s, tp_comm_debug_create(&dbg));
        RANK_OK(s, tp_comm_debug_begin(dbg));
        RANK_OK(s, tp_narrow(x, 1, 2, 3, &y));
        RANK_OK(s, tp_comm_debug_end(dbg));
        const int64_t want_ag = sd == 1 && n > 1 ? 1 : 0;
        RANK_EXPECT(s, tp_comm_debug_count(dbg, TP_COLL_ALL_GATHER) == want_ag &&
                           tp_comm_debug_total(dbg) == want_ag,
                    "shard dim %d: %lld collectives, want %lld all_gather", sd,
                    (long long)tp_comm_debug_total(dbg), (long long)want_ag);
        const tp_placement want_out = sd == 0 ? tp_shard(0) : tp_replicate();
        RANK_EXPECT(s, tp_test_placement_eq(tp_dtensor_placements(y)[0], want_out),
                    "shard dim %d: output placement", sd);
        RANK_OK(s, tp_dtensor_full_tensor(y, &yf));
        RANK_OK(s, tp_tensor_clone(full, &px));
        RANK_OK(s, tp_narrow(px, 1, 2, 3, &ref));
        bool eq = false;
        RANK_OK(s, tp_tensor_equal(yf, ref, &eq));
        RANK_EXPECT(s, eq, "shard dim %d: values differ from the plain op", sd);
        /* backward: the gradient in x's layout, the slice of g, zeros elsewhere */
        RANK_OK(s, tp_test_global_tensor(3, ys, 22, &g));
        RANK_OK(s, tp_dtensor_distribute(mesh, g, 1, tp_dtensor_placements(y), -1, &dg));
        RANK_OK(s, tp_comm_debug_begin(dbg));
        RANK_OK(s, tp_backward(y, dg));
        RANK_OK(s, tp_comm_debug_end(dbg));
        /* the gather's backward takes the local chunk: no collective */
        RANK_EXPECT(s, tp_comm_debug_total(dbg) == 0, "shard dim %d: backward %lld collectives",
                    sd, (long long)tp_comm_debug_total(dbg));
        RANK_OK(s, tp_dtensor_full_tensor(tp_tensor_grad(x), &gxf));
        const float *gv = tp_tensor_data(g), *gx = tp_tensor_data(gxf);
        for (int64_t i = 0; i < 6 * 7 * 4; i++) {
            int64_t j = i / 4 % 7;
            float want = j >= 2 && j < 5 ? gv[(i / 28 * 3 + (j - 2)) * 4 + i % 4] : 0.0f;
            RANK_EXPECT(s, gx[i] == want, "shard dim %d: dx[%lld] %g, want %g", sd, (long long)i,
                        (double)gx[i], (double)want);
        }
        tp_tensor *all[] = {full, x, y, yf, ref, g, dg, gxf, px};
        for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
            tp_tensor_release(all[i]);
        tp_comm_debug_free(dbg);
    }
    tp_mesh_free(mesh);
    return TP_OK;
}

ParameterizedTestParameters(ops_view, narrow_distributed)
{
    static int worlds[] = {1, 2, 3, 4};
    return cr_make_param_array(int, worlds, 4);
}

ParameterizedTest(int *n, ops_view, narrow_distributed, .timeout = 60)
{
    narrow_run run = {.n = *n};
    tp_test_run(*n, narrow_rank, &run, run.slot);
}
