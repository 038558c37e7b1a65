/* The CUDA 4-bit GEMM against the CPU backend, bit for bit: every CUDA 4-bit kernel on random
 * codes in [-8, 7] (the extremes often, rows of all -8 or all 7 at the largest k) over many
 * shapes (m or n = 1, odd k, tails of every tile, both unpacking paths), with row strides
 * longer than k and poisoned outputs; bad arguments. In a CUDA build also the internal pieces
 * a 4-bit layer uses: activation and weight packing (codes, clip bits and residuals against
 * the CPU layer's encoder), the user's nibble rows, and the launcher's device scales, bf16
 * output and convolution output. Reports itself skipped (77) without a GPU. */
#include "bie_cuda.h"
#include "gpu_util.h"
#ifdef BIE_TEST_CUDA_INTERNALS
#include "cuda/cuda_internal.h"
#include "layers/q4_weight.h"
#endif

static bie_tensor upload(const void *host, bie_dtype dt, int64_t count) {
    bie_tensor h = tu_view((void *)host, dt, 1, count, 0, 0, 0), d;
    int64_t shape[1] = {count};
    if (bie_cuda_tensor_alloc(&d, dt, 1, shape, 0) != BIE_OK || bie_tensor_copy(&d, &h) != BIE_OK) {
        fprintf(stderr, "upload failed: %s\n", bie_last_error());
        exit(2);
    }
    return d;
}

static int kernel_ids[32], nkernels;

/* A code in [-8, 7]; a quarter of them -8 and a quarter 7. */
static int8_t random_code(void) {
    uint64_t r = tu_next();
    switch (r & 3) {
    case 0: return -8;
    case 1: return 7;
    default: return (int8_t)((int)((r >> 8) & 15) - 8);
    }
}

/* rows x stride codes; row 0 all -8 and row 1 all 7 when `extremes`; garbage past k (it must
 * be ignored). */
static int8_t *random_codes(int64_t rows, int64_t k, int64_t stride, int extremes) {
    int8_t *c = tu_alloc((size_t)(rows * stride));
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < stride; j++)
            c[r * stride + j] = j >= k               ? (int8_t)(tu_next() >> 56)
                                : extremes && r == 0 ? -8
                                : extremes && r == 1 ? 7
                                                     : random_code();
    return c;
}

static void report(const float *got, const float *expect, int64_t m, int64_t n, int64_t k, int id) {
    int64_t bad = 0, first = -1;
    for (int64_t i = 0; i < m * n; i++)
        if (memcmp(&got[i], &expect[i], 4)) bad++, first = first < 0 ? i : first;
    fprintf(
        stderr,
        "  kernel %d m=%lld n=%lld k=%lld: %lld of %lld differ, first at (%lld, %lld): %g vs %g\n",
        id, (long long)m, (long long)n, (long long)k, (long long)bad, (long long)(m * n),
        (long long)(first / n), (long long)(first % n), (double)got[first], (double)expect[first]);
}

static void check_shape(int64_t m, int64_t n, int64_t k, int extremes) {
    const int64_t lda = k + (int64_t)(tu_next() % 4), ldb = k + (int64_t)(tu_next() % 3);
    int8_t *a = random_codes(m, k, lda, extremes), *b = random_codes(n, k, ldb, extremes);
    const float scale = tu_uniform(0.01f, 2.0f);
    float *expect = tu_alloc((size_t)(m * n) * sizeof(float));
    float *got = tu_alloc((size_t)(m * n) * sizeof(float));
    CHECK_OK(bie_q4_gemm(-1, m, n, k, a, lda, b, ldb, scale, expect));
    bie_tensor da = upload(a, BIE_I8, m * lda), db = upload(b, BIE_I8, n * ldb);
    tu_poison(got, m * n);
    bie_tensor dout = upload(got, BIE_F32, m * n), hout = tu_view(got, BIE_F32, 1, m * n, 0, 0, 0);
    for (int t = 0; t < nkernels; t++) {
        tu_poison(got, m * n);
        CHECK_OK(bie_tensor_copy(&dout, &hout)); /* poison the device output too */
        bie_status st =
            bie_cuda_q4_gemm(kernel_ids[t], m, n, k, da.data, lda, db.data, ldb, scale, dout.data);
        CHECK(st == BIE_OK);
        if (st != BIE_OK) fprintf(stderr, "  %s\n", bie_last_error());
        CHECK_OK(bie_cuda_synchronize());
        CHECK_OK(bie_tensor_copy(&hout, &dout));
        int same = tu_same_bits(got, expect, m * n);
        CHECK(same);
        if (!same) report(got, expect, m, n, k, kernel_ids[t]);
    }
    bie_tensor_free(&da);
    bie_tensor_free(&db);
    bie_tensor_free(&dout);
    free(a);
    free(b);
    free(expect);
    free(got);
}

