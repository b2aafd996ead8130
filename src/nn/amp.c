/* Loss scaling for f16 training (torch.amp.GradScaler): the scale and its
 * schedule, the inf/NaN check agreed over a comm, and optimizer steps that
 * are skipped on overflow. The unscaling itself happens inside the
 * optimizer step (optim.c), in f32, as the gradients are read. */
#include <math.h>

#include "collectives/comm_ref.h"
#include "nn/nn_internal.h"

struct tp_grad_scaler {
    tp_comm *comm; /* a reference; NULL: no agreement */
    double scale, growth_factor, backoff_factor;
    int growth_interval;
    int growth_tracker; /* good steps since the last growth or backoff */
    bool checked;       /* this step's inf check ran (unscale) */
    bool found_inf;     /* its agreed result */
};

tp_status tp_grad_scaler_create(tp_comm *comm, const tp_grad_scaler_options *opts,
                                tp_grad_scaler **out)
{
    const char *fn = "tp_grad_scaler_create";
    TP_ARG_CHECK(out, "%s: out is NULL", fn);
    *out = NULL;
    tp_grad_scaler_options o = opts ? *opts : (tp_grad_scaler_options){0};
    TP_ARG_CHECK(isfinite(o.init_scale) && o.init_scale >= 0,
                 "%s: init_scale %g must be finite and > 0 (0: the default 65536)", fn,
                 o.init_scale);
    TP_ARG_CHECK(isfinite(o.growth_factor) && (o.growth_factor == 0 || o.growth_factor > 1),
                 "%s: growth_factor %g must be finite and > 1 (0: the default 2)", fn,
                 o.growth_factor);
    TP_ARG_CHECK(o.backoff_factor >= 0 && o.backoff_factor < 1,
                 "%s: backoff_factor %g must be in (0, 1) (0: the default 0.5)", fn,
                 o.backoff_factor);
    TP_ARG_CHECK(o.growth_interval >= 0, "%s: growth_interval %d must be > 0 (0: the default 2000)",
                 fn, o.growth_interval);
    tp_grad_scaler *gs = tp__calloc(1, sizeof *gs);
    if (!gs)
        return tp__error(TP_ERR_NO_MEMORY, "%s: out of memory", fn);
    gs->comm = tp__comm_retain(comm);
    gs->scale = o.init_scale ? o.init_scale : 65536.0;
    gs->growth_factor = o.growth_factor ? o.growth_factor : 2.0;
    gs->backoff_factor = o.backoff_factor ? o.backoff_factor : 0.5;
    gs->growth_interval = o.growth_interval ? o.growth_interval : 2000;
    *out = gs;
    return TP_OK;
}

void tp_grad_scaler_free(tp_grad_scaler *gs)
{
    if (!gs)
        return;
    tp__comm_release(gs->comm);
    tp__free(gs);
}

tp_status tp_grad_scaler_scale(tp_grad_scaler *gs, tp_tensor *loss, tp_tensor **out)
{
    const char *fn = "tp_grad_scaler_scale";
    TP_ARG_CHECK(out, "%s: out is NULL", fn);
    *out = NULL;
    TP_ARG_CHECK(gs, "%s: scaler is NULL", fn);
    TP_ARG_CHECK(loss, "%s: loss is NULL", fn);
    tp_status st = tp_scale(loss, gs->scale, out);
    if (st != TP_OK)
        tp__error_prefix("%s", fn);
    return st;
}

/* The device the flag travels on: where m's parameters live (a GPU backend
 * moves device memory only). */
static tp_device tp__flag_device(const tp_module *m)
{
    tp_device d = tp_module_device(m);
    return d.type == TP_DEVICE_CUDA ? d : TP_CPU;
}

/* All-reduces (max) the found flag over the comm: every rank then skips the
 * same steps. */
static tp_status tp__agree(tp_grad_scaler *gs, const tp_module *m, bool *found)
{
    if (!gs->comm)
        return TP_OK;
    float v = *found ? 1.0f : 0.0f;
    int64_t one = 1;
    tp_device dev = tp__flag_device(m);
    tp_tensor *h = NULL, *t = NULL;
    TP_CHECK(tp_tensor_from_blob(TP_F32, TP_CPU, 1, &one, &v, NULL, NULL, &h));
    tp_status st = dev.type == TP_DEVICE_CPU ? (t = tp_tensor_retain(h), TP_OK)
                                             : tp_tensor_to(h, TP_F32, dev, &t);
    if (st == TP_OK)
        st = tp_all_reduce(gs->comm, t, t, TP_MAX, NULL);
    if (st == TP_OK && t != h)
        st = tp_tensor_copy(h, t);
    tp_tensor_release(t);
    tp_tensor_release(h);
    if (st == TP_OK)
        *found = v != 0.0f;
    return st;
}

