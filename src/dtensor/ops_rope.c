/* Rotary position embedding as Hugging Face transformers 5.x computes it for
 * Llama, Mistral and Qwen2: the inverse frequencies of the rope types
 * default, linear, dynamic and llama3 (modeling_rope_utils.py), cos and sin
 * (LlamaRotaryEmbedding.forward) and y = x cos + rotate_half(x) sin
 * (apply_rotary_pos_emb).
 *
 * The inverse frequencies are computed on the host in f32, one torch
 * operation at a time with the rounding torch gives it (a Python float
 * operand is rounded to f32 first; `a / t` is torch's t.reciprocal() * a),
 * so that only the power, whose torch result is itself within an ulp of the
 * correctly rounded one, can differ from HF's. cos and sin are computed by the
 * engine of the positions' device (rope_cos_sin: one f32 product per angle,
 * as HF's freqs), from the positions where they live: a GPU computes them
 * itself from an inv_freq of head_dim / 2 floats copied to it rather than
 * receiving B * S * head_dim values from the host. The positions are still
 * read on the host, to check them and for dynamic's maximum, as
 * tp_embedding reads its indices. */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "dtensor/ops_internal.h"

static const char *const rope_names[] = {"default", "linear", "dynamic", "llama3"};

/* Every field cfg's type uses, checked; the others are ignored. */
static tp_status rope_check(const char *fn, const tp_rope_config *cfg)
{
    TP_ARG_CHECK(cfg, "%s: cfg is NULL", fn);
    TP_ARG_CHECK((int)cfg->type >= (int)TP_ROPE_DEFAULT && (int)cfg->type <= (int)TP_ROPE_LLAMA3,
                 "%s: type %d is not a rope type (default 0, linear 1, dynamic 2, llama3 3)", fn,
                 (int)cfg->type);
    const char *t = rope_names[cfg->type];
    TP_ARG_CHECK(cfg->head_dim > 0 && cfg->head_dim % 2 == 0,
                 "%s: head_dim %lld must be positive and even", fn, (long long)cfg->head_dim);
    TP_ARG_CHECK(cfg->theta >= 0 && cfg->theta <= FLT_MAX,
                 "%s: theta %g must be >= 0 and finite in f32 (0 means 10000)", fn, cfg->theta);
    if (cfg->type == TP_ROPE_DEFAULT)
        return TP_OK;
    TP_ARG_CHECK(cfg->factor >= 1 && cfg->factor <= FLT_MAX,
                 "%s: factor %g must be >= 1 (and finite) for %s scaling", fn, cfg->factor, t);
    if (cfg->type == TP_ROPE_DYNAMIC) {
        TP_ARG_CHECK(cfg->max_position_embeddings > 0,
                     "%s: max_position_embeddings %lld must be positive for dynamic scaling", fn,
                     (long long)cfg->max_position_embeddings);
        TP_ARG_CHECK(cfg->head_dim > 2,
                     "%s: head_dim 2 is too small for dynamic scaling (its exponent is head_dim "
                     "/ (head_dim - 2))",
                     fn);
    }
    if (cfg->type == TP_ROPE_LLAMA3) {
        TP_ARG_CHECK(cfg->low_freq_factor > 0 && cfg->low_freq_factor <= FLT_MAX,
                     "%s: low_freq_factor %g must be positive for llama3 scaling", fn,
                     cfg->low_freq_factor);
        TP_ARG_CHECK(cfg->high_freq_factor > cfg->low_freq_factor &&
                         cfg->high_freq_factor <= FLT_MAX,
                     "%s: high_freq_factor %g must exceed low_freq_factor %g for llama3 scaling",
                     fn, cfg->high_freq_factor, cfg->low_freq_factor);
        TP_ARG_CHECK(cfg->original_max_position_embeddings > 0,
                     "%s: original_max_position_embeddings %lld must be positive for llama3 "
                     "scaling",
                     fn, (long long)cfg->original_max_position_embeddings);
    }
    return TP_OK;
}

/* 1 / base ** (arange(0, dim, 2).float() / dim) at i2 = 2i: the exponent
 * an f32 division, the power correctly rounded (torch's SLEEF power is
 * within an ulp of it), the reciprocal in f32. */
