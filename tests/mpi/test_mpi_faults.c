/*
 * The mpi backend after a fault: a collective that timed out leaves its
 * request posted inside MPI (MPI cannot cancel a collective), and freeing the
 * communicator and finalizing MPI must still be clean and prompt on every
 * rank, whether the peers never join or join late, when MPI may progress the
 * stale request (and send on its communicator) at any later call,
 * MPI_Finalize included. A plain C program under mpirun, one process per rank
 * (libtp initializes and finalizes MPI):
 *
 *   mpirun -np N test_mpi_faults           rank 0 times out, the others join
 *                                          late: on a split communicator while
 *                                          the world goes on, then on the world
 *                                          itself, right before finalizing
 *   mpirun -np N test_mpi_faults --never   rank 0 times out on the world, the
 *                                          others never join; all free it
 *
 * Every wait has a timeout. The world cannot count the checks once it is
 * faulted, so each rank prints its own "mpi: N passed, N failed" line after
 * MPI was finalized; the exit status is non-zero on any failure, and a crash
 * or a hang fails the mpirun.
 */
#if !defined(_GNU_SOURCE) && !defined(_POSIX_C_SOURCE)
#define _POSIX_C_SOURCE 200809L /* clock_gettime, nanosleep */
#endif
#include <mpi.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <tp.h>

static int g_rank = -1;
static long g_pass, g_fail;

#define EXPECT(cond, ...)                                                       \
    do {                                                                        \
        if (cond) {                                                             \
            g_pass++;                                                           \
        } else {                                                                \
            char msg_[512];                                                     \
            snprintf(msg_, sizeof msg_, __VA_ARGS__);                           \
            fprintf(stderr, "[rank %d] FAIL test_mpi_faults.c:%d: %s\n", g_rank, __LINE__, \
                    msg_);                                                      \
            fflush(stderr);                                                     \
            g_fail++;                                                           \
        }                                                                       \
    } while (0)

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void sleep_s(double s)
{
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    nanosleep(&ts, NULL);
}

/* A one-element f32 tensor holding v. */
static tp_tensor *scalar(float v)
{
    int64_t one = 1;
    tp_tensor *t = NULL;
    if (tp_tensor_from_data(TP_F32, 1, &one, &v, &t) != TP_OK)
        EXPECT(0, "tp_tensor_from_data: %s", tp_last_error());
    return t;
}

static float value(const tp_tensor *t) { return t ? *(const float *)tp_tensor_data(t) : -1; }

/* Rank 0 gives up on an all_reduce of c after 0.3 s. */
static void time_out(tp_comm *c, const char *label)
{
    tp_tensor *x = scalar(1);
    EXPECT(tp_comm_set_timeout(c, 0.3) == TP_OK, "%s: set_timeout", label);
    double t0 = now_s();
    tp_status st = tp_all_reduce(c, x, x, TP_SUM, NULL);
    double waited = now_s() - t0;
    EXPECT(st == TP_ERR_TIMEOUT && strstr(tp_last_error(), "timed out after 0.3 s"),
           "%s: all_reduce -> %s (%s), expected TP_ERR_TIMEOUT", label, tp_status_name(st),
           tp_last_error());
    EXPECT(waited >= 0.25 && waited < 10, "%s: timed out after %.2f s, limit 0.3 s", label,
           waited);
    EXPECT(tp_comm_is_aborted(c), "%s: not aborted after the timeout", label);
    tp_tensor_release(x); /* the request keeps its buffer alive */
}

/* A rank other than 0 posts the all_reduce rank 0 gave up on. MPI may still
 * complete it, rank 0's stale request taking part whenever MPI progresses it;
 * it must not crash or hang either way. `must` says whether rank 0 certainly
 * keeps making MPI calls meanwhile (then the result is complete and exact). */
static void join_late(tp_comm *c, int n, bool must, const char *label)
{
    tp_tensor *x = scalar((float)(tp_comm_rank(c) + 1));
    EXPECT(tp_comm_set_timeout(c, 10) == TP_OK, "%s: set_timeout", label);
    tp_status st = tp_all_reduce(c, x, x, TP_SUM, NULL);
    float want = (float)(n * (n + 1) / 2); /* rank q posted q + 1 */
    if (must || st == TP_OK)
        EXPECT(st == TP_OK && value(x) == want, "%s: late all_reduce -> %s (%s), value %g, "
               "expected TP_OK and %g", label, tp_status_name(st), tp_last_error(), value(x),
               want);
    else
        EXPECT(st == TP_ERR_TIMEOUT, "%s: late all_reduce -> %s (%s)", label,
               tp_status_name(st), tp_last_error());
    tp_tensor_release(x);
}

