/*
 * tp-plan: predicts a tensor- and data-parallel training step of a
 * Llama-shaped transformer on hardware that need not be at hand. It plays
 * one rank of the dp x tp world on meta tensors (docs/sim.md), records the
 * step's kernels and collectives (tp/plan.h) and walks them with a hardware
 * description (tp/hw.h): per-rank memory, collectives per step, step time
 * split into compute and exposed communication, tokens/s and MFU, as a table
 * or as JSON; --sweep tries every TP degree and SP choice that fits in memory
 * and ranks them; --trace writes the step as a Chrome trace-event file.
 * --config plans a Hugging Face config.json's model instead (src/models).
 * Usage: tp-plan --help; docs/plan.md.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "plan_model.h"

/* The size options, in parse_args' table order: bits of opts.given. */
enum { G_LAYERS, G_HIDDEN, G_FFN, G_HEADS, G_VOCAB, G_KV_HEADS };

typedef struct opts {
    plan_cfg cfg;
    const char *hw, *trace;
    const char *config;      /* --config: a Hugging Face config.json, or NULL */
    tp_llm_config llm;       /* its model, once read (cfg.llm points here) */
    int64_t kv_heads;        /* --kv-heads (with --config only) */
    unsigned given;          /* 1 << G_*: the size options given */
    bool dtype_given;        /* --dtype given (with --config: over the config's) */
    double memory_gib;       /* --memory-gib; 0: not given */
    double memory_limit;     /* bytes a rank may hold: --memory-gib, else the hardware's */
    const char *memory_from; /* where memory_limit came from, for the output */
    bool json, sweep, reshard_given;
} opts;

/* One evaluated configuration. */
typedef struct plan_eval {
    plan_cfg cfg;
    tp_plan_result r;
    int64_t params, params_total; /* this rank's parameter elements, the model's */
    uint64_t mem_bytes;
    bool mem_measured; /* from the meta accounting, else the estimate */
    double tokens_per_s;
    bool fits;
} plan_eval;

static const char usage[] =
    "usage: tp-plan [--config FILE] [--layers N] [--hidden N] [--ffn N] [--heads N]\n"
    "               [--kv-heads N] [--vocab N] [--seq N] [--batch N] [--dtype f32|bf16|f16]\n"
    "               [--mesh dp=D,tp=T] [--sp|--no-sp] [--loss-parallel] [--hw PRESET|FILE]\n"
    "               [--ac none|selective|full[:K]] [--fsdp [--reshard-after-forward on|off]]\n"
    "               [--memory-gib G] [--rank R] [--json] [--sweep] [--trace FILE]\n";

static const char help[] =
    "\n"
    "Predicts one training step (forward, backward, DDP over dp, Adam) of one rank of a\n"
    "dp x tp world on HARDWARE: memory per rank, collectives, step time, tokens/s, MFU.\n"
    "  --config FILE     a Hugging Face config.json (Llama, Mistral, Qwen2; or a model\n"
    "                    directory) planned as libtp builds it: kv heads, SwiGLU, vocabulary\n"
    "                    and tied embeddings the config's, the standard TP plan. --layers,\n"
    "                    --hidden, --ffn, --heads, --kv-heads and --vocab given with it\n"
    "                    override its values, --dtype its dtype (the default)\n"
    "  without --config  a Llama-shaped decoder of the size options (gated GELU MLP, one kv\n"
    "                    head per head; no vocabulary unless --vocab): 80 layers, hidden\n"
    "                    8192, ffn 28672, 64 heads, vocab 0 unless given\n"
    "  --seq 4096 --batch 1 --dtype bf16 --mesh dp=64,tp=8 --sp --hw h100-sxm-ndr --rank 0\n"
    "                    the defaults of the others\n"
    "  --ac MODE[:K]     activation recomputation of the blocks (every K-th with :K):\n"
    "                    none (default), selective (keeps GEMM and collective outputs),\n"
    "                    full (keeps each block's input)\n"
    "  --fsdp            fully sharded data parallel over dp (each block a unit, then the\n"
    "                    root; tp_fully_shard) instead of DDP; --reshard-after-forward off\n"
    "                    keeps a unit's gathered parameters from forward to backward\n"
    "  --memory-gib G    the memory a rank may use (default: the --hw description's\n"
    "                    memory_bytes, else 80)\n"
    "  --sweep           every power-of-two TP degree, with and without SP, DDP or FSDP,\n"
    "                    with each --ac mode, at dp x tp ranks\n"
    "  --json            the output as JSON; --trace FILE: the step as a Chrome trace\n"
    "docs/plan.md describes the model, the hardware files and the output.\n";

