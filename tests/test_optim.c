/*
 * Optimizers and what a training loop needs beside them: SGD with momentum,
 * dampening, Nesterov and weight decay, Adam with L2 and decoupled (AdamW)
 * weight decay, each against an f64 implementation of torch.optim's
 * single-tensor update written here; tp_clip_grad_norm (norm 2 and inf)
 * against the unsharded model's norm in f64, with sharded, replicated and
 * Partial gradients on 1-D and 2-D meshes and its all_reduces counted; the
 * warm-up + cosine schedule against its closed form; bad input.
 */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <math.h>

#include "tp_test.h"
#include "tp_test_dtensor.h"

/* ---- a module holding given parameters ---------------------------------------- */

static tp_status forward_none(tp_module *m, int nargs, tp_tensor *const *args, int nkw,
                              const tp_kwarg *kw, tp_tensor **out)
{
    (void)m, (void)nargs, (void)args, (void)nkw, (void)kw, (void)out;
    return TP_ERR_NOT_SUPPORTED;
}

/* A custom module with parameters p0, p1, ... (references taken). */
static tp_status module_of(int n, tp_tensor **params, tp_module **out)
{
    TP_TEST_TRY(tp_nn_custom_create("holder", forward_none, NULL, NULL, out));
    for (int i = 0; i < n; i++) {
        char name[16];
        snprintf(name, sizeof name, "p%d", i);
        tp_status st = tp_module_register_parameter(*out, name, params[i]);
        if (st != TP_OK) {
            tp_module_free(*out);
            *out = NULL;
            return st;
        }
    }
    return TP_OK;
}

/* ---- single-process optimizer steps vs f64 ------------------------------------ */

#define NP 2
#define STEPS 6
static const int64_t pshape[NP][2] = {{3, 4}, {5, 1}};

static int64_t pnumel(int i)
{
    return pshape[i][0] * pshape[i][1];
}

static float init_value(int i, int64_t j)
{
    return (float)(0.8 * cos(0.3 * (double)j + (double)i));
}

static float grad_value(int i, int64_t j, int step)
{
    return (float)(0.5 * sin(0.7 * (double)j + 1.3 * step + (double)i) + 0.05 * step);
}

typedef struct {
    double p[NP][32], buf[NP][32], m[NP][32], v[NP][32];
} ref_state;

static void ref_init(ref_state *r)
{
    memset(r, 0, sizeof *r);
    for (int i = 0; i < NP; i++)
        for (int64_t j = 0; j < pnumel(i); j++)
            r->p[i][j] = init_value(i, j);
}

/* torch.optim.SGD, in f64 */
static void ref_sgd(ref_state *r, const tp_sgd_options *o, double lr, int step)
{
    for (int i = 0; i < NP; i++)
        for (int64_t j = 0; j < pnumel(i); j++) {
            double d = grad_value(i, j, step) + o->weight_decay * r->p[i][j];
            if (o->momentum != 0) {
                double *b = &r->buf[i][j];
                *b = step == 0 ? d : o->momentum * *b + (1 - o->dampening) * d;
                d = o->nesterov ? d + o->momentum * *b : *b;
            }
            r->p[i][j] -= lr * d;
        }
}

/* torch.optim.Adam / AdamW, in f64 */
static void ref_adam(ref_state *r, const tp_adam_options *o, int step)
{
    double b1 = o->beta1, b2 = o->beta2, lr = o->lr, wd = o->weight_decay;
    double bc1 = 1 - pow(b1, step + 1), bc2 = 1 - pow(b2, step + 1);
    for (int i = 0; i < NP; i++)
        for (int64_t j = 0; j < pnumel(i); j++) {
            double *p = &r->p[i][j], g = grad_value(i, j, step);
            if (o->decoupled)
                *p *= 1 - lr * wd;
            else
                g += wd * *p;
            r->m[i][j] = b1 * r->m[i][j] + (1 - b1) * g;
            r->v[i][j] = b2 * r->v[i][j] + (1 - b2) * g * g;
            *p -= lr / bc1 * r->m[i][j] / (sqrt(r->v[i][j]) / sqrt(bc2) + o->eps);
        }
}

static void make_params(tp_tensor **p, tp_module **m)
{
    for (int i = 0; i < NP; i++) {
        CHECK_OK(tp_tensor_zeros(TP_F32, TP_CPU, 2, pshape[i], &p[i]));
        float *d = tp_tensor_data(p[i]);
        for (int64_t j = 0; j < pnumel(i); j++)
            d[j] = init_value(i, j);
    }
    CHECK_OK(module_of(NP, p, m));
}

