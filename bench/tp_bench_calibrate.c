/*
 * tp-bench-calibrate: writes the hardware description of this machine
 * (tp/hw.h, docs/plan.md) from measurements made through libtp itself, so
 * that plans for it use what it does rather than a data sheet.
 *
 * - GEMM: tp_matmul on square CPU matrices of side 32, 64, 128, 192, 256,
 *   384, 512, 768, 1024, 2048 (-q: 32, 128, 512) in f32 and bf16. The peak
 *   of a dtype is the best rate measured; the efficiency table has a row
 *   per side with that side's rate over the peak (row 0 for the smallest
 *   side).
 * - Devices: a device is the cores one GEMM runs on, OpenBLAS's thread count
 *   (OPENBLAS_NUM_THREADS, else OMP_NUM_THREADS, else every core), so
 *   devices_per_node is the core count over it: run with
 *   OPENBLAS_NUM_THREADS=1 to describe one device per core, the layout of
 *   shm ranks each on a core of their own.
 * - Memory bandwidth: tp_add of two 16 Mi-element f32 vectors (-q: 1 Mi),
 *   three vectors' bytes (two read, one written) over the time, on every
 *   device at once (one thread each; under mpi, every process): what one
 *   device gets while the others stream too, as in a step.
 * - Kernel latency: tp_add of one-element vectors, the whole call (dispatch,
 *   allocation, release) per op.
 * - Links: tp_all_reduce (f32 sum) over W ranks of the shm backend (threads),
 *   or with --backend mpi (under mpirun -np W) over an "mpi" world of one
 *   process per rank, 4 KiB to 16 MiB (-q: to 256 KiB), fitted to the ring
 *   model time = 2(W-1) alpha + 2(W-1)/W S / B by least squares; both link
 *   classes get the fit (one machine: no link across nodes), without async
 *   progress (on the CPU, libtp's shm and mpi backends move an asynchronous
 *   collective's data only inside test and wait calls). Under mpi,
 *   rank 0 measures the compute alone (the others wait) and writes.
 *
 * Each point is the median of -r repetitions (default 5) of a batch timed
 * as a whole. The description is written with tp_hw_write_json, read back
 * with tp_hw_load_file (so it is checked as any file is), and the measured
 * points are printed beside what the description predicts for them.
 *
 * Usage: tp-bench-calibrate [-o FILE] [-w RANKS] [-r REPS] [-q] [--backend shm|mpi]
 *   FILE: where the description goes (default: standard output only);
 *   RANKS: the all_reduce's shm world (2-64, default 2; mpi: mpirun's -np).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <tp.h>

#include "bench_util.h"

#define MAX_PTS 16

typedef struct {
    int reps;
    bool quick;
    int world;
    int nsizes;
    double sizes[MAX_PTS], secs[MAX_PTS]; /* all_reduce points */
    tp_comm *mpi;                         /* --backend mpi: the world; NULL: shm threads */
} calib_t;

/* ---- compute ------------------------------------------------------------------- */

static tp_status gemm_rate(tp_dtype dt, int64_t d, int reps, bool quick, double *flops)
{
    int64_t shape[2] = {d, d};
    tp_tensor *a = NULL, *b = NULL;
    tp_status st = tp_tensor_empty(dt, TP_CPU, 2, shape, &a);
    if (st == TP_OK)
        st = tp_tensor_empty(dt, TP_CPU, 2, shape, &b);
    if (st == TP_OK)
        st = tp_tensor_fill(a, 0.5);
    if (st == TP_OK)
        st = tp_tensor_fill(b, 0.25);
    /* a batch of about 2 GFLOP (-q: 0.2; at least one product) */
    int batch = (int)fmax(1, (quick ? 2e8 : 2e9) / (2.0 * d * d * d));
    double t[32];
    for (int r = 0; r <= reps && st == TP_OK; r++) { /* r 0: warm-up */
        double t0 = bench_now_s();
        for (int i = 0; i < batch && st == TP_OK; i++) {
            tp_tensor *y = NULL;
            st = tp_matmul(a, b, &y);
            tp_tensor_release(y);
        }
        if (r > 0)
            t[r - 1] = (bench_now_s() - t0) / batch;
    }
    if (st == TP_OK)
        *flops = 2.0 * d * d * d / bench_median(t, reps);
    tp_tensor_release(a);
    tp_tensor_release(b);
    return st;
}

