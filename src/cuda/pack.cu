// Packing on the device: float activations (+ bias_a) into sign bits and clip-mask bits,
// int8/float weights into sign bits, user-format packed rows into the GEMM layout; plus the
// deterministic |x| sum that initialises scale_a.
//
// GEMM layout (see cuda_internal.h): rows of `ld` bytes (a multiple of kRowAlign), bit j of
// a row at byte j / 8, bit j % 8 (the bit stream of SPEC §1 with W = 8), zero past k; the
// row's popcount stored as partial counts, one per slice of the row (cuda_internal.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cuda_common.cuh"
#include "cuda_internal.h"
#include "dtype.cuh"
#include "pdl.cuh"
#include "tile_t.cuh"

namespace bie_cuda {

// Adds the warps' counts of a 256-thread block; thread 0 gets the total.
__device__ __forceinline__ int block_sum_256(int v) {
    __shared__ int partial[8];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = v;
    __syncthreads();
    int total = 0;
    if (threadIdx.x == 0)
        for (int i = 0; i < 8; i++) total += partial[i];
    return total;
}

// Block (row, slice) packs the slice's kRowSlice words of one row: warp w takes words w, w + 8,
// ..., lane l element 32 * word + l, and the ballot is the word. All loads of a lane are
// issued before the first ballot. Used for short inputs (m <= 16, the inference case: slices
// of 32 words, so that a single row is packed by many blocks at once); long ones use
// pack_words (slices of 256 words, 8192 bits).
// Activations: v = x + bias; sign bit v >= 0; mask bit -1 <= v / scale_a <= 1 (exactly the
// CPU's arithmetic). Block (0, 0) also snapshots the scales used into saved_scales.
constexpr int kRowSlice = 32;
template <typename T, bool ACT>
__global__ void __launch_bounds__(256)
    pack_rows(const T *__restrict__ x, int64_t k, const float *__restrict__ bias,
              const float *__restrict__ scale_a, const float *__restrict__ scale_w,
              float *saved_scales, int64_t ld, unsigned *__restrict__ bits,
              unsigned *__restrict__ mask, int *__restrict__ popc) {
    pdl_trigger();  // the GEMM that reads these rows may launch now
    const int64_t row = blockIdx.x;
    constexpr int PER_WARP = kRowSlice / 8;
    const int64_t words = ld / 4, w0 = (int64_t)blockIdx.y * kRowSlice;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const T *xr = x + row * k;
    const float bound = (ACT && mask) ? clip_bound(*scale_a) : 1.0f;
    float v[PER_WARP];
    bool valid[PER_WARP];
#pragma unroll
    for (int i = 0; i < PER_WARP; i++) {
        const int64_t c = (w0 + warp + 8 * i) * 32 + lane;
        valid[i] = c < k;
        v[i] = valid[i] ? to_f32(xr[c]) : 0.0f;
        if (ACT && bias && valid[i]) v[i] += bias[c];
    }
    int count = 0;
#pragma unroll
    for (int i = 0; i < PER_WARP; i++) {
        const int64_t w = w0 + warp + 8 * i;
        if (w >= words) break;  // uniform across the warp
        unsigned sb = __ballot_sync(0xffffffffu, valid[i] && v[i] >= 0.0f);
        if (ACT && mask) {
            unsigned mb = __ballot_sync(0xffffffffu, valid[i] && fabsf(v[i]) <= bound);
            if (lane == 0) mask[row * words + w] = mb;
        }
        if (lane == 0) {
            bits[row * words + w] = sb;
            count += __popc(sb);
        }
    }
    int total = block_sum_256(count);
    if (threadIdx.x == 0) popc[row * gridDim.y + blockIdx.y] = total;
    if (ACT && saved_scales && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) {
        saved_scales[0] = *scale_a;
        saved_scales[1] = *scale_w;
    }
}

// The long-row form of pack_rows (slices of 1024 bytes, m > 16): block (rows, slice) packs
// bytes of the slice of RB = rb rows (rows of 64 or 128 words share a block, so that no
// thread idles), per = 256 / rb threads a row. Thread t of a row makes bytes t, t + per,
// t + 2 per, t + 3 per of the slice, each from 8 elements: a warp's loads are contiguous
// (512 bytes of bf16) and its byte stores too. The same arithmetic and outputs as pack_rows. At
// most 64 registers: four blocks an SM.
template <typename T, bool ACT>
__global__ void __launch_bounds__(256, 4)
    pack_words(const T *__restrict__ x, int64_t rows, int64_t k, const float *__restrict__ bias,
               const float *__restrict__ scale_a, const float *__restrict__ scale_w,
               float *saved_scales, int64_t ld, int rb, bool vec_x, bool vec_bias,
               unsigned *__restrict__ bits, unsigned *__restrict__ mask, int *__restrict__ popc) {
    pdl_trigger();  // the GEMM that reads these rows may launch now
    const int per = 256 / rb, lr = (int)threadIdx.x / per, t = (int)threadIdx.x % per;
    const int64_t row = (int64_t)blockIdx.x * rb + lr;
    const int64_t b0 = (int64_t)blockIdx.y * 1024, slice = min((int64_t)1024, ld - b0);
    const float bound = (ACT && mask) ? clip_bound(*scale_a) : 1.0f;
    int count = 0;
    if (row < rows) {
        uint8_t *sbytes = reinterpret_cast<uint8_t *>(bits) + row * ld + b0;
        uint8_t *mbytes = mask ? reinterpret_cast<uint8_t *>(mask) + row * ld + b0 : nullptr;
        const T *xr = x + row * k + b0 * 8;
        // One byte of bits (and of the mask) from its 8 values v (left of them inside the row;
        // biased: bias_a already added).
        auto pack_byte = [&](int byte, float(&v)[8], int64_t left, bool biased = false) {
            if (ACT && bias && !biased) {
                float b[8];
                load_n(bias + (b0 + byte) * 8, vec_bias, left, b);
#pragma unroll
                for (int e = 0; e < 8; e++) v[e] += b[e];
            }
            unsigned sb = 0, mb = 0;
#pragma unroll
            for (int e = 0; e < 8; e++) {
                const bool valid = e < left;
                sb |= (unsigned)(valid && v[e] >= 0.0f) << e;
                if (ACT && mask) mb |= (unsigned)(valid && fabsf(v[e]) <= bound) << e;
            }
            sbytes[byte] = (uint8_t)sb;
            if (ACT && mask) mbytes[byte] = (uint8_t)mb;
            count += __popc(sb);
        };
        if (vec_x && t + 3 * per < slice && (b0 + t + 3 * per) * 8 + 8 <= k) {
            // All four bytes inside the row: the loads of D bytes in flight at once, as raw
            // words (a quarter of the registers of their floats), and with them bias_a's.
            constexpr int D = sizeof(T) == 4 ? 2 : 4;
            const bool with_bias = ACT && bias && vec_bias;
#pragma unroll
            for (int j0 = 0; j0 < 4; j0 += D) {
                RawN<8, T> raw[D];
                RawN<8, float> rbias[D];
#pragma unroll
                for (int j = 0; j < D; j++) {
                    raw[j].load(xr + (t + (j0 + j) * per) * 8);
                    if (with_bias) rbias[j].load(bias + (b0 + t + (j0 + j) * per) * 8);
                }
#pragma unroll
                for (int j = 0; j < D; j++) {
                    float v[8];
                    raw[j].unpack(v);
                    if (with_bias) {
                        float b[8];
                        rbias[j].unpack(b);
#pragma unroll
                        for (int e = 0; e < 8; e++) v[e] += b[e];
                    }
                    pack_byte(t + (j0 + j) * per, v, 8, with_bias);
                }
            }
        } else {
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int byte = t + j * per;
                if (byte >= slice) break;
                const int64_t left = k - (b0 + byte) * 8;
                float v[8];
                load_n(xr + byte * 8, vec_x, left, v);
                pack_byte(byte, v, left);
            }
        }
    }
    // Per row: its per / 32 warps' counts, in warp order.
    __shared__ int partial[8];
    for (int o = 16; o > 0; o >>= 1) count += __shfl_down_sync(0xffffffffu, count, o);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = count;
    __syncthreads();
    if (t == 0 && row < rows) {
        int total = 0;
        for (int i = 0; i < per / 32; i++) total += partial[threadIdx.x / 32 + i];
        popc[row * gridDim.y + blockIdx.y] = total;
    }
    if (ACT && saved_scales && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) {
        saved_scales[0] = *scale_a;
        saved_scales[1] = *scale_w;
    }
}

