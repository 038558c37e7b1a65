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

/* A tensor on the layer's CUDA device (see bie_layer_ops.check_rows). */
bie_status bie_cuda_check_rows(const bie_layer *l, const bie_tensor *t, const char *what,
                               bie_dtype dtype, int64_t last, const bie_tensor *like,
                               const char *who);

#endif
