/* Allocator hook: make the k-th allocation fail for k = 0, 1, 2, ... until the
 * operation succeeds; every failing run must report TP_ERR_NO_MEMORY, leave its
 * out-parameter NULL and leak nothing. */
#include <stdlib.h>

#include "tp_test.h"

typedef struct counting_alloc {
    long live;      /* allocations not yet freed */
    long count;     /* allocations attempted since the last reset */
    long fail_at;   /* index of the attempt to fail; -1: never */
    size_t max_alignment;
} counting_alloc;

static counting_alloc C;

static void *counting_alloc_fn(void *ctx, size_t size, size_t alignment)
{
    counting_alloc *c = ctx;
    long k = c->count++;
    if (k == c->fail_at)
        return NULL;
    if (alignment > c->max_alignment)
        c->max_alignment = alignment;
    if (alignment < sizeof(void *))
        alignment = sizeof(void *);
    size_t rounded = (size + alignment - 1) / alignment * alignment;
    void *p = aligned_alloc(alignment, rounded ? rounded : alignment);
    if (p)
        c->live++;
    return p;
}

static void counting_free_fn(void *ctx, void *ptr)
{
    counting_alloc *c = ctx;
    cr_assert_not_null(ptr, "free receives only pointers alloc returned");
    c->live--;
    free(ptr);
}

static void install(void)
{
    C = (counting_alloc){0, 0, -1, 0};
    tp_allocator a = {counting_alloc_fn, counting_free_fn, &C};
    cr_assert_eq(tp_set_allocator(&a), TP_OK);
}

static void restore(void) { tp_set_allocator(NULL); }

TestSuite(alloc, .init = install, .fini = restore, .timeout = 30);

typedef tp_status (*op_fn)(void *arg, tp_tensor **out);

/* Runs op with allocation k failing, for k = 0, 1, ... until it succeeds. */
static void fail_each_allocation(const char *name, op_fn op, void *arg)
{
    long base_live = C.live;
    for (long k = 0; k < 64; k++) {
        C.count = 0;
        C.fail_at = k;
        tp_tensor *out = (tp_tensor *)0x1;
        tp_clear_error();
        tp_status st = op(arg, &out);
        long attempted = C.count;
        C.fail_at = -1;
        if (st == TP_OK) {
            cr_assert_leq(attempted, k, "%s succeeded although allocation %ld failed", name, k);
            cr_assert_not_null(out);
            tp_tensor_release(out);
            cr_assert_eq(C.live, base_live, "%s: %ld allocations leaked after success", name,
                         C.live - base_live);
            return;
        }
        cr_assert_eq(st, TP_ERR_NO_MEMORY, "%s with allocation %ld failing: %s (%s)", name, k,
                     tp_status_name(st), tp_last_error());
        cr_assert(strstr(tp_last_error(), "out of memory"), "%s: message %s", name,
                  tp_last_error());
        cr_assert_null(out, "%s: out stays NULL on failure", name);
        cr_assert_eq(C.live, base_live, "%s with allocation %ld failing leaked %ld", name, k,
                     C.live - base_live);
    }
    cr_assert_fail("%s never succeeded", name);
}

static const int64_t shape3[3] = {4, 6, 5};

static tp_status op_empty(void *arg, tp_tensor **out)
{
    return tp_tensor_empty(TP_F32, TP_CPU, 3, shape3, out);
}

static tp_status op_zeros(void *arg, tp_tensor **out)
{
    return tp_tensor_zeros(TP_BF16, TP_CPU, 3, shape3, out);
}

static tp_status op_scalar(void *arg, tp_tensor **out)
{
    return tp_tensor_zeros(TP_I64, TP_CPU, 0, NULL, out);
}

static tp_status op_from_data(void *arg, tp_tensor **out)
{
    static const double data[120];
    return tp_tensor_from_data(TP_F64, 3, shape3, data, out);
}

static int deleted;

static void count_deleter(void *data, void *ctx)
{
    (void)data;
    (void)ctx;
    deleted++;
}

static tp_status op_from_blob(void *arg, tp_tensor **out)
{
    static float blob[120];
    return tp_tensor_from_blob(TP_F32, TP_CPU, 3, shape3, blob, count_deleter, NULL, out);
}

