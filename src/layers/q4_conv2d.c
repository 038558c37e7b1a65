/* 4-bit conv2d (SPEC §4): per image, the weight's 4-bit codes (out_c x in_c k k) against an
 * int8 im2col of the input's codes (one row per output pixel), exact integer accumulation.
 * Padded taps get code 0, so zero padding needs no correction. Backward through
 * im2col/col2im and OpenBLAS, from the codes, clip bits and residuals kept by the forward.
 * Layers on a CUDA device delegate to q4_conv2d_cuda.c. */
#include <cblas.h>
#include <math.h>
#include <string.h>

#include "../cpu/dispatch.h"
#include "../cpu/frame/pack.h"
#include "q4_conv2d_cuda.h"

static const char *const MODULE = "q4_conv2d";

#define CHECK_LAYER(l)                                                                         \
    do {                                                                                       \
        if ((l) == NULL) return bie_fail(BIE_ERR_NULL_POINTER, "%s: layer is NULL", __func__); \
    } while (0)

static int64_t fan_in(const bie_q4_conv2d *l) { return l->in_c * l->k * l->k; }

static void drop_saved(bie_q4_conv2d *l) {
    bie_free_aligned(l->saved_codes);
    bie_free_aligned(l->saved_mask);
    bie_free_aligned(l->saved_resid);
    bie_free_aligned(l->saved_wcodes);
    l->saved_codes = l->saved_mask = NULL;
    l->saved_resid = l->saved_wcodes = NULL;
    l->has_saved = false;
}

bie_status bie_q4_conv2d_create(bie_q4_conv2d **out, int64_t in_channels, int64_t out_channels,
                                int kernel_size, int stride, int padding, int dilation,
                                bie_device device, bie_dtype dtype) {
    BIE_CHECK_NULL(out);
    BIE_TRY(bie_conv_check_params(in_channels, out_channels, kernel_size, stride, padding, dilation, MODULE));
    BIE_TRY(bie_layer_check_device(device, dtype, MODULE));
    bie_q4_conv2d *l = calloc(1, sizeof *l);
    if (l == NULL) return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: layer", MODULE);
    l->in_c = in_channels;
    l->out_c = out_channels;
    l->k = kernel_size;
    l->stride = stride;
    l->padding = padding;
    l->dilation = dilation;
    l->device = device;
    l->dtype = dtype;
    l->training = true;
    l->kernel_id = -1;
    bie_q4w_init(&l->w, out_channels, fan_in(l));
    l->bias_a = bie_layer_bias_alloc(in_channels);
    bie_status st = l->bias_a ? BIE_OK : bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: bias_a", MODULE);
#ifdef BIE_HAVE_CUDA
    if (st == BIE_OK && device.type == BIE_DEVICE_CUDA) st = bie_q4cc_create(l);
#endif
    if (st == BIE_OK) st = bie_q4_conv2d_reset_parameters(l, 0);
    if (st != BIE_OK) {
        bie_q4_conv2d_free(l);
        return st;
    }
    *out = l;
    return BIE_OK;
}

void bie_q4_conv2d_free(bie_q4_conv2d *l) {
    if (l == NULL) return;
#ifdef BIE_HAVE_CUDA
    bie_q4cc_free(l);
#endif
    drop_saved(l);
    bie_q4w_free(&l->w);
    bie_free_aligned(l->bias_a);
    bie_grads_free(&l->grads);
    free(l);
}

bie_status bie_q4_conv2d_reset_parameters(bie_q4_conv2d *l, uint64_t seed) {
    CHECK_LAYER(l);
    BIE_ON_CUDA(l, bie_q4cc_reset(l, seed));
    BIE_TRY(bie_q4w_reset(&l->w, seed));
    drop_saved(l);
    return BIE_OK;
}

bie_status bie_q4_conv2d_prepare_params(bie_q4_conv2d *l) {
    CHECK_LAYER(l);
    BIE_ON_CUDA(l, bie_q4cc_prepare(l));
    BIE_TRY(bie_q4w_prepare(&l->w, "q4_conv2d_prepare_params"));
    drop_saved(l);
    return BIE_OK;
}

