/* Optimizer steps on plain tensors: sign-flip for int8 binary weights (SPEC §5) with its
 * initial state, and Adam / AdamW with bias correction. Element-wise, so parallel loops stay
 * deterministic; the flip count is summed per thread and combined in a fixed order by OpenMP's
 * integer reduction (exact for integers). Tensors on a CUDA device step there (train_cuda.h). */
#include <math.h>
#include <string.h>

#include "train_internal.h"
#ifdef BIE_HAVE_CUDA
#include "bie_cuda.h"
#include "train_cuda.h"
#endif

/* The device every tensor of a step must share: the first tensor's, which must be one this
 * build can step on. */
static bie_status check_first_device(const bie_tensor *t, const char *what, const char *who) {
    if (t == NULL) return bie_fail(BIE_ERR_NULL_POINTER, "%s: %s is NULL", who, what);
    if (t->device.type == BIE_DEVICE_CPU) return BIE_OK;
#ifdef BIE_HAVE_CUDA
    if (t->device.type == BIE_DEVICE_CUDA) {
        if (t->device.index < 0 || t->device.index >= bie_cuda_device_count())
            return bie_fail(BIE_ERR_DEVICE, "%s: %s is on CUDA device %d, which is not available",
                            who, what, t->device.index);
        return BIE_OK;
    }
    return bie_fail(BIE_ERR_DEVICE, "%s: %s must be a CPU or CUDA tensor", who, what);
#else
    return bie_fail(BIE_ERR_DEVICE, "%s: %s must be a CPU tensor", who, what);
#endif
}

static bie_status check_state(const bie_tensor *t, const bie_tensor *like, bie_dtype dtype,
                              const char *what, const char *who) {
    if (t == NULL) return bie_fail(BIE_ERR_NULL_POINTER, "%s: %s is NULL", who, what);
    if (like && (t->device.type != like->device.type ||
                 (t->device.type == BIE_DEVICE_CUDA && t->device.index != like->device.index))) {
        if (like->device.type == BIE_DEVICE_CPU)
            return bie_fail(BIE_ERR_DEVICE, "%s: %s must be a CPU tensor, as the parameter is", who,
                            what);
        return bie_fail(BIE_ERR_DEVICE, "%s: %s must be on CUDA device %d, as the parameter is",
                        who, what, like->device.index);
    }
    if (t->dtype != dtype)
        return bie_fail(BIE_ERR_DTYPE, "%s: %s must be %s, not %s", who, what,
                        bie_dtype_name(dtype), bie_dtype_name(t->dtype));
    if (t->data == NULL) return bie_fail(BIE_ERR_NULL_POINTER, "%s: %s has no data", who, what);
    if (like && !bie_train_same_shape(t, like))
        return bie_fail(BIE_ERR_SHAPE, "%s: %s must have the parameter's shape", who, what);
    return BIE_OK;
}

/* The tensor a step changes: on a device this build steps on, of dtype, with data and a
 * valid shape of rank >= 1. */
static bie_status check_param(const bie_tensor *t, bie_dtype dtype, const char *what,
                              const char *who) {
    BIE_TRY(check_first_device(t, what, who));
    BIE_TRY(check_state(t, NULL, dtype, what, who));
    if (t->ndim < 1 || bie_tensor_numel(t) < 0)
        return bie_fail(BIE_ERR_SHAPE, "%s: %s has no valid shape", who, what);
    return BIE_OK;
}

static bool beta_ok(float b) { return isfinite(b) && b >= 0.0f && b < 1.0f; }

