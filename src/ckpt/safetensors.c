/* Loading safetensors checkpoints into (parallelized) modules: each rank
 * reads its own block of each parameter into scratch tensors, the ranks agree
 * through one all_reduce, then every rank commits. See tp/safetensors.h. */
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ckpt/checkpoint_internal.h"
#include "ckpt/st_internal.h"
#include "core/base.h"
#include "tp/autograd.h"
#include "tp/comm.h"
#include "tp/dtensor.h"
#include "tp/mesh.h"

/* A parameter of the module and what the load found for it. */
typedef struct {
    char *fqn;
    tp_tensor *p;     /* borrowed */
    int file, entry;  /* the tensor that names it; -1: none yet */
    tp_tensor *value; /* scratch: this rank's block, in p's dtype and device */
} tp__st_param;

typedef struct {
    const char *fn;
    tp__st_param *v;
    int n;
    size_t cap;
    tp_mesh *mesh; /* of the DTensor parameters, the largest; NULL: none */
} tp__st_plist;

typedef struct {
    tp__st_file *f;
    int n;
} tp__st_files;

static tp_status tp__st_collect(const char *fqn, tp_tensor *p, void *ctx)
{
    tp__st_plist *l = ctx;
    if (!tp__grow_array((void **)&l->v, (size_t)l->n, &l->cap, sizeof *l->v))
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", l->fn);
    tp__st_param *e = &l->v[l->n];
    memset(e, 0, sizeof *e);
    if (!(e->fqn = tp__strdup(fqn)))
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", l->fn);
    e->p = p;
    e->file = e->entry = -1;
    l->n++;
    /* the mesh spanning the most ranks: with fully sharded units (blocks on
     * the (tp, dp) mesh, the rest on tp) its group holds every rank once,
     * and its rank 0 is the one writer */
    if (tp_tensor_is_dtensor(p) &&
        (!l->mesh || tp_mesh_numel(tp_dtensor_mesh(p)) > tp_mesh_numel(l->mesh)))
        l->mesh = tp_dtensor_mesh(p);
    return TP_OK;
}

static void tp__st_plist_free(tp__st_plist *l)
{
    for (int i = 0; i < l->n; i++) {
        tp__free(l->v[i].fqn);
        tp_tensor_release(l->v[i].value);
    }
    tp__free(l->v);
    memset(l, 0, sizeof *l);
}

static tp_status tp__st_params(const char *fn, tp_module *m, tp__st_plist *l)
{
    memset(l, 0, sizeof *l);
    l->fn = fn;
    tp_status st = tp_module_named_parameters(m, tp__st_collect, l);
    if (st != TP_OK)
        tp__st_plist_free(l);
    return st;
}

/* Opens the file, or every file of an index (a path ending in ".json"). */
static tp_status tp__st_open_all(const char *path, tp__st_files *fs)
{
    memset(fs, 0, sizeof *fs);
    size_t len = strlen(path);
    bool index = len >= 5 && !strcmp(path + len - 5, ".json");
    tp__st_paths paths = {0};
    char *one[1] = {(char *)path};
    if (index)
        TP_CHECK(tp__st_index(path, &paths));
    int n = index ? paths.n : 1;
    char **names = index ? paths.p : one;
    tp_status st = TP_OK;
    fs->f = tp__calloc((size_t)(n ? n : 1), sizeof *fs->f);
    if (!fs->f)
        st = tp__error(TP_ERR_NO_MEMORY, "out of memory opening '%s'", path);
    for (int i = 0; i < n && st == TP_OK; i++) {
        st = tp__st_file_open(names[i], &fs->f[i]);
        if (st == TP_OK)
            fs->n++;
    }
    tp__st_paths_free(&paths);
    return st;
}

static void tp__st_close_all(tp__st_files *fs)
{
    for (int i = 0; i < fs->n; i++)
        tp__st_file_close(&fs->f[i]);
    tp__free(fs->f);
    memset(fs, 0, sizeof *fs);
}

static bool tp__st_float(int d)
{
    return d == TP_F32 || d == TP_F64 || d == TP_F16 || d == TP_BF16;
}

/* Matches one file tensor to its parameter and checks it (shape, dtype,
 * named once). *param: the parameter's index, -1 when the name is unknown,
 * -2 when the name map skipped the tensor. */
