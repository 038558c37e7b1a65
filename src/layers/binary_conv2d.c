/* Binary conv2d (SPEC §3) on the CPU: the forward and the kind's CPU ops table (the life cycle is
 * layer.c's, the backward binary_conv2d_backward.c's). The forward is an implicit GEMM on packed
 * bits: per image, the weight's sign rows (out_c x in_c k k, taps in [i, j, c] order) against
 * bit-im2col rows of the input (one per output pixel). Taps outside the input are packed as -1 and
 * corrected exactly afterwards: dot = xor_dot + sum over those taps of sum_c sign(w), so zero
 * padding contributes 0 as in a float convolution. */
#include <math.h>
#include <string.h>

#include "../cpu/dispatch.h"
#include "../cpu/frame/pack.h"
#include "conv_common.h"
#include "layer_cpu.h"

/* ---------------------------------------------------------------- geometry and checks */

static bie_conv_geom geometry(const bie_layer *l, const bie_tensor *x) {
    return bie_conv_geometry(x, l->out, l->k, l->stride, l->padding, l->dilation);
}

static bie_status check_output(const bie_conv_geom *g, const bie_tensor *t, const char *what,
                               const char *who) {
    const int64_t shape[4] = {g->n, g->o, g->oh, g->ow};
    return bie_conv_check_shape4(t, shape, what, who);
}

/* ---------------------------------------------------------------- forward */

/* Sign and clip bit planes of x' = x + bias_a[c], one plane of H W bits per (n, c). */
static void pack_planes(const bie_layer *l, const bie_conv_geom *g, const float *x, float scale_a,
                        uint8_t *signs, uint8_t *mask) {
    const int64_t plane = g->h * g->w, pb = bie_conv_plane_bytes(g);
#pragma omp parallel for num_threads(bie_threads()) \
    schedule(static) if (g->n * g->c * plane > 65536)
    for (int64_t nc = 0; nc < g->n * g->c; nc++) {
        const float *xp = x + nc * plane, b = l->bias_a[nc % g->c];
        uint8_t *sp = signs + nc * pb, *mp = mask ? mask + nc * pb : NULL;
        memset(sp, 0, (size_t)pb);
        if (mp) memset(mp, 0, (size_t)pb);
        for (int64_t i = 0; i < plane; i++) {
            float v = xp[i] + b;
            sp[i >> 3] |= (uint8_t)((v >= 0.0f) << (i & 7));
            if (mp) {
                float q = v / scale_a;
                mp[i >> 3] |= (uint8_t)((q >= -1.0f && q <= 1.0f) << (i & 7));
            }
        }
    }
}

/* OR `bits` bits of src (from bit 0) into dst at bit offset `off` (dst has a spare word). */
static void or_bits(uint64_t *dst, int64_t off, const uint64_t *src, int64_t bits) {
    int64_t words = (bits + 63) / 64, shift = off & 63;
    uint64_t *d = dst + (off >> 6);
    for (int64_t i = 0; i < words; i++) {
        uint64_t v = src[i];
        if (i == words - 1 && (bits & 63)) v &= (1ull << (bits & 63)) - 1;
        d[i] |= v << shift;
        if (shift) d[i + 1] |= v >> (64 - shift);
    }
}

/* Weight sign bits in [i, j, c] order (rows of wrb bytes) and, per output channel and tap,
 * sum_c sign(w) (the padding correction). In inference mode from qweight when the layer has
 * one (as binary linear does), otherwise from the training weight. */
