/* The CUDA engine against the CPU one: every op on CUDA tensors gives the CPU
 * result (forward and gradients) within the tolerances docs/API.md states;
 * cuBLAS products in f32, f16 and bf16; the TF32 setting; inputs on
 * different devices; tp_module_to; SGD and Adam steps on a device.
 *
 * Every test that needs a GPU skips visibly ("no CUDA device: ...") when
 * libtp has no CUDA or the machine has no device. The tests run on the main
 * thread with plain tensors: the ops' device dispatch is what is under test,
 * not the collectives. */
#include <math.h>
#include <pthread.h>

#include "tp_test.h"

#define DEV TP_CUDA(0)

/* f32 kernels: reductions in double, elementwise math in float; the order
 * of additions differs from the CPU's (and atomicAdd orders vary), so
 * results agree to a few float ulps relative to the magnitudes summed. */
#define RTOL 1e-4
#define ATOL 1e-5

static void need_cuda(void)
{
    if (tp_cuda_device_count() > 0)
        return;
    cr_skip_test("no CUDA device: %s",
                 TP_HAVE_CUDA ? "libtp has CUDA but the machine shows no device"
                              : "libtp was built without CUDA");
}

/* A CPU f32 tensor of uniform values in [a, b) from seed. */
static tp_tensor *rnd(int nd, const int64_t *shape, double a, double b, uint64_t seed)
{
    tp_tensor *t = NULL;
    CHECK_OK(tp_tensor_empty(TP_F32, TP_CPU, nd, shape, &t));
    CHECK_OK(tp_tensor_fill_random(t, TP_RNG_UNIFORM, a, b, seed, NULL, NULL));
    return t;
}

static tp_tensor *to_dev(const tp_tensor *t, tp_device dev)
{
    tp_tensor *r = NULL;
    CHECK_OK(tp_tensor_to(t, tp_tensor_dtype(t), dev, &r));
    return r;
}

static bool on(const tp_tensor *t, tp_device dev)
{
    tp_device d = tp_tensor_device(t);
    return d.type == dev.type && d.index == dev.index;
}

static void expect_close(const char *what, const tp_tensor *got, const tp_tensor *want,
                         double rtol, double atol)
{
    bool close = false;
    double diff = 0;
    CHECK_OK(tp_tensor_allclose(got, want, rtol, atol, &close));
    CHECK_OK(tp_tensor_max_abs_diff(got, want, &diff));
    cr_assert(close, "%s: CUDA differs from CPU by up to %g (rtol %g, atol %g)", what, diff, rtol,
              atol);
}

/* ---- the generic op check ----------------------------------------------------- */

typedef tp_status (*op_fn)(tp_tensor *const *in, const void *ctx, tp_tensor **y);

/* Runs op on `dev` with copies of the CPU inputs (diff bit i: input i gets a
 * gradient); loss = sum(y * r) for a fixed random r, so every gradient
 * element is exercised. *y and g[i] receive CPU copies of the results. */
static void run_on(tp_device dev, op_fn op, const void *ctx, int n, tp_tensor *const *cpu,
                   unsigned diff, tp_tensor **y_out, tp_tensor **g)
{
    tp_tensor *in[4] = {0}, *y = NULL, *yr = NULL, *loss = NULL, *r = NULL;
    for (int i = 0; i < n; i++) {
        if (!cpu[i])
            continue;
        in[i] = to_dev(cpu[i], dev);
        if (diff & (1u << i))
            CHECK_OK(tp_tensor_set_requires_grad(in[i], true));
    }
    CHECK_OK(op(in, ctx, &y));
    cr_assert(on(y, dev), "the output is not on the inputs' device");
    r = rnd(tp_tensor_ndim(y), tp_tensor_shape(y), -1, 1, 777);
    tp_tensor *rd = to_dev(r, dev);
    CHECK_OK(tp_mul(y, rd, &yr));
    CHECK_OK(tp_sum_all(yr, &loss));
    if (diff)
        CHECK_OK(tp_backward(loss, NULL));
    CHECK_OK(tp_tensor_to(y, tp_tensor_dtype(y), TP_CPU, y_out));
    for (int i = 0; i < n; i++) {
        g[i] = NULL;
        if (!(diff & (1u << i)))
            continue;
        tp_tensor *gi = tp_tensor_grad(in[i]);
        cr_assert(gi, "input %d has no gradient", i);
        cr_assert(on(gi, dev), "the gradient of input %d is not on the input's device", i);
        CHECK_OK(tp_tensor_to(gi, tp_tensor_dtype(gi), TP_CPU, &g[i]));
    }
    tp_tensor_release(rd);
    tp_tensor_release(r);
    tp_tensor_release(loss);
    tp_tensor_release(yr);
    tp_tensor_release(y);
    for (int i = 0; i < n; i++)
        tp_tensor_release(in[i]);
}

static void check_op(const char *name, op_fn op, const void *ctx, int n, tp_tensor **cpu,
                     unsigned diff, double rtol, double atol)
{
    tp_tensor *yc = NULL, *yg = NULL, *gc[4] = {0}, *gg[4] = {0};
    run_on(TP_CPU, op, ctx, n, cpu, diff, &yc, gc);
    run_on(DEV, op, ctx, n, cpu, diff, &yg, gg);
    char what[128]; /* a name of up to 95 characters and the suffix */
    snprintf(what, sizeof what, "%s forward", name);
    expect_close(what, yg, yc, rtol, atol);
    for (int i = 0; i < n; i++) {
        if (!(diff & (1u << i)))
            continue;
        snprintf(what, sizeof what, "%s gradient of input %d", name, i);
        expect_close(what, gg[i], gc[i], rtol, atol);
    }
    tp_tensor_release(yc);
    tp_tensor_release(yg);
    for (int i = 0; i < n; i++) {
        tp_tensor_release(gc[i]);
        tp_tensor_release(gg[i]);
        tp_tensor_release(cpu[i]);
    }
}

/* ---- op adapters --------------------------------------------------------------- */

static tp_status op_linear(tp_tensor *const *in, const void *c, tp_tensor **y)
{
    (void)c;
    return tp_linear(in[0], in[1], in[2], y);
}
static tp_status op_matmul(tp_tensor *const *in, const void *c, tp_tensor **y)
{
    (void)c;
    return tp_matmul(in[0], in[1], y);
}
static tp_status op_add(tp_tensor *const *in, const void *c, tp_tensor **y)
{
    (void)c;
    return tp_add(in[0], in[1], y);
}
static tp_status op_mul(tp_tensor *const *in, const void *c, tp_tensor **y)
{
    (void)c;
    return tp_mul(in[0], in[1], y);
}
static tp_status op_scale(tp_tensor *const *in, const void *c, tp_tensor **y)
{
    (void)c;
    return tp_scale(in[0], -2.5, y);
}
static tp_status op_relu(tp_tensor *const *in, const void *c, tp_tensor **y)
{
    (void)c;
    return tp_relu(in[0], y);
}
static tp_status op_gelu(tp_tensor *const *in, const void *c, tp_tensor **y)
{
    return tp_gelu(in[0], *(const tp_gelu_approx *)c, y);
}
static tp_status op_silu(tp_tensor *const *in, const void *c, tp_tensor **y)
{
    (void)c;
    return tp_silu(in[0], y);
}
static tp_status op_swiglu(tp_tensor *const *in, const void *c, tp_tensor **y)
{
    (void)c;
    return tp_swiglu(in[0], in[1], y);
}
static tp_status op_dropout(tp_tensor *const *in, const void *c, tp_tensor **y)
{
    return tp_dropout(in[0], *(const double *)c, 1234, true, y);
}
static tp_status op_reshape(tp_tensor *const *in, const void *c, tp_tensor **y)
{
    (void)c;
    const int64_t shape[2] = {-1, 6};
    return tp_reshape(in[0], 2, shape, y);
}
static tp_status op_transpose(tp_tensor *const *in, const void *c, tp_tensor **y)
{
    const int *d = c;
    return tp_transpose(in[0], d[0], d[1], y);
}
static tp_status op_permute(tp_tensor *const *in, const void *c, tp_tensor **y)
{
    return tp_permute(in[0], 3, c, y);
}
static tp_status op_flatten_unflatten(tp_tensor *const *in, const void *c, tp_tensor **y)
{
    (void)c;
    tp_tensor *f = NULL;
    tp_status st = tp_flatten(in[0], 1, 2, &f);
    if (st == TP_OK)
        st = tp_unflatten(f, -1, 2, (const int64_t[]){-1, 3}, y);
    tp_tensor_release(f);
    return st;
}
typedef struct {
    int dim;
    bool keepdim, mean, all;
} red_ctx;
static tp_status op_reduce(tp_tensor *const *in, const void *c, tp_tensor **y)
{
    const red_ctx *r = c;
    if (r->all)
        return r->mean ? tp_mean_all(in[0], y) : tp_sum_all(in[0], y);
    return r->mean ? tp_mean(in[0], r->dim, r->keepdim, y) : tp_sum(in[0], r->dim, r->keepdim, y);
}
static tp_status op_softmax(tp_tensor *const *in, const void *c, tp_tensor **y)
{
    return tp_softmax(in[0], *(const int *)c, y);
}
static tp_status op_layer_norm(tp_tensor *const *in, const void *c, tp_tensor **y)
{
    (void)c;
    return tp_layer_norm(in[0], in[1], in[2], 1e-5, y);
}
static tp_status op_rms_norm(tp_tensor *const *in, const void *c, tp_tensor **y)
{
    (void)c;
    return tp_rms_norm(in[0], in[1], 1e-6, y);
}
static tp_status op_embedding(tp_tensor *const *in, const void *c, tp_tensor **y)
{
    (void)c;
    return tp_embedding(in[0], in[1], y);
}
static tp_status op_ce(tp_tensor *const *in, const void *c, tp_tensor **y)
{
    tp_cross_entropy_options o = *(const tp_cross_entropy_options *)c;
    o.weight = in[2];
    return tp_cross_entropy(in[0], in[1], &o, y);
}
static tp_status op_sdpa(tp_tensor *const *in, const void *c, tp_tensor **y)
{
    return tp_scaled_dot_product_attention(in[0], in[1], in[2], *(const bool *)c, 0, y);
}

/* in[0] x [B, H, S, D], in[1] i64 positions [B, S]: cos and sin computed
 * where the positions are (the rope_cos_sin kernel), then the embedding */
static tp_status op_rope(tp_tensor *const *in, const void *c, tp_tensor **y)
{
    tp_tensor *co = NULL, *si = NULL;
    tp_status st = tp_rope_cos_sin(c, in[1], tp_tensor_dtype(in[0]), &co, &si);
    if (st == TP_OK)
        st = tp_rotary_embedding(in[0], co, si, y);
    tp_tensor_release(co);
    tp_tensor_release(si);
    return st;
}

/* i64 CPU tensor of integers in [a, b) */
static tp_tensor *rnd_idx(int nd, const int64_t *shape, int64_t a, int64_t b, uint64_t seed)
{
    tp_tensor *t = NULL;
    CHECK_OK(tp_tensor_empty(TP_I64, TP_CPU, nd, shape, &t));
    CHECK_OK(tp_tensor_fill_random(t, TP_RNG_RANDINT, (double)a, (double)b, seed, NULL, NULL));
    return t;
}

