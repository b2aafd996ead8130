/* DTensors: distribute / from_local / to_local / full_tensor on 1-, 2- and
 * 3-D meshes with even, uneven and empty shards; a property test of random
 * redistributions checked element for element against the global tensor and
 * collective for collective against the planner; the collective counts of
 * every transition of the DESIGN table, forward and backward; the errors. */
#include <stdlib.h>

#include "tp_test.h"

#define SEED 1234

/* ---- helpers run on rank threads ------------------------------------------ */

typedef struct {
    int ndim;
    int64_t shape[TP_MESH_MAX_DIMS];
    const char *names[TP_MESH_MAX_DIMS];
} mesh_spec;

/* Fills `t`, the block at `offset` of a global tensor, with the global
 * tensor's small integers (exact in f32 sums). */
static tp_status fill_block(tp_tensor *t, const int64_t *global, const int64_t *offset,
                            uint64_t seed)
{
    return tp_tensor_fill_random(t, TP_RNG_RANDINT, -8, 9, seed, global, offset);
}

/* This rank's local term of a DTensor with `pl` whose global value is the
 * RANDINT tensor of `seed`: Shard takes the block, Partial(sum) spreads a
 * zero-sum noise over the group, Partial(max) lowers every term but one. */
static tp_status make_source(tp_mesh *mesh, int ndim, const int64_t *global,
                             const tp_placement *pl, uint64_t seed, tp_tensor **out)
{
    int m = tp_mesh_ndim(mesh);
    int64_t shape[TP_MAX_DIMS], off[TP_MAX_DIMS];
    tp_status st = tp_dtensor_shard_extent(mesh, ndim, global, m, pl, NULL, shape, off);
    tp_tensor *local = NULL, *noise = NULL;
    if (st == TP_OK)
        st = tp_tensor_zeros(TP_F32, TP_CPU, ndim, shape, &local);
    if (st == TP_OK)
        st = fill_block(local, global, off, seed);
    if (st == TP_OK)
        st = tp_tensor_zeros(TP_F32, TP_CPU, ndim, shape, &noise);
    if (st == TP_OK)
        st = fill_block(noise, global, off, seed + 1);
    bool first = true, any_partial = false;
    double noise_mult = 0;
    tp_reduce_op pop = TP_SUM;
    for (int i = 0; i < m; i++) {
        if (pl[i].kind != TP_PLACEMENT_PARTIAL)
            continue;
        any_partial = true;
        pop = pl[i].op;
        int64_t c = tp_mesh_coord(mesh, i), w = tp_mesh_size(mesh, i);
        first = first && c == 0;
        noise_mult += c == 0 ? -(double)(w - 1) : 1.0;
    }
    int64_t n = tp_tensor_numel(local);
    float *x = tp_tensor_data(local);
    const float *r = tp_tensor_data(noise);
    for (int64_t e = 0; st == TP_OK && any_partial && e < n; e++) {
        if (pop == TP_SUM)
            x[e] = (first ? x[e] : 0.0f) + (float)noise_mult * r[e];
        else
            x[e] = first ? x[e] : x[e] - 5.0f;
    }
    tp_tensor_release(noise);
    if (st == TP_OK)
        st = tp_dtensor_from_local(mesh, local, m, pl,
                                   &(tp_from_local_options){.global_shape = global}, out);
    tp_tensor_release(local);
    return st;
}

/* Checks that dt holds, as its local shard, exactly the block of the global
 * RANDINT tensor of `seed` its placements say (non-Partial layouts). */
static bool shard_is_right(tp_tensor *dt, uint64_t seed, char *why, size_t len)
{
    tp_mesh *mesh = tp_dtensor_mesh(dt);
    int nd = tp_tensor_ndim(dt), m = tp_mesh_ndim(mesh);
    int64_t shape[TP_MAX_DIMS], off[TP_MAX_DIMS];
    tp_dtensor_shard_extent(mesh, nd, tp_tensor_shape(dt), m, tp_dtensor_placements(dt), NULL,
                            shape, off);
    tp_tensor *want = NULL, *local = tp_dtensor_local(dt);
    if (tp_tensor_ndim(local) != nd ||
        memcmp(tp_tensor_shape(local), shape, sizeof(int64_t) * (size_t)nd) != 0) {
        snprintf(why, len, "local shape is not the shard shape");
        return false;
    }
    tp_tensor_zeros(TP_F32, TP_CPU, nd, shape, &want);
    fill_block(want, tp_tensor_shape(dt), off, seed);
    bool eq = false;
    tp_tensor_equal(local, want, &eq);
    tp_tensor_release(want);
    if (!eq)
        snprintf(why, len, "local shard values differ from the global tensor's block");
    return eq;
}

static bool full_is_right(tp_tensor *full, int nd, const int64_t *global, uint64_t seed)
{
    tp_tensor *want = NULL;
    tp_tensor_zeros(TP_F32, TP_CPU, nd, global, &want);
    fill_block(want, global, NULL, seed);
    bool eq = false;
    tp_tensor_equal(full, want, &eq);
    tp_tensor_release(want);
    return eq;
}

/* ---- distribute and full_tensor round trips ------------------------------- */

typedef struct {
    mesh_spec mesh;
    tp_test_slot slot[TP_TEST_MAX_RANKS];
} rt_ctx;

static tp_status roundtrip_body(tp_comm *w, void *arg)
{
    rt_ctx *c = arg;
    tp_test_slot *s = &c->slot[tp_comm_rank(w)];
    tp_mesh *mesh = NULL;
    RANK_OK(s, tp_mesh_create(w, c->mesh.ndim, c->mesh.shape, NULL, &mesh));
    int m = c->mesh.ndim;
    static const int64_t shapes[][3] = {{8, 6, 4}, {5, 3, 7}, {1, 2, 3}, {0, 4, 2}, {9, 1, 5}};
    tp_placement opts[] = {tp_replicate(), tp_shard(0), tp_shard(1), tp_shard(-1)};
    for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
        for (int combo = 0; combo < 64; combo++) {
            tp_placement pl[TP_MESH_MAX_DIMS];
            int x = combo;
            for (int i = 0; i < m; i++, x /= 4)
                pl[i] = opts[x % 4];
            if (x)
                break;
            tp_tensor *full = NULL, *dt = NULL, *back = NULL;
            RANK_OK(s, tp_tensor_zeros(TP_F32, TP_CPU, 3, shapes[k], &full));
            RANK_OK(s, fill_block(full, shapes[k], NULL, SEED));
            /* src_rank 0 broadcasts; the others pass garbage of the same shape */
            if (tp_mesh_rank(mesh) != 0)
                RANK_OK(s, tp_tensor_fill(full, -99));
            RANK_OK(s, tp_dtensor_distribute(mesh, full, m, pl, 0, &dt));
            char why[128] = "";
            char ps[64];
            RANK_EXPECT(s, shard_is_right(dt, SEED, why, sizeof why), "distribute %s of [%lld,%lld,%lld]: %s",
                        tp_placements_str(m, pl, ps, sizeof ps), (long long)shapes[k][0],
                        (long long)shapes[k][1], (long long)shapes[k][2], why);
            RANK_OK(s, tp_dtensor_full_tensor(dt, &back));
            RANK_EXPECT(s, full_is_right(back, 3, shapes[k], SEED), "full_tensor %s wrong",
                        tp_placements_str(m, pl, ps, sizeof ps));
            tp_tensor_release(full);
            tp_tensor_release(dt);
            tp_tensor_release(back);
        }
    }
    tp_mesh_free(mesh);
    return TP_OK;
}

static const mesh_spec roundtrip_meshes[] = {
    {1, {1}, {0}}, {1, {2}, {0}}, {1, {3}, {0}}, {1, {4}, {0}}, {1, {8}, {0}},
    {2, {2, 2}, {0}}, {2, {4, 2}, {0}}, {2, {2, 3}, {0}}, {3, {2, 2, 2}, {0}},
};

ParameterizedTestParameters(dtensor, roundtrip)
{
    return cr_make_param_array(mesh_spec, (void *)roundtrip_meshes,
                               sizeof roundtrip_meshes / sizeof roundtrip_meshes[0]);
}

ParameterizedTest(const mesh_spec *ms, dtensor, roundtrip, .timeout = 120)
{
    rt_ctx c = {.mesh = *ms};
    int n = 1;
    for (int i = 0; i < ms->ndim; i++)
        n *= (int)ms->shape[i];
    tp_test_run(n, roundtrip_body, &c, c.slot);
}

