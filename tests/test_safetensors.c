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

/* Each case twice: all or nothing through scratch, and streamed (straight
 * into the parameters, or through one tensor's scratch when converting):
 * the same values, the same bytes read. */
static void load_plain(const dtype_case *c)
{
    for (int stream = 0; stream < 2; stream++) {
        char path[512];
        tp_module *m = NULL;
        tp_test_slot s = {0};
        CHECK_OK(make_model(c->param_dtype, -1, &m));
        uint64_t before = tp_safetensors_bytes_read();
        const tp_safetensors_load_options o = {.strict = true, .stream = stream};
        CHECK_OK(tp_safetensors_load(m, fixture(fixture_names[c->file], path, sizeof path), &o));
        uint64_t read = tp_safetensors_bytes_read() - before;
        expect_all(&s, m, (expect_t){true, c->fine, 0}, fixture_names[c->file]);
        tp_module_free(m);
        tp_test_assert_slots(&s, 1);
        cr_assert_eq(read, (48 + 6 + 40) * c->file_elem, "%s%s: read %llu bytes",
                     fixture_names[c->file], stream ? " streamed" : "",
                     (unsigned long long)read);
    }
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
    m = NULL;
    if (c->bad)
        return TP_OK;
    /* streamed into a fresh model: the same values, the same bytes */
    RANK_OK(s, make_sharded(world, c->layout, TP_F32, &m));
    before = tp_safetensors_bytes_read();
    const tp_safetensors_load_options so = {.strict = true, .stream = true};
    RANK_OK(s, tp_safetensors_load(m, p, &so));
    RANK_EXPECT(s, (int64_t)(tp_safetensors_bytes_read() - before) == run->want_reads[r],
                "streamed: %lld bytes read, want %lld",
                (long long)(tp_safetensors_bytes_read() - before), (long long)run->want_reads[r]);
    expect_all(s, m, (expect_t){true, c->fine, 0}, "after a streamed load");
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

/* ---- crafted files: corruption, names, strict mode -------------------------- */

/* A private directory for crafted files (removed with its files by rm_dir). */
static void tmp_dir(char *dir, size_t len)
{
    snprintf(dir, len, "/tmp/tp_st_XXXXXX");
    cr_assert_not_null(mkdtemp(dir));
}

static void rm_dir(const char *dir)
{
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    cr_assert_eq(system(cmd), 0);
}

static void write_bytes(const char *path, const void *data, size_t n)
{
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f, "cannot create %s", path);
    cr_assert_eq(fwrite(data, 1, n, f), n);
    cr_assert_eq(fclose(f), 0);
}

/* A safetensors file: header length `hlen` (0: the JSON's own), the JSON, then
 * ndata bytes of f32 values 0, 1, 2, ... */
static void write_st(const char *path, const char *json, uint64_t hlen, size_t ndata)
{
    size_t jl = strlen(json);
    unsigned char *buf = malloc(8 + jl + ndata + 1);
    cr_assert_not_null(buf);
    uint64_t l = hlen ? hlen : jl;
    for (int i = 0; i < 8; i++)
        buf[i] = (unsigned char)(l >> (8 * i));
    memcpy(buf + 8, json, jl);
    for (size_t i = 0; i + 4 <= ndata; i += 4) {
        float v = (float)(i / 4);
        memcpy(buf + 8 + jl + i, &v, 4);
    }
    write_bytes(path, buf, 8 + jl + ndata);
    free(buf);
}

/* Reads a whole file (malloc). */
static unsigned char *read_all(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "cannot open %s", path);
    fseek(f, 0, SEEK_END);
    *n = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *buf = malloc(*n ? *n : 1);
    cr_assert_eq(fread(buf, 1, *n, f), *n);
    fclose(f);
    return buf;
}

#define HDR_LIN(dtype_w, off_w)                                                          \
    "{\"lin.weight\":{\"dtype\":\"" dtype_w "\",\"shape\":[6,8],\"data_offsets\":" off_w \
    "},\"lin.bias\":{\"dtype\":\"F32\",\"shape\":[6],\"data_offsets\":[192,216]},"

