/* The backend registry: built-in backends plus any a user registers. */
#include <pthread.h>
#include <string.h>

#include "collectives/coll.h"

#define TP__MAX_BACKENDS 32

static pthread_mutex_t tp__reg_mu = PTHREAD_MUTEX_INITIALIZER;
static tp_backend tp__reg[TP__MAX_BACKENDS];
static int tp__reg_n;
static bool tp__reg_init;

/* Built-ins are added on first use so that no constructor runs at load time. */
static void tp__reg_builtins_locked(void)
{
    if (tp__reg_init)
        return;
    tp__reg_init = true;
    tp__reg[tp__reg_n++] = tp__shm_backend;
    tp__reg[tp__reg_n++] = tp__sim_backend;
#if TP_HAVE_MPI
    tp__reg[tp__reg_n++] = tp__mpi_backend;
#endif
#if TP_HAVE_NCCL
    tp__reg[tp__reg_n++] = tp__nccl_backend;
#endif
}

tp_status tp_backend_register(const tp_backend *backend)
{
    TP_ARG_CHECK(backend, "tp_backend_register: backend is NULL");
    TP_ARG_CHECK(backend->name && backend->name[0], "tp_backend_register: backend has no name");
    TP_ARG_CHECK(backend->collective,
                 "tp_backend_register: backend '%s' has no collective function", backend->name);
    tp_status st = TP_OK;
    pthread_mutex_lock(&tp__reg_mu);
    tp__reg_builtins_locked();
    for (int i = 0; i < tp__reg_n; i++) {
        if (strcmp(tp__reg[i].name, backend->name) == 0) {
            st = tp__error(TP_ERR_INVALID_ARG,
                           "tp_backend_register: a backend named '%s' is already registered",
                           backend->name);
            goto out;
        }
    }
    if (tp__reg_n == TP__MAX_BACKENDS) {
        st = tp__error(TP_ERR_NO_MEMORY, "tp_backend_register: registry full (%d backends)",
                       TP__MAX_BACKENDS);
        goto out;
    }
    tp__reg[tp__reg_n++] = *backend;
out:
    pthread_mutex_unlock(&tp__reg_mu);
    return st;
}

const tp_backend *tp_backend_find(const char *name)
{
    const tp_backend *found = NULL;
    if (!name)
        return NULL;
    pthread_mutex_lock(&tp__reg_mu);
    tp__reg_builtins_locked();
    for (int i = 0; i < tp__reg_n; i++) {
        if (strcmp(tp__reg[i].name, name) == 0) {
            found = &tp__reg[i];
            break;
        }
    }
    pthread_mutex_unlock(&tp__reg_mu);
    return found;
}
