/* Saving a sharded checkpoint: every rank writes the blocks it owns into its
 * data file in a temporary directory, rank 0 writes metadata.json and
 * renames the directory into place. See tp/checkpoint.h. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "ckpt/checkpoint_internal.h"

typedef struct {
    char *dir; /* the final name, without trailing '/' */
    char tmp[4096], old[4096];
    uint64_t nonce;
    uint64_t *off; /* per item: where this rank stores it; UINT64_MAX: not here */
    uint64_t fsize;
    uint32_t *crc; /* per item, this rank's */
} tp__ck_saver;

/* Where rank r stores each item (off[i], UINT64_MAX when it does not) and its
 * file's size. */
static tp_status tp__ck_layout(const tp__ck_list *l, int r, uint64_t *off, uint64_t *fsize)
{
    uint64_t at = 0;
    for (int i = 0; i < l->n; i++) {
        int64_t shape[TP_MAX_DIMS], offset[TP_MAX_DIMS];
        bool owner = false;
        const tp__ck_item *it = &l->it[i];
        TP_CHECK(tp__ck_block(l, it->param, r, shape, offset, &owner));
        uint64_t numel = 1;
        for (int d = 0; d < tp_tensor_ndim(it->param); d++)
            numel *= (uint64_t)shape[d];
        off[i] = UINT64_MAX;
        if (!owner || numel == 0)
            continue;
        at = (at + TP__CK_ALIGN - 1) / TP__CK_ALIGN * TP__CK_ALIGN;
        off[i] = at;
        at += numel * tp_dtype_size(it->dtype);
    }
    *fsize = at;
    return TP_OK;
}

/* A digest of what the list holds (names, kinds, dtypes, shapes,
 * placements): the ranks compare it before writing. */
static int64_t tp__ck_digest(const tp__ck_list *l)
{
    uint64_t h = 0xcbf29ce484222325ull;
#define TP__CK_MIX(x) (h = (h ^ (uint64_t)(x)) * 0x100000001b3ull)
    TP__CK_MIX(l->n);
    for (int i = 0; i < l->n; i++) {
        const tp__ck_item *it = &l->it[i];
        for (const char *c = it->fqn; *c; c++)
            TP__CK_MIX((unsigned char)*c);
        TP__CK_MIX(it->kind);
        TP__CK_MIX(it->dtype);
        for (int d = 0; d < tp_tensor_ndim(it->param); d++)
            TP__CK_MIX(tp_tensor_shape(it->param)[d]);
        if (tp_tensor_is_dtensor(it->param)) {
            const tp_placement *pl = tp_dtensor_placements(it->param);
            for (int d = 0; d < tp_mesh_ndim(tp_dtensor_mesh(it->param)); d++)
                TP__CK_MIX(pl[d].kind * 64 + pl[d].dim);
        }
    }
#undef TP__CK_MIX
    return (int64_t)(h >> 1);
}

/* ---- directories ------------------------------------------------------------------ */

/* Removes dir and the files in it (a checkpoint has no subdirectories). */
static void tp__ck_rmtree(const char *dir)
{
    DIR *d = opendir(dir);
    if (d) {
        struct dirent *e;
        while ((e = readdir(d)))
            if (strcmp(e->d_name, ".") && strcmp(e->d_name, ".."))
                unlinkat(dirfd(d), e->d_name, 0);
        closedir(d);
    }
    rmdir(dir);
}

static tp_status tp__ck_fsync_path(const char *path)
{
    int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0 || fsync(fd) != 0) {
        tp_status st =
            tp__error(TP_ERR_BACKEND, "cannot sync directory '%s': %s", path, strerror(errno));
        if (fd >= 0)
            close(fd);
        return st;
    }
    close(fd);
    return TP_OK;
}

/* The directory dir is in ("." for a bare name). */
static void tp__ck_parent(const char *dir, char *buf, size_t len)
{
    const char *slash = strrchr(dir, '/');
    if (!slash)
        snprintf(buf, len, ".");
    else if (slash == dir)
        snprintf(buf, len, "/");
    else
        snprintf(buf, len, "%.*s", (int)(slash - dir), dir);
}

