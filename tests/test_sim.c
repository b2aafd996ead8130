/* The sim backend: one process plays one rank of a simulated world on meta
 * tensors. The same program (a TP block: norm, colwise w1, gelu, rowwise w2,
 * residual; with or without sequence parallelism; optionally DDP over a dp
 * dim of a 2-D mesh) runs on a real shm world of W threads on the CPU and
 * on a sim world of W on the meta device, rank by rank: the comm-debug
 * records (count per kind and phase, bytes per kind, counts per module
 * scope) must be equal. At W = 1,024 they must equal the closed form, which
 * the small worlds check against the real runs too. */
#include "tp_test.h"
#include "tp_test_block.h"

typedef struct prog_cfg {
    int dp, tp;         /* world = dp * tp; dp > 1: a 2-D mesh and a DDP over "dp" */
    int64_t rows, d, f; /* input [rows, d], hidden f */
    bool sp;            /* sequence parallel: norm SP, w1 input S(0), w2 output S(0) */
} prog_cfg;

#define NSCOPES 3
static const char *const scope_names[NSCOPES] = {"norm", "w1", "w2"};

typedef struct prog_rec {
    int64_t cnt[TP_PHASE_COUNT][TP_COLL_KIND_COUNT]; /* "Global" */
    int64_t bytes[TP_COLL_KIND_COUNT];
    int64_t scope[NSCOPES][TP_PHASE_COUNT];
    int64_t out_shape[2];
} prog_rec;

static void read_rec(const tp_comm_debug *dbg, prog_rec *rec)
{
    for (int k = 0; k < TP_COLL_KIND_COUNT; k++) {
        rec->bytes[k] = tp_comm_debug_bytes(dbg, (tp_coll_kind)k);
        for (int p = 0; p < TP_PHASE_COUNT; p++)
            rec->cnt[p][k] =
                tp_comm_debug_module_count(dbg, TP_COMM_DEBUG_GLOBAL, (tp_phase)p, (tp_coll_kind)k);
    }
    for (int s = 0; s < NSCOPES; s++)
        for (int p = 0; p < TP_PHASE_COUNT; p++)
            rec->scope[s][p] =
                tp_comm_debug_module_count(dbg, scope_names[s], (tp_phase)p, TP_COLL_ANY);
}

typedef struct prog_state {
    tp_mesh *mesh, *tpm;
    tp_module *m;
    tp_ddp *ddp;
    tp_comm_debug *dbg;
    tp_tensor *x, *y, *loss;
} prog_state;

static void prog_free(prog_state *p)
{
    tp_tensor_release(p->loss);
    tp_tensor_release(p->y);
    tp_tensor_release(p->x);
    tp_ddp_free(p->ddp);
    tp_module_free(p->m);
    tp_comm_debug_free(p->dbg);
    tp_mesh_free(p->tpm);
    tp_mesh_free(p->mesh);
}

/* The meshes, the parallel block (and its DDP) and its input. */
static tp_status prog_setup(tp_comm *world, const prog_cfg *c, tp_device dev, prog_state *p)
{
    int64_t shape[2] = {c->dp, c->tp};
    const char *names[2] = {"dp", "tp"};
    const char *tpn = "tp";
    TP_TEST_TRY(tp_mesh_create(world, 2, shape, names, &p->mesh));
    TP_TEST_TRY(tp_mesh_slice(p->mesh, 1, &tpn, &p->tpm));
    TP_TEST_TRY(tp_test_block_make(c->d, c->f, true, dev, &p->m));
    TP_TEST_TRY(tp_test_block_parallelize(p->m, p->tpm, c->sp));
    if (c->dp > 1) {
        tp_ddp_options o = {.params_everywhere = true};
        TP_TEST_TRY(tp_ddp_create(p->m, tp_mesh_comm(p->mesh, 0), &o, &p->ddp));
    }
    int64_t xs[2] = {c->sp ? c->rows / c->tp : c->rows, c->d};
    TP_TEST_TRY(tp_tensor_empty(TP_F32, dev, 2, xs, &p->x));
    TP_TEST_TRY(tp_tensor_fill_random(p->x, TP_RNG_UNIFORM, -1, 1, 5, NULL, NULL));
    return tp_comm_debug_create(&p->dbg);
}

