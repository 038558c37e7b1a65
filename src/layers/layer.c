/* The life cycle of every layer, written once over the kind table and the (kind, device) ops
 * tables of layer.h. Each call checks its arguments, lets the device change the weight or
 * run the kernels, and keeps the common state (mode, kernel, saved forward) consistent. On
 * error nothing has changed: the ops validate and allocate before they change anything. */
#include <string.h>

#include "conv_common.h"
#include "layer.h"

#define CHECK_LAYER(l)                                                                         \
    do {                                                                                       \
        if ((l) == NULL) return bie_fail(BIE_ERR_NULL_POINTER, "%s: layer is NULL", __func__); \
    } while (0)

/* ---------------------------------------------------------------- common state */

void bie_layer_drop_saved(bie_layer *l) {
    bie_free_aligned(l->saved_signs);
    bie_free_aligned(l->saved_mask);
    bie_free_aligned(l->saved_wbits);
    bie_free_aligned(l->saved_codes);
    bie_free_aligned(l->saved_resid);
    bie_free_aligned(l->saved_wcodes);
    l->saved_signs = l->saved_mask = l->saved_wbits = l->saved_codes = NULL;
    l->saved_resid = l->saved_wcodes = NULL;
    l->has_saved = false;
}

int bie_layer_weight_shape(const bie_layer *l, int64_t *shape) {
    shape[0] = l->out;
    shape[1] = l->in;
    if (!l->kind->conv) return 2;
    shape[2] = shape[3] = l->k;
    return 4;
}

bie_tensor bie_layer_saved_like(const bie_layer *l) {
    bie_tensor like;
    memset(&like, 0, sizeof like);
    like.ndim = l->saved_ndim;
    memcpy(like.shape, l->saved_shape, sizeof like.shape);
    return like;
}

bie_conv_geom bie_layer_conv_geom(const bie_layer *l, const bie_tensor *x) {
    return bie_conv_geometry(x, l->out, l->k, l->stride, l->padding, l->dilation);
}

double bie_layer_scale_a_factor(const bie_layer *l) {
    return l->kind->scale_a_factor[l->symmetric ? 1 : 0];
}

bie_status bie_layer_activation_scale(const bie_layer *l, const bie_tensor *x, float *scale) {
    return bie_activation_scale(l->scale_a, x->data, bie_tensor_numel(x),
                                bie_layer_scale_a_factor(l), l->kind->name, scale);
}

/* ---------------------------------------------------------------- create, free */

static bie_status create(bie_layer **out, const bie_kind_def *kind, int64_t in, int64_t outf,
                         int64_t k, int64_t s, int64_t p, int64_t d, bie_device device,
                         bie_dtype dtype, bool symmetric) {
    BIE_TRY(bie_layer_check_device(device, dtype, kind->name));
    const bie_layer_ops *ops = bie_layer_ops_for(kind->id, device.type);
    if (ops == NULL)
        return bie_fail(BIE_ERR_DEVICE, "%s: this build has no %s layer on this device", kind->name,
                        kind->name);
    bie_layer *l = calloc(1, sizeof *l);
    if (l == NULL) return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: layer", kind->name);
    l->kind = kind;
    l->ops = ops;
    l->in = in;
    l->out = outf;
    l->k = k;
    l->stride = s;
    l->padding = p;
    l->dilation = d;
    l->fan_in = in * k * k;
    l->device = device;
    l->dtype = dtype;
    l->symmetric = symmetric;
    l->training = true;
    l->kernel_id = -1;
    bie_bw_init(&l->w, outf, l->fan_in);
    bie_q4w_init(&l->qw, outf, l->fan_in);
    l->bias_a = bie_layer_bias_alloc(in);
    bie_status st = l->bias_a ? BIE_OK : bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: bias_a", kind->name);
    if (st == BIE_OK && ops->init) st = ops->init(l);
    if (st == BIE_OK) st = ops->weight->reset(l, 0);
    if (st != BIE_OK) {
        bie_layer_free(l);
        return st;
    }
    *out = l;
    return BIE_OK;
}

