/*
 * tp-llm: a Hugging Face Llama, Mistral or Qwen2 model directory, sharded
 * with libtp's standard tensor-parallel plan, run and trained.
 *
 *   tp-llm logits --model DIR --tokens IDS --out FILE          [common options]
 *   tp-llm train  --model DIR --data FILE --steps N [--lr L] [--weight-decay W]
 *                 [--save DIR] [--max-shard-bytes B] [--grads-out FILE]
 *                 [--recompute none|full|selective[:K]] [--fsdp]          [common options]
 *   tp-llm generate --model DIR --tokens IDS --max-new-tokens K
 *                 [--greedy | --temperature T --top-k K --top-p P --seed S]
 *                 [--eos IDS] [--cache-len N]                             [common options]
 *
 * common: --tp N, --dp M, --backend shm|mpi, --device cpu|cuda,
 *         --dtype f32|bf16|f16, --threads K, --sp (sequence parallelism)
 *
 * IDS is a comma-separated list of ids (one sequence) or @FILE; FILE (for
 * --data too) holds one sequence per line, ids separated by commas or
 * spaces, every line the same length: a batch. `logits` writes the logits of
 * every position as one f32 tensor "logits" [batch, seq, vocab] to a
 * safetensors file. `train` takes AdamW steps on the causal-LM loss (labels =
 * the input ids, shifted inside), printing each step's loss; --grads-out
 * writes the gradients of the first backward (full, f32, Hugging Face names);
 * --recompute recomputes the decoder blocks' activations in backward
 * (every K-th block with :K; tp_module_set_recompute); --fsdp shards the
 * parameters, gradients and Adam state over --dp (tp_llm_fully_shard)
 * instead of replicating them (DDP).
 * `generate` continues each sequence of IDS (here the lines of @FILE may
 * differ in length: prompts of different lengths, left-padded into one
 * batch) by up to K tokens through a KV cache (--cache-len positions, by
 * default the longest prompt plus K), stopping a sequence at an eos id of
 * generation_config.json / config.json (or --eos); it prints one line per
 * sequence holding only its new ids, comma-separated (the eos included),
 * and on stderr the time to first token, decode tokens/s, the per-token
 * latency (median, p99) and memory. Without --greedy or a sampling option
 * it decodes as generation_config.json says (greedy when it says nothing);
 * any of --temperature, --top-k, --top-p, --seed samples, the others taken
 * from generation_config.json (top-k 50, temperature 1, top-p 1 by
 * default). generate takes neither --dp nor --sp.
 * Bad input exits 2 with a message naming it; with --backend shm the ranks
 * are threads (tp x dp of them), with mpi one process each under
 * `mpirun -np tp*dp`.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cblas.h>
#include <tp.h>

#define EXIT_BAD 2

typedef enum { CMD_LOGITS, CMD_TRAIN, CMD_GENERATE } command;

typedef struct {
    command cmd;
    const char *model, *tokens, *out, *data, *save, *grads_out;
    int tp, dp, threads;
    long steps;
    double lr, weight_decay;
    tp_recompute_mode recompute; /* of the decoder blocks, every recompute_every-th */
    long recompute_every;
    bool fsdp; /* fully sharded over --dp instead of DDP */
    size_t max_shard;
    bool mpi, cuda, sp;
    tp_dtype dtype;
    /* generate */
    long max_new, cache_len;
    bool greedy, sample_set;
    tp_llm_sampling sampling;
    const char *eos_spec;
    int n_eos;
    int64_t eos[TP_LLM_MAX_EOS];
    /* read before the ranks start */
    tp_llm_config cfg;
    tp_llm_generation_config gen;
    int64_t batch, seq;
    int64_t *ids;
    int64_t *mask; /* generate: 1 on prompt tokens, 0 on the left padding */
} options;

static void usage(FILE *f)
{
    fprintf(f,
            "usage: tp-llm logits --model DIR --tokens IDS --out FILE [options]\n"
            "       tp-llm train --model DIR --data FILE --steps N [--lr L] [--weight-decay W]\n"
            "                    [--save DIR] [--max-shard-bytes B] [--grads-out FILE]\n"
            "                    [--recompute none|full|selective[:K]] [--fsdp] [options]\n"
            "       tp-llm generate --model DIR --tokens IDS --max-new-tokens K\n"
            "                    [--greedy | --temperature T --top-k K --top-p P --seed S]\n"
            "                    [--eos IDS] [--cache-len N] [options]\n"
            "options: --tp N --dp M --backend shm|mpi --device cpu|cuda --dtype f32|bf16|f16\n"
            "         --threads K --sp\n"
            "IDS: ids separated by commas, or @FILE with one sequence per line (a batch;\n"
            "     for generate the lines may differ in length)\n");
}

