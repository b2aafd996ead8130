/*
 * tp-bench-layers: throughput of tensor-parallel Linear and Embedding layers.
 *
 * Sweeps layer x pass x tokens x hidden size x rank count and reports per
 * point: time, GFLOP/s (of the layer's matrix products), tokens/s, the share
 * of the time spent in collectives (the collectives the comm-debug counter
 * saw, re-issued alone on buffers of the same sizes and timed), the speedup
 * over one rank running the whole layer, rank 0's minor page faults per pass
 * and how many cores other processes took meanwhile. Every rank runs one BLAS
 * thread. --backend picks how ranks exist:
 *
 *   shm   threads of this process (tp_run_local), -g of them (default 1,2)
 *   mpi   one process per rank under mpirun (tp_comm_create_world("mpi")); a rank
 *         count below the process count runs on the first ranks while the
 *         others wait asleep; default -g 1,N for N processes; rank 0 prints
 *   nccl  one GPU per rank, the nccl communicator bootstrapped over the shm
 *         threads, or over the mpi world when run under mpirun
 *         (--bootstrap shm|mpi); parameters and inputs on TP_CUDA(rank % GPUs)
 *
 * One run of a point builds the layer, makes -w untimed passes, then -n timed
 * ones (a barrier before each; a pass lasts as long as its slowest rank) and
 * keeps their median. Every
 * point is run -R times (default 3); the rank counts of a point take turns run
 * by run (1 2 1 2 ...), after one untimed run of the 1-rank baseline, so a
 * change in the machine's load hits the baseline and the measured point
 * alike. A row shows the median over the runs with the min-max range; the
 * speedup is the median of the ratios inside each turn.
 *
 *   layers:  colwise   Linear(H -> 4H), ColwiseParallel
 *            rowwise   Linear(4H -> H), RowwiseParallel (input sharded)
 *            mlp       colwise -> GELU -> rowwise (the Megatron MLP block)
 *            mlp-fused the same block with the GELU fused into the first
 *                      Linear (tp_nn_linear_fuse_gelu(net1, TP_GELU_TANH):
 *                      tp_linear_gelu, on CUDA cuBLASLt's GELU_AUX_BIAS
 *                      epilogue), no GELU module; colwise, then rowwise
 *                      (not in the default)
 *            emb-col   Embedding(V, H) ColwiseParallel
 *            emb-row   Embedding(V, H) RowwiseParallel(input R)
 *            mlp-gemm  the sgemm calls of mlp's pass alone, by hand on this
 *                      rank's shards (no bias, activation, autograd or
 *                      collective): the floor for mlp and mlp-fused (not
 *                      in the default)
 *
 * With --device cuda, after the sweep: mlp and mlp-fused each against
 * mlp-gemm (bare/libtp, target >= 0.95); on any device, where mlp and
 * mlp-fused both ran: fused/unfused time, the median of the runs' ratios
 * (run r against run r) with their min-max.
 *
 * tp-bench-layers --help lists the options and their defaults;
 * tp-bench-layers --mlp-check times the MLP block 2048 -> 8192 -> 2048 on
 * 2048 tokens against its targets and exits 1 when one is missed.
 */
#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include <tp.h>

#include "bench_util.h"

#if TP_HAVE_CUDA
#include <cublas_v2.h>
#include <cuda_runtime.h>
#endif

enum { BK_SHM, BK_MPI, BK_NCCL, BK_COUNT };
static const char *backend_names[BK_COUNT] = {"shm", "mpi", "nccl"};

enum { L_COLWISE, L_ROWWISE, L_MLP, L_MLP_FUSED, L_EMB_COL, L_EMB_ROW, L_MLP_GEMM, L_COUNT };
static const char *layer_names[L_COUNT] = {"colwise", "rowwise", "mlp", "mlp-fused",
                                           "emb-col", "emb-row", "mlp-gemm"};

typedef struct {
    int layer;
    int64_t tokens, hidden, vocab;
    bool backward;
    int iters, warmup; /* timed passes (0: a warm-up run only); untimed passes before them */
    bool cuda; /* parameters, inputs and collective buffers on this rank's GPU */
    tp_dtype dtype; /* parameters and input of the Linear layers (embedding weights too) */
    bool verbose; /* rank 0 prints every pass */
    /* out (rank 0) */
    double t_med, t_coll, faults; /* median pass, collectives alone, median faults per pass */
} point;

static tp_status build(point *p, tp_mesh *mesh, int W, tp_module **root, tp_style **styles)
{
    tp_status st = TP_OK;
    int64_t H = p->hidden;
    tp_module *m = NULL, *a = NULL, *g = NULL, *b = NULL;
    tp_colwise_options co = {0};
    tp_rowwise_options ro = {0};
    switch (p->layer) {
    case L_COLWISE:
        st = tp_nn_linear_create(H, 4 * H, true, &m);
        break;
    case L_ROWWISE:
        st = tp_nn_linear_create(4 * H, H, true, &m);
        break;
    case L_MLP:
        st = tp_nn_sequential_create(&m);
        if (st == TP_OK) st = tp_nn_linear_create(H, 4 * H, true, &a);
        if (st == TP_OK) st = tp_module_add_child(m, "0", a);
        if (st == TP_OK) st = tp_nn_gelu_create(TP_GELU_TANH, &g);
        if (st == TP_OK) st = tp_module_add_child(m, "1", g);
        if (st == TP_OK) st = tp_nn_linear_create(4 * H, H, true, &b);
        if (st == TP_OK) st = tp_module_add_child(m, "2", b);
        break;
    case L_MLP_FUSED: /* mlp with the GELU inside net1: "0" fused Linear, "1" Linear */
        st = tp_nn_sequential_create(&m);
        if (st == TP_OK) st = tp_nn_linear_create(H, 4 * H, true, &a);
        if (st == TP_OK) st = tp_nn_linear_fuse_gelu(a, TP_GELU_TANH);
        if (st == TP_OK) st = tp_module_add_child(m, "0", a);
        if (st == TP_OK) st = tp_nn_linear_create(4 * H, H, true, &b);
        if (st == TP_OK) st = tp_module_add_child(m, "1", b);
        break;
    case L_EMB_COL:
    case L_EMB_ROW:
        st = tp_nn_embedding_create(p->vocab, H, &m);
        break;
    }
    if (st != TP_OK) {
        tp_module_free(m);
        return st;
    }
    if (W > 1) {
        if (p->layer == L_EMB_ROW)
            ro.input_layouts = tp_layout_of(tp_replicate());
        st = tp_colwise_parallel_create(&co, &styles[0]);
        if (st == TP_OK)
            st = tp_rowwise_parallel_create(&ro, &styles[1]);
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
        case L_MLP_FUSED:
            plan[n++] = (tp_plan_entry){"0", styles[0]};
            plan[n++] = (tp_plan_entry){"1", styles[1]};
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

/* v[i] = the largest v[i] over the ranks of w (through dev for nccl). */
static tp_status max_over_ranks(tp_comm *w, tp_device dev, double *v, int64_t n)
{
    tp_tensor *h = NULL, *d = NULL, *back = NULL;
    tp_status st = tp_tensor_from_blob(TP_F64, TP_CPU, 1, &n, v, NULL, NULL, &h);
    if (st == TP_OK && dev.type == TP_DEVICE_CPU) {
        st = tp_all_reduce(w, h, h, TP_MAX, NULL);
    } else if (st == TP_OK) {
        st = tp_tensor_to(h, TP_F64, dev, &d);
        if (st == TP_OK)
            st = tp_all_reduce(w, d, d, TP_MAX, NULL);
        if (st == TP_OK)
            st = tp_tensor_to(d, TP_F64, TP_CPU, &back);
        for (int64_t i = 0; st == TP_OK && i < n; i++)
            st = tp_tensor_get(back, &i, &v[i]);
    }
    tp_tensor_release(back);
    tp_tensor_release(d);
    tp_tensor_release(h);
    return st;
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
    if (p->dtype != TP_F32)
        TRY(tp_module_to_dtype(m, p->dtype));
    int64_t T = p->tokens, H = p->hidden;
    if (p->layer == L_EMB_COL || p->layer == L_EMB_ROW) {
        TRY(tp_tensor_zeros(TP_I64, TP_CPU, 1, &T, &x));
        TRY(tp_tensor_fill_random(x, TP_RNG_RANDINT, 0, (double)p->vocab, 7, NULL, NULL));
    } else {
        int64_t in = p->layer == L_ROWWISE ? 4 * H / W : H, xs[2] = {T, in};
        TRY(tp_tensor_zeros(p->dtype, TP_CPU, 2, xs, &x));
        TRY(tp_tensor_fill_random(x, TP_RNG_UNIFORM, -1, 1, 7, NULL, NULL));
    }
    if (dev.type != TP_DEVICE_CPU) { /* filled on the host, the same values */
        tp_tensor *xd = NULL;
        TRY(tp_tensor_to(x, tp_tensor_dtype(x), dev, &xd));
        tp_tensor_release(x);
        x = xd;
    }
    TRY(tp_comm_debug_create(&dbg));
    times = calloc(2 * ((size_t)p->iters + 1), sizeof *times);
    if (!times) {
        st = TP_ERR_NO_MEMORY;
        goto out;
    }
    double *faults = times + p->iters + 1;
    /* it < 0: warm-up; the collectives of the last one (-1) are counted. A
     * pass lies between two barriers; every rank times it from its exit of the
     * first to its exit of the second, and the pass counts as the longest of
     * these (a rank's own work alone would undercount whenever ranks do not
     * run at once: a colwise forward ends with no collective, and 4 rank
     * threads on 2 cores take turns). The second barrier is timed (about a
     * microsecond on shm). */
    for (int it = -p->warmup; it < p->iters; it++) {
        tp_tensor *y = NULL, *loss = NULL;
        TRY(tp_barrier(w, NULL));
        if (it == -1)
            TRY(tp_comm_debug_begin(dbg));
        double f0 = bench_minor_faults();
        double t0 = bench_now_s();
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
        double f1 = bench_minor_faults();
        if (st == TP_OK)
            st = tp_barrier(w, NULL);
        double t1 = bench_now_s();
        tp_tensor_release(y);
        tp_tensor_release(loss);
        if (st != TP_OK) {
            fprintf(stderr, "rank %d: %s %s\n", r, tp_status_name(st), tp_last_error());
            goto out;
        }
        if (p->verbose && r == 0)
            printf("#   %s pass %d: %.3f ms on rank 0, %.0f minor faults\n", it < 0 ? "warm-up" : "timed",
                   it < 0 ? it + p->warmup + 1 : it + 1, (t1 - t0) * 1e3, f1 - f0);
        if (it == -1)
            TRY(tp_comm_debug_end(dbg));
        else if (it >= 0) {
            times[it] = t1 - t0;
            faults[it] = f1 - f0;
        }
    }
    if (p->iters == 0) /* a warm-up run: nothing to report */
        goto out;
    if (W > 1) /* one rank: its own times (and no collective on its buffers) */
        TRY(max_over_ranks(w, dev, times, p->iters));
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
                double t0 = bench_now_s();
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
                double dt = bench_now_s() - t0;
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
        p->t_med = bench_median(times, p->iters);
        p->faults = bench_median(faults, p->iters);
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

/* The sgemm calls of one mlp pass on this rank's shards (F = 4H / W
 * columns of w1, rows of w2), with the operands and transposes libtp's
 * Linear kernels pass: forward h = x w1^T, y = a w2^T; backward gw2 = gy^T a,
 * ga = gy w2, gw1 = gh^T x (the input needs no gradient). a and gh are
 * separate buffers, as the GELU's input and output are. */
typedef struct gemm_bufs {
    float *x, *w1, *w2, *h, *a, *y, *gh, *gw1, *gw2;
} gemm_bufs;

static void gemm_pass(gemm_bufs *b, int T, int H, int F, bool backward)
{
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, F, H, 1, b->x, H, b->w1, H, 0, b->h, F);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, H, F, 1, b->a, F, b->w2, F, 0, b->y, H);
    if (!backward)
        return;
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, H, F, T, 1, b->y, H, b->a, F, 0, b->gw2,
                F);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T, F, H, 1, b->y, H, b->w2, F, 0, b->gh,
                F);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, F, H, T, 1, b->gh, F, b->x, H, 0, b->gw1,
                H);
}

