/* Free order: whatever holds a mesh, a communicator or a module hook's
 * context keeps it alive, so every teardown order is safe:
 *
 *   - a parallelized MLP whose mesh was freed right after
 *     tp_parallelize_module still trains (forward, backward, SGD) and equals
 *     the plain MLP, with the expected collectives;
 *   - DTensors outlive their rank thread, its mesh and its world, and are used
 *     and released on another thread (the last release frees the mesh there);
 *     concurrent releases on two threads;
 *   - every permutation of freeing {mesh, slice, parent mesh, module, DTensor},
 *     using what is left after each step;
 *   - tp_comm_free with work outstanding is TP_ERR_STATE (shm and a user
 *     backend) and the communicator stays usable; a work handle outlives the
 *     mesh that owned its communicator;
 *   - a DDP outlives its communicator and its module, in either order.
 *
 * Every test frees through a scribbling allocator (a freed block is
 * overwritten before it goes back to malloc), so a use after free reads
 * garbage and fails even without AddressSanitizer. */
#include <malloc.h>
#include <pthread.h>
#include <stdatomic.h>

#include "tp_test.h"

#define RTOL 1e-4
#define ATOL 1e-5

/* ---- the scribbling allocator ----------------------------------------------- */

static void *scribble_alloc(void *ctx, size_t size, size_t alignment)
{
    (void)ctx;
    if (alignment < sizeof(void *))
        alignment = sizeof(void *);
    size_t rounded = (size + alignment - 1) / alignment * alignment;
    return aligned_alloc(alignment, rounded ? rounded : alignment);
}

/* Blocks from the default allocator come from aligned_alloc too, so either
 * allocator may free the other's. */
static void scribble_free(void *ctx, void *p)
{
    (void)ctx;
    memset(p, 0xa5, malloc_usable_size(p));
    free(p);
}

static void scribble_on(void)
{
    tp_allocator a = {scribble_alloc, scribble_free, NULL};
    cr_assert_eq(tp_set_allocator(&a), TP_OK);
}

static void scribble_off(void) { (void)tp_set_allocator(NULL); }

/* ---- helpers ------------------------------------------------------------------ */

typedef struct {
    int w;
    tp_test_slot slot[TP_TEST_MAX_RANKS];
    /* dtensors_outlive_their_thread: what each rank leaves behind */
    tp_tensor *left[TP_TEST_MAX_RANKS][2];
} lt_ctx;

#define SLOT(c, world) (&(c)->slot[tp_comm_rank(world)])

static tp_status rand_t(int nd, const int64_t *shape, uint64_t seed, tp_tensor **t)
{
    TP_TEST_TRY(tp_tensor_zeros(TP_F32, TP_CPU, nd, shape, t));
    return tp_tensor_fill_random(*t, TP_RNG_UNIFORM, -1, 1, seed, NULL, NULL);
}

static bool close_to(const tp_tensor *a, const tp_tensor *b)
{
    bool ok = false;
    return tp_tensor_allclose(a, b, RTOL, ATOL, &ok) == TP_OK && ok;
}

static bool equal_to(const tp_tensor *a, const tp_tensor *b)
{
    bool ok = false;
    return tp_tensor_equal(a, b, &ok) == TP_OK && ok;
}

static tp_status add_child(tp_module *parent, const char *name, tp_status made,
                           tp_module *child)
{
    if (made != TP_OK)
        return made;
    tp_status st = tp_module_add_child(parent, name, child);
    if (st != TP_OK)
        tp_module_free(child);
    return st;
}

/* Sequential(net1 = Linear(10, 16), relu, net2 = Linear(16, 10)), the same
 * values at every parallel degree; with a mesh, net1 Colwise and net2
 * Rowwise on it (DESIGN.md's MLP). */
