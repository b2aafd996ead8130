/* The shm backend's CUDA side in a build without CUDA: no CUDA tensor can
 * exist there, so none of this is reached; each entry still refuses clearly. */
#include "collectives/shm_cuda.h"

static tp_status no_cuda(void)
{
    return tp__error(TP_ERR_NOT_SUPPORTED,
                     "backend 'shm': CUDA tensors need a libtp built with CUDA");
}

tp_status tp__shm_cuda_create(int device, int nslots, tp__shm_cuda **out)
{
    (void)device;
    (void)nslots;
    *out = NULL;
    return no_cuda();
}

void tp__shm_cuda_destroy(tp__shm_cuda *c)
{
    (void)c;
}

int tp__shm_cuda_device(const tp__shm_cuda *c)
{
    (void)c;
    return -1;
}

tp_status tp__shm_cuda_post(tp__shm_cuda *c, int slot, void **ready, void **done)
{
    (void)c;
    (void)slot;
    *ready = *done = NULL;
    return no_cuda();
}

tp_status tp__shm_cuda_wait(tp__shm_cuda *c, void *event)
{
    (void)c;
    (void)event;
    return no_cuda();
}

tp_status tp__shm_cuda_done(tp__shm_cuda *c, int slot)
{
    (void)c;
    (void)slot;
    return no_cuda();
}

tp_status tp__shm_cuda_reduce(tp__shm_cuda *c, tp_dtype dtype, tp_reduce_op op, int divisor,
                              int nsrc, const void *const *src, size_t src_off, int ndst,
                              void *const *dst, size_t dst_off, size_t len)
{
    (void)c, (void)dtype, (void)op, (void)divisor, (void)nsrc, (void)src, (void)src_off;
    (void)ndst, (void)dst, (void)dst_off, (void)len;
    return no_cuda();
}

tp_status tp__shm_cuda_copy(tp__shm_cuda *c, void *dst, const void *src, size_t bytes)
{
    (void)c, (void)dst, (void)src, (void)bytes;
    return no_cuda();
}

tp_status tp__shm_cuda_enable_peer(tp__shm_cuda *c, int peer)
{
    (void)c, (void)peer;
    return no_cuda();
}