/* mlp-gemm: run_point's timing (barriers, slowest rank, median) around
 * gemm_pass on buffers allocated and touched once. */
static tp_status gemm_point(tp_comm *w, point *p)
{
    tp_status st = TP_OK;
    int W = tp_comm_size(w), r = tp_comm_rank(w);
    int T = (int)p->tokens, H = (int)p->hidden, F = (int)(4 * p->hidden / W);
    size_t th = (size_t)T * (size_t)H, fh = (size_t)F * (size_t)H, tf = (size_t)T * (size_t)F;
    size_t len[9] = {th, fh, fh, tf, tf, th, tf, fh, fh};
    float *buf[9] = {0};
    double *times = calloc(2 * ((size_t)p->iters + 1), sizeof *times);
    bool ok = times != NULL;
    for (int i = 0; i < 9 && ok; i++) {
        buf[i] = calloc(len[i], sizeof(float));
        ok = buf[i] != NULL;
        for (size_t k = 0; ok && i < 3 && k < len[i]; k++) /* small values, as the layer's */
            buf[i][k] = (float)((k * 2654435761u + (size_t)i) % 1000) * 1e-4f - 0.05f;
    }
    if (!ok) {
        st = TP_ERR_NO_MEMORY;
        fprintf(stderr, "rank %d: mlp-gemm: out of memory\n", r);
        goto out;
    }
    gemm_bufs b = {buf[0], buf[1], buf[2], buf[3], buf[4], buf[5], buf[6], buf[7], buf[8]};
    double *faults = times + p->iters + 1;
    for (int it = -p->warmup; it < p->iters; it++) {
        TRY(tp_barrier(w, NULL));
        double f0 = bench_minor_faults(), t0 = bench_now_s();
        gemm_pass(&b, T, H, F, p->backward);
        double f1 = bench_minor_faults();
        TRY(tp_barrier(w, NULL));
        double t1 = bench_now_s();
        if (p->verbose && r == 0)
            printf("#   %s pass %d: %.3f ms on rank 0, %.0f minor faults\n",
                   it < 0 ? "warm-up" : "timed", it < 0 ? it + p->warmup + 1 : it + 1,
                   (t1 - t0) * 1e3, f1 - f0);
        if (it >= 0)
            times[it] = t1 - t0, faults[it] = f1 - f0;
    }
    if (p->iters == 0)
        goto out;
    TRY(max_over_ranks(w, TP_CPU, times, p->iters));
    if (r == 0) {
        p->t_med = bench_median(times, p->iters);
        p->faults = bench_median(faults, p->iters);
        p->t_coll = 0;
    }
out:
    for (int i = 0; i < 9; i++)
        free(buf[i]);
    free(times);
    return st;
}

#if TP_HAVE_CUDA
/* Row-major C[m,n] = op(A) op(B) as libtp's CUDA table issues it (column-major
 * C^T = op(B)^T op(A)^T: B first), f32 accumulation; f32 with TF32 as
 * tp_cuda_allow_tf32() says, like libtp's products. */
