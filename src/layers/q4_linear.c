/* 4-bit linear layer (SPEC §4 as a matrix product): life cycle, forward and backward. The
 * codes of x' and w are int8 rows multiplied exactly by the 4-bit GEMM kernels. */
#include <cblas.h>
#include <math.h>
#include <string.h>

#include "../cpu/dispatch.h"
#include "../cpu/frame/pack.h"
#include "binary_weight.h"

static const char *const MODULE = "q4_linear";
static const float kEps = 1e-5f;

struct bie_q4_linear {
    int64_t in, out;
    bool training;
    int kernel_id;
    float *weight;    /* [out, in] float, or NULL after qweight_only */
    uint8_t *qweight; /* [out, ceil(in / 2)] nibbles, or NULL */
    int8_t *qcodes;   /* qweight unpacked to int8 for the GEMM (inference cache), or NULL */
    float *bias_a;
    float scale_a, scale_w;
    /* saved by a training forward */
    bool has_saved;
    int64_t saved_m;
    int saved_ndim;
    int64_t saved_shape[BIE_MAX_DIMS];
    uint8_t *saved_codes; /* [m, ceil(in / 2)] nibbles of q4(x') */
    uint8_t *saved_mask;  /* [m, ceil(in / 8)] clip bits */
    int8_t *saved_resid;  /* [m, in] (rint(v) - v) * 254 */
    int8_t *saved_wcodes; /* [out, in] q4(w) */
    float saved_scale_a, saved_scale_w;
    /* gradients */
    bool has_grad;
    float *grad_w, *grad_bias_a, grad_scale_a;
};

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

/* Replace qweight (NULL to drop it) and drop its unpacked cache. */
static void set_qweight(bie_q4_linear *l, uint8_t *q) {
    bie_free_aligned(l->qweight);
    bie_free_aligned(l->qcodes);
    l->qweight = q;
    l->qcodes = NULL;
}

bie_status bie_q4_linear_create(bie_q4_linear **out, int64_t in_features, int64_t out_features,
                                bie_device device, bie_dtype dtype) {
    BIE_CHECK_NULL(out);
    if (in_features < 1 || out_features < 1 || in_features > (1 << 24) || out_features > INT32_MAX)
        return bie_fail(BIE_ERR_INVALID_ARGUMENT, "%s: in_features must be in 1..2^24 and out_features "
                        "in 1..2^31-1 (got %lld, %lld)", MODULE, (long long)in_features, (long long)out_features);
    if (device.type != BIE_DEVICE_CPU)
        return bie_fail(BIE_ERR_DEVICE, "%s: only the CPU backend runs 4-bit layers so far", MODULE);
    if (dtype != BIE_F32)
        return bie_fail(BIE_ERR_DTYPE, "%s: dtype %s is not supported on the CPU (float32 only)",
                        MODULE, bie_dtype_name(dtype));
    bie_q4_linear *l = calloc(1, sizeof *l);
    if (l == NULL) return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: layer", MODULE);
    l->in = in_features;
    l->out = out_features;
    l->training = true;
    l->kernel_id = -1;
    l->scale_w = 1.0f;
    l->bias_a = bie_alloc_aligned((size_t)in_features * sizeof(float));
    bie_status st = l->bias_a ? bie_q4_linear_reset_parameters(l, 0)
                              : bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: bias_a", MODULE);
    if (st != BIE_OK) {
        bie_q4_linear_free(l);
        return st;
    }
    memset(l->bias_a, 0, (size_t)in_features * sizeof(float));
    *out = l;
    return BIE_OK;
}

void bie_q4_linear_free(bie_q4_linear *l) {
    if (l == NULL) return;
    drop_saved(l);
    bie_free_aligned(l->weight);
    set_qweight(l, NULL);
    bie_free_aligned(l->bias_a);
    bie_free_aligned(l->grad_w);
    bie_free_aligned(l->grad_bias_a);
    free(l);
}

static void install_weight(bie_q4_linear *l, float *w) {
    bie_free_aligned(l->weight);
    set_qweight(l, NULL);
    l->weight = w;
    drop_saved(l);
}

