/* The 4-bit linear layer on CUDA (SPEC §4). The parameters live in device memory, so an
 * optimizer updates them in place through bie_q4_linear_param views; scale_a and scale_w are
 * device scalars that the kernels read, which keeps the forward free of host syncs.
 *
 * The forward quantizes x + bias_a and the weight into 4-bit rows of the device GEMM layout
 * (cuda_internal.h) and multiplies them exactly with the 4-bit GEMM; a training forward also
 * keeps what the backward needs, as the CPU layer does: the activation codes, the clip bits
 * and the 8-bit rounding residuals (13 bits per input element), and the weight codes. */
#include <string.h>

#include "../cuda/cuda_internal.h"
#include "bie_cuda.h"
#include "layer_cuda.h"
#include "binary_weight_cuda.h"
#include "q4_weight_cuda.h"

struct bie_q4l_cuda {
    bie_cuda_bw d;  /* weight, bias_a, scalars, gradients */
    int64_t ld;     /* GEMM-layout row bytes for in_features codes */
    /* Weight codes in the GEMM layout: of the last forward that read the float weight (a
     * training forward keeps them for the backward), and the inference cache built from
     * qweight, valid while qversion == d.version. */
    uint8_t *wcodes, *qcodes;
    unsigned qversion;
    /* Activations of the last forward: codes [a_cap rows][ld]; in training also the clip bits
     * and residuals over the m * in input elements (s_cap rows). */
    uint8_t *acodes, *amask;
    int8_t *aresid;
    int64_t a_cap, s_cap;
};

static inline struct bie_q4l_cuda *CU(const bie_layer *l) { return (struct bie_q4l_cuda *)l->backend; }

static const char *const MODULE = "q4_linear (cuda)";

#define DEV_FREE(p)                                                                            \
    do {                                                                                       \
        bie_cbw_free_ptr(p);                                                                   \
        (p) = NULL;                                                                            \
    } while (0)

static bie_status dev_alloc(void **p, size_t bytes, const char *what) {
    return bie_cbw_alloc(p, bytes, MODULE, what);
}

/* ---------------------------------------------------------------- life cycle */

static void release(bie_layer *l);

static bie_status init(bie_layer *l) {
    struct bie_q4l_cuda *c = calloc(1, sizeof *c);
    if (c == NULL) return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: layer", MODULE);
    c->ld = bie_cuda_q4_row_stride(l->in);
    l->backend = c;
    bie_status st = bie_cbw_create(&c->d, l->device.index, l->out, l->in, l->in, MODULE);
    if (st == BIE_OK) st = dev_alloc((void **)&c->wcodes, (size_t)(l->out * c->ld), "weight codes");
    if (st != BIE_OK) release(l);
    return st;
}

static void release(bie_layer *l) {
    struct bie_q4l_cuda *c = CU(l);
    if (c == NULL) return;
    bie_cbw_free(&c->d);
    bie_cbw_free_ptr(c->wcodes);
    bie_cbw_free_ptr(c->qcodes);
    bie_cbw_free_ptr(c->acodes);
    bie_cbw_free_ptr(c->amask);
    bie_cbw_free_ptr(c->aresid);
    free(c);
    l->backend = NULL;
}

static bie_status check_kernel(const bie_layer *l, int id, const char *who) {
    return bie_cq4w_check_kernel(id, l->in, who);
}

/* ---------------------------------------------------------------- forward */

static bie_status check_forward(const bie_layer *l, const bie_tensor *x) {
    static const char *who = "q4_linear_check_forward";
    if (x == NULL) return bie_fail(BIE_ERR_NULL_POINTER, "%s: input is NULL", who);
    if (x->device.type != BIE_DEVICE_CUDA || x->device.index != l->device.index)
        return bie_fail(BIE_ERR_DEVICE, "%s: input must be on CUDA device %d (the layer's device)",
                        who, l->device.index);
    if (x->dtype != l->dtype)
        return bie_fail(BIE_ERR_DTYPE, "%s: input dtype %s differs from the layer's %s", who,
                        bie_dtype_name(x->dtype), bie_dtype_name(l->dtype));
    return bie_cbw_check_tensor(l->device.index, x, "input", l->dtype, l->in, NULL, who);
}

/* Measure scale_a on x when it is still 0 (SPEC §4: 2 mean|x| / 11.269, before the shift). */
static bie_status ensure_scale_a(bie_layer *l, const bie_tensor *x, const char *who) {
    return bie_cbw_ensure_scale_a(&CU(l)->d, x->dtype, x->data, bie_tensor_numel(x), 2.0 / 11.269, who);
}

static bie_status set_activation(bie_layer *l, const bie_tensor *x, bie_tensor *x_out) {
    static const char *who = "q4_linear_set_activation";
    BIE_TRY(check_forward(l, x));
    if (x_out) BIE_TRY(bie_cbw_check_tensor(l->device.index, x_out, "output", l->dtype, l->in, x, who));
    BIE_TRY(ensure_scale_a(l, x, who));
    if (x_out == NULL) return BIE_OK;
    const int64_t m = bie_tensor_numel(x) / l->in;
    return bie_cuda_add_bias(l->dtype, x->data, m, l->in, CU(l)->d.bias_a, x_out->data);
}

/* Room for the activations of m rows (contents are not kept); with `keep`, also for the
 * backward's clip bits and residuals. */