bie_status bie_signflip_step(bie_tensor *weight, const bie_tensor *grad, bie_tensor *m,
                             bie_tensor *v, float lr, float beta1, float beta2, int64_t *flipped) {
    static const char *who = "signflip_step";
    BIE_TRY(check_param(weight, BIE_I8, "weight", who));
    BIE_CHECK_NULL(grad);
    BIE_TRY(check_state(grad, weight, grad->dtype == BIE_I8 ? BIE_I8 : BIE_F32, "grad", who));
    BIE_TRY(check_state(m, weight, BIE_F32, "m", who));
    BIE_TRY(check_state(v, weight, BIE_F32, "v", who));
    if (!isfinite(lr) || lr <= 0)
        return bie_fail(BIE_ERR_INVALID_ARGUMENT, "%s: lr = %g must be finite and > 0", who,
                        (double)lr);
    if (!beta_ok(beta1) || !beta_ok(beta2))
        return bie_fail(BIE_ERR_INVALID_ARGUMENT, "%s: betas (%g, %g) must be in [0, 1)", who,
                        (double)beta1, (double)beta2);
    const int64_t n = bie_tensor_numel(weight);
    int8_t *w = weight->data;
    float *mm = m->data, *vv = v->data;
    const int8_t *g8 = grad->dtype == BIE_I8 ? grad->data : NULL;
    const float *gf = grad->dtype == BIE_F32 ? grad->data : NULL;
#ifdef BIE_HAVE_CUDA
    if (weight->device.type == BIE_DEVICE_CUDA) {
        int previous = 0;
        BIE_TRY(bie_cuda_train_set_device(weight->device.index, &previous));
        bie_status st = bie_cuda_signflip_step(w, g8, gf, mm, vv, n, lr, beta1, beta2, flipped);
        bie_cuda_train_set_device(previous, NULL);
        return st;
    }
#endif
    const float a1 = 1.0f - beta1, a2 = 1.0f - beta2;
    int64_t flips = 0;
#pragma omp parallel for schedule(static) reduction(+ : flips) num_threads(bie_threads()) \
    if (n > BIE_TRAIN_PARALLEL_MIN)
    for (int64_t i = 0; i < n; i++) {
        const float g = g8 ? (float)g8[i] : gf[i];
        const float mi = mm[i] + a1 * (g - mm[i]);              /* lerp(m, g, 1 - beta1) */
        const float target = mi > 0 ? lr : mi < 0 ? -lr : 0.0f; /* sgn0(m) * lr, sgn0(0) = 0 */
        const float vi = vv[i] + a2 * (target - vv[i]);
        mm[i] = mi;
        vv[i] = vi;
        const bool want_negative = vi >= 0; /* u = -sign(v) with sign(0) = +1 */
        if ((w[i] < 0) != want_negative) {
            /* -(-128) does not fit: it becomes 127 */
            w[i] = w[i] == 0 ? (int8_t)-1 : w[i] == INT8_MIN ? INT8_MAX : (int8_t)-w[i];
            flips++;
        }
    }
    if (flipped) *flipped = flips;
    return BIE_OK;
}

/* delta uniform in (0, 1e-3]: 53 random bits as k in [1, 2^53], times 1e-3 / 2^53. */
static float signflip_delta(uint64_t *state) {
    const double u = (double)((bie_train_splitmix64(state) >> 11) + 1) * (1.0 / 9007199254740992.0);
    return (float)(u * 1e-3);
}

bie_status bie_signflip_init(const bie_tensor *weight, bie_tensor *m, bie_tensor *v,
                             uint64_t seed) {
    static const char *who = "signflip_init";
    BIE_TRY(check_param(weight, BIE_I8, "weight", who));
    BIE_TRY(check_state(m, weight, BIE_F32, "m", who));
    BIE_TRY(check_state(v, weight, BIE_F32, "v", who));
    if (m->data == v->data) return bie_fail(BIE_ERR_INVALID_ARGUMENT, "%s: m and v alias", who);
    const int64_t n = bie_tensor_numel(weight);
    const size_t bytes = (size_t)n * sizeof(float);
    const bool on_cpu = weight->device.type == BIE_DEVICE_CPU;
    /* On a device the state is made on the host (the same numbers anywhere), then copied. */
    int8_t *w = on_cpu ? weight->data : malloc(n > 0 ? (size_t)n : 1);
    float *vh = on_cpu ? v->data : malloc(bytes > 0 ? bytes : 1);
    if (w == NULL || vh == NULL) {
        if (!on_cpu) free(w), free(vh);
        return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: host copy", who);
    }
    bie_status st = BIE_OK;
#ifdef BIE_HAVE_CUDA
    int previous = 0;
    if (!on_cpu) {
        st = bie_cuda_train_set_device(weight->device.index, &previous);
        if (st == BIE_OK) st = bie_cuda_train_copy(w, weight->data, (size_t)n);
    }
#endif
    uint64_t state = seed;
    if (st == BIE_OK)
        for (int64_t i = 0; i < n; i++) {
            const float delta = signflip_delta(&state);
            vh[i] = w[i] < 0 ? delta : -delta; /* -sign(w) * delta, sign(0) = +1 */
        }
    if (on_cpu) {
        memset(m->data, 0, bytes);
        return BIE_OK;
    }
#ifdef BIE_HAVE_CUDA
    if (st == BIE_OK) st = bie_cuda_train_copy(v->data, vh, bytes);
    if (st == BIE_OK) st = bie_cuda_train_memset0(m->data, bytes);
    if (st == BIE_OK) st = bie_cuda_train_sync();
    bie_cuda_train_set_device(previous, NULL);
#endif
    free(w), free(vh);
    return st;
}