static int fail(const char *fmt, const char *what)
{
    fprintf(stderr, "tp-plan: ");
    fprintf(stderr, fmt, what);
    fprintf(stderr, "\n%s", usage);
    return 2;
}

static bool parse_i64(const char *s, int64_t *v)
{
    char *end;
    errno = 0;
    long long x = strtoll(s, &end, 10);
    if (errno || end == s || *end)
        return false;
    *v = x;
    return true;
}

/* "dp=16,tp=8" (either may be left out: 1) */
static int parse_mesh(const char *s, plan_cfg *c)
{
    char buf[128];
    snprintf(buf, sizeof buf, "%s", s);
    c->dp = c->tp = 1;
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok;
         tok = strtok_r(NULL, ",", &save)) {
        char *eq = strchr(tok, '=');
        if (!eq)
            return fail("--mesh: \"%s\" is not NAME=SIZE", tok);
        *eq = 0;
        int64_t *dst = strcmp(tok, "dp") == 0 ? &c->dp : strcmp(tok, "tp") == 0 ? &c->tp : NULL;
        if (!dst)
            return fail("--mesh: unknown dim \"%s\" (dims: dp, tp)", tok);
        if (!parse_i64(eq + 1, dst))
            return fail("--mesh: the size of %s is not an integer", tok);
    }
    return 0;
}

/* "none", "selective" or "full", with ":K" for every K-th block */
static int parse_ac(const char *s, plan_cfg *c)
{
    const char *colon = strchr(s, ':');
    size_t len = colon ? (size_t)(colon - s) : strlen(s);
    static const struct {
        const char *name;
        tp_recompute_mode mode;
    } modes[] = {{"none", TP_RECOMPUTE_NONE},
                 {"selective", TP_RECOMPUTE_SELECTIVE},
                 {"full", TP_RECOMPUTE_FULL}};
    size_t i = 0;
    while (i < 3 && (strlen(modes[i].name) != len || strncmp(s, modes[i].name, len)))
        i++;
    if (i == 3)
        return fail("--ac: \"%s\" is not none, selective or full (with :K for every K-th "
                    "block)", s);
    c->ac = modes[i].mode;
    c->ac_every = 1;
    if (colon && (!parse_i64(colon + 1, &c->ac_every) || c->ac_every < 1))
        return fail("--ac: K in \"%s\" is not a count >= 1", s);
    return 0;
}

static const char *ac_name(tp_recompute_mode m)
{
    return m == TP_RECOMPUTE_FULL ? "full" : m == TP_RECOMPUTE_SELECTIVE ? "selective" : "none";
}

static int parse_dtype(const char *s, tp_dtype *d)
{
    static const tp_dtype ok[] = {TP_F32, TP_BF16, TP_F16};
    for (size_t i = 0; i < 3; i++)
        if (strcmp(s, tp_dtype_name(ok[i])) == 0) {
            *d = ok[i];
            return 0;
        }
    return fail("--dtype: unknown dtype \"%s\" (f32, bf16, f16)", s);
}

static int parse_flag(opts *o, const char *a)
{
    if (strcmp(a, "--json") == 0)
        o->json = true;
    else if (strcmp(a, "--sweep") == 0)
        o->sweep = true;
    else if (strcmp(a, "--sp") == 0)
        o->cfg.sp = true;
    else if (strcmp(a, "--no-sp") == 0)
        o->cfg.sp = false;
    else if (strcmp(a, "--loss-parallel") == 0)
        o->cfg.loss_parallel = true;
    else if (strcmp(a, "--fsdp") == 0)
        o->cfg.fsdp = true;
    else
        return -1;
    return 0;
}

