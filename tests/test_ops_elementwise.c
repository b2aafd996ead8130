/* Elementwise and shape ops (add, mul, scale, relu, gelu, dropout, reshape,
 * transpose).
 *
 * On DTensors every op equals the single-rank computation on plain tensors,
 * forward (full_tensor) and every input gradient, for each sharding strategy
 * and for layouts that need redistribution, on 1-D meshes of 1..4 ranks and on
 * 2x2 and 2x3 meshes, with uneven shapes (including a dim smaller than the
 * mesh). Inputs are small integers (Partial inputs are split into integer
 * terms), so the comparison is exact for every op but gelu, which is compared
 * with tp_tensor_allclose(rtol 1e-5, atol 1e-6). The plain ops themselves are
 * checked against hand-written loops, gelu against the double-precision
 * formulas (rtol 1e-5, atol 1e-6). */
#include <math.h>

#include "tp_test_dtensor.h"

/* ---- building inputs ---------------------------------------------------------- */

/* ---- one comparison case -------------------------------------------------------- */

typedef enum {
    OP_ADD,
    OP_MUL,
    OP_SCALE,
    OP_RELU,
    OP_GELU,
    OP_DROPOUT,
    OP_RESHAPE,
    OP_TRANSPOSE
} op_kind;

typedef struct ew_case {
    const char *label;
    op_kind kind;
    int n_in;
    int nd[2];
    int64_t shape[2][4];
    /* [input][mesh dim]: 2-D meshes use both, 1-D meshes the second */
    tp_placement pl[2][2];
    bool check_out;      /* the output placements must be `out` */
    tp_placement out[2]; /* same indexing as pl */
    bool no_comm;        /* the forward issues no collective */
    /* exact collective counts on meshes of more than one rank (same indexing
     * as pl: 2-D meshes the first, 1-D the second): forward, and backward
     * from the DTensor output (needs bwd_direct) */
    bool check_coll;
    int coll[2], bwd_coll[2];
    /* backward from the DTensor output with a gradient of its placements
     * (not through full_tensor); the output must not be Partial */
    bool bwd_direct;
    bool check_grad;        /* the gradients' placements must be `grad` */
    tp_placement grad[2][2]; /* [input][mesh dim], indexed as pl */
    double tol;          /* 0: exact; else allclose(tol, tol / 10) */
    /* op parameters */
    double s;                /* scale */
    tp_gelu_approx approx;   /* gelu */
    double p;                /* dropout */
    bool training;           /* dropout */
    int rnd;                 /* reshape */
    int64_t rshape[4];       /* reshape */
    int d0, d1;              /* transpose */
} ew_case;

static tp_status apply(const ew_case *c, tp_tensor *a, tp_tensor *b, tp_tensor **y)
{
    switch (c->kind) {
    case OP_ADD: return tp_add(a, b, y);
    case OP_MUL: return tp_mul(a, b, y);
    case OP_SCALE: return tp_scale(a, c->s, y);
    case OP_RELU: return tp_relu(a, y);
    case OP_GELU: return tp_gelu(a, c->approx, y);
    case OP_DROPOUT: return tp_dropout(a, c->p, 1234, c->training, y);
    case OP_RESHAPE: return tp_reshape(a, c->rnd, c->rshape, y);
    case OP_TRANSPOSE: return tp_transpose(a, c->d0, c->d1, y);
    }
    return TP_ERR_INVALID_ARG;
}

static tp_status same_values(const ew_case *c, const tp_tensor *x, const tp_tensor *ref, bool *ok)
{
    if (c->tol > 0)
        return tp_tensor_allclose(x, ref, c->tol, c->tol / 10, ok);
    return tp_tensor_equal(x, ref, ok);
}

/* Runs the case on plain tensors and on DTensors; compares y and the grads. */
static tp_status check_case(tp_test_slot *s, tp_mesh *mesh, const ew_case *cs)
{
    static const char *names[] = {"add",     "mul",     "scale",   "relu",
                                  "gelu",    "dropout", "reshape", "transpose"};
    ew_case lc = *cs; /* the label prefixed with the op's name */
    const ew_case *c = &lc;
    int m = tp_mesh_ndim(mesh), first = m == 1 ? 1 : 0;
    char label[160];
    if (m == 1)
        snprintf(label, sizeof label, "%s %s (mesh %lld)", names[cs->kind], cs->label,
                 (long long)tp_mesh_size(mesh, 0));
    else
        snprintf(label, sizeof label, "%s %s (mesh %lldx%lld)", names[cs->kind], cs->label,
                 (long long)tp_mesh_size(mesh, 0), (long long)tp_mesh_size(mesh, 1));
    lc.label = label;
    tp_tensor *full[2] = {0}, *dt[2] = {0}, *yp = NULL, *yd = NULL, *yfull = NULL, *g = NULL;
    for (int i = 0; i < c->n_in; i++) {
        RANK_OK(s, tp_test_global_tensor(c->nd[i], c->shape[i], 100 + (uint64_t)i, &full[i]));
        RANK_OK(s, tp_test_make_dtensor(mesh, full[i], &c->pl[i][first], 200 + (uint64_t)i, &dt[i]));
        RANK_OK(s, tp_tensor_set_requires_grad(full[i], true));
        RANK_OK(s, tp_tensor_set_requires_grad(dt[i], true));
    }
    /* reference */
    RANK_OK(s, apply(c, full[0], full[1], &yp));
    RANK_OK(s, tp_test_global_tensor(tp_tensor_ndim(yp), tp_tensor_shape(yp), 7, &g));
    RANK_OK(s, tp_backward(yp, g));
    /* distributed */
    tp_comm_debug *dbg = NULL;
    RANK_OK(s, tp_comm_debug_create(&dbg));
    RANK_OK(s, tp_comm_debug_begin(dbg));
    tp_status st = apply(c, dt[0], dt[1], &yd);
    RANK_OK(s, tp_comm_debug_end(dbg));
    RANK_OK(s, st);
    int64_t ncoll = tp_comm_debug_total(dbg);
    tp_comm_debug_free(dbg);
    RANK_EXPECT(s, !c->no_comm || ncoll == 0, "%s: the forward issued %lld collectives, expected 0",
                c->label, (long long)ncoll);
    bool several = tp_mesh_size(mesh, 0) * (m > 1 ? tp_mesh_size(mesh, 1) : 1) > 1;
    RANK_EXPECT(s, !c->check_coll || !several || ncoll == c->coll[first],
                "%s: the forward issued %lld collectives, expected %d", c->label,
                (long long)ncoll, c->coll[first]);
    if (c->check_out) {
        const tp_placement *got = tp_dtensor_placements(yd);
        /* a mesh dim of size 1 moves nothing whatever its placement: the
         * dispatcher's choice there is a tie */
        for (int d = 0; d < m; d++) {
            if (tp_mesh_size(mesh, d) == 1)
                continue;
            char b1[32], b2[32];
            RANK_EXPECT(s, tp_test_placement_eq(got[d], c->out[first + d]),
                        "%s: output placement on mesh dim %d is %s, expected %s", c->label, d,
                        tp_placement_str(got[d], b1, sizeof b1),
                        tp_placement_str(c->out[first + d], b2, sizeof b2));
        }
    }
    RANK_OK(s, tp_dtensor_full_tensor(yd, &yfull));
    if (c->bwd_direct) {
        tp_tensor *gd = NULL;
        RANK_OK(s, tp_dtensor_distribute(mesh, g, m, tp_dtensor_placements(yd), -1, &gd));
        RANK_OK(s, tp_comm_debug_create(&dbg));
        RANK_OK(s, tp_comm_debug_begin(dbg));
        st = tp_backward(yd, gd);
        RANK_OK(s, tp_comm_debug_end(dbg));
        RANK_OK(s, st);
        ncoll = tp_comm_debug_total(dbg);
        tp_comm_debug_free(dbg);
        tp_tensor_release(gd);
        RANK_EXPECT(s, !c->check_coll || !several || ncoll == c->bwd_coll[first],
                    "%s: the backward issued %lld collectives, expected %d", c->label,
                    (long long)ncoll, c->bwd_coll[first]);
    } else {
        RANK_OK(s, tp_backward(yfull, g));
    }
    bool ok = false;
    RANK_OK(s, same_values(c, yfull, yp, &ok));
    RANK_EXPECT(s, ok, "%s: output differs from the single-rank result", c->label);
    for (int i = 0; i < c->n_in; i++) {
        tp_tensor *gd = tp_tensor_grad(dt[i]), *gf = NULL;
        RANK_EXPECT(s, gd != NULL, "%s: input %d got no gradient", c->label, i);
        if (!gd)
            continue;
        for (int d = 0; c->check_grad && d < m; d++) {
            if (tp_mesh_size(mesh, d) == 1)
                continue;
            char b1[32], b2[32];
            tp_placement got = tp_dtensor_placements(gd)[d], want = c->grad[i][first + d];
            RANK_EXPECT(s, tp_test_placement_eq(got, want),
                        "%s: gradient of input %d on mesh dim %d is %s, expected %s", c->label,
                        i, d, tp_placement_str(got, b1, sizeof b1),
                        tp_placement_str(want, b2, sizeof b2));
        }
        RANK_OK(s, tp_dtensor_full_tensor(gd, &gf));
        RANK_OK(s, same_values(c, gf, tp_tensor_grad(full[i]), &ok));
        RANK_EXPECT(s, ok, "%s: gradient of input %d differs", c->label, i);
        tp_tensor_release(gf);
    }
    for (int i = 0; i < 2; i++) {
        tp_tensor_release(full[i]);
        tp_tensor_release(dt[i]);
    }
    tp_tensor_release(yp);
    tp_tensor_release(yd);
    tp_tensor_release(yfull);
    tp_tensor_release(g);
    return TP_OK;
}