static void bad_arguments(void) {
    int8_t *a = random_codes(4, 64, 64, 0);
    bie_tensor da = upload(a, BIE_I8, 4 * 64), dout = upload(a, BIE_I8, 4 * 64);
    const int8_t *d = da.data;
    float *o = dout.data, host_out[16];
    const float nan = nanf(""), inf = INFINITY;
#define EXPECT(code, call)                                                    \
    do {                                                                      \
        bie_status st_ = (call);                                              \
        CHECK(st_ == (code));                                                 \
        if (st_ != (code))                                                    \
            fprintf(stderr, "  expected %s, got %s\n", bie_status_name(code), \
                    bie_status_name(st_));                                    \
    } while (0)
    EXPECT(BIE_ERR_NULL_POINTER, bie_cuda_q4_gemm(-1, 4, 4, 64, NULL, 64, d, 64, 1.0f, o));
    EXPECT(BIE_ERR_NULL_POINTER, bie_cuda_q4_gemm(-1, 4, 4, 64, d, 64, NULL, 64, 1.0f, o));
    EXPECT(BIE_ERR_NULL_POINTER, bie_cuda_q4_gemm(-1, 4, 4, 64, d, 64, d, 64, 1.0f, NULL));
    EXPECT(BIE_ERR_SHAPE, bie_cuda_q4_gemm(-1, 0, 4, 64, d, 64, d, 64, 1.0f, o));
    EXPECT(BIE_ERR_SHAPE, bie_cuda_q4_gemm(-1, 4, 0, 64, d, 64, d, 64, 1.0f, o));
    EXPECT(BIE_ERR_SHAPE, bie_cuda_q4_gemm(-1, 4, 4, 0, d, 64, d, 64, 1.0f, o));
    EXPECT(BIE_ERR_SHAPE, bie_cuda_q4_gemm(-1, 4, 4, 64, d, 63, d, 64, 1.0f, o));
    EXPECT(BIE_ERR_SHAPE, bie_cuda_q4_gemm(-1, 4, 4, 64, d, 64, d, 32, 1.0f, o));
    EXPECT(BIE_ERR_OVERFLOW,
           bie_cuda_q4_gemm(-1, 1, 1, (1 << 24) + 1, d, 1 << 25, d, 1 << 25, 1.0f, o));
    EXPECT(BIE_ERR_NOT_FINITE, bie_cuda_q4_gemm(-1, 4, 4, 64, d, 64, d, 64, nan, o));
    EXPECT(BIE_ERR_NOT_FINITE, bie_cuda_q4_gemm(-1, 4, 4, 64, d, 64, d, 64, inf, o));
    EXPECT(BIE_ERR_INVALID_ARGUMENT, bie_cuda_q4_gemm(99999, 4, 4, 64, d, 64, d, 64, 1.0f, o));
    EXPECT(BIE_ERR_INVALID_ARGUMENT,
           bie_cuda_q4_gemm(100, 4, 4, 64, d, 64, d, 64, 1.0f, o)); /* binary */
    EXPECT(BIE_ERR_INVALID_ARGUMENT,
           bie_cuda_q4_gemm(0, 4, 4, 64, d, 64, d, 64, 1.0f, o)); /* CPU */
    EXPECT(BIE_ERR_DEVICE, bie_cuda_q4_gemm(-1, 4, 4, 64, a, 64, d, 64, 1.0f, o));
    EXPECT(BIE_ERR_DEVICE, bie_cuda_q4_gemm(-1, 4, 4, 64, d, 64, d, 64, 1.0f, host_out));
    /* and the binary GEMM refuses a 4-bit kernel */
    EXPECT(BIE_ERR_INVALID_ARGUMENT, bie_cuda_binary_gemm(200, 4, 4, 64, d, 8, d, 8, 1.0f, o));
    bie_kernel_info info;
    CHECK_OK(bie_kernel_find(200, &info));
    CHECK(info.op == BIE_OP_Q4_GEMM && info.device == BIE_DEVICE_CUDA && info.available);
#undef EXPECT
    bie_tensor_free(&da);
    bie_tensor_free(&dout);
    free(a);
}

