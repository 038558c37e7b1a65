/* Binary linear layer (SPEC §2): life cycle and forward. Backward in
 * binary_linear_backward.c, kernel selection in select_kernel.c. */
#include <math.h>
#include <string.h>

#include "../cpu/dispatch.h"
#include "../cpu/frame/pack.h"
#include "binary_linear_cuda.h"
#include "binary_linear_impl.h"

static const char *const MODULE = "binary_linear";

#define CHECK_LAYER(l)                                                                         \
    do {                                                                                       \
        if ((l) == NULL) return bie_fail(BIE_ERR_NULL_POINTER, "%s: layer is NULL", __func__); \
    } while (0)

/* ---------------------------------------------------------------- helpers */

static void drop_saved(bie_binary_linear *l) {
    bie_free_aligned(l->saved_signs);
    bie_free_aligned(l->saved_mask);
    bie_free_aligned(l->saved_wbits);
    l->saved_signs = l->saved_mask = l->saved_wbits = NULL;
    l->has_saved = false;
}

#define packed_dtype bie_bw_word_dtype

/* ---------------------------------------------------------------- life cycle */

bie_status bie_binary_linear_create(bie_binary_linear **out, int64_t in_features,
                                    int64_t out_features, bie_device device, bie_dtype dtype,
                                    bool symmetric) {
    BIE_CHECK_NULL(out);
    if (in_features < 1 || out_features < 1 || in_features > INT32_MAX || out_features > INT32_MAX)
        return bie_fail(BIE_ERR_INVALID_ARGUMENT,
                        "%s: in_features (%lld) and out_features (%lld) must be in 1..2^31-1",
                        MODULE, (long long)in_features, (long long)out_features);
    int64_t numel;
    if (!bie_mul_ok(in_features, out_features, &numel) || numel > (INT64_MAX / 8))
        return bie_fail(BIE_ERR_OVERFLOW, "%s: weight of %lld x %lld elements is too large", MODULE,
                        (long long)out_features, (long long)in_features);
    BIE_TRY(bie_layer_check_device(device, dtype, MODULE));
    bie_binary_linear *l = calloc(1, sizeof *l);
    if (l == NULL) return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: layer", MODULE);
    l->in = in_features;
    l->out = out_features;
    l->device = device;
    l->dtype = dtype;
    l->symmetric = symmetric;
    l->training = true;
    l->kernel_id = -1;
    l->scale_a = 0.0f;
    bie_bw_init(&l->w, out_features, in_features);
    l->bias_a = bie_layer_bias_alloc(in_features);
    if (l->bias_a == NULL) {
        free(l);
        return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: bias_a", MODULE);
    }
    bie_status st = BIE_OK;
#ifdef BIE_HAVE_CUDA
    if (device.type == BIE_DEVICE_CUDA && (st = bie_blc_create(l)) != BIE_OK) {
        bie_binary_linear_free(l);
        return st;
    }
#endif
    st = bie_binary_linear_reset_parameters(l, 0);
    if (st != BIE_OK) {
        bie_binary_linear_free(l);
        return st;
    }
    *out = l;
    return BIE_OK;
}

void bie_binary_linear_free(bie_binary_linear *l) {
    if (l == NULL) return;
#ifdef BIE_HAVE_CUDA
    bie_blc_free(l);
#endif
    drop_saved(l);
    bie_bw_free(&l->w);
    bie_free_aligned(l->bias_a);
    bie_grads_free(&l->grads);
    free(l);
}

bie_status bie_binary_linear_reset_parameters(bie_binary_linear *l, uint64_t seed) {
    CHECK_LAYER(l);
    BIE_ON_CUDA(l, bie_blc_reset(l, seed));
    BIE_TRY(bie_bw_reset(&l->w, seed));
    drop_saved(l);
    return BIE_OK;
}

bie_status bie_binary_linear_prepare_params(bie_binary_linear *l) {
    CHECK_LAYER(l);
    BIE_ON_CUDA(l, bie_blc_prepare(l));
    bool was_float = l->w.f32 != NULL;
    BIE_TRY(bie_bw_prepare(&l->w, "binary_linear_prepare_params"));
    if (was_float) drop_saved(l);
    return BIE_OK;
}

