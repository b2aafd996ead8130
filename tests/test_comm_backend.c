/* User-written backends are first-class: registered by name, wrapped in a
 * tp_comm, driven through the same validation, async work and descriptor
 * check as the built-in ones. */
#include <pthread.h>
#include <stdlib.h>

#include "tp_test.h"

/* ---- a world of one whose work objects count how they are driven --------- */
/* (the custom process group of the data-parallel seed test) */

typedef struct {
    int collectives, waits, tests, frees;
} counting_state;

typedef struct {
    counting_state *st;
    int polls_left; /* reports "not done" this many times */
} counting_work;

static tp_status counting_collective(void *state, const tp_coll_desc *d, void **work)
{
    counting_state *s = state;
    s->collectives++;
    if (d->kind == TP_COLL_ALL_REDUCE && d->sendbuf != d->recvbuf)
        memcpy(d->recvbuf, d->sendbuf, d->count * tp_dtype_size(d->dtype));
    counting_work *w = calloc(1, sizeof *w);
    if (!w)
        return TP_ERR_NO_MEMORY;
    w->st = s;
    w->polls_left = 2;
    *work = w;
    return TP_OK;
}

static tp_status counting_test(void *state, void *work, bool *done)
{
    (void)state;
    counting_work *w = work;
    w->st->tests++;
    *done = w->polls_left-- <= 0;
    return TP_OK;
}

static tp_status counting_wait(void *state, void *work, double timeout_s)
{
    (void)state;
    (void)timeout_s;
    ((counting_work *)work)->st->waits++;
    return TP_OK;
}

static void counting_free(void *state, void *work)
{
    (void)state;
    counting_work *w = work;
    w->st->frees++;
    free(w);
}

static const tp_backend counting_backend = {
    .name = "counting",
    .device_mask = 1u << TP_DEVICE_CPU,
    .collective = counting_collective,
    .work_test = counting_test,
    .work_wait = counting_wait,
    .work_free = counting_free,
};

Test(comm_backend, world_of_one_counts_waits, .timeout = 10)
{
    counting_state s = {0};
    tp_comm *c = NULL;
    cr_assert_eq(tp_comm_create(&counting_backend, &s, 0, 1, &c), TP_OK, "%s", tp_last_error());
    cr_assert_str_eq(tp_comm_backend(c), "counting");
    int64_t n = 5;
    tp_tensor *x = NULL, *y = NULL;
    cr_assert_eq(tp_tensor_zeros(TP_F32, TP_CPU, 1, &n, &x), TP_OK);
    cr_assert_eq(tp_tensor_zeros(TP_F32, TP_CPU, 1, &n, &y), TP_OK);
    cr_assert_eq(tp_tensor_fill(x, 3), TP_OK);

    tp_comm_debug *dbg = NULL;
    cr_assert_eq(tp_comm_debug_create(&dbg), TP_OK);
    cr_assert_eq(tp_comm_debug_begin(dbg), TP_OK);

    tp_work *w = NULL;
    cr_assert_eq(tp_all_reduce(c, x, y, TP_SUM, &w), TP_OK, "%s", tp_last_error());
    bool done = false;
    while (!done)
        cr_assert_eq(tp_work_test(w, &done), TP_OK);
    cr_assert_eq(tp_work_wait(w), TP_OK);
    tp_work_free(w);
    /* blocking calls wait on the backend's work too */
    cr_assert_eq(tp_all_reduce(c, x, y, TP_SUM, NULL), TP_OK);
    cr_assert_eq(tp_comm_debug_end(dbg), TP_OK);

    cr_assert_eq(s.collectives, 2);
    cr_assert(s.tests > 0 && s.waits > 0, "tests %d waits %d", s.tests, s.waits);
    cr_assert_eq(s.frees, 2, "every backend work object is freed once");
    cr_assert_eq(tp_comm_debug_count(dbg, TP_COLL_ALL_REDUCE), 2);
    double v = 0;
    int64_t i = 4;
    cr_assert_eq(tp_tensor_get(y, &i, &v), TP_OK);
    cr_assert_eq(v, 3.0);

    /* slots left NULL are reported, not crashed on */
    tp_comm *sub = NULL;
    cr_assert_eq(tp_comm_split(c, 0, 0, &sub), TP_ERR_NOT_SUPPORTED);
    cr_assert(strstr(tp_last_error(), "cannot split") != NULL, "%s", tp_last_error());
    tp_comm_debug_free(dbg);
    tp_tensor_release(x);
    tp_tensor_release(y);
    tp_comm_free(c);
}