#ifdef BIE_TEST_CUDA_INTERNALS
static void download(void *host, const bie_tensor *d) {
    bie_tensor h = tu_view(host, d->dtype, 1, d->shape[0], 0, 0, 0);
    CHECK_OK(bie_tensor_copy(&h, d));
}

/* Layout rows of ld bytes from int8 codes [rows, k]. */
static uint8_t *layout_of(const int8_t *codes, int64_t rows, int64_t k, int64_t ld) {
    uint8_t *l = tu_alloc((size_t)(rows * ld));
    memset(l, 0, (size_t)(rows * ld));
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < k; j++)
            l[r * ld + j / 2] |= (uint8_t)((codes[r * k + j] & 15) << (4 * (j & 1)));
    return l;
}

/* The int8 code rows of kernel 211 (ld8 bytes a row, zero past k). */
static uint8_t *i8_rows_of(const int8_t *codes, int64_t rows, int64_t k, int64_t ld8) {
    uint8_t *l = tu_alloc((size_t)(rows * ld8));
    memset(l, 0, (size_t)(rows * ld8));
    for (int64_t r = 0; r < rows; r++) memcpy(l + r * ld8, codes + r * k, (size_t)k);
    return l;
}

/* v moved by steps ulps (negative: down). */
static float nudge(float v, int steps) {
    for (; steps > 0; steps--) v = nextafterf(v, INFINITY);
    for (; steps < 0; steps++) v = nextafterf(v, -INFINITY);
    return v;
}

/* x [m, k] of values around the quantization grid of s: ties (half steps), exact steps, out
 * of range, zero, NaN and infinities; a few ulps around the steps where the residual
 * (rint(q) - q) * 254 is half an integer, around the clip bounds -8 and 7 and around the
 * half steps (where the pack's product by 1 / s must give way to the division); plus uniform
 * ones. */
static void special_values(float *x, int64_t n, float s) {
    for (int64_t i = 0; i < n; i++) {
        uint64_t r = tu_next();
        int j = (int)((r >> 8) % 24) - 12;
        const int ulps = (int)((r >> 52) % 9) - 4, h = (int)((r >> 16) % 254) - 127;
        switch (r & 15) {
        case 4: x[i] = nudge(((float)j - ((float)h + 0.5f) / 254.0f) * s, ulps); break;
        case 5: x[i] = nudge((r >> 40 & 1 ? 7.0f : -8.0f) * s, ulps); break;
        case 6: x[i] = nudge(((float)j + 0.5f) * s, ulps); break;
        case 0: x[i] = ((float)j + 0.5f) * s; break;
        case 1: x[i] = (float)j * s; break;
        case 2: x[i] = (r >> 40 & 1) ? 1e30f : -7.75f * s; break;
        case 3:
            x[i] = (r >> 40 & 3) == 0   ? NAN
                   : (r >> 40 & 3) == 1 ? INFINITY
                   : (r >> 40 & 3) == 2 ? -INFINITY
                                        : 0.0f;
            break;
        default: x[i] = tu_uniform(-10.0f * s, 10.0f * s);
        }
    }
}

/* bie_cuda_q4_pack_act against bie_q4_encode (the CPU layer's encoder), for each input dtype,
 * with and without bias, in both row layouts (4-bit and int8 codes); then the GEMM of the
 * packed activations with packed weights through every kernel, device scales, f32/bf16
 * output, row-major and convolution layout, and kernel 211 on the int8 rows. */
