/* Memory accounting on the meta device (tp/meta_memory.h). The same
 * training step (forward, mean loss, backward, Adam) of an MLP (colwise w1,
 * gelu, rowwise w2) and of a transformer block's MLP half (layer norm,
 * colwise w1, gelu, rowwise w2, residual; with and without sequence
 * parallelism) runs for real on a shm world of W = 1, 2, 4 CPU threads and
 * as one rank of a sim world of W on meta, rank by rank:
 *  - the peak over the step (with meta counting as the CPU caching
 *    allocator does, TP_META_ROUND_CPU) equals the real rank's peak of
 *    tensor storage, measured per thread through a counting allocator (the
 *    CPU statistics are process-wide; at W = 1 they are checked too);
 *  - the parameter, gradient and optimizer-state bytes meta reports
 *    (TP_META_ROUND_EXACT) equal the real rank's, summed from its
 *    parameters, their gradients and Adam's m and v (2 f32 per element).
 * A 1,024-rank plan's parameter bytes equal the closed form. The Llama
 * fixture's step with FSDP x TP and activation recomputation, what tp-plan
 * plays to predict a layout's memory, has the same peak on meta as on the
 * CPU, rank by rank (the bound is 5%; it is exact). */
#include <pthread.h>

#include "tp_test.h"
#include "llm_fixture.h"
#include "tp_test_block.h"

/* ---- the real side: tensor storage counted per thread -------------------- */

/* With a user allocator, the CPU caching allocator takes each storage block
 * as one 64-byte aligned allocation of a 64-byte header plus the block's
 * capacity (tp/tensor.h: the statistics count the capacity); everything
 * else the library allocates asks for less alignment. */
#define BLK_HDR 64
#define BLK_ALIGN 64

typedef struct thr_ctr {
    size_t live, peak;
} thr_ctr;

typedef struct blk {
    void *p;
    size_t bytes;
    thr_ctr *ctr;
} blk;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static blk g_blk[1 << 14];
static _Thread_local thr_ctr *tl_ctr;

static void *ctr_alloc(void *ctx, size_t size, size_t alignment)
{
    (void)ctx;
    if (alignment < sizeof(void *))
        alignment = sizeof(void *);
    size_t rounded = (size + alignment - 1) / alignment * alignment;
    void *p = aligned_alloc(alignment, rounded ? rounded : alignment);
    if (!p || alignment != BLK_ALIGN || !tl_ctr || size < BLK_HDR)
        return p;
    pthread_mutex_lock(&g_lock);
    for (size_t i = 0; i < sizeof g_blk / sizeof *g_blk; i++)
        if (!g_blk[i].p) {
            g_blk[i] = (blk){p, size - BLK_HDR, tl_ctr};
            tl_ctr->live += size - BLK_HDR;
            if (tl_ctr->live > tl_ctr->peak)
                tl_ctr->peak = tl_ctr->live;
            break;
        }
    pthread_mutex_unlock(&g_lock);
    return p;
}

static void ctr_free(void *ctx, void *p)
{
    (void)ctx;
    pthread_mutex_lock(&g_lock);
    for (size_t i = 0; p && i < sizeof g_blk / sizeof *g_blk; i++)
        if (g_blk[i].p == p) {
            g_blk[i].ctr->live -= g_blk[i].bytes;
            g_blk[i].p = NULL;
            break;
        }
    pthread_mutex_unlock(&g_lock);
    free(p);
}

/* ---- the program ----------------------------------------------------------- */

typedef struct mem_cfg {
    int tp;
    int64_t rows, d, f;
    bool block; /* the block (norm, residual) rather than the bare MLP */
    bool sp;    /* sequence parallel (block only) */
} mem_cfg;

typedef struct mem_rec {
    size_t base, peak;                 /* live at the step's start, peak over the step */
    size_t params, grads, optim;       /* live bytes after the step (real: summed, f32 m and v) */
    size_t cat[TP_MEM_CATEGORY_COUNT]; /* meta: live bytes per category after the step */
    size_t w1_params;                  /* meta: parameter bytes in scope "w1" */
} mem_rec;

/* How a side measures: reset at the step's start, read the live and peak;
 * meta's categories after the step (NULL for the real side). */
typedef struct meter {
    void (*reset)(void);
    void (*read)(size_t *live, size_t *peak);
    void (*cats)(mem_rec *rec);
} meter;

/* Sums the local bytes of every parameter and of its gradient. */
static tp_status sum_param(const char *fqn, tp_tensor *p, void *ctx)
{
    (void)fqn;
    mem_rec *r = ctx;
    tp_tensor *l = tp_tensor_is_dtensor(p) ? tp_dtensor_local(p) : p;
    r->params += tp_tensor_nbytes(l);
    tp_tensor *g = tp_tensor_grad(p);
    if (g)
        r->grads += tp_tensor_nbytes(tp_tensor_is_dtensor(g) ? tp_dtensor_local(g) : g);
    return TP_OK;
}

