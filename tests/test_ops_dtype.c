/* Every public op in bf16 and f16, forward and backward, plain and on
 * DTensors (1-D meshes of 1 to 4 ranks, sharded and Partial layouts), against
 * the same computation in f64 on the whole inputs.
 *
 * Inputs are drawn in f32 and rounded to the dtype under test, so they are
 * exact in it; the f64 reference reads those values. Each output element y
 * must satisfy, against the reference r (docs/API.md "Precision"):
 *
 *   |y - r| <= eps |r| + (K 2^-23 + stages eps) a + 4e-6
 *
 * eps = 2^-8 (bf16), 2^-11 (f16), 2^-24 (f32); K bounds the terms of a sum;
 * a is the sum of the absolute terms for the products and sums (the f64
 * reference on the absolute inputs) and max |r| over the tensor otherwise;
 * stages counts the extra roundings the computation stores in the dtype (0
 * for one rounding; 1 more on more than one rank, where a Partial term is
 * rounded before the reduction; softmax's backward reads its rounded output,
 * attention rounds its scores and probabilities). 4e-6 covers the CPU's
 * polynomial exp/erf (1e-6).
 *
 * The same distributed run in f32 (the same input values) is held to the f32
 * bound, and its collective counts (comm-debug, per kind) must equal the
 * bf16/f16 run's; two runs repeat it with tp_set_partial_reduce_f32(true). */
#include <math.h>

#include "tp_test_dtensor.h"

#define NKINDS TP_COLL_KIND_COUNT

typedef struct dcase dcase;
typedef tp_status (*op_fn)(const dcase *c, tp_tensor *const *in, tp_tensor **y);
/* y = f(in); gin[i] = the gradient of <gy, y> w.r.t. float input i */
typedef void (*ref_fn)(const dcase *c, const double *const *in, const double *gy, double *y,
                       double *const *gin);

struct dcase {
    const char *name;
    int n_in;
    int nd[4];
    int64_t shape[4][4];
    unsigned index_mask; /* integer (i64) inputs: never a gradient */
    int64_t index_hi;    /* indices in [0, index_hi); element 1 is -100 when ignore */
    bool ignore;
    tp_placement pl[4]; /* on the 1-D mesh */
    op_fn op;
    ref_fn ref;
    bool bilinear; /* a from the reference on absolute values */
    double stages; /* of the gradients */
    int64_t K;
    double param; /* the op's scalar (scale, p, ...) */
    unsigned nograd_mask; /* float inputs that get no gradient (class weights) */
    double out_stages;    /* of the output */
};

static int64_t numel_of(int nd, const int64_t *s)
{
    int64_t n = 1;
    for (int d = 0; d < nd; d++)
        n *= s[d];
    return n;
}

static int64_t in_numel(const dcase *c, int i)
{
    return numel_of(c->nd[i], c->shape[i]);
}

/* ---- the ops -------------------------------------------------------------- */

static tp_status op_linear(const dcase *c, tp_tensor *const *in, tp_tensor **y)
{
    return tp_linear(in[0], in[1], c->n_in > 2 ? in[2] : NULL, y);
}
static tp_status op_matmul(const dcase *c, tp_tensor *const *in, tp_tensor **y)
{
    (void)c;
    return tp_matmul(in[0], in[1], y);
}
static tp_status op_add(const dcase *c, tp_tensor *const *in, tp_tensor **y)
{
    (void)c;
    return tp_add(in[0], in[1], y);
}
static tp_status op_mul(const dcase *c, tp_tensor *const *in, tp_tensor **y)
{
    (void)c;
    return tp_mul(in[0], in[1], y);
}
static tp_status op_relu(const dcase *c, tp_tensor *const *in, tp_tensor **y)
{
    (void)c;
    return tp_relu(in[0], y);
}
static tp_status op_gelu(const dcase *c, tp_tensor *const *in, tp_tensor **y)
{
    return tp_gelu(in[0], c->param != 0 ? TP_GELU_TANH : TP_GELU_EXACT, y);
}
static tp_status op_silu(const dcase *c, tp_tensor *const *in, tp_tensor **y)
{
    (void)c;
    return tp_silu(in[0], y);
}
static tp_status op_swiglu(const dcase *c, tp_tensor *const *in, tp_tensor **y)
{
    (void)c;
    return tp_swiglu(in[0], in[1], y);
}
static tp_status op_scale(const dcase *c, tp_tensor *const *in, tp_tensor **y)
{
    return tp_scale(in[0], c->param, y);
}
static tp_status op_dropout(const dcase *c, tp_tensor *const *in, tp_tensor **y)
{
    return tp_dropout(in[0], c->param, 9, true, y);
}
static tp_status op_sum1(const dcase *c, tp_tensor *const *in, tp_tensor **y)
{
    (void)c;
    return tp_sum(in[0], 1, false, y);
}
static tp_status op_mean_all(const dcase *c, tp_tensor *const *in, tp_tensor **y)
{
    (void)c;
    return tp_mean_all(in[0], y);
}
static tp_status op_softmax(const dcase *c, tp_tensor *const *in, tp_tensor **y)
{
    (void)c;
    return tp_softmax(in[0], -1, y);
}
static tp_status op_layer_norm(const dcase *c, tp_tensor *const *in, tp_tensor **y)
{
    return tp_layer_norm(in[0], in[1], in[2], c->param, y);
}
static tp_status op_rms_norm(const dcase *c, tp_tensor *const *in, tp_tensor **y)
{
    return tp_rms_norm(in[0], in[1], c->param, y);
}
static tp_status op_embedding(const dcase *c, tp_tensor *const *in, tp_tensor **y)
{
    (void)c;
    return tp_embedding(in[0], in[1], y);
}
static tp_status op_ce(const dcase *c, tp_tensor *const *in, tp_tensor **y)
{
    tp_cross_entropy_options o = TP_CROSS_ENTROPY_DEFAULTS;
    o.reduction = (tp_reduction)(int)c->param;
    o.weight = c->n_in > 2 ? in[2] : NULL;
    return tp_cross_entropy(in[0], in[1], &o, y);
}
static tp_status op_reshape(const dcase *c, tp_tensor *const *in, tp_tensor **y)
{
    (void)c;
    return tp_reshape(in[0], 3, (int64_t[]){4, 2, 3}, y);
}
static tp_status op_transpose(const dcase *c, tp_tensor *const *in, tp_tensor **y)
{
    (void)c;
    return tp_transpose(in[0], 0, 1, y);
}
static tp_status op_sdpa(const dcase *c, tp_tensor *const *in, tp_tensor **y)
{
    (void)c;
    return tp_scaled_dot_product_attention(in[0], in[1], in[2], true, 0.0, y);
}
/* grouped heads, causal with key_offset = param, key_padding in[3] */
static tp_status op_sdpa_gqa(const dcase *c, tp_tensor *const *in, tp_tensor **y)
{
    tp_sdpa_options o = {.causal = true, .key_offset = (int64_t)c->param, .key_padding = in[3]};
    return tp_scaled_dot_product_attention_with(in[0], in[1], in[2], &o, y);
}

static tp_status op_rope(const dcase *c, tp_tensor *const *in, tp_tensor **y)
{
    (void)c;
    return tp_rotary_embedding(in[0], in[1], in[2], y);
}

/* ---- the f64 references ------------------------------------------------------ */

/* y[r, o] = sum_k x[r, k] w[o, k] (+ b[o]) */
static void ref_linear(const dcase *c, const double *const *in, const double *gy, double *y,
                       double *const *g)
{
    const int64_t R = c->shape[0][0], I = c->shape[0][1], O = c->shape[1][0];
    const double *x = in[0], *w = in[1], *b = c->n_in > 2 ? in[2] : NULL;
    for (int64_t r = 0; r < R; r++)
        for (int64_t o = 0; o < O; o++) {
            double s = b ? b[o] : 0;
            for (int64_t k = 0; k < I; k++)
                s += x[r * I + k] * w[o * I + k];
            y[r * O + o] = s;
        }
    for (int64_t r = 0; r < R; r++)
        for (int64_t k = 0; k < I; k++) {
            double s = 0;
            for (int64_t o = 0; o < O; o++)
                s += gy[r * O + o] * w[o * I + k];
            g[0][r * I + k] = s;
        }
    for (int64_t o = 0; o < O; o++) {
        for (int64_t k = 0; k < I; k++) {
            double s = 0;
            for (int64_t r = 0; r < R; r++)
                s += gy[r * O + o] * x[r * I + k];
            g[1][o * I + k] = s;
        }
        if (b) {
            double s = 0;
            for (int64_t r = 0; r < R; r++)
                s += gy[r * O + o];
            g[2][o] = s;
        }
    }
}