/* --config: the file's model with the size options given over its values,
 * then checked again as the library checks a config.json (written out and
 * read back), so that an override is refused as the file's key would be. */
static int load_config(opts *o)
{
    tp_llm_config *m = &o->llm;
    plan_cfg *c = &o->cfg;
    if (tp_llm_config_load(o->config, m) != TP_OK)
        return fail("--config: %s", tp_last_error());
    const bool default_hd = m->head_dim * m->num_attention_heads == m->hidden_size,
               mha = m->num_key_value_heads == m->num_attention_heads;
    const struct {
        int bit;
        int64_t *dst, v;
    } over[] = {{G_LAYERS, &m->num_hidden_layers, c->layers},
                {G_HIDDEN, &m->hidden_size, c->hidden},
                {G_FFN, &m->intermediate_size, c->ffn},
                {G_HEADS, &m->num_attention_heads, c->heads},
                {G_VOCAB, &m->vocab_size, c->vocab},
                {G_KV_HEADS, &m->num_key_value_heads, o->kv_heads}};
    for (size_t i = 0; i < sizeof over / sizeof *over; i++)
        if (o->given & 1u << over[i].bit)
            *over[i].dst = over[i].v;
    /* new heads keep a config without grouping so, and a head_dim that was
     * hidden / heads stays that */
    if (mha && (o->given & 1u << G_HEADS) && !(o->given & 1u << G_KV_HEADS))
        m->num_key_value_heads = m->num_attention_heads;
    if (default_hd && (o->given & (1u << G_HIDDEN | 1u << G_HEADS)) &&
        m->num_attention_heads > 0 && m->hidden_size % m->num_attention_heads == 0)
        m->head_dim = m->hidden_size / m->num_attention_heads;
    if (o->given) {
        char *text = NULL;
        tp_status st = tp_llm_config_to_json(m, &text);
        if (st == TP_OK)
            st = tp_llm_config_parse(text, m);
        free(text);
        if (st != TP_OK)
            return fail("--config with the size options: %s", tp_last_error());
    }
    c->layers = m->num_hidden_layers;
    c->hidden = m->hidden_size;
    c->ffn = m->intermediate_size;
    c->heads = m->num_attention_heads;
    c->vocab = m->vocab_size;
    if (!o->dtype_given)
        c->dtype = m->dtype;
    c->llm = m;
    return 0;
}

static int parse_args(int argc, char **argv, opts *o)
{
    plan_cfg *c = &o->cfg;
    const struct {
        const char *flag;
        int64_t *v;
    } ints[] = {[G_LAYERS] = {"--layers", &c->layers},
                [G_HIDDEN] = {"--hidden", &c->hidden},
                [G_FFN] = {"--ffn", &c->ffn},
                [G_HEADS] = {"--heads", &c->heads},
                [G_VOCAB] = {"--vocab", &c->vocab},
                [G_KV_HEADS] = {"--kv-heads", &o->kv_heads},
                {"--seq", &c->seq},
                {"--batch", &c->batch},
                {"--rank", &c->rank}};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            printf("%s%s", usage, help);
            exit(0);
        }
        if (parse_flag(o, a) == 0)
            continue;
        if (i + 1 == argc)
            return fail("%s: unknown option, or it needs a value", a);
        const char *v = argv[++i];
        size_t k = 0;
        while (k < sizeof ints / sizeof *ints && strcmp(a, ints[k].flag) != 0)
            k++;
        int rc = 0;
        if (k < sizeof ints / sizeof *ints) {
            if (!parse_i64(v, ints[k].v))
                return fail("%s: not an integer", a);
            if (k <= G_KV_HEADS)
                o->given |= 1u << k;
        } else if (strcmp(a, "--config") == 0) {
            o->config = v;
        } else if (strcmp(a, "--mesh") == 0) {
            rc = parse_mesh(v, c);
        } else if (strcmp(a, "--ac") == 0) {
            rc = parse_ac(v, c);
        } else if (strcmp(a, "--reshard-after-forward") == 0) {
            if (strcmp(v, "on") && strcmp(v, "off"))
                return fail("--reshard-after-forward: \"%s\" is not on or off", v);
            c->keep_after_forward = strcmp(v, "off") == 0;
            o->reshard_given = true;
        } else if (strcmp(a, "--dtype") == 0) {
            rc = parse_dtype(v, &c->dtype);
            o->dtype_given = true;
        } else if (strcmp(a, "--hw") == 0) {
            o->hw = v;
        } else if (strcmp(a, "--trace") == 0) {
            o->trace = v;
        } else if (strcmp(a, "--memory-gib") == 0) {
            char *end;
            o->memory_gib = strtod(v, &end);
            if (end == v || *end || !(o->memory_gib > 0))
                return fail("--memory-gib: \"%s\" is not a number > 0", v);
        } else {
            return fail("%s: unknown option", a);
        }
        if (rc)
            return rc;
    }
    if (o->config) {
        int rc = load_config(o);
        if (rc)
            return rc;
    } else if (o->given & 1u << G_KV_HEADS) {
        return fail("%s: needs --config (the built-in decoder has a kv head per head)",
                    "--kv-heads");
    }
    if (o->reshard_given && !c->fsdp)
        return fail("%s: needs --fsdp", "--reshard-after-forward");
    const char *bad = plan_cfg_check(c);
    if (bad)
        return fail("invalid configuration: %s", bad);
    return 0;
}