typedef struct prog {
    tp_mesh *mesh;
    tp_module *m;
    tp_adam *adam;
    tp_tensor *x, *y, *loss;
} prog;

static void prog_free(prog *p)
{
    tp_tensor_release(p->loss);
    tp_tensor_release(p->y);
    tp_tensor_release(p->x);
    tp_adam_free(p->adam);
    tp_module_free(p->m);
    tp_mesh_free(p->mesh);
}

static tp_status prog_setup(tp_comm *world, const mem_cfg *c, tp_device dev, prog *p)
{
    const char *names[1] = {"tp"};
    TP_TEST_TRY(tp_mesh_create(world, 1, (int64_t[]){c->tp}, names, &p->mesh));
    TP_TEST_TRY(tp_test_block_make(c->d, c->f, c->block, dev, &p->m));
    TP_TEST_TRY(tp_test_block_parallelize(p->m, p->mesh, c->sp));
    TP_TEST_TRY(tp_adam_create(p->m, 1e-3, 0.9, 0.999, 1e-8, &p->adam));
    int64_t xs[2] = {c->sp ? c->rows / c->tp : c->rows, c->d};
    TP_TEST_TRY(tp_tensor_empty(TP_F32, dev, 2, xs, &p->x));
    return tp_tensor_fill_random(p->x, TP_RNG_UNIFORM, -1, 1, 5, NULL, NULL);
}

/* Sets up, then measures one step: forward, mean loss, backward, Adam. */
static tp_status prog_run(tp_comm *world, const mem_cfg *c, tp_device dev, const meter *mt,
                          mem_rec *rec)
{
    prog p = {0};
    memset(rec, 0, sizeof *rec);
    tp_status st = prog_setup(world, c, dev, &p);
    if (st == TP_OK) {
        mt->reset();
        mt->read(&rec->base, &rec->peak);
        st = tp_module_call(p.m, p.x, &p.y);
    }
    if (st == TP_OK)
        st = tp_mean_all(p.y, &p.loss);
    if (st == TP_OK)
        st = tp_backward(p.loss, NULL);
    if (st == TP_OK)
        st = tp_adam_step(p.adam);
    if (st == TP_OK) {
        size_t live;
        mt->read(&live, &rec->peak);
        st = tp_module_named_parameters(p.m, sum_param, rec);
        rec->optim = 2 * rec->params; /* f32 parameters: m and v */
        if (mt->cats)
            mt->cats(rec);
    }
    prog_free(&p);
    return st;
}

/* ---- the two sides --------------------------------------------------------- */

/* Under the lock: a block this rank allocated may be freed by another. */
static void thr_reset(void)
{
    pthread_mutex_lock(&g_lock);
    tl_ctr->peak = tl_ctr->live;
    pthread_mutex_unlock(&g_lock);
}

static void thr_read(size_t *live, size_t *peak)
{
    pthread_mutex_lock(&g_lock);
    *live = tl_ctr->live;
    *peak = tl_ctr->peak;
    pthread_mutex_unlock(&g_lock);
}

static const meter thr_meter = {thr_reset, thr_read, NULL};

static void meta_reset(void)
{
    tp_memory_reset_peak(TP_META);
}

static void meta_read(size_t *live, size_t *peak)
{
    tp_memory_info mi = {0};
    tp_memory_stats(TP_META, &mi);
    *live = mi.allocated;
    *peak = mi.peak_allocated;
}

/* Meta's own split: the categories live now (sim_run subtracts what was
 * live before the program). */
static void meta_cats(mem_rec *rec)
{
    for (int k = 0; k < TP_MEM_CATEGORY_COUNT; k++)
        rec->cat[k] = tp_meta_memory_bytes(TP_META_MEM_LIVE, NULL, (tp_mem_category)k);
    rec->w1_params = tp_meta_memory_bytes(TP_META_MEM_LIVE, "w1", TP_MEM_PARAMETERS);
}

static const meter meta_meter = {meta_reset, meta_read, meta_cats};

static void cpu_reset(void)
{
    tp_memory_reset_peak(TP_CPU);
}

static void cpu_read(size_t *live, size_t *peak)
{
    tp_memory_info mi = {0};
    tp_memory_stats(TP_CPU, &mi);
    *live = mi.allocated;
    *peak = mi.peak_allocated;
}

/* The CPU's own (process-wide) statistics, for a world of one. */
static const meter cpu_meter = {cpu_reset, cpu_read, NULL};

typedef struct shm_ctx {
    mem_cfg cfg;
    bool cpu_stats; /* measure with tp_memory_stats(TP_CPU) (a world of one) */
    thr_ctr ctr[TP_TEST_MAX_RANKS];
    mem_rec rec[TP_TEST_MAX_RANKS];
    tp_test_slot slots[TP_TEST_MAX_RANKS];
} shm_ctx;

