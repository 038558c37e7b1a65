/* The sequential model: building layers, their initialisation, mode switches, packing and
 * the architecture description. Forward / backward are in model_run.c, parameters in
 * model_params.c. */
#include <math.h>
#include <string.h>

#include "train_internal.h"

#define CHECK_MODEL(m)                                                                         \
    do {                                                                                       \
        if ((m) == NULL) return bie_fail(BIE_ERR_NULL_POINTER, "%s: model is NULL", __func__); \
    } while (0)

static bie_status create_binary_linear(const bie_layer_info *i, bie_device d, bie_layer **out) {
    return bie_binary_linear_create(out, i->in, i->out, d, BIE_F32, i->symmetric);
}
static bie_status create_binary_conv2d(const bie_layer_info *i, bie_device d, bie_layer **out) {
    return bie_binary_conv2d_create(out, i->in, i->out, i->kernel_size, i->stride, i->padding,
                                    i->dilation, d, BIE_F32, i->symmetric);
}
static bie_status create_q4_linear(const bie_layer_info *i, bie_device d, bie_layer **out) {
    return bie_q4_linear_create(out, i->in, i->out, d, BIE_F32);
}
static bie_status create_q4_conv2d(const bie_layer_info *i, bie_device d, bie_layer **out) {
    return bie_q4_conv2d_create(out, i->in, i->out, i->kernel_size, i->stride, i->padding,
                                i->dilation, d, BIE_F32);
}

/* Every layer type: name, low-bit, conv, kind of its weight, creator of its bie.h layer. */
static const bie_layer_type_traits kTypes[] = {
    [BIE_LAYER_LINEAR] = {"linear", false, false, BIE_PARAM_KIND_FLOAT, NULL},
    [BIE_LAYER_BATCHNORM1D] = {"batchnorm1d", false, false, BIE_PARAM_KIND_FLOAT, NULL},
    [BIE_LAYER_BATCHNORM2D] = {"batchnorm2d", false, false, BIE_PARAM_KIND_FLOAT, NULL},
    [BIE_LAYER_RELU] = {"relu", false, false, BIE_PARAM_KIND_FLOAT, NULL},
    [BIE_LAYER_PRELU] = {"prelu", false, false, BIE_PARAM_KIND_FLOAT, NULL},
    [BIE_LAYER_MAXPOOL2D] = {"maxpool2d", false, false, BIE_PARAM_KIND_FLOAT, NULL},
    [BIE_LAYER_FLATTEN] = {"flatten", false, false, BIE_PARAM_KIND_FLOAT, NULL},
    [BIE_LAYER_BINARY_LINEAR] = {"binary_linear", true, false, BIE_PARAM_KIND_BINARY,
                                 create_binary_linear},
    [BIE_LAYER_BINARY_CONV2D] = {"binary_conv2d", true, true, BIE_PARAM_KIND_BINARY,
                                 create_binary_conv2d},
    [BIE_LAYER_Q4_LINEAR] = {"q4_linear", true, false, BIE_PARAM_KIND_FLOAT, create_q4_linear},
    [BIE_LAYER_Q4_CONV2D] = {"q4_conv2d", true, true, BIE_PARAM_KIND_FLOAT, create_q4_conv2d},
    [BIE_LAYER_CONV2D] = {"conv2d", false, true, BIE_PARAM_KIND_FLOAT, NULL},
    [BIE_LAYER_AVGPOOL2D] = {"avgpool2d", false, false, BIE_PARAM_KIND_FLOAT, NULL},
    [BIE_LAYER_GLOBAL_AVGPOOL] = {"global_avgpool", false, false, BIE_PARAM_KIND_FLOAT, NULL},
    [BIE_LAYER_ADD] = {"add", false, false, BIE_PARAM_KIND_FLOAT, NULL},
    [BIE_LAYER_CONCAT] = {"concat", false, false, BIE_PARAM_KIND_FLOAT, NULL},
    [BIE_LAYER_RPRELU] = {"rprelu", false, false, BIE_PARAM_KIND_FLOAT, NULL},
};
#define TYPE_COUNT ((int)(sizeof kTypes / sizeof kTypes[0]))

