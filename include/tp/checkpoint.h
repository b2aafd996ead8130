/*
 * checkpoint.h - sharded checkpoints of a (parallelized) module and its
 * optimizer, saved by every rank in parallel and loaded into any mesh and
 * plan (resharding).
 *
 * A checkpoint is a directory:
 *   metadata.json    written by rank 0: format and version, the data files
 *                    with their sizes, user metadata, and per tensor its
 *                    dtype, global shape and stored shards (file, byte
 *                    offset, byte length, the global index box it covers,
 *                    a CRC-32C of its bytes)
 *   rank-NNNNN.bin   one per rank of the saving mesh: the shards that rank
 *                    owns, each a contiguous row-major block, little endian
 *                    (rank 0's file also holds every plain parameter)
 * Each rank writes only its own blocks, never gathering: a Shard placement
 * stores one block per shard, a block replicated over some mesh dims is
 * written once, by the rank at coordinate 0 of each of them (the lowest
 * rank holding it). Loading computes each rank's block of every tensor in
 * the module as it is now (any mesh, any placements, plain tensors) and
 * reads with pread only the bytes of the stored blocks that overlap it, in
 * runs of contiguous rows, straight into the parameter's local block
 * (copy_first: into a scratch tensor of the local shape): never the whole
 * tensor (unless the rank holds all of it). A load reads large blocks with a
 * second thread of its own per rank (reading ahead of the checksum; halves
 * of a long read at once), joined before the call returns.
 *
 * Saved: every parameter of the module (named_parameters order; a tied
 * parameter once, under its first FQN), in its own dtype; with an
 * optimizer, its per-parameter state (Adam exp_avg and exp_avg_sq, SGD's
 * momentum buffer, the f32 master of a bf16/f16 parameter: f32 blocks laid
 * out as their parameter's local block) and step count, its type and
 * hyper-parameters; user metadata (int64 values by key). Not saved:
 * gradients, RNG state, the grad scaler, modules' configuration (the loading
 * program builds the model itself).
 */
#ifndef TP_CHECKPOINT_H
#define TP_CHECKPOINT_H

#include <stdbool.h>
#include <stdint.h>

#include "tp/comm.h"
#include "tp/nn.h"
#include "tp/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The format version this library writes and reads (metadata "version"); a
 * checkpoint of a later version is TP_ERR_NOT_SUPPORTED. */
#define TP_CHECKPOINT_VERSION 1

/* The optimizer whose state goes with the module: at most one of the two
 * (both NULL: none). It must be the module's (created on it). */
typedef struct tp_checkpoint_optim {
    tp_adam *adam;
    tp_sgd *sgd;
} tp_checkpoint_optim;

/* A user metadata entry: saved as key -> value; on load, value and found
 * are written for each key asked (found false and value untouched when the
 * checkpoint has no such key). Keys: non-empty, at most 255 bytes. */
typedef struct tp_checkpoint_meta {
    const char *key;
    int64_t value;
    bool found;
} tp_checkpoint_meta;

/* Zero-initialize, then set what differs (NULL options: all zero). */
typedef struct tp_checkpoint_options {
    /* user metadata: saved, or looked up by key on load */
    int n_meta;
    tp_checkpoint_meta *meta;
    /* load: tensors of the checkpoint that the module (or the optimizer)
     * does not have are ignored instead of an error (strict=false in
     * PyTorch's load_state_dict) */
    bool allow_unexpected;
    /* load: parameters the checkpoint lacks keep their values, and an
     * optimizer given a checkpoint without optimizer state is left as it is,
     * instead of an error */
    bool allow_missing;
    /* load: a parameter whose stored dtype differs (among f32, f64, bf16,
     * f16) is converted, rounded to nearest even, instead of an error */
    bool convert_dtype;
    /* load: read every parameter into a scratch copy first and copy it in
     * only once all are read and the ranks agreed, so that even a data file
     * failing or changing mid-load leaves the model untouched; costs one
     * copy of the local parameters. Default (false): in place, see
     * tp_checkpoint_load. */
    bool copy_first;
    /* the ranks taking part when the module has no DTensor parameter (a
     * data-parallel model: rank 0 writes, every rank loads); NULL: the caller
     * alone. With DTensor parameters it must be NULL or their mesh's group
     * (tp_mesh_group). */
    tp_comm *comm;
} tp_checkpoint_options;