/* ---- ops, forward and backward ------------------------------------------------- */

Test(cuda, linear_and_matmul, .timeout = 120)
{
    need_cuda();
    const int64_t xs[3] = {3, 5, 32}, ws[2] = {24, 32}, bs[1] = {24};
    tp_tensor *in[3] = {rnd(3, xs, -1, 1, 1), rnd(2, ws, -1, 1, 2), rnd(1, bs, -1, 1, 3)};
    check_op("linear", op_linear, NULL, 3, in, 7u, RTOL, ATOL);
    tp_tensor *nb[3] = {rnd(3, xs, -1, 1, 1), rnd(2, ws, -1, 1, 2), NULL};
    check_op("linear without bias", op_linear, NULL, 3, nb, 3u, RTOL, ATOL);
    const int64_t as[3] = {2, 7, 16}, bm[2] = {16, 9};
    tp_tensor *mm[2] = {rnd(3, as, -1, 1, 4), rnd(2, bm, -1, 1, 5)};
    check_op("matmul", op_matmul, NULL, 2, mm, 3u, RTOL, ATOL);
    /* an empty inner dim: C = 0 (cuBLAS is not called) */
    const int64_t ze[2] = {4, 0}, zw[2] = {3, 0};
    tp_tensor *z[3] = {rnd(2, ze, -1, 1, 6), rnd(2, zw, -1, 1, 7), NULL};
    check_op("linear with 0 features", op_linear, NULL, 3, z, 0u, RTOL, ATOL);
}

Test(cuda, elementwise, .timeout = 120)
{
    need_cuda();
    const int64_t s[3] = {4, 3, 10}, row[1] = {10};
    tp_tensor *a[2] = {rnd(3, s, -2, 2, 1), rnd(3, s, -2, 2, 2)};
    check_op("add", op_add, NULL, 2, a, 3u, RTOL, ATOL);
    tp_tensor *ab[2] = {rnd(3, s, -2, 2, 1), rnd(1, row, -2, 2, 3)};
    check_op("add (row broadcast)", op_add, NULL, 2, ab, 3u, RTOL, ATOL);
    tp_tensor *m[2] = {rnd(3, s, -2, 2, 1), rnd(3, s, -2, 2, 2)};
    check_op("mul", op_mul, NULL, 2, m, 3u, RTOL, ATOL);
    tp_tensor *mb[2] = {rnd(3, s, -2, 2, 1), rnd(1, row, -2, 2, 3)};
    check_op("mul (row broadcast)", op_mul, NULL, 2, mb, 3u, RTOL, ATOL);
    tp_tensor *sc[1] = {rnd(3, s, -2, 2, 4)};
    check_op("scale", op_scale, NULL, 1, sc, 1u, RTOL, ATOL);
    tp_tensor *re[1] = {rnd(3, s, -2, 2, 5)};
    check_op("relu", op_relu, NULL, 1, re, 1u, RTOL, ATOL);
    tp_gelu_approx ex = TP_GELU_EXACT, th = TP_GELU_TANH;
    tp_tensor *ge[1] = {rnd(3, s, -4, 4, 6)};
    check_op("gelu (exact)", op_gelu, &ex, 1, ge, 1u, RTOL, ATOL);
    tp_tensor *gt[1] = {rnd(3, s, -4, 4, 7)};
    check_op("gelu (tanh)", op_gelu, &th, 1, gt, 1u, RTOL, ATOL);
    tp_tensor *si[1] = {rnd(3, s, -12, 12, 13)};
    check_op("silu", op_silu, NULL, 1, si, 1u, RTOL, ATOL);
    tp_tensor *sw[2] = {rnd(3, s, -12, 12, 14), rnd(3, s, -2, 2, 15)};
    check_op("swiglu", op_swiglu, NULL, 2, sw, 3u, RTOL, ATOL);
    tp_tensor *sg[2] = {rnd(3, s, -6, 6, 16), rnd(3, s, -2, 2, 17)};
    check_op("swiglu, d gate", op_swiglu, NULL, 2, sg, 1u, RTOL, ATOL);
    tp_tensor *su[2] = {rnd(3, s, -6, 6, 18), rnd(3, s, -2, 2, 19)};
    check_op("swiglu, d up", op_swiglu, NULL, 2, su, 2u, RTOL, ATOL);
    tp_tensor *rs[1] = {rnd(3, s, -2, 2, 8)};
    check_op("reshape", op_reshape, NULL, 1, rs, 1u, RTOL, ATOL);
    const int last2[2] = {1, 2}, outer[2] = {0, 2};
    tp_tensor *t1[1] = {rnd(3, s, -2, 2, 9)};
    check_op("transpose (last two dims)", op_transpose, last2, 1, t1, 1u, RTOL, ATOL);
    tp_tensor *t2[1] = {rnd(3, s, -2, 2, 10)};
    check_op("transpose (dims 0 and 2)", op_transpose, outer, 1, t2, 1u, RTOL, ATOL);
    const int perm[3] = {2, 0, 1};
    tp_tensor *t3[1] = {rnd(3, s, -2, 2, 11)};
    check_op("permute (2, 0, 1)", op_permute, perm, 1, t3, 1u, RTOL, ATOL);
    tp_tensor *t4[1] = {rnd(3, s, -2, 2, 12)};
    check_op("flatten, unflatten", op_flatten_unflatten, NULL, 1, t4, 1u, RTOL, ATOL);
}

/* add and mul with broadcasting: each layout class of the kernels (the flat
 * and row-broadcast fast paths, the general strided kernel) and of the
 * gradient's sum (one block of summed dims through sum_dim, several through
 * the general kernel, nothing summed, empty dims). */
Test(cuda, broadcasting, .timeout = 120)
{
    need_cuda();
    static const struct {
        const char *name;
        int na, nb;
        int64_t a[4], b[4];
    } cases[] = {
        {"[4,3,10] + [10] (row)", 3, 1, {4, 3, 10}, {10}},
        {"[10] + [4,3,10] (a smaller)", 1, 3, {10}, {4, 3, 10}},
        {"[4,3,10] + [3,10]", 3, 2, {4, 3, 10}, {3, 10}},
        {"[4,3,10] + [4,3,1] (column)", 3, 3, {4, 3, 10}, {4, 3, 1}},
        {"[4,1,10] + [1,3,1] (size-1 dims both sides)", 3, 3, {4, 1, 10}, {1, 3, 1}},
        {"[4,3,10] + [1,3,1] (two summed blocks)", 3, 3, {4, 3, 10}, {1, 3, 1}},
        {"[2,3,5,7] + [2,1,5,1]", 4, 4, {2, 3, 5, 7}, {2, 1, 5, 1}},
        {"[4,3,10] + scalar", 3, 0, {4, 3, 10}, {0}},
        {"scalar + scalar", 0, 0, {0}, {0}},
        {"[0,3] + [3] (empty output)", 2, 1, {0, 3}, {3}},
        {"[1,3] + [0,3] (a summed over an empty dim)", 2, 2, {1, 3}, {0, 3}},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++)
        for (int mul = 0; mul < 2; mul++) {
            tp_tensor *in[2] = {rnd(cases[k].na, cases[k].a, -2, 2, 10 + k),
                                rnd(cases[k].nb, cases[k].b, -2, 2, 40 + k)};
            char name[96];
            snprintf(name, sizeof name, "%s %s", mul ? "mul" : "add", cases[k].name);
            check_op(name, mul ? op_mul : op_add, NULL, 2, in, 3u, RTOL, ATOL);
        }
    /* non-contiguous views on the device: [3, 4] strides (8, 1) with a [4]
     * row of stride 6 */
    tp_tensor *ba = rnd(2, (int64_t[]){3, 8}, -2, 2, 90), *bb = rnd(2, (int64_t[]){4, 6}, -2, 2, 91);
    tp_tensor *da = to_dev(ba, DEV), *db = to_dev(bb, DEV);
    for (int mul = 0; mul < 2; mul++) {
        tp_tensor *va = NULL, *vb = NULL, *vda = NULL, *vdb = NULL, *yc = NULL, *yd = NULL,
                  *yh = NULL;
        CHECK_OK(tp_tensor_narrow(ba, 1, 2, 4, &va));
        CHECK_OK(tp_tensor_select(bb, 1, 2, &vb));
        CHECK_OK(tp_tensor_narrow(da, 1, 2, 4, &vda));
        CHECK_OK(tp_tensor_select(db, 1, 2, &vdb));
        CHECK_OK(mul ? tp_mul(va, vb, &yc) : tp_add(va, vb, &yc));
        CHECK_OK(mul ? tp_mul(vda, vdb, &yd) : tp_add(vda, vdb, &yd));
        cr_assert(on(yd, DEV));
        CHECK_OK(tp_tensor_to(yd, TP_F32, TP_CPU, &yh));
        expect_close(mul ? "mul of strided views" : "add of strided views", yh, yc, RTOL, ATOL);
        tp_tensor_release(va);
        tp_tensor_release(vb);
        tp_tensor_release(vda);
        tp_tensor_release(vdb);
        tp_tensor_release(yc);
        tp_tensor_release(yd);
        tp_tensor_release(yh);
    }
    tp_tensor_release(ba);
    tp_tensor_release(bb);
    tp_tensor_release(da);
    tp_tensor_release(db);
}

Test(cuda, dropout_mask_matches_cpu, .timeout = 120)
{
    need_cuda();
    /* the counter-based mask is the same function on both devices: equal
     * outputs, element for element */
    const int64_t s[2] = {37, 53};
    double p = 0.3, p0 = 0.0, p1 = 0.95;
    tp_tensor *x[1] = {rnd(2, s, 1, 2, 1)};
    check_op("dropout p=0.3", op_dropout, &p, 1, x, 1u, 0, 1e-6);
    tp_tensor *x0[1] = {rnd(2, s, 1, 2, 2)};
    check_op("dropout p=0", op_dropout, &p0, 1, x0, 1u, 0, 0);
    tp_tensor *x1[1] = {rnd(2, s, 1, 2, 3)};
    check_op("dropout p=0.95", op_dropout, &p1, 1, x1, 1u, 0, 1e-5);
}

Test(cuda, reductions_and_softmax, .timeout = 120)
{
    need_cuda();
    const int64_t s[3] = {5, 6, 7};
    const red_ctx cases[] = {
        {.dim = 0}, {.dim = 1, .keepdim = true}, {.dim = -1}, {.dim = 1, .mean = true},
        {.all = true}, {.all = true, .mean = true},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        char name[64];
        snprintf(name, sizeof name, "reduction case %zu", k);
        tp_tensor *x[1] = {rnd(3, s, -2, 2, 10 + k)};
        check_op(name, op_reduce, &cases[k], 1, x, 1u, RTOL, ATOL);
    }
    const int last = -1;
    tp_tensor *x1[1] = {rnd(3, s, -3, 3, 20)};
    check_op("softmax", op_softmax, &last, 1, x1, 1u, RTOL, ATOL);
}

