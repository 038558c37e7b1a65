/* The binary conv2d layer on CUDA (SPEC §3). The forward packs the input's signs per pixel
 * (NHWC bits), builds the bit im2col of every output pixel and runs the binary GEMM against
 * the weight rows (both in tap order, see cuda_internal.h), whose epilogue adds the
 * zero-padding correction of each pixel's class and writes NCHW. The sign and clip bits stay
 * on the device for the backward (two bits per input element). */
#include <cuda_runtime_api.h>
#include <string.h>

#include "../cuda/cuda_internal.h"
#include "bie_cuda.h"
#include "binary_weight_cuda.h"
#include "conv_common.h"
#include "layer_cuda.h"

struct bie_bc_cuda {
    bie_cuda_bw d;   /* weight, bias_a, scalars, gradients */
    bie_conv_geom g; /* of the last forward */
    /* Weight rows in the GEMM layout with popcounts and per-tap sums: packed by every
     * training forward (the optimizer may have changed the weight), or kept for inference
     * while wversion == d.version. */
    uint8_t *wbits;
    int *wpopc, *tapsum;
    bool w_inference;
    unsigned wversion;
    /* Padding classes of the last geometry: pix_class [plane], ylim, xlim, corr. */
    int64_t geo_h, geo_w;
    int *geo; /* pix_class, then ylim [2 ny], then xlim [2 nx] */
    int ny, nx;
    int *corr;                 /* [ny nx][o] */
    bool corr_valid;           /* corr matches the geometry and the packed weight */
    bie_cuda_fused_image fimg; /* the fused inference kernel's weight image (valid with corr) */
    /* The forward's NHWC sign and mask words (kept for the backward). */
    uint32_t *signs, *mask;
    int64_t act_cap; /* words allocated */
};

static inline struct bie_bc_cuda *CU(const bie_layer *l) {
    return (struct bie_bc_cuda *)l->backend;
}

static const char *const MODULE = "binary_conv2d (cuda)";

/* ---------------------------------------------------------------- life cycle */

static void release(bie_layer *l);

static bie_status init(bie_layer *l) {
    BIE_TRY(bie_cuda_layer_state(l, sizeof(struct bie_bc_cuda), MODULE));
    struct bie_bc_cuda *c = CU(l);
    const int64_t cw = (l->in + 31) / 32;
    /* Rows padded to 64 bytes only (not BIE_CUDA_ROW_ALIGN): for 256 channels and 3x3 taps
     * that is 320 bytes instead of 512, and the kernels with 64-byte k blocks run them. */
    c->d.ld = (l->k * l->k * cw * 4 + 63) / 64 * 64;
    bie_status st =
        bie_cbw_alloc((void **)&c->wbits, (size_t)(l->out * c->d.ld), MODULE, "weight bits");
    if (st == BIE_OK)
        st = bie_cbw_alloc((void **)&c->wpopc,
                           (size_t)(l->out * bie_cuda_popc_parts(c->d.ld)) * sizeof(int), MODULE,
                           "weight bits");
    if (st == BIE_OK)
        st = bie_cbw_alloc((void **)&c->tapsum, (size_t)(l->out * l->k * l->k) * sizeof(int),
                           MODULE, "weight bits");
    if (st != BIE_OK) release(l);
    return st;
}

static void release(bie_layer *l) {
    struct bie_bc_cuda *c = CU(l);
    if (c == NULL) return;
    bie_cbw_free_ptr(c->wbits);
    bie_cbw_free_ptr(c->wpopc);
    bie_cbw_free_ptr(c->tapsum);
    bie_cbw_free_ptr(c->geo);
    bie_cbw_free_ptr(c->corr);
    bie_cbw_free_ptr(c->fimg.data);
    bie_cbw_free_ptr(c->signs);
    bie_cbw_free_ptr(c->mask);
    bie_cuda_layer_state_free(l);
}

/* ---------------------------------------------------------------- forward */

