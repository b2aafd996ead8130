/* config.json of the Llama family, in the transformers 4.x and 5.x forms: what
 * changes the numbers is read or refused by name; the rest is ignored. */
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "core/base.h"
#include "tp/models.h"

#define FN "tp_llm_config_parse"

static const struct {
    const char *arch, *model_type;
    int64_t max_pos; /* the config class's default max_position_embeddings */
} arch_rows[] = {
    [TP_LLM_LLAMA] = {"LlamaForCausalLM", "llama", 2048},
    [TP_LLM_MISTRAL] = {"MistralForCausalLM", "mistral", 4096 * 32},
    [TP_LLM_QWEN2] = {"Qwen2ForCausalLM", "qwen2", 32768},
};
#define N_ARCH ((int)(sizeof arch_rows / sizeof arch_rows[0]))

const char *tp_llm_arch_name(tp_llm_arch arch)
{
    return (unsigned)arch < (unsigned)N_ARCH ? arch_rows[arch].arch : "?";
}

/* A key that is absent or null reads as absent. */
static json_t *get(json_t *o, const char *key)
{
    json_t *v = o ? json_object_get(o, key) : NULL;
    return v && !json_is_null(v) ? v : NULL;
}

/* An integer key: *out unchanged when absent unless required. */
static tp_status get_int(json_t *o, const char *key, bool required, int64_t *out)
{
    json_t *v = get(o, key);
    if (!v) {
        if (required)
            return tp__error(TP_ERR_INVALID_ARG, FN ": config.json has no \"%s\"", key);
        return TP_OK;
    }
    /* 4096.0 is written by some tools; accept integral reals */
    if (json_is_real(v) && json_real_value(v) == floor(json_real_value(v)) &&
        fabs(json_real_value(v)) < 9.0e15) {
        *out = (int64_t)json_real_value(v);
        return TP_OK;
    }
    if (!json_is_integer(v))
        return tp__error(TP_ERR_INVALID_ARG, FN ": \"%s\" must be an integer", key);
    *out = (int64_t)json_integer_value(v);
    return TP_OK;
}

static tp_status get_positive(json_t *o, const char *key, bool required, int64_t *out)
{
    TP_CHECK(get_int(o, key, required, out));
    TP_ARG_CHECK(*out > 0, FN ": \"%s\" is %lld; it must be positive", key, (long long)*out);
    return TP_OK;
}

static tp_status get_num(json_t *o, const char *key, double *out)
{
    json_t *v = get(o, key);
    if (!v)
        return TP_OK;
    TP_ARG_CHECK(json_is_number(v), FN ": \"%s\" must be a number", key);
    *out = json_number_value(v);
    return TP_OK;
}

static tp_status get_bool(json_t *o, const char *key, bool *out)
{
    json_t *v = get(o, key);
    if (!v)
        return TP_OK;
    TP_ARG_CHECK(json_is_boolean(v), FN ": \"%s\" must be true or false", key);
    *out = json_is_true(v);
    return TP_OK;
}

/* A string key, NULL when absent; a non-string is an error. */
static tp_status get_str(json_t *o, const char *key, const char **out)
{
    json_t *v = get(o, key);
    *out = NULL;
    if (!v)
        return TP_OK;
    TP_ARG_CHECK(json_is_string(v), FN ": \"%s\" must be a string", key);
    *out = json_string_value(v);
    return TP_OK;
}