static bool rm_gemm(cublasHandle_t h, tp_dtype dt, bool ta, bool tb, int m, int n, int k,
                    const void *a, int lda, const void *b, int ldb, void *c, int ldc)
{
    float one = 1, zero = 0;
    cudaDataType_t t = dt == TP_BF16 ? CUDA_R_16BF : dt == TP_F16 ? CUDA_R_16F : CUDA_R_32F;
    cublasComputeType_t ct =
        dt == TP_F32 && tp_cuda_allow_tf32() ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    return cublasGemmEx(h, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, n, m, k,
                        &one, b, t, ldb, a, t, lda, &zero, c, t, ldc, ct,
                        CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS;
}

/* gemm_pass's five products with cublasGemmEx on handle h (bound to this
 * rank's stream); b's pointers are device buffers of dtype dt. */
static bool gemm_pass_cuda(cublasHandle_t h, tp_dtype dt, gemm_bufs *b, int T, int H, int F,
                           bool backward)
{
    bool ok = rm_gemm(h, dt, false, true, T, F, H, b->x, H, b->w1, H, b->h, F) &&
              rm_gemm(h, dt, false, true, T, H, F, b->a, F, b->w2, F, b->y, H);
    if (!ok || !backward)
        return ok;
    return rm_gemm(h, dt, true, false, H, F, T, b->y, H, b->a, F, b->gw2, F) &&
           rm_gemm(h, dt, false, false, T, F, H, b->y, H, b->w2, F, b->gh, F) &&
           rm_gemm(h, dt, true, false, F, H, T, b->gh, F, b->x, H, b->gw1, H);
}

/* mlp-gemm on this rank's GPU: gemm_point's timing around gemm_pass_cuda on
 * this rank's own stream and cuBLAS handle; the buffers are libtp tensors
 * (x, w1, w2 random, the rest zero), made before the timed passes. */
static tp_status gemm_point_cuda(tp_comm *w, point *p)
{
    tp_status st = TP_OK;
    int W = tp_comm_size(w), r = tp_comm_rank(w);
    tp_device dev = rank_device(w, true);
    int T = (int)p->tokens, H = (int)p->hidden, F = (int)(4 * p->hidden / W);
    int64_t shp[9][2] = {{T, H}, {F, H}, {H, F}, {T, F}, {T, F}, {T, H}, {T, F}, {F, H}, {H, F}};
    tp_tensor *t[9] = {0};
    void *ptr[9] = {0};
    cudaStream_t s = NULL;
    cublasHandle_t h = NULL;
    double *times = calloc((size_t)p->iters + 1, sizeof *times);
    if (!times) {
        st = TP_ERR_NO_MEMORY;
        goto out;
    }
    for (int i = 0; i < 9; i++) {
        TRY(tp_tensor_zeros(p->dtype, dev, 2, shp[i], &t[i]));
        if (i < 3) /* small values, as the layer's */
            TRY(tp_tensor_fill_random(t[i], TP_RNG_UNIFORM, -0.05, 0.05, (uint64_t)i + 1, NULL,
                                      NULL));
        ptr[i] = tp_tensor_data(t[i]);
    }
    TRY(tp_cuda_synchronize(dev.index)); /* the buffers are ready before another stream reads */
    if (cudaSetDevice(dev.index) != cudaSuccess || cudaStreamCreate(&s) != cudaSuccess ||
        cublasCreate(&h) != CUBLAS_STATUS_SUCCESS ||
        cublasSetStream(h, s) != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "rank %d: mlp-gemm: a CUDA stream or cuBLAS handle failed\n", r);
        st = TP_ERR_BACKEND;
        goto out;
    }
    gemm_bufs b = {ptr[0], ptr[1], ptr[2], ptr[3], ptr[4], ptr[5], ptr[6], ptr[7], ptr[8]};
    for (int it = -p->warmup; it < p->iters; it++) {
        TRY(tp_barrier(w, NULL));
        double t0 = bench_now_s();
        bool ok = gemm_pass_cuda(h, p->dtype, &b, T, H, F, p->backward) &&
                  cudaStreamSynchronize(s) == cudaSuccess;
        if (!ok) {
            fprintf(stderr, "rank %d: mlp-gemm: cublasGemmEx or the stream failed\n", r);
            st = TP_ERR_BACKEND;
            goto out;
        }
        TRY(tp_barrier(w, NULL));
        double t1 = bench_now_s();
        if (p->verbose && r == 0)
            printf("#   %s pass %d: %.3f ms on rank 0\n", it < 0 ? "warm-up" : "timed",
                   it < 0 ? it + p->warmup + 1 : it + 1, (t1 - t0) * 1e3);
        if (it >= 0)
            times[it] = t1 - t0;
    }
    if (p->iters > 0 && W > 1)
        TRY(max_over_ranks(w, TP_CPU, times, p->iters));
    if (p->iters > 0 && r == 0) {
        p->t_med = bench_median(times, p->iters);
        p->faults = 0;
        p->t_coll = 0;
    }
out:
    if (h)
        cublasDestroy(h);
    if (s)
        cudaStreamDestroy(s);
    for (int i = 0; i < 9; i++)
        tp_tensor_release(t[i]);
    free(times);
    return st;
}
#endif

static tp_status body(tp_comm *w, void *arg)
{
    point *p = arg;
    if (p->layer != L_MLP_GEMM)
        return run_point(w, p);
#if TP_HAVE_CUDA
    if (p->cuda)
        return gemm_point_cuda(w, p);
#endif
    return gemm_point(w, p);
}