Test(alloc, creation, .timeout = 30)
{
    fail_each_allocation("tp_tensor_empty", op_empty, NULL);
    fail_each_allocation("tp_tensor_zeros", op_zeros, NULL);
    fail_each_allocation("tp_tensor_zeros(scalar)", op_scalar, NULL);
    fail_each_allocation("tp_tensor_from_data", op_from_data, NULL);
    cr_assert_geq(C.max_alignment, 64, "storage asks for 64-byte alignment");
    deleted = 0;
    fail_each_allocation("tp_tensor_from_blob", op_from_blob, NULL);
    cr_assert_eq(deleted, 1, "the deleter runs once, for the successful run only");
    cr_assert_eq(C.live, 0);
}

static tp_status op_narrow(void *arg, tp_tensor **out) { return tp_tensor_narrow(arg, 1, 1, 3, out); }
static tp_status op_chunk(void *arg, tp_tensor **out) { return tp_tensor_chunk(arg, 4, 2, 3, out); }
static tp_status op_select(void *arg, tp_tensor **out) { return tp_tensor_select(arg, 0, 2, out); }

static tp_status op_view(void *arg, tp_tensor **out)
{
    return tp_tensor_view(arg, 2, (const int64_t[]){-1, 10}, out);
}

static tp_status op_clone(void *arg, tp_tensor **out) { return tp_tensor_clone(arg, out); }

static tp_status op_to_f16(void *arg, tp_tensor **out)
{
    return tp_tensor_to(arg, TP_F16, TP_CPU, out);
}

static tp_status op_to_i64(void *arg, tp_tensor **out)
{
    return tp_tensor_to(arg, TP_I64, TP_CPU, out);
}

Test(alloc, views, .timeout = 30)
{
    tp_tensor *base = NULL;
    cr_assert_eq(tp_tensor_empty(TP_F32, TP_CPU, 3, shape3, &base), TP_OK);
    fail_each_allocation("tp_tensor_narrow", op_narrow, base);
    fail_each_allocation("tp_tensor_chunk", op_chunk, base);
    fail_each_allocation("tp_tensor_select", op_select, base);
    fail_each_allocation("tp_tensor_view", op_view, base);
    tp_tensor_release(base);
    cr_assert_eq(C.live, 0);
}

Test(alloc, clone_and_to, .timeout = 30)
{
    tp_tensor *base = NULL, *strided = NULL;
    cr_assert_eq(tp_tensor_empty(TP_F32, TP_CPU, 3, shape3, &base), TP_OK);
    cr_assert_eq(tp_tensor_fill_random(base, TP_RNG_UNIFORM, 0, 1, 1, NULL, NULL), TP_OK);
    cr_assert_eq(tp_tensor_narrow(base, 2, 1, 3, &strided), TP_OK);
    fail_each_allocation("tp_tensor_clone", op_clone, base);
    fail_each_allocation("tp_tensor_clone(strided)", op_clone, strided);
    fail_each_allocation("tp_tensor_to(f16)", op_to_f16, base);
    fail_each_allocation("tp_tensor_to(i64, strided)", op_to_i64, strided);
    tp_tensor_release(strided);
    tp_tensor_release(base);
    cr_assert_eq(C.live, 0);
}

Test(alloc, operations_that_do_not_allocate_on_cpu, .timeout = 30)
{
    tp_tensor *a = NULL, *b = NULL;
    cr_assert_eq(tp_tensor_zeros(TP_F32, TP_CPU, 3, shape3, &a), TP_OK);
    cr_assert_eq(tp_tensor_zeros(TP_F16, TP_CPU, 3, shape3, &b), TP_OK);
    C.count = 0;
    C.fail_at = 0; /* any allocation would fail */
    bool eq = false;
    double d = -1;
    cr_assert_eq(tp_tensor_fill(a, 2.0), TP_OK);
    cr_assert_eq(tp_tensor_copy(b, a), TP_OK);
    cr_assert_eq(tp_tensor_equal(a, b, &eq), TP_OK);
    cr_assert(eq);
    cr_assert_eq(tp_tensor_max_abs_diff(a, b, &d), TP_OK);
    cr_assert_eq(tp_tensor_fill_random(a, TP_RNG_NORMAL, 0, 1, 3, NULL, NULL), TP_OK);
    cr_assert_eq(C.count, 0, "no allocation attempted");
    C.fail_at = -1;
    tp_tensor_release(a);
    tp_tensor_release(b);
    cr_assert_eq(C.live, 0);
}