/* One training step of the block set up in p: forward, mean loss,
 * backward, the DDP's sync, SGD. */
static tp_status prog_step(prog_state *p)
{
    tp_status st = tp_module_call(p->m, p->x, &p->y);
    if (st == TP_OK)
        st = tp_mean_all(p->y, &p->loss);
    if (st == TP_OK)
        st = tp_backward(p->loss, NULL);
    if (st == TP_OK && p->ddp)
        st = tp_ddp_sync(p->ddp);
    if (st == TP_OK)
        st = tp_sgd_step(p->m, 0.1);
    return st;
}

/* The step under a comm-debug counter; rec gets its records and the
 * output's shape. */
static tp_status prog_run(tp_comm *world, const prog_cfg *c, tp_device dev, prog_rec *rec)
{
    prog_state p = {0};
    tp_status st = prog_setup(world, c, dev, &p);
    if (st == TP_OK)
        st = tp_comm_debug_begin(p.dbg);
    if (st == TP_OK) {
        st = prog_step(&p);
        tp_status e = tp_comm_debug_end(p.dbg);
        st = st != TP_OK ? st : e;
    }
    if (st == TP_OK) {
        memset(rec, 0, sizeof *rec);
        read_rec(p.dbg, rec);
        rec->out_shape[0] = tp_tensor_size(p.y, 0);
        rec->out_shape[1] = tp_tensor_size(p.y, 1);
    }
    prog_free(&p);
    return st;
}

/* ---- the real run: W shm ranks on the CPU -------------------------------- */

typedef struct shm_ctx {
    prog_cfg cfg;
    prog_rec rec[TP_TEST_MAX_RANKS];
    tp_test_slot slots[TP_TEST_MAX_RANKS];
} shm_ctx;

static tp_status shm_body(tp_comm *world, void *arg)
{
    shm_ctx *c = arg;
    int r = tp_comm_rank(world);
    RANK_OK(&c->slots[r], prog_run(world, &c->cfg, TP_CPU, &c->rec[r]));
    return TP_OK;
}

/* rank r of a sim world of cfg's size on the meta device */
static tp_status sim_run(const prog_cfg *cfg, int r, prog_rec *rec)
{
    tp_sim_options o = {.world_size = cfg->dp * cfg->tp, .rank = r};
    tp_comm *w = NULL;
    TP_TEST_TRY(tp_comm_create_world("sim", &o, &w));
    tp_status st = prog_run(w, cfg, TP_META, rec);
    tp_comm_free(w);
    return st;
}

static void rec_str(const prog_rec *r, char *buf, size_t len)
{
    int n = 0;
    for (int k = 0; k < TP_COLL_KIND_COUNT && n < (int)len; k++)
        if (r->cnt[0][k] || r->cnt[1][k] || r->bytes[k])
            n += snprintf(buf + n, len - (size_t)n, "%s f%lld b%lld %lldB; ",
                          tp_coll_kind_name((tp_coll_kind)k), (long long)r->cnt[0][k],
                          (long long)r->cnt[1][k], (long long)r->bytes[k]);
    for (int s = 0; s < NSCOPES && n < (int)len; s++)
        n += snprintf(buf + n, len - (size_t)n, "%s f%lld b%lld; ", scope_names[s],
                      (long long)r->scope[s][0], (long long)r->scope[s][1]);
    if (n < (int)len)
        snprintf(buf + n, len - (size_t)n, "out [%lld, %lld]", (long long)r->out_shape[0],
                 (long long)r->out_shape[1]);
}

