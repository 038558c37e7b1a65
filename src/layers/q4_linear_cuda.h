/* The 4-bit linear layer on CUDA: the same life cycle and semantics as on the CPU (SPEC §4),
 * with every tensor the user passes or receives in device memory. q4_linear.c delegates here
 * for layers created on a CUDA device; the device kernels are in src/cuda/. */
#ifndef BIE_Q4_LINEAR_CUDA_H
#define BIE_Q4_LINEAR_CUDA_H

#include "q4_linear_impl.h"

#ifdef BIE_HAVE_CUDA
bie_status bie_q4lc_create(bie_q4_linear *l);
void bie_q4lc_free(bie_q4_linear *l);
bie_status bie_q4lc_reset(bie_q4_linear *l, uint64_t seed);
bie_status bie_q4lc_prepare(bie_q4_linear *l);
bie_status bie_q4lc_set_weight_data(bie_q4_linear *l, const bie_tensor *w);
bie_status bie_q4lc_generate_quantized_weight(bie_q4_linear *l, bool qweight_only);
bie_status bie_q4lc_set_quantized_weight_data(bie_q4_linear *l, const bie_tensor *q);
bie_status bie_q4lc_param(bie_q4_linear *l, bie_param which, bie_tensor *v);
bie_status bie_q4lc_grad(bie_q4_linear *l, bie_param which, bie_tensor *v);
bie_status bie_q4lc_set_scale_a(bie_q4_linear *l, float scale_a);
bool bie_q4lc_has_qweight(const bie_q4_linear *l);
bie_status bie_q4lc_check_forward(const bie_q4_linear *l, const bie_tensor *x);
bie_status bie_q4lc_set_activation(bie_q4_linear *l, const bie_tensor *x, bie_tensor *x_out);
bie_status bie_q4lc_forward(bie_q4_linear *l, const bie_tensor *x, bie_tensor *out);
bie_status bie_q4lc_backward(bie_q4_linear *l, const bie_tensor *grad_out, bie_tensor *grad_x);
bie_status bie_q4lc_set_kernel(bie_q4_linear *l, int id);
#endif

#endif
