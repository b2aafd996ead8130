/*
 * tp-bench-attn: scaled dot-product attention through libtp's public op,
 * the fused (flash) backend against the math one, same inputs, same run.
 *
 * Each repeat times one forward without a gradient and one forward +
 * backward (the output gradient a fixed random tensor), from a
 * synchronized device to a synchronized device, for each backend in turn
 * (the order alternating). Rows: milliseconds and TFLOP/s (causal: half of
 * 4 B Hq S^2 D for the forward, 2.5 times that for the backward, as
 * FlashAttention counts), median [min .. max] over the repeats, the peak
 * memory the forward + backward allocated beyond its inputs, and on a GPU
 * the fraction of the dense bf16 peak. The flash / math time ratio per
 * repeat closes the table.
 *
 * tp-bench-attn --help lists the options.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <tp.h>

#include "bench_util.h"

#if TP_HAVE_CUDA
#include <cuda_runtime.h>
#endif

typedef struct {
    tp_device dev;
    tp_dtype dt;
    int B, Hq, Hkv, S, D, reps;
    bool causal, fwd_only;
    int backends; /* bit 0 math, bit 1 flash */
    const char *csv;
} opts;

static void usage(FILE *f)
{
    fprintf(f,
            "usage: tp-bench-attn [--cuda] [-t f32|bf16|f16] [-b B] [-H HEADS] [-K KV_HEADS]\n"
            "                     [-s SEQ] [-D HEAD_DIM] [--no-causal] [--backend math|flash|both]\n"
            "                     [--fwd-only] [-r REPEATS] [--csv FILE]\n"
            "Defaults: CPU, f32, B 1, 8 heads, 8 kv heads, seq 1024, head dim 64, causal,\n"
            "both backends, 5 repeats (--cuda: bf16, 32 heads, 8 kv heads, seq 4096, head\n"
            "dim 128). Exit status: 0 done; 1 a run failed; 2 no CUDA device; 64 a bad\n"
            "command line (the message names the option).\n");
}

static int parse(int argc, char **argv, opts *o)
{
    *o = (opts){TP_CPU, TP_F32, 1, 8, 8, 1024, 64, 5, true, false, 3, NULL};
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--cuda")) {
            o->dev = (tp_device){TP_DEVICE_CUDA, 0};
            o->dt = TP_BF16;
            o->Hq = 32;
            o->Hkv = 8;
            o->S = 4096;
            o->D = 128;
        }
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int *num = !strcmp(a, "-b")   ? &o->B
                   : !strcmp(a, "-H") ? &o->Hq
                   : !strcmp(a, "-K") ? &o->Hkv
                   : !strcmp(a, "-s") ? &o->S
                   : !strcmp(a, "-D") ? &o->D
                   : !strcmp(a, "-r") ? &o->reps
                                      : NULL;
        if (num) {
            if (!v || !bench_parse_int(v, 1, 1 << 24, num)) {
                fprintf(stderr, "tp-bench-attn: %s takes a positive integer, not '%s'\n", a,
                        v ? v : "");
                return 64;
            }
            i++;
        } else if (!strcmp(a, "--cuda")) {
        } else if (!strcmp(a, "--no-causal")) {
            o->causal = false;
        } else if (!strcmp(a, "--fwd-only")) {
            o->fwd_only = true;
        } else if (!strcmp(a, "-t") && v) {
            o->dt = !strcmp(v, "f32") ? TP_F32 : !strcmp(v, "bf16") ? TP_BF16
                                             : !strcmp(v, "f16")    ? TP_F16
                                                                    : TP_F64;
            if (o->dt == TP_F64) {
                fprintf(stderr, "tp-bench-attn: -t takes f32, bf16 or f16, not '%s'\n", v);
                return 64;
            }
            i++;
        } else if (!strcmp(a, "--backend") && v) {
            o->backends = !strcmp(v, "math") ? 1 : !strcmp(v, "flash") ? 2 : !strcmp(v, "both") ? 3 : 0;
            if (!o->backends) {
                fprintf(stderr, "tp-bench-attn: --backend takes math, flash or both, not '%s'\n",
                        v);
                return 64;
            }
            i++;
        } else if (!strcmp(a, "--csv") && v) {
            o->csv = v;
            i++;
        } else if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            exit(0);
        } else {
            fprintf(stderr, "tp-bench-attn: unknown option %s (or it lacks its value)\n", a);
            usage(stderr);
            return 64;
        }
    }
    if (o->Hq % o->Hkv) {
        fprintf(stderr, "tp-bench-attn: -H %d heads are not a multiple of -K %d kv heads\n",
                o->Hq, o->Hkv);
        return 64;
    }
    return 0;
}

static tp_status sync_dev(tp_device d)
{
    return d.type == TP_DEVICE_CUDA ? tp_cuda_synchronize(d.index) : TP_OK;
}

