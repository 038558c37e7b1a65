/* What the layers' CPU ops tables share (the kinds' files fill them). */
#ifndef BIE_LAYER_CPU_H
#define BIE_LAYER_CPU_H

#include "layer.h"

/* The ops tables' on_device and activate on the CPU. */
bie_status bie_cpu_on_device(const bie_layer *l, const bie_tensor *t, const char *what,
                             const char *who, bie_tensor *host);
bie_status bie_cpu_activate(bie_layer *l, const bie_tensor *x, bie_tensor *x_out, const char *who);
/* The fastest available CPU kernel of the layer's op on x's GEMM shape, timed. */
bie_status bie_cpu_select_kernel(bie_layer *l, const bie_tensor *x, int *id);

/* The kinds' CPU backward passes (their own files). */
bie_status bie_bl_cpu_backward(bie_layer *l, const bie_tensor *grad_out, bie_tensor *grad_x);
bie_status bie_bc_cpu_backward(bie_layer *l, const bie_tensor *grad_out, bie_tensor *grad_x);

/* Bytes of one internal packed row of a binary linear layer (bits without word padding). */
static inline int64_t bie_bl_row_bytes(const bie_layer *l) { return (l->in + 7) / 8; }

#endif