static int bad(const char *fmt, const char *a)
{
    fprintf(stderr, "tp-llm: ");
    fprintf(stderr, fmt, a);
    fprintf(stderr, "\n");
    return EXIT_BAD;
}

static bool parse_long(const char *s, long lo, long hi, long *out)
{
    char *end = NULL;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi)
        return false;
    *out = v;
    return true;
}

static bool parse_double(const char *s, double *out)
{
    char *end = NULL;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !(v == v))
        return false;
    *out = v;
    return true;
}

/* ---- token input ------------------------------------------------------------------ */

/* One line of ids into ids (grown); *n ids read. Returns false naming the
 * problem in err. */
static bool parse_line(const char *line, int64_t **ids, int64_t *n, int64_t *cap, char *err,
                       size_t errlen)
{
    const char *p = line;
    *n = 0;
    for (;;) {
        while (*p == ' ' || *p == '\t' || *p == ',' || *p == '\r')
            p++;
        if (!*p || *p == '\n')
            return true;
        char *end = NULL;
        errno = 0;
        long long v = strtoll(p, &end, 10);
        if (end == p || errno) {
            snprintf(err, errlen, "'%.20s' is not a token id", p);
            return false;
        }
        if (*n == *cap) {
            int64_t nc = *cap ? *cap * 2 : 64;
            int64_t *g = realloc(*ids, sizeof *g * (size_t)nc);
            if (!g) {
                snprintf(err, errlen, "out of memory");
                return false;
            }
            *ids = g;
            *cap = nc;
        }
        (*ids)[(*n)++] = v;
        p = end;
        if (*p && *p != ' ' && *p != '\t' && *p != ',' && *p != '\r' && *p != '\n') {
            snprintf(err, errlen, "'%.20s' is not a token id", p);
            return false;
        }
    }
}

/* The prompts of generate, each left-padded with `pad` to the longest: ids
 * [batch, seq] and the mask. lens[i] is prompt i's length. */
static int left_pad(options *o, const int64_t *lens, int64_t pad)
{
    int64_t S = 0;
    for (int64_t b = 0; b < o->batch; b++)
        S = lens[b] > S ? lens[b] : S;
    int64_t *ids = malloc(sizeof *ids * (size_t)(o->batch * S)),
            *mask = calloc((size_t)(o->batch * S), sizeof *mask);
    if (!ids || !mask) {
        free(ids);
        free(mask);
        return bad("%s", "out of memory");
    }
    for (int64_t b = 0, at = 0; b < o->batch; at += lens[b], b++)
        for (int64_t s = 0; s < S; s++) {
            const int64_t off = s - (S - lens[b]);
            ids[b * S + s] = off >= 0 ? o->ids[at + off] : pad;
            mask[b * S + s] = off >= 0;
        }
    free(o->ids);
    o->ids = ids;
    o->mask = mask;
    o->seq = S;
    return 0;
}

/* IDS (a list, or @FILE) or a --data FILE into o->ids [batch, seq]; for
 * generate, lines of any length (none empty), left-padded. */