/* An existing dir may be replaced only when it is a checkpoint (or empty). */
static tp_status tp__ck_check_target(const char *fn, const char *dir)
{
    struct stat sb;
    if (lstat(dir, &sb) != 0)
        return TP_OK; /* nothing there, or nothing reachable: mkdir says which */
    if (!S_ISDIR(sb.st_mode))
        return tp__error(TP_ERR_INVALID_ARG, "%s: '%s' exists and is not a directory", fn, dir);
    char *meta = tp__ck_path(dir, TP__CK_META);
    if (!meta)
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
    bool is_ckpt = access(meta, F_OK) == 0;
    tp__free(meta);
    if (is_ckpt)
        return TP_OK;
    DIR *d = opendir(dir);
    bool empty = d != NULL;
    struct dirent *e;
    while (d && empty && (e = readdir(d)))
        empty = !strcmp(e->d_name, ".") || !strcmp(e->d_name, "..");
    if (d)
        closedir(d);
    return empty ? TP_OK
                 : tp__error(TP_ERR_INVALID_ARG,
                             "%s: '%s' exists and is not a checkpoint (no %s): not replaced", fn,
                             dir, TP__CK_META);
}

/* Rank 0: checks the target and creates the temporary directory. */
static tp_status tp__ck_make_tmp(const char *fn, tp__ck_saver *s)
{
    TP_CHECK(tp__ck_check_target(fn, s->dir));
    static _Atomic unsigned serial;
    for (int attempt = 0;; attempt++) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        uint64_t x = ((uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec) ^
                     ((uint64_t)getpid() << 40) ^ ((uint64_t)serial++ << 20);
        x ^= x >> 31;
        x *= 0x9e3779b97f4a7c15ull;
        s->nonce = (x ^ (x >> 29)) >> 1; /* >= 0 as an int64 */
        snprintf(s->tmp, sizeof s->tmp, "%s.tmp-%016llx", s->dir, (unsigned long long)s->nonce);
        if (mkdir(s->tmp, 0755) == 0)
            return TP_OK;
        if (errno != EEXIST || attempt == 8)
            return tp__error(TP_ERR_BACKEND, "%s: cannot create '%s': %s", fn, s->tmp,
                             strerror(errno));
    }
}

/* Rank 0, everything written: renames the temporary directory to dir (an
 * existing checkpoint there by an exchange of names, then removed). */
static tp_status tp__ck_publish(const char *fn, tp__ck_saver *s)
{
    char parent[4096];
    tp__ck_parent(s->dir, parent, sizeof parent);
    TP_CHECK(tp__ck_fsync_path(s->tmp));
    struct stat sb;
    if (lstat(s->dir, &sb) != 0) {
        if (rename(s->tmp, s->dir) != 0)
            return tp__error(TP_ERR_BACKEND, "%s: cannot rename '%s' to '%s': %s", fn, s->tmp,
                             s->dir, strerror(errno));
        return tp__ck_fsync_path(parent);
    }
    if (renameat2(AT_FDCWD, s->tmp, AT_FDCWD, s->dir, RENAME_EXCHANGE) == 0) {
        tp__ck_rmtree(s->tmp); /* the old checkpoint, now under the temporary name */
        return tp__ck_fsync_path(parent);
    }
    if (errno != EINVAL && errno != ENOSYS && errno != ENOTSUP)
        return tp__error(TP_ERR_BACKEND, "%s: cannot exchange '%s' and '%s': %s", fn, s->tmp,
                         s->dir, strerror(errno));
    /* no exchange on this file system: old aside, new in, old removed */
    snprintf(s->old, sizeof s->old, "%s.old-%016llx", s->dir, (unsigned long long)s->nonce);
    if (rename(s->dir, s->old) != 0)
        return tp__error(TP_ERR_BACKEND, "%s: cannot rename '%s' to '%s': %s", fn, s->dir, s->old,
                         strerror(errno));
    if (rename(s->tmp, s->dir) != 0) {
        tp_status st = tp__error(TP_ERR_BACKEND, "%s: cannot rename '%s' to '%s': %s", fn, s->tmp,
                                 s->dir, strerror(errno));
        rename(s->old, s->dir);
        return st;
    }
    tp__ck_rmtree(s->old);
    return tp__ck_fsync_path(parent);
}

