/* Public bit-packing entry points (bie_pack_signs / bie_unpack_signs). */
#include <string.h>

#include "../core/formats.h"
#include "../core/internal.h"
#include "frame/pack.h"

int64_t bie_packed_words(int64_t cols, int word_bits) {
    if (!bie_word_bits_ok(word_bits) || cols < 0) return -1;
    return (cols + word_bits - 1) / word_bits;
}

static bie_dtype word_dtype(int w) { return w == 8 ? BIE_U8 : w == 32 ? BIE_U32 : BIE_U64; }

/* Common checks: CPU tensors, same leading extents, packed last extent = ceil(cols / W). */
static bie_status check_pair(const bie_tensor *plain, const bie_tensor *packed, int w,
                             const char *who) {
    if (!bie_word_bits_ok(w))
        return bie_fail(BIE_ERR_INVALID_ARGUMENT, "%s: word size %d is not 8, 32 or 64", who, w);
    if (plain->device.type != BIE_DEVICE_CPU || packed->device.type != BIE_DEVICE_CPU)
        return bie_fail(BIE_ERR_DEVICE, "%s: tensors must be on the CPU", who);
    if (plain->data == NULL || packed->data == NULL)
        return bie_fail(BIE_ERR_NULL_POINTER, "%s: tensor data is NULL", who);
    if (plain->dtype != BIE_F32 && plain->dtype != BIE_I8)
        return bie_fail(BIE_ERR_DTYPE, "%s: unpacked tensor must be float32 or int8, not %s", who,
                        bie_dtype_name(plain->dtype));
    if (packed->dtype != word_dtype(w))
        return bie_fail(BIE_ERR_DTYPE, "%s: packed tensor must be %s for %d-bit words, not %s", who,
                        bie_dtype_name(word_dtype(w)), w, bie_dtype_name(packed->dtype));
    if (plain->ndim < 1 || plain->ndim > BIE_MAX_DIMS || packed->ndim != plain->ndim)
        return bie_fail(BIE_ERR_SHAPE, "%s: ranks %d and %d differ or are outside 1..4", who,
                        plain->ndim, packed->ndim);
    for (int i = 0; i < plain->ndim; i++)
        if (plain->shape[i] < 0 || packed->shape[i] < 0)
            return bie_fail(BIE_ERR_SHAPE, "%s: extent %d is negative", who, i);
    for (int i = 0; i + 1 < plain->ndim; i++)
        if (plain->shape[i] != packed->shape[i])
            return bie_fail(BIE_ERR_SHAPE, "%s: extent %d differs (%lld vs %lld)", who, i,
                            (long long)plain->shape[i], (long long)packed->shape[i]);
    int64_t cols = plain->shape[plain->ndim - 1];
    if (bie_tensor_numel(plain) < 0 || bie_tensor_numel(packed) < 0)
        return bie_fail(BIE_ERR_OVERFLOW, "%s: element count overflows", who);
    if (packed->shape[packed->ndim - 1] != bie_packed_words(cols, w))
        return bie_fail(BIE_ERR_SHAPE,
                        "%s: packed last extent is %lld, expected ceil(%lld / %d) = %lld", who,
                        (long long)packed->shape[packed->ndim - 1], (long long)cols, w,
                        (long long)bie_packed_words(cols, w));
    return BIE_OK;
}

bie_status bie_pack_signs(const bie_tensor *src, int word_bits, bie_tensor *dst) {
    BIE_CHECK_NULL(src);
    BIE_CHECK_NULL(dst);
    BIE_TRY(check_pair(src, dst, word_bits, "bie_pack_signs"));
    int64_t cols = src->shape[src->ndim - 1];
    int64_t rows = cols ? bie_tensor_numel(src) / cols : 0;
    int64_t row_bytes = bie_packed_row_bytes(cols, word_bits);
    if (rows == 0 || cols == 0) {
        memset(dst->data, 0, (size_t)(bie_tensor_numel(dst) * (int64_t)bie_dtype_size(dst->dtype)));
        return BIE_OK;
    }
    if (src->dtype == BIE_F32)
        bie_pack_f32_rows(src->data, rows, cols, cols, NULL, dst->data, row_bytes, NULL, 1.0f, 0,
                          0);
    else
        bie_pack_i8_rows(src->data, rows, cols, dst->data, row_bytes);
    return BIE_OK;
}

bie_status bie_unpack_signs(const bie_tensor *src, int word_bits, bie_tensor *dst) {
    BIE_CHECK_NULL(src);
    BIE_CHECK_NULL(dst);
    BIE_TRY(check_pair(dst, src, word_bits, "bie_unpack_signs"));
    int64_t cols = dst->shape[dst->ndim - 1];
    int64_t rows = cols ? bie_tensor_numel(dst) / cols : 0;
    int64_t row_bytes = bie_packed_row_bytes(cols, word_bits);
    const uint8_t *s = src->data;
    if (dst->dtype == BIE_F32) {
        bie_unpack_rows_f32(s, row_bytes, rows, cols, 1.0f, dst->data);
    } else {
        int8_t *d = dst->data;
        for (int64_t r = 0; r < rows; r++)
            for (int64_t c = 0; c < cols; c++)
                d[r * cols + c] = bie_bit(s + r * row_bytes, c) ? 1 : -1;
    }
    return BIE_OK;
}