bie_status bie_q4_conv2d_set_weight_data(bie_q4_conv2d *l, const bie_tensor *w) {
    CHECK_LAYER(l);
    BIE_ON_CUDA(l, bie_q4cc_set_weight_data(l, w));
    static const char *who = "q4_conv2d_set_weight_data";
    const int64_t shape[4] = {l->out_c, l->in_c, l->k, l->k};
    BIE_TRY(bie_conv_check_shape4(w, shape, "weight", who));
    BIE_TRY(bie_q4w_set_data(&l->w, w->data, who));
    drop_saved(l);
    return BIE_OK;
}

bie_status bie_q4_conv2d_generate_quantized_weight(bie_q4_conv2d *l, bool qweight_only) {
    CHECK_LAYER(l);
    BIE_ON_CUDA(l, bie_q4cc_generate_quantized_weight(l, qweight_only));
    BIE_TRY(bie_q4w_generate_qweight(&l->w, qweight_only, "q4_conv2d_generate_quantized_weight"));
    if (qweight_only) drop_saved(l);
    return BIE_OK;
}

bie_status bie_q4_conv2d_set_quantized_weight_data(bie_q4_conv2d *l, const bie_tensor *q) {
    CHECK_LAYER(l);
    BIE_ON_CUDA(l, bie_q4cc_set_quantized_weight_data(l, q));
    static const char *who = "q4_conv2d_set_quantized_weight_data";
    const int64_t rb = bie_nibble_row_bytes(fan_in(l));
    BIE_TRY(bie_check_rows_tensor(q, "qweight", BIE_U8, rb, NULL, who));
    if (q->ndim != 2 || q->shape[0] != l->out_c)
        return bie_fail(BIE_ERR_SHAPE, "%s: qweight must be [%lld, %lld]", who, (long long)l->out_c, (long long)rb);
    return bie_q4w_set_qweight(&l->w, q->data, who);
}

bie_status bie_q4_conv2d_set_training(bie_q4_conv2d *l, bool training) {
    CHECK_LAYER(l);
    if (!training) drop_saved(l); /* on CUDA too: has_saved is shared */
    l->training = training;
    return BIE_OK;
}

bie_status bie_q4_conv2d_set_gemm_kernel(bie_q4_conv2d *l, int id) {
    CHECK_LAYER(l);
    BIE_ON_CUDA(l, bie_q4cc_set_kernel(l, id));
    if (id != -1) {
        const bie_cpu_kernel *kern;
        BIE_TRY(bie_cpu_kernel_for_call(BIE_OP_Q4_GEMM, id, 1, "q4_conv2d_set_gemm_kernel", &kern));
    }
    l->kernel_id = id;
    return BIE_OK;
}

bie_status bie_q4_conv2d_set_scale_a(bie_q4_conv2d *l, float scale_a) {
    CHECK_LAYER(l);
    BIE_TRY(bie_check_scale_a(scale_a, MODULE));
    BIE_ON_CUDA(l, bie_q4cc_set_scale_a(l, scale_a));
    l->scale_a = scale_a;
    return BIE_OK;
}

bie_status bie_q4_conv2d_param(bie_q4_conv2d *l, bie_param which, bie_tensor *v) {
    CHECK_LAYER(l);
    BIE_CHECK_NULL(v);
    BIE_ON_CUDA(l, bie_q4cc_param(l, which, v));
    int64_t wshape[4] = {l->out_c, l->in_c, l->k, l->k}, one = 1;
    int64_t qshape[2] = {l->out_c, bie_nibble_row_bytes(fan_in(l))};
    switch (which) {
    case BIE_PARAM_WEIGHT:
        if (l->w.f32 == NULL) return bie_bw_no_weight("q4_conv2d_param");
        return bie_tensor_view(v, l->w.f32, BIE_F32, 4, wshape);
    case BIE_PARAM_QWEIGHT:
        if (l->w.qweight == NULL)
            return bie_fail(BIE_ERR_STATE, "%s: no qweight yet (generate_quantized_weight)", MODULE);
        return bie_tensor_view(v, l->w.qweight, BIE_U8, 2, qshape);
    case BIE_PARAM_BIAS_A: return bie_tensor_view(v, l->bias_a, BIE_F32, 1, &l->in_c);
    case BIE_PARAM_SCALE_A: return bie_tensor_view(v, &l->scale_a, BIE_F32, 1, &one);
    case BIE_PARAM_SCALE_W: return bie_tensor_view(v, &l->w.scale_w, BIE_F32, 1, &one);
    default: break;
    }
    return bie_fail(BIE_ERR_INVALID_ARGUMENT, "%s: parameter %d does not exist", MODULE, (int)which);
}

