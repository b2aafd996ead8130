/*
 * tp-bench-ckpt: save and load bandwidth of sharded checkpoints
 * (tp/checkpoint.h) against the disk's sequential bandwidth measured in the
 * same run, and the peak memory of a load.
 *
 * Models: "transformer", the parameters of examples/transformer.c at its
 * default size (vocab 64, dim 32, 4 heads of 8, ffn 64, 2 layers; the same
 * FQNs, shapes and TP plan: wq/wk/wv/w1/output colwise, wo/w2 rowwise,
 * tok_embeddings rowwise), and "1gib", the same structure scaled to about
 * 1 GiB of f32 parameters (vocab 32000, dim 2048, ffn 8192, 3 layers). Each
 * at W = 1, 2, 4 ranks (threads of the shm backend, one mesh of W).
 *
 * Disk: a plain write loop (8 MiB writes, then fsync) of a file as large as
 * the model, and a read loop of it, once with the file just written (page
 * cache) and once after posix_fadvise(DONTNEED) (cold-ish: the kernel drops
 * the clean pages it can; dropping all caches needs root and is not done).
 * The checkpoint's loads are timed the same two ways, and once more with
 * options.copy_first (warm).
 *
 * Each save and load is paired with the disk loop run just before it (the
 * disk of a shared machine drifts by several times between runs): the
 * ratios are per repetition, printed as median [min-max].
 *
 * Usage: tp-bench-ckpt [-d DIR] [-m transformer|1gib|all] [-r REPS] [-c]
 *   DIR: where the files go (default /tmp); REPS: repetitions, the median
 *   is reported (default 3); -c (root): the cold reads drop every cache of
 *   the machine (/proc/sys/vm/drop_caches) rather than one file's pages.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <tp.h>

#include "bench_util.h"

typedef struct {
    const char *name;
    int64_t vocab, dim, heads_dim, ffn, layers, seq;
} model_cfg;

static const model_cfg models[] = {
    {"transformer", 64, 32, 32, 64, 2, 8},
    {"1gib", 32000, 2048, 2048, 8192, 3, 2048},
};

#define CHECK(expr)                                                                        \
    do {                                                                                   \
        tp_status st_ = (expr);                                                            \
        if (st_ != TP_OK) {                                                                \
            fprintf(stderr, "%s: %s (%s)\n", #expr, tp_status_name(st_), tp_last_error()); \
            return st_;                                                                    \
        }                                                                                  \
    } while (0)

static tp_status adopt(tp_module *parent, const char *name, tp_module *child)
{
    tp_status st = tp_module_add_child(parent, name, child);
    if (st != TP_OK)
        tp_module_free(child);
    return st;
}

static tp_status linear(tp_module *p, const char *name, int64_t in, int64_t out, bool bias)
{
    tp_module *m = NULL;
    CHECK(tp_nn_linear_create(in, out, bias, &m));
    return adopt(p, name, m);
}

static tp_status norm(tp_module *p, const char *name, int64_t dim)
{
    tp_module *m = NULL;
    CHECK(tp_nn_layer_norm_create(dim, true, 1e-5, &m));
    return adopt(p, name, m);
}

static tp_status embedding(tp_module *p, const char *name, int64_t num, int64_t dim)
{
    tp_module *m = NULL;
    CHECK(tp_nn_embedding_create(num, dim, &m));
    return adopt(p, name, m);
}

/* The example's parameter tree (containers: no forward is needed here). */
static tp_status build(const model_cfg *c, tp_module **out)
{
    tp_module *m = NULL, *layers = NULL;
    CHECK(tp_nn_container_create(&m));
    *out = m;
    CHECK(embedding(m, "tok_embeddings", c->vocab, c->dim));
    CHECK(embedding(m, "pos_embeddings", c->seq, c->dim));
    CHECK(tp_nn_container_create(&layers));
    CHECK(adopt(m, "layers", layers));
    for (int i = 0; i < c->layers; i++) {
        tp_module *b = NULL, *attn = NULL, *ff = NULL;
        char name[16];
        snprintf(name, sizeof name, "%d", i);
        CHECK(tp_nn_container_create(&b));
        CHECK(adopt(layers, name, b));
        CHECK(norm(b, "attention_norm", c->dim));
        CHECK(tp_nn_container_create(&attn));
        CHECK(adopt(b, "attention", attn));
        CHECK(linear(attn, "wq", c->dim, c->heads_dim, false));
        CHECK(linear(attn, "wk", c->dim, c->heads_dim, false));
        CHECK(linear(attn, "wv", c->dim, c->heads_dim, false));
        CHECK(linear(attn, "wo", c->heads_dim, c->dim, false));
        CHECK(norm(b, "ffn_norm", c->dim));
        CHECK(tp_nn_container_create(&ff));
        CHECK(adopt(b, "feed_forward", ff));
        CHECK(linear(ff, "w1", c->dim, c->ffn, true));
        CHECK(linear(ff, "w2", c->ffn, c->dim, true));
    }
    CHECK(norm(m, "norm", c->dim));
    return linear(m, "output", c->dim, c->vocab, false);
}

