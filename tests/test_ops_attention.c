/* scaled_dot_product_attention(_with): the plain op against a
 * double-precision reference written here (an explicit repeat_kv of the kv
 * heads, the causal mask shifted by key_offset, the key padding, the safe
 * softmax; forward and dq, dk, dv) over multi-head, grouped and multi-query
 * heads, Sq < Sk with a key offset (decode and chunked prefill), left
 * padding with fully masked rows, head_dim not hidden/heads, Dv != D, 2-D to
 * 5-D inputs; against PyTorch 2.15's math attention (fixtures/sdpa_torch.h,
 * made by fixtures/make_sdpa_torch.py); the distributed op against the
 * plain one with batch and heads sharded on 1-4 ranks and a 2x2 mesh, with
 * the exact collectives each layout costs; the argument errors. The math
 * and the fused (flash) backends alike, and what each keeps for the
 * backward. Tolerance: f32 softmax and GEMMs, rtol 1e-4, atol 1e-5. */
#include <math.h>

#include "tp_test.h"

#include "fixtures/sdpa_torch.h"

#define RTOL 1e-4
#define ATOL 1e-5

static tp_status rand_tensor(int nd, const int64_t *shape, uint64_t seed, tp_tensor **t)
{
    TP_TEST_TRY(tp_tensor_zeros(TP_F32, TP_CPU, nd, shape, t));
    return tp_tensor_fill_random(*t, TP_RNG_UNIFORM, -1, 1, seed, NULL, NULL);
}

/* ---- geometry and the double reference ------------------------------------------ */

/* One attention problem. nd >= 4: q [lead..., hq, sq, d], k [lead..., hkv,
 * sk, d], v [lead..., hkv, sk, dv] with nd - 3 leading dims; nd <= 3: no
 * head dim (hq = hkv = 1), nd - 2 leading dims. The padding of batch l (4-D
 * only) hides keys j < l * padleft (left padding). */
typedef struct {
    int nd;
    int64_t lead[2];
    int64_t hq, hkv, sq, sk, d, dv;
    bool causal;
    double scale;
    int64_t off;
    bool pad;
    int64_t padleft;
    const char *name;
    bool want_empty; /* some query row sees no key */
} geo;

static int nlead(const geo *g)
{
    return g->nd >= 4 ? g->nd - 3 : g->nd - 2;
}

static int64_t lead_numel(const geo *g)
{
    int64_t n = 1;
    for (int i = 0; i < nlead(g); i++)
        n *= g->lead[i];
    return n;
}

/* The shape of q (which 0), k (1), v (2) or out (3). */
static void shape_of(const geo *g, int which, int64_t *shape)
{
    int n = nlead(g), i = 0;
    for (; i < n; i++)
        shape[i] = g->lead[i];
    if (g->nd >= 4)
        shape[i++] = which == 0 || which == 3 ? g->hq : g->hkv;
    shape[i++] = which == 0 || which == 3 ? g->sq : g->sk;
    shape[i] = which == 0 ? g->d : which == 1 ? g->d : g->dv;
}

static int64_t numel_of(const geo *g, int which)
{
    int64_t s[8], n = 1;
    shape_of(g, which, s);
    for (int i = 0; i < g->nd; i++)
        n *= s[i];
    return n;
}

static bool key_visible(const geo *g, const int64_t *pad, int64_t l, int64_t i, int64_t j)
{
    return (!g->causal || j <= g->off + i) && (!pad || pad[l * g->sk + j] != 0);
}

/* The padding of the geometry, [lead[0], sk] (1 = attend). */
static int64_t *make_pad(const geo *g)
{
    int64_t n = g->lead[0] * g->sk;
    int64_t *p = calloc((size_t)(n > 0 ? n : 1), sizeof *p);
    for (int64_t l = 0; l < g->lead[0]; l++)
        for (int64_t j = 0; j < g->sk; j++)
            p[l * g->sk + j] = j >= l * g->padleft;
    return p;
}

/* out and dq, dk, dv of loss = sum(out * go), in double: k and v repeated
 * to hq heads (query head h reads kv head h / (hq / hkv)), attention per
 * head, and dk, dv summed back over the heads that share a kv head. */
static void reference(const geo *g, const float *q, const float *k, const float *v,
                      const int64_t *pad, const float *go, double *out, double *dq, double *dk,
                      double *dv)
{
    const int64_t L = lead_numel(g), Hq = g->hq, Hkv = g->hkv, n_rep = Hq / Hkv;
    const int64_t Sq = g->sq, Sk = g->sk, D = g->d, Dv = g->dv;
    const double scale = g->scale != 0 ? g->scale : 1.0 / sqrt((double)D);
    size_t nk = (size_t)(L * Hq * Sk * D + 1), nv = (size_t)(L * Hq * Sk * Dv + 1);
    double *kr = calloc(nk, sizeof(double)), *vr = calloc(nv, sizeof(double));
    double *dkr = calloc(nk, sizeof(double)), *dvr = calloc(nv, sizeof(double));
    double *p = calloc((size_t)(Sq * Sk + 1), sizeof(double));
    double *ds = calloc((size_t)(Sq * Sk + 1), sizeof(double));
    for (int64_t l = 0; l < L; l++) /* repeat_kv */
        for (int64_t h = 0; h < Hq; h++)
            for (int64_t j = 0; j < Sk; j++) {
                int64_t src = (l * Hkv + h / n_rep) * Sk + j, dst = (l * Hq + h) * Sk + j;
                for (int64_t e = 0; e < D; e++)
                    kr[dst * D + e] = k[src * D + e];
                for (int64_t e = 0; e < Dv; e++)
                    vr[dst * Dv + e] = v[src * Dv + e];
            }
    for (int64_t i = 0; i < L * Hq * Sq * D; i++)
        dq[i] = 0;
    for (int64_t l = 0; l < L; l++)
        for (int64_t h = 0; h < Hq; h++) {
            int64_t lh = l * Hq + h;
            const float *qh = q + lh * Sq * D, *gh = go + lh * Sq * Dv;
            const double *kh = kr + lh * Sk * D, *vh = vr + lh * Sk * Dv;
            double *oh = out + lh * Sq * Dv, *dqh = dq + lh * Sq * D;
            double *dkh = dkr + lh * Sk * D, *dvh = dvr + lh * Sk * Dv;
            for (int64_t i = 0; i < Sq; i++) {
                double mx = -INFINITY, sum = 0;
                for (int64_t j = 0; j < Sk; j++) {
                    double s = 0;
                    for (int64_t e = 0; e < D; e++)
                        s += (double)qh[i * D + e] * kh[j * D + e];
                    p[i * Sk + j] = key_visible(g, pad, l, i, j) ? s * scale : -INFINITY;
                    mx = fmax(mx, p[i * Sk + j]);
                }
                for (int64_t j = 0; j < Sk; j++) /* the safe softmax */
                    sum += (p[i * Sk + j] = mx == -INFINITY ? 0 : exp(p[i * Sk + j] - mx));
                for (int64_t j = 0; j < Sk; j++)
                    p[i * Sk + j] = sum > 0 ? p[i * Sk + j] / sum : 0;
                for (int64_t e = 0; e < Dv; e++) {
                    double o = 0;
                    for (int64_t j = 0; j < Sk; j++)
                        o += p[i * Sk + j] * vh[j * Dv + e];
                    oh[i * Dv + e] = o;
                }
            }
            for (int64_t i = 0; i < Sq; i++) {
                double dot = 0;
                for (int64_t j = 0; j < Sk; j++) {
                    double dp = 0;
                    for (int64_t e = 0; e < Dv; e++)
                        dp += (double)gh[i * Dv + e] * vh[j * Dv + e];
                    ds[i * Sk + j] = dp;
                    dot += dp * p[i * Sk + j];
                }
                for (int64_t j = 0; j < Sk; j++)
                    ds[i * Sk + j] = p[i * Sk + j] * (ds[i * Sk + j] - dot);
            }
            for (int64_t i = 0; i < Sq; i++)
                for (int64_t j = 0; j < Sk; j++) {
                    for (int64_t e = 0; e < Dv; e++)
                        dvh[j * Dv + e] += p[i * Sk + j] * gh[i * Dv + e];
                    for (int64_t e = 0; e < D; e++) {
                        dqh[i * D + e] += scale * ds[i * Sk + j] * kh[j * D + e];
                        dkh[j * D + e] += scale * ds[i * Sk + j] * qh[i * D + e];
                    }
                }
        }
    for (int64_t i = 0; i < L * Hkv * Sk * D; i++)
        dk[i] = 0;
    for (int64_t i = 0; i < L * Hkv * Sk * Dv; i++)
        dv[i] = 0;
    for (int64_t l = 0; l < L; l++) /* the sum over each kv head's query heads */
        for (int64_t h = 0; h < Hq; h++)
            for (int64_t j = 0; j < Sk; j++) {
                int64_t src = (l * Hq + h) * Sk + j, dst = (l * Hkv + h / n_rep) * Sk + j;
                for (int64_t e = 0; e < D; e++)
                    dk[dst * D + e] += dkr[src * D + e];
                for (int64_t e = 0; e < Dv; e++)
                    dv[dst * Dv + e] += dvr[src * Dv + e];
            }
    free(kr), free(vr), free(dkr), free(dvr), free(p), free(ds);
}