Test(comm_backend, registry, .timeout = 10)
{
    cr_assert_not_null(tp_backend_find("shm"));
    cr_assert_null(tp_backend_find("no-such-backend"));
    cr_assert_null(tp_backend_find(NULL));
    tp_backend b = counting_backend;
    b.name = "counting-registered";
    cr_assert_eq(tp_backend_register(&b), TP_OK, "%s", tp_last_error());
    const tp_backend *found = tp_backend_find("counting-registered");
    cr_assert_not_null(found);
    cr_assert_eq(found->collective, counting_collective);
    cr_assert_eq(tp_backend_register(&b), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "already registered") != NULL, "%s", tp_last_error());
    cr_assert_eq(tp_backend_register(NULL), TP_ERR_INVALID_ARG);
    tp_backend nameless = counting_backend;
    nameless.name = "";
    cr_assert_eq(tp_backend_register(&nameless), TP_ERR_INVALID_ARG);
    tp_backend nocoll = {.name = "nocoll"};
    cr_assert_eq(tp_backend_register(&nocoll), TP_ERR_INVALID_ARG);

    tp_comm *c = (tp_comm *)&b;
    cr_assert_eq(tp_comm_create_world("no-such-backend", NULL, &c), TP_ERR_NOT_SUPPORTED);
    cr_assert_null(c);
    cr_assert_eq(tp_comm_create_world("shm", NULL, &c), TP_ERR_NOT_SUPPORTED);
    cr_assert(strstr(tp_last_error(), "tp_run_local") != NULL, "%s", tp_last_error());
    cr_assert_eq(tp_comm_create_world("counting-registered", NULL, &c), TP_ERR_NOT_SUPPORTED);

    cr_assert_eq(tp_comm_create(NULL, NULL, 0, 1, &c), TP_ERR_INVALID_ARG);
    cr_assert_eq(tp_comm_create(&counting_backend, NULL, 1, 1, &c), TP_ERR_INVALID_ARG);
    cr_assert(strstr(tp_last_error(), "rank 1 out of range for size 1") != NULL, "%s",
              tp_last_error());
    cr_assert_eq(tp_comm_create(&counting_backend, NULL, 0, 0, &c), TP_ERR_INVALID_ARG);
}

/* CUDA buffers are refused by a backend that only moves CPU memory. */
Test(comm_backend, device_mask, .timeout = 10)
{
    if (tp_cuda_device_count() == 0) {
        cr_log_info("no CUDA device: skipping the CUDA half of the device-mask check");
        cr_skip_test("no CUDA device");
    }
    counting_state s = {0};
    tp_comm *c = NULL;
    cr_assert_eq(tp_comm_create(&counting_backend, &s, 0, 1, &c), TP_OK);
    int64_t n = 4;
    tp_tensor *x = NULL;
    cr_assert_eq(tp_tensor_zeros(TP_F32, TP_CUDA(0), 1, &n, &x), TP_OK);
    cr_assert_eq(tp_all_reduce(c, x, x, TP_SUM, NULL), TP_ERR_NOT_SUPPORTED);
    cr_assert(strstr(tp_last_error(), "cannot move CUDA tensors") != NULL, "%s", tp_last_error());
    tp_tensor_release(x);
    tp_comm_free(c);
}

/* ---- a world of one that splits, and fails without saying why -------------- */

typedef struct {
    double split_timeout; /* the timeout split was given */
    int splits, frees;
} quiet_state;

/* Fails every collective with a bare status: libtp words the message. */
static tp_status quiet_collective(void *state, const tp_coll_desc *d, void **work)
{
    (void)state;
    (void)d;
    *work = NULL;
    return TP_ERR_BACKEND;
}

/* The new group shares the state (a world of one splits into itself). */
static tp_status quiet_split(void *state, int color, int key, double timeout_s, void **new_state,
                             int *new_rank, int *new_size)
{
    (void)key;
    quiet_state *s = state;
    s->splits++;
    s->split_timeout = timeout_s;
    *new_state = color < 0 ? NULL : s;
    *new_rank = 0;
    *new_size = 1;
    return TP_OK;
}

static void quiet_free(void *state) { ((quiet_state *)state)->frees++; }

static const tp_backend quiet_backend = {
    .name = "quiet",
    .device_mask = 1u << TP_DEVICE_CPU,
    .collective = quiet_collective,
    .split = quiet_split,
    .free = quiet_free,
};

/* A collective that fails without a message gets one naming the backend and
 * the kind, after the public function's name. */
