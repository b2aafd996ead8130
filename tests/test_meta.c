/* The meta device: tensors with a shape and no memory.
 *
 * The property test runs random cases of every op (and its backward) twice,
 * on CPU tensors with values and on meta tensors of the same shapes, and
 * requires the same status, output shape, strides, dtype and (for DTensors,
 * on a real 2-rank shm world and on a simulated one) placements and local
 * shapes, and the same gradient shapes. The other tests check that reading
 * a meta tensor is an error naming meta, that writes into one do nothing,
 * that nothing of a meta tensor's size is allocated, and the moves between
 * meta and the CPU. */
#include "tp_test.h"

/* ---- deterministic random cases ------------------------------------------ */

typedef struct rng {
    uint64_t s;
} rng;

static uint64_t rnd(rng *r, uint64_t n)
{
    r->s = r->s * 6364136223846793005ULL + 1442695040888963407ULL;
    return (r->s >> 33) % n;
}

enum {
    OP_ADD,
    OP_MUL,
    OP_SCALE,
    OP_RELU,
    OP_GELU,
    OP_DROPOUT,
    OP_RESHAPE,
    OP_FLATTEN,
    OP_TRANSPOSE,
    OP_PERMUTE,
    OP_SUM,
    OP_MEAN,
    OP_SUM_ALL,
    OP_MEAN_ALL,
    OP_SOFTMAX,
    OP_LAYER_NORM,
    OP_RMS_NORM,
    OP_LINEAR,
    OP_MATMUL,
    OP_EMBEDDING,
    OP_CROSS_ENTROPY,
    OP_SDPA,
    OP_SILU,
    OP_SWIGLU,
    OP_COUNT
};

static const char *const op_names[OP_COUNT] = {
    "add",     "mul",       "scale",         "relu",       "gelu",     "dropout",
    "reshape", "flatten",   "transpose",     "permute",    "sum",      "mean",
    "sum_all", "mean_all",  "softmax",       "layer_norm", "rms_norm", "linear",
    "matmul",  "embedding", "cross_entropy", "sdpa",       "silu",     "swiglu"};

#define MAX_IN 3

/* What a case produced: compared between the CPU and the meta run. */
typedef struct case_out {
    tp_status st;
    int ndim;
    int64_t shape[TP_MAX_DIMS], stride[TP_MAX_DIMS], lshape[TP_MAX_DIMS];
    tp_dtype dtype;
    bool dist;
    tp_placement pl[2];
    int nin;
    int gnd[MAX_IN];
    int64_t gshape[MAX_IN][TP_MAX_DIMS];
    tp_placement gpl[MAX_IN][2];
} case_out;

/* One input: its global shape, dtype and (on a mesh) placement. */
typedef struct in_spec {
    int nd;
    int64_t shape[TP_MAX_DIMS];
    tp_dtype dtype;
    bool grad;
    int64_t hi; /* integer inputs: values in [0, hi) */
    tp_placement pl;
} in_spec;

typedef struct case_spec {
    int op;
    int nin;
    in_spec in[MAX_IN];
    int64_t a[TP_MAX_DIMS]; /* op arguments: dims, new shapes */
    int na;
} case_spec;

static void rand_shape(rng *r, int nd, int64_t *shape)
{
    for (int d = 0; d < nd; d++)
        shape[d] = 1 + (int64_t)rnd(r, 4);
}

static in_spec float_in(int nd, const int64_t *shape)
{
    in_spec s = {.nd = nd, .dtype = TP_F32, .grad = true};
    memcpy(s.shape, shape, sizeof(int64_t) * (size_t)nd);
    return s;
}

/* The inputs and arguments of case `seed` of op (a few cases are invalid on
 * purpose: both runs must then fail alike). */