/* ---- property test: random redistributions ------------------------------- */

typedef struct {
    int world;
    int trials;
    int done[TP_TEST_MAX_RANKS];
    tp_test_slot slot[TP_TEST_MAX_RANKS];
} prop_ctx;

static uint64_t lcg(uint64_t *s)
{
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return *s >> 33;
}

/* A random placement for mesh dim i of a tensor with nd dims; partial allowed
 * when `pop` >= 0 (that op). */
static tp_placement random_placement(uint64_t *rs, int nd, int pop)
{
    int k = (int)(lcg(rs) % (pop >= 0 ? 4 : 3));
    if (k == 0 || nd == 0)
        return tp_replicate();
    if (k == 3)
        return tp_partial((tp_reduce_op)pop);
    return tp_shard((int)(lcg(rs) % (uint64_t)nd));
}

static tp_status prop_body(tp_comm *w, void *arg)
{
    prop_ctx *c = arg;
    int r = tp_comm_rank(w);
    tp_test_slot *s = &c->slot[r];
    /* every mesh whose size is the world size */
    static const mesh_spec all[] = {
        {1, {1}, {0}}, {1, {2}, {0}}, {1, {3}, {0}}, {1, {4}, {0}}, {1, {6}, {0}},
        {1, {8}, {0}}, {2, {2, 2}, {0}}, {2, {4, 2}, {0}}, {2, {2, 4}, {0}}, {2, {2, 3}, {0}},
        {2, {3, 2}, {0}}, {2, {1, 4}, {0}}, {3, {2, 2, 2}, {0}}, {3, {2, 1, 3}, {0}},
    };
    tp_mesh *meshes[16];
    int nm = 0;
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) {
        int64_t n = 1;
        for (int d = 0; d < all[i].ndim; d++)
            n *= all[i].shape[d];
        if (n == c->world)
            RANK_OK(s, tp_mesh_create(w, all[i].ndim, all[i].shape, NULL, &meshes[nm++]));
    }
    uint64_t rs = 42 + (uint64_t)c->world; /* the same sequence on every rank */
    tp_comm_debug *dbg = NULL;
    RANK_OK(s, tp_comm_debug_create(&dbg));
    for (int t = 0; t < c->trials; t++) {
        tp_mesh *mesh = meshes[lcg(&rs) % (uint64_t)nm];
        int m = tp_mesh_ndim(mesh);
        int nd = 1 + (int)(lcg(&rs) % 3);
        int64_t global[3];
        for (int d = 0; d < nd; d++)
            global[d] = (int64_t)(lcg(&rs) % 8); /* 0..7: empty and uneven shards */
        int pop = (lcg(&rs) % 3 == 0) ? -1 : (lcg(&rs) % 2 ? TP_SUM : TP_MAX);
        tp_placement src[TP_MESH_MAX_DIMS], dst[TP_MESH_MAX_DIMS];
        for (int i = 0; i < m; i++)
            src[i] = random_placement(&rs, nd, pop);
        for (int i = 0; i < m; i++) {
            dst[i] = random_placement(&rs, nd, -1);
            /* a Partial target is allowed where the source already is, and
             * Partial(sum) where it is a Shard (not mixed with max) */
            if (src[i].kind == TP_PLACEMENT_PARTIAL && lcg(&rs) % 3 == 0)
                dst[i] = src[i];
            else if (src[i].kind == TP_PLACEMENT_SHARD && pop != TP_MAX && lcg(&rs) % 4 == 0)
                dst[i] = tp_partial(TP_SUM);
        }
        uint64_t seed = 1000 + (uint64_t)t;
        tp_tensor *dt = NULL, *out = NULL, *full = NULL;
        RANK_OK(s, make_source(mesh, nd, global, src, seed, &dt));
        int64_t predicted[TP_COLL_KIND_COUNT];
        RANK_OK(s, tp_dtensor_plan_collectives(mesh, nd, m, src, dst, predicted));
        RANK_OK(s, tp_comm_debug_begin(dbg));
        tp_status st = tp_dtensor_redistribute(dt, m, dst, &out);
        RANK_OK(s, tp_comm_debug_end(dbg));
        char a[64], b[64];
        tp_placements_str(m, src, a, sizeof a);
        tp_placements_str(m, dst, b, sizeof b);
        RANK_EXPECT(s, st == TP_OK, "trial %d %s -> %s: %s %s", t, a, b, tp_status_name(st),
                    tp_last_error());
        if (st != TP_OK)
            return st;
        for (int k = 0; k < TP_COLL_KIND_COUNT; k++)
            RANK_EXPECT(s, tp_comm_debug_count(dbg, (tp_coll_kind)k) == predicted[k],
                        "trial %d %s -> %s: %lld %s issued, planner said %lld", t, a, b,
                        (long long)tp_comm_debug_count(dbg, (tp_coll_kind)k),
                        tp_coll_kind_name((tp_coll_kind)k), (long long)predicted[k]);
        bool has_partial = false;
        for (int i = 0; i < m; i++)
            has_partial |= dst[i].kind == TP_PLACEMENT_PARTIAL;
        char why[128] = "";
        if (!has_partial)
            RANK_EXPECT(s, shard_is_right(out, seed, why, sizeof why),
                        "trial %d %s -> %s on a %d-d mesh, global [%lld %lld %lld]: %s", t, a, b,
                        m, (long long)global[0], (long long)(nd > 1 ? global[1] : -1),
                        (long long)(nd > 2 ? global[2] : -1), why);
        RANK_OK(s, tp_dtensor_full_tensor(out, &full));
        RANK_EXPECT(s, full_is_right(full, nd, global, seed), "trial %d %s -> %s: full tensor wrong",
                    t, a, b);
        tp_tensor_release(dt);
        tp_tensor_release(out);
        tp_tensor_release(full);
        c->done[r]++;
    }
    tp_comm_debug_free(dbg);
    for (int i = 0; i < nm; i++)
        tp_mesh_free(meshes[i]);
    return TP_OK;
}

Test(dtensor, random_redistributions, .timeout = 300)
{
    static const int worlds[] = {1, 2, 3, 4, 6, 8};
    int total = 0;
    for (size_t i = 0; i < sizeof worlds / sizeof worlds[0]; i++) {
        prop_ctx c = {.world = worlds[i], .trials = 200};
        tp_test_run(worlds[i], prop_body, &c, c.slot);
        for (int r = 0; r < worlds[i]; r++)
            if (tp_test_rank_is_local(r))
                cr_assert_eq(c.done[r], c.trials, "world %d rank %d ran %d trials", worlds[i], r,
                             c.done[r]);
        total += c.trials;
    }
    cr_assert_geq(total, 1000);
}

/* ---- the DESIGN table: counts forward and backward ------------------------ */

typedef struct {
    tp_placement src, dst;
    int64_t fwd[TP_COLL_KIND_COUNT], bwd[TP_COLL_KIND_COUNT];
    bool grad_r; /* the gradient of the local output is Replicate (not dst) */
} table_row;

#define AG TP_COLL_ALL_GATHER
#define AR TP_COLL_ALL_REDUCE
#define RS TP_COLL_REDUCE_SCATTER
#define A2A TP_COLL_ALL_TO_ALL

typedef struct {
    tp_test_slot slot[TP_TEST_MAX_RANKS];
} table_ctx;