static bool close_to(const tp_tensor *t, const double *want, int64_t n, int64_t *bad)
{
    const float *x = tp_tensor_data(t);
    for (int64_t i = 0; i < n; i++)
        if (!(fabs(x[i] - want[i]) <= ATOL + RTOL * fabs(want[i]))) {
            *bad = i;
            return false;
        }
    return true;
}

/* ---- the plain op against the reference ------------------------------------------ */

typedef struct {
    tp_tensor *q, *k, *v, *g, *pad;
    int64_t *padv;
} inputs;

static void inputs_free(inputs *in)
{
    tp_tensor_release(in->q);
    tp_tensor_release(in->k);
    tp_tensor_release(in->v);
    tp_tensor_release(in->g);
    tp_tensor_release(in->pad);
    free(in->padv);
}

/* The global inputs of g (the same on every rank: seeds), plain, q, k, v
 * requiring grad; pad_dt TP_I64 or TP_I32 for the padding. */
static tp_status make_inputs(const geo *g, uint64_t seed, tp_dtype pad_dt, inputs *in)
{
    memset(in, 0, sizeof *in);
    int64_t s[4][8];
    for (int w = 0; w < 4; w++)
        shape_of(g, w, s[w]);
    TP_TEST_TRY(rand_tensor(g->nd, s[0], seed, &in->q));
    TP_TEST_TRY(rand_tensor(g->nd, s[1], seed + 1, &in->k));
    TP_TEST_TRY(rand_tensor(g->nd, s[2], seed + 2, &in->v));
    TP_TEST_TRY(rand_tensor(g->nd, s[3], seed + 3, &in->g));
    TP_TEST_TRY(tp_tensor_set_requires_grad(in->q, true));
    TP_TEST_TRY(tp_tensor_set_requires_grad(in->k, true));
    TP_TEST_TRY(tp_tensor_set_requires_grad(in->v, true));
    if (g->pad) {
        in->padv = make_pad(g);
        int64_t ps[2] = {g->lead[0], g->sk};
        TP_TEST_TRY(tp_tensor_zeros(pad_dt, TP_CPU, 2, ps, &in->pad));
        for (int64_t i = 0; i < ps[0] * ps[1]; i++) {
            if (pad_dt == TP_I64)
                ((int64_t *)tp_tensor_data(in->pad))[i] = in->padv[i];
            else
                ((int32_t *)tp_tensor_data(in->pad))[i] = (int32_t)in->padv[i];
        }
    }
    return TP_OK;
}

/* The backend the plain checks ask for: MATH, FLASH in the flash tests
 * (AUTO is FLASH on the CPU: auto_is_flash_on_the_cpu). */
static tp_sdpa_backend backend = TP_SDPA_BACKEND_MATH;

static tp_sdpa_options opts_of(const geo *g, tp_tensor *pad)
{
    return (tp_sdpa_options){g->causal, g->scale, g->off, pad, backend};
}

/* Runs g plainly and checks it against the reference; out_i64 receives the
 * output (for the i32-padding rerun). */
static void check_plain(const geo *g, tp_dtype pad_dt, tp_tensor **out_keep)
{
    inputs in;
    CHECK_OK(make_inputs(g, 100, pad_dt, &in));
    tp_sdpa_options o = opts_of(g, in.pad);
    tp_tensor *out = NULL;
    CHECK_OK(tp_scaled_dot_product_attention_with(in.q, in.k, in.v, &o, &out));
    int64_t os[8];
    shape_of(g, 3, os);
    cr_assert_eq(tp_tensor_ndim(out), g->nd, "%s", g->name);
    cr_assert(!memcmp(tp_tensor_shape(out), os, sizeof(int64_t) * (size_t)g->nd),
              "%s: output shape", g->name);
    CHECK_OK(tp_backward(out, in.g));
    int64_t nq = numel_of(g, 0), nk = numel_of(g, 1), nv = numel_of(g, 2), no = numel_of(g, 3);
    double *ro = calloc((size_t)no + 1, 8), *rq = calloc((size_t)nq + 1, 8),
           *rk = calloc((size_t)nk + 1, 8), *rv = calloc((size_t)nv + 1, 8);
    reference(g, tp_tensor_data(in.q), tp_tensor_data(in.k), tp_tensor_data(in.v), in.padv,
              tp_tensor_data(in.g), ro, rq, rk, rv);
    int64_t bad = -1;
    cr_assert(close_to(out, ro, no, &bad), "%s: output[%lld] %g, reference %g", g->name,
              (long long)bad, bad >= 0 ? ((const float *)tp_tensor_data(out))[bad] : 0.0,
              bad >= 0 ? ro[bad] : 0.0);
    cr_assert(close_to(tp_tensor_grad(in.q), rq, nq, &bad), "%s: dq[%lld] differs", g->name,
              (long long)bad);
    cr_assert(close_to(tp_tensor_grad(in.k), rk, nk, &bad), "%s: dk[%lld] differs", g->name,
              (long long)bad);
    cr_assert(close_to(tp_tensor_grad(in.v), rv, nv, &bad), "%s: dv[%lld] differs", g->name,
              (long long)bad);
    /* rows with no visible key: exactly 0 out and 0 dq */
    const int64_t L = lead_numel(g);
    const float *of = tp_tensor_data(out), *dqf = tp_tensor_data(tp_tensor_grad(in.q));
    int64_t empty = 0;
    for (int64_t l = 0; l < L; l++)
        for (int64_t h = 0; h < g->hq; h++)
            for (int64_t i = 0; i < g->sq; i++) {
                bool any = false;
                for (int64_t j = 0; j < g->sk; j++)
                    any |= key_visible(g, in.padv, l, i, j);
                if (any)
                    continue;
                empty++;
                int64_t r = (l * g->hq + h) * g->sq + i;
                for (int64_t e = 0; e < g->dv; e++)
                    cr_assert(of[r * g->dv + e] == 0.0f, "%s: a fully masked row's output",
                              g->name);
                for (int64_t e = 0; e < g->d; e++)
                    cr_assert(dqf[r * g->d + e] == 0.0f, "%s: a fully masked row's dq", g->name);
            }
    cr_assert_eq(empty > 0, g->want_empty, "%s: %lld fully masked rows", g->name,
                 (long long)empty);
    free(ro), free(rq), free(rk), free(rv);
    if (out_keep)
        *out_keep = tp_tensor_retain(out);
    tp_tensor_release(out);
    inputs_free(&in);
}

