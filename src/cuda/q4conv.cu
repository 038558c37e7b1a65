// 4-bit conv2d forward pieces on the device (layouts in cuda_internal.h): the input's codes
// (nibbles, flat over N C H W, as the CPU layer keeps them) with the backward's clip bits and
// residuals, and the im2col of those codes into 4-bit GEMM rows, one per output pixel. Taps
// outside the input get code 0: zero padding needs no correction for 4-bit codes.
#include <cuda_runtime.h>

#include "cuda_common.cuh"
#include "cuda_internal.h"
#include "pdl.cuh"
#include "q4_common.cuh"

namespace bie_cuda {
namespace {

constexpr int64_t kQ4RowCodesMax = 48 * 1024;  // codes of a weight row in shared memory

unsigned blocks_for(int64_t count) {
    const int64_t b = (count + 255) / 256;
    return (unsigned)(b < 1 ? 1 : b > (1 << 20) ? (1 << 20) : b);
}

// One thread per 8 inputs (one word of codes, one byte of clip bits; x loaded and the residuals
// stored 8 at a time where `vec`: x 16-byte and resid 8-byte aligned; 32-bit index divisions
// where `narrow`): code i of the flat
// input in nibble i % 8 of word i / 8; bias of channel (i / hw) % c, as bie_q4_encode. QUOT:
// the state's quotients by q4_quotient (q4_quotient_wanted).
template <typename T, bool QUOT>
__global__ void __launch_bounds__(256)
    q4_conv_encode(const T *__restrict__ x, int64_t total, int64_t hw, int64_t c,
                   const float *__restrict__ bias, const float *__restrict__ scale, bool vec,
                   bool narrow, unsigned *__restrict__ codes, uint8_t *__restrict__ mask,
                   int8_t *__restrict__ resid) {
    const int64_t groups = (total + 7) / 8;
    const float s = *scale, inv = bie_q4_inverse(s), y = QUOT ? q4_reciprocal(s) : 0.0f;
    for (int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; t < groups;
         t += (int64_t)gridDim.x * blockDim.x) {
        unsigned w = 0, bits = 0;
        // The channel of the group's first element, then stepped along (one division per
        // group instead of two per element).
        const int64_t left = total - t * 8;
        int64_t plane0, off, ch;
        if (narrow) {  // 32-bit divisions
            const unsigned e = (unsigned)(t * 8), p = e / (unsigned)hw;
            plane0 = p, off = e - p * (unsigned)hw, ch = p % (unsigned)c;
        } else {
            plane0 = t * 8 / hw, off = t * 8 - plane0 * hw, ch = plane0 % c;
        }
        float xv[8];
        load_n(x + t * 8, vec, left, xv);
        uint2 rw = make_uint2(0u, 0u);
        int8_t *r8 = reinterpret_cast<int8_t *>(&rw);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            if (j >= left) break;
            if (off == hw) {
                off = 0;
                if (++ch == c) ch = 0;
            }
            off++;
            const float v = __fadd_rn(xv[j], bias[ch]);
            if (mask) {  // one division gives the code, the clip bit and the residual
                bool clip;
                w |= (unsigned)(q4_state<QUOT>(v, s, y, &clip, &r8[j]) & 15) << (4 * j);
                bits |= (unsigned)clip << j;
            } else {
                w |= (unsigned)(q4_code_fast(v, s, inv) & 15) << (4 * j);
            }
        }
        codes[t] = w;
        if (mask) {
            mask[t] = (uint8_t)bits;
            if (vec && left >= 8) {
                *reinterpret_cast<uint2 *>(resid + t * 8) = rw;
            } else {
                for (int j = 0; j < 8 && j < left; j++) resid[t * 8 + j] = r8[j];
            }
        }
    }
}

// Block per GEMM row [n oh ow][ld] (one output pixel), threads over its 32-bit words (8
// codes each): the codes of taps e = 8 q .. 8 q + 7 in [c, i, j] order, 0 outside the input
// and past C k k. 32-bit index math (the layer checks the extents).
__global__ void __launch_bounds__(128)
    q4_conv_im2col(const uint8_t *__restrict__ codes, bie_conv_geom g64, int words,
                   unsigned *__restrict__ cols) {
    const int r = blockIdx.x, k = (int)g64.k, kk = k * k, C = (int)g64.c, K = C * kk;
    const int h = (int)g64.h, w = (int)g64.w, ow = (int)g64.ow, plane = (int)(g64.oh * g64.ow),
              d = (int)g64.d;
    const int n = r / plane, pix = r - n * plane, oy = pix / ow, ox = pix - oy * ow;
    const int y0 = oy * (int)g64.s - (int)g64.p, x0 = ox * (int)g64.s - (int)g64.p;
    const int64_t base = (int64_t)n * C * h * w;
    for (int q = threadIdx.x; q < words; q += 128) {
        const int e0 = q * 8;
        unsigned v = 0;
        if (e0 < K) {
            int c = e0 / kk, t = e0 - c * kk, i = t / k, j = t - i * k;
            for (int b = 0; b < 8 && e0 + b < K; b++) {
                const int iy = y0 + i * d, ix = x0 + j * d;
                if (iy >= 0 && iy < h && ix >= 0 && ix < w) {
                    const int64_t at = base + ((int64_t)c * h + iy) * w + ix;
                    v |= ((unsigned)(codes[at >> 1] >> ((at & 1) * 4)) & 15u) << (4 * b);
                }
                if (++j == k) {  // next tap in [c, i, j] order
                    j = 0;
                    if (++i == k) {
                        i = 0;
                        c++;
                    }
                }
            }
        }
        cols[(int64_t)r * words + q] = v;
    }
}

// Two neighbouring elements as floats (one vector load; p aligned to two elements).
__device__ __forceinline__ void load2(const float *p, float &a, float &b) {
    const float2 v = *reinterpret_cast<const float2 *>(p);
    a = v.x, b = v.y;
}
__device__ __forceinline__ void load2(const __nv_bfloat16 *p, float &a, float &b) {
    const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(p));
    a = v.x, b = v.y;
}
__device__ __forceinline__ void load2(const __half *p, float &a, float &b) {
    const float2 v = __half22float2(*reinterpret_cast<const __half2 *>(p));
    a = v.x, b = v.y;
}