static tp_status shm_body(tp_comm *world, void *arg)
{
    shm_ctx *c = arg;
    int r = tp_comm_rank(world);
    tl_ctr = &c->ctr[r];
    tp_status st =
        prog_run(world, &c->cfg, TP_CPU, c->cpu_stats ? &cpu_meter : &thr_meter, &c->rec[r]);
    tl_ctr = NULL;
    RANK_OK(&c->slots[r], st);
    return TP_OK;
}

/* Rank r on meta, counted with `rounding`. */
static tp_status sim_run(const mem_cfg *cfg, int r, tp_meta_rounding rounding, mem_rec *rec)
{
    tp_sim_options o = {.world_size = cfg->tp, .rank = r};
    tp_comm *w = NULL;
    TP_TEST_TRY(tp_meta_memory_set_rounding(rounding));
    /* what earlier tests of this process left live (the in-process runner)
     * is not this program's */
    mem_rec before = {0};
    size_t peak0;
    meta_read(&before.base, &peak0);
    meta_cats(&before);
    tp_status st = tp_comm_create_world("sim", &o, &w);
    if (st == TP_OK)
        st = prog_run(w, cfg, TP_META, &meta_meter, rec);
    rec->base -= before.base;
    rec->peak -= before.base;
    rec->w1_params -= before.w1_params;
    for (int k = 0; k < TP_MEM_CATEGORY_COUNT; k++)
        rec->cat[k] -= before.cat[k];
    tp_comm_free(w);
    tp_meta_memory_set_rounding(TP_META_ROUND_EXACT);
    return st;
}

/* Meta's categories (exact bytes) against the real rank's sums and the
 * closed form of w1's shard: colwise, [f / tp, d] and [f / tp] in f32. */
static void check_cats(const mem_cfg *cfg, int r, const mem_rec *meta, const mem_rec *real)
{
    cr_assert_eq(meta->params, real->params, "rank %d", r);
    cr_assert_eq(meta->cat[TP_MEM_PARAMETERS], real->params,
                 "rank %d: parameter bytes meta %zu, real %zu", r, meta->cat[TP_MEM_PARAMETERS],
                 real->params);
    cr_assert_eq(meta->cat[TP_MEM_GRADIENTS], real->grads,
                 "rank %d: gradient bytes meta %zu, real %zu", r, meta->cat[TP_MEM_GRADIENTS],
                 real->grads);
    cr_assert_eq(meta->cat[TP_MEM_OPTIMIZER], real->optim,
                 "rank %d: optimizer bytes meta %zu, real %zu", r, meta->cat[TP_MEM_OPTIMIZER],
                 real->optim);
    cr_assert_eq(meta->cat[TP_MEM_MASTER], 0, "rank %d: f32 parameters have no master", r);
    size_t f_loc = (size_t)(cfg->f / cfg->tp), d = (size_t)cfg->d;
    cr_assert_eq(meta->w1_params, (f_loc * d + f_loc) * 4, "rank %d: w1's parameters %zu", r,
                 meta->w1_params);
}

static void check_cfg(const mem_cfg *cfg)
{
    shm_ctx *c = calloc(1, sizeof *c);
    cr_assert_not_null(c);
    c->cfg = *cfg;
    CHECK_OK(tp_set_allocator(&(tp_allocator){ctr_alloc, ctr_free, NULL}));
    tp_test_run(cfg->tp, shm_body, c, c->slots);
    CHECK_OK(tp_set_allocator(NULL));
    for (int r = 0; r < cfg->tp; r++) {
        mem_rec got, exact, want = c->rec[r];
        CHECK_OK(sim_run(cfg, r, TP_META_ROUND_CPU, &got));
        cr_assert_eq(got.peak, want.peak, "tp %d sp %d block %d rank %d: peak meta %zu, real %zu",
                     cfg->tp, cfg->sp, cfg->block, r, got.peak, want.peak);
        cr_assert_eq(got.base, want.base, "rank %d: base meta %zu, real %zu", r, got.base,
                     want.base);
        CHECK_OK(sim_run(cfg, r, TP_META_ROUND_EXACT, &exact));
        check_cats(cfg, r, &exact, &want);
    }
    free(c);
}

Test(meta_memory, mlp_matches_shm, .timeout = 60)
{
    for (int w = 1; w <= 4; w *= 2)
        check_cfg(&(mem_cfg){.tp = w, .rows = 24, .d = 16, .f = 64});
}

Test(meta_memory, block_matches_shm, .timeout = 60)
{
    for (int w = 1; w <= 4; w *= 2) {
        check_cfg(&(mem_cfg){.tp = w, .rows = 24, .d = 16, .f = 64, .block = true});
        check_cfg(&(mem_cfg){.tp = w, .rows = 24, .d = 16, .f = 64, .block = true, .sp = true});
    }
}