/* ---- this rank's data file -------------------------------------------------------- */

#define TP__CK_WRITE_CHUNK (16u << 20)

/* Writes n bytes at off in chunks, each checksummed just before it is
 * written (still in cache) and its writeback started at once
 * (sync_file_range), so that the disk works while the next chunks are
 * summed and copied, and the final fsync has little left to wait for. */
static tp_status tp__ck_write_chunks(int fd, const char *path, const char *p, size_t n,
                                     uint64_t off, uint32_t *crc)
{
    *crc = 0;
    for (size_t at = 0; at < n; at += TP__CK_WRITE_CHUNK) {
        size_t len = n - at < TP__CK_WRITE_CHUNK ? n - at : TP__CK_WRITE_CHUNK;
        *crc = tp__ck_crc32c(*crc, p + at, len);
        TP_CHECK(tp__ck_pwrite(fd, path, p + at, len, off + at));
        (void)sync_file_range(fd, (off64_t)(off + at), (off64_t)len, SYNC_FILE_RANGE_WRITE);
    }
    return TP_OK;
}

/* Writes item i's block (this rank owns it) at s->off[i]; its CRC in s->crc[i]. */
static tp_status tp__ck_write_item(const tp__ck_list *l, tp__ck_saver *s, int fd, const char *path,
                                   int i)
{
    const tp__ck_item *it = &l->it[i];
    int64_t shape[TP_MAX_DIMS], offset[TP_MAX_DIMS];
    bool owner = false;
    TP_CHECK(tp__ck_block(l, it->param, l->rank, shape, offset, &owner));
    int64_t numel = 1;
    for (int d = 0; d < tp_tensor_ndim(it->param); d++)
        numel *= shape[d];
    if (tp_tensor_numel(it->local) != numel)
        return tp__error(TP_ERR_STATE,
                         "%s: '%s' (%s) holds %lld elements on rank %d, its block %lld", l->fn,
                         it->fqn, tp__ck_kind_names[it->kind],
                         (long long)tp_tensor_numel(it->local), l->rank, (long long)numel);
    tp_tensor *host = NULL;
    if (tp_tensor_device(it->local).type == TP_DEVICE_CPU && tp_tensor_is_contiguous(it->local) &&
        tp_tensor_dtype(it->local) == it->dtype)
        host = tp_tensor_retain(it->local);
    else
        TP_CHECK(tp_tensor_to(it->local, it->dtype, TP_CPU, &host));
    size_t n = (size_t)numel * tp_dtype_size(it->dtype);
    tp_status st = tp__ck_write_chunks(fd, path, tp_tensor_data(host), n, s->off[i], &s->crc[i]);
    tp_tensor_release(host);
    if (st != TP_OK)
        tp__error_prefix("%s: '%s' (%s)", l->fn, it->fqn, tp__ck_kind_names[it->kind]);
    return st;
}

static tp_status tp__ck_write_file(const tp__ck_list *l, tp__ck_saver *s)
{
    char name[64];
    tp__ck_file_name(l->rank, name, sizeof name);
    char *path = tp__ck_path(s->tmp, name);
    if (!path)
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", l->fn);
    tp_status st = tp__ck_layout(l, l->rank, s->off, &s->fsize);
    int fd = st == TP_OK ? open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644) : -1;
    if (st == TP_OK && fd < 0)
        st = tp__error(TP_ERR_BACKEND, "%s: cannot create '%s': %s", l->fn, path, strerror(errno));
    for (int i = 0; i < l->n && st == TP_OK; i++)
        if (s->off[i] != UINT64_MAX)
            st = tp__ck_write_item(l, s, fd, path, i);
    if (st == TP_OK && ftruncate(fd, (off_t)s->fsize) != 0)
        st = tp__error(TP_ERR_BACKEND, "%s: cannot size '%s': %s", l->fn, path, strerror(errno));
    if (st == TP_OK && fsync(fd) != 0)
        st = tp__error(TP_ERR_BACKEND, "%s: cannot sync '%s': %s", l->fn, path, strerror(errno));
    if (fd >= 0 && close(fd) != 0 && st == TP_OK)
        st = tp__error(TP_ERR_BACKEND, "%s: cannot close '%s': %s", l->fn, path, strerror(errno));
    tp__free(path);
    return st;
}