static void set_grads(tp_tensor **p, int step)
{
    for (int i = 0; i < NP; i++) {
        tp_tensor *g = NULL;
        CHECK_OK(tp_tensor_zeros(TP_F32, TP_CPU, 2, pshape[i], &g));
        float *d = tp_tensor_data(g);
        for (int64_t j = 0; j < pnumel(i); j++)
            d[j] = grad_value(i, j, step);
        CHECK_OK(tp_tensor_set_grad(p[i], g));
        tp_tensor_release(g);
    }
}

static void expect_params(tp_tensor **p, const ref_state *r, double tol, const char *what, int step)
{
    for (int i = 0; i < NP; i++) {
        const float *d = tp_tensor_data(p[i]);
        for (int64_t j = 0; j < pnumel(i); j++)
            cr_assert(fabs(d[j] - r->p[i][j]) <= tol * (1 + fabs(r->p[i][j])),
                      "%s, step %d: p%d[%lld] = %.9g, reference %.9g", what, step, i, (long long)j,
                      d[j], r->p[i][j]);
    }
}

static void release_params(tp_tensor **p, tp_module *m)
{
    tp_module_free(m);
    for (int i = 0; i < NP; i++)
        tp_tensor_release(p[i]);
}

/* SGD over STEPS steps; with a schedule, the rate of each step comes from
 * tp_lr_warmup_cosine (the reference uses the closed form). */
static void run_sgd(const tp_sgd_options *o, bool schedule, const char *what)
{
    tp_tensor *p[NP];
    tp_module *m = NULL;
    tp_sgd *opt = NULL;
    ref_state r;
    make_params(p, &m);
    ref_init(&r);
    CHECK_OK(tp_sgd_create_with(m, o, &opt));
    for (int step = 0; step < STEPS; step++) {
        double lr = o->lr;
        if (schedule) {
            CHECK_OK(tp_lr_warmup_cosine(step, 2, STEPS, o->lr, 0.01, &lr));
            double want =
                step < 2 ? o->lr * step / 2.0
                         : 0.01 + (o->lr - 0.01) * 0.5 *
                                      (1 + cos(3.14159265358979323846 * (step - 2) / (STEPS - 2)));
            cr_assert(fabs(lr - want) <= 1e-15, "schedule at %d: %.17g, want %.17g", step, lr,
                      want);
            CHECK_OK(tp_sgd_set_lr(opt, lr));
            cr_assert_eq(tp_sgd_lr(opt), lr);
        }
        set_grads(p, step);
        CHECK_OK(tp_sgd_opt_step(opt));
        ref_sgd(&r, o, lr, step);
        expect_params(p, &r, 2e-6, what, step);
    }
    tp_sgd_free(opt);
    release_params(p, m);
}

Test(optim, sgd_momentum, .timeout = 30)
{
    run_sgd(&(tp_sgd_options){.lr = 0.1, .momentum = 0.9}, false, "momentum 0.9");
}

Test(optim, sgd_momentum_dampening_weight_decay, .timeout = 30)
{
    run_sgd(&(tp_sgd_options){.lr = 0.05, .momentum = 0.8, .dampening = 0.3, .weight_decay = 0.01},
            false, "momentum, dampening, weight decay");
}

Test(optim, sgd_nesterov_weight_decay_scheduled, .timeout = 30)
{
    run_sgd(&(tp_sgd_options){.lr = 0.1, .momentum = 0.9, .weight_decay = 0.05, .nesterov = true},
            true, "nesterov, weight decay, warm-up + cosine");
}

Test(optim, sgd_weight_decay_only, .timeout = 30)
{
    run_sgd(&(tp_sgd_options){.lr = 0.2, .weight_decay = 0.1}, false, "weight decay");
}

/* The old constructor is plain SGD: the same as momentum 0. */
Test(optim, sgd_create_is_plain, .timeout = 30)
{
    tp_tensor *p[NP];
    tp_module *m = NULL;
    tp_sgd *opt = NULL;
    ref_state r;
    make_params(p, &m);
    ref_init(&r);
    CHECK_OK(tp_sgd_create(m, 0.3, &opt));
    cr_assert_eq(tp_sgd_lr(opt), 0.3);
    for (int step = 0; step < 3; step++) {
        set_grads(p, step);
        CHECK_OK(tp_sgd_opt_step(opt));
        ref_sgd(&r, &(tp_sgd_options){.lr = 0.3}, 0.3, step);
        expect_params(p, &r, 2e-6, "tp_sgd_create", step);
    }
    tp_sgd_free(opt);
    release_params(p, m);
}

/* bf16 round to nearest even, as the library stores */
static float bf16_round(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&x, &u, sizeof x);
    return x;
}

