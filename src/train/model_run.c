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

/* The shape of node j's output (j = BIE_MODEL_INPUT: the input's) in the last forward. */
static const int64_t *shape_of(const bie_model *m, int j, int *ndim) {
    if (j == BIE_MODEL_INPUT) {
        *ndim = m->x_ndim;
        return m->x_shape;
    }
    *ndim = m->layers[j].out_ndim;
    return m->layers[j].out_shape;
}

/* The conv geometry of a conv2d node in the last forward. */
static bie_conv_geom geom_of(const bie_train_layer *l) {
    const bie_layer_info *c = &l->info;
    bie_conv_geom g = {l->in_shape[0], l->in_shape[1],  l->in_shape[2],  l->in_shape[3],
                       c->out,         l->out_shape[2], l->out_shape[3], c->kernel_size,
                       c->stride,      c->padding,      c->dilation,     0};
    return g;
}

/* Shapes of every layer for this input, and every buffer the pass needs. */
static bie_status plan_forward(bie_model *m, const bie_tensor *x) {
    static const char *who = "model_forward";
    int *ndims = malloc((size_t)(m->count + 1) * sizeof *ndims);
    int64_t(*shapes)[BIE_MAX_DIMS] = malloc((size_t)(m->count + 1) * sizeof *shapes);
    bie_status st =
        ndims && shapes ? BIE_OK : bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: shape plan", who);
    if (st == BIE_OK) st = bie_model_plan_shapes(m, x->ndim, x->shape, ndims, shapes, who);
    const int64_t in_n = numel_of(x->ndim, x->shape);
    if (st == BIE_OK && !ensure(m, &m->acts[0], &m->act_cap[0], in_n))
        st = bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: input copy", who);
    /* Copied before any other buffer moves: x may be a view of the previous output. */
    if (st == BIE_OK) st = m->ops->copy(m->acts[0], x->data, (size_t)in_n * sizeof(float));
    if (st == BIE_OK) {
        m->x_ndim = ndims[0];
        memcpy(m->x_shape, shapes[0], sizeof m->x_shape);
    }
    for (int i = 0; i < m->count && st == BIE_OK; i++) {
        bie_train_layer *l = &m->layers[i];
        const int first = l->inputs[0] + 1;
        l->in_ndim = ndims[first];
        memcpy(l->in_shape, shapes[first], sizeof l->in_shape);
        l->out_ndim = ndims[i + 1];
        memcpy(l->out_shape, shapes[i + 1], sizeof l->out_shape);
        const int64_t n = numel_of(l->in_ndim, l->in_shape);
        const int64_t out_n = numel_of(l->out_ndim, l->out_shape);
        if (!ensure(m, &m->acts[i + 1], &m->act_cap[i + 1], out_n)) {
            st = bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: activations of layer %d", who, i);
            break;
        }
        const bie_layer_type t = l->info.type;
        if (m->training && (t == BIE_LAYER_BATCHNORM1D || t == BIE_LAYER_BATCHNORM2D)) {
            if (n / l->in_shape[1] < 2) {
                st = bie_fail(BIE_ERR_SHAPE,
                              "%s: layer %d (batch norm) needs more than one "
                              "value per channel in training mode",
                              who, i);
                break;
            }
            if (!ensure(m, &l->saved_xhat, &l->saved_cap, n))
                st = bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: batch norm of layer %d", who, i);
        }
        if (m->training && t == BIE_LAYER_MAXPOOL2D &&
            !ensure(m, &l->saved_argmax, &l->saved_cap, out_n))
            st = bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: max-pool of layer %d", who, i);
        if (t == BIE_LAYER_CONV2D) {
            const bie_conv_geom g = geom_of(l);
            if (!ensure(m, &l->work, &l->work_cap, m->ops->conv2d_work_floats(&g)))
                st = bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: conv2d of layer %d", who, i);
        }
        if (st == BIE_OK && m->training && l->lowbit &&
            bie_layer_type_traits_of(t)->weight == BIE_PARAM_KIND_BINARY) {
            bie_tensor w;
            st = bie_layer_param(l->lowbit, BIE_PARAM_WEIGHT, &w);
            if (st != BIE_OK || w.dtype != BIE_I8)
                st = bie_fail(BIE_ERR_STATE,
                              "%s: layer %d's binary weight is not int8: call "
                              "bie_model_prepare_params before training",
                              who, i);
        }
    }
    free(ndims);
    free(shapes);
    return st;
}

