/*
 * tp-bench-gemm: one local matrix product on a GPU through libtp's public op
 * against the same cuBLAS call made by hand.
 *
 * libtp: tp_linear(x, w, NULL, &y) on plain CUDA tensors, y[M,N] = x[M,K]
 * w[N,K]^T: the CUDA kernel table's cublasGemmEx on the calling thread's
 * stream, with y allocated from libtp's stream-ordered pool and released
 * every call. Bare: the same cublasGemmEx (same operands, transposes,
 * compute type, CUBLAS_GEMM_DEFAULT) on a stream and handle of this program,
 * into one preallocated y. dtypes: bf16 (f32 accumulation), f32 with TF32 off
 * (CUBLAS_COMPUTE_32F) and tf32 (f32 tensors, tp_cuda_set_allow_tf32(true),
 * CUBLAS_COMPUTE_32F_FAST_TF32).
 *
 * Timing: a warm-up call of each, then a batch size chosen so that one batch
 * of libtp calls lasts about --ms milliseconds; each of -R repeats times one
 * batch of each (the order alternating), from a synchronized device to a
 * synchronized device (host clock around the batch, so queueing, launch and
 * allocation count). Rows: TFLOP/s (2 M N K per call) of both, median over
 * the repeats [min .. max], and the throughput ratio libtp / bare per repeat
 * (median [min .. max]); target: the median ratio >= 0.97 (within 3%).
 *
 * tp-bench-gemm --help lists the options.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <tp.h>

#include "bench_util.h"

#if TP_HAVE_CUDA
#include <cublas_v2.h>
#include <cuda_runtime.h>
#endif

enum { MAX_SHAPES = 16, MAX_REPS = 100, D_BF16 = 0, D_F32, D_TF32, D_COUNT };
static const char *dtype_names[D_COUNT] = {"bf16", "f32", "tf32"};

typedef struct opts {
    int64_t shape[MAX_SHAPES][3]; /* M (tokens), K (in), N (out) */
    int ns;
    bool dtypes[D_COUNT];
    int reps, target_ms, device;
    const char *csv;
} opts;

static void usage(FILE *f)
{
    fputs("usage: tp-bench-gemm [-s SHAPES] [--dtype LIST] [-R N] [--ms MS] [-d DEV] [--csv FILE]\n"
          "\n"
          "Times tp_linear on plain CUDA tensors (y[M,N] = x[M,K] w[N,K]^T, libtp's\n"
          "cublasGemmEx) against the same cublasGemmEx by hand, both timed with the\n"
          "device synchronized before and after a batch of calls.\n"
          "\n"
          "option          meaning                                              default\n"
          "  -s SHAPES     comma-separated: S (M = K = N = S) or MxKxN          4096,8192,16384,\n"
          "                (tokens x in x out)                                  8192x2048x8192\n"
          "  --dtype LIST  bf16, f32 (TF32 off), tf32 (f32 tensors, TF32 on)    bf16,f32,tf32\n"
          "  -R N          repeats, each one batch of libtp and one of bare     5\n"
          "                calls (1-100)\n"
          "  --ms MS       the length of one batch of libtp calls (1-10000)     50\n"
          "  -d DEV        CUDA device ordinal                                  0\n"
          "  --csv FILE    also write the rows as CSV (one header row)          none\n"
          "  -h, --help    this text\n"
          "\n"
          "Exit status: 0 done, every median ratio >= 0.97; 1 a ratio below 0.97; 2 no CUDA\n"
          "device, or a libtp or CUDA call failed; 64 bad command line.\n",
          f);
}

/* "S" or "MxKxN", each a positive integer up to 2^20. */
static bool parse_shape(const char *s, size_t len, int64_t out[3])
{
    char buf[64];
    if (len == 0 || len >= sizeof buf)
        return false;
    memcpy(buf, s, len);
    buf[len] = 0;
    if (buf[0] == 'x' || buf[len - 1] == 'x' || strstr(buf, "xx"))
        return false; /* an empty size (strtok would skip it) */
    int n = 0;
    for (char *tok = strtok(buf, "x"); tok; tok = strtok(NULL, "x")) {
        int v = 0;
        if (n == 3 || !bench_parse_int(tok, 1, 1 << 20, &v))
            return false;
        out[n++] = v;
    }
    if (n == 1)
        out[1] = out[2] = out[0];
    return n == 1 || n == 3;
}

static bool parse_shapes(const char *s, opts *o)
{
    o->ns = 0;
    while (*s) {
        size_t len = strcspn(s, ",");
        if (o->ns == MAX_SHAPES || !parse_shape(s, len, o->shape[o->ns]))
            return false;
        o->ns++;
        s += len;
        if (*s && !*++s)
            return false; /* a trailing comma */
    }
    return o->ns > 0;
}

