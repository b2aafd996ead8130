/* The Llama family as a module tree named as Hugging Face names its state
 * dict, and its forward, read top to bottom as modeling_llama.py:
 *
 *   LlamaForCausalLM(ids)  = lm_head(model(ids))
 *   LlamaModel(ids)        = norm(layers(embed_tokens(ids), cos, sin, mask))
 *   LlamaDecoderLayer(h)   = h' + mlp(post_attention_layernorm(h')),
 *                            h' = h + self_attn(input_layernorm(h))
 *   LlamaAttention(x)      = o_proj(sdpa(rope(q_proj x), rope(k_proj x), v_proj x))
 *   LlamaMLP(x)            = down_proj(silu(gate_proj x) * up_proj x)
 *
 * Sharding is the plan's business (plan.c): attention computes on the heads
 * its q/k/v projections hand it, however many that is on this rank. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "core/base.h"
#include "models/models_internal.h"
#include "nn/nn_ext.h"
#include "tp/autograd.h"
#include "tp/comm_debug.h"
#include "tp/dtensor.h"

#define CHECK(expr) TP_CHECK_GOTO(expr, st, out)

static tp_status one_input(const char *type, int nargs)
{
    if (nargs != 1)
        return tp__error(TP_ERR_INVALID_ARG, "%s.forward takes 1 positional input, got %d", type,
                         nargs);
    return TP_OK;
}

/* The keyword input `name`, NULL when absent or None. */
static tp_tensor *kwarg(int nkw, const tp_kwarg *kw, const char *name)
{
    for (int i = 0; i < nkw; i++)
        if (kw[i].name && !strcmp(kw[i].name, name))
            return kw[i].value;
    return NULL;
}

/* Refuses keywords other than the listed ones (NULL-terminated). */
static tp_status known_kwargs(const char *type, int nkw, const tp_kwarg *kw,
                              const char *const *names)
{
    for (int i = 0; i < nkw; i++) {
        bool ok = false;
        for (int j = 0; names[j] && !ok; j++)
            ok = kw[i].name && !strcmp(kw[i].name, names[j]);
        if (!ok)
            return tp__error(TP_ERR_INVALID_ARG, "%s.forward has no keyword input \"%s\"", type,
                             kw[i].name ? kw[i].name : "(null)");
    }
    return TP_OK;
}

static tp_status call(tp_module *self, const char *child, tp_tensor *x, tp_tensor **out)
{
    return tp_module_call(tp_module_child(self, child), x, out);
}

/* ---- attention ------------------------------------------------------------- */

/* [B, S, H*D] -> [B, H, S, D], H inferred: a projection's output holds the
 * heads this rank computes. */
static tp_status split_heads(const char *what, tp_tensor *x, int64_t head_dim, tp_tensor **out)
{
    *out = NULL;
    if (tp_tensor_is_dtensor(x))
        return tp__error(TP_ERR_INVALID_ARG,
                         "LlamaAttention: %s is a DTensor; attention computes on the heads a "
                         "projection hands it as a local tensor (Colwise with use_local_output, "
                         "as the standard plan has it)", what);
    TP_ARG_CHECK(tp_tensor_ndim(x) == 3, "LlamaAttention: %s has %d dims, expected [batch, seq, "
                 "heads * head_dim]", what, tp_tensor_ndim(x));
    const int64_t n = tp_tensor_size(x, 2);
    TP_ARG_CHECK(n % head_dim == 0, "LlamaAttention: %s has %lld features, not a multiple of "
                 "head_dim %lld", what, (long long)n, (long long)head_dim);
    const int64_t shape[4] = {tp_tensor_size(x, 0), tp_tensor_size(x, 1), n / head_dim, head_dim};
    if (shape[1] == 1) { /* one position (a decode step): the swap moves nothing */
        const int64_t heads_first[4] = {shape[0], shape[2], 1, head_dim};
        return tp_reshape(x, 4, heads_first, out);
    }
    tp_tensor *r = NULL;
    TP_CHECK(tp_reshape(x, 4, shape, &r));
    tp_status st = tp_transpose(r, 1, 2, out);
    tp_tensor_release(r);
    return st;
}

/* One replicated projection's output for this rank's kv head: rows
 * [kv_head * D, (kv_head + 1) * D) of its weight (and bias), whose gradient
 * (this rank's share) flows back as Partial: the optimizer's reduction sums
 * the ranks' shares into the full gradient. */