/* bf16 parameters and gradients: the f32 master (from the bf16 values)
 * carries the momentum update; each step writes the parameter rounded once,
 * within half a bf16 ulp of the f64 reference started from the same
 * rounded values and fed the rounded gradients. */
Test(optim, sgd_momentum_bf16_master, .timeout = 30)
{
    tp_tensor *p32[NP], *p[NP];
    tp_module *m = NULL;
    tp_sgd *opt = NULL;
    ref_state r;
    tp_sgd_options o = {.lr = 0.05, .momentum = 0.9, .weight_decay = 0.01, .nesterov = true};
    make_params(p32, &m);
    tp_module_free(m);
    memset(&r, 0, sizeof r);
    for (int i = 0; i < NP; i++) {
        CHECK_OK(tp_tensor_to(p32[i], TP_BF16, TP_CPU, &p[i]));
        CHECK_OK(tp_tensor_set_requires_grad(p[i], true));
        for (int64_t j = 0; j < pnumel(i); j++)
            r.p[i][j] = bf16_round(init_value(i, j));
        tp_tensor_release(p32[i]);
    }
    CHECK_OK(module_of(NP, p, &m));
    CHECK_OK(tp_sgd_create_with(m, &o, &opt));
    for (int step = 0; step < STEPS; step++) {
        for (int i = 0; i < NP; i++) {
            tp_tensor *g = NULL, *gb = NULL;
            CHECK_OK(tp_tensor_zeros(TP_F32, TP_CPU, 2, pshape[i], &g));
            for (int64_t j = 0; j < pnumel(i); j++)
                ((float *)tp_tensor_data(g))[j] = grad_value(i, j, step);
            CHECK_OK(tp_tensor_to(g, TP_BF16, TP_CPU, &gb));
            CHECK_OK(tp_tensor_set_grad(p[i], gb));
            tp_tensor_release(g);
            tp_tensor_release(gb);
        }
        CHECK_OK(tp_sgd_opt_step(opt));
        for (int i = 0; i < NP; i++)
            for (int64_t j = 0; j < pnumel(i); j++) {
                double d = bf16_round(grad_value(i, j, step)) + o.weight_decay * r.p[i][j];
                double *b = &r.buf[i][j];
                *b = step == 0 ? d : o.momentum * *b + d;
                r.p[i][j] -= o.lr * (d + o.momentum * *b);
            }
        for (int i = 0; i < NP; i++) {
            tp_tensor *f = NULL;
            CHECK_OK(tp_tensor_to(p[i], TP_F32, TP_CPU, &f));
            for (int64_t j = 0; j < pnumel(i); j++) {
                double got = ((const float *)tp_tensor_data(f))[j], want = r.p[i][j];
                cr_assert(fabs(got - want) <= fabs(want) / 256 + 1e-6,
                          "step %d: p%d[%lld] = %.9g, reference %.9g", step, i, (long long)j, got,
                          want);
            }
            tp_tensor_release(f);
        }
    }
    tp_sgd_free(opt);
    release_params(p, m);
}

static void run_adam(const tp_adam_options *o, const char *what)
{
    tp_tensor *p[NP];
    tp_module *m = NULL;
    tp_adam *opt = NULL;
    ref_state r;
    make_params(p, &m);
    ref_init(&r);
    CHECK_OK(tp_adam_create_with(m, o, &opt));
    cr_assert_eq(tp_adam_lr(opt), o->lr);
    for (int step = 0; step < STEPS; step++) {
        set_grads(p, step);
        CHECK_OK(tp_adam_step(opt));
        ref_adam(&r, o, step);
        expect_params(p, &r, 5e-6, what, step);
    }
    tp_adam_free(opt);
    release_params(p, m);
}

Test(optim, adamw, .timeout = 30)
{
    run_adam(&(tp_adam_options){.lr = 0.01,
                                .beta1 = 0.9,
                                .beta2 = 0.999,
                                .eps = 1e-8,
                                .weight_decay = 0.1,
                                .decoupled = true},
             "AdamW");
}

Test(optim, adamw_strong_decay, .timeout = 30)
{
    run_adam(&(tp_adam_options){.lr = 0.1,
                                .beta1 = 0.8,
                                .beta2 = 0.95,
                                .eps = 1e-6,
                                .weight_decay = 0.5,
                                .decoupled = true},
             "AdamW, strong decay");
}

Test(optim, adam_l2_weight_decay, .timeout = 30)
{
    run_adam(
        &(tp_adam_options){
            .lr = 0.01, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.1},
        "Adam, L2 weight decay");
}

