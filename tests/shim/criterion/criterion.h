/* In-process stand-in for the subset of Criterion 2.4 that libtp's tests use.
 *
 * Only used with `meson setup -Dtest_runner=shim` (see tests/shim/README.md):
 * Criterion cannot start under ThreadSanitizer (Snaipe/Criterion#274), so the
 * TSan job builds the same test sources against these headers instead. The
 * normal suite uses the real Criterion.
 *
 * Header-only: every test executable is one translation unit, and the runner
 * (registry, main, reporting) is defined here with weak linkage so that an
 * executable made of several units that include this header still links.
 *
 * Differences from Criterion, all consequences of running in one process:
 *   - tests run one after the other in the runner's process, in source order
 *     (Criterion sorts by name and forks one process per test), each on a
 *     fresh thread so that thread-local state starts clean; process-wide
 *     state a test leaves behind is seen by the next one;
 *   - a timeout or a crash ends the whole run (after the report and the
 *     synthesis line); the remaining tests do not run;
 *   - .signal / .exit_code tests cannot run in-process and are reported as
 *     skipped;
 *   - an assertion that fails in .fini counts the test as failed (Criterion
 *     ignores it).
 */
#ifndef CRITERION_SHIM_CRITERION_H_
#define CRITERION_SHIM_CRITERION_H_

#define CRITERION_SHIM 1

/* What the real <criterion/criterion.h> makes visible transitively. */
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <wchar.h>

#define CRS_WEAK_ __attribute__((weak))
#define CRS_NORETURN_ __attribute__((noreturn))
#define CRS_PRINTF_(f, a) __attribute__((format(printf, f, a)))

/* ---- public types (field names as in Criterion's criterion/types.h) ------ */

struct criterion_test_extra_data {
    int sentinel_;
    void (*init)(void);
    void (*fini)(void);
    int signal;
    int exit_code;
    bool disabled;
    const char *description;
    double timeout;
    void *data;
};

struct criterion_test_params {
    size_t size;
    void *params;
    size_t length;
    void (*cleanup)(struct criterion_test_params *);
};

/* ---- registry ----------------------------------------------------------- */

struct crs_test_ {
    const char *name;
    const char *suite;
    const char *file;
    unsigned line;
    void (*fn)(void);                            /* plain test */
    void (*pfn)(void *);                         /* parameterized test */
    struct criterion_test_params (*params)(void); /* its parameters */
    struct criterion_test_extra_data *data;
    struct crs_test_ *next;
};

struct crs_suite_ {
    const char *name;
    struct criterion_test_extra_data *data;
    struct crs_suite_ *next;
};

CRS_WEAK_ void crs_register_test_(struct crs_test_ *t);
CRS_WEAK_ void crs_register_suite_(struct crs_suite_ *s);

#define CRS_ID_(Suite, Name, Suffix) Suite##_##Name##_##Suffix

#define CRS_TEST_BASE_(Suite, Name, ...)                                          \
    void CRS_ID_(Suite, Name, impl)(void);                                        \
    static struct criterion_test_extra_data CRS_ID_(Suite, Name, extra) = {       \
        __VA_ARGS__};                                                             \
    static struct crs_test_ CRS_ID_(Suite, Name, meta) = {                        \
        #Name, #Suite, __FILE__, __LINE__, CRS_ID_(Suite, Name, impl), NULL,      \
        NULL, &CRS_ID_(Suite, Name, extra), NULL};                                \
    __attribute__((constructor)) static void CRS_ID_(Suite, Name, reg)(void)      \
    {                                                                             \
        crs_register_test_(&CRS_ID_(Suite, Name, meta));                          \
    }                                                                             \
    void CRS_ID_(Suite, Name, impl)(void)

#define CRS_SID_(Name, Suffix) crs_suite_##Name##_##Suffix

