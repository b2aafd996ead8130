/* The small random models of tests/fixtures/hf (make_models.py) for the
 * model tests: their directories and reference tensors, and a model loaded
 * and parallelized with the standard plan. Included by test_models.c and
 * test_generate.c. */
#ifndef TP_TEST_LLM_FIXTURE_H
#define TP_TEST_LLM_FIXTURE_H

#include <math.h>

#include "tp_test.h"

/* Criterion parameters hold no pointers: models by index. */
enum { LLAMA, LLAMA_BF16, MISTRAL, QWEN2, N_MODELS };
static const char *const model_names[N_MODELS] = {"llama", "llama_bf16", "mistral", "qwen2"};

static inline const char *model_dir(int model, char *buf, size_t len)
{
    const char *dir = getenv("TP_FIXTURES");
    snprintf(buf, len, "%s/hf/%s", dir ? dir : "tests/fixtures", model_names[model]);
    return buf;
}

static inline tp_status ref_tensor(int model, const char *name, tp_tensor **out)
{
    char dir[512], path[600];
    snprintf(path, sizeof path, "%s/ref.safetensors", model_dir(model, dir, sizeof dir));
    return tp_safetensors_read(path, name, out);
}

/* largest |a - b| and largest |b| over two f32 CPU tensors of one size */
static inline void max_diff(const tp_tensor *a, const tp_tensor *b, double *diff,
                            double *scale)
{
    const float *x = tp_tensor_data(a), *y = tp_tensor_data(b);
    *diff = 0;
    *scale = 0;
    for (int64_t i = 0; i < tp_tensor_numel(b); i++) {
        double d = fabs((double)x[i] - y[i]);
        *diff = d > *diff || isnan(d) ? d : *diff;
        *scale = fmax(*scale, fabs((double)y[i]));
    }
}

/* A DTensor's (or plain tensor's) full value as a plain f32 CPU tensor. */
static inline tp_status full_f32(tp_tensor *t, tp_tensor **out)
{
    tp_tensor *full = NULL;
    if (tp_tensor_is_dtensor(t)) {
        tp_no_grad_begin();
        tp_status st = tp_dtensor_full_tensor(t, &full);
        tp_no_grad_end();
        TP_TEST_TRY(st);
    } else {
        full = tp_tensor_retain(t);
    }
    tp_status st = tp_tensor_to(full, TP_F32, TP_CPU, out);
    tp_tensor_release(full);
    return st;
}

/* Rows [first, first + rows) of a fixed batch of token sequences (ids
 * below vocab, `seq` each): what the data-parallel tests split over dp. */
static inline tp_status fixture_batch_ids(int64_t vocab, int64_t first, int64_t rows,
                                          int64_t seq, tp_tensor **out)
{
    TP_TEST_TRY(tp_tensor_empty(TP_I64, TP_CPU, 2, (int64_t[]){rows, seq}, out));
    int64_t *d = tp_tensor_data(*out);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t s = 0; s < seq; s++)
            d[r * seq + s] = ((first + r) * 131 + s * 17 + 5) % vocab;
    return TP_OK;
}

/* A fixture model on `dev` in `dtype`, parallelized over world (a 1-D tp
 * mesh) with the standard plan (SP when sp), its weights loaded when `load`. */
typedef struct {
    tp_llm_config cfg;
    tp_mesh *mesh;
    tp_module *model;
} fixture_model;

static inline void fixture_close(fixture_model *f)
{
    tp_module_free(f->model);
    tp_mesh_free(f->mesh);
    memset(f, 0, sizeof *f);
}

static inline tp_status fixture_open(tp_comm *world, int model, bool sp, tp_dtype dtype,
                                     tp_device dev, bool load, fixture_model *f)
{
    char dir[512];
    model_dir(model, dir, sizeof dir);
    memset(f, 0, sizeof *f);
    tp_llm_plan *plan = NULL;
    TP_TEST_TRY(tp_llm_config_load(dir, &f->cfg));
    TP_TEST_TRY(tp_nn_set_default_device(dev));
    tp_status st = tp_llm_create(&f->cfg, &f->model);
    TP_TEST_TRY(tp_nn_set_default_device(TP_CPU));
    if (st == TP_OK && dtype != TP_F32)
        st = tp_module_to_dtype(f->model, dtype);
    const int64_t tp = tp_comm_size(world);
    if (st == TP_OK)
        st = tp_mesh_create(world, 1, &tp, (const char *[]){"tp"}, &f->mesh);
    if (st == TP_OK)
        st = tp_llm_plan_create(&(tp_llm_plan_options){.sequence_parallel = sp}, &plan);
    /* every rank reads its own values from the files: nothing to send */
    if (st == TP_OK)
        st = tp_llm_parallelize(f->model, f->mesh, tp_llm_plan_size(plan),
                                tp_llm_plan_entries(plan),
                                &(tp_parallelize_options){.src_data_rank = TP_SRC_DATA_RANK_NONE});
    tp_llm_plan_free(plan);
    if (st == TP_OK && load)
        st = tp_llm_load(f->model, dir);
    if (st != TP_OK)
        fixture_close(f);
    return st;
}

#ifndef TP_TEST_MPI
#include <stdarg.h>
#include <sys/wait.h>

/* Runs a shell command line; its exit status. */
static inline int sh(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static inline int sh(const char *fmt, ...)
{
    char cmd[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    int rc = system(cmd);
    return rc == -1 ? -1 : WIFEXITED(rc) ? WEXITSTATUS(rc) : 128;
}

static inline const char *tp_llm(void)
{
    const char *p = getenv("TP_LLM");
    return p ? p : "build/tools/tp-llm";
}
#endif /* TP_TEST_MPI */

#endif /* TP_TEST_LLM_FIXTURE_H */