static tp_status parse_arch(json_t *root, tp_llm_config *c)
{
    json_t *archs = get(root, "architectures");
    const char *mt = NULL;
    TP_CHECK(get_str(root, "model_type", &mt));
    if (archs) {
        TP_ARG_CHECK(json_is_array(archs) && json_array_size(archs) == 1 &&
                         json_is_string(json_array_get(archs, 0)),
                     FN ": \"architectures\" must be a list of one name");
        const char *a = json_string_value(json_array_get(archs, 0));
        for (int i = 0; i < N_ARCH; i++)
            if (!strcmp(a, arch_rows[i].arch)) {
                c->arch = (tp_llm_arch)i;
                return TP_OK;
            }
        return tp__error(TP_ERR_NOT_SUPPORTED,
                         FN ": architectures \"%s\" is not supported (LlamaForCausalLM, "
                            "MistralForCausalLM and Qwen2ForCausalLM are)", a);
    }
    TP_ARG_CHECK(mt, FN ": config.json has neither \"architectures\" nor \"model_type\"");
    for (int i = 0; i < N_ARCH; i++)
        if (!strcmp(mt, arch_rows[i].model_type)) {
            c->arch = (tp_llm_arch)i;
            return TP_OK;
        }
    return tp__error(TP_ERR_NOT_SUPPORTED,
                     FN ": model_type \"%s\" is not supported (llama, mistral and qwen2 are)", mt);
}

static tp_status parse_dtype(json_t *root, tp_llm_config *c)
{
    const char *d = NULL;
    const char *key = "dtype";
    TP_CHECK(get_str(root, key, &d));
    if (!d) {
        key = "torch_dtype";
        TP_CHECK(get_str(root, key, &d));
    }
    c->dtype = TP_F32;
    if (!d)
        return TP_OK;
    if (!strcmp(d, "float32"))
        c->dtype = TP_F32;
    else if (!strcmp(d, "bfloat16"))
        c->dtype = TP_BF16;
    else if (!strcmp(d, "float16"))
        c->dtype = TP_F16;
    else
        return tp__error(TP_ERR_NOT_SUPPORTED,
                         FN ": \"%s\" \"%s\" is not supported (float32, bfloat16, float16 are)",
                         key, d);
    return TP_OK;
}

/* rope_parameters (5.x) or rope_theta + rope_scaling (4.x). */
static tp_status parse_rope(json_t *root, tp_llm_config *c)
{
    tp_rope_config *r = &c->rope;
    memset(r, 0, sizeof *r);
    r->theta = 10000.0;
    json_t *p = get(root, "rope_parameters");
    const char *where = "rope_parameters";
    if (p) {
        TP_ARG_CHECK(json_is_object(p), FN ": \"rope_parameters\" must be an object");
        /* a per-layer-type dict ({"full_attention": {...}}) is Gemma's form */
        TP_ARG_CHECK(!get(p, "full_attention") && !get(p, "sliding_attention"),
                     FN ": per-layer-type \"rope_parameters\" are not supported");
    } else {
        p = get(root, "rope_scaling");
        where = "rope_scaling";
        TP_ARG_CHECK(!p || json_is_object(p), FN ": \"rope_scaling\" must be an object or null");
    }
    /* rope_theta: in rope_parameters (5.x) or at the top (4.x) */
    TP_CHECK(get_num(root, "rope_theta", &r->theta));
    TP_CHECK(get_num(p, "rope_theta", &r->theta));
    TP_ARG_CHECK(r->theta > 0, FN ": \"rope_theta\" is %g; it must be positive", r->theta);

    const char *type = NULL;
    TP_CHECK(get_str(p, "rope_type", &type));
    if (!type)
        TP_CHECK(get_str(p, "type", &type));
    if (!type || !strcmp(type, "default"))
        r->type = TP_ROPE_DEFAULT;
    else if (!strcmp(type, "linear"))
        r->type = TP_ROPE_LINEAR;
    else if (!strcmp(type, "dynamic"))
        r->type = TP_ROPE_DYNAMIC;
    else if (!strcmp(type, "llama3"))
        r->type = TP_ROPE_LLAMA3;
    else
        return tp__error(TP_ERR_NOT_SUPPORTED,
                         FN ": %s rope_type \"%s\" is not supported (default, linear, dynamic "
                            "and llama3 are)", where, type);
    double prf = 1.0;
    TP_CHECK(get_num(p, "partial_rotary_factor", &prf));
    TP_CHECK(get_num(root, "partial_rotary_factor", &prf));
    if (prf != 1.0)
        return tp__error(TP_ERR_NOT_SUPPORTED,
                         FN ": \"partial_rotary_factor\" %g is not supported (only 1)", prf);
    if (r->type != TP_ROPE_DEFAULT) {
        TP_ARG_CHECK(get(p, "factor"), FN ": %s of type \"%s\" has no \"factor\"", where, type);
        TP_CHECK(get_num(p, "factor", &r->factor));
    }
    if (r->type == TP_ROPE_LLAMA3) {
        static const char *const keys[] = {"low_freq_factor", "high_freq_factor",
                                           "original_max_position_embeddings"};
        for (int i = 0; i < 3; i++)
            TP_ARG_CHECK(get(p, keys[i]), FN ": %s of type \"llama3\" has no \"%s\"", where,
                         keys[i]);
        TP_CHECK(get_num(p, "low_freq_factor", &r->low_freq_factor));
        TP_CHECK(get_num(p, "high_freq_factor", &r->high_freq_factor));
        TP_CHECK(get_positive(p, "original_max_position_embeddings", true,
                              &r->original_max_position_embeddings));
    }
    return TP_OK;
}