#if TP_HAVE_NCCL
/* A nccl communicator over the ranks of `boot` (collective over boot). */
static tp_status nccl_over(tp_comm *boot, tp_comm **out)
{
    tp_status st = tp_comm_create_world("nccl", &(tp_nccl_options){.bootstrap = boot, .device = -1}, out);
    if (st != TP_OK)
        fprintf(stderr, "rank %d: tp_comm_create_world(\"nccl\"): %s (%s)\n", tp_comm_rank(boot),
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
    double deadline = bench_now_s() + tp_comm_timeout(world);
    bool done = false;
    while (st == TP_OK && !done) {
        st = tp_work_test(wk, &done);
        if (st == TP_OK && !done) {
            if (bench_now_s() > deadline) {
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

/* Matrix-product flops of one pass. The input never requires grad, so the
 * backward of a single Linear computes only the weight gradient (one more
 * GEMM); in the MLP the second Linear also computes its input gradient. */
static double flops(const point *p)
{
    double T = (double)p->tokens, H = (double)p->hidden, gemm = 2 * T * H * 4 * H;
    switch (p->layer) {
    case L_COLWISE:
    case L_ROWWISE: return p->backward ? 2 * gemm : gemm;
    case L_MLP:
    case L_MLP_FUSED:
    case L_MLP_GEMM:
        return p->backward ? 5 * gemm : 2 * gemm;
    default: return 0; /* embeddings do no matrix products */
    }
}

/* ---- machine state: load, other processes' CPU time --------------------- */

/* "AMD EPYC (2 cores)": /proc/cpuinfo's model name and the cores the run may
 * use, no commas (it goes in a CSV column). */
static void machine_name(char *buf, size_t len, int cores)
{
    char line[256], model[128] = "unknown CPU";
    FILE *f = fopen("/proc/cpuinfo", "r");
    while (f && fgets(line, sizeof line, f)) {
        char *c = strchr(line, ':');
        if (strncmp(line, "model name", 10) || !c)
            continue;
        c++;
        while (*c == ' ' || *c == '\t')
            c++;
        snprintf(model, sizeof model, "%s", c);
        model[strcspn(model, "\n")] = 0;
        break;
    }
    if (f)
        fclose(f);
    for (char *c = model; *c; c++)
        if (*c == ',' || *c == '"')
            *c = ' ';
    snprintf(buf, len, "%s (%d cores)", model, cores);
}

static double load1(void)
{
    double l[3] = {0};
    return bench_loadavg(l) ? l[0] : -1;
}

static void print_load(const char *when)
{
    double l[3] = {0};
    if (bench_loadavg(l))
        printf("# load average %s: %.2f %.2f %.2f (1, 5, 15 min)\n", when, l[0], l[1], l[2]);
}

/* CPU time so far: busy and stolen seconds of the whole machine (/proc/stat,
 * all CPUs) and this run's own (all its processes under mpi). */
typedef struct cpu_mark {
    double wall, busy, steal, ours;
} cpu_mark;

static double sum_over(tp_comm *world, double v)
{
    tp_tensor *t = NULL;
    int64_t one = 1, zero = 0;
    double out = v;
    if (!world)
        return v;
    if (tp_tensor_zeros(TP_F64, TP_CPU, 1, &one, &t) == TP_OK && tp_tensor_fill(t, v) == TP_OK &&
        tp_all_reduce(world, t, t, TP_SUM, NULL) == TP_OK)
        tp_tensor_get(t, &zero, &out);
    tp_tensor_release(t);
    return out;
}

static cpu_mark cpu_now(tp_comm *world)
{
    cpu_mark m = {.wall = bench_now_s()};
    struct rusage ru;
    double mine = 0;
    if (getrusage(RUSAGE_SELF, &ru) == 0)
        mine = (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec * 1e-6 +
               (double)ru.ru_stime.tv_sec + (double)ru.ru_stime.tv_usec * 1e-6;
    m.ours = sum_over(world, mine);
    FILE *f = fopen("/proc/stat", "r");
    unsigned long long v[8] = {0};
    if (f && fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu", &v[0], &v[1], &v[2], &v[3],
                    &v[4], &v[5], &v[6], &v[7]) == 8) {
        double hz = (double)sysconf(_SC_CLK_TCK);
        /* user nice system idle iowait irq softirq steal */
        m.busy = (double)(v[0] + v[1] + v[2] + v[5] + v[6]) / hz;
        m.steal = (double)v[7] / hz;
    } else {
        m.busy = m.steal = -1;
    }
    if (f)
        fclose(f);
    return m;
}

/* Cores other processes kept busy between a and b, and cores the hypervisor
 * took (steal); -1 where /proc/stat is not readable. /proc/stat counts in
 * clock ticks (10 ms), so for short intervals these are coarse. */
static void cpu_between(cpu_mark a, cpu_mark b, double *other, double *steal)
{
    double dt = b.wall - a.wall;
    if (a.busy < 0 || b.busy < 0 || dt <= 0) {
        *other = *steal = -1;
        return;
    }
    double o = (b.busy - a.busy - (b.ours - a.ours)) / dt;
    *other = o > 0 ? o : 0;
    *steal = (b.steal - a.steal) / dt;
}

/* The warnings: the ranks want `ranks` of the cores; anything else running
 * takes from them. */
static void warn_before(int64_t ranks, int cores)
{
    double l = load1();
    if (l > (double)(cores - ranks))
        printf("# WARNING: busy machine: load %.2f > %d cores - %lld ranks; other work competes "
               "with the ranks, so times move between runs: compare rows within one run, or wait "
               "for a quiet machine\n", l, cores, (long long)ranks);
}

static void warn_after(int64_t ranks, int cores, cpu_mark start, cpu_mark end)
{
    double l = load1(), other, steal;
    cpu_between(start, end, &other, &steal);
    if (other >= 0)
        printf("# during the run other processes kept %.2f cores busy on average and the "
               "hypervisor took %.2f (/proc/stat minus this run's own CPU time)\n", other, steal);
    /* the 1-minute load now includes this run's own ranks: the others' share
     * (l - ranks) outgrew the cores the ranks left free (cores - ranks), so
     * the machine was oversubscribed, exactly when l > cores */
    if (l > (double)cores || other + steal > 0.25)
        printf("# WARNING: the machine was busy during the run (load %.2f with %lld ranks of our "
               "own on %d cores; others %.2f cores): treat the figures as noisy\n", l,
               (long long)ranks, cores, other + steal);
}

/* ---- command line ------------------------------------------------------- */

enum { P_FWD, P_BWD, P_COUNT };
static const char *pass_names[P_COUNT] = {"fwd", "fwd+bwd"};

/* Untimed passes per run unless -w says otherwise. A Linear's first pass
 * faults in its fresh activations and warms BLAS; the embeddings' backward
 * runs several times slower for its first few passes (malloc's mmap threshold
 * rises only as large blocks are freed, so until then every pass maps and
 * faults in fresh pages): see bench/README.md. */
static const int default_warmup[L_COUNT] = {2, 2, 2, 2, 8, 8, 2};

#define MAX_LIST 8
#define MAX_REPS 100

typedef struct opts {
    int backend, boot;
    bool layers[L_COUNT], passes[P_COUNT];
    int64_t tokens[MAX_LIST], hidden[MAX_LIST], ranks[MAX_LIST], vocab;
    int nt, nh, nr;
    int iters, warmup, reps; /* iters, warmup: -1 = default */
    tp_dtype dtype;
    bool ranks_given, tokens_given, hidden_given, mlp_check, verbose;
    bool cuda_dev; /* --device cuda: shm ranks with everything on TP_CUDA(rank % GPUs) */
    const char *csv;
} opts;

static void usage(FILE *f)
{
    fprintf(
        f,
        "usage: tp-bench-layers [options]\n"
        "       tp-bench-layers --mlp-check [-R N] [-n N] [-w N] [-t T] [-H H] [-v]\n"
        "\n"
        "Times tensor-parallel Linear and Embedding layers for every layer, pass, token\n"
        "count, hidden size and rank count: -R runs of -w untimed and -n timed passes,\n"
        "the rank counts taking turns run by run after one untimed run of the 1-rank\n"
        "baseline. Rows show the median over runs and the min-max range. One BLAS thread\n"
        "per rank.\n"
        "\n"
        "option          meaning                                               default\n"
        "  -l LIST       layers: colwise (Linear H->4H), rowwise (4H->H),      all five\n"
        "                mlp (colwise, GELU, rowwise), emb-col, emb-row;\n"
        "                mlp-fused (mlp with the GELU fused into the\n"
        "                colwise Linear: tp_nn_linear_fuse_gelu);\n"
        "                mlp-gemm (mlp's sgemm calls alone, by hand)\n"
        "  -p LIST       passes: fwd, fwd+bwd                                  fwd,fwd+bwd\n"
        "  -t LIST       tokens                                                512,2048\n"
        "  -H LIST       hidden sizes H                                        256,512,1024\n"
        "  -V N          embedding vocabulary                                  8192\n"
        "  --dtype D     f32, bf16 or f16: the parameters and input            f32\n"
        "                (mlp-gemm: f32 only, any with --device cuda);\n"
        "                products accumulate in f32\n"
        "  --device D    cpu, or cuda: shm ranks (threads), parameters,        cpu\n"
        "                inputs and buffers on GPU rank %% GPUs (all on one GPU\n"
        "                when there is one); mlp-gemm calls cublasGemmEx on\n"
        "                each rank's stream; prints mlp and mlp-fused against\n"
        "                mlp-gemm and the GPU's peak\n"
        "  -g LIST       rank counts                                           1,2 (mpi: 1,N)\n"
        "  -n N          timed passes per run; a run is their median           5 (--mlp-check 3)\n"
        "  -w N          untimed passes before them                            Linear layers %d,\n"
        "                                                                      embeddings %d\n"
        "  -R N          runs per point (1-%d)                                 3\n"
        "  --backend B   shm (ranks as threads), mpi (one rank per process    shm\n"
        "                under mpirun), nccl (one GPU per rank)\n"
        "  --bootstrap B nccl communicators over shm threads or the mpi world  mpi under mpirun,\n"
        "                                                                      else shm\n"
        "  --csv FILE    also write the rows as CSV (one header row)           none\n"
        "  -v, --verbose print every pass of every run: time, page faults      off\n"
        "  --mlp-check   the Megatron MLP block 2048 -> 8192 -> 2048 on 2048 tokens, fwd+bwd,\n"
        "                f32: 1 rank against 2 (target: speedup >= 1.80) and 2 ranks against\n"
        "                the unsharded block by hand with 2-thread OpenBLAS (target: within\n"
        "                10%%); PASS or FAIL per target; -t and -H (first value) change the\n"
        "                shape, for quick runs (the targets are set for the default one)\n"
        "  -h, --help    this text\n"
        "\n"
        "With mlp and mlp-fused both in -l, a line per point after the sweep gives\n"
        "fused/unfused time: the median of the runs' ratios (run r against run r),\n"
        "[min .. max].\n"
        "\n"
        "LIST is comma-separated. Exit status: 0 done (all --mlp-check targets met); 1 an\n"
        "--mlp-check target missed, or with --device cuda an mlp or mlp-fused row slower\n"
        "than 0.95 of its mlp-gemm row; 2 a libtp call failed, or no CUDA device; 64 bad\n"
        "command line.\n",
        default_warmup[L_COLWISE], default_warmup[L_EMB_COL], MAX_REPS);
}

/* Positive integers separated by commas; -1 on anything else. */
static int parse_list(const char *s, int64_t *v, int max)
{
    int n = 0;
    while (*s) {
        char *end;
        long long x = strtoll(s, &end, 10);
        if (end == s || x < 1 || n == max || (*end && *end != ','))
            return -1;
        v[n++] = x;
        s = *end ? end + 1 : end;
    }
    return n;
}

/* Names from `names` separated by commas into flags; false on an unknown one. */
static bool parse_names(const char *s, const char *const *names, int count, bool *on)
{
    for (int i = 0; i < count; i++)
        on[i] = false;
    while (*s) {
        size_t len = strcspn(s, ",");
        int i = 0;
        while (i < count && (strlen(names[i]) != len || strncmp(s, names[i], len)))
            i++;
        if (i == count)
            return false;
        on[i] = true;
        s += len;
        if (*s)
            s++;
    }
    return true;
}

static int parse_args(int argc, char **argv, opts *o)
{
    *o = (opts){.backend = BK_SHM, .boot = -1, .tokens = {512, 2048}, .hidden = {256, 512, 1024},
                .ranks = {1, 2}, .vocab = 8192, .nt = 2, .nh = 3, .nr = 2, .iters = -1,
                .warmup = -1, .reps = 3};
    for (int l = 0; l < L_COUNT; l++)
        o->layers[l] = l != L_MLP_GEMM && l != L_MLP_FUSED;
    o->passes[P_FWD] = o->passes[P_BWD] = true;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        bool ok = true, takes = true;
        int vocab = 0;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--mlp-check")) {
            o->mlp_check = true, takes = false;
        } else if (!strcmp(a, "-v") || !strcmp(a, "--verbose")) {
            o->verbose = true, takes = false;
        } else if (!v) {
            fprintf(stderr, "tp-bench-layers: %s: unknown option, or its value is missing\n", a);
            usage(stderr);
            return 64;
        } else if (!strcmp(a, "-t")) {
            ok = (o->nt = parse_list(v, o->tokens, MAX_LIST)) > 0, o->tokens_given = true;
        } else if (!strcmp(a, "-H")) {
            ok = (o->nh = parse_list(v, o->hidden, MAX_LIST)) > 0, o->hidden_given = true;
        } else if (!strcmp(a, "-g")) {
            ok = (o->nr = parse_list(v, o->ranks, MAX_LIST)) > 0, o->ranks_given = true;
        } else if (!strcmp(a, "-n")) {
            ok = bench_parse_int(v, 1, 1000000, &o->iters);
        } else if (!strcmp(a, "-w")) {
            ok = bench_parse_int(v, 0, 1000000, &o->warmup);
        } else if (!strcmp(a, "-R")) {
            ok = bench_parse_int(v, 1, MAX_REPS, &o->reps);
        } else if (!strcmp(a, "-V")) {
            ok = bench_parse_int(v, 1, 1 << 30, &vocab);
            o->vocab = vocab;
        } else if (!strcmp(a, "--csv")) {
            o->csv = v;
        } else if (!strcmp(a, "--device")) {
            ok = !strcmp(v, "cpu") || !strcmp(v, "cuda");
            o->cuda_dev = !strcmp(v, "cuda");
        } else if (!strcmp(a, "--dtype")) {
            ok = !strcmp(v, "f32") || !strcmp(v, "bf16") || !strcmp(v, "f16");
            o->dtype = !strcmp(v, "bf16") ? TP_BF16 : !strcmp(v, "f16") ? TP_F16 : TP_F32;
        } else if (!strcmp(a, "-l")) {
            ok = parse_names(v, layer_names, L_COUNT, o->layers);
        } else if (!strcmp(a, "-p")) {
            ok = parse_names(v, pass_names, P_COUNT, o->passes);
        } else if (!strcmp(a, "--backend") || !strcmp(a, "--bootstrap")) {
            bool is_boot = !strcmp(a, "--bootstrap");
            int b = 0;
            while (b < BK_COUNT && strcmp(v, backend_names[b]))
                b++;
            if (b == BK_COUNT || (is_boot && b == BK_NCCL)) {
                fprintf(stderr, "tp-bench-layers: unknown %s '%s' (%s)\n", a, v,
                        is_boot ? "shm|mpi" : "shm|mpi|nccl");
                return 64;
            }
            if (is_boot)
                o->boot = b;
            else
                o->backend = b;
        } else {
            fprintf(stderr, "tp-bench-layers: %s: unknown option\n", a);
            usage(stderr);
            return 64;
        }
        if (!ok) {
            fprintf(stderr, "tp-bench-layers: %s '%s': %s\n", a, v,
                    !strcmp(a, "-l")
                        ? "layers are colwise, rowwise, mlp, mlp-fused, emb-col, emb-row, mlp-gemm"
                    : !strcmp(a, "-p")       ? "passes are fwd, fwd+bwd"
                    : !strcmp(a, "--device") ? "devices are cpu, cuda"
                    : !strcmp(a, "--dtype")  ? "dtypes are f32, bf16, f16"
                    : !strcmp(a, "-R")       ? "runs per point are 1 to 100"
                    : !strcmp(a, "-w")       ? "needs a count >= 0"
                                       : "needs positive integers (at most 8, comma-separated)");
            return 64;
        }
        i += takes;
    }
    if (o->boot >= 0 && o->backend != BK_NCCL) {
        fprintf(stderr, "tp-bench-layers: --bootstrap goes with --backend nccl\n");
        return 64;
    }
    if (o->mlp_check && o->backend != BK_SHM) {
        fprintf(stderr, "tp-bench-layers: --mlp-check runs its ranks as threads (--backend shm)\n");
        return 64;
    }
    if (o->cuda_dev && (o->backend != BK_SHM || o->mlp_check)) {
        fprintf(stderr, "tp-bench-layers: --device cuda goes with --backend shm, without "
                        "--mlp-check\n");
        return 64;
    }
    if (o->layers[L_MLP_GEMM] && o->dtype != TP_F32 && !o->cuda_dev) {
        fprintf(stderr, "tp-bench-layers: -l mlp-gemm times f32 sgemm calls (--dtype f32)\n");
        return 64;
    }
    if (o->mlp_check && o->dtype != TP_F32) {
        fprintf(stderr, "tp-bench-layers: --mlp-check is an f32 check (--dtype f32)\n");
        return 64;
    }
    if (o->layers[L_MLP_GEMM] && o->backend == BK_NCCL) {
        fprintf(stderr,
                "tp-bench-layers: -l mlp-gemm calls the CPU's sgemm (not --backend nccl)\n");
        return 64;
    }
    return -1;
}

/* ---- --mlp-check ---------------------------------------------------------- */

/* The unsharded block by hand: x[T,H] -> h = x w1^T [T,F] -> act -> y = h w2^T
 * [T,H], then the backward with gy = y: gw2 = gy^T h, gh = gy w2, act', gw1 =
 * gh^T x. The same five GEMMs as libtp's pass (the input needs no gradient,
 * so neither computes gx); a leaky ReLU stands in for GELU (the same memory
 * traffic, less arithmetic: it favours the hand-written side). No biases. */
typedef struct hand_block {
    int T, H, F;
    float *x, *w1, *w2, *h, *y, *gh, *gw1, *gw2;
} hand_block;

static void hand_free(hand_block *b)
{
    free(b->x), free(b->w1), free(b->w2), free(b->h), free(b->y), free(b->gh), free(b->gw1), free(b->gw2);
}

static bool hand_init(hand_block *b, int64_t T, int64_t H, int64_t F)
{
    *b = (hand_block){.T = (int)T, .H = (int)H, .F = (int)F};
    size_t th = (size_t)(T * H), fh = (size_t)(F * H), tf = (size_t)(T * F);
    b->x = malloc(th * 4), b->w1 = malloc(fh * 4), b->w2 = malloc(fh * 4), b->h = malloc(tf * 4);
    b->y = malloc(th * 4), b->gh = malloc(tf * 4), b->gw1 = malloc(fh * 4), b->gw2 = malloc(fh * 4);
    if (!b->x || !b->w1 || !b->w2 || !b->h || !b->y || !b->gh || !b->gw1 || !b->gw2) {
        hand_free(b);
        return false;
    }
    /* small values, every page touched once here */
    uint32_t s = 7;
    float *fill[] = {b->x, b->w1, b->w2};
    size_t n[] = {th, fh, fh};
    for (int k = 0; k < 3; k++)
        for (size_t i = 0; i < n[k]; i++) {
            s = s * 1664525u + 1013904223u;
            fill[k][i] = ((float)(s >> 8) / 16777216.0f - 0.5f) * 0.05f;
        }
    memset(b->h, 0, tf * 4), memset(b->gh, 0, tf * 4), memset(b->y, 0, th * 4);
    memset(b->gw1, 0, fh * 4), memset(b->gw2, 0, fh * 4);
    return true;
}

static double hand_pass(hand_block *b)
{
    int T = b->T, H = b->H, F = b->F;
    size_t tf = (size_t)T * (size_t)F;
    double t0 = bench_now_s();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, F, H, 1, b->x, H, b->w1, H, 0, b->h, F);
    for (size_t i = 0; i < tf; i++)
        b->h[i] = b->h[i] > 0 ? b->h[i] : 0.01f * b->h[i];
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, H, F, 1, b->h, F, b->w2, F, 0, b->y, H);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, H, F, T, 1, b->y, H, b->h, F, 0, b->gw2, F);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T, F, H, 1, b->y, H, b->w2, F, 0, b->gh, F);
    for (size_t i = 0; i < tf; i++)
        b->gh[i] *= b->h[i] > 0 ? 1.0f : 0.01f;
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, F, H, T, 1, b->gh, F, b->x, H, 0, b->gw1, H);
    return bench_now_s() - t0;
}

