/* tp_module_replicate, after the seed test_data_parallel.py
 * (torch.nn.parallel.replicate): replicas on logical CPU devices {0, 1}, on
 * one GPU {cuda:0, cuda:0} (the replicas then run on rank threads sharing
 * the device, their outputs summed through the shm backend), and on CUDA
 * devices 0, 1 where two GPUs exist, keep the tree, compute what the
 * original computes, share parameter storage on the original's device and
 * deep-copy elsewhere; replicas run concurrently on rank threads; errors and
 * allocation failures leave nothing behind.
 *
 * The seed's Msm/Mpy hold nn.Sequential(Linear(2,2), BatchNorm1d(2), ReLU,
 * Linear(2,2)); libtp has no BatchNorm (and so no buffers), LayerNorm(2)
 * stands in. */
#include <stdlib.h>

#include "tp_test.h"

/* ---- modules of the seed --------------------------------------------------------- */

/* Mpy1 / Msm1 / Msm / Mpy: forward = the only child's forward. */
static tp_status fwd_child(tp_module *self, int nargs, tp_tensor *const *args, int nkw,
                           const tp_kwarg *kw, tp_tensor **out)
{
    return tp_module_forward(tp_module_child_at(self, 0, NULL), nargs, args, nkw, kw, out);
}

/* Mpy2(block1, block2): block2(block1(x)). libtp's tree gives a module one
 * parent, so the seed's second reference to the shared block s (block2 ==
 * block1.m) is reached by its path from self: the replica then resolves it
 * to its own copy of s. */
static tp_status fwd_mpy2(tp_module *self, int nargs, tp_tensor *const *args, int nkw,
                          const tp_kwarg *kw, tp_tensor **out)
{
    tp_tensor *x = NULL;
    TP_TEST_TRY(tp_module_forward(tp_module_child(self, "m1"), nargs, args, nkw, kw, &x));
    tp_status st = tp_module_call(tp_module_find(self, "m1.m"), x, out);
    tp_tensor_release(x);
    return st;
}

/* Hangs `child` under a new custom module `type` as `name`. */
static tp_status wrap(const char *type, tp_forward_fn fwd, const char *name, tp_module *child,
                      tp_module **out)
{
    tp_module *m = NULL;
    tp_status st = tp_nn_custom_create(type, fwd, NULL, NULL, &m);
    if (st == TP_OK)
        st = tp_module_add_child(m, name, child);
    if (st != TP_OK) {
        tp_module_free(m);
        tp_module_free(child);
        return st;
    }
    *out = m;
    return TP_OK;
}

/* Sequential(Linear(2,2), LayerNorm(2), ReLU, Linear(2,2)). */
static tp_status make_seq(tp_module **out)
{
    tp_module *seq = NULL, *c = NULL;
    TP_TEST_TRY(tp_nn_sequential_create(&seq));
    tp_status st = TP_OK;
    for (int i = 0; i < 4 && st == TP_OK; i++) {
        c = NULL;
        switch (i) {
        case 0:
        case 3:
            st = tp_nn_linear_create(2, 2, true, &c);
            break;
        case 1:
            st = tp_nn_layer_norm_create(2, true, 1e-5, &c);
            break;
        default:
            st = tp_nn_relu_create(&c);
            break;
        }
        char name[4];
        snprintf(name, sizeof name, "%d", i);
        if (st == TP_OK && (st = tp_module_add_child(seq, name, c)) != TP_OK)
            tp_module_free(c);
    }
    if (st != TP_OK) {
        tp_module_free(seq);
        return st;
    }
    *out = seq;
    return TP_OK;
}

/* Msm: a module whose `m` is the Sequential above. */
static tp_module *make_msm(void)
{
    tp_module *seq = NULL, *msm = NULL;
    CHECK_OK(make_seq(&seq));
    CHECK_OK(wrap("Msm", fwd_child, "m", seq, &msm));
    return msm;
}

/* Parameters with values from (seed, FQN). */
static void init(tp_module *m, uint64_t seed) { CHECK_OK(tp_module_init(m, seed)); }

/* ---- helpers ---------------------------------------------------------------------- */

#define MAX_P 32
typedef struct {
    int n;
    char fqn[MAX_P][96];
    tp_tensor *t[MAX_P];
} plist;

static tp_status collect(const char *fqn, tp_tensor *t, void *ctx)
{
    plist *l = ctx;
    if (l->n >= MAX_P)
        return TP_ERR_NO_MEMORY;
    snprintf(l->fqn[l->n], sizeof l->fqn[0], "%s", fqn);
    l->t[l->n++] = t;
    return TP_OK;
}

static plist params_of(tp_module *m)
{
    plist l = {0};
    CHECK_OK(tp_module_named_parameters(m, collect, &l));
    return l;
}

static bool same_dev(tp_device a, tp_device b) { return a.type == b.type && a.index == b.index; }

static tp_device physical(tp_device d) { return d.type == TP_DEVICE_CPU ? TP_CPU : d; }

static tp_tensor *random_input(uint64_t seed, tp_device dev)
{
    tp_tensor *x = NULL, *y = NULL;
    CHECK_OK(tp_tensor_zeros(TP_F32, TP_CPU, 2, (int64_t[]){2, 2}, &x));
    CHECK_OK(tp_tensor_fill_random(x, TP_RNG_NORMAL, 0, 1, seed, NULL, NULL));
    if (dev.type == TP_DEVICE_CPU)
        return x;
    CHECK_OK(tp_tensor_to(x, TP_F32, dev, &y));
    tp_tensor_release(x);
    return y;
}

static tp_tensor *on(const tp_tensor *x, tp_device dev)
{
    tp_tensor *y = NULL;
    CHECK_OK(tp_tensor_to(x, tp_tensor_dtype(x), physical(dev), &y));
    return y;
}

/* Equal on the CPU; within float rounding across CUDA devices. */
static void assert_same_output(const tp_tensor *a, const tp_tensor *b, const char *what)
{
    bool ok = false;
    if (tp_tensor_device(a).type == TP_DEVICE_CPU && tp_tensor_device(b).type == TP_DEVICE_CPU)
        CHECK_OK(tp_tensor_equal(a, b, &ok));
    else
        CHECK_OK(tp_tensor_allclose(a, b, 1e-5, 1e-6, &ok));
    cr_assert(ok, "%s: outputs differ", what);
}

