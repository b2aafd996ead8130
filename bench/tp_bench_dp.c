/*
 * tp-bench-dp: one data-parallel training step of an MLP, with and without
 * gradient bucketing and overlap (tp/dp.h).
 *
 * The model is Sequential(L x [Linear(H, H), ReLU]) without the last ReLU;
 * every rank feeds its own B rows, loss = mean of the output, then an SGD
 * step and zero_grad. One step is timed in each configuration:
 *
 *   compute       the step without DDP: no communication (the compute time)
 *   comm-param    one blocking tp_all_reduce (avg) per parameter, alone, on
 *                 buffers of the parameters' sizes (what plain DP moves)
 *   comm-bucket   one blocking tp_all_reduce per bucket, alone, on buffers of
 *                 the buckets' sizes (what the bucketed configurations move)
 *   comm-async    the same per-bucket all_reduces launched at once, then
 *                 waited for in order (what late_waits leaves for the step
 *                 when nothing progressed during backward)
 *   plain         DDP, manual_passes and no pass: one blocking all_reduce per
 *                 gradient inside backward
 *   bucketed      DDP, bucket_fusion only: each bucket waited right after its
 *                 all_reduce
 *   overlap       DDP defaults: bucket_fusion + late_waits
 *   overlap-view  the defaults with gradient_as_bucket_view (+ remove_copies)
 *   overlap-view-1  the same with max_in_flight = 1: launching a bucket first
 *                 waits for the one before
 *
 * Every configuration has its own model (same seed) and runs -w untimed
 * steps, then -r timed ones; the configurations take turns step by step, so
 * slow moments of a shared machine spread over all of them. Each timed step
 * is preceded by a barrier; a step counts as the slowest rank's time; the
 * table shows the median. hidden = (T_compute + T_comm - T_step) / T_comm,
 * with the per-parameter comm time for plain DP and the per-bucket one for
 * the bucketed configurations: 1 means the step costs no more than its
 * compute, 0 that communication adds its full time, below 0 that it adds
 * more than its own time.
 *
 * Also per configuration: the median time inside tp_sgd_step (under DDP the
 * late waits and copies out, then the update) and the median minor page
 * faults per step (fresh memory touched: gradients allocated anew every
 * step fault in page by page; bucket views do not), both the slowest rank's.
 *
 * Check: after the first (untimed) step every DDP configuration's parameters
 * are compared with a reference step that all_reduces each gradient by hand;
 * the largest absolute difference over parameters and ranks is printed.
 *
 *   --backend shm   ranks are -g threads of this process (tp_run_local)
 *   --backend mpi   one rank per process under mpirun (tp_comm_create_world("mpi"));
 *                   -g is ignored; rank 0 prints and writes the CSV
 *
 * Usage: tp-bench-dp [--backend shm|mpi] [-g RANKS] [-H HIDDEN] [-L LAYERS] [-B ROWS]
 *                    [--bucket-mb MIB] [-r REPS] [-w WARMUP] [--csv FILE]
 */
#include <cblas.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <tp.h>

#include "bench_util.h"

enum { BK_SHM, BK_MPI, BK_COUNT };
static const char *const backend_names[BK_COUNT] = {"shm", "mpi"};

enum {
    C_COMPUTE, C_COMM_PARAM, C_COMM_BUCKET, C_COMM_ASYNC,
    C_PLAIN, C_FUSION, C_OVERLAP, C_VIEWS, C_VIEWS1, C_COUNT
};
static const char *const cfg_names[C_COUNT] = {"compute", "comm-param", "comm-bucket",
                                               "comm-async", "plain",
                                               "bucketed", "overlap", "overlap-view",
                                               "overlap-view-1"};
static const char *const cfg_titles[C_COUNT] = {
    "compute only (no DDP)",       "comm only, per parameter", "comm only, per bucket",
    "comm only, buckets at once",
    "plain DP (no pass)",          "bucketed, no overlap",     "bucketed + overlap",
    "bucketed + overlap + views",  "views, 1 bucket in flight"};

static bool is_ddp(int c) { return c >= C_PLAIN; }

#define LR 0.01
#define SEED 42

