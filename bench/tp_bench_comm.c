/*
 * tp-bench-comm - libtp's collectives swept the way nccl-tests sweeps NCCL's:
 * nccl-tests' flags, nccl-tests' table (so scripts written for all_reduce_perf
 * and friends read it), the spread of repeated measurements, and the
 * machine's memory-copy bandwidth measured in the same run as a roof.
 *
 * Every collective is a section that reads like the output of the nccl-tests
 * binary of that collective:
 *
 *   # Collective test starting: all_reduce_perf
 *   #                     ...   out-of-place                       in-place
 *   #       size         count      type   redop    root     time   algbw   busbw #wrong     time ...
 *   #        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us) ...
 *           4096          1024     float     sum      -1     1.02    4.02    4.02      0     0.98 ...
 *   # Out of bounds values : 0 OK
 *   # Avg bus bandwidth    : 4.1
 *   #   ... the spread of every row, roof%, notes: '#' lines only ...
 *   # Collective test concluded: all_reduce_perf
 *
 * Nothing but data rows sits between the header rows and the two closing
 * lines, so a parser that reads the rows by position, stopping at the first
 * '#', sees exactly nccl-tests' columns. What nccl-tests does not print (the
 * spread over repetitions, roof%, the load average) is in '#' lines after the
 * closing lines and in the CSV (--csv).
 *
 * Sizes and columns, as nccl-tests (S is the size column; count is
 * nccl-tests' "count", the per-rank block of the split collectives):
 *
 *   collective      S                          count       busbw = algbw x
 *   all_reduce      send = recv                S / elt     2(n-1)/n
 *   all_gather      recv (all blocks)          S / elt / n (n-1)/n
 *   reduce_scatter  send (all blocks)          S / elt / n (n-1)/n
 *   all_to_all      send = recv (all blocks)   S / elt / n (n-1)/n
 *   broadcast       the buffer                 S / elt     1
 *   scatter         root's send (all blocks)   S / elt / n (n-1)/n
 *
 * algbw = S / time, GB = 1e9 B. Where a collective splits S into n blocks, S
 * is rounded down to whole elements per block (4096 B of f32 over 3 ranks is
 * 4092 B); the size column shows the size moved.
 *
 * Timing of one row, each form (out-of-place, in-place) in turn: -w warm-up
 * calls, then -R repetitions of a timed loop of -n calls (-n 0: as many as fill
 * about --target-s). Every call is preceded by a barrier that is not timed and
 * every rank times its own call; a rank's time for a repetition is its mean
 * per call, and the repetition's time combines the ranks as -a says (0 rank
 * 0's, 1 the mean over ranks, 2 the fastest rank, 3 the slowest; nccl-tests'
 * -a). The table's time is the median of the repetitions; their range is in
 * the spread lines. -z 1 makes every call blocking (work = NULL), -z 0 starts
 * it with a work handle and waits for it (tp_work_wait).
 *
 * Forms libtp lacks: tp_broadcast has one buffer (in place) and tp_all_to_all
 * refuses overlapping buffers. The missing form's columns time the form libtp
 * has once more and are not checked (#wrong N/A), as nccl-tests' alltoall_perf
 * leaves its in-place results unchecked; a note line says so.
 *
 * Checking (-c N, N > 0): inputs are small integers whose reductions are
 * exact in the dtype (rank + 1 + g % 13 for sum/avg/max/min, 1 or 2 for prod);
 * every element of every rank's output is compared after the first warm-up
 * call, after every repetition (the outputs are reset to a sentinel before
 * it, so a loop that stops copying is caught), and in N more calls on fresh
 * inputs; #wrong counts the wrong elements over ranks. avg on floating dtypes
 * allows about two ulps, because a backend may divide as x * (1/n). In-place
 * sum/avg/prod feed their output back in, so their repetitions are not checked
 * (the values grow, floats reach inf, as in nccl-tests); the fresh calls are.
 *
 * Roof: before the sweep every rank copies a buffer of its own (--roof-bytes,
 * default 256 MiB), all ranks at once, timed like a collective, in three ways;
 * the fastest median is the roof. roof% compares a collective with that copy
 * bandwidth through a model of the least memory traffic a shared-memory
 * implementation must do; see model_bytes() and bench/README.md.
 *
 * GPUs (--device cuda with --backend shm, and --backend nccl): every call is
 * timed until the rank's CUDA stream has finished it (tp_cuda_synchronize),
 * since a collective on CUDA tensors may return once enqueued. The roof is a
 * bare cudaMemcpyAsync device to device of each row's bytes (time_device_copy);
 * '# gpu' lines give busbw / the copy's algbw and roof%. --nccl-bare (nccl,
 * -g 1) times ncclAllReduce / ncclAllGather on the same buffers beside libtp's.
 *
 * Exit status: 0 when every point ran and every check passed, 1 when a check
 * counted wrong elements, 2 when a libtp call failed, 64 on a usage error,
 * 77 when a GPU run finds no CUDA device (a skip; the message says "no CUDA
 * device").
 */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "tp/comm.h"
#include "tp/config.h"
#include "tp/status.h"
#include "tp/tensor.h"

#if TP_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif
#if TP_HAVE_NCCL
/* nccl.h declares ncclGroupStart() and ncclGroupEnd() without prototypes */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wstrict-prototypes"
#include <nccl.h>
#pragma GCC diagnostic pop
#endif

#include "bench_util.h"

#define EXIT_WRONG 1
#define EXIT_ERROR 2
#define EXIT_USAGE 64
#define EXIT_NO_DEVICE 77 /* --device cuda (or backend nccl) and no CUDA device: a skip */

#define MIN_ITERS 5
#define MAX_ITERS 20000
#define MAX_REPS 100
#define ROOF_REPS 7   /* timed copies of the roof buffer, after one warm-up copy */
#define PAT_MAX 13    /* longest pattern period */
#define HOST_MAX 64   /* host name bytes shown per rank */
#define COPY_WARM 3   /* device-to-device copies before the timed ones */
#define COPY_REPS 5   /* timed batches of the copy baseline; the median counts */
#define COPY_BATCH 10 /* copies per timed batch, between two events */

enum { FORM_OOP = 0, FORM_IP = 1, N_FORMS = 2 };
static const char *const form_name[N_FORMS] = {"out-of-place", "in-place"};

/* ---- static tables ------------------------------------------------------- */

typedef enum bench_op {
    OP_ALL_REDUCE = 0,
    OP_ALL_GATHER,
    OP_REDUCE_SCATTER,
    OP_ALL_TO_ALL,
    OP_BROADCAST,
    OP_SCATTER,
    OP_COUNT
} bench_op;

static const struct op_info {
    const char *name;  /* libtp's spelling */
    const char *alias; /* MPI's and mpi_coll.c's */
    const char *perf;  /* the nccl-tests binary */
    bool reduces;
    bool rooted;
    bool split;           /* S is n blocks */
    bool has[N_FORMS];    /* the forms libtp has */
} op_info[OP_COUNT] = {
    [OP_ALL_REDUCE] = {"all_reduce", "allreduce", "all_reduce_perf", true, false, false, {true, true}},
    [OP_ALL_GATHER] = {"all_gather", "allgather", "all_gather_perf", false, false, true, {true, true}},
    [OP_REDUCE_SCATTER] = {"reduce_scatter", "reducescatter", "reduce_scatter_perf", true, false,
                           true, {true, true}},
    [OP_ALL_TO_ALL] = {"all_to_all", "alltoall", "alltoall_perf", false, false, true, {true, false}},
    [OP_BROADCAST] = {"broadcast", "bcast", "broadcast_perf", false, true, false, {false, true}},
    [OP_SCATTER] = {"scatter", "scatter", "scatter_perf", false, true, true, {true, true}},
};

typedef struct dtype_info {
    const char *name;  /* nccl-tests' */
    const char *alias; /* libtp's */
    tp_dtype dtype;
    size_t size;
    bool is_float;
    double exact_limit; /* every integer in [0, exact_limit] is representable */
    double avg_rtol;    /* tolerance of the avg check (about two ulps) */
} dtype_info;

/* nccl-tests' types that libtp has, in nccl-tests' order (-d all) */
static const dtype_info dtypes[] = {
    {"int32", "i32", TP_I32, 4, false, 2147483647.0, 0.0},
    {"int64", "i64", TP_I64, 8, false, 9007199254740992.0, 0.0},
    {"half", "f16", TP_F16, 2, true, 2048.0, 0x1p-9},
    {"float", "f32", TP_F32, 4, true, 16777216.0, 0x1p-22},
    {"double", "f64", TP_F64, 8, true, 9007199254740992.0, 0x1p-51},
    {"bfloat16", "bf16", TP_BF16, 2, true, 256.0, 0x1p-6},
};
#define N_DTYPES (sizeof(dtypes) / sizeof(dtypes[0]))

/* nccl-tests' types that libtp has no dtype for */
static const char *const unsupported_dtypes[] = {"int8", "uint8", "uint32", "uint64"};
#define DTYPE_NAMES "int32|int64|half|float|double|bfloat16|all"

/* nccl-tests' reduction names and order (-o all) */
static const struct redop_info {
    const char *name;
    const char *alias;
    tp_reduce_op op;
} redops[] = {
    {"sum", NULL, TP_SUM}, {"prod", "product", TP_PRODUCT}, {"max", NULL, TP_MAX},
    {"min", NULL, TP_MIN}, {"avg", NULL, TP_AVG},
};
#define N_REDOPS (sizeof(redops) / sizeof(redops[0]))
#define REDOP_NAMES "sum|prod|max|min|avg|all"

static const char *redop_name(tp_reduce_op op)
{
    for (size_t i = 0; i < N_REDOPS; i++)
        if (redops[i].op == op)
            return redops[i].name;
    return "?";
}

static const char *const average_name[4] = {"rank 0's time", "mean over ranks", "fastest rank",
                                            "slowest rank"};

/* ---- configuration and backends ------------------------------------------ */

struct bench_run;

/*
 * How the ranks of a backend come to exist. Adding a backend is one entry:
 *  - "mpi": one process per rank started by mpirun; the world communicator
 *    comes from tp_comm_create_world("mpi", NULL, &world) (launch_world below).
 *  - "nccl": one GPU per rank, buffers on the device (launch_nccl). Under
 *    mpirun (one process per rank) the NCCL communicator is bootstrapped over
 *    the MPI world and each process takes GPU (local rank % GPUs); in a
 *    single process, -g tp_run_local threads take GPU rank each, bootstrapped
 *    over the shm world. Inputs are written and outputs checked in host
 *    mirrors of the device buffers (tp_tensor_copy before and after);
 *    statistics travel over the bootstrap communicator; no memcpy roof.
 * A backend is offered when it is "shm" (always built in) or when
 * tp_backend_find() knows its name.
 */
typedef struct bench_backend {
    const char *name;
    const char *how;
    bool threads; /* ranks are threads of this process; -g picks their number */
    tp_status (*launch)(struct bench_run *run);
} bench_backend;

static tp_status launch_threads(struct bench_run *run);
static tp_status launch_world(struct bench_run *run);
static tp_status launch_nccl(struct bench_run *run);

static const bench_backend backends[] = {
    {"shm", "ranks are threads of this process (tp_run_local), -g of them", true, launch_threads},
    {"mpi", "one process per rank under mpirun (tp_comm_create_world(\"mpi\")); -g is ignored", false,
     launch_world},
    {"nccl", "one GPU per rank: -g threads of this process on GPUs 0..g-1, or under mpirun\n"
             "         one process per rank on GPU (local rank % GPUs), -g ignored",
     true, launch_nccl},
};
#define N_BACKENDS (sizeof(backends) / sizeof(backends[0]))

static bool backend_available(const bench_backend *b)
{
    return strcmp(b->name, "shm") == 0 || tp_backend_find(b->name) != NULL;
}

typedef struct bench_cfg {
    size_t min_bytes, max_bytes;
    size_t factor;     /* > 1: multiply the size; 1: add step_bytes (-i) */
    size_t step_bytes;
    int iters;  /* 0: automatic */
    int warmup;
    int check;  /* -c: 0 no checks; N: N checked calls on fresh inputs, and the others */
    int reps;   /* -R */
    int average; /* -a: 0 rank 0, 1 mean, 2 min, 3 max over ranks */
    bool blocking; /* -z */
    bool ops[OP_COUNT];
    bool types[N_DTYPES];
    bool redops[N_REDOPS];
    int root;   /* -r; -1: every rank in turn */
    int nranks;
    bool nranks_given;
    const bench_backend *backend;
    const char *csv_path;
    size_t roof_bytes; /* 0: no roof */
    double target_s;   /* seconds per timed loop with -n 0 */
    bool cuda;         /* --device cuda (always with backend nccl): buffers on GPUs */
    bool device_given;
    bool nccl_bare; /* --nccl-bare: bare ncclAllReduce/ncclAllGather beside libtp's */
} bench_cfg;

/* One form of one row, as rank 0 records it. */
typedef struct form_result {
    bool substitute; /* the other form's call, timed again (no such form in libtp) */
    bool checked;
    int iters;
    double wrong;
    double time_s, min_s, max_s; /* median, minimum, maximum over repetitions */
    double iter_med_s;           /* median over reps of the median per call of the slowest rank */
    double rep_s[MAX_REPS];
    double algbw, busbw;
    double model;    /* bytes per rank of the traffic model */
    double roof;     /* fraction of the roof; NAN: none */
    double busbw_copy; /* busbw / the device copy's algbw; NAN: no copy baseline */
    /* --nccl-bare: the bare NCCL call, timed the same way; bare_s 0: none */
    double bare_s, bare_min_s, bare_max_s;
    double ratio, ratio_min, ratio_max; /* libtp time / bare time: medians, per-rep range */
} form_result;

typedef struct point_row {
    size_t bytes, count;
    const dtype_info *dt;
    tp_reduce_op redop;
    int root;
    double copy_s; /* device runs: one D2D cudaMemcpyAsync of `bytes`; 0: none */
    form_result f[N_FORMS];
} point_row;

/* Per-op outcome, seen from rank 0. */
typedef struct op_summary {
    bool ran;
    int points;
    double wrong;
    tp_status status;
} op_summary;

typedef struct bench_run {
    const bench_cfg *cfg;
    FILE *csv;
    op_summary ops[OP_COUNT];
    double roof_GBps; /* memcpy traffic per thread; 0 when not measured */
    double wrong_total;
    bool printer; /* this process prints (false on MPI ranks other than 0) */
    int threads;  /* ranks in this process */
    double load_before[3];
    bool have_load;
    int cores;
    /* rows of the current section (rank 0) */
    point_row *rows;
    size_t nrows, cap;
} bench_run;

/* ---- small helpers -------------------------------------------------------- */

static size_t min_size(size_t a, size_t b) { return a < b ? a : b; }

/* ---- element encoding ---------------------------------------------------- */