static int read_tokens(options *o, const char *spec, bool file)
{
    char err[160];
    int64_t cap = 0, n = 0, *row = NULL, rcap = 0, *lens = NULL, total = 0;
    const bool ragged = o->cmd == CMD_GENERATE;
    o->batch = o->seq = 0;
    if (!file && spec[0] != '@') {
        if (!parse_line(spec, &o->ids, &n, &cap, err, sizeof err))
            return bad("--tokens: %s", err);
        o->batch = 1;
        o->seq = n;
    } else {
        const char *path = file ? spec : spec + 1;
        FILE *f = fopen(path, "r");
        if (!f) {
            fprintf(stderr, "tp-llm: cannot open %s: %s\n", path, strerror(errno));
            return EXIT_BAD;
        }
        char *line = NULL;
        size_t lcap = 0;
        int rc = 0;
        while (getline(&line, &lcap, f) >= 0) {
            int64_t k = 0;
            if (!parse_line(line, &row, &k, &rcap, err, sizeof err)) {
                fprintf(stderr, "tp-llm: %s line %lld: %s\n", path, (long long)o->batch + 1, err);
                rc = EXIT_BAD;
                break;
            }
            if (k == 0 && ragged) {
                fprintf(stderr, "tp-llm: %s line %lld holds no token ids: an empty prompt\n",
                        path, (long long)o->batch + 1);
                rc = EXIT_BAD;
                break;
            }
            if (k == 0)
                continue;
            if (ragged) {
                int64_t *g = realloc(o->ids, sizeof *g * (size_t)(total + k)),
                        *gl = g ? realloc(lens, sizeof *gl * (size_t)(o->batch + 1)) : NULL;
                if (g)
                    o->ids = g;
                if (gl)
                    lens = gl;
                if (!g || !gl) {
                    rc = bad("%s", "out of memory");
                    break;
                }
                memcpy(o->ids + total, row, sizeof *row * (size_t)k);
                total += k;
                lens[o->batch++] = k;
                o->seq = k > o->seq ? k : o->seq;
                continue;
            }
            if (o->batch > 0 && k != o->seq) {
                fprintf(stderr, "tp-llm: %s line %lld has %lld ids, the first line %lld: every "
                                "sequence of a batch must have the same length\n",
                        path, (long long)o->batch + 1, (long long)k, (long long)o->seq);
                rc = EXIT_BAD;
                break;
            }
            o->seq = k;
            int64_t *g = realloc(o->ids, sizeof *g * (size_t)((o->batch + 1) * k));
            if (!g) {
                rc = bad("%s", "out of memory");
                break;
            }
            o->ids = g;
            memcpy(o->ids + o->batch * k, row, sizeof *row * (size_t)k);
            o->batch++;
        }
        free(line);
        free(row);
        fclose(f);
        if (rc) {
            free(lens);
            return rc;
        }
    }
    if (o->batch == 0 || o->seq == 0) {
        free(lens);
        return bad("%s holds no token ids", file ? spec : "--tokens");
    }
    if (ragged && !lens) { /* one sequence from --tokens */
        lens = malloc(sizeof *lens);
        if (!lens)
            return bad("%s", "out of memory");
        lens[0] = o->seq;
    }
    /* checked before padding: the positions are the prompt's own */
    for (int64_t b = 0, at = 0; b < o->batch; at += ragged ? lens[b] : o->seq, b++)
        for (int64_t s = 0; s < (ragged ? lens[b] : o->seq); s++)
            if (o->ids[at + s] < 0 || o->ids[at + s] >= o->cfg.vocab_size) {
                fprintf(stderr, "tp-llm: token id %lld (sequence %lld, position %lld) is outside "
                                "the vocabulary [0, %lld)\n",
                        (long long)o->ids[at + s], (long long)b, (long long)s,
                        (long long)o->cfg.vocab_size);
                free(lens);
                return EXIT_BAD;
            }
    int rc = 0;
    if (ragged) {
        const int64_t pad = o->gen.pad_token_id >= 0 ? o->gen.pad_token_id
                            : o->gen.n_eos > 0      ? o->gen.eos_token_id[0]
                                                    : 0;
        rc = left_pad(o, lens, pad);
    }
    free(lens);
    return rc;
}

/* ---- options ------------------------------------------------------------------------ */

/* generate's decoding: --greedy, the sampling options over
 * generation_config.json's, or generation_config.json's alone; the eos ids
 * of --eos or of the configs. */
static int choose_decoding(options *o)
{
    /* given: what the options set (-1: not given) */
    const tp_llm_sampling given = o->sampling;
    o->sampling = o->greedy ? (tp_llm_sampling){0} : o->gen.sampling;
    if (o->sample_set) {
        o->sampling.do_sample = true;
        if (given.temperature > 0)
            o->sampling.temperature = given.temperature;
        if (given.top_p > 0)
            o->sampling.top_p = given.top_p;
        if (given.top_k >= 0)
            o->sampling.top_k = given.top_k;
        o->sampling.seed = given.seed;
    }
    o->n_eos = o->gen.n_eos;
    memcpy(o->eos, o->gen.eos_token_id, sizeof o->eos);
    if (o->eos_spec) {
        int64_t *ids = NULL, n = 0, cap = 0;
        char err[160];
        if (!parse_line(o->eos_spec, &ids, &n, &cap, err, sizeof err) || n == 0 ||
            n > TP_LLM_MAX_EOS) {
            free(ids);
            return bad("--eos '%s': 1 to 8 token ids separated by commas", o->eos_spec);
        }
        for (int64_t i = 0; i < n; i++)
            if (ids[i] < 0 || ids[i] >= o->cfg.vocab_size) {
                free(ids);
                return bad("--eos '%s': an id is outside the vocabulary", o->eos_spec);
            }
        o->n_eos = (int)n;
        memcpy(o->eos, ids, sizeof *ids * (size_t)n);
        free(ids);
    }
    return 0;
}

