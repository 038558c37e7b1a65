/* The 4-bit linear layer's state, shared by its CPU (q4_linear.c) and CUDA
 * (q4_linear_cuda.c) implementations. */
#ifndef BIE_Q4_LINEAR_IMPL_H
#define BIE_Q4_LINEAR_IMPL_H

#include "q4_weight.h"

struct bie_q4_linear {
    int64_t in, out;
    bie_device device;
    bie_dtype dtype;
    bool training;
    int kernel_id; /* -1: default per shape */
    bie_q4_weight w; /* [out, in] (on CUDA: host staging only, see q4_weight_cuda.h) */
    float *bias_a;
    float scale_a;
    /* saved by a training forward (flat over the input's m x in elements) */
    bool has_saved;
    int64_t saved_m;
    int saved_ndim;
    int64_t saved_shape[BIE_MAX_DIMS];
    uint8_t *saved_codes; /* q4(x') nibbles */
    uint8_t *saved_mask;  /* clip bits */
    int8_t *saved_resid;  /* (rint(v) - v) * 254 */
    int8_t *saved_wcodes; /* [out, in] q4(w) */
    float saved_scale_a, saved_scale_w;
    bie_layer_grads grads;
    /* Device state of a layer on CUDA (q4_linear_cuda.c), NULL on the CPU. */
    struct bie_q4l_cuda *cuda;
};

#endif
