/* The model's parameters by name: enumeration (for optimizers, model files, inspection)
 * and loading values into them. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "bie_cuda.h"
#include "train_internal.h"

/* Parameters of the float layers, in `bie_param_entry.which`. */
enum { SLOT_WEIGHT, SLOT_BIAS, SLOT_RUNNING_MEAN, SLOT_RUNNING_VAR, SLOT_SHIFT_IN };

static void add_entry(bie_param_entry *list, int *n, int layer, const char *name,
                      bie_param_kind kind, int which) {
    if (list) {
        bie_param_entry *e = &list[*n];
        snprintf(e->name, sizeof e->name, "%d.%s", layer, name);
        e->layer = layer;
        e->kind = kind;
        e->which = which;
    }
    (*n)++;
}

/* Entries of the model's current state; with list NULL only counts them. */
static int list_params(const bie_model *m, bie_param_entry *list) {
    int n = 0;
    for (int i = 0; i < m->count; i++) {
        const bie_layer_info *c = &m->layers[i].info;
        if (m->layers[i].lowbit) {
            if (m->packed)
                add_entry(list, &n, i, "qweight", BIE_PARAM_KIND_PACKED, BIE_PARAM_QWEIGHT);
            else
                add_entry(list, &n, i, "weight", bie_layer_type_traits_of(c->type)->weight,
                          BIE_PARAM_WEIGHT);
            add_entry(list, &n, i, "bias_a", BIE_PARAM_KIND_FLOAT, BIE_PARAM_BIAS_A);
            add_entry(list, &n, i, "scale_a", BIE_PARAM_KIND_FLOAT, BIE_PARAM_SCALE_A);
            add_entry(list, &n, i, "scale_w", BIE_PARAM_KIND_BUFFER, BIE_PARAM_SCALE_W);
            continue;
        }
        switch (c->type) {
        case BIE_LAYER_LINEAR:
        case BIE_LAYER_CONV2D:
            add_entry(list, &n, i, "weight", BIE_PARAM_KIND_FLOAT, SLOT_WEIGHT);
            if (c->bias) add_entry(list, &n, i, "bias", BIE_PARAM_KIND_FLOAT, SLOT_BIAS);
            break;
        case BIE_LAYER_BATCHNORM1D:
        case BIE_LAYER_BATCHNORM2D:
            add_entry(list, &n, i, "weight", BIE_PARAM_KIND_FLOAT, SLOT_WEIGHT);
            add_entry(list, &n, i, "bias", BIE_PARAM_KIND_FLOAT, SLOT_BIAS);
            add_entry(list, &n, i, "running_mean", BIE_PARAM_KIND_BUFFER, SLOT_RUNNING_MEAN);
            add_entry(list, &n, i, "running_var", BIE_PARAM_KIND_BUFFER, SLOT_RUNNING_VAR);
            break;
        case BIE_LAYER_PRELU:
            add_entry(list, &n, i, "weight", BIE_PARAM_KIND_FLOAT, SLOT_WEIGHT);
            break;
        case BIE_LAYER_RPRELU:
            add_entry(list, &n, i, "shift_in", BIE_PARAM_KIND_FLOAT, SLOT_SHIFT_IN);
            add_entry(list, &n, i, "weight", BIE_PARAM_KIND_FLOAT, SLOT_WEIGHT);
            add_entry(list, &n, i, "shift_out", BIE_PARAM_KIND_FLOAT, SLOT_BIAS);
            break;
        default: break;
        }
    }
    return n;
}

bie_status bie_model_refresh_params(bie_model *m) {
    if (m->params_generation == m->generation) return BIE_OK;
    const int n = list_params(m, NULL);
    bie_param_entry *list = calloc((size_t)(n > 0 ? n : 1), sizeof *list);
    if (list == NULL) return bie_fail(BIE_ERR_OUT_OF_MEMORY, "model: parameter list");
    list_params(m, list);
    free(m->params);
    m->params = list;
    m->param_count = n;
    m->params_generation = m->generation;
    return BIE_OK;
}

int bie_model_param_count(const bie_model *m) { return m ? list_params(m, NULL) : 0; }

