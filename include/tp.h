/*
 * tp.h - libtp, tensor parallelism in C.
 *
 * Umbrella header: includes every public header of the library.
 *
 * A worked example - four ranks as threads, each contributing its rank, summed
 * with an all_reduce while a comm-debug counter records the call:
 *
 *     #include <tp.h>
 *
 *     static tp_status body(tp_comm *world, void *arg)
 *     {
 *         int64_t n = 4;
 *         tp_tensor *x = NULL;
 *         tp_comm_debug *dbg = NULL;
 *         tp_status st = tp_tensor_empty(TP_F32, TP_CPU, 1, &n, &x);
 *         if (st == TP_OK) st = tp_tensor_fill(x, tp_comm_rank(world));
 *         if (st == TP_OK) st = tp_comm_debug_create(&dbg);
 *         if (st == TP_OK) st = tp_comm_debug_begin(dbg);
 *         if (st == TP_OK) st = tp_all_reduce(world, x, x, TP_SUM, NULL); // in place
 *         if (st == TP_OK) st = tp_comm_debug_end(dbg);
 *         // every element of x is now 0+1+2+3 = 6, and
 *         // tp_comm_debug_count(dbg, TP_COLL_ALL_REDUCE) == 1
 *         tp_comm_debug_free(dbg);
 *         tp_tensor_release(x);
 *         return st;
 *     }
 *
 *     int main(void)
 *     {
 *         tp_status st = tp_run_local(4, body, NULL);
 *         if (st != TP_OK)
 *             fprintf(stderr, "%s: %s\n", tp_status_string(st), tp_last_error());
 *         return st != TP_OK;
 *     }
 */
#ifndef TP_H
#define TP_H

#include "tp/autograd.h"
#include "tp/checkpoint.h"
#include "tp/comm.h"
#include "tp/comm_debug.h"
#include "tp/config.h"
#include "tp/dp.h"
#include "tp/dtensor.h"
#include "tp/hw.h"
#include "tp/mesh.h"
#include "tp/meta_memory.h"
#include "tp/models.h"
#include "tp/nn.h"
#include "tp/ops.h"
#include "tp/plan.h"
#include "tp/safetensors.h"
#include "tp/status.h"
#include "tp/styles.h"
#include "tp/tensor.h"

#endif /* TP_H */
