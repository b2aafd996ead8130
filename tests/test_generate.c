/* Generation against transformers: the small random models of
 * tests/fixtures/hf, their left-padded batch of three prompts (9, 4 and 7
 * tokens) generated greedily at tp 1, 2 and 4 (gen_ref.safetensors, made by
 * make_models.py --generate-refs): every token equal to
 * transformers' generate(do_sample=False), with the config's eos and with an
 * eos that ends one row early; the logits of every decode step within f32
 * rounding of transformers' and of a full forward over the whole prefix;
 * the collectives of a decode step; no allocation in steady state; the
 * cache's bytes; refusals that leave the cache as it was; sampling's
 * determinism across tp degrees and its distribution (chi-square). Also
 * built as test_generate_mpi (one process per rank under mpirun). */
#include <math.h>
#include <stdarg.h>
#include <sys/wait.h>

#include "llm_fixture.h"

static tp_status gen_ref(int model, const char *name, tp_tensor **out)
{
    char dir[512], path[600];
    snprintf(path, sizeof path, "%s/gen_ref.safetensors", model_dir(model, dir, sizeof dir));
    return tp_safetensors_read(path, name, out);
}

static bool same_i64(const tp_tensor *a, const tp_tensor *b)
{
    return tp_tensor_ndim(a) == 2 && tp_tensor_ndim(b) == 2 &&
           tp_tensor_size(a, 0) == tp_tensor_size(b, 0) &&
           tp_tensor_size(a, 1) == tp_tensor_size(b, 1) &&
           !memcmp(tp_tensor_data(a), tp_tensor_data(b), tp_tensor_nbytes(a));
}

static const char *row_str(const tp_tensor *t, int64_t b, char *buf, size_t len)
{
    const int64_t T = tp_tensor_size(t, 1), *d = (const int64_t *)tp_tensor_data(t) + b * T;
    size_t n = 0;
    buf[0] = 0;
    for (int64_t i = 0; i < T && n + 24 < len; i++)
        n += (size_t)snprintf(buf + n, len - n, "%s%lld", i ? "," : "", (long long)d[i]);
    return buf;
}

/* ---- greedy generation against transformers -------------------------------------- */

typedef struct {
    int model, tp;
    bool cuda;      /* the model on the GPU (shm ranks sharing it) */
    tp_dtype dtype; /* the model's (0: f32) */
    tp_test_slot slot[TP_TEST_MAX_RANKS];
} gen_case;

static tp_device case_device(const gen_case *c, int rank)
{
    return c->cuda ? TP_CUDA(rank % tp_cuda_device_count()) : TP_CPU;
}

static tp_status greedy_body(tp_comm *world, void *arg)
{
    gen_case *c = arg;
    const int r = tp_comm_rank(world);
    tp_test_slot *slot = &c->slot[r];
    fixture_model f;
    tp_tensor *ids = NULL, *mask = NULL, *want = NULL, *want_eos = NULL, *eos = NULL,
              *got = NULL, *got_eos = NULL;
    RANK_OK(slot, fixture_open(world, c->model, false, TP_F32, TP_CPU, true, &f));
    RANK_OK(slot, gen_ref(c->model, "gen_input_ids", &ids));
    RANK_OK(slot, gen_ref(c->model, "gen_mask", &mask));
    RANK_OK(slot, gen_ref(c->model, "gen_greedy", &want));
    RANK_OK(slot, gen_ref(c->model, "gen_greedy_eos", &want_eos));
    RANK_OK(slot, gen_ref(c->model, "gen_eos_id", &eos));
    tp_llm_generate_options o = {.max_new_tokens = 12, .pad_token_id = 0};
    tp_llm_generate_stats stats;
    RANK_OK(slot, tp_llm_generate(f.model, ids, mask, &o, &got, &stats));
    char a[256], b[256];
    int64_t row = 0; /* the first row that differs */
    while (row < 2 && !strcmp(row_str(got, row, a, sizeof a), row_str(want, row, b, sizeof b)))
        row++;
    RANK_EXPECT(slot, same_i64(got, want), "%s tp %d rank %d: row %lld is %s, transformers %s",
                model_names[c->model], c->tp, r, (long long)row, row_str(got, row, a, sizeof a),
                row_str(want, row, b, sizeof b));
    RANK_EXPECT(slot, stats.decode_steps == tp_tensor_size(want, 1) - 1 && stats.prefill_s > 0,
                "%lld decode steps", (long long)stats.decode_steps);
    o.n_eos = 1;
    o.eos_token_ids = tp_tensor_data(eos);
    RANK_OK(slot, tp_llm_generate(f.model, ids, mask, &o, &got_eos, NULL));
    RANK_EXPECT(slot, same_i64(got_eos, want_eos), "%s tp %d rank %d: with eos %lld row 0 is "
                "%s, transformers %s", model_names[c->model], c->tp, r,
                (long long)*(int64_t *)tp_tensor_data(eos), row_str(got_eos, 0, a, sizeof a),
                row_str(want_eos, 0, b, sizeof b));
    tp_tensor *all[] = {ids, mask, want, want_eos, eos, got, got_eos};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        tp_tensor_release(all[i]);
    fixture_close(&f);
    return TP_OK;
}

/* kv heads: llama and qwen2 2, llama_bf16 4, mistral 1: tp 4 keeps
 * replicated kv heads on three of them */
ParameterizedTestParameters(generate, greedy_equals_transformers)
{
    static gen_case cases[] = {
        {.model = LLAMA, .tp = 1},      {.model = LLAMA, .tp = 2},   {.model = LLAMA, .tp = 4},
        {.model = LLAMA_BF16, .tp = 1}, {.model = LLAMA_BF16, .tp = 2},
        {.model = LLAMA_BF16, .tp = 4}, {.model = MISTRAL, .tp = 1}, {.model = MISTRAL, .tp = 2},
        {.model = MISTRAL, .tp = 4},    {.model = QWEN2, .tp = 1},   {.model = QWEN2, .tp = 2},
        {.model = QWEN2, .tp = 4},
    };
    return cr_make_param_array(gen_case, cases, sizeof cases / sizeof cases[0]);
}

ParameterizedTest(gen_case *c, generate, greedy_equals_transformers, .timeout = 120)
{
    tp_test_run(c->tp, greedy_body, c, c->slot);
}

/* ---- every step's logits ----------------------------------------------------------- */

/* The positions transformers gives a left-padded row: its real tokens
 * numbered from 0, the padding 0. */
static void positions_of(const int64_t *mask, int64_t B, int64_t S, int64_t *pos)
{
    for (int64_t b = 0; b < B; b++) {
        int64_t n = 0;
        for (int64_t s = 0; s < S; s++)
            pos[b * S + s] = mask[b * S + s] ? n++ : 0;
    }
}

/* |a - b| <= tol * max|b| over the [B, V] logits a (a [B, 1, V] tensor) and
 * row block b of ref (B rows of V from `from`) */
static bool close_rows(const tp_tensor *a, const float *ref, double tol, double *err)
{
    const float *x = tp_tensor_data(a);
    double d = 0, sc = 0;
    for (int64_t i = 0; i < tp_tensor_numel(a); i++) {
        d = fmax(d, fabs((double)x[i] - ref[i]));
        sc = fmax(sc, fabs((double)ref[i]));
        if (isnan(x[i]))
            d = INFINITY;
    }
    *err = d / sc;
    return d <= tol * sc;
}

