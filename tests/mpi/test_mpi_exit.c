/*
 * The mpi backend when a peer stops answering for good: the surviving ranks
 * must report the fault, free their communicators and exit promptly instead
 * of waiting in MPI_Finalize (which waits for every process of the job), and
 * mpirun must then end the whole job. A plain C program under mpirun, one
 * process per rank, run by tests/mpi/fault_exit.sh, which times the job and
 * checks that no process of it is left:
 *
 *   test_mpi_exit stop T   rank 1 stops itself (SIGSTOP) inside an all_reduce
 *                          loop; the others time out after T s
 *   test_mpi_exit kill T   rank 1 kills itself (SIGKILL) inside the loop
 *   test_mpi_exit cut T    nobody faults by itself: the script cuts the link
 *                          between two hosts (scripts/multihost-check.sh), and
 *                          every rank times out after T s
 *
 * Every rank prints "pid R PID"; rank 1 prints "fault_at SECONDS" (the
 * realtime clock) right before the fault. Each surviving rank checks what it
 * sees and prints "mpi: N passed, N failed" before it exits; under `stop`
 * and `cut` the checks are: TP_ERR_TIMEOUT after T s, tp_comm_free within the exit
 * grace, tp_last_error still the timeout's message, MPI left unfinalized,
 * and a new world refused with TP_ERR_STATE. With TP_MPI_ABORT_ON_FAILURE=1
 * the timeout calls MPI_Abort instead (the script checks its message).
 */
#if !defined(_GNU_SOURCE) && !defined(_POSIX_C_SOURCE)
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#endif
#include <mpi.h>

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <tp.h>

enum { MODE_STOP, MODE_KILL, MODE_CUT };

static int g_rank = -1;
static long g_pass, g_fail;

#define EXPECT(cond, ...)                                                                       \
    do {                                                                                        \
        if (cond) {                                                                             \
            g_pass++;                                                                           \
        } else {                                                                                \
            char msg_[1536];                                                                    \
            snprintf(msg_, sizeof msg_, __VA_ARGS__);                                           \
            fprintf(stderr, "[rank %d] FAIL test_mpi_exit.c:%d: %s\n", g_rank, __LINE__, msg_); \
            fflush(stderr);                                                                     \
            g_fail++;                                                                           \
        }                                                                                       \
    } while (0)

static double clock_s(clockid_t id)
{
    struct timespec ts;
    clock_gettime(id, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Rank 1 faults on iteration 20 (stop, kill); every rank all_reduces until
 * an error. */
static tp_status reduce_until_fault(tp_comm *world, int mode, double *waited)
{
    int64_t n = 1024;
    tp_tensor *x = NULL;
    if (tp_tensor_zeros(TP_F32, TP_CPU, 1, &n, &x) != TP_OK) {
        EXPECT(0, "tp_tensor_zeros: %s", tp_last_error());
        return TP_ERR_NO_MEMORY;
    }
    tp_status st = TP_OK;
    for (int i = 0; st == TP_OK; i++) {
        if (g_rank == 1 && i == 20 && mode != MODE_CUT) {
            printf("fault_at %.3f\n", clock_s(CLOCK_REALTIME));
            fflush(stdout);
            raise(mode == MODE_STOP ? SIGSTOP : SIGKILL);
        }
        double t0 = clock_s(CLOCK_MONOTONIC);
        st = tp_all_reduce(world, x, x, TP_SUM, NULL);
        *waited = clock_s(CLOCK_MONOTONIC) - t0;
    }
    tp_tensor_release(x);
    return st;
}

int main(int argc, char **argv)
{
    const char *m = argc > 1 ? argv[1] : "";
    int mode = !strcmp(m, "stop") ? MODE_STOP : !strcmp(m, "cut") ? MODE_CUT : MODE_KILL;
    bool timeout = mode != MODE_KILL;
    double limit = argc > 2 ? atof(argv[2]) : 2.0;
    tp_comm *world = NULL;
    if (tp_comm_create_world("mpi", NULL, &world) != TP_OK) {
        fprintf(stderr, "tp_comm_create_world(\"mpi\"): %s\n", tp_last_error());
        return 1;
    }
    g_rank = tp_comm_rank(world);
    printf("pid %d %ld\n", g_rank, (long)getpid());
    fflush(stdout);
    if (tp_comm_size(world) < 2) {
        tp_comm_free(world);
        printf("mpi: 0 passed, 0 failed (needs 2 ranks)\n");
        return 0;
    }
    EXPECT(tp_comm_set_timeout(world, limit) == TP_OK, "set_timeout: %s", tp_last_error());
    double waited = 0;
    tp_status st = reduce_until_fault(world, mode, &waited);
    char err[400];
    snprintf(err, sizeof err, "%s", tp_last_error());
    if (timeout) {
        EXPECT(st == TP_ERR_TIMEOUT && strstr(err, "timed out after"),
               "all_reduce -> %s (%s), expected TP_ERR_TIMEOUT", tp_status_name(st), err);
        EXPECT(waited >= limit - 0.05 && waited < limit + 5, "timed out after %.2f s, limit %.3g s",
               waited, limit);
    } else {
        EXPECT(st != TP_OK, "all_reduce went on after the peer was killed");
    }
    double t0 = clock_s(CLOCK_MONOTONIC);
    st = tp_comm_free(world);
    double took = clock_s(CLOCK_MONOTONIC) - t0;
    EXPECT(st == TP_OK, "tp_comm_free -> %s (%s)", tp_status_name(st), tp_last_error());
    EXPECT(took < 8, "tp_comm_free took %.2f s (exit grace 5 s)", took);
    EXPECT(strcmp(tp_last_error(), err) == 0,
           "tp_last_error changed by tp_comm_free: '%s', was '%s'", tp_last_error(), err);
    int fin = 1;
    MPI_Finalized(&fin);
    EXPECT(!fin, "MPI was finalized although a peer never reached the end");
    tp_comm *again = NULL;
    st = tp_comm_create_world("mpi", NULL, &again);
    EXPECT(st == TP_ERR_STATE && again == NULL && strstr(tp_last_error(), "unfinalized"),
           "a new world after the abandoned one -> %s (%s), expected TP_ERR_STATE",
           tp_status_name(st), tp_last_error());
    printf("mpi: %ld passed, %ld failed\n", g_pass, g_fail);
    fflush(stdout);
    return g_fail != 0;
}