/* One GPU: each replica runs on its own rank thread of tp_run_local, all
 * on cuda:0, and the ranks sum their outputs with an all_reduce through
 * the shm backend; each output and the sum are the original's (times n). */
typedef struct {
    tp_module **replicas;
    const tp_tensor *x; /* on cuda:0, read only */
    tp_tensor *out[TP_TEST_MAX_RANKS], *sum[TP_TEST_MAX_RANKS];
    tp_test_slot slot[TP_TEST_MAX_RANKS];
} gpu_ranks_ctx;

static tp_status replica_on_rank(tp_comm *w, void *arg)
{
    gpu_ranks_ctx *c = arg;
    int r = tp_comm_rank(w);
    tp_test_slot *s = &c->slot[r];
    tp_tensor *y = NULL, *sum = NULL;
    RANK_OK(s, tp_module_call(c->replicas[r], (tp_tensor *)c->x, &y));
    RANK_OK(s, tp_tensor_clone(y, &sum));
    RANK_OK(s, tp_all_reduce(w, sum, sum, TP_SUM, NULL));
    RANK_OK(s, tp_tensor_to(y, TP_F32, TP_CPU, &c->out[r]));
    RANK_OK(s, tp_tensor_to(sum, TP_F32, TP_CPU, &c->sum[r]));
    tp_tensor_release(y);
    tp_tensor_release(sum);
    return TP_OK;
}

static void check_replicas_on_ranks(tp_module **replicas, int n, const tp_tensor *input,
                                    const tp_tensor *expected)
{
    gpu_ranks_ctx c = {.replicas = replicas, .x = input};
    CHECK_OK(tp_cuda_synchronize(0)); /* input and parameters, for the other threads */
    tp_test_run(n, replica_on_rank, &c, c.slot);
    tp_tensor *want = NULL, *nwant = NULL;
    CHECK_OK(tp_tensor_to(expected, TP_F32, TP_CPU, &want));
    CHECK_OK(tp_scale(want, (double)n, &nwant));
    for (int r = 0; r < n; r++) {
        char what[64];
        snprintf(what, sizeof what, "replica %d on its rank", r);
        assert_same_output(c.out[r], want, what);
        snprintf(what, sizeof what, "rank %d: the sum over the ranks", r);
        assert_same_output(c.sum[r], nwant, what);
        tp_tensor_release(c.out[r]);
        tp_tensor_release(c.sum[r]);
    }
    tp_tensor_release(want);
    tp_tensor_release(nwant);
}

/* Every module of the replica reports the replica's device. */
static void assert_tree_device(const tp_module *m, tp_device dev, int replica)
{
    tp_device d = tp_module_device(m);
    cr_assert(same_dev(d, dev), "replica %d: module '%s' (%s) reports device %d:%d, not %d:%d",
              replica, tp_module_name(m), tp_module_type_name(m), (int)d.type, d.index,
              (int)dev.type, dev.index);
    for (int i = 0; i < tp_module_num_children(m); i++)
        assert_tree_device(tp_module_child_at(m, i, NULL), dev, replica);
}

/* The seed's check_replicas: the device of every parameter (there are no
 * buffers), the same FQNs, and the original's output on the same input. */
static void check_replicas(tp_module *module, tp_module **replicas, const tp_device *devices,
                           int n)
{
    tp_tensor *input = random_input(11, physical(tp_module_device(module)));
    tp_tensor *expected = NULL;
    CHECK_OK(tp_module_call(module, input, &expected));
    plist orig = params_of(module);
    for (int i = 0; i < n; i++) {
        cr_assert_not_null(replicas[i], "replica %d", i);
        assert_tree_device(replicas[i], devices[i], i);
        plist rp = params_of(replicas[i]);
        cr_assert_eq(rp.n, orig.n, "replica %d has %d parameters, the original %d", i, rp.n,
                     orig.n);
        for (int k = 0; k < rp.n; k++) {
            cr_assert_str_eq(rp.fqn[k], orig.fqn[k], "replica %d parameter %d", i, k);
            tp_device d = tp_tensor_device(rp.t[k]);
            cr_assert(same_dev(d, physical(devices[i])), "replica %d: %s on %d:%d", i,
                      rp.fqn[k], (int)d.type, d.index);
            cr_assert(tp_tensor_requires_grad(rp.t[k]), "replica %d: %s", i, rp.fqn[k]);
        }
        tp_tensor *x = on(input, devices[i]), *y = NULL;
        CHECK_OK(tp_module_call(replicas[i], x, &y));
        cr_assert(same_dev(tp_tensor_device(y), physical(devices[i])));
        char what[64];
        snprintf(what, sizeof what, "replica %d", i);
        assert_same_output(y, expected, what);
        tp_tensor_release(x);
        tp_tensor_release(y);
    }
    if (n > 1 && same_dev(devices[0], TP_CUDA(0)) && same_dev(devices[n - 1], TP_CUDA(0)))
        check_replicas_on_ranks(replicas, n, input, expected);
    tp_tensor_release(input);
    tp_tensor_release(expected);
}

static void free_all(tp_module **r, int n)
{
    for (int i = 0; i < n; i++)
        tp_module_free(r[i]);
}

static const tp_device CPU01[2] = {{TP_DEVICE_CPU, 0}, {TP_DEVICE_CPU, 1}};
static const tp_device CUDA00[2] = {{TP_DEVICE_CUDA, 0}, {TP_DEVICE_CUDA, 0}};
static const tp_device CUDA01[2] = {{TP_DEVICE_CUDA, 0}, {TP_DEVICE_CUDA, 1}};

/* Where a scenario's two replicas go. */
typedef enum { ON_CPU, ON_ONE_GPU, ON_TWO_GPUS } placement_mode;

/* The devices of a scenario: logical CPU devices, both replicas on cuda:0,
 * or two GPUs (skipping the test visibly without them); the module goes to
 * devices[0]. */