static void check_layer_pieces(int64_t m, int64_t n, int64_t k) {
    const int64_t ld = bie_cuda_q4_row_stride(k), mk = m * k, ld8 = bie_cuda_q4_i8_row_stride(k);
    CHECK(ld8 % 128 == 0 && ld8 >= k && ld8 >= ld);
    CHECK(ld % BIE_CUDA_Q4_ROW_ALIGN == 0 && ld * 2 >= k);
    const float sa = tu_uniform(0.05f, 0.5f), sw = tu_uniform(0.01f, 0.1f);
    float *x = tu_alloc((size_t)mk * sizeof(float)), *bias = tu_alloc((size_t)k * sizeof(float));
    float *w = tu_alloc((size_t)(n * k) * sizeof(float));
    special_values(x, mk, sa);
    tu_fill(bias, k, -2.0f * sa, 2.0f * sa);
    for (int64_t j = 0; j < k; j++)
        if (j % 5 == 0) bias[j] = 0.5f * sa * (float)(j % 3); /* ties survive the addition */
    special_values(w, n * k, sw);
    for (int64_t i = 0; i < n * k; i++)
        if (!isfinite(w[i])) w[i] = 3.0f * sw; /* weights are finite in a layer */
    float scales[2] = {sa, sw};
    bie_tensor dscales = upload(scales, BIE_F32, 2), dbias = upload(bias, BIE_F32, k);
    const float *d_sa = dscales.data, *d_sw = (const float *)dscales.data + 1;

    int8_t *acodes = tu_alloc((size_t)mk), *resid = tu_alloc((size_t)mk),
           *got_resid = tu_alloc((size_t)mk);
    uint8_t *mask = tu_alloc((size_t)((mk + 7) / 8)), *got_mask = tu_alloc((size_t)((mk + 7) / 8));
    uint8_t *got = tu_alloc((size_t)((m > n ? m : n) * ld));
    int64_t shape[1] = {(m > n ? m : n) * ld};
    bie_tensor dcodes, dmask, dresid, dwcodes;
    CHECK_OK(bie_cuda_tensor_alloc(&dcodes, BIE_U8, 1, shape, 0));
    CHECK_OK(bie_cuda_tensor_alloc(&dwcodes, BIE_U8, 1, shape, 0));
    bie_tensor dcodes8, dwcodes8;
    shape[0] = m * ld8;
    CHECK_OK(bie_cuda_tensor_alloc(&dcodes8, BIE_U8, 1, shape, 0));
    shape[0] = n * ld8;
    CHECK_OK(bie_cuda_tensor_alloc(&dwcodes8, BIE_U8, 1, shape, 0));
    shape[0] = (mk + 7) / 8;
    CHECK_OK(bie_cuda_tensor_alloc(&dmask, BIE_U8, 1, shape, 0));
    shape[0] = mk;
    CHECK_OK(bie_cuda_tensor_alloc(&dresid, BIE_I8, 1, shape, 0));

    /* weights: q4(w, sw) */
    int8_t *wcodes = tu_alloc((size_t)(n * k));
    for (int64_t i = 0; i < n * k; i++) {
        float q = rintf(w[i] / sw);
        wcodes[i] = (int8_t)(q < -8.0f ? -8 : q > 7.0f ? 7 : q);
    }
    uint8_t *wlayout = layout_of(wcodes, n, k, ld);
    bie_tensor dw = upload(w, BIE_F32, n * k);
    CHECK_OK(bie_cuda_q4_pack_weight(dw.data, n, k, d_sw, ld, false, dwcodes.data));
    uint8_t *w8 = i8_rows_of(wcodes, n, k, ld8);
    poison_device_with(&dwcodes8, 0xa5); /* no code byte: an unwritten one fails */
    CHECK_OK(bie_cuda_q4_pack_weight(dw.data, n, k, d_sw, ld8, true, dwcodes8.data));
    CHECK_OK(bie_cuda_synchronize());
    CHECK(device_bytes_match(&dwcodes8, w8));
    free(w8);
    CHECK_OK(bie_cuda_synchronize());
    bie_tensor hw = tu_view(got, BIE_U8, 1, n * ld, 0, 0, 0),
               dwv = tu_view(dwcodes.data, BIE_U8, 1, n * ld, 0, 0, 0);
    dwv.device = dwcodes.device;
    CHECK_OK(bie_tensor_copy(&hw, &dwv));
    CHECK(memcmp(got, wlayout, (size_t)(n * ld)) == 0);

    /* the user's nibble rows (garbage in the odd k's last high nibble) */
    {
        const int64_t rb = (k + 1) / 2;
        uint8_t *user = tu_alloc((size_t)(n * rb));
        memset(user, 0, (size_t)(n * rb));
        for (int64_t r = 0; r < n; r++) {
            for (int64_t j = 0; j < k; j++)
                user[r * rb + j / 2] |= (uint8_t)((wcodes[r * k + j] & 15) << (4 * (j & 1)));
            if (k & 1) user[r * rb + rb - 1] |= (uint8_t)(tu_next() & 0xf0);
        }
        bie_tensor duser = upload(user, BIE_U8, n * rb);
        memset(got, 0xa5, (size_t)(n * ld));
        CHECK_OK(bie_tensor_copy(&dwv, &hw)); /* poison */
        CHECK_OK(bie_cuda_q4_repack_rows(duser.data, n, k, ld, dwcodes.data));
        CHECK_OK(bie_cuda_synchronize());
        CHECK_OK(bie_tensor_copy(&hw, &dwv));
        CHECK(memcmp(got, wlayout, (size_t)(n * ld)) == 0);
        bie_tensor_free(&duser);
        free(user);
    }

    for (int dt = 0; dt < 3; dt++) {
        const bie_dtype dtype = dt == 0 ? BIE_F32 : dt == 1 ? BIE_BF16 : BIE_F16;
        /* the input in its dtype, and the float values the CPU sees */
        float *xv = tu_alloc((size_t)mk * sizeof(float));
        void *xin = tu_alloc((size_t)mk * 4);
        for (int64_t i = 0; i < mk; i++) {
            if (dtype == BIE_F32) {
                xv[i] = x[i];
                ((float *)xin)[i] = x[i];
            } else if (dtype == BIE_BF16) {
                uint16_t h = isnan(x[i]) ? 0x7fc0 : to_bf16(x[i]);
                ((uint16_t *)xin)[i] = h;
                xv[i] = from_bf16(h);
            } else {
                float v = isnan(x[i])              ? 0.0f
                          : fabsf(x[i]) > 60000.0f ? copysignf(60000.0f, x[i])
                                                   : x[i];
                uint16_t h = to_f16(v);
                if (isnan(x[i])) h = 0x7e00;
                if (isinf(x[i])) h = x[i] > 0 ? 0x7c00 : 0xfc00;
                ((uint16_t *)xin)[i] = h;
                xv[i] = from_f16(h);
            }
        }
        bie_tensor dx = upload(xin, dtype, mk);
        for (int with_bias = 0; with_bias < 2; with_bias++) {
            float *zero = tu_alloc((size_t)k * sizeof(float));
            memset(zero, 0, (size_t)k * sizeof(float));
            bie_q4_encode(xv, mk, with_bias ? bias : zero, 1, k, sa, acodes, mask, resid);
            free(zero);
            uint8_t *alayout = layout_of(acodes, m, k, ld);
            memset(got, 0x5a, (size_t)(m * ld));
            bie_tensor hc = tu_view(got, BIE_U8, 1, m * ld, 0, 0, 0),
                       dcv = tu_view(dcodes.data, BIE_U8, 1, m * ld, 0, 0, 0);
            dcv.device = dcodes.device;
            CHECK_OK(bie_tensor_copy(&dcv, &hc)); /* poison */
            memset(got_resid, 0x5a, (size_t)mk);
            memset(got_mask, 0x5a, (size_t)((mk + 7) / 8));
            bie_tensor hm = tu_view(got_mask, BIE_U8, 1, (mk + 7) / 8, 0, 0, 0);
            bie_tensor hr = tu_view(got_resid, BIE_I8, 1, mk, 0, 0, 0);
            CHECK_OK(bie_tensor_copy(&dmask, &hm));
            CHECK_OK(bie_tensor_copy(&dresid, &hr));
            const bool keep = with_bias; /* the inference call passes no mask */
            CHECK_OK(bie_cuda_q4_pack_act(dtype, dx.data, m, k, with_bias ? dbias.data : NULL, d_sa,
                                          ld, false, dcodes.data, keep ? dmask.data : NULL,
                                          keep ? dresid.data : NULL));
            CHECK_OK(bie_cuda_synchronize());
            CHECK_OK(bie_tensor_copy(&hc, &dcv));
            int same = memcmp(got, alayout, (size_t)(m * ld)) == 0;
            CHECK(same);
            if (!same)
                fprintf(stderr, "  activation codes differ: %s m=%lld k=%lld bias=%d\n",
                        bie_dtype_name(dtype), (long long)m, (long long)k, with_bias);
            if (keep) {
                download(got_mask, &dmask);
                download(got_resid, &dresid);
                CHECK(memcmp(got_mask, mask, (size_t)((mk + 7) / 8)) == 0);
                CHECK(memcmp(got_resid, resid, (size_t)mk) == 0);
            }
            free(alayout);
            /* the same as int8 rows, with the clip bits and residuals written again */
            uint8_t *a8 = i8_rows_of(acodes, m, k, ld8);
            poison_device_with(&dcodes8, 0xa5);
            if (keep) {
                poison_device_with(&dmask, 0xa5);
                poison_device_with(&dresid, 0xa5);
            }
            /* a training pass of a 16-bit input also writes the codes' values where it can */
            const bool values = keep && bie_cuda_q4_act_values_wanted(dtype, k);
            bie_tensor dval = {0};
            if (values) {
                shape[0] = mk;
                CHECK_OK(bie_cuda_tensor_alloc(&dval, dtype, 1, shape, 0));
                poison_device_with(&dval, 0xa5);
            }
            CHECK_OK(bie_cuda_q4_pack_act_values(
                dtype, dx.data, m, k, with_bias ? dbias.data : NULL, d_sa, ld8, true, dcodes8.data,
                keep ? dmask.data : NULL, keep ? dresid.data : NULL, values ? dval.data : NULL));
            CHECK_OK(bie_cuda_synchronize());
            CHECK(device_bytes_match(&dcodes8, a8));
            if (keep) {
                CHECK(device_bytes_match(&dmask, mask));
                CHECK(device_bytes_match(&dresid, resid));
            }
            if (values) {
                uint16_t *want = tu_alloc((size_t)mk * 2);
                for (int64_t i = 0; i < mk; i++)
                    want[i] =
                        dtype == BIE_BF16 ? to_bf16((float)acodes[i]) : to_f16((float)acodes[i]);
                CHECK(device_bytes_match(&dval, want));
                free(want);
                bie_tensor_free(&dval);
            }
            free(a8);
        }
        bie_tensor_free(&dx);
        free(xv);
        free(xin);
    }

    /* GEMM of the last packed activations (f16 input, with bias) and the weights: device
     * scales; f32 and bf16 output; row-major and, for m divisible by 3, convolution output. */
    int64_t *dots = tu_alloc((size_t)(m * n) * sizeof(int64_t));
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++) {
            int64_t d = 0;
            for (int64_t c = 0; c < k; c++) d += (int64_t)acodes[i * k + c] * wcodes[j * k + c];
            dots[i * n + j] = d;
        }
    const float s = sa * sw;
    float *outf = tu_alloc((size_t)(m * n) * sizeof(float)),
          *expf_ = tu_alloc((size_t)(m * n) * sizeof(float));
    shape[0] = m * n;
    bie_tensor dout;
    CHECK_OK(bie_cuda_tensor_alloc(&dout, BIE_F32, 1, shape, 0));
    for (int t = 0; t < nkernels; t++)
        for (int variant = 0; variant < 4; variant++) {
            const int bf16 = variant & 1, conv = variant >> 1;
            if (conv && m % 3) continue;
            bie_cuda_conv_out co = {m / 3, NULL, NULL, 0};
            const int64_t plane = m / 3;
            for (int64_t i = 0; i < m; i++)
                for (int64_t j = 0; j < n; j++) {
                    const float v = (float)dots[i * n + j] * s;
                    const int64_t at = conv ? ((i / plane) * n + j) * plane + i % plane : i * n + j;
                    if (bf16) {
                        uint16_t h = to_bf16(v);
                        memcpy((uint16_t *)expf_ + at, &h, 2);
                    } else {
                        expf_[at] = v;
                    }
                }
            tu_poison(outf, m * n);
            float poison;
            tu_poison(&poison, 1);
            bie_tensor ho = tu_view(outf, BIE_F32, 1, m * n, 0, 0, 0);
            CHECK_OK(bie_tensor_copy(&dout, &ho));
            CHECK_OK(bie_cuda_q4gemm_launch(kernel_ids[t], m, n, k, dcodes.data, dwcodes.data, ld,
                                            0.0f, d_sa, d_sw, bf16 ? BIE_BF16 : BIE_F32, dout.data,
                                            conv ? &co : NULL));
            CHECK_OK(bie_cuda_synchronize());
            CHECK_OK(bie_tensor_copy(&ho, &dout));
            const size_t bytes = (size_t)(m * n) * (bf16 ? 2 : 4);
            int same = memcmp(outf, expf_, bytes) == 0;
            if (bf16) { /* the bytes past the bf16 output keep their poison */
                const uint8_t *tail = (const uint8_t *)outf + bytes;
                for (size_t i = 0; i < bytes; i++)
                    same = same && tail[i] == ((const uint8_t *)&poison)[(bytes + i) % 4];
            }
            CHECK(same);
            if (!same)
                fprintf(stderr,
                        "  launcher: kernel %d m=%lld n=%lld k=%lld bf16=%d conv=%d differs\n",
                        kernel_ids[t], (long long)m, (long long)n, (long long)k, bf16, conv);
        }
    /* kernel 211 on the int8 rows (where the device runs it) */
    if (bie_cuda_q4_kernel_fits(211, k)) {
        tu_poison(outf, m * n);
        bie_tensor ho = tu_view(outf, BIE_F32, 1, m * n, 0, 0, 0);
        CHECK_OK(bie_tensor_copy(&dout, &ho));
        CHECK_OK(bie_cuda_q4gemm_i8_launch(m, n, k, dcodes8.data, dwcodes8.data, ld8, 0.0f, d_sa,
                                           d_sw, BIE_F32, dout.data, NULL));
        CHECK_OK(bie_cuda_synchronize());
        CHECK_OK(bie_tensor_copy(&ho, &dout));
        int64_t off = 0;
        for (int64_t i = 0; i < m * n; i++) off += outf[i] != (float)dots[i] * s;
        CHECK(off == 0);
        if (off)
            fprintf(stderr, "  int8 rows: m=%lld n=%lld k=%lld: %lld differ\n", (long long)m,
                    (long long)n, (long long)k, (long long)off);
    }
    bie_tensor_free(&dout);
    bie_tensor_free(&dcodes8);
    bie_tensor_free(&dwcodes8);
    free(outf);
    free(expf_);
    free(dots);
    bie_tensor_free(&dw);
    bie_tensor_free(&dscales);
    bie_tensor_free(&dbias);
    bie_tensor_free(&dcodes);
    bie_tensor_free(&dwcodes);
    bie_tensor_free(&dmask);
    bie_tensor_free(&dresid);
    free(x), free(bias), free(w), free(acodes), free(resid), free(got_resid), free(mask),
        free(got_mask);
    free(got), free(wcodes), free(wlayout);
}

