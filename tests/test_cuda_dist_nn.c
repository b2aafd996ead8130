/* The op, style, module and optimizer layers on DTensors whose shards live
 * on TP_CUDA(0) (every rank of tp_run_local on the one GPU, through shm),
 * against the same programs on the CPU: forward values, gradients, updated
 * parameters and comm-debug counts (tests/tp_test_cuda_dist.h), within the
 * tolerances of docs/API.md, "CUDA against CPU". Without a GPU the CPU run
 * is still checked and the test then skips ("no CUDA device: ..."). */
#include "tp_test_cuda_dist.h"

static const int WORLDS[] = {1, 2, 3, 4};
#define N_WORLDS 4

/* ==== ops on DTensors ========================================================== */

#define MAX_IN 4

typedef tp_status (*op_fn)(tp_tensor *const *in, tp_tensor **y);

typedef struct op_case {
    const char *name;
    op_fn op;
    int nin;
    int nd[MAX_IN];
    int64_t shape[MAX_IN][4];
    tp_placement pl[MAX_IN];
    int64_t index_range[MAX_IN]; /* > 0: an i64 index input in [0, range) */
    unsigned diff;               /* bit i: input i gets a gradient */
    int64_t K;                   /* longest reduction feeding a result */
    int L;                       /* rounded ops (and accumulating adds) on the longest path */
    bool norm;                   /* f32 atol at least 1e-4: a norm's backward cancels */
} op_case;

/* The case's tolerance (docs/API.md, "CUDA against CPU"). */
static dist_tol tol_of(tp_dtype d, int64_t K, int L, bool norm)
{
    dist_tol t = dist_op_tol(d, K, L);
    if (norm && d == TP_F32 && t.atol < 1e-4)
        t.atol = 1e-4;
    return t;
}

static tp_status op_linear(tp_tensor *const *in, tp_tensor **y)
{
    return tp_linear(in[0], in[1], in[2], y);
}
static tp_status op_matmul(tp_tensor *const *in, tp_tensor **y)
{
    return tp_matmul(in[0], in[1], y);
}
static tp_status op_add_mul(tp_tensor *const *in, tp_tensor **y)
{
    tp_tensor *s = NULL;
    TP_TEST_TRY(tp_add(in[0], in[1], &s));
    tp_status st = tp_mul(s, in[0], y);
    tp_tensor_release(s);
    return st;
}
static tp_status op_gelu_tanh(tp_tensor *const *in, tp_tensor **y)
{
    return tp_gelu(in[0], TP_GELU_TANH, y);
}
static tp_status op_gelu_exact(tp_tensor *const *in, tp_tensor **y)
{
    return tp_gelu(in[0], TP_GELU_EXACT, y);
}
static tp_status op_softmax(tp_tensor *const *in, tp_tensor **y)
{
    return tp_softmax(in[0], -1, y);
}
static tp_status op_ce_mean(tp_tensor *const *in, tp_tensor **y)
{
    return tp_cross_entropy(in[0], in[1], NULL, y);
}
static tp_status op_ce_sum(tp_tensor *const *in, tp_tensor **y)
{
    tp_cross_entropy_options o = TP_CROSS_ENTROPY_DEFAULTS;
    o.reduction = TP_REDUCTION_SUM;
    return tp_cross_entropy(in[0], in[1], &o, y);
}
static tp_status op_layer_norm(tp_tensor *const *in, tp_tensor **y)
{
    return tp_layer_norm(in[0], in[1], in[2], 1e-5, y);
}
static tp_status op_rms_norm(tp_tensor *const *in, tp_tensor **y)
{
    return tp_rms_norm(in[0], in[1], 1e-5, y);
}
static tp_status op_embedding(tp_tensor *const *in, tp_tensor **y)
{
    return tp_embedding(in[0], in[1], y);
}
static tp_status op_attention(tp_tensor *const *in, tp_tensor **y)
{
    return tp_scaled_dot_product_attention(in[0], in[1], in[2], true, 0, y);
}

#define R                                 \
    {                                     \
        TP_PLACEMENT_REPLICATE, 0, TP_SUM \
    }