static int parse_args(int argc, char **argv, options *o)
{
    memset(o, 0, sizeof *o);
    o->tp = o->dp = 1;
    o->lr = 1e-3;
    o->weight_decay = 0.01;
    o->max_shard = (size_t)5 << 30;
    o->steps = -1;
    o->sampling = (tp_llm_sampling){.temperature = -1, .top_k = -1, .top_p = -1};
    if (argc < 2) {
        usage(stderr);
        return EXIT_BAD;
    }
    if (!strcmp(argv[1], "logits"))
        o->cmd = CMD_LOGITS;
    else if (!strcmp(argv[1], "train"))
        o->cmd = CMD_TRAIN;
    else if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        usage(stdout);
        exit(0);
    } else if (!strcmp(argv[1], "generate")) {
        o->cmd = CMD_GENERATE;
    } else {
        usage(stderr);
        return bad("unknown command '%s'", argv[1]);
    }
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        long n = 0;
        if (!strcmp(a, "--sp")) {
            o->sp = true;
            continue;
        }
        if (!strcmp(a, "--greedy") && o->cmd == CMD_GENERATE) {
            o->greedy = true;
            continue;
        }
        if (!strcmp(a, "--fsdp") && o->cmd == CMD_TRAIN) {
            o->fsdp = true;
            continue;
        }
        if (!v)
            return bad("%s needs a value", a);
        i++;
        if (!strcmp(a, "--model"))
            o->model = v;
        else if (!strcmp(a, "--tokens") && o->cmd != CMD_TRAIN)
            o->tokens = v;
        else if (!strcmp(a, "--eos") && o->cmd == CMD_GENERATE)
            o->eos_spec = v;
        else if ((!strcmp(a, "--max-new-tokens") || !strcmp(a, "--cache-len")) &&
                 o->cmd == CMD_GENERATE) {
            if (!parse_long(v, 1, 1L << 40, &n))
                return bad("%s needs a count >= 1", a);
            *(a[2] == 'm' ? &o->max_new : &o->cache_len) = n;
        } else if (!strcmp(a, "--temperature") && o->cmd == CMD_GENERATE) {
            if (!parse_double(v, &o->sampling.temperature) || !(o->sampling.temperature > 0))
                return bad("--temperature '%s' is not > 0", v);
            o->sample_set = true;
        } else if (!strcmp(a, "--top-p") && o->cmd == CMD_GENERATE) {
            if (!parse_double(v, &o->sampling.top_p) || !(o->sampling.top_p > 0) ||
                o->sampling.top_p > 1)
                return bad("--top-p '%s' is outside (0, 1]", v);
            o->sample_set = true;
        } else if (!strcmp(a, "--top-k") && o->cmd == CMD_GENERATE) {
            if (!parse_long(v, 0, 1L << 40, &n))
                return bad("--top-k '%s' is not a count >= 0 (0: off)", v);
            o->sampling.top_k = n;
            o->sample_set = true;
        } else if (!strcmp(a, "--seed") && o->cmd == CMD_GENERATE) {
            char *end = NULL;
            errno = 0;
            unsigned long long seed = strtoull(v, &end, 10);
            if (errno || end == v || *end || v[0] == '-')
                return bad("--seed '%s' is not a number >= 0", v);
            o->sampling.seed = seed;
            o->sample_set = true;
        }
        else if (!strcmp(a, "--out") && o->cmd == CMD_LOGITS)
            o->out = v;
        else if (!strcmp(a, "--data") && o->cmd == CMD_TRAIN)
            o->data = v;
        else if (!strcmp(a, "--save") && o->cmd == CMD_TRAIN)
            o->save = v;
        else if (!strcmp(a, "--grads-out") && o->cmd == CMD_TRAIN)
            o->grads_out = v;
        else if (!strcmp(a, "--steps") && o->cmd == CMD_TRAIN) {
            if (!parse_long(v, 0, 1L << 40, &o->steps))
                return bad("--steps '%s' is not a count >= 0", v);
        } else if (!strcmp(a, "--lr") && o->cmd == CMD_TRAIN) {
            if (!parse_double(v, &o->lr) || o->lr < 0)
                return bad("--lr '%s' is not a rate >= 0", v);
        } else if (!strcmp(a, "--weight-decay") && o->cmd == CMD_TRAIN) {
            if (!parse_double(v, &o->weight_decay) || o->weight_decay < 0)
                return bad("--weight-decay '%s' is not >= 0", v);
        } else if (!strcmp(a, "--recompute") && o->cmd == CMD_TRAIN) {
            const char *colon = strchr(v, ':');
            size_t len = colon ? (size_t)(colon - v) : strlen(v);
            if (len == 4 && !strncmp(v, "none", 4))
                o->recompute = TP_RECOMPUTE_NONE;
            else if (len == 4 && !strncmp(v, "full", 4))
                o->recompute = TP_RECOMPUTE_FULL;
            else if (len == 9 && !strncmp(v, "selective", 9))
                o->recompute = TP_RECOMPUTE_SELECTIVE;
            else
                return bad("--recompute '%s': none, full or selective, with :K for every K-th "
                           "block", v);
            o->recompute_every = 1;
            if (colon && !parse_long(colon + 1, 1, 1L << 30, &o->recompute_every))
                return bad("--recompute '%s': K (after ':') is not a count >= 1", v);
        } else if (!strcmp(a, "--max-shard-bytes") && o->cmd == CMD_TRAIN) {
            if (!parse_long(v, 1, 1L << 50, &n))
                return bad("--max-shard-bytes '%s' is not a positive size", v);
            o->max_shard = (size_t)n;
        } else if (!strcmp(a, "--tp") || !strcmp(a, "--dp") || !strcmp(a, "--threads")) {
            if (!parse_long(v, 1, 4096, &n))
                return bad("%s needs a count >= 1", a);
            *(a[2] == 't' && a[3] == 'p' ? &o->tp : a[2] == 'd' ? &o->dp : &o->threads) = (int)n;
        } else if (!strcmp(a, "--backend")) {
            if (strcmp(v, "shm") && strcmp(v, "mpi"))
                return bad("--backend '%s': shm or mpi", v);
            o->mpi = !strcmp(v, "mpi");
        } else if (!strcmp(a, "--device")) {
            if (strcmp(v, "cpu") && strcmp(v, "cuda"))
                return bad("--device '%s': cpu or cuda", v);
            o->cuda = !strcmp(v, "cuda");
        } else if (!strcmp(a, "--dtype")) {
            if (!strcmp(v, "f32"))
                o->dtype = TP_F32;
            else if (!strcmp(v, "bf16"))
                o->dtype = TP_BF16;
            else if (!strcmp(v, "f16"))
                o->dtype = TP_F16;
            else
                return bad("--dtype '%s': f32, bf16 or f16", v);
        } else {
            return bad("unknown option '%s' (tp-llm --help)", a);
        }
    }
    if (!o->model)
        return bad("%s", "--model DIR is required");
    if (o->cmd == CMD_LOGITS && (!o->tokens || !o->out))
        return bad("%s", "logits needs --tokens IDS and --out FILE");
    if (o->cmd == CMD_TRAIN && (!o->data || o->steps < 0))
        return bad("%s", "train needs --data FILE and --steps N");
    if (o->cmd == CMD_GENERATE) {
        if (!o->tokens || !o->max_new)
            return bad("%s", "generate needs --tokens IDS and --max-new-tokens K");
        if (o->greedy && o->sample_set)
            return bad("%s", "--greedy samples nothing: drop --temperature, --top-k, --top-p "
                             "and --seed, or --greedy");
        if (o->dp > 1 || o->sp)
            return bad("%s", "generate takes neither --dp nor --sp (a decode step is one token "
                             "per sequence on the tp ranks)");
    }
    tp_status st = tp_llm_config_load(o->model, &o->cfg);
    if (st == TP_OK && o->cmd == CMD_GENERATE)
        st = tp_llm_generation_config_load(o->model, &o->cfg, &o->gen);
    if (st != TP_OK) {
        fprintf(stderr, "tp-llm: %s\n", tp_last_error());
        return EXIT_BAD;
    }
    if (o->cmd == CMD_GENERATE) {
        int rc = choose_decoding(o);
        if (rc)
            return rc;
    }
    int rc = read_tokens(o, o->cmd == CMD_TRAIN ? o->data : o->tokens, o->cmd == CMD_TRAIN);
    if (rc)
        return rc;
    if (o->cfg.num_attention_heads % o->tp ||
        (o->cfg.num_key_value_heads % o->tp && o->tp % o->cfg.num_key_value_heads)) {
        fprintf(stderr, "tp-llm: --tp %d does not split %lld attention heads and %lld key/value "
                        "heads (tp must divide the attention heads, and divide the kv heads "
                        "or be a multiple of them)\n", o->tp,
                (long long)o->cfg.num_attention_heads, (long long)o->cfg.num_key_value_heads);
        return EXIT_BAD;
    }
    if (o->batch % o->dp) {
        fprintf(stderr, "tp-llm: --dp %d does not divide the batch of %lld sequences\n", o->dp,
                (long long)o->batch);
        return EXIT_BAD;
    }
    if (o->cmd == CMD_TRAIN && o->seq < 2)
        return bad("%s", "train needs sequences of at least 2 tokens");
    if (o->cmd == CMD_GENERATE && o->cache_len && o->seq + o->max_new > o->cache_len) {
        fprintf(stderr, "tp-llm: a prompt of %lld tokens and %ld new ones exceed --cache-len "
                        "%ld\n", (long long)o->seq, o->max_new, o->cache_len);
        return EXIT_BAD;
    }
    if (o->sp && o->seq % o->tp) {
        fprintf(stderr, "tp-llm: --sp shards the %lld-token sequence over --tp %d: it must "
                        "divide it\n", (long long)o->seq, o->tp);
        return EXIT_BAD;
    }
    return 0;
}

