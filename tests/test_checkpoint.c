/* Sharded checkpoints (tp/checkpoint.h): save at one world size and plan,
 * load at another (Shard(0), Shard(1), Replicate, plain, a 2-D dp x tp
 * mesh, world sizes 1-4 with uneven shards), the gathered parameters
 * compared bit for bit, the optimizer state (Adam moments, step counts, f32
 * masters of bf16 parameters, SGD momentum) compared through the next steps
 * (a resumed run equals an uninterrupted one, bit for bit: the updates are
 * elementwise, so independent of the layout), user metadata, the bytes each
 * rank reads, every error case (exact status on every rank, message
 * fragment, model untouched), atomic replacement and failure in the middle
 * of a save (allocation failure in turn), unwritable directories. */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <dirent.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tp_test.h"

/* ---- the model ------------------------------------------------------------------ */

/* a: Linear(10 -> 7), b: Linear(7 -> 5), e: Embedding(9, 6): dims 7, 5 and 9
 * split unevenly over 2, 3 and 4 ranks. */
#define NP 5
static const char *const pnames[NP] = {"a.weight", "a.bias", "b.weight", "b.bias", "e.weight"};
#define MAXB 1024 /* bytes of the largest parameter, f32 */

enum { PLAIN, ROW, COL, REP, TWO_D, NPLANS };
static const char *const plan_names[NPLANS] = {"plain", "Shard(0)", "Shard(1)", "Replicate", "2-D"};

typedef struct {
    bool extra_c; /* a child "c" the checkpoint does not have */
    bool drop_e;  /* no "e" */
    int a_out;    /* a's out features (0: 7) */
} variant_t;

static tp_tensor *param(tp_module *m, const char *fqn)
{
    char child[16];
    const char *dot = strchr(fqn, '.');
    snprintf(child, sizeof child, "%.*s", (int)(dot - fqn), fqn);
    tp_module *c = tp_module_find(m, child);
    return c ? tp_module_parameter(c, dot + 1) : NULL;
}

/* Placements of parameter pi (ndim nd) in a plan. */
static void placements(int plan, int pi, int nd, tp_placement *pl)
{
    pl[0] = pl[1] = tp_replicate();
    if (plan == ROW)
        pl[0] = tp_shard(0);
    else if (plan == COL)
        pl[0] = nd == 2 ? tp_shard(1) : tp_replicate();
    else if (plan == TWO_D && nd == 1)
        pl[1] = tp_shard(0);
    else if (plan == TWO_D) {
        static const int kinds[NP][2] = {{-1, 0}, {0, 0}, {0, 1}, {0, 0}, {1, -1}};
        for (int d = 0; d < 2; d++)
            pl[d] = kinds[pi][d] < 0 ? tp_replicate() : tp_shard(kinds[pi][d]);
    }
}

/* The global value of parameter pi for a salt: exact small binary
 * fractions, different for each element, parameter and salt. */
static float gen(int pi, int64_t k, int salt)
{
    return (float)((k * 37 + pi * 101 + salt * 211) % 1009 - 504) / 256.0f;
}

static tp_status full_value(const tp_tensor *p, int pi, int salt, tp_tensor **out)
{
    int64_t n = tp_tensor_numel(p);
    float *buf = malloc((size_t)n * sizeof *buf);
    for (int64_t k = 0; k < n; k++)
        buf[k] = gen(pi, k, salt);
    tp_tensor *f = NULL;
    tp_status st = tp_tensor_from_blob(TP_F32, TP_CPU, tp_tensor_ndim(p), tp_tensor_shape(p), buf,
                                       NULL, NULL, &f);
    if (st == TP_OK)
        st = tp_tensor_to(f, tp_tensor_dtype(p), TP_CPU, out);
    tp_tensor_release(f);
    free(buf);
    return st;
}

/* p's value in the plan: a DTensor with the plan's placements, or full. */
static tp_status distribute(tp_mesh *mesh, int plan, int pi, tp_tensor *full, tp_tensor **out)
{
    if (plan == PLAIN) {
        *out = tp_tensor_retain(full);
        return TP_OK;
    }
    tp_placement pl[2];
    placements(plan, pi, tp_tensor_ndim(full), pl);
    return tp_dtensor_distribute(mesh, full, tp_mesh_ndim(mesh), pl, -1, out);
}

