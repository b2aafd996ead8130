/* safetensors checkpoints: loading the files tests/fixtures/make_safetensors.py
 * wrote with the reference package (every element against values recomputed
 * here, all three dtypes and conversions), into plain and colwise/rowwise
 * parallelized modules at world sizes 1-4 (bytes read per rank, one
 * all_reduce), the name map, strict mode, every corrupt-file case (exact
 * code, tensor and file named, module untouched), save -> load round trips
 * and allocation failure in turn. */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <fcntl.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tp_test.h"

/* ---- fixtures and reference values ---------------------------------------- */

/* Criterion parameters hold no pointers (a test may run in a new process):
 * fixtures by index. */
enum { F32_FILE, BF16_FILE, F16_FILE, INDEX_FILE, NO_FILE };
static const char *const fixture_names[] = {"model_f32.safetensors", "model_bf16.safetensors",
                                            "model_f16.safetensors", "model.safetensors.index.json",
                                            "../no-such-dir/model.safetensors"};

static const char *fixture(const char *name, char *buf, size_t len)
{
    const char *dir = getenv("TP_FIXTURES");
    snprintf(buf, len, "%s/%s", dir ? dir : "tests/fixtures", name);
    return buf;
}

/* The values make_safetensors.py wrote; `fine` adds the 2^-12 terms of the
 * F32 files. k is the flat (row-major) index. */
static double ref_value(const char *fqn, int64_t k, bool fine)
{
    if (!strcmp(fqn, "lin.weight"))
        return (double)(k - 20) * 0.375 + (fine ? (double)(k % 5) * ldexp(1, -12) : 0);
    if (!strcmp(fqn, "lin.bias"))
        return (double)k * 10 - 25;
    return (double)k * 0.25 - 5; /* emb.weight */
}