static void assert_rec_eq(const prog_rec *got, const prog_rec *want, const char *what, int r)
{
    char g[1024], w[1024];
    rec_str(got, g, sizeof g);
    rec_str(want, w, sizeof w);
    cr_assert(memcmp(got, want, sizeof *got) == 0, "%s, rank %d:\n  got  %s\n  want %s", what, r, g,
              w);
}

/* ---- the closed form ----------------------------------------------------- */

/* The records of one step of the block at any (dp, tp), from the sizes
 * alone (f32: 4 bytes). tp = 1 issues no TP collective; dp = 1 no DDP. */
static void closed_form(const prog_cfg *c, prog_rec *r)
{
    memset(r, 0, sizeof *r);
    const int64_t es = 4, act = c->rows * c->d * es;
    enum { F = TP_PHASE_FORWARD, B = TP_PHASE_BACKWARD };
    if (c->tp > 1 && c->sp) {
        /* forward: w1's input S(0) -> R (all_gather), w2's output P -> S(0)
         * (reduce_scatter); backward: their mirror images */
        r->cnt[F][TP_COLL_ALL_GATHER] = 1;
        r->cnt[F][TP_COLL_REDUCE_SCATTER] = 1;
        r->cnt[B][TP_COLL_ALL_GATHER] = 1;
        r->cnt[B][TP_COLL_REDUCE_SCATTER] = 1;
        r->bytes[TP_COLL_ALL_GATHER] = 2 * act;
        r->bytes[TP_COLL_REDUCE_SCATTER] = 2 * act;
        r->scope[1][F] = 1; /* w1 */
        r->scope[1][B] = 1;
        r->scope[2][F] = 1; /* w2 */
        r->scope[2][B] = 1;
        /* the step: the norm's weight and bias gradients are partial sums
         * (each rank saw its rows), reduced when SGD reads them */
        r->cnt[F][TP_COLL_ALL_REDUCE] = 2;
        r->bytes[TP_COLL_ALL_REDUCE] = 2 * c->d * es;
    } else if (c->tp > 1) {
        /* forward: w2's output P -> R; backward: w1's input grad P -> R */
        r->cnt[F][TP_COLL_ALL_REDUCE] = 1;
        r->cnt[B][TP_COLL_ALL_REDUCE] = 1;
        r->bytes[TP_COLL_ALL_REDUCE] = 2 * act;
        r->scope[1][B] = 1;
        r->scope[2][F] = 1;
    }
    if (c->dp > 1) {
        /* one bucket (all under 25 MiB): this rank's gradients, all_reduced */
        int64_t f_loc = c->f / c->tp;
        int64_t numel = 2 * c->d + f_loc * c->d + f_loc + c->d * f_loc + c->d;
        r->cnt[B][TP_COLL_ALL_REDUCE] += 1;
        r->bytes[TP_COLL_ALL_REDUCE] += numel * es;
        /* the first step's bucket order: rank 0's, broadcast (6 int64) */
        r->cnt[F][TP_COLL_BROADCAST] = 1;
        r->bytes[TP_COLL_BROADCAST] = 6 * 8;
    }
    r->out_shape[0] = c->sp && c->tp > 1 ? c->rows / c->tp : c->rows;
    r->out_shape[1] = c->d;
}

/* ---- tests ---------------------------------------------------------------- */

static void check_against_shm(const prog_cfg *cfg)
{
    int w = cfg->dp * cfg->tp;
    shm_ctx *c = calloc(1, sizeof *c);
    cr_assert_not_null(c);
    c->cfg = *cfg;
    tp_test_run(w, shm_body, c, c->slots);
    prog_rec want;
    closed_form(cfg, &want);
    for (int r = 0; r < w; r++) {
        prog_rec got;
        CHECK_OK(sim_run(cfg, r, &got));
        assert_rec_eq(&got, &c->rec[r], "sim vs shm", r);
        assert_rec_eq(&c->rec[r], &want, "shm vs closed form", r);
    }
    free(c);
}

