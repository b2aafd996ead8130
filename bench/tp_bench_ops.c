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
 * --cuda instead times the host side of DTensor ops on CUDA tensors (a
 * 1-rank mesh on TP_CUDA(0), launch-bound shapes): add, GELU, a colwise
 * Linear and a no-op redistribute, each against the bare launch of the same
 * work (bench_cuda.cu's kernels, the same cublasGemmEx; nothing for the
 * no-op) on a stream of this program. A batch is CUDA_BATCH calls back to back
 * with no synchronization inside, from and to a synchronized device; the host
 * time per call is the batch's issue time over its calls (median over
 * CUDA_BATCHES batches, op and bare interleaved). Target: overhead < 5 us.
 *
 * Usage: tp-bench-ops [-g RANKS] [-t TOKENS] [-i IN] [-o OUT] [-r REPS] [--cuda] [--csv FILE]
 */
#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <tp.h>

#include "bench_cuda.h"
#include "bench_util.h"

#if TP_HAVE_CUDA
#include <cublas_v2.h>
#endif

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

/* ---- --cuda: per-op host time on CUDA tensors ------------------------------ */

#if TP_HAVE_CUDA
enum { CUDA_BATCH = 200, CUDA_BATCHES = 25, C_ADD = 0, C_GELU, C_LINEAR, C_REDIST, C_COUNT };
static const char *cuda_op_names[C_COUNT] = {"add", "gelu", "linear", "redistribute R->R"};

/* The work of one row: the DTensors (x [T, I] R, w [O, I] S(0) on a 1-rank
 * mesh) and, for the bare side, their device buffers, an output buffer, this
 * program's stream and cuBLAS handle. */
typedef struct cuda_work {
    tp_tensor *x, *w;
    float *xd, *wd, *yd;
    int64_t t, i, o;
    cudaStream_t s;
    cublasHandle_t h;
} cuda_work;

typedef struct cuda_rows {
    double op_us[C_COUNT], bare_us[C_COUNT], op_min[C_COUNT], op_max[C_COUNT];
    double op_total_us[C_COUNT], bare_total_us[C_COUNT];
} cuda_rows;

static tp_status cuda_op(cuda_work *cw, int op)
{
    tp_tensor *y = NULL;
    tp_placement R = tp_replicate();
    tp_status st = op == C_ADD      ? tp_add(cw->x, cw->x, &y)
                   : op == C_GELU   ? tp_gelu(cw->x, TP_GELU_TANH, &y)
                   : op == C_LINEAR ? tp_linear(cw->x, cw->w, NULL, &y)
                                    : tp_dtensor_redistribute(cw->x, 1, &R, &y);
    tp_tensor_release(y);
    return st;
}

/* The same work by hand on preallocated buffers (the no-op redistribute:
 * nothing). y = x w^T is the call libtp's CUDA table makes. */
