/* The 4-bit conv2d layer on CUDA (SPEC §4). The forward quantizes the input (+ bias_a) into
 * 4-bit codes and multiplies them with the weight's codes in the 4-bit GEMM, whose epilogue
 * writes NCHW; code 0 for taps outside the input makes zero padding exact without
 * corrections. By default (32 <= C <= 2048, no kernel chosen) the codes are NHWC and the
 * GEMM gathers each output pixel's taps itself (an implicit GEMM, weight rows in tap order);
 * otherwise, or with a kernel chosen, an im2col of the codes (one GEMM row per output pixel)
 * feeds the GEMM. A training forward keeps what the CPU layer keeps for the backward: the
 * input's codes, clip bits and 8-bit rounding residuals (13 bits per input element; NHWC
 * with channels padded to 64 where the backward runs on the TMA kernels, else flat), and the
 * weight codes. */
#include <cuda_runtime_api.h>
#include <string.h>

#include "../cuda/cuda_internal.h"
#include "bie_cuda.h"
#include "binary_weight_cuda.h"
#include "conv_common.h"
#include "layer_cuda.h"
#include "q4_weight_cuda.h"

struct bie_q4c_cuda {
    bie_cuda_bw d;   /* weight, bias_a, scalars, gradients */
    bie_conv_geom g; /* of the last forward */
    /* Weight codes in the GEMM layout (rows in the weight's [c, i, j] order): of the last
     * forward that read the float weight (kept for the backward), and the inference cache
     * built from qweight, valid while qversion == d.version. */
    uint8_t *wcodes, *qcodes;
    unsigned qversion;
    /* The implicit GEMM's weight rows (tap order), of the inference cache while taps_cached
     * and tversion == d.version. */
    uint8_t *wtaps;
    unsigned tversion;
    bool taps_cached;
    /* The last forward's input codes; in training also the clip bits and residuals, flat
     * over N C H W or, where nhwc_state, NHWC (bie_cuda_q4_conv_nhwc_state). Capacities in
     * bytes. */
    uint8_t *codes, *mask;
    int8_t *resid;
    int64_t codes_cap, mask_cap, resid_cap;
    bool nhwc_state;
};

static inline struct bie_q4c_cuda *CU(const bie_layer *l) {
    return (struct bie_q4c_cuda *)l->backend;
}

static const char *const MODULE = "q4_conv2d (cuda)";

/* ---------------------------------------------------------------- life cycle */

static void release(bie_layer *l);

static bie_status init(bie_layer *l) {
    BIE_TRY(bie_cuda_layer_state(l, sizeof(struct bie_q4c_cuda), MODULE));
    struct bie_q4c_cuda *c = CU(l);
    c->d.ld = bie_cuda_q4_row_stride(l->fan_in);
    bie_status st =
        bie_cbw_alloc((void **)&c->wcodes, (size_t)(l->out * c->d.ld), MODULE, "weight codes");
    if (st != BIE_OK) release(l);
    return st;
}

static void release(bie_layer *l) {
    struct bie_q4c_cuda *c = CU(l);
    if (c == NULL) return;
    bie_cbw_free_ptr(c->wcodes);
    bie_cbw_free_ptr(c->qcodes);
    bie_cbw_free_ptr(c->wtaps);
    bie_cbw_free_ptr(c->codes);
    bie_cbw_free_ptr(c->mask);
    bie_cbw_free_ptr(c->resid);
    bie_cuda_layer_state_free(l);
}

/* ---------------------------------------------------------------- forward */

/* *buf holds at least `bytes` (contents are not kept). */
static bie_status reserve_bytes(bie_layer *l, void **buf, int64_t *cap, int64_t bytes,
                                const char *what) {
    if (bytes <= *cap) return BIE_OK;
    l->has_saved = false;
    BIE_DEV_FREE(*buf);
    *cap = 0;
    BIE_TRY(bie_cbw_alloc(buf, (size_t)bytes, MODULE, what));
    *cap = bytes;
    return BIE_OK;
}

/* Room for the input codes the forward keeps (flat, or NHWC where nhwc), and with `keep`
 * also for the backward's clip bits and residuals. */