static const tp_device *devices_for(placement_mode mode, tp_module *module)
{
    if (mode == ON_CPU)
        return CPU01;
    int count = tp_cuda_device_count(), need = mode == ON_TWO_GPUS ? 2 : 1;
    if (count < need) {
        tp_module_free(module);
        if (count == 0)
            cr_skip_test("no CUDA device: needs %d, found 0", need);
        cr_skip_test("not enough CUDA devices: needs %d, found %d", need, count);
    }
    CHECK_OK(tp_module_to(module, TP_CUDA(0)));
    return mode == ON_TWO_GPUS ? CUDA01 : CUDA00;
}

/* Replica i views the original's storage exactly when it is on the
 * original's device (devices[0] is). */
static bool shares(const tp_device *dev, int i)
{
    return same_dev(dev[i], dev[0]);
}

/* ---- the seed's tests ----------------------------------------------------------- */

/* test_python_submodule_script: Mpy1(Msm()). */
static void python_submodule(placement_mode mode)
{
    tp_module *module = NULL, *r[2];
    CHECK_OK(wrap("Mpy1", fwd_child, "m", make_msm(), &module));
    init(module, 1);
    const tp_device *dev = devices_for(mode, module);
    CHECK_OK(tp_module_replicate(module, dev, 2, r));
    check_replicas(module, r, dev, 2);
    free_all(r, 2);
    tp_module_free(module);
}

Test(replicate, python_submodule_cpu, .timeout = 30)
{
    python_submodule(ON_CPU);
}
Test(replicate, python_submodule_cuda, .timeout = 60)
{
    python_submodule(ON_ONE_GPU);
}
Test(replicate, python_submodule_cuda_two_gpus, .timeout = 60)
{
    python_submodule(ON_TWO_GPUS);
}

/* test_shared_module: Mpy2(Mpy1(s), s). */
static void shared_module(placement_mode mode)
{
    tp_module *s = make_msm(), *p1 = NULL, *module = NULL, *other = NULL, *r[2];
    CHECK_OK(wrap("Mpy1", fwd_child, "m", s, &p1));
    CHECK_OK(wrap("Mpy2", fwd_mpy2, "m1", p1, &module));
    /* a module has one parent: s cannot hang in the tree twice */
    CHECK_OK(tp_nn_container_create(&other));
    CHECK_ERR(tp_module_add_child(other, "m2", s), TP_ERR_INVALID_ARG);
    tp_module_free(other);
    init(module, 2);
    const tp_device *dev = devices_for(mode, module);
    CHECK_OK(tp_module_replicate(module, dev, 2, r));
    check_replicas(module, r, dev, 2);
    /* the replica's shared block is its own: both uses in its forward reach
     * the replica's s */
    tp_module *rs = tp_module_find(r[1], "m1.m");
    cr_assert_not_null(rs);
    cr_assert_neq(rs, s);
    cr_assert_eq(tp_tensor_shares_storage(tp_module_parameter(tp_module_find(rs, "m.0"), "weight"),
                                          tp_module_parameter(tp_module_find(s, "m.0"), "weight")),
                 shares(dev, 1), "replica 1's s views the original's storage iff on its device");
    free_all(r, 2);
    tp_module_free(module);
}

Test(replicate, shared_module_cpu, .timeout = 30)
{
    shared_module(ON_CPU);
}
Test(replicate, shared_module_cuda, .timeout = 60)
{
    shared_module(ON_ONE_GPU);
}
Test(replicate, shared_module_cuda_two_gpus, .timeout = 60)
{
    shared_module(ON_TWO_GPUS);
}

/* test_tensor_sharing: Msm1(Msm()); replica 0 (the original's device) views
 * the original's storage, replica 1 does on the original's device (one GPU)
 * and not elsewhere (another logical CPU device, another GPU). */
static void tensor_sharing(placement_mode mode)
{
    tp_module *module = NULL, *r[2];
    CHECK_OK(wrap("Msm1", fwd_child, "block", make_msm(), &module));
    init(module, 3);
    const tp_device *dev = devices_for(mode, module);
    CHECK_OK(tp_module_replicate(module, dev, 2, r));
    plist o = params_of(module), p0 = params_of(r[0]), p1 = params_of(r[1]);
    cr_assert_eq(o.n, 6);
    cr_assert_eq(p0.n, o.n);
    cr_assert_eq(p1.n, o.n);
    for (int k = 0; k < o.n; k++) {
        cr_assert_neq(p0.t[k], o.t[k], "%s: a tensor of its own (own autograd state)", o.fqn[k]);
        cr_assert(same_dev(tp_tensor_device(p0.t[k]), tp_tensor_device(o.t[k])), "%s", o.fqn[k]);
        cr_assert(tp_tensor_shares_storage(p0.t[k], o.t[k]), "%s", o.fqn[k]);
        cr_assert_eq(tp_tensor_data(p0.t[k]), tp_tensor_data(o.t[k]), "%s", o.fqn[k]);
        cr_assert_eq(tp_tensor_shares_storage(p1.t[k], o.t[k]), shares(dev, 1), "%s", o.fqn[k]);
        cr_assert_eq(tp_tensor_data(p1.t[k]) == tp_tensor_data(o.t[k]), shares(dev, 1), "%s",
                     o.fqn[k]);
        bool eq = false;
        CHECK_OK(tp_tensor_equal(p1.t[k], o.t[k], &eq));
        cr_assert(eq, "%s: the deep copy holds the original's values", o.fqn[k]);
    }
    free_all(r, 2);
    tp_module_free(module);
}

Test(replicate, tensor_sharing_cpu, .timeout = 30)
{
    tensor_sharing(ON_CPU);
}
Test(replicate, tensor_sharing_cuda, .timeout = 60)
{
    tensor_sharing(ON_ONE_GPU);
}
Test(replicate, tensor_sharing_cuda_two_gpus, .timeout = 60)
{
    tensor_sharing(ON_TWO_GPUS);
}

/* test_tensor_sharing_with_forward: after one SGD step on the original,
 * replica 0 computes the original's second forward and replica 1 its
 * first (its second where it shares the original's device). */