static void make_case(int op, uint64_t seed, bool mesh, case_spec *c)
{
    rng r = {seed * 7919 + (uint64_t)op};
    memset(c, 0, sizeof *c);
    c->op = op;
    int nd = 1 + (int)rnd(&r, 3);
    int64_t sh[TP_MAX_DIMS];
    rand_shape(&r, nd, sh);
    c->nin = 1;
    c->in[0] = float_in(nd, sh);
    switch (op) {
    case OP_ADD:
    case OP_MUL: {
        int64_t b[TP_MAX_DIMS];
        memcpy(b, sh, sizeof b);
        for (int d = 0; d < nd; d++)
            if (rnd(&r, 3) == 0)
                b[d] = rnd(&r, 4) == 0 ? b[d] + 1 : 1; /* broadcast, or a mismatch */
        c->nin = 2;
        c->in[1] = float_in(nd, b);
        break;
    }
    case OP_RESHAPE: {
        int64_t n = 1;
        for (int d = 0; d < nd; d++)
            n *= sh[d];
        c->na = 2;
        c->a[0] = rnd(&r, 2) ? -1 : n + (int64_t)rnd(&r, 2); /* -1: inferred */
        c->a[1] = 1;
        break;
    }
    case OP_FLATTEN:
    case OP_TRANSPOSE:
    case OP_SUM:
    case OP_MEAN:
    case OP_SOFTMAX:
        c->na = 2;
        c->a[0] = (int64_t)rnd(&r, (uint64_t)nd + 1) - 1; /* -1 .. nd-1 */
        c->a[1] = (int64_t)rnd(&r, (uint64_t)nd);
        break;
    case OP_PERMUTE:
        c->na = nd;
        for (int d = 0; d < nd; d++)
            c->a[d] = nd - 1 - d;
        break;
    case OP_LAYER_NORM:
    case OP_RMS_NORM:
        c->nin = 3;
        c->in[1] = float_in(1, &sh[nd - 1]);
        c->in[2] = float_in(1, &sh[nd - 1]);
        break;
    case OP_LINEAR: {
        int64_t w[2] = {1 + (int64_t)rnd(&r, 4), sh[nd - 1] + (rnd(&r, 8) == 0)};
        c->nin = 3;
        c->in[1] = float_in(2, w);
        c->in[2] = float_in(1, w);
        break;
    }
    case OP_MATMUL: {
        int64_t b[2] = {sh[nd - 1], 1 + (int64_t)rnd(&r, 4)};
        c->nin = 2;
        c->in[1] = float_in(2, b);
        break;
    }
    case OP_EMBEDDING: {
        int64_t w[2] = {2 + (int64_t)rnd(&r, 5), 1 + (int64_t)rnd(&r, 4)};
        c->in[0].dtype = TP_I64;
        c->in[0].grad = false;
        c->in[0].hi = w[0];
        c->nin = 2;
        c->in[1] = float_in(2, w);
        break;
    }
    case OP_CROSS_ENTROPY: {
        int64_t n = 1 + (int64_t)rnd(&r, 4), cls = 2 + (int64_t)rnd(&r, 4);
        c->in[0] = float_in(2, (int64_t[]){n, cls});
        c->in[1] = float_in(1, &n);
        c->in[1].dtype = TP_I64;
        c->in[1].grad = false;
        c->in[1].hi = cls;
        c->nin = 2;
        c->na = 1;
        c->a[0] = (int64_t)rnd(&r, 3); /* reduction */
        break;
    }
    case OP_SDPA: {
        int64_t q[4] = {1 + (int64_t)rnd(&r, 2), 1 + (int64_t)rnd(&r, 2), 1 + (int64_t)rnd(&r, 4),
                        1 + (int64_t)rnd(&r, 4)};
        c->nin = 3;
        for (int i = 0; i < 3; i++)
            c->in[i] = float_in(4, q);
        c->na = 1;
        c->a[0] = (int64_t)rnd(&r, 2); /* causal */
        break;
    }
    case OP_SWIGLU: { /* up of gate's shape, or (sometimes) not */
        int64_t b[TP_MAX_DIMS];
        memcpy(b, sh, sizeof b);
        if (rnd(&r, 5) == 0)
            b[nd - 1]++;
        c->nin = 2;
        c->in[1] = float_in(nd, b);
        break;
    }
    default:
        break;
    }
    if (!mesh)
        return;
    /* on a mesh: each input Replicate or Shard on a random dim; integer
     * inputs and norm weights replicated (as their ops require) */
    for (int i = 0; i < c->nin; i++) {
        bool rep = c->in[i].dtype != TP_F32 || rnd(&r, 3) == 0 ||
                   ((op == OP_LAYER_NORM || op == OP_RMS_NORM) && i > 0);
        c->in[i].pl = rep ? tp_replicate() : tp_shard((int)rnd(&r, (uint64_t)c->in[i].nd));
    }
}

