/*
 * Fuzz target for what a Hugging Face model directory feeds libtp: config.json
 * text, safetensors headers and model.safetensors.index.json (docs/fuzzing.md).
 *
 * An input is one mode byte (its value mod 3; FUZZ_LLM_MODE=config|header|index
 * forces one), then:
 *
 *   config  the text of a config.json, written into a directory that
 *           tp_llm_config_load (tp_llm_config_parse) reads. A config that
 *           parses must survive tp_llm_config_to_json and parse back to the
 *           same fields, and is built (tp_llm_create, within the allocation
 *           budget below) and freed; a small one also runs on three tokens
 *           (tp_llm_forward, tp_llm_loss).
 *   header  a variant byte, then the JSON header of model.safetensors for one
 *           of three small models (variant & 3, mod 3: Llama in bf16 with tied
 *           embeddings and MLP biases, Mistral, Qwen2), written with its
 *           8-byte length and a data buffer of the model's f32 size (variant
 *           bit 7: 512 KiB, the size of the fixtures' models) less
 *           ((variant >> 3) & 3) bytes into a directory of its own, which
 *           tp_llm_load reads. Variant bit 2 (raw): the rest is the whole file.
 *           Variant bit 6: the load goes into the model parallelized over 2
 *           ranks (threads) instead. Variant bit 5: tp_safetensors_load of
 *           the same file, all or nothing, rather than tp_llm_load, which
 *           streams.
 *   index   a variant byte (the model and bits 5 and 6, as above), then the text of
 *           model.safetensors.index.json, written into a directory that
 *           holds the model saved as shards, as one model.safetensors, and
 *           odd neighbours (a directory, an empty file, a 3-byte file, a FIFO).
 *
 * Every call must return TP_OK or a clean error: TP_ERR_INVALID_ARG,
 * TP_ERR_NOT_SUPPORTED or (a file that cannot be read) TP_ERR_BACKEND, with a
 * message, and a failed load must leave the parameters as they were. Anything
 * else aborts, as a sanitizer report does. The files live in a scratch
 * directory in /dev/shm (else $TMPDIR or /tmp), removed at exit.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <malloc.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fuzz_llm.h"
#include "tp/comm.h"
#include "tp/dtensor.h"
#include "tp/mesh.h"
#include "tp/models.h"
#include "tp/safetensors.h"

enum { MODE_CONFIG, MODE_HEADER, MODE_INDEX, N_MODES };
static const char *const mode_names[N_MODES] = {"config", "header", "index"};

enum { N_SMALL = 3 };
static const char *const small_names[N_SMALL] = {"llama", "mistral", "qwen2"};
/* Small enough that an input costs well under a millisecond, shaped to take
 * every loading path: tied lm_head (skipped by name), biases, bf16
 * parameters (converted from f32 files), grouped kv heads, heads that split
 * over 2 ranks and vocabularies that do not (uneven shards). */
static const char *const small_configs[N_SMALL] = {
    "{\"architectures\": [\"LlamaForCausalLM\"], \"vocab_size\": 7, \"hidden_size\": 8, "
    "\"intermediate_size\": 12, \"num_hidden_layers\": 2, \"num_attention_heads\": 2, "
    "\"num_key_value_heads\": 2, \"head_dim\": 4, \"max_position_embeddings\": 16, "
    "\"rms_norm_eps\": 1e-05, \"mlp_bias\": true, \"tie_word_embeddings\": true, "
    "\"torch_dtype\": \"bfloat16\", \"rope_theta\": 500000.0, "
    "\"rope_scaling\": {\"rope_type\": \"linear\", \"factor\": 2.0}, \"hidden_act\": \"silu\", "
    "\"bos_token_id\": 1, \"eos_token_id\": [2, 3]}",
    "{\"architectures\": [\"MistralForCausalLM\"], \"vocab_size\": 5, \"hidden_size\": 8, "
    "\"intermediate_size\": 6, \"num_hidden_layers\": 1, \"num_attention_heads\": 4, "
    "\"num_key_value_heads\": 2, \"max_position_embeddings\": 16, \"sliding_window\": 8, "
    "\"dtype\": \"float32\", \"rope_theta\": 10000.0, \"hidden_act\": \"silu\"}",
    "{\"architectures\": [\"Qwen2ForCausalLM\"], \"model_type\": \"qwen2\", \"vocab_size\": 6, "
    "\"hidden_size\": 8, \"intermediate_size\": 8, \"num_hidden_layers\": 1, "
    "\"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"rope_parameters\": "
    "{\"rope_type\": \"llama3\", \"factor\": 8.0, \"low_freq_factor\": 1.0, "
    "\"high_freq_factor\": 4.0, \"original_max_position_embeddings\": 8, \"rope_theta\": "
    "10000.0}, \"layer_types\": [\"full_attention\"], \"use_sliding_window\": false, "
    "\"dtype\": \"float32\", \"hidden_act\": \"silu\"}",
};