/* Seconds per tp_add of two n-element f32 vectors. */
static tp_status add_time(int64_t n, int batch, int reps, double *secs)
{
    tp_tensor *a = NULL, *b = NULL;
    tp_status st = tp_tensor_zeros(TP_F32, TP_CPU, 1, &n, &a);
    if (st == TP_OK)
        st = tp_tensor_zeros(TP_F32, TP_CPU, 1, &n, &b);
    double t[32];
    for (int r = 0; r <= reps && st == TP_OK; r++) {
        double t0 = bench_now_s();
        for (int i = 0; i < batch && st == TP_OK; i++) {
            tp_tensor *y = NULL;
            st = tp_add(a, b, &y);
            tp_tensor_release(y);
        }
        if (r > 0)
            t[r - 1] = (bench_now_s() - t0) / batch;
    }
    if (st == TP_OK)
        *secs = bench_median(t, reps);
    tp_tensor_release(a);
    tp_tensor_release(b);
    return st;
}

/* tp_add streams on every device at once (devices shm threads): a rank's
 * element-wise work in a step runs while the other devices' ranks stream
 * too, so the memory bandwidth of one device is what it gets then. */
typedef struct {
    int64_t n;
    int batch, reps;
    double secs[64];
} stream_t;

static tp_status stream_rank(tp_comm *w, void *arg)
{
    stream_t *s = arg;
    tp_status st = tp_barrier(w, NULL);
    return st != TP_OK ? st : add_time(s->n, s->batch, s->reps, &s->secs[tp_comm_rank(w)]);
}

/* ---- links --------------------------------------------------------------------------- */

static tp_status ar_rank(tp_comm *w, void *arg)
{
    calib_t *c = arg;
    tp_status st = TP_OK;
    tp_tensor *x = NULL;
    for (int k = 0; k < c->nsizes; k++) {
        int64_t n = (int64_t)(c->sizes[k] / 4);
        TRY(tp_tensor_zeros(TP_F32, TP_CPU, 1, &n, &x));
        int batch = (int)fmax(4, fmin(1000, 2e8 / c->sizes[k]));
        double t[32];
        for (int r = 0; r <= c->reps; r++) {
            TRY(tp_barrier(w, NULL));
            double t0 = bench_now_s();
            for (int i = 0; i < batch; i++)
                TRY(tp_all_reduce(w, x, x, TP_SUM, NULL));
            TRY(tp_barrier(w, NULL));
            if (r > 0)
                t[r - 1] = (bench_now_s() - t0) / batch;
        }
        if (tp_comm_rank(w) == 0)
            c->secs[k] = bench_median(t, c->reps);
        tp_tensor_release(x);
        x = NULL;
    }
out:
    tp_tensor_release(x);
    return st;
}

/* Least squares of secs = a + b * size over the points, each weighted by
 * 1 / secs^2: relative errors, so that the small sizes (latency) count as
 * much as the large ones (bandwidth). */
static void fit_line(const calib_t *c, double *a, double *b)
{
    double sw = 0, sx = 0, sy = 0, sxx = 0, sxy = 0;
    for (int k = 0; k < c->nsizes; k++) {
        double w = 1 / (c->secs[k] * c->secs[k]), x = c->sizes[k], y = c->secs[k];
        sw += w;
        sx += w * x;
        sy += w * y;
        sxx += w * x * x;
        sxy += w * x * y;
    }
    *b = (sw * sxy - sx * sy) / (sw * sxx - sx * sx);
    *a = (sy - *b * sx) / sw;
}