bie_status bie_binary_linear_create(bie_layer **out, int64_t in_features, int64_t out_features,
                                    bie_device device, bie_dtype dtype, bool symmetric) {
    const bie_kind_def *kind = bie_kind_get(BIE_KIND_BINARY_LINEAR);
    BIE_CHECK_NULL(out);
    if (in_features < 1 || out_features < 1 || in_features > INT32_MAX || out_features > INT32_MAX)
        return bie_fail(BIE_ERR_INVALID_ARGUMENT,
                        "%s: in_features (%lld) and out_features (%lld) must be in 1..2^31-1",
                        kind->name, (long long)in_features, (long long)out_features);
    int64_t numel;
    if (!bie_mul_ok(in_features, out_features, &numel) || numel > (INT64_MAX / 8))
        return bie_fail(BIE_ERR_OVERFLOW, "%s: weight of %lld x %lld elements is too large",
                        kind->name, (long long)out_features, (long long)in_features);
    return create(out, kind, in_features, out_features, 1, 1, 0, 1, device, dtype, symmetric);
}

bie_status bie_q4_linear_create(bie_layer **out, int64_t in_features, int64_t out_features,
                                bie_device device, bie_dtype dtype) {
    const bie_kind_def *kind = bie_kind_get(BIE_KIND_Q4_LINEAR);
    BIE_CHECK_NULL(out);
    if (in_features < 1 || out_features < 1 || in_features > (1 << 24) || out_features > INT32_MAX)
        return bie_fail(BIE_ERR_INVALID_ARGUMENT,
                        "%s: in_features must be in 1..2^24 and out_features in 1..2^31-1 (got "
                        "%lld, %lld)",
                        kind->name, (long long)in_features, (long long)out_features);
    return create(out, kind, in_features, out_features, 1, 1, 0, 1, device, dtype, false);
}

static bie_status create_conv(bie_layer **out, bie_layer_kind id, int64_t in_c, int64_t out_c,
                              int k, int s, int p, int d, bie_device device, bie_dtype dtype,
                              bool symmetric) {
    const bie_kind_def *kind = bie_kind_get(id);
    BIE_CHECK_NULL(out);
    BIE_TRY(bie_conv_check_params(in_c, out_c, k, s, p, d, kind->name));
    return create(out, kind, in_c, out_c, k, s, p, d, device, dtype, symmetric);
}

bie_status bie_binary_conv2d_create(bie_layer **out, int64_t in_channels, int64_t out_channels,
                                    int kernel_size, int stride, int padding, int dilation,
                                    bie_device device, bie_dtype dtype, bool symmetric) {
    return create_conv(out, BIE_KIND_BINARY_CONV2D, in_channels, out_channels, kernel_size, stride,
                       padding, dilation, device, dtype, symmetric);
}

bie_status bie_q4_conv2d_create(bie_layer **out, int64_t in_channels, int64_t out_channels,
                                int kernel_size, int stride, int padding, int dilation,
                                bie_device device, bie_dtype dtype) {
    return create_conv(out, BIE_KIND_Q4_CONV2D, in_channels, out_channels, kernel_size, stride,
                       padding, dilation, device, dtype, false);
}

void bie_layer_free(bie_layer *l) {
    if (l == NULL) return;
    if (l->ops->release) l->ops->release(l);
    bie_layer_drop_saved(l);
    bie_bw_free(&l->w);
    bie_q4w_free(&l->qw);
    bie_free_aligned(l->bias_a);
    bie_grads_free(&l->grads);
    bie_ws_free(&l->ws);
    free(l);
}

bie_status bie_layer_describe(const bie_layer *l, bie_layer_desc *desc) {
    CHECK_LAYER(l);
    BIE_CHECK_NULL(desc);
    memset(desc, 0, sizeof *desc);
    desc->kind = l->kind->id;
    desc->name = l->kind->name;
    desc->in = l->in;
    desc->out = l->out;
    desc->fan_in = l->fan_in;
    if (l->kind->conv) {
        desc->kernel_size = (int)l->k;
        desc->stride = (int)l->stride;
        desc->padding = (int)l->padding;
        desc->dilation = (int)l->dilation;
    }
    desc->device = l->device;
    desc->dtype = l->dtype;
    desc->symmetric = l->kind->binary && l->symmetric;
    desc->training = l->training;
    desc->kernel_id = l->kernel_id;
    desc->bits_binary_word = l->kind->binary ? l->w.word_bits : 0;
    return BIE_OK;
}

/* ---------------------------------------------------------------- the weight */

bie_status bie_layer_reset_parameters(bie_layer *l, uint64_t seed) {
    CHECK_LAYER(l);
    BIE_TRY(l->ops->weight->reset(l, seed));
    bie_layer_drop_saved(l);
    return BIE_OK;
}

