/*
 * tp-bench-comm - sweep of libtp's collectives in the manner of nccl-tests,
 * with the machine's memory-copy bandwidth measured in the same run as a roof.
 *
 * For each collective and each size S (bytes, nccl-tests conventions):
 *
 *   all_reduce      send S,   recv S            busbw = algbw * 2(n-1)/n
 *   all_gather      send S/n, recv S (total)    busbw = algbw * (n-1)/n
 *   reduce_scatter  send S,   recv S/n          busbw = algbw * (n-1)/n
 *   all_to_all      send S,   recv S            busbw = algbw * (n-1)/n
 *   broadcast       buffer S (root's, in place) busbw = algbw
 *
 * algbw = S / t with GB = 1e9 B. S is rounded down to a multiple of n element
 * blocks where the collective splits it (so 4096 B of f32 over 3 ranks is
 * 4092 B); the size column shows the size actually moved.
 *
 * Timing: warm-up, then timed iterations. Every iteration is preceded by a
 * barrier that is not timed; each rank times its own call, the iteration's
 * time is the maximum over ranks, and the row reports the mean over
 * iterations (median and minimum go to the CSV). With -n 0 the iteration count
 * is chosen so a point takes about --target-s seconds, at least 5.
 *
 * Checking (-c 1): inputs are small integers whose reductions are exact in
 * the chosen dtype (rank + 1 + g % 13 for sum/avg/max/min, 1 or 2 for
 * product); every element of every rank's output is compared after the first
 * warm-up call and again after the timed loop, and the wrong elements are
 * counted (#wrong). avg on floating dtypes allows about two ulps, because a
 * backend may divide as x * (1/n). In-place sum/avg/product change their own
 * input every call, so for those the after-the-loop check refills the inputs
 * and makes one more (untimed) call; during the timed loop the values grow
 * (floats reach inf, integers wrap), as in nccl-tests.
 *
 * Roof: before the sweep every rank copies a buffer of its own (--roof-bytes,
 * default 256 MiB) with memcpy, all ranks at once, timed like a collective,
 * as one call and as 64 KiB calls; the faster median is the roof.
 * roof% compares a collective with that copy bandwidth through a model of the
 * least memory traffic a shared-memory implementation must do; see
 * model_bytes() and bench/README.md.
 *
 * Exit status: 0 when every point ran and every check passed, 1 when a check
 * counted wrong elements, 2 when a libtp call failed, 64 on a usage error.
 */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#include <time.h>

#include "tp/comm.h"
#include "tp/status.h"
#include "tp/tensor.h"

#define EXIT_WRONG 1
#define EXIT_ERROR 2
#define EXIT_USAGE 64

#define MIN_ITERS 5
#define MAX_ITERS 20000
#define ROOF_REPS 7   /* timed copies of the roof buffer, after one warm-up copy */
#define PAT_MAX 13    /* longest pattern period */

/* ---- static tables ------------------------------------------------------- */

typedef enum bench_op {
    OP_ALL_REDUCE = 0,
    OP_ALL_GATHER,
    OP_REDUCE_SCATTER,
    OP_ALL_TO_ALL,
    OP_BROADCAST,
    OP_COUNT
} bench_op;

static const struct op_info {
    const char *name;
    const char *alias; /* the spelling of mpi_coll.c and MPI */
    bool reduces;
} op_info[OP_COUNT] = {
    [OP_ALL_REDUCE] = {"all_reduce", "allreduce", true},
    [OP_ALL_GATHER] = {"all_gather", "allgather", false},
    [OP_REDUCE_SCATTER] = {"reduce_scatter", "reducescatter", true},
    [OP_ALL_TO_ALL] = {"all_to_all", "alltoall", false},
    [OP_BROADCAST] = {"broadcast", "bcast", false},
};

typedef struct dtype_info {
    const char *name;
    tp_dtype dtype;
    size_t size;
    bool is_float;
    double exact_limit; /* every integer in [0, exact_limit] is representable */
    double avg_rtol;    /* tolerance of the avg check (about two ulps) */
} dtype_info;

static const dtype_info dtypes[] = {
    {"f32", TP_F32, 4, true, 16777216.0, 0x1p-22},
    {"f64", TP_F64, 8, true, 9007199254740992.0, 0x1p-51},
    {"f16", TP_F16, 2, true, 2048.0, 0x1p-9},
    {"bf16", TP_BF16, 2, true, 256.0, 0x1p-6},
    {"i32", TP_I32, 4, false, 2147483647.0, 0.0},
    {"i64", TP_I64, 8, false, 9007199254740992.0, 0.0},
};
#define N_DTYPES (sizeof(dtypes) / sizeof(dtypes[0]))

static const struct redop_info {
    const char *name;
    tp_reduce_op op;
} redops[] = {
    {"sum", TP_SUM}, {"avg", TP_AVG}, {"max", TP_MAX}, {"min", TP_MIN}, {"product", TP_PRODUCT},
};
#define N_REDOPS (sizeof(redops) / sizeof(redops[0]))