Test(cuda, norms, .timeout = 120)
{
    need_cuda();
    const int64_t s[3] = {3, 4, 48}, c[1] = {48};
    tp_tensor *ln[3] = {rnd(3, s, -2, 3, 1), rnd(1, c, 0.5, 1.5, 2), rnd(1, c, -1, 1, 3)};
    check_op("layer_norm", op_layer_norm, NULL, 3, ln, 7u, 1e-4, 1e-4);
    tp_tensor *ln0[3] = {rnd(3, s, -2, 3, 4), NULL, NULL};
    check_op("layer_norm without affine", op_layer_norm, NULL, 3, ln0, 1u, 1e-4, 1e-4);
    tp_tensor *rms[2] = {rnd(3, s, -2, 3, 5), rnd(1, c, 0.5, 1.5, 6)};
    check_op("rms_norm", op_rms_norm, NULL, 2, rms, 3u, 1e-4, 1e-4);
    tp_tensor *rms0[2] = {rnd(3, s, -2, 3, 7), NULL};
    check_op("rms_norm without weight", op_rms_norm, NULL, 2, rms0, 1u, 1e-4, 1e-4);
}

Test(cuda, embedding, .timeout = 120)
{
    need_cuda();
    /* repeated indices: the backward's atomicAdd sums several rows into one */
    const int64_t is[2] = {6, 9}, ws[2] = {11, 16};
    tp_tensor *in[2] = {rnd_idx(2, is, 0, 11, 1), rnd(2, ws, -1, 1, 2)};
    check_op("embedding", op_embedding, NULL, 2, in, 2u, RTOL, ATOL);

    /* an index out of range is found on the host copy, before any kernel */
    tp_tensor *idx = rnd_idx(2, is, 0, 11, 1), *w = rnd(2, ws, -1, 1, 2), *y = NULL;
    const int64_t at[2] = {2, 3};
    CHECK_OK(tp_tensor_set(idx, at, 11));
    tp_tensor *di = to_dev(idx, DEV), *dw = to_dev(w, DEV);
    CHECK_ERR(tp_embedding(di, dw, &y), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "out of range"), "%s", tp_last_error());
    tp_tensor_release(di);
    tp_tensor_release(dw);
    tp_tensor_release(idx);
    tp_tensor_release(w);
}

Test(cuda, cross_entropy, .timeout = 120)
{
    need_cuda();
    const int64_t ls[2] = {13, 21}, ts[1] = {13}, cs[1] = {21};
    const tp_reduction reds[3] = {TP_REDUCTION_MEAN, TP_REDUCTION_SUM, TP_REDUCTION_NONE};
    for (int k = 0; k < 3; k++)
        for (int weighted = 0; weighted < 2; weighted++) {
            tp_cross_entropy_options o = {reds[k], NULL, 4};
            tp_tensor *in[3] = {rnd(2, ls, -3, 3, 1), rnd_idx(1, ts, 0, 21, 2),
                                weighted ? rnd(1, cs, 0.5, 2, 3) : NULL};
            /* ignore_index 4: rows whose target is 4 count for nothing */
            const int64_t r0 = 0;
            CHECK_OK(tp_tensor_set(in[1], &r0, 4));
            char name[64];
            snprintf(name, sizeof name, "cross_entropy (reduction %d, weighted %d)", k, weighted);
            check_op(name, op_ce, &o, 3, in, 1u, RTOL, ATOL);
        }
    /* N-D logits (N, C, d1[, d2]): the class dim strided; unbatched (C) with a
     * 0-d target; targets equal to ignore_index 4 at a few positions */
    const int64_t l3[3] = {5, 21, 7}, t3[2] = {5, 7}, l4[4] = {2, 21, 3, 4}, t4[3] = {2, 3, 4};
    const int64_t l1[1] = {21};
    struct {
        int nd;
        const int64_t *ls, *ts;
    } nds[3] = {{3, l3, t3}, {4, l4, t4}, {1, l1, NULL}};
    for (int s = 0; s < 3; s++)
        for (int k = 0; k < 3; k++)
            for (int weighted = 0; weighted < 2; weighted++) {
                tp_cross_entropy_options o = {reds[k], NULL, 4};
                tp_tensor *in[3] = {rnd(nds[s].nd, nds[s].ls, -3, 3, 10 + (uint64_t)s),
                                    rnd_idx(nds[s].nd - 1, nds[s].ts, 0, 21, 11),
                                    weighted ? rnd(1, cs, 0.5, 2, 3) : NULL};
                int64_t *tv = tp_tensor_data(in[1]);
                for (int64_t i = 0; s < 2 && i < tp_tensor_numel(in[1]); i += 5)
                    tv[i] = 4;
                char name[80];
                snprintf(name, sizeof name, "cross_entropy %d-d (reduction %d, weighted %d)",
                         nds[s].nd, k, weighted);
                check_op(name, op_ce, &o, 3, in, 1u, RTOL, ATOL);
            }
    /* a target outside [0, C) is refused from the host copy */
    tp_tensor *x = rnd(2, ls, -3, 3, 1), *t = rnd_idx(1, ts, 0, 21, 2), *loss = NULL;
    const int64_t r1 = 1;
    CHECK_OK(tp_tensor_set(t, &r1, 21));
    tp_tensor *dx = to_dev(x, DEV), *dt = to_dev(t, DEV);
    CHECK_ERR(tp_cross_entropy(dx, dt, NULL, &loss), TP_ERR_INVALID_ARG);
    tp_tensor_release(dx);
    tp_tensor_release(dt);
    tp_tensor_release(x);
    tp_tensor_release(t);
}

Test(cuda, attention, .timeout = 120)
{
    need_cuda();
    const int64_t s[4] = {2, 3, 7, 8};
    for (int causal = 0; causal < 2; causal++) {
        bool c = causal;
        tp_tensor *in[3] = {rnd(4, s, -1, 1, 1), rnd(4, s, -1, 1, 2), rnd(4, s, -1, 1, 3)};
        check_op(causal ? "attention (causal)" : "attention", op_sdpa, &c, 3, in, 7u, 1e-4, 1e-5);
    }
}

static tp_status op_sdpa_with(tp_tensor *const *in, const void *c, tp_tensor **y)
{
    tp_sdpa_options o = *(const tp_sdpa_options *)c;
    o.key_padding = in[3];
    return tp_scaled_dot_product_attention_with(in[0], in[1], in[2], &o, y);
}

/* 8 query heads over 2 kv heads, 4 queries after 5 cached keys (over 256
 * keys in a second case: more than a block's threads), Dv != D, left padding
 * in i64 and i32 that leaves batch 1's first queries no key */
Test(cuda, attention_grouped_offset_padding, .timeout = 120)
{
    need_cuda();
    const int64_t sks[2] = {9, 300};
    for (int c = 0; c < 2; c++)
        for (int i32 = 0; i32 < 2; i32++) {
            const int64_t sk = sks[c], off = sk - 4;
            const int64_t qs[4] = {2, 8, 4, 8}, ks[4] = {2, 2, sk, 8}, vs[4] = {2, 2, sk, 5},
                          ps[2] = {2, sk};
            tp_tensor *pad = NULL;
            CHECK_OK(tp_tensor_zeros(i32 ? TP_I32 : TP_I64, TP_CPU, 2, ps, &pad));
            for (int64_t j = 0; j < 2 * sk; j++) { /* batch 1: off + 2 keys of padding */
                int64_t v = j < sk || j - sk >= off + 2;
                if (i32)
                    ((int32_t *)tp_tensor_data(pad))[j] = (int32_t)v;
                else
                    ((int64_t *)tp_tensor_data(pad))[j] = v;
            }
            tp_tensor *in[4] = {rnd(4, qs, -1, 1, 4), rnd(4, ks, -1, 1, 5), rnd(4, vs, -1, 1, 6),
                                pad};
            tp_sdpa_options o = {.causal = true, .key_offset = off};
            check_op(i32 ? "attention grouped (i32 padding)" : "attention grouped", op_sdpa_with,
                     &o, 4, in, 7u, 1e-4, 1e-5);
        }
}

/* The fused attention on the GPU (FLASH: the tensor-core kernels for head
 * dims 64 and 128, the general ones otherwise) and the math form in the
 * same dtype, both against the CPU's f32 math attention on the same rounded
 * inputs, and AUTO's output equal to FLASH's: causal grouped heads over
 * several tiles, a decode row over a cache's prefix (strided k and v), key
 * padding leaving rows empty. Bound: 2% of each value plus 1% of the
 * largest (bf16 keeps 8 bits; P is rounded before P V). */