static tp_status table_body(tp_comm *w, void *arg)
{
    table_ctx *c = arg;
    tp_test_slot *s = &c->slot[tp_comm_rank(w)];
    int n = tp_comm_size(w);
    int64_t W = n;
    tp_mesh *mesh = NULL;
    RANK_OK(s, tp_mesh_create(w, 1, &W, NULL, &mesh));
    table_row rows[] = {
        {tp_shard(0), tp_replicate(), {[AG] = 1}, {0}, false},       /* grad R: local chunk */
        {tp_replicate(), tp_shard(0), {0}, {[AG] = 1}, false},       /* grad S(0) -> R */
        {tp_partial(TP_SUM), tp_replicate(), {[AR] = 1}, {0}, false}, /* grad stays R */
        {tp_partial(TP_SUM), tp_shard(0), {[RS] = 1}, {[AG] = 1}, false}, /* grad S(0) -> R */
        {tp_shard(0), tp_shard(1), {[A2A] = 1}, {[A2A] = 1}, false},
        {tp_shard(1), tp_replicate(), {[AG] = 1}, {0}, false},
        {tp_shard(0), tp_shard(0), {0}, {0}, false},
        {tp_replicate(), tp_replicate(), {0}, {0}, false},
        /* S -> P(sum): zero-filled locally; a Replicate gradient is chunked */
        {tp_shard(0), tp_partial(TP_SUM), {0}, {0}, true},
        {tp_shard(1), tp_partial(TP_SUM), {0}, {0}, true},
    };
    int64_t shape[2] = {4 * W + 1, 3 * W};
    tp_comm_debug *dbg = NULL;
    RANK_OK(s, tp_comm_debug_create(&dbg));
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        table_row *row = &rows[i];
        tp_tensor *local = NULL, *dt = NULL, *out = NULL, *ol = NULL, *g = NULL;
        int64_t ls[2], off[2];
        RANK_OK(s, tp_dtensor_shard_extent(mesh, 2, shape, 1, &row->src, NULL, ls, off));
        RANK_OK(s, tp_tensor_zeros(TP_F32, TP_CPU, 2, ls, &local));
        RANK_OK(s, fill_block(local, shape, off, SEED));
        RANK_OK(s, tp_tensor_set_requires_grad(local, true));
        RANK_OK(s, tp_dtensor_from_local(mesh, local, 1, &row->src,
                                         &(tp_from_local_options){.global_shape = shape}, &dt));
        RANK_OK(s, tp_comm_debug_begin(dbg));
        RANK_OK(s, tp_dtensor_redistribute(dt, 1, &row->dst, &out));
        tp_placement rep = tp_replicate();
        RANK_OK(s, tp_dtensor_to_local(out, row->grad_r ? 1 : 0, row->grad_r ? &rep : NULL, &ol));
        RANK_OK(s, tp_tensor_zeros(TP_F32, TP_CPU, tp_tensor_ndim(ol), tp_tensor_shape(ol), &g));
        RANK_OK(s, tp_tensor_fill(g, 1));
        RANK_OK(s, tp_backward(ol, g));
        RANK_OK(s, tp_comm_debug_end(dbg));
        char a[32], b[32];
        tp_placement_str(row->src, a, sizeof a);
        tp_placement_str(row->dst, b, sizeof b);
        for (int k = 0; k < TP_COLL_KIND_COUNT; k++) {
            int64_t f = tp_comm_debug_module_count(dbg, TP_COMM_DEBUG_GLOBAL, TP_PHASE_FORWARD,
                                                   (tp_coll_kind)k);
            int64_t bw = tp_comm_debug_module_count(dbg, TP_COMM_DEBUG_GLOBAL, TP_PHASE_BACKWARD,
                                                    (tp_coll_kind)k);
            int64_t ef = n == 1 ? 0 : row->fwd[k], eb = n == 1 ? 0 : row->bwd[k];
            RANK_EXPECT(s, f == ef && bw == eb, "%s -> %s: %s forward %lld (want %lld), backward "
                        "%lld (want %lld)", a, b, tp_coll_kind_name((tp_coll_kind)k),
                        (long long)f, (long long)ef, (long long)bw, (long long)eb);
        }
        /* the gradient reaching the source shard: ones for non-Partial sources
         * (every element of the global tensor got gradient 1) */
        tp_tensor *gl = tp_tensor_grad(local);
        RANK_EXPECT(s, gl != NULL, "%s -> %s: no gradient reached the source", a, b);
        if (gl) {
            bool ok = tp_tensor_ndim(gl) == 2 && tp_tensor_size(gl, 0) == ls[0] &&
                      tp_tensor_size(gl, 1) == ls[1];
            for (int64_t e0 = 0; ok && e0 < ls[0]; e0++)
                for (int64_t e1 = 0; ok && e1 < ls[1]; e1++) {
                    double v = 0;
                    tp_tensor_get(gl, (int64_t[]){e0, e1}, &v);
                    ok = v == 1.0;
                }
            RANK_EXPECT(s, ok, "%s -> %s: the source gradient is not all ones", a, b);
        }
        tp_tensor_release(local);
        tp_tensor_release(dt);
        tp_tensor_release(out);
        tp_tensor_release(ol);
        tp_tensor_release(g);
    }
    tp_comm_debug_free(dbg);
    tp_mesh_free(mesh);
    return TP_OK;
}

TP_TEST_WORLD_SIZE_PARAMS(dtensor, design_table_counts)

ParameterizedTest(int *n, dtensor, design_table_counts, .timeout = 60)
{
    table_ctx c = {0};
    tp_test_run(*n, table_body, &c, c.slot);
}

/* ---- Shard -> Partial(sum) on 1-D and 2-D meshes ------------------------ */

typedef struct {
    int m;
    tp_placement src[2], dst[2];
    bool exact_local; /* the local is src's block in place in dst's extent, zeros elsewhere */
    bool ag_dim1;     /* the plan all_gathers on mesh dim 1 first (nested sharding undone),
                       * and so does the backward that nests it again */
} sp_case;

typedef struct {
    mesh_spec mesh;
    tp_test_slot slot[TP_TEST_MAX_RANKS];
} sp_ctx;

static bool same_placement(tp_placement a, tp_placement b)
{
    return a.kind == b.kind && (a.kind != TP_PLACEMENT_SHARD || a.dim == b.dim) &&
           (a.kind != TP_PLACEMENT_PARTIAL || a.op == b.op);
}

/* Expected local of `dst` when each rank keeps exactly its `src` block: zeros
 * of dst's extent with the global values at src's block. */
static tp_status sp_expected(tp_mesh *mesh, int nd, const int64_t *global, const tp_placement *src,
                             const tp_placement *dst, uint64_t seed, tp_tensor **out)
{
    int m = tp_mesh_ndim(mesh);
    int64_t ss[TP_MAX_DIMS], so[TP_MAX_DIMS], ds[TP_MAX_DIMS], dof[TP_MAX_DIMS];
    TP_TEST_TRY(tp_dtensor_shard_extent(mesh, nd, global, m, src, NULL, ss, so));
    TP_TEST_TRY(tp_dtensor_shard_extent(mesh, nd, global, m, dst, NULL, ds, dof));
    TP_TEST_TRY(tp_tensor_zeros(TP_F32, TP_CPU, nd, ds, out));
    tp_tensor *v = tp_tensor_retain(*out), *next = NULL;
    tp_status st = TP_OK;
    for (int d = 0; d < nd && st == TP_OK; d++) {
        st = tp_tensor_narrow(v, d, so[d] - dof[d], ss[d], &next);
        tp_tensor_release(v);
        v = next;
    }
    if (st == TP_OK)
        st = fill_block(v, global, so, seed);
    tp_tensor_release(v);
    return st;
}