typedef struct {
    tp_module *model;
    size_t f32_bytes;     /* the parameters' size in f32: the data buffer */
    char header_dir[512]; /* model.safetensors only, rewritten per input */
    char index_dir[512];  /* the shards and neighbours; the index rewritten */
} small_model;

static small_model models[N_SMALL];
static char scratch[256];
static bool ready;
static int forced_mode = -1;
static bool verbose; /* FUZZ_LLM_VERBOSE: each input's outcome on stderr */

static void report(const char *what, tp_status st)
{
    if (verbose)
        fprintf(stderr, "fuzz_llm: %s: %s%s%s\n", what, tp_status_name(st), st ? ": " : "",
                st ? tp_last_error() : "");
}

static void die(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("fuzz_llm: ", stderr);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    abort();
}

static void write_file(const char *path, const void *a, size_t na, const void *b, size_t nb,
                       const void *c, size_t nc)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0)
        die("cannot create %s: %s", path, strerror(errno));
    const void *part[3] = {a, b, c};
    size_t len[3] = {na, nb, nc};
    for (int i = 0; i < 3; i++) {
        const char *p = part[i];
        while (len[i] > 0) {
            ssize_t w = write(fd, p, len[i]);
            if (w < 0 && errno == EINTR)
                continue;
            if (w <= 0)
                die("cannot write %s: %s", path, strerror(errno));
            p += w;
            len[i] -= (size_t)w;
        }
    }
    if (close(fd) != 0)
        die("cannot close %s: %s", path, strerror(errno));
}

/* The whole of a file (malloc'ed, 0-terminated), or NULL. */
static char *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    char *buf = NULL;
    long n = -1;
    if (fseek(f, 0, SEEK_END) == 0 && (n = ftell(f)) >= 0 && fseek(f, 0, SEEK_SET) == 0 &&
        (buf = malloc((size_t)n + 1)) && fread(buf, 1, (size_t)n, f) == (size_t)n) {
        buf[n] = '\0';
        *len = (size_t)n;
    } else {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    return buf;
}

/* ---- the status contract ----------------------------------------------------- */

/* A clean outcome: TP_OK, or one of the codes `allowed` lists with a message. */
static void check_status(const char *what, tp_status st, const tp_status *allowed, int n)
{
    if (st == TP_OK)
        return;
    bool ok = false;
    for (int i = 0; i < n; i++)
        ok = ok || st == allowed[i];
    if (!ok)
        die("%s returned %s: %s", what, tp_status_name(st), tp_last_error());
    if (!tp_last_error()[0])
        die("%s returned %s without a message", what, tp_status_name(st));
}

static const tp_status parse_errors[] = {TP_ERR_INVALID_ARG, TP_ERR_NOT_SUPPORTED};
static const tp_status load_errors[] = {TP_ERR_INVALID_ARG, TP_ERR_NOT_SUPPORTED,
                                        TP_ERR_BACKEND};

static tp_status sum_bytes(const char *fqn, tp_tensor *p, void *ctx)
{
    (void)fqn;
    *(size_t *)ctx += (size_t)tp_tensor_numel(p) * 4;
    return TP_OK;
}

/* How tp_safetensors_save_sharded splits the parameters at `limit` bytes. */
typedef struct {
    size_t limit, in_shard;
    int n;
} shard_count;

static tp_status count_shards(const char *fqn, tp_tensor *p, void *ctx)
{
    (void)fqn;
    shard_count *c = ctx;
    size_t b = tp_tensor_nbytes(p);
    if (c->n == 0 || (c->in_shard > 0 && c->in_shard + b > c->limit)) {
        c->n++;
        c->in_shard = 0;
    }
    c->in_shard += b;
    return TP_OK;
}

/* FNV-1a over every parameter's bytes. */
static tp_status hash_params(const char *fqn, tp_tensor *p, void *ctx)
{
    uint64_t *h = ctx;
    for (const char *s = fqn; *s; s++)
        *h = (*h ^ (unsigned char)*s) * 0x100000001b3ull;
    if (tp_tensor_is_dtensor(p))
        p = tp_dtensor_local(p);
    const unsigned char *b = tp_tensor_data(p);
    for (size_t i = 0; i < tp_tensor_nbytes(p); i++)
        *h = (*h ^ b[i]) * 0x100000001b3ull;
    return TP_OK;
}