static tp_status mlp_new(tp_mesh *mesh, tp_module **out)
{
    tp_module *m = NULL, *c = NULL;
    TP_TEST_TRY(tp_nn_sequential_create(&m));
    tp_status st = tp_nn_linear_create(10, 16, true, &c);
    st = add_child(m, "net1", st, c);
    if (st == TP_OK) {
        st = tp_nn_relu_create(&c);
        st = add_child(m, "relu", st, c);
    }
    if (st == TP_OK) {
        st = tp_nn_linear_create(16, 10, true, &c);
        st = add_child(m, "net2", st, c);
    }
    if (st == TP_OK)
        st = tp_module_init(m, 5);
    if (st == TP_OK && mesh) {
        tp_style *cs = NULL, *rs = NULL;
        st = tp_colwise_parallel_create(NULL, &cs);
        if (st == TP_OK)
            st = tp_rowwise_parallel_create(NULL, &rs);
        if (st == TP_OK) {
            tp_plan_entry plan[2] = {{"net1", cs}, {"net2", rs}};
            st = tp_parallelize_module(m, mesh, 2, plan, NULL);
        }
        tp_style_free(cs);
        tp_style_free(rs);
    }
    if (st != TP_OK) {
        tp_module_free(m);
        return st;
    }
    *out = m;
    return TP_OK;
}

/* y = m(x); then, when backward, sum(y) backward. */
static tp_status forward_backward(tp_module *m, tp_tensor *x, bool backward, tp_tensor **y)
{
    TP_TEST_TRY(tp_module_call(m, x, y));
    if (!backward)
        return TP_OK;
    tp_tensor *loss = NULL;
    tp_status st = tp_sum_all(*y, &loss);
    if (st == TP_OK)
        st = tp_backward(loss, NULL);
    tp_tensor_release(loss);
    return st;
}

/* One training step, then the output of the stepped module: y0 = m(x)
 * before, y1 = m(x) after sum(m(x)) backward and SGD(lr 0.1). */
static tp_status train_step(tp_module *m, tp_tensor *x, tp_tensor **y0, tp_tensor **y1)
{
    TP_TEST_TRY(forward_backward(m, x, true, y0));
    TP_TEST_TRY(tp_sgd_step(m, 0.1));
    tp_module_zero_grad(m);
    return tp_module_call(m, x, y1);
}

/* ---- a mesh freed right after tp_parallelize_module ---------------------------- */

static tp_status mesh_first_body(tp_comm *world, void *arg)
{
    lt_ctx *c = arg;
    tp_test_slot *s = SLOT(c, world);
    int w = c->w;
    int64_t n = w;
    tp_mesh *mesh = NULL;
    tp_module *m = NULL, *ref = NULL;
    tp_tensor *x = NULL, *y0 = NULL, *y1 = NULL, *r0 = NULL, *r1 = NULL, *full = NULL;
    tp_comm_debug *dbg = NULL;
    RANK_OK(s, tp_mesh_create(world, 1, &n, (const char *[]){"tp"}, &mesh));
    RANK_OK(s, mlp_new(mesh, &m));
    tp_mesh_free(mesh); /* the module's hooks and DTensor parameters hold it */
    mesh = NULL;

    RANK_OK(s, rand_t(2, (int64_t[]){8, 10}, 7, &x));
    RANK_OK(s, tp_comm_debug_create(&dbg));
    RANK_OK(s, tp_comm_debug_begin(dbg));
    tp_status st = train_step(m, x, &y0, &y1);
    tp_status e = tp_comm_debug_end(dbg);
    RANK_OK(s, st);
    RANK_OK(s, e);
    /* first forward + backward: one all_reduce (Rowwise); the SGD step and
     * the second forward: one more all_reduce */
    RANK_EXPECT(s, tp_comm_debug_count(dbg, TP_COLL_ALL_REDUCE) == (w > 1 ? 2 : 0) &&
                       tp_comm_debug_total(dbg) == (w > 1 ? 2 : 0),
                "W=%d: %lld collectives (%lld all_reduce), expected %d all_reduces", w,
                (long long)tp_comm_debug_total(dbg),
                (long long)tp_comm_debug_count(dbg, TP_COLL_ALL_REDUCE), w > 1 ? 2 : 0);

    RANK_OK(s, mlp_new(NULL, &ref));
    RANK_OK(s, train_step(ref, x, &r0, &r1));
    RANK_EXPECT(s, close_to(y0, r0), "W=%d: output differs from the plain MLP", w);
    RANK_EXPECT(s, close_to(y1, r1), "W=%d: output after the SGD step differs", w);

    /* a parameter outlives the module; the mesh still works through it */
    tp_tensor *w1 = tp_tensor_retain(tp_module_parameter(tp_module_child(m, "net1"), "weight"));
    tp_module_free(m);
    RANK_EXPECT(s, tp_tensor_is_dtensor(w1), "net1.weight is not a DTensor");
    RANK_OK(s, tp_dtensor_full_tensor(w1, &full));
    RANK_EXPECT(s, close_to(full, tp_module_parameter(tp_module_child(ref, "net1"), "weight")),
                "W=%d: net1.weight gathered after everything else was freed differs", w);
    RANK_EXPECT(s, tp_mesh_numel(tp_dtensor_mesh(w1)) == w, "the mesh of net1.weight is gone");
    tp_tensor_release(w1); /* the last reference on the mesh */

    tp_tensor *ts[] = {x, y0, y1, r0, r1, full};
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++)
        tp_tensor_release(ts[i]);
    tp_module_free(ref);
    tp_comm_debug_free(dbg);
    return TP_OK;
}

