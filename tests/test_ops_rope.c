/* Rotary position embedding (src/dtensor/ops_rope.c):
 *  - tp_rope_inv_freq for the four rope types against the numbers Hugging
 *    Face transformers gives (tests/fixtures/rope_hf_fixture.h, made by
 *    tests/fixtures/gen_rope_fixture.py) and against the HF formulas
 *    evaluated in double here;
 *  - tp_rope_cos_sin against HF's cos/sin and against a double reference at
 *    positions up to 100000 (f32 tolerance), in bf16/f16 one rounding of the
 *    f32 values, as DTensors with the positions' placements;
 *  - tp_rotary_embedding forward and backward bit for bit against HF's
 *    apply_rotary_pos_emb and against a double reference that forms
 *    rotate_half itself; cos and sin get no gradient;
 *  - the distributed op equal to the single-rank one, bit for bit, on 1-4
 *    ranks and a 2x2 mesh with heads, batch and sequence sharded, with no
 *    collective forward or backward (comm-debug counts exactly 0);
 *  - the meta device, and every error with its code and message.
 * bf16/f16 against f64 references are in test_ops_dtype.c, the kernels in
 * test_kernel_table.c / test_kernels_dtype.c, CUDA in test_cuda*.c. */
#include <math.h>

#include "tp_test.h"

#include "fixtures/rope_hf_fixture.h"