/* ---- metadata.json (rank 0) ------------------------------------------------------ */

/* One tensor's entry: dtype, global shape, and each rank's stored block with
 * its CRC (crcs: the all_gather, n + 1 words per rank). */
static json_t *tp__ck_entry_json(const tp__ck_list *l, int i, const int64_t *crcs,
                                 uint64_t *const *offs)
{
    const tp__ck_item *it = &l->it[i];
    int nd = tp_tensor_ndim(it->param);
    json_t *e = json_object(), *shape = json_array(), *shards = json_array();
    bool bad = !e || !shape || !shards;
    for (int d = 0; d < nd && !bad; d++)
        bad = json_array_append_new(shape, json_integer(tp_tensor_shape(it->param)[d])) != 0;
    for (int r = 0; r < l->size && !bad; r++) {
        if (offs[r][i] == UINT64_MAX)
            continue;
        int64_t bs[TP_MAX_DIMS], bo[TP_MAX_DIMS];
        bool owner;
        bad = tp__ck_block(l, it->param, r, bs, bo, &owner) != TP_OK;
        json_t *sh = json_object(), *b = json_array(), *en = json_array();
        uint64_t len = tp_dtype_size(it->dtype);
        for (int d = 0; d < nd && !bad; d++) {
            len *= (uint64_t)bs[d];
            bad = json_array_append_new(b, json_integer(bo[d])) ||
                  json_array_append_new(en, json_integer(bo[d] + bs[d]));
        }
        bad = bad || !sh || !b || !en || json_object_set_new(sh, "file", json_integer(r)) ||
              json_object_set_new(sh, "offset", json_integer((json_int_t)offs[r][i])) ||
              json_object_set_new(sh, "length", json_integer((json_int_t)len)) ||
              json_object_set(sh, "begin", b) || json_object_set(sh, "end", en) ||
              json_object_set_new(sh, "crc32c",
                                  json_integer((uint32_t)crcs[(size_t)r * (l->n + 1) + 1 + i])) ||
              json_array_append(shards, sh);
        json_decref(sh);
        json_decref(b);
        json_decref(en);
    }
    bad = bad || json_object_set_new(e, "dtype", json_string(tp__ck_dtype_name(it->dtype))) ||
          json_object_set(e, "shape", shape) || json_object_set(e, "shards", shards);
    json_decref(shape);
    json_decref(shards);
    if (bad) {
        json_decref(e);
        return NULL;
    }
    return e;
}

static bool tp__ck_set_num(json_t *o, const char *k, double v)
{
    return json_object_set_new(o, k, json_real(v)) == 0;
}

/* "optimizer": type, hyper-parameters and "state" (filled by the caller). */
static json_t *tp__ck_optim_json(const tp__ck_list *l)
{
    tp__opt_hyperparams h;
    tp__opt_hyper(l->opt, &h);
    json_t *o = json_object();
    bool ok = o && !json_object_set_new(o, "type", json_string(l->opt.adam ? "adam" : "sgd")) &&
              tp__ck_set_num(o, "lr", h.lr) && tp__ck_set_num(o, "weight_decay", h.weight_decay);
    if (l->opt.adam)
        ok = ok && tp__ck_set_num(o, "beta1", h.beta1) && tp__ck_set_num(o, "beta2", h.beta2) &&
             tp__ck_set_num(o, "eps", h.eps) &&
             !json_object_set_new(o, "decoupled", json_boolean(h.decoupled));
    else
        ok = ok && tp__ck_set_num(o, "momentum", h.momentum) &&
             tp__ck_set_num(o, "dampening", h.dampening) &&
             !json_object_set_new(o, "nesterov", json_boolean(h.nesterov));
    ok = ok && !json_object_set_new(o, "state", json_object());
    if (!ok) {
        json_decref(o);
        return NULL;
    }
    return o;
}