static bie_status reserve_activations(bie_layer *l, const bie_conv_geom *g, bool keep, bool nhwc) {
    struct bie_q4c_cuda *c = CU(l);
    const int64_t n_in = g->n * g->c * g->h * g->w, pixels = g->n * g->h * g->w,
                  cw = (g->c + 63) / 64 * 8; /* clip bytes of an NHWC pixel */
    BIE_TRY(reserve_bytes(l, (void **)&c->codes, &c->codes_cap,
                          nhwc ? pixels * bie_cuda_q4_conv_cb(g->c) : (n_in + 7) / 8 * 4,
                          "input codes"));
    if (!keep) return BIE_OK;
    BIE_TRY(reserve_bytes(l, (void **)&c->mask, &c->mask_cap, nhwc ? pixels * cw : (n_in + 7) / 8,
                          "input clip bits"));
    return reserve_bytes(l, (void **)&c->resid, &c->resid_cap, nhwc ? pixels * cw * 8 : n_in,
                         "input residuals");
}

/* The implicit GEMM serves inputs of 32 to 2048 channels (fewer: mostly padding codes;
 * more: its encode's tile outgrows shared memory) when no kernel was chosen. */
static bool use_implicit(const bie_layer *l, const bie_conv_geom *g) {
    return l->kernel_id < 0 && g->c >= 32 && g->c <= 2048;
}

static bie_status reserve_taps(bie_layer *l) {
    struct bie_q4c_cuda *c = CU(l);
    if (c->wtaps) return BIE_OK;
    return bie_cbw_alloc((void **)&c->wtaps,
                         (size_t)(l->out * l->k * l->k * bie_cuda_q4_conv_cb(l->in)), MODULE,
                         "weight taps");
}

/* The weight codes the forward multiplies with (*codes, GEMM layout) and, for the implicit
 * GEMM, in tap order (*taps; else NULL). From the float weight: q4(w, scale_w), packed now
 * (the optimizer may have changed it), both layouts in one pass. In inference from qweight:
 * its codes unpacked, and their taps, once after each weight change. */
static bie_status forward_weight(bie_layer *l, const bie_conv_geom *g, bool implicit,
                                 const uint8_t **codes, const uint8_t **taps) {
    struct bie_q4c_cuda *c = CU(l);
    const int64_t K = l->fan_in;
    const float *scale_w = c->d.scalars + BIE_CBW_SCALE_W;
    *taps = NULL;
    if (l->training || c->d.qweight == NULL) {
        *codes = c->wcodes;
        if (!implicit)
            return bie_cuda_q4_pack_weight(c->d.w_f32, l->out, K, scale_w, c->d.ld, false,
                                           c->wcodes);
        BIE_TRY(reserve_taps(l));
        c->taps_cached = false;
        BIE_TRY(bie_cuda_q4_conv_pack_weight(c->d.w_f32, g, scale_w, c->d.ld, c->wcodes, c->wtaps));
        *taps = c->wtaps;
        return BIE_OK;
    }
    if (c->qcodes == NULL || c->qversion != c->d.version) {
        if (c->qcodes == NULL)
            BIE_TRY(bie_cbw_alloc((void **)&c->qcodes, (size_t)(l->out * c->d.ld), MODULE,
                                  "weight codes"));
        BIE_TRY(bie_cuda_q4_repack_rows(c->d.qweight, l->out, K, c->d.ld, c->qcodes));
        c->qversion = c->d.version;
    }
    *codes = c->qcodes;
    if (!implicit) return BIE_OK;
    if (!(c->taps_cached && c->tversion == c->d.version)) {
        BIE_TRY(reserve_taps(l));
        c->taps_cached = false;
        BIE_TRY(bie_cuda_q4_conv_weight_taps(c->qcodes, c->d.ld, g, c->wtaps));
        c->taps_cached = true;
        c->tversion = c->d.version;
    }
    *taps = c->wtaps;
    return BIE_OK;
}

/* The implicit GEMM: NHWC codes, then the GEMM. The codes are the layer's kept state, with
 * the clip bits and residuals, where the forward keeps an NHWC state; otherwise they live in a
 * stream-ordered workspace. */