bie_status bie_q4_conv2d_opt_weight(bie_q4_conv2d *l, bie_tensor *v) {
    CHECK_LAYER(l);
    BIE_CHECK_NULL(v);
    if (l->training) return bie_q4_conv2d_param(l, BIE_PARAM_WEIGHT, v);
#ifdef BIE_HAVE_CUDA
    if (l->cuda && !bie_q4cc_has_qweight(l)) BIE_TRY(bie_q4_conv2d_generate_quantized_weight(l, false));
    if (l->cuda) return bie_q4_conv2d_param(l, BIE_PARAM_QWEIGHT, v);
#endif
    if (l->w.qweight == NULL) BIE_TRY(bie_q4_conv2d_generate_quantized_weight(l, false));
    return bie_q4_conv2d_param(l, BIE_PARAM_QWEIGHT, v);
}

bie_status bie_q4_conv2d_check_forward(const bie_q4_conv2d *l, const bie_tensor *x) {
    CHECK_LAYER(l);
    BIE_ON_CUDA(l, bie_q4cc_check_forward(l, x));
    return bie_conv_check_input(x, l->in_c, l->k, l->stride, l->padding, l->dilation, "q4_conv2d_check_forward");
}

bie_status bie_q4_conv2d_output_size(const bie_q4_conv2d *l, int64_t h, int64_t w, int64_t *out_h,
                                     int64_t *out_w) {
    CHECK_LAYER(l);
    BIE_CHECK_NULL(out_h);
    BIE_CHECK_NULL(out_w);
    if (h < 1 || w < 1) return bie_fail(BIE_ERR_SHAPE, "%s: input extents must be >= 1", MODULE);
    *out_h = bie_conv_out_extent(h, l->k, l->stride, l->padding, l->dilation);
    *out_w = bie_conv_out_extent(w, l->k, l->stride, l->padding, l->dilation);
    return BIE_OK;
}

static bie_status activation_scale(const bie_q4_conv2d *l, const bie_tensor *x, float *scale) {
    return bie_activation_scale(l->scale_a, x->data, bie_tensor_numel(x), 2.0 / 11.269, MODULE, scale);
}

bie_status bie_q4_conv2d_set_activation(bie_q4_conv2d *l, const bie_tensor *x, bie_tensor *x_out) {
    CHECK_LAYER(l);
    BIE_ON_CUDA(l, bie_q4cc_set_activation(l, x, x_out));
    static const char *who = "q4_conv2d_set_activation";
    BIE_TRY(bie_q4_conv2d_check_forward(l, x));
    if (x_out) BIE_TRY(bie_conv_check_shape4(x_out, x->shape, "output", who));
    float scale = 0;
    BIE_TRY(activation_scale(l, x, &scale));
    l->scale_a = scale;
    if (x_out) {
        const int64_t hw = x->shape[2] * x->shape[3], n = bie_tensor_numel(x);
        const float *src = x->data;
        float *dst = x_out->data;
        for (int64_t i = 0; i < n; i++) dst[i] = src[i] + l->bias_a[(i / hw) % l->in_c];
    }
    return BIE_OK;
}

/* cols [OH OW, C k k] int8: the codes under each tap of each output pixel, 0 outside. */
static void im2col_codes(const bie_conv_geom *g, const int8_t *img, int8_t *cols) {
    const int64_t kk = g->k * g->k, K = g->c * kk;
#pragma omp parallel for num_threads(bie_threads()) schedule(static) if (g->oh * g->ow * K > 65536)
    for (int64_t pix = 0; pix < g->oh * g->ow; pix++) {
        int64_t oy = pix / g->ow, ox = pix % g->ow;
        int8_t *row = cols + pix * K;
        for (int64_t c = 0; c < g->c; c++)
            for (int64_t i = 0; i < g->k; i++) {
                int64_t iy = bie_conv_in(g, oy, i);
                for (int64_t j = 0; j < g->k; j++) {
                    int64_t ix = bie_conv_in(g, ox, j);
                    row[c * kk + i * g->k + j] = (iy >= 0 && iy < g->h && ix >= 0 && ix < g->w)
                                                     ? img[(c * g->h + iy) * g->w + ix] : 0;
                }
            }
    }
}