static float rope_base_inv(float base, int64_t i2, int64_t dim)
{
    const float e = (float)i2 / (float)dim;
    return 1.0f / (float)pow((double)base, (double)e);
}

/* _compute_llama3_parameters on one element, its torch operations in f32:
 * wavelen = 2 pi / inv (reciprocal, times 2 pi in f32); low frequencies
 * (wavelen > low_freq_wavelen) divided by factor; the band between the two
 * wavelengths smoothed. */
static float rope_llama3(const tp_rope_config *cfg, float inv)
{
    const double old = (double)cfg->original_max_position_embeddings;
    const float factor = (float)cfg->factor, low = (float)cfg->low_freq_factor;
    const float low_wl = (float)(old / cfg->low_freq_factor);
    const float high_wl = (float)(old / cfg->high_freq_factor);
    const float wl = (1.0f / inv) * (float)(2.0 * 3.141592653589793);
    const float scaled = wl > low_wl ? inv / factor : inv;
    float smooth = (1.0f / wl) * (float)old - low;
    smooth = smooth / (float)(cfg->high_freq_factor - cfg->low_freq_factor);
    const float smoothed = (1.0f - smooth) * scaled / factor + smooth * scaled;
    const bool medium = !(wl < high_wl) && !(wl > low_wl);
    return medium ? smoothed : scaled;
}

/* The base dynamic scaling gives at seq_len: below max_position_embeddings
 * the init-time one (Python floats: theta itself, up to rounding); above it
 * the one the module's forward computes from its int64 seq_len tensor, in
 * f32 (the exponent, a Python float, stays double in torch's pow). */
static float rope_dynamic_base(const tp_rope_config *cfg, double theta, int64_t seq_len)
{
    const int64_t mp = cfg->max_position_embeddings, dim = cfg->head_dim;
    const double ex = (double)dim / (double)(dim - 2), factor = cfg->factor;
    if (seq_len <= mp)
        return (float)(theta * pow(factor * (double)mp / (double)mp - (factor - 1.0), ex));
    float g = (float)factor * (float)seq_len;
    g = g / (float)mp;
    g = g - (float)(factor - 1.0);
    return (float)theta * (float)pow((double)g, ex);
}

/* inv_freq of a checked config (and seq_len >= 0). */
static void rope_compute(const tp_rope_config *cfg, int64_t seq_len, float *inv)
{
    const int64_t dim = cfg->head_dim;
    const double theta = cfg->theta != 0 ? cfg->theta : 10000.0;
    const float base =
        cfg->type == TP_ROPE_DYNAMIC ? rope_dynamic_base(cfg, theta, seq_len) : (float)theta;
    for (int64_t i = 0; i < dim / 2; i++) {
        float v = rope_base_inv(base, 2 * i, dim);
        if (cfg->type == TP_ROPE_LINEAR)
            v = v / (float)cfg->factor;
        else if (cfg->type == TP_ROPE_LLAMA3)
            v = rope_llama3(cfg, v);
        inv[i] = v;
    }
}

tp_status tp_rope_inv_freq(const tp_rope_config *cfg, int64_t seq_len, float *inv_freq,
                           double *attention_scaling)
{
    const char *fn = "rope_inv_freq";
    TP_CHECK(rope_check(fn, cfg));
    TP_ARG_CHECK(inv_freq, "%s: inv_freq is NULL", fn);
    TP_ARG_CHECK(seq_len >= 0, "%s: seq_len %lld is negative", fn, (long long)seq_len);
    rope_compute(cfg, seq_len, inv_freq);
    if (attention_scaling)
        *attention_scaling = 1.0; /* HF's attention_factor for these four types */
    return TP_OK;
}

/* ---- cos and sin ------------------------------------------------------------- */

/* position_ids' placements: Shard and Replicate only; no shard for dynamic
 * (its maximum is over the whole tensor). */