bie_status bie_q4_linear_reset_parameters(bie_q4_linear *l, uint64_t seed) {
    CHECK_LAYER(l);
    bie_binary_weight tmp; /* the same Kaiming-uniform initialisation as the binary layers */
    bie_bw_init(&tmp, l->out, l->in);
    BIE_TRY(bie_bw_reset(&tmp, seed));
    install_weight(l, tmp.f32);
    return BIE_OK;
}

bie_status bie_q4_linear_prepare_params(bie_q4_linear *l) {
    CHECK_LAYER(l);
    if (l->weight == NULL) return bie_bw_no_weight("q4_linear_prepare_params");
    double s = 0;
    for (int64_t i = 0; i < l->in * l->out; i++) s += fabs((double)l->weight[i]);
    float sw = (float)(2.0 * s / (double)(l->in * l->out) / 5.6345);
    if (!isfinite(sw)) return bie_fail(BIE_ERR_NOT_FINITE, "%s: weight has non-finite values", MODULE);
    l->scale_w = sw > kEps ? sw : kEps;
    drop_saved(l);
    return BIE_OK;
}

bie_status bie_q4_linear_set_weight_data(bie_q4_linear *l, const bie_tensor *w) {
    CHECK_LAYER(l);
    static const char *who = "q4_linear_set_weight_data";
    BIE_TRY(bie_check_rows_tensor(w, "weight", BIE_F32, l->in, NULL, who));
    if (w->ndim != 2 || w->shape[0] != l->out)
        return bie_fail(BIE_ERR_SHAPE, "%s: weight must be [%lld, %lld]", who, (long long)l->out, (long long)l->in);
    const float *src = w->data;
    for (int64_t i = 0; i < l->in * l->out; i++)
        if (!isfinite(src[i])) return bie_fail(BIE_ERR_NOT_FINITE, "%s: weight has non-finite values", who);
    float *copy = bie_alloc_aligned((size_t)(l->in * l->out) * sizeof(float));
    if (copy == NULL) return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: weight", who);
    memcpy(copy, src, (size_t)(l->in * l->out) * sizeof(float));
    float old_sw = l->scale_w;
    float *old = l->weight;
    l->weight = copy; /* prepare_params on the new weight; restore on failure */
    bie_status st = bie_q4_linear_prepare_params(l);
    if (st != BIE_OK) {
        l->weight = old;
        l->scale_w = old_sw;
        bie_free_aligned(copy);
        return st;
    }
    bie_free_aligned(old);
    set_qweight(l, NULL);
    return BIE_OK;
}

/* int8 codes q4(w, scale_w) of the weight, or of qweight when the weight is gone or the
 * layer is in inference mode with a qweight. */
static bie_status weight_codes(const bie_q4_linear *l, int8_t **out, const char *who) {
    int8_t *c = bie_alloc_aligned((size_t)(l->out * l->in));
    if (c == NULL) return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: weight codes", who);
    const bool use_q = l->qweight && (!l->training || l->weight == NULL);
    const int64_t qrb = bie_nibble_row_bytes(l->in);
#pragma omp parallel for num_threads(bie_threads()) schedule(static) if (l->out * l->in > 65536)
    for (int64_t o = 0; o < l->out; o++)
        for (int64_t i = 0; i < l->in; i++)
            c[o * l->in + i] = use_q ? bie_nibble_get(l->qweight + o * qrb, i)
                                     : bie_q4(l->weight[o * l->in + i], l->scale_w);
    *out = c;
    return BIE_OK;
}

static void pack_nibbles(const int8_t *codes, int64_t rows, int64_t cols, uint8_t *dst) {
    const int64_t rb = bie_nibble_row_bytes(cols);
    memset(dst, 0, (size_t)(rows * rb));
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < cols; i++)
            dst[r * rb + (i >> 1)] |= (uint8_t)((codes[r * cols + i] & 15) << ((i & 1) * 4));
}

