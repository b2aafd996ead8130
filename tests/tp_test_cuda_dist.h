/*
 * tp_test_cuda_dist.h - one distributed program, run twice: on the CPU (the
 * reference) and with every rank on TP_CUDA(0) through the shm backend.
 *
 * A program is written once against `dist_io`: it builds its inputs on the
 * CPU from seeds, moves them to io->dev in io->dtype, runs, and hands every
 * result it wants compared to dist_keep() (a CPU copy is taken; a DTensor
 * gives its local shard) with the tolerance docs/API.md states for it
 * ("CUDA against CPU"). dist_compare() runs the program on the CPU, checks
 * its ranks' slots, skips ("no CUDA device: ...") without a GPU, runs it on
 * CUDA and requires the same outputs within the kept tolerances and the same
 * comm-debug counts per phase and kind on every rank. So without a GPU the
 * program itself still runs and is checked on the CPU.
 */
#ifndef TP_TEST_CUDA_DIST_H
#define TP_TEST_CUDA_DIST_H

#include <math.h>

#include "tp_test.h"

/* |cuda - cpu| <= atol + rtol |cpu| elementwise; {0, 0}: bit-identical. */
typedef struct dist_tol {
    double rtol, atol;
} dist_tol;

static const dist_tol DIST_EXACT = {0, 0};

/* Half an ulp relative (the dtype's rounding); 0 for integer dtypes. */
static inline double dist_eps(tp_dtype d)
{
    switch (d) {
    case TP_BF16:
        return 0x1p-8;
    case TP_F16:
        return 0x1p-11;
    case TP_F32:
        return 0x1p-24;
    case TP_F64:
        return 0x1p-53;
    default:
        return 0;
    }
}

/* An op chain's forward value or gradient whose longest reduction has K
 * terms, through L rounded ops: f32 1e-4 relative plus 1e-5 sqrt(K) (the
 * order of cuBLAS and reduction additions differs: a random walk of K
 * roundings); bf16 / f16 2 L eps_d relative and 2 L eps_d sqrt(K) absolute
 * (each rounded op may land one ulp apart). */
static inline dist_tol dist_op_tol(tp_dtype d, int64_t K, int L)
{
    double sk = sqrt((double)(K < 1 ? 1 : K));
    if (d == TP_F32)
        return (dist_tol){1e-4, 1e-5 * sk};
    double e = 2.0 * L * dist_eps(d);
    return (dist_tol){e, e * sk};
}

typedef struct dist_run dist_run;

/* One rank's view of one run. */
typedef struct dist_io {
    tp_device dev;  /* TP_CPU, or TP_CUDA(0) on every rank */
    tp_dtype dtype; /* the case's dtype */
    int arg;        /* the case's parameter */
    tp_test_slot *s;
    dist_run *run_;
    int rank_;
} dist_io;

typedef tp_status (*dist_prog)(tp_comm *world, dist_io *io);

/* One kept output. */
typedef struct dist_out {
    tp_tensor *t; /* CPU copy */
    char name[160];
    dist_tol tol;
} dist_out;

struct dist_run {
    dist_prog fn;
    tp_device dev;
    tp_dtype dtype;
    int arg;
    dist_out *out[TP_TEST_MAX_RANKS]; /* nout[rank] of cap[rank] */
    int nout[TP_TEST_MAX_RANKS], cap[TP_TEST_MAX_RANKS];
    int64_t counts[TP_TEST_MAX_RANKS][TP_PHASE_COUNT][TP_COLL_KIND_COUNT];
    tp_test_slot slot[TP_TEST_MAX_RANKS];
};

static inline bool dist_same_device(tp_device a, tp_device b)
{
    return a.type == b.type && a.index == b.index;
}

/* Inside a rank: records a CPU copy of t (a DTensor: its local shard) under
 * `name`, to be compared within `tol`. t must be on io->dev. */
