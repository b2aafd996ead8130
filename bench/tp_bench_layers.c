/*
 * tp-bench-layers: throughput of tensor-parallel Linear and Embedding layers.
 *
 * Sweeps style x tokens x hidden size x rank count, forward and
 * forward+backward, and reports per point: time, GFLOP/s (of the layer's
 * matrix products), tokens/s, the share of the time spent in collectives
 * (the collectives the comm-debug counter saw, re-issued alone on buffers of
 * the same sizes and timed), and the speedup over one rank running the whole
 * layer. Every rank runs one BLAS thread. --backend picks how ranks exist:
 *
 *   shm   threads of this process (tp_run_local), -g of them (default 1,2)
 *   mpi   one process per rank under mpirun (tp_comm_init("mpi")); a rank
 *         count below the process count runs on the first ranks while the
 *         others wait asleep; default -g 1,N for N processes; rank 0 prints
 *   nccl  one GPU per rank, the nccl communicator bootstrapped over the shm
 *         threads, or over the mpi world when run under mpirun
 *         (--bootstrap shm|mpi); parameters and inputs on TP_CUDA(rank % GPUs)
 *
 * The timing is the same for all: a barrier before every timed pass, rank 0's
 * clock, the median over -n passes (default 5) after -w untimed ones (default
 * 1; the embeddings' backward needs a few more before their buffers are reused).
 *
 *   layers:  colwise   Linear(H -> 4H), ColwiseParallel
 *            rowwise   Linear(4H -> H), RowwiseParallel (input sharded)
 *            mlp       colwise -> GELU -> rowwise (the Megatron MLP block)
 *            emb-col   Embedding(V, H) ColwiseParallel
 *            emb-row   Embedding(V, H) RowwiseParallel(input R)
 *
 * Usage: tp-bench-layers [--backend shm|mpi|nccl] [--bootstrap shm|mpi] [-l LAYERS]
 *                        [-t TOKENS,..] [-H HIDDEN,..] [-g RANKS,..] [-n ITERS] [-w WARMUP]
 *                        [--csv FILE]
 *        tp-bench-layers --mlp-check   (2048 -> 8192 -> 2048, 2048 tokens)
 */
#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <tp.h>

enum { BK_SHM, BK_MPI, BK_NCCL, BK_COUNT };
static const char *backend_names[BK_COUNT] = {"shm", "mpi", "nccl"};

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

enum { L_COLWISE, L_ROWWISE, L_MLP, L_EMB_COL, L_EMB_ROW, L_COUNT };
static const char *layer_names[L_COUNT] = {"colwise", "rowwise", "mlp", "emb-col", "emb-row"};

typedef struct {
    int layer;
    int64_t tokens, hidden, vocab;
    bool backward;
    int iters, warmup; /* timed passes; untimed passes before them (>= 1) */
    bool cuda; /* parameters, inputs and collective buffers on this rank's GPU */
    /* out (rank 0) */
    double t_med, t_coll;
} point;

#define TRY(expr)                                                               \
    do {                                                                        \
        st = (expr);                                                            \
        if (st != TP_OK) {                                                      \
            fprintf(stderr, "rank %d: %s: %s (%s)\n", tp_comm_rank(w), #expr,   \
                    tp_status_name(st), tp_last_error());                       \
            goto out;                                                           \
        }                                                                       \
    } while (0)