static bie_status forward_implicit(bie_layer *l, const bie_tensor *x, const bie_conv_geom *g,
                                   const uint8_t *taps, bool nhwc_state, bie_tensor *out) {
    struct bie_q4c_cuda *c = CU(l);
    cudaStream_t stream = (cudaStream_t)bie_cuda_current_stream();
    uint8_t *codes = c->codes;
    const size_t bytes = (size_t)(g->n * g->h * g->w * bie_cuda_q4_conv_cb(g->c));
    if (!nhwc_state)
        BIE_TRY(
            bie_cbw_cuda_ok(cudaMallocAsync((void **)&codes, bytes, stream), MODULE, "NHWC codes"));
    float *scalars = c->d.scalars;
    bie_status st = bie_cuda_q4_conv_encode_nhwc(
        l->dtype, x->data, g, c->d.bias_a, scalars + BIE_CBW_SCALE_A, codes,
        nhwc_state ? c->mask : NULL, nhwc_state ? c->resid : NULL);
    if (st == BIE_OK)
        st = bie_cuda_q4conv_implicit(-1, codes, g, taps, scalars + BIE_CBW_SCALE_A,
                                      scalars + BIE_CBW_SCALE_W, l->dtype, out->data);
    if (nhwc_state) return st;
    bie_status fst = bie_cbw_cuda_ok(cudaFreeAsync(codes, stream), MODULE, "NHWC codes");
    BIE_TRY(st);
    return fst;
}

/* The im2col path: the flat codes' im2col in a stream-ordered workspace, then the GEMM. With
 * an NHWC state, that state is encoded first and the flat codes live in a workspace too;
 * otherwise they are the layer's (encoded by the caller). */
static bie_status forward_im2col(bie_layer *l, const bie_tensor *x, const bie_conv_geom *g,
                                 const uint8_t *wcodes, int64_t cols_bytes, bool nhwc_state,
                                 bie_tensor *out) {
    struct bie_q4c_cuda *c = CU(l);
    cudaStream_t stream = (cudaStream_t)bie_cuda_current_stream();
    const float *scale_a = c->d.scalars + BIE_CBW_SCALE_A;
    uint8_t *codes = c->codes;
    if (nhwc_state) {
        BIE_TRY(bie_cuda_q4_conv_encode_nhwc(l->dtype, x->data, g, c->d.bias_a, scale_a, c->codes,
                                             c->mask, c->resid));
        const int64_t n_in = g->n * g->c * g->h * g->w;
        BIE_TRY(
            bie_cbw_cuda_ok(cudaMallocAsync((void **)&codes, (size_t)((n_in + 7) / 8 * 4), stream),
                            MODULE, "input codes"));
    }
    uint8_t *cols = NULL;
    bie_status st = bie_cbw_cuda_ok(cudaMallocAsync((void **)&cols, (size_t)cols_bytes, stream),
                                    MODULE, "im2col workspace");
    if (st == BIE_OK && nhwc_state)
        st = bie_cuda_q4_conv_encode(l->dtype, x->data, g, c->d.bias_a, scale_a, codes, NULL, NULL);
    if (st == BIE_OK) st = bie_cuda_q4_conv_im2col(codes, g, c->d.ld, cols);
    const bie_cuda_conv_out conv = {g->oh * g->ow, NULL, NULL, 0};
    if (st == BIE_OK)
        st = bie_cuda_q4gemm_launch(l->kernel_id, g->n * g->oh * g->ow, g->o, l->fan_in, cols,
                                    wcodes, c->d.ld, 0.0f, scale_a, c->d.scalars + BIE_CBW_SCALE_W,
                                    l->dtype, out->data, &conv);
    bie_status fst = cols == NULL
                         ? BIE_OK
                         : bie_cbw_cuda_ok(cudaFreeAsync(cols, stream), MODULE, "im2col workspace");
    if (nhwc_state && fst == BIE_OK)
        fst = bie_cbw_cuda_ok(cudaFreeAsync(codes, stream), MODULE, "input codes");
    BIE_TRY(st);
    return fst;
}