bie_status bie_binary_linear_set_weight_data(bie_binary_linear *l, const bie_tensor *w) {
    CHECK_LAYER(l);
    BIE_ON_CUDA(l, bie_blc_set_weight_data(l, w));
    static const char *who = "binary_linear_set_weight_data";
    BIE_TRY(bie_check_rows_tensor(w, "weight", l->dtype, l->in, NULL, who));
    if (w->ndim != 2 || w->shape[0] != l->out)
        return bie_fail(BIE_ERR_SHAPE, "%s: weight must be [%lld, %lld]", who, (long long)l->out,
                        (long long)l->in);
    BIE_TRY(bie_bw_set_data(&l->w, w->data, who));
    drop_saved(l);
    return BIE_OK;
}

bie_status bie_binary_linear_generate_quantized_weight(bie_binary_linear *l, bool qweight_only) {
    CHECK_LAYER(l);
    BIE_ON_CUDA(l, bie_blc_generate_quantized_weight(l, qweight_only));
    BIE_TRY(bie_bw_generate_qweight(&l->w, qweight_only, "generate_quantized_weight"));
    if (qweight_only) drop_saved(l);
    return BIE_OK;
}

bie_status bie_binary_linear_set_quantized_weight_data(bie_binary_linear *l, const bie_tensor *q) {
    CHECK_LAYER(l);
    BIE_ON_CUDA(l, bie_blc_set_quantized_weight_data(l, q));
    static const char *who = "binary_linear_set_quantized_weight_data";
    int64_t words = bie_packed_words(l->in, l->w.word_bits);
    BIE_TRY(bie_check_rows_tensor(q, "qweight", packed_dtype(l->w.word_bits), words, NULL, who));
    if (q->ndim != 2 || q->shape[0] != l->out)
        return bie_fail(BIE_ERR_SHAPE, "%s: qweight must be [%lld, %lld]", who, (long long)l->out,
                        (long long)words);
    return bie_bw_set_qweight(&l->w, q->data, who);
}

bie_status bie_binary_linear_set_bits_binary_word(bie_binary_linear *l, int bits) {
    CHECK_LAYER(l);
    BIE_ON_CUDA(l, bie_blc_set_bits(l, bits));
    return bie_bw_set_word_bits(&l->w, bits, MODULE);
}

int bie_binary_linear_bits_binary_word(const bie_binary_linear *l) { return l ? l->w.word_bits : 0; }
int64_t bie_binary_linear_in_features(const bie_binary_linear *l) { return l ? l->in : 0; }
int64_t bie_binary_linear_out_features(const bie_binary_linear *l) { return l ? l->out : 0; }

bie_status bie_binary_linear_set_training(bie_binary_linear *l, bool training) {
    CHECK_LAYER(l);
    if (!training) drop_saved(l); /* on CUDA too: has_saved is shared */
    l->training = training;
    return BIE_OK;
}

bool bie_binary_linear_training(const bie_binary_linear *l) { return l && l->training; }

static bie_status view_of(bie_tensor *v, void *data, bie_dtype dt, int ndim, int64_t d0, int64_t d1) {
    int64_t shape[2] = {d0, d1};
    return bie_tensor_view(v, data, dt, ndim, shape);
}

bie_status bie_binary_linear_param(bie_binary_linear *l, bie_param which, bie_tensor *v) {
    CHECK_LAYER(l);
    BIE_CHECK_NULL(v);
    BIE_ON_CUDA(l, bie_blc_param(l, which, v));
    switch (which) {
    case BIE_PARAM_WEIGHT:
        if (l->w.i8) return view_of(v, l->w.i8, BIE_I8, 2, l->out, l->in);
        if (l->w.f32) return view_of(v, l->w.f32, BIE_F32, 2, l->out, l->in);
        return bie_bw_no_weight("binary_linear_param");
    case BIE_PARAM_QWEIGHT:
        if (l->w.qweight == NULL)
            return bie_fail(BIE_ERR_STATE, "%s: no qweight yet (generate_quantized_weight)", MODULE);
        return view_of(v, l->w.qweight, packed_dtype(l->w.word_bits), 2, l->out,
                       bie_packed_words(l->in, l->w.word_bits));
    case BIE_PARAM_BIAS_A: return view_of(v, l->bias_a, BIE_F32, 1, l->in, 0);
    case BIE_PARAM_SCALE_A: return view_of(v, &l->scale_a, BIE_F32, 1, 1, 0);
    case BIE_PARAM_SCALE_W: return view_of(v, &l->w.scale_w, BIE_F32, 1, 1, 0);
    case BIE_PARAM_WEIGHT_FLOAT_GRAD: break;
    }
    return bie_fail(BIE_ERR_INVALID_ARGUMENT, "%s: parameter %d does not exist", MODULE, (int)which);
}