static uint16_t f32_to_f16(float f)
{
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t fexp = (x >> 23) & 0xffu;
    uint32_t mant = x & 0x7fffffu;
    if (fexp == 0xffu)
        return (uint16_t)(sign | 0x7c00u | (mant ? 0x200u : 0u));
    int32_t e = (int32_t)fexp - 127 + 15;
    if (e >= 31)
        return (uint16_t)(sign | 0x7c00u);
    if (e <= 0) {
        if (e < -10)
            return (uint16_t)sign;
        mant |= 0x800000u;
        uint32_t shift = (uint32_t)(14 - e);
        uint32_t h = mant >> shift, rem = mant & ((1u << shift) - 1u), mid = 1u << (shift - 1u);
        if (rem > mid || (rem == mid && (h & 1u)))
            h++;
        return (uint16_t)(sign | h);
    }
    uint32_t h = sign | ((uint32_t)e << 10) | (mant >> 13), rem = mant & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u)))
        h++; /* a carry into the exponent is the correct rounding */
    return (uint16_t)h;
}

static double f16_to_f64(uint16_t h)
{
    int e = (h >> 10) & 0x1f, m = h & 0x3ff;
    double v;
    if (e == 0)
        v = ldexp((double)m, -24);
    else if (e == 31)
        v = m ? NAN : INFINITY;
    else
        v = ldexp((double)(m + 1024), e - 25);
    return (h & 0x8000u) ? -v : v;
}