static float f32_of_bits(uint32_t b)
{
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

static int32_t bits_of(float f)
{
    int32_t b;
    memcpy(&b, &f, sizeof b);
    return b;
}

/* Distance in units in the last place between two positive f32 values. */
static int64_t ulps(float a, float b)
{
    return llabs((int64_t)bits_of(a) - (int64_t)bits_of(b));
}

static tp_rope_config cfg_of(const hf_case *c)
{
    return (tp_rope_config){(tp_rope_type)c->type, c->head_dim, c->theta, c->factor, c->low,
                            c->high, c->original_max, c->max_pos};
}

/* An i64 [B, S] CPU tensor of the given positions. */
static tp_tensor *positions(int64_t B, int64_t S, const int64_t *p)
{
    tp_tensor *t = NULL;
    const int64_t shape[2] = {B, S};
    CHECK_OK(tp_tensor_from_data(TP_I64, 2, shape, p, &t));
    return t;
}

#define CHECK_MSG(expr, code, text)                                                \
    do {                                                                           \
        CHECK_ERR(expr, code);                                                     \
        cr_assert(strstr(tp_last_error(), text), "%s: \"%s\" lacks \"%s\"", #expr, \
                  tp_last_error(), text);                                          \
    } while (0)

/* ---- inverse frequencies ------------------------------------------------------ */

/* HF's inv_freq (after a forward over positions up to 100000: seq_len
 * 100001 for dynamic): equal in nearly every element; where torch's power
 * (SLEEF, 1 ulp) rounds differently from the correctly rounded one, by an
 * ulp or two. */
Test(ops_rope, inv_freq_matches_hugging_face, .timeout = 30)
{
    for (int k = 0; k < HF_NCASES; k++) {
        const hf_case *c = &HF_CASES[k];
        tp_rope_config cfg = cfg_of(c);
        float inv[64];
        double scaling = 0;
        CHECK_OK(tp_rope_inv_freq(&cfg, 100001, inv, &scaling));
        cr_assert_eq(scaling, 1.0, "%s: attention scaling %g", c->name, scaling);
        int differ = 0;
        for (int64_t i = 0; i < c->head_dim / 2; i++) {
            float want = f32_of_bits(c->inv_freq[i]);
            cr_assert(ulps(inv[i], want) <= 2, "%s: inv_freq[%lld] = %.9g, HF %.9g", c->name,
                      (long long)i, (double)inv[i], (double)want);
            differ += inv[i] != want;
        }
        cr_assert_leq(differ, 1, "%s: %d elements differ from HF's", c->name, differ);
    }
    /* dynamic at the tensor seq_lens HF's module passes, one at or below
     * max_position_embeddings (theta unchanged) */
    const hf_case *c = &HF_CASES[HF_DYNAMIC_CASE];
    tp_rope_config cfg = cfg_of(c);
    for (int j = 0; j < 2; j++) {
        float inv[32];
        CHECK_OK(tp_rope_inv_freq(&cfg, HF_DYNAMIC_SEQ_LENS[j], inv, NULL));
        int differ = 0;
        for (int i = 0; i < 32; i++) {
            float want = f32_of_bits(HF_DYNAMIC_INV_FREQ_AT[j][i]);
            cr_assert(ulps(inv[i], want) <= 2, "dynamic at %lld: [%d] %.9g, HF %.9g",
                      (long long)HF_DYNAMIC_SEQ_LENS[j], i, (double)inv[i], (double)want);
            differ += inv[i] != want;
        }
        cr_assert_leq(differ, 1);
    }
}

/* The HF formulas in double, written out here; f32 steps stay within a few
 * f32 roundings of them (the llama3 smoothing is continuous, so no element
 * is near a jump). */
static double ref_inv(const tp_rope_config *c, int64_t seq_len, int64_t i)
{
    const double dim = (double)c->head_dim;
    double base = c->theta == 0 ? 10000.0 : c->theta;
    if (c->type == TP_ROPE_DYNAMIC) {
        double L = (double)(seq_len > c->max_position_embeddings ? seq_len
                                                                 : c->max_position_embeddings);
        base *= pow(c->factor * L / (double)c->max_position_embeddings - (c->factor - 1),
                    dim / (dim - 2));
    }
    double inv = 1.0 / pow(base, 2.0 * (double)i / dim);
    if (c->type == TP_ROPE_LINEAR)
        return inv / c->factor;
    if (c->type != TP_ROPE_LLAMA3)
        return inv;
    double old = (double)c->original_max_position_embeddings;
    double wl = 2 * M_PI / inv, low_wl = old / c->low_freq_factor,
           high_wl = old / c->high_freq_factor;
    if (wl < high_wl)
        return inv;
    if (wl > low_wl)
        return inv / c->factor;
    double sm = (old / wl - c->low_freq_factor) / (c->high_freq_factor - c->low_freq_factor);
    return (1 - sm) * inv / c->factor + sm * inv;
}

Test(ops_rope, inv_freq_against_double_formulas, .timeout = 30)
{
    const tp_rope_config cfgs[] = {
        {TP_ROPE_DEFAULT, 128, 0, 0, 0, 0, 0, 0}, /* theta 0: 10000 */
        {TP_ROPE_DEFAULT, 96, 1e6, 0, 0, 0, 0, 0},
        {TP_ROPE_LINEAR, 80, 10000, 2.5, 0, 0, 0, 0},
        {TP_ROPE_DYNAMIC, 64, 10000, 4, 0, 0, 0, 4096},
        {TP_ROPE_DYNAMIC, 6, 500000, 1.5, 0, 0, 0, 100}, /* exponent 1.5 */
        {TP_ROPE_LLAMA3, 128, 500000, 8, 1, 4, 8192, 0},
        {TP_ROPE_LLAMA3, 64, 500000, 32, 1, 4, 8192, 0},
        {TP_ROPE_LLAMA3, 256, 10000, 4, 2, 8, 2048, 0},
    };
    const int64_t lens[] = {0, 100, 4096, 4097, 100000};
    for (size_t k = 0; k < sizeof cfgs / sizeof cfgs[0]; k++)
        for (size_t l = 0; l < sizeof lens / sizeof lens[0]; l++) {
            float inv[128];
            CHECK_OK(tp_rope_inv_freq(&cfgs[k], lens[l], inv, NULL));
            for (int64_t i = 0; i < cfgs[k].head_dim / 2; i++) {
                double r = ref_inv(&cfgs[k], lens[l], i);
                cr_assert(fabs(inv[i] - r) <= 16 * 0x1p-24 * r,
                          "config %zu, seq_len %lld: inv_freq[%lld] = %.9g, reference %.9g", k,
                          (long long)lens[l], (long long)i, (double)inv[i], r);
            }
        }
    /* the llama3 bands: the highest frequency unchanged, the lowest / factor */
    float inv[64], def[64];
    tp_rope_config d = cfgs[6];
    d.type = TP_ROPE_DEFAULT;
    CHECK_OK(tp_rope_inv_freq(&cfgs[6], 0, inv, NULL));
    CHECK_OK(tp_rope_inv_freq(&d, 0, def, NULL));
    cr_assert_eq(inv[0], def[0]);
    cr_assert_eq(inv[31], def[31] / 32.0f);
    /* dynamic below max_position_embeddings is the default */
    tp_rope_config dyn = cfgs[3];
    d = dyn;
    d.type = TP_ROPE_DEFAULT;
    CHECK_OK(tp_rope_inv_freq(&dyn, 4096, inv, NULL));
    CHECK_OK(tp_rope_inv_freq(&d, 0, def, NULL));
    cr_assert(!memcmp(inv, def, 32 * sizeof(float)), "dynamic at max_position_embeddings");
}

/* ---- cos and sin ------------------------------------------------------------- */

/* HF's cos and sin at positions up to 100000. With equal inv_freq the angle
 * is the same f32 product and cos/sin agree to an ulp (torch's SLEEF vs the
 * correctly rounded value); where inv_freq differs by an ulp, the angle may
 * differ by |position| times that, plus its own rounding. */
Test(ops_rope, cos_sin_match_hugging_face, .timeout = 30)
{
    tp_tensor *pos = positions(1, HF_NPOS, HF_POSITIONS);
    for (int k = 0; k < HF_NCASES; k++) {
        const hf_case *c = &HF_CASES[k];
        tp_rope_config cfg = cfg_of(c);
        tp_tensor *co = NULL, *si = NULL;
        CHECK_OK(tp_rope_cos_sin(&cfg, pos, TP_F32, &co, &si));
        const int64_t D = c->head_dim, h = D / 2;
        cr_assert_eq(tp_tensor_ndim(co), 3);
        cr_assert(tp_tensor_size(co, 0) == 1 && tp_tensor_size(co, 1) == HF_NPOS &&
                  tp_tensor_size(co, 2) == D);
        float inv[64];
        CHECK_OK(tp_rope_inv_freq(&cfg, HF_POSITIONS[HF_NPOS - 1] + 1, inv, NULL));
        const float *cv = tp_tensor_data(co), *sv = tp_tensor_data(si);
        for (int p = 0; p < HF_NPOS; p++)
            for (int64_t i = 0; i < D; i++) {
                int64_t j = i % h;
                float hinv = f32_of_bits(c->inv_freq[j]);
                float angle = (float)HF_POSITIONS[p] * hinv;
                double tol = (double)HF_POSITIONS[p] * fabs((double)inv[j] - hinv) +
                             2 * (nextafterf(angle, INFINITY) - angle) + 0x1p-23;
                double wc = f32_of_bits(c->cos[p * h + j]), ws = f32_of_bits(c->sin[p * h + j]);
                cr_assert(fabs(cv[p * D + i] - wc) <= tol && fabs(sv[p * D + i] - ws) <= tol,
                          "%s, position %lld, [%lld]: cos %.9g sin %.9g, HF %.9g %.9g (tol %.3g)",
                          c->name, (long long)HF_POSITIONS[p], (long long)i,
                          (double)cv[p * D + i], (double)sv[p * D + i], wc, ws, tol);
            }
        tp_tensor_release(co);
        tp_tensor_release(si);
    }
    tp_tensor_release(pos);
}

/* cos/sin against cos and sin in double of the f32 angle (float)p *
 * inv_freq[i], HF's freqs: within half an f32 ulp (plus a double rounding),
 * positions up to 100000; the second half of the head dim repeats the first;
 * bf16 and f16 are the f32 values rounded once. */
Test(ops_rope, cos_sin_against_double, .timeout = 30)
{
    enum { B = 3, S = 37, D = 64, N = B * S };
    int64_t p[N];
    for (int i = 0; i < N; i++)
        p[i] = (int64_t)(tp_rng_uniform(5, (uint64_t)i) * 100001.0);
    p[0] = 0;
    p[1] = 100000;
    p[2] = 99999;
    tp_tensor *pos = positions(B, S, p);
    const tp_rope_config cfgs[] = {{TP_ROPE_DEFAULT, D, 500000, 0, 0, 0, 0, 0},
                                   {TP_ROPE_LLAMA3, D, 500000, 8, 1, 4, 8192, 0},
                                   {TP_ROPE_DYNAMIC, D, 10000, 2, 0, 0, 0, 2048}};
    for (size_t k = 0; k < sizeof cfgs / sizeof cfgs[0]; k++) {
        float inv[D / 2];
        int64_t mx = 0;
        for (int i = 0; i < N; i++)
            mx = p[i] > mx ? p[i] : mx;
        CHECK_OK(tp_rope_inv_freq(&cfgs[k], mx + 1, inv, NULL));
        tp_tensor *co = NULL, *si = NULL;
        CHECK_OK(tp_rope_cos_sin(&cfgs[k], pos, TP_F32, &co, &si));
        cr_assert_eq(tp_tensor_dtype(co), TP_F32);
        cr_assert(!tp_tensor_requires_grad(co) && !tp_tensor_requires_grad(si));
        const float *cv = tp_tensor_data(co), *sv = tp_tensor_data(si);
        for (int r = 0; r < N; r++)
            for (int i = 0; i < D; i++) {
                float angle = (float)p[r] * inv[i % (D / 2)];
                double wc = cos((double)angle), ws = sin((double)angle);
                cr_assert(fabs(cv[r * D + i] - wc) <= 0x1p-24 * fabs(wc) + 0x1p-60 &&
                              fabs(sv[r * D + i] - ws) <= 0x1p-24 * fabs(ws) + 0x1p-60,
                          "config %zu, position %lld, [%d]: cos %.9g sin %.9g, want %.17g %.17g",
                          k, (long long)p[r], i, (double)cv[r * D + i], (double)sv[r * D + i], wc,
                          ws);
            }
        const tp_dtype lp[2] = {TP_BF16, TP_F16};
        for (int d = 0; d < 2; d++) {
            tp_tensor *cl = NULL, *sl = NULL, *cr = NULL, *sr = NULL;
            bool eq = false;
            CHECK_OK(tp_rope_cos_sin(&cfgs[k], pos, lp[d], &cl, &sl));
            cr_assert_eq(tp_tensor_dtype(cl), lp[d]);
            CHECK_OK(tp_tensor_to(co, lp[d], TP_CPU, &cr));
            CHECK_OK(tp_tensor_to(si, lp[d], TP_CPU, &sr));
            CHECK_OK(tp_tensor_equal(cl, cr, &eq));
            cr_assert(eq, "config %zu: %s cos is not the f32 cos rounded once", k,
                      tp_dtype_name(lp[d]));
            CHECK_OK(tp_tensor_equal(sl, sr, &eq));
            cr_assert(eq, "config %zu: %s sin is not the f32 sin rounded once", k,
                      tp_dtype_name(lp[d]));
            tp_tensor_release(cl);
            tp_tensor_release(sl);
            tp_tensor_release(cr);
            tp_tensor_release(sr);
        }
        tp_tensor_release(co);
        tp_tensor_release(si);
    }
    tp_tensor_release(pos);
}

/* dynamic is stateless: the largest position of this call decides. */
Test(ops_rope, dynamic_follows_the_largest_position, .timeout = 30)
{
    const tp_rope_config cfg = {TP_ROPE_DYNAMIC, 16, 10000, 2, 0, 0, 0, 64};
    const int64_t a[4] = {0, 1, 2, 3}, b[4] = {0, 1, 2, 200};
    tp_tensor *pa = positions(1, 4, a), *pb = positions(1, 4, b);
    tp_tensor *ca = NULL, *sa = NULL, *cb = NULL, *sb = NULL;
    CHECK_OK(tp_rope_cos_sin(&cfg, pa, TP_F32, &ca, &sa));
    CHECK_OK(tp_rope_cos_sin(&cfg, pb, TP_F32, &cb, &sb));
    float i64[8], i201[8];
    CHECK_OK(tp_rope_inv_freq(&cfg, 64, i64, NULL));
    CHECK_OK(tp_rope_inv_freq(&cfg, 201, i201, NULL));
    cr_assert(i201[3] < i64[3] * 0.9999f, "a longer sequence lowers the frequencies: %g, %g",
              (double)i201[3], (double)i64[3]);
    const float *va = tp_tensor_data(ca), *vb = tp_tensor_data(cb);
    /* position 3 of the first call at the unscaled frequency, position 2 of
     * the second at the one of seq_len 201 */
    cr_assert_eq(va[3 * 16 + 5], (float)cos((double)(3.0f * i64[5])));
    cr_assert_eq(vb[2 * 16 + 5], (float)cos((double)(2.0f * i201[5])));
    tp_tensor *all[] = {pa, pb, ca, sa, cb, sb};
    for (size_t i = 0; i < 6; i++)
        tp_tensor_release(all[i]);
}

/* ---- the op -------------------------------------------------------------------- */

static tp_tensor *from_bits(int nd, const int64_t *shape, const uint32_t *bits, int64_t half,
                            bool dup)
{
    int64_t n = 1;
    for (int d = 0; d < nd; d++)
        n *= shape[d];
    float *v = malloc((size_t)n * sizeof *v);
    for (int64_t e = 0; e < n; e++)
        v[e] = dup ? f32_of_bits(bits[(e / (2 * half)) * half + e % half]) : f32_of_bits(bits[e]);
    tp_tensor *t = NULL;
    CHECK_OK(tp_tensor_from_data(TP_F32, nd, shape, v, &t));
    free(v);
    return t;
}

/* apply_rotary_pos_emb in f32, forward and backward, on HF's own cos and
 * sin: the same roundings, so the same bits. */
Test(ops_rope, apply_matches_hugging_face_bit_for_bit, .timeout = 30)
{
    const int64_t B = HF_APPLY_B, H = HF_APPLY_H, S = HF_APPLY_S, D = HF_APPLY_D;
    const int64_t xs[4] = {B, H, S, D}, cs[3] = {B, S, D}, n = B * H * S * D;
    float *q = malloc((size_t)n * sizeof *q), *g = malloc((size_t)n * sizeof *g);
    for (int64_t i = 0; i < n; i++) {
        q[i] = (float)((37 * i) % 101 - 50) / 32.0f;
        g[i] = (float)((53 * i) % 89 - 44) / 16.0f;
    }
    tp_tensor *x = NULL, *gy = NULL, *y = NULL;
    CHECK_OK(tp_tensor_from_data(TP_F32, 4, xs, q, &x));
    CHECK_OK(tp_tensor_from_data(TP_F32, 4, xs, g, &gy));
    tp_tensor *co = from_bits(3, cs, HF_APPLY_COS, D / 2, true);
    tp_tensor *si = from_bits(3, cs, HF_APPLY_SIN, D / 2, true);
    CHECK_OK(tp_tensor_set_requires_grad(x, true));
    CHECK_OK(tp_rotary_embedding(x, co, si, &y));
    CHECK_OK(tp_backward(y, gy));
    const float *yv = tp_tensor_data(y), *gv = tp_tensor_data(tp_tensor_grad(x));
    for (int64_t i = 0; i < n; i++) {
        cr_assert_eq(bits_of(yv[i]), (int32_t)HF_APPLY_Y[i], "y[%lld] = %.9g, HF %.9g",
                     (long long)i, (double)yv[i], (double)f32_of_bits(HF_APPLY_Y[i]));
        cr_assert_eq(bits_of(gv[i]), (int32_t)HF_APPLY_GQ[i], "gq[%lld] = %.9g, HF %.9g",
                     (long long)i, (double)gv[i], (double)f32_of_bits(HF_APPLY_GQ[i]));
    }
    /* our cos/sin at those positions: HF's to an ulp */
    const int64_t p[4] = {0, 1, 2, 3};
    tp_tensor *pos = positions(1, 4, p), *c2 = NULL, *s2 = NULL;
    const tp_rope_config cfg = cfg_of(&HF_CASES[0]);
    CHECK_OK(tp_rope_cos_sin(&cfg, pos, TP_F32, &c2, &s2));
    double dc = 0, ds = 0;
    CHECK_OK(tp_tensor_max_abs_diff(c2, co, &dc));
    CHECK_OK(tp_tensor_max_abs_diff(s2, si, &ds));
    cr_assert(dc <= 0x1p-24 && ds <= 0x1p-24, "cos/sin differ from HF's by %g, %g", dc, ds);
    tp_tensor *all[] = {x, gy, y, co, si, pos, c2, s2};
    for (size_t i = 0; i < 8; i++)
        tp_tensor_release(all[i]);
    free(q);
    free(g);
}

/* rotate_half written out: r = cat(-x[h:], x[:h]) */
static void rotate_half(const double *x, double *r, int64_t D)
{
    for (int64_t i = 0; i < D / 2; i++) {
        r[i] = -x[i + D / 2];
        r[i + D / 2] = x[i];
    }
}

/* y = x cos + rotate_half(x) sin and, for loss <g, y>, gx = g cos +
 * rotate_half^T(g sin), rotate_half^T(v) = cat(v[h:], -v[:h]); a: the sums of
 * the absolute terms (the error bound). */
static void ref_rope(int64_t B, int64_t H, int64_t S, int64_t D, int64_t Bc, const float *x,
                     const float *c, const float *s, const float *g, double *y, double *gx,
                     double *ay, double *ag)
{
    double xr[64], rh[64], gs[64];
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t t = 0; t < S; t++) {
                int64_t row = ((b * H + h) * S + t) * D, cr = ((Bc == 1 ? 0 : b) * S + t) * D;
                for (int64_t i = 0; i < D; i++) {
                    xr[i] = x[row + i];
                    gs[i] = (double)g[row + i] * s[cr + i];
                }
                rotate_half(xr, rh, D);
                for (int64_t i = 0; i < D; i++) {
                    y[row + i] = xr[i] * c[cr + i] + rh[i] * s[cr + i];
                    ay[row + i] = fabs(xr[i] * c[cr + i]) + fabs(rh[i] * s[cr + i]);
                }
                for (int64_t i = 0; i < D; i++) {
                    double t2 = i < D / 2 ? gs[i + D / 2] : -gs[i - D / 2];
                    gx[row + i] = (double)g[row + i] * c[cr + i] + t2;
                    ag[row + i] = fabs((double)g[row + i] * c[cr + i]) + fabs(t2);
                }
            }
}

