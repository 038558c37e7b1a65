/* The CUDA device's entry in the device registry (src/core/device.h): its memory, its
 * kernels and the layers' ops tables on it. */
#include "../core/device.h"
#include "../cuda/cuda_internal.h"
#include "layer_cuda.h"

static const bie_layer_ops *layer_ops(bie_layer_kind kind) {
    switch (kind) {
    case BIE_KIND_BINARY_LINEAR: return &bie_binary_linear_cuda_ops;
    case BIE_KIND_BINARY_CONV2D: return &bie_binary_conv2d_cuda_ops;
    case BIE_KIND_Q4_LINEAR: return &bie_q4_linear_cuda_ops;
    case BIE_KIND_Q4_CONV2D: return &bie_q4_conv2d_cuda_ops;
    }
    return NULL;
}

const bie_device_iface bie_cuda_device = {
    .type = BIE_DEVICE_CUDA,
    .name = "cuda",
    .free_ptr = bie_cuda_free_ptr,
    .kernel_count = bie_cuda_kernel_count_internal,
    .kernel_describe = bie_cuda_kernel_describe,
    .kernel_index = bie_cuda_kernel_index,
    .layer_ops = layer_ops,
};