static tp_status build(point *p, tp_mesh *mesh, int W, tp_module **root, tp_style **styles)
{
    tp_status st = TP_OK;
    int64_t H = p->hidden;
    tp_module *m = NULL, *a = NULL, *g = NULL, *b = NULL;
    tp_colwise_options co = {0};
    tp_rowwise_options ro = {0};
    switch (p->layer) {
    case L_COLWISE:
        st = tp_linear_create(H, 4 * H, true, &m);
        break;
    case L_ROWWISE:
        st = tp_linear_create(4 * H, H, true, &m);
        break;
    case L_MLP:
        st = tp_sequential_create(&m);
        if (st == TP_OK) st = tp_linear_create(H, 4 * H, true, &a);
        if (st == TP_OK) st = tp_module_add_child(m, "0", a);
        if (st == TP_OK) st = tp_gelu_create(TP_GELU_TANH, &g);
        if (st == TP_OK) st = tp_module_add_child(m, "1", g);
        if (st == TP_OK) st = tp_linear_create(4 * H, H, true, &b);
        if (st == TP_OK) st = tp_module_add_child(m, "2", b);
        break;
    case L_EMB_COL:
    case L_EMB_ROW:
        st = tp_embedding_create(p->vocab, H, &m);
        break;
    }
    if (st != TP_OK) {
        tp_module_free(m);
        return st;
    }
    if (W > 1) {
        if (p->layer == L_EMB_ROW)
            ro.input_layouts = tp_layout_of(tp_replicate());
        st = tp_colwise_parallel(&co, &styles[0]);
        if (st == TP_OK)
            st = tp_rowwise_parallel(&ro, &styles[1]);
        tp_plan_entry plan[2];
        int n = 0;
        switch (p->layer) {
        case L_COLWISE:
        case L_EMB_COL: plan[n++] = (tp_plan_entry){"", styles[0]}; break;
        case L_ROWWISE:
        case L_EMB_ROW: plan[n++] = (tp_plan_entry){"", styles[1]}; break;
        case L_MLP:
            plan[n++] = (tp_plan_entry){"0", styles[0]};
            plan[n++] = (tp_plan_entry){"2", styles[1]};
            break;
        }
        tp_parallelize_options po = {.src_data_rank = TP_SRC_DATA_RANK_NONE};
        if (st == TP_OK)
            st = tp_parallelize_module(m, mesh, n, plan, &po);
    }
    if (st == TP_OK)
        st = tp_module_init(m, 42);
    if (st != TP_OK) {
        tp_module_free(m);
        return st;
    }
    *root = m;
    return TP_OK;
}

/* The GPU of a rank: the nccl backend's choice for device = -1. */
static tp_device rank_device(const tp_comm *w, bool cuda)
{
    int n = cuda ? tp_cuda_device_count() : 0;
    return n > 0 ? TP_CUDA(tp_comm_rank(w) % n) : TP_CPU;
}

/* GPU kernels are queued: a timed region ends when this thread's stream has
 * drained (blocking nccl collectives have completed on return, and the
 * stream is ordered after them). No-op on the CPU. */
static tp_status device_sync(tp_device dev)
{
    return dev.type == TP_DEVICE_CPU ? TP_OK : tp_cuda_synchronize(dev.index);
}