static tp_status cuda_bare(cuda_work *cw, int op)
{
    int64_t n = cw->t * cw->i;
    if (op == C_ADD)
        return bench_cuda_add_f32(cw->xd, cw->xd, cw->yd, n, cw->s) ? TP_ERR_BACKEND : TP_OK;
    if (op == C_GELU)
        return bench_cuda_gelu_f32(cw->xd, cw->yd, n, cw->s) ? TP_ERR_BACKEND : TP_OK;
    if (op == C_REDIST)
        return TP_OK;
    float one = 1, zero = 0;
    int t = (int)cw->t, i = (int)cw->i, o = (int)cw->o;
    cublasStatus_t s = cublasGemmEx(cw->h, CUBLAS_OP_T, CUBLAS_OP_N, o, t, i, &one, cw->wd,
                                    CUDA_R_32F, i, cw->xd, CUDA_R_32F, i, &zero, cw->yd, CUDA_R_32F,
                                    o, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    return s == CUBLAS_STATUS_SUCCESS ? TP_OK : TP_ERR_BACKEND;
}

/* One batch from a synchronized device: host seconds per call to issue it,
 * and per call until the device is done. */
static tp_status cuda_batch(cuda_work *cw, int op, bool bare, double *issue, double *total)
{
    tp_status st = cudaDeviceSynchronize() == cudaSuccess ? TP_OK : TP_ERR_BACKEND;
    double t0 = bench_now_s();
    for (int k = 0; k < CUDA_BATCH && st == TP_OK; k++)
        st = bare ? cuda_bare(cw, op) : cuda_op(cw, op);
    double t1 = bench_now_s();
    if (st == TP_OK && cudaDeviceSynchronize() != cudaSuccess)
        st = TP_ERR_BACKEND;
    *issue = (t1 - t0) / CUDA_BATCH;
    *total = (bench_now_s() - t0) / CUDA_BATCH;
    return st;
}

static tp_status cuda_measure(cuda_work *cw, cuda_rows *out)
{
    for (int op = 0; op < C_COUNT; op++) {
        double oi[CUDA_BATCHES], ot[CUDA_BATCHES], bi[CUDA_BATCHES], bt[CUDA_BATCHES];
        for (int b = -1; b < CUDA_BATCHES; b++) { /* b = -1: warm-up */
            double a1, a2, b1, b2;
            tp_status st = cuda_batch(cw, op, false, &a1, &a2);
            if (st == TP_OK)
                st = cuda_batch(cw, op, true, &b1, &b2);
            if (st != TP_OK) {
                fprintf(stderr, "tp-bench-ops: %s on CUDA: %s (%s)\n", cuda_op_names[op],
                        tp_status_name(st), tp_last_error());
                return st;
            }
            if (b >= 0)
                oi[b] = a1 * 1e6, ot[b] = a2 * 1e6, bi[b] = b1 * 1e6, bt[b] = b2 * 1e6;
        }
        out->op_us[op] = bench_median(oi, CUDA_BATCHES);
        out->op_min[op] = oi[0], out->op_max[op] = oi[CUDA_BATCHES - 1];
        out->bare_us[op] = bench_median(bi, CUDA_BATCHES);
        out->op_total_us[op] = bench_median(ot, CUDA_BATCHES);
        out->bare_total_us[op] = bench_median(bt, CUDA_BATCHES);
    }
    return TP_OK;
}

static tp_status cuda_body(tp_comm *w, void *arg)
{
    cuda_rows *out = arg;
    int64_t one = 1;
    tp_status st = TP_OK;
    tp_mesh *mesh = NULL;
    tp_tensor *xl = NULL, *wl = NULL, *y = NULL;
    cuda_work cw = {.t = 64, .i = 256, .o = 256};
    int64_t xs[2] = {cw.t, cw.i}, ws[2] = {cw.o, cw.i}, ys = cw.t * (cw.o > cw.i ? cw.o : cw.i);
    tp_placement R = tp_replicate(), S0 = tp_shard(0);
    TRY(tp_mesh_create(w, 1, &one, (const char *[]){"tp"}, &mesh));
    TRY(tp_tensor_empty(TP_F32, TP_CUDA(0), 2, xs, &xl));
    TRY(tp_tensor_empty(TP_F32, TP_CUDA(0), 2, ws, &wl));
    TRY(tp_tensor_empty(TP_F32, TP_CUDA(0), 1, &ys, &y));
    TRY(tp_tensor_fill_random(xl, TP_RNG_UNIFORM, -1, 1, 1, NULL, NULL));
    TRY(tp_tensor_fill_random(wl, TP_RNG_UNIFORM, -1, 1, 2, NULL, NULL));
    TRY(tp_dtensor_from_local(mesh, xl, 1, &R, NULL, &cw.x));
    TRY(tp_dtensor_from_local(mesh, wl, 1, &S0, NULL, &cw.w));
    TRY(tp_cuda_synchronize(0));
    cw.xd = tp_tensor_data(xl), cw.wd = tp_tensor_data(wl), cw.yd = tp_tensor_data(y);
    if (cudaStreamCreate(&cw.s) != cudaSuccess) {
        st = TP_ERR_BACKEND;
        fprintf(stderr, "tp-bench-ops: cudaStreamCreate failed\n");
        goto out;
    }
    if (cublasCreate(&cw.h) != CUBLAS_STATUS_SUCCESS ||
        cublasSetStream(cw.h, cw.s) != CUBLAS_STATUS_SUCCESS) {
        st = TP_ERR_BACKEND;
        fprintf(stderr, "tp-bench-ops: cublasCreate failed\n");
        goto out;
    }
    st = cuda_measure(&cw, out);
out:
    if (cw.h)
        cublasDestroy(cw.h);
    if (cw.s)
        cudaStreamDestroy(cw.s);
    tp_tensor_release(cw.x);
    tp_tensor_release(cw.w);
    tp_tensor_release(xl);
    tp_tensor_release(wl);
    tp_tensor_release(y);
    tp_mesh_free(mesh);
    return st;
}

static int cuda_main(const char *csv)
{
    cuda_rows rows = {0};
    struct cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess)
        snprintf(prop.name, sizeof prop.name, "unknown");
    FILE *f = csv ? fopen(csv, "w") : NULL;
    if (csv && !f) {
        perror(csv);
        return 2;
    }
    tp_status st = tp_run_local(1, cuda_body, &rows);
    if (st != TP_OK) {
        fprintf(stderr, "tp-bench-ops: %s: %s\n", tp_status_name(st), tp_last_error());
        if (f)
            fclose(f);
        return 2;
    }
    printf("# tp-bench-ops --cuda on cuda:0, %s: DTensor ops on a 1-rank mesh, x [64,256] f32 R, "
           "w [256,256] S(0); host time per call over %d calls back to back, median of %d "
           "batches [min .. max]; bare = the same launch by hand\n",
           prop.name, CUDA_BATCH, CUDA_BATCHES);
    printf("%-18s %9s %19s %9s %9s %11s %11s\n", "op", "host(us)", "[min .. max]", "bare(us)",
           "overhead", "op+sync", "bare+sync");
    if (f)
        fprintf(f, "op,host_us,host_min_us,host_max_us,bare_us,overhead_us,op_total_us,"
                   "bare_total_us,device\n");
    int rc = 0;
    for (int op = 0; op < C_COUNT; op++) {
        double ov = rows.op_us[op] - rows.bare_us[op];
        printf("%-18s %9.3f [%7.3f .. %7.3f] %9.3f %9.3f %11.3f %11.3f %s\n", cuda_op_names[op],
               rows.op_us[op], rows.op_min[op], rows.op_max[op], rows.bare_us[op], ov,
               rows.op_total_us[op], rows.bare_total_us[op], ov < 5 ? "PASS" : "FAIL");
        if (ov >= 5)
            rc = 1;
        if (f)
            fprintf(f, "%s,%.4f,%.4f,%.4f,%.4f,%.4f,%.4f,%.4f,%s\n", cuda_op_names[op],
                    rows.op_us[op], rows.op_min[op], rows.op_max[op], rows.bare_us[op], ov,
                    rows.op_total_us[op], rows.bare_total_us[op], prop.name);
    }
    if (f)
        fclose(f);
    return rc;
}
#endif

