/* Device meshes: coordinates, per-dim communicators, slicing, errors.
 *
 * Every check derives the expected value from the world rank and the world
 * mesh shape alone (coordinates by division, groups by scanning all ranks), so
 * a mesh that computes coordinates or colors wrongly cannot agree with it. */
#include <stdatomic.h>
#include <stdint.h>

#include "tp_test.h"

#define MAXD 8

/* ---- reference model ------------------------------------------------------ */

/* Row-major coordinate of rank r in a mesh of this shape. */
static void ref_coord(int ndim, const int64_t *shape, int64_t r, int64_t *coord)
{
    for (int d = ndim - 1; d >= 0; d--) {
        coord[d] = r % shape[d];
        r /= shape[d];
    }
}

static int64_t ref_numel(int ndim, const int64_t *shape)
{
    int64_t n = 1;
    for (int d = 0; d < ndim; d++)
        n *= shape[d];
    return n;
}

/*
 * A mesh as the test expects it: a view of the world mesh (base_ndim dims of
 * base_shape) keeping base dims map[0..ndim) in that order and fixing the
 * others to this rank's coordinates. A mesh made by tp_mesh_create is the
 * identity view; a slice keeps some dims.
 */
typedef struct view {
    int base_ndim;
    int64_t base_shape[MAXD];
    int ndim;
    int map[MAXD];
    const char *names[MAXD]; /* expected dim names */
} view;

/* Index of world rank q in the view that contains it (row-major over the kept
 * coordinates in view order). */
static int64_t view_index(const view *v, int64_t q)
{
    int64_t c[MAXD], lin = 0;
    ref_coord(v->base_ndim, v->base_shape, q, c);
    for (int i = 0; i < v->ndim; i++)
        lin = lin * v->base_shape[v->map[i]] + c[v->map[i]];
    return lin;
}

/* true if world ranks p and q agree on every base coordinate except those in
 * `free_dims` (a bitmask of base dims). */
static bool same_except(const view *v, int64_t p, int64_t q, unsigned free_dims)
{
    int64_t cp[MAXD], cq[MAXD];
    ref_coord(v->base_ndim, v->base_shape, p, cp);
    ref_coord(v->base_ndim, v->base_shape, q, cq);
    for (int d = 0; d < v->base_ndim; d++)
        if (!(free_dims & (1u << d)) && cp[d] != cq[d])
            return false;
    return true;
}

/* ---- collective probes ---------------------------------------------------- */

/* all_reduce(SUM) of `value` over comm into *out. */
static tp_status probe_sum(tp_comm *comm, double value, double *out)
{
    int64_t one = 1, idx = 0;
    float v = (float)value;
    tp_tensor *t = NULL;
    tp_status st = tp_tensor_from_data(TP_F32, 1, &one, &v, &t);
    if (st == TP_OK)
        st = tp_all_reduce(comm, t, t, TP_SUM, NULL);
    if (st == TP_OK)
        st = tp_tensor_get(t, &idx, out);
    tp_tensor_release(t);
    return st;
}

/* all_gather of `value` over comm into out[0..size). */
static tp_status probe_gather(tp_comm *comm, double value, double *out)
{
    int64_t one = 1, n = tp_comm_size(comm);
    float v = (float)value;
    tp_tensor *send = NULL, *recv = NULL;
    tp_status st = tp_tensor_from_data(TP_F32, 1, &one, &v, &send);
    if (st == TP_OK)
        st = tp_tensor_empty(TP_F32, TP_CPU, 1, &n, &recv);
    if (st == TP_OK)
        st = tp_all_gather(comm, send, recv, NULL);
    for (int64_t i = 0; st == TP_OK && i < n; i++)
        st = tp_tensor_get(recv, &i, &out[i]);
    tp_tensor_release(send);
    tp_tensor_release(recv);
    return st;
}

/*
 * Checks everything observable about mesh m on world rank `wr` against view v:
 * shape, coordinates, rank, names, each dim's communicator (size, rank, and
 * the group it reduces over) and the group communicator (size, rank, and its
 * rank order, through an all_gather of world ranks).
 */