typedef struct bench {
    int64_t H, L, B;
    size_t cap; /* bucket cap, bytes */
    int reps, warmup;
    /* out, valid on rank 0 */
    int nranks, nparams;
    int64_t grad_bytes;
    double t_med[C_COUNT], t_min[C_COUNT], t_max[C_COUNT];
    double t_opt[C_COUNT];       /* median time in tp_sgd_step */
    double faults[C_COUNT];      /* median minor page faults per step */
    int buckets[C_COUNT];    /* of the DDP's step graph; -1: none */
    int64_t allreduces[C_COUNT]; /* per step, counted in the last warm-up step */
    double diff[C_COUNT];    /* max |param - reference| after step 1; -1: not checked */
} bench;

/* Sequential(fc0, relu0, fc1, ..., fc{L-1}): Linear(H, H) with bias, ReLU
 * between them. The same parameters on every rank (one seed). */
static tp_status make_mlp(int64_t H, int64_t L, tp_module **out)
{
    tp_module *m = NULL;
    tp_status st = tp_nn_sequential_create(&m);
    for (int64_t l = 0; st == TP_OK && l < L; l++) {
        char name[32];
        tp_module *c = NULL;
        snprintf(name, sizeof name, "fc%lld", (long long)l);
        st = tp_nn_linear_create(H, H, true, &c);
        if (st == TP_OK && (st = tp_module_add_child(m, name, c)) != TP_OK)
            tp_module_free(c);
        if (st != TP_OK || l == L - 1)
            break;
        c = NULL;
        snprintf(name, sizeof name, "relu%lld", (long long)l);
        st = tp_nn_relu_create(&c);
        if (st == TP_OK && (st = tp_module_add_child(m, name, c)) != TP_OK)
            tp_module_free(c);
    }
    if (st == TP_OK)
        st = tp_module_init(m, SEED);
    if (st != TP_OK) {
        tp_module_free(m);
        return st;
    }
    *out = m;
    return TP_OK;
}

/* The parameters of a module, in registration order (borrowed). */
typedef struct plist {
    tp_tensor *t[256];
    int n;
} plist;

static tp_status collect(const char *fqn, tp_tensor *t, void *ctx)
{
    (void)fqn;
    plist *p = ctx;
    if (p->n == (int)(sizeof p->t / sizeof p->t[0]))
        return TP_ERR_INVALID_ARG;
    p->t[p->n++] = t;
    return TP_OK;
}

/* Forward, loss, backward; then, for the reference only, each gradient
 * all_reduced (avg) by hand; then the SGD step (which, under DDP, waits for
 * the buckets) and zero_grad. */
static tp_status step(tp_comm *w, tp_module *m, tp_tensor *x, bool by_hand, double *t_opt)
{
    tp_tensor *y = NULL, *loss = NULL;
    tp_status st = tp_module_call(m, x, &y);
    if (st == TP_OK)
        st = tp_mean_all(y, &loss);
    if (st == TP_OK)
        st = tp_backward(loss, NULL);
    if (st == TP_OK && by_hand) {
        plist p = {.n = 0};
        st = tp_module_named_parameters(m, collect, &p);
        for (int i = 0; st == TP_OK && i < p.n; i++) {
            tp_tensor *g = tp_tensor_grad(p.t[i]);
            st = tp_all_reduce(w, g, g, TP_AVG, NULL);
        }
    }
    double t0 = bench_now_s();
    if (st == TP_OK)
        st = tp_sgd_step(m, LR);
    *t_opt = bench_now_s() - t0;
    tp_module_zero_grad(m);
    tp_tensor_release(loss);
    tp_tensor_release(y);
    return st;
}

/* The DDP of one configuration. */
static tp_status wrap(tp_module *m, tp_comm *w, int c, size_t cap, tp_ddp **out)
{
    tp_ddp_options o = {.bucket_cap_bytes = cap,
                        .manual_passes = c == C_PLAIN || c == C_FUSION,
                        .gradient_as_bucket_view = c == C_VIEWS || c == C_VIEWS1,
                        .max_in_flight = c == C_VIEWS1 ? 1 : 0};
    tp_status st = tp_ddp_create(m, w, &o, out);
    if (st == TP_OK && c == C_FUSION)
        st = tp_pass_apply(tp_pass_bucket_fusion(), tp_ddp_graph(*out));
    return st;
}

