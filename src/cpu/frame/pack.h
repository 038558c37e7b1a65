/* Packing of float/int8 rows into sign-bit streams (layout in core/formats.h), and the
 * clip mask the binary layers keep for their backward pass. */
#ifndef BIE_CPU_PACK_H
#define BIE_CPU_PACK_H

#include <stdint.h>

/* Sign bits of (x[r, c] + bias[c]) (bias may be NULL) for rows x cols floats with row
 * stride ld (elements) into dst rows of dst_row_bytes bytes (>= ceil(cols / 8)); bytes
 * past the valid bits are zeroed. When mask != NULL, also writes the clip mask
 * 1{lo <= (x + bias) / scale <= hi} in the same layout. */
void bie_pack_f32_rows(const float *x, int64_t rows, int64_t cols, int64_t ld, const float *bias,
                       uint8_t *dst, int64_t dst_row_bytes, uint8_t *mask, float scale, float lo,
                       float hi);

/* Sign bits of int8 rows (v >= 0 -> 1). */
void bie_pack_i8_rows(const int8_t *x, int64_t rows, int64_t cols, uint8_t *dst,
                      int64_t dst_row_bytes);

/* Expand packed sign rows to ±value floats (bit 1 -> +value). */
void bie_unpack_rows_f32(const uint8_t *src, int64_t src_row_bytes, int64_t rows, int64_t cols,
                         float value, float *dst);

/* Bit c of a packed row. */
static inline int bie_bit(const uint8_t *row, int64_t c) { return (row[c >> 3] >> (c & 7)) & 1; }

#endif
