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

/* The ops tables' on_device and activate on CUDA. */
bie_status bie_cuda_on_device(const bie_layer *l, const bie_tensor *t, const char *what,
                              const char *who, bie_tensor *host);
bie_status bie_cuda_activate(bie_layer *l, const bie_tensor *x, bie_tensor *x_out, const char *who);
/* The ops tables' kernel choice on CUDA (the kind's op, rows of the device state's ld). */
bie_status bie_cuda_check_kernel(const bie_layer *l, int id, const char *who);
bie_status bie_cuda_select_kernel(bie_layer *l, const bie_tensor *x, int *id);
/* scale_a = factor * mean|x| on the device when it is still 0 (the kind's factor). */
bie_status bie_cuda_ensure_scale_a(bie_layer *l, const bie_tensor *x, const char *who);

#endif