// The training forward's weight pass where the exact backward's grad_x product takes the ±1
// weight (backward_fp8.cu): the sign bits of the int8 weight [n][k] (ld = k / 8 bytes a row,
// k a multiple of 2048, so no padding byte) with their popcounts, and the ±1 values transposed,
// st [k][n] (V: 16-bit, or uint8_t for e4m3, the FP8 backward's), in one read of w instead of the
// bits' pass in the forward and signs_t over the bits in the backward. A block per 64 x 64 tile
// (n a multiple of 16): thread t reads 16 weights of row t / 4, stores their 16 sign bits (two
// bytes) and adds their popcount, summed over the row's four threads, to the row's part of this
// 8192-column slice (popc zeroed first: integer sums, the same in any order); 16-bit values leave
// through tile_put / tile_store_t, e4m3 bytes through a byte tile: thread t then stores 16 rows
// of column t / 4 (one 16-byte piece).
template <typename V>
__global__ void __launch_bounds__(256)
    weight_signs_t(const int8_t *__restrict__ w, int64_t n, int64_t k, uint8_t *__restrict__ bits,
                   int *__restrict__ popc, int parts, V *__restrict__ st) {
    const int t = (int)threadIdx.x, r = t >> 2, c16 = (t & 3) * 16;
    const int64_t r0 = (int64_t)blockIdx.y * 64, c0 = (int64_t)blockIdx.x * 64, row = r0 + r;
    float v[16];
    unsigned sb = 0;
    if (row < n) {
        const uint4 q = *reinterpret_cast<const uint4 *>(w + row * k + c0 + c16);
        const int8_t *x = reinterpret_cast<const int8_t *>(&q);
#pragma unroll
        for (int j = 0; j < 16; j++) {
            const bool pos = x[j] >= 0;  // the weight pack's sign (pack_words)
            sb |= (unsigned)pos << j;
            v[j] = pos ? 1.0f : -1.0f;
        }
        *reinterpret_cast<uint16_t *>(bits + row * (k / 8) + (c0 + c16) / 8) = (uint16_t)sb;
    } else {
#pragma unroll
        for (int j = 0; j < 16; j++) v[j] = 0.0f;
    }
    int count = __popc(sb);
    count += __shfl_xor_sync(0xffffffffu, count, 1);
    count += __shfl_xor_sync(0xffffffffu, count, 2);
    if ((t & 3) == 0 && row < n) atomicAdd(popc + row * parts + c0 / 8192, count);
    if constexpr (sizeof(V) == 2) {
        __shared__ V tile[64 * kTilePitch];
        tile_put(tile, t, v);
        __syncthreads();
        tile_store_t(tile, t, r0, c0, n, k, st);
    } else {
        constexpr int kPitch = 68;  // bytes a row of the byte tile (a multiple of 4)
        __shared__ uint32_t tile8[64 * kPitch / 4];
#pragma unroll
        for (int q = 0; q < 4; q++) {
            uint32_t word = 0;
#pragma unroll
            for (int j = 0; j < 4; j++)
                word |= (v[4 * q + j] > 0.0f ? 0x38u : 0xb8u) << (8 * j);  // e4m3 +1 / -1
            tile8[(r * kPitch + c16) / 4 + q] = word;
        }
        __syncthreads();
        const uint8_t *tb = reinterpret_cast<const uint8_t *>(tile8);
        const int col = t >> 2, x = t & 3;
        if (c0 + col < k && r0 + 16 * x < n) {
            uint32_t q[4] = {0, 0, 0, 0};
#pragma unroll
            for (int i = 0; i < 16; i++)
                q[i / 4] |= (uint32_t)tb[(16 * x + i) * kPitch + col] << (8 * (i % 4));
            *reinterpret_cast<uint4 *>(reinterpret_cast<uint8_t *>(st) + (c0 + col) * n + r0 +
                                       16 * x) = make_uint4(q[0], q[1], q[2], q[3]);
        }
    }
}

