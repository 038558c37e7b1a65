/* The binary linear layer's state, shared by its life-cycle, forward, backward and kernel
 * selection files. */
#ifndef BIE_BINARY_LINEAR_IMPL_H
#define BIE_BINARY_LINEAR_IMPL_H

#include "../core/formats.h"
#include "../core/internal.h"
#include "binary_weight.h"

struct bie_binary_linear {
    int64_t in, out;
    bie_device device;
    bie_dtype dtype;
    bool symmetric;
    bool training;
    int kernel_id; /* -1: default per shape */

    bie_binary_weight w; /* [out, in] */
    float *bias_a;
    float scale_a;

    /* Saved by a training forward for the backward: packed sign(x') and clip mask rows of
     * ceil(in / 8) bytes, the packed weight signs, and the scales used. */
    bool has_saved;
    int64_t saved_m;
    int saved_ndim;
    int64_t saved_shape[BIE_MAX_DIMS];
    uint8_t *saved_signs, *saved_mask, *saved_wbits;
    float saved_scale_a, saved_scale_w;

    /* Gradients of the last backward. */
    bie_layer_grads grads;

    /* Device state of a layer on CUDA (binary_linear_cuda.c), NULL on the CPU. */
    struct bie_bl_cuda *cuda;
};

/* Bytes of one internal packed row (bit stream without word padding). */
static inline int64_t bie_bl_row_bytes(const bie_binary_linear *l) { return (l->in + 7) / 8; }

#endif