Test(comm_backend, bare_status_gets_a_message, .timeout = 10)
{
    quiet_state s = {0};
    tp_comm *c = NULL;
    CHECK_OK(tp_comm_create(&quiet_backend, &s, 0, 1, &c));
    int64_t n = 3;
    tp_tensor *x = NULL;
    CHECK_OK(tp_tensor_zeros(TP_F32, TP_CPU, 1, &n, &x));
    CHECK_ERR(tp_all_reduce(c, x, x, TP_SUM, NULL), TP_ERR_BACKEND);
    cr_assert_str_eq(tp_last_error(),
                     "tp_all_reduce: backend 'quiet' returned an error without a message for "
                     "all_reduce");
    tp_work *w = NULL;
    CHECK_ERR(tp_barrier(c, &w), TP_ERR_BACKEND);
    cr_assert_null(w);
    cr_assert_str_eq(tp_last_error(),
                     "tp_barrier: backend 'quiet' returned an error without a message for "
                     "barrier");
    /* not an abort: the communicator stays usable */
    cr_assert(!tp_comm_is_aborted(c));
    tp_tensor_release(x);
    CHECK_OK(tp_comm_free(c));
    cr_assert_eq(s.frees, 1);
}

/* split is given the communicator's timeout, and the new communicator keeps
 * it. */
Test(comm_backend, split_gets_the_timeout, .timeout = 10)
{
    quiet_state s = {0};
    tp_comm *c = NULL, *sub = NULL, *none = NULL;
    CHECK_OK(tp_comm_create(&quiet_backend, &s, 0, 1, &c));
    CHECK_OK(tp_comm_set_timeout(c, 7.5));
    CHECK_OK(tp_comm_split(c, 0, 0, &sub));
    cr_assert_eq(s.split_timeout, 7.5);
    cr_assert_not_null(sub);
    cr_assert_eq(tp_comm_timeout(sub), 7.5);
    CHECK_OK(tp_comm_set_timeout(sub, 0.25));
    CHECK_OK(tp_comm_split(sub, TP_COMM_NO_COLOR, 0, &none));
    cr_assert_eq(s.split_timeout, 0.25);
    cr_assert_null(none);
    cr_assert_eq(s.splits, 2);
    CHECK_OK(tp_comm_free(sub));
    CHECK_OK(tp_comm_free(c));
    cr_assert_eq(s.frees, 2);
}

/* ---- a multi-rank user backend: blocking, pointer exchange + barrier ------- */

typedef struct {
    pthread_barrier_t bar;
    int n;
    const void *send[8];
    void *recv[8];
} toy_shared;

typedef struct {
    toy_shared *sh;
    int rank;
} toy_state;

static tp_status toy_collective(void *state, const tp_coll_desc *d, void **work)
{
    toy_state *t = state;
    toy_shared *sh = t->sh;
    size_t es = tp_dtype_size(d->dtype);
    *work = NULL;
    sh->send[t->rank] = d->sendbuf;
    sh->recv[t->rank] = d->recvbuf;
    pthread_barrier_wait(&sh->bar);
    tp_status st = TP_OK;
    if (d->kind == TP_COLL_ALL_GATHER) {
        for (int q = 0; q < sh->n; q++)
            memcpy((char *)d->recvbuf + (size_t)q * d->count * es, sh->send[q], d->count * es);
    } else if (d->kind == TP_COLL_ALL_REDUCE && d->dtype == TP_F32 && d->op == TP_SUM &&
               d->sendbuf != d->recvbuf) {
        for (size_t i = 0; i < d->count; i++) {
            float acc = 0;
            for (int q = 0; q < sh->n; q++)
                acc += ((const float *)sh->send[q])[i];
            ((float *)d->recvbuf)[i] = acc;
        }
    } else if (d->kind != TP_COLL_BARRIER) {
        st = TP_ERR_NOT_SUPPORTED;
    }
    pthread_barrier_wait(&sh->bar);
    return st;
}

static const tp_backend toy_backend = {
    .name = "toy",
    .device_mask = 1u << TP_DEVICE_CPU,
    .checks_descriptors = false,
    .collective = toy_collective,
};

typedef struct {
    toy_shared *sh;
    int rank;
    int odd_count; /* the last rank issues a different element count */
    tp_status got;
    char msg[512];
    tp_status got_scatter, got_scatter_root; /* unimplemented kind; roots differ */
    char msg_scatter[512], msg_scatter_root[512];
    tp_test_slot slot;
} toy_arg;