static tp_status load_hw(const char *name, tp_hw **out)
{
    if (access(name, R_OK) == 0 || strchr(name, '/') || strstr(name, ".json"))
        return tp_hw_load_file(name, out);
    return tp_hw_preset(name, out);
}

/* The bytes a rank may hold: --memory-gib, else the hardware description's
 * memory_bytes, else 80 GiB (an 80 GB part), saying which. */
static void set_memory_limit(opts *o, const tp_hw *hw)
{
    const double gib = 1024.0 * 1024.0 * 1024.0;
    static char from[160];
    if (o->memory_gib > 0) {
        o->memory_limit = o->memory_gib * gib;
        o->memory_from = "--memory-gib";
    } else if (tp_hw_memory_bytes(hw) > 0) {
        o->memory_limit = tp_hw_memory_bytes(hw);
        snprintf(from, sizeof from, "%s's memory_bytes", tp_hw_name(hw));
        o->memory_from = from;
    } else {
        o->memory_limit = 80 * gib;
        snprintf(from, sizeof from, "default: %s gives no memory_bytes", tp_hw_name(hw));
        o->memory_from = from;
    }
}

/* Per-rank bytes: the meta device's peak where it reports one, else
 * parameters, gradients and Adam's two f32 moments (and f32 master weights
 * for 16-bit parameters); activations are then not counted. */
static void plan_memory(const plan_step *s, tp_dtype dtype, plan_eval *e)
{
    uint64_t n = (uint64_t)s->params;
    e->params = s->params;
    e->mem_measured = s->peak_bytes > 0;
    e->mem_bytes = e->mem_measured ? s->peak_bytes
                                   : 2 * s->param_bytes + 8 * n + (dtype != TP_F32 ? 4 * n : 0);
}

static tp_status evaluate(const plan_cfg *c, const tp_hw *hw, double mem_limit, const char *trace,
                          plan_eval *e)
{
    plan_step s;
    *e = (plan_eval){.cfg = *c};
    tp_status st = plan_run_step(c, &s);
    if (st != TP_OK)
        return st;
    st = tp_plan_walk(s.trace, hw, &e->r);
    if (st == TP_OK && trace) {
        FILE *f = fopen(trace, "w");
        st = f ? tp_plan_write_chrome_trace(s.trace, hw, c->rank, f) : TP_ERR_BACKEND;
        if (!f)
            fprintf(stderr, "tp-plan: cannot write %s: %s\n", trace, strerror(errno));
        if (f && fclose(f) != 0)
            st = TP_ERR_BACKEND;
    }
    plan_memory(&s, c->dtype, e);
    e->params_total = s.params_total;
    e->fits = (double)e->mem_bytes <= mem_limit;
    e->tokens_per_s = e->r.step_s > 0 ? (double)(c->dp * c->batch * c->seq) / e->r.step_s : 0;
    plan_step_free(&s);
    return st;
}