/* A world of one, measured by the CPU's own statistics (the caching
 * allocator on, its blocks counted at their capacity; the last model has
 * blocks past 1 MiB, rounded to pages): the step's growth
 * over the live bytes at its start equals meta's counted as the CPU does. */
Test(meta_memory, cpu_stats_match_at_one_rank, .timeout = 60)
{
    const mem_cfg cfgs[3] = {{.tp = 1, .rows = 24, .d = 16, .f = 64},
                             {.tp = 1, .rows = 24, .d = 16, .f = 64, .block = true},
                             {.tp = 1, .rows = 8, .d = 256, .f = 1280, .block = true}};
    for (int i = 0; i < 3; i++) {
        shm_ctx *c = calloc(1, sizeof *c);
        cr_assert_not_null(c);
        c->cfg = cfgs[i];
        c->cpu_stats = true;
        tp_test_run(1, shm_body, c, c->slots);
        mem_rec got;
        CHECK_OK(sim_run(&cfgs[i], 0, TP_META_ROUND_CPU, &got));
        size_t real = c->rec[0].peak - c->rec[0].base;
        cr_assert_gt(real, 0);
        cr_assert_eq(got.peak - got.base, real, "config %d: step growth meta %zu, CPU %zu", i,
                     got.peak - got.base, real);
        free(c);
    }
}

/* ---- a 1,024-rank plan: the closed form ------------------------------------ */

/* One step of the block (SP) as rank 1000 of dp 128 x tp 8, parameters in
 * `dtype` (bf16: Adam keeps f32 masters): every category and module scope
 * against the sizes alone, and in f32 the peak and its split. */
static void check_plan_1024(tp_dtype dtype)
{
    const int64_t d = 1024, f = 4096, tpn = 8, rows = 64;
    const mem_cfg cfg = {.tp = (int)tpn, .rows = rows, .d = d, .f = f, .block = true, .sp = true};
    mem_rec before = {0}; /* what earlier tests left live (the in-process runner) */
    size_t peak0;
    meta_read(&before.base, &peak0);
    meta_cats(&before);
    tp_comm *w = NULL;
    CHECK_OK(tp_comm_create_world("sim", &(tp_sim_options){.world_size = 1024, .rank = 1000}, &w));
    tp_mesh *mesh = NULL, *tpm = NULL;
    const char *names[2] = {"dp", "tp"}, *tpname = "tp";
    CHECK_OK(tp_mesh_create(w, 2, (int64_t[]){128, tpn}, names, &mesh));
    CHECK_OK(tp_mesh_slice(mesh, 1, &tpname, &tpm));
    prog p = {0};
    CHECK_OK(tp_test_block_make(cfg.d, cfg.f, cfg.block, TP_META, &p.m));
    if (dtype != TP_F32)
        CHECK_OK(tp_module_to_dtype(p.m, dtype));
    CHECK_OK(tp_test_block_parallelize(p.m, tpm, true));
    CHECK_OK(tp_adam_create(p.m, 1e-3, 0.9, 0.999, 1e-8, &p.adam));
    CHECK_OK(tp_tensor_empty(dtype, TP_META, 2, (int64_t[]){rows / tpn, d}, &p.x));
    CHECK_OK(tp_memory_reset_peak(TP_META));
    CHECK_OK(tp_module_call(p.m, p.x, &p.y));
    CHECK_OK(tp_mean_all(p.y, &p.loss));
    CHECK_OK(tp_backward(p.loss, NULL));
    CHECK_OK(tp_adam_step(p.adam));
    size_t es = tp_dtype_size(dtype), fl = (size_t)(f / tpn), dd = (size_t)d;
    size_t norm = 2 * dd * es, w1 = (fl * dd + fl) * es, w2 = (dd * fl + dd) * es;
    size_t all = norm + w1 + w2, n = all / es;
    mem_rec now = {0};
    meta_cats(&now);
    for (int k = 0; k < TP_MEM_CATEGORY_COUNT; k++)
        now.cat[k] -= before.cat[k];
    cr_assert_eq(now.cat[TP_MEM_PARAMETERS], all);
    cr_assert_eq(tp_meta_memory_bytes(TP_META_MEM_LIVE, "norm", TP_MEM_PARAMETERS), norm);
    cr_assert_eq(tp_meta_memory_bytes(TP_META_MEM_LIVE, "w1", TP_MEM_PARAMETERS), w1);
    cr_assert_eq(tp_meta_memory_bytes(TP_META_MEM_LIVE, "w2", TP_MEM_PARAMETERS), w2);
    cr_assert_eq(now.cat[TP_MEM_GRADIENTS], all);
    cr_assert_eq(now.cat[TP_MEM_OPTIMIZER], 2 * n * 4);
    cr_assert_eq(tp_meta_memory_bytes(TP_META_MEM_LIVE, "w2", TP_MEM_OPTIMIZER), 2 * (w2 / es) * 4);
    cr_assert_eq(now.cat[TP_MEM_MASTER], dtype == TP_F32 ? 0 : n * 4);
    if (dtype == TP_F32) {
        /* f32: the step peaks at its end (Adam's states outweigh the
         * activations): parameters, gradients, m and v, the input x and the
         * output y (the block's rows / tp each, which the mean keeps), and
         * the f32 loss */
        size_t act = 2 * (size_t)(rows / tpn) * dd * 4, peak = 4 * all + act + 4;
        tp_memory_info mi;
        CHECK_OK(tp_memory_stats(TP_META, &mi));
        cr_assert_eq(mi.peak_allocated, peak, "peak %zu, closed form %zu", mi.peak_allocated, peak);
        size_t want[TP_MEM_CATEGORY_COUNT] = {all, all, 2 * all, 0, act, 4};
        for (int k = 0; k < TP_MEM_CATEGORY_COUNT; k++)
            cr_assert_eq(tp_meta_memory_bytes(TP_META_MEM_AT_PEAK, NULL, (tp_mem_category)k),
                         want[k], "%s at the peak", tp_mem_category_name((tp_mem_category)k));
    }
    prog_free(&p);
    tp_mesh_free(tpm);
    tp_mesh_free(mesh);
    tp_comm_free(w);
}