/* y[r, n] = sum_k a[r, k] b[k, n], a's leading dims flattened */
static void ref_matmul(const dcase *c, const double *const *in, const double *gy, double *y,
                       double *const *g)
{
    const int64_t K = c->shape[1][0], N = c->shape[1][1], R = in_numel(c, 0) / K;
    const double *a = in[0], *b = in[1];
    for (int64_t r = 0; r < R; r++)
        for (int64_t n = 0; n < N; n++) {
            double s = 0;
            for (int64_t k = 0; k < K; k++)
                s += a[r * K + k] * b[k * N + n];
            y[r * N + n] = s;
        }
    for (int64_t r = 0; r < R; r++)
        for (int64_t k = 0; k < K; k++) {
            double s = 0;
            for (int64_t n = 0; n < N; n++)
                s += gy[r * N + n] * b[k * N + n];
            g[0][r * K + k] = s;
        }
    for (int64_t k = 0; k < K; k++)
        for (int64_t n = 0; n < N; n++) {
            double s = 0;
            for (int64_t r = 0; r < R; r++)
                s += a[r * K + k] * gy[r * N + n];
            g[1][k * N + n] = s;
        }
}

/* a + b or a * b with b broadcast over a's leading dims (b's shape is a's
 * trailing dims) */
static void ref_binary(const dcase *c, const double *const *in, const double *gy, double *y,
                       double *const *g, bool mul)
{
    const int64_t n = in_numel(c, 0), nb = in_numel(c, 1);
    const double *a = in[0], *b = in[1];
    for (int64_t j = 0; j < nb; j++)
        g[1][j] = 0;
    for (int64_t i = 0; i < n; i++) {
        double bv = b[i % nb];
        y[i] = mul ? a[i] * bv : a[i] + bv;
        g[0][i] = mul ? gy[i] * bv : gy[i];
        g[1][i % nb] += mul ? gy[i] * a[i] : gy[i];
    }
}
static void ref_add(const dcase *c, const double *const *in, const double *gy, double *y,
                    double *const *g)
{
    ref_binary(c, in, gy, y, g, false);
}
static void ref_mul(const dcase *c, const double *const *in, const double *gy, double *y,
                    double *const *g)
{
    ref_binary(c, in, gy, y, g, true);
}

/* elementwise: y = f(x), g = gy f'(x) */
static void ref_unary(const dcase *c, const double *const *in, const double *gy, double *y,
                      double *const *g, double (*f)(double, double, double *))
{
    for (int64_t i = 0; i < in_numel(c, 0); i++) {
        double d = 0;
        y[i] = f(in[0][i], c->param, &d);
        g[0][i] = gy[i] * d;
    }
}
static double f_relu(double x, double p, double *d)
{
    (void)p;
    *d = x > 0 ? 1 : 0;
    return x > 0 ? x : 0;
}
static double f_gelu(double x, double tanh_form, double *d)
{
    if (tanh_form != 0) {
        const double k = sqrt(2.0 / M_PI), u = k * (x + 0.044715 * x * x * x), t = tanh(u);
        *d = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * k * (1 + 3 * 0.044715 * x * x);
        return 0.5 * x * (1 + t);
    }
    const double cdf = 0.5 * (1 + erf(x / sqrt(2.0)));
    *d = cdf + x * exp(-0.5 * x * x) / sqrt(2 * M_PI);
    return x * cdf;
}
static double f_scale(double x, double s, double *d)
{
    *d = s;
    return x * s;
}
/* silu from exp(-|x|): sigmoid and 1 - sigmoid without overflow */
static double f_silu(double x, double p, double *d)
{
    (void)p;
    double e = exp(-fabs(x)), q = 1.0 / (1.0 + e), sg = x >= 0 ? q : e * q,
           om = x >= 0 ? e * q : q;
    *d = sg * (1 + x * om);
    return x * sg;
}
static void ref_silu(const dcase *c, const double *const *in, const double *gy, double *y,
                     double *const *g)
{
    ref_unary(c, in, gy, y, g, f_silu);
}
/* y = silu(gate) up; d gate = gy up silu'(gate), d up = gy silu(gate) */
static void ref_swiglu(const dcase *c, const double *const *in, const double *gy, double *y,
                       double *const *g)
{
    for (int64_t i = 0; i < in_numel(c, 0); i++) {
        double d = 0, s = f_silu(in[0][i], 0, &d);
        y[i] = s * in[1][i];
        g[0][i] = gy[i] * in[1][i] * d;
        g[1][i] = gy[i] * s;
    }
}
static void ref_relu(const dcase *c, const double *const *in, const double *gy, double *y,
                     double *const *g)
{
    ref_unary(c, in, gy, y, g, f_relu);
}
static void ref_gelu(const dcase *c, const double *const *in, const double *gy, double *y,
                     double *const *g)
{
    ref_unary(c, in, gy, y, g, f_gelu);
}
static void ref_scale(const dcase *c, const double *const *in, const double *gy, double *y,
                      double *const *g)
{
    ref_unary(c, in, gy, y, g, f_scale);
}

/* kept iff tp_rng_uniform(seed 9, global index) >= p, scaled by 1/(1-p) */
static void ref_dropout(const dcase *c, const double *const *in, const double *gy, double *y,
                        double *const *g)
{
    const double p = c->param, k = 1.0 / (1.0 - p);
    for (int64_t i = 0; i < in_numel(c, 0); i++) {
        bool keep = tp_rng_uniform(9, (uint64_t)i) >= p;
        y[i] = keep ? in[0][i] * k : 0;
        g[0][i] = keep ? gy[i] * k : 0;
    }
}

static void ref_sum1(const dcase *c, const double *const *in, const double *gy, double *y,
                     double *const *g)
{
    const int64_t R = c->shape[0][0], C = c->shape[0][1];
    for (int64_t r = 0; r < R; r++) {
        double s = 0;
        for (int64_t j = 0; j < C; j++) {
            s += in[0][r * C + j];
            g[0][r * C + j] = gy[r];
        }
        y[r] = s;
    }
}
static void ref_mean_all(const dcase *c, const double *const *in, const double *gy, double *y,
                         double *const *g)
{
    const int64_t n = in_numel(c, 0);
    double s = 0;
    for (int64_t i = 0; i < n; i++) {
        s += in[0][i];
        g[0][i] = gy[0] / (double)n;
    }
    y[0] = s / (double)n;
}

/* softmax of each row of [rows, cols] into p */
static void softmax_rows(const double *x, double *p, int64_t rows, int64_t cols)
{
    for (int64_t r = 0; r < rows; r++) {
        double m = -INFINITY, s = 0;
        for (int64_t j = 0; j < cols; j++)
            m = fmax(m, x[r * cols + j]);
        for (int64_t j = 0; j < cols; j++)
            s += (p[r * cols + j] = isinf(x[r * cols + j]) ? 0 : exp(x[r * cols + j] - m));
        for (int64_t j = 0; j < cols; j++)
            p[r * cols + j] /= s;
    }
}
/* g = p (gy - sum(gy p)) per row */
static void softmax_rows_bwd(const double *p, const double *gy, double *g, int64_t rows,
                             int64_t cols)
{
    for (int64_t r = 0; r < rows; r++) {
        double dot = 0;
        for (int64_t j = 0; j < cols; j++)
            dot += gy[r * cols + j] * p[r * cols + j];
        for (int64_t j = 0; j < cols; j++)
            g[r * cols + j] = p[r * cols + j] * (gy[r * cols + j] - dot);
    }
}
static void ref_softmax(const dcase *c, const double *const *in, const double *gy, double *y,
                        double *const *g)
{
    const int64_t C = c->shape[0][c->nd[0] - 1], R = in_numel(c, 0) / C;
    softmax_rows(in[0], y, R, C);
    softmax_rows_bwd(y, gy, g[0], R, C);
}

/* layer norm (rms: no mean, no bias) over the last dim */
static void ref_norm(const dcase *c, const double *const *in, const double *gy, double *y,
                     double *const *g, bool rms)
{
    const int64_t C = c->shape[0][1], R = c->shape[0][0];
    const double *x = in[0], *w = in[1], *b = rms ? NULL : in[2];
    for (int64_t j = 0; j < C; j++) {
        g[1][j] = 0;
        if (b)
            g[2][j] = 0;
    }
    for (int64_t r = 0; r < R; r++) {
        const double *xr = x + r * C, *gr = gy + r * C;
        double mean = 0, var = 0, a1 = 0, a2 = 0;
        for (int64_t j = 0; j < C; j++)
            mean += rms ? 0 : xr[j] / (double)C;
        for (int64_t j = 0; j < C; j++)
            var += (xr[j] - mean) * (xr[j] - mean) / (double)C;
        const double rstd = 1.0 / sqrt(var + c->param);
        for (int64_t j = 0; j < C; j++) {
            double xh = (xr[j] - mean) * rstd, gh = gr[j] * w[j];
            y[r * C + j] = xh * w[j] + (b ? b[j] : 0);
            g[1][j] += gr[j] * xh;
            if (b)
                g[2][j] += gr[j];
            a1 += gh / (double)C;
            a2 += gh * xh / (double)C;
        }
        for (int64_t j = 0; j < C; j++) {
            double xh = (xr[j] - mean) * rstd;
            g[0][r * C + j] = rstd * (gr[j] * w[j] - (rms ? 0 : a1) - xh * a2);
        }
    }
}
static void ref_layer_norm(const dcase *c, const double *const *in, const double *gy, double *y,
                           double *const *g)
{
    ref_norm(c, in, gy, y, g, false);
}
static void ref_rms_norm(const dcase *c, const double *const *in, const double *gy, double *y,
                         double *const *g)
{
    ref_norm(c, in, gy, y, g, true);
}