static const char *style_name(const plan_cfg *c)
{
    static _Thread_local char buf[64];
    const char *tp = c->sp ? (c->loss_parallel ? "TP+SP+loss" : "TP+SP")
                           : (c->loss_parallel ? "TP+loss" : "TP");
    int n = snprintf(buf, sizeof buf, "%s%s",
                     !c->fsdp ? "" : c->keep_after_forward ? "FSDP(keep)+" : "FSDP+", tp);
    if (c->ac != TP_RECOMPUTE_NONE && c->ac_every > 1)
        snprintf(buf + n, sizeof buf - (size_t)n, "+AC(%s:%lld)", ac_name(c->ac),
                 (long long)c->ac_every);
    else if (c->ac != TP_RECOMPUTE_NONE)
        snprintf(buf + n, sizeof buf - (size_t)n, "+AC(%s)", ac_name(c->ac));
    return buf;
}

static void print_table(const opts *o, const tp_hw *hw, const plan_eval *e)
{
    const plan_cfg *c = &e->cfg;
    const double gib = 1024.0 * 1024.0 * 1024.0, mib = 1024.0 * 1024.0;
    const tp_llm_config *m = c->llm;
    if (m)
        printf("model: %s (%s): %lld layers, hidden %lld, SwiGLU intermediate %lld, heads %lld, "
               "kv heads %lld, head_dim %lld, vocab %lld%s, seq %lld, batch %lld, %s\n",
               o->config, tp_llm_arch_name(m->arch), (long long)m->num_hidden_layers,
               (long long)m->hidden_size, (long long)m->intermediate_size,
               (long long)m->num_attention_heads, (long long)m->num_key_value_heads,
               (long long)m->head_dim, (long long)m->vocab_size,
               m->tie_word_embeddings ? " (tied embeddings)" : "", (long long)c->seq,
               (long long)c->batch, tp_dtype_name(c->dtype));
    else
        printf("model: %lld layers, hidden %lld, ffn %lld, heads %lld, vocab %lld, seq %lld, "
               "batch %lld, %s\n",
               (long long)c->layers, (long long)c->hidden, (long long)c->ffn, (long long)c->heads,
               (long long)c->vocab, (long long)c->seq, (long long)c->batch,
               tp_dtype_name(c->dtype));
    printf("mesh: dp=%lld,tp=%lld (%lld ranks), %s, hardware %s, rank %lld\n", (long long)c->dp,
           (long long)c->tp, (long long)(c->dp * c->tp), style_name(c), tp_hw_name(hw),
           (long long)c->rank);
    printf("memory per rank: %.2f GiB (%s), %lld parameter elements (of %lld in the model); "
           "%s %.2f GiB (%s)\n",
           (double)e->mem_bytes / gib,
           e->mem_measured ? "meta peak" : "params+grads+Adam, no activations",
           (long long)e->params, (long long)e->params_total,
           e->fits ? "fits in" : "does NOT fit in", o->memory_limit / gib, o->memory_from);
    printf("%-15s %8s %14s %12s\n", "collective", "count", "MiB", "time_s");
    for (int k = 0; k < TP_COLL_KIND_COUNT; k++)
        if (e->r.coll_count[k])
            printf("%-15s %8lld %14.3f %12.6f\n", tp_coll_kind_name((tp_coll_kind)k),
                   (long long)e->r.coll_count[k], (double)e->r.coll_bytes[k] / mib, e->r.coll_s[k]);
    printf("step time %.6f s = compute %.6f s + exposed communication %.6f s "
           "(communication %.6f s in all)\n",
           e->r.step_s, e->r.compute_s, e->r.exposed_comm_s, e->r.comm_s);
    printf("compute by phase: forward %.6f s, backward %.6f s, optimizer %.6f s", e->r.phase_s[0],
           e->r.phase_s[1], e->r.phase_s[2]);
    if (e->r.phase_s[TP_PLAN_RECOMPUTE] > 0)
        printf(", recompute %.6f s", e->r.phase_s[TP_PLAN_RECOMPUTE]);
    printf("\n");
    printf("tokens/s %.1f (%.1f per device), MFU %.1f%%\n", e->tokens_per_s,
           e->tokens_per_s / (double)(c->dp * c->tp), 100.0 * e->r.mfu);
}

