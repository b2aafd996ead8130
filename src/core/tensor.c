/* Tensors: refcounted storage, views, copies across dtypes, layouts and
 * devices, fill, element access and comparison. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "core/cache.h"
#include "core/core.h"
#include "core/dtype_elem.h"
#include "core/meta_mem.h"

#define TP__SHAPE_BUF 200 /* "[" + 8 x (20 digits + ", ") + "]" */

/* ---- validation ----------------------------------------------------------- */

static tp_status tp__check_dtype(const char *fn, tp_dtype dtype)
{
    if (!tp__dtype_traits_of(dtype))
        return tp__error(TP_ERR_INVALID_ARG, "%s: invalid dtype %d", fn, (int)dtype);
    return TP_OK;
}

/* Validates a shape and returns its element count and byte size. The product
 * of max(size, 1) must fit so that contiguous strides never overflow, even
 * for shapes with a zero size. */
static tp_status tp__check_shape(const char *fn, tp_dtype dtype, int ndim, const int64_t *shape,
                                 int64_t *numel, size_t *nbytes)
{
    if (ndim < 0 || ndim > TP_MAX_DIMS)
        return tp__error(TP_ERR_INVALID_ARG, "%s: ndim %d outside [0, %d]", fn, ndim,
                         TP_MAX_DIMS);
    if (ndim > 0 && !shape)
        return tp__error(TP_ERR_INVALID_ARG, "%s: shape is NULL for ndim %d", fn, ndim);
    int64_t n = 1, span = 1;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0)
            return tp__error(TP_ERR_INVALID_ARG, "%s: size %lld of dim %d is negative", fn,
                             (long long)shape[i], i);
        int64_t s = shape[i] ? shape[i] : 1;
        if (span > INT64_MAX / s) {
            char buf[TP__SHAPE_BUF];
            return tp__error(TP_ERR_INVALID_ARG, "%s: shape %s has too many elements", fn,
                             tp__shape_str(ndim, shape, buf, sizeof buf));
        }
        span *= s;
        n *= shape[i];
    }
    size_t es = tp_dtype_size(dtype);
    if ((uint64_t)span > (uint64_t)(PTRDIFF_MAX / (ptrdiff_t)es)) {
        char buf[TP__SHAPE_BUF];
        return tp__error(TP_ERR_INVALID_ARG, "%s: shape %s of %s exceeds the addressable size",
                         fn, tp__shape_str(ndim, shape, buf, sizeof buf), tp_dtype_name(dtype));
    }
    *numel = n;
    *nbytes = (size_t)n * es;
    return TP_OK;
}


int tp_cuda_device_count(void) { return tp__cuda_mem.count(); }

static atomic_bool tp__allow_tf32; /* zero-initialized: false */

tp_status tp_cuda_set_allow_tf32(bool allow)
{
    atomic_store_explicit(&tp__allow_tf32, allow, memory_order_relaxed);
    return TP_OK;
}

bool tp_cuda_allow_tf32(void)
{
    return atomic_load_explicit(&tp__allow_tf32, memory_order_relaxed);
}

/* The memory table of dev, once dev names a device this process can use. */
static tp_status tp__check_device(const char *fn, tp_device dev, const tp__device_mem **mem)
{
    const tp__device_mem *m = tp__device_mem_of(dev.type);
    if (!m)
        return tp__error(TP_ERR_INVALID_ARG, "%s: invalid device type %d", fn, (int)dev.type);
    TP_CHECK(m->check(fn, dev.index));
    if (mem)
        *mem = m;
    return TP_OK;
}

tp_status tp_cuda_synchronize(int device)
{
    const char *fn = "tp_cuda_synchronize";
    const tp__device_mem *m = NULL;
    TP_CHECK(tp__check_device(fn, TP_CUDA(device), &m));
    return m->sync(fn, device);
}

/* ---- storage and lifetime ------------------------------------------------- */

static void tp__storage_release(tp_storage *s)
{
    if (atomic_fetch_sub_explicit(&s->refcount, 1, memory_order_acq_rel) != 1)
        return;
    if (s->deleter)
        s->deleter(s->data, s->deleter_ctx);
    else if (s->owned && s->data) /* NULL: dropped (tp__storage_drop) */
        tp__device_mem_of(s->device.type)->free(s->device.index, s->data);
    tp__free(s);
}

void tp__storage_drop(tp_tensor *t)
{
    tp_storage *s = t ? t->storage : NULL;
    if (!s || !s->owned || s->deleter || !s->data || !s->nbytes)
        return;
    tp__device_mem_of(s->device.type)->free(s->device.index, s->data);
    s->data = NULL;
}

bool tp__storage_dropped(const tp_tensor *t)
{
    return t && t->storage && !t->storage->data && t->storage->nbytes;
}

tp_status tp__storage_restore(tp_tensor *t)
{
    tp_storage *s = t->storage;
    if (!tp__storage_dropped(t))
        return TP_OK;
    return tp__device_mem_of(s->device.type)
        ->alloc("tp__storage_restore", s->device.index, s->nbytes, false, &s->data);
}

static tp_status tp__storage_new(const char *fn, const tp__device_mem *mem, tp_device dev,
                                 size_t nbytes, bool zero, tp_storage **out)
{
    tp_storage *s = tp__malloc(sizeof *s);
    if (!s)
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory for the storage header", fn);
    atomic_init(&s->refcount, 1);
    s->data = NULL;
    s->nbytes = nbytes;
    s->device = dev;
    s->deleter = NULL;
    s->deleter_ctx = NULL;
    s->owned = true;
    tp_status st = mem->alloc(fn, dev.index, nbytes, zero, &s->data);
    if (st != TP_OK) {
        tp__free(s);
        return st;
    }
    *out = s;
    return TP_OK;
}

static void tp__contiguous_strides(int ndim, const int64_t *shape, int64_t *stride)
{
    int64_t s = 1;
    for (int i = ndim - 1; i >= 0; i--) {
        stride[i] = s;
        s *= shape[i] ? shape[i] : 1;
    }
}

/* A tensor header over `storage` (whose reference it takes over). */
static tp_tensor *tp__tensor_header(tp_storage *storage, tp_dtype dtype, int ndim,
                                    const int64_t *shape, const int64_t *stride, int64_t offset)
{
    tp_tensor *t = tp__malloc(sizeof *t);
    if (!t)
        return NULL;
    atomic_init(&t->refcount, 1);
    t->storage = storage;
    t->dtype = dtype;
    t->ndim = ndim;
    memset(t->shape, 0, sizeof t->shape);
    memset(t->stride, 0, sizeof t->stride);
    if (ndim > 0) {
        memcpy(t->shape, shape, (size_t)ndim * sizeof *shape);
        if (stride)
            memcpy(t->stride, stride, (size_t)ndim * sizeof *stride);
        else
            tp__contiguous_strides(ndim, shape, t->stride);
    }
    t->offset = offset;
    t->ext_ops = NULL;
    t->ext = NULL;
    return t;
}