static const char *redop_name(tp_reduce_op op)
{
    for (size_t i = 0; i < N_REDOPS; i++)
        if (redops[i].op == op)
            return redops[i].name;
    return "?";
}

/* ---- configuration and backends ------------------------------------------ */

struct bench_run;

/*
 * How the ranks of a backend come to exist. Adding a backend is one entry:
 *  - "mpi": one process per rank started by mpirun; the world communicator
 *    comes from tp_comm_init("mpi", NULL, &world) (launch_world below). The
 *    entry is already here and becomes available as soon as libtp registers a
 *    backend of that name.
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
    {"mpi", "one process per rank under mpirun (tp_comm_init(\"mpi\")); -g is ignored", false,
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
    size_t factor;
    int iters;  /* 0: automatic */
    int warmup;
    bool check;
    bool ops[OP_COUNT];
    const dtype_info *dt;
    tp_reduce_op redop;
    int nranks;
    bool nranks_given;
    const bench_backend *backend;
    bool inplace;
    const char *csv_path;
    int root;
    size_t roof_bytes; /* 0: no roof */
    double target_s;
} bench_cfg;

/* Per-op outcome, seen from rank 0. */
typedef struct op_summary {
    bool ran;
    int points;
    double busbw_sum;
    double wrong;
    bool check_skipped;
    tp_status status;
} op_summary;

typedef struct bench_run {
    const bench_cfg *cfg;
    FILE *csv;
    op_summary ops[OP_COUNT];
    double roof_GBps; /* memcpy traffic per thread; 0 when not measured */
    double wrong_total;
    bool printer; /* this process prints (false on MPI ranks other than 0) */
} bench_run;

/* ---- small helpers -------------------------------------------------------- */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

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
 *
 * With n = 1 the in-place forms move nothing (model 0, roof% not shown) and
 * the out-of-place forms are a copy (2S).
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
    default: return 0.0;
    }
}

