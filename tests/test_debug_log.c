/* TP_DEBUG and TP_DEBUG_FILE: the lines a colwise+rowwise MLP prints at
 * INFO and TRACE, one file per rank, against the comm-debug counter of the
 * same run; nothing when unset; a clear warning for a bad value or an
 * unwritable file. The level is read once per process, so every case runs
 * debug_log_child (TP_DEBUG_LOG_CHILD, set by meson) in a process of its own
 * with the environment it needs. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tp_test.h"

#define DL_TIMEOUT 120

extern char **environ;

typedef struct {
    char base[64];  /* a fresh directory, removed by cleanup() */
    char dir[256];  /* where the log files go: nothing else is written there */
    char out[300];  /* the child's stdout and stderr, outside dir */
    char err[300];
    int status;     /* exit status, -1 if it did not exit */
    int pid;        /* as the child printed it */
} child_run;

static const char *child_path(void)
{
    const char *p = getenv("TP_DEBUG_LOG_CHILD");
    cr_assert(p && *p, "TP_DEBUG_LOG_CHILD is not set (run through meson test)");
    return p;
}

/* Runs the child with argv[1..] and the environment minus TP_DEBUG*, plus
 * `level` (NULL: unset) and `file` ("%d" in it: the log dir). */
static void run_child(child_run *c, const char *level, const char *file, const char *mode,
                      const char *ranks)
{
    snprintf(c->base, sizeof c->base, "/tmp/tp-debug-log-XXXXXX");
    cr_assert_not_null(mkdtemp(c->base), "mkdtemp: %s", strerror(errno));
    snprintf(c->dir, sizeof c->dir, "%s/logs", c->base);
    cr_assert_eq(mkdir(c->dir, 0700), 0);
    snprintf(c->out, sizeof c->out, "%s/stdout", c->base);
    snprintf(c->err, sizeof c->err, "%s/stderr", c->base);

    static char *envp[512];
    static char lvl[64], fil[600];
    int n = 0;
    for (char **e = environ; *e && n < 500; e++)
        if (strncmp(*e, "TP_DEBUG", 8) != 0)
            envp[n++] = *e;
    if (level) {
        snprintf(lvl, sizeof lvl, "TP_DEBUG=%s", level);
        envp[n++] = lvl;
    }
    if (file) {
        char path[512];
        snprintf(path, sizeof path, file, c->dir);
        snprintf(fil, sizeof fil, "TP_DEBUG_FILE=%s", path);
        envp[n++] = fil;
    }
    envp[n] = NULL;

    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, c->out, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    posix_spawn_file_actions_addopen(&fa, 2, c->err, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    char *argv[] = {(char *)child_path(), (char *)mode, (char *)ranks, NULL};
    pid_t pid = 0;
    int rc = posix_spawn(&pid, argv[0], &fa, NULL, argv, envp);
    posix_spawn_file_actions_destroy(&fa);
    cr_assert_eq(rc, 0, "posix_spawn %s: %s", argv[0], strerror(rc));
    int ws = 0;
    cr_assert_eq(waitpid(pid, &ws, 0), pid);
    c->status = WIFEXITED(ws) ? WEXITSTATUS(ws) : -1;
    c->pid = -1;
    FILE *f = fopen(c->out, "r");
    cr_assert_not_null(f);
    cr_assert_eq(fscanf(f, "pid %d", &c->pid), 1, "the child printed no pid");
    fclose(f);
    cr_assert_eq(c->pid, (int)pid);
}

/* Removes what run_child made (left in place when a case fails, to look at). */
static void cleanup(const child_run *c)
{
    DIR *d = opendir(c->dir);
    for (struct dirent *e; d && (e = readdir(d));) {
        char path[600];
        snprintf(path, sizeof path, "%s/%s", c->dir, e->d_name);
        if (e->d_name[0] != '.')
            unlink(path);
    }
    if (d)
        closedir(d);
    rmdir(c->dir);
    unlink(c->out);
    unlink(c->err);
    rmdir(c->base);
}

/* The whole file into a malloc'd string ("" if absent, NULL never). */
static char *slurp(const char *path)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return calloc(1, 1);
    size_t cap = 1 << 16, n = 0;
    char *s = malloc(cap);
    cr_assert_not_null(s);
    size_t k;
    while ((k = fread(s + n, 1, cap - n - 1, f)) > 0) {
        n += k;
        if (n + 1 == cap) {
            cap *= 2;
            s = realloc(s, cap);
            cr_assert_not_null(s);
        }
    }
    s[n] = '\0';
    fclose(f);
    return s;
}

