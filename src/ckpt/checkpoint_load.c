/* Loading a sharded checkpoint into a module and optimizer as they are now:
 * match names, read each rank's blocks into scratch tensors, agree, commit.
 * See tp/checkpoint.h. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "ckpt/checkpoint_read.h"

typedef struct {
    tp__ck_list l;
    tp__ck_reader r;
    const tp_checkpoint_options *o;
    json_t **src; /* per item: its entry in the metadata */
    size_t cap_src;
    tp_tensor **val;   /* per item: this rank's block, in the item's dtype and device */
    tp__ck_entry *ent; /* per item: its entry, checked */
    bool load_opt;
    double lr;
    tp__opt_pending *pending;
} tp__ck_loader;

static const tp_checkpoint_options tp__ck_no_options;

static tp_status tp__ck_add(tp__ck_loader *L, int p, tp__ck_kind kind, tp_dtype dt, json_t *src)
{
    if (!tp__grow_array((void **)&L->src, (size_t)L->l.n, &L->cap_src, sizeof *L->src))
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", L->l.fn);
    L->src[L->l.n] = src;
    return tp__ck_list_add(&L->l, p, kind, NULL, dt);
}

static int tp__ck_param_index(const tp__ck_list *l, const char *fqn)
{
    for (int p = 0; p < l->np; p++)
        if (!strcmp(l->fqns[p], fqn))
            return p;
    return -1;
}

/* Appends a name to a bounded list message. */
static void tp__ck_msg_add(char *buf, size_t len, const char *s)
{
    size_t used = strlen(buf);
    if (used + 8 >= len)
        return;
    snprintf(buf + used, len - used, "%s'%s'", used ? ", " : "", s);
}

static tp_status tp__ck_match_model(tp__ck_loader *L)
{
    tp__ck_list *l = &L->l;
    json_t *model = json_object_get(L->r.root, "model");
    char missing[400] = "", unexpected[400] = "";
    size_t matched = 0;
    for (int p = 0; p < l->np; p++) {
        json_t *j = json_object_get(model, l->fqns[p]);
        if (!j) {
            tp__ck_msg_add(missing, sizeof missing, l->fqns[p]);
            continue;
        }
        matched++;
        TP_CHECK(tp__ck_add(L, p, TP__CK_PARAM, tp_tensor_dtype(l->params[p]), j));
    }
    const char *key;
    json_t *v;
    if (matched != json_object_size(model)) {
        json_object_foreach(model, key, v)
        {
            if (tp__ck_param_index(l, key) < 0)
                tp__ck_msg_add(unexpected, sizeof unexpected, key);
        }
    }
    if (missing[0] && !L->o->allow_missing)
        return tp__error(TP_ERR_INVALID_ARG,
                         "%s: '%s': parameters missing from the checkpoint: %s (allow_missing "
                         "to keep their values)",
                         l->fn, L->r.meta, missing);
    if (unexpected[0] && !L->o->allow_unexpected)
        return tp__error(TP_ERR_INVALID_ARG,
                         "%s: '%s': unexpected tensors, naming no parameter of the module: %s "
                         "(allow_unexpected to ignore them)",
                         l->fn, L->r.meta, unexpected);
    return TP_OK;
}