static tp_status sp_body(tp_comm *w, void *arg)
{
    sp_ctx *c = arg;
    tp_test_slot *s = &c->slot[tp_comm_rank(w)];
    tp_mesh *mesh = NULL;
    RANK_OK(s, tp_mesh_create(w, c->mesh.ndim, c->mesh.shape, NULL, &mesh));
    int m = c->mesh.ndim;
    tp_placement R = tp_replicate(), S0 = tp_shard(0), S1 = tp_shard(1), P = tp_partial(TP_SUM);
    const sp_case cases[] = {
        {1, {S0}, {P}, true, false},
        {1, {S1}, {P}, true, false},
        {2, {S0, S0}, {P, P}, true, false},
        {2, {S0, S0}, {S0, P}, true, false},
        {2, {S0, S1}, {P, S1}, true, false},
        {2, {S0, S1}, {S0, P}, true, false},
        {2, {S1, R}, {P, R}, true, false},
        {2, {R, S0}, {R, P}, true, false},
        {2, {S0, S0}, {P, S0}, false, true},
    };
    static const int64_t shapes[][2] = {{7, 5}, {8, 6}, {2, 9}, {0, 3}, {13, 1}};
    tp_comm_debug *dbg = NULL;
    RANK_OK(s, tp_comm_debug_create(&dbg));
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const sp_case *k = &cases[ci];
        if (k->m != m)
            continue;
        for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
            const int64_t *global = shapes[si];
            uint64_t seed = 77 + si;
            char a[64], b[64];
            tp_placements_str(m, k->src, a, sizeof a);
            tp_placements_str(m, k->dst, b, sizeof b);
            tp_tensor *dt = NULL, *out = NULL, *full = NULL, *want = NULL, *ones = NULL;
            int64_t ls[2], lo[2];
            RANK_OK(s, tp_dtensor_shard_extent(mesh, 2, global, m, k->src, NULL, ls, lo));
            tp_tensor *local = NULL;
            RANK_OK(s, tp_tensor_zeros(TP_F32, TP_CPU, 2, ls, &local));
            RANK_OK(s, fill_block(local, global, lo, seed));
            RANK_OK(s, tp_tensor_set_requires_grad(local, true));
            RANK_OK(s, tp_dtensor_from_local(mesh, local, m, k->src,
                                             &(tp_from_local_options){.global_shape = global},
                                             &dt));
            int64_t planned[TP_COLL_KIND_COUNT];
            RANK_OK(s, tp_dtensor_plan_collectives(mesh, 2, m, k->src, k->dst, planned));
            RANK_OK(s, tp_comm_debug_begin(dbg));
            RANK_OK(s, tp_dtensor_redistribute(dt, m, k->dst, &out));
            RANK_OK(s, tp_comm_debug_end(dbg));
            int64_t want_ag = k->ag_dim1 && tp_mesh_size(mesh, 1) > 1 ? 1 : 0;
            for (int kk = 0; kk < TP_COLL_KIND_COUNT; kk++) {
                int64_t got = tp_comm_debug_count(dbg, (tp_coll_kind)kk);
                int64_t e = kk == TP_COLL_ALL_GATHER ? want_ag : 0;
                RANK_EXPECT(s, got == e && planned[kk] == e,
                            "%s -> %s of [%lld, %lld]: %lld %s (planned %lld, want %lld)", a, b,
                            (long long)global[0], (long long)global[1], (long long)got,
                            tp_coll_kind_name((tp_coll_kind)kk), (long long)planned[kk],
                            (long long)e);
            }
            for (int i = 0; i < m; i++)
                RANK_EXPECT(s, same_placement(tp_dtensor_placements(out)[i], k->dst[i]),
                            "%s -> %s: placement %d differs", a, b, i);
            if (k->exact_local) {
                RANK_OK(s, sp_expected(mesh, 2, global, k->src, k->dst, seed, &want));
                bool eq = false;
                RANK_OK(s, tp_tensor_equal(tp_dtensor_local(out), want, &eq));
                RANK_EXPECT(s, eq, "%s -> %s of [%lld, %lld]: the local is not this rank's "
                            "shard in place with zeros elsewhere", a, b, (long long)global[0],
                            (long long)global[1]);
            }
            /* the terms sum to the value; the Replicate gradient is chunked back
             * (when the forward undid nested sharding, re-nesting the gradient
             * all_gathers once on mesh dim 1) */
            RANK_OK(s, tp_dtensor_full_tensor(out, &full));
            RANK_EXPECT(s, full_is_right(full, 2, global, seed), "%s -> %s of [%lld, %lld]: "
                        "full tensor wrong", a, b, (long long)global[0], (long long)global[1]);
            RANK_OK(s, tp_tensor_zeros(TP_F32, TP_CPU, 2, global, &ones));
            RANK_OK(s, tp_tensor_fill(ones, 1));
            RANK_OK(s, tp_comm_debug_begin(dbg));
            RANK_OK(s, tp_backward(full, ones));
            RANK_OK(s, tp_comm_debug_end(dbg));
            RANK_EXPECT(s, tp_comm_debug_total(dbg) == want_ag &&
                               tp_comm_debug_count(dbg, TP_COLL_ALL_GATHER) == want_ag,
                        "%s -> %s: backward issued %lld collectives, want %lld all_gathers", a, b,
                        (long long)tp_comm_debug_total(dbg), (long long)want_ag);
            tp_tensor *gl = tp_tensor_grad(local);
            bool ones_ok = gl && tp_tensor_numel(gl) == ls[0] * ls[1];
            for (int64_t e = 0; ones_ok && e < ls[0] * ls[1]; e++) {
                double v = 0;
                tp_tensor_get(gl, (int64_t[]){e / ls[1], e % ls[1]}, &v);
                ones_ok = v == 1.0;
            }
            RANK_EXPECT(s, ones_ok || ls[0] * ls[1] == 0, "%s -> %s: the source gradient is "
                        "not all ones", a, b);
            tp_tensor *all[] = {local, dt, out, full, want, ones};
            for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
                tp_tensor_release(all[i]);
        }
    }
    tp_comm_debug_free(dbg);
    tp_mesh_free(mesh);
    return TP_OK;
}

static const mesh_spec sp_meshes[] = {
    {1, {1}, {0}},    {1, {2}, {0}},    {1, {3}, {0}},    {1, {4}, {0}},
    {1, {8}, {0}},    {2, {2, 2}, {0}}, {2, {2, 3}, {0}}, {2, {4, 2}, {0}},
};

ParameterizedTestParameters(dtensor, shard_to_partial_sum)
{
    return cr_make_param_array(mesh_spec, (void *)sp_meshes, sizeof sp_meshes / sizeof sp_meshes[0]);
}

ParameterizedTest(const mesh_spec *ms, dtensor, shard_to_partial_sum, .timeout = 120)
{
    sp_ctx c = {.mesh = *ms};
    int n = 1;
    for (int i = 0; i < ms->ndim; i++)
        n *= (int)ms->shape[i];
    tp_test_run(n, sp_body, &c, c.slot);
}

/* ---- distribute: scatter Shard dims, broadcast Replicate dims ------------- */

/* The collectives rank `me` (mesh coordinates) issues distributing from
 * `src` with placements pl of a [global] f32 tensor: mesh dim by mesh dim,
 * by the ranks whose coordinates equal src's on every later dim, a scatter
 * of the padded level block for a Shard dim, a broadcast of it for
 * Replicate. */
static void dist_expected(const tp_mesh *mesh, int nd, const int64_t *global,
                          const tp_placement *pl, int src, int64_t count[TP_COLL_KIND_COUNT],
                          int64_t bytes[TP_COLL_KIND_COUNT])
{
    int m = tp_mesh_ndim(mesh);
    int64_t sc[TP_MESH_MAX_DIMS], rest = src, shape[TP_MAX_DIMS];
    for (int i = m - 1; i >= 0; i--) {
        sc[i] = rest % tp_mesh_size(mesh, i);
        rest /= tp_mesh_size(mesh, i);
    }
    memset(count, 0, sizeof(int64_t) * TP_COLL_KIND_COUNT);
    memset(bytes, 0, sizeof(int64_t) * TP_COLL_KIND_COUNT);
    memcpy(shape, global, sizeof(int64_t) * (size_t)nd);
    for (int i = 0; i < m; i++) {
        bool part = true;
        for (int j = i + 1; j < m; j++)
            part = part && tp_mesh_coord(mesh, j) == sc[j];
        int64_t w = tp_mesh_size(mesh, i), numel = 1;
        int d = pl[i].kind == TP_PLACEMENT_SHARD ? pl[i].dim : -1;
        for (int e = 0; e < nd; e++)
            numel *= e == d ? (shape[e] + w - 1) / w * w : shape[e];
        if (part) {
            tp_coll_kind kind = d >= 0 ? TP_COLL_SCATTER : TP_COLL_BROADCAST;
            count[kind]++;
            bytes[kind] += numel * 4;
        }
        if (d >= 0) {
            int64_t start = 0, len = 0;
            tp_chunk_range(shape[d], w, tp_mesh_coord(mesh, i), &start, &len);
            shape[d] = len;
        }
    }
}