/* ---- the ranks ---------------------------------------------------------------------- */

typedef struct {
    options *o;
    int world_rank;
} rank_ctx;

#define TRY(expr)                                                               \
    do {                                                                        \
        st = (expr);                                                            \
        if (st != TP_OK)                                                        \
            goto out;                                                           \
    } while (0)

/* A DTensor's or plain tensor's full value as a plain f32 CPU tensor. */
static tp_status full_f32(tp_tensor *t, tp_tensor **out)
{
    tp_tensor *full = NULL;
    tp_status st = TP_OK;
    if (tp_tensor_is_dtensor(t)) {
        tp_no_grad_begin();
        st = tp_dtensor_full_tensor(t, &full);
        tp_no_grad_end();
    } else {
        full = tp_tensor_retain(t);
    }
    if (st == TP_OK)
        st = tp_tensor_to(full, TP_F32, TP_CPU, out);
    tp_tensor_release(full);
    return st;
}

typedef struct {
    int n, cap;
    char **names;
    tp_tensor **t;
} named_list;

static tp_status collect_grad(const char *fqn, tp_tensor *p, void *ctx)
{
    named_list *l = ctx;
    tp_tensor *g = tp_tensor_grad(p), *full = NULL;
    if (!g)
        return TP_OK; /* a parameter the loss does not reach */
    tp_status st = full_f32(g, &full);
    if (st != TP_OK)
        return st;
    if (l->n == l->cap) {
        int nc = l->cap ? 2 * l->cap : 64;
        char **nn = realloc(l->names, sizeof *nn * (size_t)nc);
        if (nn)
            l->names = nn;
        tp_tensor **nt = nn ? realloc(l->t, sizeof *nt * (size_t)nc) : NULL;
        if (!nt) {
            tp_tensor_release(full);
            return TP_ERR_NO_MEMORY;
        }
        l->t = nt;
        l->cap = nc;
    }
    l->names[l->n] = strdup(fqn);
    l->t[l->n++] = full;
    return l->names[l->n - 1] ? TP_OK : TP_ERR_NO_MEMORY;
}