/* The decode loop by hand, fed transformers' tokens: after the prefill and
 * each step, the cached forward's logits against transformers' (gen_logits)
 * and against tp_llm_forward over the whole prefix so far (its last
 * position). */
static tp_status steps_body(tp_comm *world, void *arg)
{
    gen_case *c = arg;
    const int r = tp_comm_rank(world);
    tp_test_slot *slot = &c->slot[r];
    fixture_model f;
    tp_tensor *ids = NULL, *mask = NULL, *toks = NULL, *ref = NULL;
    tp_llm_cache *cache = NULL;
    const tp_dtype dt = c->dtype ? c->dtype : TP_F32;
    /* f32: rounding; bf16: the bound docs/API.md states for the logits */
    const double tol_hf = dt == TP_F32 ? 1e-4 : dt == TP_F16 ? 4e-3 : 3e-2,
                 tol_full = dt == TP_F32 ? 1e-5 : dt == TP_F16 ? 4e-3 : 3e-2;
    RANK_OK(slot, fixture_open(world, c->model, false, dt, case_device(c, r), true, &f));
    RANK_OK(slot, gen_ref(c->model, "gen_input_ids", &ids));
    RANK_OK(slot, gen_ref(c->model, "gen_mask", &mask));
    RANK_OK(slot, gen_ref(c->model, "gen_greedy", &toks));
    RANK_OK(slot, gen_ref(c->model, "gen_logits", &ref));
    const int64_t B = 3, S = 9, T = tp_tensor_size(toks, 1), V = f.cfg.vocab_size;
    /* the whole sequence so far, for the full forwards */
    int64_t *all_ids = calloc((size_t)(B * (S + T)), sizeof(int64_t)),
            *all_mask = calloc((size_t)(B * (S + T)), sizeof(int64_t)),
            *all_pos = calloc((size_t)(B * (S + T)), sizeof(int64_t));
    RANK_EXPECT(slot, all_ids && all_mask && all_pos, "out of memory");
    RANK_OK(slot, tp_llm_cache_create(f.model, B, S + T, &cache));
    tp_tensor *logits = NULL, *step = NULL;
    const int64_t one[2] = {B, 1};
    RANK_OK(slot, tp_tensor_empty(TP_I64, TP_CPU, 2, one, &step));
    for (int64_t t = 0; t < T; t++) {
        const int64_t len = S + t;
        tp_tensor *out = NULL;
        if (t == 0) {
            RANK_OK(slot, tp_llm_forward_cached(f.model, cache, ids, mask, 1, &out));
        } else {
            for (int64_t b = 0; b < B; b++)
                ((int64_t *)tp_tensor_data(step))[b] =
                    ((const int64_t *)tp_tensor_data(toks))[b * T + t - 1];
            RANK_OK(slot, tp_llm_forward_cached(f.model, cache, step, NULL, 1, &out));
        }
        RANK_EXPECT(slot, tp_tensor_dtype(out) == dt &&
                              tp_tensor_device(out).type == case_device(c, r).type,
                    "step %lld: the logits are not on the model's device in its dtype",
                    (long long)t);
        tp_status cst = full_f32(out, &logits);
        tp_tensor_release(out);
        RANK_OK(slot, cst);
        RANK_EXPECT(slot, tp_tensor_ndim(logits) == 3 && tp_tensor_size(logits, 0) == B &&
                              tp_tensor_size(logits, 1) == 1 && tp_tensor_size(logits, 2) == V,
                    "step %lld: the logits are not [3, 1, %lld]", (long long)t, (long long)V);
        RANK_EXPECT(slot, tp_llm_cache_length(cache) == len, "step %lld: cache length %lld", 
                    (long long)t, (long long)tp_llm_cache_length(cache));
        double e = 0;
        /* dynamic rope (qwen2): transformers' frequencies follow the longest
         * position of each forward, so earlier keys were rotated with other
         * frequencies than a full forward over the prefix uses; the cache
         * keeps them as transformers does, and only transformers' logits
         * apply */
        RANK_EXPECT(slot, close_rows(logits, (const float *)tp_tensor_data(ref) + t * B * V,
                                     tol_hf, &e),
                    "%s tp %d rank %d step %lld: the logits differ from transformers' by %g",
                    model_names[c->model], c->tp, r, (long long)t, e);
        /* the full forward over the prefix [B, len] */
        for (int64_t b = 0; b < B; b++) {
            for (int64_t s = 0; s < len; s++) {
                const int64_t at = b * len + s;
                all_ids[at] = s < S ? ((const int64_t *)tp_tensor_data(ids))[b * S + s]
                                    : ((const int64_t *)tp_tensor_data(toks))[b * T + s - S];
                all_mask[at] = s < S ? ((const int64_t *)tp_tensor_data(mask))[b * S + s] : 1;
            }
        }
        positions_of(all_mask, B, len, all_pos);
        if (f.cfg.rope.type != TP_ROPE_DYNAMIC) {
            const int64_t shape[2] = {B, len};
            tp_tensor *fi = NULL, *fm = NULL, *fp = NULL, *fp_dev = NULL, *fl = NULL,
                      *full = NULL, *last = NULL, *lastc = NULL;
            tp_tensor *fi_cpu = NULL;
            RANK_OK(slot, tp_tensor_from_blob(TP_I64, TP_CPU, 2, shape, all_ids, NULL, NULL,
                                              &fi_cpu));
            tp_status ist = tp_tensor_to(fi_cpu, TP_I64, case_device(c, r), &fi);
            tp_tensor_release(fi_cpu);
            RANK_OK(slot, ist);
            tp_tensor *fm_cpu = NULL;
            RANK_OK(slot, tp_tensor_from_blob(TP_I64, TP_CPU, 2, shape, all_mask, NULL, NULL,
                                              &fm_cpu));
            ist = tp_tensor_to(fm_cpu, TP_I64, case_device(c, r), &fm);
            tp_tensor_release(fm_cpu);
            RANK_OK(slot, ist);
            RANK_OK(slot, tp_tensor_from_blob(TP_I64, TP_CPU, 2, shape, all_pos, NULL, NULL, &fp));
            RANK_OK(slot, tp_tensor_to(fp, TP_I64, case_device(c, r), &fp_dev));
            tp_no_grad_begin();
            tp_status fst = tp_llm_forward(f.model, fi, fp_dev, fm, &fl);
            tp_no_grad_end();
            RANK_OK(slot, fst);
            RANK_OK(slot, full_f32(fl, &full));
            RANK_OK(slot, tp_tensor_narrow(full, 1, len - 1, 1, &last));
            RANK_OK(slot, tp_tensor_clone(last, &lastc));
            RANK_EXPECT(slot, close_rows(logits, tp_tensor_data(lastc), tol_full, &e),
                        "%s tp %d rank %d step %lld: the cached logits differ from a full "
                        "forward's by %g", model_names[c->model], c->tp, r, (long long)t, e);
            tp_tensor *tmp[] = {fi, fm, fp, fp_dev, fl, full, last, lastc};
            for (size_t i = 0; i < sizeof tmp / sizeof *tmp; i++)
                tp_tensor_release(tmp[i]);
        }
        tp_tensor_release(logits);
        logits = NULL;
    }
    free(all_ids);
    free(all_mask);
    free(all_pos);
    tp_tensor_release(step);
    tp_llm_cache_free(cache);
    tp_tensor *rel[] = {ids, mask, toks, ref};
    for (size_t i = 0; i < sizeof rel / sizeof *rel; i++)
        tp_tensor_release(rel[i]);
    fixture_close(&f);
    return TP_OK;
}