static uint16_t f32_to_bf16(float f)
{
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    if ((x & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((x >> 16) | 0x40u);
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

static double bf16_to_f64(uint16_t h)
{
    uint32_t x = (uint32_t)h << 16;
    float f;
    memcpy(&f, &x, sizeof f);
    return f;
}

static void encode(tp_dtype dt, double v, void *out)
{
    switch (dt) {
    case TP_F32: { float f = (float)v; memcpy(out, &f, 4); break; }
    case TP_F64: memcpy(out, &v, 8); break;
    case TP_F16: { uint16_t h = f32_to_f16((float)v); memcpy(out, &h, 2); break; }
    case TP_BF16: { uint16_t h = f32_to_bf16((float)v); memcpy(out, &h, 2); break; }
    case TP_I32: { int32_t i = (int32_t)v; memcpy(out, &i, 4); break; }
    case TP_I64: { int64_t i = (int64_t)v; memcpy(out, &i, 8); break; }
    default: break;
    }
}

static double decode(tp_dtype dt, const void *in)
{
    switch (dt) {
    case TP_F32: { float f; memcpy(&f, in, 4); return f; }
    case TP_F64: { double d; memcpy(&d, in, 8); return d; }
    case TP_F16: { uint16_t h; memcpy(&h, in, 2); return f16_to_f64(h); }
    case TP_BF16: { uint16_t h; memcpy(&h, in, 2); return bf16_to_f64(h); }
    case TP_I32: { int32_t i; memcpy(&i, in, 4); return (double)i; }
    case TP_I64: { int64_t i; memcpy(&i, in, 8); return (double)i; }
    default: return NAN;
    }
}

/* ---- data patterns ---------------------------------------------------------
 * Every input and expected output is periodic: element i of a region holds
 * v[(phase + i) % period]. Filling and checking tile an encoded period. */

typedef struct pattern {
    size_t period;
    double v[PAT_MAX];
} pattern;

typedef struct epattern {
    size_t period, esize;
    unsigned char bytes[PAT_MAX * 8];
} epattern;

static epattern encode_pattern(const pattern *p, const dtype_info *dt)
{
    epattern ep = {.period = p->period, .esize = dt->size};
    for (size_t k = 0; k < p->period; k++)
        encode(dt->dtype, p->v[k], ep.bytes + k * dt->size);
    return ep;
}

/* true if every value of p survives encoding in dt unchanged */
static bool pattern_exact(const pattern *p, const dtype_info *dt)
{
    unsigned char buf[8];
    for (size_t k = 0; k < p->period; k++) {
        encode(dt->dtype, p->v[k], buf);
        if (decode(dt->dtype, buf) != p->v[k])
            return false;
    }
    return true;
}

#define FILL_DOUBLING_CAP 16384 /* elements; then copy blocks of that size */

/* dst[i] = pattern[(phase + i) % period] for i in [0, count) */
static void pattern_fill(void *dst, size_t count, const epattern *ep, size_t phase)
{
    unsigned char *d = dst;
    size_t es = ep->esize, per = ep->period;
    size_t have = min_size(count, per);
    for (size_t i = 0; i < have; i++)
        memcpy(d + i * es, ep->bytes + ((phase + i) % per) * es, es);
    /* copies start at offsets that are multiples of the period, so d[0..]
     * is the right source for every later block */
    while (have < count && have < FILL_DOUBLING_CAP) {
        size_t len = min_size(have, count - have);
        memcpy(d + have * es, d, len * es);
        have += len;
    }
    size_t blk = have;
    while (have < count) {
        size_t len = min_size(blk, count - have);
        memcpy(d + have * es, d, len * es);
        have += len;
    }
}

static const pattern sentinel_pattern = {.period = 1, .v = {-1.0}};

/* Pattern of a block that is copied rather than reduced (all_gather,
 * all_to_all, broadcast): tag identifies the block. Values stay <= 237, exact
 * in every dtype (bf16 holds all integers up to 256). */
static pattern block_pattern(size_t tag)
{
    pattern p = {.period = 13};
    for (size_t k = 0; k < 13; k++)
        p.v[k] = 1.0 + (double)((tag % 15) * 16 + k);
    return p;
}

/* Inputs of reductions: rank r holds v(r, g % period) at global index g. */
typedef struct red_plan {
    size_t period;
    bool rank_term; /* v = r + 1 + k, else v = 1 + k (sum/avg at many ranks) */
    bool exact;     /* false: the check is skipped (no exact inputs found) */
} red_plan;

static red_plan make_red_plan(tp_reduce_op op, const dtype_info *dt, int n)
{
    red_plan p = {.period = 13, .rank_term = true, .exact = true};
    if (op == TP_PRODUCT) {
        p.period = 2;
        return p;
    }
    if (op != TP_SUM && op != TP_AVG)
        return p;
    /* the largest partial sum is the total: n(n+1)/2 + n(period-1) */
    double nn = (double)n, base = nn * (nn + 1.0) / 2.0;
    while (p.period > 1 && base + nn * (double)(p.period - 1) > dt->exact_limit)
        p.period--;
    if (base + nn * (double)(p.period - 1) > dt->exact_limit) {
        p.rank_term = false;
        p.period = 13;
        while (p.period > 1 && nn * (double)p.period > dt->exact_limit)
            p.period--;
        if (nn * (double)p.period > dt->exact_limit)
            p.exact = false;
    }
    return p;
}

static double red_input(const red_plan *p, tp_reduce_op op, int r, size_t k)
{
    if (op == TP_PRODUCT)
        return 1.0 + (double)(((size_t)r + k) % 2);
    return (p->rank_term ? (double)r + 1.0 : 1.0) + (double)k;
}

static pattern red_in_pattern(const red_plan *p, tp_reduce_op op, int r)
{
    pattern pat = {.period = p->period};
    for (size_t k = 0; k < p->period; k++)
        pat.v[k] = red_input(p, op, r, k);
    return pat;
}

static pattern red_out_pattern(const red_plan *p, tp_reduce_op op, int n, const dtype_info *dt)
{
    pattern pat = {.period = p->period};
    for (size_t k = 0; k < p->period; k++) {
        double acc = red_input(p, op, 0, k);
        for (int r = 1; r < n; r++) {
            double v = red_input(p, op, r, k);
            switch (op) {
            case TP_SUM:
            case TP_AVG: acc += v; break;
            case TP_PRODUCT: acc *= v; break;
            case TP_MAX: acc = v > acc ? v : acc; break;
            case TP_MIN: acc = v < acc ? v : acc; break;
            default: break;
            }
        }
        if (op == TP_AVG)
            acc = dt->is_float ? acc / n : floor(acc / n); /* integers truncate; acc > 0 */
        pat.v[k] = acc;
    }
    return pat;
}

/* Counts elements of src[0, count) that differ from the pattern. rtol > 0
 * accepts |got - want| <= rtol |want|. scratch holds per * 1024 elements. */
static size_t pattern_count_wrong(const void *src, size_t count, const epattern *ep, size_t phase,
                                  const dtype_info *dt, double rtol, unsigned char *scratch)
{
    const unsigned char *s = src;
    size_t es = ep->esize, blk = min_size(count, ep->period * 1024), wrong = 0;
    pattern_fill(scratch, blk, ep, phase);
    for (size_t off = 0; off < count; off += blk) {
        size_t len = min_size(blk, count - off);
        if (memcmp(s + off * es, scratch, len * es) == 0)
            continue;
        for (size_t i = 0; i < len; i++) {
            const unsigned char *got = s + (off + i) * es, *want = scratch + i * es;
            if (memcmp(got, want, es) == 0)
                continue;
            if (rtol > 0) {
                double g = decode(dt->dtype, got), w = decode(dt->dtype, want);
                if (fabs(g - w) <= rtol * fabs(w))
                    continue;
            }
            wrong++;
        }
    }
    return wrong;
}

/* ---- the performance model ---------------------------------------------------
 *
 * model_bytes(): the least memory traffic per rank, in bytes read plus bytes
 * written, of a shared-memory implementation in which every rank reads its
 * peers' buffers directly (no staging copies), each input element is read
 * once, each output element is written once, and the work is split evenly
 * over the n ranks. Totals over all ranks, divided by n:
 *
 *   op              out-of-place                        in-place (n > 1)
 *   all_reduce      read S   + write S       = 2S       read S + write S = 2S
 *                   (the owner of slice j reads slice j of all n inputs and
 *                    writes the reduced slice into all n outputs)
 *   all_gather      read S/n + write S   = S(n+1)/n     read S/n + write S(n-1)/n = S
 *                   (a rank reads its own block once and writes it into
 *                    every recv buffer; in place its own copy is already there)
 *   reduce_scatter  read S   + write S/n = S(n+1)/n     same
 *   all_to_all      read S   + write S       = 2S       (never in place)
 *   broadcast       (always in place)                   read S/n + write S(n-1)/n = S
 *                   (root's S is read once, in n slices, and written n-1 times)
 *   scatter         (read S + write S) / n   = 2S/n     2S(n-1)/n^2
 *                   (root's S is read once and each block written once; in
 *                    place root's own block stays)
 *
 * With n = 1 the in-place forms move nothing (model 0, roof% not shown) and
 * the out-of-place forms are a copy (2S). The model is that of the call made:
 * a form libtp lacks is modelled as the form timed in its place.
 *
 * roof% = (model_bytes / t) / roof, where roof is the memcpy traffic
 * bandwidth of one thread (2 x bytes copied / time) measured with n threads
 * copying at once (measure_roof). Not counted, neither here nor in the roof:
 * write-allocate reads (STREAM's convention; the 64 KiB-call memcpy pays them
 * like an ordinary-store kernel, the one-call memcpy uses non-temporal stores
 * and does not), synchronisation, and caches: while the buffers of all ranks
 * fit in the last level cache roof% can pass 100%, and it only means
 * something at sizes well beyond the cache.
 */
static double model_bytes(bench_op op, bool inplace, double S, int n)
{
    double nn = (double)n;
    if (inplace && n == 1)
        return 0.0;
    switch (op) {
    case OP_ALL_REDUCE: return 2.0 * S;
    case OP_ALL_GATHER: return inplace ? S : S / nn + S;
    case OP_REDUCE_SCATTER: return S + S / nn;
    case OP_ALL_TO_ALL: return 2.0 * S;
    case OP_BROADCAST: return n == 1 ? 0.0 : S;
    case OP_SCATTER: return inplace ? 2.0 * S * (nn - 1.0) / (nn * nn) : 2.0 * S / nn;
    default: return 0.0;
    }
}

/* nccl-tests' bus bandwidth factors (doc/PERFORMANCE.md and the *_perf sources) */
static double bus_factor(bench_op op, int n)
{
    double nn = (double)n;
    switch (op) {
    case OP_ALL_REDUCE: return 2.0 * (nn - 1.0) / nn;
    case OP_ALL_GATHER:
    case OP_REDUCE_SCATTER:
    case OP_ALL_TO_ALL:
    case OP_SCATTER: return (nn - 1.0) / nn;
    case OP_BROADCAST: return 1.0;
    default: return 0.0;
    }
}

/* ---- per-rank state ---------------------------------------------------------- */

typedef struct rank_ctx {
    bench_run *run;
    const bench_cfg *cfg;
    tp_comm *comm; /* the collectives under test */
    tp_comm *ctl;  /* statistics on host tensors: comm, or nccl's bootstrap */
    int rank, n;
    int device;                     /* CUDA ordinal of the buffers, or -1: CPU */
    int dev_ranks;                  /* ranks sharing the busiest GPU (roof% on devices) */
    bool sync_stream;               /* drain this rank's CUDA stream after each call */
    void *bare;                     /* --nccl-bare: this rank's bare NCCL state */
    tp_tensor *sendraw, *recvraw;   /* max_bytes each (f64), on the device under test */
    tp_tensor *hsendraw, *hrecvraw; /* host mirrors when device >= 0, else NULL */
    /* the same memory typed as the dtype being run */
    tp_tensor *sendbuf, *recvbuf, *hsendbuf, *hrecvbuf;
    unsigned char *scratch;         /* PAT_MAX * 1024 elements */
    double *times;                  /* MAX_ITERS */
} rank_ctx;

/* One form of one point of the sweep on this rank. */
typedef struct point {
    bench_op op;
    const dtype_info *dt;
    tp_reduce_op redop; /* reductions only */
    int root;           /* rooted collectives only */
    int form;           /* the columns: FORM_OOP or FORM_IP */
    bool inplace;       /* the call made: differs from form for a substitute */
    bool substitute;
    size_t bytes; /* S actually moved */
    size_t count; /* S / element size */
    size_t k;     /* block elements: per-rank slice of split collectives, else count */
    tp_tensor *send, *recv;   /* views; broadcast uses send as its buffer; scatter's send
                               * is NULL on ranks other than root */
    tp_tensor *hsend, *hrecv; /* the same views of the host mirrors (== send, recv on CPU) */
    red_plan plan;
    bool check;
} point;

static void report(const rank_ctx *rc, const point *pt, const char *what, tp_status st)
{
    if (pt)
        fprintf(stderr, "tp-bench-comm: rank %d: %s %s, %s, %zu B: %s: %s: %s\n", rc->rank,
                op_info[pt->op].name, form_name[pt->form], pt->dt->name, pt->bytes, what,
                tp_status_name(st), tp_last_error());
    else
        fprintf(stderr, "tp-bench-comm: rank %d: setup: %s: %s: %s\n", rc->rank, what,
                tp_status_name(st), tp_last_error());
}

/* Elementwise max (or sum, min) of vals over ranks, through libtp itself so
 * that it works for every backend. */
static tp_status reduce_f64(const rank_ctx *rc, double *vals, size_t count, tp_reduce_op op)
{
    int64_t shape = (int64_t)count;
    tp_tensor *t = NULL;
    tp_status st = tp_tensor_from_blob(TP_F64, TP_CPU, 1, &shape, vals, NULL, NULL, &t);
    if (st != TP_OK) {
        report(rc, NULL, "tp_tensor_from_blob (statistics)", st);
        return st;
    }
    st = tp_all_reduce(rc->ctl, t, t, op, NULL);
    if (st != TP_OK)
        report(rc, NULL, "tp_all_reduce (statistics)", st);
    tp_tensor_release(t);
    return st;
}

static unsigned char *tdata(const tp_tensor *t) { return tp_tensor_data(t); }

/* ---- the memcpy roof ---------------------------------------------------------- */

/*
 * Every rank copies a buffer of its own, all ranks at once, timed like a
 * collective (barrier, own time, slowest rank). Three ways of copying,
 * interleaved rep by rep: one memcpy call for the whole buffer, one memcpy
 * call per 64 KiB piece (ordinary stores), and a loop of SSE2 non-temporal
 * stores (no write-allocate read, the way the shm backend writes large
 * outputs). Which is fastest depends on the machine, so the roof is the
 * fastest median: the copy bandwidth the memory system actually allows.
 */
#define ROOF_CHUNK ((size_t)64 << 10)
#define ROOF_KINDS 3

static void roof_copy(unsigned char *dst, const unsigned char *src, size_t bytes, int kind)
{
    if (kind == 0) {
        memcpy(dst, src, bytes);
        return;
    }
#if defined(__SSE2__)
    if (kind == 2) {
        size_t body = bytes & ~(size_t)63; /* both buffers are 4096-aligned */
        for (size_t i = 0; i < body; i += 64) {
            __m128i x0 = _mm_load_si128((const __m128i *)(src + i));
            __m128i x1 = _mm_load_si128((const __m128i *)(src + i + 16));
            __m128i x2 = _mm_load_si128((const __m128i *)(src + i + 32));
            __m128i x3 = _mm_load_si128((const __m128i *)(src + i + 48));
            _mm_stream_si128((__m128i *)(dst + i), x0);
            _mm_stream_si128((__m128i *)(dst + i + 16), x1);
            _mm_stream_si128((__m128i *)(dst + i + 32), x2);
            _mm_stream_si128((__m128i *)(dst + i + 48), x3);
        }
        _mm_sfence();
        memcpy(dst + body, src + body, bytes - body);
        return;
    }
#endif
    for (size_t off = 0; off < bytes; off += ROOF_CHUNK)
        memcpy(dst + off, src + off, min_size(ROOF_CHUNK, bytes - off));
}

static tp_status measure_roof(rank_ctx *rc)
{
    size_t bytes = rc->cfg->roof_bytes;
    if (bytes == 0)
        return TP_OK;
    size_t alloc = (bytes + 4095) & ~(size_t)4095;
    unsigned char *a = aligned_alloc(4096, alloc), *b = aligned_alloc(4096, alloc);
    double failed = (a == NULL || b == NULL) ? 1.0 : 0.0;
    tp_status st = reduce_f64(rc, &failed, 1, TP_MAX);
    if (st != TP_OK || failed != 0.0) {
        if (st == TP_OK && rc->rank == 0)
            fprintf(stderr, "tp-bench-comm: no memory for the roof buffers (2 x %zu B per rank); "
                            "roof%% not shown\n", bytes);
        free(a);
        free(b);
        return st;
    }
    memset(a, 0x5a, bytes); /* fault every page in before timing */
    memset(b, 0, bytes);
    /* t[k * (ROOF_REPS + 1) + rep] for copy kind k; rep 0 of each series is
     * its warm-up */
    double t[ROOF_KINDS * (ROOF_REPS + 1)];
    volatile unsigned char sink = 0;
    for (int rep = 0; rep <= ROOF_REPS && st == TP_OK; rep++) {
        for (int kind = 0; kind < ROOF_KINDS; kind++) {
            st = tp_barrier(rc->comm, NULL);
            if (st != TP_OK) {
                report(rc, NULL, "tp_barrier (roof)", st);
                break;
            }
            double t0 = bench_now_s();
            roof_copy(b, a, bytes, kind);
            t[kind * (ROOF_REPS + 1) + rep] = bench_now_s() - t0;
            sink = b[(size_t)rep * 4099 % bytes]; /* keeps the copy alive */
        }
    }
    bool ok = st == TP_OK && memcmp(a, b, bytes) == 0;
    (void)sink;
    free(a);
    free(b);
    if (st != TP_OK)
        return st;
    if (!ok) {
        fprintf(stderr, "tp-bench-comm: rank %d: memcpy roof copy mismatch\n", rc->rank);
        return TP_ERR_STATE;
    }
    if ((st = reduce_f64(rc, t, ROOF_KINDS * (ROOF_REPS + 1), TP_MAX)) != TP_OK)
        return st;
    double bw[ROOF_KINDS], lo[ROOF_KINDS], hi[ROOF_KINDS];
    for (int c = 0; c < ROOF_KINDS; c++) {
        double *ts = t + c * (ROOF_REPS + 1) + 1;
        qsort(ts, ROOF_REPS, sizeof(double), bench_cmp_double);
        bw[c] = 2.0 * (double)bytes / ts[ROOF_REPS / 2] / 1e9;
        lo[c] = 2.0 * (double)bytes / ts[ROOF_REPS - 1] / 1e9;
        hi[c] = 2.0 * (double)bytes / ts[0] / 1e9;
    }
    if (rc->rank == 0) {
        double roof = bw[0];
        for (int c = 1; c < ROOF_KINDS; c++)
            roof = bw[c] > roof ? bw[c] : roof;
        rc->run->roof_GBps = roof;
        printf("# memcpy roof: %d thread%s x %zu MiB each, traffic = 2 x bytes copied, per thread, "
               "median of %d (range):\n"
               "#   one memcpy call %.2f GB/s (%.2f..%.2f), 64 KiB calls %.2f GB/s (%.2f..%.2f),\n"
               "#   non-temporal stores %.2f GB/s (%.2f..%.2f)\n"
               "#   roof = the fastest: %.2f GB/s traffic per thread, %.2f GB/s total\n",
               rc->n, rc->n == 1 ? "" : "s", bytes >> 20, ROOF_REPS, bw[0], lo[0], hi[0], bw[1],
               lo[1], hi[1], bw[2], lo[2], hi[2], roof, roof * rc->n);
        fflush(stdout);
    }
    return TP_OK;
}

/* ---- one point ----------------------------------------------------------------- */

static void release_pair(tp_tensor **send, tp_tensor **recv)
{
    if (*recv != *send)
        tp_tensor_release(*recv);
    tp_tensor_release(*send);
    *send = *recv = NULL;
}

static void release_views(point *pt)
{
    if (pt->hsend != pt->send || pt->hrecv != pt->recv)
        release_pair(&pt->hsend, &pt->hrecv);
    pt->hsend = pt->hrecv = NULL;
    release_pair(&pt->send, &pt->recv);
}

/* The send and recv views of a point on one pair of buffers. */
static tp_status make_views(const point *pt, int rank, tp_tensor *sendbuf, tp_tensor *recvbuf,
                            tp_tensor **send, tp_tensor **recv)
{
    int64_t cnt = (int64_t)pt->count, k = (int64_t)pt->k, rk = (int64_t)rank * k;
    tp_status st = TP_OK;
    *send = *recv = NULL;
    switch (pt->op) {
    case OP_ALL_REDUCE:
        st = tp_tensor_narrow(sendbuf, 0, 0, cnt, send);
        if (st == TP_OK)
            st = pt->inplace ? (*recv = *send, TP_OK)
                             : tp_tensor_narrow(recvbuf, 0, 0, cnt, recv);
        break;
    case OP_ALL_GATHER:
        st = tp_tensor_narrow(recvbuf, 0, 0, cnt, recv);
        if (st == TP_OK)
            st = pt->inplace ? tp_tensor_narrow(*recv, 0, rk, k, send)
                             : tp_tensor_narrow(sendbuf, 0, 0, k, send);
        break;
    case OP_REDUCE_SCATTER:
        st = tp_tensor_narrow(sendbuf, 0, 0, cnt, send);
        if (st == TP_OK)
            st = pt->inplace ? tp_tensor_narrow(*send, 0, rk, k, recv)
                             : tp_tensor_narrow(recvbuf, 0, 0, k, recv);
        break;
    case OP_ALL_TO_ALL:
        st = tp_tensor_narrow(sendbuf, 0, 0, cnt, send);
        if (st == TP_OK)
            st = tp_tensor_narrow(recvbuf, 0, 0, cnt, recv);
        break;
    case OP_BROADCAST:
        st = tp_tensor_narrow(sendbuf, 0, 0, cnt, send);
        *recv = *send;
        break;
    case OP_SCATTER:
        /* as nccl-tests: in place, root's send is the recv buffer and every
         * rank's recv is its own block of it */
        st = pt->inplace ? tp_tensor_narrow(recvbuf, 0, rk, k, recv)
                         : tp_tensor_narrow(recvbuf, 0, 0, k, recv);
        if (st == TP_OK && rank == pt->root)
            st = tp_tensor_narrow(pt->inplace ? recvbuf : sendbuf, 0, 0, cnt, send);
        break;
    default: break;
    }
    if (st != TP_OK) {
        if (*recv == *send)
            *recv = NULL;
        tp_tensor_release(*recv);
        tp_tensor_release(*send);
        *send = *recv = NULL;
    }
    return st;
}

/* Picks the element counts for size S and the call a form makes, and makes
 * the views. Returns TP_OK with pt->k == 0 when S is too small for one element
 * per block. */
static tp_status setup_point(const rank_ctx *rc, point *pt, size_t S)
{
    const struct op_info *oi = &op_info[pt->op];
    size_t es = pt->dt->size, n = (size_t)rc->n;
    tp_status st = TP_OK;
    pt->substitute = !oi->has[pt->form];
    pt->inplace = pt->substitute ? pt->form != FORM_IP : pt->form == FORM_IP;
    pt->k = oi->split ? S / es / n : S / es;
    pt->count = oi->split ? pt->k * n : pt->k;
    pt->bytes = pt->count * es;
    if (pt->k == 0)
        return TP_OK;
    st = make_views(pt, rc->rank, rc->sendbuf, rc->recvbuf, &pt->send, &pt->recv);
    if (st == TP_OK && rc->device >= 0) {
        st = make_views(pt, rc->rank, rc->hsendbuf, rc->hrecvbuf, &pt->hsend, &pt->hrecv);
        if (st != TP_OK)
            release_pair(&pt->send, &pt->recv);
    } else {
        pt->hsend = pt->send;
        pt->hrecv = pt->recv;
    }
    if (st != TP_OK)
        report(rc, pt, "tp_tensor_narrow", st);
    return st;
}

/* Device buffers: host mirrors -> device before a call, device -> host
 * before a check. No-ops on CPU. */
static tp_status upload(const rank_ctx *rc, const point *pt)
{
    if (rc->device < 0)
        return TP_OK;
    tp_status st = tp_tensor_copy(pt->recv, pt->hrecv);
    if (st == TP_OK && pt->send && pt->send != pt->recv)
        st = tp_tensor_copy(pt->send, pt->hsend);
    if (st != TP_OK)
        report(rc, pt, "tp_tensor_copy (host to device)", st);
    return st;
}

static tp_status download(const rank_ctx *rc, const point *pt)
{
    if (rc->device < 0)
        return TP_OK;
    tp_status st = tp_tensor_copy(pt->hrecv, pt->recv);
    if (st != TP_OK)
        report(rc, pt, "tp_tensor_copy (device to host)", st);
    return st;
}

/* One call: blocking (-z 1), or started with a work handle and waited for. */
static tp_status run_coll(const rank_ctx *rc, const point *pt)
{
    tp_work *w = NULL, **wp = rc->cfg->blocking ? NULL : &w;
    tp_status st;
    switch (pt->op) {
    case OP_ALL_REDUCE: st = tp_all_reduce(rc->comm, pt->send, pt->recv, pt->redop, wp); break;
    case OP_ALL_GATHER: st = tp_all_gather(rc->comm, pt->send, pt->recv, wp); break;
    case OP_REDUCE_SCATTER:
        st = tp_reduce_scatter(rc->comm, pt->send, pt->recv, pt->redop, wp);
        break;
    case OP_ALL_TO_ALL: st = tp_all_to_all(rc->comm, pt->send, pt->recv, wp); break;
    case OP_BROADCAST: st = tp_broadcast(rc->comm, pt->send, pt->root, wp); break;
    case OP_SCATTER: st = tp_scatter(rc->comm, pt->send, pt->recv, pt->root, wp); break;
    default: st = TP_ERR_INVALID_ARG; break;
    }
    if (st == TP_OK && w)
        st = tp_work_wait(w);
    tp_work_free(w);
    /* The shm backend on CUDA tensors may return once the data movement is
     * enqueued: a call is timed until this rank's stream, which the collective
     * runs on, has finished it. (The nccl backend's wait above already waits
     * for the collective's completion event.) */
    if (st == TP_OK && rc->sync_stream)
        st = tp_cuda_synchronize(rc->device);
    return st;
}

/* Writes the sentinel into everything the collective must overwrite. */
static void reset_outputs(const rank_ctx *rc, const point *pt)
{
    epattern s = encode_pattern(&sentinel_pattern, pt->dt);
    size_t es = pt->dt->size, k = pt->k, r = (size_t)rc->rank, n = (size_t)rc->n;
    switch (pt->op) {
    case OP_ALL_REDUCE:
    case OP_REDUCE_SCATTER:
        if (!pt->inplace)
            pattern_fill(tdata(pt->hrecv), pt->op == OP_ALL_REDUCE ? pt->count : k, &s, 0);
        break;
    case OP_ALL_GATHER:
        for (size_t b = 0; b < n; b++)
            if (!pt->inplace || b != r)
                pattern_fill(tdata(pt->hrecv) + b * k * es, k, &s, 0);
        break;
    case OP_ALL_TO_ALL: pattern_fill(tdata(pt->hrecv), pt->count, &s, 0); break;
    case OP_BROADCAST:
        if (rc->rank != pt->root)
            pattern_fill(tdata(pt->hsend), pt->count, &s, 0);
        break;
    case OP_SCATTER:
        if (!pt->inplace || rc->rank != pt->root)
            pattern_fill(tdata(pt->hrecv), k, &s, 0);
        break;
    default: break;
    }
}

/* Writes the inputs, and the sentinel into the outputs. */
static void fill_point(const rank_ctx *rc, const point *pt)
{
    const dtype_info *dt = pt->dt;
    size_t es = dt->size, k = pt->k, r = (size_t)rc->rank, n = (size_t)rc->n;
    reset_outputs(rc, pt);
    switch (pt->op) {
    case OP_ALL_REDUCE:
    case OP_REDUCE_SCATTER: {
        pattern p = red_in_pattern(&pt->plan, pt->redop, rc->rank);
        epattern ep = encode_pattern(&p, dt);
        pattern_fill(tdata(pt->hsend), pt->count, &ep, 0);
        break;
    }
    case OP_ALL_GATHER: {
        pattern p = block_pattern(r);
        epattern ep = encode_pattern(&p, dt);
        pattern_fill(tdata(pt->hsend), k, &ep, 0);
        break;
    }
    case OP_ALL_TO_ALL:
        for (size_t j = 0; j < n; j++) {
            pattern p = block_pattern(r * n + j);
            epattern ep = encode_pattern(&p, dt);
            pattern_fill(tdata(pt->hsend) + j * k * es, k, &ep, 0);
        }
        break;
    case OP_BROADCAST:
        if (rc->rank == pt->root) {
            pattern p = block_pattern((size_t)pt->root);
            epattern ep = encode_pattern(&p, dt);
            pattern_fill(tdata(pt->hsend), pt->count, &ep, 0);
        }
        break;
    case OP_SCATTER:
        if (rc->rank == pt->root)
            for (size_t j = 0; j < n; j++) {
                pattern p = block_pattern(j);
                epattern ep = encode_pattern(&p, dt);
                pattern_fill(tdata(pt->hsend) + j * k * es, k, &ep, 0);
            }
        break;
    default: break;
    }
}

/* Wrong elements of this rank's output. */
static size_t check_point(const rank_ctx *rc, const point *pt)
{
    const dtype_info *dt = pt->dt;
    size_t es = dt->size, k = pt->k, r = (size_t)rc->rank, n = (size_t)rc->n, wrong = 0;
    switch (pt->op) {
    case OP_ALL_REDUCE:
    case OP_REDUCE_SCATTER: {
        pattern p = red_out_pattern(&pt->plan, pt->redop, rc->n, dt);
        epattern ep = encode_pattern(&p, dt);
        double rtol = (pt->redop == TP_AVG && dt->is_float) ? dt->avg_rtol : 0.0;
        if (pt->op == OP_ALL_REDUCE)
            wrong = pattern_count_wrong(tdata(pt->hrecv), pt->count, &ep, 0, dt, rtol, rc->scratch);
        else
            wrong = pattern_count_wrong(tdata(pt->hrecv), k, &ep, (r * k) % p.period, dt, rtol,
                                        rc->scratch);
        break;
    }
    case OP_ALL_GATHER:
        for (size_t b = 0; b < n; b++) {
            pattern p = block_pattern(b);
            epattern ep = encode_pattern(&p, dt);
            wrong += pattern_count_wrong(tdata(pt->hrecv) + b * k * es, k, &ep, 0, dt, 0.0,
                                         rc->scratch);
        }
        break;
    case OP_ALL_TO_ALL:
        for (size_t b = 0; b < n; b++) {
            pattern p = block_pattern(b * n + r);
            epattern ep = encode_pattern(&p, dt);
            wrong += pattern_count_wrong(tdata(pt->hrecv) + b * k * es, k, &ep, 0, dt, 0.0,
                                         rc->scratch);
        }
        break;
    case OP_BROADCAST: {
        pattern p = block_pattern((size_t)pt->root);
        epattern ep = encode_pattern(&p, dt);
        wrong = pattern_count_wrong(tdata(pt->hsend), pt->count, &ep, 0, dt, 0.0, rc->scratch);
        break;
    }
    case OP_SCATTER: {
        pattern p = block_pattern(r);
        epattern ep = encode_pattern(&p, dt);
        wrong = pattern_count_wrong(tdata(pt->hrecv), k, &ep, 0, dt, 0.0, rc->scratch);
        break;
    }
    default: break;
    }
    return wrong;
}

/* true if a call changes its own input (in-place sum/avg/prod), so the
 * outputs after a timed loop cannot be checked */
static bool compounds(const point *pt)
{
    return pt->inplace && op_info[pt->op].reduces &&
           (pt->redop == TP_SUM || pt->redop == TP_AVG || pt->redop == TP_PRODUCT);
}

/* false when the check of a reduction is skipped: no inputs found whose
 * result is exact in the dtype at n ranks */
static bool reduction_checkable(bench_op op, tp_reduce_op redop, const dtype_info *dt, int n)
{
    if (!op_info[op].reduces)
        return true;
    red_plan plan = make_red_plan(redop, dt, n);
    pattern out = red_out_pattern(&plan, redop, n, dt);
    return plan.exact && pattern_exact(&out, dt);
}

/* A barrier and one call; `what` names the failing one. */
static tp_status barrier_call(const rank_ctx *rc, const point *pt, const char **what)
{
    tp_status st = tp_barrier(rc->comm, NULL);
    if (st != TP_OK) {
        *what = "tp_barrier";
        return st;
    }
    *what = op_info[pt->op].name;
    return run_coll(rc, pt);
}

/* ---- the device copy baseline (buffers on a GPU) ---------------------------------
 *
 * A bare cudaMemcpyAsync device to device of the row's bytes on rank 0's GPU,
 * from its send buffer to its recv buffer, on a stream of its own: COPY_WARM
 * copies, then COPY_REPS batches of COPY_BATCH copies each timed between two
 * CUDA events; the median batch over COPY_BATCH is the copy time. Its algbw
 * (bytes / time) is what busbw is compared with, its traffic (2 x bytes /
 * time) is roof%'s roof. The other ranks wait in a barrier meanwhile, so the
 * GPU copies alone. Returns 0 when the copy could not be timed (no CUDA). */
static double time_device_copy(const rank_ctx *rc, size_t bytes)
{
#if TP_HAVE_CUDA
    void *dst = tp_tensor_data(rc->recvraw);
    const void *src = tp_tensor_data(rc->sendraw);
    cudaStream_t s = NULL;
    cudaEvent_t ev[2] = {NULL, NULL};
    float ms[COPY_REPS];
    int prev = 0;
    cudaError_t err = cudaGetDevice(&prev);
    if (err == cudaSuccess)
        err = cudaSetDevice(rc->device);
    if (err == cudaSuccess)
        err = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    if (err == cudaSuccess)
        err = cudaEventCreate(&ev[0]);
    if (err == cudaSuccess)
        err = cudaEventCreate(&ev[1]);
    for (int i = 0; i < COPY_WARM && err == cudaSuccess; i++)
        err = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s);
    for (int r = 0; r < COPY_REPS && err == cudaSuccess; r++) {
        err = cudaEventRecord(ev[0], s);
        for (int i = 0; i < COPY_BATCH && err == cudaSuccess; i++)
            err = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s);
        if (err == cudaSuccess)
            err = cudaEventRecord(ev[1], s);
        if (err == cudaSuccess)
            err = cudaEventSynchronize(ev[1]);
        if (err == cudaSuccess)
            err = cudaEventElapsedTime(&ms[r], ev[0], ev[1]);
    }
    for (int i = 0; i < 2; i++)
        if (ev[i])
            (void)cudaEventDestroy(ev[i]);
    if (s)
        (void)cudaStreamDestroy(s);
    (void)cudaSetDevice(prev);
    if (err != cudaSuccess) {
        fprintf(stderr,
                "tp-bench-comm: device copy baseline of %zu B on cuda:%d: %s; "
                "busbw/copy and roof%% not shown\n",
                bytes, rc->device, cudaGetErrorString(err));
        return 0.0;
    }
    double t[COPY_REPS];
    for (int r = 0; r < COPY_REPS; r++)
        t[r] = (double)ms[r] * 1e-3 / COPY_BATCH;
    return bench_median(t, COPY_REPS);
#else
    (void)rc;
    (void)bytes;
    return 0.0;
#endif
}

/* Every rank: the GPU idle, rank 0 times the copy, everyone waits for it. */
static tp_status measure_device_copy(const rank_ctx *rc, size_t bytes, double *copy_s)
{
    *copy_s = 0.0;
    tp_status st = tp_barrier(rc->comm, NULL);
    if (st == TP_OK && rc->rank == 0)
        *copy_s = time_device_copy(rc, bytes);
    if (st == TP_OK)
        st = tp_barrier(rc->comm, NULL);
    if (st != TP_OK)
        report(rc, NULL, "tp_barrier (device copy baseline)", st);
    return st;
}

/*
 * The traffic of the shm backend's data phase (src/collectives/shm.c) on
 * GPUs, totals over all n ranks in bytes read + written, where every copy
 * reads its source and writes its destination (no reuse through a cache):
 *
 *   all_reduce      rank r reduces slice r of all n inputs into all n outputs:
 *                   reads S, writes S per rank               total 2nS
 *   all_gather      rank r copies its block into every recv buffer (n copies
 *                   of S/n; in place n-1)                    2nS, in place 2S(n-1)
 *   reduce_scatter  rank r reads slice r of all n inputs, writes S/n   S(n+1)
 *   all_to_all      rank r copies n blocks of S/n into its recv        2nS
 *   broadcast       the n-1 other ranks copy root's S                  2S(n-1)
 *   scatter         every rank copies its block from root's send
 *                   (in place root's stays)                  2S, in place 2S(n-1)/n
 *
 * With n = 1 the out-of-place forms are a copy (2S), the in-place ones move
 * nothing. bench/README.md derives from it the bound of busbw / copy on one GPU.
 */
static double device_traffic(bench_op op, bool inplace, double S, int n)
{
    double nn = (double)n;
    switch (op) {
    case OP_ALL_REDUCE:
        return inplace && n == 1 ? 0.0 : 2.0 * nn * S;
    case OP_ALL_GATHER:
        return inplace ? 2.0 * S * (nn - 1.0) : 2.0 * nn * S;
    case OP_REDUCE_SCATTER:
        return inplace && n == 1 ? 0.0 : S * (nn + 1.0);
    case OP_ALL_TO_ALL:
        return 2.0 * nn * S;
    case OP_BROADCAST:
        return 2.0 * S * (nn - 1.0);
    case OP_SCATTER:
        return inplace ? 2.0 * S * (nn - 1.0) / nn : 2.0 * S;
    default:
        return 0.0;
    }
}

/* Rank 0, a device row: busbw over the copy's algbw, and roof% = the data
 * phase's traffic on the busiest GPU (dev_ranks of the n ranks' share) per
 * second over the copy's traffic (2 x bytes) per second. The CSV's model
 * column becomes that traffic per rank. */
static void device_roof(const rank_ctx *rc, point_row *row, bench_op op)
{
    for (int form = 0; form < N_FORMS; form++) {
        form_result *f = &row->f[form];
        f->busbw_copy = NAN;
        if (row->copy_s <= 0.0 || f->time_s <= 0.0)
            continue;
        double S = (double)row->bytes, copy_algbw = S / row->copy_s / 1e9;
        f->busbw_copy = f->busbw / copy_algbw;
        bool inplace = (form == FORM_IP) != f->substitute;
        f->model = device_traffic(op, inplace, S, rc->n) / rc->n;
        double traffic = f->model * rc->dev_ranks;
        f->roof = traffic > 0.0 ? (traffic / f->time_s) / (2.0 * S / row->copy_s) : NAN;
    }
}

/* ---- --nccl-bare: NCCL itself on the same buffers (a world of one) ----------------- */

#if TP_HAVE_NCCL
typedef struct bare_nccl {
    ncclComm_t comm;
    cudaStream_t stream;
    int device;
} bare_nccl;

static bool nccl_types(const point *pt, ncclDataType_t *t, ncclRedOp_t *op)
{
    switch (pt->dt->dtype) {
    case TP_F32:
        *t = ncclFloat32;
        break;
    case TP_F64:
        *t = ncclFloat64;
        break;
    case TP_F16:
        *t = ncclFloat16;
        break;
    case TP_BF16:
        *t = ncclBfloat16;
        break;
    case TP_I32:
        *t = ncclInt32;
        break;
    case TP_I64:
        *t = ncclInt64;
        break;
    default:
        return false;
    }
    switch (pt->redop) {
    case TP_SUM:
        *op = ncclSum;
        break;
    case TP_PRODUCT:
        *op = ncclProd;
        break;
    case TP_MAX:
        *op = ncclMax;
        break;
    case TP_MIN:
        *op = ncclMin;
        break;
    case TP_AVG:
        *op = ncclAvg;
        break;
    default:
        return false;
    }
    return true;
}

/* One bare call, waited for on the host like libtp's (its stream synchronized). */
static tp_status bare_call(const bare_nccl *b, const point *pt)
{
    ncclDataType_t t;
    ncclRedOp_t op;
    if (!nccl_types(pt, &t, &op))
        return TP_ERR_NOT_SUPPORTED;
    const void *send = tp_tensor_data(pt->send);
    void *recv = tp_tensor_data(pt->recv);
    ncclResult_t r = pt->op == OP_ALL_REDUCE
                         ? ncclAllReduce(send, recv, pt->count, t, op, b->comm, b->stream)
                         : ncclAllGather(send, recv, pt->k, t, b->comm, b->stream);
    if (r != ncclSuccess) {
        fprintf(stderr, "tp-bench-comm: bare %s: %s\n",
                pt->op == OP_ALL_REDUCE ? "ncclAllReduce" : "ncclAllGather", ncclGetErrorString(r));
        return TP_ERR_BACKEND;
    }
    cudaError_t err = cudaStreamSynchronize(b->stream);
    if (err != cudaSuccess) {
        fprintf(stderr, "tp-bench-comm: bare NCCL call: cudaStreamSynchronize: %s\n",
                cudaGetErrorString(err));
        return TP_ERR_BACKEND;
    }
    return TP_OK;
}

/* The bare call timed like libtp's form (same -w, calls per loop, -R, a
 * barrier before each call, checked the same way); res gets its times and
 * the ratios. World of one: this is rank 0. */
static tp_status bench_bare(rank_ctx *rc, point *pt, form_result *res)
{
    const bench_cfg *cfg = rc->cfg;
    const bare_nccl *b = rc->bare;
    double rep_s[MAX_REPS], wrong = 0.0;
    tp_status st = TP_OK;
    int prev = 0;
    if (cudaGetDevice(&prev) != cudaSuccess || cudaSetDevice(b->device) != cudaSuccess)
        return TP_ERR_BACKEND;
    bool check = pt->check && !compounds(pt);
    fill_point(rc, pt);
    st = upload(rc, pt);
    for (int i = 0; i < (cfg->warmup > 0 ? cfg->warmup : 1) && st == TP_OK; i++)
        if ((st = tp_barrier(rc->comm, NULL)) == TP_OK)
            st = bare_call(b, pt);
    for (int rep = 0; rep < cfg->reps && st == TP_OK; rep++) {
        if (check) {
            reset_outputs(rc, pt);
            st = upload(rc, pt);
        }
        double sum = 0.0;
        for (int i = 0; i < res->iters && st == TP_OK; i++) {
            if ((st = tp_barrier(rc->comm, NULL)) != TP_OK)
                break;
            double t0 = bench_now_s();
            st = bare_call(b, pt);
            sum += bench_now_s() - t0;
        }
        rep_s[rep] = sum / res->iters;
        if (st == TP_OK && check && (st = download(rc, pt)) == TP_OK)
            wrong += (double)check_point(rc, pt);
    }
    (void)cudaSetDevice(prev);
    if (st != TP_OK) {
        report(rc, pt, "bare NCCL", st);
        return st;
    }
    res->wrong += wrong;
    res->ratio_min = INFINITY;
    res->ratio_max = 0.0;
    for (int r = 0; r < cfg->reps; r++) {
        double q = rep_s[r] > 0.0 ? res->rep_s[r] / rep_s[r] : NAN;
        res->ratio_min = q < res->ratio_min ? q : res->ratio_min;
        res->ratio_max = q > res->ratio_max ? q : res->ratio_max;
    }
    qsort(rep_s, (size_t)cfg->reps, sizeof(double), bench_cmp_double);
    res->bare_s = bench_median(rep_s, cfg->reps);
    res->bare_min_s = rep_s[0];
    res->bare_max_s = rep_s[cfg->reps - 1];
    res->ratio = res->bare_s > 0.0 ? res->time_s / res->bare_s : NAN;
    return TP_OK;
}

/* A world of one on `device`: ncclCommInitAll and a non-blocking stream. */
static tp_status bare_create(int device, bare_nccl **out)
{
    bare_nccl *b = calloc(1, sizeof *b);
    int prev = 0;
    *out = NULL;
    if (!b)
        return TP_ERR_NO_MEMORY;
    b->device = device;
    cudaError_t err = cudaGetDevice(&prev);
    if (err == cudaSuccess && (err = cudaSetDevice(device)) == cudaSuccess)
        err = cudaStreamCreateWithFlags(&b->stream, cudaStreamNonBlocking);
    ncclResult_t r = err == cudaSuccess ? ncclCommInitAll(&b->comm, 1, &device) : ncclSuccess;
    (void)cudaSetDevice(prev);
    if (err != cudaSuccess || r != ncclSuccess) {
        fprintf(stderr, "tp-bench-comm: bare NCCL world of one on cuda:%d: %s\n", device,
                err != cudaSuccess ? cudaGetErrorString(err) : ncclGetErrorString(r));
        if (b->stream)
            (void)cudaStreamDestroy(b->stream);
        free(b);
        return TP_ERR_BACKEND;
    }
    *out = b;
    return TP_OK;
}

static void bare_free(bare_nccl *b)
{
    if (!b)
        return;
    (void)ncclCommDestroy(b->comm);
    (void)cudaStreamDestroy(b->stream);
    free(b);
}
#endif

/* Runs one form of one point on this rank: warm-up, -R timed loops, checks.
 * Rank 0 fills `res`. */
static tp_status bench_form(rank_ctx *rc, point *pt, form_result *res)
{
    const bench_cfg *cfg = rc->cfg;
    const char *what = op_info[pt->op].name;
    bool compound = compounds(pt);
    double wrong = 0.0, t0, t1;
    double rep_mean[MAX_REPS], iter_med[MAX_REPS];
    tp_status st;

    fill_point(rc, pt);
    if ((st = upload(rc, pt)) != TP_OK)
        return st;
    /* first warm-up call: checked, and timed to size the rest */
    t0 = bench_now_s();
    if ((st = barrier_call(rc, pt, &what)) != TP_OK)
        goto fail;
    double tw[2] = {bench_now_s() - t0, 0.0};
    if (pt->check) {
        if ((st = download(rc, pt)) != TP_OK)
            return st;
        wrong += (double)check_point(rc, pt);
    }
    if ((st = reduce_f64(rc, tw, 1, TP_MAX)) != TP_OK)
        return st;
    int warm_rest = cfg->warmup - 1;
    if (cfg->iters == 0 && warm_rest > 0 && tw[0] > 0.0 && (double)warm_rest * tw[0] > cfg->target_s / 2)
        warm_rest = (int)(cfg->target_s / 2 / tw[0]);
    t0 = bench_now_s();
    for (int i = 0; i < warm_rest; i++)
        if ((st = barrier_call(rc, pt, &what)) != TP_OK)
            goto fail;
    /* barriers included: the count bounds the wall time of a loop */
    tw[1] = warm_rest > 0 ? (bench_now_s() - t0) / warm_rest : tw[0];
    if ((st = reduce_f64(rc, tw + 1, 1, TP_MAX)) != TP_OK)
        return st;
    int iters = cfg->iters;
    if (iters == 0) {
        double want = tw[1] > 0.0 ? cfg->target_s / tw[1] : MAX_ITERS;
        iters = want < MIN_ITERS ? MIN_ITERS : want > MAX_ITERS ? MAX_ITERS : (int)want;
    }

    for (int rep = 0; rep < cfg->reps; rep++) {
        bool check_rep = pt->check && !compound;
        if (check_rep) {
            reset_outputs(rc, pt);
            if ((st = upload(rc, pt)) != TP_OK)
                return st;
        }
        double sum = 0.0;
        for (int i = 0; i < iters; i++) {
            if ((st = tp_barrier(rc->comm, NULL)) != TP_OK) {
                what = "tp_barrier";
                goto fail;
            }
            t0 = bench_now_s();
            st = run_coll(rc, pt);
            t1 = bench_now_s();
            if (st != TP_OK)
                goto fail;
            rc->times[i] = t1 - t0;
            sum += t1 - t0;
        }
        rep_mean[rep] = sum / iters;
        if (check_rep) {
            if ((st = download(rc, pt)) != TP_OK)
                return st;
            wrong += (double)check_point(rc, pt);
        }
        /* the slowest rank per call, for the median per call in the CSV */
        if ((st = reduce_f64(rc, rc->times, (size_t)iters, TP_MAX)) != TP_OK)
            return st;
        if (rc->rank == 0)
            iter_med[rep] = bench_median(rc->times, iters);
    }
    /* -c N: N more calls on fresh inputs, each checked */
    for (int c = 0; pt->check && c < cfg->check; c++) {
        fill_point(rc, pt);
        if ((st = upload(rc, pt)) != TP_OK)
            return st;
        if ((st = barrier_call(rc, pt, &what)) != TP_OK)
            goto fail;
        if ((st = download(rc, pt)) != TP_OK)
            return st;
        wrong += (double)check_point(rc, pt);
    }

    /* -a: how the ranks' times of a repetition combine */
    switch (cfg->average) {
    case 1:
        if ((st = reduce_f64(rc, rep_mean, (size_t)cfg->reps, TP_SUM)) != TP_OK)
            return st;
        for (int r = 0; r < cfg->reps; r++)
            rep_mean[r] /= rc->n;
        break;
    case 2: st = reduce_f64(rc, rep_mean, (size_t)cfg->reps, TP_MIN); break;
    case 3: st = reduce_f64(rc, rep_mean, (size_t)cfg->reps, TP_MAX); break;
    default: break; /* 0: rank 0's own */
    }
    if (st != TP_OK)
        return st;
    if ((st = reduce_f64(rc, &wrong, 1, TP_SUM)) != TP_OK)
        return st;

    if (rc->rank == 0) {
        double sorted[MAX_REPS];
        memset(res, 0, sizeof *res);
        res->substitute = pt->substitute;
        res->checked = pt->check;
        res->iters = iters;
        res->wrong = wrong;
        memcpy(res->rep_s, rep_mean, sizeof(double) * (size_t)cfg->reps);
        memcpy(sorted, rep_mean, sizeof(double) * (size_t)cfg->reps);
        res->time_s = bench_median(sorted, cfg->reps);
        res->min_s = sorted[0];
        res->max_s = sorted[cfg->reps - 1];
        res->iter_med_s = bench_median(iter_med, cfg->reps);
        double Sd = (double)pt->bytes;
        res->algbw = res->time_s > 0.0 ? Sd / res->time_s / 1e9 : 0.0;
        res->busbw = res->algbw * bus_factor(pt->op, rc->n);
        res->model = model_bytes(pt->op, pt->inplace, Sd, rc->n);
        res->roof = (rc->run->roof_GBps > 0.0 && res->model > 0.0 && res->time_s > 0.0)
                        ? res->model / res->time_s / 1e9 / rc->run->roof_GBps
                        : NAN;
    }
#if TP_HAVE_NCCL
    if (rc->bare && (pt->op == OP_ALL_REDUCE || pt->op == OP_ALL_GATHER))
        return bench_bare(rc, pt, res);
#endif
    return TP_OK;

fail:
    report(rc, pt, what, st);
    return st;
}

/* nccl-tests' time column: 2 decimals below 100 us, 1 below 10 ms, then none */
static const char *fmt_time(char *buf, size_t len, double us)
{
    if (us >= 10000.0)
        snprintf(buf, len, "%7.0f", us);
    else if (us >= 100.0)
        snprintf(buf, len, "%7.1f", us);
    else
        snprintf(buf, len, "%7.2f", us);
    return buf;
}

static void csv_row(const rank_ctx *rc, const point_row *row, bench_op op, int form)
{
    const form_result *f = &row->f[form];
    FILE *csv = rc->run->csv;
    const bench_cfg *cfg = rc->cfg;
    fprintf(csv, "%s,%s,%d,%d,%d,%s,%s,%d,%zu,%zu,%d,%d,%.3f,%.3f,%.3f,%.3f,%.4f,%.4f,",
            op_info[op].name, cfg->backend->name, rc->n, form == FORM_IP,
            (form == FORM_IP) != f->substitute, row->dt->name,
            op_info[op].reduces ? redop_name(row->redop) : "none",
            op_info[op].rooted ? row->root : -1, row->bytes,
            row->count, f->iters, cfg->reps, f->time_s * 1e6, f->min_s * 1e6, f->max_s * 1e6,
            f->iter_med_s * 1e6, f->algbw, f->busbw);
    if (f->checked)
        fprintf(csv, "%.0f", f->wrong);
    fprintf(csv, ",%d,%d,", cfg->average, cfg->blocking ? 1 : 0);
    for (int r = 0; r < cfg->reps; r++)
        fprintf(csv, "%s%.3f", r ? " " : "", f->rep_s[r] * 1e6);
    /* on a GPU the roof is the copy's traffic, 2 x bytes / copy time, of the whole device */
    double roof = rc->device >= 0
                      ? (row->copy_s > 0.0 ? 2.0 * (double)row->bytes / row->copy_s / 1e9 : 0.0)
                      : rc->run->roof_GBps;
    fprintf(csv, ",%.0f,%.3f,", f->model, roof);
    if (!isnan(f->roof))
        fprintf(csv, "%.4f", f->roof);
    fprintf(csv, ",%s,", rc->device >= 0 ? "cuda" : "cpu");
    if (row->copy_s > 0.0)
        fprintf(csv, "%.3f,%.3f,%.4f", row->copy_s * 1e6, (double)row->bytes / row->copy_s / 1e9,
                f->busbw_copy);
    else
        fprintf(csv, ",,");
    if (f->bare_s > 0.0)
        fprintf(csv, ",%.3f,%.3f,%.3f,%.4f,%.4f,%.4f", f->bare_s * 1e6, f->bare_min_s * 1e6,
                f->bare_max_s * 1e6, f->ratio, f->ratio_min, f->ratio_max);
    else
        fprintf(csv, ",,,,,,");
    fprintf(csv, "\n");
}

/* Runs one point (both forms) on this rank; rank 0 prints its row. */
static tp_status bench_point(rank_ctx *rc, bench_op op, const dtype_info *dt,
                             tp_reduce_op redop, int root, size_t S)
{
    bench_run *run = rc->run;
    point_row row = {.dt = dt, .redop = redop, .root = root};
    tp_status st = TP_OK;
    bool copied = false;
    for (int form = 0; form < N_FORMS; form++) {
        point pt = {.op = op, .dt = dt, .redop = redop, .root = root, .form = form};
        if ((st = setup_point(rc, &pt, S)) != TP_OK)
            break;
        if (pt.k == 0)
            return TP_OK; /* too small for one element per block */
        pt.plan = make_red_plan(redop, dt, rc->n);
        pt.check = rc->cfg->check > 0 && !pt.substitute &&
                   reduction_checkable(op, redop, dt, rc->n);
        row.bytes = pt.bytes;
        row.count = pt.k;
        if (rc->device >= 0 && !copied) {
            copied = true;
            if ((st = measure_device_copy(rc, pt.bytes, &row.copy_s)) != TP_OK) {
                release_views(&pt);
                break;
            }
        }
        st = bench_form(rc, &pt, &row.f[form]);
        release_views(&pt);
        if (st != TP_OK)
            break;
    }
    if (st != TP_OK) {
        if (rc->rank == 0)
            run->ops[op].status = st;
        return st;
    }
    if (rc->rank != 0)
        return TP_OK;
    if (rc->device >= 0)
        device_roof(rc, &row, op);

    printf("%12zu  %12zu  %8s  %6s  %6d", row.bytes, row.count, dt->name,
           op_info[op].reduces ? redop_name(redop) : "none", op_info[op].rooted ? root : -1);
    for (int form = 0; form < N_FORMS; form++) {
        const form_result *f = &row.f[form];
        char ts[32], ws[32];
        if (f->checked)
            snprintf(ws, sizeof ws, "%g", f->wrong);
        else
            snprintf(ws, sizeof ws, "N/A");
        printf("  %7s  %6.2f  %6.2f  %5s", fmt_time(ts, sizeof ts, f->time_s * 1e6), f->algbw,
               f->busbw, ws);
    }
    printf("\n");
    fflush(stdout);
    if (run->csv) {
        for (int form = 0; form < N_FORMS; form++)
            csv_row(rc, &row, op, form);
        fflush(run->csv);
    }
    op_summary *os = &run->ops[op];
    os->points++;
    for (int form = 0; form < N_FORMS; form++) {
        os->wrong += row.f[form].wrong;
        run->wrong_total += row.f[form].wrong;
    }
    if (run->nrows == run->cap) {
        size_t cap = run->cap ? 2 * run->cap : 64;
        point_row *rows = realloc(run->rows, cap * sizeof *rows);
        if (!rows) {
            fprintf(stderr, "tp-bench-comm: out of memory for the spread table\n");
            return TP_OK; /* the row is printed; only its spread line is lost */
        }
        run->rows = rows;
        run->cap = cap;
    }
    run->rows[run->nrows++] = row;
    return TP_OK;
}

/* ---- sections: one per collective, each like one nccl-tests binary's output ---- */

static void print_section_header(const rank_ctx *rc, bench_op op)
{
    const struct op_info *oi = &op_info[op];
    printf("#\n# Collective test starting: %s\n", oi->perf);
    printf("# %s: libtp tp_%s, %d rank%s\n", oi->name, oi->name, rc->n, rc->n == 1 ? "" : "s");
    printf("#\n");
    printf("# %10s  %12s  %8s  %6s  %6s           out-of-place                       in-place          \n",
           "", "", "", "", "");
    printf("# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s %6s  %7s  %6s  %6s %6s\n", "size", "count",
           "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw",
           "#wrong");
    printf("# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %5s  %7s  %6s  %6s  %5s\n", "(B)",
           "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", "");
    fflush(stdout);
}

/* '#' lines of a device run: the copy baseline of every row, busbw over the
 * copy's algbw and roof%; with --nccl-bare the bare NCCL call's time and the
 * ratio libtp / bare (median, and its range over the -R repetitions). */
static void print_device_lines(const rank_ctx *rc, bench_op op)
{
    const bench_run *run = rc->run;
    printf("# %s on GPUs: copy = one cudaMemcpyAsync device to device of the row's bytes on rank "
           "0's GPU\n#   (algbw = bytes / its time); busbw/copy = busbw / that algbw; roof%% = "
           "modelled traffic of the\n#   %d rank%s on the busiest GPU per second / the copy's "
           "2 x bytes per second (bench/README.md)\n",
           op_info[op].name, rc->dev_ranks, rc->dev_ranks == 1 ? "" : "s");
    printf("# gpu %12s  %8s  %8s  %8s  | %8s  %6s  | %8s  %6s\n", "size", "copy", "copy", "",
           "busbw/", "roof%", "busbw/", "roof%");
    printf("# gpu %12s  %8s  %8s  %8s  | %8s  %6s  | %8s  %6s\n", "(B)", "(us)", "(GB/s)", "",
           "copy oop", "oop", "copy ip", "ip");
    for (size_t i = 0; i < run->nrows; i++) {
        const point_row *row = &run->rows[i];
        if (row->copy_s <= 0.0) {
            printf("# gpu %12zu  (no copy baseline)\n", row->bytes);
            continue;
        }
        printf("# gpu %12zu  %8.2f  %8.1f  %8s", row->bytes, row->copy_s * 1e6,
               (double)row->bytes / row->copy_s / 1e9, "");
        for (int form = 0; form < N_FORMS; form++) {
            const form_result *f = &row->f[form];
            char roof[16] = "-";
            if (!isnan(f->roof))
                snprintf(roof, sizeof roof, "%.1f", 100.0 * f->roof);
            printf("  | %8.3f  %6s", f->busbw_copy, roof);
        }
        printf("\n");
    }
    if (!rc->bare || (op != OP_ALL_REDUCE && op != OP_ALL_GATHER))
        return;
    printf("# bare NCCL: %s on the same buffers, stream synchronized after each call, "
           "timed like libtp's;\n#   ratio = libtp time / bare time (medians), min..max over "
           "the -R repetitions, paired\n",
           op == OP_ALL_REDUCE ? "ncclAllReduce" : "ncclAllGather");
    printf("# bare %12s  | %8s  %8s  %15s  | %8s  %8s  %15s\n", "size", "oop bare", "ratio",
           "min..max", "ip bare", "ratio", "min..max");
    for (size_t i = 0; i < run->nrows; i++) {
        const point_row *row = &run->rows[i];
        printf("# bare %12zu", row->bytes);
        for (int form = 0; form < N_FORMS; form++) {
            const form_result *f = &row->f[form];
            char t[32], range[40];
            snprintf(range, sizeof range, "%.3f..%.3f", f->ratio_min, f->ratio_max);
            printf("  | %8s  %8.3f  %15s", fmt_time(t, sizeof t, f->bare_s * 1e6), f->ratio, range);
        }
        printf("\n");
    }
}

/* The closing lines of nccl-tests, then what its table has no room for. */
static void print_section_footer(const rank_ctx *rc, bench_op op)
{
    const bench_cfg *cfg = rc->cfg;
    const bench_run *run = rc->run;
    const struct op_info *oi = &op_info[op];
    int errors = 0, bw_count = 0;
    double bw_sum = 0.0;
    for (size_t i = 0; i < run->nrows; i++)
        for (int form = 0; form < N_FORMS; form++) {
            errors += run->rows[i].f[form].wrong > 0;
            bw_sum += run->rows[i].f[form].busbw;
            bw_count++;
        }
    printf("# Out of bounds values : %d %s\n", errors, errors ? "FAILED" : "OK");
    printf("# Avg bus bandwidth    : %g \n", bw_count ? bw_sum / bw_count : 0.0);
    printf("#\n");

    /* the spread of every row */
    printf("# %s: spread over -R %d repetition%s of each timed loop; time = their median (the "
           "table's),\n# min..max their range, spread = (max - min) / median; each repetition's "
           "time: -a %d, %s\n",
           oi->name, cfg->reps, cfg->reps == 1 ? "" : "s", cfg->average,
           average_name[cfg->average]);
    if (rc->device >= 0)
        printf(
            "# roof%% = model traffic on the busiest GPU / time / the copy's traffic (the '# gpu' "
            "lines)\n");
    else
        printf("# roof%% = model traffic per rank / time / memcpy roof per thread "
               "(bench/README.md)\n");
    /* the first word is not nccl-tests' "size" nor "(B)": parsers that look
     * for the header rows must not take these for them */
    printf("# spread %12s  %8s  %6s  %6s  | %6s  %7s  %7s  %7s  %6s  %6s  | %6s  %7s  %7s  %7s  %6s  %6s\n",
           "size", "type", "redop", "root", "iters", "time", "min", "max", "spread", "roof%",
           "iters", "time", "min", "max", "spread", "roof%");
    printf("# spread %12s  %8s  %6s  %6s  | %6s  %7s  %7s  %7s  %6s  %6s  | %6s  %7s  %7s  %7s  %6s  %6s\n",
           "(B)", "", "", "", "", "(us)", "(us)", "(us)", "(%)", "", "", "(us)", "(us)", "(us)",
           "(%)", "");
    for (size_t i = 0; i < run->nrows; i++) {
        const point_row *row = &run->rows[i];
        printf("# spread %12zu  %8s  %6s  %6d", row->bytes, row->dt->name,
               oi->reduces ? redop_name(row->redop) : "none", oi->rooted ? row->root : -1);
        for (int form = 0; form < N_FORMS; form++) {
            const form_result *f = &row->f[form];
            char t[3][32], roof[16];
            if (isnan(f->roof))
                snprintf(roof, sizeof roof, "-");
            else
                snprintf(roof, sizeof roof, "%.1f", 100.0 * f->roof);
            printf("  | %6d  %7s  %7s  %7s  %6.1f  %6s", f->iters,
                   fmt_time(t[0], sizeof t[0], f->time_s * 1e6),
                   fmt_time(t[1], sizeof t[1], f->min_s * 1e6),
                   fmt_time(t[2], sizeof t[2], f->max_s * 1e6),
                   f->time_s > 0.0 ? 100.0 * (f->max_s - f->min_s) / f->time_s : 0.0, roof);
        }
        printf("\n");
    }

    if (rc->device >= 0)
        print_device_lines(rc, op);

    /* notes */
    if (!oi->has[FORM_IP])
        printf("# note: tp_%s has no in-place form (it refuses overlapping buffers): the in-place "
               "columns\n#   time the out-of-place call again and are not checked (#wrong N/A), "
               "as nccl-tests'\n#   %s leaves its in-place results unchecked\n",
               oi->name, oi->perf);
    if (!oi->has[FORM_OOP])
        printf("# note: tp_%s has one buffer (in place): the out-of-place columns time that call "
               "again\n#   and are not checked (#wrong N/A)\n", oi->name);
    if (cfg->check > 0 && oi->reduces)
        for (size_t d = 0; d < N_DTYPES; d++)
            for (size_t r = 0; r < N_REDOPS; r++)
                if (cfg->types[d] && cfg->redops[r] &&
                    !reduction_checkable(op, redops[r].op, &dtypes[d], rc->n))
                    printf("# note: no exact %s inputs for %s at %d ranks: those rows are not "
                           "checked (#wrong N/A)\n", dtypes[d].name, redops[r].name, rc->n);
    printf("# Collective test concluded: %s\n", oi->perf);
    fflush(stdout);
}

/* The ranks, nccl-tests' "Using devices" lines: pid and device gathered
 * through libtp, host names as bytes in an i32 all_gather. */
static tp_status print_devices(const rank_ctx *rc)
{
    int n = rc->n;
    double *ids = calloc((size_t)(2 * n), sizeof(double));
    int32_t *hosts = calloc((size_t)(HOST_MAX * (n + 1)), sizeof(int32_t));
    tp_tensor *mine = NULL, *all = NULL;
    tp_status st = TP_ERR_NO_MEMORY;
    if (!ids || !hosts)
        goto out;
    ids[2 * rc->rank] = (double)getpid();
    ids[2 * rc->rank + 1] = (double)rc->device;
    if ((st = reduce_f64(rc, ids, (size_t)(2 * n), TP_SUM)) != TP_OK)
        goto out;
    char name[HOST_MAX] = "?";
    gethostname(name, sizeof name - 1);
    name[HOST_MAX - 1] = '\0';
    for (int i = 0; i < HOST_MAX; i++)
        hosts[i] = (unsigned char)name[i];
    int64_t one = HOST_MAX, every = (int64_t)HOST_MAX * n;
    if ((st = tp_tensor_from_blob(TP_I32, TP_CPU, 1, &one, hosts, NULL, NULL, &mine)) != TP_OK ||
        (st = tp_tensor_from_blob(TP_I32, TP_CPU, 1, &every, hosts + HOST_MAX, NULL, NULL, &all)) !=
            TP_OK ||
        (st = tp_all_gather(rc->ctl, mine, all, NULL)) != TP_OK) {
        report(rc, NULL, "tp_all_gather (host names)", st);
        goto out;
    }
    if (rc->rank == 0) {
        printf("# Using devices\n");
        for (int r = 0; r < n; r++) {
            char host[HOST_MAX];
            for (int i = 0; i < HOST_MAX; i++)
                host[i] = (char)hosts[HOST_MAX * (r + 1) + i];
            host[HOST_MAX - 1] = '\0';
            int dev = (int)ids[2 * r + 1];
            if (dev >= 0)
                printf("#  Rank %2d Group  0 Pid %6.0f on %10s device %2d [cuda] %s\n", r,
                       ids[2 * r], host, dev, rc->cfg->backend->name);
            else
                printf("#  Rank %2d Group  0 Pid %6.0f on %10s device cpu [%s]\n", r, ids[2 * r],
                       host, rc->cfg->backend->name);
        }
    }
out:
    tp_tensor_release(mine);
    tp_tensor_release(all);
    free(ids);
    free(hosts);
    return st;
}

/* ---- the rank body ------------------------------------------------------------ */

/* The run's parameters, nccl-tests' first line among them. */
static void print_run_header(const rank_ctx *rc, int threads)
{
    const bench_cfg *cfg = rc->cfg;
    const bench_run *run = rc->run;
    printf("# tp-bench-comm: libtp %s, backend %s, %d rank%s\n", tp_version(), cfg->backend->name,
           rc->n, rc->n == 1 ? "" : "s");
    printf("# nThread %d nGpus 1 minBytes %zu maxBytes %zu step: %zu(%s) warmup iters: %d iters: %d "
           "agg iters: 1 validation: %d graph: 0\n",
           threads, cfg->min_bytes, cfg->max_bytes, cfg->factor > 1 ? cfg->factor : cfg->step_bytes,
           cfg->factor > 1 ? "factor" : "bytes", cfg->warmup, cfg->iters, cfg->check);
    if (cfg->blocking)
        printf("# Blocking Enabled: every call blocks (work = NULL); -z 0 would start it with a "
               "work handle and wait\n");
    if (cfg->iters)
        printf("# timed loop: %d calls", cfg->iters);
    else
        printf("# timed loop: about %.2f s of calls (%d..%d; -n 0)", cfg->target_s, MIN_ITERS,
               MAX_ITERS);
    printf(", -R %d repetitions, time = median of the repetitions; -a %d: a repetition's time is "
           "the %s\n#   of the ranks' mean per call; a barrier, not timed, before every call\n",
           cfg->reps, cfg->average, average_name[cfg->average]);
    if (run->have_load) {
        printf("# load average (/proc/loadavg) before the run: %.2f %.2f %.2f (1, 5, 15 min); "
               "%d cores, %d ranks\n",
               run->load_before[0], run->load_before[1], run->load_before[2], run->cores, rc->n);
        if (run->load_before[0] > (double)(run->cores - rc->n)) {
            char why[160];
            if (rc->n >= run->cores)
                snprintf(why, sizeof why, "load %.2f with %d ranks on %d cores: the ranks share "
                         "their cores with it", run->load_before[0], rc->n, run->cores);
            else
                snprintf(why, sizeof why, "load %.2f is above %d cores - %d ranks",
                         run->load_before[0], run->cores, rc->n);
            printf("# warning: the machine is busy: %s; the times will be slower and noisier\n",
                   why);
            fprintf(stderr, "tp-bench-comm: warning: the machine is busy: %s\n", why);
        }
    }
    printf("#\n");
    fflush(stdout);
}

/* Types the whole buffers as dt (the same memory, no copy). */
static tp_status type_buffers(rank_ctx *rc, const dtype_info *dt)
{
    tp_tensor **typed[4] = {&rc->sendbuf, &rc->recvbuf, &rc->hsendbuf, &rc->hrecvbuf};
    tp_tensor *raw[4] = {rc->sendraw, rc->recvraw, rc->hsendraw, rc->hrecvraw};
    int64_t count = (int64_t)(rc->cfg->max_bytes / dt->size);
    for (int i = 0; i < 4; i++) {
        tp_tensor_release(*typed[i]);
        *typed[i] = NULL;
        if (!raw[i])
            continue;
        tp_device where = i < 2 && rc->device >= 0 ? TP_CUDA(rc->device) : TP_CPU;
        tp_status st = tp_tensor_from_blob(dt->dtype, where, 1, &count, tp_tensor_data(raw[i]),
                                           NULL, NULL, typed[i]);
        if (st != TP_OK) {
            report(rc, NULL, "tp_tensor_from_blob (typed buffers)", st);
            return st;
        }
    }
    return TP_OK;
}

/* One collective's sweep: every dtype, reduction and root asked for. */
static tp_status run_section(rank_ctx *rc, bench_op op)
{
    const bench_cfg *cfg = rc->cfg;
    const struct op_info *oi = &op_info[op];
    bench_run *run = rc->run;
    tp_status st = TP_OK;
    if (rc->rank == 0) {
        run->ops[op].ran = true;
        run->nrows = 0;
        print_section_header(rc, op);
    }
    for (size_t d = 0; d < N_DTYPES && st == TP_OK; d++) {
        if (!cfg->types[d])
            continue;
        if ((st = type_buffers(rc, &dtypes[d])) != TP_OK)
            break;
        for (size_t r = 0; r < N_REDOPS && st == TP_OK; r++) {
            if (oi->reduces ? !cfg->redops[r] : r > 0)
                continue;
            int root_lo = 0, root_hi = 0;
            if (oi->rooted) {
                root_lo = cfg->root < 0 ? 0 : cfg->root;
                root_hi = cfg->root < 0 ? rc->n - 1 : cfg->root;
            }
            for (int root = root_lo; root <= root_hi && st == TP_OK; root++) {
                for (size_t S = cfg->min_bytes; S <= cfg->max_bytes && st == TP_OK;) {
                    st = bench_point(rc, op, &dtypes[d], redops[r].op, root, S);
                    size_t next = cfg->factor > 1 ? S * cfg->factor : S + cfg->step_bytes;
                    if (next <= S || (cfg->factor > 1 && S > SIZE_MAX / cfg->factor))
                        break;
                    S = next;
                }
            }
        }
    }
    if (rc->rank == 0 && st == TP_OK)
        print_section_footer(rc, op);
    return st;
}

/* One rank's sweep over `comm`; `ctl` carries the statistics (host
 * tensors); device >= 0 puts the buffers on that CUDA device. */
static tp_status rank_body(bench_run *run, tp_comm *comm, tp_comm *ctl, int device, void *bare)
{
    const bench_cfg *cfg = run->cfg;
    rank_ctx rc = {
        .run = run,
        .cfg = cfg,
        .comm = comm,
        .ctl = ctl,
        .rank = tp_comm_rank(comm),
        .n = tp_comm_size(comm),
        .device = device,
        .dev_ranks = 1,
        .sync_stream = device >= 0 && strcmp(cfg->backend->name, "nccl") != 0,
        .bare = bare,
    };
    tp_status st = TP_OK;
    /* one rank per process: each may be bound to fewer cores than the run has */
    if (run->threads == 1)
        run->cores = bench_world_cores(ctl);
    if (rc.rank == 0)
        print_run_header(&rc, run->threads);
    if (cfg->root >= rc.n) {
        if (rc.rank == 0)
            fprintf(stderr, "tp-bench-comm: -r %d is not a rank of %d\n", cfg->root, rc.n);
        return TP_ERR_INVALID_ARG;
    }
    if (rc.rank == 0 && cfg->csv_path) {
        run->csv = fopen(cfg->csv_path, "w");
        if (run->csv)
            fprintf(run->csv,
                    "collective,backend,nranks,inplace,call_inplace,dtype,redop,root,"
                    "size_bytes,count,iters,reps,time_us,time_min_us,time_max_us,"
                    "iter_med_us,algbw_GBps,busbw_GBps,wrong,average,blocking,"
                    "rep_times_us,model_bytes_per_rank,roof_GBps_per_thread,roof_frac,device,"
                    "copy_us,copy_GBps,busbw_over_copy,bare_time_us,bare_min_us,"
                    "bare_max_us,bare_ratio,bare_ratio_min,bare_ratio_max\n");
        else
            fprintf(stderr, "tp-bench-comm: cannot write %s: %s\n", cfg->csv_path, strerror(errno));
    }
    double csv_failed = (rc.rank == 0 && cfg->csv_path && !run->csv) ? 1.0 : 0.0;
    if ((st = reduce_f64(&rc, &csv_failed, 1, TP_MAX)) != TP_OK)
        return st;
    if (csv_failed != 0.0)
        return TP_ERR_INVALID_ARG;
    if ((st = print_devices(&rc)) != TP_OK)
        return st;
    if (device >= 0) {
        /* rank r on GPU r % GPUs (shm threads), or one GPU each (nccl) */
        int gpus = tp_cuda_device_count();
        if (!strcmp(cfg->backend->name, "shm") && gpus > 0)
            rc.dev_ranks = (rc.n + gpus - 1) / gpus;
        if (rc.rank == 0)
            printf("# buffers on the GPU; the roof is a device-to-device copy of each row's bytes "
                   "(the '# gpu' lines)\n");
    } else if ((st = measure_roof(&rc)) != TP_OK) {
        return st;
    }

    /* f64 elements: whole max_bytes, aligned for every dtype */
    int64_t raw = (int64_t)((cfg->max_bytes + 7) / 8);
    rc.times = malloc(sizeof(double) * MAX_ITERS);
    rc.scratch = malloc(PAT_MAX * 1024 * 8);
    if (!rc.times || !rc.scratch) {
        st = TP_ERR_NO_MEMORY;
        fprintf(stderr, "tp-bench-comm: rank %d: out of memory\n", rc.rank);
        goto out;
    }
    tp_device where = device >= 0 ? TP_CUDA(device) : TP_CPU;
    if ((st = tp_tensor_empty(TP_F64, where, 1, &raw, &rc.sendraw)) != TP_OK ||
        (st = tp_tensor_empty(TP_F64, where, 1, &raw, &rc.recvraw)) != TP_OK) {
        report(&rc, NULL, "tp_tensor_empty (2 buffers of max size)", st);
        goto out;
    }
    if (device >= 0 &&
        ((st = tp_tensor_empty(TP_F64, TP_CPU, 1, &raw, &rc.hsendraw)) != TP_OK ||
         (st = tp_tensor_empty(TP_F64, TP_CPU, 1, &raw, &rc.hrecvraw)) != TP_OK)) {
        report(&rc, NULL, "tp_tensor_empty (2 host mirrors of max size)", st);
        goto out;
    }

    for (int op = 0; op < OP_COUNT && st == TP_OK; op++)
        if (cfg->ops[op])
            st = run_section(&rc, (bench_op)op);
out:
    tp_tensor_release(rc.sendbuf);
    tp_tensor_release(rc.recvbuf);
    tp_tensor_release(rc.hsendbuf);
    tp_tensor_release(rc.hrecvbuf);
    tp_tensor_release(rc.sendraw);
    tp_tensor_release(rc.recvraw);
    tp_tensor_release(rc.hsendraw);
    tp_tensor_release(rc.hrecvraw);
    free(rc.times);
    free(rc.scratch);
    return st;
}

static tp_status rank_main(tp_comm *world, void *arg)
{
    return rank_body(arg, world, world, -1, NULL);
}

/* --device cuda: rank r's buffers on GPU r % GPUs (one GPU: all ranks share it) */
static tp_status rank_main_cuda(tp_comm *world, void *arg)
{
    return rank_body(arg, world, world, tp_comm_rank(world) % tp_cuda_device_count(), NULL);
}

static tp_status launch_threads(bench_run *run)
{
    run->threads = run->cfg->nranks;
    return tp_run_local(run->cfg->nranks, run->cfg->cuda ? rank_main_cuda : rank_main, run);
}

/* One rank per process: the world comes from the backend (MPI: mpirun). */
static tp_status launch_world(bench_run *run)
{
    tp_comm *world = NULL;
    tp_status st = tp_comm_create_world(run->cfg->backend->name, NULL, &world);
    if (st != TP_OK)
        return st;
    run->printer = tp_comm_rank(world) == 0;
    run->threads = 1;
    if (run->cfg->nranks_given && tp_comm_size(world) != run->cfg->nranks && tp_comm_rank(world) == 0)
        fprintf(stderr, "tp-bench-comm: -g %d ignored: backend %s has %d ranks\n",
                run->cfg->nranks, run->cfg->backend->name, tp_comm_size(world));
    st = rank_main(world, run);
    tp_comm_free(world);
    return st;
}

/* One rank of the nccl backend: an NCCL communicator bootstrapped over
 * `boot` on `device`, statistics over boot. */
static tp_status nccl_rank_on(bench_run *run, tp_comm *boot, int device)
{
    tp_nccl_options o = {.bootstrap = boot, .device = device};
    tp_comm *comm = NULL;
    tp_status st = tp_comm_create_world("nccl", &o, &comm);
    if (st != TP_OK) {
        fprintf(stderr, "tp-bench-comm: rank %d: tp_comm_create_world(\"nccl\") on cuda:%d: %s: %s\n",
                tp_comm_rank(boot), device, tp_status_name(st), tp_last_error());
        return st;
    }
    void *bare = NULL;
#if TP_HAVE_NCCL
    bare_nccl *b = NULL;
    if (run->cfg->nccl_bare && (st = bare_create(device, &b)) != TP_OK) {
        tp_comm_free(comm);
        return st;
    }
    bare = b;
#endif
    st = rank_body(run, comm, boot, device, bare);
#if TP_HAVE_NCCL
    bare_free(b);
#endif
    tp_comm_free(comm);
    return st;
}

static tp_status nccl_thread_main(tp_comm *world, void *arg)
{
    return nccl_rank_on(arg, world, tp_comm_rank(world));
}

/* Threads of this process, GPU r for rank r; or, under mpirun, one process
 * per rank on GPU (local rank % GPUs), bootstrapped over the MPI world. */
static tp_status launch_nccl(bench_run *run)
{
    int gpus = tp_cuda_device_count();
    if (gpus <= 0) {
        fprintf(stderr, "tp-bench-comm: backend nccl: no CUDA device visible\n");
        return TP_ERR_NOT_SUPPORTED;
    }
    if (bench_under_mpirun() && tp_backend_find("mpi")) {
        tp_comm *world = NULL;
        tp_status st = tp_comm_create_world("mpi", NULL, &world);
        if (st != TP_OK)
            return st;
        run->printer = tp_comm_rank(world) == 0;
        run->threads = 1;
        if (run->cfg->nranks_given && tp_comm_size(world) != run->cfg->nranks &&
            tp_comm_rank(world) == 0)
            fprintf(stderr, "tp-bench-comm: -g %d ignored: mpirun started %d processes\n",
                    run->cfg->nranks, tp_comm_size(world));
        int local = bench_launcher_local_rank();
        st = nccl_rank_on(run, world, (local >= 0 ? local : tp_comm_rank(world)) % gpus);
        tp_comm_free(world);
        return st;
    }
    if (run->cfg->nranks > gpus) {
        fprintf(stderr, "tp-bench-comm: backend nccl: -g %d needs %d GPUs, %d visible\n",
                run->cfg->nranks, run->cfg->nranks, gpus);
        return TP_ERR_INVALID_ARG;
    }
    run->threads = run->cfg->nranks;
    return tp_run_local(run->cfg->nranks, nccl_thread_main, run);
}

/* ---- command line --------------------------------------------------------------- */

static void usage(FILE *f)
{
    fprintf(
        f,
        "usage: tp-bench-comm [options]      (nccl-tests' letters and meanings)\n"
        "  -b, --minbytes SIZE     smallest size (default 4K); suffixes K, M, G (powers of 1024)\n"
        "  -e, --maxbytes SIZE     largest size (default 256M)\n"
        "  -f, --stepfactor N      multiply the size by N between points (default 2); 1: add -i\n"
        "  -i, --stepbytes SIZE    add SIZE between points instead (default 1M, with -f 1 or "
        "alone)\n"
        "  -n, --iters N           calls per timed loop; 0 = about --target-s (default 0)\n"
        "  -w, --warmup_iters N    warm-up calls per point and form (default 5; with -n 0 cut\n"
        "                          to about half the target time; at least one always runs)\n"
        "  -c, --check N           0: no checks; N: check the results, N fresh calls too (default "
        "1)\n"
        "  -o, --op OP             reduction: " REDOP_NAMES " (default sum)\n"
        "  -d, --datatype T        " DTYPE_NAMES " (default float)\n"
        "  -r, --root R            root of broadcast and scatter, or all (default 0)\n"
        "  -a, --average 0|1|2|3   a repetition's time: 0 rank 0's, 1 mean over ranks,\n"
        "                          2 fastest rank, 3 slowest rank (default 1)\n"
        "  -z, --blocking 0|1      1: blocking calls; 0: work handle + tp_work_wait (default 0)\n"
        "  -g, --ngpus N           ranks (default 2; thread backends only)\n"
        "  -R, --repeat N          repetitions of each timed loop; the table shows their\n"
        "                          median, the spread lines their range (default 3)\n"
        "      --collective LIST   all_reduce|all_gather|reduce_scatter|all_to_all|broadcast|\n"
        "                          scatter|all, comma-separated (MPI spellings allreduce,\n"
        "                          allgather, reducescatter, alltoall, bcast work too; default "
        "all)\n"
        "      --backend NAME      how ranks run (default shm); see below\n"
        "      --csv FILE          also write every point and form as CSV\n"
        "      --target-s SEC      seconds per timed loop with -n 0 (default 0.1)\n"
        "      --roof-bytes SIZE   memcpy roof buffer per rank (default 256M; 0 = no roof)\n"
        "      --device cpu|cuda   where the buffers are (default cpu; nccl: always cuda).\n"
        "                          cuda with --backend shm: rank r on GPU r %% GPUs, a\n"
        "                          device-to-device copy of each row's bytes as the roof\n"
        "      --nccl-bare         with --backend nccl -g 1: also time bare ncclAllReduce and\n"
        "                          ncclAllGather on the same buffers, print libtp / bare\n"
        "  -h, --help              this text\n"
        "backends:\n");
    for (size_t i = 0; i < N_BACKENDS; i++)
        fprintf(f, "  %-6s %s%s\n", backends[i].name, backends[i].how,
                backend_available(&backends[i]) ? "" : " [not in this libtp]");
}

static void list_available(FILE *f)
{
    const char *sep = "";
    for (size_t i = 0; i < N_BACKENDS; i++)
        if (backend_available(&backends[i])) {
            fprintf(f, "%s%s", sep, backends[i].name);
            sep = ", ";
        }
}

/* A size as nccl-tests reads one: a number, possibly with a fraction, and an
 * optional K, M or G (powers of 1024; "KiB", "KB" also read). */
static bool parse_size(const char *s, size_t *out)
{
    char *end;
    errno = 0;
    if (*s == '-' || *s == '\0')
        return false;
    double v = strtod(s, &end);
    if (errno || end == s || !(v >= 0.0))
        return false;
    double unit = 1.0;
    switch (*end) {
    case 'k': case 'K': unit = 1024.0; end++; break;
    case 'm': case 'M': unit = 1048576.0; end++; break;
    case 'g': case 'G': unit = 1073741824.0; end++; break;
    default: break;
    }
    if (unit > 1.0 && (*end == 'i' || *end == 'I'))
        end++;
    if (unit > 1.0 && (*end == 'b' || *end == 'B'))
        end++;
    double bytes = floor(v * unit);
    if (*end != '\0' || bytes > (double)(SIZE_MAX / 4))
        return false;
    *out = (size_t)bytes;
    return true;
}

static bool parse_ops(const char *s, bool ops[OP_COUNT])
{
    char buf[256];
    if (strlen(s) >= sizeof buf)
        return false;
    strcpy(buf, s);
    memset(ops, 0, sizeof(bool) * OP_COUNT);
    char *save = NULL;
    bool any = false;
    for (char *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        bool found = false;
        if (strcmp(tok, "all") == 0) {
            for (int i = 0; i < OP_COUNT; i++)
                ops[i] = true;
            any = true;
            continue;
        }
        for (int i = 0; i < OP_COUNT; i++)
            if (strcmp(tok, op_info[i].name) == 0 || strcmp(tok, op_info[i].alias) == 0 ||
                strcmp(tok, op_info[i].perf) == 0) {
                ops[i] = found = any = true;
            }
        if (!found)
            return false;
    }
    return any;
}

static int bad_arg(const char *opt, const char *val, const char *want)
{
    fprintf(stderr, "tp-bench-comm: bad value '%s' for %s: expected %s\n", val, opt, want);
    return EXIT_USAGE;
}

/* -d: nccl-tests' type names, libtp's as aliases; the types libtp lacks are
 * named as such */
static int parse_dtype(const char *s, bool types[N_DTYPES])
{
    memset(types, 0, sizeof(bool) * N_DTYPES);
    if (strcmp(s, "all") == 0) {
        for (size_t i = 0; i < N_DTYPES; i++)
            types[i] = true;
        return 0;
    }
    for (size_t i = 0; i < N_DTYPES; i++)
        if (strcmp(s, dtypes[i].name) == 0 || strcmp(s, dtypes[i].alias) == 0) {
            types[i] = true;
            return 0;
        }
    for (size_t i = 0; i < sizeof unsupported_dtypes / sizeof unsupported_dtypes[0]; i++)
        if (strcmp(s, unsupported_dtypes[i]) == 0) {
            fprintf(stderr, "tp-bench-comm: -d %s: libtp has no %s dtype (tp_dtype has f32, f64, "
                            "f16, bf16, i32, i64); use one of " DTYPE_NAMES "\n",
                    s, s);
            return EXIT_USAGE;
        }
    return bad_arg("-d", s, DTYPE_NAMES);
}

static int parse_redop(const char *s, bool ops[N_REDOPS])
{
    memset(ops, 0, sizeof(bool) * N_REDOPS);
    if (strcmp(s, "all") == 0) {
        for (size_t i = 0; i < N_REDOPS; i++)
            ops[i] = true;
        return 0;
    }
    for (size_t i = 0; i < N_REDOPS; i++)
        if (strcmp(s, redops[i].name) == 0 || (redops[i].alias && strcmp(s, redops[i].alias) == 0)) {
            ops[i] = true;
            return 0;
        }
    if (strcmp(s, "mulsum") == 0 || strcmp(s, "premulsum") == 0) {
        fprintf(stderr, "tp-bench-comm: -o %s: libtp has no pre-multiplied sum; use one of "
                        REDOP_NAMES "\n", s);
        return EXIT_USAGE;
    }
    if (strcmp(s, "all_reduce") == 0 || strcmp(s, "allreduce") == 0 || strcmp(s, "broadcast") == 0 ||
        strcmp(s, "all_gather") == 0 || strcmp(s, "reduce_scatter") == 0 ||
        strcmp(s, "all_to_all") == 0 || strcmp(s, "alltoall") == 0 || strcmp(s, "bcast") == 0) {
        fprintf(stderr, "tp-bench-comm: -o is the reduction (sum, prod, ...) as in nccl-tests; "
                        "the collective is --collective %s\n", s);
        return EXIT_USAGE;
    }
    return bad_arg("-o", s, REDOP_NAMES);
}

enum { OPT_BACKEND = 256, OPT_CSV, OPT_TARGET, OPT_ROOF, OPT_COLLECTIVE, OPT_DEVICE, OPT_BARE };

/* nccl-tests' options this program does not have */
static const struct {
    int letter;
    const char *what; /* nccl-tests' meaning */
    const char *hint;
} unsupported_opts[] = {
    {'t', "threads per process", "the shm backend's ranks are threads already: -g counts them"},
    {'m', "aggregated iterations", NULL},
    {'p', "parallel init", NULL},
    {'y', "stream_null", NULL},
    {'T', "timeout", "set TP_COMM_TIMEOUT (seconds) in the environment"},
    {'G', "CUDA graph launches", NULL},
    {'C', "report_cputime", NULL},
    {'F', "CSV output", "use --csv, whose columns are tp-bench-comm's own"},
};

/* --device and --nccl-bare against the backend: the combinations this bench
 * runs, the others refused by name (EXIT_USAGE). */
static int check_device_args(bench_cfg *cfg)
{
    const char *b = cfg->backend->name;
    bool nccl = strcmp(b, "nccl") == 0;
    if (nccl && cfg->device_given && !cfg->cuda) {
        fprintf(stderr,
                "tp-bench-comm: --device cpu with --backend nccl: the nccl backend's "
                "buffers are on the GPU here; --device cpu runs with --backend shm or mpi\n");
        return EXIT_USAGE;
    }
    if (nccl)
        cfg->cuda = true;
    if (cfg->cuda && strcmp(b, "shm") != 0 && !nccl) {
        fprintf(stderr,
                "tp-bench-comm: --device cuda with --backend %s is not supported: CUDA "
                "buffers run with --backend shm (ranks as threads on GPU rank %% GPUs) "
                "or nccl\n",
                b);
        return EXIT_USAGE;
    }
    if (cfg->nccl_bare && !nccl) {
        fprintf(stderr,
                "tp-bench-comm: --nccl-bare compares libtp with NCCL itself: it needs "
                "--backend nccl -g 1 (backend here: %s)\n",
                b);
        return EXIT_USAGE;
    }
    if (cfg->nccl_bare && (cfg->nranks != 1 || bench_under_mpirun())) {
        fprintf(stderr,
                "tp-bench-comm: --nccl-bare runs a world of one: -g 1 in one process "
                "(-g %d%s)\n",
                cfg->nranks, bench_under_mpirun() ? ", under mpirun" : "");
        return EXIT_USAGE;
    }
    return 0;
}

static int parse_args(int argc, char **argv, bench_cfg *cfg)
{
    static const struct option longopts[] = {
        {"minbytes", required_argument, NULL, 'b'},
        {"maxbytes", required_argument, NULL, 'e'},
        {"stepfactor", required_argument, NULL, 'f'},
        {"stepbytes", required_argument, NULL, 'i'},
        {"iters", required_argument, NULL, 'n'},
        {"warmup_iters", required_argument, NULL, 'w'},
        {"warmup", required_argument, NULL, 'w'},
        {"check", required_argument, NULL, 'c'},
        {"op", required_argument, NULL, 'o'},
        {"datatype", required_argument, NULL, 'd'},
        {"root", required_argument, NULL, 'r'},
        {"average", required_argument, NULL, 'a'},
        {"blocking", required_argument, NULL, 'z'},
        {"ngpus", required_argument, NULL, 'g'},
        {"nranks", required_argument, NULL, 'g'},
        {"repeat", required_argument, NULL, 'R'},
        {"collective", required_argument, NULL, OPT_COLLECTIVE},
        {"backend", required_argument, NULL, OPT_BACKEND},
        {"csv", required_argument, NULL, OPT_CSV},
        {"target-s", required_argument, NULL, OPT_TARGET},
        {"roof-bytes", required_argument, NULL, OPT_ROOF},
        {"device", required_argument, NULL, OPT_DEVICE},
        {"nccl-bare", no_argument, NULL, OPT_BARE},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    int v;
    int c, rc;
    bool factor_given = false, step_given = false;
    const char *backend = "shm";
    opterr = 0;
    while ((c = getopt_long(argc, argv, ":b:e:f:i:n:w:c:o:d:r:a:z:g:R:ht:m:p:y:T:G:C:F:", longopts,
                            NULL)) != -1) {
        switch (c) {
        case 'b':
            if (!parse_size(optarg, &cfg->min_bytes) || cfg->min_bytes == 0)
                return bad_arg("-b", optarg, "a size > 0 such as 4096, 4K, 1.5M");
            break;
        case 'e':
            if (!parse_size(optarg, &cfg->max_bytes) || cfg->max_bytes == 0)
                return bad_arg("-e", optarg, "a size > 0 such as 256M, 1G");
            break;
        case 'f':
            if (!bench_parse_int(optarg, 1, 1 << 20, &v))
                return bad_arg("-f", optarg, "an integer factor >= 1 (1: step by -i)");
            cfg->factor = (size_t)v;
            factor_given = true;
            break;
        case 'i':
            if (!parse_size(optarg, &cfg->step_bytes) || cfg->step_bytes == 0)
                return bad_arg("-i", optarg, "a size > 0 such as 1M");
            step_given = true;
            break;
        case 'n':
            if (!bench_parse_int(optarg, 0, MAX_ITERS, &v))
                return bad_arg("-n", optarg, "0 (auto) .. 20000");
            cfg->iters = v;
            break;
        case 'w':
            if (!bench_parse_int(optarg, 0, 100000, &v))
                return bad_arg("-w", optarg, "an integer >= 0");
            cfg->warmup = v;
            break;
        case 'c':
            if (!bench_parse_int(optarg, 0, 1000, &v))
                return bad_arg("-c", optarg, "0 (no checks) or a count of checked calls");
            cfg->check = v;
            break;
        case 'o':
            if ((rc = parse_redop(optarg, cfg->redops)) != 0)
                return rc;
            break;
        case 'd':
            if ((rc = parse_dtype(optarg, cfg->types)) != 0)
                return rc;
            break;
        case 'r':
            if (strcmp(optarg, "all") == 0)
                cfg->root = -1;
            else if (bench_parse_int(optarg, 0, 4095, &v))
                cfg->root = v;
            else
                return bad_arg("-r", optarg, "a rank >= 0, or all");
            break;
        case 'a':
            if (!bench_parse_int(optarg, 0, 3, &v))
                return bad_arg("-a", optarg, "0 (rank 0), 1 (mean), 2 (min) or 3 (max)");
            cfg->average = v;
            break;
        case 'z':
            if (!bench_parse_int(optarg, 0, 1, &v))
                return bad_arg("-z", optarg, "0 or 1");
            cfg->blocking = v != 0;
            break;
        case 'g':
            if (!bench_parse_int(optarg, 1, 4096, &v))
                return bad_arg("-g", optarg, "a rank count >= 1");
            cfg->nranks = v;
            cfg->nranks_given = true;
            break;
        case 'R':
            if (!bench_parse_int(optarg, 1, MAX_REPS, &v))
                return bad_arg("-R", optarg, "1 .. 100 repetitions");
            cfg->reps = v;
            break;
        case OPT_COLLECTIVE:
            if (!parse_ops(optarg, cfg->ops))
                return bad_arg("--collective", optarg,
                               "all_reduce|all_gather|reduce_scatter|all_to_all|broadcast|scatter|all");
            break;
        case OPT_BACKEND: backend = optarg; break;
        case OPT_CSV: cfg->csv_path = optarg; break;
        case OPT_TARGET: {
            char *end;
            cfg->target_s = strtod(optarg, &end);
            if (end == optarg || *end || !(cfg->target_s > 0.0) || cfg->target_s > 600.0)
                return bad_arg("--target-s", optarg, "seconds in (0, 600]");
            break;
        }
        case OPT_ROOF:
            if (!parse_size(optarg, &cfg->roof_bytes))
                return bad_arg("--roof-bytes", optarg, "a size such as 256M, or 0");
            break;
        case OPT_DEVICE:
            if (strcmp(optarg, "cpu") != 0 && strcmp(optarg, "cuda") != 0)
                return bad_arg("--device", optarg, "cpu or cuda");
            cfg->cuda = strcmp(optarg, "cuda") == 0;
            cfg->device_given = true;
            break;
        case OPT_BARE:
            cfg->nccl_bare = true;
            break;
        case 'h': usage(stdout); return -1;
        case ':':
            fprintf(stderr, "tp-bench-comm: option %s needs a value\n", argv[optind - 1]);
            return EXIT_USAGE;
        default:
            for (size_t i = 0; i < sizeof unsupported_opts / sizeof unsupported_opts[0]; i++)
                if (c == unsupported_opts[i].letter) {
                    fprintf(stderr, "tp-bench-comm: -%c (nccl-tests' %s) is not supported%s%s\n",
                            c, unsupported_opts[i].what, unsupported_opts[i].hint ? ": " : "",
                            unsupported_opts[i].hint ? unsupported_opts[i].hint : "");
                    return EXIT_USAGE;
                }
            fprintf(stderr, "tp-bench-comm: unknown option %s\n", argv[optind - 1]);
            usage(stderr);
            return EXIT_USAGE;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "tp-bench-comm: unexpected argument '%s'\n", argv[optind]);
        return EXIT_USAGE;
    }
    if (step_given && factor_given && cfg->factor > 1) {
        fprintf(stderr, "tp-bench-comm: -i %zu and -f %zu both given: the sizes grow by one or "
                        "the other (-f 1 -i SIZE, or -f N alone)\n",
                cfg->step_bytes, cfg->factor);
        return EXIT_USAGE;
    }
    if (step_given)
        cfg->factor = 1;
    if (cfg->min_bytes > cfg->max_bytes) {
        fprintf(stderr, "tp-bench-comm: -b %zu is larger than -e %zu\n", cfg->min_bytes,
                cfg->max_bytes);
        return EXIT_USAGE;
    }
    cfg->backend = NULL;
    for (size_t i = 0; i < N_BACKENDS; i++)
        if (strcmp(backend, backends[i].name) == 0 && backend_available(&backends[i]))
            cfg->backend = &backends[i];
    if (!cfg->backend) {
        bool known = false;
        for (size_t i = 0; i < N_BACKENDS; i++)
            known = known || strcmp(backend, backends[i].name) == 0;
        fprintf(stderr, "tp-bench-comm: backend '%s' is %s; available: ", backend,
                known ? "not registered in this libtp build" : "unknown");
        list_available(stderr);
        fprintf(stderr, "\n");
        return EXIT_USAGE;
    }
    if ((rc = check_device_args(cfg)) != 0)
        return rc;
    if (cfg->backend->threads && !(strcmp(cfg->backend->name, "nccl") == 0 && bench_under_mpirun()) &&
        cfg->root >= cfg->nranks) {
        fprintf(stderr, "tp-bench-comm: -r %d is not a rank of %d\n", cfg->root, cfg->nranks);
        return EXIT_USAGE;
    }
    return 0;
}

int main(int argc, char **argv)
{
    bench_cfg cfg = {
        .min_bytes = 4096,
        .max_bytes = (size_t)256 << 20,
        .factor = 2,
        .step_bytes = (size_t)1 << 20,
        .iters = 0,
        .warmup = 5,
        .check = 1,
        .reps = 3,
        .average = 1,
        .blocking = false,
        .ops = {true, true, true, true, true, true},
        .types = {false, false, false, true, false, false}, /* float */
        .redops = {true, false, false, false, false},       /* sum */
        .root = 0,
        .nranks = 2,
        .roof_bytes = (size_t)256 << 20,
        .target_s = 0.1,
    };
    int rc = parse_args(argc, argv, &cfg);
    if (rc != 0)
        return rc < 0 ? 0 : rc;

    bench_run run = {.cfg = &cfg, .printer = true, .cores = bench_cores()};
    for (int i = 0; i < OP_COUNT; i++)
        run.ops[i].status = TP_OK;
    run.have_load = bench_loadavg(run.load_before);

    /* a GPU run without a GPU: a skip, said as such (status 77), before anything runs */
    if (cfg.cuda && tp_cuda_device_count() <= 0) {
        fprintf(stderr, "tp-bench-comm: backend %s%s: no CUDA device %s\n", cfg.backend->name,
                cfg.device_given ? " --device cuda" : "",
                TP_HAVE_CUDA ? "visible" : "(libtp was built without CUDA)");
        return EXIT_NO_DEVICE;
    }

    tp_status st = cfg.backend->launch(&run);
    const char *err = st != TP_OK ? tp_last_error() : "";
    if (run.csv)
        fclose(run.csv);
    free(run.rows);

    int status = 0;
    if (st != TP_OK) {
        fprintf(stderr, "tp-bench-comm: %s: %s\n", tp_status_name(st), err);
        status = EXIT_ERROR;
    } else if (run.wrong_total > 0) {
        status = EXIT_WRONG;
    }
    if (!run.printer)
        return status;
    printf("#\n# summary:\n");
    for (int i = 0; i < OP_COUNT; i++) {
        const op_summary *os = &run.ops[i];
        if (!os->ran)
            continue;
        if (os->status != TP_OK)
            printf("#   %-15s ERROR %s\n", op_info[i].name, tp_status_name(os->status));
        else if (os->wrong > 0)
            printf("#   %-15s FAILED: %.0f wrong elements\n", op_info[i].name, os->wrong);
        else
            printf("#   %-15s OK (%d rows%s)\n", op_info[i].name, os->points,
                   !cfg.check ? ", not checked" : "");
    }
    if (st != TP_OK)
        printf("#   run stopped: %s: %s\n", tp_status_name(st), err);
    double load_after[3];
    if (bench_loadavg(load_after)) {
        printf("# load average (/proc/loadavg) after the run: %.2f %.2f %.2f (1, 5, 15 min); "
               "%d cores\n", load_after[0], load_after[1], load_after[2], run.cores);
        /* the run's own ranks count in it: busy when the rest passes cores - ranks */
        if (load_after[0] > (double)run.cores) {
            printf("# warning: the machine was busy: load %.2f is above %d cores (the run's own "
                   "ranks count in it)\n", load_after[0], run.cores);
            fprintf(stderr, "tp-bench-comm: warning: the machine was busy: load average %.2f after "
                            "the run is above %d cores\n", load_after[0], run.cores);
        }
    }
    return status;
}