// User-format rows (src_stride bytes, k valid bits, garbage past k) into the GEMM layout.
__global__ void __launch_bounds__(256)
    repack_user_rows(const uint8_t *__restrict__ src, int64_t src_stride, int64_t k, int64_t ld,
                     unsigned *__restrict__ dst, int *__restrict__ popc) {
    const int64_t row = blockIdx.x, words = ld / 4, w0 = (int64_t)blockIdx.y * 256;
    const int64_t nbytes = (k + 7) >> 3;
    const uint8_t *s = src + row * src_stride;
    int count = 0;
    for (int64_t w = w0 + threadIdx.x; w < w0 + 256 && w < words; w += 256) {
        unsigned v = 0;
        for (int b = 0; b < 4; b++) {
            int64_t idx = w * 4 + b;
            if (idx < nbytes) v |= (unsigned)s[idx] << (8 * b);
        }
        int64_t valid = k - w * 32;  // bits of this word inside the row
        if (valid < 32) v &= valid > 0 ? (1u << valid) - 1u : 0u;
        dst[row * words + w] = v;
        count += __popc(v);
    }
    int total = block_sum_256(count);
    if (threadIdx.x == 0) popc[row * gridDim.y + blockIdx.y] = total;
}

// Deterministic sum of |x|: a fixed grid of partial sums in double, then one block adds them
// in a fixed order.
constexpr int kSumBlocks = 256;

