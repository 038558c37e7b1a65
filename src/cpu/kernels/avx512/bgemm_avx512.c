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

static void tile_avx512_4x4(int64_t steps, const uint8_t *a, const uint8_t *b, int64_t k,
                            float scale, float *c, int64_t ldc) {
    __m512i acc[4][4];
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) acc[i][j] = _mm512_setzero_si512();
    for (int64_t s = 0; s < steps; s++) {
        const uint8_t *as = a + s * 4 * 64, *bs = b + s * 4 * 64;
        __m512i av[4];
        for (int i = 0; i < 4; i++) av[i] = _mm512_load_si512((const void *)(as + i * 64));
        for (int j = 0; j < 4; j++) {
            __m512i bv = _mm512_load_si512((const void *)(bs + j * 64));
            for (int i = 0; i < 4; i++)
                acc[i][j] = _mm512_add_epi64(acc[i][j],
                                             _mm512_popcnt_epi64(_mm512_xor_si512(av[i], bv)));
        }
    }
    uint64_t popc[16];
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) popc[i * 4 + j] = (uint64_t)_mm512_reduce_add_epi64(acc[i][j]);
    bie_tile_store(4, 4, popc, k, scale, c, ldc);
}

const bie_tile_kernel bie_tile_avx512_4x4 = {4, 4, 64, BIE_PANEL_DENSE, tile_avx512_4x4};