/* ---- the description ------------------------------------------------------------------ */

enum { NSIDES = 10 };
static const int64_t sides[NSIDES] = {32, 64, 128, 192, 256, 384, 512, 768, 1024, 2048};
static const int64_t quick_sides[3] = {32, 128, 512};

/* The cores one GEMM runs on: OpenBLAS's thread count as the environment
 * sets it (it reads it when it loads), else every core of this process. */
static int blas_threads(void)
{
    const char *vars[] = {"OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"};
    for (int i = 0; i < 2; i++) {
        int v = 0;
        const char *e = getenv(vars[i]);
        if (e && bench_parse_int(e, 1, 1 << 16, &v))
            return v < bench_cores() ? v : bench_cores();
    }
    return bench_cores();
}

/* Memory bandwidth per device: tp_add on every device at once (shm: one
 * thread per device; mpi: every process of the world). Collective under
 * mpi. */
static int measure_stream(const calib_t *c, int devices, double *mem_bw)
{
    stream_t st = {
        .n = c->quick ? (1 << 20) : (1 << 24), .batch = c->quick ? 8 : 4, .reps = c->reps};
    int nd = devices < 64 ? devices : 64;
    double t = 0; /* the mean time of the streams */
    if (c->mpi) {
        nd = tp_comm_size(c->mpi);
        int64_t one = 1;
        tp_tensor *sum = NULL;
        double mine = 0;
        tp_status s = tp_barrier(c->mpi, NULL);
        if (s == TP_OK)
            s = add_time(st.n, st.batch, st.reps, &mine);
        if (s == TP_OK)
            s = tp_tensor_from_blob(TP_F64, TP_CPU, 1, &one, &mine, NULL, NULL, &sum);
        if (s == TP_OK)
            s = tp_all_reduce(c->mpi, sum, sum, TP_AVG, NULL);
        tp_tensor_release(sum);
        if (s != TP_OK)
            return 1;
        t = mine;
    } else {
        if ((nd > 1 ? tp_run_local(nd, stream_rank, &st)
                    : add_time(st.n, st.batch, st.reps, &st.secs[0])) != TP_OK)
            return 1;
        for (int d = 0; d < nd; d++)
            t += st.secs[d] / nd;
    }
    *mem_bw = 3.0 * 4 * (double)st.n / t;
    if (!c->mpi || tp_comm_rank(c->mpi) == 0)
        printf("memory bandwidth (tp_add, %lld f32, on %d %s at once): %.2f GB/s each\n",
               (long long)st.n, nd,
               c->mpi    ? "processes"
               : nd == 1 ? "device"
                         : "devices",
               *mem_bw / 1e9);
    return 0;
}

static int measure_compute(const calib_t *c, double peak[2], double eff[2][NSIDES], int *nsides,
                           double *lat)
{
    *nsides = c->quick ? 3 : NSIDES;
    const int64_t *side = c->quick ? quick_sides : sides;
    const tp_dtype dts[2] = {TP_F32, TP_BF16};
    for (int di = 0; di < 2; di++) {
        double rate[NSIDES];
        peak[di] = 0;
        for (int i = 0; i < *nsides; i++) {
            if (gemm_rate(dts[di], side[i], c->reps, c->quick, &rate[i]) != TP_OK)
                return 1;
            peak[di] = fmax(peak[di], rate[i]);
            printf("gemm %-4s %5lld^3: %8.2f GFLOP/s\n", tp_dtype_name(dts[di]), (long long)side[i],
                   rate[i] / 1e9);
        }
        for (int i = 0; i < *nsides; i++)
            eff[di][i] = rate[i] / peak[di];
    }
    if (add_time(1, 2000, c->reps, lat) != TP_OK)
        return 1;
    printf("per-op latency (tp_add of 1): %.2f us\n", *lat * 1e6);
    return 0;
}