ParameterizedTestParameters(generate, every_step_equals_transformers_and_full_forward)
{
    /* 1, 2 and 4 kv heads at tp 1 to 4 (3 divides no head count: left out) */
    static gen_case cases[] = {
        {.model = LLAMA, .tp = 1},      {.model = LLAMA, .tp = 2},   {.model = LLAMA, .tp = 4},
        {.model = LLAMA_BF16, .tp = 1}, {.model = LLAMA_BF16, .tp = 4},
        {.model = MISTRAL, .tp = 1},    {.model = MISTRAL, .tp = 2}, {.model = MISTRAL, .tp = 4},
        {.model = QWEN2, .tp = 2},      {.model = LLAMA, .tp = 2, .dtype = TP_BF16},
        {.model = MISTRAL, .tp = 4, .dtype = TP_F16},
    };
    return cr_make_param_array(gen_case, cases, sizeof cases / sizeof cases[0]);
}

ParameterizedTest(gen_case *c, generate, every_step_equals_transformers_and_full_forward,
                  .timeout = 120)
{
    tp_test_run(c->tp, steps_body, c, c->slot);
}

/* The same on the GPU, the cache on the device: the shm ranks (threads)
 * share it, as on a one-GPU machine. Skipped visibly without a device. */
ParameterizedTestParameters(generate, cuda_every_step)
{
    static gen_case cases[] = {
        {.model = LLAMA, .tp = 1, .cuda = true},
        {.model = MISTRAL, .tp = 2, .cuda = true},
        {.model = LLAMA, .tp = 2, .cuda = true, .dtype = TP_BF16},
        {.model = LLAMA_BF16, .tp = 4, .cuda = true, .dtype = TP_BF16},
    };
    return cr_make_param_array(gen_case, cases, sizeof cases / sizeof cases[0]);
}

ParameterizedTest(gen_case *c, generate, cuda_every_step, .timeout = 300)
{
    if (tp_cuda_device_count() <= 0)
        cr_skip_test("no CUDA device: %s", TP_HAVE_CUDA ? "libtp has CUDA but the machine shows "
                                                          "no device"
                                                        : "libtp was built without CUDA");
    tp_test_run(c->tp, steps_body, c, c->slot);
}

/* ---- a decode step's collectives and allocations ----------------------------------- */

typedef struct {
    int model, tp;
    tp_test_slot slot[TP_TEST_MAX_RANKS];
} step_case;

static tp_status decode_once(fixture_model *f, tp_llm_cache *cache, tp_tensor *step)
{
    tp_tensor *logits = NULL;
    TP_TEST_TRY(tp_llm_forward_cached(f->model, cache, step, NULL, 1, &logits));
    tp_tensor_release(logits);
    return TP_OK;
}

/* Storage allocations the caching allocator could not serve (process-wide:
 * every shm rank's). */
static uint64_t misses(void)
{
    tp_memory_info mi;
    tp_memory_stats(TP_CPU, &mi);
    return mi.num_allocs - mi.num_cache_hits;
}

/* One decode step: one all_reduce for the embedding and two per layer
 * (o_proj, down_proj), one all_gather of the vocab shards, nothing else
 * (docs/models.md); the prefill the same. After two warm-up steps, five
 * more steps allocate nothing from the system on any rank. */
static tp_status collectives_body(tp_comm *world, void *arg)
{
    step_case *c = arg;
    const int r = tp_comm_rank(world);
    tp_test_slot *slot = &c->slot[r];
    fixture_model f;
    tp_tensor *ids = NULL, *mask = NULL, *step = NULL, *logits = NULL;
    tp_llm_cache *cache = NULL;
    tp_comm_debug *pre = NULL, *dec = NULL;
    RANK_OK(slot, fixture_open(world, c->model, false, TP_F32, TP_CPU, true, &f));
    RANK_OK(slot, gen_ref(c->model, "gen_input_ids", &ids));
    RANK_OK(slot, gen_ref(c->model, "gen_mask", &mask));
    RANK_OK(slot, tp_llm_cache_create(f.model, 3, 32, &cache));
    const int64_t one[2] = {3, 1};
    RANK_OK(slot, tp_tensor_zeros(TP_I64, TP_CPU, 2, one, &step));
    RANK_OK(slot, tp_tensor_fill(step, 5));
    RANK_OK(slot, tp_comm_debug_create(&pre));
    RANK_OK(slot, tp_comm_debug_create(&dec));
    RANK_OK(slot, tp_comm_debug_begin(pre));
    RANK_OK(slot, tp_llm_forward_cached(f.model, cache, ids, mask, 1, &logits));
    RANK_OK(slot, tp_comm_debug_end(pre));
    RANK_OK(slot, tp_comm_debug_begin(dec));
    RANK_OK(slot, decode_once(&f, cache, step));
    RANK_OK(slot, tp_comm_debug_end(dec));
    const int64_t L = f.cfg.num_hidden_layers, tp = c->tp;
    for (int k = 0; k < TP_COLL_KIND_COUNT; k++) {
        const int64_t want = tp == 1                           ? 0
                             : k == TP_COLL_ALL_REDUCE ? 2 * L + 1
                             : k == TP_COLL_ALL_GATHER ? 1
                                                       : 0;
        const char *kind = tp_coll_kind_name((tp_coll_kind)k);
        RANK_EXPECT(slot, tp_comm_debug_count(dec, (tp_coll_kind)k) == want,
                    "%s tp %d: a decode step issued %lld %s, expected %lld",
                    model_names[c->model], c->tp, (long long)tp_comm_debug_count(dec,
                                                                                (tp_coll_kind)k),
                    kind, (long long)want);
        RANK_EXPECT(slot, tp_comm_debug_count(pre, (tp_coll_kind)k) == want,
                    "%s tp %d: the prefill issued %lld %s, expected %lld",
                    model_names[c->model], c->tp,
                    (long long)tp_comm_debug_count(pre, (tp_coll_kind)k), kind, (long long)want);
    }
    RANK_OK(slot, decode_once(&f, cache, step));
    RANK_OK(slot, tp_barrier(world, NULL));
    const uint64_t before = misses();
    RANK_OK(slot, tp_barrier(world, NULL));
    for (int i = 0; i < 5; i++)
        RANK_OK(slot, decode_once(&f, cache, step));
    RANK_OK(slot, tp_barrier(world, NULL));
    const uint64_t after = misses();
    RANK_EXPECT(slot, after == before, "%s tp %d rank %d: 5 decode steps made %llu allocations "
                "the cache could not serve", model_names[c->model], c->tp, r,
                (unsigned long long)(after - before));
    RANK_OK(slot, tp_barrier(world, NULL));
    tp_comm_debug_free(pre);
    tp_comm_debug_free(dec);
    tp_tensor_release(logits);
    tp_tensor_release(step);
    tp_tensor_release(mask);
    tp_tensor_release(ids);
    tp_llm_cache_free(cache);
    fixture_close(&f);
    return TP_OK;
}

ParameterizedTestParameters(generate, decode_step_collectives_and_allocations)
{
    static step_case cases[] = {
        {.model = LLAMA, .tp = 1},   {.model = LLAMA, .tp = 2},   {.model = LLAMA_BF16, .tp = 4},
        {.model = MISTRAL, .tp = 4}, {.model = QWEN2, .tp = 2},
    };
    return cr_make_param_array(step_case, cases, sizeof cases / sizeof cases[0]);
}