static const geo plain_geos[] = {
    {4, {2}, 8, 8, 6, 6, 8, 8, true, 0, 0, false, 0, "MHA causal", false},
    {4, {2}, 8, 8, 6, 6, 8, 8, false, 0, 0, false, 0, "MHA", false},
    {4, {2}, 8, 4, 6, 6, 8, 8, true, 0, 0, false, 0, "GQA 8/4", false},
    {4, {2}, 8, 2, 6, 6, 8, 8, true, 0, 0, false, 0, "GQA 8/2", false},
    {4, {2}, 8, 1, 6, 6, 8, 8, true, 0, 0, false, 0, "MQA 8/1", false},
    {4, {2}, 8, 2, 1, 9, 8, 8, true, 0, 8, false, 0, "decode Sq 1 after 8 cached keys", false},
    {4, {2}, 8, 4, 3, 10, 8, 8, true, 0, 7, false, 0, "chunked prefill, 3 after 7", false},
    {4, {3}, 4, 2, 3, 10, 8, 8, true, 0, 4, false, 0, "a middle chunk: later keys hidden", false},
    {4, {2}, 4, 4, 3, 5, 4, 4, true, 0, 9, false, 0, "key_offset past the keys", false},
    {4, {3}, 4, 2, 5, 5, 8, 8, true, 0, 0, true, 2, "left padding, fully masked rows", true},
    {4, {3}, 4, 1, 2, 7, 8, 8, true, 0, 5, true, 3, "decode-like with left padding", true},
    {4, {3}, 4, 2, 4, 7, 8, 5, false, 0, 0, true, 4, "padding alone, a batch all padding", true},
    {4, {1}, 3, 3, 5, 5, 16, 16, true, 0, 0, false, 0, "D 16 with 3 heads", false},
    {4, {2}, 6, 3, 4, 6, 4, 6, true, 0.3, 2, false, 0, "Dv 6 != D 4, scale 0.3", false},
    {3, {2}, 1, 1, 5, 7, 4, 4, true, 0, 2, false, 0, "3-D, Sq 5 < Sk 7", false},
    {2, {0}, 1, 1, 4, 6, 3, 5, true, 0, 2, false, 0, "2-D", false},
    {5, {2, 2}, 4, 2, 3, 5, 4, 4, true, 0, 2, false, 0, "5-D grouped", false},
    {4, {2}, 4, 2, 3, 0, 4, 4, false, 0, 0, false, 0, "no keys: all rows empty", true},
    {4, {2}, 4, 2, 0, 5, 4, 4, true, 0, 0, false, 0, "no queries", false},
};

Test(ops_attention, plain_matches_reference, .timeout = 60)
{
    for (size_t c = 0; c < sizeof plain_geos / sizeof plain_geos[0]; c++) {
        const geo *g = &plain_geos[c];
        tp_tensor *o64 = NULL, *o32 = NULL;
        check_plain(g, TP_I64, &o64);
        if (g->pad) { /* i32 padding: the same output */
            check_plain(g, TP_I32, &o32);
            bool eq = false;
            CHECK_OK(tp_tensor_equal(o64, o32, &eq));
            cr_assert(eq, "%s: i32 padding differs from i64", g->name);
        }
        tp_tensor_release(o64);
        tp_tensor_release(o32);
    }
}

/* The fused (flash) form against the same reference: every geometry above,
 * and ones whose query rows and keys span several of its tiles (64 rows,
 * 128 keys), grouped heads whose rows straddle a tile, a decode row over a
 * long cache, padding across tiles. */
static const geo flash_geos[] = {
    {4, {1}, 4, 2, 150, 150, 16, 16, true, 0, 0, false, 0, "tiles: causal GQA 4/2, S 150", false},
    {4, {2}, 2, 2, 70, 300, 8, 12, false, 0, 0, true, 100, "tiles: padding over 3 key tiles",
     false},
    {4, {1}, 8, 1, 1, 400, 32, 32, true, 0, 399, false, 0, "decode over a 400-key cache", false},
    {4, {2}, 6, 3, 33, 290, 8, 8, true, 0.2, 257, true, 130, "chunked prefill, padded, tiles",
     false},
    {4, {1}, 2, 2, 130, 130, 260 - 4, 8, true, 0, 0, false, 0, "D 256", false},
};

Test(ops_attention, flash_matches_reference, .timeout = 120)
{
    backend = TP_SDPA_BACKEND_FLASH;
    for (size_t c = 0; c < sizeof plain_geos / sizeof plain_geos[0]; c++)
        check_plain(&plain_geos[c], plain_geos[c].pad ? TP_I32 : TP_I64, NULL);
    for (size_t c = 0; c < sizeof flash_geos / sizeof flash_geos[0]; c++)
        check_plain(&flash_geos[c], TP_I64, NULL);
    backend = TP_SDPA_BACKEND_MATH;
}

/* What the backward keeps: the math form the [rows, Sk] probabilities, the
 * fused one an f32 log-sum-exp per query row (and an alias of the output it
 * returns anyway). Measured as the bytes the forward leaves allocated, and
 * all given back when the output is released without a backward. */
Test(ops_attention, flash_keeps_memory_linear_in_keys, .timeout = 60)
{
    const geo g = {4, {1}, 4, 2, 256, 256, 16, 16, true, 0, 0, false, 0, "keep", false};
    int64_t kept[2];
    for (int f = 0; f < 2; f++) {
        inputs in;
        CHECK_OK(make_inputs(&g, 3, TP_I64, &in));
        backend = f ? TP_SDPA_BACKEND_FLASH : TP_SDPA_BACKEND_MATH;
        tp_sdpa_options o = opts_of(&g, NULL);
        tp_memory_info before, after;
        CHECK_OK(tp_memory_stats(TP_CPU, &before));
        tp_tensor *out = NULL;
        CHECK_OK(tp_scaled_dot_product_attention_with(in.q, in.k, in.v, &o, &out));
        CHECK_OK(tp_memory_stats(TP_CPU, &after));
        kept[f] = (int64_t)after.allocated - (int64_t)before.allocated;
        /* released without a backward, the output frees what the node kept:
         * it keeps no reference to the output (no cycle) */
        tp_tensor_release(out);
        CHECK_OK(tp_memory_stats(TP_CPU, &after));
        cr_assert_eq(after.allocated, before.allocated, "%s: %lld bytes left after the release",
                     f ? "flash" : "math",
                     (long long)after.allocated - (long long)before.allocated);
        inputs_free(&in);
    }
    backend = TP_SDPA_BACKEND_MATH;
    const int64_t outb = 4 * 256 * 16 * 4, probs = 4 * 256 * 256 * 4, lse = 4 * 256 * 4;
    cr_assert_eq(kept[0], outb + probs, "math keeps %lld bytes", (long long)kept[0]);
    cr_assert_eq(kept[1], outb + lse, "flash keeps %lld bytes", (long long)kept[1]);
}

/* bf16 and f16 through the fused form agree with the math form in the same
 * dtype within the dtype's rounding (both accumulate in f32). */