static tp_status rope_check_placements(const char *fn, const tp_rope_config *cfg,
                                       const tp__dist *dist)
{
    for (int d = 0; d < dist->mesh_ndim; d++) {
        const tp_placement p = dist->placements[d];
        if (p.kind == TP_PLACEMENT_PARTIAL)
            return tp__error(TP_ERR_NOT_SUPPORTED,
                             "%s: position_ids are Partial on mesh dim %d; positions must be "
                             "Shard or Replicate",
                             fn, d);
        if (p.kind == TP_PLACEMENT_SHARD && cfg->type == TP_ROPE_DYNAMIC)
            return tp__error(TP_ERR_NOT_SUPPORTED,
                             "%s: dynamic scaling needs the largest position of all of "
                             "position_ids, which are Shard(%d) on mesh dim %d: pass them "
                             "Replicate",
                             fn, p.dim, d);
    }
    return TP_OK;
}

/* The local positions as a contiguous host i64 tensor (a view when they are
 * one already); NULL for meta tensors, which have no values. */
static tp_status rope_host_positions(tp_tensor *local, tp_tensor **out)
{
    *out = NULL;
    if (tp_tensor_is_meta(local))
        return TP_OK;
    if (tp_tensor_device(local).type == TP_DEVICE_CPU && tp_tensor_is_contiguous(local))
        return tp_tensor_view(local, local->ndim, local->shape, out);
    return tp_tensor_to(local, TP_I64, TP_CPU, out);
}

/* Checks the host positions (global index through `off`, the block's offset)
 * and gives their maximum (-1 for none). */
static tp_status rope_scan_positions(const char *fn, const tp_tensor *host, const int64_t *off,
                                     int64_t *max)
{
    const int64_t *p = tp_tensor_data(host), S = host->shape[1];
    *max = -1;
    for (int64_t e = 0; e < tp_tensor_numel(host); e++) {
        if (p[e] < 0)
            return tp__error(TP_ERR_INVALID_ARG, "%s: position_ids[%lld, %lld] = %lld is negative",
                             fn, (long long)(off[0] + e / S), (long long)(off[1] + e % S),
                             (long long)p[e]);
        if (p[e] > *max)
            *max = p[e];
    }
    return TP_OK;
}

tp_status tp_rope_cos_sin(const tp_rope_config *cfg, tp_tensor *position_ids, tp_dtype dtype,
                          tp_tensor **cos, tp_tensor **sin)
{
    const char *fn = "rope_cos_sin";
    TP_ARG_CHECK(cos && sin, "%s: %s is NULL", fn, cos ? "sin" : "cos");
    *cos = *sin = NULL;
    TP_CHECK(rope_check(fn, cfg));
    TP_ARG_CHECK(position_ids, "%s: position_ids is NULL", fn);
    TP_ARG_CHECK(position_ids->dtype == TP_I64, "%s: position_ids are %s; they must be i64", fn,
                 tp_dtype_name(position_ids->dtype));
    TP_ARG_CHECK(position_ids->ndim == 2,
                 "%s: position_ids have %d dims; they must be [batch, seq]", fn,
                 position_ids->ndim);
    const tp__dist *dist = tp__dist_of(position_ids);
    if (dist)
        TP_CHECK(rope_check_placements(fn, cfg, dist));
    tp_tensor *local = dist ? dist->local : position_ids;
    const tp_device dev = tp_tensor_device(local);
    const tp__kernels *k = NULL;
    TP_CHECK(tp__kernels_for(dev, &k));
    if (!k->supports(TP__KOP_ROPE_COS_SIN, dtype))
        return tp__error(TP_ERR_NOT_SUPPORTED,
                         "%s: dtype %s is not one the %s kernels take (f32, bf16 and f16)", fn,
                         tp_dtype_name(dtype), k->name);

    const int64_t D = cfg->head_dim, half = D / 2, B = local->shape[0], S = local->shape[1];
    const int64_t shape[3] = {B, S, D};
    const int64_t gshape[3] = {position_ids->shape[0], position_ids->shape[1], D};
    int64_t off[2] = {0, 0}, lshape[2], max = -1;
    if (dist)
        tp__shard_extent(dist->mesh, 2, position_ids->shape, dist->placements, NULL, lshape, off);
    tp_tensor *host = NULL, *pos = NULL, *invh = NULL, *invd = NULL, *c = NULL, *s = NULL;
    double scaling = 1.0;
    tp_status st;
    TP_CHECK_GOTO(rope_host_positions(local, &host), st, done);
    if (host)
        TP_CHECK_GOTO(rope_scan_positions(fn, host, off, &max), st, done);
    /* the positions where the kernel runs: the host copy on the CPU, the
     * caller's tensor on a device when it is contiguous there */
    if (dev.type == TP_DEVICE_CPU || (!tp_tensor_is_contiguous(local) && host))
        st = dev.type == TP_DEVICE_CPU ? tp_tensor_view(host, 2, host->shape, &pos)
                                       : tp_tensor_to(host, TP_I64, dev, &pos);
    else
        st = tp_tensor_view(local, 2, local->shape, &pos);
    if (st != TP_OK)
        goto done;
    TP_CHECK_GOTO(tp_tensor_empty(TP_F32, TP_CPU, 1, &half, &invh), st, done);
    TP_CHECK_GOTO(tp_rope_inv_freq(cfg, max + 1, tp_tensor_data(invh), &scaling), st, done);
    if (dev.type == TP_DEVICE_CPU)
        invd = tp_tensor_retain(invh);
    else
        TP_CHECK_GOTO(tp_tensor_to(invh, TP_F32, dev, &invd), st, done);
    TP_CHECK_GOTO(tp__new(dtype, dev, 3, shape, false, &c), st, done);
    TP_CHECK_GOTO(tp__new(dtype, dev, 3, shape, false, &s), st, done);
    TP_CHECK_GOTO(k->rope_cos_sin(dev, dtype, tp_tensor_data(pos), tp_tensor_data(invd),
                                  tp_tensor_data(c), tp_tensor_data(s), B * S, D, (float)scaling),
                  st, done);
    if (dist) {
        TP_CHECK_GOTO(tp__dtensor_wrap(dist->mesh, c, dist->placements, 3, gshape, cos), st, done);
        st = tp__dtensor_wrap(dist->mesh, s, dist->placements, 3, gshape, sin);
        if (st != TP_OK) {
            tp_tensor_release(*cos);
            *cos = NULL;
        }
    } else {
        *cos = tp_tensor_retain(c);
        *sin = tp_tensor_retain(s);
    }
done:
    tp_tensor_release(host);
    tp_tensor_release(pos);
    tp_tensor_release(invh);
    tp_tensor_release(invd);
    tp_tensor_release(c);
    tp_tensor_release(s);
    return st;
}