static tp_status dist_body(tp_comm *w, void *arg)
{
    rt_ctx *c = arg;
    int me = tp_comm_rank(w);
    tp_test_slot *s = &c->slot[me];
    tp_mesh *mesh = NULL;
    RANK_OK(s, tp_mesh_create(w, c->mesh.ndim, c->mesh.shape, NULL, &mesh));
    int m = c->mesh.ndim, n = (int)tp_mesh_numel(mesh);
    static const int64_t shapes[][2] = {{8, 6}, {5, 3}, {1, 7}, {0, 4}, {9, 2}};
    tp_placement opts[] = {tp_replicate(), tp_shard(0), tp_shard(1)};
    tp_comm_debug *dbg = NULL;
    RANK_OK(s, tp_comm_debug_create(&dbg));
    for (int src = 0; src < n; src++) {
        for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
            for (int combo = 0; combo < 9; combo++) {
                tp_placement pl[2];
                int x = combo;
                for (int i = 0; i < m; i++, x /= 3)
                    pl[i] = opts[x % 3];
                if (x)
                    break;
                /* every rank holds different values: only src's may arrive */
                tp_tensor *full = NULL, *dt = NULL;
                RANK_OK(s, tp_tensor_zeros(TP_F32, TP_CPU, 2, shapes[k], &full));
                RANK_OK(s, fill_block(full, shapes[k], NULL, SEED + (uint64_t)me));
                RANK_OK(s, tp_comm_debug_begin(dbg));
                RANK_OK(s, tp_dtensor_distribute(mesh, full, m, pl, src, &dt));
                RANK_OK(s, tp_comm_debug_end(dbg));
                char why[128] = "", ps[64];
                tp_placements_str(m, pl, ps, sizeof ps);
                RANK_EXPECT(s, shard_is_right(dt, SEED + (uint64_t)src, why, sizeof why),
                            "distribute %s of [%lld, %lld] from %d: %s", ps,
                            (long long)shapes[k][0], (long long)shapes[k][1], src, why);
                int64_t count[TP_COLL_KIND_COUNT], bytes[TP_COLL_KIND_COUNT];
                dist_expected(mesh, 2, shapes[k], pl, src, count, bytes);
                for (int kk = 0; kk < TP_COLL_KIND_COUNT; kk++)
                    RANK_EXPECT(s, tp_comm_debug_count(dbg, (tp_coll_kind)kk) == count[kk] &&
                                       tp_comm_debug_bytes(dbg, (tp_coll_kind)kk) == bytes[kk],
                                "distribute %s of [%lld, %lld] from %d: %lld %s of %lld bytes, "
                                "want %lld of %lld", ps, (long long)shapes[k][0],
                                (long long)shapes[k][1], src,
                                (long long)tp_comm_debug_count(dbg, (tp_coll_kind)kk),
                                tp_coll_kind_name((tp_coll_kind)kk),
                                (long long)tp_comm_debug_bytes(dbg, (tp_coll_kind)kk),
                                (long long)count[kk], (long long)bytes[kk]);
                /* the caller's tensor is neither changed nor shared */
                RANK_EXPECT(s, full_is_right(full, 2, shapes[k], SEED + (uint64_t)me) &&
                                   tp_dtensor_local(dt) != full,
                            "distribute %s from %d changed or kept the caller's tensor", ps, src);
                tp_tensor_release(full);
                tp_tensor_release(dt);
            }
        }
    }
    /* src_rank < 0: every rank's own values, nothing sent */
    tp_tensor *full = NULL, *dt = NULL;
    RANK_OK(s, tp_tensor_zeros(TP_F32, TP_CPU, 2, shapes[0], &full));
    RANK_OK(s, fill_block(full, shapes[0], NULL, SEED + (uint64_t)me));
    RANK_OK(s, tp_comm_debug_begin(dbg));
    RANK_OK(s, tp_dtensor_distribute(mesh, full, m, (tp_placement[]){opts[1], opts[2]}, -1, &dt));
    RANK_OK(s, tp_comm_debug_end(dbg));
    char why[128] = "";
    RANK_EXPECT(s, shard_is_right(dt, SEED + (uint64_t)me, why, sizeof why) &&
                       tp_comm_debug_total(dbg) == 0,
                "distribute from no rank: %s, %lld collectives", why,
                (long long)tp_comm_debug_total(dbg));
    /* the shard is a copy, even where it is contiguous in the caller's
     * tensor: overwriting (or freeing) that tensor leaves the DTensor whole */
    RANK_OK(s, fill_block(full, shapes[0], NULL, SEED + 100 + (uint64_t)me));
    RANK_EXPECT(s, shard_is_right(dt, SEED + (uint64_t)me, why, sizeof why),
                "distribute from no rank shares the caller's storage: %s", why);
    tp_tensor_release(full);
    tp_tensor_release(dt);
    tp_comm_debug_free(dbg);
    tp_mesh_free(mesh);
    return TP_OK;
}

static const mesh_spec dist_meshes[] = {
    {1, {1}, {0}},    {1, {2}, {0}},    {1, {3}, {0}},    {1, {4}, {0}},
    {1, {8}, {0}},    {2, {2, 2}, {0}}, {2, {2, 3}, {0}}, {2, {4, 2}, {0}},
};

ParameterizedTestParameters(dtensor, distribute_scatters)
{
    return cr_make_param_array(mesh_spec, (void *)dist_meshes,
                               sizeof dist_meshes / sizeof dist_meshes[0]);
}

ParameterizedTest(const mesh_spec *ms, dtensor, distribute_scatters, .timeout = 120)
{
    rt_ctx c = {.mesh = *ms};
    int n = 1;
    for (int i = 0; i < ms->ndim; i++)
        n *= (int)ms->shape[i];
    tp_test_run(n, dist_body, &c, c.slot);
}

/* ---- errors ----------------------------------------------------------------- */