static tp_status check_mesh(tp_test_slot *slot, const tp_mesh *m, int wr, const view *v)
{
    int64_t bc[MAXD], shape[MAXD], coord[MAXD];
    ref_coord(v->base_ndim, v->base_shape, wr, bc);
    for (int i = 0; i < v->ndim; i++) {
        shape[i] = v->base_shape[v->map[i]];
        coord[i] = bc[v->map[i]];
    }
    const int64_t numel = ref_numel(v->ndim, shape);
    const int64_t world = ref_numel(v->base_ndim, v->base_shape);

    RANK_EXPECT(slot, tp_mesh_ndim(m) == v->ndim, "ndim %d, expected %d", tp_mesh_ndim(m),
                v->ndim);
    RANK_EXPECT(slot, tp_mesh_numel(m) == numel, "numel %lld, expected %lld",
                (long long)tp_mesh_numel(m), (long long)numel);
    RANK_EXPECT(slot, tp_mesh_rank(m) == view_index(v, wr), "mesh rank %d, expected %lld",
                tp_mesh_rank(m), (long long)view_index(v, wr));
    for (int i = 0; i < v->ndim; i++) {
        RANK_EXPECT(slot, tp_mesh_size(m, i) == shape[i], "size(%d) %lld, expected %lld", i,
                    (long long)tp_mesh_size(m, i), (long long)shape[i]);
        RANK_EXPECT(slot, tp_mesh_size(m, i - v->ndim) == shape[i], "size(%d) wrong",
                    i - v->ndim);
        RANK_EXPECT(slot, tp_mesh_coord(m, i) == coord[i], "coord(%d) %lld, expected %lld", i,
                    (long long)tp_mesh_coord(m, i), (long long)coord[i]);
        RANK_EXPECT(slot, tp_mesh_coord(m, i - v->ndim) == coord[i], "coord(%d) wrong",
                    i - v->ndim);
        const char *name = tp_mesh_dim_name(m, i);
        RANK_EXPECT(slot, name && strcmp(name, v->names[i]) == 0, "dim %d named %s, expected %s",
                    i, name ? name : "(null)", v->names[i]);
        RANK_EXPECT(slot, tp_mesh_dim_index(m, v->names[i]) == i, "dim_index(%s) %d, expected %d",
                    v->names[i], tp_mesh_dim_index(m, v->names[i]), i);
    }

    for (int i = 0; i < v->ndim; i++) {
        tp_comm *c = tp_mesh_comm(m, i);
        RANK_EXPECT(slot, c != NULL, "comm(%d) is NULL", i);
        if (!c)
            return TP_ERR_STATE;
        RANK_EXPECT(slot, tp_mesh_comm(m, i - v->ndim) == c, "comm(%d) differs from comm(%d)",
                    i - v->ndim, i);
        RANK_EXPECT(slot, tp_comm_size(c) == shape[i], "comm(%d) size %d, expected %lld", i,
                    tp_comm_size(c), (long long)shape[i]);
        RANK_EXPECT(slot, tp_comm_rank(c) == coord[i], "comm(%d) rank %d, expected %lld", i,
                    tp_comm_rank(c), (long long)coord[i]);
        /* The dim's group: world ranks agreeing on every base coordinate except
         * the one this dim walks along. */
        double expected = 0, got = -1;
        for (int64_t q = 0; q < world; q++)
            if (same_except(v, wr, q, 1u << v->map[i]))
                expected += (double)q;
        RANK_OK(slot, probe_sum(c, wr, &got));
        RANK_EXPECT(slot, got == expected, "all_reduce over comm(%d) (\"%s\") gave %g, expected %g",
                    i, v->names[i], got, expected);
    }

    tp_comm *g = tp_mesh_group(m);
    RANK_EXPECT(slot, g != NULL, "group is NULL");
    if (!g)
        return TP_ERR_STATE;
    RANK_EXPECT(slot, tp_comm_size(g) == numel, "group size %d, expected %lld", tp_comm_size(g),
                (long long)numel);
    RANK_EXPECT(slot, tp_comm_rank(g) == tp_mesh_rank(m), "group rank %d, mesh rank %d",
                tp_comm_rank(g), tp_mesh_rank(m));
    /* Block j of the gather is the world rank of the mesh's rank j: the world
     * rank in this view, sharing the fixed coordinates, whose index is j. */
    unsigned kept = 0;
    for (int i = 0; i < v->ndim; i++)
        kept |= 1u << v->map[i];
    double got[64];
    RANK_OK(slot, probe_gather(g, wr, got));
    for (int64_t q = 0; q < world; q++) {
        if (!same_except(v, wr, q, kept))
            continue;
        int64_t j = view_index(v, q);
        RANK_EXPECT(slot, got[j] == (double)q, "group rank %lld is world rank %g, expected %lld",
                    (long long)j, got[j], (long long)q);
    }
    return TP_OK;
}

static view identity_view(int ndim, const int64_t *shape, const char *const *names)
{
    static const char *const dflt[MAXD] = {"dim0", "dim1", "dim2", "dim3",
                                           "dim4", "dim5", "dim6", "dim7"};
    view v = {.base_ndim = ndim, .ndim = ndim};
    for (int d = 0; d < ndim; d++) {
        v.base_shape[d] = shape[d];
        v.map[d] = d;
        v.names[d] = names ? names[d] : dflt[d];
    }
    return v;
}