static tp_tensor *uniform(int nd, const int64_t *shape, uint64_t seed)
{
    tp_tensor *t = NULL;
    CHECK_OK(tp_tensor_zeros(TP_F32, TP_CPU, nd, shape, &t));
    CHECK_OK(tp_tensor_fill_random(t, TP_RNG_UNIFORM, -1, 1, seed, NULL, NULL));
    return t;
}

Test(ops_rope, forward_and_backward_against_double, .timeout = 30)
{
    enum { B = 2, H = 3, S = 5, D = 16 };
    const int64_t xs[4] = {B, H, S, D};
    int64_t p[B * S];
    for (int i = 0; i < B * S; i++)
        p[i] = (int64_t)(tp_rng_uniform(9, (uint64_t)i) * 100001.0);
    p[3] = 100000;
    const tp_rope_config cfg = {TP_ROPE_LLAMA3, D, 500000, 8, 1, 4, 8192, 0};
    /* cos/sin [B, S, D] and [1, S, D] from positions, and arbitrary [B, S, D]
     * values whose halves differ (the formula in general) */
    for (int mode = 0; mode < 3; mode++) {
        const int64_t Bc = mode == 1 ? 1 : B;
        tp_tensor *pos = positions(Bc, S, p), *co = NULL, *si = NULL, *y = NULL;
        if (mode < 2) {
            CHECK_OK(tp_rope_cos_sin(&cfg, pos, TP_F32, &co, &si));
        } else {
            co = uniform(3, (int64_t[]){B, S, D}, 3);
            si = uniform(3, (int64_t[]){B, S, D}, 4);
        }
        tp_tensor *x = uniform(4, xs, 1), *g = uniform(4, xs, 2);
        CHECK_OK(tp_tensor_set_requires_grad(x, true));
        CHECK_OK(tp_tensor_set_requires_grad(co, true)); /* never gets a gradient */
        CHECK_OK(tp_rotary_embedding(x, co, si, &y));
        CHECK_OK(tp_backward(y, g));
        static double ry[B * H * S * D], rg[B * H * S * D], ay[B * H * S * D],
            ag[B * H * S * D];
        ref_rope(B, H, S, D, Bc, tp_tensor_data(x), tp_tensor_data(co), tp_tensor_data(si),
                 tp_tensor_data(g), ry, rg, ay, ag);
        const float *yv = tp_tensor_data(y), *gv = tp_tensor_data(tp_tensor_grad(x));
        for (int i = 0; i < B * H * S * D; i++) {
            cr_assert(fabs(yv[i] - ry[i]) <= 0x1p-23 * ay[i], "mode %d: y[%d] = %.9g, want %.17g",
                      mode, i, (double)yv[i], ry[i]);
            cr_assert(fabs(gv[i] - rg[i]) <= 0x1p-23 * ag[i], "mode %d: gx[%d] = %.9g, want %.17g",
                      mode, i, (double)gv[i], rg[i]);
        }
        cr_assert_null(tp_tensor_grad(co), "cos got a gradient");
        cr_assert_null(tp_tensor_grad(si), "sin got a gradient");
        tp_tensor *all[] = {pos, co, si, y, x, g};
        for (size_t i = 0; i < 6; i++)
            tp_tensor_release(all[i]);
    }
}

