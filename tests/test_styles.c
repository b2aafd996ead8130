/* Parallel styles and tp_parallelize_module, case by case after the seed
 * test_tp_style.py: the local output shapes and the exact collectives per
 * kind (forward, then backward) of ColwiseParallel, RowwiseParallel,
 * PrepareModuleInput (positional and keyword inputs), PrepareModuleOutput;
 * the MLP counts of DESIGN.md (plain and sequence parallel); numerical
 * equality of every style against the unparallelized module (forward output
 * and parameter gradients, f32 with |a - b| <= ATOL + RTOL |b|); FQN
 * matching, unmatched plan entries, the error cases (double sharding,
 * Colwise on a LayerNorm, 2-D mesh, option validation), and a 1-D slice of a
 * 2x2 mesh.
 *
 * Counts at W = 1 are all zero (a mesh dim of size 1 never communicates). */
#include "tp_test.h"

#define RTOL 1e-4
#define ATOL 1e-5

typedef struct {
    int w;
    tp_test_slot slot[TP_TEST_MAX_RANKS];
} sty_ctx;

#define SLOT(c, world) (&(c)->slot[tp_comm_rank(world)])

/* ---- helpers ---------------------------------------------------------------- */

static tp_status mesh1d(tp_comm *world, tp_mesh **mesh)
{
    int64_t n = tp_comm_size(world);
    return tp_mesh_create(world, 1, &n, NULL, mesh);
}

static tp_status rand_t(int nd, const int64_t *shape, uint64_t seed, tp_tensor **t)
{
    TP_TEST_TRY(tp_tensor_zeros(TP_F32, TP_CPU, nd, shape, t));
    return tp_tensor_fill_random(*t, TP_RNG_UNIFORM, -1, 1, seed, NULL, NULL);
}

static tp_status ones_t(int nd, const int64_t *shape, tp_tensor **t)
{
    TP_TEST_TRY(tp_tensor_zeros(TP_F32, TP_CPU, nd, shape, t));
    return tp_tensor_fill(*t, 1.0);
}

/* i64 tensor holding 0, 1, 2, ... (torch.arange(n).reshape(shape)). */
static tp_status arange_i64(int nd, const int64_t *shape, tp_tensor **t)
{
    TP_TEST_TRY(tp_tensor_zeros(TP_I64, TP_CPU, nd, shape, t));
    int64_t *d = tp_tensor_data(*t);
    for (int64_t i = 0; i < tp_tensor_numel(*t); i++)
        d[i] = i;
    return TP_OK;
}

/* Parallelizes m itself with one style (plan {"", style}); frees the style
 * right away (hooks keep their own copies). */
static tp_status par_self(tp_module *m, tp_mesh *mesh, tp_style *style)
{
    tp_plan_entry e = {"", style};
    tp_status st = tp_parallelize_module(m, mesh, 1, &e, NULL);
    tp_style_free(style);
    return st;
}

static tp_status colwise(const tp_colwise_options *o, tp_style **s)
{
    return tp_colwise_parallel_create(o, s);
}

static bool shape_is(const tp_tensor *t, int nd, const int64_t *shape)
{
    if (!t || tp_tensor_ndim(t) != nd)
        return false;
    for (int d = 0; d < nd; d++)
        if (tp_tensor_shape(t)[d] != shape[d])
            return false;
    return true;
}

static void expect_shape(tp_test_slot *s, const tp_tensor *t, int nd, const int64_t *shape,
                         const char *label)
{
    char got[96] = "(null)", want[96];
    int p = 0;
    if (t) {
        p = snprintf(got, sizeof got, "(");
        for (int d = 0; d < tp_tensor_ndim(t); d++)
            p += snprintf(got + p, sizeof got - (size_t)p, "%s%lld", d ? ", " : "",
                          (long long)tp_tensor_shape(t)[d]);
        snprintf(got + p, sizeof got - (size_t)p, ")");
    }
    p = snprintf(want, sizeof want, "(");
    for (int d = 0; d < nd; d++)
        p += snprintf(want + p, sizeof want - (size_t)p, "%s%lld", d ? ", " : "",
                      (long long)shape[d]);
    snprintf(want + p, sizeof want - (size_t)p, ")");
    RANK_EXPECT(s, shape_is(t, nd, shape), "%s: shape %s, expected %s", label, got, want);
}

/* The counts of one phase ("Global" scope): exactly ar all_reduces, ag
 * all_gathers, rs reduce_scatters and nothing else (zero at W = 1). */
static void expect_phase(tp_test_slot *s, const tp_comm_debug *d, tp_phase ph, int w,
                         int64_t ar, int64_t ag, int64_t rs, const char *label)
{
    int64_t want[TP_COLL_KIND_COUNT] = {0};
    if (w > 1) {
        want[TP_COLL_ALL_REDUCE] = ar;
        want[TP_COLL_ALL_GATHER] = ag;
        want[TP_COLL_REDUCE_SCATTER] = rs;
    }
    for (int k = 0; k < TP_COLL_KIND_COUNT; k++) {
        int64_t got = tp_comm_debug_module_count(d, TP_COMM_DEBUG_GLOBAL, ph, (tp_coll_kind)k);
        RANK_EXPECT(s, got == want[k], "%s (%s, W=%d): %lld %s, expected %lld", label,
                    ph == TP_PHASE_FORWARD ? "forward" : "backward", w, (long long)got,
                    tp_coll_kind_name((tp_coll_kind)k), (long long)want[k]);
    }
}

/* Forward of m on one input under the counter, then (backward) tp_backward
 * of tp_sum_all of the output. *out keeps the output. */
static tp_status run_counted(tp_module *m, tp_tensor *x, bool backward, tp_comm_debug *dbg,
                             tp_tensor **out)
{
    TP_TEST_TRY(tp_comm_debug_begin(dbg));
    tp_status st = tp_module_call(m, x, out);
    if (st == TP_OK && backward) {
        tp_tensor *l = NULL;
        st = tp_sum_all(*out, &l);
        if (st == TP_OK)
            st = tp_backward(l, NULL);
        tp_tensor_release(l);
    }
    tp_status e = tp_comm_debug_end(dbg);
    return st != TP_OK ? st : e;
}

static int64_t chunk_len(int64_t n, int w, int r)
{
    int64_t start = 0, len = 0;
    tp_chunk_range(n, w, r, &start, &len);
    return len;
}

static bool msg_has(const char *needle) { return strstr(tp_last_error(), needle) != NULL; }

/* ---- parameters of the parameterized tests ---------------------------------- */

#define SIZES_PARAMS(name, ...)                                                 \
    ParameterizedTestParameters(styles, name)                                   \
    {                                                                           \
        static int sizes[] = {__VA_ARGS__};                                     \
        return cr_make_param_array(int, sizes, sizeof sizes / sizeof sizes[0]); \
    }

/* ==== ColwiseParallel on Linear ============================================= */

static tp_status colwise_linear_body(tp_comm *world, void *arg)
{
    sty_ctx *c = arg;
    tp_test_slot *s = SLOT(c, world);
    int w = c->w, r = tp_comm_rank(world);
    tp_mesh *mesh = NULL;
    tp_comm_debug *dbg = NULL;
    tp_tensor *x = NULL, *out = NULL;
    tp_module *m = NULL;
    tp_style *st = NULL;
    RANK_OK(s, mesh1d(world, &mesh));
    RANK_OK(s, tp_comm_debug_create(&dbg));
    RANK_OK(s, rand_t(2, (int64_t[]){8, 16}, 1, &x));
    RANK_OK(s, tp_tensor_set_requires_grad(x, true));

    /* default: no communication forward, one all_reduce backward */
    RANK_OK(s, tp_nn_linear_create(16, 16, true, &m));
    RANK_OK(s, tp_module_init(m, 42));
    RANK_OK(s, colwise(NULL, &st));
    RANK_OK(s, par_self(m, mesh, st));
    RANK_OK(s, run_counted(m, x, true, dbg, &out));
    expect_shape(s, out, 2, (int64_t[]){8, chunk_len(16, w, r)}, "colwise default output");
    RANK_EXPECT(s, !tp_tensor_is_dtensor(out), "colwise default: output is not local");
    expect_phase(s, dbg, TP_PHASE_FORWARD, w, 0, 0, 0, "colwise default");
    expect_phase(s, dbg, TP_PHASE_BACKWARD, w, 1, 0, 0, "colwise default");
    RANK_EXPECT(s, tp_tensor_grad(x) != NULL, "colwise default: x got no gradient");
    tp_tensor_release(out);
    out = NULL;
    tp_module_free(m);
    tp_tensor_zero_grad(x);

    /* input_layouts = Shard(0): all_gather forward, reduce_scatter backward */
    RANK_OK(s, tp_nn_linear_create(16, 16, true, &m));
    RANK_OK(s, tp_module_init(m, 42));
    tp_colwise_options o = {.input_layouts = tp_layout_of(tp_shard(0))};
    RANK_OK(s, colwise(&o, &st));
    RANK_OK(s, par_self(m, mesh, st));
    RANK_OK(s, run_counted(m, x, true, dbg, &out));
    expect_shape(s, out, 2, (int64_t[]){8 * w, chunk_len(16, w, r)}, "colwise S(0) output");
    expect_phase(s, dbg, TP_PHASE_FORWARD, w, 0, 1, 0, "colwise S(0)");
    expect_phase(s, dbg, TP_PHASE_BACKWARD, w, 0, 0, 1, "colwise S(0)");
    expect_shape(s, tp_tensor_grad(x), 2, (int64_t[]){8, 16}, "colwise S(0) x grad");
    tp_tensor_release(out);
    out = NULL;
    tp_module_free(m);

    /* use_local_output false: the output stays a DTensor S(-1) */
    RANK_OK(s, tp_nn_linear_create(16, 16, true, &m));
    RANK_OK(s, tp_module_init(m, 42));
    tp_colwise_options k = {.use_local_output = TP_FLAG_FALSE};
    RANK_OK(s, colwise(&k, &st));
    RANK_OK(s, par_self(m, mesh, st));
    RANK_OK(s, run_counted(m, x, false, dbg, &out));
    RANK_EXPECT(s, tp_tensor_is_dtensor(out), "use_local_output false: output is not a DTensor");
    if (tp_tensor_is_dtensor(out)) {
        expect_shape(s, out, 2, (int64_t[]){8, 16}, "use_local_output false: global shape");
        RANK_EXPECT(s, tp_dtensor_placements(out)[0].kind == TP_PLACEMENT_SHARD &&
                           tp_dtensor_placements(out)[0].dim == 1,
                    "use_local_output false: output is not S(1)");
    }
    expect_phase(s, dbg, TP_PHASE_FORWARD, w, 0, 0, 0, "colwise use_local_output false");
    tp_tensor_release(out);
    out = NULL;
    tp_module_free(m);

    /* a DTensor input whose layout differs from input_layouts (R) is
     * redistributed to it first: S(0) -> R is one all_gather */
    RANK_OK(s, tp_nn_linear_create(16, 16, true, &m));
    RANK_OK(s, tp_module_init(m, 42));
    RANK_OK(s, colwise(NULL, &st));
    RANK_OK(s, par_self(m, mesh, st));
    tp_tensor *xd = NULL;
    tp_placement s0 = tp_shard(0);
    RANK_OK(s, tp_dtensor_from_local(mesh, x, 1, &s0, NULL, &xd));
    RANK_OK(s, run_counted(m, xd, false, dbg, &out));
    expect_shape(s, out, 2, (int64_t[]){8 * w, chunk_len(16, w, r)}, "colwise DTensor input");
    expect_phase(s, dbg, TP_PHASE_FORWARD, w, 0, 1, 0, "colwise DTensor S(0) input");
    tp_tensor_release(xd);
    tp_tensor_release(out);
    tp_module_free(m);

    tp_tensor_release(x);
    tp_comm_debug_free(dbg);
    tp_mesh_free(mesh);
    return TP_OK;
}

SIZES_PARAMS(colwise_linear, 1, 2, 3, 4)
ParameterizedTest(int *n, styles, colwise_linear, .timeout = 60)
{
    sty_ctx c = {.w = *n};
    tp_test_run(*n, colwise_linear_body, &c, c.slot);
}

/* ==== ColwiseParallel on Embedding ========================================== */

static tp_status colwise_embedding_body(tp_comm *world, void *arg)
{
    sty_ctx *c = arg;
    tp_test_slot *s = SLOT(c, world);
    int w = c->w, r = tp_comm_rank(world);
    tp_mesh *mesh = NULL;
    tp_comm_debug *dbg = NULL;
    tp_tensor *idx = NULL, *out = NULL;
    tp_module *m = NULL;
    tp_style *st = NULL;
    RANK_OK(s, mesh1d(world, &mesh));
    RANK_OK(s, tp_comm_debug_create(&dbg));
    RANK_OK(s, arange_i64(2, (int64_t[]){4, 2}, &idx));
    RANK_OK(s, tp_nn_embedding_create(16, 16, &m));
    RANK_OK(s, tp_module_init(m, 7));
    RANK_OK(s, colwise(NULL, &st));
    RANK_OK(s, par_self(m, mesh, st));
    RANK_OK(s, run_counted(m, idx, true, dbg, &out));
    expect_shape(s, out, 3, (int64_t[]){4, 2, chunk_len(16, w, r)}, "embedding colwise");
    expect_phase(s, dbg, TP_PHASE_FORWARD, w, 0, 0, 0, "embedding colwise");
    expect_phase(s, dbg, TP_PHASE_BACKWARD, w, 0, 0, 0, "embedding colwise");
    tp_tensor *wgt = tp_module_parameter(m, "weight");
    RANK_EXPECT(s, wgt && tp_tensor_grad(wgt), "embedding colwise: weight got no gradient");
    tp_tensor_release(out);
    tp_tensor_release(idx);
    tp_module_free(m);
    tp_comm_debug_free(dbg);
    tp_mesh_free(mesh);
    return TP_OK;
}

SIZES_PARAMS(colwise_embedding, 1, 2, 3, 4)
ParameterizedTest(int *n, styles, colwise_embedding, .timeout = 60)
{
    sty_ctx c = {.w = *n};
    tp_test_run(*n, colwise_embedding_body, &c, c.slot);
}

/* ==== RowwiseParallel on Linear ============================================= */