#define view(data, ndim, shape) bie_model_view(m, (data), BIE_F32, (ndim), (shape))

/* Read without a view: a view would tell a CUDA layer that scale_a may have been written,
 * and its next forward would read it back again. */
static float scale_a_of(bie_train_layer *l) {
    float v = 0.0f;
    if (l->lowbit && bie_layer_get_scale_a(l->lowbit, &v) != BIE_OK) v = 0.0f;
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

/* [outer, channels, inner] of an input whose dim 1 holds the channels. */
static void channel_split(int ndim, const int64_t *s, int64_t *outer, int64_t *ch, int64_t *inner) {
    const int64_t n = numel_of(ndim, s);
    *outer = s[0];
    *ch = ndim >= 2 ? s[1] : 1;
    *inner = n / (*outer * *ch);
}

/* Add or concat: every input into y. */
static bie_status merge_forward(bie_model *m, const bie_train_layer *l, float *y) {
    const bie_train_ops *k = m->ops;
    const int64_t n = numel_of(l->out_ndim, l->out_shape);
    if (l->info.type == BIE_LAYER_ADD) {
        BIE_TRY(k->add_forward(m->acts[l->inputs[0] + 1], m->acts[l->inputs[1] + 1], n, y));
        for (int j = 2; j < l->n_inputs; j++)
            BIE_TRY(k->add_forward(y, m->acts[l->inputs[j] + 1], n, y));
        return BIE_OK;
    }
    int64_t offset = 0;
    for (int j = 0; j < l->n_inputs; j++) {
        int nd;
        const int64_t *sj = shape_of(m, l->inputs[j], &nd);
        int64_t outer, ci, inner;
        channel_split(nd, sj, &outer, &ci, &inner);
        BIE_TRY(k->concat_copy(m->acts[l->inputs[j] + 1], outer, ci, inner, l->out_shape[1], offset,
                               y));
        offset += ci;
    }
    return BIE_OK;
}

static bie_status layer_forward(bie_model *m, int i) {
    bie_train_layer *l = &m->layers[i];
    const bie_layer_info *c = &l->info;
    const int64_t *s = l->in_shape;
    const int64_t n = numel_of(l->in_ndim, s);
    const float *x = m->acts[l->inputs[0] + 1];
    float *y = m->acts[i + 1];
    bie_tensor tx = view((float *)x, l->in_ndim, s), ty = view(y, l->out_ndim, l->out_shape);
    const bie_train_ops *k = m->ops;
    int64_t outer, ch, inner;
    channel_split(l->in_ndim, s, &outer, &ch, &inner);
    switch (c->type) {
    case BIE_LAYER_LINEAR:
        return k->linear_forward(x, n / c->in, c->in, c->out, l->weight, l->bias, y);
    case BIE_LAYER_CONV2D: {
        const bie_conv_geom g = geom_of(l);
        return k->conv2d_forward(&g, x, l->weight, l->bias, y, l->work);
    }
    case BIE_LAYER_BATCHNORM1D:
    case BIE_LAYER_BATCHNORM2D:
        if (m->training)
            return k->batchnorm_forward_train(x, outer, ch, inner, l->weight, l->bias, c->eps, y,
                                              l->saved_xhat, l->saved_invstd, l->batch_mean,
                                              l->batch_var);
        return k->batchnorm_forward_eval(x, outer, ch, inner, l->weight, l->bias, c->eps,
                                         l->running_mean, l->running_var, y);
    case BIE_LAYER_RELU: return k->relu_forward(x, n, y);
    case BIE_LAYER_PRELU: return k->prelu_forward(x, outer, ch, inner, l->weight, c->in, y);
    case BIE_LAYER_RPRELU:
        return k->rprelu_forward(x, outer, ch, inner, l->shift_in, l->weight, l->bias, y);
    case BIE_LAYER_MAXPOOL2D:
        return k->maxpool_forward(x, s[0] * s[1], s[2], s[3], c->kernel_size, c->stride,
                                  l->out_shape[2], l->out_shape[3], y,
                                  m->training ? l->saved_argmax : NULL);
    case BIE_LAYER_AVGPOOL2D:
        return k->avgpool_forward(x, s[0] * s[1], s[2], s[3], c->kernel_size, c->stride,
                                  l->out_shape[2], l->out_shape[3], y);
    case BIE_LAYER_GLOBAL_AVGPOOL: return k->global_avgpool_forward(x, s[0] * s[1], s[2] * s[3], y);
    case BIE_LAYER_FLATTEN: return k->copy(y, x, (size_t)n * sizeof(float));
    case BIE_LAYER_ADD:
    case BIE_LAYER_CONCAT: return merge_forward(m, l, y);
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
        for (int i = 0; i < m->count; i++) scale_before[i] = scale_a_of(&m->layers[i]);
    }
    bie_status st = BIE_OK;
    for (int i = 0; i < m->count && st == BIE_OK; i++) st = layer_forward(m, i);
    if (st != BIE_OK) {
        if (scale_before)
            for (int i = 0; i < m->count; i++)
                if (scale_a_of(&m->layers[i]) != scale_before[i])
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

/* Backward of a one-input node: dy is d loss / d output, dx (NULL: not needed) receives
 * d loss / d input; parameter gradients are overwritten. */
static bie_status layer_backward(bie_model *m, int i, const float *dy, float *dx) {
    bie_train_layer *l = &m->layers[i];
    const bie_layer_info *c = &l->info;
    const int64_t *s = l->in_shape;
    const int64_t n = numel_of(l->in_ndim, s);
    const float *x = m->acts[l->inputs[0] + 1];
    bie_tensor tdy = view((float *)dy, l->out_ndim, l->out_shape);
    bie_tensor tdx = view(dx, l->in_ndim, s);
    bie_tensor *pdx = dx ? &tdx : NULL;
    const bie_train_ops *k = m->ops;
    int64_t outer, ch, inner;
    channel_split(l->in_ndim, s, &outer, &ch, &inner);
    l->has_grad = true;
    switch (c->type) {
    case BIE_LAYER_LINEAR:
        return k->linear_backward(x, dy, n / c->in, c->in, c->out, l->weight, dx, l->grad_weight,
                                  l->grad_bias);
    case BIE_LAYER_CONV2D: {
        const bie_conv_geom g = geom_of(l);
        return k->conv2d_backward(&g, x, dy, l->weight, dx, l->grad_weight, l->grad_bias, l->work);
    }
    case BIE_LAYER_BATCHNORM1D:
    case BIE_LAYER_BATCHNORM2D:
        return k->batchnorm_backward(l->saved_xhat, l->saved_invstd, dy, outer, ch, inner,
                                     l->weight, dx, l->grad_weight, l->grad_bias);
    case BIE_LAYER_RELU: return dx ? k->relu_backward(m->acts[i + 1], dy, n, dx) : BIE_OK;
    case BIE_LAYER_PRELU:
        return k->prelu_backward(x, dy, outer, ch, inner, l->weight, c->in, dx, l->grad_weight);
    case BIE_LAYER_RPRELU:
        return k->rprelu_backward(x, dy, outer, ch, inner, l->shift_in, l->weight, dx,
                                  l->grad_shift_in, l->grad_weight, l->grad_bias);
    case BIE_LAYER_MAXPOOL2D:
        return dx ? k->maxpool_backward(dy, l->saved_argmax, s[0] * s[1], s[2], s[3],
                                        l->out_shape[2], l->out_shape[3], dx)
                  : BIE_OK;
    case BIE_LAYER_AVGPOOL2D:
        return dx ? k->avgpool_backward(dy, s[0] * s[1], s[2], s[3], c->kernel_size, c->stride,
                                        l->out_shape[2], l->out_shape[3], dx)
                  : BIE_OK;
    case BIE_LAYER_GLOBAL_AVGPOOL:
        return dx ? k->global_avgpool_backward(dy, s[0] * s[1], s[2] * s[3], dx) : BIE_OK;
    case BIE_LAYER_FLATTEN: return dx ? k->copy(dx, dy, (size_t)n * sizeof(float)) : BIE_OK;
    default:
        if (l->lowbit) return bie_layer_backward(l->lowbit, &tdy, pdx);
        break;
    }
    return bie_fail(BIE_ERR_INTERNAL, "model_backward: unknown layer type");
}

/* Gradient buffers. Row r (0: the input, i + 1: node i's output) has a gradient from the
 * backward of its last reader until its own node's backward; rows whose lifetimes do not
 * overlap share a slot (m->grads[slot]), so a chain needs two slots, as a ping-pong. */
typedef struct grad_plan {
    int *slot;     /* per row: its slot, -1 while it has none */
    bool *set;     /* per row: its gradient holds a value (later ones are added) */
    int64_t *need; /* per slot: floats */
    int slots;
} grad_plan;

static int64_t row_numel(const bie_model *m, int row) {
    int nd;
    const int64_t *s = shape_of(m, row - 1, &nd);
    return numel_of(nd, s);
}

/* Give row r a slot: a free one (free_list, *n_free), else a new one. */
static void take_slot(const bie_model *m, grad_plan *g, int *free_list, int *n_free, int r) {
    if (g->slot[r] >= 0) return;
    const int s = *n_free > 0 ? free_list[--*n_free] : g->slots++;
    g->slot[r] = s;
    const int64_t n = row_numel(m, r);
    if (g->need[s] < n) g->need[s] = n;
}

/* The slots of one backward (the order of bie_model_backward's loop). */
static bie_status plan_grads(bie_model *m, bool want_x, bool stage_out, grad_plan *g,
                             const char *who) {
    const int rows = m->count + 1;
    g->slot = calloc((size_t)rows, sizeof *g->slot);
    g->set = calloc((size_t)rows, sizeof *g->set);
    g->need = calloc((size_t)rows, sizeof *g->need);
    int *free_list = calloc((size_t)rows, sizeof *free_list), n_free = 0;
    g->slots = 0;
    if (!g->slot || !g->set || !g->need || !free_list) {
        free(free_list);
        return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: workspace", who);
    }
    for (int r = 0; r < rows; r++) g->slot[r] = -1;
    if (stage_out) take_slot(m, g, free_list, &n_free, m->count);
    for (int i = m->count - 1; i >= 0; i--) {
        if (i < m->count - 1) take_slot(m, g, free_list, &n_free, i + 1); /* nobody read it */
        const bie_train_layer *l = &m->layers[i];
        for (int q = 0; q < l->n_inputs; q++)
            if (l->inputs[q] != BIE_MODEL_INPUT || want_x)
                take_slot(m, g, free_list, &n_free, l->inputs[q] + 1);
        if (g->slot[i + 1] >= 0) free_list[n_free++] = g->slot[i + 1]; /* dead after node i */
    }
    free(free_list);
    for (int s = 0; s < g->slots; s++)
        if (!ensure(m, &m->grads[s], &m->grad_cap[s], g->need[s]))
            return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: gradient buffers", who);
    return BIE_OK;
}

static void free_plan(grad_plan *g) {
    free(g->slot);
    free(g->set);
    free(g->need);
}

static float *row_grad(const bie_model *m, const grad_plan *g, int row) {
    return m->grads[g->slot[row]];
}

/* Where the gradient for input j goes: straight into its row's buffer when nothing is there
 * yet, else into the scratch buffer, to be added (finish_input). NULL when that gradient is
 * not needed (the model's input without grad_x). */
static float *input_target(bie_model *m, grad_plan *g, int j, bool want_x, int64_t n,
                           const char *who, bie_status *st) {
    const int row = j + 1;
    if (j == BIE_MODEL_INPUT && !want_x) return NULL;
    if (!g->set[row]) return row_grad(m, g, row);
    if (!ensure(m, &m->scratch, &m->scratch_cap, n))
        *st = bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: gradient buffers", who);
    return m->scratch;
}

static bie_status finish_input(bie_model *m, grad_plan *g, int j, const float *written, int64_t n) {
    const int row = j + 1;
    if (written == NULL) return BIE_OK;
    if (g->set[row]) return m->ops->accumulate(row_grad(m, g, row), written, n);
    g->set[row] = true;
    return BIE_OK;
}

/* Backward of node i from dy into every input's gradient. */
static bie_status node_backward(bie_model *m, int i, const float *dy, grad_plan *g, bool want_x,
                                const char *who) {
    bie_train_layer *l = &m->layers[i];
    const bie_layer_type t = l->info.type;
    bie_status st = BIE_OK;
    if (t != BIE_LAYER_ADD && t != BIE_LAYER_CONCAT) {
        const int j = l->inputs[0];
        const int64_t nj = numel_of(l->in_ndim, l->in_shape);
        float *dx = input_target(m, g, j, want_x, nj, who, &st);
        BIE_TRY(st);
        BIE_TRY(layer_backward(m, i, dy, dx));
        return finish_input(m, g, j, dx, nj);
    }
    int64_t offset = 0;
    for (int q = 0; q < l->n_inputs; q++) {
        const int j = l->inputs[q];
        int nd;
        const int64_t *sj = shape_of(m, j, &nd);
        const int64_t nj = numel_of(nd, sj);
        int64_t outer, ci, inner;
        channel_split(nd, sj, &outer, &ci, &inner);
        if (j == BIE_MODEL_INPUT && !want_x) {
            offset += ci;
            continue;
        }
        if (t == BIE_LAYER_ADD && g->set[j + 1]) {
            BIE_TRY(m->ops->accumulate(row_grad(m, g, j + 1), dy, nj)); /* no copy to add */
        } else {
            float *dx = input_target(m, g, j, want_x, nj, who, &st);
            BIE_TRY(st);
            BIE_TRY(t == BIE_LAYER_ADD
                        ? m->ops->copy(dx, dy, (size_t)nj * sizeof(float))
                        : m->ops->concat_slice(dy, outer, ci, inner, l->out_shape[1], offset, dx));
            BIE_TRY(finish_input(m, g, j, dx, nj));
        }
        offset += ci;
    }
    l->has_grad = true;
    return BIE_OK;
}

bie_status bie_model_backward(bie_model *m, const bie_tensor *grad_out, bie_tensor *grad_x) {
    static const char *who = "model_backward";
    if (m == NULL) return bie_fail(BIE_ERR_NULL_POINTER, "%s: model is NULL", who);
    BIE_TRY(check_io(m, grad_out, "grad_out", who));
    if (!m->can_backward || !m->training)
        return bie_fail(BIE_ERR_STATE, "%s: no training forward since the model last changed", who);
    bie_blas_threads();
    const bie_train_layer *last = &m->layers[m->count - 1];
    bie_tensor like = view(NULL, last->out_ndim, last->out_shape);
    if (!bie_train_same_shape(grad_out, &like))
        return bie_fail(BIE_ERR_SHAPE, "%s: grad_out must have the shape of the last output", who);
    if (grad_x) {
        BIE_TRY(check_io(m, grad_x, "grad_x", who));
        bie_tensor in_like = view(NULL, m->x_ndim, m->x_shape);
        if (!bie_train_same_shape(grad_x, &in_like))
            return bie_fail(BIE_ERR_SHAPE, "%s: grad_x must have the shape of the last input", who);
    }
    /* The last node reads grad_out where it is, or a copy on the model's device. */
    const bool stage_out = grad_out->device.type != m->device.type;
    grad_plan g;
    bie_status st = plan_grads(m, grad_x != NULL, stage_out, &g, who);
    const float *dy_last = grad_out->data;
    const int64_t out_n = numel_of(last->out_ndim, last->out_shape);
    if (st == BIE_OK && stage_out) {
        dy_last = row_grad(m, &g, m->count);
        st = m->ops->copy((float *)dy_last, grad_out->data, (size_t)out_n * sizeof(float));
    }
    for (int i = m->count - 1; i >= 0 && st == BIE_OK; i--) {
        const float *dy = dy_last;
        if (i < m->count - 1) {
            if (!g.set[i + 1]) { /* nobody reads this node's output: its gradient is zero */
                const int64_t n = row_numel(m, i + 1);
                st = m->ops->zero(row_grad(m, &g, i + 1), (size_t)n * sizeof(float));
                g.set[i + 1] = true;
            }
            dy = row_grad(m, &g, i + 1);
        }
        if (st == BIE_OK) st = node_backward(m, i, dy, &g, grad_x != NULL, who);
    }
    if (st == BIE_OK && grad_x) {
        const int64_t in_n = numel_of(m->x_ndim, m->x_shape);
        st = g.set[0] ? m->ops->copy(grad_x->data, row_grad(m, &g, 0), (size_t)in_n * sizeof(float))
                      : bie_fail(BIE_ERR_INTERNAL, "%s: no gradient reached the input", who);
    }
    free_plan(&g);
    if (st == BIE_OK) m->backward_count++;
    return st;
}
