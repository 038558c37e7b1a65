/* The 4-bit conv2d layer's state, shared by its CPU (q4_conv2d.c) and CUDA
 * (q4_conv2d_cuda.c) implementations. */
#ifndef BIE_Q4_CONV2D_IMPL_H
#define BIE_Q4_CONV2D_IMPL_H

#include "conv_common.h"
#include "q4_weight.h"

struct bie_q4_conv2d {
    int64_t in_c, out_c, k, stride, padding, dilation;
    bie_device device;
    bie_dtype dtype;
    bool training;
    int kernel_id; /* -1: default per shape */
    bie_q4_weight w; /* [out_c, in_c k k] (on CUDA: host staging only, see q4_weight_cuda.h) */
    float *bias_a;
    float scale_a;
    bool has_saved;
    bie_conv_geom saved_geom;
    uint8_t *saved_codes, *saved_mask; /* flat over N C H W */
    int8_t *saved_resid, *saved_wcodes;
    float saved_scale_a, saved_scale_w;
    bie_layer_grads grads;
    /* Device state of a layer on CUDA (q4_conv2d_cuda.c), NULL on the CPU. */
    struct bie_q4c_cuda *cuda;
};

#endif