/* ---- the mesh runner --------------------------------------------------------- */

typedef struct ew_ctx ew_ctx;
typedef tp_status (*ew_body_fn)(tp_test_slot *s, tp_mesh *mesh, ew_ctx *c);

struct ew_ctx {
    int mesh_ndim;
    int64_t mesh_shape[2];
    ew_body_fn body;
    tp_test_slot slot[TP_TEST_MAX_RANKS];
};

static tp_status ew_rank(tp_comm *w, void *arg)
{
    ew_ctx *c = arg;
    tp_test_slot *s = &c->slot[tp_comm_rank(w)];
    tp_mesh *mesh = NULL;
    RANK_OK(s, tp_mesh_create(w, c->mesh_ndim, c->mesh_shape, NULL, &mesh));
    tp_status st = c->body(s, mesh, c);
    tp_mesh_free(mesh);
    return st;
}

typedef struct {
    int ndim;
    int64_t shape[2];
} ew_mesh;

static void run_on_mesh(const ew_mesh *em, ew_body_fn body)
{
    ew_ctx c = {.mesh_ndim = em->ndim, .mesh_shape = {em->shape[0], em->shape[1]}, .body = body};
    memset(c.slot, 0, sizeof c.slot);
    tp_test_run((int)(em->shape[0] * (em->ndim > 1 ? em->shape[1] : 1)), ew_rank, &c, c.slot);
}

static tp_status run_cases(tp_test_slot *s, tp_mesh *mesh, const ew_case *cases, size_t n)
{
    for (size_t k = 0; k < n; k++)
        TP_TEST_TRY(check_case(s, mesh, &cases[k]));
    return TP_OK;
}

#define NCASES(a) (sizeof(a) / sizeof((a)[0]))

/* Placements used by the case tables. */
#define R_ tp_replicate()
#define P_ tp_partial(TP_SUM)
#define S_(d) tp_shard(d)

/* a, b: [5, 3, 7] (uneven on every mesh) */
#define SAME2 .n_in = 2, .nd = {3, 3}, .shape = {{5, 3, 7}, {5, 3, 7}}
/* a [5, 3, 7], b [7] */
#define BCAST2 .n_in = 2, .nd = {3, 1}, .shape = {{5, 3, 7}, {7}}
/* a [2, 9]: dim 0 smaller than the 3- and 4-rank meshes; b [9] */
#define SMALL2 .n_in = 2, .nd = {2, 1}, .shape = {{2, 9}, {9}}
#define X1 .n_in = 1, .nd = {3}, .shape = {{5, 3, 7}}

/* ---- add and mul ---------------------------------------------------------------- */

static tp_status binary_cases(tp_test_slot *s, tp_mesh *mesh, op_kind k)
{
    ew_case cases[] = {
        /* same shape */
        {"S(0)+S(0)", k, SAME2, .pl = {{S_(1), S_(0)}, {S_(1), S_(0)}}, .check_out = true,
         .out = {S_(1), S_(0)}, .no_comm = true},
        {"S(2)+S(2)", k, SAME2, .pl = {{S_(0), S_(2)}, {S_(0), S_(2)}}, .check_out = true,
         .out = {S_(0), S_(2)}, .no_comm = true},
        {"nested S(0) S(0)", k, SAME2, .pl = {{S_(0), S_(0)}, {S_(0), S_(0)}},
         .check_out = true, .out = {S_(0), S_(0)}, .no_comm = true},
        {"R+R", k, SAME2, .pl = {{R_, R_}, {R_, R_}}, .check_out = true, .out = {R_, R_},
         .no_comm = true},
        {"P+R", k, SAME2, .pl = {{S_(0), P_}, {S_(0), R_}}, .check_out = true,
         .out = {S_(0), P_}, .no_comm = true},
        {"R+P", k, SAME2, .pl = {{R_, R_}, {R_, P_}}, .check_out = true, .out = {R_, P_},
         .no_comm = true},
        {"P on different mesh dims", k, SAME2, .pl = {{P_, R_}, {R_, P_}}, .check_out = true,
         .out = {P_, P_}, .no_comm = true},
        {"P+P", k, SAME2, .pl = {{S_(1), P_}, {S_(1), P_}}},
        {"S(0)+S(1) (redistributes)", k, SAME2, .pl = {{R_, S_(0)}, {S_(2), S_(1)}}},
        {"S(1)+R (b chunked locally)", k, SAME2, .pl = {{S_(0), S_(1)}, {R_, R_}},
         .check_out = true, .out = {S_(0), S_(1)}, .no_comm = true},
        {"P+S(1) (redistributes)", k, SAME2, .pl = {{R_, P_}, {R_, S_(1)}}},
        /* b broadcast over the rows */
        {"bcast S(0)+R", k, BCAST2, .pl = {{S_(1), S_(0)}, {R_, R_}}, .check_out = true,
         .out = {S_(1), S_(0)}, .no_comm = true},
        {"bcast S(2)+S(0)", k, BCAST2, .pl = {{S_(0), S_(2)}, {R_, S_(0)}},
         .check_out = true, .out = {S_(0), S_(2)}, .no_comm = true},
        {"bcast nested S(2)+S(0)", k, BCAST2, .pl = {{S_(2), S_(2)}, {S_(0), S_(0)}},
         .check_out = true, .out = {S_(2), S_(2)}, .no_comm = true},
        {"bcast R+R", k, BCAST2, .pl = {{R_, R_}, {R_, R_}}, .no_comm = true},
        {"bcast P+R", k, BCAST2, .pl = {{S_(0), P_}, {R_, R_}}, .check_out = true,
         .out = {S_(0), P_}, .no_comm = true},
        {"bcast R+P", k, BCAST2, .pl = {{S_(1), R_}, {R_, P_}}, .check_out = true,
         .out = {S_(1), P_}, .no_comm = true},
        {"bcast P+P", k, BCAST2, .pl = {{R_, P_}, {R_, P_}}},
        {"bcast S(1)+S(0) (b gathered)", k, BCAST2, .pl = {{S_(0), S_(1)}, {R_, S_(0)}},
         .check_out = true, .out = {S_(0), S_(1)}},
        {"bcast S(2)+R (b chunked)", k, BCAST2, .pl = {{R_, S_(2)}, {R_, R_}},
         .check_out = true, .out = {R_, S_(2)}, .no_comm = true},
        {"small S(0)+R", k, SMALL2, .pl = {{S_(0), S_(0)}, {R_, R_}}, .check_out = true,
         .out = {S_(0), S_(0)}, .no_comm = true},
        {"small S(1)+S(0)", k, SMALL2, .pl = {{S_(0), S_(1)}, {R_, S_(0)}},
         .check_out = true, .out = {S_(0), S_(1)}, .no_comm = true},
    };
    return run_cases(s, mesh, cases, NCASES(cases));
}

static tp_status add_body(tp_test_slot *s, tp_mesh *mesh, ew_ctx *c)
{
    (void)c;
    return binary_cases(s, mesh, OP_ADD);
}

static tp_status mul_body(tp_test_slot *s, tp_mesh *mesh, ew_ctx *c)
{
    (void)c;
    return binary_cases(s, mesh, OP_MUL);
}

/* ---- broadcasting ----------------------------------------------------------------
 * B, S, D = 5, 3, 7 (uneven on every mesh). The output sharded on a dim takes
 * the operands that have it sharded alike and the ones broadcast along it
 * replicated, with no collective; the gradient of an operand broadcast along a
 * sharded dim is a partial sum (Partial(sum)), as in PyTorch 2.15.
 *
 * PyTorch 2.15 (CommDebugMode, gloo, 4 ranks and a 2x2 mesh) gives the same
 * output and gradient placements and 0 collectives forward and backward for
 * every "no comm" case below, for add and mul. Where it redistributes:
 * [5,1,7] S(0) + [1,3,1] S(1): 1 all_gather forward, as here; backward it
 * keeps b's gradient Partial (0 for add, 1 all_gather for mul) where libtp
 * returns it to b's S(1) with 1 reduce_scatter. [5,3,7] S(1) + [3,7] S(1):
 * 1 collective forward both; PyTorch moves a to S(2) (gloo has no all_to_all:
 * an all_gather), libtp the smaller b to S(0) with 1 all_to_all, and 1 all_to_all
 * back in the backward, where PyTorch leaves b's gradient S(0). */

