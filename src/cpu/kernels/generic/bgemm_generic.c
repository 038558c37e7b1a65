/* Reference and portable binary kernels: plain C, any CPU. */
#include "../../../core/formats.h"
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
            for (int j = 0; j < 4; j++)
                acc[i * 4 + j] += (uint64_t)__builtin_popcountll(as[i] ^ bs[j]);
    }
    bie_tile_store(4, 4, acc, k, scale, c, ldc);
}

const bie_tile_kernel bie_tile_generic_4x4 = {4, 4, 8, BIE_PANEL_DENSE, tile_generic_4x4};

/* Bits for elements [c0, end) of a row, one byte (8 elements) at a time. */
void bie_pack_f32_row_generic(const float *x, const float *bias, int64_t cols, uint8_t *dst,
                              uint8_t *mask, float scale, float lo, float hi) {
    for (int64_t c0 = 0; c0 < cols; c0 += 8) {
        int64_t end = c0 + 8 < cols ? c0 + 8 : cols;
        unsigned bits = 0, inr = 0;
        for (int64_t c = c0; c < end; c++) {
            float v = bias ? x[c] + bias[c] : x[c];
            bits |= (unsigned)(v >= 0.0f) << (c - c0);
            if (mask) {
                float q = v / scale;
                inr |= (unsigned)(q >= lo && q <= hi) << (c - c0);
            }
        }
        dst[c0 >> 3] = (uint8_t)bits;
        if (mask) mask[c0 >> 3] = (uint8_t)inr;
    }
}

void bie_pack_i8_row_generic(const int8_t *x, int64_t cols, uint8_t *dst) {
    for (int64_t c0 = 0; c0 < cols; c0 += 8) {
        int64_t end = c0 + 8 < cols ? c0 + 8 : cols;
        unsigned bits = 0;
        for (int64_t c = c0; c < end; c++) bits |= (unsigned)(x[c] >= 0) << (c - c0);
        dst[c0 >> 3] = (uint8_t)bits;
    }
}

/* 4-bit GEMM (codes as int8), plain C: the reference and portable tier. */
static void i8tile_generic_4x4(int64_t steps, const uint8_t *a, const uint8_t *b, int64_t k,
                               float scale, float *c, int64_t ldc) {
    (void)k;
    int32_t acc[16] = {0};
    for (int64_t s = 0; s < steps; s++) {
        const int8_t *as = (const int8_t *)(a + s * 4 * 32), *bs = (const int8_t *)(b + s * 4 * 32);
        for (int i = 0; i < 4; i++)
            for (int j = 0; j < 4; j++)
                for (int e = 0; e < 32; e++) acc[i * 4 + j] += as[i * 32 + e] * bs[j * 32 + e];
    }
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) c[i * ldc + j] = (float)acc[i * 4 + j] * scale;
}

const bie_tile_kernel bie_i8tile_generic_4x4 = {4, 4, 32, BIE_PANEL_DENSE, i8tile_generic_4x4};

void bie_q4_quantize_generic(const float *x, int64_t n, float s, int8_t *out) {
    for (int64_t i = 0; i < n; i++) out[i] = bie_q4(x[i], s);
}