ParameterizedTestParameters(lifetime, mesh_freed_first)
{
    static int sizes[] = {1, 2, 3, 4, 8};
    return cr_make_param_array(int, sizes, sizeof sizes / sizeof sizes[0]);
}

ParameterizedTest(int *n, lifetime, mesh_freed_first, .timeout = 60)
{
    lt_ctx c = {.w = *n};
    scribble_on();
    tp_test_run(*n, mesh_first_body, &c, c.slot);
    scribble_off();
}

/* ---- DTensors on other threads -------------------------------------------------- */

enum { NCONC = 64 };

typedef struct {
    tp_tensor **t;
    int n;
} releaser;

static void *release_evens(void *p)
{
    releaser *r = p;
    for (int i = 0; i < r->n; i += 2)
        tp_tensor_release(r->t[i]);
    return NULL;
}

/* The full tensor every rank holds: 8 x 6, from the global index. */
static tp_status full_8x6(tp_tensor **t)
{
    return rand_t(2, (int64_t[]){8, 6}, 99, t);
}

static tp_status threads_body(tp_comm *world, void *arg)
{
    lt_ctx *c = arg;
    tp_test_slot *s = SLOT(c, world);
    int r = tp_comm_rank(world);
    /* (1, W): dim "dp" is a split of its own (for W > 1), "tp" is the world */
    tp_mesh *mesh = NULL;
    tp_tensor *full = NULL, *conc[NCONC] = {0};
    RANK_OK(s, tp_mesh_create(world, 2, (int64_t[]){1, c->w}, (const char *[]){"dp", "tp"},
                              &mesh));
    RANK_OK(s, full_8x6(&full));
    const tp_placement shard[2] = {tp_replicate(), tp_shard(0)};
    const tp_placement rep[2] = {tp_replicate(), tp_replicate()};
    for (int i = 0; i < NCONC; i++)
        RANK_OK(s, tp_dtensor_distribute(mesh, full, 2, i % 3 ? shard : rep, -1, &conc[i]));
    /* releases on two threads at once, the mesh's own among them */
    pthread_t th;
    releaser rel = {conc, NCONC};
    RANK_EXPECT(s, pthread_create(&th, NULL, release_evens, &rel) == 0, "pthread_create");
    for (int i = 1; i < NCONC; i += 2)
        tp_tensor_release(conc[i]);
    RANK_OK(s, tp_dtensor_distribute(mesh, full, 2, shard, -1, &c->left[r][0]));
    RANK_OK(s, tp_dtensor_distribute(mesh, full, 2, rep, -1, &c->left[r][1]));
    tp_mesh_free(mesh);
    pthread_join(th, NULL);
    tp_tensor_release(full);
    /* left[r] outlives this thread, its mesh reference and its world */
    return TP_OK;
}

