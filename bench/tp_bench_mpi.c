/*
 * tp-bench-mpi: libtp's mpi backend against the MPI it calls, in one
 * process per rank under mpirun. For every collective and size it times, in
 * turn, libtp's blocking call (work = NULL) on an "mpi" world, the same MPI's
 * blocking call (MPI_Allreduce, ...) and its non-blocking call waited for with
 * an MPI_Test loop (MPI_Iallreduce, ...), each on its own duplicate of
 * MPI_COMM_WORLD; each repetition starts with the next of the three (A B C,
 * B C A, C A B, ...) so that no form always runs first. Per point it prints
 * the median time per call of each and the ratio libtp / the better bare
 * form: the bare form (blocking or non-blocking) with the lower median is
 * chosen once per point, and the ratio is the median over repetitions of
 * libtp's time over that form's time in the same repetition, with its
 * min-max. (Dividing by the lower of the two bare times inside each
 * repetition instead would bias the ratio upwards: the minimum of two noisy
 * times of the same cost is below either.) --self times MPI's blocking call
 * in libtp's place, an A/A run that shows the method's own noise.
 *
 *   mpirun -np 2 tp-bench-mpi [-b 4K] [-e 64M] [-f 4] [-R 5] [--target-s 0.2]
 *                             [--collective all_reduce,all_gather,...] [--csv FILE]
 *                             [--self]
 *
 * Sizes follow nccl-tests (and ../shared/peers/mpi_coll.c): float32, the
 * size is the larger buffer of a rank (all_gather's output, reduce_scatter's
 * input). A time per call is the slowest rank's loop time over its calls.
 * Results are checked once per point (exit 1 on a wrong element).
 */
#include <mpi.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <tp.h>

enum { C_ALL_REDUCE, C_ALL_GATHER, C_REDUCE_SCATTER, C_ALL_TO_ALL, C_BROADCAST, C_COUNT };
enum { V_TP, V_BLOCKING, V_NONBLOCKING, V_COUNT };
enum { MAX_REPS = 100 };

static const char *const coll_names[C_COUNT] = {"all_reduce", "all_gather", "reduce_scatter",
                                                "all_to_all", "broadcast"};

typedef struct bench {
    int rank, size;
    tp_comm *world;
    MPI_Comm comm[V_COUNT]; /* V_TP's: the barriers between loops, and --self's calls */
    tp_tensor *send, *recv;
    float *sbuf, *rbuf;
    size_t count; /* elements of the larger buffer */
    bool self;    /* --self: MPI's blocking call in libtp's place */
} bench;

static int64_t elems(size_t n)
{
    return (int64_t)n;
}