/* Shapes only on the meta device. */
Test(ops_rope, meta_device, .timeout = 30)
{
    const tp_rope_config cfg = {TP_ROPE_DYNAMIC, 8, 0, 2, 0, 0, 0, 16};
    tp_tensor *pos = NULL, *x = NULL, *co = NULL, *si = NULL, *y = NULL;
    CHECK_OK(tp_tensor_empty(TP_I64, TP_META, 2, (int64_t[]){2, 7}, &pos));
    CHECK_OK(tp_tensor_empty(TP_BF16, TP_META, 4, (int64_t[]){2, 4, 7, 8}, &x));
    CHECK_OK(tp_rope_cos_sin(&cfg, pos, TP_BF16, &co, &si));
    cr_assert(tp_tensor_is_meta(co) && tp_tensor_is_meta(si));
    cr_assert(tp_tensor_size(co, 0) == 2 && tp_tensor_size(co, 1) == 7 &&
              tp_tensor_size(co, 2) == 8 && tp_tensor_dtype(co) == TP_BF16);
    CHECK_OK(tp_tensor_set_requires_grad(x, true));
    CHECK_OK(tp_rotary_embedding(x, co, si, &y));
    cr_assert(tp_tensor_is_meta(y) && tp_tensor_ndim(y) == 4 && tp_tensor_size(y, 2) == 7);
    tp_tensor *all[] = {pos, x, co, si, y};
    for (size_t i = 0; i < 5; i++)
        tp_tensor_release(all[i]);
}

/* ---- errors ------------------------------------------------------------------------ */