template <typename T>
__global__ void __launch_bounds__(256)
    abs_sum_partial(const T *__restrict__ x, int64_t n, double *part) {
    double s = 0;
    for (int64_t i = (int64_t)blockIdx.x * 256 + threadIdx.x; i < n; i += (int64_t)kSumBlocks * 256)
        s += fabs((double)to_f32(x[i]));
    __shared__ double sh[256];
    sh[threadIdx.x] = s;
    __syncthreads();
    for (int o = 128; o > 0; o >>= 1) {
        if ((int)threadIdx.x < o) sh[threadIdx.x] += sh[threadIdx.x + o];
        __syncthreads();
    }
    if (threadIdx.x == 0) part[blockIdx.x] = sh[0];
}

__global__ void sum_partials(const double *part, int n, double *out) {
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        double s = 0;
        for (int i = 0; i < n; i++) s += part[i];
        *out = s;
    }
}

template <typename T, bool ACT>
void launch_pack(const void *x, int64_t rows, int64_t k, const float *bias, const float *scale_a,
                 const float *scale_w, float *saved_scales, int64_t ld, uint8_t *bits,
                 uint8_t *mask, int *popc) {
    const int parts = ACT ? bie_cuda_act_popc_parts(rows, ld) : bie_cuda_popc_parts(ld);
    dim3 grid((unsigned)rows, (unsigned)parts);
    if (parts == bie_cuda_popc_parts(ld)) {
        const int words = (int)(ld / 4), rb = words == 64 ? 4 : words == 128 ? 2 : 1;
        pack_words<T, ACT>
            <<<dim3((unsigned)((rows + rb - 1) / rb), (unsigned)parts), 256, 0, current_stream>>>(
                static_cast<const T *>(x), rows, k, bias, scale_a, scale_w, saved_scales, ld, rb,
                rows_aligned16<T>(x, k), rows_aligned16<float>(bias, 0),
                reinterpret_cast<unsigned *>(bits), reinterpret_cast<unsigned *>(mask), popc);
    } else
        pack_rows<T, ACT><<<grid, 256, 0, current_stream>>>(
            static_cast<const T *>(x), k, bias, scale_a, scale_w, saved_scales, ld,
            reinterpret_cast<unsigned *>(bits), reinterpret_cast<unsigned *>(mask), popc);
}

}  // namespace bie_cuda

using namespace bie_cuda;