static tp_status rowwise_linear_body(tp_comm *world, void *arg)
{
    sty_ctx *c = arg;
    tp_test_slot *s = SLOT(c, world);
    int w = c->w;
    tp_mesh *mesh = NULL;
    tp_comm_debug *dbg = NULL;
    tp_tensor *x = NULL, *out = NULL;
    tp_module *m = NULL;
    tp_style *st = NULL;
    RANK_OK(s, mesh1d(world, &mesh));
    RANK_OK(s, tp_comm_debug_create(&dbg));
    RANK_OK(s, rand_t(2, (int64_t[]){8, 16 / w}, 2, &x));
    RANK_OK(s, tp_tensor_set_requires_grad(x, true));

    /* default: all_reduce forward, nothing backward */
    RANK_OK(s, tp_nn_linear_create(16, 16, true, &m));
    RANK_OK(s, tp_module_init(m, 42));
    RANK_OK(s, tp_rowwise_parallel_create(NULL, &st));
    RANK_OK(s, par_self(m, mesh, st));
    RANK_OK(s, run_counted(m, x, true, dbg, &out));
    expect_shape(s, out, 2, (int64_t[]){8, 16}, "rowwise default output");
    RANK_EXPECT(s, !tp_tensor_is_dtensor(out), "rowwise default: output is not local");
    expect_phase(s, dbg, TP_PHASE_FORWARD, w, 1, 0, 0, "rowwise default");
    expect_phase(s, dbg, TP_PHASE_BACKWARD, w, 0, 0, 0, "rowwise default");
    expect_shape(s, tp_tensor_grad(x), 2, (int64_t[]){8, 16 / w}, "rowwise x grad");
    tp_tensor_release(out);
    out = NULL;
    tp_module_free(m);

    /* output_layouts = Shard(0): reduce_scatter forward, all_gather backward */
    RANK_OK(s, tp_nn_linear_create(16, 16, true, &m));
    RANK_OK(s, tp_module_init(m, 42));
    tp_rowwise_options o = {.output_layouts = tp_layout_of(tp_shard(0))};
    RANK_OK(s, tp_rowwise_parallel_create(&o, &st));
    RANK_OK(s, par_self(m, mesh, st));
    RANK_OK(s, run_counted(m, x, true, dbg, &out));
    expect_shape(s, out, 2, (int64_t[]){8 / w, 16}, "rowwise S(0) output");
    expect_phase(s, dbg, TP_PHASE_FORWARD, w, 0, 0, 1, "rowwise output S(0)");
    expect_phase(s, dbg, TP_PHASE_BACKWARD, w, 0, 1, 0, "rowwise output S(0)");
    tp_tensor_release(out);
    tp_module_free(m);

    tp_tensor_release(x);
    tp_comm_debug_free(dbg);
    tp_mesh_free(mesh);
    return TP_OK;
}

SIZES_PARAMS(rowwise_linear, 1, 2, 4)
ParameterizedTest(int *n, styles, rowwise_linear, .timeout = 60)
{
    sty_ctx c = {.w = *n};
    tp_test_run(*n, rowwise_linear_body, &c, c.slot);
}

/* ==== RowwiseParallel on Embedding ========================================== */

static tp_status rowwise_embedding_body(tp_comm *world, void *arg)
{
    sty_ctx *c = arg;
    tp_test_slot *s = SLOT(c, world);
    int w = c->w, r = tp_comm_rank(world);
    tp_mesh *mesh = NULL;
    tp_comm_debug *dbg = NULL;
    tp_tensor *idx = NULL, *idx8 = NULL, *out = NULL;
    tp_module *m = NULL;
    tp_style *st = NULL;
    RANK_OK(s, mesh1d(world, &mesh));
    RANK_OK(s, tp_comm_debug_create(&dbg));
    RANK_OK(s, arange_i64(2, (int64_t[]){4, 2}, &idx));
    RANK_OK(s, arange_i64(1, (int64_t[]){8}, &idx8));

    /* input_layouts = Replicate (and the Embedding default, also R) */
    for (int explicit_r = 1; explicit_r >= 0; explicit_r--) {
        const char *label = explicit_r ? "embedding rowwise input R" : "embedding rowwise default";
        RANK_OK(s, tp_nn_embedding_create(16, 16, &m));
        RANK_OK(s, tp_module_init(m, 7));
        tp_rowwise_options o = {0};
        if (explicit_r)
            o.input_layouts = tp_layout_of(tp_replicate());
        RANK_OK(s, tp_rowwise_parallel_create(&o, &st));
        RANK_OK(s, par_self(m, mesh, st));
        RANK_OK(s, run_counted(m, idx, true, dbg, &out));
        expect_shape(s, out, 3, (int64_t[]){4, 2, 16}, label);
        expect_phase(s, dbg, TP_PHASE_FORWARD, w, 1, 0, 0, label);
        expect_phase(s, dbg, TP_PHASE_BACKWARD, w, 0, 0, 0, label);
        tp_tensor_release(out);
        out = NULL;
        tp_module_free(m);
    }

    /* input R, output Shard(1), indices [8] */
    RANK_OK(s, tp_nn_embedding_create(16, 16, &m));
    RANK_OK(s, tp_module_init(m, 7));
    tp_rowwise_options o = {.input_layouts = tp_layout_of(tp_replicate()),
                            .output_layouts = tp_layout_of(tp_shard(1))};
    RANK_OK(s, tp_rowwise_parallel_create(&o, &st));
    RANK_OK(s, par_self(m, mesh, st));
    RANK_OK(s, run_counted(m, idx8, true, dbg, &out));
    expect_shape(s, out, 2, (int64_t[]){8, chunk_len(16, w, r)}, "embedding rowwise S(1)");
    expect_phase(s, dbg, TP_PHASE_FORWARD, w, 0, 0, 1, "embedding rowwise output S(1)");
    expect_phase(s, dbg, TP_PHASE_BACKWARD, w, 0, 1, 0, "embedding rowwise output S(1)");
    tp_tensor_release(out);
    tp_module_free(m);

    tp_tensor_release(idx);
    tp_tensor_release(idx8);
    tp_comm_debug_free(dbg);
    tp_mesh_free(mesh);
    return TP_OK;
}

SIZES_PARAMS(rowwise_embedding, 1, 2, 4)
ParameterizedTest(int *n, styles, rowwise_embedding, .timeout = 60)
{
    sty_ctx c = {.w = *n};
    tp_test_run(*n, rowwise_embedding_body, &c, c.slot);
}

/* ==== PrepareModuleInput / PrepareModuleOutput on Identity ================== */

static tp_status prepare_identity_body(tp_comm *world, void *arg)
{
    sty_ctx *c = arg;
    tp_test_slot *s = SLOT(c, world);
    int w = c->w;
    tp_mesh *mesh = NULL;
    tp_comm_debug *dbg = NULL;
    tp_tensor *x = NULL, *out = NULL, *full = NULL, *want = NULL;
    tp_module *m = NULL;
    tp_style *st = NULL;
    bool eq = false;
    RANK_OK(s, mesh1d(world, &mesh));
    RANK_OK(s, tp_comm_debug_create(&dbg));

    /* PrepareModuleInput S(0) -> R: the full tensor is ones(2W, 16) */
    RANK_OK(s, ones_t(2, (int64_t[]){2, 16}, &x));
    RANK_OK(s, ones_t(2, (int64_t[]){2 * w, 16}, &want));
    RANK_OK(s, tp_nn_identity_create(&m));
    tp_prepare_input_options pi = {.n_inputs = 1,
                                   .input_layouts = {tp_layout_of(tp_shard(0))},
                                   .n_desired = 1,
                                   .desired_input_layouts = {tp_layout_of(tp_replicate())}};
    RANK_OK(s, tp_prepare_module_input_create(&pi, &st));
    RANK_OK(s, par_self(m, mesh, st));
    RANK_OK(s, run_counted(m, x, false, dbg, &out));
    expect_phase(s, dbg, TP_PHASE_FORWARD, w, 0, 1, 0, "PrepareModuleInput S(0)->R");
    RANK_EXPECT(s, tp_tensor_is_dtensor(out), "PrepareModuleInput: output is not a DTensor");
    if (tp_tensor_is_dtensor(out)) {
        RANK_OK(s, tp_dtensor_full_tensor(out, &full));
        RANK_OK(s, tp_tensor_equal(full, want, &eq));
        RANK_EXPECT(s, eq, "PrepareModuleInput: full tensor is not ones(2W, 16)");
    }
    tp_tensor_release(full);
    tp_tensor_release(out);
    tp_tensor_release(x);
    tp_tensor_release(want);
    full = out = x = want = NULL;
    tp_module_free(m);

    /* PrepareModuleInput with use_local_output: the module sees a local tensor */
    RANK_OK(s, ones_t(2, (int64_t[]){2, 16}, &x));
    RANK_OK(s, tp_nn_identity_create(&m));
    pi.use_local_output = true;
    RANK_OK(s, tp_prepare_module_input_create(&pi, &st));
    RANK_OK(s, par_self(m, mesh, st));
    RANK_OK(s, run_counted(m, x, false, dbg, &out));
    RANK_EXPECT(s, !tp_tensor_is_dtensor(out), "PrepareModuleInput use_local_output: DTensor");
    expect_shape(s, out, 2, (int64_t[]){2 * w, 16}, "PrepareModuleInput use_local_output");
    tp_tensor_release(out);
    tp_tensor_release(x);
    out = x = NULL;
    tp_module_free(m);

    /* PrepareModuleOutput R -> S(0): this rank's ones(8/W, 16), no collective */
    RANK_OK(s, ones_t(2, (int64_t[]){8, 16}, &x));
    RANK_OK(s, ones_t(2, (int64_t[]){8 / w, 16}, &want));
    RANK_OK(s, tp_nn_identity_create(&m));
    tp_prepare_output_options po = {.n_outputs = 1,
                                    .output_layouts = {tp_layout_of(tp_replicate())},
                                    .n_desired = 1,
                                    .desired_output_layouts = {tp_layout_of(tp_shard(0))}};
    RANK_OK(s, tp_prepare_module_output_create(&po, &st));
    RANK_OK(s, par_self(m, mesh, st));
    RANK_OK(s, run_counted(m, x, false, dbg, &out));
    expect_phase(s, dbg, TP_PHASE_FORWARD, w, 0, 0, 0, "PrepareModuleOutput R->S(0)");
    RANK_EXPECT(s, !tp_tensor_is_dtensor(out), "PrepareModuleOutput: output is not local");
    RANK_OK(s, tp_tensor_equal(out, want, &eq));
    RANK_EXPECT(s, eq, "PrepareModuleOutput: output is not ones(8/W, 16)");
    tp_tensor_release(out);
    out = NULL;
    tp_module_free(m);

    /* the same with use_local_output TP_FLAG_FALSE: the output stays a DTensor
     * S(0) whose local shard is ones(8/W, 16) */
    RANK_OK(s, tp_nn_identity_create(&m));
    tp_prepare_output_options pk = po;
    pk.use_local_output = TP_FLAG_FALSE;
    RANK_OK(s, tp_prepare_module_output_create(&pk, &st));
    RANK_OK(s, par_self(m, mesh, st));
    RANK_OK(s, run_counted(m, x, false, dbg, &out));
    expect_phase(s, dbg, TP_PHASE_FORWARD, w, 0, 0, 0, "PrepareModuleOutput DTensor output");
    RANK_EXPECT(s, tp_tensor_is_dtensor(out), "PrepareModuleOutput use_local_output false: "
                "output is not a DTensor");
    if (tp_tensor_is_dtensor(out)) {
        RANK_EXPECT(s, tp_dtensor_placements(out)[0].kind == TP_PLACEMENT_SHARD &&
                           tp_dtensor_placements(out)[0].dim == 0,
                    "PrepareModuleOutput use_local_output false: output is not S(0)");
        RANK_OK(s, tp_tensor_equal(tp_dtensor_local(out), want, &eq));
        RANK_EXPECT(s, eq, "PrepareModuleOutput use_local_output false: local is not ones");
    }
    tp_tensor_release(out);
    tp_tensor_release(want);
    out = want = NULL;
    tp_module_free(m);

    /* PrepareModuleInputOutput: S(0) -> R in, R -> S(0) out gives x back */
    RANK_OK(s, rand_t(2, (int64_t[]){2, 16}, 100 + (uint64_t)tp_comm_rank(world), &want));
    RANK_OK(s, tp_nn_identity_create(&m));
    pi.use_local_output = TP_FLAG_FALSE;
    RANK_OK(s, tp_prepare_module_input_output_create(&pi, &po, &st));
    RANK_OK(s, par_self(m, mesh, st));
    RANK_OK(s, run_counted(m, want, false, dbg, &out));
    expect_phase(s, dbg, TP_PHASE_FORWARD, w, 0, 1, 0, "PrepareModuleInputOutput");
    RANK_OK(s, tp_tensor_equal(out, want, &eq));
    RANK_EXPECT(s, eq, "PrepareModuleInputOutput: S(0)->R->S(0) did not give the input back");
    tp_tensor_release(out);
    tp_tensor_release(want);
    tp_module_free(m);

    tp_tensor_release(x);
    tp_comm_debug_free(dbg);
    tp_mesh_free(mesh);
    return TP_OK;
}

SIZES_PARAMS(prepare_identity, 1, 2, 4)
ParameterizedTest(int *n, styles, prepare_identity, .timeout = 60)
{
    sty_ctx c = {.w = *n};
    tp_test_run(*n, prepare_identity_body, &c, c.slot);
}

/* ==== PrepareModuleInput with several inputs ================================ */

/* forward(x, y) = linear(x) + y */
static tp_status two_input_forward(tp_module *self, int nargs, tp_tensor *const *args, int nkw,
                                   const tp_kwarg *kw, tp_tensor **out)
{
    (void)nkw;
    (void)kw;
    if (nargs != 2 || !args[0] || !args[1])
        return TP_ERR_INVALID_ARG;
    tp_tensor *h = NULL;
    TP_TEST_TRY(tp_module_call(tp_module_child(self, "linear"), args[0], &h));
    tp_status st = tp_add(h, args[1], out);
    tp_tensor_release(h);
    return st;
}

static tp_status make_two_input(tp_module **out)
{
    tp_module *m = NULL, *lin = NULL;
    TP_TEST_TRY(tp_nn_custom_create("TestModule", two_input_forward, NULL, NULL, &m));
    tp_status st = tp_nn_linear_create(8, 8, true, &lin);
    if (st == TP_OK)
        st = tp_module_add_child(m, "linear", lin);
    else
        lin = NULL;
    if (st != TP_OK) {
        tp_module_free(lin);
        tp_module_free(m);
        return st;
    }
    st = tp_module_init(m, 3);
    if (st != TP_OK) {
        tp_module_free(m);
        return st;
    }
    *out = m;
    return TP_OK;
}

static tp_status multiple_inputs_body(tp_comm *world, void *arg)
{
    sty_ctx *c = arg;
    tp_test_slot *s = SLOT(c, world);
    int w = c->w;
    tp_mesh *mesh = NULL;
    tp_tensor *x = NULL, *y = NULL, *out = NULL;
    tp_module *m = NULL;
    tp_style *st = NULL;
    RANK_OK(s, mesh1d(world, &mesh));
    RANK_OK(s, rand_t(2, (int64_t[]){2, 8}, 5, &x));
    RANK_OK(s, ones_t(2, (int64_t[]){2 * w, 8 / w}, &y));

    /* one input layout for a module called with two inputs */
    RANK_OK(s, make_two_input(&m));
    RANK_OK(s, colwise(NULL, &st));
    RANK_OK(s, par_self(tp_module_child(m, "linear"), mesh, st));
    tp_prepare_input_options shortp = {.n_inputs = 1,
                                       .input_layouts = {tp_layout_of(tp_shard(0))},
                                       .n_desired = 1,
                                       .desired_input_layouts = {tp_layout_of(tp_replicate())}};
    RANK_OK(s, tp_prepare_module_input_create(&shortp, &st));
    RANK_OK(s, par_self(m, mesh, st));
    tp_tensor *args[2] = {x, y};
    tp_clear_error();
    tp_status e = tp_module_forward(m, 2, args, 0, NULL, &out);
    RANK_EXPECT(s, e == TP_ERR_INVALID_ARG &&
                       msg_has("module inputs and input_layouts should have same length"),
                "two inputs, one layout: %s (%s)", tp_status_name(e), tp_last_error());
    RANK_EXPECT(s, out == NULL, "failed forward left an output");
    tp_module_free(m);

    /* (S(0), None) -> (R, None) */
    RANK_OK(s, make_two_input(&m));
    RANK_OK(s, colwise(NULL, &st));
    RANK_OK(s, par_self(tp_module_child(m, "linear"), mesh, st));
    tp_prepare_input_options p2 = {
        .n_inputs = 2,
        .input_layouts = {tp_layout_of(tp_shard(0)), tp_layout_none()},
        .n_desired = 2,
        .desired_input_layouts = {tp_layout_of(tp_replicate()), tp_layout_none()}};
    RANK_OK(s, tp_prepare_module_input_create(&p2, &st));
    RANK_OK(s, par_self(m, mesh, st));
    RANK_OK(s, tp_module_forward(m, 2, args, 0, NULL, &out));
    expect_shape(s, out, 2, (int64_t[]){2 * w, 8 / w}, "(S(0), None) -> (R, None) output");
    tp_tensor_release(out);
    out = NULL;
    tp_module_free(m);

    /* a layout given for an input that is None */
    RANK_OK(s, make_two_input(&m));
    tp_prepare_input_options p3 = {
        .n_inputs = 2,
        .input_layouts = {tp_layout_of(tp_shard(0)), tp_layout_of(tp_shard(0))},
        .n_desired = 2,
        .desired_input_layouts = {tp_layout_of(tp_replicate()), tp_layout_of(tp_replicate())}};
    RANK_OK(s, tp_prepare_module_input_create(&p3, &st));
    RANK_OK(s, par_self(m, mesh, st));
    tp_tensor *args2[2] = {x, NULL};
    tp_clear_error();
    e = tp_module_forward(m, 2, args2, 0, NULL, &out);
    RANK_EXPECT(s, e == TP_ERR_INVALID_ARG && msg_has("input_layouts[1] is set but the input is None"),
                "layout for a None input: %s (%s)", tp_status_name(e), tp_last_error());
    tp_module_free(m);

    tp_tensor_release(x);
    tp_tensor_release(y);
    tp_mesh_free(mesh);
    return TP_OK;
}

