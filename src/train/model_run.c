/* The model's forward and backward passes: shape propagation, activation buffers, and the
 * dispatch of each layer to its float kernel or its bie.h layer object. */
#include <stdio.h>
#include <string.h>

#include "train_internal.h"

static int64_t numel_of(int ndim, const int64_t *shape) {
    int64_t n = 1;
    for (int d = 0; d < ndim; d++)
        if (!bie_mul_ok(n, shape[d], &n)) return -1;
    return n;
}

static bie_status shape_error(int index, const bie_train_layer *l, const char *what) {
    return bie_fail(BIE_ERR_SHAPE, "model: layer %d (%s): %s", index,
                    bie_layer_type_name(l->info.type), what);
}

/* floor((size + 2p - d(k - 1) - 1) / s) + 1, or 0 when the dilated kernel does not fit. */
static int64_t conv_extent(int64_t size, const bie_layer_info *c) {
    const int64_t span = (int64_t)c->dilation * (c->kernel_size - 1) + 1;
    if (size + 2 * (int64_t)c->padding < span) return 0;
    return (size + 2 * (int64_t)c->padding - span) / c->stride + 1;
}

bie_status bie_model_layer_out_shape(const bie_model *m, int index, int ndim, const int64_t *shape,
                                     int *out_ndim, int64_t *out) {
    const bie_train_layer *l = &m->layers[index];
    const bie_layer_info *c = &l->info;
    char msg[160];
    *out_ndim = ndim;
    memcpy(out, shape, (size_t)ndim * sizeof *out);
    const bie_layer_type_traits *t = bie_layer_type_traits_of(c->type);
    if (t == NULL) return shape_error(index, l, "unknown layer type");
    if (t->conv) {
        if (ndim != 4 || shape[1] != c->in) {
            snprintf(msg, sizeof msg, "expects NCHW input with %lld channels", (long long)c->in);
            return shape_error(index, l, msg);
        }
        out[1] = c->out;
        out[2] = conv_extent(shape[2], c);
        out[3] = conv_extent(shape[3], c);
        if (out[2] < 1 || out[3] < 1) {
            snprintf(msg, sizeof msg, "input %lld x %lld is smaller than the dilated kernel",
                     (long long)shape[2], (long long)shape[3]);
            return shape_error(index, l, msg);
        }
        return BIE_OK;
    }
    if (c->type == BIE_LAYER_LINEAR || t->low_bit) {
        if (shape[ndim - 1] != c->in) {
            snprintf(msg, sizeof msg,
                     "the input's last extent is %lld, expected in_features = %lld",
                     (long long)shape[ndim - 1], (long long)c->in);
            return shape_error(index, l, msg);
        }
        out[ndim - 1] = c->out;
        return BIE_OK;
    }
    switch (c->type) {
    case BIE_LAYER_BATCHNORM1D:
    case BIE_LAYER_BATCHNORM2D: {
        const int want = c->type == BIE_LAYER_BATCHNORM1D ? 2 : 4;
        if (ndim != want || shape[1] != c->in) {
            snprintf(msg, sizeof msg, "expects input [N, %lld%s], got rank %d with dim 1 = %lld",
                     (long long)c->in, want == 4 ? ", H, W" : "", ndim,
                     (long long)(ndim > 1 ? shape[1] : 0));
            return shape_error(index, l, msg);
        }
        return BIE_OK;
    }
    case BIE_LAYER_RELU: return BIE_OK;
    case BIE_LAYER_PRELU:
        if (c->in > 1 && (ndim < 2 || shape[1] != c->in)) {
            snprintf(msg, sizeof msg, "has %lld slopes: the input's dim 1 must have that size",
                     (long long)c->in);
            return shape_error(index, l, msg);
        }
        return BIE_OK;
    case BIE_LAYER_MAXPOOL2D:
        if (ndim != 4 || shape[2] < c->kernel_size || shape[3] < c->kernel_size) {
            snprintf(msg, sizeof msg, "expects NCHW input of at least %d x %d", c->kernel_size,
                     c->kernel_size);
            return shape_error(index, l, msg);
        }
        out[2] = (shape[2] - c->kernel_size) / c->stride + 1;
        out[3] = (shape[3] - c->kernel_size) / c->stride + 1;
        return BIE_OK;
    case BIE_LAYER_FLATTEN:
        if (ndim < 2) return shape_error(index, l, "expects an input of rank >= 2");
        *out_ndim = 2;
        out[1] = numel_of(ndim - 1, shape + 1);
        return BIE_OK;
    default: break;
    }
    return shape_error(index, l, "unknown layer type");
}