/* ---- meshes over the world ------------------------------------------------ */

typedef struct mesh_case {
    int ndim;
    int64_t shape[3];
    char names[3][8]; /* names[0][0] == 0: default names */
} mesh_case;

typedef struct shape_arg {
    mesh_case c;
    tp_test_slot slots[TP_TEST_MAX_RANKS];
} shape_arg;

static tp_status shape_rank(tp_comm *world, void *p)
{
    shape_arg *a = p;
    int wr = tp_comm_rank(world);
    tp_test_slot *slot = &a->slots[wr];
    const char *names_buf[3];
    const char *const *names = NULL;
    if (a->c.names[0][0]) {
        for (int d = 0; d < a->c.ndim; d++)
            names_buf[d] = a->c.names[d];
        names = names_buf;
    }
    tp_mesh *m = NULL;
    RANK_OK(slot, tp_mesh_create(world, a->c.ndim, a->c.shape, names, &m));
    RANK_EXPECT(slot, tp_mesh_group(m) == world, "the mesh does not use world as its group");
    view v = identity_view(a->c.ndim, a->c.shape, names);
    tp_status st = check_mesh(slot, m, wr, &v);
    tp_mesh_free(m);
    return st;
}

ParameterizedTestParameters(mesh, shapes)
{
    static mesh_case cases[] = {
        {1, {1}, {""}},
        {1, {2}, {""}},
        {1, {3}, {""}},
        {1, {4}, {"tp"}},
        {1, {8}, {""}},
        {2, {2, 2}, {"dp", "tp"}},
        {2, {4, 2}, {""}},
        {2, {2, 4}, {"dp", "tp"}},
        {2, {2, 3}, {""}},
        {2, {3, 2}, {"x", "y"}},
        {2, {1, 4}, {""}},
        {2, {4, 1}, {"dp", "tp"}},
        {2, {1, 1}, {""}},
        {3, {2, 2, 2}, {"pp", "dp", "tp"}},
        {3, {2, 1, 3}, {""}},
    };
    return cr_make_param_array(mesh_case, cases, sizeof cases / sizeof cases[0]);
}

ParameterizedTest(mesh_case *c, mesh, shapes, .timeout = 60)
{
    shape_arg a = {.c = *c};
    int n = (int)ref_numel(c->ndim, c->shape);
    tp_test_run(n, shape_rank, &a, a.slots);
}

/* Names are copied: the caller's strings may change or die after create. */
static tp_status names_copied_rank(tp_comm *world, void *p)
{
    tp_test_slot *slot = &((tp_test_slot *)p)[tp_comm_rank(world)];
    char a[8] = "dp", b[8] = "tp";
    const char *names[] = {a, b};
    int64_t shape[] = {1, tp_comm_size(world)};
    tp_mesh *m = NULL;
    RANK_OK(slot, tp_mesh_create(world, 2, shape, names, &m));
    strcpy(a, "zz");
    strcpy(b, "yy");
    RANK_EXPECT(slot, strcmp(tp_mesh_dim_name(m, 0), "dp") == 0, "dim 0 renamed to %s",
                tp_mesh_dim_name(m, 0));
    RANK_EXPECT(slot, tp_mesh_dim_index(m, "tp") == 1, "\"tp\" not found");
    RANK_EXPECT(slot, tp_mesh_dim_index(m, "zz") == -1, "\"zz\" found");
    tp_mesh_free(m);
    return TP_OK;
}

Test(mesh, names_are_copied, .timeout = 30)
{
    tp_test_slot slots[TP_TEST_MAX_RANKS] = {0};
    tp_test_run(2, names_copied_rank, slots, slots);
}

/* Two meshes over the same world, and a second mesh created while the first
 * is in use, are independent. */
static tp_status two_meshes_rank(tp_comm *world, void *p)
{
    int wr = tp_comm_rank(world);
    tp_test_slot *slot = &((tp_test_slot *)p)[wr];
    int64_t s1[] = {2, 3}, s2[] = {3, 2};
    tp_mesh *a = NULL, *b = NULL;
    RANK_OK(slot, tp_mesh_create(world, 2, s1, NULL, &a));
    tp_status st = tp_mesh_create(world, 2, s2, NULL, &b);
    RANK_EXPECT(slot, st == TP_OK, "second mesh: %s", tp_last_error());
    view va = identity_view(2, s1, NULL), vb = identity_view(2, s2, NULL);
    if (st == TP_OK)
        st = check_mesh(slot, b, wr, &vb);
    if (st == TP_OK)
        st = check_mesh(slot, a, wr, &va);
    tp_mesh_free(a);
    tp_mesh_free(b);
    return st;
}