/* One parameter's stored optimizer state: its step and tensors as items. */
static tp_status tp__ck_match_state(tp__ck_loader *L, int p, json_t *sv)
{
    tp__ck_list *l = &L->l;
    const char *fqn = l->fqns[p], *key;
    json_t *step = json_object_get(sv, "step"), *ev;
    if (!json_is_object(sv) || !json_is_integer(step) || json_integer_value(step) < 0)
        return tp__error(TP_ERR_INVALID_ARG,
                         "%s: '%s': the optimizer state of '%s' needs a step count >= 0", l->fn,
                         L->r.meta, fqn);
    l->steps[p] = json_integer_value(step);
    bool adam = L->l.opt.adam != NULL, has[TP__CK_KINDS] = {false};
    json_object_foreach(sv, key, ev)
    {
        if (!strcmp(key, "step"))
            continue;
        int kind = 1;
        while (kind < TP__CK_KINDS && strcmp(key, tp__ck_kind_names[kind]))
            kind++;
        bool mine =
            kind == TP__CK_MASTER ||
            (adam ? kind == TP__CK_EXP_AVG || kind == TP__CK_EXP_AVG_SQ : kind == TP__CK_MOMENTUM);
        if (!mine)
            return tp__error(
                TP_ERR_INVALID_ARG, "%s: '%s': optimizer state '%s' of '%s' is not one of a%s",
                l->fn, L->r.meta, key, fqn,
                adam ? "n Adam (exp_avg, exp_avg_sq, master)" : " SGD (momentum_buffer, master)");
        has[kind] = true;
        if (kind == TP__CK_MASTER && tp_tensor_dtype(l->params[p]) == TP_F32)
            continue; /* an f32 parameter is its own master */
        TP_CHECK(tp__ck_add(L, p, (tp__ck_kind)kind, TP_F32, ev));
    }
    if (adam && !(has[TP__CK_EXP_AVG] && has[TP__CK_EXP_AVG_SQ]))
        return tp__error(TP_ERR_INVALID_ARG,
                         "%s: '%s': the Adam state of '%s' lacks exp_avg or exp_avg_sq", l->fn,
                         L->r.meta, fqn);
    return TP_OK;
}

static tp_status tp__ck_match_optim(tp__ck_loader *L)
{
    tp__ck_list *l = &L->l;
    if (!l->opt.adam && !l->opt.sgd)
        return TP_OK;
    json_t *oj = json_object_get(L->r.root, "optimizer");
    if (!oj && L->o->allow_missing)
        return TP_OK;
    if (!oj)
        return tp__error(TP_ERR_INVALID_ARG,
                         "%s: '%s' holds no optimizer state (allow_missing to load the module "
                         "and leave the optimizer as it is)",
                         l->fn, L->r.meta);
    const char *want = l->opt.adam ? "adam" : "sgd";
    json_t *type = json_object_get(oj, "type"), *lr = json_object_get(oj, "lr"),
           *state = json_object_get(oj, "state");
    if (!json_is_string(type) || !json_is_number(lr) || !json_is_object(state))
        return tp__error(TP_ERR_INVALID_ARG,
                         "%s: '%s': \"optimizer\" needs a type, an lr and a state object", l->fn,
                         L->r.meta);
    if (strcmp(json_string_value(type), want) != 0)
        return tp__error(TP_ERR_INVALID_ARG,
                         "%s: '%s' holds the state of a%s %s optimizer; the optimizer given is %s",
                         l->fn, L->r.meta, json_string_value(type)[0] == 'a' ? "n" : "",
                         json_string_value(type), want);
    L->lr = json_number_value(lr);
    if (!isfinite(L->lr) || L->lr < 0)
        return tp__error(TP_ERR_INVALID_ARG, "%s: '%s': optimizer lr %g is not finite and >= 0",
                         l->fn, L->r.meta, L->lr);
    const char *key;
    json_t *sv;
    char unexpected[400] = "";
    json_object_foreach(state, key, sv)
    {
        int p = tp__ck_param_index(l, key);
        if (p < 0)
            tp__ck_msg_add(unexpected, sizeof unexpected, key);
        else
            TP_CHECK(tp__ck_match_state(L, p, sv));
    }
    if (unexpected[0] && !L->o->allow_unexpected)
        return tp__error(TP_ERR_INVALID_ARG,
                         "%s: '%s': unexpected optimizer state, naming no parameter of the "
                         "module: %s (allow_unexpected to ignore it)",
                         l->fn, L->r.meta, unexpected);
    L->load_opt = true;
    return TP_OK;
}