SIZES_PARAMS(prepare_input_multiple_inputs, 1, 2, 4)
ParameterizedTest(int *n, styles, prepare_input_multiple_inputs, .timeout = 60)
{
    sty_ctx c = {.w = *n};
    tp_test_run(*n, multiple_inputs_body, &c, c.slot);
}

/* ==== PrepareModuleInput with keyword inputs ================================ */

static tp_tensor *kwarg_value(int nkw, const tp_kwarg *kw, const char *name)
{
    for (int i = 0; i < nkw; i++)
        if (kw[i].name && strcmp(kw[i].name, name) == 0)
            return kw[i].value;
    return NULL;
}

/* forward(x, *, y) = linear(x) + y (the seed's constant z = 2 is left out:
 * it issues no collective) */
static tp_status kwarg_forward(tp_module *self, int nargs, tp_tensor *const *args, int nkw,
                               const tp_kwarg *kw, tp_tensor **out)
{
    tp_tensor *y = kwarg_value(nkw, kw, "y");
    if (nargs != 1 || !args[0] || !y)
        return TP_ERR_INVALID_ARG;
    tp_tensor *h = NULL;
    TP_TEST_TRY(tp_module_call(tp_module_child(self, "linear"), args[0], &h));
    tp_status st = tp_add(h, y, out);
    tp_tensor_release(h);
    return st;
}

/* forward(*, x, z=None) = linear(x) (+ z when given) */
static tp_status kwarg_only_forward(tp_module *self, int nargs, tp_tensor *const *args, int nkw,
                                    const tp_kwarg *kw, tp_tensor **out)
{
    (void)args;
    tp_tensor *x = kwarg_value(nkw, kw, "x"), *z = kwarg_value(nkw, kw, "z");
    if (nargs != 0 || !x)
        return TP_ERR_INVALID_ARG;
    tp_tensor *h = NULL;
    TP_TEST_TRY(tp_module_call(tp_module_child(self, "linear"), x, &h));
    if (!z) {
        *out = h;
        return TP_OK;
    }
    tp_status st = tp_add(h, z, out);
    tp_tensor_release(h);
    return st;
}

static tp_status make_kw_module(const char *type, tp_forward_fn f, tp_mesh *mesh,
                                const tp_prepare_input_options *pi, tp_module **out)
{
    tp_module *m = NULL, *lin = NULL;
    tp_style *st = NULL;
    TP_TEST_TRY(tp_nn_custom_create(type, f, NULL, NULL, &m));
    tp_status e = tp_nn_linear_create(8, 8, true, &lin);
    if (e == TP_OK)
        e = tp_module_add_child(m, "linear", lin);
    else
        lin = NULL;
    if (e != TP_OK) {
        tp_module_free(lin);
        tp_module_free(m);
        return e;
    }
    /* ColwiseParallel(use_local_output=False) on the linear, then the input
     * preparation on the module: one plan */
    tp_colwise_options co = {.use_local_output = TP_FLAG_FALSE};
    tp_style *pstyle = NULL;
    e = tp_module_init(m, 4);
    if (e == TP_OK)
        e = tp_colwise_parallel_create(&co, &st);
    if (e == TP_OK)
        e = tp_prepare_module_input_create(pi, &pstyle);
    if (e == TP_OK) {
        tp_plan_entry plan[2] = {{"linear", st}, {"", pstyle}};
        e = tp_parallelize_module(m, mesh, 2, plan, NULL);
    }
    tp_style_free(st);
    tp_style_free(pstyle);
    if (e != TP_OK) {
        tp_module_free(m);
        return e;
    }
    *out = m;
    return TP_OK;
}

static tp_status kwargs_body(tp_comm *world, void *arg)
{
    sty_ctx *c = arg;
    tp_test_slot *s = SLOT(c, world);
    int w = c->w;
    tp_mesh *mesh = NULL;
    tp_comm_debug *dbg = NULL;
    tp_tensor *x = NULL, *xw = NULL, *one = NULL, *out = NULL, *xdt = NULL;
    tp_module *m = NULL;
    RANK_OK(s, mesh1d(world, &mesh));
    RANK_OK(s, tp_comm_debug_create(&dbg));
    RANK_OK(s, rand_t(2, (int64_t[]){1, 8}, 6, &x));
    RANK_OK(s, rand_t(2, (int64_t[]){w, 8}, 6, &xw));
    RANK_OK(s, ones_t(2, (int64_t[]){1, 8}, &one));

    /* y: S(0) -> R; one collective */
    tp_prepare_input_options p1 = {
        .n_kwargs = 1,
        .kwargs = {{"y", tp_layout_of(tp_shard(0)), tp_layout_of(tp_replicate())}}};
    RANK_OK(s, make_kw_module("TestKwargModule", kwarg_forward, mesh, &p1, &m));
    tp_kwarg kw1[1] = {{"y", one}};
    RANK_OK(s, tp_comm_debug_begin(dbg));
    tp_status e = tp_module_forward(m, 1, &xw, 1, kw1, &out);
    RANK_OK(s, tp_comm_debug_end(dbg));
    RANK_OK(s, e);
    RANK_EXPECT(s, tp_comm_debug_total(dbg) == (w > 1 ? 1 : 0),
                "kwarg module: %lld collectives, expected 1", (long long)tp_comm_debug_total(dbg));
    expect_shape(s, out, 2, (int64_t[]){w, 8}, "kwarg module output (global)");
    tp_tensor_release(out);
    out = NULL;
    tp_module_free(m);

    /* keyword-only: x and z S(0) -> R; two collectives */
    tp_prepare_input_options p2 = {
        .n_kwargs = 2,
        .kwargs = {{"x", tp_layout_of(tp_shard(0)), tp_layout_of(tp_replicate())},
                   {"z", tp_layout_of(tp_shard(0)), tp_layout_of(tp_replicate())}}};
    RANK_OK(s, make_kw_module("TestKwargOnlyModule", kwarg_only_forward, mesh, &p2, &m));
    tp_kwarg kw2[2] = {{"x", x}, {"z", one}};
    RANK_OK(s, tp_comm_debug_begin(dbg));
    e = tp_module_forward(m, 0, NULL, 2, kw2, &out);
    RANK_OK(s, tp_comm_debug_end(dbg));
    RANK_OK(s, e);
    RANK_EXPECT(s, tp_comm_debug_total(dbg) == (w > 1 ? 2 : 0),
                "kwarg-only module: %lld collectives, expected 2",
                (long long)tp_comm_debug_total(dbg));
    expect_shape(s, out, 2, (int64_t[]){w, 8}, "kwarg-only module output (global)");
    tp_tensor_release(out);
    out = NULL;

    /* x already a DTensor S(0): still two collectives */
    tp_placement s0 = tp_shard(0);
    RANK_OK(s, tp_dtensor_from_local(mesh, x, 1, &s0, NULL, &xdt));
    tp_kwarg kw3[2] = {{"x", xdt}, {"z", one}};
    RANK_OK(s, tp_comm_debug_begin(dbg));
    e = tp_module_forward(m, 0, NULL, 2, kw3, &out);
    RANK_OK(s, tp_comm_debug_end(dbg));
    RANK_OK(s, e);
    RANK_EXPECT(s, tp_comm_debug_total(dbg) == (w > 1 ? 2 : 0),
                "kwarg-only module, DTensor x: %lld collectives, expected 2",
                (long long)tp_comm_debug_total(dbg));
    expect_shape(s, out, 2, (int64_t[]){w, 8}, "kwarg-only module output, DTensor x");
    tp_tensor_release(out);
    out = NULL;

    /* z absent, or given as None: it passes; one collective (x) */
    for (int variant = 0; variant < 2; variant++) {
        tp_kwarg kw4[2] = {{"x", x}, {"z", NULL}};
        RANK_OK(s, tp_comm_debug_begin(dbg));
        e = tp_module_forward(m, 0, NULL, variant ? 2 : 1, kw4, &out);
        RANK_OK(s, tp_comm_debug_end(dbg));
        RANK_OK(s, e);
        RANK_EXPECT(s, tp_comm_debug_total(dbg) == (w > 1 ? 1 : 0),
                    "kwarg-only module, z %s: %lld collectives, expected 1",
                    variant ? "None" : "absent", (long long)tp_comm_debug_total(dbg));
        tp_tensor_release(out);
        out = NULL;
    }
    tp_module_free(m);

    tp_tensor_release(xdt);
    tp_tensor_release(x);
    tp_tensor_release(xw);
    tp_tensor_release(one);
    tp_comm_debug_free(dbg);
    tp_mesh_free(mesh);
    return TP_OK;
}

SIZES_PARAMS(prepare_input_kwargs, 1, 2, 3, 4)
ParameterizedTest(int *n, styles, prepare_input_kwargs, .timeout = 60)
{
    sty_ctx c = {.w = *n};
    tp_test_run(*n, kwargs_body, &c, c.slot);
}

/* ==== SequenceParallel ======================================================= */

static tp_status sequence_parallel_body(tp_comm *world, void *arg)
{
    sty_ctx *c = arg;
    tp_test_slot *s = SLOT(c, world);
    int w = c->w;
    tp_mesh *mesh = NULL;
    tp_comm_debug *dbg = NULL;
    tp_tensor *x = NULL, *out = NULL;
    tp_module *m = NULL;
    tp_style *st = NULL;
    RANK_OK(s, mesh1d(world, &mesh));
    RANK_OK(s, tp_comm_debug_create(&dbg));
    RANK_OK(s, rand_t(3, (int64_t[]){2, 3, 12}, 8 + (uint64_t)tp_comm_rank(world), &x));
    RANK_OK(s, tp_tensor_set_requires_grad(x, true));

    /* parameters become Replicate without any communication, even though
     * src_data_rank is rank 0 (the default) */
    RANK_OK(s, tp_nn_layer_norm_create(12, true, 1e-5, &m));
    RANK_OK(s, tp_module_init(m, 1));
    RANK_OK(s, tp_sequence_parallel_create(NULL, &st));
    RANK_OK(s, tp_comm_debug_begin(dbg));
    tp_status e = par_self(m, mesh, st);
    RANK_OK(s, tp_comm_debug_end(dbg));
    RANK_OK(s, e);
    RANK_EXPECT(s, tp_comm_debug_total(dbg) == 0, "SequenceParallel distribution issued %lld "
                "collectives", (long long)tp_comm_debug_total(dbg));
    tp_tensor *wgt = tp_module_parameter(m, "weight");
    RANK_EXPECT(s, wgt && tp_tensor_is_dtensor(wgt) &&
                       tp_dtensor_placements(wgt)[0].kind == TP_PLACEMENT_REPLICATE,
                "SequenceParallel: weight is not a Replicate DTensor");
    RANK_EXPECT(s, wgt && tp_tensor_requires_grad(wgt), "SequenceParallel: weight needs grad");
    RANK_OK(s, run_counted(m, x, false, dbg, &out));
    expect_phase(s, dbg, TP_PHASE_FORWARD, w, 0, 0, 0, "SequenceParallel forward");
    RANK_EXPECT(s, tp_tensor_is_dtensor(out), "SequenceParallel: output is not a DTensor");
    if (tp_tensor_is_dtensor(out)) {
        expect_shape(s, out, 3, (int64_t[]){2, 3 * w, 12}, "SequenceParallel global output");
        RANK_EXPECT(s, tp_dtensor_placements(out)[0].kind == TP_PLACEMENT_SHARD &&
                           tp_dtensor_placements(out)[0].dim == 1,
                    "SequenceParallel: output is not S(1)");
    }
    tp_tensor_release(out);
    out = NULL;
    tp_module_free(m);

    /* use_local_output; sequence_dim 0 */
    RANK_OK(s, tp_nn_layer_norm_create(12, true, 1e-5, &m));
    RANK_OK(s, tp_module_init(m, 1));
    tp_sequence_parallel_options so = {.sequence_dim = 0, .sequence_dim_set = true,
                                       .use_local_output = true};
    RANK_OK(s, tp_sequence_parallel_create(&so, &st));
    RANK_OK(s, par_self(m, mesh, st));
    RANK_OK(s, run_counted(m, x, true, dbg, &out));
    expect_phase(s, dbg, TP_PHASE_FORWARD, w, 0, 0, 0, "SequenceParallel(dim 0, local)");
    /* the norm's parameter gradients stay Partial: nothing in backward */
    expect_phase(s, dbg, TP_PHASE_BACKWARD, w, 0, 0, 0, "SequenceParallel(dim 0, local)");
    RANK_EXPECT(s, !tp_tensor_is_dtensor(out), "SequenceParallel use_local_output: DTensor");
    expect_shape(s, out, 3, (int64_t[]){2, 3, 12}, "SequenceParallel local output");
    tp_tensor_release(out);
    tp_module_free(m);

    tp_tensor_release(x);
    tp_comm_debug_free(dbg);
    tp_mesh_free(mesh);
    return TP_OK;
}

SIZES_PARAMS(sequence_parallel, 1, 2, 3, 4)
ParameterizedTest(int *n, styles, sequence_parallel, .timeout = 60)
{
    sty_ctx c = {.w = *n};
    tp_test_run(*n, sequence_parallel_body, &c, c.slot);
}

/* ==== numerical equality against the unparallelized module ================== */

typedef struct eq_case {
    const char *label;
    int module;      /* 0 Linear(12, 24), 1 Embedding(16, 12), 2 LayerNorm(12) */
    int style;       /* 0 colwise, 1 rowwise, 2 sequence parallel */
    tp_layout in;    /* style input layout (unset: default) */
    tp_layout outl;  /* style output layout (unset: default) */
    int in_shard;    /* the parallel module gets this rank's chunk of x on this dim; -1: all of x */
    int out_shard;   /* the local output is the chunk on this dim; -1: the whole output */
    bool out_dtensor;/* the output is a DTensor (full_tensor it) */
} eq_case;