Test(meta_memory, plan_1024_ranks_closed_form, .timeout = 60)
{
    check_plan_1024(TP_F32);
    check_plan_1024(TP_BF16);
}

/* ---- the counters, rounding, report and errors ------------------------------ */

static size_t meta_alloc_in_scope(const char *scope, int64_t numel, tp_tensor **t)
{
    CHECK_OK(tp_comm_debug_push_scope(scope));
    CHECK_OK(tp_tensor_empty(TP_F32, TP_META, 1, &numel, t));
    CHECK_OK(tp_comm_debug_pop_scope());
    return tp_meta_memory_bytes(TP_META_MEM_LIVE, scope, TP_MEM_ANY);
}

Test(meta_memory, counters_and_rounding, .timeout = 30)
{
    tp_memory_info a, b;
    CHECK_OK(tp_memory_stats(TP_META, &a));
    tp_tensor *t = NULL, *u = NULL, *v = NULL;
    /* 1,100 bytes: exact 1,100; the CPU's block 1,280 (5 steps of 256);
     * CUDA 1,536 (3 x 512); an empty tensor: 0, 64 and 512 */
    cr_assert_eq(meta_alloc_in_scope("mm_exact", 275, &t), 1100);
    CHECK_OK(tp_meta_memory_set_rounding(TP_META_ROUND_CPU));
    cr_assert_eq(tp_meta_memory_rounding(), TP_META_ROUND_CPU);
    cr_assert_eq(meta_alloc_in_scope("mm_cpu", 275, &u), 1280);
    CHECK_OK(tp_meta_memory_set_rounding(TP_META_ROUND_CUDA));
    cr_assert_eq(meta_alloc_in_scope("mm_cuda", 275, &v), 1536);
    CHECK_OK(tp_meta_memory_set_rounding(TP_META_ROUND_EXACT));
    CHECK_OK(tp_memory_stats(TP_META, &b));
    cr_assert_eq(b.allocated - a.allocated, 1100 + 1280 + 1536);
    cr_assert_eq(b.reserved, b.allocated);
    cr_assert_eq(b.num_allocs - a.num_allocs, 3);
    cr_assert_eq(b.num_cache_hits, 0);
    cr_assert_geq(b.peak_allocated, b.allocated);
    cr_assert_eq(tp_meta_memory_bytes(TP_META_MEM_LIVE, "mm_cpu", TP_MEM_OTHER), 1280);
    cr_assert_eq(tp_meta_memory_bytes(TP_META_MEM_LIVE, "mm_cpu", TP_MEM_PARAMETERS), 0);
    /* views share their storage's bytes; releasing the last frees them */
    tp_tensor *view = NULL;
    CHECK_OK(tp_tensor_narrow(t, 0, 0, 10, &view));
    tp_tensor_release(t);
    cr_assert_eq(tp_meta_memory_bytes(TP_META_MEM_LIVE, "mm_exact", TP_MEM_ANY), 1100);
    tp_tensor_release(view);
    cr_assert_eq(tp_meta_memory_bytes(TP_META_MEM_LIVE, "mm_exact", TP_MEM_ANY), 0);
    /* the split at the peak keeps what was live then; a reset restarts it
     * and the totals from what is live */
    CHECK_OK(tp_memory_stats(TP_META, &b));
    cr_assert_eq(b.allocated - a.allocated, 1280 + 1536);
    tp_memory_reset_peak(TP_META);
    cr_assert_eq(tp_meta_memory_bytes(TP_META_MEM_AT_PEAK, "mm_cpu", TP_MEM_ANY), 1280);
    cr_assert_eq(tp_meta_memory_bytes(TP_META_MEM_TOTAL, "mm_cpu", TP_MEM_ANY), 0);
    tp_tensor_release(u);
    cr_assert_eq(tp_meta_memory_bytes(TP_META_MEM_AT_PEAK, "mm_cpu", TP_MEM_ANY), 1280);
    cr_assert_eq(tp_meta_memory_bytes(TP_META_MEM_LIVE, "mm_cpu", TP_MEM_ANY), 0);
    tp_tensor *w = NULL;
    cr_assert_eq(meta_alloc_in_scope("mm_exact", 100, &w), 400);
    cr_assert_eq(tp_meta_memory_bytes(TP_META_MEM_AT_PEAK, "mm_exact", TP_MEM_ANY), 0);
    cr_assert_eq(tp_meta_memory_bytes(TP_META_MEM_TOTAL, "mm_exact", TP_MEM_ANY), 400);
    tp_tensor_release(v);
    tp_tensor_release(w);
    /* scopes are listed, in the order first seen */
    int n = tp_meta_memory_scope_count(), found = 0;
    for (int i = 0; i < n; i++)
        found += strcmp(tp_meta_memory_scope_name(i), "mm_cuda") == 0;
    cr_assert_eq(found, 1);
    cr_assert_null(tp_meta_memory_scope_name(n));
    cr_assert_null(tp_meta_memory_scope_name(-1));
    cr_assert_eq(tp_meta_memory_bytes(TP_META_MEM_LIVE, "never seen", TP_MEM_ANY), 0);
    cr_assert_eq(tp_meta_memory_bytes((tp_meta_mem_view)9, NULL, TP_MEM_ANY), 0);
}

