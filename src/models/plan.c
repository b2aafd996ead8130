/* The standard tensor-parallel plan of the Llama family (as torchtitan and
 * transformers' base_model_tp_plan lay it out), tp_llm_parallelize, and the
 * causal-LM loss. */
#include <string.h>

#include "core/base.h"
#include "models/models_internal.h"
#include "tp/dtensor.h"

enum {
    ST_COL,     /* q/k/v, gate/up */
    ST_ROW,     /* o, down */
    ST_EMB,     /* embed_tokens */
    ST_HEAD,    /* lm_head */
    ST_SEQ,     /* the norms, with sequence parallelism */
    ST_GATHER,  /* self_attn and mlp gather the sequence-sharded input */
    N_STYLES
};

#define MAX_ENTRIES 12

struct tp_llm_plan {
    tp_style *s[N_STYLES];
    int n;
    tp_plan_entry e[MAX_ENTRIES];
};

void tp_llm_plan_free(tp_llm_plan *plan)
{
    if (!plan)
        return;
    for (int i = 0; i < N_STYLES; i++)
        tp_style_free(plan->s[i]);
    tp__free(plan);
}

static void add(tp_llm_plan *p, const char *fqn, int style)
{
    p->e[p->n++] = (tp_plan_entry){fqn, p->s[style]};
}

tp_status tp_llm_plan_create(const tp_llm_plan_options *opts, tp_llm_plan **out)
{
    const char *fn = "tp_llm_plan_create";
    TP_ARG_CHECK(out, "%s: out is NULL", fn);
    *out = NULL;
    const tp_llm_plan_options o = opts ? *opts : (tp_llm_plan_options){0};
    TP_ARG_CHECK((unsigned)o.loss_parallel <= TP_FLAG_FALSE,
                 "%s: loss_parallel %d is not a tp_flag", fn, (int)o.loss_parallel);
    const bool sp = o.sequence_parallel, lp = o.loss_parallel != TP_FLAG_FALSE;
    tp_llm_plan *p = tp__calloc(1, sizeof *p);
    if (!p)
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
    const tp_layout R = tp_layout_of(tp_replicate()), S1 = tp_layout_of(tp_shard(1));
    tp_status st;
    TP_CHECK_GOTO(tp_colwise_parallel_create(NULL, &p->s[ST_COL]), st, fail);
    /* with SP, o_proj and down_proj reduce-scatter onto the sequence dim and
     * hand a DTensor on to the residual add */
    const tp_rowwise_options row = {.output_layouts = sp ? S1 : R,
                                    .use_local_output = sp ? TP_FLAG_FALSE : TP_FLAG_DEFAULT};
    TP_CHECK_GOTO(tp_rowwise_parallel_create(&row, &p->s[ST_ROW]), st, fail);
    /* the token ids arrive replicated */
    const tp_rowwise_options emb = {.input_layouts = R,
                                    .output_layouts = sp ? S1 : R,
                                    .use_local_output = sp ? TP_FLAG_FALSE : TP_FLAG_DEFAULT};
    TP_CHECK_GOTO(tp_rowwise_parallel_create(&emb, &p->s[ST_EMB]), st, fail);
    /* loss parallel: the logits stay sharded on the vocab dim, a DTensor, for
     * the vocab-parallel cross entropy; else they are gathered */
    const tp_colwise_options head = {
        .input_layouts = sp ? S1 : R,
        .output_layouts = lp ? tp_layout_of(tp_shard(-1)) : R,
        .use_local_output = lp ? TP_FLAG_FALSE : TP_FLAG_TRUE};
    TP_CHECK_GOTO(tp_colwise_parallel_create(&head, &p->s[ST_HEAD]), st, fail);
    add(p, "model.embed_tokens", ST_EMB);
    if (sp) {
        TP_CHECK_GOTO(tp_sequence_parallel_create(NULL, &p->s[ST_SEQ]), st, fail);
        tp_prepare_input_options g = {.n_inputs = 1, .n_desired = 1};
        g.input_layouts[0] = S1;
        g.desired_input_layouts[0] = R;
        TP_CHECK_GOTO(tp_prepare_module_input_create(&g, &p->s[ST_GATHER]), st, fail);
        add(p, "model.layers.*.input_layernorm", ST_SEQ);
        add(p, "model.layers.*.self_attn", ST_GATHER);
    }
    add(p, "model.layers.*.self_attn.[qkv]_proj", ST_COL);
    add(p, "model.layers.*.self_attn.o_proj", ST_ROW);
    if (sp) {
        add(p, "model.layers.*.post_attention_layernorm", ST_SEQ);
        add(p, "model.layers.*.mlp", ST_GATHER);
    }
    add(p, "model.layers.*.mlp.gate_proj", ST_COL);
    add(p, "model.layers.*.mlp.up_proj", ST_COL);
    add(p, "model.layers.*.mlp.down_proj", ST_ROW);
    if (sp)
        add(p, "model.norm", ST_SEQ);
    add(p, "lm_head", ST_HEAD);
    *out = p;
    return TP_OK;
fail:
    tp_llm_plan_free(p);
    return st;
}