/* One call of collective c in form v on the current buffers. */
static int call(bench *b, int c, int v)
{
    size_t n = b->count, k = n / (size_t)b->size;
    if (v == V_TP && !b->self) {
        switch (c) {
        case C_ALL_REDUCE:
            return tp_all_reduce(b->world, b->send, b->recv, TP_SUM, NULL);
        case C_ALL_GATHER:
            return tp_all_gather(b->world, b->send, b->recv, NULL);
        case C_REDUCE_SCATTER:
            return tp_reduce_scatter(b->world, b->send, b->recv, TP_SUM, NULL);
        case C_ALL_TO_ALL:
            return tp_all_to_all(b->world, b->send, b->recv, NULL);
        default:
            return tp_broadcast(b->world, b->recv, 0, NULL);
        }
    }
    MPI_Comm m = b->comm[v];
    MPI_Request req = MPI_REQUEST_NULL;
    MPI_Request *r = v == V_NONBLOCKING ? &req : NULL; /* V_TP here: --self */
    int rc;
    switch (c) {
    case C_ALL_REDUCE:
        rc = r ? MPI_Iallreduce(b->sbuf, b->rbuf, (int)n, MPI_FLOAT, MPI_SUM, m, r)
               : MPI_Allreduce(b->sbuf, b->rbuf, (int)n, MPI_FLOAT, MPI_SUM, m);
        break;
    case C_ALL_GATHER:
        rc = r ? MPI_Iallgather(b->sbuf, (int)k, MPI_FLOAT, b->rbuf, (int)k, MPI_FLOAT, m, r)
               : MPI_Allgather(b->sbuf, (int)k, MPI_FLOAT, b->rbuf, (int)k, MPI_FLOAT, m);
        break;
    case C_REDUCE_SCATTER:
        rc = r ? MPI_Ireduce_scatter_block(b->sbuf, b->rbuf, (int)k, MPI_FLOAT, MPI_SUM, m, r)
               : MPI_Reduce_scatter_block(b->sbuf, b->rbuf, (int)k, MPI_FLOAT, MPI_SUM, m);
        break;
    case C_ALL_TO_ALL:
        rc = r ? MPI_Ialltoall(b->sbuf, (int)k, MPI_FLOAT, b->rbuf, (int)k, MPI_FLOAT, m, r)
               : MPI_Alltoall(b->sbuf, (int)k, MPI_FLOAT, b->rbuf, (int)k, MPI_FLOAT, m);
        break;
    default:
        rc = r ? MPI_Ibcast(b->rbuf, (int)n, MPI_FLOAT, 0, m, r)
               : MPI_Bcast(b->rbuf, (int)n, MPI_FLOAT, 0, m);
        break;
    }
    for (int flag = !r; rc == MPI_SUCCESS && !flag;)
        rc = MPI_Test(r, &flag, MPI_STATUS_IGNORE);
    return rc;
}

/* Fills the inputs (rank r, element i: r + i % 7) and checks one call's result. */
static long check(bench *b, int c, int v)
{
    size_t n = b->count, k = n / (size_t)b->size;
    int p = b->size, r = b->rank;
    size_t sn = c == C_ALL_GATHER ? k : n, rn = c == C_REDUCE_SCATTER ? k : n;
    for (size_t i = 0; i < sn; i++)
        b->sbuf[i] = (float)(r + (int)(i % 7));
    for (size_t i = 0; i < rn; i++)
        b->rbuf[i] = c == C_BROADCAST && r == 0 ? (float)(i % 7) : -1;
    if (call(b, c, v) != 0)
        return -1;
    size_t out = (c == C_REDUCE_SCATTER)                   ? k
                 : (c == C_ALL_REDUCE || c == C_BROADCAST) ? n
                                                           : k * (size_t)p;
    long wrong = 0;
    for (size_t i = 0; i < out; i++) {
        size_t blk = k ? i / k : 0, j = k ? i % k : i;
        double want;
        if (c == C_ALL_REDUCE)
            want = (double)p * (p - 1) / 2 + (double)p * (double)(i % 7);
        else if (c == C_REDUCE_SCATTER)
            want = (double)p * (p - 1) / 2 + (double)p * (double)(((size_t)r * k + i) % 7);
        else if (c == C_ALL_GATHER)
            want = (double)blk + (double)(j % 7);
        else if (c == C_ALL_TO_ALL)
            want = (double)blk + (double)(((size_t)r * k + j) % 7);
        else
            want = (double)(i % 7);
        wrong += b->rbuf[i] != (float)want;
    }
    return wrong;
}

