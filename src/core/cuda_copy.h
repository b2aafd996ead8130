/* Strided copies between views of one CUDA device, on the device (cuda_copy.cu),
 * so tp_tensor_copy does not stage them through the host. Not installed. */
#ifndef TP_CUDA_COPY_H
#define TP_CUDA_COPY_H

#include <stddef.h>
#include <stdint.h>

#include "tp/config.h"
#include "tp/status.h"

#if TP_HAVE_CUDA
#ifdef __cplusplus
extern "C" {
#endif

/* dst[i] = src[i] for every multi-index i of `shape` (ndim <= TP_MAX_DIMS,
 * numel > 0), elements of `elem_size` bytes (1, 2, 4 or 8) at the element
 * strides dstride / sstride from dst / src, all on CUDA device `dev`. Runs
 * on the calling thread's stream and waits for it, so the copy is complete
 * on return. The views must not overlap. */
tp_status tp__cuda_strided_copy(const char *fn, int dev, size_t elem_size, int ndim,
                                const int64_t *shape, void *dst, const int64_t *dstride,
                                const void *src, const int64_t *sstride);

#ifdef __cplusplus
}
#endif
#endif

#endif /* TP_CUDA_COPY_H */