static tp_status run_point(tp_comm *w, point *p)
{
    tp_status st = TP_OK;
    int W = tp_comm_size(w), r = tp_comm_rank(w);
    int64_t Wl = W;
    tp_device dev = rank_device(w, p->cuda);
    tp_mesh *mesh = NULL;
    tp_module *m = NULL;
    tp_style *styles[2] = {0};
    tp_tensor *x = NULL, *g = NULL;
    tp_comm_debug *dbg = NULL;
    double *times = NULL;
    TRY(tp_mesh_create(w, 1, &Wl, (const char *[]){"tp"}, &mesh));
    TRY(build(p, mesh, W, &m, styles));
    if (dev.type != TP_DEVICE_CPU)
        TRY(tp_module_to(m, dev));
    int64_t T = p->tokens, H = p->hidden;
    if (p->layer == L_EMB_COL || p->layer == L_EMB_ROW) {
        TRY(tp_tensor_zeros(TP_I64, TP_CPU, 1, &T, &x));
        TRY(tp_tensor_fill_random(x, TP_RNG_RANDINT, 0, (double)p->vocab, 7, NULL, NULL));
    } else {
        int64_t in = p->layer == L_ROWWISE ? 4 * H / W : H, xs[2] = {T, in};
        TRY(tp_tensor_zeros(TP_F32, TP_CPU, 2, xs, &x));
        TRY(tp_tensor_fill_random(x, TP_RNG_UNIFORM, -1, 1, 7, NULL, NULL));
    }
    if (dev.type != TP_DEVICE_CPU) { /* filled on the host, the same values */
        tp_tensor *xd = NULL;
        TRY(tp_tensor_to(x, tp_tensor_dtype(x), dev, &xd));
        tp_tensor_release(x);
        x = xd;
    }
    TRY(tp_comm_debug_create(&dbg));
    times = calloc((size_t)p->iters + 1, sizeof *times);
    /* it < 0: warm-up; the collectives of the last one (-1) are counted */
    for (int it = -p->warmup; it < p->iters; it++) {
        tp_tensor *y = NULL, *loss = NULL;
        TRY(tp_barrier(w, NULL));
        if (it == -1)
            TRY(tp_comm_debug_begin(dbg));
        double t0 = now_s();
        if (!p->backward)
            tp_no_grad_begin();
        st = tp_module_call(m, x, &y);
        if (!p->backward)
            tp_no_grad_end();
        if (st == TP_OK && p->backward) {
            st = tp_sum_all(y, &loss);
            if (st == TP_OK && tp_tensor_is_dtensor(loss)) {
                tp_tensor *l = NULL;
                st = tp_dtensor_to_local(loss, 0, NULL, &l);
                tp_tensor_release(loss);
                loss = l;
            }
            if (st == TP_OK)
                st = tp_backward(loss, NULL);
            tp_module_zero_grad(m);
        }
        if (st == TP_OK)
            st = device_sync(dev);
        double t1 = now_s();
        tp_tensor_release(y);
        tp_tensor_release(loss);
        if (st != TP_OK) {
            fprintf(stderr, "rank %d: %s %s\n", r, tp_status_name(st), tp_last_error());
            goto out;
        }
        if (it == -1)
            TRY(tp_comm_debug_end(dbg));
        else if (it >= 0)
            times[it] = t1 - t0;
    }
    /* the collectives of one iteration, alone, on buffers of their sizes */
    double t_coll = 0;
    if (W > 1) {
        for (int k = 0; k < TP_COLL_BARRIER; k++) {
            int64_t cnt = tp_comm_debug_count(dbg, (tp_coll_kind)k);
            if (!cnt)
                continue;
            int64_t elems = tp_comm_debug_bytes(dbg, (tp_coll_kind)k) / cnt / 4;
            elems = elems / W * W;
            int64_t part = elems / W;
            tp_tensor *a = NULL, *b = NULL;
            int64_t sa = (k == TP_COLL_ALL_GATHER) ? part : elems;
            int64_t sb = (k == TP_COLL_REDUCE_SCATTER) ? part : elems;
            TRY(tp_tensor_zeros(TP_F32, dev, 1, &sa, &a));
            TRY(tp_tensor_zeros(TP_F32, dev, 1, &sb, &b));
            double best = 1e30;
            for (int rep = 0; rep < 5; rep++) {
                TRY(tp_barrier(w, NULL));
                double t0 = now_s();
                for (int64_t c = 0; c < cnt; c++) {
                    if (k == TP_COLL_ALL_REDUCE) st = tp_all_reduce(w, a, b, TP_SUM, NULL);
                    else if (k == TP_COLL_ALL_GATHER) st = tp_all_gather(w, a, b, NULL);
                    else if (k == TP_COLL_REDUCE_SCATTER) st = tp_reduce_scatter(w, a, b, TP_SUM, NULL);
                    else if (k == TP_COLL_ALL_TO_ALL) st = tp_all_to_all(w, a, b, NULL);
                    else st = tp_broadcast(w, a, 0, NULL);
                    if (st != TP_OK)
                        break;
                }
                if (st == TP_OK)
                    st = device_sync(dev);
                double dt = now_s() - t0;
                if (st != TP_OK) {
                    fprintf(stderr, "rank %d: %s x%lld: %s (%s)\n", r, tp_coll_kind_name((tp_coll_kind)k),
                            (long long)cnt, tp_status_name(st), tp_last_error());
                    tp_tensor_release(a);
                    tp_tensor_release(b);
                    goto out;
                }
                best = dt < best ? dt : best;
            }
            t_coll += best;
            tp_tensor_release(a);
            tp_tensor_release(b);
        }
    }
    if (r == 0) {
        qsort(times, (size_t)p->iters, sizeof *times, cmp_d);
        p->t_med = times[p->iters / 2];
        p->t_coll = t_coll;
    }
out:
    free(times);
    tp_comm_debug_free(dbg);
    tp_tensor_release(x);
    tp_tensor_release(g);
    tp_module_free(m);
    tp_style_free(styles[0]);
    tp_style_free(styles[1]);
    tp_mesh_free(mesh);
    return st;
}

