/* The CUDA engine's core half: error text, device switching, a compute
 * stream per thread and device, and the CUDA memory table (core/device.h).
 * Built only with CUDA; cuda_stub.c stands in for it otherwise. */
#include <pthread.h>

#include "core/cuda_rt.h"
#include "core/device.h"

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
    TP_CUDA_CHECK(fn, "cudaStreamSynchronize", cudaStreamSynchronize(s));
    return TP_OK;
}

const char *tp__cuda_unavailable_reason(void) { return "no CUDA device"; }

/* ---- the CUDA memory table -------------------------------------------------- */

static tp_status tp__cuda_check(const char *fn, int index)
{
    if (index < 0)
        return tp__error(TP_ERR_INVALID_ARG, "%s: CUDA device index %d is negative", fn,
                         index);
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess) {
        (void)cudaGetLastError();
        return tp__error(TP_ERR_NOT_SUPPORTED, "%s: CUDA device %d unavailable: %s", fn, index,
                         cudaGetErrorString(err));
    }
    if (count == 0)
        return tp__error(TP_ERR_NOT_SUPPORTED, "%s: CUDA device %d unavailable: no device", fn,
                         index);
    if (index >= count)
        return tp__error(TP_ERR_INVALID_ARG, "%s: CUDA device %d out of range (%d devices)", fn,
                         index, count);
    return TP_OK;
}

static int tp__cuda_count(void)
{
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return count;
}

static tp_status tp__cuda_alloc(const char *fn, int index, size_t nbytes, bool zero, void **out)
{
    const char *what = zero ? "cudaMalloc/cudaMemset" : "cudaMalloc";
    int prev = 0;
    TP_CHECK(tp__cuda_enter(fn, index, &prev));
    void *p = NULL;
    tp_status st = TP_OK;
    /* cudaMalloc(0) may hand back NULL; keep every storage a real pointer */
    TP_CUDA_CHECK_GOTO(fn, what, cudaMalloc(&p, nbytes ? nbytes : 1), st, done);
    if (zero && nbytes) {
        TP_CUDA_CHECK_GOTO(fn, what, cudaMemset(p, 0, nbytes), st, fail);
        /* memset may run asynchronously; copies elsewhere may not wait */
        TP_CUDA_CHECK_GOTO(fn, what, cudaDeviceSynchronize(), st, fail);
    }
    *out = p;
    goto done;
fail:
    (void)cudaFree(p);
    (void)cudaGetLastError();
done:
    tp__cuda_leave(prev, index);
    return st;
}

static void tp__cuda_free(int index, void *p)
{
    /* a failing cudaFree means the context is already gone, and the memory
     * with it */
    int prev = 0;
    if (tp__cuda_enter("tp_tensor_release", index, &prev) != TP_OK)
        return;
    if (cudaFree(p) != cudaSuccess)
        (void)cudaGetLastError();
    tp__cuda_leave(prev, index);
}

static tp_status tp__cuda_zero(const char *fn, int index, void *p, size_t nbytes)
{
    int prev = 0;
    TP_CHECK(tp__cuda_enter(fn, index, &prev));
    tp_status st = TP_OK;
    TP_CUDA_CHECK_GOTO(fn, "cudaMemset", cudaMemset(p, 0, nbytes), st, done);
    TP_CUDA_CHECK_GOTO(fn, "cudaMemset", cudaDeviceSynchronize(), st, done);
done:
    tp__cuda_leave(prev, index);
    return st;
}

/* Blocking byte copy where at least one side is a CUDA device. D2D copies are
 * asynchronous to the host in CUDA; libtp synchronizes so every copy is
 * complete on return, whichever stream the caller uses next. */
static tp_status tp__cuda_memcpy(const char *fn, void *dst, tp_device dd, const void *src,
                                 tp_device sd, size_t n)
{
    int dev = dd.type == TP_DEVICE_CUDA ? dd.index : sd.index, prev = 0;
    TP_CHECK(tp__cuda_enter(fn, dev, &prev));
    cudaError_t err;
    const char *what;
    if (dd.type == TP_DEVICE_CUDA && sd.type == TP_DEVICE_CUDA) {
        if (tp__device_eq(dd, sd)) {
            what = "cudaMemcpy(device to device)";
            err = cudaMemcpy(dst, src, n, cudaMemcpyDeviceToDevice);
        } else {
            what = "cudaMemcpyPeer";
            err = cudaMemcpyPeer(dst, dd.index, src, sd.index, n);
        }
        if (err == cudaSuccess)
            err = cudaDeviceSynchronize();
    } else if (dd.type == TP_DEVICE_CUDA) {
        what = "cudaMemcpy(host to device)";
        err = cudaMemcpy(dst, src, n, cudaMemcpyHostToDevice);
    } else {
        what = "cudaMemcpy(device to host)";
        err = cudaMemcpy(dst, src, n, cudaMemcpyDeviceToHost);
    }
    tp_status st = err == cudaSuccess ? TP_OK : tp__cuda_fail(fn, what, err);
    tp__cuda_leave(prev, dev);
    return st;
}

static tp_status tp__cuda_sync(const char *fn, int index)
{
    int prev = 0;
    TP_CHECK(tp__cuda_enter(fn, index, &prev));
    tp_status st = tp__cuda_stream_sync(fn, index);
    tp__cuda_leave(prev, index);
    return st;
}

const tp__device_mem tp__cuda_mem = {
    .name = "cuda", .check = tp__cuda_check, .count = tp__cuda_count,
    .alloc = tp__cuda_alloc, .free = tp__cuda_free, .zero = tp__cuda_zero,
    .copy = tp__cuda_memcpy, .strided_copy = tp__cuda_strided_copy,
    .sync = tp__cuda_sync,
};
