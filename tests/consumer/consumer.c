/*
 * consumer.c - a program that uses an installed libtp, the way an application
 * would: only <tp.h> and the library. scripts/consumer-check.sh builds it
 * through pkg-config, CMake, a Meson subproject and the Debian packages.
 *
 * On 2 ranks (threads, the shm backend):
 *   all_reduce  each rank's tensor holds rank + 1 + i/16 at element i; the
 *               sum must be 3 + 2 i/16 on both ranks
 *   colwise     Linear(IN, OUT) parallelized with ColwiseParallel: rank r's
 *               output columns must equal the same Linear's output computed
 *               on one rank (same seed, same input) within 1e-5 relative
 * Prints one line per check and the engines the library was built with; exit 0
 * when every number matches, 1 otherwise.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include <tp.h>

/* Built through CMake, the package's libtp_HAVE_CUDA/NCCL/MPI come in as
 * these (CMakeLists.txt): they must agree with the installed <tp/config.h>. */
#ifdef CONSUMER_EXPECT_CUDA
#if CONSUMER_EXPECT_CUDA != TP_HAVE_CUDA || CONSUMER_EXPECT_NCCL != TP_HAVE_NCCL || \
    CONSUMER_EXPECT_MPI != TP_HAVE_MPI
#error "libtp_HAVE_CUDA/NCCL/MPI of libtpConfig.cmake disagree with <tp/config.h>"
#endif
#endif

enum { RANKS = 2, N = 16, BATCH = 4, IN = 8, OUT = 6 };
#define SEED 2024

typedef struct shared {
    float x[BATCH * IN];    /* the Linear's input, the same on every rank */
    float ref[BATCH * OUT]; /* the Linear's output on one rank */
    double ar_err[RANKS];   /* max |all_reduce - expected| per rank */
    double lin_err[RANKS];  /* max relative error of the colwise output */
    int64_t lin_cols[RANKS];
} shared;

static void fail(const char *what, tp_status st)
{
    fprintf(stderr, "consumer: %s: %s: %s\n", what, tp_status_string(st), tp_last_error());
}

/* y[b][o] of a 2-D f32 tensor, whatever its strides. */
static float at(const tp_tensor *t, int64_t b, int64_t o)
{
    const int64_t *s = tp_tensor_strides(t);
    return ((const float *)tp_tensor_data(t))[b * s[0] + o * s[1]];
}

/* Linear(IN, OUT) initialised from SEED, applied to sh->x. */
static tp_status linear_forward(tp_module *lin, const shared *sh, tp_tensor **y)
{
    int64_t shape[2] = {BATCH, IN};
    tp_tensor *x = NULL;
    tp_status st = tp_tensor_from_data(TP_F32, 2, shape, sh->x, &x);
    if (st == TP_OK)
        st = tp_module_call(lin, x, y);
    tp_tensor_release(x);
    return st;
}

static tp_status check_all_reduce(tp_comm *world, shared *sh)
{
    int rank = tp_comm_rank(world);
    int64_t n = N;
    float v[N];
    for (int i = 0; i < N; i++)
        v[i] = (float)(rank + 1) + (float)i / 16.0f;
    tp_tensor *t = NULL;
    tp_status st = tp_tensor_from_data(TP_F32, 1, &n, v, &t);
    if (st == TP_OK)
        st = tp_all_reduce(world, t, t, TP_SUM, NULL);
    if (st == TP_OK) {
        const float *r = tp_tensor_data(t);
        double err = 0.0;
        for (int i = 0; i < N; i++)
            err = fmax(err, fabs(r[i] - (3.0 + 2.0 * i / 16.0)));
        sh->ar_err[rank] = err;
    }
    tp_tensor_release(t);
    return st;
}