/* Zero options are torch's Adam defaults; the rate can change between steps. */
Test(optim, adam_defaults_and_set_lr, .timeout = 30)
{
    tp_tensor *p[NP];
    tp_module *m = NULL;
    tp_adam *opt = NULL;
    ref_state r;
    make_params(p, &m);
    ref_init(&r);
    CHECK_OK(tp_adam_create_with(m, NULL, &opt));
    cr_assert_eq(tp_adam_lr(opt), 1e-3);
    tp_adam_options o = {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8};
    for (int step = 0; step < 4; step++) {
        if (step == 2) {
            CHECK_OK(tp_adam_set_lr(opt, 0.05));
            o.lr = 0.05;
        }
        set_grads(p, step);
        CHECK_OK(tp_adam_step(opt));
        ref_adam(&r, &o, step);
        expect_params(p, &r, 5e-6, "Adam defaults", step);
    }
    tp_adam_free(opt);
    release_params(p, m);
}

/* ---- schedule ------------------------------------------------------------------ */

Test(optim, warmup_cosine_values, .timeout = 30)
{
    const double pi = 3.14159265358979323846, base = 3e-4, lo = 3e-5;
    double lr = 0;
    for (int64_t s = 0; s <= 120; s++) {
        CHECK_OK(tp_lr_warmup_cosine(s, 10, 110, base, lo, &lr));
        double want = s < 10     ? base * (double)s / 10
                      : s >= 110 ? lo
                                 : lo + (base - lo) * 0.5 * (1 + cos(pi * (double)(s - 10) / 100));
        cr_assert(fabs(lr - want) <= 1e-18, "step %lld: %.17g, want %.17g", (long long)s, lr, want);
    }
    /* the landmarks: 0 at 0, the peak right after warm-up, half way, the floor */
    CHECK_OK(tp_lr_warmup_cosine(0, 10, 110, base, lo, &lr));
    cr_assert_eq(lr, 0.0);
    CHECK_OK(tp_lr_warmup_cosine(10, 10, 110, base, lo, &lr));
    cr_assert_eq(lr, base);
    CHECK_OK(tp_lr_warmup_cosine(60, 10, 110, base, lo, &lr));
    cr_assert(fabs(lr - (base + lo) / 2) < 1e-18);
    CHECK_OK(tp_lr_warmup_cosine(110, 10, 110, base, lo, &lr));
    cr_assert_eq(lr, lo);
    /* no warm-up: the cosine from base_lr at step 0 */
    CHECK_OK(tp_lr_warmup_cosine(0, 0, 50, base, 0, &lr));
    cr_assert_eq(lr, base);
    /* warm-up over the whole run: min_lr at total */
    CHECK_OK(tp_lr_warmup_cosine(5, 10, 10, base, lo, &lr));
    cr_assert_eq(lr, base * 0.5);
    CHECK_OK(tp_lr_warmup_cosine(10, 10, 10, base, lo, &lr));
    cr_assert_eq(lr, lo);
}

Test(optim, warmup_cosine_bad_input, .timeout = 30)
{
    double lr = 0;
    CHECK_ERR(tp_lr_warmup_cosine(0, 1, 10, 1, 0, NULL), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_lr_warmup_cosine(-1, 1, 10, 1, 0, &lr), TP_ERR_INVALID_ARG);
    cr_assert(isnan(lr));
    CHECK_ERR(tp_lr_warmup_cosine(0, -1, 10, 1, 0, &lr), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_lr_warmup_cosine(0, 11, 10, 1, 0, &lr), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_lr_warmup_cosine(0, 1, 10, -1, 0, &lr), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_lr_warmup_cosine(0, 1, 10, NAN, 0, &lr), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_lr_warmup_cosine(0, 1, 10, 1, 2, &lr), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_lr_warmup_cosine(0, 1, 10, 1, -0.5, &lr), TP_ERR_INVALID_ARG);
}

/* ---- bad input -------------------------------------------------------------- */

