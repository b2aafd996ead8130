/* The process-group layer: argument validation for every collective in one
 * place, comm-debug recording, the optional descriptor check, dispatch to the
 * backend, and async work handles. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "collectives/coll.h"
#include "collectives/comm_debug_internal.h"
#include "collectives/observer.h"
#include "core/log.h"

/* The plan traces' observer (src/plan/trace.c registers it), or NULL. */
static _Atomic(const tp__coll_observer *) tp__observer;

void tp__comm_set_observer(const tp__coll_observer *obs)
{
    atomic_store_explicit(&tp__observer, obs, memory_order_release);
}

static const char *const tp__kind_names[TP_COLL_KIND_COUNT] = {
    [TP_COLL_ALL_REDUCE] = "all_reduce",         [TP_COLL_ALL_GATHER] = "all_gather",
    [TP_COLL_REDUCE_SCATTER] = "reduce_scatter", [TP_COLL_ALL_TO_ALL] = "all_to_all",
    [TP_COLL_BROADCAST] = "broadcast",           [TP_COLL_BARRIER] = "barrier",
    [TP_COLL_SCATTER] = "scatter",
};

static const char *const tp__op_names[TP_REDUCE_OP_COUNT] = {
    [TP_SUM] = "sum", [TP_AVG] = "avg", [TP_MAX] = "max", [TP_MIN] = "min",
    [TP_PRODUCT] = "product",
};

const char *tp_coll_kind_name(tp_coll_kind kind)
{
    return ((unsigned)kind < TP_COLL_KIND_COUNT) ? tp__kind_names[kind] : "invalid";
}

const char *tp_reduce_op_name(tp_reduce_op op)
{
    return ((unsigned)op < TP_REDUCE_OP_COUNT) ? tp__op_names[op] : "invalid";
}

double tp__default_timeout(void)
{
    const char *env = getenv("TP_COMM_TIMEOUT");
    if (env && *env) {
        char *end = NULL;
        double v = strtod(env, &end);
        if (end && *end == '\0' && v > 0)
            return v;
    }
    return 300.0;
}

bool tp__default_check(void)
{
    const char *env = getenv("TP_COMM_CHECK");
    return env && strcmp(env, "1") == 0;
}

/* ---- communicators -------------------------------------------------------- */

int tp_comm_rank(const tp_comm *comm) { return comm ? comm->rank : -1; }
int tp_comm_size(const tp_comm *comm) { return comm ? comm->size : -1; }
const char *tp_comm_backend(const tp_comm *comm) { return comm ? comm->ops.name : NULL; }
double tp_comm_timeout(const tp_comm *comm) { return comm ? comm->timeout_s : 0.0; }
bool tp_comm_check(const tp_comm *comm) { return comm && comm->check; }

tp_status tp_comm_set_timeout(tp_comm *comm, double seconds)
{
    TP_ARG_CHECK(comm, "tp_comm_set_timeout: comm is NULL");
    TP_ARG_CHECK(seconds > 0 && seconds < 1e9,
                 "tp_comm_set_timeout: timeout must be positive, got %g s", seconds);
    comm->timeout_s = seconds;
    return TP_OK;
}

tp_status tp_comm_set_check(tp_comm *comm, bool enabled)
{
    TP_ARG_CHECK(comm, "tp_comm_set_check: comm is NULL");
    comm->check = enabled;
    return TP_OK;
}

tp_status tp_comm_create(const tp_backend *backend, void *state, int rank, int size,
                         tp_comm **out)
{
    TP_ARG_CHECK(out, "tp_comm_create: out is NULL");
    *out = NULL;
    TP_ARG_CHECK(backend, "tp_comm_create: backend is NULL");
    TP_ARG_CHECK(backend->name && backend->name[0], "tp_comm_create: backend has no name");
    TP_ARG_CHECK(size >= 1, "tp_comm_create: size must be >= 1, got %d", size);
    TP_ARG_CHECK(rank >= 0 && rank < size, "tp_comm_create: rank %d out of range for size %d",
                 rank, size);
    tp_comm *c = tp__calloc(1, sizeof *c);
    if (!c)
        return tp__error(TP_ERR_NO_MEMORY, "tp_comm_create: out of memory");
    c->ops = *backend;
    c->state = state;
    c->rank = rank;
    c->size = size;
    c->timeout_s = tp__default_timeout();
    c->check = tp__default_check();
    c->id = tp__comm_debug_comm_id(0, (uint32_t)size, 0);
    c->global_rank = rank;
    c->global_stride = 1;
    atomic_init(&c->refs, 1);
    atomic_init(&c->pending, 0);
    *out = c;
    return TP_OK;
}

