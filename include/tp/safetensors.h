/*
 * safetensors.h - loading and saving module parameters in the safetensors
 * format (the format pretrained transformer weights ship in).
 *
 * A .safetensors file is an 8-byte little-endian header length N, N bytes of
 * JSON ({"name": {"dtype": "F32", "shape": [..], "data_offsets": [b, e]},
 * .., optional "__metadata__": {string: string}}), then the data buffer;
 * offsets are relative to the start of the buffer, row-major, little endian.
 * A sharded checkpoint is a set of such files listed by a
 * "model.safetensors.index.json" ({"weight_map": {"name": "file"}}).
 */
#ifndef TP_SAFETENSORS_H
#define TP_SAFETENSORS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tp/nn.h"
#include "tp/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Longest FQN a name-map callback may write (including the terminating 0). */
#define TP_SAFETENSORS_MAX_NAME 512

/*
 * Maps the name of a tensor in the file to a parameter FQN of the module.
 * `fqn` (fqn_cap bytes) arrives holding file_name; the callback may rewrite
 * it (0-terminated, within fqn_cap). Returns false to skip the tensor (it is
 * neither read nor counted as unknown).
 */
typedef bool (*tp_safetensors_name_fn)(const char *file_name, char *fqn, size_t fqn_cap, void *ctx);

typedef struct tp_safetensors_load_options {
    tp_safetensors_name_fn map_name; /* NULL: file names are FQNs */
    void *map_ctx;
    /* true: every tensor of the file not skipped must name a parameter and
     * every parameter must be named (TP_ERR_INVALID_ARG listing them). false:
     * unknown names are ignored and parameters not named keep their values. */
    bool strict;
    /* false (default): all or nothing, as below: every tensor is read into
     * scratch first, so a rank's peak is twice its shard. true: every
     * header, name, shape and dtype is still checked first, before any
     * tensor data is read; then each tensor is read and committed in turn,
     * straight into the parameter when the file has its dtype and it lives
     * on the CPU, else through one tensor's scratch: the peak is the
     * parameters plus one tensor. A read failure part-way (an I/O error: a
     * short file is caught by the checks) leaves the parameters before it
     * loaded; the status says which tensor failed, and the ranks agree as
     * below (TP_ERR_MISMATCH where another rank failed). For loading into a
     * fresh model, whose values nobody needs if the load fails. */
    bool stream;
} tp_safetensors_load_options;

/*
 * Loads a .safetensors file, or a sharded set through its index (a path
 * ending in ".json": an index whose weight_map names files in the index's
 * directory), into the parameters of m by FQN (NULL opts: identity names,
 * strict).
 *
 * Each rank reads (pread) only the bytes of its own block of each parameter:
 * a DTensor parameter's shard (Shard(0) of a matrix: one contiguous range;
 * Shard(1): one range per row), a replicated or plain one whole. Values are
 * converted when the file's dtype differs from the parameter's among the
 * float dtypes F32, F64, F16 and BF16 (rounded to nearest even); I32 and I64
 * load only into their own dtype; other dtypes of the format (I8, U8, BOOL,
 * F8_*, ..) are TP_ERR_NOT_SUPPORTED for a tensor that is loaded (skipped
 * ones are fine).
 *
 * All or nothing: every tensor is first read into scratch memory; the
 * parameters change only when every one succeeded. Errors name the tensor
 * and the file: a header length that is too large (> 100 MB or beyond the
 * file), malformed JSON or entries, offsets that overlap, are reversed, do not
 * match dtype x shape or lie beyond the end of the file (a truncated file),
 * a shape that is not the parameter's global shape, a dtype not convertible,
 * the same parameter named twice: TP_ERR_INVALID_ARG; a file that cannot be
 * opened or read, or is not a regular file (a directory, a FIFO: never
 * waited on): TP_ERR_BACKEND; unsupported dtypes and Partial parameters:
 * TP_ERR_NOT_SUPPORTED.
 *
 * Collective when m has DTensor parameters (they must share one mesh, as
 * tp_parallelize_module makes them): every rank of that mesh calls it, and
 * the ranks agree through exactly one all_reduce (of a 1-element i32 error
 * flag, over tp_mesh_group of the mesh) before any rank commits: a rank that
 * succeeded while another failed returns TP_ERR_MISMATCH and commits
 * nothing. Without DTensor parameters: local, no communication.
 */
TP_API tp_status tp_safetensors_load(tp_module *m, const char *path,
                                     const tp_safetensors_load_options *opts);

/*
 * Writes every parameter of m (named_parameters order; a tied parameter once,
 * under its first name) with its full value as one .safetensors file at
 * `path`, with "__metadata__": {"format": "pt"}. Tensors are laid out by
 * decreasing element size (then parameter order), so every tensor's data is
 * aligned to its element size, and the header is padded with spaces to a
 * multiple of 8 bytes. Atomic: written to "<path>.tmp.<pid>.<n>" then
 * renamed over path; on failure path is untouched and the temporary file
 * removed.
 *
 * Collective when m has DTensor parameters: each one is gathered
 * (tp_dtensor_full_tensor) and the rank `root` of the mesh group writes; the
 * ranks then agree on the outcome through one all_reduce, so that every rank
 * returns the same status (TP_ERR_MISMATCH on ranks other than the one that
 * failed). Without DTensor parameters the caller writes (root must be 0),
 * with no communication.
 */
TP_API tp_status tp_safetensors_save(tp_module *m, const char *path, int root);

/*
 * tp_safetensors_save into the directory `dir` (which must exist) in the
 * layout transformers' save_pretrained writes: "<prefix>.safetensors" when
 * every parameter fits in max_shard_bytes (0: no limit), else
 * "<prefix>-0000k-of-0000n.safetensors" (parameters in named_parameters
 * order, a new file when the next one would pass the limit, a parameter
 * larger than the limit in a file of its own) and
 * "<prefix>.safetensors.index.json" ({"metadata": {"total_size": bytes},
 * "weight_map": {fqn: file}}), written last. prefix NULL: "model". Each file
 * is atomic as tp_safetensors_save's; a failure leaves the files already
 * renamed into place and no index. Collective as tp_safetensors_save (one
 * all_reduce at the end, whatever the number of files).
 */
TP_API tp_status tp_safetensors_save_sharded(tp_module *m, const char *dir, const char *prefix,
                                             size_t max_shard_bytes, int root);

/* Reads the tensor `name` of a .safetensors file into a new plain CPU tensor
 * of the file's dtype and shape (F32, F64, F16, BF16, I32, I64; others are
 * TP_ERR_NOT_SUPPORTED). A name the file lacks is TP_ERR_INVALID_ARG; the
 * header is checked as tp_safetensors_load checks it. Local. */
TP_API tp_status tp_safetensors_read(const char *path, const char *name, tp_tensor **out);
/* Writes n plain tensors (any device, dtypes the format holds) under their
 * names as one .safetensors file, atomically, laid out as
 * tp_safetensors_save lays out parameters. Names must be distinct. Local. */
TP_API tp_status tp_safetensors_write(const char *path, int n, const char *const *names,
                                      tp_tensor *const *tensors);

/* Bytes the calling thread has read from safetensors data buffers (tensor
 * data, not headers) since it started: instrumentation, e.g. to check that a
 * rank reads only its shard. */
TP_API uint64_t tp_safetensors_bytes_read(void);

#ifdef __cplusplus
}
#endif

#endif /* TP_SAFETENSORS_H */
