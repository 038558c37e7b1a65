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

// Thread (n, word, pixel), pixels fastest so that reads of one channel plane coalesce: 32
// channels of one pixel into one sign word (and one mask word). v = x + bias and the mask
// test are the CPU's float arithmetic.
template <typename T>
__global__ void __launch_bounds__(256)
    pack_input(const T *__restrict__ x, bie_cuda_conv_shape g, int64_t cw, const float *__restrict__ bias,
               const float *scale_a, const float *scale_w, float *saved_scales, uint32_t *signs, uint32_t *mask) {
    const int64_t hw = g.h * g.w, total = g.n * cw * hw;
    const float sa = mask ? *scale_a : 1.0f;
    for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int64_t pix = idx % hw, word = (idx / hw) % cw, n = idx / (hw * cw);
        const int64_t c0 = word * 32, cn = g.c - c0 < 32 ? g.c - c0 : 32;
        const T *xp = x + (n * g.c + c0) * hw + pix;
        uint32_t sb = 0, mb = 0;
        for (int64_t c = 0; c < cn; c++) {
            float v = to_f32(xp[c * hw]) + bias[c0 + c];
            sb |= (uint32_t)(v >= 0.0f) << c;
            if (mask) {
                float q = v / sa;
                mb |= (uint32_t)(q >= -1.0f && q <= 1.0f) << c;
            }
        }
        const int64_t dst = (n * hw + pix) * cw + word;
        signs[dst] = sb;
        if (mask) mask[dst] = mb;
    }
    if (saved_scales && blockIdx.x == 0 && threadIdx.x == 0) {
        saved_scales[0] = *scale_a;
        saved_scales[1] = *scale_w;
    }
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
// and the row's popcount.
__global__ void __launch_bounds__(256)
    im2col_bits(const uint32_t *__restrict__ signs, bie_cuda_conv_shape g, int64_t cw, int64_t ld,
                uint32_t *cols, int *popc) {
    const int64_t rows = g.n * g.oh * g.ow, words = ld / 4, kk = g.k * g.k;
    const int lane = threadIdx.x & 31;
    for (int64_t r = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < rows;
         r += ((int64_t)gridDim.x * blockDim.x) >> 5) {
        const int64_t n = r / (g.oh * g.ow), pix = r % (g.oh * g.ow), oy = pix / g.ow, ox = pix % g.ow;
        int count = 0;
        for (int64_t q = lane; q < words; q += 32) {
            uint32_t v = 0;
            if (q < kk * cw) {
                const int64_t t = q / cw, w = q % cw;
                const int64_t iy = oy * g.s - g.p + (t / g.k) * g.d, ix = ox * g.s - g.p + (t % g.k) * g.d;
                if (iy >= 0 && iy < g.h && ix >= 0 && ix < g.w) v = signs[((n * g.h + iy) * g.w + ix) * cw + w];
            }
            cols[r * words + q] = v;
            count += __popc(v);
        }
        for (int o = 16; o > 0; o >>= 1) count += __shfl_down_sync(0xffffffffu, count, o);
        if (lane == 0) popc[r] = count;
    }
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
    const int64_t cw = bie_cuda_conv_cw(g);
    const unsigned grid = blocks_for(g->n * cw * g->h * g->w, 256);
    cudaStream_t st = current_stream;
    switch (dtype) {
    case BIE_F32:
        pack_input<<<grid, 256, 0, st>>>(static_cast<const float *>(x), *g, cw, bias, scale_a, scale_w,
                                         saved_scales, signs, mask);
        break;
    case BIE_BF16:
        pack_input<<<grid, 256, 0, st>>>(static_cast<const __nv_bfloat16 *>(x), *g, cw, bias, scale_a,
                                         scale_w, saved_scales, signs, mask);
        break;
    case BIE_F16:
        pack_input<<<grid, 256, 0, st>>>(static_cast<const __half *>(x), *g, cw, bias, scale_a, scale_w,
                                         saved_scales, signs, mask);
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
    im2col_bits<<<blocks_for(rows * 32, 256), 256, 0, current_stream>>>(
        signs, *g, bie_cuda_conv_cw(g), ld, reinterpret_cast<uint32_t *>(cols), popc);
    return check(cudaGetLastError(), "cuda conv im2col");
}

bie_status bie_cuda_conv_corrections(const int *tapsum, const bie_cuda_conv_shape *g,
                                     const int *ylim, int ny, const int *xlim, int nx, int *corr) {
    corrections<<<blocks_for((int64_t)ny * nx * g->o, 256), 256, 0, current_stream>>>(tapsum, *g, ylim, xlim,
                                                                                     ny, nx, corr);
    return check(cudaGetLastError(), "cuda conv corrections");
}

}  // extern "C"
