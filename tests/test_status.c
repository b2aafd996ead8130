/* Status codes, last-error text (per thread) and the version string. */
#include <pthread.h>

#include "tp_test.h"

static const tp_status all_status[] = {
#define STATUS_ENTRY(name, value, desc) name,
    TP_STATUS_LIST(STATUS_ENTRY)
#undef STATUS_ENTRY
};
#define N_STATUS ((int)(sizeof all_status / sizeof all_status[0]))

Test(status, names_and_strings_distinct, .timeout = 30)
{
    cr_assert_eq(N_STATUS, 9);
    for (int i = 0; i < N_STATUS; i++) {
        const char *n = tp_status_name(all_status[i]);
        const char *s = tp_status_string(all_status[i]);
        cr_assert(n && n[0], "status %d has no name", (int)all_status[i]);
        cr_assert(s && s[0], "status %d has no string", (int)all_status[i]);
        cr_assert_str_neq(n, "unknown status");
        cr_assert_str_neq(s, "unknown status");
        for (int j = 0; j < i; j++) {
            cr_assert_str_neq(n, tp_status_name(all_status[j]));
            cr_assert_str_neq(s, tp_status_string(all_status[j]));
        }
    }
    cr_assert_str_eq(tp_status_name(TP_OK), "TP_OK");
    cr_assert_str_eq(tp_status_name(TP_ERR_NO_MEMORY), "TP_ERR_NO_MEMORY");
    cr_assert_str_eq(tp_status_string(TP_ERR_NO_MEMORY), "out of memory");
    cr_assert_eq(TP_OK, 0);
    for (int i = 1; i < N_STATUS; i++)
        cr_assert_lt((int)all_status[i], 0, "error codes are negative");
}

Test(status, unknown_status, .timeout = 30)
{
    cr_assert_str_eq(tp_status_string((tp_status)-1000), "unknown status");
    cr_assert_str_eq(tp_status_name((tp_status)-1000), "unknown status");
    cr_assert_str_eq(tp_status_string((tp_status)42), "unknown status");
    cr_assert_str_eq(tp_status_name((tp_status)42), "unknown status");
}

Test(status, last_error_set_and_cleared, .timeout = 30)
{
    tp_clear_error();
    cr_assert_str_eq(tp_last_error(), "");
    int64_t shape[2] = {2, -3};
    tp_tensor *t = (tp_tensor *)0x1;
    cr_assert_eq(tp_tensor_empty(TP_F32, TP_CPU, 2, shape, &t), TP_ERR_INVALID_ARG);
    cr_assert_null(t, "out stays NULL on failure");
    const char *msg = tp_last_error();
    cr_assert(strstr(msg, "tp_tensor_empty"), "message names the function: %s", msg);
    cr_assert(strstr(msg, "-3"), "message names the value: %s", msg);
    tp_clear_error();
    cr_assert_str_eq(tp_last_error(), "");

    /* a setter with bad slots also reports */
    tp_allocator bad = {NULL, NULL, NULL};
    cr_assert_eq(tp_set_allocator(&bad), TP_ERR_INVALID_ARG);
    cr_assert_neq(tp_last_error()[0], '\0');
    tp_clear_error();
}

typedef struct thread_result {
    char seen_at_start[256];
    char own_error[256];
    pthread_barrier_t *barrier;
} thread_result;

static void *error_thread(void *arg)
{
    thread_result *r = arg;
    /* the main thread has already failed a call: this thread must not see it */
    snprintf(r->seen_at_start, sizeof r->seen_at_start, "%s", tp_last_error());
    tp_tensor *t = NULL;
    (void)tp_tensor_empty((tp_dtype)99, TP_CPU, 0, NULL, &t);
    snprintf(r->own_error, sizeof r->own_error, "%s", tp_last_error());
    pthread_barrier_wait(r->barrier);
    return NULL;
}

Test(status, last_error_is_per_thread, .timeout = 30)
{
    tp_clear_error();
    int64_t shape = -1;
    tp_tensor *t = NULL;
    cr_assert_eq(tp_tensor_zeros(TP_F32, TP_CPU, 1, &shape, &t), TP_ERR_INVALID_ARG);
    char mine[256];
    snprintf(mine, sizeof mine, "%s", tp_last_error());
    cr_assert_neq(mine[0], '\0');

    pthread_barrier_t barrier;
    pthread_barrier_init(&barrier, NULL, 2);
    thread_result r = {.barrier = &barrier};
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, error_thread, &r), 0);
    pthread_barrier_wait(&barrier);
    pthread_join(th, NULL);
    pthread_barrier_destroy(&barrier);

    cr_assert_str_eq(r.seen_at_start, "", "new thread starts with no error, saw: %s",
                     r.seen_at_start);
    cr_assert(strstr(r.own_error, "dtype"), "thread got its own error: %s", r.own_error);
    cr_assert_str_eq(tp_last_error(), mine, "main thread's error unchanged by the other thread");
    tp_clear_error();
}

Test(status, version, .timeout = 30)
{
    const char *v = tp_version();
    cr_assert(v && v[0]);
    int major, minor, patch;
    cr_assert_eq(sscanf(v, "%d.%d.%d", &major, &minor, &patch), 3, "version %s", v);
}

Test(status, allocator_get_set, .timeout = 30)
{
    tp_allocator def = tp_get_allocator();
    cr_assert(def.alloc && def.free);
    tp_allocator half = def;
    half.free = NULL;
    cr_assert_eq(tp_set_allocator(&half), TP_ERR_INVALID_ARG);
    tp_allocator now = tp_get_allocator();
    cr_assert(now.alloc == def.alloc && now.free == def.free, "failed set keeps the old one");
    cr_assert_eq(tp_set_allocator(NULL), TP_OK);
}
