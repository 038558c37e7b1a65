/* The 4-bit linear layer on CUDA (SPEC §4). The parameters live in device memory, so an
 * optimizer updates them in place through bie_layer_param views; scale_a and scale_w are
 * device scalars that the kernels read, which keeps the forward free of host syncs.
 *
 * The forward quantizes x + bias_a and the weight into 4-bit rows of the device GEMM layout
 * (cuda_internal.h), or into int8 code rows where kernel 211 takes the product
 * (bie_cuda_q4_i8_wanted), and multiplies them exactly; a training forward also
 * keeps what the backward needs, as the CPU layer does: the activation codes, the clip bits
 * and the 8-bit rounding residuals (13 bits per input element; opt-in, in 16-bit layers, the
 * codes' values instead of the codes, which the grad_w product takes, written in the same pass:
 * 1 byte per input element more, a pass over the codes less per step), and the weight codes
 * (and, where the backward's grad_x product takes them, their 16-bit values transposed, written
 * in the same pass: 2 bytes per weight more, one read of the float weight less per step). */
#include <string.h>

#include "../cuda/cuda_internal.h"
#include "bie_cuda.h"
#include "binary_weight_cuda.h"
#include "layer_cuda.h"
#include "q4_weight_cuda.h"

struct bie_q4l_cuda {
    bie_cuda_bw d; /* weight, bias_a, scalars, gradients */
    /* Weight codes in the GEMM layout: of the last forward that read the float weight (a
     * training forward keeps them for the backward), and the inference cache built from
     * qweight, valid while qversion == d.version. */
    uint8_t *wcodes, *qcodes;
    unsigned qversion;
    /* The values of wcodes transposed [in][out] (16-bit), written with them by a training
     * forward where the backward's grad_x product takes them (valt_ok; allocated on first use). */
    void *valt;
    bool valt_ok;
    /* Activations of the last forward: codes (a_cap bytes; not kept where xval_ok); in training
     * also the clip bits and residuals over the m * in input elements (s_cap rows). */
    uint8_t *acodes, *amask;
    int8_t *aresid;
    int64_t a_cap, s_cap;
    /* The codes' values [m][in] (16-bit) of the last training forward where
     * bie_cuda_q4_act_values_wanted (xval_ok; v_cap rows). */
    void *xval;
    int64_t v_cap;
    bool xval_ok;
    /* The rows of wcodes and acodes: int8 codes (row_bytes = ld8) or the 4-bit layout (d.ld),
     * as the last forward wrote them. */
    int64_t ld8, row_bytes;
    bool i8;
};

static inline struct bie_q4l_cuda *CU(const bie_layer *l) {
    return (struct bie_q4l_cuda *)l->backend;
}

static const char *const MODULE = "q4_linear (cuda)";

/* ---------------------------------------------------------------- life cycle */

static void release(bie_layer *l);

static bie_status init(bie_layer *l) {
    BIE_TRY(bie_cuda_layer_state(l, sizeof(struct bie_q4l_cuda), MODULE));
    struct bie_q4l_cuda *c = CU(l);
    c->d.ld = bie_cuda_q4_row_stride(l->in);
    c->ld8 = bie_cuda_q4_i8_row_stride(l->in); /* >= d.ld: wcodes holds either layout */
    bie_status st =
        bie_cbw_alloc((void **)&c->wcodes, (size_t)(l->out * c->ld8), MODULE, "weight codes");
    if (st != BIE_OK) release(l);
    return st;
}

static void release(bie_layer *l) {
    struct bie_q4l_cuda *c = CU(l);
    if (c == NULL) return;
    bie_cbw_free_ptr(c->wcodes);
    bie_cbw_free_ptr(c->qcodes);
    bie_cbw_free_ptr(c->valt);
    bie_cbw_free_ptr(c->acodes);
    bie_cbw_free_ptr(c->amask);
    bie_cbw_free_ptr(c->aresid);
    bie_cbw_free_ptr(c->xval);
    bie_cuda_layer_state_free(l);
}

/* ---------------------------------------------------------------- forward */

/* Room for the activation codes of m rows of row_bytes (contents are not kept) unless the
 * forward writes their values (xval: the codes are then scratch of the forward alone); with
 * `keep`, also for the backward's clip bits and residuals, and with xval their values. */