static tp_status make_module(int which, tp_module **m)
{
    switch (which) {
    case 0:
        TP_TEST_TRY(tp_nn_linear_create(12, 24, true, m));
        break;
    case 1:
        TP_TEST_TRY(tp_nn_embedding_create(16, 12, m));
        break;
    default:
        TP_TEST_TRY(tp_nn_layer_norm_create(12, true, 1e-5, m));
        break;
    }
    return tp_module_init(*m, 1234);
}

static tp_status make_style(const eq_case *k, tp_style **s)
{
    if (k->style == 0) {
        tp_colwise_options o = {.input_layouts = k->in, .output_layouts = k->outl};
        return tp_colwise_parallel_create(&o, s);
    }
    if (k->style == 1) {
        tp_rowwise_options o = {.input_layouts = k->in, .output_layouts = k->outl};
        return tp_rowwise_parallel_create(&o, s);
    }
    return tp_sequence_parallel_create(NULL, s);
}

static tp_status gather_out(tp_mesh *mesh, tp_tensor *y, const tp_tensor *ref, const eq_case *k,
                            tp_tensor **full)
{
    if (k->out_dtensor)
        return tp_dtensor_full_tensor(y, full);
    if (k->out_shard < 0) {
        *full = tp_tensor_retain(y);
        return TP_OK;
    }
    tp_tensor *dt = NULL;
    tp_placement p = tp_shard(k->out_shard);
    tp_from_local_options fo = {.global_shape = tp_tensor_shape(ref)};
    TP_TEST_TRY(tp_dtensor_from_local(mesh, y, 1, &p, &fo, &dt));
    tp_status st = tp_dtensor_full_tensor(dt, full);
    tp_tensor_release(dt);
    return st;
}

static tp_status close_to(tp_test_slot *s, const tp_tensor *a, const tp_tensor *b,
                          const char *label, const char *what)
{
    bool ok = false;
    double diff = -1;
    if (!a || !b || !shape_is(a, tp_tensor_ndim(b), tp_tensor_shape(b))) {
        RANK_EXPECT(s, 0, "%s: %s missing or of the wrong shape", label, what);
        return TP_OK;
    }
    RANK_OK(s, tp_tensor_allclose(a, b, RTOL, ATOL, &ok));
    RANK_OK(s, tp_tensor_max_abs_diff(a, b, &diff));
    RANK_EXPECT(s, ok, "%s: %s differs from the unparallelized module (max |diff| %g)", label,
                what, diff);
    return TP_OK;
}

static tp_status check_equal(tp_test_slot *s, tp_mesh *mesh, const eq_case *k)
{
    int w = (int)tp_mesh_size(mesh, 0), r = (int)tp_mesh_coord(mesh, 0);
    tp_module *ref = NULL, *par = NULL;
    tp_style *st = NULL;
    tp_tensor *x = NULL, *xr = NULL, *xp = NULL, *yr = NULL, *yl = NULL, *yf = NULL, *g = NULL;
    RANK_OK(s, make_module(k->module, &ref));
    RANK_OK(s, make_module(k->module, &par));
    RANK_OK(s, make_style(k, &st));
    RANK_OK(s, par_self(par, mesh, st));
    bool is_float = k->module != 1;
    if (k->module == 0)
        RANK_OK(s, rand_t(2, (int64_t[]){12, 12}, 77, &x));
    else if (k->module == 2)
        RANK_OK(s, rand_t(3, (int64_t[]){2, 12, 12}, 77, &x));
    else {
        RANK_OK(s, tp_tensor_zeros(TP_I64, TP_CPU, 2, (int64_t[]){4, 3}, &x));
        RANK_OK(s, tp_tensor_fill_random(x, TP_RNG_RANDINT, 0, 16, 77, NULL, NULL));
    }
    RANK_OK(s, tp_tensor_clone(x, &xr));
    if (k->in_shard >= 0) {
        tp_tensor *ch = NULL;
        RANK_OK(s, tp_tensor_chunk(x, w, k->in_shard, r, &ch));
        RANK_OK(s, tp_tensor_clone(ch, &xp));
        tp_tensor_release(ch);
    } else {
        RANK_OK(s, tp_tensor_clone(x, &xp));
    }
    if (is_float) {
        RANK_OK(s, tp_tensor_set_requires_grad(xr, true));
        RANK_OK(s, tp_tensor_set_requires_grad(xp, true));
    }
    /* reference */
    RANK_OK(s, tp_module_call(ref, xr, &yr));
    RANK_OK(s, rand_t(tp_tensor_ndim(yr), tp_tensor_shape(yr), 99, &g));
    RANK_OK(s, tp_backward(yr, g));
    /* parallel */
    RANK_OK(s, tp_module_call(par, xp, &yl));
    RANK_EXPECT(s, tp_tensor_is_dtensor(yl) == k->out_dtensor, "%s: output %s a DTensor",
                k->label, tp_tensor_is_dtensor(yl) ? "is" : "is not");
    RANK_OK(s, gather_out(mesh, yl, yr, k, &yf));
    TP_TEST_TRY(close_to(s, yf, yr, k->label, "forward output"));
    RANK_OK(s, tp_backward(yf, g));
    if (is_float) {
        tp_tensor *gx = tp_tensor_grad(xr), *want = NULL;
        if (k->in_shard >= 0 && gx)
            RANK_OK(s, tp_tensor_chunk(gx, w, k->in_shard, r, &want));
        else
            want = tp_tensor_retain(gx);
        TP_TEST_TRY(close_to(s, tp_tensor_grad(xp), want, k->label, "input gradient"));
        tp_tensor_release(want);
    }
    const char *names[2] = {"weight", "bias"};
    for (int i = 0; i < 2; i++) {
        tp_tensor *pr = tp_module_parameter(ref, names[i]), *pp = tp_module_parameter(par, names[i]);
        if (!pr)
            continue;
        RANK_EXPECT(s, pp && tp_tensor_is_dtensor(pp), "%s: %s is not a DTensor", k->label,
                    names[i]);
        if (!pp || !tp_tensor_is_dtensor(pp))
            continue;
        tp_tensor *gd = tp_tensor_grad(pp), *gf = NULL;
        RANK_EXPECT(s, gd != NULL, "%s: %s got no gradient", k->label, names[i]);
        if (!gd)
            continue;
        RANK_OK(s, tp_tensor_is_dtensor(gd) ? tp_dtensor_full_tensor(gd, &gf)
                                            : tp_tensor_clone(gd, &gf));
        char what[48];
        snprintf(what, sizeof what, "%s gradient", names[i]);
        TP_TEST_TRY(close_to(s, gf, tp_tensor_grad(pr), k->label, what));
        tp_tensor_release(gf);
    }
    tp_tensor_release(x);
    tp_tensor_release(xr);
    tp_tensor_release(xp);
    tp_tensor_release(yr);
    tp_tensor_release(yl);
    tp_tensor_release(yf);
    tp_tensor_release(g);
    tp_module_free(ref);
    tp_module_free(par);
    return TP_OK;
}

static const eq_case eq_cases[] = {
    {"Linear colwise", 0, 0, {0}, {0}, -1, 1, false},
    {"Linear colwise input S(0)", 0, 0, {true, {TP_PLACEMENT_SHARD, 0, TP_SUM}}, {0}, 0, 1,
     false},
    {"Linear colwise output R", 0, 0, {0}, {true, {TP_PLACEMENT_REPLICATE, 0, TP_SUM}}, -1, -1,
     false},
    {"Linear rowwise", 0, 1, {0}, {0}, 1, -1, false},
    {"Linear rowwise output S(0)", 0, 1, {0}, {true, {TP_PLACEMENT_SHARD, 0, TP_SUM}}, 1, 0,
     false},
    {"Embedding colwise", 1, 0, {0}, {0}, -1, 2, false},
    {"Embedding rowwise", 1, 1, {0}, {0}, -1, -1, false},
    {"Embedding rowwise output S(1)", 1, 1, {0}, {true, {TP_PLACEMENT_SHARD, 1, TP_SUM}}, -1, 1,
     false},
    {"LayerNorm sequence parallel", 2, 2, {0}, {0}, 1, 1, true},
};

static tp_status equality_body(tp_comm *world, void *arg)
{
    sty_ctx *c = arg;
    tp_test_slot *s = SLOT(c, world);
    tp_mesh *mesh = NULL;
    RANK_OK(s, mesh1d(world, &mesh));
    for (size_t i = 0; i < sizeof eq_cases / sizeof eq_cases[0]; i++)
        TP_TEST_TRY(check_equal(s, mesh, &eq_cases[i]));
    tp_mesh_free(mesh);
    return TP_OK;
}

SIZES_PARAMS(equals_unparallelized, 1, 2, 3, 4)
ParameterizedTest(int *n, styles, equals_unparallelized, .timeout = 120)
{
    sty_ctx c = {.w = *n};
    tp_test_run(*n, equality_body, &c, c.slot);
}

/* ==== uneven sequence shards ================================================= */

/* A sequence-parallel block (DESIGN.md, PyTorch's TP tutorial): norm
 * SequenceParallel, w1 Colwise(input S(1)), w2 Rowwise(output S(1), DTensor
 * output), on a sequence length the ranks do not divide (4 and 5 on 3 ranks,
 * 4 and 12 on 8: some ranks hold one token or none).
 *   - A DTensor input carrying the global shape works as in PyTorch 2.15:
 *     forward all_gather 1 + reduce_scatter 1, backward the same; output,
 *     input gradient and parameter gradients equal the unparallelized block.
 *   - A plain input is taken to be evenly sharded (its global shape inferred
 *     from this rank's shard, as PyTorch's from_local does, which cannot
 *     know better): the ranks then disagree, and every rank returns
 *     TP_ERR_MISMATCH from the first collective, saying what to change. */
typedef struct seq_ctx {
    int w;
    int64_t seq;
    tp_test_slot slot[TP_TEST_MAX_RANKS];
} seq_ctx;

static tp_status seq_block(tp_module **out)
{
    tp_module *m = NULL, *c = NULL;
    TP_TEST_TRY(tp_nn_sequential_create(&m));
    tp_status st = tp_nn_layer_norm_create(8, true, 1e-5, &c);
    if (st == TP_OK && (st = tp_module_add_child(m, "norm", c)) != TP_OK)
        tp_module_free(c);
    if (st == TP_OK && (st = tp_nn_linear_create(8, 24, true, &c)) == TP_OK &&
        (st = tp_module_add_child(m, "w1", c)) != TP_OK)
        tp_module_free(c);
    if (st == TP_OK && (st = tp_nn_relu_create(&c)) == TP_OK &&
        (st = tp_module_add_child(m, "relu", c)) != TP_OK)
        tp_module_free(c);
    if (st == TP_OK && (st = tp_nn_linear_create(24, 8, true, &c)) == TP_OK &&
        (st = tp_module_add_child(m, "w2", c)) != TP_OK)
        tp_module_free(c);
    if (st == TP_OK)
        st = tp_module_init(m, 91);
    if (st != TP_OK) {
        tp_module_free(m);
        return st;
    }
    *out = m;
    return TP_OK;
}

static tp_status seq_parallelize(tp_module *m, tp_mesh *mesh)
{
    tp_style *sp = NULL, *col = NULL, *row = NULL;
    const tp_colwise_options co = {.input_layouts = tp_layout_of(tp_shard(1))};
    const tp_rowwise_options ro = {.output_layouts = tp_layout_of(tp_shard(1)),
                                   .use_local_output = TP_FLAG_FALSE};
    tp_status st = tp_sequence_parallel_create(NULL, &sp);
    if (st == TP_OK)
        st = tp_colwise_parallel_create(&co, &col);
    if (st == TP_OK)
        st = tp_rowwise_parallel_create(&ro, &row);
    if (st == TP_OK) {
        const tp_plan_entry plan[] = {{"norm", sp}, {"w1", col}, {"w2", row}};
        st = tp_parallelize_module(m, mesh, 3, plan, NULL);
    }
    tp_style_free(sp);
    tp_style_free(col);
    tp_style_free(row);
    return st;
}

static tp_status uneven_seq_body(tp_comm *world, void *arg)
{
    seq_ctx *c = arg;
    tp_test_slot *s = SLOT(c, world);
    int w = c->w, r = tp_comm_rank(world);
    char label[64];
    snprintf(label, sizeof label, "sequence %lld on %d ranks", (long long)c->seq, w);
    tp_mesh *mesh = NULL;
    tp_module *ref = NULL, *par = NULL;
    tp_comm_debug *dbg = NULL;
    tp_tensor *x = NULL, *xr = NULL, *ch = NULL, *xl = NULL, *xd = NULL, *g = NULL, *gd = NULL;
    tp_tensor *yr = NULL, *y = NULL, *yf = NULL;
    const int64_t shape[3] = {2, c->seq, 8};
    RANK_OK(s, mesh1d(world, &mesh));
    RANK_OK(s, seq_block(&ref));
    RANK_OK(s, seq_block(&par));
    RANK_OK(s, seq_parallelize(par, mesh));
    RANK_OK(s, rand_t(3, shape, 5, &x));
    RANK_OK(s, rand_t(3, shape, 6, &g));
    RANK_OK(s, tp_tensor_clone(x, &xr));
    RANK_OK(s, tp_tensor_set_requires_grad(xr, true));
    RANK_OK(s, tp_tensor_chunk(x, w, 1, r, &ch));
    RANK_OK(s, tp_tensor_clone(ch, &xl));
    RANK_OK(s, tp_tensor_set_requires_grad(xl, true));

    /* the reference */
    RANK_OK(s, tp_module_call(ref, xr, &yr));
    RANK_OK(s, tp_backward(yr, g));

    /* a DTensor input with its global shape */
    const tp_placement s1 = tp_shard(1);
    const tp_from_local_options fo = {.global_shape = shape};
    RANK_OK(s, tp_dtensor_from_local(mesh, xl, 1, &s1, &fo, &xd));
    RANK_OK(s, tp_dtensor_distribute(mesh, g, 1, &s1, -1, &gd));
    RANK_OK(s, tp_comm_debug_create(&dbg));
    RANK_OK(s, tp_comm_debug_begin(dbg));
    RANK_OK(s, tp_module_call(par, xd, &y));
    RANK_OK(s, tp_backward(y, gd));
    RANK_OK(s, tp_comm_debug_end(dbg));
    expect_phase(s, dbg, TP_PHASE_FORWARD, w, 0, 1, 1, label);
    expect_phase(s, dbg, TP_PHASE_BACKWARD, w, 0, 1, 1, label);
    expect_shape(s, y, 3, shape, label);
    RANK_OK(s, tp_dtensor_full_tensor(y, &yf));
    TP_TEST_TRY(close_to(s, yf, yr, label, "forward output"));
    tp_tensor *gx = NULL;
    RANK_OK(s, tp_tensor_chunk(tp_tensor_grad(xr), w, 1, r, &gx));
    TP_TEST_TRY(close_to(s, tp_tensor_grad(xl), gx, label, "input gradient"));
    tp_tensor_release(gx);
    static const char *const mods[3] = {"norm", "w1", "w2"};
    for (int i = 0; i < 3; i++)
        for (int k = 0; k < 2; k++) {
            const char *pn = k ? "bias" : "weight";
            tp_tensor *gp = tp_tensor_grad(tp_module_parameter(tp_module_child(par, mods[i]), pn));
            tp_tensor *gf = NULL;
            RANK_EXPECT(s, gp && tp_tensor_is_dtensor(gp), "%s: %s.%s has no DTensor gradient",
                        label, mods[i], pn);
            if (!gp || !tp_tensor_is_dtensor(gp))
                continue;
            RANK_OK(s, tp_dtensor_full_tensor(gp, &gf));
            char what[48];
            snprintf(what, sizeof what, "%s.%s gradient", mods[i], pn);
            TP_TEST_TRY(close_to(s, gf,
                                 tp_tensor_grad(tp_module_parameter(tp_module_child(ref, mods[i]),
                                                                    pn)),
                                 label, what));
            tp_tensor_release(gf);
        }

    /* a plain input: every rank fails at the first collective, naming the
     * fix (backends other than shm compare the ranks' collectives with the
     * descriptor check; without it the mismatched all_gather would time out) */
    RANK_OK(s, tp_comm_set_check(tp_mesh_comm(mesh, 0), true));
    tp_tensor *yp = NULL;
    tp_clear_error();
    tp_status st = tp_module_call(par, xl, &yp);
    char fix[96];
    snprintf(fix, sizeof fix, "pass a DTensor built with its global_shape, or make dim 1 "
             "divisible by %d", w);
    RANK_EXPECT(s, st == TP_ERR_MISMATCH && yp == NULL && strstr(tp_last_error(), "ranks disagree") &&
                       strstr(tp_last_error(), "ColwiseParallel at 'w1'") &&
                       strstr(tp_last_error(), fix),
                "%s, plain input: %s (%s)", label, tp_status_name(st), tp_last_error());
    tp_tensor_release(yp);

    tp_tensor_release(x);
    tp_tensor_release(xr);
    tp_tensor_release(ch);
    tp_tensor_release(xl);
    tp_tensor_release(xd);
    tp_tensor_release(g);
    tp_tensor_release(gd);
    tp_tensor_release(yr);
    tp_tensor_release(y);
    tp_tensor_release(yf);
    tp_comm_debug_free(dbg);
    tp_module_free(ref);
    tp_module_free(par);
    tp_mesh_free(mesh);
    return TP_OK;
}

