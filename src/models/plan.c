/* The standard tensor-parallel plan of the Llama family (as torchtitan and
 * transformers' base_model_tp_plan lay it out), tp_llm_parallelize, and the
 * causal-LM loss. */
#include <stdint.h>
#include <stdio.h>
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

/* How the heads split over tp ranks: the query heads evenly; the kv heads
 * evenly, or, where tp is a multiple of them, replicated over the tp / Hkv
 * ranks that share one (*replicate). Anything else is a clear error. */
static tp_status check_heads(const char *fn, const tp_llm_config *c, int64_t tp, bool *replicate)
{
    const long long hq = c->num_attention_heads, hkv = c->num_key_value_heads, t = tp;
    TP_ARG_CHECK(hq % t == 0, "%s: %lld attention heads cannot be split over tp %lld ranks", fn,
                 hq, t);
    *replicate = hkv % t != 0;
    TP_ARG_CHECK(!*replicate || t % hkv == 0,
                 "%s: %lld key/value heads can neither be split over tp %lld ranks nor "
                 "replicated over them (tp must divide the kv heads or be a multiple of them)",
                 fn, hkv, t);
    return TP_OK;
}

/* The FQNs of the modules below m (m's own is prefix) into a list. */
typedef struct {
    char **v;
    int n;
    size_t cap;
} fqn_list;

static void fqn_list_free(fqn_list *l)
{
    for (int i = 0; i < l->n; i++)
        tp__free(l->v[i]);
    tp__free(l->v);
}

static tp_status collect_fqns(tp_module *m, const char *prefix, fqn_list *l)
{
    for (int i = 0; i < tp_module_num_children(m); i++) {
        const char *name = NULL;
        tp_module *c = tp_module_child_at(m, i, &name);
        char fqn[512];
        int k = snprintf(fqn, sizeof fqn, "%s%s%s", prefix, *prefix ? "." : "", name);
        TP_ARG_CHECK(k > 0 && (size_t)k < sizeof fqn, "tp_llm_parallelize: FQN too long");
        if (!tp__grow_array((void **)&l->v, (size_t)l->n, &l->cap, sizeof *l->v) ||
            !(l->v[l->n] = tp__strdup(fqn)))
            return tp__error(TP_ERR_NO_MEMORY, "tp_llm_parallelize: out of memory");
        l->n++;
        TP_CHECK(collect_fqns(c, l->v[l->n - 1], l));
    }
    return TP_OK;
}

static bool is_kv_proj(const char *fqn)
{
    return tp_fqn_match("model.layers.*.self_attn.k_proj", fqn) ||
           tp_fqn_match("model.layers.*.self_attn.v_proj", fqn);
}

/* The plan with kv projections left out: one entry per matching module of
 * `fqns` (patterns resolved; the entries borrow the strings), k_proj and
 * v_proj skipped. An entry that matches nothing is the error
 * tp_parallelize_module would give, unless allowed. */
static tp_status plan_without_kv(const char *fn, const fqn_list *fqns, int n,
                                 const tp_plan_entry *plan, bool allow_unmatched,
                                 tp_plan_entry **out, int *nout)
{
    tp_plan_entry *e = tp__calloc((size_t)n * (size_t)(fqns->n + 1) + 1, sizeof *e);
    if (!e)
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
    int ne = 0;
    for (int i = 0; i < n; i++) {
        bool matched = false;
        if (!plan[i].fqn[0]) { /* "" is the model itself */
            e[ne++] = plan[i];
            continue;
        }
        for (int j = 0; j < fqns->n; j++) {
            if (!tp_fqn_match(plan[i].fqn, fqns->v[j]))
                continue;
            matched = true;
            if (!is_kv_proj(fqns->v[j]))
                e[ne++] = (tp_plan_entry){fqns->v[j], plan[i].style};
        }
        if (!matched && !allow_unmatched) {
            tp__free(e);
            return tp__error(TP_ERR_INVALID_ARG, "%s: plan entry %d ('%s') matched no module",
                             fn, i, plan[i].fqn);
        }
    }
    *out = e;
    *nout = ne;
    return TP_OK;
}

/* k_proj and v_proj of every layer: parameters Replicate over the mesh
 * (from src_data_rank, as a style distributes them), and each attention
 * told which kv head its rank computes. */