const bie_layer_type_traits *bie_layer_type_traits_of(bie_layer_type type) {
    return (int)type >= 0 && (int)type < TYPE_COUNT ? &kTypes[type] : NULL;
}

const char *bie_layer_type_name(bie_layer_type type) {
    const bie_layer_type_traits *t = bie_layer_type_traits_of(type);
    return t ? t->name : NULL;
}

bie_status bie_layer_type_from_name(const char *name, bie_layer_type *type) {
    BIE_CHECK_NULL(name);
    BIE_CHECK_NULL(type);
    for (int t = 0; t < TYPE_COUNT; t++)
        if (strcmp(name, kTypes[t].name) == 0) {
            *type = (bie_layer_type)t;
            return BIE_OK;
        }
    return bie_fail(BIE_ERR_INVALID_ARGUMENT, "layer_type_from_name: unknown layer type '%s'",
                    name);
}

bie_status bie_model_create(bie_model **out) {
    BIE_CHECK_NULL(out);
    bie_model *m = calloc(1, sizeof *m);
    if (m == NULL) return bie_fail(BIE_ERR_OUT_OF_MEMORY, "model_create: model");
    m->training = true;
    m->generation = 1;
    m->device = bie_cpu();
    m->ops = bie_train_ops_for(m->device);
    *out = m;
    return BIE_OK;
}

void bie_model_layer_release(bie_train_layer *l) {
    const bie_train_ops *ops = bie_train_ops_for(l->device);
    if (ops) {
        float *const buffers[] = {l->weight,       l->bias,
                                  l->grad_weight,  l->grad_bias,
                                  l->running_mean, l->running_var,
                                  l->saved_xhat,   l->saved_invstd,
                                  l->batch_mean,   l->batch_var,
                                  l->shift_in,     l->grad_shift_in,
                                  l->work,         (float *)l->saved_argmax};
        for (size_t i = 0; i < sizeof buffers / sizeof buffers[0]; i++) ops->release(buffers[i]);
    }
    bie_layer_free(l->lowbit);
    memset(l, 0, sizeof *l);
}

void bie_model_free(bie_model *m) {
    if (m == NULL) return;
    for (int i = 0; i < m->count; i++) bie_model_layer_release(&m->layers[i]);
    free(m->layers);
    for (int i = 0; m->acts && i <= m->count; i++) m->ops->release(m->acts[i]);
    for (int i = 0; m->grads && i <= m->count; i++) m->ops->release(m->grads[i]);
    free(m->acts);
    free(m->act_cap);
    free(m->grads);
    free(m->grad_cap);
    m->ops->release(m->scratch);
    free(m->params);
    free(m);
}

