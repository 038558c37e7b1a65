/* The contract between the CPU frame (packing, blocking, threads, epilogue) and the per-ISA
 * micro-kernels. A new ISA adds one folder under kernels/ and one line per kernel in
 * cpu/dispatch.c; layers never see this header.
 *
 * Two kinds of binary kernels:
 *  - a row kernel: popcount(a XOR b) of two packed rows of k valid bits, read in place
 *    (bytes past ceil(k / 8) are never read, invalid bits of the last byte are masked).
 *    The frame runs it over every (i, j) pair: the small-m path, which streams the packed
 *    weights once without repacking them.
 *  - a tile micro-kernel (BLIS style): accumulates popcount(a_i XOR b_j) for an mr x nr tile
 *    from panels packed by the frame in the kernel's layout, over `steps` k-steps. */
#ifndef BIE_CPU_KERNELS_H
#define BIE_CPU_KERNELS_H

#include <stdint.h>

typedef uint64_t (*bie_row_popc_fn)(const uint8_t *a, const uint8_t *b, int64_t k);

typedef enum bie_panel_layout {
    /* Each step holds step_bytes consecutive bytes of the bit stream per row. */
    BIE_PANEL_DENSE = 0,
    /* Each 32-byte chunk of the bit stream becomes two steps of 32 bytes: the low nibbles,
     * then the high nibbles (4 valid bits per byte), for nibble-table popcounts. */
    BIE_PANEL_NIBBLE32 = 1
} bie_panel_layout;

/* Writes a full mr x nr tile of results from panels laid out [step][row][step_bytes]
 * (64-byte aligned): c[i * ldc + j] = (float)(k - 2 * popcount(a_i XOR b_j)) * scale, the
 * epilogue every kernel shares (see bie_tile_store). */
typedef void (*bie_tile_fn)(int64_t steps, const uint8_t *a, const uint8_t *b, int64_t k,
                            float scale, float *c, int64_t ldc);

/* The exact dot product from a popcount, scaled once in float. */
static inline float bie_finish_dot(int64_t k, uint64_t popc, float scale) {
    return (float)(k - 2 * (int64_t)popc) * scale;
}

/* Scalar epilogue for kernels that collect their popcounts in memory. */
static inline void bie_tile_store(int mr, int nr, const uint64_t *popc, int64_t k, float scale,
                                  float *c, int64_t ldc) {
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) c[i * ldc + j] = bie_finish_dot(k, popc[i * nr + j], scale);
}

typedef struct bie_tile_kernel {
    int mr, nr;
    int step_bytes;
    bie_panel_layout layout;
    bie_tile_fn fn;
} bie_tile_kernel;

/* Row packing (layout in core/formats.h): sign bits of v = x[c] + bias[c] (bias may be
 * NULL) into dst[0 .. ceil(cols / 8)), and, when mask != NULL, the clip bits
 * 1{lo <= v / scale <= hi} in the same layout. Every ISA computes v, the division and the
 * comparisons exactly as the scalar version, so the bits are identical. */
typedef void (*bie_pack_f32_row_fn)(const float *x, const float *bias, int64_t cols, uint8_t *dst,
                                    uint8_t *mask, float scale, float lo, float hi);
/* Sign bits of int8 values (v >= 0 -> 1) into dst[0 .. ceil(cols / 8)). */
typedef void (*bie_pack_i8_row_fn)(const int8_t *x, int64_t cols, uint8_t *dst);

/* 4-bit codes q4(x[i], s) = clamp(rint(x[i] / s), -8, 7) (NaN -> 0), identical on every ISA. */
typedef void (*bie_q4_quantize_fn)(const float *x, int64_t n, float s, int8_t *out);
void bie_q4_quantize_generic(const float *x, int64_t n, float s, int8_t *out);
void bie_q4_quantize_avx2(const float *x, int64_t n, float s, int8_t *out);

void bie_pack_f32_row_generic(const float *x, const float *bias, int64_t cols, uint8_t *dst,
                              uint8_t *mask, float scale, float lo, float hi);
void bie_pack_i8_row_generic(const int8_t *x, int64_t cols, uint8_t *dst);
void bie_pack_f32_row_avx2(const float *x, const float *bias, int64_t cols, uint8_t *dst,
                           uint8_t *mask, float scale, float lo, float hi);
void bie_pack_i8_row_avx2(const int8_t *x, int64_t cols, uint8_t *dst);

/* Integer (4-bit codes held as int8) tile kernels share bie_tile_fn: panels hold int8 rows in
 * BIE_PANEL_DENSE layout (the frame packs them as bytes: k_bits = 8 * k) and the tile gets
 * c[i * ldc + j] = (float)dot(a_i, b_j) * scale, the exact int32 dot; `k` is unused.
 * Codes are in [-8, 7], so |products| <= 64 and 16-bit pair sums cannot saturate. */
extern const bie_tile_kernel bie_i8tile_generic_4x4;
extern const bie_tile_kernel bie_i8tile_avx2_3x2;
/* AVX-512 VNNI (needs avx512vnni besides the AVX-512 set). */
extern const bie_tile_kernel bie_i8tile_vnni_6x32;

/* Scalar reference (any CPU). */
uint64_t bie_row_popc_ref(const uint8_t *a, const uint8_t *b, int64_t k);
/* Portable C, 64-bit words. */
uint64_t bie_row_popc_generic(const uint8_t *a, const uint8_t *b, int64_t k);
extern const bie_tile_kernel bie_tile_generic_4x4;
/* AVX2 (nibble table popcount). */
uint64_t bie_row_popc_avx2(const uint8_t *a, const uint8_t *b, int64_t k);
extern const bie_tile_kernel bie_tile_avx2_4x2;
extern const bie_tile_kernel bie_tile_avx2_3x3;
/* AVX-512 with VPOPCNTDQ. */
uint64_t bie_row_popc_avx512(const uint8_t *a, const uint8_t *b, int64_t k);
extern const bie_tile_kernel bie_tile_avx512_4x4;
extern const bie_tile_kernel bie_tile_avx512_6x32;

/* Shared helper: popcount of XOR over bytes [from, nbytes) of two rows, last byte masked
 * by the tail of k. Used by the row kernels for their tails. */
static inline uint64_t bie_popc_tail(const uint8_t *a, const uint8_t *b, int64_t from, int64_t k) {
    int64_t nbytes = (k + 7) >> 3;
    uint64_t p = 0;
    int64_t i = from;
    for (; i + 8 <= nbytes - 1; i += 8) {
        uint64_t x, y;
        __builtin_memcpy(&x, a + i, 8);
        __builtin_memcpy(&y, b + i, 8);
        p += (uint64_t)__builtin_popcountll(x ^ y);
    }
    for (; i < nbytes; i++) {
        unsigned v = (unsigned)(a[i] ^ b[i]);
        if (i == nbytes - 1 && (k & 7)) v &= (1u << (k & 7)) - 1u;
        p += (uint64_t)__builtin_popcount(v);
    }
    return p;
}

#endif