static void flash_case(tp_dtype dt, int64_t B, int64_t hq, int64_t hkv, int64_t sq, int64_t sk,
                       int64_t cap, int64_t D, int64_t off, bool padded, uint64_t seed)
{
    const int64_t qs[4] = {B, hq, sq, D}, ks[4] = {B, hkv, cap, D}, ps[2] = {B, sk};
    tp_tensor *h[4] = {rnd(4, qs, -1, 1, seed), rnd(4, ks, -1, 1, seed + 1),
                       rnd(4, ks, -1, 1, seed + 2), rnd(4, qs, -1, 1, seed + 3)};
    tp_tensor *pad = NULL, *dpad = NULL;
    if (padded) { /* batch b's first 37 b keys are padding */
        CHECK_OK(tp_tensor_zeros(TP_I64, TP_CPU, 2, ps, &pad));
        for (int64_t b = 0; b < B; b++)
            for (int64_t j = 0; j < sk; j++)
                ((int64_t *)tp_tensor_data(pad))[b * sk + j] = j >= 37 * b;
        dpad = to_dev(pad, DEV);
    }
    /* the dtype's values, as f32 on the CPU and as dt on the GPU */
    tp_tensor *c[4], *d[4];
    for (int i = 0; i < 4; i++) {
        tp_tensor *r = NULL;
        CHECK_OK(tp_tensor_to(h[i], dt, TP_CPU, &r));
        CHECK_OK(tp_tensor_to(r, TP_F32, TP_CPU, &c[i]));
        CHECK_OK(tp_tensor_to(r, dt, DEV, &d[i]));
        tp_tensor_release(r);
    }
    tp_tensor *want[4], *got[2][4];
    tp_sdpa_options o = {.causal = true, .key_offset = off, .key_padding = pad,
                         .backend = TP_SDPA_BACKEND_MATH};
    /* k and v: views of their first sk positions, a cache's prefix; the
     * views are the leaves whose gradients are compared */
    tp_tensor *cx[3] = {c[0], NULL, NULL};
    CHECK_OK(tp_tensor_narrow(c[1], 2, 0, sk, &cx[1]));
    CHECK_OK(tp_tensor_narrow(c[2], 2, 0, sk, &cx[2]));
    for (int i = 0; i < 3; i++)
        CHECK_OK(tp_tensor_set_requires_grad(cx[i], true));
    CHECK_OK(tp_scaled_dot_product_attention_with(cx[0], cx[1], cx[2], &o, &want[0]));
    CHECK_OK(tp_backward(want[0], c[3]));
    for (int i = 0; i < 3; i++)
        want[1 + i] = tp_tensor_retain(tp_tensor_grad(cx[i]));
    tp_tensor_release(cx[1]);
    tp_tensor_release(cx[2]);
    o.key_padding = dpad;
    for (int f = 0; f < 2; f++) {
        o.backend = f ? TP_SDPA_BACKEND_FLASH : TP_SDPA_BACKEND_MATH;
        tp_tensor *dx[3] = {d[0], NULL, NULL}, *y = NULL;
        CHECK_OK(tp_tensor_narrow(d[1], 2, 0, sk, &dx[1]));
        CHECK_OK(tp_tensor_narrow(d[2], 2, 0, sk, &dx[2]));
        tp_tensor_zero_grad(d[0]);
        for (int i = 0; i < 3; i++)
            CHECK_OK(tp_tensor_set_requires_grad(dx[i], true));
        CHECK_OK(tp_scaled_dot_product_attention_with(dx[0], dx[1], dx[2], &o, &y));
        CHECK_OK(tp_backward(y, d[3]));
        CHECK_OK(tp_tensor_to(y, TP_F32, TP_CPU, &got[f][0]));
        tp_tensor_release(y);
        for (int i = 0; i < 3; i++)
            CHECK_OK(tp_tensor_to(tp_tensor_grad(dx[i]), TP_F32, TP_CPU, &got[f][1 + i]));
        tp_tensor_release(dx[1]);
        tp_tensor_release(dx[2]);
    }
    { /* AUTO in bf16/f16 on CUDA is the fused form: the same output, bit for bit */
        o.backend = TP_SDPA_BACKEND_AUTO;
        tp_tensor *y = NULL, *yf = NULL, *dk = NULL, *dvv = NULL;
        CHECK_OK(tp_tensor_narrow(d[1], 2, 0, sk, &dk));
        CHECK_OK(tp_tensor_narrow(d[2], 2, 0, sk, &dvv));
        tp_no_grad_begin();
        tp_status st = tp_scaled_dot_product_attention_with(d[0], dk, dvv, &o, &y);
        tp_no_grad_end();
        CHECK_OK(st);
        CHECK_OK(tp_tensor_to(y, TP_F32, TP_CPU, &yf));
        bool eq = false;
        CHECK_OK(tp_tensor_equal(yf, got[1][0], &eq));
        cr_assert(eq, "%s D %lld: AUTO's output is not FLASH's", tp_dtype_name(dt), (long long)D);
        tp_tensor *drop[] = {y, yf, dk, dvv};
        for (size_t i = 0; i < 4; i++)
            tp_tensor_release(drop[i]);
    }
    const char *names[4] = {"out", "dq", "dk", "dv"};
    for (int i = 0; i < 4; i++) {
        const float *w = tp_tensor_data(want[i]);
        const int64_t n = tp_tensor_numel(want[i]);
        double amax = 0;
        for (int64_t e = 0; e < n; e++)
            amax = fmax(amax, fabs(w[e]));
        for (int f = 0; f < 2; f++) {
            cr_assert_eq(tp_tensor_numel(got[f][i]), n);
            const float *y = tp_tensor_data(got[f][i]);
            for (int64_t e = 0; e < n; e++)
                cr_assert(fabs(y[e] - w[e]) <= 0.02 * fabs(w[e]) + 0.01 * amax,
                          "%s D %lld Sq %lld Sk %lld, %s %s[%lld]: %g, CPU f32 %g",
                          tp_dtype_name(dt), (long long)D, (long long)sq, (long long)sk,
                          f ? "flash" : "math", names[i], (long long)e, y[e], w[e]);
            tp_tensor_release(got[f][i]);
        }
        tp_tensor_release(want[i]);
    }
    for (int i = 0; i < 4; i++) {
        tp_tensor_release(h[i]);
        tp_tensor_release(c[i]);
        tp_tensor_release(d[i]);
    }
    tp_tensor_release(pad);
    tp_tensor_release(dpad);
}

Test(cuda, attention_flash_low_precision, .timeout = 300)
{
    need_cuda();
    const tp_dtype dts[2] = {TP_BF16, TP_F16};
    for (int k = 0; k < 2; k++) {
        flash_case(dts[k], 2, 8, 2, 150, 150, 150, 128, 0, false, 10);  /* tiles, GQA */
        flash_case(dts[k], 2, 4, 4, 100, 100, 100, 64, 0, true, 20);    /* padding */
        flash_case(dts[k], 1, 8, 2, 1, 300, 512, 128, 299, false, 30);  /* decode, cache */
        flash_case(dts[k], 2, 4, 2, 33, 90, 128, 48, 57, true, 40);     /* general kernel */
    }
}

/* positions up to 100000: the same f32 angles, sincosf against the CPU's
 * double cos and sin */
Test(cuda, rotary_embedding, .timeout = 120)
{
    need_cuda();
    const int64_t xs[4] = {2, 3, 5, 64}, ps[2] = {2, 5};
    const tp_rope_config cfgs[2] = {{TP_ROPE_LLAMA3, 64, 500000, 8, 1, 4, 8192, 0},
                                    {TP_ROPE_DYNAMIC, 64, 10000, 2, 0, 0, 0, 4096}};
    for (int k = 0; k < 2; k++) {
        tp_tensor *in[2] = {rnd(4, xs, -1, 1, 1), rnd_idx(2, ps, 0, 100001, 2)};
        check_op(k ? "rotary_embedding (dynamic)" : "rotary_embedding (llama3)", op_rope, &cfgs[k],
                 2, in, 1u, RTOL, ATOL);
    }
    /* a negative position is found on the host copy, before any kernel */
    tp_tensor *p = rnd_idx(2, ps, 0, 10, 3), *dp = NULL, *co = NULL, *si = NULL;
    CHECK_OK(tp_tensor_set(p, (int64_t[]){1, 4}, -2));
    dp = to_dev(p, DEV);
    CHECK_ERR(tp_rope_cos_sin(&cfgs[0], dp, TP_F32, &co, &si), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "position_ids[1, 4] = -2 is negative"), "%s",
              tp_last_error());
    tp_tensor_release(dp);
    tp_tensor_release(p);
}

Test(cuda, large_sizes_use_grid_stride_loops, .timeout = 300)
{
    need_cuda();
    /* more elements than one capped grid covers (65535 blocks x 256), and
     * more rows than the row kernels' grid */
    const int64_t big[1] = {(int64_t)20 << 20};
    tp_tensor *a[2] = {rnd(1, big, -1, 1, 1), rnd(1, big, -1, 1, 2)};
    check_op("add, 20M elements", op_add, NULL, 2, a, 3u, RTOL, ATOL);
    const int64_t rows[2] = {70000, 5};
    const int last = -1;
    tp_tensor *x[1] = {rnd(2, rows, -3, 3, 3)};
    check_op("softmax, 70000 rows", op_softmax, &last, 1, x, 1u, RTOL, ATOL);
    const red_ctx all = {.all = true};
    tp_tensor *s[1] = {rnd(1, big, 0, 1, 4)};
    check_op("sum_all, 20M elements", op_reduce, &all, 1, s, 1u, 1e-5, 1e-3);
}

/* ---- cuBLAS dtypes and TF32 -------------------------------------------------------- */

Test(cuda, tf32_setting, .timeout = 30)
{
    /* the setting itself needs no GPU */
    cr_assert(!tp_cuda_allow_tf32(), "TF32 must be off by default");
    CHECK_OK(tp_cuda_set_allow_tf32(true));
    cr_assert(tp_cuda_allow_tf32());
    CHECK_OK(tp_cuda_set_allow_tf32(false));
    cr_assert(!tp_cuda_allow_tf32());
}

Test(cuda, synchronize, .timeout = 30)
{
    if (tp_cuda_device_count() == 0) {
        CHECK_ERR(tp_cuda_synchronize(0), TP_ERR_NOT_SUPPORTED);
        return;
    }
    CHECK_OK(tp_cuda_synchronize(0));
    CHECK_ERR(tp_cuda_synchronize(tp_cuda_device_count()), TP_ERR_INVALID_ARG);
}

Test(cuda, tf32_products_stay_close, .timeout = 60)
{
    need_cuda();
    const int64_t xs[2] = {64, 128}, ws[2] = {32, 128};
    CHECK_OK(tp_cuda_set_allow_tf32(true));
    /* TF32 rounds the inputs to 10 mantissa bits: each product is off by
     * up to ~1e-3 relative, and 128 of them add up to a few 1e-3 absolute */
    tp_tensor *in[3] = {rnd(2, xs, -1, 1, 1), rnd(2, ws, -1, 1, 2), NULL};
    check_op("linear with TF32", op_linear, NULL, 3, in, 3u, 1e-2, 2e-2);
    CHECK_OK(tp_cuda_set_allow_tf32(false));
}

/* linear in dtype on the GPU against the CPU f32 result of the same
 * (rounded) values; forward and gradients come back in dtype */
static void check_half_linear(tp_dtype dt, double rtol, double atol)
{
    const int64_t xs[2] = {17, 64}, ws[2] = {24, 64}, bs[1] = {24};
    tp_tensor *x = rnd(2, xs, -1, 1, 1), *w = rnd(2, ws, -1, 1, 2), *b = rnd(1, bs, -1, 1, 3);
    tp_tensor *cpu[3] = {x, w, b}, *half[3], *ref[3], *dev[3];
    for (int i = 0; i < 3; i++) {
        CHECK_OK(tp_tensor_to(cpu[i], dt, TP_CPU, &half[i]));      /* rounded */
        CHECK_OK(tp_tensor_to(half[i], TP_F32, TP_CPU, &ref[i]));  /* the same values in f32 */
        CHECK_OK(tp_tensor_to(half[i], dt, DEV, &dev[i]));
        CHECK_OK(tp_tensor_set_requires_grad(ref[i], true));
        CHECK_OK(tp_tensor_set_requires_grad(dev[i], true));
    }
    tp_tensor *yr = NULL, *yd = NULL, *gr = NULL, *gd = NULL;
    CHECK_OK(tp_linear(ref[0], ref[1], ref[2], &yr));
    CHECK_OK(tp_linear(dev[0], dev[1], dev[2], &yd));
    cr_assert_eq(tp_tensor_dtype(yd), dt, "the output keeps the input dtype");
    cr_assert(on(yd, DEV));
    expect_close(tp_dtype_name(dt), yd, yr, rtol, atol);
    /* the output gradient: ones (the reductions take f32 only) */
    CHECK_OK(tp_tensor_empty(TP_F32, TP_CPU, 2, tp_tensor_shape(yr), &gr));
    CHECK_OK(tp_tensor_fill(gr, 1.0));
    CHECK_OK(tp_tensor_to(gr, dt, DEV, &gd));
    CHECK_OK(tp_backward(yr, gr));
    CHECK_OK(tp_backward(yd, gd));
    for (int i = 0; i < 3; i++) {
        tp_tensor *g = tp_tensor_grad(dev[i]);
        cr_assert(g && tp_tensor_dtype(g) == dt, "gradient %d in %s", i, tp_dtype_name(dt));
        /* the bias gradient sums 17 ones: exact; the others sum 24 or 17 terms */
        expect_close("gradient", g, tp_tensor_grad(ref[i]), rtol, atol * 4);
    }
    tp_tensor_release(yr);
    tp_tensor_release(yd);
    tp_tensor_release(gr);
    tp_tensor_release(gd);
    for (int i = 0; i < 3; i++) {
        tp_tensor_release(cpu[i]);
        tp_tensor_release(half[i]);
        tp_tensor_release(ref[i]);
        tp_tensor_release(dev[i]);
    }
}