bie_status bie_model_output_shape(const bie_model *m, int in_ndim, const int64_t *in_shape,
                                  int *out_ndim, int64_t *out_shape) {
    static const char *who = "model_output_shape";
    if (m == NULL) return bie_fail(BIE_ERR_NULL_POINTER, "%s: model is NULL", who);
    BIE_CHECK_NULL(in_shape);
    BIE_CHECK_NULL(out_ndim);
    BIE_CHECK_NULL(out_shape);
    if (m->count == 0) return bie_fail(BIE_ERR_STATE, "%s: the model has no layers", who);
    if (in_ndim < 1 || in_ndim > BIE_MAX_DIMS)
        return bie_fail(BIE_ERR_SHAPE, "%s: input rank %d outside 1..%d", who, in_ndim,
                        BIE_MAX_DIMS);
    int nd = in_ndim;
    int64_t cur[BIE_MAX_DIMS], next[BIE_MAX_DIMS];
    memcpy(cur, in_shape, (size_t)in_ndim * sizeof *cur);
    for (int d = 0; d < nd; d++)
        if (cur[d] < 1) return bie_fail(BIE_ERR_SHAPE, "%s: input extents must be >= 1", who);
    if (numel_of(nd, cur) < 0 || numel_of(nd, cur) > (int64_t)1 << 40)
        return bie_fail(BIE_ERR_OVERFLOW, "%s: input too large", who);
    for (int i = 0; i < m->count; i++) {
        int nn;
        BIE_TRY(bie_model_layer_out_shape(m, i, nd, cur, &nn, next));
        const int64_t n = numel_of(nn, next);
        if (n < 0 || n > (int64_t)1 << 40)
            return bie_fail(BIE_ERR_OVERFLOW, "%s: layer %d's output is too large", who, i);
        nd = nn;
        memcpy(cur, next, sizeof cur);
    }
    *out_ndim = nd;
    memcpy(out_shape, cur, (size_t)nd * sizeof *out_shape);
    return BIE_OK;
}

/* Grow a buffer of the model's device to hold n 4-byte elements (contents are not kept). */
static bool ensure(const bie_model *m, void *buf, int64_t *cap, int64_t n) {
    float **b = buf;
    if (*cap >= n && *b) return true;
    float *p = m->ops->alloc((size_t)n * sizeof(float));
    if (p == NULL) return false;
    m->ops->release(*b);
    *b = p;
    *cap = n;
    return true;
}

/* An F32 tensor for the model: on the CPU, or on the model's device. */
static bie_status check_io(const bie_model *m, const bie_tensor *t, const char *what,
                           const char *who) {
    if (t == NULL || t->device.type == BIE_DEVICE_CPU || m->device.type == BIE_DEVICE_CPU)
        return bie_train_check_f32(t, what, who);
    if (t->device.type != m->device.type || t->device.index != m->device.index)
        return bie_fail(BIE_ERR_DEVICE, "%s: %s must be on the CPU or on the model's device", who,
                        what);
    bie_tensor host_like = *t; /* the other checks are the CPU's */
    host_like.device = bie_cpu();
    return bie_train_check_f32(&host_like, what, who);
}

