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
#include "conv_common.h"
#include "layer_cpu.h"

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
                                                     ? img[(c * g->h + iy) * g->w + ix]
                                                     : 0;
                }
            }
    }
}

static bie_status forward(bie_layer *l, const bie_tensor *x, bie_tensor *out) {
    static const char *who = "q4_conv2d_forward";
    BIE_TRY(bie_layer_check_forward(l, x));
    const bie_conv_geom g = bie_conv_geometry(x, l->out, l->k, l->stride, l->padding, l->dilation);
    const int64_t oshape[4] = {g.n, g.o, g.oh, g.ow};
    BIE_TRY(bie_conv_check_shape4(out, oshape, "output", who));
    if (l->qw.f32 == NULL && (l->training || l->qw.qweight == NULL)) return bie_bw_no_weight(who);
    float scale_a = 0;
    BIE_TRY(bie_layer_activation_scale(l, x, &scale_a));
    const float scale = scale_a * l->qw.scale_w;
    if (!isfinite(scale))
        return bie_fail(BIE_ERR_NOT_FINITE, "%s: scale_a * scale_w is not finite", who);
    const bie_cpu_kernel *kern;
    BIE_TRY(bie_cpu_kernel_for_call(BIE_OP_Q4_GEMM, l->kernel_id, g.o, who, &kern));
    const int64_t n_in = bie_tensor_numel(x), chw = g.c * g.h * g.w, K = l->fan_in,
                  plane = g.oh * g.ow;
    const bool keep = l->training;
    BIE_TRY(bie_ws_reserve(&l->ws, bie_ws_piece((size_t)n_in) + bie_ws_piece((size_t)(plane * K)),
                           who));
    int8_t *codes = bie_ws_take(&l->ws, (size_t)n_in),
           *cols = bie_ws_take(&l->ws, (size_t)(plane * K));
    int8_t *wcodes = NULL;
    bie_q4_state state;
    const bool room = bie_q4_state_alloc(&state, n_in, keep);
    bool borrowed = false;
    bie_status st = BIE_OK;
    if (!codes || !cols || !room) {
        st = bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: workspace", who);
        goto done;
    }
    if ((st = bie_q4w_codes(&l->qw, !l->training, &wcodes, &borrowed, who)) != BIE_OK) goto done;
    bie_q4_encode(x->data, n_in, l->bias_a, g.h * g.w, g.c, scale_a, codes, state.mask,
                  state.resid);
    float *o = out->data;
    for (int64_t n = 0; n < g.n && st == BIE_OK; n++) {
        im2col_codes(&g, codes + n * chw, cols);
        st = bie_cpu_bgemm(kern, g.o, plane, K * 8, (const uint8_t *)wcodes, K,
                           (const uint8_t *)cols, K, scale, o + n * g.o * plane);
    }
    if (st != BIE_OK) goto done;
    l->scale_a = scale_a;
    if (keep) {
        bie_q4_state_keep(l, &state, codes, n_in, &wcodes, scale_a);
        l->saved_geom = g;
    }
done:
    if (!borrowed) bie_free_aligned(wcodes);
    bie_q4_state_free(&state);
    return st;
}

static bie_status backward(bie_layer *l, const bie_tensor *grad_out, bie_tensor *grad_x) {
    static const char *who = "q4_conv2d_backward";
    if (!l->has_saved)
        return bie_fail(BIE_ERR_STATE,
                        "%s: no saved activations: run a training-mode forward first", who);
    const bie_conv_geom g = l->saved_geom;
    const int64_t gshape[4] = {g.n, g.o, g.oh, g.ow}, xshape[4] = {g.n, g.c, g.h, g.w};
    BIE_TRY(bie_conv_check_shape4(grad_out, gshape, "grad_out", who));
    if (grad_x) BIE_TRY(bie_conv_check_shape4(grad_x, xshape, "grad_x", who));
    const int64_t K = l->fan_in, plane = g.oh * g.ow, hw = g.h * g.w, chw = g.c * hw,
                  n_in = g.n * chw;
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
        for (int64_t i = 0; i < chw; i++)
            img[i] = (float)bie_nibble_get(l->saved_codes, n * chw + i) * l->saved_scale_a;
        bie_conv_im2col_f32(&g, img, cols);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)g.o, (int)K, (int)plane, 1.0f, gn,
                    (int)plane, cols, (int)plane, n ? 1.0f : 0.0f, gw, (int)K);
    }
    bie_q4_state_grads(l, gx, n_in, hw, g.c, gw, gb, csum);
    bie_free_aligned(wf);
    bie_free_aligned(cols);
    bie_free_aligned(img);
    if (!grad_x) bie_free_aligned(gx);
    free(csum);
    return BIE_OK;
}

const bie_layer_ops bie_q4_conv2d_cpu_ops = {
    .weight = &bie_q4_weight_cpu_ops,
    .device = &bie_cpu_device_ops,
    .forward = forward,
    .backward = backward,
};
