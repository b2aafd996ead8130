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
#include "tp_test_fs.h"

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
static bool expect_salt(tp_test_slot *s, tp_module *m, int salt, const char *what)
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
    bool sgd, no_optim, in_place;
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
    co.copy_first = !j->in_place;
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

static bool in_place_runs; /* run_reshard loads in place */

static void run_reshard(int w1, int p1, int w2, int p2, tp_dtype dt, bool sgd, int k, int n)
{
    char base[64];
    job_t *j = calloc(1, sizeof *j);
    j->in_place = in_place_runs;
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
    tp_test_rm_tree(base);
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
Test(checkpoint, bf16_masters_reshard, .timeout = 60)
{
    run_reshard(2, ROW, 3, COL, TP_BF16, false, 3, 5);
    run_reshard(4, TWO_D, 1, PLAIN, TP_BF16, true, 3, 5);
}

/* SGD momentum buffers (with nesterov and weight decay). */
Test(checkpoint, sgd_momentum_reshard, .timeout = 60)
{
    run_reshard(3, COL, 2, ROW, TP_F32, true, 2, 4);
}

/* Loading in place (no scratch copy of the parameters): the same results,
 * resharded, on 1-D and 2-D meshes, bf16 parameters with their masters, SGD. */
Test(checkpoint, in_place_reshard, .timeout = 60)
{
    in_place_runs = true;
    run_reshard(4, ROW, 3, COL, TP_F32, false, 2, 3);
    run_reshard(2, TWO_D, 4, TWO_D, TP_BF16, false, 2, 4);
    run_reshard(1, PLAIN, 2, REP, TP_F32, true, 2, 3);
    in_place_runs = false;
}

/* Training equivalence: 6 steps == 3 steps, save, load on another world
 * size and plan, 3 steps; bit for bit (the updates are elementwise). */
Test(checkpoint, training_equivalence, .timeout = 60)
{
    run_reshard(2, ROW, 3, COL, TP_F32, false, 3, 6);
    run_reshard(4, TWO_D, 2, ROW, TP_F32, false, 3, 6);
    run_reshard(1, PLAIN, 4, ROW, TP_F32, true, 3, 6);
}

/* ---- bad checkpoints ------------------------------------------------------------------ */

enum {
    E_MISSING,
    E_UNEXPECTED,
    E_SHAPE,
    E_DTYPE,
    E_TRUNCATED,
    E_CORRUPT,
    E_CORRUPT_RESHARD,
    E_OVERFLOW,
    E_VERSION,
    E_MALFORMED,
    E_NO_DIR,
    E_OPT_TYPE,
    E_NO_OPT,
    E_MISSING_ALLOWED,
    E_UNEXPECTED_ALLOWED,
    E_DTYPE_CONVERTED,
    E_NO_OPT_ALLOWED,
    E_CORRUPT_IN_PLACE,
    E_CORRUPT_RESHARD_IN_PLACE,
};

typedef struct {
    int kind;
    tp_status want;
    char frag[64], frag2[64]; /* both in the message */
} err_case;

typedef struct {
    job_t job;
    err_case c;
    int world, plan;
    variant_t v;
    tp_dtype dt;
    bool sgd;
    tp_checkpoint_options flags;
    tp_status st[TP_TEST_MAX_RANKS];
    char msg[TP_TEST_MAX_RANKS][700];
} err_job;

static tp_status err_rank(tp_comm *world, void *arg)
{
    err_job *e = arg;
    int r = tp_comm_rank(world);
    tp_test_slot *s = &e->job.slots[r];
    tp_mesh *mesh = NULL;
    tp_module *m = NULL;
    optim_t o = {0};
    RANK_OK(s, make_mesh(world, e->plan, &mesh));
    RANK_OK(s, build(mesh, e->plan, e->dt, 2, e->v, &m));
    RANK_OK(s, make_optim(m, e->sgd, &o));
    double lr = o.adam ? tp_adam_lr(o.adam) : tp_sgd_lr(o.sgd);
    tp_checkpoint_options co = e->flags;
    co.comm = opts_for(e->plan, world).comm;
    tp_checkpoint_optim opt = {o.adam, o.sgd};
    tp_clear_error();
    e->st[r] = tp_checkpoint_load(e->job.dir, m, &opt, &co);
    snprintf(e->msg[r], sizeof e->msg[r], "%s", tp_last_error());
    double lr2 = o.adam ? tp_adam_lr(o.adam) : tp_sgd_lr(o.sgd);
    if (e->c.want != TP_OK) {
        expect_salt(s, m, 2, "after a failed load, the model");
        RANK_EXPECT(s, lr == lr2, "after a failed load, the optimizer's lr changed");
    } else {
        /* loaded: what the checkpoint has, the rest untouched */
        for (int pi = 0; pi < NP; pi++) {
            tp_tensor *p = param(m, pnames[pi]), *want = NULL;
            if (!p)
                continue;
            unsigned char got[MAXB];
            size_t len = 0;
            RANK_OK(s, gather(m, pi, got, &len));
            /* the saved value (f32), in the parameter's dtype */
            tp_tensor *saved = NULL;
            RANK_OK(s, tp_tensor_from_blob(TP_F32, TP_CPU, tp_tensor_ndim(p), tp_tensor_shape(p),
                                           e->job.at_save[pi], NULL, NULL, &saved));
            tp_status st = tp_tensor_to(saved, tp_tensor_dtype(p), TP_CPU, &want);
            tp_tensor_release(saved);
            RANK_OK(s, st);
            RANK_EXPECT(s, len == tp_tensor_nbytes(want) && !memcmp(got, tp_tensor_data(want), len),
                        "%s not loaded", pnames[pi]);
            tp_tensor_release(want);
        }
    }
    free_optim(&o);
    tp_module_free(m);
    tp_mesh_free(mesh);
    return TP_OK;
}

/* Replaces the first occurrence of `from` in path's text by `to`. */
static void edit_file(const char *path, const char *from, const char *to)
{
    FILE *f = fopen(path, "rb");
    cr_assert(f, "open %s", path);
    static char text[1 << 20];
    size_t n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = '\0';
    char *at = strstr(text, from);
    cr_assert(at, "'%s' not in %s", from, path);
    f = fopen(path, "wb");
    fwrite(text, 1, (size_t)(at - text), f);
    fputs(to, f);
    fputs(at + strlen(from), f);
    fclose(f);
}

static void file_path(const char *dir, const char *name, char *buf, size_t len)
{
    snprintf(buf, len, "%s/%s", dir, name);
}

/* Makes the checkpoint bad (or the module different) as the case says. */
static void prepare_case(err_job *e)
{
    char p[600];
    switch (e->c.kind) {
    case E_MISSING:
    case E_MISSING_ALLOWED:
        e->v.extra_c = true;
        e->flags.allow_missing = e->c.kind == E_MISSING_ALLOWED;
        break;
    case E_UNEXPECTED:
    case E_UNEXPECTED_ALLOWED:
        e->v.drop_e = true;
        e->flags.allow_unexpected = e->c.kind == E_UNEXPECTED_ALLOWED;
        break;
    case E_SHAPE:
        e->v.a_out = 8;
        break;
    case E_DTYPE:
    case E_DTYPE_CONVERTED:
        e->dt = TP_BF16;
        e->flags.convert_dtype = e->c.kind == E_DTYPE_CONVERTED;
        break;
    case E_TRUNCATED: {
        file_path(e->job.dir, "rank-00001.bin", p, sizeof p);
        struct stat sb;
        cr_assert_eq(stat(p, &sb), 0);
        cr_assert_eq(truncate(p, sb.st_size - 8), 0);
        break;
    }
    case E_CORRUPT:
    case E_CORRUPT_RESHARD:
    case E_CORRUPT_IN_PLACE:
    case E_CORRUPT_RESHARD_IN_PLACE: {
        file_path(e->job.dir, "rank-00000.bin", p, sizeof p);
        int fd = open(p, O_RDWR);
        unsigned char b = 0;
        cr_assert_eq(pread(fd, &b, 1, 5), 1);
        b ^= 0x10;
        cr_assert_eq(pwrite(fd, &b, 1, 5), 1);
        close(fd);
        if (e->c.kind == E_CORRUPT_RESHARD || e->c.kind == E_CORRUPT_RESHARD_IN_PLACE) {
            e->world = 3;
            e->plan = COL;
        }
        /* the first kinds through the scratch copy, the _IN_PLACE ones the
         * default way */
        e->flags.copy_first = e->c.kind < E_CORRUPT_IN_PLACE;
        break;
    }
    case E_OVERFLOW:
        file_path(e->job.dir, "metadata.json", p, sizeof p);
        edit_file(p, "\"offset\": 0,", "\"offset\": 99999999,");
        break;
    case E_VERSION:
        file_path(e->job.dir, "metadata.json", p, sizeof p);
        edit_file(p, "\"version\": 1", "\"version\": 2");
        break;
    case E_MALFORMED:
        file_path(e->job.dir, "metadata.json", p, sizeof p);
        edit_file(p, "\"model\"", "\"model");
        break;
    case E_NO_DIR:
        strcat(e->job.dir, "-none");
        break;
    case E_OPT_TYPE:
        e->sgd = true;
        break;
    case E_NO_OPT:
    case E_NO_OPT_ALLOWED:
        e->flags.allow_missing = e->c.kind == E_NO_OPT_ALLOWED;
        break;
    }
}

ParameterizedTestParameters(checkpoint, errors)
{
    static err_case c[] = {
        {E_MISSING, TP_ERR_INVALID_ARG, "missing from the checkpoint: 'c.weight', 'c.bias'",
         "metadata.json"},
        {E_UNEXPECTED, TP_ERR_INVALID_ARG, "unexpected tensors", "'e.weight'"},
        {E_SHAPE, TP_ERR_INVALID_ARG, "tensor 'a.weight' in",
         "has shape [7, 10], the parameter [8, 10]"},
        {E_DTYPE, TP_ERR_INVALID_ARG, "tensor 'a.weight' in",
         "has dtype F32, the parameter is bf16"},
        {E_TRUNCATED, TP_ERR_INVALID_ARG, "state 'exp_avg_sq' of 'e.weight': block 1",
         "rank-00001.bin' ("},
        {E_CORRUPT, TP_ERR_INVALID_ARG, "tensor 'a.weight': block 0", "rank-00000.bin': CRC-32C"},
        {E_CORRUPT_RESHARD, TP_ERR_INVALID_ARG, "tensor 'a.weight': block 0", "corrupted data"},
        {E_OVERFLOW, TP_ERR_INVALID_ARG, "tensor 'a.weight' in", "overflows data file"},
        {E_VERSION, TP_ERR_NOT_SUPPORTED, "format version 2", ""},
        {E_MALFORMED, TP_ERR_INVALID_ARG, "malformed JSON", ""},
        {E_NO_DIR, TP_ERR_BACKEND, "cannot open", ""},
        {E_OPT_TYPE, TP_ERR_INVALID_ARG, "adam optimizer; the optimizer given is sgd", ""},
        {E_NO_OPT, TP_ERR_INVALID_ARG, "holds no optimizer state", ""},
        {E_MISSING_ALLOWED, TP_OK, "", ""},
        {E_UNEXPECTED_ALLOWED, TP_OK, "", ""},
        {E_DTYPE_CONVERTED, TP_OK, "", ""},
        {E_NO_OPT_ALLOWED, TP_OK, "", ""},
        {E_CORRUPT_IN_PLACE, TP_ERR_INVALID_ARG, "tensor 'a.weight': block 0", "corrupted data"},
        {E_CORRUPT_RESHARD_IN_PLACE, TP_ERR_INVALID_ARG, "tensor 'a.weight': block 0",
         "corrupted data"},
    };
    return cr_make_param_array(err_case, c, sizeof c / sizeof *c);
}

/* Each bad case: the same status on every rank, the message naming the
 * tensor or file, the model and optimizer untouched. */
ParameterizedTest(err_case *c, checkpoint, errors, .timeout = 60)
{
    char base[64];
    err_job *e = calloc(1, sizeof *e);
    test_dir(base, sizeof base, e->job.dir, sizeof e->job.dir);
    e->job.plan = ROW;
    e->job.k = e->job.n = 1;
    e->job.no_optim = c->kind == E_NO_OPT || c->kind == E_NO_OPT_ALLOWED;
    tp_test_run(2, save_rank, &e->job, e->job.slots);
    e->c = *c;
    e->world = 2;
    e->plan = ROW;
    e->dt = TP_F32;
    prepare_case(e);
    memset(e->job.slots, 0, sizeof e->job.slots);
    tp_test_run(e->world, err_rank, e, e->job.slots);
    for (int r = 0; r < e->world; r++) {
        cr_assert_eq(e->st[r], c->want, "rank %d: %s, expected %s (%s)", r,
                     tp_status_name(e->st[r]), tp_status_name(c->want), e->msg[r]);
        cr_assert(strstr(e->msg[r], c->frag), "rank %d: '%s' lacks '%s'", r, e->msg[r], c->frag);
        cr_assert(strstr(e->msg[r], c->frag2), "rank %d: '%s' lacks '%s'", r, e->msg[r], c->frag2);
        cr_assert(strstr(e->msg[r], "tp_checkpoint_load") || c->want == TP_OK, "rank %d: %s", r,
                  e->msg[r]);
    }
    tp_test_rm_tree(base);
    free(e);
}

/* ---- atomicity and directories ------------------------------------------------------- */

typedef struct {
    char dir[300];
    int salt, plan;
    tp_status st[TP_TEST_MAX_RANKS];
    char msg[TP_TEST_MAX_RANKS][700];
    tp_test_slot slots[TP_TEST_MAX_RANKS];
} dir_job;

/* Saves the salt's model (and Adam, no step yet) into j->dir; records the
 * status. */
static tp_status dir_save_rank(tp_comm *world, void *arg)
{
    dir_job *j = arg;
    int r = tp_comm_rank(world);
    tp_test_slot *s = &j->slots[r];
    tp_mesh *mesh = NULL;
    tp_module *m = NULL;
    RANK_OK(s, make_mesh(world, j->plan, &mesh));
    RANK_OK(s, build(mesh, j->plan, TP_F32, j->salt, (variant_t){0}, &m));
    tp_checkpoint_options co = opts_for(j->plan, world);
    tp_clear_error();
    j->st[r] = tp_checkpoint_save(j->dir, m, NULL, &co);
    snprintf(j->msg[r], sizeof j->msg[r], "%s", tp_last_error());
    tp_module_free(m);
    tp_mesh_free(mesh);
    return TP_OK;
}

/* Loads j->dir into a salt-9 model and expects the salt's values. */
static tp_status dir_load_rank(tp_comm *world, void *arg)
{
    dir_job *j = arg;
    tp_test_slot *s = &j->slots[tp_comm_rank(world)];
    tp_mesh *mesh = NULL;
    tp_module *m = NULL;
    RANK_OK(s, make_mesh(world, j->plan, &mesh));
    RANK_OK(s, build(mesh, j->plan, TP_F32, 9, (variant_t){0}, &m));
    tp_checkpoint_options co = opts_for(j->plan, world);
    RANK_OK(s, tp_checkpoint_load(j->dir, m, NULL, &co));
    expect_salt(s, m, j->salt, "loaded");
    tp_module_free(m);
    tp_mesh_free(mesh);
    return TP_OK;
}

static void run_dir(int w, tp_rank_fn fn, dir_job *j)
{
    memset(j->slots, 0, sizeof j->slots);
    tp_test_run(w, fn, j, j->slots);
}

/* A checkpoint replaces the one at its name (W = 2 and 3), atomically:
 * nothing else is left in the directory. */
Test(checkpoint, replace_existing, .timeout = 60)
{
    char base[64];
    dir_job *j = calloc(1, sizeof *j);
    test_dir(base, sizeof base, j->dir, sizeof j->dir);
    j->plan = ROW;
    for (int salt = 1; salt <= 3; salt++) {
        j->salt = salt;
        run_dir(salt == 2 ? 3 : 2, dir_save_rank, j);
        for (int r = 0; r < 2; r++)
            cr_assert_eq(j->st[r], TP_OK, "save %d rank %d: %s", salt, r, j->msg[r]);
        cr_assert_eq(count_entries(base), 1, "after save %d: only the checkpoint", salt);
        run_dir(4, dir_load_rank, j);
    }
    tp_test_rm_tree(base);
    free(j);
}

/* A directory that cannot be created (its parent is a file), and an existing
 * directory that is not a checkpoint: the same error on every rank, nothing
 * created, the directory untouched. */
Test(checkpoint, unwritable_dir, .timeout = 60)
{
    char base[64], file[300];
    dir_job *j = calloc(1, sizeof *j);
    test_dir(base, sizeof base, j->dir, sizeof j->dir);
    snprintf(file, sizeof file, "%s/file", base);
    FILE *f = fopen(file, "w");
    fputs("x", f);
    fclose(f);
    snprintf(j->dir, sizeof j->dir, "%s/file/ckpt", base);
    j->plan = ROW;
    j->salt = 1;
    run_dir(2, dir_save_rank, j);
    for (int r = 0; r < 2; r++) {
        cr_assert_eq(j->st[r], TP_ERR_BACKEND, "rank %d: %s (%s)", r, tp_status_name(j->st[r]),
                     j->msg[r]);
        cr_assert(strstr(j->msg[r], "cannot create") && strstr(j->msg[r], "/file/ckpt.tmp-"),
                  "rank %d: %s", r, j->msg[r]);
    }
    cr_assert_eq(count_entries(base), 1);
    /* an existing directory holding something else */
    snprintf(j->dir, sizeof j->dir, "%s/mine", base);
    cr_assert_eq(mkdir(j->dir, 0755), 0);
    snprintf(file, sizeof file, "%s/mine/keep.txt", base);
    f = fopen(file, "w");
    fputs("mine", f);
    fclose(f);
    run_dir(3, dir_save_rank, j);
    for (int r = 0; r < 3; r++) {
        cr_assert_eq(j->st[r], TP_ERR_INVALID_ARG, "rank %d: %s", r, j->msg[r]);
        cr_assert(strstr(j->msg[r], "is not a checkpoint (no metadata.json): not replaced"),
                  "rank %d: %s", r, j->msg[r]);
    }
    cr_assert_eq(count_entries(base), 2);
    cr_assert_eq(count_entries(j->dir), 1, "the directory is untouched");
    tp_test_rm_tree(base);
    free(j);
}

/* Failure in the middle of a save: every allocation of a save fails in
 * turn (one process: no collectives to disturb), first into a new
 * directory, then replacing a checkpoint. Each failure is TP_ERR_NO_MEMORY
 * with a message, leaves no temporary directory and no leak, and nothing
 * under the final name (the first time) or the old checkpoint, loading
 * whole (the second); the first save that gets all its memory is the
 * checkpoint. */
static void alloc_failures(dir_job *j, const char *base, int salt_before);

Test(checkpoint, alloc_failure_mid_save, .timeout = 120)
{
    char base[64];
    dir_job *j = calloc(1, sizeof *j);
    test_dir(base, sizeof base, j->dir, sizeof j->dir);
    j->plan = PLAIN;
    alloc_failures(j, base, 0);
    j->salt = 1;
    run_dir(1, dir_save_rank, j);
    cr_assert_eq(j->st[0], TP_OK, "%s", j->msg[0]);
    alloc_failures(j, base, 1);
    tp_test_rm_tree(base);
    free(j);
}

static void alloc_failures(dir_job *j, const char *base, int salt_before)
{
    tp_module *m = NULL;
    CHECK_OK(build(NULL, PLAIN, TP_F32, 2, (variant_t){0}, &m));
    tp_adam *adam = NULL;
    CHECK_OK(tp_adam_create(m, 0.01, 0, 0, 0, &adam));
    tp_checkpoint_optim opt = {adam, NULL};
    int failures = 0;
    for (long at = 0;; at++) {
        tp_test_alloc c = {.fail_at = at};
        tp_allocator a = {tp_test_alloc_fn, tp_test_free_fn, &c};
        CHECK_OK(tp_set_allocator(&a));
        tp_clear_error();
        tp_status st = tp_checkpoint_save(j->dir, m, &opt, NULL);
        CHECK_OK(tp_set_allocator(NULL));
        cr_assert_eq(c.live, 0, "allocation %ld failing: %ld blocks leaked", at, c.live);
        if (st == TP_OK) {
            j->salt = 2;
            break;
        }
        cr_assert_eq(st, TP_ERR_NO_MEMORY, "allocation %ld: %s (%s)", at, tp_status_name(st),
                     tp_last_error());
        cr_assert_neq(tp_last_error()[0], '\0');
        failures++;
        cr_assert_eq(count_entries(base), salt_before ? 1 : 0,
                     "allocation %ld failing: something left", at);
        if (salt_before)
            run_dir(1, dir_load_rank, j); /* still the old checkpoint */
    }
    cr_assert_eq(count_entries(base), 1);
    cr_assert_gt(failures, 5, "the save allocates");
    run_dir(1, dir_load_rank, j);
    tp_adam_free(adam);
    tp_module_free(m);
}

/* Bytes read, through the scratch copy (copy_first): at the same plan each
 * rank reads exactly its blocks (their CRC checks included). Resharded from
 * rows over 4 ranks to columns over 2, each rank reads its blocks, and the
 * stored row blocks of the matrices, which no rank needs whole, are read
 * once more in all for their CRCs. In place (the default) a rank reads its
 * blocks twice: once to check, once into the parameters. */
typedef struct {
    char dir[300];
    int plan;
    bool in_place;
    uint64_t got[TP_TEST_MAX_RANKS], want[TP_TEST_MAX_RANKS];
    tp_test_slot slots[TP_TEST_MAX_RANKS];
} bytes_job;

static tp_status bytes_rank(tp_comm *world, void *arg)
{
    bytes_job *j = arg;
    int r = tp_comm_rank(world);
    tp_test_slot *s = &j->slots[r];
    tp_mesh *mesh = NULL;
    tp_module *m = NULL;
    RANK_OK(s, make_mesh(world, j->plan, &mesh));
    RANK_OK(s, build(mesh, j->plan, TP_F32, 3, (variant_t){0}, &m));
    uint64_t before = tp_checkpoint_bytes_read();
    const tp_checkpoint_options o = {.copy_first = !j->in_place};
    RANK_OK(s, tp_checkpoint_load(j->dir, m, NULL, &o));
    j->got[r] = tp_checkpoint_bytes_read() - before;
    j->want[r] = 0;
    for (int pi = 0; pi < NP; pi++)
        j->want[r] += tp_tensor_nbytes(tp_dtensor_local(param(m, pnames[pi])));
    expect_salt(s, m, 1, "loaded");
    tp_module_free(m);
    tp_mesh_free(mesh);
    return TP_OK;
}

Test(checkpoint, bytes_read, .timeout = 60)
{
    char base[64];
    dir_job *d = calloc(1, sizeof *d);
    bytes_job *j = calloc(1, sizeof *j);
    test_dir(base, sizeof base, d->dir, sizeof d->dir);
    d->plan = ROW;
    d->salt = 1;
    run_dir(4, dir_save_rank, d);
    cr_assert_eq(d->st[0], TP_OK, "%s", d->msg[0]);
    snprintf(j->dir, sizeof j->dir, "%s", d->dir);
    j->plan = ROW;
    tp_test_run(4, bytes_rank, j, j->slots);
    uint64_t total = 0;
    for (int r = 0; r < 4; r++) {
        cr_assert_eq(j->got[r], j->want[r], "rank %d read %llu bytes, its blocks are %llu", r,
                     (unsigned long long)j->got[r], (unsigned long long)j->want[r]);
        total += j->want[r];
    }
    memset(j->slots, 0, sizeof j->slots);
    j->in_place = true;
    tp_test_run(4, bytes_rank, j, j->slots);
    for (int r = 0; r < 4; r++)
        cr_assert_eq(j->got[r], 2 * j->want[r], "in place: rank %d read %llu bytes, its blocks are "
                     "%llu (checked, then read)", r, (unsigned long long)j->got[r],
                     (unsigned long long)j->want[r]);
    memset(j->slots, 0, sizeof j->slots);
    j->in_place = false;
    j->plan = COL;
    tp_test_run(2, bytes_rank, j, j->slots);
    uint64_t got = j->got[0] + j->got[1], need = j->want[0] + j->want[1];
    uint64_t matrices = (7 * 10 + 5 * 7 + 9 * 6) * sizeof(float);
    cr_assert_eq(got, need + matrices, "read %llu bytes, needed %llu + %llu to check",
                 (unsigned long long)got, (unsigned long long)need, (unsigned long long)matrices);
    cr_assert_lt(need, 2 * total);
    tp_test_rm_tree(base);
    free(d);
    free(j);
}

/* Peak tensor memory of a load (one process, f32 on the CPU, no optimizer):
 * copy_first's scratch holds a copy of every parameter; in place (the
 * default), nothing. */
Test(checkpoint, load_peak_memory, .timeout = 60)
{
    char base[64];
    dir_job *j = calloc(1, sizeof *j);
    test_dir(base, sizeof base, j->dir, sizeof j->dir);
    j->plan = PLAIN;
    j->salt = 1;
    run_dir(1, dir_save_rank, j);
    cr_assert_eq(j->st[0], TP_OK, "%s", j->msg[0]);
    size_t params = 0;
    for (int in_place = 0; in_place < 2; in_place++) {
        tp_module *m = NULL;
        CHECK_OK(build(NULL, PLAIN, TP_F32, 2, (variant_t){0}, &m));
        tp_memory_info before, after;
        CHECK_OK(tp_memory_stats(TP_CPU, &before));
        CHECK_OK(tp_memory_reset_peak(TP_CPU));
        tp_checkpoint_options o = {.copy_first = !in_place};
        CHECK_OK(tp_checkpoint_load(j->dir, m, NULL, &o));
        CHECK_OK(tp_memory_stats(TP_CPU, &after));
        size_t extra = after.peak_allocated - before.allocated;
        if (!in_place) {
            for (int pi = 0; pi < NP; pi++)
                params += tp_tensor_nbytes(param(m, pnames[pi]));
            cr_assert_geq(extra, params, "scratch %zu bytes, parameters %zu", extra, params);
        } else {
            cr_assert_eq(extra, 0, "in place: %zu bytes of tensor memory above the model", extra);
        }
        tp_test_slot s = {0};
        expect_salt(&s, m, 1, "loaded");
        cr_assert(!s.failed, "%s", s.msg);
        tp_module_free(m);
    }
    tp_test_rm_tree(base);
    free(j);
}

/* ---- blocks larger than one read chunk ----------------------------------------------- */

/* An allocator that refuses every second allocation of exactly `size`
 * bytes: the overlapped check's second 4 MiB buffer, so the load takes the
 * one-buffer way. */
typedef struct {
    size_t size;
    int seen;
} half_fail;

static void *half_fail_alloc(void *ctx, size_t size, size_t alignment)
{
    half_fail *h = ctx;
    if (size == h->size && h->seen++ % 2 == 1)
        return NULL;
    size_t rounded = (size + alignment - 1) / alignment * alignment;
    return aligned_alloc(alignment, rounded ? rounded : alignment);
}

static void half_fail_free(void *ctx, void *p)
{
    (void)ctx;
    free(p);
}

/* Loads dir into a Linear(1024, 4200) initialised with seed 2 (the default
 * way: checked, then read in place); returns the status, its message in
 * msg, and whether the weight holds seed `want`'s values. */
static tp_status load_big(const char *dir, uint64_t want, char *msg, size_t len, bool *equal,
                          uint64_t *bytes)
{
    tp_module *m = NULL, *ref = NULL;
    cr_assert_eq(tp_nn_linear_create(1024, 4200, true, &m), TP_OK);
    cr_assert_eq(tp_nn_linear_create(1024, 4200, true, &ref), TP_OK);
    cr_assert_eq(tp_module_init(m, 2), TP_OK);
    cr_assert_eq(tp_module_init(ref, want), TP_OK);
    uint64_t before = tp_checkpoint_bytes_read();
    tp_clear_error();
    tp_status st = tp_checkpoint_load(dir, m, NULL, NULL);
    *bytes = tp_checkpoint_bytes_read() - before;
    snprintf(msg, len, "%s", tp_last_error());
    *equal = true;
    const char *names[2] = {"weight", "bias"};
    for (int i = 0; i < 2; i++) {
        tp_tensor *a = tp_module_parameter(m, names[i]), *b = tp_module_parameter(ref, names[i]);
        *equal = *equal && !memcmp(tp_tensor_data(a), tp_tensor_data(b), tp_tensor_nbytes(a));
    }
    tp_module_free(ref);
    tp_module_free(m);
    return st;
}

/* A 16.4 MiB weight spans five 4 MiB read chunks: its check reads one chunk
 * while it sums the one before (a second thread), or, when the second
 * buffer cannot be had, one after the other; the read after the check is
 * split in two halves read at once (over 16 MiB). Either way: the values,
 * each byte counted twice (checked, then read), and a byte flipped in the
 * third chunk found with the model untouched. */
Test(checkpoint, blocks_over_one_chunk, .timeout = 120)
{
    char base[64], dir[300], msg[700];
    test_dir(base, sizeof base, dir, sizeof dir);
    tp_module *m = NULL;
    cr_assert_eq(tp_nn_linear_create(1024, 4200, true, &m), TP_OK);
    cr_assert_eq(tp_module_init(m, 1), TP_OK);
    cr_assert_eq(tp_checkpoint_save(dir, m, NULL, NULL), TP_OK, "%s", tp_last_error());
    uint64_t nbytes = (1024 * 4200 + 4200) * sizeof(float);
    tp_module_free(m);

    half_fail h = {.size = 4u << 20};
    tp_allocator hook = {half_fail_alloc, half_fail_free, &h};
    for (int pass = 0; pass < 2; pass++) { /* 0: overlapped, 1: one buffer */
        if (pass == 1)
            cr_assert_eq(tp_set_allocator(&hook), TP_OK);
        bool equal = false;
        uint64_t bytes = 0;
        tp_status st = load_big(dir, 1, msg, sizeof msg, &equal, &bytes);
        cr_assert_eq(st, TP_OK, "pass %d: %s", pass, msg);
        cr_assert(equal, "pass %d: the loaded weight differs from the saved one", pass);
        cr_assert_eq(bytes, 2 * nbytes, "pass %d: read %llu bytes, expected %llu", pass,
                     (unsigned long long)bytes, (unsigned long long)(2 * nbytes));
    }
    cr_assert_geq(h.seen, 2, "the one-buffer pass did not ask for a second buffer");
    cr_assert_eq(tp_set_allocator(NULL), TP_OK);

    char p[600];
    file_path(dir, "rank-00000.bin", p, sizeof p);
    int fd = open(p, O_RDWR);
    cr_assert_geq(fd, 0);
    unsigned char b = 0;
    off_t at = (off_t)9 << 20; /* the weight's third chunk, wherever the bias is */
    cr_assert_eq(pread(fd, &b, 1, at), 1);
    b ^= 0x01;
    cr_assert_eq(pwrite(fd, &b, 1, at), 1);
    close(fd);
    h.seen = 0;
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1)
            cr_assert_eq(tp_set_allocator(&hook), TP_OK);
        bool equal = false;
        uint64_t bytes = 0;
        tp_status st = load_big(dir, 2, msg, sizeof msg, &equal, &bytes);
        cr_assert_eq(st, TP_ERR_INVALID_ARG, "pass %d: %s (%s)", pass, tp_status_name(st), msg);
        cr_assert(strstr(msg, "tensor 'weight'") && strstr(msg, "CRC-32C"),
                  "pass %d: '%s' names neither the tensor nor the checksum", pass, msg);
        cr_assert(equal, "pass %d: a failed load changed the model", pass);
    }
    cr_assert_eq(tp_set_allocator(NULL), TP_OK);
    tp_test_rm_tree(base);
}