static tp_status tp__tensor_new(const char *fn, tp_dtype dtype, tp_device device, int ndim,
                                const int64_t *shape, bool zero, tp_tensor **out)
{
    int64_t numel;
    size_t nbytes;
    TP_CHECK(tp__check_dtype(fn, dtype));
    TP_CHECK(tp__check_shape(fn, dtype, ndim, shape, &numel, &nbytes));
    const tp__device_mem *mem = NULL;
    TP_CHECK(tp__check_device(fn, device, &mem));
    tp_storage *s = NULL;
    TP_CHECK(tp__storage_new(fn, mem, device, nbytes, zero, &s));
    tp_tensor *t = tp__tensor_header(s, dtype, ndim, shape, NULL, 0);
    if (!t) {
        tp__storage_release(s);
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory for the tensor header", fn);
    }
    *out = t;
    return TP_OK;
}

tp_status tp_tensor_empty(tp_dtype dtype, tp_device device, int ndim, const int64_t *shape,
                          tp_tensor **out)
{
    TP_ARG_CHECK(out, "tp_tensor_empty: out is NULL");
    *out = NULL;
    return tp__tensor_new("tp_tensor_empty", dtype, device, ndim, shape, false, out);
}

tp_status tp_tensor_zeros(tp_dtype dtype, tp_device device, int ndim, const int64_t *shape,
                          tp_tensor **out)
{
    TP_ARG_CHECK(out, "tp_tensor_zeros: out is NULL");
    *out = NULL;
    return tp__tensor_new("tp_tensor_zeros", dtype, device, ndim, shape, true, out);
}

tp_status tp_tensor_from_data(tp_dtype dtype, int ndim, const int64_t *shape, const void *data,
                              tp_tensor **out)
{
    const char *fn = "tp_tensor_from_data";
    TP_ARG_CHECK(out, "%s: out is NULL", fn);
    *out = NULL;
    int64_t numel;
    size_t nbytes;
    TP_CHECK(tp__check_dtype(fn, dtype));
    TP_CHECK(tp__check_shape(fn, dtype, ndim, shape, &numel, &nbytes));
    TP_ARG_CHECK(data || numel == 0, "%s: data is NULL for %lld elements", fn, (long long)numel);
    tp_tensor *t = NULL;
    TP_CHECK(tp__tensor_new(fn, dtype, TP_CPU, ndim, shape, false, &t));
    if (nbytes)
        memcpy(t->storage->data, data, nbytes);
    *out = t;
    return TP_OK;
}

tp_status tp_tensor_from_blob(tp_dtype dtype, tp_device device, int ndim, const int64_t *shape,
                              void *data, void (*deleter)(void *data, void *ctx), void *ctx,
                              tp_tensor **out)
{
    const char *fn = "tp_tensor_from_blob";
    TP_ARG_CHECK(out, "%s: out is NULL", fn);
    *out = NULL;
    int64_t numel;
    size_t nbytes;
    TP_CHECK(tp__check_dtype(fn, dtype));
    TP_CHECK(tp__check_shape(fn, dtype, ndim, shape, &numel, &nbytes));
    TP_CHECK(tp__check_device(fn, device, NULL));
    TP_ARG_CHECK(device.type != TP_DEVICE_META,
                 "%s: the meta device holds no memory to wrap; use tp_tensor_empty(..., TP_META, "
                 "...)",
                 fn);
    TP_ARG_CHECK(data || numel == 0, "%s: data is NULL for %lld elements", fn, (long long)numel);
    /* element loops and kernels rely on natural alignment */
    TP_ARG_CHECK((uintptr_t)data % tp_dtype_size(dtype) == 0,
                 "%s: data %p is not aligned to the %zu-byte %s element size", fn, data,
                 tp_dtype_size(dtype), tp_dtype_name(dtype));
    tp_storage *s = tp__malloc(sizeof *s);
    if (!s)
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory for the storage header", fn);
    atomic_init(&s->refcount, 1);
    s->data = data;
    s->nbytes = nbytes;
    s->device = device;
    s->deleter = deleter;
    s->deleter_ctx = ctx;
    s->owned = deleter != NULL;
    tp_tensor *t = tp__tensor_header(s, dtype, ndim, shape, NULL, 0);
    if (!t) {
        /* the caller keeps ownership on failure: do not run the deleter */
        tp__free(s);
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory for the tensor header", fn);
    }
    *out = t;
    return TP_OK;
}

tp_status tp__tensor_refuse(const tp_tensor *t, const char *fn, const char *what)
{
    if (t->ext_ops && t->ext_ops->refuse)
        return t->ext_ops->refuse(t, fn, what);
    return tp__error(TP_ERR_INVALID_ARG, "%s: %s has no storage", fn, what);
}

tp_tensor *tp_tensor_retain(tp_tensor *t)
{
    if (t)
        atomic_fetch_add_explicit(&t->refcount, 1, memory_order_relaxed);
    return t;
}

void tp_tensor_release(tp_tensor *t)
{
    if (!t)
        return;
    if (atomic_fetch_sub_explicit(&t->refcount, 1, memory_order_acq_rel) != 1)
        return;
    if (t->ext)
        t->ext_ops->finalize(t);
    if (t->storage)
        tp__storage_release(t->storage);
    tp__free(t);
}

/* ---- properties ----------------------------------------------------------- */

int tp_tensor_ndim(const tp_tensor *t) { return t ? t->ndim : -1; }

const int64_t *tp_tensor_shape(const tp_tensor *t) { return t ? t->shape : NULL; }

int64_t tp_tensor_size(const tp_tensor *t, int d)
{
    if (!t)
        return -1;
    d = tp__wrap_dim(d, t->ndim);
    return d < 0 ? -1 : t->shape[d];
}

const int64_t *tp_tensor_strides(const tp_tensor *t) { return t ? t->stride : NULL; }

int64_t tp_tensor_numel(const tp_tensor *t) { return t ? tp__numel(t) : 0; }

tp_dtype tp_tensor_dtype(const tp_tensor *t) { return t ? t->dtype : TP_DTYPE_COUNT; }

tp_device tp_tensor_device(const tp_tensor *t)
{
    if (t && !t->storage)
        return tp_tensor_device(tp__tensor_local(t));
    return t ? t->storage->device : (tp_device){TP_DEVICE_CPU, -1};
}

bool tp_tensor_is_meta(const tp_tensor *t)
{
    return t && tp_tensor_device(t).type == TP_DEVICE_META;
}

size_t tp_tensor_nbytes(const tp_tensor *t)
{
    return t ? (size_t)tp__numel(t) * tp_dtype_size(t->dtype) : 0;
}

void *tp_tensor_data(const tp_tensor *t)
{
    if (!t || !t->storage)
        return NULL;
    return (char *)t->storage->data + (size_t)t->offset * tp_dtype_size(t->dtype);
}

bool tp_tensor_is_contiguous(const tp_tensor *t)
{
    return t && t->storage && tp__is_contiguous(t);
}

bool tp_tensor_shares_storage(const tp_tensor *a, const tp_tensor *b)
{
    return a && b && a->storage && a->storage == b->storage;
}

/* ---- views ---------------------------------------------------------------- */

/* A new header over t's storage with the given layout; retains the storage. */
static tp_status tp__make_view(const char *fn, const tp_tensor *t, int ndim, const int64_t *shape,
                               const int64_t *stride, int64_t offset, tp_tensor **out)
{
    tp_tensor *v = tp__tensor_header(t->storage, t->dtype, ndim, shape, stride, offset);
    if (!v)
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory for the view header", fn);
    atomic_fetch_add_explicit(&t->storage->refcount, 1, memory_order_relaxed);
    *out = v;
    return TP_OK;
}