tp_status tp_comm_create_world(const char *backend_name, void *options, tp_comm **out)
{
    TP_ARG_CHECK(out, "tp_comm_create_world: out is NULL");
    *out = NULL;
    TP_ARG_CHECK(backend_name, "tp_comm_create_world: backend name is NULL");
    const tp_backend *b = tp_backend_find(backend_name);
    if (!b && strcmp(backend_name, "nccl") == 0)
        return tp__error(
            TP_ERR_NOT_SUPPORTED,
            "tp_comm_create_world: libtp was built without NCCL, so backend 'nccl' is not "
            "available (rebuild with CUDA and NCCL found: meson setup "
            "-Dnccl=enabled)");
    if (!b && strcmp(backend_name, "mpi") == 0)
        return tp__error(
            TP_ERR_NOT_SUPPORTED,
            "tp_comm_create_world: libtp was built without MPI, so backend 'mpi' is not "
            "available (rebuild with MPI found: meson setup -Dmpi=enabled)");
    if (!b)
        return tp__error(
            TP_ERR_NOT_SUPPORTED, "tp_comm_create_world: no backend named '%s' is registered%s",
            backend_name, strcmp(backend_name, "shm") == 0 ? "" : " (is libtp built with it?)");
    if (!b->init_world)
        return tp__error(
            TP_ERR_NOT_SUPPORTED, "tp_comm_create_world: backend '%s' has no world of its own%s",
            backend_name, strcmp(backend_name, "shm") == 0 ? "; use tp_run_local" : "");
    void *state = NULL;
    int rank = 0, size = 0;
    TP_CHECK(b->init_world(options, &state, &rank, &size));
    tp_status st = tp_comm_create(b, state, rank, size, out);
    if (st != TP_OK && b->free)
        b->free(state);
    if (st == TP_OK)
        tp__log_set_process_rank(rank);
    return st;
}

void tp_comm_abort(tp_comm *comm, const char *reason)
{
    if (!comm)
        return;
    if (!reason)
        reason = "aborted by the application";
    if (!comm->aborted)
        snprintf(comm->abort_reason, sizeof comm->abort_reason, "rank %d aborted: %s", comm->rank,
                 reason);
    comm->aborted = true;
    if (comm->ops.abort)
        comm->ops.abort(comm->state, reason);
}

bool tp_comm_is_aborted(const tp_comm *comm) { return comm && comm->aborted; }

tp_comm *tp__comm_retain(tp_comm *comm)
{
    if (comm)
        atomic_fetch_add(&comm->refs, 1);
    return comm;
}

void tp__comm_release(tp_comm *comm)
{
    if (!comm || atomic_fetch_sub(&comm->refs, 1) != 1)
        return;
    if (comm->ops.free)
        comm->ops.free(comm->state);
    tp__free(comm);
}

tp_status tp_comm_free(tp_comm *comm)
{
    if (!comm || comm->owned_by_run)
        return TP_OK;
    /* Work handles point at the communicator and the caller still has to
     * wait on or free them: refuse rather than pull the handle from under
     * them (they keep it alive anyway, so nothing dangles either way). */
    int pending = atomic_load(&comm->pending);
    if (pending > 0)
        return tp__error(TP_ERR_STATE,
                         "tp_comm_free: %d work handle%s of this communicator (rank %d of %d, "
                         "backend '%s') %s not freed yet; free %s with tp_work_free first",
                         pending, pending == 1 ? "" : "s", comm->rank, comm->size,
                         comm->ops.name, pending == 1 ? "is" : "are",
                         pending == 1 ? "it" : "them");
    tp__comm_release(comm);
    return TP_OK;
}

static tp_status tp__finish(tp_comm *comm, const char *fn, tp_status st);