Test(meta_memory, report_and_errors, .timeout = 30)
{
    tp_tensor *t = NULL;
    CHECK_OK(tp_memory_reset_peak(TP_META));
    cr_assert_eq(meta_alloc_in_scope("mm_\"report\"", 25, &t), 100);
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    cr_assert_not_null(f);
    CHECK_OK(tp_meta_memory_write_report(f, TP_META_REPORT_JSON));
    fclose(f);
    cr_assert_not_null(strstr(buf,
                              "{\"scope\": \"mm_\\\"report\\\"\", \"at_peak\": {\"parameters\": "
                              "0, \"gradients\": 0, \"optimizer\": 0, \"master\": 0, "
                              "\"activations\": 0, \"other\": 100, \"total\": 100}, "
                              "\"total\": {\"parameters\": 0, \"gradients\": 0, "
                              "\"optimizer\": 0, \"master\": 0, \"activations\": 0, "
                              "\"other\": 100, \"total\": 100}}"),
                       "%s", buf);
    tp_memory_info mi;
    CHECK_OK(tp_memory_stats(TP_META, &mi));
    char want[128];
    snprintf(want, sizeof want, "\"allocated\": %zu, \"peak\": %zu,", mi.allocated,
             mi.peak_allocated);
    cr_assert_not_null(strstr(buf, want), "%s", buf);
    free(buf);
    f = open_memstream(&buf, &len);
    cr_assert_not_null(f);
    CHECK_OK(tp_meta_memory_write_report(f, TP_META_REPORT_TABLE));
    fclose(f);
    cr_assert_not_null(strstr(buf, "mm_\"report\""), "%s", buf);
    cr_assert_not_null(strstr(buf, "live at the peak (bytes)"), "%s", buf);
    free(buf);
    tp_tensor_release(t);

    CHECK_ERR(tp_meta_memory_write_report(NULL, TP_META_REPORT_JSON), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_meta_memory_write_report(stderr, (tp_meta_report_format)5), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_meta_memory_set_rounding((tp_meta_rounding)3), TP_ERR_INVALID_ARG);
    cr_assert_eq(tp_meta_memory_rounding(), TP_META_ROUND_EXACT);
    CHECK_ERR(tp_memory_stats((tp_device){TP_DEVICE_META, 1}, &mi), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_memory_set_cache_limit(TP_META, 0), TP_ERR_NOT_SUPPORTED);
    CHECK_OK(tp_memory_empty_cache(TP_META));
    cr_assert_str_eq(tp_mem_category_name(TP_MEM_ACTIVATIONS), "activations");
    cr_assert_str_eq(tp_mem_category_name(TP_MEM_ANY), "any");
    cr_assert_null(tp_mem_category_name(TP_MEM_CATEGORY_COUNT));
}

/* ---- allocation failures ----------------------------------------------------- */

static long g_fail_at = -1, g_count;

