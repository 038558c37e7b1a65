/* The binary conv2d layer on CUDA: the same life cycle and semantics as on the CPU (SPEC §3),
 * with every tensor the user passes or receives in device memory. binary_conv2d.c delegates
 * here for layers created on a CUDA device; the device kernels are in src/cuda/conv.cu. */
#ifndef BIE_BINARY_CONV2D_CUDA_H
#define BIE_BINARY_CONV2D_CUDA_H

#include "binary_conv2d_impl.h"

#ifdef BIE_HAVE_CUDA
bie_status bie_bcc_create(bie_binary_conv2d *l);
void bie_bcc_free(bie_binary_conv2d *l);
bie_status bie_bcc_reset(bie_binary_conv2d *l, uint64_t seed);
bie_status bie_bcc_prepare(bie_binary_conv2d *l);
bie_status bie_bcc_set_weight_data(bie_binary_conv2d *l, const bie_tensor *w);
bie_status bie_bcc_generate_quantized_weight(bie_binary_conv2d *l, bool qweight_only);
bie_status bie_bcc_set_quantized_weight_data(bie_binary_conv2d *l, const bie_tensor *q);
bie_status bie_bcc_set_bits(bie_binary_conv2d *l, int bits);
bie_status bie_bcc_param(bie_binary_conv2d *l, bie_param which, bie_tensor *v);
bie_status bie_bcc_grad(bie_binary_conv2d *l, bie_param which, bie_tensor *v);
bie_status bie_bcc_set_scale_a(bie_binary_conv2d *l, float scale_a);
bool bie_bcc_has_qweight(const bie_binary_conv2d *l);
bie_status bie_bcc_check_forward(const bie_binary_conv2d *l, const bie_tensor *x);
bie_status bie_bcc_set_activation(bie_binary_conv2d *l, const bie_tensor *x, bie_tensor *x_out);
bie_status bie_bcc_forward(bie_binary_conv2d *l, const bie_tensor *x, bie_tensor *out);
bie_status bie_bcc_backward(bie_binary_conv2d *l, const bie_tensor *grad_out, bie_tensor *grad_x);
bie_status bie_bcc_select_kernel(bie_binary_conv2d *l, const bie_tensor *x);
bie_status bie_bcc_set_kernel(bie_binary_conv2d *l, int id);
#endif

#endif