Test(ops_rope, config_errors_name_the_field, .timeout = 30)
{
    float inv[64];
    const tp_rope_config ok = {TP_ROPE_LLAMA3, 64, 500000, 8, 1, 4, 8192, 0};
    tp_rope_config c;
    CHECK_MSG(tp_rope_inv_freq(NULL, 0, inv, NULL), TP_ERR_INVALID_ARG, "cfg is NULL");
    CHECK_MSG(tp_rope_inv_freq(&ok, 0, NULL, NULL), TP_ERR_INVALID_ARG, "inv_freq is NULL");
    CHECK_MSG(tp_rope_inv_freq(&ok, -1, inv, NULL), TP_ERR_INVALID_ARG, "seq_len -1 is negative");
    c = ok;
    c.type = (tp_rope_type)7;
    CHECK_MSG(tp_rope_inv_freq(&c, 0, inv, NULL), TP_ERR_INVALID_ARG, "type 7 is not a rope type");
    c = ok;
    c.head_dim = 63;
    CHECK_MSG(tp_rope_inv_freq(&c, 0, inv, NULL), TP_ERR_INVALID_ARG,
              "rope_inv_freq: head_dim 63 must be positive and even");
    c.head_dim = 0;
    CHECK_MSG(tp_rope_inv_freq(&c, 0, inv, NULL), TP_ERR_INVALID_ARG, "head_dim 0 must be");
    c.head_dim = -4;
    CHECK_MSG(tp_rope_inv_freq(&c, 0, inv, NULL), TP_ERR_INVALID_ARG, "head_dim -4 must be");
    c = ok;
    c.theta = -1;
    CHECK_MSG(tp_rope_inv_freq(&c, 0, inv, NULL), TP_ERR_INVALID_ARG, "theta -1 must be >= 0");
    c.theta = NAN;
    CHECK_MSG(tp_rope_inv_freq(&c, 0, inv, NULL), TP_ERR_INVALID_ARG, "theta nan");
    c = ok;
    c.factor = 0.5;
    CHECK_MSG(tp_rope_inv_freq(&c, 0, inv, NULL), TP_ERR_INVALID_ARG,
              "factor 0.5 must be >= 1 (and finite) for llama3 scaling");
    c.type = TP_ROPE_LINEAR;
    c.factor = 0;
    CHECK_MSG(tp_rope_inv_freq(&c, 0, inv, NULL), TP_ERR_INVALID_ARG,
              "factor 0 must be >= 1 (and finite) for linear scaling");
    c = ok;
    c.high_freq_factor = 1;
    CHECK_MSG(tp_rope_inv_freq(&c, 0, inv, NULL), TP_ERR_INVALID_ARG,
              "high_freq_factor 1 must exceed low_freq_factor 1 for llama3 scaling");
    c = ok;
    c.low_freq_factor = 0;
    CHECK_MSG(tp_rope_inv_freq(&c, 0, inv, NULL), TP_ERR_INVALID_ARG,
              "low_freq_factor 0 must be positive");
    c = ok;
    c.original_max_position_embeddings = 0;
    CHECK_MSG(tp_rope_inv_freq(&c, 0, inv, NULL), TP_ERR_INVALID_ARG,
              "original_max_position_embeddings 0 must be positive for llama3 scaling");
    c = (tp_rope_config){TP_ROPE_DYNAMIC, 64, 10000, 2, 0, 0, 0, 0};
    CHECK_MSG(tp_rope_inv_freq(&c, 0, inv, NULL), TP_ERR_INVALID_ARG,
              "max_position_embeddings 0 must be positive for dynamic scaling");
    c.max_position_embeddings = 10;
    c.head_dim = 2;
    CHECK_MSG(tp_rope_inv_freq(&c, 0, inv, NULL), TP_ERR_INVALID_ARG,
              "head_dim 2 is too small for dynamic scaling");
    /* the default type ignores the scaling fields; theta 0 is 10000 */
    c = (tp_rope_config){TP_ROPE_DEFAULT, 4, 0, -3, -1, -1, -1, -1};
    CHECK_OK(tp_rope_inv_freq(&c, 0, inv, NULL));
    cr_assert(inv[0] == 1.0f && inv[1] == 0.01f, "%.9g %.9g", (double)inv[0], (double)inv[1]);
    /* nothing written on error */
    inv[0] = -7;
    c.head_dim = 3;
    CHECK_ERR(tp_rope_inv_freq(&c, 0, inv, NULL), TP_ERR_INVALID_ARG);
    cr_assert_eq(inv[0], -7.0f);
}

Test(ops_rope, cos_sin_errors, .timeout = 30)
{
    const tp_rope_config cfg = {TP_ROPE_DEFAULT, 8, 10000, 0, 0, 0, 0, 0};
    const int64_t p[6] = {0, 1, 2, 3, -4, 5};
    tp_tensor *pos = positions(2, 3, p), *co = NULL, *si = NULL, *p32 = NULL, *p1 = NULL;
    CHECK_MSG(tp_rope_cos_sin(&cfg, pos, TP_F32, &co, &si), TP_ERR_INVALID_ARG,
              "rope_cos_sin: position_ids[1, 1] = -4 is negative");
    cr_assert(!co && !si);
    CHECK_MSG(tp_rope_cos_sin(&cfg, pos, TP_F32, NULL, &si), TP_ERR_INVALID_ARG, "cos is NULL");
    CHECK_MSG(tp_rope_cos_sin(&cfg, pos, TP_F32, &co, NULL), TP_ERR_INVALID_ARG, "sin is NULL");
    CHECK_MSG(tp_rope_cos_sin(&cfg, NULL, TP_F32, &co, &si), TP_ERR_INVALID_ARG,
              "position_ids is NULL");
    CHECK_MSG(tp_rope_cos_sin(NULL, pos, TP_F32, &co, &si), TP_ERR_INVALID_ARG, "cfg is NULL");
    CHECK_OK(tp_tensor_to(pos, TP_I32, TP_CPU, &p32));
    CHECK_MSG(tp_rope_cos_sin(&cfg, p32, TP_F32, &co, &si), TP_ERR_INVALID_ARG,
              "position_ids are i32; they must be i64");
    CHECK_OK(tp_tensor_from_data(TP_I64, 1, (int64_t[]){3}, p, &p1));
    CHECK_MSG(tp_rope_cos_sin(&cfg, p1, TP_F32, &co, &si), TP_ERR_INVALID_ARG,
              "position_ids have 1 dims; they must be [batch, seq]");
    CHECK_MSG(tp_rope_cos_sin(&cfg, p1, TP_F64, &co, &si), TP_ERR_INVALID_ARG, "1 dims");
    tp_tensor *good = positions(1, 3, p);
    CHECK_MSG(tp_rope_cos_sin(&cfg, good, TP_F64, &co, &si), TP_ERR_NOT_SUPPORTED,
              "rope_cos_sin: dtype f64 is not one the cpu kernels take");
    tp_rope_config bad = cfg;
    bad.head_dim = 5;
    CHECK_MSG(tp_rope_cos_sin(&bad, good, TP_F32, &co, &si), TP_ERR_INVALID_ARG,
              "rope_cos_sin: head_dim 5 must be positive and even");
    cr_assert(!co && !si);
    tp_tensor *all[] = {pos, p32, p1, good};
    for (size_t i = 0; i < 4; i++)
        tp_tensor_release(all[i]);
}

static tp_tensor *zeros(tp_dtype dt, int nd, const int64_t *shape)
{
    tp_tensor *t = NULL;
    CHECK_OK(tp_tensor_zeros(dt, TP_CPU, nd, shape, &t));
    return t;
}