bie_status bie_q4_conv2d_forward(bie_q4_conv2d *l, const bie_tensor *x, bie_tensor *out) {
    CHECK_LAYER(l);
    BIE_ON_CUDA(l, bie_q4cc_forward(l, x, out));
    static const char *who = "q4_conv2d_forward";
    BIE_TRY(bie_q4_conv2d_check_forward(l, x));
    const bie_conv_geom g = bie_conv_geometry(x, l->out_c, l->k, l->stride, l->padding, l->dilation);
    const int64_t oshape[4] = {g.n, g.o, g.oh, g.ow};
    BIE_TRY(bie_conv_check_shape4(out, oshape, "output", who));
    if (l->w.f32 == NULL && (l->training || l->w.qweight == NULL)) return bie_bw_no_weight(who);
    float scale_a = 0;
    BIE_TRY(activation_scale(l, x, &scale_a));
    const float scale = scale_a * l->w.scale_w;
    if (!isfinite(scale)) return bie_fail(BIE_ERR_NOT_FINITE, "%s: scale_a * scale_w is not finite", who);
    const bie_cpu_kernel *kern;
    BIE_TRY(bie_cpu_kernel_for_call(BIE_OP_Q4_GEMM, l->kernel_id, g.o, who, &kern));
    const int64_t n_in = bie_tensor_numel(x), chw = g.c * g.h * g.w, K = fan_in(l), plane = g.oh * g.ow;
    const bool keep = l->training;
    int8_t *codes = bie_alloc_aligned((size_t)n_in), *cols = bie_alloc_aligned((size_t)(plane * K));
    uint8_t *nib = keep ? bie_alloc_aligned((size_t)bie_nibble_row_bytes(n_in)) : NULL;
    uint8_t *mask = keep ? bie_alloc_aligned((size_t)((n_in + 7) / 8)) : NULL;
    int8_t *resid = keep ? bie_alloc_aligned((size_t)n_in) : NULL, *wcodes = NULL;
    bool borrowed = false;
    bie_status st = BIE_OK;
    if (!codes || !cols || (keep && (!nib || !mask || !resid))) {
        st = bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: workspace", who);
        goto done;
    }
    if ((st = bie_q4w_codes(&l->w, !l->training, &wcodes, &borrowed, who)) != BIE_OK) goto done;
    bie_q4_encode(x->data, n_in, l->bias_a, g.h * g.w, g.c, scale_a, codes, mask, resid);
    float *o = out->data;
    for (int64_t n = 0; n < g.n && st == BIE_OK; n++) {
        im2col_codes(&g, codes + n * chw, cols);
        st = bie_cpu_bgemm(kern, g.o, plane, K * 8, (const uint8_t *)wcodes, K, (const uint8_t *)cols, K,
                           scale, o + n * g.o * plane);
    }
    if (st != BIE_OK) goto done;
    l->scale_a = scale_a;
    if (keep) {
        bie_q4_pack_nibbles(codes, 1, n_in, nib);
        drop_saved(l);
        l->saved_codes = nib;
        l->saved_mask = mask;
        l->saved_resid = resid;
        l->saved_wcodes = wcodes;
        l->saved_geom = g;
        l->saved_scale_a = scale_a;
        l->saved_scale_w = l->w.scale_w;
        l->has_saved = true;
        nib = mask = NULL;
        resid = wcodes = NULL;
    }
done:
    bie_free_aligned(codes);
    bie_free_aligned(cols);
    if (!borrowed) bie_free_aligned(wcodes);
    bie_free_aligned(nib);
    bie_free_aligned(mask);
    bie_free_aligned(resid);
    return st;
}

