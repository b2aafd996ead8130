/* Generation: the KV cache, the cached forward (prefill and decode), the
 * choice of the next token and the loop that strings them together, as
 * transformers' generate does for a decoder-only model:
 *
 *   prefill   logits = model(prompts, mask)[:, -1]       (the cache filled)
 *   step t    token_t = choose(logits, t); ended rows get the pad id
 *             logits = model(token_t, mask + [1])[:, -1]  (one position appended)
 *
 * The cache holds, per layer, the rotated keys and the values of the kv
 * heads this rank computes; attention over it reads a view of its first
 * positions in place (sdpa reads strided keys). Position ids number each
 * sequence's real tokens from 0 whatever padding precedes them, as
 * transformers' generate numbers them from the attention mask. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/base.h"
#include "dtensor/dtensor_internal.h"
#include "models/models_internal.h"
#include "tp/autograd.h"
#include "tp/dtensor.h"

#define CHECK(expr) TP_CHECK_GOTO(expr, st, out)

struct tp_llm_cache {
    const tp__llm *owner; /* the model's root context */
    int64_t n_layers, max_batch, max_len, kv_heads, head_dim;
    tp_dtype dtype;
    tp_device device;
    tp_tensor **k, **v;  /* per layer [max_batch, kv_heads, max_len, head_dim] */
    tp_tensor *mask;     /* i64 [max_batch, max_len] on the device */
    tp_tensor *mask_cpu; /* the same on the CPU (the mask itself on a CPU model) */
    int64_t *seen;       /* per row: real tokens so far (the next position id) */
    int64_t *seen_next;  /* the same after the call in flight */
    int64_t len, batch;
    bool padded;         /* a 0 among the mask's first len positions */
    /* the call in flight's batch (len advances only when the call succeeds:
     * during it, len is the positions before it) */
    int64_t call_batch;
};

/* ---- the cache -------------------------------------------------------------------- */

static tp_module *layers_of(tp_module *model)
{
    return tp_module_child(tp_module_child(model, "model"), "layers");
}

static tp_tensor *local_of(tp_tensor *t)
{
    return t && tp_tensor_is_dtensor(t) ? tp_dtensor_local(t) : t;
}

tp_status tp_llm_cache_create(tp_module *model, int64_t max_batch, int64_t max_len,
                              tp_llm_cache **out)
{
    const char *fn = "tp_llm_cache_create";
    TP_ARG_CHECK(out, "%s: out is NULL", fn);
    *out = NULL;
    const tp__llm *m = tp__llm_of(model);
    TP_ARG_CHECK(m, "%s: model is not a model tp_llm_create made", fn);
    TP_ARG_CHECK(max_batch > 0, "%s: max_batch %lld must be positive", fn, (long long)max_batch);
    TP_ARG_CHECK(max_len > 0, "%s: max_len %lld must be positive", fn, (long long)max_len);
    tp_module *layers = layers_of(model);
    const int64_t n = tp_module_num_children(layers);
    TP_ARG_CHECK(n > 0, "%s: the model has no decoder layers", fn);
    tp_module *attn = tp_module_child(tp_module_child_at(layers, 0, NULL), "self_attn");
    const tp__llm_attn *a = tp_module_ctx(attn);
    tp_tensor *kw = local_of(tp_module_parameter(tp_module_child(attn, "k_proj"), "weight"));
    tp_tensor *emb = local_of(
        tp_module_parameter(tp_module_child(tp_module_child(model, "model"), "embed_tokens"),
                            "weight"));
    TP_ARG_CHECK(a && kw && emb, "%s: the model lacks its attention or embedding weights", fn);
    const int64_t D = a->head_dim;
    const int64_t kvh = a->kv_head >= 0 ? 1 : tp_tensor_size(kw, 0) / D;
    /* max_batch * kvh * max_len * D elements per tensor, within int64 */
    TP_ARG_CHECK(max_len <= INT64_MAX / D / (kvh > 0 ? kvh : 1) / max_batch / 8,
                 "%s: max_batch %lld x max_len %lld overflows the cache's size", fn,
                 (long long)max_batch, (long long)max_len);
    tp_llm_cache *c = tp__calloc(1, sizeof *c);
    if (!c)
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
    c->owner = m;
    c->n_layers = n;
    c->max_batch = max_batch;
    c->max_len = max_len;
    c->kv_heads = kvh;
    c->head_dim = D;
    c->dtype = tp_tensor_dtype(emb);
    c->device = tp_tensor_device(emb);
    tp_status st = TP_OK;
    c->k = tp__calloc((size_t)n, sizeof *c->k);
    c->v = tp__calloc((size_t)n, sizeof *c->v);
    c->seen = tp__calloc((size_t)max_batch, sizeof *c->seen);
    c->seen_next = tp__calloc((size_t)max_batch, sizeof *c->seen_next);
    if (!c->k || !c->v || !c->seen || !c->seen_next) {
        st = tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
        goto out;
    }
    const int64_t shape[4] = {max_batch, kvh, max_len, D}, mshape[2] = {max_batch, max_len};
    for (int64_t i = 0; i < n; i++) {
        CHECK(tp_tensor_empty(c->dtype, c->device, 4, shape, &c->k[i]));
        CHECK(tp_tensor_empty(c->dtype, c->device, 4, shape, &c->v[i]));
    }
    CHECK(tp_tensor_zeros(TP_I64, c->device, 2, mshape, &c->mask));
    if (c->device.type == TP_DEVICE_CPU)
        c->mask_cpu = tp_tensor_retain(c->mask);
    else if (c->device.type != TP_DEVICE_META)
        CHECK(tp_tensor_zeros(TP_I64, TP_CPU, 2, mshape, &c->mask_cpu));
    *out = c;
    c = NULL;
out:
    tp_llm_cache_free(c);
    return st;
}