Test(ops_attention, flash_low_precision_matches_math, .timeout = 60)
{
    const geo g = {4, {2}, 4, 2, 70, 140, 16, 16, true, 0, 70, true, 20, "lowp", false};
    const tp_dtype dts[2] = {TP_BF16, TP_F16};
    for (int d = 0; d < 2; d++) {
        inputs in;
        CHECK_OK(make_inputs(&g, 5, TP_I64, &in));
        tp_tensor *x[3] = {in.q, in.k, in.v}, *lx[3] = {NULL, NULL, NULL}, *res[2][4];
        for (int i = 0; i < 3; i++) {
            CHECK_OK(tp_tensor_to(x[i], dts[d], TP_CPU, &lx[i]));
            CHECK_OK(tp_tensor_set_requires_grad(lx[i], true));
        }
        tp_tensor *lg = NULL;
        CHECK_OK(tp_tensor_to(in.g, dts[d], TP_CPU, &lg));
        for (int f = 0; f < 2; f++) {
            backend = f ? TP_SDPA_BACKEND_FLASH : TP_SDPA_BACKEND_MATH;
            tp_sdpa_options o = opts_of(&g, in.pad);
            CHECK_OK(tp_scaled_dot_product_attention_with(lx[0], lx[1], lx[2], &o, &res[f][0]));
            CHECK_OK(tp_backward(res[f][0], lg));
            for (int i = 0; i < 3; i++) {
                CHECK_OK(tp_tensor_to(tp_tensor_grad(lx[i]), TP_F32, TP_CPU, &res[f][1 + i]));
                tp_tensor_zero_grad(lx[i]);
            }
            tp_tensor *o32 = NULL;
            CHECK_OK(tp_tensor_to(res[f][0], TP_F32, TP_CPU, &o32));
            tp_tensor_release(res[f][0]);
            res[f][0] = o32;
        }
        backend = TP_SDPA_BACKEND_MATH;
        const char *names[4] = {"out", "dq", "dk", "dv"};
        for (int i = 0; i < 4; i++) {
            const float *a = tp_tensor_data(res[0][i]), *b = tp_tensor_data(res[1][i]);
            int64_t n = tp_tensor_numel(res[0][i]);
            double amax = 0;
            for (int64_t e = 0; e < n; e++)
                amax = fmax(amax, fabs(a[e]));
            for (int64_t e = 0; e < n; e++)
                cr_assert(fabs(a[e] - b[e]) <= 0.02 * fabs(a[e]) + 0.01 * amax,
                          "%s %s[%lld]: math %g, flash %g", tp_dtype_name(dts[d]), names[i],
                          (long long)e, a[e], b[e]);
            tp_tensor_release(res[0][i]);
            tp_tensor_release(res[1][i]);
        }
        for (int i = 0; i < 3; i++)
            tp_tensor_release(lx[i]);
        tp_tensor_release(lg);
        inputs_free(&in);
    }
}

/* Every allocation of a fused forward + backward failing in turn (outputs,
 * lse, delta; in bf16 the f32 copies of each group): TP_ERR_NO_MEMORY,
 * nothing leaked, until the whole step runs and every input has its
 * gradient. */
static tp_test_alloc A;

/* returns how many allocations the step makes */
static long flash_alloc_failures(tp_dtype dt)
{
    A = (tp_test_alloc){0, 0, -1};
    tp_allocator al = {tp_test_alloc_fn, tp_test_free_fn, &A};
    cr_assert_eq(tp_set_allocator(&al), TP_OK);
    const int64_t qs[4] = {2, 4, 70, 16}, ks[4] = {2, 2, 140, 16};
    tp_tensor *x[3];
    for (int i = 0; i < 3; i++) {
        tp_tensor *f = NULL;
        CHECK_OK(rand_tensor(4, i ? ks : qs, 40 + (uint64_t)i, &f));
        CHECK_OK(tp_tensor_to(f, dt, TP_CPU, &x[i]));
        tp_tensor_release(f);
        CHECK_OK(tp_tensor_set_requires_grad(x[i], true));
    }
    const tp_sdpa_options o = {.causal = true, .key_offset = 70,
                               .backend = TP_SDPA_BACKEND_FLASH};
    const long base = A.live;
    bool done = false;
    long k = 0;
    for (; k < 400 && !done; k++) {
        A.count = 0;
        A.fail_at = k;
        tp_tensor *y = NULL, *l = NULL;
        tp_status st = tp_scaled_dot_product_attention_with(x[0], x[1], x[2], &o, &y);
        if (st == TP_OK)
            st = tp_sum_all(y, &l);
        if (st == TP_OK)
            st = tp_backward(l, NULL);
        tp_tensor_release(y);
        tp_tensor_release(l);
        A.fail_at = -1;
        done = st == TP_OK;
        cr_assert(st == TP_OK || st == TP_ERR_NO_MEMORY, "%s, allocation %ld failing: %s (%s)",
                  tp_dtype_name(dt), k, tp_status_name(st), tp_last_error());
        for (int i = 0; i < 3; i++) {
            if (done)
                cr_assert(tp_tensor_grad(x[i]), "%s: input %d has no gradient",
                          tp_dtype_name(dt), i);
            tp_tensor_zero_grad(x[i]);
        }
        cr_assert_eq(A.live, base, "%s, allocation %ld failing: %ld blocks leaked",
                     tp_dtype_name(dt), k, A.live - base);
    }
    cr_assert(done, "the step never succeeded");
    for (int i = 0; i < 3; i++)
        tp_tensor_release(x[i]);
    cr_assert_eq(A.live, 0);
    tp_set_allocator(NULL);
    return k;
}

Test(ops_attention, flash_allocation_failures, .timeout = 60)
{
    const long f32 = flash_alloc_failures(TP_F32), bf16 = flash_alloc_failures(TP_BF16);
    /* bf16 also allocates each group's f32 copies: their failures were hit */
    cr_assert_gt(bf16, f32, "bf16 made %ld allocations, f32 %ld", bf16, f32);
}

/* AUTO on the CPU is the fused form, bit for bit. */
Test(ops_attention, auto_is_flash_on_the_cpu, .timeout = 30)
{
    const geo *g = &plain_geos[9];
    inputs in;
    CHECK_OK(make_inputs(g, 11, TP_I64, &in));
    tp_tensor *r[2];
    for (int f = 0; f < 2; f++) {
        backend = f ? TP_SDPA_BACKEND_FLASH : TP_SDPA_BACKEND_AUTO;
        tp_sdpa_options o = opts_of(g, in.pad);
        CHECK_OK(tp_scaled_dot_product_attention_with(in.q, in.k, in.v, &o, &r[f]));
    }
    backend = TP_SDPA_BACKEND_MATH;
    bool eq = false;
    CHECK_OK(tp_tensor_equal(r[0], r[1], &eq));
    cr_assert(eq);
    tp_tensor_release(r[0]);
    tp_tensor_release(r[1]);
    inputs_free(&in);
}

Test(ops_attention, flash_refusals, .timeout = 30)
{
    int64_t qs[4] = {1, 2, 3, 300}, vs[4] = {1, 2, 3, 8};
    tp_tensor *q = NULL, *v = NULL, *out = NULL;
    CHECK_OK(rand_tensor(4, qs, 1, &q));
    CHECK_OK(rand_tensor(4, vs, 2, &v));
    tp_sdpa_options o = {.backend = TP_SDPA_BACKEND_FLASH};
    CHECK_ERR(tp_scaled_dot_product_attention_with(q, q, v, &o, &out), TP_ERR_NOT_SUPPORTED);
    cr_assert(strstr(tp_last_error(), "head dims up to 256"), "%s", tp_last_error());
    cr_assert_null(out);
    o.backend = TP_SDPA_BACKEND_AUTO; /* the math form takes it */
    CHECK_OK(tp_scaled_dot_product_attention_with(q, q, v, &o, &out));
    tp_tensor_release(out);
    out = NULL;
    o.backend = (tp_sdpa_backend)7;
    CHECK_ERR(tp_scaled_dot_product_attention_with(q, q, v, &o, &out), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "backend 7"), "%s", tp_last_error());
    tp_tensor_release(q);
    tp_tensor_release(v);
}

