/* TP_DEBUG: lines that show the data path (strategies, redistribute steps,
 * collectives), as NCCL_DEBUG shows NCCL's. Not installed.
 *
 * Every log site is guarded by TP_LOG_ON(level): one relaxed load of a cached
 * level and a branch predicted not taken, so with TP_DEBUG unset the hot path
 * formats no string, reads no environment and takes no lock. The level starts
 * above every real level (TP__LOG_UNREAD), so the process's first guard takes
 * the slow path, which reads TP_DEBUG once and caches it; the functions below
 * check the real level themselves. */
#ifndef TP_LOG_H
#define TP_LOG_H

#include <stdatomic.h>
#include <stdbool.h>

#define TP_LIKELY(x) __builtin_expect(!!(x), 1)
#define TP_UNLIKELY(x) __builtin_expect(!!(x), 0)

enum {
    TP_LOG_OFF = 0,
    TP_LOG_WARN = 1,  /* failures worth a line: a collective that failed */
    TP_LOG_INFO = 2,  /* per op: the strategy; per redistribute: each step */
    TP_LOG_TRACE = 3, /* and each collective */
    TP__LOG_UNREAD = 100,
};

extern atomic_int tp__log_level;

#define TP_LOG_ON(level)                                                        \
    TP_UNLIKELY(atomic_load_explicit(&tp__log_level, memory_order_relaxed) >= (level))

/* Whether lines of `level` are printed (reads TP_DEBUG on the first call). */
bool tp__log_enabled(int level);

/* Prints one line "libtp <host>:<pid>:<tid> [<rank>] <LEVEL> <message>" if
 * `level` is enabled, to stderr or the calling rank's TP_DEBUG_FILE. */
void tp__log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* The world rank the calling thread's lines carry (a rank thread of
 * tp_run_local), and the one every thread of the process carries unless it
 * set its own (a process of an mpi or nccl world). */
void tp__log_set_thread_rank(int rank);
void tp__log_set_process_rank(int rank);


#endif /* TP_LOG_H */
