/* Sharded checkpoints, the parts save and load share: the list of tensors
 * (parameters, optimizer states), the block each rank holds and whether it
 * stores it, the agreement on an outcome, CRC-32C and file helpers. See
 * tp/checkpoint.h. */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "ckpt/checkpoint_internal.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <nmmintrin.h>
#define TP__CK_HW_CRC 1
#endif

const char *const tp__ck_kind_names[TP__CK_KINDS] = {"param", "exp_avg", "exp_avg_sq",
                                                     "momentum_buffer", "master"};

/* ---- the list ----------------------------------------------------------------- */

tp_status tp__ck_list_add(tp__ck_list *l, int p, tp__ck_kind kind, tp_tensor *local, tp_dtype dtype)
{
    if (!tp__grow_array((void **)&l->it, (size_t)l->n, &l->cap, sizeof *l->it))
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", l->fn);
    l->it[l->n++] = (tp__ck_item){l->fqns[p], kind, l->params[p], local, dtype};
    return TP_OK;
}

/* Whether b lays the ranks out as a does: one mesh, or two of the same
 * dims (sizes and names) with this rank at the same coordinate, so that the
 * rank of a's group is the rank of b's at every coordinate. The units of
 * tp_fully_shard each slice their own (tp, dp) mesh from the one given: a
 * sharded model's parameters are on several such meshes. */
static bool tp__ck_same_layout(const tp_mesh *a, const tp_mesh *b)
{
    if (a == b)
        return true;
    const int nd = tp_mesh_ndim(a);
    if (!a || !b || tp_mesh_ndim(b) != nd || tp_mesh_rank(a) != tp_mesh_rank(b))
        return false;
    for (int d = 0; d < nd; d++)
        if (tp_mesh_size(a, d) != tp_mesh_size(b, d) ||
            tp_mesh_coord(a, d) != tp_mesh_coord(b, d) ||
            strcmp(tp_mesh_dim_name(a, d), tp_mesh_dim_name(b, d)) != 0)
            return false;
    return true;
}

/* "(tp 2, dp 2)" into buf. */
static const char *tp__ck_mesh_str(const tp_mesh *m, char *buf, size_t len)
{
    size_t at = 0;
    buf[0] = '\0';
    for (int d = 0; d < tp_mesh_ndim(m) && at < len; d++) {
        int k = snprintf(buf + at, len - at, "%s%s %lld", d ? ", " : "(", tp_mesh_dim_name(m, d),
                         (long long)tp_mesh_size(m, d));
        at += k > 0 ? (size_t)k : 0;
    }
    if (at < len)
        snprintf(buf + at, len - at, ")");
    return buf;
}

static tp_status tp__ck_collect(const char *fqn, tp_tensor *p, void *ctx)
{
    tp__ck_list *l = ctx;
    if (!tp__grow_array((void **)&l->fqns, (size_t)l->np, &l->cap_p, sizeof *l->fqns))
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", l->fn);
    if (!tp__grow_array((void **)&l->params, (size_t)l->np, &l->cap_params, sizeof *l->params))
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", l->fn);
    if (!(l->fqns[l->np] = tp__strdup(fqn)))
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", l->fn);
    l->params[l->np++] = p;
    if (!tp_tensor_is_dtensor(p))
        return TP_OK;
    tp_mesh *mesh = tp_dtensor_mesh(p);
    if (!tp__ck_same_layout(l->mesh, mesh)) {
        char a[96], b[96];
        return tp__error(TP_ERR_INVALID_ARG,
                         "%s: parameter '%s' is on a mesh %s, another parameter on %s: a "
                         "checkpoint needs every DTensor parameter on one mesh, or on meshes of "
                         "one layout (the same dims and sizes, this rank at the same "
                         "coordinate); a model with tp_fully_shard units needs its root "
                         "fully sharded too",
                         l->fn, fqn, tp__ck_mesh_str(mesh, a, sizeof a),
                         tp__ck_mesh_str(l->mesh, b, sizeof b));
    }
    const tp_placement *pl = tp_dtensor_placements(p);
    for (int d = 0; d < tp_mesh_ndim(mesh); d++)
        if (pl[d].kind == TP_PLACEMENT_PARTIAL)
            return tp__error(TP_ERR_NOT_SUPPORTED,
                             "%s: parameter '%s' has a Partial placement on mesh dim %d: "
                             "reduce it (tp_dtensor_redistribute) before a checkpoint",
                             l->fn, fqn, d);
    return TP_OK;
}