void tp_llm_cache_free(tp_llm_cache *c)
{
    if (!c)
        return;
    for (int64_t i = 0; c->k && i < c->n_layers; i++)
        tp_tensor_release(c->k[i]);
    for (int64_t i = 0; c->v && i < c->n_layers; i++)
        tp_tensor_release(c->v[i]);
    tp_tensor_release(c->mask);
    tp_tensor_release(c->mask_cpu);
    tp__free(c->k);
    tp__free(c->v);
    tp__free(c->seen);
    tp__free(c->seen_next);
    tp__free(c);
}

void tp_llm_cache_reset(tp_llm_cache *c)
{
    if (c) {
        c->len = c->batch = 0;
        c->padded = false;
    }
}

int64_t tp_llm_cache_length(const tp_llm_cache *c)
{
    return c ? c->len : 0;
}

int64_t tp_llm_cache_batch(const tp_llm_cache *c)
{
    return c ? c->batch : 0;
}

size_t tp_llm_cache_nbytes(const tp_llm_cache *c)
{
    if (!c)
        return 0;
    size_t n = tp_tensor_nbytes(c->mask);
    for (int64_t i = 0; i < c->n_layers; i++)
        n += tp_tensor_nbytes(c->k[i]) + tp_tensor_nbytes(c->v[i]);
    return n;
}

/* The view [:B, :, from:from+len] of a cache buffer (dim 2 is the position;
 * the mask's is dim 1). */
static tp_status window(tp_tensor *buf, int pos_dim, int64_t B, int64_t from, int64_t len,
                        tp_tensor **out)
{
    tp_tensor *rows = NULL;
    TP_CHECK(tp_tensor_narrow(buf, 0, 0, B, &rows));
    tp_status st = tp_tensor_narrow(rows, pos_dim, from, len, out);
    tp_tensor_release(rows);
    return st;
}

/* Writes x [B, kvh, S, D] at positions len.. of buf, then hands back the
 * view of every position so far. */
static tp_status append(tp_llm_cache *c, tp_tensor *buf, tp_tensor *x, tp_tensor **all)
{
    const int64_t B = c->call_batch, S = tp_tensor_size(x, 2);
    tp_tensor *dst = NULL;
    TP_CHECK(window(buf, 2, B, c->len, S, &dst));
    tp_status st = tp_tensor_copy(dst, x);
    tp_tensor_release(dst);
    if (st == TP_OK)
        st = window(buf, 2, B, 0, c->len + S, all);
    return st;
}