int tp_llm_plan_size(const tp_llm_plan *plan)
{
    return plan ? plan->n : 0;
}

const tp_plan_entry *tp_llm_plan_entries(const tp_llm_plan *plan)
{
    return plan ? plan->e : NULL;
}

/* The heads of one projection split over tp ranks: a clear error where they
 * cannot be. */
static tp_status check_heads(const char *fn, const tp_llm_config *c, int64_t tp)
{
    TP_ARG_CHECK(c->num_attention_heads % tp == 0,
                 "%s: %lld attention heads cannot be split over tp %lld ranks", fn,
                 (long long)c->num_attention_heads, (long long)tp);
    if (c->num_key_value_heads % tp != 0)
        return tp__error(TP_ERR_NOT_SUPPORTED,
                         "%s: %lld key/value heads cannot be split over tp %lld ranks (kv heads "
                         "replicated over the ranks that share one are not built yet)",
                         fn, (long long)c->num_key_value_heads, (long long)tp);
    return TP_OK;
}

tp_status tp_llm_parallelize(tp_module *model, tp_mesh *mesh, int n, const tp_plan_entry *plan,
                             const tp_parallelize_options *opts)
{
    const char *fn = "tp_llm_parallelize";
    const tp__llm *m = tp__llm_of(model);
    TP_ARG_CHECK(m, "%s: model is not a model tp_llm_create made", fn);
    TP_ARG_CHECK(mesh, "%s: mesh is NULL", fn);
    TP_ARG_CHECK(tp_mesh_ndim(mesh) == 1, "%s: the mesh has %d dims; pass its 1-D tp slice "
                 "(tp_mesh_slice)", fn, tp_mesh_ndim(mesh));
    TP_ARG_CHECK(n >= 0 && (n == 0 || plan), "%s: %d plan entries at %p", fn, n, (void *)plan);
    TP_CHECK(check_heads(fn, &m->cfg, tp_mesh_size(mesh, 0)));
    tp_llm_plan *std = NULL;
    if (n == 0) {
        TP_CHECK(tp_llm_plan_create(NULL, &std));
        n = std->n;
        plan = std->e;
    }
    tp_status st = tp_parallelize_module(model, mesh, n, plan, opts);
    tp_llm_plan_free(std);
    if (st != TP_OK || !m->cfg.tie_word_embeddings)
        return st;
    /* Each style distributed its own module's parameter, which untied them:
     * the embedding (rowwise, rows over the vocab) and lm_head (colwise,
     * output rows over the vocab) are both Shard(0), so one tensor serves
     * both again. */
    tp_module *emb = tp_module_find(model, "model.embed_tokens"),
              *head = tp_module_find(model, "lm_head");
    tp_tensor *we = tp_module_parameter(emb, "weight"), *wh = tp_module_parameter(head, "weight");
    if (we == wh)
        return TP_OK;
    const bool de = tp_tensor_is_dtensor(we), dh = tp_tensor_is_dtensor(wh);
    bool same = de == dh;
    if (same && de) {
        same = tp_dtensor_mesh(we) == tp_dtensor_mesh(wh) &&
               !memcmp(tp_dtensor_placements(we), tp_dtensor_placements(wh),
                       sizeof(tp_placement) * (size_t)tp_mesh_ndim(tp_dtensor_mesh(we)));
    }
    if (!same)
        return tp__error(TP_ERR_NOT_SUPPORTED,
                         "%s: tie_word_embeddings needs model.embed_tokens.weight and "
                         "lm_head.weight laid out alike (the plan made them differ: shard "
                         "both on the vocab dim, Rowwise and Colwise, or neither)", fn);
    return tp_module_set_parameter(head, "weight", we);
}