int main(int argc, char **argv)
{
    static const char usage[] =
        "usage: tp-bench-ops [-g RANKS] [-t TOKENS] [-i IN] [-o OUT] [-r REPS] [--csv FILE]\n"
        "       tp-bench-ops --cuda [--csv FILE]\n"
        "  --cuda      host time per DTensor op on CUDA tensors (1 rank, TP_CUDA(0)) against\n"
        "              the bare launch; exit 1 when an overhead reaches 5 us, 2 without a\n"
        "              CUDA device\n"
        "  --csv FILE  also write the rows as CSV (one header row)\n";
    cfg c = {.ranks = 2, .tokens = 2048, .in = 2048, .out = 4096, .reps = 5};
    bool cuda = false, cpu_opts = false;
    const char *csv = NULL;
    for (int i = 1; i < argc; i += 2) {
        const char *a = argv[i], *val = i + 1 < argc ? argv[i + 1] : NULL;
        int v = 0;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            fputs(usage, stdout);
            return 0;
        }
        if (!strcmp(a, "--cuda")) {
            cuda = true;
            i--; /* takes no value */
            continue;
        }
        if (!strcmp(a, "--csv") && val) {
            csv = val;
            continue;
        }
        if (strcmp(a, "-g") && strcmp(a, "-t") && strcmp(a, "-i") && strcmp(a, "-o") && strcmp(a, "-r")) {
            fprintf(stderr, "tp-bench-ops: %s '%s'\n%s",
                    strcmp(a, "--csv") ? "unknown option" : "a value is missing after", a, usage);
            return 64;
        }
        if (!val || !bench_parse_int(val, 1, 1 << 20, &v)) {
            fprintf(stderr, "tp-bench-ops: %s '%s': expected an integer in [1, %d]\n%s", a,
                    val ? val : "", 1 << 20, usage);
            return 64;
        }
        cpu_opts = true;
        switch (a[1]) {
        case 'g': c.ranks = v; break;
        case 't': c.tokens = v; break;
        case 'i': c.in = v; break;
        case 'o': c.out = v; break;
        default: c.reps = v; break;
        }
    }
    if (cuda && cpu_opts) {
        fprintf(stderr,
                "tp-bench-ops: --cuda takes no -g, -t, -i, -o or -r (its shapes are fixed)\n");
        return 64;
    }
    if (cuda) {
        if (tp_cuda_device_count() == 0) {
            fprintf(stderr, "tp-bench-ops: --cuda: no CUDA device%s\n",
                    TP_HAVE_CUDA ? "" : " (libtp built without CUDA)");
            return 2;
        }
#if TP_HAVE_CUDA
        return cuda_main(csv);
#endif
    }
    if (c.ranks < 1 || c.out % c.ranks) {
        fprintf(stderr, "tp-bench-ops: -o must be a multiple of -g\n");
        return 64;
    }
    FILE *f = csv ? fopen(csv, "w") : NULL;
    if (csv && !f) {
        perror(csv);
        return 2;
    }
    /* one BLAS thread per rank: the ranks are the parallelism */
    openblas_set_num_threads(1);
    tp_status st = tp_run_local(c.ranks, body, &c);
    if (st != TP_OK) {
        fprintf(stderr, "tp-bench-ops: %s: %s\n", tp_status_name(st), tp_last_error());
        if (f)
            fclose(f);
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
    if (f) {
        fprintf(f, "op,ranks,time_us,bare_us,overhead_us\n");
        const char *names[4] = {"linear", "linear requires_grad", "linear in scopes",
                                "redistribute S(0)->R"};
        double op[4] = {c.op_us, c.op_grad_us, c.op_scoped_us, c.redist_us};
        for (int k = 0; k < 4; k++) {
            double bare = k < 3 ? c.kernel_us : c.coll_us;
            fprintf(f, "%s,%d,%.4f,%.4f,%.4f\n", names[k], c.ranks, op[k], bare, op[k] - bare);
        }
        fprintf(f, "colwise fwd+bwd %lldx%lld->%lld,%d,%.2f,%.2f,%.2f\n", (long long)c.tokens,
                (long long)c.in, (long long)c.out, c.ranks, c.tp_ms * 1e3, c.hand_ms * 1e3,
                (c.tp_ms - c.hand_ms) * 1e3);
        fclose(f);
    }
    return 0;
}