/* ---- the op -------------------------------------------------------------------- */

static int rope_strategies(const tp__op *op, int mesh_dim, tp__strategy *s)
{
    (void)mesh_dim;
    const tp_placement R = tp__R(), P = tp__P();
    /* cos and sin follow a batch shard when they have the batch dim */
    const tp_placement cb = tp__op_gshape(op, 1)[0] == 1 ? R : tp__S(0);
    int n = 0;
    s[n++] = (tp__strategy){{tp__S(1), R, R}, tp__S(1), {tp__S(1), R, R}};
    s[n++] = (tp__strategy){{tp__S(0), cb, cb}, tp__S(0), {tp__S(0), cb, cb}};
    s[n++] = (tp__strategy){{tp__S(2), tp__S(1), tp__S(1)}, tp__S(2),
                            {tp__S(2), tp__S(1), tp__S(1)}};
    s[n++] = (tp__strategy){{P, R, R}, P, {R, R, R}};
    s[n++] = (tp__strategy){{R, R, R}, R, {R, R, R}};
    return n;
}

static tp_status rope_shape(const tp__op *op, int *ndim, int64_t *shape)
{
    *ndim = 4;
    memcpy(shape, tp__op_gshape(op, 0), 4 * sizeof *shape);
    return TP_OK;
}

/* out = rope_fwd(x) or rope_bwd(x) with the local cos and sin. */
static tp_status rope_local(tp__op *op, tp_tensor *x, tp_tensor *cosl, tp_tensor *sinl, bool bwd,
                            tp_tensor **out)
{
    const int64_t B = x->shape[0], H = x->shape[1], S = x->shape[2], D = x->shape[3];
    /* the strategies shard cos's batch exactly when they shard x's */
    TP_ASSERT((cosl->shape[0] == 1 || cosl->shape[0] == B) && cosl->shape[1] == S);
    const int64_t cbs = cosl->shape[0] == 1 ? 0 : S * D;
    TP_CHECK(tp__new(op->dt, op->dev, 4, x->shape, false, out));
    tp_status st =
        (bwd ? op->k->rope_bwd : op->k->rope_fwd)(op->dev, op->dt, tp_tensor_data(x),
                                                  tp_tensor_data(cosl), tp_tensor_data(sinl),
                                                  tp_tensor_data(*out), B, H, S, D, cbs);
    if (st != TP_OK) {
        tp_tensor_release(*out);
        *out = NULL;
    }
    return st;
}