static uint64_t params_hash(tp_module *m)
{
    uint64_t h = 0xcbf29ce484222325ull;
    if (tp_module_named_parameters(m, hash_params, &h) != TP_OK)
        die("named_parameters: %s", tp_last_error());
    return h;
}

/* ---- libtp's allocations, bounded ---------------------------------------------------- */

/* Every host allocation libtp makes comes here (tp_set_allocator), which
 * also turns off its caching of tensor storage, so AddressSanitizer sees each
 * buffer freed. A config can describe any model: past the budget the
 * allocation fails, and tp_llm_create must then fail cleanly
 * (TP_ERR_NO_MEMORY) rather than stall or crash. */
enum { ALLOC_ONE = 8 << 20, ALLOC_LIVE = 16 << 20 };
static _Atomic size_t live_bytes;

static void *bounded_alloc(void *ctx, size_t size, size_t alignment)
{
    (void)ctx;
    if (size > ALLOC_ONE || atomic_load(&live_bytes) + size > ALLOC_LIVE)
        return NULL;
    size_t n = (size + alignment - 1) / alignment * alignment;
    void *p = aligned_alloc(alignment, n ? n : alignment);
    if (p)
        atomic_fetch_add(&live_bytes, malloc_usable_size(p));
    return p;
}

static void bounded_free(void *ctx, void *p)
{
    (void)ctx;
    atomic_fetch_sub(&live_bytes, malloc_usable_size(p));
    free(p);
}

/* ---- the scratch directory and the small models -------------------------------- */

static int remove_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb;
    (void)flag;
    (void)ftw;
    remove(path);
    return 0;
}