bie_status bie_q4_linear_generate_quantized_weight(bie_q4_linear *l, bool qweight_only) {
    CHECK_LAYER(l);
    static const char *who = "q4_linear_generate_quantized_weight";
    if (l->weight == NULL) {
        if (l->qweight) return BIE_OK;
        return bie_bw_no_weight(who);
    }
    uint8_t *q = bie_alloc_aligned((size_t)(l->out * bie_nibble_row_bytes(l->in)));
    int8_t *codes = NULL;
    bie_q4_linear tmp = *l; /* codes from the float weight */
    tmp.qweight = NULL;
    bie_status st = q ? weight_codes(&tmp, &codes, who) : bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s", who);
    if (st != BIE_OK) {
        bie_free_aligned(q);
        return st;
    }
    pack_nibbles(codes, l->out, l->in, q);
    bie_free_aligned(codes);
    set_qweight(l, q);
    if (qweight_only) {
        bie_free_aligned(l->weight);
        l->weight = NULL;
        drop_saved(l);
    }
    return BIE_OK;
}

bie_status bie_q4_linear_set_quantized_weight_data(bie_q4_linear *l, const bie_tensor *q) {
    CHECK_LAYER(l);
    static const char *who = "q4_linear_set_quantized_weight_data";
    const int64_t rb = bie_nibble_row_bytes(l->in);
    BIE_TRY(bie_check_rows_tensor(q, "qweight", BIE_U8, rb, NULL, who));
    if (q->ndim != 2 || q->shape[0] != l->out)
        return bie_fail(BIE_ERR_SHAPE, "%s: qweight must be [%lld, %lld]", who, (long long)l->out, (long long)rb);
    uint8_t *copy = bie_alloc_aligned((size_t)(l->out * rb));
    if (copy == NULL) return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: qweight", who);
    memcpy(copy, q->data, (size_t)(l->out * rb));
    if (l->in & 1) /* the unused high nibble of each row's last byte is cleared */
        for (int64_t o = 0; o < l->out; o++) copy[o * rb + rb - 1] &= 15;
    set_qweight(l, copy);
    return BIE_OK;
}

bie_status bie_q4_linear_set_training(bie_q4_linear *l, bool training) {
    CHECK_LAYER(l);
    if (!training) drop_saved(l);
    l->training = training;
    return BIE_OK;
}

bie_status bie_q4_linear_set_gemm_kernel(bie_q4_linear *l, int id) {
    CHECK_LAYER(l);
    if (id != -1) {
        const bie_cpu_kernel *kern;
        BIE_TRY(bie_cpu_kernel_for_call(BIE_OP_Q4_GEMM, id, 1, "q4_linear_set_gemm_kernel", &kern));
    }
    l->kernel_id = id;
    return BIE_OK;
}

bie_status bie_q4_linear_set_scale_a(bie_q4_linear *l, float scale_a) {
    CHECK_LAYER(l);
    if (!isfinite(scale_a) || scale_a < 0)
        return bie_fail(BIE_ERR_NOT_FINITE, "%s: scale_a must be finite and >= 0 (got %g)", MODULE, (double)scale_a);
    l->scale_a = scale_a;
    return BIE_OK;
}

bie_status bie_q4_linear_param(bie_q4_linear *l, bie_param which, bie_tensor *v) {
    CHECK_LAYER(l);
    BIE_CHECK_NULL(v);
    int64_t wshape[2] = {l->out, l->in}, qshape[2] = {l->out, bie_nibble_row_bytes(l->in)}, one = 1;
    switch (which) {
    case BIE_PARAM_WEIGHT:
        if (l->weight == NULL) return bie_bw_no_weight("q4_linear_param");
        return bie_tensor_view(v, l->weight, BIE_F32, 2, wshape);
    case BIE_PARAM_QWEIGHT:
        if (l->qweight == NULL)
            return bie_fail(BIE_ERR_STATE, "%s: no qweight yet (generate_quantized_weight)", MODULE);
        return bie_tensor_view(v, l->qweight, BIE_U8, 2, qshape);
    case BIE_PARAM_BIAS_A: return bie_tensor_view(v, l->bias_a, BIE_F32, 1, &l->in);
    case BIE_PARAM_SCALE_A: return bie_tensor_view(v, &l->scale_a, BIE_F32, 1, &one);
    case BIE_PARAM_SCALE_W: return bie_tensor_view(v, &l->scale_w, BIE_F32, 1, &one);
    default: break;
    }
    return bie_fail(BIE_ERR_INVALID_ARGUMENT, "%s: parameter %d does not exist", MODULE, (int)which);
}