static tp_status tp__st_match(const tp__st_files *fs, int fi, int ei, tp__st_plist *l,
                              const tp_safetensors_load_options *o, int *param)
{
    const tp__st_file *f = &fs->f[fi];
    const tp__st_entry *e = &f->e[ei];
    char fqn[TP_SAFETENSORS_MAX_NAME];
    *param = -1;
    snprintf(fqn, sizeof fqn, "%s", e->name);
    if (o->map_name && !o->map_name(e->name, fqn, sizeof fqn, o->map_ctx)) {
        *param = -2;
        return TP_OK;
    }
    fqn[sizeof fqn - 1] = '\0';
    for (int i = 0; i < l->n && *param < 0; i++)
        if (!strcmp(l->v[i].fqn, fqn))
            *param = i;
    if (*param < 0)
        return TP_OK; /* unknown: the caller decides */
    tp__st_param *pa = &l->v[*param];
    if (pa->file >= 0)
        return tp__error(TP_ERR_INVALID_ARG,
                         "%s: parameter '%s' is named twice: by '%s' in '%s' "
                         "and by '%s' in '%s'",
                         l->fn, fqn, fs->f[pa->file].e[pa->entry].name, fs->f[pa->file].path,
                         e->name, f->path);
    int nd = tp_tensor_ndim(pa->p);
    if (e->ndim != nd || memcmp(e->shape, tp_tensor_shape(pa->p), (size_t)nd * sizeof(int64_t))) {
        char a[128], b[128];
        return tp__error(TP_ERR_INVALID_ARG,
                         "%s: tensor '%s' in '%s' has shape %s, parameter "
                         "'%s' has %s",
                         l->fn, e->name, f->path, tp__shape_str(e->ndim, e->shape, a, sizeof a),
                         fqn, tp__shape_str(nd, tp_tensor_shape(pa->p), b, sizeof b));
    }
    tp_dtype pd = tp_tensor_dtype(pa->p);
    if (e->dtype < 0)
        return tp__error(TP_ERR_NOT_SUPPORTED,
                         "%s: tensor '%s' in '%s' has dtype %s, which libtp "
                         "cannot load (F32, F64, F16, BF16, I32, I64)",
                         l->fn, e->name, f->path, e->dtype_name);
    if (e->dtype != (int)pd && !(tp__st_float(e->dtype) && tp__st_float((int)pd)))
        return tp__error(TP_ERR_INVALID_ARG,
                         "%s: tensor '%s' in '%s' has dtype %s, not "
                         "convertible to parameter '%s' of dtype %s",
                         l->fn, e->name, f->path, e->dtype_name, fqn, tp_dtype_name(pd));
    pa->file = fi;
    pa->entry = ei;
    return TP_OK;
}

/* Appends a name to a bounded list message. */
static void tp__st_msg_add(char *buf, size_t len, const char *s)
{
    size_t used = strlen(buf);
    if (used + 3 >= len)
        return;
    snprintf(buf + used, len - used, "%s%s", used ? ", " : "", s);
}

/* Matches every tensor of every file; strict: unknown and missing names. */
static tp_status tp__st_match_all(const char *path, const tp__st_files *fs, tp__st_plist *l,
                                  const tp_safetensors_load_options *o)
{
    char unknown[512] = "", missing[512] = "";
    for (int fi = 0; fi < fs->n; fi++)
        for (int ei = 0; ei < fs->f[fi].n; ei++) {
            int param = -1;
            TP_CHECK(tp__st_match(fs, fi, ei, l, o, &param));
            if (param == -1)
                tp__st_msg_add(unknown, sizeof unknown, fs->f[fi].e[ei].name);
        }
    for (int i = 0; i < l->n; i++)
        if (l->v[i].file < 0)
            tp__st_msg_add(missing, sizeof missing, l->v[i].fqn);
    if (o->strict && (unknown[0] || missing[0]))
        return tp__error(TP_ERR_INVALID_ARG, "%s: '%s'%s%s%s%s", l->fn, path,
                         unknown[0] ? ": tensors naming no parameter: " : "", unknown,
                         missing[0] ? ": parameters not in the file: " : "", missing);
    return TP_OK;
}

/* Reads this rank's block [offset, offset + shape) of entry e into dst
 * (contiguous, e's element size): the outer dims row by row, each run of
 * contiguous bytes with one pread. */