/* Largest |a - b| over two modules' parameters, then over the ranks. */
static tp_status max_diff(tp_comm *w, tp_module *a, tp_tensor *const *ref, double *out)
{
    plist pa = {.n = 0};
    tp_status st = tp_module_named_parameters(a, collect, &pa);
    double d = 0;
    for (int i = 0; st == TP_OK && i < pa.n; i++) {
        double di = 0;
        st = tp_tensor_max_abs_diff(pa.t[i], ref[i], &di);
        d = di > d || isnan(di) ? di : d;
    }
    tp_tensor *t = NULL;
    if (st == TP_OK)
        st = tp_tensor_from_blob(TP_F64, TP_CPU, 1, (int64_t[]){1}, &d, NULL, NULL, &t);
    if (st == TP_OK)
        st = tp_all_reduce(w, t, t, TP_MAX, NULL);
    tp_tensor_release(t);
    *out = d;
    return st;
}

/* The all_reduces of comm-param or comm-bucket, one after another. */
static tp_status comm_only(tp_comm *w, tp_tensor **bufs, int n)
{
    tp_status st = TP_OK;
    for (int i = 0; i < n && st == TP_OK; i++)
        st = tp_all_reduce(w, bufs[i], bufs[i], TP_AVG, NULL);
    return st;
}

/* The per-bucket all_reduces all launched, then waited for in order: what
 * late_waits leaves for the step when nothing progressed during backward. */
static tp_status comm_at_once(tp_comm *w, tp_tensor **bufs, int n)
{
    tp_work *wk[256] = {0};
    tp_status st = TP_OK;
    int launched = 0;
    for (; launched < n && st == TP_OK; launched++)
        st = tp_all_reduce(w, bufs[launched], bufs[launched], TP_AVG, &wk[launched]);
    for (int i = 0; i < launched; i++) {
        tp_status si = wk[i] ? tp_work_wait(wk[i]) : TP_OK;
        st = st == TP_OK ? si : st;
        tp_work_free(wk[i]);
    }
    return st;
}