bie_status bie_layer_prepare_params(bie_layer *l) {
    CHECK_LAYER(l);
    const bool was_float = l->ops->weight->weight_is_float(l);
    BIE_TRY(l->ops->weight->prepare(l, l->kind->who.prepare_params));
    if (was_float) bie_layer_drop_saved(l);
    return BIE_OK;
}

bie_status bie_layer_check_rows(const bie_layer *l, const bie_tensor *t, const char *what,
                                bie_dtype dtype, int64_t last, const bie_tensor *like,
                                const char *who) {
    if (t == NULL) return bie_fail(BIE_ERR_NULL_POINTER, "%s: %s is NULL", who, what);
    bie_tensor host;
    BIE_TRY(l->ops->device->on_device(l, t, what, who, &host));
    return bie_check_rows_tensor(&host, what, dtype, last, like, who);
}

/* t must be a tensor of `dtype` on the layer's device with exactly the given shape. */
static bie_status check_exact(const bie_layer *l, const bie_tensor *t, const char *what,
                              bie_dtype dtype, int ndim, const int64_t *shape, const char *who) {
    BIE_TRY(bie_layer_check_rows(l, t, what, dtype, shape[ndim - 1], NULL, who));
    bool same = t->ndim == ndim;
    for (int i = 0; same && i < ndim; i++) same = t->shape[i] == shape[i];
    if (same) return BIE_OK;
    if (ndim == 2)
        return bie_fail(BIE_ERR_SHAPE, "%s: %s must be [%lld, %lld]", who, what,
                        (long long)shape[0], (long long)shape[1]);
    return bie_fail(BIE_ERR_SHAPE, "%s: %s must be [%lld, %lld, %lld, %lld]", who, what,
                    (long long)shape[0], (long long)shape[1], (long long)shape[2],
                    (long long)shape[3]);
}

bie_status bie_layer_set_weight_data(bie_layer *l, const bie_tensor *w) {
    CHECK_LAYER(l);
    const char *who = l->kind->who.set_weight_data;
    int64_t shape[4];
    const int ndim = bie_layer_weight_shape(l, shape);
    BIE_TRY(check_exact(l, w, "weight", l->dtype, ndim, shape, who));
    BIE_TRY(l->ops->weight->set_data(l, w, who));
    bie_layer_drop_saved(l);
    return BIE_OK;
}

bie_status bie_layer_generate_quantized_weight(bie_layer *l, bool qweight_only) {
    CHECK_LAYER(l);
    BIE_TRY(l->ops->weight->generate(l, qweight_only, l->kind->who.generate_quantized_weight));
    if (qweight_only) bie_layer_drop_saved(l);
    return BIE_OK;
}

/* QWEIGHT's dtype and row length. */
static void qweight_format(const bie_layer *l, bie_dtype *dtype, int64_t *row) {
    if (l->kind->binary) {
        *dtype = bie_bw_word_dtype(l->w.word_bits);
        *row = bie_packed_words(l->fan_in, l->w.word_bits);
    } else {
        *dtype = BIE_U8;
        *row = bie_nibble_row_bytes(l->fan_in);
    }
}

bie_status bie_layer_set_quantized_weight_data(bie_layer *l, const bie_tensor *q) {
    CHECK_LAYER(l);
    const char *who = l->kind->who.set_quantized_weight_data;
    bie_dtype dtype;
    int64_t shape[2] = {l->out, 0};
    qweight_format(l, &dtype, &shape[1]);
    BIE_TRY(check_exact(l, q, "qweight", dtype, 2, shape, who));
    return l->ops->weight->set_qweight(l, q, who);
}

bie_status bie_layer_set_bits_binary_word(bie_layer *l, int bits) {
    CHECK_LAYER(l);
    if (l->ops->weight->set_word_bits == NULL)
        return bie_fail(BIE_ERR_UNSUPPORTED, "%s: a 4-bit layer has no binary word size",
                        l->kind->name);
    return l->ops->weight->set_word_bits(l, bits, l->kind->name);
}

bie_status bie_layer_param(bie_layer *l, bie_param which, bie_tensor *v) {
    CHECK_LAYER(l);
    BIE_CHECK_NULL(v);
    int64_t shape[4];
    const int ndim = bie_layer_weight_shape(l, shape);
    return l->ops->weight->param(l, which, ndim, shape, v);
}