/* Value and gradient views of one entry. */
static bie_status fill_param(bie_model *m, const bie_param_entry *e, bie_model_param *p) {
    bie_train_layer *l = &m->layers[e->layer];
    bie_model_param r;
    memset(&r, 0, sizeof r);
    r.name = e->name;
    r.layer = e->layer;
    r.kind = e->kind;
    if (l->lowbit) {
        BIE_TRY(bie_layer_param(l->lowbit, (bie_param)e->which, &r.value));
        if (l->has_grad && e->kind != BIE_PARAM_KIND_BUFFER && e->kind != BIE_PARAM_KIND_PACKED)
            BIE_TRY(bie_layer_grad(l->lowbit, (bie_param)e->which, &r.grad));
        *p = r;
        return BIE_OK;
    }
    const bie_layer_info *c = &l->info;
    float *value = NULL, *grad = NULL;
    int64_t shape[4] = {c->in, 0, 0, 0};
    int ndim = 1;
    switch (e->which) {
    case SLOT_WEIGHT:
        value = l->weight;
        grad = l->grad_weight;
        if (c->type == BIE_LAYER_LINEAR || c->type == BIE_LAYER_CONV2D) {
            shape[0] = c->out;
            shape[1] = c->in;
            ndim = 2;
        }
        if (c->type == BIE_LAYER_CONV2D) {
            shape[2] = shape[3] = c->kernel_size;
            ndim = 4;
        }
        break;
    case SLOT_BIAS:
        value = l->bias;
        grad = l->grad_bias;
        if (c->type == BIE_LAYER_LINEAR || c->type == BIE_LAYER_CONV2D) shape[0] = c->out;
        break;
    case SLOT_SHIFT_IN:
        value = l->shift_in;
        grad = l->grad_shift_in;
        break;
    case SLOT_RUNNING_MEAN: value = l->running_mean; break;
    case SLOT_RUNNING_VAR: value = l->running_var; break;
    default: return bie_fail(BIE_ERR_INTERNAL, "model: unknown parameter slot");
    }
    r.value = bie_model_view(m, value, BIE_F32, ndim, shape);
    if (grad && l->has_grad) r.grad = bie_model_view(m, grad, BIE_F32, ndim, shape);
    *p = r;
    return BIE_OK;
}

bie_status bie_model_param_get(bie_model *m, int index, bie_model_param *param) {
    if (m == NULL) return bie_fail(BIE_ERR_NULL_POINTER, "model_param_get: model is NULL");
    BIE_CHECK_NULL(param);
    BIE_TRY(bie_model_refresh_params(m));
    if (index < 0 || index >= m->param_count)
        return bie_fail(BIE_ERR_INVALID_ARGUMENT, "model_param_get: index %d outside [0, %d)",
                        index, m->param_count);
    return fill_param(m, &m->params[index], param);
}

static bie_status find_entry(bie_model *m, const char *name, const char *who,
                             const bie_param_entry **out) {
    if (m == NULL) return bie_fail(BIE_ERR_NULL_POINTER, "%s: model is NULL", who);
    BIE_CHECK_NULL(name);
    BIE_TRY(bie_model_refresh_params(m));
    for (int i = 0; i < m->param_count; i++)
        if (strcmp(m->params[i].name, name) == 0) {
            *out = &m->params[i];
            return BIE_OK;
        }
    return bie_fail(BIE_ERR_INVALID_ARGUMENT, "%s: the model has no parameter '%s'%s", who, name,
                    m->packed ? " (packed model: low-bit layers have qweight, not weight)" : "");
}

bie_status bie_model_param_find(bie_model *m, const char *name, bie_model_param *param) {
    BIE_CHECK_NULL(param);
    const bie_param_entry *e;
    BIE_TRY(find_entry(m, name, "model_param_find", &e));
    return fill_param(m, e, param);
}

static bie_status check_finite(const bie_tensor *src, const char *name, const char *who) {
    const float *f = src->data;
    for (int64_t i = 0; i < bie_tensor_numel(src); i++)
        if (!isfinite(f[i]))
            return bie_fail(BIE_ERR_NOT_FINITE, "%s: '%s' holds non-finite values", who, name);
    return BIE_OK;
}

/* `src` (host memory) as a tensor on the model's device: itself on the CPU, else a new
 * device copy that the caller frees (owns_data). */
static bie_status on_model_device(const bie_model *m, const bie_tensor *src, bie_tensor *out) {
    if (m->device.type == BIE_DEVICE_CPU) {
        *out = *src;
        out->owns_data = false;
        return BIE_OK;
    }
    BIE_TRY(bie_cuda_tensor_alloc(out, src->dtype, src->ndim, src->shape, m->device.index));
    bie_status st = bie_tensor_copy(out, src);
    if (st != BIE_OK) bie_tensor_free(out);
    return st;
}

