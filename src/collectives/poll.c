/* The backends' wait loop (poll.h). */
#include <sched.h>
#include <time.h>

#include "collectives/poll.h"

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

tp_status tp__poll_until(tp__poll_fn poll, void *ctx, double timeout_s, const tp__pace *pace)
{
    unsigned every = pace->every ? pace->every : 1, left = every;
    double t0 = -1;
    for (;;) {
        bool done = false;
        tp_status st = poll(ctx, &done);
        if (st != TP_OK || done) {
            TP_ASSERT(st != TP_ERR_TIMEOUT);
            return st;
        }
        if (--left) {
            if (!pace->no_pause)
                cpu_relax();
            continue;
        }
        left = every;
        double now = tp__now();
        if (t0 < 0)
            t0 = now;
        double waited = now - t0;
        if (waited > timeout_s)
            return TP_ERR_TIMEOUT;
        if (waited < pace->spin_s) {
            if (!pace->no_pause)
                cpu_relax();
        } else if (waited < pace->yield_s) {
            sched_yield();
        } else if (pace->sleep) {
            pace->sleep(ctx);
        } else {
            struct timespec ts = {pace->sleep_ns / 1000000000L, pace->sleep_ns % 1000000000L};
            nanosleep(&ts, NULL);
        }
    }
}