#define HDR_EMB "\"emb.weight\":{\"dtype\":\"F32\",\"shape\":[10,4],\"data_offsets\":[216,376]}}"

/* Loads `path` into a fresh plain model filled with 7; expects `code`, a
 * message naming every string in `names` (NULL-terminated), and the model
 * untouched. */
static void expect_refused(const char *path, const tp_safetensors_load_options *o, tp_status code,
                           const char *const *names)
{
    tp_module *m = NULL;
    tp_test_slot s = {0};
    CHECK_OK(make_model(TP_F32, 7, &m));
    CHECK_ERR(tp_safetensors_load(m, path, o), code);
    const char *msg = tp_last_error();
    for (int i = 0; names[i]; i++)
        cr_assert_not_null(strstr(msg, names[i]), "message \"%s\" does not name %s", msg, names[i]);
    expect_all(&s, m, (expect_t){false, false, 7}, "after a refused load");
    tp_module_free(m);
    tp_test_assert_slots(&s, 1);
}

typedef struct {
    const char *json; /* NULL: a patched copy of the F32 fixture */
    uint64_t hlen;
    size_t ndata;
    tp_status code;
    const char *names[3];
} bad_case;

static void check_bad(const bad_case *b)
{
    char dir[64], path[128];
    tmp_dir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/bad.safetensors", dir);
    write_st(path, b->json, b->hlen, b->ndata);
    const char *names[5] = {path, b->names[0], b->names[1], b->names[2], NULL};
    expect_refused(path, NULL, b->code, names);
    rm_dir(dir);
}

