/* The built-in module kinds: creation (zero parameters) and forwards. Each
 * kind's forward is stored in the module's `forward` slot, so
 * tp_module_forward dispatches every kind alike. */
#include <math.h>
#include <string.h>

#include "nn/nn_internal.h"

static tp_status tp__module_new(const char *fn, tp_module_kind kind, const char *type_name,
                                tp_forward_fn forward, tp_module **out)
{
    tp_module *m = tp__calloc(1, sizeof *m);
    if (!m)
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
    m->kind = kind;
    m->type_name = tp__strdup(type_name);
    m->name = tp__strdup("");
    m->forward = forward;
    m->training = true;
    if (!m->type_name || !m->name) {
        tp_module_free(m);
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
    }
    *out = m;
    return TP_OK;
}

static _Thread_local tp_device tp__param_device; /* zero: TP_CPU */

tp_status tp_nn_set_default_device(tp_device device)
{
    const char *fn = "tp_nn_set_default_device";
    switch (device.type) {
    case TP_DEVICE_CPU:
    case TP_DEVICE_META:
        TP_ARG_CHECK(device.index == 0, "%s: %s device index must be 0, got %d", fn,
                     device.type == TP_DEVICE_CPU ? "CPU" : "meta", device.index);
        break;
    case TP_DEVICE_CUDA:
        if (device.index < 0 || device.index >= tp_cuda_device_count())
            return tp__error(TP_ERR_NOT_SUPPORTED, "%s: CUDA device %d unavailable (%d devices)",
                             fn, device.index, tp_cuda_device_count());
        break;
    default:
        return tp__error(TP_ERR_INVALID_ARG, "%s: invalid device type %d", fn, (int)device.type);
    }
    tp__param_device = device;
    return TP_OK;
}

tp_device tp_nn_default_device(void)
{
    return tp__param_device;
}

/* A zero f32 parameter on the thread's default device; present false
 * registers the name as absent. */
static tp_status tp__add_param(tp_module *m, const char *name, bool present, int ndim,
                               const int64_t *shape)
{
    if (!present)
        return tp_module_register_parameter(m, name, NULL);
    tp_tensor *t = NULL;
    TP_CHECK(tp_tensor_zeros(TP_F32, tp__param_device, ndim, shape, &t));
    tp_status st = tp_module_register_parameter(m, name, t);
    tp_tensor_release(t);
    return st;
}

/* Built-in kinds take one positional, non-None input and no keywords. */
static tp_status tp__one_input(const tp_module *m, int nargs, tp_tensor *const *args, int nkw)
{
    const char *fn = "tp_module_forward";
    TP_ARG_CHECK(nargs == 1, "%s: %s takes 1 input, got %d", fn, m->type_name, nargs);
    TP_ARG_CHECK(nkw == 0, "%s: %s takes no keyword inputs, got %d", fn, m->type_name, nkw);
    TP_ARG_CHECK(args[0], "%s: the input of %s is None", fn, m->type_name);
    return TP_OK;
}

#define TP__ONE_INPUT(self)                                                     \
    do {                                                                        \
        (void)kw;                                                               \
        TP_CHECK(tp__one_input((self), nargs, args, nkw));                      \
    } while (0)

/* ---- forwards ---------------------------------------------------------------- */

static tp_status tp__linear_forward(tp_module *self, int nargs, tp_tensor *const *args,
                                    int nkw, const tp_kwarg *kw, tp_tensor **out)
{
    TP__ONE_INPUT(self);
    if (self->cfg.linear.fused_gelu)
        return tp_linear_gelu(args[0], tp_module_parameter(self, "weight"),
                              tp_module_parameter(self, "bias"), self->cfg.linear.gelu, out);
    return tp_linear(args[0], tp_module_parameter(self, "weight"),
                     tp_module_parameter(self, "bias"), out);
}

static tp_status tp__embedding_forward(tp_module *self, int nargs, tp_tensor *const *args,
                                       int nkw, const tp_kwarg *kw, tp_tensor **out)
{
    TP__ONE_INPUT(self);
    return tp_embedding(args[0], tp_module_parameter(self, "weight"), out);
}

static tp_status tp__layer_norm_forward(tp_module *self, int nargs, tp_tensor *const *args,
                                        int nkw, const tp_kwarg *kw, tp_tensor **out)
{
    TP__ONE_INPUT(self);
    return tp_layer_norm(args[0], tp_module_parameter(self, "weight"),
                         tp_module_parameter(self, "bias"), self->cfg.norm.eps, out);
}