/* A faulted communicator is freed at once: nothing is waited for. */
static void free_promptly(tp_comm *c, const char *label)
{
    double t0 = now_s();
    tp_status st = tp_comm_free(c);
    double took = now_s() - t0;
    EXPECT(st == TP_OK, "%s: tp_comm_free -> %s (%s)", label, tp_status_name(st), tp_last_error());
    EXPECT(took < 5, "%s: tp_comm_free took %.2f s", label, took);
}

static void check_world(tp_comm *world, const char *label)
{
    int n = tp_comm_size(world);
    tp_tensor *x = scalar(2);
    tp_status st = tp_all_reduce(world, x, x, TP_SUM, NULL);
    EXPECT(st == TP_OK && value(x) == 2.0f * (float)n, "%s: world all_reduce -> %s (%s), %g",
           label, tp_status_name(st), tp_last_error(), value(x));
    tp_tensor_release(x);
}

/* Rank 0 times out on a split communicator; the others join only once it
 * has freed it and waits in a world collective (whose waiting progresses the
 * stale request: the late data arrives, and MPI sends the next round on the
 * freed communicator's behalf). Then a split nobody else joins, one freed
 * with its work still pending, and a split of a split that nobody else
 * joins; last, a split whose rank 0 times out on an all_gather that two
 * ranks send as persistent requests, nobody else joining. */
static void split_faults(tp_comm *world)
{
    int n = tp_comm_size(world), r = tp_comm_rank(world);
    tp_comm *a = NULL;
    EXPECT(tp_comm_split(world, 0, r, &a) == TP_OK, "split: %s", tp_last_error());
    if (!a)
        return;
    if (r == 0) {
        time_out(a, "split, late peers");
        free_promptly(a, "split, late peers");
        EXPECT(tp_barrier(world, NULL) == TP_OK, "barrier: %s", tp_last_error());
    } else {
        EXPECT(tp_barrier(world, NULL) == TP_OK, "barrier: %s", tp_last_error());
        join_late(a, n, true, "split, late peers");
        tp_comm_free(a);
    }
    check_world(world, "after a split with late peers");

    tp_comm *b = NULL;
    EXPECT(tp_comm_split(world, 0, r, &b) == TP_OK, "split: %s", tp_last_error());
    if (!b)
        return;
    if (r == 0) {
        time_out(b, "split, absent peers");
        free_promptly(b, "split, absent peers");
    } else {
        tp_comm_free(b);
    }
    check_world(world, "after a split with absent peers");

    /* a communicator with a work handle outstanding is not freed (TP_ERR_STATE);
     * freeing the pending handle waits up to the communicator's timeout (0.3 s
     * here), not the default, and then the faulted communicator frees at once */
    tp_comm *c = NULL;
    EXPECT(tp_comm_split(world, 0, r, &c) == TP_OK, "split: %s", tp_last_error());
    if (!c)
        return;
    if (r == 0) {
        tp_tensor *x = scalar(1);
        tp_work *w = NULL;
        EXPECT(tp_comm_set_timeout(c, 0.3) == TP_OK, "set_timeout");
        EXPECT(tp_all_reduce(c, x, x, TP_SUM, &w) == TP_OK, "async all_reduce: %s",
               tp_last_error());
        tp_tensor_release(x);
        tp_status st = tp_comm_free(c);
        EXPECT(st == TP_ERR_STATE, "pending work: tp_comm_free -> %s, expected TP_ERR_STATE",
               tp_status_name(st));
        double t0 = now_s();
        tp_work_free(w);
        double took = now_s() - t0;
        EXPECT(took < 5, "pending work, absent peers: tp_work_free took %.2f s", took);
        free_promptly(c, "pending work, absent peers");
    } else {
        tp_comm_free(c);
    }
    check_world(world, "after freeing pending work");

    /* a split waits no longer than the timeout of the communicator split (0.3
     * s), not the default; the barrier it leaves posted faults only that
     * communicator */
    tp_comm *d = NULL;
    EXPECT(tp_comm_split(world, 0, r, &d) == TP_OK, "split: %s", tp_last_error());
    if (!d)
        return;
    if (r == 0) {
        tp_comm *sub = d; /* must be reset to NULL */
        EXPECT(tp_comm_set_timeout(d, 0.3) == TP_OK, "set_timeout");
        double t0 = now_s();
        tp_status st = tp_comm_split(d, 0, 0, &sub);
        double took = now_s() - t0;
        EXPECT(st == TP_ERR_TIMEOUT && strstr(tp_last_error(), "timed out after 0.3 s"),
               "split, absent peers -> %s (%s), expected TP_ERR_TIMEOUT", tp_status_name(st),
               tp_last_error());
        EXPECT(took >= 0.25 && took < 10, "split, absent peers: timed out after %.2f s, limit "
               "0.3 s", took);
        EXPECT(sub == NULL, "split, absent peers: out not reset");
        EXPECT(tp_comm_is_aborted(d), "split, absent peers: not aborted after the timeout");
        free_promptly(d, "split, absent peers");
    } else {
        tp_comm_free(d);
    }
    check_world(world, "after a split with absent peers");

    /* the persistent requests of a two-rank world (mpi.c): two all_gathers
     * of the same buffers complete, the second starting the requests the
     * first made; rank 0's third finds no peer, times out with them started,
     * and the communicator it faulted frees at once */
    tp_comm *e = NULL;
    EXPECT(tp_comm_split(world, 0, r, &e) == TP_OK, "split: %s", tp_last_error());
    if (!e)
        return;
    int64_t one = 1, all = n;
    tp_tensor *x = NULL, *y = NULL;
    EXPECT(tp_tensor_zeros(TP_F32, TP_CPU, 1, &one, &x) == TP_OK &&
               tp_tensor_zeros(TP_F32, TP_CPU, 1, &all, &y) == TP_OK,
           "tensors: %s", tp_last_error());
    for (int i = 0; i < 2 && x && y; i++) {
        *(float *)tp_tensor_data(x) = (float)(r + i);
        tp_status st = tp_all_gather(e, x, y, NULL);
        long bad = 0;
        for (int q = 0; q < n && st == TP_OK; q++)
            bad += ((const float *)tp_tensor_data(y))[q] != (float)(q + i);
        EXPECT(st == TP_OK && bad == 0, "persistent all_gather %d -> %s (%s), %ld wrong", i,
               tp_status_name(st), tp_last_error(), bad);
    }
    if (r == 0 && x && y) {
        EXPECT(tp_comm_set_timeout(e, 0.3) == TP_OK, "set_timeout");
        double t0 = now_s();
        tp_status st = tp_all_gather(e, x, y, NULL);
        double waited = now_s() - t0;
        EXPECT(st == TP_ERR_TIMEOUT && strstr(tp_last_error(), "timed out after 0.3 s"),
               "persistent all_gather, absent peers -> %s (%s), expected TP_ERR_TIMEOUT",
               tp_status_name(st), tp_last_error());
        EXPECT(waited >= 0.25 && waited < 10,
               "persistent all_gather: timed out after %.2f s, limit 0.3 s", waited);
        EXPECT(tp_comm_is_aborted(e), "persistent all_gather: not aborted after the timeout");
        tp_tensor_release(x); /* the requests keep their buffers alive */
        tp_tensor_release(y);
        free_promptly(e, "persistent all_gather, absent peers");
    } else {
        tp_tensor_release(x);
        tp_tensor_release(y);
        tp_comm_free(e);
    }
    check_world(world, "after a persistent all_gather with absent peers");
}

