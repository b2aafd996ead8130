/* The CUDA engine of a build without CUDA: no table, so that a CUDA device
 * asked for its kernels gets TP_ERR_NOT_SUPPORTED (tp__kernels_for). Meson
 * compiles this file instead of cuda.cu. */
#include <stddef.h>

#include "kernels/kernels.h"

const tp__kernels *const tp__kernels_cuda = NULL;