static tp_status tp__st_read_block(const tp__st_file *f, const tp__st_entry *e,
                                   const int64_t *shape, const int64_t *offset, char *dst)
{
    int nd = e->ndim;
    uint64_t gstride[TP_MAX_DIMS + 1];
    gstride[nd] = 1;
    for (int d = nd - 1; d >= 0; d--)
        gstride[d] = gstride[d + 1] * (uint64_t)e->shape[d];
    for (int d = 0; d < nd; d++)
        if (shape[d] == 0)
            return TP_OK;
    if (nd == 0)
        return tp__st_pread(f, dst, e->size, f->data_start + e->begin, true);
    int k = nd - 1; /* the dims after k are whole: a run is shape[k] x gstride[k] */
    while (k > 0 && shape[k] == e->shape[k])
        k--;
    size_t run = (size_t)shape[k] * gstride[k + 1] * e->size;
    int64_t idx[TP_MAX_DIMS] = {0};
    for (;;) {
        uint64_t el = (uint64_t)offset[k] * gstride[k + 1];
        for (int d = 0; d < k; d++)
            el += (uint64_t)(offset[d] + idx[d]) * gstride[d + 1];
        TP_CHECK(tp__st_pread(f, dst, run, f->data_start + e->begin + el * e->size, true));
        dst += run;
        int d = k - 1;
        while (d >= 0 && ++idx[d] == shape[d])
            idx[d--] = 0;
        if (d < 0)
            return TP_OK;
    }
}

/* Reads parameter pa's block into pa->value, converted to its dtype and
 * device. */
static tp_status tp__st_read_param(const char *fn, const tp__st_files *fs, tp__st_param *pa)
{
    const tp__st_file *f = &fs->f[pa->file];
    const tp__st_entry *e = &f->e[pa->entry];
    int64_t shape[TP_MAX_DIMS], offset[TP_MAX_DIMS];
    int nd = e->ndim;
    if (tp_tensor_is_dtensor(pa->p)) {
        tp_mesh *mesh = tp_dtensor_mesh(pa->p);
        const tp_placement *pl = tp_dtensor_placements(pa->p);
        for (int d = 0; d < tp_mesh_ndim(mesh); d++)
            if (pl[d].kind == TP_PLACEMENT_PARTIAL)
                return tp__error(TP_ERR_NOT_SUPPORTED,
                                 "%s: parameter '%s' has a Partial "
                                 "placement",
                                 fn, pa->fqn);
        TP_CHECK(tp_dtensor_shard_extent(mesh, nd, e->shape, tp_mesh_ndim(mesh), pl, NULL, shape,
                                         offset));
    } else {
        memcpy(shape, e->shape, (size_t)nd * sizeof *shape);
        memset(offset, 0, (size_t)nd * sizeof *offset);
    }
    tp_tensor *raw = NULL;
    TP_CHECK(tp_tensor_empty((tp_dtype)e->dtype, TP_CPU, nd, shape, &raw));
    tp_status st = tp__st_read_block(f, e, shape, offset, tp_tensor_data(raw));
    tp_tensor *local = tp_tensor_is_dtensor(pa->p) ? tp_dtensor_local(pa->p) : pa->p;
    if (st == TP_OK &&
        (e->dtype != (int)tp_tensor_dtype(pa->p) || tp_tensor_device(local).type != TP_DEVICE_CPU))
        st = tp_tensor_to(raw, tp_tensor_dtype(pa->p), tp_tensor_device(local), &pa->value);
    else if (st == TP_OK)
        pa->value = tp_tensor_retain(raw);
    tp_tensor_release(raw);
    if (st != TP_OK)
        tp__error_prefix("%s: tensor '%s' in '%s'", fn, e->name, f->path);
    return st;
}

/* Streams parameter pa's block straight into it: read into the parameter's
 * own memory when the file has its dtype and it lives on the CPU, else
 * through one scratch copy (tp__st_read_param) committed and dropped at
 * once. */
static tp_status tp__st_stream_param(const char *fn, const tp__st_files *fs, tp__st_param *pa)
{
    const tp__st_file *f = &fs->f[pa->file];
    const tp__st_entry *e = &f->e[pa->entry];
    tp_tensor *local = tp_tensor_is_dtensor(pa->p) ? tp_dtensor_local(pa->p) : pa->p;
    bool partial = false;
    if (tp_tensor_is_dtensor(pa->p))
        for (int d = 0; d < tp_mesh_ndim(tp_dtensor_mesh(pa->p)); d++)
            partial = partial || tp_dtensor_placements(pa->p)[d].kind == TP_PLACEMENT_PARTIAL;
    if (!partial && e->dtype == (int)tp_tensor_dtype(local) &&
        tp_tensor_device(local).type == TP_DEVICE_CPU && tp_tensor_is_contiguous(local)) {
        int64_t offset[TP_MAX_DIMS] = {0};
        if (tp_tensor_is_dtensor(pa->p)) {
            int64_t shape[TP_MAX_DIMS];
            tp_mesh *mesh = tp_dtensor_mesh(pa->p);
            TP_CHECK(tp_dtensor_shard_extent(mesh, e->ndim, e->shape, tp_mesh_ndim(mesh),
                                             tp_dtensor_placements(pa->p), NULL, shape, offset));
        }
        tp_status st = tp__st_read_block(f, e, tp_tensor_shape(local), offset,
                                         tp_tensor_data(local));
        if (st != TP_OK)
            tp__error_prefix("%s: tensor '%s' in '%s'", fn, e->name, f->path);
        return st;
    }
    TP_CHECK(tp__st_read_param(fn, fs, pa));
    tp_status st = tp_tensor_copy(local, pa->value);
    tp_tensor_release(pa->value);
    pa->value = NULL;
    if (st != TP_OK)
        tp__error_prefix("%s: committing '%s'", fn, pa->fqn);
    return st;
}