tp_status tp_grad_scaler_unscale(tp_grad_scaler *gs, tp_module *m, bool *found_inf)
{
    const char *fn = "tp_grad_scaler_unscale";
    if (found_inf)
        *found_inf = false;
    TP_ARG_CHECK(gs, "%s: scaler is NULL", fn);
    TP_ARG_CHECK(m, "%s: module is NULL", fn);
    if (gs->checked)
        return tp__error(TP_ERR_STATE, "%s: already unscaled since the last tp_grad_scaler_update",
                         fn);
    /* the gradients are final only after the step pre-hooks (a DDP's
     * all_reduces); the optimizer runs them again, which is a no-op then */
    TP_CHECK(tp__module_run_step_hooks(m));
    bool found = false;
    TP_CHECK(tp__grads_nonfinite(fn, m, &found));
    tp_status st = tp__agree(gs, m, &found);
    if (st != TP_OK) {
        tp__error_prefix("%s: agreeing on the inf/NaN check", fn);
        return st;
    }
    gs->checked = true;
    gs->found_inf = found;
    if (found_inf)
        *found_inf = found;
    return TP_OK;
}

/* The checks shared by the two steps; *skip: an inf/NaN was found. */
static tp_status tp__step_begin(const char *fn, tp_grad_scaler *gs, const void *opt, tp_module *m,
                                bool *stepped, bool *skip)
{
    if (stepped)
        *stepped = false;
    TP_ARG_CHECK(gs, "%s: scaler is NULL", fn);
    TP_ARG_CHECK(opt, "%s: optimizer is NULL", fn);
    if (!gs->checked)
        TP_CHECK(tp_grad_scaler_unscale(gs, m, NULL));
    *skip = gs->found_inf;
    return TP_OK;
}

tp_status tp_grad_scaler_step_adam(tp_grad_scaler *gs, tp_adam *opt, bool *stepped)
{
    bool skip = true;
    TP_CHECK(tp__step_begin("tp_grad_scaler_step_adam", gs, opt, opt ? tp__adam_module(opt) : NULL,
                            stepped, &skip));
    if (skip)
        return TP_OK;
    TP_CHECK(tp__adam_step_scaled(opt, (float)(1.0 / gs->scale)));
    if (stepped)
        *stepped = true;
    return TP_OK;
}

tp_status tp_grad_scaler_step_sgd(tp_grad_scaler *gs, tp_sgd *opt, bool *stepped)
{
    bool skip = true;
    TP_CHECK(tp__step_begin("tp_grad_scaler_step_sgd", gs, opt, opt ? tp__sgd_module(opt) : NULL,
                            stepped, &skip));
    if (skip)
        return TP_OK;
    TP_CHECK(tp__sgd_step_scaled(opt, (float)(1.0 / gs->scale)));
    if (stepped)
        *stepped = true;
    return TP_OK;
}

/* torch's _amp_update_scale_. */
tp_status tp_grad_scaler_update(tp_grad_scaler *gs)
{
    const char *fn = "tp_grad_scaler_update";
    TP_ARG_CHECK(gs, "%s: scaler is NULL", fn);
    if (!gs->checked)
        return tp__error(TP_ERR_STATE,
                         "%s: no inf check ran since the last update (call "
                         "tp_grad_scaler_unscale or a tp_grad_scaler_step_* first)",
                         fn);
    if (gs->found_inf) {
        gs->scale *= gs->backoff_factor;
        gs->growth_tracker = 0;
    } else if (++gs->growth_tracker == gs->growth_interval) {
        gs->scale *= gs->growth_factor;
        gs->growth_tracker = 0;
    }
    gs->checked = false;
    gs->found_inf = false;
    return TP_OK;
}

double tp_grad_scaler_get_scale(const tp_grad_scaler *gs)
{
    return gs ? gs->scale : 0.0;
}

int tp_grad_scaler_growth_tracker(const tp_grad_scaler *gs)
{
    return gs ? gs->growth_tracker : -1;
}