bie_status bie_layer_grad(bie_layer *l, bie_param which, bie_tensor *v) {
    CHECK_LAYER(l);
    BIE_CHECK_NULL(v);
    int64_t shape[4];
    const int ndim = bie_layer_weight_shape(l, shape);
    return l->ops->weight->grad(l, which, ndim, shape, v);
}

bie_status bie_layer_opt_weight(bie_layer *l, bie_tensor *v) {
    CHECK_LAYER(l);
    BIE_CHECK_NULL(v);
    if (l->training) return bie_layer_param(l, BIE_PARAM_WEIGHT, v);
    if (!l->ops->weight->has_qweight(l)) BIE_TRY(bie_layer_generate_quantized_weight(l, false));
    return bie_layer_param(l, BIE_PARAM_QWEIGHT, v);
}

bie_status bie_layer_set_scale_a(bie_layer *l, float scale_a) {
    CHECK_LAYER(l);
    BIE_TRY(bie_check_scale_a(scale_a, l->kind->name));
    return l->ops->weight->set_scale_a(l, scale_a);
}

bie_status bie_layer_get_scale_a(bie_layer *l, float *scale_a) {
    CHECK_LAYER(l);
    BIE_CHECK_NULL(scale_a);
    return l->ops->weight->get_scale_a(l, scale_a);
}

/* ---------------------------------------------------------------- running it */

/* The float input of a layer: NCHW with room for the kernel (conv kinds) or rows of `in`. */
static bie_status check_float_input(const bie_layer *l, const bie_tensor *x, const char *who) {
    if (x == NULL) return bie_fail(BIE_ERR_NULL_POINTER, "%s: input is NULL", who);
    bie_tensor h;
    BIE_TRY(l->ops->device->on_device(l, x, "input", who, &h));
    if (l->kind->conv)
        return bie_conv_check_input_as(&h, l->dtype, l->in, l->k, l->stride, l->padding,
                                       l->dilation, who);
    if (h.dtype != l->dtype && h.dtype != BIE_U8 && h.dtype != BIE_U32 && h.dtype != BIE_U64)
        return bie_fail(BIE_ERR_DTYPE, "%s: input dtype %s differs from the layer's %s", who,
                        bie_dtype_name(h.dtype), bie_dtype_name(l->dtype));
    return bie_check_rows_tensor(&h, "input", l->dtype, l->in, NULL, who);
}

bie_status bie_layer_check_forward(const bie_layer *l, const bie_tensor *x) {
    CHECK_LAYER(l);
    const char *who = l->kind->who.check_forward;
    const bool packed = x && (x->dtype == BIE_U8 || x->dtype == BIE_U32 || x->dtype == BIE_U64);
    if (!packed || !l->kind->packed_input) return check_float_input(l, x, who);
    bie_tensor h;
    BIE_TRY(l->ops->device->on_device(l, x, "packed input", who, &h));
    const bie_dtype word = bie_bw_word_dtype(l->w.word_bits);
    if (x->dtype != word)
        return bie_fail(BIE_ERR_DTYPE, "%s: packed input is %s but bits_binary_word is %d (%s)",
                        who, bie_dtype_name(x->dtype), l->w.word_bits, bie_dtype_name(word));
    return bie_check_rows_tensor(&h, "packed input", word, bie_packed_words(l->in, l->w.word_bits),
                                 NULL, who);
}

