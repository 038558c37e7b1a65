// The 4-bit quantization on the device, shared by the packing kernels of the linear
// (q4pack.cu) and convolution (q4conv.cu) layers: the CPU's arithmetic operation for
// operation (q4_weight.c: v = x + bias in float, q = v / s with an IEEE division, round half
// to even, NaN to 0, clamp to [-8, 7]), so that a layer gives bit-identical codes on either
// device.
#pragma once
#include "../core/formats.h"
#include "dtype.cuh"
#include "tile_t.cuh"

namespace bie_cuda {

// q4(v, s) = clamp(rint(v / s), -8, 7), NaN -> 0: bie_q4 of src/core/formats.h.
__device__ __forceinline__ int q4_code(float v, float s) { return bie_q4(v, s); }

// The same code with the division only near a half (bie_q4_fast; inv = bie_q4_inverse(s),
// computed once per thread).
__device__ __forceinline__ int q4_code_fast(float v, float s, float inv) {
    return bie_q4_fast(v, s, inv);
}

// The code of a two's-complement nibble nib (0 .. 15).
__device__ __forceinline__ int nibble_code(int nib) { return nib - ((nib & 8) << 1); }

// Code i of flat two's-complement nibbles (even index in the low nibble).
__device__ __forceinline__ int code_at(const uint8_t *codes, int64_t i) {
    return nibble_code((codes[i >> 1] >> ((i & 1) * 4)) & 15);
}

// The code (q4_code), *clip and *resid (q4_clip_resid below) of an input whose quotient
// q = v / s is already known.
__device__ __forceinline__ int q4_state_of(float q, bool *clip, int8_t *resid) {
    const float r = rintf(q);
    *clip = q >= -8.0f && q <= 7.0f;
    *resid = *clip ? (int8_t)rintf(__fmul_rn(__fsub_rn(r, q), 254.0f)) : (int8_t)0;
    if (!(r == r)) return 0;
    return (int)(r < -8.0f ? -8.0f : r > 7.0f ? 7.0f : r);
}

// The same of v from one division.
__device__ __forceinline__ int q4_code_state(float v, float s, bool *clip, int8_t *resid) {
    return q4_state_of(__fdiv_rn(v, s), clip, resid);
}

// The backward's state of one input v (SPEC §4): the clip bit 1{-8 <= v / s <= 7}, and the
// rounding residual (rint(q) - q) * 254 rounded to int8 inside the clip range (else 0).
__device__ __forceinline__ bool q4_clip_resid(float v, float s, int8_t *resid) {
    bool clip;
    (void)q4_code_state(v, s, &clip, resid);
    return clip;
}

// The quotient v / s from y = q4_reciprocal(s), computed once per thread, without a division
// (bie_q4_quotient of src/core/formats.h: the division's result wherever a code, clip bit or
// residual can tell).
__device__ __forceinline__ float q4_reciprocal(float s) { return bie_q4_reciprocal(s); }
__device__ __forceinline__ float q4_quotient(float v, float s, float y) {
    return bie_q4_quotient(v, s, y);
}

// Whether the passes that keep the backward's state (the linear layer's activation pass, the
// convolution's encodes) take their quotients from q4_quotient instead of the division
// (BIE_CUDA_Q4_QUOTIENT=1: the same codes, clip bits and residuals, checked on the CPU; opt-in
// until timed on a GPU). Host code (q4pack.cu).
bool q4_quotient_wanted();

// The code, clip bit and residual of v by the division, or (QUOT) by q4_quotient with
// y = q4_reciprocal(s).
template <bool QUOT>
__device__ __forceinline__ int q4_state(float v, float s, float y, bool *clip, int8_t *resid) {
    return QUOT ? q4_state_of(q4_quotient(v, s, y), clip, resid) : q4_code_state(v, s, clip, resid);
}

}  // namespace bie_cuda