/* Checks item i's entry against its parameter (shape, dtype). */
static tp_status tp__ck_check_entry(const tp__ck_loader *L, int i, const char *what,
                                    const tp__ck_entry *e)
{
    const tp__ck_item *it = &L->l.it[i];
    const char *fn = L->l.fn;
    int nd = tp_tensor_ndim(it->param);
    const int64_t *gs = tp_tensor_shape(it->param);
    if (e->ndim != nd || memcmp(e->shape, gs, (size_t)nd * sizeof *gs)) {
        char a[128], b[128];
        return tp__error(TP_ERR_INVALID_ARG, "%s: %s in '%s' has shape %s, the parameter %s", fn,
                         what, L->r.meta, tp__shape_str(e->ndim, e->shape, a, sizeof a),
                         tp__shape_str(nd, gs, b, sizeof b));
    }
    if (e->dtype == (int)it->dtype)
        return TP_OK;
    bool fl =
        (e->dtype == TP_F32 || e->dtype == TP_F64 || e->dtype == TP_F16 || e->dtype == TP_BF16) &&
        (it->dtype == TP_F32 || it->dtype == TP_F64 || it->dtype == TP_F16 || it->dtype == TP_BF16);
    if (it->kind == TP__CK_PARAM && fl && L->o->convert_dtype)
        return TP_OK;
    return tp__error(TP_ERR_INVALID_ARG, "%s: %s in '%s' has dtype %s, the %s is %s%s", fn, what,
                     L->r.meta, tp__ck_dtype_name((tp_dtype)e->dtype),
                     it->kind == TP__CK_PARAM ? "parameter" : "optimizer state",
                     tp_dtype_name(it->dtype),
                     it->kind == TP__CK_PARAM && fl ? " (convert_dtype to convert)" : "");
}

static void tp__ck_what(const tp__ck_item *it, char *what, size_t len)
{
    if (it->kind == TP__CK_PARAM)
        snprintf(what, len, "tensor '%s'", it->fqn);
    else
        snprintf(what, len, "optimizer state '%s' of '%s'", tp__ck_kind_names[it->kind], it->fqn);
}

static tp_tensor *tp__ck_local(const tp_tensor *p)
{
    return tp_tensor_is_dtensor(p) ? tp_dtensor_local(p) : (tp_tensor *)p;
}

/* Item i's entry, parsed and checked against its parameter, into L->ent[i]. */
static tp_status tp__ck_item_entry(tp__ck_loader *L, int i, const char *what)
{
    const tp__ck_item *it = &L->l.it[i];
    tp__ck_entry *e = &L->ent[i];
    TP_CHECK(tp__ck_parse_entry(&L->r, what, L->src[i], e));
    TP_CHECK(tp__ck_check_entry(L, i, what, e));
    int64_t shape[TP_MAX_DIMS], off[TP_MAX_DIMS];
    bool owner;
    TP_CHECK(tp__ck_block(&L->l, it->param, L->l.rank, shape, off, &owner));
    tp_tensor *local = tp__ck_local(it->param);
    int nd = tp_tensor_ndim(it->param);
    if (tp_tensor_ndim(local) != nd ||
        memcmp(tp_tensor_shape(local), shape, (size_t)nd * sizeof *shape))
        return tp__error(TP_ERR_STATE, "%s: %s: the local block of the parameter is not its shard",
                         L->l.fn, what);
    return TP_OK;
}

/* Reads item i (its entry parsed) into *out, a new tensor in the item's
 * dtype on its parameter's device; with `into` (the parameter's local block,
 * CPU, contiguous, of the stored dtype) straight into it instead. */
static tp_status tp__ck_read_value(tp__ck_loader *L, int i, const char *what, tp__ck_read_mode mode,
                                   tp_tensor *into, tp_tensor **out)
{
    const tp__ck_item *it = &L->l.it[i];
    const tp__ck_entry *e = &L->ent[i];
    if (into)
        return tp__ck_read_box(&L->r, &L->l, what, e, it->param, i, mode, tp_tensor_data(into));
    tp_tensor *local = tp__ck_local(it->param), *raw = NULL;
    TP_CHECK(tp_tensor_empty((tp_dtype)e->dtype, TP_CPU, tp_tensor_ndim(local),
                             tp_tensor_shape(local), &raw));
    tp_status st = tp__ck_read_box(&L->r, &L->l, what, e, it->param, i, mode, tp_tensor_data(raw));
    tp_device dev = tp_tensor_device(local);
    if (st == TP_OK && (e->dtype != (int)it->dtype || dev.type != TP_DEVICE_CPU))
        st = tp_tensor_to(raw, it->dtype, dev, out);
    else if (st == TP_OK)
        *out = tp_tensor_retain(raw);
    tp_tensor_release(raw);
    return st;
}

/* Whether parameter item i is read only after the agreement, straight into
 * the parameter (the default: no copy_first), after its blocks' CRCs are checked now. Not
 * when the optimizer's master of it is to be made from the loaded value. */