static void tensor_sharing_with_forward(placement_mode mode)
{
    tp_module *module = NULL, *r[2];
    CHECK_OK(wrap("Msm1", fwd_child, "block", make_msm(), &module));
    init(module, 4);
    const tp_device *dev = devices_for(mode, module);
    CHECK_OK(tp_module_replicate(module, dev, 2, r));
    tp_tensor *x = NULL, *first = NULL, *second = NULL, *loss = NULL;
    CHECK_OK(tp_tensor_zeros(TP_F32, physical(dev[0]), 2, (int64_t[]){2, 2}, &x));
    CHECK_OK(tp_tensor_fill(x, 1.0));
    /* ones give LayerNorm a zero-variance row; vary the input a little */
    tp_tensor *noise = random_input(5, physical(dev[0])), *xin = NULL;
    CHECK_OK(tp_add(x, noise, &xin));
    CHECK_OK(tp_tensor_set_requires_grad(xin, true));
    CHECK_OK(tp_module_call(module, xin, &first));
    CHECK_OK(tp_sum_all(first, &loss));
    CHECK_OK(tp_backward(loss, NULL));
    CHECK_OK(tp_sgd_step(module, 1.0));
    CHECK_OK(tp_module_call(module, xin, &second));
    double diff = 0;
    CHECK_OK(tp_tensor_max_abs_diff(first, second, &diff));
    cr_assert_gt(diff, 0, "the step changed the output");

    tp_tensor *r0 = NULL, *r1 = NULL, *x1 = on(xin, dev[1]);
    CHECK_OK(tp_module_call(r[0], xin, &r0));
    assert_same_output(r0, second, "replica 0 against the second forward");
    CHECK_OK(tp_module_call(r[1], x1, &r1));
    if (shares(dev, 1)) /* one GPU: replica 1 views the stepped parameters */
        assert_same_output(r1, second, "replica 1 against the second forward");
    else
        assert_same_output(r1, first, "replica 1 against the first forward");
    /* the original's gradients stayed its own */
    plist p0 = params_of(r[0]);
    for (int k = 0; k < p0.n; k++)
        cr_assert_null(tp_tensor_grad(p0.t[k]), "%s", p0.fqn[k]);

    tp_tensor *objs[] = {x, noise, xin, first, second, loss, r0, r1, x1};
    for (size_t i = 0; i < sizeof objs / sizeof *objs; i++)
        tp_tensor_release(objs[i]);
    free_all(r, 2);
    tp_module_free(module);
}

Test(replicate, tensor_sharing_with_forward_cpu, .timeout = 30)
{
    tensor_sharing_with_forward(ON_CPU);
}
Test(replicate, tensor_sharing_with_forward_cuda, .timeout = 60)
{
    tensor_sharing_with_forward(ON_ONE_GPU);
}
Test(replicate, tensor_sharing_with_forward_cuda_two_gpus, .timeout = 60)
{
    tensor_sharing_with_forward(ON_TWO_GPUS);
}

/* ---- beyond the seed ---------------------------------------------------------------- */

/* A backward through replica 0 fills its own gradients, not the original's;
 * a frozen parameter stays frozen in the replicas. */
Test(replicate, replica_gradients_are_their_own, .timeout = 30)
{
    tp_module *module = make_msm(), *r[2];
    init(module, 6);
    tp_tensor *frozen = tp_module_parameter(tp_module_find(module, "m.3"), "bias");
    CHECK_OK(tp_tensor_set_requires_grad(frozen, false));
    CHECK_OK(tp_module_replicate(module, CPU01, 2, r));
    for (int i = 0; i < 2; i++) {
        tp_tensor *x = random_input(7, TP_CPU), *y = NULL, *loss = NULL;
        CHECK_OK(tp_module_call(r[i], x, &y));
        CHECK_OK(tp_sum_all(y, &loss));
        CHECK_OK(tp_backward(loss, NULL));
        plist o = params_of(module), p = params_of(r[i]);
        for (int k = 0; k < o.n; k++) {
            cr_assert_null(tp_tensor_grad(o.t[k]), "replica %d: original's %s", i, o.fqn[k]);
            bool is_frozen = !strcmp(p.fqn[k], "m.3.bias");
            cr_assert_eq(tp_tensor_requires_grad(p.t[k]), !is_frozen, "replica %d: %s", i,
                         p.fqn[k]);
            if (is_frozen)
                cr_assert_null(tp_tensor_grad(p.t[k]), "replica %d: %s", i, p.fqn[k]);
            else
                cr_assert_not_null(tp_tensor_grad(p.t[k]), "replica %d: %s", i, p.fqn[k]);
        }
        tp_tensor_release(x);
        tp_tensor_release(y);
        tp_tensor_release(loss);
    }
    free_all(r, 2);
    tp_module_free(module);
}

/* Freeing the original first leaves the replicas whole: the shared storage
 * is refcounted. */
Test(replicate, original_freed_first, .timeout = 30)
{
    tp_module *module = make_msm(), *r[2];
    init(module, 8);
    tp_tensor *x = random_input(9, TP_CPU), *expected = NULL;
    CHECK_OK(tp_module_call(module, x, &expected));
    CHECK_OK(tp_module_replicate(module, CPU01, 2, r));
    tp_module_free(module);
    for (int i = 0; i < 2; i++) {
        tp_tensor *y = NULL;
        CHECK_OK(tp_module_call(r[i], x, &y));
        assert_same_output(y, expected, "after the original was freed");
        tp_tensor_release(y);
    }
    tp_tensor_release(x);
    tp_tensor_release(expected);
    free_all(r, 2);
}

/* Each rank of tp_run_local runs replicas[rank] (logical CPU device rank)
 * at the same time, forward and backward, at every world size. */
typedef struct {
    tp_module **replicas;
    tp_tensor *x; /* shared, read only */
    tp_tensor *out[TP_TEST_MAX_RANKS];
    tp_test_slot slots[TP_TEST_MAX_RANKS];
} rank_ctx;