static void *failing_alloc(void *ctx, size_t size, size_t alignment)
{
    if (g_count++ == g_fail_at)
        return NULL;
    return ctr_alloc(ctx, size, alignment);
}

/* A meta tensor made in a scope never seen (so the accounting interns it)
 * with allocation k failing, k = 0, 1, ...: TP_ERR_NO_MEMORY, no tensor and
 * no bytes counted, until it succeeds. */
Test(meta_memory, allocation_failures, .timeout = 30)
{
    CHECK_OK(tp_set_allocator(&(tp_allocator){failing_alloc, ctr_free, NULL}));
    int failures = 0;
    bool done = false;
    for (long k = 0; k < 64 && !done; k++) {
        char scope[32];
        snprintf(scope, sizeof scope, "mm_fail_%ld", k);
        CHECK_OK(tp_comm_debug_push_scope(scope));
        tp_memory_info a, b;
        CHECK_OK(tp_memory_stats(TP_META, &a));
        tp_tensor *t = (tp_tensor *)0x1;
        g_count = 0;
        g_fail_at = k;
        tp_clear_error();
        tp_status st = tp_tensor_empty(TP_F32, TP_META, 1, (int64_t[]){1000}, &t);
        g_fail_at = -1;
        CHECK_OK(tp_comm_debug_pop_scope());
        CHECK_OK(tp_memory_stats(TP_META, &b));
        if (st == TP_OK) {
            cr_assert_eq(b.allocated - a.allocated, 4000);
            tp_tensor_release(t);
            done = true;
            continue;
        }
        failures++;
        cr_assert_eq(st, TP_ERR_NO_MEMORY, "allocation %ld failing: %s (%s)", k, tp_status_name(st),
                     tp_last_error());
        cr_assert(strstr(tp_last_error(), "out of memory"), "%s", tp_last_error());
        cr_assert_null(t);
        cr_assert_eq(b.allocated, a.allocated, "allocation %ld failing: bytes counted", k);
        cr_assert_eq(tp_meta_memory_bytes(TP_META_MEM_LIVE, scope, TP_MEM_ANY), 0);
    }
    CHECK_OK(tp_set_allocator(NULL));
    cr_assert(done, "never succeeded");
    cr_assert_geq(failures, 2, "the header and the accounting's scope can fail");
}

/* ---- FSDP x TP x recompute on the Llama fixture ----------------------------- */

typedef struct llm_cfg {
    int dp, tp;
    bool fsdp;
    tp_recompute_mode ac;
} llm_cfg;

enum { LLM_ROWS = 4, LLM_SEQ = 8 };

/* One training step of the fixture "llama" model as tp-plan plays it (TP on
 * the tp slice of a (dp, tp) mesh, recompute of the blocks, FSDP units or
 * DDP over dp, Adam), its step's growth over the live bytes at its start
 * measured by mt. */
static tp_status llm_run(tp_comm *world, const llm_cfg *c, tp_device dev, const meter *mt,
                         size_t *growth)
{
    char dir[512];
    tp_llm_config cfg;
    TP_TEST_TRY(tp_llm_config_load(model_dir(LLAMA, dir, sizeof dir), &cfg));
    tp_module *model = NULL;
    tp_mesh *mesh = NULL, *tpm = NULL;
    tp_llm_plan *plan = NULL;
    tp_ddp *ddp = NULL;
    tp_adam *adam = NULL;
    tp_tensor *ids = NULL, *ids_dev = NULL, *logits = NULL, *loss = NULL;
    TP_TEST_TRY(tp_nn_set_default_device(dev));
    tp_status st = tp_llm_create(&cfg, &model);
    tp_nn_set_default_device(TP_CPU);
    if (st == TP_OK)
        st = tp_mesh_create(world, 2, (int64_t[]){c->dp, c->tp}, (const char *[]){"dp", "tp"},
                            &mesh);
    if (st == TP_OK)
        st = tp_mesh_slice(mesh, 1, (const char *[]){"tp"}, &tpm);
    if (st == TP_OK)
        st = tp_llm_plan_create(&(tp_llm_plan_options){0}, &plan);
    if (st == TP_OK)
        st = tp_llm_parallelize(model, tpm, tp_llm_plan_size(plan), tp_llm_plan_entries(plan),
                                &(tp_parallelize_options){.src_data_rank = TP_SRC_DATA_RANK_NONE});
    if (st == TP_OK)
        st = tp_module_init(model, 1);
    tp_module *layers = tp_module_find(model, "model.layers");
    if (st == TP_OK)
        st = tp_module_set_recompute_every(layers, 1, c->ac);
    for (int i = 0; c->fsdp && st == TP_OK && i < tp_module_num_children(layers); i++)
        st = tp_fully_shard(tp_module_child_at(layers, i, NULL), mesh, NULL);
    if (st == TP_OK && c->fsdp)
        st = tp_fully_shard(model, mesh, NULL);
    else if (st == TP_OK && c->dp > 1)
        st = tp_ddp_create(model, tp_mesh_comm(mesh, 0),
                           &(tp_ddp_options){.params_everywhere = true}, &ddp);
    if (st == TP_OK)
        st = tp_adam_create(model, 1e-3, 0.9, 0.999, 1e-8, &adam);
    const int64_t shape[2] = {LLM_ROWS, LLM_SEQ};
    if (st == TP_OK)
        st = tp_tensor_zeros(TP_I64, TP_CPU, 2, shape, &ids);
    if (st == TP_OK) /* token 0 everywhere: the values do not change the bytes */
        st = tp_tensor_zeros(TP_I64, dev, 2, shape, &ids_dev);
    size_t base = 0, peak = 0, live = 0;
    if (st == TP_OK) {
        mt->reset();
        mt->read(&base, &peak);
        st = tp_llm_forward(model, ids_dev, NULL, NULL, &logits);
    }
    if (st == TP_OK)
        st = tp_llm_loss(logits, ids, &loss);
    if (st == TP_OK)
        st = tp_backward(loss, NULL);
    if (st == TP_OK)
        st = tp_adam_step(adam);
    if (st == TP_OK) {
        mt->read(&live, &peak);
        *growth = peak - base;
    }
    tp_tensor_release(loss);
    tp_tensor_release(logits);
    tp_tensor_release(ids_dev);
    tp_tensor_release(ids);
    tp_adam_free(adam);
    tp_ddp_free(ddp);
    tp_module_free(model);
    tp_llm_plan_free(plan);
    tp_mesh_free(tpm);
    tp_mesh_free(mesh);
    return st;
}