/* y[i, :] = w[idx[i], :]; gw[idx[i], :] += gy[i, :] */
static void ref_embedding(const dcase *c, const double *const *in, const double *gy, double *y,
                          double *const *g)
{
    const int64_t n = in_numel(c, 0), D = c->shape[1][1];
    for (int64_t k = 0; k < in_numel(c, 1); k++)
        g[1][k] = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t t = (int64_t)in[0][i];
        for (int64_t d = 0; d < D; d++) {
            y[i * D + d] = in[1][t * D + d];
            g[1][t * D + d] += gy[i * D + d];
        }
    }
}

/* cross entropy of [N, C] logits, ignore_index -100; param: the reduction */
static void ref_ce(const dcase *c, const double *const *in, const double *gy, double *y,
                   double *const *g)
{
    const int64_t N = c->shape[0][0], C = c->shape[0][1];
    const tp_reduction red = (tp_reduction)(int)c->param;
    const double *cw = c->n_in > 2 ? in[2] : NULL;
    double *p = calloc((size_t)(N * C), sizeof *p), total = 0, count = 0;
    softmax_rows(in[0], p, N, C);
    for (int64_t r = 0; r < N; r++) {
        int64_t t = (int64_t)in[1][r];
        double loss = 0;
        if (t != -100) {
            double m = -INFINITY, s = 0;
            for (int64_t j = 0; j < C; j++)
                m = fmax(m, in[0][r * C + j]);
            for (int64_t j = 0; j < C; j++)
                s += exp(in[0][r * C + j] - m);
            loss = (cw ? cw[t] : 1) * (log(s) + m - in[0][r * C + t]);
            count += cw ? cw[t] : 1;
        }
        total += loss;
        if (red == TP_REDUCTION_NONE)
            y[r] = loss;
    }
    if (red != TP_REDUCTION_NONE)
        y[0] = red == TP_REDUCTION_MEAN ? total / count : total;
    for (int64_t r = 0; r < N; r++) {
        int64_t t = (int64_t)in[1][r];
        double gl = red == TP_REDUCTION_NONE   ? gy[r]
                    : red == TP_REDUCTION_MEAN ? gy[0] / count
                                               : gy[0];
        for (int64_t j = 0; j < C; j++)
            g[0][r * C + j] =
                t == -100 ? 0 : gl * (cw ? cw[t] : 1) * (p[r * C + j] - (j == t ? 1 : 0));
    }
    free(p);
}

/* a copy with dims reordered: out[i0, i1] for the transpose of [A, B] */
static void ref_transpose(const dcase *c, const double *const *in, const double *gy, double *y,
                          double *const *g)
{
    const int64_t A = c->shape[0][0], B = c->shape[0][1];
    for (int64_t i = 0; i < A; i++)
        for (int64_t j = 0; j < B; j++) {
            y[j * A + i] = in[0][i * B + j];
            g[0][i * B + j] = gy[j * A + i];
        }
}
static void ref_reshape(const dcase *c, const double *const *in, const double *gy, double *y,
                        double *const *g)
{
    for (int64_t i = 0; i < in_numel(c, 0); i++) {
        y[i] = in[0][i];
        g[0][i] = gy[i];
    }
}

/* causal attention over [B..., S, D], scale 1/sqrt(D) */
static void ref_sdpa(const dcase *c, const double *const *in, const double *gy, double *y,
                     double *const *g)
{
    const int nd = c->nd[0];
    const int64_t S = c->shape[0][nd - 2], D = c->shape[0][nd - 1], B = in_numel(c, 0) / (S * D);
    const double sc = 1.0 / sqrt((double)D);
    double *s = malloc(sizeof(double) * (size_t)(S * S)),
           *p = malloc(sizeof(double) * (size_t)(S * S)),
           *dp = malloc(sizeof(double) * (size_t)(S * S)),
           *ds = malloc(sizeof(double) * (size_t)(S * S));
    for (int64_t b = 0; b < B; b++) {
        const double *q = in[0] + b * S * D, *k = in[1] + b * S * D, *v = in[2] + b * S * D,
                     *go = gy + b * S * D;
        double *o = y + b * S * D, *gq = g[0] + b * S * D, *gk = g[1] + b * S * D,
               *gv = g[2] + b * S * D;
        for (int64_t i = 0; i < S; i++)
            for (int64_t j = 0; j < S; j++) {
                double t = 0;
                for (int64_t d = 0; d < D; d++)
                    t += q[i * D + d] * k[j * D + d];
                s[i * S + j] = j > i ? -INFINITY : t * sc;
            }
        softmax_rows(s, p, S, S);
        for (int64_t i = 0; i < S; i++)
            for (int64_t d = 0; d < D; d++) {
                double t = 0, tv = 0;
                for (int64_t j = 0; j < S; j++) {
                    t += p[i * S + j] * v[j * D + d];
                    tv += p[j * S + i] * go[j * D + d];
                }
                o[i * D + d] = t;
                gv[i * D + d] = tv;
            }
        for (int64_t i = 0; i < S; i++)
            for (int64_t j = 0; j < S; j++) {
                double t = 0;
                for (int64_t d = 0; d < D; d++)
                    t += go[i * D + d] * v[j * D + d];
                dp[i * S + j] = t;
            }
        softmax_rows_bwd(p, dp, ds, S, S);
        for (int64_t i = 0; i < S; i++)
            for (int64_t d = 0; d < D; d++) {
                double tq = 0, tk = 0;
                for (int64_t j = 0; j < S; j++) {
                    tq += ds[i * S + j] * k[j * D + d];
                    tk += ds[j * S + i] * q[j * D + d];
                }
                gq[i * D + d] = tq * sc;
                gk[i * D + d] = tk * sc;
            }
    }
    free(s);
    free(p);
    free(dp);
    free(ds);
}

/* grouped attention: q [B, Hq, Sq, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv],
 * pad [B, Sk]; query head h reads kv head h / (Hq / Hkv); query i sees key j
 * iff j <= param + i and pad[b, j] != 0; a row seeing nothing is 0 */
static void ref_sdpa_gqa(const dcase *c, const double *const *in, const double *gy, double *y,
                         double *const *g)
{
    const int64_t B = c->shape[0][0], Hq = c->shape[0][1], Sq = c->shape[0][2],
                  D = c->shape[0][3], Hkv = c->shape[1][1], Sk = c->shape[1][2],
                  Dv = c->shape[2][3], off = (int64_t)c->param, rep = Hq / Hkv;
    const double sc = 1.0 / sqrt((double)D);
    double *p = malloc(sizeof(double) * (size_t)(Sq * Sk)),
           *ds = malloc(sizeof(double) * (size_t)(Sq * Sk));
    for (int64_t i = 0; i < in_numel(c, 1); i++)
        g[1][i] = 0;
    for (int64_t i = 0; i < in_numel(c, 2); i++)
        g[2][i] = 0;
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < Hq; h++) {
            const int64_t hk = b * Hkv + h / rep, hq = b * Hq + h;
            const double *q = in[0] + hq * Sq * D, *k = in[1] + hk * Sk * D,
                         *v = in[2] + hk * Sk * Dv, *pad = in[3] + b * Sk, *go = gy + hq * Sq * Dv;
            double *o = y + hq * Sq * Dv, *gq = g[0] + hq * Sq * D, *gk = g[1] + hk * Sk * D,
                   *gv = g[2] + hk * Sk * Dv;
            for (int64_t i = 0; i < Sq; i++) {
                double m = -INFINITY, sum = 0;
                for (int64_t j = 0; j < Sk; j++) {
                    double t = 0;
                    for (int64_t d = 0; d < D; d++)
                        t += q[i * D + d] * k[j * D + d];
                    p[i * Sk + j] = j <= off + i && pad[j] != 0 ? t * sc : -INFINITY;
                    m = fmax(m, p[i * Sk + j]);
                }
                for (int64_t j = 0; j < Sk; j++)
                    sum += (p[i * Sk + j] = m == -INFINITY ? 0 : exp(p[i * Sk + j] - m));
                for (int64_t j = 0; j < Sk; j++)
                    p[i * Sk + j] = sum > 0 ? p[i * Sk + j] / sum : 0;
            }
            for (int64_t i = 0; i < Sq; i++)
                for (int64_t d = 0; d < Dv; d++) {
                    double t = 0;
                    for (int64_t j = 0; j < Sk; j++)
                        t += p[i * Sk + j] * v[j * Dv + d];
                    o[i * Dv + d] = t;
                }
            for (int64_t j = 0; j < Sk; j++)
                for (int64_t d = 0; d < Dv; d++)
                    for (int64_t i = 0; i < Sq; i++)
                        gv[j * Dv + d] += p[i * Sk + j] * go[i * Dv + d];
            for (int64_t i = 0; i < Sq; i++)
                for (int64_t j = 0; j < Sk; j++) {
                    double t = 0;
                    for (int64_t d = 0; d < Dv; d++)
                        t += go[i * Dv + d] * v[j * Dv + d];
                    ds[i * Sk + j] = t;
                }
            softmax_rows_bwd(p, ds, ds, Sq, Sk);
            for (int64_t i = 0; i < Sq; i++)
                for (int64_t d = 0; d < D; d++) {
                    double t = 0;
                    for (int64_t j = 0; j < Sk; j++)
                        t += ds[i * Sk + j] * k[j * D + d];
                    gq[i * D + d] = t * sc;
                }
            for (int64_t j = 0; j < Sk; j++)
                for (int64_t d = 0; d < D; d++)
                    for (int64_t i = 0; i < Sq; i++)
                        gk[j * D + d] += ds[i * Sk + j] * q[i * D + d] * sc;
        }
    free(p);
    free(ds);
}

