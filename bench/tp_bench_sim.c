/*
 * tp-bench-sim: one training step of a Llama-shaped decoder (RMSNorm,
 * attention with colwise wq/wk/wv and rowwise wo, a gated GELU MLP with
 * colwise w1/w3 and rowwise w2, residuals; sequence parallel) played as one
 * rank of a simulated dp x tp world on meta tensors (docs/sim.md): the
 * model is built on the meta device, parallelized over the "tp" dim of a
 * 2-D mesh, wrapped in a DDP over "dp", run forward and backward and
 * stepped with Adam. Prints the time of each phase, the collectives the
 * step issued (count and bytes per kind, as comm-debug records them) and
 * the process's peak RSS.
 *
 *   tp-bench-sim [--layers 80] [--hidden 8192] [--ffn 28672] [--heads 64]
 *                [--seq 4096] [--batch 1] [--dp 64] [--tp 8] [--rank 0]
 *
 * With --measure N --hw FILE it also walks the step on that hardware
 * description (tp/plan.h) and runs N real steps of the same model on this
 * machine (dp x tp shm ranks on the CPU), printing predicted against
 * measured step time (docs/plan.md, "Validation"). The ranks share the
 * file's devices_per_node devices (tp_hw_share_devices: ceil(ranks /
 * devices) per device); run it with the BLAS threads the file was
 * calibrated with (OPENBLAS_NUM_THREADS=1 for a device per core). With
 * --backend mpi, under mpirun -np dp*tp, the real steps run one process per
 * rank of an "mpi" world instead, and rank 0 prints.
 *
 * The defaults are the 70B configuration of issue 19. The loss is the mean
 * of the last block's output (no vocabulary). The model and the step are
 * tools/plan_model.c's, which tp-plan runs too.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "bench_util.h"
#include "plan_model.h"

typedef struct cfg {
    int layers, hidden, ffn, heads, seq, batch, dp, tp, rank, measure;
    const char *hw;
    tp_comm *world; /* --backend mpi: the real steps' world; NULL: shm threads */
} cfg;

static void report(const tp_comm_debug *dbg)
{
    for (int k = 0; k < TP_COLL_KIND_COUNT; k++) {
        int64_t n = tp_comm_debug_count(dbg, (tp_coll_kind)k);
        if (n)
            printf("  %-15s %8lld  %14.3f MiB\n", tp_coll_kind_name((tp_coll_kind)k), (long long)n,
                   (double)tp_comm_debug_bytes(dbg, (tp_coll_kind)k) / (1024.0 * 1024.0));
    }
}