static bie_status weight_taps(const bie_layer *l, uint8_t **wbits_out, int64_t wrb,
                              int32_t **tapsum_out, const char *who) {
    const int64_t kk = l->k * l->k, C = l->in, K = C * kk;
    uint8_t *flat = NULL; /* [c, i, j] order sign rows */
    int64_t frb = (K + 7) / 8;
    const bool use_q = !l->training && l->w.qweight != NULL;
    if (!use_q) BIE_TRY(bie_bw_pack(&l->w, frb, &flat, who));
    const uint8_t *src = use_q ? l->w.qweight : flat;
    const int64_t srb = use_q ? bie_packed_row_bytes(K, l->w.word_bits) : frb;
    uint8_t *wbits = bie_alloc_aligned((size_t)(l->out * wrb));
    int32_t *tapsum = bie_alloc_aligned((size_t)(l->out * kk) * sizeof(int32_t));
    if (wbits == NULL || tapsum == NULL) {
        bie_free_aligned(flat);
        bie_free_aligned(wbits);
        bie_free_aligned(tapsum);
        return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: weight bits", who);
    }
#pragma omp parallel for num_threads(bie_threads()) schedule(static) if (l->out * K > 65536)
    for (int64_t o = 0; o < l->out; o++) {
        const uint8_t *s = src + o * srb;
        uint8_t *d = wbits + o * wrb;
        memset(d, 0, (size_t)wrb);
        for (int64_t t = 0; t < kk; t++) {
            int32_t ones = 0;
            for (int64_t c0 = 0; c0 < C; c0 += 64) { /* 64 channels of tap t at a time */
                int64_t cn = C - c0 < 64 ? C - c0 : 64;
                uint64_t chunk = 0;
                for (int64_t c = 0; c < cn; c++)
                    chunk |= (uint64_t)bie_bit(s, (c0 + c) * kk + t) << c;
                or_bits((uint64_t *)d, t * C + c0, &chunk, cn);
                ones += __builtin_popcountll(chunk);
            }
            tapsum[o * kk + t] = 2 * ones - (int32_t)C;
        }
    }
    bie_free_aligned(flat);
    *wbits_out = wbits;
    *tapsum_out = tapsum;
    return BIE_OK;
}

/* Bit-im2col of image n: one row of crb bytes per output pixel, taps in [i, j, c] order;
 * taps outside the input stay 0 (-1, corrected later). */
static void im2col_bits(const bie_conv_geom *g, const uint64_t *nhwc, int64_t cw, int64_t n,
                        uint8_t *cols, int64_t crb) {
    const int64_t C = g->c;
#pragma omp parallel for num_threads(bie_threads()) \
    schedule(static) if (g->oh * g->ow * g->k * g->k * C > 65536)
    for (int64_t pix = 0; pix < g->oh * g->ow; pix++) {
        int64_t oy = pix / g->ow, ox = pix % g->ow;
        uint64_t *row = (uint64_t *)(cols + pix * crb);
        memset(row, 0, (size_t)crb);
        for (int64_t i = 0; i < g->k; i++) {
            int64_t iy = bie_conv_in(g, oy, i);
            if (iy < 0 || iy >= g->h) continue;
            for (int64_t j = 0; j < g->k; j++) {
                int64_t ix = bie_conv_in(g, ox, j);
                if (ix < 0 || ix >= g->w) continue;
                or_bits(row, (i * g->k + j) * C, nhwc + ((n * g->h + iy) * g->w + ix) * cw, C);
            }
        }
    }
}

/* dst (out_c x OH OW of one image) = (float)(dot + padding correction) * scale, where src
 * (rows of stride src_ld) holds (float)dot exactly. `outside` lists, per output pixel, how
 * many of its taps fall outside the input and which (border_taps), or is NULL. */
static void finish_image(const bie_conv_geom *g, const int32_t *tapsum, const int32_t *outside,
                         float scale, const float *src, int64_t src_ld, float *dst) {
    const int64_t kk = g->k * g->k, plane = g->oh * g->ow;
#pragma omp parallel for num_threads(bie_threads()) schedule(static) if (g->o * plane > 65536)
    for (int64_t o = 0; o < g->o; o++) {
        const float *in = src + o * src_ld;
        const int32_t *ts = tapsum + o * kk;
        float *row = dst + o * plane;
        for (int64_t pix = 0; pix < plane; pix++) {
            int64_t dot = (int64_t)in[pix];
            if (outside) {
                const int32_t *list = outside + pix * (kk + 1);
                if (list[0] == 0) { /* in[pix] is the exact dot: (float)dot * scale */
                    row[pix] = in[pix] * scale;
                    continue;
                }
                for (int32_t q = 1; q <= list[0]; q++) dot += ts[list[q]];
            } else { /* no list (very large planes and kernels): find the taps here */
                const int64_t oy = pix / g->ow, ox = pix % g->ow;
                for (int64_t i = 0; i < g->k; i++)
                    for (int64_t j = 0; j < g->k; j++) {
                        int64_t iy = bie_conv_in(g, oy, i), ix = bie_conv_in(g, ox, j);
                        if (iy < 0 || iy >= g->h || ix < 0 || ix >= g->w) dot += ts[i * g->k + j];
                    }
            }
            row[pix] = (float)dot * scale;
        }
    }
}