static tp_status kv_proj(tp_module *self, const tp__llm_attn *a, const char *name, tp_tensor *x,
                         tp_tensor **out)
{
    tp_module *lin = tp_module_child(self, name);
    const tp_placement partial = tp_partial(TP_SUM);
    tp_tensor *w = NULL, *wg = NULL, *b = NULL, *bg = NULL;
    tp_status st = tp_comm_debug_push_scope(name);
    if (st != TP_OK)
        return st;
    CHECK(tp_dtensor_to_local(tp_module_parameter(lin, "weight"), 1, &partial, &w));
    CHECK(tp_narrow(w, 0, a->kv_head * a->head_dim, a->head_dim, &wg));
    if (tp_module_parameter(lin, "bias")) {
        CHECK(tp_dtensor_to_local(tp_module_parameter(lin, "bias"), 1, &partial, &b));
        CHECK(tp_narrow(b, 0, a->kv_head * a->head_dim, a->head_dim, &bg));
    }
    CHECK(tp_linear(x, wg, bg, out));
out:
    tp_comm_debug_pop_scope();
    tp_tensor_release(bg);
    tp_tensor_release(b);
    tp_tensor_release(wg);
    tp_tensor_release(w);
    return st;
}

/* k and v when tp exceeds the kv heads: each rank computes the kv head its
 * query heads read (as vLLM does), from weights replicated over the mesh.
 * The input's gradient from these projections is this rank's share, so the
 * input is taken as a Replicate DTensor whose local gradient is Partial: its
 * reduction (one all_reduce for both, or the sequence-parallel gather's
 * reduce_scatter, shared with q_proj's) sums the shares. */
static tp_status replicated_kv(tp_module *self, const tp__llm_attn *a, tp_tensor *x,
                               tp_tensor **k, tp_tensor **v)
{
    const tp_placement rep = tp_replicate(), partial = tp_partial(TP_SUM);
    tp_tensor *xd = NULL, *xl = NULL;
    tp_status st = TP_OK;
    if (tp_tensor_is_dtensor(x))
        xd = tp_tensor_retain(x);
    else
        CHECK(tp_dtensor_from_local(a->mesh, x, 1, &rep, NULL, &xd));
    CHECK(tp_dtensor_to_local(xd, 1, &partial, &xl));
    CHECK(kv_proj(self, a, "k_proj", xl, k));
    CHECK(kv_proj(self, a, "v_proj", xl, v));
out:
    tp_tensor_release(xl);
    tp_tensor_release(xd);
    return st;
}

static tp_status attention_forward(tp_module *self, int nargs, tp_tensor *const *args, int nkw,
                                   const tp_kwarg *kw, tp_tensor **out)
{
    const tp__llm_attn *a = tp_module_ctx(self);
    tp_status st = one_input("LlamaAttention", nargs);
    if (st != TP_OK)
        return st;
    static const char *const names[] = {"cos", "sin", "attention_mask", NULL};
    TP_CHECK(known_kwargs("LlamaAttention", nkw, kw, names));
    tp_tensor *cos = kwarg(nkw, kw, "cos"), *sin = kwarg(nkw, kw, "sin");
    TP_ARG_CHECK(cos && sin, "LlamaAttention.forward needs the keyword inputs cos and sin");
    tp_tensor *q = NULL, *k = NULL, *v = NULL, *qh = NULL, *kh = NULL, *vh = NULL, *qr = NULL,
              *kr = NULL, *o = NULL, *ot = NULL, *merged = NULL;
    CHECK(call(self, "q_proj", args[0], &q));
    if (a->kv_head >= 0) {
        CHECK(replicated_kv(self, a, args[0], &k, &v));
    } else {
        CHECK(call(self, "k_proj", args[0], &k));
        CHECK(call(self, "v_proj", args[0], &v));
    }
    CHECK(split_heads("q_proj's output", q, a->head_dim, &qh));
    CHECK(split_heads("k_proj's output", k, a->head_dim, &kh));
    CHECK(split_heads("v_proj's output", v, a->head_dim, &vh));
    CHECK(tp_rotary_embedding(qh, cos, sin, &qr));
    CHECK(tp_rotary_embedding(kh, cos, sin, &kr));
    const tp_sdpa_options so = {.causal = true,
                                .scale = 1.0 / sqrt((double)a->head_dim),
                                .key_padding = kwarg(nkw, kw, "attention_mask")};
    if (a->run && a->run->cache)
        CHECK(tp__llm_cache_attend(a->run->cache, a->layer, qr, kr, vh, so.scale, &o));
    else
        CHECK(tp_scaled_dot_product_attention_with(qr, kr, vh, &so, &o)); /* [B, H, S, D] */
    if (tp_tensor_size(o, 2) == 1) /* one position: [B, H, 1, D] is [B, 1, H, D] */
        ot = tp_tensor_retain(o);
    else
        CHECK(tp_transpose(o, 1, 2, &ot)); /* [B, S, H, D] */
    const int64_t shape[3] = {tp_tensor_size(o, 0), tp_tensor_size(o, 2),
                              tp_tensor_size(o, 1) * a->head_dim};
    CHECK(tp_reshape(ot, 3, shape, &merged));
    CHECK(call(self, "o_proj", merged, out));
out:
    tp_tensor_release(merged);
    tp_tensor_release(ot);
    tp_tensor_release(o);
    tp_tensor_release(kr);
    tp_tensor_release(qr);
    tp_tensor_release(vh);
    tp_tensor_release(kh);
    tp_tensor_release(qh);
    tp_tensor_release(v);
    tp_tensor_release(k);
    tp_tensor_release(q);
    return st;
}