bie_adam_options bie_adam_defaults(void) {
    bie_adam_options o = {1e-3f, 0.9f, 0.999f, 1e-8f, 0.0f, false};
    return o;
}

bie_status bie_adam_step(bie_tensor *param, const bie_tensor *grad, bie_tensor *m, bie_tensor *v,
                         int64_t step, const bie_adam_options *options) {
    static const char *who = "adam_step";
    BIE_CHECK_NULL(options);
    BIE_TRY(check_param(param, BIE_F32, "param", who));
    BIE_TRY(check_state(grad, param, BIE_F32, "grad", who));
    BIE_TRY(check_state(m, param, BIE_F32, "m", who));
    BIE_TRY(check_state(v, param, BIE_F32, "v", who));
    const bie_adam_options o = *options;
    if (step < 1) return bie_fail(BIE_ERR_INVALID_ARGUMENT, "%s: step must be >= 1", who);
    if (!isfinite(o.lr) || o.lr <= 0 || !isfinite(o.eps) || o.eps <= 0)
        return bie_fail(BIE_ERR_INVALID_ARGUMENT, "%s: lr = %g and eps = %g must be finite and > 0",
                        who, (double)o.lr, (double)o.eps);
    if (!beta_ok(o.beta1) || !beta_ok(o.beta2))
        return bie_fail(BIE_ERR_INVALID_ARGUMENT, "%s: betas (%g, %g) must be in [0, 1)", who,
                        (double)o.beta1, (double)o.beta2);
    if (!isfinite(o.weight_decay) || o.weight_decay < 0)
        return bie_fail(BIE_ERR_INVALID_ARGUMENT, "%s: weight_decay = %g must be finite and >= 0",
                        who, (double)o.weight_decay);
    const int64_t n = bie_tensor_numel(param);
    float *p = param->data, *mm = m->data, *vv = v->data;
    const float *g = grad->data;
#ifdef BIE_HAVE_CUDA
    if (param->device.type == BIE_DEVICE_CUDA) {
        int previous = 0;
        BIE_TRY(bie_cuda_train_set_device(param->device.index, &previous));
        bie_status st = bie_cuda_adam_step(p, g, mm, vv, n, step, &o);
        bie_cuda_train_set_device(previous, NULL);
        return st;
    }
#endif
    const double bc1 = 1.0 - pow((double)o.beta1, (double)step);
    const double bc2 = 1.0 - pow((double)o.beta2, (double)step);
    const float step_size = (float)((double)o.lr / bc1);
    const float bc2_sqrt = (float)sqrt(bc2);
    const float decay = o.decoupled ? 1.0f - o.lr * o.weight_decay : 1.0f;
    const float l2 = o.decoupled ? 0.0f : o.weight_decay;
#pragma omp parallel for schedule(static) num_threads(bie_threads()) if (n > BIE_TRAIN_PARALLEL_MIN)
    for (int64_t i = 0; i < n; i++) {
        const float gi = g[i] + l2 * p[i];
        const float mi = o.beta1 * mm[i] + (1.0f - o.beta1) * gi;
        const float vi = o.beta2 * vv[i] + (1.0f - o.beta2) * gi * gi;
        mm[i] = mi;
        vv[i] = vi;
        p[i] = p[i] * decay - step_size * mi / (sqrtf(vi) / bc2_sqrt + o.eps);
    }
    return BIE_OK;
}

bie_status bie_clamp_min_scaled(bie_tensor *x, const bie_tensor *floor, float factor) {
    static const char *who = "clamp_min_scaled";
    BIE_TRY(check_param(x, BIE_F32, "x", who));
    BIE_TRY(check_state(floor, x, BIE_F32, "floor", who));
    if (!isfinite(factor))
        return bie_fail(BIE_ERR_INVALID_ARGUMENT, "%s: factor %g is not finite", who,
                        (double)factor);
    const int64_t n = bie_tensor_numel(x);
    float *p = x->data;
    const float *f = floor->data;
#ifdef BIE_HAVE_CUDA
    if (x->device.type == BIE_DEVICE_CUDA) {
        int previous = 0;
        BIE_TRY(bie_cuda_train_set_device(x->device.index, &previous));
        bie_status st = bie_cuda_clamp_min_scaled(p, f, n, factor);
        bie_cuda_train_set_device(previous, NULL);
        return st;
    }
#endif
    for (int64_t i = 0; i < n; i++) {
        const float lo = factor * f[i];
        if (p[i] < lo) p[i] = lo;
    }
    return BIE_OK;
}