/* y = x cos + rotate_half(x) sin, x [B, H, S, D], cos/sin [1 or B, S, D];
 * the gradient of x is the transpose: g cos + rotate_half^T(g sin) */
static void ref_rope(const dcase *c, const double *const *in, const double *gy, double *y,
                     double *const *g)
{
    const int64_t B = c->shape[0][0], H = c->shape[0][1], S = c->shape[0][2], D = c->shape[0][3];
    const int64_t Bc = c->shape[1][0], h = D / 2;
    const double *x = in[0], *co = in[1], *si = in[2];
    for (int64_t b = 0; b < B; b++)
        for (int64_t r = 0; r < H * S; r++) {
            const int64_t e = (b * H * S + r) * D, ce = ((Bc == 1 ? 0 : b) * S + r % S) * D;
            for (int64_t i = 0; i < D; i++) {
                double rot = i < h ? -x[e + i + h] : x[e + i - h];
                double rtg = i < h ? gy[e + i + h] * si[ce + i + h]
                                   : -gy[e + i - h] * si[ce + i - h];
                y[e + i] = x[e + i] * co[ce + i] + rot * si[ce + i];
                g[0][e + i] = gy[e + i] * co[ce + i] + rtg;
            }
        }
}

/* ---- the cases ---------------------------------------------------------------- */

#define R_                                \
    {                                     \
        TP_PLACEMENT_REPLICATE, 0, TP_SUM \
    }
#define S_(d)                         \
    {                                 \
        TP_PLACEMENT_SHARD, d, TP_SUM \
    }
#define P_                              \
    {                                   \
        TP_PLACEMENT_PARTIAL, 0, TP_SUM \
    }

static const dcase cases[] = {
    {"linear colwise",
     3,
     {2, 2, 1},
     {{5, 6}, {7, 6}, {7}},
     0,
     0,
     false,
     {R_, S_(0), S_(0)},
     op_linear,
     ref_linear,
     true,
     0,
     8,
     0,
     0,
     0},
    {"linear rowwise",
     3,
     {2, 2, 1},
     {{5, 6}, {7, 6}, {7}},
     0,
     0,
     false,
     {S_(1), S_(1), R_},
     op_linear,
     ref_linear,
     true,
     0,
     8,
     0,
     0,
     0},
    {"linear on a Partial input",
     2,
     {2, 2},
     {{5, 6}, {7, 6}},
     0,
     0,
     false,
     {P_, R_},
     op_linear,
     ref_linear,
     true,
     0,
     8,
     0,
     0,
     0},
    {"matmul rowwise",
     2,
     {3, 2},
     {{2, 5, 6}, {6, 4}},
     0,
     0,
     false,
     {S_(2), S_(0)},
     op_matmul,
     ref_matmul,
     true,
     0,
     10,
     0,
     0,
     0},
    {"matmul colwise",
     2,
     {3, 2},
     {{2, 5, 6}, {6, 4}},
     0,
     0,
     false,
     {R_, S_(1)},
     op_matmul,
     ref_matmul,
     true,
     0,
     10,
     0,
     0,
     0},
    {"add broadcast",
     2,
     {3, 2},
     {{3, 5, 4}, {5, 4}},
     0,
     0,
     false,
     {S_(1), S_(0)},
     op_add,
     ref_add,
     true,
     0,
     3,
     0,
     0,
     0},
    {"add Partial + Partial",
     2,
     {2, 2},
     {{5, 4}, {5, 4}},
     0,
     0,
     false,
     {P_, P_},
     op_add,
     ref_add,
     true,
     0,
     1,
     0,
     0,
     0},
    /* b's gradient: gy * a is stored in the dtype, then summed over the
     * broadcast dims (as PyTorch) */
    {"mul broadcast",
     2,
     {3, 1},
     {{3, 5, 4}, {4}},
     0,
     0,
     false,
     {S_(2), S_(0)},
     op_mul,
     ref_mul,
     true,
     1,
     15,
     0,
     0,
     0},
    {"relu", 1, {2}, {{5, 7}}, 0, 0, false, {S_(0)}, op_relu, ref_relu, false, 0, 1, 0, 0, 0},
    {"gelu exact", 1, {2}, {{5, 7}}, 0, 0, false, {S_(1)}, op_gelu, ref_gelu, false, 0, 1, 0, 0, 0},
    {"gelu tanh", 1, {2}, {{5, 7}}, 0, 0, false, {R_}, op_gelu, ref_gelu, false, 0, 1, 1, 0, 0},
    {"silu", 1, {2}, {{5, 7}}, 0, 0, false, {S_(1)}, op_silu, ref_silu, false, 0, 1, 0, 0, 0},
    {"silu of a Partial", 1, {2}, {{5, 7}}, 0, 0, false, {P_}, op_silu, ref_silu, false, 0, 1, 0, 0,
     0},
    {"swiglu S(-1)", 2, {2, 2}, {{5, 7}, {5, 7}}, 0, 0, false, {S_(-1), S_(-1)}, op_swiglu,
     ref_swiglu, false, 0, 1, 0, 0, 0},
    {"swiglu S(0) and R", 2, {2, 2}, {{5, 7}, {5, 7}}, 0, 0, false, {S_(0), R_}, op_swiglu,
     ref_swiglu, false, 0, 1, 0, 0, 0},
    {"swiglu of a Partial gate", 2, {2, 2}, {{5, 7}, {5, 7}}, 0, 0, false, {P_, R_}, op_swiglu,
     ref_swiglu, false, 0, 1, 0, 0, 0},
    {"scale of a Partial",
     1,
     {2},
     {{5, 7}},
     0,
     0,
     false,
     {P_},
     op_scale,
     ref_scale,
     false,
     0,
     1,
     0.75,
     0,
     0},
    {"dropout",
     1,
     {2},
     {{5, 7}},
     0,
     0,
     false,
     {S_(1)},
     op_dropout,
     ref_dropout,
     false,
     0,
     1,
     0.25,
     0,
     0},
    {"sum over a sharded dim",
     1,
     {2},
     {{5, 7}},
     0,
     0,
     false,
     {S_(1)},
     op_sum1,
     ref_sum1,
     true,
     0,
     7,
     0,
     0,
     0},
    {"mean_all",
     1,
     {2},
     {{5, 7}},
     0,
     0,
     false,
     {S_(0)},
     op_mean_all,
     ref_mean_all,
     true,
     0,
     35,
     0,
     0,
     0},
    {"softmax",
     1,
     {2},
     {{5, 7}},
     0,
     0,
     false,
     {S_(0)},
     op_softmax,
     ref_softmax,
     false,
     1,
     7,
     0,
     0,
     0},
    {"layer_norm sequence-sharded",
     3,
     {2, 1, 1},
     {{6, 8}, {8}, {8}},
     0,
     0,
     false,
     {S_(0), R_, R_},
     op_layer_norm,
     ref_layer_norm,
     false,
     0,
     16,
     1e-5,
     0,
     0},
    {"rms_norm sequence-sharded",
     2,
     {2, 1},
     {{6, 8}, {8}},
     0,
     0,
     false,
     {S_(0), R_},
     op_rms_norm,
     ref_rms_norm,
     false,
     0,
     16,
     1e-5,
     0,
     0},
    /* indices repeat: the table gradient adds up to 12 rows into one */
    {"embedding row-sharded",
     2,
     {2, 2},
     {{4, 3}, {10, 6}},
     1u,
     10,
     false,
     {R_, S_(0)},
     op_embedding,
     ref_embedding,
     true,
     0,
     12,
     0,
     0,
     0},
    {"embedding dim-sharded",
     2,
     {2, 2},
     {{4, 3}, {10, 6}},
     1u,
     10,
     false,
     {R_, S_(1)},
     op_embedding,
     ref_embedding,
     true,
     0,
     12,
     0,
     0,
     0},
    /* the loss gradient is rounded to the dtype before the logits' one */
    {"cross_entropy mean",
     2,
     {2, 1},
     {{6, 10}, {6}},
     2u,
     10,
     true,
     {R_, R_},
     op_ce,
     ref_ce,
     false,
     1,
     60,
     TP_REDUCTION_MEAN,
     0,
     0},
    {"cross_entropy none",
     2,
     {2, 1},
     {{6, 10}, {6}},
     2u,
     10,
     true,
     {R_, R_},
     op_ce,
     ref_ce,
     false,
     1,
     10,
     TP_REDUCTION_NONE,
     0,
     0},
    {"cross_entropy vocab-parallel mean",
     2,
     {2, 1},
     {{6, 10}, {6}},
     2u,
     10,
     true,
     {S_(1), R_},
     op_ce,
     ref_ce,
     false,
     1,
     60,
     TP_REDUCTION_MEAN,
     0,
     0},
    {"cross_entropy vocab-parallel sum",
     2,
     {2, 1},
     {{6, 10}, {6}},
     2u,
     10,
     true,
     {S_(1), R_},
     op_ce,
     ref_ce,
     false,
     1,
     60,
     TP_REDUCTION_SUM,
     0,
     0},
    {"cross_entropy vocab-parallel none",
     2,
     {2, 1},
     {{6, 10}, {6}},
     2u,
     10,
     true,
     {S_(1), R_},
     op_ce,
     ref_ce,
     false,
     1,
     10,
     TP_REDUCTION_NONE,
     0,
     0},
    /* class weights in the logits' dtype, in [0.25, 2) */
    {"cross_entropy weighted mean",
     3,
     {2, 1, 1},
     {{6, 10}, {6}, {10}},
     2u,
     10,
     true,
     {R_, R_, R_},
     op_ce,
     ref_ce,
     false,
     1,
     60,
     TP_REDUCTION_MEAN,
     4u,
     0},
    {"cross_entropy vocab-parallel weighted mean",
     3,
     {2, 1, 1},
     {{6, 10}, {6}, {10}},
     2u,
     10,
     true,
     {S_(1), R_, R_},
     op_ce,
     ref_ce,
     false,
     1,
     60,
     TP_REDUCTION_MEAN,
     4u,
     0},
    {"reshape",
     1,
     {2},
     {{4, 6}},
     0,
     0,
     false,
     {S_(0)},
     op_reshape,
     ref_reshape,
     false,
     0,
     1,
     0,
     0,
     0},
    {"transpose",
     1,
     {2},
     {{4, 6}},
     0,
     0,
     false,
     {S_(1)},
     op_transpose,
     ref_transpose,
     false,
     0,
     1,
     0,
     0,
     0},
    /* scores and probabilities are stored in the dtype (as PyTorch's math
     * attention), then multiplied again */
    {"attention heads-sharded",
     3,
     {4, 4, 4},
     {{2, 3, 4, 5}, {2, 3, 4, 5}, {2, 3, 4, 5}},
     0,
     0,
     false,
     {S_(1), S_(1), S_(1)},
     op_sdpa,
     ref_sdpa,
     false,
     4,
     5,
     0,
     0,
     4},
    /* 4 query heads over 2 kv heads, 3 queries after 3 cached keys, Dv 3,
     * random 0/1 key padding (rows with no key come out 0); heads shard on
     * 2 ranks, on 3 and 4 the inputs are gathered */
    {"attention grouped, key offset and padding",
     4,
     {4, 4, 4, 2},
     {{2, 4, 3, 5}, {2, 2, 6, 5}, {2, 2, 6, 3}, {2, 6}},
     8u,
     2,
     false,
     {S_(1), S_(1), S_(1), R_},
     op_sdpa_gqa,
     ref_sdpa_gqa,
     false,
     4,
     8,
     3,
     0,
     4},
    /* the halves of cos and sin differ here: the general formula */
    {"rotary_embedding heads-sharded",
     3,
     {4, 3, 3},
     {{2, 3, 4, 6}, {1, 4, 6}, {1, 4, 6}},
     0,
     0,
     false,
     {S_(1), R_, R_},
     op_rope,
     ref_rope,
     false,
     0,
     4,
     0,
     6u,
     0},
    {"rotary_embedding sequence-sharded",
     3,
     {4, 3, 3},
     {{2, 3, 5, 6}, {2, 5, 6}, {2, 5, 6}},
     0,
     0,
     false,
     {S_(2), S_(1), S_(1)},
     op_rope,
     ref_rope,
     false,
     0,
     4,
     0,
     6u,
     0},
};
#define NCASES ((int)(sizeof cases / sizeof cases[0]))

