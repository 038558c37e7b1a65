/* The weight of a 4-bit layer (SPEC §4), shared by 4-bit linear and 4-bit conv2d: a float
 * [rows, cols] matrix (cols = fan-in, [c, i, j] order for conv) kept for straight-through
 * training, scale_w, and optionally its packed codes (qweight: nibbles, two per byte, even
 * index low) with an int8 copy of them cached for inference. */
#ifndef BIE_Q4_WEIGHT_H
#define BIE_Q4_WEIGHT_H

#include "../cpu/dispatch.h"
#include "binary_weight.h"

typedef struct bie_q4_weight {
    int64_t rows, cols;
    float *f32;          /* or NULL after generate_quantized_weight(qweight_only) */
    uint8_t *qweight;    /* [rows, ceil(cols / 2)] or NULL */
    int8_t *qcodes;      /* qweight as int8 (inference cache) or NULL */
    bie_packed_b packed; /* qcodes in a tile kernel's panels (inference cache) */
    float scale_w;
} bie_q4_weight;

void bie_q4w_init(bie_q4_weight *w, int64_t rows, int64_t cols);
void bie_q4w_free(bie_q4_weight *w);
bie_status bie_q4w_reset(bie_q4_weight *w, uint64_t seed);
/* scale_w = max(2 mean|w| / 5.6345, 1e-5). */
bie_status bie_q4w_prepare(bie_q4_weight *w, const char *who);
/* Copy rows * cols floats (checked finite) and prepare. */
bie_status bie_q4w_set_data(bie_q4_weight *w, const float *data, const char *who);
bie_status bie_q4w_generate_qweight(bie_q4_weight *w, bool qweight_only, const char *who);
/* q: rows x ceil(cols / 2) bytes, already validated. */
bie_status bie_q4w_set_qweight(bie_q4_weight *w, const uint8_t *q, const char *who);
/* int8 codes [rows, cols] for a forward: from qweight when `prefer_q` (inference) and the
 * layer has one, else q4(w, scale_w). *borrowed is set when the result is the layer's
 * cache (not to be freed). */
bie_status bie_q4w_codes(bie_q4_weight *w, bool prefer_q, int8_t **codes, bool *borrowed,
                         const char *who);
/* Activation codes of a 4-bit layer: codes[i] = q4(x[i] + b, scale) with
 * b = bias[(i / run) % len] (linear: run 1, len in; conv: run H W, len in_c). When mask is
 * not NULL, also the clip bit 1{-8 <= v <= 7} (v = (x + b) / scale; bit i of the flat
 * tensor) and the rounding residual (rint(v) - v) * 254 in int8 for the backward. */
void bie_q4_encode(const float *x, int64_t n, const float *bias, int64_t run, int64_t len,
                   float scale, int8_t *codes, uint8_t *mask, int8_t *resid);
/* qweight's codes packed once into `kern`'s weight panels (a tile kernel), for inference. */
bie_status bie_q4w_packed(bie_q4_weight *w, const bie_cpu_kernel *kern, const bie_packed_b **out,
                          const char *who);
/* Pack int8 codes into nibble rows. */
void bie_q4_pack_nibbles(const int8_t *codes, int64_t rows, int64_t cols, uint8_t *dst);

#endif