static tp_status errors_body(tp_comm *w, void *arg)
{
    table_ctx *c = arg;
    tp_test_slot *s = &c->slot[tp_comm_rank(w)];
    int64_t ms[2] = {2, 2}, sh[2] = {4, 6};
    tp_mesh *mesh = NULL;
    RANK_OK(s, tp_mesh_create(w, 2, ms, (const char *[]){"dp", "tp"}, &mesh));
    tp_tensor *full = NULL, *dt = NULL, *out = (tp_tensor *)1, *pt = NULL;
    RANK_OK(s, tp_tensor_zeros(TP_F32, TP_CPU, 2, sh, &full));
    tp_placement rr[2] = {tp_replicate(), tp_replicate()};
#define ERR(call, code, needle)                                                                \
    do {                                                                                       \
        tp_status st_ = (call);                                                                \
        RANK_EXPECT(s, st_ == (code) && strstr(tp_last_error(), needle), "%s: %s '%s'", #call, \
                    tp_status_name(st_), tp_last_error());                                     \
    } while (0)
    ERR(tp_dtensor_distribute(mesh, full, 1, rr, -1, &out), TP_ERR_INVALID_ARG,
        "1 placements for a 2-d mesh");
    RANK_EXPECT(s, out == NULL, "out not reset on failure");
    ERR(tp_dtensor_distribute(mesh, full, 2, (tp_placement[]){tp_shard(2), tp_replicate()}, -1,
                              &out),
        TP_ERR_INVALID_ARG, "Shard(2) but the tensor has 2 dims");
    ERR(tp_dtensor_distribute(mesh, full, 2, (tp_placement[]){tp_partial(TP_SUM), tp_replicate()},
                              -1, &out),
        TP_ERR_INVALID_ARG, "Partial, not allowed here");
    ERR(tp_dtensor_distribute(mesh, full, 2, rr, 4, &out), TP_ERR_INVALID_ARG, "src_rank 4");
    ERR(tp_dtensor_distribute(NULL, full, 2, rr, 0, &out), TP_ERR_INVALID_ARG, "mesh is NULL");
    RANK_OK(s, tp_dtensor_distribute(mesh, full, 2, (tp_placement[]){tp_shard(0), tp_shard(1)}, -1,
                                     &dt));
    /* of the conversions to Partial only Shard -> Partial(sum) is public */
    tp_tensor *pd = NULL, *rd = NULL, *mx = NULL;
    RANK_OK(s, tp_dtensor_redistribute(dt, 2, (tp_placement[]){tp_partial(TP_SUM), tp_shard(1)},
                                       &pd));
    RANK_EXPECT(s, tp_dtensor_placements(pd)[0].kind == TP_PLACEMENT_PARTIAL,
                "S(0) -> P(sum) is not Partial");
    ERR(tp_dtensor_redistribute(dt, 2, (tp_placement[]){tp_partial(TP_AVG), tp_shard(1)}, &out),
        TP_ERR_NOT_SUPPORTED, "mesh dim 0: S(0) -> P(avg) is not supported; only Shard -> "
                              "Partial(sum) is");
    RANK_OK(s, tp_dtensor_distribute(mesh, full, 2, rr, -1, &rd));
    ERR(tp_dtensor_redistribute(rd, 2, (tp_placement[]){tp_replicate(), tp_partial(TP_SUM)}, &out),
        TP_ERR_INVALID_ARG, "mesh dim 1: R -> P(sum): redistributing Replicate to Partial is for "
                            "internal use");
    RANK_OK(s, tp_dtensor_from_local(mesh, full, 2,
                                     (tp_placement[]){tp_partial(TP_MAX), tp_replicate()}, NULL,
                                     &mx));
    ERR(tp_dtensor_redistribute(mx, 2, (tp_placement[]){tp_partial(TP_SUM), tp_replicate()}, &out),
        TP_ERR_NOT_SUPPORTED, "mesh dim 0: P(max) -> P(sum) is not supported");
    RANK_EXPECT(s, out == NULL, "out not reset on failure");
    tp_tensor_release(pd);
    tp_tensor_release(rd);
    tp_tensor_release(mx);
    ERR(tp_dtensor_redistribute(dt, 3, rr, &out), TP_ERR_INVALID_ARG, "3 placements");
    ERR(tp_dtensor_redistribute(full, 2, rr, &out), TP_ERR_INVALID_ARG, "not a DTensor");
    ERR(tp_dtensor_to_local(full, 0, NULL, &out), TP_ERR_INVALID_ARG, "not a DTensor");
    int64_t counts[TP_COLL_KIND_COUNT];
    RANK_OK(s, tp_dtensor_plan_collectives(mesh, 2, 2, (tp_placement[]){tp_shard(0), tp_shard(1)},
                                           (tp_placement[]){tp_partial(TP_SUM), tp_shard(1)},
                                           counts));
    for (int k = 0; k < TP_COLL_KIND_COUNT; k++)
        RANK_EXPECT(s, counts[k] == 0, "planner: S(0) -> P(sum) issues %lld %s", (long long)counts[k],
                    tp_coll_kind_name((tp_coll_kind)k));
    ERR(tp_dtensor_plan_collectives(mesh, 2, 2, (tp_placement[]){tp_shard(0), tp_shard(1)},
                                    (tp_placement[]){tp_partial(TP_MAX), tp_shard(1)}, counts),
        TP_ERR_NOT_SUPPORTED, "S(0) -> P(max) on mesh dim 0 is not supported (Shard -> Partial "
                              "is for sum only)");
    ERR(tp_dtensor_plan_collectives(mesh, 2, 2, (tp_placement[]){tp_partial(TP_MAX), rr[1]},
                                    (tp_placement[]){tp_partial(TP_MIN), rr[1]}, counts),
        TP_ERR_NOT_SUPPORTED, "P(max) -> P(min) on mesh dim 0 is not supported");
    /* arguments that used to pass silently */
    ERR(tp_dtensor_plan_collectives(mesh, TP_MAX_DIMS + 1, 2, rr, rr, counts), TP_ERR_INVALID_ARG,
        "ndim 9 out of range [0, 8]");
    ERR(tp_dtensor_plan_collectives(mesh, -1, 2, rr, rr, counts), TP_ERR_INVALID_ARG,
        "ndim -1 out of range");
    int64_t neg[2] = {4, -3}, ls[2], lo[2];
    ERR(tp_dtensor_shard_extent(mesh, 2, neg, 2, (tp_placement[]){tp_shard(0), tp_shard(1)}, NULL,
                                ls, lo),
        TP_ERR_INVALID_ARG, "global size -3 of dim 1 is negative");
    ERR(tp_dtensor_shard_extent(mesh, 2, neg, 2, rr, NULL, ls, lo), TP_ERR_INVALID_ARG,
        "global size -3 of dim 1 is negative");
    /* core refuses DTensors where it needs memory */
    ERR(tp_tensor_narrow(dt, 0, 0, 1, &pt), TP_ERR_INVALID_ARG, "is a DTensor");
    ERR(tp_tensor_fill(dt, 1), TP_ERR_INVALID_ARG, "is a DTensor");
    ERR(tp_tensor_copy(full, dt), TP_ERR_INVALID_ARG, "is a DTensor");
    RANK_EXPECT(s, tp_tensor_data(dt) == NULL && !tp_tensor_is_contiguous(dt),
                "a DTensor exposes data");
    RANK_EXPECT(s, tp_tensor_numel(dt) == 24 && tp_tensor_is_dtensor(dt) &&
                       tp_tensor_numel(tp_dtensor_local(dt)) == 6,
                "DTensor shape accessors");
    /* from_local with a global shape this rank's shard does not fit */
    int64_t bad[2] = {5, 6};
    char want_msg[128];
    snprintf(want_msg, sizeof want_msg,
             "local shape [4, 6] is not this rank's shard [%d, 6] of global [5, 6]",
             tp_mesh_coord(mesh, 0) == 0 ? 3 : 2);
    ERR(tp_dtensor_from_local(mesh, full, 2, (tp_placement[]){tp_shard(0), tp_replicate()},
                              &(tp_from_local_options){.global_shape = bad}, &out),
        TP_ERR_INVALID_ARG, want_msg);
    /* the check option catches replicas that differ */
    tp_tensor *mine = NULL;
    RANK_OK(s, tp_tensor_zeros(TP_F32, TP_CPU, 2, sh, &mine));
    RANK_OK(s, tp_tensor_fill(mine, tp_mesh_coord(mesh, 1)));
    ERR(tp_dtensor_from_local(mesh, mine, 2, rr, &(tp_from_local_options){.check = true}, &out),
        TP_ERR_MISMATCH, "mesh dim 1 is Replicate but the ranks hold different values");
    /* backward errors */
    ERR(tp_backward(full, NULL), TP_ERR_INVALID_ARG, "does not require grad");
    ERR(tp_tensor_set_requires_grad(NULL, true), TP_ERR_INVALID_ARG, "NULL");
    tp_tensor_release(mine);
    tp_tensor_release(dt);
    tp_tensor_release(full);
    tp_mesh_free(mesh);
    return TP_OK;
}

Test(dtensor, errors, .timeout = 60)
{
    table_ctx c = {0};
    tp_test_run(4, errors_body, &c, c.slot);
}

/* ---- autograd mechanics ----------------------------------------------------- */

static tp_status autograd_body(tp_comm *w, void *arg)
{
    table_ctx *c = arg;
    tp_test_slot *s = &c->slot[tp_comm_rank(w)];
    int64_t n = tp_comm_size(w);
    tp_mesh *mesh = NULL;
    RANK_OK(s, tp_mesh_create(w, 1, &n, NULL, &mesh));
    int64_t xs[2] = {3, 4}, ws[2] = {2 * n, 4};
    tp_tensor *xf = NULL, *wf = NULL, *x = NULL, *wt = NULL, *y = NULL, *yl = NULL, *g = NULL;
    RANK_OK(s, tp_tensor_zeros(TP_F32, TP_CPU, 2, xs, &xf));
    RANK_OK(s, tp_tensor_zeros(TP_F32, TP_CPU, 2, ws, &wf));
    RANK_OK(s, fill_block(xf, xs, NULL, 5));
    RANK_OK(s, fill_block(wf, ws, NULL, 6));
    tp_placement R = tp_replicate(), S0 = tp_shard(0);
    RANK_OK(s, tp_dtensor_distribute(mesh, xf, 1, &R, -1, &x));
    RANK_OK(s, tp_dtensor_distribute(mesh, wf, 1, &S0, -1, &wt));
    RANK_OK(s, tp_tensor_set_requires_grad(wt, true));
    RANK_EXPECT(s, tp_tensor_requires_grad(wt) && !tp_tensor_has_grad_fn(wt), "leaf state");

    /* no-grad scopes record nothing */
    tp_no_grad_begin();
    RANK_EXPECT(s, !tp_grad_enabled(), "no-grad scope not reported");
    RANK_OK(s, tp_linear(x, wt, NULL, &y));
    RANK_EXPECT(s, !tp_tensor_requires_grad(y) && !tp_tensor_has_grad_fn(y),
                "an op inside no-grad recorded a node");
    tp_no_grad_end();
    RANK_EXPECT(s, tp_grad_enabled(), "no-grad scope did not end");
    tp_tensor_release(y);

    /* two backwards through two graphs accumulate; a third through a spent
     * graph is refused */
    for (int round = 0; round < 2; round++) {
        RANK_OK(s, tp_linear(x, wt, NULL, &y));
        RANK_EXPECT(s, tp_tensor_has_grad_fn(y), "the op recorded no node");
        RANK_OK(s, tp_dtensor_to_local(y, 0, NULL, &yl));
        RANK_OK(s, tp_tensor_zeros(TP_F32, TP_CPU, 2, tp_tensor_shape(yl), &g));
        RANK_OK(s, tp_tensor_fill(g, 1));
        RANK_OK(s, tp_backward(yl, g));
        if (round == 1) {
            tp_status st = tp_backward(yl, g);
            RANK_EXPECT(s, st == TP_ERR_STATE && strstr(tp_last_error(), "already freed"),
                        "second backward: %s %s", tp_status_name(st), tp_last_error());
        }
        tp_tensor_release(y);
        tp_tensor_release(yl);
        tp_tensor_release(g);
    }
    /* d/dW of sum(x W^T) is the column sums of x, twice */
    tp_tensor *gw = tp_tensor_grad(wt), *gwf = NULL;
    RANK_EXPECT(s, gw && tp_tensor_is_dtensor(gw) &&
                       tp_dtensor_placements(gw)[0].kind == TP_PLACEMENT_SHARD,
                "weight gradient missing or not sharded like the weight");
    RANK_OK(s, tp_dtensor_full_tensor(gw, &gwf));
    bool ok = true;
    for (int64_t o = 0; o < ws[0]; o++)
        for (int64_t i = 0; i < 4; i++) {
            double v = 0, colsum = 0, e = 0;
            tp_tensor_get(gwf, (int64_t[]){o, i}, &v);
            for (int64_t r = 0; r < 3; r++) {
                tp_tensor_get(xf, (int64_t[]){r, i}, &e);
                colsum += e;
            }
            ok = ok && v == 2 * colsum;
        }
    RANK_EXPECT(s, ok, "accumulated weight gradient is not twice the column sums");
    tp_tensor_zero_grad(wt);
    RANK_EXPECT(s, tp_tensor_grad(wt) == NULL, "zero_grad kept the gradient");
    /* only leaves can be marked */
    RANK_OK(s, tp_linear(x, wt, NULL, &y));
    tp_status st = tp_tensor_set_requires_grad(y, false);
    RANK_EXPECT(s, st == TP_ERR_STATE, "marking a non-leaf: %s", tp_status_name(st));
    tp_tensor *idx = NULL;
    int64_t three = 3;
    RANK_OK(s, tp_tensor_zeros(TP_I64, TP_CPU, 1, &three, &idx));
    st = tp_tensor_set_requires_grad(idx, true);
    RANK_EXPECT(s, st == TP_ERR_INVALID_ARG && strstr(tp_last_error(), "float dtype"),
                "integer leaf: %s", tp_status_name(st));
    tp_tensor *all[] = {xf, wf, x, wt, y, gwf, idx};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        tp_tensor_release(all[i]);
    tp_mesh_free(mesh);
    return TP_OK;
}