static tp_status parallelize(tp_module *m, tp_mesh *mesh)
{
    tp_style *col = NULL, *row = NULL, *emb = NULL;
    tp_rowwise_options eo = {.input_layouts = tp_layout_of(tp_replicate())};
    tp_status st = tp_colwise_parallel_create(NULL, &col);
    if (st == TP_OK)
        st = tp_rowwise_parallel_create(NULL, &row);
    if (st == TP_OK)
        st = tp_rowwise_parallel_create(&eo, &emb);
    const tp_plan_entry plan[] = {
        {"tok_embeddings", emb},           {"layers.*.attention.w[qkv]", col},
        {"layers.*.attention.wo", row},    {"layers.*.feed_forward.w1", col},
        {"layers.*.feed_forward.w2", row}, {"output", col},
    };
    const tp_parallelize_options po = {.src_data_rank = TP_SRC_DATA_RANK_NONE};
    if (st == TP_OK)
        st = tp_parallelize_module(m, mesh, (int)(sizeof plan / sizeof plan[0]), plan, &po);
    tp_style_free(col);
    tp_style_free(row);
    tp_style_free(emb);
    return st;
}

/* ---- the disk ------------------------------------------------------------------- */

#define CHUNK (8u << 20)

static bool drop_all; /* -c: every clean page of the machine, not one file's */

static int drop_cache(const char *path)
{
    int fd = open(path, O_RDONLY);
    if (fd < 0)
        return -1;
    fdatasync(fd);
    int rc = posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    close(fd);
    if (drop_all) {
        FILE *f = fopen("/proc/sys/vm/drop_caches", "w");
        rc = f && fputs("3\n", f) >= 0 && fclose(f) == 0 ? 0 : -1;
        if (rc != 0)
            fprintf(stderr, "tp-bench-ckpt: -c: cannot write /proc/sys/vm/drop_caches\n");
    }
    return rc;
}

static double disk_write(const char *path, uint64_t bytes, char *buf)
{
    double t0 = bench_now_s();
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    for (uint64_t at = 0; fd >= 0 && at < bytes; at += CHUNK) {
        size_t n = bytes - at < CHUNK ? (size_t)(bytes - at) : CHUNK;
        if (write(fd, buf, n) != (ssize_t)n)
            break;
    }
    if (fd >= 0) {
        fsync(fd);
        close(fd);
    }
    return bytes / (bench_now_s() - t0);
}

static double disk_read(const char *path, uint64_t bytes, char *buf, bool cold)
{
    if (cold)
        drop_cache(path);
    double t0 = bench_now_s();
    int fd = open(path, O_RDONLY);
    while (fd >= 0 && read(fd, buf, CHUNK) > 0)
        ;
    if (fd >= 0)
        close(fd);
    return bytes / (bench_now_s() - t0);
}

/* ---- one run ---------------------------------------------------------------------- */

typedef struct {
    const model_cfg *cfg;
    char dir[512];
    int phase; /* 0: save; 1: load (in place); 2: load with copy_first */
    double t_save, t_load;
    uint64_t model_bytes;
    size_t base_alloc, peak_alloc;
} run_t;

