/* The CUDA engine's kernel table (src/kernels/cuda.cu) entry by entry: every
 * entry in f32, bf16 and f16 against the CPU engine's f32 entry on the same
 * inputs (values already representable in the dtype, converted to f32 for
 * the CPU), within the dtype contract's bounds (docs/API.md "Precision"):
 *   |y - r| <= (eps_d + 2^-18) |r| + atol,
 * eps_d = 2^-8 (bf16), 2^-11 (f16), 2^-24 (f32) for the one rounding of the
 * output; 2^-18 covers the CPU's f32 math (its exp and erf agree with the
 * f64 formulas to 1e-6); atol is each case's K 2^-23 sum|terms| allowance for
 * f32 accumulation in a different order. Outputs that stay f32 whatever the
 * dtype (statistics, Adam moments) get eps_d = 2^-24; masks must match.
 *
 * Also: supports() true for exactly f32/bf16/f16, and the refusal of other
 * dtypes (runs without a device in a CUDA build).
 *
 * Like test_kernel_table.c this reaches internals (the tables, the CUDA
 * memory table), so it links libtp's objects rather than the library. Tests
 * that need a GPU skip visibly ("no CUDA device: ...") without one. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tp_test.h"

#include "core/base.h"
#include "core/device.h"
#include "kernels/kernels.h"

static const tp_device CPU = {TP_DEVICE_CPU, 0};
static const tp_device GPU = {TP_DEVICE_CUDA, 0};

static void need_cuda(void)
{
    if (tp_cuda_device_count() > 0)
        return;
    cr_skip_test("no CUDA device: %s", TP_HAVE_CUDA
                                           ? "libtp has CUDA but the machine shows no device"
                                           : "libtp was built without CUDA");
}

/* ---- buffers ---------------------------------------------------------------------
 *
 * A case's buffers, each one of: 'T' in the op's dtype, 'F' always f32, 'I'
 * int64, 'U' one byte (masks); 0: a NULL argument. Host values are kept as
 * double-free f32 (T values already rounded to the dtype), or int64/uint8. */

#define MAXB 12

typedef struct bspec {
    char kind;
    bool out;      /* compared after the run (an input too when `in`) */
    bool in;       /* for outputs: initialized (accumulated into / read) */
    int64_t n;     /* elements */
    double lo, hi; /* random values in [lo, hi) (I: integers, U: 0 or 1) */
} bspec;

typedef tp_status (*kfn)(const tp__kernels *K, tp_device dev, tp_dtype dt, void **p,
                         const double *a);

typedef struct kcase {
    const char *name;
    kfn run;
    double a[12]; /* sizes and scalars, as run() reads them */
    double atol;
    double mag; /* extra eps_d * mag: entries that round more than once (atomics) */
    bspec b[MAXB];
} kcase;

typedef struct hbuf {
    float *f;   /* T and F */
    int64_t *i; /* I */
    uint8_t *u; /* U */
} hbuf;

static double eps_of(tp_dtype dt)
{
    return dt == TP_BF16 ? 0x1p-8 : dt == TP_F16 ? 0x1p-11 : 0x1p-24;
}

static float round_to(tp_dtype dt, float v)
{
    if (dt == TP_BF16)
        return tp__bf16_to_f32(tp__f32_to_bf16(v));
    if (dt == TP_F16)
        return tp__f16_to_f32(tp__f32_to_f16(v));
    return v;
}

static size_t elem_size(char kind, tp_dtype dt)
{
    return kind == 'T' ? tp_dtype_size(dt) : kind == 'F' ? 4 : kind == 'I' ? 8 : 1;
}

static void fill_host(const bspec *s, tp_dtype dt, uint64_t seed, hbuf *h)
{
    int64_t n = s->n;
    memset(h, 0, sizeof *h);
    if (s->kind == 'I') {
        h->i = calloc((size_t)n, sizeof *h->i);
        for (int64_t k = 0; k < n; k++)
            h->i[k] = (int64_t)floor(s->lo + (s->hi - s->lo) * tp_rng_uniform(seed, (uint64_t)k));
    } else if (s->kind == 'U') {
        h->u = calloc((size_t)n, 1);
        for (int64_t k = 0; k < n; k++)
            h->u[k] = s->out && !s->in ? 0 : (uint8_t)(tp_rng_uniform(seed, (uint64_t)k) < 0.6);
    } else {
        h->f = calloc((size_t)n, sizeof *h->f);
        for (int64_t k = 0; k < n; k++) {
            float v = s->out && !s->in
                          ? 0.0f
                          : (float)(s->lo + (s->hi - s->lo) * tp_rng_uniform(seed, (uint64_t)k));
            h->f[k] = s->kind == 'T' ? round_to(dt, v) : v;
        }
    }
}

static void *host_ptr(const hbuf *h)
{
    return h->f ? (void *)h->f : h->i ? (void *)h->i : h->u;
}

static void free_host(hbuf *h)
{
    free(h->f);
    free(h->i);
    free(h->u);
}

/* The device copy of h in the op's dtype. */
static void *upload(const bspec *s, tp_dtype dt, const hbuf *h)
{
    size_t es = elem_size(s->kind, dt), nb = (size_t)s->n * es;
    void *src = host_ptr(h), *tmp = NULL, *d = NULL;
    if (s->kind == 'T' && dt != TP_F32) {
        uint16_t *t = malloc(nb ? nb : 1);
        for (int64_t k = 0; k < s->n; k++)
            t[k] = dt == TP_BF16 ? tp__f32_to_bf16(h->f[k]) : tp__f32_to_f16(h->f[k]);
        src = tmp = t;
    }
    CHECK_OK(tp__cuda_mem.alloc("upload", 0, nb, false, &d));
    if (nb)
        CHECK_OK(tp__cuda_mem.copy("upload", d, GPU, src, CPU, nb));
    free(tmp);
    return d;
}

/* The device buffer's values as f32 (T, F) or bytes (U) into h. */
static void download(const bspec *s, tp_dtype dt, void *d, hbuf *h)
{
    size_t es = elem_size(s->kind, dt), nb = (size_t)s->n * es;
    if (s->kind == 'T' && dt != TP_F32) {
        uint16_t *t = malloc(nb ? nb : 1);
        CHECK_OK(tp__cuda_mem.copy("download", t, CPU, d, GPU, nb));
        for (int64_t k = 0; k < s->n; k++)
            h->f[k] = dt == TP_BF16 ? tp__bf16_to_f32(t[k]) : tp__f16_to_f32(t[k]);
        free(t);
    } else if (nb) {
        CHECK_OK(tp__cuda_mem.copy("download", host_ptr(h), CPU, d, GPU, nb));
    }
}

static void compare(const kcase *c, int bi, tp_dtype dt, const hbuf *got, const hbuf *want)
{
    const bspec *s = &c->b[bi];
    if (s->kind == 'U') {
        for (int64_t k = 0; k < s->n; k++)
            cr_assert_eq(got->u[k], want->u[k], "%s %s: mask %d[%lld] %d, CPU %d", c->name,
                         tp_dtype_name(dt), bi, (long long)k, got->u[k], want->u[k]);
        return;
    }
    double eps = s->kind == 'T' ? eps_of(dt) : 0x1p-24;
    double atol = c->atol + (s->kind == 'T' ? eps_of(dt) * c->mag : 0.0);
    for (int64_t k = 0; k < s->n; k++) {
        double y = got->f[k], r = want->f[k];
        if (isinf(r) && y == r)
            continue;
        cr_assert(fabs(y - r) <= (eps + 0x1p-18) * fabs(r) + atol,
                  "%s %s: buffer %d[%lld] = %.9g, CPU f32 %.9g (|diff| %.3g > %.3g)", c->name,
                  tp_dtype_name(dt), bi, (long long)k, y, r, fabs(y - r),
                  (eps + 0x1p-18) * fabs(r) + atol);
    }
}

