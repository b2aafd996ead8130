/*
 * tp-bench-ops: what the DTensor layer costs on top of the work it does.
 *
 * 1. Dispatch overhead on small tensors, per call: a DTensor op (strategy
 *    choice, wrapping, autograd recording) minus the bare kernel it runs
 *    (the same cblas_sgemm), and a redistribute minus the bare collective it
 *    issues (the same tp_all_gather on the same buffers). Interleaved A B A B
 *    in one run; medians of repeated batches.
 * 2. A sharded Linear forward + backward at a large shape (colwise, 2 ranks)
 *    against the same local GEMMs and the same all_reduce run by hand.
 *
 * Usage: tp-bench-ops [-g RANKS] [-t TOKENS] [-i IN] [-o OUT] [-r REPS]
 */
#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <tp.h>

#include "bench_util.h"

typedef struct {
    int ranks;
    int64_t tokens, in, out;
    int reps;
    /* results from rank 0 */
    double op_us, kernel_us, op_grad_us, op_scoped_us, redist_us, coll_us;
    double tp_ms, hand_ms;
    tp_status st;
    char err[512];
} cfg;

#define CHECK(expr)                                                             \
    do {                                                                        \
        tp_status st_ = (expr);                                                 \
        if (st_ != TP_OK) {                                                     \
            fprintf(stderr, "rank %d: %s failed: %s (%s)\n", r, #expr,          \
                    tp_status_name(st_), tp_last_error());                      \
            return st_;                                                         \
        }                                                                       \
    } while (0)

enum { BATCH = 2000, BATCHES = 15 };

/* Seconds per call over BATCH calls of tp_linear(x, wt). */
static tp_status linear_batch(tp_tensor *x, tp_tensor *wt, double *seconds)
{
    double t0 = bench_now_s();
    for (int i = 0; i < BATCH; i++) {
        tp_tensor *y = NULL;
        tp_status st = tp_linear(x, wt, NULL, &y);
        if (st != TP_OK)
            return st;
        tp_tensor_release(y);
    }
    *seconds = (bench_now_s() - t0) / BATCH;
    return TP_OK;
}