/* Round to nearest even of a float to bf16, from its bits. */
static double round_bf16(double v)
{
    float f = (float)v;
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7fffu + ((u >> 16) & 1u);
    u &= 0xffff0000u;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* The value a parameter of dtype `dt` holds after loading v (the F16 file's
 * values and the coarse ones are exact in every dtype here). */
static double as_dtype(double v, tp_dtype dt)
{
    return dt == TP_BF16 ? round_bf16(v) : dt == TP_F32 ? (double)(float)v : v;
}

static const char *const names3[] = {"lin.weight", "lin.bias", "emb.weight"};

/* Parameter by FQN ("child.name"); borrowed. */
static tp_tensor *param(tp_module *m, const char *fqn)
{
    char child[64];
    const char *dot = strchr(fqn, '.');
    snprintf(child, sizeof child, "%.*s", (int)(dot - fqn), fqn);
    tp_module *c = tp_module_find(m, child);
    return c ? tp_module_parameter(c, dot + 1) : NULL;
}

static tp_tensor *local_of(tp_tensor *p)
{
    return tp_tensor_is_dtensor(p) ? tp_dtensor_local(p) : p;
}

/* A container: "lin" Linear(8 -> 6, bias), "emb" Embedding(10, 4), every
 * parameter filled with `fill`, in dtype dt. */
static tp_status make_model(tp_dtype dt, double fill, tp_module **out)
{
    tp_module *m = NULL, *lin = NULL, *emb = NULL;
    tp_status st = tp_nn_container_create(&m);
    if (st == TP_OK)
        st = tp_nn_linear_create(8, 6, true, &lin);
    if (st == TP_OK && (st = tp_module_add_child(m, "lin", lin)) != TP_OK)
        tp_module_free(lin);
    if (st == TP_OK)
        st = tp_nn_embedding_create(10, 4, &emb);
    if (st == TP_OK && (st = tp_module_add_child(m, "emb", emb)) != TP_OK)
        tp_module_free(emb);
    if (st == TP_OK && dt != TP_F32)
        st = tp_module_to_dtype(m, dt);
    for (int i = 0; i < 3 && st == TP_OK; i++)
        st = tp_tensor_fill(local_of(param(m, names3[i])), fill);
    if (st != TP_OK) {
        tp_module_free(m);
        return st;
    }
    *out = m;
    return TP_OK;
}

/* What a parameter should hold: the fixture's values (fine or not) or
 * `fill` everywhere (untouched). */
typedef struct {
    bool loaded, fine;
    double fill;
} expect_t;

/* This rank's block of p: shape and offset in the global tensor. */
static tp_status block_of(tp_tensor *p, int64_t *shape, int64_t *offset)
{
    int nd = tp_tensor_ndim(p);
    if (!tp_tensor_is_dtensor(p)) {
        memcpy(shape, tp_tensor_shape(p), (size_t)nd * sizeof *shape);
        memset(offset, 0, (size_t)nd * sizeof *offset);
        return TP_OK;
    }
    tp_mesh *mesh = tp_dtensor_mesh(p);
    return tp_dtensor_shard_extent(mesh, nd, tp_tensor_shape(p), tp_mesh_ndim(mesh),
                                   tp_dtensor_placements(p), NULL, shape, offset);
}

/* Every element of this rank's block of parameter fqn (1-D or 2-D) against
 * the expectation; returns whether all matched. */
static bool expect_param(tp_test_slot *s, tp_module *m, const char *fqn, expect_t e,
                         const char *what)
{
    tp_tensor *p = param(m, fqn);
    RANK_EXPECT(s, p, "%s: no parameter %s", what, fqn);
    if (!p)
        return false;
    int64_t shape[2] = {1, 1}, offset[2] = {0, 0};
    int nd = tp_tensor_ndim(p);
    tp_status st = block_of(p, shape, offset);
    RANK_EXPECT(s, st == TP_OK, "%s: block of %s: %s", what, fqn, tp_last_error());
    int64_t cols = nd == 2 ? tp_tensor_shape(p)[1] : 1, rows = nd == 2 ? shape[0] : 1;
    int64_t ncol = nd == 2 ? shape[1] : shape[0];
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < ncol; j++) {
            int64_t idx[2] = {i, j},
                    k = nd == 2 ? (offset[0] + i) * cols + offset[1] + j : offset[0] + j;
            double got = 0, want = e.loaded
                                       ? as_dtype(ref_value(fqn, k, e.fine), tp_tensor_dtype(p))
                                       : e.fill;
            st = tp_tensor_get(local_of(p), nd == 2 ? idx : &idx[1], &got);
            if (st != TP_OK || got != want) {
                RANK_EXPECT(s, 0, "%s: %s[%lld] = %.9g, expected %.9g (%s)", what, fqn,
                            (long long)k, got, want, tp_status_name(st));
                return false;
            }
        }
    return true;
}

static bool expect_all(tp_test_slot *s, tp_module *m, expect_t e, const char *what)
{
    bool ok = true;
    for (int i = 0; i < 3; i++)
        ok = expect_param(s, m, names3[i], e, what) && ok;
    return ok;
}

/* Bytes this rank must read for parameter fqn: its block, in file dtype. */
static int64_t block_bytes(tp_module *m, const char *fqn, size_t elem)
{
    int64_t shape[2], offset[2];
    tp_tensor *p = param(m, fqn);
    if (block_of(p, shape, offset) != TP_OK)
        return -1;
    int64_t n = 1;
    for (int d = 0; d < tp_tensor_ndim(p); d++)
        n *= shape[d];
    return n * (int64_t)elem;
}

/* ---- single process: the three dtypes and conversions ---------------------- */

TestSuite(safetensors, .timeout = 60);

typedef struct {
    int file;
    tp_dtype param_dtype;
    bool fine;
    size_t file_elem;
} dtype_case;

static void load_plain(const dtype_case *c)
{
    char path[512];
    tp_module *m = NULL;
    tp_test_slot s = {0};
    CHECK_OK(make_model(c->param_dtype, -1, &m));
    uint64_t before = tp_safetensors_bytes_read();
    CHECK_OK(tp_safetensors_load(m, fixture(fixture_names[c->file], path, sizeof path), NULL));
    uint64_t read = tp_safetensors_bytes_read() - before;
    expect_all(&s, m, (expect_t){true, c->fine, 0}, fixture_names[c->file]);
    tp_module_free(m);
    tp_test_assert_slots(&s, 1);
    cr_assert_eq(read, (48 + 6 + 40) * c->file_elem, "%s: read %llu bytes", fixture_names[c->file],
                 (unsigned long long)read);
}