/* The implicit 4-bit convolution (the 4-bit conv layer's forward GEMM), every tile variant the
 * device runs, on NHWC codes and tap-ordered weight codes (random nibbles, code 0 past C),
 * against integer dot products on the host: out = (float)dot * (scale_a * scale_w), exactly. */
static void check_conv_variants(int64_t n, int64_t c, int64_t hw, int64_t o) {
    const bie_conv_geom g = {n, c, hw, hw, o, hw, hw, 3, 1, 1, 1, 0};
    const int64_t cb = bie_cuda_q4_conv_cb(c), ld = 9 * cb, rows = n * hw * hw;
    uint8_t *codes = tu_alloc((size_t)(n * hw * hw * cb)), *taps = tu_alloc((size_t)(o * ld));
    int8_t *ac = tu_alloc((size_t)(n * hw * hw * c)), *wc = tu_alloc((size_t)(o * 9 * c));
    memset(codes, 0, (size_t)(n * hw * hw * cb));
    memset(taps, 0, (size_t)(o * ld));
    for (int64_t px = 0; px < n * hw * hw; px++)
        for (int64_t ch = 0; ch < c; ch++) {
            const int8_t v = random_code();
            ac[px * c + ch] = v;
            codes[px * cb + ch / 2] |= (uint8_t)((v & 15) << (4 * (ch & 1)));
        }
    for (int64_t oc = 0; oc < o; oc++)
        for (int64_t t = 0; t < 9; t++)
            for (int64_t ch = 0; ch < c; ch++) {
                const int8_t v = random_code();
                wc[(oc * 9 + t) * c + ch] = v;
                taps[oc * ld + t * cb + ch / 2] |= (uint8_t)((v & 15) << (4 * (ch & 1)));
            }
    const float sa = 0.375f, sw = 1.25f, scale = sa * sw;
    float *expect = tu_alloc((size_t)(rows * o) * sizeof(float)),
          *got = tu_alloc((size_t)(rows * o) * sizeof(float));
    for (int64_t img = 0; img < n; img++)
        for (int64_t oc = 0; oc < o; oc++)
            for (int64_t y = 0; y < hw; y++)
                for (int64_t x = 0; x < hw; x++) {
                    long long dot = 0;
                    for (int64_t t = 0; t < 9; t++) {
                        const int64_t iy = y + t / 3 - 1, ix = x + t % 3 - 1;
                        if (iy < 0 || iy >= hw || ix < 0 || ix >= hw) continue;
                        const int8_t *a = ac + ((img * hw + iy) * hw + ix) * c,
                                     *w = wc + (oc * 9 + t) * c;
                        for (int64_t ch = 0; ch < c; ch++) dot += a[ch] * w[ch];
                    }
                    expect[((img * o + oc) * hw + y) * hw + x] = (float)dot * scale;
                }
    const float hs[2] = {sa, sw};
    bie_tensor dcodes = upload(codes, BIE_U8, n * hw * hw * cb),
               dtaps = upload(taps, BIE_U8, o * ld);
    bie_tensor dsc = upload(hs, BIE_F32, 2), dout = device_empty(BIE_F32, rows, o);
    int ran = 0;
    for (int variant = 0; variant < 16; variant++) {
        poison_device(&dout);
        const bie_status st =
            bie_cuda_q4conv_implicit(variant, dcodes.data, &g, dtaps.data, (const float *)dsc.data,
                                     (const float *)dsc.data + 1, BIE_F32, dout.data);
        if (st == BIE_ERR_INVALID_ARGUMENT || st == BIE_ERR_UNSUPPORTED)
            continue; /* not for this shape / device */
        CHECK_OK(st);
        download_as(&dout, got);
        ran++;
        if (!compare_exact("implicit conv variant", got, expect, rows * o))
            fprintf(stderr, "  variant %d, n=%lld c=%lld hw=%lld o=%lld\n", variant, (long long)n,
                    (long long)c, (long long)hw, (long long)o);
    }
    CHECK(ran >= (cb % 128 == 0 ? 4 : 2));
    bie_tensor_free(&dcodes), bie_tensor_free(&dtaps), bie_tensor_free(&dsc),
        bie_tensor_free(&dout);
    free(codes), free(taps), free(ac), free(wc), free(expect), free(got);
}
#endif

