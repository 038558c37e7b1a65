/* Binary linear backward (SPEC §2), from the packed signs and clip mask kept by the
 * forward. The float GEMMs run in OpenBLAS. */
#include <cblas.h>
#include <math.h>
#include <string.h>

#include "../cpu/frame/pack.h"
#include "layer_cpu.h"

/* grad_x *= clip mask; per-row sums of grad_x * sign(x') into row_dot (summed in a fixed
 * order afterwards, so the result does not depend on the thread count). */
static void apply_mask(const bie_layer *l, int64_t m, float *gx, double *row_dot) {
    const int64_t k = l->in, rb = bie_bl_row_bytes(l);
#pragma omp parallel for num_threads(bie_threads()) schedule(static) if (m * k > 65536)
    for (int64_t i = 0; i < m; i++) {
        const uint8_t *mask = l->saved_mask + i * rb, *sign = l->saved_signs + i * rb;
        float *row = gx + i * k;
        double d = 0;
        for (int64_t c = 0; c < k; c++) {
            float g = bie_bit(mask, c) ? row[c] : 0.0f;
            row[c] = g;
            d += bie_bit(sign, c) ? g : -g;
        }
        row_dot[i] = d;
    }
}

/* Column sums of grad_x (grad of bias_a), each column summed over rows in order. */
static void column_sums(const float *gx, int64_t m, int64_t k, float *out) {
    const int64_t chunk = 256;
#pragma omp parallel for num_threads(bie_threads()) schedule(static) if (m * k > 65536)
    for (int64_t c0 = 0; c0 < k; c0 += chunk) {
        double acc[256] = {0};
        int64_t w = k - c0 < chunk ? k - c0 : chunk;
        for (int64_t i = 0; i < m; i++)
            for (int64_t c = 0; c < w; c++) acc[c] += gx[i * k + c0 + c];
        for (int64_t c = 0; c < w; c++) out[c0 + c] = (float)acc[c];
    }
}

bie_status bie_bl_cpu_backward(bie_layer *l, const bie_tensor *grad_out, bie_tensor *grad_x) {
    static const char *who = "binary_linear_backward";
    if (!l->has_saved)
        return bie_fail(BIE_ERR_STATE,
                        "%s: no saved activations: run a training-mode forward "
                        "on float input first",
                        who);
    const bie_tensor like = bie_layer_saved_like(l);
    BIE_TRY(bie_check_rows_tensor(grad_out, "grad_out", BIE_F32, l->out, &like, who));
    if (grad_x) BIE_TRY(bie_check_rows_tensor(grad_x, "grad_x", BIE_F32, l->in, &like, who));

    const int64_t m = l->saved_m, k = l->in, n = l->out, rb = bie_bl_row_bytes(l);
    if (m > INT32_MAX)
        return bie_fail(BIE_ERR_OVERFLOW, "%s: %lld rows exceed the BLAS index range", who,
                        (long long)m);
    float *wf = bie_alloc_aligned((size_t)(n * k) * sizeof(float));
    float *xs = bie_alloc_aligned((size_t)(m * k) * sizeof(float));
    float *gx = grad_x ? NULL : bie_alloc_aligned((size_t)(m * k) * sizeof(float));
    float *gw = bie_alloc_aligned((size_t)(n * k) * sizeof(float));
    float *gb = bie_alloc_aligned((size_t)k * sizeof(float));
    double *row_dot = malloc((size_t)m * sizeof(double));
    int8_t *gq = l->w.i8 ? bie_alloc_aligned((size_t)(n * k)) : NULL;
    if (!wf || !xs || (!grad_x && !gx) || !gw || !gb || !row_dot || (l->w.i8 && !gq)) {
        bie_free_aligned(wf);
        bie_free_aligned(xs);
        bie_free_aligned(gx);
        bie_free_aligned(gw);
        bie_free_aligned(gb);
        bie_free_aligned(gq);
        free(row_dot);
        return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: workspace", who);
    }
    if (grad_x) gx = grad_x->data;
    const float *g = grad_out->data;

    /* grad_x = (grad_out @ (sign(w) * scale_w)) * inr */
    bie_unpack_rows_f32(l->saved_wbits, rb, n, k, l->saved_scale_w, wf);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)m, (int)k, (int)n, 1.0f, g, (int)n,
                wf, (int)k, 0.0f, gx, (int)k);
    apply_mask(l, m, gx, row_dot);
    double dscale = 0;
    for (int64_t i = 0; i < m; i++) dscale += row_dot[i];
    column_sums(gx, m, k, gb);
    /* grad_w = grad_out^T @ (sign(x') * scale_a) */
    bie_unpack_rows_f32(l->saved_signs, rb, m, k, l->saved_scale_a, xs);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)n, (int)k, (int)m, 1.0f, g, (int)n,
                xs, (int)k, 0.0f, gw, (int)k);
    if (gq) bie_quantize_i8(gw, n * k, gq);

    bie_grads_install(&l->grads, gw, gq, gb, (float)(dscale / sqrt((double)(m * k))));
    bie_free_aligned(wf);
    bie_free_aligned(xs);
    if (!grad_x) bie_free_aligned(gx);
    free(row_dot);
    return BIE_OK;
}