Test(alloc, set_allocator_rejects_null_slots, .timeout = 30)
{
    tp_allocator a = {NULL, counting_free_fn, &C};
    cr_assert_eq(tp_set_allocator(&a), TP_ERR_INVALID_ARG);
    tp_allocator b = {counting_alloc_fn, NULL, &C};
    cr_assert_eq(tp_set_allocator(&b), TP_ERR_INVALID_ARG);
    /* the counting allocator installed by init is still in place */
    tp_allocator cur = tp_get_allocator();
    cr_assert(cur.alloc == counting_alloc_fn && cur.free == counting_free_fn && cur.ctx == &C);
    cr_assert_eq(tp_set_allocator(NULL), TP_OK);
    cur = tp_get_allocator();
    cr_assert(cur.alloc != counting_alloc_fn);
    /* the default allocator works */
    tp_tensor *t = NULL;
    cr_assert_eq(tp_tensor_zeros(TP_F32, TP_CPU, 3, shape3, &t), TP_OK);
    tp_tensor_release(t);
    cr_assert_eq(C.count, 0, "nothing went through the removed allocator");
}

/* A permute or transpose of a plain tensor that needs no gradient allocates
 * its result and nothing else (no scratch view of its input), whichever copy
 * it makes: the strided gather, the last-two-dims transpose, the identity. */
Test(alloc, permute_allocates_only_its_result, .timeout = 30)
{
    tp_tensor *x = NULL, *y = NULL;
    cr_assert_eq(tp_tensor_empty(TP_F32, TP_CPU, 3, shape3, &x), TP_OK);
    cr_assert_eq(tp_tensor_fill_random(x, TP_RNG_UNIFORM, 0, 1, 1, NULL, NULL), TP_OK);
    C.count = 0;
    cr_assert_eq(tp_tensor_empty(TP_F32, TP_CPU, 3, shape3, &y), TP_OK);
    long result = C.count;
    tp_tensor_release(y);
    const int perms[3][3] = {{2, 0, 1}, {0, 2, 1}, {0, 1, 2}};
    for (int p = 0; p < 3; p++) {
        C.count = 0;
        y = NULL;
        cr_assert_eq(tp_permute(x, 3, perms[p], &y), TP_OK, "%s", tp_last_error());
        cr_assert_eq(C.count, result, "permute (%d, %d, %d) made %ld allocations; its result "
                     "takes %ld", perms[p][0], perms[p][1], perms[p][2], C.count, result);
        tp_tensor_release(y);
    }
    tp_tensor_release(x);
    cr_assert_eq(C.live, 0);
}

/* ---- the meta device and a simulated world ---------------------------------
 * Meta tensors take no storage memory but their headers, views, op outputs
 * and autograd state do: every failing allocation is still reported. */

static tp_status op_meta_empty(void *arg, tp_tensor **out)
{
    return tp_tensor_empty(TP_F32, TP_META, 3, shape3, out);
}

static tp_status op_to_meta(void *arg, tp_tensor **out)
{
    return tp_tensor_to(arg, TP_BF16, TP_META, out);
}

static tp_status op_meta_linear(void *arg, tp_tensor **out)
{
    tp_tensor **xw = arg;
    return tp_linear(xw[0], xw[1], NULL, out);
}

static tp_status op_meta_distribute(void *arg, tp_tensor **out)
{
    void **mf = arg;
    tp_placement s0 = tp_shard(0);
    return tp_dtensor_distribute(mf[0], mf[1], 1, &s0, 0, out);
}

Test(alloc, meta_and_sim, .timeout = 30)
{
    tp_tensor *base = NULL, *xw[2] = {NULL, NULL};
    cr_assert_eq(tp_tensor_empty(TP_F32, TP_CPU, 3, shape3, &base), TP_OK);
    cr_assert_eq(tp_tensor_empty(TP_F32, TP_META, 3, shape3, &xw[0]), TP_OK);
    cr_assert_eq(tp_tensor_empty(TP_F32, TP_META, 2, (int64_t[]){3, 5}, &xw[1]), TP_OK);
    cr_assert_eq(tp_tensor_set_requires_grad(xw[1], true), TP_OK);
    fail_each_allocation("tp_tensor_empty(meta)", op_meta_empty, NULL);
    fail_each_allocation("tp_tensor_to(meta)", op_to_meta, base);
    fail_each_allocation("tp_linear(meta)", op_meta_linear, xw);

    tp_comm *w = NULL;
    tp_mesh *mesh = NULL;
    cr_assert_eq(tp_comm_create_world("sim", &(tp_sim_options){.world_size = 4, .rank = 2}, &w),
                 TP_OK);
    cr_assert_eq(tp_mesh_create(w, 1, (int64_t[]){4}, NULL, &mesh), TP_OK);
    void *mf[2] = {mesh, xw[0]};
    fail_each_allocation("tp_dtensor_distribute(sim, meta)", op_meta_distribute, mf);
    tp_mesh_free(mesh);
    cr_assert_eq(tp_comm_free(w), TP_OK);
    tp_tensor_release(xw[0]);
    tp_tensor_release(xw[1]);
    tp_tensor_release(base);
    cr_assert_eq(C.live, 0);
}