static int measure_links(calib_t *c, double *alpha, double *bw)
{
    c->nsizes = 0;
    for (double s = 4096; s <= (c->quick ? 262144 : 16777216); s *= 4)
        c->sizes[c->nsizes++] = s;
    if ((c->mpi ? ar_rank(c->mpi, c) : tp_run_local(c->world, ar_rank, c)) != TP_OK) {
        fprintf(stderr, "tp-bench-calibrate: the all_reduce sweep: %s\n", tp_last_error());
        return 1;
    }
    if (c->mpi && tp_comm_rank(c->mpi) != 0)
        return 0;
    double a = 0, b = 0;
    fit_line(c, &a, &b);
    int g = c->world;
    *alpha = fmax(0, a / (2.0 * (g - 1)));
    *bw = b > 0 ? 2.0 * (g - 1) / g / b : 1e12;
    printf("%s all_reduce over %d ranks: alpha %.2f us, B %.2f GB/s (ring fit)\n",
           c->mpi ? "mpi" : "shm", g, *alpha * 1e6, *bw / 1e9);
    return 0;
}

static int describe(calib_t *c, char *json, size_t len)
{
    double peak[2], eff[2][NSIDES], mem_bw = 0, lat = 0, alpha = 0, bw = 0;
    int ns = 0;
    const int64_t *side = c->quick ? quick_sides : sides;
    /* under mpirun each process may be bound to a core of its own: the node's
     * cores are those of every process together */
    int cores = c->mpi ? bench_world_cores(c->mpi) : bench_cores();
    int threads = blas_threads(), devices = cores >= threads ? cores / threads : 1;
    bool lead = !c->mpi || tp_comm_rank(c->mpi) == 0;
    if (lead)
        printf("BLAS threads per GEMM: %d of %d cores: %d device%s per node%s\n", threads, cores,
               devices, devices == 1 ? "" : "s",
               threads > 1 ? " (OPENBLAS_NUM_THREADS=1 describes one device per core)" : "");
    if (lead && measure_compute(c, peak, eff, &ns, &lat))
        return 1;
    if (c->mpi && tp_barrier(c->mpi, NULL) != TP_OK) /* the others wait for it */
        return 1;
    if (measure_stream(c, devices, &mem_bw))
        return 1;
    if (measure_links(c, &alpha, &bw))
        return 1;
    if (!lead)
        return 0;
    /* one table for both dtypes: f32's (bf16 converts and calls sgemm on the CPU) */
    char rows[1024] = "";
    for (int i = 0; i < ns; i++) {
        size_t at = strlen(rows);
        snprintf(rows + at, sizeof rows - at, "%s{\"min_dim\": %lld, \"efficiency\": %.4f}",
                 i ? ", " : "", i ? (long long)side[i] : 0LL, fmax(1e-4, eff[0][i]));
    }
    snprintf(json, len,
             "{\"name\": \"this-machine\", \"description\": \"calibrated by tp-bench-calibrate on "
             "%d cores, %d BLAS thread%s per GEMM: tp_matmul, tp_add, %s all_reduce over %d "
             "ranks\", \"devices_per_node\": %d, \"compute\": {\"peak_flops\": {\"f32\": %.6g, "
             "\"bf16\": "
             "%.6g}, \"gemm_efficiency\": [%s], \"memory_bandwidth\": %.6g, \"kernel_latency\": "
             "%.6g}, \"links\": {\"intra_node\": {\"latency\": %.6g, \"bandwidth\": %.6g, "
             "\"algorithm\": \"ring\", \"async_progress\": false}, \"inter_node\": {\"latency\": "
             "%.6g, \"bandwidth\": %.6g, \"algorithm\": \"ring\", \"async_progress\": false}}}",
             cores, threads, threads == 1 ? "" : "s", c->mpi ? "mpi" : "shm", c->world, devices,
             peak[0], peak[1], rows, mem_bw, lat, alpha, bw, alpha, bw);
    return 0;
}