ParameterizedTest(step_case *c, generate, decode_step_collectives_and_allocations,
                  .timeout = 120)
{
    tp_test_run(c->tp, collectives_body, c, c->slot);
}

/* ---- the cache's memory ------------------------------------------------------------- */

#ifndef TP_TEST_MPI

/* Its bytes: layers x (k, v) x max_batch x local kv heads x max_len x
 * head_dim in the model's dtype, and the i64 mask; allocated once, on the
 * CPU and on the meta device alike. */
Test(generate, cache_bytes_cpu_and_meta, .timeout = 60)
{
    char dir[512];
    tp_llm_config cfg;
    CHECK_OK(tp_llm_config_load(model_dir(LLAMA, dir, sizeof dir), &cfg));
    const tp_device devs[2] = {TP_CPU, TP_META};
    const tp_dtype dts[2] = {TP_F32, TP_BF16};
    for (int i = 0; i < 2; i++) {
        tp_module *m = NULL;
        CHECK_OK(tp_nn_set_default_device(devs[i]));
        CHECK_OK(tp_llm_create(&cfg, &m));
        CHECK_OK(tp_nn_set_default_device(TP_CPU));
        CHECK_OK(tp_module_to_dtype(m, dts[i]));
        tp_memory_info a, b;
        CHECK_OK(tp_memory_stats(devs[i], &a));
        tp_llm_cache *c = NULL;
        CHECK_OK(tp_llm_cache_create(m, 4, 100, &c));
        CHECK_OK(tp_memory_stats(devs[i], &b));
        const size_t want = (size_t)(cfg.num_hidden_layers * 2 * 4 * cfg.num_key_value_heads *
                                     100 * cfg.head_dim) * tp_dtype_size(dts[i]) +
                            4 * 100 * sizeof(int64_t);
        cr_assert_eq(tp_llm_cache_nbytes(c), want, "%s: %zu bytes, expected %zu",
                     devs[i].type == TP_DEVICE_META ? "meta" : "cpu", tp_llm_cache_nbytes(c),
                     want);
        cr_assert(b.allocated - a.allocated >= want && b.allocated - a.allocated <= want + 4096 * 9,
                  "allocated grew by %zu for a cache of %zu", b.allocated - a.allocated, want);
        cr_assert_eq(tp_llm_cache_length(c), 0);
        tp_llm_cache_free(c);
        tp_module_free(m);
    }
}

/* ---- refusals -------------------------------------------------------------------------- */

#define CHECK_MSG(expr, text)                                                      \
    do {                                                                           \
        CHECK_ERR(expr, TP_ERR_INVALID_ARG);                                       \
        cr_assert(strstr(tp_last_error(), text), "%s: \"%s\" lacks \"%s\"", #expr, \
                  tp_last_error(), text);                                          \
    } while (0)

static tp_tensor *ids_of(int64_t B, int64_t S, int64_t value)
{
    tp_tensor *t = NULL;
    const int64_t shape[2] = {B, S};
    CHECK_OK(tp_tensor_zeros(TP_I64, TP_CPU, 2, shape, &t));
    CHECK_OK(tp_tensor_fill(t, (double)value));
    return t;
}

/* Each refusal names the problem and leaves the cache as it was: the
 * decode after them gives the logits of a run that never saw them. */
Test(generate, refusals_leave_the_cache_as_it_was, .timeout = 60)
{
    char dir[512];
    tp_llm_config cfg;
    tp_module *m = NULL;
    CHECK_OK(tp_llm_config_load(model_dir(LLAMA, dir, sizeof dir), &cfg));
    CHECK_OK(tp_llm_create(&cfg, &m));
    CHECK_OK(tp_llm_load(m, dir));
    tp_llm_cache *c = NULL, *ref = NULL;
    CHECK_OK(tp_llm_cache_create(m, 2, 6, &c));
    CHECK_OK(tp_llm_cache_create(m, 2, 6, &ref));
    tp_tensor *p = ids_of(2, 4, 7), *one = ids_of(2, 1, 9), *l1 = NULL, *l2 = NULL;
    CHECK_OK(tp_llm_forward_cached(m, c, p, NULL, 1, &l1));
    tp_tensor_release(l1);
    /* bad calls */
    tp_tensor *three = ids_of(3, 1, 9), *two = ids_of(2, 2, 9), *bad = ids_of(2, 1, 131),
              *neg = ids_of(2, 1, -1), *mask2 = ids_of(2, 1, 2), *maskw = ids_of(2, 2, 1);
    CHECK_MSG(tp_llm_forward_cached(m, c, three, NULL, 1, &l1), "exceeds the cache's max_batch 2");
    CHECK_MSG(tp_llm_forward_cached(m, c, bad, NULL, 1, &l1), "outside the vocabulary [0, 131)");
    CHECK_MSG(tp_llm_forward_cached(m, c, neg, NULL, 1, &l1), "input_ids[0][0] is -1");
    CHECK_MSG(tp_llm_forward_cached(m, c, one, mask2, 1, &l1), "attention_mask[0][0] is 2");
    CHECK_MSG(tp_llm_forward_cached(m, c, one, maskw, 1, &l1), "attention_mask must be");
    CHECK_MSG(tp_llm_forward_cached(m, c, one, NULL, 2, &l1), "logits_to_keep 2 is outside");
    CHECK_MSG(tp_llm_forward_cached(m, c, NULL, NULL, 1, &l1), "input_ids is NULL");
    CHECK_MSG(tp_llm_forward_cached(NULL, c, one, NULL, 1, &l1), "not a model");
    CHECK_MSG(tp_llm_forward_cached(m, NULL, one, NULL, 1, &l1), "cache is NULL");
    cr_assert_eq(tp_llm_cache_length(c), 4);
    /* 4 + 2 fits 6; one more position does not */
    tp_tensor *three_more = ids_of(2, 3, 1);
    CHECK_MSG(tp_llm_forward_cached(m, c, three_more, NULL, 1, &l1),
              "3 new positions after 4 exceed the cache's max_len 6");
    tp_tensor_release(three_more);
    cr_assert_eq(tp_llm_cache_length(c), 4);
    CHECK_OK(tp_llm_forward_cached(m, c, two, NULL, 1, &l1));
    CHECK_MSG(tp_llm_forward_cached(m, c, one, NULL, 1, &l2), "1 new positions after 6 exceed");
    cr_assert_eq(tp_llm_cache_length(c), 6);
    /* the same two calls on a cache that saw no refusal */
    CHECK_OK(tp_llm_forward_cached(m, ref, p, NULL, 1, &l2));
    tp_tensor_release(l2);
    CHECK_OK(tp_llm_forward_cached(m, ref, two, NULL, 1, &l2));
    bool eq = false;
    CHECK_OK(tp_tensor_equal(l1, l2, &eq));
    cr_assert(eq, "the refusals changed the cache");
    tp_tensor_release(l1);
    tp_tensor_release(l2);
    tp_llm_cache_free(ref);
    /* another model's cache, a model without a cache */
    tp_module *m2 = NULL;
    tp_tensor *none = NULL;
    tp_llm_cache *made = NULL;
    CHECK_OK(tp_llm_create(&cfg, &m2));
    tp_llm_cache_reset(c);
    CHECK_MSG(tp_llm_forward_cached(m2, c, p, NULL, 1, &none), "belongs to another model");
    CHECK_MSG(tp_llm_cache_create(m, 0, 6, &made), "max_batch 0 must be positive");
    CHECK_MSG(tp_llm_cache_create(m, 1, -1, &made), "max_len -1 must be positive");
    CHECK_MSG(tp_llm_cache_create(m, INT64_MAX / 2, INT64_MAX / 2, &made), "overflows");
    cr_assert_null(made);
    /* a model cast after its cache was made */
    tp_llm_cache *c2 = NULL;
    CHECK_OK(tp_llm_cache_create(m2, 2, 6, &c2));
    CHECK_OK(tp_module_to_dtype(m2, TP_BF16));
    CHECK_MSG(tp_llm_forward_cached(m2, c2, p, NULL, 1, &none), "a cache made before the model's");
    cr_assert_null(none);
    tp_llm_cache_free(c2);
    tp_tensor *all[] = {p, one, three, two, bad, neg, mask2, maskw};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        tp_tensor_release(all[i]);
    tp_llm_cache_free(c);
    tp_module_free(m);
    tp_module_free(m2);
}