Test(cuda, cublas_f16, .timeout = 60)
{
    need_cuda();
    /* f16 output rounding: 2^-11 relative; products accumulate in f32 */
    check_half_linear(TP_F16, 2e-3, 2e-3);
}

Test(cuda, cublas_bf16, .timeout = 60)
{
    need_cuda();
    /* bf16 output rounding: 2^-8 relative */
    check_half_linear(TP_BF16, 1e-2, 1e-2);
}

/* Every op takes f16/bf16 on the CPU too (the dtype contract;
 * tests/test_ops_dtype.c checks the values); f64 stays refused. */
Test(cuda, half_inputs_run_on_the_cpu_and_f64_is_refused, .timeout = 30)
{
    const int64_t s[2] = {2, 4};
    tp_tensor *x = NULL, *y = NULL, *d = NULL;
    CHECK_OK(tp_tensor_zeros(TP_F16, TP_CPU, 2, s, &x));
    CHECK_OK(tp_linear(x, x, NULL, &y));
    cr_assert_eq(tp_tensor_dtype(y), TP_F16);
    tp_tensor_release(y);
    CHECK_OK(tp_relu(x, &y));
    cr_assert_eq(tp_tensor_dtype(y), TP_F16);
    tp_tensor_release(y);
    CHECK_OK(tp_tensor_zeros(TP_F64, TP_CPU, 2, s, &d));
    CHECK_ERR(tp_linear(d, d, NULL, &y), TP_ERR_NOT_SUPPORTED);
    CHECK_ERR(tp_relu(d, &y), TP_ERR_NOT_SUPPORTED);
    tp_tensor_release(d);
    tp_tensor_release(x);
}

/* ---- devices --------------------------------------------------------------------------- */

Test(cuda, mismatched_devices_are_an_error, .timeout = 30)
{
    need_cuda();
    const int64_t s[2] = {3, 4}, is[1] = {3};
    tp_tensor *a = rnd(2, s, -1, 1, 1), *b = rnd(2, s, -1, 1, 2), *bd = to_dev(b, DEV),
              *y = NULL;
    CHECK_ERR(tp_add(a, bd, &y), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "cpu") && strstr(tp_last_error(), "cuda:0"),
              "the message names both devices: %s", tp_last_error());
    CHECK_ERR(tp_linear(bd, a, NULL, &y), TP_ERR_INVALID_ARG);
    tp_tensor *idx = rnd_idx(1, is, 0, 3, 3);
    CHECK_ERR(tp_embedding(idx, bd, &y), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_cross_entropy(bd, idx, NULL, &y), TP_ERR_INVALID_ARG);
    cr_assert(y == NULL);
    tp_tensor_release(idx);
    tp_tensor_release(a);
    tp_tensor_release(b);
    tp_tensor_release(bd);
}

Test(cuda, fill_copy_compare_on_device, .timeout = 30)
{
    need_cuda();
    const int64_t s[2] = {5, 6};
    tp_tensor *d = NULL, *h = NULL, *r = NULL;
    CHECK_OK(tp_tensor_empty(TP_F32, DEV, 2, s, &d));
    CHECK_OK(tp_tensor_fill(d, 2.5));
    CHECK_OK(tp_tensor_empty(TP_F32, TP_CPU, 2, s, &h));
    CHECK_OK(tp_tensor_fill(h, 2.5));
    bool eq = false;
    CHECK_OK(tp_tensor_equal(d, h, &eq));
    cr_assert(eq, "fill on the device");
    /* the random fill draws the same values on both devices */
    CHECK_OK(tp_tensor_fill_random(d, TP_RNG_NORMAL, 0, 1, 9, NULL, NULL));
    CHECK_OK(tp_tensor_fill_random(h, TP_RNG_NORMAL, 0, 1, 9, NULL, NULL));
    CHECK_OK(tp_tensor_equal(d, h, &eq));
    cr_assert(eq, "fill_random on the device");
    CHECK_OK(tp_tensor_clone(d, &r));
    cr_assert(on(r, DEV));
    CHECK_OK(tp_tensor_equal(r, h, &eq));
    cr_assert(eq, "clone on the device");
    tp_tensor_release(d);
    tp_tensor_release(h);
    tp_tensor_release(r);
}

Test(cuda, strided_copies_on_device, .timeout = 30)
{
    need_cuda();
    /* shard-like chunks of the last dim, in 2-, 4- and 8-byte dtypes: the
     * clone of a strided device view, and a copy into one */
    const tp_dtype dts[3] = {TP_F16, TP_F32, TP_I64};
    const int64_t s[3] = {3, 4, 10};
    for (int k = 0; k < 3; k++) {
        tp_tensor *h = NULL, *d = NULL, *hv = NULL, *dv = NULL, *dc = NULL, *hz = NULL,
                  *dz = NULL, *dzv = NULL, *hzv = NULL;
        CHECK_OK(tp_tensor_empty(dts[k], TP_CPU, 3, s, &h));
        CHECK_OK(tp_tensor_fill_random(h, TP_RNG_RANDINT, -50, 50, 3, NULL, NULL));
        d = to_dev(h, DEV);
        CHECK_OK(tp_tensor_chunk(h, 3, 2, 1, &hv));
        CHECK_OK(tp_tensor_chunk(d, 3, 2, 1, &dv));
        CHECK_OK(tp_tensor_clone(dv, &dc));
        cr_assert(on(dc, DEV));
        bool eq = false;
        CHECK_OK(tp_tensor_equal(dc, hv, &eq));
        cr_assert(eq, "clone of a strided %s view on the device", tp_dtype_name(dts[k]));
        /* into a strided destination: only the view's elements change */
        CHECK_OK(tp_tensor_zeros(dts[k], TP_CPU, 3, s, &hz));
        dz = to_dev(hz, DEV);
        CHECK_OK(tp_tensor_chunk(dz, 3, 2, 1, &dzv));
        CHECK_OK(tp_tensor_chunk(hz, 3, 2, 1, &hzv));
        CHECK_OK(tp_tensor_copy(dzv, dv));
        CHECK_OK(tp_tensor_copy(hzv, hv));
        CHECK_OK(tp_tensor_equal(dz, hz, &eq));
        cr_assert(eq, "copy into a strided %s view on the device", tp_dtype_name(dts[k]));
        tp_tensor *all[] = {h, d, hv, dv, dc, hz, dz, dzv, hzv};
        for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
            tp_tensor_release(all[i]);
    }
}

/* DTensors over CUDA locals on a one-rank mesh (no collective runs): the
 * layout machinery keeps the device, and a rank thread gets its own stream
 * and cuBLAS handle, released when the thread exits. */
typedef struct {
    tp_tensor *x, *w, *want; /* x, w on the device; want = x w^T on the CPU */
    tp_test_slot slot[1];
} dt_ctx;

static tp_status dt_rank(tp_comm *world, void *arg)
{
    dt_ctx *c = arg;
    tp_test_slot *s = &c->slot[0];
    const int64_t one = 1;
    const tp_device dev = DEV;
    tp_mesh *mesh = NULL;
    tp_tensor *x = NULL, *w = NULL, *y = NULL, *full = NULL, *loss = NULL;
    RANK_OK(s, tp_mesh_create(world, 1, &one, NULL, &mesh));
    const tp_placement rep = tp_replicate(), sh0 = tp_shard(0);
    tp_status st = tp_dtensor_from_local(mesh, c->x, 1, &rep, NULL, &x);
    if (st == TP_OK)
        st = tp_dtensor_from_local(mesh, c->w, 1, &sh0, NULL, &w);
    if (st == TP_OK)
        st = tp_tensor_set_requires_grad(w, true);
    if (st == TP_OK)
        st = tp_linear(x, w, NULL, &y);
    if (st == TP_OK) {
        RANK_EXPECT(s, on(x, dev) && on(y, dev) && on(tp_dtensor_local(y), dev),
                    "a DTensor over a CUDA shard is not on the device");
        st = tp_dtensor_full_tensor(y, &full);
    }
    bool close = false;
    if (st == TP_OK)
        st = tp_tensor_allclose(full, c->want, RTOL, ATOL, &close);
    if (st == TP_OK) {
        RANK_EXPECT(s, close, "linear on DTensors over CUDA shards differs from the CPU");
        st = tp_sum_all(y, &loss);
    }
    if (st == TP_OK)
        st = tp_backward(loss, NULL);
    if (st == TP_OK) {
        tp_tensor *g = tp_tensor_grad(w);
        RANK_EXPECT(s, g && tp_tensor_is_dtensor(g) && on(tp_dtensor_local(g), dev),
                    "the weight's gradient is not a DTensor on the device");
    }
    RANK_EXPECT(s, st == TP_OK, "%s (%s)", tp_status_name(st), tp_last_error());
    tp_tensor_release(loss);
    tp_tensor_release(full);
    tp_tensor_release(y);
    tp_tensor_release(w);
    tp_tensor_release(x);
    tp_mesh_free(mesh);
    return st;
}

Test(cuda, dtensor_on_device, .timeout = 60)
{
    need_cuda();
    const int64_t xs[2] = {6, 10}, ws[2] = {4, 10};
    tp_tensor *x = rnd(2, xs, -1, 1, 1), *w = rnd(2, ws, -1, 1, 2);
    dt_ctx c = {.x = to_dev(x, DEV), .w = to_dev(w, DEV)};
    CHECK_OK(tp_linear(x, w, NULL, &c.want));
    tp_test_run(1, dt_rank, &c, c.slot);
    tp_tensor_release(c.x);
    tp_tensor_release(c.w);
    tp_tensor_release(c.want);
    tp_tensor_release(x);
    tp_tensor_release(w);
}

/* ---- modules and optimizers ----------------------------------------------------------- */

static tp_module *mlp(void)
{
    tp_module *seq = NULL, *l1 = NULL, *act = NULL, *l2 = NULL, *ln = NULL;
    CHECK_OK(tp_nn_sequential_create(&seq));
    CHECK_OK(tp_nn_linear_create(12, 16, true, &l1));
    CHECK_OK(tp_nn_gelu_create(TP_GELU_TANH, &act));
    CHECK_OK(tp_nn_layer_norm_create(16, true, 1e-5, &ln));
    CHECK_OK(tp_nn_linear_create(16, 5, true, &l2));
    CHECK_OK(tp_module_add_child(seq, "0", l1));
    CHECK_OK(tp_module_add_child(seq, "1", act));
    CHECK_OK(tp_module_add_child(seq, "2", ln));
    CHECK_OK(tp_module_add_child(seq, "3", l2));
    CHECK_OK(tp_module_init(seq, 42));
    return seq;
}

static tp_status all_on(const char *fqn, tp_tensor *p, void *ctx)
{
    (void)fqn;
    const tp_device *d = ctx;
    return on(p, *d) && tp_tensor_requires_grad(p) ? TP_OK : TP_ERR_STATE;
}

typedef struct {
    tp_module *other;
    double rtol, atol;
} cmp_ctx;