static tp_status tp__narrow(const char *fn, tp_tensor *t, int dim, int64_t start, int64_t length,
                            tp_tensor **out)
{
    TP_CHECK(tp__need_storage(t, fn, "t"));
    int d = tp__wrap_dim(dim, t->ndim);
    TP_ARG_CHECK(d >= 0, "%s: dim %d out of range for a %d-d tensor", fn, dim, t->ndim);
    int64_t size = t->shape[d];
    TP_ARG_CHECK(start >= 0 && start <= size, "%s: start %lld outside [0, %lld] of dim %d", fn,
                 (long long)start, (long long)size, d);
    TP_ARG_CHECK(length >= 0, "%s: length %lld is negative", fn, (long long)length);
    TP_ARG_CHECK(length <= size - start, "%s: start %lld + length %lld exceeds size %lld of dim %d",
                 fn, (long long)start, (long long)length, (long long)size, d);
    int64_t shape[TP_MAX_DIMS];
    memcpy(shape, t->shape, sizeof shape);
    shape[d] = length;
    return tp__make_view(fn, t, t->ndim, shape, t->stride, t->offset + start * t->stride[d], out);
}

tp_status tp_tensor_narrow(tp_tensor *t, int dim, int64_t start, int64_t length, tp_tensor **out)
{
    TP_ARG_CHECK(out, "tp_tensor_narrow: out is NULL");
    *out = NULL;
    TP_ARG_CHECK(t, "tp_tensor_narrow: t is NULL");
    return tp__narrow("tp_tensor_narrow", t, dim, start, length, out);
}

void tp_chunk_range(int64_t n, int64_t chunks, int64_t index, int64_t *start, int64_t *length)
{
    int64_t s = 0, l = 0;
    if (n > 0 && chunks > 0 && index >= 0 && index < chunks) {
        int64_t c = n / chunks + (n % chunks != 0); /* ceil without overflow */
        /* index * c may overflow for huge n; index > n / c already means past the end */
        s = index > n / c ? n : index * c;
        if (s > n)
            s = n;
        l = n - s < c ? n - s : c;
    }
    if (start)
        *start = s;
    if (length)
        *length = l;
}

tp_status tp_tensor_chunk(tp_tensor *t, int64_t chunks, int dim, int64_t index, tp_tensor **out)
{
    const char *fn = "tp_tensor_chunk";
    TP_ARG_CHECK(out, "%s: out is NULL", fn);
    *out = NULL;
    TP_ARG_CHECK(t, "%s: t is NULL", fn);
    TP_CHECK(tp__need_storage(t, fn, "t"));
    TP_ARG_CHECK(chunks >= 1, "%s: chunks %lld must be >= 1", fn, (long long)chunks);
    TP_ARG_CHECK(index >= 0 && index < chunks, "%s: index %lld outside [0, %lld)", fn,
                 (long long)index, (long long)chunks);
    int d = tp__wrap_dim(dim, t->ndim);
    TP_ARG_CHECK(d >= 0, "%s: dim %d out of range for a %d-d tensor", fn, dim, t->ndim);
    int64_t start, length;
    tp_chunk_range(t->shape[d], chunks, index, &start, &length);
    return tp__narrow(fn, t, d, start, length, out);
}

tp_status tp_tensor_select(tp_tensor *t, int dim, int64_t index, tp_tensor **out)
{
    const char *fn = "tp_tensor_select";
    TP_ARG_CHECK(out, "%s: out is NULL", fn);
    *out = NULL;
    TP_ARG_CHECK(t, "%s: t is NULL", fn);
    TP_CHECK(tp__need_storage(t, fn, "t"));
    int d = tp__wrap_dim(dim, t->ndim);
    TP_ARG_CHECK(d >= 0, "%s: dim %d out of range for a %d-d tensor", fn, dim, t->ndim);
    int64_t size = t->shape[d];
    int64_t i = index < 0 ? index + size : index;
    TP_ARG_CHECK(i >= 0 && i < size, "%s: index %lld out of range for size %lld of dim %d", fn,
                 (long long)index, (long long)size, d);
    int64_t shape[TP_MAX_DIMS], stride[TP_MAX_DIMS];
    int n = 0;
    for (int k = 0; k < t->ndim; k++) {
        if (k == d)
            continue;
        shape[n] = t->shape[k];
        stride[n] = t->stride[k];
        n++;
    }
    return tp__make_view(fn, t, n, shape, stride, t->offset + i * t->stride[d], out);
}

tp_status tp_tensor_view(tp_tensor *t, int ndim, const int64_t *shape, tp_tensor **out)
{
    const char *fn = "tp_tensor_view";
    TP_ARG_CHECK(out, "%s: out is NULL", fn);
    *out = NULL;
    TP_ARG_CHECK(t, "%s: t is NULL", fn);
    TP_CHECK(tp__need_storage(t, fn, "t"));
    TP_ARG_CHECK(ndim >= 0 && ndim <= TP_MAX_DIMS, "%s: ndim %d outside [0, %d]", fn, ndim,
                 TP_MAX_DIMS);
    TP_ARG_CHECK(ndim == 0 || shape, "%s: shape is NULL for ndim %d", fn, ndim);
    char buf[TP__SHAPE_BUF], buf2[TP__SHAPE_BUF];
    if (!tp__is_contiguous(t))
        return tp__error(TP_ERR_INVALID_ARG, "%s: tensor of shape %s with strides %s is not contiguous",
                         fn, tp__shape_str(t->ndim, t->shape, buf, sizeof buf),
                         tp__shape_str(t->ndim, t->stride, buf2, sizeof buf2));
    int64_t numel = tp__numel(t), resolved[TP_MAX_DIMS], known = 0;
    TP_CHECK(tp__infer_sizes(fn, numel, ndim, shape, 0, resolved, &known));
    if (known != numel)
        return tp__error(TP_ERR_INVALID_ARG, "%s: shape %s has %lld elements, tensor %s has %lld",
                         fn, tp__shape_str(ndim, shape, buf, sizeof buf), (long long)known,
                         tp__shape_str(t->ndim, t->shape, buf2, sizeof buf2), (long long)numel);
    int64_t n2;
    size_t nb;
    TP_CHECK(tp__check_shape(fn, t->dtype, ndim, resolved, &n2, &nb));
    return tp__make_view(fn, t, ndim, resolved, NULL, t->offset, out);
}

tp_status tp__infer_sizes(const char *fn, int64_t total, int n, const int64_t *sizes, int first,
                          int64_t *out, int64_t *numel)
{
    int infer = -1;
    int64_t known = 1;
    bool zero = false, overflow = false;
    for (int i = 0; i < n; i++) {
        out[i] = sizes[i];
        if (sizes[i] == -1) {
            TP_ARG_CHECK(infer < 0, "%s: only one size may be -1 (dims %d and %d are)", fn,
                         first + infer, first + i);
            infer = i;
            continue;
        }
        TP_ARG_CHECK(sizes[i] >= 0, "%s: size %lld of dim %d is invalid", fn,
                     (long long)sizes[i], first + i);
        if (sizes[i] == 0)
            zero = true;
        else if (known > INT64_MAX / sizes[i])
            overflow = true;
        else
            known *= sizes[i];
    }
    /* as tp__check_shape: the sizes other than 0 must have a product, even
     * where a 0 makes the element count 0 */
    char buf[TP__SHAPE_BUF];
    if (overflow)
        return tp__error(TP_ERR_INVALID_ARG, "%s: shape %s has too many elements", fn,
                         tp__shape_str(n, sizes, buf, sizeof buf));
    if (zero)
        known = 0;
    if (infer >= 0) {
        TP_ARG_CHECK(known != 0 && total % known == 0,
                     "%s: cannot infer the size of dim %d: %lld elements into %s", fn,
                     first + infer, (long long)total, tp__shape_str(n, sizes, buf, sizeof buf));
        out[infer] = total / known;
        known = total;
    }
    *numel = known;
    return TP_OK;
}

