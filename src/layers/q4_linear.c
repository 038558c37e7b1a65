/* 4-bit linear layer (SPEC §4 as a matrix product): life cycle, forward and backward. The
 * codes of x' and w are int8 rows multiplied exactly by the 4-bit GEMM kernels. Layers on a
 * CUDA device delegate to q4_linear_cuda.c. */
#include <cblas.h>
#include <math.h>
#include <string.h>

#include "../cpu/dispatch.h"
#include "../cpu/frame/pack.h"
#include "q4_linear_cuda.h"

static const char *const MODULE = "q4_linear";

#define CHECK_LAYER(l)                                                                         \
    do {                                                                                       \
        if ((l) == NULL) return bie_fail(BIE_ERR_NULL_POINTER, "%s: layer is NULL", __func__); \
    } while (0)

static void drop_saved(bie_q4_linear *l) {
    bie_free_aligned(l->saved_codes);
    bie_free_aligned(l->saved_mask);
    bie_free_aligned(l->saved_resid);
    bie_free_aligned(l->saved_wcodes);
    l->saved_codes = l->saved_mask = NULL;
    l->saved_resid = l->saved_wcodes = NULL;
    l->has_saved = false;
}

bie_status bie_q4_linear_create(bie_q4_linear **out, int64_t in_features, int64_t out_features,
                                bie_device device, bie_dtype dtype) {
    BIE_CHECK_NULL(out);
    if (in_features < 1 || out_features < 1 || in_features > (1 << 24) || out_features > INT32_MAX)
        return bie_fail(BIE_ERR_INVALID_ARGUMENT, "%s: in_features must be in 1..2^24 and out_features "
                        "in 1..2^31-1 (got %lld, %lld)", MODULE, (long long)in_features, (long long)out_features);
    BIE_TRY(bie_layer_check_device(device, dtype, MODULE));
    bie_q4_linear *l = calloc(1, sizeof *l);
    if (l == NULL) return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: layer", MODULE);
    l->in = in_features;
    l->out = out_features;
    l->device = device;
    l->dtype = dtype;
    l->training = true;
    l->kernel_id = -1;
    bie_q4w_init(&l->w, out_features, in_features);
    l->bias_a = bie_layer_bias_alloc(in_features);
    bie_status st = l->bias_a ? BIE_OK : bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: bias_a", MODULE);
#ifdef BIE_HAVE_CUDA
    if (st == BIE_OK && device.type == BIE_DEVICE_CUDA) st = bie_q4lc_create(l);
#endif
    if (st == BIE_OK) st = bie_q4_linear_reset_parameters(l, 0);
    if (st != BIE_OK) {
        bie_q4_linear_free(l);
        return st;
    }
    *out = l;
    return BIE_OK;
}

void bie_q4_linear_free(bie_q4_linear *l) {
    if (l == NULL) return;
#ifdef BIE_HAVE_CUDA
    bie_q4lc_free(l);
#endif
    drop_saved(l);
    bie_q4w_free(&l->w);
    bie_free_aligned(l->bias_a);
    bie_grads_free(&l->grads);
    free(l);
}

bie_status bie_q4_linear_reset_parameters(bie_q4_linear *l, uint64_t seed) {
    CHECK_LAYER(l);
    BIE_ON_CUDA(l, bie_q4lc_reset(l, seed));
    BIE_TRY(bie_q4w_reset(&l->w, seed));
    drop_saved(l);
    return BIE_OK;
}

bie_status bie_q4_linear_prepare_params(bie_q4_linear *l) {
    CHECK_LAYER(l);
    BIE_ON_CUDA(l, bie_q4lc_prepare(l));
    BIE_TRY(bie_q4w_prepare(&l->w, "q4_linear_prepare_params"));
    drop_saved(l);
    return BIE_OK;
}

bie_status bie_q4_linear_set_weight_data(bie_q4_linear *l, const bie_tensor *w) {
    CHECK_LAYER(l);
    BIE_ON_CUDA(l, bie_q4lc_set_weight_data(l, w));
    static const char *who = "q4_linear_set_weight_data";
    BIE_TRY(bie_check_rows_tensor(w, "weight", BIE_F32, l->in, NULL, who));
    if (w->ndim != 2 || w->shape[0] != l->out)
        return bie_fail(BIE_ERR_SHAPE, "%s: weight must be [%lld, %lld]", who, (long long)l->out, (long long)l->in);
    BIE_TRY(bie_q4w_set_data(&l->w, w->data, who));
    drop_saved(l);
    return BIE_OK;
}

