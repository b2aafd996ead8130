/*
 * tp/tensor.h - local tensors: refcounted storage, shape, views, dtypes,
 * devices, copy/fill/compare helpers and counter-based random fills.
 *
 * Shapes are int64_t, row-major, PyTorch dimension order (dim 0 outermost).
 * Negative dims count from the end. Strides are in elements. A tensor is a view
 * (shape, strides, offset) of a refcounted storage; views share the storage.
 *
 * Ownership:
 * - tp_tensor: owned by its references. Every function that returns a tensor
 *   through an out-parameter gives the caller one reference, released with
 *   tp_tensor_release(); tp_tensor_retain() adds one. The last release frees
 *   the view together with whatever state upper layers hang on it (autograd,
 *   a DTensor's layout) and drops its storage reference. Functions that take
 *   a tensor borrow it, unless documented to retain it.
 * - storage: owned by the views over it, each holding a reference; it is
 *   freed with the last of them. Memory libtp allocated is returned to the
 *   tp_allocator (CPU) or the device; memory wrapped by tp_tensor_from_blob
 *   stays the caller's and is handed to its deleter.
 * - allocator (tp/status.h): process-wide, installed by the user; libtp
 *   never frees it.
 */
#ifndef TP_TENSOR_H
#define TP_TENSOR_H

#include <stdbool.h>
#include <stdint.h>

#include "tp/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TP_MAX_DIMS 8

typedef enum tp_dtype {
    TP_F32 = 0,
    TP_F64,
    TP_F16,
    TP_BF16,
    TP_I32,
    TP_I64,
    TP_DTYPE_COUNT
} tp_dtype;

/*
 * TP_DEVICE_META: tensors with dtype, shape, strides (and, as DTensors,
 * placements) but no memory behind them, for planning a model of any size on
 * one machine (docs/sim.md). Creating one allocates only its header. Every
 * op, backward, redistribute, module, init and optimizer step takes meta
 * tensors and computes the shapes and placements of its outputs without
 * running a kernel or drawing a random number. Writes into a meta tensor
 * (tp_tensor_fill, tp_tensor_fill_random, tp_tensor_copy into it from any
 * device) do nothing and return TP_OK once their arguments pass the usual
 * checks (shapes, overlap, distribution bounds); element access
 * (tp_tensor_get, tp_tensor_set) and reading its elements (the comparisons,
 * tp_tensor_copy or tp_tensor_to from it to another device) is
 * TP_ERR_INVALID_ARG with a message saying the tensor is a meta tensor. tp_tensor_to(cpu_tensor, dtype, TP_META, &out) gives a
 * meta tensor of the same shape (the data is dropped). tp_tensor_data of a
 * meta tensor is an address with no memory behind it, distinct for each
 * storage so that views keep their offsets and overlap checks work: never
 * dereference it. Index 0 only; tp_tensor_from_blob refuses the meta device.
 */
typedef enum tp_device_type {
    TP_DEVICE_CPU = 0,
    TP_DEVICE_CUDA = 1,
    TP_DEVICE_META = 2
} tp_device_type;

typedef struct tp_device {
    tp_device_type type;
    int index; /* CUDA ordinal; 0 for the CPU and the meta device */
} tp_device;

#define TP_CPU ((tp_device){TP_DEVICE_CPU, 0})
#define TP_CUDA(i) ((tp_device){TP_DEVICE_CUDA, (i)})
#define TP_META ((tp_device){TP_DEVICE_META, 0})

typedef struct tp_tensor tp_tensor;

/* true when t is a meta tensor (storage or, for a DTensor, local shard on
 * TP_DEVICE_META); false for NULL. */
TP_API bool tp_tensor_is_meta(const tp_tensor *t);

/* Bytes per element (2 for f16/bf16); 0 for an invalid dtype. */
TP_API size_t tp_dtype_size(tp_dtype dtype);
/* "f32", "f64", "f16", "bf16", "i32", "i64"; "invalid" otherwise. */
TP_API const char *tp_dtype_name(tp_dtype dtype);
/* true for f32, f64, f16, bf16. */
TP_API bool tp_dtype_is_float(tp_dtype dtype);

/* Number of CUDA devices usable by libtp: 0 when built without CUDA or when no
 * device is present (never an error). */
TP_API int tp_cuda_device_count(void);

/* TF32 tensor cores for f32 matrix products on CUDA devices (cuBLAS
 * CUBLAS_COMPUTE_32F_FAST_TF32: inputs rounded to 10 mantissa bits, f32
 * accumulation). Process-wide; default false: f32 products use full f32
 * (CUBLAS_COMPUTE_32F). f16/bf16 products are unaffected. Takes effect for
 * products issued after the call. Setting it in a build without CUDA is
 * allowed and has no effect. Always TP_OK. */