/* ---- strided iteration ---------------------------------------------------- */

/* Processes n elements: d and s advance by ds and ss bytes per element. */
typedef void (*tp__run_fn)(char *d, int64_t ds, const char *s, int64_t ss, int64_t n, void *ctx);

/*
 * Calls fn once per innermost run of two same-shaped strided arrays (strides in
 * bytes). Size-1 dims are dropped and dims that are contiguous with their inner
 * neighbour in both arrays are merged, so contiguous data is one run (memcpy
 * speed) and the outer odometer costs no divisions. numel must be > 0.
 */
static void tp__foreach2(int ndim, const int64_t *shape, char *d, const int64_t *dstr,
                         const char *s, const int64_t *sstr, tp__run_fn fn, void *ctx)
{
    int64_t sh[TP_MAX_DIMS], ds[TP_MAX_DIMS], ss[TP_MAX_DIMS], idx[TP_MAX_DIMS];
    int n = 0;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] == 1)
            continue;
        if (n > 0 && ds[n - 1] == dstr[i] * shape[i] && ss[n - 1] == sstr[i] * shape[i]) {
            sh[n - 1] *= shape[i];
            ds[n - 1] = dstr[i];
            ss[n - 1] = sstr[i];
        } else {
            sh[n] = shape[i];
            ds[n] = dstr[i];
            ss[n] = sstr[i];
            n++;
        }
    }
    if (n == 0) {
        fn(d, 0, s, 0, 1, ctx);
        return;
    }
    for (int i = 0; i < n; i++)
        idx[i] = 0;
    int inner = n - 1;
    for (;;) {
        fn(d, ds[inner], s, ss[inner], sh[inner], ctx);
        int k = inner - 1;
        for (; k >= 0; k--) {
            d += ds[k];
            s += ss[k];
            if (++idx[k] < sh[k])
                break;
            d -= ds[k] * sh[k];
            s -= ss[k] * sh[k];
            idx[k] = 0;
        }
        if (k < 0)
            return;
    }
}

/* ---- element conversion runs ---------------------------------------------- */

