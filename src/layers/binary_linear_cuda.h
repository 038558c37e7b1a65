/* The binary linear layer on CUDA: the same life cycle and semantics as on the CPU (SPEC §2),
 * with every tensor the user passes or receives in device memory. binary_linear.c delegates
 * here for layers created on a CUDA device; the device kernels are in src/cuda/. */
#ifndef BIE_BINARY_LINEAR_CUDA_H
#define BIE_BINARY_LINEAR_CUDA_H

#include "binary_linear_impl.h"

#ifdef BIE_HAVE_CUDA
bie_status bie_blc_create(bie_binary_linear *l);
void bie_blc_free(bie_binary_linear *l);
bie_status bie_blc_reset(bie_binary_linear *l, uint64_t seed);
bie_status bie_blc_prepare(bie_binary_linear *l);
bie_status bie_blc_set_weight_data(bie_binary_linear *l, const bie_tensor *w);
bie_status bie_blc_generate_quantized_weight(bie_binary_linear *l, bool qweight_only);
bie_status bie_blc_set_quantized_weight_data(bie_binary_linear *l, const bie_tensor *q);
bie_status bie_blc_set_bits(bie_binary_linear *l, int bits);
bie_status bie_blc_param(bie_binary_linear *l, bie_param which, bie_tensor *v);
bie_status bie_blc_grad(bie_binary_linear *l, bie_param which, bie_tensor *v);
bie_status bie_blc_set_scale_a(bie_binary_linear *l, float scale_a);
void bie_blc_drop_saved(bie_binary_linear *l);
bie_status bie_blc_check_forward(const bie_binary_linear *l, const bie_tensor *x);
bie_status bie_blc_set_activation(bie_binary_linear *l, const bie_tensor *x, bie_tensor *x_out);
bie_status bie_blc_forward(bie_binary_linear *l, const bie_tensor *x, bie_tensor *out);
bie_status bie_blc_backward(bie_binary_linear *l, const bie_tensor *grad_out, bie_tensor *grad_x);
bie_status bie_blc_select_kernel(bie_binary_linear *l, const bie_tensor *x);
bie_status bie_blc_set_kernel(bie_binary_linear *l, int id);
bool bie_blc_has_qweight(const bie_binary_linear *l);
#endif

#endif