bie_status bie_q4_linear_opt_weight(bie_q4_linear *l, bie_tensor *v) {
    CHECK_LAYER(l);
    BIE_CHECK_NULL(v);
    if (l->training) return bie_q4_linear_param(l, BIE_PARAM_WEIGHT, v);
    if (l->qweight == NULL) BIE_TRY(bie_q4_linear_generate_quantized_weight(l, false));
    return bie_q4_linear_param(l, BIE_PARAM_QWEIGHT, v);
}

bie_status bie_q4_linear_check_forward(const bie_q4_linear *l, const bie_tensor *x) {
    CHECK_LAYER(l);
    return bie_check_rows_tensor(x, "input", BIE_F32, l->in, NULL, "q4_linear_check_forward");
}

static bie_status activation_scale(const bie_q4_linear *l, const bie_tensor *x, float *scale) {
    return bie_activation_scale(l->scale_a, x->data, bie_tensor_numel(x), 2.0 / 11.269, MODULE, scale);
}

bie_status bie_q4_linear_set_activation(bie_q4_linear *l, const bie_tensor *x, bie_tensor *x_out) {
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
    static const char *who = "q4_linear_forward";
    BIE_TRY(bie_q4_linear_check_forward(l, x));
    BIE_TRY(bie_check_rows_tensor(out, "output", BIE_F32, l->out, x, who));
    if (l->weight == NULL && (l->training || l->qweight == NULL)) return bie_bw_no_weight(who);
    const int64_t m = bie_tensor_numel(x) / l->in, k = l->in;
    float scale_a = 0;
    BIE_TRY(activation_scale(l, x, &scale_a));
    const float scale = scale_a * l->scale_w;
    if (!isfinite(scale)) return bie_fail(BIE_ERR_NOT_FINITE, "%s: scale_a * scale_w is not finite", who);
    const bie_cpu_kernel *kern;
    BIE_TRY(bie_cpu_kernel_for_call(BIE_OP_Q4_GEMM, l->kernel_id, m, who, &kern));
    int64_t mk;
    if (!bie_mul_ok(m, k, &mk)) return bie_fail(BIE_ERR_OVERFLOW, "%s: input too large", who);
    const bool keep = l->training;
    int8_t *codes = bie_alloc_aligned((size_t)mk), *wcodes = NULL;
    uint8_t *nib = keep ? bie_alloc_aligned((size_t)(m * bie_nibble_row_bytes(k))) : NULL;
    uint8_t *mask = keep ? bie_alloc_aligned((size_t)(m * ((k + 7) / 8))) : NULL;
    int8_t *resid = keep ? bie_alloc_aligned((size_t)mk) : NULL;
    bie_status st = BIE_OK;
    if (!codes || (keep && (!nib || !mask || !resid))) {
        st = bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: workspace", who);
        goto done;
    }
    const int8_t *wc;
    if (!l->training && l->qcodes) {
        wc = l->qcodes; /* packed weights, unpacked once */
    } else {
        if ((st = weight_codes(l, &wcodes, who)) != BIE_OK) goto done;
        wc = wcodes;
    }
    const float *xs = x->data;
    const int64_t mb = (k + 7) / 8;
    if (mask) memset(mask, 0, (size_t)(m * mb));
#pragma omp parallel for num_threads(bie_threads()) schedule(static) if (mk > 65536)
    for (int64_t r = 0; r < m; r++)
        for (int64_t c = 0; c < k; c++) {
            float v = xs[r * k + c] + l->bias_a[c];
            codes[r * k + c] = bie_q4(v, scale_a);
            if (keep) {
                float q = v / scale_a;
                int inr = q >= -8.0f && q <= 7.0f;
                mask[r * mb + (c >> 3)] |= (uint8_t)(inr << (c & 7));
                resid[r * k + c] = inr ? (int8_t)rintf((rintf(q) - q) * 254.0f) : 0;
            }
        }
    st = bie_cpu_bgemm(kern, m, l->out, k * 8, (const uint8_t *)codes, k, (const uint8_t *)wc, k,
                       scale, out->data);
    if (st != BIE_OK) goto done;
    l->scale_a = scale_a;
    if (!l->training && l->qweight && l->qcodes == NULL) { /* codes from qweight: keep them */
        l->qcodes = wcodes;
        wcodes = NULL;
    }
    if (keep) {
        pack_nibbles(codes, m, k, nib);
        drop_saved(l);
        l->saved_codes = nib;
        l->saved_mask = mask;
        l->saved_resid = resid;
        l->saved_wcodes = wcodes;
        l->saved_m = m;
        l->saved_ndim = x->ndim;
        memcpy(l->saved_shape, x->shape, sizeof l->saved_shape);
        l->saved_scale_a = scale_a;
        l->saved_scale_w = l->scale_w;
        l->has_saved = true;
        nib = mask = NULL;
        resid = wcodes = NULL;
    }
done:
    bie_free_aligned(codes);
    bie_free_aligned(wcodes);
    bie_free_aligned(nib);
    bie_free_aligned(mask);
    bie_free_aligned(resid);
    return st;
}

