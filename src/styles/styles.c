/* Parallel styles: ColwiseParallel, RowwiseParallel, SequenceParallel,
 * PrepareModuleInput, PrepareModuleOutput and PrepareModuleInputOutput.
 *
 * A style is an immutable value (shared read-only by plan entries). Applying
 * it to a module distributes the module's parameters (the parameter-sharding
 * styles) and installs a forward pre-hook (inputs) and/or a forward hook
 * (output). Each hook owns a private copy of what it needs (tp__hook_ctx),
 * freed by the module through the hook's ctx_free. */
#include <stdio.h>
#include <string.h>

#include "styles/styles_internal.h"

typedef enum tp__style_kind {
    TP__STY_COLWISE = 0,
    TP__STY_ROWWISE,
    TP__STY_SEQUENCE,
    TP__STY_PREP_IN,
    TP__STY_PREP_OUT,
    TP__STY_PREP_INOUT
} tp__style_kind;

/* Colwise and Rowwise options (the same fields), defaults resolved; Rowwise's
 * input layout stays None when not given (its default depends on the
 * module). */
typedef struct tp__io_options {
    tp_layout in, out;
    tp_flag use_local_output;
} tp__io_options;

struct tp_style {
    tp__style_kind kind;
    tp__io_options io; /* Colwise, Rowwise */
    tp_sequence_parallel_options sp;
    tp_prepare_input_options in; /* kwargs[i].name point into kwnames */
    char *kwnames[TP_STYLE_MAX_LAYOUTS];
    tp_prepare_output_options out;
};

static const char *const tp__style_names[] = {
    "ColwiseParallel",    "RowwiseParallel",     "SequenceParallel",
    "PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput",
};

const char *tp__style_name(const tp_style *s)
{
    return s ? tp__style_names[s->kind] : "(null style)";
}

bool tp__style_shards_params(const tp_style *s)
{
    return s && (s->kind == TP__STY_COLWISE || s->kind == TP__STY_ROWWISE ||
                 s->kind == TP__STY_SEQUENCE);
}

/* ---- small helpers ---------------------------------------------------------- */

const char *tp__style_where(const char *fqn, char *buf, size_t len)
{
    if (!fqn || !fqn[0])
        snprintf(buf, len, "the root module");
    else
        snprintf(buf, len, "'%s'", fqn);
    return buf;
}

static tp_status tp__layout_valid(const char *fn, const char *what, tp_layout l, bool desired)
{
    if (!l.set)
        return TP_OK;
    if (l.p.kind != TP_PLACEMENT_REPLICATE && l.p.kind != TP_PLACEMENT_SHARD &&
        l.p.kind != TP_PLACEMENT_PARTIAL)
        return tp__error(TP_ERR_INVALID_ARG, "%s: %s has an invalid placement kind %d", fn, what,
                         (int)l.p.kind);
    if (l.p.kind == TP_PLACEMENT_PARTIAL) {
        if (desired)
            return tp__error(TP_ERR_INVALID_ARG,
                             "%s: %s cannot be Partial (redistributing to Partial is for internal "
                             "use)",
                             fn, what);
        if (l.p.op != TP_SUM && l.p.op != TP_AVG && l.p.op != TP_MAX && l.p.op != TP_MIN)
            return tp__error(TP_ERR_INVALID_ARG, "%s: %s has an invalid Partial op %d", fn, what,
                             (int)l.p.op);
    }
    return TP_OK;
}

/* Placement equality with shard dims normalized against ndim. */
static bool tp__placement_same(tp_placement a, tp_placement b, int ndim)
{
    if (a.kind != b.kind)
        return false;
    if (a.kind == TP_PLACEMENT_SHARD)
        return tp__wrap_dim(a.dim, ndim) == tp__wrap_dim(b.dim, ndim);
    if (a.kind == TP_PLACEMENT_PARTIAL)
        return a.op == b.op;
    return true;
}

static tp_style *tp__style_new(tp__style_kind kind)
{
    tp_style *s = tp__calloc(1, sizeof *s);
    if (s)
        s->kind = kind;
    return s;
}

void tp_style_free(tp_style *s)
{
    if (!s)
        return;
    for (int i = 0; i < TP_STYLE_MAX_LAYOUTS; i++)
        tp__free(s->kwnames[i]);
    tp__free(s);
}

/* ---- creation --------------------------------------------------------------- */

/* Resolves a tp_flag option to its value, or refuses a value that is none of
 * the three. */