Test(mesh, two_meshes_on_one_world, .timeout = 30)
{
    tp_test_slot slots[TP_TEST_MAX_RANKS] = {0};
    tp_test_run(6, two_meshes_rank, slots, slots);
}

/* ---- slicing -------------------------------------------------------------- */

typedef struct slice_arg {
    int64_t shape[2];
    tp_test_slot slots[TP_TEST_MAX_RANKS];
} slice_arg;

static view slice_view(int base_ndim, const int64_t *base_shape, int ndim, const int *map,
                       const char *const *names)
{
    view v = {.base_ndim = base_ndim, .ndim = ndim};
    for (int d = 0; d < base_ndim; d++)
        v.base_shape[d] = base_shape[d];
    for (int i = 0; i < ndim; i++) {
        v.map[i] = map[i];
        v.names[i] = names[i];
    }
    return v;
}

static tp_status slice_2d_rank(tp_comm *world, void *p)
{
    slice_arg *a = p;
    int wr = tp_comm_rank(world);
    tp_test_slot *slot = &a->slots[wr];
    static const char *const names[] = {"dp", "tp"};
    static const char *const rev[] = {"tp", "dp"};
    tp_mesh *m = NULL, *tp = NULL, *dp = NULL, *swapped = NULL, *same = NULL;
    tp_status st = TP_OK;

    RANK_OK(slot, tp_mesh_create(world, 2, a->shape, names, &m));
    view vm = identity_view(2, a->shape, names);
    view vtp = slice_view(2, a->shape, 1, (int[]){1}, (const char *const[]){"tp"});
    view vdp = slice_view(2, a->shape, 1, (int[]){0}, (const char *const[]){"dp"});
    view vsw = slice_view(2, a->shape, 2, (int[]){1, 0}, rev);

#define STEP(expr)                                                              \
    do {                                                                        \
        if (st == TP_OK) {                                                      \
            st = (expr);                                                        \
            RANK_EXPECT(slot, st == TP_OK, "%s: %s (%s)", #expr,                \
                        tp_status_name(st), tp_last_error());                   \
        }                                                                       \
    } while (0)

    STEP(tp_mesh_slice(m, 1, (const char *const[]){"tp"}, &tp));
    STEP(check_mesh(slot, tp, wr, &vtp));
    STEP(tp_mesh_slice(m, 1, (const char *const[]){"dp"}, &dp));
    STEP(check_mesh(slot, dp, wr, &vdp));
    STEP(tp_mesh_slice(m, 2, rev, &swapped));
    STEP(check_mesh(slot, swapped, wr, &vsw));
    STEP(tp_mesh_slice(m, 2, names, &same));
    STEP(check_mesh(slot, same, wr, &vm));
    /* The parent still works after slicing. */
    STEP(check_mesh(slot, m, wr, &vm));

    /* Slices outlive their parent: they own their communicators. */
    tp_mesh_free(m);
    STEP(check_mesh(slot, tp, wr, &vtp));
    STEP(check_mesh(slot, swapped, wr, &vsw));
    /* ... and can be sliced in turn, outliving that parent as well. */
    tp_mesh *tp2 = NULL;
    STEP(tp_mesh_slice(swapped, 1, (const char *const[]){"tp"}, &tp2));
    tp_mesh_free(swapped);
    STEP(check_mesh(slot, tp2, wr, &vtp));
#undef STEP
    tp_mesh_free(tp2);
    tp_mesh_free(tp);
    tp_mesh_free(dp);
    tp_mesh_free(same);
    return st;
}

typedef struct shape2 {
    int64_t s[2];
} shape2;

ParameterizedTestParameters(mesh, slice_2d)
{
    static shape2 shapes[] = {{{2, 2}}, {{4, 2}}, {{2, 3}}, {{3, 2}}, {{1, 4}}, {{4, 1}}};
    return cr_make_param_array(shape2, shapes, sizeof shapes / sizeof shapes[0]);
}

ParameterizedTest(shape2 *shape, mesh, slice_2d, .timeout = 60)
{
    slice_arg a = {.shape = {shape->s[0], shape->s[1]}};
    int n = (int)(a.shape[0] * a.shape[1]);
    tp_test_run(n, slice_2d_rank, &a, a.slots);
}

/* 3-D (pp, dp, tp) = 2x2x2 and 2x3x2: every slice of two dims in both
 * orders, and of one dim. */
