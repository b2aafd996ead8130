/* Helpers shared by the benchmark programs; see bench_util.h. */
#include "bench_util.h"

#include <errno.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

double bench_now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int bench_cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double bench_median(double *v, int n)
{
    if (n <= 0)
        return 0;
    qsort(v, (size_t)n, sizeof *v, bench_cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

bool bench_parse_int(const char *s, int lo, int hi, int *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end != '\0' || v < lo || v > hi)
        return false;
    *out = (int)v;
    return true;
}

double bench_minor_faults(void)
{
    struct rusage ru;
    return getrusage(RUSAGE_THREAD, &ru) == 0 ? (double)ru.ru_minflt : 0;
}

int bench_launcher_local_rank(void)
{
    static const char *const vars[] = {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID",
                                       "MV2_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID",
                                       "PMIX_LOCAL_RANK"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) {
        const char *v = getenv(vars[i]);
        if (v && *v)
            return atoi(v);
    }
    return -1;
}

bool bench_under_mpirun(void)
{
    return bench_launcher_local_rank() >= 0 || getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMI_SIZE") ||
           getenv("PMIX_RANK");
}

int bench_cores(void)
{
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0)
        return CPU_COUNT(&set);
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

int bench_world_cores(tp_comm *world)
{
    int mine = bench_cores();
    cpu_set_t set;
    if (!world || tp_comm_size(world) < 2 || sched_getaffinity(0, sizeof set, &set) != 0)
        return mine;
    /* a CPU is the run's when any process may use it: max over the ranks of
     * 0/1 per CPU (every rank calls the all_reduce, whatever its mask) */
    double on[CPU_SETSIZE];
    for (int c = 0; c < CPU_SETSIZE; c++)
        on[c] = CPU_ISSET(c, &set) ? 1.0 : 0.0;
    int64_t n = CPU_SETSIZE;
    tp_tensor *t = NULL;
    tp_status st = tp_tensor_from_blob(TP_F64, TP_CPU, 1, &n, on, NULL, NULL, &t);
    if (st == TP_OK)
        st = tp_all_reduce(world, t, t, TP_MAX, NULL);
    tp_tensor_release(t);
    int count = 0;
    for (int c = 0; c < CPU_SETSIZE; c++)
        count += on[c] != 0.0;
    return st == TP_OK && count > 0 ? count : mine;
}

bool bench_loadavg(double out[3])
{
    return getloadavg(out, 3) == 3;
}

double bench_gpu_peak_tflops(const char *device_name, const char *kind)
{
    if (!device_name || !kind)
        return 0;
    bool h100_sxm =
        strstr(device_name, "H100") && (strstr(device_name, "HBM3") || strstr(device_name, "SXM"));
    if (!h100_sxm && !strstr(device_name, "H200"))
        return 0;
    if (!strcmp(kind, "bf16"))
        return 989;
    if (!strcmp(kind, "tf32"))
        return 494.5;
    return !strcmp(kind, "f32") ? 66.9 : 0;
}