/* compares every parameter with the same one of another module */
static tp_status same_params(const char *fqn, tp_tensor *p, void *vctx)
{
    cmp_ctx *c = vctx;
    tp_module *owner = c->other;
    char buf[64];
    snprintf(buf, sizeof buf, "%s", fqn);
    char *dot = strrchr(buf, '.');
    *dot = '\0';
    tp_tensor *q = tp_module_parameter(tp_module_find(owner, buf), dot + 1);
    bool close = false;
    tp_status st = tp_tensor_allclose(p, q, c->rtol, c->atol, &close);
    return st != TP_OK ? st : close ? TP_OK : TP_ERR_MISMATCH;
}

static void train_step(tp_module *m, tp_device dev, tp_adam *adam)
{
    const int64_t xs[2] = {7, 12}, ts[1] = {7};
    tp_tensor *x = rnd(2, xs, -1, 1, 5), *t = rnd_idx(1, ts, 0, 5, 6);
    tp_tensor *xd = to_dev(x, dev), *td = to_dev(t, dev), *y = NULL, *loss = NULL;
    CHECK_OK(tp_module_call(m, xd, &y));
    cr_assert(on(y, dev));
    CHECK_OK(tp_cross_entropy(y, td, NULL, &loss));
    CHECK_OK(tp_backward(loss, NULL));
    if (adam)
        CHECK_OK(tp_adam_step(adam));
    else
        CHECK_OK(tp_sgd_step(m, 0.1));
    tp_module_zero_grad(m);
    tp_tensor_release(x);
    tp_tensor_release(t);
    tp_tensor_release(xd);
    tp_tensor_release(td);
    tp_tensor_release(y);
    tp_tensor_release(loss);
}

Test(cuda, module_to_and_back, .timeout = 60)
{
    need_cuda();
    tp_module *m = mlp(), *ref = mlp();
    tp_device dev = DEV, cpu = TP_CPU;
    CHECK_OK(tp_module_to(m, DEV));
    CHECK_OK(tp_module_named_parameters(m, all_on, &dev));
    cmp_ctx exact = {ref, 0, 0};
    CHECK_OK(tp_module_named_parameters(m, same_params, &exact));
    /* initialising on the device gives the CPU values */
    CHECK_OK(tp_module_init(m, 42));
    CHECK_OK(tp_module_named_parameters(m, same_params, &exact));
    CHECK_OK(tp_module_to(m, TP_CPU));
    CHECK_OK(tp_module_named_parameters(m, all_on, &cpu));
    tp_module_free(m);
    tp_module_free(ref);
}

Test(cuda, sgd_and_adam_steps_on_device, .timeout = 120)
{
    need_cuda();
    for (int use_adam = 0; use_adam < 2; use_adam++) {
        tp_module *m = mlp(), *ref = mlp();
        CHECK_OK(tp_module_to(m, DEV));
        tp_adam *am = NULL, *ar = NULL;
        if (use_adam) {
            /* eps 1e-3, not 1e-8: Adam's first steps move each parameter by
             * about lr * sign(grad), which float rounding could flip for a
             * gradient near 0; a larger eps keeps the update continuous */
            CHECK_OK(tp_adam_create(m, 1e-2, 0, 0, 1e-3, &am));
            CHECK_OK(tp_adam_create(ref, 1e-2, 0, 0, 1e-3, &ar));
        }
        for (int step = 0; step < 3; step++) {
            train_step(m, DEV, am);
            train_step(ref, TP_CPU, ar);
        }
        cmp_ctx c = {ref, 1e-4, 1e-5};
        tp_status st = tp_module_named_parameters(m, same_params, &c);
        cr_assert_eq(st, TP_OK, "%s: parameters after 3 steps differ from the CPU's",
                     use_adam ? "Adam" : "SGD");
        tp_adam_free(am);
        tp_adam_free(ar);
        tp_module_free(m);
        tp_module_free(ref);
    }
}

/* Moving keeps ties: a tensor under two names is copied once and both names
 * get the copy; two handles over one storage region stay over one (new)
 * storage; moving back keeps them too. */
Test(cuda, module_to_keeps_tied_weights, .timeout = 60)
{
    need_cuda();
    for (int view = 0; view <= 1; view++) {
        tp_module *root = NULL, *a = NULL, *b = NULL;
        CHECK_OK(tp_nn_container_create(&root));
        CHECK_OK(tp_nn_linear_create(4, 4, false, &a));
        CHECK_OK(tp_nn_linear_create(4, 4, false, &b));
        CHECK_OK(tp_module_add_child(root, "a", a));
        CHECK_OK(tp_module_add_child(root, "b", b));
        CHECK_OK(tp_module_init(root, 3));
        tp_tensor *w = tp_module_parameter(a, "weight"), *v = NULL;
        if (view)
            CHECK_OK(tp_tensor_view(w, 2, (int64_t[]){4, 4}, &v));
        CHECK_OK(tp_module_set_parameter(b, "weight", v ? v : w));
        tp_tensor_release(v);
        tp_tensor *before = NULL;
        CHECK_OK(tp_tensor_clone(w, &before));
        tp_device devs[2] = {DEV, TP_CPU};
        for (int k = 0; k < 2; k++) {
            CHECK_OK(tp_module_to(root, devs[k]));
            tp_tensor *wa = tp_module_parameter(a, "weight"), *wb = tp_module_parameter(b, "weight");
            cr_assert(on(wa, devs[k]) && on(wb, devs[k]));
            if (view)
                cr_assert(wa != wb && tp_tensor_shares_storage(wa, wb) &&
                              tp_tensor_data(wa) == tp_tensor_data(wb),
                          "to %s: the two handles no longer share one storage",
                          k ? "the CPU" : "the device");
            else
                cr_assert_eq(wa, wb, "to %s: the tied weight became two tensors",
                             k ? "the CPU" : "the device");
            cr_assert(tp_tensor_requires_grad(wa) && tp_tensor_requires_grad(wb));
        }
        bool same = false;
        CHECK_OK(tp_tensor_equal(tp_module_parameter(b, "weight"), before, &same));
        cr_assert(same, "the values changed on the way");
        tp_tensor_release(before);
        tp_module_free(root);
    }
}

Test(cuda, module_to_without_a_device, .timeout = 30)
{
    /* runs where the GPU tests skip: the refusal is the behaviour there */
    if (tp_cuda_device_count() > 0)
        cr_skip_test("a CUDA device is present: the refusal cannot be observed");
    tp_module *m = mlp();
    CHECK_ERR(tp_module_to(m, DEV), TP_ERR_NOT_SUPPORTED);
    tp_device cpu = TP_CPU;
    CHECK_OK(tp_module_named_parameters(m, all_on, &cpu));
    CHECK_OK(tp_module_to(m, TP_CPU)); /* already there: nothing to do */
    tp_module_free(m);
}

/* ---- the caching allocator (core/cuda_rt.c) ------------------------------------------- */

#define MiB ((size_t)1 << 20)

static tp_memory_info mstats(void)
{
    tp_memory_info s;
    CHECK_OK(tp_memory_stats(DEV, &s));
    return s;
}

/* A CUDA f32 tensor of `bytes` bytes. */
static tp_tensor *dev_bytes(size_t bytes)
{
    int64_t n = (int64_t)(bytes / 4);
    tp_tensor *t = NULL;
    CHECK_OK(tp_tensor_empty(TP_F32, DEV, 1, &n, &t));
    return t;
}

/* A freed block stays reserved and serves the next allocation: a cache hit,
 * and reserved memory does not grow. */
Test(cuda, memory_reuse_counts_a_cache_hit, .timeout = 60)
{
    need_cuda();
    CHECK_OK(tp_memory_set_cache_limit(DEV, SIZE_MAX));
    CHECK_OK(tp_memory_empty_cache(DEV));
    tp_memory_info s0 = mstats();
    cr_assert_eq(s0.cache_limit, SIZE_MAX);
    tp_tensor *a = dev_bytes(16 * MiB);
    tp_memory_info s1 = mstats();
    cr_assert_eq(s1.num_allocs, s0.num_allocs + 1);
    cr_assert_eq(s1.num_cache_hits, s0.num_cache_hits, "an emptied pool must grow for 16 MiB");
    cr_assert_eq(s1.allocated, s0.allocated + 16 * MiB);
    cr_assert_geq(s1.reserved, s0.reserved + 16 * MiB);
    tp_tensor_release(a);
    CHECK_OK(tp_cuda_synchronize(0));
    tp_memory_info s2 = mstats();
    cr_assert_eq(s2.allocated, s0.allocated);
    cr_assert_eq(s2.reserved, s1.reserved, "the freed block stays reserved");
    a = dev_bytes(16 * MiB);
    tp_memory_info s3 = mstats();
    cr_assert_eq(s3.num_allocs, s0.num_allocs + 2);
    cr_assert_eq(s3.num_cache_hits, s0.num_cache_hits + 1, "the second block came from the cache");
    cr_assert_eq(s3.reserved, s1.reserved);
    tp_tensor_release(a);
}

Test(cuda, memory_peak_and_reset, .timeout = 60)
{
    need_cuda();
    tp_memory_info s0 = mstats();
    tp_tensor *a = dev_bytes(8 * MiB), *b = dev_bytes(8 * MiB);
    tp_memory_info s1 = mstats();
    cr_assert_eq(s1.allocated, s0.allocated + 16 * MiB);
    cr_assert_geq(s1.peak_allocated, s1.allocated);
    tp_tensor_release(b);
    tp_memory_info s2 = mstats();
    cr_assert_eq(s2.allocated, s0.allocated + 8 * MiB);
    cr_assert_eq(s2.peak_allocated, s1.peak_allocated, "the peak stays after a release");
    CHECK_OK(tp_memory_reset_peak(DEV));
    cr_assert_eq(mstats().peak_allocated, s0.allocated + 8 * MiB);
    tp_tensor_release(a);
    cr_assert_eq(mstats().allocated, s0.allocated);
}

Test(cuda, memory_empty_cache_lowers_reserved, .timeout = 60)
{
    need_cuda();
    CHECK_OK(tp_memory_set_cache_limit(DEV, SIZE_MAX));
    CHECK_OK(tp_memory_empty_cache(DEV));
    size_t r0 = mstats().reserved;
    tp_tensor_release(dev_bytes(32 * MiB));
    CHECK_OK(tp_cuda_synchronize(0));
    size_t r1 = mstats().reserved;
    cr_assert_geq(r1, r0 + 32 * MiB, "kept through a synchronization without a limit");
    CHECK_OK(tp_memory_empty_cache(DEV));
    cr_assert_leq(mstats().reserved, r0, "empty_cache returns the idle 32 MiB");
}

/* The limit is the pool's release threshold: idle memory beyond it goes at
 * the next synchronization, or at once when the limit is set. */
Test(cuda, memory_cache_limit_is_honoured, .timeout = 60)
{
    need_cuda();
    CHECK_OK(tp_memory_empty_cache(DEV));
    size_t r0 = mstats().reserved;
    CHECK_OK(tp_memory_set_cache_limit(DEV, 0));
    cr_assert_eq(mstats().cache_limit, 0);
    tp_tensor_release(dev_bytes(32 * MiB));
    CHECK_OK(tp_cuda_synchronize(0));
    cr_assert_leq(mstats().reserved, r0, "limit 0: the freed block goes at the synchronization");
    CHECK_OK(tp_memory_set_cache_limit(DEV, r0 + 64 * MiB));
    tp_tensor_release(dev_bytes(32 * MiB));
    CHECK_OK(tp_cuda_synchronize(0));
    cr_assert_geq(mstats().reserved, r0 + 32 * MiB, "under the limit: kept");
    CHECK_OK(tp_memory_set_cache_limit(DEV, r0));
    cr_assert_leq(mstats().reserved, r0, "lowering the limit trims at once");
    CHECK_OK(tp_memory_set_cache_limit(DEV, SIZE_MAX));
}