/* ---- MLP, decoder layer ---------------------------------------------------- */

static tp_status mlp_forward(tp_module *self, int nargs, tp_tensor *const *args, int nkw,
                             const tp_kwarg *kw, tp_tensor **out)
{
    (void)kw;
    tp_status st = one_input("LlamaMLP", nargs);
    if (st != TP_OK)
        return st;
    TP_ARG_CHECK(nkw == 0, "LlamaMLP.forward takes no keyword inputs");
    tp_tensor *g = NULL, *u = NULL, *a = NULL;
    CHECK(call(self, "gate_proj", args[0], &g));
    CHECK(call(self, "up_proj", args[0], &u));
    CHECK(tp_swiglu(g, u, &a));
    CHECK(call(self, "down_proj", a, out));
out:
    tp_tensor_release(a);
    tp_tensor_release(u);
    tp_tensor_release(g);
    return st;
}

static tp_status layer_forward(tp_module *self, int nargs, tp_tensor *const *args, int nkw,
                               const tp_kwarg *kw, tp_tensor **out)
{
    tp_status st = one_input("LlamaDecoderLayer", nargs);
    if (st != TP_OK)
        return st;
    tp_tensor *n1 = NULL, *a = NULL, *h = NULL, *n2 = NULL, *m = NULL;
    CHECK(call(self, "input_layernorm", args[0], &n1));
    CHECK(tp_module_forward(tp_module_child(self, "self_attn"), 1, &n1, nkw, kw, &a));
    CHECK(tp_add(args[0], a, &h));
    CHECK(call(self, "post_attention_layernorm", h, &n2));
    CHECK(call(self, "mlp", n2, &m));
    CHECK(tp_add(h, m, out));
out:
    tp_tensor_release(m);
    tp_tensor_release(n2);
    tp_tensor_release(h);
    tp_tensor_release(a);
    tp_tensor_release(n1);
    return st;
}

/* ---- the model ---------------------------------------------------------------- */

/* The key of the attachment that marks a model's root (its value: the
 * root's context): a user's custom module may hold any context. */
static const char llm_key;

/* position_ids [B, S] = 0..S-1 on every row, on `device`. */
static tp_status default_positions(int64_t B, int64_t S, tp_device device, tp_tensor **out)
{
    const int64_t shape[2] = {B, S};
    tp_tensor *p = NULL;
    TP_CHECK(tp_tensor_empty(TP_I64, TP_CPU, 2, shape, &p));
    int64_t *d = tp_tensor_data(p);
    for (int64_t b = 0; b < B; b++)
        for (int64_t s = 0; s < S; s++)
            d[b * S + s] = s;
    if (device.type == TP_DEVICE_CPU) {
        *out = p;
        return TP_OK;
    }
    tp_status st = tp_tensor_to(p, TP_I64, device, out);
    tp_tensor_release(p);
    return st;
}

/* The checks that need the input ids' values: ids in [0, vocab). Plain CPU
 * ids only (the embedding checks the rest itself). */