static tp_status body(tp_comm *w, void *arg)
{
    return run_point(w, arg);
}

#if TP_HAVE_NCCL
/* A nccl communicator over the ranks of `boot` (collective over boot). */
static tp_status nccl_over(tp_comm *boot, tp_comm **out)
{
    tp_status st = tp_comm_init("nccl", &(tp_nccl_options){.bootstrap = boot, .device = -1}, out);
    if (st != TP_OK)
        fprintf(stderr, "rank %d: tp_comm_init(\"nccl\"): %s (%s)\n", tp_comm_rank(boot),
                tp_status_name(st), tp_last_error());
    return st;
}

/* nccl over shm threads: each point makes its communicator from the threads'
 * world, outside the timed passes, and frees it after. */
static tp_status body_nccl(tp_comm *w, void *arg)
{
    tp_comm *nc = NULL;
    tp_status st = nccl_over(w, &nc);
    if (st == TP_OK)
        st = run_point(nc, arg);
    tp_comm_free(nc);
    return st;
}
#endif

/* ---- one rank per process (mpi, or nccl bootstrapped over mpi) ---------- */

typedef struct proc_world {
    tp_comm *world;
    int nr;
    tp_comm *sub[8]; /* the first ranks[i] processes; NULL on the others */
    tp_comm *run[8]; /* what points with ranks[i] ranks run on: sub[i] or its nccl comm */
} proc_world;

/* Every process learns whether any failed. The wait polls with short sleeps:
 * a process that sits out a point (fewer ranks than processes) must leave its
 * core to the ranks being timed, and MPI's own waits spin. */
static tp_status agree(tp_comm *world, tp_status mine)
{
    tp_tensor *f = NULL;
    tp_work *wk = NULL;
    int64_t one = 1, zero = 0;
    double any = 1;
    tp_status st = tp_tensor_zeros(TP_I32, TP_CPU, 1, &one, &f);
    if (st == TP_OK)
        st = tp_tensor_fill(f, mine != TP_OK);
    if (st == TP_OK)
        st = tp_all_reduce(world, f, f, TP_MAX, &wk);
    double deadline = now_s() + tp_comm_timeout(world);
    bool done = false;
    while (st == TP_OK && !done) {
        st = tp_work_test(wk, &done);
        if (st == TP_OK && !done) {
            if (now_s() > deadline) {
                st = TP_ERR_TIMEOUT;
                break;
            }
            nanosleep(&(struct timespec){.tv_nsec = 1000000}, NULL);
        }
    }
    tp_work_free(wk);
    if (st == TP_OK)
        st = tp_tensor_get(f, &zero, &any);
    tp_tensor_release(f);
    if (mine != TP_OK)
        return mine;
    if (st != TP_OK)
        return st;
    return any != 0 ? TP_ERR_ABORTED : TP_OK;
}

static tp_status proc_point(proc_world *pw, int i, point *p)
{
    tp_status st = pw->run[i] ? run_point(pw->run[i], p) : TP_OK;
    return agree(pw->world, st);
}

