// Binary conv2d forward pieces on the device (layouts in cuda_internal.h): the input's sign
// and clip bits per pixel (NHWC), the weight rows in tap order with their per-tap sums, the
// bit im2col the GEMM multiplies, and the zero-padding corrections per pixel class.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cuda_common.cuh"
#include "cuda_internal.h"

namespace bie_cuda {
namespace {

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }

unsigned blocks_for(int64_t count, int threads) {
    int64_t b = (count + threads - 1) / threads;
    return (unsigned)(b < 1 ? 1 : b > 1048576 ? 1048576 : b);
}

// Block (pixel block, word, image): thread = one pixel's 32 channels of one sign word (and
// mask word). Neighbouring threads read neighbouring pixels of a channel plane (coalesced),
// and the 32 loads of a thread are unrolled so that they are all in flight. v = x + bias and
// the mask test are the CPU's float arithmetic. Index math in 32 bits (the layer checks the
// extents).
template <typename T>
__global__ void __launch_bounds__(256)
    pack_input(const T *__restrict__ x, bie_cuda_conv_shape g64, const float *__restrict__ bias,
               const float *scale_a, const float *scale_w, float *saved_scales, uint32_t *signs, uint32_t *mask) {
    const int hw = (int)(g64.h * g64.w), C = (int)g64.c, cw = (C + 31) / 32;
    const int pix = blockIdx.x * 256 + threadIdx.x, word = blockIdx.y, n = blockIdx.z;
    if (saved_scales && blockIdx.x == 0 && word == 0 && n == 0 && threadIdx.x == 0) {
        saved_scales[0] = *scale_a;
        saved_scales[1] = *scale_w;
    }
    if (pix >= hw) return;
    const int c0 = word * 32, cn = C - c0 < 32 ? C - c0 : 32;
    const float sa = mask ? *scale_a : 1.0f;
    const T *xp = x + ((int64_t)n * C + c0) * hw + pix;
    float v[32];
#pragma unroll
    for (int c = 0; c < 32; c++) v[c] = c < cn ? to_f32(xp[(int64_t)c * hw]) + bias[c0 + c] : 0.0f;
    uint32_t sb = 0, mb = 0;
#pragma unroll
    for (int c = 0; c < 32; c++) {
        sb |= (uint32_t)(c < cn && v[c] >= 0.0f) << c;
        const float q = v[c] / sa;
        mb |= (uint32_t)(c < cn && q >= -1.0f && q <= 1.0f) << c;
    }
    const int64_t dst = ((int64_t)n * hw + pix) * cw + word;
    signs[dst] = sb;
    if (mask) mask[dst] = mb;
}

// Sign of element idx of weight row `row` ([c, i, j] order) from the source format.
template <typename S> __device__ __forceinline__ bool weight_sign(const S *src, int64_t rb, int64_t row, int64_t idx);
template <> __device__ __forceinline__ bool weight_sign<int8_t>(const int8_t *w, int64_t rb, int64_t row, int64_t idx) {
    return w[row * rb + idx] >= 0;
}
template <> __device__ __forceinline__ bool weight_sign<float>(const float *w, int64_t rb, int64_t row, int64_t idx) {
    return w[row * rb + idx] >= 0.0f;
}
template <> __device__ __forceinline__ bool weight_sign<uint8_t>(const uint8_t *q, int64_t rb, int64_t row, int64_t idx) {
    return (q[row * rb + (idx >> 3)] >> (idx & 7)) & 1;
}

// Block (row, part): the 256 words of popcount part `part` of weight row `row`.
template <typename S>
__global__ void __launch_bounds__(256)
    pack_weight(const S *__restrict__ src, int64_t rb, bie_cuda_conv_shape g, int64_t cw, int64_t ld,
                uint32_t *bits, int *popc) {
    const int64_t row = blockIdx.x, words = ld / 4, kk = g.k * g.k;
    const int64_t q = (int64_t)blockIdx.y * 256 + threadIdx.x;
    uint32_t v = 0;
    if (q < kk * cw && q < words) {
        const int64_t t = q / cw, c0 = (q % cw) * 32, cn = g.c - c0 < 32 ? g.c - c0 : 32;
        for (int64_t c = 0; c < cn; c++) v |= (uint32_t)weight_sign(src, rb, row, (c0 + c) * kk + t) << c;
    }
    if (q < words) bits[row * words + q] = v;
    int count = __popc(v);
    for (int o = 16; o > 0; o >>= 1) count += __shfl_down_sync(0xffffffffu, count, o);
    __shared__ int partial[8];
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = count;
    __syncthreads();
    if (threadIdx.x == 0) {
        int total = 0;
        for (int i = 0; i < 8; i++) total += partial[i];
        popc[row * gridDim.y + blockIdx.y] = total;
    }
}

// tapsum[o][t] = 2 * (ones among the tap's C bits) - C.
__global__ void tap_sums(const uint32_t *bits, bie_cuda_conv_shape g, int64_t cw, int64_t ld, int *tapsum) {
    const int64_t kk = g.k * g.k, words = ld / 4;
    for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < g.o * kk;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int64_t o = idx / kk, t = idx % kk;
        int ones = 0;
        for (int64_t w = 0; w < cw; w++) ones += __popc(bits[o * words + t * cw + w]);
        tapsum[idx] = 2 * ones - (int)g.c;
    }
}