/* Input i of c on dev: the same values on every device (a CPU tensor made
 * first, then moved; on the meta device the move keeps the shape only). */
static tp_status make_input(const in_spec *s, uint64_t seed, tp_device dev, tp_mesh *mesh,
                            tp_tensor **out)
{
    tp_tensor *h = NULL, *t = NULL;
    TP_TEST_TRY(tp_tensor_empty(s->dtype, TP_CPU, s->nd, s->shape, &h));
    tp_status st =
        s->dtype == TP_I64
            ? tp_tensor_fill_random(h, TP_RNG_RANDINT, 0, (double)s->hi, seed, NULL, NULL)
            : tp_tensor_fill_random(h, TP_RNG_UNIFORM, -1, 1, seed, NULL, NULL);
    if (st == TP_OK)
        st = tp_tensor_to(h, s->dtype, dev, &t);
    tp_tensor_release(h);
    if (st == TP_OK && mesh) {
        h = t;
        t = NULL;
        st = tp_dtensor_distribute(mesh, h, 1, &s->pl, 0, &t);
        tp_tensor_release(h);
    }
    if (st == TP_OK && s->grad)
        st = tp_tensor_set_requires_grad(t, true);
    if (st != TP_OK) {
        tp_tensor_release(t);
        return st;
    }
    *out = t;
    return TP_OK;
}

static tp_status run_op(const case_spec *c, tp_tensor **x, tp_tensor **y)
{
    const int64_t *a = c->a;
    switch (c->op) {
    case OP_ADD:
        return tp_add(x[0], x[1], y);
    case OP_MUL:
        return tp_mul(x[0], x[1], y);
    case OP_SCALE:
        return tp_scale(x[0], 0.5, y);
    case OP_RELU:
        return tp_relu(x[0], y);
    case OP_GELU:
        return tp_gelu(x[0], TP_GELU_EXACT, y);
    case OP_DROPOUT:
        return tp_dropout(x[0], 0.25, 3, true, y);
    case OP_RESHAPE:
        return tp_reshape(x[0], 2, a, y);
    case OP_FLATTEN:
        return tp_flatten(x[0], (int)a[1], -1, y);
    case OP_TRANSPOSE:
        return tp_transpose(x[0], (int)a[0], (int)a[1], y);
    case OP_PERMUTE: {
        int dims[TP_MAX_DIMS];
        for (int d = 0; d < c->na; d++)
            dims[d] = (int)a[d];
        return tp_permute(x[0], c->na, dims, y);
    }
    case OP_SUM:
        return tp_sum(x[0], (int)a[0], a[1] % 2 == 0, y);
    case OP_MEAN:
        return tp_mean(x[0], (int)a[0], a[1] % 2 == 1, y);
    case OP_SUM_ALL:
        return tp_sum_all(x[0], y);
    case OP_MEAN_ALL:
        return tp_mean_all(x[0], y);
    case OP_SOFTMAX:
        return tp_softmax(x[0], (int)a[0], y);
    case OP_LAYER_NORM:
        return tp_layer_norm(x[0], x[1], x[2], 1e-5, y);
    case OP_RMS_NORM:
        return tp_rms_norm(x[0], x[1], 1e-5, y);
    case OP_LINEAR:
        return tp_linear(x[0], x[1], x[2], y);
    case OP_MATMUL:
        return tp_matmul(x[0], x[1], y);
    case OP_EMBEDDING:
        return tp_embedding(x[0], x[1], y);
    case OP_CROSS_ENTROPY: {
        tp_cross_entropy_options o = TP_CROSS_ENTROPY_DEFAULTS;
        o.reduction = (tp_reduction)a[0];
        return tp_cross_entropy(x[0], x[1], &o, y);
    }
    case OP_SDPA:
        return tp_scaled_dot_product_attention(x[0], x[1], x[2], a[0] != 0, 0.0, y);
    case OP_SILU:
        return tp_silu(x[0], y);
    case OP_SWIGLU:
        return tp_swiglu(x[0], x[1], y);
    default:
        return TP_ERR_INVALID_ARG;
    }
}