static tp_status check_ids(const tp__llm *m, tp_tensor *ids)
{
    TP_ARG_CHECK(!tp_tensor_is_dtensor(ids), "%s: input_ids must be a plain tensor, the same "
                 "on every rank", tp_llm_arch_name(m->cfg.arch));
    TP_ARG_CHECK(tp_tensor_ndim(ids) == 2, "%s: input_ids has %d dims, expected [batch, seq]",
                 tp_llm_arch_name(m->cfg.arch), tp_tensor_ndim(ids));
    TP_ARG_CHECK(tp_tensor_dtype(ids) == TP_I64, "%s: input_ids must be i64",
                 tp_llm_arch_name(m->cfg.arch));
    TP_ARG_CHECK(tp_tensor_size(ids, 1) > 0, "%s: input_ids has no tokens",
                 tp_llm_arch_name(m->cfg.arch));
    if (m->cfg.sliding_window > 0)
        TP_ARG_CHECK(tp_tensor_size(ids, 1) <= m->cfg.sliding_window,
                     "%s: %lld tokens exceed sliding_window %lld, which libtp does not "
                     "apply (sequences up to the window compute exactly)",
                     tp_llm_arch_name(m->cfg.arch), (long long)tp_tensor_size(ids, 1),
                     (long long)m->cfg.sliding_window);
    if (tp_tensor_device(ids).type != TP_DEVICE_CPU)
        return TP_OK;
    const int64_t *d = tp_tensor_data(ids), n = tp_tensor_numel(ids);
    for (int64_t i = 0; i < n; i++)
        TP_ARG_CHECK(d[i] >= 0 && d[i] < m->cfg.vocab_size,
                     "%s: input_ids[%lld][%lld] is %lld, outside the vocabulary [0, %lld)",
                     tp_llm_arch_name(m->cfg.arch), (long long)(i / tp_tensor_size(ids, 1)),
                     (long long)(i % tp_tensor_size(ids, 1)), (long long)d[i],
                     (long long)m->cfg.vocab_size);
    return TP_OK;
}

static tp_status check_bs(const char *arch, const char *what, tp_tensor *t, tp_tensor *ids)
{
    if (!t)
        return TP_OK;
    TP_ARG_CHECK(!tp_tensor_is_dtensor(t), "%s: %s must be a plain tensor", arch, what);
    TP_ARG_CHECK(tp_tensor_ndim(t) == 2 && tp_tensor_size(t, 0) == tp_tensor_size(ids, 0) &&
                     tp_tensor_size(t, 1) == tp_tensor_size(ids, 1),
                 "%s: %s must have input_ids' shape [%lld, %lld]", arch, what,
                 (long long)tp_tensor_size(ids, 0), (long long)tp_tensor_size(ids, 1));
    TP_ARG_CHECK(tp_tensor_dtype(t) == TP_I64 || tp_tensor_dtype(t) == TP_I32,
                 "%s: %s must be i64 or i32", arch, what);
    return TP_OK;
}

/* The dtype the layers compute in: the embedding table's. */
static tp_dtype compute_dtype(tp_module *model)
{
    tp_tensor *w = tp_module_parameter(tp_module_child(model, "embed_tokens"), "weight");
    return w ? tp_tensor_dtype(w) : TP_F32;
}

static tp_status model_forward(tp_module *self, int nargs, tp_tensor *const *args, int nkw,
                               const tp_kwarg *kw, tp_tensor **out)
{
    const tp__llm *m = tp_module_ctx(self);
    const char *arch = tp_llm_arch_name(m->cfg.arch);
    tp_status st = one_input("LlamaModel", nargs);
    if (st != TP_OK)
        return st;
    static const char *const names[] = {"position_ids", "attention_mask", NULL};
    TP_CHECK(known_kwargs("LlamaModel", nkw, kw, names));
    tp_tensor *ids = args[0], *pos_in = kwarg(nkw, kw, "position_ids"),
              *mask = kwarg(nkw, kw, "attention_mask");
    TP_CHECK(check_ids(m, ids));
    TP_CHECK(check_bs(arch, "position_ids", pos_in, ids));
    TP_CHECK(check_bs(arch, "attention_mask", mask, ids));
    tp_tensor *pos = NULL, *cos = NULL, *sin = NULL, *h = NULL;
    if (pos_in)
        pos = tp_tensor_retain(pos_in);
    else
        CHECK(default_positions(tp_tensor_size(ids, 0), tp_tensor_size(ids, 1),
                                tp_tensor_device(ids), &pos));
    CHECK(tp_rope_cos_sin(&m->cfg.rope, pos, compute_dtype(self), &cos, &sin));
    CHECK(call(self, "embed_tokens", ids, &h));
    tp_module *layers = tp_module_child(self, "layers");
    const tp_kwarg lkw[3] = {{"cos", cos}, {"sin", sin}, {"attention_mask", mask}};
    for (int i = 0; i < tp_module_num_children(layers); i++) {
        tp_tensor *next = NULL;
        st = tp_module_forward(tp_module_child_at(layers, i, NULL), 1, &h, mask ? 3 : 2, lkw,
                               &next);
        tp_tensor_release(h);
        h = next;
        if (st != TP_OK)
            goto out;
    }
    CHECK(call(self, "norm", h, out));
out:
    tp_tensor_release(h);
    tp_tensor_release(sin);
    tp_tensor_release(cos);
    tp_tensor_release(pos);
    return st;
}