static tp_status slice_3d_rank(tp_comm *world, void *p)
{
    int wr = tp_comm_rank(world);
    slice_arg *a = p; /* shape[0] selects the case */
    tp_test_slot *slot = &a->slots[wr];
    int64_t shape[3] = {2, a->shape[0], 2};
    static const char *const names[] = {"pp", "dp", "tp"};
    tp_mesh *m = NULL;
    RANK_OK(slot, tp_mesh_create(world, 3, shape, names, &m));
    tp_status st = TP_OK;
    for (int x = 0; x < 3 && st == TP_OK; x++) {
        for (int y = 0; y < 3 && st == TP_OK; y++) {
            int map[2] = {x, y};
            int n = x == y ? 1 : 2;
            const char *sel[2] = {names[x], names[y]};
            tp_mesh *s = NULL;
            st = tp_mesh_slice(m, n, sel, &s);
            RANK_EXPECT(slot, st == TP_OK, "slice (%s, %s): %s", sel[0], n > 1 ? sel[1] : "",
                        tp_last_error());
            if (st == TP_OK) {
                view v = slice_view(3, shape, n, map, sel);
                st = check_mesh(slot, s, wr, &v);
            }
            tp_mesh_free(s);
        }
    }
    tp_mesh_free(m);
    return st;
}

Test(mesh, slice_3d_2x2x2, .timeout = 60)
{
    slice_arg a = {.shape = {2}};
    tp_test_run(8, slice_3d_rank, &a, a.slots);
}

Test(mesh, slice_3d_2x3x2, .timeout = 60)
{
    slice_arg a = {.shape = {3}};
    tp_test_run(12, slice_3d_rank, &a, a.slots);
}

/* Slice the 3-D mesh to 2-D (tp, pp), free the parent, slice again. */
static tp_status slice_chain_rank(tp_comm *world, void *p)
{
    int wr = tp_comm_rank(world);
    tp_test_slot *slot = &((tp_test_slot *)p)[wr];
    int64_t shape[3] = {2, 2, 2};
    static const char *const names[] = {"pp", "dp", "tp"};
    tp_mesh *m = NULL, *s = NULL, *t = NULL;
    RANK_OK(slot, tp_mesh_create(world, 3, shape, names, &m));
    tp_status st = tp_mesh_slice(m, 2, (const char *const[]){"tp", "pp"}, &s);
    RANK_EXPECT(slot, st == TP_OK, "slice (tp, pp): %s", tp_last_error());
    tp_mesh_free(m);
    if (st == TP_OK) {
        view v = slice_view(3, shape, 2, (int[]){2, 0}, (const char *const[]){"tp", "pp"});
        st = check_mesh(slot, s, wr, &v);
    }
    if (st == TP_OK) {
        st = tp_mesh_slice(s, 1, (const char *const[]){"pp"}, &t);
        RANK_EXPECT(slot, st == TP_OK, "slice (pp): %s", tp_last_error());
    }
    tp_mesh_free(s);
    if (st == TP_OK) {
        view v = slice_view(3, shape, 1, (int[]){0}, (const char *const[]){"pp"});
        st = check_mesh(slot, t, wr, &v);
    }
    tp_mesh_free(t);
    return st;
}

Test(mesh, slice_of_slice_outlives_parents, .timeout = 30)
{
    tp_test_slot slots[TP_TEST_MAX_RANKS] = {0};
    tp_test_run(8, slice_chain_rank, slots, slots);
}

/* ---- errors --------------------------------------------------------------- */

/* A failed create must leave *out NULL and the world usable (validation runs
 * before any communication), and fail with INVALID_ARG whose text contains
 * every string in `needles`. */