/* The hyper-parameters that apply to info->type, checked, with every other field zero. */
bie_status bie_model_canonical_info(const bie_layer_info *in, bie_layer_info *out,
                                    const char *who) {
    bie_layer_info c;
    memset(&c, 0, sizeof c);
    c.type = in->type;
    const int64_t kMax = INT32_MAX;
    const bie_layer_type_traits *t = bie_layer_type_traits_of(in->type);
    if (t == NULL)
        return bie_fail(BIE_ERR_INVALID_ARGUMENT, "%s: unknown layer type %d", who, (int)in->type);
    if (in->type == BIE_LAYER_LINEAR || in->type == BIE_LAYER_CONV2D || t->low_bit) {
        if (in->in < 1 || in->out < 1 || in->in > kMax || in->out > kMax)
            return bie_fail(BIE_ERR_INVALID_ARGUMENT,
                            "%s: %s sizes (%lld, %lld) must be in "
                            "[1, 2^31 - 1]",
                            who, t->name, (long long)in->in, (long long)in->out);
        c.in = in->in;
        c.out = in->out;
        c.bias = (in->type == BIE_LAYER_LINEAR || in->type == BIE_LAYER_CONV2D) && in->bias;
        if (t->conv) {
            if (in->kernel_size < 1 || in->stride < 1 || in->padding < 0 || in->dilation < 1)
                return bie_fail(BIE_ERR_INVALID_ARGUMENT,
                                "%s: conv needs kernel_size >= 1, "
                                "stride >= 1, padding >= 0, dilation >= 1 (got %d, %d, %d, %d)",
                                who, in->kernel_size, in->stride, in->padding, in->dilation);
            c.kernel_size = in->kernel_size;
            c.stride = in->stride;
            c.padding = in->padding;
            c.dilation = in->dilation;
        }
        if (t->weight == BIE_PARAM_KIND_BINARY) {
            if (in->bits_binary_word != 8 && in->bits_binary_word != 32 &&
                in->bits_binary_word != 64)
                return bie_fail(BIE_ERR_INVALID_ARGUMENT,
                                "%s: bits_binary_word = %d must be 8, "
                                "32 or 64",
                                who, in->bits_binary_word);
            c.symmetric = in->symmetric;
            c.bits_binary_word = in->bits_binary_word;
        }
        *out = c;
        return BIE_OK;
    }
    switch (in->type) {
    case BIE_LAYER_BATCHNORM1D:
    case BIE_LAYER_BATCHNORM2D:
        if (in->in < 1 || in->in > kMax)
            return bie_fail(BIE_ERR_INVALID_ARGUMENT,
                            "%s: batch norm needs 1..2^31-1 features, "
                            "got %lld",
                            who, (long long)in->in);
        if (!isfinite(in->eps) || in->eps <= 0 || !isfinite(in->momentum) || in->momentum < 0 ||
            in->momentum > 1)
            return bie_fail(BIE_ERR_INVALID_ARGUMENT,
                            "%s: batch norm needs eps > 0 and momentum "
                            "in [0, 1] (got %g, %g)",
                            who, (double)in->eps, (double)in->momentum);
        c.in = in->in;
        c.eps = in->eps;
        c.momentum = in->momentum;
        break;
    case BIE_LAYER_PRELU:
    case BIE_LAYER_RPRELU:
        if (in->in < 1 || in->in > kMax)
            return bie_fail(BIE_ERR_INVALID_ARGUMENT, "%s: %s needs 1..2^31-1 %s, got %lld", who,
                            t->name, in->type == BIE_LAYER_PRELU ? "slopes" : "channels",
                            (long long)in->in);
        c.in = in->in;
        break;
    case BIE_LAYER_MAXPOOL2D:
    case BIE_LAYER_AVGPOOL2D:
        if (in->kernel_size < 1 || in->stride < 0)
            return bie_fail(BIE_ERR_INVALID_ARGUMENT,
                            "%s: %s needs kernel_size >= 1 and "
                            "stride >= 0 (got %d, %d)",
                            who, t->name, in->kernel_size, in->stride);
        c.kernel_size = in->kernel_size;
        c.stride = in->stride == 0 ? in->kernel_size : in->stride;
        break;
    default: /* ReLU, flatten, global pool, add, concat: no hyper-parameters */ break;
    }
    *out = c;
    return BIE_OK;
}