/* Per output pixel: the number of taps outside the input, then their indices i k + j. */
static void border_taps(const bie_conv_geom *g, int32_t *outside) {
    const int64_t kk = g->k * g->k;
    for (int64_t pix = 0; pix < g->oh * g->ow; pix++) {
        int64_t oy = pix / g->ow, ox = pix % g->ow;
        int32_t *list = outside + pix * (kk + 1), count = 0;
        for (int64_t i = 0; i < g->k; i++)
            for (int64_t j = 0; j < g->k; j++) {
                int64_t iy = bie_conv_in(g, oy, i), ix = bie_conv_in(g, ox, j);
                if (iy < 0 || iy >= g->h || ix < 0 || ix >= g->w)
                    list[++count] = (int32_t)(i * g->k + j);
            }
        list[0] = count;
    }
}

static const bie_cpu_kernel *forward_kernel(const bie_layer *l, int64_t m) {
    if (l->kernel_id >= 0) return bie_cpu_kernel_by_id(l->kernel_id);
    return bie_cpu_default_kernel(m);
}

/* o (out_c x OH OW per image) = the product of the sign planes with the weight bits (rows of
 * crb bytes, taps in [i, j, c] order), padding-corrected with tapsum, times scale. */
static bie_status product(bie_layer *l, const bie_conv_geom *g, const uint8_t *signs,
                          const uint8_t *wbits, int64_t crb, const int32_t *tapsum, float scale,
                          float *o, const char *who) {
    const int64_t C = g->c, K = C * g->k * g->k, plane = g->oh * g->ow;
    const int64_t pb = bie_conv_plane_bytes(g), cw = (C + 63) / 64;
    int64_t nhwc_words, cols_bytes;
    if (!bie_mul_ok(g->n * g->h * g->w, cw, &nhwc_words) || !bie_mul_ok(plane, crb, &cols_bytes))
        return bie_fail(BIE_ERR_OVERFLOW, "%s: input too large", who);
    /* Images go through the GEMM in chunks (one call for many images keeps both threads
     * busy); a chunk's bit-im2col stays within about 32 MiB. */
    int64_t chunk = (32 << 20) / (cols_bytes > 0 ? cols_bytes : 1);
    chunk = chunk < 1 ? 1 : chunk > g->n ? g->n : chunk;
    cols_bytes *= chunk;
    /* the outside-tap lists, unless they would take more than 16 MB */
    const int64_t list_ints = plane * (g->k * g->k + 1);
    const bool lists = list_ints <= ((int64_t)1 << 22);
    const size_t nhwc_b = (size_t)nhwc_words * 8, border_b = lists ? (size_t)list_ints * 4 : 0;
    const size_t dots_b = (size_t)(g->o * chunk * plane) * sizeof(float);
    BIE_TRY(bie_ws_reserve(&l->ws,
                           bie_ws_piece(nhwc_b) + bie_ws_piece((size_t)cols_bytes) +
                               bie_ws_piece(border_b) + bie_ws_piece(dots_b),
                           who));
    uint64_t *nhwc = bie_ws_take(&l->ws, nhwc_b);
    uint8_t *cols = bie_ws_take(&l->ws, (size_t)cols_bytes);
    int32_t *border = lists ? bie_ws_take(&l->ws, border_b) : NULL;
    float *dots = bie_ws_take(&l->ws, dots_b);
    if (border) border_taps(g, border);
#pragma omp parallel for num_threads(bie_threads()) \
    schedule(static) if (g->n * g->h * g->w * C > 65536)
    for (int64_t px = 0; px < g->n * g->h * g->w; px++) { /* sign planes -> C bits per pixel */
        int64_t n = px / (g->h * g->w), pos = px % (g->h * g->w);
        uint64_t *d = nhwc + px * cw;
        memset(d, 0, (size_t)cw * 8);
        for (int64_t c = 0; c < C; c++)
            d[c >> 6] |= (uint64_t)bie_bit(signs + (n * C + c) * pb, pos) << (c & 63);
    }
    const bie_cpu_kernel *kern = forward_kernel(l, g->o);
    bie_status st = BIE_OK;
    for (int64_t n0 = 0; n0 < g->n && st == BIE_OK; n0 += chunk) {
        const int64_t cnt = g->n - n0 < chunk ? g->n - n0 : chunk, width = cnt * plane;
        for (int64_t n = n0; n < n0 + cnt; n++)
            im2col_bits(g, nhwc, cw, n, cols + (n - n0) * plane * crb, crb);
        st = bie_cpu_bgemm(kern, g->o, width, K, wbits, crb, cols, crb, 1.0f, dots);
        for (int64_t n = n0; n < n0 + cnt && st == BIE_OK; n++)
            finish_image(g, tapsum, border, scale, dots + (n - n0) * plane, width,
                         o + n * g->o * plane);
    }
    return st;
}