/* A binary layer's weight from an F32 or I8 source (see bie_model_set_param). */
static bie_status set_binary_weight(bie_model *m, bie_train_layer *l, const bie_tensor *src,
                                    const bie_tensor *cur, const char *who) {
    if (src->dtype == BIE_I8) {
        const int8_t *q = src->data;
        for (int64_t i = 0; i < bie_tensor_numel(src); i++)
            if (q[i] == INT8_MIN)
                return bie_fail(BIE_ERR_INVALID_ARGUMENT, "%s: int8 weights must be in [-127, 127]",
                                who);
        if (cur->dtype != BIE_I8) { /* make the layer's weight int8 first, then overwrite it */
            BIE_TRY(bie_layer_prepare_params(l->lowbit));
            m->generation++;
        }
        bie_tensor now;
        BIE_TRY(bie_layer_param(l->lowbit, BIE_PARAM_WEIGHT, &now));
        BIE_TRY(m->ops->copy(now.data, src->data, (size_t)bie_tensor_numel(src)));
        l->prepared = true;
        return BIE_OK;
    }
    if (src->dtype != BIE_F32)
        return bie_fail(BIE_ERR_DTYPE, "%s: a binary weight is loaded from F32 or I8", who);
    BIE_TRY(check_finite(src, "weight", who));
    if (cur->dtype == BIE_F32)
        return m->ops->copy(cur->data, src->data, (size_t)bie_tensor_numel(src) * sizeof(float));
    bie_tensor staged;
    BIE_TRY(on_model_device(m, src, &staged));
    bie_status st = bie_layer_set_weight_data(l->lowbit, &staged);
    if (staged.owns_data) bie_tensor_free(&staged);
    if (st == BIE_OK) m->generation++; /* the int8 weight was reallocated */
    return st;
}

static bie_status set_packed(bie_model *m, bie_train_layer *l, const bie_tensor *src) {
    bie_tensor staged;
    BIE_TRY(on_model_device(m, src, &staged));
    bie_status st = bie_layer_set_quantized_weight_data(l->lowbit, &staged);
    if (staged.owns_data) bie_tensor_free(&staged);
    return st;
}

static bie_status set_from_host(bie_model *m, const bie_param_entry *e, const bie_tensor *src,
                                const char *who) {
    const char *name = e->name;
    bie_model_param p;
    BIE_TRY(fill_param(m, e, &p));
    if (!bie_train_same_shape(src, &p.value))
        return bie_fail(BIE_ERR_SHAPE, "%s: '%s' has another shape than the source", who, name);
    bie_train_layer *l = &m->layers[e->layer];
    const bool low_bit = l->lowbit != NULL;
    if (e->kind == BIE_PARAM_KIND_BINARY) {
        BIE_TRY(set_binary_weight(m, l, src, &p.value, who));
    } else if (e->kind == BIE_PARAM_KIND_PACKED) {
        BIE_TRY(set_packed(m, l, src));
    } else {
        if (src->dtype != BIE_F32)
            return bie_fail(BIE_ERR_DTYPE, "%s: '%s' is F32, the source is %s", who, name,
                            bie_dtype_name(src->dtype));
        BIE_TRY(check_finite(src, name, who));
        if (!low_bit && e->which == SLOT_RUNNING_VAR)
            for (int64_t i = 0; i < bie_tensor_numel(src); i++)
                if (((const float *)src->data)[i] < 0)
                    return bie_fail(BIE_ERR_INVALID_ARGUMENT, "%s: '%s' must not be negative", who,
                                    name);
        const float v0 = *(const float *)src->data;
        if (low_bit && e->which == BIE_PARAM_SCALE_A) {
            BIE_TRY(bie_layer_set_scale_a(l->lowbit, v0));
        } else {
            if (low_bit && e->which == BIE_PARAM_SCALE_W) {
                if (!(v0 > 0))
                    return bie_fail(BIE_ERR_NOT_FINITE, "%s: '%s' must be > 0", who, name);
                l->prepared = true; /* a loaded scale_w is kept by prepare_params */
            }
            BIE_TRY(m->ops->copy(p.value.data, src->data,
                                 (size_t)bie_tensor_numel(src) * sizeof(float)));
        }
    }
    if (!m->packed) m->qweight_stale = true;
    return BIE_OK;
}

bie_status bie_model_set_param(bie_model *m, const char *name, const bie_tensor *src) {
    static const char *who = "model_set_param";
    const bie_param_entry *e;
    BIE_TRY(find_entry(m, name, who, &e));
    BIE_CHECK_NULL(src);
    if (src->data == NULL) return bie_fail(BIE_ERR_NULL_POINTER, "%s: '%s' has no data", who, name);
    if (src->device.type == BIE_DEVICE_CPU) return set_from_host(m, e, src, who);
    if (src->device.type != BIE_DEVICE_CUDA)
        return bie_fail(BIE_ERR_DEVICE, "%s: '%s' comes from an unknown device", who, name);
    /* A device source is checked (finite, in range) on the host like any other. */
    bie_tensor host;
    BIE_TRY(bie_tensor_alloc(&host, src->dtype, src->ndim, src->shape));
    bie_status st = bie_tensor_copy(&host, src);
    if (st == BIE_OK) st = set_from_host(m, e, &host, who);
    bie_tensor_free(&host);
    return st;
}