bie_status bie_binary_linear_set_scale_a(bie_binary_linear *l, float scale_a) {
    CHECK_LAYER(l);
    BIE_TRY(bie_check_scale_a(scale_a, MODULE));
    BIE_ON_CUDA(l, bie_blc_set_scale_a(l, scale_a));
    l->scale_a = scale_a;
    return BIE_OK;
}

bie_status bie_binary_linear_opt_weight(bie_binary_linear *l, bie_tensor *v) {
    CHECK_LAYER(l);
    BIE_CHECK_NULL(v);
    if (l->training) return bie_binary_linear_param(l, BIE_PARAM_WEIGHT, v);
#ifdef BIE_HAVE_CUDA
    if (l->cuda && !bie_blc_has_qweight(l)) BIE_TRY(bie_binary_linear_generate_quantized_weight(l, false));
    if (l->cuda) return bie_binary_linear_param(l, BIE_PARAM_QWEIGHT, v);
#endif
    if (l->w.qweight == NULL) BIE_TRY(bie_binary_linear_generate_quantized_weight(l, false));
    return bie_binary_linear_param(l, BIE_PARAM_QWEIGHT, v);
}

/* ---------------------------------------------------------------- forward */

bie_status bie_binary_linear_check_forward(const bie_binary_linear *l, const bie_tensor *x) {
    CHECK_LAYER(l);
    BIE_ON_CUDA(l, bie_blc_check_forward(l, x));
    static const char *who = "binary_linear_check_forward";
    if (x == NULL) return bie_fail(BIE_ERR_NULL_POINTER, "%s: input is NULL", who);
    if (x->dtype == BIE_F32) return bie_check_rows_tensor(x, "input", BIE_F32, l->in, NULL, who);
    if (x->dtype == BIE_U8 || x->dtype == BIE_U32 || x->dtype == BIE_U64) {
        if (x->dtype != packed_dtype(l->w.word_bits))
            return bie_fail(BIE_ERR_DTYPE, "%s: packed input is %s but bits_binary_word is %d (%s)",
                            who, bie_dtype_name(x->dtype), l->w.word_bits,
                            bie_dtype_name(packed_dtype(l->w.word_bits)));
        return bie_check_rows_tensor(x, "packed input", x->dtype,
                                     bie_packed_words(l->in, l->w.word_bits), NULL, who);
    }
    return bie_fail(BIE_ERR_DTYPE, "%s: input dtype %s is not accepted on the CPU (float32, or "
                    "packed uint8/uint32/uint64)", who, bie_dtype_name(x->dtype));
}

/* scale_a the next forward uses for x: the stored one, or the initialisation from x. */
static bie_status activation_scale(const bie_binary_linear *l, const bie_tensor *x, float *scale) {
    return bie_activation_scale(l->scale_a, x->data, bie_tensor_numel(x), l->symmetric ? 2.0 : 4.0, MODULE, scale);
}

bie_status bie_binary_linear_set_activation(bie_binary_linear *l, const bie_tensor *x,
                                            bie_tensor *x_out) {
    CHECK_LAYER(l);
    BIE_ON_CUDA(l, bie_blc_set_activation(l, x, x_out));
    static const char *who = "binary_linear_set_activation";
    BIE_TRY(bie_check_rows_tensor(x, "input", BIE_F32, l->in, NULL, who));
    if (x_out) BIE_TRY(bie_check_rows_tensor(x_out, "output", BIE_F32, l->in, x, who));
    float scale = 0;
    BIE_TRY(activation_scale(l, x, &scale));
    l->scale_a = scale;
    if (x_out) {
        int64_t rows = bie_tensor_numel(x) / l->in;
        const float *src = x->data;
        float *dst = x_out->data;
        for (int64_t r = 0; r < rows; r++)
            for (int64_t c = 0; c < l->in; c++) dst[r * l->in + c] = src[r * l->in + c] + l->bias_a[c];
    }
    return BIE_OK;
}