static tp_status run_bench(tp_comm *w, bench *b)
{
    tp_status st = TP_OK;
    int rank = tp_comm_rank(w), R = b->reps;
    tp_module *m[C_COUNT] = {0}, *mref = NULL;
    tp_ddp *ddp[C_COUNT] = {0};
    tp_tensor *x = NULL, *ref[256] = {0}, *pbuf[256] = {0}, *bbuf[256] = {0}, *tt = NULL;
    tp_comm_debug *dbg = NULL;
    /* times, then the time in tp_sgd_step (the late waits and the update) */
    double *times = calloc(3 * (size_t)C_COUNT * (size_t)R, sizeof *times);
    double *topt = times + (size_t)C_COUNT * (size_t)R, *flt = topt + (size_t)C_COUNT * (size_t)R;
    plist pl = {.n = 0};
    int nb = 0, np = 0; /* buckets, parameters */
    if (!times) {
        fprintf(stderr, "rank %d: out of memory\n", rank);
        return TP_ERR_NO_MEMORY;
    }

    /* this rank's rows: the same every step, different on every rank */
    TRY(tp_tensor_empty(TP_F32, TP_CPU, 2, (int64_t[]){b->B, b->H}, &x));
    TRY(tp_tensor_fill_random(x, TP_RNG_NORMAL, 0.0, 1.0, 1000 + (uint64_t)rank, NULL, NULL));

    /* the reference step */
    TRY(make_mlp(b->H, b->L, &mref));
    double t_opt = 0;
    TRY(step(w, mref, x, true, &t_opt));
    TRY(tp_module_named_parameters(mref, collect, &pl));
    for (int i = 0; i < pl.n; i++) {
        TRY(tp_tensor_clone(pl.t[i], &ref[i]));
        b->grad_bytes += tp_tensor_numel(pl.t[i]) * 4;
    }
    b->nparams = pl.n;
    tp_module_free(mref); /* pl's tensors with it: the clones stand for them from here on */
    mref = NULL;
    np = pl.n;

    for (int c = 0; c < C_COUNT; c++) {
        b->buckets[c] = -1;
        b->diff[c] = -1;
        if (c == C_COMM_PARAM || c == C_COMM_BUCKET || c == C_COMM_ASYNC)
            continue;
        TRY(make_mlp(b->H, b->L, &m[c]));
        if (is_ddp(c))
            TRY(wrap(m[c], w, c, b->cap, &ddp[c]));
    }
    /* one buffer per parameter, of its size */
    for (int i = 0; i < np; i++) {
        int64_t n = tp_tensor_numel(ref[i]);
        TRY(tp_tensor_empty(TP_F32, TP_CPU, 1, &n, &pbuf[i]));
        TRY(tp_tensor_fill(pbuf[i], 1.0));
    }
    TRY(tp_comm_debug_create(&dbg));

    /* it < 0: warm-up; it == -warmup is the checked step. The comm-only
     * configurations run last: the buckets are known once the bucketed DDP
     * took its first step (which records the ready order). */
    static const int order[C_COUNT] = {C_COMPUTE, C_PLAIN,      C_FUSION,      C_OVERLAP,
                                       C_VIEWS,   C_VIEWS1,     C_COMM_PARAM,  C_COMM_BUCKET,
                                       C_COMM_ASYNC};
    for (int it = -b->warmup; it < R; it++) {
        for (int k = 0; k < C_COUNT; k++) {
            int c = order[k];
            if (c == C_COMM_BUCKET && nb == 0) {
                /* one buffer per bucket of the bucketed DDP's schedule */
                const tp_step_graph *g = tp_ddp_graph(ddp[C_FUSION]);
                nb = tp_step_graph_num_buckets(g);
                int64_t sizes[256] = {0};
                if (nb > 256) {
                    fprintf(stderr, "rank %d: %d buckets: at most 256\n", rank, nb);
                    st = TP_ERR_INVALID_ARG;
                    goto out;
                }
                for (int i = 0; i < np; i++)
                    sizes[tp_step_graph_bucket_of(g, i)] += tp_tensor_numel(ref[i]);
                for (int j = 0; j < nb; j++) {
                    TRY(tp_tensor_empty(TP_F32, TP_CPU, 1, &sizes[j], &bbuf[j]));
                    TRY(tp_tensor_fill(bbuf[j], 1.0));
                }
            }
            bool count = it == -1;
            TRY(tp_barrier(w, NULL));
            if (count)
                TRY(tp_comm_debug_begin(dbg));
            double f0 = bench_minor_faults(), t0 = bench_now_s();
            if (c == C_COMM_PARAM)
                st = comm_only(w, pbuf, np);
            else if (c == C_COMM_BUCKET)
                st = comm_only(w, bbuf, nb);
            else if (c == C_COMM_ASYNC)
                st = comm_at_once(w, bbuf, nb);
            else
                st = step(w, m[c], x, false, &t_opt);
            double t1 = bench_now_s(), f1 = bench_minor_faults();
            if (st != TP_OK) {
                fprintf(stderr, "rank %d: %s step: %s (%s)\n", rank, cfg_names[c],
                        tp_status_name(st), tp_last_error());
                goto out;
            }
            if (count) {
                TRY(tp_comm_debug_end(dbg));
                b->allreduces[c] = tp_comm_debug_count(dbg, TP_COLL_ALL_REDUCE);
            }
            if (it >= 0) {
                times[c * R + it] = t1 - t0;
                topt[c * R + it] = is_ddp(c) || c == C_COMPUTE ? t_opt : 0;
                flt[c * R + it] = f1 - f0;
            }
            if (it == -b->warmup && is_ddp(c))
                TRY(max_diff(w, m[c], ref, &b->diff[c]));
        }
    }
    for (int c = C_PLAIN; c < C_COUNT; c++)
        b->buckets[c] = tp_step_graph_num_buckets(tp_ddp_graph(ddp[c]));
    b->buckets[C_COMM_PARAM] = np;
    b->buckets[C_COMM_BUCKET] = b->buckets[C_COMM_ASYNC] = nb;

    /* every step counts as its slowest rank's */
    TRY(tp_tensor_from_blob(TP_F64, TP_CPU, 1, (int64_t[]){3 * (int64_t)C_COUNT * R}, times,
                            NULL, NULL, &tt));
    TRY(tp_all_reduce(w, tt, tt, TP_MAX, NULL));
    for (int c = 0; c < C_COUNT; c++) {
        double *v = &times[c * R];
        b->t_med[c] = bench_median(v, R); /* sorts v */
        b->t_min[c] = v[0];
        b->t_max[c] = v[R - 1];
        b->t_opt[c] = bench_median(&topt[c * R], R);
        b->faults[c] = bench_median(&flt[c * R], R);
    }
    b->nranks = tp_comm_size(w);
out:
    tp_tensor_release(tt);
    tp_comm_debug_free(dbg);
    for (int c = 0; c < C_COUNT; c++) {
        tp_ddp_free(ddp[c]);
        tp_module_free(m[c]);
    }
    tp_module_free(mref);
    for (int i = 0; i < 256; i++) {
        tp_tensor_release(ref[i]);
        tp_tensor_release(pbuf[i]);
        tp_tensor_release(bbuf[i]);
    }
    tp_tensor_release(x);
    free(times);
    return st;
}