tp_status tp_comm_split(tp_comm *comm, int color, int key, tp_comm **out)
{
    TP_ARG_CHECK(out, "tp_comm_split: out is NULL");
    *out = NULL;
    TP_ARG_CHECK(comm, "tp_comm_split: comm is NULL");
    if (!comm->ops.split)
        return tp__error(TP_ERR_NOT_SUPPORTED, "tp_comm_split: backend '%s' cannot split",
                         comm->ops.name);
    if (color < 0)
        color = TP_COMM_NO_COLOR;
    uint32_t split_seq = comm->nsplits++; /* every rank splits: the same on all */
    void *state = NULL;
    int rank = 0, size = 0;
    tp_status st =
        comm->ops.split(comm->state, color, key, comm->timeout_s, &state, &rank, &size);
    if (st != TP_OK)
        return tp__finish(comm, "tp_comm_split", st);
    if (!state)
        return TP_OK; /* color < 0: took part, joins nothing */
    tp_comm *c = NULL;
    st = tp_comm_create(&comm->ops, state, rank, size, &c);
    if (st != TP_OK) {
        /* the new group's peers must not wait for this rank */
        if (comm->ops.abort)
            comm->ops.abort(state, "a rank could not create its handle in tp_comm_split");
        if (comm->ops.free)
            comm->ops.free(state);
        return st;
    }
    c->timeout_s = comm->timeout_s;
    c->check = comm->check;
    c->id = tp__comm_debug_comm_id(comm->id, split_seq, color);
    c->global_rank = comm->global_rank;
    c->global_stride = 0;
    *out = c;
    return TP_OK;
}

static _Thread_local int tp__split_hint;
static _Thread_local const tp_coll_desc *tp__blocking_desc;

bool tp__comm_blocking_call(const tp_coll_desc *desc)
{
    return desc && desc == tp__blocking_desc;
}

tp_status tp__comm_split_sized(tp_comm *comm, int color, int key, int size, tp_comm **out)
{
    int saved = tp__split_hint;
    tp__split_hint = size;
    tp_status st = tp_comm_split(comm, color, key, out);
    tp__split_hint = saved;
    return st;
}

int tp__comm_split_size_hint(void)
{
    return tp__split_hint;
}

int64_t tp__comm_global_stride(const tp_comm *comm)
{
    return comm ? comm->global_stride : 0;
}

void tp__comm_set_global_stride(tp_comm *comm, int64_t stride)
{
    if (comm)
        comm->global_stride = stride;
}

/* ---- validation ----------------------------------------------------------- */

static bool tp__overlap(const void *a, size_t alen, const void *b, size_t blen)
{
    uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
    return alen && blen && x < y + blen && y < x + alen;
}

/* What the checks of one buffer found, so that tp__prepare asks each tensor
 * once. */
typedef struct tp__buf {
    char *data;
    size_t numel;
    tp_device device;
} tp__buf;

/* The checks of tp__check_buf in order, each with its message, for a buffer
 * that failed there: out of line, off the path of a call that passes. */
__attribute__((noinline, cold)) static tp_status
tp__refuse_buf(const char *fn, const char *what, const tp_tensor *t, const tp_comm *comm)
{
    TP_ARG_CHECK(t, "%s: %s is NULL", fn, what);
    TP_ARG_CHECK((unsigned)t->dtype < TP_DTYPE_COUNT, "%s: %s has an invalid dtype", fn, what);
    TP_ARG_CHECK(tp_tensor_is_contiguous(t), "%s: %s is not contiguous", fn, what);
    /* what is left to fail: a device the backend does not take */
    tp_device dev = tp_tensor_device(t);
    return tp__error(TP_ERR_NOT_SUPPORTED, "%s: backend '%s' cannot move %s tensors (%s)%s", fn,
                     comm->ops.name,
                     dev.type == TP_DEVICE_CUDA   ? "CUDA"
                     : dev.type == TP_DEVICE_META ? "meta"
                                                  : "CPU",
                     what,
                     comm->ops.device_mask == 1u << TP_DEVICE_META
                         ? "; a simulated world takes meta tensors only (TP_META)"
                         : "");
}

/* A buffer the backend can take: not NULL, a valid dtype, contiguous (which
 * a tensor without storage of its own, a DTensor, is not), on a device of
 * the backend's mask. Reads the tensor's fields directly, once, on every
 * collective's path. */