bie_status bie_q4_linear_generate_quantized_weight(bie_q4_linear *l, bool qweight_only) {
    CHECK_LAYER(l);
    BIE_ON_CUDA(l, bie_q4lc_generate_quantized_weight(l, qweight_only));
    BIE_TRY(bie_q4w_generate_qweight(&l->w, qweight_only, "q4_linear_generate_quantized_weight"));
    if (qweight_only) drop_saved(l);
    return BIE_OK;
}

bie_status bie_q4_linear_set_quantized_weight_data(bie_q4_linear *l, const bie_tensor *q) {
    CHECK_LAYER(l);
    BIE_ON_CUDA(l, bie_q4lc_set_quantized_weight_data(l, q));
    static const char *who = "q4_linear_set_quantized_weight_data";
    const int64_t rb = bie_nibble_row_bytes(l->in);
    BIE_TRY(bie_check_rows_tensor(q, "qweight", BIE_U8, rb, NULL, who));
    if (q->ndim != 2 || q->shape[0] != l->out)
        return bie_fail(BIE_ERR_SHAPE, "%s: qweight must be [%lld, %lld]", who, (long long)l->out, (long long)rb);
    return bie_q4w_set_qweight(&l->w, q->data, who);
}

bie_status bie_q4_linear_set_training(bie_q4_linear *l, bool training) {
    CHECK_LAYER(l);
    if (!training) drop_saved(l); /* on CUDA too: has_saved is shared */
    l->training = training;
    return BIE_OK;
}

bie_status bie_q4_linear_set_gemm_kernel(bie_q4_linear *l, int id) {
    CHECK_LAYER(l);
    BIE_ON_CUDA(l, bie_q4lc_set_kernel(l, id));
    if (id != -1) {
        const bie_cpu_kernel *kern;
        BIE_TRY(bie_cpu_kernel_for_call(BIE_OP_Q4_GEMM, id, 1, "q4_linear_set_gemm_kernel", &kern));
    }
    l->kernel_id = id;
    return BIE_OK;
}

bie_status bie_q4_linear_set_scale_a(bie_q4_linear *l, float scale_a) {
    CHECK_LAYER(l);
    BIE_TRY(bie_check_scale_a(scale_a, MODULE));
    BIE_ON_CUDA(l, bie_q4lc_set_scale_a(l, scale_a));
    l->scale_a = scale_a;
    return BIE_OK;
}

bie_status bie_q4_linear_param(bie_q4_linear *l, bie_param which, bie_tensor *v) {
    CHECK_LAYER(l);
    BIE_CHECK_NULL(v);
    BIE_ON_CUDA(l, bie_q4lc_param(l, which, v));
    int64_t wshape[2] = {l->out, l->in}, qshape[2] = {l->out, bie_nibble_row_bytes(l->in)}, one = 1;
    switch (which) {
    case BIE_PARAM_WEIGHT:
        if (l->w.f32 == NULL) return bie_bw_no_weight("q4_linear_param");
        return bie_tensor_view(v, l->w.f32, BIE_F32, 2, wshape);
    case BIE_PARAM_QWEIGHT:
        if (l->w.qweight == NULL)
            return bie_fail(BIE_ERR_STATE, "%s: no qweight yet (generate_quantized_weight)", MODULE);
        return bie_tensor_view(v, l->w.qweight, BIE_U8, 2, qshape);
    case BIE_PARAM_BIAS_A: return bie_tensor_view(v, l->bias_a, BIE_F32, 1, &l->in);
    case BIE_PARAM_SCALE_A: return bie_tensor_view(v, &l->scale_a, BIE_F32, 1, &one);
    case BIE_PARAM_SCALE_W: return bie_tensor_view(v, &l->w.scale_w, BIE_F32, 1, &one);
    default: break;
    }
    return bie_fail(BIE_ERR_INVALID_ARGUMENT, "%s: parameter %d does not exist", MODULE, (int)which);
}

bie_status bie_q4_linear_opt_weight(bie_q4_linear *l, bie_tensor *v) {
    CHECK_LAYER(l);
    BIE_CHECK_NULL(v);
    if (l->training) return bie_q4_linear_param(l, BIE_PARAM_WEIGHT, v);
#ifdef BIE_HAVE_CUDA
    if (l->cuda && !bie_q4lc_has_qweight(l)) BIE_TRY(bie_q4_linear_generate_quantized_weight(l, false));
    if (l->cuda) return bie_q4_linear_param(l, BIE_PARAM_QWEIGHT, v);
#endif
    if (l->w.qweight == NULL) BIE_TRY(bie_q4_linear_generate_quantized_weight(l, false));
    return bie_q4_linear_param(l, BIE_PARAM_QWEIGHT, v);
}