static tp_status overhead(tp_comm *w, cfg *c, tp_mesh *mesh)
{
    int r = tp_comm_rank(w);
    int64_t n = tp_comm_size(w);
    /* small: x [4, 16] R, W [16 n, 16] S(0): colwise, exact match, no comm */
    int64_t xs[2] = {4, 16}, ws[2] = {16 * n, 16};
    tp_tensor *xf = NULL, *wf = NULL, *x = NULL, *wt = NULL;
    CHECK(tp_tensor_zeros(TP_F32, TP_CPU, 2, xs, &xf));
    CHECK(tp_tensor_zeros(TP_F32, TP_CPU, 2, ws, &wf));
    CHECK(tp_tensor_fill_random(xf, TP_RNG_UNIFORM, -1, 1, 1, NULL, NULL));
    CHECK(tp_tensor_fill_random(wf, TP_RNG_UNIFORM, -1, 1, 2, NULL, NULL));
    tp_placement R = tp_replicate(), S0 = tp_shard(0);
    CHECK(tp_dtensor_distribute(mesh, xf, 1, &R, -1, &x));
    CHECK(tp_dtensor_distribute(mesh, wf, 1, &S0, -1, &wt));
    const float *xl = tp_tensor_data(tp_dtensor_local(x));
    const float *wl = tp_tensor_data(tp_dtensor_local(wt));
    float yl[4 * 16];
    double t_op[BATCHES], t_k[BATCHES], t_g[BATCHES];
    for (int b = 0; b < BATCHES; b++) {
        CHECK(linear_batch(x, wt, &t_op[b]));
        double t0 = bench_now_s();
        for (int i = 0; i < BATCH; i++)
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, 4, 16, 16, 1.0f, xl, 16, wl, 16,
                        0.0f, yl, 16);
        t_k[b] = (bench_now_s() - t0) / BATCH;
    }
    /* with autograd recording: the weight requires grad */
    CHECK(tp_tensor_set_requires_grad(wt, true));
    for (int b = 0; b < BATCHES; b++)
        CHECK(linear_batch(x, wt, &t_g[b]));
    /* and inside two comm-debug scopes (as in a module), no counter active:
     * autograd saves the open scopes with every node */
    double t_s[BATCHES];
    CHECK(tp_comm_debug_push_scope("block"));
    CHECK(tp_comm_debug_push_scope("mlp"));
    for (int b = 0; b < BATCHES; b++)
        CHECK(linear_batch(x, wt, &t_s[b]));
    CHECK(tp_comm_debug_pop_scope());
    CHECK(tp_comm_debug_pop_scope());
    /* redistribute S(0) -> R of a [4 n, 16] tensor vs the bare all_gather */
    int64_t ss[2] = {4 * n, 16}, ls[2] = {4, 16};
    tp_tensor *sf = NULL, *sd = NULL, *rd = NULL, *send = NULL, *recv = NULL;
    CHECK(tp_tensor_zeros(TP_F32, TP_CPU, 2, ss, &sf));
    CHECK(tp_dtensor_distribute(mesh, sf, 1, &S0, -1, &sd));
    CHECK(tp_tensor_zeros(TP_F32, TP_CPU, 2, ls, &send));
    CHECK(tp_tensor_zeros(TP_F32, TP_CPU, 2, ss, &recv));
    double t_r[BATCHES], t_c[BATCHES];
    for (int b = 0; b < BATCHES; b++) {
        CHECK(tp_barrier(w, NULL));
        double t0 = bench_now_s();
        for (int i = 0; i < BATCH; i++) {
            CHECK(tp_dtensor_redistribute(sd, 1, &R, &rd));
            tp_tensor_release(rd);
        }
        t_r[b] = (bench_now_s() - t0) / BATCH;
        CHECK(tp_barrier(w, NULL));
        t0 = bench_now_s();
        for (int i = 0; i < BATCH; i++) {
            tp_tensor *fresh = NULL; /* redistribute allocates its output too */
            CHECK(tp_tensor_empty(TP_F32, TP_CPU, 2, ss, &fresh));
            CHECK(tp_all_gather(w, send, fresh, NULL));
            tp_tensor_release(fresh);
        }
        t_c[b] = (bench_now_s() - t0) / BATCH;
    }
    if (r == 0) {
        c->op_us = bench_median(t_op, BATCHES) * 1e6;
        c->kernel_us = bench_median(t_k, BATCHES) * 1e6;
        c->op_grad_us = bench_median(t_g, BATCHES) * 1e6;
        c->op_scoped_us = bench_median(t_s, BATCHES) * 1e6;
        c->redist_us = bench_median(t_r, BATCHES) * 1e6;
        c->coll_us = bench_median(t_c, BATCHES) * 1e6;
    }
    tp_tensor_release(xf);
    tp_tensor_release(wf);
    tp_tensor_release(x);
    tp_tensor_release(wt);
    tp_tensor_release(sf);
    tp_tensor_release(sd);
    tp_tensor_release(send);
    tp_tensor_release(recv);
    return TP_OK;
}

/* Colwise Linear(in -> out) on `tokens` rows: forward + backward through
 * libtp, against the same GEMMs and all_reduce by hand. */