static tp_status add_linear(tp_module *m, const char *name, int64_t in, int64_t out)
{
    tp_module *c = NULL;
    TP_TEST_TRY(tp_nn_linear_create(in, out, true, &c));
    tp_status st = tp_module_add_child(m, name, c);
    if (st != TP_OK)
        tp_module_free(c);
    return st;
}

static tp_status build(tp_mesh *mesh, int plan, tp_dtype dt, int salt, variant_t v, tp_module **out)
{
    tp_module *m = NULL, *e = NULL;
    TP_TEST_TRY(tp_nn_container_create(&m));
    tp_status st = add_linear(m, "a", 10, v.a_out ? v.a_out : 7);
    if (st == TP_OK)
        st = add_linear(m, "b", 7, 5);
    if (st == TP_OK && !v.drop_e && (st = tp_nn_embedding_create(9, 6, &e)) == TP_OK &&
        (st = tp_module_add_child(m, "e", e)) != TP_OK)
        tp_module_free(e);
    if (st == TP_OK && v.extra_c)
        st = add_linear(m, "c", 3, 2);
    if (st == TP_OK && dt != TP_F32)
        st = tp_module_to_dtype(m, dt);
    for (int pi = 0; pi < NP && st == TP_OK; pi++) {
        tp_tensor *p = param(m, pnames[pi]), *full = NULL, *d = NULL;
        if (!p)
            continue;
        st = full_value(p, pi, salt, &full);
        if (st == TP_OK)
            st = distribute(mesh, plan, pi, full, &d);
        if (st == TP_OK) {
            char child[2] = {pnames[pi][0], 0};
            st = tp_module_set_parameter(tp_module_find(m, child), strchr(pnames[pi], '.') + 1, d);
        }
        tp_tensor_release(full);
        tp_tensor_release(d);
    }
    if (st != TP_OK) {
        tp_module_free(m);
        return st;
    }
    *out = m;
    return TP_OK;
}

static tp_status make_mesh(tp_comm *world, int plan, tp_mesh **mesh)
{
    *mesh = NULL;
    int n = tp_comm_size(world);
    if (plan == PLAIN)
        return TP_OK;
    if (plan == TWO_D) {
        int64_t shape[2] = {n >= 4 ? 2 : 1, n >= 4 ? n / 2 : n};
        const char *names[2] = {"dp", "tp"};
        return tp_mesh_create(world, 2, shape, names, mesh);
    }
    int64_t shape = n;
    return tp_mesh_create(world, 1, &shape, NULL, mesh);
}

/* The gathered value of parameter pi, as bytes (at most MAXB), on every rank. */
static tp_status gather(tp_module *m, int pi, unsigned char *buf, size_t *len)
{
    tp_tensor *p = param(m, pnames[pi]), *full = NULL;
    if (tp_tensor_is_dtensor(p))
        TP_TEST_TRY(tp_dtensor_full_tensor(p, &full));
    else
        full = tp_tensor_retain(p);
    *len = tp_tensor_nbytes(full);
    memcpy(buf, tp_tensor_data(full), *len < MAXB ? *len : MAXB);
    tp_tensor_release(full);
    return TP_OK;
}

/* Every parameter of m equals its value for `salt`, bit for bit. */
__attribute__((unused)) static bool expect_salt(tp_test_slot *s, tp_module *m, int salt,
                                                const char *what)
{
    for (int pi = 0; pi < NP; pi++) {
        tp_tensor *p = param(m, pnames[pi]), *want = NULL;
        if (!p)
            continue;
        unsigned char got[MAXB];
        size_t len = 0;
        tp_status st = gather(m, pi, got, &len);
        if (st == TP_OK)
            st = full_value(p, pi, salt, &want);
        RANK_EXPECT(s, st == TP_OK, "%s: gathering %s: %s", what, pnames[pi], tp_last_error());
        bool same =
            st == TP_OK && len == tp_tensor_nbytes(want) && !memcmp(got, tp_tensor_data(want), len);
        tp_tensor_release(want);
        RANK_EXPECT(s, same, "%s: %s differs from its salt-%d value", what, pnames[pi], salt);
        if (!same)
            return false;
    }
    return true;
}