void tp__ck_list_free(tp__ck_list *l)
{
    for (int i = 0; i < l->np; i++)
        tp__free(l->fqns[i]);
    tp__free(l->fqns);
    tp__free(l->params);
    tp__free(l->it);
    tp__free(l->steps);
    l->fqns = NULL;
    l->params = NULL;
    l->it = NULL;
    l->steps = NULL;
    l->np = l->n = 0;
}

/* The optimizer's state of parameter p as items (master, then the moments
 * or the momentum buffer), its step count in l->steps[p]. */
static tp_status tp__ck_add_state(tp__ck_list *l, int p)
{
    int n = tp__opt_num_states(l->opt);
    for (int i = 0; i < n; i++) {
        tp__opt_state s;
        tp__opt_state_at(l->opt, i, &s);
        if (strcmp(s.fqn, l->fqns[p]) != 0)
            continue;
        if (s.param != l->params[p])
            return tp__error(TP_ERR_STATE,
                             "%s: the optimizer's state of '%s' belongs to a parameter the "
                             "module has replaced since",
                             l->fn, s.fqn);
        l->steps[p] = s.step;
        if (s.master)
            TP_CHECK(tp__ck_list_add(l, p, TP__CK_MASTER, s.master, TP_F32));
        if (s.m)
            TP_CHECK(
                tp__ck_list_add(l, p, l->opt.adam ? TP__CK_EXP_AVG : TP__CK_MOMENTUM, s.m, TP_F32));
        if (s.v)
            TP_CHECK(tp__ck_list_add(l, p, TP__CK_EXP_AVG_SQ, s.v, TP_F32));
        return TP_OK;
    }
    return TP_OK;
}

/* Who takes part, and the optimizer. */
static tp_status tp__ck_setup(tp__ck_list *l, tp_module *m, const tp_checkpoint_optim *optim,
                              const tp_checkpoint_options *o)
{
    if (optim) {
        TP_ARG_CHECK(!(optim->adam && optim->sgd), "%s: optim has both adam and sgd set", l->fn);
        l->opt = (tp__opt_ref){optim->adam, optim->sgd};
        TP_ARG_CHECK(!(optim->adam || optim->sgd) || tp__opt_module(l->opt) == m,
                     "%s: the optimizer was created on another module", l->fn);
    }
    tp_comm *c = o ? o->comm : NULL;
    if (l->mesh) {
        TP_ARG_CHECK(!c || c == tp_mesh_group(l->mesh),
                     "%s: options.comm must be NULL or the group of the parameters' mesh", l->fn);
        c = tp_mesh_group(l->mesh);
    }
    l->comm = c;
    l->rank = c ? tp_comm_rank(c) : 0;
    l->size = c ? tp_comm_size(c) : 1;
    if (o)
        for (int i = 0; i < o->n_meta; i++)
            TP_ARG_CHECK(o->meta && o->meta[i].key && o->meta[i].key[0] &&
                             strlen(o->meta[i].key) < 256,
                         "%s: options.meta[%d] needs a key of 1 to 255 bytes", l->fn, i);
    return TP_OK;
}

/* The mesh of the first DTensor parameter of the tree (no allocation). */
static tp_mesh *tp__ck_find_mesh(const tp_module *m)
{
    for (int i = 0; i < tp__module_num_params(m); i++) {
        tp_tensor *p = tp__module_param_at(m, i, NULL);
        if (p && tp_tensor_is_dtensor(p))
            return tp_dtensor_mesh(p);
    }
    for (int i = 0; i < tp_module_num_children(m); i++) {
        tp_mesh *mesh = tp__ck_find_mesh(tp_module_child_at(m, i, NULL));
        if (mesh)
            return mesh;
    }
    return NULL;
}

tp_status tp__ck_list_init(const char *fn, tp_module *m, const tp_checkpoint_optim *optim,
                           const tp_checkpoint_options *o, tp__ck_list *l)
{
    memset(l, 0, sizeof *l);
    l->fn = fn;
    l->mesh = tp__ck_find_mesh(m);
    return tp__ck_setup(l, m, optim, o);
}