typedef struct seq_param {
    int w;
    int64_t seq;
} seq_param;

ParameterizedTestParameters(styles, uneven_sequence_shards)
{
    static seq_param p[] = {{3, 4}, {3, 5}, {8, 4}, {8, 12}};
    return cr_make_param_array(seq_param, p, sizeof p / sizeof p[0]);
}

ParameterizedTest(seq_param *p, styles, uneven_sequence_shards, .timeout = 60)
{
    seq_ctx c = {.w = p->w, .seq = p->seq};
    tp_test_run(p->w, uneven_seq_body, &c, c.slot);
}

/* ==== the MLP of DESIGN.md ==================================================== */

/* net1 ColwiseParallel, net2 RowwiseParallel (sequence parallel: S(0) in
 * and out), as the seed's MLP test plans them. */
static tp_status parallelize_mlp(tp_module *m, tp_mesh *mesh, bool seq)
{
    tp_style *cs = NULL, *rs = NULL;
    tp_colwise_options co = {0};
    tp_rowwise_options ro = {0};
    if (seq) {
        co.input_layouts = tp_layout_of(tp_shard(0));
        ro.output_layouts = tp_layout_of(tp_shard(0));
    }
    tp_status st = tp_colwise_parallel_create(&co, &cs);
    if (st == TP_OK)
        st = tp_rowwise_parallel_create(&ro, &rs);
    if (st == TP_OK) {
        tp_plan_entry plan[2] = {{"net1", cs}, {"net2", rs}};
        st = tp_parallelize_module(m, mesh, 2, plan, NULL);
    }
    tp_style_free(cs);
    tp_style_free(rs);
    return st;
}

static tp_status make_mlp(tp_mesh *mesh, bool seq, tp_module **out)
{
    tp_module *m = NULL, *a = NULL, *relu = NULL, *b = NULL;
    TP_TEST_TRY(tp_nn_sequential_create(&m));
    tp_status st = tp_nn_linear_create(10, 16, true, &a);
    if (st == TP_OK)
        st = tp_module_add_child(m, "net1", a);
    else
        a = NULL;
    if (st != TP_OK) {
        tp_module_free(a);
        tp_module_free(m);
        return st;
    }
    st = tp_nn_relu_create(&relu);
    if (st == TP_OK)
        st = tp_module_add_child(m, "relu", relu);
    else
        relu = NULL;
    if (st != TP_OK) {
        tp_module_free(relu);
        tp_module_free(m);
        return st;
    }
    st = tp_nn_linear_create(16, 10, true, &b);
    if (st == TP_OK)
        st = tp_module_add_child(m, "net2", b);
    else
        b = NULL;
    if (st != TP_OK) {
        tp_module_free(b);
        tp_module_free(m);
        return st;
    }
    st = tp_module_init(m, 5);
    if (st == TP_OK)
        st = parallelize_mlp(m, mesh, seq);
    if (st != TP_OK) {
        tp_module_free(m);
        return st;
    }
    *out = m;
    return TP_OK;
}

static tp_status mlp_body(tp_comm *world, void *arg)
{
    sty_ctx *c = arg;
    tp_test_slot *s = SLOT(c, world);
    int w = c->w;
    tp_mesh *mesh = NULL;
    tp_comm_debug *dbg = NULL;
    tp_tensor *x = NULL, *out = NULL;
    tp_module *m = NULL;
    RANK_OK(s, mesh1d(world, &mesh));
    RANK_OK(s, tp_comm_debug_create(&dbg));
    RANK_OK(s, rand_t(2, (int64_t[]){8, 10}, 12 + (uint64_t)tp_comm_rank(world), &x));

    RANK_OK(s, make_mlp(mesh, false, &m));
    RANK_OK(s, run_counted(m, x, true, dbg, &out));
    expect_shape(s, out, 2, (int64_t[]){8, 10}, "MLP output");
    expect_phase(s, dbg, TP_PHASE_FORWARD, w, 1, 0, 0, "MLP");
    expect_phase(s, dbg, TP_PHASE_BACKWARD, w, 0, 0, 0, "MLP");
    RANK_EXPECT(s, tp_comm_debug_count(dbg, TP_COLL_ALL_REDUCE) == (w > 1 ? 1 : 0) &&
                       tp_comm_debug_total(dbg) == (w > 1 ? 1 : 0),
                "MLP: %lld collectives in all", (long long)tp_comm_debug_total(dbg));
    /* the per-module scopes, by plan FQN ("" the root): the all_reduce
     * belongs to net2; every module was seen, also at W = 1 */
    const int64_t one = w > 1 ? 1 : 0;
    tp_test_scope_count_is(s, dbg, TP_COMM_DEBUG_ROOT, TP_PHASE_FORWARD, TP_COLL_ALL_REDUCE, one,
                           "MLP");
    tp_test_scope_count_is(s, dbg, "net1", TP_PHASE_COUNT, TP_COLL_ANY, 0, "MLP");
    tp_test_scope_count_is(s, dbg, "relu", TP_PHASE_COUNT, TP_COLL_ANY, 0, "MLP");
    tp_test_scope_count_is(s, dbg, "net2", TP_PHASE_FORWARD, TP_COLL_ALL_REDUCE, one, "MLP");
    tp_test_scope_count_is(s, dbg, "net2", TP_PHASE_COUNT, TP_COLL_ANY, one, "MLP");
    int64_t unseen = -1;
    RANK_EXPECT(s, tp_comm_debug_scope_count(dbg, "Sequential.net2", TP_PHASE_COUNT, TP_COLL_ANY,
                                             &unseen) == TP_ERR_INVALID_ARG && unseen == 0 &&
                       strstr(tp_last_error(), "\"Sequential.net2\" was never entered"),
                "MLP: \"Sequential.net2\" is not a scope: %s", tp_last_error());
    tp_tensor *w1 = tp_module_parameter(tp_module_child(m, "net1"), "weight");
    RANK_EXPECT(s, w1 && tp_tensor_grad(w1), "MLP: net1.weight got no gradient");
    tp_tensor_release(out);
    out = NULL;
    tp_module_free(m);

    /* sequence parallel: all_gather 2, reduce_scatter 1 */
    RANK_OK(s, make_mlp(mesh, true, &m));
    RANK_OK(s, run_counted(m, x, true, dbg, &out));
    expect_shape(s, out, 2, (int64_t[]){8, 10}, "sequence-parallel MLP output");
    expect_phase(s, dbg, TP_PHASE_FORWARD, w, 0, 1, 1, "sequence-parallel MLP");
    expect_phase(s, dbg, TP_PHASE_BACKWARD, w, 0, 1, 0, "sequence-parallel MLP");
    RANK_EXPECT(s, tp_comm_debug_count(dbg, TP_COLL_ALL_GATHER) == (w > 1 ? 2 : 0) &&
                       tp_comm_debug_count(dbg, TP_COLL_REDUCE_SCATTER) == (w > 1 ? 1 : 0) &&
                       tp_comm_debug_total(dbg) == (w > 1 ? 3 : 0),
                "sequence-parallel MLP: %lld collectives in all",
                (long long)tp_comm_debug_total(dbg));
    /* net1 gathers its S(0) input, net2 reduce-scatters its output, and the
     * backward of that reduce_scatter gathers in net2's scope */
    tp_test_scope_count_is(s, dbg, "net1", TP_PHASE_FORWARD, TP_COLL_ALL_GATHER, one, "SP MLP");
    tp_test_scope_count_is(s, dbg, "net1", TP_PHASE_BACKWARD, TP_COLL_ANY, 0, "SP MLP");
    tp_test_scope_count_is(s, dbg, "net2", TP_PHASE_FORWARD, TP_COLL_REDUCE_SCATTER, one,
                           "SP MLP");
    tp_test_scope_count_is(s, dbg, "net2", TP_PHASE_BACKWARD, TP_COLL_ALL_GATHER, one, "SP MLP");
    tp_test_scope_count_is(s, dbg, TP_COMM_DEBUG_ROOT, TP_PHASE_COUNT, TP_COLL_ANY, 3 * one,
                           "SP MLP");
    tp_tensor_release(out);
    out = NULL;

    /* counting the backward only: its nodes re-enter the scopes of the
     * modules that recorded them, the root's included */
    tp_tensor *l = NULL;
    RANK_OK(s, tp_module_call(m, x, &out));
    RANK_OK(s, tp_sum_all(out, &l));
    RANK_OK(s, tp_comm_debug_begin(dbg));
    tp_status bst = tp_backward(l, NULL);
    RANK_OK(s, tp_comm_debug_end(dbg));
    tp_tensor_release(l);
    RANK_OK(s, bst);
    tp_test_scope_count_is(s, dbg, "net2", TP_PHASE_BACKWARD, TP_COLL_ALL_GATHER, one,
                           "SP MLP, backward only");
    tp_test_scope_count_is(s, dbg, TP_COMM_DEBUG_ROOT, TP_PHASE_BACKWARD, TP_COLL_ALL_GATHER, one,
                           "SP MLP, backward only");
    tp_test_scope_count_is(s, dbg, "net1", TP_PHASE_COUNT, TP_COLL_ANY, 0,
                           "SP MLP, backward only");
    tp_test_scope_count_is(s, dbg, TP_COMM_DEBUG_GLOBAL, TP_PHASE_COUNT, TP_COLL_ANY, one,
                           "SP MLP, backward only");
    tp_tensor_release(out);
    tp_module_free(m);

    tp_tensor_release(x);
    tp_comm_debug_free(dbg);
    tp_mesh_free(mesh);
    return TP_OK;
}

SIZES_PARAMS(mlp_counts, 1, 2, 3, 4)
ParameterizedTest(int *n, styles, mlp_counts, .timeout = 60)
{
    sty_ctx c = {.w = *n};
    tp_test_run(*n, mlp_body, &c, c.slot);
}

/* ==== the MLP with its GELU fused into net1 ======================================= */

/* Sequential(net1 Linear 10->16, [act GELU(tanh)], net2 Linear 16->10),
 * seed 5; fused: the GELU fused into net1 (tp_nn_linear_fuse_gelu) and no
 * act. With a mesh: net1 colwise, net2 rowwise (sequence parallel: S(0) in
 * and out). */
static tp_status make_gelu_mlp(tp_mesh *mesh, bool seq, bool fused, tp_module **out)
{
    tp_module *m = NULL, *child = NULL;
    TP_TEST_TRY(tp_nn_sequential_create(&m));
    tp_status st = tp_nn_linear_create(10, 16, true, &child);
    if (st == TP_OK && fused)
        st = tp_nn_linear_fuse_gelu(child, TP_GELU_TANH);
    if (st == TP_OK)
        st = tp_module_add_child(m, "net1", child), child = st == TP_OK ? NULL : child;
    if (st == TP_OK && !fused) {
        st = tp_nn_gelu_create(TP_GELU_TANH, &child);
        if (st == TP_OK)
            st = tp_module_add_child(m, "act", child), child = st == TP_OK ? NULL : child;
    }
    if (st == TP_OK)
        st = tp_nn_linear_create(16, 10, true, &child);
    if (st == TP_OK)
        st = tp_module_add_child(m, "net2", child), child = st == TP_OK ? NULL : child;
    if (st == TP_OK)
        st = tp_module_init(m, 5);
    if (st == TP_OK && mesh)
        st = parallelize_mlp(m, mesh, seq);
    tp_module_free(child);
    if (st != TP_OK) {
        tp_module_free(m);
        return st;
    }
    *out = m;
    return TP_OK;
}

/* The full gradient of a parameter of m (a DTensor's gathered). */
static tp_status param_grad(tp_module *m, const char *fqn, tp_tensor **out)
{
    char mod[32];
    const char *dot = strchr(fqn, '.');
    snprintf(mod, sizeof mod, "%.*s", (int)(dot - fqn), fqn);
    tp_tensor *p = tp_module_parameter(tp_module_find(m, mod), dot + 1);
    tp_tensor *g = p ? tp_tensor_grad(p) : NULL;
    if (!g)
        return TP_ERR_STATE;
    if (tp_tensor_is_dtensor(g))
        return tp_dtensor_full_tensor(g, out);
    *out = tp_tensor_retain(g);
    return TP_OK;
}