/* ---- training ---------------------------------------------------------------------- */

typedef struct {
    tp_adam *adam;
    tp_sgd *sgd;
} optim_t;

static tp_status make_optim(tp_module *m, bool sgd, optim_t *o)
{
    *o = (optim_t){0};
    if (sgd) {
        tp_sgd_options so = {.lr = 0.05, .momentum = 0.9, .weight_decay = 0.01, .nesterov = true};
        return tp_sgd_create_with(m, &so, &o->sgd);
    }
    tp_adam_options ao = {.lr = 0.01, .weight_decay = 0.02, .decoupled = true};
    return tp_adam_create_with(m, &ao, &o->adam);
}

static void free_optim(optim_t *o)
{
    tp_adam_free(o->adam);
    tp_sgd_free(o->sgd);
    *o = (optim_t){0};
}

/* Steps [from, to): gradients of salt 100 + step, in each parameter's
 * layout; the optimizer steps. */
static tp_status train(tp_module *m, tp_mesh *mesh, int plan, optim_t *o, int from, int to)
{
    for (int step = from; step < to; step++) {
        for (int pi = 0; pi < NP; pi++) {
            tp_tensor *p = param(m, pnames[pi]), *full = NULL, *g = NULL;
            if (!p)
                continue;
            tp_status st = full_value(p, pi, 100 + step, &full);
            if (st == TP_OK)
                st = distribute(mesh, plan, pi, full, &g);
            if (st == TP_OK)
                st = tp_tensor_set_grad(p, g);
            tp_tensor_release(full);
            tp_tensor_release(g);
            TP_TEST_TRY(st);
        }
        TP_TEST_TRY(o->adam ? tp_adam_step(o->adam) : tp_sgd_opt_step(o->sgd));
        tp_module_zero_grad(m);
    }
    return TP_OK;
}

/* ---- runs ---------------------------------------------------------------------------- */

typedef struct {
    char dir[256];
    int plan;
    tp_dtype dt;
    bool sgd, no_optim;
    int k, n; /* steps before the save, in all */
    /* filled by the saving run's rank 0 */
    unsigned char at_save[NP][MAXB], ref[NP][MAXB];
    size_t len[NP];
    tp_test_slot slots[TP_TEST_MAX_RANKS];
} job_t;

static tp_checkpoint_options opts_for(int plan, tp_comm *world)
{
    tp_checkpoint_options o = {0};
    if (plan == PLAIN && tp_comm_size(world) > 1)
        o.comm = world;
    return o;
}

/* Builds (salt 1), trains k steps, saves, trains to n: the reference. */
static tp_status save_rank(tp_comm *world, void *arg)
{
    job_t *j = arg;
    int r = tp_comm_rank(world);
    tp_test_slot *s = &j->slots[r];
    tp_mesh *mesh = NULL;
    tp_module *m = NULL;
    optim_t o = {0};
    RANK_OK(s, make_mesh(world, j->plan, &mesh));
    RANK_OK(s, build(mesh, j->plan, j->dt, 1, (variant_t){0}, &m));
    RANK_OK(s, make_optim(m, j->sgd, &o));
    RANK_OK(s, train(m, mesh, j->plan, &o, 0, j->k));
    tp_checkpoint_options co = opts_for(j->plan, world);
    tp_checkpoint_meta meta[2] = {{"step", j->k, false}, {"epoch", -3, false}};
    co.n_meta = 2;
    co.meta = meta;
    tp_checkpoint_optim opt = {o.adam, o.sgd};
    RANK_OK(s, tp_checkpoint_save(j->dir, m, j->no_optim ? NULL : &opt, &co));
    for (int pi = 0; pi < NP; pi++) {
        unsigned char buf[MAXB];
        size_t len = 0;
        RANK_OK(s, gather(m, pi, buf, &len));
        if (r == 0) {
            memcpy(j->at_save[pi], buf, len);
            j->len[pi] = len;
        }
    }
    RANK_OK(s, train(m, mesh, j->plan, &o, j->k, j->n));
    for (int pi = 0; pi < NP; pi++) {
        unsigned char buf[MAXB];
        size_t len = 0;
        RANK_OK(s, gather(m, pi, buf, &len));
        if (r == 0)
            memcpy(j->ref[pi], buf, len);
    }
    free_optim(&o);
    tp_module_free(m);
    tp_mesh_free(mesh);
    return TP_OK;
}