/* The old entry point is the new one with {causal, scale}. */
Test(ops_attention, old_entry_is_the_new_one, .timeout = 30)
{
    int64_t shape[4] = {2, 3, 5, 4};
    tp_tensor *q = NULL, *k = NULL, *v = NULL, *a = NULL, *b = NULL;
    CHECK_OK(rand_tensor(4, shape, 1, &q));
    CHECK_OK(rand_tensor(4, shape, 2, &k));
    CHECK_OK(rand_tensor(4, shape, 3, &v));
    for (int causal = 0; causal < 2; causal++) {
        tp_sdpa_options o = {.causal = causal, .scale = 0.7};
        CHECK_OK(tp_scaled_dot_product_attention(q, k, v, causal, 0.7, &a));
        CHECK_OK(tp_scaled_dot_product_attention_with(q, k, v, &o, &b));
        bool eq = false;
        CHECK_OK(tp_tensor_equal(a, b, &eq));
        cr_assert(eq, "causal=%d", causal);
        tp_tensor_release(a);
        tp_tensor_release(b);
        /* NULL options: not causal, 1/sqrt(D) */
        CHECK_OK(tp_scaled_dot_product_attention(q, k, v, false, 0, &a));
        CHECK_OK(tp_scaled_dot_product_attention_with(q, k, v, NULL, &b));
        CHECK_OK(tp_tensor_equal(a, b, &eq));
        cr_assert(eq, "NULL options");
        tp_tensor_release(a);
        tp_tensor_release(b);
    }
    tp_tensor_release(q);
    tp_tensor_release(k);
    tp_tensor_release(v);
}

/* PyTorch 2.15, math attention with enable_gqa and a boolean mask (causal
 * shifted by key_offset, left padding), in float64 on the same f32 inputs. */
Test(ops_attention, matches_pytorch_math_attention, .timeout = 30)
{
    const int64_t qs[4] = {SDPA_T_B, SDPA_T_HQ, SDPA_T_SQ, SDPA_T_D},
                  ks[4] = {SDPA_T_B, SDPA_T_HKV, SDPA_T_SK, SDPA_T_D},
                  vs[4] = {SDPA_T_B, SDPA_T_HKV, SDPA_T_SK, SDPA_T_DV},
                  gs[4] = {SDPA_T_B, SDPA_T_HQ, SDPA_T_SQ, SDPA_T_DV},
                  ps[2] = {SDPA_T_B, SDPA_T_SK};
    tp_tensor *q = NULL, *k = NULL, *v = NULL, *g = NULL, *pad = NULL, *out = NULL;
    CHECK_OK(tp_tensor_from_blob(TP_F32, TP_CPU, 4, qs, (void *)sdpa_in_q, NULL, NULL, &q));
    CHECK_OK(tp_tensor_from_blob(TP_F32, TP_CPU, 4, ks, (void *)sdpa_in_k, NULL, NULL, &k));
    CHECK_OK(tp_tensor_from_blob(TP_F32, TP_CPU, 4, vs, (void *)sdpa_in_v, NULL, NULL, &v));
    CHECK_OK(tp_tensor_from_blob(TP_F32, TP_CPU, 4, gs, (void *)sdpa_in_g, NULL, NULL, &g));
    CHECK_OK(tp_tensor_from_blob(TP_I64, TP_CPU, 2, ps, (void *)sdpa_t_pad, NULL, NULL, &pad));
    CHECK_OK(tp_tensor_set_requires_grad(q, true));
    CHECK_OK(tp_tensor_set_requires_grad(k, true));
    CHECK_OK(tp_tensor_set_requires_grad(v, true));
    for (int f = 0; f < 2; f++) {
        tp_sdpa_options o = {.causal = true, .key_offset = SDPA_T_OFF, .key_padding = pad,
                             .backend = f ? TP_SDPA_BACKEND_FLASH : TP_SDPA_BACKEND_MATH};
        tp_tensor_zero_grad(q);
        tp_tensor_zero_grad(k);
        tp_tensor_zero_grad(v);
        CHECK_OK(tp_scaled_dot_product_attention_with(q, k, v, &o, &out));
        CHECK_OK(tp_backward(out, g));
        int64_t bad = -1;
        cr_assert(close_to(out, sdpa_out, (int64_t)(sizeof sdpa_out / 8), &bad), "out[%lld]",
                  (long long)bad);
        cr_assert(close_to(tp_tensor_grad(q), sdpa_dq, (int64_t)(sizeof sdpa_dq / 8), &bad),
                  "dq[%lld]", (long long)bad);
        cr_assert(close_to(tp_tensor_grad(k), sdpa_dk, (int64_t)(sizeof sdpa_dk / 8), &bad),
                  "dk[%lld]", (long long)bad);
        cr_assert(close_to(tp_tensor_grad(v), sdpa_dv, (int64_t)(sizeof sdpa_dv / 8), &bad),
                  "dv[%lld]", (long long)bad);
        /* batch 1, query 0 sees keys 0..2, all padding: 0, as torch's */
        const float *of = tp_tensor_data(out);
        for (int h = 0; h < SDPA_T_HQ; h++)
            for (int e = 0; e < SDPA_T_DV; e++)
                cr_assert(of[((SDPA_T_HQ + h) * SDPA_T_SQ) * SDPA_T_DV + e] == 0.0f);
        tp_tensor_release(out);
        out = NULL;
    }
    tp_tensor *all[] = {q, k, v, g, pad, out};
    for (size_t i = 0; i < 6; i++)
        tp_tensor_release(all[i]);
}

/* Without a gradient wanted the op keeps nothing and still computes the
 * same output (the probabilities are scratch). */
Test(ops_attention, no_grad_output_is_the_same, .timeout = 30)
{
    const geo *g = &plain_geos[10];
    inputs in;
    CHECK_OK(make_inputs(g, 7, TP_I64, &in));
    tp_sdpa_options o = opts_of(g, in.pad);
    tp_tensor *a = NULL, *b = NULL;
    CHECK_OK(tp_scaled_dot_product_attention_with(in.q, in.k, in.v, &o, &a));
    CHECK_OK(tp_tensor_set_requires_grad(in.q, false));
    CHECK_OK(tp_tensor_set_requires_grad(in.k, false));
    CHECK_OK(tp_tensor_set_requires_grad(in.v, false));
    CHECK_OK(tp_scaled_dot_product_attention_with(in.q, in.k, in.v, &o, &b));
    cr_assert(tp_tensor_has_grad_fn(a) && !tp_tensor_has_grad_fn(b));
    bool eq = false;
    CHECK_OK(tp_tensor_equal(a, b, &eq));
    cr_assert(eq);
    tp_tensor_release(a);
    tp_tensor_release(b);
    inputs_free(&in);
}

/* ---- argument errors ---------------------------------------------------------------- */

#define CHECK_MSG(expr, text)                                                      \
    do {                                                                           \
        CHECK_ERR(expr, TP_ERR_INVALID_ARG);                                       \
        cr_assert(strstr(tp_last_error(), text), "%s: \"%s\" lacks \"%s\"", #expr, \
                  tp_last_error(), text);                                          \
    } while (0)

static tp_tensor *zeros(tp_dtype dt, int nd, const int64_t *shape)
{
    tp_tensor *t = NULL;
    CHECK_OK(tp_tensor_zeros(dt, TP_CPU, nd, shape, &t));
    return t;
}