/* What would change the result and is not built: refused by name. */
static tp_status refuse_unsupported(json_t *root, tp_llm_config *c)
{
    const char *act = NULL;
    TP_CHECK(get_str(root, "hidden_act", &act));
    if (act && strcmp(act, "silu"))
        return tp__error(TP_ERR_NOT_SUPPORTED,
                         FN ": \"hidden_act\" \"%s\" is not supported (only silu)", act);
    double drop = 0;
    TP_CHECK(get_num(root, "attention_dropout", &drop));
    if (drop != 0)
        return tp__error(TP_ERR_NOT_SUPPORTED,
                         FN ": \"attention_dropout\" %g is not supported (only 0)", drop);
    if (c->arch == TP_LLM_QWEN2) {
        bool use_sw = false;
        TP_CHECK(get_bool(root, "use_sliding_window", &use_sw));
        if (use_sw)
            return tp__error(TP_ERR_NOT_SUPPORTED,
                             FN ": \"use_sliding_window\" true is not supported (Qwen2's "
                                "window is accepted only while it is off)");
    }
    json_t *lt = get(root, "layer_types");
    if (lt) {
        TP_ARG_CHECK(json_is_array(lt), FN ": \"layer_types\" must be a list");
        size_t i;
        json_t *v;
        json_array_foreach(lt, i, v)
        {
            TP_ARG_CHECK(json_is_string(v), FN ": \"layer_types\" must hold strings");
            if (strcmp(json_string_value(v), "full_attention"))
                return tp__error(TP_ERR_NOT_SUPPORTED,
                                 FN ": \"layer_types\" entry %zu \"%s\" is not supported "
                                    "(only full_attention)", i, json_string_value(v));
        }
        TP_ARG_CHECK((int64_t)json_array_size(lt) == c->num_hidden_layers,
                     FN ": \"layer_types\" has %zu entries for %lld layers",
                     json_array_size(lt), (long long)c->num_hidden_layers);
    }
    return TP_OK;
}

static tp_status parse_tokens(json_t *root, tp_llm_config *c)
{
    c->bos_token_id = c->pad_token_id = -1;
    TP_CHECK(get_int(root, "bos_token_id", false, &c->bos_token_id));
    TP_CHECK(get_int(root, "pad_token_id", false, &c->pad_token_id));
    /* -1 is "none" (what null reads as); other negative ids name no token */
    TP_ARG_CHECK(c->bos_token_id >= -1, FN ": \"bos_token_id\" %lld is negative",
                 (long long)c->bos_token_id);
    TP_ARG_CHECK(c->pad_token_id >= -1, FN ": \"pad_token_id\" %lld is negative",
                 (long long)c->pad_token_id);
    json_t *eos = get(root, "eos_token_id");
    c->n_eos = 0;
    if (!eos)
        return TP_OK;
    if (json_is_integer(eos)) {
        c->eos_token_id[c->n_eos++] = (int64_t)json_integer_value(eos);
        return TP_OK;
    }
    TP_ARG_CHECK(json_is_array(eos), FN ": \"eos_token_id\" must be an integer or a list");
    TP_ARG_CHECK(json_array_size(eos) <= TP_LLM_MAX_EOS,
                 FN ": \"eos_token_id\" lists %zu ids (at most %d)", json_array_size(eos),
                 TP_LLM_MAX_EOS);
    size_t i;
    json_t *v;
    json_array_foreach(eos, i, v)
    {
        TP_ARG_CHECK(json_is_integer(v), FN ": \"eos_token_id\" must hold integers");
        c->eos_token_id[c->n_eos++] = (int64_t)json_integer_value(v);
    }
    return TP_OK;
}