static bool tp__ck_deferred(const tp__ck_loader *L, int i)
{
    const tp__ck_item *it = &L->l.it[i];
    if (L->o->copy_first || it->kind != TP__CK_PARAM)
        return false;
    if (!L->load_opt || tp_tensor_dtype(it->param) == TP_F32)
        return true;
    bool state = false;
    for (int j = 0; j < L->l.n; j++) {
        if (L->l.it[j].param != it->param)
            continue;
        if (L->l.it[j].kind == TP__CK_MASTER)
            return true;
        state = true;
    }
    return !state;
}

/* Reads item i into L->val[i], or for a deferred one checks its CRCs. */
static tp_status tp__ck_load_item(tp__ck_loader *L, int i)
{
    char what[600];
    tp__ck_what(&L->l.it[i], what, sizeof what);
    TP_CHECK(tp__ck_item_entry(L, i, what));
    if (tp__ck_deferred(L, i))
        return tp__ck_read_value(L, i, what, TP__CK_VERIFY, tp__ck_local(L->l.it[i].param), NULL);
    return tp__ck_read_value(L, i, what, TP__CK_READ_VERIFY, NULL, &L->val[i]);
}

/* In place, after the agreement: deferred item i straight into its
 * parameter (through one block's scratch when it converts or lives on a
 * GPU). */
static tp_status tp__ck_read_in_place(tp__ck_loader *L, int i)
{
    char what[600];
    tp__ck_what(&L->l.it[i], what, sizeof what);
    tp_tensor *local = tp__ck_local(L->l.it[i].param), *v = NULL;
    bool direct = tp_tensor_device(local).type == TP_DEVICE_CPU && tp_tensor_is_contiguous(local) &&
                  (int)tp_tensor_dtype(local) == L->ent[i].dtype;
    if (direct)
        return tp__ck_read_value(L, i, what, TP__CK_READ, local, NULL);
    TP_CHECK(tp__ck_read_value(L, i, what, TP__CK_READ, NULL, &v));
    tp_status st = tp_tensor_copy(local, v);
    tp_tensor_release(v);
    return st;
}

/* The optimizer's new states from the items read. */
static tp_status tp__ck_build_states(tp__ck_loader *L)
{
    tp__ck_list *l = &L->l;
    tp__opt_state *v = tp__calloc((size_t)(l->np ? l->np : 1), sizeof *v);
    tp_tensor **made = tp__calloc((size_t)(l->np ? l->np : 1), sizeof *made);
    tp_status st = v && made ? TP_OK : tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", l->fn);
    int n = 0;
    for (int p = 0; p < l->np && st == TP_OK; p++) {
        if (l->steps[p] < 0)
            continue;
        tp__opt_state *s = &v[n++];
        *s = (tp__opt_state){.fqn = l->fqns[p], .param = l->params[p], .step = l->steps[p]};
        tp_tensor *pval = NULL;
        for (int i = 0; i < l->n; i++) {
            if (l->it[i].param != l->params[p])
                continue;
            tp__ck_kind k = l->it[i].kind;
            if (k == TP__CK_PARAM)
                pval = L->val[i];
            else if (k == TP__CK_MASTER)
                s->master = L->val[i];
            else if (k == TP__CK_EXP_AVG_SQ)
                s->v = L->val[i];
            else
                s->m = L->val[i];
        }
        tp_tensor *local =
            tp_tensor_is_dtensor(l->params[p]) ? tp_dtensor_local(l->params[p]) : l->params[p];
        if (!s->master && tp_tensor_dtype(local) != TP_F32) {
            st = tp_tensor_to(pval ? pval : local, TP_F32, tp_tensor_device(local), &made[p]);
            s->master = made[p];
        }
    }
    if (st == TP_OK)
        st = tp__opt_pending_new(n, v, &L->pending);
    for (int p = 0; made && p < l->np; p++)
        tp_tensor_release(made[p]);
    tp__free(made);
    tp__free(v);
    return st;
}

