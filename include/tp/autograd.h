/*
 * tp/autograd.h - reverse-mode automatic differentiation.
 *
 * Any tensor, plain or distributed (tp/dtensor.h), may require grad. Ops
 * (tp/ops.h) record a tape while grad is enabled; tp_backward walks it in
 * reverse and accumulates gradients into tp_tensor_grad() of the leaves.
 *
 * Ownership: a tensor's autograd state (its gradient, hooks and the node
 * that produced it) belongs to the tensor and is freed with its last
 * reference; the recorded graph holds references to the tensors its
 * backward needs until tp_backward has walked it or the output is released.
 */
#ifndef TP_AUTOGRAD_H
#define TP_AUTOGRAD_H

#include <stdbool.h>

#include "tp/status.h"
#include "tp/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Marks a leaf tensor (plain or DTensor) as requiring grad. TP_ERR_STATE for
 * a non-leaf, TP_ERR_INVALID_ARG for a non-float dtype. */
TP_API tp_status tp_tensor_set_requires_grad(tp_tensor *t, bool requires_grad);
TP_API bool tp_tensor_requires_grad(const tp_tensor *t);
/* The accumulated gradient (borrowed; same layout as t for DTensors), or NULL
 * if none was computed yet.
 *
 * A gradient whose final value is still in flight (a parameter of a data
 * parallel module, tp/dp.h, between backward and the step: its bucket's
 * all_reduce was launched and is waited for late) is finished first: the
 * call waits for that bucket's all_reduce (and copies the average into the
 * gradient), so the value returned is the averaged gradient, never a
 * half-reduced or local one; the other buckets stay in flight. If that wait
 * fails, the result is NULL with tp_last_error() naming the failure (clear
 * it first to tell this from "no gradient"), and the data-parallel wrapper
 * is failed for good: every later read returns NULL the same way, and
 * tp_ddp_sync and the optimizer steps return TP_ERR_STATE, until
 * tp_ddp_free. */
TP_API tp_tensor *tp_tensor_grad(const tp_tensor *t);
/* Drops the accumulated gradient. A gradient in flight (see tp_tensor_grad)
 * is waited for first, so nothing writes into it afterwards, then dropped:
 * the step that follows applies nothing to t. If the wait fails, the
 * gradient is dropped anyway and the failure stays with the data-parallel
 * wrapper. */
TP_API void tp_tensor_zero_grad(tp_tensor *t);
/*
 * Installs g as t's gradient (t must require grad; a reference to g is
 * taken; NULL drops the gradient like tp_tensor_zero_grad). g has t's shape,
 * dtype and device; for a DTensor t, g is a DTensor on t's mesh (any
 * placements). Later backward passes add into g in place, as they do into a
 * gradient libtp allocated, so g may be a view into a larger buffer (a
 * communication bucket) that then receives the gradient without a copy. If a
 * contribution cannot be added in place (g not contiguous), the sum is a new
 * tensor and g is no longer t's gradient. A gradient in flight (see
 * tp_tensor_grad) is waited for first; if that fails, so does this call,
 * with t unchanged.
 */
TP_API tp_status tp_tensor_set_grad(tp_tensor *t, tp_tensor *g);

/* Post-accumulate gradient hook: called on backward's thread once per
 * tp_backward for every leaf that received a gradient, as soon as the last
 * contribution of that backward was added into tp_tensor_grad(t). Inside a
 * no-grad scope. A status other than TP_OK stops the backward, which returns
 * it. */
typedef tp_status (*tp_grad_hook_fn)(tp_tensor *t, void *ctx);
/* Registers a hook on a tensor that requires grad (leaves only: a hook on a
 * non-leaf is TP_ERR_STATE). Hooks run in registration order. *handle (may be
 * NULL) receives an id for tp_tensor_remove_grad_hook. */
TP_API tp_status tp_tensor_add_grad_hook(tp_tensor *t, tp_grad_hook_fn fn, void *ctx,
                                         int *handle);
/* Removes a hook; an unknown handle is a no-op. */
TP_API void tp_tensor_remove_grad_hook(tp_tensor *t, int handle);
/* true when t was produced by a recorded op (has a backward node). */
TP_API bool tp_tensor_has_grad_fn(const tp_tensor *t);

/*
 * Reverse mode from `loss`: grad NULL means a ones tensor (loss must then have
 * one element); otherwise grad has loss's shape and layout. Collective when
 * the graph contains DTensor ops. Gradients accumulate into the leaves'
 * tp_tensor_grad(); the graph is freed as it is walked (a second backward
 * through it is TP_ERR_STATE). The comm-debug phase is "backward" meanwhile.
 */
TP_API tp_status tp_backward(tp_tensor *loss, const tp_tensor *grad);

/* No-grad scopes (per thread, nestable): ops inside record nothing. */
TP_API void tp_no_grad_begin(void);
TP_API void tp_no_grad_end(void);
TP_API bool tp_grad_enabled(void);

#ifdef __cplusplus
}
#endif

#endif /* TP_AUTOGRAD_H */