static void check_left_behind(lt_ctx *c, int r)
{
    tp_tensor *a = c->left[r][0], *b = c->left[r][1], *bs = NULL, *sum = NULL, *twice = NULL;
    tp_mesh *mesh = tp_dtensor_mesh(a);
    cr_assert_eq(tp_dtensor_mesh(b), mesh);
    cr_assert_eq(tp_mesh_ndim(mesh), 2);
    cr_assert_eq(tp_mesh_numel(mesh), c->w);
    cr_assert_eq(tp_mesh_coord(mesh, 1), r);
    cr_assert_str_eq(tp_mesh_dim_name(mesh, 1), "tp");
    /* R -> S(0) is a local chunk: no communication, on this thread */
    const tp_placement shard[2] = {tp_replicate(), tp_shard(0)};
    CHECK_OK(tp_dtensor_redistribute(b, 2, shard, &bs));
    cr_assert(equal_to(tp_dtensor_local(bs), tp_dtensor_local(a)), "rank %d: shards differ", r);
    CHECK_OK(tp_add(a, bs, &sum));
    CHECK_OK(tp_scale(tp_dtensor_local(a), 2.0, &twice));
    cr_assert(equal_to(tp_dtensor_local(sum), twice), "rank %d: a + a is not 2a", r);
    tp_tensor_release(twice);
    tp_tensor_release(sum);
    tp_tensor_release(bs);
    tp_tensor_release(b);
    tp_tensor_release(a); /* the last reference: frees the mesh and the world here */
    c->left[r][0] = c->left[r][1] = NULL;
}

ParameterizedTestParameters(lifetime, dtensors_outlive_their_thread)
{
    static int sizes[] = {1, 2, 3, 4};
    return cr_make_param_array(int, sizes, sizeof sizes / sizeof sizes[0]);
}

ParameterizedTest(int *n, lifetime, dtensors_outlive_their_thread, .timeout = 60)
{
    lt_ctx c = {.w = *n};
    scribble_on();
    tp_test_run(*n, threads_body, &c, c.slot);
    for (int r = 0; r < *n; r++)
        if (tp_test_rank_is_local(r))
            check_left_behind(&c, r);
    scribble_off();
}

/* ---- every free order ------------------------------------------------------------ */

enum { O_MESH, O_SLICE, O_PARENT, O_MODULE, O_DTENSOR, O_COUNT };
static const char *const o_names[O_COUNT] = {"mesh", "slice", "parent mesh", "module",
                                             "dtensor"};

/* The module is parallelized on `mesh` (1-D, the world); the DTensor lives
 * on `slice`, the "tp" slice of `parent` (2-D). */
typedef struct {
    int w, pa, pb; /* parent shape */
    tp_mesh *mesh, *parent, *slice;
    tp_module *module;
    tp_tensor *dt;
    tp_tensor *x, *y_ref, *full; /* plain, kept for the checks */
} setup;

static tp_status setup_make(tp_comm *world, setup *o)
{
    int64_t n = o->w;
    TP_TEST_TRY(tp_mesh_create(world, 1, &n, (const char *[]){"world"}, &o->mesh));
    TP_TEST_TRY(tp_mesh_create(world, 2, (int64_t[]){o->pa, o->pb},
                               (const char *[]){"dp", "tp"}, &o->parent));
    TP_TEST_TRY(tp_mesh_slice(o->parent, 1, (const char *[]){"tp"}, &o->slice));
    TP_TEST_TRY(mlp_new(o->mesh, &o->module));
    const tp_placement s0 = tp_shard(0);
    return tp_dtensor_distribute(o->slice, o->full, 1, &s0, -1, &o->dt);
}