// One warp per output pixel: its row of k k taps (cw words each, zero outside the input)
// and the row's popcount. 32-bit index math.
__global__ void __launch_bounds__(256)
    im2col_bits(const uint32_t *__restrict__ signs, bie_cuda_conv_shape g64, int words, uint32_t *cols, int *popc) {
    const int C = (int)g64.c, cw = (C + 31) / 32, k = (int)g64.k, s = (int)g64.s, p = (int)g64.p, d = (int)g64.d;
    const int h = (int)g64.h, w = (int)g64.w, oh = (int)g64.oh, ow = (int)g64.ow;
    const int plane = oh * ow, rows = (int)g64.n * plane, used = k * k * cw;
    const int lane = threadIdx.x & 31;
    const int r = (int)(((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5);
    if (r >= rows) return;
    const int n = r / plane, pix = r - n * plane, oy = pix / ow, ox = pix - oy * ow;
    const uint32_t *img = signs + (int64_t)n * h * w * cw;
    int count = 0;
    for (int q = lane; q < words; q += 32) {
        uint32_t v = 0;
        if (q < used) {
            const int t = q / cw, wd = q - t * cw, i = t / k, j = t - i * k;
            const int iy = oy * s - p + i * d, ix = ox * s - p + j * d;
            if (iy >= 0 && iy < h && ix >= 0 && ix < w) v = img[(iy * w + ix) * cw + wd];
        }
        cols[(int64_t)r * words + q] = v;
        count += __popc(v);
    }
    for (int o = 16; o > 0; o >>= 1) count += __shfl_down_sync(0xffffffffu, count, o);
    if (lane == 0) popc[r] = count;
}

__global__ void corrections(const int *tapsum, bie_cuda_conv_shape g, const int *ylim, const int *xlim,
                            int ny, int nx, int *corr) {
    const int64_t kk = g.k * g.k;
    for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < (int64_t)ny * nx * g.o;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int64_t cls = idx / g.o, o = idx % g.o;
        const int cy = (int)(cls / nx), cx = (int)(cls % nx);
        int sum = 0;
        for (int64_t i = 0; i < g.k; i++)
            for (int64_t j = 0; j < g.k; j++) {
                const bool inside = i >= ylim[2 * cy] && i < ylim[2 * cy + 1] && j >= xlim[2 * cx] && j < xlim[2 * cx + 1];
                if (!inside) sum += tapsum[o * kk + i * g.k + j];
            }
        corr[idx] = sum;
    }
}

}  // namespace
}  // namespace bie_cuda