static tp_status large(tp_comm *w, cfg *c, tp_mesh *mesh)
{
    int r = tp_comm_rank(w);
    int64_t n = tp_comm_size(w), nt = c->tokens, ni = c->in, no = c->out;
    int64_t xs[2] = {nt, ni}, ws[2] = {no, ni}, ol = no / n;
    tp_tensor *xf = NULL, *wf = NULL, *x = NULL, *wt = NULL;
    CHECK(tp_tensor_zeros(TP_F32, TP_CPU, 2, xs, &xf));
    CHECK(tp_tensor_zeros(TP_F32, TP_CPU, 2, ws, &wf));
    CHECK(tp_tensor_fill_random(xf, TP_RNG_UNIFORM, -1, 1, 1, NULL, NULL));
    CHECK(tp_tensor_fill_random(wf, TP_RNG_UNIFORM, -1, 1, 2, NULL, NULL));
    tp_placement R = tp_replicate(), S0 = tp_shard(0);
    CHECK(tp_dtensor_distribute(mesh, xf, 1, &R, -1, &x));
    CHECK(tp_dtensor_distribute(mesh, wf, 1, &S0, -1, &wt));
    CHECK(tp_tensor_set_requires_grad(x, true));
    CHECK(tp_tensor_set_requires_grad(wt, true));
    /* by hand: y = x Wl^nt; gx = gy Wl (then all_reduce); gW = gy^nt x */
    float *xl = tp_tensor_data(tp_dtensor_local(x)), *wl = tp_tensor_data(tp_dtensor_local(wt));
    int64_t ys[2] = {nt, ol};
    tp_tensor *yh = NULL, *gyh = NULL, *gxh = NULL, *gxr = NULL, *gwh = NULL;
    CHECK(tp_tensor_empty(TP_F32, TP_CPU, 2, ys, &yh));
    CHECK(tp_tensor_zeros(TP_F32, TP_CPU, 2, ys, &gyh));
    CHECK(tp_tensor_fill(gyh, 1e-3));
    CHECK(tp_tensor_empty(TP_F32, TP_CPU, 2, xs, &gxh));
    CHECK(tp_tensor_empty(TP_F32, TP_CPU, 2, xs, &gxr));
    int64_t gws[2] = {ol, ni};
    CHECK(tp_tensor_empty(TP_F32, TP_CPU, 2, gws, &gwh));
    double t_tp[64], t_hand[64];
    int reps = c->reps < 64 ? c->reps : 64;
    for (int k = -1; k < reps; k++) { /* k = -1: warm-up */
        CHECK(tp_barrier(w, NULL));
        double t0 = bench_now_s();
        tp_tensor *y = NULL, *yl = NULL, *g = NULL;
        CHECK(tp_linear(x, wt, NULL, &y));
        CHECK(tp_dtensor_to_local(y, 0, NULL, &yl));
        CHECK(tp_tensor_empty(TP_F32, TP_CPU, 2, ys, &g));
        CHECK(tp_tensor_fill(g, 1e-3));
        CHECK(tp_backward(yl, g));
        tp_tensor_zero_grad(x);
        tp_tensor_zero_grad(wt);
        tp_tensor_release(y);
        tp_tensor_release(yl);
        tp_tensor_release(g);
        double t1 = bench_now_s();
        CHECK(tp_barrier(w, NULL));
        double t2 = bench_now_s();
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)nt, (int)ol, (int)ni, 1.0f, xl,
                    (int)ni, wl, (int)ni, 0.0f, tp_tensor_data(yh), (int)ol);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)nt, (int)ni, (int)ol, 1.0f,
                    tp_tensor_data(gyh), (int)ol, wl, (int)ni, 0.0f, tp_tensor_data(gxh), (int)ni);
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)ol, (int)ni, (int)nt, 1.0f,
                    tp_tensor_data(gyh), (int)ol, xl, (int)ni, 0.0f, tp_tensor_data(gwh), (int)ni);
        CHECK(tp_all_reduce(w, gxh, gxr, TP_SUM, NULL));
        double t3 = bench_now_s();
        if (k >= 0) {
            t_tp[k] = t1 - t0;
            t_hand[k] = t3 - t2;
        }
    }
    if (r == 0) {
        c->tp_ms = bench_median(t_tp, reps) * 1e3;
        c->hand_ms = bench_median(t_hand, reps) * 1e3;
    }
    tp_tensor *all[] = {xf, wf, x, wt, yh, gyh, gxh, gxr, gwh};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        tp_tensor_release(all[i]);
    return TP_OK;
}

