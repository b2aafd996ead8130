/* The dtensor layer's TP_DEBUG lines (src/core/log.h): the strategy an op
 * chose and each redistribute step. Call behind TP_LOG_ON(TP_LOG_INFO), so
 * nothing is formatted when the level is lower. Not installed. */
#ifndef TP_DTENSOR_DEBUG_LOG_H
#define TP_DTENSOR_DEBUG_LOG_H

#include "core/log.h"
#include "dtensor/dtensor_internal.h"

struct tp__op;

/* After the strategy is chosen, before any input is redistributed: "op
 * linear on mesh (tp=2): input [4, 16] (R), weight [32, 16] (S(0)), bias [32]
 * (S(0)) -> out (S(1))", an input to be redistributed shown as "(S(0)) =>
 * (R)". For the op's backward (node: its node, gy: the incoming gradient):
 * "op linear backward on mesh (tp=2): grad out (S(1)) -> grad input (P(sum)),
 * grad weight (S(0))", the gradients of the inputs that need one. */
void tp__log_op(const struct tp__op *op, const tp__node *node, const tp_tensor *gy);

/* "redistribute [8, 16] (S(0)) -> (R) step 1/1: mesh dim 0 (tp=2) S(0) -> R,
 * all_gather, local f32 [4, 16] 256 bytes"; kind TP_COLL_KIND_COUNT for a
 * local step. */
void tp__log_redistribute_step(const tp_tensor *dt, const tp_placement *dst, int step,
                               int nsteps, int mesh_dim, tp_placement from, tp_placement to,
                               tp_coll_kind kind, const tp_tensor *local);

#endif /* TP_DTENSOR_DEBUG_LOG_H */