static int by_value(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* --measure N --hw FILE: the walk's step time beside N real steps on this
 * machine (dp x tp shm ranks on the CPU). */
static tp_status predict_and_measure(const cfg *c, const plan_cfg *pc, const plan_step *s)
{
    tp_hw *file = NULL, *hw = NULL;
    tp_status st = tp_hw_load_file(c->hw, &file);
    /* every rank runs on this one machine: ranks beyond its devices take
     * turns on them */
    int ranks = c->dp * c->tp, dpn = file ? tp_hw_devices_per_node(file) : 1;
    int share = (ranks + dpn - 1) / dpn;
    if (st == TP_OK)
        st = tp_hw_share_devices(file, share, &hw);
    tp_plan_result r;
    if (st == TP_OK) {
        printf("%d ranks (%s) on %d device%s: %d rank%s per device\n", ranks,
               c->world ? "mpi processes" : "shm threads", dpn, dpn == 1 ? "" : "s", share,
               share == 1 ? "" : "s");
        st = tp_plan_walk(s->trace, hw, &r);
    }
    tp_hw_free(hw);
    tp_hw_free(file);
    double *t = calloc((size_t)c->measure, sizeof *t);
    if (st == TP_OK && !t)
        st = TP_ERR_NO_MEMORY;
    if (st == TP_OK)
        st = c->world ? plan_measure_steps_on(pc, c->world, c->measure, t)
                      : plan_measure_steps(pc, c->measure, t);
    if (st == TP_OK && (!c->world || tp_comm_rank(c->world) == 0)) {
        qsort(t, (size_t)c->measure, sizeof *t, by_value);
        double med = t[c->measure / 2];
        printf("predicted step %.6f s (compute %.6f s, exposed communication %.6f s); "
               "measured over %d steps: min %.6f s, median %.6f s, max %.6f s; "
               "error vs median %+.1f%%\n",
               r.step_s, r.compute_s, r.exposed_comm_s, c->measure, t[0], med, t[c->measure - 1],
               100.0 * (r.step_s - med) / med);
        printf("the walk: %lld GEMMs, %lld element-wise kernels, %lld collectives\n",
               (long long)r.gemms, (long long)r.elementwise, (long long)r.collectives);
    }
    free(t);
    return st;
}

static tp_status run(const cfg *c)
{
    plan_cfg pc = {.layers = c->layers,
                   .hidden = c->hidden,
                   .ffn = c->ffn,
                   .heads = c->heads,
                   .seq = c->seq,
                   .batch = c->batch,
                   .dtype = TP_F32,
                   .dp = c->dp,
                   .tp = c->tp,
                   .rank = c->rank,
                   .sp = true};
    plan_step s;
    tp_status st = plan_run_step(&pc, &s);
    if (st == TP_OK && c->measure)
        st = predict_and_measure(c, &pc, &s);
    if (st != TP_OK) {
        fprintf(stderr, "tp-bench-sim: %s (%s)\n", tp_status_name(st), tp_last_error());
        return st;
    }
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    printf("sim step: %d layers, hidden %d, ffn %d, heads %d, seq %d, batch %d; dp %d x tp %d, "
           "rank %d of %d\n",
           c->layers, c->hidden, c->ffn, c->heads, c->seq, c->batch, c->dp, c->tp, c->rank,
           c->dp * c->tp);
    printf("  build %.3f s, parallelize+ddp %.3f s, forward %.3f s, backward %.3f s, "
           "step %.3f s; total %.3f s\n",
           s.t_build, s.t_setup, s.t_forward, s.t_backward, s.t_optim,
           s.t_build + s.t_setup + s.t_forward + s.t_backward + s.t_optim);
    printf("  peak RSS %.1f MiB\n", (double)ru.ru_maxrss / 1024.0);
    printf("collectives of the step (this rank):\n");
    report(s.dbg);
    plan_step_free(&s);
    return TP_OK;
}

int main(int argc, char **argv)
{
    cfg c = {80, 8192, 28672, 64, 4096, 1, 64, 8, 0, 0, NULL, NULL};
    struct {
        const char *flag;
        int *v;
    } opts[] = {{"--layers", &c.layers},  {"--hidden", &c.hidden}, {"--ffn", &c.ffn},
                {"--heads", &c.heads},    {"--seq", &c.seq},       {"--batch", &c.batch},
                {"--dp", &c.dp},          {"--tp", &c.tp},         {"--rank", &c.rank},
                {"--measure", &c.measure}};
    const char *backend = "shm";
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--hw") == 0 && i + 1 < argc) {
            c.hw = argv[++i];
            continue;
        }
        if (strcmp(argv[i], "--backend") == 0 && i + 1 < argc &&
            (strcmp(argv[i + 1], "shm") == 0 || strcmp(argv[i + 1], "mpi") == 0)) {
            backend = argv[++i];
            continue;
        }
        size_t k = 0;
        while (k < sizeof opts / sizeof *opts && strcmp(argv[i], opts[k].flag) != 0)
            k++;
        if (k == sizeof opts / sizeof *opts || i + 1 == argc ||
            !bench_parse_int(argv[++i], 0, 1 << 30, opts[k].v)) {
            fprintf(stderr, "usage: tp-bench-sim [--layers N] [--hidden N] [--ffn N] [--heads N] "
                            "[--seq N] [--batch N] [--dp N] [--tp N] [--rank R] "
                            "[--measure N --hw FILE [--backend shm|mpi]]\n");
            return 2;
        }
    }
    if (c.measure && !c.hw) {
        fprintf(stderr, "tp-bench-sim: --measure needs --hw FILE (tp-bench-calibrate -o FILE)\n");
        return 2;
    }
    if (c.heads <= 0 || c.tp <= 0 || c.hidden % c.heads || c.heads % c.tp || c.seq % c.tp) {
        fprintf(stderr, "tp-bench-sim: heads must divide hidden, tp heads and seq\n");
        return 2;
    }
    if (strcmp(backend, "mpi") == 0) {
        if (!c.measure) {
            fprintf(stderr, "tp-bench-sim: --backend mpi is for --measure\n");
            return 2;
        }
        if (tp_comm_create_world("mpi", NULL, &c.world) != TP_OK) {
            fprintf(stderr, "tp-bench-sim: tp_comm_create_world(\"mpi\"): %s\n", tp_last_error());
            return 1;
        }
        if (tp_comm_rank(c.world) != 0 && !freopen("/dev/null", "w", stdout))
            return 1; /* rank 0 prints */
    }
    int rc = run(&c) == TP_OK ? 0 : 1;
    tp_comm_free(c.world);
    return rc;
}