Test(optim, optimizer_bad_input, .timeout = 30)
{
    tp_tensor *p[NP];
    tp_module *m = NULL;
    make_params(p, &m);
    tp_sgd *s = (tp_sgd *)1;
    tp_adam *a = (tp_adam *)1;
    CHECK_ERR(tp_sgd_create_with(m, NULL, NULL), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_sgd_create_with(NULL, NULL, &s), TP_ERR_INVALID_ARG);
    cr_assert_null(s);
    CHECK_ERR(tp_sgd_create_with(m, &(tp_sgd_options){.lr = -1}, &s), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_sgd_create_with(m, &(tp_sgd_options){.lr = NAN}, &s), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_sgd_create_with(m, &(tp_sgd_options){.lr = 1, .momentum = -0.1}, &s),
              TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_sgd_create_with(m, &(tp_sgd_options){.lr = 1, .weight_decay = -1}, &s),
              TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_sgd_create_with(m, &(tp_sgd_options){.lr = 1, .dampening = INFINITY}, &s),
              TP_ERR_INVALID_ARG);
    /* torch: Nesterov momentum requires a momentum and zero dampening */
    CHECK_ERR(tp_sgd_create_with(m, &(tp_sgd_options){.lr = 1, .nesterov = true}, &s),
              TP_ERR_INVALID_ARG);
    CHECK_ERR(
        tp_sgd_create_with(
            m, &(tp_sgd_options){.lr = 1, .momentum = 0.9, .dampening = 0.1, .nesterov = true}, &s),
        TP_ERR_INVALID_ARG);
    cr_assert_null(s);
    CHECK_ERR(tp_adam_create_with(NULL, NULL, &a), TP_ERR_INVALID_ARG);
    cr_assert_null(a);
    CHECK_ERR(tp_adam_create_with(m, NULL, NULL), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_adam_create_with(m, &(tp_adam_options){.lr = -1}, &a), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_adam_create_with(m, &(tp_adam_options){.beta1 = 1}, &a), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_adam_create_with(m, &(tp_adam_options){.beta2 = -0.5}, &a), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_adam_create_with(m, &(tp_adam_options){.eps = -1}, &a), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_adam_create_with(m, &(tp_adam_options){.weight_decay = -0.1}, &a),
              TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_adam_create_with(m, &(tp_adam_options){.weight_decay = NAN}, &a),
              TP_ERR_INVALID_ARG);
    cr_assert_null(a);

    CHECK_OK(tp_sgd_create_with(m, &(tp_sgd_options){.lr = 0.5}, &s));
    CHECK_OK(tp_adam_create_with(m, NULL, &a));
    CHECK_ERR(tp_sgd_set_lr(NULL, 1), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_sgd_set_lr(s, -1), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_sgd_set_lr(s, INFINITY), TP_ERR_INVALID_ARG);
    cr_assert_eq(tp_sgd_lr(s), 0.5); /* kept */
    CHECK_ERR(tp_adam_set_lr(NULL, 1), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_adam_set_lr(a, NAN), TP_ERR_INVALID_ARG);
    cr_assert_eq(tp_adam_lr(a), 1e-3);
    cr_assert(isnan(tp_sgd_lr(NULL)));
    cr_assert(isnan(tp_adam_lr(NULL)));
    tp_sgd_free(s);
    tp_adam_free(a);

    double tn = 0;
    CHECK_ERR(tp_clip_grad_norm(NULL, 1, 2, &tn), TP_ERR_INVALID_ARG);
    cr_assert(isnan(tn));
    CHECK_ERR(tp_clip_grad_norm(m, -1, 2, &tn), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_clip_grad_norm(m, NAN, 2, &tn), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_clip_grad_norm(m, 1, 1.5, &tn), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_clip_grad_norm(m, 1, -INFINITY, &tn), TP_ERR_INVALID_ARG);
    CHECK_ERR(tp_clip_grad_norm(m, 1, NAN, &tn), TP_ERR_INVALID_ARG);
    release_params(p, m);
}

/* ---- clipping, one process ----------------------------------------------------- */

/* Plain parameters: norm 2 and inf vs f64, the scaling, and no scaling when
 * the norm is under max_norm (gradients bit for bit unchanged). */
Test(optim, clip_plain, .timeout = 30)
{
    tp_tensor *p[NP];
    tp_module *m = NULL;
    make_params(p, &m);
    for (int inf = 0; inf < 2; inf++) {
        set_grads(p, 3);
        double want = 0;
        for (int i = 0; i < NP; i++)
            for (int64_t j = 0; j < pnumel(i); j++) {
                double g = grad_value(i, j, 3);
                want = inf ? fmax(want, fabs(g)) : want + g * g;
            }
        if (!inf)
            want = sqrt(want);
        double tn = 0;
        /* above the norm: nothing changes */
        CHECK_OK(tp_clip_grad_norm(m, want * 2, inf ? INFINITY : 2, &tn));
        cr_assert(fabs(tn - want) <= 1e-6 * want, "norm %d: %.9g, want %.9g", inf, tn, want);
        for (int i = 0; i < NP; i++)
            for (int64_t j = 0; j < pnumel(i); j++)
                cr_assert_eq(((const float *)tp_tensor_data(tp_tensor_grad(p[i])))[j],
                             grad_value(i, j, 3));
        /* a quarter of it: every gradient times max_norm / (total + 1e-6) */
        double mx = want / 4, coef = mx / (want + 1e-6);
        CHECK_OK(tp_clip_grad_norm(m, mx, inf ? INFINITY : 2, &tn));
        cr_assert(fabs(tn - want) <= 1e-6 * want);
        for (int i = 0; i < NP; i++)
            for (int64_t j = 0; j < pnumel(i); j++) {
                double got = ((const float *)tp_tensor_data(tp_tensor_grad(p[i])))[j];
                double w = grad_value(i, j, 3) * coef;
                cr_assert(fabs(got - w) <= 2e-7 * (1e-3 + fabs(w)),
                          "clip %d: g%d[%lld] %.9g, want %.9g", inf, i, (long long)j, got, w);
            }
        /* the clipped norm is max_norm (to the 1e-6) */
        CHECK_OK(tp_clip_grad_norm(m, want, inf ? INFINITY : 2, &tn));
        cr_assert(fabs(tn - mx) <= 1e-5 * mx, "clipped norm %.9g, want %.9g", tn, mx);
    }
    /* a parameter without gradient counts nothing; NULL total_norm is fine */
    tp_tensor_zero_grad(p[0]);
    CHECK_OK(tp_clip_grad_norm(m, 1e9, 2, NULL));
    release_params(p, m);
}