/* Element loads and stores: core/dtype_elem.h. */
#define TP__ST(D, p, v)                                                         \
    _Generic((v), int32_t: tp__st_##D##_i, int64_t: tp__st_##D##_i, default: tp__st_##D##_d)((p), (v))

#define TP__CONV(S, D)                                                          \
    static void tp__conv_##S##_##D(char *d, int64_t ds, const char *s, int64_t ss, int64_t n,   \
                                   void *ctx)                                   \
    {                                                                           \
        (void)ctx;                                                              \
        for (int64_t i = 0; i < n; i++, d += ds, s += ss)                       \
            TP__ST(D, d, tp__ld_##S(s));                                        \
    }
#define TP__CONV_FROM(S)                                                        \
    TP__CONV(S, f32) TP__CONV(S, f64) TP__CONV(S, f16) TP__CONV(S, bf16) TP__CONV(S, i32)       \
    TP__CONV(S, i64)
TP__CONV_FROM(f32)
TP__CONV_FROM(f64)
TP__CONV_FROM(f16)
TP__CONV_FROM(bf16)
TP__CONV_FROM(i32)
TP__CONV_FROM(i64)

#define TP__CONV_ROW(S)                                                         \
    {                                                                           \
        [TP_F32] = tp__conv_##S##_f32, [TP_F64] = tp__conv_##S##_f64,           \
        [TP_F16] = tp__conv_##S##_f16, [TP_BF16] = tp__conv_##S##_bf16,         \
        [TP_I32] = tp__conv_##S##_i32, [TP_I64] = tp__conv_##S##_i64,           \
    }
/* [src][dst]; the diagonal is never used (same dtype copies move raw bytes so
 * that f16/bf16 NaN payloads survive) but keeps the table total. */
static const tp__run_fn tp__conv_table[TP_DTYPE_COUNT][TP_DTYPE_COUNT] = {
    [TP_F32] = TP__CONV_ROW(f32), [TP_F64] = TP__CONV_ROW(f64),
    [TP_F16] = TP__CONV_ROW(f16), [TP_BF16] = TP__CONV_ROW(bf16),
    [TP_I32] = TP__CONV_ROW(i32), [TP_I64] = TP__CONV_ROW(i64),
};

/* Same-dtype copy; ctx points at the element size. */
static void tp__run_move(char *d, int64_t ds, const char *s, int64_t ss, int64_t n, void *ctx)
{
    size_t es = *(const size_t *)ctx;
    if (ds == (int64_t)es && ss == (int64_t)es) {
        memcpy(d, s, (size_t)n * es);
        return;
    }
    switch (es) {
    case 2:
        for (int64_t i = 0; i < n; i++, d += ds, s += ss)
            memcpy(d, s, 2);
        break;
    case 4:
        for (int64_t i = 0; i < n; i++, d += ds, s += ss)
            memcpy(d, s, 4);
        break;
    default:
        for (int64_t i = 0; i < n; i++, d += ds, s += ss)
            memcpy(d, s, 8);
        break;
    }
}

/* CPU copy between two strided arrays of the same shape (strides in elements). */
static void tp__cpu_copy(int ndim, const int64_t *shape, char *d, tp_dtype dd,
                         const int64_t *dstride, const char *s, tp_dtype sd,
                         const int64_t *sstride)
{
    size_t des = tp_dtype_size(dd), ses = tp_dtype_size(sd);
    int64_t db[TP_MAX_DIMS], sb[TP_MAX_DIMS];
    for (int i = 0; i < ndim; i++) {
        db[i] = dstride[i] * (int64_t)des;
        sb[i] = sstride[i] * (int64_t)ses;
    }
    if (dd == sd)
        tp__foreach2(ndim, shape, d, db, s, sb, tp__run_move, &des);
    else
        tp__foreach2(ndim, shape, d, db, s, sb, tp__conv_table[sd][dd], NULL);
}

/* ---- the CPU's memory table ------------------------------------------------ */

static tp_status tp__cpu_check(const char *fn, int index)
{
    if (index != 0)
        return tp__error(TP_ERR_INVALID_ARG, "%s: CPU device index must be 0, got %d", fn, index);
    return TP_OK;
}

static int tp__cpu_count(void) { return 1; }

static tp_status tp__cpu_alloc(const char *fn, int index, size_t nbytes, bool zero, void **out)
{
    /* through the caching allocator (cache.c), which also keeps the stats */
    void *p = tp__cpu_cache_alloc(nbytes, zero);
    if (!p)
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory allocating %zu bytes", fn, nbytes);
    *out = p;
    return TP_OK;
}

static void tp__cpu_free(int index, void *p) { tp__cpu_cache_free(p); }

static tp_status tp__cpu_zero(const char *fn, int index, void *p, size_t nbytes)
{
    memset(p, 0, nbytes);
    return TP_OK;
}

static tp_status tp__cpu_memcpy(const char *fn, void *dst, tp_device dd, const void *src,
                                tp_device sd, size_t n)
{
    memcpy(dst, src, n);
    return TP_OK;
}

static tp_status tp__cpu_strided_copy(const char *fn, int index, size_t es, int ndim,
                                      const int64_t *shape, void *dst, const int64_t *dstride,
                                      const void *src, const int64_t *sstride)
{
    int64_t db[TP_MAX_DIMS], sb[TP_MAX_DIMS];
    for (int i = 0; i < ndim; i++) {
        db[i] = dstride[i] * (int64_t)es;
        sb[i] = sstride[i] * (int64_t)es;
    }
    tp__foreach2(ndim, shape, dst, db, src, sb, tp__run_move, &es);
    return TP_OK;
}

static tp_status tp__cpu_sync(const char *fn, int index)
{
    return TP_OK; /* host work is complete when the call that issued it returns */
}

const tp__device_mem tp__cpu_mem = {
    .name = "cpu", .check = tp__cpu_check, .count = tp__cpu_count,
    .alloc = tp__cpu_alloc, .free = tp__cpu_free, .zero = tp__cpu_zero,
    .copy = tp__cpu_memcpy, .strided_copy = tp__cpu_strided_copy,
    .sync = tp__cpu_sync,
};

/* ---- copies --------------------------------------------------------------- */

static bool tp__same_shape(const tp_tensor *a, const tp_tensor *b)
{
    if (a->ndim != b->ndim)
        return false;
    for (int i = 0; i < a->ndim; i++)
        if (a->shape[i] != b->shape[i])
            return false;
    return true;
}

/* Bytes from a view's first element through its last. Strides are never
 * negative, so this is the window a staged strided copy must move. */
static size_t tp__span_bytes(const tp_tensor *t)
{
    int64_t last = 0;
    for (int i = 0; i < t->ndim; i++)
        last += (t->shape[i] - 1) * t->stride[i];
    return (size_t)(last + 1) * tp_dtype_size(t->dtype);
}

/*
 * Copy with at least one side off the CPU, through that device's memory
 * table (`mem`: dst's unless dst is on the CPU). Same dtype and both
 * contiguous is one byte copy; on one device, the device's strided copy or,
 * between dtypes, its conversion kernel. A dtype change across devices
 * (host and device, or two devices) is converted on a device as well, through
 * a contiguous temporary there: on src's device into dst's dtype when src is
 * on one (then those bytes move), else on dst's device from src's bytes moved
 * in src's dtype. What is left (one dtype, strided, across devices) goes
 * through host staging: a strided device source is fetched as the whole
 * window its elements span, gathered on the host, and a strided device
 * destination is read, patched and written back as a window (so elements
 * inside the window but outside the view are rewritten with their own
 * values: do not run kernels on them concurrently).
 */
static tp_status tp__copy_device(const char *fn, const tp__device_mem *mem, tp_tensor *dst,
                                 const tp_tensor *src)
{
    tp_device dd = dst->storage->device, sd = src->storage->device;
    if (dst->dtype == src->dtype && tp__is_contiguous(dst) && tp__is_contiguous(src))
        return mem->copy(fn, tp_tensor_data(dst), dd, tp_tensor_data(src), sd,
                         tp_tensor_nbytes(src));
    /* one device (shard chunks, padding, mixed-precision casts): on the device */
    if (tp__device_eq(dd, sd) && dst->dtype == src->dtype)
        return mem->strided_copy(fn, dd.index, tp_dtype_size(dst->dtype), dst->ndim, dst->shape,
                                 tp_tensor_data(dst), dst->stride, tp_tensor_data(src),
                                 src->stride);
    if (tp__device_eq(dd, sd))
        return mem->convert(fn, dd.index, dst->ndim, dst->shape, tp_tensor_data(dst), dst->dtype,
                            dst->stride, tp_tensor_data(src), src->dtype, src->stride);
    if (dst->dtype != src->dtype) {
        bool on_src = sd.type != TP_DEVICE_CPU;
        tp_tensor *tmp = NULL;
        TP_CHECK(tp__tensor_new(fn, on_src ? dst->dtype : src->dtype, on_src ? sd : dd, src->ndim,
                                src->shape, false, &tmp));
        /* each step is one device or one dtype, so neither comes back here */
        tp_status st = tp__copy_device(fn, on_src ? tp__device_mem_of(sd.type) : mem, tmp, src);
        if (st == TP_OK)
            st = tp__copy_device(fn, mem, dst, tmp);
        tp_tensor_release(tmp);
        return st;
    }

    tp_status st = TP_OK;
    char *sbuf = NULL, *dbuf = NULL;
    const char *sbase = tp_tensor_data(src);
    if (sd.type != TP_DEVICE_CPU) {
        size_t n = tp__span_bytes(src);
        sbuf = tp__aligned_alloc(n, TP__ALIGN);
        if (!sbuf) {
            st = tp__error(TP_ERR_NO_MEMORY, "%s: out of memory for a %zu-byte staging buffer",
                           fn, n);
            goto done;
        }
        TP_CHECK_GOTO(mem->copy(fn, sbuf, TP_CPU, sbase, sd, n), st, done);
        sbase = sbuf;
    }
    if (dd.type == TP_DEVICE_CPU) {
        tp__cpu_copy(dst->ndim, dst->shape, tp_tensor_data(dst), dst->dtype, dst->stride, sbase,
                     src->dtype, src->stride);
        goto done;
    }
    bool contig = tp__is_contiguous(dst);
    size_t n = contig ? tp_tensor_nbytes(dst) : tp__span_bytes(dst);
    dbuf = tp__aligned_alloc(n, TP__ALIGN);
    if (!dbuf) {
        st = tp__error(TP_ERR_NO_MEMORY, "%s: out of memory for a %zu-byte staging buffer", fn,
                       n);
        goto done;
    }
    int64_t cstride[TP_MAX_DIMS];
    const int64_t *dstride = dst->stride;
    if (contig) {
        tp__contiguous_strides(dst->ndim, dst->shape, cstride);
        dstride = cstride;
    } else {
        TP_CHECK_GOTO(mem->copy(fn, dbuf, TP_CPU, tp_tensor_data(dst), dd, n), st, done);
    }
    tp__cpu_copy(dst->ndim, dst->shape, dbuf, dst->dtype, dstride, sbase, src->dtype,
                 src->stride);
    st = mem->copy(fn, tp_tensor_data(dst), dd, dbuf, TP_CPU, n);
done:
    tp__free(sbuf);
    tp__free(dbuf);
    return st;
}

/* ---- overlap of two views of one storage ---------------------------------- */

/* One term of the byte distance between an element of a and one of b:
 * c * s with s > 0 and c in [lo, hi]. */
typedef struct tp__ov_dim {
    int64_t s, lo, hi;
} tp__ov_dim;

enum { TP__OV_DISJOINT = 0, TP__OV_OVERLAP = 1, TP__OV_UNKNOWN = 2 };

/* Whether sum over j >= i of c_j * d[j].s can land in [lo, hi]: dims in
 * decreasing stride, rmin/rmax[i] the least and greatest such sum. Each step
 * tries the few values of c_i that leave the rest within reach, so views cut
 * from one row-major layout (narrow, select, view) take a handful of steps
 * per dim; *budget bounds the work for any other stride pattern. */
static int tp__ov_search(const tp__ov_dim *d, int n, int i, int64_t lo, int64_t hi,
                         const int64_t *rmin, const int64_t *rmax, long *budget)
{
    if (rmax[i] < lo || rmin[i] > hi)
        return TP__OV_DISJOINT;
    if (i == n)
        return TP__OV_OVERLAP; /* the empty sum 0 is in [lo, hi] */
    if (--*budget < 0)
        return TP__OV_UNKNOWN;
    int64_t s = d[i].s;
    /* c * s + r in [lo, hi] for some r in [rmin[i+1], rmax[i+1]] */
    int64_t a = lo - rmax[i + 1], b = hi - rmin[i + 1];
    int64_t cmin = a >= 0 ? (a + s - 1) / s : -(-a / s);
    int64_t cmax = b >= 0 ? b / s : -((-b + s - 1) / s);
    if (cmin < d[i].lo)
        cmin = d[i].lo;
    if (cmax > d[i].hi)
        cmax = d[i].hi;
    for (int64_t c = cmin; c <= cmax; c++) {
        int r = tp__ov_search(d, n, i + 1, lo - c * s, hi - c * s, rmin, rmax, budget);
        if (r != TP__OV_DISJOINT)
            return r;
    }
    return TP__OV_DISJOINT;
}

/* Whether some byte of an element of view a is also a byte of an element of
 * view b (both nonempty, on one device). Exact: an element at byte x of a
 * and one at byte y of b share a byte iff x - y lies in [1 - es_a, es_b - 1],
 * and x - y is a sum of stride terms searched above (dims of equal stride
 * merged), so views that interleave without touching (even and odd columns,
 * even and odd rows) are told apart from views that share elements.
 * TP__OV_UNKNOWN only when the search runs out of budget. */
static int tp__views_overlap(const tp_tensor *a, const tp_tensor *b)
{
    tp__ov_dim d[2 * TP_MAX_DIMS];
    int n = 0;
    int64_t ea = (int64_t)tp_dtype_size(a->dtype), eb = (int64_t)tp_dtype_size(b->dtype);
    for (int side = 0; side < 2; side++) {
        const tp_tensor *t = side ? b : a;
        int64_t es = side ? eb : ea;
        for (int k = 0; k < t->ndim; k++) {
            int64_t s = t->stride[k] * es * (side ? -1 : 1), m = t->shape[k] - 1;
            if (s == 0 || m == 0)
                continue;
            d[n++] = s > 0 ? (tp__ov_dim){s, 0, m} : (tp__ov_dim){-s, -m, 0};
        }
    }
    /* decreasing stride (insertion sort: at most 16 dims), equal strides merged */
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && d[j - 1].s < d[j].s; j--) {
            tp__ov_dim x = d[j];
            d[j] = d[j - 1];
            d[j - 1] = x;
        }
    int m = 0;
    for (int i = 0; i < n; i++) {
        if (m > 0 && d[m - 1].s == d[i].s) {
            d[m - 1].lo += d[i].lo;
            d[m - 1].hi += d[i].hi;
        } else {
            d[m++] = d[i];
        }
    }
    int64_t rmin[2 * TP_MAX_DIMS + 1], rmax[2 * TP_MAX_DIMS + 1];
    rmin[m] = rmax[m] = 0;
    for (int i = m - 1; i >= 0; i--) {
        rmin[i] = rmin[i + 1] + d[i].lo * d[i].s;
        rmax[i] = rmax[i + 1] + d[i].hi * d[i].s;
    }
    /* x - y = (a's first byte - b's first byte) + the sum of the terms */
    int64_t base = (int64_t)((uintptr_t)tp_tensor_data(a) - (uintptr_t)tp_tensor_data(b));
    int64_t lo = 1 - ea - base, hi = eb - 1 - base;
    /* the sum is a multiple of the strides' gcd: none in [lo, hi], no overlap
     * (the interleaved columns of one buffer, whatever their count) */
    int64_t g = 0;
    for (int i = 0; i < m; i++)
        for (int64_t x = d[i].s; x;) {
            int64_t r = g % x;
            g = x;
            x = r;
        }
    if (g > 0) {
        int64_t top = hi >= 0 ? hi / g : -((-hi + g - 1) / g); /* floor(hi / g) */
        if (top * g < lo)
            return TP__OV_DISJOINT;
    }
    long budget = 100000;
    return tp__ov_search(d, m, 0, lo, hi, rmin, rmax, &budget);
}