/* nccl-tests' bus bandwidth factors (PERFORMANCE.md) */
static double bus_factor(bench_op op, int n)
{
    double nn = (double)n;
    switch (op) {
    case OP_ALL_REDUCE: return 2.0 * (nn - 1.0) / nn;
    case OP_ALL_GATHER:
    case OP_REDUCE_SCATTER:
    case OP_ALL_TO_ALL: return (nn - 1.0) / nn;
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
    int device;                   /* CUDA ordinal of the buffers, or -1: CPU */
    tp_tensor *sendbuf, *recvbuf; /* max_bytes each, on the device under test */
    tp_tensor *hsendbuf, *hrecvbuf; /* host mirrors when device >= 0, else NULL */
    unsigned char *scratch;       /* PAT_MAX * 1024 elements */
    double *times;                /* MAX_ITERS */
} rank_ctx;

/* One point of the sweep on this rank. */
typedef struct point {
    bench_op op;
    bool inplace;
    size_t bytes; /* S actually moved */
    size_t count; /* S / element size */
    size_t k;     /* block elements: per-rank slice of split collectives */
    tp_tensor *send, *recv; /* views; broadcast uses send as its buffer */
    tp_tensor *hsend, *hrecv; /* the same views of the host mirrors (== send, recv on CPU) */
    red_plan plan;
    bool check;
} point;

static void report(const rank_ctx *rc, const point *pt, const char *what, tp_status st)
{
    fprintf(stderr, "tp-bench-comm: rank %d: %s, %zu B: %s: %s: %s\n", rc->rank,
            pt ? op_info[pt->op].name : "setup", pt ? pt->bytes : (size_t)0, what,
            tp_status_name(st), tp_last_error());
}

/* Elementwise max (or sum) of vals over ranks, through libtp itself so that it
 * works for every backend. */
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
            double t0 = now_s();
            roof_copy(b, a, bytes, kind);
            t[kind * (ROOF_REPS + 1) + rep] = now_s() - t0;
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
        qsort(ts, ROOF_REPS, sizeof(double), cmp_double);
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

/* Picks the element counts for size S and makes the views. Returns TP_OK with
 * pt->count == 0 when S is too small for one element per block. */
static tp_status setup_point(const rank_ctx *rc, bench_op op, size_t S, point *pt)
{
    const bench_cfg *cfg = rc->cfg;
    size_t es = cfg->dt->size, n = (size_t)rc->n;
    tp_status st = TP_OK;
    memset(pt, 0, sizeof *pt);
    pt->op = op;
    pt->inplace = op == OP_BROADCAST ? true : cfg->inplace;
    bool split = op == OP_ALL_GATHER || op == OP_REDUCE_SCATTER || op == OP_ALL_TO_ALL;
    pt->k = split ? S / es / n : S / es;
    pt->count = split ? pt->k * n : pt->k;
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
    if (st == TP_OK && pt->send != pt->recv)
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

static tp_status run_coll(const rank_ctx *rc, const point *pt)
{
    switch (pt->op) {
    case OP_ALL_REDUCE: return tp_all_reduce(rc->comm, pt->send, pt->recv, rc->cfg->redop, NULL);
    case OP_ALL_GATHER: return tp_all_gather(rc->comm, pt->send, pt->recv, NULL);
    case OP_REDUCE_SCATTER:
        return tp_reduce_scatter(rc->comm, pt->send, pt->recv, rc->cfg->redop, NULL);
    case OP_ALL_TO_ALL: return tp_all_to_all(rc->comm, pt->send, pt->recv, NULL);
    case OP_BROADCAST: return tp_broadcast(rc->comm, pt->send, rc->cfg->root, NULL);
    default: return TP_ERR_INVALID_ARG;
    }
}

/* Writes the sentinel into everything the collective must overwrite. */
static void reset_outputs(const rank_ctx *rc, const point *pt)
{
    epattern s = encode_pattern(&sentinel_pattern, rc->cfg->dt);
    size_t es = rc->cfg->dt->size, k = pt->k, r = (size_t)rc->rank, n = (size_t)rc->n;
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
        if (rc->rank != rc->cfg->root)
            pattern_fill(tdata(pt->hsend), pt->count, &s, 0);
        break;
    default: break;
    }
}

/* Writes the inputs, and the sentinel into the outputs. */
static void fill_point(const rank_ctx *rc, const point *pt)
{
    const bench_cfg *cfg = rc->cfg;
    const dtype_info *dt = cfg->dt;
    size_t es = dt->size, k = pt->k, r = (size_t)rc->rank, n = (size_t)rc->n;
    reset_outputs(rc, pt);
    switch (pt->op) {
    case OP_ALL_REDUCE:
    case OP_REDUCE_SCATTER: {
        pattern p = red_in_pattern(&pt->plan, cfg->redop, rc->rank);
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
        if (rc->rank == cfg->root) {
            pattern p = block_pattern((size_t)cfg->root);
            epattern ep = encode_pattern(&p, dt);
            pattern_fill(tdata(pt->hsend), pt->count, &ep, 0);
        }
        break;
    default: break;
    }
}

/* Wrong elements of this rank's output. */
static size_t check_point(const rank_ctx *rc, const point *pt)
{
    const bench_cfg *cfg = rc->cfg;
    const dtype_info *dt = cfg->dt;
    size_t es = dt->size, k = pt->k, r = (size_t)rc->rank, n = (size_t)rc->n, wrong = 0;
    switch (pt->op) {
    case OP_ALL_REDUCE:
    case OP_REDUCE_SCATTER: {
        pattern p = red_out_pattern(&pt->plan, cfg->redop, rc->n, dt);
        epattern ep = encode_pattern(&p, dt);
        double rtol = (cfg->redop == TP_AVG && dt->is_float) ? dt->avg_rtol : 0.0;
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
        pattern p = block_pattern((size_t)cfg->root);
        epattern ep = encode_pattern(&p, dt);
        wrong = pattern_count_wrong(tdata(pt->hsend), pt->count, &ep, 0, dt, 0.0, rc->scratch);
        break;
    }
    default: break;
    }
    return wrong;
}

/* true if a call changes its own input (in-place sum/avg/product), so the
 * outputs after the timed loop cannot be checked without a refill */
static bool compounds(const rank_ctx *rc, const point *pt)
{
    tp_reduce_op op = rc->cfg->redop;
    return pt->inplace && op_info[pt->op].reduces && (op == TP_SUM || op == TP_AVG || op == TP_PRODUCT);
}

static void print_header(const bench_cfg *cfg, bench_op op, int n)
{
    printf("#\n# %s, %d rank%s, %s\n", op_info[op].name, n, n == 1 ? "" : "s",
           op == OP_BROADCAST ? "in place (its only form)"
                              : (cfg->inplace ? "in-place" : "out-of-place"));
    printf("# %12s %12s %6s %7s %5s %6s %10s %8s %8s %7s %6s\n", "size", "count", "type", "redop",
           "root", "iters", "time", "algbw", "busbw", "#wrong", "roof%");
    printf("# %12s %12s %6s %7s %5s %6s %10s %8s %8s %7s %6s\n", "(B)", "(elements)", "", "", "",
           "", "(us)", "(GB/s)", "(GB/s)", "", "");
}

/* Runs one point on this rank; rank 0 prints and records it. */
static tp_status bench_point(rank_ctx *rc, bench_op op, size_t S)
{
    const bench_cfg *cfg = rc->cfg;
    bench_run *run = rc->run;
    point pt;
    tp_status st = setup_point(rc, op, S, &pt);
    if (st != TP_OK || pt.k == 0)
        return st;
    pt.plan = make_red_plan(cfg->redop, cfg->dt, rc->n);
    pt.check = cfg->check;
    if (pt.check && op_info[op].reduces) {
        pattern out = red_out_pattern(&pt.plan, cfg->redop, rc->n, cfg->dt);
        if (!pt.plan.exact || !pattern_exact(&out, cfg->dt)) {
            pt.check = false;
            if (rc->rank == 0 && !run->ops[op].check_skipped)
                printf("# %s: no exact %s inputs for %s at %d ranks; results not checked\n",
                       op_info[op].name, cfg->dt->name, redop_name(cfg->redop), rc->n);
            if (rc->rank == 0)
                run->ops[op].check_skipped = true;
        }
    }
    fill_point(rc, &pt);
    if ((st = upload(rc, &pt)) != TP_OK)
        goto done;

    double wrong = 0.0, t0, t1;
    const char *what = op_info[op].name;
    /* first warm-up call: checked, and timed to size the rest */
    if ((st = tp_barrier(rc->comm, NULL)) != TP_OK) {
        what = "tp_barrier";
        goto fail;
    }
    t0 = now_s();
    if ((st = run_coll(rc, &pt)) != TP_OK)
        goto fail;
    double tw[2] = {now_s() - t0, 0.0};
    if (pt.check) {
        if ((st = download(rc, &pt)) != TP_OK)
            goto done;
        wrong += (double)check_point(rc, &pt);
    }
    if ((st = reduce_f64(rc, tw, 1, TP_MAX)) != TP_OK)
        goto done;
    int warm_rest = cfg->warmup - 1;
    if (cfg->iters == 0 && warm_rest > 0 && tw[0] > 0.0 && (double)warm_rest * tw[0] > cfg->target_s / 2)
        warm_rest = (int)(cfg->target_s / 2 / tw[0]);
    t0 = now_s();
    for (int i = 0; i < warm_rest; i++) {
        if ((st = tp_barrier(rc->comm, NULL)) != TP_OK) {
            what = "tp_barrier";
            goto fail;
        }
        if ((st = run_coll(rc, &pt)) != TP_OK)
            goto fail;
    }
    /* barriers included: the count bounds the wall time of the point */
    tw[1] = warm_rest > 0 ? (now_s() - t0) / warm_rest : tw[0];
    if ((st = reduce_f64(rc, tw + 1, 1, TP_MAX)) != TP_OK)
        goto done;
    int iters = cfg->iters;
    if (iters == 0) {
        double want = tw[1] > 0.0 ? cfg->target_s / tw[1] : MAX_ITERS;
        iters = want < MIN_ITERS ? MIN_ITERS : want > MAX_ITERS ? MAX_ITERS : (int)want;
    }
    if (pt.check) {
        reset_outputs(rc, &pt);
        if ((st = upload(rc, &pt)) != TP_OK)
            goto done;
    }

    for (int i = 0; i < iters; i++) {
        if ((st = tp_barrier(rc->comm, NULL)) != TP_OK) {
            what = "tp_barrier";
            goto fail;
        }
        t0 = now_s();
        st = run_coll(rc, &pt);
        t1 = now_s();
        if (st != TP_OK)
            goto fail;
        rc->times[i] = t1 - t0;
    }
    if (pt.check) {
        if (compounds(rc, &pt)) {
            fill_point(rc, &pt);
            if ((st = upload(rc, &pt)) != TP_OK)
                goto done;
            if ((st = tp_barrier(rc->comm, NULL)) != TP_OK) {
                what = "tp_barrier";
                goto fail;
            }
            if ((st = run_coll(rc, &pt)) != TP_OK)
                goto fail;
        }
        if ((st = download(rc, &pt)) != TP_OK)
            goto done;
        wrong += (double)check_point(rc, &pt);
    }
    if ((st = reduce_f64(rc, rc->times, (size_t)iters, TP_MAX)) != TP_OK)
        goto done;
    if ((st = reduce_f64(rc, &wrong, 1, TP_SUM)) != TP_OK)
        goto done;

    if (rc->rank == 0) {
        double sum = 0.0;
        for (int i = 0; i < iters; i++)
            sum += rc->times[i];
        double mean = sum / iters;
        qsort(rc->times, (size_t)iters, sizeof(double), cmp_double);
        double med = rc->times[iters / 2], mn = rc->times[0];
        double Sd = (double)pt.bytes, algbw = Sd / mean / 1e9;
        double busbw = algbw * bus_factor(op, rc->n);
        double busbw_med = Sd / med / 1e9 * bus_factor(op, rc->n);
        double model = model_bytes(op, pt.inplace, Sd, rc->n);
        double roof = (run->roof_GBps > 0.0 && model > 0.0) ? model / mean / 1e9 / run->roof_GBps
                                                             : NAN;
        char roofs[16], roots[8];
        if (isnan(roof))
            snprintf(roofs, sizeof roofs, "-");
        else
            snprintf(roofs, sizeof roofs, "%.1f", 100.0 * roof);
        if (op == OP_BROADCAST)
            snprintf(roots, sizeof roots, "%d", cfg->root);
        else
            snprintf(roots, sizeof roots, "-");
        const char *redop = op_info[op].reduces ? redop_name(cfg->redop) : "none";
        char wrongs[24];
        if (pt.check)
            snprintf(wrongs, sizeof wrongs, "%.0f", wrong);
        else
            snprintf(wrongs, sizeof wrongs, "N/A");
        printf("  %12zu %12zu %6s %7s %5s %6d %10.2f %8.2f %8.2f %7s %6s\n", pt.bytes, pt.count,
               cfg->dt->name, redop, roots, iters, mean * 1e6, algbw, busbw, wrongs, roofs);
        fflush(stdout);
        if (run->csv) {
            fprintf(run->csv,
                    "%s,%s,%d,%d,%s,%s,%s,%zu,%zu,%d,%.3f,%.3f,%.3f,%.4f,%.4f,%.4f,%s,%.0f,%.3f,",
                    op_info[op].name, cfg->backend->name, rc->n, pt.inplace ? 1 : 0,
                    cfg->dt->name, redop, op == OP_BROADCAST ? roots : "", pt.bytes, pt.count,
                    iters, mean * 1e6, med * 1e6, mn * 1e6, algbw, busbw, busbw_med,
                    pt.check ? wrongs : "", model, run->roof_GBps);
            if (isnan(roof))
                fprintf(run->csv, "\n");
            else
                fprintf(run->csv, "%.4f\n", roof);
            fflush(run->csv);
        }
        op_summary *os = &run->ops[op];
        os->points++;
        os->busbw_sum += busbw;
        os->wrong += wrong;
        run->wrong_total += wrong;
    }
    goto done;

fail:
    report(rc, &pt, what, st);
    if (rc->rank == 0)
        run->ops[op].status = st;
done:
    release_views(&pt);
    return st;
}

/* ---- the rank body ------------------------------------------------------------ */

/* One rank's sweep over `comm`; `ctl` carries the statistics (host
 * tensors); device >= 0 puts the buffers on that CUDA device. */
static tp_status rank_body(bench_run *run, tp_comm *comm, tp_comm *ctl, int device)
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
    };
    tp_status st = TP_OK;
    if (rc.rank == 0) {
        printf("# tp-bench-comm: libtp %s, backend %s, %d rank%s, dtype %s, redop %s, %s, check %s\n",
               tp_version(), cfg->backend->name, rc.n, rc.n == 1 ? "" : "s", cfg->dt->name,
               redop_name(cfg->redop), cfg->inplace ? "in-place" : "out-of-place",
               cfg->check ? "on" : "off");
        if (cfg->iters)
            printf("# iterations %d, warm-up %d, sizes %zu..%zu B x%zu\n", cfg->iters, cfg->warmup,
                   cfg->min_bytes, cfg->max_bytes, cfg->factor);
        else
            printf("# iterations auto (%.2f s per point, %d..%d), warm-up up to %d, sizes %zu..%zu B "
                   "x%zu\n", cfg->target_s, MIN_ITERS, MAX_ITERS, cfg->warmup, cfg->min_bytes,
                   cfg->max_bytes, cfg->factor);
        printf("# time = mean over iterations of the slowest rank's call; barrier between "
               "iterations not timed\n");
        fflush(stdout);
    }
    if (cfg->root >= rc.n) {
        if (rc.rank == 0)
            fprintf(stderr, "tp-bench-comm: --root %d is not a rank of %d\n", cfg->root, rc.n);
        return TP_ERR_INVALID_ARG;
    }
    if (rc.rank == 0 && cfg->csv_path) {
        run->csv = fopen(cfg->csv_path, "w");
        if (run->csv)
            fprintf(run->csv, "op,backend,nranks,inplace,dtype,redop,root,size_bytes,count,iters,"
                              "time_us,time_med_us,time_min_us,algbw_GBps,busbw_GBps,"
                              "busbw_med_GBps,wrong,model_bytes_per_rank,roof_GBps_per_thread,"
                              "roof_frac\n");
        else
            fprintf(stderr, "tp-bench-comm: cannot write %s: %s\n", cfg->csv_path, strerror(errno));
    }
    double csv_failed = (rc.rank == 0 && cfg->csv_path && !run->csv) ? 1.0 : 0.0;
    if ((st = reduce_f64(&rc, &csv_failed, 1, TP_MAX)) != TP_OK)
        return st;
    if (csv_failed != 0.0)
        return TP_ERR_INVALID_ARG;
    if (device >= 0) {
        if (rc.rank == 0)
            printf("# buffers on the GPU (cuda:%d on rank 0); no memcpy roof: roof%% not shown\n",
                   device);
    } else if ((st = measure_roof(&rc)) != TP_OK) {
        return st;
    }

    int64_t maxcount = (int64_t)(cfg->max_bytes / cfg->dt->size);
    rc.times = malloc(sizeof(double) * MAX_ITERS);
    rc.scratch = malloc(PAT_MAX * 1024 * 8);
    if (!rc.times || !rc.scratch) {
        st = TP_ERR_NO_MEMORY;
        fprintf(stderr, "tp-bench-comm: rank %d: out of memory\n", rc.rank);
        goto out;
    }
    tp_device where = device >= 0 ? TP_CUDA(device) : TP_CPU;
    if ((st = tp_tensor_empty(cfg->dt->dtype, where, 1, &maxcount, &rc.sendbuf)) != TP_OK ||
        (st = tp_tensor_empty(cfg->dt->dtype, where, 1, &maxcount, &rc.recvbuf)) != TP_OK) {
        report(&rc, NULL, "tp_tensor_empty (2 buffers of max size)", st);
        goto out;
    }
    if (device >= 0 &&
        ((st = tp_tensor_empty(cfg->dt->dtype, TP_CPU, 1, &maxcount, &rc.hsendbuf)) != TP_OK ||
         (st = tp_tensor_empty(cfg->dt->dtype, TP_CPU, 1, &maxcount, &rc.hrecvbuf)) != TP_OK)) {
        report(&rc, NULL, "tp_tensor_empty (2 host mirrors of max size)", st);
        goto out;
    }

    for (int op = 0; op < OP_COUNT && st == TP_OK; op++) {
        if (!cfg->ops[op])
            continue;
        if (op == OP_ALL_TO_ALL && cfg->inplace) {
            if (rc.rank == 0)
                printf("#\n# all_to_all: skipped, it is never in place\n");
            continue;
        }
        if (rc.rank == 0) {
            run->ops[op].ran = true;
            print_header(cfg, (bench_op)op, rc.n);
        }
        for (size_t S = cfg->min_bytes; S <= cfg->max_bytes && st == TP_OK; S *= cfg->factor) {
            st = bench_point(&rc, (bench_op)op, S);
            if (S > SIZE_MAX / cfg->factor)
                break;
        }
        if (rc.rank == 0 && st == TP_OK) {
            op_summary *os = &run->ops[op];
            printf("# %s: average busbw %.2f GB/s over %d sizes, #wrong %.0f\n", op_info[op].name,
                   os->points ? os->busbw_sum / os->points : 0.0, os->points, os->wrong);
            fflush(stdout);
        }
    }
out:
    tp_tensor_release(rc.sendbuf);
    tp_tensor_release(rc.recvbuf);
    tp_tensor_release(rc.hsendbuf);
    tp_tensor_release(rc.hrecvbuf);
    free(rc.times);
    free(rc.scratch);
    return st;
}