/* Shapes of every layer for this input, and every buffer the pass needs. */
static bie_status plan_forward(bie_model *m, const bie_tensor *x) {
    static const char *who = "model_forward";
    int nd = x->ndim;
    int64_t shape[BIE_MAX_DIMS];
    memcpy(shape, x->shape, sizeof shape);
    for (int d = 0; d < nd; d++)
        if (shape[d] < 1) return bie_fail(BIE_ERR_SHAPE, "%s: input extents must be >= 1", who);
    int64_t dummy_out[BIE_MAX_DIMS];
    int dummy_nd;
    BIE_TRY(bie_model_output_shape(m, nd, shape, &dummy_nd, dummy_out));
    if (!ensure(m, &m->acts[0], &m->act_cap[0], numel_of(nd, shape)))
        return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: input copy", who);
    /* Copied before any other buffer moves: x may be a view of the previous output. */
    BIE_TRY(m->ops->copy(m->acts[0], x->data, (size_t)numel_of(nd, shape) * sizeof(float)));
    for (int i = 0; i < m->count; i++) {
        bie_train_layer *l = &m->layers[i];
        int on;
        int64_t os[BIE_MAX_DIMS];
        BIE_TRY(bie_model_layer_out_shape(m, i, nd, shape, &on, os));
        const int64_t in_n = numel_of(nd, shape), out_n = numel_of(on, os);
        if (!ensure(m, &m->acts[i + 1], &m->act_cap[i + 1], out_n))
            return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: activations of layer %d", who, i);
        const bie_layer_type t = l->info.type;
        if (m->training && (t == BIE_LAYER_BATCHNORM1D || t == BIE_LAYER_BATCHNORM2D)) {
            const int64_t per_channel = in_n / shape[1];
            if (per_channel < 2)
                return bie_fail(BIE_ERR_SHAPE,
                                "%s: layer %d (batch norm) needs more than one "
                                "value per channel in training mode",
                                who, i);
            if (!ensure(m, &l->saved_xhat, &l->saved_cap, in_n))
                return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: batch norm of layer %d", who, i);
        }
        if (m->training && t == BIE_LAYER_MAXPOOL2D &&
            !ensure(m, &l->saved_argmax, &l->saved_cap, out_n))
            return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: max-pool of layer %d", who, i);
        if (m->training && l->lowbit &&
            bie_layer_type_traits_of(t)->weight == BIE_PARAM_KIND_BINARY) {
            bie_tensor w;
            bie_status st = bie_layer_param(l->lowbit, BIE_PARAM_WEIGHT, &w);
            if (st != BIE_OK || w.dtype != BIE_I8)
                return bie_fail(BIE_ERR_STATE,
                                "%s: layer %d's binary weight is not int8: call "
                                "bie_model_prepare_params before training",
                                who, i);
        }
        l->in_ndim = nd;
        memcpy(l->in_shape, shape, sizeof shape);
        l->out_ndim = on;
        memcpy(l->out_shape, os, sizeof os);
        nd = on;
        memcpy(shape, os, sizeof shape);
    }
    return BIE_OK;
}

#define view(data, ndim, shape) bie_model_view(m, (data), BIE_F32, (ndim), (shape))

static float scale_a_of(const bie_model *m, bie_train_layer *l) {
    bie_tensor s = {0};
    if (l->lowbit && bie_layer_param(l->lowbit, BIE_PARAM_SCALE_A, &s) != BIE_OK) s.data = NULL;
    float v = 0.0f;
    if (s.data && m->ops->copy(&v, s.data, sizeof v) != BIE_OK) v = 0.0f;
    return v;
}

static void set_scale_a(bie_train_layer *l, float v) {
    if (l->lowbit) bie_layer_set_scale_a(l->lowbit, v);
}

/* Evaluation packs low-bit weights once; they are packed again after they changed. */
static bie_status refresh_qweights(bie_model *m) {
    if (m->packed || !m->qweight_stale) return BIE_OK;
    for (int i = 0; i < m->count; i++) {
        bie_train_layer *l = &m->layers[i];
        if (l->lowbit) BIE_TRY(bie_layer_generate_quantized_weight(l->lowbit, false));
    }
    m->qweight_stale = false;
    return BIE_OK;
}

static bie_status layer_forward(bie_model *m, int i, const float *x, float *y) {
    bie_train_layer *l = &m->layers[i];
    const bie_layer_info *c = &l->info;
    const int64_t *s = l->in_shape;
    const int64_t n = numel_of(l->in_ndim, s);
    bie_tensor tx = view((float *)x, l->in_ndim, s), ty = view(y, l->out_ndim, l->out_shape);
    const bie_train_ops *k = m->ops;
    switch (c->type) {
    case BIE_LAYER_LINEAR:
        return k->linear_forward(x, n / c->in, c->in, c->out, l->weight, l->bias, y);
    case BIE_LAYER_BATCHNORM1D:
    case BIE_LAYER_BATCHNORM2D: {
        const int64_t inner = n / (s[0] * s[1]);
        if (m->training)
            return k->batchnorm_forward_train(x, s[0], s[1], inner, l->weight, l->bias, c->eps, y,
                                              l->saved_xhat, l->saved_invstd, l->batch_mean,
                                              l->batch_var);
        return k->batchnorm_forward_eval(x, s[0], s[1], inner, l->weight, l->bias, c->eps,
                                         l->running_mean, l->running_var, y);
    }
    case BIE_LAYER_RELU: return k->relu_forward(x, n, y);
    case BIE_LAYER_PRELU: {
        const int64_t ch = l->in_ndim >= 2 ? s[1] : 1,
                      inner = l->in_ndim >= 2 ? n / (s[0] * s[1]) : 1;
        return k->prelu_forward(x, n / (ch * inner), ch, inner, l->weight, c->in, y);
    }
    case BIE_LAYER_MAXPOOL2D:
        return k->maxpool_forward(x, s[0] * s[1], s[2], s[3], c->kernel_size, c->stride,
                                  l->out_shape[2], l->out_shape[3], y,
                                  m->training ? l->saved_argmax : NULL);
    case BIE_LAYER_FLATTEN: return k->copy(y, x, (size_t)n * sizeof(float));
    default:
        if (l->lowbit) return bie_layer_forward(l->lowbit, &tx, &ty);
        break;
    }
    return bie_fail(BIE_ERR_INTERNAL, "model_forward: unknown layer type");
}