tp_status tp__ck_list_fill(tp__ck_list *l, tp_module *m, bool with_state)
{
    TP_CHECK(tp_module_named_parameters(m, tp__ck_collect, l));
    if (!(l->steps = tp__calloc((size_t)(l->np ? l->np : 1), sizeof *l->steps)))
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", l->fn);
    for (int p = 0; p < l->np; p++) {
        l->steps[p] = -1;
        tp_tensor *t = l->params[p];
        TP_CHECK(tp__ck_list_add(l, p, TP__CK_PARAM,
                                 tp_tensor_is_dtensor(t) ? tp_dtensor_local(t) : t,
                                 tp_tensor_dtype(t)));
    }
    for (int p = 0; p < l->np && with_state && (l->opt.adam || l->opt.sgd); p++)
        TP_CHECK(tp__ck_add_state(l, p));
    return TP_OK;
}

/* ---- blocks ----------------------------------------------------------------- */

tp_status tp__ck_block(const tp__ck_list *l, const tp_tensor *param, int rank, int64_t *shape,
                       int64_t *offset, bool *owner)
{
    int nd = tp_tensor_ndim(param);
    if (!tp_tensor_is_dtensor(param)) {
        memcpy(shape, tp_tensor_shape(param), (size_t)nd * sizeof *shape);
        memset(offset, 0, (size_t)nd * sizeof *offset);
        *owner = rank == 0;
        return TP_OK;
    }
    tp_mesh *mesh = tp_dtensor_mesh(param);
    int md = tp_mesh_ndim(mesh);
    int64_t coord[TP_MESH_MAX_DIMS];
    for (int d = md - 1, r = rank; d >= 0; d--) {
        coord[d] = r % tp_mesh_size(mesh, d);
        r /= (int)tp_mesh_size(mesh, d);
    }
    const tp_placement *pl = tp_dtensor_placements(param);
    *owner = true;
    for (int d = 0; d < md; d++)
        if (pl[d].kind != TP_PLACEMENT_SHARD && coord[d] != 0)
            *owner = false;
    tp_status st =
        tp_dtensor_shard_extent(mesh, nd, tp_tensor_shape(param), md, pl, coord, shape, offset);
    if (st != TP_OK)
        tp__error_prefix("%s", l->fn);
    return st;
}

/* ---- agreement ------------------------------------------------------------------ */

#define TP__CK_MSG_WORDS 160 /* status + 636 bytes of message */

tp_status tp__ck_agree(tp_comm *comm, tp_status local_st)
{
    if (!comm || tp_comm_size(comm) == 1)
        return local_st;
    int rank = tp_comm_rank(comm), size = tp_comm_size(comm);
    int32_t first = local_st != TP_OK ? rank : size;
    int32_t buf[TP__CK_MSG_WORDS] = {0};
    int64_t one = 1, nbuf = TP__CK_MSG_WORDS;
    tp_tensor *f = NULL, *b = NULL;
    char *msg = (char *)&buf[1];
    size_t cap = sizeof buf - sizeof buf[0];
    if (local_st != TP_OK) {
        buf[0] = (int32_t)local_st;
        snprintf(msg, cap, "%s", tp_last_error());
    }
    tp_status st = tp_tensor_from_blob(TP_I32, TP_CPU, 1, &one, &first, NULL, NULL, &f);
    if (st == TP_OK)
        st = tp_all_reduce(comm, f, f, TP_MIN, NULL);
    if (st == TP_OK && first < size)
        st = tp_tensor_from_blob(TP_I32, TP_CPU, 1, &nbuf, buf, NULL, NULL, &b);
    if (st == TP_OK && first < size)
        st = tp_broadcast(comm, b, first, NULL);
    tp_tensor_release(f);
    tp_tensor_release(b);
    if (st != TP_OK)
        return local_st != TP_OK ? tp__error(local_st, "%s", msg) : st;
    if (first == size)
        return TP_OK;
    msg[cap - 1] = '\0';
    if (first == rank)
        return tp__error(local_st, "%s", msg);
    return tp__error((tp_status)buf[0], "%s (on rank %d)", msg, (int)first);
}

/* ---- CRC-32C ------------------------------------------------------------------- */

static uint32_t tp__ck_crc_table[8][256];

static void tp__ck_crc_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? (c >> 1) ^ 0x82f63b78u : c >> 1;
        tp__ck_crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            tp__ck_crc_table[t][i] = (tp__ck_crc_table[t - 1][i] >> 8) ^
                                     tp__ck_crc_table[0][tp__ck_crc_table[t - 1][i] & 0xff];
}