static int report(const calib_t *c, const tp_hw *hw)
{
    printf("%12s %12s %12s %7s\n", "all_reduce", "measured us", "model us", "model/m");
    for (int k = 0; k < c->nsizes; k++) {
        double t = 0;
        if (tp_hw_collective_time(hw, TP_COLL_ALL_REDUCE, c->world, TP_LINK_INTRA_NODE,
                                  (uint64_t)c->sizes[k], &t) != TP_OK)
            return 1;
        printf("%10.0f B %12.2f %12.2f %7.2f\n", c->sizes[k], c->secs[k] * 1e6, t * 1e6,
               t / c->secs[k]);
    }
    return 0;
}

int main(int argc, char **argv)
{
    calib_t c = {.reps = 5, .world = 2};
    const char *out = NULL;
    bool mpi = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-o") && i + 1 < argc)
            out = argv[++i];
        else if (!strcmp(argv[i], "-w") && i + 1 < argc &&
                 bench_parse_int(argv[i + 1], 2, 64, &c.world))
            i++;
        else if (!strcmp(argv[i], "-r") && i + 1 < argc &&
                 bench_parse_int(argv[i + 1], 1, 31, &c.reps))
            i++;
        else if (!strcmp(argv[i], "-q"))
            c.quick = true;
        else if (!strcmp(argv[i], "--backend") && i + 1 < argc &&
                 (!strcmp(argv[i + 1], "shm") || !strcmp(argv[i + 1], "mpi")))
            mpi = !strcmp(argv[++i], "mpi");
        else {
            fprintf(stderr,
                    "tp-bench-calibrate: bad option '%s'\n"
                    "usage: %s [-o FILE] [-w RANKS (2-64)] [-r REPS (1-31)] [-q] "
                    "[--backend shm|mpi]\n",
                    argv[i], argv[0]);
            return 2;
        }
    }
    if (mpi) {
        if (tp_comm_create_world("mpi", NULL, &c.mpi) != TP_OK) {
            fprintf(stderr, "tp-bench-calibrate: tp_comm_create_world(\"mpi\"): %s\n",
                    tp_last_error());
            return 1;
        }
        c.world = tp_comm_size(c.mpi);
        if (c.world < 2) {
            fprintf(stderr, "tp-bench-calibrate: --backend mpi needs mpirun -np 2 or more\n");
            tp_comm_free(c.mpi);
            return 2;
        }
    }
    static char json[4096];
    int drc = describe(&c, json, sizeof json);
    if (c.mpi && (drc || tp_comm_rank(c.mpi) != 0)) {
        tp_comm_free(c.mpi);
        return drc;
    }
    if (drc)
        return 1;
    tp_hw *hw = NULL;
    if (tp_hw_load_string(json, "this-machine", &hw) != TP_OK) {
        fprintf(stderr, "tp-bench-calibrate: %s\n", tp_last_error());
        tp_comm_free(c.mpi);
        return 1;
    }
    int rc = report(&c, hw);
    FILE *f = out ? fopen(out, "w") : stdout;
    if (!f || tp_hw_write_json(hw, f) != TP_OK || (out && fclose(f) != 0)) {
        fprintf(stderr, "tp-bench-calibrate: cannot write %s\n", out ? out : "stdout");
        rc = 1;
    }
    tp_hw_free(hw);
    if (rc == 0 && out) {
        if (tp_hw_load_file(out, &hw) != TP_OK) {
            fprintf(stderr, "tp-bench-calibrate: %s\n", tp_last_error());
            tp_comm_free(c.mpi);
            return 1;
        }
        printf("wrote %s (%s, read back)\n", out, tp_hw_name(hw));
        tp_hw_free(hw);
    }
    tp_comm_free(c.mpi);
    return rc;
}