static inline tp_status tp__check_buf(const char *fn, const char *what, const tp_tensor *t,
                                      const tp_comm *comm, tp__buf *b)
{
    int64_t numel;
    if (TP_UNLIKELY(!t || (unsigned)t->dtype >= TP_DTYPE_COUNT || !t->storage ||
                    !tp__contiguous_numel(t, &numel) ||
                    !(comm->ops.device_mask & (1u << t->storage->device.type)))) {
        *b = (tp__buf){0}; /* never read: the refusal is an error */
        return tp__refuse_buf(fn, what, t, comm);
    }
    b->data = (char *)t->storage->data + (size_t)t->offset * tp__dtype_traits_table[t->dtype].size;
    b->numel = (size_t)numel;
    b->device = t->storage->device;
    return TP_OK;
}

static tp_status tp__check_pair(const char *fn, const tp_tensor *send, const tp_tensor *recv,
                                const tp__buf *bs, const tp__buf *br)
{
    if (send->dtype != recv->dtype)
        return tp__error(TP_ERR_INVALID_ARG, "%s: send is %s but recv is %s", fn,
                         tp_dtype_name(send->dtype), tp_dtype_name(recv->dtype));
    if (!tp__device_eq(bs->device, br->device))
        return tp__error(TP_ERR_INVALID_ARG, "%s: send and recv are on different devices", fn);
    return TP_OK;
}

/* scatter: recv on every rank, send on root only (ignored elsewhere). */
static tp_status tp__prepare_scatter(tp_comm *comm, const char *fn, const tp_tensor *send,
                                     tp_tensor *recv, int root, tp_coll_desc *d)
{
    tp__buf br, bs;
    TP_CHECK(tp__check_buf(fn, "recv", recv, comm, &br));
    if (root < 0 || root >= comm->size)
        return tp__error(TP_ERR_INVALID_ARG, "%s: root %d out of range for %d ranks", fn, root,
                         comm->size);
    size_t es = tp__dtype_size(recv->dtype), n = (size_t)comm->size;
    size_t nr = br.numel;
    char *pr = br.data;
    d->dtype = recv->dtype;
    d->device = br.device;
    d->count = nr;
    d->recvbuf = pr;
    d->recv = recv;
    if (comm->rank != root)
        return TP_OK;
    TP_ARG_CHECK(send, "%s: send is NULL on root %d", fn, root);
    TP_CHECK(tp__check_buf(fn, "send", send, comm, &bs));
    TP_CHECK(tp__check_pair(fn, send, recv, &bs, &br));
    size_t ns = bs.numel;
    const char *ps = bs.data;
    if (ns != nr * n)
        return tp__error(TP_ERR_INVALID_ARG,
                         "%s: send has %zu elements, expected %zu (recv %zu x %zu ranks)", fn, ns,
                         nr * n, nr, n);
    d->sendbuf = ps;
    d->send = send;
    bool in_place = pr == ps + (size_t)root * nr * es;
    if (!in_place && tp__overlap(ps, ns * es, pr, nr * es))
        return tp__error(TP_ERR_INVALID_ARG,
                         "%s: send and recv overlap in a way that is not the in-place form", fn);
    return TP_OK;
}

/* Fills the descriptor from the arguments, applying the count and in-place
 * rules of comm.h. */