#define S(d)                          \
    {                                 \
        TP_PLACEMENT_SHARD, d, TP_SUM \
    }

static const op_case OPS[] = {
    {"linear colwise",
     op_linear,
     3,
     {2, 2, 1},
     {{5, 12}, {8, 12}, {8}},
     {R, S(0), S(0)},
     {0},
     7,
     12,
     2,
     false},
    {"linear rowwise",
     op_linear,
     3,
     {2, 2, 1},
     {{5, 12}, {8, 12}, {8}},
     {S(1), S(1), R},
     {0},
     7,
     12,
     2,
     false},
    {"matmul batch-sharded",
     op_matmul,
     2,
     {2, 2},
     {{6, 12}, {12, 7}},
     {S(0), R},
     {0},
     3,
     12,
     2,
     false},
    {"add and mul", op_add_mul, 2, {2, 2}, {{6, 8}, {6, 8}}, {S(0), S(0)}, {0}, 3, 1, 2, false},
    {"gelu tanh", op_gelu_tanh, 1, {2}, {{6, 8}}, {S(1)}, {0}, 1, 1, 2, false},
    {"gelu exact", op_gelu_exact, 1, {2}, {{6, 8}}, {S(0)}, {0}, 1, 1, 2, false},
    {"softmax rows sharded", op_softmax, 1, {2}, {{6, 8}}, {S(0)}, {0}, 1, 8, 2, false},
    {"softmax dim sharded", op_softmax, 1, {2}, {{6, 8}}, {S(1)}, {0}, 1, 8, 2, false},
    {"cross_entropy loss parallel, mean",
     op_ce_mean,
     2,
     {2, 1},
     {{6, 10}, {6}},
     {S(1), R},
     {0, 10},
     1,
     60,
     3,
     false},
    {"cross_entropy loss parallel, sum",
     op_ce_sum,
     2,
     {2, 1},
     {{6, 10}, {6}},
     {S(1), R},
     {0, 10},
     1,
     60,
     3,
     false},
    {"layer_norm sequence-sharded",
     op_layer_norm,
     3,
     {2, 1, 1},
     {{6, 8}, {8}, {8}},
     {S(0), R, R},
     {0},
     7,
     8,
     3,
     true},
    {"rms_norm sequence-sharded",
     op_rms_norm,
     2,
     {2, 1},
     {{6, 8}, {8}},
     {S(0), R},
     {0},
     3,
     8,
     3,
     true},
    /* the backward rounds once per added row: up to 7 adds into one row */
    {"embedding row-sharded",
     op_embedding,
     2,
     {1, 2},
     {{7}, {10, 6}},
     {R, S(0)},
     {10, 0},
     2,
     7,
     7,
     false},
    {"embedding column-sharded",
     op_embedding,
     2,
     {1, 2},
     {{7}, {10, 6}},
     {R, S(1)},
     {10, 0},
     2,
     7,
     7,
     false},
    {"attention heads-sharded",
     op_attention,
     3,
     {4, 4, 4},
     {{2, 4, 5, 8}, {2, 4, 5, 8}, {2, 4, 5, 8}},
     {S(1), S(1), S(1)},
     {0},
     7,
     8,
     4,
     false},
};
#define N_OPS ((int)(sizeof OPS / sizeof OPS[0]))

/* Input i of c as a DTensor on io's device: a leaf through its local shard
 * (requires grad when c->diff says so). */
static tp_status op_input(tp_mesh *mesh, dist_io *io, const op_case *c, int i, tp_tensor **local,
                          tp_tensor **dt)
{
    tp_tensor *full = NULL, *cpu = NULL;
    bool idx = c->index_range[i] > 0;
    TP_TEST_TRY(tp_tensor_zeros(idx ? TP_I64 : TP_F32, TP_CPU, c->nd[i], c->shape[i], &full));
    TP_TEST_TRY(tp_tensor_fill_random(full, idx ? TP_RNG_RANDINT : TP_RNG_UNIFORM, idx ? 0 : -1,
                                      idx ? (double)c->index_range[i] : 1, 50 + (uint64_t)i, NULL,
                                      NULL));
    TP_TEST_TRY(tp_dtensor_distribute(mesh, full, 1, &c->pl[i], -1, &cpu));
    TP_TEST_TRY(tp_tensor_to(tp_dtensor_local(cpu), idx ? TP_I64 : io->dtype, io->dev, local));
    if (c->diff & (1u << i))
        TP_TEST_TRY(tp_tensor_set_requires_grad(*local, true));
    tp_from_local_options o = {.global_shape = c->shape[i]};
    TP_TEST_TRY(tp_dtensor_from_local(mesh, *local, 1, &c->pl[i], &o, dt));
    tp_tensor_release(full);
    tp_tensor_release(cpu);
    return TP_OK;
}