static tp_status rank_fn(tp_comm *world, void *arg)
{
    run_t *r = arg;
    int64_t w = tp_comm_size(world);
    tp_mesh *mesh = NULL;
    tp_module *m = NULL;
    tp_status st = tp_mesh_create(world, 1, &w, NULL, &mesh);
    if (st == TP_OK)
        st = build(r->cfg, &m);
    if (st == TP_OK)
        st = parallelize(m, mesh);
    if (st == TP_OK)
        st = tp_module_init(m, 7);
    if (st == TP_OK)
        st = tp_barrier(world, NULL);
    bool lead = tp_comm_rank(world) == 0;
    if (st == TP_OK && lead && r->phase >= 1) {
        tp_memory_info mi;
        tp_memory_stats(TP_CPU, &mi);
        r->base_alloc = mi.allocated;
        tp_memory_reset_peak(TP_CPU);
    }
    if (st == TP_OK)
        st = tp_barrier(world, NULL);
    double t0 = bench_now_s();
    tp_checkpoint_options copy_first = {.copy_first = true};
    if (st == TP_OK)
        st = r->phase == 0 ? tp_checkpoint_save(r->dir, m, NULL, NULL)
                           : tp_checkpoint_load(r->dir, m, NULL, r->phase == 2 ? &copy_first : NULL);
    if (st == TP_OK)
        st = tp_barrier(world, NULL);
    double t = bench_now_s() - t0;
    if (st == TP_OK && lead) {
        tp_memory_info mi;
        tp_memory_stats(TP_CPU, &mi);
        *(r->phase == 0 ? &r->t_save : &r->t_load) = t;
        r->peak_alloc = mi.peak_allocated;
    }
    if (st != TP_OK)
        fprintf(stderr, "rank %d: %s (%s)\n", tp_comm_rank(world), tp_status_name(st),
                tp_last_error());
    tp_module_free(m);
    tp_mesh_free(mesh);
    return st;
}

static uint64_t model_bytes(const model_cfg *c)
{
    uint64_t n = (uint64_t)(c->vocab + c->seq) * c->dim + 2 * (uint64_t)c->dim + c->dim * c->vocab;
    n += (uint64_t)c->layers * (4 * (uint64_t)c->dim + 4 * (uint64_t)c->dim * c->heads_dim +
                                2 * (uint64_t)c->dim * c->ffn + c->ffn + c->dim);
    return n * sizeof(float);
}

/* Drops the page cache of every file of the checkpoint. */
static void drop_ckpt(const char *dir, int w)
{
    char p[600];
    for (int r = 0; r < w; r++) {
        snprintf(p, sizeof p, "%s/rank-%05d.bin", dir, r);
        drop_cache(p);
    }
    snprintf(p, sizeof p, "%s/metadata.json", dir);
    drop_cache(p);
}

/* "median [min-max]" of the ratios v[0..n) as percentages */
static void print_ratio(const double *v, int n)
{
    double c[16], lo = v[0], hi = v[0];
    for (int i = 0; i < n; i++) {
        c[i] = v[i];
        lo = v[i] < lo ? v[i] : lo;
        hi = v[i] > hi ? v[i] : hi;
    }
    printf(" %4.0f%% [%3.0f-%3.0f]", 100 * bench_median(c, n), 100 * lo, 100 * hi);
}