static tp_status tp__prepare(tp_comm *comm, tp_coll_kind kind, const char *fn,
                             const tp_tensor *send, tp_tensor *recv, tp_reduce_op op, int root,
                             tp_coll_desc *d)
{
    memset(d, 0, sizeof *d);
    d->kind = kind;
    d->op = op;
    d->root = root;
    if (kind == TP_COLL_BARRIER) {
        d->device = TP_CPU;
        return TP_OK;
    }
    if (kind == TP_COLL_SCATTER)
        return tp__prepare_scatter(comm, fn, send, recv, root, d);
    if (kind == TP_COLL_ALL_REDUCE || kind == TP_COLL_REDUCE_SCATTER)
        TP_ARG_CHECK((unsigned)op < TP_REDUCE_OP_COUNT, "%s: invalid reduce op %d", fn, (int)op);
    tp__buf bs, br = {0}; /* broadcast has no recv */
    TP_CHECK(tp__check_buf(fn, kind == TP_COLL_BROADCAST ? "buffer" : "send", send, comm, &bs));
    if (kind != TP_COLL_BROADCAST) {
        TP_CHECK(tp__check_buf(fn, "recv", recv, comm, &br));
        TP_CHECK(tp__check_pair(fn, send, recv, &bs, &br));
    }
    size_t es = tp__dtype_size(send->dtype);
    size_t n = (size_t)comm->size;
    size_t ns = bs.numel, nr = br.numel;
    const char *ps = bs.data;
    char *pr = br.data;
    d->dtype = send->dtype;
    d->device = bs.device;
    d->sendbuf = ps;
    d->recvbuf = pr;
    d->send = send;
    d->recv = recv;
    bool in_place = false;
    switch (kind) {
    case TP_COLL_ALL_REDUCE:
        if (ns != nr)
            return tp__error(TP_ERR_INVALID_ARG, "%s: send has %zu elements but recv has %zu", fn,
                             ns, nr);
        d->count = ns;
        in_place = ps == pr;
        break;
    case TP_COLL_ALL_GATHER:
        if (nr != ns * n)
            return tp__error(TP_ERR_INVALID_ARG,
                             "%s: recv has %zu elements, expected %zu (send %zu x %zu ranks)", fn,
                             nr, ns * n, ns, n);
        d->count = ns;
        in_place = ps == pr + (size_t)comm->rank * ns * es;
        break;
    case TP_COLL_REDUCE_SCATTER:
        if (ns != nr * n)
            return tp__error(TP_ERR_INVALID_ARG,
                             "%s: send has %zu elements, expected %zu (recv %zu x %zu ranks)", fn,
                             ns, nr * n, nr, n);
        d->count = nr;
        in_place = pr == ps + (size_t)comm->rank * nr * es;
        break;
    case TP_COLL_ALL_TO_ALL:
        if (ns != nr)
            return tp__error(TP_ERR_INVALID_ARG, "%s: send has %zu elements but recv has %zu", fn,
                             ns, nr);
        if (ns % n)
            return tp__error(TP_ERR_INVALID_ARG,
                             "%s: %zu elements do not split into %zu equal blocks", fn, ns, n);
        d->count = ns / n;
        break;
    case TP_COLL_BROADCAST:
        if (root < 0 || root >= comm->size)
            return tp__error(TP_ERR_INVALID_ARG, "%s: root %d out of range for %d ranks", fn,
                             root, comm->size);
        d->count = ns;
        d->recvbuf = (void *)ps;
        d->recv = (tp_tensor *)send;
        return TP_OK;
    default:
        return tp__error(TP_ERR_INVALID_ARG, "%s: invalid collective kind", fn);
    }
    if (!in_place && tp__overlap(ps, ns * es, pr, nr * es))
        return tp__error(TP_ERR_INVALID_ARG,
                         "%s: send and recv overlap in a way that is not the in-place form", fn);
    return TP_OK;
}

static size_t tp__debug_bytes(const tp_coll_desc *d, int size)
{
    size_t es = tp__dtype_size(d->dtype);
    switch (d->kind) {
    case TP_COLL_ALL_GATHER:
    case TP_COLL_REDUCE_SCATTER:
    case TP_COLL_ALL_TO_ALL:
    case TP_COLL_SCATTER:
        return d->count * (size_t)size * es;
    case TP_COLL_BARRIER:
        return 0;
    default:
        return d->count * es;
    }
}

/* ---- the optional descriptor check --------------------------------------- */

enum { TP__DESC_WORDS = 7 };

static void tp__desc_pack(const tp_coll_desc *d, uint64_t seq, int64_t w[TP__DESC_WORDS])
{
    bool red = d->kind == TP_COLL_ALL_REDUCE || d->kind == TP_COLL_REDUCE_SCATTER;
    w[0] = (int64_t)seq;
    w[1] = d->kind;
    w[2] = d->kind == TP_COLL_BARRIER ? -1 : (int64_t)d->dtype;
    w[3] = (int64_t)d->count;
    w[4] = red ? (int64_t)d->op : -1;
    w[5] = d->kind == TP_COLL_BROADCAST || d->kind == TP_COLL_SCATTER ? d->root : -1;
    w[6] = d->kind == TP_COLL_BARRIER ? -1 : (int64_t)d->device.type;
}