static bie_status forward(bie_layer *l, const bie_tensor *x, bie_tensor *out) {
    static const char *who = "q4_conv2d_forward";
    struct bie_q4c_cuda *c = CU(l);
    BIE_TRY(bie_layer_check_forward(l, x));
    const bie_conv_geom g = bie_layer_conv_geom(l, x);
    const int64_t oshape[4] = {g.n, g.o, g.oh, g.ow};
    BIE_TRY(bie_cbw_check_shape4(l->device.index, out, l->dtype, oshape, "output", who));
    if (c->d.w_f32 == NULL && (l->training || c->d.qweight == NULL)) return bie_bw_no_weight(who);
    const int64_t rows = g.n * g.oh * g.ow;
    int64_t cols_bytes;
    /* The GEMM and the backward's BLAS index rows in 32 bits. */
    if (rows > INT32_MAX || !bie_mul_ok(rows, c->d.ld, &cols_bytes) || g.h * g.w > INT32_MAX ||
        g.c * g.k * g.k > INT32_MAX)
        return bie_fail(BIE_ERR_OVERFLOW, "%s: input too large for the CUDA kernels", who);
    const bool keep = l->training, implicit = use_implicit(l, &g);
    /* A training forward keeps its codes, clip bits and residuals NHWC where the backward
     * runs on the TMA kernels (which read them so), else flat. */
    const bool nhwc = keep && bie_cuda_q4_conv_nhwc_state(l->dtype, &g);
    BIE_TRY(bie_cuda_ensure_scale_a(l, x, who));
    BIE_TRY(reserve_activations(l, &g, keep, nhwc));
    l->has_saved = false;
    float *scalars = c->d.scalars;
    /* The flat codes feed the im2col, and the backward from a flat state (forward_im2col
     * encodes its own where the state is NHWC). */
    if (!nhwc && (keep || !implicit))
        BIE_TRY(bie_cuda_q4_conv_encode(l->dtype, x->data, &g, c->d.bias_a,
                                        scalars + BIE_CBW_SCALE_A, c->codes, keep ? c->mask : NULL,
                                        keep ? c->resid : NULL));
    if (keep) BIE_TRY(bie_cbw_save_scales(&c->d));
    const uint8_t *wcodes = NULL, *taps = NULL;
    BIE_TRY(forward_weight(l, &g, implicit, &wcodes, &taps));
    BIE_TRY(implicit ? forward_implicit(l, x, &g, taps, nhwc, out)
                     : forward_im2col(l, x, &g, wcodes, cols_bytes, nhwc, out));
    if (keep) {
        c->g = g;
        c->nhwc_state = nhwc;
        bie_conv_geom sg = {g.n, g.c, g.h, g.w, g.o, g.oh, g.ow, g.k, g.s, g.p, g.d, 0};
        l->saved_geom = sg;
        l->has_saved = true;
    }
    return BIE_OK;
}

/* ---------------------------------------------------------------- backward */

static bie_status backward(bie_layer *l, const bie_tensor *grad_out, bie_tensor *grad_x) {
    static const char *who = "q4_conv2d_backward";
    struct bie_q4c_cuda *c = CU(l);
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
    if (!bie_mul_ok(rows, K, &cells) || rows > INT32_MAX || cells > ((int64_t)1 << 40))
        return bie_fail(BIE_ERR_OVERFLOW, "%s: too large for the BLAS index range", who);
    BIE_TRY(bie_cbw_reserve_grads(&c->d, l->wgrad_target));
    bie_cuda_q4conv_backward_args a = {
        .dtype = l->dtype,
        .g = g,
        .grad_out = grad_out->data,
        .grad_x = grad_x ? grad_x->data : NULL,
        .wcodes = c->wcodes,
        .ld = c->d.ld,
        .nhwc_state = c->nhwc_state,
        .codes = c->codes,
        .mask = c->mask,
        .resid = c->resid,
        .saved_scales = c->d.scalars + BIE_CBW_SAVED_SCALES,
        .grad_w = c->d.out_w,
        .grad_bias = c->d.g_bias,
        .grad_scale_a = c->d.g_scale,
    };
    BIE_TRY(bie_cuda_q4_conv2d_backward(&a));
    bie_cbw_grads_done(&c->d);
    return BIE_OK;
}

const bie_layer_ops bie_q4_conv2d_cuda_ops = {
    .weight = &bie_q4_weight_cuda_ops,
    .device = &bie_cuda_device_ops,
    .init = init,
    .release = release,
    .forward = forward,
    .backward = backward,
    .wgrad_target_direct = true,
};