/* Adds item i's entry to "model" or to its parameter's optimizer state. */
static bool tp__ck_add_entry(const tp__ck_list *l, int i, json_t *model, json_t *state,
                             const int64_t *crcs, uint64_t *const *offs)
{
    const tp__ck_item *it = &l->it[i];
    json_t *e = tp__ck_entry_json(l, i, crcs, offs);
    if (!e)
        return false;
    if (it->kind == TP__CK_PARAM)
        return json_object_set_new(model, it->fqn, e) == 0;
    json_t *ps = json_object_get(state, it->fqn);
    if (!ps) {
        int p = 0;
        while (l->params[p] != it->param)
            p++;
        ps = json_object();
        if (!ps || json_object_set_new(ps, "step", json_integer(l->steps[p])) ||
            json_object_set_new(state, it->fqn, ps)) {
            json_decref(e);
            return false;
        }
    }
    return json_object_set_new(ps, tp__ck_kind_names[it->kind], e) == 0;
}

static json_t *tp__ck_files_json(const tp__ck_list *l, const uint64_t *fsizes)
{
    json_t *files = json_array();
    for (int r = 0; r < l->size && files; r++) {
        char name[64];
        tp__ck_file_name(r, name, sizeof name);
        json_t *f = json_pack("{s:s, s:I}", "name", name, "size", (json_int_t)fsizes[r]);
        if (!f || json_array_append_new(files, f)) {
            json_decref(files);
            files = NULL;
        }
    }
    return files;
}

/* The whole metadata.json text (json_dumps: free with free()). */
static char *tp__ck_meta_text(const tp__ck_list *l, const tp_checkpoint_options *o,
                              const int64_t *crcs, uint64_t *const *offs, const uint64_t *fsizes)
{
    json_t *root = json_object(), *user = json_object(), *model = json_object();
    json_t *opt = l->opt.adam || l->opt.sgd ? tp__ck_optim_json(l) : NULL;
    json_t *files = tp__ck_files_json(l, fsizes);
    bool ok = root && user && model && files && (opt || !(l->opt.adam || l->opt.sgd));
    ok = ok && !json_object_set_new(root, "format", json_string(TP__CK_FORMAT)) &&
         !json_object_set_new(root, "version", json_integer(TP_CHECKPOINT_VERSION)) &&
         !json_object_set_new(root, "world_size", json_integer(l->size)) &&
         !json_object_set(root, "files", files) && !json_object_set(root, "user", user) &&
         !json_object_set(root, "model", model) &&
         (!opt || !json_object_set(root, "optimizer", opt));
    for (int i = 0; o && ok && i < o->n_meta; i++)
        ok = !json_object_set_new(user, o->meta[i].key, json_integer(o->meta[i].value));
    json_t *state = opt ? json_object_get(opt, "state") : NULL;
    for (int i = 0; ok && i < l->n; i++)
        ok = tp__ck_add_entry(l, i, model, state, crcs, offs);
    char *text = ok ? json_dumps(root, JSON_INDENT(1)) : NULL;
    json_decref(files);
    json_decref(user);
    json_decref(model);
    json_decref(opt);
    json_decref(root);
    return text;
}

/* Rank 0, every rank's file written: metadata.json into the temporary
 * directory (synced). */