extern "C" {

int64_t bie_cuda_row_stride(int64_t k) {
    return ((k + 7) / 8 + BIE_CUDA_ROW_ALIGN - 1) / BIE_CUDA_ROW_ALIGN * BIE_CUDA_ROW_ALIGN;
}

int bie_cuda_popc_parts(int64_t ld) { return (int)((ld + 1023) / 1024); }

int bie_cuda_act_popc_parts(int64_t m, int64_t ld) {
    return m <= 16 ? (int)(ld / 128) : bie_cuda_popc_parts(ld);
}

bie_status bie_cuda_pack_act(bie_dtype dtype, const void *x, int64_t m, int64_t k,
                             const float *bias, const float *scale_a, const float *scale_w,
                             float *saved_scales, int64_t ld, uint8_t *bits, uint8_t *mask,
                             int *popc) {
    switch (dtype) {
    case BIE_F32:
        launch_pack<float, true>(x, m, k, bias, scale_a, scale_w, saved_scales, ld, bits, mask,
                                 popc);
        break;
    case BIE_BF16:
        launch_pack<__nv_bfloat16, true>(x, m, k, bias, scale_a, scale_w, saved_scales, ld, bits,
                                         mask, popc);
        break;
    case BIE_F16:
        launch_pack<__half, true>(x, m, k, bias, scale_a, scale_w, saved_scales, ld, bits, mask,
                                  popc);
        break;
    default: return bie_fail(BIE_ERR_DTYPE, "cuda pack: dtype %s", bie_dtype_name(dtype));
    }
    return check(cudaGetLastError(), "cuda pack activations");
}

bie_status bie_cuda_pack_weight(bie_dtype dtype, const void *w, int64_t n, int64_t k, int64_t ld,
                                uint8_t *bits, int *popc) {
    if (dtype == BIE_I8)
        launch_pack<int8_t, false>(w, n, k, NULL, NULL, NULL, NULL, ld, bits, NULL, popc);
    else if (dtype == BIE_F32)
        launch_pack<float, false>(w, n, k, NULL, NULL, NULL, NULL, ld, bits, NULL, popc);
    else
        return bie_fail(BIE_ERR_DTYPE, "cuda pack: weight dtype %s", bie_dtype_name(dtype));
    return check(cudaGetLastError(), "cuda pack weight");
}

bool bie_cuda_weight_signs_shape(int64_t n, int64_t k) {
    return k % 2048 == 0 && n % 16 == 0 && n / 64 < 65535 && k / 64 <= 0x7fffffff;
}

bie_status bie_cuda_pack_weight_signs(const int8_t *w, int64_t n, int64_t k, int64_t ld,
                                      uint8_t *bits, int *popc, int es, bie_dtype dtype,
                                      void *signs_t) {
    if (!bie_cuda_weight_signs_shape(n, k) ||
        (es == 2 ? dtype != BIE_BF16 && dtype != BIE_F16 : es != 1) || ld != k / 8 ||
        reinterpret_cast<uintptr_t>(w) % 16 || reinterpret_cast<uintptr_t>(bits) % 2 ||
        reinterpret_cast<uintptr_t>(signs_t) % 16)
        return bie_fail(BIE_ERR_INTERNAL, "cuda weight signs: a %lld x %lld %s weight",
                        (long long)n, (long long)k, bie_dtype_name(dtype));
    const int parts = bie_cuda_popc_parts(ld);
    BIE_CUDA_TRY(check(cudaMemsetAsync(popc, 0, (size_t)(n * parts) * sizeof(int), current_stream),
                       "cudaMemsetAsync (weight popcounts)"));
    const dim3 grid((unsigned)(k / 64), (unsigned)((n + 63) / 64));
    if (es == 1)
        weight_signs_t<uint8_t><<<grid, 256, 0, current_stream>>>(w, n, k, bits, popc, parts,
                                                                  static_cast<uint8_t *>(signs_t));
    else if (dtype == BIE_BF16)
        weight_signs_t<__nv_bfloat16><<<grid, 256, 0, current_stream>>>(
            w, n, k, bits, popc, parts, static_cast<__nv_bfloat16 *>(signs_t));
    else
        weight_signs_t<__half><<<grid, 256, 0, current_stream>>>(w, n, k, bits, popc, parts,
                                                                 static_cast<__half *>(signs_t));
    return check(cudaGetLastError(), "cuda weight signs");
}

bie_status bie_cuda_repack_rows(const void *src, int64_t src_stride, int64_t rows, int64_t k,
                                int64_t ld, uint8_t *dst, int *popc) {
    dim3 grid((unsigned)rows, (unsigned)bie_cuda_popc_parts(ld));
    repack_user_rows<<<grid, 256, 0, current_stream>>>(static_cast<const uint8_t *>(src),
                                                       src_stride, k, ld,
                                                       reinterpret_cast<unsigned *>(dst), popc);
    return check(cudaGetLastError(), "cuda repack rows");
}

bie_status bie_cuda_abs_sum(bie_dtype dtype, const void *x, int64_t n, double *result) {
    cudaStream_t st = current_stream;
    double *ws = NULL;
    BIE_CUDA_TRY(check(cudaMallocAsync((void **)&ws, (kSumBlocks + 1) * sizeof(double), st),
                       "cudaMallocAsync"));
    switch (dtype) {
    case BIE_F32:
        abs_sum_partial<float><<<kSumBlocks, 256, 0, st>>>(static_cast<const float *>(x), n, ws);
        break;
    case BIE_BF16:
        abs_sum_partial<__nv_bfloat16>
            <<<kSumBlocks, 256, 0, st>>>(static_cast<const __nv_bfloat16 *>(x), n, ws);
        break;
    case BIE_F16:
        abs_sum_partial<__half><<<kSumBlocks, 256, 0, st>>>(static_cast<const __half *>(x), n, ws);
        break;
    default: break;
    }
    sum_partials<<<1, 32, 0, st>>>(ws, kSumBlocks, ws + kSumBlocks);
    cudaError_t err = cudaGetLastError();
    if (err == cudaSuccess)
        err = cudaMemcpyAsync(result, ws + kSumBlocks, sizeof(double), cudaMemcpyDeviceToHost, st);
    cudaError_t free_err = cudaFreeAsync(ws, st);
    if (err == cudaSuccess) err = cudaStreamSynchronize(st);
    BIE_CUDA_TRY(check(err, "cuda |x| sum"));
    return check(free_err, "cudaFreeAsync");
}

}  // extern "C"