void tp__desc_string(const int64_t *w, char *buf, size_t len)
{
    int n = snprintf(buf, len, "%s", tp_coll_kind_name((tp_coll_kind)w[1]));
    if (w[1] != TP_COLL_BARRIER && n >= 0 && (size_t)n < len)
        n += snprintf(buf + n, len - (size_t)n, "(%s, %lld elements%s%s%s", tp_dtype_name((tp_dtype)w[2]),
                      (long long)w[3], w[4] >= 0 ? ", " : "",
                      w[4] >= 0 ? tp_reduce_op_name((tp_reduce_op)w[4]) : "",
                      w[5] >= 0 ? ", root " : "");
    if (w[1] != TP_COLL_BARRIER && n >= 0 && (size_t)n < len) {
        if (w[5] >= 0)
            n += snprintf(buf + n, len - (size_t)n, "%lld", (long long)w[5]);
        if (n >= 0 && (size_t)n < len)
            snprintf(buf + n, len - (size_t)n, ")");
    }
}

/* Every rank all-gathers every rank's descriptor through the backend itself
 * (not recorded by comm-debug), so each reaches the same verdict. */
static tp_status tp__check_descriptors(tp_comm *comm, const char *fn, const tp_coll_desc *d)
{
    int n = comm->size;
    int64_t mine[TP__DESC_WORDS];
    tp__desc_pack(d, comm->check_seq++, mine);
    int64_t *all = tp__malloc(sizeof(int64_t) * TP__DESC_WORDS * (size_t)n);
    if (!all)
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory for the descriptor check", fn);
    int64_t sh = TP__DESC_WORDS, rh = (int64_t)TP__DESC_WORDS * n;
    tp_tensor *ts = NULL, *tr = NULL;
    tp_status st = tp_tensor_from_blob(TP_I64, TP_CPU, 1, &sh, mine, NULL, NULL, &ts);
    if (st == TP_OK)
        st = tp_tensor_from_blob(TP_I64, TP_CPU, 1, &rh, all, NULL, NULL, &tr);
    if (st == TP_OK) {
        tp_coll_desc g = {.kind = TP_COLL_ALL_GATHER, .dtype = TP_I64, .device = TP_CPU,
                          .count = TP__DESC_WORDS, .sendbuf = mine, .recvbuf = all,
                          .send = ts, .recv = tr, .timeout_s = comm->timeout_s};
        void *impl = NULL;
        st = comm->ops.collective(comm->state, &g, &impl);
        if (st == TP_OK && impl) {
            st = comm->ops.work_wait ? comm->ops.work_wait(comm->state, impl, comm->timeout_s)
                                     : TP_ERR_NOT_SUPPORTED;
            if (comm->ops.work_free)
                comm->ops.work_free(comm->state, impl);
        }
    }
    if (st == TP_OK) {
        for (int q = 1; q < n; q++) {
            const int64_t *a = all, *b = all + (size_t)q * TP__DESC_WORDS;
            if (memcmp(a, b, sizeof mine) != 0) {
                char da[160], db[160];
                tp__desc_string(a, da, sizeof da);
                tp__desc_string(b, db, sizeof db);
                st = tp__error(TP_ERR_MISMATCH,
                               "%s: ranks disagree at checked collective #%lld: rank 0 issued "
                               "%s, rank %d issued %s%s",
                               fn, (long long)a[0], da, q, db,
                               a[0] != b[0] ? " (sequence numbers differ)" : "");
                break;
            }
        }
    } else if (st != TP_ERR_MISMATCH) {
        tp__error_prefix("%s: descriptor check", fn);
    }
    tp_tensor_release(ts);
    tp_tensor_release(tr);
    tp__free(all);
    return st;
}

/* ---- dispatch ------------------------------------------------------------- */

/* After a timeout the peers must not wait for this rank any longer: abort
 * (backends that abort on their own ignore the second call). */
static void tp__note_abort(tp_comm *comm, tp_status st)
{
    if ((st != TP_ERR_ABORTED && st != TP_ERR_TIMEOUT) || comm->aborted)
        return;
    snprintf(comm->abort_reason, sizeof comm->abort_reason, "%s", tp_last_error());
    comm->aborted = true;
    if (st == TP_ERR_TIMEOUT && comm->ops.abort)
        comm->ops.abort(comm->state, "a rank timed out");
}