// The implicit GEMM's input codes: a block per 32 VP pixels (flat over N H W) and 8 words of
// codes (64 channels): lane = VP neighbouring pixels (coalesced loads of each channel plane;
// VP = 2 needs an even H W, so a pair never straddles two images, and an aligned x),
// warp = word; the words meet in shared memory and leave as each pixel's 32 contiguous
// bytes. Codes as q4_conv_encode computes them; channels past C get code 0. STATE (a
// training forward): also the backward's clip bits and residuals, NHWC: per pixel cw bytes
// of clip bits (channel ch at bit ch % 8 of byte ch / 8) and 8 cw residuals, 0 past C
// (bie_cuda_q4_conv_encode_nhwc); QUOT, their quotients by q4_quotient.
template <typename T, int VP, bool STATE, bool QUOT>
__global__ void __launch_bounds__(256)
    q4_conv_encode_nhwc(const T *__restrict__ x, int pixels, int hw, int c, int cbw, int cw,
                        const float *__restrict__ bias, const float *__restrict__ scale,
                        unsigned *__restrict__ codes, uint8_t *__restrict__ mask,
                        int8_t *__restrict__ resid) {
    constexpr int kSt = STATE ? 32 * VP : 1;  // the state tiles' pixels
    __shared__ unsigned tile[32 * VP][9];
    __shared__ uint2 rtile[kSt][9];  // rows padded against bank conflicts
    __shared__ uint8_t mtile[kSt][9];
    pdl_trigger();  // the GEMM that reads these codes may launch now
    const float s = *scale, inv = bie_q4_inverse(s), y = QUOT ? q4_reciprocal(s) : 0.0f;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, first = blockIdx.x * 32 * VP;
    const int px = first + lane * VP, gw = blockIdx.y * 8 + warp;
    unsigned word[VP], bits[VP];
    uint2 rw[VP];
#pragma unroll
    for (int e = 0; e < VP; e++) word[e] = 0, bits[e] = 0, rw[e] = make_uint2(0u, 0u);
    if (px < pixels && gw < cbw) {
        const int n = px / hw, pix = px - n * hw;
        float v[8][VP];
#pragma unroll
        for (int j = 0; j < 8; j++) {  // all loads first
            const int ch = gw * 8 + j;
            const T *src = x + ((int64_t)n * c + ch) * hw + pix;
            if (ch >= c) {
#pragma unroll
                for (int e = 0; e < VP; e++) v[j][e] = 0.0f;
            } else if (VP == 2) {
                load2(src, v[j][0], v[j][VP - 1]);
            } else {
                v[j][0] = to_f32(*src);
            }
        }
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const int ch = gw * 8 + j;
            if (ch < c)
#pragma unroll
                for (int e = 0; e < VP; e++) {
                    const float a = __fadd_rn(v[j][e], bias[ch]);
                    int q;
                    if (STATE) {  // one division: the code, the clip bit, the residual
                        bool clip;
                        int8_t r;
                        q = q4_state<QUOT>(a, s, y, &clip, &r);
                        bits[e] |= (unsigned)clip << j;
                        const unsigned rb = (unsigned)(uint8_t)r << (8 * (j & 3));
                        if (j < 4)
                            rw[e].x |= rb;
                        else
                            rw[e].y |= rb;
                    } else {
                        q = q4_code_fast(a, s, inv);
                    }
                    word[e] |= (unsigned)(q & 15) << (4 * j);
                }
        }
    }