/* Storage and the low-bit object of a new layer; nothing is initialised yet. */
bie_status bie_model_build_layer(const bie_layer_info *info, bie_device device, bie_train_layer *l,
                                 const char *who) {
    memset(l, 0, sizeof *l);
    l->info = *info;
    l->device = device;
    const bie_train_ops *ops = bie_train_ops_for(device);
    if (ops == NULL)
        return bie_fail(BIE_ERR_DEVICE, "%s: no %s device in this build or on this machine", who,
                        device.type == BIE_DEVICE_CUDA ? "CUDA" : "such");
#define alloc_floats(n) ((float *)ops->alloc((size_t)(n) * sizeof(float)))
    bie_status st = BIE_OK;
    const int64_t in = info->in, out = info->out;
    switch (info->type) {
    case BIE_LAYER_LINEAR:
    case BIE_LAYER_CONV2D: {
        int64_t n, kk = 1;
        if (info->type == BIE_LAYER_CONV2D) kk = (int64_t)info->kernel_size * info->kernel_size;
        if (!bie_mul_ok(in, out, &n) || !bie_mul_ok(n, kk, &n) || n > ((int64_t)1 << 40))
            return bie_fail(BIE_ERR_OVERFLOW, "%s: %s %lld x %lld is too large", who,
                            bie_layer_type_name(info->type), (long long)out, (long long)in);
        l->weight = alloc_floats(n);
        l->grad_weight = alloc_floats(n);
        if (info->bias) {
            l->bias = alloc_floats(out);
            l->grad_bias = alloc_floats(out);
        }
        if (!l->weight || !l->grad_weight || (info->bias && (!l->bias || !l->grad_bias)))
            st = bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: %s parameters", who,
                          bie_layer_type_name(info->type));
        break;
    }
    case BIE_LAYER_RPRELU:
        l->weight = alloc_floats(in);
        l->grad_weight = alloc_floats(in);
        l->bias = alloc_floats(in);
        l->grad_bias = alloc_floats(in);
        l->shift_in = alloc_floats(in);
        l->grad_shift_in = alloc_floats(in);
        if (!l->weight || !l->grad_weight || !l->bias || !l->grad_bias || !l->shift_in ||
            !l->grad_shift_in)
            st = bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: RPReLU parameters", who);
        break;
    case BIE_LAYER_BATCHNORM1D:
    case BIE_LAYER_BATCHNORM2D:
        l->weight = alloc_floats(in);
        l->bias = alloc_floats(in);
        l->grad_weight = alloc_floats(in);
        l->grad_bias = alloc_floats(in);
        l->running_mean = alloc_floats(in);
        l->running_var = alloc_floats(in);
        l->saved_invstd = alloc_floats(in);
        l->batch_mean = alloc_floats(in);
        l->batch_var = alloc_floats(in);
        if (!l->weight || !l->bias || !l->grad_weight || !l->grad_bias || !l->running_mean ||
            !l->running_var || !l->saved_invstd || !l->batch_mean || !l->batch_var)
            st = bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: batch norm parameters", who);
        break;
    case BIE_LAYER_PRELU:
        l->weight = alloc_floats(in);
        l->grad_weight = alloc_floats(in);
        if (!l->weight || !l->grad_weight)
            st = bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: PReLU slopes", who);
        break;
    default: { /* low-bit types: their bie.h layer */
        const bie_layer_type_traits *t = bie_layer_type_traits_of(info->type);
        if (t == NULL || !t->low_bit) break;
        st = t->create(info, device, &l->lowbit);
        if (st == BIE_OK && t->weight == BIE_PARAM_KIND_BINARY)
            st = bie_layer_set_bits_binary_word(l->lowbit, info->bits_binary_word);
        break;
    }
    }
#undef alloc_floats
    if (st != BIE_OK) bie_model_layer_release(l);
    return st;
}

/* A layer's generator seed: a mix of the model seed and the layer index. */
static uint64_t layer_seed(uint64_t seed, int index) {
    uint64_t s = seed ^ ((uint64_t)(index + 1) * 0xD1B54A32D192ED69ull);
    return bie_train_splitmix64(&s);
}

/* Zero a low-bit layer's bias_a and scale_a, which reset_parameters leaves alone. */
static bie_status clear_activation_params(bie_train_layer *l) {
    bie_tensor bias;
    BIE_TRY(bie_layer_param(l->lowbit, BIE_PARAM_BIAS_A, &bias));
    BIE_TRY(bie_layer_set_scale_a(l->lowbit, 0.0f));
    return bie_train_ops_for(l->device)->zero(bias.data,
                                              (size_t)bie_tensor_numel(&bias) * sizeof(float));
}

/* Fill `count` floats of layer memory with `value`, or (value NaN) uniformly in ±bound. The
 * numbers are made on the host, so a layer on any device gets the same ones. */
static bie_status fill_layer(const bie_train_layer *l, float *dst, int64_t count, float value,
                             double bound, uint64_t *state) {
    float *host = malloc((size_t)count * sizeof(float));
    if (host == NULL) return bie_fail(BIE_ERR_OUT_OF_MEMORY, "model: initial values");
    if (isnan(value))
        bie_train_fill_uniform(host, count, bound, state);
    else
        for (int64_t i = 0; i < count; i++) host[i] = value;
    bie_status st = bie_train_ops_for(l->device)->copy(dst, host, (size_t)count * sizeof(float));
    free(host);
    return st;
}