#define BSD_SD .n_in = 2, .nd = {3, 2}, .shape = {{5, 3, 7}, {3, 7}}
#define SD_BSD .n_in = 2, .nd = {2, 3}, .shape = {{3, 7}, {5, 3, 7}}
#define B1D_1S1 .n_in = 2, .nd = {3, 3}, .shape = {{5, 1, 7}, {1, 3, 1}}
#define BSD_SCALAR .n_in = 2, .nd = {3, 0}, .shape = {{5, 3, 7}, {0}}
#define SCALAR_BSD .n_in = 2, .nd = {0, 3}, .shape = {{0}, {5, 3, 7}}
#define SCALARS .n_in = 2, .nd = {0, 0}, .shape = {{0}, {0}}
/* the output [0, 3, 7]: a broadcast along the empty dim */
#define EMPTY_OUT .n_in = 2, .nd = {3, 3}, .shape = {{1, 3, 7}, {0, 1, 7}}
/* an empty dim in the sharded operand */
#define EMPTY_IN .n_in = 2, .nd = {3, 2}, .shape = {{4, 0, 7}, {1, 7}}
/* a [2, 1] column (dim 0 smaller than most meshes) times a [1, 9] row */
#define COL_ROW .n_in = 2, .nd = {2, 2}, .shape = {{2, 1}, {1, 9}}

/* no collective forward or backward */
#define QUIET .no_comm = true, .check_coll = true, .bwd_direct = true

static tp_status bcast_cases(tp_test_slot *s, tp_mesh *mesh, op_kind k)
{
    ew_case cases[] = {
        {"[B,S,D] S(1) + [S,D] S(0)", k, BSD_SD, .pl = {{S_(0), S_(1)}, {R_, S_(0)}},
         .check_out = true, .out = {S_(0), S_(1)}, QUIET, .check_grad = true,
         .grad = {{S_(0), S_(1)}, {P_, S_(0)}}},
        {"[S,D] S(0) + [B,S,D] S(1)", k, SD_BSD, .pl = {{R_, S_(0)}, {S_(0), S_(1)}},
         .check_out = true, .out = {S_(0), S_(1)}, QUIET, .check_grad = true,
         .grad = {{P_, S_(0)}, {S_(0), S_(1)}}},
        {"[B,S,D] S(2) + [D] S(0)", k, BCAST2, .pl = {{S_(1), S_(2)}, {R_, S_(0)}},
         .check_out = true, .out = {S_(1), S_(2)}, QUIET, .check_grad = true,
         .grad = {{S_(1), S_(2)}, {P_, S_(0)}}},
        {"[B,S,D] S(0) + [S,D] R", k, BSD_SD, .pl = {{S_(2), S_(0)}, {S_(1), R_}},
         .check_out = true, .out = {S_(2), S_(0)}, QUIET, .check_grad = true,
         .grad = {{S_(2), S_(0)}, {S_(1), P_}}},
        {"[S,D] R + [B,S,D] S(0)", k, SD_BSD, .pl = {{S_(0), R_}, {S_(1), S_(0)}},
         .check_out = true, .out = {S_(1), S_(0)}, QUIET, .check_grad = true,
         .grad = {{S_(0), P_}, {S_(1), S_(0)}}},
        {"[B,1,D] S(0) + [1,S,1] R", k, B1D_1S1, .pl = {{S_(2), S_(0)}, {R_, R_}},
         .check_out = true, .out = {S_(2), S_(0)}, QUIET, .check_grad = true,
         .grad = {{S_(2), S_(0)}, {P_, P_}}},
        {"[B,1,D] R + nested [1,S,1] S(1)", k, B1D_1S1, .pl = {{R_, R_}, {S_(1), S_(1)}},
         .check_out = true, .out = {S_(1), S_(1)}, QUIET, .check_grad = true,
         .grad = {{P_, P_}, {S_(1), S_(1)}}},
        {"[B,S,D] S(1) + scalar R", k, BSD_SCALAR, .pl = {{S_(0), S_(1)}, {R_, R_}},
         .check_out = true, .out = {S_(0), S_(1)}, QUIET, .check_grad = true,
         .grad = {{S_(0), S_(1)}, {P_, P_}}},
        {"scalar R + [B,S,D] S(2)", k, SCALAR_BSD, .pl = {{R_, R_}, {S_(2), S_(2)}},
         .check_out = true, .out = {S_(2), S_(2)}, QUIET, .check_grad = true,
         .grad = {{P_, P_}, {S_(2), S_(2)}}},
        {"[2,1] S(0) * [1,9] R (dim 0 smaller than the mesh)", k, COL_ROW,
         .pl = {{S_(0), S_(0)}, {R_, R_}}, .check_out = true, .out = {S_(0), S_(0)}, QUIET,
         .check_grad = true, .grad = {{S_(0), S_(0)}, {P_, P_}}},
        {"[2,1] R * [1,9] S(1)", k, COL_ROW, .pl = {{R_, R_}, {S_(1), S_(1)}},
         .check_out = true, .out = {S_(1), S_(1)}, QUIET, .check_grad = true,
         .grad = {{P_, P_}, {S_(1), S_(1)}}},
        /* empty dims: the gradient of the operand broadcast over the empty
         * dim is zeros */
        {"[1,S,D] S(1) + [0,1,D] R", k, EMPTY_OUT, .pl = {{S_(2), S_(1)}, {S_(2), R_}},
         .check_out = true, .out = {S_(2), S_(1)}, QUIET, .check_grad = true,
         .grad = {{S_(2), S_(1)}, {S_(2), P_}}},
        {"[4,0,D] S(0) + [1,D] R", k, EMPTY_IN, .pl = {{S_(2), S_(0)}, {S_(1), R_}},
         .check_out = true, .out = {S_(2), S_(0)}, QUIET, .check_grad = true,
         .grad = {{S_(2), S_(0)}, {S_(1), P_}}},
        /* Partial operands with broadcasting */
        {"[B,S,D] P + [D] R", k, BCAST2, .pl = {{S_(1), P_}, {R_, R_}}, .check_out = true,
         .out = {S_(1), P_}, .no_comm = true},
        {"scalar P + [B,S,D] R", k, SCALAR_BSD, .pl = {{R_, P_}, {S_(0), R_}},
         .check_out = true, .out = {S_(0), P_}, .no_comm = true},
        {"scalar R + scalar P", k, SCALARS, .pl = {{P_, R_}, {R_, P_}}, .check_out = true,
         .out = {P_, P_}, .no_comm = true},
        {"[S,D] P + [B,S,D] P", k, SD_BSD, .pl = {{R_, P_}, {R_, P_}}},
        /* redistribution: the smaller operand moves */
        {"[B,1,D] S(0) + [1,S,1] S(1) (b gathered)", k, B1D_1S1,
         .pl = {{R_, S_(0)}, {R_, S_(1)}}, .check_out = true, .out = {R_, S_(0)},
         .check_coll = true, .coll = {1, 1}, .bwd_coll = {1, 1}, .bwd_direct = true,
         .check_grad = true, .grad = {{R_, S_(0)}, {R_, S_(1)}}},
        {"[B,S,D] S(1) + [S,D] S(1) (b to S(0))", k, BSD_SD,
         .pl = {{R_, S_(1)}, {R_, S_(1)}}, .check_out = true, .out = {R_, S_(1)},
         .check_coll = true, .coll = {1, 1}, .bwd_coll = {1, 1}, .bwd_direct = true,
         .check_grad = true, .grad = {{R_, S_(1)}, {R_, S_(1)}}},
    };
    return run_cases(s, mesh, cases, NCASES(cases));
}

static tp_status bcast_body(tp_test_slot *s, tp_mesh *mesh, ew_ctx *c)
{
    (void)c;
    TP_TEST_TRY(bcast_cases(s, mesh, OP_ADD));
    return bcast_cases(s, mesh, OP_MUL);
}

/* ---- scale, relu, gelu ---------------------------------------------------------- */

static tp_status unary_body(tp_test_slot *s, tp_mesh *mesh, ew_ctx *c)
{
    (void)c;
    const tp_placement PMAX = tp_partial(TP_MAX), PMIN = tp_partial(TP_MIN);
    ew_case cases[] = {
        {"S(1) by 0.5", OP_SCALE, X1, .pl = {{S_(0), S_(1)}}, .check_out = true,
         .out = {S_(0), S_(1)}, .no_comm = true, .s = 0.5},
        {"R by -2", OP_SCALE, X1, .pl = {{R_, R_}}, .check_out = true, .out = {R_, R_},
         .no_comm = true, .s = -2},
        {"P by 4", OP_SCALE, X1, .pl = {{S_(2), P_}}, .check_out = true,
         .out = {S_(2), P_}, .no_comm = true, .s = 4},
        {"P(max) by 2", OP_SCALE, X1, .pl = {{R_, PMAX}}, .check_out = true,
         .out = {R_, PMAX}, .no_comm = true, .s = 2},
        {"P(max) by -0.25 (P(min))", OP_SCALE, X1, .pl = {{S_(0), PMAX}},
         .check_out = true, .out = {S_(0), PMIN}, .no_comm = true, .s = -0.25},
        {"S(0)", OP_RELU, X1, .pl = {{S_(1), S_(0)}}, .check_out = true,
         .out = {S_(1), S_(0)}, .no_comm = true},
        {"nested S(2)", OP_RELU, X1, .pl = {{S_(2), S_(2)}}, .check_out = true,
         .out = {S_(2), S_(2)}, .no_comm = true},
        {"R", OP_RELU, X1, .pl = {{R_, R_}}, .check_out = true, .out = {R_, R_},
         .no_comm = true},
        {"P (reduced first)", OP_RELU, X1, .pl = {{S_(1), P_}}},
        {"exact S(1)", OP_GELU, X1, .pl = {{S_(0), S_(1)}}, .check_out = true,
         .out = {S_(0), S_(1)}, .no_comm = true, .tol = 1e-5, .approx = TP_GELU_EXACT},
        {"tanh S(2)", OP_GELU, X1, .pl = {{R_, S_(2)}}, .check_out = true,
         .out = {R_, S_(2)}, .no_comm = true, .tol = 1e-5, .approx = TP_GELU_TANH},
        {"exact R", OP_GELU, X1, .pl = {{R_, R_}}, .no_comm = true, .tol = 1e-5,
         .approx = TP_GELU_EXACT},
        {"tanh P (reduced first)", OP_GELU, X1, .pl = {{P_, R_}}, .tol = 1e-5,
         .approx = TP_GELU_TANH},
        {"exact small S(0)", OP_GELU, .n_in = 1, .nd = {2}, .shape = {{2, 9}},
         .pl = {{S_(1), S_(0)}}, .check_out = true, .out = {S_(1), S_(0)}, .no_comm = true,
         .tol = 1e-5, .approx = TP_GELU_EXACT},
    };
    return run_cases(s, mesh, cases, NCASES(cases));
}