/* Builds (salt 2), loads, checks the values saved, trains k..n and checks
 * the reference. */
static tp_status load_rank(tp_comm *world, void *arg)
{
    job_t *j = arg;
    tp_test_slot *s = &j->slots[tp_comm_rank(world)];
    tp_mesh *mesh = NULL;
    tp_module *m = NULL;
    optim_t o = {0};
    RANK_OK(s, make_mesh(world, j->plan, &mesh));
    RANK_OK(s, build(mesh, j->plan, j->dt, 2, (variant_t){0}, &m));
    RANK_OK(s, make_optim(m, j->sgd, &o));
    tp_checkpoint_options co = opts_for(j->plan, world);
    tp_checkpoint_meta meta[3] = {{"epoch", 0, false}, {"step", 0, false}, {"nope", 5, true}};
    co.n_meta = 3;
    co.meta = meta;
    co.allow_missing = j->no_optim;
    tp_checkpoint_optim opt = {o.adam, o.sgd};
    RANK_OK(s, tp_checkpoint_load(j->dir, m, &opt, &co));
    RANK_EXPECT(s, meta[0].found && meta[0].value == -3 && meta[1].found && meta[1].value == j->k,
                "user metadata: epoch %d %lld, step %d %lld", meta[0].found,
                (long long)meta[0].value, meta[1].found, (long long)meta[1].value);
    RANK_EXPECT(s, !meta[2].found && meta[2].value == 5, "a key not saved is not found");
    for (int pi = 0; pi < NP; pi++) {
        unsigned char buf[MAXB];
        size_t len = 0;
        RANK_OK(s, gather(m, pi, buf, &len));
        RANK_EXPECT(s, len == j->len[pi] && !memcmp(buf, j->at_save[pi], len),
                    "%s after the load differs from the saved value", pnames[pi]);
    }
    RANK_OK(s, train(m, mesh, j->plan, &o, j->k, j->n));
    for (int pi = 0; pi < NP; pi++) {
        unsigned char buf[MAXB];
        size_t len = 0;
        RANK_OK(s, gather(m, pi, buf, &len));
        RANK_EXPECT(s, !memcmp(buf, j->ref[pi], len),
                    "%s after steps %d..%d differs from the uninterrupted run", pnames[pi], j->k,
                    j->n);
    }
    free_optim(&o);
    tp_module_free(m);
    tp_mesh_free(mesh);
    return TP_OK;
}