static tp_status tp__rms_norm_forward(tp_module *self, int nargs, tp_tensor *const *args,
                                      int nkw, const tp_kwarg *kw, tp_tensor **out)
{
    TP__ONE_INPUT(self);
    return tp_rms_norm(args[0], tp_module_parameter(self, "weight"), self->cfg.norm.eps, out);
}

/* The mask seed advances with every training call, so successive calls draw
 * different masks while every rank (and every parallel degree) agrees on
 * each; evaluation calls do not advance it, as PyTorch's generator does not
 * move in eval mode. */
static tp_status tp__dropout_forward(tp_module *self, int nargs, tp_tensor *const *args,
                                     int nkw, const tp_kwarg *kw, tp_tensor **out)
{
    TP__ONE_INPUT(self);
    bool training = self->training && self->cfg.dropout.p > 0;
    tp_status st = tp_dropout(args[0], self->cfg.dropout.p,
                              self->cfg.dropout.seed + self->cfg.dropout.calls, training, out);
    if (st == TP_OK && training)
        self->cfg.dropout.calls++;
    return st;
}

static tp_status tp__identity_forward(tp_module *self, int nargs, tp_tensor *const *args,
                                      int nkw, const tp_kwarg *kw, tp_tensor **out)
{
    TP__ONE_INPUT(self);
    *out = tp_tensor_retain(args[0]);
    return TP_OK;
}

static tp_status tp__relu_forward(tp_module *self, int nargs, tp_tensor *const *args, int nkw,
                                  const tp_kwarg *kw, tp_tensor **out)
{
    TP__ONE_INPUT(self);
    return tp_relu(args[0], out);
}

static tp_status tp__gelu_forward(tp_module *self, int nargs, tp_tensor *const *args, int nkw,
                                  const tp_kwarg *kw, tp_tensor **out)
{
    TP__ONE_INPUT(self);
    return tp_gelu(args[0], self->cfg.gelu, out);
}

static tp_status tp__silu_forward(tp_module *self, int nargs, tp_tensor *const *args, int nkw,
                                  const tp_kwarg *kw, tp_tensor **out)
{
    TP__ONE_INPUT(self);
    return tp_silu(args[0], out);
}

/* An empty Sequential returns its input, as PyTorch's does. */
static tp_status tp__sequential_forward(tp_module *self, int nargs, tp_tensor *const *args,
                                        int nkw, const tp_kwarg *kw, tp_tensor **out)
{
    TP__ONE_INPUT(self);
    tp_tensor *cur = tp_tensor_retain(args[0]);
    for (int i = 0; i < self->n_children; i++) {
        tp_tensor *next = NULL;
        tp_status st = tp_module_forward(self->children[i], 1, &cur, 0, NULL, &next);
        tp_tensor_release(cur);
        if (st != TP_OK)
            return st;
        cur = next;
    }
    *out = cur;
    return TP_OK;
}

static tp_status tp__container_forward(tp_module *self, int nargs, tp_tensor *const *args,
                                       int nkw, const tp_kwarg *kw, tp_tensor **out)
{
    (void)self, (void)nargs, (void)args, (void)nkw, (void)kw, (void)out;
    return tp__error(TP_ERR_NOT_SUPPORTED,
                     "tp_module_forward: Container has no forward; call its children");
}

/* ---- creation ------------------------------------------------------------------ */

tp_status tp_nn_linear_create(int64_t in_features, int64_t out_features, bool bias, tp_module **out)
{
    const char *fn = "tp_nn_linear_create";
    TP_ARG_CHECK(out, "%s: out is NULL", fn);
    *out = NULL;
    TP_ARG_CHECK(in_features >= 0 && out_features >= 0,
                 "%s: in_features %lld and out_features %lld must be >= 0", fn,
                 (long long)in_features, (long long)out_features);
    tp_module *m = NULL;
    TP_CHECK(tp__module_new(fn, TP_MODULE_LINEAR, "Linear", tp__linear_forward, &m));
    m->cfg.linear.in = in_features;
    m->cfg.linear.out = out_features;
    m->cfg.linear.bias = bias;
    tp_status st = tp__add_param(m, "weight", true, 2, (int64_t[]){out_features, in_features});
    if (st == TP_OK)
        st = tp__add_param(m, "bias", bias, 1, &out_features);
    if (st != TP_OK) {
        tp_module_free(m);
        return st;
    }
    *out = m;
    return TP_OK;
}

