/* The CPU kernels of the fused batch norm, residual add and PReLU (bn_act_cpu.c), called by
 * bn_act.c after its checks: y, res, out and the gradients float32 [outer][c][inner]; the
 * per-channel tensors as bie_bn_act_params has them. Errors: out of memory. */
#ifndef BIE_BN_ACT_CPU_H
#define BIE_BN_ACT_CPU_H

#include "../core/internal.h"

bie_status bie_bn_act_cpu_forward(const bie_bn_act_params *p, int64_t outer, int64_t c,
                                  int64_t inner, const float *y, const float *res, float *save_mean,
                                  float *save_rstd, float *out);
bie_status bie_bn_act_cpu_backward(const bie_bn_act_params *p, int64_t outer, int64_t c,
                                   int64_t inner, const float *grad_out, const float *y,
                                   const float *res, const float *save_mean, const float *save_rstd,
                                   float *grad_y, float *grad_res, float *grad_gamma,
                                   float *grad_beta, float *grad_slope);

#endif
