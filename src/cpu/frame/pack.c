#include "pack.h"

#include <string.h>

#include "../../core/internal.h"

void bie_pack_f32_rows(const float *x, int64_t rows, int64_t cols, int64_t ld, const float *bias,
                       uint8_t *dst, int64_t dst_row_bytes, uint8_t *mask, float scale, float lo,
                       float hi) {
#pragma omp parallel for num_threads(bie_threads()) schedule(static) if (rows * cols > 65536)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * ld;
        uint8_t *dr = dst + r * dst_row_bytes;
        uint8_t *mr = mask ? mask + r * dst_row_bytes : NULL;
        memset(dr, 0, (size_t)dst_row_bytes);
        if (mr) memset(mr, 0, (size_t)dst_row_bytes);
        for (int64_t c0 = 0; c0 < cols; c0 += 8) {
            int64_t end = c0 + 8 < cols ? c0 + 8 : cols;
            unsigned bits = 0, inr = 0;
            for (int64_t c = c0; c < end; c++) {
                float v = bias ? xr[c] + bias[c] : xr[c];
                bits |= (unsigned)(v >= 0.0f) << (c - c0);
                if (mr) {
                    float s = v / scale;
                    inr |= (unsigned)(s >= lo && s <= hi) << (c - c0);
                }
            }
            dr[c0 >> 3] = (uint8_t)bits;
            if (mr) mr[c0 >> 3] = (uint8_t)inr;
        }
    }
}

void bie_pack_i8_rows(const int8_t *x, int64_t rows, int64_t cols, uint8_t *dst,
                      int64_t dst_row_bytes) {
#pragma omp parallel for num_threads(bie_threads()) schedule(static) if (rows * cols > 65536)
    for (int64_t r = 0; r < rows; r++) {
        const int8_t *xr = x + r * cols;
        uint8_t *dr = dst + r * dst_row_bytes;
        memset(dr, 0, (size_t)dst_row_bytes);
        for (int64_t c = 0; c < cols; c++) dr[c >> 3] |= (uint8_t)((xr[c] >= 0) << (c & 7));
    }
}

void bie_unpack_rows_f32(const uint8_t *src, int64_t src_row_bytes, int64_t rows, int64_t cols,
                         float value, float *dst) {
#pragma omp parallel for num_threads(bie_threads()) schedule(static) if (rows * cols > 65536)
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *sr = src + r * src_row_bytes;
        float *d = dst + r * cols;
        for (int64_t c = 0; c < cols; c++) d[c] = bie_bit(sr, c) ? value : -value;
    }
}