static void record_out(const tp_tensor *y, case_out *o)
{
    o->ndim = tp_tensor_ndim(y);
    o->dtype = tp_tensor_dtype(y);
    memcpy(o->shape, tp_tensor_shape(y), sizeof(int64_t) * (size_t)o->ndim);
    o->dist = tp_tensor_is_dtensor(y);
    const tp_tensor *l = o->dist ? tp_dtensor_local(y) : y;
    memcpy(o->lshape, tp_tensor_shape(l), sizeof(int64_t) * (size_t)o->ndim);
    memcpy(o->stride, tp_tensor_strides(l), sizeof(int64_t) * (size_t)o->ndim);
    if (o->dist)
        o->pl[0] = tp_dtensor_placements(y)[0];
}

/* Backward of sum_all(y) (y reduced to a replicated scalar first), then
 * the input gradients' shapes and placements. */
static tp_status backward_of(tp_tensor *y, tp_tensor **x, int nin, case_out *o)
{
    tp_tensor *s = NULL;
    if (!tp_tensor_requires_grad(y))
        return TP_OK;
    TP_TEST_TRY(tp_sum_all(y, &s));
    tp_status st = tp_backward(s, NULL);
    tp_tensor_release(s);
    for (int i = 0; i < nin && st == TP_OK; i++) {
        tp_tensor *g = tp_tensor_grad(x[i]);
        o->gnd[i] = g ? tp_tensor_ndim(g) : -1;
        if (!g)
            continue;
        memcpy(o->gshape[i], tp_tensor_shape(g), sizeof(int64_t) * (size_t)o->gnd[i]);
        if (tp_tensor_is_dtensor(g))
            o->gpl[i][0] = tp_dtensor_placements(g)[0];
    }
    return st;
}

/* Runs case c on dev (on mesh when non-NULL) into *o. */
static tp_status run_case(const case_spec *c, uint64_t seed, tp_device dev, tp_mesh *mesh,
                          case_out *o)
{
    memset(o, 0, sizeof *o);
    o->nin = c->nin;
    tp_tensor *x[MAX_IN] = {NULL}, *y = NULL;
    tp_status st = TP_OK;
    for (int i = 0; i < c->nin && st == TP_OK; i++)
        st = make_input(&c->in[i], seed + (uint64_t)i, dev, mesh, &x[i]);
    if (st != TP_OK)
        goto done; /* a setup failure: the caller reports it */
    o->st = run_op(c, x, &y);
    if (o->st == TP_OK) {
        record_out(y, o);
        st = backward_of(y, x, c->nin, o);
    }
done:
    tp_tensor_release(y);
    for (int i = 0; i < c->nin; i++)
        tp_tensor_release(x[i]);
    return st;
}