bie_status bie_model_forward(bie_model *m, const bie_tensor *x, bie_tensor *out) {
    static const char *who = "model_forward";
    if (m == NULL) return bie_fail(BIE_ERR_NULL_POINTER, "%s: model is NULL", who);
    BIE_CHECK_NULL(out);
    BIE_TRY(check_io(m, x, "x", who));
    if (m->count == 0) return bie_fail(BIE_ERR_STATE, "%s: the model has no layers", who);
    bie_blas_threads(); /* the float layers' GEMMs (OpenBLAS) in this thread */
    /* The layers' recorded shapes change below: only a complete training forward allows a
     * backward again. */
    m->can_backward = false;
    BIE_TRY(plan_forward(m, x));
    if (!m->training) BIE_TRY(refresh_qweights(m));

    /* A failing layer (e.g. an all-zero input where scale_a is still to be measured) must
     * not leave scale_a initialised in the layers before it. */
    float *scale_before = NULL;
    if (m->training) {
        scale_before = malloc((size_t)m->count * sizeof(float));
        if (scale_before == NULL) return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: workspace", who);
        for (int i = 0; i < m->count; i++) scale_before[i] = scale_a_of(m, &m->layers[i]);
    }
    bie_status st = BIE_OK;
    for (int i = 0; i < m->count && st == BIE_OK; i++)
        st = layer_forward(m, i, m->acts[i], m->acts[i + 1]);
    if (st != BIE_OK) {
        if (scale_before)
            for (int i = 0; i < m->count; i++)
                if (scale_a_of(m, &m->layers[i]) != scale_before[i])
                    set_scale_a(&m->layers[i], scale_before[i]);
        free(scale_before);
        return st;
    }
    free(scale_before);
    if (m->training) {
        for (int i = 0; i < m->count; i++) {
            bie_train_layer *l = &m->layers[i];
            if (l->info.type == BIE_LAYER_BATCHNORM1D || l->info.type == BIE_LAYER_BATCHNORM2D)
                BIE_TRY(m->ops->batchnorm_update_running(l->info.in, l->info.momentum,
                                                         l->batch_mean, l->batch_var,
                                                         l->running_mean, l->running_var));
        }
        m->can_backward = true;
    }
    const bie_train_layer *last = &m->layers[m->count - 1];
    *out = view(m->acts[m->count], last->out_ndim, last->out_shape);
    return BIE_OK;
}

static bie_status layer_backward(bie_model *m, int i, const float *dy, float *dx) {
    bie_train_layer *l = &m->layers[i];
    const bie_layer_info *c = &l->info;
    const int64_t *s = l->in_shape;
    const int64_t n = numel_of(l->in_ndim, s);
    const float *x = m->acts[i];
    bie_tensor tdy = view((float *)dy, l->out_ndim, l->out_shape);
    bie_tensor tdx = view(dx, l->in_ndim, s);
    bie_tensor *pdx = dx ? &tdx : NULL;
    const bie_train_ops *k = m->ops;
    l->has_grad = true;
    switch (c->type) {
    case BIE_LAYER_LINEAR:
        return k->linear_backward(x, dy, n / c->in, c->in, c->out, l->weight, dx, l->grad_weight,
                                  l->grad_bias);
    case BIE_LAYER_BATCHNORM1D:
    case BIE_LAYER_BATCHNORM2D:
        return k->batchnorm_backward(l->saved_xhat, l->saved_invstd, dy, s[0], s[1],
                                     n / (s[0] * s[1]), l->weight, dx, l->grad_weight,
                                     l->grad_bias);
    case BIE_LAYER_RELU: return dx ? k->relu_backward(m->acts[i + 1], dy, n, dx) : BIE_OK;
    case BIE_LAYER_PRELU: {
        const int64_t ch = l->in_ndim >= 2 ? s[1] : 1,
                      inner = l->in_ndim >= 2 ? n / (s[0] * s[1]) : 1;
        return k->prelu_backward(x, dy, n / (ch * inner), ch, inner, l->weight, c->in, dx,
                                 l->grad_weight);
    }
    case BIE_LAYER_MAXPOOL2D:
        return dx ? k->maxpool_backward(dy, l->saved_argmax, s[0] * s[1], s[2], s[3],
                                        l->out_shape[2], l->out_shape[3], dx)
                  : BIE_OK;
    case BIE_LAYER_FLATTEN: return dx ? k->copy(dx, dy, (size_t)n * sizeof(float)) : BIE_OK;
    default:
        if (l->lowbit) return bie_layer_backward(l->lowbit, &tdy, pdx);
        break;
    }
    return bie_fail(BIE_ERR_INTERNAL, "model_backward: unknown layer type");
}