static tp_status causal_lm_forward(tp_module *self, int nargs, tp_tensor *const *args, int nkw,
                                   const tp_kwarg *kw, tp_tensor **out)
{
    tp_status st = one_input(tp_llm_arch_name(((const tp__llm *)tp_module_ctx(self))->cfg.arch),
                             nargs);
    if (st != TP_OK)
        return st;
    tp_tensor *h = NULL;
    CHECK(tp_module_forward(tp_module_child(self, "model"), 1, args, nkw, kw, &h));
    CHECK(call(self, "lm_head", h, out));
out:
    tp_tensor_release(h);
    return st;
}

/* ---- building ------------------------------------------------------------------ */

/* Hangs child under parent; frees it when the parent does not take it. */
static tp_status adopt(tp_module *parent, const char *name, tp_module *child)
{
    tp_status st = tp_module_add_child(parent, name, child);
    if (st != TP_OK)
        tp_module_free(child);
    return st;
}

static tp_status add_linear(tp_module *parent, const char *name, int64_t in, int64_t out,
                            bool bias)
{
    tp_module *m = NULL;
    TP_CHECK(tp_nn_linear_create(in, out, bias, &m));
    return adopt(parent, name, m);
}

static tp_status add_norm(tp_module *parent, const char *name, const tp_llm_config *c)
{
    tp_module *m = NULL;
    TP_CHECK(tp_nn_rms_norm_create(c->hidden_size, true, c->rms_norm_eps, &m));
    return adopt(parent, name, m);
}

void tp__llm_attn_free(void *ctx)
{
    tp__llm_attn *a = ctx;
    if (a)
        tp_mesh_free(a->mesh);
    tp__free(a);
}

/* A custom module with a malloc'ed copy of ctx (n bytes), freed by
 * ctx_free (NULL: tp__free). */
static tp_status add_custom(tp_module *parent, const char *name, const char *type,
                            tp_forward_fn fwd, const void *ctx, size_t n,
                            void (*ctx_free)(void *), tp_module **out)
{
    void *copy = NULL;
    if (n) {
        if (!(copy = tp__malloc(n)))
            return tp__error(TP_ERR_NO_MEMORY, "tp_llm_create: out of memory");
        memcpy(copy, ctx, n);
    }
    tp_module *m = NULL;
    tp_status st = tp_nn_custom_create(type, fwd, copy, copy ? (ctx_free ? ctx_free : tp__free)
                                                            : NULL, &m);
    if (st != TP_OK) {
        tp__free(copy);
        return st;
    }
    if (parent && (st = adopt(parent, name, m)) != TP_OK)
        return st;
    *out = m;
    return TP_OK;
}

/* The root's context owns the run state its children share. */
static void root_free(void *ctx)
{
    tp__llm *m = ctx;
    if (m)
        tp__free(m->run);
    tp__free(m);
}