/* One run of the hand block: `warm` untimed passes, then the median of
 * `iters`, with 2 BLAS threads. */
static double hand_run(hand_block *b, int warm, int iters, bool verbose)
{
    double *t = calloc((size_t)iters + 1, sizeof *t);
    if (!t)
        return 0;
    openblas_set_num_threads(2);
    for (int i = 0; i < warm; i++) {
        double dt = hand_pass(b);
        if (verbose)
            printf("#   by hand warm-up pass %d: %.3f ms\n", i + 1, dt * 1e3);
    }
    for (int i = 0; i < iters; i++) {
        t[i] = hand_pass(b);
        if (verbose)
            printf("#   by hand timed pass %d: %.3f ms\n", i + 1, t[i] * 1e3);
    }
    openblas_set_num_threads(1);
    double m = bench_median(t, iters);
    free(t);
    return m;
}

static void min_max(const double *v, int n, double *lo, double *hi)
{
    *lo = *hi = n ? v[0] : 0;
    for (int i = 1; i < n; i++) {
        *lo = v[i] < *lo ? v[i] : *lo;
        *hi = v[i] > *hi ? v[i] : *hi;
    }
}

static int mlp_check(const opts *o)
{
    int64_t T = o->tokens_given ? o->tokens[0] : 2048, H = o->hidden_given ? o->hidden[0] : 2048;
    int iters = o->iters > 0 ? o->iters : 3, R = o->reps;
    int warm = o->warmup >= 0 ? o->warmup : default_warmup[L_MLP];
    const double target_speedup = 1.8, target_hand = 1.10;
    if (H % 2 || T > (1 << 20) || H > (1 << 16)) {
        fprintf(stderr, "tp-bench-layers: --mlp-check needs an even -H up to 65536 and -t up to 2^20\n");
        return 64;
    }
    hand_block hb;
    if (!hand_init(&hb, T, H, 4 * H)) {
        fprintf(stderr, "tp-bench-layers: --mlp-check: out of memory for the hand-written block\n");
        return 2;
    }
    char machine[192];
    int cores = bench_cores();
    machine_name(machine, sizeof machine, cores);
    printf("# MLP block Linear(%lld->%lld) colwise -> GELU(tanh) -> Linear(%lld->%lld) rowwise, %lld "
           "tokens, fwd+bwd, f32; %s\n", (long long)H, (long long)(4 * H), (long long)(4 * H),
           (long long)H, (long long)T, machine);
    printf("# %d runs of each configuration, taking turns (1 rank, 2 ranks, by hand) after a warm-up "
           "run of the 1-rank baseline and of the hand block; a run = median of %d timed passes "
           "after %d untimed\n", R, iters, warm);
    if (T != 2048 || H != 2048)
        printf("# NOTE: not the default shape (2048 tokens, H 2048): the targets were set for that one\n");
    print_load("before");
    warn_before(2, cores);
    fflush(stdout);
    cpu_mark c0 = cpu_now(NULL);
    openblas_set_num_threads(1);
    point p1 = {.layer = L_MLP, .tokens = T, .hidden = H, .backward = true, .iters = 0,
                .warmup = warm, .verbose = o->verbose};
    tp_status st = tp_run_local(1, body, &p1); /* warm the baseline */
    if (st == TP_OK)
        hand_run(&hb, warm, 0, o->verbose);
    double t1[MAX_REPS], t2[MAX_REPS], th[MAX_REPS], sp[MAX_REPS], rh[MAX_REPS], f1[MAX_REPS], f2[MAX_REPS];
    for (int r = 0; r < R && st == TP_OK; r++) {
        point a = p1, b = p1;
        a.iters = b.iters = iters;
        st = tp_run_local(1, body, &a);
        if (st == TP_OK)
            st = tp_run_local(2, body, &b);
        if (st != TP_OK)
            break;
        th[r] = hand_run(&hb, warm, iters, o->verbose);
        if (th[r] <= 0) {
            st = TP_ERR_NO_MEMORY;
            break;
        }
        t1[r] = a.t_med, t2[r] = b.t_med, f1[r] = a.faults, f2[r] = b.faults;
        sp[r] = t1[r] / t2[r], rh[r] = t2[r] / th[r];
        printf("# turn %d: 1 rank %.1f ms, 2 ranks %.1f ms, by hand %.1f ms: speedup %.3f, libtp/hand %.3f\n",
               r + 1, t1[r] * 1e3, t2[r] * 1e3, th[r] * 1e3, sp[r], rh[r]);
        fflush(stdout);
    }
    hand_free(&hb);
    if (st != TP_OK) {
        fprintf(stderr, "tp-bench-layers: --mlp-check: %s (%s)\n", tp_status_name(st), tp_last_error());
        return 2;
    }
    cpu_mark c1 = cpu_now(NULL);
    double lo, hi, m;
    struct {
        const char *what;
        double *v;
        double *faults;
    } rows[] = {{"1 rank, 1 BLAS thread:", t1, f1}, {"2 ranks, 1 BLAS thread each:", t2, f2},
                {"unsharded by hand, 2 threads:", th, NULL}};
    for (int i = 0; i < 3; i++) {
        min_max(rows[i].v, R, &lo, &hi);
        double tmp[MAX_REPS];
        memcpy(tmp, rows[i].v, sizeof(double) * (size_t)R);
        m = bench_median(tmp, R);
        printf("%-30s %9.1f ms  [%.1f .. %.1f]", rows[i].what, m * 1e3, lo * 1e3, hi * 1e3);
        if (rows[i].faults) {
            memcpy(tmp, rows[i].faults, sizeof(double) * (size_t)R);
            printf("  %.0f page faults per pass on rank 0", bench_median(tmp, R));
        }
        printf("\n");
    }
    int fails = 0;
    min_max(sp, R, &lo, &hi);
    m = bench_median(sp, R);
    bool ok = m >= target_speedup;
    fails += !ok;
    printf("%s  speedup, 2 ranks over 1: %.2fx (median of %d turns, range %.2f .. %.2f); target >= %.2fx\n",
           ok ? "PASS" : "FAIL", m, R, lo, hi, target_speedup);
    min_max(rh, R, &lo, &hi);
    m = bench_median(rh, R);
    ok = m <= target_hand;
    fails += !ok;
    printf("%s  2 ranks against the unsharded block by hand (2 BLAS threads): libtp/hand %.3f (median "
           "of %d turns, range %.3f .. %.3f); target <= %.2f (within %.0f%%)\n",
           ok ? "PASS" : "FAIL", m, R, lo, hi, target_hand, (target_hand - 1) * 100);
    print_load("after");
    warn_after(2, cores, c0, c1);
    return fails ? 1 : 0;
}