static tp_status rank_main(tp_comm *world, void *arg)
{
    return rank_body(arg, world, world, -1);
}

static tp_status launch_threads(bench_run *run)
{
    return tp_run_local(run->cfg->nranks, rank_main, run);
}

/* One rank per process: the world comes from the backend (MPI: mpirun). */
static tp_status launch_world(bench_run *run)
{
    tp_comm *world = NULL;
    tp_status st = tp_comm_init(run->cfg->backend->name, NULL, &world);
    if (st != TP_OK)
        return st;
    run->printer = tp_comm_rank(world) == 0;
    if (run->cfg->nranks_given && tp_comm_size(world) != run->cfg->nranks && tp_comm_rank(world) == 0)
        fprintf(stderr, "tp-bench-comm: -g %d ignored: backend %s has %d ranks\n",
                run->cfg->nranks, run->cfg->backend->name, tp_comm_size(world));
    st = rank_main(world, run);
    tp_comm_free(world);
    return st;
}

/* This process's rank among those of its node under mpirun (OpenMPI, MPICH,
 * Slurm spellings), or -1 when not started by a launcher. */
static int launcher_local_rank(void)
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

static bool under_mpirun(void)
{
    return launcher_local_rank() >= 0 || getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMI_SIZE");
}

/* One rank of the nccl backend: an NCCL communicator bootstrapped over
 * `boot` on `device`, statistics over boot. */