namespace bie_cuda {
// out = x + bias[(i / run) % len]: linear rows (run 1, len k) or NCHW planes (run H W, len C).
template <typename T>
__global__ void add_bias_runs(const T *x, int64_t total, int64_t run, int64_t len,
                              const float *bias, T *out) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x)
        out[i] = from_f32<T>(to_f32(x[i]) + bias[(i / run) % len]);
}

bie_status add_bias(bie_dtype dtype, const void *x, int64_t total, int64_t run, int64_t len,
                    const float *bias, void *out) {
    int64_t blocks = (total + 255) / 256;
    unsigned grid = (unsigned)(blocks < 65535 ? (blocks > 0 ? blocks : 1) : 65535);
    cudaStream_t st = current_stream;
    switch (dtype) {
    case BIE_F32:
        add_bias_runs<<<grid, 256, 0, st>>>(static_cast<const float *>(x), total, run, len, bias,
                                            static_cast<float *>(out));
        break;
    case BIE_BF16:
        add_bias_runs<<<grid, 256, 0, st>>>(static_cast<const __nv_bfloat16 *>(x), total, run, len,
                                            bias, static_cast<__nv_bfloat16 *>(out));
        break;
    case BIE_F16:
        add_bias_runs<<<grid, 256, 0, st>>>(static_cast<const __half *>(x), total, run, len, bias,
                                            static_cast<__half *>(out));
        break;
    default: return bie_fail(BIE_ERR_DTYPE, "cuda add bias: dtype %s", bie_dtype_name(dtype));
    }
    return check(cudaGetLastError(), "cuda add bias");
}
}  // namespace bie_cuda

extern "C" bie_status bie_cuda_add_bias(bie_dtype dtype, const void *x, int64_t m, int64_t k,
                                        const float *bias, void *out) {
    return add_bias(dtype, x, m * k, 1, k, bias, out);
}

extern "C" bie_status bie_cuda_add_bias_planes(bie_dtype dtype, const void *x, int64_t n, int64_t c,
                                               int64_t hw, const float *bias, void *out) {
    return add_bias(dtype, x, n * c * hw, hw, c, bias, out);
}