ParameterizedTestParameters(safetensors, dtypes)
{
    static dtype_case cases[] = {
        {F32_FILE, TP_F32, true, 4},    {F32_FILE, TP_BF16, true, 4}, /* rounds the 2^-12 terms */
        {BF16_FILE, TP_BF16, false, 2}, {BF16_FILE, TP_F32, false, 2},
        {BF16_FILE, TP_F16, false, 2},  {F16_FILE, TP_F16, false, 2},
        {F16_FILE, TP_F32, false, 2},   {F16_FILE, TP_BF16, false, 2},
        {INDEX_FILE, TP_F32, true, 4},
    };
    return cr_make_param_array(dtype_case, cases, sizeof cases / sizeof *cases);
}

ParameterizedTest(dtype_case *c, safetensors, dtypes, .timeout = 30)
{
    load_plain(c);
}

Test(safetensors, bf16_rounding_is_exercised, .timeout = 10)
{
    /* the F32 file's fine terms must not all survive bf16, else the
     * conversion case above would prove nothing */
    int changed = 0;
    for (int64_t k = 0; k < 48; k++)
        changed += round_bf16(ref_value("lin.weight", k, true)) !=
                   (double)(float)ref_value("lin.weight", k, true);
    cr_assert_gt(changed, 20);
}

/* ---- distributed: colwise/rowwise modules, world sizes 1-4 ------------------- */

typedef struct {
    int n;
    int layout; /* 0: lin colwise (weight Shard(0)), emb rowwise (Shard(0));
                   1: lin rowwise (weight Shard(1), bias replicated), emb colwise (Shard(1)) */
    int file;
    size_t file_elem;
    bool fine;
    bool bad; /* rank n-1 loads NO_FILE instead (a failure) */
} dist_case;

typedef struct {
    const dist_case *c;
    tp_test_slot slot[TP_TEST_MAX_RANKS];
    tp_status st[TP_TEST_MAX_RANKS];
    int64_t reads[TP_TEST_MAX_RANKS], want_reads[TP_TEST_MAX_RANKS];
    int64_t all_reduces[TP_TEST_MAX_RANKS], colls[TP_TEST_MAX_RANKS];
} dist_run;

static tp_status par_style(tp_module *m, tp_mesh *mesh, const char *fqn, bool col)
{
    tp_style *style = NULL;
    TP_TEST_TRY(col ? tp_colwise_parallel_create(NULL, &style)
                    : tp_rowwise_parallel_create(NULL, &style));
    tp_plan_entry e = {fqn, style};
    tp_parallelize_options o = {.src_data_rank = TP_SRC_DATA_RANK_NONE};
    tp_status st = tp_parallelize_module(m, mesh, 1, &e, &o);
    tp_style_free(style);
    return st;
}

/* A sharded model on a 1-D mesh of the world, filled with -1. */
static tp_status make_sharded(tp_comm *world, int layout, tp_dtype dt, tp_module **out)
{
    int64_t n = tp_comm_size(world);
    tp_mesh *mesh = NULL;
    tp_module *m = NULL;
    TP_TEST_TRY(tp_mesh_create(world, 1, &n, NULL, &mesh));
    tp_status st = make_model(dt, -1, &m);
    if (st == TP_OK)
        st = par_style(m, mesh, "lin", layout == 0);
    if (st == TP_OK)
        st = par_style(m, mesh, "emb", layout != 0);
    for (int i = 0; i < 3 && st == TP_OK; i++)
        st = tp_tensor_fill(local_of(param(m, names3[i])), -1);
    tp_mesh_free(mesh);
    if (st != TP_OK) {
        tp_module_free(m);
        return st;
    }
    *out = m;
    return TP_OK;
}