/* Runs case c in dtype dt on the GPU and in f32 on the CPU, same inputs. */
static void check_case(const kcase *c, tp_dtype dt)
{
    hbuf cpu[MAXB], gpu[MAXB];
    void *cp[MAXB] = {0}, *gp[MAXB] = {0};
    for (int i = 0; i < MAXB; i++) {
        memset(&cpu[i], 0, sizeof cpu[i]);
        memset(&gpu[i], 0, sizeof gpu[i]);
        if (!c->b[i].kind)
            continue;
        fill_host(&c->b[i], dt, 1000u + (uint64_t)i, &cpu[i]);
        fill_host(&c->b[i], dt, 1000u + (uint64_t)i, &gpu[i]);
        cp[i] = host_ptr(&cpu[i]);
        gp[i] = upload(&c->b[i], dt, &gpu[i]);
    }
    CHECK_OK(c->run(&tp__kernels_cpu, CPU, TP_F32, cp, c->a));
    CHECK_OK(c->run(tp__kernels_cuda, GPU, dt, gp, c->a));
    CHECK_OK(tp__cuda_mem.sync("check_case", 0));
    for (int i = 0; i < MAXB; i++) {
        if (!c->b[i].kind)
            continue;
        if (c->b[i].out) {
            download(&c->b[i], dt, gp[i], &gpu[i]);
            compare(c, i, dt, &gpu[i], &cpu[i]);
        }
        tp__cuda_mem.free(0, gp[i]);
        free_host(&cpu[i]);
        free_host(&gpu[i]);
    }
}

/* ---- the entries' calls (a: the case's numbers) ---------------------------------- */

#define I(k) ((int64_t)a[k])

static tp_status r_gemm(const tp__kernels *K, tp_device d, tp_dtype t, void **p, const double *a)
{
    return K->gemm(d, t, a[0] != 0, a[1] != 0, I(2), I(3), I(4), (float)a[5], p[0], I(6), p[1],
                   I(7), 0.25f, p[2], I(3));
}
static tp_status r_linear_fwd(const tp__kernels *K, tp_device d, tp_dtype t, void **p,
                              const double *a)
{
    return K->linear_fwd(d, t, p[0], p[1], p[2], p[3], I(0), I(1), I(2));
}
static tp_status r_linear_bwd(const tp__kernels *K, tp_device d, tp_dtype t, void **p,
                              const double *a)
{
    return K->linear_bwd(d, t, p[0], p[1], p[2], p[3], p[4], p[5], I(0), I(1), I(2), a[3] != 0);
}
/* a: rows, in, out, tanh_approx */
static tp_status r_linear_gelu_fwd(const tp__kernels *K, tp_device d, tp_dtype t, void **p,
                                   const double *a)
{
    return K->linear_gelu_fwd(d, t, p[0], p[1], p[2], p[3], p[4], I(0), I(1), I(2), a[3] != 0);
}
static tp_status r_linear_gelu_bwd(const tp__kernels *K, tp_device d, tp_dtype t, void **p,
                                   const double *a)
{
    return K->linear_gelu_bwd(d, t, p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7], I(0), I(1),
                              I(2), a[3] != 0);
}
static tp_status r_linear_bwd_dgelu(const tp__kernels *K, tp_device d, tp_dtype t, void **p,
                                    const double *a)
{
    return K->linear_bwd_dgelu(d, t, p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7], I(0), I(1),
                               I(2), a[3] != 0);
}
static tp_status r_copy(const tp__kernels *K, tp_device d, tp_dtype t, void **p, const double *a)
{
    return K->copy(d, t, p[1], p[0], I(0));
}
static tp_status r_fill(const tp__kernels *K, tp_device d, tp_dtype t, void **p, const double *a)
{
    return K->fill(d, t, p[0], (float)a[1], I(0));
}
static tp_status r_add(const tp__kernels *K, tp_device d, tp_dtype t, void **p, const double *a)
{
    return K->add(d, t, p[0], p[1], p[2], I(0));
}
static tp_status r_mul(const tp__kernels *K, tp_device d, tp_dtype t, void **p, const double *a)
{
    return K->mul(d, t, p[0], p[1], p[2], I(0));
}
static tp_status r_scale(const tp__kernels *K, tp_device d, tp_dtype t, void **p, const double *a)
{
    return K->scale(d, t, p[0], (float)a[1], p[1], I(0));
}
static tp_status r_accumulate(const tp__kernels *K, tp_device d, tp_dtype t, void **p,
                              const double *a)
{
    return K->accumulate(d, t, p[1], p[0], I(0));
}

/* the broadcast geometries: a[0] picks one */
static const int64_t bc_shape[3][3] = {{60}, {4, 6}, {3, 4, 5}};
static const int64_t bc_as[3][3] = {{1}, {6, 1}, {20, 5, 1}};
static const int64_t bc_bs[3][3] = {{1}, {0, 1}, {5, 0, 1}};
static const int bc_ndim[3] = {1, 2, 3};

