/* The CUDA engine's fused attention (cuda_flash.cu): the flash_attn_fwd and
 * flash_attn_bwd entries of its kernel table (kernels.h), kept in a file of
 * their own. Not installed. */
#ifndef TP_KERNELS_CUDA_FLASH_H
#define TP_KERNELS_CUDA_FLASH_H

#include "kernels/kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

tp_status tp__cuda_flash_attn_fwd(tp_device dev, tp_dtype dtype, const tp__attn_geom *g,
                                  const void *q, const void *k, const void *v, void *out,
                                  float *lse);
tp_status tp__cuda_flash_attn_bwd(tp_device dev, tp_dtype dtype, const tp__attn_geom *g,
                                  const void *q, const void *k, const void *v, const void *out,
                                  const float *lse, const void *gout, float *delta, void *gq,
                                  void *gk, void *gv);

#ifdef __cplusplus
}
#endif

#endif /* TP_KERNELS_CUDA_FLASH_H */
