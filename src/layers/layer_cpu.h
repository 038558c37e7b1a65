/* What the layers' CPU ops tables share (the kinds' files fill them). */
#ifndef BIE_LAYER_CPU_H
#define BIE_LAYER_CPU_H

#include "layer.h"

/* The kinds' CPU backward passes (their own files). */
bie_status bie_bl_cpu_backward(bie_layer *l, const bie_tensor *grad_out, bie_tensor *grad_x);
bie_status bie_bc_cpu_backward(bie_layer *l, const bie_tensor *grad_out, bie_tensor *grad_x);

/* A 4-bit layer's training state of n inputs while its forward runs: the nibble codes, clip
 * bits and residuals (all NULL unless keep). bie_q4_state_alloc: false where memory ran out. */
typedef struct bie_q4_state {
    uint8_t *nib, *mask;
    int8_t *resid;
} bie_q4_state;
bool bie_q4_state_alloc(bie_q4_state *s, int64_t n, bool keep);
/* The layer keeps the state (its codes packed to nibbles), the weight codes (*wcodes, then
 * NULL) and the scales; what it kept before is dropped. The caller sets the shape fields. */
void bie_q4_state_keep(bie_layer *l, bie_q4_state *s, const int8_t *codes, int64_t n,
                       int8_t **wcodes, float scale_a);
void bie_q4_state_free(bie_q4_state *s);
/* The 4-bit layers' backward from the kept state: gx [n] (grad_x before the clip) masked by
 * the clip bits; grad_bias [len] (gb) its sums per channel (element i in channel
 * (i / run) % len; n a multiple of run); grad_scale_a its dot with the residuals / 254 over
 * sqrt(7 n). Installs gw and gb as the layer's gradients. sums: len doubles. */
void bie_q4_state_grads(bie_layer *l, float *gx, int64_t n, int64_t run, int64_t len, float *gw,
                        float *gb, double *sums);

/* Bytes of one internal packed row of a binary linear layer (bits without word padding). */
static inline int64_t bie_bl_row_bytes(const bie_layer *l) { return (l->in + 7) / 8; }

#endif