static tp_status r_add_bcast(const tp__kernels *K, tp_device d, tp_dtype t, void **p,
                             const double *a)
{
    int g = (int)a[0];
    return K->add_bcast(d, t, p[0], p[1], p[2], bc_ndim[g], bc_shape[g], bc_as[g], bc_bs[g]);
}
static tp_status r_mul_bcast(const tp__kernels *K, tp_device d, tp_dtype t, void **p,
                             const double *a)
{
    int g = (int)a[0];
    return K->mul_bcast(d, t, p[0], p[1], p[2], bc_ndim[g], bc_shape[g], bc_as[g], bc_bs[g]);
}
static tp_status r_sum_bcast(const tp__kernels *K, tp_device d, tp_dtype t, void **p,
                             const double *a)
{
    static const int64_t shape[3] = {3, 4, 5}, ys[2][3] = {{1, 4, 1}, {3, 1, 5}};
    return K->sum_bcast(d, t, p[0], p[1], 3, shape, ys[I(0)]);
}
static tp_status r_gather(const tp__kernels *K, tp_device d, tp_dtype t, void **p, const double *a)
{
    static const int64_t shape[2] = {4, 3}, stride[2] = {1, 4};
    return K->gather(d, t, p[1], p[0], 2, shape, stride);
}
static tp_status r_relu_fwd(const tp__kernels *K, tp_device d, tp_dtype t, void **p,
                            const double *a)
{
    return K->relu_fwd(d, t, p[0], p[1], I(0));
}
static tp_status r_relu_bwd(const tp__kernels *K, tp_device d, tp_dtype t, void **p,
                            const double *a)
{
    return K->relu_bwd(d, t, p[0], p[1], p[2], I(0));
}
static tp_status r_gelu_fwd(const tp__kernels *K, tp_device d, tp_dtype t, void **p,
                            const double *a)
{
    return K->gelu_fwd(d, t, p[0], p[1], I(0), a[1] != 0);
}
static tp_status r_gelu_bwd(const tp__kernels *K, tp_device d, tp_dtype t, void **p,
                            const double *a)
{
    return K->gelu_bwd(d, t, p[0], p[1], p[2], I(0), a[1] != 0);
}
static tp_status r_silu_fwd(const tp__kernels *K, tp_device d, tp_dtype t, void **p,
                            const double *a)
{
    return K->silu_fwd(d, t, p[0], p[1], I(0));
}
static tp_status r_silu_bwd(const tp__kernels *K, tp_device d, tp_dtype t, void **p,
                            const double *a)
{
    return K->silu_bwd(d, t, p[0], p[1], p[2], I(0));
}
static tp_status r_swiglu_fwd(const tp__kernels *K, tp_device d, tp_dtype t, void **p,
                              const double *a)
{
    return K->swiglu_fwd(d, t, p[0], p[1], p[2], I(0));
}
static tp_status r_swiglu_bwd(const tp__kernels *K, tp_device d, tp_dtype t, void **p,
                              const double *a)
{
    return K->swiglu_bwd(d, t, p[0], p[1], p[2], p[3], p[4], I(0));
}
static tp_status r_sum_dim(const tp__kernels *K, tp_device d, tp_dtype t, void **p, const double *a)
{
    return K->sum_dim(d, t, p[0], p[1], I(0), I(1), I(2), a[3]);
}
static tp_status r_sum_dim_bwd(const tp__kernels *K, tp_device d, tp_dtype t, void **p,
                               const double *a)
{
    return K->sum_dim_bwd(d, t, p[0], p[1], I(0), I(1), I(2), (float)a[3]);
}
static tp_status r_sum_all(const tp__kernels *K, tp_device d, tp_dtype t, void **p, const double *a)
{
    return K->sum_all(d, t, p[0], I(0), p[1], a[1]);
}
static tp_status r_softmax_fwd(const tp__kernels *K, tp_device d, tp_dtype t, void **p,
                               const double *a)
{
    return K->softmax_fwd(d, t, p[0], p[1], I(0), I(1));
}
static tp_status r_softmax_bwd(const tp__kernels *K, tp_device d, tp_dtype t, void **p,
                               const double *a)
{
    return K->softmax_bwd(d, t, p[0], p[1], p[2], I(0), I(1));
}
static tp_status r_causal_mask(const tp__kernels *K, tp_device d, tp_dtype t, void **p,
                               const double *a)
{
    return K->causal_mask(d, t, p[0], I(0), I(1));
}
static tp_status r_transpose(const tp__kernels *K, tp_device d, tp_dtype t, void **p,
                             const double *a)
{
    return K->transpose_last2(d, t, p[0], p[1], I(0), I(1), I(2));
}
static tp_status r_embedding_fwd(const tp__kernels *K, tp_device d, tp_dtype t, void **p,
                                 const double *a)
{
    return K->embedding_fwd(d, t, p[0], I(0), p[1], I(1), I(2), I(3), p[2]);
}
static tp_status r_embedding_bwd(const tp__kernels *K, tp_device d, tp_dtype t, void **p,
                                 const double *a)
{
    return K->embedding_bwd(d, t, p[0], I(0), p[1], I(1), I(2), I(3), p[2]);
}
static tp_status r_layer_norm_fwd(const tp__kernels *K, tp_device d, tp_dtype t, void **p,
                                  const double *a)
{
    return K->layer_norm_fwd(d, t, p[0], p[1], p[2], p[3], p[4], p[5], I(0), I(1), 1e-5f);
}
static tp_status r_layer_norm_bwd(const tp__kernels *K, tp_device d, tp_dtype t, void **p,
                                  const double *a)
{
    return K->layer_norm_bwd(d, t, p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7], I(0), I(1));
}
static tp_status r_rms_norm_fwd(const tp__kernels *K, tp_device d, tp_dtype t, void **p,
                                const double *a)
{
    return K->rms_norm_fwd(d, t, p[0], p[1], p[2], p[3], I(0), I(1), 1e-5f);
}
static tp_status r_rms_norm_bwd(const tp__kernels *K, tp_device d, tp_dtype t, void **p,
                                const double *a)
{
    return K->rms_norm_bwd(d, t, p[0], p[1], p[2], p[3], p[4], p[5], I(0), I(1));
}
static tp_status r_dropout_fwd(const tp__kernels *K, tp_device d, tp_dtype t, void **p,
                               const double *a)
{
    static const int64_t shape[2] = {4, 50}, gshape[2] = {8, 50}, off[2] = {4, 0};
    return K->dropout_fwd(d, t, p[0], p[1], p[2], 2, shape, gshape, off, (float)a[0], 42);
}
static tp_status r_dropout_bwd(const tp__kernels *K, tp_device d, tp_dtype t, void **p,
                               const double *a)
{
    return K->dropout_bwd(d, t, p[0], p[1], p[2], I(1), (float)a[0]);
}
static tp_status r_ce_fwd(const tp__kernels *K, tp_device d, tp_dtype t, void **p, const double *a)
{
    return K->cross_entropy_fwd(d, t, p[0], p[1], p[2], p[3], I(0), I(1), I(2), -1);
}
static tp_status r_ce_bwd(const tp__kernels *K, tp_device d, tp_dtype t, void **p, const double *a)
{
    return K->cross_entropy_bwd(d, t, p[0], p[1], p[2], p[3], p[4], I(0), I(1), I(2), -1);
}
static tp_status r_ce_gloss(const tp__kernels *K, tp_device d, tp_dtype t, void **p,
                            const double *a)
{
    return K->ce_gloss(d, t, p[0], p[1], I(0), a[1] != 0, a[2]);
}
static tp_status r_row_max(const tp__kernels *K, tp_device d, tp_dtype t, void **p, const double *a)
{
    return K->row_max(d, t, p[0], p[1], I(0), I(1), I(2));
}
static tp_status r_row_sumexp(const tp__kernels *K, tp_device d, tp_dtype t, void **p,
                              const double *a)
{
    return K->row_sumexp(d, t, p[0], p[1], p[2], I(0), I(1), I(2));
}
static tp_status r_pick_target(const tp__kernels *K, tp_device d, tp_dtype t, void **p,
                               const double *a)
{
    return K->pick_target(d, t, p[0], p[1], p[2], I(0), I(1), I(2), I(3), -1);
}
static tp_status r_vocab_ce_loss(const tp__kernels *K, tp_device d, tp_dtype t, void **p,
                                 const double *a)
{
    return K->vocab_ce_loss(d, t, p[0], p[1], p[2], p[3], p[4], p[5], I(0), -1);
}
static tp_status r_vocab_ce_bwd(const tp__kernels *K, tp_device d, tp_dtype t, void **p,
                                const double *a)
{
    return K->vocab_ce_bwd(d, t, p[0], p[1], p[2], p[3], p[4], p[5], p[6], I(0), I(1), I(2), I(3),
                           -1);
}
static tp_status r_sgd(const tp__kernels *K, tp_device d, tp_dtype t, void **p, const double *a)
{
    return K->sgd_step(d, t, p[0], p[1], I(0), a[1]);
}
static tp_status r_adam(const tp__kernels *K, tp_device d, tp_dtype t, void **p, const double *a)
{
    return K->adam_step(d, t, p[0], p[1], p[2], p[3], I(0), 0.9, 0.999, 0.01, 0.5, 1e-8);
}
/* a: B, H, S, D, cos_batch_stride */
static tp_status r_rope_fwd(const tp__kernels *K, tp_device d, tp_dtype t, void **p,
                            const double *a)
{
    return K->rope_fwd(d, t, p[0], p[1], p[2], p[3], I(0), I(1), I(2), I(3), I(4));
}
static tp_status r_rope_bwd(const tp__kernels *K, tp_device d, tp_dtype t, void **p,
                            const double *a)
{
    return K->rope_bwd(d, t, p[0], p[1], p[2], p[3], I(0), I(1), I(2), I(3), I(4));
}
/* a: n, D, scaling */
static tp_status r_rope_cos_sin(const tp__kernels *K, tp_device d, tp_dtype t, void **p,
                                const double *a)
{
    return K->rope_cos_sin(d, t, p[0], p[1], p[2], p[3], I(0), I(1), (float)a[2]);
}

static tp_status r_attn_softmax(const tp__kernels *K, tp_device d, tp_dtype t, void **p,
                                const double *a)
{
    return K->attn_softmax(d, t, p[0], I(0), I(1), I(2), I(3), I(4), a[5] != 0, p[1], TP_I64,
                           I(6));
}

/* fused attention {G, M, Sq, Sk, D, Dv, key_offset, causal, cap, pad_div}:
 * group b's keys at b * cap rows of k and v (cap > Sk: a cache's prefix),
 * the padding [G / pad_div, Sk] */
static tp__attn_geom flash_geom(const double *a, const void *pad)
{
    const int64_t D = I(4), Dv = I(5), cap = I(8);
    return (tp__attn_geom){.G = I(0),
                           .M = I(1),
                           .Sq = I(2),
                           .Sk = I(3),
                           .D = D,
                           .Dv = Dv,
                           .k_gs = cap * D,
                           .k_ld = D,
                           .v_gs = cap * Dv,
                           .v_ld = Dv,
                           .key_offset = I(6),
                           .pad = pad,
                           .pad_dtype = TP_I64,
                           .pad_div = I(9),
                           .pad_ld = I(3),
                           .scale = (float)(1.0 / sqrt((double)D)),
                           .causal = a[7] != 0};
}

static tp_status r_flash_attn_fwd(const tp__kernels *K, tp_device d, tp_dtype t, void **p,
                                  const double *a)
{
    const tp__attn_geom g = flash_geom(a, p[5]);
    return K->flash_attn_fwd(d, t, &g, p[0], p[1], p[2], p[3], p[4]);
}

static tp_status r_flash_attn_bwd(const tp__kernels *K, tp_device d, tp_dtype t, void **p,
                                  const double *a)
{
    const tp__attn_geom g = flash_geom(a, p[10]);
    return K->flash_attn_bwd(d, t, &g, p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7], p[8],
                             p[9]);
}