TP_API tp_status tp_cuda_set_allow_tf32(bool allow);
TP_API bool tp_cuda_allow_tf32(void);

/* Waits until the work libtp issued from the calling thread on CUDA device
 * `device` (its compute stream: kernels, cuBLAS, copies) is complete. Host
 * reads of device tensors (tp_tensor_copy/to to the CPU, the comparisons)
 * already wait; call this before handing a device tensor that this thread
 * just produced to another thread, whose stream does not wait for this
 * one. TP_ERR_NOT_SUPPORTED without CUDA or a device; TP_ERR_INVALID_ARG for
 * an ordinal past the device count. */
TP_API tp_status tp_cuda_synchronize(int device);

/* ---- creation and lifetime ------------------------------------------------ */

/* New contiguous tensor with uninitialized contents. ndim in [0, 8] (0 is a
 * scalar with one element); every size >= 0. CPU storage is 64-byte aligned.
 * CUDA devices need a CUDA build and a device (TP_ERR_NOT_SUPPORTED otherwise;
 * an ordinal past the device count is TP_ERR_INVALID_ARG) and use cudaMalloc.
 * The CPU device index must be 0. */
TP_API tp_status tp_tensor_empty(tp_dtype dtype, tp_device device, int ndim,
                                 const int64_t *shape, tp_tensor **out);
/* Same, filled with zeros. */
TP_API tp_status tp_tensor_zeros(tp_dtype dtype, tp_device device, int ndim,
                                 const int64_t *shape, tp_tensor **out);
/* New contiguous CPU tensor holding a copy of `data` (numel elements of dtype,
 * row-major). */
TP_API tp_status tp_tensor_from_data(tp_dtype dtype, int ndim, const int64_t *shape,
                                     const void *data, tp_tensor **out);
/* Wraps caller memory without copying. `data` must stay valid until the last
 * reference is released; then deleter(data, ctx) is called if non-NULL. data
 * must be aligned to the element size (NULL only for zero elements). On failure
 * the caller keeps ownership: the deleter is not called. */
TP_API tp_status tp_tensor_from_blob(tp_dtype dtype, tp_device device, int ndim,
                                     const int64_t *shape, void *data,
                                     void (*deleter)(void *data, void *ctx), void *ctx,
                                     tp_tensor **out);
/* Adds a reference; returns t. NULL-safe. */
TP_API tp_tensor *tp_tensor_retain(tp_tensor *t);
/* Drops a reference; frees the view (and the storage with its last view) at
 * zero. NULL is a no-op. */
TP_API void tp_tensor_release(tp_tensor *t);

/* ---- properties ----------------------------------------------------------- */

/* On a NULL tensor: ndim -1, shape/strides/data NULL, size -1, numel 0,
 * nbytes 0, dtype TP_DTYPE_COUNT, device {TP_DEVICE_CPU, -1}, is_contiguous
 * and shares_storage false. */

TP_API int tp_tensor_ndim(const tp_tensor *t);
/* Pointer to ndim sizes, valid while t is alive. */
TP_API const int64_t *tp_tensor_shape(const tp_tensor *t);
/* Size of dim d (negative counts from the end); -1 if d is out of range. */
TP_API int64_t tp_tensor_size(const tp_tensor *t, int d);
/* Pointer to ndim strides in elements. */
TP_API const int64_t *tp_tensor_strides(const tp_tensor *t);
TP_API int64_t tp_tensor_numel(const tp_tensor *t);
TP_API tp_dtype tp_tensor_dtype(const tp_tensor *t);
TP_API tp_device tp_tensor_device(const tp_tensor *t);
/* Bytes of the elements the view covers (numel * dtype size). */
TP_API size_t tp_tensor_nbytes(const tp_tensor *t);
/* Address of the first element of the view (storage + offset). */
TP_API void *tp_tensor_data(const tp_tensor *t);
TP_API bool tp_tensor_is_contiguous(const tp_tensor *t);
/* true when a and b view the same storage. */
TP_API bool tp_tensor_shares_storage(const tp_tensor *a, const tp_tensor *b);

/* ---- views (share storage; no copy) -------------------------------------- */

/* Elements [start, start+length) along dim. 0 <= start, length >= 0,
 * start + length <= size. */
TP_API tp_status tp_tensor_narrow(tp_tensor *t, int dim, int64_t start, int64_t length,
                                  tp_tensor **out);
/* torch.chunk semantics with a fixed chunk count: chunk size c = ceil(n/chunks);
 * chunk i covers [i*c, min((i+1)*c, n)), which is empty for trailing chunks
 * when n is small. index in [0, chunks). */