static void *toy_rank(void *p)
{
    toy_arg *a = p;
    toy_state st = {a->sh, a->rank};
    tp_comm *c = NULL;
    tp_test_slot *s = &a->slot;
    int n = a->sh->n;
    if (tp_comm_create(&toy_backend, &st, a->rank, n, &c) != TP_OK) {
        RANK_EXPECT(s, 0, "tp_comm_create: %s", tp_last_error());
        return NULL;
    }
    tp_comm_set_check(c, true);
    int64_t k = 8, k2 = 16;
    tp_tensor *x = NULL, *y = NULL, *x2 = NULL, *y2 = NULL;
    tp_tensor_zeros(TP_F32, TP_CPU, 1, &k, &x);
    tp_tensor_zeros(TP_F32, TP_CPU, 1, &k, &y);
    tp_tensor_zeros(TP_F32, TP_CPU, 1, &k2, &x2);
    tp_tensor_zeros(TP_F32, TP_CPU, 1, &k2, &y2);
    tp_tensor_fill(x, a->rank + 1);
    /* a kind the backend does not implement: its bare TP_ERR_NOT_SUPPORTED gets
     * a message naming backend and kind; the communicator stays usable */
    int64_t kn = k * n;
    tp_tensor *xs = NULL;
    tp_tensor_zeros(TP_F32, TP_CPU, 1, &kn, &xs);
    a->got_scatter = tp_scatter(c, a->rank == 0 ? xs : NULL, y, 0, NULL);
    snprintf(a->msg_scatter, sizeof a->msg_scatter, "%s", tp_last_error());
    /* the descriptor check compares scatter roots (send is read on root only,
     * so every rank may pass one) */
    a->got_scatter_root = tp_scatter(c, xs, y, a->rank == n - 1 ? 1 : 0, NULL);
    snprintf(a->msg_scatter_root, sizeof a->msg_scatter_root, "%s", tp_last_error());
    tp_tensor_release(xs);
    /* matching calls pass the check and compute */
    tp_status r = tp_all_reduce(c, x, y, TP_SUM, NULL);
    RANK_EXPECT(s, r == TP_OK, "checked all_reduce: %s %s", tp_status_name(r), tp_last_error());
    double v = 0;
    int64_t i = 7;
    tp_tensor_get(y, &i, &v);
    RANK_EXPECT(s, v == n * (n + 1) / 2, "checked all_reduce gave %g", v);
    /* mismatched calls are caught before the backend sees them */
    bool odd = a->odd_count && a->rank == n - 1;
    a->got = odd ? tp_all_reduce(c, x2, y2, TP_SUM, NULL) : tp_all_reduce(c, x, y, TP_SUM, NULL);
    snprintf(a->msg, sizeof a->msg, "%s", tp_last_error());
    tp_tensor_release(x);
    tp_tensor_release(y);
    tp_tensor_release(x2);
    tp_tensor_release(y2);
    tp_comm_free(c);
    return NULL;
}

Test(comm_backend, descriptor_check_on_a_user_backend, .timeout = 30)
{
    for (int n = 2; n <= 4; n++) {
        toy_shared sh = {.n = n};
        pthread_barrier_init(&sh.bar, NULL, (unsigned)n);
        toy_arg args[8];
        pthread_t th[8];
        for (int r = 0; r < n; r++) {
            args[r] = (toy_arg){.sh = &sh, .rank = r, .odd_count = 1};
            pthread_create(&th[r], NULL, toy_rank, &args[r]);
        }
        for (int r = 0; r < n; r++)
            pthread_join(th[r], NULL);
        pthread_barrier_destroy(&sh.bar);
        char needle[200];
        snprintf(needle, sizeof needle,
                 "rank 0 issued all_reduce(f32, 8 elements, sum), rank %d issued "
                 "all_reduce(f32, 16 elements, sum)",
                 n - 1);
        for (int r = 0; r < n; r++) {
            cr_assert(!args[r].slot.failed, "rank %d: %s", r, args[r].slot.msg);
            cr_assert_eq(args[r].got, TP_ERR_MISMATCH, "rank %d: %s", r,
                         tp_status_name(args[r].got));
            cr_assert(strstr(args[r].msg, needle) != NULL, "'%s'", args[r].msg);
            cr_assert_eq(args[r].got_scatter, TP_ERR_NOT_SUPPORTED, "rank %d: %s", r,
                         tp_status_name(args[r].got_scatter));
            cr_assert(strstr(args[r].msg_scatter, "tp_scatter: backend 'toy' does not implement "
                                                  "scatter") != NULL,
                      "'%s'", args[r].msg_scatter);
            char sneedle[200];
            snprintf(sneedle, sizeof sneedle,
                     "rank 0 issued scatter(f32, 8 elements, root 0), rank %d issued "
                     "scatter(f32, 8 elements, root 1)",
                     n - 1);
            cr_assert_eq(args[r].got_scatter_root, TP_ERR_MISMATCH, "rank %d: %s", r,
                         tp_status_name(args[r].got_scatter_root));
            cr_assert(strstr(args[r].msg_scatter_root, sneedle) != NULL, "'%s'",
                      args[r].msg_scatter_root);
        }
    }
}