using namespace bie_cuda;

extern "C" {

bie_status bie_cuda_conv_pack_input(bie_dtype dtype, const void *x, const bie_cuda_conv_shape *g,
                                    const float *bias, const float *scale_a, const float *scale_w,
                                    float *saved_scales, uint32_t *signs, uint32_t *mask) {
    const dim3 grid((unsigned)((g->h * g->w + 255) / 256), (unsigned)bie_cuda_conv_cw(g), (unsigned)g->n);
    cudaStream_t st = current_stream;
    switch (dtype) {
    case BIE_F32:
        pack_input<<<grid, 256, 0, st>>>(static_cast<const float *>(x), *g, bias, scale_a, scale_w, saved_scales,
                                         signs, mask);
        break;
    case BIE_BF16:
        pack_input<<<grid, 256, 0, st>>>(static_cast<const __nv_bfloat16 *>(x), *g, bias, scale_a, scale_w,
                                         saved_scales, signs, mask);
        break;
    case BIE_F16:
        pack_input<<<grid, 256, 0, st>>>(static_cast<const __half *>(x), *g, bias, scale_a, scale_w, saved_scales,
                                         signs, mask);
        break;
    default: return bie_fail(BIE_ERR_DTYPE, "cuda conv pack: dtype %s", bie_dtype_name(dtype));
    }
    return check(cudaGetLastError(), "cuda conv pack input");
}

bie_status bie_cuda_conv_pack_weight(bie_dtype dtype, const void *src, int64_t src_row_bytes,
                                     const bie_cuda_conv_shape *g, int64_t ld, uint8_t *bits,
                                     int *popc, int *tapsum) {
    const int64_t cw = bie_cuda_conv_cw(g), K = g->c * g->k * g->k;
    const dim3 grid((unsigned)g->o, (unsigned)bie_cuda_popc_parts(ld));
    cudaStream_t st = current_stream;
    uint32_t *b = reinterpret_cast<uint32_t *>(bits);
    switch (dtype) {
    case BIE_I8: pack_weight<<<grid, 256, 0, st>>>(static_cast<const int8_t *>(src), K, *g, cw, ld, b, popc); break;
    case BIE_F32: pack_weight<<<grid, 256, 0, st>>>(static_cast<const float *>(src), K, *g, cw, ld, b, popc); break;
    case BIE_U8:
        pack_weight<<<grid, 256, 0, st>>>(static_cast<const uint8_t *>(src), src_row_bytes, *g, cw, ld, b, popc);
        break;
    default: return bie_fail(BIE_ERR_DTYPE, "cuda conv pack: weight dtype %s", bie_dtype_name(dtype));
    }
    tap_sums<<<blocks_for(g->o * g->k * g->k, 256), 256, 0, st>>>(b, *g, cw, ld, tapsum);
    return check(cudaGetLastError(), "cuda conv pack weight");
}

bie_status bie_cuda_conv_im2col(const uint32_t *signs, const bie_cuda_conv_shape *g, int64_t ld,
                                uint8_t *cols, int *popc) {
    const int64_t rows = g->n * g->oh * g->ow;
    im2col_bits<<<(unsigned)((rows * 32 + 255) / 256), 256, 0, current_stream>>>(
        signs, *g, (int)(ld / 4), reinterpret_cast<uint32_t *>(cols), popc);
    return check(cudaGetLastError(), "cuda conv im2col");
}

bie_status bie_cuda_conv_corrections(const int *tapsum, const bie_cuda_conv_shape *g,
                                     const int *ylim, int ny, const int *xlim, int nx, int *corr) {
    corrections<<<blocks_for((int64_t)ny * nx * g->o, 256), 256, 0, current_stream>>>(tapsum, *g, ylim, xlim,
                                                                                     ny, nx, corr);
    return check(cudaGetLastError(), "cuda conv corrections");
}

}  // extern "C"