/* Valid taps [lo, hi) along one axis for each output position, grouped into classes with
 * class 0 = all taps valid; cls[o] receives each position's class, lim the classes' ranges. */
static int axis_classes(int64_t out, int64_t in, int64_t k, int64_t s, int64_t p, int64_t d,
                        int *cls, int *lim) {
    int count = 1;
    lim[0] = 0;
    lim[1] = (int)k;
    for (int64_t o = 0; o < out; o++) {
        int64_t lo = 0, hi = k;
        while (lo < k && o * s - p + lo * d < 0) lo++;
        while (hi > lo && o * s - p + (hi - 1) * d >= in) hi--;
        int c = 0;
        while (c < count && !(lim[2 * c] == lo && lim[2 * c + 1] == hi)) c++;
        if (c == count) {
            lim[2 * c] = (int)lo;
            lim[2 * c + 1] = (int)hi;
            count++;
        }
        cls[o] = c;
    }
    return count;
}

/* The padding classes of the geometry (host computation, uploaded once per input size). */
static bie_status ensure_geometry(bie_layer *l, const bie_conv_geom *g) {
    struct bie_bc_cuda *c = CU(l);
    if (c->geo && c->geo_h == g->h && c->geo_w == g->w) return BIE_OK;
    const int64_t plane = g->oh * g->ow;
    int *ycls = malloc((size_t)g->oh * sizeof(int)), *xcls = malloc((size_t)g->ow * sizeof(int));
    int *ylim = malloc((size_t)(2 * (g->oh + 1)) * sizeof(int)),
        *xlim = malloc((size_t)(2 * (g->ow + 1)) * sizeof(int));
    int *host = NULL, *geo = NULL;
    bie_status st = BIE_OK;
    if (!ycls || !xcls || !ylim || !xlim) {
        st = bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: padding classes", MODULE);
        goto done;
    }
    const int ny = axis_classes(g->oh, g->h, g->k, g->s, g->p, g->d, ycls, ylim);
    const int nx = axis_classes(g->ow, g->w, g->k, g->s, g->p, g->d, xcls, xlim);
    const size_t count = (size_t)(plane + 2 * ny + 2 * nx);
    if ((host = malloc(count * sizeof(int))) == NULL) {
        st = bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: padding classes", MODULE);
        goto done;
    }
    for (int64_t oy = 0; oy < g->oh; oy++)
        for (int64_t ox = 0; ox < g->ow; ox++) host[oy * g->ow + ox] = ycls[oy] * nx + xcls[ox];
    memcpy(host + plane, ylim, (size_t)(2 * ny) * sizeof(int));
    memcpy(host + plane + 2 * ny, xlim, (size_t)(2 * nx) * sizeof(int));
    if ((st = bie_cbw_alloc((void **)&geo, count * sizeof(int), MODULE, "padding classes")) !=
            BIE_OK ||
        (st = bie_cbw_copy_sync(geo, host, count * sizeof(int), MODULE, "padding classes")) !=
            BIE_OK)
        goto done;
    int *corr = NULL;
    if ((st = bie_cbw_alloc((void **)&corr, (size_t)(ny * nx) * (size_t)g->o * sizeof(int), MODULE,
                            "padding corrections")) != BIE_OK)
        goto done;
    bie_cbw_free_ptr(c->geo);
    bie_cbw_free_ptr(c->corr);
    c->geo = geo;
    c->corr = corr;
    c->corr_valid = false;
    geo = NULL;
    c->ny = ny;
    c->nx = nx;
    c->geo_h = g->h;
    c->geo_w = g->w;
done:
    bie_cbw_free_ptr(geo);
    free(host);
    free(ycls);
    free(xcls);
    free(ylim);
    free(xlim);
    return st;
}

/* The padding classes of the last geometry (ensure_geometry). */
static bie_cuda_conv_classes classes_of(const struct bie_bc_cuda *c, const bie_conv_geom *g) {
    const int *ylim = c->geo + g->oh * g->ow;
    const bie_cuda_conv_classes cls = {ylim, ylim + 2 * c->ny, c->ny, c->nx};
    return cls;
}

