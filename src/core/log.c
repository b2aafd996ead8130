/* TP_DEBUG and TP_DEBUG_FILE (see log.h and docs/API.md, "Debugging:
 * TP_DEBUG").
 *
 * The level is read once per process, on the first guard that finds it
 * unread. Lines go to stderr, or to one file per expansion of TP_DEBUG_FILE
 * ("%r" the world rank, "%p" the pid, "%h" the host), opened on first use,
 * line-buffered and closed when the library unloads. Each line is one fputs,
 * which stdio makes atomic per stream, so lines never interleave; rank
 * threads writing to their own files do not wait for each other (each keeps
 * its stream; the table of streams is locked only to find or open one), and
 * a read-write lock keeps the streams open while anyone writes. The log's own
 * bookkeeping uses libc's allocator, not tp_allocator, so that turning it on
 * does not change what an allocator hook sees. */
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "core/log.h"

atomic_int tp__log_level = TP__LOG_UNREAD;

static pthread_once_t tp__log_once = PTHREAD_ONCE_INIT;
static char tp__log_host[64] = "?";
static char tp__log_pattern[PATH_MAX]; /* TP_DEBUG_FILE; "" for stderr */

static _Thread_local int tp__log_thread_rank = -1;
static atomic_int tp__log_process_rank = -1;

/* The files opened so far, by expanded path; f NULL: could not be opened,
 * its lines go to stderr. Guarded by tp__log_mu. */
typedef struct {
    char *path;
    FILE *f;
} tp__log_sink;

static pthread_mutex_t tp__log_mu = PTHREAD_MUTEX_INITIALIZER;
static tp__log_sink *tp__log_sinks;
static size_t tp__log_nsinks, tp__log_cap;
static bool tp__log_open_warned;
/* Held shared around every write, alone to close the files. */
static pthread_rwlock_t tp__log_rw = PTHREAD_RWLOCK_INITIALIZER;
static bool tp__log_closed;
/* The calling thread's stream and the rank it was found for. */
static _Thread_local FILE *tp__log_my_stream;
static _Thread_local int tp__log_my_rank = -2;

static const char *const tp__log_names[] = {"OFF", "WARN", "INFO", "TRACE"};

static int tp__log_rank(void)
{
    int r = tp__log_thread_rank;
    return r >= 0 ? r : atomic_load_explicit(&tp__log_process_rank, memory_order_relaxed);
}

/* "libtp <host>:<pid>:<tid> [<rank>] <LEVEL> <msg>\n" into buf (cut with
 * "...\n" when too long). */
static void tp__log_format(char *buf, size_t len, int level, const char *msg)
{
    char rank[16] = "?";
    int r = tp__log_rank();
    if (r >= 0)
        snprintf(rank, sizeof rank, "%d", r);
    int n = snprintf(buf, len, "libtp %s:%d:%ld [%s] %s %s\n", tp__log_host, (int)getpid(),
                     (long)syscall(SYS_gettid), rank, tp__log_names[level], msg);
    if (n < 0 || (size_t)n >= len)
        memcpy(buf + len - 5, "...\n", 5);
}

/* Writes a warning about the log's own configuration to stderr, whatever
 * the level. */