static int count_substr(const char *s, const char *sub)
{
    int n = 0;
    for (const char *p = strstr(s, sub); p; p = strstr(p + 1, sub))
        n++;
    return n;
}

/* Lines of s that contain every one of the NULL-terminated needles. */
static int count_lines_with(const char *s, const char *const *needles)
{
    int n = 0;
    while (*s) {
        const char *e = strchr(s, '\n');
        size_t len = e ? (size_t)(e - s) : strlen(s);
        bool all = true;
        for (const char *const *nd = needles; *nd && all; nd++) {
            const char *p = s;
            bool found = false;
            size_t k = strlen(*nd);
            for (; p + k <= s + len && !found; p++)
                found = memcmp(p, *nd, k) == 0;
            all = found;
        }
        n += all;
        s += len + (e ? 1 : 0);
    }
    return n;
}

/* Every line is "libtp <host>:<pid>:<tid> [<rank>] <LEVEL> <text>". */
static void assert_line_format(const char *s, int pid, int rank, const char *what)
{
    int lines = 0;
    while (*s) {
        const char *e = strchr(s, '\n');
        cr_assert_not_null(e, "%s: last line not terminated", what);
        char host[128], level[16];
        int lpid = -1, tid = -1, lrank = -1, off = 0;
        int got = sscanf(s, "libtp %127[^:]:%d:%d [%d] %15s %n", host, &lpid, &tid, &lrank,
                         level, &off);
        cr_assert(got == 5 && off > 0, "%s: malformed line: %.*s", what, (int)(e - s), s);
        cr_assert_eq(lpid, pid, "%s: pid in %.*s", what, (int)(e - s), s);
        cr_assert_eq(lrank, rank, "%s: rank in %.*s", what, (int)(e - s), s);
        cr_assert(tid > 0);
        cr_assert(!strcmp(level, "INFO") || !strcmp(level, "TRACE"), "%s: level %s", what,
                  level);
        lines++;
        s = e + 1;
    }
    cr_assert_gt(lines, 0, "%s is empty", what);
}

static int files_in(const char *dir)
{
    DIR *d = opendir(dir);
    cr_assert_not_null(d);
    int n = 0;
    for (struct dirent *e; (e = readdir(d));)
        n += e->d_name[0] != '.';
    closedir(d);
    return n;
}

typedef struct {
    long long total, bytes, kinds[TP_COLL_KIND_COUNT];
} counted;

/* The counter's numbers the child printed for rank r. */
static counted child_counts(const child_run *c, int r)
{
    char *out = slurp(c->out);
    char key[32];
    snprintf(key, sizeof key, "\nrank %d total ", r);
    const char *p = strstr(out, key);
    cr_assert_not_null(p, "no counts for rank %d in:\n%s", r, out);
    counted k;
    int off = 0;
    cr_assert_eq(sscanf(p + strlen(key), "%lld kinds%n", &k.total, &off), 1);
    p += strlen(key) + (size_t)off;
    for (int i = 0; i < TP_COLL_KIND_COUNT; i++) {
        cr_assert_eq(sscanf(p, " %lld%n", &k.kinds[i], &off), 1);
        p += off;
    }
    cr_assert_eq(sscanf(p, " bytes %lld", &k.bytes), 1);
    free(out);
    return k;
}

static void log_path(const child_run *c, int r, char *buf, size_t len)
{
    snprintf(buf, len, "%s/tp-%d.log", c->dir, r);
}

/* ---- INFO and TRACE, one file per rank --------------------------------------- */