/* The op forward (its full value) and backward from a seeded gradient of
 * the full value (the same on every rank): the gradients reaching each
 * differentiable input's local shard. */
static tp_status op_prog(tp_comm *w, dist_io *io)
{
    const op_case *c = &OPS[io->arg];
    tp_mesh *mesh = NULL;
    int64_t n = tp_comm_size(w);
    tp_tensor *local[MAX_IN] = {0}, *dt[MAX_IN] = {0}, *y = NULL, *yf = NULL, *g = NULL;
    RANK_OK(io->s, tp_mesh_create(w, 1, &n, NULL, &mesh));
    for (int i = 0; i < c->nin; i++)
        RANK_OK(io->s, op_input(mesh, io, c, i, &local[i], &dt[i]));
    RANK_OK(io->s, c->op(dt, &y));
    RANK_OK(io->s, tp_dtensor_full_tensor(y, &yf));
    dist_tol tol = tol_of(io->dtype, c->K, c->L, c->norm);
    RANK_OK(io->s, dist_keep(io, "forward", yf, tol));
    if (tp_tensor_ndim(yf) == 0) {
        RANK_OK(io->s, tp_backward(yf, NULL));
    } else {
        RANK_OK(io->s,
                dist_rand(tp_tensor_ndim(yf), tp_tensor_shape(yf), io->dtype, io->dev, 77, &g));
        RANK_OK(io->s, tp_backward(yf, g));
    }
    for (int i = 0; i < c->nin; i++) {
        if (!(c->diff & (1u << i)))
            continue;
        char name[32];
        snprintf(name, sizeof name, "gradient of input %d", i);
        RANK_OK(io->s, dist_keep(io, name, tp_tensor_grad(local[i]), tol));
    }
    for (int i = 0; i < c->nin; i++) {
        tp_tensor_release(local[i]);
        tp_tensor_release(dt[i]);
    }
    tp_tensor_release(y);
    tp_tensor_release(yf);
    tp_tensor_release(g);
    tp_mesh_free(mesh);
    return TP_OK;
}

static const tp_dtype OP_DTYPES[] = {TP_F32, TP_BF16, TP_F16};
#define N_OP_DTYPES 3

ParameterizedTestParameters(cuda_dist, ops)
{
    static dist_param p[N_OPS * N_OP_DTYPES * N_WORLDS];
    int k = 0;
    for (int o = 0; o < N_OPS; o++)
        for (int d = 0; d < N_OP_DTYPES; d++)
            for (int i = 0; i < N_WORLDS; i++)
                p[k++] = (dist_param){WORLDS[i], OP_DTYPES[d], o};
    return cr_make_param_array(dist_param, p, (size_t)k);
}

ParameterizedTest(dist_param *p, cuda_dist, ops, .timeout = 60)
{
    char label[96];
    snprintf(label, sizeof label, "%s, %s, world %d", OPS[p->arg].name, tp_dtype_name(p->dtype),
             p->n);
    dist_compare(p->n, op_prog, p->dtype, p->arg, label);
}

/* ==== modules, styles and a training step ======================================== */

/* Hangs *child (made with status st) under parent as `name`; frees it when
 * that fails. */
static tp_status add(tp_module *parent, const char *name, tp_status st, tp_module **child)
{
    if (st == TP_OK && (st = tp_module_add_child(parent, name, *child)) != TP_OK)
        tp_module_free(*child);
    return st;
}

