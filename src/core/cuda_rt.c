/* Internal CUDA runtime helpers: error text, device switching, a compute
 * stream per thread and device. */
#include "core/cuda_rt.h"

#if TP_HAVE_CUDA
#include <pthread.h>

#define TP__CUDA_MAX_DEVICES 64

typedef struct tp__cuda_streams {
    cudaStream_t s[TP__CUDA_MAX_DEVICES];
} tp__cuda_streams;

static pthread_key_t tp__stream_key;
static pthread_once_t tp__stream_once = PTHREAD_ONCE_INIT;

static void tp__streams_destroy(void *p)
{
    tp__cuda_streams *ts = p;
    int prev = 0;
    bool have_prev = cudaGetDevice(&prev) == cudaSuccess;
    for (int i = 0; i < TP__CUDA_MAX_DEVICES; i++) {
        if (!ts->s[i])
            continue;
        if (cudaSetDevice(i) == cudaSuccess)
            (void)cudaStreamDestroy(ts->s[i]);
    }
    if (have_prev)
        (void)cudaSetDevice(prev);
    (void)cudaGetLastError();
    tp__free(ts);
}

static void tp__stream_key_init(void) { (void)pthread_key_create(&tp__stream_key, tp__streams_destroy); }

tp_status tp__cuda_fail(const char *fn, const char *what, cudaError_t err)
{
    (void)cudaGetLastError();
    return tp__error(err == cudaErrorMemoryAllocation ? TP_ERR_NO_MEMORY : TP_ERR_BACKEND,
                     "%s: %s failed: %s", fn, what, cudaGetErrorString(err));
}

tp_status tp__cuda_enter(const char *fn, int index, int *prev)
{
    cudaError_t err = cudaGetDevice(prev);
    if (err == cudaSuccess && *prev != index)
        err = cudaSetDevice(index);
    if (err != cudaSuccess)
        return tp__cuda_fail(fn, "cudaSetDevice", err);
    return TP_OK;
}

void tp__cuda_leave(int prev, int index)
{
    if (prev != index)
        (void)cudaSetDevice(prev);
}

tp_status tp__cuda_stream(const char *fn, int index, cudaStream_t *out)
{
    if (index < 0 || index >= TP__CUDA_MAX_DEVICES)
        return tp__error(TP_ERR_INVALID_ARG, "%s: CUDA device %d outside [0, %d)", fn, index,
                         TP__CUDA_MAX_DEVICES);
    (void)pthread_once(&tp__stream_once, tp__stream_key_init);
    tp__cuda_streams *ts = pthread_getspecific(tp__stream_key);
    if (!ts) {
        ts = tp__calloc(1, sizeof *ts);
        if (!ts)
            return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory for the stream table", fn);
        if (pthread_setspecific(tp__stream_key, ts) != 0) {
            tp__free(ts);
            return tp__error(TP_ERR_NO_MEMORY, "%s: pthread_setspecific failed", fn);
        }
    }
    if (!ts->s[index]) {
        int prev;
        TP_CHECK(tp__cuda_enter(fn, index, &prev));
        cudaError_t err = cudaStreamCreate(&ts->s[index]);
        tp__cuda_leave(prev, index);
        if (err != cudaSuccess) {
            ts->s[index] = NULL;
            return tp__cuda_fail(fn, "cudaStreamCreate", err);
        }
    }
    *out = ts->s[index];
    return TP_OK;
}

tp_status tp__cuda_stream_sync(const char *fn, int index)
{
    cudaStream_t s = NULL;
    TP_CHECK(tp__cuda_stream(fn, index, &s));
    cudaError_t err = cudaStreamSynchronize(s);
    return err == cudaSuccess ? TP_OK : tp__cuda_fail(fn, "cudaStreamSynchronize", err);
}
#endif
