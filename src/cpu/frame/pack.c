#include "pack.h"

#include <string.h>

#include "../../core/internal.h"
#include "../dispatch.h"

void bie_pack_f32_rows(const float *x, int64_t rows, int64_t cols, int64_t ld, const float *bias,
                       uint8_t *dst, int64_t dst_row_bytes, uint8_t *mask, float scale, float lo,
                       float hi) {
    const bie_pack_f32_row_fn pack = bie_cpu_pack().f32;
#pragma omp parallel for num_threads(bie_threads()) schedule(static) if (rows * cols > 65536)
    for (int64_t r = 0; r < rows; r++) {
        uint8_t *dr = dst + r * dst_row_bytes;
        uint8_t *mr = mask ? mask + r * dst_row_bytes : NULL;
        memset(dr, 0, (size_t)dst_row_bytes);
        if (mr) memset(mr, 0, (size_t)dst_row_bytes);
        pack(x + r * ld, bias, cols, dr, mr, scale, lo, hi);
    }
}

void bie_pack_i8_rows(const int8_t *x, int64_t rows, int64_t cols, uint8_t *dst,
                      int64_t dst_row_bytes) {
    const bie_pack_i8_row_fn pack = bie_cpu_pack().i8;
#pragma omp parallel for num_threads(bie_threads()) schedule(static) if (rows * cols > 65536)
    for (int64_t r = 0; r < rows; r++) {
        uint8_t *dr = dst + r * dst_row_bytes;
        memset(dr, 0, (size_t)dst_row_bytes);
        pack(x + r * cols, cols, dr);
    }
}

void bie_unpack_rows_f32(const uint8_t *src, int64_t src_row_bytes, int64_t rows, int64_t cols,
                         float value, float *dst) {
    /* whole bytes through a table of the 256 patterns, the tail bit by bit */
    float lut[256][8];
    for (int b = 0; b < 256; b++)
        for (int t = 0; t < 8; t++) lut[b][t] = (b >> t) & 1 ? value : -value;
#pragma omp parallel for num_threads(bie_threads()) schedule(static) if (rows * cols > 65536)
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *sr = src + r * src_row_bytes;
        float *d = dst + r * cols;
        int64_t c = 0;
        for (; c + 8 <= cols; c += 8) memcpy(d + c, lut[sr[c >> 3]], 8 * sizeof(float));
        for (; c < cols; c++) d[c] = bie_bit(sr, c) ? value : -value;
    }
}