static tp_status tp__flag(const char *fn, const char *what, tp_flag *f, bool dflt)
{
    TP_ARG_CHECK(*f == TP_FLAG_DEFAULT || *f == TP_FLAG_TRUE || *f == TP_FLAG_FALSE,
                 "%s: %s is %d; use TP_FLAG_DEFAULT, TP_FLAG_TRUE or TP_FLAG_FALSE", fn, what,
                 (int)*f);
    if (*f == TP_FLAG_DEFAULT)
        *f = dflt ? TP_FLAG_TRUE : TP_FLAG_FALSE;
    return TP_OK;
}

/* Colwise and Rowwise: the options (the style's defaults for unset
 * layouts) checked, resolved and stored in a new style. */
static tp_status tp__io_style_create(tp__style_kind kind, tp__io_options o, tp_layout in_default,
                                     tp_layout out_default, tp_style **out)
{
    const char *fn = tp__style_names[kind];
    TP_ARG_CHECK(out, "%s: out is NULL", fn);
    *out = NULL;
    if (!o.in.set)
        o.in = in_default;
    if (!o.out.set)
        o.out = out_default;
    TP_CHECK(tp__layout_valid(fn, "input_layouts", o.in, false));
    TP_CHECK(tp__layout_valid(fn, "output_layouts", o.out, true));
    TP_CHECK(tp__flag(fn, "use_local_output", &o.use_local_output, true));
    tp_style *s = tp__style_new(kind);
    if (!s)
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
    s->io = o;
    *out = s;
    return TP_OK;
}

tp_status tp_colwise_parallel_create(const tp_colwise_options *opts, tp_style **out)
{
    tp__io_options o = {0};
    if (opts)
        o = (tp__io_options){opts->input_layouts, opts->output_layouts, opts->use_local_output};
    return tp__io_style_create(TP__STY_COLWISE, o, tp_layout_of(tp_replicate()),
                               tp_layout_of(tp_shard(-1)), out);
}

tp_status tp_rowwise_parallel_create(const tp_rowwise_options *opts, tp_style **out)
{
    tp__io_options o = {0};
    if (opts)
        o = (tp__io_options){opts->input_layouts, opts->output_layouts, opts->use_local_output};
    /* input_layouts stays unset when not given: the default depends on the
     * module (Linear S(-1), Embedding R) */
    return tp__io_style_create(TP__STY_ROWWISE, o, tp_layout_none(),
                               tp_layout_of(tp_replicate()), out);
}

tp_status tp_sequence_parallel_create(const tp_sequence_parallel_options *opts, tp_style **out)
{
    const char *fn = "SequenceParallel";
    TP_ARG_CHECK(out, "%s: out is NULL", fn);
    *out = NULL;
    tp_sequence_parallel_options o = {0};
    if (opts)
        o = *opts;
    if (!o.sequence_dim_set && o.sequence_dim == 0)
        o.sequence_dim = 1;
    o.sequence_dim_set = true;
    TP_ARG_CHECK(o.sequence_dim > -TP_MAX_DIMS && o.sequence_dim < TP_MAX_DIMS,
                 "%s: sequence_dim %d is out of range", fn, o.sequence_dim);
    TP_CHECK(tp__flag(fn, "use_local_output", &o.use_local_output, false));
    tp_style *s = tp__style_new(TP__STY_SEQUENCE);
    if (!s)
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
    s->sp = o;
    *out = s;
    return TP_OK;
}

/* n (<what>_layouts[i], desired_<what>_layouts[i]) pairs: both set or both
 * None, and valid. */
static tp_status tp__check_layout_pairs(const char *fn, const char *what, int n,
                                        const tp_layout *l, const tp_layout *want)
{
    for (int i = 0; i < n; i++) {
        char a[64], b[64];
        snprintf(a, sizeof a, "%s_layouts[%d]", what, i);
        snprintf(b, sizeof b, "desired_%s_layouts[%d]", what, i);
        TP_ARG_CHECK(l[i].set == want[i].set, "%s: %s is %s but %s is %s", fn, a,
                     l[i].set ? "set" : "None", b, want[i].set ? "set" : "None");
        TP_CHECK(tp__layout_valid(fn, a, l[i], false));
        TP_CHECK(tp__layout_valid(fn, b, want[i], true));
    }
    return TP_OK;
}