static void setup_free_one(setup *o, int which)
{
    switch (which) {
    case O_MESH: tp_mesh_free(o->mesh); o->mesh = NULL; break;
    case O_SLICE: tp_mesh_free(o->slice); o->slice = NULL; break;
    case O_PARENT: tp_mesh_free(o->parent); o->parent = NULL; break;
    case O_MODULE: tp_module_free(o->module); o->module = NULL; break;
    default: tp_tensor_release(o->dt); o->dt = NULL; break;
    }
}

/* Uses everything still alive (collectives included: every rank frees in
 * the same order); returns false with the reason in msg. */
static bool setup_use(setup *o, char *msg, size_t len)
{
    if (o->module) {
        tp_tensor *y = NULL;
        tp_status st = forward_backward(o->module, o->x, true, &y);
        bool ok = st == TP_OK && close_to(y, o->y_ref);
        tp_tensor_release(y);
        if (!ok) {
            snprintf(msg, len, "module forward/backward: %s (%s)", tp_status_name(st),
                     tp_last_error());
            return false;
        }
    }
    if (o->dt) {
        tp_tensor *f = NULL;
        tp_status st = tp_dtensor_full_tensor(o->dt, &f); /* all_gather on the slice */
        bool ok = st == TP_OK && equal_to(f, o->full) &&
                  tp_mesh_size(tp_dtensor_mesh(o->dt), 0) == o->pb;
        tp_tensor_release(f);
        if (!ok) {
            snprintf(msg, len, "dtensor full_tensor: %s (%s)", tp_status_name(st),
                     tp_last_error());
            return false;
        }
    }
    if (o->slice && (tp_mesh_ndim(o->slice) != 1 || tp_mesh_size(o->slice, 0) != o->pb ||
                     strcmp(tp_mesh_dim_name(o->slice, 0), "tp") != 0)) {
        snprintf(msg, len, "the slice's geometry changed");
        return false;
    }
    if (o->parent) {
        tp_mesh *dp = NULL;
        tp_status st = tp_mesh_slice(o->parent, 1, (const char *[]){"dp"}, &dp);
        bool ok = st == TP_OK && tp_mesh_size(dp, 0) == o->pa;
        tp_mesh_free(dp);
        if (!ok) {
            snprintf(msg, len, "slicing the parent: %s (%s)", tp_status_name(st),
                     tp_last_error());
            return false;
        }
    }
    if (o->mesh && (tp_mesh_numel(o->mesh) != o->w ||
                    tp_barrier(tp_mesh_group(o->mesh), NULL) != TP_OK)) {
        snprintf(msg, len, "the mesh: %s", tp_last_error());
        return false;
    }
    return true;
}

/* Next permutation in lexicographic order; false after the last. */
static bool next_perm(int *a, int n)
{
    int i = n - 2;
    while (i >= 0 && a[i] >= a[i + 1])
        i--;
    if (i < 0)
        return false;
    int j = n - 1;
    while (a[j] <= a[i])
        j--;
    int t = a[i];
    a[i] = a[j];
    a[j] = t;
    for (int l = i + 1, r = n - 1; l < r; l++, r--) {
        t = a[l];
        a[l] = a[r];
        a[r] = t;
    }
    return true;
}

