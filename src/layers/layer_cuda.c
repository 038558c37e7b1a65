/* What every kind shares on CUDA (layer_cuda.h's bie_cuda_device_ops): the device check,
 * set_activation's work on the device, kernel checks and select_gemm_kernel. */
#include "layer_cuda.h"
#include "../cuda/cuda_internal.h"
#include "binary_weight_cuda.h"
#include "q4_weight_cuda.h"

static bie_cuda_bw *dev(const bie_layer *l) { return (bie_cuda_bw *)l->backend; }

static bie_status on_device(const bie_layer *l, const bie_tensor *t, const char *what,
                            const char *who, bie_tensor *host) {
    return bie_cbw_on_device(l->device.index, t, what, who, host);
}

bie_status bie_cuda_ensure_scale_a(bie_layer *l, const bie_tensor *x, const char *who) {
    return bie_cbw_ensure_scale_a(dev(l), x->dtype, x->data, bie_tensor_numel(x),
                                  bie_layer_scale_a_factor(l), who);
}

bie_status bie_cuda_check_backward_mode(const bie_layer *l, int mode, const char *who) {
    if (mode == BIE_BACKWARD_FP8 && !bie_cuda_fp8_usable(l->device.index))
        return bie_fail(BIE_ERR_UNSUPPORTED,
                        "%s_%s: CUDA device %d has no FP8 tensor cores (compute capability 8.9 or "
                        "newer)",
                        l->kind->name, who, l->device.index);
    return BIE_OK;
}

static bie_status activate(bie_layer *l, const bie_tensor *x, bie_tensor *x_out, const char *who) {
    BIE_TRY(bie_cuda_ensure_scale_a(l, x, who));
    if (x_out == NULL) return BIE_OK;
    if (l->kind->conv && !l->channels_last) /* NHWC: rows of channels, as a linear layer's */
        return bie_cuda_add_bias_planes(l->dtype, x->data, x->shape[0], l->in,
                                        x->shape[2] * x->shape[3], dev(l)->bias_a, x_out->data);
    return bie_cuda_add_bias(l->dtype, x->data, bie_tensor_numel(x) / l->in, l->in, dev(l)->bias_a,
                             x_out->data);
}

/* ---------------------------------------------------------------- kernel choice */

static bie_status check_kernel(const bie_layer *l, int id, const char *who) {
    if (l->kind->op == BIE_OP_Q4_GEMM) return bie_cq4w_check_kernel(id, l->fan_in, who);
    return bie_cbw_check_kernel(id, dev(l)->ld, who);
}

static bie_status select_kernel(bie_layer *l, const bie_tensor *x, int *id) {
    int64_t m; /* the GEMM's rows: input rows, or every output pixel of the batch */
    if (l->kind->conv) {
        const bie_conv_geom g = bie_layer_conv_geom(l, x);
        m = g.n * g.oh * g.ow;
    } else {
        m = bie_tensor_numel(x) / x->shape[x->ndim - 1];
    }
    return bie_cbw_select_kernel(l->kind->op, m, l->out, l->fan_in, dev(l)->ld, id);
}

const bie_device_ops bie_cuda_device_ops = {
    .on_device = on_device,
    .activate = activate,
    .check_kernel = check_kernel,
    .select_kernel = select_kernel,
};