static bool parse_dtypes(const char *s, bool *on)
{
    bool any = false;
    memset(on, 0, sizeof(bool) * D_COUNT);
    while (*s) {
        size_t len = strcspn(s, ",");
        int i = 0;
        while (i < D_COUNT && (strlen(dtype_names[i]) != len || strncmp(s, dtype_names[i], len)))
            i++;
        if (i == D_COUNT)
            return false;
        on[i] = any = true;
        s += len;
        if (*s)
            s++;
    }
    return any;
}

/* -1: go on; otherwise the exit status. */
static int parse_args(int argc, char **argv, opts *o)
{
    *o = (opts){.shape = {{4096, 4096, 4096},
                          {8192, 8192, 8192},
                          {16384, 16384, 16384},
                          {8192, 2048, 8192}},
                .ns = 4,
                .dtypes = {true, true, true},
                .reps = 5,
                .target_ms = 50};
    for (int i = 1; i < argc; i += 2) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        bool ok;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return 0;
        }
        if (strcmp(a, "-s") && strcmp(a, "--dtype") && strcmp(a, "-R") && strcmp(a, "--ms") &&
            strcmp(a, "-d") && strcmp(a, "--csv")) {
            fprintf(stderr, "tp-bench-gemm: %s: unknown option\n", a);
            usage(stderr);
            return 64;
        }
        if (!v) {
            fprintf(stderr, "tp-bench-gemm: %s: its value is missing\n", a);
            return 64;
        }
        if (!strcmp(a, "-s"))
            ok = parse_shapes(v, o);
        else if (!strcmp(a, "--dtype"))
            ok = parse_dtypes(v, o->dtypes);
        else if (!strcmp(a, "-R"))
            ok = bench_parse_int(v, 1, MAX_REPS, &o->reps);
        else if (!strcmp(a, "--ms"))
            ok = bench_parse_int(v, 1, 10000, &o->target_ms);
        else if (!strcmp(a, "-d"))
            ok = bench_parse_int(v, 0, 63, &o->device);
        else
            ok = (o->csv = v) != NULL;
        if (!ok) {
            fprintf(stderr, "tp-bench-gemm: %s '%s': %s\n", a, v,
                    !strcmp(a, "-s")        ? "shapes are S or MxKxN, positive, comma-separated"
                    : !strcmp(a, "--dtype") ? "dtypes are bf16, f32, tf32"
                    : !strcmp(a, "-R")      ? "repeats are 1 to 100"
                    : !strcmp(a, "--ms")    ? "milliseconds are 1 to 10000"
                                            : "a device ordinal is 0 to 63");
            return 64;
        }
    }
    return -1;
}

#if TP_HAVE_CUDA

/* The bare side: this program's stream and cuBLAS handle. */
typedef struct bare {
    cudaStream_t s;
    cublasHandle_t h;
} bare;

typedef struct gemm_case {
    int64_t m, k, n;
    int d; /* D_* */
    tp_tensor *x, *w, *yb;
} gemm_case;

static tp_status cuda_check(cudaError_t e, const char *what)
{
    if (e == cudaSuccess)
        return TP_OK;
    fprintf(stderr, "tp-bench-gemm: %s: %s\n", what, cudaGetErrorString(e));
    return TP_ERR_BACKEND;
}

/* The call gemm_on in src/kernels/cuda.cu makes for tp_linear (row-major
 * y = x w^T read column-major: y^T = w x^T, w transposed). */
static tp_status bare_gemm(bare *b, const gemm_case *c)
{
    float one = 1, zero = 0;
    cudaDataType_t t = c->d == D_BF16 ? CUDA_R_16BF : CUDA_R_32F;
    cublasComputeType_t ct = c->d == D_TF32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    int m = (int)c->m, n = (int)c->n, k = (int)c->k;
    cublasStatus_t s = cublasGemmEx(b->h, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &one,
                                    tp_tensor_data(c->w), t, k, tp_tensor_data(c->x), t, k, &zero,
                                    tp_tensor_data(c->yb), t, n, ct, CUBLAS_GEMM_DEFAULT);
    if (s != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "tp-bench-gemm: cublasGemmEx: status %d\n", (int)s);
        return TP_ERR_BACKEND;
    }
    return TP_OK;
}

static tp_status tp_gemm(const gemm_case *c)
{
    tp_tensor *y = NULL;
    tp_status st = tp_linear(c->x, c->w, NULL, &y);
    tp_tensor_release(y);
    if (st != TP_OK)
        fprintf(stderr, "tp-bench-gemm: tp_linear: %s (%s)\n", tp_status_name(st), tp_last_error());
    return st;
}