/* The weight rows the forward multiplies with (see struct bie_bc_cuda), and with them the
 * corrections of the geometry's classes. */
static bie_status forward_weight(bie_layer *l, const bie_conv_geom *g) {
    struct bie_bc_cuda *c = CU(l);
    if (!l->training && c->w_inference && c->wversion == c->d.version) return BIE_OK;
    c->w_inference = false;
    c->corr_valid = false;
    c->fimg.valid = false;
    const bie_cuda_conv_classes cls = classes_of(c, g);
    if (!l->training && c->d.qweight)
        BIE_TRY(bie_cuda_conv_pack_weight(BIE_U8, c->d.qweight,
                                          bie_packed_row_bytes(l->fan_in, l->w.word_bits), g,
                                          c->d.ld, c->wbits, c->wpopc, c->tapsum, &cls, c->corr));
    else if (c->d.w_i8)
        BIE_TRY(bie_cuda_conv_pack_weight(BIE_I8, c->d.w_i8, 0, g, c->d.ld, c->wbits, c->wpopc,
                                          c->tapsum, &cls, c->corr));
    else
        BIE_TRY(bie_cuda_conv_pack_weight(BIE_F32, c->d.w_f32, 0, g, c->d.ld, c->wbits, c->wpopc,
                                          c->tapsum, &cls, c->corr));
    c->corr_valid = true;
    c->w_inference = !l->training;
    c->wversion = c->d.version;
    return BIE_OK;
}

static bie_status reserve_activations(bie_layer *l, int64_t words) {
    struct bie_bc_cuda *c = CU(l);
    if (words <= c->act_cap) return BIE_OK;
    l->has_saved = false;
    BIE_DEV_FREE(c->signs);
    BIE_DEV_FREE(c->mask);
    c->act_cap = 0;
    BIE_TRY(bie_cbw_alloc((void **)&c->signs, (size_t)words * 4, MODULE, "input signs"));
    BIE_TRY(bie_cbw_alloc((void **)&c->mask, (size_t)words * 4, MODULE, "input mask"));
    c->act_cap = words;
    return BIE_OK;
}

/* After a forward's launches: what the backward needs. */
static bie_status finish_forward(bie_layer *l, const bie_conv_geom *g, bool keep) {
    CU(l)->g = *g;
    if (keep) {
        bie_conv_geom sg = {g->n,  g->c, g->h, g->w, g->o, g->oh,
                            g->ow, g->k, g->s, g->p, g->d, g->nhwc};
        l->saved_geom = sg;
        l->has_saved = true;
    }
    return BIE_OK;
}

/* The epilogue's per-pixel geometry (border classes and padding corrections). */
static bie_cuda_conv_out out_args(const struct bie_bc_cuda *c, const bie_conv_geom *g) {
    const bie_cuda_conv_out conv = {g->oh * g->ow, c->geo, c->corr, (int)g->nhwc};
    return conv;
}

/* out = the product of the sign words in c->signs with the weight bits, scaled by *scale_a
 * *scale_w (device pointers). The default is the implicit GEMM reading the sign words in
 * place; a chosen GEMM kernel (or weights too large for shared memory) takes the im2col
 * path. */