Test(generate, generate_refusals, .timeout = 60)
{
    char dir[512];
    tp_llm_config cfg;
    tp_module *m = NULL;
    CHECK_OK(tp_llm_config_load(model_dir(MISTRAL, dir, sizeof dir), &cfg));
    CHECK_OK(tp_llm_create(&cfg, &m));
    tp_tensor *p = ids_of(2, 3, 7), *toks = NULL, *zero = ids_of(2, 3, 0);
    tp_llm_generate_options o = {.max_new_tokens = 4};
    o.max_new_tokens = 0;
    CHECK_MSG(tp_llm_generate(m, p, NULL, &o, &toks, NULL), "max_new_tokens 0 must be positive");
    o.max_new_tokens = 4;
    CHECK_MSG(tp_llm_generate(m, p, zero, &o, &toks, NULL), "prompt 0 has no real token");
    tp_tensor *right = ids_of(2, 3, 1);
    const int64_t last[2] = {1, 2};
    CHECK_OK(tp_tensor_set(right, last, 0));
    CHECK_MSG(tp_llm_generate(m, p, right, &o, &toks, NULL), "prompt 1 ends with padding");
    tp_tensor_release(right);
    o.sampling = (tp_llm_sampling){.do_sample = true, .top_p = 1.5};
    CHECK_MSG(tp_llm_generate(m, p, NULL, &o, &toks, NULL), "top_p 1.5 is outside (0, 1]");
    o.sampling = (tp_llm_sampling){0};
    o.pad_token_id = 131;
    CHECK_MSG(tp_llm_generate(m, p, NULL, &o, &toks, NULL), "pad_token_id 131 is outside");
    o.pad_token_id = 0;
    tp_llm_cache *small = NULL;
    CHECK_OK(tp_llm_cache_create(m, 2, 6, &small));
    o.cache = small;
    CHECK_MSG(tp_llm_generate(m, p, NULL, &o, &toks, NULL), "is too small for 2 prompts of 3 tokens");
    o.max_new_tokens = 3;
    CHECK_OK(tp_llm_generate(m, p, NULL, &o, &toks, NULL));
    cr_assert_eq(tp_tensor_size(toks, 1), 3);
    tp_llm_cache_free(small);
    tp_tensor_release(toks);
    tp_tensor_release(p);
    tp_tensor_release(zero);
    tp_module_free(m);
}

#endif /* TP_TEST_MPI */

/* ---- sampling ---------------------------------------------------------------------------- */

#ifndef TP_TEST_MPI

static tp_tensor *logit_rows(int64_t B, int64_t V, uint64_t seed)
{
    tp_tensor *t = NULL;
    const int64_t shape[2] = {B, V};
    CHECK_OK(tp_tensor_zeros(TP_F32, TP_CPU, 2, shape, &t));
    CHECK_OK(tp_tensor_fill_random(t, TP_RNG_NORMAL, 0, 3, seed, NULL, NULL));
    return t;
}

/* Greedy is the first largest logit; top_k 1 is greedy whatever the
 * temperature; the same seed and step draw the same tokens, other seeds
 * others; bf16 and [B, 1, V] logits are taken. */
Test(generate, sampling_greedy_top_k_1_and_seeds, .timeout = 30)
{
    const int64_t B = 16, V = 1000;
    tp_tensor *l = logit_rows(B, V, 3);
    float *d = tp_tensor_data(l);
    d[5 * V + 7] = d[5 * V + 9] = 50; /* a tie: the first wins */
    int64_t g[16], k1[16], a[16], b[16], c[16];
    CHECK_OK(tp_llm_sample(l, NULL, 0, g));
    for (int64_t r = 0; r < B; r++) {
        int64_t best = 0;
        for (int64_t i = 1; i < V; i++)
            best = d[r * V + i] > d[r * V + best] ? i : best;
        cr_assert_eq(g[r], best, "row %lld: greedy %lld, argmax %lld", (long long)r,
                     (long long)g[r], (long long)best);
    }
    cr_assert_eq(g[5], 7);
    const tp_llm_sampling k1s = {.do_sample = true, .temperature = 2.5, .top_k = 1, .seed = 9};
    CHECK_OK(tp_llm_sample(l, &k1s, 3, k1));
    cr_assert(!memcmp(g, k1, sizeof g), "top_k 1 differs from greedy");
    tp_llm_sampling s = {.do_sample = true, .temperature = 1.5, .top_k = 50, .top_p = 0.9,
                         .seed = 1234};
    CHECK_OK(tp_llm_sample(l, &s, 4, a));
    CHECK_OK(tp_llm_sample(l, &s, 4, b));
    cr_assert(!memcmp(a, b, sizeof a), "the same seed and step drew different tokens");
    int differ = 0;
    for (uint64_t seed = 1; seed < 9; seed++) {
        s.seed = seed;
        CHECK_OK(tp_llm_sample(l, &s, 4, c));
        differ += memcmp(a, c, sizeof a) != 0;
    }
    cr_assert_eq(differ, 8, "other seeds drew the same tokens %d times in 8", 8 - differ);
    /* bf16 [B, 1, V] */
    tp_tensor *h = NULL, *h3 = NULL;
    CHECK_OK(tp_tensor_to(l, TP_BF16, TP_CPU, &h));
    const int64_t s3[3] = {B, 1, V};
    CHECK_OK(tp_reshape(h, 3, s3, &h3));
    CHECK_OK(tp_llm_sample(h3, NULL, 0, c));
    cr_assert_eq(c[5], 7);
    /* refusals */
    const tp_llm_sampling bad[] = {{.do_sample = true, .temperature = -1},
                                   {.do_sample = true, .temperature = NAN},
                                   {.do_sample = true, .top_k = -2},
                                   {.do_sample = true, .top_p = 1.01},
                                   {.do_sample = true, .top_p = -0.5}};
    const char *msg[] = {"temperature -1 must be positive", "temperature nan",
                         "top_k -2 is negative", "top_p 1.01 is outside (0, 1]",
                         "top_p -0.5 is outside"};
    for (int i = 0; i < 5; i++)
        CHECK_MSG(tp_llm_sample(l, &bad[i], 0, c), msg[i]);
    CHECK_MSG(tp_llm_sample(NULL, NULL, 0, c), "logits is NULL");
    CHECK_MSG(tp_llm_sample(l, NULL, 0, NULL), "ids is NULL");
    tp_tensor *ids = ids_of(2, 3, 1);
    CHECK_MSG(tp_llm_sample(ids, NULL, 0, c), "not floats");
    tp_tensor_release(ids);
    tp_tensor_release(h3);
    tp_tensor_release(h);
    tp_tensor_release(l);
}