/* Seconds per call of n calls (the slowest rank's). */
static double loop(bench *b, int c, int v, int n)
{
    MPI_Barrier(b->comm[V_TP]);
    double t0 = MPI_Wtime();
    for (int i = 0; i < n; i++)
        if (call(b, c, v) != 0)
            return NAN;
    double t = (MPI_Wtime() - t0) / n, slowest = 0;
    MPI_Allreduce(&t, &slowest, 1, MPI_DOUBLE, MPI_MAX, b->comm[V_TP]);
    return slowest;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static int set_size(bench *b, int c, size_t bytes)
{
    tp_tensor_release(b->send);
    tp_tensor_release(b->recv);
    b->send = b->recv = NULL;
    size_t n = bytes / sizeof(float), k = n / (size_t)b->size;
    n = k * (size_t)b->size;
    b->count = n;
    int64_t sn = elems(c == C_ALL_GATHER ? k : n), rn = elems(c == C_REDUCE_SCATTER ? k : n);
    if (tp_tensor_zeros(TP_F32, TP_CPU, 1, &sn, &b->send) != TP_OK ||
        tp_tensor_zeros(TP_F32, TP_CPU, 1, &rn, &b->recv) != TP_OK)
        return -1;
    b->sbuf = tp_tensor_data(b->send);
    b->rbuf = tp_tensor_data(b->recv);
    return 0;
}

/* All repetitions of one point; prints its line and CSV rows. */
static int point(bench *b, int c, size_t bytes, int reps, double target, FILE *csv)
{
    if (set_size(b, c, bytes) != 0)
        return 2;
    long wrong = 0;
    for (int v = 0; v < V_COUNT; v++)
        wrong += check(b, c, v);
    double once = loop(b, c, V_BLOCKING, 5);
    int n = (int)fmin(10000, fmax(3, target / fmax(once, 1e-7)));
    MPI_Bcast(&n, 1, MPI_INT, 0, b->comm[V_TP]);
    double t[V_COUNT][MAX_REPS], ratio[MAX_REPS];
    for (int v = 0; v < V_COUNT; v++)
        loop(b, c, v, n < 10 ? n : 10); /* warm-up */
    for (int rep = 0; rep < reps; rep++)
        for (int j = 0; j < V_COUNT; j++) {
            int v = (rep + j) % V_COUNT;
            t[v][rep] = loop(b, c, v, n);
        }
    double med[V_COUNT], fast[V_COUNT], sorted[MAX_REPS];
    for (int v = 0; v < V_COUNT; v++) {
        memcpy(sorted, t[v], (size_t)reps * sizeof *sorted);
        med[v] = median(sorted, reps);
        fast[v] = sorted[0];
    }
    int best = med[V_NONBLOCKING] < med[V_BLOCKING] ? V_NONBLOCKING : V_BLOCKING;
    for (int rep = 0; rep < reps; rep++) {
        ratio[rep] = t[V_TP][rep] / t[best][rep];
        if (csv && b->rank == 0)
            fprintf(csv, "%s,%zu,%d,%d,%.3f,%.3f,%.3f,%s,%.4f\n", coll_names[c], bytes, rep, n,
                    t[V_TP][rep] * 1e6, t[V_BLOCKING][rep] * 1e6, t[V_NONBLOCKING][rep] * 1e6,
                    best == V_BLOCKING ? "blocking" : "nonblocking", ratio[rep]);
    }
    double lo = ratio[0], hi = ratio[0];
    for (int rep = 1; rep < reps; rep++) {
        lo = fmin(lo, ratio[rep]);
        hi = fmax(hi, ratio[rep]);
    }
    double mr = median(ratio, reps);
    double fr = fast[V_TP] / fmin(fast[V_BLOCKING], fast[V_NONBLOCKING]);
    if (b->rank == 0)
        printf("%-15s %10zu %6d %11.2f %11.2f %11.2f %-8s %7.3f  %.3f-%.3f %8.3f  %s\n",
               coll_names[c], bytes, n, med[V_TP] * 1e6, med[V_BLOCKING] * 1e6,
               med[V_NONBLOCKING] * 1e6, best == V_BLOCKING ? "blocking" : "nonblock", mr, lo, hi,
               fr, wrong ? "WRONG" : "ok");
    fflush(stdout);
    return wrong ? 1 : 0;
}

static size_t parse_size(const char *s)
{
    char *end = NULL;
    double v = strtod(s, &end);
    if (end && (*end == 'K' || *end == 'k'))
        v *= 1024;
    else if (end && (*end == 'M' || *end == 'm'))
        v *= 1024 * 1024;
    else if (end && (*end == 'G' || *end == 'g'))
        v *= 1024.0 * 1024 * 1024;
    return v > 0 ? (size_t)v : 0;
}

typedef struct opts {
    size_t lo, hi;
    double factor, target;
    int reps;
    bool coll[C_COUNT];
    const char *csv;
    bool self;
} opts;

static int parse(int argc, char **argv, opts *o)
{
    *o = (opts){.lo = 4096, .hi = 64u << 20, .factor = 4, .target = 0.2, .reps = 5};
    bool any = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--self") == 0) {
            o->self = true;
            continue;
        }
        if (!v)
            return -1;
        i++;
        if (strcmp(a, "-b") == 0)
            o->lo = parse_size(v);
        else if (strcmp(a, "-e") == 0)
            o->hi = parse_size(v);
        else if (strcmp(a, "-f") == 0)
            o->factor = atof(v);
        else if (strcmp(a, "-R") == 0)
            o->reps = atoi(v);
        else if (strcmp(a, "--target-s") == 0)
            o->target = atof(v);
        else if (strcmp(a, "--csv") == 0)
            o->csv = v;
        else if (strcmp(a, "--collective") == 0)
            for (int c = 0; c < C_COUNT; c++)
                any |= o->coll[c] = strstr(v, coll_names[c]) != NULL;
        else
            return -1;
    }
    for (int c = 0; c < C_COUNT && !any; c++)
        o->coll[c] = true;
    return o->lo && o->hi >= o->lo && o->factor > 1 && o->reps >= 1 && o->reps <= MAX_REPS &&
                   o->target > 0
               ? 0
               : -1;
}