bie_status bie_q4_linear_check_forward(const bie_q4_linear *l, const bie_tensor *x) {
    CHECK_LAYER(l);
    BIE_ON_CUDA(l, bie_q4lc_check_forward(l, x));
    return bie_check_rows_tensor(x, "input", BIE_F32, l->in, NULL, "q4_linear_check_forward");
}

static bie_status activation_scale(const bie_q4_linear *l, const bie_tensor *x, float *scale) {
    return bie_activation_scale(l->scale_a, x->data, bie_tensor_numel(x), 2.0 / 11.269, MODULE, scale);
}

bie_status bie_q4_linear_set_activation(bie_q4_linear *l, const bie_tensor *x, bie_tensor *x_out) {
    CHECK_LAYER(l);
    BIE_ON_CUDA(l, bie_q4lc_set_activation(l, x, x_out));
    static const char *who = "q4_linear_set_activation";
    BIE_TRY(bie_q4_linear_check_forward(l, x));
    if (x_out) BIE_TRY(bie_check_rows_tensor(x_out, "output", BIE_F32, l->in, x, who));
    float scale = 0;
    BIE_TRY(activation_scale(l, x, &scale));
    l->scale_a = scale;
    if (x_out) {
        const int64_t rows = bie_tensor_numel(x) / l->in;
        const float *src = x->data;
        float *dst = x_out->data;
        for (int64_t r = 0; r < rows; r++)
            for (int64_t c = 0; c < l->in; c++) dst[r * l->in + c] = src[r * l->in + c] + l->bias_a[c];
    }
    return BIE_OK;
}

bie_status bie_q4_linear_forward(bie_q4_linear *l, const bie_tensor *x, bie_tensor *out) {
    CHECK_LAYER(l);
    BIE_ON_CUDA(l, bie_q4lc_forward(l, x, out));
    static const char *who = "q4_linear_forward";
    BIE_TRY(bie_q4_linear_check_forward(l, x));
    BIE_TRY(bie_check_rows_tensor(out, "output", BIE_F32, l->out, x, who));
    if (l->w.f32 == NULL && (l->training || l->w.qweight == NULL)) return bie_bw_no_weight(who);
    const int64_t m = bie_tensor_numel(x) / l->in, k = l->in, mk = m * k;
    float scale_a = 0;
    BIE_TRY(activation_scale(l, x, &scale_a));
    const float scale = scale_a * l->w.scale_w;
    if (!isfinite(scale)) return bie_fail(BIE_ERR_NOT_FINITE, "%s: scale_a * scale_w is not finite", who);
    const bie_cpu_kernel *kern;
    BIE_TRY(bie_cpu_kernel_for_call(BIE_OP_Q4_GEMM, l->kernel_id, m, who, &kern));
    const bool keep = l->training;
    int8_t *codes = bie_alloc_aligned((size_t)mk), *wcodes = NULL;
    uint8_t *nib = keep ? bie_alloc_aligned((size_t)bie_nibble_row_bytes(mk)) : NULL;
    uint8_t *mask = keep ? bie_alloc_aligned((size_t)((mk + 7) / 8)) : NULL;
    int8_t *resid = keep ? bie_alloc_aligned((size_t)mk) : NULL;
    bool borrowed = false;
    bie_status st = BIE_OK;
    if (!codes || (keep && (!nib || !mask || !resid))) {
        st = bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: workspace", who);
        goto done;
    }
    bie_q4_encode(x->data, mk, l->bias_a, 1, k, scale_a, codes, mask, resid);
    if (!l->training && l->w.qweight && kern->tile) { /* deployment: weight panels packed once */
        const bie_packed_b *wp;
        if ((st = bie_q4w_packed(&l->w, kern, &wp, who)) == BIE_OK)
            st = bie_cpu_bgemm_packed(kern, m, (const uint8_t *)codes, k, wp, scale, out->data);
    } else {
        if ((st = bie_q4w_codes(&l->w, !l->training, &wcodes, &borrowed, who)) != BIE_OK) goto done;
        st = bie_cpu_bgemm(kern, m, l->out, k * 8, (const uint8_t *)codes, k, (const uint8_t *)wcodes, k,
                           scale, out->data);
    }
    if (st != BIE_OK) goto done;
    l->scale_a = scale_a;
    if (keep) {
        bie_q4_pack_nibbles(codes, 1, mk, nib);
        drop_saved(l);
        l->saved_codes = nib;
        l->saved_mask = mask;
        l->saved_resid = resid;
        l->saved_wcodes = wcodes; /* training codes come from the float weight: owned */
        l->saved_m = m;
        l->saved_ndim = x->ndim;
        memcpy(l->saved_shape, x->shape, sizeof l->saved_shape);
        l->saved_scale_a = scale_a;
        l->saved_scale_w = l->w.scale_w;
        l->has_saved = true;
        nib = mask = NULL;
        resid = wcodes = NULL;
    }
done:
    bie_free_aligned(codes);
    if (!borrowed) bie_free_aligned(wcodes);
    bie_free_aligned(nib);
    bie_free_aligned(mask);
    bie_free_aligned(resid);
    return st;
}

