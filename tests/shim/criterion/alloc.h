/* Criterion 2.4's criterion/alloc.h for the in-process shim: with every test
 * in one process there is no shared-memory arena, so these are malloc & co. */
/* first, so that criterion.h sees this header whole whichever is included first */
#include "criterion.h"

#ifndef CRITERION_SHIM_ALLOC_H_
#define CRITERION_SHIM_ALLOC_H_

CRS_WEAK_ void *cr_malloc(size_t size);
CRS_WEAK_ void *cr_calloc(size_t nmemb, size_t size);
CRS_WEAK_ void *cr_realloc(void *ptr, size_t size);
CRS_WEAK_ void cr_free(void *ptr);

#endif /* !CRITERION_SHIM_ALLOC_H_ */