static bie_status reserve_activations(bie_layer *l, int64_t m, int64_t row_bytes, bool keep,
                                      bool xval) {
    struct bie_q4l_cuda *c = CU(l);
    if (!xval && m * row_bytes > c->a_cap) {
        l->has_saved = false;
        BIE_DEV_FREE(c->acodes);
        c->a_cap = 0;
        BIE_TRY(bie_cbw_alloc((void **)&c->acodes, (size_t)(m * row_bytes), MODULE,
                              "activation codes"));
        c->a_cap = m * row_bytes;
    }
    if (keep && m > c->s_cap) {
        l->has_saved = false;
        BIE_DEV_FREE(c->amask);
        BIE_DEV_FREE(c->aresid);
        c->s_cap = 0;
        const int64_t mk = m * l->in;
        BIE_TRY(bie_cbw_alloc((void **)&c->amask, (size_t)((mk + 7) / 8), MODULE,
                              "activation clip bits"));
        BIE_TRY(bie_cbw_alloc((void **)&c->aresid, (size_t)mk, MODULE, "activation residuals"));
        c->s_cap = m;
    }
    if (xval && m > c->v_cap) {
        l->has_saved = false;
        BIE_DEV_FREE(c->xval);
        c->v_cap = 0;
        BIE_TRY(bie_cbw_alloc(&c->xval, (size_t)(m * l->in) * 2, MODULE, "activation values"));
        c->v_cap = m;
    }
    return BIE_OK;
}

/* The weight codes the forward multiplies with: q4(w, scale_w) of the float weight, packed
 * now in rows of row_bytes (int8 codes with i8; the optimizer may have changed the weight;
 * inference without qweight too, as the CPU layer does), or in inference (from_q) the 4-bit
 * codes of qweight, unpacked once after each weight change. */
static bie_status forward_weight(bie_layer *l, bool from_q, bool i8, int64_t row_bytes,
                                 const uint8_t **codes) {
    struct bie_q4l_cuda *c = CU(l);
    const float *scale_w = c->d.scalars + BIE_CBW_SCALE_W;
    c->valt_ok = false;
    if (!from_q && l->training &&
        bie_cuda_q4_weight_values_wanted(l->dtype, c->d.w_f32, l->out, l->in)) {
        if (c->valt == NULL)
            BIE_TRY(bie_cbw_alloc(&c->valt, (size_t)(l->out * l->in) * 2, MODULE, "weight values"));
        BIE_TRY(bie_cuda_q4_pack_weight_values(c->d.w_f32, l->out, l->in, scale_w, i8, l->dtype,
                                               c->wcodes, c->valt));
        c->valt_ok = true;
        *codes = c->wcodes;
        return BIE_OK;
    }
    if (!from_q) {
        BIE_TRY(
            bie_cuda_q4_pack_weight(c->d.w_f32, l->out, l->in, scale_w, row_bytes, i8, c->wcodes));
        *codes = c->wcodes;
        return BIE_OK;
    }
    if (c->qcodes == NULL || c->qversion != c->d.version) {
        if (c->qcodes == NULL)
            BIE_TRY(bie_cbw_alloc((void **)&c->qcodes, (size_t)(l->out * c->d.ld), MODULE,
                                  "weight codes"));
        BIE_TRY(bie_cuda_q4_repack_rows(c->d.qweight, l->out, l->in, c->d.ld, c->qcodes));
        c->qversion = c->d.version;
    }
    *codes = c->qcodes;
    return BIE_OK;
}