bie_status bie_q4_linear_backward(bie_q4_linear *l, const bie_tensor *grad_out, bie_tensor *grad_x) {
    static const char *who = "q4_linear_backward";
    CHECK_LAYER(l);
    if (!l->has_saved)
        return bie_fail(BIE_ERR_STATE, "%s: no saved activations: run a training-mode forward first", who);
    bie_tensor like;
    memset(&like, 0, sizeof like);
    like.ndim = l->saved_ndim;
    memcpy(like.shape, l->saved_shape, sizeof like.shape);
    BIE_TRY(bie_check_rows_tensor(grad_out, "grad_out", BIE_F32, l->out, &like, who));
    if (grad_x) BIE_TRY(bie_check_rows_tensor(grad_x, "grad_x", BIE_F32, l->in, &like, who));
    const int64_t m = l->saved_m, k = l->in, n = l->out, mb = (k + 7) / 8, nrb = bie_nibble_row_bytes(k);
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
    for (int64_t r = 0; r < m; r++)
        for (int64_t c = 0; c < k; c++) xs[r * k + c] = (float)bie_nibble_get(l->saved_codes + r * nrb, c) * l->saved_scale_a;
    const float *g = grad_out->data;
    /* grad_x = (grad_out @ (q4(w) * scale_w)) * inr;  grad_w = grad_out^T @ (q4(x') * scale_a) */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)m, (int)k, (int)n, 1.0f, g, (int)n, wf,
                (int)k, 0.0f, gx, (int)k);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)n, (int)k, (int)m, 1.0f, g, (int)n, xs,
                (int)k, 0.0f, gw, (int)k);
    double dscale = 0;
    for (int64_t r = 0; r < m; r++)
        for (int64_t c = 0; c < k; c++) {
            float v = bie_bit(l->saved_mask + r * mb, c) ? gx[r * k + c] : 0.0f;
            gx[r * k + c] = v;
            dscale += (double)v * (double)l->saved_resid[r * k + c] / 254.0;
            col[c] += v;
        }
    for (int64_t c = 0; c < k; c++) gb[c] = (float)col[c];
    bie_free_aligned(l->grad_w);
    bie_free_aligned(l->grad_bias_a);
    l->grad_w = gw;
    l->grad_bias_a = gb;
    l->grad_scale_a = (float)(dscale / sqrt((double)(m * k) * 7.0));
    l->has_grad = true;
    bie_free_aligned(wf);
    bie_free_aligned(xs);
    if (!grad_x) bie_free_aligned(gx);
    free(col);
    return BIE_OK;
}

bie_status bie_q4_linear_grad(bie_q4_linear *l, bie_param which, bie_tensor *v) {
    CHECK_LAYER(l);
    BIE_CHECK_NULL(v);
    if (!l->has_grad) return bie_fail(BIE_ERR_STATE, "%s: no gradients yet (run backward)", MODULE);
    int64_t wshape[2] = {l->out, l->in}, one = 1;
    switch (which) {
    case BIE_PARAM_WEIGHT:
    case BIE_PARAM_WEIGHT_FLOAT_GRAD: return bie_tensor_view(v, l->grad_w, BIE_F32, 2, wshape);
    case BIE_PARAM_BIAS_A: return bie_tensor_view(v, l->grad_bias_a, BIE_F32, 1, &l->in);
    case BIE_PARAM_SCALE_A: return bie_tensor_view(v, &l->grad_scale_a, BIE_F32, 1, &one);
    default: break;
    }
    return bie_fail(BIE_ERR_INVALID_ARGUMENT, "%s: parameter %d has no gradient", MODULE, (int)which);
}