static tp_status build_layer(tp_module *layers, int64_t i, const tp_llm_config *c,
                             tp__llm_run *run)
{
    char name[24];
    snprintf(name, sizeof name, "%lld", (long long)i);
    tp_module *l = NULL, *attn = NULL, *mlp = NULL;
    TP_CHECK(add_custom(layers, name, "LlamaDecoderLayer", layer_forward, NULL, 0, NULL, &l));
    const tp__llm_attn actx = {c->head_dim, -1, NULL, i, run};
    TP_CHECK(add_custom(l, "self_attn", "LlamaAttention", attention_forward, &actx, sizeof actx,
                        tp__llm_attn_free, &attn));
    const int64_t hd = c->head_dim, H = c->hidden_size;
    const bool qkvb = c->attention_bias || c->qkv_bias;
    TP_CHECK(add_linear(attn, "q_proj", H, c->num_attention_heads * hd, qkvb));
    TP_CHECK(add_linear(attn, "k_proj", H, c->num_key_value_heads * hd, qkvb));
    TP_CHECK(add_linear(attn, "v_proj", H, c->num_key_value_heads * hd, qkvb));
    TP_CHECK(add_linear(attn, "o_proj", c->num_attention_heads * hd, H, c->attention_bias));
    TP_CHECK(add_custom(l, "mlp", "LlamaMLP", mlp_forward, NULL, 0, NULL, &mlp));
    TP_CHECK(add_linear(mlp, "gate_proj", H, c->intermediate_size, c->mlp_bias));
    TP_CHECK(add_linear(mlp, "up_proj", H, c->intermediate_size, c->mlp_bias));
    TP_CHECK(add_linear(mlp, "down_proj", c->intermediate_size, H, c->mlp_bias));
    TP_CHECK(add_norm(l, "input_layernorm", c));
    return add_norm(l, "post_attention_layernorm", c);
}

tp_status tp_llm_create(const tp_llm_config *cfg, tp_module **out)
{
    const char *fn = "tp_llm_create";
    TP_ARG_CHECK(out, "%s: out is NULL", fn);
    *out = NULL;
    TP_ARG_CHECK(cfg, "%s: cfg is NULL", fn);
    TP_CHECK(tp__llm_config_check(fn, cfg));
    tp__llm ctx;
    memset(&ctx, 0, sizeof ctx);
    ctx.cfg = *cfg;
    ctx.cfg.rope.head_dim = cfg->head_dim;
    if (!(ctx.run = tp__calloc(1, sizeof *ctx.run)))
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
    tp_status st;
    tp_module *root = NULL, *model = NULL, *layers = NULL, *emb = NULL, *head = NULL;
    st = add_custom(NULL, NULL, tp_llm_arch_name(cfg->arch), causal_lm_forward, &ctx, sizeof ctx,
                    root_free, &root);
    if (st != TP_OK) {
        tp__free(ctx.run);
        return st;
    }
    CHECK(tp__module_attach(root, &llm_key, tp_module_ctx(root), NULL));
    CHECK(add_custom(root, "model", "LlamaModel", model_forward, &ctx, sizeof ctx, NULL, &model));
    CHECK(tp_nn_embedding_create(cfg->vocab_size, cfg->hidden_size, &emb));
    st = adopt(model, "embed_tokens", emb);
    CHECK(st);
    CHECK(tp_nn_container_create(&layers));
    CHECK(adopt(model, "layers", layers));
    for (int64_t i = 0; i < cfg->num_hidden_layers; i++)
        CHECK(build_layer(layers, i, cfg, ctx.run));
    CHECK(add_norm(model, "norm", cfg));
    CHECK(tp_nn_linear_create(cfg->hidden_size, cfg->vocab_size, false, &head));
    CHECK(adopt(root, "lm_head", head));
    if (cfg->tie_word_embeddings)
        CHECK(tp_module_set_parameter(head, "weight", tp_module_parameter(emb, "weight")));
    *out = root;
    root = NULL;
out:
    tp_module_free(root);
    return st;
}

const tp__llm *tp__llm_of(const tp_module *m)
{
    return m ? tp__module_attached(m, &llm_key) : NULL;
}

const tp_llm_config *tp_llm_config_of(const tp_module *model)
{
    const tp__llm *m = tp__llm_of(model);
    return m ? &m->cfg : NULL;
}

tp_status tp_llm_forward(tp_module *model, tp_tensor *input_ids, tp_tensor *position_ids,
                         tp_tensor *attention_mask, tp_tensor **logits)
{
    const char *fn = "tp_llm_forward";
    TP_ARG_CHECK(logits, "%s: logits is NULL", fn);
    *logits = NULL;
    TP_ARG_CHECK(tp__llm_of(model), "%s: model is not a model tp_llm_create made", fn);
    TP_ARG_CHECK(input_ids, "%s: input_ids is NULL", fn);
    tp_kwarg kw[2];
    int nkw = 0;
    if (position_ids)
        kw[nkw++] = (tp_kwarg){"position_ids", position_ids};
    if (attention_mask)
        kw[nkw++] = (tp_kwarg){"attention_mask", attention_mask};
    return tp_module_forward(model, 1, &input_ids, nkw, kw, logits);
}