static tp_status check_colwise(tp_comm *world, shared *sh)
{
    int rank = tp_comm_rank(world);
    int64_t mshape[1] = {RANKS};
    const char *names[1] = {"tp"};
    tp_mesh *mesh = NULL;
    tp_module *lin = NULL;
    tp_style *col = NULL;
    tp_tensor *y = NULL;
    tp_status st = tp_mesh_create(world, 1, mshape, names, &mesh);
    if (st == TP_OK)
        st = tp_nn_linear_create(IN, OUT, true, &lin);
    if (st == TP_OK)
        st = tp_colwise_parallel_create(NULL, &col);
    if (st == TP_OK) {
        tp_plan_entry plan[1] = {{"", col}};
        st = tp_parallelize_module(lin, mesh, 1, plan, NULL);
    }
    if (st == TP_OK)
        st = tp_module_init(lin, SEED);
    if (st == TP_OK)
        st = linear_forward(lin, sh, &y); /* this rank's columns of y */
    if (st == TP_OK) {
        int64_t cols = tp_tensor_size(y, 1);
        double err = tp_tensor_size(y, 0) == BATCH && cols == OUT / RANKS ? 0.0 : INFINITY;
        for (int64_t b = 0; b < BATCH && err < INFINITY; b++)
            for (int64_t o = 0; o < cols; o++) {
                double want = sh->ref[b * OUT + rank * cols + o];
                err = fmax(err, fabs(at(y, b, o) - want) / (1e-6 + fabs(want)));
            }
        sh->lin_cols[rank] = cols;
        sh->lin_err[rank] = err;
    }
    tp_tensor_release(y);
    tp_style_free(col);
    tp_module_free(lin);
    tp_mesh_free(mesh);
    return st;
}

static tp_status body(tp_comm *world, void *arg)
{
    tp_status st = check_all_reduce(world, arg);
    if (st == TP_OK)
        st = check_colwise(world, arg);
    if (st != TP_OK)
        fail("rank", st);
    return st;
}

/* The reference: the same Linear on one rank, no mesh. */
static int reference(shared *sh)
{
    tp_module *lin = NULL;
    tp_tensor *y = NULL;
    tp_status st = tp_nn_linear_create(IN, OUT, true, &lin);
    if (st == TP_OK)
        st = tp_module_init(lin, SEED);
    if (st == TP_OK)
        st = linear_forward(lin, sh, &y);
    if (st == TP_OK)
        for (int b = 0; b < BATCH; b++)
            for (int o = 0; o < OUT; o++)
                sh->ref[b * OUT + o] = at(y, b, o);
    tp_tensor_release(y);
    tp_module_free(lin);
    if (st != TP_OK)
        fail("reference", st);
    return st == TP_OK ? 0 : 1;
}

int main(void)
{
    static shared sh;
    for (int i = 0; i < BATCH * IN; i++)
        sh.x[i] = (float)((i * 7) % 11) / 5.0f - 1.0f;
    for (int r = 0; r < RANKS; r++)
        sh.ar_err[r] = sh.lin_err[r] = INFINITY;
    if (reference(&sh) != 0)
        return 1;
    tp_status st = tp_run_local(RANKS, body, &sh);
    if (st != TP_OK) {
        fail("tp_run_local", st);
        return 1;
    }
    int bad = 0;
    for (int r = 0; r < RANKS; r++) {
        bool ar_ok = sh.ar_err[r] == 0.0, lin_ok = sh.lin_err[r] <= 1e-5;
        printf("rank %d: all_reduce max error %g %s; colwise Linear %lld columns, max rel "
               "error %g %s\n",
               r, sh.ar_err[r], ar_ok ? "ok" : "MISMATCH", (long long)sh.lin_cols[r], sh.lin_err[r],
               lin_ok ? "ok" : "MISMATCH");
        bad += !ar_ok + !lin_ok;
    }
    printf("libtp %s (cuda %d, nccl %d, mpi %d) consumer: %s\n", TP_VERSION, TP_HAVE_CUDA,
           TP_HAVE_NCCL, TP_HAVE_MPI, bad ? "FAILED" : "ok");
    return bad ? 1 : 0;
}