/* ---- the sweep ------------------------------------------------------------ */

static tp_status run_on(const opts *o, proc_world *pw, tp_rank_fn fn, int ri, point *p)
{
    return o->boot == BK_MPI ? proc_point(pw, ri, p) : tp_run_local((int)o->ranks[ri], fn, p);
}

/* A failed run of point p on W ranks, on stderr. Under mpi rank 0 speaks for
 * every process (each printed its own error); on threads, tp_run_local has
 * copied the failing rank's message into this thread's tp_last_error(). */
static void run_failed(const opts *o, bool printer, const point *p, int64_t W, const char *what,
                       tp_status st)
{
    if (!printer)
        return;
    fprintf(stderr, "tp-bench-layers: %s %s T=%lld H=%lld, %s on %lld rank%s failed: %s",
            layer_names[p->layer], pass_names[p->backward], (long long)p->tokens,
            (long long)p->hidden, what, (long long)W, W == 1 ? "" : "s", tp_status_name(st));
    if (o->boot != BK_MPI)
        fprintf(stderr, " (%s)", tp_last_error());
    fprintf(stderr, "\n");
}

/* ---- --device cuda: the GPU's name and peak, mlp against mlp-gemm --------- */

/* The mlp-like rows: mlp (0), mlp-gemm (1), mlp-fused (2). */
enum { M_MLP, M_GEMM, M_FUSED, M_COUNT };

static int mlp_kind(int layer)
{
    return layer == L_MLP ? M_MLP : layer == L_MLP_GEMM ? M_GEMM : layer == L_MLP_FUSED ? M_FUSED : -1;
}

/* Their medians and every run's time, by kind, pass, tokens, hidden and rank
 * count index; 0 where not run (or a run failed). */
typedef struct mlp_medians {
    double med[M_COUNT][P_COUNT][MAX_LIST][MAX_LIST][MAX_LIST];
    double run[M_COUNT][P_COUNT][MAX_LIST][MAX_LIST][MAX_LIST][MAX_REPS];
} mlp_medians;

/* GPU 0's name (commas dropped), or "unknown GPU". */
static void gpu_name(char *buf, size_t len)
{
    snprintf(buf, len, "unknown GPU");
#if TP_HAVE_CUDA
    struct cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess)
        snprintf(buf, len, "%s", prop.name);
#endif
    for (char *c = buf; *c; c++)
        if (*c == ',')
            *c = ' ';
}

/* Per point with an mlp or mlp-fused row and an mlp-gemm row: bare (mlp-gemm)
 * time over libtp's (target >= 0.95) and libtp's TFLOP/s against the GPU's
 * dense peak. The rows' medians come from separate runs of the sweep. false
 * if a target is missed. */