static bie_status forward(bie_layer *l, const bie_tensor *x, bie_tensor *out) {
    static const char *who = "q4_linear_forward";
    struct bie_q4l_cuda *c = CU(l);
    BIE_TRY(bie_layer_check_forward(l, x));
    BIE_TRY(bie_cbw_check_tensor(l->device.index, out, "output", l->dtype, l->out, x, who));
    if (c->d.w_f32 == NULL && (l->training || c->d.qweight == NULL)) return bie_bw_no_weight(who);
    const int64_t m = bie_tensor_numel(x) / l->in;
    int64_t bytes;
    /* The GEMM indexes rows in 32 bits, the backward's BLAS too. */
    if (m > INT32_MAX || !bie_mul_ok(m, c->ld8, &bytes)) /* ld8 >= d.ld: either layout */
        return bie_fail(BIE_ERR_OVERFLOW, "%s: %lld rows are too many for the CUDA kernels", who,
                        (long long)m);
    const bool keep = l->training, from_q = !l->training && c->d.qweight;
    /* int8 code rows where kernel 211 takes the product (the inference cache of qweight stays
     * in the 4-bit layout) */
    const bool i8 = !from_q && bie_cuda_q4_i8_wanted(l->kernel_id, m, l->out, l->in);
    const int64_t row_bytes = i8 ? c->ld8 : c->d.ld;
    BIE_TRY(bie_cuda_ensure_scale_a(l, x, who));
    /* the codes' values for the backward, the codes then scratch of this call */
    const bool xval = keep && bie_cuda_q4_act_values_wanted(l->dtype, l->in);
    BIE_TRY(reserve_activations(l, m, row_bytes, keep, xval));
    l->has_saved = false;
    c->xval_ok = false;
    float *scalars = c->d.scalars;
    uint8_t *acodes = c->acodes;
    void *scratch = NULL;
    if (xval) {
        BIE_TRY(bie_cuda_scratch_alloc(&scratch, (size_t)(m * row_bytes), "activation codes"));
        acodes = scratch;
    }
    bie_status st = bie_cuda_q4_pack_act_values(
        l->dtype, x->data, m, l->in, c->d.bias_a, scalars + BIE_CBW_SCALE_A, row_bytes, i8, acodes,
        keep ? c->amask : NULL, keep ? c->aresid : NULL, xval ? c->xval : NULL);
    if (st == BIE_OK && keep) st = bie_cbw_save_scales(&c->d);
    const uint8_t *wcodes = NULL;
    if (st == BIE_OK) st = forward_weight(l, from_q, i8, row_bytes, &wcodes);
    if (st == BIE_OK && i8)
        st = bie_cuda_q4gemm_i8_launch(
            m, l->out, l->in, (const int8_t *)acodes, (const int8_t *)wcodes, row_bytes, 0.0f,
            scalars + BIE_CBW_SCALE_A, scalars + BIE_CBW_SCALE_W, l->dtype, out->data, NULL);
    else if (st == BIE_OK)
        st = bie_cuda_q4gemm_launch(l->kernel_id, m, l->out, l->in, acodes, wcodes, c->d.ld, 0.0f,
                                    scalars + BIE_CBW_SCALE_A, scalars + BIE_CBW_SCALE_W, l->dtype,
                                    out->data, NULL);
    bie_cuda_scratch_free(scratch);
    BIE_TRY(st);
    c->xval_ok = xval;
    if (keep) {
        c->i8 = i8;
        c->row_bytes = row_bytes;
        l->saved_m = m;
        l->saved_ndim = x->ndim;
        memcpy(l->saved_shape, x->shape, sizeof l->saved_shape);
        l->has_saved = true;
    }
    return BIE_OK;
}

/* ---------------------------------------------------------------- backward */

static bie_status backward(bie_layer *l, const bie_tensor *grad_out, bie_tensor *grad_x) {
    static const char *who = "q4_linear_backward";
    struct bie_q4l_cuda *c = CU(l);
    if (!l->has_saved)
        return bie_fail(BIE_ERR_STATE,
                        "%s: no saved activations: run a training-mode forward first", who);
    const bie_tensor like = bie_layer_saved_like(l);
    BIE_TRY(
        bie_cbw_check_tensor(l->device.index, grad_out, "grad_out", l->dtype, l->out, &like, who));
    if (grad_x)
        BIE_TRY(
            bie_cbw_check_tensor(l->device.index, grad_x, "grad_x", l->dtype, l->in, &like, who));
    BIE_TRY(bie_cbw_reserve_grads(&c->d, l->wgrad_target));
    bie_cuda_q4l_backward_args a = {
        .dtype = l->dtype,
        .m = l->saved_m,
        .n = l->out,
        .k = l->in,
        .ld = c->row_bytes,
        .i8 = c->i8,
        .grad_out = grad_out->data,
        .grad_x = grad_x ? grad_x->data : NULL,
        .wcodes = c->wcodes,
        .xcodes = c->xval_ok ? NULL : c->acodes, /* scratch of the forward where values are kept */
        .wvalt = c->valt_ok ? c->valt : NULL,
        .xval = c->xval_ok ? c->xval : NULL,
        .mask = c->amask,
        .resid = c->aresid,
        .saved_scales = c->d.scalars + BIE_CBW_SAVED_SCALES,
        .grad_w = c->d.out_w,
        .grad_bias = c->d.g_bias,
        .grad_scale_a = c->d.g_scale,
    };
    BIE_TRY(bie_cuda_q4_linear_backward(&a));
    bie_cbw_grads_done(&c->d);
    return BIE_OK;
}

const bie_layer_ops bie_q4_linear_cuda_ops = {
    .weight = &bie_q4_weight_cuda_ops,
    .device = &bie_cuda_device_ops,
    .init = init,
    .release = release,
    .forward = forward,
    .backward = backward,
    .wgrad_target_direct = true,
};