/* Seconds for `iters` calls, from a synchronized device to a synchronized
 * device; libtp's side (bare NULL) or the bare one. */
static tp_status time_batch(bare *b, const gemm_case *c, int dev, int iters, double *sec)
{
    tp_status st = cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    double t0 = bench_now_s();
    for (int i = 0; i < iters && st == TP_OK; i++)
        st = b ? bare_gemm(b, c) : tp_gemm(c);
    if (st == TP_OK)
        st = b ? cuda_check(cudaStreamSynchronize(b->s), "cudaStreamSynchronize")
               : tp_cuda_synchronize(dev);
    if (st == TP_OK)
        st = cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    *sec = bench_now_s() - t0;
    return st;
}

typedef struct result {
    double tp[MAX_REPS], bare[MAX_REPS], ratio[MAX_REPS];
    int iters;
} result;

static tp_status run_case(bare *b, gemm_case *c, const opts *o, result *res)
{
    tp_dtype dt = c->d == D_BF16 ? TP_BF16 : TP_F32;
    tp_device dev = TP_CUDA(o->device);
    int64_t xs[2] = {c->m, c->k}, ws[2] = {c->n, c->k}, ys[2] = {c->m, c->n};
    tp_status st = tp_cuda_set_allow_tf32(c->d == D_TF32);
    if (st == TP_OK)
        st = tp_tensor_empty(dt, dev, 2, xs, &c->x);
    if (st == TP_OK)
        st = tp_tensor_empty(dt, dev, 2, ws, &c->w);
    if (st == TP_OK)
        st = tp_tensor_empty(dt, dev, 2, ys, &c->yb);
    /* random operands: tensor cores slow down on real data, not on zeros */
    if (st == TP_OK)
        st = tp_tensor_fill_random(c->x, TP_RNG_UNIFORM, -1, 1, 1, NULL, NULL);
    if (st == TP_OK)
        st = tp_tensor_fill_random(c->w, TP_RNG_UNIFORM, -1, 1, 2, NULL, NULL);
    if (st != TP_OK) {
        fprintf(stderr, "tp-bench-gemm: operands: %s (%s)\n", tp_status_name(st), tp_last_error());
        return st;
    }
    double t1 = 0, tb = 0;
    st = time_batch(NULL, c, o->device, 1, &t1); /* warm-up, and the batch size */
    if (st == TP_OK)
        st = time_batch(b, c, o->device, 1, &tb);
    if (st == TP_OK)
        st = time_batch(NULL, c, o->device, 1, &t1);
    double want = o->target_ms * 1e-3 / (t1 > 0 ? t1 : 1e-6);
    res->iters = want < 1 ? 1 : want > 10000 ? 10000 : (int)ceil(want);
    for (int r = 0; r < o->reps && st == TP_OK; r++) {
        /* alternate which side goes first, so that neither always follows the other */
        bool tp_first = r % 2 == 0;
        st = time_batch(tp_first ? NULL : b, c, o->device, res->iters,
                        tp_first ? &res->tp[r] : &res->bare[r]);
        if (st == TP_OK)
            st = time_batch(tp_first ? b : NULL, c, o->device, res->iters,
                            tp_first ? &res->bare[r] : &res->tp[r]);
        res->ratio[r] = res->bare[r] / res->tp[r];
    }
    return st;
}

static void min_max(const double *v, int n, double *lo, double *hi)
{
    *lo = *hi = v[0];
    for (int i = 1; i < n; i++) {
        *lo = v[i] < *lo ? v[i] : *lo;
        *hi = v[i] > *hi ? v[i] : *hi;
    }
}

/* Median [min .. max] of flop / seconds in TFLOP/s, or of the ratios. */
static void summarize(const double *sec, int n, double flop, double out[3])
{
    double v[MAX_REPS];
    for (int i = 0; i < n; i++)
        v[i] = flop > 0 ? flop / sec[i] / 1e12 : sec[i];
    out[0] = bench_median(v, n);
    min_max(v, n, &out[1], &out[2]);
}

