/* bench-kernels-dtype: the CPU engine's bf16 and f16 entries against f32 on
 * the same shapes (not a test; built on demand:
 * `ninja -C build tests/bench-kernels-dtype`).
 *
 * Usage: bench-kernels-dtype [ROWS IN OUT [N [REPS]]]
 *   linear_fwd y[ROWS, OUT] = x[ROWS, IN] W[OUT, IN]^T (default 2048 8192 2048)
 *   gelu_fwd (exact) and gelu_bwd on N elements (default 16M)
 * Prints the median (and the fastest) of REPS runs (default 5) per entry and
 * dtype, the dtypes interleaved, and the bf16/f16 median over the f32 one. Links libtp's objects (the kernel tables
 * are hidden in the library). */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "core/base.h"
#include "kernels/kernels.h"

static const tp__kernels *const K = &tp__kernels_cpu;
static const tp_device CPU = {TP_DEVICE_CPU, 0};

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* n random values in [-2, 2) of dtype */
static void *rnd(tp_dtype dt, int64_t n, uint64_t seed)
{
    void *p = malloc((size_t)n * tp_dtype_size(dt));
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(1);
    }
    for (int64_t i = 0; i < n; i++)
        tp__store_f64(p, dt, i, 4.0 * tp_rng_uniform(seed, (uint64_t)i) - 2.0);
    return p;
}

enum { OP_LINEAR, OP_GELU_FWD, OP_GELU_BWD, NOPS };
static const char *const op_names[NOPS] = {"linear_fwd", "gelu_fwd", "gelu_bwd"};

static tp_status run(int op, tp_dtype dt, void *const *b, int64_t rows, int64_t in, int64_t out,
                     int64_t n)
{
    switch (op) {
    case OP_LINEAR:
        return K->linear_fwd(CPU, dt, b[0], b[1], NULL, b[2], rows, in, out);
    case OP_GELU_FWD:
        return K->gelu_fwd(CPU, dt, b[0], b[1], n, false);
    default:
        return K->gelu_bwd(CPU, dt, b[0], b[1], b[2], n, false);
    }
}

int main(int argc, char **argv)
{
    int64_t rows = argc > 3 ? atoll(argv[1]) : 2048, in = argc > 3 ? atoll(argv[2]) : 8192;
    int64_t out = argc > 3 ? atoll(argv[3]) : 2048, n = argc > 4 ? atoll(argv[4]) : 16 << 20;
    int reps = argc > 5 ? atoi(argv[5]) : 5;
    if (rows <= 0 || in <= 0 || out <= 0 || n <= 0 || reps <= 0 || reps > 100) {
        fprintf(stderr, "usage: %s [ROWS IN OUT [N [REPS]]]\n", argv[0]);
        return 64;
    }
    const tp_dtype dts[3] = {TP_F32, TP_BF16, TP_F16};
    printf("linear_fwd %lld x %lld x %lld, gelu on %lld elements, median of %d\n", (long long)rows,
           (long long)in, (long long)out, (long long)n, reps);
    for (int op = 0; op < NOPS; op++) {
        void *b[3][3];
        for (int d = 0; d < 3; d++)
            for (int i = 0; i < 3; i++) {
                int64_t len = op != OP_LINEAR ? n
                              : i == 0        ? rows * in
                              : i == 1        ? out * in
                                              : rows * out;
                b[d][i] = rnd(dts[d], len, 1 + (uint64_t)i);
            }
        /* the dtypes interleaved, run after run, so that load on the machine
         * spreads over all three; the first round warms up */
        double t[3][100];
        for (int r = 0; r <= reps; r++)
            for (int d = 0; d < 3; d++) {
                double t0 = now_s();
                tp_status st = run(op, dts[d], b[d], rows, in, out, n);
                if (st != TP_OK) {
                    fprintf(stderr, "%s %s: %s\n", op_names[op], tp_dtype_name(dts[d]),
                            tp_status_name(st));
                    return 1;
                }
                if (r > 0)
                    t[d][r - 1] = now_s() - t0;
            }
        double base = 0;
        for (int d = 0; d < 3; d++) {
            qsort(t[d], (size_t)reps, sizeof t[d][0], cmp_d);
            double med = t[d][reps / 2];
            base = d == 0 ? med : base;
            printf("%-10s %-4s %10.2f ms (min %.2f)  x%.2f of f32\n", op_names[op],
                   tp_dtype_name(dts[d]), med * 1e3, t[d][0] * 1e3, med / base);
            for (int i = 0; i < 3; i++)
                free(b[d][i]);
        }
    }
    return 0;
}
