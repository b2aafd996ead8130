/* Internal core definitions: the tensor layout and the extension seam through
 * which an upper layer hangs its state on a tensor. Everything that the CUDA
 * (C++) files share with C is in core/base.h, included here. Not installed. */
#ifndef TP_CORE_H
#define TP_CORE_H

#include <stdatomic.h>

#include "base.h"
#include "device.h"

/* ---- tensors -------------------------------------------------------------- */

/* Refcounted memory of one device, shared by the views over it: each view
 * holds one reference and the last release frees it (through its device's
 * tp__device_mem, or the tp_tensor_from_blob deleter; caller memory without a
 * deleter is never freed by libtp). */
typedef struct tp_storage {
    atomic_long refcount;
    void *data;
    size_t nbytes;
    tp_device device;
    void (*deleter)(void *data, void *ctx); /* NULL: freed by libtp */
    void *deleter_ctx;
    bool owned; /* false for blobs without deleter */
} tp_storage;

/*
 * The extension seam. Core knows nothing of the layers above it; a layer
 * that needs state on a tensor (the dtensor layer: autograd state on any
 * tensor, the distribution of a DTensor) hangs one object on it, `ext`, and
 * sets `ext_ops` to its hooks. Both are NULL on a tensor core creates; the
 * extension sets them together, before the tensor is shared between threads.
 *
 * A tensor may have no storage of its own (storage NULL: a DTensor, whose
 * data is its local shard); only an extension creates such a tensor. Core
 * functions that read or write elements refuse it through tp__need_storage,
 * whose message the extension's `refuse` hook writes.
 *
 * No accumulate hook: core never adds tensors.
 */
typedef struct tp__tensor_ext_ops {
    /* The last reference to t is going: free t->ext (t and its storage are
     * core's to free afterwards). */
    void (*finalize)(tp_tensor *t);
    /* For a tensor with no storage: the tensor that holds its elements here
     * (borrowed), or NULL. */
    tp_tensor *(*local)(const tp_tensor *t);
    /* Records why core function fn cannot take t, a tensor with no storage,
     * as its argument `what` ("t", "dst"), and returns the status. */
    tp_status (*refuse)(const tp_tensor *t, const char *fn, const char *what);
} tp__tensor_ext_ops;

struct tp_tensor {
    atomic_long refcount;
    tp_storage *storage; /* NULL only for a tensor an extension created */
    tp_dtype dtype;
    int ndim;
    int64_t shape[TP_MAX_DIMS];
    int64_t stride[TP_MAX_DIMS]; /* elements */
    int64_t offset;              /* elements from storage->data */
    const tp__tensor_ext_ops *ext_ops; /* NULL while ext is NULL */
    void *ext;                         /* the upper layer's state, freed by ext_ops->finalize */
};

/* out = the n sizes (each >= 0, or one -1) with the -1 replaced by total /
 * (the product of the others); *numel = the product of out, which the caller
 * compares with total when there was no -1. TP_ERR_INVALID_ARG naming fn for
 * a size below -1, two -1s, sizes other than 0 whose product passes
 * INT64_MAX (even beside a 0, as a tensor's shape) or a -1 that cannot be
 * inferred; messages number sizes[i] as dim first + i (sizes may be a slice
 * of a shape). */
tp_status tp__infer_sizes(const char *fn, int64_t total, int n, const int64_t *sizes, int first,
                          int64_t *out, int64_t *numel);

/* Storage resharding (fully sharded data parallel, dp/fsdp.c): drop frees
 * the bytes of t's storage (libtp's own, no deleter) and keeps its header,
 * so that every tensor over it, those an autograd graph saved included,
 * sees bytes again once restore has allocated them anew (the same size, the
 * contents undefined). Dropping a dropped storage, or one that is not
 * libtp's, and restoring one that is not dropped do nothing. Only for
 * storage whose user guarantees nothing reads it meanwhile. */
void tp__storage_drop(tp_tensor *t);
tp_status tp__storage_restore(tp_tensor *t);
bool tp__storage_dropped(const tp_tensor *t);

/* A new plain header over t's storage region (t has storage): the same
 * dtype, shape, strides and offset, no extension state. */
tp_status tp__tensor_alias(const tp_tensor *t, tp_tensor **out);

/* Records the refusal of a tensor without storage (out of line, cold). */
tp_status tp__tensor_refuse(const tp_tensor *t, const char *fn, const char *what);

/* TP_OK when t (non-NULL) has storage of its own, which a core function that
 * reads or writes elements, or makes views, needs. Otherwise the extension
 * says why (e.g. "fn: t is a DTensor; use ..."), TP_ERR_INVALID_ARG. */
static inline tp_status tp__need_storage(const tp_tensor *t, const char *fn, const char *what)
{
    return t->storage ? TP_OK : tp__tensor_refuse(t, fn, what);
}

/* The tensor holding t's elements on this process: t itself when it has
 * storage, else its extension's local tensor (borrowed; NULL if none). */
static inline tp_tensor *tp__tensor_local(const tp_tensor *t)
{
    return t->storage ? (tp_tensor *)t : t->ext_ops->local(t);
}

/* ---- layout, for the library's own hot paths ----------------------------- */

/* The number of elements of t (the product of its shape). */
static inline int64_t tp__numel(const tp_tensor *t)
{
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++)
        n *= t->shape[i];
    return n;
}

/* Whether t's strides are those of a fresh tensor of its shape (dims of size
 * 1 aside, and any strides once a dim is 0); when they are, *numel gets
 * tp__numel(t) from the same pass, which a caller that validates a buffer
 * needs next. */
static inline bool tp__contiguous_numel(const tp_tensor *t, int64_t *numel)
{
    int64_t expect = 1;
    for (int i = t->ndim - 1; i >= 0; i--) {
        if (t->shape[i] == 0) {
            *numel = 0;
            return true; /* no elements: any strides describe them */
        }
        if (t->shape[i] != 1 && t->stride[i] != expect)
            return false;
        expect *= t->shape[i];
    }
    *numel = expect;
    return true;
}

static inline bool tp__is_contiguous(const tp_tensor *t)
{
    int64_t numel;
    return tp__contiguous_numel(t, &numel);
}

#endif /* TP_CORE_H */