/* The MLP's lines on rank r of n: the op lines with their strategies, each
 * redistribute step (one P(sum) -> R all_reduce per all_reduce the counter
 * saw), and at TRACE each collective the counter saw, with its bytes. */
static void check_rank_log(const child_run *c, int n, int r, bool trace, char *comm_id)
{
    char path[512], what[600];
    log_path(c, r, path, sizeof path);
    snprintf(what, sizeof what, "%s (n=%d)", path, n);
    char *log = slurp(path);
    assert_line_format(log, c->pid, r, what);
    counted k = child_counts(c, r);

    char colwise[160], rowwise[160], bwd_col[160], bwd_row[160], step[200];
    snprintf(colwise, sizeof colwise, "] INFO op linear on mesh (tp=%d): x [4, 6] (R), weight "
             "[6, 6] (S(0)), bias [6] (S(0)) -> out (S(1))\n", n);
    snprintf(rowwise, sizeof rowwise, "] INFO op linear on mesh (tp=%d): x [4, 6] (S(1)), "
             "weight [5, 6] (S(1)), bias [5] (R) -> out (P(sum))\n", n);
    snprintf(bwd_row, sizeof bwd_row, "] INFO op linear backward on mesh (tp=%d): grad out (R) "
             "-> grad x (S(1)), grad weight (S(1)), grad bias (R)\n", n);
    snprintf(bwd_col, sizeof bwd_col, "] INFO op linear backward on mesh (tp=%d): grad out "
             "(S(1)) -> grad x (P(sum)), grad weight (S(0)), grad bias (S(0))\n", n);
    snprintf(step, sizeof step, "] INFO redistribute [4, 5] (P(sum)) -> (R) step 1/1: mesh dim "
             "0 (tp=%d) P(sum) -> R, %s, input f32 [4, 5], 80 bytes\n", n,
             n > 1 ? "all_reduce" : "no collective");
    cr_assert_eq(count_substr(log, colwise), 1, "%s: %s missing:\n%s", what, colwise, log);
    cr_assert_eq(count_substr(log, rowwise), 1, "%s: %s missing:\n%s", what, rowwise, log);
    cr_assert_eq(count_substr(log, bwd_row), 1, "%s: %s missing:\n%s", what, bwd_row, log);
    cr_assert_eq(count_substr(log, bwd_col), 1, "%s: %s missing:\n%s", what, bwd_col, log);
    cr_assert_eq(count_substr(log, step), 1, "%s: %s missing:\n%s", what, step, log);
    /* the colwise backward's P(sum) gradient of x, made R by the style */
    snprintf(step, sizeof step, "] INFO redistribute [4, 6] (P(sum)) -> (R) step 1/1: mesh dim "
             "0 (tp=%d) P(sum) -> R, %s, input f32 [4, 6], 96 bytes\n", n,
             n > 1 ? "all_reduce" : "no collective");
    cr_assert_eq(count_substr(log, step), 1, "%s: %s missing:\n%s", what, step, log);
    /* every all_reduce of the run is one of those steps */
    const char *ar_steps[] = {"] INFO redistribute ", ", all_reduce, ", NULL};
    cr_assert_eq(count_lines_with(log, ar_steps), k.kinds[TP_COLL_ALL_REDUCE],
                 "%s: all_reduce steps vs the counter's %lld", what, k.kinds[TP_COLL_ALL_REDUCE]);
    cr_assert_eq(k.kinds[TP_COLL_ALL_REDUCE], n > 1 ? 2 : 0, "%s: counter", what);

    char comm[64];
    snprintf(comm, sizeof comm, " (shm, rank %d of %d): ", r, n);
    const char *coll[] = {"] TRACE coll ", NULL};
    if (!trace) {
        cr_assert_eq(count_lines_with(log, coll), 0, "%s: TRACE lines at INFO", what);
        free(log);
        return;
    }
    cr_assert_eq(count_lines_with(log, coll), k.total, "%s: coll lines vs the counter's %lld",
                 what, k.total);
    cr_assert(n == 1 || k.total > 0, "%s: the counter saw no collective", what);
    long long bytes = 0;
    for (int kind = 0; kind < TP_COLL_KIND_COUNT; kind++) {
        char name[48];
        snprintf(name, sizeof name, "] TRACE coll %s comm ", tp_coll_kind_name(kind));
        const char *nd[] = {name, comm, " us", NULL};
        cr_assert_eq(count_lines_with(log, nd), k.kinds[kind], "%s: %s lines", what,
                     tp_coll_kind_name(kind));
    }
    for (const char *p = strstr(log, "] TRACE coll "); p; p = strstr(p + 1, "] TRACE coll ")) {
        const char *e = strchr(p, '\n'), *b = strstr(p, " bytes");
        cr_assert(b && b < e, "%s: no bytes in %.*s", what, (int)(e - p), p);
        while (b[-1] >= '0' && b[-1] <= '9')
            b--;
        bytes += atoll(b);
    }
    cr_assert_eq(bytes, k.bytes, "%s: bytes in the log %lld vs the counter's %lld", what, bytes,
                 k.bytes);
    /* one communicator (the world), comm_id its id */
    char id[16];
    for (const char *p = strstr(log, " comm "); p; p = strstr(p + 1, " comm ")) {
        cr_assert_eq(sscanf(p, " comm %15s", id), 1);
        if (!comm_id[0])
            memcpy(comm_id, id, sizeof id);
        cr_assert_str_eq(id, comm_id, "%s: one communicator", what);
    }
    free(log);
}