/*
 * Saves m (and optim's state, optim may be NULL) as a checkpoint directory
 * at `dir`. Collective over the group of the mesh of m's DTensor parameters
 * (they must share one mesh, as tp_parallelize_module makes them, or meshes
 * of one layout: the same dims, sizes and names, this rank at the same
 * coordinate, as the units of a tp_fully_shard model each slice their own
 * (tp, dp) mesh), or over opts->comm: every rank calls it with the same arguments (the same dir, on
 * a file system every rank sees). Without DTensor parameters and comm, the
 * caller saves alone.
 *
 * Atomic: rank 0 creates "<dir>.tmp-<nonce>" (the nonce reaches the others
 * through the first all_gather), each rank writes and fsyncs its data file there, rank 0 then
 * writes and fsyncs metadata.json (last: a directory without it is not a
 * checkpoint) and the directory, and renames it to dir. An existing
 * checkpoint at dir is replaced by one atomic exchange of the two names
 * (renameat2 RENAME_EXCHANGE; where the file system lacks it: the old one is
 * renamed to "<dir>.old-<nonce>", the new one renamed in), then removed.
 * So dir names the old complete checkpoint or the new complete one, never
 * a partial one; a crash may leave a "<dir>.tmp-*" or "<dir>.old-*"
 * directory behind, which nothing reads. An existing dir that is not a
 * checkpoint (no metadata.json, not empty) is never replaced
 * (TP_ERR_INVALID_ARG).
 *
 * Errors, the same status and message on every rank (the failing rank's
 * message is broadcast): NULL m or dir, an optimizer of another module, both
 * optimizers set, DTensor parameters on meshes of different layouts (a
 * model whose blocks are fully sharded and its root not), a comm that is not
 * the mesh's group, a bad meta key: TP_ERR_INVALID_ARG; a Partial
 * parameter: TP_ERR_NOT_SUPPORTED (reduce it first); a directory that cannot
 * be created or written, a full disk: TP_ERR_BACKEND naming the path; ranks
 * holding different parameters or optimizer states: TP_ERR_MISMATCH. On any
 * error nothing is left under dir (an old checkpoint there is kept) and the
 * temporary directory is removed.
 *
 * Communication: two all_gathers (each rank's status, tensor count and a
 * digest of its tensor list with rank 0's nonce; then each rank's write
 * status and CRCs), one all_reduce (the outcome) and, on failure, one
 * broadcast (its message).
 */
TP_API tp_status tp_checkpoint_save(const char *dir, tp_module *m, const tp_checkpoint_optim *optim,
                                    const tp_checkpoint_options *opts);

/*
 * Loads the checkpoint at dir into m (and optim, may be NULL) as they are
 * now: any mesh and placements, whatever the saving run's. Collective as
 * tp_checkpoint_save; every rank reads metadata.json and the byte ranges it
 * needs (see above).
 *
 * Parameters are matched by FQN (named_parameters: a tied parameter under
 * its first name). Optimizer state: the optimizer's states are replaced by
 * the checkpoint's (a parameter without stored state starts fresh at its
 * next step, as a parameter that had no gradient yet); the learning rate is
 * restored (as torch's load_state_dict restores param groups), the other
 * hyper-parameters stay the optimizer's own. A bf16/f16 parameter gets its
 * stored f32 master, or, when the checkpoint has none (saved from f32), one
 * made from the loaded value; an f32 parameter ignores a stored master.
 *
 * Checked before anything changes: every tensor is checked (sizes, CRC-32C
 * of every stored block) first; the ranks agree through an all_reduce;
 * only then is anything written into the parameters and the optimizer.
 * With copy_first the first pass reads every value into scratch. By
 * default the first pass only checks (names, shapes, sizes,
 * every block's CRC: the blocks a rank checks are read twice) and the
 * parameters are then read straight into themselves: extra memory one
 * block (when the dtype converts or the parameter lives on a GPU), never a
 * copy of the model. Every error below still leaves the model untouched;
 * the one failure that changes it is a data file failing or changing
 * between the two passes (TP_ERR_BACKEND, "parameters partly loaded";
 * options.copy_first avoids it at the cost of a copy of the local
 * parameters). The optimizer's new states become its states. Every stored block is
 * CRC-checked once per load: by the lowest rank that reads all of it, or,
 * when no rank needs all of it (a resharded load), by a rank chosen by the
 * block's index that reads it in bounded chunks.
 *
 * Errors (the same status and message on every rank, naming the tensor and
 * the file; m and optim untouched): no metadata.json or a data file that
 * cannot be opened or read: TP_ERR_BACKEND; a metadata.json that is not
 * valid (malformed JSON, a missing field, a block that lies outside its
 * tensor, overflows its file or does not match its dtype and box, blocks
 * that do not tile their tensor exactly), a data file shorter than the
 * metadata says (truncated), a CRC mismatch (corrupted data), missing or
 * unexpected names (unless allowed), a shape that is not the parameter's
 * global shape, a dtype that differs (unless convert_dtype: then
 * TP_ERR_INVALID_ARG only for non-float dtypes), optimizer state of another
 * optimizer type: TP_ERR_INVALID_ARG; a format version above
 * TP_CHECKPOINT_VERSION or a Partial parameter: TP_ERR_NOT_SUPPORTED.
 *
 * Communication: one all_reduce (the outcome) and, on failure, one
 * broadcast (its message); without copy_first the same once more after the
 * parameters are written.
 */
TP_API tp_status tp_checkpoint_load(const char *dir, tp_module *m, const tp_checkpoint_optim *optim,
                                    const tp_checkpoint_options *opts);

/* Bytes the calling thread has read from checkpoint data files (CRC checks
 * included) since it started: instrumentation, e.g. to check that a rank
 * reads only what it needs. */
TP_API uint64_t tp_checkpoint_bytes_read(void);

#ifdef __cplusplus
}
#endif

#endif /* TP_CHECKPOINT_H */
