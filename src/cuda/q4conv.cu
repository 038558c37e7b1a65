// 4-bit conv2d forward pieces on the device (layouts in cuda_internal.h): the input's codes
// (nibbles, flat over N C H W, as the CPU layer keeps them) with the backward's clip bits and
// residuals, and the im2col of those codes into 4-bit GEMM rows, one per output pixel. Taps
// outside the input get code 0: zero padding needs no correction for 4-bit codes.
#include <cuda_runtime.h>

#include "cuda_common.cuh"
#include "cuda_internal.h"
#include "q4_common.cuh"

namespace bie_cuda {
namespace {

unsigned blocks_for(int64_t count) {
    const int64_t b = (count + 255) / 256;
    return (unsigned)(b < 1 ? 1 : b > (1 << 20) ? (1 << 20) : b);
}

// One thread per 8 inputs (one word of codes, one byte of clip bits): code i of the flat
// input in nibble i % 8 of word i / 8; bias of channel (i / hw) % c, as bie_q4_encode.
template <typename T>
__global__ void __launch_bounds__(256)
    q4_conv_encode(const T *__restrict__ x, int64_t total, int64_t hw, int64_t c, const float *__restrict__ bias,
                   const float *__restrict__ scale, unsigned *__restrict__ codes, uint8_t *__restrict__ mask,
                   int8_t *__restrict__ resid) {
    const int64_t groups = (total + 7) / 8;
    const float s = *scale;
    for (int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; t < groups; t += (int64_t)gridDim.x * blockDim.x) {
        unsigned w = 0, bits = 0;
        // The channel of the group's first element, then stepped along (one division per
        // group instead of two per element).
        const int64_t plane0 = t * 8 / hw;
        int64_t off = t * 8 - plane0 * hw, ch = plane0 % c;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const int64_t i = t * 8 + j;
            if (i >= total) break;
            if (off == hw) {
                off = 0;
                if (++ch == c) ch = 0;
            }
            off++;
            const float v = __fadd_rn(q4_to_f32(x[i]), bias[ch]);
            w |= (unsigned)(q4_code(v, s) & 15) << (4 * j);
            if (mask) bits |= (unsigned)q4_clip_resid(v, s, &resid[i]) << j;
        }
        codes[t] = w;
        if (mask) mask[t] = (uint8_t)bits;
    }
}

// Block per GEMM row [n oh ow][ld] (one output pixel), threads over its 32-bit words (8
// codes each): the codes of taps e = 8 q .. 8 q + 7 in [c, i, j] order, 0 outside the input
// and past C k k. 32-bit index math (the layer checks the extents).
__global__ void __launch_bounds__(128)
    q4_conv_im2col(const uint8_t *__restrict__ codes, bie_cuda_conv_shape g64, int words, unsigned *__restrict__ cols) {
    const int r = blockIdx.x, k = (int)g64.k, kk = k * k, C = (int)g64.c, K = C * kk;
    const int h = (int)g64.h, w = (int)g64.w, ow = (int)g64.ow, plane = (int)(g64.oh * g64.ow), d = (int)g64.d;
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

template <typename T>
void launch_encode(const void *x, const bie_cuda_conv_shape *g, const float *bias, const float *scale_a,
                   uint8_t *codes, uint8_t *mask, int8_t *resid) {
    const int64_t total = g->n * g->c * g->h * g->w;
    q4_conv_encode<T><<<blocks_for((total + 7) / 8), 256, 0, current_stream>>>(
        static_cast<const T *>(x), total, g->h * g->w, g->c, bias, scale_a, reinterpret_cast<unsigned *>(codes),
        mask, resid);
}

}  // namespace
}  // namespace bie_cuda

using namespace bie_cuda;

extern "C" {

bie_status bie_cuda_q4_conv_encode(bie_dtype dtype, const void *x, const bie_cuda_conv_shape *g,
                                   const float *bias, const float *scale_a, uint8_t *codes, uint8_t *mask,
                                   int8_t *resid) {
    switch (dtype) {
    case BIE_F32: launch_encode<float>(x, g, bias, scale_a, codes, mask, resid); break;
    case BIE_BF16: launch_encode<__nv_bfloat16>(x, g, bias, scale_a, codes, mask, resid); break;
    case BIE_F16: launch_encode<__half>(x, g, bias, scale_a, codes, mask, resid); break;
    default: return bie_fail(BIE_ERR_DTYPE, "cuda 4-bit conv encode: dtype %s", bie_dtype_name(dtype));
    }
    return check(cudaGetLastError(), "cuda 4-bit conv encode");
}

bie_status bie_cuda_q4_conv_im2col(const uint8_t *codes, const bie_cuda_conv_shape *g, int64_t ld, uint8_t *cols) {
    q4_conv_im2col<<<(unsigned)(g->n * g->oh * g->ow), 128, 0, current_stream>>>(codes, *g, (int)(ld / 4),
                                                                               reinterpret_cast<unsigned *>(cols));
    return check(cudaGetLastError(), "cuda 4-bit conv im2col");
}

}  // extern "C"