static tp_status nccl_rank_on(bench_run *run, tp_comm *boot, int device)
{
    tp_nccl_options o = {.bootstrap = boot, .device = device};
    tp_comm *comm = NULL;
    tp_status st = tp_comm_init("nccl", &o, &comm);
    if (st != TP_OK) {
        fprintf(stderr, "tp-bench-comm: rank %d: tp_comm_init(\"nccl\") on cuda:%d: %s: %s\n",
                tp_comm_rank(boot), device, tp_status_name(st), tp_last_error());
        return st;
    }
    st = rank_body(run, comm, boot, device);
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
    if (under_mpirun() && tp_backend_find("mpi")) {
        tp_comm *world = NULL;
        tp_status st = tp_comm_init("mpi", NULL, &world);
        if (st != TP_OK)
            return st;
        run->printer = tp_comm_rank(world) == 0;
        if (run->cfg->nranks_given && tp_comm_size(world) != run->cfg->nranks &&
            tp_comm_rank(world) == 0)
            fprintf(stderr, "tp-bench-comm: -g %d ignored: mpirun started %d processes\n",
                    run->cfg->nranks, tp_comm_size(world));
        int local = launcher_local_rank();
        st = nccl_rank_on(run, world, (local >= 0 ? local : tp_comm_rank(world)) % gpus);
        tp_comm_free(world);
        return st;
    }
    if (run->cfg->nranks > gpus) {
        fprintf(stderr, "tp-bench-comm: backend nccl: -g %d needs %d GPUs, %d visible\n",
                run->cfg->nranks, run->cfg->nranks, gpus);
        return TP_ERR_INVALID_ARG;
    }
    return tp_run_local(run->cfg->nranks, nccl_thread_main, run);
}