static int run_model(const model_cfg *c, const char *dir, int reps)
{
    uint64_t bytes = model_bytes(c);
    char *buf = malloc(CHUNK), path[600];
    memset(buf, 0x5a, CHUNK);
    snprintf(path, sizeof path, "%s/tp-bench-ckpt-disk.bin", dir);
    printf("\nmodel %s: %.1f MiB of f32 parameters\n", c->name, bytes / 1048576.0);
    printf("%3s %10s %18s %10s %18s %10s %18s %6s %12s %6s\n", "W", "save MB/s", "/disk [min-max]",
           "load MB/s", "/cache [min-max]", "cold MB/s", "/disk [min-max]", "peak", "copy-first",
           "peak");
    double dsum[3] = {0};
    for (int w = 1; w <= 4; w *= 2) {
        double ts[16], tl[16], tc[16], ti[16], rs[16] = {0}, rl[16] = {0}, rc[16] = {0};
        double peak = 0, peak_ip = 0;
        run_t r = {.cfg = c};
        snprintf(r.dir, sizeof r.dir, "%s/tp-bench-ckpt-%s-w%d", dir, c->name, w);
        for (int i = 0; i < reps; i++) {
            /* each figure beside the disk loop run just before it: the
             * disk of a shared machine drifts between runs */
            double dw = disk_write(path, bytes, buf);
            r.phase = 0;
            if (tp_run_local(w, rank_fn, &r) != TP_OK)
                return 1;
            ts[i] = bytes / r.t_save;
            rs[i] = ts[i] / dw;
            double dr = disk_read(path, bytes, buf, false);
            r.phase = 1;
            if (tp_run_local(w, rank_fn, &r) != TP_OK)
                return 1;
            tl[i] = bytes / r.t_load;
            rl[i] = tl[i] / dr;
            peak = (double)(r.peak_alloc - r.base_alloc) / bytes;
            double drc = disk_read(path, bytes, buf, true);
            drop_ckpt(r.dir, w);
            if (tp_run_local(w, rank_fn, &r) != TP_OK)
                return 1;
            tc[i] = bytes / r.t_load;
            rc[i] = tc[i] / drc;
            r.phase = 2;
            if (tp_run_local(w, rank_fn, &r) != TP_OK)
                return 1;
            ti[i] = bytes / r.t_load;
            peak_ip = (double)(r.peak_alloc - r.base_alloc) / bytes;
            dsum[0] += dw / (3.0 * reps);
            dsum[1] += dr / (3.0 * reps);
            dsum[2] += drc / (3.0 * reps);
        }
        printf("%3d %10.0f", w, bench_median(ts, reps) / 1e6);
        print_ratio(rs, reps);
        printf(" %10.0f", bench_median(tl, reps) / 1e6);
        print_ratio(rl, reps);
        printf(" %10.0f", bench_median(tc, reps) / 1e6);
        print_ratio(rc, reps);
        printf(" %6.2f %12.0f %6.2f\n", peak, bench_median(ti, reps) / 1e6, peak_ip);
        char cmd[700];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", r.dir);
        if (system(cmd) != 0)
            fprintf(stderr, "could not remove %s\n", r.dir);
    }
    unlink(path);
    free(buf);
    printf("disk (same size, 8 MiB chunks; means over the runs): write+fsync %.0f MB/s, read (page "
           "cache) %.0f MB/s, read after DONTNEED %.0f MB/s\n",
           dsum[0] / 1e6, dsum[1] / 1e6, dsum[2] / 1e6);
    return 0;
}

int main(int argc, char **argv)
{
    const char *dir = "/tmp", *which = "all";
    int reps = 3;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-d") && i + 1 < argc)
            dir = argv[++i];
        else if (!strcmp(argv[i], "-m") && i + 1 < argc)
            which = argv[++i];
        else if (!strcmp(argv[i], "-c"))
            drop_all = true;
        else if (!strcmp(argv[i], "-r") && i + 1 < argc &&
                 bench_parse_int(argv[i + 1], 1, 16, &reps))
            i++;
        else {
            fprintf(stderr, "usage: %s [-d DIR] [-m transformer|1gib|all] [-r REPS (1-16)] [-c]\n",
                    argv[0]);
            return 2;
        }
    }
    bool known = !strcmp(which, "all");
    for (size_t i = 0; i < sizeof models / sizeof *models; i++)
        known = known || !strcmp(which, models[i].name);
    if (!known) {
        fprintf(stderr,
                "tp-bench-ckpt: unknown model '%s'\n"
                "usage: %s [-d DIR] [-m transformer|1gib|all] [-r REPS (1-16)] [-c]\n",
                which, argv[0]);
        return 2;
    }
    printf("tp-bench-ckpt: dir %s, %d repetitions (medians), %d cores, cold: %s\n", dir, reps,
           bench_cores(), drop_all ? "drop_caches" : "DONTNEED");
    printf("peak: the highest tensor memory during a load above what the model held before "
           "it, over the model's size (all ranks together); copy-first: a load with "
           "options.copy_first (page cache warm), MB/s and peak\n");
    for (size_t i = 0; i < sizeof models / sizeof *models; i++)
        if (!strcmp(which, "all") || !strcmp(which, models[i].name))
            if (run_model(&models[i], dir, reps))
                return 1;
    return 0;
}