/* Slicing by 8: the portable path. */
static uint32_t tp__ck_crc_sw(uint32_t c, const unsigned char *p, size_t n)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, tp__ck_crc_init);
    const uint32_t(*t)[256] = (const uint32_t(*)[256])tp__ck_crc_table;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= c;
        c = t[7][w & 0xff] ^ t[6][(w >> 8) & 0xff] ^ t[5][(w >> 16) & 0xff] ^
            t[4][(w >> 24) & 0xff] ^ t[3][(w >> 32) & 0xff] ^ t[2][(w >> 40) & 0xff] ^
            t[1][(w >> 48) & 0xff] ^ t[0][w >> 56];
        p += 8;
        n -= 8;
    }
    while (n--)
        c = (c >> 8) ^ t[0][(c ^ *p++) & 0xff];
    return c;
}

#ifdef TP__CK_HW_CRC
/* The SSE4.2 crc32 instruction, 8 bytes at a time: several GB/s. */
__attribute__((target("sse4.2"))) static uint32_t tp__ck_crc_hw(uint32_t c, const unsigned char *p,
                                                                size_t n)
{
    uint64_t c64 = c;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c64 = _mm_crc32_u64(c64, w);
        p += 8;
        n -= 8;
    }
    c = (uint32_t)c64;
    while (n--)
        c = _mm_crc32_u8(c, *p++);
    return c;
}
#endif

uint32_t tp__ck_crc32c(uint32_t crc, const void *buf, size_t n)
{
    uint32_t c = ~crc;
#ifdef TP__CK_HW_CRC
    if (__builtin_cpu_supports("sse4.2"))
        return ~tp__ck_crc_hw(c, buf, n);
#endif
    return ~tp__ck_crc_sw(c, buf, n);
}

/* ---- files ------------------------------------------------------------------------ */

static _Thread_local uint64_t tp__ck_read_total;

uint64_t tp_checkpoint_bytes_read(void)
{
    return tp__ck_read_total;
}

void tp__ck_count_read(uint64_t n)
{
    tp__ck_read_total += n;
}

tp_status tp__ck_pread(int fd, const char *path, void *buf, size_t n, uint64_t off, bool data)
{
    char *p = buf;
    while (n > 0) {
        ssize_t got = pread(fd, p, n, (off_t)off);
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0)
            return tp__error(TP_ERR_BACKEND, "cannot read %zu bytes at offset %llu of '%s': %s", n,
                             (unsigned long long)off, path,
                             got < 0 ? strerror(errno) : "unexpected end of file (truncated?)");
        if (data)
            tp__ck_read_total += (uint64_t)got;
        p += got;
        n -= (size_t)got;
        off += (uint64_t)got;
    }
    return TP_OK;
}

tp_status tp__ck_pwrite(int fd, const char *path, const void *buf, size_t n, uint64_t off)
{
    const char *p = buf;
    while (n > 0) {
        ssize_t put = pwrite(fd, p, n, (off_t)off);
        if (put < 0 && errno == EINTR)
            continue;
        if (put <= 0)
            return tp__error(TP_ERR_BACKEND, "cannot write %zu bytes at offset %llu of '%s': %s", n,
                             (unsigned long long)off, path,
                             put < 0 ? strerror(errno) : "no progress");
        p += put;
        n -= (size_t)put;
        off += (uint64_t)put;
    }
    return TP_OK;
}

char *tp__ck_path(const char *dir, const char *name)
{
    size_t a = strlen(dir), b = strlen(name);
    char *s = tp__malloc(a + b + 2);
    if (s) {
        memcpy(s, dir, a);
        s[a] = '/';
        memcpy(s + a + 1, name, b + 1);
    }
    return s;
}

void tp__ck_file_name(int r, char *buf, size_t len)
{
    snprintf(buf, len, "rank-%05d.bin", r);
}

static const char *const tp__ck_dtype_names[TP_DTYPE_COUNT] = {"F32",  "F64", "F16",
                                                               "BF16", "I32", "I64"};

const char *tp__ck_dtype_name(tp_dtype d)
{
    return (unsigned)d < TP_DTYPE_COUNT ? tp__ck_dtype_names[d] : "?";
}

int tp__ck_dtype_of(const char *name)
{
    const char *const *names = tp__ck_dtype_names;
    for (int d = 0; d < TP_DTYPE_COUNT; d++)
        if (!strcmp(name, names[d]))
            return d;
    return -1;
}