static void named_list_free(named_list *l)
{
    for (int i = 0; i < l->n; i++) {
        free(l->names[i]);
        tp_tensor_release(l->t[i]);
    }
    free(l->names);
    free(l->t);
}

/* This dp group's rows of the batch, on the device. */
static tp_status local_ids(const options *o, int64_t dp_coord, tp_device dev, tp_tensor **out)
{
    const int64_t rows = o->batch / o->dp, shape[2] = {rows, o->seq};
    tp_tensor *cpu = NULL;
    tp_status st = tp_tensor_from_data(TP_I64, 2, shape, o->ids + dp_coord * rows * o->seq, &cpu);
    if (st != TP_OK || dev.type == TP_DEVICE_CPU) {
        *out = cpu;
        return st;
    }
    st = tp_tensor_to(cpu, TP_I64, dev, out);
    tp_tensor_release(cpu);
    return st;
}

static tp_status add_local_bytes(const char *fqn, tp_tensor *p, void *ctx)
{
    (void)fqn;
    *(size_t *)ctx += tp_tensor_nbytes(tp_tensor_is_dtensor(p) ? tp_dtensor_local(p) : p);
    return TP_OK;
}

static double mib(size_t n)
{
    return (double)n / (1024.0 * 1024.0);
}

/* generate on one rank: every rank generates the same tokens; rank 0
 * prints them and the timings, each rank its memory. */