Test(cuda, memory_arguments, .timeout = 30)
{
    need_cuda();
    tp_memory_info s;
    int count = tp_cuda_device_count();
    CHECK_ERR(tp_memory_stats(TP_CUDA(count), &s), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_memory_reset_peak(TP_CUDA(-1)), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_memory_empty_cache(TP_CUDA(count)), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_memory_set_cache_limit(TP_CUDA(count), 0), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_memory_stats(DEV, NULL), TP_ERR_INVALID_ARG);
}

/* The allocation-failure hook fails CUDA allocations too (the block's host
 * record): each failing run reports TP_ERR_NO_MEMORY, hands back no tensor
 * and leaves neither host memory nor device memory behind. */
static struct {
    long live, count, fail_at;
} FA;

static void *fa_alloc(void *ctx, size_t size, size_t alignment)
{
    (void)ctx;
    if (FA.count++ == FA.fail_at)
        return NULL;
    if (alignment < sizeof(void *))
        alignment = sizeof(void *);
    size_t rounded = (size + alignment - 1) / alignment * alignment;
    void *p = aligned_alloc(alignment, rounded ? rounded : alignment);
    FA.live += p != NULL;
    return p;
}

static void fa_free(void *ctx, void *p)
{
    (void)ctx;
    FA.live--;
    free(p);
}

Test(cuda, memory_allocation_failures_leak_nothing, .timeout = 60)
{
    need_cuda();
    const int64_t s[2] = {64, 64};
    tp_tensor *t = NULL;
    /* the thread's stream table and the pool exist before counting */
    CHECK_OK(tp_tensor_zeros(TP_F32, DEV, 2, s, &t));
    tp_tensor_release(t);
    size_t allocated0 = mstats().allocated;
    FA.live = 0;
    FA.fail_at = -1;
    tp_allocator a = {fa_alloc, fa_free, NULL};
    CHECK_OK(tp_set_allocator(&a));
    long failures = 0, leaks = 0, wrong = 0, device_leaks = 0, record = 0;
    tp_status st = TP_ERR_NO_MEMORY;
    for (long k = 0; k < 64 && st != TP_OK; k++) {
        FA.count = 0;
        FA.fail_at = k;
        t = NULL;
        st = tp_tensor_zeros(TP_F32, DEV, 2, s, &t);
        if (st == TP_OK)
            break;
        failures++;
        wrong += st != TP_ERR_NO_MEMORY || t != NULL;
        record += strstr(tp_last_error(), "CUDA block record") != NULL;
        leaks += FA.live != 0;
        tp_memory_info m;
        if (tp_memory_stats(DEV, &m) != TP_OK || m.allocated != allocated0)
            device_leaks++;
    }
    tp_tensor_release(t);
    long live_after = FA.live;
    CHECK_OK(tp_set_allocator(NULL));
    cr_assert_eq(st, TP_OK, "the allocation never succeeded");
    cr_assert_geq(failures, 3, "the tensor, its storage and the block record each failed");
    cr_assert_eq(wrong, 0, "a failure that is not TP_ERR_NO_MEMORY or left a tensor");
    cr_assert_eq(record, 1, "the block record's failure is reported once");
    cr_assert_eq(leaks, 0, "host memory leaked by a failed allocation");
    cr_assert_eq(device_leaks, 0, "device memory counted after a failed allocation");
    cr_assert_eq(live_after, 0, "host memory left after the release");
    cr_assert_eq(mstats().allocated, allocated0);
}

/* Two rank-like threads allocate, fill, read and free concurrently on their
 * own streams; each leaves one tensor that the main thread frees after the
 * thread (and its stream) is gone. */
typedef struct mt_slot {
    int id;
    long bad;
    tp_status st;
    tp_tensor *left;
} mt_slot;

static void *mt_worker(void *arg)
{
    mt_slot *s = arg;
    tp_tensor *ring[4] = {0};
    for (int i = 0; i < 200 && s->st == TP_OK; i++) {
        int64_t n = (int64_t)(1 + (i * 7 + s->id * 13) % 64) * 1024;
        tp_tensor *t = NULL;
        double v = s->id * 1000 + i, got = 0;
        int64_t last = n - 1, first = 0;
        if ((s->st = tp_tensor_empty(TP_F32, DEV, 1, &n, &t)) != TP_OK)
            break;
        if ((s->st = tp_tensor_fill(t, v)) == TP_OK &&
            (s->st = tp_tensor_get(t, &first, &got)) == TP_OK)
            s->bad += got != v;
        if (s->st == TP_OK && (s->st = tp_tensor_get(t, &last, &got)) == TP_OK)
            s->bad += got != v;
        tp_tensor_release(ring[i % 4]);
        ring[i % 4] = t;
    }
    for (int k = 1; k < 4; k++)
        tp_tensor_release(ring[k]);
    s->left = ring[0]; /* the last fill on it is complete: tp_tensor_get waited */
    return NULL;
}

Test(cuda, memory_two_threads_on_their_own_streams, .timeout = 120)
{
    need_cuda();
    size_t allocated0 = mstats().allocated;
    mt_slot slots[2] = {{0, 0, TP_OK, NULL}, {1, 0, TP_OK, NULL}};
    pthread_t th[2];
    for (int r = 0; r < 2; r++)
        cr_assert_eq(pthread_create(&th[r], NULL, mt_worker, &slots[r]), 0);
    for (int r = 0; r < 2; r++)
        pthread_join(th[r], NULL);
    for (int r = 0; r < 2; r++) {
        cr_assert_eq(slots[r].st, TP_OK, "thread %d: %s", r, tp_status_string(slots[r].st));
        cr_assert_eq(slots[r].bad, 0, "thread %d read back wrong values", r);
        cr_assert_not_null(slots[r].left);
        int64_t first = 0;
        double got = 0;
        CHECK_OK(tp_tensor_get(slots[r].left, &first, &got));
        cr_assert_eq(got, (double)(r * 1000 + 196), "thread %d's last tensor", r);
        tp_tensor_release(slots[r].left);
    }
    CHECK_OK(tp_cuda_synchronize(0));
    cr_assert_eq(mstats().allocated, allocated0, "every block was freed");
}

/* ---- dtype conversions on the device (core/cuda_copy.cu) -------------------------------
 *
 * tp_tensor_copy between dtypes on one CUDA device runs one conversion kernel;
 * its results are compared bit for bit with the CPU path's conversion of the
 * same stored values (core/base.h states the rules). The values sit on the
 * rounding boundaries of every narrowing: f32/bf16/f16 ties to even, f16
 * overflow to inf and its subnormals, float -> integer truncation, NaN -> 0
 * and saturation, i64 -> f32 rounding once, i64 -> i32 keeping the low bits,
 * NaNs with payloads (quiet ones: how a signaling NaN is quieted on the way
 * through double depends on the host compiler). */

#define CV_R 6
#define CV_C 8
#define CV_N (CV_R * CV_C)

static const tp_dtype CV_DTYPES[6] = {TP_F32, TP_F64, TP_F16, TP_BF16, TP_I32, TP_I64};

static double cv_bits(uint64_t b)
{
    double d;
    memcpy(&d, &b, sizeof d);
    return d;
}

/* A CPU [CV_R, CV_C] tensor of dtype dt: the boundary values (stored in dt
 * by the CPU conversion), then filler. */
static tp_tensor *cv_source(tp_dtype dt)
{
    const double f[] = {0.0,
                        -0.0,
                        1.0,
                        -1.0,
                        0.5,
                        2.5,
                        -2.5,
                        0.7,
                        -0.7,
                        123.456,
                        1.0 + 0x1p-8,
                        1.0 + 3 * 0x1p-8,
                        1.0 + 0x1p-8 + 0x1p-20, /* bf16 ties */
                        1.0 + 0x1p-24,
                        1.0 + 3 * 0x1p-24, /* f32 ties */
                        1.0 + 0x1p-11,
                        1.0 + 3 * 0x1p-11, /* f16 ties */
                        65504.0,
                        65519.0,
                        65520.0,
                        1e5,
                        -1e5, /* f16 max, overflow */
                        0x1p-24,
                        0x1p-25,
                        3 * 0x1p-25,
                        1e-6,
                        0x1p-14 - 0x1p-25, /* f16 subnormals */
                        3.4e38,
                        3.5e38,
                        -1e300,
                        1e-300,
                        5e-324,
                        0x1p-149, /* f32 range */
                        2147483647.5,
                        2147483648.0,
                        -2147483649.0,
                        -2147483648.9,
                        9.3e18,
                        -9.3e18,
                        INFINITY,
                        -INFINITY,
                        NAN,
                        cv_bits(0xfff8000000000000ull),
                        cv_bits(0x7ffc000000012345ull),
                        cv_bits(0x7ff8002000000000ull)};
    const int64_t iv[] = {0,
                          1,
                          -1,
                          7,
                          -7,
                          255,
                          2049,
                          65504,
                          65519,
                          65520,
                          70000,
                          -70000,
                          16777217,
                          -16777217,
                          16777219,
                          INT32_MAX,
                          INT32_MIN,
                          (int64_t)INT32_MAX + 1,
                          (int64_t)INT32_MIN - 1,
                          ((int64_t)1 << 32) + 5,
                          ((int64_t)1 << 53) + 1,
                          9007199791611905, /* 2^53+2^29+1: one rounding */
                          ((int64_t)1 << 62) + 3,
                          INT64_MAX,
                          INT64_MIN,
                          INT64_MIN + 1};
    const int64_t shape[2] = {CV_R, CV_C};
    tp_tensor *src = NULL, *t = NULL;
    if (dt == TP_I32 || dt == TP_I64) {
        int64_t v[CV_N];
        size_t k = sizeof iv / sizeof iv[0];
        for (int i = 0; i < CV_N; i++)
            v[i] = i < (int)k ? iv[i] : (int64_t)((i * 7919) % 2001) - 1000;
        CHECK_OK(tp_tensor_from_data(TP_I64, 2, shape, v, &src));
    } else {
        double v[CV_N];
        size_t k = sizeof f / sizeof f[0];
        cr_assert_leq(k, CV_N);
        for (int i = 0; i < CV_N; i++)
            v[i] = i < (int)k ? f[i] : ((i * 7919) % 2001 - 1000) * 0.0137;
        CHECK_OK(tp_tensor_from_data(TP_F64, 2, shape, v, &src));
    }
    CHECK_OK(tp_tensor_to(src, dt, TP_CPU, &t));
    tp_tensor_release(src);
    return t;
}

/* got (any device, any layout) equals want (CPU, contiguous, same dtype) bit
 * for bit */