tp_status tp__llm_cache_attend(tp_llm_cache *c, int64_t layer, tp_tensor *q, tp_tensor *k,
                               tp_tensor *v, double scale, tp_tensor **out)
{
    const char *fn = "tp_llm_forward_cached";
    *out = NULL;
    TP_ARG_CHECK(layer >= 0 && layer < c->n_layers,
                 "%s: layer %lld is not among the cache's %lld layers", fn, (long long)layer,
                 (long long)c->n_layers);
    const tp_tensor *kv[2] = {k, v};
    for (int i = 0; i < 2; i++) {
        const tp_tensor *t = kv[i];
        TP_ARG_CHECK(!tp_tensor_is_dtensor(t) && tp_tensor_ndim(t) == 4 &&
                         tp_tensor_size(t, 0) == c->call_batch &&
                         tp_tensor_size(t, 1) == c->kv_heads &&
                         tp_tensor_size(t, 3) == c->head_dim,
                     "%s: layer %lld computes %s of %lld kv heads x %lld, the cache holds %lld "
                     "x %lld (a cache made before the model's plan changed?)", fn,
                     (long long)layer, i ? "values" : "keys", (long long)tp_tensor_size(t, 1),
                     (long long)tp_tensor_size(t, 3), (long long)c->kv_heads,
                     (long long)c->head_dim);
        TP_ARG_CHECK(tp_tensor_dtype(t) == c->dtype &&
                         tp_tensor_device(t).type == c->device.type &&
                         tp_tensor_device(t).index == c->device.index,
                     "%s: layer %lld computes %s in %s, the cache holds %s on another or the "
                     "same device (a cache made before the model's dtype or device changed?)",
                     fn, (long long)layer, i ? "values" : "keys",
                     tp_dtype_name(tp_tensor_dtype(t)), tp_dtype_name(c->dtype));
    }
    tp_tensor *ka = NULL, *va = NULL, *pad = NULL;
    tp_status st;
    CHECK(append(c, c->k[layer], k, &ka));
    CHECK(append(c, c->v[layer], v, &va));
    if (c->padded)
        CHECK(window(c->mask, 1, c->call_batch, 0, tp_tensor_size(ka, 2), &pad));
    const tp_sdpa_options o = {
        .causal = true, .scale = scale, .key_offset = c->len, .key_padding = pad};
    CHECK(tp__sdpa_with_capacity(q, ka, va, &o, c->max_len, out));
out:
    tp_tensor_release(pad);
    tp_tensor_release(va);
    tp_tensor_release(ka);
    return st;
}

/* ---- the cached forward ----------------------------------------------------------- */

/* Checks input_ids and the mask of a cached forward; fills the mask's new
 * columns and the position ids pos [B, S] (CPU), and sets *any_pad. Nothing
 * the cache keeps changes (seen_next takes the new counts). */
static tp_status stage(tp_llm_cache *c, const tp__llm *m, tp_tensor *ids, tp_tensor *mask,
                       tp_tensor *pos, bool *any_pad)
{
    const char *fn = "tp_llm_forward_cached";
    const int64_t B = tp_tensor_size(ids, 0), S = tp_tensor_size(ids, 1);
    const int64_t *idd = tp_tensor_data(ids);
    for (int64_t i = 0; i < B * S; i++)
        TP_ARG_CHECK(idd[i] >= 0 && idd[i] < m->cfg.vocab_size,
                     "%s: input_ids[%lld][%lld] is %lld, outside the vocabulary [0, %lld)", fn,
                     (long long)(i / S), (long long)(i % S), (long long)idd[i],
                     (long long)m->cfg.vocab_size);
    int64_t *md = c->mask_cpu ? tp_tensor_data(c->mask_cpu) : NULL, *pd = tp_tensor_data(pos);
    const bool i32 = mask && tp_tensor_dtype(mask) == TP_I32;
    const void *mk = mask ? tp_tensor_data(mask) : NULL;
    *any_pad = false;
    for (int64_t b = 0; b < B; b++) {
        int64_t seen = c->len ? c->seen[b] : 0;
        for (int64_t s = 0; s < S; s++) {
            const int64_t mv = !mk ? 1 : i32 ? ((const int32_t *)mk)[b * S + s]
                                             : ((const int64_t *)mk)[b * S + s];
            TP_ARG_CHECK(mv == 0 || mv == 1,
                         "%s: attention_mask[%lld][%lld] is %lld; it must be 0 or 1", fn,
                         (long long)b, (long long)s, (long long)mv);
            if (md)
                md[b * c->max_len + c->len + s] = mv;
            *any_pad |= mv == 0;
            pd[b * S + s] = mv ? seen++ : 0; /* transformers' fill for padding */
        }
        c->seen_next[b] = seen;
    }
    return TP_OK;
}