/* ---- running one case ------------------------------------------------------------ */

static double eps_of(tp_dtype dt)
{
    return dt == TP_BF16 ? 0x1p-8 : dt == TP_F16 ? 0x1p-11 : 0x1p-24;
}

/* A global tensor of `dt` holding values drawn in f32 in [lo, hi) and rounded
 * to `round_dt`; vals receives them (numel doubles, malloc'd). */
static tp_status exact_tensor(int nd, const int64_t *shape, uint64_t seed, double lo, double hi,
                              tp_dtype round_dt, tp_dtype dt, tp_tensor **out, double **vals)
{
    tp_tensor *f = NULL, *r = NULL, *back = NULL;
    TP_TEST_TRY(tp_tensor_zeros(TP_F32, TP_CPU, nd, shape, &f));
    tp_status st = tp_tensor_fill_random(f, TP_RNG_UNIFORM, lo, hi, seed, NULL, NULL);
    if (st == TP_OK)
        st = tp_tensor_to(f, round_dt, TP_CPU, &r);
    if (st == TP_OK)
        st = tp_tensor_to(r, TP_F32, TP_CPU, &back);
    if (st == TP_OK)
        st = tp_tensor_to(back, dt, TP_CPU, out);
    int64_t n = numel_of(nd, shape);
    *vals = calloc((size_t)(n > 0 ? n : 1), sizeof(double));
    for (int64_t i = 0; st == TP_OK && i < n; i++)
        (*vals)[i] = ((const float *)tp_tensor_data(back))[i];
    tp_tensor_release(f);
    tp_tensor_release(r);
    tp_tensor_release(back);
    return st;
}

/* The DTensor of global tensor full with placement pl on a 1-D mesh; a
 * Partial one holds the value on coordinate 0 and zeros elsewhere. A leaf. */
static tp_status to_dtensor(tp_mesh *mesh, tp_tensor *full, tp_placement pl, tp_tensor **out)
{
    if (pl.kind != TP_PLACEMENT_PARTIAL)
        return tp_dtensor_distribute(mesh, full, 1, &pl, -1, out);
    tp_tensor *local = NULL;
    if (tp_mesh_coord(mesh, 0) == 0)
        TP_TEST_TRY(tp_tensor_clone(full, &local));
    else
        TP_TEST_TRY(tp_tensor_zeros(tp_tensor_dtype(full), TP_CPU, tp_tensor_ndim(full),
                                    tp_tensor_shape(full), &local));
    tp_status st = tp_dtensor_from_local(mesh, local, 1, &pl, NULL, out);
    tp_tensor_release(local);
    return st;
}

/* Checks plain tensor t (dtype dt) against r (n doubles) with the bound of
 * the header; a: the absolute sums or NULL (max |r| then). */
static void check_close(tp_test_slot *s, const char *label, const char *what, tp_tensor *t,
                        tp_dtype dt, const double *r, const double *a, int64_t n, double stages,
                        int64_t K)
{
    RANK_EXPECT(s, tp_tensor_dtype(t) == dt, "%s: %s is %s, expected %s", label, what,
                tp_dtype_name(tp_tensor_dtype(t)), tp_dtype_name(dt));
    RANK_EXPECT(s, tp_tensor_numel(t) == n, "%s: %s has %lld elements, expected %lld", label, what,
                (long long)tp_tensor_numel(t), (long long)n);
    tp_tensor *f = NULL;
    if (tp_tensor_numel(t) != n || tp_tensor_to(t, TP_F32, TP_CPU, &f) != TP_OK)
        return;
    const float *y = tp_tensor_data(f);
    const double eps = eps_of(dt);
    double amax = 0;
    for (int64_t i = 0; i < n; i++)
        amax = fmax(amax, fabs(r[i]));
    for (int64_t i = 0; i < n; i++) {
        double ai = a ? a[i] : amax;
        double tol = eps * fabs(r[i]) + ((double)K * 0x1p-23 + stages * eps) * ai + 4e-6;
        if (!(fabs((double)y[i] - r[i]) <= tol)) {
            RANK_EXPECT(s, 0, "%s (%s): %s[%lld] = %.9g, reference %.9g, |diff| %.3g > %.3g", label,
                        tp_dtype_name(dt), what, (long long)i, (double)y[i], r[i],
                        fabs((double)y[i] - r[i]), tol);
            break;
        }
    }
    tp_tensor_release(f);
}

typedef struct {
    tp_tensor *full[4], *dt[4];
    double *val[4], *absval[4];
    tp_tensor *y, *yfull, *gy;
    double *gyv;
} run_state;