/* Everything before the agreement: open, match, read into scratch (or,
 * streaming, into the parameters). */
static tp_status tp__st_stage(const char *path, const tp_safetensors_load_options *o,
                              tp__st_plist *l, tp__st_files *fs)
{
    tp_status st = tp__st_open_all(path, fs);
    if (st != TP_OK) {
        tp__error_prefix("%s", l->fn);
        return st;
    }
    TP_CHECK(tp__st_match_all(path, fs, l, o));
    for (int i = 0; i < l->n; i++)
        if (l->v[i].file >= 0)
            TP_CHECK(o->stream ? tp__st_stream_param(l->fn, fs, &l->v[i])
                               : tp__st_read_param(l->fn, fs, &l->v[i]));
    return TP_OK;
}

/* The ranks of the module's mesh agree on the outcome (one all_reduce, MAX of
 * the failure flag). Returns the combined status: local_st when this rank
 * failed, TP_ERR_MISMATCH when another one did. */
tp_status tp__st_agree(const char *fn, tp_mesh *mesh, tp_tensor *flag, tp_status local_st)
{
    if (!mesh)
        return local_st;
    char msg[512] = "";
    if (local_st != TP_OK)
        snprintf(msg, sizeof msg, "%s", tp_last_error());
    *(int32_t *)tp_tensor_data(flag) = local_st != TP_OK;
    tp_status st = tp_all_reduce(tp_mesh_group(mesh), flag, flag, TP_MAX, NULL);
    if (st != TP_OK)
        return local_st != TP_OK ? local_st : st;
    if (local_st != TP_OK) {
        tp__error(local_st, "%s", msg);
        return local_st;
    }
    if (*(int32_t *)tp_tensor_data(flag))
        return tp__error(TP_ERR_MISMATCH,
                         "%s: another rank of the mesh failed; nothing done on "
                         "this rank",
                         fn);
    return TP_OK;
}

tp_status tp_safetensors_load(tp_module *m, const char *path,
                              const tp_safetensors_load_options *opts)
{
    const char *fn = "tp_safetensors_load";
    TP_ARG_CHECK(m, "%s: module is NULL", fn);
    TP_ARG_CHECK(path, "%s: path is NULL", fn);
    tp_safetensors_load_options o = opts ? *opts : (tp_safetensors_load_options){.strict = true};
    tp__st_plist l;
    TP_CHECK(tp__st_params(fn, m, &l));
    /* the flag first: past it, every failure reaches the agreement */
    int64_t one = 1;
    tp_tensor *flag = NULL;
    tp_status st = l.mesh ? tp_tensor_empty(TP_I32, TP_CPU, 1, &one, &flag) : TP_OK;
    if (st != TP_OK) {
        tp__st_plist_free(&l);
        return st;
    }
    tp__st_files fs = {0};
    st = tp__st_stage(path, &o, &l, &fs);
    tp__st_close_all(&fs);
    st = tp__st_agree(fn, l.mesh, flag, st);
    /* commit: scratch values are in the parameter's dtype and device */
    for (int i = 0; i < l.n && st == TP_OK; i++) {
        tp__st_param *pa = &l.v[i];
        if (!pa->value)
            continue;
        tp_tensor *local = tp_tensor_is_dtensor(pa->p) ? tp_dtensor_local(pa->p) : pa->p;
        st = tp_tensor_copy(local, pa->value);
        if (st != TP_OK)
            tp__error_prefix("%s: committing '%s'", fn, pa->fqn);
    }
    tp_tensor_release(flag);
    tp__st_plist_free(&l);
    return st;
}

/* ---- saving ------------------------------------------------------------------ */

typedef struct {
    int fd; /* -1: this rank does not write */
    char tmp[4096];
    uint64_t data_start;
    uint64_t *begin; /* per parameter, in the data buffer */
    int *order;      /* parameters by decreasing element size, then in order */
} tp__st_writer;

