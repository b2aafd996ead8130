/* Status strings and the per-thread last-error text. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/core.h"

#define TP__ERRLEN 1024

static _Thread_local char tp__errbuf[TP__ERRLEN];

const char *tp_status_string(tp_status status)
{
    switch (status) {
#define TP__STATUS_STR(name, value, desc)                                       \
    case name:                                                                  \
        return desc;
        TP_STATUS_LIST(TP__STATUS_STR)
#undef TP__STATUS_STR
    }
    return "unknown status";
}

const char *tp_status_name(tp_status status)
{
    switch (status) {
#define TP__STATUS_NAME(name, value, desc)                                      \
    case name:                                                                  \
        return #name;
        TP_STATUS_LIST(TP__STATUS_NAME)
#undef TP__STATUS_NAME
    }
    return "unknown status";
}

const char *tp_last_error(void) { return tp__errbuf; }

void tp_clear_error(void) { tp__errbuf[0] = '\0'; }

const char *tp_version(void) { return TP_VERSION; }

tp_status tp__error(tp_status status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tp__errbuf, sizeof tp__errbuf, fmt, ap);
    va_end(ap);
    return status;
}

void tp__error_prefix(const char *fmt, ...)
{
    char buf[TP__ERRLEN];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n + 2 >= sizeof buf)
        return;
    memcpy(buf + n, ": ", 2);
    size_t room = sizeof buf - (size_t)n - 2 - 1, len = strlen(tp__errbuf);
    if (len > room)
        len = room;
    memcpy(buf + n + 2, tp__errbuf, len);
    buf[(size_t)n + 2 + len] = '\0';
    memcpy(tp__errbuf, buf, sizeof buf);
}

void tp__error_set_text(const char *text)
{
    snprintf(tp__errbuf, sizeof tp__errbuf, "%s", text ? text : "");
}

void tp__assert_fail(const char *expr, const char *file, int line)
{
    fprintf(stderr, "libtp: internal invariant failed: %s (%s:%d)\n", expr, file, line);
    abort();
}

const char *tp__shape_str(int ndim, const int64_t *shape, char *buf, size_t len)
{
    size_t used = 0;
    if (len == 0)
        return buf;
    buf[0] = '\0';
    used += (size_t)snprintf(buf + used, len - used, "[");
    for (int i = 0; i < ndim && used < len; i++)
        used += (size_t)snprintf(buf + used, len - used, i ? ", %lld" : "%lld",
                                 (long long)shape[i]);
    if (used < len)
        snprintf(buf + used, len - used, "]");
    return buf;
}

double tp__now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}