/* net1 Linear(in, hid), gelu, net2 Linear(hid, out). */
static tp_status mlp(int64_t in, int64_t hid, int64_t out, tp_module **m)
{
    tp_module *a = NULL, *g = NULL, *b = NULL;
    TP_TEST_TRY(tp_nn_sequential_create(m));
    tp_status st = add(*m, "net1", tp_nn_linear_create(in, hid, true, &a), &a);
    if (st == TP_OK)
        st = add(*m, "gelu", tp_nn_gelu_create(TP_GELU_TANH, &g), &g);
    if (st == TP_OK)
        st = add(*m, "net2", tp_nn_linear_create(hid, out, true, &b), &b);
    if (st != TP_OK) {
        tp_module_free(*m);
        *m = NULL;
    }
    return st;
}

/* ---- a small transformer block: x + attn(norm1(x)), then + mlp(norm2(.)) ---- */

#define E 24 /* model dim */
#define HD 2 /* head dim: 12 heads, whole heads on 1, 2, 3 and 4 ranks */
#define SEQ 5

/* [B, S, h*HD] -> [B, h, S, HD] */
static tp_status heads(tp_tensor *x, tp_tensor **out)
{
    tp_tensor *v = NULL;
    const int64_t shape[4] = {tp_tensor_size(x, 0), tp_tensor_size(x, 1), -1, HD};
    TP_TEST_TRY(tp_reshape(x, 4, shape, &v));
    tp_status st = tp_transpose(v, 1, 2, out);
    tp_tensor_release(v);
    return st;
}

/* Attention over the local heads (wq, wk, wv colwise: this rank's heads;
 * wo rowwise: the sum over ranks). */
static tp_status attn_fwd(tp_module *self, int nargs, tp_tensor *const *args, int nkw,
                          const tp_kwarg *kw, tp_tensor **out)
{
    static const char *const names[3] = {"wq", "wk", "wv"};
    tp_tensor *p[3] = {0}, *h[3] = {0}, *a = NULL, *t = NULL, *m = NULL;
    tp_status st = TP_OK;
    for (int i = 0; i < 3 && st == TP_OK; i++) {
        st = tp_module_call(tp_module_child(self, names[i]), args[0], &p[i]);
        if (st == TP_OK)
            st = heads(p[i], &h[i]);
    }
    if (st == TP_OK)
        st = tp_scaled_dot_product_attention(h[0], h[1], h[2], true, 0, &a);
    if (st == TP_OK)
        st = tp_transpose(a, 1, 2, &t);
    if (st == TP_OK)
        st = tp_flatten(t, 2, 3, &m);
    if (st == TP_OK)
        st = tp_module_call(tp_module_child(self, "wo"), m, out);
    for (int i = 0; i < 3; i++) {
        tp_tensor_release(p[i]);
        tp_tensor_release(h[i]);
    }
    tp_tensor_release(a);
    tp_tensor_release(t);
    tp_tensor_release(m);
    return st;
}

/* x + f(norm(x)) */
static tp_status residual(tp_module *norm, tp_module *f, tp_tensor *x, tp_tensor **out)
{
    tp_tensor *n = NULL, *y = NULL;
    TP_TEST_TRY(tp_module_call(norm, x, &n));
    tp_status st = tp_module_call(f, n, &y);
    if (st == TP_OK)
        st = tp_add(x, y, out);
    tp_tensor_release(n);
    tp_tensor_release(y);
    return st;
}

static tp_status block_fwd(tp_module *self, int nargs, tp_tensor *const *args, int nkw,
                           const tp_kwarg *kw, tp_tensor **out)
{
    tp_tensor *h = NULL;
    TP_TEST_TRY(
        residual(tp_module_child(self, "norm1"), tp_module_child(self, "attn"), args[0], &h));
    tp_status st = residual(tp_module_child(self, "norm2"), tp_module_child(self, "mlp"), h, out);
    tp_tensor_release(h);
    return st;
}