static tp_status proc_setup(proc_world *pw, const int64_t *ranks, int nr, bool nccl)
{
    int me = tp_comm_rank(pw->world);
    tp_status st = TP_OK;
    for (int i = 0; i < nr && st == TP_OK; i++) {
        st = tp_comm_split(pw->world, me < ranks[i] ? 0 : TP_COMM_NO_COLOR, me, &pw->sub[i]);
        pw->nr = i + 1;
        pw->run[i] = pw->sub[i];
        if (st != TP_OK) {
            fprintf(stderr, "rank %d: tp_comm_split: %s (%s)\n", me, tp_status_name(st),
                    tp_last_error());
            break;
        }
#if TP_HAVE_NCCL
        if (nccl && pw->sub[i])
            st = nccl_over(pw->sub[i], &pw->run[i]);
        st = agree(pw->world, st);
#else
        (void)nccl;
#endif
    }
    return st;
}

static void proc_free(proc_world *pw)
{
    for (int i = 0; i < pw->nr; i++) {
        if (pw->run[i] != pw->sub[i])
            tp_comm_free(pw->run[i]);
        tp_comm_free(pw->sub[i]);
    }
    tp_comm_free(pw->world);
}

static bool under_mpirun(void)
{
    return getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMI_SIZE") || getenv("PMIX_RANK");
}

/* Matrix-product flops of one pass. The input never requires grad, so the
 * backward of a single Linear computes only the weight gradient (one more
 * GEMM); in the MLP the second Linear also computes its input gradient. */
static double flops(const point *p)
{
    double T = (double)p->tokens, H = (double)p->hidden, gemm = 2 * T * H * 4 * H;
    switch (p->layer) {
    case L_COLWISE:
    case L_ROWWISE: return p->backward ? 2 * gemm : gemm;
    case L_MLP: return p->backward ? 5 * gemm : 2 * gemm;
    default: return 0; /* embeddings do no matrix products */
    }
}

static int parse_list(const char *s, int64_t *v, int max)
{
    int n = 0;
    while (*s && n < max) {
        v[n++] = strtoll(s, (char **)&s, 10);
        if (*s == ',')
            s++;
    }
    return n;
}