static tp_status fused_mlp_body(tp_comm *world, void *arg)
{
    sty_ctx *c = arg;
    tp_test_slot *s = SLOT(c, world);
    int w = c->w;
    tp_mesh *mesh = NULL;
    tp_comm_debug *dbg = NULL;
    tp_tensor *x = NULL, *yr = NULL, *yf = NULL;
    tp_module *ref = NULL, *m = NULL;
    RANK_OK(s, mesh1d(world, &mesh));
    RANK_OK(s, tp_comm_debug_create(&dbg));
    RANK_OK(s, rand_t(2, (int64_t[]){8, 10}, 12, &x)); /* the same on every rank */

    /* the unparallelized, unfused MLP against the fused one parallelized:
     * the same values, and the MLP's collectives of DESIGN.md (forward one
     * all_reduce, backward none) */
    RANK_OK(s, make_gelu_mlp(NULL, false, false, &ref));
    RANK_OK(s, run_counted(ref, x, true, dbg, &yr));
    RANK_OK(s, make_gelu_mlp(mesh, false, true, &m));
    RANK_OK(s, run_counted(m, x, true, dbg, &yf));
    expect_phase(s, dbg, TP_PHASE_FORWARD, w, 1, 0, 0, "fused MLP");
    expect_phase(s, dbg, TP_PHASE_BACKWARD, w, 0, 0, 0, "fused MLP");
    RANK_EXPECT(s, tp_comm_debug_total(dbg) == (w > 1 ? 1 : 0), "fused MLP: %lld collectives",
                (long long)tp_comm_debug_total(dbg));
    TP_TEST_TRY(close_to(s, yf, yr, "fused MLP", "the output"));
    const char *fqns[4] = {"net1.weight", "net1.bias", "net2.weight", "net2.bias"};
    for (int i = 0; i < 4; i++) {
        tp_tensor *gr = NULL, *gf = NULL;
        RANK_OK(s, param_grad(ref, fqns[i], &gr));
        RANK_OK(s, param_grad(m, fqns[i], &gf));
        TP_TEST_TRY(close_to(s, gf, gr, "fused MLP", fqns[i]));
        tp_tensor_release(gr);
        tp_tensor_release(gf);
    }
    tp_tensor_release(yf);
    yf = NULL;
    tp_module_free(m);
    m = NULL;

    /* sequence parallel: all_gather + reduce_scatter forward, all_gather
     * backward, as unfused */
    RANK_OK(s, make_gelu_mlp(mesh, true, true, &m));
    RANK_OK(s, run_counted(m, x, true, dbg, &yf));
    expect_phase(s, dbg, TP_PHASE_FORWARD, w, 0, 1, 1, "sequence-parallel fused MLP");
    expect_phase(s, dbg, TP_PHASE_BACKWARD, w, 0, 1, 0, "sequence-parallel fused MLP");
    expect_shape(s, yf, 2, (int64_t[]){8, 10}, "sequence-parallel fused MLP output");
    tp_tensor_release(yf);
    tp_module_free(m);
    m = NULL;

    /* RowwiseParallel on a fused Linear is refused before anything moves,
     * and a Linear split along its input features cannot be fused */
    RANK_OK(s, make_gelu_mlp(NULL, false, true, &m));
    tp_style *rs = NULL;
    RANK_OK(s, tp_rowwise_parallel_create(NULL, &rs));
    tp_plan_entry bad = {"net1", rs};
    tp_status st = tp_parallelize_module(m, mesh, 1, &bad, NULL);
    RANK_EXPECT(s, st == TP_ERR_INVALID_ARG &&
                       msg_has("RowwiseParallel cannot shard a Linear with a fused GELU at 'net1'"),
                "rowwise on a fused Linear: %s %s", tp_status_name(st), tp_last_error());
    tp_tensor *w1 = tp_module_parameter(tp_module_child(m, "net1"), "weight");
    RANK_EXPECT(s, w1 && !tp_tensor_is_dtensor(w1), "the refused plan sharded net1.weight");
    tp_plan_entry ok = {"net2", rs};
    RANK_OK(s, tp_parallelize_module(m, mesh, 1, &ok, NULL));
    st = tp_nn_linear_fuse_gelu(tp_module_child(m, "net2"), TP_GELU_TANH);
    RANK_EXPECT(s, st == TP_ERR_INVALID_ARG && msg_has("split along its input features"),
                "fusing a rowwise Linear: %s %s", tp_status_name(st), tp_last_error());
    RANK_EXPECT(s, !tp_nn_linear_fused_gelu(tp_module_child(m, "net2"), NULL),
                "the refused fusion took effect");
    tp_gelu_approx ap = TP_GELU_EXACT;
    RANK_EXPECT(s, tp_nn_linear_fused_gelu(tp_module_child(m, "net1"), &ap) && ap == TP_GELU_TANH,
                "net1 is not reported fused (tanh)");
    tp_style_free(rs);
    tp_module_free(m);
    m = NULL;

    tp_module_free(ref);
    tp_tensor_release(yr);
    tp_tensor_release(x);
    tp_comm_debug_free(dbg);
    tp_mesh_free(mesh);
    return TP_OK;
}

SIZES_PARAMS(fused_gelu_mlp, 1, 2, 3, 4, 8)
ParameterizedTest(int *n, styles, fused_gelu_mlp, .timeout = 60)
{
    sty_ctx c = {.w = *n};
    tp_test_run(*n, fused_mlp_body, &c, c.slot);
}

Test(styles, fuse_gelu_refusals, .timeout = 10)
{
    tp_module *g = NULL, *l = NULL;
    CHECK_OK(tp_nn_gelu_create(TP_GELU_TANH, &g));
    tp_status st = tp_nn_linear_fuse_gelu(g, TP_GELU_TANH);
    cr_assert(st == TP_ERR_INVALID_ARG && msg_has("tp_nn_linear_fuse_gelu: the module is a GELU, "
                                                  "not a Linear"),
              "%s", tp_last_error());
    st = tp_nn_linear_fuse_gelu(NULL, TP_GELU_TANH);
    cr_assert(st == TP_ERR_INVALID_ARG && msg_has("linear is NULL"), "%s", tp_last_error());
    CHECK_OK(tp_nn_linear_create(4, 4, false, &l));
    st = tp_nn_linear_fuse_gelu(l, (tp_gelu_approx)3);
    cr_assert(st == TP_ERR_INVALID_ARG && msg_has("approx 3 is neither"), "%s", tp_last_error());
    cr_assert(!tp_nn_linear_fused_gelu(l, NULL) && !tp_nn_linear_fused_gelu(g, NULL) &&
              !tp_nn_linear_fused_gelu(NULL, NULL));
    CHECK_OK(tp_nn_linear_fuse_gelu(l, TP_GELU_EXACT));
    cr_assert_str_eq(tp_module_type_name(l), "Linear");
    tp_gelu_approx ap = TP_GELU_TANH;
    cr_assert(tp_nn_linear_fused_gelu(l, &ap) && ap == TP_GELU_EXACT);
    tp_module_free(g);
    tp_module_free(l);
}

/* ==== FQN matching ============================================================= */

Test(styles, fqn_match, .timeout = 10)
{
    cr_assert(tp_fqn_match("layers.*.attention.wq", "layers.0.attention.wq"));
    cr_assert(tp_fqn_match("layers.*.attention.wq", "layers.11.attention.wq"));
    cr_assert(!tp_fqn_match("layers.*.attention.wq", "layers.0.attention.wk"));
    cr_assert(!tp_fqn_match("layers.*.attention.wq", "layers.0.1.attention.wq"));
    cr_assert(!tp_fqn_match("layers.*.attention.wq", "layers.attention.wq"));
    cr_assert(!tp_fqn_match("layers.*", "layers.0.attention"));
    cr_assert(tp_fqn_match("net[12]", "net1"));
    cr_assert(tp_fqn_match("net[12]", "net2"));
    cr_assert(!tp_fqn_match("net[12]", "net3"));
    cr_assert(!tp_fqn_match("net[12]", "net12"));
    cr_assert(tp_fqn_match("net?", "net7"));
    cr_assert(tp_fqn_match("", ""));
    cr_assert(!tp_fqn_match("", "net1"));
    cr_assert(!tp_fqn_match("net1", ""));
    cr_assert(!tp_fqn_match("*", ""), "\"*\" matches children, not the module itself");
    cr_assert(tp_fqn_match("*", "net1"));
    cr_assert(!tp_fqn_match("*", "a.b"));
    cr_assert(tp_fqn_match("*.*", "a.b"));
    cr_assert(tp_fqn_match("a.b.c", "a.b.c"));
    cr_assert(!tp_fqn_match("a.b.c", "a.b.cd"));
    cr_assert(!tp_fqn_match("a.b", "a.b.c"));
    cr_assert(!tp_fqn_match(NULL, "a"));
    cr_assert(!tp_fqn_match("a", NULL));
}

/* ==== tp_parallelize_module: plans and errors ============================== */

/* root (container)
 *   layers.{0,1}.attention.{wq, wk}: Linear(8, 8)
 *   layers.{0,1}.norm:               LayerNorm(8)
 *   net1, net2:                      Linear(8, 8) */
static tp_status make_tree(tp_module **out)
{
    tp_module *root = NULL, *layers = NULL;
    TP_TEST_TRY(tp_nn_container_create(&root));
    tp_status st = tp_nn_container_create(&layers);
    if (st == TP_OK && (st = tp_module_add_child(root, "layers", layers)) != TP_OK)
        tp_module_free(layers);
    for (int i = 0; i < 2 && st == TP_OK; i++) {
        tp_module *layer = NULL, *att = NULL, *q = NULL, *k = NULL, *norm = NULL;
        char name[8];
        snprintf(name, sizeof name, "%d", i);
        if ((st = tp_nn_container_create(&layer)) != TP_OK)
            break;
        if ((st = tp_module_add_child(layers, name, layer)) != TP_OK) {
            tp_module_free(layer);
            break;
        }
        if ((st = tp_nn_container_create(&att)) != TP_OK)
            break;
        if ((st = tp_module_add_child(layer, "attention", att)) != TP_OK) {
            tp_module_free(att);
            break;
        }
        if ((st = tp_nn_linear_create(8, 8, true, &q)) != TP_OK)
            break;
        if ((st = tp_module_add_child(att, "wq", q)) != TP_OK) {
            tp_module_free(q);
            break;
        }
        if ((st = tp_nn_linear_create(8, 8, false, &k)) != TP_OK)
            break;
        if ((st = tp_module_add_child(att, "wk", k)) != TP_OK) {
            tp_module_free(k);
            break;
        }
        if ((st = tp_nn_layer_norm_create(8, true, 1e-5, &norm)) != TP_OK)
            break;
        if ((st = tp_module_add_child(layer, "norm", norm)) != TP_OK) {
            tp_module_free(norm);
            break;
        }
    }
    for (int i = 1; i <= 2 && st == TP_OK; i++) {
        tp_module *n = NULL;
        char name[8];
        snprintf(name, sizeof name, "net%d", i);
        if ((st = tp_nn_linear_create(8, 8, true, &n)) != TP_OK)
            break;
        if ((st = tp_module_add_child(root, name, n)) != TP_OK)
            tp_module_free(n);
    }
    if (st == TP_OK)
        st = tp_module_init(root, 9);
    if (st != TP_OK) {
        tp_module_free(root);
        return st;
    }
    *out = root;
    return TP_OK;
}

static bool is_dt_with(const tp_tensor *t, tp_placement_kind kind, int dim)
{
    if (!t || !tp_tensor_is_dtensor(t))
        return false;
    tp_placement p = tp_dtensor_placements(t)[0];
    return p.kind == kind && (kind != TP_PLACEMENT_SHARD || p.dim == dim);
}

static tp_status plan_body(tp_comm *world, void *arg)
{
    sty_ctx *c = arg;
    tp_test_slot *s = SLOT(c, world);
    tp_mesh *mesh = NULL;
    tp_module *root = NULL;
    tp_style *col = NULL, *row = NULL, *seq = NULL;
    tp_comm_debug *dbg = NULL;
    RANK_OK(s, mesh1d(world, &mesh));
    RANK_OK(s, tp_comm_debug_create(&dbg));
    RANK_OK(s, tp_colwise_parallel_create(NULL, &col));
    RANK_OK(s, tp_rowwise_parallel_create(NULL, &row));
    RANK_OK(s, tp_sequence_parallel_create(NULL, &seq));
    RANK_OK(s, make_tree(&root));

    /* an unmatched entry: an error naming it, and nothing applied */
    int unmatched[8] = {-1, -1, -1, -1, -1, -1, -1, -1}, n_unmatched = -1;
    tp_parallelize_options opts = {.unmatched = unmatched, .n_unmatched = &n_unmatched};
    tp_plan_entry plan[5] = {{"layers.*.attention.wq", col},
                             {"layers.*.attention.wk", col},
                             {"layers.*.attention.wo", row},
                             {"layers.*.norm", seq},
                             {"net[9]", row}};
    tp_clear_error();
    tp_status e = tp_parallelize_module(root, mesh, 5, plan, &opts);
    RANK_EXPECT(s, e == TP_ERR_INVALID_ARG && msg_has("layers.*.attention.wo"),
                "unmatched entry: %s (%s)", tp_status_name(e), tp_last_error());
    RANK_EXPECT(s, n_unmatched == 2 && unmatched[0] == 2 && unmatched[1] == 4,
                "unmatched: n %d [%d, %d], expected 2 [2, 4]", n_unmatched, unmatched[0],
                unmatched[1]);
    tp_tensor *wq0 = tp_module_parameter(tp_module_find(root, "layers.0.attention.wq"), "weight");
    RANK_EXPECT(s, wq0 && !tp_tensor_is_dtensor(wq0), "a failed plan changed layers.0.attention.wq");

    /* allow_unmatched: the rest applies; one scatter per distributed
     * parameter (wq weight + bias, wk weight, twice: all sharded), none for
     * the norms */
    opts.allow_unmatched = true;
    RANK_OK(s, tp_comm_debug_begin(dbg));
    e = tp_parallelize_module(root, mesh, 5, plan, &opts);
    RANK_OK(s, tp_comm_debug_end(dbg));
    RANK_EXPECT(s, e == TP_OK, "allow_unmatched: %s (%s)", tp_status_name(e), tp_last_error());
    RANK_EXPECT(s, n_unmatched == 2, "allow_unmatched: n_unmatched %d", n_unmatched);
    int64_t sc = tp_comm_debug_count(dbg, TP_COLL_SCATTER);
    /* (tp_dtensor_distribute scatters from src_data_rank 0 even on one rank) */
    RANK_EXPECT(s, sc == 6 && tp_comm_debug_total(dbg) == sc,
                "parallelize issued %lld scatters (%lld collectives), expected 6",
                (long long)sc, (long long)tp_comm_debug_total(dbg));
    for (int i = 0; i < 2; i++) {
        char f[64];
        snprintf(f, sizeof f, "layers.%d.attention.wq", i);
        tp_module *q = tp_module_find(root, f);
        RANK_EXPECT(s, q && is_dt_with(tp_module_parameter(q, "weight"), TP_PLACEMENT_SHARD, 0) &&
                           is_dt_with(tp_module_parameter(q, "bias"), TP_PLACEMENT_SHARD, 0),
                    "%s is not colwise-sharded", f);
        snprintf(f, sizeof f, "layers.%d.attention.wk", i);
        tp_module *k = tp_module_find(root, f);
        RANK_EXPECT(s, k && is_dt_with(tp_module_parameter(k, "weight"), TP_PLACEMENT_SHARD, 0) &&
                           tp_module_parameter(k, "bias") == NULL,
                    "%s is not colwise-sharded", f);
        snprintf(f, sizeof f, "layers.%d.norm", i);
        tp_module *nm = tp_module_find(root, f);
        RANK_EXPECT(s, nm && is_dt_with(tp_module_parameter(nm, "weight"),
                                        TP_PLACEMENT_REPLICATE, 0),
                    "%s is not replicated", f);
    }
    RANK_EXPECT(s, !tp_tensor_is_dtensor(tp_module_parameter(tp_module_child(root, "net1"), "weight")),
                "net1 was touched");

    /* a second parameter-sharding style on the same module */
    tp_plan_entry again = {"layers.0.attention.wq", row};
    tp_clear_error();
    e = tp_parallelize_module(root, mesh, 1, &again, NULL);
    RANK_EXPECT(s, e == TP_ERR_INVALID_ARG && msg_has("'layers.0.attention.wq'") &&
                       msg_has("ColwiseParallel") && msg_has("RowwiseParallel"),
                "second sharding style: %s (%s)", tp_status_name(e), tp_last_error());

    /* two sharding styles for one module inside one plan: nothing applied */
    tp_plan_entry twice[2] = {{"net1", col}, {"net[1]", row}};
    tp_clear_error();
    e = tp_parallelize_module(root, mesh, 2, twice, NULL);
    RANK_EXPECT(s, e == TP_ERR_INVALID_ARG && msg_has("'net1'") && msg_has("ColwiseParallel") &&
                       msg_has("RowwiseParallel"),
                "two sharding styles in one plan: %s (%s)", tp_status_name(e), tp_last_error());
    RANK_EXPECT(s, !tp_tensor_is_dtensor(tp_module_parameter(tp_module_child(root, "net1"), "weight")),
                "a failed plan changed net1");

    /* Colwise on a LayerNorm; Rowwise on a container (the root) */
    tp_plan_entry bad = {"layers.1.norm", col};
    tp_clear_error();
    e = tp_parallelize_module(root, mesh, 1, &bad, NULL);
    RANK_EXPECT(s, e == TP_ERR_INVALID_ARG &&
                       msg_has("ColwiseParallel only supports Linear and Embedding, got "
                               "LayerNorm at 'layers.1.norm'"),
                "Colwise on LayerNorm: %s (%s)", tp_status_name(e), tp_last_error());
    tp_plan_entry bad2 = {"", row};
    tp_clear_error();
    e = tp_parallelize_module(root, mesh, 1, &bad2, NULL);
    RANK_EXPECT(s, e == TP_ERR_INVALID_ARG &&
                       msg_has("RowwiseParallel only supports Linear and Embedding"),
                "Rowwise on a container: %s (%s)", tp_status_name(e), tp_last_error());

    /* the parallelized tree still runs: layers.0.attention.wq on x 4x8 */
    tp_tensor *x = NULL, *y = NULL;
    RANK_OK(s, rand_t(2, (int64_t[]){4, 8}, 3, &x));
    RANK_OK(s, tp_module_call(tp_module_find(root, "layers.0.attention.wq"), x, &y));
    expect_shape(s, y, 2, (int64_t[]){4, chunk_len(8, c->w, tp_comm_rank(world))},
                 "layers.0.attention.wq output");
    tp_tensor_release(x);
    tp_tensor_release(y);

    tp_module_free(root);
    tp_style_free(col);
    tp_style_free(row);
    tp_style_free(seq);
    tp_comm_debug_free(dbg);
    tp_mesh_free(mesh);
    return TP_OK;
}