/* ---- dropout ------------------------------------------------------------------- */

static tp_status dropout_body(tp_test_slot *s, tp_mesh *mesh, ew_ctx *c)
{
    (void)c;
    /* p = 0.5 scales by exactly 2; p = 0.3 by the same f32 factor everywhere */
    ew_case cases[] = {
        {"S(0)", OP_DROPOUT, X1, .pl = {{S_(1), S_(0)}}, .check_out = true,
         .out = {S_(1), S_(0)}, .no_comm = true, .p = 0.5, .training = true},
        {"S(1)", OP_DROPOUT, X1, .pl = {{S_(2), S_(1)}}, .check_out = true,
         .out = {S_(2), S_(1)}, .no_comm = true, .p = 0.3, .training = true},
        {"S(2)", OP_DROPOUT, X1, .pl = {{R_, S_(2)}}, .check_out = true,
         .out = {R_, S_(2)}, .no_comm = true, .p = 0.5, .training = true},
        {"nested S(0)", OP_DROPOUT, X1, .pl = {{S_(0), S_(0)}}, .check_out = true,
         .out = {S_(0), S_(0)}, .no_comm = true, .p = 0.25, .training = true},
        {"R", OP_DROPOUT, X1, .pl = {{R_, R_}}, .check_out = true, .out = {R_, R_},
         .no_comm = true, .p = 0.5, .training = true},
        {"P (reduced first)", OP_DROPOUT, X1, .pl = {{S_(1), P_}}, .p = 0.5,
         .training = true},
        {"small S(0)", OP_DROPOUT, .n_in = 1, .nd = {2}, .shape = {{2, 9}},
         .pl = {{S_(1), S_(0)}}, .check_out = true, .out = {S_(1), S_(0)}, .no_comm = true,
         .p = 0.5, .training = true},
        {"eval P passes", OP_DROPOUT, X1, .pl = {{S_(0), P_}}, .check_out = true,
         .out = {S_(0), P_}, .no_comm = true, .p = 0.5, .training = false},
        {"p=0 S(1)", OP_DROPOUT, X1, .pl = {{R_, S_(1)}}, .check_out = true,
         .out = {R_, S_(1)}, .no_comm = true, .p = 0, .training = true},
    };
    return run_cases(s, mesh, cases, NCASES(cases));
}

/* ---- reshape and transpose ---------------------------------------------------- */

static tp_status shape_body(tp_test_slot *s, tp_mesh *mesh, ew_ctx *c)
{
    (void)c;
    ew_case cases[] = {
        /* dims 0..d kept: the shard passes through */
        {"[5,21] S(0)", OP_RESHAPE, X1, .pl = {{S_(0), S_(0)}}, .check_out = true,
         .out = {S_(0), S_(0)}, .no_comm = true, .rnd = 2, .rshape = {5, 21}},
        {"[5,3,7,1] S(2)", OP_RESHAPE, X1, .pl = {{S_(0), S_(2)}}, .check_out = true,
         .out = {S_(0), S_(2)}, .no_comm = true, .rnd = 4, .rshape = {5, 3, 7, 1}},
        {"[5,3,-1] S(1)", OP_RESHAPE, X1, .pl = {{S_(1), S_(1)}}, .check_out = true,
         .out = {S_(1), S_(1)}, .no_comm = true, .rnd = 3, .rshape = {5, 3, -1}},
        /* a shard whose dim merges is replicated first; a shard after merged
         * dims moves with its dim (S(2) of [5,3,7] is S(1) of [15,7]) */
        {"[15,7] S(2)->S(1), S(0) (replicated)", OP_RESHAPE, X1, .pl = {{S_(2), S_(0)}},
         .check_out = true, .out = {S_(1), R_}, .rnd = 2, .rshape = {15, 7}},
        {"[15,7] S(2)->S(1)", OP_RESHAPE, X1, .pl = {{S_(2), S_(2)}}, .check_out = true,
         .out = {S_(1), S_(1)}, .no_comm = true, .rnd = 2, .rshape = {15, 7}},
        {"[-1] S(1) (replicated)", OP_RESHAPE, X1, .pl = {{R_, S_(1)}},
         .check_out = true, .out = {R_, R_}, .rnd = 1, .rshape = {-1}},
        {"[5,7,3] S(0)+S(1)", OP_RESHAPE, X1, .pl = {{S_(0), S_(1)}},
         .check_out = true, .out = {S_(0), R_}, .rnd = 3, .rshape = {5, 7, 3}},
        {"[35,3] P", OP_RESHAPE, X1, .pl = {{R_, P_}}, .check_out = true,
         .out = {R_, P_}, .no_comm = true, .rnd = 2, .rshape = {35, 3}},
        {"[105] R", OP_RESHAPE, X1, .pl = {{R_, R_}}, .check_out = true,
         .out = {R_, R_}, .no_comm = true, .rnd = 1, .rshape = {105}},
        {"small [2,3,3] S(0)", OP_RESHAPE, .n_in = 1, .nd = {2}, .shape = {{2, 9}},
         .pl = {{R_, S_(0)}}, .check_out = true, .out = {R_, S_(0)}, .no_comm = true,
         .rnd = 3, .rshape = {2, 3, 3}},
        /* transpose: shards follow the swap */
        {"(1,2) S(1)", OP_TRANSPOSE, X1, .pl = {{S_(0), S_(1)}}, .check_out = true,
         .out = {S_(0), S_(2)}, .no_comm = true, .d0 = 1, .d1 = 2},
        {"(-1,-2) S(2)", OP_TRANSPOSE, X1, .pl = {{S_(1), S_(2)}},
         .check_out = true, .out = {S_(2), S_(1)}, .no_comm = true, .d0 = -1, .d1 = -2},
        {"(0,2) S(0)", OP_TRANSPOSE, X1, .pl = {{S_(1), S_(0)}}, .check_out = true,
         .out = {S_(1), S_(2)}, .no_comm = true, .d0 = 0, .d1 = 2},
        {"(0,1) nested S(1)", OP_TRANSPOSE, X1, .pl = {{S_(1), S_(1)}},
         .check_out = true, .out = {S_(0), S_(0)}, .no_comm = true, .d0 = 0, .d1 = 1},
        {"(2,0) R", OP_TRANSPOSE, X1, .pl = {{R_, R_}}, .check_out = true,
         .out = {R_, R_}, .no_comm = true, .d0 = 2, .d1 = 0},
        {"(1,1) S(2)", OP_TRANSPOSE, X1, .pl = {{R_, S_(2)}}, .check_out = true,
         .out = {R_, S_(2)}, .no_comm = true, .d0 = 1, .d1 = 1},
        {"(0,1) P", OP_TRANSPOSE, X1, .pl = {{S_(2), P_}}, .check_out = true,
         .out = {S_(2), P_}, .no_comm = true, .d0 = 0, .d1 = 1},
        {"(0,1) small S(0)", OP_TRANSPOSE, .n_in = 1, .nd = {2}, .shape = {{2, 9}},
         .pl = {{S_(1), S_(0)}}, .check_out = true, .out = {S_(0), S_(1)}, .no_comm = true,
         .d0 = 0, .d1 = 1},
    };
    return run_cases(s, mesh, cases, NCASES(cases));
}

/* ---- distributed errors ------------------------------------------------------- */

