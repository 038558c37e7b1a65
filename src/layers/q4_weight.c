/* The 4-bit weight format (q4_weight.h): init, reset, scale_w, codes and nibble packing. */
#include "q4_weight.h"

#include <math.h>
#include <string.h>

static const float kEps = 1e-5f;

void bie_q4w_init(bie_q4_weight *w, int64_t rows, int64_t cols) {
    memset(w, 0, sizeof *w);
    w->rows = rows;
    w->cols = cols;
    w->scale_w = 1.0f;
}

static void set_qweight(bie_q4_weight *w, uint8_t *q) {
    bie_free_aligned(w->qweight);
    bie_free_aligned(w->qcodes);
    bie_cpu_packed_b_free(&w->packed);
    w->qweight = q;
    w->qcodes = NULL;
}

void bie_q4w_free(bie_q4_weight *w) {
    bie_free_aligned(w->f32);
    w->f32 = NULL;
    set_qweight(w, NULL);
}

bie_status bie_q4w_reset(bie_q4_weight *w, uint64_t seed) {
    bie_binary_weight tmp; /* the same Kaiming-uniform initialisation as the binary layers */
    bie_bw_init(&tmp, w->rows, w->cols);
    BIE_TRY(bie_bw_reset(&tmp, seed));
    bie_q4w_free(w);
    w->f32 = tmp.f32;
    return BIE_OK;
}

static bie_status scale_of(const float *f, int64_t n, float *out, const char *who) {
    double s = 0;
    for (int64_t i = 0; i < n; i++) s += fabs((double)f[i]);
    float sw = (float)(2.0 * s / (double)n / 5.6345);
    if (!isfinite(sw)) return bie_fail(BIE_ERR_NOT_FINITE, "%s: weight has non-finite values", who);
    *out = sw > kEps ? sw : kEps;
    return BIE_OK;
}

bie_status bie_q4w_prepare(bie_q4_weight *w, const char *who) {
    if (w->f32 == NULL) return bie_bw_no_weight(who);
    return scale_of(w->f32, w->rows * w->cols, &w->scale_w, who);
}

bie_status bie_q4w_set_data(bie_q4_weight *w, const float *data, const char *who) {
    const int64_t n = w->rows * w->cols;
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(data[i]))
            return bie_fail(BIE_ERR_NOT_FINITE, "%s: weight has non-finite values", who);
    float sw = 0;
    BIE_TRY(scale_of(data, n, &sw, who));
    float *copy = bie_alloc_aligned((size_t)n * sizeof(float));
    if (copy == NULL) return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: weight", who);
    memcpy(copy, data, (size_t)n * sizeof(float));
    bie_q4w_free(w);
    w->f32 = copy;
    w->scale_w = sw;
    return BIE_OK;
}

void bie_q4_pack_nibbles(const int8_t *codes, int64_t rows, int64_t cols, uint8_t *dst) {
    const int64_t rb = bie_nibble_row_bytes(cols);
    memset(dst, 0, (size_t)(rows * rb));
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < cols; i++)
            dst[r * rb + (i >> 1)] |= (uint8_t)((codes[r * cols + i] & 15) << ((i & 1) * 4));
}

static bie_status float_codes(const bie_q4_weight *w, int8_t **out, const char *who) {
    int8_t *c = bie_alloc_aligned((size_t)(w->rows * w->cols));
    if (c == NULL) return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: weight codes", who);
    const bie_q4_quantize_fn quantize = bie_cpu_pack().q4;
#pragma omp parallel for num_threads(bie_threads()) schedule(static) if (w->rows * w->cols > 65536)
    for (int64_t r = 0; r < w->rows; r++)
        quantize(w->f32 + r * w->cols, w->cols, w->scale_w, c + r * w->cols);
    *out = c;
    return BIE_OK;
}

