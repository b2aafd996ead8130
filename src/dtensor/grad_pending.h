/* The pending-gradient hook. A component that holds the final value of a
 * leaf's gradient in flight (the data-parallel wrapper, whose bucket
 * all_reduce is launched during backward and waited for late) installs a
 * callback on the leaf; every access to the gradient through the public API
 * (tp_tensor_grad, tp_tensor_set_grad, tp_tensor_zero_grad) and backward's
 * accumulation into it call the callback first, which must finish the
 * pending work for that tensor (wait, copy the result into the gradient)
 * and remove itself. If it fails, the access fails with its status and
 * message (tp_tensor_grad returns NULL), and the callback stays installed.
 * The owner reads and writes the gradient itself through tp__grad_peek and
 * with its callback removed, so its own accesses never trigger it. Not
 * installed. */
#ifndef TP_GRAD_PENDING_H
#define TP_GRAD_PENDING_H

#include "core/core.h"

/* fn: the public function reaching the gradient ("tp_tensor_grad",
 * "tp_tensor_set_grad", "tp_tensor_zero_grad", "tp_backward"), which the
 * callback's messages name. */
typedef tp_status (*tp__grad_pending_fn)(tp_tensor *t, const char *fn, void *ctx);

/* Installs fn (ctx passed back) as t's callback, replacing any; fn NULL
 * removes it. t requires grad (it has autograd state); otherwise a no-op. */
void tp__grad_pending_set(tp_tensor *t, tp__grad_pending_fn fn, void *ctx);

/* t's gradient as it is now, without calling the callback. */
tp_tensor *tp__grad_peek(const tp_tensor *t);

#endif /* TP_GRAD_PENDING_H */