static tp_status errors_body(tp_test_slot *s, tp_mesh *mesh, ew_ctx *c)
{
    (void)c;
    int m = tp_mesh_ndim(mesh);
    tp_placement rr[2] = {R_, R_}, ss[2] = {S_(0), S_(0)};
    tp_tensor *a = NULL, *b = NULL, *da = NULL, *db = NULL, *y = NULL;
    RANK_OK(s, tp_test_global_tensor(2, (int64_t[]){4, 6}, 1, &a));
    RANK_OK(s, tp_test_global_tensor(1, (int64_t[]){5}, 2, &b));
    RANK_OK(s, tp_dtensor_distribute(mesh, a, m, ss, -1, &da));
    RANK_OK(s, tp_dtensor_distribute(mesh, b, m, rr, -1, &db));
    /* mixing plain and distributed names the arguments */
    tp_status st = tp_add(a, da, &y);
    RANK_EXPECT(s, st == TP_ERR_INVALID_ARG && y == NULL &&
                       strstr(tp_last_error(), "add: a is a plain tensor but b is a DTensor"),
                "add mixing: %s %s", tp_status_name(st), tp_last_error());
    st = tp_mul(da, a, &y);
    RANK_EXPECT(s, st == TP_ERR_INVALID_ARG && y == NULL &&
                       strstr(tp_last_error(), "mul: a is a DTensor but b is a plain tensor"),
                "mul mixing: %s %s", tp_status_name(st), tp_last_error());
    /* a shape mismatch fails before any collective */
    tp_comm_debug *dbg = NULL;
    RANK_OK(s, tp_comm_debug_create(&dbg));
    RANK_OK(s, tp_comm_debug_begin(dbg));
    st = tp_add(da, db, &y);
    RANK_OK(s, tp_comm_debug_end(dbg));
    RANK_EXPECT(s, st == TP_ERR_INVALID_ARG && y == NULL &&
                       strstr(tp_last_error(), "add: a of shape [4, 6] and b of shape [5] do "
                                               "not broadcast: dim -1 is 6 in a but 5 in b"),
                "add shapes: %s %s", tp_status_name(st), tp_last_error());
    RANK_EXPECT(s, tp_comm_debug_total(dbg) == 0, "a failed add issued %lld collectives",
                (long long)tp_comm_debug_total(dbg));
    tp_comm_debug_free(dbg);
    st = tp_reshape(da, 2, (int64_t[]){5, 5}, &y);
    RANK_EXPECT(s, st == TP_ERR_INVALID_ARG && y == NULL &&
                       strstr(tp_last_error(), "reshape: cannot reshape [4, 6] (24 elements) "
                                               "into [5, 5] (25 elements)"),
                "reshape: %s %s", tp_status_name(st), tp_last_error());
    st = tp_dropout(da, 1.0, 1, true, &y);
    RANK_EXPECT(s, st == TP_ERR_INVALID_ARG && y == NULL &&
                       strstr(tp_last_error(), "dropout: p = 1 is outside [0, 1)"),
                "dropout: %s %s", tp_status_name(st), tp_last_error());
    st = tp_transpose(da, 0, 2, &y);
    RANK_EXPECT(s, st == TP_ERR_INVALID_ARG && y == NULL &&
                       strstr(tp_last_error(), "transpose: dims (0, 2) out of range for 2 dims"),
                "transpose: %s %s", tp_status_name(st), tp_last_error());
    tp_tensor_release(a);
    tp_tensor_release(b);
    tp_tensor_release(da);
    tp_tensor_release(db);
    return TP_OK;
}

/* ---- the distributed tests -------------------------------------------------------- */

ParameterizedTestParameters(ops_elementwise, add)
{
    static ew_mesh meshes[] = {{1, {1}}, {1, {2}}, {1, {3}}, {1, {4}}, {1, {8}}, {2, {2, 2}}, {2, {4, 2}}, {2, {2, 3}}};
    return cr_make_param_array(ew_mesh, meshes, NCASES(meshes));
}
ParameterizedTest(ew_mesh *em, ops_elementwise, add, .timeout = 120)
{
    run_on_mesh(em, add_body);
}

ParameterizedTestParameters(ops_elementwise, mul)
{
    static ew_mesh meshes[] = {{1, {1}}, {1, {2}}, {1, {3}}, {1, {4}}, {1, {8}}, {2, {2, 2}}, {2, {4, 2}}, {2, {2, 3}}};
    return cr_make_param_array(ew_mesh, meshes, NCASES(meshes));
}
ParameterizedTest(ew_mesh *em, ops_elementwise, mul, .timeout = 120)
{
    run_on_mesh(em, mul_body);
}

ParameterizedTestParameters(ops_elementwise, broadcast)
{
    static ew_mesh meshes[] = {{1, {1}}, {1, {2}}, {1, {3}}, {1, {4}}, {1, {8}}, {2, {2, 2}}, {2, {4, 2}}, {2, {2, 3}}};
    return cr_make_param_array(ew_mesh, meshes, NCASES(meshes));
}
ParameterizedTest(ew_mesh *em, ops_elementwise, broadcast, .timeout = 120)
{
    run_on_mesh(em, bcast_body);
}

ParameterizedTestParameters(ops_elementwise, scale_relu_gelu)
{
    static ew_mesh meshes[] = {{1, {1}}, {1, {2}}, {1, {3}}, {1, {4}}, {1, {8}}, {2, {2, 2}}, {2, {4, 2}}, {2, {2, 3}}};
    return cr_make_param_array(ew_mesh, meshes, NCASES(meshes));
}
ParameterizedTest(ew_mesh *em, ops_elementwise, scale_relu_gelu, .timeout = 120)
{
    run_on_mesh(em, unary_body);
}

ParameterizedTestParameters(ops_elementwise, dropout)
{
    static ew_mesh meshes[] = {{1, {1}}, {1, {2}}, {1, {3}}, {1, {4}}, {1, {8}}, {2, {2, 2}}, {2, {4, 2}}, {2, {2, 3}}};
    return cr_make_param_array(ew_mesh, meshes, NCASES(meshes));
}
ParameterizedTest(ew_mesh *em, ops_elementwise, dropout, .timeout = 120)
{
    run_on_mesh(em, dropout_body);
}

ParameterizedTestParameters(ops_elementwise, reshape_transpose)
{
    static ew_mesh meshes[] = {{1, {1}}, {1, {2}}, {1, {3}}, {1, {4}}, {1, {8}}, {2, {2, 2}}, {2, {4, 2}}, {2, {2, 3}}};
    return cr_make_param_array(ew_mesh, meshes, NCASES(meshes));
}
ParameterizedTest(ew_mesh *em, ops_elementwise, reshape_transpose, .timeout = 120)
{
    run_on_mesh(em, shape_body);
}

ParameterizedTestParameters(ops_elementwise, distributed_errors)
{
    static ew_mesh meshes[] = {{1, {1}}, {1, {3}}, {2, {2, 2}}};
    return cr_make_param_array(ew_mesh, meshes, NCASES(meshes));
}
ParameterizedTest(ew_mesh *em, ops_elementwise, distributed_errors, .timeout = 60)
{
    run_on_mesh(em, errors_body);
}

/* ---- plain ops against hand-written loops (main thread) ----------------------------- */

static tp_tensor *rand_t(int nd, const int64_t *shape, uint64_t seed)
{
    tp_tensor *t = NULL;
    CHECK_OK(tp_test_global_tensor(nd, shape, seed, &t));
    return t;
}

static tp_tensor *grad_of(tp_tensor *y, tp_tensor *g, tp_tensor *x)
{
    CHECK_OK(tp_backward(y, g));
    tp_tensor *gx = tp_tensor_grad(x);
    cr_assert(gx, "no gradient");
    return gx;
}

Test(ops_elementwise, plain_add_mul, .timeout = 30)
{
    const int64_t sh[2] = {3, 4}, sb[1] = {4};
    for (int mul = 0; mul < 2; mul++) {
        for (int bc = 0; bc < 2; bc++) {
            tp_tensor *a = rand_t(2, sh, 1), *b = rand_t(bc ? 1 : 2, bc ? sb : sh, 2),
                      *g = rand_t(2, sh, 3), *y = NULL;
            CHECK_OK(tp_tensor_set_requires_grad(a, true));
            CHECK_OK(tp_tensor_set_requires_grad(b, true));
            CHECK_OK(mul ? tp_mul(a, b, &y) : tp_add(a, b, &y));
            cr_assert(tp_tensor_has_grad_fn(y));
            CHECK_OK(tp_backward(y, g));
            const float *pa = tp_tensor_data(a), *pb = tp_tensor_data(b),
                        *pg = tp_tensor_data(g), *py = tp_tensor_data(y),
                        *ga = tp_tensor_data(tp_tensor_grad(a)),
                        *gb = tp_tensor_data(tp_tensor_grad(b));
            float colsum[4] = {0};
            for (int i = 0; i < 12; i++) {
                float bv = pb[bc ? i % 4 : i];
                float want = mul ? pa[i] * bv : pa[i] + bv;
                cr_assert_eq(py[i], want, "%s%s y[%d] = %g, want %g", mul ? "mul" : "add",
                             bc ? " bcast" : "", i, py[i], want);
                float wa = mul ? pg[i] * bv : pg[i];
                cr_assert_eq(ga[i], wa, "ga[%d] = %g, want %g", i, ga[i], wa);
                float wb = mul ? pg[i] * pa[i] : pg[i];
                if (bc)
                    colsum[i % 4] += wb;
                else
                    cr_assert_eq(gb[i], wb, "gb[%d] = %g, want %g", i, gb[i], wb);
            }
            for (int j = 0; bc && j < 4; j++)
                cr_assert_eq(gb[j], colsum[j], "gb[%d] = %g, want %g", j, gb[j], colsum[j]);
            tp_tensor_release(a);
            tp_tensor_release(b);
            tp_tensor_release(g);
            tp_tensor_release(y);
        }
    }
}

/* y = a op b and both gradients against loops over the broadcast index space
 * that read every tensor through tp_tensor_get (so any strides). Integer
 * inputs: exact. */