void tp_fuzz_llm_cleanup(void)
{
    for (int a = 0; a < N_SMALL; a++) {
        tp_module_free(models[a].model);
        models[a].model = NULL;
    }
    if (scratch[0])
        nftw(scratch, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
    scratch[0] = '\0';
    ready = false;
}

static void make_scratch(void)
{
    const char *bases[] = {"/dev/shm", getenv("TMPDIR"), "/tmp"};
    for (size_t i = 0; i < sizeof bases / sizeof *bases; i++) {
        if (!bases[i] || access(bases[i], W_OK) != 0)
            continue;
        snprintf(scratch, sizeof scratch, "%s/tp-fuzz-llm-XXXXXX", bases[i]);
        if (mkdtemp(scratch))
            return;
    }
    die("cannot create a scratch directory");
}

#define TRY(expr)                                                                      \
    do {                                                                               \
        tp_status st_ = (expr);                                                        \
        if (st_ != TP_OK)                                                              \
            die("%s: %s: %s", #expr, tp_status_name(st_), tp_last_error());           \
    } while (0)

static void setup_model(int a)
{
    small_model *s = &models[a];
    tp_llm_config c;
    TRY(tp_llm_config_parse(small_configs[a], &c));
    TRY(tp_llm_create(&c, &s->model));
    TRY(tp_module_init(s->model, 1000u + (unsigned)a));
    if (c.dtype != TP_F32)
        TRY(tp_module_to_dtype(s->model, c.dtype));
    s->f32_bytes = 0;
    TRY(tp_module_named_parameters(s->model, sum_bytes, &s->f32_bytes));

    snprintf(s->header_dir, sizeof s->header_dir, "%s/header-%s", scratch, small_names[a]);
    snprintf(s->index_dir, sizeof s->index_dir, "%s/index-%s", scratch, small_names[a]);
    if (mkdir(s->header_dir, 0755) != 0 || mkdir(s->index_dir, 0755) != 0)
        die("mkdir in %s: %s", scratch, strerror(errno));
    /* three shards, as the Llama fixture's index names, and the whole model
     * beside them */
    shard_count sc = {0};
    for (sc.limit = 1; sc.limit < s->f32_bytes; sc.limit++) {
        sc.n = 0;
        sc.in_shard = 0;
        TRY(tp_module_named_parameters(s->model, count_shards, &sc));
        if (sc.n <= 3)
            break;
    }
    TRY(tp_safetensors_save_sharded(s->model, s->index_dir, "model", sc.limit, 0));
    char p[700];
    snprintf(p, sizeof p, "%s/model.safetensors", s->index_dir);
    TRY(tp_safetensors_save(s->model, p, 0));
    snprintf(p, sizeof p, "%s/dir.safetensors", s->index_dir);
    if (mkdir(p, 0755) != 0)
        die("mkdir %s: %s", p, strerror(errno));
    snprintf(p, sizeof p, "%s/empty.safetensors", s->index_dir);
    write_file(p, NULL, 0, NULL, 0, NULL, 0);
    snprintf(p, sizeof p, "%s/short.safetensors", s->index_dir);
    write_file(p, "\x08\0\0", 3, NULL, 0, NULL, 0);
    snprintf(p, sizeof p, "%s/fifo.safetensors", s->index_dir);
    if (mkfifo(p, 0644) != 0)
        die("mkfifo %s: %s", p, strerror(errno));
}

static void setup(void)
{
    if (ready)
        return;
    /* before the first libtp object, as tp_set_allocator asks */
    static const tp_allocator bounded = {bounded_alloc, bounded_free, NULL};
    TRY(tp_set_allocator(&bounded));
    make_scratch();
    char p[300];
    snprintf(p, sizeof p, "%s/config", scratch);
    if (mkdir(p, 0755) != 0)
        die("mkdir %s: %s", p, strerror(errno));
    static bool registered;
    if (!registered && atexit(tp_fuzz_llm_cleanup) == 0)
        registered = true;
    for (int a = 0; a < N_SMALL; a++)
        setup_model(a);
    ready = true;
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    const char *m = getenv("FUZZ_LLM_MODE");
    for (int i = 0; m && *m && i < N_MODES; i++)
        if (!strcmp(m, mode_names[i]))
            forced_mode = i;
    if (m && *m && forced_mode < 0)
        die("FUZZ_LLM_MODE=%s: expected config, header or index", m);
    verbose = getenv("FUZZ_LLM_VERBOSE") != NULL;
    setup();
    return 0;
}

/* ---- config.json ------------------------------------------------------------------ */

/* tp_llm_config_to_json writes a negative bos/pad id as null, which parses as
 * -1 (none): the one change a round trip may make (docs/fuzzing.md). */
static int64_t token_id(int64_t id)
{
    return id < 0 ? -1 : id;
}

static bool same_config(const tp_llm_config *x, const tp_llm_config *y)
{
    bool same = x->arch == y->arch && x->vocab_size == y->vocab_size &&
                x->hidden_size == y->hidden_size && x->intermediate_size == y->intermediate_size &&
                x->num_hidden_layers == y->num_hidden_layers &&
                x->num_attention_heads == y->num_attention_heads &&
                x->num_key_value_heads == y->num_key_value_heads && x->head_dim == y->head_dim &&
                x->max_position_embeddings == y->max_position_embeddings &&
                x->rms_norm_eps == y->rms_norm_eps && x->rope.type == y->rope.type &&
                x->rope.theta == y->rope.theta && x->rope.factor == y->rope.factor &&
                x->rope.low_freq_factor == y->rope.low_freq_factor &&
                x->rope.high_freq_factor == y->rope.high_freq_factor &&
                x->rope.original_max_position_embeddings ==
                    y->rope.original_max_position_embeddings &&
                x->rope.head_dim == y->rope.head_dim &&
                x->rope.max_position_embeddings == y->rope.max_position_embeddings &&
                x->tie_word_embeddings == y->tie_word_embeddings &&
                x->attention_bias == y->attention_bias && x->qkv_bias == y->qkv_bias &&
                x->mlp_bias == y->mlp_bias && x->sliding_window == y->sliding_window &&
                x->dtype == y->dtype && token_id(x->bos_token_id) == token_id(y->bos_token_id) &&
                token_id(x->pad_token_id) == token_id(y->pad_token_id) && x->n_eos == y->n_eos;
    for (int i = 0; same && i < x->n_eos; i++)
        same = x->eos_token_id[i] == y->eos_token_id[i];
    return same;
}

/* Few enough parameters to build and run in a millisecond or so. */
static bool small_enough(const tp_llm_config *c)
{
    const int64_t lim[] = {c->vocab_size, 256, c->hidden_size, 128, c->intermediate_size, 256,
                           c->num_hidden_layers, 2, c->num_attention_heads, 16,
                           c->num_key_value_heads, 16, c->head_dim, 64};
    for (size_t i = 0; i < sizeof lim / sizeof *lim; i += 2)
        if (lim[i] > lim[i + 1])
            return false;
    int64_t q = c->num_attention_heads * c->head_dim, kv = c->num_key_value_heads * c->head_dim;
    int64_t layer = c->hidden_size * (2 * q + 2 * kv + 3 * c->intermediate_size);
    return 2 * c->vocab_size * c->hidden_size + c->num_hidden_layers * layer <= 200000;
}

static const tp_status create_errors[] = {TP_ERR_INVALID_ARG, TP_ERR_NOT_SUPPORTED,
                                          TP_ERR_NO_MEMORY};

/* Builds the model (within the allocation budget) and, when it is small,
 * runs it on three tokens. */
static void build_and_run(const tp_llm_config *c)
{
    tp_module *m = NULL;
    tp_status st = tp_llm_create(c, &m);
    report("tp_llm_create", st);
    check_status("tp_llm_create", st, create_errors, 3);
    if (st != TP_OK)
        return;
    if (!small_enough(c)) {
        tp_module_free(m);
        return;
    }
    TRY(tp_module_init(m, 7));
    const int64_t shape[2] = {1, 3};
    const int64_t ids[3] = {0, c->vocab_size - 1, c->vocab_size / 2};
    tp_tensor *x = NULL, *logits = NULL, *loss = NULL;
    TRY(tp_tensor_from_data(TP_I64, 2, shape, ids, &x));
    st = tp_llm_forward(m, x, NULL, NULL, &logits);
    report("tp_llm_forward", st);
    check_status("tp_llm_forward", st, parse_errors, 2);
    if (st == TP_OK) {
        st = tp_llm_loss(logits, x, &loss);
        check_status("tp_llm_loss", st, parse_errors, 2);
    }
    tp_tensor_release(loss);
    tp_tensor_release(logits);
    tp_tensor_release(x);
    tp_module_free(m);
}

static void fuzz_config(const uint8_t *data, size_t size)
{
    /* through the file, as a model directory is read */
    char path[300];
    snprintf(path, sizeof path, "%s/config/config.json", scratch);
    write_file(path, data, size, NULL, 0, NULL, 0);
    snprintf(path, sizeof path, "%s/config", scratch);
    tp_llm_config c;
    tp_clear_error();
    tp_status st = tp_llm_config_load(path, &c);
    report("tp_llm_config_load", st);
    check_status("tp_llm_config_load", st, parse_errors, 2);
    if (st != TP_OK)
        return;
    char *json = NULL;
    TRY(tp_llm_config_to_json(&c, &json));
    tp_llm_config back;
    st = tp_llm_config_parse(json, &back);
    if (st != TP_OK)
        die("the config's own JSON does not parse (%s):\n%s", tp_last_error(), json);
    if (!same_config(&c, &back))
        die("the config's own JSON parses to another config:\n%s", json);
    free(json);
    build_and_run(&c);
}

/* ---- model directories ------------------------------------------------------------ */

/* tp_llm_load's name map, for the staged load below. */
static bool skip_names(const char *file_name, char *fqn, size_t cap, void *ctx)
{
    (void)fqn;
    (void)cap;
    const tp_llm_config *c = ctx;
    const char *inv = ".rotary_emb.inv_freq";
    size_t n = strlen(file_name), k = strlen(inv);
    if (n >= k && !strcmp(file_name + n - k, inv))
        return false;
    return !(c->tie_word_embeddings && !strcmp(file_name, "lm_head.weight"));
}

/* tp_llm_load (streamed: every check first, then each tensor straight into
 * its parameter), or with `staged` tp_safetensors_load of the same file with
 * the same names, all or nothing (every tensor read into scratch first). */
static tp_status load_dir(tp_module *m, const char *dir, bool staged)
{
    if (!staged)
        return tp_llm_load(m, dir);
    char path[700];
    struct stat sb;
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    if (stat(path, &sb) != 0)
        snprintf(path, sizeof path, "%s/model.safetensors", dir);
    const tp_safetensors_load_options o = {.map_name = skip_names,
                                           .map_ctx = (void *)tp_llm_config_of(m),
                                           .strict = true};
    return tp_safetensors_load(m, path, &o);
}

static void load_into(small_model *s, const char *dir, bool staged)
{
    const uint64_t before = params_hash(s->model);
    tp_clear_error();
    tp_status st = load_dir(s->model, dir, staged);
    report(staged ? "tp_safetensors_load" : "tp_llm_load", st);
    check_status("tp_llm_load", st, load_errors, 3);
    /* streamed too: only an I/O error part-way may leave a load half done */
    if (st != TP_OK && params_hash(s->model) != before)
        die("a failed tp_llm_load changed the parameters (%s)", tp_last_error());
}

/* The same load into the model parallelized over 2 ranks (threads of the shm
 * backend, the standard plan): each rank reads its shard of each parameter,
 * Shard(1) ones row by row, and the ranks agree through one all_reduce. */
enum { TP_RANKS = 2 };

typedef struct {
    int arch;
    const char *dir;
    bool staged;
    tp_status st[TP_RANKS];
    char msg[TP_RANKS][512];
    bool changed[TP_RANKS];
} tp_job;

static tp_status tp_rank(tp_comm *world, void *arg)
{
    tp_job *j = arg;
    const int r = tp_comm_rank(world);
    tp_llm_config c;
    tp_module *m = NULL;
    tp_mesh *mesh = NULL;
    const int64_t shape[1] = {TP_RANKS};
    TRY(tp_llm_config_parse(small_configs[j->arch], &c));
    TRY(tp_llm_create(&c, &m));
    if (c.dtype != TP_F32)
        TRY(tp_module_to_dtype(m, c.dtype));
    TRY(tp_mesh_create(world, 1, shape, (const char *[]){"tp"}, &mesh));
    /* zeros everywhere: nothing to send */
    const tp_parallelize_options po = {.src_data_rank = TP_SRC_DATA_RANK_NONE};
    TRY(tp_llm_parallelize(m, mesh, 0, NULL, &po));
    const uint64_t before = params_hash(m);
    tp_clear_error();
    j->st[r] = load_dir(m, j->dir, j->staged);
    snprintf(j->msg[r], sizeof j->msg[r], "%s", tp_last_error());
    j->changed[r] = params_hash(m) != before;
    tp_module_free(m);
    tp_mesh_free(mesh);
    return TP_OK;
}

static void load_parallel(int arch, const char *dir, bool staged)
{
    tp_job j = {.arch = arch, .dir = dir, .staged = staged};
    TRY(tp_run_local(TP_RANKS, tp_rank, &j));
    for (int r = 0; r < TP_RANKS; r++) {
        tp_status st = j.st[r];
        if (verbose)
            fprintf(stderr, "fuzz_llm: tp_llm_load rank %d: %s%s%s\n", r, tp_status_name(st),
                    st ? ": " : "", st ? j.msg[r] : "");
        /* every rank reads the same files: they fail alike, or one of them
         * reads what the other could not and sees TP_ERR_MISMATCH */
        if (st != TP_OK && st != TP_ERR_INVALID_ARG && st != TP_ERR_NOT_SUPPORTED &&
            st != TP_ERR_BACKEND && st != TP_ERR_MISMATCH)
            die("tp_llm_load on rank %d returned %s: %s", r, tp_status_name(st), j.msg[r]);
        if (st != TP_OK && !j.msg[r][0])
            die("tp_llm_load on rank %d returned %s without a message", r, tp_status_name(st));
        if (st != TP_OK && j.changed[r])
            die("a failed tp_llm_load changed rank %d's parameters (%s)", r, j.msg[r]);
        if ((st == TP_OK) != (j.st[0] == TP_OK))
            die("tp_llm_load: rank 0 returned %s, rank %d %s", tp_status_name(j.st[0]), r,
                tp_status_name(st));
    }
}

/* Variant bits: 0x40 on 2 ranks, 0x20 staged. */
static void load(int arch, const char *dir, unsigned variant)
{
    if (variant & 0x40)
        load_parallel(arch, dir, variant & 0x20);
    else
        load_into(&models[arch], dir, variant & 0x20);
}

static void fuzz_header(const uint8_t *data, size_t size)
{
    if (size < 1)
        return;
    const unsigned v = data[0];
    const int arch = (v & 3) % N_SMALL;
    small_model *s = &models[arch];
    data++;
    size--;
    char path[700];
    snprintf(path, sizeof path, "%s/model.safetensors", s->header_dir);
    if (v & 4) {
        write_file(path, data, size, NULL, 0, NULL, 0);
    } else {
        unsigned char len[8];
        for (int i = 0; i < 8; i++)
            len[i] = (unsigned char)((uint64_t)size >> (8 * i));
        const size_t cut = (v >> 3) & 3, all = v & 0x80 ? (size_t)512 << 10 : s->f32_bytes,
                     n = all > cut ? all - cut : 0;
        /* finite in every float dtype, whatever the alignment */
        unsigned char *buf = malloc(n ? n : 1);
        if (!buf)
            die("out of memory");
        memset(buf, 0x3c, n);
        write_file(path, len, 8, data, size, buf, n);
        free(buf);
    }
    load(arch, s->header_dir, v);
}

static void fuzz_index(const uint8_t *data, size_t size)
{
    if (size < 1)
        return;
    const int arch = (data[0] & 3) % N_SMALL;
    char path[700];
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", models[arch].index_dir);
    write_file(path, data + 1, size - 1, NULL, 0, NULL, 0);
    load(arch, models[arch].index_dir, data[0]);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    setup();
    const int mode = forced_mode >= 0 ? forced_mode : data[0] % N_MODES;
    if (mode == MODE_CONFIG)
        fuzz_config(data + 1, size - 1);
    else if (mode == MODE_HEADER)
        fuzz_header(data + 1, size - 1);
    else
        fuzz_index(data + 1, size - 1);
    return 0;
}

/* ---- the seed corpus ----------------------------------------------------------------- */

/* A seed: the mode's digit, the variant byte (none: -1), the body. */
static void write_seed(const char *out, int mode, const char *name, int variant,
                       const void *body, size_t n)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/%s/%s", out, mode_names[mode], name);
    const char head[2] = {(char)('0' + mode), (char)variant};
    write_file(path, head, variant >= 0 ? 2 : 1, body, n, NULL, 0);
}

/* The JSON header of a safetensors file (malloc'ed), or NULL. */
static char *st_header(const char *path, size_t *len)
{
    size_t n = 0;
    char *all = read_file(path, &n);
    if (!all || n < 8) {
        free(all);
        return NULL;
    }
    uint64_t h = 0;
    for (int i = 7; i >= 0; i--)
        h = h << 8 | (unsigned char)all[i];
    if (h > n - 8) {
        free(all);
        return NULL;
    }
    memmove(all, all + 8, (size_t)h);
    *len = (size_t)h;
    return all;
}

static tp_status sum_nbytes(const char *fqn, tp_tensor *p, void *ctx)
{
    (void)fqn;
    *(size_t *)ctx += tp_tensor_nbytes(p);
    return TP_OK;
}

/* The tied Llama's header with the two tensors its loading skips by name: a
 * separate lm_head.weight and a rotary inv_freq buffer, after the data. */
static void write_skipped_seed(const char *out, const char *json, size_t n)
{
    size_t end = 0;
    TRY(tp_module_named_parameters(models[0].model, sum_nbytes, &end));
    char extra[512];
    int k = snprintf(extra, sizeof extra,
                     "\"lm_head.weight\":{\"dtype\":\"BF16\",\"shape\":[7,8],"
                     "\"data_offsets\":[%zu,%zu]},"
                     "\"model.layers.1.self_attn.rotary_emb.inv_freq\":{\"dtype\":\"F32\","
                     "\"shape\":[2],\"data_offsets\":[%zu,%zu]},",
                     end, end + 112, end + 112, end + 120);
    char *text = malloc(n + (size_t)k + 1);
    if (!text || n < 1 || json[0] != '{' || end + 120 > models[0].f32_bytes)
        die("cannot make the skipped-names seed");
    text[0] = '{';
    memcpy(text + 1, extra, (size_t)k);
    memcpy(text + 1 + k, json + 1, n - 1);
    write_seed(out, MODE_HEADER, "small-llama-skipped", 0, text, n + (size_t)k);
    free(text);
}

/* The header of small model `arch` saved in `dtype`: a file whose values
 * the load converts to the parameters' dtype (malloc'ed). */
static char *converted_header(int arch, tp_dtype dtype, size_t *n)
{
    tp_llm_config c;
    tp_module *m = NULL;
    char path[300];
    snprintf(path, sizeof path, "%s/converted.safetensors", scratch);
    TRY(tp_llm_config_parse(small_configs[arch], &c));
    TRY(tp_llm_create(&c, &m));
    TRY(tp_module_to_dtype(m, dtype));
    TRY(tp_safetensors_save(m, path, 0));
    tp_module_free(m);
    char *text = st_header(path, n);
    if (!text)
        die("cannot read %s", path);
    unlink(path);
    return text;
}

/* A seed of `text` with the first `from` replaced by `to`. */
static void write_seed_replaced(const char *out, int mode, const char *name, int variant,
                                const char *text, size_t n, const char *from, const char *to)
{
    const char *at = strstr(text, from);
    if (!at)
        die("seed %s: no '%s' to replace", name, from);
    const size_t head = (size_t)(at - text), nf = strlen(from), nt = strlen(to);
    char *copy = malloc(n - nf + nt);
    if (!copy)
        die("out of memory");
    memcpy(copy, text, head);
    memcpy(copy + head, to, nt);
    memcpy(copy + head + nt, at + nf, n - head - nf);
    write_seed(out, mode, name, variant, copy, n - nf + nt);
    free(copy);
}

int tp_fuzz_llm_write_seeds(const char *out, const char *fixtures)
{
    setup();
    char path[1024], name[128];
    size_t n = 0;
    char *text;
    for (int a = 0; a < N_SMALL; a++) {
        snprintf(name, sizeof name, "small-%s", small_names[a]);
        write_seed(out, MODE_CONFIG, name, -1, small_configs[a], strlen(small_configs[a]));
        snprintf(path, sizeof path, "%s/model.safetensors", models[a].index_dir);
        if (!(text = st_header(path, &n)))
            die("cannot read %s", path);
        write_seed(out, MODE_HEADER, name, a, text, n);
        if (a == 0)
            write_skipped_seed(out, text, n);
        if (a == 1) {
            write_seed(out, MODE_HEADER, "small-mistral-tp2", a | 0x40, text, n);
            write_seed_replaced(out, MODE_HEADER, "small-mistral-i32", a, text, n, "F32", "I32");
            /* what byte mutations of a JSON object rarely reach: more dims
             * than a tensor has, a shape of 2^80 elements, metadata that is
             * not an object, a header that is not an object */
            write_seed_replaced(out, MODE_HEADER, "small-mistral-9dims", a, text, n,
                                "\"shape\":[5,8]", "\"shape\":[1,1,1,1,1,1,1,5,8]");
            write_seed_replaced(out, MODE_HEADER, "small-mistral-2e80", a, text, n,
                                "\"shape\":[5,8]", "\"shape\":[1099511627776,1099511627776]");
            write_seed_replaced(out, MODE_HEADER, "small-mistral-metadata", a, text, n,
                                "{\"format\":\"pt\"}", "\"pt\"");
            write_seed(out, MODE_HEADER, "array", a, "[]", 2);
        }
        free(text);
        snprintf(path, sizeof path, "%s/model.safetensors.index.json", models[a].index_dir);
        if (!(text = read_file(path, &n)))
            die("cannot read %s", path);
        write_seed(out, MODE_INDEX, name, a, text, n);
        if (a == 2)
            write_seed(out, MODE_INDEX, "small-qwen2-tp2", a | 0x40, text, n);
        if (a == 0)
            write_seed(out, MODE_INDEX, "small-llama-staged", a | 0x20, text, n);
        free(text);
    }
    /* files in another dtype than the parameters: converted, refused as not
     * convertible (integers), refused as a dtype libtp does not load */
    text = converted_header(1, TP_F16, &n);
    write_seed(out, MODE_HEADER, "small-mistral-f16", 1, text, n);
    write_seed(out, MODE_HEADER, "small-mistral-f16-staged", 1 | 0x20, text, n);
    write_seed_replaced(out, MODE_HEADER, "small-mistral-i16", 1, text, n, "F16", "I16");
    free(text);
    text = converted_header(0, TP_F32, &n);
    write_seed(out, MODE_HEADER, "small-llama-f32", 0, text, n);
    free(text);
    text = converted_header(2, TP_BF16, &n);
    write_seed(out, MODE_HEADER, "small-qwen2-bf16-tp2", 2 | 0x40, text, n);
    write_seed(out, MODE_HEADER, "small-qwen2-bf16-tp2-staged", 2 | 0x60, text, n);
    free(text);
    /* integral reals where integers are expected, as some tools write them */
    const char *reals = "{\"model_type\": \"qwen2\", \"vocab_size\": 6.0, \"hidden_size\": 8, "
                        "\"intermediate_size\": 8.0, \"num_hidden_layers\": 1, "
                        "\"num_attention_heads\": 2, \"partial_rotary_factor\": 1.0, "
                        "\"layer_types\": [\"full_attention\"], \"eos_token_id\": [1, 2]}";
    write_seed(out, MODE_CONFIG, "small-qwen2-reals", -1, reals, strlen(reals));
    /* the whole model and a shard of it: every tensor of the shard named twice */
    const char *twice = "{\"weight_map\": {\"model.norm.weight\": \"model.safetensors\", "
                        "\"lm_head.weight\": \"model-00003-of-00003.safetensors\"}}";
    write_seed(out, MODE_INDEX, "small-mistral-twice", 1, twice, strlen(twice));
    /* the fixtures (Hugging Face's own files): configs of both transformers
     * forms, a shard's header transformers wrote (BF16) and an index, each
     * with the small model of its architecture */
    static const char *const dirs[] = {"llama", "llama_bf16", "mistral", "qwen2"};
    for (size_t i = 0; i < sizeof dirs / sizeof *dirs; i++) {
        snprintf(path, sizeof path, "%s/%s/config.json", fixtures, dirs[i]);
        if (!(text = read_file(path, &n)))
            die("cannot read %s", path);
        snprintf(name, sizeof name, "hf-%s", dirs[i]);
        write_seed(out, MODE_CONFIG, name, -1, text, n);
        free(text);
    }
    snprintf(path, sizeof path, "%s/llama_bf16/model-00003-of-00003.safetensors", fixtures);
    if (!(text = st_header(path, &n)))
        die("cannot read %s", path);
    write_seed(out, MODE_HEADER, "hf-llama_bf16-shard3", 0x80, text, n);
    free(text);
    snprintf(path, sizeof path, "%s/llama_bf16/model.safetensors.index.json", fixtures);
    if (!(text = read_file(path, &n)))
        die("cannot read %s", path);
    write_seed(out, MODE_INDEX, "hf-llama_bf16", 0, text, n);
    free(text);
    return 0;
}