bie_status bie_q4_linear_backward(bie_q4_linear *l, const bie_tensor *grad_out, bie_tensor *grad_x) {
    static const char *who = "q4_linear_backward";
    CHECK_LAYER(l);
    BIE_ON_CUDA(l, bie_q4lc_backward(l, grad_out, grad_x));
    if (!l->has_saved)
        return bie_fail(BIE_ERR_STATE, "%s: no saved activations: run a training-mode forward first", who);
    bie_tensor like;
    memset(&like, 0, sizeof like);
    like.ndim = l->saved_ndim;
    memcpy(like.shape, l->saved_shape, sizeof like.shape);
    BIE_TRY(bie_check_rows_tensor(grad_out, "grad_out", BIE_F32, l->out, &like, who));
    if (grad_x) BIE_TRY(bie_check_rows_tensor(grad_x, "grad_x", BIE_F32, l->in, &like, who));
    const int64_t m = l->saved_m, k = l->in, n = l->out;
    if (m > INT32_MAX) return bie_fail(BIE_ERR_OVERFLOW, "%s: too many rows for BLAS", who);
    float *wf = bie_alloc_aligned((size_t)(n * k) * sizeof(float));
    float *xs = bie_alloc_aligned((size_t)(m * k) * sizeof(float));
    float *gx = grad_x ? grad_x->data : bie_alloc_aligned((size_t)(m * k) * sizeof(float));
    float *gw = bie_alloc_aligned((size_t)(n * k) * sizeof(float));
    float *gb = bie_alloc_aligned((size_t)k * sizeof(float));
    double *col = calloc((size_t)k, sizeof(double));
    if (!wf || !xs || !gx || !gw || !gb || !col) {
        bie_free_aligned(wf);
        bie_free_aligned(xs);
        if (!grad_x) bie_free_aligned(gx);
        bie_free_aligned(gw);
        bie_free_aligned(gb);
        free(col);
        return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: workspace", who);
    }
    for (int64_t i = 0; i < n * k; i++) wf[i] = (float)l->saved_wcodes[i] * l->saved_scale_w;
    for (int64_t i = 0; i < m * k; i++) xs[i] = (float)bie_nibble_get(l->saved_codes, i) * l->saved_scale_a;
    const float *g = grad_out->data;
    /* grad_x = (grad_out @ (q4(w) * scale_w)) * inr;  grad_w = grad_out^T @ (q4(x') * scale_a) */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)m, (int)k, (int)n, 1.0f, g, (int)n, wf,
                (int)k, 0.0f, gx, (int)k);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)n, (int)k, (int)m, 1.0f, g, (int)n, xs,
                (int)k, 0.0f, gw, (int)k);
    double dscale = 0;
    for (int64_t i = 0; i < m * k; i++) {
        float v = bie_bit(l->saved_mask, i) ? gx[i] : 0.0f;
        gx[i] = v;
        dscale += (double)v * (double)l->saved_resid[i] / 254.0;
        col[i % k] += v;
    }
    for (int64_t c = 0; c < k; c++) gb[c] = (float)col[c];
    bie_grads_install(&l->grads, gw, NULL, gb, (float)(dscale / sqrt((double)(m * k) * 7.0)));
    bie_free_aligned(wf);
    bie_free_aligned(xs);
    if (!grad_x) bie_free_aligned(gx);
    free(col);
    return BIE_OK;
}

bie_status bie_q4_linear_grad(bie_q4_linear *l, bie_param which, bie_tensor *v) {
    CHECK_LAYER(l);
    BIE_ON_CUDA(l, bie_q4lc_grad(l, which, v));
    const int64_t wshape[2] = {l->out, l->in};
    return bie_grads_view(&l->grads, which, 2, wshape, &l->in, v, "q4_linear_grad");
}
