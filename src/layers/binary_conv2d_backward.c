/* Binary conv2d backward (SPEC §3) from the saved sign/clip bit planes: conv2d_input and
 * conv2d_weight as im2col/col2im around OpenBLAS sgemm, per image. */
#include <cblas.h>
#include <math.h>
#include <string.h>

#include "../cpu/frame/pack.h"
#include "conv_common.h"
#include "layer_cpu.h"

/* cols [c k k][oh ow] of image n: scale_a * sign(x') under each tap, 0 outside the input.
 * At stride 1 a tap's pixels along a row are neighbouring bits, expanded 8 at a time
 * through a table of the 256 byte patterns. */
static void im2col_signs(const bie_conv_geom *g, const uint8_t *signs, int64_t n, float scale_a,
                         float *cols) {
    const int64_t plane = g->oh * g->ow, kk = g->k * g->k, pb = bie_conv_plane_bytes(g);
    float lut[256][8];
    for (int b = 0; b < 256; b++)
        for (int t = 0; t < 8; t++) lut[b][t] = (b >> t) & 1 ? scale_a : -scale_a;
#pragma omp parallel for num_threads(bie_threads()) schedule(static) if (g->c * kk * plane > 65536)
    for (int64_t r = 0; r < g->c * kk; r++) {
        int64_t c = r / kk, i = (r % kk) / g->k, j = r % g->k;
        const uint8_t *sp = signs + (n * g->c + c) * pb;
        float *row = cols + r * plane;
        /* the output columns whose tap lands inside the input: ox in [lo, hi) at stride 1 */
        const int64_t shift = j * g->d - g->p;
        int64_t lo = shift < 0 ? -shift : 0, hi = g->w - shift < g->ow ? g->w - shift : g->ow;
        if (hi < lo) hi = lo;
        for (int64_t oy = 0; oy < g->oh; oy++) {
            int64_t iy = bie_conv_in(g, oy, i);
            float *dst = row + oy * g->ow;
            if (iy < 0 || iy >= g->h) {
                memset(dst, 0, (size_t)g->ow * sizeof(float));
                continue;
            }
            if (g->s != 1) {
                for (int64_t ox = 0; ox < g->ow; ox++) {
                    int64_t ix = bie_conv_in(g, ox, j);
                    dst[ox] = ix >= 0 && ix < g->w
                                  ? (bie_bit(sp, iy * g->w + ix) ? scale_a : -scale_a)
                                  : 0.0f;
                }
                continue;
            }
            for (int64_t ox = 0; ox < lo; ox++) dst[ox] = 0.0f;
            for (int64_t ox = hi; ox < g->ow; ox++) dst[ox] = 0.0f;
            int64_t ox = lo, bit = iy * g->w + lo + shift;
            for (; ox + 8 <= hi; ox += 8, bit += 8) {
                const int64_t byte = bit >> 3;
                unsigned v = sp[byte];
                if (byte + 1 < pb) v |= (unsigned)sp[byte + 1] << 8; /* not past the plane */
                memcpy(dst + ox, lut[(v >> (bit & 7)) & 255u], 8 * sizeof(float));
            }
            for (; ox < hi; ox++, bit++) dst[ox] = bie_bit(sp, bit) ? scale_a : -scale_a;
        }
    }
}