bie_status bie_model_layer_reset(bie_model *m, int index, uint64_t seed) {
    bie_train_layer *l = &m->layers[index];
    uint64_t s = layer_seed(seed, index);
    const int64_t in = l->info.in, out = l->info.out;
    l->has_grad = false;
    l->prepared = false;
    switch (l->info.type) {
    case BIE_LAYER_LINEAR: { /* PyTorch: kaiming_uniform(a = sqrt(5)) = U(±1/sqrt(in)) */
        const double bound = 1.0 / sqrt((double)in);
        BIE_TRY(fill_layer(l, l->weight, in * out, NAN, bound, &s));
        if (l->bias) BIE_TRY(fill_layer(l, l->bias, out, NAN, bound, &s));
        return BIE_OK;
    }
    case BIE_LAYER_BATCHNORM1D:
    case BIE_LAYER_BATCHNORM2D:
        BIE_TRY(fill_layer(l, l->weight, in, 1.0f, 0, &s));
        BIE_TRY(fill_layer(l, l->bias, in, 0.0f, 0, &s));
        BIE_TRY(fill_layer(l, l->running_mean, in, 0.0f, 0, &s));
        return fill_layer(l, l->running_var, in, 1.0f, 0, &s);
    case BIE_LAYER_CONV2D: { /* U(±1/sqrt(fan_in)), fan_in = in k k */
        const int64_t kk = (int64_t)l->info.kernel_size * l->info.kernel_size;
        const double bound = 1.0 / sqrt((double)(in * kk));
        BIE_TRY(fill_layer(l, l->weight, in * out * kk, NAN, bound, &s));
        if (l->bias) BIE_TRY(fill_layer(l, l->bias, out, NAN, bound, &s));
        return BIE_OK;
    }
    case BIE_LAYER_PRELU: return fill_layer(l, l->weight, in, 0.25f, 0, &s);
    case BIE_LAYER_RPRELU:
        BIE_TRY(fill_layer(l, l->shift_in, in, 0.0f, 0, &s));
        BIE_TRY(fill_layer(l, l->weight, in, 0.25f, 0, &s));
        return fill_layer(l, l->bias, in, 0.0f, 0, &s);
    default:
        if (l->lowbit == NULL) return BIE_OK; /* ReLU, max-pool, flatten */
        BIE_TRY(bie_layer_reset_parameters(l->lowbit, s));
        return clear_activation_params(l);
    }
}

/* A structural change: parameters and their storage may differ, saved activations are
 * stale. */
static void changed(bie_model *m) {
    m->generation++;
    m->can_backward = false;
    m->qweight_stale = true;
}

/* Room for one more node in every per-node array; a failure leaves the model as it was. */
static bie_status grow(bie_model *m, const char *who) {
    if (m->count < m->capacity) return BIE_OK;
    const int cap = m->capacity ? 2 * m->capacity : 8;
    bie_train_layer *layers = realloc(m->layers, (size_t)cap * sizeof *layers);
    if (layers == NULL) return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: layer list", who);
    m->layers = layers;
    float ***const bufs[2] = {&m->acts, &m->grads};
    int64_t **const caps[2] = {&m->act_cap, &m->grad_cap};
    for (int b = 0; b < 2; b++) {
        float **p = realloc(*bufs[b], (size_t)(cap + 1) * sizeof *p);
        if (p == NULL) return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: layer list", who);
        const int old = *bufs[b] ? m->capacity + 1 : 0;
        *bufs[b] = p;
        int64_t *c = realloc(*caps[b], (size_t)(cap + 1) * sizeof *c);
        if (c == NULL) return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: layer list", who);
        *caps[b] = c;
        for (int i = old; i <= cap; i++) {
            p[i] = NULL;
            c[i] = 0;
        }
    }
    m->capacity = cap;
    return BIE_OK;
}

bie_status bie_model_append(bie_model *m, const bie_layer_info *c, int n_inputs, const int *inputs,
                            const char *who) {
    if (m->count == INT32_MAX / 2) return bie_fail(BIE_ERR_OVERFLOW, "%s: too many layers", who);
    BIE_TRY(grow(m, who));
    bie_train_layer l;
    BIE_TRY(bie_model_build_layer(c, m->device, &l, who));
    l.n_inputs = n_inputs;
    memcpy(l.inputs, inputs, (size_t)n_inputs * sizeof *inputs);
    m->layers[m->count] = l;
    bie_status st = bie_model_layer_reset(m, m->count, 0);
    if (st != BIE_OK) {
        bie_model_layer_release(&m->layers[m->count]);
        return st;
    }
    if (!m->training) { /* the new layer follows the model's mode */
        bie_train_layer *nl = &m->layers[m->count];
        if (nl->lowbit) st = bie_layer_set_training(nl->lowbit, false);
        if (st != BIE_OK) {
            bie_model_layer_release(nl);
            return st;
        }
    }
    m->count++;
    changed(m);
    return BIE_OK;
}

