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
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const int64_t i = t * 8 + j;
            if (i >= total) break;
            const float v = __fadd_rn(q4_to_f32(x[i]), bias[(i / hw) % c]);
            w |= (unsigned)(q4_code(v, s) & 15) << (4 * j);
            if (mask) bits |= (unsigned)q4_clip_resid(v, s, &resid[i]) << j;
        }
        codes[t] = w;
        if (mask) mask[t] = (uint8_t)bits;
    }
}

// One thread per 32-bit word (8 codes) of the GEMM rows [n oh ow][ld]: the codes of taps
// e = 8 q .. 8 q + 7 in [c, i, j] order of output pixel r, 0 outside the input and past C k k.
__global__ void __launch_bounds__(256)
    q4_conv_im2col(const uint8_t *__restrict__ codes, bie_cuda_conv_shape g, int64_t ld, unsigned *__restrict__ cols) {
    const int64_t words = ld / 4, plane = g.oh * g.ow, rows = g.n * plane, total = rows * words;
    const int64_t kk = g.k * g.k, K = g.c * kk, chw = g.c * g.h * g.w;
    for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = idx / words, e0 = (idx - r * words) * 8;
        unsigned w = 0;
        if (e0 < K) {
            const int64_t n = r / plane, pix = r - n * plane, oy = pix / g.ow, ox = pix - oy * g.ow;
            const int64_t y0 = oy * g.s - g.p, x0 = ox * g.s - g.p, base = n * chw;
            int64_t c = e0 / kk, t = e0 - c * kk, i = t / g.k, j = t - i * g.k;
            for (int b = 0; b < 8 && e0 + b < K; b++) {
                const int64_t iy = y0 + i * g.d, ix = x0 + j * g.d;
                if (iy >= 0 && iy < g.h && ix >= 0 && ix < g.w) {
                    const int64_t at = base + (c * g.h + iy) * g.w + ix;
                    w |= ((unsigned)(codes[at >> 1] >> ((at & 1) * 4)) & 15u) << (4 * b);
                }
                if (++j == g.k) {  // next tap in [c, i, j] order
                    j = 0;
                    if (++i == g.k) {
                        i = 0;
                        c++;
                    }
                }
            }
        }
        cols[idx] = w;
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
    const int64_t total = g->n * g->oh * g->ow * (ld / 4);
    q4_conv_im2col<<<blocks_for(total), 256, 0, current_stream>>>(codes, *g, ld, reinterpret_cast<unsigned *>(cols));
    return check(cudaGetLastError(), "cuda 4-bit conv im2col");
}

}  // extern "C"