/* ---- the cases -------------------------------------------------------------------- */

#define T_IN(n)                       \
    {                                 \
        'T', false, false, (n), -1, 1 \
    }
#define T_POS(n)                         \
    {                                    \
        'T', false, false, (n), 0.5, 1.5 \
    }
#define T_OUT(n)                    \
    {                               \
        'T', true, false, (n), 0, 0 \
    }
#define T_ACC(n)                    \
    {                               \
        'T', true, true, (n), -1, 1 \
    }
#define F_IN(n, lo, hi)                    \
    {                                      \
        'F', false, false, (n), (lo), (hi) \
    }
#define F_OUT(n)                    \
    {                               \
        'F', true, false, (n), 0, 0 \
    }
#define F_ACC(n, lo, hi)                 \
    {                                    \
        'F', true, true, (n), (lo), (hi) \
    }
#define I_IN(n, lo, hi)                    \
    {                                      \
        'I', false, false, (n), (lo), (hi) \
    }
#define U_IN(n)                      \
    {                                \
        'U', false, false, (n), 0, 1 \
    }
#define U_OUT(n)                    \
    {                               \
        'U', true, false, (n), 0, 0 \
    }
#define T_WIDE(n)                      \
    {                                  \
        'T', false, false, (n), -12, 12 \
    }
/* weights of a long product (pre-activations of order 1) */
#define T_SMALL(n)                            \
    {                                         \
        'T', false, false, (n), -0.125, 0.125 \
    }
/* pre-activations: GELU's bend and both tails */
#define T_PRE(n)                      \
    {                                 \
        'T', false, false, (n), -4, 4 \
    }
/* scratch the entry overwrites, not compared */
#define T_TMP(n)                     \
    {                                \
        'T', false, false, (n), 0, 0 \
    }
#define NONE                     \
    {                            \
        0, false, false, 0, 0, 0 \
    }

/* CE geometry: [outer 2, classes 9, inner 3] = 6 rows; vocab: 20 global
 * classes, this block owning [5, 14) */