/* Two buffers of n floats on the model's device: layer i writes its input gradient into one
 * while reading its output gradient from the other. */
static bool ensure_grad_buffers(bie_model *m, int64_t n) {
    if (m->grad_cap >= n && m->grad_buf[0] && m->grad_buf[1]) return true;
    float *a = m->ops->alloc((size_t)n * sizeof(float));
    float *b = m->ops->alloc((size_t)n * sizeof(float));
    if (a == NULL || b == NULL) {
        m->ops->release(a);
        m->ops->release(b);
        return false;
    }
    m->ops->release(m->grad_buf[0]);
    m->ops->release(m->grad_buf[1]);
    m->grad_buf[0] = a;
    m->grad_buf[1] = b;
    m->grad_cap = n;
    return true;
}

bie_status bie_model_backward(bie_model *m, const bie_tensor *grad_out, bie_tensor *grad_x) {
    static const char *who = "model_backward";
    if (m == NULL) return bie_fail(BIE_ERR_NULL_POINTER, "%s: model is NULL", who);
    BIE_TRY(check_io(m, grad_out, "grad_out", who));
    if (!m->can_backward || !m->training)
        return bie_fail(BIE_ERR_STATE, "%s: no training forward since the model last changed", who);
    bie_blas_threads();
    const bie_train_layer *last = &m->layers[m->count - 1], *first = &m->layers[0];
    bie_tensor like = view(NULL, last->out_ndim, last->out_shape);
    if (!bie_train_same_shape(grad_out, &like))
        return bie_fail(BIE_ERR_SHAPE, "%s: grad_out must have the shape of the last output", who);
    if (grad_x) {
        BIE_TRY(check_io(m, grad_x, "grad_x", who));
        bie_tensor in_like = view(NULL, first->in_ndim, first->in_shape);
        if (!bie_train_same_shape(grad_x, &in_like))
            return bie_fail(BIE_ERR_SHAPE, "%s: grad_x must have the shape of the last input", who);
    }
    /* Host tensors of a model on another device pass through the gradient buffers: grad_out
     * is staged where layer count - 1 reads it, grad_x comes from where layer 0 writes. */
    const bool stage_out = grad_out->device.type != m->device.type;
    const bool stage_x = grad_x && grad_x->device.type != m->device.type;
    const int64_t out_n = numel_of(last->out_ndim, last->out_shape);
    const int64_t in_n = numel_of(first->in_ndim, first->in_shape);
    int64_t most = 1;
    for (int i = 0; i < m->count - 1; i++) {
        const int64_t n = numel_of(m->layers[i].out_ndim, m->layers[i].out_shape);
        most = n > most ? n : most;
    }
    if (stage_out && out_n > most) most = out_n;
    if (stage_x && in_n > most) most = in_n;
    if (!ensure_grad_buffers(m, most))
        return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: gradient buffers", who);
    const float *dy = grad_out->data;
    if (stage_out) {
        float *staged = m->grad_buf[m->count % 2];
        BIE_TRY(m->ops->copy(staged, grad_out->data, (size_t)out_n * sizeof(float)));
        dy = staged;
    }
    for (int i = m->count - 1; i >= 0; i--) {
        float *dx = i > 0 || stage_x ? m->grad_buf[i % 2] : grad_x ? grad_x->data : NULL;
        BIE_TRY(layer_backward(m, i, dy, dx));
        dy = dx;
    }
    if (stage_x) BIE_TRY(m->ops->copy(grad_x->data, m->grad_buf[0], (size_t)in_n * sizeof(float)));
    m->backward_count++;
    return BIE_OK;
}