static int run_all(const opts *o, FILE *fcsv)
{
    struct cudaDeviceProp prop;
    bare b = {0};
    int rc = 0;
    if (cuda_check(cudaSetDevice(o->device), "cudaSetDevice") != TP_OK ||
        cuda_check(cudaGetDeviceProperties(&prop, o->device), "cudaGetDeviceProperties") != TP_OK ||
        cuda_check(cudaStreamCreate(&b.s), "cudaStreamCreate") != TP_OK)
        return 2;
    if (cublasCreate(&b.h) != CUBLAS_STATUS_SUCCESS ||
        cublasSetStream(b.h, b.s) != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "tp-bench-gemm: cublasCreate failed\n");
        cudaStreamDestroy(b.s);
        return 2;
    }
    for (char *p = prop.name; *p; p++)
        if (*p == ',')
            *p = ' ';
    printf("# tp-bench-gemm on cuda:%d, %s; %d repeats, batches of about %d ms; TFLOP/s median "
           "[min .. max]; ratio = libtp / bare throughput per repeat\n",
           o->device, prop.name, o->reps, o->target_ms);
    printf("%-6s %6s %6s %6s %6s %9s %19s %9s %19s %6s %15s %8s\n", "dtype", "M", "K", "N", "iters",
           "libtp", "[min .. max]", "bare", "[min .. max]", "ratio", "[min .. max]", "of peak");
    if (fcsv)
        fprintf(fcsv, "dtype,m,k,n,iters,reps,tflops,tflops_min,tflops_max,bare_tflops,"
                      "bare_tflops_min,bare_tflops_max,ratio,ratio_min,ratio_max,peak_tflops,"
                      "device\n");
    for (int d = 0; d < D_COUNT && rc != 2; d++) {
        if (!o->dtypes[d])
            continue;
        double peak = bench_gpu_peak_tflops(prop.name, dtype_names[d]);
        for (int si = 0; si < o->ns && rc != 2; si++) {
            gemm_case c = {o->shape[si][0], o->shape[si][1], o->shape[si][2], d, NULL, NULL, NULL};
            result res = {0};
            tp_status st = run_case(&b, &c, o, &res);
            tp_tensor_release(c.x);
            tp_tensor_release(c.w);
            tp_tensor_release(c.yb);
            if (st != TP_OK) {
                rc = 2;
                break;
            }
            double flop = 2.0 * (double)c.m * (double)c.n * (double)c.k * res.iters, a[3], bb[3],
                   q[3];
            summarize(res.tp, o->reps, flop, a);
            summarize(res.bare, o->reps, flop, bb);
            summarize(res.ratio, o->reps, 0, q);
            char pk[32] = "unknown";
            if (peak > 0)
                snprintf(pk, sizeof pk, "%.1f%%", 100 * a[0] / peak);
            printf("%-6s %6lld %6lld %6lld %6d %9.1f [%7.1f .. %7.1f] %9.1f [%7.1f .. %7.1f] %6.3f "
                   "[%.3f .. %.3f] %8s %s\n",
                   dtype_names[d], (long long)c.m, (long long)c.k, (long long)c.n, res.iters, a[0],
                   a[1], a[2], bb[0], bb[1], bb[2], q[0], q[1], q[2], pk,
                   q[0] >= 0.97 ? "PASS" : "FAIL");
            fflush(stdout);
            if (q[0] < 0.97)
                rc = 1;
            if (fcsv)
                fprintf(fcsv,
                        /* %g: a tiny shape's TFLOP/s would print as 0.00 in fixed point */
                        "%s,%lld,%lld,%lld,%d,%d,%.6g,%.6g,%.6g,%.6g,%.6g,%.6g,%.4f,%.4f,"
                        "%.4f,%.1f,%s\n",
                        dtype_names[d], (long long)c.m, (long long)c.k, (long long)c.n, res.iters,
                        o->reps, a[0], a[1], a[2], bb[0], bb[1], bb[2], q[0], q[1], q[2], peak,
                        prop.name);
        }
    }
    if (!bench_gpu_peak_tflops(prop.name, "bf16"))
        printf("# peak unknown for %s\n", prop.name);
    (void)tp_cuda_set_allow_tf32(false);
    cublasDestroy(b.h);
    cudaStreamDestroy(b.s);
    return rc;
}
#endif

int main(int argc, char **argv)
{
    opts o;
    int rc = parse_args(argc, argv, &o);
    if (rc >= 0)
        return rc;
    int ndev = tp_cuda_device_count();
    if (ndev == 0) {
        fprintf(stderr, "tp-bench-gemm: no CUDA device%s\n",
                TP_HAVE_CUDA ? "" : " (libtp built without CUDA)");
        return 2;
    }
    if (o.device >= ndev) {
        fprintf(stderr, "tp-bench-gemm: -d %d: there %s %d CUDA device%s\n", o.device,
                ndev == 1 ? "is" : "are", ndev, ndev == 1 ? "" : "s");
        return 64;
    }
#if TP_HAVE_CUDA
    FILE *fcsv = o.csv ? fopen(o.csv, "w") : NULL;
    if (o.csv && !fcsv) {
        perror(o.csv);
        return 2;
    }
    rc = run_all(&o, fcsv);
    if (fcsv)
        fclose(fcsv);
    return rc;
#else
    return 2;
#endif
}