bie_status bie_model_add_layer(bie_model *m, const bie_layer_info *info) {
    CHECK_MODEL(m);
    const int input = m->count - 1; /* the node before, or BIE_MODEL_INPUT */
    return bie_model_add_node(m, info, 1, &input);
}

static bie_layer_info base_info(bie_layer_type type, int64_t in, int64_t out) {
    bie_layer_info i;
    memset(&i, 0, sizeof i);
    i.type = type;
    i.in = in;
    i.out = out;
    i.eps = 1e-5f;
    i.momentum = 0.1f;
    return i;
}

bie_status bie_model_add_linear(bie_model *m, int64_t in, int64_t out, bool bias) {
    bie_layer_info i = base_info(BIE_LAYER_LINEAR, in, out);
    i.bias = bias;
    return bie_model_add_layer(m, &i);
}

bie_status bie_model_add_batchnorm1d(bie_model *m, int64_t num_features) {
    bie_layer_info i = base_info(BIE_LAYER_BATCHNORM1D, num_features, 0);
    return bie_model_add_layer(m, &i);
}

bie_status bie_model_add_batchnorm2d(bie_model *m, int64_t num_channels) {
    bie_layer_info i = base_info(BIE_LAYER_BATCHNORM2D, num_channels, 0);
    return bie_model_add_layer(m, &i);
}

bie_status bie_model_add_relu(bie_model *m) {
    bie_layer_info i = base_info(BIE_LAYER_RELU, 0, 0);
    return bie_model_add_layer(m, &i);
}

bie_status bie_model_add_prelu(bie_model *m, int64_t num_parameters) {
    bie_layer_info i = base_info(BIE_LAYER_PRELU, num_parameters, 0);
    return bie_model_add_layer(m, &i);
}

bie_status bie_model_add_maxpool2d(bie_model *m, int kernel_size, int stride) {
    bie_layer_info i = base_info(BIE_LAYER_MAXPOOL2D, 0, 0);
    i.kernel_size = kernel_size;
    i.stride = stride;
    return bie_model_add_layer(m, &i);
}

bie_status bie_model_add_flatten(bie_model *m) {
    bie_layer_info i = base_info(BIE_LAYER_FLATTEN, 0, 0);
    return bie_model_add_layer(m, &i);
}

bie_status bie_model_add_conv2d(bie_model *m, int64_t in, int64_t out, int kernel_size, int stride,
                                int padding, bool bias) {
    bie_layer_info i = base_info(BIE_LAYER_CONV2D, in, out);
    i.kernel_size = kernel_size;
    i.stride = stride;
    i.padding = padding;
    i.dilation = 1;
    i.bias = bias;
    return bie_model_add_layer(m, &i);
}

bie_status bie_model_add_avgpool2d(bie_model *m, int kernel_size, int stride) {
    bie_layer_info i = base_info(BIE_LAYER_AVGPOOL2D, 0, 0);
    i.kernel_size = kernel_size;
    i.stride = stride;
    return bie_model_add_layer(m, &i);
}

bie_status bie_model_add_global_avgpool(bie_model *m) {
    bie_layer_info i = base_info(BIE_LAYER_GLOBAL_AVGPOOL, 0, 0);
    return bie_model_add_layer(m, &i);
}

bie_status bie_model_add_rprelu(bie_model *m, int64_t channels) {
    bie_layer_info i = base_info(BIE_LAYER_RPRELU, channels, 0);
    return bie_model_add_layer(m, &i);
}

bie_status bie_model_reset_parameters(bie_model *m, uint64_t seed) {
    CHECK_MODEL(m);
    if (m->packed)
        return bie_fail(BIE_ERR_STATE,
                        "model_reset_parameters: the model is packed (inference-only)");
    for (int i = 0; i < m->count; i++) BIE_TRY(bie_model_layer_reset(m, i, seed));
    changed(m);
    return BIE_OK;
}