int main(int argc, char **argv)
{
    opts o;
    if (parse(argc, argv, &o) != 0) {
        fprintf(stderr, "usage: mpirun -np N tp-bench-mpi [-b 4K] [-e 64M] [-f 4] [-R 5] "
                        "[--target-s 0.2] [--collective LIST] [--csv FILE] [--self]\n");
        return 64;
    }
    bench b = {.self = o.self};
    if (tp_comm_create_world("mpi", NULL, &b.world) != TP_OK) {
        fprintf(stderr, "tp-bench-mpi: tp_comm_create_world(\"mpi\"): %s\n", tp_last_error());
        return 2;
    }
    b.rank = tp_comm_rank(b.world);
    b.size = tp_comm_size(b.world);
    for (int v = 0; v < V_COUNT; v++)
        MPI_Comm_dup(MPI_COMM_WORLD, &b.comm[v]);
    FILE *csv = NULL;
    if (o.csv && b.rank == 0 && !(csv = fopen(o.csv, "w")))
        fprintf(stderr, "tp-bench-mpi: cannot write %s\n", o.csv);
    if (csv)
        fprintf(csv, "coll,bytes,rep,calls,tp_us,blocking_us,nonblocking_us,against,ratio\n");
    if (b.rank == 0)
        printf("# tp-bench-mpi: %d ranks, f32 sum, %d repetitions; ratio = %s / the better of "
               "MPI's blocking and non-blocking call (`against`, by median; median and min-max "
               "of the ratio over repetitions)\n"
               "# %-13s %10s %6s %11s %11s %11s %-8s %7s  %-11s %8s\n",
               b.size, o.reps, o.self ? "MPI's blocking call again (--self)" : "libtp",
               "collective", "bytes", "calls", o.self ? "self_us" : "libtp_us", "blocking_us",
               "nonblock_us", "against", "ratio", "spread", "fastest");
    int status = 0;
    for (int c = 0; c < C_COUNT && status < 2; c++)
        for (size_t s = o.lo; o.coll[c] && s <= o.hi && status < 2; s = (size_t)(s * o.factor)) {
            int st = point(&b, c, s, o.reps, o.target, csv);
            status = st > status ? st : status;
        }
    if (csv)
        fclose(csv);
    tp_tensor_release(b.send);
    tp_tensor_release(b.recv);
    for (int v = 0; v < V_COUNT; v++)
        MPI_Comm_free(&b.comm[v]);
    tp_comm_free(b.world);
    return status;
}