static tp_status rope_fwd(tp__op *op, tp_tensor *const *in, tp_tensor **out)
{
    return rope_local(op, in[0], in[1], in[2], false, out);
}

static tp_status rope_bwd(tp__op *op, tp_tensor *const *in, tp_tensor *gy, tp_tensor **g)
{
    return op->need_grad[0] ? rope_local(op, gy, in[1], in[2], true, &g[0]) : TP_OK;
}

static const tp__op_def rope_def = {
    .name = "rotary_embedding",
    .n_inputs = 3,
    .input_names = {"x", "cos", "sin"},
    .nondiff_mask = 6u,
    .dtype_kernel = TP__KOP_ROPE_FWD,
    .strategies = rope_strategies,
    .out_shape = rope_shape,
    .forward = rope_fwd,
    .backward = rope_bwd,
};

/* "[a, b, c]" of a tensor's (global) shape into buf. */
static const char *rope_shape_str(const tp_tensor *t, char *buf, size_t len)
{
    int used = snprintf(buf, len, "[");
    for (int d = 0; d < t->ndim && used > 0 && (size_t)used < len; d++)
        used += snprintf(buf + used, len - (size_t)used, d ? ", %lld" : "%lld",
                         (long long)t->shape[d]);
    if (used > 0 && (size_t)used < len)
        snprintf(buf + used, len - (size_t)used, "]");
    return buf;
}

tp_status tp_rotary_embedding(tp_tensor *x, tp_tensor *cos, tp_tensor *sin, tp_tensor **y)
{
    const char *fn = rope_def.name;
    TP_ARG_CHECK(y, "%s: y is NULL", fn);
    *y = NULL;
    TP_ARG_CHECK(x && cos && sin, "%s: %s is NULL", fn, !x ? "x" : !cos ? "cos" : "sin");
    char b1[96], b2[96];
    TP_ARG_CHECK(x->ndim == 4, "%s: x is %s; it must be 4-D [batch, heads, seq, head_dim]", fn,
                 rope_shape_str(x, b1, sizeof b1));
    TP_ARG_CHECK(x->shape[3] % 2 == 0, "%s: x is %s; its head dim must be even", fn,
                 rope_shape_str(x, b1, sizeof b1));
    TP_ARG_CHECK(cos->ndim == 3, "%s: cos is %s; it must be 3-D [batch or 1, seq, head_dim]", fn,
                 rope_shape_str(cos, b1, sizeof b1));
    TP_ARG_CHECK(sin->ndim == 3 && !memcmp(sin->shape, cos->shape, 3 * sizeof(int64_t)),
                 "%s: cos is %s but sin is %s", fn, rope_shape_str(cos, b1, sizeof b1),
                 rope_shape_str(sin, b2, sizeof b2));
    const int64_t *xs = x->shape, *cs = cos->shape;
    TP_ARG_CHECK((cs[0] == 1 || cs[0] == xs[0]) && cs[1] == xs[2] && cs[2] == xs[3],
                 "%s: x is %s but cos and sin are %s; they must be [%lld or 1, %lld, %lld]", fn,
                 rope_shape_str(x, b1, sizeof b1), rope_shape_str(cos, b2, sizeof b2),
                 (long long)xs[0], (long long)xs[2], (long long)xs[3]);
    TP_ARG_CHECK(cos->dtype == x->dtype && sin->dtype == x->dtype,
                 "%s: x is %s but %s is %s; the dtypes must match", fn, tp_dtype_name(x->dtype),
                 cos->dtype != x->dtype ? "cos" : "sin",
                 tp_dtype_name(cos->dtype != x->dtype ? cos->dtype : sin->dtype));
    tp_tensor *args[3] = {x, cos, sin};
    return tp__op_run(&rope_def, args, NULL, 0, y);
}