int main(int argc, char **argv)
{
    int64_t tokens[8] = {512, 2048}, hidden[8] = {256, 512, 1024}, ranks[8] = {1, 2};
    int nt = 2, nh = 3, nr = 2, iters = 5, warmup = 1, backend = BK_SHM, boot = -1;
    bool layers[L_COUNT] = {true, true, true, true, true}, mlp_check = false, ranks_given = false;
    const char *csv = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--mlp-check")) {
            mlp_check = true;
        } else if (i + 1 < argc && !strcmp(argv[i], "-t")) {
            nt = parse_list(argv[++i], tokens, 8);
        } else if (i + 1 < argc && !strcmp(argv[i], "-H")) {
            nh = parse_list(argv[++i], hidden, 8);
        } else if (i + 1 < argc && !strcmp(argv[i], "-g")) {
            nr = parse_list(argv[++i], ranks, 8);
            ranks_given = true;
        } else if (i + 1 < argc && !strcmp(argv[i], "-n")) {
            iters = atoi(argv[++i]);
        } else if (i + 1 < argc && !strcmp(argv[i], "-w")) {
            warmup = atoi(argv[++i]);
        } else if (i + 1 < argc && !strcmp(argv[i], "--csv")) {
            csv = argv[++i];
        } else if (i + 1 < argc && !strcmp(argv[i], "-l")) {
            const char *s = argv[++i];
            for (int l = 0; l < L_COUNT; l++)
                layers[l] = strstr(s, layer_names[l]) != NULL;
        } else if (i + 1 < argc && (!strcmp(argv[i], "--backend") || !strcmp(argv[i], "--bootstrap"))) {
            bool is_boot = !strcmp(argv[i], "--bootstrap");
            const char *name = argv[++i];
            int b = 0;
            while (b < BK_COUNT && strcmp(name, backend_names[b]))
                b++;
            if (b == BK_COUNT || (is_boot && b == BK_NCCL)) {
                fprintf(stderr, "tp-bench-layers: unknown %s '%s' (%s)\n", argv[i - 1], name,
                        is_boot ? "shm|mpi" : "shm|mpi|nccl");
                return 64;
            }
            if (is_boot)
                boot = b;
            else
                backend = b;
        } else {
            fprintf(stderr, "usage: tp-bench-layers [--backend shm|mpi|nccl] [--bootstrap shm|mpi] "
                            "[-l LAYERS] [-t T,..] [-H H,..] [-g RANKS,..] [-n ITERS] [-w WARMUP] [--csv FILE]\n"
                            "       tp-bench-layers --mlp-check\n");
            return 64;
        }
    }
    if (iters < 1 || warmup < 1 || nr < 1 || nt < 1 || nh < 1) {
        fprintf(stderr, "tp-bench-layers: -n, -w, -g, -t, -H need at least one positive value\n");
        return 64;
    }
    for (int ri = 0; ri < nr; ri++)
        if (ranks[ri] < 1) {
            fprintf(stderr, "tp-bench-layers: -g: rank counts must be >= 1\n");
            return 64;
        }
    if (boot >= 0 && backend != BK_NCCL) {
        fprintf(stderr, "tp-bench-layers: --bootstrap goes with --backend nccl\n");
        return 64;
    }
    if (mlp_check && backend != BK_SHM) {
        fprintf(stderr, "tp-bench-layers: --mlp-check runs its ranks as threads (--backend shm)\n");
        return 64;
    }
    openblas_set_num_threads(1);
    if (mlp_check) {
        /* 2048 -> 8192 -> 2048, 2048 tokens, forward + backward */
        point p1 = {.layer = L_MLP, .tokens = 2048, .hidden = 2048, .backward = true, .iters = 3, .warmup = 1};
        point p2 = p1;
        tp_status st = tp_run_local(1, body, &p1);
        if (st == TP_OK)
            st = tp_run_local(2, body, &p2);
        if (st != TP_OK) {
            fprintf(stderr, "tp-bench-layers: %s\n", tp_last_error());
            return 2;
        }
        /* the unsharded block by hand, 2 BLAS threads */
        openblas_set_num_threads(2);
        int64_t T = 2048, H = 2048, F = 8192;
        float *x = calloc((size_t)(T * H), 4), *w1 = calloc((size_t)(F * H), 4),
              *w2 = calloc((size_t)(H * F), 4), *h = calloc((size_t)(T * F), 4),
              *y = calloc((size_t)(T * H), 4), *gh = calloc((size_t)(T * F), 4),
              *gw1 = calloc((size_t)(F * H), 4), *gw2 = calloc((size_t)(H * F), 4),
              *gx = calloc((size_t)(T * H), 4);
        double best = 1e30;
        for (int it = 0; it < 4; it++) {
            double t0 = now_s();
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)T, (int)F, (int)H, 1, x, (int)H, w1, (int)H, 0, h, (int)F);
            for (int64_t i = 0; i < T * F; i++) /* gelu stand-in: same memory traffic */
                h[i] = h[i] > 0 ? h[i] : 0.01f * h[i];
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)T, (int)H, (int)F, 1, h, (int)F, w2, (int)F, 0, y, (int)H);
            /* backward with gy = ones: gw2 = gy^T h, gh = gy w2, gw1 = gh^T x, gx = gh w1 */
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)H, (int)F, (int)T, 1, y, (int)H, h, (int)F, 0, gw2, (int)F);
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)T, (int)F, (int)H, 1, y, (int)H, w2, (int)F, 0, gh, (int)F);
            for (int64_t i = 0; i < T * F; i++)
                gh[i] *= h[i] > 0 ? 1.0f : 0.01f;
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)F, (int)H, (int)T, 1, gh, (int)F, x, (int)H, 0, gw1, (int)H);
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)T, (int)H, (int)F, 1, gh, (int)F, w1, (int)H, 0, gx, (int)H);
            double dt = now_s() - t0;
            best = dt < best ? dt : best;
        }
        printf("# MLP block Linear(2048->8192) colwise -> GELU -> Linear(8192->2048) rowwise, 2048 tokens, fwd+bwd\n");
        printf("1 rank, 1 BLAS thread:        %8.1f ms\n", p1.t_med * 1e3);
        printf("2 ranks, 1 BLAS thread each:  %8.1f ms  speedup %.2fx (target >= 1.8x)\n",
               p2.t_med * 1e3, p1.t_med / p2.t_med);
        printf("unsharded by hand, 2 threads: %8.1f ms  libtp/hand %.3f (target <= 1.10)\n",
               best * 1e3, p2.t_med / best);
        free(x), free(w1), free(w2), free(h), free(y), free(gh), free(gw1), free(gw2), free(gx);
        return 0;
    }
    if (backend == BK_NCCL) {
#if !TP_HAVE_NCCL
        fprintf(stderr, "tp-bench-layers: libtp built without NCCL support\n");
        return 2;
#else
        if (tp_cuda_device_count() == 0) {
            fprintf(stderr, "tp-bench-layers: no CUDA device\n");
            return 2;
        }
#endif
    }
    if (boot < 0)
        boot = backend == BK_MPI || (backend == BK_NCCL && under_mpirun()) ? BK_MPI : BK_SHM;
    if (backend == BK_MPI)
        boot = BK_MPI;
    if (backend == BK_NCCL && boot == BK_SHM) {
        /* rank threads take GPUs 0..r-1; NCCL refuses two ranks on one GPU */
        int k = 0, ndev = tp_cuda_device_count();
        for (int ri = 0; ri < nr; ri++) {
            if (ranks[ri] <= ndev)
                ranks[k++] = ranks[ri];
            else
                fprintf(stderr, "tp-bench-layers: -g %lld skipped: %d GPU%s\n", (long long)ranks[ri],
                        ndev, ndev == 1 ? "" : "s");
        }
        nr = k;
        if (nr == 0)
            return 2;
    }

    /* one rank per process: every process runs the whole sweep */
    proc_world pw = {0};
    bool printer = true;
    int nproc = 0;
    if (boot == BK_MPI) {
        if (!tp_backend_find("mpi")) {
            fprintf(stderr, "tp-bench-layers: libtp built without MPI support\n");
            return 2;
        }
        tp_status st = tp_comm_init("mpi", NULL, &pw.world);
        if (st != TP_OK) {
            fprintf(stderr, "tp-bench-layers: tp_comm_init(\"mpi\"): %s (%s)\n", tp_status_name(st),
                    tp_last_error());
            return 2;
        }
        nproc = tp_comm_size(pw.world);
        printer = tp_comm_rank(pw.world) == 0;
        if (!ranks_given) {
            nr = nproc > 1 ? 2 : 1;
            ranks[0] = 1;
            ranks[1] = nproc;
        }
        int k = 0;
        for (int ri = 0; ri < nr; ri++) {
            if (ranks[ri] <= nproc)
                ranks[k++] = ranks[ri];
            else if (printer)
                fprintf(stderr, "tp-bench-layers: -g %lld skipped: the MPI world has %d processes\n",
                        (long long)ranks[ri], nproc);
        }
        nr = k;
        st = proc_setup(&pw, ranks, nr, backend == BK_NCCL);
        if (st != TP_OK || nr == 0) {
            proc_free(&pw);
            return 2;
        }
    }

    FILE *fcsv = csv && printer ? fopen(csv, "w") : NULL;
    if (csv && printer && !fcsv)
        perror(csv);
    if (boot == BK_MPI && agree(pw.world, csv && printer && !fcsv ? TP_ERR_INVALID_ARG : TP_OK) != TP_OK) {
        proc_free(&pw);
        return 2;
    }
    if (csv && printer && !fcsv)
        return 2;
    if (fcsv)
        fprintf(fcsv, "layer,pass,tokens,hidden,ranks,time_ms,gflops,tokens_per_s,coll_share,speedup,"
                      "backend\n");
    if (printer) {
        if (backend == BK_SHM)
            printf("# tp-bench-layers: ranks as threads, 1 BLAS thread each; median of %d after %d warm-up\n", iters, warmup);
        else if (backend == BK_MPI)
            printf("# tp-bench-layers: backend mpi, ranks as processes of a %d-process MPI world (fewer "
                   "ranks run on the first processes, the rest wait asleep), 1 BLAS thread each; "
                   "median of %d after %d warm-up\n", nproc, iters, warmup);
        else
            printf("# tp-bench-layers: backend nccl over %s, one GPU per rank (rank %% %d GPUs); "
                   "median of %d after %d warm-up\n", backend_names[boot], tp_cuda_device_count(), iters,
                   warmup);
        printf("%-8s %-8s %6s %6s %5s %10s %8s %12s %6s %7s\n", "layer", "pass", "tokens", "hidden",
               "ranks", "time(ms)", "GFLOP/s", "tokens/s", "coll%", "speedup");
        fflush(stdout);
    }
    tp_rank_fn fn = body;
