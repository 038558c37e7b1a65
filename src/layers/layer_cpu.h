/* What the layers' CPU ops tables share (the kinds' files fill them). */
#ifndef BIE_LAYER_CPU_H
#define BIE_LAYER_CPU_H

#include "layer.h"

/* The kinds' CPU backward passes (their own files). */
bie_status bie_bl_cpu_backward(bie_layer *l, const bie_tensor *grad_out, bie_tensor *grad_x);
bie_status bie_bc_cpu_backward(bie_layer *l, const bie_tensor *grad_out, bie_tensor *grad_x);

/* Bytes of one internal packed row of a binary linear layer (bits without word padding). */
static inline int64_t bie_bl_row_bytes(const bie_layer *l) { return (l->in + 7) / 8; }

#endif