static tp_status rank_forward(tp_comm *w, void *arg)
{
    rank_ctx *c = arg;
    int r = tp_comm_rank(w);
    tp_test_slot *s = &c->slots[r];
    RANK_EXPECT(s, same_dev(tp_module_device(c->replicas[r]), (tp_device){TP_DEVICE_CPU, r}),
                "replica %d reports device index %d", r,
                tp_module_device(c->replicas[r]).index);
    for (int it = 0; it < 20; it++) {
        tp_tensor *y = NULL, *loss = NULL;
        RANK_OK(s, tp_module_call(c->replicas[r], c->x, &y));
        RANK_OK(s, tp_sum_all(y, &loss));
        RANK_OK(s, tp_backward(loss, NULL));
        tp_tensor_release(loss);
        tp_tensor_release(c->out[r]);
        c->out[r] = y;
    }
    return TP_OK;
}

Test(replicate, replicas_on_rank_threads, .timeout = 60)
{
    static const int sizes[] = TP_TEST_WORLD_SIZES;
    for (int si = 0; si < TP_TEST_N_WORLD_SIZES; si++) {
        int n = sizes[si];
        tp_module *module = make_msm(), *r[TP_TEST_MAX_RANKS];
        init(module, 10);
        tp_device dev[TP_TEST_MAX_RANKS];
        for (int i = 0; i < n; i++)
            dev[i] = (tp_device){TP_DEVICE_CPU, i};
        CHECK_OK(tp_module_replicate(module, dev, n, r));
        rank_ctx c = {.replicas = r, .x = random_input(12, TP_CPU)};
        tp_tensor *expected = NULL;
        CHECK_OK(tp_module_call(module, c.x, &expected));
        tp_test_run(n, rank_forward, &c, c.slots);
        for (int i = 0; i < n; i++) {
            char what[64];
            snprintf(what, sizeof what, "%d ranks, rank %d", n, i);
            cr_assert_not_null(c.out[i], "%s", what);
            assert_same_output(c.out[i], expected, what);
            tp_tensor_release(c.out[i]);
        }
        tp_tensor_release(c.x);
        tp_tensor_release(expected);
        free_all(r, n);
        tp_module_free(module);
    }
}

/* Names, kinds, configuration, training flag, hooks and custom ctx: hooks
 * run on the replica (with the replica as `m`) sharing the original's ctx,
 * freed once after the last holder; tied weights stay tied. */
typedef struct {
    int calls;
    const tp_module *last;
} hook_ctx;

static tp_status count_hook(tp_module *m, int nargs, tp_tensor *const *args, tp_tensor **out,
                            void *ctx)
{
    (void)nargs, (void)args, (void)out;
    hook_ctx *h = ctx;
    h->calls++;
    h->last = m;
    return TP_OK;
}

static int ctx_frees;
static void ctx_free_count(void *ctx)
{
    (void)ctx;
    ctx_frees++;
}

/* linear(linear(x, w), inner.w2) with w2 the same tensor as w. */
static tp_status fwd_tied(tp_module *self, int nargs, tp_tensor *const *args, int nkw,
                          const tp_kwarg *kw, tp_tensor **out)
{
    (void)nargs, (void)nkw, (void)kw;
    int *tag = tp_module_ctx(self);
    if (!tag || *tag != 42)
        return TP_ERR_STATE;
    tp_tensor *a = NULL;
    TP_TEST_TRY(tp_linear(args[0], tp_module_parameter(self, "w"), NULL, &a));
    tp_status st = tp_linear(a, tp_module_parameter(tp_module_child(self, "inner"), "w2"), NULL,
                             out);
    tp_tensor_release(a);
    return st;
}

static tp_status noop_pre(tp_module *m, int nargs, tp_tensor **args, int nkw, tp_kwarg *kw,
                          void *ctx)
{
    (void)m, (void)nargs, (void)args, (void)nkw, (void)kw, (void)ctx;
    return TP_OK;
}

static void assert_same_tree(const tp_module *a, const tp_module *b)
{
    cr_assert_eq(tp_module_kind_of(a), tp_module_kind_of(b));
    cr_assert_str_eq(tp_module_type_name(a), tp_module_type_name(b));
    cr_assert_str_eq(tp_module_name(a), tp_module_name(b));
    cr_assert_eq(tp_module_is_training(a), tp_module_is_training(b), "%s", tp_module_name(a));
    cr_assert_eq(tp_module_ctx(a), tp_module_ctx(b));
    cr_assert_eq(tp_module_num_children(a), tp_module_num_children(b));
    for (int i = 0; i < tp_module_num_children(a); i++)
        assert_same_tree(tp_module_child_at(a, i, NULL), tp_module_child_at(b, i, NULL));
}