/* ---- clipping over meshes ------------------------------------------------------- */

#define MAXP 4

/* One distributed case: parameters with global shapes and placements, and
 * the placements of their gradients (Partial ones allowed). */
typedef struct {
    int n; /* world size */
    int mesh_nd;
    int64_t mesh_shape[2];
    int np;
    int64_t shape[MAXP][2];
    tp_placement ppl[MAXP][2]; /* parameter placements */
    tp_placement gpl[MAXP][2]; /* gradient placements */
    bool inf;
    int64_t want_all_reduce, want_reduce_scatter, want_total; /* counted in the clip */
    tp_test_slot slots[TP_TEST_MAX_RANKS];
} clip_case;

static tp_status clip_rank(tp_comm *world, void *arg)
{
    clip_case *c = arg;
    int rank = tp_comm_rank(world);
    tp_test_slot *s = &c->slots[rank];
    tp_mesh *mesh = NULL;
    tp_module *m = NULL;
    tp_comm_debug *dbg = NULL;
    tp_tensor *params[MAXP] = {0}, *gfull[MAXP] = {0};
    RANK_OK(s, tp_mesh_create(world, c->mesh_nd, c->mesh_shape, NULL, &mesh));
    double want = 0;
    for (int i = 0; i < c->np; i++) {
        tp_tensor *full = NULL, *g = NULL;
        RANK_OK(s, tp_test_global_tensor(2, c->shape[i], 100 + i, &full));
        RANK_OK(s, tp_dtensor_distribute(mesh, full, c->mesh_nd, c->ppl[i], -1, &params[i]));
        RANK_OK(s, tp_tensor_set_requires_grad(params[i], true));
        tp_tensor_release(full);
        /* the gradient may share the storage of the tensor it is made from
         * (scaled in place): the reference is a second copy */
        RANK_OK(s, tp_test_global_tensor(2, c->shape[i], 200 + i, &full));
        RANK_OK(s, tp_test_global_tensor(2, c->shape[i], 200 + i, &gfull[i]));
        RANK_OK(s, tp_test_make_dtensor(mesh, full, c->gpl[i], 300 + i, &g));
        tp_tensor_release(full);
        RANK_OK(s, tp_tensor_set_grad(params[i], g));
        tp_tensor_release(g);
        const float *v = tp_tensor_data(gfull[i]);
        for (int64_t j = 0; j < tp_tensor_numel(gfull[i]); j++)
            want = c->inf ? fmax(want, fabs(v[j])) : want + (double)v[j] * v[j];
    }
    if (!c->inf)
        want = sqrt(want);
    RANK_OK(s, module_of(c->np, params, &m));
    RANK_OK(s, tp_comm_debug_create(&dbg));
    double tn = 0, mx = want / 3, coef = mx / (want + 1e-6);
    RANK_OK(s, tp_comm_debug_begin(dbg));
    RANK_OK(s, tp_clip_grad_norm(m, mx, c->inf ? INFINITY : 2, &tn));
    RANK_OK(s, tp_comm_debug_end(dbg));
    /* integer gradients: the local sums are exact, the total too */
    RANK_EXPECT(s, fabs(tn - want) <= 1e-7 * want, "total norm %.12g, unsharded model %.12g", tn,
                want);
    int64_t ar = tp_comm_debug_count(dbg, TP_COLL_ALL_REDUCE);
    int64_t rs = tp_comm_debug_count(dbg, TP_COLL_REDUCE_SCATTER);
    int64_t tot = tp_comm_debug_total(dbg);
    RANK_EXPECT(s, ar == c->want_all_reduce && rs == c->want_reduce_scatter && tot == c->want_total,
                "collectives: %lld all_reduce, %lld reduce_scatter, %lld in all; expected %lld, "
                "%lld, %lld",
                (long long)ar, (long long)rs, (long long)tot, (long long)c->want_all_reduce,
                (long long)c->want_reduce_scatter, (long long)c->want_total);
    for (int i = 0; i < c->np; i++) {
        tp_tensor *full = NULL;
        RANK_OK(s, tp_dtensor_full_tensor(tp_tensor_grad(params[i]), &full));
        const float *got = tp_tensor_data(full), *g0 = tp_tensor_data(gfull[i]);
        for (int64_t j = 0; j < tp_tensor_numel(full); j++) {
            double w = g0[j] * coef;
            RANK_EXPECT(s, fabs(got[j] - w) <= 1e-6 * (1 + fabs(w)),
                        "p%d grad[%lld] = %.9g after clipping, want %.9g", i, (long long)j, got[j],
                        w);
        }
        tp_tensor_release(full);
    }
    tp_comm_debug_free(dbg);
    tp_module_free(m);
    for (int i = 0; i < c->np; i++) {
        tp_tensor_release(params[i]);
        tp_tensor_release(gfull[i]);
    }
    tp_mesh_free(mesh);
    return TP_OK;
}