static void check_bcast_plain(bool mul, tp_tensor *a, tp_tensor *b)
{
    const char *op = mul ? "mul" : "add";
    int na = tp_tensor_ndim(a), nb = tp_tensor_ndim(b), nd = na > nb ? na : nb;
    const int64_t *sa = tp_tensor_shape(a), *sb = tp_tensor_shape(b);
    int64_t shape[TP_MAX_DIMS], n = 1;
    for (int d = 0; d < nd; d++) {
        int ka = d - (nd - na), kb = d - (nd - nb);
        int64_t x = ka >= 0 ? sa[ka] : 1, z = kb >= 0 ? sb[kb] : 1;
        shape[d] = x == 1 ? z : x;
        n *= shape[d];
    }
    tp_tensor *y = NULL, *g = NULL;
    CHECK_OK(tp_tensor_set_requires_grad(a, true));
    CHECK_OK(tp_tensor_set_requires_grad(b, true));
    tp_tensor_zero_grad(a);
    tp_tensor_zero_grad(b);
    CHECK_OK(mul ? tp_mul(a, b, &y) : tp_add(a, b, &y));
    cr_assert_eq(tp_tensor_ndim(y), nd, "%s: the output has %d dims, want %d", op,
                 tp_tensor_ndim(y), nd);
    cr_assert(!memcmp(tp_tensor_shape(y), shape, sizeof(int64_t) * (size_t)nd),
              "%s: wrong output shape", op);
    g = rand_t(nd, shape, 33);
    CHECK_OK(tp_backward(y, g));
    tp_tensor *ga = tp_tensor_grad(a), *gb = tp_tensor_grad(b);
    cr_assert(ga && gb, "%s: a gradient is missing", op);
    cr_assert_eq(tp_tensor_ndim(ga), na);
    cr_assert_eq(tp_tensor_ndim(gb), nb);
    int64_t n_a = tp_tensor_numel(a), n_b = tp_tensor_numel(b);
    double *wa = calloc((size_t)(n_a + 1), sizeof *wa), *wb = calloc((size_t)(n_b + 1), sizeof *wb);
    cr_assert(wa && wb);
    int64_t i[TP_MAX_DIMS] = {0}, ia[TP_MAX_DIMS], ib[TP_MAX_DIMS];
    for (int64_t e = 0; e < n; e++) {
        int64_t rem = e, la = 0, lb = 0;
        for (int d = nd - 1; d >= 0; d--) {
            i[d] = rem % shape[d];
            rem /= shape[d];
        }
        for (int k = 0; k < na; k++) {
            ia[k] = sa[k] == 1 ? 0 : i[k + nd - na];
            la = la * sa[k] + ia[k];
        }
        for (int k = 0; k < nb; k++) {
            ib[k] = sb[k] == 1 ? 0 : i[k + nd - nb];
            lb = lb * sb[k] + ib[k];
        }
        double va, vb, vg, vy;
        CHECK_OK(tp_tensor_get(a, ia, &va));
        CHECK_OK(tp_tensor_get(b, ib, &vb));
        CHECK_OK(tp_tensor_get(g, i, &vg));
        CHECK_OK(tp_tensor_get(y, i, &vy));
        double want = mul ? va * vb : va + vb;
        cr_assert_eq(vy, want, "%s: y[%lld] = %g, want %g", op, (long long)e, vy, want);
        wa[la] += mul ? vg * vb : vg;
        wb[lb] += mul ? vg * va : vg;
    }
    /* the gradients are contiguous, in their operand's shape */
    const float *pa = tp_tensor_data(ga), *pb = tp_tensor_data(gb);
    cr_assert(tp_tensor_is_contiguous(ga) && tp_tensor_is_contiguous(gb));
    for (int64_t k = 0; k < n_a; k++)
        cr_assert_eq((double)pa[k], wa[k], "%s: grad a[%lld] = %g, want %g", op, (long long)k,
                     (double)pa[k], wa[k]);
    for (int64_t k = 0; k < n_b; k++)
        cr_assert_eq((double)pb[k], wb[k], "%s: grad b[%lld] = %g, want %g", op, (long long)k,
                     (double)pb[k], wb[k]);
    free(wa);
    free(wb);
    tp_tensor_release(y);
    tp_tensor_release(g);
}

Test(ops_elementwise, plain_broadcast_shapes, .timeout = 30)
{
    static const struct {
        int na, nb;
        int64_t a[8], b[8];
    } cases[] = {
        {3, 1, {2, 3, 4}, {4}},                      /* rank mismatch, b smaller */
        {1, 3, {4}, {2, 3, 4}},                      /* a smaller */
        {2, 3, {3, 4}, {2, 3, 4}},
        {3, 3, {2, 1, 4}, {1, 3, 1}},                /* size-1 dims on both sides */
        {2, 2, {3, 1}, {1, 4}},                      /* column times row */
        {2, 2, {3, 4}, {3, 1}},                      /* column broadcast */
        {3, 3, {2, 3, 4}, {2, 3, 4}},                /* same shape */
        {2, 0, {2, 3}, {0}},                         /* scalar b */
        {0, 2, {0}, {2, 3}},                         /* scalar a */
        {0, 0, {0}, {0}},                            /* two scalars */
        {1, 1, {1}, {5}},
        {2, 1, {0, 3}, {3}},                         /* empty output */
        {2, 2, {1, 3}, {0, 3}},                      /* a broadcast over an empty dim */
        {2, 2, {2, 0}, {2, 1}},
        {8, 8, {2, 1, 2, 1, 2, 1, 2, 1}, {1, 2, 1, 2, 1, 2, 1, 2}}, /* TP_MAX_DIMS dims */
    };
    for (int mul = 0; mul < 2; mul++)
        for (size_t k = 0; k < NCASES(cases); k++) {
            tp_tensor *a = rand_t(cases[k].na, cases[k].a, 1 + k),
                      *b = rand_t(cases[k].nb, cases[k].b, 50 + k);
            check_bcast_plain(mul, a, b);
            tp_tensor_release(a);
            tp_tensor_release(b);
        }
}

/* add and mul read non-contiguous views through their strides. */
Test(ops_elementwise, plain_broadcast_strided_inputs, .timeout = 30)
{
    tp_tensor *base_a = rand_t(2, (int64_t[]){3, 8}, 1), *base_b = rand_t(2, (int64_t[]){4, 6}, 2),
              *base_c = rand_t(2, (int64_t[]){3, 9}, 3);
    for (int mul = 0; mul < 2; mul++) {
        tp_tensor *a = NULL, *b = NULL, *c = NULL, *col = NULL;
        CHECK_OK(tp_tensor_narrow(base_a, 1, 2, 4, &a)); /* [3, 4], strides (8, 1) */
        CHECK_OK(tp_tensor_select(base_b, 1, 2, &b));    /* [4], stride 6 */
        CHECK_OK(tp_tensor_narrow(base_c, 1, 5, 4, &c)); /* [3, 4], strides (9, 1) */
        CHECK_OK(tp_tensor_narrow(base_c, 1, 7, 1, &col)); /* [3, 1], strides (9, 1) */
        cr_assert(!tp_tensor_is_contiguous(a) && !tp_tensor_is_contiguous(b) &&
                  !tp_tensor_is_contiguous(c) && !tp_tensor_is_contiguous(col));
        check_bcast_plain(mul, a, b);   /* strided row broadcast */
        check_bcast_plain(mul, a, c);   /* same shape, both strided */
        check_bcast_plain(mul, b, col); /* a strided row against a strided column */
        tp_tensor_release(a);
        tp_tensor_release(b);
        tp_tensor_release(c);
        tp_tensor_release(col);
    }
    tp_tensor_release(base_a);
    tp_tensor_release(base_b);
    tp_tensor_release(base_c);
}

Test(ops_elementwise, plain_scale_relu, .timeout = 30)
{
    const int64_t sh[2] = {4, 5};
    tp_tensor *x = rand_t(2, sh, 4), *g = rand_t(2, sh, 5), *y = NULL;
    CHECK_OK(tp_tensor_set_requires_grad(x, true));
    CHECK_OK(tp_scale(x, -0.5, &y));
    const float *gx = tp_tensor_data(grad_of(y, g, x));
    const float *px = tp_tensor_data(x), *pg = tp_tensor_data(g), *py = tp_tensor_data(y);
    for (int i = 0; i < 20; i++) {
        cr_assert_eq(py[i], -0.5f * px[i]);
        cr_assert_eq(gx[i], -0.5f * pg[i]);
    }
    tp_tensor_release(y);
    tp_tensor_zero_grad(x);
    CHECK_OK(tp_relu(x, &y));
    gx = tp_tensor_data(grad_of(y, g, x));
    py = tp_tensor_data(y);
    int zeros = 0;
    for (int i = 0; i < 20; i++) {
        cr_assert_eq(py[i], px[i] > 0 ? px[i] : 0.0f);
        cr_assert_eq(gx[i], px[i] > 0 ? pg[i] : 0.0f);
        zeros += px[i] <= 0;
    }
    cr_assert(zeros > 0 && zeros < 20, "the input should have both signs");
    tp_tensor_release(y);
    tp_tensor_release(x);
    tp_tensor_release(g);
}

