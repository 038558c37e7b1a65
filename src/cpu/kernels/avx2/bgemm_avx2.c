/* AVX2 binary kernels. Popcounts use a 16-entry nibble table (vpshufb): the frame packs
 * panels as separate low- and high-nibble steps (BIE_PANEL_NIBBLE32), so a step costs one
 * XOR, one shuffle and one byte add per tile element. Byte counters take at most 4 per step
 * and are widened (vpsadbw) every 63 steps, before they could overflow. */
#include <immintrin.h>

#include "../../../core/formats.h"
#include "../kernels.h"

#define NIBBLE_LUT                                                                                 \
    _mm256_setr_epi8(0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4, 0, 1, 1, 2, 1, 2, 2, 3, 1, 2, \
                     2, 3, 2, 3, 3, 4)

static inline uint64_t hsum_epi64(__m256i v) {
    __m128i s = _mm_add_epi64(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    return (uint64_t)_mm_cvtsi128_si64(s) + (uint64_t)_mm_extract_epi64(s, 1);
}

/* Popcount of the 32 bytes of v, as four 64-bit partial sums. */
static inline __m256i popc_bytes(__m256i v, __m256i lut, __m256i low4) {
    __m256i lo = _mm256_shuffle_epi8(lut, _mm256_and_si256(v, low4));
    __m256i hi = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(v, 4), low4));
    return _mm256_sad_epu8(_mm256_add_epi8(lo, hi), _mm256_setzero_si256());
}

uint64_t bie_row_popc_avx2(const uint8_t *a, const uint8_t *b, int64_t k) {
    const __m256i lut = NIBBLE_LUT, low4 = _mm256_set1_epi8(0x0f);
    int64_t nbytes = (k + 7) >> 3;
    __m256i total = _mm256_setzero_si256();
    int64_t i = 0;
    /* Full 32-byte chunks that stop before the last byte (which may need masking). */
    for (; i + 32 <= nbytes - 1; i += 32) {
        __m256i x = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(a + i)),
                                     _mm256_loadu_si256((const __m256i *)(b + i)));
        total = _mm256_add_epi64(total, popc_bytes(x, lut, low4));
    }
    return hsum_epi64(total) + bie_popc_tail(a, b, i, k);
}

/* The tile kernels are written in inline assembly: GCC's register allocation of the
 * intrinsics version spilled accumulators and added register copies, doubling the
 * instructions of the inner loop. Each pair (i, j) of a step costs exactly
 * vpxor + vpshufb + vpaddb. */
#define PAIR(A, C)                    \
    "vpxor %[" A "], %[bv], %[t]\n\t" \
    "vpshufb %[t], %[lut], %[t]\n\t"  \
    "vpaddb %[t], %[" C "], %[" C "]\n\t"

/* [sum of v0's lanes, v1's, v2's, v3's] for vectors of four 64-bit partial sums. */
static inline __m256i reduce4(__m256i v0, __m256i v1, __m256i v2, __m256i v3) {
    __m256i s01 = _mm256_add_epi64(_mm256_unpacklo_epi64(v0, v1), _mm256_unpackhi_epi64(v0, v1));
    __m256i s23 = _mm256_add_epi64(_mm256_unpacklo_epi64(v2, v3), _mm256_unpackhi_epi64(v2, v3));
    return _mm256_add_epi64(_mm256_permute2x128_si256(s01, s23, 0x20),
                            _mm256_permute2x128_si256(s01, s23, 0x31));
}

/* Four popcounts (64-bit lanes, < 2^31) to (float)(k - 2 popc) * scale. */
static inline __m128 finish4(__m256i popc, int64_t k, float scale) {
    __m128i p = _mm256_castsi256_si128(
        _mm256_permutevar8x32_epi32(popc, _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6)));
    __m128i dot = _mm_sub_epi32(_mm_set1_epi32((int)k), _mm_slli_epi32(p, 1));
    return _mm_mul_ps(_mm_cvtepi32_ps(dot), _mm_set1_ps(scale));
}

/* n (1..63) steps of the 4x2 tile; sums[] gets each element's 64-bit partial sums, column 0
 * rows 0..3 then column 1. */