Test(replicate, tree_hooks_ctx_and_tied_weights, .timeout = 30)
{
    static int tag = 42;
    ctx_frees = 0;
    tp_module *module = NULL, *drop = NULL, *inner = NULL, *r[3];
    CHECK_OK(tp_nn_custom_create("Tied", fwd_tied, &tag, ctx_free_count, &module));
    CHECK_OK(tp_nn_dropout_create(0.5, 77, &drop));
    CHECK_OK(tp_module_add_child(module, "drop", drop));
    CHECK_OK(tp_nn_custom_create("Inner", fwd_child, NULL, NULL, &inner));
    CHECK_OK(tp_module_add_child(module, "inner", inner));
    tp_tensor *w = random_input(13, TP_CPU);
    CHECK_OK(tp_module_register_parameter(module, "w", w));
    CHECK_OK(tp_module_register_parameter(module, "absent", NULL));
    CHECK_OK(tp_module_register_parameter(inner, "w2", w)); /* tied */
    hook_ctx h = {0};
    CHECK_OK(tp_module_add_forward_hook(drop, count_hook, &h, NULL, NULL));
    /* advance Dropout's call count: replicas continue from it */
    tp_tensor *x = random_input(14, TP_CPU), *y = NULL;
    CHECK_OK(tp_module_call(drop, x, &y));
    tp_tensor_release(y);
    tp_module_set_training(drop, false);

    tp_device dev[3] = {{TP_DEVICE_CPU, 0}, {TP_DEVICE_CPU, 3}, {TP_DEVICE_CPU, 0}};
    CHECK_OK(tp_module_replicate(module, dev, 3, r));
    tp_module_set_training(drop, true);
    tp_tensor *expected = NULL, *xd = NULL;
    CHECK_OK(tp_module_call(module, x, &expected));
    CHECK_OK(tp_module_call(drop, x, &xd)); /* the original's next mask */
    for (int i = 0; i < 3; i++) {
        tp_module *rd = tp_module_child(r[i], "drop");
        cr_assert(!tp_module_is_training(rd), "replica %d copied evaluation mode", i);
        cr_assert(tp_module_is_training(r[i]), "replica %d copied the root's mode", i);
        tp_module_set_training(r[i], true);
        assert_same_tree(module, r[i]);
        cr_assert(same_dev(tp_module_device(r[i]), dev[i]));
        cr_assert_null(tp_module_parameter(r[i], "absent"));
        tp_tensor *rw = tp_module_parameter(r[i], "w");
        cr_assert_eq(rw, tp_module_parameter(tp_module_child(r[i], "inner"), "w2"),
                     "replica %d: the tied weight is one tensor", i);
        cr_assert_eq(tp_tensor_shares_storage(rw, w), i != 1, "replica %d", i);
        plist rp = params_of(r[i]);
        cr_assert_eq(rp.n, 1, "replica %d: w once (the tied inner.w2 and absent skipped)", i);
        tp_tensor *yr = NULL;
        CHECK_OK(tp_module_call(r[i], x, &yr));
        assert_same_output(yr, expected, "tied forward");
        tp_tensor_release(yr);
        /* Dropout continues from the original's call count: the same mask;
         * the hook runs on the replica's module with the shared ctx */
        h.calls = 0;
        tp_tensor *xr = NULL;
        CHECK_OK(tp_module_call(rd, x, &xr));
        cr_assert_eq(h.calls, 1, "replica %d: the hook ran", i);
        cr_assert_eq(h.last, rd, "replica %d: the hook saw the replica's module", i);
        assert_same_output(xr, xd, "dropout mask");
        tp_tensor_release(xr);
    }
    free_all(r, 3);
    cr_assert_eq(ctx_frees, 0, "the original still holds the shared ctx");
    tp_module_free(module);
    cr_assert_eq(ctx_frees, 1);
    tp_tensor_release(w);
    tp_tensor_release(x);
    tp_tensor_release(expected);
    tp_tensor_release(xd);
}

/* Handles over one storage region are one parameter (tp/nn.h), as for
 * tp_module_to: a replica keeps them handles over one storage (its copy's on
 * another device), and a handle registered twice stays one tensor. */
Test(replicate, aliasing_handles_stay_one_parameter, .timeout = 30)
{
    tp_module *module = NULL, *inner = NULL, *r[2];
    CHECK_OK(tp_nn_custom_create("Tied", fwd_tied, NULL, NULL, &module));
    CHECK_OK(tp_nn_custom_create("Inner", fwd_child, NULL, NULL, &inner));
    CHECK_OK(tp_module_add_child(module, "inner", inner));
    tp_tensor *w = random_input(21, TP_CPU), *v = NULL;
    CHECK_OK(tp_tensor_view(w, 2, (int64_t[]){2, 2}, &v)); /* a second handle */
    CHECK_OK(tp_module_register_parameter(module, "w", w));
    CHECK_OK(tp_module_register_parameter(module, "v", v));
    CHECK_OK(tp_module_register_parameter(inner, "v2", v)); /* v tied */
    tp_device dev[2] = {{TP_DEVICE_CPU, 0}, {TP_DEVICE_CPU, 1}};
    CHECK_OK(tp_module_replicate(module, dev, 2, r));
    for (int i = 0; i < 2; i++) {
        tp_tensor *rw = tp_module_parameter(r[i], "w"), *rv = tp_module_parameter(r[i], "v");
        cr_assert(rw && rv && rw != rv, "replica %d: two handles", i);
        cr_assert_eq(rv, tp_module_parameter(tp_module_child(r[i], "inner"), "v2"),
                     "replica %d: the tied handle is one tensor", i);
        cr_assert(tp_tensor_shares_storage(rw, rv), "replica %d: the handles of one parameter "
                  "were copied apart", i);
        cr_assert_eq(tp_tensor_data(rw), tp_tensor_data(rv), "replica %d", i);
        cr_assert_eq(tp_tensor_shares_storage(rw, w), i == 0, "replica %d", i);
        cr_assert(tp_tensor_requires_grad(rv), "replica %d", i);
    }
    free_all(r, 2);
    tp_module_free(module);
    tp_tensor_release(v);
    tp_tensor_release(w);
}

/* tp_module_device: NULL, fresh modules, parameterless replicas. */
/* The original and its replicas share the custom ctx and the hooks' ctx:
 * each ctx_free runs once, after the last of them is freed, in any order;
 * a replica removes its own copy of a hook by the original's handle. */
typedef struct {
    int tag; /* 42 while alive */
    int calls;
} heap_ctx;

static int heap_frees;
static void heap_ctx_free(void *ctx)
{
    ((heap_ctx *)ctx)->tag = 0;
    free(ctx);
    heap_frees++;
}

static tp_status fwd_heap(tp_module *self, int nargs, tp_tensor *const *args, int nkw,
                          const tp_kwarg *kw, tp_tensor **out)
{
    (void)nargs, (void)nkw, (void)kw;
    heap_ctx *c = tp_module_ctx(self);
    if (!c || c->tag != 42)
        return TP_ERR_STATE;
    c->calls++;
    *out = tp_tensor_retain(args[0]);
    return TP_OK;
}

static tp_status heap_hook(tp_module *m, int nargs, tp_tensor *const *args, tp_tensor **out,
                           void *ctx)
{
    (void)m, (void)nargs, (void)args, (void)out;
    heap_ctx *c = ctx;
    if (c->tag != 42)
        return TP_ERR_STATE;
    c->calls++;
    return TP_OK;
}

static heap_ctx *heap_new(void)
{
    heap_ctx *c = calloc(1, sizeof *c);
    cr_assert_not_null(c);
    c->tag = 42;
    return c;
}