TP_API tp_status tp_tensor_chunk(tp_tensor *t, int64_t chunks, int dim, int64_t index,
                                 tp_tensor **out);
/* Removes dim, keeping element `index` along it (negative counts from the
 * end). */
TP_API tp_status tp_tensor_select(tp_tensor *t, int dim, int64_t index, tp_tensor **out);
/* Same elements, new shape (numel must match); t must be contiguous. One size
 * may be -1 (inferred). */
TP_API tp_status tp_tensor_view(tp_tensor *t, int ndim, const int64_t *shape,
                                tp_tensor **out);

/* Start/length of chunk `index` of n elements split into `chunks` (torch.chunk
 * rule above). Pure helper used by sharding. */
TP_API void tp_chunk_range(int64_t n, int64_t chunks, int64_t index, int64_t *start,
                           int64_t *length);

/* ---- copies and conversions ---------------------------------------------- */

/* Copies src into dst elementwise. Shapes must be equal; dtypes may differ
 * (values convert as C casts do, floats round to nearest even when narrowing to
 * f16/bf16; float -> integer truncates toward zero, with NaN -> 0 and
 * out-of-range values saturating where a C cast would be undefined); either may
 * be strided; devices may differ (CPU<->CUDA). src and dst must not share a
 * byte unless they are the same view (same first element, dtype and strides):
 * an overlap is TP_ERR_INVALID_ARG ("dst and src overlap in memory"). The
 * check is by address (views of one storage, or tensors wrapping one buffer):
 * views that interleave without sharing a byte, such as the even and odd
 * columns of a matrix, may be copied into each other. It is exact within a
 * bounded search; views whose strides are too irregular for that search to
 * settle are copied through a temporary copy of src, which is correct
 * whether or not they share bytes. Returns when the copy is complete. */
TP_API tp_status tp_tensor_copy(tp_tensor *dst, const tp_tensor *src);
/* New contiguous tensor with src's contents, on `device`, of `dtype`. */
TP_API tp_status tp_tensor_to(const tp_tensor *src, tp_dtype dtype, tp_device device,
                              tp_tensor **out);
/* New contiguous copy on the same device and dtype. */
TP_API tp_status tp_tensor_clone(const tp_tensor *src, tp_tensor **out);

/* ---- fill and element access --------------------------------------------- */

/* Sets every element to value (converted to the dtype). */
TP_API tp_status tp_tensor_fill(tp_tensor *t, double value);
/* Element at the multi-index idx (ndim entries; NULL for a scalar) as a
 * double. On CUDA: one synchronous copy of the element, after the work
 * queued on the device (like PyTorch's .item(); slow in a loop). */
TP_API tp_status tp_tensor_get(const tp_tensor *t, const int64_t *idx, double *value);
/* Sets the element at idx (converted to the dtype); on CUDA, one synchronous
 * copy as for tp_tensor_get. */
TP_API tp_status tp_tensor_set(tp_tensor *t, const int64_t *idx, double value);

/* ---- comparison ----------------------------------------------------------- */

/* *equal = same shape, and every element equal (NaN never equals). Dtypes
 * may differ (values compare as doubles). Any devices. */
TP_API tp_status tp_tensor_equal(const tp_tensor *a, const tp_tensor *b, bool *equal);
/* *close = same shape and |a-b| <= atol + rtol*|b| elementwise (NaN never
 * close). */
TP_API tp_status tp_tensor_allclose(const tp_tensor *a, const tp_tensor *b, double rtol,
                                    double atol, bool *close);
/* Largest |a-b| over all elements (shapes must match). */
TP_API tp_status tp_tensor_max_abs_diff(const tp_tensor *a, const tp_tensor *b,
                                        double *diff);

/* ---- counter-based random numbers --------------------------------------- */

/*
 * Philox-4x32-10 keyed by seed: the value of global element g depends only on
 * (seed, g), so each rank can generate exactly its shard of a global random
 * tensor without materializing the whole, and parameters initialise
 * identically at every parallel degree.
 */
TP_API void tp_philox4x32(uint64_t seed, uint64_t counter, uint32_t out[4]);
/* Uniform in [0, 1) for global element g. */
TP_API double tp_rng_uniform(uint64_t seed, uint64_t g);
/* Standard normal for global element g (Box-Muller on one Philox block). */
TP_API double tp_rng_normal(uint64_t seed, uint64_t g);

typedef enum tp_rng_dist {
    TP_RNG_UNIFORM = 0, /* uniform in [a, b) */
    TP_RNG_NORMAL,      /* mean a, standard deviation b */
    TP_RNG_RANDINT      /* integer in [a, b) (a < b, both integral) */
} tp_rng_dist;