static tp_status body(tp_comm *w, void *arg)
{
    bench *b = arg;
    if (tp_comm_rank(w) == 0)
        return run_bench(w, b);
    bench mine = *b; /* the results are rank 0's */
    return run_bench(w, &mine);
}

/* ---- the report ------------------------------------------------------------ */

static double comm_of(const bench *b, int c)
{
    return c == C_PLAIN ? b->t_med[C_COMM_PARAM] : b->t_med[C_COMM_BUCKET];
}

static void report(const bench *b, int backend, FILE *csv)
{
    double tc = b->t_med[C_COMPUTE], tplain = b->t_med[C_PLAIN];
    printf("# tp-bench-dp: backend %s, %d ranks%s, 1 BLAS thread each\n", backend_names[backend],
           b->nranks, backend == BK_SHM ? " (threads)" : " (processes)");
    printf("# MLP %lld x Linear(%lld, %lld) + ReLU, %lld rows per rank, loss = mean, SGD; "
           "gradients %.1f MB in %d parameters; bucket cap %.3g MiB\n",
           (long long)b->L, (long long)b->H, (long long)b->H, (long long)b->B,
           (double)b->grad_bytes / 1e6, b->nparams, (double)b->cap / 1048576.0);
    printf("# per step: median of %d after %d warm-up (slowest rank, barrier before each); "
           "configurations interleaved step by step\n", b->reps, b->warmup);
    /* the machines are shared: say how busy this one was */
    double load[3];
    if (bench_loadavg(load))
        printf("# load average (1 min) at the end: %.2f\n", load[0]);
    printf("%-27s %7s %6s %9s %19s %8s %7s %8s %8s %10s\n", "configuration", "buckets", "allred",
           "time(ms)", "[min .. max]", "sgd(ms)", "faults", "hidden", "speedup", "max|diff|");
    for (int c = 0; c < C_COUNT; c++) {
        char bk[16] = "-", hid[16] = "-", sp[16] = "-", df[16] = "-", so[16] = "-";
        bool stepped = c == C_COMPUTE || is_ddp(c);
        if (stepped)
            snprintf(so, sizeof so, "%.2f", b->t_opt[c] * 1e3);
        if (b->buckets[c] >= 0)
            snprintf(bk, sizeof bk, "%d", b->buckets[c]);
        double hidden = NAN, speed = NAN;
        if (is_ddp(c)) {
            double tm = comm_of(b, c);
            hidden = (tc + tm - b->t_med[c]) / tm;
            speed = tplain / b->t_med[c];
            snprintf(hid, sizeof hid, "%.2f", hidden);
            snprintf(sp, sizeof sp, "%.2fx", speed);
            snprintf(df, sizeof df, "%.3g", b->diff[c]);
        }
        printf("%-27s %7s %6lld %9.2f %8.2f .. %-8.2f %8s %7.0f %8s %8s %10s\n", cfg_titles[c], bk,
               (long long)b->allreduces[c], b->t_med[c] * 1e3, b->t_min[c] * 1e3,
               b->t_max[c] * 1e3, so, b->faults[c], hid, sp, df);
        if (csv) {
            /* empty fields where a column does not apply */
            char cbk[16] = "", cso[32] = "", cm[32] = "", ch[32] = "", csp[32] = "", cdf[32] = "";
            if (b->buckets[c] >= 0)
                snprintf(cbk, sizeof cbk, "%d", b->buckets[c]);
            if (stepped)
                snprintf(cso, sizeof cso, "%.4f", b->t_opt[c] * 1e3);
            if (is_ddp(c)) {
                snprintf(cm, sizeof cm, "%.4f", comm_of(b, c) * 1e3);
                snprintf(ch, sizeof ch, "%.4f", hidden);
                snprintf(csp, sizeof csp, "%.4f", speed);
                snprintf(cdf, sizeof cdf, "%.6g", b->diff[c]);
            }
            fprintf(csv, "%s,%s,%d,%lld,%lld,%lld,%.4f,%lld,%s,%lld,%.4f,%.4f,%.4f,%s,%.0f,%s,%s,%s,%s\n",
                    cfg_names[c], backend_names[backend], b->nranks, (long long)b->H,
                    (long long)b->L, (long long)b->B, (double)b->cap / 1048576.0,
                    (long long)b->grad_bytes, cbk, (long long)b->allreduces[c],
                    b->t_med[c] * 1e3, b->t_min[c] * 1e3, b->t_max[c] * 1e3, cso, b->faults[c], cm,
                    ch, csp, cdf);
        }
    }
    printf("# T_compute %.2f ms; T_comm %.2f ms per parameter, %.2f ms per bucket\n", tc * 1e3,
           b->t_med[C_COMM_PARAM] * 1e3, b->t_med[C_COMM_BUCKET] * 1e3);
    for (int c = C_PLAIN; c < C_COUNT; c++) {
        double tm = comm_of(b, c), h = (tc + tm - b->t_med[c]) / tm;
        double hc = h < 0 ? 0 : h > 1 ? 1 : h;
        printf("# %-26s step = compute %+6.2f ms: %3.0f%% of the %.2f ms of communication "
               "hidden (raw %.2f)\n", cfg_titles[c], (b->t_med[c] - tc) * 1e3, 100 * hc, tm * 1e3,
               h);
    }
    double worst = 0;
    for (int c = C_PLAIN; c < C_COUNT; c++)
        worst = b->diff[c] > worst || isnan(b->diff[c]) ? b->diff[c] : worst;
    printf("# parameters after step 1 vs a reference step with per-gradient all_reduces by hand: "
           "max |diff| %.3g over the DDP configurations and ranks\n", worst);
}