Test(replicate, shared_ctx_freed_after_the_last_holder, .timeout = 30)
{
    heap_frees = 0;
    heap_ctx *mc = heap_new(), *hc = heap_new();
    tp_module *module = NULL, *r[2];
    int h = 0;
    CHECK_OK(tp_nn_custom_create("Heap", fwd_heap, mc, heap_ctx_free, &module));
    CHECK_OK(tp_module_add_forward_hook(module, heap_hook, hc, heap_ctx_free, &h));
    CHECK_OK(tp_module_replicate(module, CPU01, 2, r));
    tp_module_free(module);
    cr_assert_eq(heap_frees, 0, "the original's free took the replicas' ctx");
    tp_tensor *x = random_input(3, TP_CPU), *y = NULL;
    for (int i = 0; i < 2; i++) {
        CHECK_OK(tp_module_call(r[i], x, &y));
        tp_tensor_release(y);
    }
    cr_assert_eq(mc->calls, 2);
    cr_assert_eq(hc->calls, 2);
    tp_module_remove_hook(r[0], h); /* r[1] still holds the hook */
    cr_assert_eq(heap_frees, 0);
    CHECK_OK(tp_module_call(r[0], x, &y));
    tp_tensor_release(y);
    cr_assert_eq(hc->calls, 2, "the hook removed from r[0] ran");
    CHECK_OK(tp_module_call(r[1], x, &y));
    tp_tensor_release(y);
    cr_assert_eq(hc->calls, 3);
    tp_module_free(r[1]);
    cr_assert_eq(heap_frees, 1, "the hook's ctx goes with its last holder");
    tp_module_free(r[0]);
    cr_assert_eq(heap_frees, 2, "the module's ctx goes with the last replica");
    tp_tensor_release(x);
}

Test(replicate, module_device, .timeout = 10)
{
    tp_device d = tp_module_device(NULL);
    cr_assert(d.type == TP_DEVICE_CPU && d.index == -1);
    tp_module *relu = NULL, *lin = NULL, *r[2];
    CHECK_OK(tp_nn_relu_create(&relu));
    CHECK_OK(tp_nn_linear_create(2, 3, true, &lin));
    cr_assert(same_dev(tp_module_device(relu), TP_CPU));
    cr_assert(same_dev(tp_module_device(lin), TP_CPU));
    tp_device dev[2] = {{TP_DEVICE_CPU, 5}, {TP_DEVICE_CPU, 2}};
    CHECK_OK(tp_module_replicate(relu, dev, 2, r));
    cr_assert(same_dev(tp_module_device(r[0]), dev[0]));
    cr_assert(same_dev(tp_module_device(r[1]), dev[1]));
    /* a replica of a replica: its own device is the source */
    tp_module *rep = NULL, *rr[2];
    tp_device back[2] = {{TP_DEVICE_CPU, 2}, {TP_DEVICE_CPU, 0}};
    CHECK_OK(tp_module_replicate(lin, &dev[1], 1, &rep));
    cr_assert(same_dev(tp_module_device(rep), dev[1]));
    CHECK_OK(tp_module_replicate(rep, back, 2, rr));
    tp_tensor *w = tp_module_parameter(rep, "weight");
    cr_assert(tp_tensor_shares_storage(tp_module_parameter(rr[0], "weight"), w));
    cr_assert(!tp_tensor_shares_storage(tp_module_parameter(rr[1], "weight"), w));
    cr_assert(!tp_tensor_shares_storage(w, tp_module_parameter(lin, "weight")));
    free_all(rr, 2);
    free_all(r, 2);
    tp_module_free(rep);
    tp_module_free(relu);
    tp_module_free(lin);
}

/* A CPU module replicated to a GPU and a logical CPU device, where a GPU
 * exists. */
Test(replicate, mixed_cpu_and_cuda, .timeout = 60)
{
    if (tp_cuda_device_count() < 1)
        cr_skip_test("no CUDA device: mixed CPU/CUDA replication needs one");
    tp_module *module = make_msm(), *r[3];
    init(module, 15);
    tp_device dev[3] = {TP_CUDA(0), {TP_DEVICE_CPU, 1}, {TP_DEVICE_CPU, 0}};
    CHECK_OK(tp_module_replicate(module, dev, 3, r));
    check_replicas(module, r, dev, 3);
    plist o = params_of(module), p2 = params_of(r[2]);
    for (int k = 0; k < o.n; k++)
        cr_assert(tp_tensor_shares_storage(o.t[k], p2.t[k]));
    free_all(r, 3);
    tp_module_free(module);
}

/* ---- errors ------------------------------------------------------------------------- */

#define POISON ((tp_module *)&poison_)
static int poison_;

static void poison(tp_module **r, int n)
{
    for (int i = 0; i < n; i++)
        r[i] = POISON;
}

static void assert_cleared(tp_module **r, int n)
{
    for (int i = 0; i < n; i++)
        cr_assert_null(r[i], "replicas[%d] left set", i);
}

#define CHECK_REP_ERR(module, dev, n, code, text)                               \
    do {                                                                        \
        poison(r, 3);                                                           \
        CHECK_ERR(tp_module_replicate((module), (dev), (n), r), (code));        \
        cr_assert(strstr(tp_last_error(), (text)), "message: %s", tp_last_error()); \
        assert_cleared(r, (n) > 0 ? (n) : 0);                                   \
    } while (0)