Test(ops_attention, argument_errors, .timeout = 30)
{
    tp_tensor *q12 = zeros(TP_F32, 4, (int64_t[]){2, 12, 3, 4}),
              *k5 = zeros(TP_F32, 4, (int64_t[]){2, 5, 6, 4}),
              *q8 = zeros(TP_F32, 4, (int64_t[]){2, 8, 3, 4}),
              *k2 = zeros(TP_F32, 4, (int64_t[]){2, 2, 6, 4}),
              *v2 = zeros(TP_F32, 4, (int64_t[]){2, 2, 6, 7}),
              *k3b = zeros(TP_F32, 4, (int64_t[]){3, 2, 6, 4}),
              *kd3 = zeros(TP_F32, 4, (int64_t[]){2, 2, 6, 3}),
              *v5keys = zeros(TP_F32, 4, (int64_t[]){2, 2, 5, 7}),
              *v4heads = zeros(TP_F32, 4, (int64_t[]){2, 4, 6, 7}),
              *q3 = zeros(TP_F32, 3, (int64_t[]){2, 3, 4}),
              *k3 = zeros(TP_F32, 3, (int64_t[]){2, 6, 4}),
              *q1 = zeros(TP_F32, 1, (int64_t[]){4}),
              *pad = zeros(TP_I64, 2, (int64_t[]){2, 6}),
              *pad_short = zeros(TP_I64, 2, (int64_t[]){2, 5}),
              *pad_f = zeros(TP_F32, 2, (int64_t[]){2, 6}),
              *pad_1d = zeros(TP_I32, 1, (int64_t[]){6}), *out = NULL;
    CHECK_MSG(tp_scaled_dot_product_attention(q12, k5, k5, true, 0, &out),
              "scaled_dot_product_attention: 12 query heads are not a multiple of 5 key/value "
              "heads");
    cr_assert_null(out);
    CHECK_MSG(tp_scaled_dot_product_attention(q8, k3b, k3b, true, 0, &out),
              "q, k and v must have the same leading dims: q [2, 8, 3, 4], k [3, 2, 6, 4]");
    CHECK_MSG(tp_scaled_dot_product_attention(q8, kd3, v2, true, 0, &out),
              "q and k must have the same head_dim: q [2, 8, 3, 4], k [2, 2, 6, 3]");
    CHECK_MSG(tp_scaled_dot_product_attention(q8, k2, v5keys, true, 0, &out),
              "k has 6 keys but v has 5");
    CHECK_MSG(tp_scaled_dot_product_attention(q8, k2, v4heads, true, 0, &out),
              "k has 2 key/value heads but v has 4");
    CHECK_MSG(tp_scaled_dot_product_attention(q8, k3, k3, true, 0, &out), "k has 3 dims, q has 4");
    CHECK_MSG(tp_scaled_dot_product_attention(q1, q1, q1, false, 0, &out),
              "q must have at least 2 dims");
    CHECK_MSG(tp_scaled_dot_product_attention(q8, k2, v2, false, -1, &out), "scale -1 is negative");
    tp_sdpa_options o = {.causal = true, .key_offset = -1};
    CHECK_MSG(tp_scaled_dot_product_attention_with(q8, k2, v2, &o, &out),
              "key_offset -1 is negative");
    o = (tp_sdpa_options){.key_padding = pad_short};
    CHECK_MSG(tp_scaled_dot_product_attention_with(q8, k2, v2, &o, &out),
              "key_padding is [2, 5], expected [batch, keys] = [2, 6]");
    o.key_padding = pad_1d;
    CHECK_MSG(tp_scaled_dot_product_attention_with(q8, k2, v2, &o, &out),
              "key_padding is [6], expected [batch, keys] = [2, 6]");
    o.key_padding = pad_f;
    CHECK_MSG(tp_scaled_dot_product_attention_with(q8, k2, v2, &o, &out),
              "key_padding is f32; it must be i64 or i32");
    o.key_padding = pad;
    CHECK_MSG(tp_scaled_dot_product_attention_with(q3, k3, k3, &o, &out),
              "key_padding needs 4-D q [batch, heads, seq, head_dim], q is [2, 3, 4]");
    CHECK_MSG(tp_scaled_dot_product_attention_with(NULL, k2, v2, &o, &out), "q is NULL");
    CHECK_MSG(tp_scaled_dot_product_attention_with(q8, k2, v2, &o, NULL), "out is NULL");
    /* the valid neighbours of those calls run */
    CHECK_OK(tp_scaled_dot_product_attention_with(q8, k2, v2, &o, &out));
    tp_tensor_release(out);
    CHECK_OK(tp_scaled_dot_product_attention(q3, k3, k3, true, 0, &out));
    tp_tensor_release(out);
    tp_tensor *all[] = {q12,     k5, q8, k2, v2,  k3b,       kd3,   v5keys,
                        v4heads, q3, k3, q1, pad, pad_short, pad_f, pad_1d};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        tp_tensor_release(all[i]);
}

/* ---- distributed == single rank, exact collectives ------------------------------------ */

enum { M1, M2, M3, M4, M22, NMESH }; /* 1-D meshes of 1-4 ranks, 2x2 */

/* Collectives of one run: forward all_gather, all_to_all; backward
 * all_gather, all_to_all (every other kind must be 0). */
typedef struct {
    int fag, fa2a, bag, ba2a;
} counts;

/* A layout: placements of q, k and v, and of key_padding, per mesh dim (1-D
 * meshes use the first), and the collectives it costs on each mesh. */
typedef struct {
    const char *name;
    int geo;
    tp_placement q[2], kv[2], pad[2];
    counts want[NMESH];
} layout;

/* B 3 (uneven over 2 and 4), 8 query heads over 4 or 2 kv heads, 5 queries
 * after 2 cached keys, left padding with fully masked rows. */
static const geo dist_geos[] = {
    {4, {3}, 8, 4, 5, 7, 4, 6, true, 0, 2, true, 2, "GQA 8/4", false},
    {4, {3}, 8, 2, 5, 7, 4, 6, true, 0, 2, true, 2, "GQA 8/2", false},
    {4, {3}, 8, 4, 6, 6, 4, 4, true, 0, 0, false, 0, "GQA 8/4 self-attention", false},
};

#define S_(d) {TP_PLACEMENT_SHARD, d, TP_SUM}
#define R_ {TP_PLACEMENT_REPLICATE, 0, TP_SUM}
#define NONE_ {0, 0, 0, 0}

/* Why each count: heads shard when the mesh dim divides the kv heads left on
 * a rank (8/4 on 2 and 4 ranks and on both dims of the 2x2 mesh; 8/2 on 2,
 * and on the 2x2 mesh only on mesh dim 0); otherwise the cheapest layout is
 * Replicate (an all_gather per input, its gradient a local chunk), which
 * moves as many bytes as the batch layout's all_to_all but leaves
 * key_padding where it is. The batch dim shards anywhere (uneven too). k, v
 * Replicate under sharded heads are chunked locally; their gradients come
 * back with an all_gather each per sharding mesh dim. A sequence shard moves
 * to the heads (all_to_all, back in the backward), on 3 ranks to the batch
 * (no key_padding there: the first of the equally cheap layouts). */