static inline tp_status dist_keep(dist_io *io, const char *name, const tp_tensor *t, dist_tol tol)
{
    dist_run *r = io->run_;
    int k = r->nout[io->rank_];
    RANK_EXPECT(io->s, t != NULL, "%s: no tensor to keep", name);
    if (!t)
        return TP_ERR_INVALID_ARG;
    if (k == r->cap[io->rank_]) {
        int cap = k ? 2 * k : 64;
        dist_out *o = realloc(r->out[io->rank_], (size_t)cap * sizeof *o);
        if (!o)
            return TP_ERR_NO_MEMORY;
        r->out[io->rank_] = o;
        r->cap[io->rank_] = cap;
    }
    dist_out *o = &r->out[io->rank_][k];
    const tp_tensor *l = tp_tensor_is_dtensor(t) ? tp_dtensor_local(t) : t;
    tp_device d = tp_tensor_device(l);
    RANK_EXPECT(io->s, dist_same_device(d, io->dev), "%s is on %s:%d, not on the run's device",
                name, d.type == TP_DEVICE_CPU ? "cpu" : "cuda", d.index);
    o->t = NULL;
    TP_TEST_TRY(tp_tensor_to(l, tp_tensor_dtype(l), TP_CPU, &o->t));
    snprintf(o->name, sizeof o->name, "%s", name);
    o->tol = tol;
    r->nout[io->rank_] = k + 1;
    return TP_OK;
}

/* Inside a rank: keeps a status (or any small integer) as an exact output. */
static inline tp_status dist_keep_int(dist_io *io, const char *name, int64_t v)
{
    tp_tensor *t = NULL;
    TP_TEST_TRY(tp_tensor_zeros(TP_I64, TP_CPU, 1, (int64_t[]){1}, &t));
    ((int64_t *)tp_tensor_data(t))[0] = v;
    tp_device dev = io->dev;
    io->dev = TP_CPU; /* a host value by nature */
    tp_status st = dist_keep(io, name, t, DIST_EXACT);
    io->dev = dev;
    tp_tensor_release(t);
    return st;
}

/* A CPU tensor of `dtype` from seed: floats uniform in [-1, 1), integers in
 * [-4, 5); then on `dev`. */
static inline tp_status dist_rand(int nd, const int64_t *shape, tp_dtype dtype, tp_device dev,
                                  uint64_t seed, tp_tensor **out)
{
    tp_tensor *c = NULL;
    bool fl = tp_dtype_is_float(dtype);
    TP_TEST_TRY(tp_tensor_zeros(fl ? TP_F64 : TP_I64, TP_CPU, nd, shape, &c));
    tp_status st = tp_tensor_fill_random(c, fl ? TP_RNG_UNIFORM : TP_RNG_RANDINT, fl ? -1 : -4,
                                         5 * !fl + fl, seed, NULL, NULL);
    if (st == TP_OK)
        st = tp_tensor_to(c, dtype, dev, out);
    tp_tensor_release(c);
    return st;
}

static tp_status dist_rank_main_(tp_comm *w, void *arg)
{
    dist_run *r = arg;
    int rank = tp_comm_rank(w);
    dist_io io = {r->dev, r->dtype, r->arg, &r->slot[rank], r, rank};
    tp_comm_debug *dbg = NULL;
    RANK_OK(io.s, tp_comm_debug_create(&dbg));
    RANK_OK(io.s, tp_comm_debug_begin(dbg));
    tp_status st = r->fn(w, &io);
    tp_comm_debug_end(dbg);
    for (int p = 0; p < TP_PHASE_COUNT; p++)
        for (int k = 0; k < TP_COLL_KIND_COUNT; k++)
            r->counts[rank][p][k] =
                tp_comm_debug_module_count(dbg, TP_COMM_DEBUG_GLOBAL, (tp_phase)p, (tp_coll_kind)k);
    tp_comm_debug_free(dbg);
    if (st != TP_OK)
        RANK_EXPECT(io.s, 0, "the program failed: %s (%s)", tp_status_name(st), tp_last_error());
    return st;
}

static inline void dist_run_free_(dist_run *r, int n)
{
    for (int i = 0; i < n; i++) {
        for (int k = 0; k < r->nout[i]; k++)
            tp_tensor_release(r->out[i][k].t);
        free(r->out[i]);
    }
    free(r);
}

static inline dist_run *dist_run_on_(int n, dist_prog fn, tp_device dev, tp_dtype dtype, int arg)
{
    dist_run *r = calloc(1, sizeof *r);
    cr_assert_not_null(r);
    r->fn = fn;
    r->dev = dev;
    r->dtype = dtype;
    r->arg = arg;
    tp_status st = tp_run_local(n, dist_rank_main_, r);
    for (int i = 0; i < n; i++)
        cr_assert(!r->slot[i].failed, "%s, rank %d: %s", dev.type == TP_DEVICE_CPU ? "cpu" : "cuda",
                  i, r->slot[i].msg);
    cr_assert_eq(st, TP_OK, "%s run: %s", dev.type == TP_DEVICE_CPU ? "cpu" : "cuda",
                 tp_last_error());
    return r;
}