Test(replicate, errors, .timeout = 30)
{
    tp_module *module = make_msm(), *r[3];
    init(module, 16);
    CHECK_ERR(tp_module_replicate(module, CPU01, 2, NULL), TP_ERR_INVALID_ARG);
    CHECK_REP_ERR(NULL, CPU01, 2, TP_ERR_INVALID_ARG, "module is NULL");
    CHECK_REP_ERR(module, NULL, 2, TP_ERR_INVALID_ARG, "devices is NULL");
    CHECK_REP_ERR(module, CPU01, 0, TP_ERR_INVALID_ARG, "n is 0");
    CHECK_REP_ERR(module, CPU01, -1, TP_ERR_INVALID_ARG, "n is -1");
    tp_device neg[2] = {{TP_DEVICE_CPU, 0}, {TP_DEVICE_CPU, -1}};
    CHECK_REP_ERR(module, neg, 2, TP_ERR_INVALID_ARG, "devices[1] is cpu:-1");
    tp_device negc[2] = {{TP_DEVICE_CPU, 0}, {TP_DEVICE_CUDA, -2}};
    CHECK_REP_ERR(module, negc, 2, TP_ERR_INVALID_ARG, "negative index");
    tp_device bad[1] = {{(tp_device_type)7, 0}};
    CHECK_REP_ERR(module, bad, 1, TP_ERR_INVALID_ARG, "unknown device type 7");
    int count = tp_cuda_device_count();
    tp_device cuda[3] = {{TP_DEVICE_CPU, 0}, {TP_DEVICE_CPU, 1}, TP_CUDA(count)};
    if (count == 0)
        CHECK_REP_ERR(module, cuda, 3, TP_ERR_NOT_SUPPORTED, "devices[2] is cuda:0");
    else
        CHECK_REP_ERR(module, cuda, 3, TP_ERR_INVALID_ARG, "CUDA devices");
    CHECK_REP_ERR(tp_module_find(module, "m.0"), CPU01, 2, TP_ERR_INVALID_ARG,
                  "replicate the root");
    /* the module is untouched and still replicates */
    CHECK_OK(tp_module_replicate(module, CPU01, 2, r));
    free_all(r, 2);
    tp_module_free(module);
}

/* A tensor-parallel module (DTensor parameters) is refused. */
typedef struct {
    tp_test_slot slots[1];
} dt_ctx;

static tp_status rank_dtensor(tp_comm *w, void *arg)
{
    dt_ctx *c = arg;
    tp_test_slot *s = &c->slots[0];
    tp_mesh *mesh = NULL;
    tp_module *lin = NULL, *r[2] = {POISON, POISON};
    tp_tensor *dt = NULL;
    RANK_OK(s, tp_mesh_create(w, 1, (int64_t[]){1}, NULL, &mesh));
    RANK_OK(s, tp_nn_linear_create(2, 2, true, &lin));
    tp_placement p = tp_shard(0);
    RANK_OK(s, tp_dtensor_from_local(mesh, tp_module_parameter(lin, "bias"), 1, &p, NULL, &dt));
    RANK_OK(s, tp_module_set_parameter(lin, "bias", dt));
    tp_status st = tp_module_replicate(lin, CPU01, 2, r);
    RANK_EXPECT(s, st == TP_ERR_NOT_SUPPORTED, "replicate -> %s", tp_status_name(st));
    RANK_EXPECT(s, strstr(tp_last_error(), "parameter 'bias' is a DTensor"), "message: %s",
                tp_last_error());
    RANK_EXPECT(s, !r[0] && !r[1], "replicas left set");
    tp_tensor_release(dt);
    tp_module_free(lin);
    tp_mesh_free(mesh);
    return TP_OK;
}

Test(replicate, tensor_parallel_module_refused, .timeout = 30)
{
    dt_ctx c = {0};
    tp_test_run(1, rank_dtensor, &c, c.slots);
}

/* ---- allocation failures -------------------------------------------------------------- */

static tp_test_alloc A;

static void rep_alloc_install(void)
{
    tp_allocator a = {tp_test_alloc_fn, tp_test_free_fn, &A};
    A = (tp_test_alloc){0, 0, -1};
    cr_assert_eq(tp_set_allocator(&a), TP_OK);
}

static void rep_alloc_restore(void) { tp_set_allocator(NULL); }

/* Every allocation of tp_module_replicate fails in turn: TP_ERR_NO_MEMORY,
 * no replica, nothing leaked; the original stays usable. */
Test(replicate, allocation_failures, .init = rep_alloc_install, .fini = rep_alloc_restore,
     .timeout = 60)
{
    tp_module *module = NULL, *r[3];
    CHECK_OK(wrap("Mpy1", fwd_child, "m", make_msm(), &module));
    init(module, 17);
    /* a tied weight exercises the memo */
    tp_tensor *w = tp_module_parameter(tp_module_find(module, "m.m.0"), "weight");
    tp_module *tied = NULL;
    CHECK_OK(tp_nn_custom_create("Tied", fwd_child, NULL, NULL, &tied));
    CHECK_OK(tp_module_register_parameter(tied, "w", w));
    CHECK_OK(tp_module_add_child(module, "tied", tied));
    static hook_ctx h;
    CHECK_OK(tp_module_add_forward_hook(tied, count_hook, &h, NULL, NULL));
    CHECK_OK(tp_module_add_forward_pre_hook(module, noop_pre, NULL, NULL, NULL));
    tp_device dev[3] = {{TP_DEVICE_CPU, 0}, {TP_DEVICE_CPU, 1}, {TP_DEVICE_CPU, 0}};
    long base = A.live, k = 0;
    for (;; k++) {
        A.count = 0;
        A.fail_at = k;
        tp_clear_error();
        poison(r, 3);
        tp_status st = tp_module_replicate(module, dev, 3, r);
        A.fail_at = -1;
        if (st == TP_OK) {
            cr_assert_leq(A.count, k, "succeeded although allocation %ld failed", k);
            break;
        }
        cr_assert_eq(st, TP_ERR_NO_MEMORY, "allocation %ld failing: %s (%s)", k,
                     tp_status_name(st), tp_last_error());
        cr_assert(strstr(tp_last_error(), "out of memory"), "allocation %ld: %s", k,
                  tp_last_error());
        cr_assert(strstr(tp_last_error(), "tp_module_replicate"), "allocation %ld: %s", k,
                  tp_last_error());
        assert_cleared(r, 3);
        cr_assert_eq(A.live, base, "allocation %ld failing leaked %ld", k, A.live - base);
    }
    cr_assert_gt(k, 30, "the replication allocates (%ld)", k);
    check_replicas(module, r, dev, 3);
    free_all(r, 3);
    tp_module_free(module);
    cr_assert_eq(A.live, 0, "leaked %ld", A.live);
}