Test(safetensors, corrupt_headers, .timeout = 30)
{
    static const bad_case cases[] = {
        /* data cut short: the last tensor lies beyond the end of the file */
        {HDR_LIN("F32", "[0,192]") HDR_EMB,
         0,
         376 - 4,
         TP_ERR_INVALID_ARG,
         {"emb.weight", "beyond the end"}},
        /* header length past the end of the file */
        {HDR_LIN("F32", "[0,192]") HDR_EMB,
         100000,
         376,
         TP_ERR_INVALID_ARG,
         {"header length 100000"}},
        /* header length over the format's 100 MB limit */
        {HDR_LIN("F32", "[0,192]") HDR_EMB, 1ull << 62, 376, TP_ERR_INVALID_ARG, {"too large"}},
        /* malformed JSON */
        {"{\"lin.weight\":{\"dtype\":\"F32\",", 0, 376, TP_ERR_INVALID_ARG, {"malformed"}},
        /* overlapping tensors */
        {HDR_LIN("F32", "[0,192]") "\"emb.weight\":{\"dtype\":\"F32\",\"shape\":[10,4],\"data_"
                                   "offsets\":[200,360]}}",
         0,
         376,
         TP_ERR_INVALID_ARG,
         {"lin.bias", "emb.weight", "overlap"}},
        /* offsets beyond the data */
        {HDR_LIN("F32", "[0,192]") "\"emb.weight\":{\"dtype\":\"F32\",\"shape\":[10,4],\"data_"
                                   "offsets\":[400,560]}}",
         0,
         376,
         TP_ERR_INVALID_ARG,
         {"emb.weight", "beyond"}},
        /* offsets that do not match dtype x shape */
        {HDR_LIN("F32", "[0,190]") HDR_EMB,
         0,
         376,
         TP_ERR_INVALID_ARG,
         {"lin.weight", "190 bytes"}},
        /* reversed offsets */
        {HDR_LIN("F32", "[192,0]") HDR_EMB,
         0,
         376,
         TP_ERR_INVALID_ARG,
         {"lin.weight", "data_offsets"}},
        /* a dtype the format does not have */
        {HDR_LIN("Q4", "[0,192]") HDR_EMB, 0, 376, TP_ERR_NOT_SUPPORTED, {"lin.weight", "'Q4'"}},
        /* a dtype of the format libtp cannot load */
        {HDR_LIN("I16", "[0,96]") HDR_EMB, 0, 376, TP_ERR_NOT_SUPPORTED, {"lin.weight", "I16"}},
        /* not convertible: integers into a float parameter */
        {HDR_LIN("I32", "[0,192]") HDR_EMB,
         0,
         376,
         TP_ERR_INVALID_ARG,
         {"lin.weight", "not convertible"}},
        /* the wrong shape */
        {"{\"lin.weight\":{\"dtype\":\"F32\",\"shape\":[8,6],\"data_offsets\":[0,192]},"
         "\"lin.bias\":{\"dtype\":\"F32\",\"shape\":[6],\"data_offsets\":[192,216]}," HDR_EMB,
         0,
         376,
         TP_ERR_INVALID_ARG,
         {"lin.weight", "[8, 6]"}},
        /* an entry without data_offsets */
        {"{\"lin.weight\":{\"dtype\":\"F32\",\"shape\":[6,8]}}",
         0,
         376,
         TP_ERR_INVALID_ARG,
         {"lin.weight", "data_offsets"}},
        /* not an object */
        {"[1,2,3]", 0, 0, TP_ERR_INVALID_ARG, {"not a JSON object"}},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
        check_bad(&cases[i]);
}

Test(safetensors, short_and_missing_files, .timeout = 30)
{
    char dir[64], path[128];
    tmp_dir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/short.safetensors", dir);
    write_bytes(path, "\x10\0\0", 3);
    expect_refused(path, NULL, TP_ERR_INVALID_ARG, (const char *const[]){path, "too short", NULL});
    snprintf(path, sizeof path, "%s/absent.safetensors", dir);
    expect_refused(path, NULL, TP_ERR_BACKEND, (const char *const[]){path, "cannot open", NULL});
    /* an index naming a file that is not there, and one without a weight map */
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    const char *idx = "{\"weight_map\":{\"lin.weight\":\"gone.safetensors\"}}";
    write_bytes(path, idx, strlen(idx));
    expect_refused(path, NULL, TP_ERR_BACKEND,
                   (const char *const[]){"gone.safetensors", "cannot open", NULL});
    write_bytes(path, "{\"metadata\":{}}", 15);
    expect_refused(path, NULL, TP_ERR_INVALID_ARG, (const char *const[]){path, "weight_map", NULL});
    rm_dir(dir);
}

/* Shapes whose element count passes 2^64: the count once wrapped (here to 0,
 * which matched empty offsets) and the header passed its check. An empty
 * tensor with large other sizes stays readable, as tp_tensor_empty makes it. */
Test(safetensors, shape_overflow, .timeout = 10)
{
    char dir[64], path[128];
    tmp_dir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/wrap.safetensors", dir);
    write_st(path,
             HDR_LIN("F32", "[0,192]") "\"emb.weight\":{\"dtype\":\"F32\",\"shape\":[16777216,"
                                       "16777216,65536],\"data_offsets\":[216,216]}}",
             0, 376);
    expect_refused(path, NULL, TP_ERR_INVALID_ARG,
                   (const char *const[]){path, "emb.weight", "shape too large", NULL});
    tp_tensor *t = NULL;
    CHECK_ERR(tp_safetensors_read(path, "emb.weight", &t), TP_ERR_INVALID_ARG);
    cr_assert_not_null(strstr(tp_last_error(), "shape too large"), "%s", tp_last_error());
    snprintf(path, sizeof path, "%s/empty.safetensors", dir);
    write_st(path, "{\"e\":{\"dtype\":\"F32\",\"shape\":[0,1099511627776,1048576],"
                   "\"data_offsets\":[0,0]}}", 0, 0);
    CHECK_OK(tp_safetensors_read(path, "e", &t));
    cr_assert_eq(tp_tensor_numel(t), 0);
    cr_assert_eq(tp_tensor_shape(t)[1], 1099511627776LL);
    tp_tensor_release(t);
    rm_dir(dir);
}

/* Only regular files are read: a FIFO named by an index (or given itself)
 * once blocked open() for a writer that never came; a directory is refused
 * by name rather than by a failed read. */
Test(safetensors, not_regular_files, .timeout = 10)
{
    char dir[64], path[128], fifo[128], idx[128];
    tmp_dir(dir, sizeof dir);
    snprintf(fifo, sizeof fifo, "%s/fifo.safetensors", dir);
    cr_assert_eq(mkfifo(fifo, 0644), 0);
    expect_refused(fifo, NULL, TP_ERR_BACKEND,
                   (const char *const[]){fifo, "not a regular file", NULL});
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    const char *to_fifo = "{\"weight_map\":{\"lin.weight\":\"fifo.safetensors\"}}";
    write_bytes(path, to_fifo, strlen(to_fifo));
    expect_refused(path, NULL, TP_ERR_BACKEND,
                   (const char *const[]){fifo, "not a regular file", NULL});
    const char *to_dir = "{\"weight_map\":{\"lin.weight\":\"..\"}}";
    write_bytes(path, to_dir, strlen(to_dir));
    expect_refused(path, NULL, TP_ERR_BACKEND, (const char *const[]){"/..", "not a regular file",
                                                                     NULL});
    /* the index itself a FIFO */
    snprintf(idx, sizeof idx, "%s/fifo.index.json", dir);
    cr_assert_eq(mkfifo(idx, 0644), 0);
    expect_refused(idx, NULL, TP_ERR_BACKEND, (const char *const[]){idx, "not a regular file",
                                                                    NULL});
    rm_dir(dir);
}

Test(safetensors, truncated_fixture, .timeout = 30)
{
    char dir[64], path[128], src[512];
    size_t n = 0;
    unsigned char *buf = read_all(fixture(fixture_names[F32_FILE], src, sizeof src), &n);
    tmp_dir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/cut.safetensors", dir);
    write_bytes(path, buf, n - 1);
    /* the reference package lays lin.weight out last */
    expect_refused(path, NULL, TP_ERR_INVALID_ARG,
                   (const char *const[]){path, "lin.weight", "truncated", NULL});
    free(buf);
    rm_dir(dir);
}

/* Strict mode: tensors naming no parameter and parameters left out. */
Test(safetensors, strict, .timeout = 30)
{
    char dir[64], path[128];
    tmp_dir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/part.safetensors", dir);
    write_st(path,
             HDR_LIN("F32", "[0,192]") "\"head.weight\":{\"dtype\":\"F32\",\"shape\":[2],\"data_"
                                       "offsets\":[216,224]}}",
             0, 224);
    expect_refused(path, NULL, TP_ERR_INVALID_ARG,
                   (const char *const[]){path, "head.weight", "emb.weight", NULL});
    tp_safetensors_load_options o = {.strict = false};
    tp_module *m = NULL;
    tp_test_slot s = {0};
    CHECK_OK(make_model(TP_F32, 7, &m));
    CHECK_OK(tp_safetensors_load(m, path, &o));
    /* lin.* hold 0, 1, 2, .. (write_st's data), emb untouched */
    double v = 0;
    CHECK_OK(tp_tensor_get(param(m, "lin.weight"), (int64_t[]){5, 7}, &v));
    cr_assert_eq(v, 47.0);
    CHECK_OK(tp_tensor_get(param(m, "lin.bias"), (int64_t[]){2}, &v));
    cr_assert_eq(v, 50.0);
    expect_param(&s, m, "emb.weight", (expect_t){false, false, 7}, "non-strict");
    tp_module_free(m);
    tp_test_assert_slots(&s, 1);
    rm_dir(dir);
}

/* The name map: "model." prefixes dropped, rotary buffers skipped. */
static bool strip_model(const char *file_name, char *fqn, size_t cap, void *ctx)
{
    int *calls = ctx;
    (*calls)++;
    if (strstr(file_name, "rotary"))
        return false;
    if (!strncmp(file_name, "model.", 6))
        snprintf(fqn, cap, "%s", file_name + 6);
    return true;
}

Test(safetensors, name_map, .timeout = 30)
{
    char dir[64], path[128];
    tmp_dir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/hf.safetensors", dir);
    write_st(
        path,
        "{\"model.lin.weight\":{\"dtype\":\"F32\",\"shape\":[6,8],\"data_offsets\":[0,192]},"
        "\"model.lin.bias\":{\"dtype\":\"F32\",\"shape\":[6],\"data_offsets\":[192,216]},"
        "\"model.rotary.inv_freq\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[216,220]},"
        "\"emb.weight\":{\"dtype\":\"F32\",\"shape\":[10,4],\"data_offsets\":[220,380]}}",
        0, 380);
    int calls = 0;
    tp_safetensors_load_options o = {.map_name = strip_model, .map_ctx = &calls, .strict = true};
    tp_module *m = NULL;
    CHECK_OK(make_model(TP_F32, 7, &m));
    uint64_t before = tp_safetensors_bytes_read();
    CHECK_OK(tp_safetensors_load(m, path, &o));
    cr_assert_eq(tp_safetensors_bytes_read() - before, 376, "the skipped tensor is not read");
    cr_assert_eq(calls, 4);
    double v = 0;
    CHECK_OK(tp_tensor_get(param(m, "lin.weight"), (int64_t[]){0, 1}, &v));
    cr_assert_eq(v, 1.0);
    CHECK_OK(tp_tensor_get(param(m, "emb.weight"), (int64_t[]){9, 3}, &v));
    cr_assert_eq(v, 94.0); /* data float 55 + 39 */
    tp_module_free(m);
    /* without the map: the prefixed names are unknown (and the U8 tensor too) */
    expect_refused(path, NULL, TP_ERR_INVALID_ARG,
                   (const char *const[]){"model.lin.weight", "lin.bias", NULL});
    rm_dir(dir);
}

/* ---- saving ------------------------------------------------------------------ */

typedef struct {
    int n, layout;
    tp_dtype dtype;
    char path[128];
    char dir[64];        /* tp_safetensors_save_sharded into it when shard_bytes > 0 */
    size_t shard_bytes;
    tp_test_slot slot[TP_TEST_MAX_RANKS];
    tp_status st[TP_TEST_MAX_RANKS];
    int64_t gathers[TP_TEST_MAX_RANKS], all_reduces[TP_TEST_MAX_RANKS];
} save_run;

static tp_status save_body(tp_comm *world, void *arg)
{
    save_run *run = arg;
    int r = tp_comm_rank(world);
    tp_test_slot *s = &run->slot[r];
    tp_module *m = NULL;
    tp_comm_debug *dbg = NULL;
    RANK_OK(s, make_sharded(world, run->layout, run->dtype, &m));
    RANK_OK(s, tp_module_init(m, 1234));
    tp_status st = tp_comm_debug_create(&dbg);
    if (st == TP_OK)
        st = tp_comm_debug_begin(dbg);
    if (st == TP_OK)
        run->st[r] = run->shard_bytes
                         ? tp_safetensors_save_sharded(m, run->dir, NULL, run->shard_bytes,
                                                       run->n - 1)
                         : tp_safetensors_save(m, run->path, run->n - 1);
    if (st == TP_OK)
        st = tp_comm_debug_end(dbg);
    RANK_EXPECT(s, st == TP_OK, "comm debug: %s", tp_last_error());
    RANK_EXPECT(s, run->st[r] == TP_OK, "save: %s", tp_last_error());
    run->all_reduces[r] = tp_comm_debug_count(dbg, TP_COLL_ALL_REDUCE);
    run->gathers[r] = tp_comm_debug_count(dbg, TP_COLL_ALL_GATHER);
    tp_comm_debug_free(dbg);
    tp_module_free(m);
    return TP_OK;
}

/* Saves a sharded model (root: the last rank), loads the file into a plain
 * model and compares it with a plain model initialised alike (tp_module_init
 * gives the same global values at every degree). */
static void save_round_trip(int n, int layout, tp_dtype dt)
{
    char dir[64];
    tmp_dir(dir, sizeof dir);
    save_run run = {.n = n, .layout = layout, .dtype = dt};
    snprintf(run.path, sizeof run.path, "%s/out.safetensors", dir);
    tp_test_run(n, save_body, &run, run.slot);
    /* sharded parameters: layout 0 all three, layout 1 lin.weight and
     * emb.weight (lin.bias is replicated); one all_gather each */
    int64_t want_gathers = n == 1 ? 0 : layout == 0 ? 3 : 2;
    for (int r = 0; r < n; r++) {
        cr_assert_eq(run.all_reduces[r], 1, "rank %d: %lld all_reduces", r,
                     (long long)run.all_reduces[r]);
        cr_assert_eq(run.gathers[r], want_gathers, "rank %d: %lld all_gathers", r,
                     (long long)run.gathers[r]);
    }
    size_t len = 0;
    unsigned char *buf = read_all(run.path, &len);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = hlen << 8 | buf[i];
    cr_assert_eq((8 + hlen) % 8, 0, "header length %llu", (unsigned long long)hlen);
    cr_assert_eq(len, 8 + hlen + (48 + 6 + 40) * tp_dtype_size(dt));
    cr_assert_not_null(strstr((char *)buf + 8, "\"__metadata__\":{\"format\":\"pt\"}"));
    free(buf);

    tp_module *want = NULL, *got = NULL;
    CHECK_OK(make_model(dt, 0, &want));
    CHECK_OK(tp_module_init(want, 1234));
    CHECK_OK(make_model(dt, 7, &got));
    CHECK_OK(tp_safetensors_load(got, run.path, NULL));
    for (int i = 0; i < 3; i++) {
        bool eq = false;
        CHECK_OK(tp_tensor_equal(param(got, names3[i]), param(want, names3[i]), &eq));
        cr_assert(eq, "n %d layout %d %s: %s differs after the round trip", n, layout,
                  tp_dtype_name(dt), names3[i]);
    }
    tp_module_free(want);
    tp_module_free(got);
    rm_dir(dir);
}

typedef struct {
    int n, layout;
    tp_dtype dtype;
} save_case;

ParameterizedTestParameters(safetensors, save)
{
    static save_case cases[] = {
        {1, 0, TP_F32}, {2, 0, TP_F32},  {3, 1, TP_F32}, {4, 0, TP_F32},
        {4, 1, TP_F32}, {2, 1, TP_BF16}, {3, 0, TP_F16},
    };
    return cr_make_param_array(save_case, cases, sizeof cases / sizeof *cases);
}

ParameterizedTest(save_case *c, safetensors, save, .timeout = 60)
{
    save_round_trip(c->n, c->layout, c->dtype);
}

/* Sharded as transformers shards: 200 bytes put lin.weight (192 bytes in f32)
 * alone and lin.bias with emb.weight (24 + 160) in a second file; the index
 * lists both; one all_reduce whatever the number of files. */
ParameterizedTestParameters(safetensors, save_sharded)
{
    static int worlds[] = {1, 3};
    return cr_make_param_array(int, worlds, 2);
}

ParameterizedTest(int *n, safetensors, save_sharded, .timeout = 60)
{
    save_run run = {.n = *n, .layout = 0, .dtype = TP_F32, .shard_bytes = 200};
    tmp_dir(run.dir, sizeof run.dir);
    tp_test_run(*n, save_body, &run, run.slot);
    for (int r = 0; r < *n; r++)
        cr_assert_eq(run.all_reduces[r], 1, "rank %d: %lld all_reduces", r,
                     (long long)run.all_reduces[r]);
    char path[200];
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", run.dir);
    size_t len = 0;
    char *index = (char *)read_all(path, &len);
    cr_assert_not_null(strstr(index, "\"total_size\": 376"), "%s", index);
    cr_assert_not_null(strstr(index, "\"lin.weight\": \"model-00001-of-00002.safetensors\""));
    cr_assert_not_null(strstr(index, "\"lin.bias\": \"model-00002-of-00002.safetensors\""));
    cr_assert_not_null(strstr(index, "\"emb.weight\": \"model-00002-of-00002.safetensors\""));
    free(index);
    char first[64];
    snprintf(first, sizeof first, "%s", run.dir);
    tp_module *want = NULL, *got = NULL;
    CHECK_OK(make_model(TP_F32, 0, &want));
    CHECK_OK(tp_module_init(want, 1234));
    CHECK_OK(make_model(TP_F32, 7, &got));
    CHECK_OK(tp_safetensors_load(got, path, NULL));
    for (int i = 0; i < 3; i++) {
        bool eq = false;
        CHECK_OK(tp_tensor_equal(param(got, names3[i]), param(want, names3[i]), &eq));
        cr_assert(eq, "n %d: %s differs after the sharded round trip", *n, names3[i]);
    }
    /* no limit: one model.safetensors, no index */
    run = (save_run){.n = 1, .layout = 0, .dtype = TP_F32};
    tmp_dir(run.dir, sizeof run.dir);
    tp_module *m = NULL;
    CHECK_OK(make_model(TP_F32, 0, &m));
    CHECK_OK(tp_module_init(m, 1234));
    CHECK_OK(tp_safetensors_save_sharded(m, run.dir, "model", 0, 0));
    snprintf(path, sizeof path, "%s/model.safetensors", run.dir);
    CHECK_OK(tp_safetensors_load(got, path, NULL));
    char cmd[200];
    snprintf(cmd, sizeof cmd, "test $(ls '%s' | wc -l) -eq 1", run.dir);
    cr_assert_eq(system(cmd), 0, "expected one file in %s", run.dir);
    CHECK_ERR(tp_safetensors_save_sharded(m, run.dir, "a/b", 0, 0), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_safetensors_save_sharded(m, run.dir, NULL, 0, 1), TP_ERR_INVALID_ARG);
    tp_module_free(m);
    tp_module_free(want);
    tp_module_free(got);
    rm_dir(run.dir);
    rm_dir(first);
}

/* Plain tensors by name: written, read back bit for bit, refusals named. */
Test(safetensors, read_write_tensors, .timeout = 30)
{
    char dir[64], path[160];
    tmp_dir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/t.safetensors", dir);
    const int64_t s1[3] = {2, 3, 5}, s2[1] = {4};
    tp_tensor *a = NULL, *b = NULL, *c = NULL, *back = NULL;
    CHECK_OK(tp_tensor_zeros(TP_F32, TP_CPU, 3, s1, &a));
    CHECK_OK(tp_tensor_fill_random(a, TP_RNG_UNIFORM, -1, 1, 5, NULL, NULL));
    const int64_t ids[4] = {7, -1, 1LL << 40, 0};
    CHECK_OK(tp_tensor_from_data(TP_I64, 1, s2, ids, &b));
    CHECK_OK(tp_tensor_to(a, TP_BF16, TP_CPU, &c));
    const char *names[3] = {"logits", "ids", "half"};
    tp_tensor *ts[3] = {a, b, c};
    CHECK_OK(tp_safetensors_write(path, 3, names, ts));
    for (int i = 0; i < 3; i++) {
        CHECK_OK(tp_safetensors_read(path, names[i], &back));
        bool eq = false;
        CHECK_OK(tp_tensor_equal(back, ts[i], &eq));
        cr_assert(eq, "%s differs after the round trip", names[i]);
        tp_tensor_release(back);
        back = NULL;
    }
    CHECK_ERR(tp_safetensors_read(path, "nope", &back), TP_ERR_INVALID_ARG);
    cr_assert_not_null(strstr(tp_last_error(), "nope"));
    cr_assert_null(back);
    const char *twice[2] = {"x", "x"};
    CHECK_ERR(tp_safetensors_write(path, 2, twice, ts), TP_ERR_INVALID_ARG);
    cr_assert_not_null(strstr(tp_last_error(), "named twice"));
    snprintf(path, sizeof path, "%s/missing.safetensors", dir);
    CHECK_ERR(tp_safetensors_read(path, "logits", &back), TP_ERR_BACKEND);
    tp_tensor_release(a);
    tp_tensor_release(b);
    tp_tensor_release(c);
    rm_dir(dir);
}

Test(safetensors, save_plain_and_failure, .timeout = 30)
{
    char dir[64], path[160];
    tmp_dir(dir, sizeof dir);
    tp_module *m = NULL, *back = NULL;
    CHECK_OK(make_model(TP_F32, 0, &m));
    CHECK_OK(tp_module_init(m, 99));
    snprintf(path, sizeof path, "%s/plain.safetensors", dir);
    CHECK_ERR(tp_safetensors_save(m, path, 1), TP_ERR_INVALID_ARG);
    CHECK_OK(tp_safetensors_save(m, path, 0));
    CHECK_OK(make_model(TP_F32, 7, &back));
    CHECK_OK(tp_safetensors_load(back, path, NULL));
    for (int i = 0; i < 3; i++) {
        bool eq = false;
        CHECK_OK(tp_tensor_equal(param(back, names3[i]), param(m, names3[i]), &eq));
        cr_assert(eq, "%s differs", names3[i]);
    }
    /* a directory that is not there: an error, and nothing left behind */
    snprintf(path, sizeof path, "%s/no/such.safetensors", dir);
    CHECK_ERR(tp_safetensors_save(m, path, 0), TP_ERR_BACKEND);
    cr_assert_not_null(strstr(tp_last_error(), path));
    /* overwriting an existing file is atomic: the old one stays until rename */
    snprintf(path, sizeof path, "%s/plain.safetensors", dir);
    CHECK_OK(tp_module_init(m, 100));
    CHECK_OK(tp_safetensors_save(m, path, 0));
    CHECK_OK(tp_safetensors_load(back, path, NULL));
    bool eq = false;
    CHECK_OK(tp_tensor_equal(param(back, "lin.weight"), param(m, "lin.weight"), &eq));
    cr_assert(eq);
    char cmd[200];
    snprintf(cmd, sizeof cmd, "test $(ls '%s' | wc -l) -eq 1", dir);
    cr_assert_eq(system(cmd), 0, "a temporary file was left in %s", dir);
    tp_module_free(m);
    tp_module_free(back);
    rm_dir(dir);
}

/* ---- allocation failure in turn -------------------------------------------- */

static tp_test_alloc A;

static void alloc_restore(void)
{
    tp_set_allocator(NULL);
}

/* Every allocation of a load (sharded index, conversion to bf16) and of a
 * save fails in turn: TP_ERR_NO_MEMORY, the model untouched, nothing leaked. */
Test(safetensors, alloc_failure, .timeout = 60, .fini = alloc_restore)
{
    char path[512], dir[64], out[128];
    tmp_dir(dir, sizeof dir);
    snprintf(out, sizeof out, "%s/out.safetensors", dir);
    A = (tp_test_alloc){0, 0, -1};
    tp_allocator a = {tp_test_alloc_fn, tp_test_free_fn, &A};
    CHECK_OK(tp_set_allocator(&a));
    tp_module *m = NULL;
    CHECK_OK(make_model(TP_BF16, 7, &m));
    for (int op = 0; op < 2; op++) {
        bool done = false;
        long k = 0;
        for (; k < 4096 && !done; k++) {
            tp_test_slot s = {0};
            long live = A.live;
            A.count = 0;
            A.fail_at = k;
            tp_status st = op == 0
                               ? tp_safetensors_load(
                                     m, fixture(fixture_names[INDEX_FILE], path, sizeof path), NULL)
                               : tp_safetensors_save(m, out, 0);
            A.fail_at = -1;
            done = st == TP_OK;
            cr_assert(done || st == TP_ERR_NO_MEMORY, "op %d, allocation %ld failing: %s (%s)", op,
                      k, tp_status_name(st), tp_last_error());
            cr_assert_eq(A.live, live, "op %d, allocation %ld failing: %ld blocks leaked", op, k,
                         A.live - live);
            if (op == 0 && !done)
                expect_all(&s, m, (expect_t){false, false, 7}, "after a failed load");
            if (op == 1 && !done)
                cr_assert_neq(access(out, F_OK), 0, "a failed save left %s", out);
            tp_test_assert_slots(&s, 1);
        }
        cr_assert(done, "op %d never succeeded", op);
        /* paths, names, the entry table, scratch tensors, ... */
        cr_assert_gt(k, 10, "op %d: only %ld allocations exercised", op, k);
    }
    tp_module_free(m);
    tp_set_allocator(NULL);
    rm_dir(dir);
}