/* Checks *o and resolves its use_local_output. */
static tp_status tp__check_input_opts(const char *fn, tp_prepare_input_options *o)
{
    TP_CHECK(tp__flag(fn, "use_local_output", &o->use_local_output, false));
    TP_ARG_CHECK(o->n_inputs >= 0 && o->n_inputs <= TP_STYLE_MAX_LAYOUTS,
                 "%s: n_inputs %d outside [0, %d]", fn, o->n_inputs, TP_STYLE_MAX_LAYOUTS);
    TP_ARG_CHECK(o->n_desired >= 0 && o->n_desired <= TP_STYLE_MAX_LAYOUTS,
                 "%s: n_desired %d outside [0, %d]", fn, o->n_desired, TP_STYLE_MAX_LAYOUTS);
    TP_ARG_CHECK(o->n_kwargs >= 0 && o->n_kwargs <= TP_STYLE_MAX_LAYOUTS,
                 "%s: n_kwargs %d outside [0, %d]", fn, o->n_kwargs, TP_STYLE_MAX_LAYOUTS);
    TP_ARG_CHECK(o->n_inputs == o->n_desired,
                 "%s: input_layouts and desired_input_layouts should have same length "
                 "(%d input_layouts, %d desired_input_layouts)",
                 fn, o->n_inputs, o->n_desired);
    TP_CHECK(tp__check_layout_pairs(fn, "input", o->n_inputs, o->input_layouts,
                                    o->desired_input_layouts));
    for (int i = 0; i < o->n_kwargs; i++) {
        const tp_kwarg_layout *k = &o->kwargs[i];
        TP_ARG_CHECK(k->name && k->name[0], "%s: kwargs[%d] has no name", fn, i);
        for (int j = 0; j < i; j++)
            TP_ARG_CHECK(strcmp(o->kwargs[j].name, k->name) != 0,
                         "%s: keyword input '%s' is listed twice", fn, k->name);
        TP_ARG_CHECK(k->layout.set == k->desired.set,
                     "%s: input_kwarg_layouts and desired_input_kwarg_layouts should have same "
                     "length ('%s' has %s)",
                     fn, k->name,
                     k->layout.set ? "an input layout but no desired layout"
                                   : "a desired layout but no input layout");
        char what[96];
        snprintf(what, sizeof what, "input_kwarg_layouts['%.60s']", k->name);
        TP_CHECK(tp__layout_valid(fn, what, k->layout, false));
        snprintf(what, sizeof what, "desired_input_kwarg_layouts['%.60s']", k->name);
        TP_CHECK(tp__layout_valid(fn, what, k->desired, true));
    }
    return TP_OK;
}

/* Checks *o and resolves its use_local_output. */
static tp_status tp__check_output_opts(const char *fn, tp_prepare_output_options *o)
{
    TP_CHECK(tp__flag(fn, "use_local_output", &o->use_local_output, true));
    TP_ARG_CHECK(o->n_outputs >= 0 && o->n_outputs <= TP_STYLE_MAX_LAYOUTS,
                 "%s: n_outputs %d outside [0, %d]", fn, o->n_outputs, TP_STYLE_MAX_LAYOUTS);
    TP_ARG_CHECK(o->n_desired >= 0 && o->n_desired <= TP_STYLE_MAX_LAYOUTS,
                 "%s: n_desired %d outside [0, %d]", fn, o->n_desired, TP_STYLE_MAX_LAYOUTS);
    TP_ARG_CHECK(o->n_outputs == o->n_desired,
                 "%s: output_layouts and desired_output_layouts should have same length "
                 "(%d output_layouts, %d desired_output_layouts)",
                 fn, o->n_outputs, o->n_desired);
    TP_ARG_CHECK(o->n_outputs >= 1, "%s: output_layouts is required (n_outputs is 0)", fn);
    TP_ARG_CHECK(o->n_outputs == 1,
                 "%s: module outputs and output_layouts should have same length (a module "
                 "returns one tensor; got %d output_layouts)",
                 fn, o->n_outputs);
    return tp__check_layout_pairs(fn, "output", o->n_outputs, o->output_layouts,
                                  o->desired_output_layouts);
}

/* Copies input options (kwarg names included) into s. */
static tp_status tp__style_set_input(tp_style *s, const char *fn,
                                     const tp_prepare_input_options *o)
{
    s->in = *o;
    for (int i = 0; i < o->n_kwargs; i++) {
        s->kwnames[i] = tp__strdup(o->kwargs[i].name);
        if (!s->kwnames[i])
            return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
        s->in.kwargs[i].name = s->kwnames[i];
    }
    for (int i = o->n_kwargs; i < TP_STYLE_MAX_LAYOUTS; i++)
        s->in.kwargs[i].name = NULL;
    return TP_OK;
}