TP_TEST_WORLD_SIZE_PARAMS(dtensor, autograd)

ParameterizedTest(int *n, dtensor, autograd, .timeout = 60)
{
    table_ctx c = {0};
    tp_test_run(*n, autograd_body, &c, c.slot);
}

/* Collectives issued by a node's backward are counted for the scope the node
 * was recorded in, whatever scope backward is called from. */
static tp_status scope_body(tp_comm *w, void *arg)
{
    table_ctx *c = arg;
    tp_test_slot *s = &c->slot[tp_comm_rank(w)];
    int64_t n = tp_comm_size(w), shape[2] = {2 * n + 1, 3};
    tp_mesh *mesh = NULL;
    RANK_OK(s, tp_mesh_create(w, 1, &n, NULL, &mesh));
    tp_placement R = tp_replicate(), S0 = tp_shard(0);
    tp_tensor *full = NULL, *dt = NULL, *sh = NULL, *l = NULL, *g = NULL;
    RANK_OK(s, tp_tensor_zeros(TP_F32, TP_CPU, 2, shape, &full));
    RANK_OK(s, tp_dtensor_distribute(mesh, full, 1, &R, -1, &dt));
    RANK_OK(s, tp_tensor_set_requires_grad(dt, true));
    tp_comm_debug *dbg = NULL;
    RANK_OK(s, tp_comm_debug_create(&dbg));
    RANK_OK(s, tp_comm_debug_begin(dbg));
    RANK_OK(s, tp_comm_debug_push_scope("mlp"));
    RANK_OK(s, tp_comm_debug_push_scope("net1"));
    RANK_OK(s, tp_dtensor_redistribute(dt, 1, &S0, &sh)); /* R -> S(0): backward all_gathers */
    RANK_OK(s, tp_comm_debug_pop_scope());
    RANK_OK(s, tp_comm_debug_pop_scope());
    RANK_OK(s, tp_dtensor_to_local(sh, 0, NULL, &l));
    RANK_OK(s, tp_tensor_zeros(TP_F32, TP_CPU, 2, tp_tensor_shape(l), &g));
    RANK_OK(s, tp_comm_debug_push_scope("elsewhere"));
    RANK_OK(s, tp_backward(l, g));
    RANK_EXPECT(s, strcmp(tp_comm_debug_current_scope(), "elsewhere") == 0,
                "backward did not restore the caller's scope: %s", tp_comm_debug_current_scope());
    RANK_OK(s, tp_comm_debug_pop_scope());
    RANK_OK(s, tp_comm_debug_end(dbg));
    int64_t want = n > 1 ? 1 : 0;
    tp_test_scope_count_is(s, dbg, "mlp.net1", TP_PHASE_BACKWARD, TP_COLL_ALL_GATHER, want,
                           "the node's scope");
    tp_test_scope_count_is(s, dbg, "mlp", TP_PHASE_BACKWARD, TP_COLL_ALL_GATHER, want,
                           "the scope around the node's");
    tp_test_scope_count_is(s, dbg, "elsewhere", TP_PHASE_COUNT, TP_COLL_ANY, 0,
                           "the caller's scope (seen, without collectives)");
    tp_comm_debug_free(dbg);
    tp_tensor *all[] = {full, dt, sh, l, g};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        tp_tensor_release(all[i]);
    tp_mesh_free(mesh);
    return TP_OK;
}

TP_TEST_WORLD_SIZE_PARAMS(dtensor, backward_scopes)

ParameterizedTest(int *n, dtensor, backward_scopes, .timeout = 60)
{
    table_ctx c = {0};
    tp_test_run(*n, scope_body, &c, c.slot);
}

/* ---- gradient hooks and installed gradients ---------------------------------- */

typedef struct hook_log {
    int calls;
    double seen[4]; /* the leaf's gradient when the hook ran */
    int order[8];   /* ids of the hooks in call order */
    int n_order;
    int id;
    tp_status ret;
} hook_log;

static tp_status log_hook(tp_tensor *t, void *ctx)
{
    hook_log *l = ctx;
    tp_tensor *g = tp_tensor_grad(t);
    for (int64_t i = 0; g && i < 4 && i < tp_tensor_numel(g); i++)
        (void)tp_tensor_get(g, &i, &l->seen[i]);
    l->calls++;
    return l->ret;
}

typedef struct order_ctx {
    hook_log *log;
    int id;
} order_ctx;

static tp_status order_hook(tp_tensor *t, void *ctx)
{
    (void)t;
    order_ctx *o = ctx;
    if (o->log->n_order < 8)
        o->log->order[o->log->n_order++] = o->id;
    return TP_OK;
}

static tp_tensor *leaf4(const float *v)
{
    tp_tensor *t = NULL;
    cr_assert_eq(tp_tensor_from_data(TP_F32, 1, (int64_t[]){4}, v, &t), TP_OK);
    cr_assert_eq(tp_tensor_set_requires_grad(t, true), TP_OK);
    return t;
}

/* loss = sum(x * x + x): x reaches the loss through three edges; the hook
 * runs once, after all three, and sees 2x + 1. */
static void backward_square_plus(tp_tensor *x)
{
    tp_tensor *sq = NULL, *y = NULL, *loss = NULL;
    CHECK_OK(tp_mul(x, x, &sq));
    CHECK_OK(tp_add(sq, x, &y));
    CHECK_OK(tp_sum_all(y, &loss));
    CHECK_OK(tp_backward(loss, NULL));
    tp_tensor_release(loss);
    tp_tensor_release(y);
    tp_tensor_release(sq);
}

Test(dtensor, grad_hook_runs_once_after_the_last_contribution, .timeout = 30)
{
    const float v[4] = {1, -2, 0.5f, 3};
    tp_tensor *x = leaf4(v);
    hook_log l = {0};
    int h = 0;
    CHECK_OK(tp_tensor_add_grad_hook(x, log_hook, &l, &h));
    backward_square_plus(x);
    cr_assert_eq(l.calls, 1, "the hook ran %d times in one backward", l.calls);
    for (int i = 0; i < 4; i++)
        cr_assert_float_eq(l.seen[i], 2.0 * v[i] + 1.0, 1e-6, "element %d: %g", i, l.seen[i]);
    /* a second backward accumulates, and the hook sees the sum */
    backward_square_plus(x);
    cr_assert_eq(l.calls, 2);
    for (int i = 0; i < 4; i++)
        cr_assert_float_eq(l.seen[i], 2.0 * (2.0 * v[i] + 1.0), 1e-6);
    /* removed: not called again */
    tp_tensor_remove_grad_hook(x, h);
    tp_tensor_remove_grad_hook(x, 12345); /* unknown: no-op */
    backward_square_plus(x);
    cr_assert_eq(l.calls, 2);
    tp_tensor_release(x);
}