static bie_status reserve_activations(bie_layer *l, int64_t m, bool keep) {
    struct bie_q4l_cuda *c = CU(l);
    if (m > c->a_cap) {
        l->has_saved = false;
        DEV_FREE(c->acodes);
        c->a_cap = 0;
        BIE_TRY(dev_alloc((void **)&c->acodes, (size_t)(m * c->ld), "activation codes"));
        c->a_cap = m;
    }
    if (keep && m > c->s_cap) {
        l->has_saved = false;
        DEV_FREE(c->amask);
        DEV_FREE(c->aresid);
        c->s_cap = 0;
        const int64_t mk = m * l->in;
        BIE_TRY(dev_alloc((void **)&c->amask, (size_t)((mk + 7) / 8), "activation clip bits"));
        BIE_TRY(dev_alloc((void **)&c->aresid, (size_t)mk, "activation residuals"));
        c->s_cap = m;
    }
    return BIE_OK;
}

/* The weight codes the forward multiplies with: q4(w, scale_w) of the float weight, packed
 * now (the optimizer may have changed it; inference without qweight too, as the CPU layer
 * does), or in inference the codes of qweight, unpacked once after each weight change. */
static bie_status forward_weight(bie_layer *l, const uint8_t **codes) {
    struct bie_q4l_cuda *c = CU(l);
    const bool from_q = !l->training && c->d.qweight;
    if (!from_q) {
        BIE_TRY(bie_cuda_q4_pack_weight(c->d.w_f32, l->out, l->in, c->d.scalars + BIE_CBW_SCALE_W, c->ld,
                                        c->wcodes));
        *codes = c->wcodes;
        return BIE_OK;
    }
    if (c->qcodes == NULL || c->qversion != c->d.version) {
        if (c->qcodes == NULL) BIE_TRY(dev_alloc((void **)&c->qcodes, (size_t)(l->out * c->ld), "weight codes"));
        BIE_TRY(bie_cuda_q4_repack_rows(c->d.qweight, l->out, l->in, c->ld, c->qcodes));
        c->qversion = c->d.version;
    }
    *codes = c->qcodes;
    return BIE_OK;
}

static bie_status forward(bie_layer *l, const bie_tensor *x, bie_tensor *out) {
    static const char *who = "q4_linear_forward";
    struct bie_q4l_cuda *c = CU(l);
    BIE_TRY(check_forward(l, x));
    BIE_TRY(bie_cbw_check_tensor(l->device.index, out, "output", l->dtype, l->out, x, who));
    if (c->d.w_f32 == NULL && (l->training || c->d.qweight == NULL)) return bie_bw_no_weight(who);
    const int64_t m = bie_tensor_numel(x) / l->in;
    int64_t bytes;
    /* The GEMM indexes rows in 32 bits, the backward's BLAS too. */
    if (m > INT32_MAX || !bie_mul_ok(m, c->ld, &bytes))
        return bie_fail(BIE_ERR_OVERFLOW, "%s: %lld rows are too many for the CUDA kernels", who, (long long)m);
    const bool keep = l->training;
    BIE_TRY(ensure_scale_a(l, x, who));
    BIE_TRY(reserve_activations(l, m, keep));
    l->has_saved = false;
    float *scalars = c->d.scalars;
    BIE_TRY(bie_cuda_q4_pack_act(l->dtype, x->data, m, l->in, c->d.bias_a, scalars + BIE_CBW_SCALE_A, c->ld,
                                 c->acodes, keep ? c->amask : NULL, keep ? c->aresid : NULL));
    if (keep) BIE_TRY(bie_cbw_save_scales(&c->d));
    const uint8_t *wcodes = NULL;
    BIE_TRY(forward_weight(l, &wcodes));
    BIE_TRY(bie_cuda_q4gemm_launch(l->kernel_id, m, l->out, l->in, c->acodes, wcodes, c->ld, 0.0f,
                                   scalars + BIE_CBW_SCALE_A, scalars + BIE_CBW_SCALE_W, l->dtype, out->data,
                                   NULL));
    if (keep) {
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
        return bie_fail(BIE_ERR_STATE, "%s: no saved activations: run a training-mode forward first", who);
    bie_tensor like;
    memset(&like, 0, sizeof like);
    like.ndim = l->saved_ndim;
    memcpy(like.shape, l->saved_shape, sizeof like.shape);
    BIE_TRY(bie_cbw_check_tensor(l->device.index, grad_out, "grad_out", l->dtype, l->out, &like, who));
    if (grad_x) BIE_TRY(bie_cbw_check_tensor(l->device.index, grad_x, "grad_x", l->dtype, l->in, &like, who));
    BIE_TRY(bie_cbw_reserve_grads(&c->d));
    bie_cuda_q4l_backward_args a = {
        .dtype = l->dtype, .m = l->saved_m, .n = l->out, .k = l->in, .ld = c->ld,
        .grad_out = grad_out->data, .grad_x = grad_x ? grad_x->data : NULL, .wcodes = c->wcodes,
        .xcodes = c->acodes, .mask = c->amask, .resid = c->aresid,
        .saved_scales = c->d.scalars + BIE_CBW_SAVED_SCALES, .grad_w = c->d.g_w, .grad_bias = c->d.g_bias,
        .grad_scale_a = c->d.g_scale,
    };
    BIE_TRY(bie_cuda_q4_linear_backward(&a));
    c->d.has_grads = true;
    return BIE_OK;
}

static bie_status select_kernel(bie_layer *l, const bie_tensor *x, int *id) {
    const int64_t m = bie_tensor_numel(x) / x->shape[x->ndim - 1];
    return bie_cbw_select_kernel(BIE_OP_Q4_GEMM, m, l->out, l->in, CU(l)->ld, id);
}

const bie_layer_ops bie_q4_linear_cuda_ops = {
    .weight = &bie_q4_weight_cuda_ops,
    .init = init,
    .release = release,
    .check_rows = bie_cuda_check_rows,
    .check_forward = check_forward,
    .set_activation = set_activation,
    .forward = forward,
    .backward = backward,
    .check_kernel = check_kernel,
    .select_kernel = select_kernel,
};