tp_status tp_prepare_module_input_create(const tp_prepare_input_options *opts, tp_style **out)
{
    const char *fn = "PrepareModuleInput";
    TP_ARG_CHECK(out, "%s: out is NULL", fn);
    *out = NULL;
    tp_prepare_input_options o = {0};
    if (opts)
        o = *opts;
    TP_CHECK(tp__check_input_opts(fn, &o));
    tp_style *s = tp__style_new(TP__STY_PREP_IN);
    if (!s)
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
    tp_status st = tp__style_set_input(s, fn, &o);
    if (st != TP_OK) {
        tp_style_free(s);
        return st;
    }
    *out = s;
    return TP_OK;
}

tp_status tp_prepare_module_output_create(const tp_prepare_output_options *opts, tp_style **out)
{
    const char *fn = "PrepareModuleOutput";
    TP_ARG_CHECK(out, "%s: out is NULL", fn);
    *out = NULL;
    TP_ARG_CHECK(opts, "%s: options are required (output_layouts, desired_output_layouts)", fn);
    tp_prepare_output_options o = *opts;
    TP_CHECK(tp__check_output_opts(fn, &o));
    tp_style *s = tp__style_new(TP__STY_PREP_OUT);
    if (!s)
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
    s->out = o;
    *out = s;
    return TP_OK;
}

tp_status tp_prepare_module_input_output_create(const tp_prepare_input_options *in,
                                                const tp_prepare_output_options *out_opts,
                                                tp_style **out)
{
    const char *fn = "PrepareModuleInputOutput";
    TP_ARG_CHECK(out, "%s: out is NULL", fn);
    *out = NULL;
    tp_prepare_input_options i = {0};
    if (in)
        i = *in;
    TP_ARG_CHECK(out_opts, "%s: output options are required", fn);
    tp_prepare_output_options o = *out_opts;
    TP_CHECK(tp__check_input_opts(fn, &i));
    TP_CHECK(tp__check_output_opts(fn, &o));
    tp_style *s = tp__style_new(TP__STY_PREP_INOUT);
    if (!s)
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
    tp_status st = tp__style_set_input(s, fn, &i);
    if (st != TP_OK) {
        tp_style_free(s);
        return st;
    }
    s->out = o;
    *out = s;
    return TP_OK;
}

/* ---- hooks ------------------------------------------------------------------ */

typedef enum tp__out_mode {
    TP__OUT_NONE = 0,
    TP__OUT_STYLE,     /* Colwise/Rowwise: the op's layout -> out_to */
    TP__OUT_PREPARE,   /* PrepareModuleOutput: out_from -> out_to */
    TP__OUT_LOCAL_ONLY /* SequenceParallel(use_local_output) */
} tp__out_mode;

typedef struct tp__hook_ctx {
    const char *style; /* static name */
    tp_mesh *mesh;     /* holds a reference: the caller may free the mesh first */
    char *fqn;         /* owned */
    /* inputs */
    int n_in; /* -1: positional inputs are not checked */
    tp_layout in[TP_STYLE_MAX_LAYOUTS], want[TP_STYLE_MAX_LAYOUTS];
    int n_kw;
    char *kwname[TP_STYLE_MAX_LAYOUTS]; /* owned */
    tp_layout kwin[TP_STYLE_MAX_LAYOUTS], kwwant[TP_STYLE_MAX_LAYOUTS];
    bool in_local;   /* hand the module local tensors */
    bool none_error; /* a None input is an error (parameter styles) */
    /* output */
    tp__out_mode out_mode;
    tp_layout out_from, out_to;
    bool out_local;
} tp__hook_ctx;

static void tp__hook_ctx_free(void *p)
{
    tp__hook_ctx *c = p;
    if (!c)
        return;
    tp__free(c->fqn);
    for (int i = 0; i < TP_STYLE_MAX_LAYOUTS; i++)
        tp__free(c->kwname[i]);
    tp_mesh_free(c->mesh);
    tp__free(c);
}

static tp__hook_ctx *tp__hook_ctx_new(const tp_style *s, tp_mesh *mesh, const char *fqn)
{
    tp__hook_ctx *c = tp__calloc(1, sizeof *c);
    if (!c)
        return NULL;
    c->style = tp__style_name(s);
    c->mesh = tp_mesh_retain(mesh);
    c->fqn = tp__strdup(fqn ? fqn : "");
    if (!c->fqn) {
        tp__hook_ctx_free(c);
        return NULL;
    }
    c->n_in = -1;
    return c;
}