bie_status bie_q4w_generate_qweight(bie_q4_weight *w, bool qweight_only, const char *who) {
    if (w->f32 == NULL) {
        if (w->qweight) return BIE_OK;
        return bie_bw_no_weight(who);
    }
    uint8_t *q = bie_alloc_aligned((size_t)(w->rows * bie_nibble_row_bytes(w->cols)));
    if (q == NULL) return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: qweight", who);
    int8_t *codes = NULL;
    bie_status st = float_codes(w, &codes, who);
    if (st != BIE_OK) {
        bie_free_aligned(q);
        return st;
    }
    bie_q4_pack_nibbles(codes, w->rows, w->cols, q);
    bie_free_aligned(codes);
    set_qweight(w, q);
    if (qweight_only) {
        bie_free_aligned(w->f32);
        w->f32 = NULL;
    }
    return BIE_OK;
}

bie_status bie_q4w_set_qweight(bie_q4_weight *w, const uint8_t *q, const char *who) {
    const int64_t rb = bie_nibble_row_bytes(w->cols);
    uint8_t *copy = bie_alloc_aligned((size_t)(w->rows * rb));
    if (copy == NULL) return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: qweight", who);
    memcpy(copy, q, (size_t)(w->rows * rb));
    if (w->cols & 1) /* the unused high nibble of each row's last byte is cleared */
        for (int64_t r = 0; r < w->rows; r++) copy[r * rb + rb - 1] &= 15;
    set_qweight(w, copy);
    return BIE_OK;
}

bie_status bie_q4w_codes(bie_q4_weight *w, bool prefer_q, int8_t **codes, bool *borrowed,
                         const char *who) {
    *borrowed = false;
    if (!(w->qweight && (prefer_q || w->f32 == NULL))) {
        if (w->f32 == NULL) return bie_bw_no_weight(who);
        return float_codes(w, codes, who);
    }
    if (w->qcodes == NULL) { /* unpack once; cached until qweight changes */
        int8_t *c = bie_alloc_aligned((size_t)(w->rows * w->cols));
        if (c == NULL) return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: weight codes", who);
        const int64_t rb = bie_nibble_row_bytes(w->cols);
#pragma omp parallel for num_threads(bie_threads()) schedule(static) if (w->rows * w->cols > 65536)
        for (int64_t r = 0; r < w->rows; r++)
            for (int64_t i = 0; i < w->cols; i++)
                c[r * w->cols + i] = bie_nibble_get(w->qweight + r * rb, i);
        w->qcodes = c;
    }
    *codes = w->qcodes;
    *borrowed = true;
    return BIE_OK;
}

void bie_q4_encode(const float *x, int64_t n, const float *bias, int64_t run, int64_t len,
                   float scale, int8_t *codes, uint8_t *mask, int8_t *resid) {
    const int64_t nbytes = (n + 7) / 8;
#pragma omp parallel for num_threads(bie_threads()) schedule(static) if (n > 65536)
    for (int64_t byte = 0; byte < nbytes; byte++) { /* 8 elements: one mask byte per thread */
        unsigned bits = 0;
        for (int64_t i = byte * 8; i < byte * 8 + 8 && i < n; i++) {
            float v = x[i] + bias[(i / run) % len];
            codes[i] = bie_q4(v, scale);
            if (mask) {
                float q = v / scale;
                int inr = q >= -8.0f && q <= 7.0f;
                bits |= (unsigned)inr << (i & 7);
                resid[i] = inr ? (int8_t)rintf((rintf(q) - q) * 254.0f) : 0;
            }
        }
        if (mask) mask[byte] = (uint8_t)bits;
    }
}

bie_status bie_q4w_packed(bie_q4_weight *w, const bie_cpu_kernel *kern, const bie_packed_b **out,
                          const char *who) {
    if (!bie_cpu_packed_b_fits(&w->packed, kern, w->rows, w->cols * 8)) {
        int8_t *codes = NULL;
        bool borrowed = false;
        BIE_TRY(bie_q4w_codes(w, true, &codes, &borrowed, who));
        bie_status st =
            bie_cpu_pack_b(kern, w->rows, w->cols * 8, (const uint8_t *)codes, w->cols, &w->packed);
        if (!borrowed) bie_free_aligned(codes);
        BIE_TRY(st);
        bie_free_aligned(w->qcodes); /* the panels supersede the unpacked copy */
        w->qcodes = NULL;
    }
    *out = &w->packed;
    return BIE_OK;
}