static void cv_expect_bits(const char *what, tp_dtype from, const tp_tensor *got,
                           const tp_tensor *want)
{
    cr_assert_eq(tp_tensor_dtype(got), tp_tensor_dtype(want), "%s: dtype", what);
    cr_assert_eq(tp_tensor_numel(got), tp_tensor_numel(want), "%s: numel", what);
    tp_tensor *h = NULL;
    CHECK_OK(tp_tensor_to(got, tp_tensor_dtype(got), TP_CPU, &h));
    size_t es = tp_dtype_size(tp_tensor_dtype(want));
    const unsigned char *a = tp_tensor_data(h), *b = tp_tensor_data(want);
    for (int64_t i = 0; i < tp_tensor_numel(want); i++) {
        if (memcmp(a + i * es, b + i * es, es) == 0)
            continue;
        uint64_t x = 0, y = 0;
        memcpy(&x, a + i * es, es);
        memcpy(&y, b + i * es, es);
        cr_assert(false, "%s, %s -> %s: element %lld is 0x%llx, the CPU gives 0x%llx", what,
                  tp_dtype_name(from), tp_dtype_name(tp_tensor_dtype(want)), (long long)i,
                  (unsigned long long)x, (unsigned long long)y);
    }
    tp_tensor_release(h);
}

/* The CPU's conversion of view hv and the device's of its twin dv: on the
 * device, host to device and device to host. */
static void cv_check_views(const char *what, tp_tensor *hv, tp_tensor *dv, tp_dtype to)
{
    tp_dtype from = tp_tensor_dtype(hv);
    tp_tensor *want = NULL, *g[3] = {NULL, NULL, NULL};
    char buf[96];
    CHECK_OK(tp_tensor_to(hv, to, TP_CPU, &want));
    CHECK_OK(tp_tensor_to(dv, to, DEV, &g[0]));
    cr_assert(on(g[0], DEV));
    snprintf(buf, sizeof buf, "%s on the device", what);
    cv_expect_bits(buf, from, g[0], want);
    CHECK_OK(tp_tensor_to(hv, to, DEV, &g[1]));
    snprintf(buf, sizeof buf, "%s host to device", what);
    cv_expect_bits(buf, from, g[1], want);
    CHECK_OK(tp_tensor_to(dv, to, TP_CPU, &g[2]));
    snprintf(buf, sizeof buf, "%s device to host", what);
    cv_expect_bits(buf, from, g[2], want);
    tp_tensor_release(want);
    for (int k = 0; k < 3; k++)
        tp_tensor_release(g[k]);
}

Test(cuda, convert_every_dtype_pair_bit_exact, .timeout = 120)
{
    need_cuda();
    for (int si = 0; si < 6; si++) {
        tp_tensor *h = cv_source(CV_DTYPES[si]);
        tp_tensor *d = to_dev(h, DEV);
        for (int di = 0; di < 6; di++)
            cv_check_views("contiguous", h, d, CV_DTYPES[di]);
        tp_tensor_release(h);
        tp_tensor_release(d);
    }
}

/* The same view of a CPU tensor and of its device copy. */
typedef tp_status (*cv_view_fn)(tp_tensor *t, tp_tensor **out);

static tp_status cv_narrow(tp_tensor *t, tp_tensor **out)
{
    return tp_tensor_narrow(t, 1, 1, 5, out); /* [6, 5], row stride 8 */
}

static tp_status cv_column(tp_tensor *t, tp_tensor **out)
{
    return tp_tensor_select(t, 1, 3, out); /* [6], stride 8 */
}

static tp_status cv_chunk3d(tp_tensor *t, tp_tensor **out)
{
    /* [2, 3, 4] at strides [24, 8, 1]: the outer two dims merge, the last does not */
    const int64_t s3[3] = {2, 3, 8};
    tp_tensor *v = NULL;
    tp_status st = tp_tensor_view(t, 3, s3, &v);
    if (st == TP_OK)
        st = tp_tensor_chunk(v, 2, 2, 1, out);
    tp_tensor_release(v);
    return st;
}

Test(cuda, convert_strided_views_bit_exact, .timeout = 120)
{
    need_cuda();
    const cv_view_fn views[3] = {cv_narrow, cv_column, cv_chunk3d};
    const char *names[3] = {"sliced columns", "one column", "3-d chunk"};
    for (int si = 0; si < 6; si++) {
        tp_tensor *h = cv_source(CV_DTYPES[si]);
        tp_tensor *d = to_dev(h, DEV);
        for (int v = 0; v < 3; v++) {
            tp_tensor *hv = NULL, *dv = NULL;
            CHECK_OK(views[v](h, &hv));
            CHECK_OK(views[v](d, &dv));
            cr_assert(!tp_tensor_is_contiguous(dv));
            for (int di = 0; di < 6; di++)
                cv_check_views(names[v], hv, dv, CV_DTYPES[di]);
            tp_tensor_release(hv);
            tp_tensor_release(dv);
        }
        tp_tensor_release(h);
        tp_tensor_release(d);
    }
}

/* Into a strided destination (columns 3..7 of [6, 10] zeros): only the view's
 * elements change, as on the CPU, whichever side the source is on. */
Test(cuda, convert_into_strided_destination_bit_exact, .timeout = 120)
{
    need_cuda();
    const int64_t zs[2] = {CV_R, 10};
    for (int si = 0; si < 6; si++) {
        tp_tensor *h = cv_source(CV_DTYPES[si]), *hv = NULL, *dv = NULL;
        tp_tensor *d = to_dev(h, DEV);
        CHECK_OK(cv_narrow(h, &hv));
        CHECK_OK(cv_narrow(d, &dv));
        for (int di = 0; di < 6; di++) {
            tp_dtype to = CV_DTYPES[di];
            tp_tensor *want = NULL, *wv = NULL;
            CHECK_OK(tp_tensor_zeros(to, TP_CPU, 2, zs, &want));
            CHECK_OK(tp_tensor_narrow(want, 1, 3, 5, &wv));
            CHECK_OK(tp_tensor_copy(wv, hv));
            /* device -> device, host -> device, device -> host */
            tp_tensor *srcs[3] = {dv, hv, dv};
            const tp_device dsts[3] = {DEV, DEV, TP_CPU};
            const char *what[3] = {"strided dst on the device", "strided dst host to device",
                                   "strided dst device to host"};
            for (int k = 0; k < 3; k++) {
                tp_tensor *z = NULL, *zv = NULL;
                CHECK_OK(tp_tensor_zeros(to, dsts[k], 2, zs, &z));
                CHECK_OK(tp_tensor_narrow(z, 1, 3, 5, &zv));
                CHECK_OK(tp_tensor_copy(zv, srcs[k]));
                cv_expect_bits(what[k], CV_DTYPES[si], z, want);
                tp_tensor_release(zv);
                tp_tensor_release(z);
            }
            tp_tensor_release(wv);
            tp_tensor_release(want);
        }
        tp_tensor_release(hv);
        tp_tensor_release(dv);
        tp_tensor_release(h);
        tp_tensor_release(d);
    }
}

/* A conversion on one device stages nothing through the host. libtp keeps
 * no count of its host copies, but every staging buffer (and every device
 * temporary's host record) is a host allocation through the allocator hook,
 * so a conversion that makes none moved no bytes through host memory; a
 * host-to-device conversion, which does allocate, shows the count works. */
Test(cuda, convert_on_device_allocates_no_host_staging, .timeout = 60)
{
    need_cuda();
    const int64_t s[2] = {64, 96};
    tp_tensor *a = NULL, *b = NULL, *c = NULL, *av = NULL, *cv = NULL, *h = NULL;
    CHECK_OK(tp_tensor_empty(TP_F32, DEV, 2, s, &a));
    CHECK_OK(tp_tensor_fill_random(a, TP_RNG_NORMAL, 0, 1, 5, NULL, NULL));
    CHECK_OK(tp_tensor_empty(TP_BF16, DEV, 2, s, &b));
    CHECK_OK(tp_tensor_zeros(TP_F16, DEV, 2, s, &c));
    CHECK_OK(tp_tensor_narrow(a, 1, 8, 40, &av));
    CHECK_OK(tp_tensor_narrow(c, 1, 50, 40, &cv));
    CHECK_OK(tp_tensor_empty(TP_F32, TP_CPU, 2, s, &h));
    CHECK_OK(tp_tensor_fill(h, 1.5));
    CHECK_OK(tp_tensor_copy(b, a)); /* the thread's stream exists before counting */
    FA.live = 0;
    FA.count = 0;
    FA.fail_at = -1;
    tp_allocator fa = {fa_alloc, fa_free, NULL};
    CHECK_OK(tp_set_allocator(&fa));
    tp_status st1 = tp_tensor_copy(b, a);   /* f32 -> bf16, contiguous */
    tp_status st2 = tp_tensor_copy(cv, av); /* f32 -> f16, strided both sides */
    tp_status st3 = tp_tensor_copy(a, b);   /* bf16 -> f32 */
    long on_device = FA.count;
    tp_status st4 = tp_tensor_copy(b, h); /* host f32 -> device bf16 */
    long staged = FA.count - on_device, live = FA.live;
    CHECK_OK(tp_set_allocator(NULL));
    cr_assert(st1 == TP_OK && st2 == TP_OK && st3 == TP_OK && st4 == TP_OK);
    cr_assert_eq(on_device, 0, "a conversion on the device made %ld host allocations", on_device);
    cr_assert_gt(staged, 0, "the host-to-device conversion allocated nothing: the count is blind");
    cr_assert_eq(live, 0, "host memory left by the conversions");
    /* the host-to-device conversion landed (tp_tensor_get is CPU only) */
    tp_tensor *hb = NULL;
    double got = 0;
    const int64_t at[2] = {63, 95};
    CHECK_OK(tp_tensor_to(b, TP_F32, TP_CPU, &hb));
    CHECK_OK(tp_tensor_get(hb, at, &got));
    cr_assert_eq(got, 1.5);
    tp_tensor *all[] = {a, b, c, av, cv, h, hb};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        tp_tensor_release(all[i]);
}

/* tp_tensor_get / tp_tensor_set on a device tensor: one element copied each
 * way, ordered after the fill queued before it, in every dtype. */
Test(cuda, get_and_set_one_element, .timeout = 60)
{
    need_cuda();
    const tp_dtype dts[] = {TP_F32, TP_F64, TP_F16, TP_BF16, TP_I32, TP_I64};
    for (size_t k = 0; k < sizeof dts / sizeof dts[0]; k++) {
        int64_t shape[2] = {3, 5}, at[2] = {2, 3}, other[2] = {0, 1};
        tp_tensor *t = NULL;
        CHECK_OK(tp_tensor_empty(dts[k], TP_CUDA(0), 2, shape, &t));
        CHECK_OK(tp_tensor_fill(t, 7));
        CHECK_OK(tp_tensor_set(t, at, -3));
        double got = 0;
        CHECK_OK(tp_tensor_get(t, at, &got));
        cr_assert_eq(got, -3.0, "%s: set then get gave %g", tp_dtype_name(dts[k]), got);
        CHECK_OK(tp_tensor_get(t, other, &got));
        cr_assert_eq(got, 7.0, "%s: the fill before it gave %g", tp_dtype_name(dts[k]), got);
        int64_t bad[2] = {3, 0};
        cr_assert_eq(tp_tensor_get(t, bad, &got), TP_ERR_INVALID_ARG);
        tp_tensor_release(t);
    }
}
