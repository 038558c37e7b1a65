/* The kind table: one row per layer kind (what differs by kind), and where each kind's
 * operations on each device are found. Adding a kind is a row here, its ops tables and a row
 * in the tests' kind table. */
#include "../core/device.h"
#include "layer.h"

#define NAMES(kind)                                                                          \
    {                                                                                        \
        kind "_prepare_params", kind "_set_weight_data", kind "_generate_quantized_weight",  \
            kind "_set_quantized_weight_data", kind "_check_forward", kind "_set_activation" \
    }

static const bie_kind_def kinds[] = {
    [BIE_KIND_BINARY_LINEAR] = {BIE_KIND_BINARY_LINEAR,
                                "binary_linear",
                                BIE_OP_BINARY_GEMM,
                                false,
                                true,
                                true,
                                {4.0, 2.0},
                                NAMES("binary_linear")},
    [BIE_KIND_BINARY_CONV2D] = {BIE_KIND_BINARY_CONV2D,
                                "binary_conv2d",
                                BIE_OP_BINARY_GEMM,
                                true,
                                true,
                                false,
                                {4.0, 2.0},
                                NAMES("binary_conv2d")},
    [BIE_KIND_Q4_LINEAR] = {BIE_KIND_Q4_LINEAR,
                            "q4_linear",
                            BIE_OP_Q4_GEMM,
                            false,
                            false,
                            false,
                            {2.0 / 11.269, 2.0 / 11.269},
                            NAMES("q4_linear")},
    [BIE_KIND_Q4_CONV2D] = {BIE_KIND_Q4_CONV2D,
                            "q4_conv2d",
                            BIE_OP_Q4_GEMM,
                            true,
                            false,
                            false,
                            {2.0 / 11.269, 2.0 / 11.269},
                            NAMES("q4_conv2d")},
};

static const bie_layer_ops *const cpu_ops[] = {
    [BIE_KIND_BINARY_LINEAR] = &bie_binary_linear_cpu_ops,
    [BIE_KIND_BINARY_CONV2D] = &bie_binary_conv2d_cpu_ops,
    [BIE_KIND_Q4_LINEAR] = &bie_q4_linear_cpu_ops,
    [BIE_KIND_Q4_CONV2D] = &bie_q4_conv2d_cpu_ops,
};

const bie_kind_def *bie_kind_get(bie_layer_kind id) { return &kinds[id]; }

const bie_layer_ops *bie_layer_ops_for(bie_layer_kind kind, bie_device_type device) {
    if ((unsigned)kind >= sizeof kinds / sizeof kinds[0]) return NULL;
    if (device == BIE_DEVICE_CPU) return cpu_ops[kind];
    const bie_device_iface *dev = bie_device_get(device);
    return dev && dev->layer_ops ? dev->layer_ops(kind) : NULL;
}