/* Hooks fire as the backward reaches each leaf: the last layer's parameters
 * before the first's; several hooks on one leaf in registration order. */
Test(dtensor, grad_hooks_follow_the_backward_order, .timeout = 30)
{
    tp_tensor *w1 = NULL, *w2 = NULL, *x = NULL, *h = NULL, *y = NULL, *loss = NULL;
    CHECK_OK(tp_tensor_empty(TP_F32, TP_CPU, 2, (int64_t[]){3, 4}, &w1));
    CHECK_OK(tp_tensor_empty(TP_F32, TP_CPU, 2, (int64_t[]){2, 3}, &w2));
    CHECK_OK(tp_tensor_empty(TP_F32, TP_CPU, 2, (int64_t[]){5, 4}, &x));
    CHECK_OK(tp_tensor_fill_random(w1, TP_RNG_NORMAL, 0, 1, 1, NULL, NULL));
    CHECK_OK(tp_tensor_fill_random(w2, TP_RNG_NORMAL, 0, 1, 2, NULL, NULL));
    CHECK_OK(tp_tensor_fill_random(x, TP_RNG_NORMAL, 0, 1, 3, NULL, NULL));
    CHECK_OK(tp_tensor_set_requires_grad(w1, true));
    CHECK_OK(tp_tensor_set_requires_grad(w2, true));
    hook_log l = {0};
    order_ctx o1 = {&l, 1}, o2a = {&l, 2}, o2b = {&l, 3};
    CHECK_OK(tp_tensor_add_grad_hook(w1, order_hook, &o1, NULL));
    CHECK_OK(tp_tensor_add_grad_hook(w2, order_hook, &o2a, NULL));
    CHECK_OK(tp_tensor_add_grad_hook(w2, order_hook, &o2b, NULL));
    CHECK_OK(tp_linear(x, w1, NULL, &h));
    CHECK_OK(tp_linear(h, w2, NULL, &y));
    CHECK_OK(tp_sum_all(y, &loss));
    /* hooks go on leaves only */
    CHECK_ERR(tp_tensor_add_grad_hook(y, order_hook, &o1, NULL), TP_ERR_STATE);
    CHECK_OK(tp_backward(loss, NULL));
    cr_assert_eq(l.n_order, 3);
    cr_assert(l.order[0] == 2 && l.order[1] == 3 && l.order[2] == 1,
              "hook order %d %d %d, expected w2's two hooks then w1's", l.order[0], l.order[1],
              l.order[2]);
    tp_tensor_release(loss);
    tp_tensor_release(y);
    tp_tensor_release(h);
    tp_tensor_release(x);
    tp_tensor_release(w2);
    tp_tensor_release(w1);
}

Test(dtensor, grad_hook_failure_stops_backward, .timeout = 30)
{
    const float v[4] = {1, 2, 3, 4};
    tp_tensor *x = leaf4(v);
    hook_log l = {.ret = TP_ERR_BACKEND};
    CHECK_OK(tp_tensor_add_grad_hook(x, log_hook, &l, NULL));
    tp_tensor *sq = NULL, *loss = NULL;
    CHECK_OK(tp_mul(x, x, &sq));
    CHECK_OK(tp_sum_all(sq, &loss));
    CHECK_ERR(tp_backward(loss, NULL), TP_ERR_BACKEND);
    cr_assert_eq(l.calls, 1);
    tp_tensor_release(loss);
    tp_tensor_release(sq);
    CHECK_ERR(tp_tensor_add_grad_hook(NULL, log_hook, &l, NULL), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_add_grad_hook(x, NULL, &l, NULL), TP_ERR_INVALID_ARG);
    tp_tensor *plain = NULL;
    CHECK_OK(tp_tensor_zeros(TP_F32, TP_CPU, 1, (int64_t[]){4}, &plain));
    CHECK_ERR(tp_tensor_add_grad_hook(plain, log_hook, &l, NULL), TP_ERR_INVALID_ARG);
    tp_tensor_release(plain);
    tp_tensor_release(x);
}

/* A gradient installed as a view into a larger buffer receives the backward
 * in place: the buffer holds the gradient without a copy, and a second
 * backward adds into it. */
Test(dtensor, set_grad_accumulates_into_a_bucket_view, .timeout = 30)
{
    const float v[4] = {1, -2, 0.5f, 3};
    tp_tensor *x = leaf4(v);
    tp_tensor *bucket = NULL, *view = NULL;
    CHECK_OK(tp_tensor_zeros(TP_F32, TP_CPU, 1, (int64_t[]){10}, &bucket));
    CHECK_OK(tp_tensor_narrow(bucket, 0, 3, 4, &view));
    CHECK_OK(tp_tensor_set_grad(x, view));
    cr_assert_eq(tp_tensor_grad(x), view);
    backward_square_plus(x);
    cr_assert_eq(tp_tensor_grad(x), view, "the installed gradient was replaced");
    const float *b = tp_tensor_data(bucket);
    for (int i = 0; i < 4; i++)
        cr_assert_float_eq(b[3 + i], 2.0 * v[i] + 1.0, 1e-6, "bucket[%d] = %g", 3 + i, b[3 + i]);
    cr_assert(b[0] == 0 && b[1] == 0 && b[2] == 0 && b[7] == 0 && b[8] == 0 && b[9] == 0,
              "the backward wrote outside the view");
    backward_square_plus(x);
    for (int i = 0; i < 4; i++)
        cr_assert_float_eq(b[3 + i], 2.0 * (2.0 * v[i] + 1.0), 1e-6);
    /* zero_grad drops it; set_grad(NULL) too */
    tp_tensor_zero_grad(x);
    cr_assert_null(tp_tensor_grad(x));
    CHECK_OK(tp_tensor_set_grad(x, view));
    CHECK_OK(tp_tensor_set_grad(x, NULL));
    cr_assert_null(tp_tensor_grad(x));

    /* errors */
    tp_tensor *wrong = NULL, *f64 = NULL, *noreq = NULL;
    CHECK_OK(tp_tensor_zeros(TP_F32, TP_CPU, 1, (int64_t[]){5}, &wrong));
    CHECK_OK(tp_tensor_zeros(TP_F64, TP_CPU, 1, (int64_t[]){4}, &f64));
    CHECK_OK(tp_tensor_zeros(TP_F32, TP_CPU, 1, (int64_t[]){4}, &noreq));
    CHECK_ERR(tp_tensor_set_grad(NULL, view), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_set_grad(x, wrong), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_set_grad(x, f64), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_set_grad(x, x), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_tensor_set_grad(noreq, view), TP_ERR_INVALID_ARG);
    tp_tensor_release(noreq);
    tp_tensor_release(f64);
    tp_tensor_release(wrong);
    tp_tensor_release(view);
    tp_tensor_release(bucket);
    tp_tensor_release(x);
}

/* The first contribution is kept by reference and may be shared: a leaf
 * that owns no buffer yet never writes into it. Two leaves get the same
 * upstream gradient from an add; accumulating into one must not change the
 * other. */
Test(dtensor, shared_first_gradients_are_not_written_in_place, .timeout = 30)
{
    const float va[4] = {1, 2, 3, 4}, vb[4] = {5, 6, 7, 8};
    tp_tensor *a = leaf4(va), *b = leaf4(vb);
    for (int round = 1; round <= 3; round++) {
        tp_tensor *y = NULL, *loss = NULL;
        CHECK_OK(tp_add(a, b, &y));
        CHECK_OK(tp_sum_all(y, &loss));
        CHECK_OK(tp_backward(loss, NULL));
        for (int64_t i = 0; i < 4; i++) {
            double ga = 0, gb = 0;
            CHECK_OK(tp_tensor_get(tp_tensor_grad(a), &i, &ga));
            CHECK_OK(tp_tensor_get(tp_tensor_grad(b), &i, &gb));
            cr_assert(ga == round && gb == round, "round %d: grads %g and %g", round, ga, gb);
        }
        tp_tensor_release(loss);
        tp_tensor_release(y);
    }
    tp_tensor_release(b);
    tp_tensor_release(a);
}
