/*
 * bench_util.h: what the benchmark programs (tp-bench-comm, -ops, -layers,
 * -dp) share: a monotonic clock, medians, whole-string integer options, page
 * faults, the launcher's environment, and the machine's cores and load. One
 * copy, so that e.g. every bench counts the same cores.
 */
#ifndef TP_BENCH_UTIL_H
#define TP_BENCH_UTIL_H

#include <stdbool.h>

#include <tp.h>

/* Seconds on CLOCK_MONOTONIC. */
double bench_now_s(void);

/* qsort comparator for doubles, ascending. */
int bench_cmp_double(const void *a, const void *b);

/* Median of v[0..n): the middle element, or the mean of the middle two for an
 * even n; 0 for n <= 0. Sorts v in place (so v[0] and v[n-1] are then the
 * minimum and maximum). */
double bench_median(double *v, int n);

/* s as a whole decimal integer in [lo, hi] into *out; false (and *out
 * untouched) on anything else: empty, trailing characters, out of range. */
bool bench_parse_int(const char *s, int lo, int hi, int *out);

/* Minor page faults of the calling thread so far. A buffer that malloc maps
 * afresh (above its mmap threshold) costs one per 4 KiB page on first touch. */
double bench_minor_faults(void);

/* This process's rank among those of its node when a launcher (mpirun:
 * OpenMPI, MPICH, MVAPICH; Slurm; PMIx) started it, else -1. */
int bench_launcher_local_rank(void);

/* Whether a launcher started this process (one rank of several processes). */
bool bench_under_mpirun(void);

/* The cores this process may run on (sched_getaffinity: a cpuset or taskset
 * limit counts, as in nproc), at least 1. */
int bench_cores(void);

/* The cores the processes of world may run on together: the union of their
 * bench_cores() sets, so that ranks bound one core each (mpirun's default
 * --bind-to core) count all their cores. Collective over world; NULL (or one
 * rank, or a failed all_reduce) gives bench_cores(). */
int bench_world_cores(tp_comm *world);

/* The load averages over 1, 5 and 15 minutes; false where there are none. */
bool bench_loadavg(double out[3]);

/* The dense peak of a GPU in TFLOP/s for matrix products of `kind`: "bf16"
 * (bf16/f16 tensor cores), "tf32" or "f32" (no tensor cores), from its name
 * as cudaGetDeviceProperties gives it: the H100 SXM ("H100 ... HBM3" or
 * "H100 SXM") and the H200 (989, 494.5 and 66.9); 0 for any other name or
 * kind ("peak unknown"). */
double bench_gpu_peak_tflops(const char *device_name, const char *kind);

/* st = expr; on failure: the rank, the call, its status and message on
 * stderr, then goto out. Needs a tp_status st, the rank's tp_comm *w and a
 * label out in the function. */
#define TRY(expr)                                                               \
    do {                                                                        \
        st = (expr);                                                            \
        if (st != TP_OK) {                                                      \
            fprintf(stderr, "rank %d: %s: %s (%s)\n", tp_comm_rank(w), #expr,   \
                    tp_status_name(st), tp_last_error());                       \
            goto out;                                                           \
        }                                                                       \
    } while (0)

#endif