/* ---- the command line ------------------------------------------------------ */

static const char usage[] =
    "usage: tp-bench-dp [--backend shm|mpi] [-g RANKS] [-H HIDDEN] [-L LAYERS] [-B ROWS]\n"
    "                   [--bucket-mb MIB] [-r REPS] [-w WARMUP] [--csv FILE]\n"
    "  --backend   shm: ranks are threads (default); mpi: one rank per process under mpirun\n"
    "  -g          ranks for shm (default 2; ignored with mpi)\n"
    "  -H -L -B    hidden size, Linear layers, rows per rank (default 1024, 6, 64)\n"
    "  --bucket-mb bucket cap in MiB (default 5: one Linear's weight and bias per bucket at H=1024)\n"
    "  -r -w       timed and warm-up steps per configuration (default 21, 3; -w >= 1)\n"
    "  --csv FILE  also write the rows as CSV\n";

/* An option's whole-string integer in [lo, hi]; says what it expected if not. */
static bool parse_opt(const char *opt, const char *s, int lo, int hi, int *out)
{
    if (bench_parse_int(s, lo, hi, out))
        return true;
    fprintf(stderr, "tp-bench-dp: %s '%s': expected an integer in [%d, %d]\n", opt, s, lo, hi);
    return false;
}

int main(int argc, char **argv)
{
    bench b = {.H = 1024, .L = 6, .B = 64, .cap = 5u << 20, .reps = 21, .warmup = 3};
    int ranks = 2, v = 0;
    int backend = BK_SHM;
    const char *csv = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            fputs(usage, stdout);
            return 0;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "tp-bench-dp: %s: %s\n", a,
                    a[0] == '-' ? "missing value" : "unexpected argument");
            fputs(usage, stderr);
            return 64;
        }
        const char *val = argv[++i];
        if (!strcmp(a, "--backend")) {
            backend = -1;
            for (int k = 0; k < BK_COUNT; k++)
                if (!strcmp(val, backend_names[k]))
                    backend = k;
            if (backend < 0) {
                fprintf(stderr, "tp-bench-dp: unknown --backend '%s' (shm|mpi)\n", val);
                return 64;
            }
        } else if (!strcmp(a, "-g")) {
            if (!parse_opt(a, val, 1, 64, &ranks))
                return 64;
        } else if (!strcmp(a, "-H")) {
            if (!parse_opt(a, val, 1, 1 << 16, &v))
                return 64;
            b.H = v;
        } else if (!strcmp(a, "-L")) {
            if (!parse_opt(a, val, 1, 100, &v))
                return 64;
            b.L = v;
        } else if (!strcmp(a, "-B")) {
            if (!parse_opt(a, val, 1, 1 << 20, &v))
                return 64;
            b.B = v;
        } else if (!strcmp(a, "-r")) {
            if (!parse_opt(a, val, 1, 100000, &v))
                return 64;
            b.reps = v;
        } else if (!strcmp(a, "-w")) {
            if (!parse_opt(a, val, 1, 100000, &v))
                return 64;
            b.warmup = v;
        } else if (!strcmp(a, "--bucket-mb")) {
            char *end = NULL;
            errno = 0;
            double mb = strtod(val, &end);
            if (errno || end == val || *end || !(mb > 0) || mb > 1048576) {
                fprintf(stderr, "tp-bench-dp: --bucket-mb '%s': expected a size in MiB > 0\n", val);
                return 64;
            }
            b.cap = (size_t)(mb * 1048576.0);
            if (b.cap == 0)
                b.cap = 1; /* 0 would mean the default, 25 MiB */
        } else if (!strcmp(a, "--csv")) {
            csv = val;
        } else {
            fprintf(stderr, "tp-bench-dp: unknown option '%s'\n", a);
            fputs(usage, stderr);
            return 64;
        }
    }
    if ((double)b.H * (double)b.H * 4.0 > 4e9 || (double)b.B * (double)b.H * 4.0 > 4e9) {
        fprintf(stderr, "tp-bench-dp: -H %lld with -B %lld is over 4 GB a tensor\n",
                (long long)b.H, (long long)b.B);
        return 64;
    }
    openblas_set_num_threads(1);

    tp_comm *world = NULL;
    bool printer = true;
    tp_status st;
    if (backend == BK_MPI) {
        if (!tp_backend_find("mpi")) {
            fprintf(stderr, "tp-bench-dp: libtp built without MPI support\n");
            return 2;
        }
        st = tp_comm_create_world("mpi", NULL, &world);
        if (st != TP_OK) {
            fprintf(stderr, "tp-bench-dp: tp_comm_create_world(\"mpi\"): %s (%s)\n", tp_status_name(st),
                    tp_last_error());
            return 2;
        }
        printer = tp_comm_rank(world) == 0;
    }
    FILE *fcsv = NULL;
    if (csv && printer) {
        fcsv = fopen(csv, "w");
        if (!fcsv) {
            fprintf(stderr, "tp-bench-dp: --csv %s: %s\n", csv, strerror(errno));
            tp_comm_free(world);
            return 2; /* the other processes fail in their first collective */
        }
        fprintf(fcsv, "config,backend,ranks,hidden,layers,rows,bucket_mib,grad_bytes,buckets,"
                      "allreduces,time_ms,time_min_ms,time_max_ms,sgd_ms,minor_faults,comm_ms,hidden_share,"
                      "speedup_vs_plain,max_abs_diff\n");
    }
    if (backend == BK_MPI)
        st = body(world, &b);
    else
        st = tp_run_local(ranks, body, &b);
    int rc = 0;
    if (st != TP_OK) {
        if (printer)
            fprintf(stderr, "tp-bench-dp: %s (%s)\n", tp_status_name(st), tp_last_error());
        rc = 2;
    } else if (printer) {
        report(&b, backend, fcsv);
    }
    if (fcsv)
        fclose(fcsv);
    tp_comm_free(world);
    return rc;
}