Test(sim, tp_block_matches_shm, .timeout = 60)
{
    for (int w = 2; w <= 4; w++) {
        check_against_shm(&(prog_cfg){.dp = 1, .tp = w, .rows = 24, .d = 8, .f = 24});
        check_against_shm(&(prog_cfg){.dp = 1, .tp = w, .rows = 24, .d = 8, .f = 24, .sp = true});
    }
}

Test(sim, dp_tp_block_matches_shm, .timeout = 60)
{
    check_against_shm(&(prog_cfg){.dp = 2, .tp = 2, .rows = 24, .d = 8, .f = 24, .sp = true});
    check_against_shm(&(prog_cfg){.dp = 3, .tp = 1, .rows = 24, .d = 8, .f = 24});
    check_against_shm(&(prog_cfg){.dp = 2, .tp = 2, .rows = 24, .d = 8, .f = 24});
}

/* W = 1,024: the closed form, at the first, a middle and the last rank */
static void check_closed_form(const prog_cfg *cfg)
{
    prog_rec want;
    closed_form(cfg, &want);
    int w = cfg->dp * cfg->tp, ranks[3] = {0, w / 2 + 1, w - 1};
    for (int i = 0; i < 3; i++) {
        prog_rec got;
        CHECK_OK(sim_run(cfg, ranks[i], &got));
        assert_rec_eq(&got, &want, "sim vs closed form", ranks[i]);
    }
}

Test(sim, tp1024_closed_form, .timeout = 60)
{
    check_closed_form(&(prog_cfg){.dp = 1, .tp = 1024, .rows = 4096, .d = 256, .f = 8192});
    check_closed_form(
        &(prog_cfg){.dp = 1, .tp = 1024, .rows = 4096, .d = 256, .f = 8192, .sp = true});
}

/* The 1,024-rank plan of the issue: dp = 128 x tp = 8, sequence parallel */
Test(sim, dp128_tp8_plan_counts, .timeout = 60)
{
    prog_cfg cfg = {.dp = 128, .tp = 8, .rows = 4096, .d = 1024, .f = 4096, .sp = true};
    check_closed_form(&cfg);
    prog_rec got;
    CHECK_OK(sim_run(&cfg, 1000, &got));
    enum { F = TP_PHASE_FORWARD, B = TP_PHASE_BACKWARD };
    cr_assert_eq(got.cnt[F][TP_COLL_ALL_GATHER], 1);
    cr_assert_eq(got.cnt[F][TP_COLL_REDUCE_SCATTER], 1);
    cr_assert_eq(got.cnt[B][TP_COLL_ALL_GATHER], 1);
    cr_assert_eq(got.cnt[B][TP_COLL_REDUCE_SCATTER], 1);
    cr_assert_eq(got.cnt[F][TP_COLL_ALL_REDUCE], 2, "the norm's two partial gradients");
    cr_assert_eq(got.cnt[B][TP_COLL_ALL_REDUCE], 1, "one DDP bucket");
    cr_assert_eq(got.cnt[F][TP_COLL_BROADCAST], 1, "the DDP's first bucket order");
    /* all_gather: the whole [4096, 1024] f32 activation, twice */
    cr_assert_eq(got.bytes[TP_COLL_ALL_GATHER], 2LL * 4096 * 1024 * 4);
    cr_assert_eq(got.bytes[TP_COLL_REDUCE_SCATTER], 2LL * 4096 * 1024 * 4);
    /* DDP: this rank's gradients: 2 norm + w1 [512, 1024] + 512 + w2 [1024, 512] + 1024;
     * then the norm's 2 x 1024 */
    cr_assert_eq(got.bytes[TP_COLL_ALL_REDUCE],
                 (2LL * 1024 + 2 * 512 * 1024 + 512 + 1024) * 4 + 2 * 1024 * 4);
    cr_assert_eq(got.out_shape[0], 4096 / 8);
}

