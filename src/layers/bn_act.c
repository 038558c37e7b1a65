/* Batch norm, residual add and PReLU fused (bie.h §7): the argument checks both devices share,
 * then the CPU's kernels (bn_act_cpu.c) or the CUDA ones (cuda/bn_act.cu).
 *
 * Each device computes a channel's affine map z = a y + b + res (a = gamma rstd, b = beta -
 * mean a, from the float32 statistics) the same way in its forward and its backward, so the
 * backward recomputes the forward's z bit for bit on that device. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../core/internal.h"
#include "../cuda/cuda_internal.h"
#include "bie_cuda.h"
#include "bn_act_cpu.h"

typedef struct bn_geom {
    int64_t outer, c, inner, count; /* count: elements a channel, outer inner */
    bool cuda;
    int device;
} bn_geom;

static bool same_device(const bie_tensor *a, const bie_tensor *b) {
    return a->device.type == b->device.type &&
           (a->device.type != BIE_DEVICE_CUDA || a->device.index == b->device.index);
}

/* y's geometry, and its dtype and device for this build. */
static bie_status check_main(const bie_tensor *y, const char *who, bn_geom *g) {
    if (y->ndim < 2 || y->ndim > 4)
        return bie_fail(BIE_ERR_SHAPE, "%s: y has rank %d; expected 2..4 (dim 1 the channels)", who,
                        y->ndim);
    for (int i = 0; i < y->ndim; i++)
        if (y->shape[i] < 0) return bie_fail(BIE_ERR_SHAPE, "%s: y extent %d is negative", who, i);
    const int64_t numel = bie_tensor_numel(y);
    if (numel < 0) return bie_fail(BIE_ERR_OVERFLOW, "%s: y's element count overflows", who);
    g->outer = y->shape[0];
    g->c = y->shape[1];
    g->inner = 1;
    for (int i = 2; i < y->ndim; i++) g->inner *= y->shape[i];
    g->count = g->outer * g->inner;
    if (g->c < 1) return bie_fail(BIE_ERR_SHAPE, "%s: y has no channels", who);
    g->cuda = y->device.type == BIE_DEVICE_CUDA;
    g->device = y->device.index;
    if (g->cuda) {
        if (y->dtype != BIE_F32 && y->dtype != BIE_BF16 && y->dtype != BIE_F16)
            return bie_fail(BIE_ERR_DTYPE, "%s: y is %s; CUDA takes float32, bfloat16, float16",
                            who, bie_dtype_name(y->dtype));
        if (!bie_cuda_built())
            return bie_fail(BIE_ERR_DEVICE, "%s: this build has no CUDA backend", who);
        if (g->device < 0 || g->device >= bie_cuda_device_count())
            return bie_fail(BIE_ERR_DEVICE, "%s: no CUDA device %d", who, g->device);
    } else if (y->device.type != BIE_DEVICE_CPU) {
        return bie_fail(BIE_ERR_DEVICE, "%s: y is on an unknown device", who);
    } else if (y->dtype != BIE_F32) {
        return bie_fail(BIE_ERR_DTYPE, "%s: y is %s; the CPU takes float32", who,
                        bie_dtype_name(y->dtype));
    }
    if (numel > 0 && y->data == NULL) return bie_fail(BIE_ERR_NULL_POINTER, "%s: y's data", who);
    return BIE_OK;
}

/* t (may be NULL when optional) shaped, typed and placed like y. */
static bie_status check_like(const bie_tensor *t, const bie_tensor *y, const char *name,
                             const char *who) {
    if (t == NULL) return BIE_OK;
    if (t->ndim != y->ndim)
        return bie_fail(BIE_ERR_SHAPE, "%s: %s has rank %d, y %d", who, name, t->ndim, y->ndim);
    for (int i = 0; i < y->ndim; i++)
        if (t->shape[i] != y->shape[i])
            return bie_fail(BIE_ERR_SHAPE, "%s: %s extent %d is %lld, y's %lld", who, name, i,
                            (long long)t->shape[i], (long long)y->shape[i]);
    if (t->dtype != y->dtype)
        return bie_fail(BIE_ERR_DTYPE, "%s: %s is %s, y %s", who, name, bie_dtype_name(t->dtype),
                        bie_dtype_name(y->dtype));
    if (!same_device(t, y))
        return bie_fail(BIE_ERR_DEVICE, "%s: %s is not on y's device", who, name);
    if (t->data == NULL && bie_tensor_numel(y) > 0)
        return bie_fail(BIE_ERR_NULL_POINTER, "%s: %s's data is NULL", who, name);
    return BIE_OK;
}