#define EXPECT_INVALID(slot, call, out, ...)                                    \
    do {                                                                        \
        (out) = (void *)0x1;                                                    \
        tp_status st_ = (call);                                                 \
        RANK_EXPECT(slot, st_ == TP_ERR_INVALID_ARG, "%s gave %s, expected "    \
                    "TP_ERR_INVALID_ARG", #call, tp_status_name(st_));          \
        RANK_EXPECT(slot, (out) == NULL, "%s left out non-NULL", #call);        \
        const char *needles_[] = {__VA_ARGS__};                                 \
        for (size_t i_ = 0; i_ < sizeof needles_ / sizeof needles_[0]; i_++)     \
            RANK_EXPECT(slot, strstr(tp_last_error(), needles_[i_]) != NULL,    \
                        "%s: message \"%s\" lacks \"%s\"", #call,               \
                        tp_last_error(), needles_[i_]);                         \
    } while (0)

static tp_status create_errors_rank(tp_comm *world, void *p)
{
    int wr = tp_comm_rank(world);
    tp_test_slot *slot = &((tp_test_slot *)p)[wr];
    tp_mesh *m;
    int64_t s23[] = {2, 3}, s22[] = {2, 2}, s4[] = {4};
    int64_t nine[9] = {1, 1, 1, 1, 4, 1, 1, 1, 1};
    int64_t s04[] = {0, 4}, sneg[] = {-1, -4};

    EXPECT_INVALID(slot, tp_mesh_create(world, 2, s23, NULL, &m), m, "[2, 3]", "6", "4");
    EXPECT_INVALID(slot, tp_mesh_create(world, 1, (int64_t[]){8}, NULL, &m), m, "8", "4");
    EXPECT_INVALID(slot, tp_mesh_create(world, 0, s4, NULL, &m), m, "ndim");
    EXPECT_INVALID(slot, tp_mesh_create(world, -1, s4, NULL, &m), m, "ndim");
    EXPECT_INVALID(slot, tp_mesh_create(world, 9, nine, NULL, &m), m, "ndim");
    EXPECT_INVALID(slot, tp_mesh_create(world, 2, s04, NULL, &m), m, "size 0");
    EXPECT_INVALID(slot, tp_mesh_create(world, 2, sneg, NULL, &m), m, "size -1");
    EXPECT_INVALID(slot, tp_mesh_create(world, 1, NULL, NULL, &m), m, "shape");
    EXPECT_INVALID(slot, tp_mesh_create(world, 2, s22, (const char *const[]){"tp", "tp"}, &m),
                   m, "tp");
    EXPECT_INVALID(slot, tp_mesh_create(world, 2, s22, (const char *const[]){"dp", ""}, &m),
                   m, "empty");
    EXPECT_INVALID(slot, tp_mesh_create(world, 2, s22, (const char *const[]){NULL, "tp"}, &m),
                   m, "NULL");
    RANK_EXPECT(slot, tp_mesh_create(world, 1, s4, NULL, NULL) == TP_ERR_INVALID_ARG,
                "NULL out accepted");

    /* Eight dims (the maximum) are fine, sizes of 1 included. */
    m = NULL;
    RANK_OK(slot, tp_mesh_create(world, 8, nine, NULL, &m));
    RANK_EXPECT(slot, tp_mesh_ndim(m) == 8 && tp_mesh_size(m, 4) == 4 &&
                          tp_mesh_coord(m, 4) == wr && tp_mesh_coord(m, 7) == 0,
                "8-D mesh wrong");
    RANK_EXPECT(slot, tp_comm_size(tp_mesh_comm(m, 7)) == 1, "size-1 dim comm has size %d",
                tp_comm_size(tp_mesh_comm(m, 7)));
    tp_mesh_free(m);

    /* The world is still usable: no collective was started by the failures. */
    double sum = -1;
    RANK_OK(slot, probe_sum(world, wr, &sum));
    RANK_EXPECT(slot, sum == 6, "world all_reduce after errors gave %g", sum);
    return TP_OK;
}

Test(mesh, create_errors, .timeout = 30)
{
    tp_test_slot slots[TP_TEST_MAX_RANKS] = {0};
    tp_test_run(4, create_errors_rank, slots, slots);
}

Test(mesh, create_null_world, .timeout = 10)
{
    int64_t shape[] = {1};
    tp_mesh *m = (void *)0x1;
    cr_assert_eq(tp_mesh_create(NULL, 1, shape, NULL, &m), TP_ERR_INVALID_ARG);
    cr_assert_null(m);
    cr_assert(strstr(tp_last_error(), "world") != NULL, "message: %s", tp_last_error());
}

static tp_status slice_errors_rank(tp_comm *world, void *p)
{
    int wr = tp_comm_rank(world);
    tp_test_slot *slot = &((tp_test_slot *)p)[wr];
    int64_t shape[] = {2, 2};
    tp_mesh *m = NULL, *s;
    RANK_OK(slot, tp_mesh_create(world, 2, shape, (const char *const[]){"dp", "tp"}, &m));

    EXPECT_INVALID(slot, tp_mesh_slice(m, 1, (const char *const[]){"pp"}, &s), s, "pp");
    EXPECT_INVALID(slot, tp_mesh_slice(m, 2, (const char *const[]){"tp", "tp"}, &s), s, "tp");
    EXPECT_INVALID(slot, tp_mesh_slice(m, 2, (const char *const[]){"tp", "dim0"}, &s), s,
                   "dim0");
    EXPECT_INVALID(slot, tp_mesh_slice(m, 2, (const char *const[]){"tp", NULL}, &s), s, "NULL");
    EXPECT_INVALID(slot, tp_mesh_slice(m, 0, (const char *const[]){"tp"}, &s), s, "0");
    EXPECT_INVALID(slot, tp_mesh_slice(m, 3, (const char *const[]){"dp", "tp", "dp"}, &s), s,
                   "3");
    EXPECT_INVALID(slot, tp_mesh_slice(m, 1, NULL, &s), s, "names");
    EXPECT_INVALID(slot, tp_mesh_slice(NULL, 1, (const char *const[]){"tp"}, &s), s, "mesh");
    RANK_EXPECT(slot, tp_mesh_slice(m, 1, (const char *const[]){"tp"}, NULL) ==
                          TP_ERR_INVALID_ARG, "NULL out accepted");

    /* The mesh is still usable after the failures. */
    view v = identity_view(2, shape, (const char *const[]){"dp", "tp"});
    tp_status st = check_mesh(slot, m, wr, &v);
    tp_mesh_free(m);
    return st;
}

Test(mesh, slice_errors, .timeout = 30)
{
    tp_test_slot slots[TP_TEST_MAX_RANKS] = {0};
    tp_test_run(4, slice_errors_rank, slots, slots);
}

static tp_status accessors_rank(tp_comm *world, void *p)
{
    tp_test_slot *slot = &((tp_test_slot *)p)[tp_comm_rank(world)];
    int64_t shape[] = {1, 2};
    tp_mesh *m = NULL;
    RANK_OK(slot, tp_mesh_create(world, 2, shape, NULL, &m));
    RANK_EXPECT(slot, tp_mesh_size(m, 2) == -1 && tp_mesh_size(m, -3) == -1,
                "size out of range");
    RANK_EXPECT(slot, tp_mesh_size(m, -1) == 2 && tp_mesh_size(m, -2) == 1, "negative size");
    RANK_EXPECT(slot, tp_mesh_coord(m, 2) == -1 && tp_mesh_coord(m, -3) == -1,
                "coord out of range");
    RANK_EXPECT(slot, tp_mesh_dim_name(m, 2) == NULL && tp_mesh_dim_name(m, -3) == NULL,
                "name out of range");
    RANK_EXPECT(slot, strcmp(tp_mesh_dim_name(m, -1), "dim1") == 0, "name(-1) is %s",
                tp_mesh_dim_name(m, -1));
    RANK_EXPECT(slot, tp_mesh_comm(m, 2) == NULL && tp_mesh_comm(m, -3) == NULL,
                "comm out of range");
    RANK_EXPECT(slot, tp_mesh_comm(m, 100) == NULL && tp_mesh_comm(m, -100) == NULL,
                "comm far out of range");
    RANK_EXPECT(slot, tp_mesh_dim_index(m, "dim2") == -1 && tp_mesh_dim_index(m, "") == -1 &&
                          tp_mesh_dim_index(m, NULL) == -1,
                "dim_index of unknown names");
    RANK_EXPECT(slot, tp_mesh_dim_index(m, "dim1") == 1, "dim_index(dim1)");
    tp_mesh_free(m);
    return TP_OK;
}

Test(mesh, accessors_out_of_range, .timeout = 30)
{
    tp_test_slot slots[TP_TEST_MAX_RANKS] = {0};
    tp_test_run(2, accessors_rank, slots, slots);
}

Test(mesh, accessors_null_mesh, .timeout = 10)
{
    cr_assert_eq(tp_mesh_ndim(NULL), -1);
    cr_assert_eq(tp_mesh_size(NULL, 0), -1);
    cr_assert_eq(tp_mesh_numel(NULL), -1);
    cr_assert_eq(tp_mesh_coord(NULL, 0), -1);
    cr_assert_eq(tp_mesh_rank(NULL), -1);
    cr_assert_null(tp_mesh_dim_name(NULL, 0));
    cr_assert_eq(tp_mesh_dim_index(NULL, "dim0"), -1);
    cr_assert_null(tp_mesh_comm(NULL, 0));
    cr_assert_null(tp_mesh_group(NULL));
    tp_mesh_free(NULL);
}

/* ---- allocation failures ---------------------------------------------------- */

/* Forwards to the allocator that was installed before, counts live blocks,
 * and fails every allocation from the `fail_at`-th one (counted from arming)
 * on, so every later step of a path fails too. */
static struct {
    tp_allocator inner;
    atomic_long live;
    atomic_long count;
    atomic_long fail_at; /* < 0: never */
} fa;

static void *fa_alloc(void *ctx, size_t size, size_t alignment)
{
    (void)ctx;
    long k = atomic_fetch_add(&fa.count, 1);
    long f = atomic_load(&fa.fail_at);
    if (f >= 0 && k >= f)
        return NULL;
    void *p = fa.inner.alloc(fa.inner.ctx, size, alignment);
    if (p)
        atomic_fetch_add(&fa.live, 1);
    return p;
}

static void fa_free(void *ctx, void *ptr)
{
    (void)ctx;
    atomic_fetch_sub(&fa.live, 1);
    fa.inner.free(fa.inner.ctx, ptr);
}

typedef struct oom_arg {
    long fail_at;
    long used; /* allocations rank 0 saw while armed */
    int world;
    tp_status create_st, slice_st;
    tp_test_slot slots[TP_TEST_MAX_RANKS];
} oom_arg;

/* One rank: create a mesh and slice it with allocation failure armed. Every
 * rank sees one of OK, NO_MEMORY, or (peers of a failing rank) ABORTED. */
static tp_status oom_rank(tp_comm *world, void *p)
{
    oom_arg *a = p;
    int wr = tp_comm_rank(world);
    tp_test_slot *slot = &a->slots[wr];
    int64_t shape[] = {a->world, 1};
    tp_mesh *m = NULL, *s = NULL;
    /* Arm only once every rank is running, so that the failures land in the
     * mesh code rather than in tp_run_local's own setup. */
    tp_status st = tp_barrier(world, NULL);
    /* Rank 0 may leave the barrier, arm, and abort the world before this
     * rank has seen the barrier complete: ABORTED is a valid outcome here. */
    RANK_EXPECT(slot, st == TP_OK || st == TP_ERR_ABORTED, "barrier: %s (%s)",
                tp_status_name(st), tp_last_error());
    if (st != TP_OK)
        return st;
    if (wr == 0) {
        atomic_store(&fa.count, 0);
        atomic_store(&fa.fail_at, a->fail_at);
    }
    st = tp_mesh_create(world, 2, shape, (const char *const[]){"dp", "tp"}, &m);
    RANK_EXPECT(slot, st == TP_OK || st == TP_ERR_NO_MEMORY || st == TP_ERR_ABORTED,
                "create: %s (%s)", tp_status_name(st), tp_last_error());
    RANK_EXPECT(slot, (st == TP_OK) == (m != NULL), "create: status %s with mesh %p",
                tp_status_name(st), (void *)m);
    if (wr == 0)
        a->create_st = st;
    if (st == TP_OK) {
        st = tp_mesh_slice(m, 2, (const char *const[]){"tp", "dp"}, &s);
        RANK_EXPECT(slot, st == TP_OK || st == TP_ERR_NO_MEMORY || st == TP_ERR_ABORTED,
                    "slice: %s (%s)", tp_status_name(st), tp_last_error());
        RANK_EXPECT(slot, (st == TP_OK) == (s != NULL), "slice: status %s with mesh %p",
                    tp_status_name(st), (void *)s);
        if (wr == 0)
            a->slice_st = st;
    }
    tp_mesh_free(s);
    tp_mesh_free(m);
    if (wr == 0) {
        a->used = atomic_load(&fa.count);
        atomic_store(&fa.fail_at, -1);
    }
    /* Keep a failing rank from returning while its peer is still inside a
     * split: tp_run_local would abort the run under that peer, which tests
     * the shm backend's abort races rather than the mesh. Its status does
     * not matter (the world is aborted when create failed). */
    (void)tp_barrier(world, NULL);
    return st;
}

static void run_oom(int world)
{
    fa.inner = tp_get_allocator();
    atomic_store(&fa.live, 0);
    atomic_store(&fa.fail_at, -1);
    cr_assert_eq(tp_set_allocator(&(tp_allocator){fa_alloc, fa_free, NULL}), TP_OK);
    /* Failure k = 0, 1, ... until a run succeeds with nothing failing; the
     * bound only guards against a path that never stops allocating. */
    bool done = false;
    for (long k = 0; k < 400 && !done; k++) {
        oom_arg a = {.fail_at = k, .world = world, .create_st = TP_OK, .slice_st = TP_OK};
        tp_status st = tp_run_local_opts(world, oom_rank, &a,
                                         &(tp_run_options){.timeout_s = 10});
        atomic_store(&fa.fail_at, -1);
        long live = atomic_load(&fa.live);
        if (live != 0) {
            tp_set_allocator(NULL);
            cr_assert_fail("k=%ld: %ld blocks leaked (run: %s)", k, live, tp_status_name(st));
        }
        for (int r = 0; r < world; r++)
            if (a.slots[r].failed) {
                tp_set_allocator(NULL);
                cr_assert_fail("k=%ld rank %d: %s", k, r, a.slots[r].msg);
            }
        if (st != TP_OK && st != TP_ERR_NO_MEMORY && st != TP_ERR_ABORTED) {
            tp_set_allocator(NULL);
            cr_assert_fail("k=%ld: run gave %s (%s)", k, tp_status_name(st), tp_last_error());
        }
        done = st == TP_OK && a.create_st == TP_OK && a.slice_st == TP_OK && a.used <= k;
    }
    tp_set_allocator(NULL);
    cr_assert(done, "never succeeded within 400 allocations");
}

Test(mesh, out_of_memory_world1, .timeout = 120)
{
    run_oom(1);
}

Test(mesh, out_of_memory_world2, .timeout = 300)
{
    run_oom(2);
}