Test(ops_rope, rotary_embedding_errors, .timeout = 30)
{
    const int64_t xs[4] = {2, 3, 5, 8}, cs[3] = {2, 5, 8};
    tp_tensor *x = zeros(TP_F32, 4, xs), *c = zeros(TP_F32, 3, cs), *s = zeros(TP_F32, 3, cs);
    tp_tensor *y = NULL;
    CHECK_MSG(tp_rotary_embedding(x, c, s, NULL), TP_ERR_INVALID_ARG, "y is NULL");
    CHECK_MSG(tp_rotary_embedding(NULL, c, s, &y), TP_ERR_INVALID_ARG,
              "rotary_embedding: x is NULL");
    CHECK_MSG(tp_rotary_embedding(x, c, NULL, &y), TP_ERR_INVALID_ARG, "sin is NULL");
    tp_tensor *x3 = zeros(TP_F32, 3, cs), *xo = zeros(TP_F32, 4, (int64_t[]){2, 3, 5, 7});
    CHECK_MSG(tp_rotary_embedding(x3, c, s, &y), TP_ERR_INVALID_ARG,
              "x is [2, 5, 8]; it must be 4-D [batch, heads, seq, head_dim]");
    CHECK_MSG(tp_rotary_embedding(xo, c, s, &y), TP_ERR_INVALID_ARG,
              "x is [2, 3, 5, 7]; its head dim must be even");
    tp_tensor *c4 = zeros(TP_F32, 4, xs), *cb3 = zeros(TP_F32, 3, (int64_t[]){3, 5, 8}),
              *cs4 = zeros(TP_F32, 3, (int64_t[]){2, 4, 8}),
              *cd = zeros(TP_F32, 3, (int64_t[]){1, 5, 6}),
              *c1 = zeros(TP_F32, 3, (int64_t[]){1, 5, 8});
    CHECK_MSG(tp_rotary_embedding(x, c4, c4, &y), TP_ERR_INVALID_ARG,
              "cos is [2, 3, 5, 8]; it must be 3-D [batch or 1, seq, head_dim]");
    CHECK_MSG(tp_rotary_embedding(x, c, c1, &y), TP_ERR_INVALID_ARG,
              "cos is [2, 5, 8] but sin is [1, 5, 8]");
    CHECK_MSG(tp_rotary_embedding(x, cb3, cb3, &y), TP_ERR_INVALID_ARG,
              "x is [2, 3, 5, 8] but cos and sin are [3, 5, 8]; they must be [2 or 1, 5, 8]");
    CHECK_MSG(tp_rotary_embedding(x, cs4, cs4, &y), TP_ERR_INVALID_ARG, "are [2, 4, 8]");
    CHECK_MSG(tp_rotary_embedding(x, cd, cd, &y), TP_ERR_INVALID_ARG, "are [1, 5, 6]");
    tp_tensor *cbf = zeros(TP_BF16, 3, cs), *xbf = zeros(TP_BF16, 4, xs);
    CHECK_MSG(tp_rotary_embedding(x, c, cbf, &y), TP_ERR_INVALID_ARG,
              "rotary_embedding: x is f32 but sin is bf16; the dtypes must match");
    CHECK_MSG(tp_rotary_embedding(xbf, c, c, &y), TP_ERR_INVALID_ARG,
              "x is bf16 but cos is f32; the dtypes must match");
    tp_tensor *x64 = zeros(TP_F64, 4, xs), *c64 = zeros(TP_F64, 3, cs);
    CHECK_MSG(tp_rotary_embedding(x64, c64, c64, &y), TP_ERR_NOT_SUPPORTED,
              "rotary_embedding: x is f64, which the cpu kernels do not take");
    /* a non-contiguous cos */
    tp_tensor *wide = zeros(TP_F32, 3, (int64_t[]){2, 5, 16}), *nc = NULL;
    CHECK_OK(tp_tensor_narrow(wide, 2, 0, 8, &nc));
    CHECK_MSG(tp_rotary_embedding(x, nc, nc, &y), TP_ERR_INVALID_ARG,
              "rotary_embedding: cos is not contiguous");
    cr_assert_null(y);
    /* [1, S, D] broadcast is accepted, and so are empty sizes */
    CHECK_OK(tp_rotary_embedding(x, c1, c1, &y));
    tp_tensor_release(y);
    tp_tensor *xe = zeros(TP_F32, 4, (int64_t[]){2, 3, 0, 8}),
              *ce = zeros(TP_F32, 3, (int64_t[]){2, 0, 8});
    CHECK_OK(tp_rotary_embedding(xe, ce, ce, &y));
    cr_assert_eq(tp_tensor_numel(y), 0);
    tp_tensor_release(y);
    tp_tensor *all[] = {x,   c,   s,   x3,  xo,   c4, cb3, cs4, cd,
                        c1, cbf, xbf, x64, c64, wide, nc, xe,  ce};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        tp_tensor_release(all[i]);
}

/* ---- distributed == single rank, no collectives ------------------------------------- */

typedef struct {
    int mesh_ndim;
    int64_t mesh_shape[2];
    tp_test_slot slot[TP_TEST_MAX_RANKS];
} dist_ctx;

enum { DB = 3, DH = 5, DS = 7, DD = 8 }; /* uneven over 2, 3 and 4 ranks */

/* One layout: x's and cos/sin's placements per mesh dim; cb1: cos/sin
 * [1, S, D] (else [B, S, D]). */
typedef struct {
    const char *name;
    bool cb1;
    tp_placement x[2], c[2];
} layout;

static tp_status equal_or_fail(tp_test_slot *s, const char *what, const char *name,
                               tp_tensor *dist, const tp_tensor *plain)
{
    tp_tensor *full = NULL;
    TP_TEST_TRY(tp_dtensor_full_tensor(dist, &full));
    bool eq = false;
    tp_status st = tp_tensor_equal(full, plain, &eq);
    RANK_EXPECT(s, st == TP_OK && eq, "%s: the distributed %s differs from the single-rank one",
                name, what);
    tp_tensor_release(full);
    return st;
}