bie_status bie_q4_conv2d_backward(bie_q4_conv2d *l, const bie_tensor *grad_out, bie_tensor *grad_x) {
    static const char *who = "q4_conv2d_backward";
    CHECK_LAYER(l);
    BIE_ON_CUDA(l, bie_q4cc_backward(l, grad_out, grad_x));
    if (!l->has_saved)
        return bie_fail(BIE_ERR_STATE, "%s: no saved activations: run a training-mode forward first", who);
    const bie_conv_geom g = l->saved_geom;
    const int64_t gshape[4] = {g.n, g.o, g.oh, g.ow}, xshape[4] = {g.n, g.c, g.h, g.w};
    BIE_TRY(bie_conv_check_shape4(grad_out, gshape, "grad_out", who));
    if (grad_x) BIE_TRY(bie_conv_check_shape4(grad_x, xshape, "grad_x", who));
    const int64_t K = fan_in(l), plane = g.oh * g.ow, hw = g.h * g.w, chw = g.c * hw, n_in = g.n * chw;
    if (plane > INT32_MAX || K * plane > (int64_t)1 << 40)
        return bie_fail(BIE_ERR_OVERFLOW, "%s: image too large for the BLAS index range", who);
    float *wf = bie_alloc_aligned((size_t)(g.o * K) * sizeof(float));
    float *cols = bie_alloc_aligned((size_t)(K * plane) * sizeof(float));
    float *img = bie_alloc_aligned((size_t)chw * sizeof(float));
    float *gx = grad_x ? grad_x->data : bie_alloc_aligned((size_t)n_in * sizeof(float));
    float *gw = bie_alloc_aligned((size_t)(g.o * K) * sizeof(float));
    float *gb = bie_alloc_aligned((size_t)g.c * sizeof(float));
    double *csum = calloc((size_t)g.c, sizeof(double));
    if (!wf || !cols || !img || !gx || !gw || !gb || !csum) {
        bie_free_aligned(wf);
        bie_free_aligned(cols);
        bie_free_aligned(img);
        if (!grad_x) bie_free_aligned(gx);
        bie_free_aligned(gw);
        bie_free_aligned(gb);
        free(csum);
        return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: workspace", who);
    }
    for (int64_t i = 0; i < g.o * K; i++) wf[i] = (float)l->saved_wcodes[i] * l->saved_scale_w;
    const float *go = grad_out->data;
    for (int64_t n = 0; n < g.n; n++) {
        const float *gn = go + n * g.o * plane;
        float *gxn = gx + n * chw;
        /* grad_x = conv2d_input(grad_out, q4(w) * scale_w) */
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)K, (int)plane, (int)g.o, 1.0f, wf,
                    (int)K, gn, (int)plane, 0.0f, cols, (int)plane);
        memset(gxn, 0, (size_t)chw * sizeof(float));
        bie_conv_col2im(&g, cols, gxn);
        /* grad_w += conv2d_weight(q4(x') * scale_a, grad_out) */
        for (int64_t i = 0; i < chw; i++) img[i] = (float)bie_nibble_get(l->saved_codes, n * chw + i) * l->saved_scale_a;
        bie_conv_im2col_f32(&g, img, cols);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)g.o, (int)K, (int)plane, 1.0f, gn,
                    (int)plane, cols, (int)plane, n ? 1.0f : 0.0f, gw, (int)K);
    }
    double dscale = 0;
    for (int64_t i = 0; i < n_in; i++) {
        float v = bie_bit(l->saved_mask, i) ? gx[i] : 0.0f;
        gx[i] = v;
        dscale += (double)v * (double)l->saved_resid[i] / 254.0;
        csum[(i / hw) % g.c] += v;
    }
    for (int64_t c = 0; c < g.c; c++) gb[c] = (float)csum[c];
    bie_grads_install(&l->grads, gw, NULL, gb, (float)(dscale / sqrt((double)n_in * 7.0)));
    bie_free_aligned(wf);
    bie_free_aligned(cols);
    bie_free_aligned(img);
    if (!grad_x) bie_free_aligned(gx);
    free(csum);
    return BIE_OK;
}

bie_status bie_q4_conv2d_grad(bie_q4_conv2d *l, bie_param which, bie_tensor *v) {
    CHECK_LAYER(l);
    BIE_ON_CUDA(l, bie_q4cc_grad(l, which, v));
    const int64_t wshape[4] = {l->out_c, l->in_c, l->k, l->k};
    return bie_grads_view(&l->grads, which, 4, wshape, &l->in_c, v, "q4_conv2d_grad");
}
