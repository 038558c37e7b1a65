/* 4-bit linear layer (SPEC §4 as a matrix product) on the CPU: forward, backward and the kind's
 * CPU ops table (the life cycle is layer.c's). The codes of x' and w are int8 rows multiplied
 * exactly by the 4-bit GEMM kernels. */
#include <cblas.h>
#include <math.h>
#include <string.h>

#include "../cpu/dispatch.h"
#include "../cpu/frame/pack.h"
#include "layer_cpu.h"

static bie_status forward(bie_layer *l, const bie_tensor *x, bie_tensor *out) {
    static const char *who = "q4_linear_forward";
    BIE_TRY(bie_layer_check_forward(l, x));
    BIE_TRY(bie_check_rows_tensor(out, "output", BIE_F32, l->out, x, who));
    if (l->qw.f32 == NULL && (l->training || l->qw.qweight == NULL)) return bie_bw_no_weight(who);
    const int64_t m = bie_tensor_numel(x) / l->in, k = l->in, mk = m * k;
    float scale_a = 0;
    BIE_TRY(bie_layer_activation_scale(l, x, &scale_a));
    const float scale = scale_a * l->qw.scale_w;
    if (!isfinite(scale))
        return bie_fail(BIE_ERR_NOT_FINITE, "%s: scale_a * scale_w is not finite", who);
    const bie_cpu_kernel *kern;
    BIE_TRY(bie_cpu_kernel_for_call(BIE_OP_Q4_GEMM, l->kernel_id, m, who, &kern));
    const bool keep = l->training;
    BIE_TRY(bie_ws_reserve(&l->ws, bie_ws_piece((size_t)mk), who));
    int8_t *codes = bie_ws_take(&l->ws, (size_t)mk), *wcodes = NULL;
    bie_q4_state state;
    const bool room = bie_q4_state_alloc(&state, mk, keep);
    bool borrowed = false;
    bie_status st = BIE_OK;
    if (!codes || !room) {
        st = bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: workspace", who);
        goto done;
    }
    bie_q4_encode(x->data, mk, l->bias_a, 1, k, scale_a, codes, state.mask, state.resid);
    if (!l->training && l->qw.qweight && kern->tile) { /* deployment: weight panels packed once */
        const bie_packed_b *wp;
        if ((st = bie_q4w_packed(&l->qw, kern, &wp, who)) == BIE_OK)
            st = bie_cpu_bgemm_packed(kern, m, (const uint8_t *)codes, k, wp, scale, out->data);
    } else {
        if ((st = bie_q4w_codes(&l->qw, !l->training, &wcodes, &borrowed, who)) != BIE_OK)
            goto done;
        st = bie_cpu_bgemm(kern, m, l->out, k * 8, (const uint8_t *)codes, k,
                           (const uint8_t *)wcodes, k, scale, out->data);
    }
    if (st != BIE_OK) goto done;
    l->scale_a = scale_a;
    if (keep) {
        bie_q4_state_keep(l, &state, codes, mk, &wcodes, scale_a);
        l->saved_m = m;
        l->saved_ndim = x->ndim;
        memcpy(l->saved_shape, x->shape, sizeof l->saved_shape);
    }
done:
    if (!borrowed) bie_free_aligned(wcodes);
    bie_q4_state_free(&state);
    return st;
}

static bie_status backward(bie_layer *l, const bie_tensor *grad_out, bie_tensor *grad_x) {
    static const char *who = "q4_linear_backward";
    if (!l->has_saved)
        return bie_fail(BIE_ERR_STATE,
                        "%s: no saved activations: run a training-mode forward first", who);
    const bie_tensor like = bie_layer_saved_like(l);
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
    for (int64_t i = 0; i < m * k; i++)
        xs[i] = (float)bie_nibble_get(l->saved_codes, i) * l->saved_scale_a;
    const float *g = grad_out->data;
    /* grad_x = (grad_out @ (q4(w) * scale_w)) * inr;  grad_w = grad_out^T @ (q4(x') * scale_a) */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)m, (int)k, (int)n, 1.0f, g, (int)n,
                wf, (int)k, 0.0f, gx, (int)k);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)n, (int)k, (int)m, 1.0f, g, (int)n,
                xs, (int)k, 0.0f, gw, (int)k);
    bie_q4_state_grads(l, gx, m * k, 1, k, gw, gb, col);
    bie_free_aligned(wf);
    bie_free_aligned(xs);
    if (!grad_x) bie_free_aligned(gx);
    free(col);
    return BIE_OK;
}

const bie_layer_ops bie_q4_linear_cpu_ops = {
    .weight = &bie_q4_weight_cpu_ops,
    .device = &bie_cpu_device_ops,
    .forward = forward,
    .backward = backward,
};