static tp_status dist_body(tp_comm *world, void *arg)
{
    dist_run *run = arg;
    const dist_case *c = run->c;
    int r = tp_comm_rank(world);
    tp_test_slot *s = &run->slot[r];
    tp_module *m = NULL;
    tp_comm_debug *dbg = NULL;
    char path[512];
    RANK_OK(s, make_sharded(world, c->layout, TP_F32, &m));
    for (int i = 0; i < 3; i++)
        run->want_reads[r] += block_bytes(m, names3[i], c->file_elem);
    tp_status st = tp_comm_debug_create(&dbg);
    if (st == TP_OK)
        st = tp_comm_debug_begin(dbg);
    uint64_t before = tp_safetensors_bytes_read();
    const char *p =
        fixture(fixture_names[c->bad && r == c->n - 1 ? NO_FILE : c->file], path, sizeof path);
    if (st == TP_OK)
        run->st[r] = tp_safetensors_load(m, p, NULL);
    run->reads[r] = (int64_t)(tp_safetensors_bytes_read() - before);
    if (st == TP_OK)
        st = tp_comm_debug_end(dbg);
    RANK_EXPECT(s, st == TP_OK, "comm debug: %s", tp_last_error());
    run->all_reduces[r] = tp_comm_debug_count(dbg, TP_COLL_ALL_REDUCE);
    run->colls[r] = tp_comm_debug_count(dbg, TP_COLL_ANY);
    if (!c->bad)
        RANK_EXPECT(s, run->st[r] == TP_OK, "load: %s", tp_last_error());
    expect_all(s, m, c->bad ? (expect_t){false, false, -1} : (expect_t){true, c->fine, 0},
               "after load");
    tp_comm_debug_free(dbg);
    tp_module_free(m);
    return TP_OK;
}

static void run_dist(const dist_case *c)
{
    dist_run run = {.c = c};
    tp_test_run(c->n, dist_body, &run, run.slot);
    for (int r = 0; r < c->n; r++) {
        cr_assert_eq(run.all_reduces[r], 1, "rank %d: %lld all_reduces", r,
                     (long long)run.all_reduces[r]);
        cr_assert_eq(run.colls[r], 1, "rank %d: %lld collectives", r, (long long)run.colls[r]);
        if (c->bad) {
            tp_status want = r == c->n - 1 ? TP_ERR_BACKEND : TP_ERR_MISMATCH;
            cr_assert_eq(run.st[r], want, "rank %d: %s, expected %s", r, tp_status_name(run.st[r]),
                         tp_status_name(want));
        } else {
            cr_assert_eq(run.reads[r], run.want_reads[r],
                         "rank %d read %lld bytes, its block is %lld", r, (long long)run.reads[r],
                         (long long)run.want_reads[r]);
        }
    }
}

ParameterizedTestParameters(safetensors, sharded)
{
    static dist_case cases[] = {
        {1, 0, F32_FILE, 4, true, false},
        {2, 0, F32_FILE, 4, true, false},
        {3, 0, F32_FILE, 4, true, false},
        {4, 0, F32_FILE, 4, true, false},
        {1, 1, F32_FILE, 4, true, false},
        {2, 1, F32_FILE, 4, true, false},
        {3, 1, F32_FILE, 4, true, false},
        {4, 1, F32_FILE, 4, true, false},
        {2, 0, BF16_FILE, 2, false, false},
        {3, 1, F16_FILE, 2, false, false},
        {1, 1, INDEX_FILE, 4, true, false},
        {2, 1, INDEX_FILE, 4, true, false},
        {3, 0, INDEX_FILE, 4, true, false},
        {4, 1, INDEX_FILE, 4, true, false},
        /* one rank fails: nobody commits */
        {2, 0, F32_FILE, 4, true, true},
        {3, 1, F32_FILE, 4, true, true},
        {4, 0, INDEX_FILE, 4, true, true},
    };
    return cr_make_param_array(dist_case, cases, sizeof cases / sizeof *cases);
}

ParameterizedTest(dist_case *c, safetensors, sharded, .timeout = 60)
{
    run_dist(c);
}
