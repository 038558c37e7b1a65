/* AVX-512 binary kernels with VPOPCNTDQ: XOR, 64-bit popcount and add per 512 bits. */
#include <immintrin.h>

#include "../kernels.h"

uint64_t bie_row_popc_avx512(const uint8_t *a, const uint8_t *b, int64_t k) {
    int64_t nbytes = (k + 7) >> 3;
    __m512i total = _mm512_setzero_si512();
    int64_t i = 0;
    for (; i + 64 <= nbytes - 1; i += 64) {
        __m512i x = _mm512_xor_si512(_mm512_loadu_si512((const void *)(a + i)),
                                     _mm512_loadu_si512((const void *)(b + i)));
        total = _mm512_add_epi64(total, _mm512_popcnt_epi64(x));
    }
    return (uint64_t)_mm512_reduce_add_epi64(total) + bie_popc_tail(a, b, i, k);
}

/* [sum of v[0]'s lanes, ..., sum of v[7]'s] for eight vectors of 64-bit partial sums. */
static inline __m512i reduce8(const __m512i *v) {
    __m512i a[4];
    for (int p = 0; p < 4; p++)
        a[p] = _mm512_add_epi64(_mm512_unpacklo_epi64(v[2 * p], v[2 * p + 1]),
                                _mm512_unpackhi_epi64(v[2 * p], v[2 * p + 1]));
    __m512i b0 = _mm512_add_epi64(_mm512_shuffle_i64x2(a[0], a[1], 0x88),
                                  _mm512_shuffle_i64x2(a[0], a[1], 0xDD));
    __m512i b1 = _mm512_add_epi64(_mm512_shuffle_i64x2(a[2], a[3], 0x88),
                                  _mm512_shuffle_i64x2(a[2], a[3], 0xDD));
    return _mm512_add_epi64(_mm512_shuffle_i64x2(b0, b1, 0x88), _mm512_shuffle_i64x2(b0, b1, 0xDD));
}

/* Two tile rows (eight popcounts, < 2^31) to (float)(k - 2 popc) * scale, stored. */
static inline void finish_rows(__m512i popc, int64_t k, float scale, float *c0, float *c1) {
    __m256i p = _mm512_cvtepi64_epi32(popc);
    __m256i dot = _mm256_sub_epi32(_mm256_set1_epi32((int)k), _mm256_slli_epi32(p, 1));
    __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(scale));
    _mm_storeu_ps(c0, _mm256_castps256_ps128(f));
    _mm_storeu_ps(c1, _mm256_extractf128_ps(f, 1));
}

static void tile_avx512_4x4(int64_t steps, const uint8_t *a, const uint8_t *b, int64_t k,
                            float scale, float *c, int64_t ldc) {
    __m512i acc[16]; /* row-major: acc[i * 4 + j] */
    for (int t = 0; t < 16; t++) acc[t] = _mm512_setzero_si512();
    for (int64_t s = 0; s < steps; s++) {
        const uint8_t *as = a + s * 4 * 64, *bs = b + s * 4 * 64;
        __m512i av[4];
        for (int i = 0; i < 4; i++) av[i] = _mm512_load_si512((const void *)(as + i * 64));
        for (int j = 0; j < 4; j++) {
            __m512i bv = _mm512_load_si512((const void *)(bs + j * 64));
            for (int i = 0; i < 4; i++)
                acc[i * 4 + j] = _mm512_add_epi64(acc[i * 4 + j],
                                                  _mm512_popcnt_epi64(_mm512_xor_si512(av[i], bv)));
        }
    }
    finish_rows(reduce8(acc), k, scale, c, c + ldc);
    finish_rows(reduce8(acc + 8), k, scale, c + 2 * ldc, c + 3 * ldc);
}

/* Outer-product form: each 64-bit lane holds a different output. A step is one 64-bit word
 * of k: a row's word is broadcast and XORed against 8 columns' words at once, so the
 * popcounts land in per-output lanes and the epilogue needs no horizontal sums. 6 rows x
 * 32 columns: 24 accumulators + 4 column vectors + broadcast + temporary = 30 registers. */
