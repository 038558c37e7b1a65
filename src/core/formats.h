/* The one definition of the bit layouts (SPEC §1), shared by the CPU and CUDA code.
 *
 * A packed sign row is a bit stream: element j of the row is bit (j % 8) of byte (j / 8),
 * least significant bit first; bit 1 means +1 (value >= 0), bit 0 means -1. On a
 * little-endian machine this is the same stream for words of 8, 32 and 64 bits: the word
 * size only sets how a row is padded (to a whole number of words). Padding bits are zero
 * when the library writes them and ignored (masked) when it reads them.
 *
 * Binary dot product of two rows with k valid bits (padding zero in both):
 *   dot = k - 2 * popcount(a XOR b)                                   (XOR form)
 *   dot = k - 2 * popcount(a) - 2 * popcount(b) + 4 * popcount(a AND b) (AND form) */
#ifndef BIE_FORMATS_H
#define BIE_FORMATS_H

#include <math.h>
#include <stdint.h>

#define BIE_SIGN_BIT(v) ((v) >= 0) /* sign(0) = +1 */

/* The geometry of one convolution call, shared by the C and CUDA code: input N x C x H x W,
 * output N x O x OH x OW, square kernel k, stride s, padding p, dilation d. */
typedef struct bie_conv_geom {
    int64_t n, c, h, w; /* input */
    int64_t o, oh, ow;  /* output */
    int64_t k, s, p, d;
    int64_t nhwc; /* 1: x, out, grad_out and grad_x are NHWC in memory (else NCHW) */
} bie_conv_geom;

static inline int bie_word_bits_ok(int w) { return w == 8 || w == 32 || w == 64; }

/* Bytes of one packed row of `cols` elements in words of `w` bits. */
static inline int64_t bie_packed_row_bytes(int64_t cols, int w) {
    return (cols + w - 1) / w * (w / 8);
}

/* Mask of the valid bits in the last byte of a row of k bits (0xff when k % 8 == 0). */
static inline uint8_t bie_tail_mask(int64_t k) {
    return (uint8_t)((k & 7) ? ((1u << (k & 7)) - 1u) : 0xffu);
}

#ifdef __CUDACC__
#define BIE_HOST_DEVICE __host__ __device__
#else
#define BIE_HOST_DEVICE
#endif
#ifdef __CUDA_ARCH__
#define BIE_RINTF rintf
#else
#define BIE_RINTF __builtin_rintf
#endif

/* 4-bit quantization (SPEC §1): clamp(rint(v / s), -8, 7), round half to even (the default
 * rounding mode); NaN maps to 0. The same code on the host and the device. */
BIE_HOST_DEVICE static inline int8_t bie_q4(float v, float s) {
    float q = BIE_RINTF(v / s);
    if (!(q == q)) return 0;
    return (int8_t)(q < -8.0f ? -8.0f : q > 7.0f ? 7.0f : q);
}

/* bie_q4 without a division where one cannot change the code: y = v * inv, with
 * inv = bie_q4_inverse(s) (NaN when 1 / s is not a normal float: then every code takes the
 * division). For |y| < 16, y is within 2^-18 of the correctly rounded v / s (two roundings of
 * 2^-24 relative each, and the quotient's own rounding), so when y is more than 0.499 from
 * its nearest integer both round to the same integer; |y| >= 16 clamps the same either way.
 * Inputs near a half (and NaN, infinities) take the division, so the code is always
 * bie_q4(v, s) (tests/test_pack.c checks it on values at and around every half). Whether
 * y - q is contracted into a fused multiply-add does not matter: the bound holds for both. */
BIE_HOST_DEVICE static inline float bie_q4_inverse(float s) {
    const float a = s < 0.0f ? -s : s;
    return a >= 0x1p-125f && a <= 0x1p125f ? 1.0f / s : NAN;
}
BIE_HOST_DEVICE static inline int8_t bie_q4_fast(float v, float s, float inv) {
    const float y = v * inv, q = BIE_RINTF(y), d = y - q;
    if (d < 0.499f && d > -0.499f) return (int8_t)(q < -8.0f ? -8 : q > 7.0f ? 7 : (int)q);
    return bie_q4(v, s);
}

/* v / s without a division, for the 4-bit backward state (whose clip bit and residual need the
 * correctly rounded quotient, not only its code): y = bie_q4_reciprocal(s) once per scale
 * (NaN where |s| is outside [2^-60, 2^60]), then bie_q4_quotient(v, s, y). q0 = v y is within a
 * few ulps of v / s; one fused correction by the exact remainder v - s q makes it faithful, a
 * second correctly rounded (Markstein: y within half an ulp of 1 / s, the remainder exact in a
 * fused multiply-add). With |v| <= 2^60 and s in range nothing overflows; where |v| is below
 * about 2^-100 or the quotient below the normal range, the remainder or the quotient can lose
 * bits to underflow and differ from the division's in its last place: such a quotient is below
 * 2^-40 in magnitude, where the code (0), the clip bit (1) and the residual (0) are the same
 * either way. NaN, infinities, |v| > 2^60 and scales out of range take the division.
 * tests/test_pack.c checks both against the division on the CPU. */
#ifdef __CUDA_ARCH__
#define BIE_FMAF __fmaf_rn
#define BIE_FMUL __fmul_rn
#define BIE_FRCP __frcp_rn
#define BIE_FDIV __fdiv_rn
#else
#define BIE_FMAF fmaf
#define BIE_FMUL(a, b) ((a) * (b))
#define BIE_FRCP(a) (1.0f / (a))
#define BIE_FDIV(a, b) ((a) / (b))
#endif
BIE_HOST_DEVICE static inline float bie_q4_reciprocal(float s) {
    const float a = s < 0.0f ? -s : s;
    return a >= 0x1p-60f && a <= 0x1p60f ? BIE_FRCP(s) : NAN;
}
BIE_HOST_DEVICE static inline float bie_q4_quotient(float v, float s, float y) {
    if (!(v <= 0x1p60f && v >= -0x1p60f) || !(y == y)) return BIE_FDIV(v, s);
    const float q0 = BIE_FMUL(v, y);
    const float q1 = BIE_FMAF(y, BIE_FMAF(-s, q0, v), q0);
    return BIE_FMAF(y, BIE_FMAF(-s, q1, v), q1);
}

/* Two's complement nibbles, two per byte, even index in the low nibble. */
static inline int8_t bie_nibble_get(const uint8_t *row, int64_t i) {
    int v = (row[i >> 1] >> ((i & 1) * 4)) & 15;
    return (int8_t)(v >= 8 ? v - 16 : v);
}
static inline int64_t bie_nibble_row_bytes(int64_t cols) { return (cols + 1) / 2; }

#endif
