/*
 * tp/ops.h - differentiable ops on plain tensors and DTensors (CPU, f32).
 *
 * Every op takes either only plain tensors or only DTensors on one mesh;
 * mixing is TP_ERR_INVALID_ARG naming the argument. On DTensors the op picks,
 * per mesh dim, the sharding strategy that accepts the inputs' placements, or
 * else the one that is cheapest to redistribute them to (fewest bytes moved,
 * collectives counted by the comm-debug counter); an op with no strategy for
 * the layouts fails with TP_ERR_NOT_SUPPORTED naming the op and the layouts.
 * Outputs record a backward node when an input requires grad (and recording
 * is on). Ops are collective over the mesh when they redistribute.
 */
#ifndef TP_OPS_H
#define TP_OPS_H

#include <stdbool.h>
#include <stdint.h>

#include "tp/dtensor.h"
#include "tp/status.h"
#include "tp/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* y[..., out] = x[..., in] W[out, in]^T + b[out] (b may be NULL).
 * Strategies per mesh dim: x R, W S(0), b S(0) -> y S(-1) (colwise);
 * x S(-1), W S(1), b R -> y P(sum), bias added once (rowwise);
 * x S(d) (a batch dim), W R, b R -> y S(d); x P, W R, b R -> y P; all R -> R. */
TP_API tp_status tp_linear(tp_tensor *x, tp_tensor *w, tp_tensor *b, tp_tensor **y);

/* y[..., m, n] = a[..., m, k] b[k, n] (b is 2-D). Strategies as linear with
 * b read as W^T: a R, b S(1) -> S(-1); a S(-1), b S(0) -> P; a S(batch), b R;
 * a P, b R -> P; all R. */
TP_API tp_status tp_matmul(tp_tensor *a, tp_tensor *b, tp_tensor **y);

#ifdef __cplusplus
}
#endif

#endif /* TP_OPS_H */
