/* The binary conv2d layer's state and geometry, shared by its forward and backward files. */
#ifndef BIE_BINARY_CONV2D_IMPL_H
#define BIE_BINARY_CONV2D_IMPL_H

#include "binary_weight.h"

typedef struct bie_conv_geom {
    int64_t n, c, h, w; /* input */
    int64_t o, oh, ow;  /* output */
    int64_t k, s, p, d;
} bie_conv_geom;

struct bie_binary_conv2d {
    int64_t in_c, out_c;
    int64_t k, stride, padding, dilation;
    bie_device device;
    bie_dtype dtype;
    bool symmetric, training;
    int kernel_id;
    bie_binary_weight w; /* [out_c, in_c * k * k], [c, i, j] order */
    float *bias_a;       /* [in_c] */
    float scale_a;

    /* Saved by a training forward: sign(x') and the clip mask as bit planes of ceil(H W / 8)
     * bytes per (n, c), the weight's sign bits in [i, j, c] order, and the scales used. */
    bool has_saved;
    bie_conv_geom saved_geom;
    uint8_t *saved_signs, *saved_mask, *saved_wbits;
    int64_t saved_wrb; /* bytes per row of saved_wbits */
    float saved_scale_a, saved_scale_w;

    bie_layer_grads grads;

    /* Device state of a layer on CUDA (binary_conv2d_cuda.c), NULL on the CPU. */
    struct bie_bc_cuda *cuda;
};

/* Input row index of output row `o` and tap `i` (may be outside 0..h-1). */
static inline int64_t bie_conv_in(const bie_conv_geom *g, int64_t o, int64_t i) {
    return o * g->s - g->p + i * g->d;
}

/* Bit plane bytes of one (n, c) plane. */
static inline int64_t bie_conv_plane_bytes(const bie_conv_geom *g) { return (g->h * g->w + 7) / 8; }

#endif