static const layout layouts[] = {
    {"heads 8/4", 0, {S_(1), S_(1)}, {S_(1), S_(1)}, {R_, R_},
     {NONE_, NONE_, {3, 0, 0, 0}, NONE_, NONE_}},
    {"heads 8/2", 1, {S_(1), S_(1)}, {S_(1), S_(1)}, {R_, R_},
     {NONE_, NONE_, {3, 0, 0, 0}, {3, 0, 0, 0}, {3, 0, 0, 0}}},
    {"batch, then heads", 0, {S_(0), S_(1)}, {S_(0), S_(1)}, {S_(0), R_},
     {NONE_, NONE_, NONE_, NONE_, NONE_}},
    {"heads, then batch", 1, {S_(1), S_(0)}, {S_(1), S_(0)}, {R_, S_(0)},
     {NONE_, NONE_, {3, 0, 0, 0}, {3, 0, 0, 0}, NONE_}},
    {"q heads, k and v replicated", 0, {S_(1), S_(1)}, {R_, R_}, {R_, R_},
     {NONE_, {0, 0, 2, 0}, {1, 0, 0, 0}, {0, 0, 2, 0}, {0, 0, 4, 0}}},
    {"replicated", 1, {R_, R_}, {R_, R_}, {R_, R_}, {NONE_, NONE_, NONE_, NONE_, NONE_}},
    {"sequence to heads", 2, {S_(2), R_}, {S_(2), R_}, {R_, R_},
     {NONE_, {0, 3, 0, 3}, {0, 3, 0, 3}, {0, 3, 0, 3}, {0, 3, 0, 3}}},
};

typedef struct {
    int mesh;
    tp_test_slot slot[TP_TEST_MAX_RANKS];
} dist_ctx;

static int64_t kind_count(const tp_comm_debug *d, tp_phase ph, tp_coll_kind k)
{
    return tp_comm_debug_module_count(d, TP_COMM_DEBUG_GLOBAL, ph, k);
}

static tp_status run_layout(tp_test_slot *s, tp_mesh *mesh, int mi, const layout *L)
{
    const geo *g = &dist_geos[L->geo];
    int m = tp_mesh_ndim(mesh);
    inputs in;
    tp_tensor *po = NULL, *d[4] = {0}, *dout = NULL, *gd = NULL, *full = NULL;
    RANK_OK(s, make_inputs(g, 40, TP_I64, &in));
    /* the single-rank op */
    tp_sdpa_options o = opts_of(g, in.pad);
    RANK_OK(s, tp_scaled_dot_product_attention_with(in.q, in.k, in.v, &o, &po));
    RANK_OK(s, tp_backward(po, in.g));
    /* the distributed one */
    tp_tensor *src[4] = {in.q, in.k, in.v, in.pad};
    const tp_placement *pl[4] = {L->q, L->kv, L->kv, L->pad};
    for (int i = 0; i < 4; i++) {
        tp_tensor *plain = NULL;
        if (!src[i])
            continue;
        if (i < 3) /* a copy of the values, without autograd: the DTensor is a leaf */
            RANK_OK(s, tp_tensor_clone(src[i], &plain));
        else
            plain = tp_tensor_retain(src[i]);
        RANK_OK(s, tp_dtensor_distribute(mesh, plain, m, pl[i], -1, &d[i]));
        tp_tensor_release(plain);
        if (i < 3)
            RANK_OK(s, tp_tensor_set_requires_grad(d[i], true));
    }
    o.key_padding = d[3];
    tp_comm_debug *dbg = NULL;
    RANK_OK(s, tp_comm_debug_create(&dbg));
    RANK_OK(s, tp_comm_debug_begin(dbg));
    tp_status st = tp_scaled_dot_product_attention_with(d[0], d[1], d[2], &o, &dout);
    if (st == TP_OK) /* the output's gradient in the output's layout: no comm */
        st = tp_dtensor_distribute(mesh, in.g, m, tp_dtensor_placements(dout), -1, &gd);
    if (st == TP_OK)
        st = tp_backward(dout, gd);
    RANK_OK(s, tp_comm_debug_end(dbg));
    RANK_OK(s, st);
    const counts *w = &L->want[mi];
    const int64_t want[2][TP_COLL_KIND_COUNT] = {
        [TP_PHASE_FORWARD] = {[TP_COLL_ALL_GATHER] = w->fag, [TP_COLL_ALL_TO_ALL] = w->fa2a},
        [TP_PHASE_BACKWARD] = {[TP_COLL_ALL_GATHER] = w->bag, [TP_COLL_ALL_TO_ALL] = w->ba2a}};
    for (int ph = 0; ph < 2; ph++)
        for (int k = 0; k < TP_COLL_KIND_COUNT; k++) {
            int64_t got = kind_count(dbg, (tp_phase)ph, (tp_coll_kind)k);
            RANK_EXPECT(s, got == want[ph][k], "%s, mesh %d: %lld %s in the %s, expected %lld",
                        L->name, mi, (long long)got, tp_coll_kind_name((tp_coll_kind)k),
                        ph == TP_PHASE_FORWARD ? "forward" : "backward",
                        (long long)want[ph][k]);
        }
    tp_comm_debug_free(dbg);
    bool ok = false;
    RANK_OK(s, tp_dtensor_full_tensor(dout, &full));
    RANK_OK(s, tp_tensor_allclose(full, po, RTOL, ATOL, &ok));
    RANK_EXPECT(s, ok, "%s, mesh %d: the output differs from the single-rank op", L->name, mi);
    tp_tensor *plain_in[3] = {in.q, in.k, in.v};
    for (int i = 0; i < 3; i++) {
        tp_tensor *gf = NULL;
        RANK_EXPECT(s, tp_tensor_grad(d[i]) != NULL, "%s: input %d has no gradient", L->name, i);
        if (!tp_tensor_grad(d[i]))
            continue;
        RANK_OK(s, tp_dtensor_full_tensor(tp_tensor_grad(d[i]), &gf));
        RANK_OK(s, tp_tensor_allclose(gf, tp_tensor_grad(plain_in[i]), RTOL, ATOL, &ok));
        RANK_EXPECT(s, ok, "%s, mesh %d: the gradient of input %d differs", L->name, mi, i);
        tp_tensor_release(gf);
    }
    for (int i = 0; i < 4; i++)
        tp_tensor_release(d[i]);
    tp_tensor_release(po);
    tp_tensor_release(dout);
    tp_tensor_release(gd);
    tp_tensor_release(full);
    inputs_free(&in);
    return TP_OK;
}

static tp_status dist_body(tp_comm *w, void *arg)
{
    dist_ctx *c = arg;
    tp_test_slot *s = &c->slot[tp_comm_rank(w)];
    tp_mesh *mesh = NULL;
    int64_t shape[2] = {c->mesh == M22 ? 2 : c->mesh + 1, 2};
    RANK_OK(s, tp_mesh_create(w, c->mesh == M22 ? 2 : 1, shape, NULL, &mesh));
    for (size_t L = 0; L < sizeof layouts / sizeof layouts[0]; L++)
        if (run_layout(s, mesh, c->mesh, &layouts[L]) != TP_OK)
            break;
    tp_mesh_free(mesh);
    return TP_OK;
}

ParameterizedTestParameters(ops_attention, equals_single_rank)
{
    static int meshes[] = {M1, M2, M3, M4, M22};
    return cr_make_param_array(int, meshes, NMESH);
}

ParameterizedTest(int *mesh, ops_attention, equals_single_rank, .timeout = 120)
{
    static dist_ctx c;
    memset(&c, 0, sizeof c);
    c.mesh = *mesh;
    tp_test_run(*mesh == M22 ? 4 : *mesh + 1, dist_body, &c, c.slot);
}

/* A DTensor q with a plain key_padding is refused, as every op refuses
 * mixing; Hq 12 over Hkv 5 fails before any collective. */