/*
 * Fills t, viewed as the block of a global tensor of shape `global_shape`
 * starting at `offset` (both t's ndim entries), with the values the global
 * tensor holds there: element at global multi-index G gets the value of
 * counter g = row-major linear index of G in global_shape. global_shape and
 * offset may be NULL: t is then the whole tensor (a NULL global_shape means
 * t's own shape, a NULL offset means all zeros). The block must lie inside
 * the global shape. Integer dtypes store values as tp_tensor_copy converts
 * them; RANDINT bounds must be at most 2^53 in magnitude.
 */
TP_API tp_status tp_tensor_fill_random(tp_tensor *t, tp_rng_dist dist, double a, double b,
                                       uint64_t seed, const int64_t *global_shape,
                                       const int64_t *offset);

/*
 * CPU tensor memory. Tensor storage on the CPU goes through a caching
 * allocator: a released tensor's block is kept and handed to the next
 * allocation of the same size class (small blocks, up to 1 MiB: per thread,
 * four classes per power of two; larger ones: a shared pool, best fit taking
 * a block at most twice the request), so steady-state steps do not fault in
 * and zero fresh pages. Zeroed allocations still return zeros. A block freed
 * on another thread than the one that allocated it goes to a shared pool. A
 * thread's cached blocks are released when it exits.
 *
 * The bytes held idle stay under a process-wide limit: 1 GiB by default, or
 * the environment variable TP_CPU_CACHE_LIMIT (bytes, optional K/M/G suffix,
 * e.g. "256M"; "0" disables caching) read at the first tensor allocation, or
 * tp_memory_set_cache_limit. A free that would pass it returns shared-pool
 * blocks to the system first, then the freed block itself.
 *
 * With a user allocator installed (tp_set_allocator) there is no caching:
 * every storage allocation calls it and every release frees through it at
 * once. Installing or removing an allocator empties the cache.
 *
 * CUDA tensor memory comes from a stream-ordered pool per device
 * (cudaMallocFromPoolAsync / cudaFreeAsync on the calling thread's stream).
 * Freed memory stays reserved up to the pool's release threshold, which is
 * the device's cache limit (default unlimited; memory beyond it returns to
 * the system at the next synchronization). Statistics are per device:
 * allocated and peak are counted by libtp (sizes rounded up to 512 bytes),
 * reserved is the pool's reserved memory (live and idle), a cache hit is an
 * allocation for which reserved memory did not grow. A tensor released by
 * another thread than the one that allocated it is freed after the
 * allocating thread's queued work; work on it queued by any other thread
 * must be complete first (tp_cuda_synchronize).
 *
 * Every function below takes a device: the CPU (index 0) or a CUDA device
 * (TP_ERR_NOT_SUPPORTED without CUDA or without that device), or TP_META,
 * which counts the bytes its storage would take (tp/meta_memory.h; no cache:
 * tp_memory_empty_cache does nothing, tp_memory_set_cache_limit is
 * TP_ERR_NOT_SUPPORTED); another device or index is TP_ERR_INVALID_ARG.
 */
typedef struct tp_memory_info {
    size_t allocated;      /* bytes in live tensor storage (block sizes, rounded) */
    size_t reserved;       /* allocated + bytes held idle in the cache */
    size_t peak_allocated; /* highest `allocated` since start or tp_memory_reset_peak */
    size_t cache_limit;    /* the current limit on idle bytes */
    uint64_t num_allocs;     /* storage allocations since the process started */
    uint64_t num_cache_hits; /* of those, the ones served from the cache */
} tp_memory_info;

/* Process-wide statistics of `device`'s tensor memory into *out. */
TP_API tp_status tp_memory_stats(tp_device device, tp_memory_info *out);

/* Sets peak_allocated to the current allocated. */
TP_API tp_status tp_memory_reset_peak(tp_device device);

/* Returns the idle cached blocks to the system: the shared pools and the
 * calling thread's at once, every other thread's at its next tensor
 * allocation or release (or its exit). reserved drops accordingly. On a CUDA
 * device: waits for the whole device (every stream), then trims the pool to
 * its live blocks. */
TP_API tp_status tp_memory_empty_cache(tp_device device);

/* Sets the limit on idle cached bytes (0: no caching from now on); when
 * more is held, the cache is emptied as by tp_memory_empty_cache. On a CUDA
 * device: the pool's release threshold (reserved bytes kept through a
 * synchronization); idle memory beyond it is trimmed at once. */
TP_API tp_status tp_memory_set_cache_limit(tp_device device, size_t bytes);

#ifdef __cplusplus
}
#endif

#endif /* TP_TENSOR_H */
