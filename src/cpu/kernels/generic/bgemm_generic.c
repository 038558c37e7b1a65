/* Reference and portable binary kernels: plain C, any CPU. */
#include "../kernels.h"

uint64_t bie_row_popc_ref(const uint8_t *a, const uint8_t *b, int64_t k) {
    uint64_t p = 0;
    for (int64_t c = 0; c < k; c++) p += (uint64_t)(((a[c >> 3] ^ b[c >> 3]) >> (c & 7)) & 1);
    return p;
}

uint64_t bie_row_popc_generic(const uint8_t *a, const uint8_t *b, int64_t k) {
    return bie_popc_tail(a, b, 0, k);
}

static void tile_generic_4x4(int64_t steps, const uint8_t *a, const uint8_t *b, int64_t k,
                             float scale, float *c, int64_t ldc) {
    uint64_t acc[16] = {0};
    for (int64_t s = 0; s < steps; s++) {
        const uint64_t *as = (const uint64_t *)(a + s * 32);
        const uint64_t *bs = (const uint64_t *)(b + s * 32);
        for (int i = 0; i < 4; i++)
            for (int j = 0; j < 4; j++) acc[i * 4 + j] += (uint64_t)__builtin_popcountll(as[i] ^ bs[j]);
    }
    bie_tile_store(4, 4, acc, k, scale, c, ldc);
}

const bie_tile_kernel bie_tile_generic_4x4 = {4, 4, 8, BIE_PANEL_DENSE, tile_generic_4x4};