static tp_status tp__ck_write_meta(const tp__ck_list *l, const tp_checkpoint_options *o,
                                   tp__ck_saver *s, const int64_t *crcs)
{
    uint64_t **offs = tp__calloc((size_t)l->size, sizeof *offs);
    uint64_t *fsizes = tp__calloc((size_t)l->size, sizeof *fsizes);
    tp_status st = offs && fsizes ? TP_OK : tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", l->fn);
    for (int r = 0; r < l->size && st == TP_OK; r++) {
        offs[r] = tp__malloc((size_t)(l->n ? l->n : 1) * sizeof **offs);
        st = offs[r] ? tp__ck_layout(l, r, offs[r], &fsizes[r])
                     : tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", l->fn);
    }
    char *text = st == TP_OK ? tp__ck_meta_text(l, o, crcs, offs, fsizes) : NULL;
    if (st == TP_OK && !text)
        st = tp__error(TP_ERR_NO_MEMORY, "%s: out of memory building %s", l->fn, TP__CK_META);
    char *path = st == TP_OK ? tp__ck_path(s->tmp, TP__CK_META) : NULL;
    if (st == TP_OK && !path)
        st = tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", l->fn);
    int fd = st == TP_OK ? open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644) : -1;
    if (st == TP_OK && fd < 0)
        st = tp__error(TP_ERR_BACKEND, "%s: cannot create '%s': %s", l->fn, path, strerror(errno));
    if (st == TP_OK)
        st = tp__ck_pwrite(fd, path, text, strlen(text), 0);
    if (st == TP_OK && fsync(fd) != 0)
        st = tp__error(TP_ERR_BACKEND, "%s: cannot sync '%s': %s", l->fn, path, strerror(errno));
    if (fd >= 0 && close(fd) != 0 && st == TP_OK)
        st = tp__error(TP_ERR_BACKEND, "%s: cannot close '%s': %s", l->fn, path, strerror(errno));
    free(text);
    tp__free(path);
    for (int r = 0; offs && r < l->size; r++)
        tp__free(offs[r]);
    tp__free(offs);
    tp__free(fsizes);
    return st;
}

/* ---- the protocol ------------------------------------------------------------------ */

/* all_gather of n int64 per rank into recv (size * n); comm NULL: a copy.
 * This rank's last error message (a failure the others learn of through
 * the flags gathered) survives it. */
static tp_status tp__ck_gather(tp_comm *comm, int64_t *send, int64_t n, int64_t *recv)
{
    if (!comm) {
        memcpy(recv, send, (size_t)n * sizeof *send);
        return TP_OK;
    }
    char kept[640];
    snprintf(kept, sizeof kept, "%s", tp_last_error());
    int64_t nr = n * tp_comm_size(comm);
    tp_tensor *a = NULL, *b = NULL;
    tp_status st = tp_tensor_from_blob(TP_I64, TP_CPU, 1, &n, send, NULL, NULL, &a);
    if (st == TP_OK)
        st = tp_tensor_from_blob(TP_I64, TP_CPU, 1, &nr, recv, NULL, NULL, &b);
    if (st == TP_OK)
        st = tp_all_gather(comm, a, b, NULL);
    tp_tensor_release(a);
    tp_tensor_release(b);
    if (st == TP_OK)
        tp__error_set_text(kept);
    return st;
}

/* Phase 1: every rank's status, tensor count and digest, and rank 0's
 * nonce. *st: this rank's outcome (a MISMATCH found here); *go: every rank
 * may write. Returns the collective's status. */
static tp_status tp__ck_hello(const tp__ck_list *l, tp__ck_saver *s, tp_status *st, bool *go)
{
    int64_t send[4] = {*st != TP_OK, l->n, *st == TP_OK ? tp__ck_digest(l) : 0, (int64_t)s->nonce};
    int64_t *all = tp__malloc((size_t)l->size * sizeof send);
    *go = false;
    if (!all)
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", l->fn);
    tp_status cst = tp__ck_gather(l->comm, send, 4, all);
    if (cst != TP_OK) {
        tp__free(all);
        return cst;
    }
    *go = true;
    for (int r = 0; r < l->size; r++)
        *go = *go && !all[4 * r];
    for (int r = 1; r < l->size && *go; r++)
        if (all[4 * r + 1] != all[1] || all[4 * r + 2] != all[2]) {
            *st = tp__error(TP_ERR_MISMATCH,
                            "%s: rank %d holds other tensors than rank 0 (%lld and %lld, "
                            "optimizer states included): every rank must save the same module "
                            "and optimizer",
                            l->fn, r, (long long)all[4 * r + 1], (long long)all[1]);
            *go = false;
        }
    s->nonce = (uint64_t)all[3];
    if (*go && l->rank != 0)
        snprintf(s->tmp, sizeof s->tmp, "%s.tmp-%016llx", s->dir, (unsigned long long)s->nonce);
    tp__free(all);
    return TP_OK;
}