#pragma unroll
    for (int e = 0; e < VP; e++) {
        tile[lane * VP + e][warp] = word[e];
        if (STATE) rtile[lane * VP + e][warp] = rw[e], mtile[lane * VP + e][warp] = bits[e];
    }
    __syncthreads();
#pragma unroll
    for (int i = threadIdx.x; i < 32 * VP * 8; i += 256) {
        const int p = i >> 3, q = i & 7, w = blockIdx.y * 8 + q;
        if (first + p >= pixels) continue;
        if (w < cbw) codes[(int64_t)(first + p) * cbw + w] = tile[p][q];
        if (STATE && w < cw) {
            const int64_t at = (int64_t)(first + p) * cw + w;
            mask[at] = mtile[p][q];
            *reinterpret_cast<uint2 *>(resid + at * 8) = rtile[p][q];
        }
    }
}

// Weight codes of the GEMM layout (row o: code e = c k k + t at nibble e) to the tap layout
// (row o: tap t's cb bytes, channel c at nibble t cb 2 + c). One thread per output byte.
__global__ void __launch_bounds__(256)
    q4_conv_weight_taps(const uint8_t *__restrict__ w, int64_t ld, int o, int c, int kk, int cb,
                        uint8_t *__restrict__ taps) {
    const int64_t row_bytes = (int64_t)kk * cb, total = (int64_t)o * row_bytes;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t oo = i / row_bytes;
        const int rem = (int)(i - oo * row_bytes), t = rem / cb, b = rem - t * cb;
        unsigned v = 0;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int ch = 2 * b + h;
            if (ch < c) {
                const int64_t e = (int64_t)ch * kk + t;
                v |= ((unsigned)(w[oo * ld + (e >> 1)] >> ((e & 1) * 4)) & 15u) << (4 * h);
            }
        }
        taps[i] = (uint8_t)v;
    }
}