static tp_status block(tp_module **out)
{
    tp_module *b = NULL, *at = NULL, *c = NULL;
    TP_TEST_TRY(tp_nn_custom_create("Block", block_fwd, NULL, NULL, &b));
    tp_status st = add(b, "norm1", tp_nn_layer_norm_create(E, true, 1e-5, &c), &c);
    if (st == TP_OK)
        st = add(b, "attn", tp_nn_custom_create("Attention", attn_fwd, NULL, NULL, &at), &at);
    static const char *const lin[4] = {"wq", "wk", "wv", "wo"};
    for (int i = 0; i < 4 && st == TP_OK; i++)
        st = add(at, lin[i], tp_nn_linear_create(E, E, i < 3, &c), &c);
    if (st == TP_OK)
        st = add(b, "norm2", tp_nn_rms_norm_create(E, true, 1e-5, &c), &c);
    if (st == TP_OK)
        st = add(b, "mlp", mlp(E, 2 * E, E, &c), &c);
    *out = b;
    return st;
}

/* ---- the models, their plans and inputs ------------------------------------ */

enum { M_MLP, M_MLP_SP, M_SEQ_BLOCK, M_EMBED, M_BLOCK, N_MODELS };
static const char *const MODEL_NAMES[N_MODELS] = {
    "MLP colwise/rowwise", "MLP sequence parallel", "norm + MLP sequence parallel",
    "Embedding rowwise + Linear colwise", "transformer block"};

/* The longest reduction feeding a value or gradient (features, hidden
 * units or batch rows), and the rounded ops on the longest path. */
static const int64_t MODEL_K[N_MODELS] = {16, 32, 24, 16, 48};
static const int MODEL_L[N_MODELS] = {4, 4, 5, 6, 8}; /* embedding: 6 lookups */
static const bool MODEL_NORM[N_MODELS] = {false, false, true, false, true};

enum { O_SGD, O_ADAM, O_ADAMW, N_OPTS };
static const char *const OPT_NAMES[N_OPTS] = {"sgd", "adam", "adamw"};

typedef struct plan {
    int n;
    tp_plan_entry e[8];
    tp_style *own[8];
} plan;

/* Appends the style *s (made with status st) as the entry for fqn. */
static tp_status plan_add(plan *p, const char *fqn, tp_status st, tp_style **s)
{
    if (st != TP_OK)
        return st;
    p->own[p->n] = *s;
    p->e[p->n++] = (tp_plan_entry){fqn, *s};
    return TP_OK;
}

static tp_status col(plan *p, const char *fqn, tp_placement in)
{
    tp_style *s = NULL;
    tp_colwise_options o = {.input_layouts = tp_layout_of(in)};
    return plan_add(p, fqn, tp_colwise_parallel_create(&o, &s), &s);
}

static tp_status row(plan *p, const char *fqn, tp_placement out)
{
    tp_style *s = NULL;
    tp_rowwise_options o = {.output_layouts = tp_layout_of(out)};
    return plan_add(p, fqn, tp_rowwise_parallel_create(&o, &s), &s);
}

/* The model, its plan, and the input shape (a plain local input: the whole
 * batch, or this rank's sequence shard for the sequence-parallel ones). */