/* ---- command line --------------------------------------------------------------- */

static void usage(FILE *f)
{
    fprintf(f,
        "usage: tp-bench-comm [options]\n"
        "  -b, --minbytes SIZE   smallest size (default 4K); suffixes K, M, G (powers of 1024)\n"
        "  -e, --maxbytes SIZE   largest size (default 256M)\n"
        "  -f, --stepfactor N    multiply the size by N between points (default 2)\n"
        "  -n, --iters N         timed iterations per point; 0 = auto (default 0)\n"
        "  -w, --warmup N        warm-up iterations (default 5; with -n 0 capped to ~half\n"
        "                        the target time; at least one call always runs)\n"
        "  -c, --check 0|1       check results (default 1)\n"
        "  -o, --op OP           all_reduce|all_gather|reduce_scatter|all_to_all|broadcast|all\n"
        "                        (default all; a comma-separated list works too)\n"
        "  -d, --datatype T      f32|f64|f16|bf16|i32|i64 (default f32)\n"
        "  -r, --redop OP        sum|avg|max|min|product (default sum)\n"
        "  -g, --nranks N        ranks (default 2; thread backends only)\n"
        "      --backend NAME    how ranks run (default shm); see below\n"
        "      --inplace 0|1     in-place collectives (default 0)\n"
        "      --root R          broadcast root (default 0)\n"
        "      --csv FILE        also write the rows as CSV\n"
        "      --target-s SEC    seconds per point with -n 0 (default 0.2)\n"
        "      --roof-bytes SIZE memcpy roof buffer per rank (default 256M; 0 = no roof)\n"
        "  -h, --help            this text\n"
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

static bool parse_size(const char *s, size_t *out)
{
    char *end;
    errno = 0;
    if (*s == '-')
        return false;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s)
        return false;
    unsigned shift = 0;
    switch (*end) {
    case 'k': case 'K': shift = 10; end++; break;
    case 'm': case 'M': shift = 20; end++; break;
    case 'g': case 'G': shift = 30; end++; break;
    default: break;
    }
    if (shift && (*end == 'i' || *end == 'I'))
        end++;
    if (shift && (*end == 'b' || *end == 'B'))
        end++;
    if (*end != '\0' || (shift && v > (SIZE_MAX >> shift)))
        return false;
    *out = (size_t)(v << shift);
    return true;
}

static bool parse_int(const char *s, long lo, long hi, long *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end != '\0' || v < lo || v > hi)
        return false;
    *out = v;
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
    for (char *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        bool found = false;
        if (strcmp(tok, "all") == 0) {
            for (int i = 0; i < OP_COUNT; i++)
                ops[i] = true;
            continue;
        }
        for (int i = 0; i < OP_COUNT; i++)
            if (strcmp(tok, op_info[i].name) == 0 || strcmp(tok, op_info[i].alias) == 0) {
                ops[i] = found = true;
            }
        if (!found)
            return false;
    }
    return true;
}