static tp_status parse_root(json_t *root, tp_llm_config *c)
{
    TP_ARG_CHECK(json_is_object(root), FN ": config.json must hold a JSON object");
    TP_CHECK(parse_arch(root, c));
    TP_CHECK(get_positive(root, "vocab_size", true, &c->vocab_size));
    TP_CHECK(get_positive(root, "hidden_size", true, &c->hidden_size));
    TP_CHECK(get_positive(root, "intermediate_size", true, &c->intermediate_size));
    TP_CHECK(get_positive(root, "num_hidden_layers", true, &c->num_hidden_layers));
    TP_CHECK(get_positive(root, "num_attention_heads", true, &c->num_attention_heads));
    c->num_key_value_heads = c->num_attention_heads;
    TP_CHECK(get_positive(root, "num_key_value_heads", false, &c->num_key_value_heads));
    c->head_dim = c->hidden_size / c->num_attention_heads;
    TP_CHECK(get_positive(root, "head_dim", false, &c->head_dim));
    TP_ARG_CHECK(get(root, "head_dim") || c->hidden_size % c->num_attention_heads == 0,
                 FN ": \"hidden_size\" %lld is not a multiple of \"num_attention_heads\" %lld "
                    "and there is no \"head_dim\"",
                 (long long)c->hidden_size, (long long)c->num_attention_heads);
    /* the projections' sizes must not overflow (kv heads <= heads) */
    TP_ARG_CHECK(c->num_attention_heads <= INT64_MAX / c->head_dim,
                 FN ": \"num_attention_heads\" %lld x \"head_dim\" %lld overflows",
                 (long long)c->num_attention_heads, (long long)c->head_dim);
    TP_ARG_CHECK(c->head_dim % 2 == 0, FN ": \"head_dim\" %lld is odd (rotary embeddings "
                                          "rotate halves)", (long long)c->head_dim);
    TP_ARG_CHECK(c->num_attention_heads % c->num_key_value_heads == 0,
                 FN ": \"num_attention_heads\" %lld is not a multiple of "
                    "\"num_key_value_heads\" %lld",
                 (long long)c->num_attention_heads, (long long)c->num_key_value_heads);
    c->max_position_embeddings = arch_rows[c->arch].max_pos;
    TP_CHECK(get_positive(root, "max_position_embeddings", false, &c->max_position_embeddings));
    c->rms_norm_eps = 1e-6;
    TP_CHECK(get_num(root, "rms_norm_eps", &c->rms_norm_eps));
    TP_ARG_CHECK(c->rms_norm_eps > 0, FN ": \"rms_norm_eps\" is %g; it must be positive",
                 c->rms_norm_eps);
    TP_CHECK(parse_rope(root, c));
    c->rope.head_dim = c->head_dim;
    c->rope.max_position_embeddings = c->max_position_embeddings;
    TP_CHECK(get_bool(root, "tie_word_embeddings", &c->tie_word_embeddings));
    if (c->arch == TP_LLM_LLAMA) {
        TP_CHECK(get_bool(root, "attention_bias", &c->attention_bias));
        TP_CHECK(get_bool(root, "mlp_bias", &c->mlp_bias));
    }
    c->qkv_bias = c->arch == TP_LLM_QWEN2;
    if (c->arch == TP_LLM_MISTRAL) {
        TP_CHECK(get_int(root, "sliding_window", false, &c->sliding_window));
        TP_ARG_CHECK(c->sliding_window >= 0, FN ": \"sliding_window\" is %lld",
                     (long long)c->sliding_window);
    }
    TP_CHECK(parse_dtype(root, c));
    TP_CHECK(parse_tokens(root, c));
    return refuse_unsupported(root, c);
}