/* Removes a directory tree of depth <= 2 (checkpoint dirs in a test dir). */
static void rm_tree(const char *path)
{
    DIR *d = opendir(path);
    struct dirent *e;
    while (d && (e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
            continue;
        char sub[600];
        snprintf(sub, sizeof sub, "%s/%s", path, e->d_name);
        struct stat sb;
        if (lstat(sub, &sb) == 0 && S_ISDIR(sb.st_mode))
            rm_tree(sub);
        else
            unlink(sub);
    }
    if (d)
        closedir(d);
    rmdir(path);
}

static int count_entries(const char *path)
{
    DIR *d = opendir(path);
    int n = 0;
    struct dirent *e;
    while (d && (e = readdir(d)))
        n += strcmp(e->d_name, ".") && strcmp(e->d_name, "..");
    if (d)
        closedir(d);
    return n;
}

/* A fresh test directory; the checkpoint goes to <it>/ckpt. */
static void test_dir(char *base, size_t len, char *ckpt, size_t clen)
{
    snprintf(base, len, "/tmp/tp_ckpt_XXXXXX");
    cr_assert(mkdtemp(base), "mkdtemp");
    snprintf(ckpt, clen, "%s/ckpt", base);
}

typedef struct {
    int w1, p1, w2, p2;
} reshard_case;

static void run_reshard(int w1, int p1, int w2, int p2, tp_dtype dt, bool sgd, int k, int n)
{
    char base[64];
    job_t *j = calloc(1, sizeof *j);
    test_dir(base, sizeof base, j->dir, sizeof j->dir);
    j->plan = p1;
    j->dt = dt;
    j->sgd = sgd;
    j->k = k;
    j->n = n;
    tp_test_run(w1, save_rank, j, j->slots);
    cr_assert_eq(count_entries(base), 1, "only the checkpoint in %s", base);
    memset(j->slots, 0, sizeof j->slots);
    j->plan = p2;
    tp_test_run(w2, load_rank, j, j->slots);
    rm_tree(base);
    free(j);
}

TestSuite(checkpoint, .timeout = 120);

/* Round trips at world sizes 1-4, each plan, Adam. */
ParameterizedTestParameters(checkpoint, round_trip)
{
    static reshard_case c[] = {{1, PLAIN, 1, PLAIN}, {1, ROW, 1, ROW},     {2, ROW, 2, ROW},
                               {3, ROW, 3, ROW},     {4, ROW, 4, ROW},     {3, COL, 3, COL},
                               {4, REP, 4, REP},     {4, TWO_D, 4, TWO_D}, {2, PLAIN, 2, PLAIN}};
    return cr_make_param_array(reshard_case, c, sizeof c / sizeof *c);
}

ParameterizedTest(reshard_case *c, checkpoint, round_trip, .timeout = 60)
{
    run_reshard(c->w1, c->p1, c->w2, c->p2, TP_F32, false, 2, 3);
}

/* The resharding matrix: save at (W, plan), load at (W', plan'). */
ParameterizedTestParameters(checkpoint, reshard)
{
    static const int src[][2] = {{4, ROW}, {2, COL}, {1, PLAIN}, {3, REP}, {4, TWO_D}, {3, COL}};
    static const int dst[][2] = {{2, ROW}, {1, PLAIN}, {4, COL}, {3, ROW}, {4, TWO_D}, {2, REP}};
    static reshard_case c[36];
    int n = 0;
    for (int a = 0; a < 6; a++)
        for (int b = 0; b < 6; b++)
            c[n++] = (reshard_case){src[a][0], src[a][1], dst[b][0], dst[b][1]};
    return cr_make_param_array(reshard_case, c, (size_t)n);
}

ParameterizedTest(reshard_case *c, checkpoint, reshard, .timeout = 60)
{
    cr_log_info("save W=%d %s, load W=%d %s", c->w1, plan_names[c->p1], c->w2, plan_names[c->p2]);
    run_reshard(c->w1, c->p1, c->w2, c->p2, TP_F32, false, 2, 3);
}

/* bf16 parameters: the f32 masters travel and reshard (a master made again
 * from the bf16 value would give other results at the next steps). */
Test(checkpoint, bf16_masters_reshard)
{
    run_reshard(2, ROW, 3, COL, TP_BF16, false, 3, 5);
    run_reshard(4, TWO_D, 1, PLAIN, TP_BF16, true, 3, 5);
}

/* SGD momentum buffers (with nesterov and weight decay). */
Test(checkpoint, sgd_momentum_reshard)
{
    run_reshard(3, COL, 2, ROW, TP_F32, true, 2, 4);
}

/* Training equivalence: 6 steps == 3 steps, save, load on another world
 * size and plan, 3 steps; bit for bit (the updates are elementwise). */
Test(checkpoint, training_equivalence)
{
    run_reshard(2, ROW, 3, COL, TP_F32, false, 3, 6);
    run_reshard(4, TWO_D, 2, ROW, TP_F32, false, 3, 6);
    run_reshard(1, PLAIN, 4, ROW, TP_F32, true, 3, 6);
}