static tp_status run_layout(tp_test_slot *s, tp_mesh *mesh, const layout *L)
{
    const int m = tp_mesh_ndim(mesh);
    const int64_t xs[4] = {DB, DH, DS, DD}, Bc = L->cb1 ? 1 : DB;
    int64_t p[DB * DS];
    for (int i = 0; i < DB * DS; i++)
        p[i] = (int64_t)(tp_rng_uniform(21, (uint64_t)i) * 100001.0);
    const tp_rope_config cfg = {TP_ROPE_LLAMA3, DD, 500000, 8, 1, 4, 8192, 0};
    tp_tensor *pos = NULL, *co = NULL, *si = NULL, *x = NULL, *g = NULL, *y = NULL;
    tp_tensor *dx = NULL, *dc = NULL, *dsn = NULL, *dg = NULL, *dy = NULL;
    TP_TEST_TRY(tp_tensor_from_data(TP_I64, 2, (int64_t[]){Bc, DS}, p, &pos));
    TP_TEST_TRY(tp_rope_cos_sin(&cfg, pos, TP_F32, &co, &si));
    TP_TEST_TRY(tp_tensor_zeros(TP_F32, TP_CPU, 4, xs, &x));
    TP_TEST_TRY(tp_tensor_fill_random(x, TP_RNG_UNIFORM, -1, 1, 3, NULL, NULL));
    TP_TEST_TRY(tp_tensor_zeros(TP_F32, TP_CPU, 4, xs, &g));
    TP_TEST_TRY(tp_tensor_fill_random(g, TP_RNG_UNIFORM, -1, 1, 4, NULL, NULL));
    /* the single-rank op */
    TP_TEST_TRY(tp_tensor_set_requires_grad(x, true));
    TP_TEST_TRY(tp_rotary_embedding(x, co, si, &y));
    TP_TEST_TRY(tp_backward(y, g));
    /* the same on the mesh */
    TP_TEST_TRY(tp_dtensor_distribute(mesh, x, m, L->x, -1, &dx));
    TP_TEST_TRY(tp_tensor_set_requires_grad(dx, true));
    TP_TEST_TRY(tp_dtensor_distribute(mesh, co, m, L->c, -1, &dc));
    TP_TEST_TRY(tp_dtensor_distribute(mesh, si, m, L->c, -1, &dsn));
    TP_TEST_TRY(tp_dtensor_distribute(mesh, g, m, L->x, -1, &dg));
    tp_comm_debug *dbg = NULL;
    TP_TEST_TRY(tp_comm_debug_create(&dbg));
    TP_TEST_TRY(tp_comm_debug_begin(dbg));
    tp_status st = tp_rotary_embedding(dx, dc, dsn, &dy);
    if (st == TP_OK)
        st = tp_backward(dy, dg);
    tp_comm_debug_end(dbg);
    RANK_EXPECT(s, st == TP_OK, "%s: %s", L->name, tp_last_error());
    RANK_EXPECT(s, tp_comm_debug_total(dbg) == 0, "%s: %lld collectives, expected none", L->name,
                (long long)tp_comm_debug_total(dbg));
    tp_comm_debug_free(dbg);
    if (st == TP_OK) {
        const tp_placement *yp = tp_dtensor_placements(dy);
        for (int d = 0; d < m; d++)
            RANK_EXPECT(s, yp[d].kind == L->x[d].kind && yp[d].dim == L->x[d].dim,
                        "%s: y's placement on mesh dim %d is not x's", L->name, d);
        (void)equal_or_fail(s, "output", L->name, dy, y);
        (void)equal_or_fail(s, "gradient", L->name, tp_tensor_grad(dx), tp_tensor_grad(x));
    }
    tp_tensor *all[] = {pos, co, si, x, g, y, dx, dc, dsn, dg, dy};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        tp_tensor_release(all[i]);
    return st;
}

/* cos/sin from DTensor positions: the positions' placements, each rank's
 * block of the single-rank result, no collective; then the op on them (the
 * sequence-parallel flow: x Shard(2), positions Shard(1)). */
static tp_status run_positions(tp_test_slot *s, tp_mesh *mesh, const tp_placement *pp,
                               const tp_placement *xp, const char *name)
{
    const int m = tp_mesh_ndim(mesh);
    int64_t p[DB * DS];
    for (int i = 0; i < DB * DS; i++)
        p[i] = (int64_t)(tp_rng_uniform(22, (uint64_t)i) * 100001.0);
    const tp_rope_config cfg = {TP_ROPE_DEFAULT, DD, 1e6, 0, 0, 0, 0, 0};
    const int64_t xs[4] = {DB, DH, DS, DD};
    tp_tensor *pos = NULL, *co = NULL, *si = NULL, *dp = NULL, *dc = NULL, *dsn = NULL;
    tp_tensor *x = NULL, *y = NULL, *dx = NULL, *dy = NULL;
    TP_TEST_TRY(tp_tensor_from_data(TP_I64, 2, (int64_t[]){DB, DS}, p, &pos));
    TP_TEST_TRY(tp_rope_cos_sin(&cfg, pos, TP_F32, &co, &si));
    TP_TEST_TRY(tp_dtensor_distribute(mesh, pos, m, pp, -1, &dp));
    TP_TEST_TRY(tp_tensor_zeros(TP_F32, TP_CPU, 4, xs, &x));
    TP_TEST_TRY(tp_tensor_fill_random(x, TP_RNG_UNIFORM, -1, 1, 5, NULL, NULL));
    TP_TEST_TRY(tp_rotary_embedding(x, co, si, &y));
    TP_TEST_TRY(tp_dtensor_distribute(mesh, x, m, xp, -1, &dx));
    tp_comm_debug *dbg = NULL;
    TP_TEST_TRY(tp_comm_debug_create(&dbg));
    TP_TEST_TRY(tp_comm_debug_begin(dbg));
    tp_status st = tp_rope_cos_sin(&cfg, dp, TP_F32, &dc, &dsn);
    if (st == TP_OK)
        st = tp_rotary_embedding(dx, dc, dsn, &dy);
    tp_comm_debug_end(dbg);
    RANK_EXPECT(s, st == TP_OK, "%s: %s", name, tp_last_error());
    RANK_EXPECT(s, tp_comm_debug_total(dbg) == 0, "%s: %lld collectives, expected none", name,
                (long long)tp_comm_debug_total(dbg));
    tp_comm_debug_free(dbg);
    if (st == TP_OK) {
        const tp_placement *cp = tp_dtensor_placements(dc);
        for (int d = 0; d < m; d++)
            RANK_EXPECT(s, cp[d].kind == pp[d].kind && cp[d].dim == pp[d].dim,
                        "%s: cos's placement on mesh dim %d is not the positions'", name, d);
        (void)equal_or_fail(s, "cos", name, dc, co);
        (void)equal_or_fail(s, "sin", name, dsn, si);
        (void)equal_or_fail(s, "output", name, dy, y);
    }
    tp_tensor *all[] = {pos, co, si, dp, dc, dsn, x, y, dx, dy};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        tp_tensor_release(all[i]);
    return st;
}