/* One pwrite loop for both file formats (checkpoint.c). */
static tp_status tp__st_pwrite(const char *path, int fd, const void *buf, size_t n, uint64_t off)
{
    return tp__ck_pwrite(fd, path, buf, n, off);
}

/* Lays the parameters out (w->order, w->begin). */
static tp_status tp__st_layout(const tp__st_plist *l, tp__st_writer *w)
{
    w->begin = tp__calloc((size_t)(l->n ? l->n : 1), sizeof *w->begin);
    w->order = tp__calloc((size_t)(l->n ? l->n : 1), sizeof *w->order);
    if (!w->begin || !w->order)
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", l->fn);
    int k = 0;
    for (size_t size = 8; size >= 1; size /= 2)
        for (int i = 0; i < l->n; i++)
            if (tp_dtype_size(tp_tensor_dtype(l->v[i].p)) == size)
                w->order[k++] = i;
    TP_ASSERT(k == l->n);
    uint64_t at = 0;
    for (int j = 0; j < l->n; j++) {
        const tp_tensor *p = l->v[w->order[j]].p;
        w->begin[w->order[j]] = at;
        at += (uint64_t)tp_tensor_numel(p) * tp_dtype_size(tp_tensor_dtype(p));
    }
    return TP_OK;
}

/* The header JSON, padded with spaces to a multiple of 8 bytes with its
 * length field: *out (tp__malloc). */
static tp_status tp__st_header_json(const tp__st_plist *l, const tp__st_writer *w, char **out,
                                    size_t *len)
{
    json_t *root = json_object(), *meta = json_object();
    tp_status st = TP_OK;
    if (!root || !meta || json_object_set_new(meta, "format", json_string("pt")) ||
        json_object_set(root, "__metadata__", meta))
        st = tp__error(TP_ERR_NO_MEMORY, "%s: out of memory building the header", l->fn);
    for (int j = 0; j < l->n && st == TP_OK; j++) {
        int i = w->order[j];
        const tp_tensor *p = l->v[i].p;
        json_t *e = json_object(), *shape = json_array(), *off = json_array();
        bool bad = !e || !shape || !off;
        for (int d = 0; d < tp_tensor_ndim(p) && !bad; d++)
            bad = json_array_append_new(shape, json_integer(tp_tensor_shape(p)[d])) != 0;
        uint64_t end =
            w->begin[i] + (uint64_t)tp_tensor_numel(p) * tp_dtype_size(tp_tensor_dtype(p));
        bad = bad || json_array_append_new(off, json_integer((json_int_t)w->begin[i])) ||
              json_array_append_new(off, json_integer((json_int_t)end)) ||
              json_object_set_new(e, "dtype", json_string(tp__st_dtype_name(tp_tensor_dtype(p)))) ||
              json_object_set(e, "shape", shape) || json_object_set(e, "data_offsets", off) ||
              json_object_set(root, l->v[i].fqn, e);
        json_decref(e);
        json_decref(shape);
        json_decref(off);
        if (bad)
            st = tp__error(TP_ERR_NO_MEMORY, "%s: out of memory building the header", l->fn);
    }
    char *text = st == TP_OK ? json_dumps(root, JSON_COMPACT) : NULL;
    if (st == TP_OK && !text)
        st = tp__error(TP_ERR_NO_MEMORY, "%s: out of memory building the header", l->fn);
    json_decref(meta);
    json_decref(root);
    if (st != TP_OK)
        return st;
    size_t n = strlen(text), padded = (n + 7) / 8 * 8;
    *out = tp__malloc(padded + 1);
    if (*out) {
        memcpy(*out, text, n);
        memset(*out + n, ' ', padded - n);
        (*out)[padded] = '\0';
        *len = padded;
    }
    free(text);
    return *out ? TP_OK : tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", l->fn);
}

