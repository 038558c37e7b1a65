/* What the layers' CPU ops tables share (the kinds' files fill them). */
#ifndef BIE_LAYER_CPU_H
#define BIE_LAYER_CPU_H

#include "layer.h"

/* A CPU tensor of `dtype` whose last extent is `last` and whose leading extents equal those
 * of `like` (any when NULL). */
bie_status bie_cpu_check_rows(const bie_layer *l, const bie_tensor *t, const char *what,
                              bie_dtype dtype, int64_t last, const bie_tensor *like,
                              const char *who);
/* The fastest available CPU kernel of the layer's op on x's GEMM shape, timed. */
bie_status bie_cpu_select_kernel(bie_layer *l, const bie_tensor *x, int *id);

/* The kinds' CPU backward passes (their own files). */
bie_status bie_bl_cpu_backward(bie_layer *l, const bie_tensor *grad_out, bie_tensor *grad_x);
bie_status bie_bc_cpu_backward(bie_layer *l, const bie_tensor *grad_out, bie_tensor *grad_x);

/* Bytes of one internal packed row of a binary linear layer (bits without word padding). */
static inline int64_t bie_bl_row_bytes(const bie_layer *l) { return (l->in + 7) / 8; }

#endif