/* Refuses a plan with sequence parallelism: its norms hold DTensor weights. */
static tp_status check_no_sp(tp_module *model)
{
    tp_tensor *w =
        tp_module_parameter(tp_module_child(tp_module_child(model, "model"), "norm"), "weight");
    TP_ARG_CHECK(!w || !tp_tensor_is_dtensor(w),
                 "tp_llm_forward_cached: model.norm is sequence-parallel (its weight is a "
                 "DTensor); decoding runs one token at a time: parallelize without "
                 "sequence_parallel to generate");
    return TP_OK;
}

tp_status tp_llm_forward_cached(tp_module *model, tp_llm_cache *c, tp_tensor *ids,
                                tp_tensor *mask, int64_t keep, tp_tensor **logits)
{
    const char *fn = "tp_llm_forward_cached";
    TP_ARG_CHECK(logits, "%s: logits is NULL", fn);
    *logits = NULL;
    const tp__llm *m = tp__llm_of(model);
    TP_ARG_CHECK(m, "%s: model is not a model tp_llm_create made", fn);
    TP_ARG_CHECK(c, "%s: cache is NULL", fn);
    TP_ARG_CHECK(c->owner == m, "%s: the cache belongs to another model", fn);
    TP_ARG_CHECK(ids, "%s: input_ids is NULL", fn);
    TP_ARG_CHECK(!tp_tensor_is_dtensor(ids) && tp_tensor_ndim(ids) == 2 &&
                     tp_tensor_dtype(ids) == TP_I64 &&
                     tp_tensor_device(ids).type == TP_DEVICE_CPU && tp_tensor_is_contiguous(ids),
                 "%s: input_ids must be a plain contiguous i64 CPU tensor [batch, seq]", fn);
    const int64_t B = tp_tensor_size(ids, 0), S = tp_tensor_size(ids, 1);
    TP_ARG_CHECK(B > 0 && S > 0, "%s: input_ids [%lld, %lld] holds no tokens", fn, (long long)B,
                 (long long)S);
    TP_ARG_CHECK(B <= c->max_batch, "%s: a batch of %lld exceeds the cache's max_batch %lld", fn,
                 (long long)B, (long long)c->max_batch);
    TP_ARG_CHECK(c->len == 0 || B == c->batch,
                 "%s: a batch of %lld after a prefill of %lld (tp_llm_cache_reset starts new "
                 "sequences)", fn, (long long)B, (long long)c->batch);
    TP_ARG_CHECK(S <= c->max_len - c->len,
                 "%s: %lld new positions after %lld exceed the cache's max_len %lld", fn,
                 (long long)S, (long long)c->len, (long long)c->max_len);
    TP_ARG_CHECK(keep >= 0 && keep <= S, "%s: logits_to_keep %lld is outside [0, %lld]", fn,
                 (long long)keep, (long long)S);
    if (mask) {
        TP_ARG_CHECK(!tp_tensor_is_dtensor(mask) && tp_tensor_ndim(mask) == 2 &&
                         tp_tensor_size(mask, 0) == B && tp_tensor_size(mask, 1) == S &&
                         (tp_tensor_dtype(mask) == TP_I64 || tp_tensor_dtype(mask) == TP_I32) &&
                         tp_tensor_device(mask).type == TP_DEVICE_CPU &&
                         tp_tensor_is_contiguous(mask),
                     "%s: attention_mask must be a plain contiguous i64 or i32 CPU tensor "
                     "[%lld, %lld], input_ids' shape", fn, (long long)B, (long long)S);
    }
    if (m->cfg.sliding_window > 0)
        TP_ARG_CHECK(c->len + S <= m->cfg.sliding_window,
                     "%s: %lld positions exceed sliding_window %lld, which libtp does not apply",
                     fn, (long long)(c->len + S), (long long)m->cfg.sliding_window);
    TP_CHECK(check_no_sp(model));
    if (!keep)
        keep = S;
    const int64_t pshape[2] = {B, S};
    tp_tensor *pos = NULL, *pos_dev = NULL, *ids_dev = NULL, *h = NULL, *hk = NULL, *lg = NULL;
    bool any_pad = false, grad_off = false;
    const bool padded_before = c->padded;
    tp_status st;
    CHECK(tp_tensor_empty(TP_I64, TP_CPU, 2, pshape, &pos));
    CHECK(stage(c, m, ids, mask, pos, &any_pad));
    if (c->mask_cpu && c->mask_cpu != c->mask) {
        tp_tensor *src = NULL, *dst = NULL;
        st = window(c->mask_cpu, 1, B, c->len, S, &src);
        if (st == TP_OK)
            st = window(c->mask, 1, B, c->len, S, &dst);
        if (st == TP_OK)
            st = tp_tensor_copy(dst, src);
        tp_tensor_release(dst);
        tp_tensor_release(src);
        CHECK(st);
    }
    if (c->device.type != TP_DEVICE_CPU) {
        CHECK(tp_tensor_to(pos, TP_I64, c->device, &pos_dev));
        CHECK(tp_tensor_to(ids, TP_I64, c->device, &ids_dev));
    } else {
        pos_dev = tp_tensor_retain(pos);
        ids_dev = tp_tensor_retain(ids);
    }
    c->call_batch = B;
    c->padded = (c->len && c->padded) || any_pad;
    m->run->cache = c;
    tp_no_grad_begin();
    grad_off = true;
    const tp_kwarg kw = {"position_ids", pos_dev};
    CHECK(tp_module_forward(tp_module_child(model, "model"), 1, &ids_dev, 1, &kw, &h));
    if (keep < S)
        CHECK(tp_narrow(h, 1, S - keep, keep, &hk));
    else
        hk = tp_tensor_retain(h);
    CHECK(tp_module_call(tp_module_child(model, "lm_head"), hk, &lg));
    if (tp_tensor_is_dtensor(lg))
        CHECK(tp_dtensor_full_tensor(lg, logits));
    else
        *logits = tp_tensor_retain(lg);
    c->len += S;
    c->batch = B;
    memcpy(c->seen, c->seen_next, sizeof *c->seen * (size_t)B);
out:
    if (grad_off)
        tp_no_grad_end();
    m->run->cache = NULL;
    if (st != TP_OK)
        c->padded = padded_before; /* the cache as it was: len moves on success only */
    tp_tensor_release(lg);
    tp_tensor_release(hk);
    tp_tensor_release(h);
    tp_tensor_release(ids_dev);
    tp_tensor_release(pos_dev);
    tp_tensor_release(pos);
    return st;
}