static tp_status orders_body(tp_comm *world, void *arg)
{
    lt_ctx *c = arg;
    tp_test_slot *s = SLOT(c, world);
    setup base = {.w = c->w, .pa = c->w % 2 == 0 ? c->w / 2 : 1};
    base.pb = c->w / base.pa;
    tp_module *ref = NULL;
    RANK_OK(s, rand_t(2, (int64_t[]){8, 10}, 7, &base.x));
    RANK_OK(s, full_8x6(&base.full));
    RANK_OK(s, mlp_new(NULL, &ref));
    RANK_OK(s, tp_module_call(ref, base.x, &base.y_ref));
    tp_module_free(ref);

    int perm[O_COUNT] = {0, 1, 2, 3, 4}, count = 0;
    do {
        setup o = base;
        tp_status st = setup_make(world, &o);
        char msg[400] = "";
        for (int k = 0; k < O_COUNT && st == TP_OK; k++) {
            setup_free_one(&o, perm[k]);
            if (!setup_use(&o, msg, sizeof msg))
                st = TP_ERR_MISMATCH;
        }
        if (st != TP_OK) {
            char order[128] = "";
            for (int k = 0; k < O_COUNT; k++)
                snprintf(order + strlen(order), sizeof order - strlen(order), "%s%s",
                         k ? ", " : "", o_names[perm[k]]);
            RANK_EXPECT(s, 0, "W=%d, freeing %s: %s", c->w, order,
                        msg[0] ? msg : tp_last_error());
            for (int k = 0; k < O_COUNT; k++)
                setup_free_one(&o, k);
            break;
        }
        count++;
    } while (next_perm(perm, O_COUNT));
    RANK_EXPECT(s, s->failed || count == 120, "%d orders ran, expected 120", count);
    tp_tensor_release(base.x);
    tp_tensor_release(base.full);
    tp_tensor_release(base.y_ref);
    return TP_OK;
}

ParameterizedTestParameters(lifetime, every_free_order)
{
    static int sizes[] = {1, 2, 3, 4};
    return cr_make_param_array(int, sizes, sizeof sizes / sizeof sizes[0]);
}

ParameterizedTest(int *n, lifetime, every_free_order, .timeout = 300)
{
    lt_ctx c = {.w = *n};
    scribble_on();
    tp_test_run(*n, orders_body, &c, c.slot);
    scribble_off();
}

/* ---- tp_comm_free with work outstanding ----------------------------------------- */

static bool last_error_has(const char *needle) { return strstr(tp_last_error(), needle); }