static void run_free(run_state *r)
{
    for (int i = 0; i < 4; i++) {
        tp_tensor_release(r->full[i]);
        tp_tensor_release(r->dt[i]);
        free(r->val[i]);
        free(r->absval[i]);
    }
    tp_tensor_release(r->y);
    tp_tensor_release(r->yfull);
    tp_tensor_release(r->gy);
    free(r->gyv);
}

/* The inputs of case c in dtype dt (values rounded to round_dt), as
 * DTensors that require grad. */
static tp_status make_inputs(tp_mesh *mesh, const dcase *c, tp_dtype round_dt, tp_dtype dt,
                             run_state *r)
{
    for (int i = 0; i < c->n_in; i++) {
        int64_t n = in_numel(c, i);
        if (c->index_mask & (1u << i)) {
            TP_TEST_TRY(tp_tensor_zeros(TP_I64, TP_CPU, c->nd[i], c->shape[i], &r->full[i]));
            TP_TEST_TRY(tp_tensor_fill_random(r->full[i], TP_RNG_RANDINT, 0, (double)c->index_hi,
                                              31 + (uint64_t)i, NULL, NULL));
            int64_t *iv = tp_tensor_data(r->full[i]);
            if (c->ignore)
                iv[1] = -100;
            r->val[i] = calloc((size_t)n, sizeof(double));
            r->absval[i] = calloc((size_t)n, sizeof(double));
            for (int64_t k = 0; k < n; k++)
                r->val[i][k] = r->absval[i][k] = (double)iv[k];
        } else {
            bool w = c->nograd_mask & (1u << i);
            TP_TEST_TRY(exact_tensor(c->nd[i], c->shape[i], 11 + (uint64_t)i, w ? 0.25 : -2, 2,
                                     round_dt, dt, &r->full[i], &r->val[i]));
            r->absval[i] = calloc((size_t)n, sizeof(double));
            for (int64_t k = 0; k < n; k++)
                r->absval[i][k] = fabs(r->val[i][k]);
        }
        TP_TEST_TRY(to_dtensor(mesh, r->full[i], c->pl[i], &r->dt[i]));
        if (!((c->index_mask | c->nograd_mask) & (1u << i)))
            TP_TEST_TRY(tp_tensor_set_requires_grad(r->dt[i], true));
    }
    return TP_OK;
}

/* Runs case c in dt on the mesh under a comm-debug counter (the op, the full
 * output, the backward), records the counts per kind, and checks the output
 * and the gradients against the f64 reference. */
static tp_status run_case(tp_test_slot *s, tp_mesh *mesh, const dcase *c, tp_dtype round_dt,
                          tp_dtype dt, int64_t *counts)
{
    run_state r;
    memset(&r, 0, sizeof r);
    tp_comm_debug *dbg = NULL;
    char label[96];
    snprintf(label, sizeof label, "%s, %d rank(s)", c->name, (int)tp_mesh_size(mesh, 0));
    tp_status st = make_inputs(mesh, c, round_dt, dt, &r);
    RANK_EXPECT(s, st == TP_OK, "%s: inputs: %s", label, tp_last_error());
    if (st == TP_OK)
        st = tp_comm_debug_create(&dbg);
    if (st == TP_OK)
        st = tp_comm_debug_begin(dbg);
    if (st == TP_OK) {
        st = c->op(c, r.dt, &r.y);
        RANK_EXPECT(s, st == TP_OK, "%s (%s): op: %s", label, tp_dtype_name(dt), tp_last_error());
    }
    if (st == TP_OK)
        st = tp_dtensor_full_tensor(r.y, &r.yfull);
    if (st == TP_OK)
        st = exact_tensor(tp_tensor_ndim(r.yfull), tp_tensor_shape(r.yfull), 77, -1, 1, round_dt,
                          dt, &r.gy, &r.gyv);
    if (st == TP_OK) {
        st = tp_backward(r.yfull, r.gy);
        RANK_EXPECT(s, st == TP_OK, "%s (%s): backward: %s", label, tp_dtype_name(dt),
                    tp_last_error());
    }
    if (dbg)
        tp_comm_debug_end(dbg);
    for (int k = 0; k < NKINDS && dbg; k++)
        counts[k] = tp_comm_debug_count(dbg, (tp_coll_kind)k);
    tp_comm_debug_free(dbg);
    if (st != TP_OK) {
        RANK_EXPECT(s, 0, "%s (%s): %s", label, tp_dtype_name(dt), tp_last_error());
        run_free(&r);
        return st;
    }
    RANK_EXPECT(s, tp_tensor_dtype(r.y) == dt, "%s: the output is %s, expected %s", label,
                tp_dtype_name(tp_tensor_dtype(r.y)), tp_dtype_name(dt));

    /* the reference, and the absolute sums of its terms */
    int64_t ny = tp_tensor_numel(r.yfull);
    double *yr = calloc((size_t)ny, sizeof(double)), *ya = calloc((size_t)ny, sizeof(double));
    double *gr[4] = {0}, *ga[4] = {0}, *gyabs = calloc((size_t)ny, sizeof(double));
    for (int64_t k = 0; k < ny; k++)
        gyabs[k] = fabs(r.gyv[k]);
    for (int i = 0; i < c->n_in; i++) {
        gr[i] = calloc((size_t)in_numel(c, i), sizeof(double));
        ga[i] = calloc((size_t)in_numel(c, i), sizeof(double));
    }
    c->ref(c, (const double *const *)r.val, r.gyv, yr, gr);
    if (c->bilinear)
        c->ref(c, (const double *const *)r.absval, gyabs, ya, ga);
    const double more = tp_mesh_size(mesh, 0) > 1 ? 1 : 0, stages = c->stages + more;
    check_close(s, label, "output", r.yfull, dt, yr, c->bilinear ? ya : NULL, ny,
                c->out_stages + more, c->K);
    for (int i = 0; i < c->n_in; i++) {
        if ((c->index_mask | c->nograd_mask) & (1u << i))
            continue;
        tp_tensor *g = tp_tensor_grad(r.dt[i]), *gf = NULL;
        char what[48];
        snprintf(what, sizeof what, "the gradient of input %d", i);
        RANK_EXPECT(s, g != NULL, "%s (%s): %s is missing", label, tp_dtype_name(dt), what);
        if (g && tp_dtensor_full_tensor(g, &gf) == TP_OK)
            check_close(s, label, what, gf, dt, gr[i], c->bilinear ? ga[i] : NULL, in_numel(c, i),
                        stages, c->K);
        tp_tensor_release(gf);
    }
    for (int i = 0; i < 4; i++) {
        free(gr[i]);
        free(ga[i]);
    }
    free(yr);
    free(ya);
    free(gyabs);
    run_free(&r);
    return TP_OK;
}

/* ---- every op, every world size, bf16 and f16 --------------------------------- */

typedef struct {
    int world;
    tp_dtype dt;
    bool partial_f32; /* tp_set_partial_reduce_f32 during the run */
} dtype_param;

typedef struct {
    dtype_param p;
    tp_test_slot slot[TP_TEST_MAX_RANKS];
} ops_ctx;

static tp_status ops_body(tp_comm *w, void *arg)
{
    ops_ctx *c = arg;
    tp_test_slot *s = &c->slot[tp_comm_rank(w)];
    tp_mesh *mesh = NULL;
    int64_t ms = tp_comm_size(w);
    RANK_OK(s, tp_mesh_create(w, 1, &ms, NULL, &mesh));
    for (int k = 0; k < NCASES; k++) {
        int64_t c32[NKINDS] = {0}, cd[NKINDS] = {0};
        /* the f32 run on the same values: the collectives to match, and a
         * check of the references at f32's bound */
        (void)run_case(s, mesh, &cases[k], c->p.dt, TP_F32, c32);
        (void)run_case(s, mesh, &cases[k], c->p.dt, c->p.dt, cd);
        for (int q = 0; q < NKINDS; q++)
            RANK_EXPECT(s, c32[q] == cd[q], "%s: %lld %s in %s, %lld in f32", cases[k].name,
                        (long long)cd[q], tp_coll_kind_name((tp_coll_kind)q),
                        tp_dtype_name(c->p.dt), (long long)c32[q]);
    }
    tp_mesh_free(mesh);
    return TP_OK;
}

ParameterizedTestParameters(ops_dtype, every_op)
{
    static dtype_param params[] = {
        {1, TP_BF16, false}, {2, TP_BF16, false}, {3, TP_BF16, false}, {4, TP_BF16, false},
        {1, TP_F16, false},  {2, TP_F16, false},  {3, TP_F16, false},  {4, TP_F16, false},
        {3, TP_BF16, true},  {4, TP_F16, true},
    };
    return cr_make_param_array(dtype_param, params, sizeof params / sizeof params[0]);
}