static tp_status tp__finish(tp_comm *comm, const char *fn, tp_status st)
{
    if (st == TP_OK)
        return st;
    tp__error_prefix("%s", fn);
    tp__note_abort(comm, st);
    return st;
}

/* *d: the descriptor, filled once the arguments pass validation. */
static tp_status tp__issue(tp_comm *comm, tp_coll_kind kind, const char *fn,
                           const tp_tensor *send, tp_tensor *recv, tp_reduce_op op, int root,
                           tp_work **work, tp_coll_desc *d)
{
    if (work)
        *work = NULL;
    TP_ARG_CHECK(comm, "%s: comm is NULL", fn);
    TP_CHECK(tp__prepare(comm, kind, fn, send, recv, op, root, d));
    d->timeout_s = comm->timeout_s;
    if (comm->aborted)
        return tp__error(TP_ERR_ABORTED, "%s: communicator aborted: %s", fn, comm->abort_reason);

    tp_work *w = NULL;
    if (work) {
        w = tp__calloc(1, sizeof *w);
        if (!w)
            return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory for the work handle", fn);
    }
    size_t bytes = tp__debug_bytes(d, comm->size);
    tp__comm_debug_record(kind, bytes);
    const tp__coll_observer *obs = atomic_load_explicit(&tp__observer, memory_order_acquire);
    uint64_t plan_id = obs ? obs->collective(kind, comm->size, comm->rank, comm->global_rank,
                                             comm->global_stride, bytes, work != NULL)
                           : 0;

    tp_status st = TP_OK;
    if (comm->check && !comm->ops.checks_descriptors && comm->size > 1)
        st = tp__check_descriptors(comm, fn, d);
    void *impl = NULL;
    if (st == TP_OK) {
        tp_clear_error();
        /* saved and restored: a user backend may issue libtp collectives
         * of its own from inside `collective` */
        const tp_coll_desc *outer = tp__blocking_desc;
        tp__blocking_desc = work ? NULL : d;
        st = comm->ops.collective(comm->state, d, &impl);
        tp__blocking_desc = outer;
        if (st != TP_OK && !tp_last_error()[0]) /* a user backend's bare status */
            tp__error(st, "backend '%s' %s %s", comm->ops.name,
                      st == TP_ERR_NOT_SUPPORTED ? "does not implement"
                                                 : "returned an error without a message for",
                      tp_coll_kind_name(kind));
    }
    if (st != TP_OK) {
        tp__free(w);
        return tp__finish(comm, fn, st);
    }
    if (w) {
        w->impl = impl;
        w->kind = kind;
        w->plan_id = plan_id;
        w->done = impl == NULL;
        w->comm = tp__comm_retain(comm);
        atomic_fetch_add(&comm->pending, 1);
        *work = w;
        return TP_OK;
    }
    if (impl) {
        st = comm->ops.work_wait
                 ? comm->ops.work_wait(comm->state, impl, comm->timeout_s)
                 : tp__error(TP_ERR_NOT_SUPPORTED, "backend '%s' returned work it cannot wait on",
                             comm->ops.name);
        if (comm->ops.work_free)
            comm->ops.work_free(comm->state, impl);
    }
    return tp__finish(comm, fn, st);
}

/* With TP_DEBUG at WARN or above, the collective's line: a failure (WARN),
 * or what it moved and, when it completed here, how long it took (TRACE).
 * One call of tp__issue, so that it stays inlined here. */
static tp_status tp__dispatch(tp_comm *comm, tp_coll_kind kind, const char *fn,
                              const tp_tensor *send, tp_tensor *recv, tp_reduce_op op, int root,
                              tp_work **work)
{
    double t0 = TP_LOG_ON(TP_LOG_WARN) ? tp__now() : -1;
    tp_coll_desc d;
    tp_status st = tp__issue(comm, kind, fn, send, recv, op, root, work, &d);
    if (TP_UNLIKELY(t0 >= 0)) {
        if (st == TP_OK)
            tp__comm_debug_trace(comm, &d, tp__debug_bytes(&d, comm->size),
                                 work && *work && !(*work)->done ? -1 : tp__now() - t0);
        else
            tp__log(TP_LOG_WARN, "%s failed: %s: %s", fn, tp_status_name(st), tp_last_error());
    }
    return st;
}