/* The draws of one logit vector over many steps against its distribution:
 * softmax(l / T), restricted to the top k (renormalized) and to top p as
 * transformers keeps it. Pearson's chi-square with the draws' counts; the
 * seed is fixed, so the statistic is one number; it must stay under the
 * 0.999 quantile of its chi-square law (a fair sampler passes with
 * probability 0.999 over seeds, and this seed's pass is deterministic). */
static void chi_square_case(const tp_llm_sampling *s, const double *want, int64_t V,
                            double quantile)
{
    const int64_t N = 40000;
    const float l[8] = {1.0f, 2.0f, 0.5f, -1.0f, 3.0f, 2.5f, 0.0f, 1.5f};
    tp_tensor *t = NULL;
    const int64_t shape[2] = {1, V};
    CHECK_OK(tp_tensor_from_data(TP_F32, 2, shape, l, &t));
    int64_t count[8] = {0};
    for (int64_t i = 0; i < N; i++) {
        int64_t id = -1;
        CHECK_OK(tp_llm_sample(t, s, (uint64_t)i, &id));
        cr_assert(id >= 0 && id < V);
        count[id]++;
    }
    double chi = 0;
    for (int64_t i = 0; i < V; i++) {
        if (want[i] == 0) {
            cr_assert_eq(count[i], 0, "token %lld drawn %lld times, its probability is 0",
                         (long long)i, (long long)count[i]);
            continue;
        }
        const double e = want[i] * (double)N;
        chi += (count[i] - e) * (count[i] - e) / e;
    }
    cr_assert(chi < quantile, "chi-square %g over its 0.999 quantile %g", chi, quantile);
    tp_tensor_release(t);
}

Test(generate, sampling_matches_the_softmax, .timeout = 60)
{
    const int64_t V = 8;
    const float l[8] = {1.0f, 2.0f, 0.5f, -1.0f, 3.0f, 2.5f, 0.0f, 1.5f};
    double p[8], z = 0;
    const double T = 0.7;
    for (int i = 0; i < V; i++)
        z += (p[i] = exp(l[i] / T));
    for (int i = 0; i < V; i++)
        p[i] /= z;
    /* 7 degrees of freedom: 0.999 quantile 24.32 */
    chi_square_case(&(tp_llm_sampling){.do_sample = true, .temperature = T, .seed = 5}, p, V,
                    24.32);
    /* top_k 3: tokens 4, 5, 1 (logits 3, 2.5, 2); 2 degrees: 13.82 */
    double k3[8] = {0}, zk = p[4] + p[5] + p[1];
    k3[4] = p[4] / zk;
    k3[5] = p[5] / zk;
    k3[1] = p[1] / zk;
    chi_square_case(&(tp_llm_sampling){.do_sample = true, .temperature = T, .top_k = 3,
                                       .seed = 6},
                    k3, V, 13.82);
    /* top_p 0.8: the most likely tokens until their mass reaches 0.8 (what
     * transformers keeps: dropping from the least likely while the dropped
     * mass stays <= 0.2) */
    int order[8] = {4, 5, 1, 7, 0, 2, 6, 3};
    double kept[8] = {0}, cum_low = 0, zp = 0;
    int nkeep = 8;
    for (int i = 7; i > 0; i--) {
        cum_low += p[order[i]];
        if (cum_low > 0.2)
            break;
        nkeep = i;
    }
    for (int i = 0; i < nkeep; i++)
        zp += p[order[i]];
    for (int i = 0; i < nkeep; i++)
        kept[order[i]] = p[order[i]] / zp;
    cr_assert(nkeep >= 2 && nkeep < 8, "the top_p case keeps %d tokens", nkeep);
    static const double q999[8] = {0, 10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32};
    chi_square_case(&(tp_llm_sampling){.do_sample = true, .temperature = T, .top_p = 0.8,
                                       .seed = 7},
                    kept, V, q999[nkeep - 1]);
}

/* top_p over a 2000-token vocabulary (the library drops the tokens that
 * surely fall out before it sorts the rest): every draw lies in the set
 * transformers keeps, found here by sorting everything, and every kept
 * token above 1% is drawn. */