#define TEST_PI 3.14159265358979323846

static double gelu_ref(double x, bool t)
{
    if (!t)
        return 0.5 * x * (1.0 + erf(x / sqrt(2.0)));
    const double k = sqrt(2.0 / TEST_PI);
    return 0.5 * x * (1.0 + tanh(k * (x + 0.044715 * x * x * x)));
}

static double gelu_ref_grad(double x, bool t)
{
    if (!t)
        return 0.5 * (1.0 + erf(x / sqrt(2.0))) + x * exp(-0.5 * x * x) / sqrt(2.0 * TEST_PI);
    const double k = sqrt(2.0 / TEST_PI);
    double u = k * (x + 0.044715 * x * x * x), th = tanh(u);
    return 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * k * (1.0 + 3 * 0.044715 * x * x);
}

/* tolerance of the f32 kernels against the double formulas: rtol 1e-5, atol 1e-6 */
Test(ops_elementwise, plain_gelu_matches_formula, .timeout = 30)
{
    const int64_t n = 161;
    for (int t = 0; t < 2; t++) {
        tp_tensor *x = NULL, *g = NULL, *y = NULL;
        CHECK_OK(tp_tensor_empty(TP_F32, TP_CPU, 1, &n, &x));
        CHECK_OK(tp_tensor_empty(TP_F32, TP_CPU, 1, &n, &g));
        float *px = tp_tensor_data(x), *pg = tp_tensor_data(g);
        for (int64_t i = 0; i < n; i++) {
            px[i] = -8.0f + 0.1f * (float)i;
            pg[i] = 1.0f + 0.01f * (float)i;
        }
        CHECK_OK(tp_tensor_set_requires_grad(x, true));
        CHECK_OK(tp_gelu(x, t ? TP_GELU_TANH : TP_GELU_EXACT, &y));
        const float *gx = tp_tensor_data(grad_of(y, g, x)), *py = tp_tensor_data(y);
        for (int64_t i = 0; i < n; i++) {
            double wy = gelu_ref(px[i], t), wg = pg[i] * gelu_ref_grad(px[i], t);
            cr_assert(fabs(py[i] - wy) <= 1e-6 + 1e-5 * fabs(wy),
                      "gelu(%s)(%g) = %.9g, want %.9g", t ? "tanh" : "exact", px[i], py[i], wy);
            cr_assert(fabs(gx[i] - wg) <= 1e-6 + 1e-5 * fabs(wg),
                      "gelu'(%s)(%g) * g = %.9g, want %.9g", t ? "tanh" : "exact", px[i], gx[i],
                      wg);
        }
        tp_tensor_release(x);
        tp_tensor_release(g);
        tp_tensor_release(y);
    }
}

Test(ops_elementwise, plain_transpose_reshape, .timeout = 30)
{
    const int64_t sh[4] = {2, 3, 4, 5};
    tp_tensor *x = rand_t(4, sh, 6);
    CHECK_OK(tp_tensor_set_requires_grad(x, true));
    const int pairs[][2] = {{0, 1}, {1, 3}, {2, 3}, {-1, -2}, {0, 3}, {2, 2}};
    for (size_t k = 0; k < NCASES(pairs); k++) {
        int d0 = pairs[k][0] < 0 ? pairs[k][0] + 4 : pairs[k][0];
        int d1 = pairs[k][1] < 0 ? pairs[k][1] + 4 : pairs[k][1];
        tp_tensor *y = NULL, *g = NULL;
        CHECK_OK(tp_transpose(x, pairs[k][0], pairs[k][1], &y));
        cr_assert(tp_tensor_is_contiguous(y));
        cr_assert_eq(tp_tensor_size(y, d0), sh[d1]);
        cr_assert_eq(tp_tensor_size(y, d1), sh[d0]);
        g = rand_t(4, tp_tensor_shape(y), 11);
        tp_tensor_zero_grad(x);
        tp_tensor *gx = grad_of(y, g, x);
        int64_t i[4], j[4];
        for (i[0] = 0; i[0] < 2; i[0]++)
            for (i[1] = 0; i[1] < 3; i[1]++)
                for (i[2] = 0; i[2] < 4; i[2]++)
                    for (i[3] = 0; i[3] < 5; i[3]++) {
                        memcpy(j, i, sizeof j);
                        j[d0] = i[d1];
                        j[d1] = i[d0];
                        double vx, vy, vg, vgx;
                        CHECK_OK(tp_tensor_get(x, i, &vx));
                        CHECK_OK(tp_tensor_get(y, j, &vy));
                        CHECK_OK(tp_tensor_get(g, j, &vg));
                        CHECK_OK(tp_tensor_get(gx, i, &vgx));
                        cr_assert_eq(vx, vy, "transpose(%d, %d) moved a value wrongly", d0, d1);
                        cr_assert_eq(vg, vgx, "transpose(%d, %d) gradient wrong", d0, d1);
                    }
        tp_tensor_release(y);
        tp_tensor_release(g);
    }
    /* reshape: same elements in the same order, gradient reshaped back */
    tp_tensor *y = NULL, *g = rand_t(2, (int64_t[]){6, 20}, 12);
    tp_tensor_zero_grad(x);
    CHECK_OK(tp_reshape(x, 2, (int64_t[]){-1, 20}, &y));
    cr_assert_eq(tp_tensor_ndim(y), 2);
    cr_assert_eq(tp_tensor_size(y, 0), 6);
    cr_assert(tp_tensor_is_contiguous(y));
    const float *gx = tp_tensor_data(grad_of(y, g, x));
    cr_assert(memcmp(tp_tensor_data(y), tp_tensor_data(x), 120 * sizeof(float)) == 0);
    cr_assert(memcmp(gx, tp_tensor_data(g), 120 * sizeof(float)) == 0);
    cr_assert(gx != tp_tensor_data(g), "the gradient must not alias the caller's grad");
    tp_tensor_release(y);
    tp_tensor_release(g);
    tp_tensor_release(x);
}

/* ---- dropout statistics and determinism --------------------------------------------- */

Test(ops_elementwise, dropout_statistics, .timeout = 30)
{
    const int64_t sh[2] = {200, 500};
    const int64_t n = 200 * 500;
    const double ps[] = {0.1, 0.3, 0.5, 0.8};
    tp_tensor *x = NULL, *g = NULL;
    CHECK_OK(tp_tensor_empty(TP_F32, TP_CPU, 2, sh, &x));
    CHECK_OK(tp_tensor_fill(x, 1.0));
    g = rand_t(2, sh, 9);
    CHECK_OK(tp_tensor_set_requires_grad(x, true));
    for (size_t k = 0; k < NCASES(ps); k++) {
        double p = ps[k];
        float scale = 1.0f / (1.0f - (float)p);
        tp_tensor *y = NULL;
        tp_tensor_zero_grad(x);
        CHECK_OK(tp_dropout(x, p, 42, true, &y));
        const float *gx = tp_tensor_data(grad_of(y, g, x)), *py = tp_tensor_data(y),
                    *pg = tp_tensor_data(g);
        int64_t dropped = 0;
        for (int64_t i = 0; i < n; i++) {
            if (py[i] == 0.0f) {
                dropped++;
                cr_assert_eq(gx[i], 0.0f, "a dropped element got a gradient");
            } else {
                cr_assert_eq(py[i], scale, "p=%g: kept value %g, want %g", p, py[i], scale);
                cr_assert_eq(gx[i], pg[i] * scale, "p=%g: gradient of a kept element", p);
            }
        }
        /* the binomial standard deviation is below 0.0016 here: 0.01 is > 6 sigma */
        double frac = (double)dropped / (double)n;
        cr_assert(fabs(frac - p) < 0.01, "p=%g: dropped a fraction %g", p, frac);
        tp_tensor_release(y);
    }
    /* the same seed gives the same mask, another seed another one; not training
     * (or p = 0) is the identity */
    tp_tensor *y1 = NULL, *y2 = NULL, *y3 = NULL, *y4 = NULL, *y5 = NULL;
    CHECK_OK(tp_dropout(x, 0.5, 7, true, &y1));
    CHECK_OK(tp_dropout(x, 0.5, 7, true, &y2));
    CHECK_OK(tp_dropout(x, 0.5, 8, true, &y3));
    CHECK_OK(tp_dropout(x, 0.5, 7, false, &y4));
    CHECK_OK(tp_dropout(x, 0.0, 7, true, &y5));
    bool eq = false;
    CHECK_OK(tp_tensor_equal(y1, y2, &eq));
    cr_assert(eq, "same seed, different masks");
    CHECK_OK(tp_tensor_equal(y1, y3, &eq));
    cr_assert(!eq, "different seeds, same mask");
    CHECK_OK(tp_tensor_equal(y4, x, &eq));
    cr_assert(eq, "dropout in eval mode is not the identity");
    CHECK_OK(tp_tensor_equal(y5, x, &eq));
    cr_assert(eq, "dropout with p = 0 is not the identity");
    cr_assert(tp_tensor_data(y4) != tp_tensor_data(x), "eval dropout must copy");
    tp_tensor_release(y1);
    tp_tensor_release(y2);
    tp_tensor_release(y3);
    tp_tensor_release(y4);
    tp_tensor_release(y5);
    tp_tensor_release(x);
    tp_tensor_release(g);
}