/* One storage, or two whose memory intersects (tp_tensor_from_blob on the
 * same buffer) on one device. */
static bool tp__storages_alias(const tp_storage *a, const tp_storage *b)
{
    if (a == b)
        return true;
    if (!tp__device_eq(a->device, b->device))
        return false;
    uintptr_t x = (uintptr_t)a->data, y = (uintptr_t)b->data;
    return a->nbytes && b->nbytes && x < y + b->nbytes && y < x + a->nbytes;
}

static tp_status tp__to(const char *fn, const tp_tensor *src, tp_dtype dtype, tp_device device,
                        tp_tensor **out);

static tp_status tp__copy(const char *fn, tp_tensor *dst, const tp_tensor *src)
{
    TP_CHECK(tp__need_storage(dst, fn, "dst"));
    TP_CHECK(tp__need_storage(src, fn, "src"));
    if (!tp__same_shape(dst, src)) {
        char b1[TP__SHAPE_BUF], b2[TP__SHAPE_BUF];
        return tp__error(TP_ERR_INVALID_ARG, "%s: dst shape %s != src shape %s", fn,
                         tp__shape_str(dst->ndim, dst->shape, b1, sizeof b1),
                         tp__shape_str(src->ndim, src->shape, b2, sizeof b2));
    }
    if (tp__numel(src) == 0)
        return TP_OK;
    if (tp__storages_alias(dst->storage, src->storage)) {
        bool same = tp_tensor_data(dst) == tp_tensor_data(src) && dst->dtype == src->dtype;
        for (int d = 0; d < dst->ndim && same; d++)
            same = dst->shape[d] == 1 || dst->stride[d] == src->stride[d];
        if (same)
            return TP_OK; /* the same view: copying onto itself changes nothing */
        int ov = tp__views_overlap(dst, src);
        if (ov == TP__OV_OVERLAP)
            return tp__error(TP_ERR_INVALID_ARG,
                             "%s: dst and src overlap in memory (they share bytes but are "
                             "not the same view)",
                             fn);
        if (ov == TP__OV_UNKNOWN) {
            /* strides too irregular for the bounded search to settle: read src
             * into a temporary first, which is right whether or not they meet */
            tp_tensor *tmp = NULL;
            TP_CHECK(tp__to(fn, src, src->dtype, src->storage->device, &tmp));
            tp_status st = tp__copy(fn, dst, tmp);
            tp_tensor_release(tmp);
            return st;
        }
    }
    tp_device dd = dst->storage->device, sd = src->storage->device;
    if (dd.type == TP_DEVICE_META) {
        /* a meta dst takes the shape only: nothing to write, but a step being
         * planned pays the copy's time */
        tp__meta_note_copy(dst->dtype, tp__numel(dst));
        return TP_OK;
    }
    if (sd.type == TP_DEVICE_META)
        return tp__meta_refuse(fn, "src");
    if (dd.type == TP_DEVICE_CPU && sd.type == TP_DEVICE_CPU) {
        tp__cpu_copy(dst->ndim, dst->shape, tp_tensor_data(dst), dst->dtype, dst->stride,
                     tp_tensor_data(src), src->dtype, src->stride);
        return TP_OK;
    }
    return tp__copy_device(fn, tp__device_mem_of(dd.type != TP_DEVICE_CPU ? dd.type : sd.type),
                           dst, src);
}