static int bad_arg(const char *opt, const char *val, const char *want)
{
    fprintf(stderr, "tp-bench-comm: bad value '%s' for %s: expected %s\n", val, opt, want);
    return EXIT_USAGE;
}

enum { OPT_BACKEND = 256, OPT_INPLACE, OPT_CSV, OPT_ROOT, OPT_TARGET, OPT_ROOF };

static int parse_args(int argc, char **argv, bench_cfg *cfg)
{
    static const struct option longopts[] = {
        {"minbytes", required_argument, NULL, 'b'},
        {"maxbytes", required_argument, NULL, 'e'},
        {"stepfactor", required_argument, NULL, 'f'},
        {"iters", required_argument, NULL, 'n'},
        {"warmup", required_argument, NULL, 'w'},
        {"warmup_iters", required_argument, NULL, 'w'},
        {"check", required_argument, NULL, 'c'},
        {"op", required_argument, NULL, 'o'},
        {"datatype", required_argument, NULL, 'd'},
        {"redop", required_argument, NULL, 'r'},
        {"nranks", required_argument, NULL, 'g'},
        {"backend", required_argument, NULL, OPT_BACKEND},
        {"inplace", required_argument, NULL, OPT_INPLACE},
        {"csv", required_argument, NULL, OPT_CSV},
        {"root", required_argument, NULL, OPT_ROOT},
        {"target-s", required_argument, NULL, OPT_TARGET},
        {"roof-bytes", required_argument, NULL, OPT_ROOF},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    long v;
    int c;
    const char *backend = "shm";
    while ((c = getopt_long(argc, argv, "b:e:f:n:w:c:o:d:r:g:h", longopts, NULL)) != -1) {
        switch (c) {
        case 'b':
            if (!parse_size(optarg, &cfg->min_bytes) || cfg->min_bytes == 0)
                return bad_arg("-b", optarg, "a size > 0 such as 4096, 4K, 1M");
            break;
        case 'e':
            if (!parse_size(optarg, &cfg->max_bytes) || cfg->max_bytes == 0)
                return bad_arg("-e", optarg, "a size > 0 such as 256M, 1G");
            break;
        case 'f':
            if (!parse_size(optarg, &cfg->factor) || cfg->factor < 2)
                return bad_arg("-f", optarg, "an integer factor >= 2");
            break;
        case 'n':
            if (!parse_int(optarg, 0, MAX_ITERS, &v))
                return bad_arg("-n", optarg, "0 (auto) .. 20000");
            cfg->iters = (int)v;
            break;
        case 'w':
            if (!parse_int(optarg, 0, 100000, &v))
                return bad_arg("-w", optarg, "an integer >= 0");
            cfg->warmup = (int)v;
            break;
        case 'c':
            if (!parse_int(optarg, 0, 1, &v))
                return bad_arg("-c", optarg, "0 or 1");
            cfg->check = v != 0;
            break;
        case 'o':
            if (!parse_ops(optarg, cfg->ops))
                return bad_arg("-o", optarg,
                               "all_reduce|all_gather|reduce_scatter|all_to_all|broadcast|all");
            break;
        case 'd': {
            cfg->dt = NULL;
            for (size_t i = 0; i < N_DTYPES; i++)
                if (strcmp(optarg, dtypes[i].name) == 0)
                    cfg->dt = &dtypes[i];
            if (!cfg->dt)
                return bad_arg("-d", optarg, "f32|f64|f16|bf16|i32|i64");
            break;
        }
        case 'r': {
            bool found = false;
            for (size_t i = 0; i < N_REDOPS; i++)
                if (strcmp(optarg, redops[i].name) == 0) {
                    cfg->redop = redops[i].op;
                    found = true;
                }
            if (!found)
                return bad_arg("-r", optarg, "sum|avg|max|min|product");
            break;
        }
        case 'g':
            if (!parse_int(optarg, 1, 4096, &v))
                return bad_arg("-g", optarg, "a rank count >= 1");
            cfg->nranks = (int)v;
            cfg->nranks_given = true;
            break;
        case OPT_BACKEND: backend = optarg; break;
        case OPT_INPLACE:
            if (!parse_int(optarg, 0, 1, &v))
                return bad_arg("--inplace", optarg, "0 or 1");
            cfg->inplace = v != 0;
            break;
        case OPT_CSV: cfg->csv_path = optarg; break;
        case OPT_ROOT:
            if (!parse_int(optarg, 0, 4095, &v))
                return bad_arg("--root", optarg, "a rank >= 0");
            cfg->root = (int)v;
            break;
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
        case 'h': usage(stdout); return -1;
        default: usage(stderr); return EXIT_USAGE;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "tp-bench-comm: unexpected argument '%s'\n", argv[optind]);
        return EXIT_USAGE;
    }
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
    if (cfg->backend->threads && !(strcmp(cfg->backend->name, "nccl") == 0 && under_mpirun()) &&
        cfg->root >= cfg->nranks) {
        fprintf(stderr, "tp-bench-comm: --root %d is not a rank of %d\n", cfg->root, cfg->nranks);
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
        .iters = 0,
        .warmup = 5,
        .check = true,
        .ops = {true, true, true, true, true},
        .dt = &dtypes[0],
        .redop = TP_SUM,
        .nranks = 2,
        .root = 0,
        .roof_bytes = (size_t)256 << 20,
        .target_s = 0.2,
    };
    int rc = parse_args(argc, argv, &cfg);
    if (rc != 0)
        return rc < 0 ? 0 : rc;

    bench_run run = {.cfg = &cfg, .printer = true};
    for (int i = 0; i < OP_COUNT; i++)
        run.ops[i].status = TP_OK;

    tp_status st = cfg.backend->launch(&run);
    const char *err = st != TP_OK ? tp_last_error() : "";
    if (run.csv)
        fclose(run.csv);

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
        if (os->status != TP_OK) {
            printf("#   %-15s ERROR %s\n", op_info[i].name, tp_status_name(os->status));
        } else if (os->wrong > 0) {
            printf("#   %-15s FAILED: %.0f wrong elements\n", op_info[i].name, os->wrong);
        } else {
            printf("#   %-15s OK (%d sizes%s)\n", op_info[i].name, os->points,
                   !cfg.check ? ", not checked" : os->check_skipped ? ", check skipped" : "");
        }
    }
    if (st != TP_OK)
        printf("#   run stopped: %s: %s\n", tp_status_name(st), err);
    printf("# Out of bounds values : %.0f %s\n", run.wrong_total, run.wrong_total > 0 ? "FAILED" : "OK");
    return status;
}