static tp_status rand_on(const opts *o, int64_t h, int64_t d, uint64_t seed, tp_tensor **out)
{
    int64_t shape[4] = {o->B, h, o->S, d};
    tp_tensor *t = NULL;
    tp_status st = tp_tensor_empty(TP_F32, TP_CPU, 4, shape, &t);
    if (st == TP_OK)
        st = tp_tensor_fill_random(t, TP_RNG_NORMAL, 0, 1, seed, NULL, NULL);
    if (st == TP_OK)
        st = tp_tensor_to(t, o->dt, o->dev, out);
    tp_tensor_release(t);
    return st;
}

typedef struct {
    double fwd[64], step[64]; /* seconds per repeat */
    size_t peak;              /* bytes beyond the inputs, forward + backward */
    bool ok;
} result;

/* One forward (no gradient) and one forward + backward of backend b. */
static tp_status run_once(const opts *o, tp_sdpa_backend b, tp_tensor *const *in, tp_tensor *g,
                          double *fwd_s, double *step_s, size_t *peak)
{
    tp_sdpa_options so = {.causal = o->causal, .backend = b};
    tp_tensor *out = NULL;
    tp_status st = TP_OK;
    for (int i = 0; i < 3; i++)
        tp_tensor_set_requires_grad(in[i], false);
    if ((st = sync_dev(o->dev)) != TP_OK)
        return st;
    double t0 = bench_now_s();
    st = tp_scaled_dot_product_attention_with(in[0], in[1], in[2], &so, &out);
    if (st == TP_OK)
        st = sync_dev(o->dev);
    *fwd_s = bench_now_s() - t0;
    tp_tensor_release(out);
    out = NULL;
    if (st != TP_OK || o->fwd_only)
        return st;
    for (int i = 0; i < 3; i++)
        tp_tensor_set_requires_grad(in[i], true);
    tp_memory_info before, after;
    if ((st = tp_memory_reset_peak(o->dev)) != TP_OK ||
        (st = tp_memory_stats(o->dev, &before)) != TP_OK)
        return st;
    t0 = bench_now_s();
    st = tp_scaled_dot_product_attention_with(in[0], in[1], in[2], &so, &out);
    if (st == TP_OK)
        st = tp_backward(out, g);
    if (st == TP_OK)
        st = sync_dev(o->dev);
    *step_s = bench_now_s() - t0;
    if (st == TP_OK && (st = tp_memory_stats(o->dev, &after)) == TP_OK)
        *peak = after.peak_allocated - before.allocated;
    tp_tensor_release(out);
    for (int i = 0; i < 3; i++)
        tp_tensor_zero_grad(in[i]);
    return st;
}

static void stats(double *v, int n, double *med, double *lo, double *hi)
{
    double c[64];
    memcpy(c, v, sizeof(double) * (size_t)n);
    *med = bench_median(c, n);
    *lo = c[0];
    *hi = c[n - 1];
}