ParameterizedTest(dtype_param *p, ops_dtype, every_op, .timeout = 120)
{
    static ops_ctx c;
    memset(&c, 0, sizeof c);
    c.p = *p;
    tp_set_partial_reduce_f32(p->partial_f32);
    tp_test_run(p->world, ops_body, &c, c.slot);
    tp_set_partial_reduce_f32(false);
}

/* ---- dtype errors ------------------------------------------------------------ */

static tp_tensor *filled(tp_dtype dt, int nd, const int64_t *shape)
{
    tp_tensor *f = NULL, *t = NULL;
    cr_assert_eq(tp_tensor_zeros(TP_F32, TP_CPU, nd, shape, &f), TP_OK);
    cr_assert_eq(tp_tensor_fill_random(f, TP_RNG_RANDINT, -3, 4, 5, NULL, NULL), TP_OK);
    cr_assert_eq(tp_tensor_to(f, dt, TP_CPU, &t), TP_OK, "%s", tp_last_error());
    tp_tensor_release(f);
    return t;
}

#define CHECK_MSG(expr, code, text)                                                \
    do {                                                                           \
        CHECK_ERR(expr, code);                                                     \
        cr_assert(strstr(tp_last_error(), text), "%s: \"%s\" lacks \"%s\"", #expr, \
                  tp_last_error(), text);                                          \
    } while (0)

Test(ops_dtype, mixed_dtypes_are_invalid, .timeout = 30)
{
    const int64_t s46[2] = {4, 6}, s56[2] = {5, 6}, s6[1] = {6}, s3[1] = {3};
    tp_tensor *xb = filled(TP_BF16, 2, s46), *xf = filled(TP_F32, 2, s46),
              *wb = filled(TP_BF16, 2, s56), *wf = filled(TP_F32, 2, s56),
              *gh = filled(TP_F16, 1, s6), *lb = filled(TP_BF16, 2, (int64_t[]){3, 6}),
              *cw = filled(TP_F32, 1, s6), *y = NULL, *t = NULL;
    CHECK_OK(tp_tensor_zeros(TP_I64, TP_CPU, 1, s3, &t));
    CHECK_MSG(tp_add(xb, xf, &y), TP_ERR_INVALID_ARG,
              "add: a is bf16 but b is f32; the dtypes must match");
    CHECK_MSG(tp_mul(xf, xb, &y), TP_ERR_INVALID_ARG,
              "mul: a is f32 but b is bf16; the dtypes must match");
    CHECK_MSG(tp_linear(xb, wf, NULL, &y), TP_ERR_INVALID_ARG,
              "linear: x is bf16 but weight is f32; the dtypes must match");
    CHECK_MSG(tp_linear(xf, wb, NULL, &y), TP_ERR_INVALID_ARG, "the dtypes must match");
    CHECK_MSG(tp_layer_norm(xb, gh, NULL, 1e-5, &y), TP_ERR_INVALID_ARG,
              "layer_norm: x is bf16 but weight is f16; the dtypes must match");
    CHECK_MSG(tp_rms_norm(xb, gh, 1e-5, &y), TP_ERR_INVALID_ARG, "the dtypes must match");
    CHECK_MSG(tp_swiglu(xb, xf, &y), TP_ERR_INVALID_ARG,
              "swiglu: gate is bf16 but up is f32; the dtypes must match");
    CHECK_MSG(tp_scaled_dot_product_attention(xb, xb, xf, false, 0, &y), TP_ERR_INVALID_ARG,
              "q is bf16 but v is f32; the dtypes must match");
    tp_cross_entropy_options o = TP_CROSS_ENTROPY_DEFAULTS;
    o.weight = cw;
    CHECK_MSG(tp_cross_entropy(lb, t, &o, &y), TP_ERR_INVALID_ARG,
              "cross_entropy: logits is bf16 but weight is f32; the dtypes must match");
    cr_assert_null(y);
    tp_tensor *tensors[] = {xb, xf, wb, wf, gh, lb, cw, t};
    for (size_t i = 0; i < sizeof tensors / sizeof tensors[0]; i++)
        tp_tensor_release(tensors[i]);
}

Test(ops_dtype, f64_is_not_supported, .timeout = 30)
{
    const int64_t s46[2] = {4, 6}, s56[2] = {5, 6}, s4[1] = {4};
    tp_tensor *x = filled(TP_F64, 2, s46), *w = filled(TP_F64, 2, s56), *y = NULL, *t = NULL;
    CHECK_OK(tp_tensor_zeros(TP_I64, TP_CPU, 1, s4, &t));
    CHECK_MSG(tp_relu(x, &y), TP_ERR_NOT_SUPPORTED,
              "relu: x is f64, which the cpu kernels do not take (ops take f32, bf16 and f16)");
    CHECK_MSG(tp_linear(x, w, NULL, &y), TP_ERR_NOT_SUPPORTED, "linear: x is f64");
    CHECK_MSG(tp_add(x, x, &y), TP_ERR_NOT_SUPPORTED, "add: a is f64");
    CHECK_MSG(tp_softmax(x, -1, &y), TP_ERR_NOT_SUPPORTED, "softmax: x is f64");
    CHECK_MSG(tp_silu(x, &y), TP_ERR_NOT_SUPPORTED, "silu: x is f64");
    CHECK_MSG(tp_swiglu(x, x, &y), TP_ERR_NOT_SUPPORTED, "swiglu: gate is f64");
    CHECK_MSG(tp_transpose(x, 0, 1, &y), TP_ERR_NOT_SUPPORTED, "transpose: x is f64");
    CHECK_MSG(tp_cross_entropy(x, t, NULL, &y), TP_ERR_NOT_SUPPORTED,
              "cross_entropy: logits is f64");
    cr_assert_null(y);
    tp_tensor_release(x);
    tp_tensor_release(w);
    tp_tensor_release(t);
}

/* On DTensors the dtypes are checked before any redistribution: a refused
 * op issues no collective. */
typedef struct {
    tp_test_slot slot[TP_TEST_MAX_RANKS];
} mix_ctx;

static tp_status mix_body(tp_comm *w, void *arg)
{
    mix_ctx *c = arg;
    tp_test_slot *s = &c->slot[tp_comm_rank(w)];
    tp_mesh *mesh = NULL;
    int64_t ms = tp_comm_size(w);
    RANK_OK(s, tp_mesh_create(w, 1, &ms, NULL, &mesh));
    tp_tensor *fb = NULL, *ff = NULL, *db = NULL, *df = NULL, *y = NULL;
    double *v = NULL;
    const int64_t sh[2] = {6, 6};
    RANK_OK(s, exact_tensor(2, sh, 3, -1, 1, TP_BF16, TP_BF16, &fb, &v));
    free(v);
    RANK_OK(s, exact_tensor(2, sh, 3, -1, 1, TP_BF16, TP_F32, &ff, &v));
    free(v);
    tp_placement s0 = tp_shard(0), s1 = tp_shard(1);
    RANK_OK(s, tp_dtensor_distribute(mesh, fb, 1, &s0, -1, &db));
    RANK_OK(s, tp_dtensor_distribute(mesh, ff, 1, &s1, -1, &df));
    tp_comm_debug *dbg = NULL;
    RANK_OK(s, tp_comm_debug_create(&dbg));
    RANK_OK(s, tp_comm_debug_begin(dbg));
    tp_status st = tp_add(db, df, &y);
    tp_comm_debug_end(dbg);
    RANK_EXPECT(s, st == TP_ERR_INVALID_ARG && strstr(tp_last_error(), "the dtypes must match"),
                "bf16 S(0) + f32 S(1): %s (%s)", tp_status_name(st), tp_last_error());
    RANK_EXPECT(s, tp_comm_debug_total(dbg) == 0, "the refused op issued %lld collectives",
                (long long)tp_comm_debug_total(dbg));
    tp_comm_debug_free(dbg);
    tp_tensor_release(fb);
    tp_tensor_release(ff);
    tp_tensor_release(db);
    tp_tensor_release(df);
    tp_mesh_free(mesh);
    return TP_OK;
}

Test(ops_dtype, mixed_dtensors_fail_before_communicating, .timeout = 30)
{
    static mix_ctx c;
    memset(&c, 0, sizeof c);
    tp_test_run(3, mix_body, &c, c.slot);
}

/* ---- the partial-reduce setting ------------------------------------------------ */

/* Three ranks' Partial(sum) terms 1, u, u with u half a unit in the last place
 * of 1 in the dtype: the exact sum 1 + 2u is representable; adding in the
 * dtype step by step gives 1 (each 1 + u is a tie rounded to even). */
typedef struct {
    tp_dtype dt;
    bool f32;
    int64_t counts[2][NKINDS]; /* rank 0's, to R and to S(0) */
    int64_t bytes[2];
    double got[2][6];
    tp_test_slot slot[TP_TEST_MAX_RANKS];
} pr_ctx;