tp_status tp_llm_loss(tp_tensor *logits, tp_tensor *input_ids, tp_tensor **loss)
{
    const char *fn = "tp_llm_loss";
    TP_ARG_CHECK(loss, "%s: loss is NULL", fn);
    *loss = NULL;
    TP_ARG_CHECK(logits && input_ids, "%s: %s is NULL", fn, logits ? "input_ids" : "logits");
    TP_ARG_CHECK(!tp_tensor_is_dtensor(input_ids) && tp_tensor_ndim(input_ids) == 2 &&
                     tp_tensor_dtype(input_ids) == TP_I64 &&
                     tp_tensor_device(input_ids).type == TP_DEVICE_CPU,
                 "%s: input_ids must be a plain i64 CPU tensor [batch, seq]", fn);
    const int64_t B = tp_tensor_size(input_ids, 0), S = tp_tensor_size(input_ids, 1);
    TP_ARG_CHECK(tp_tensor_ndim(logits) == 3 && tp_tensor_size(logits, 0) == B &&
                     tp_tensor_size(logits, 1) == S,
                 "%s: logits must be [%lld, %lld, vocab], as input_ids", fn, (long long)B,
                 (long long)S);
    TP_ARG_CHECK(S >= 2, "%s: a causal-LM loss needs at least 2 tokens per sequence", fn);
    /* labels = input_ids shifted left by one, the last position ignored:
     * the mean over the B * (S - 1) predicted positions */
    const int64_t n = B * S;
    tp_tensor *tgt = NULL, *tgt_in = NULL, *flat = NULL;
    tp_status st = tp_tensor_empty(TP_I64, TP_CPU, 1, &n, &tgt);
    if (st != TP_OK)
        return st;
    const int64_t *ids = tp_tensor_data(input_ids);
    int64_t *t = tp_tensor_data(tgt);
    for (int64_t b = 0; b < B; b++)
        for (int64_t s = 0; s < S; s++)
            t[b * S + s] = s + 1 < S ? ids[b * S + s + 1] : -100;
    tp_device dev = tp_tensor_device(tp_tensor_is_dtensor(logits) ? tp_dtensor_local(logits)
                                                                   : logits);
    if (dev.type != TP_DEVICE_CPU) {
        tp_tensor *moved = NULL;
        TP_CHECK_GOTO(tp_tensor_to(tgt, TP_I64, dev, &moved), st, out);
        tp_tensor_release(tgt);
        tgt = moved;
    }
    if (tp_tensor_is_dtensor(logits)) {
        tp_mesh *mesh = tp_dtensor_mesh(logits);
        tp_placement rep[TP_MESH_MAX_DIMS];
        for (int d = 0; d < tp_mesh_ndim(mesh); d++)
            rep[d] = tp_replicate();
        TP_CHECK_GOTO(tp_dtensor_from_local(mesh, tgt, tp_mesh_ndim(mesh), rep, NULL, &tgt_in),
                      st, out);
    } else {
        tgt_in = tp_tensor_retain(tgt);
    }
    TP_CHECK_GOTO(tp_flatten(logits, 0, 1, &flat), st, out);
    const tp_cross_entropy_options ce = TP_CROSS_ENTROPY_DEFAULTS;
    st = tp_cross_entropy(flat, tgt_in, &ce, loss);
out:
    tp_tensor_release(flat);
    tp_tensor_release(tgt_in);
    tp_tensor_release(tgt);
    return st;
}