/* The mask depends only on the global index: every world size draws the same
 * one (outputs of a sharded [13, 11] tensor at 1..4 ranks against 1 rank). */
typedef struct {
    tp_test_slot slot[TP_TEST_MAX_RANKS];
} drop_ctx;

static tp_status drop_same_rank(tp_comm *w, void *arg)
{
    drop_ctx *c = arg;
    tp_test_slot *s = &c->slot[tp_comm_rank(w)];
    int64_t n = tp_comm_size(w), shape[2] = {13, 11};
    tp_mesh *mesh = NULL;
    tp_tensor *x = NULL, *ref = NULL;
    RANK_OK(s, tp_mesh_create(w, 1, &n, NULL, &mesh));
    RANK_OK(s, tp_tensor_empty(TP_F32, TP_CPU, 2, shape, &x));
    RANK_OK(s, tp_tensor_fill(x, 1.0));
    RANK_OK(s, tp_dropout(x, 0.4, 99, true, &ref));
    for (int d = 0; d < 2; d++) {
        tp_placement pl = tp_shard(d);
        tp_tensor *dx = NULL, *dy = NULL, *full = NULL;
        RANK_OK(s, tp_dtensor_distribute(mesh, x, 1, &pl, -1, &dx));
        RANK_OK(s, tp_dropout(dx, 0.4, 99, true, &dy));
        RANK_OK(s, tp_dtensor_full_tensor(dy, &full));
        bool eq = false;
        RANK_OK(s, tp_tensor_equal(full, ref, &eq));
        RANK_EXPECT(s, eq, "world %lld, S(%d): the mask differs from one rank's", (long long)n, d);
        tp_tensor_release(dx);
        tp_tensor_release(dy);
        tp_tensor_release(full);
    }
    tp_tensor_release(x);
    tp_tensor_release(ref);
    tp_mesh_free(mesh);
    return TP_OK;
}

Test(ops_elementwise, dropout_mask_same_at_every_world_size, .timeout = 60)
{
    for (int n = 1; n <= 4; n++) {
        drop_ctx c;
        memset(&c, 0, sizeof c);
        tp_test_run(n, drop_same_rank, &c, c.slot);
    }
}

/* ---- argument errors (plain tensors) ---------------------------------------------- */

#define CHECK_MSG(substr)                                                                     \
    cr_assert(strstr(tp_last_error(), (substr)), "message \"%s\" lacks \"%s\"",                \
              tp_last_error(), (substr))

Test(ops_elementwise, errors, .timeout = 30)
{
    tp_tensor *a = rand_t(2, (int64_t[]){3, 4}, 1), *b3 = rand_t(1, (int64_t[]){3}, 2),
              *b32 = rand_t(2, (int64_t[]){3, 2}, 3), *y = (tp_tensor *)&y;
    /* shapes that do not broadcast: both named, and the first clashing dim
     * counted from the right */
    CHECK_ERR(tp_add(a, b3, &y), TP_ERR_INVALID_ARG);
    CHECK_MSG("add: a of shape [3, 4] and b of shape [3] do not broadcast: dim -1 is 4 in a "
              "but 3 in b");
    cr_assert_null(y);
    CHECK_ERR(tp_mul(a, b32, &y), TP_ERR_INVALID_ARG);
    CHECK_MSG("mul: a of shape [3, 4] and b of shape [3, 2] do not broadcast: dim -1 is 4 in a "
              "but 2 in b");
    CHECK_ERR(tp_add(b3, a, &y), TP_ERR_INVALID_ARG);
    CHECK_MSG("add: a of shape [3] and b of shape [3, 4] do not broadcast: dim -1 is 3 in a "
              "but 4 in b");
    tp_tensor *a234 = rand_t(3, (int64_t[]){2, 3, 4}, 4), *b51 = rand_t(2, (int64_t[]){5, 1}, 5),
              *e04 = rand_t(2, (int64_t[]){0, 4}, 6), *b24 = rand_t(2, (int64_t[]){2, 4}, 7);
    CHECK_ERR(tp_mul(a234, b51, &y), TP_ERR_INVALID_ARG);
    CHECK_MSG("mul: a of shape [2, 3, 4] and b of shape [5, 1] do not broadcast: dim -2 is 3 in "
              "a but 5 in b");
    CHECK_ERR(tp_add(b24, e04, &y), TP_ERR_INVALID_ARG); /* 0 is not 1: no stretching */
    CHECK_MSG("add: a of shape [2, 4] and b of shape [0, 4] do not broadcast: dim -2 is 2 in a "
              "but 0 in b");
    cr_assert_null(y);
    tp_tensor_release(a234);
    tp_tensor_release(b51);
    tp_tensor_release(e04);
    tp_tensor_release(b24);
    /* NULLs */
    CHECK_ERR(tp_add(a, NULL, &y), TP_ERR_INVALID_ARG);
    CHECK_MSG("add: b is NULL");
    CHECK_ERR(tp_relu(NULL, &y), TP_ERR_INVALID_ARG);
    CHECK_MSG("relu: x is NULL");
    CHECK_ERR(tp_scale(a, 2.0, NULL), TP_ERR_INVALID_ARG);
    CHECK_MSG("scale: out is NULL");
    CHECK_ERR(tp_reshape(NULL, 1, (int64_t[]){12}, &y), TP_ERR_INVALID_ARG);
    CHECK_MSG("reshape: x is NULL");
    /* dropout p */
    const double bad_p[] = {1.0, -0.1, 1.5, NAN};
    for (size_t k = 0; k < NCASES(bad_p); k++) {
        CHECK_ERR(tp_dropout(a, bad_p[k], 1, true, &y), TP_ERR_INVALID_ARG);
        CHECK_MSG("is outside [0, 1)");
        CHECK_ERR(tp_dropout(a, bad_p[k], 1, false, &y), TP_ERR_INVALID_ARG);
    }
    CHECK_ERR(tp_dropout(a, -0.5, 1, true, &y), TP_ERR_INVALID_ARG);
    CHECK_MSG("dropout: p = -0.5 is outside [0, 1)");
    /* gelu mode */
    CHECK_ERR(tp_gelu(a, (tp_gelu_approx)7, &y), TP_ERR_INVALID_ARG);
    CHECK_MSG("gelu: approx 7");
    /* reshape */
    CHECK_ERR(tp_reshape(a, 2, (int64_t[]){5, 2}, &y), TP_ERR_INVALID_ARG);
    CHECK_MSG("reshape: cannot reshape [3, 4] (12 elements) into [5, 2] (10 elements)");
    CHECK_ERR(tp_reshape(a, 2, (int64_t[]){-1, -1}, &y), TP_ERR_INVALID_ARG);
    CHECK_MSG("only one size may be -1");
    CHECK_ERR(tp_reshape(a, 2, (int64_t[]){-1, 5}, &y), TP_ERR_INVALID_ARG);
    CHECK_MSG("reshape: cannot infer the size of dim 0");
    CHECK_ERR(tp_reshape(a, 2, (int64_t[]){-3, 4}, &y), TP_ERR_INVALID_ARG);
    CHECK_MSG("reshape: size -3 of dim 0 is invalid");
    CHECK_ERR(tp_reshape(a, 9, (int64_t[]){1, 1, 1, 1, 1, 1, 1, 1, 12}, &y), TP_ERR_INVALID_ARG);
    CHECK_MSG("reshape: ndim 9");
    /* transpose */
    CHECK_ERR(tp_transpose(a, 0, 2, &y), TP_ERR_INVALID_ARG);
    CHECK_MSG("transpose: dims (0, 2) out of range for 2 dims");
    CHECK_ERR(tp_transpose(a, -3, 0, &y), TP_ERR_INVALID_ARG);
    /* dtype and layout */
    tp_tensor *ai = NULL, *nc = NULL;
    CHECK_OK(tp_tensor_zeros(TP_I64, TP_CPU, 2, (int64_t[]){3, 4}, &ai));
    CHECK_ERR(tp_relu(ai, &y), TP_ERR_NOT_SUPPORTED);
    CHECK_MSG("relu: x is i64");
    CHECK_OK(tp_tensor_narrow(a, 1, 1, 2, &nc));
    CHECK_ERR(tp_transpose(nc, 0, 1, &y), TP_ERR_INVALID_ARG);
    CHECK_MSG("transpose: x is not contiguous");
    cr_assert_null(y);
    tp_tensor_release(ai);
    tp_tensor_release(nc);
    tp_tensor_release(a);
    tp_tensor_release(b3);
    tp_tensor_release(b32);
}

/* Without requires_grad nothing is recorded (and dropout keeps no mask). */
Test(ops_elementwise, no_grad_records_nothing, .timeout = 30)
{
    tp_tensor *a = rand_t(2, (int64_t[]){3, 4}, 1), *y = NULL, *z = NULL;
    CHECK_OK(tp_dropout(a, 0.5, 1, true, &y));
    cr_assert(!tp_tensor_has_grad_fn(y));
    CHECK_OK(tp_tensor_set_requires_grad(a, true));
    tp_no_grad_begin();
    CHECK_OK(tp_add(a, a, &z));
    tp_no_grad_end();
    cr_assert(!tp_tensor_has_grad_fn(z));
    tp_tensor_release(a);
    tp_tensor_release(y);
    tp_tensor_release(z);
}
