/* The optimizer object: per-parameter state over a model's trainable parameters, stepping
 * binary weights by sign flips (state started by bie_signflip_init from the options' seed)
 * and float parameters by Adam / AdamW. */
#include <math.h>
#include <string.h>

#include "train_internal.h"

typedef struct param_state {
    int index; /* in the model's parameter list */
    bie_param_kind kind;
    int64_t numel;
    float *m, *v;
} param_state;

struct bie_optimizer {
    bie_model *model;
    const bie_train_ops *ops; /* the memory of the model's device at creation */
    bie_optimizer_options options;
    uint64_t generation;    /* the model's, when created */
    uint64_t last_backward; /* the model's backward count at the last step */
    int64_t steps;
    int count;
    param_state *states;
};

bie_optimizer_options bie_optimizer_defaults(void) {
    bie_optimizer_options o;
    o.binary_lr = 1e-4f;
    o.binary_beta1 = 0.99f;
    o.binary_beta2 = 0.9999f;
    o.adam = bie_adam_defaults();
    o.seed = 0;
    return o;
}

/* The generator seed of parameter `index`'s initial sign-flip state: a mix of the
 * optimizer's seed and the index. */
static uint64_t param_seed(uint64_t seed, int index) {
    uint64_t s = seed ^ ((uint64_t)(index + 1) * 0x9E6C63D0676A9A99ull);
    return bie_train_splitmix64(&s);
}

static bool beta_ok(float b) { return isfinite(b) && b >= 0.0f && b < 1.0f; }
static bool lr_ok(float lr) { return isfinite(lr) && lr > 0.0f; }

static bie_status check_options(const bie_optimizer_options *o, const char *who) {
    if (!lr_ok(o->binary_lr) || !lr_ok(o->adam.lr) || !lr_ok(o->adam.eps))
        return bie_fail(BIE_ERR_INVALID_ARGUMENT,
                        "%s: learning rates and eps must be finite and > 0", who);
    if (!beta_ok(o->binary_beta1) || !beta_ok(o->binary_beta2) || !beta_ok(o->adam.beta1) ||
        !beta_ok(o->adam.beta2))
        return bie_fail(BIE_ERR_INVALID_ARGUMENT, "%s: betas must be in [0, 1)", who);
    if (!isfinite(o->adam.weight_decay) || o->adam.weight_decay < 0)
        return bie_fail(BIE_ERR_INVALID_ARGUMENT, "%s: weight_decay must be finite and >= 0", who);
    return BIE_OK;
}

void bie_optimizer_free(bie_optimizer *o) {
    if (o == NULL) return;
    for (int i = 0; i < o->count; i++) {
        o->ops->release(o->states[i].m);
        o->ops->release(o->states[i].v);
    }
    free(o->states);
    free(o);
}

bie_status bie_optimizer_create(bie_optimizer **out, bie_model *model,
                                const bie_optimizer_options *options) {
    static const char *who = "optimizer_create";
    BIE_CHECK_NULL(out);
    BIE_CHECK_NULL(model);
    const bie_optimizer_options opts = options ? *options : bie_optimizer_defaults();
    BIE_TRY(check_options(&opts, who));
    if (model->packed)
        return bie_fail(BIE_ERR_STATE, "%s: the model is packed (inference-only)", who);
    const int n = bie_model_param_count(model);
    int trainable = 0;
    for (int i = 0; i < n; i++) {
        bie_model_param p;
        BIE_TRY(bie_model_param_get(model, i, &p));
        if (p.kind == BIE_PARAM_KIND_BINARY && p.value.dtype != BIE_I8)
            return bie_fail(BIE_ERR_STATE,
                            "%s: '%s' is not int8 yet: call bie_model_prepare_params "
                            "first",
                            who, p.name);
        trainable += p.kind == BIE_PARAM_KIND_BINARY || p.kind == BIE_PARAM_KIND_FLOAT;
    }
    bie_optimizer *o = calloc(1, sizeof *o);
    if (o == NULL) return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: optimizer", who);
    o->ops = model->ops;
    o->states = calloc((size_t)(trainable > 0 ? trainable : 1), sizeof *o->states);
    if (o->states == NULL) {
        free(o);
        return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: optimizer state", who);
    }
    for (int i = 0; i < n; i++) {
        bie_model_param p;
        bie_status st = bie_model_param_get(model, i, &p);
        if (st != BIE_OK) {
            bie_optimizer_free(o);
            return st;
        }
        if (p.kind != BIE_PARAM_KIND_BINARY && p.kind != BIE_PARAM_KIND_FLOAT) continue;
        param_state *s = &o->states[o->count++];
        s->index = i;
        s->kind = p.kind;
        s->numel = bie_tensor_numel(&p.value);
        const size_t bytes = (size_t)s->numel * sizeof(float);
        s->m = o->ops->alloc(bytes); /* on the model's device, like the parameters */
        s->v = o->ops->alloc(bytes);
        if (s->m == NULL || s->v == NULL) {
            bie_optimizer_free(o);
            return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: optimizer state", who);
        }
        if (p.kind == BIE_PARAM_KIND_BINARY) { /* m = 0, v = -sign(w) * delta (SPEC §5) */
            bie_tensor tm = bie_model_view(model, s->m, BIE_F32, p.value.ndim, p.value.shape);
            bie_tensor tv = bie_model_view(model, s->v, BIE_F32, p.value.ndim, p.value.shape);
            st = bie_signflip_init(&p.value, &tm, &tv, param_seed(opts.seed, i));
        } else { /* Adam's moments start at 0 */
            st = o->ops->zero(s->m, bytes);
            if (st == BIE_OK) st = o->ops->zero(s->v, bytes);
        }
        if (st != BIE_OK) {
            bie_optimizer_free(o);
            return st;
        }
    }
    o->model = model;
    o->options = opts;
    o->generation = model->generation;
    o->last_backward = model->backward_count;
    *out = o;
    return BIE_OK;
}