bie_status bie_bc_cpu_backward(bie_layer *l, const bie_tensor *grad_out, bie_tensor *grad_x) {
    static const char *who = "binary_conv2d_backward";
    if (l == NULL) return bie_fail(BIE_ERR_NULL_POINTER, "%s: layer is NULL", who);
    if (!l->has_saved)
        return bie_fail(BIE_ERR_STATE,
                        "%s: no saved activations: run a training-mode forward first", who);
    const bie_conv_geom g = l->saved_geom;
    const int64_t gshape[4] = {g.n, g.o, g.oh, g.ow}, xshape[4] = {g.n, g.c, g.h, g.w};
    BIE_TRY(bie_conv_check_shape4(grad_out, gshape, "grad_out", who));
    if (grad_x) BIE_TRY(bie_conv_check_shape4(grad_x, xshape, "grad_x", who));
    const int64_t C = g.c, kk = g.k * g.k, K = C * kk, plane = g.oh * g.ow, hw = g.h * g.w;
    const int64_t pb = bie_conv_plane_bytes(&g);
    if (plane > INT32_MAX || K * plane > (int64_t)1 << 40)
        return bie_fail(BIE_ERR_OVERFLOW, "%s: image too large for the BLAS index range", who);
    float *wf = bie_alloc_aligned((size_t)(g.o * K) * sizeof(float));
    float *cols = bie_alloc_aligned((size_t)(K * plane) * sizeof(float));
    float *gx = grad_x ? NULL : bie_alloc_aligned((size_t)(g.n * C * hw) * sizeof(float));
    float *gw = bie_alloc_aligned((size_t)(g.o * K) * sizeof(float));
    float *gb = bie_alloc_aligned((size_t)C * sizeof(float));
    double *plane_dot = malloc((size_t)(g.n * C) * sizeof(double));
    double *plane_sum = malloc((size_t)(g.n * C) * sizeof(double));
    int8_t *gq = l->w.i8 ? bie_alloc_aligned((size_t)(g.o * K)) : NULL;
    if (!wf || !cols || (!grad_x && !gx) || !gw || !gb || !plane_dot || !plane_sum ||
        (l->w.i8 && !gq)) {
        bie_free_aligned(wf);
        bie_free_aligned(cols);
        bie_free_aligned(gx);
        bie_free_aligned(gw);
        bie_free_aligned(gb);
        bie_free_aligned(gq);
        free(plane_dot);
        free(plane_sum);
        return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: workspace", who);
    }
    if (grad_x) gx = grad_x->data;
    const float *go = grad_out->data;

    /* sign(w) * scale_w in the float weight's [c, i, j] order, from the forward's [i, j, c] bits */
    for (int64_t o = 0; o < g.o; o++)
        for (int64_t c = 0; c < C; c++)
            for (int64_t t = 0; t < kk; t++)
                wf[o * K + c * kk + t] = bie_bit(l->saved_wbits + o * l->saved_wrb, t * C + c)
                                             ? l->saved_scale_w
                                             : -l->saved_scale_w;
    for (int64_t n = 0; n < g.n; n++) {
        const float *gn = go + n * g.o * plane;
        float *gxn = gx + n * C * hw;
        /* grad_x = conv2d_input(grad_out, sign(w) * scale_w) */
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)K, (int)plane, (int)g.o, 1.0f, wf,
                    (int)K, gn, (int)plane, 0.0f, cols, (int)plane);
        memset(gxn, 0, (size_t)(C * hw) * sizeof(float));
        bie_conv_col2im(&g, cols, gxn);
        /* grad_w += conv2d_weight(sign(x') * scale_a, grad_out) */
        im2col_signs(&g, l->saved_signs, n, l->saved_scale_a, cols);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)g.o, (int)K, (int)plane, 1.0f, gn,
                    (int)plane, cols, (int)plane, n ? 1.0f : 0.0f, gw, (int)K);
    }
    /* clip mask, and per-plane sums for grad_scale_a and grad_bias_a (fixed order) */
#pragma omp parallel for num_threads(bie_threads()) schedule(static) if (g.n * C * hw > 65536)
    for (int64_t nc = 0; nc < g.n * C; nc++) {
        const uint8_t *mp = l->saved_mask + nc * pb, *sp = l->saved_signs + nc * pb;
        float *p = gx + nc * hw;
        double d = 0, sum = 0;
        for (int64_t i = 0; i < hw; i++) {
            float v = bie_bit(mp, i) ? p[i] : 0.0f;
            p[i] = v;
            d += bie_bit(sp, i) ? v : -v;
            sum += v;
        }
        plane_dot[nc] = d;
        plane_sum[nc] = sum;
    }
    double dscale = 0;
    for (int64_t c = 0; c < C; c++) {
        double b = 0;
        for (int64_t n = 0; n < g.n; n++) b += plane_sum[n * C + c];
        gb[c] = (float)b;
    }
    for (int64_t nc = 0; nc < g.n * C; nc++) dscale += plane_dot[nc];
    if (gq) bie_quantize_i8(gw, g.o * K, gq);

    bie_grads_install(&l->grads, gw, gq, gb, (float)(dscale / sqrt((double)(g.n * C * hw))));
    bie_free_aligned(wf);
    bie_free_aligned(cols);
    if (!grad_x) bie_free_aligned(gx);
    free(plane_dot);
    free(plane_sum);
    return BIE_OK;
}