static int case_diff(const case_out *a, const case_out *b, char *msg, size_t len)
{
    if (a->st != b->st)
        return snprintf(msg, len, "status %s vs %s", tp_status_name(a->st), tp_status_name(b->st));
    if (a->st != TP_OK)
        return 0;
    if (a->ndim != b->ndim || a->dtype != b->dtype || a->dist != b->dist)
        return snprintf(msg, len, "ndim %d/%d dtype %d/%d dist %d/%d", a->ndim, b->ndim,
                        (int)a->dtype, (int)b->dtype, a->dist, b->dist);
    size_t nb = sizeof(int64_t) * (size_t)a->ndim;
    if (memcmp(a->shape, b->shape, nb) || memcmp(a->lshape, b->lshape, nb) ||
        memcmp(a->stride, b->stride, nb))
        return snprintf(msg, len, "shape, local shape or strides differ");
    if (a->dist && memcmp(&a->pl[0], &b->pl[0], sizeof a->pl[0]))
        return snprintf(msg, len, "placement %d/%d differs", (int)a->pl[0].kind,
                        (int)b->pl[0].kind);
    for (int i = 0; i < a->nin; i++) {
        if (a->gnd[i] != b->gnd[i] ||
            (a->gnd[i] > 0 &&
             memcmp(a->gshape[i], b->gshape[i], sizeof(int64_t) * (size_t)a->gnd[i])) ||
            memcmp(&a->gpl[i][0], &b->gpl[i][0], sizeof a->gpl[i][0]))
            return snprintf(msg, len, "gradient of input %d differs", i);
    }
    return 0;
}

#define NCASES 24

/* ---- plain tensors ---------------------------------------------------------- */

Test(meta, ops_match_cpu_plain, .timeout = 60)
{
    int ok = 0, failed = 0;
    for (int op = 0; op < OP_COUNT; op++)
        for (uint64_t k = 0; k < NCASES; k++) {
            case_spec c;
            make_case(op, k, false, &c);
            case_out cpu, meta;
            CHECK_OK(run_case(&c, k, TP_CPU, NULL, &cpu));
            uint64_t before = 0;
            tp_memory_info mi;
            CHECK_OK(tp_memory_stats(TP_CPU, &mi));
            before = mi.num_allocs;
            CHECK_OK(run_case(&c, k, TP_META, NULL, &meta));
            CHECK_OK(tp_memory_stats(TP_CPU, &mi));
            char msg[256];
            cr_assert(case_diff(&cpu, &meta, msg, sizeof msg) == 0, "%s case %llu: %s",
                      op_names[op], (unsigned long long)k, msg);
            /* the meta run made its inputs on the CPU first (one tensor
             * each), and nothing else */
            cr_assert_leq(mi.num_allocs - before, (uint64_t)c.nin,
                          "%s case %llu: the meta run allocated %llu CPU tensors", op_names[op],
                          (unsigned long long)k, (unsigned long long)(mi.num_allocs - before));
            if (cpu.st == TP_OK)
                ok++;
            else
                failed++;
        }
    /* the cases cover both outcomes */
    cr_assert_gt(ok, OP_COUNT * NCASES / 2);
    cr_assert_gt(failed, 0);
}

/* ---- DTensors: a real 2-rank world against a simulated one ---------------- */

#define MW 2

typedef struct dist_ctx {
    case_out out[MW][OP_COUNT][NCASES];
    tp_test_slot slots[MW];
} dist_ctx;

static tp_status dist_cases(tp_comm *world, tp_device dev, case_out (*out)[NCASES])
{
    int64_t n = tp_comm_size(world);
    tp_mesh *mesh = NULL;
    TP_TEST_TRY(tp_mesh_create(world, 1, &n, NULL, &mesh));
    tp_status st = TP_OK;
    for (int op = 0; op < OP_COUNT && st == TP_OK; op++)
        for (uint64_t k = 0; k < NCASES && st == TP_OK; k++) {
            case_spec c;
            make_case(op, k, true, &c);
            st = run_case(&c, k, dev, mesh, &out[op][k]);
        }
    tp_mesh_free(mesh);
    return st;
}

static tp_status dist_body(tp_comm *world, void *arg)
{
    dist_ctx *c = arg;
    int r = tp_comm_rank(world);
    RANK_OK(&c->slots[r], dist_cases(world, TP_CPU, c->out[r]));
    return TP_OK;
}