static tp_status generate_rank(const options *o, tp_module *model, int rank, tp_device dev,
                               tp_tensor *ids)
{
    tp_tensor *mask = NULL, *toks = NULL;
    tp_llm_cache *cache = NULL;
    tp_llm_generate_stats stats;
    const int64_t shape[2] = {o->batch, o->seq};
    const int64_t len = o->cache_len ? o->cache_len : o->seq + o->max_new;
    tp_status st = tp_tensor_from_data(TP_I64, 2, shape, o->mask, &mask);
    if (st == TP_OK)
        st = tp_llm_cache_create(model, o->batch, len, &cache);
    const tp_llm_generate_options go = {.max_new_tokens = o->max_new,
                                        .sampling = o->sampling,
                                        .n_eos = o->n_eos > 0 ? o->n_eos : -1,
                                        .eos_token_ids = o->eos,
                                        .pad_token_id = o->gen.pad_token_id,
                                        .cache = cache};
    if (st == TP_OK)
        st = tp_llm_generate(model, ids, mask, &go, &toks, &stats);
    size_t weights = 0;
    if (st == TP_OK)
        st = tp_module_named_parameters(model, add_local_bytes, &weights);
    if (st == TP_OK && rank == 0) {
        const int64_t T = tp_tensor_size(toks, 1);
        const int64_t *d = tp_tensor_data(toks);
        for (int64_t b = 0; b < o->batch; b++) {
            for (int64_t t = 0; t < T; t++) {
                printf("%s%lld", t ? "," : "", (long long)d[b * T + t]);
                bool end = false;
                for (int i = 0; i < o->n_eos; i++)
                    end |= d[b * T + t] == o->eos[i];
                if (end)
                    break;
            }
            printf("\n");
        }
        fflush(stdout);
        const double tok_s = stats.decode_s > 0
                                 ? (double)(o->batch * stats.decode_steps) / stats.decode_s
                                 : 0;
        tp_memory_info mi;
        tp_memory_stats(dev, &mi);
        fprintf(stderr,
                "tp-llm: %lld sequences, %lld new tokens each at most: time to first token "
                "%.2f ms, decode %.1f tokens/s (%lld steps), per-token latency median %.3f ms, "
                "p99 %.3f ms\n"
                "tp-llm: peak memory %.1f MiB (%s)\n",
                (long long)o->batch, (long long)o->max_new, stats.prefill_s * 1e3, tok_s,
                (long long)stats.decode_steps, stats.step_p50_s * 1e3, stats.step_p99_s * 1e3,
                mib(mi.peak_allocated),
                o->mpi ? "this process: rank 0"
                       : o->tp > 1 ? "the process: every rank, as threads of it" : "rank 0");
    }
    if (st == TP_OK)
        fprintf(stderr, "tp-llm: rank %d holds %.3f MiB of weights and a %.3f MiB KV cache\n",
                rank, mib(weights), mib(stats.cache_bytes));
    tp_tensor_release(toks);
    tp_tensor_release(mask);
    tp_llm_cache_free(cache);
    return st;
}