typedef struct llm_ctx {
    llm_cfg cfg;
    thr_ctr ctr[TP_TEST_MAX_RANKS];
    size_t growth[TP_TEST_MAX_RANKS];
    tp_test_slot slots[TP_TEST_MAX_RANKS];
} llm_ctx;

static tp_status llm_body(tp_comm *world, void *arg)
{
    llm_ctx *c = arg;
    int r = tp_comm_rank(world);
    tl_ctr = &c->ctr[r];
    tp_status st = llm_run(world, &c->cfg, TP_CPU, &thr_meter, &c->growth[r]);
    tl_ctr = NULL;
    RANK_OK(&c->slots[r], st);
    return TP_OK;
}

static void check_llm(const llm_cfg *cfg)
{
    llm_ctx *c = calloc(1, sizeof *c);
    cr_assert_not_null(c);
    c->cfg = *cfg;
    const int n = cfg->dp * cfg->tp;
    CHECK_OK(tp_set_allocator(&(tp_allocator){ctr_alloc, ctr_free, NULL}));
    tp_test_run(n, llm_body, c, c->slots);
    CHECK_OK(tp_set_allocator(NULL));
    for (int r = 0; r < n; r++) {
        tp_comm *w = NULL;
        size_t got = 0;
        CHECK_OK(tp_meta_memory_set_rounding(TP_META_ROUND_CPU));
        CHECK_OK(tp_comm_create_world("sim", &(tp_sim_options){.world_size = n, .rank = r}, &w));
        CHECK_OK(llm_run(w, cfg, TP_META, &meta_meter, &got));
        tp_comm_free(w);
        CHECK_OK(tp_meta_memory_set_rounding(TP_META_ROUND_EXACT));
        const double real = (double)c->growth[r];
        cr_assert_gt(real, 0);
        if (getenv("TP_TEST_PRINT_MEMORY"))
            printf("dp %d tp %d fsdp %d ac %d rank %d: step peak meta %zu, CPU %zu\n", cfg->dp,
                   cfg->tp, cfg->fsdp, (int)cfg->ac, r, got, c->growth[r]);
        cr_assert(fabs((double)got - real) <= 0.05 * real,
                  "dp %d tp %d fsdp %d ac %d rank %d: the step's peak on meta %zu, on the CPU "
                  "%zu", cfg->dp, cfg->tp, cfg->fsdp, (int)cfg->ac, r, got, c->growth[r]);
    }
    free(c);
}

Test(meta_memory, llm_fsdp_tp_recompute_matches_cpu, .timeout = 120)
{
    const llm_cfg cfgs[] = {
        {2, 2, true, TP_RECOMPUTE_NONE},     {2, 2, true, TP_RECOMPUTE_FULL},
        {2, 2, true, TP_RECOMPUTE_SELECTIVE}, {2, 2, false, TP_RECOMPUTE_FULL},
        {4, 1, true, TP_RECOMPUTE_FULL},     {3, 2, true, TP_RECOMPUTE_SELECTIVE},
    };
    for (size_t i = 0; i < sizeof cfgs / sizeof *cfgs; i++)
        check_llm(&cfgs[i]);
}