static void print_json_eval(const plan_eval *e)
{
    const plan_cfg *c = &e->cfg;
    printf("{\"dp\": %lld, \"tp\": %lld, \"sp\": %s, \"loss_parallel\": %s, \"ac\": \"%s\", "
           "\"ac_every\": %lld, \"fsdp\": %s, \"reshard_after_forward\": %s, \"rank\": %lld, "
           "\"memory_bytes\": %llu, \"memory_measured\": %s, \"fits\": %s, \"params\": %lld, "
           "\"params_total\": %lld, \"step_s\": %.9g, \"compute_s\": %.9g, "
           "\"exposed_comm_s\": %.9g, \"comm_s\": %.9g, \"tokens_per_s\": %.9g, \"mfu\": %.9g, "
           "\"collectives\": {",
           (long long)c->dp, (long long)c->tp, c->sp ? "true" : "false",
           c->loss_parallel ? "true" : "false", ac_name(c->ac),
           (long long)(c->ac_every > 1 ? c->ac_every : 1), c->fsdp ? "true" : "false",
           c->fsdp && !c->keep_after_forward ? "true" : "false", (long long)c->rank,
           (unsigned long long)e->mem_bytes, e->mem_measured ? "true" : "false",
           e->fits ? "true" : "false", (long long)e->params, (long long)e->params_total,
           e->r.step_s, e->r.compute_s, e->r.exposed_comm_s, e->r.comm_s, e->tokens_per_s,
           e->r.mfu);
    const char *sep = "";
    for (int k = 0; k < TP_COLL_KIND_COUNT; k++)
        if (e->r.coll_count[k]) {
            printf("%s\"%s\": {\"count\": %lld, \"bytes\": %llu, \"time_s\": %.9g}", sep,
                   tp_coll_kind_name((tp_coll_kind)k), (long long)e->r.coll_count[k],
                   (unsigned long long)e->r.coll_bytes[k], e->r.coll_s[k]);
            sep = ", ";
        }
    printf("}}");
}

/* s as a JSON string (a path or a name from a file may hold anything). */
static void print_json_str(const char *s)
{
    putchar('"');
    for (; *s; s++) {
        unsigned char ch = (unsigned char)*s;
        if (ch == '"' || ch == '\\')
            printf("\\%c", ch);
        else if (ch < 0x20)
            printf("\\u%04x", ch);
        else
            putchar(ch);
    }
    putchar('"');
}

static void print_json(const opts *o, const tp_hw *hw, const plan_eval *e, int n)
{
    const plan_cfg *c = &o->cfg;
    const tp_llm_config *m = c->llm;
    printf("{\"hardware\": ");
    print_json_str(tp_hw_name(hw));
    printf(", \"model\": {");
    if (m) {
        printf("\"config\": ");
        print_json_str(o->config);
        printf(", \"arch\": \"%s\", \"kv_heads\": %lld, \"head_dim\": %lld, "
               "\"tie_word_embeddings\": %s, ",
               tp_llm_arch_name(m->arch), (long long)m->num_key_value_heads,
               (long long)m->head_dim, m->tie_word_embeddings ? "true" : "false");
    }
    printf("\"layers\": %lld, \"hidden\": %lld, \"ffn\": %lld, \"heads\": %lld, \"vocab\": %lld, "
           "\"seq\": %lld, \"batch\": %lld, \"dtype\": \"%s\"}, \"memory_limit_bytes\": %.0f, "
           "\"memory_limit_from\": ",
           (long long)c->layers, (long long)c->hidden, (long long)c->ffn, (long long)c->heads,
           (long long)c->vocab, (long long)c->seq, (long long)c->batch, tp_dtype_name(c->dtype),
           o->memory_limit);
    print_json_str(o->memory_from);
    printf(", \"%s\": ", o->sweep ? "sweep" : "plan");
    if (o->sweep)
        printf("[");
    for (int i = 0; i < n; i++) {
        printf(i ? ",\n  " : "\n  ");
        print_json_eval(&e[i]);
    }
    printf(o->sweep ? "]}\n" : "}\n");
}

