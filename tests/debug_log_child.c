/* The program test_debug_log runs with TP_DEBUG and TP_DEBUG_FILE set (the
 * level is read once per process, so each setting needs a process of its
 * own).
 *
 *   debug_log_child mlp N   N rank threads: a colwise+rowwise MLP built,
 *                           parallelized (parameters sent from rank 0), run
 *                           forward and backward, all under a comm-debug
 *                           counter; prints per rank
 *                           "rank R total T kinds K0 K1 ... bytes B"
 *   debug_log_child fail    one rank: a rejected all_reduce (the WARN line)
 *
 * First line of stdout: "pid P". Exit status 0 when everything ran as
 * expected. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <tp.h>

#define MAX_RANKS 8
enum { BATCH = 4, IN = 6, HIDDEN = 6, OUT = 5 };

typedef struct {
    int64_t total, bytes, kinds[TP_COLL_KIND_COUNT];
    tp_status st;
    char err[512];
} rank_result;

static rank_result results[MAX_RANKS];

#define TRY(expr)                                                               \
    do {                                                                        \
        st = (expr);                                                            \
        if (st != TP_OK) {                                                      \
            snprintf(res->err, sizeof res->err, "%s: %s (%s)", #expr,           \
                     tp_status_name(st), tp_last_error());                      \
            goto out;                                                           \
        }                                                                       \
    } while (0)

static tp_status mlp_forward(tp_module *self, int nargs, tp_tensor *const *args, int nkw,
                             const tp_kwarg *kw, tp_tensor **out)
{
    (void)nargs;
    (void)nkw;
    (void)kw;
    tp_tensor *h = NULL, *a = NULL;
    tp_status st = tp_module_call(tp_module_child(self, "net1"), args[0], &h);
    if (st == TP_OK)
        st = tp_module_call(tp_module_child(self, "relu"), h, &a);
    if (st == TP_OK)
        st = tp_module_call(tp_module_child(self, "net2"), a, out);
    tp_tensor_release(h);
    tp_tensor_release(a);
    return st;
}

/* Hangs *child (just made, with status `made`) under parent. */
static tp_status add(tp_module *parent, const char *name, tp_status made, tp_module **child)
{
    if (made != TP_OK)
        return made;
    tp_status st = tp_module_add_child(parent, name, *child);
    if (st != TP_OK)
        tp_module_free(*child);
    *child = NULL;
    return st;
}

static tp_status mlp_rank(tp_comm *world, void *arg)
{
    (void)arg;
    int r = tp_comm_rank(world);
    rank_result *res = &results[r];
    tp_status st = TP_OK;
    tp_comm_debug *dbg = NULL;
    tp_mesh *mesh = NULL;
    tp_module *m = NULL, *c = NULL;
    tp_style *col = NULL, *row = NULL;
    tp_tensor *x = NULL, *y = NULL, *loss = NULL;
    /* everything this rank issues is counted, so the log must show as many */
    TRY(tp_comm_debug_create(&dbg));
    TRY(tp_comm_debug_begin(dbg));
    int64_t n = tp_comm_size(world);
    TRY(tp_mesh_create(world, 1, &n, (const char *[]){"tp"}, &mesh));
    TRY(tp_nn_custom_create("MLP", mlp_forward, NULL, NULL, &m));
    TRY(add(m, "net1", tp_nn_linear_create(IN, HIDDEN, true, &c), &c));
    TRY(add(m, "relu", tp_nn_relu_create(&c), &c));
    TRY(add(m, "net2", tp_nn_linear_create(HIDDEN, OUT, true, &c), &c));
    TRY(tp_module_init(m, 7));
    TRY(tp_colwise_parallel_create(&(tp_colwise_options){0}, &col));
    TRY(tp_rowwise_parallel_create(&(tp_rowwise_options){0}, &row));
    const tp_plan_entry plan[] = {{"net1", col}, {"net2", row}};
    TRY(tp_parallelize_module(m, mesh, 2, plan, NULL));
    /* a plain input the colwise style takes as Replicate */
    TRY(tp_tensor_zeros(TP_F32, TP_CPU, 2, (int64_t[]){BATCH, IN}, &x));
    TRY(tp_tensor_fill_random(x, TP_RNG_UNIFORM, -1, 1, 3, NULL, NULL));
    TRY(tp_tensor_set_requires_grad(x, true));
    TRY(tp_module_call(m, x, &y));
    TRY(tp_sum_all(y, &loss));
    tp_comm_debug_set_phase(TP_PHASE_BACKWARD);
    TRY(tp_backward(loss, NULL));
    tp_comm_debug_set_phase(TP_PHASE_FORWARD);
    TRY(tp_comm_debug_end(dbg));
    res->total = tp_comm_debug_total(dbg);
    res->bytes = tp_comm_debug_bytes(dbg, TP_COLL_ANY);
    for (int k = 0; k < TP_COLL_KIND_COUNT; k++)
        res->kinds[k] = tp_comm_debug_count(dbg, (tp_coll_kind)k);
out:
    res->st = st;
    tp_tensor_release(loss);
    tp_tensor_release(y);
    tp_tensor_release(x);
    tp_style_free(col);
    tp_style_free(row);
    tp_module_free(m);
    tp_mesh_free(mesh);
    tp_comm_debug_free(dbg);
    return st;
}

static tp_status fail_rank(tp_comm *world, void *arg)
{
    (void)arg;
    tp_tensor *a = NULL, *b = NULL;
    tp_status st = tp_tensor_zeros(TP_F32, TP_CPU, 1, (int64_t[]){4}, &a);
    if (st == TP_OK)
        st = tp_tensor_zeros(TP_F32, TP_CPU, 1, (int64_t[]){5}, &b);
    tp_status bad = st == TP_OK ? tp_all_reduce(world, a, b, TP_SUM, NULL) : st;
    tp_tensor_release(a);
    tp_tensor_release(b);
    return bad == TP_ERR_INVALID_ARG ? TP_OK : TP_ERR_STATE;
}

int main(int argc, char **argv)
{
    printf("pid %d\n", (int)getpid());
    if (argc == 3 && strcmp(argv[1], "mlp") == 0) {
        int n = atoi(argv[2]);
        if (n < 1 || n > MAX_RANKS)
            return 64;
        tp_status st = tp_run_local(n, mlp_rank, NULL);
        for (int r = 0; r < n; r++) {
            rank_result *res = &results[r];
            if (res->st != TP_OK) {
                fprintf(stderr, "rank %d: %s\n", r, res->err);
                continue;
            }
            printf("rank %d total %lld kinds", r, (long long)res->total);
            for (int k = 0; k < TP_COLL_KIND_COUNT; k++)
                printf(" %lld", (long long)res->kinds[k]);
            printf(" bytes %lld\n", (long long)res->bytes);
        }
        return st == TP_OK ? 0 : 1;
    }
    if (argc == 2 && strcmp(argv[1], "fail") == 0)
        return tp_run_local(1, fail_rank, NULL) == TP_OK ? 0 : 1;
    fprintf(stderr, "usage: debug_log_child mlp N | fail\n");
    return 64;
}