tp_status tp_tensor_copy(tp_tensor *dst, const tp_tensor *src)
{
    TP_ARG_CHECK(dst, "tp_tensor_copy: dst is NULL");
    TP_ARG_CHECK(src, "tp_tensor_copy: src is NULL");
    return tp__copy("tp_tensor_copy", dst, src);
}

static tp_status tp__to(const char *fn, const tp_tensor *src, tp_dtype dtype, tp_device device,
                        tp_tensor **out)
{
    tp_tensor *t = NULL;
    TP_CHECK(tp__tensor_new(fn, dtype, device, src->ndim, src->shape, false, &t));
    tp_status st = tp__copy(fn, t, src);
    if (st != TP_OK) {
        tp_tensor_release(t);
        return st;
    }
    *out = t;
    return TP_OK;
}

tp_status tp_tensor_to(const tp_tensor *src, tp_dtype dtype, tp_device device, tp_tensor **out)
{
    TP_ARG_CHECK(out, "tp_tensor_to: out is NULL");
    *out = NULL;
    TP_ARG_CHECK(src, "tp_tensor_to: src is NULL");
    return tp__to("tp_tensor_to", src, dtype, device, out);
}

tp_status tp_tensor_clone(const tp_tensor *src, tp_tensor **out)
{
    TP_ARG_CHECK(out, "tp_tensor_clone: out is NULL");
    *out = NULL;
    TP_ARG_CHECK(src, "tp_tensor_clone: src is NULL");
    TP_CHECK(tp__need_storage(src, "tp_tensor_clone", "src"));
    return tp__to("tp_tensor_clone", src, src->dtype, src->storage->device, out);
}

/* ---- fill and element access ---------------------------------------------- */

typedef struct tp__fill_ctx {
    unsigned char pattern[8];
    size_t es;
    bool zero;
} tp__fill_ctx;

static void tp__run_fill(char *d, int64_t ds, const char *s, int64_t ss, int64_t n, void *vctx)
{
    (void)s;
    (void)ss;
    const tp__fill_ctx *c = vctx;
    if (c->zero && ds == (int64_t)c->es) {
        memset(d, 0, (size_t)n * c->es);
        return;
    }
    switch (c->es) {
    case 2:
        for (int64_t i = 0; i < n; i++, d += ds)
            memcpy(d, c->pattern, 2);
        break;
    case 4:
        for (int64_t i = 0; i < n; i++, d += ds)
            memcpy(d, c->pattern, 4);
        break;
    default:
        for (int64_t i = 0; i < n; i++, d += ds)
            memcpy(d, c->pattern, 8);
        break;
    }
}

static void tp__fill_cpu(tp_tensor *t, double value)
{
    tp__fill_ctx c;
    c.es = tp_dtype_size(t->dtype);
    memset(c.pattern, 0, sizeof c.pattern);
    tp__store_f64(c.pattern, t->dtype, 0, value);
    c.zero = true;
    for (size_t i = 0; i < c.es; i++)
        c.zero = c.zero && c.pattern[i] == 0;
    int64_t b[TP_MAX_DIMS];
    for (int i = 0; i < t->ndim; i++)
        b[i] = t->stride[i] * (int64_t)c.es;
    char *p = tp_tensor_data(t);
    tp__foreach2(t->ndim, t->shape, p, b, p, b, tp__run_fill, &c);
}

tp_status tp_tensor_fill(tp_tensor *t, double value)
{
    const char *fn = "tp_tensor_fill";
    TP_ARG_CHECK(t, "%s: t is NULL", fn);
    TP_CHECK(tp__need_storage(t, fn, "t"));
    if (tp__numel(t) == 0)
        return TP_OK;
    tp_device dev = t->storage->device;
    if (dev.type == TP_DEVICE_META)
        return TP_OK;
    if (dev.type == TP_DEVICE_CPU) {
        tp__fill_cpu(t, value);
        return TP_OK;
    }
    /* Zero bytes on a contiguous view: one memset on the device. */
    unsigned char pat[8] = {0};
    tp__store_f64(pat, t->dtype, 0, value);
    bool zero = true;
    for (size_t i = 0; i < tp_dtype_size(t->dtype); i++)
        zero = zero && pat[i] == 0;
    if (zero && tp__is_contiguous(t))
        return tp__device_mem_of(dev.type)->zero(fn, dev.index, tp_tensor_data(t),
                                                 tp_tensor_nbytes(t));
    tp_tensor *host = NULL;
    TP_CHECK(tp__tensor_new(fn, t->dtype, TP_CPU, t->ndim, t->shape, false, &host));
    tp__fill_cpu(host, value);
    tp_status st = tp__copy(fn, t, host);
    tp_tensor_release(host);
    return st;
}

/* Element offset (in elements from storage->data) of multi-index idx. */
static tp_status tp__elem_offset(const char *fn, const tp_tensor *t, const int64_t *idx,
                                 int64_t *off)
{
    TP_ARG_CHECK(idx || t->ndim == 0, "%s: idx is NULL for a %d-d tensor", fn, t->ndim);
    int64_t o = t->offset;
    for (int i = 0; i < t->ndim; i++) {
        TP_ARG_CHECK(idx[i] >= 0 && idx[i] < t->shape[i],
                     "%s: index %lld out of range for size %lld of dim %d", fn,
                     (long long)idx[i], (long long)t->shape[i], i);
        o += idx[i] * t->stride[i];
    }
    *off = o;
    return TP_OK;
}

/* One element's bytes between a tensor's storage (any device) and elem:
 * in place on the CPU, else one copy through the device's memory table,
 * complete on return and ordered after the work queued on the device. */
static tp_status tp__elem_io(const char *fn, const tp_tensor *t, const int64_t *idx,
                             unsigned char *elem, bool write)
{
    TP_ARG_CHECK(t, "%s: t is NULL", fn);
    TP_CHECK(tp__need_storage(t, fn, "t"));
    if (t->storage->device.type == TP_DEVICE_META)
        return tp__meta_refuse(fn, "t");
    int64_t off = 0;
    TP_CHECK(tp__elem_offset(fn, t, idx, &off));
    size_t es = tp_dtype_size(t->dtype);
    char *p = (char *)t->storage->data + (size_t)off * es;
    tp_device dev = t->storage->device;
    if (dev.type == TP_DEVICE_CPU) {
        if (write)
            memcpy(p, elem, es);
        else
            memcpy(elem, p, es);
        return TP_OK;
    }
    const tp__device_mem *m = tp__device_mem_of(dev.type);
    return write ? m->copy(fn, p, dev, elem, TP_CPU, es) : m->copy(fn, elem, TP_CPU, p, dev, es);
}