/* Phase 2: each rank writes its file; rank 0 then, when every rank
 * succeeded, writes the metadata and publishes (*published). */
static tp_status tp__ck_write_all(const tp__ck_list *l, const tp_checkpoint_options *o,
                                  tp__ck_saver *s, bool *published)
{
    tp_status st = tp__ck_write_file(l, s);
    int64_t n1 = l->n + 1;
    int64_t *send = tp__malloc((size_t)n1 * sizeof *send);
    int64_t *all = tp__malloc((size_t)(n1 * l->size) * sizeof *all);
    if (!send || !all) {
        tp__free(send);
        tp__free(all);
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", l->fn);
    }
    send[0] = st != TP_OK;
    for (int i = 0; i < l->n; i++)
        send[1 + i] = s->off[i] != UINT64_MAX ? (int64_t)s->crc[i] : -1;
    tp_status cst = tp__ck_gather(l->comm, send, n1, all);
    bool go = cst == TP_OK;
    for (int r = 0; r < l->size && go; r++)
        go = !all[r * n1];
    if (cst != TP_OK && st == TP_OK)
        st = cst;
    if (go && l->rank == 0)
        st = tp__ck_write_meta(l, o, s, all);
    if (go && l->rank == 0 && st == TP_OK) {
        st = tp__ck_publish(l->fn, s);
        *published = st == TP_OK;
    }
    tp__free(send);
    tp__free(all);
    return st;
}

static tp_status tp__ck_saver_init(const tp__ck_list *l, const char *dir, tp__ck_saver *s)
{
    size_t len = strlen(dir);
    while (len > 1 && dir[len - 1] == '/')
        len--;
    if (len + 32 >= sizeof s->tmp)
        return tp__error(TP_ERR_INVALID_ARG, "%s: directory name too long", l->fn);
    s->dir = tp__malloc(len + 1);
    s->off = tp__calloc((size_t)(l->n ? l->n : 1), sizeof *s->off);
    s->crc = tp__calloc((size_t)(l->n ? l->n : 1), sizeof *s->crc);
    if (!s->dir || !s->off || !s->crc)
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", l->fn);
    memcpy(s->dir, dir, len);
    s->dir[len] = '\0';
    return TP_OK;
}

tp_status tp_checkpoint_save(const char *dir, tp_module *m, const tp_checkpoint_optim *optim,
                             const tp_checkpoint_options *opts)
{
    const char *fn = "tp_checkpoint_save";
    TP_ARG_CHECK(dir && dir[0], "%s: dir is NULL or empty", fn);
    TP_ARG_CHECK(m, "%s: module is NULL", fn);
    tp__ck_list l;
    TP_CHECK(tp__ck_list_init(fn, m, optim, opts, &l));
    /* from here every rank takes part in every collective, failed or not */
    tp_status st = tp__ck_list_fill(&l, m, true);
    tp__ck_saver s = {0};
    if (st == TP_OK)
        st = tp__ck_saver_init(&l, dir, &s);
    bool made = false, go = false, published = false;
    if (st == TP_OK && l.rank == 0) {
        st = tp__ck_make_tmp(fn, &s);
        made = st == TP_OK;
    }
    tp_status cst = tp__ck_hello(&l, &s, &st, &go);
    if (cst == TP_OK && go)
        st = tp__ck_write_all(&l, opts, &s, &published);
    if (made && !published)
        tp__ck_rmtree(s.tmp);
    st = cst == TP_OK ? tp__ck_agree(l.comm, st) : cst;
    tp__free(s.dir);
    tp__free(s.off);
    tp__free(s.crc);
    tp__ck_list_free(&l);
    return st;
}