static bool print_mlp_vs_gemm(const opts *o, const mlp_medians *med, const char *gpu)
{
    const char *kind = o->dtype == TP_F32 ? (tp_cuda_allow_tf32() ? "tf32" : "f32") : "bf16";
    double peak = bench_gpu_peak_tflops(gpu, kind);
    bool all = true;
    if (peak > 0)
        printf("# %s: dense %s peak %.1f TFLOP/s\n", gpu, kind, peak);
    else
        printf("# %s: peak unknown\n", gpu);
    static const int libtp_kinds[2] = {M_MLP, M_FUSED};
    for (int bw = 0; bw < P_COUNT; bw++)
        for (int ti = 0; ti < o->nt; ti++)
            for (int hi = 0; hi < o->nh; hi++)
                for (int ri = 0; ri < o->nr; ri++)
                    for (int kk = 0; kk < 2; kk++) {
                        int mk = libtp_kinds[kk];
                        double tl = med->med[mk][bw][ti][hi][ri], tb = med->med[M_GEMM][bw][ti][hi][ri];
                        if (tl <= 0 || tb <= 0)
                            continue;
                        point p = {.layer = mk == M_FUSED ? L_MLP_FUSED : L_MLP,
                                   .tokens = o->tokens[ti],
                                   .hidden = o->hidden[hi],
                                   .backward = bw};
                        double tf = flops(&p) / tl / 1e12, ratio = tb / tl;
                        char pk[32] = "peak unknown";
                        if (peak > 0)
                            snprintf(pk, sizeof pk, "%.1f%% of peak", 100 * tf / peak);
                        printf("# %s vs mlp-gemm %s T=%lld H=%lld ranks %lld: libtp %.3f ms, bare "
                               "%.3f ms, bare/libtp %.3f (target >= 0.95) %s; libtp %.1f TFLOP/s, "
                               "%s\n",
                               layer_names[p.layer], pass_names[bw], (long long)p.tokens,
                               (long long)p.hidden, (long long)o->ranks[ri], tl * 1e3, tb * 1e3,
                               ratio, ratio >= 0.95 ? "PASS" : "FAIL", tf, pk);
                        all = all && ratio >= 0.95;
                    }
    return all;
}

/* Per point with both an mlp and an mlp-fused row (any device): fused/unfused
 * time, the median of the runs' ratios (run r of mlp-fused over run r of mlp)
 * with their min-max, as the rows' speedup. The layers run one after the other
 * in the sweep, so run r of the two is not a turn: the range holds the drift
 * of the machine between them too. */
static void print_fused_vs_mlp(const opts *o, const mlp_medians *med)
{
    int R = o->reps;
    for (int bw = 0; bw < P_COUNT; bw++)
        for (int ti = 0; ti < o->nt; ti++)
            for (int hi = 0; hi < o->nh; hi++)
                for (int ri = 0; ri < o->nr; ri++) {
                    double tu = med->med[M_MLP][bw][ti][hi][ri], tf = med->med[M_FUSED][bw][ti][hi][ri];
                    if (tu <= 0 || tf <= 0)
                        continue;
                    const double *ru = med->run[M_MLP][bw][ti][hi][ri];
                    const double *rf = med->run[M_FUSED][bw][ti][hi][ri];
                    double v[MAX_REPS], lo, hi_;
                    for (int r = 0; r < R; r++)
                        v[r] = rf[r] / ru[r];
                    min_max(v, R, &lo, &hi_);
                    double m = bench_median(v, R);
                    printf("# mlp-fused vs mlp %s T=%lld H=%lld ranks %lld: mlp %.3f ms, mlp-fused "
                           "%.3f ms, fused/unfused %.3f [%.3f .. %.3f] (median of %d runs' ratios)\n",
                           pass_names[bw], (long long)o->tokens[ti], (long long)o->hidden[hi],
                           (long long)o->ranks[ri], tu * 1e3, tf * 1e3, m, lo, hi_, R);
                }
}