static bie_status product(bie_layer *l, const bie_conv_geom *g, const float *scale_a,
                          const float *scale_w, void *out) {
    struct bie_bc_cuda *c = CU(l);
    const bie_cuda_conv_out conv = out_args(c, g);
    const int classes = c->ny * c->nx;
    const int bn = l->kernel_id < 0 ? bie_cuda_conv_implicit_bn(g, classes) : 0;
    if (bn > 0)
        return bie_cuda_conv_implicit(c->signs, g, c->wbits, c->d.ld, c->wpopc, bn, classes,
                                      scale_a, scale_w, l->dtype, out, &conv);
    /* The bit im2col lives only for this call: stream-ordered allocation. */
    const int64_t rows = g->n * g->oh * g->ow, cols_bytes = rows * c->d.ld;
    cudaStream_t stream = (cudaStream_t)bie_cuda_current_stream();
    uint8_t *cols = NULL;
    BIE_TRY(bie_cbw_cuda_ok(
        cudaMallocAsync((void **)&cols, (size_t)cols_bytes + (size_t)rows * sizeof(int), stream),
        MODULE, "im2col workspace"));
    int *cpopc = (int *)(cols + cols_bytes);
    bie_status st = bie_cuda_conv_im2col(c->signs, g, c->d.ld, cols, cpopc);
    if (st == BIE_OK)
        st =
            bie_cuda_bgemm_launch(l->kernel_id, rows, g->o, l->fan_in, cols, c->wbits, c->d.ld,
                                  cpopc, 1, c->wpopc, 0.0f, scale_a, scale_w, l->dtype, out, &conv);
    bie_status fst = bie_cbw_cuda_ok(cudaFreeAsync(cols, stream), MODULE, "im2col workspace");
    BIE_TRY(st);
    return fst;
}

static bie_status forward(bie_layer *l, const bie_tensor *x, bie_tensor *out) {
    static const char *who = "binary_conv2d_forward";
    struct bie_bc_cuda *c = CU(l);
    BIE_TRY(bie_layer_check_forward(l, x));
    bie_conv_geom g = bie_layer_conv_geom(l, x);
    g.nhwc = l->channels_last;
    const int64_t oshape[4] = {g.n, g.o, g.oh, g.ow};
    BIE_TRY(bie_cbw_check_shape4(l->device.index, out, l->dtype, oshape, "output", who));
    const bool has_weight = c->d.w_i8 || c->d.w_f32;
    if (!has_weight && (l->training || c->d.qweight == NULL)) return bie_bw_no_weight(who);
    const int64_t rows = g.n * g.oh * g.ow, cw = bie_cuda_conv_cw(&g);
    int64_t words, cols_bytes;
    /* The kernels index in 32 bits within an image and over rows; grid extents cap n and cw. */
    if (!bie_mul_ok(g.n * g.h * g.w, cw, &words) || !bie_mul_ok(rows, c->d.ld, &cols_bytes) ||
        rows > INT32_MAX || g.n * g.h * g.w > INT32_MAX || g.n > 65535 || cw > 65535 ||
        g.o * l->fan_in > INT32_MAX)
        return bie_fail(BIE_ERR_OVERFLOW, "%s: input too large for the CUDA kernels", who);
    BIE_TRY(bie_cuda_ensure_scale_a(l, x, who));
    BIE_TRY(ensure_geometry(l, &g));
    BIE_TRY(reserve_activations(l, words));
    l->has_saved = false;
    BIE_TRY(forward_weight(l, &g));
    float *scalars = c->d.scalars;
    const bool keep = l->training;
    if (!c->corr_valid) { /* a new geometry for weight rows kept from before */
        c->fimg.valid = false;
        const bie_cuda_conv_classes cls = classes_of(c, &g);
        BIE_TRY(bie_cuda_conv_corrections(c->tapsum, &g, &cls, c->corr));
    }
    c->corr_valid = true;
    /* Inference with the default kernel: the pack fused into the GEMM where it applies (the
     * training forward keeps the sign and mask words for the backward). */
    if (!keep && l->kernel_id < 0 && !g.nhwc) {
        bool ran = false;
        const bie_cuda_conv_out conv = out_args(c, &g);
        BIE_TRY(bie_cuda_conv_fused(l->dtype, x->data, &g, c->d.bias_a, c->wbits, c->d.ld, c->wpopc,
                                    c->ny * c->nx, scalars + BIE_CBW_SCALE_A,
                                    scalars + BIE_CBW_SCALE_W, out->data, &conv, &c->fimg, &ran));
        if (ran) return finish_forward(l, &g, keep);
    }
    BIE_TRY(bie_cuda_conv_pack_input(
        l->dtype, x->data, &g, c->d.bias_a, scalars + BIE_CBW_SCALE_A, scalars + BIE_CBW_SCALE_W,
        keep ? scalars + BIE_CBW_SAVED_SCALES : NULL, c->signs, keep ? c->mask : NULL));
    BIE_TRY(product(l, &g, scalars + BIE_CBW_SCALE_A, scalars + BIE_CBW_SCALE_W, out->data));
    return finish_forward(l, &g, keep);
}