static tp_status model_of(int which, tp_module **m, plan *p, int *nd, int64_t *xs, bool *index)
{
    tp_module *c = NULL;
    tp_style *sp = NULL;
    tp_status st = TP_OK;
    *index = false;
    switch (which) {
    case M_MLP:
    case M_MLP_SP: {
        bool seq = which == M_MLP_SP;
        st = mlp(10, 16, 10, m);
        if (st == TP_OK)
            st = col(p, "net1", seq ? tp_shard(0) : tp_replicate());
        if (st == TP_OK)
            st = row(p, "net2", seq ? tp_shard(0) : tp_replicate());
        *nd = 2, xs[0] = 8, xs[1] = 10;
        break;
    }
    case M_SEQ_BLOCK:
        TP_TEST_TRY(tp_nn_sequential_create(m));
        st = add(*m, "norm", tp_nn_layer_norm_create(8, true, 1e-5, &c), &c);
        if (st == TP_OK)
            st = add(*m, "mlp", mlp(8, 24, 8, &c), &c);
        if (st == TP_OK)
            st = plan_add(p, "norm", tp_sequence_parallel_create(NULL, &sp), &sp);
        if (st == TP_OK)
            st = col(p, "mlp.net1", tp_shard(1));
        if (st == TP_OK)
            st = row(p, "mlp.net2", tp_shard(1));
        *nd = 3, xs[0] = 2, xs[1] = 3, xs[2] = 8;
        break;
    case M_EMBED: {
        tp_style *s = NULL;
        TP_TEST_TRY(tp_nn_sequential_create(m));
        st = add(*m, "emb", tp_nn_embedding_create(16, 8, &c), &c);
        if (st == TP_OK)
            st = add(*m, "lin", tp_nn_linear_create(8, 6, true, &c), &c);
        if (st == TP_OK)
            st = plan_add(p, "emb", tp_rowwise_parallel_create(NULL, &s), &s);
        if (st == TP_OK)
            st = col(p, "lin", tp_replicate());
        *nd = 2, xs[0] = 2, xs[1] = 3, *index = true;
        break;
    }
    default:
        st = block(m);
        static const char *const cols[4] = {"attn.wq", "attn.wk", "attn.wv", "mlp.net1"};
        for (int i = 0; i < 4 && st == TP_OK; i++)
            st = col(p, cols[i], tp_replicate());
        if (st == TP_OK)
            st = row(p, "attn.wo", tp_replicate());
        if (st == TP_OK)
            st = row(p, "mlp.net2", tp_replicate());
        *nd = 3, xs[0] = 2, xs[1] = SEQ, xs[2] = E;
        break;
    }
    return st;
}

/* Largest |t| (0 for NULL). */
static double absmax(const tp_tensor *t)
{
    tp_tensor *z = NULL;
    double m = 0;
    if (t && tp_tensor_zeros(tp_tensor_dtype(t), tp_tensor_device(t), tp_tensor_ndim(t),
                             tp_tensor_shape(t), &z) == TP_OK)
        tp_tensor_max_abs_diff(t, z, &m);
    tp_tensor_release(z);
    return m;
}

#define LR_SGD 0.1
#define LR_ADAM 1e-3
#define EPS_ADAM \
    1e-3 /* lr / eps = 1: the first step moves a parameter by at
                       * most the gradient's own difference */

typedef struct keep_ctx {
    dist_io *io;
    const char *what;
    dist_tol tol;
    double factor; /* updated parameters: lr (SGD) or lr / eps (Adam) */
} keep_ctx;

/* Keeps each parameter's gradient (what "grad") or value ("param"). */
static tp_status keep_param(const char *fqn, tp_tensor *t, void *arg)
{
    keep_ctx *k = arg;
    char name[160];
    snprintf(name, sizeof name, "%s %s", fqn, k->what);
    if (k->what[0] == 'g')
        return dist_keep(k->io, name, tp_tensor_grad(t), k->tol);
    /* the step moves p by factor x (gradient difference), bounded by the
     * gradient tolerance at the largest gradient; the stored parameter is
     * rounded once more to its dtype */
    const tp_tensor *gl = tp_tensor_grad(t);
    if (gl && tp_tensor_is_dtensor(gl))
        gl = tp_dtensor_local(gl);
    dist_tol pt = {2 * dist_eps(k->io->dtype),
                   k->factor * (k->tol.atol + k->tol.rtol * absmax(gl))};
    return dist_keep(k->io, name, t, pt);
}

static tp_status optimizer_step(tp_module *m, int opt, tp_sgd **sgd, tp_adam **adam)
{
    if (opt == O_SGD) {
        TP_TEST_TRY(tp_sgd_create(m, LR_SGD, sgd));
        return tp_sgd_opt_step(*sgd);
    }
    tp_adam_options o = {.lr = LR_ADAM,
                         .eps = EPS_ADAM,
                         .weight_decay = opt == O_ADAMW ? 0.1 : 0,
                         .decoupled = opt == O_ADAMW};
    TP_TEST_TRY(tp_adam_create_with(m, &o, adam));
    return tp_adam_step(*adam);
}

/* loss = mean(y * y) over this rank's output. */
static tp_status loss_of(tp_tensor *y, tp_tensor **loss)
{
    tp_tensor *sq = NULL, *yl = y;
    if (tp_tensor_is_dtensor(y))
        TP_TEST_TRY(tp_dtensor_full_tensor(y, &yl));
    tp_status st = tp_mul(yl, yl, &sq);
    if (st == TP_OK)
        st = tp_mean_all(sq, loss);
    if (yl != y)
        tp_tensor_release(yl);
    tp_tensor_release(sq);
    return st;
}