/* Main thread: the test skips, visibly, without a CUDA device. */
static inline void dist_need_cuda(void)
{
    if (tp_cuda_device_count() > 0)
        return;
    cr_skip_test("no CUDA device: %s", TP_HAVE_CUDA
                                           ? "libtp has CUDA but the machine shows no device"
                                           : "libtp was built without CUDA");
}

/* NaN where the CPU has NaN (a mean over a rank's empty shard is NaN on both
 * devices, as in PyTorch), and within (rtol, atol) everywhere else. */
static inline bool dist_same_nans_close_elsewhere(const tp_tensor *g, const tp_tensor *c,
                                                  double rtol, double atol)
{
    if (tp_tensor_numel(g) != tp_tensor_numel(c))
        return false;
    tp_tensor *a = NULL, *b = NULL;
    bool ok = tp_tensor_to(g, TP_F64, TP_CPU, &a) == TP_OK &&
              tp_tensor_to(c, TP_F64, TP_CPU, &b) == TP_OK;
    for (int64_t i = 0; ok && i < tp_tensor_numel(b); i++) {
        double x = ((const double *)tp_tensor_data(a))[i], y = ((const double *)tp_tensor_data(b))[i];
        if (isnan(x) || isnan(y))
            ok = isnan(x) && isnan(y);
        else
            ok = fabs(x - y) <= atol + rtol * fabs(y);
    }
    tp_tensor_release(a);
    tp_tensor_release(b);
    return ok;
}

static inline void dist_compare_outputs_(const dist_run *a, const dist_run *b, int n,
                                         const char *label)
{
    for (int i = 0; i < n; i++) {
        cr_assert_eq(b->nout[i], a->nout[i], "%s rank %d: %d outputs on cuda, %d on cpu", label, i,
                     b->nout[i], a->nout[i]);
        for (int p = 0; p < TP_PHASE_COUNT; p++)
            for (int k = 0; k < TP_COLL_KIND_COUNT; k++)
                cr_assert_eq(b->counts[i][p][k], a->counts[i][p][k],
                             "%s rank %d: %s %s: %lld on cuda, %lld on cpu", label, i,
                             p ? "backward" : "forward", tp_coll_kind_name((tp_coll_kind)k),
                             (long long)b->counts[i][p][k], (long long)a->counts[i][p][k]);
        for (int k = 0; k < a->nout[i]; k++) {
            const dist_out *ga = &b->out[i][k], *ca = &a->out[i][k];
            const tp_tensor *g = ga->t, *c = ca->t;
            dist_tol t = ca->tol;
            bool ok = false;
            double diff = 0;
            cr_assert_str_eq(ga->name, ca->name, "%s rank %d output %d", label, i, k);
            cr_assert_eq(tp_tensor_dtype(g), tp_tensor_dtype(c), "%s rank %d %s: dtype", label, i,
                         ca->name);
            if (t.rtol == 0 && t.atol == 0)
                CHECK_OK(tp_tensor_equal(g, c, &ok));
            else
                CHECK_OK(tp_tensor_allclose(g, c, t.rtol, t.atol, &ok));
            if (!ok)
                ok = dist_same_nans_close_elsewhere(g, c, t.rtol, t.atol);
            if (!ok && tp_tensor_ndim(g) == tp_tensor_ndim(c))
                tp_tensor_max_abs_diff(g, c, &diff);
            cr_assert(ok, "%s rank %d %s: cuda differs from cpu by up to %g (rtol %g, atol %g)",
                      label, i, ca->name, diff, t.rtol, t.atol);
        }
    }
}

/* Runs `fn` on n ranks on the CPU, then (with a GPU) with every rank on
 * TP_CUDA(0), and compares. */
static inline void dist_compare(int n, dist_prog fn, tp_dtype dtype, int arg, const char *label)
{
    dist_run *cpu = dist_run_on_(n, fn, TP_CPU, dtype, arg);
    if (tp_cuda_device_count() == 0) {
        dist_run_free_(cpu, n);
        dist_need_cuda();
        return;
    }
    dist_run *gpu = dist_run_on_(n, fn, TP_CUDA(0), dtype, arg);
    dist_compare_outputs_(cpu, gpu, n, label);
    dist_run_free_(cpu, n);
    dist_run_free_(gpu, n);
}

/* A world size and a dtype: the parameters of most cases. */
typedef struct dist_param {
    int n;
    tp_dtype dtype;
    int arg;
} dist_param;

#endif /* TP_TEST_CUDA_DIST_H */