Test(sim, world_options_checked, .timeout = 10)
{
    tp_comm *w = NULL;
    CHECK_ERR(tp_comm_create_world("sim", NULL, &w), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_comm_create_world("sim", &(tp_sim_options){.world_size = 0}, &w),
              TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_comm_create_world("sim", &(tp_sim_options){.world_size = 65537}, &w),
              TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_comm_create_world("sim", &(tp_sim_options){.world_size = 4, .rank = 4}, &w),
              TP_ERR_INVALID_ARG);
    cr_assert_null(w);
    CHECK_OK(
        tp_comm_create_world("sim", &(tp_sim_options){.world_size = 65536, .rank = 65535}, &w));
    cr_assert_eq(tp_comm_size(w), 65536);
    cr_assert_eq(tp_comm_rank(w), 65535);
    cr_assert_str_eq(tp_comm_backend(w), "sim");
    /* a direct split cannot know the group sizes */
    tp_comm *g = NULL;
    CHECK_ERR(tp_comm_split(w, 0, 0, &g), TP_ERR_NOT_SUPPORTED);
    cr_assert(strstr(tp_last_error(), "tp_mesh_create") != NULL, "%s", tp_last_error());
    CHECK_OK(tp_comm_free(w));
}

/* Collectives on a sim world: meta buffers only; each is recorded as on a
 * real world of the same size; the usual argument checks apply. */
Test(sim, collectives_recorded_and_checked, .timeout = 10)
{
    tp_comm *w = NULL;
    CHECK_OK(tp_comm_create_world("sim", &(tp_sim_options){.world_size = 1024, .rank = 3}, &w));
    tp_tensor *a = NULL, *big = NULL, *big2 = NULL, *cpu = NULL;
    CHECK_OK(tp_tensor_empty(TP_BF16, TP_META, 1, (int64_t[]){1000}, &a));
    CHECK_OK(tp_tensor_empty(TP_BF16, TP_META, 1, (int64_t[]){1024000}, &big));
    CHECK_OK(tp_tensor_empty(TP_BF16, TP_META, 1, (int64_t[]){1024000}, &big2));
    CHECK_OK(tp_tensor_zeros(TP_BF16, TP_CPU, 1, (int64_t[]){1000}, &cpu));
    tp_comm_debug *dbg = NULL;
    CHECK_OK(tp_comm_debug_create(&dbg));
    CHECK_OK(tp_comm_debug_begin(dbg));
    CHECK_OK(tp_all_reduce(w, a, a, TP_SUM, NULL));
    CHECK_OK(tp_all_gather(w, a, big, NULL));
    CHECK_OK(tp_reduce_scatter(w, big, a, TP_SUM, NULL));
    tp_work *work = NULL;
    CHECK_OK(tp_all_to_all(w, big, big2, &work));
    CHECK_OK(tp_work_wait(work));
    tp_work_free(work);
    CHECK_OK(tp_broadcast(w, a, 1023, NULL));
    CHECK_OK(tp_barrier(w, NULL));
    /* wrong sizes and CPU buffers are refused as on any backend */
    CHECK_ERR(tp_all_gather(w, a, a, NULL), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_all_reduce(w, cpu, cpu, TP_SUM, NULL), TP_ERR_NOT_SUPPORTED);
    cr_assert(strstr(tp_last_error(), "meta") != NULL, "%s", tp_last_error());
    CHECK_OK(tp_comm_debug_end(dbg));
    cr_assert_eq(tp_comm_debug_count(dbg, TP_COLL_ALL_REDUCE), 1);
    cr_assert_eq(tp_comm_debug_bytes(dbg, TP_COLL_ALL_REDUCE), 2000);
    cr_assert_eq(tp_comm_debug_bytes(dbg, TP_COLL_ALL_GATHER), 2048000);
    cr_assert_eq(tp_comm_debug_bytes(dbg, TP_COLL_REDUCE_SCATTER), 2048000);
    cr_assert_eq(tp_comm_debug_bytes(dbg, TP_COLL_BROADCAST), 2000);
    cr_assert_eq(tp_comm_debug_bytes(dbg, TP_COLL_ALL_TO_ALL), 2048000);
    cr_assert_eq(tp_comm_debug_count(dbg, TP_COLL_BARRIER), 1);
    cr_assert_eq(tp_comm_debug_total(dbg), 6);
    tp_comm_debug_free(dbg);
    tp_tensor_release(a);
    tp_tensor_release(big);
    tp_tensor_release(big2);
    tp_tensor_release(cpu);
    CHECK_OK(tp_comm_free(w));
}

