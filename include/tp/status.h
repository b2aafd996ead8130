/*
 * tp/status.h - status codes, last-error text, allocator hook.
 *
 * Every fallible libtp function returns a tp_status: TP_OK (0) on success, a
 * negative code on failure. The calling thread's detailed message for the most
 * recent failure is available from tp_last_error().
 */
#ifndef TP_STATUS_H
#define TP_STATUS_H

#include <stddef.h>

#include "tp/config.h"

#if defined(TP_STATIC)
#define TP_API
#elif defined(TP_BUILDING)
#define TP_API __attribute__((visibility("default")))
#else
#define TP_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* X(name, value, description) */
#define TP_STATUS_LIST(X)                                                       \
    X(TP_OK, 0, "success")                                                      \
    X(TP_ERR_INVALID_ARG, -1, "invalid argument")                               \
    X(TP_ERR_NO_MEMORY, -2, "out of memory")                                    \
    X(TP_ERR_NOT_SUPPORTED, -3, "not supported")                                \
    X(TP_ERR_BACKEND, -4, "backend error")                                      \
    X(TP_ERR_TIMEOUT, -5, "timed out")                                          \
    X(TP_ERR_ABORTED, -6, "communicator aborted")                               \
    X(TP_ERR_MISMATCH, -7, "ranks disagree")                                    \
    X(TP_ERR_STATE, -8, "invalid state")

typedef enum tp_status {
#define TP__STATUS_ENUM(name, value, desc) name = value,
    TP_STATUS_LIST(TP__STATUS_ENUM)
#undef TP__STATUS_ENUM
} tp_status;

/* Short fixed description of a status ("out of memory"); never NULL. Unknown
 * values give "unknown status". */
TP_API const char *tp_status_string(tp_status status);

/* Symbolic name of a status ("TP_ERR_NO_MEMORY"); never NULL. */
TP_API const char *tp_status_name(tp_status status);

/* The calling thread's detailed message for the most recent failure, such as
 * "all_reduce: recv has 12 elements, send has 16". Empty string when no
 * failure was recorded. The pointer stays valid until the thread's next libtp
 * call. */
TP_API const char *tp_last_error(void);

/* Clears the calling thread's last-error text. */
TP_API void tp_clear_error(void);

/*
 * Allocator hook. Every host allocation libtp makes (tensor storage and
 * internal objects) goes through it. alloc must return memory aligned to at
 * least `alignment` bytes (a power of two, at most 4096) or NULL; free receives
 * only pointers alloc returned (never NULL). libtp frees through whichever
 * allocator is current at the time, so install it while no libtp object is
 * alive (before the first, after the last). Tests use it to make the k-th
 * allocation fail and check that every path reports TP_ERR_NO_MEMORY and
 * leaks nothing. Owner: the caller (process-wide); libtp copies the struct
 * and never frees ctx.
 */
typedef struct tp_allocator {
    void *(*alloc)(void *ctx, size_t size, size_t alignment);
    void (*free)(void *ctx, void *ptr);
    void *ctx;
} tp_allocator;

/* Installs `allocator` (copied), or restores the default (aligned_alloc/free)
 * when NULL. Returns TP_ERR_INVALID_ARG if a slot is NULL. Not thread-safe. */
TP_API tp_status tp_set_allocator(const tp_allocator *allocator);

/* The allocator in use (the default one if none was installed). */
TP_API tp_allocator tp_get_allocator(void);

/* Library version, "MAJOR.MINOR.PATCH". */
TP_API const char *tp_version(void);

#ifdef __cplusplus
}
#endif

#endif /* TP_STATUS_H */