static tp_status replicate_kv(tp_module *model, const tp_llm_config *c, tp_mesh *mesh, int src)
{
    const int64_t tp = tp_mesh_size(mesh, 0),
                  kv_head = tp_mesh_coord(mesh, 0) / (tp / c->num_key_value_heads);
    const tp_placement rep = tp_replicate();
    tp_module *layers = tp_module_find(model, "model.layers");
    for (int i = 0; i < tp_module_num_children(layers); i++) {
        tp_module *attn = tp_module_child(tp_module_child_at(layers, i, NULL), "self_attn");
        for (int j = 0; j < 2; j++) {
            tp_module *lin = tp_module_child(attn, j ? "v_proj" : "k_proj");
            for (int k = 0; k < 2; k++) {
                const char *pn = k ? "bias" : "weight";
                tp_tensor *p = tp_module_parameter(lin, pn), *d = NULL;
                if (!p || tp_tensor_is_dtensor(p))
                    continue;
                TP_CHECK(tp_dtensor_distribute(mesh, p, 1, &rep, src, &d));
                tp_status st = tp_module_set_parameter(lin, pn, d);
                tp_tensor_release(d);
                TP_CHECK(st);
            }
        }
        tp__llm_attn *a = tp_module_ctx(attn);
        if (!a->mesh)
            a->mesh = tp_mesh_retain(mesh);
        a->kv_head = kv_head;
    }
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
    bool replicate = false;
    TP_CHECK(check_heads(fn, &m->cfg, tp_mesh_size(mesh, 0), &replicate));
    const tp_parallelize_options o = opts ? *opts : (tp_parallelize_options){0};
    TP_ARG_CHECK(o.src_data_rank == TP_SRC_DATA_RANK_NONE ||
                     (o.src_data_rank >= 0 && o.src_data_rank < tp_mesh_size(mesh, 0)),
                 "%s: src_data_rank %d is not a rank of the mesh", fn, o.src_data_rank);
    tp_llm_plan *std = NULL;
    if (n == 0) {
        TP_CHECK(tp_llm_plan_create(NULL, &std));
        n = std->n;
        plan = std->e;
    }
    tp_plan_entry *eff = NULL;
    int neff = n;
    tp_status st = TP_OK;
    if (replicate) {
        fqn_list fqns = {0};
        st = collect_fqns(model, "", &fqns);
        if (st == TP_OK)
            st = plan_without_kv(fn, &fqns, n, plan, o.allow_unmatched, &eff, &neff);
        if (st == TP_OK) {
            tp_parallelize_options po = o;
            po.unmatched = NULL;
            po.n_unmatched = NULL;
            if (o.n_unmatched)
                *o.n_unmatched = 0;
            st = tp_parallelize_module(model, mesh, neff, eff, &po);
        }
        if (st == TP_OK)
            st = replicate_kv(model, &m->cfg, mesh,
                              o.src_data_rank == TP_SRC_DATA_RANK_NONE ? -1 : o.src_data_rank);
        tp__free(eff);
        fqn_list_free(&fqns);
    } else {
        st = tp_parallelize_module(model, mesh, n, plan, opts);
    }
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

/* ---- fully sharded data parallel ------------------------------------------------- */

tp_status tp_llm_fully_shard(tp_module *model, tp_mesh *mesh, const tp_fsdp_options *opts)
{
    const char *fn = "tp_llm_fully_shard";
    TP_ARG_CHECK(model, "%s: model is NULL", fn);
    const tp_llm_config *cfg = tp_llm_config_of(model);
    TP_ARG_CHECK(cfg, "%s: the module is not a model tp_llm_create made", fn);
    tp_module *layers = tp_module_find(model, "model.layers");
    for (int i = 0; i < tp_module_num_children(layers); i++) {
        tp_status st = tp_fully_shard(tp_module_child_at(layers, i, NULL), mesh, opts);
        if (st != TP_OK) {
            tp__error_prefix("%s: model.layers.%d", fn, i);
            return st;
        }
    }
    /* tied embeddings are one parameter: the root holds it */
    const char *ends[2] = {"model.embed_tokens", "lm_head"};
    for (int i = 0; i < 2 && !cfg->tie_word_embeddings; i++) {
        tp_status st = tp_fully_shard(tp_module_find(model, ends[i]), mesh, opts);
        if (st != TP_OK) {
            tp__error_prefix("%s: %s", fn, ends[i]);
            return st;
        }
    }
    tp_status st = tp_fully_shard(model, mesh, opts);
    if (st != TP_OK)
        tp__error_prefix("%s: the root", fn);
    return st;
}