static tp_status dist_body(tp_comm *w, void *arg)
{
    dist_ctx *c = arg;
    tp_test_slot *s = &c->slot[tp_comm_rank(w)];
    tp_mesh *mesh = NULL;
    RANK_OK(s, tp_mesh_create(w, c->mesh_ndim, c->mesh_shape, NULL, &mesh));
    const tp_placement R = tp_replicate(), S0 = tp_shard(0), S1 = tp_shard(1), S2 = tp_shard(2);
    const layout layouts[] = {
        {"heads (tensor parallel)", true, {S1, S1}, {R, R}},
        {"heads, cos [B, S, D]", false, {S1, R}, {R, R}},
        {"batch, cos [B, S, D]", false, {S0, S0}, {S0, S0}},
        {"batch, cos [1, S, D]", true, {S0, R}, {R, R}},
        {"sequence", false, {S2, S2}, {S1, S1}},
        {"replicate", false, {R, R}, {R, R}},
        {"heads x batch", false, {S1, S0}, {R, S0}},
        {"batch x sequence", false, {S0, S2}, {S0, S1}},
        {"sequence x heads", true, {S2, S1}, {S1, R}},
    };
    for (size_t k = 0; k < sizeof layouts / sizeof layouts[0]; k++)
        (void)run_layout(s, mesh, &layouts[k]);
    const struct {
        const char *name;
        tp_placement p[2], x[2];
    } pl[] = {{"positions Shard(1), x Shard(2)", {S1, S1}, {S2, S2}},
              {"positions Shard(0), x Shard(0)", {S0, R}, {S0, S1}},
              {"positions Replicate, x Shard(1)", {R, R}, {S1, S1}}};
    for (size_t k = 0; k < sizeof pl / sizeof pl[0]; k++)
        (void)run_positions(s, mesh, pl[k].p, pl[k].x, pl[k].name);

    /* refused before any communication */
    const int m = tp_mesh_ndim(mesh);
    const tp_placement sh[2] = {S1, R}, part[2] = {tp_partial(TP_SUM), R};
    tp_tensor *pos = NULL, *dp = NULL, *pp = NULL, *co = NULL, *si = NULL;
    const int64_t p[6] = {0, 1, 2, 3, 4, 5};
    RANK_OK(s, tp_tensor_from_data(TP_I64, 2, (int64_t[]){2, 3}, p, &pos));
    RANK_OK(s, tp_dtensor_distribute(mesh, pos, m, sh, -1, &dp));
    RANK_OK(s, tp_dtensor_from_local(mesh, pos, m, part, NULL, &pp));
    const tp_rope_config dyn = {TP_ROPE_DYNAMIC, DD, 10000, 2, 0, 0, 0, 4};
    tp_status st = tp_rope_cos_sin(&dyn, dp, TP_F32, &co, &si);
    RANK_EXPECT(s, st == TP_ERR_NOT_SUPPORTED && strstr(tp_last_error(), "Shard(1) on mesh dim 0"),
                "dynamic with sharded positions: %s (%s)", tp_status_name(st), tp_last_error());
    st = tp_rope_cos_sin(&dyn, pp, TP_F32, &co, &si);
    RANK_EXPECT(s, st == TP_ERR_NOT_SUPPORTED && strstr(tp_last_error(), "Partial on mesh dim 0"),
                "Partial positions: %s (%s)", tp_status_name(st), tp_last_error());
    RANK_EXPECT(s, !co && !si, "outputs set on error");
    tp_tensor *x = NULL, *c1 = NULL, *y = NULL;
    RANK_OK(s, tp_tensor_zeros(TP_F32, TP_CPU, 4, (int64_t[]){2, 3, 3, DD}, &x));
    RANK_OK(s, tp_tensor_zeros(TP_F32, TP_CPU, 3, (int64_t[]){1, 3, DD}, &c1));
    tp_tensor *dcs = NULL;
    const tp_placement rr[2] = {R, R};
    RANK_OK(s, tp_dtensor_distribute(mesh, c1, m, rr, -1, &dcs));
    st = tp_rotary_embedding(x, dcs, dcs, &y);
    RANK_EXPECT(s,
                st == TP_ERR_INVALID_ARG &&
                    strstr(tp_last_error(), "x is a plain tensor but cos is a DTensor"),
                "mixed: %s (%s)", tp_status_name(st), tp_last_error());
    tp_tensor *all[] = {pos, dp, pp, x, c1, dcs};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        tp_tensor_release(all[i]);
    tp_mesh_free(mesh);
    return TP_OK;
}

typedef struct {
    int ndim;
    int64_t shape[2];
} rope_mesh;

ParameterizedTestParameters(ops_rope, distributed_equals_single_rank)
{
    static rope_mesh meshes[] = {{1, {1}}, {1, {2}}, {1, {3}}, {1, {4}}, {2, {2, 2}}};
    return cr_make_param_array(rope_mesh, meshes, sizeof meshes / sizeof meshes[0]);
}

ParameterizedTest(rope_mesh *rm, ops_rope, distributed_equals_single_rank, .timeout = 60)
{
    static dist_ctx c;
    memset(&c, 0, sizeof c);
    c.mesh_ndim = rm->ndim;
    c.mesh_shape[0] = rm->shape[0];
    c.mesh_shape[1] = rm->shape[1];
    tp_test_run((int)(rm->shape[0] * (rm->ndim > 1 ? rm->shape[1] : 1)), dist_body, &c, c.slot);
}

/* x sharded on the head dim (no strategy) is redistributed, counted, and
 * the result is still the single-rank one. */
static tp_status redist_body(tp_comm *w, void *arg)
{
    dist_ctx *c = arg;
    tp_test_slot *s = &c->slot[tp_comm_rank(w)];
    tp_mesh *mesh = NULL;
    int64_t n = tp_comm_size(w);
    RANK_OK(s, tp_mesh_create(w, 1, &n, NULL, &mesh));
    const int64_t xs[4] = {2, 3, 4, 8}, cs[3] = {1, 4, 8}, p[4] = {0, 7, 700, 70000};
    const tp_rope_config cfg = {TP_ROPE_DEFAULT, 8, 0, 0, 0, 0, 0, 0};
    tp_tensor *pos = NULL, *co = NULL, *si = NULL, *x = NULL, *y = NULL, *dx = NULL, *dc = NULL,
              *dsn = NULL, *dy = NULL;
    RANK_OK(s, tp_tensor_from_data(TP_I64, 2, (int64_t[]){1, 4}, p, &pos));
    RANK_OK(s, tp_rope_cos_sin(&cfg, pos, TP_F32, &co, &si));
    (void)cs;
    RANK_OK(s, tp_tensor_zeros(TP_F32, TP_CPU, 4, xs, &x));
    RANK_OK(s, tp_tensor_fill_random(x, TP_RNG_UNIFORM, -1, 1, 6, NULL, NULL));
    RANK_OK(s, tp_rotary_embedding(x, co, si, &y));
    const tp_placement s3 = tp_shard(3), r = tp_replicate();
    RANK_OK(s, tp_dtensor_distribute(mesh, x, 1, &s3, -1, &dx));
    RANK_OK(s, tp_dtensor_distribute(mesh, co, 1, &r, -1, &dc));
    RANK_OK(s, tp_dtensor_distribute(mesh, si, 1, &r, -1, &dsn));
    tp_comm_debug *dbg = NULL;
    RANK_OK(s, tp_comm_debug_create(&dbg));
    RANK_OK(s, tp_comm_debug_begin(dbg));
    tp_status st = tp_rotary_embedding(dx, dc, dsn, &dy);
    tp_comm_debug_end(dbg);
    RANK_EXPECT(s, st == TP_OK, "%s", tp_last_error());
    RANK_EXPECT(s, tp_comm_debug_total(dbg) == (n > 1 ? 1 : 0),
                "x Shard(3): %lld collectives, expected one on more than one rank",
                (long long)tp_comm_debug_total(dbg));
    tp_comm_debug_free(dbg);
    if (st == TP_OK)
        (void)equal_or_fail(s, "output", "x Shard(3)", dy, y);
    tp_tensor *all[] = {pos, co, si, x, y, dx, dc, dsn, dy};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        tp_tensor_release(all[i]);
    tp_mesh_free(mesh);
    return TP_OK;
}

Test(ops_rope, head_dim_shard_is_redistributed, .timeout = 60)
{
    for (int n = 1; n <= 4; n++) {
        static dist_ctx c;
        memset(&c, 0, sizeof c);
        tp_test_run(n, redist_body, &c, c.slot);
    }
}