static inline __attribute__((always_inline)) void block_4x2(int64_t n, const uint8_t *ap,
                                                            const uint8_t *bp, __m256i *sums) {
    const __m256i lut = NIBBLE_LUT, zero = _mm256_setzero_si256();
    __m256i c00 = zero, c10 = zero, c20 = zero, c30 = zero;
    __m256i c01 = zero, c11 = zero, c21 = zero, c31 = zero;
    __m256i a0, a1, a2, a3, bv, t;
    __asm__ volatile(
        "1:\n\t"
        "vmovdqa (%[ap]), %[a0]\n\t"
        "vmovdqa 32(%[ap]), %[a1]\n\t"
        "vmovdqa 64(%[ap]), %[a2]\n\t"
        "vmovdqa 96(%[ap]), %[a3]\n\t"
        "vmovdqa (%[bp]), %[bv]\n\t" PAIR("a0", "c00") PAIR("a1", "c10") PAIR("a2", "c20")
            PAIR("a3", "c30") "vmovdqa 32(%[bp]), %[bv]\n\t" PAIR("a0", "c01") PAIR("a1", "c11")
                PAIR("a2", "c21") PAIR("a3", "c31") "add $128, %[ap]\n\t"
                                                    "add $64, %[bp]\n\t"
                                                    "dec %[n]\n\t"
                                                    "jnz 1b\n\t"
        : [c00] "+x"(c00), [c10] "+x"(c10), [c20] "+x"(c20), [c30] "+x"(c30), [c01] "+x"(c01),
          [c11] "+x"(c11), [c21] "+x"(c21), [c31] "+x"(c31), [a0] "=&x"(a0), [a1] "=&x"(a1),
          [a2] "=&x"(a2), [a3] "=&x"(a3), [bv] "=&x"(bv), [t] "=&x"(t), [ap] "+r"(ap),
          [bp] "+r"(bp), [n] "+r"(n)
        : [lut] "x"(lut)
        : "cc", "memory");
    sums[0] = _mm256_sad_epu8(c00, zero);
    sums[1] = _mm256_sad_epu8(c10, zero);
    sums[2] = _mm256_sad_epu8(c20, zero);
    sums[3] = _mm256_sad_epu8(c30, zero);
    sums[4] = _mm256_sad_epu8(c01, zero);
    sums[5] = _mm256_sad_epu8(c11, zero);
    sums[6] = _mm256_sad_epu8(c21, zero);
    sums[7] = _mm256_sad_epu8(c31, zero);
}

static void tile_avx2_4x2(int64_t steps, const uint8_t *a, const uint8_t *b, int64_t k, float scale,
                          float *c, int64_t ldc) {
    __m256i wide[8], more[8];
    block_4x2(steps < 63 ? steps : 63, a, b, wide);
    for (int64_t s0 = 63; s0 < steps; s0 += 63) { /* k > 8064: widen every 63 steps */
        block_4x2(steps - s0 < 63 ? steps - s0 : 63, a + s0 * 4 * 32, b + s0 * 2 * 32, more);
        for (int u = 0; u < 8; u++) wide[u] = _mm256_add_epi64(wide[u], more[u]);
    }
    __m128 col0 = finish4(reduce4(wide[0], wide[1], wide[2], wide[3]), k, scale);
    __m128 col1 = finish4(reduce4(wide[4], wide[5], wide[6], wide[7]), k, scale);
    __m128 rows01 = _mm_unpacklo_ps(col0, col1), rows23 = _mm_unpackhi_ps(col0, col1);
    _mm_storel_pi((__m64 *)c, rows01);
    _mm_storeh_pi((__m64 *)(c + ldc), rows01);
    _mm_storel_pi((__m64 *)(c + 2 * ldc), rows23);
    _mm_storeh_pi((__m64 *)(c + 3 * ldc), rows23);
}

static void tile_avx2_3x3(int64_t steps, const uint8_t *a, const uint8_t *b, int64_t k, float scale,
                          float *c, int64_t ldc) {
    const __m256i lut = NIBBLE_LUT;
    uint64_t total[9] = {0};
    for (int64_t s0 = 0; s0 < steps; s0 += 63) {
        int64_t n = steps - s0 < 63 ? steps - s0 : 63;
        const uint8_t *ap = a + s0 * 3 * 32, *bp = b + s0 * 3 * 32;
        __m256i c00 = _mm256_setzero_si256(), c01 = c00, c02 = c00, c10 = c00, c11 = c00;
        __m256i c12 = c00, c20 = c00, c21 = c00, c22 = c00;
        __m256i a0, a1, a2, bv, t;
        __asm__ volatile(
            "1:\n\t"
            "vmovdqa (%[ap]), %[a0]\n\t"
            "vmovdqa 32(%[ap]), %[a1]\n\t"
            "vmovdqa 64(%[ap]), %[a2]\n\t"
            "vmovdqa (%[bp]), %[bv]\n\t" PAIR("a0", "c00") PAIR("a1", "c10")
                PAIR("a2", "c20") "vmovdqa 32(%[bp]), %[bv]\n\t" PAIR("a0", "c01") PAIR("a1", "c11")
                    PAIR("a2", "c21") "vmovdqa 64(%[bp]), %[bv]\n\t" PAIR("a0", "c02")
                        PAIR("a1", "c12") PAIR("a2", "c22") "add $96, %[ap]\n\t"
                                                            "add $96, %[bp]\n\t"
                                                            "dec %[n]\n\t"
                                                            "jnz 1b\n\t"
            : [c00] "+x"(c00), [c01] "+x"(c01), [c02] "+x"(c02), [c10] "+x"(c10), [c11] "+x"(c11),
              [c12] "+x"(c12), [c20] "+x"(c20), [c21] "+x"(c21), [c22] "+x"(c22), [a0] "=&x"(a0),
              [a1] "=&x"(a1), [a2] "=&x"(a2), [bv] "=&x"(bv), [t] "=&x"(t), [ap] "+r"(ap),
              [bp] "+r"(bp), [n] "+r"(n)
            : [lut] "x"(lut)
            : "cc", "memory");
        const __m256i acc[9] = {c00, c01, c02, c10, c11, c12, c20, c21, c22};
        for (int u = 0; u < 9; u++)
            total[u] += hsum_epi64(_mm256_sad_epu8(acc[u], _mm256_setzero_si256()));
    }
    bie_tile_store(3, 3, total, k, scale, c, ldc);
}

