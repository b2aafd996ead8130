/*
 * tp/hw.h - hardware descriptions and the cost model that plans with them.
 *
 * A hardware description says what one device computes and how fast the
 * links between devices move data: per-dtype peak FLOP/s and the fraction of
 * it a GEMM reaches by shape, memory bandwidth for element-wise work,
 * devices per node, and two link classes (within a node, across nodes),
 * each with a latency, a bandwidth and the collective algorithm it runs.
 * It is read from a JSON file (format: docs/plan.md), from a JSON string,
 * or taken from a built-in preset, and it answers three questions in
 * seconds: how long a GEMM takes, how long element-wise work over some
 * bytes takes, and how long a collective takes (alpha-beta: latency per
 * step plus bytes over bandwidth, with the step and byte counts of the
 * link's algorithm).
 *
 * Collective sizes follow comm-debug's convention (tp/comm_debug.h, that of
 * nccl-tests): all_reduce and broadcast the buffer, all_gather the whole
 * recv buffer, reduce_scatter, all_to_all and scatter the whole send
 * buffer, barrier 0. So a comm-debug record can be timed as it is.
 *
 * A description is immutable once made and may be shared between threads.
 */
#ifndef TP_HW_H
#define TP_HW_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "tp/comm.h"
#include "tp/status.h"
#include "tp/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tp_hw tp_hw;

/* The link a group's collectives run over: every member on one node, or
 * not. */
typedef enum tp_link_class { TP_LINK_INTRA_NODE = 0, TP_LINK_INTER_NODE = 1 } tp_link_class;

/* Collective algorithms a link class may name ("algorithm" in the file):
 * ring (bandwidth-optimal, 2(g-1) or g-1 latency steps) and tree (recursive
 * halving/doubling and binomial trees: log2 steps, the same bytes for the
 * reductions and gathers). Formulas: docs/plan.md. */
typedef enum tp_coll_algo { TP_ALGO_RING = 0, TP_ALGO_TREE = 1 } tp_coll_algo;

/* Reads a description from the JSON file at path. TP_ERR_INVALID_ARG for a
 * malformed file, an unknown key, a missing field or a value out of range,
 * with a message naming the file and the field ("links.inter_node.bandwidth
 * must be a number > 0"); TP_ERR_BACKEND if the file cannot be read. */
TP_API tp_status tp_hw_load_file(const char *path, tp_hw **out);
/* The same from JSON text; `what` names it in errors (NULL: "<string>"). */
TP_API tp_status tp_hw_load_string(const char *json, const char *what, tp_hw **out);
/* A built-in description: "h100-sxm-ndr" (8 H100 SXM per node on
 * NVLink/NVSwitch, InfiniBand NDR between nodes) or "a100-sxm-hdr" (8 A100
 * SXM 80 GB per node on NVLink, InfiniBand HDR between nodes). Their
 * figures are vendor peaks with typical efficiencies (docs/plan.md), to be
 * replaced by a calibrated file where the machine is at hand.
 * TP_ERR_INVALID_ARG for another name, listing the presets. */
TP_API tp_status tp_hw_preset(const char *name, tp_hw **out);
/* The names of the presets, NULL-terminated (static). */
TP_API const char *const *tp_hw_preset_names(void);
TP_API void tp_hw_free(tp_hw *hw);

/* The description's "name" (borrowed, valid while hw is). */
TP_API const char *tp_hw_name(const tp_hw *hw);
TP_API int tp_hw_devices_per_node(const tp_hw *hw);
/* How many ranks share one device ("ranks_per_device", default 1): more
 * than one when a job places more ranks on a node than it has devices
 * (ranks as threads on a CPU's cores, several processes per GPU). They
 * take turns: every kernel's time (GEMM and element-wise) is multiplied by
 * it, and a node holds devices_per_node x ranks_per_device ranks. */
TP_API int tp_hw_ranks_per_device(const tp_hw *hw);
/* One device's memory in bytes ("memory_bytes", optional), the limit a
 * plan's per-rank peak is held against; 0 when the description does not
 * say. The presets give what nvidia-smi reports as the device's total
 * (docs/plan.md). 0 for NULL. */
TP_API double tp_hw_memory_bytes(const tp_hw *hw);
/* A copy of hw with ranks_per_device set (1 to 65536), for a job whose
 * placement differs from the file's; free it with tp_hw_free.
 * TP_ERR_INVALID_ARG for NULL or a count out of range. */
TP_API tp_status tp_hw_share_devices(const tp_hw *hw, int ranks_per_device, tp_hw **out);

/* The link class of a group of n global ranks: intra-node when every rank
 * r has the same r / (devices_per_node x ranks_per_device), else
 * inter-node. TP_ERR_INVALID_ARG for NULL, n < 1 or a negative rank. */
TP_API tp_status tp_hw_group_link(const tp_hw *hw, const int *ranks, int n, tp_link_class *out);

/* Seconds of a [m, k] x [k, n] product in dtype: 2 m n k / (peak FLOP/s of
 * the dtype x the efficiency of the GEMM table's row for min(m, n, k)) plus
 * the kernel launch latency, times ranks_per_device; 0 when m, n or k is 0. TP_ERR_INVALID_ARG for
 * a negative size, TP_ERR_NOT_SUPPORTED when the description has no peak for
 * the dtype (naming both). */
TP_API tp_status tp_hw_gemm_time(const tp_hw *hw, tp_dtype dtype, int64_t m, int64_t n, int64_t k,
                                 double *seconds);
/* Seconds of element-wise work that reads and writes `bytes` in all:
 * bytes / memory bandwidth plus the kernel launch latency, times
 * ranks_per_device. */
TP_API tp_status tp_hw_elementwise_time(const tp_hw *hw, uint64_t bytes, double *seconds);
/* Whether asynchronous collectives on link class `link` move data beside
 * compute ("async_progress" of the link, default true: NCCL's kernels, an
 * MPI with a progress thread), or only inside the wait on them (false: the
 * shm backend and an MPI without a progress thread, on the CPU), where the
 * step-time walk charges them. false for NULL or an unknown class. */
TP_API bool tp_hw_async_progress(const tp_hw *hw, tp_link_class link);

/* Seconds of one collective of `kind` over a group of group_size ranks on
 * link class `link`, `bytes` as comm-debug counts them: the link's
 * algorithm's latency steps times its latency plus the bytes each rank
 * sends on its busiest link over the link's bandwidth. 0 for a group of one.
 * TP_ERR_INVALID_ARG for group_size < 1, an unknown kind or link. */
TP_API tp_status tp_hw_collective_time(const tp_hw *hw, tp_coll_kind kind, int group_size,
                                       tp_link_class link, uint64_t bytes, double *seconds);

/* Writes hw as JSON in the file format (every field, so that loading it
 * gives the same description). TP_ERR_BACKEND when writing fails. */
TP_API tp_status tp_hw_write_json(const tp_hw *hw, FILE *f);

#ifdef __cplusplus
}
#endif

#endif /* TP_HW_H */