static const kcase cases[] = {
    {"gemm A B^T", r_gemm, {0, 1, 5, 7, 9, 0.5, 9, 9}, 1e-5, 0, {T_IN(45), T_IN(63), T_ACC(35)}},
    {"gemm A^T B", r_gemm, {1, 0, 5, 7, 9, 1.0, 5, 7}, 1e-5, 0, {T_IN(45), T_IN(63), T_ACC(35)}},
    {"gemm k=0", r_gemm, {0, 0, 5, 7, 0, 1.0, 1, 7}, 0, 0, {T_IN(1), T_IN(1), T_ACC(35)}},
    {"linear_fwd", r_linear_fwd, {6, 8, 5}, 1e-5, 0, {T_IN(48), T_IN(40), T_IN(5), T_OUT(30)}},
    {"linear_bwd",
     r_linear_bwd,
     {6, 8, 5, 0},
     1e-5,
     0,
     {T_IN(48), T_IN(40), T_IN(30), T_OUT(48), T_OUT(40), T_OUT(5)}},
    {"linear_bwd accumulate",
     r_linear_bwd,
     {6, 8, 5, 1},
     1e-5,
     0,
     {T_IN(48), T_IN(40), T_IN(30), T_ACC(48), T_ACC(40), T_ACC(5)}},
    /* more rows than the bias broadcast's grid: each thread walks rows */
    {"linear_fwd tall",
     r_linear_fwd,
     {5000, 8, 5},
     1e-5,
     0,
     {T_IN(40000), T_IN(40), T_IN(5), T_OUT(25000)}},
    /* rows enough for the bias gradient's chunked column sums */
    {"linear_bwd tall",
     r_linear_bwd,
     {2048, 8, 40, 0},
     1e-5,
     0,
     {T_IN(16384), T_IN(320), T_IN(81920), T_OUT(16384), T_OUT(320), T_OUT(40)}},
    /* cuBLAS may round the product to bf16/f16 before it adds C (gx here,
     * seen on the H200): a second rounding, of products up to about 64
     * (gw sums 2048 rows); the case is here for the bias gradient's
     * chunked accumulation, which rounds once */
    {"linear_bwd tall accumulate",
     r_linear_bwd,
     {2048, 8, 40, 1},
     1e-5,
     64,
     {T_IN(16384), T_IN(320), T_IN(81920), T_ACC(16384), T_ACC(320), T_ACC(40)}},
    /* an output large enough for cuBLASLt's bias epilogue (kernels/cuda.cu) */
    {"linear_fwd epilogue",
     r_linear_fwd,
     {2048, 64, 128},
     1e-5,
     0,
     {T_IN(131072), T_IN(8192), T_IN(128), T_OUT(262144)}},
    /* linear + GELU {rows, in, out, tanh}, forward {x, w, bias, y, aux}: tanh
     * at an output of 2^18 elements (out a multiple of 8) takes cuBLASLt's
     * GELU epilogue in bf16/f16 (f32 composes) in each of its four forms (y the GELU of the f32
     * accumulator, one rounding); erf and small shapes the linear forward
     * and the GELU kernel (in place in y without aux), whose y is the GELU
     * of the rounded aux: u |gelu'(a) a| <= 1.13 u |a| more, mag 1.13
     * max|aux| (max|aux| 3.70 and 5.29 here; the epilogue cases too, for
     * a product that falls back or TP_CUDA_EPILOGUE=0) */
    {"linear_gelu_fwd tanh epilogue",
     r_linear_gelu_fwd,
     {512, 256, 512, 1},
     1e-5,
     4.5,
     {T_IN(131072), T_SMALL(131072), T_IN(512), T_OUT(262144), T_OUT(262144)}},
    {"linear_gelu_fwd tanh epilogue no bias",
     r_linear_gelu_fwd,
     {512, 256, 512, 1},
     1e-5,
     4.5,
     {T_IN(131072), T_SMALL(131072), NONE, T_OUT(262144), T_OUT(262144)}},
    {"linear_gelu_fwd tanh epilogue no aux",
     r_linear_gelu_fwd,
     {512, 256, 512, 1},
     1e-5,
     4.5,
     {T_IN(131072), T_SMALL(131072), T_IN(512), T_OUT(262144), NONE}},
    {"linear_gelu_fwd tanh epilogue no bias no aux",
     r_linear_gelu_fwd,
     {512, 256, 512, 1},
     1e-5,
     4.5,
     {T_IN(131072), T_SMALL(131072), NONE, T_OUT(262144), NONE}},
    {"linear_gelu_fwd erf",
     r_linear_gelu_fwd,
     {37, 19, 45, 0},
     1e-5,
     6,
     {T_IN(703), T_IN(855), T_IN(45), T_OUT(1665), T_OUT(1665)}},
    {"linear_gelu_fwd erf in place",
     r_linear_gelu_fwd,
     {37, 19, 45, 0},
     1e-5,
     6,
     {T_IN(703), T_IN(855), T_IN(45), T_OUT(1665), NONE}},
    /* backward {x, w, aux, gy, gz, gx, gw, gb}: gz (one rounding; with gb,
     * from the CUDA column pass that also sums it) checked alone, mag 0;
     * the products and gb read the rounded gz where the CPU's f32 reads
     * its f32 gz: u sum|terms| more, mag the largest sum|terms| of gz W
     * (out terms), gz^T x and the column sums of gz (rows terms): 88, 95,
     * 166 at 512 x 256 x 512 (atol for f32 sums of 512 terms: the CPU's
     * alone is 7e-6 past the relative bound), 11, 9, 15 at 37 x 19 x 45 */
    {"linear_gelu_bwd tanh gz",
     r_linear_gelu_bwd,
     {512, 256, 512, 1},
     2e-6,
     0,
     {T_IN(131072), T_IN(131072), T_PRE(262144), T_IN(262144), T_OUT(262144), NONE, NONE,
      T_TMP(512)}},
    {"linear_gelu_bwd tanh",
     r_linear_gelu_bwd,
     {512, 256, 512, 1},
     1e-4,
     170,
     {T_IN(131072), T_IN(131072), T_PRE(262144), T_IN(262144), T_TMP(262144), T_OUT(131072),
      T_OUT(131072), T_OUT(512)}},
    {"linear_gelu_bwd erf gz",
     r_linear_gelu_bwd,
     {37, 19, 45, 0},
     2e-6,
     0,
     {T_IN(703), T_IN(855), T_PRE(1665), T_IN(1665), T_OUT(1665), NONE, NONE, T_TMP(45)}},
    {"linear_gelu_bwd erf",
     r_linear_gelu_bwd,
     {37, 19, 45, 0},
     1e-5,
     15,
     {T_IN(703), T_IN(855), T_PRE(1665), T_IN(1665), T_TMP(1665), T_OUT(703), T_OUT(855),
      T_OUT(45)}},
    /* without gb: the GELU backward kernel, then the one product */
    {"linear_gelu_bwd erf gw alone",
     r_linear_gelu_bwd,
     {37, 19, 45, 0},
     1e-5,
     15,
     {T_IN(703), T_IN(855), T_PRE(1665), T_IN(1665), T_TMP(1665), NONE, T_OUT(855), NONE}},
    /* linear backward through a GELU {rows, in, out, tanh}, {x, w, gy, aux,
     * gz, gb_act, gw, gb}: tanh at gz of 2^18 elements (in a multiple of 8)
     * takes cuBLASLt's DGELU_BGRAD epilogue in bf16/f16 (DGELU without
     * gb_act; f32 composes), gz = gelu'(aux) times the f32 accumulator, one
     * rounding; erf and small shapes the product into gz, rounded, then the
     * column pass (the GELU backward kernel without gb_act) over it: a
     * second rounding, u |gelu'(aux) gy W| <= 1.13 u |gy W| more, mag 1.13
     * max|gy W| (max|gy W| 3.27 at 512 x 512 x 256, 4.82 at 37 x 45 x 19;
     * the epilogue cases too, for a product that falls back or
     * TP_CUDA_EPILOGUE=0); gz's atol as linear_gelu_fwd's (products of as
     * many terms of the same sizes). gb_act sums gz rounded up to twice
     * where the CPU's f32 sums its f32 gz: 2 u sum|gz| more, mag twice the
     * largest column sum|gz| (rows terms): 183 and 40.1 here (atol for f32
     * sums of 512 terms, as linear_gelu_bwd's); gw and gb read the inputs
     * and round once */
    {"linear_bwd_dgelu tanh epilogue gz",
     r_linear_bwd_dgelu,
     {512, 512, 256, 1},
     1e-5,
     4,
     {T_IN(262144), T_SMALL(131072), T_IN(131072), T_PRE(262144), T_OUT(262144), T_TMP(512),
      T_TMP(131072), T_TMP(256)}},
    {"linear_bwd_dgelu tanh epilogue",
     r_linear_bwd_dgelu,
     {512, 512, 256, 1},
     1e-4,
     370,
     {T_IN(262144), T_SMALL(131072), T_IN(131072), T_PRE(262144), T_TMP(262144), T_OUT(512),
      T_OUT(131072), T_OUT(256)}},
    {"linear_bwd_dgelu tanh epilogue no gb_act",
     r_linear_bwd_dgelu,
     {512, 512, 256, 1},
     1e-5,
     4,
     {T_IN(262144), T_SMALL(131072), T_IN(131072), T_PRE(262144), T_OUT(262144), NONE, NONE,
      NONE}},
    {"linear_bwd_dgelu erf",
     r_linear_bwd_dgelu,
     {37, 45, 19, 0},
     1e-5,
     81,
     {T_IN(1665), T_IN(855), T_IN(703), T_PRE(1665), T_OUT(1665), T_OUT(45), T_OUT(855),
      T_OUT(19)}},
    {"linear_bwd_dgelu erf gz alone",
     r_linear_bwd_dgelu,
     {37, 45, 19, 0},
     1e-5,
     6,
     {T_IN(1665), T_IN(855), T_IN(703), T_PRE(1665), T_OUT(1665), NONE, NONE, NONE}},
    {"copy", r_copy, {101}, 0, 0, {T_IN(101), T_OUT(101)}},
    {"fill", r_fill, {101, 0.3}, 0, 0, {T_OUT(101)}},
    {"add", r_add, {1000}, 0, 0, {T_IN(1000), T_IN(1000), T_OUT(1000)}},
    {"mul", r_mul, {1000}, 0, 0, {T_IN(1000), T_IN(1000), T_OUT(1000)}},
    {"scale", r_scale, {1000, 0.7}, 0, 0, {T_IN(1000), T_OUT(1000)}},
    {"accumulate", r_accumulate, {1000}, 0, 0, {T_IN(1000), T_ACC(1000)}},
    {"add_bcast same shape", r_add_bcast, {0}, 0, 0, {T_IN(60), T_IN(60), T_OUT(60)}},
    {"add_bcast rows", r_add_bcast, {1}, 0, 0, {T_IN(24), T_IN(6), T_OUT(24)}},
    {"add_bcast general", r_add_bcast, {2}, 0, 0, {T_IN(60), T_IN(15), T_OUT(60)}},
    {"mul_bcast same shape", r_mul_bcast, {0}, 0, 0, {T_IN(60), T_IN(60), T_OUT(60)}},
    {"mul_bcast rows", r_mul_bcast, {1}, 0, 0, {T_IN(24), T_IN(6), T_OUT(24)}},
    {"mul_bcast general", r_mul_bcast, {2}, 0, 0, {T_IN(60), T_IN(15), T_OUT(60)}},
    {"sum_bcast two runs", r_sum_bcast, {0}, 1e-5, 0, {T_IN(60), T_OUT(4)}},
    {"sum_bcast one run", r_sum_bcast, {1}, 1e-5, 0, {T_IN(60), T_OUT(15)}},
    {"gather", r_gather, {0}, 0, 0, {T_IN(12), T_OUT(12)}},
    {"relu_fwd", r_relu_fwd, {1000}, 0, 0, {T_IN(1000), T_OUT(1000)}},
    {"relu_bwd", r_relu_bwd, {1000}, 0, 0, {T_IN(1000), T_IN(1000), T_OUT(1000)}},
    {"gelu_fwd tanh", r_gelu_fwd, {1000, 1}, 2e-6, 0, {T_IN(1000), T_OUT(1000)}},
    {"gelu_fwd erf", r_gelu_fwd, {1000, 0}, 2e-6, 0, {T_IN(1000), T_OUT(1000)}},
    {"gelu_bwd tanh", r_gelu_bwd, {1000, 1}, 2e-6, 0, {T_IN(1000), T_IN(1000), T_OUT(1000)}},
    {"gelu_bwd erf", r_gelu_bwd, {1000, 0}, 2e-6, 0, {T_IN(1000), T_IN(1000), T_OUT(1000)}},
    /* whole 16-byte packs and a tail of single elements */
    {"gelu_fwd tail", r_gelu_fwd, {1003, 0}, 2e-6, 0, {T_IN(1003), T_OUT(1003)}},
    {"gelu_bwd tail", r_gelu_bwd, {1003, 1}, 2e-6, 0, {T_IN(1003), T_IN(1003), T_OUT(1003)}},
    /* SiLU and SwiGLU over [-12, 12] (gates) and [-1, 1]: packs and a tail, and
     * swiglu_bwd with either gradient NULL */
    {"silu_fwd", r_silu_fwd, {1003}, 2e-6, 0, {T_WIDE(1003), T_OUT(1003)}},
    {"silu_bwd", r_silu_bwd, {1003}, 2e-6, 0, {T_WIDE(1003), T_IN(1003), T_OUT(1003)}},
    {"swiglu_fwd", r_swiglu_fwd, {1003}, 2e-6, 0, {T_WIDE(1003), T_IN(1003), T_OUT(1003)}},
    {"swiglu_bwd",
     r_swiglu_bwd,
     {1003},
     2e-6,
     0,
     {T_WIDE(1003), T_IN(1003), T_IN(1003), T_OUT(1003), T_OUT(1003)}},
    {"swiglu_bwd gate alone",
     r_swiglu_bwd,
     {1000},
     2e-6,
     0,
     {T_WIDE(1000), T_IN(1000), T_IN(1000), T_OUT(1000), NONE}},
    {"swiglu_bwd up alone",
     r_swiglu_bwd,
     {1000},
     2e-6,
     0,
     {T_WIDE(1000), T_IN(1000), T_IN(1000), NONE, T_OUT(1000)}},
    {"sum_dim rows", r_sum_dim, {3, 400, 1, 1}, 1e-5, 0, {T_IN(1200), T_OUT(3)}},
    {"sum_dim columns", r_sum_dim, {1, 40, 6, 4}, 1e-5, 0, {T_IN(240), T_OUT(6)}},
    {"sum_dim strided", r_sum_dim, {3, 7, 5, 2}, 1e-5, 0, {T_IN(105), T_OUT(15)}},
    /* columns over enough rows to split them in chunks */
    {"sum_dim columns chunked", r_sum_dim, {1, 3000, 40, 2}, 1e-5, 0, {T_IN(120000), T_OUT(40)}},
    {"sum_dim_bwd", r_sum_dim_bwd, {3, 4, 5, 0.5}, 0, 0, {T_IN(15), T_OUT(60)}},
    {"sum_dim_bwd whole", r_sum_dim_bwd, {1, 50, 1, 0.5}, 0, 0, {T_IN(1), T_OUT(50)}},
    {"sum_all", r_sum_all, {3000, 10}, 1e-5, 0, {T_IN(3000), T_OUT(1)}},
    /* over one block's share: partial sums of many blocks */
    {"sum_all many blocks", r_sum_all, {300000, 10}, 1e-5, 0, {T_IN(300000), T_OUT(1)}},
    {"softmax_fwd", r_softmax_fwd, {5, 300}, 1e-7, 0, {T_IN(1500), T_OUT(1500)}},
    {"softmax_bwd", r_softmax_bwd, {5, 300}, 1e-5, 0, {T_POS(1500), T_IN(1500), T_OUT(1500)}},
    {"causal_mask", r_causal_mask, {2, 6}, 0, 0, {T_ACC(72)}},
    {"transpose_last2", r_transpose, {2, 33, 40}, 0, 0, {T_IN(2640), T_OUT(2640)}},
    {"embedding_fwd",
     r_embedding_fwd,
     {10, 8, 16, 2},
     0,
     0,
     {I_IN(10, -2, 12), T_IN(128), T_OUT(160)}},
    /* per-element atomics: one rounding per index hitting the row (at most 10) */
    {"embedding_bwd",
     r_embedding_bwd,
     {10, 8, 16, 2},
     1e-6,
     10,
     {I_IN(10, -2, 12), T_IN(160), T_ACC(128)}},
    {"layer_norm_fwd",
     r_layer_norm_fwd,
     {4, 70},
     1e-5,
     0,
     {T_IN(280), T_IN(70), T_IN(70), T_OUT(280), F_OUT(4), F_OUT(4)}},
    {"layer_norm_fwd no affine",
     r_layer_norm_fwd,
     {4, 70},
     1e-5,
     0,
     {T_IN(280), NONE, NONE, T_OUT(280), F_OUT(4), F_OUT(4)}},
    {"layer_norm_bwd",
     r_layer_norm_bwd,
     {4, 70},
     1e-5,
     0,
     {T_IN(280), T_IN(70), F_IN(4, -0.2, 0.2), F_IN(4, 0.5, 2), T_IN(280), T_OUT(280), T_ACC(70),
      T_ACC(70)}},
    /* rows enough for the weight and bias gradients' chunked column sums */
    {"layer_norm_bwd tall",
     r_layer_norm_bwd,
     {2048, 70},
     1e-5,
     0,
     {T_IN(143360), T_IN(70), F_IN(2048, -0.2, 0.2), F_IN(2048, 0.5, 2), T_IN(143360),
      T_OUT(143360), T_ACC(70), T_ACC(70)}},
    {"rms_norm_fwd", r_rms_norm_fwd, {4, 70}, 1e-5, 0, {T_IN(280), T_IN(70), T_OUT(280), F_OUT(4)}},
    {"rms_norm_bwd",
     r_rms_norm_bwd,
     {4, 70},
     1e-5,
     0,
     {T_IN(280), T_IN(70), F_IN(4, 0.5, 2), T_IN(280), T_OUT(280), T_ACC(70)}},
    {"dropout_fwd", r_dropout_fwd, {0.3}, 0, 0, {T_IN(200), T_OUT(200), U_OUT(200)}},
    {"dropout_fwd p=0", r_dropout_fwd, {0.0}, 0, 0, {T_IN(200), T_OUT(200), U_OUT(200)}},
    {"dropout_fwd p=1", r_dropout_fwd, {1.0}, 0, 0, {T_IN(200), T_OUT(200), U_OUT(200)}},
    {"dropout_bwd", r_dropout_bwd, {0.3, 200}, 0, 0, {T_IN(200), U_IN(200), T_OUT(200)}},
    {"dropout_bwd p=0", r_dropout_bwd, {0.0, 200}, 0, 0, {T_IN(200), U_IN(200), T_OUT(200)}},
    {"cross_entropy_fwd",
     r_ce_fwd,
     {6, 9, 3},
     1e-6,
     0,
     {T_IN(54), I_IN(6, -1, 9), T_POS(9), T_OUT(6)}},
    {"cross_entropy_bwd",
     r_ce_bwd,
     {6, 9, 3},
     1e-6,
     0,
     {T_IN(54), I_IN(6, -1, 9), T_POS(9), T_IN(6), T_OUT(54)}},
    {"ce_gloss", r_ce_gloss, {6, 0, 1}, 0, 0, {T_IN(6), T_OUT(6)}},
    {"ce_gloss broadcast", r_ce_gloss, {6, 1, 6}, 0, 0, {T_IN(1), T_OUT(6)}},
    {"row_max", r_row_max, {6, 9, 3}, 0, 0, {T_IN(54), F_OUT(6)}},
    {"row_sumexp", r_row_sumexp, {6, 9, 3}, 1e-6, 0, {T_IN(54), F_IN(6, 0, 1), F_OUT(6)}},
    {"pick_target", r_pick_target, {6, 9, 3, 5}, 0, 0, {T_IN(54), I_IN(6, -1, 20), F_OUT(6)}},
    {"vocab_ce_loss",
     r_vocab_ce_loss,
     {6},
     1e-6,
     0,
     {I_IN(6, -1, 20), T_POS(20), F_IN(6, 0, 1), F_IN(6, 1, 10), F_IN(6, -1, 1), T_OUT(6)}},
    {"vocab_ce_bwd",
     r_vocab_ce_bwd,
     {6, 9, 3, 5},
     1e-6,
     0,
     {T_IN(54), I_IN(6, -1, 20), T_POS(20), F_IN(6, 0, 1), F_IN(6, 1, 10), T_IN(6), T_OUT(54)}},
    {"sgd_step", r_sgd, {1000, 0.1}, 0, 0, {T_ACC(1000), T_IN(1000)}},
    {"adam_step",
     r_adam,
     {1000},
     1e-7,
     0,
     {T_ACC(1000), F_ACC(1000, -1, 1), F_ACC(1000, 0, 1), T_IN(1000)}},
    /* attn_softmax {batch, rows, Sq, Sk, key_offset, causal, pad_div}: pads
     * of 0/1 (rows with no visible key come out 0) */
    {"attn_softmax causal", r_attn_softmax, {2, 6, 6, 6, 0, 1, 1}, 1e-7, 0, {T_ACC(72), NONE}},
    {"attn_softmax grouped offset pad",
     r_attn_softmax,
     {4, 6, 3, 9, 6, 1, 2},
     1e-7,
     0,
     {T_ACC(216), I_IN(18, 0, 2)}},
    /* more keys than a block has threads */
    {"attn_softmax decode pad",
     r_attn_softmax,
     {4, 4, 1, 300, 299, 1, 1},
     1e-7,
     0,
     {T_ACC(4800), I_IN(1200, 0, 2)}},
    {"attn_softmax padding only",
     r_attn_softmax,
     {8, 2, 2, 3, 0, 0, 1},
     1e-7,
     0,
     {T_ACC(48), I_IN(24, 0, 2)}},
    /* fused attention: the tensor-core forward in bf16 and f16 (head dims 64
     * and 128, over several row and key tiles, grouped rows straddling a
     * tile, a decode row over a cache's prefix; few row blocks split the
     * keys, which a combine pass joins) and the general form (f32,
     * other head dims, Dv != D); P is rounded to the dtype before P V, as
     * flash attention does: mag 1.5 allows it on outputs below 1 */
    {"flash fwd causal GQA D128",
     r_flash_attn_fwd,
     {2, 300, 150, 150, 128, 128, 0, 1, 150, 1},
     1e-5,
     1.5,
     {T_IN(76800), T_IN(38400), T_IN(38400), T_OUT(76800), F_OUT(600), NONE}},
    /* at most two key tiles: one pass over the keys (the others split them) */
    {"flash fwd unsplit causal GQA D64",
     r_flash_attn_fwd,
     {2, 200, 100, 100, 64, 64, 0, 1, 100, 1},
     1e-5,
     1.5,
     {T_IN(25600), T_IN(12800), T_IN(12800), T_OUT(25600), F_OUT(400), NONE}},
    {"flash fwd padded D64",
     r_flash_attn_fwd,
     {4, 140, 70, 200, 64, 64, 0, 0, 200, 2},
     1e-5,
     1.5,
     {T_IN(35840), T_IN(51200), T_IN(51200), T_OUT(35840), F_OUT(560), I_IN(400, 0, 2)}},
    {"flash fwd decode over a cache D128",
     r_flash_attn_fwd,
     {2, 4, 1, 300, 128, 128, 299, 1, 512, 1},
     1e-5,
     1.5,
     {T_IN(1024), T_IN(131072), T_IN(131072), T_OUT(1024), F_OUT(8), NONE}},
    {"flash fwd general D80",
     r_flash_attn_fwd,
     {2, 80, 40, 90, 80, 80, 50, 1, 90, 1},
     1e-5,
     1.5,
     {T_IN(12800), T_IN(14400), T_IN(14400), T_OUT(12800), F_OUT(160), NONE}},
    {"flash fwd general Dv 32 != D 64",
     r_flash_attn_fwd,
     {2, 60, 30, 70, 64, 32, 0, 1, 70, 2},
     1e-5,
     1.5,
     {T_IN(7680), T_IN(8960), T_IN(4480), T_OUT(3840), F_OUT(120), I_IN(70, 0, 2)}},
    /* the backward {q, k, v, out, lse, gout, delta, gq, gk, gv, pad} on
     * independent inputs (lse in [3, 4] keeps p below 1): the tensor-core
     * kernels (D 128 causal grouped, D 64 padded), the general ones */
    {"flash bwd causal GQA D128",
     r_flash_attn_bwd,
     {2, 300, 150, 150, 128, 128, 0, 1, 150, 1},
     1e-5,
     4,
     {T_IN(76800), T_IN(38400), T_IN(38400), T_IN(76800), F_IN(600, 3, 4), T_IN(76800),
      F_OUT(600), T_OUT(76800), T_OUT(38400), T_OUT(38400), NONE}},
    {"flash bwd padded D64",
     r_flash_attn_bwd,
     {4, 140, 70, 200, 64, 64, 0, 0, 200, 2},
     1e-5,
     4,
     {T_IN(35840), T_IN(51200), T_IN(51200), T_IN(35840), F_IN(560, 3, 4), T_IN(35840),
      F_OUT(560), T_OUT(35840), T_OUT(51200), T_OUT(51200), I_IN(400, 0, 2)}},
    {"flash bwd padded decode Dv 32",
     r_flash_attn_bwd,
     {2, 4, 1, 100, 64, 32, 99, 1, 128, 1},
     1e-5,
     4,
     {T_IN(512), T_IN(16384), T_IN(8192), T_IN(256), F_IN(8, 3, 4), T_IN(256), F_OUT(8),
      T_OUT(512), T_OUT(12800), T_OUT(6400), I_IN(200, 0, 2)}},
    /* cos and sin with halves that differ (the general formula); the f32
     * arithmetic is the CPU's, rounding for rounding */
    {"rope_fwd",
     r_rope_fwd,
     {2, 3, 5, 8, 40},
     1e-7,
     0,
     {T_IN(240), T_IN(80), T_IN(80), T_OUT(240)}},
    {"rope_fwd cos broadcast over the batch",
     r_rope_fwd,
     {3, 2, 70, 130, 0},
     1e-7,
     0,
     {T_IN(54600), T_IN(9100), T_IN(9100), T_OUT(54600)}},
    {"rope_bwd",
     r_rope_bwd,
     {2, 3, 5, 8, 40},
     1e-7,
     0,
     {T_IN(240), T_IN(80), T_IN(80), T_OUT(240)}},
    {"rope_bwd cos broadcast over the batch",
     r_rope_bwd,
     {3, 2, 70, 130, 0},
     1e-7,
     0,
     {T_IN(54600), T_IN(9100), T_IN(9100), T_OUT(54600)}},
    /* angles up to 1e5 rad: the same f32 product; sincosf against cos/sin in double */
    {"rope_cos_sin",
     r_rope_cos_sin,
     {50, 64, 1},
     1e-7,
     0,
     {I_IN(50, 0, 100001), F_IN(32, 0.0001, 1), T_OUT(3200), T_OUT(3200)}},
    {"rope_cos_sin scaled",
     r_rope_cos_sin,
     {7, 6, 0.75},
     1e-7,
     0,
     {I_IN(7, 0, 20), F_IN(3, 0.01, 1), T_OUT(42), T_OUT(42)}},
};

