/*
 * An LD_PRELOAD library for tests/bench_layers_cli.sh: the process's first
 * tp_mesh_create fails with TP_ERR_NO_MEMORY, every later call is libtp's.
 * In a tp-bench-layers sweep over -g 1,N that first call is the untimed
 * warm-up run of the 1-rank baseline, so the test sees how the bench reports
 * a failure there (message, exit status 2) while the later runs succeed.
 */
#include <dlfcn.h>
#include <stdatomic.h>
#include <stdio.h>

#include <tp.h>

typedef tp_status (*mesh_create_fn)(tp_comm *, int, const int64_t *, const char *const *,
                                    tp_mesh **);

static atomic_int calls;

TP_API tp_status tp_mesh_create(tp_comm *world, int ndim, const int64_t *shape,
                                const char *const *names, tp_mesh **out)
{
    if (atomic_fetch_add(&calls, 1) == 0) {
        fprintf(stderr, "bench_fail_first: tp_mesh_create fails once\n");
        *out = NULL;
        return TP_ERR_NO_MEMORY;
    }
    mesh_create_fn real = (mesh_create_fn)dlsym(RTLD_NEXT, "tp_mesh_create");
    if (!real) {
        fprintf(stderr, "bench_fail_first: libtp's tp_mesh_create not found\n");
        *out = NULL;
        return TP_ERR_STATE;
    }
    return real(world, ndim, shape, names, out);
}