/* Redistributes *t (a DTensor; reference replaced) to p unless it already has
 * it. */
static tp_status tp__to_placement(tp_tensor **t, tp_placement p)
{
    const tp_placement *cur = tp_dtensor_placements(*t);
    if (cur && tp__placement_same(cur[0], p, tp_tensor_ndim(*t)))
        return TP_OK;
    tp_tensor *r = NULL;
    TP_CHECK(tp_dtensor_redistribute(*t, 1, &p, &r));
    tp_tensor_release(*t);
    *t = r;
    return TP_OK;
}

/* Which input a message names: positional input `index`, or the keyword
 * input `kw` when it is not NULL. Formatted only for a message: the hooks
 * run on every forward. */
typedef struct {
    int index;
    const char *kw;
} tp__input_name;

static const char *tp__input_what(tp__input_name n, char *buf, size_t len)
{
    if (n.kw)
        snprintf(buf, len, "input_kwarg_layouts['%.60s']", n.kw);
    else
        snprintf(buf, len, "input_layouts[%d]", n.index);
    return buf;
}

/* Prepares one input in place: *slot is a borrowed-by-the-array reference
 * (release the old, store a new one). `name` names it for messages. */
static tp_status tp__prepare_input(const tp__hook_ctx *c, tp_module *m, tp_tensor **slot,
                                   tp_layout in, tp_layout want, tp__input_name name)
{
    char wb[300], what[96];
    tp_tensor *x = *slot;
    if (!in.set)
        return TP_OK;
    if (!x) {
        if (c->none_error)
            return tp__error(TP_ERR_INVALID_ARG,
                             "%s at %s: expecting the input of %s to be a tensor or DTensor, "
                             "got None",
                             c->style, tp__style_where(c->fqn, wb, sizeof wb),
                             tp_module_type_name(m));
        return tp__error(TP_ERR_INVALID_ARG, "%s at %s: %s is set but the input is None",
                         c->style, tp__style_where(c->fqn, wb, sizeof wb),
                         tp__input_what(name, what, sizeof what));
    }
    tp_tensor *dt = NULL;
    tp_status st;
    if (tp_tensor_is_dtensor(x)) {
        TP_ARG_CHECK(tp_mesh_ndim(tp_dtensor_mesh(x)) == 1,
                     "%s at %s: input is a DTensor on a %d-d mesh; styles work on 1-d meshes",
                     c->style, tp__style_where(c->fqn, wb, sizeof wb),
                     tp_mesh_ndim(tp_dtensor_mesh(x)));
        dt = tp_tensor_retain(x);
        /* a DTensor whose layout differs from the declared one is first
         * brought to it (as PyTorch does) */
        st = tp__to_placement(&dt, in.p);
    } else {
        /* A Linear knows the global size of its feature dim, so a plain input
         * sharded on it may hold uneven shards (in_features not divisible by
         * the mesh); elsewhere shards are taken to be even, as in PyTorch. */
        tp_from_local_options fo = {0};
        int64_t global[TP_MAX_DIMS];
        int nd = tp_tensor_ndim(x);
        if (tp_module_kind_of(m) == TP_MODULE_LINEAR && in.p.kind == TP_PLACEMENT_SHARD &&
            nd >= 1 && (in.p.dim == -1 || in.p.dim == nd - 1)) {
            memcpy(global, tp_tensor_shape(x), sizeof(int64_t) * (size_t)nd);
            global[nd - 1] = tp__module_linear_in(m);
            fo.global_shape = global;
        }
        st = tp_dtensor_from_local(c->mesh, x, 1, &in.p, &fo, &dt);
    }
    if (st == TP_OK && want.set)
        st = tp__to_placement(&dt, want.p);
    if (st == TP_OK && c->in_local) {
        tp_tensor *loc = NULL;
        st = tp_dtensor_to_local(dt, 0, NULL, &loc);
        if (st == TP_OK) {
            tp_tensor_release(dt);
            dt = loc;
        }
    }
    if (st != TP_OK) {
        tp_tensor_release(dt);
        tp__error_prefix("%s at %s: %s", c->style, tp__style_where(c->fqn, wb, sizeof wb),
                         tp__input_what(name, what, sizeof what));
        return st;
    }
    tp_tensor_release(*slot);
    *slot = dt;
    return TP_OK;
}