Test(meta, ops_match_cpu_dtensor, .timeout = 120)
{
    dist_ctx *cpu = calloc(1, sizeof *cpu), *meta = calloc(1, sizeof *meta);
    cr_assert(cpu && meta);
    tp_test_run(MW, dist_body, cpu, cpu->slots);
    int ok = 0;
    for (int r = 0; r < MW; r++) {
        tp_comm *w = NULL;
        CHECK_OK(tp_comm_create_world("sim", &(tp_sim_options){.world_size = MW, .rank = r}, &w));
        CHECK_OK(dist_cases(w, TP_META, meta->out[r]));
        CHECK_OK(tp_comm_free(w));
        for (int op = 0; op < OP_COUNT; op++)
            for (int k = 0; k < NCASES; k++) {
                char msg[256];
                cr_assert(case_diff(&cpu->out[r][op][k], &meta->out[r][op][k], msg, sizeof msg) ==
                              0,
                          "rank %d, %s case %d: %s", r, op_names[op], k, msg);
                ok += cpu->out[r][op][k].st == TP_OK && cpu->out[r][op][k].dist;
            }
    }
    cr_assert_gt(ok, MW * OP_COUNT * NCASES / 3, "only %d DTensor cases ran", ok);
    free(cpu);
    free(meta);
}

/* ---- data access ------------------------------------------------------------ */

static void expect_meta_error(tp_status st, tp_status code, const char *what)
{
    cr_assert_eq(st, code, "%s -> %s", what, tp_status_name(st));
    cr_assert(strstr(tp_last_error(), "meta") != NULL, "%s: message %s", what, tp_last_error());
}

Test(meta, reading_data_is_an_error, .timeout = 10)
{
    tp_tensor *m = NULL, *c = NULL, *out = NULL;
    int64_t sh[2] = {3, 4}, idx[2] = {1, 2};
    CHECK_OK(tp_tensor_empty(TP_F32, TP_META, 2, sh, &m));
    CHECK_OK(tp_tensor_zeros(TP_F32, TP_CPU, 2, sh, &c));
    cr_assert(tp_tensor_is_meta(m));
    cr_assert(!tp_tensor_is_meta(c));
    cr_assert(!tp_tensor_is_meta(NULL));
    double v = 7;
    bool b = true;
    expect_meta_error(tp_tensor_get(m, idx, &v), TP_ERR_INVALID_ARG, "get");
    cr_assert_eq(v, 0.0);
    expect_meta_error(tp_tensor_set(m, idx, 1.0), TP_ERR_INVALID_ARG, "set");
    expect_meta_error(tp_tensor_equal(m, c, &b), TP_ERR_INVALID_ARG, "equal");
    cr_assert(!b);
    expect_meta_error(tp_tensor_equal(c, m, &b), TP_ERR_INVALID_ARG, "equal (b)");
    expect_meta_error(tp_tensor_allclose(m, m, 0, 0, &b), TP_ERR_INVALID_ARG, "allclose");
    expect_meta_error(tp_tensor_max_abs_diff(m, c, &v), TP_ERR_INVALID_ARG, "max_abs_diff");
    expect_meta_error(tp_tensor_copy(c, m), TP_ERR_INVALID_ARG, "copy to the CPU");
    expect_meta_error(tp_tensor_to(m, TP_F32, TP_CPU, &out), TP_ERR_INVALID_ARG, "to the CPU");
    cr_assert_null(out);
    expect_meta_error(tp_tensor_from_blob(TP_F32, TP_META, 2, sh, &v, NULL, NULL, &out),
                      TP_ERR_INVALID_ARG, "from_blob");
    CHECK_ERR(tp_tensor_empty(TP_F32, (tp_device){TP_DEVICE_META, 1}, 2, sh, &out),
              TP_ERR_INVALID_ARG);
    /* the full tensor of a meta DTensor is meta too, and just as unreadable */
    tp_comm *w = NULL;
    tp_mesh *mesh = NULL;
    tp_tensor *dt = NULL, *full = NULL;
    CHECK_OK(tp_comm_create_world("sim", &(tp_sim_options){.world_size = 4, .rank = 1}, &w));
    CHECK_OK(tp_mesh_create(w, 1, (int64_t[]){4}, NULL, &mesh));
    tp_placement s0 = tp_shard(0);
    CHECK_OK(tp_dtensor_distribute(mesh, m, 1, &s0, 0, &dt));
    cr_assert(tp_tensor_is_meta(dt));
    CHECK_OK(tp_dtensor_full_tensor(dt, &full));
    cr_assert(tp_tensor_is_meta(full));
    cr_assert_eq(tp_tensor_size(full, 0), 3);
    expect_meta_error(tp_tensor_get(full, idx, &v), TP_ERR_INVALID_ARG, "get (full tensor)");
    tp_tensor_release(full);
    tp_tensor_release(dt);
    tp_mesh_free(mesh);
    CHECK_OK(tp_comm_free(w));
    tp_tensor_release(m);
    tp_tensor_release(c);
}