#define NCASES (sizeof cases / sizeof cases[0])

/* Every entry of the table appears in some case. */
Test(cuda_kernels, the_cases_cover_every_entry, .timeout = 30)
{
    static const struct {
        kfn fn;
        const char *entry;
    } map[] = {
        {r_gemm, "gemm"},
        {r_linear_fwd, "linear_fwd"},
        {r_linear_bwd, "linear_bwd"},
        {r_linear_gelu_fwd, "linear_gelu_fwd"},
        {r_linear_gelu_bwd, "linear_gelu_bwd"},
        {r_linear_bwd_dgelu, "linear_bwd_dgelu"},
        {r_copy, "copy"},
        {r_fill, "fill"},
        {r_add, "add"},
        {r_mul, "mul"},
        {r_scale, "scale"},
        {r_accumulate, "accumulate"},
        {r_add_bcast, "add_bcast"},
        {r_mul_bcast, "mul_bcast"},
        {r_sum_bcast, "sum_bcast"},
        {r_gather, "gather"},
        {r_relu_fwd, "relu_fwd"},
        {r_relu_bwd, "relu_bwd"},
        {r_gelu_fwd, "gelu_fwd"},
        {r_gelu_bwd, "gelu_bwd"},
        {r_sum_dim, "sum_dim"},
        {r_sum_dim_bwd, "sum_dim_bwd"},
        {r_sum_all, "sum_all"},
        {r_softmax_fwd, "softmax_fwd"},
        {r_softmax_bwd, "softmax_bwd"},
        {r_causal_mask, "causal_mask"},
        {r_transpose, "transpose_last2"},
        {r_embedding_fwd, "embedding_fwd"},
        {r_embedding_bwd, "embedding_bwd"},
        {r_layer_norm_fwd, "layer_norm_fwd"},
        {r_layer_norm_bwd, "layer_norm_bwd"},
        {r_rms_norm_fwd, "rms_norm_fwd"},
        {r_rms_norm_bwd, "rms_norm_bwd"},
        {r_dropout_fwd, "dropout_fwd"},
        {r_dropout_bwd, "dropout_bwd"},
        {r_ce_fwd, "cross_entropy_fwd"},
        {r_ce_bwd, "cross_entropy_bwd"},
        {r_ce_gloss, "ce_gloss"},
        {r_row_max, "row_max"},
        {r_row_sumexp, "row_sumexp"},
        {r_pick_target, "pick_target"},
        {r_vocab_ce_loss, "vocab_ce_loss"},
        {r_vocab_ce_bwd, "vocab_ce_bwd"},
        {r_sgd, "sgd_step"},
        {r_adam, "adam_step"},
        {r_silu_fwd, "silu_fwd"},
        {r_silu_bwd, "silu_bwd"},
        {r_swiglu_fwd, "swiglu_fwd"},
        {r_swiglu_bwd, "swiglu_bwd"},
        {r_attn_softmax, "attn_softmax"},
        {r_flash_attn_fwd, "flash_attn_fwd"},
        {r_flash_attn_bwd, "flash_attn_bwd"},
        {r_rope_fwd, "rope_fwd"},
        {r_rope_bwd, "rope_bwd"},
        {r_rope_cos_sin, "rope_cos_sin"},
    };
    cr_assert_eq(sizeof map / sizeof map[0], (size_t)(TP__KOP_COUNT - 1));
    for (int op = 1; op < TP__KOP_COUNT; op++) {
        const char *name = tp__kop_name((tp__kop)op);
        bool found = false;
        for (size_t m = 0; m < sizeof map / sizeof map[0]; m++) {
            if (strcmp(map[m].entry, name) != 0)
                continue;
            for (size_t c = 0; c < NCASES; c++)
                found |= cases[c].run == map[m].fn;
        }
        cr_assert(found, "no case runs the entry %s", name);
    }
}