/* ---- choosing the next token --------------------------------------------------------- */

typedef struct {
    float score; /* logit / temperature */
    float w;     /* exp(score - the largest score): the unnormalized probability */
    int64_t id;
} cand;

static int by_score_desc(const void *a, const void *b)
{
    const cand *x = a, *y = b;
    if (x->score != y->score)
        return x->score > y->score ? -1 : 1;
    return x->id < y->id ? -1 : x->id > y->id;
}

/* The k-th largest of v[0..n) (1-based k <= n), by selection on scratch. */
static float kth_largest(const float *v, int64_t n, int64_t k, float *scratch)
{
    memcpy(scratch, v, sizeof *scratch * (size_t)n);
    int64_t lo = 0, hi = n - 1, want = k - 1; /* index in descending order */
    while (lo < hi) {
        const float p = scratch[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (scratch[i] > p)
                i++;
            while (scratch[j] < p)
                j--;
            if (i <= j) {
                float t = scratch[i];
                scratch[i++] = scratch[j];
                scratch[j--] = t;
            }
        }
        if (want <= j)
            hi = j;
        else if (want >= i)
            lo = i;
        else
            break;
    }
    return scratch[want];
}

static tp_status check_sampling(const char *fn, const tp_llm_sampling *s)
{
    TP_ARG_CHECK(!isnan(s->temperature) && s->temperature >= 0,
                 "%s: temperature %g must be positive", fn, s->temperature);
    TP_ARG_CHECK(s->top_k >= 0, "%s: top_k %lld is negative", fn, (long long)s->top_k);
    TP_ARG_CHECK(!isnan(s->top_p) && s->top_p >= 0 && s->top_p <= 1,
                 "%s: top_p %g is outside (0, 1]", fn, s->top_p);
    return TP_OK;
}

