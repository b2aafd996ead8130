/* Hugging Face model directories: config.json, generation_config.json and the
 * weights, one model.safetensors or shards with model.safetensors.index.json,
 * loaded into a (parallelized) model and saved from one. */
#include <errno.h>
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckpt/st_internal.h"
#include "core/base.h"
#include "models/models_internal.h"
#include "tp/dtensor.h"
#include "tp/safetensors.h"

tp_status tp__llm_config_check(const char *fn, const tp_llm_config *c)
{
    TP_ARG_CHECK((unsigned)c->arch <= TP_LLM_QWEN2, "%s: arch %d is not one of tp_llm_arch", fn,
                 (int)c->arch);
    const struct {
        const char *name;
        int64_t v;
    } sizes[] = {{"vocab_size", c->vocab_size},
                 {"hidden_size", c->hidden_size},
                 {"intermediate_size", c->intermediate_size},
                 {"num_hidden_layers", c->num_hidden_layers},
                 {"num_attention_heads", c->num_attention_heads},
                 {"num_key_value_heads", c->num_key_value_heads},
                 {"head_dim", c->head_dim},
                 {"max_position_embeddings", c->max_position_embeddings}};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
        TP_ARG_CHECK(sizes[i].v > 0, "%s: %s is %lld; it must be positive", fn, sizes[i].name,
                     (long long)sizes[i].v);
    TP_ARG_CHECK(c->num_attention_heads % c->num_key_value_heads == 0,
                 "%s: num_attention_heads %lld is not a multiple of num_key_value_heads %lld", fn,
                 (long long)c->num_attention_heads, (long long)c->num_key_value_heads);
    TP_ARG_CHECK(c->head_dim % 2 == 0, "%s: head_dim %lld is odd", fn, (long long)c->head_dim);
    TP_ARG_CHECK(c->num_attention_heads <= INT64_MAX / c->head_dim,
                 "%s: num_attention_heads %lld x head_dim %lld overflows", fn,
                 (long long)c->num_attention_heads, (long long)c->head_dim);
    TP_ARG_CHECK(c->rms_norm_eps > 0, "%s: rms_norm_eps %g must be positive", fn, c->rms_norm_eps);
    TP_ARG_CHECK(c->sliding_window >= 0, "%s: sliding_window %lld is negative", fn,
                 (long long)c->sliding_window);
    TP_ARG_CHECK(c->n_eos >= 0 && c->n_eos <= TP_LLM_MAX_EOS, "%s: n_eos %d is not in [0, %d]",
                 fn, c->n_eos, TP_LLM_MAX_EOS);
    TP_ARG_CHECK(c->dtype == TP_F32 || c->dtype == TP_BF16 || c->dtype == TP_F16,
                 "%s: dtype must be f32, bf16 or f16", fn);
    /* the rope fields: tp_rope_inv_freq checks them as it computes */
    tp_rope_config r = c->rope;
    r.head_dim = c->head_dim;
    float *inv = tp__malloc(sizeof(float) * (size_t)(c->head_dim / 2));
    if (!inv)
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
    double scaling = 0;
    tp_status st = tp_rope_inv_freq(&r, c->max_position_embeddings, inv, &scaling);
    tp__free(inv);
    if (st != TP_OK)
        tp__error_prefix("%s", fn);
    return st;
}

/* ---- loading ------------------------------------------------------------------ */

static bool ends_with(const char *s, const char *suffix)
{
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && !strcmp(s + n - k, suffix);
}

/* Tensors a checkpoint may hold that the model does not: the rotary
 * inverse frequencies of older Llama checkpoints (a buffer, recomputed), and
 * lm_head.weight of a tied model saved with both names. */
static bool map_name(const char *file_name, char *fqn, size_t cap, void *ctx)
{
    const tp__llm *m = ctx;
    (void)fqn;
    (void)cap;
    if (ends_with(file_name, ".rotary_emb.inv_freq"))
        return false;
    if (m->cfg.tie_word_embeddings && !strcmp(file_name, "lm_head.weight"))
        return false;
    return true;
}

static bool exists(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0 && S_ISREG(sb.st_mode);
}

tp_status tp_llm_load(tp_module *model, const char *dir)
{
    const char *fn = "tp_llm_load";
    const tp__llm *m = tp__llm_of(model);
    TP_ARG_CHECK(m, "%s: model is not a model tp_llm_create made", fn);
    TP_ARG_CHECK(dir, "%s: dir is NULL", fn);
    char path[4096];
    int n = snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    TP_ARG_CHECK(n > 0 && (size_t)n < sizeof path, "%s: dir is too long", fn);
    if (!exists(path)) {
        snprintf(path, sizeof path, "%s/model.safetensors", dir);
        /* every rank sees the same directory: this refusal is unanimous */
        if (!exists(path))
            return tp__error(TP_ERR_BACKEND, "%s: %s holds neither model.safetensors nor "
                                             "model.safetensors.index.json", fn, dir);
    }
    /* streamed: a rank's peak is its shard plus one tensor, not twice its
     * shard (the model is fresh: a failed load leaves nothing worth keeping) */
    const tp_safetensors_load_options o = {.map_name = map_name, .map_ctx = (void *)m,
                                           .strict = true, .stream = true};
    return tp_safetensors_load(model, path, &o);
}