static void run_all(tp_dtype dt)
{
    need_cuda();
    for (size_t c = 0; c < NCASES; c++)
        check_case(&cases[c], dt);
}

Test(cuda_kernels, every_entry_f32, .timeout = 120)
{
    run_all(TP_F32);
}
Test(cuda_kernels, every_entry_bf16, .timeout = 120)
{
    run_all(TP_BF16);
}
Test(cuda_kernels, every_entry_f16, .timeout = 120)
{
    run_all(TP_F16);
}

/* supports() and the refusals need no device, only a CUDA build. */
Test(cuda_kernels, supports_exactly_the_float_dtypes, .timeout = 30)
{
    if (!TP_HAVE_CUDA)
        cr_skip_test("no CUDA device: libtp was built without CUDA");
    const tp__kernels *K = tp__kernels_cuda;
    cr_assert_not_null(K);
    static const tp_dtype yes[] = {TP_F32, TP_BF16, TP_F16}, no[] = {TP_F64, TP_I32, TP_I64};
    for (int op = 1; op < TP__KOP_COUNT; op++)
        for (int k = 0; k < 3; k++) {
            cr_assert(K->supports((tp__kop)op, yes[k]), "%s refuses %s", tp__kop_name((tp__kop)op),
                      tp_dtype_name(yes[k]));
            cr_assert(!K->supports((tp__kop)op, no[k]), "%s takes %s", tp__kop_name((tp__kop)op),
                      tp_dtype_name(no[k]));
        }
    cr_assert(!K->supports(TP__KOP_NONE, TP_F32));
    cr_assert(!K->supports(TP__KOP_COUNT, TP_F32));
    /* refused before the device is touched: dangling pointers are never read */
    CHECK_ERR(K->relu_fwd(GPU, TP_F64, NULL, NULL, 4), TP_ERR_NOT_SUPPORTED);
    cr_assert_str_eq(tp_last_error(), "cuda kernels: relu_fwd does not take f64");
    CHECK_ERR(K->adam_step(GPU, TP_I64, NULL, NULL, NULL, NULL, 4, 0.9, 0.999, 0.1, 1, 1e-8),
              TP_ERR_NOT_SUPPORTED);
    cr_assert_str_eq(tp_last_error(), "cuda kernels: adam_step does not take i64");
}