static int cmp_prob_asc(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

Test(generate, sampling_top_p_keeps_transformers_set, .timeout = 60)
{
    const int64_t V = 2000;
    tp_tensor *l = logit_rows(1, V, 21);
    const float *d = tp_tensor_data(l);
    double *p = malloc(sizeof *p * (size_t)V), *sorted = malloc(sizeof *sorted * (size_t)V);
    cr_assert(p && sorted);
    double z = 0, mx = -INFINITY;
    for (int64_t i = 0; i < V; i++)
        mx = fmax(mx, d[i]);
    for (int64_t i = 0; i < V; i++)
        z += (p[i] = exp(d[i] - mx));
    for (int64_t i = 0; i < V; i++)
        sorted[i] = (p[i] /= z);
    qsort(sorted, (size_t)V, sizeof *sorted, cmp_prob_asc);
    const double top_p = 0.7;
    double cum = 0, cut = 0; /* tokens with probability <= cut are dropped */
    for (int64_t i = 0; i < V - 1; i++) {
        cum += sorted[i];
        if (cum > 1 - top_p)
            break;
        cut = sorted[i];
    }
    int64_t kept = 0;
    for (int64_t i = 0; i < V; i++)
        kept += p[i] > cut;
    cr_assert(kept > 1 && kept < V / 4, "the case keeps %lld tokens", (long long)kept);
    int *hits = calloc((size_t)V, sizeof *hits);
    const tp_llm_sampling s = {.do_sample = true, .top_p = top_p, .seed = 3};
    for (int i = 0; i < 4000; i++) {
        int64_t id = -1;
        CHECK_OK(tp_llm_sample(l, &s, (uint64_t)i, &id));
        cr_assert(id >= 0 && id < V && p[id] > cut,
                  "draw %d is token %lld of probability %g, which transformers drops", i,
                  (long long)id, id >= 0 && id < V ? p[id] : -1.0);
        hits[id]++;
    }
    for (int64_t i = 0; i < V; i++)
        cr_assert(p[i] < 0.01 || hits[i] > 0, "token %lld (probability %g) never drawn",
                  (long long)i, p[i]);
    free(hits);
    free(sorted);
    free(p);
    tp_tensor_release(l);
}

#endif /* TP_TEST_MPI */

/* Sampled generation gives every rank the tokens of the model run alone
 * (tp 1, no plan) with the same seed: the same at any tp degree and on
 * either backend (this file runs under mpirun too). */
static tp_status sampled_body(tp_comm *world, void *arg)
{
    gen_case *c = arg;
    const int r = tp_comm_rank(world);
    tp_test_slot *slot = &c->slot[r];
    fixture_model f;
    char dir[512];
    tp_llm_config cfg;
    tp_module *alone = NULL;
    tp_tensor *ids = NULL, *mask = NULL, *got = NULL, *want = NULL;
    RANK_OK(slot, fixture_open(world, c->model, false, TP_F32, TP_CPU, true, &f));
    RANK_OK(slot, tp_llm_config_load(model_dir(c->model, dir, sizeof dir), &cfg));
    RANK_OK(slot, tp_llm_create(&cfg, &alone));
    RANK_OK(slot, tp_llm_load(alone, dir));
    RANK_OK(slot, gen_ref(c->model, "gen_input_ids", &ids));
    RANK_OK(slot, gen_ref(c->model, "gen_mask", &mask));
    const tp_llm_generate_options o = {
        .max_new_tokens = 16,
        .n_eos = -1,
        .sampling = {.do_sample = true, .temperature = 1.3, .top_k = 40, .top_p = 0.95,
                     .seed = 2026}};
    RANK_OK(slot, tp_llm_generate(f.model, ids, mask, &o, &got, NULL));
    RANK_OK(slot, tp_llm_generate(alone, ids, mask, &o, &want, NULL));
    char a[256], b[256];
    RANK_EXPECT(slot, same_i64(got, want), "%s tp %d rank %d: sampled %s, alone %s",
                model_names[c->model], c->tp, r, row_str(got, 0, a, sizeof a),
                row_str(want, 0, b, sizeof b));
    tp_tensor_release(ids);
    tp_tensor_release(mask);
    tp_tensor_release(got);
    tp_tensor_release(want);
    tp_module_free(alone);
    fixture_close(&f);
    return TP_OK;
}

ParameterizedTestParameters(generate, sampling_is_the_same_at_any_tp)
{
    static gen_case cases[] = {
        {.model = LLAMA, .tp = 2},   {.model = LLAMA, .tp = 4}, {.model = LLAMA_BF16, .tp = 4},
        {.model = MISTRAL, .tp = 2}, {.model = QWEN2, .tp = 4},
    };
    return cr_make_param_array(gen_case, cases, sizeof cases / sizeof cases[0]);
}

ParameterizedTest(gen_case *c, generate, sampling_is_the_same_at_any_tp, .timeout = 120)
{
    tp_test_run(c->tp, sampled_body, c, c->slot);
}

#ifndef TP_TEST_MPI

/* generation_config.json over config.json's tokens and transformers'
 * defaults; a missing file is no error; a key of the wrong type names the
 * file and the key. */
Test(generate, generation_config, .timeout = 30)
{
    char dir[512], tmp[64], path[128];
    tp_llm_config cfg;
    tp_llm_generation_config g;
    CHECK_OK(tp_llm_config_load(model_dir(LLAMA, dir, sizeof dir), &cfg));
    CHECK_OK(tp_llm_generation_config_load(dir, &cfg, &g));
    cr_assert(g.n_eos == 1 && g.eos_token_id[0] == 2 && g.bos_token_id == 1);
    cr_assert(!g.sampling.do_sample && g.sampling.temperature == 1 && g.sampling.top_k == 50 &&
              g.sampling.top_p == 1 && g.max_new_tokens == -1);
    snprintf(tmp, sizeof tmp, "/tmp/tp_gencfg_XXXXXX");
    cr_assert_not_null(mkdtemp(tmp));
    CHECK_OK(tp_llm_generation_config_load(tmp, &cfg, &g)); /* no file: config.json's */
    cr_assert(g.n_eos == 1 && g.eos_token_id[0] == 2 && g.pad_token_id == cfg.pad_token_id);
    snprintf(path, sizeof path, "%s/generation_config.json", tmp);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fputs("{\"bos_token_id\": 128000, \"do_sample\": true, \"eos_token_id\": [128001, 128008, "
          "128009], \"temperature\": 0.6, \"top_p\": 0.9, \"max_new_tokens\": 64, "
          "\"transformers_version\": \"4.45.0\"}\n", f);
    fclose(f);
    CHECK_OK(tp_llm_generation_config_load(tmp, &cfg, &g));
    cr_assert(g.n_eos == 3 && g.eos_token_id[0] == 128001 && g.eos_token_id[2] == 128009);
    cr_assert(g.bos_token_id == 128000 && g.sampling.do_sample && g.sampling.temperature == 0.6 &&
              g.sampling.top_p == 0.9 && g.sampling.top_k == 50 && g.max_new_tokens == 64);
    f = fopen(path, "w");
    cr_assert_not_null(f);
    fputs("{\"temperature\": \"hot\"}\n", f);
    fclose(f);
    CHECK_MSG(tp_llm_generation_config_load(tmp, &cfg, &g), "\"temperature\" must be a number");
    cr_assert(strstr(tp_last_error(), "generation_config.json"), "%s", tp_last_error());
    f = fopen(path, "w");
    cr_assert_not_null(f);
    fputs("{\"top_p\": 0}\n", f);
    fclose(f);
    CHECK_MSG(tp_llm_generation_config_load(tmp, &cfg, &g), "\"top_p\" 0 is outside (0, 1]");
    f = fopen(path, "w");
    cr_assert_not_null(f);
    fputs("{\"top_p\": \n", f);
    fclose(f);
    CHECK_MSG(tp_llm_generation_config_load(tmp, &cfg, &g), "line 2");
    remove(path);
    rmdir(tmp);
}

#endif /* TP_TEST_MPI */

/* ---- tp-llm generate ------------------------------------------------------------------------ */

#ifndef TP_TEST_MPI

/* The prompts of gen_ref without their padding, one a line (of different
 * lengths), as tp-llm generate reads them. */
static void write_prompts(int model, const char *path)
{
    tp_tensor *ids = NULL, *mask = NULL;
    CHECK_OK(gen_ref(model, "gen_input_ids", &ids));
    CHECK_OK(gen_ref(model, "gen_mask", &mask));
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    const int64_t *d = tp_tensor_data(ids), *m = tp_tensor_data(mask), S = tp_tensor_size(ids, 1);
    for (int64_t b = 0; b < tp_tensor_size(ids, 0); b++) {
        bool first = true;
        for (int64_t s = 0; s < S; s++)
            if (m[b * S + s]) {
                fprintf(f, "%s%lld", first ? "" : ",", (long long)d[b * S + s]);
                first = false;
            }
        fputc('\n', f);
    }
    fclose(f);
    tp_tensor_release(ids);
    tp_tensor_release(mask);
}

/* What tp-llm prints for a reference: each row up to its first eos. */
static void expected_lines(int model, const char *name, int64_t eos, char *buf, size_t len)
{
    tp_tensor *t = NULL;
    CHECK_OK(gen_ref(model, name, &t));
    const int64_t T = tp_tensor_size(t, 1), *d = tp_tensor_data(t);
    size_t n = 0;
    for (int64_t b = 0; b < tp_tensor_size(t, 0); b++) {
        for (int64_t i = 0; i < T; i++) {
            n += (size_t)snprintf(buf + n, len - n, "%s%lld", i ? "," : "", (long long)d[b * T + i]);
            if (d[b * T + i] == eos)
                break;
        }
        n += (size_t)snprintf(buf + n, len - n, "\n");
    }
    tp_tensor_release(t);
}

static void read_file(const char *path, char *buf, size_t len)
{
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f, "%s", path);
    size_t n = fread(buf, 1, len - 1, f);
    buf[n] = 0;
    fclose(f);
}

typedef struct {
    int model, tp;
    bool mpi;
} cli_case;

/* tp-llm generate --greedy prints transformers' tokens, with the config's
 * eos and with --eos ending a row early, at tp 1, 2, 4 on shm and 2, 4 under
 * mpirun; its stderr has the figures. */
ParameterizedTestParameters(generate, tp_llm_generate_greedy)
{
    static cli_case cases[] = {
        {LLAMA, 1, false},  {LLAMA, 2, false},  {LLAMA, 4, false},      {MISTRAL, 4, false},
        {QWEN2, 2, false},  {LLAMA, 2, true},   {LLAMA_BF16, 4, true},  {QWEN2, 4, true},
    };
    return cr_make_param_array(cli_case, cases, sizeof cases / sizeof cases[0]);
}

