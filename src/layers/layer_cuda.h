/* What the layers' CUDA ops tables share (cuda_layer.h holds the device state they use). */
#ifndef BIE_LAYER_CUDA_H
#define BIE_LAYER_CUDA_H

#include "cuda_layer.h"
#include "layer.h"

/* The CUDA weight operations of each format (weight_cuda.c). */
extern const bie_weight_ops bie_binary_weight_cuda_ops, bie_q4_weight_cuda_ops;
/* The ops tables of each kind on CUDA. */
extern const bie_layer_ops bie_binary_linear_cuda_ops, bie_binary_conv2d_cuda_ops;
extern const bie_layer_ops bie_q4_linear_cuda_ops, bie_q4_conv2d_cuda_ops;

/* What every kind shares on CUDA. */
extern const bie_device_ops bie_cuda_device_ops;
/* scale_a = factor * mean|x| on the device when it is still 0 (the kind's factor). */
bie_status bie_cuda_ensure_scale_a(bie_layer *l, const bie_tensor *x, const char *who);
/* The binary layers' check_backward_mode: FP8 needs FP8 tensor cores on the layer's device. */
bie_status bie_cuda_check_backward_mode(const bie_layer *l, int mode, const char *who);

#endif