static tp_status pr_body(tp_comm *w, void *arg)
{
    pr_ctx *c = arg;
    int rank = tp_comm_rank(w);
    tp_test_slot *s = &c->slot[rank];
    tp_mesh *mesh = NULL;
    int64_t ms = tp_comm_size(w), n = 6;
    RANK_OK(s, tp_mesh_create(w, 1, &ms, NULL, &mesh));
    const double u = c->dt == TP_BF16 ? 0x1p-8 : 0x1p-11;
    tp_tensor *l32 = NULL, *local = NULL, *p = NULL;
    RANK_OK(s, tp_tensor_zeros(TP_F32, TP_CPU, 1, &n, &l32));
    RANK_OK(s, tp_tensor_fill(l32, rank == 0 ? 1.0 : u));
    RANK_OK(s, tp_tensor_to(l32, c->dt, TP_CPU, &local));
    tp_placement P = tp_partial(TP_SUM), to[2] = {tp_replicate(), tp_shard(0)};
    RANK_OK(s, tp_dtensor_from_local(mesh, local, 1, &P, NULL, &p));
    for (int k = 0; k < 2; k++) {
        tp_tensor *out = NULL, *full = NULL, *f = NULL;
        tp_comm_debug *dbg = NULL;
        RANK_OK(s, tp_comm_debug_create(&dbg));
        RANK_OK(s, tp_comm_debug_begin(dbg));
        tp_status st = tp_dtensor_redistribute(p, 1, &to[k], &out);
        tp_comm_debug_end(dbg);
        for (int q = 0; q < NKINDS && rank == 0; q++)
            c->counts[k][q] = tp_comm_debug_count(dbg, (tp_coll_kind)q);
        if (rank == 0)
            c->bytes[k] = tp_comm_debug_bytes(dbg, TP_COLL_ANY);
        tp_comm_debug_free(dbg);
        RANK_OK(s, st);
        RANK_EXPECT(s, tp_tensor_dtype(out) == c->dt, "the reduced tensor is %s",
                    tp_dtype_name(tp_tensor_dtype(out)));
        RANK_OK(s, tp_dtensor_full_tensor(out, &full));
        RANK_OK(s, tp_tensor_to(full, TP_F32, TP_CPU, &f));
        for (int64_t i = 0; i < n && rank == 0; i++)
            c->got[k][i] = ((const float *)tp_tensor_data(f))[i];
        tp_tensor_release(out);
        tp_tensor_release(full);
        tp_tensor_release(f);
    }
    tp_tensor_release(l32);
    tp_tensor_release(local);
    tp_tensor_release(p);
    tp_mesh_free(mesh);
    return TP_OK;
}

/* The value of (1 + u) + u rounded to dt at every step. */
static double stepwise(tp_dtype dt, double u)
{
    double v = 1.0;
    for (int k = 0; k < 2; k++) {
        tp_tensor *t = NULL, *h = NULL, *b = NULL;
        cr_assert_eq(tp_tensor_zeros(TP_F64, TP_CPU, 0, NULL, &t), TP_OK);
        cr_assert_eq(tp_tensor_fill(t, v + u), TP_OK);
        cr_assert_eq(tp_tensor_to(t, dt, TP_CPU, &h), TP_OK);
        cr_assert_eq(tp_tensor_to(h, TP_F64, TP_CPU, &b), TP_OK);
        v = *(const double *)tp_tensor_data(b);
        tp_tensor_release(t);
        tp_tensor_release(h);
        tp_tensor_release(b);
    }
    return v;
}

static void check_partial_reduce(tp_dtype dt)
{
    static pr_ctx c[2];
    const double u = dt == TP_BF16 ? 0x1p-8 : 0x1p-11, exact = 1.0 + 2 * u;
    /* the values tell the two apart: step by step in the dtype gives 1 */
    cr_assert_eq(stepwise(dt, u), 1.0);
    cr_assert(!tp_partial_reduce_f32(), "the setting defaults to false");
    for (int on = 0; on < 2; on++) {
        memset(&c[on], 0, sizeof c[on]);
        c[on].dt = dt;
        tp_set_partial_reduce_f32(on != 0);
        cr_assert_eq(tp_partial_reduce_f32(), on != 0);
        tp_test_run(3, pr_body, &c[on], c[on].slot);
        tp_set_partial_reduce_f32(false);
    }
    for (int k = 0; k < 2; k++) {
        /* on: reduced in f32, rounded once; off: the shm backend also
         * accumulates halves in f32 and rounds once (NCCL/MPI may not) */
        for (int on = 0; on < 2; on++)
            for (int i = 0; i < 6; i++)
                cr_assert_eq(c[on].got[k][i], exact,
                             "%s, %s, setting %s: element %d = %.9g, "
                             "expected %.9g",
                             tp_dtype_name(dt), k ? "P -> S(0)" : "P -> R", on ? "on" : "off", i,
                             c[on].got[k][i], exact);
        for (int q = 0; q < NKINDS; q++)
            cr_assert_eq(c[1].counts[k][q], c[0].counts[k][q],
                         "%s: %lld with the setting on, %lld off",
                         tp_coll_kind_name((tp_coll_kind)q), (long long)c[1].counts[k][q],
                         (long long)c[0].counts[k][q]);
    }
    cr_assert_eq(c[1].counts[0][TP_COLL_ALL_REDUCE], 1);
    /* with the setting on the collective carries f32: twice the bytes */
    for (int k = 0; k < 2; k++)
        cr_assert(c[0].bytes[k] > 0 && c[1].bytes[k] == 2 * c[0].bytes[k],
                  "%s: %lld bytes with the setting on, %lld off", k ? "P -> S(0)" : "P -> R",
                  (long long)c[1].bytes[k], (long long)c[0].bytes[k]);
    cr_assert_eq(c[1].counts[1][TP_COLL_REDUCE_SCATTER], 1);
}

Test(ops_dtype, partial_reduce_f32_bf16, .timeout = 30)
{
    check_partial_reduce(TP_BF16);
}

Test(ops_dtype, partial_reduce_f32_f16, .timeout = 30)
{
    check_partial_reduce(TP_F16);
}

/* ---- allocation failures ------------------------------------------------------- */

static tp_test_alloc A;

/* layer_norm -> gelu -> cross_entropy (mean: the f32 rows path) and the
 * backward, in dt */
static tp_status alloc_seq(tp_tensor *x, tp_tensor *w, tp_tensor *b, tp_tensor *t)
{
    tp_tensor *h = NULL, *a = NULL, *loss = NULL;
    tp_status st = tp_layer_norm(x, w, b, 1e-5, &h);
    if (st == TP_OK)
        st = tp_gelu(h, TP_GELU_TANH, &a);
    if (st == TP_OK)
        st = tp_cross_entropy(a, t, NULL, &loss);
    if (st == TP_OK)
        st = tp_backward(loss, NULL);
    tp_tensor_release(h);
    tp_tensor_release(a);
    tp_tensor_release(loss);
    return st;
}

static void check_alloc_failures(tp_dtype dt)
{
    A = (tp_test_alloc){0, 0, -1};
    tp_allocator al = {tp_test_alloc_fn, tp_test_free_fn, &A};
    cr_assert_eq(tp_set_allocator(&al), TP_OK);
    const int64_t xs[2] = {6, 10}, ws[1] = {10}, ts[1] = {6};
    tp_tensor *x = filled(dt, 2, xs), *w = filled(dt, 1, ws), *b = filled(dt, 1, ws), *t = NULL;
    CHECK_OK(tp_tensor_zeros(TP_I64, TP_CPU, 1, ts, &t));
    CHECK_OK(tp_tensor_fill(t, 3));
    tp_tensor *leaves[3] = {x, w, b};
    for (int i = 0; i < 3; i++)
        CHECK_OK(tp_tensor_set_requires_grad(leaves[i], true));
    const long base = A.live;
    bool done = false;
    for (long k = 0; k < 400 && !done; k++) {
        A.count = 0;
        A.fail_at = k;
        tp_status st = alloc_seq(x, w, b, t);
        A.fail_at = -1;
        done = st == TP_OK;
        cr_assert(st == TP_OK || st == TP_ERR_NO_MEMORY, "%s, allocation %ld failing: %s (%s)",
                  tp_dtype_name(dt), k, tp_status_name(st), tp_last_error());
        for (int i = 0; i < 3; i++) {
            if (done)
                cr_assert(tp_tensor_grad(leaves[i]) &&
                              tp_tensor_dtype(tp_tensor_grad(leaves[i])) == dt,
                          "input %d's gradient", i);
            tp_tensor_zero_grad(leaves[i]);
        }
        cr_assert_eq(A.live, base, "%s, allocation %ld failing: %ld blocks leaked",
                     tp_dtype_name(dt), k, A.live - base);
    }
    cr_assert(done, "the sequence never succeeded");
    for (int i = 0; i < 3; i++)
        tp_tensor_release(leaves[i]);
    tp_tensor_release(t);
    cr_assert_eq(A.live, 0);
    tp_set_allocator(NULL);
}

Test(ops_dtype, allocation_failures_bf16, .timeout = 60)
{
    check_alloc_failures(TP_BF16);
}

Test(ops_dtype, allocation_failures_f16, .timeout = 60)
{
    check_alloc_failures(TP_F16);
}