/* A per-channel float32 vector of c (or, with shared, 1) elements on y's device. */
static bie_status check_vec(const bie_tensor *t, const bie_tensor *y, int64_t c, bool shared,
                            const char *name, const char *who) {
    if (t == NULL) return BIE_OK;
    if (t->dtype != BIE_F32)
        return bie_fail(BIE_ERR_DTYPE, "%s: %s is %s; expected float32", who, name,
                        bie_dtype_name(t->dtype));
    if (t->ndim != 1 || (t->shape[0] != c && !(shared && t->shape[0] == 1)))
        return bie_fail(BIE_ERR_SHAPE, "%s: %s must be [%lld]%s", who, name, (long long)c,
                        shared ? " or [1]" : "");
    if (!same_device(t, y))
        return bie_fail(BIE_ERR_DEVICE, "%s: %s is not on y's device", who, name);
    if (t->data == NULL) return bie_fail(BIE_ERR_NULL_POINTER, "%s: %s's data is NULL", who, name);
    return BIE_OK;
}

/* p's tensors and values, and the saved statistics. */
static bie_status check_params(const bie_bn_act_params *p, const bie_tensor *y, const bn_geom *g,
                               const bie_tensor *save_mean, const bie_tensor *save_rstd,
                               const char *who) {
    BIE_TRY(check_vec(save_mean, y, g->c, false, "save_mean", who));
    BIE_TRY(check_vec(save_rstd, y, g->c, false, "save_rstd", who));
    BIE_TRY(check_vec(p->gamma, y, g->c, false, "gamma", who));
    BIE_TRY(check_vec(p->beta, y, g->c, false, "beta", who));
    BIE_TRY(check_vec(p->slope, y, g->c, true, "slope", who));
    BIE_TRY(check_vec(p->running_mean, y, g->c, false, "running_mean", who));
    BIE_TRY(check_vec(p->running_var, y, g->c, false, "running_var", who));
    if (!(p->eps > 0.0f) || !isfinite(p->eps))
        return bie_fail(BIE_ERR_INVALID_ARGUMENT, "%s: eps %g must be positive and finite", who,
                        (double)p->eps);
    if (!(p->momentum >= 0.0f && p->momentum <= 1.0f))
        return bie_fail(BIE_ERR_INVALID_ARGUMENT, "%s: momentum %g is outside 0..1", who,
                        (double)p->momentum);
    if ((p->running_mean == NULL) != (p->running_var == NULL))
        return bie_fail(BIE_ERR_NULL_POINTER, "%s: running_mean and running_var go together", who);
    if (p->training && g->count < 2)
        return bie_fail(BIE_ERR_SHAPE,
                        "%s: training needs at least 2 elements a channel; y has %lld", who,
                        (long long)g->count);
    if (!p->training && p->running_mean == NULL)
        return bie_fail(BIE_ERR_NULL_POINTER, "%s: inference needs the running statistics", who);
    return BIE_OK;
}

static bie_cuda_bn_act cuda_args(const bie_bn_act_params *p, const bie_tensor *y,
                                 const bn_geom *g) {
    bie_cuda_bn_act a;
    memset(&a, 0, sizeof a);
    a.device = g->device;
    a.dtype = y->dtype;
    a.outer = g->outer;
    a.c = g->c;
    a.inner = g->inner;
    a.gamma = p->gamma ? p->gamma->data : NULL;
    a.beta = p->beta ? p->beta->data : NULL;
    a.slope = p->slope ? p->slope->data : NULL;
    a.slope_shared = p->slope != NULL && p->slope->shape[0] == 1 && g->c != 1;
    a.running_mean = p->running_mean ? p->running_mean->data : NULL;
    a.running_var = p->running_var ? p->running_var->data : NULL;
    a.eps = p->eps;
    a.momentum = p->momentum;
    a.training = p->training;
    return a;
}