int main(int argc, char **argv)
{
    opts o;
    int rc = parse_args(argc, argv, &o);
    if (rc >= 0)
        return rc;
    rc = 0;
    openblas_set_num_threads(1);
    if (o.mlp_check)
        return mlp_check(&o);
    if (o.cuda_dev && tp_cuda_device_count() == 0) {
        fprintf(stderr, "tp-bench-layers: --device cuda: no CUDA device\n");
        return 2;
    }
    if (o.backend == BK_NCCL) {
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
    if (o.boot < 0)
        o.boot = o.backend == BK_MPI || (o.backend == BK_NCCL && bench_under_mpirun()) ? BK_MPI : BK_SHM;
    if (o.backend == BK_MPI)
        o.boot = BK_MPI;
    if (o.backend == BK_NCCL && o.boot == BK_SHM) {
        /* rank threads take GPUs 0..r-1; NCCL refuses two ranks on one GPU */
        int k = 0, ndev = tp_cuda_device_count();
        for (int ri = 0; ri < o.nr; ri++) {
            if (o.ranks[ri] <= ndev)
                o.ranks[k++] = o.ranks[ri];
            else
                fprintf(stderr, "tp-bench-layers: -g %lld skipped: %d GPU%s\n", (long long)o.ranks[ri],
                        ndev, ndev == 1 ? "" : "s");
        }
        o.nr = k;
        if (o.nr == 0)
            return 2;
    }

    /* one rank per process: every process runs the whole sweep */
    proc_world pw = {0};
    bool printer = true;
    int nproc = 0;
    if (o.boot == BK_MPI) {
        if (!tp_backend_find("mpi")) {
            fprintf(stderr, "tp-bench-layers: libtp built without MPI support\n");
            return 2;
        }
        tp_status st = tp_comm_create_world("mpi", NULL, &pw.world);
        if (st != TP_OK) {
            fprintf(stderr, "tp-bench-layers: tp_comm_create_world(\"mpi\"): %s (%s)\n", tp_status_name(st),
                    tp_last_error());
            return 2;
        }
        nproc = tp_comm_size(pw.world);
        printer = tp_comm_rank(pw.world) == 0;
        if (!o.ranks_given) {
            o.nr = nproc > 1 ? 2 : 1;
            o.ranks[0] = 1;
            o.ranks[1] = nproc;
        }
        int k = 0;
        for (int ri = 0; ri < o.nr; ri++) {
            if (o.ranks[ri] <= nproc)
                o.ranks[k++] = o.ranks[ri];
            else if (printer)
                fprintf(stderr, "tp-bench-layers: -g %lld skipped: the MPI world has %d processes\n",
                        (long long)o.ranks[ri], nproc);
        }
        o.nr = k;
        st = proc_setup(&pw, o.ranks, o.nr, o.backend == BK_NCCL);
        if (st != TP_OK || o.nr == 0) {
            proc_free(&pw);
            return 2;
        }
    }

    FILE *fcsv = o.csv && printer ? fopen(o.csv, "w") : NULL;
    if (o.csv && printer && !fcsv)
        perror(o.csv);
    if (o.boot == BK_MPI && agree(pw.world, o.csv && printer && !fcsv ? TP_ERR_INVALID_ARG : TP_OK) != TP_OK) {
        proc_free(&pw);
        return 2;
    }
    if (o.csv && printer && !fcsv)
        return 2;

    char gpu[256] = "";
    static mlp_medians med; /* zero: nothing run yet */
    if (o.cuda_dev)
        gpu_name(gpu, sizeof gpu);
    int64_t maxr = 1;
    for (int ri = 0; ri < o.nr; ri++)
        maxr = o.ranks[ri] > maxr ? o.ranks[ri] : maxr;
    char machine[192], warm_desc[64];
    /* under mpi every process calls it (collective) */
    int cores = o.boot == BK_MPI ? bench_world_cores(pw.world) : bench_cores();
    machine_name(machine, sizeof machine, cores);
    if (o.warmup >= 0)
        snprintf(warm_desc, sizeof warm_desc, "%d", o.warmup);
    else
        snprintf(warm_desc, sizeof warm_desc, "%d (Linear layers) or %d (embeddings)",
                 default_warmup[L_COLWISE], default_warmup[L_EMB_COL]);
    int iters = o.iters > 0 ? o.iters : 5;
    if (fcsv)
        fprintf(fcsv, "layer,pass,tokens,hidden,ranks,time_ms,gflops,tokens_per_s,coll_share,speedup,"
                      "backend,time_min_ms,time_max_ms,gflops_min,gflops_max,speedup_min,speedup_max,"
                      "runs,iters,warmup,blas_threads,vocab,faults_per_pass,other_cores,steal_cores,"
                      "dtype,load_before,machine\n");
    double load_before = load1();
    if (printer) {
        if (o.backend == BK_SHM && o.cuda_dev)
            printf("# tp-bench-layers: backend shm, ranks as threads on GPU rank %% %d (%s); %s\n",
                   tp_cuda_device_count(), gpu, machine);
        else if (o.backend == BK_SHM)
            printf("# tp-bench-layers: backend shm, ranks as threads, 1 BLAS thread each; %s\n", machine);
        else if (o.backend == BK_MPI)
            printf("# tp-bench-layers: backend mpi, ranks as processes of a %d-process MPI world (fewer "
                   "ranks run on the first processes, the rest wait asleep), 1 BLAS thread each; %s\n",
                   nproc, machine);
        else
            printf("# tp-bench-layers: backend nccl over %s, one GPU per rank (rank %% %d GPUs); %s\n",
                   backend_names[o.boot], tp_cuda_device_count(), machine);
        printf("# per point: %d runs, the rank counts taking turns after an untimed run of the 1-rank "
               "baseline; a run = median of %d timed passes after %s untimed; rows: median over runs "
               "[min .. max]; speedup = median of the ratios inside each turn\n", o.reps, iters, warm_desc);
        printf("# faults: rank 0's minor page faults per pass; other: cores that other processes (and "
               "the hypervisor) took during the point\n");
        printf("# dtype %s (parameters and input; products and sums accumulate in f32)\n",
               tp_dtype_name(o.dtype));
        print_load("before");
        warn_before(maxr, cores);
        printf("%-9s %-8s %6s %6s %5s %10s %21s %8s %7s %14s %6s %7s %5s\n", "layer", "pass", "tokens",
               "hidden", "ranks", "time(ms)", "[min .. max]", "GFLOP/s", "speedup", "[min .. max]",
               "coll%", "faults", "other");
        fflush(stdout);
    }
    tp_rank_fn fn = body;
#if TP_HAVE_NCCL
    if (o.backend == BK_NCCL)
        fn = body_nccl;
#endif
    int R = o.reps;
    cpu_mark sweep0 = cpu_now(pw.world);
    for (int l = 0; l < L_COUNT; l++) {
        if (!o.layers[l])
            continue;
        bool emb = l == L_EMB_COL || l == L_EMB_ROW;
        for (int bw = 0; bw < P_COUNT; bw++) {
            if (!o.passes[bw])
                continue;
            for (int ti = 0; ti < o.nt; ti++)
                for (int hi = 0; hi < o.nh; hi++) {
                    point p0 = {.layer = l,
                                .tokens = o.tokens[ti],
                                .hidden = o.hidden[hi],
                                .vocab = o.vocab,
                                .backward = bw,
                                .iters = iters,
                                .warmup = o.warmup >= 0 ? o.warmup : default_warmup[l],
                                .cuda = o.backend == BK_NCCL || o.cuda_dev,
                                .dtype = o.dtype,
                                .verbose = o.verbose && printer};
                    int idx[MAX_LIST], k = 0, base = -1;
                    for (int ri = 0; ri < o.nr; ri++) {
                        int64_t W = o.ranks[ri];
                        if (4 * p0.hidden % W || p0.hidden % W || (emb && p0.vocab % W))
                            continue;
                        if (W == 1)
                            base = k;
                        idx[k++] = ri;
                    }
                    if (!k)
                        continue;
                    double t[MAX_LIST][MAX_REPS], share[MAX_LIST][MAX_REPS], flt[MAX_LIST][MAX_REPS];
                    bool failed[MAX_LIST] = {0};
                    cpu_mark c0 = cpu_now(pw.world);
                    if (base >= 0 && k > 1) { /* warm the baseline */
                        point pw0 = p0;
                        pw0.iters = 0;
                        if (pw0.verbose)
                            printf("# %s %s T=%lld H=%lld: warm-up run of the 1-rank baseline\n",
                                   layer_names[l], pass_names[bw], (long long)p0.tokens,
                                   (long long)p0.hidden);
                        tp_status st = run_on(&o, &pw, fn, idx[base], &pw0);
                        if (st != TP_OK) {
                            failed[base] = true;
                            run_failed(&o, printer, &pw0, 1, "warm-up run", st);
                            rc = 2;
                        }
                    }
                    for (int r = 0; r < R; r++)
                        for (int j = 0; j < k; j++) {
                            if (failed[j])
                                continue;
                            point p = p0;
                            if (p.verbose)
                                printf("# %s %s T=%lld H=%lld ranks %lld, run %d\n", layer_names[l],
                                       pass_names[bw], (long long)p.tokens, (long long)p.hidden,
                                       (long long)o.ranks[idx[j]], r + 1);
                            tp_status st = run_on(&o, &pw, fn, idx[j], &p);
                            if (st != TP_OK) {
                                failed[j] = true;
                                run_failed(&o, printer, &p, o.ranks[idx[j]], "run", st);
                                rc = 2;
                                continue;
                            }
                            t[j][r] = p.t_med;
                            share[j][r] = p.t_coll / p.t_med;
                            flt[j][r] = p.faults;
                        }
                    cpu_mark c1 = cpu_now(pw.world);
                    if (!printer)
                        continue;
                    double other, steal;
                    cpu_between(c0, c1, &other, &steal);
                    for (int j = 0; j < k; j++) {
                        if (failed[j])
                            continue;
                        int64_t W = o.ranks[idx[j]];
                        double v[MAX_REPS], tmin, tmax, smin = 0, smax = 0, sp = 0;
                        min_max(t[j], R, &tmin, &tmax);
                        memcpy(v, t[j], sizeof(double) * (size_t)R);
                        double tmed = bench_median(v, R);
                        int mk = mlp_kind(l);
                        if (mk >= 0) {
                            med.med[mk][bw][ti][hi][idx[j]] = tmed;
                            memcpy(med.run[mk][bw][ti][hi][idx[j]], t[j], sizeof(double) * (size_t)R);
                        }
                        bool has_sp = base >= 0 && !failed[base];
                        if (has_sp) {
                            for (int r = 0; r < R; r++)
                                v[r] = t[base][r] / t[j][r];
                            min_max(v, R, &smin, &smax);
                            sp = bench_median(v, R);
                        }
                        memcpy(v, share[j], sizeof(double) * (size_t)R);
                        double sh = bench_median(v, R);
                        memcpy(v, flt[j], sizeof(double) * (size_t)R);
                        double fl = bench_median(v, R);
                        double fp = flops(&p0);
                        char gf[16] = "-", spb[16] = "-", spr[32] = "", oth[16] = "?";
                        if (fp > 0)
                            snprintf(gf, sizeof gf, "%.1f", fp / tmed / 1e9);
                        if (has_sp) {
                            snprintf(spb, sizeof spb, "%.2f", sp);
                            snprintf(spr, sizeof spr, "[%.2f .. %.2f]", smin, smax);
                        }
                        if (other >= 0)
                            snprintf(oth, sizeof oth, "%.2f", other + steal);
                        printf("%-9s %-8s %6lld %6lld %5lld %10.3f [%8.3f .. %8.3f] %8s %7s %14s %5.1f%% "
                               "%7.0f %5s\n", layer_names[l], pass_names[bw], (long long)p0.tokens,
                               (long long)p0.hidden, (long long)W, tmed * 1e3, tmin * 1e3, tmax * 1e3, gf,
                               spb, spr, 100 * sh, fl, oth);
                        fflush(stdout);
                        if (fcsv) {
                            fprintf(fcsv, "%s,%s,%lld,%lld,%lld,%.4f,%.2f,%.0f,%.4f,", layer_names[l],
                                    pass_names[bw], (long long)p0.tokens, (long long)p0.hidden,
                                    (long long)W, tmed * 1e3, fp / tmed / 1e9,
                                    (double)p0.tokens / tmed, sh);
                            if (has_sp)
                                fprintf(fcsv, "%.3f", sp);
                            fprintf(fcsv, ",%s,%.4f,%.4f,%.2f,%.2f,", backend_names[o.backend],
                                    tmin * 1e3, tmax * 1e3, fp / tmax / 1e9, fp / tmin / 1e9);
                            if (has_sp)
                                fprintf(fcsv, "%.3f,%.3f", smin, smax);
                            else
                                fprintf(fcsv, ",");
                            fprintf(fcsv, ",%d,%d,%d,1,%lld,%.0f,", R, p0.iters, p0.warmup,
                                    (long long)p0.vocab, fl);
                            if (other >= 0)
                                fprintf(fcsv, "%.3f,%.3f", other, steal);
                            else
                                fprintf(fcsv, ",");
                            fprintf(fcsv, ",%s,%.2f,%s\n", tp_dtype_name(o.dtype), load_before,
                                    machine);
                            fflush(fcsv);
                        }
                    }
                }
        }
    }
    cpu_mark sweep1 = cpu_now(pw.world);
    if (printer && o.cuda_dev && !print_mlp_vs_gemm(&o, &med, gpu) && rc == 0)
        rc = 1;
    if (printer)
        print_fused_vs_mlp(&o, &med);
    if (printer) {
        print_load("after");
        warn_after(maxr, cores, sweep0, sweep1);
    }
    if (fcsv)
        fclose(fcsv);
    if (o.boot == BK_MPI)
        proc_free(&pw);
    return rc;
}