static tp_status comm_free_body(tp_comm *world, void *arg)
{
    lt_ctx *c = arg;
    tp_test_slot *s = SLOT(c, world);
    int w = c->w;
    int64_t four = 4;
    tp_comm *sub = NULL;
    tp_tensor *x = NULL, *y = NULL;
    tp_work *k1 = NULL, *k2 = NULL;
    RANK_OK(s, tp_comm_split(world, 0, tp_comm_rank(world), &sub));
    RANK_OK(s, tp_tensor_zeros(TP_F32, TP_CPU, 1, &four, &x));
    RANK_OK(s, tp_tensor_zeros(TP_F32, TP_CPU, 1, &four, &y));
    RANK_OK(s, tp_tensor_fill(x, 1.0));
    RANK_OK(s, tp_tensor_fill(y, 2.0));
    RANK_OK(s, tp_all_reduce(sub, x, x, TP_SUM, &k1));

    tp_clear_error();
    tp_status st = tp_comm_free(sub);
    RANK_EXPECT(s, st == TP_ERR_STATE, "tp_comm_free with 1 work pending returned %s",
                tp_status_name(st));
    RANK_EXPECT(s, last_error_has("1 work handle of this communicator") &&
                       last_error_has("tp_work_free"),
                "message: '%s'", tp_last_error());
    RANK_OK(s, tp_all_reduce(sub, y, y, TP_SUM, &k2));
    st = tp_comm_free(sub);
    RANK_EXPECT(s, st == TP_ERR_STATE && last_error_has("2 work handles"),
                "with 2 pending: %s '%s'", tp_status_name(st), tp_last_error());

    /* still usable: the pending work completes, a new collective runs */
    RANK_OK(s, tp_work_wait(k1));
    RANK_OK(s, tp_work_wait(k2));
    RANK_OK(s, tp_all_reduce(sub, x, x, TP_SUM, NULL));
    double vx = 0, vy = 0;
    RANK_OK(s, tp_tensor_get(x, (int64_t[]){3}, &vx));
    RANK_OK(s, tp_tensor_get(y, (int64_t[]){3}, &vy));
    RANK_EXPECT(s, vx == (double)w * w && vy == 2.0 * w, "values %g, %g at W=%d", vx, vy, w);
    tp_work_free(k1);
    st = tp_comm_free(sub); /* completed but not freed: still refused */
    RANK_EXPECT(s, st == TP_ERR_STATE && last_error_has("1 work handle"),
                "with 1 completed handle not freed: %s '%s'", tp_status_name(st),
                tp_last_error());
    tp_work_free(k2);
    RANK_OK(s, tp_comm_free(sub));
    RANK_EXPECT(s, tp_comm_free(NULL) == TP_OK, "tp_comm_free(NULL)");
    RANK_EXPECT(s, tp_comm_free(world) == TP_OK, "freeing the run's world is a no-op");

    /* a work handle outlives the mesh (and slice) that owned its
     * communicator */
    tp_mesh *mesh = NULL, *slice = NULL;
    tp_work *k3 = NULL;
    RANK_OK(s, tp_mesh_create(world, 2, (int64_t[]){1, w}, (const char *[]){"dp", "tp"},
                              &mesh));
    RANK_OK(s, tp_mesh_slice(mesh, 1, (const char *[]){"tp"}, &slice));
    RANK_OK(s, tp_tensor_fill(x, 1.0));
    RANK_OK(s, tp_all_reduce(tp_mesh_group(slice), x, x, TP_SUM, &k3));
    tp_mesh_free(slice);
    tp_mesh_free(mesh);
    RANK_OK(s, tp_work_wait(k3));
    RANK_OK(s, tp_tensor_get(x, (int64_t[]){0}, &vx));
    RANK_EXPECT(s, vx == w, "after the mesh was freed: %g at W=%d", vx, w);
    tp_work_free(k3); /* the last reference on the slice's communicator */

    /* a mesh holds the communicator it was created on */
    RANK_OK(s, tp_comm_split(world, 0, tp_comm_rank(world), &sub));
    int64_t n = w;
    RANK_OK(s, tp_mesh_create(sub, 1, &n, NULL, &mesh));
    RANK_OK(s, tp_comm_free(sub));
    RANK_OK(s, tp_tensor_fill(x, 1.0));
    RANK_OK(s, tp_all_reduce(tp_mesh_group(mesh), x, x, TP_SUM, NULL));
    RANK_OK(s, tp_tensor_get(x, (int64_t[]){0}, &vx));
    RANK_EXPECT(s, vx == w, "on a mesh whose world was freed: %g at W=%d", vx, w);
    tp_mesh_free(mesh); /* the last reference on sub */

    tp_tensor_release(x);
    tp_tensor_release(y);
    return TP_OK;
}

ParameterizedTestParameters(lifetime, comm_free_with_work_outstanding)
{
    static int sizes[] = {1, 2, 3, 4};
    return cr_make_param_array(int, sizes, sizeof sizes / sizeof sizes[0]);
}

ParameterizedTest(int *n, lifetime, comm_free_with_work_outstanding, .timeout = 60)
{
    lt_ctx c = {.w = *n};
    scribble_on();
    tp_test_run(*n, comm_free_body, &c, c.slot);
    scribble_off();
}

/* A user backend of one rank whose work is pending until waited for. */
typedef struct {
    int pending, frees, work_frees;
} ub_state;

static tp_status ub_collective(void *state, const tp_coll_desc *d, void **work)
{
    ub_state *u = state;
    if (d->recvbuf && d->recvbuf != d->sendbuf)
        memcpy(d->recvbuf, d->sendbuf, d->count * tp_dtype_size(d->dtype));
    *work = &u->pending;
    u->pending++;
    return TP_OK;
}

static tp_status ub_wait(void *state, void *work, double timeout_s)
{
    (void)work, (void)timeout_s;
    ((ub_state *)state)->pending--;
    return TP_OK;
}

static void ub_work_free(void *state, void *work)
{
    (void)work;
    ((ub_state *)state)->work_frees++;
}

static void ub_free(void *state) { ((ub_state *)state)->frees++; }