Test(meta, writes_do_nothing_and_moves_keep_the_shape, .timeout = 10)
{
    tp_tensor *m = NULL, *c = NULL, *mc = NULL, *v = NULL, *v2 = NULL;
    int64_t sh[2] = {3, 4};
    CHECK_OK(tp_tensor_zeros(TP_F32, TP_CPU, 2, sh, &c));
    CHECK_OK(tp_tensor_to(c, TP_BF16, TP_META, &m));
    cr_assert(tp_tensor_is_meta(m));
    cr_assert_eq(tp_tensor_dtype(m), TP_BF16);
    cr_assert_eq(tp_tensor_size(m, 1), 4);
    cr_assert_eq(tp_tensor_device(m).type, TP_DEVICE_META);
    CHECK_OK(tp_tensor_fill(m, 3.0));
    CHECK_OK(tp_tensor_fill_random(m, TP_RNG_NORMAL, 0, 1, 9, NULL, NULL));
    CHECK_OK(tp_tensor_copy(m, c));
    CHECK_OK(tp_tensor_clone(m, &mc));
    cr_assert(tp_tensor_is_meta(mc));
    cr_assert(!tp_tensor_shares_storage(m, mc));
    /* the arguments are still checked */
    CHECK_ERR(tp_tensor_fill_random(m, TP_RNG_UNIFORM, 1, 0, 9, NULL, NULL), TP_ERR_INVALID_ARG);
    /* views keep their offsets; distinct storages do not overlap */
    CHECK_OK(tp_tensor_narrow(m, 1, 1, 2, &v));
    CHECK_OK(tp_tensor_narrow(m, 1, 2, 2, &v2));
    cr_assert(tp_tensor_shares_storage(m, v));
    cr_assert_eq((char *)tp_tensor_data(v) - (char *)tp_tensor_data(m), 2);
    CHECK_ERR(tp_tensor_copy(v, v2), TP_ERR_INVALID_ARG); /* they overlap, as on the CPU */
    cr_assert(strstr(tp_last_error(), "overlap") != NULL, "%s", tp_last_error());
    tp_tensor_release(v);
    tp_tensor_release(v2);
    tp_tensor_release(mc);
    tp_tensor_release(m);
    tp_tensor_release(c);
}

/* A model far larger than this machine: a 65,536 x 65,536 Linear (16 GiB of
 * f32 weight, 32 GiB with its gradient) built on meta, run forward and
 * backward and stepped, with no CPU tensor memory at all. */