tp_status tp_nn_linear_fuse_gelu(tp_module *linear, tp_gelu_approx approx)
{
    const char *fn = "tp_nn_linear_fuse_gelu";
    TP_ARG_CHECK(linear, "%s: linear is NULL", fn);
    TP_ARG_CHECK(linear->kind == TP_MODULE_LINEAR, "%s: the module is a %s, not a Linear", fn,
                 linear->type_name);
    TP_ARG_CHECK(approx == TP_GELU_EXACT || approx == TP_GELU_TANH,
                 "%s: approx %d is neither TP_GELU_EXACT nor TP_GELU_TANH", fn, (int)approx);
    /* a weight split along its input features makes the output a partial
     * sum, whose GELU is not the GELU of the total */
    tp_tensor *w = tp_module_parameter(linear, "weight");
    if (w && tp_tensor_is_dtensor(w)) {
        const tp_placement *pl = tp_dtensor_placements(w);
        int nd = tp_mesh_ndim(tp_dtensor_mesh(w));
        for (int i = 0; i < nd; i++)
            TP_ARG_CHECK(!(pl[i].kind == TP_PLACEMENT_SHARD && pl[i].dim == 1),
                         "%s: the weight is split along its input features (rowwise, mesh dim "
                         "%d): the output is a partial sum, and a GELU cannot follow it fused",
                         fn, i);
    }
    linear->cfg.linear.fused_gelu = true;
    linear->cfg.linear.gelu = approx;
    return TP_OK;
}

bool tp_nn_linear_fused_gelu(const tp_module *m, tp_gelu_approx *approx)
{
    if (!m || m->kind != TP_MODULE_LINEAR || !m->cfg.linear.fused_gelu)
        return false;
    if (approx)
        *approx = m->cfg.linear.gelu;
    return true;
}

tp_status tp_nn_embedding_create(int64_t num, int64_t dim, tp_module **out)
{
    const char *fn = "tp_nn_embedding_create";
    TP_ARG_CHECK(out, "%s: out is NULL", fn);
    *out = NULL;
    TP_ARG_CHECK(num >= 0 && dim >= 0, "%s: num %lld and dim %lld must be >= 0", fn,
                 (long long)num, (long long)dim);
    tp_module *m = NULL;
    TP_CHECK(tp__module_new(fn, TP_MODULE_EMBEDDING, "Embedding", tp__embedding_forward, &m));
    m->cfg.embedding.num = num;
    m->cfg.embedding.dim = dim;
    tp_status st = tp__add_param(m, "weight", true, 2, (int64_t[]){num, dim});
    if (st != TP_OK) {
        tp_module_free(m);
        return st;
    }
    *out = m;
    return TP_OK;
}

static tp_status tp__norm_create(const char *fn, tp_module_kind kind, int64_t dim, bool affine,
                                 double eps, tp_module **out)
{
    TP_ARG_CHECK(out, "%s: out is NULL", fn);
    *out = NULL;
    TP_ARG_CHECK(dim >= 0, "%s: dim %lld must be >= 0", fn, (long long)dim);
    TP_ARG_CHECK(isfinite(eps) && eps >= 0, "%s: eps %g must be finite and >= 0", fn, eps);
    bool layer = kind == TP_MODULE_LAYER_NORM;
    tp_module *m = NULL;
    TP_CHECK(tp__module_new(fn, kind, layer ? "LayerNorm" : "RMSNorm",
                            layer ? tp__layer_norm_forward : tp__rms_norm_forward, &m));
    m->cfg.norm.dim = dim;
    m->cfg.norm.affine = affine;
    m->cfg.norm.eps = eps;
    tp_status st = tp__add_param(m, "weight", affine, 1, &dim);
    if (st == TP_OK && layer)
        st = tp__add_param(m, "bias", affine, 1, &dim);
    if (st != TP_OK) {
        tp_module_free(m);
        return st;
    }
    *out = m;
    return TP_OK;
}

tp_status tp_nn_layer_norm_create(int64_t dim, bool affine, double eps, tp_module **out)
{
    return tp__norm_create("tp_nn_layer_norm_create", TP_MODULE_LAYER_NORM, dim, affine, eps, out);
}