tp_status tp_llm_config_parse(const char *json_text, tp_llm_config *out)
{
    TP_ARG_CHECK(json_text, FN ": json_text is NULL");
    TP_ARG_CHECK(out, FN ": out is NULL");
    json_error_t err;
    json_t *root = json_loads(json_text, JSON_REJECT_DUPLICATES, &err);
    if (!root)
        return tp__error(TP_ERR_INVALID_ARG, FN ": config.json is not valid JSON: %s (line %d, "
                                                "column %d)", err.text, err.line, err.column);
    tp_llm_config c;
    memset(&c, 0, sizeof c);
    tp_status st = parse_root(root, &c);
    json_decref(root);
    if (st == TP_OK)
        *out = c;
    return st;
}

/* The whole of a (small) file, 0-terminated. */
static tp_status read_text(const char *fn, const char *path, char **out)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return tp__error(TP_ERR_BACKEND, "%s: cannot open %s: %s", fn, path, strerror(errno));
    tp_status st = TP_OK;
    char *buf = NULL;
    long n = -1;
    if (fseek(f, 0, SEEK_END) == 0)
        n = ftell(f);
    if (n < 0 || n > (64L << 20) || fseek(f, 0, SEEK_SET) != 0)
        st = tp__error(TP_ERR_BACKEND, "%s: cannot read %s (%s)", fn, path,
                       n > (64L << 20) ? "larger than 64 MiB" : strerror(errno));
    else if (!(buf = tp__malloc((size_t)n + 1)))
        st = tp__error(TP_ERR_NO_MEMORY, "%s: out of memory reading %s", fn, path);
    else if (fread(buf, 1, (size_t)n, f) != (size_t)n)
        st = tp__error(TP_ERR_BACKEND, "%s: cannot read %s", fn, path);
    fclose(f);
    if (st != TP_OK) {
        tp__free(buf);
        return st;
    }
    buf[n] = '\0';
    *out = buf;
    return TP_OK;
}

tp_status tp_llm_config_load(const char *path, tp_llm_config *out)
{
    const char *fn = "tp_llm_config_load";
    TP_ARG_CHECK(path, "%s: path is NULL", fn);
    TP_ARG_CHECK(out, "%s: out is NULL", fn);
    struct stat sb;
    char file[4096];
    if (stat(path, &sb) == 0 && S_ISDIR(sb.st_mode)) {
        int n = snprintf(file, sizeof file, "%s/config.json", path);
        TP_ARG_CHECK(n > 0 && (size_t)n < sizeof file, "%s: path too long", fn);
    } else {
        TP_ARG_CHECK(strlen(path) < sizeof file, "%s: path too long", fn);
        strcpy(file, path);
    }
    char *text = NULL;
    TP_CHECK(read_text(fn, file, &text));
    tp_status st = tp_llm_config_parse(text, out);
    tp__free(text);
    if (st != TP_OK)
        tp__error_prefix("%s", file);
    return st;
}