static void tile_avx512_6x32(int64_t steps, const uint8_t *a, const uint8_t *b, int64_t k,
                             float scale, float *c, int64_t ldc) {
    __m512i acc[6][4];
    for (int i = 0; i < 6; i++)
        for (int j = 0; j < 4; j++) acc[i][j] = _mm512_setzero_si512();
    for (int64_t s = 0; s < steps; s++) {
        const uint64_t *as = (const uint64_t *)(a + s * 6 * 8);
        const uint8_t *bs = b + s * 32 * 8;
        __m512i bv[4];
        for (int j = 0; j < 4; j++) bv[j] = _mm512_load_si512((const void *)(bs + j * 64));
        for (int i = 0; i < 6; i++) {
            __m512i av = _mm512_set1_epi64((long long)as[i]);
            for (int j = 0; j < 4; j++)
                acc[i][j] =
                    _mm512_add_epi64(acc[i][j], _mm512_popcnt_epi64(_mm512_xor_si512(av, bv[j])));
        }
    }
    const __m256i vk = _mm256_set1_epi32((int)k);
    const __m256 vs = _mm256_set1_ps(scale);
    for (int i = 0; i < 6; i++)
        for (int j = 0; j < 4; j++) {
            __m256i p = _mm512_cvtepi64_epi32(acc[i][j]);
            __m256i dot = _mm256_sub_epi32(vk, _mm256_slli_epi32(p, 1));
            _mm256_storeu_ps(c + i * ldc + j * 8, _mm256_mul_ps(_mm256_cvtepi32_ps(dot), vs));
        }
}

const bie_tile_kernel bie_tile_avx512_4x4 = {4, 4, 64, BIE_PANEL_DENSE, tile_avx512_4x4};
const bie_tile_kernel bie_tile_avx512_6x32 = {6, 32, 8, BIE_PANEL_DENSE, tile_avx512_6x32};

/* 4-bit GEMM with AVX-512 VNNI, outer-product form: a step is 4 codes of k; a row's 4 codes
 * (shifted to unsigned, a + 8) are broadcast to every 32-bit lane and vpdpbusd multiplies
 * them with 16 columns' 4 codes at once, each lane accumulating its own output exactly.
 * The shift is removed with the column sums: dot = dot(a + 8, b) - 8 sum(b). */
static void i8tile_vnni_6x32(int64_t steps, const uint8_t *a, const uint8_t *b, int64_t k,
                             float scale, float *c, int64_t ldc) {
    (void)k;
    const __m512i eight = _mm512_set1_epi8(8), ones = _mm512_set1_epi8(1);
    __m512i acc[6][2], bsum[2];
    for (int j = 0; j < 2; j++) {
        bsum[j] = _mm512_setzero_si512();
        for (int i = 0; i < 6; i++) acc[i][j] = _mm512_setzero_si512();
    }
    for (int64_t s = 0; s < steps; s++) {
        const uint8_t *as = a + s * 6 * 4, *bs = b + s * 32 * 4;
        __m512i b0 = _mm512_load_si512((const void *)bs),
                b1 = _mm512_load_si512((const void *)(bs + 64));
        bsum[0] = _mm512_dpbusd_epi32(bsum[0], ones, b0);
        bsum[1] = _mm512_dpbusd_epi32(bsum[1], ones, b1);
        for (int i = 0; i < 6; i++) {
            int32_t word;
            __builtin_memcpy(&word, as + i * 4, 4);
            __m512i ua = _mm512_add_epi8(_mm512_set1_epi32(word), eight);
            acc[i][0] = _mm512_dpbusd_epi32(acc[i][0], ua, b0);
            acc[i][1] = _mm512_dpbusd_epi32(acc[i][1], ua, b1);
        }
    }
    const __m512 vs = _mm512_set1_ps(scale);
    for (int j = 0; j < 2; j++) {
        __m512i corr = _mm512_slli_epi32(bsum[j], 3);
        for (int i = 0; i < 6; i++)
            _mm512_storeu_ps(
                c + i * ldc + j * 16,
                _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i][j], corr)), vs));
    }
}

const bie_tile_kernel bie_i8tile_vnni_6x32 = {6, 32, 4, BIE_PANEL_DENSE, i8tile_vnni_6x32};