ParameterizedTestParameters(optim, clip_tp_1d)
{
    static int sizes[] = {1, 2, 3, 4};
    return cr_make_param_array(int, sizes, 4);
}

/* A colwise + rowwise pair on a 1-D TP mesh: weights Shard(0) and Shard(1),
 * the first bias Shard(0), the second Replicate. One all_reduce (of the
 * sharded slot) when the mesh has more than one rank, none otherwise. */
ParameterizedTest(int *n, optim, clip_tp_1d, .timeout = 60)
{
    for (int inf = 0; inf < 2; inf++) {
        clip_case c = {.n = *n, .mesh_nd = 1, .mesh_shape = {*n}, .np = 4, .inf = inf};
        int64_t shapes[4][2] = {{8, 6}, {8, 1}, {6, 8}, {6, 1}};
        tp_placement pl[4] = {tp_shard(0), tp_shard(0), tp_shard(1), tp_replicate()};
        for (int i = 0; i < 4; i++) {
            memcpy(c.shape[i], shapes[i], sizeof shapes[i]);
            c.ppl[i][0] = c.gpl[i][0] = pl[i];
        }
        c.want_all_reduce = c.want_total = *n > 1;
        tp_test_run(*n, clip_rank, &c, c.slots);
    }
}

ParameterizedTestParameters(optim, clip_dp_tp_2d)
{
    static int sizes[] = {1, 2, 3, 4};
    return cr_make_param_array(int, sizes, 4);
}

/* A dp x tp mesh (1x1, 2x1, 1x3, 2x2): gradients Replicate on dp and Shard
 * or Replicate on tp need one all_reduce on tp (when tp > 1); a parameter
 * sharded on both dims adds one on dp (when dp > 1). */
ParameterizedTest(int *n, optim, clip_dp_tp_2d, .timeout = 60)
{
    int64_t dp = *n % 2 == 0 ? 2 : 1, tp = *n / dp;
    for (int both = 0; both < 2; both++)
        for (int inf = 0; inf < 2; inf++) {
            clip_case c = {
                .n = *n, .mesh_nd = 2, .mesh_shape = {dp, tp}, .np = 3 + both, .inf = inf};
            int64_t shapes[4][2] = {{8, 6}, {6, 8}, {6, 1}, {4, 6}};
            tp_placement pl[4][2] = {{tp_replicate(), tp_shard(0)},
                                     {tp_replicate(), tp_shard(1)},
                                     {tp_replicate(), tp_replicate()},
                                     {tp_shard(0), tp_shard(1)}};
            for (int i = 0; i < c.np; i++) {
                memcpy(c.shape[i], shapes[i], sizeof shapes[i]);
                memcpy(c.ppl[i], pl[i], sizeof pl[i]);
                memcpy(c.gpl[i], pl[i], sizeof pl[i]);
            }
            c.want_all_reduce = (tp > 1) + (both && dp > 1);
            c.want_total = c.want_all_reduce;
            tp_test_run(*n, clip_rank, &c, c.slots);
        }
}

ParameterizedTestParameters(optim, clip_partial)
{
    static int sizes[] = {1, 2, 3, 4};
    return cr_make_param_array(int, sizes, 4);
}

/* Partial(sum) gradients: reduced to the parameter's placements for the
 * norm (a Replicate parameter: one all_reduce; a Shard one: one
 * reduce_scatter, then the norm's all_reduce), their local terms scaled. */