static tp_status mixing_body(tp_comm *w, void *arg)
{
    tp_test_slot *s = &((tp_test_slot *)arg)[tp_comm_rank(w)];
    tp_mesh *mesh = NULL;
    int64_t n = tp_comm_size(w);
    RANK_OK(s, tp_mesh_create(w, 1, &n, NULL, &mesh));
    geo g = dist_geos[0];
    inputs in;
    RANK_OK(s, make_inputs(&g, 5, TP_I64, &in));
    tp_placement r = tp_replicate();
    tp_tensor *d[3] = {0}, *out = NULL;
    tp_tensor *src[3] = {in.q, in.k, in.v};
    for (int i = 0; i < 3; i++) {
        tp_tensor *plain = NULL;
        RANK_OK(s, tp_tensor_clone(src[i], &plain));
        RANK_OK(s, tp_dtensor_distribute(mesh, plain, 1, &r, -1, &d[i]));
        tp_tensor_release(plain);
    }
    tp_sdpa_options o = opts_of(&g, in.pad);
    tp_status st = tp_scaled_dot_product_attention_with(d[0], d[1], d[2], &o, &out);
    RANK_EXPECT(s, st == TP_ERR_INVALID_ARG && strstr(tp_last_error(), "a DTensor") &&
                       strstr(tp_last_error(), "key_padding is a plain tensor"),
                "mixing: %s (%s)", tp_status_name(st), tp_last_error());
    tp_comm_debug *dbg = NULL;
    RANK_OK(s, tp_comm_debug_create(&dbg));
    RANK_OK(s, tp_comm_debug_begin(dbg));
    tp_tensor *q12 = NULL, *k5 = NULL, *dq = NULL, *dk = NULL;
    tp_placement sh = tp_shard(1);
    RANK_OK(s, tp_tensor_zeros(TP_F32, TP_CPU, 4, (int64_t[]){2, 12, 3, 4}, &q12));
    RANK_OK(s, tp_tensor_zeros(TP_F32, TP_CPU, 4, (int64_t[]){2, 5, 3, 4}, &k5));
    RANK_OK(s, tp_dtensor_distribute(mesh, q12, 1, &sh, -1, &dq));
    RANK_OK(s, tp_dtensor_distribute(mesh, k5, 1, &sh, -1, &dk));
    st = tp_scaled_dot_product_attention(dq, dk, dk, true, 0, &out);
    RANK_OK(s, tp_comm_debug_end(dbg));
    RANK_EXPECT(s, st == TP_ERR_INVALID_ARG && out == NULL &&
                       strstr(tp_last_error(), "12 query heads are not a multiple of 5"),
                "Hq 12 / Hkv 5: %s (%s)", tp_status_name(st), tp_last_error());
    RANK_EXPECT(s, tp_comm_debug_count(dbg, TP_COLL_ANY) == 0, "a refused call communicated");
    tp_comm_debug_free(dbg);
    tp_tensor *all[] = {d[0], d[1], d[2], q12, k5, dq, dk};
    for (size_t i = 0; i < 7; i++)
        tp_tensor_release(all[i]);
    inputs_free(&in);
    tp_mesh_free(mesh);
    return TP_OK;
}

Test(ops_attention, distributed_argument_errors, .timeout = 60)
{
    static tp_test_slot slots[TP_TEST_MAX_RANKS];
    memset(slots, 0, sizeof slots);
    tp_test_run(2, mixing_body, slots, slots);
}

/* ---- strided k, v and key_padding ------------------------------------------------------ */

/* A KV cache hands attention a view of its first Sk positions: k, v
 * [B, Hkv, Sk, D] inside [B, Hkv, L, D] storage, and key_padding [B, Sk]
 * inside [B, L]. Such views are read in place (the rows' and groups'
 * strides), views that do not fold into groups of rows (a narrow of the
 * head dim) through a copy, and both give the contiguous inputs' output and
 * gradients exactly. */
static tp_tensor *view_of(tp_tensor *big, int dim, int64_t len)
{
    tp_tensor *v = NULL;
    CHECK_OK(tp_tensor_narrow(big, dim, 0, len, &v));
    return v;
}

static void strided_case(int dim, int64_t extra, bool grad, tp_sdpa_backend be)
{
    const int64_t B = 2, Hq = 4, Hkv = 2, Sq = 3, Sk = 5, D = 8;
    int64_t qs[4] = {B, Hq, Sq, D}, ks[4] = {B, Hkv, Sk, D}, ps[2] = {B, Sk + extra};
    ks[dim] += extra;
    tp_tensor *q = NULL, *kb = NULL, *vb = NULL, *pb = NULL;
    CHECK_OK(rand_tensor(4, qs, 1, &q));
    CHECK_OK(rand_tensor(4, ks, 2, &kb));
    CHECK_OK(rand_tensor(4, ks, 3, &vb));
    CHECK_OK(tp_tensor_zeros(TP_I64, TP_CPU, 2, ps, &pb));
    CHECK_OK(tp_tensor_fill(pb, 1));
    const int64_t i0[2] = {0, 0}, i1[2] = {0, 1};
    CHECK_OK(tp_tensor_set(pb, i0, 0)); /* batch 0 left-padded by 2 */
    CHECK_OK(tp_tensor_set(pb, i1, 0));
    tp_tensor *k = view_of(kb, dim, ks[dim] - extra), *v = view_of(vb, dim, ks[dim] - extra),
              *pad = view_of(pb, 1, Sk);
    cr_assert((dim == 0 || !tp_tensor_is_contiguous(k)) && !tp_tensor_is_contiguous(pad));
    tp_tensor *kc = NULL, *vc = NULL, *pc = NULL, *qc = NULL;
    CHECK_OK(tp_tensor_clone(k, &kc));
    CHECK_OK(tp_tensor_clone(v, &vc));
    CHECK_OK(tp_tensor_clone(pad, &pc));
    CHECK_OK(tp_tensor_clone(q, &qc));
    tp_tensor *ins[2][3] = {{q, k, v}, {qc, kc, vc}};
    for (int s = 0; s < 2 && grad; s++)
        for (int i = 0; i < 3; i++)
            CHECK_OK(tp_tensor_set_requires_grad(ins[s][i], true));
    tp_sdpa_options o = {.causal = true, .key_offset = Sk - Sq, .key_padding = pad,
                         .backend = be};
    tp_tensor *a = NULL, *b = NULL;
    CHECK_OK(tp_scaled_dot_product_attention_with(q, k, v, &o, &a));
    o.key_padding = pc;
    CHECK_OK(tp_scaled_dot_product_attention_with(qc, kc, vc, &o, &b));
    bool eq = false;
    CHECK_OK(tp_tensor_equal(a, b, &eq));
    cr_assert(eq, "dim %d: the strided inputs' output differs", dim);
    if (grad) {
        tp_tensor *la = NULL, *lb = NULL;
        CHECK_OK(tp_sum_all(a, &la));
        CHECK_OK(tp_sum_all(b, &lb));
        CHECK_OK(tp_backward(la, NULL));
        CHECK_OK(tp_backward(lb, NULL));
        for (int i = 0; i < 3; i++) {
            CHECK_OK(tp_tensor_equal(tp_tensor_grad(ins[0][i]), tp_tensor_grad(ins[1][i]), &eq));
            cr_assert(eq, "dim %d: the gradient of input %d differs", dim, i);
        }
        tp_tensor_release(la);
        tp_tensor_release(lb);
    }
    tp_tensor *all[] = {a, b, q, kb, vb, pb, k, v, pad, kc, vc, pc, qc};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        tp_tensor_release(all[i]);
}

Test(ops_attention, strided_kv_and_padding_read_in_place, .timeout = 30)
{
    for (int f = 0; f < 2; f++) {
        tp_sdpa_backend be = f ? TP_SDPA_BACKEND_FLASH : TP_SDPA_BACKEND_MATH;
        strided_case(2, 7, false, be); /* a cache's prefix: groups L rows apart */
        strided_case(2, 7, true, be);
        strided_case(3, 8, true, be);  /* rows 2D apart */
        strided_case(0, 1, false, be); /* a batch prefix: contiguous groups */
        strided_case(1, 2, true, be);  /* heads of a wider tensor: copied */
    }
}