static tp_status tp__pre_hook(tp_module *m, int nargs, tp_tensor **args, int nkw, tp_kwarg *kw,
                              void *ctx)
{
    const tp__hook_ctx *c = ctx;
    char wb[300];
    if (c->n_in >= 0 && nargs != c->n_in)
        return tp__error(TP_ERR_INVALID_ARG,
                         "%s at %s: module inputs and input_layouts should have same length "
                         "(got %d inputs, %d input_layouts)",
                         c->style, tp__style_where(c->fqn, wb, sizeof wb), nargs, c->n_in);
    if (c->n_in > 0)
        for (int i = 0; i < nargs; i++) {
            const tp__input_name name = {i, NULL};
            TP_CHECK(tp__prepare_input(c, m, &args[i], c->in[i], c->want[i], name));
        }
    for (int k = 0; k < c->n_kw; k++) {
        for (int j = 0; j < nkw; j++) {
            if (!kw[j].name || strcmp(kw[j].name, c->kwname[k]) != 0)
                continue;
            if (!kw[j].value) /* an absent or None keyword input passes */
                break;
            const tp__input_name name = {0, c->kwname[k]};
            TP_CHECK(tp__prepare_input(c, m, &kw[j].value, c->kwin[k], c->kwwant[k], name));
            break;
        }
    }
    return TP_OK;
}

static tp_status tp__post_hook(tp_module *m, int nargs, tp_tensor *const *args, tp_tensor **out,
                               void *ctx)
{
    (void)m;
    (void)nargs;
    (void)args;
    const tp__hook_ctx *c = ctx;
    char wb[300];
    tp_tensor *y = *out;
    if (c->out_mode == TP__OUT_NONE)
        return TP_OK;
    if (c->out_mode == TP__OUT_LOCAL_ONLY) {
        if (!y || !tp_tensor_is_dtensor(y))
            return TP_OK;
        tp_tensor *loc = NULL;
        TP_CHECK(tp_dtensor_to_local(y, 0, NULL, &loc));
        tp_tensor_release(*out);
        *out = loc;
        return TP_OK;
    }
    if (!c->out_from.set) /* PrepareModuleOutput with a None layout */
        return TP_OK;
    if (!y)
        return tp__error(TP_ERR_INVALID_ARG, "%s at %s: output_layouts[0] is set but the output "
                                             "is None",
                         c->style, tp__style_where(c->fqn, wb, sizeof wb));
    tp_tensor *dt = NULL;
    tp_status st = TP_OK;
    if (tp_tensor_is_dtensor(y)) {
        dt = tp_tensor_retain(y);
        if (c->out_mode == TP__OUT_PREPARE)
            st = tp__to_placement(&dt, c->out_from.p);
    } else {
        st = tp_dtensor_from_local(c->mesh, y, 1, &c->out_from.p, NULL, &dt);
    }
    if (st == TP_OK && c->out_to.set)
        st = tp__to_placement(&dt, c->out_to.p);
    if (st == TP_OK && c->out_local) {
        tp_tensor *loc = NULL;
        st = tp_dtensor_to_local(dt, 0, NULL, &loc);
        if (st == TP_OK) {
            tp_tensor_release(dt);
            dt = loc;
        }
    }
    if (st != TP_OK) {
        tp_tensor_release(dt);
        tp__error_prefix("%s at %s: output", c->style, tp__style_where(c->fqn, wb, sizeof wb));
        return st;
    }
    tp_tensor_release(*out);
    *out = dt;
    return TP_OK;
}

/* ---- applying ---------------------------------------------------------------- */

/* The key of the name of the parameter-sharding style applied to a module:
 * a second one on the same module is an error. */
static const char tp__sharded_by_key;

const char *tp__style_sharded_by(const tp_module *m)
{
    return tp__module_attached(m, &tp__sharded_by_key);
}

static tp_status tp__set_sharded_by(tp_module *m, const tp_style *s)
{
    /* a static name: nothing to free */
    return tp__module_attach(m, &tp__sharded_by_key, (void *)tp__style_name(s), NULL);
}

tp_status tp__style_check(const tp_style *s, const tp_module *m, const char *fqn)
{
    char wb[300];
    if (s->kind != TP__STY_COLWISE && s->kind != TP__STY_ROWWISE)
        return TP_OK;
    tp_module_kind k = tp_module_kind_of(m);
    if (s->kind == TP__STY_ROWWISE && tp_nn_linear_fused_gelu(m, NULL))
        return tp__error(TP_ERR_INVALID_ARG,
                         "RowwiseParallel cannot shard a Linear with a fused GELU at %s: its "
                         "output would be a partial sum, and the GELU of partial sums is not the "
                         "GELU of their total",
                         tp__style_where(fqn, wb, sizeof wb));
    if (k == TP_MODULE_LINEAR || k == TP_MODULE_EMBEDDING)
        return TP_OK;
    return tp__error(TP_ERR_INVALID_ARG, "%s only supports Linear and Embedding, got %s at %s",
                     tp__style_name(s), tp_module_type_name(m), tp__style_where(fqn, wb, sizeof wb));
}