const bie_tile_kernel bie_tile_avx2_4x2 = {4, 2, 32, BIE_PANEL_NIBBLE32, tile_avx2_4x2};
const bie_tile_kernel bie_tile_avx2_3x3 = {3, 3, 32, BIE_PANEL_NIBBLE32, tile_avx2_3x3};

/* Packing with compare + movemask: 8 floats or 32 int8 per instruction pair. The last
 * partial byte goes through the generic code, which computes the same bits. */
void bie_pack_f32_row_avx2(const float *x, const float *bias, int64_t cols, uint8_t *dst,
                           uint8_t *mask, float scale, float lo, float hi) {
    const __m256 zero = _mm256_setzero_ps(), vs = _mm256_set1_ps(scale);
    const __m256 vlo = _mm256_set1_ps(lo), vhi = _mm256_set1_ps(hi);
    int64_t c = 0;
    for (; c + 8 <= cols; c += 8) {
        __m256 v = _mm256_loadu_ps(x + c);
        if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + c));
        dst[c >> 3] = (uint8_t)_mm256_movemask_ps(_mm256_cmp_ps(v, zero, _CMP_GE_OQ));
        if (mask) {
            __m256 q = _mm256_div_ps(v, vs);
            __m256 in =
                _mm256_and_ps(_mm256_cmp_ps(q, vlo, _CMP_GE_OQ), _mm256_cmp_ps(q, vhi, _CMP_LE_OQ));
            mask[c >> 3] = (uint8_t)_mm256_movemask_ps(in);
        }
    }
    if (c < cols)
        bie_pack_f32_row_generic(x + c, bias ? bias + c : NULL, cols - c, dst + (c >> 3),
                                 mask ? mask + (c >> 3) : NULL, scale, lo, hi);
}

void bie_pack_i8_row_avx2(const int8_t *x, int64_t cols, uint8_t *dst) {
    int64_t c = 0;
    for (; c + 32 <= cols; c += 32) {
        uint32_t negative =
            (uint32_t)_mm256_movemask_epi8(_mm256_loadu_si256((const __m256i *)(x + c)));
        uint32_t bits = ~negative; /* bit i of the word is element c + i */
        __builtin_memcpy(dst + (c >> 3), &bits, 4);
    }
    if (c < cols) bie_pack_i8_row_generic(x + c, cols - c, dst + (c >> 3));
}

/* 4-bit GEMM (codes as int8). With a' = a + 8 in [0, 15] (unsigned), vpmaddubsw multiplies
 * a' by b directly: dot(a, b) = dot(a', b) - 8 sum(b). Pair sums lie in [-240, 210], so the
 * 16-bit accumulators take 128 steps (32 codes each) before they are widened (vpmaddwd);
 * sum(b) is accumulated the same way. Per tile element and step: one vpmaddubsw, one add. */
static inline __m256i widen_add(__m256i acc32, __m256i acc16) {
    return _mm256_add_epi32(acc32, _mm256_madd_epi16(acc16, _mm256_set1_epi16(1)));
}

static inline int32_t hsum_epi32(__m256i v) {
    __m128i x = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0x4e));
    x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0xb1));
    return _mm_cvtsi128_si32(x);
}

/* n (1..128) steps of the 3x2 4-bit tile in registers (the intrinsics version spilled two
 * accumulators): acc gets the 16-bit sums of row i x column j, bacc the column sums. */