/* The last training forward's output again, from what it kept: its sign words, weight bits,
 * corrections and the scales it used (no pack; the weight and scale_a may have changed). */
static bie_status forward_again(bie_layer *l, bie_tensor *out) {
    static const char *who = "binary_conv2d_forward_again";
    struct bie_bc_cuda *c = CU(l);
    if (!l->has_saved)
        return bie_fail(BIE_ERR_STATE, "%s: nothing kept: run a training-mode forward first", who);
    const bie_conv_geom g = c->g;
    const int64_t oshape[4] = {g.n, g.o, g.oh, g.ow};
    BIE_TRY(bie_cbw_check_shape4(l->device.index, out, l->dtype, oshape, "output", who));
    const float *saved = c->d.scalars + BIE_CBW_SAVED_SCALES;
    return product(l, &g, saved, saved + 1, out->data);
}

/* ---------------------------------------------------------------- backward */

static bie_status backward(bie_layer *l, const bie_tensor *grad_out, bie_tensor *grad_x) {
    static const char *who = "binary_conv2d_backward";
    struct bie_bc_cuda *c = CU(l);
    if (!l->has_saved)
        return bie_fail(BIE_ERR_STATE,
                        "%s: no saved activations: run a training-mode forward first", who);
    const bie_conv_geom g = c->g;
    const int64_t gshape[4] = {g.n, g.o, g.oh, g.ow}, xshape[4] = {g.n, g.c, g.h, g.w};
    BIE_TRY(bie_cbw_check_shape4(l->device.index, grad_out, l->dtype, gshape, "grad_out", who));
    if (grad_x)
        BIE_TRY(bie_cbw_check_shape4(l->device.index, grad_x, l->dtype, xshape, "grad_x", who));
    const int64_t rows = g.n * g.oh * g.ow, K = l->fan_in;
    int64_t cells;
    if (!bie_mul_ok(rows, K, &cells) || rows > INT32_MAX || K > INT32_MAX ||
        cells > ((int64_t)1 << 40))
        return bie_fail(BIE_ERR_OVERFLOW, "%s: too large for the BLAS index range", who);
    BIE_TRY(bie_cbw_reserve_grads(&c->d, l->wgrad_target));
    bie_cuda_bconv_backward_args a = {
        .dtype = l->dtype,
        .g = g,
        .grad_out = grad_out->data,
        .grad_x = grad_x ? grad_x->data : NULL,
        .wbits = c->wbits,
        .ld = c->d.ld,
        .signs = c->signs,
        .mask = c->mask,
        .saved_scales = c->d.scalars + BIE_CBW_SAVED_SCALES,
        .grad_w = c->d.out_w,
        .grad_w_i8 = c->d.out_w_i8,
        .grad_bias = c->d.g_bias,
        .grad_scale_a = c->d.g_scale,
        .fp8 = l->backward_mode == BIE_BACKWARD_FP8,
    };
    BIE_TRY(bie_cuda_binary_conv2d_backward(&a));
    bie_cbw_grads_done(&c->d);
    return BIE_OK;
}

const bie_layer_ops bie_binary_conv2d_cuda_ops = {
    .weight = &bie_binary_weight_cuda_ops,
    .device = &bie_cuda_device_ops,
    .init = init,
    .release = release,
    .forward = forward,
    .forward_again = forward_again,
    .backward = backward,
    .wgrad_target_direct = true,
    .check_backward_mode = bie_cuda_check_backward_mode,
    .channels_last = true,
};
