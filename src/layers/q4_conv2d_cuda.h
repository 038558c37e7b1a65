/* The 4-bit conv2d layer on CUDA: the same life cycle and semantics as on the CPU (SPEC §4),
 * with every tensor the user passes or receives in device memory. q4_conv2d.c delegates here
 * for layers created on a CUDA device; the device kernels are in src/cuda/. */
#ifndef BIE_Q4_CONV2D_CUDA_H
#define BIE_Q4_CONV2D_CUDA_H

#include "q4_conv2d_impl.h"

#ifdef BIE_HAVE_CUDA
bie_status bie_q4cc_create(bie_q4_conv2d *l);
void bie_q4cc_free(bie_q4_conv2d *l);
bie_status bie_q4cc_reset(bie_q4_conv2d *l, uint64_t seed);
bie_status bie_q4cc_prepare(bie_q4_conv2d *l);
bie_status bie_q4cc_set_weight_data(bie_q4_conv2d *l, const bie_tensor *w);
bie_status bie_q4cc_generate_quantized_weight(bie_q4_conv2d *l, bool qweight_only);
bie_status bie_q4cc_set_quantized_weight_data(bie_q4_conv2d *l, const bie_tensor *q);
bie_status bie_q4cc_param(bie_q4_conv2d *l, bie_param which, bie_tensor *v);
bie_status bie_q4cc_grad(bie_q4_conv2d *l, bie_param which, bie_tensor *v);
bie_status bie_q4cc_set_scale_a(bie_q4_conv2d *l, float scale_a);
bool bie_q4cc_has_qweight(const bie_q4_conv2d *l);
bie_status bie_q4cc_check_forward(const bie_q4_conv2d *l, const bie_tensor *x);
bie_status bie_q4cc_set_activation(bie_q4_conv2d *l, const bie_tensor *x, bie_tensor *x_out);
bie_status bie_q4cc_forward(bie_q4_conv2d *l, const bie_tensor *x, bie_tensor *out);
bie_status bie_q4cc_backward(bie_q4_conv2d *l, const bie_tensor *grad_out, bie_tensor *grad_x);
bie_status bie_q4cc_set_kernel(bie_q4_conv2d *l, int id);
#endif

#endif
