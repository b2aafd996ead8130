/* The CPU engine's bf16 and f16 support (cpu_lowp.c): the f32 kernels of
 * cpu.c run on f32 copies of an entry's buffers, and each output is rounded
 * once into the entry's dtype (round to nearest even, core/base.h). Not
 * installed.
 *
 * An entry describes its buffers of the op's dtype to a frame: inputs are
 * converted to f32 scratch, outputs get f32 scratch (converted in first when
 * the kernel reads them: accumulate forms, beta != 0), and tp__lp_end rounds
 * the outputs back into place after the kernel ran, so an output may be the
 * same buffer as an input. For f32 the frame hands back the caller's
 * pointers and converts nothing: one code path for every dtype.
 *
 * Scratch comes from the frame's own stack arena when it fits, else from the
 * caching allocator (core/cache.h); a failed allocation makes the frame's
 * status TP_ERR_NO_MEMORY (recorded with tp__error), every later call a
 * no-op returning NULL, and tp__lp_end frees what was taken and returns that
 * status without writing any output. Pointers stay NULL for NULL buffers
 * (the optional arguments) and are non-NULL for empty ones. */
#ifndef TP_KERNELS_CPU_LOWP_H
#define TP_KERNELS_CPU_LOWP_H

#include <stdbool.h>
#include <stdint.h>

#include "kernels/kernels.h"

enum {
    TP__LP_CHUNK = 1024, /* elements per chunk of the elementwise driver (up to 3 buffers) */
    TP__LP_MAXBUF = 5,   /* buffers of the op's dtype per elementwise entry */
    TP__LP_ARENA = 3 * TP__LP_CHUNK,
    TP__LP_MAX = 10 /* buffers per frame (fused attention's backward: 9) */
};

typedef struct tp__lp_out_rec {
    void *dst;        /* the caller's buffer */
    const float *src; /* its f32 scratch, rows x cols compact */
    int64_t rows, cols, ld;
} tp__lp_out_rec;

typedef struct tp__lp {
    tp__kop op;
    tp_dtype dtype;
    tp_status status;
    int nblk, nout;
    size_t arena_used; /* floats */
    void *blk[TP__LP_MAX];
    tp__lp_out_rec out[TP__LP_MAX];
    _Alignas(64) float arena[TP__LP_ARENA];
} tp__lp;

/* A frame for op on buffers of dtype (f32, bf16 or f16). */
void tp__lp_begin(tp__lp *f, tp__kop op, tp_dtype dtype);
static inline bool tp__lp_ok(const tp__lp *f)
{
    return f->status == TP_OK;
}
/* An input of n contiguous elements. */
const float *tp__lp_in(tp__lp *f, const void *p, int64_t n);
/* An input read at element offsets lo .. lo + n - 1 from p (strided views,
 * lo may be negative); the result is indexed like p. */
const float *tp__lp_in_span(tp__lp *f, const void *p, int64_t lo, int64_t n);
/* An input matrix of rows x cols at leading dimension ld; *ldf receives the
 * leading dimension of the result (ld for f32, else max(cols, 1)). */
const float *tp__lp_in_mat(tp__lp *f, const void *p, int64_t rows, int64_t cols, int64_t ld,
                           int64_t *ldf);
/* An output of n contiguous elements; `read`: the kernel reads it too (its
 * current values are converted in). */
float *tp__lp_out(tp__lp *f, void *p, int64_t n, bool read);
float *tp__lp_out_mat(tp__lp *f, void *p, int64_t rows, int64_t cols, int64_t ld, bool read,
                      int64_t *ldf);
/* nbytes of scratch (64-byte aligned) for the entry's own use, NULL for a
 * failed frame (or when this one fails); freed by tp__lp_end. */
void *tp__lp_scratch(tp__lp *f, size_t nbytes);
/* Rounds the outputs into place (when the frame is OK), frees the scratch and
 * returns the frame's status. */
tp_status tp__lp_end(tp__lp *f);

/* The elementwise driver: nbuf (<= TP__LP_MAXBUF) buffers of n elements of
 * dtype, modes[i] 'i' (input), 'o' (output) or 'u' (read and written); fn
 * runs the f32 kernel on elements [off, off + len) given their f32 copies
 * buf[i] (f32: the buffers themselves, one call for all n). Chunked through
 * the frame's stack arena (TP__LP_CHUNK elements, fewer for more than three
 * buffers): no allocation, cannot fail; in place when an output is an input.
 * A NULL buffer stays NULL. */
typedef void (*tp__lp_ew_fn)(float *const *buf, int64_t off, int64_t len, const void *ctx);
void tp__lp_elementwise(tp_dtype dtype, int64_t n, int nbuf, void *const *p, const char *modes,
                        tp__lp_ew_fn fn, const void *ctx);

/* The unit driver, for entries whose work splits into independent units (a
 * softmax or norm row, a [classes, inner] slab of logits, a batch matrix):
 * buffer i is b[i].p with b[i].per elements per unit (the unit's elements
 * follow unit by unit), or, for per 0, a whole buffer of b[i].len elements
 * every unit uses (weights, accumulated weight gradients: converted once,
 * rounded once at the end); modes as the elementwise driver's. fn runs the
 * f32 kernel on units [u0, u0 + nu) given their f32 copies (per-unit
 * buffers start at unit u0; f32: the buffers themselves, one call for all).
 * The per-unit buffers go through scratch of about tp__lp_unit_elems
 * elements each (at least one unit), reused chunk after chunk: the scratch
 * stays small and in cache. TP_ERR_NO_MEMORY when scratch fails, having
 * written nothing. Outputs may be inputs (per-unit ones of the same per). */
typedef struct tp__lp_buf {
    void *p;
    int64_t per, len;
    char mode; /* 'i', 'o', 'u' */
} tp__lp_buf;
extern int64_t tp__lp_unit_elems; /* default 16384; tests lower it */
tp_status tp__lp_units(tp__kop op, tp_dtype dtype, int64_t nunits, int nbuf, const tp__lp_buf *b,
                       tp__lp_ew_fn fn, const void *ctx);

/* Element conversions of n contiguous values between dtype (f32, bf16, f16)
 * and f32 (round to nearest even). */
void tp__lp_load(tp_dtype dtype, float *dst, const void *src, int64_t n);
void tp__lp_store(tp_dtype dtype, void *dst, const float *src, int64_t n);

#endif /* TP_KERNELS_CPU_LOWP_H */