/* generation_config.json's keys over *g (absent keys keep their value). */
static tp_status parse_generation(json_t *root, tp_llm_generation_config *g)
{
    TP_ARG_CHECK(json_is_object(root), FN ": generation_config.json must hold a JSON object");
    tp_llm_config tok;
    memset(&tok, 0, sizeof tok);
    TP_CHECK(parse_tokens(root, &tok));
    if (get(root, "eos_token_id")) {
        g->n_eos = tok.n_eos;
        memcpy(g->eos_token_id, tok.eos_token_id, sizeof g->eos_token_id);
    }
    if (get(root, "bos_token_id"))
        g->bos_token_id = tok.bos_token_id;
    if (get(root, "pad_token_id"))
        g->pad_token_id = tok.pad_token_id;
    TP_CHECK(get_bool(root, "do_sample", &g->sampling.do_sample));
    TP_CHECK(get_num(root, "temperature", &g->sampling.temperature));
    TP_CHECK(get_num(root, "top_p", &g->sampling.top_p));
    TP_CHECK(get_int(root, "top_k", false, &g->sampling.top_k));
    TP_CHECK(get_int(root, "max_new_tokens", false, &g->max_new_tokens));
    TP_ARG_CHECK(g->sampling.temperature > 0, FN ": \"temperature\" %g must be positive",
                 g->sampling.temperature);
    TP_ARG_CHECK(g->sampling.top_p > 0 && g->sampling.top_p <= 1,
                 FN ": \"top_p\" %g is outside (0, 1]", g->sampling.top_p);
    TP_ARG_CHECK(g->sampling.top_k >= 0, FN ": \"top_k\" %lld is negative",
                 (long long)g->sampling.top_k);
    TP_ARG_CHECK(g->max_new_tokens >= -1, FN ": \"max_new_tokens\" %lld is negative",
                 (long long)g->max_new_tokens);
    return TP_OK;
}

tp_status tp_llm_generation_config_load(const char *dir, const tp_llm_config *cfg,
                                        tp_llm_generation_config *out)
{
    const char *fn = "tp_llm_generation_config_load";
    TP_ARG_CHECK(dir, "%s: dir is NULL", fn);
    TP_ARG_CHECK(cfg, "%s: cfg is NULL", fn);
    TP_ARG_CHECK(out, "%s: out is NULL", fn);
    tp_llm_generation_config g;
    memset(&g, 0, sizeof g);
    g.n_eos = cfg->n_eos;
    memcpy(g.eos_token_id, cfg->eos_token_id, sizeof g.eos_token_id);
    g.pad_token_id = cfg->pad_token_id;
    g.bos_token_id = cfg->bos_token_id;
    g.sampling = (tp_llm_sampling){.temperature = 1.0, .top_k = 50, .top_p = 1.0};
    g.max_new_tokens = -1;
    char file[4096];
    int n = snprintf(file, sizeof file, "%s/generation_config.json", dir);
    TP_ARG_CHECK(n > 0 && (size_t)n < sizeof file, "%s: path too long", fn);
    struct stat sb;
    if (stat(file, &sb) != 0 && errno == ENOENT) {
        *out = g;
        return TP_OK;
    }
    char *text = NULL;
    TP_CHECK(read_text(fn, file, &text));
    json_error_t jerr;
    json_t *root = json_loads(text, 0, &jerr);
    tp__free(text);
    tp_status st = root ? parse_generation(root, &g)
                        : tp__error(TP_ERR_INVALID_ARG, "%s: line %d, column %d: %s", fn,
                                    jerr.line, jerr.column, jerr.text);
    json_decref(root);
    if (st != TP_OK) {
        tp__error_prefix("%s", file);
        return st;
    }
    *out = g;
    return TP_OK;
}

static const char *dtype_json(tp_dtype d)
{
    return d == TP_BF16 ? "bfloat16" : d == TP_F16 ? "float16" : "float32";
}

static const char *rope_type_json(tp_rope_type t)
{
    return t == TP_ROPE_LINEAR ? "linear" : t == TP_ROPE_DYNAMIC ? "dynamic"
                                        : t == TP_ROPE_LLAMA3 ? "llama3" : "default";
}

static int put_int(json_t *o, const char *k, int64_t v)
{
    return json_object_set_new(o, k, json_integer((json_int_t)v));
}

