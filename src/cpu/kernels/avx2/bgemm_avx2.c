/* AVX2 binary kernels. Popcounts use a 16-entry nibble table (vpshufb): the frame packs
 * panels as separate low- and high-nibble steps (BIE_PANEL_NIBBLE32), so a step costs one
 * XOR, one shuffle and one byte add per tile element. Byte counters take at most 4 per step
 * and are widened (vpsadbw) every 63 steps, before they could overflow. */
#include <immintrin.h>

#include "../kernels.h"

#define NIBBLE_LUT _mm256_setr_epi8(0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4, \
                                    0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4)

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

/* mr x nr tile over nibble panels; mr and nr are constants after inlining. */
static inline __attribute__((always_inline)) void
tile_nibble(int mr, int nr, int64_t steps, const uint8_t *a, const uint8_t *b, uint32_t *popc) {
    const __m256i lut = NIBBLE_LUT;
    __m256i wide[4][4];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) wide[i][j] = _mm256_setzero_si256();
    for (int64_t s0 = 0; s0 < steps; s0 += 63) {
        int64_t s1 = s0 + 63 < steps ? s0 + 63 : steps;
        __m256i acc[4][4];
        for (int i = 0; i < mr; i++)
            for (int j = 0; j < nr; j++) acc[i][j] = _mm256_setzero_si256();
        for (int64_t s = s0; s < s1; s++) {
            const __m256i *as = (const __m256i *)(a + s * mr * 32);
            const __m256i *bs = (const __m256i *)(b + s * nr * 32);
            __m256i av[4];
            for (int i = 0; i < mr; i++) av[i] = _mm256_load_si256(as + i);
            for (int j = 0; j < nr; j++) {
                __m256i bv = _mm256_load_si256(bs + j);
                for (int i = 0; i < mr; i++)
                    acc[i][j] = _mm256_add_epi8(
                        acc[i][j], _mm256_shuffle_epi8(lut, _mm256_xor_si256(av[i], bv)));
            }
        }
        for (int i = 0; i < mr; i++)
            for (int j = 0; j < nr; j++)
                wide[i][j] = _mm256_add_epi64(wide[i][j],
                                              _mm256_sad_epu8(acc[i][j], _mm256_setzero_si256()));
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) popc[i * nr + j] = (uint32_t)hsum_epi64(wide[i][j]);
}

static void tile_avx2_4x2(int64_t steps, const uint8_t *a, const uint8_t *b, uint32_t *popc) {
    tile_nibble(4, 2, steps, a, b, popc);
}

static void tile_avx2_3x3(int64_t steps, const uint8_t *a, const uint8_t *b, uint32_t *popc) {
    tile_nibble(3, 3, steps, a, b, popc);
}

const bie_tile_kernel bie_tile_avx2_4x2 = {4, 2, 32, BIE_PANEL_NIBBLE32, tile_avx2_4x2};
const bie_tile_kernel bie_tile_avx2_3x3 = {3, 3, 32, BIE_PANEL_NIBBLE32, tile_avx2_3x3};