static inline __attribute__((always_inline)) void block_i8_3x2(int64_t n, const uint8_t *ap,
                                                               const uint8_t *bp, __m256i *acc,
                                                               __m256i *bacc) {
    const __m256i eight = _mm256_set1_epi8(8), ones8 = _mm256_set1_epi8(1);
    __m256i c00 = _mm256_setzero_si256(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m256i s0 = c00, s1 = c00, av, b0, b1, t;
    __asm__ volatile(
        "1:\n\t"
        "vmovdqa (%[bp]), %[b0]\n\t"
        "vmovdqa 32(%[bp]), %[b1]\n\t"
        "vpmaddubsw %[b0], %[ones], %[t]\n\t"
        "vpaddw %[t], %[s0], %[s0]\n\t"
        "vpmaddubsw %[b1], %[ones], %[t]\n\t"
        "vpaddw %[t], %[s1], %[s1]\n\t"
        "vpaddb (%[ap]), %[eight], %[av]\n\t"
        "vpmaddubsw %[b0], %[av], %[t]\n\t"
        "vpaddw %[t], %[c00], %[c00]\n\t"
        "vpmaddubsw %[b1], %[av], %[t]\n\t"
        "vpaddw %[t], %[c01], %[c01]\n\t"
        "vpaddb 32(%[ap]), %[eight], %[av]\n\t"
        "vpmaddubsw %[b0], %[av], %[t]\n\t"
        "vpaddw %[t], %[c10], %[c10]\n\t"
        "vpmaddubsw %[b1], %[av], %[t]\n\t"
        "vpaddw %[t], %[c11], %[c11]\n\t"
        "vpaddb 64(%[ap]), %[eight], %[av]\n\t"
        "vpmaddubsw %[b0], %[av], %[t]\n\t"
        "vpaddw %[t], %[c20], %[c20]\n\t"
        "vpmaddubsw %[b1], %[av], %[t]\n\t"
        "vpaddw %[t], %[c21], %[c21]\n\t"
        "add $96, %[ap]\n\t"
        "add $64, %[bp]\n\t"
        "dec %[n]\n\t"
        "jnz 1b\n\t"
        : [c00] "+x"(c00), [c01] "+x"(c01), [c10] "+x"(c10), [c11] "+x"(c11), [c20] "+x"(c20),
          [c21] "+x"(c21), [s0] "+x"(s0), [s1] "+x"(s1), [av] "=&x"(av), [b0] "=&x"(b0),
          [b1] "=&x"(b1), [t] "=&x"(t), [ap] "+r"(ap), [bp] "+r"(bp), [n] "+r"(n)
        : [eight] "x"(eight), [ones] "x"(ones8)
        : "cc", "memory");
    acc[0] = c00, acc[1] = c01, acc[2] = c10, acc[3] = c11, acc[4] = c20, acc[5] = c21;
    bacc[0] = s0, bacc[1] = s1;
}

static void i8tile_avx2_3x2(int64_t steps, const uint8_t *a, const uint8_t *b, int64_t k,
                            float scale, float *c, int64_t ldc) {
    (void)k;
    __m256i wide[6], bsum[2], acc[6], bacc[2];
    for (int t = 0; t < 6; t++) wide[t] = _mm256_setzero_si256();
    bsum[0] = bsum[1] = _mm256_setzero_si256();
    for (int64_t s0 = 0; s0 < steps; s0 += 128) {
        int64_t n = steps - s0 < 128 ? steps - s0 : 128;
        block_i8_3x2(n, a + s0 * 3 * 32, b + s0 * 2 * 32, acc, bacc);
        for (int t = 0; t < 6; t++) wide[t] = widen_add(wide[t], acc[t]);
        for (int j = 0; j < 2; j++) bsum[j] = widen_add(bsum[j], bacc[j]);
    }
    for (int j = 0; j < 2; j++) {
        int32_t sb = hsum_epi32(bsum[j]);
        for (int i = 0; i < 3; i++)
            c[i * ldc + j] = (float)(hsum_epi32(wide[i * 2 + j]) - 8 * sb) * scale;
    }
}

const bie_tile_kernel bie_i8tile_avx2_3x2 = {3, 2, 32, BIE_PANEL_DENSE, i8tile_avx2_3x2};

/* q4 of 8 floats at a time: the same IEEE division and round-half-to-even as the scalar
 * code, clamped, NaN mapped to 0, narrowed to int8. */
void bie_q4_quantize_avx2(const float *x, int64_t n, float s, int8_t *out) {
    const __m256 vs = _mm256_set1_ps(s), lo = _mm256_set1_ps(-8.0f), hi = _mm256_set1_ps(7.0f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 q = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), vs),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m256 ordered = _mm256_cmp_ps(q, q, _CMP_ORD_Q);
        q = _mm256_and_ps(_mm256_min_ps(_mm256_max_ps(q, lo), hi), ordered);
        __m256i v = _mm256_cvtps_epi32(q);
        __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        _mm_storel_epi64((__m128i *)(out + i), _mm_packs_epi16(w, w));
    }
    for (; i < n; i++) out[i] = bie_q4(x[i], s);
}