bie_status bie_layer_output_shape(const bie_layer *l, int in_ndim, const int64_t *in_shape,
                                  int *out_ndim, int64_t *out_shape) {
    CHECK_LAYER(l);
    BIE_CHECK_NULL(in_shape);
    BIE_CHECK_NULL(out_ndim);
    BIE_CHECK_NULL(out_shape);
    const char *name = l->kind->name;
    if (in_ndim < 1 || in_ndim > BIE_MAX_DIMS)
        return bie_fail(BIE_ERR_SHAPE, "%s: input rank %d is not in 1..%d", name, in_ndim,
                        BIE_MAX_DIMS);
    for (int i = 0; i < in_ndim; i++)
        if (in_shape[i] < 1) return bie_fail(BIE_ERR_SHAPE, "%s: input extents must be >= 1", name);
    if (!l->kind->conv) {
        if (in_shape[in_ndim - 1] != l->in)
            return bie_fail(BIE_ERR_SHAPE, "%s: input's last extent is %lld, expected %lld", name,
                            (long long)in_shape[in_ndim - 1], (long long)l->in);
        memcpy(out_shape, in_shape, (size_t)in_ndim * sizeof *in_shape);
        out_shape[in_ndim - 1] = l->out;
        *out_ndim = in_ndim;
        return BIE_OK;
    }
    if (in_ndim != 4 || in_shape[1] != l->in)
        return bie_fail(BIE_ERR_SHAPE, "%s: input must be [N, %lld, H, W]", name, (long long)l->in);
    const int64_t oh = bie_conv_out_extent(in_shape[2], l->k, l->stride, l->padding, l->dilation);
    const int64_t ow = bie_conv_out_extent(in_shape[3], l->k, l->stride, l->padding, l->dilation);
    if (oh < 1 || ow < 1)
        return bie_fail(BIE_ERR_SHAPE,
                        "%s: input of %lld x %lld is smaller than the dilated "
                        "kernel with padding",
                        name, (long long)in_shape[2], (long long)in_shape[3]);
    out_shape[0] = in_shape[0];
    out_shape[1] = l->out;
    out_shape[2] = oh;
    out_shape[3] = ow;
    *out_ndim = 4;
    return BIE_OK;
}

bie_status bie_layer_set_activation(bie_layer *l, const bie_tensor *x, bie_tensor *x_out) {
    CHECK_LAYER(l);
    const char *who = l->kind->who.set_activation;
    BIE_TRY(check_float_input(l, x, who));
    if (x_out)
        BIE_TRY(bie_layer_check_rows(l, x_out, "output", l->dtype, x->shape[x->ndim - 1], x, who));
    return l->ops->device->activate(l, x, x_out, who);
}

bie_status bie_layer_set_gemm_kernel(bie_layer *l, int id) {
    CHECK_LAYER(l);
    if (id != -1) BIE_TRY(l->ops->device->check_kernel(l, id, "set_gemm_kernel"));
    l->kernel_id = id;
    return BIE_OK;
}

bie_status bie_layer_select_gemm_kernel(bie_layer *l, const bie_tensor *x) {
    BIE_TRY(bie_layer_check_forward(l, x));
    int id = -1;
    BIE_TRY(l->ops->device->select_kernel(l, x, &id));
    l->kernel_id = id;
    return BIE_OK;
}

bie_status bie_layer_set_backward_mode(bie_layer *l, bie_backward_mode mode) {
    static const char *who = "set_backward_mode";
    CHECK_LAYER(l);
    if (mode != BIE_BACKWARD_EXACT && mode != BIE_BACKWARD_FP8)
        return bie_fail(BIE_ERR_INVALID_ARGUMENT, "%s_%s: unknown backward mode %d", l->kind->name,
                        who, (int)mode);
    if (mode != BIE_BACKWARD_EXACT) {
        if (l->ops->check_backward_mode == NULL)
            return bie_fail(BIE_ERR_UNSUPPORTED,
                            "%s_%s: the FP8 backward exists for the binary linear and conv2d "
                            "layers on CUDA devices with FP8 tensor cores only",
                            l->kind->name, who);
        BIE_TRY(l->ops->check_backward_mode(l, (int)mode, who));
    }
    l->backward_mode = (int)mode;
    return BIE_OK;
}

bie_status bie_layer_set_channels_last(bie_layer *l, bool channels_last) {
    static const char *who = "set_channels_last";
    CHECK_LAYER(l);
    if (!l->kind->conv)
        return bie_fail(BIE_ERR_INVALID_ARGUMENT, "%s_%s: only conv layers have channels",
                        l->kind->name, who);
    if (channels_last && !l->ops->channels_last)
        return bie_fail(BIE_ERR_UNSUPPORTED,
                        "%s_%s: NHWC activations exist for the binary conv2d on CUDA only",
                        l->kind->name, who);
    l->channels_last = channels_last;
    return BIE_OK;
}

bie_status bie_layer_get_channels_last(const bie_layer *l, bool *channels_last) {
    CHECK_LAYER(l);
    if (channels_last == NULL)
        return bie_fail(BIE_ERR_NULL_POINTER, "get_channels_last: NULL channels_last");
    *channels_last = l->channels_last;
    return BIE_OK;
}