tp_status tp_nn_rms_norm_create(int64_t dim, bool affine, double eps, tp_module **out)
{
    return tp__norm_create("tp_nn_rms_norm_create", TP_MODULE_RMS_NORM, dim, affine, eps, out);
}

tp_status tp_nn_dropout_create(double p, uint64_t seed, tp_module **out)
{
    const char *fn = "tp_nn_dropout_create";
    TP_ARG_CHECK(out, "%s: out is NULL", fn);
    *out = NULL;
    TP_ARG_CHECK(p >= 0 && p < 1, "%s: p %g must be in [0, 1)", fn, p);
    tp_module *m = NULL;
    TP_CHECK(tp__module_new(fn, TP_MODULE_DROPOUT, "Dropout", tp__dropout_forward, &m));
    m->cfg.dropout.p = p;
    m->cfg.dropout.seed = seed;
    *out = m;
    return TP_OK;
}

static tp_status tp__simple_create(const char *fn, tp_module_kind kind, const char *type_name,
                                   tp_forward_fn forward, tp_module **out)
{
    TP_ARG_CHECK(out, "%s: out is NULL", fn);
    *out = NULL;
    return tp__module_new(fn, kind, type_name, forward, out);
}

tp_status tp_nn_identity_create(tp_module **out)
{
    return tp__simple_create("tp_nn_identity_create", TP_MODULE_IDENTITY, "Identity",
                             tp__identity_forward, out);
}

tp_status tp_nn_relu_create(tp_module **out)
{
    return tp__simple_create("tp_nn_relu_create", TP_MODULE_RELU, "ReLU", tp__relu_forward, out);
}

tp_status tp_nn_gelu_create(tp_gelu_approx approx, tp_module **out)
{
    const char *fn = "tp_nn_gelu_create";
    TP_ARG_CHECK(out, "%s: out is NULL", fn);
    *out = NULL;
    TP_ARG_CHECK(approx == TP_GELU_EXACT || approx == TP_GELU_TANH,
                 "%s: approx %d is neither TP_GELU_EXACT nor TP_GELU_TANH", fn, (int)approx);
    TP_CHECK(tp__module_new(fn, TP_MODULE_GELU, "GELU", tp__gelu_forward, out));
    (*out)->cfg.gelu = approx;
    return TP_OK;
}

tp_status tp_nn_silu_create(tp_module **out)
{
    return tp__simple_create("tp_nn_silu_create", TP_MODULE_SILU, "SiLU", tp__silu_forward, out);
}

tp_status tp_nn_sequential_create(tp_module **out)
{
    return tp__simple_create("tp_nn_sequential_create", TP_MODULE_SEQUENTIAL, "Sequential",
                             tp__sequential_forward, out);
}

tp_status tp_nn_container_create(tp_module **out)
{
    return tp__simple_create("tp_nn_container_create", TP_MODULE_CONTAINER, "Container",
                             tp__container_forward, out);
}

/* The type name labels a root's comm-debug scope in tables, so it follows
 * the scope-name rules: non-empty, no '.', not "Global". */
tp_status tp_nn_custom_create(const char *type_name, tp_forward_fn forward, void *ctx,
                              void (*ctx_free)(void *ctx), tp_module **out)
{
    const char *fn = "tp_nn_custom_create";
    TP_ARG_CHECK(out, "%s: out is NULL", fn);
    *out = NULL;
    TP_ARG_CHECK(type_name && type_name[0], "%s: type_name is NULL or empty", fn);
    TP_ARG_CHECK(!strchr(type_name, '.'), "%s: type_name '%s' contains '.'", fn, type_name);
    TP_ARG_CHECK(strcmp(type_name, "Global") != 0, "%s: type_name 'Global' is reserved", fn);
    TP_ARG_CHECK(forward, "%s: forward is NULL", fn);
    tp__ctx_ref *ref = NULL;
    if (ctx_free && !(ref = tp__ctx_ref_new(ctx, ctx_free)))
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
    tp_status st = tp__module_new(fn, TP_MODULE_CUSTOM, type_name, forward, out);
    if (st != TP_OK) {
        tp__free(ref); /* the caller keeps ctx */
        return st;
    }
    (*out)->ctx = ctx;
    (*out)->ctx_ref = ref;
    return TP_OK;
}