__attribute__((format(printf, 1, 2))) static void tp__log_warn_stderr(const char *fmt, ...)
{
    char msg[PATH_MAX + 256], line[PATH_MAX + 512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    tp__log_format(line, sizeof line, TP_LOG_WARN, msg);
    fputs(line, stderr);
}

static void tp__log_init(void)
{
    if (gethostname(tp__log_host, sizeof tp__log_host) != 0)
        snprintf(tp__log_host, sizeof tp__log_host, "?");
    tp__log_host[sizeof tp__log_host - 1] = '\0';
    char *dot = strchr(tp__log_host, '.');
    if (dot && dot != tp__log_host)
        *dot = '\0';

    int level = TP_LOG_OFF;
    const char *v = getenv("TP_DEBUG");
    if (v && *v) {
        if (!strcasecmp(v, "OFF") || !strcmp(v, "0"))
            level = TP_LOG_OFF;
        else if (!strcasecmp(v, "WARN"))
            level = TP_LOG_WARN;
        else if (!strcasecmp(v, "INFO"))
            level = TP_LOG_INFO;
        else if (!strcasecmp(v, "TRACE"))
            level = TP_LOG_TRACE;
        else
            tp__log_warn_stderr("TP_DEBUG=\"%.64s\" is not OFF, WARN, INFO or TRACE; debug "
                                "output stays off", v);
    }
    const char *f = getenv("TP_DEBUG_FILE");
    if (level > TP_LOG_OFF && f && *f) {
        if (strlen(f) < sizeof tp__log_pattern)
            memcpy(tp__log_pattern, f, strlen(f) + 1);
        else
            tp__log_warn_stderr("TP_DEBUG_FILE is longer than %d characters; printing to "
                                "stderr instead", PATH_MAX - 1);
    }
    /* release: a thread that sees the level sees the host and the pattern */
    atomic_store_explicit(&tp__log_level, level, memory_order_release);
}

bool tp__log_enabled(int level)
{
    int l = atomic_load_explicit(&tp__log_level, memory_order_acquire);
    if (TP_UNLIKELY(l == TP__LOG_UNREAD)) {
        pthread_once(&tp__log_once, tp__log_init);
        l = atomic_load_explicit(&tp__log_level, memory_order_acquire);
    }
    return level > TP_LOG_OFF && l >= level;
}

void tp__log_set_thread_rank(int rank) { tp__log_thread_rank = rank; }

void tp__log_set_process_rank(int rank)
{
    atomic_store_explicit(&tp__log_process_rank, rank, memory_order_relaxed);
}

/* TP_DEBUG_FILE with %r, %p, %h and %% expanded; false when too long. */
static bool tp__log_expand(char *out, size_t len, int rank)
{
    size_t n = 0;
    for (const char *p = tp__log_pattern; *p; p++) {
        char tmp[80];
        const char *s = tmp;
        if (p[0] == '%' && p[1] == 'r') {
            if (rank >= 0)
                snprintf(tmp, sizeof tmp, "%d", rank);
            else
                s = "norank";
            p++;
        } else if (p[0] == '%' && p[1] == 'p') {
            snprintf(tmp, sizeof tmp, "%d", (int)getpid());
            p++;
        } else if (p[0] == '%' && p[1] == 'h') {
            s = tp__log_host;
            p++;
        } else if (p[0] == '%' && p[1] == '%') {
            s = "%";
            p++;
        } else {
            tmp[0] = *p;
            tmp[1] = '\0';
        }
        size_t k = strlen(s);
        if (n + k >= len)
            return false;
        memcpy(out + n, s, k);
        n += k;
    }
    out[n] = '\0';
    return true;
}

/* The stream for rank's lines: its file, or stderr when there is none or it
 * cannot be opened; *keep false when the next line should look again (out
 * of memory). tp__log_mu held. */
static FILE *tp__log_stream(int rank, bool *keep)
{
    *keep = true;
    if (!tp__log_pattern[0])
        return stderr;
    char path[PATH_MAX];
    if (!tp__log_expand(path, sizeof path, rank)) {
        if (!tp__log_open_warned)
            tp__log_warn_stderr("TP_DEBUG_FILE \"%s\" expands to a path longer than %d "
                                "characters; printing to stderr instead", tp__log_pattern,
                                PATH_MAX - 1);
        tp__log_open_warned = true;
        return stderr;
    }
    for (size_t i = 0; i < tp__log_nsinks; i++)
        if (strcmp(tp__log_sinks[i].path, path) == 0)
            return tp__log_sinks[i].f ? tp__log_sinks[i].f : stderr;
    FILE *f = fopen(path, "w");
    if (f) {
        setvbuf(f, NULL, _IOLBF, BUFSIZ);
    } else {
        if (!tp__log_open_warned)
            tp__log_warn_stderr("TP_DEBUG_FILE: cannot open \"%s\" for writing: %s; printing "
                                "to stderr instead (reported once)", path, strerror(errno));
        tp__log_open_warned = true;
    }
    char *copy = strdup(path);
    if (copy && tp__log_nsinks == tp__log_cap) {
        size_t cap = tp__log_cap ? 2 * tp__log_cap : 8;
        tp__log_sink *s = realloc(tp__log_sinks, cap * sizeof *s);
        if (s) {
            tp__log_sinks = s;
            tp__log_cap = cap;
        }
    }
    if (!copy || tp__log_nsinks == tp__log_cap) {
        /* out of memory: this line goes to stderr, the next one retries */
        free(copy);
        if (f)
            fclose(f);
        *keep = false;
        return stderr;
    }
    tp__log_sinks[tp__log_nsinks++] = (tp__log_sink){copy, f};
    return f ? f : stderr;
}

void tp__log(int level, const char *fmt, ...)
{
    if (!tp__log_enabled(level))
        return;
    char msg[1024], line[1280];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (n < 0)
        return;
    if ((size_t)n >= sizeof msg)
        memcpy(msg + sizeof msg - 4, "...", 4);
    tp__log_format(line, sizeof line, level, msg);
    pthread_rwlock_rdlock(&tp__log_rw);
    if (!tp__log_closed) {
        int rank = tp__log_rank();
        FILE *f = tp__log_my_stream;
        if (!f || tp__log_my_rank != rank) {
            bool keep = true;
            pthread_mutex_lock(&tp__log_mu);
            f = tp__log_stream(rank, &keep);
            pthread_mutex_unlock(&tp__log_mu);
            tp__log_my_stream = keep ? f : NULL;
            tp__log_my_rank = rank;
        }
        fputs(line, f);
    }
    pthread_rwlock_unlock(&tp__log_rw);
}

/* Closes the files when the library unloads (at exit for a program linked
 * with it); a line logged after that is dropped. */
__attribute__((destructor)) static void tp__log_fini(void)
{
    pthread_rwlock_wrlock(&tp__log_rw);
    pthread_mutex_lock(&tp__log_mu);
    for (size_t i = 0; i < tp__log_nsinks; i++) {
        if (tp__log_sinks[i].f)
            fclose(tp__log_sinks[i].f);
        free(tp__log_sinks[i].path);
    }
    free(tp__log_sinks);
    tp__log_sinks = NULL;
    tp__log_nsinks = tp__log_cap = 0;
    tp__log_closed = true;
    pthread_mutex_unlock(&tp__log_mu);
    pthread_rwlock_unlock(&tp__log_rw);
}