static tp_status tp__distribute_param(tp_module *m, const char *name, tp_placement p,
                                      tp_mesh *mesh, int src, const char *style,
                                      const char *fqn)
{
    tp_tensor *param = tp_module_parameter(m, name);
    if (!param) /* absent optional parameter (bias=false) */
        return TP_OK;
    char wb[300];
    tp_tensor *dt = NULL;
    tp_status st = tp_dtensor_distribute(mesh, param, 1, &p, src, &dt);
    if (st == TP_OK)
        st = tp_module_set_parameter(m, name, dt);
    tp_tensor_release(dt);
    if (st != TP_OK)
        tp__error_prefix("%s at %s: parameter '%s'", style, tp__style_where(fqn, wb, sizeof wb), name);
    return st;
}

/* SequenceParallel: every plain parameter of m and its descendants becomes a
 * Replicate DTensor, without communication. */
static tp_status tp__replicate_params(tp_module *m, tp_mesh *mesh, const char *fqn)
{
    for (int i = 0; i < tp__module_num_params(m); i++) {
        const char *name = NULL;
        tp_tensor *p = tp__module_param_at(m, i, &name);
        if (!p || tp_tensor_is_dtensor(p))
            continue;
        TP_CHECK(tp__distribute_param(m, name, tp_replicate(), mesh, -1, "SequenceParallel", fqn));
    }
    for (int i = 0; i < tp_module_num_children(m); i++)
        TP_CHECK(tp__replicate_params(tp_module_child_at(m, i, NULL), mesh, fqn));
    return TP_OK;
}

static tp_status tp__add_pre(tp_module *m, tp__hook_ctx *c)
{
    tp_status st = tp_module_add_forward_pre_hook(m, tp__pre_hook, c, tp__hook_ctx_free, NULL);
    if (st != TP_OK)
        tp__hook_ctx_free(c);
    return st;
}

static tp_status tp__add_post(tp_module *m, tp__hook_ctx *c)
{
    tp_status st = tp_module_add_forward_hook(m, tp__post_hook, c, tp__hook_ctx_free, NULL);
    if (st != TP_OK)
        tp__hook_ctx_free(c);
    return st;
}

static tp_status tp__copy_input_ctx(tp__hook_ctx *c, const tp_prepare_input_options *o)
{
    c->n_in = o->n_inputs > 0 ? o->n_inputs : -1; /* no input_layouts: not checked */
    for (int i = 0; i < o->n_inputs; i++) {
        c->in[i] = o->input_layouts[i];
        c->want[i] = o->desired_input_layouts[i];
    }
    c->n_kw = o->n_kwargs;
    for (int k = 0; k < o->n_kwargs; k++) {
        c->kwname[k] = tp__strdup(o->kwargs[k].name);
        if (!c->kwname[k])
            return tp__error(TP_ERR_NO_MEMORY, "out of memory");
        c->kwin[k] = o->kwargs[k].layout;
        c->kwwant[k] = o->kwargs[k].desired;
    }
    c->in_local = o->use_local_output == TP_FLAG_TRUE;
    return TP_OK;
}

static tp_status tp__apply_prepare_input(const tp_style *s, tp_module *m, const char *fqn,
                                         tp_mesh *mesh)
{
    tp__hook_ctx *c = tp__hook_ctx_new(s, mesh, fqn);
    if (!c)
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", tp__style_name(s));
    tp_status st = tp__copy_input_ctx(c, &s->in);
    if (st != TP_OK) {
        tp__hook_ctx_free(c);
        return st;
    }
    return tp__add_pre(m, c);
}

static tp_status tp__apply_prepare_output(const tp_style *s, tp_module *m, const char *fqn,
                                          tp_mesh *mesh)
{
    tp__hook_ctx *c = tp__hook_ctx_new(s, mesh, fqn);
    if (!c)
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", tp__style_name(s));
    c->out_mode = TP__OUT_PREPARE;
    c->out_from = s->out.output_layouts[0];
    c->out_to = s->out.desired_output_layouts[0];
    c->out_local = s->out.use_local_output == TP_FLAG_TRUE;
    return tp__add_post(m, c);
}