// Block per weight row o: the codes q4(w, scale_w) of the float row, one division each, into
// shared memory (a byte each); then the row in the GEMM layout (ld bytes) and in the tap
// layout, as bie_cuda_q4_pack_weight and q4_conv_weight_taps would write them.
__global__ void __launch_bounds__(256)
    q4_conv_weight_rows(const float *__restrict__ w, int c, int kk, int64_t ld, int cb,
                        const float *__restrict__ scale, uint8_t *__restrict__ codes,
                        uint8_t *__restrict__ taps) {
    extern __shared__ uint8_t sc[];  // [c kk]
    const int K = c * kk;
    const float s = *scale, *row = w + (int64_t)blockIdx.x * K;
    for (int e0 = (int)threadIdx.x; e0 < K; e0 += 256 * 8) {  // 8 loads in flight a thread
        float v[8];
#pragma unroll
        for (int u = 0; u < 8; u++) v[u] = e0 + 256 * u < K ? row[e0 + 256 * u] : 0.0f;
#pragma unroll
        for (int u = 0; u < 8; u++)
            if (e0 + 256 * u < K) sc[e0 + 256 * u] = (uint8_t)(q4_code(v[u], s) & 15);
    }
    __syncthreads();
    unsigned *crow = reinterpret_cast<unsigned *>(codes + (int64_t)blockIdx.x * ld);
    for (int q = (int)threadIdx.x; q < (int)(ld / 4); q += 256) {
        unsigned v = 0;
#pragma unroll
        for (int j = 0; j < 8; j++)
            if (q * 8 + j < K) v |= (unsigned)sc[q * 8 + j] << (4 * j);
        crow[q] = v;
    }
    uint8_t *trow = taps + (int64_t)blockIdx.x * kk * cb;
    for (int i = (int)threadIdx.x; i < kk * cb; i += 256) {
        const int t = i / cb, b = i - t * cb;
        unsigned v = 0;
#pragma unroll
        for (int h = 0; h < 2; h++)
            if (2 * b + h < c) v |= (unsigned)sc[(2 * b + h) * kk + t] << (4 * h);
        trow[i] = (uint8_t)v;
    }
}

template <typename T>
void launch_encode_nhwc(const void *x, const bie_conv_geom *g, const float *bias,
                        const float *scale_a, uint8_t *codes, uint8_t *mask, int8_t *resid) {
    const int pixels = (int)(g->n * g->h * g->w), cbw = (int)(bie_cuda_q4_conv_cb(g->c) / 4),
              hw = (int)(g->h * g->w), cw = (int)((g->c + 63) / 64 * 8);
    const bool pairs = hw % 2 == 0 && reinterpret_cast<uintptr_t>(x) % (2 * sizeof(T)) == 0;
    const int vp = pairs ? 2 : 1;
    const dim3 grid((unsigned)((pixels + 32 * vp - 1) / (32 * vp)), (unsigned)((cbw + 7) / 8));
    static const bool quot = q4_quotient_wanted();
    auto fn = !mask  ? (pairs ? q4_conv_encode_nhwc<T, 2, false, false>
                              : q4_conv_encode_nhwc<T, 1, false, false>)
              : quot ? (pairs ? q4_conv_encode_nhwc<T, 2, true, true>
                              : q4_conv_encode_nhwc<T, 1, true, true>)
                     : (pairs ? q4_conv_encode_nhwc<T, 2, true, false>
                              : q4_conv_encode_nhwc<T, 1, true, false>);
    fn<<<grid, 256, 0, current_stream>>>(static_cast<const T *>(x), pixels, hw, (int)g->c, cbw, cw,
                                         bias, scale_a, reinterpret_cast<unsigned *>(codes), mask,
                                         resid);
}

template <typename T>
void launch_encode(const void *x, const bie_conv_geom *g, const float *bias, const float *scale_a,
                   uint8_t *codes, uint8_t *mask, int8_t *resid) {
    const int64_t total = g->n * g->c * g->h * g->w;
    static const bool quot = q4_quotient_wanted();
    auto fn = quot && mask ? q4_conv_encode<T, true> : q4_conv_encode<T, false>;
    fn<<<blocks_for((total + 7) / 8), 256, 0, current_stream>>>(
        static_cast<const T *>(x), total, g->h * g->w, g->c, bias, scale_a,
        reinterpret_cast<uintptr_t>(x) % 16 == 0 && reinterpret_cast<uintptr_t>(resid) % 8 == 0,
        total + 8 <= (int64_t)UINT32_MAX, reinterpret_cast<unsigned *>(codes), mask, resid);
}

}  // namespace
}  // namespace bie_cuda