Test(meta, huge_model_allocates_nothing, .timeout = 30)
{
    tp_memory_info before, after;
    CHECK_OK(tp_memory_stats(TP_CPU, &before));
    cr_assert_eq(tp_nn_default_device().type, TP_DEVICE_CPU);
    CHECK_OK(tp_nn_set_default_device(TP_META));
    tp_module *lin = NULL;
    tp_status st = tp_nn_linear_create(65536, 65536, true, &lin);
    CHECK_OK(tp_nn_set_default_device(TP_CPU));
    CHECK_OK(st);
    CHECK_OK(tp_module_init(lin, 1));
    tp_tensor *w = tp_module_parameter(lin, "weight");
    cr_assert(tp_tensor_is_meta(w));
    cr_assert_eq(tp_tensor_nbytes(w), (size_t)65536 * 65536 * 4);
    tp_tensor *x = NULL, *y = NULL, *loss = NULL;
    CHECK_OK(tp_tensor_empty(TP_F32, TP_META, 2, (int64_t[]){4096, 65536}, &x));
    CHECK_OK(tp_module_call(lin, x, &y));
    cr_assert(tp_tensor_is_meta(y));
    cr_assert_eq(tp_tensor_size(y, 0), 4096);
    cr_assert_eq(tp_tensor_size(y, 1), 65536);
    CHECK_OK(tp_mean_all(y, &loss));
    CHECK_OK(tp_backward(loss, NULL));
    tp_tensor *g = tp_tensor_grad(w);
    cr_assert(g && tp_tensor_is_meta(g));
    cr_assert_eq(tp_tensor_size(g, 0), 65536);
    tp_adam *opt = NULL;
    CHECK_OK(tp_adam_create(lin, 1e-3, 0.9, 0.999, 1e-8, &opt));
    CHECK_OK(tp_adam_step(opt));
    double norm = -1;
    CHECK_OK(tp_clip_grad_norm(lin, 1.0, 2.0, &norm));
    CHECK_OK(tp_memory_stats(TP_CPU, &after));
    cr_assert_eq(after.num_allocs, before.num_allocs, "%llu CPU tensor allocations",
                 (unsigned long long)(after.num_allocs - before.num_allocs));
    cr_assert_eq(after.peak_allocated, before.peak_allocated);
    tp_adam_free(opt);
    tp_tensor_release(loss);
    tp_tensor_release(y);
    tp_tensor_release(x);
    tp_module_free(lin);
}

/* meta -> CPU: zeros, ready for tp_module_init; CPU -> meta: the values go */
Test(meta, module_to_and_from_meta, .timeout = 10)
{
    tp_module *a = NULL, *b = NULL;
    CHECK_OK(tp_nn_linear_create(6, 5, true, &a));
    CHECK_OK(tp_module_init(a, 3));
    CHECK_OK(tp_nn_set_default_device(TP_META));
    tp_status st = tp_nn_linear_create(6, 5, true, &b);
    CHECK_OK(tp_nn_set_default_device(TP_CPU));
    CHECK_OK(st);
    CHECK_ERR(tp_nn_set_default_device((tp_device){TP_DEVICE_META, 2}), TP_ERR_INVALID_ARG);
    cr_assert_eq(tp_nn_default_device().type, TP_DEVICE_CPU);
    cr_assert(tp_tensor_is_meta(tp_module_parameter(b, "weight")));
    CHECK_OK(tp_module_to(b, TP_CPU));
    tp_tensor *bw = tp_module_parameter(b, "weight");
    cr_assert(!tp_tensor_is_meta(bw));
    cr_assert(tp_tensor_requires_grad(bw));
    double v = 1;
    CHECK_OK(tp_tensor_get(bw, (int64_t[]){4, 5}, &v));
    cr_assert_eq(v, 0.0, "meta -> CPU gives zeros");
    /* then initialised, it equals the module built on the CPU */
    CHECK_OK(tp_module_init(b, 3));
    bool eq = false;
    CHECK_OK(
        tp_tensor_equal(tp_module_parameter(a, "weight"), tp_module_parameter(b, "weight"), &eq));
    cr_assert(eq);
    CHECK_OK(tp_module_to(a, TP_META));
    cr_assert(tp_tensor_is_meta(tp_module_parameter(a, "bias")));
    cr_assert_eq(tp_tensor_size(tp_module_parameter(a, "weight"), 1), 6);
    double got = 0;
    CHECK_ERR(tp_tensor_get(tp_module_parameter(a, "bias"), (int64_t[]){0}, &got),
              TP_ERR_INVALID_ARG);
    tp_module_free(a);
    tp_module_free(b);
}