/* ---- saving ------------------------------------------------------------------- */

static tp_status write_text(const char *fn, const char *path, const char *text)
{
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
    FILE *f = fopen(tmp, "wb");
    if (!f)
        return tp__error(TP_ERR_BACKEND, "%s: cannot create %s: %s", fn, tmp, strerror(errno));
    size_t n = strlen(text);
    bool ok = fwrite(text, 1, n, f) == n && fputc('\n', f) != EOF;
    ok = (fclose(f) == 0) && ok;
    if (!ok || rename(tmp, path) != 0) {
        int e = errno;
        unlink(tmp);
        return tp__error(TP_ERR_BACKEND, "%s: cannot write %s: %s", fn, path, strerror(e));
    }
    return TP_OK;
}

static tp_status generation_json(const tp_llm_config *c, char **out)
{
    json_t *o = json_object();
    bool bad = !o;
    if (!bad && c->bos_token_id >= 0)
        bad = json_object_set_new(o, "bos_token_id", json_integer(c->bos_token_id));
    if (!bad && c->pad_token_id >= 0)
        bad = json_object_set_new(o, "pad_token_id", json_integer(c->pad_token_id));
    if (!bad && c->n_eos == 1)
        bad = json_object_set_new(o, "eos_token_id", json_integer(c->eos_token_id[0]));
    if (!bad && c->n_eos > 1) {
        json_t *a = json_array();
        bad = !a || json_object_set(o, "eos_token_id", a);
        for (int i = 0; i < c->n_eos && !bad; i++)
            bad = json_array_append_new(a, json_integer(c->eos_token_id[i]));
        json_decref(a);
    }
    *out = bad ? NULL : json_dumps(o, JSON_INDENT(2) | JSON_SORT_KEYS);
    json_decref(o);
    return *out ? TP_OK : tp__error(TP_ERR_NO_MEMORY, "tp_llm_save: out of memory");
}

/* The writing rank's share: the directory and the two JSON files. */
static tp_status save_configs(const char *fn, tp_module *model, const tp__llm *m, const char *dir)
{
    if (mkdir(dir, 0755) != 0 && errno != EEXIST)
        return tp__error(TP_ERR_BACKEND, "%s: cannot create %s: %s", fn, dir, strerror(errno));
    tp_llm_config c = m->cfg;
    tp_tensor *w = tp_module_parameter(tp_module_find(model, "model.embed_tokens"), "weight");
    if (w)
        c.dtype = tp_tensor_dtype(w);
    char path[4096], *text = NULL;
    TP_CHECK(tp_llm_config_to_json(&c, &text));
    snprintf(path, sizeof path, "%s/config.json", dir);
    tp_status st = write_text(fn, path, text);
    free(text);
    text = NULL;
    if (st == TP_OK)
        st = generation_json(&c, &text);
    if (st == TP_OK) {
        snprintf(path, sizeof path, "%s/generation_config.json", dir);
        st = write_text(fn, path, text);
    }
    free(text);
    return st;
}

static tp_status find_mesh(const char *fqn, tp_tensor *p, void *ctx)
{
    (void)fqn;
    tp_mesh **mesh = ctx;
    /* the largest, as tp_safetensors_save_sharded picks: one writer */
    if (tp_tensor_is_dtensor(p) &&
        (!*mesh || tp_mesh_numel(tp_dtensor_mesh(p)) > tp_mesh_numel(*mesh)))
        *mesh = tp_dtensor_mesh(p);
    return TP_OK;
}

tp_status tp_llm_save(tp_module *model, const char *dir, size_t max_shard_bytes)
{
    const char *fn = "tp_llm_save";
    const tp__llm *m = tp__llm_of(model);
    TP_ARG_CHECK(m, "%s: model is not a model tp_llm_create made", fn);
    TP_ARG_CHECK(dir && *dir, "%s: dir is NULL or empty", fn);
    TP_ARG_CHECK(strlen(dir) < 3900, "%s: dir is too long", fn);
    tp_mesh *mesh = NULL;
    TP_CHECK(tp_module_named_parameters(model, find_mesh, &mesh));
    const bool writer = !mesh || tp_comm_rank(tp_mesh_group(mesh)) == 0;
    tp_tensor *flag = NULL;
    const int64_t one = 1;
    if (mesh)
        TP_CHECK(tp_tensor_empty(TP_I32, TP_CPU, 1, &one, &flag));
    tp_status st = writer ? save_configs(fn, model, m, dir) : TP_OK;
    st = tp__st_agree(fn, mesh, flag, st);
    tp_tensor_release(flag);
    if (st != TP_OK)
        return st;
    return tp_safetensors_save_sharded(model, dir, "model", max_shard_bytes, 0);
}