bie_status bie_layer_get_backward_mode(const bie_layer *l, bie_backward_mode *mode) {
    CHECK_LAYER(l);
    if (mode == NULL) return bie_fail(BIE_ERR_NULL_POINTER, "get_backward_mode: NULL mode");
    *mode = (bie_backward_mode)l->backward_mode;
    return BIE_OK;
}

bie_status bie_layer_set_training(bie_layer *l, bool training) {
    CHECK_LAYER(l);
    if (!training) bie_layer_drop_saved(l);
    l->training = training;
    return BIE_OK;
}

bie_status bie_layer_forward(bie_layer *l, const bie_tensor *x, bie_tensor *out) {
    CHECK_LAYER(l);
    return l->ops->forward(l, x, out);
}

bie_status bie_layer_forward_again(bie_layer *l, bie_tensor *out) {
    CHECK_LAYER(l);
    if (out == NULL) return bie_fail(BIE_ERR_NULL_POINTER, "%s: out is NULL", __func__);
    if (l->ops->forward_again == NULL)
        return bie_fail(BIE_ERR_UNSUPPORTED,
                        "%s: %s keeps no state to compute its output from (the binary kinds "
                        "do)",
                        __func__, l->kind->name);
    return l->ops->forward_again(l, out);
}

/* The dtype of the weight's gradient (bie_layer_grad(WEIGHT)): I8 for an int8 training
 * weight, else F32; an error where the layer has no training weight. */
static bie_status weight_grad_dtype(const bie_layer *l, bie_dtype *dt, const char *who) {
    if (!l->ops->weight->has_weight(l))
        return bie_fail(BIE_ERR_STATE, "%s: the layer has no training weight", who);
    *dt = l->ops->weight->weight_is_float(l) ? BIE_F32 : BIE_I8;
    return BIE_OK;
}

bie_status bie_layer_set_weight_grad_target(bie_layer *l, const bie_tensor *target) {
    static const char *who = "bie_layer_set_weight_grad_target";
    CHECK_LAYER(l);
    if (target == NULL) {
        l->wgrad_target = NULL;
        return BIE_OK;
    }
    bie_dtype want = BIE_F32;
    BIE_TRY(weight_grad_dtype(l, &want, who));
    bie_tensor host;
    BIE_TRY(l->ops->device->on_device(l, target, "target", who, &host));
    if (target->dtype != want)
        return bie_fail(BIE_ERR_DTYPE, "%s: target is %s, the weight's gradient %s", who,
                        bie_dtype_name(target->dtype), bie_dtype_name(want));
    const int64_t numel = l->out * l->fan_in; /* the weight's elements */
    if (bie_tensor_numel(target) != numel)
        return bie_fail(BIE_ERR_SHAPE, "%s: target has %lld elements, the weight %lld", who,
                        (long long)bie_tensor_numel(target), (long long)numel);
    if (target->data == NULL && numel > 0)
        return bie_fail(BIE_ERR_NULL_POINTER, "%s: target's data is NULL", who);
    l->wgrad_target = target->data;
    l->wgrad_target_dtype = want;
    return BIE_OK;
}

bie_status bie_layer_backward(bie_layer *l, const bie_tensor *grad_out, bie_tensor *grad_x) {
    static const char *who = "bie_layer_backward";
    CHECK_LAYER(l);
    if (l->wgrad_target) { /* prepare_params may have changed the weight since it was set */
        bie_dtype now = BIE_F32;
        BIE_TRY(weight_grad_dtype(l, &now, who));
        if (now != l->wgrad_target_dtype)
            return bie_fail(BIE_ERR_STATE,
                            "%s: the weight's gradient target is %s but the gradient is now %s "
                            "(set the target again)",
                            who, bie_dtype_name(l->wgrad_target_dtype), bie_dtype_name(now));
    }
    bie_blas_threads(); /* the CPU backward's float GEMMs (OpenBLAS) in this thread */
    BIE_TRY(l->ops->backward(l, grad_out, grad_x));
    if (l->wgrad_target && !l->ops->wgrad_target_direct) { /* host memory (CPU layers) */
        bie_tensor v;
        const bie_status st = bie_layer_grad(l, BIE_PARAM_WEIGHT, &v);
        if (st == BIE_OK && bie_tensor_numel(&v) > 0)
            memcpy(l->wgrad_target, v.data, (size_t)bie_tensor_numel(&v) * bie_dtype_size(v.dtype));
        l->wgrad_target = NULL;
        return st;
    }
    l->wgrad_target = NULL;
    return BIE_OK;
}