/* ---- TF32 -------------------------------------------------------------------------
 *
 * The setting is process-wide: a rank thread reads what the main thread set
 * (no GPU needed). On a GPU, an f32 product y = x w^T with K = 1024 through
 * tp_linear: with TF32 off within f32 bounds of an f64 reference computed
 * here; with TF32 on within the TF32 bound of that reference, and (so that the
 * setting is shown to reach cuBLAS) farther from it than f32 allows somewhere. */

static tp_status read_tf32(tp_comm *w, void *arg)
{
    (void)w;
    *(bool *)arg = tp_cuda_allow_tf32();
    return TP_OK;
}

Test(cuda_kernels, tf32_setting_is_process_wide, .timeout = 30)
{
    bool seen = false;
    cr_assert(!tp_cuda_allow_tf32(), "TF32 must be off by default");
    CHECK_OK(tp_cuda_set_allow_tf32(true));
    CHECK_OK(tp_run_local(1, read_tf32, &seen));
    cr_assert(seen, "a rank thread does not see TF32 set by the main thread");
    CHECK_OK(tp_cuda_set_allow_tf32(false));
    CHECK_OK(tp_run_local(1, read_tf32, &seen));
    cr_assert(!seen, "a rank thread does not see TF32 cleared by the main thread");
}

enum { TF_M = 256, TF_N = 256, TF_K = 1024 }; /* large enough for tensor-core kernels */

/* tp_linear(x, w) on GPU with TF32 as given, back on the CPU in f32. */
static float *gpu_linear_f32(tp_tensor *xc, tp_tensor *wc, bool tf32)
{
    tp_tensor *xg = NULL, *wg = NULL, *yg = NULL, *yc = NULL;
    CHECK_OK(tp_cuda_set_allow_tf32(tf32));
    CHECK_OK(tp_tensor_to(xc, TP_F32, GPU, &xg));
    CHECK_OK(tp_tensor_to(wc, TP_F32, GPU, &wg));
    tp_status st = tp_linear(xg, wg, NULL, &yg);
    CHECK_OK(tp_cuda_set_allow_tf32(false));
    CHECK_OK(st);
    CHECK_OK(tp_tensor_to(yg, TP_F32, CPU, &yc));
    float *out = malloc(sizeof(float) * TF_M * TF_N);
    cr_assert_not_null(out);
    memcpy(out, tp_tensor_data(yc), sizeof(float) * TF_M * TF_N);
    tp_tensor *all[] = {xg, wg, yg, yc};
    for (int i = 0; i < 4; i++)
        tp_tensor_release(all[i]);
    return out;
}

Test(cuda_kernels, tf32_product_bounds, .timeout = 60)
{
    need_cuda();
    const int64_t xs[2] = {TF_M, TF_K}, ws[2] = {TF_N, TF_K};
    tp_tensor *xc = NULL, *wc = NULL;
    CHECK_OK(tp_tensor_empty(TP_F32, CPU, 2, xs, &xc));
    CHECK_OK(tp_tensor_empty(TP_F32, CPU, 2, ws, &wc));
    CHECK_OK(tp_tensor_fill_random(xc, TP_RNG_UNIFORM, -1, 1, 11, NULL, NULL));
    CHECK_OK(tp_tensor_fill_random(wc, TP_RNG_UNIFORM, -1, 1, 12, NULL, NULL));
    const float *x = tp_tensor_data(xc), *w = tp_tensor_data(wc);
    float *off = gpu_linear_f32(xc, wc, false), *on = gpu_linear_f32(xc, wc, true);
    double beyond_f32 = 0;
    for (int i = 0; i < TF_M; i++)
        for (int j = 0; j < TF_N; j++) {
            double r = 0, mag = 0;
            for (int k = 0; k < TF_K; k++) {
                double t = (double)x[i * TF_K + k] * (double)w[j * TF_K + k];
                r += t;
                mag += fabs(t);
            }
            /* f32: one rounding of the output and K 2^-23 sum|terms| for the sums;
             * TF32: each input keeps 10 mantissa bits (off by < 2^-10 relative,
             * rounded or truncated), so each product is off by < 2^-9 relative */
            double f32_bound = 0x1p-24 * fabs(r) + TF_K * 0x1p-23 * mag;
            double tf32_bound = 0x1p-9 * mag + f32_bound;
            double e_off = fabs(off[i * TF_N + j] - r), e_on = fabs(on[i * TF_N + j] - r);
            cr_assert(e_off <= f32_bound, "TF32 off: y[%d][%d] = %.9g, f64 %.9g, off by %g > %g", i,
                      j, off[i * TF_N + j], r, e_off, f32_bound);
            cr_assert(e_on <= tf32_bound, "TF32 on: y[%d][%d] = %.9g, f64 %.9g, off by %g > %g", i,
                      j, on[i * TF_N + j], r, e_on, tf32_bound);
            beyond_f32 = fmax(beyond_f32, e_on / (0x1p-24 * fabs(r) + 0x1p-23 * mag));
        }
    /* exact f32 products in order would stay within 2^-23 sum|terms|; TF32
     * products lose ~2^-11 each, so some output lies far outside that */
    cr_assert(beyond_f32 > 8,
              "TF32 on is as exact as f32 (%.2f x the f32 error unit): the "
              "setting does not reach cuBLAS",
              beyond_f32);
    free(off);
    free(on);
    tp_tensor_release(xc);
    tp_tensor_release(wc);
}