/* The writer creates the temporary file and writes the length and header. */
static tp_status tp__st_begin_file(const char *path, const tp__st_plist *l, tp__st_writer *w)
{
    static _Atomic unsigned serial;
    snprintf(w->tmp, sizeof w->tmp, "%s.tmp.%ld.%u", path, (long)getpid(), serial++);
    char *hdr = NULL;
    size_t n = 0;
    TP_CHECK(tp__st_header_json(l, w, &hdr, &n));
    w->fd = open(w->tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (w->fd < 0) {
        tp__free(hdr);
        return tp__error(TP_ERR_BACKEND, "%s: cannot create '%s': %s", l->fn, w->tmp,
                         strerror(errno));
    }
    unsigned char lenb[8];
    for (int i = 0; i < 8; i++)
        lenb[i] = (unsigned char)((uint64_t)n >> (8 * i));
    tp_status st = tp__st_pwrite(w->tmp, w->fd, lenb, 8, 0);
    if (st == TP_OK)
        st = tp__st_pwrite(w->tmp, w->fd, hdr, n, 8);
    w->data_start = 8 + n;
    tp__free(hdr);
    return st;
}

/* Every rank gathers each parameter's full value in turn (collective for
 * DTensors); the writer (w->fd >= 0) writes it at its place while its status
 * is OK, and keeps gathering after a failure so that no rank is left waiting. */
static tp_status tp__st_write_values(const tp__st_plist *l, tp__st_writer *w, tp_status wst)
{
    for (int i = 0; i < l->n; i++) {
        tp_tensor *full = NULL, *host = NULL;
        tp_tensor *p = l->v[i].p;
        tp_status st = TP_OK;
        if (tp_tensor_is_dtensor(p)) {
            tp_no_grad_begin();
            st = tp_dtensor_full_tensor(p, &full);
            tp_no_grad_end();
            if (st != TP_OK) {
                tp__error_prefix("%s: gathering '%s'", l->fn, l->v[i].fqn);
                return st; /* a collective failed: the others see it too */
            }
        } else {
            full = tp_tensor_retain(p);
        }
        if (w->fd >= 0 && wst == TP_OK)
            wst = tp_tensor_to(full, tp_tensor_dtype(full), TP_CPU, &host);
        if (w->fd >= 0 && wst == TP_OK)
            wst = tp__st_pwrite(w->tmp, w->fd, tp_tensor_data(host), tp_tensor_nbytes(host),
                                w->data_start + w->begin[i]);
        tp_tensor_release(host);
        tp_tensor_release(full);
    }
    return wst;
}

/* Closes the writer's file: renamed over path on success, removed otherwise. */
static tp_status tp__st_end_file(const char *path, tp__st_writer *w, tp_status st)
{
    if (w->fd < 0)
        return st;
    if (st == TP_OK && fsync(w->fd) != 0)
        st = tp__error(TP_ERR_BACKEND, "cannot sync '%s': %s", w->tmp, strerror(errno));
    if (close(w->fd) != 0 && st == TP_OK)
        st = tp__error(TP_ERR_BACKEND, "cannot close '%s': %s", w->tmp, strerror(errno));
    w->fd = -1;
    if (st == TP_OK && rename(w->tmp, path) != 0)
        st = tp__error(TP_ERR_BACKEND, "cannot rename '%s' to '%s': %s", w->tmp, path,
                       strerror(errno));
    if (st != TP_OK)
        unlink(w->tmp);
    return st;
}

/* The parameters to save, with root checked against the ranks of their mesh
 * (the caller without one), and whether this rank writes. */
static tp_status tp__st_save_params(const char *fn, tp_module *m, int root, tp__st_plist *l,
                                    bool *writer)
{
    TP_CHECK(tp__st_params(fn, m, l));
    int size = l->mesh ? tp_comm_size(tp_mesh_group(l->mesh)) : 1;
    if (root < 0 || root >= size) {
        bool mesh = l->mesh != NULL;
        tp__st_plist_free(l);
        return tp__error(TP_ERR_INVALID_ARG, "%s: root %d is not a rank of the %s (size %d)", fn,
                         root, mesh ? "module's mesh" : "caller (no DTensor parameters)", size);
    }
    *writer = !l->mesh || tp_comm_rank(tp_mesh_group(l->mesh)) == root;
    return TP_OK;
}

tp_status tp_safetensors_save(tp_module *m, const char *path, int root)
{
    const char *fn = "tp_safetensors_save";
    TP_ARG_CHECK(m, "%s: module is NULL", fn);
    TP_ARG_CHECK(path, "%s: path is NULL", fn);
    tp__st_plist l;
    bool writer = false;
    TP_CHECK(tp__st_save_params(fn, m, root, &l, &writer));
    int64_t one = 1;
    tp_tensor *flag = NULL;
    tp_status st = l.mesh ? tp_tensor_empty(TP_I32, TP_CPU, 1, &one, &flag) : TP_OK;
    if (st != TP_OK) {
        tp__st_plist_free(&l);
        return st;
    }
    tp__st_writer w = {.fd = -1};
    if (writer) {
        st = tp__st_layout(&l, &w);
        if (st == TP_OK)
            st = tp__st_begin_file(path, &l, &w);
    }
    st = tp__st_write_values(&l, &w, st);
    st = tp__st_end_file(path, &w, st);
    st = tp__st_agree(fn, l.mesh, flag, st);
    tp__free(w.begin);
    tp__free(w.order);
    tp_tensor_release(flag);
    tp__st_plist_free(&l);
    return st;
}

/* The index of a sharded save: {"metadata": {"total_size": N}, "weight_map":
 * {fqn: file}}, as transformers writes it. */
static tp_status tp__st_write_index(const char *fn, const char *path, const tp__st_plist *l,
                                    const int *shard_of, int nshards, const char *prefix,
                                    uint64_t total)
{
    json_t *root = json_object(), *meta = json_object(), *map = json_object();
    bool bad = !root || !meta || !map || json_object_set(root, "metadata", meta) ||
               json_object_set(root, "weight_map", map) ||
               json_object_set_new(meta, "total_size", json_integer((json_int_t)total));
    for (int i = 0; i < l->n && !bad; i++) {
        char file[512];
        snprintf(file, sizeof file, "%s-%05d-of-%05d.safetensors", prefix, shard_of[i] + 1,
                 nshards);
        bad = json_object_set_new(map, l->v[i].fqn, json_string(file)) != 0;
    }
    char *text = bad ? NULL : json_dumps(root, JSON_INDENT(2) | JSON_SORT_KEYS);
    json_decref(map);
    json_decref(meta);
    json_decref(root);
    if (!text)
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory building the index", fn);
    tp__st_writer w = {.fd = -1};
    static _Atomic unsigned serial;
    int k = snprintf(w.tmp, sizeof w.tmp, "%s.tmp.%ld.%u", path, (long)getpid(), serial++);
    tp_status st = TP_OK;
    if (k < 0 || (size_t)k >= sizeof w.tmp) {
        free(text);
        return tp__error(TP_ERR_INVALID_ARG, "%s: path '%s' is too long", fn, path);
    }
    w.fd = open(w.tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (w.fd < 0)
        st = tp__error(TP_ERR_BACKEND, "%s: cannot create '%s': %s", fn, w.tmp, strerror(errno));
    else
        st = tp__st_pwrite(w.tmp, w.fd, text, strlen(text), 0);
    free(text);
    return tp__st_end_file(path, &w, st);
}

tp_status tp_safetensors_save_sharded(tp_module *m, const char *dir, const char *prefix,
                                      size_t max_shard_bytes, int root)
{
    const char *fn = "tp_safetensors_save_sharded";
    TP_ARG_CHECK(m, "%s: module is NULL", fn);
    TP_ARG_CHECK(dir, "%s: dir is NULL", fn);
    if (!prefix)
        prefix = "model";
    TP_ARG_CHECK(*prefix && !strchr(prefix, '/') && strlen(prefix) < 256,
                 "%s: prefix \"%s\" must be a non-empty file name", fn, prefix);
    TP_ARG_CHECK(strlen(dir) + strlen(prefix) < 4096 - 64, "%s: dir '%s' is too long", fn, dir);
    tp__st_plist l;
    bool writer = false;
    TP_CHECK(tp__st_save_params(fn, m, root, &l, &writer));
    int64_t one = 1;
    tp_tensor *flag = NULL;
    int *shard_of = tp__calloc((size_t)(l.n ? l.n : 1), sizeof *shard_of);
    tp_status st = shard_of ? TP_OK : tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
    if (st == TP_OK && l.mesh)
        st = tp_tensor_empty(TP_I32, TP_CPU, 1, &one, &flag);
    if (st != TP_OK) {
        tp__free(shard_of);
        tp__st_plist_free(&l);
        return st;
    }
    /* transformers' split: parameters in order, a new file when the next one
     * would pass the limit; a parameter larger than the limit alone */
    int nshards = l.n ? 1 : 0;
    uint64_t in_shard = 0, total = 0;
    for (int i = 0; i < l.n; i++) {
        uint64_t b = (uint64_t)tp_tensor_numel(l.v[i].p) * tp_dtype_size(tp_tensor_dtype(l.v[i].p));
        if (max_shard_bytes && in_shard > 0 && in_shard + b > max_shard_bytes) {
            nshards++;
            in_shard = 0;
        }
        shard_of[i] = nshards - 1;
        in_shard += b;
        total += b;
    }
    if (nshards <= 1)
        nshards = 1;
    char path[4096];
    /* every rank walks every shard: the gathers are collective */
    for (int s = 0, lo = 0; s < nshards; s++) {
        int hi = lo;
        while (hi < l.n && shard_of[hi] == s)
            hi++;
        tp__st_plist sub = l;
        sub.v = l.v + lo;
        sub.n = hi - lo;
        if (nshards == 1)
            snprintf(path, sizeof path, "%s/%s.safetensors", dir, prefix);
        else
            snprintf(path, sizeof path, "%s/%s-%05d-of-%05d.safetensors", dir, prefix, s + 1,
                     nshards);
        tp__st_writer w = {.fd = -1};
        tp_status fst = st;
        if (writer && fst == TP_OK) {
            fst = tp__st_layout(&sub, &w);
            if (fst == TP_OK)
                fst = tp__st_begin_file(path, &sub, &w);
        }
        tp_status gst = tp__st_write_values(&sub, &w, fst);
        fst = tp__st_end_file(path, &w, gst);
        tp__free(w.begin);
        tp__free(w.order);
        if (st == TP_OK)
            st = fst;
        /* a rank that does not write fails only in a gather: a collective
         * the others saw fail too */
        if (gst != TP_OK && !writer)
            break;
        lo = hi;
    }
    if (writer && st == TP_OK && nshards > 1) {
        snprintf(path, sizeof path, "%s/%s.safetensors.index.json", dir, prefix);
        st = tp__st_write_index(fn, path, &l, shard_of, nshards, prefix, total);
    }
    st = tp__st_agree(fn, l.mesh, flag, st);
    tp__free(shard_of);
    tp_tensor_release(flag);
    tp__st_plist_free(&l);
    return st;
}

/* ---- plain tensors by name ------------------------------------------------------- */

tp_status tp_safetensors_read(const char *path, const char *name, tp_tensor **out)
{
    const char *fn = "tp_safetensors_read";
    TP_ARG_CHECK(out, "%s: out is NULL", fn);
    *out = NULL;
    TP_ARG_CHECK(path && name, "%s: %s is NULL", fn, path ? "name" : "path");
    tp__st_file f;
    TP_CHECK(tp__st_file_open(path, &f));
    tp_status st = TP_OK;
    const tp__st_entry *e = NULL;
    for (int i = 0; i < f.n && !e; i++)
        if (!strcmp(f.e[i].name, name))
            e = &f.e[i];
    tp_tensor *t = NULL;
    if (!e)
        st = tp__error(TP_ERR_INVALID_ARG, "%s: '%s' holds no tensor '%s'", fn, path, name);
    else if (e->dtype < 0)
        st = tp__error(TP_ERR_NOT_SUPPORTED, "%s: '%s' in '%s' has dtype %s, which libtp does "
                                             "not load", fn, name, path, e->dtype_name);
    else
        st = tp_tensor_empty((tp_dtype)e->dtype, TP_CPU, e->ndim, e->shape, &t);
    if (st == TP_OK && e->end > e->begin)
        st = tp__st_pread(&f, tp_tensor_data(t), (size_t)(e->end - e->begin),
                          f.data_start + e->begin, true);
    tp__st_file_close(&f);
    if (st != TP_OK) {
        tp_tensor_release(t);
        return st;
    }
    *out = t;
    return TP_OK;
}

tp_status tp_safetensors_write(const char *path, int n, const char *const *names,
                               tp_tensor *const *tensors)
{
    const char *fn = "tp_safetensors_write";
    TP_ARG_CHECK(path, "%s: path is NULL", fn);
    TP_ARG_CHECK(n >= 0 && (n == 0 || (names && tensors)), "%s: %d tensors with NULL arrays", fn,
                 n);
    tp__st_plist l = {.fn = fn};
    tp_status st = TP_OK;
    for (int i = 0; i < n && st == TP_OK; i++) {
        if (!names[i] || !tensors[i]) {
            st = tp__error(TP_ERR_INVALID_ARG, "%s: entry %d has a NULL %s", fn, i,
                           names[i] ? "tensor" : "name");
            break;
        }
        if (tp_tensor_is_dtensor(tensors[i]) || !tp__st_dtype_name(tp_tensor_dtype(tensors[i]))) {
            st = tp__error(TP_ERR_INVALID_ARG, "%s: '%s' must be a plain tensor of a dtype the "
                                               "format holds", fn, names[i]);
            break;
        }
        for (int j = 0; j < i && st == TP_OK; j++)
            if (!strcmp(names[i], names[j]))
                st = tp__error(TP_ERR_INVALID_ARG, "%s: '%s' is named twice", fn, names[i]);
        if (st == TP_OK)
            st = tp__st_collect(names[i], tensors[i], &l);
    }
    tp__st_writer w = {.fd = -1};
    if (st == TP_OK)
        st = tp__st_layout(&l, &w);
    if (st == TP_OK)
        st = tp__st_begin_file(path, &l, &w);
    if (st == TP_OK)
        st = tp__st_write_values(&l, &w, st);
    st = tp__st_end_file(path, &w, st);
    tp__free(w.begin);
    tp__free(w.order);
    tp__st_plist_free(&l);
    return st;
}