/* ---- uneven shards: every distinct rank in one call ---------------------- */

/* The step only, set up outside the counter tp_sim_each_rank keeps: the
 * setup's collectives (parallelize, DDP) would count otherwise. */
static tp_status sim_step_body(tp_comm *world, void *arg)
{
    const prog_cfg *c = arg;
    prog_state p = {0};
    tp_comm_debug *outer = tp_comm_debug_active();
    tp_status st = tp_comm_debug_end(outer);
    if (st == TP_OK)
        st = prog_setup(world, c, TP_META, &p);
    tp_status e = tp_comm_debug_begin(outer);
    st = st != TP_OK ? st : e;
    if (st == TP_OK)
        st = prog_step(&p);
    prog_free(&p);
    return st;
}

/* hidden 20 over tp = 3 (7, 7, 6): the DDP's bucket differs by tp
 * coordinate; the report's maxima are those of the real run's ranks */
Test(sim, each_rank_uneven_maxima, .timeout = 60)
{
    prog_cfg cfg = {.dp = 2, .tp = 3, .rows = 24, .d = 8, .f = 20, .sp = true};
    shm_ctx *c = calloc(1, sizeof *c);
    cr_assert_not_null(c);
    c->cfg = cfg;
    tp_test_run(6, shm_body, c, c->slots);
    int64_t want_max[TP_COLL_KIND_COUNT] = {0}, want_cnt[TP_COLL_KIND_COUNT] = {0};
    int want_rank[TP_COLL_KIND_COUNT] = {0};
    for (int r = 0; r < 6; r++)
        for (int k = 0; k < TP_COLL_KIND_COUNT; k++) {
            if (c->rec[r].bytes[k] > want_max[k]) {
                want_max[k] = c->rec[r].bytes[k];
                want_rank[k] = r;
            }
            int64_t n = c->rec[r].cnt[0][k] + c->rec[r].cnt[1][k];
            want_cnt[k] = n > want_cnt[k] ? n : want_cnt[k];
        }
    /* the shards differ: the last tp coordinate reduces fewer bytes */
    cr_assert_lt(c->rec[2].bytes[TP_COLL_ALL_REDUCE], c->rec[0].bytes[TP_COLL_ALL_REDUCE]);

    tp_sim_report all, some;
    CHECK_OK(tp_sim_each_rank(6, 0, NULL, sim_step_body, &cfg, &all));
    cr_assert_eq(all.ranks_played, 6);
    /* one rank of each tp coordinate is enough */
    CHECK_OK(tp_sim_each_rank(6, 3, (int[]){3, 4, 5}, sim_step_body, &cfg, &some));
    cr_assert_eq(some.ranks_played, 3);
    for (int k = 0; k < TP_COLL_KIND_COUNT; k++) {
        cr_assert_eq(all.max_bytes[k], want_max[k], "%s", tp_coll_kind_name((tp_coll_kind)k));
        cr_assert_eq(all.max_count[k], want_cnt[k], "%s", tp_coll_kind_name((tp_coll_kind)k));
        cr_assert_eq(some.max_bytes[k], want_max[k], "%s", tp_coll_kind_name((tp_coll_kind)k));
        if (want_max[k])
            cr_assert_eq(all.max_bytes_rank[k], want_rank[k], "%s",
                         tp_coll_kind_name((tp_coll_kind)k));
    }
    /* DDP bytes: ceil(20 / 3) = 7 rows of w1 and columns of w2 at most */
    int64_t numel = 2 * 8 + 7 * 8 + 7 + 8 * 7 + 8;
    cr_assert_eq(all.max_bytes[TP_COLL_ALL_REDUCE], (numel + 2 * 8) * 4);
    free(c);
}