/* One training step of model (arg / N_OPTS) with optimizer (arg % N_OPTS):
 * moved to the device, cast to the dtype, parallelized; forward, loss,
 * backward, step. Keeps output, loss, gradients and updated parameters. */
static tp_status train_prog(tp_comm *w, dist_io *io)
{
    int which = io->arg / N_OPTS, opt = io->arg % N_OPTS, nd = 0;
    int64_t n = tp_comm_size(w), xs[4];
    bool index = false;
    tp_mesh *mesh = NULL;
    tp_module *m = NULL;
    plan p = {0};
    tp_tensor *xc = NULL, *x = NULL, *y = NULL, *loss = NULL;
    tp_sgd *sgd = NULL;
    tp_adam *adam = NULL;
    RANK_OK(io->s, tp_mesh_create(w, 1, &n, NULL, &mesh));
    RANK_OK(io->s, model_of(which, &m, &p, &nd, xs, &index));
    RANK_OK(io->s, tp_module_init(m, 5));
    RANK_OK(io->s, tp_module_to(m, io->dev));
    RANK_OK(io->s, tp_module_to_dtype(m, io->dtype));
    RANK_OK(io->s, tp_parallelize_module(m, mesh, p.n, p.e, NULL));
    uint64_t seed =
        60 + (which == M_MLP_SP || which == M_SEQ_BLOCK ? (uint64_t)tp_comm_rank(w) : 0);
    if (index) {
        RANK_OK(io->s, tp_tensor_zeros(TP_I64, TP_CPU, nd, xs, &xc));
        RANK_OK(io->s, tp_tensor_fill_random(xc, TP_RNG_RANDINT, 0, 16, seed, NULL, NULL));
        RANK_OK(io->s, tp_tensor_to(xc, TP_I64, io->dev, &x));
    } else {
        RANK_OK(io->s, dist_rand(nd, xs, io->dtype, io->dev, seed, &x));
    }
    RANK_OK(io->s, tp_module_call(m, x, &y));
    RANK_OK(io->s, loss_of(y, &loss));
    RANK_OK(io->s, tp_backward(loss, NULL));
    dist_tol tol = tol_of(io->dtype, MODEL_K[which], MODEL_L[which], MODEL_NORM[which]);
    RANK_OK(io->s, dist_keep(io, "output", y, tol));
    RANK_OK(io->s, dist_keep(io, "loss", loss, tol));
    keep_ctx k = {io, "grad", tol, 0};
    RANK_OK(io->s, tp_module_named_parameters(m, keep_param, &k));
    RANK_OK(io->s, optimizer_step(m, opt, &sgd, &adam));
    k.what = "param";
    k.factor = opt == O_SGD ? LR_SGD : LR_ADAM / EPS_ADAM;
    RANK_OK(io->s, tp_module_named_parameters(m, keep_param, &k));
    for (int i = 0; i < p.n; i++)
        tp_style_free(p.own[i]);
    tp_sgd_free(sgd);
    tp_adam_free(adam);
    tp_tensor *all[] = {xc, x, y, loss};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        tp_tensor_release(all[i]);
    tp_module_free(m);
    tp_mesh_free(mesh);
    return TP_OK;
}

static const tp_dtype TRAIN_DTYPES[] = {TP_F32, TP_BF16};

ParameterizedTestParameters(cuda_dist, train_step)
{
    static dist_param p[N_MODELS * N_OPTS * 2 * N_WORLDS];
    int k = 0;
    for (int a = 0; a < N_MODELS * N_OPTS; a++)
        for (int d = 0; d < 2; d++)
            for (int i = 0; i < N_WORLDS; i++)
                p[k++] = (dist_param){WORLDS[i], TRAIN_DTYPES[d], a};
    return cr_make_param_array(dist_param, p, (size_t)k);
}