#define CRS_SUITE_BASE_(Name, ...)                                                \
    static struct criterion_test_extra_data CRS_SID_(Name, extra) = {__VA_ARGS__}; \
    static struct crs_suite_ CRS_SID_(Name, meta) = {                             \
        #Name, &CRS_SID_(Name, extra), NULL};                                     \
    __attribute__((constructor)) static void CRS_SID_(Name, reg)(void)            \
    {                                                                             \
        crs_register_suite_(&CRS_SID_(Name, meta));                               \
    }                                                                             \
    /* swallows the ';' after TestSuite(...) */                                  \
    struct crs_suite_ *CRS_SID_(Name, decl)(void)

/* Test(Suite, Name, .init = f, .fini = g, .timeout = s, .disabled = b, ...) */
#define Test(...) CRS_TEST_BASE_(__VA_ARGS__, .sentinel_ = 0)
/* TestSuite(Name, ...): defaults for every test of the suite; .init/.fini run
 * around each test's own (suite init, test init, body, test fini, suite fini). */
#define TestSuite(...) CRS_SUITE_BASE_(__VA_ARGS__, .sentinel_ = 0)

/* ---- runner interface used by the assertion macros ---------------------- */

/* A malloc'd printf-formatted string (NULL when out of memory). */
CRS_WEAK_ char *crs_format_(const char *fmt, ...) CRS_PRINTF_(1, 2);
/* A failed assertion: defmsg is Criterion's default message (malloc'd, freed
 * here), fmt the user's message prefixed with one extra character ("x"). */
CRS_WEAK_ CRS_NORETURN_ void crs_fail_abort_(const char *file, unsigned line, char *defmsg,
                                             const char *fmt, ...) CRS_PRINTF_(4, 5);
CRS_WEAK_ void crs_fail_continue_(const char *file, unsigned line, char *defmsg,
                                  const char *fmt, ...) CRS_PRINTF_(4, 5);
CRS_WEAK_ CRS_NORETURN_ void crs_skip_(const char *fmt, ...) CRS_PRINTF_(1, 2);

#include "alloc.h"
#include "assert.h"
#include "logging.h"

/* ---- runner ------------------------------------------------------------- */
#ifndef CRITERION_SHIM_NO_RUNNER

#include <errno.h>
#include <fnmatch.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <time.h>
#include <unistd.h>

enum crs_phase_ { CRS_IDLE_, CRS_SETUP_, CRS_MAIN_, CRS_TEARDOWN_ };

struct crs_state_ {
    struct crs_test_ *tests; /* sorted by (file, line): source order */
    struct crs_suite_ *suites;
    pthread_t runner;    /* the thread running the current test */
    jmp_buf jmp;
    int jmp_armed;       /* runner is set and jmp can be jumped to */
    /* the run in progress (read by the signal handlers) */
    const struct crs_test_ *volatile current;
    const struct criterion_test_extra_data *suite; /* its suite's defaults */
    void *param;
    void (*step)(void);
    volatile sig_atomic_t phase;
    atomic_int failed;   /* an assertion or expectation failed */
    int skipped;         /* cr_skip_test was called */
    char *skip_msg;      /* its message, prefixed with one character */
    int setup_failed;    /* an assertion failed in .init / .fini */
    unsigned timeout_s;  /* of the run in progress, 0: none */
    struct timespec start;
    /* totals, Criterion's meaning: tested excludes skipped tests */
    volatile sig_atomic_t tested, passed, failing, crashing, skipped_total;
};

CRS_WEAK_ struct crs_state_ crs_state_;

CRS_WEAK_ void crs_register_test_(struct crs_test_ *t)
{
    struct crs_test_ **p = &crs_state_.tests;
    while (*p) {
        int c = strcmp((*p)->file, t->file);
        if (c > 0 || (c == 0 && (*p)->line > t->line))
            break;
        p = &(*p)->next;
    }
    t->next = *p;
    *p = t;
}

CRS_WEAK_ void crs_register_suite_(struct crs_suite_ *s)
{
    s->next = crs_state_.suites;
    crs_state_.suites = s;
}

/* vasprintf without needing _GNU_SOURCE */
CRS_WEAK_ char *crs_vformat_(const char *fmt, va_list ap) CRS_PRINTF_(1, 0);
CRS_WEAK_ char *crs_vformat_(const char *fmt, va_list ap)
{
    va_list aq;
    va_copy(aq, ap);
    int n = vsnprintf(NULL, 0, fmt, aq);
    va_end(aq);
    if (n < 0)
        return NULL;
    char *s = malloc((size_t)n + 1);
    if (s)
        vsnprintf(s, (size_t)n + 1, fmt, ap);
    return s;
}

CRS_WEAK_ char *crs_format_(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    char *s = crs_vformat_(fmt, ap);
    va_end(ap);
    return s;
}

CRS_WEAK_ void crs_print_lines_(const char *prefix, const char *msg);
CRS_WEAK_ void crs_print_lines_(const char *prefix, const char *msg)
{
    const char *p = msg;
    do {
        const char *nl = strchr(p, '\n');
        int len = nl ? (int)(nl - p) : (int)strlen(p);
        fprintf(stderr, "%s%.*s\n", prefix, len, p);
        p = nl ? nl + 1 : NULL;
    } while (p);
}

/* Prints Criterion's "Assertion Failed" block and records the failure. */
CRS_WEAK_ void crs_report_failure_(const char *file, unsigned line, char *defmsg, const char *fmt,
                                   va_list ap);
CRS_WEAK_ void crs_report_failure_(const char *file, unsigned line, char *defmsg, const char *fmt,
                                   va_list ap)
{
    char *user = crs_vformat_(fmt, ap);
    const char *msg = user && user[1] ? user + 1 : defmsg ? defmsg : "(out of memory)";
    flockfile(stderr);
    fprintf(stderr, "[----] %s:%u: Assertion Failed\n[----]   \n", file, line);
    crs_print_lines_("[----]   ", msg);
    fprintf(stderr, "[----]   \n");
    funlockfile(stderr);
    free(user);
    free(defmsg);
    atomic_store(&crs_state_.failed, 1);
}

CRS_WEAK_ int crs_on_runner_thread_(void);
CRS_WEAK_ int crs_on_runner_thread_(void)
{
    return crs_state_.jmp_armed && pthread_equal(pthread_self(), crs_state_.runner);
}

CRS_WEAK_ void crs_fail_abort_(const char *file, unsigned line, char *defmsg, const char *fmt,
                               ...)
{
    va_list ap;
    va_start(ap, fmt);
    crs_report_failure_(file, line, defmsg, fmt, ap);
    va_end(ap);
    if (!crs_on_runner_thread_()) {
        /* Criterion would longjmp across threads here; stop loudly instead. */
        fprintf(stderr, "[----] criterion shim: a cr_assert failed outside the test's thread "
                        "(or outside a test); aborting\n");
        abort();
    }
    if (crs_state_.phase != CRS_MAIN_)
        crs_state_.setup_failed = 1;
    longjmp(crs_state_.jmp, 1);
}

CRS_WEAK_ void crs_fail_continue_(const char *file, unsigned line, char *defmsg,
                                  const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    crs_report_failure_(file, line, defmsg, fmt, ap);
    va_end(ap);
}

CRS_WEAK_ void crs_skip_(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    char *msg = crs_vformat_(fmt, ap);
    va_end(ap);
    if (!crs_on_runner_thread_() || !crs_state_.current) {
        fprintf(stderr, "[----] criterion shim: cr_skip_test outside the test's thread; aborting\n");
        abort();
    }
    free(crs_state_.skip_msg);
    crs_state_.skip_msg = msg;
    crs_state_.skipped = 1;
    longjmp(crs_state_.jmp, 1);
}

CRS_WEAK_ void cr_log(enum criterion_severity severity, const char *msg, ...)
{
    static const char *const prefix[] = {"[----] ", "[WARN] ", "[ERR ] "};
    va_list ap;
    va_start(ap, msg);
    char *s = crs_vformat_(msg, ap);
    va_end(ap);
    unsigned k = (unsigned)severity < 3 ? (unsigned)severity : 0;
    flockfile(stderr);
    crs_print_lines_(prefix[k], s ? s : msg);
    funlockfile(stderr);
    free(s);
}

CRS_WEAK_ void *cr_malloc(size_t size) { return malloc(size); }
CRS_WEAK_ void *cr_calloc(size_t nmemb, size_t size) { return calloc(nmemb, size); }
CRS_WEAK_ void *cr_realloc(void *ptr, size_t size) { return realloc(ptr, size); }
CRS_WEAK_ void cr_free(void *ptr) { free(ptr); }

/* ---- async-signal-safe output for the timeout / crash / exit paths ------ */

struct crs_buf_ {
    char s[512];
    size_t n;
};

CRS_WEAK_ void crs_buf_str_(struct crs_buf_ *b, const char *s);
CRS_WEAK_ void crs_buf_str_(struct crs_buf_ *b, const char *s)
{
    while (*s && b->n < sizeof b->s)
        b->s[b->n++] = *s++;
}

CRS_WEAK_ void crs_buf_uint_(struct crs_buf_ *b, unsigned long v, int min_digits);
CRS_WEAK_ void crs_buf_uint_(struct crs_buf_ *b, unsigned long v, int min_digits)
{
    char d[24];
    int n = 0;
    do {
        d[n++] = (char)('0' + v % 10);
        v /= 10;
    } while (v && n < (int)sizeof d);
    while (n < min_digits && n < (int)sizeof d)
        d[n++] = '0';
    while (n > 0 && b->n < sizeof b->s)
        b->s[b->n++] = d[--n];
}

CRS_WEAK_ void crs_buf_flush_(struct crs_buf_ *b);
CRS_WEAK_ void crs_buf_flush_(struct crs_buf_ *b)
{
    size_t off = 0;
    while (off < b->n) {
        ssize_t w = write(STDERR_FILENO, b->s + off, b->n - off);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            break;
        off += (size_t)w;
    }
    b->n = 0;
}

/* Elapsed time of the current run in hundredths of a second. */
CRS_WEAK_ unsigned long crs_elapsed_cs_(void);
CRS_WEAK_ unsigned long crs_elapsed_cs_(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    long long ns = (long long)(now.tv_sec - crs_state_.start.tv_sec) * 1000000000LL +
                   (now.tv_nsec - crs_state_.start.tv_nsec);
    return ns > 0 ? (unsigned long)(ns / 10000000LL) : 0;
}

CRS_WEAK_ void crs_buf_secs_(struct crs_buf_ *b, unsigned long cs);
CRS_WEAK_ void crs_buf_secs_(struct crs_buf_ *b, unsigned long cs)
{
    crs_buf_uint_(b, cs / 100, 1);
    crs_buf_str_(b, ".");
    crs_buf_uint_(b, cs % 100, 2);
}

/* Under mpirun every process runs the same tests (tests built with
 * -DTP_TEST_MPI): only the first process reports skips and the synthesis, the
 * others report only failures, so that summed counts are per test, not per
 * process. */
CRS_WEAK_ int crs_quiet_(void);
CRS_WEAK_ int crs_quiet_(void)
{
    const char *r = getenv("OMPI_COMM_WORLD_RANK");
    if (!r)
        r = getenv("PMI_RANK");
    return r && strcmp(r, "0") != 0;
}

CRS_WEAK_ void crs_buf_synthesis_(struct crs_buf_ *b);
CRS_WEAK_ void crs_buf_synthesis_(struct crs_buf_ *b)
{
    crs_buf_str_(b, "[====] Synthesis: Tested: ");
    crs_buf_uint_(b, (unsigned long)crs_state_.tested, 1);
    crs_buf_str_(b, " | Passing: ");
    crs_buf_uint_(b, (unsigned long)crs_state_.passed, 1);
    crs_buf_str_(b, " | Failing: ");
    crs_buf_uint_(b, (unsigned long)crs_state_.failing, 1);
    crs_buf_str_(b, " | Crashing: ");
    crs_buf_uint_(b, (unsigned long)crs_state_.crashing, 1);
    crs_buf_str_(b, " \n");
}

/* The run in progress cannot finish (timeout, crash, exit): report it as a
 * failure, print the synthesis and say that the remaining tests did not run. */
CRS_WEAK_ void crs_die_report_(const char *what, int crashed);
CRS_WEAK_ void crs_die_report_(const char *what, int crashed)
{
    const struct crs_test_ *t = crs_state_.current;
    struct crs_buf_ b = {.n = 0};
    if (t) {
        crs_state_.tested++;
        crs_state_.failing++;
        if (crashed)
            crs_state_.crashing++;
        crs_buf_str_(&b, "[FAIL] ");
        crs_buf_str_(&b, t->suite);
        crs_buf_str_(&b, "::");
        crs_buf_str_(&b, t->name);
        crs_buf_str_(&b, ": ");
        crs_buf_str_(&b, what);
        crs_buf_str_(&b, "\n");
        crs_buf_flush_(&b);
    }
    crs_buf_str_(&b, "[----] criterion shim: the tests run in one process; the remaining "
                     "tests were not run\n");
    crs_buf_flush_(&b);
    crs_buf_synthesis_(&b);
    crs_buf_flush_(&b);
}

CRS_WEAK_ void crs_on_alarm_(int sig);
CRS_WEAK_ void crs_on_alarm_(int sig)
{
    (void)sig;
    struct crs_buf_ b = {.n = 0};
    crs_buf_str_(&b, "Timed out. (");
    crs_buf_secs_(&b, crs_elapsed_cs_());
    crs_buf_str_(&b, "s, limit ");
    crs_buf_uint_(&b, crs_state_.timeout_s, 1);
    crs_buf_str_(&b, "s)");
    b.s[b.n < sizeof b.s ? b.n : sizeof b.s - 1] = '\0';
    crs_die_report_(b.s, 0);
    _exit(1);
}

CRS_WEAK_ void crs_on_crash_(int sig);
CRS_WEAK_ void crs_on_crash_(int sig)
{
    struct crs_buf_ b = {.n = 0};
    crs_buf_str_(&b, "CRASH! (signal ");
    crs_buf_uint_(&b, (unsigned long)sig, 1);
    crs_buf_str_(&b, crs_state_.phase == CRS_MAIN_ ? ")" : ", during setup or teardown)");
    b.s[b.n < sizeof b.s ? b.n : sizeof b.s - 1] = '\0';
    crs_die_report_(b.s, 1);
    /* SA_RESETHAND restored the default action: die of the same signal */
    raise(sig);
}

CRS_WEAK_ void crs_on_exit_(void);
CRS_WEAK_ void crs_on_exit_(void)
{
    if (crs_state_.phase == CRS_IDLE_)
        return;
    crs_die_report_("the test called exit() (Criterion's .exit_code is not supported by the "
                    "in-process shim)", 0);
    _exit(1);
}

/* ---- running -------------------------------------------------------------- */

CRS_WEAK_ const struct criterion_test_extra_data *crs_suite_data_(const char *name);
CRS_WEAK_ const struct criterion_test_extra_data *crs_suite_data_(const char *name)
{
    for (const struct crs_suite_ *s = crs_state_.suites; s; s = s->next)
        if (strcmp(s->name, name) == 0)
            return s->data;
    return NULL;
}

/* The steps of one run, each called through crs_guarded_ (no local state
 * lives across its setjmp: everything is in crs_state_). */
CRS_WEAK_ void crs_step_main_(void);
CRS_WEAK_ void crs_step_main_(void)
{
    const struct crs_test_ *t = crs_state_.current;
    if (crs_state_.suite && crs_state_.suite->init)
        crs_state_.suite->init();
    if (t->data->init)
        t->data->init();
    crs_state_.phase = CRS_MAIN_;
    if (t->pfn)
        t->pfn(crs_state_.param);
    else
        t->fn();
}

CRS_WEAK_ void crs_step_test_fini_(void);
CRS_WEAK_ void crs_step_test_fini_(void)
{
    if (crs_state_.current->data->fini)
        crs_state_.current->data->fini();
}

CRS_WEAK_ void crs_step_suite_fini_(void);
CRS_WEAK_ void crs_step_suite_fini_(void)
{
    if (crs_state_.suite && crs_state_.suite->fini)
        crs_state_.suite->fini();
}

/* Runs crs_state_.step; a failed cr_assert or cr_skip_test longjmps back here. */
CRS_WEAK_ void crs_guarded_(void);
CRS_WEAK_ void crs_guarded_(void)
{
    if (setjmp(crs_state_.jmp) == 0)
        crs_state_.step();
}

/* The thread one run happens on: setup and body, then the teardown (which
 * also runs after a failed setup: in one process, whatever the setup changed
 * must be undone before the next test). */
CRS_WEAK_ void *crs_test_thread_(void *arg);
CRS_WEAK_ void *crs_test_thread_(void *arg)
{
    (void)arg;
    crs_state_.runner = pthread_self();
    crs_state_.jmp_armed = 1;
    crs_state_.step = crs_step_main_;
    crs_guarded_();
    crs_state_.phase = CRS_TEARDOWN_;
    crs_state_.step = crs_step_test_fini_;
    crs_guarded_();
    crs_state_.step = crs_step_suite_fini_;
    crs_guarded_();
    crs_state_.jmp_armed = 0;
    return NULL;
}

/* One run of a test (one parameter of a parameterized test). */
CRS_WEAK_ void crs_run_one_(const struct crs_test_ *t, const struct criterion_test_extra_data *sd,
                            void *param);
CRS_WEAK_ void crs_run_one_(const struct crs_test_ *t, const struct criterion_test_extra_data *sd,
                            void *param)
{
    const struct criterion_test_extra_data *td = t->data;
    double timeout = td->timeout > 0 ? td->timeout : sd && sd->timeout > 0 ? sd->timeout : 0;

    atomic_store(&crs_state_.failed, 0);
    crs_state_.skipped = 0;
    crs_state_.setup_failed = 0;
    crs_state_.current = t;
    crs_state_.suite = sd;
    crs_state_.param = param;
    unsigned whole = timeout > 0 && timeout < 4e9 ? (unsigned)timeout : 0;
    crs_state_.timeout_s = whole + (timeout > (double)whole && timeout < 4e9); /* ceil */
    fflush(NULL);
    clock_gettime(CLOCK_MONOTONIC, &crs_state_.start);
    alarm(crs_state_.timeout_s);

    crs_state_.phase = CRS_SETUP_;
    /* A fresh thread per run: thread-local state (libtp's last error, scope
     * stack, phase) starts clean as in Criterion's fresh process per test. */
    pthread_attr_t attr;
    pthread_t th;
    int rc = pthread_attr_init(&attr);
    if (rc == 0) {
        pthread_attr_setstacksize(&attr, (size_t)64 << 20);
        rc = pthread_create(&th, &attr, crs_test_thread_, NULL);
        pthread_attr_destroy(&attr);
    }
    if (rc == 0) {
        pthread_join(th, NULL);
    } else {
        fprintf(stderr, "[----] criterion shim: cannot start the test's thread: %s\n",
                strerror(rc));
        atomic_store(&crs_state_.failed, 1);
    }

    alarm(0);
    unsigned long cs = crs_elapsed_cs_();
    crs_state_.phase = CRS_IDLE_;
    crs_state_.current = NULL;

    if (crs_state_.setup_failed) {
        fprintf(stderr, "[----] Warning! The test `%s::%s` crashed during its setup or teardown.\n",
                t->suite, t->name);
        crs_state_.tested++;
        crs_state_.failing++;
        crs_state_.crashing++;
    } else if (atomic_load(&crs_state_.failed)) {
        fprintf(stderr, "[FAIL] %s::%s: (%lu.%02lus)\n", t->suite, t->name, cs / 100, cs % 100);
        crs_state_.tested++;
        crs_state_.failing++;
    } else if (crs_state_.skipped) {
        const char *m = crs_state_.skip_msg;
        if (!crs_quiet_())
            fprintf(stderr, "[SKIP] %s::%s: %s\n", t->suite, t->name, m ? m + 1 : "");
        crs_state_.skipped_total++;
    } else {
        crs_state_.tested++;
        crs_state_.passed++;
    }
    free(crs_state_.skip_msg);
    crs_state_.skip_msg = NULL;
    fflush(stderr);
}

CRS_WEAK_ void crs_usage_(const char *argv0);
CRS_WEAK_ void crs_usage_(const char *argv0)
{
    fprintf(stderr,
            "usage: %s [--jobs N] [--filter PATTERN] [--verbose]\n"
            "  in-process Criterion stand-in (tests/shim); --jobs and --verbose are accepted\n"
            "  and ignored (skips and failures are always printed),\n"
            "  --filter runs the tests whose \"suite/name\" matches the glob PATTERN\n",
            argv0);
}

CRS_WEAK_ int main(int argc, char **argv)
{
    const char *filter = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--jobs") == 0 || strcmp(a, "-j") == 0) {
            if (++i >= argc) {
                crs_usage_(argv[0]);
                return 2;
            }
        } else if (strncmp(a, "--jobs=", 7) == 0 || (strncmp(a, "-j", 2) == 0 && a[2]) ||
                   strcmp(a, "--verbose") == 0 || strncmp(a, "--verbose=", 10) == 0) {
            /* ignored: the shim always runs one test at a time */
        } else if (strcmp(a, "--filter") == 0) {
            if (++i >= argc) {
                crs_usage_(argv[0]);
                return 2;
            }
            filter = argv[i];
        } else if (strncmp(a, "--filter=", 9) == 0) {
            filter = a + 9;
        } else if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            crs_usage_(argv[0]);
            return 0;
        } else {
            fprintf(stderr, "criterion shim: unsupported argument '%s'\n", a);
            crs_usage_(argv[0]);
            return 2;
        }
    }

    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sigemptyset(&sa.sa_mask);
    sa.sa_handler = crs_on_alarm_;
    sigaction(SIGALRM, &sa, NULL);
    sa.sa_handler = crs_on_crash_;
    sa.sa_flags = SA_RESETHAND | SA_NODEFER;
    static const int deadly[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};
    for (size_t k = 0; k < sizeof deadly / sizeof deadly[0]; k++)
        sigaction(deadly[k], &sa, NULL);
    atexit(crs_on_exit_);

    for (const struct crs_test_ *t = crs_state_.tests; t; t = t->next) {
        if (filter) {
            char id[512];
            snprintf(id, sizeof id, "%s/%s", t->suite, t->name);
            if (fnmatch(filter, id, 0) != 0)
                continue;
        }
        const struct criterion_test_extra_data *sd = crs_suite_data_(t->suite);
        if (t->data->disabled || (sd && sd->disabled)) {
            fprintf(stderr, "[SKIP] %s::%s: Test is disabled\n", t->suite, t->name);
            crs_state_.skipped_total++;
            continue;
        }
        if (t->data->signal || t->data->exit_code || (sd && (sd->signal || sd->exit_code))) {
            fprintf(stderr, "[SKIP] %s::%s: .signal / .exit_code need one process per test; "
                            "not run by the in-process shim\n", t->suite, t->name);
            crs_state_.skipped_total++;
            continue;
        }
        if (!t->pfn) {
            crs_run_one_(t, sd, NULL);
            continue;
        }
        struct criterion_test_params p = t->params();
        for (size_t k = 0; k < p.length; k++)
            crs_run_one_(t, sd, (char *)p.params + k * p.size);
        if (p.cleanup)
            p.cleanup(&p);
    }

    struct crs_buf_ b = {.n = 0};
    if (!crs_quiet_() || crs_state_.failing > 0 || crs_state_.crashing > 0)
        crs_buf_synthesis_(&b);
    fflush(NULL);
    crs_buf_flush_(&b);
    return crs_state_.failing > 0 || crs_state_.crashing > 0;
}

#endif /* !CRITERION_SHIM_NO_RUNNER */

#endif /* !CRITERION_SHIM_CRITERION_H_ */
