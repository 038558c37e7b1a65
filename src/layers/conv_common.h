/* Geometry, checks and float im2col/col2im shared by the convolution layers. */
#ifndef BIE_CONV_COMMON_H
#define BIE_CONV_COMMON_H

#include "layer.h"

/* Input row index of output row `o` and tap `i` (may be outside 0..h-1). */
static inline int64_t bie_conv_in(const bie_conv_geom *g, int64_t o, int64_t i) {
    return o * g->s - g->p + i * g->d;
}

/* Bit plane bytes of one (n, c) plane. */
static inline int64_t bie_conv_plane_bytes(const bie_conv_geom *g) { return (g->h * g->w + 7) / 8; }

/* Create-time checks of a convolution's hyper-parameters (SPEC §3: square kernel, groups 1);
 * fan_in = in_c k k must stay below 2^24. */
bie_status bie_conv_check_params(int64_t in_c, int64_t out_c, int k, int s, int p, int d,
                                 const char *who);
/* Output extent along one axis (0 when the dilated kernel does not fit). */
int64_t bie_conv_out_extent(int64_t in, int64_t k, int64_t s, int64_t p, int64_t d);
/* x must be NCHW F32 on the CPU with in_c channels and room for the dilated kernel. */
bie_status bie_conv_check_input(const bie_tensor *x, int64_t in_c, int64_t k, int64_t s, int64_t p,
                                int64_t d, const char *who);
/* The same checks for a tensor of `dtype` (the device is checked by the caller: the tensor
 * passed here is marked as a CPU one). */
bie_status bie_conv_check_input_as(const bie_tensor *x, bie_dtype dtype, int64_t in_c, int64_t k,
                                   int64_t s, int64_t p, int64_t d, const char *who);
bie_status bie_conv_check_shape4_as(const bie_tensor *t, bie_dtype dtype, const int64_t *shape,
                                    const char *what, const char *who);
bie_conv_geom bie_conv_geometry(const bie_tensor *x, int64_t out_c, int64_t k, int64_t s, int64_t p,
                                int64_t d);
/* t must be an F32 CPU tensor of exactly [d0, d1, d2, d3]. */
bie_status bie_conv_check_shape4(const bie_tensor *t, const int64_t *shape, const char *what,
                                 const char *who);
/* gx (C x H x W of one image) += col2im(cols), cols [C k k, OH OW] in [c, i, j] rows. */
void bie_conv_col2im(const bie_conv_geom *g, const float *cols, float *gx);
/* cols [C k k, OH OW] = im2col of one image's C x H x W floats, 0 outside the input. */
void bie_conv_im2col_f32(const bie_conv_geom *g, const float *img, float *cols);

#endif