using namespace bie_cuda;

extern "C" {

bie_status bie_cuda_q4_conv_encode(bie_dtype dtype, const void *x, const bie_conv_geom *g,
                                   const float *bias, const float *scale_a, uint8_t *codes,
                                   uint8_t *mask, int8_t *resid) {
    switch (dtype) {
    case BIE_F32: launch_encode<float>(x, g, bias, scale_a, codes, mask, resid); break;
    case BIE_BF16: launch_encode<__nv_bfloat16>(x, g, bias, scale_a, codes, mask, resid); break;
    case BIE_F16: launch_encode<__half>(x, g, bias, scale_a, codes, mask, resid); break;
    default:
        return bie_fail(BIE_ERR_DTYPE, "cuda 4-bit conv encode: dtype %s", bie_dtype_name(dtype));
    }
    return check(cudaGetLastError(), "cuda 4-bit conv encode");
}

bie_status bie_cuda_q4_conv_im2col(const uint8_t *codes, const bie_conv_geom *g, int64_t ld,
                                   uint8_t *cols) {
    q4_conv_im2col<<<(unsigned)(g->n * g->oh * g->ow), 128, 0, current_stream>>>(
        codes, *g, (int)(ld / 4), reinterpret_cast<unsigned *>(cols));
    return check(cudaGetLastError(), "cuda 4-bit conv im2col");
}

bie_status bie_cuda_q4_conv_encode_nhwc(bie_dtype dtype, const void *x, const bie_conv_geom *g,
                                        const float *bias, const float *scale_a, uint8_t *codes,
                                        uint8_t *mask, int8_t *resid) {
    if ((mask == NULL) != (resid == NULL))
        return bie_fail(BIE_ERR_INVALID_ARGUMENT, "cuda 4-bit conv encode: clip bits and "
                                                  "residuals go together");
    switch (dtype) {
    case BIE_F32: launch_encode_nhwc<float>(x, g, bias, scale_a, codes, mask, resid); break;
    case BIE_BF16:
        launch_encode_nhwc<__nv_bfloat16>(x, g, bias, scale_a, codes, mask, resid);
        break;
    case BIE_F16: launch_encode_nhwc<__half>(x, g, bias, scale_a, codes, mask, resid); break;
    default:
        return bie_fail(BIE_ERR_DTYPE, "cuda 4-bit conv encode: dtype %s", bie_dtype_name(dtype));
    }
    return check(cudaGetLastError(), "cuda 4-bit conv encode (NHWC)");
}

bie_status bie_cuda_q4_conv_weight_taps(const uint8_t *wcodes, int64_t ld, const bie_conv_geom *g,
                                        uint8_t *taps) {
    const int64_t cb = bie_cuda_q4_conv_cb(g->c), total = g->o * g->k * g->k * cb;
    q4_conv_weight_taps<<<blocks_for(total), 256, 0, current_stream>>>(
        wcodes, ld, (int)g->o, (int)g->c, (int)(g->k * g->k), (int)cb, taps);
    return check(cudaGetLastError(), "cuda 4-bit conv weight taps");
}

bie_status bie_cuda_q4_conv_pack_weight(const float *w, const bie_conv_geom *g,
                                        const float *scale_w, int64_t ld, uint8_t *codes,
                                        uint8_t *taps) {
    const int64_t kk = g->k * g->k, K = g->c * kk;
    if (K > kQ4RowCodesMax) {  // the row's codes do not fit in shared memory: two passes
        BIE_CUDA_TRY(bie_cuda_q4_pack_weight(w, g->o, K, scale_w, ld, false, codes));
        return bie_cuda_q4_conv_weight_taps(codes, ld, g, taps);
    }
    q4_conv_weight_rows<<<(unsigned)g->o, 256, (size_t)K, current_stream>>>(
        w, (int)g->c, (int)kk, ld, (int)bie_cuda_q4_conv_cb(g->c), scale_w, codes, taps);
    return check(cudaGetLastError(), "cuda 4-bit conv pack weight");
}

}  // extern "C"
