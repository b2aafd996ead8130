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

/*
 * The gradients of `out` with respect to `inputs` (torch.autograd.grad):
 * reverse mode from out seeded with grad_out (NULL: ones, out must then
 * have one element), like tp_backward, but what reaches inputs[i] is
 * returned in grads[i] (a new reference; NULL when no gradient reaches it)
 * instead of being added into tp_tensor_grad(inputs[i]); leaves not listed
 * receive nothing, and no gradient hook runs. Every input must require grad
 * and be a leaf (no recorded op produced it: TP_ERR_INVALID_ARG otherwise,
 * naming it; tp_tensor_detach makes a leaf of any tensor). The graph is
 * freed as it is walked, as by tp_backward. May be called inside a backward
 * (from a custom function's backward, below): that is how a recomputed
 * forward is differentiated. On failure every grads[i] is NULL.
 */
TP_API tp_status tp_autograd_grad(tp_tensor *out, const tp_tensor *grad_out, int n,
                                  tp_tensor *const *inputs, tp_tensor **grads);

/* ---- custom functions ---------------------------------------------------------
 *
 * An op whose forward the caller computed without recording (inside
 * tp_no_grad_begin/end) and whose backward it supplies, the way
 * torch.autograd.Function extends autograd: data parallelism's parameter
 * gathers and activation recomputation (tp_module_set_recompute) are built
 * on it.
 *
 *   tp_no_grad_begin(); y = f(x, w) ...; tp_no_grad_end();
 *   tp_function_attach(y, "f", 2, (tp_tensor *[]){x, w}, f_backward, ctx, free);
 *
 * backward(ctx, grad_out, n, grad_in) runs once, inside tp_backward (or
 * tp_autograd_grad), in a no-grad scope (tp_enable_grad_begin lifts it),
 * in the backward phase of comm-debug and in the scopes that were open when
 * the function was attached. grad_out is the summed gradient of out (its
 * global shape; a DTensor's placements are whatever its consumers
 * produced); grad_in has n entries, all NULL: set grad_in[i] (a new
 * reference, inputs[i]'s shape and layout) for each input a gradient flows
 * to, and leave the others NULL. What is set for an input that does not
 * require grad is dropped. A failing status stops the backward.
 */
typedef tp_status (*tp_function_backward_fn)(void *ctx, tp_tensor *grad_out, int n,
                                             tp_tensor **grad_in);
/* Makes `out` the output of a recorded op named `name` (a string that
 * outlives the graph, a literal) with inputs[0..n) (any n >= 0; the graph
 * holds a reference on those that require grad). out must not require grad
 * yet (TP_ERR_INVALID_ARG: compute it without recording, or attach to
 * tp_tensor_detach's copy). When grad is disabled or no input requires grad,
 * nothing is attached and ctx_free(ctx) runs at once. Otherwise ctx belongs
 * to the graph from here: ctx_free (may be NULL) runs once, when the node
 * has run its backward or the graph is released. On failure the caller
 * keeps ctx. */
TP_API tp_status tp_function_attach(tp_tensor *out, const char *name, int n,
                                    tp_tensor *const *inputs, tp_function_backward_fn backward,
                                    void *ctx, void (*ctx_free)(void *ctx));

/* A new handle over t's data (plain: the same storage region; DTensor: the
 * same local shard, mesh and placements) without t's autograd state: it
 * requires no grad and has no grad_fn (torch's detach). */
TP_API tp_status tp_tensor_detach(tp_tensor *t, tp_tensor **out);

/* No-grad scopes (per thread, nestable): ops inside record nothing. */
TP_API void tp_no_grad_begin(void);
TP_API void tp_no_grad_end(void);
TP_API bool tp_grad_enabled(void);
/* Enables recording on this thread whatever no-grad scopes are open (as
 * inside a backward) until tp_enable_grad_end(token) restores them; the
 * token is what begin returned. Pairs nest. */
TP_API int tp_enable_grad_begin(void);
TP_API void tp_enable_grad_end(int token);

#ifdef __cplusplus
}
#endif

#endif /* TP_AUTOGRAD_H */