ParameterizedTest(int *n, optim, clip_partial, .timeout = 60)
{
    for (int inf = 0; inf < 2; inf++) {
        clip_case c = {.n = *n, .mesh_nd = 1, .mesh_shape = {*n}, .np = 2, .inf = inf};
        int64_t shapes[2][2] = {{5, 3}, {8, 4}};
        tp_placement pl[2] = {tp_replicate(), tp_shard(0)};
        for (int i = 0; i < 2; i++) {
            memcpy(c.shape[i], shapes[i], sizeof shapes[i]);
            c.ppl[i][0] = pl[i];
            c.gpl[i][0] = tp_partial(TP_SUM);
        }
        c.want_all_reduce = *n > 1 ? 2 : 0;
        c.want_reduce_scatter = *n > 1;
        c.want_total = c.want_all_reduce + c.want_reduce_scatter;
        tp_test_run(*n, clip_rank, &c, c.slots);
    }
}

/* ---- allocation failures ------------------------------------------------------- */

/* Two steps of an optimizer (0: SGD with Nesterov momentum and weight decay,
 * 1: AdamW, 2: Adam with L2 decay), each after clipping (norm 2, then inf);
 * everything freed whatever fails. Returns the first failure. */
static tp_status train_sequence(int which)
{
    tp_tensor *p[NP] = {0};
    tp_module *m = NULL;
    tp_sgd *sgd = NULL;
    tp_adam *adam = NULL;
    tp_status st = TP_OK;
    for (int i = 0; i < NP && st == TP_OK; i++) {
        st = tp_tensor_zeros(TP_F32, TP_CPU, 2, pshape[i], &p[i]);
        if (st == TP_OK)
            st = tp_tensor_fill(p[i], 0.5);
        if (st == TP_OK)
            st = tp_tensor_set_requires_grad(p[i], true);
    }
    if (st == TP_OK)
        st = module_of(NP, p, &m);
    if (st == TP_OK && which == 0)
        st = tp_sgd_create_with(
            m, &(tp_sgd_options){.lr = 0.1, .momentum = 0.9, .weight_decay = 0.1, .nesterov = true},
            &sgd);
    if (st == TP_OK && which > 0)
        st = tp_adam_create_with(
            m, &(tp_adam_options){.lr = 0.01, .weight_decay = 0.1, .decoupled = which == 1}, &adam);
    for (int step = 0; step < 2 && st == TP_OK; step++) {
        for (int i = 0; i < NP && st == TP_OK; i++) {
            tp_tensor *g = NULL;
            st = tp_tensor_zeros(TP_F32, TP_CPU, 2, pshape[i], &g);
            if (st == TP_OK)
                st = tp_tensor_fill(g, 1.0 + step);
            if (st == TP_OK)
                st = tp_tensor_set_grad(p[i], g);
            tp_tensor_release(g);
        }
        double tn = 0;
        if (st == TP_OK)
            st = tp_clip_grad_norm(m, 1.0, step ? INFINITY : 2, &tn);
        if (st == TP_OK)
            st = sgd ? tp_sgd_opt_step(sgd) : tp_adam_step(adam);
    }
    tp_sgd_free(sgd);
    tp_adam_free(adam);
    tp_module_free(m);
    for (int i = 0; i < NP; i++)
        tp_tensor_release(p[i]);
    return st;
}

/* Allocation k fails, for k = 0, 1, ... until the sequence succeeds: each
 * failing run is TP_ERR_NO_MEMORY and leaks nothing. */
Test(optim, allocation_failures, .timeout = 120)
{
    for (int which = 0; which < 3; which++) {
        tp_test_alloc a = {0, 0, -1};
        cr_assert_eq(tp_set_allocator(&(tp_allocator){tp_test_alloc_fn, tp_test_free_fn, &a}),
                     TP_OK);
        bool done = false;
        for (long k = 0; k < 100000 && !done; k++) {
            a.count = 0;
            a.fail_at = k;
            tp_clear_error();
            tp_status st = train_sequence(which);
            long tried = a.count;
            a.fail_at = -1;
            cr_assert(st == TP_OK || st == TP_ERR_NO_MEMORY,
                      "case %d, allocation %ld failing: %s (%s)", which, k, tp_status_name(st),
                      tp_last_error());
            cr_assert(st != TP_OK || tried <= k, "case %d succeeded although allocation %ld failed",
                      which, k);
            cr_assert_eq(a.live, 0, "case %d, allocation %ld failing: %ld blocks leaked", which, k,
                         a.live);
            done = st == TP_OK;
        }
        tp_set_allocator(NULL);
        cr_assert(done, "case %d never succeeded", which);
    }
}