SIZES_PARAMS(plan_matching_and_errors, 1, 2, 3, 4)
ParameterizedTest(int *n, styles, plan_matching_and_errors, .timeout = 60)
{
    sty_ctx c = {.w = *n};
    tp_test_run(*n, plan_body, &c, c.slot);
}

/* ==== meshes: 2-D refused, a 1-D slice of 2x2 works ======================= */

static tp_status mesh2d_body(tp_comm *world, void *arg)
{
    sty_ctx *c = arg;
    tp_test_slot *s = SLOT(c, world);
    tp_mesh *mesh = NULL, *tpm = NULL;
    tp_module *m = NULL;
    tp_style *st = NULL;
    tp_comm_debug *dbg = NULL;
    tp_tensor *x = NULL, *out = NULL;
    const char *names[2] = {"dp", "tp"};
    RANK_OK(s, tp_mesh_create(world, 2, (int64_t[]){2, 2}, names, &mesh));
    RANK_OK(s, tp_comm_debug_create(&dbg));
    RANK_OK(s, tp_nn_linear_create(16, 16, true, &m));
    RANK_OK(s, tp_module_init(m, 42));
    RANK_OK(s, tp_colwise_parallel_create(NULL, &st));
    tp_plan_entry e1 = {"", st};
    tp_clear_error();
    tp_status e = tp_parallelize_module(m, mesh, 1, &e1, NULL);
    RANK_EXPECT(s, e == TP_ERR_INVALID_ARG &&
                       msg_has("tp_parallelize_module: mesh is 2-d; pass a 1-d slice "
                               "(tp_mesh_slice)"),
                "2-D mesh: %s (%s)", tp_status_name(e), tp_last_error());
    RANK_EXPECT(s, !tp_tensor_is_dtensor(tp_module_parameter(m, "weight")),
                "a refused 2-D mesh changed the module");

    const char *tpn[1] = {"tp"};
    RANK_OK(s, tp_mesh_slice(mesh, 1, tpn, &tpm));
    RANK_OK(s, par_self(m, tpm, st));
    /* each dp group its own data */
    RANK_OK(s, rand_t(2, (int64_t[]){8, 16}, 50 + (uint64_t)tp_mesh_coord(mesh, 0), &x));
    RANK_OK(s, tp_tensor_set_requires_grad(x, true));
    RANK_OK(s, run_counted(m, x, true, dbg, &out));
    expect_shape(s, out, 2, (int64_t[]){8, 8}, "colwise on the tp slice");
    expect_phase(s, dbg, TP_PHASE_FORWARD, 2, 0, 0, 0, "colwise on the tp slice");
    expect_phase(s, dbg, TP_PHASE_BACKWARD, 2, 1, 0, 0, "colwise on the tp slice");
    tp_tensor_release(out);
    tp_tensor_release(x);
    tp_module_free(m);

    /* the styles equal the unparallelized module on the slice too */
    for (size_t i = 0; i < sizeof eq_cases / sizeof eq_cases[0]; i++)
        TP_TEST_TRY(check_equal(s, tpm, &eq_cases[i]));

    tp_comm_debug_free(dbg);
    tp_mesh_free(tpm);
    tp_mesh_free(mesh);
    return TP_OK;
}

Test(styles, mesh_2d_refused_slice_works, .timeout = 60)
{
    sty_ctx c = {.w = 4};
    tp_test_run(4, mesh2d_body, &c, c.slot);
}

/* ==== option validation (no communication) ================================ */

Test(styles, option_validation, .timeout = 10)
{
    tp_style *s = (tp_style *)0x1;
    const tp_layout R = tp_layout_of(tp_replicate()), S0 = tp_layout_of(tp_shard(0)),
                    P = tp_layout_of(tp_partial(TP_SUM)), N = tp_layout_none();

    /* the seed: input_layouts=Shard(0), desired_input_layouts=(Replicate(), None) */
    tp_prepare_input_options a = {.n_inputs = 1, .input_layouts = {S0}, .n_desired = 2,
                                  .desired_input_layouts = {R, N}};
    CHECK_ERR(tp_prepare_module_input_create(&a, &s), TP_ERR_INVALID_ARG);
    cr_assert(msg_has("input_layouts and desired_input_layouts should have same length"), "%s",
              tp_last_error());
    cr_assert_null(s);

    tp_prepare_input_options b = {.n_inputs = 2, .input_layouts = {S0, S0}, .n_desired = 2,
                                  .desired_input_layouts = {R, N}};
    CHECK_ERR(tp_prepare_module_input_create(&b, &s), TP_ERR_INVALID_ARG);
    cr_assert(msg_has("input_layouts[1]"), "%s", tp_last_error());
    tp_prepare_input_options b2 = {.n_inputs = 1, .input_layouts = {N}, .n_desired = 1,
                                   .desired_input_layouts = {R}};
    CHECK_ERR(tp_prepare_module_input_create(&b2, &s), TP_ERR_INVALID_ARG);

    tp_prepare_input_options p = {.n_inputs = 1, .input_layouts = {S0}, .n_desired = 1,
                                  .desired_input_layouts = {P}};
    CHECK_ERR(tp_prepare_module_input_create(&p, &s), TP_ERR_INVALID_ARG);
    cr_assert(msg_has("Partial"), "%s", tp_last_error());

    tp_prepare_input_options kw = {.n_kwargs = 2, .kwargs = {{"y", S0, R}, {"y", S0, R}}};
    CHECK_ERR(tp_prepare_module_input_create(&kw, &s), TP_ERR_INVALID_ARG);
    cr_assert(msg_has("'y'"), "%s", tp_last_error());
    tp_prepare_input_options kw2 = {.n_kwargs = 1, .kwargs = {{"y", S0, N}}};
    CHECK_ERR(tp_prepare_module_input_create(&kw2, &s), TP_ERR_INVALID_ARG);
    cr_assert(msg_has("input_kwarg_layouts and desired_input_kwarg_layouts should have same "
                      "length"),
              "%s", tp_last_error());
    tp_prepare_input_options kw3 = {.n_kwargs = 1, .kwargs = {{NULL, S0, R}}};
    CHECK_ERR(tp_prepare_module_input_create(&kw3, &s), TP_ERR_INVALID_ARG);
    tp_prepare_input_options big = {.n_inputs = TP_STYLE_MAX_LAYOUTS + 1,
                                    .n_desired = TP_STYLE_MAX_LAYOUTS + 1};
    CHECK_ERR(tp_prepare_module_input_create(&big, &s), TP_ERR_INVALID_ARG);

    tp_prepare_output_options o1 = {.n_outputs = 1, .output_layouts = {R}, .n_desired = 0};
    CHECK_ERR(tp_prepare_module_output_create(&o1, &s), TP_ERR_INVALID_ARG);
    cr_assert(msg_has("output_layouts and desired_output_layouts should have same length"), "%s",
              tp_last_error());
    tp_prepare_output_options o2 = {.n_outputs = 1, .output_layouts = {R}, .n_desired = 1,
                                    .desired_output_layouts = {N}};
    CHECK_ERR(tp_prepare_module_output_create(&o2, &s), TP_ERR_INVALID_ARG);
    tp_prepare_output_options o3 = {.n_outputs = 1, .output_layouts = {R}, .n_desired = 1,
                                    .desired_output_layouts = {P}};
    CHECK_ERR(tp_prepare_module_output_create(&o3, &s), TP_ERR_INVALID_ARG);
    tp_prepare_output_options o4 = {.n_outputs = 2, .output_layouts = {R, R}, .n_desired = 2,
                                    .desired_output_layouts = {S0, S0}};
    CHECK_ERR(tp_prepare_module_output_create(&o4, &s), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_prepare_module_output_create(NULL, &s), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_prepare_module_input_output_create(&a, &o1, &s), TP_ERR_INVALID_ARG);

    tp_colwise_options co = {.output_layouts = P};
    CHECK_ERR(tp_colwise_parallel_create(&co, &s), TP_ERR_INVALID_ARG);
    tp_rowwise_options ro = {.output_layouts = P};
    CHECK_ERR(tp_rowwise_parallel_create(&ro, &s), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_colwise_parallel_create(NULL, NULL), TP_ERR_INVALID_ARG);

    /* use_local_output is a tp_flag: anything but its three values is refused
     * by every style, naming the option */
    const tp_flag bad = (tp_flag)7;
    CHECK_ERR(tp_colwise_parallel_create(&(tp_colwise_options){.use_local_output = bad}, &s),
              TP_ERR_INVALID_ARG);
    cr_assert(msg_has("ColwiseParallel: use_local_output is 7; use TP_FLAG_DEFAULT, "
                      "TP_FLAG_TRUE or TP_FLAG_FALSE"),
              "%s", tp_last_error());
    CHECK_ERR(tp_rowwise_parallel_create(&(tp_rowwise_options){.use_local_output = bad}, &s),
              TP_ERR_INVALID_ARG);
    cr_assert(msg_has("RowwiseParallel: use_local_output is 7"), "%s", tp_last_error());
    CHECK_ERR(
        tp_sequence_parallel_create(&(tp_sequence_parallel_options){.use_local_output = bad}, &s),
        TP_ERR_INVALID_ARG);
    cr_assert(msg_has("SequenceParallel: use_local_output is 7"), "%s", tp_last_error());
    CHECK_ERR(
        tp_prepare_module_input_create(&(tp_prepare_input_options){.use_local_output = bad}, &s),
        TP_ERR_INVALID_ARG);
    cr_assert(msg_has("PrepareModuleInput: use_local_output is 7"), "%s", tp_last_error());
    tp_prepare_output_options ob = {.n_outputs = 1, .output_layouts = {R}, .n_desired = 1,
                                    .desired_output_layouts = {S0}, .use_local_output = bad};
    CHECK_ERR(tp_prepare_module_output_create(&ob, &s), TP_ERR_INVALID_ARG);
    cr_assert(msg_has("PrepareModuleOutput: use_local_output is 7"), "%s", tp_last_error());
    cr_assert_null(s);

    /* valid ones */
    CHECK_OK(
        tp_prepare_module_input_create(&(tp_prepare_input_options){.n_inputs = 2,
                                                                   .input_layouts = {S0, N},
                                                                   .n_desired = 2,
                                                                   .desired_input_layouts = {R, N}},
                                       &s));
    tp_style_free(s);
    CHECK_OK(tp_prepare_module_input_create(NULL, &s));
    tp_style_free(s);
    CHECK_OK(tp_colwise_parallel_create(NULL, &s));
    tp_style_free(s);
    CHECK_OK(tp_rowwise_parallel_create(NULL, &s));
    tp_style_free(s);
    CHECK_OK(tp_sequence_parallel_create(NULL, &s));
    tp_style_free(s);
    tp_style_free(NULL);
}

/* A module called with the wrong number of inputs for its style. */
static tp_status wrong_arity_body(tp_comm *world, void *arg)
{
    sty_ctx *c = arg;
    tp_test_slot *s = SLOT(c, world);
    tp_mesh *mesh = NULL;
    tp_module *m = NULL;
    tp_style *st = NULL;
    tp_tensor *x = NULL, *out = NULL;
    RANK_OK(s, mesh1d(world, &mesh));
    RANK_OK(s, tp_nn_linear_create(8, 8, true, &m));
    RANK_OK(s, tp_module_init(m, 1));
    RANK_OK(s, tp_colwise_parallel_create(NULL, &st));
    RANK_OK(s, par_self(m, mesh, st));
    RANK_OK(s, rand_t(2, (int64_t[]){2, 8}, 1, &x));
    tp_tensor *args[2] = {x, x};
    tp_clear_error();
    tp_status e = tp_module_forward(m, 2, args, 0, NULL, &out);
    RANK_EXPECT(s, e == TP_ERR_INVALID_ARG &&
                       msg_has("module inputs and input_layouts should have same length"),
                "Colwise with two inputs: %s (%s)", tp_status_name(e), tp_last_error());
    tp_tensor *none[1] = {NULL};
    tp_clear_error();
    e = tp_module_forward(m, 1, none, 0, NULL, &out);
    RANK_EXPECT(s, e == TP_ERR_INVALID_ARG && msg_has("None"),
                "Colwise with a None input: %s (%s)", tp_status_name(e), tp_last_error());
    tp_tensor_release(x);
    tp_module_free(m);
    tp_mesh_free(mesh);
    return TP_OK;
}

Test(styles, wrong_number_of_inputs, .timeout = 30)
{
    sty_ctx c = {.w = 2};
    tp_test_run(2, wrong_arity_body, &c, c.slot);
}