ParameterizedTest(dist_param *p, cuda_dist, train_step, .timeout = 120)
{
    char label[128];
    snprintf(label, sizeof label, "%s, %s, %s, world %d", MODEL_NAMES[p->arg / N_OPTS],
             OPT_NAMES[p->arg % N_OPTS], tp_dtype_name(p->dtype), p->n);
    dist_compare(p->n, train_prog, p->dtype, p->arg, label);
}

/* ==== DDP on a dp x tp mesh ===================================================== */

/* 2x2 mesh (dp, tp): the MLP colwise/rowwise over tp, wrapped by a DDP over
 * dp (bf16 gradients reduced in f32), each dp row its own batch; two SGD
 * steps. */
static tp_status ddp_prog(tp_comm *w, dist_io *io)
{
    tp_mesh *mesh = NULL, *tpm = NULL;
    tp_module *m = NULL;
    tp_ddp *ddp = NULL;
    plan p = {0};
    const char *const names[2] = {"dp", "tp"};
    RANK_OK(io->s, tp_mesh_create(w, 2, (int64_t[]){2, 2}, names, &mesh));
    RANK_OK(io->s, tp_mesh_slice(mesh, 1, (const char *const[]){"tp"}, &tpm));
    RANK_OK(io->s, mlp(10, 16, 10, &m));
    RANK_OK(io->s, col(&p, "net1", tp_replicate()));
    RANK_OK(io->s, row(&p, "net2", tp_replicate()));
    RANK_OK(io->s, tp_module_init(m, 5));
    RANK_OK(io->s, tp_module_to(m, io->dev));
    RANK_OK(io->s, tp_module_to_dtype(m, io->dtype));
    RANK_OK(io->s, tp_parallelize_module(m, tpm, p.n, p.e, NULL));
    tp_ddp_options o = {
        .bucket_cap_bytes = 300, .has_reduce_dtype = io->dtype != TP_F32, .reduce_dtype = TP_F32};
    RANK_OK(io->s, tp_ddp_create(m, tp_mesh_comm(mesh, 0), &o, &ddp));
    dist_tol tol = tol_of(io->dtype, MODEL_K[M_MLP], MODEL_L[M_MLP] + 1, false);
    for (int step = 0; step < 2; step++) {
        tp_tensor *x = NULL, *y = NULL, *loss = NULL;
        uint64_t seed = 200 + 10 * (uint64_t)step + (uint64_t)tp_mesh_coord(mesh, 0);
        RANK_OK(io->s, dist_rand(2, (int64_t[]){6, 10}, io->dtype, io->dev, seed, &x));
        RANK_OK(io->s, tp_module_call(m, x, &y));
        RANK_OK(io->s, loss_of(y, &loss));
        RANK_OK(io->s, tp_backward(loss, NULL));
        RANK_OK(io->s, dist_keep(io, "output", y, tol));
        keep_ctx k = {io, "grad", tol, 0};
        RANK_OK(io->s, tp_ddp_sync(ddp));
        RANK_OK(io->s, tp_module_named_parameters(m, keep_param, &k));
        RANK_OK(io->s, tp_sgd_step(m, LR_SGD));
        k.what = "param";
        k.factor = LR_SGD;
        RANK_OK(io->s, tp_module_named_parameters(m, keep_param, &k));
        tp_module_zero_grad(m);
        tp_tensor_release(x);
        tp_tensor_release(y);
        tp_tensor_release(loss);
    }
    for (int i = 0; i < p.n; i++)
        tp_style_free(p.own[i]);
    tp_ddp_free(ddp);
    tp_module_free(m);
    tp_mesh_free(tpm);
    tp_mesh_free(mesh);
    return TP_OK;
}

ParameterizedTestParameters(cuda_dist, ddp_dp_x_tp)
{
    static dist_param p[] = {{4, TP_F32, 0}, {4, TP_BF16, 0}};
    return cr_make_param_array(dist_param, p, 2);
}

ParameterizedTest(dist_param *p, cuda_dist, ddp_dp_x_tp, .timeout = 120)
{
    char label[64];
    snprintf(label, sizeof label, "DDP 2x2 dp x tp, %s", tp_dtype_name(p->dtype));
    dist_compare(p->n, ddp_prog, p->dtype, 0, label);
}