static tp_status body(tp_comm *w, void *arg)
{
    cfg *c = arg;
    int64_t n = tp_comm_size(w);
    tp_mesh *mesh = NULL;
    tp_status st = tp_mesh_create(w, 1, &n, (const char *[]){"tp"}, &mesh);
    if (st == TP_OK)
        st = overhead(w, c, mesh);
    if (st == TP_OK)
        st = large(w, c, mesh);
    tp_mesh_free(mesh);
    return st;
}

int main(int argc, char **argv)
{
    static const char usage[] = "usage: tp-bench-ops [-g RANKS] [-t TOKENS] [-i IN] [-o OUT] [-r REPS]\n";
    cfg c = {.ranks = 2, .tokens = 2048, .in = 2048, .out = 4096, .reps = 5};
    for (int i = 1; i < argc; i += 2) {
        const char *a = argv[i], *val = i + 1 < argc ? argv[i + 1] : NULL;
        int v = 0;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            fputs(usage, stdout);
            return 0;
        }
        if (strcmp(a, "-g") && strcmp(a, "-t") && strcmp(a, "-i") && strcmp(a, "-o") && strcmp(a, "-r")) {
            fprintf(stderr, "tp-bench-ops: unknown option '%s'\n%s", a, usage);
            return 64;
        }
        if (!val || !bench_parse_int(val, 1, 1 << 20, &v)) {
            fprintf(stderr, "tp-bench-ops: %s '%s': expected an integer in [1, %d]\n%s", a,
                    val ? val : "", 1 << 20, usage);
            return 64;
        }
        switch (a[1]) {
        case 'g': c.ranks = v; break;
        case 't': c.tokens = v; break;
        case 'i': c.in = v; break;
        case 'o': c.out = v; break;
        default: c.reps = v; break;
        }
    }
    if (c.ranks < 1 || c.out % c.ranks) {
        fprintf(stderr, "tp-bench-ops: -o must be a multiple of -g\n");
        return 64;
    }
    /* one BLAS thread per rank: the ranks are the parallelism */
    openblas_set_num_threads(1);
    tp_status st = tp_run_local(c.ranks, body, &c);
    if (st != TP_OK) {
        fprintf(stderr, "tp-bench-ops: %s: %s\n", tp_status_name(st), tp_last_error());
        return 2;
    }
    printf("# tp-bench-ops, %d ranks (threads), one BLAS thread each\n", c.ranks);
    printf("# dispatch overhead, small tensors (median of %d batches of %d calls)\n", BATCHES,
           BATCH);
    printf("linear colwise x[4,16] W[%d,16] local: %8.3f us/call, bare sgemm %8.3f us -> "
           "overhead %6.3f us\n",
           16, c.op_us, c.kernel_us, c.op_us - c.kernel_us);
    printf("  same, weight requires grad (node recorded): %8.3f us -> overhead %6.3f us\n",
           c.op_grad_us, c.op_grad_us - c.kernel_us);
    printf("  same, inside 2 comm-debug scopes, no counter: %8.3f us -> overhead %6.3f us\n",
           c.op_scoped_us, c.op_scoped_us - c.kernel_us);
    printf("redistribute S(0)->R [4n,16]: %8.3f us/call, bare all_gather %8.3f us -> overhead "
           "%6.3f us\n",
           c.redist_us, c.coll_us, c.redist_us - c.coll_us);
    printf("# colwise Linear(%lld -> %lld), %lld tokens, forward + backward (median of %d)\n",
           (long long)c.in, (long long)c.out, (long long)c.tokens, c.reps);
    printf("libtp %.2f ms, by hand (3 sgemm + all_reduce) %.2f ms, ratio %.3f\n", c.tp_ms,
           c.hand_ms, c.tp_ms / c.hand_ms);
    return 0;
}