int main(int argc, char **argv)
{
    opts o;
    int rc = parse(argc, argv, &o);
    if (rc)
        return rc;
    if (o.reps > 64) {
        fprintf(stderr, "tp-bench-attn: -r %d: at most 64 repeats\n", o.reps);
        return 64;
    }
    char devname[256] = "cpu";
    double peak_tf = 0;
    if (o.dev.type == TP_DEVICE_CUDA) {
        if (tp_cuda_device_count() < 1) {
            fprintf(stderr, "tp-bench-attn: no CUDA device\n");
            return 2;
        }
#if TP_HAVE_CUDA
        struct cudaDeviceProp prop;
        if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess) {
            snprintf(devname, sizeof devname, "%s", prop.name);
            peak_tf = bench_gpu_peak_tflops(prop.name, "bf16");
        }
#endif
    }
    tp_tensor *in[3] = {NULL, NULL, NULL}, *g = NULL;
    tp_status st = rand_on(&o, o.Hq, o.D, 1, &in[0]);
    if (st == TP_OK)
        st = rand_on(&o, o.Hkv, o.D, 2, &in[1]);
    if (st == TP_OK)
        st = rand_on(&o, o.Hkv, o.D, 3, &in[2]);
    if (st == TP_OK)
        st = rand_on(&o, o.Hq, o.D, 4, &g);
    if (st != TP_OK) {
        fprintf(stderr, "tp-bench-attn: inputs: %s (%s)\n", tp_status_name(st), tp_last_error());
        return 1;
    }
    const double fwd_flop =
        4.0 * o.B * o.Hq * (double)o.S * o.S * o.D * (o.causal ? 0.5 : 1.0);
    const char *names[2] = {"math", "flash"};
    result res[2];
    memset(res, 0, sizeof res);
    for (int b = 0; b < 2; b++) /* warm-up (allocator, cuBLAS handles, kernels) */
        if (o.backends & (1 << b)) {
            double f, s;
            size_t p = 0;
            tp_status e = run_once(&o, b ? TP_SDPA_BACKEND_FLASH : TP_SDPA_BACKEND_MATH, in, g,
                                   &f, &s, &p);
            res[b].ok = e == TP_OK;
            if (e != TP_OK)
                fprintf(stderr, "tp-bench-attn: %s: %s (%s)\n", names[b], tp_status_name(e),
                        tp_last_error());
        }
    for (int r = 0; r < o.reps; r++)
        for (int k = 0; k < 2; k++) {
            int b = r % 2 ? 1 - k : k; /* alternate which goes first */
            if (!(o.backends & (1 << b)) || !res[b].ok)
                continue;
            size_t p = 0;
            tp_status e = run_once(&o, b ? TP_SDPA_BACKEND_FLASH : TP_SDPA_BACKEND_MATH, in, g,
                                   &res[b].fwd[r], &res[b].step[r], &p);
            if (e != TP_OK) {
                fprintf(stderr, "tp-bench-attn: %s: %s (%s)\n", names[b], tp_status_name(e),
                        tp_last_error());
                res[b].ok = false;
            }
            if (p > res[b].peak)
                res[b].peak = p;
        }
    printf("# tp-bench-attn on %s: %s, B %d, heads %d/%d kv, seq %d, head dim %d, %s; %d repeats\n",
           devname, tp_dtype_name(o.dt), o.B, o.Hq, o.Hkv, o.S, o.D,
           o.causal ? "causal" : "not causal", o.reps);
    FILE *csv = o.csv ? fopen(o.csv, "w") : NULL;
    if (o.csv && !csv)
        fprintf(stderr, "tp-bench-attn: --csv %s: cannot write it\n", o.csv);
    if (csv)
        fprintf(csv, "device,dtype,B,Hq,Hkv,S,D,causal,backend,pass,ms_median,ms_min,ms_max,"
                     "tflops_median,peak_fraction,extra_mib\n");
    printf("%-6s %-8s %26s %10s %8s %10s\n", "form", "pass", "ms median [min .. max]",
           "TFLOP/s", "of peak", "extra MiB");
    for (int b = 0; b < 2; b++) {
        if (!(o.backends & (1 << b)) || !res[b].ok)
            continue;
        for (int pass = 0; pass < (o.fwd_only ? 1 : 2); pass++) {
            double med, lo, hi;
            stats(pass ? res[b].step : res[b].fwd, o.reps, &med, &lo, &hi);
            double flop = pass ? fwd_flop * 3.5 : fwd_flop, tf = flop / med / 1e12;
            double mib = pass ? (double)res[b].peak / (1 << 20) : NAN;
            char ofpeak[16] = "-", extra[24] = "-";
            if (peak_tf > 0)
                snprintf(ofpeak, sizeof ofpeak, "%.1f%%", 100 * tf / peak_tf);
            if (pass)
                snprintf(extra, sizeof extra, "%.1f", mib);
            printf("%-6s %-8s %9.3f [%7.3f .. %7.3f] %10.2f %8s %10s\n", names[b],
                   pass ? "fwd+bwd" : "fwd", med * 1e3, lo * 1e3, hi * 1e3, tf, ofpeak, extra);
            if (csv)
                fprintf(csv, "%s,%s,%d,%d,%d,%d,%d,%d,%s,%s,%.4f,%.4f,%.4f,%.3f,%.4f,%.1f\n",
                        devname, tp_dtype_name(o.dt), o.B, o.Hq, o.Hkv, o.S, o.D, o.causal,
                        names[b], pass ? "fwd+bwd" : "fwd", med * 1e3, lo * 1e3, hi * 1e3, tf,
                        peak_tf > 0 ? tf / peak_tf : NAN, mib);
        }
    }
    if (o.backends == 3 && res[0].ok && res[1].ok)
        for (int pass = 0; pass < (o.fwd_only ? 1 : 2); pass++) {
            double ratio[64];
            for (int r = 0; r < o.reps; r++)
                ratio[r] = pass ? res[1].step[r] / res[0].step[r] : res[1].fwd[r] / res[0].fwd[r];
            double med, lo, hi;
            stats(ratio, o.reps, &med, &lo, &hi);
            printf("flash / math time, %s: %.3f [%.3f .. %.3f]\n", pass ? "fwd+bwd" : "fwd", med,
                   lo, hi);
        }
    if (csv)
        fclose(csv);
    for (int i = 0; i < 3; i++)
        tp_tensor_release(in[i]);
    tp_tensor_release(g);
    return (o.backends & 1 && !res[0].ok) || (o.backends & 2 && !res[1].ok) ? 1 : 0;
}