/* ---------------------------------------------------------------- entry points */

bie_status bie_bn_act_forward(const bie_bn_act_params *p, const bie_tensor *y,
                              const bie_tensor *res, bie_tensor *save_mean, bie_tensor *save_rstd,
                              bie_tensor *out) {
    static const char *who = "bie_bn_act_forward";
    BIE_CHECK_NULL(p);
    BIE_CHECK_NULL(y);
    BIE_CHECK_NULL(save_mean);
    BIE_CHECK_NULL(save_rstd);
    BIE_CHECK_NULL(out);
    bn_geom g;
    BIE_TRY(check_main(y, who, &g));
    BIE_TRY(check_like(res, y, "res", who));
    BIE_TRY(check_like(out, y, "out", who));
    BIE_TRY(check_params(p, y, &g, save_mean, save_rstd, who));
    if (g.cuda) {
        const bie_cuda_bn_act a = cuda_args(p, y, &g);
        return bie_cuda_bn_act_forward(&a, y->data, res ? res->data : NULL, save_mean->data,
                                       save_rstd->data, out->data);
    }
    return bie_bn_act_cpu_forward(p, g.outer, g.c, g.inner, y->data, res ? res->data : NULL,
                                  save_mean->data, save_rstd->data, out->data);
}

bie_status bie_bn_act_backward(const bie_bn_act_params *p, const bie_tensor *grad_out,
                               const bie_tensor *y, const bie_tensor *res,
                               const bie_tensor *save_mean, const bie_tensor *save_rstd,
                               bie_tensor *grad_y, bie_tensor *grad_res, bie_tensor *grad_gamma,
                               bie_tensor *grad_beta, bie_tensor *grad_slope) {
    static const char *who = "bie_bn_act_backward";
    BIE_CHECK_NULL(p);
    BIE_CHECK_NULL(grad_out);
    BIE_CHECK_NULL(y);
    BIE_CHECK_NULL(save_mean);
    BIE_CHECK_NULL(save_rstd);
    BIE_CHECK_NULL(grad_y);
    bn_geom g;
    BIE_TRY(check_main(y, who, &g));
    BIE_TRY(check_like(grad_out, y, "grad_out", who));
    BIE_TRY(check_like(res, y, "res", who));
    BIE_TRY(check_like(grad_y, y, "grad_y", who));
    BIE_TRY(check_like(grad_res, y, "grad_res", who));
    BIE_TRY(check_params(p, y, &g, save_mean, save_rstd, who));
    BIE_TRY(check_vec(grad_gamma, y, g.c, false, "grad_gamma", who));
    BIE_TRY(check_vec(grad_beta, y, g.c, false, "grad_beta", who));
    if (grad_slope != NULL && p->slope == NULL)
        return bie_fail(BIE_ERR_INVALID_ARGUMENT, "%s: grad_slope without a slope", who);
    if (grad_slope != NULL) {
        BIE_TRY(check_vec(grad_slope, y, g.c, true, "grad_slope", who));
        if (grad_slope->shape[0] != p->slope->shape[0])
            return bie_fail(BIE_ERR_SHAPE, "%s: grad_slope is not shaped like slope", who);
    }
    if (g.cuda) {
        const bie_cuda_bn_act a = cuda_args(p, y, &g);
        return bie_cuda_bn_act_backward(
            &a, grad_out->data, y->data, res ? res->data : NULL, save_mean->data, save_rstd->data,
            grad_y->data, grad_res ? grad_res->data : NULL, grad_gamma ? grad_gamma->data : NULL,
            grad_beta ? grad_beta->data : NULL, grad_slope ? grad_slope->data : NULL);
    }
    return bie_bn_act_cpu_backward(
        p, g.outer, g.c, g.inner, grad_out->data, y->data, res ? res->data : NULL, save_mean->data,
        save_rstd->data, grad_y->data, grad_res ? grad_res->data : NULL,
        grad_gamma ? grad_gamma->data : NULL, grad_beta ? grad_beta->data : NULL,
        grad_slope ? grad_slope->data : NULL);
}