tp_status tp_tensor_get(const tp_tensor *t, const int64_t *idx, double *value)
{
    TP_ARG_CHECK(value, "tp_tensor_get: value is NULL");
    *value = 0.0;
    unsigned char elem[8];
    TP_CHECK(tp__elem_io("tp_tensor_get", t, idx, elem, false));
    *value = tp__load_f64(elem, t->dtype, 0);
    return TP_OK;
}

tp_status tp_tensor_set(tp_tensor *t, const int64_t *idx, double value)
{
    unsigned char elem[8];
    if (t)
        tp__store_f64(elem, t->dtype, 0, value);
    return tp__elem_io("tp_tensor_set", t, idx, elem, true);
}

/* ---- comparison ----------------------------------------------------------- */

enum { TP__CMP_EQUAL, TP__CMP_CLOSE, TP__CMP_MAXDIFF };

typedef struct tp__cmp_ctx {
    int mode;
    tp_dtype ad, bd;
    double rtol, atol;
    bool ok;     /* EQUAL / CLOSE: every element so far passed */
    double diff; /* MAXDIFF: NaN once any pair differs by NaN */
} tp__cmp_ctx;

static void tp__run_cmp(char *a, int64_t as, const char *b, int64_t bs, int64_t n, void *vctx)
{
    tp__cmp_ctx *c = vctx;
    for (int64_t i = 0; i < n; i++, a += as, b += bs) {
        double x = tp__load_f64(a, c->ad, 0), y = tp__load_f64(b, c->bd, 0);
        switch (c->mode) {
        case TP__CMP_EQUAL:
            c->ok = c->ok && x == y;
            break;
        case TP__CMP_CLOSE:
            /* equal infinities are close; any other inf or NaN is not (the
             * bound atol + rtol*|inf| alone would accept +inf vs -inf) */
            if (x != y && (!isfinite(x) || !isfinite(y) ||
                           !(fabs(x - y) <= c->atol + c->rtol * fabs(y))))
                c->ok = false;
            break;
        default: {
            double d = x == y ? 0.0 : fabs(x - y);
            if (isnan(d) || d > c->diff)
                c->diff = d;
            break;
        }
        }
    }
}

/* Host copy for comparison; *tmp holds what the caller must release. */
static tp_status tp__host_view(const char *fn, const tp_tensor *t, const tp_tensor **host,
                               tp_tensor **tmp)
{
    *tmp = NULL;
    if (t->storage->device.type == TP_DEVICE_CPU) {
        *host = t;
        return TP_OK;
    }
    TP_CHECK(tp__to(fn, t, t->dtype, TP_CPU, tmp));
    *host = *tmp;
    return TP_OK;
}

static tp_status tp__compare(const char *fn, const tp_tensor *a, const tp_tensor *b,
                             bool mismatch_is_error, tp__cmp_ctx *c)
{
    TP_ARG_CHECK(a, "%s: a is NULL", fn);
    TP_ARG_CHECK(b, "%s: b is NULL", fn);
    TP_CHECK(tp__need_storage(a, fn, "a"));
    TP_CHECK(tp__need_storage(b, fn, "b"));
    if (a->storage->device.type == TP_DEVICE_META)
        return tp__meta_refuse(fn, "a");
    if (b->storage->device.type == TP_DEVICE_META)
        return tp__meta_refuse(fn, "b");
    if (!tp__same_shape(a, b)) {
        if (!mismatch_is_error) {
            c->ok = false;
            return TP_OK;
        }
        char b1[TP__SHAPE_BUF], b2[TP__SHAPE_BUF];
        return tp__error(TP_ERR_INVALID_ARG, "%s: shape %s != shape %s", fn,
                         tp__shape_str(a->ndim, a->shape, b1, sizeof b1),
                         tp__shape_str(b->ndim, b->shape, b2, sizeof b2));
    }
    if (tp__numel(a) == 0)
        return TP_OK;
    const tp_tensor *ha, *hb;
    tp_tensor *ta = NULL, *tb = NULL;
    tp_status st;
    TP_CHECK_GOTO(tp__host_view(fn, a, &ha, &ta), st, done);
    TP_CHECK_GOTO(tp__host_view(fn, b, &hb, &tb), st, done);
    int64_t as[TP_MAX_DIMS], bs[TP_MAX_DIMS];
    for (int i = 0; i < a->ndim; i++) {
        as[i] = ha->stride[i] * (int64_t)tp_dtype_size(ha->dtype);
        bs[i] = hb->stride[i] * (int64_t)tp_dtype_size(hb->dtype);
    }
    c->ad = ha->dtype;
    c->bd = hb->dtype;
    tp__foreach2(a->ndim, a->shape, tp_tensor_data(ha), as, tp_tensor_data(hb), bs, tp__run_cmp,
                 c);
done:
    tp_tensor_release(ta);
    tp_tensor_release(tb);
    return st;
}

tp_status tp_tensor_equal(const tp_tensor *a, const tp_tensor *b, bool *equal)
{
    TP_ARG_CHECK(equal, "tp_tensor_equal: equal is NULL");
    *equal = false;
    tp__cmp_ctx c = {.mode = TP__CMP_EQUAL, .ok = true};
    TP_CHECK(tp__compare("tp_tensor_equal", a, b, false, &c));
    *equal = c.ok;
    return TP_OK;
}

tp_status tp_tensor_allclose(const tp_tensor *a, const tp_tensor *b, double rtol, double atol,
                             bool *close)
{
    TP_ARG_CHECK(close, "tp_tensor_allclose: close is NULL");
    *close = false;
    TP_ARG_CHECK(rtol >= 0 && atol >= 0, "tp_tensor_allclose: rtol %g and atol %g must be >= 0",
                 rtol, atol);
    tp__cmp_ctx c = {.mode = TP__CMP_CLOSE, .rtol = rtol, .atol = atol, .ok = true};
    TP_CHECK(tp__compare("tp_tensor_allclose", a, b, false, &c));
    *close = c.ok;
    return TP_OK;
}

tp_status tp_tensor_max_abs_diff(const tp_tensor *a, const tp_tensor *b, double *diff)
{
    TP_ARG_CHECK(diff, "tp_tensor_max_abs_diff: diff is NULL");
    *diff = 0.0;
    tp__cmp_ctx c = {.mode = TP__CMP_MAXDIFF, .diff = 0.0};
    TP_CHECK(tp__compare("tp_tensor_max_abs_diff", a, b, true, &c));
    *diff = c.diff;
    return TP_OK;
}

tp_status tp__tensor_alias(const tp_tensor *t, tp_tensor **out)
{
    TP_ASSERT(t->storage);
    tp_tensor *a = tp__malloc(sizeof *a);
    if (!a)
        return tp__error(TP_ERR_NO_MEMORY, "out of memory");
    memcpy(a, t, sizeof *a);
    atomic_init(&a->refcount, 1);
    atomic_fetch_add(&t->storage->refcount, 1);
    a->ext_ops = NULL;
    a->ext = NULL;
    *out = a;
    return TP_OK;
}