static void mlp_case(const char *level, int n)
{
    child_run c;
    char ranks[8];
    snprintf(ranks, sizeof ranks, "%d", n);
    run_child(&c, level, "%s/tp-%%r.log", "mlp", ranks);
    char *err = slurp(c.err);
    cr_assert_eq(c.status, 0, "child exited %d:\n%s", c.status, err);
    cr_assert_eq(count_substr(err, "libtp "), 0, "nothing on stderr with a file:\n%s", err);
    free(err);
    cr_assert_eq(files_in(c.dir), n, "one file per rank");
    char comm_id[16] = ""; /* the world's, the same on every rank */
    for (int r = 0; r < n; r++)
        check_rank_log(&c, n, r, strcmp(level, "TRACE") == 0, comm_id);
    cleanup(&c);
}

Test(debug_log, info_2_ranks, .timeout = DL_TIMEOUT) { mlp_case("INFO", 2); }
Test(debug_log, info_3_ranks, .timeout = DL_TIMEOUT) { mlp_case("info", 3); }
Test(debug_log, trace_1_rank, .timeout = DL_TIMEOUT) { mlp_case("TRACE", 1); }
Test(debug_log, trace_2_ranks, .timeout = DL_TIMEOUT) { mlp_case("TRACE", 2); }
Test(debug_log, trace_3_ranks, .timeout = DL_TIMEOUT) { mlp_case("TRACE", 3); }

/* ---- off, and its variants --------------------------------------------------- */

static void quiet_case(const char *level)
{
    child_run c;
    run_child(&c, level, "%s/tp-%%r.log", "mlp", "2");
    char *err = slurp(c.err);
    cr_assert_eq(c.status, 0, "child exited %d:\n%s", c.status, err);
    cr_assert_eq(count_substr(err, "libtp "), 0, "TP_DEBUG=%s: stderr:\n%s",
                 level ? level : "(unset)", err);
    cr_assert_eq(files_in(c.dir), 0, "TP_DEBUG=%s: no file", level ? level : "(unset)");
    free(err);
    cleanup(&c);
}

Test(debug_log, unset_no_file_no_output, .timeout = DL_TIMEOUT) { quiet_case(NULL); }
Test(debug_log, off_no_file_no_output, .timeout = DL_TIMEOUT) { quiet_case("OFF"); }
/* WARN prints failures only: the MLP has none */
Test(debug_log, warn_quiet_when_nothing_fails, .timeout = DL_TIMEOUT) { quiet_case("WARN"); }