bie_status bie_model_prepare_params(bie_model *m) {
    CHECK_MODEL(m);
    if (m->packed)
        return bie_fail(BIE_ERR_STATE,
                        "model_prepare_params: the model is packed (inference-only)");
    bool any = false;
    for (int i = 0; i < m->count; i++) {
        bie_train_layer *l = &m->layers[i];
        if (l->lowbit && bie_layer_type_traits_of(l->info.type)->weight == BIE_PARAM_KIND_BINARY) {
            bie_tensor w; /* a no-op once the weight is int8 */
            BIE_TRY(bie_layer_param(l->lowbit, BIE_PARAM_WEIGHT, &w));
            if (w.dtype != BIE_I8) {
                BIE_TRY(bie_layer_prepare_params(l->lowbit));
                any = true;
            }
        } else if (l->lowbit && !l->prepared) {
            /* scale_w stays fixed once set (here or loaded) while the float weight trains */
            BIE_TRY(bie_layer_prepare_params(l->lowbit));
            any = true;
        }
        l->prepared = true;
    }
    if (any) changed(m);
    return BIE_OK;
}

static bie_status layer_set_training(bie_train_layer *l, bool training) {
    return l->lowbit ? bie_layer_set_training(l->lowbit, training) : BIE_OK;
}

bie_status bie_model_set_training(bie_model *m, bool training) {
    CHECK_MODEL(m);
    if (m->packed && training)
        return bie_fail(BIE_ERR_STATE, "model_set_training: a packed model is inference-only");
    for (int i = 0; i < m->count; i++) BIE_TRY(layer_set_training(&m->layers[i], training));
    m->training = training;
    m->can_backward = false;
    /* Weights may have been written through parameter views: the next evaluation forward
     * packs them again. */
    m->qweight_stale = true;
    return BIE_OK;
}

bool bie_model_training(const bie_model *m) { return m && m->training; }
bool bie_model_packed(const bie_model *m) { return m && m->packed; }

bie_status bie_model_pack(bie_model *m) {
    CHECK_MODEL(m);
    if (m->packed) return BIE_OK;
    /* Check first that every low-bit layer still has a weight to pack. */
    for (int i = 0; i < m->count; i++) {
        bie_tensor w;
        if (m->layers[i].lowbit)
            BIE_TRY(bie_layer_param(m->layers[i].lowbit, BIE_PARAM_WEIGHT, &w));
    }
    for (int i = 0; i < m->count; i++) {
        bie_train_layer *l = &m->layers[i];
        if (l->lowbit) BIE_TRY(bie_layer_generate_quantized_weight(l->lowbit, true));
        BIE_TRY(layer_set_training(l, false));
        l->has_grad = false;
    }
    m->packed = true;
    m->training = false;
    changed(m);
    m->qweight_stale = false;
    return BIE_OK;
}

int bie_model_layer_count(const bie_model *m) { return m ? m->count : 0; }

bie_status bie_model_layer_info(const bie_model *m, int index, bie_layer_info *info) {
    CHECK_MODEL(m);
    BIE_CHECK_NULL(info);
    if (index < 0 || index >= m->count)
        return bie_fail(BIE_ERR_INVALID_ARGUMENT, "model_layer_info: index %d outside [0, %d)",
                        index, m->count);
    *info = m->layers[index].info;
    return BIE_OK;
}

bie_status bie_model_layer(bie_model *m, int index, bie_layer **layer) {
    static const char *who = "model_layer";
    CHECK_MODEL(m);
    BIE_CHECK_NULL(layer);
    if (index < 0 || index >= m->count)
        return bie_fail(BIE_ERR_INVALID_ARGUMENT, "%s: index %d outside [0, %d)", who, index,
                        m->count);
    const bie_train_layer *l = &m->layers[index];
    if (l->lowbit == NULL)
        return bie_fail(BIE_ERR_INVALID_ARGUMENT, "%s: layer %d is a %s, not a low-bit layer", who,
                        index, bie_layer_type_name(l->info.type));
    *layer = l->lowbit;
    return BIE_OK;
}