/* One row: greedy, or the draw u in [0, 1) from the filtered softmax. */
static int64_t choose_row(const float *row, int64_t V, const tp_llm_sampling *s, double u,
                          cand *cs, float *scratch)
{
    if (!s->do_sample) {
        int64_t best = 0;
        for (int64_t i = 1; i < V; i++)
            if (row[i] > row[best] || (isnan(row[i]) && !isnan(row[best])))
                best = i;
        return best;
    }
    const double t = s->temperature > 0 ? s->temperature : 1.0;
    const double top_p = s->top_p > 0 ? s->top_p : 1.0;
    float thresh = -INFINITY;
    if (s->top_k > 0 && s->top_k < V)
        thresh = kth_largest(row, V, s->top_k, scratch);
    int64_t n = 0;
    float mx = -INFINITY;
    for (int64_t i = 0; i < V; i++)
        if (row[i] >= thresh) {
            cs[n++] = (cand){(float)(row[i] / t), 0.0f, i};
            if (cs[n - 1].score > mx)
                mx = cs[n - 1].score;
        }
    if (n == 0 || !isfinite(mx))
        return n ? cs[0].id : 0;
    double total = 0;
    for (int64_t i = 0; i < n; i++)
        total += cs[i].w = expf(cs[i].score - mx);
    if (top_p < 1.0) {
        /* transformers' rule: in ascending order of probability, drop tokens
         * while the cumulative probability stays <= 1 - top_p; the most
         * likely stays. The tokens under (1 - top_p) / n each add up to less
         * than 1 - top_p together and come first in that order: they are
         * dropped before the sort, which orders only the rest (a few
         * hundred of a 32k vocabulary where a model is sure, not all) */
        const double floor_w = (1.0 - top_p) / (double)n * total, limit = (1.0 - top_p) * total;
        double cum = 0;
        int64_t m = 0;
        for (int64_t i = 0; i < n; i++) {
            if (cs[i].w < floor_w)
                cum += cs[i].w;
            else
                cs[m++] = cs[i];
        }
        qsort(cs, (size_t)m, sizeof *cs, by_score_desc);
        int64_t keep = m;
        for (int64_t i = m - 1; i > 0; i--) {
            cum += cs[i].w;
            if (cum > limit)
                break;
            keep = i;
        }
        n = keep;
        total = 0;
        for (int64_t i = 0; i < n; i++)
            total += cs[i].w;
    }
    const double target = u * total;
    double cum = 0;
    for (int64_t i = 0; i < n; i++) {
        cum += cs[i].w;
        if (cum > target)
            return cs[i].id;
    }
    return cs[n - 1].id;
}

tp_status tp_llm_sample(tp_tensor *logits, const tp_llm_sampling *sampling, uint64_t step,
                        int64_t *ids)
{
    const char *fn = "tp_llm_sample";
    TP_ARG_CHECK(logits, "%s: logits is NULL", fn);
    TP_ARG_CHECK(ids, "%s: ids is NULL", fn);
    const tp_llm_sampling s = sampling ? *sampling : (tp_llm_sampling){0};
    TP_CHECK(check_sampling(fn, &s));
    const int nd = tp_tensor_ndim(logits);
    TP_ARG_CHECK(!tp_tensor_is_dtensor(logits) &&
                     (nd == 2 || (nd == 3 && tp_tensor_size(logits, 1) == 1)),
                 "%s: logits must be a plain [batch, vocab] or [batch, 1, vocab] tensor", fn);
    TP_ARG_CHECK(tp_dtype_is_float(tp_tensor_dtype(logits)), "%s: logits are %s, not floats", fn,
                 tp_dtype_name(tp_tensor_dtype(logits)));
    const int64_t B = tp_tensor_size(logits, 0), V = tp_tensor_size(logits, nd - 1);
    TP_ARG_CHECK(V > 0, "%s: logits hold an empty vocabulary", fn);
    tp_tensor *f = NULL;
    if (tp_tensor_dtype(logits) == TP_F32 && tp_tensor_device(logits).type == TP_DEVICE_CPU &&
        tp_tensor_is_contiguous(logits))
        f = tp_tensor_retain(logits);
    else
        TP_CHECK(tp_tensor_to(logits, TP_F32, (tp_device){TP_DEVICE_CPU, 0}, &f));
    cand *cs = s.do_sample ? tp__malloc(sizeof *cs * (size_t)V) : NULL;
    float *scratch = s.do_sample ? tp__malloc(sizeof *scratch * (size_t)V) : NULL;
    tp_status st = TP_OK;
    if (s.do_sample && (!cs || !scratch))
        st = tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
    const float *d = tp_tensor_data(f);
    for (int64_t b = 0; b < B && st == TP_OK; b++)
        ids[b] = choose_row(d + b * V, V, &s, tp_rng_uniform(s.seed, (step << 32) + (uint64_t)b),
                            cs, scratch);
    tp__free(scratch);
    tp__free(cs);
    tp_tensor_release(f);
    return st;
}

