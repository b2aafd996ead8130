/* Data-movement kernels of the shm backend. */
#ifndef TP_SHM_KERNELS_H
#define TP_SHM_KERNELS_H

#include <stdbool.h>
#include <stddef.h>

#include "tp/comm.h"
#include "tp/tensor.h"

/* dst[j][off .. off+len) = reduce over q < nsrc of src[q][off .. off+len), for
 * every j < ndst (elements, not bytes). avg divides by `divisor`. Sources may
 * alias destinations element for element (in-place): each element is read
 * from every source before it is written. `stream` selects non-temporal stores
 * for outputs that will not be read again soon. */
void tp__shm_reduce(tp_dtype dtype, tp_reduce_op op, int divisor, int nsrc,
                    const void *const *src, size_t src_off, int ndst, void *const *dst,
                    size_t dst_off, size_t len, bool stream);

/* memcpy that uses non-temporal stores when `stream` is set and the CPU has
 * them; regions must not overlap. */
void tp__shm_copy(void *dst, const void *src, size_t bytes, bool stream);

/* Issued after streaming stores, before the release that publishes them. */
void tp__shm_store_fence(void);

#endif /* TP_SHM_KERNELS_H */