/* Everything before the agreement. */
static tp_status tp__ck_stage(tp__ck_loader *L, tp_module *m, const char *dir)
{
    TP_CHECK(tp__ck_reader_open(L->l.fn, dir, &L->r));
    TP_CHECK(tp__ck_list_fill(&L->l, m, false));
    L->l.n = 0; /* the items are what the checkpoint holds */
    TP_CHECK(tp__ck_match_model(L));
    TP_CHECK(tp__ck_match_optim(L));
    L->val = tp__calloc((size_t)(L->l.n ? L->l.n : 1), sizeof *L->val);
    L->ent = tp__calloc((size_t)(L->l.n ? L->l.n : 1), sizeof *L->ent);
    if (!L->val || !L->ent)
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", L->l.fn);
    for (int i = 0; i < L->l.n; i++)
        TP_CHECK(tp__ck_load_item(L, i));
    if (L->load_opt)
        TP_CHECK(tp__ck_build_states(L));
    json_t *user = json_object_get(L->r.root, "user");
    for (int i = 0; i < L->o->n_meta; i++) {
        json_t *v = json_object_get(user, L->o->meta[i].key);
        if (v && !json_is_integer(v))
            return tp__error(TP_ERR_INVALID_ARG, "%s: '%s': user metadata '%s' is not an integer",
                             L->l.fn, L->r.meta, L->o->meta[i].key);
    }
    return TP_OK;
}

/* Every rank agreed: the values go in. */
static tp_status tp__ck_commit(tp__ck_loader *L)
{
    tp__ck_list *l = &L->l;
    for (int i = 0; i < l->n; i++) {
        if (!tp__ck_deferred(L, i))
            continue;
        tp_status st = tp__ck_read_in_place(L, i);
        if (st != TP_OK) {
            tp__error_prefix("%s: parameters partly loaded (in place; options.copy_first "
                             "avoids this)",
                             l->fn);
            return st;
        }
    }
    for (int i = 0; i < l->n; i++) {
        if (l->it[i].kind != TP__CK_PARAM || !L->val[i])
            continue;
        tp_tensor *p = l->it[i].param;
        tp_status st = tp_tensor_copy(tp_tensor_is_dtensor(p) ? tp_dtensor_local(p) : p, L->val[i]);
        if (st != TP_OK) {
            tp__error_prefix("%s: committing '%s'", l->fn, l->it[i].fqn);
            return st;
        }
    }
    if (L->load_opt) {
        tp__opt_pending_commit(l->opt, L->pending);
        L->pending = NULL;
        if (l->opt.adam)
            (void)tp_adam_set_lr(l->opt.adam, L->lr); /* checked in tp__ck_match_optim */
        else
            (void)tp_sgd_set_lr(l->opt.sgd, L->lr);
    }
    json_t *user = json_object_get(L->r.root, "user");
    for (int i = 0; i < L->o->n_meta; i++) {
        json_t *v = json_object_get(user, L->o->meta[i].key);
        L->o->meta[i].found = v != NULL;
        if (v)
            L->o->meta[i].value = json_integer_value(v);
    }
    return TP_OK;
}

tp_status tp_checkpoint_load(const char *dir, tp_module *m, const tp_checkpoint_optim *optim,
                             const tp_checkpoint_options *opts)
{
    const char *fn = "tp_checkpoint_load";
    TP_ARG_CHECK(dir && dir[0], "%s: dir is NULL or empty", fn);
    TP_ARG_CHECK(m, "%s: module is NULL", fn);
    tp__ck_loader L = {.o = opts ? opts : &tp__ck_no_options};
    TP_CHECK(tp__ck_list_init(fn, m, optim, opts, &L.l));
    /* from here every rank reaches the agreement, failed or not */
    tp_status st = tp__ck_stage(&L, m, dir);
    st = tp__ck_agree(L.l.comm, st);
    if (st == TP_OK)
        st = tp__ck_commit(&L);
    if (!L.o->copy_first) /* a failure while committing reaches every rank */
        st = tp__ck_agree(L.l.comm, st);
    for (int i = 0; L.val && i < L.l.n; i++)
        tp_tensor_release(L.val[i]);
    tp__free(L.val);
    for (int i = 0; L.ent && i < L.l.n; i++)
        tp__ck_entry_free(&L.ent[i]);
    tp__free(L.ent);
    tp__free(L.src);
    tp__opt_pending_free(L.pending);
    tp__ck_reader_close(&L.r);
    tp__ck_list_free(&L.l);
    return st;
}