int main(int argc, char **argv)
{
    bool never = argc > 1 && strcmp(argv[1], "--never") == 0;
    tp_comm *world = NULL;
    if (tp_comm_create_world("mpi", NULL, &world) != TP_OK) {
        fprintf(stderr, "tp_comm_create_world(\"mpi\"): %s\n", tp_last_error());
        return 1;
    }
    g_rank = tp_comm_rank(world);
    int n = tp_comm_size(world);
    const char *env = getenv("TP_MPI_ABORT_ON_FAILURE");
    bool run = n > 1 && !(env && strcmp(env, "1") == 0); /* a fault would end the job */
    if (run && never) {
        /* the world itself: rank 0 times out, the others free it at once */
        if (g_rank == 0) {
            time_out(world, "world, absent peers");
            free_promptly(world, "world, absent peers");
        } else {
            tp_comm_free(world);
        }
    } else if (run) {
        EXPECT(tp_comm_set_timeout(world, 30) == TP_OK, "set_timeout");
        split_faults(world);
        /* the world itself, the peers joining late: rank 0 is inside
         * MPI_Finalize (which progresses the stale request) by then */
        EXPECT(tp_barrier(world, NULL) == TP_OK, "barrier: %s", tp_last_error());
        if (g_rank == 0) {
            time_out(world, "world, late peers");
        } else {
            sleep_s(1.0);
            join_late(world, n, false, "world, late peers");
        }
        tp_comm_free(world);
    } else {
        tp_comm_free(world);
    }
    int fin = 0;
    MPI_Finalized(&fin);
    EXPECT(fin, "MPI is not finalized after the world was freed");
    printf("mpi: %ld passed, %ld failed\n", g_pass, g_fail);
    fflush(stdout);
    if (!fin)
        MPI_Finalize();
    return g_fail != 0;
}