/* Arguments of tp_parallelize_module itself. */
static tp_status args_body(tp_comm *world, void *arg)
{
    sty_ctx *c = arg;
    tp_test_slot *s = SLOT(c, world);
    tp_mesh *mesh = NULL;
    tp_module *m = NULL;
    tp_style *st = NULL;
    RANK_OK(s, mesh1d(world, &mesh));
    RANK_OK(s, tp_nn_linear_create(8, 8, true, &m));
    RANK_OK(s, tp_colwise_parallel_create(NULL, &st));
    tp_plan_entry ok = {"", st}, nostyle = {"", NULL}, nofqn = {NULL, st};
    RANK_EXPECT(s, tp_parallelize_module(NULL, mesh, 1, &ok, NULL) == TP_ERR_INVALID_ARG,
                "NULL module accepted");
    RANK_EXPECT(s, tp_parallelize_module(m, NULL, 1, &ok, NULL) == TP_ERR_INVALID_ARG,
                "NULL mesh accepted");
    RANK_EXPECT(s, tp_parallelize_module(m, mesh, 1, NULL, NULL) == TP_ERR_INVALID_ARG,
                "NULL plan accepted");
    RANK_EXPECT(s, tp_parallelize_module(m, mesh, 1, &nostyle, NULL) == TP_ERR_INVALID_ARG,
                "entry without style accepted");
    RANK_EXPECT(s, tp_parallelize_module(m, mesh, 1, &nofqn, NULL) == TP_ERR_INVALID_ARG,
                "entry without fqn accepted");
    RANK_EXPECT(s, tp_parallelize_module(m, mesh, 0, NULL, NULL) == TP_OK, "empty plan refused");
    /* "*" does not match the module itself (it has no children) */
    tp_plan_entry star = {"*", st};
    tp_clear_error();
    tp_status e = tp_parallelize_module(m, mesh, 1, &star, NULL);
    RANK_EXPECT(s, e == TP_ERR_INVALID_ARG && msg_has("'*'"), "\"*\" on a leaf: %s (%s)",
                tp_status_name(e), tp_last_error());
    /* src_data_rank: a mesh rank or TP_SRC_DATA_RANK_NONE, checked before
     * anything is sent or changed */
    tp_comm_debug *dbg = NULL;
    RANK_OK(s, tp_comm_debug_create(&dbg));
    RANK_OK(s, tp_module_init(m, 2));
    for (int bad = 0; bad < 2; bad++) {
        tp_parallelize_options pb = {.src_data_rank = bad ? -2 : 2};
        RANK_OK(s, tp_comm_debug_begin(dbg));
        tp_clear_error();
        e = tp_parallelize_module(m, mesh, 1, &ok, &pb);
        RANK_OK(s, tp_comm_debug_end(dbg));
        char want[96];
        snprintf(want, sizeof want, "src_data_rank %d is not a rank of the 2-rank mesh",
                 pb.src_data_rank);
        RANK_EXPECT(s, e == TP_ERR_INVALID_ARG && msg_has(want), "src_data_rank %d: %s (%s)",
                    pb.src_data_rank, tp_status_name(e), tp_last_error());
        RANK_EXPECT(s, tp_comm_debug_total(dbg) == 0 &&
                           !tp_tensor_is_dtensor(tp_module_parameter(m, "weight")),
                    "src_data_rank %d: %lld collectives, or the module changed",
                    pb.src_data_rank, (long long)tp_comm_debug_total(dbg));
    }
    /* TP_SRC_DATA_RANK_NONE: nothing is sent */
    tp_parallelize_options po = {.src_data_rank = TP_SRC_DATA_RANK_NONE};
    RANK_OK(s, tp_comm_debug_begin(dbg));
    e = tp_parallelize_module(m, mesh, 1, &ok, &po);
    RANK_OK(s, tp_comm_debug_end(dbg));
    RANK_OK(s, e);
    RANK_EXPECT(s, tp_comm_debug_total(dbg) == 0, "TP_SRC_DATA_RANK_NONE: %lld collectives",
                (long long)tp_comm_debug_total(dbg));
    tp_comm_debug_free(dbg);
    tp_style_free(st);
    tp_module_free(m);
    tp_mesh_free(mesh);
    return TP_OK;
}

Test(styles, parallelize_arguments, .timeout = 30)
{
    sty_ctx c = {.w = 2};
    tp_test_run(2, args_body, &c, c.slot);
}

/* The parameter-sharding style a module got stays with it: a replica
 * (tp_module_replicate, which takes a module without DTensor parameters, such
 * as a parameterless one under SequenceParallel) refuses a second one too,
 * whichever of the two is freed first. */
static tp_status sharded_replica_body(tp_comm *world, void *arg)
{
    sty_ctx *c = arg;
    tp_test_slot *s = SLOT(c, world);
    tp_mesh *mesh = NULL;
    tp_module *m = NULL, *r[2] = {NULL, NULL};
    tp_style *seq = NULL;
    RANK_OK(s, mesh1d(world, &mesh));
    RANK_OK(s, tp_sequence_parallel_create(NULL, &seq));
    RANK_OK(s, tp_nn_relu_create(&m));
    tp_plan_entry e = {"", seq};
    RANK_OK(s, tp_parallelize_module(m, mesh, 1, &e, NULL));
    tp_device dev[2] = {{TP_DEVICE_CPU, 0}, {TP_DEVICE_CPU, 1}};
    RANK_OK(s, tp_module_replicate(m, dev, 2, r));
    tp_module_free(m);
    for (int i = 0; i < 2; i++) {
        tp_clear_error();
        tp_status st = tp_parallelize_module(r[i], mesh, 1, &e, NULL);
        RANK_EXPECT(s, st == TP_ERR_INVALID_ARG && msg_has("the root module") &&
                           msg_has("already sharded by SequenceParallel"),
                    "replica %d: %s (%s)", i, tp_status_name(st), tp_last_error());
        tp_module_free(r[i]);
    }
    tp_style_free(seq);
    tp_mesh_free(mesh);
    return TP_OK;
}

Test(styles, sharded_by_follows_replicas, .timeout = 30)
{
    sty_ctx c = {.w = 2};
    tp_test_run(2, sharded_replica_body, &c, c.slot);
}

/* ---- uneven feature shards through Colwise -> Rowwise ---------------------- */
/* 22 hidden features over 3 ranks (8, 7, 7): the plain local output of the
 * colwise layer enters the rowwise one, which knows its in_features and so
 * wraps the uneven shard correctly. */

typedef struct {
    tp_test_slot slot[TP_TEST_MAX_RANKS];
} uneven_ctx;

static tp_status uneven_build(tp_module **out)
{
    tp_module *seq = NULL, *a = NULL, *b = NULL;
    TP_TEST_TRY(tp_nn_sequential_create(&seq));
    tp_status st = tp_nn_linear_create(16, 22, true, &a);
    if (st == TP_OK)
        st = tp_module_add_child(seq, "net1", a);
    if (st == TP_OK)
        st = tp_nn_linear_create(22, 16, true, &b);
    if (st == TP_OK)
        st = tp_module_add_child(seq, "net2", b);
    if (st != TP_OK) {
        tp_module_free(seq);
        return st;
    }
    *out = seq;
    return TP_OK;
}

static tp_status uneven_body(tp_comm *w, void *arg)
{
    uneven_ctx *c = arg;
    tp_test_slot *s = &c->slot[tp_comm_rank(w)];
    int64_t n = tp_comm_size(w), xs[2] = {5, 16};
    tp_mesh *mesh = NULL;
    tp_module *ref = NULL, *par = NULL;
    tp_style *col = NULL, *row = NULL;
    tp_tensor *x = NULL, *yr = NULL, *yp = NULL;
    RANK_OK(s, tp_mesh_create(w, 1, &n, NULL, &mesh));
    RANK_OK(s, uneven_build(&ref));
    RANK_OK(s, uneven_build(&par));
    RANK_OK(s, tp_colwise_parallel_create(NULL, &col));
    RANK_OK(s, tp_rowwise_parallel_create(NULL, &row));
    tp_plan_entry plan[2] = {{"net1", col}, {"net2", row}};
    RANK_OK(s, tp_parallelize_module(par, mesh, 2, plan, NULL));
    RANK_OK(s, tp_module_init(ref, 9));
    RANK_OK(s, tp_module_init(par, 9));
    RANK_OK(s, tp_tensor_zeros(TP_F32, TP_CPU, 2, xs, &x));
    RANK_OK(s, tp_tensor_fill_random(x, TP_RNG_UNIFORM, -1, 1, 3, NULL, NULL));
    RANK_OK(s, tp_module_call(ref, x, &yr));
    RANK_OK(s, tp_module_call(par, x, &yp));
    bool ok = false;
    RANK_OK(s, tp_tensor_allclose(yp, yr, 1e-5, 1e-5, &ok));
    RANK_EXPECT(s, ok, "uneven colwise -> rowwise output differs from the plain module");
    tp_tensor *all[] = {x, yr, yp};
    for (size_t i = 0; i < 3; i++)
        tp_tensor_release(all[i]);
    tp_module_free(ref);
    tp_module_free(par);
    tp_style_free(col);
    tp_style_free(row);
    tp_mesh_free(mesh);
    return TP_OK;
}

Test(styles, uneven_feature_shards, .timeout = 60)
{
    for (int n = 1; n <= 4; n++) {
        uneven_ctx c = {0};
        tp_test_run(n, uneven_body, &c, c.slot);
    }
}

/* ---- src_data_rank: whose values the parameters get ------------------------ */
/* Every rank initializes the module with its own seed; parallelized from
 * src_data_rank 1, every rank ends with rank 1's values: one scatter per
 * sharded parameter, one broadcast per replicated one, with exactly their
 * bytes (a broadcast of every parameter fails the counts); with
 * TP_SRC_DATA_RANK_NONE every rank keeps its own values and nothing is sent. */

#define SRC_SEED 100

/* emb: Embedding(11, 6) Colwise; net1: Linear(10, 16) Colwise; net2:
 * Linear(16, 10) Rowwise; emb2: Embedding(9, 5) Rowwise; norm: LayerNorm(10)
 * SequenceParallel. */
static tp_status make_src_model(tp_module **out)
{
    tp_module *root = NULL;
    TP_TEST_TRY(tp_nn_container_create(&root));
    const char *names[] = {"emb", "net1", "net2", "emb2", "norm"};
    tp_status st = TP_OK;
    for (int i = 0; i < 5 && st == TP_OK; i++) {
        tp_module *c = NULL;
        switch (i) {
        case 0:
            st = tp_nn_embedding_create(11, 6, &c);
            break;
        case 1:
            st = tp_nn_linear_create(10, 16, true, &c);
            break;
        case 2:
            st = tp_nn_linear_create(16, 10, true, &c);
            break;
        case 3:
            st = tp_nn_embedding_create(9, 5, &c);
            break;
        default:
            st = tp_nn_layer_norm_create(10, true, 1e-5, &c);
            break;
        }
        if (st == TP_OK && (st = tp_module_add_child(root, names[i], c)) != TP_OK)
            tp_module_free(c);
    }
    if (st != TP_OK) {
        tp_module_free(root);
        return st;
    }
    *out = root;
    return TP_OK;
}

typedef struct {
    tp_module *ref; /* plain, initialized with the seed whose values are expected */
    int checked, wrong;
    char first[128];
} src_cmp;

/* The local shard of param equals the block of the same parameter of ref. */
static tp_status src_compare(const char *fqn, tp_tensor *param, void *arg)
{
    src_cmp *c = arg;
    tp_tensor *full = tp_test_param(c->ref, fqn);
    bool eq = false;
    if (full && tp_tensor_is_dtensor(param)) {
        tp_mesh *mesh = tp_dtensor_mesh(param);
        int nd = tp_tensor_ndim(param);
        int64_t shape[TP_MAX_DIMS], off[TP_MAX_DIMS];
        TP_TEST_TRY(tp_dtensor_shard_extent(mesh, nd, tp_tensor_shape(param), tp_mesh_ndim(mesh),
                                            tp_dtensor_placements(param), NULL, shape, off));
        tp_tensor *v = tp_tensor_retain(full), *next = NULL;
        for (int d = 0; d < nd; d++) {
            TP_TEST_TRY(tp_tensor_narrow(v, d, off[d], shape[d], &next));
            tp_tensor_release(v);
            v = next;
        }
        TP_TEST_TRY(tp_tensor_equal(tp_dtensor_local(param), v, &eq));
        tp_tensor_release(v);
    }
    c->checked++;
    if (!eq && c->wrong++ == 0)
        snprintf(c->first, sizeof c->first, "%s", fqn);
    return TP_OK;
}

static tp_status src_body(tp_comm *world, void *arg)
{
    sty_ctx *c = arg;
    tp_test_slot *s = SLOT(c, world);
    int w = c->w, r = tp_comm_rank(world);
    tp_mesh *mesh = NULL;
    tp_style *col = NULL, *row = NULL, *seq = NULL;
    tp_comm_debug *dbg = NULL;
    RANK_OK(s, mesh1d(world, &mesh));
    RANK_OK(s, tp_comm_debug_create(&dbg));
    RANK_OK(s, tp_colwise_parallel_create(NULL, &col));
    RANK_OK(s, tp_rowwise_parallel_create(NULL, &row));
    RANK_OK(s, tp_sequence_parallel_create(NULL, &seq));
    const tp_plan_entry plan[] = {{"emb", col}, {"net1", col}, {"net2", row}, {"emb2", row},
                                  {"norm", seq}};
    /* scatter bytes: nccl-tests' size, the padded send buffer */
    int64_t W = w, ch6 = (6 + W - 1) / W, ch16 = (16 + W - 1) / W, ch9 = (9 + W - 1) / W;
    int64_t scatter_bytes = 4 * W * (11 * ch6 + 10 * ch16 + ch16 + 10 * ch16 + 5 * ch9);
    for (int mode = 0; mode < 2; mode++) {
        int src = mode == 0 ? 1 : TP_SRC_DATA_RANK_NONE;
        tp_module *m = NULL, *ref = NULL;
        RANK_OK(s, make_src_model(&m));
        RANK_OK(s, make_src_model(&ref));
        RANK_OK(s, tp_module_init(m, SRC_SEED + (uint64_t)r));
        RANK_OK(s, tp_module_init(ref, SRC_SEED + (uint64_t)(src >= 0 ? src : r)));
        tp_parallelize_options po = {.src_data_rank = src};
        RANK_OK(s, tp_comm_debug_begin(dbg));
        tp_status e = tp_parallelize_module(m, mesh, 5, plan, &po);
        RANK_OK(s, tp_comm_debug_end(dbg));
        RANK_OK(s, e);
        int64_t sc = tp_comm_debug_count(dbg, TP_COLL_SCATTER);
        int64_t bc = tp_comm_debug_count(dbg, TP_COLL_BROADCAST);
        int64_t want_sc = src >= 0 ? 5 : 0, want_bc = src >= 0 ? 1 : 0;
        RANK_EXPECT(s, sc == want_sc && bc == want_bc && tp_comm_debug_total(dbg) == sc + bc,
                    "src_data_rank %d at W=%d: %lld scatters, %lld broadcasts, %lld in all; want "
                    "%lld and %lld", src, w, (long long)sc, (long long)bc,
                    (long long)tp_comm_debug_total(dbg), (long long)want_sc, (long long)want_bc);
        int64_t sb = tp_comm_debug_bytes(dbg, TP_COLL_SCATTER);
        int64_t bb = tp_comm_debug_bytes(dbg, TP_COLL_BROADCAST);
        RANK_EXPECT(s, sb == (src >= 0 ? scatter_bytes : 0) && bb == (src >= 0 ? 40 : 0),
                    "src_data_rank %d at W=%d: scatter bytes %lld (want %lld), broadcast bytes "
                    "%lld (want 40)", src, w, (long long)sb,
                    (long long)(src >= 0 ? scatter_bytes : 0), (long long)bb);
        src_cmp cmp = {.ref = ref};
        RANK_OK(s, tp_module_named_parameters(m, src_compare, &cmp));
        RANK_EXPECT(s, cmp.checked == 8 && cmp.wrong == 0,
                    "src_data_rank %d at W=%d, rank %d: %d of %d parameters differ from rank "
                    "%d's values (first: %s)", src, w, r, cmp.wrong, cmp.checked,
                    src >= 0 ? src : r, cmp.first);
        tp_module_free(m);
        tp_module_free(ref);
    }
    tp_style_free(col);
    tp_style_free(row);
    tp_style_free(seq);
    tp_comm_debug_free(dbg);
    tp_mesh_free(mesh);
    return TP_OK;
}

SIZES_PARAMS(src_data_rank, 2, 3, 4)
ParameterizedTest(int *n, styles, src_data_rank, .timeout = 60)
{
    sty_ctx c = {.w = *n};
    tp_test_run(*n, src_body, &c, c.slot);
}