static tp_status run_rank(tp_comm *world, void *arg)
{
    rank_ctx *rc = arg;
    options *o = rc->o;
    const int rank = tp_comm_rank(world);
    tp_status st = TP_OK;
    tp_mesh *mesh = NULL, *tpm = NULL;
    tp_module *model = NULL;
    tp_llm_plan *plan = NULL;
    tp_ddp *ddp = NULL;
    tp_adam *adam = NULL;
    tp_tensor *ids = NULL, *ids_cpu = NULL, *logits = NULL, *full = NULL, *gathered = NULL,
              *loss = NULL;
    named_list grads = {0};
    tp_device dev = TP_CPU;
    if (o->cuda) {
        int n = tp_cuda_device_count();
        if (n <= 0) {
            st = TP_ERR_NOT_SUPPORTED;
            fprintf(stderr, "tp-llm: --device cuda: no CUDA device\n");
            goto out;
        }
        dev = TP_CUDA(rank % n);
    }
    const char *names[2] = {"dp", "tp"};
    const int64_t shape[2] = {o->dp, o->tp};
    TRY(tp_mesh_create(world, 2, shape, names, &mesh));
    TRY(tp_mesh_slice(mesh, 1, (const char *[]){"tp"}, &tpm));
    const int64_t dp_coord = tp_mesh_coord(mesh, 0);
    if (o->cuda)
        TRY(tp_nn_set_default_device(dev));
    TRY(tp_llm_create(&o->cfg, &model));
    if (o->dtype != TP_F32)
        TRY(tp_module_to_dtype(model, o->dtype));
    const tp_llm_plan_options po = {.sequence_parallel = o->sp};
    TRY(tp_llm_plan_create(&po, &plan));
    const tp_parallelize_options par = {.src_data_rank = TP_SRC_DATA_RANK_NONE};
    TRY(tp_llm_parallelize(model, tpm, tp_llm_plan_size(plan), tp_llm_plan_entries(plan),
                           &par));
    TRY(tp_llm_load(model, o->model));
    TRY(local_ids(o, dp_coord, dev, &ids));
    TRY(local_ids(o, dp_coord, TP_CPU, &ids_cpu));

    if (o->cmd == CMD_GENERATE) {
        TRY(generate_rank(o, model, rank, dev, ids_cpu));
        goto out;
    }
    if (o->cmd == CMD_LOGITS) {
        tp_no_grad_begin();
        st = tp_llm_forward(model, ids, NULL, NULL, &logits);
        tp_no_grad_end();
        TRY(st);
        TRY(full_f32(logits, &full));
        const int64_t gshape[3] = {o->batch, o->seq, o->cfg.vocab_size};
        TRY(tp_tensor_empty(TP_F32, TP_CPU, 3, gshape, &gathered));
        if (o->dp > 1)
            TRY(tp_all_gather(tp_mesh_comm(mesh, 0), full, gathered, NULL));
        else
            TRY(tp_tensor_copy(gathered, full));
        if (rank == 0) {
            const char *nm = "logits";
            TRY(tp_safetensors_write(o->out, 1, &nm, &gathered));
        }
        goto out;
    }

    if (o->recompute != TP_RECOMPUTE_NONE)
        TRY(tp_module_set_recompute_every(tp_module_find(model, "model.layers"),
                                          (int)o->recompute_every, o->recompute));
    if (o->fsdp) {
        TRY(tp_llm_fully_shard(model, mesh, NULL));
    } else if (o->dp > 1) {
        const tp_ddp_options dopts = {.params_everywhere = true};
        TRY(tp_ddp_create(model, tp_mesh_comm(mesh, 0), &dopts, &ddp));
    }
    const tp_adam_options ao = {.lr = o->lr, .weight_decay = o->weight_decay, .decoupled = true};
    TRY(tp_adam_create_with(model, &ao, &adam));
    TRY(tp_adam_set_lr(adam, o->lr)); /* options take 0 as "the default" */
    for (long step = 0; step < o->steps; step++) {
        tp_module_zero_grad(model);
        TRY(tp_llm_forward(model, ids, NULL, NULL, &logits));
        TRY(tp_llm_loss(logits, ids_cpu, &loss));
        TRY(full_f32(loss, &full));
        if (o->dp > 1)
            TRY(tp_all_reduce(tp_mesh_comm(mesh, 0), full, full, TP_AVG, NULL));
        if (rank == 0) {
            printf("step %ld loss %.6f\n", step, (double)*(const float *)tp_tensor_data(full));
            fflush(stdout);
        }
        tp_tensor_release(full);
        full = NULL;
        TRY(tp_backward(loss, NULL));
        tp_tensor_release(loss);
        tp_tensor_release(logits);
        loss = logits = NULL;
        if (step == 0 && o->grads_out) {
            if (ddp)
                TRY(tp_ddp_sync(ddp));
            TRY(tp_module_named_parameters(model, collect_grad, &grads));
            if (rank == 0)
                TRY(tp_safetensors_write(o->grads_out, grads.n, (const char *const *)grads.names,
                                         grads.t));
        }
        TRY(tp_adam_step(adam));
    }
    if (o->save) {
        /* the dp groups hold the same weights: the first one saves */
        if (dp_coord == 0)
            TRY(tp_llm_save(model, o->save, o->max_shard));
    }
out:
    if (st != TP_OK && tp_last_error()[0])
        fprintf(stderr, "tp-llm: rank %d: %s\n", rank, tp_last_error());
    named_list_free(&grads);
    tp_tensor_release(loss);
    tp_tensor_release(gathered);
    tp_tensor_release(full);
    tp_tensor_release(logits);
    tp_tensor_release(ids_cpu);
    tp_tensor_release(ids);
    tp_adam_free(adam);
    tp_ddp_free(ddp);
    tp_llm_plan_free(plan);
    tp_module_free(model);
    tp_mesh_free(tpm);
    tp_mesh_free(mesh);
    if (st != TP_OK && o->mpi)
        tp_comm_abort(world, "tp-llm: a rank failed");
    return st;
}

int main(int argc, char **argv)
{
    options o;
    int rc = parse_args(argc, argv, &o);
    if (rc) {
        free(o.ids);
        free(o.mask);
        return rc;
    }
    if (o.threads)
        openblas_set_num_threads(o.threads);
    rank_ctx ctx = {&o, 0};
    tp_status st;
    if (o.mpi) {
        tp_comm *world = NULL;
        st = tp_comm_create_world("mpi", NULL, &world);
        if (st == TP_OK && tp_comm_size(world) != o.tp * o.dp) {
            fprintf(stderr, "tp-llm: mpirun started %d processes; --tp %d x --dp %d needs %d\n",
                    tp_comm_size(world), o.tp, o.dp, o.tp * o.dp);
            st = TP_ERR_INVALID_ARG;
        } else if (st == TP_OK) {
            st = run_rank(world, &ctx);
        } else {
            fprintf(stderr, "tp-llm: %s\n", tp_last_error());
        }
        tp_comm_free(world);
    } else {
        st = tp_run_local(o.tp * o.dp, run_rank, &ctx);
    }
    free(o.ids);
    free(o.mask);
    if (st == TP_OK)
        return 0;
    return st == TP_ERR_INVALID_ARG || st == TP_ERR_NOT_SUPPORTED || st == TP_ERR_MISMATCH
               ? EXIT_BAD
               : 1;
}