bie_status bie_optimizer_step(bie_optimizer *o, int64_t *flipped) {
    static const char *who = "optimizer_step";
    BIE_CHECK_NULL(o);
    bie_model *m = o->model;
    if (m->generation != o->generation)
        return bie_fail(BIE_ERR_STATE,
                        "%s: the model's parameters changed (reset, prepare, pack, "
                        "load or new layers) since the optimizer was created",
                        who);
    if (m->backward_count == o->last_backward)
        return bie_fail(BIE_ERR_STATE, "%s: no backward since the last step", who);
    /* Every check that can fail runs before the first parameter changes. */
    bie_model_param *params = malloc((size_t)(o->count > 0 ? o->count : 1) * sizeof *params);
    if (params == NULL) return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: workspace", who);
    bie_status st = BIE_OK;
    for (int i = 0; i < o->count && st == BIE_OK; i++)
        st = bie_model_param_get(m, o->states[i].index, &params[i]);
    int64_t flips = 0;
    for (int i = 0; i < o->count && st == BIE_OK; i++) {
        param_state *s = &o->states[i];
        bie_model_param *p = &params[i];
        if (p->grad.data == NULL) continue; /* no gradient reached it (as grad None) */
        bie_tensor tm = bie_model_view(m, s->m, BIE_F32, p->value.ndim, p->value.shape);
        bie_tensor tv = bie_model_view(m, s->v, BIE_F32, p->value.ndim, p->value.shape);
        if (s->kind == BIE_PARAM_KIND_BINARY) {
            /* counted only when asked: on a GPU the count waits for the device */
            int64_t f = 0;
            st = bie_signflip_step(&p->value, &p->grad, &tm, &tv, o->options.binary_lr,
                                   o->options.binary_beta1, o->options.binary_beta2,
                                   flipped ? &f : NULL);
            flips += f;
        } else {
            st = bie_adam_step(&p->value, &p->grad, &tm, &tv, o->steps + 1, &o->options.adam);
        }
    }
    free(params);
    if (st != BIE_OK) return st;
    o->steps++;
    o->last_backward = m->backward_count;
    m->qweight_stale = true;
    if (flipped) *flipped = flips;
    return BIE_OK;
}

bie_status bie_optimizer_set_lr(bie_optimizer *o, float float_lr, float binary_lr) {
    BIE_CHECK_NULL(o);
    if (!lr_ok(float_lr) || !lr_ok(binary_lr))
        return bie_fail(BIE_ERR_INVALID_ARGUMENT,
                        "optimizer_set_lr: learning rates (%g, %g) must "
                        "be finite and > 0",
                        (double)float_lr, (double)binary_lr);
    o->options.adam.lr = float_lr;
    o->options.binary_lr = binary_lr;
    return BIE_OK;
}

int64_t bie_optimizer_steps(const bie_optimizer *o) { return o ? o->steps : 0; }