static bie_status forward(bie_layer *l, const bie_tensor *x, bie_tensor *out) {
    static const char *who = "binary_conv2d_forward";
    BIE_TRY(bie_layer_check_forward(l, x));
    const bie_conv_geom g = geometry(l, x);
    BIE_TRY(check_output(&g, out, "output", who));
    if (!bie_bw_has_training_weight(&l->w) && (l->training || l->w.qweight == NULL))
        return bie_bw_no_weight(who);
    float scale_a = 0;
    BIE_TRY(bie_layer_activation_scale(l, x, &scale_a));
    const float scale = scale_a * l->w.scale_w;
    if (!isfinite(scale))
        return bie_fail(BIE_ERR_NOT_FINITE, "%s: scale_a * scale_w = %g is not finite", who,
                        (double)scale);

    /* Allocate everything before any state changes. */
    const int64_t C = g.c, K = C * g.k * g.k, pb = bie_conv_plane_bytes(&g);
    const int64_t crb = ((K + 63) / 64 + 1) * 8;
    int64_t planes_bytes;
    if (!bie_mul_ok(g.n * C, pb, &planes_bytes))
        return bie_fail(BIE_ERR_OVERFLOW, "%s: input too large", who);
    uint8_t *signs = bie_alloc_aligned((size_t)planes_bytes);
    uint8_t *mask = l->training ? bie_alloc_aligned((size_t)planes_bytes) : NULL;
    uint8_t *wbits = NULL;
    int32_t *tapsum = NULL;
    bie_status st = BIE_OK;
    if (!signs || (l->training && !mask)) {
        st = bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: packed input", who);
        goto done;
    }
    if ((st = weight_taps(l, &wbits, crb, &tapsum, who)) != BIE_OK) goto done;
    pack_planes(l, &g, x->data, scale_a, signs, mask);
    if ((st = product(l, &g, signs, wbits, crb, tapsum, scale, out->data, who)) != BIE_OK)
        goto done;

    l->scale_a = scale_a;
    if (l->training) {
        bie_layer_drop_saved(l);
        l->saved_signs = signs;
        l->saved_mask = mask;
        l->saved_wbits = wbits;
        l->saved_wrb = crb;
        l->saved_geom = g;
        l->saved_scale_a = scale_a;
        l->saved_scale_w = l->w.scale_w;
        l->has_saved = true;
        signs = mask = wbits = NULL;
    }
done:
    bie_free_aligned(signs);
    bie_free_aligned(mask);
    bie_free_aligned(wbits);
    bie_free_aligned(tapsum);
    return st;
}

/* The last training forward's output again from its kept sign planes and weight bits (the
 * padding corrections counted from those bits) and the scales it used. */
static bie_status forward_again(bie_layer *l, bie_tensor *out) {
    static const char *who = "binary_conv2d_forward_again";
    if (!l->has_saved)
        return bie_fail(BIE_ERR_STATE, "%s: nothing kept: run a training-mode forward first", who);
    const bie_conv_geom g = l->saved_geom;
    BIE_TRY(check_output(&g, out, "output", who));
    const int64_t kk = g.k * g.k;
    int32_t *tapsum = bie_alloc_aligned((size_t)(g.o * kk) * sizeof(int32_t));
    if (tapsum == NULL) return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: tap sums", who);
    for (int64_t o = 0; o < g.o; o++) /* sum_c sign(w) per tap, from the kept bits */
        for (int64_t t = 0; t < kk; t++) {
            int32_t ones = 0;
            for (int64_t c = 0; c < g.c; c++)
                ones += bie_bit(l->saved_wbits + o * l->saved_wrb, t * g.c + c);
            tapsum[o * kk + t] = 2 * ones - (int32_t)g.c;
        }
    const bie_status st = product(l, &g, l->saved_signs, l->saved_wbits, l->saved_wrb, tapsum,
                                  l->saved_scale_a * l->saved_scale_w, out->data, who);
    bie_free_aligned(tapsum);
    return st;
}

const bie_layer_ops bie_binary_conv2d_cpu_ops = {
    .weight = &bie_binary_weight_cpu_ops,
    .device = &bie_cpu_device_ops,
    .forward = forward,
    .forward_again = forward_again,
    .backward = bie_bc_cpu_backward,
};