tp_status tp_all_reduce(tp_comm *comm, const tp_tensor *send, tp_tensor *recv, tp_reduce_op op,
                        tp_work **work)
{
    return tp__dispatch(comm, TP_COLL_ALL_REDUCE, "tp_all_reduce", send, recv, op, 0, work);
}

tp_status tp_all_gather(tp_comm *comm, const tp_tensor *send, tp_tensor *recv, tp_work **work)
{
    return tp__dispatch(comm, TP_COLL_ALL_GATHER, "tp_all_gather", send, recv, TP_SUM, 0, work);
}

tp_status tp_reduce_scatter(tp_comm *comm, const tp_tensor *send, tp_tensor *recv,
                            tp_reduce_op op, tp_work **work)
{
    return tp__dispatch(comm, TP_COLL_REDUCE_SCATTER, "tp_reduce_scatter", send, recv, op, 0,
                        work);
}

tp_status tp_all_to_all(tp_comm *comm, const tp_tensor *send, tp_tensor *recv, tp_work **work)
{
    return tp__dispatch(comm, TP_COLL_ALL_TO_ALL, "tp_all_to_all", send, recv, TP_SUM, 0, work);
}

tp_status tp_broadcast(tp_comm *comm, tp_tensor *buffer, int root, tp_work **work)
{
    return tp__dispatch(comm, TP_COLL_BROADCAST, "tp_broadcast", buffer, NULL, TP_SUM, root, work);
}

tp_status tp_barrier(tp_comm *comm, tp_work **work)
{
    return tp__dispatch(comm, TP_COLL_BARRIER, "tp_barrier", NULL, NULL, TP_SUM, 0, work);
}

tp_status tp_scatter(tp_comm *comm, const tp_tensor *send, tp_tensor *recv, int root,
                     tp_work **work)
{
    return tp__dispatch(comm, TP_COLL_SCATTER, "tp_scatter", send, recv, TP_SUM, root, work);
}

/* ---- work ----------------------------------------------------------------- */

static void tp__work_complete(tp_work *w, tp_status st)
{
    tp_comm *c = w->comm;
    if (c->ops.work_free && w->impl)
        c->ops.work_free(c->state, w->impl);
    w->impl = NULL;
    w->done = true;
    w->status = st;
    if (st != TP_OK) {
        tp__error_prefix("tp_work_wait (%s)", tp_coll_kind_name(w->kind));
        tp__note_abort(c, st);
    }
}

tp_status tp_work_wait(tp_work *work)
{
    TP_ARG_CHECK(work, "tp_work_wait: work is NULL");
    if (work->plan_id) {
        const tp__coll_observer *obs = atomic_load_explicit(&tp__observer, memory_order_acquire);
        if (obs)
            obs->wait(work->plan_id);
        work->plan_id = 0;
    }
    if (work->done)
        return work->status;
    tp_comm *c = work->comm;
    tp_status st = c->ops.work_wait
                       ? c->ops.work_wait(c->state, work->impl, c->timeout_s)
                       : tp__error(TP_ERR_NOT_SUPPORTED, "backend '%s' cannot wait on work",
                                   c->ops.name);
    tp__work_complete(work, st);
    return st;
}

tp_status tp_work_test(tp_work *work, bool *done)
{
    TP_ARG_CHECK(done, "tp_work_test: done is NULL");
    *done = false;
    TP_ARG_CHECK(work, "tp_work_test: work is NULL");
    if (work->done) {
        *done = true;
        return work->status;
    }
    tp_comm *c = work->comm;
    bool fin = false;
    tp_status st = c->ops.work_test
                       ? c->ops.work_test(c->state, work->impl, &fin)
                       : tp__error(TP_ERR_NOT_SUPPORTED, "backend '%s' cannot test work",
                                   c->ops.name);
    if (st != TP_OK || fin) {
        tp__work_complete(work, st);
        *done = true;
    }
    return st;
}

void tp_work_free(tp_work *work)
{
    if (!work)
        return;
    if (!work->done)
        (void)tp_work_wait(work);
    tp_comm *c = work->comm;
    atomic_fetch_sub(&c->pending, 1);
    tp__free(work);
    tp__comm_release(c);
}