static int by_throughput(const void *a, const void *b)
{
    const plan_eval *x = a, *y = b;
    if (x->fits != y->fits)
        return x->fits ? -1 : 1;
    return (x->tokens_per_s < y->tokens_per_s) - (x->tokens_per_s > y->tokens_per_s);
}

/* Every TP degree (powers of two dividing the world, up to 64) and SP
 * choice that the configuration allows, best tokens/s first. */
static int sweep(const opts *o, const tp_hw *hw)
{
    int64_t world = o->cfg.dp * o->cfg.tp;
    static const tp_recompute_mode acs[] = {TP_RECOMPUTE_NONE, TP_RECOMPUTE_SELECTIVE,
                                            TP_RECOMPUTE_FULL};
    plan_eval e[128];
    int n = 0;
    for (int64_t t = 1; t <= world && t <= 64; t *= 2)
        for (int sp = 0; sp < (t > 1 ? 2 : 1) && world % t == 0; sp++)
            for (int fsdp = 0; fsdp < (world / t > 1 ? 2 : 1); fsdp++)
                for (int a = 0; a < 3; a++) {
                    plan_cfg c = o->cfg;
                    c.tp = t;
                    c.dp = world / t;
                    c.sp = sp;
                    c.fsdp = fsdp;
                    c.ac = acs[a];
                    c.ac_every = 1;
                    c.rank = 0;
                    if (plan_cfg_check(&c))
                        continue;
                    if (evaluate(&c, hw, o->memory_limit, NULL, &e[n]) != TP_OK)
                        return fprintf(stderr, "tp-plan: %s\n", tp_last_error()), 1;
                    n++;
                }
    if (!n)
        return fprintf(stderr, "tp-plan: --sweep: no TP degree fits the configuration\n"), 1;
    qsort(e, (size_t)n, sizeof *e, by_throughput);
    if (o->trace && evaluate(&e[0].cfg, hw, o->memory_limit, o->trace, &e[0]) != TP_OK)
        return fprintf(stderr, "tp-plan: --trace: %s\n", tp_last_error()), 1;
    if (o->json) {
        print_json(o, hw, e, n);
        return 0;
    }
    printf("%-4s %-5s %-6s %-22s %-10s %-12s %-8s %s\n", "rank", "dp", "tp", "style", "mem_GiB",
           "step_s", "MFU_%", "tokens/s");
    for (int i = 0; i < n; i++)
        printf("%-4d %-5lld %-6lld %-22s %-10.2f %-12.6f %-8.1f %.1f%s\n", i + 1,
               (long long)e[i].cfg.dp, (long long)e[i].cfg.tp, style_name(&e[i].cfg),
               (double)e[i].mem_bytes / (1024.0 * 1024.0 * 1024.0), e[i].r.step_s,
               100.0 * e[i].r.mfu, e[i].tokens_per_s, e[i].fits ? "" : "  (does not fit)");
    return e[0].fits ? 0 : 1;
}

int main(int argc, char **argv)
{
    opts o = {.cfg = {.layers = 80,
                      .hidden = 8192,
                      .ffn = 28672,
                      .heads = 64,
                      .vocab = 0,
                      .seq = 4096,
                      .batch = 1,
                      .dtype = TP_BF16,
                      .dp = 64,
                      .tp = 8,
                      .sp = true},
              .hw = "h100-sxm-ndr"};
    int rc = parse_args(argc, argv, &o);
    if (rc)
        return rc;
    tp_hw *hw = NULL;
    if (load_hw(o.hw, &hw) != TP_OK) {
        fprintf(stderr, "tp-plan: --hw: %s\n", tp_last_error());
        return 2;
    }
    set_memory_limit(&o, hw);
    if (o.sweep) {
        rc = sweep(&o, hw);
    } else {
        plan_eval e;
        if (evaluate(&o.cfg, hw, o.memory_limit, o.trace, &e) != TP_OK) {
            fprintf(stderr, "tp-plan: %s\n", tp_last_error());
            rc = 1;
        } else if (o.json) {
            print_json(&o, hw, &e, 1);
        } else {
            print_table(&o, hw, &e);
        }
    }
    tp_hw_free(hw);
    return rc;
}