tp_status tp_llm_config_to_json(const tp_llm_config *c, char **json)
{
    const char *fn = "tp_llm_config_to_json";
    TP_ARG_CHECK(c && json, "%s: an argument is NULL", fn);
    TP_ARG_CHECK((unsigned)c->arch < (unsigned)N_ARCH, "%s: arch %d is not one of tp_llm_arch",
                 fn, (int)c->arch);
    *json = NULL;
    json_t *o = json_object(), *archs = json_array(), *rope = json_object();
    int bad = !o || !archs || !rope;
    /* the _new setters take the reference whether or not they succeed */
    bad = bad || json_object_set(o, "architectures", archs) ||
          json_array_append_new(archs, json_string(arch_rows[c->arch].arch));
    json_decref(archs);
    bad = bad || json_object_set_new(o, "model_type", json_string(arch_rows[c->arch].model_type));
    bad = bad || put_int(o, "vocab_size", c->vocab_size) ||
          put_int(o, "hidden_size", c->hidden_size) ||
          put_int(o, "intermediate_size", c->intermediate_size) ||
          put_int(o, "num_hidden_layers", c->num_hidden_layers) ||
          put_int(o, "num_attention_heads", c->num_attention_heads) ||
          put_int(o, "num_key_value_heads", c->num_key_value_heads) ||
          put_int(o, "head_dim", c->head_dim) ||
          put_int(o, "max_position_embeddings", c->max_position_embeddings) ||
          json_object_set_new(o, "rms_norm_eps", json_real(c->rms_norm_eps)) ||
          json_object_set_new(o, "hidden_act", json_string("silu")) ||
          json_object_set_new(o, "tie_word_embeddings", json_boolean(c->tie_word_embeddings)) ||
          json_object_set_new(o, "dtype", json_string(dtype_json(c->dtype))) ||
          json_object_set_new(o, "attention_dropout", json_real(0.0));
    if (c->arch == TP_LLM_LLAMA)
        bad = bad || json_object_set_new(o, "attention_bias", json_boolean(c->attention_bias)) ||
              json_object_set_new(o, "mlp_bias", json_boolean(c->mlp_bias));
    if (c->arch == TP_LLM_MISTRAL)
        bad = bad || json_object_set_new(o, "sliding_window",
                                         c->sliding_window > 0 ? json_integer(c->sliding_window)
                                                               : json_null());
    if (c->arch == TP_LLM_QWEN2)
        bad = bad || json_object_set_new(o, "use_sliding_window", json_false());
    bad = bad || json_object_set_new(rope, "rope_type", json_string(rope_type_json(c->rope.type))) ||
          json_object_set_new(rope, "rope_theta", json_real(c->rope.theta));
    if (c->rope.type != TP_ROPE_DEFAULT)
        bad = bad || json_object_set_new(rope, "factor", json_real(c->rope.factor));
    if (c->rope.type == TP_ROPE_LLAMA3)
        bad = bad || json_object_set_new(rope, "low_freq_factor",
                                         json_real(c->rope.low_freq_factor)) ||
              json_object_set_new(rope, "high_freq_factor", json_real(c->rope.high_freq_factor)) ||
              put_int(rope, "original_max_position_embeddings",
                      c->rope.original_max_position_embeddings);
    bad = bad || json_object_set(o, "rope_parameters", rope);
    bad = bad || json_object_set_new(o, "bos_token_id", c->bos_token_id >= 0
                                                            ? json_integer(c->bos_token_id)
                                                            : json_null()) ||
          json_object_set_new(o, "pad_token_id", c->pad_token_id >= 0
                                                     ? json_integer(c->pad_token_id)
                                                     : json_null());
    if (!bad && c->n_eos == 1)
        bad = put_int(o, "eos_token_id", c->eos_token_id[0]);
    else if (!bad && c->n_eos > 1) {
        json_t *eos = json_array();
        bad = !eos;
        for (int i = 0; !bad && i < c->n_eos; i++)
            bad = json_array_append_new(eos, json_integer(c->eos_token_id[i]));
        bad = bad || json_object_set(o, "eos_token_id", eos);
        json_decref(eos);
    }
    char *text = bad ? NULL : json_dumps(o, JSON_INDENT(2) | JSON_SORT_KEYS | JSON_REAL_PRECISION(17));
    json_decref(rope);
    json_decref(o);
    if (!text)
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
    *json = text;
    return TP_OK;
}