Test(debug_log, unknown_level_warns_once_and_means_off, .timeout = DL_TIMEOUT)
{
    child_run c;
    run_child(&c, "LOUD", "%s/tp-%%r.log", "mlp", "3");
    char *err = slurp(c.err);
    cr_assert_eq(c.status, 0, "child exited %d:\n%s", c.status, err);
    cr_assert_eq(count_substr(err, "libtp "), 1, "one line:\n%s", err);
    cr_assert_eq(count_substr(err, " WARN TP_DEBUG=\"LOUD\" is not OFF, WARN, INFO or TRACE; "
                                   "debug output stays off\n"), 1, "stderr:\n%s", err);
    cr_assert_eq(files_in(c.dir), 0);
    free(err);
    cleanup(&c);
}

/* ---- bad files and failures ---------------------------------------------------- */

Test(debug_log, unwritable_file_warns_once_and_prints_to_stderr, .timeout = DL_TIMEOUT)
{
    child_run c;
    run_child(&c, "INFO", "%s/missing-dir/tp-%%r.log", "mlp", "3");
    char *err = slurp(c.err);
    cr_assert_eq(c.status, 0, "child exited %d:\n%s", c.status, err);
    char want[600];
    snprintf(want, sizeof want, " WARN TP_DEBUG_FILE: cannot open \"%s/missing-dir/tp-",
             c.dir);
    cr_assert_eq(count_substr(err, want), 1, "one warning for three ranks:\n%s", err);
    cr_assert_eq(count_substr(err, "No such file or directory; printing to stderr instead "
                                   "(reported once)\n"), 1, "stderr:\n%s", err);
    cr_assert_eq(count_substr(err, " WARN "), 1, "stderr:\n%s", err);
    /* the lines went to stderr instead, every rank's */
    for (int r = 0; r < 3; r++) {
        char tag[32];
        snprintf(tag, sizeof tag, " [%d] INFO op linear on mesh ", r);
        cr_assert_eq(count_substr(err, tag), 2, "rank %d's op lines on stderr:\n%s", r, err);
    }
    cr_assert_eq(files_in(c.dir), 0);
    free(err);
    cleanup(&c);
}

Test(debug_log, stderr_without_file, .timeout = DL_TIMEOUT)
{
    child_run c;
    run_child(&c, "TRACE", NULL, "mlp", "2");
    char *err = slurp(c.err);
    cr_assert_eq(c.status, 0, "child exited %d:\n%s", c.status, err);
    for (int r = 0; r < 2; r++) {
        char tag[64];
        snprintf(tag, sizeof tag, " [%d] INFO op linear on mesh (tp=2)", r);
        cr_assert_eq(count_substr(err, tag), 2, "rank %d:\n%s", r, err);
        counted k = child_counts(&c, r);
        snprintf(tag, sizeof tag, " [%d] TRACE coll ", r);
        cr_assert_eq(count_substr(err, tag), k.total, "rank %d:\n%s", r, err);
    }
    free(err);
    cleanup(&c);
}

Test(debug_log, file_pattern_pid_and_percent, .timeout = DL_TIMEOUT)
{
    child_run c;
    run_child(&c, "INFO", "%s/%%%%-%%p-%%r.log", "mlp", "2");
    cr_assert_eq(c.status, 0);
    cr_assert_eq(files_in(c.dir), 2);
    for (int r = 0; r < 2; r++) {
        char path[600];
        snprintf(path, sizeof path, "%s/%%-%d-%d.log", c.dir, c.pid, r);
        char *log = slurp(path);
        assert_line_format(log, c.pid, r, path);
        free(log);
    }
    cleanup(&c);
}

Test(debug_log, warn_names_a_failed_collective, .timeout = DL_TIMEOUT)
{
    child_run c;
    run_child(&c, "WARN", NULL, "fail", NULL);
    char *err = slurp(c.err);
    cr_assert_eq(c.status, 0, "child exited %d:\n%s", c.status, err);
    cr_assert_eq(count_substr(err, "libtp "), 1, "one line:\n%s", err);
    cr_assert_eq(count_substr(err, " [0] WARN tp_all_reduce failed: TP_ERR_INVALID_ARG: "
                                   "tp_all_reduce: send has 4 elements but recv has 5\n"),
                 1, "stderr:\n%s", err);
    free(err);
    cleanup(&c);
}