#if TP_HAVE_NCCL
    if (backend == BK_NCCL)
        fn = body_nccl;
#endif
    int rc = 0;
    for (int l = 0; l < L_COUNT; l++) {
        if (!layers[l])
            continue;
        for (int bw = 0; bw < 2; bw++)
            for (int ti = 0; ti < nt; ti++)
                for (int hi = 0; hi < nh; hi++) {
                    double t1 = 0;
                    for (int ri = 0; ri < nr; ri++) {
                        point p = {.layer = l, .tokens = tokens[ti], .hidden = hidden[hi],
                                   .vocab = 8192, .backward = bw, .iters = iters, .warmup = warmup,
                                   .cuda = backend == BK_NCCL};
                        bool emb = l == L_EMB_COL || l == L_EMB_ROW;
                        if (4 * p.hidden % ranks[ri] || (emb && p.vocab % ranks[ri]) ||
                            p.hidden % ranks[ri])
                            continue;
                        tp_status st = boot == BK_MPI ? proc_point(&pw, ri, &p)
                                                      : tp_run_local((int)ranks[ri], fn, &p);
                        if (st != TP_OK) {
                            if (boot != BK_MPI)
                                fprintf(stderr, "tp-bench-layers: %s\n", tp_last_error());
                            else if (printer)
                                fprintf(stderr, "tp-bench-layers: %s %s T=%lld H=%lld on %lld ranks "
                                                "failed: %s\n", layer_names[l], bw ? "fwd+bwd" : "fwd",
                                        (long long)p.tokens, (long long)p.hidden,
                                        (long long)ranks[ri], tp_status_name(st));
                            rc = 2;
                            continue;
                        }
                        if (!printer)
                            continue;
                        if (ranks[ri] == 1)
                            t1 = p.t_med;
                        double gf = flops(&p) / p.t_med / 1e9;
                        double share = p.t_coll / p.t_med;
                        double sp = t1 > 0 ? t1 / p.t_med : 0;
                        printf("%-8s %-8s %6lld %6lld %5lld %10.3f %8.1f %12.0f %5.1f%% %7.2f\n",
                               layer_names[l], bw ? "fwd+bwd" : "fwd", (long long)p.tokens,
                               (long long)p.hidden, (long long)ranks[ri], p.t_med * 1e3, gf,
                               (double)p.tokens / p.t_med, 100 * share, sp);
                        fflush(stdout);
                        if (fcsv)
                            fprintf(fcsv, "%s,%s,%lld,%lld,%lld,%.4f,%.2f,%.0f,%.4f,%.3f,%s\n",
                                    layer_names[l], bw ? "fwd+bwd" : "fwd", (long long)p.tokens,
                                    (long long)p.hidden, (long long)ranks[ri], p.t_med * 1e3, gf,
                                    (double)p.tokens / p.t_med, share, sp, backend_names[backend]);
                    }
                }
    }
    if (fcsv)
        fclose(fcsv);
    if (boot == BK_MPI)
        proc_free(&pw);
    return rc;
}