Test(sim, each_rank_checks_and_stops, .timeout = 10)
{
    tp_sim_report rep;
    prog_cfg cfg = {.dp = 1, .tp = 2, .rows = 24, .d = 8, .f = 24};
    CHECK_ERR(tp_sim_each_rank(0, 0, NULL, sim_step_body, &cfg, &rep), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_sim_each_rank(2, 1, (int[]){2}, sim_step_body, &cfg, &rep), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_sim_each_rank(2, 0, NULL, NULL, &cfg, &rep), TP_ERR_INVALID_ARG);
    /* the program is for a world of 2: on 3 ranks the mesh refuses, at rank 0 */
    CHECK_ERR(tp_sim_each_rank(3, 0, NULL, sim_step_body, &cfg, &rep), TP_ERR_INVALID_ARG);
    cr_assert(strncmp(tp_last_error(), "sim rank 0: ", 12) == 0, "%s", tp_last_error());
    cr_assert_eq(rep.ranks_played, 0);
}

/* A 3-D mesh and a 2-D slice of it on every rank of a simulated world of
 * 24: each dim's group has the dim's size and the rank's coordinate as its
 * rank, as on a real world; a collective on the slice counts its size. */
Test(sim, mesh_3d_and_slices, .timeout = 30)
{
    const int64_t shape[3] = {2, 3, 4};
    const char *names[3] = {"a", "b", "c"}, *sel[2] = {"a", "c"};
    for (int r = 0; r < 24; r++) {
        tp_comm *w = NULL;
        tp_mesh *m = NULL, *s = NULL;
        CHECK_OK(tp_comm_create_world("sim", &(tp_sim_options){.world_size = 24, .rank = r}, &w));
        CHECK_OK(tp_mesh_create(w, 3, shape, names, &m));
        int64_t coord[3] = {r / 12, r / 4 % 3, r % 4};
        for (int d = 0; d < 3; d++) {
            cr_assert_eq(tp_mesh_coord(m, d), coord[d]);
            cr_assert_eq(tp_comm_size(tp_mesh_comm(m, d)), shape[d]);
            cr_assert_eq(tp_comm_rank(tp_mesh_comm(m, d)), coord[d], "rank %d dim %d", r, d);
        }
        CHECK_OK(tp_mesh_slice(m, 2, sel, &s));
        cr_assert_eq(tp_mesh_numel(s), 8);
        cr_assert_eq(tp_comm_rank(tp_mesh_group(s)), (int)(coord[0] * 4 + coord[2]));
        tp_tensor *a = NULL, *g = NULL;
        CHECK_OK(tp_tensor_empty(TP_F16, TP_META, 1, (int64_t[]){10}, &a));
        CHECK_OK(tp_tensor_empty(TP_F16, TP_META, 1, (int64_t[]){80}, &g));
        tp_comm_debug *dbg = NULL;
        CHECK_OK(tp_comm_debug_create(&dbg));
        CHECK_OK(tp_comm_debug_begin(dbg));
        CHECK_OK(tp_all_gather(tp_mesh_group(s), a, g, NULL));
        CHECK_ERR(tp_all_gather(tp_mesh_comm(m, 1), a, g, NULL), TP_ERR_INVALID_ARG);
        CHECK_OK(tp_comm_debug_end(dbg));
        cr_assert_eq(tp_comm_debug_count(dbg, TP_COLL_ALL_GATHER), 1);
        cr_assert_eq(tp_comm_debug_bytes(dbg, TP_COLL_ALL_GATHER), 160);
        tp_comm_debug_free(dbg);
        tp_tensor_release(a);
        tp_tensor_release(g);
        tp_mesh_free(s);
        tp_mesh_free(m);
        CHECK_OK(tp_comm_free(w));
    }
}