ParameterizedTest(cli_case *c, generate, tp_llm_generate_greedy, .timeout = 300)
{
    const char *mpirun = getenv("MPIRUN");
    if (c->mpi && (!mpirun || !*mpirun))
        cr_skip_test("no MPIRUN (a build without MPI, or under ThreadSanitizer)");
    char tmp[64], dir[512], prompts[128], out[128], err[128], launch[1024];
    snprintf(tmp, sizeof tmp, "/tmp/tp_gen_XXXXXX");
    cr_assert_not_null(mkdtemp(tmp));
    snprintf(prompts, sizeof prompts, "%s/prompts.txt", tmp);
    snprintf(out, sizeof out, "%s/out.txt", tmp);
    snprintf(err, sizeof err, "%s/err.txt", tmp);
    write_prompts(c->model, prompts);
    model_dir(c->model, dir, sizeof dir);
    if (c->mpi)
        snprintf(launch, sizeof launch,
                 "ASAN_OPTIONS=${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0 %s "
                 "--allow-run-as-root --oversubscribe -np %d %s", mpirun, c->tp, tp_llm());
    else
        snprintf(launch, sizeof launch, "%s", tp_llm());
    tp_tensor *eos = NULL;
    CHECK_OK(gen_ref(c->model, "gen_eos_id", &eos));
    const int64_t eos_id = *(const int64_t *)tp_tensor_data(eos);
    tp_tensor_release(eos);
    char want[2048], got[2048];
    for (int pass = 0; pass < 2; pass++) {
        char extra[64] = "";
        if (pass)
            snprintf(extra, sizeof extra, "--eos %lld", (long long)eos_id);
        cr_assert_eq(sh("%s generate --model %s --tokens @%s --max-new-tokens 12 --greedy --tp %d "
                        "%s %s >%s 2>%s", launch, dir, prompts, c->tp,
                        c->mpi ? "--backend mpi" : "", extra, out, err), 0,
                     "tp-llm generate failed");
        expected_lines(c->model, pass ? "gen_greedy_eos" : "gen_greedy", pass ? eos_id : 2, want,
                       sizeof want);
        read_file(out, got, sizeof got);
        cr_assert_str_eq(got, want, "%s tp %d%s%s", model_names[c->model], c->tp,
                         c->mpi ? " mpi" : "", pass ? " --eos" : "");
    }
    read_file(err, got, sizeof got);
    cr_assert(strstr(got, "time to first token") && strstr(got, "tokens/s") &&
                  strstr(got, "median") && strstr(got, "p99") && strstr(got, "peak memory") &&
                  strstr(got, "KV cache"),
              "stderr lacks a figure: %s", got);
    sh("rm -rf '%s'", tmp);
}

/* Sampled: the same seed prints the same tokens at tp 1, 2 and 4 and under
 * mpirun; another seed others. */
Test(generate, tp_llm_generate_sampled, .timeout = 300)
{
    char tmp[64], dir[512], prompts[128], a[2048], b[2048], path[160];
    snprintf(tmp, sizeof tmp, "/tmp/tp_gen_XXXXXX");
    cr_assert_not_null(mkdtemp(tmp));
    snprintf(prompts, sizeof prompts, "%s/prompts.txt", tmp);
    write_prompts(LLAMA, prompts);
    model_dir(LLAMA, dir, sizeof dir);
    const char *mpirun = getenv("MPIRUN");
    const char *runs[] = {"--tp 1 --seed 7", "--tp 2 --seed 7", "--tp 4 --seed 7",
                          "--tp 2 --seed 7 --backend mpi", "--tp 2 --seed 8"};
    for (int i = 0; i < 5; i++) {
        const bool mpi = strstr(runs[i], "mpi") != NULL;
        if (mpi && (!mpirun || !*mpirun))
            continue;
        char launch[1024];
        if (mpi)
            snprintf(launch, sizeof launch,
                     "ASAN_OPTIONS=${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0 %s "
                     "--allow-run-as-root --oversubscribe -np 2 %s", mpirun, tp_llm());
        else
            snprintf(launch, sizeof launch, "%s", tp_llm());
        snprintf(path, sizeof path, "%s/out%d.txt", tmp, i);
        cr_assert_eq(sh("%s generate --model %s --tokens @%s --max-new-tokens 16 --temperature "
                        "1.2 --top-k 40 --top-p 0.95 --eos 1 %s >%s 2>/dev/null", launch, dir,
                        prompts, runs[i], path), 0, "%s", runs[i]);
        read_file(path, i ? b : a, sizeof a);
        if (i > 0 && i < 4)
            cr_assert_str_eq(b, a, "%s printed other tokens than --tp 1", runs[i]);
        if (i == 4)
            cr_assert_str_neq(b, a, "another seed printed the same tokens");
    }
    sh("rm -rf '%s'", tmp);
}

/* Bad input exits 2 naming it. */
Test(generate, tp_llm_generate_bad_input, .timeout = 60)
{
    char tmp[64], dir[512], err[128], text[1024];
    snprintf(tmp, sizeof tmp, "/tmp/tp_gen_XXXXXX");
    cr_assert_not_null(mkdtemp(tmp));
    snprintf(err, sizeof err, "%s/err.txt", tmp);
    model_dir(LLAMA, dir, sizeof dir);
    const char *t = tp_llm();
    const struct {
        const char *args, *says;
    } cases[] = {
        {"--tokens @%s/empty --max-new-tokens 4", "line 2 holds no token ids: an empty prompt"},
        {"--tokens 1,2,3 --max-new-tokens 4 --cache-len 5", "exceed --cache-len 5"},
        {"--tokens 1,131 --max-new-tokens 4", "token id 131 (sequence 0, position 1) is outside"},
        {"--tokens 1,2 --max-new-tokens 4 --top-p 0", "--top-p '0' is outside (0, 1]"},
        {"--tokens 1,2 --max-new-tokens 4 --top-p 1.5", "--top-p '1.5' is outside (0, 1]"},
        {"--tokens 1,2 --max-new-tokens 4 --temperature 0", "--temperature '0' is not > 0"},
        {"--tokens 1,2 --max-new-tokens 4 --top-k -1", "--top-k '-1'"},
        {"--tokens 1,2 --max-new-tokens 0", "--max-new-tokens needs a count >= 1"},
        {"--tokens 1,2", "generate needs --tokens IDS and --max-new-tokens K"},
        {"--tokens 1,2 --max-new-tokens 4 --greedy --seed 3", "--greedy samples nothing"},
        {"--tokens 1,2 --max-new-tokens 4 --sp", "generate takes neither --dp nor --sp"},
        {"--tokens 1,2 --max-new-tokens 4 --eos 999", "--eos '999'"},
    };
    sh("printf '1,2\\n\\n3\\n' > %s/empty", tmp);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char args[256];
        snprintf(args, sizeof args, cases[i].args, tmp);
        cr_assert_eq(sh("%s generate --model %s %s >/dev/null 2>%s", t, dir, args, err), 2, "%s",
                     args);
        read_file(err, text, sizeof text);
        cr_assert(strstr(text, cases[i].says), "%s: stderr \"%s\" lacks \"%s\"", args, text,
                  cases[i].says);
    }
    sh("rm -rf '%s'", tmp);
}

#endif /* TP_TEST_MPI */