int main(int argc, char **argv) {
    /* --small: a few small shapes, for runs under compute-sanitizer */
    const int small = argc > 1 && strcmp(argv[1], "--small") == 0;
    if (gpu_missing()) return TU_SKIP;
    tu_seed(404);
    kernel_ids[nkernels++] = -1;
    for (int i = 0; i < bie_kernel_count(); i++) {
        bie_kernel_info info;
        CHECK_OK(bie_kernel_get(i, &info));
        if (info.device == BIE_DEVICE_CUDA && info.op == BIE_OP_Q4_GEMM && info.available &&
            nkernels < 32) {
            kernel_ids[nkernels++] = info.id;
            printf("kernel %d %s\n", info.id, info.name);
        }
    }
    CHECK(nkernels > 1);
    bad_arguments();
    const int64_t shapes[][3] = {
        {1, 1, 1},          {2, 1, 7},        {1, 2, 2},          {7, 31, 33},
        {31, 7, 64},        {33, 64, 31},     {64, 33, 100},      {100, 129, 7},
        {129, 100, 257},    {257, 2, 129},    {2, 257, 1000},     {1, 1000, 257},
        {1000, 1, 33},      {16, 1000, 1000}, {17, 129, 1001},    {64, 64, 64},
        {128, 128, 256},    {129, 257, 255},  {1000, 257, 129},   {257, 1000, 31},
        {100, 100, 4097},   {3, 300, 8191},   {1000, 1000, 1000}, {2048, 1536, 4608},
        {1024, 2048, 2047},
    };
    const size_t count = small ? 6 : sizeof shapes / sizeof shapes[0];
    for (size_t s = 0; s < count; s++)
        check_shape(shapes[s][0], shapes[s][1], shapes[s][2], s % 3 == 0);
    if (!small) {
        /* both unpacking paths at their boundary, and the largest k with all -8 / all 7 rows */
        check_shape(3, 5, (1 << 17) - 1, 1);
        check_shape(3, 5, 1 << 17, 1);
        check_shape(2, 9, (1 << 17) + 5, 1);
        check_shape(2, 2, 1 << 24, 1);
    }
#ifdef BIE_TEST_CUDA_INTERNALS
    const int64_t pieces[][3] = {{1, 1, 1},       {3, 7, 31},     {21, 9, 257},
                                 {48, 130, 1000}, {300, 77, 130}, {129, 264, 4097}};
    const size_t np = small ? 3 : sizeof pieces / sizeof pieces[0];
    for (size_t s = 0; s < np; s++) check_layer_pieces(pieces[s][0], pieces[s][1], pieces[s][2]);
    /* implicit conv tile variants: 64- and 128-byte channel blocks (an odd number of 64-byte
     * k blocks with C = 120), partial channel tiles */
    check_conv_variants(2, 120, 9, 130);
    if (!small) {
        check_conv_variants(3, 136, 9, 256);
        check_conv_variants(2, 256, 7, 200);
    }
#endif
    return tu_finish();
}