/* Installs the input and output hooks of a parameter-sharding style. */
static tp_status tp__apply_io(const tp_style *s, tp_module *m, const char *fqn, tp_mesh *mesh,
                              tp_layout in, tp_layout want, tp__out_mode mode,
                              tp_layout out_from, tp_layout out_to, bool out_local)
{
    tp__hook_ctx *c = tp__hook_ctx_new(s, mesh, fqn);
    if (!c)
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", tp__style_name(s));
    c->n_in = 1;
    c->in[0] = in;
    c->want[0] = want;
    c->none_error = true;
    TP_CHECK(tp__add_pre(m, c));
    if (mode == TP__OUT_NONE)
        return TP_OK;
    c = tp__hook_ctx_new(s, mesh, fqn);
    if (!c)
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", tp__style_name(s));
    c->out_mode = mode;
    c->out_from = out_from;
    c->out_to = out_to;
    c->out_local = out_local;
    return tp__add_post(m, c);
}

tp_status tp__style_apply(const tp_style *s, tp_module *m, const char *fqn, tp_mesh *mesh,
                          int src_data_rank)
{
    char wb[300];
    TP_CHECK(tp__style_check(s, m, fqn));
    const char *prev = tp__style_sharded_by(m);
    if (tp__style_shards_params(s) && prev)
        return tp__error(TP_ERR_INVALID_ARG,
                         "tp_parallelize_module: module %s is already sharded by %s; cannot "
                         "also apply %s",
                         tp__style_where(fqn, wb, sizeof wb), prev, tp__style_name(s));
    int src = src_data_rank < 0 ? -1 : src_data_rank;
    bool emb = tp_module_kind_of(m) == TP_MODULE_EMBEDDING;
    switch (s->kind) {
    case TP__STY_COLWISE: {
        const char *name = tp__style_name(s);
        if (emb) {
            TP_CHECK(tp__distribute_param(m, "weight", tp_shard(1), mesh, src, name, fqn));
        } else {
            TP_CHECK(tp__distribute_param(m, "weight", tp_shard(0), mesh, src, name, fqn));
            TP_CHECK(tp__distribute_param(m, "bias", tp_shard(0), mesh, src, name, fqn));
        }
        TP_CHECK(tp__set_sharded_by(m, s));
        return tp__apply_io(s, m, fqn, mesh, s->io.in, tp_layout_of(tp_replicate()),
                            TP__OUT_STYLE, tp_layout_of(tp_shard(-1)), s->io.out,
                            s->io.use_local_output == TP_FLAG_TRUE);
    }
    case TP__STY_ROWWISE: {
        const char *name = tp__style_name(s);
        tp_layout want;
        if (emb) {
            TP_CHECK(tp__distribute_param(m, "weight", tp_shard(0), mesh, src, name, fqn));
            want = tp_layout_of(tp_replicate());
        } else {
            TP_CHECK(tp__distribute_param(m, "weight", tp_shard(1), mesh, src, name, fqn));
            TP_CHECK(tp__distribute_param(m, "bias", tp_replicate(), mesh, src, name, fqn));
            want = tp_layout_of(tp_shard(-1));
        }
        TP_CHECK(tp__set_sharded_by(m, s));
        tp_layout in = s->io.in.set ? s->io.in : want;
        return tp__apply_io(s, m, fqn, mesh, in, want, TP__OUT_STYLE,
                            tp_layout_of(tp_partial(TP_SUM)), s->io.out,
                            s->io.use_local_output == TP_FLAG_TRUE);
    }
    case TP__STY_SEQUENCE: {
        TP_CHECK(tp__replicate_params(m, mesh, fqn));
        TP_CHECK(tp__set_sharded_by(m, s));
        tp_layout l = tp_layout_of(tp_shard(s->sp.sequence_dim));
        return tp__apply_io(s, m, fqn, mesh, l, l,
                            s->sp.use_local_output == TP_FLAG_TRUE ? TP__OUT_LOCAL_ONLY : TP__OUT_NONE,
                            tp_layout_none(), tp_layout_none(), true);
    }
    case TP__STY_PREP_IN:
        return tp__apply_prepare_input(s, m, fqn, mesh);
    case TP__STY_PREP_OUT:
        return tp__apply_prepare_output(s, m, fqn, mesh);
    case TP__STY_PREP_INOUT:
        TP_CHECK(tp__apply_prepare_input(s, m, fqn, mesh));
        return tp__apply_prepare_output(s, m, fqn, mesh);
    }
    return tp__error(TP_ERR_INVALID_ARG, "invalid style");
}