Test(lifetime, comm_free_with_work_outstanding_user_backend, .timeout = 30)
{
    static const tp_backend ub = {.name = "lifetime-user", .device_mask = 1u << TP_DEVICE_CPU,
                                  .collective = ub_collective, .work_wait = ub_wait,
                                  .work_free = ub_work_free, .free = ub_free};
    ub_state u = {0};
    tp_comm *c = NULL;
    CHECK_OK(tp_comm_create(&ub, &u, 0, 1, &c));
    int64_t four = 4;
    tp_tensor *x = NULL;
    CHECK_OK(tp_tensor_zeros(TP_F32, TP_CPU, 1, &four, &x));
    tp_work *wk = NULL;
    CHECK_OK(tp_all_reduce(c, x, x, TP_SUM, &wk));
    cr_assert_eq(u.pending, 1);
    CHECK_ERR(tp_comm_free(c), TP_ERR_STATE);
    cr_assert(last_error_has("1 work handle") && last_error_has("'lifetime-user'"), "%s",
              tp_last_error());
    cr_assert_eq(u.frees, 0, "the backend state was freed with work outstanding");
    CHECK_OK(tp_barrier(c, NULL)); /* still usable */
    CHECK_OK(tp_work_wait(wk));
    tp_work_free(wk);
    cr_assert_eq(u.pending, 0);
    CHECK_OK(tp_comm_free(c));
    cr_assert_eq(u.frees, 1);
    tp_tensor_release(x);
}

/* ---- DDP, its communicator and its module -------------------------------------- */

static tp_status ddp_body(tp_comm *world, void *arg)
{
    lt_ctx *c = arg;
    tp_test_slot *s = SLOT(c, world);
    for (int order = 0; order < 2; order++) {
        tp_comm *sub = NULL;
        tp_module *m = NULL, *ref = NULL;
        tp_ddp *ddp = NULL;
        tp_tensor *x = NULL, *y0 = NULL, *y1 = NULL, *r0 = NULL, *r1 = NULL;
        RANK_OK(s, tp_comm_split(world, 0, tp_comm_rank(world), &sub));
        RANK_OK(s, mlp_new(NULL, &m));
        RANK_OK(s, tp_ddp_create(m, sub, NULL, &ddp));
        RANK_OK(s, tp_comm_free(sub)); /* the DDP holds it */
        /* the same batch everywhere: the averaged gradient is the local one */
        RANK_OK(s, rand_t(2, (int64_t[]){8, 10}, 7, &x));
        RANK_OK(s, train_step(m, x, &y0, &y1));
        RANK_OK(s, mlp_new(NULL, &ref));
        RANK_OK(s, train_step(ref, x, &r0, &r1));
        RANK_EXPECT(s, close_to(y1, r1), "DDP step after its comm was freed differs");
        tp_tensor *y2 = NULL;
        if (order == 0) {
            tp_module_free(m); /* the DDP keeps its parameters */
            tp_ddp_free(ddp);
        } else {
            tp_ddp_free(ddp); /* the module's DDP hooks go quiet */
            RANK_OK(s, tp_module_call(m, x, &y2));
            RANK_EXPECT(s, equal_to(y2, y1), "the module changed when its DDP was freed");
            tp_module_free(m);
        }
        tp_module_free(ref);
        tp_tensor *ts[] = {x, y0, y1, y2, r0, r1};
        for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++)
            tp_tensor_release(ts[i]);
    }
    return TP_OK;
}

ParameterizedTestParameters(lifetime, ddp_comm_and_module_in_any_order)
{
    static int sizes[] = {1, 2, 3, 4};
    return cr_make_param_array(int, sizes, sizeof sizes / sizeof sizes[0]);
}

ParameterizedTest(int *n, lifetime, ddp_comm_and_module_in_any_order, .timeout = 60)
{
    lt_ctx c = {.w = *n};
    scribble_on();
    tp_test_run(*n, ddp_body, &c, c.slot);
    scribble_off();
}