/* ---- generation ------------------------------------------------------------------------- */

static int cmp_double(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Nearest-rank percentile q of n sorted values. */
static double percentile(const double *v, int64_t n, double q)
{
    if (n == 0)
        return 0;
    int64_t r = (int64_t)ceil(q * (double)n);
    return v[(r < 1 ? 1 : r > n ? n : r) - 1];
}

static bool is_eos(int64_t id, int n, const int64_t *eos)
{
    for (int i = 0; i < n; i++)
        if (eos[i] == id)
            return true;
    return false;
}

tp_status tp_llm_generate(tp_module *model, tp_tensor *ids, tp_tensor *mask,
                          const tp_llm_generate_options *opts, tp_tensor **tokens,
                          tp_llm_generate_stats *stats)
{
    const char *fn = "tp_llm_generate";
    TP_ARG_CHECK(tokens, "%s: tokens is NULL", fn);
    *tokens = NULL;
    if (stats)
        memset(stats, 0, sizeof *stats);
    const tp__llm *m = tp__llm_of(model);
    TP_ARG_CHECK(m, "%s: model is not a model tp_llm_create made", fn);
    TP_ARG_CHECK(opts, "%s: opts is NULL", fn);
    TP_ARG_CHECK(ids && tp_tensor_ndim(ids) == 2 && tp_tensor_dtype(ids) == TP_I64 &&
                     !tp_tensor_is_dtensor(ids) && tp_tensor_device(ids).type == TP_DEVICE_CPU,
                 "%s: input_ids must be a plain i64 CPU tensor [batch, seq]", fn);
    const int64_t B = tp_tensor_size(ids, 0), S = tp_tensor_size(ids, 1);
    const int64_t N = opts->max_new_tokens;
    TP_ARG_CHECK(B > 0 && S > 0, "%s: input_ids [%lld, %lld] holds no prompt", fn,
                 (long long)B, (long long)S);
    TP_ARG_CHECK(N > 0, "%s: max_new_tokens %lld must be positive", fn, (long long)N);
    TP_CHECK(check_sampling(fn, &opts->sampling));
    TP_ARG_CHECK(opts->n_eos <= 0 || opts->eos_token_ids,
                 "%s: n_eos %d with eos_token_ids NULL", fn, opts->n_eos);
    const int n_eos = opts->n_eos > 0 ? opts->n_eos : opts->n_eos < 0 ? 0 : m->cfg.n_eos;
    const int64_t *eos = opts->n_eos > 0 ? opts->eos_token_ids : m->cfg.eos_token_id;
    const int64_t pad = opts->pad_token_id >= 0 ? opts->pad_token_id
                        : m->cfg.pad_token_id >= 0 ? m->cfg.pad_token_id
                        : n_eos > 0 ? eos[0] : 0;
    TP_ARG_CHECK(pad < m->cfg.vocab_size, "%s: pad_token_id %lld is outside the vocabulary "
                 "[0, %lld)", fn, (long long)pad, (long long)m->cfg.vocab_size);
    if (mask && tp_tensor_ndim(mask) == 2 && tp_tensor_size(mask, 0) == B &&
        tp_tensor_size(mask, 1) == S && tp_tensor_device(mask).type == TP_DEVICE_CPU &&
        tp_tensor_is_contiguous(mask) &&
        (tp_tensor_dtype(mask) == TP_I64 || tp_tensor_dtype(mask) == TP_I32)) {
        for (int64_t b = 0; b < B; b++) {
            bool any = false;
            for (int64_t s = 0; s < S && !any; s++)
                any = tp_tensor_dtype(mask) == TP_I32
                          ? ((const int32_t *)tp_tensor_data(mask))[b * S + s] != 0
                          : ((const int64_t *)tp_tensor_data(mask))[b * S + s] != 0;
            TP_ARG_CHECK(any, "%s: prompt %lld has no real token (its attention_mask row is "
                         "all 0)", fn, (long long)b);
            const int64_t last = tp_tensor_dtype(mask) == TP_I32
                                     ? ((const int32_t *)tp_tensor_data(mask))[b * S + S - 1]
                                     : ((const int64_t *)tp_tensor_data(mask))[b * S + S - 1];
            TP_ARG_CHECK(last != 0, "%s: prompt %lld ends with padding (attention_mask 0 at "
                         "its last position): the next token follows the last position, so "
                         "prompts are padded on the left", fn, (long long)b);
        }
    }
    tp_llm_cache *cache = opts->cache, *own = NULL;
    if (cache) {
        TP_ARG_CHECK(cache->max_batch >= B && cache->max_len - S >= N,
                     "%s: the cache (max_batch %lld, max_len %lld) is too small for %lld "
                     "prompts of %lld tokens and %lld new ones", fn,
                     (long long)cache->max_batch, (long long)cache->max_len, (long long)B,
                     (long long)S, (long long)N);
        tp_llm_cache_reset(cache);
    } else {
        TP_ARG_CHECK(N <= INT64_MAX - S, "%s: max_new_tokens %lld is too large", fn,
                     (long long)N);
        TP_CHECK(tp_llm_cache_create(model, B, S + N, &own));
        cache = own;
    }
    int64_t *out_buf = tp__malloc(sizeof *out_buf * (size_t)(B * N)),
            *next = tp__malloc(sizeof *next * (size_t)B);
    bool *done = tp__calloc((size_t)B, sizeof *done);
    double *steps = tp__malloc(sizeof *steps * (size_t)N);
    tp_tensor *logits = NULL, *step_ids = NULL;
    tp_status st = TP_OK;
    if (!out_buf || !next || !done || !steps) {
        st = tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
        goto out;
    }
    double t0 = tp__now();
    CHECK(tp_llm_forward_cached(model, cache, ids, mask, 1, &logits));
    CHECK(tp_llm_sample(logits, &opts->sampling, 0, next));
    const double prefill = tp__now() - t0;
    const int64_t one[2] = {B, 1};
    CHECK(tp_tensor_empty(TP_I64, TP_CPU, 2, one, &step_ids));
    int64_t T = 0, nsteps = 0;
    for (;;) {
        bool all_done = true;
        for (int64_t b = 0; b < B; b++) {
            const int64_t id = done[b] ? pad : next[b];
            out_buf[b * N + T] = id;
            ((int64_t *)tp_tensor_data(step_ids))[b] = id;
            done[b] = done[b] || is_eos(id, n_eos, eos);
            all_done = all_done && done[b];
        }
        T++;
        if (all_done || T == N)
            break;
        const double ts = tp__now();
        tp_tensor_release(logits);
        logits = NULL;
        CHECK(tp_llm_forward_cached(model, cache, step_ids, NULL, 1, &logits));
        CHECK(tp_llm_sample(logits, &opts->sampling, (uint64_t)T, next));
        steps[nsteps++] = tp__now() - ts;
    }
    const int64_t oshape[2] = {B, T};
    CHECK(tp_tensor_empty(TP_I64, TP_CPU, 2, oshape, tokens));
    for (int64_t b = 0; b < B; b++)
        memcpy((int64_t *)tp_tensor_data(*tokens) + b * T, out_buf + b * N,
               sizeof *out_buf * (size_t)T);
    if (stats) {
        stats->prefill_s = prefill;
        for (int64_t i = 0; i < nsteps; i++)
            stats->decode_s += steps[i];
        stats->decode_steps = nsteps;
        qsort(steps, (size_t)nsteps, sizeof *steps, cmp_double);
        stats->step_p50_s = percentile(steps, nsteps, 0.5);
        stats->step_p99_s = percentile(steps, nsteps, 0.99);
        stats->cache_bytes = tp_llm_cache_nbytes(cache);
    }
out:
    tp_tensor_release(step_ids);
    tp_tensor_release(logits);
    tp__free(steps);
    tp__free(done);
    tp__free(next);
    tp__free(out_buf);
    tp_llm_cache_free(own);
    return st;
}