/* ---- the fused linear + GELU, forward and backward ----------------------------
 * Every allocation of the op, of its pre-activation, of the backward's
 * scratch (bf16: the f32 copies of the CPU engine too) and of the gradients
 * fails in turn: TP_ERR_NO_MEMORY, nothing leaked, the leaves' gradients
 * dropped. */

static tp_status op_linear_gelu_step(void *arg, tp_tensor **out)
{
    tp_tensor **t = arg; /* x, w, b, gy */
    tp_tensor *y = NULL;
    tp_status st = tp_linear_gelu(t[0], t[1], t[2], TP_GELU_TANH, &y);
    if (st == TP_OK)
        st = tp_backward(y, t[3]);
    for (int i = 0; i < 3; i++)
        tp_tensor_zero_grad(t[i]);
    if (st != TP_OK) {
        tp_tensor_release(y);
        *out = NULL;
        return st;
    }
    *out = y;
    return TP_OK;
}

/* linear_gelu, then a linear over its output whose backward takes the
 * GELU's backward over (ops.h): the hand-over's allocations fail too */
static tp_status op_gelu_mlp_step(void *arg, tp_tensor **out)
{
    tp_tensor **t = arg; /* x, w1, b1, w2, b2, gy */
    tp_tensor *h = NULL, *y = NULL;
    tp_status st = tp_linear_gelu(t[0], t[1], t[2], TP_GELU_TANH, &h);
    if (st == TP_OK)
        st = tp_linear(h, t[3], t[4], &y);
    tp_tensor_release(h);
    if (st == TP_OK)
        st = tp_backward(y, t[5]);
    for (int i = 0; i < 5; i++)
        tp_tensor_zero_grad(t[i]);
    if (st != TP_OK) {
        tp_tensor_release(y);
        *out = NULL;
        return st;
    }
    *out = y;
    return TP_OK;
}

Test(alloc, linear_gelu_forward_backward, .timeout = 30)
{
    const int64_t shapes[4][2] = {{6, 5}, {8, 5}, {8, 1}, {6, 8}};
    for (int d = 0; d < 2; d++) {
        tp_dtype dt = d ? TP_BF16 : TP_F32;
        tp_tensor *t[4] = {0};
        for (int i = 0; i < 4; i++) {
            cr_assert_eq(tp_tensor_empty(dt, TP_CPU, i == 2 ? 1 : 2, shapes[i], &t[i]), TP_OK);
            cr_assert_eq(tp_tensor_fill_random(t[i], TP_RNG_UNIFORM, -1, 1, 3 + (uint64_t)i,
                                               NULL, NULL),
                         TP_OK);
            if (i < 3)
                cr_assert_eq(tp_tensor_set_requires_grad(t[i], true), TP_OK);
        }
        fail_each_allocation(d ? "tp_linear_gelu + backward (bf16)" : "tp_linear_gelu + backward",
                             op_linear_gelu_step, t);
        /* x [6, 5] -> 8 -> 3 */
        const int64_t mshapes[6][2] = {{6, 5}, {8, 5}, {8, 1}, {3, 8}, {3, 1}, {6, 3}};
        tp_tensor *m[6] = {0};
        for (int i = 0; i < 6; i++) {
            cr_assert_eq(tp_tensor_empty(dt, TP_CPU, mshapes[i][1] == 1 ? 1 : 2, mshapes[i], &m[i]),
                         TP_OK);
            cr_assert_eq(tp_tensor_fill_random(m[i], TP_RNG_UNIFORM, -1, 1, 9 + (uint64_t)i, NULL,
                                               NULL),
                         TP_OK);
            if (i < 5)
                cr_assert_eq(tp_tensor_set_requires_grad(m[i], true), TP_OK);
        }
        fail_each_allocation(d ? "tp_linear_gelu -> tp_linear + backward (bf16)"
                               : "tp_linear_gelu -> tp_linear + backward",
                             op_gelu_mlp_step, m);
        for (int i = 0; i < 6; i++)
            tp_tensor_release(m[i]);
        for (int i = 0; i < 4; i++)
            tp_tensor_release(t[i]);
    }
    cr_assert_eq(C.live, 0);
}