/* Kernel for m rows: the selected one, or the default for the shape. */
static const bie_cpu_kernel *forward_kernel(const bie_binary_linear *l, int64_t m) {
    if (l->kernel_id >= 0) return bie_cpu_kernel_by_id(l->kernel_id);
    return bie_cpu_default_kernel(m);
}

bie_status bie_binary_linear_forward(bie_binary_linear *l, const bie_tensor *x, bie_tensor *out) {
    CHECK_LAYER(l);
    BIE_ON_CUDA(l, bie_blc_forward(l, x, out));
    static const char *who = "binary_linear_forward";
    BIE_TRY(bie_binary_linear_check_forward(l, x));
    BIE_TRY(bie_check_rows_tensor(out, "output", BIE_F32, l->out, x, who));
    const bool packed_input = x->dtype != BIE_F32;
    const bool keep = l->training && !packed_input;
    if (!bie_bw_has_training_weight(&l->w) && (l->training || l->w.qweight == NULL))
        return bie_bw_no_weight(who);
    if (packed_input && l->scale_a == 0.0f)
        return bie_fail(BIE_ERR_STATE, "%s: scale_a is 0 (uninitialised) and cannot be measured on "
                        "pre-packed input: run a float forward or set scale_a first", who);
    const int64_t m = bie_tensor_numel(x) / x->shape[x->ndim - 1];
    float scale_a = 0;
    BIE_TRY(activation_scale(l, x, &scale_a));
    const float scale = scale_a * l->w.scale_w;
    if (!isfinite(scale))
        return bie_fail(BIE_ERR_NOT_FINITE, "%s: scale_a * scale_w = %g is not finite", who, (double)scale);
    const bie_cpu_kernel *kern = forward_kernel(l, m);

    /* Everything that can fail is allocated before any state changes. */
    const int64_t rb = bie_bl_row_bytes(l);
    int64_t a_bytes;
    if (!bie_mul_ok(m, rb, &a_bytes))
        return bie_fail(BIE_ERR_OVERFLOW, "%s: input of %lld rows is too large", who, (long long)m);
    uint8_t *signs = NULL, *mask = NULL, *wbits = NULL, *qnew = NULL;
    const uint8_t *a = x->data, *b = l->w.qweight;
    int64_t lda = bie_packed_row_bytes(l->in, l->w.word_bits), ldb = lda;
    bie_status st = BIE_OK;
    if (!packed_input) {
        signs = bie_alloc_aligned((size_t)a_bytes);
        mask = keep ? bie_alloc_aligned((size_t)a_bytes) : NULL;
        if (signs == NULL || (keep && mask == NULL)) {
            st = bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: packed input", who);
            goto fail;
        }
        bie_pack_f32_rows(x->data, m, l->in, l->in, l->bias_a, signs, rb, mask, scale_a, -1.0f, 1.0f);
        a = signs;
        lda = rb;
    }
    if (l->training) {
        if ((st = bie_bw_pack(&l->w, rb, &wbits, who)) != BIE_OK) goto fail;
        b = wbits;
        ldb = rb;
    } else if (l->w.qweight == NULL) { /* opt_weight: packed on first use */
        if ((st = bie_bw_pack(&l->w, ldb, &qnew, who)) != BIE_OK) goto fail;
        b = qnew;
    }
    st = bie_cpu_bgemm(kern, m, l->out, l->in, a, lda, b, ldb, scale, out->data);
    if (st != BIE_OK) goto fail;

    l->scale_a = scale_a;
    if (qnew) l->w.qweight = qnew;
    if (keep) {
        drop_saved(l);
        l->saved_signs = signs;
        l->saved_mask = mask;
        l->saved_wbits = wbits;
        l->saved_m = m;
        l->saved_ndim = x->ndim;
        memcpy(l->saved_shape, x->shape, sizeof l->saved_shape);
        l->saved_scale_a = scale_a;
        l->saved_scale_w = l->w.scale_w;
        l->has_saved = true;
        return BIE_OK;
    }
    if (l->training) drop_saved(l); /* a packed-input forward cannot be differentiated */
    bie_free_aligned(signs);
    bie_free_aligned(wbits);
    return BIE_OK;
fail:
    bie_free_aligned(signs);
    bie_free_aligned(mask);
    bie_free_aligned(wbits);
    bie_free_aligned(qnew);
    return st;
}
