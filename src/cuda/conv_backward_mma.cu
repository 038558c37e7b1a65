// Binary conv2d backward (SPEC §3) on tensor cores, without im2col buffers: both gradient
// products are implicit GEMMs of our own (mma.sync m16n8k16, bfloat16 / float16 operands,
// f32 accumulators) that read grad_out where it lies and expand the saved activation sign
// bits on chip. Exact operands: ±1 and 0 are exact in both 16-bit types, so only the sums'
// order differs from the CPU.
//   grad_x  [n c h w] = mask * scale_w * sum over (tap, o) of grad_out at the output pixel the
//           tap maps the input pixel to, times sign(w[o, c, tap]). Tile: 128 input pixels x 64
//           input channels; K runs over taps x output channels (weight as ±1, tap-major).
//           The epilogue applies the clip mask and writes per-block channel sums of the masked
//           gradient and of its product with sign(x') (grad_bias_a, grad_scale_a).
//   grad_w  [o c k k] = scale_a * sum over output pixels of grad_out[o] * sign(x') at the
//           tap's input pixel (0 in the padding). Tile: 64 output channels x (32 input
//           channels x every tap); K runs over output pixels, split into slices whose
//           partial tiles are summed in a fixed order.
// Every reduction has a fixed shape and order: results do not vary from run to run. This file
// holds grad_x and the driver; grad_w's kernel is in conv_wgrad_mma.cu.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <type_traits>

#include "backward_common.cuh"
#include "conv_backward_mma.cuh"
#include "dtype.cuh"
#include "mma.cuh"
#include "wgmma_entry.cuh"

namespace bie_cuda {
namespace {

// The ±1 weight as grad_x's B operand, [tap][cp][op] (op, cp: O, C rounded up to the tile;
// 0 past them) from the forward's tap-layout rows (row o: per tap cw words of channel bits),
// in the 16-bit type E or, for the FP8 backward, as e4m3 bytes (E = uint8_t).
// Block (8 output channels, 256 (tap, channel) pairs): a thread makes its pair's 8 values, one
// store (op is a multiple of 8).
template <typename E> __device__ __forceinline__ E weight_value(float v) { return from_f32<E>(v); }
template <> __device__ __forceinline__ uint8_t weight_value<uint8_t>(float v) { return to_e4m3(v); }
template <typename E>
__global__ void __launch_bounds__(256)
    dgrad_weight(const uint32_t *__restrict__ bits, int words, bie_conv_geom g64, int cp, int op,
                 E *__restrict__ wt) {
    const int C = (int)g64.c, O = (int)g64.o, cw = (C + 31) / 32, kk = (int)(g64.k * g64.k);
    const int o0 = (int)blockIdx.x * 8, e = (int)blockIdx.y * 256 + (int)threadIdx.x;
    if (e >= kk * cp) return;
    const int t = e / cp, c = e - t * cp;
    __align__(16) E v[8];
#pragma unroll
    for (int j = 0; j < 8; j++) {
        float f = 0.0f;
        if (o0 + j < O && c < C) {
            const uint32_t w = bits[(int64_t)(o0 + j) * words + t * cw + (c >> 5)];
            f = (w >> (c & 31)) & 1 ? 1.0f : -1.0f;
        }
        v[j] = weight_value<E>(f);
    }
    if constexpr (sizeof(E) == 2)
        *reinterpret_cast<uint4 *>(wt + (int64_t)e * op + o0) = *reinterpret_cast<const uint4 *>(v);
    else
        *reinterpret_cast<uint2 *>(wt + (int64_t)e * op + o0) = *reinterpret_cast<const uint2 *>(v);
}

// The FP8 backward's gradient rows: NHWC grad_out [rows][O] to e4m3 of grad_out * 448 / amax
// (amax from the partial maxima in part; scales written as fp8_scale_of_partials does), rows
// of op8 bytes (0 past O): a thread per 8 channels of a row, one 16-byte load where `vec`
// (O % 8 == 0, g 16-byte aligned) and one 8-byte store; grid-stride over at most
// kFp8RowBlocks blocks, so that few blocks reduce the partial maxima.
constexpr unsigned kFp8RowBlocks = 1024;
template <typename T>
__global__ void __launch_bounds__(kAmaxBlocks)
    fp8_pixel_rows(const T *__restrict__ g, int64_t rows, int O, int op8, bool vec,
                   const float *__restrict__ part, float *__restrict__ scales,
                   uint8_t *__restrict__ g8) {
    const float s = fp8_scale_of_partials(part, scales);
    const int groups = op8 / 8;
    for (int64_t i = (int64_t)blockIdx.x * 256 + threadIdx.x; i < rows * groups;
         i += (int64_t)gridDim.x * 256) {
        const int64_t r = i / groups;
        const int c0 = (int)(i - r * groups) * 8;
        float f[8];
        load_n(g + r * O + c0, vec, O - c0, f);
        __align__(8) uint8_t v[8];
#pragma unroll
        for (int j = 0; j < 8; j++) v[j] = to_e4m3(f[j] * s);  // 0 past O
        *reinterpret_cast<uint2 *>(g8 + r * op8 + c0) = *reinterpret_cast<const uint2 *>(v);
    }
}

// NHWC grad_out [n oh ow][O] -> rows of op channels (0 for o >= O): grid-stride, one element
// a thread.
template <typename T>
__global__ void __launch_bounds__(256)
    pad_pixel_rows(const T *__restrict__ g, int64_t rows, int O, int op, T *__restrict__ gt) {
    const T zero = from_f32<T>(0.0f);
    for (int64_t i = (int64_t)blockIdx.x * 256 + threadIdx.x; i < rows * op;
         i += (int64_t)gridDim.x * 256) {
        const int64_t r = i / op;
        const int o = (int)(i - r * op);
        gt[i] = o < O ? g[r * O + o] : zero;
    }
}

// grad_out [n][o][oh ow] -> pixel-major [n oh ow][op] (0 for o >= O), so that a pixel's
// gradient row is contiguous: the GEMMs gather whole 16-byte rows of 8 channels. Block: 32
// pixels x 32 channels of one image through shared memory; blockIdx.x = image x pixel tiles.
template <typename T>
__global__ void __launch_bounds__(256)
    to_pixel_major(const T *__restrict__ g, int O, int hw, int op, T *__restrict__ gt) {
    __shared__ T tile[32][33];
    const int tiles = (hw + 31) / 32, n = blockIdx.x / tiles;
    const int p0 = (blockIdx.x - n * tiles) * 32, o0 = blockIdx.y * 32;
    const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
    const T zero = from_f32<T>(0.0f);
    for (int r = ty; r < 32; r += 8) {
        const int o = o0 + r, p = p0 + tx;
        tile[r][tx] = o < O && p < hw ? g[((int64_t)n * O + o) * hw + p] : zero;
    }
    __syncthreads();
    for (int r = ty; r < 32; r += 8) {
        const int p = p0 + r, o = o0 + tx;
        if (p < hw) gt[((int64_t)n * hw + p) * op + o] = tile[tx][r];
    }
}

// The same for 16-bit T with 16-byte accesses (hw a multiple of 8, g and gt 16-byte aligned,
// op a multiple of 64): 64 channels x 64 pixels per block, rows loaded 8 pixels at a time,
// each thread then writes 8 channels of two pixels; the 2-element-per-access form was
// ALU-bound at a fifth of the memory bandwidth. Tile words hold two pixels of a channel.
template <typename T>
__global__ void __launch_bounds__(256)
    to_pixel_major_x8(const T *__restrict__ g, int O, int hw, int op, T *__restrict__ gt) {
    static_assert(sizeof(T) == 2, "16-bit elements");
    __shared__ __align__(16) uint32_t tile[64][36];  // [channel][pixel pair], padded rows
    const int tiles = (hw + 63) / 64, n = blockIdx.x / tiles;
    const int p0 = (blockIdx.x - n * tiles) * 64, o0 = blockIdx.y * 64, t = threadIdx.x;
    for (int i = t; i < 512; i += 256) {
        const int r = i >> 3, q = i & 7, o = o0 + r, p = p0 + q * 8;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (o < O && p < hw)
            v = __ldg(reinterpret_cast<const uint4 *>(g + ((int64_t)n * O + o) * hw + p));
        *reinterpret_cast<uint4 *>(&tile[r][q * 4]) = v;
    }
    __syncthreads();
    const int pp = t & 31, cg = t >> 5, p = p0 + 2 * pp;
    if (p >= hw) return;
    uint32_t w[8];
#pragma unroll
    for (int j = 0; j < 8; j++) w[j] = tile[cg * 8 + j][pp];
    // Channel pairs of pixel p (low halves) and of pixel p + 1 (high halves).
    const uint4 lo = make_uint4(__byte_perm(w[0], w[1], 0x5410), __byte_perm(w[2], w[3], 0x5410),
                                __byte_perm(w[4], w[5], 0x5410), __byte_perm(w[6], w[7], 0x5410));
    const uint4 hi = make_uint4(__byte_perm(w[0], w[1], 0x7632), __byte_perm(w[2], w[3], 0x7632),
                                __byte_perm(w[4], w[5], 0x7632), __byte_perm(w[6], w[7], 0x7632));
    T *out = gt + ((int64_t)n * hw + p) * op + o0 + cg * 8;
    *reinterpret_cast<uint4 *>(out) = lo;
    *reinterpret_cast<uint4 *>(out + op) = hi;  // p + 1 < hw: hw is even
}

// The grad_x kernels' epilogue: scale_w, the clip mask, grad_x in its dtype, and the
// tile's per-channel sums of the masked gradient and of its product with sign(x'), written to
// part_sum / part_dot [tile][c] (tile = blockIdx.x) in a fixed order. The block's 8 warps are
// 4 (pixels, MI m16 tiles each) x 2 (channels, 32 each); tile row r is the flat input pixel
// (n h w) pixel_of(r), none where that is negative.
template <typename T, int MI, class PixelOf>
__device__ __forceinline__ void dgrad_epilogue(
    const float (&acc)[MI][4][4], PixelOf pixel_of, const uint32_t *__restrict__ mask,
    const uint32_t *__restrict__ signs, const float *__restrict__ scales, const bie_conv_geom &g64,
    T *__restrict__ grad_x, float *__restrict__ part_sum, float *__restrict__ part_dot) {
    __shared__ float red[2][4][kDgN];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gq = lane >> 2, tq = lane & 3;
    const int wm = warp & 3, wn = warp >> 2, c0 = blockIdx.y * kDgN;
    const int C = (int)g64.c, HW = (int)(g64.h * g64.w);
    const float sw = scales[1];
    const int cw = (C + 31) / 32, word = (c0 + wn * 32) >> 5;
    float csum[4][2] = {}, cdot[4][2] = {};
#pragma unroll
    for (int mi = 0; mi < MI; mi++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int qq = pixel_of(wm * 16 * MI + mi * 16 + gq + 8 * h);
            if (qq < 0 || word >= cw) continue;
            const uint32_t mw = mask[(int64_t)qq * cw + word], sg = signs[(int64_t)qq * cw + word];
            const int n = qq / HW, pix = qq - n * HW;
#pragma unroll
            for (int ni = 0; ni < 4; ni++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int b = ni * 8 + 2 * tq + e, c = c0 + wn * 32 + b;
                    if (c >= C) continue;
                    const float v = (mw >> b) & 1 ? acc[mi][ni][2 * h + e] * sw : 0.0f;
                    if (grad_x)
                        grad_x[g64.nhwc ? (int64_t)qq * C + c : ((int64_t)n * C + c) * HW + pix] =
                            from_f32<T>(v);
                    csum[ni][e] += v;
                    cdot[ni][e] += (sg >> b) & 1 ? v : -v;
                }
        }
#pragma unroll
    for (int ni = 0; ni < 4; ni++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
#pragma unroll
            for (int off = 4; off < 32; off <<= 1) {
                csum[ni][e] += __shfl_xor_sync(0xffffffffu, csum[ni][e], off);
                cdot[ni][e] += __shfl_xor_sync(0xffffffffu, cdot[ni][e], off);
            }
            if (gq == 0) {
                red[0][wm][wn * 32 + ni * 8 + 2 * tq + e] = csum[ni][e];
                red[1][wm][wn * 32 + ni * 8 + 2 * tq + e] = cdot[ni][e];
            }
        }
    __syncthreads();
    if (tid < kDgN && c0 + tid < C) {
        const int64_t at = (int64_t)blockIdx.x * C + c0 + tid;
        part_sum[at] = ((red[0][0][tid] + red[0][1][tid]) + red[0][2][tid]) + red[0][3][tid];
        part_dot[at] = ((red[1][0][tid] + red[1][1][tid]) + red[1][2][tid]) + red[1][3][tid];
    }
}

// The grad_x kernels' B operand. One step's weight tile: the ±1 weight [tap][cp][op] rows of
// the block's kDgN channels at tap t, output channels o0 .., into the stage's rows bs (each
// thread two 16-byte chunks of row threadIdx.x / 4).
template <typename T>
__device__ __forceinline__ void dgrad_issue_weights(T (*bs)[kDgPitch], const T *__restrict__ wt,
                                                    int t, int cp, int c0, int op, int o0) {
    const int row = threadIdx.x >> 2, chunk = (threadIdx.x & 3) * 2;
    const T *src = wt + ((int64_t)t * cp + c0 + row) * op + o0;
#pragma unroll
    for (int c = 0; c < 2; c++)
        cp_async16(smem_u32(&bs[row][(chunk + c) * 8]), src + (chunk + c) * 8, true);
}

// The products of one k16 step: this warp's B fragments (its 32 channels of the stage's rows
// bs, warps as 4 x 2 with the channels' warp index warp / 4) against the A fragments af.
template <typename T, int MI>
__device__ __forceinline__ void dgrad_products(float (&acc)[MI][4][4], const unsigned (&af)[MI][4],
                                               const T (*bs)[kDgPitch], int ks) {
    const int lane = threadIdx.x & 31, wn = threadIdx.x >> 7;
    unsigned bf[2][4];
#pragma unroll
    for (int np = 0; np < 2; np++)
        ldmatrix_x4(
            bf[np],
            smem_u32(
                &bs[wn * 32 + np * 16 + (lane & 7) + (lane >> 4) * 8][ks + ((lane >> 3) & 1) * 8]));
#pragma unroll
    for (int mi = 0; mi < MI; mi++)
#pragma unroll
        for (int ni = 0; ni < 4; ni++)
            mma16816<T>(acc[mi][ni], af[mi], bf[ni >> 1][(ni & 1) * 2],
                        bf[ni >> 1][(ni & 1) * 2 + 1]);
}

// The grad_x kernels' K loop over a kDgStages-deep cp.async ring: issue(step, stage) starts
// copying a step's operands kDgStages - 1 steps ahead, body(step, stage) multiplies them once
// they have landed; all copies are complete on return.
template <class Issue, class Body>
__device__ __forceinline__ void dgrad_pipeline(int steps, Issue &issue, Body &&body) {
#pragma unroll
    for (int st = 0; st < kDgStages - 1; st++) {
        if (st < steps) issue(st, st);
        cp_async_commit();
    }
    for (int step = 0; step < steps; step++) {
        cp_async_wait<kDgStages - 2>();
        __syncthreads();
        const int next = step + kDgStages - 1;
        if (next < steps) issue(next, next % kDgStages);
        cp_async_commit();
        body(step, step % kDgStages);
    }
    cp_async_wait<0>();
}

// grad_x shared memory: stages x (A [kDgM][kDgPitch] + B [kDgN][kDgPitch]) of T.
template <typename T> constexpr size_t dgrad_smem() {
    return (size_t)kDgStages * (kDgM + kDgN) * kDgPitch * sizeof(T);
}

// The input pixels of a strided convolution split by phase (y mod S, x mod S), S = stride
// (S = 1: one phase, every pixel): a phase's pixels are read by the same taps (those with
// (phase + p - tap d) a multiple of s), so its blocks run over those taps alone instead of
// multiplying zero rows for the others (3/4 of the products of a 3 x 3, stride-2 layer).
// Phase ph = (ph / S, ph % S) owns the pixel tiles first[ph] .. first[ph + 1] - 1.
constexpr int kMaxPhases = kDgradMaxPhases;
using DgradPhases = DgradPhaseSplit;  // (wgmma_entry.cuh: the wgmma kernel takes it too)

// grad_x: block (pixel tile, channel tile), 8 warps as 4 (pixels) x 2 (channels) of 32 x 32.
// A tile's pixels are kDgM consecutive pixels of one phase, in (n, y, x) order. Each K step is
// one of the phase's taps and kDgK output channels: every pixel's row of the pixel-major
// gradient at the output pixel the tap maps it to (zeros where none), copied asynchronously
// kDgStages - 1 steps ahead. part_sum / part_dot [pixel tile][c]: the tile's masked-gradient
// sums per channel.
template <typename T>
__global__ void __launch_bounds__(256)
    dgrad_mma(const T *__restrict__ gt, const T *__restrict__ wt, const uint32_t *__restrict__ mask,
              const uint32_t *__restrict__ signs, const float *__restrict__ scales,
              bie_conv_geom g64, DgradPhases phases, int op, int cp, T *__restrict__ grad_x,
              float *__restrict__ part_sum, float *__restrict__ part_dot) {
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ int taps[16];  // the phase's taps (k <= 3)
    typedef T Row[kDgPitch];
    Row *as = reinterpret_cast<Row *>(smem);  // [stage * kDgM + m]
    Row *bs = reinterpret_cast<Row *>(smem + (size_t)kDgStages * kDgM * kDgPitch * sizeof(T));
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp & 3;
    const DgradPhaseTile pt = dgrad_phase_tile(g64, phases.split, phases.first, kDgM);
    const int m0 = pt.m0, c0 = blockIdx.y * kDgN;
    const int ntaps = dgrad_phase_taps(g64, pt, taps);
    __syncthreads();

    // This thread's A row (one input pixel, half of its 8 16-byte chunks) and B rows.
    const int am = tid >> 1, ach = (tid & 1) * 4;
    const DgradGather px(g64, pt.pixel_of(m0 + am));
    const int per_tap = op / kDgK, steps = ntaps * per_tap;
    auto issue = [&](int step, int stage) {
        const int tn = step / per_tap, o0 = (step - tn * per_tap) * kDgK, t = taps[tn];
        const int row = px.row(g64, t);
        const bool ok = row >= 0;
        const T *src = gt + (ok ? (int64_t)row * op + o0 : 0);
        Row &ar = as[stage * kDgM + am];
#pragma unroll
        for (int c = 0; c < 4; c++)
            cp_async16(smem_u32(&ar[(ach + c) * 8]), src + (ach + c) * 8, ok);
        dgrad_issue_weights<T>(bs + stage * kDgN, wt, t, cp, c0, op, o0);
    };

    float acc[2][4][4] = {};
    dgrad_pipeline(steps, issue, [&](int step, int stage) {
#pragma unroll
        for (int ks = 0; ks < kDgK; ks += 16) {
            unsigned af[2][4];
#pragma unroll
            for (int mi = 0; mi < 2; mi++)
                ldmatrix_x4(
                    af[mi],
                    smem_u32(
                        &as[stage * kDgM + wm * 32 + mi * 16 + (lane & 15)][ks + (lane >> 4) * 8]));
            dgrad_products<T, 2>(acc, af, bs + stage * kDgN, ks);
        }
    });

    dgrad_epilogue<T, 2>(
        acc, [=](int r) { return pt.pixel_of(m0 + r); }, mask, signs, scales, g64, grad_x, part_sum,
        part_dot);
}

// grad_x of a stride-1 convolution whose output has the input's size (OH = H, OW = W): the
// same GEMM as dgrad_mma, but a block's tile is `tr` whole rows of the flattened [n h] image
// rows (tr W <= 64 MI pixels: MI m16 tiles per warp) and, for each kDgK output channels, it copies
// the pixel-major gradient rows its taps read once (tr + (k - 1) d rows, the halo) instead of once
// per tap; each tap's A fragments are gathered from it by the ldmatrix row addresses (a zero row
// where the tap leaves the image). Steps run over (channel chunk, tap), taps inner; the halo of a
// chunk is copied with its first tap's weights, two steps ahead, into one of two buffers (one
// where op is a single chunk: less shared memory, more resident blocks). At most 128 registers
// (two blocks' worth per SM): one block per SM leaves its halo copy and its epilogue exposed.
constexpr int kHaloFillPerSm = 2;  // blocks per SM that keep the device busy; else MI = 2
__host__ __device__ constexpr size_t dgrad_halo_smem(int tr, int k, int d, int w, int esize,
                                                     int op) {
    return ((size_t)dgrad_halo_buffers(op) * (tr + (k - 1) * d) * w + kDgStages * kDgN + 1) *
           kDgPitch * esize;
}

template <typename T, int MI>
__global__ void __launch_bounds__(256, 2)
    dgrad_halo_mma(const T *__restrict__ gt, const T *__restrict__ wt,
                   const uint32_t *__restrict__ mask, const uint32_t *__restrict__ signs,
                   const float *__restrict__ scales, bie_conv_geom g64, int op, int cp, int tr,
                   T *__restrict__ grad_x, float *__restrict__ part_sum,
                   float *__restrict__ part_dot) {
    extern __shared__ __align__(16) unsigned char smem[];
    typedef T Row[kDgPitch];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp & 3;
    const int H = (int)g64.h, W = (int)g64.w, NH = (int)g64.n * H, k = (int)g64.k;
    const int kk = k * k, p = (int)g64.p, d = (int)g64.d;
    const int hpix = (tr + (k - 1) * d) * W, gy0 = blockIdx.x * tr, c0 = blockIdx.y * kDgN;
    Row *halo = reinterpret_cast<Row *>(smem);       // [2][hpix]
    Row *bs = halo + dgrad_halo_buffers(op) * hpix;  // [kDgStages][kDgN]
    Row *zero = bs + kDgStages * kDgN;
    if (tid < 8) *reinterpret_cast<uint4 *>(&zero[0][tid * 8]) = make_uint4(0, 0, 0, 0);

    // The A rows this lane addresses: tile row, column and image row of pixel m of each m16.
    int ltr[MI], lx[MI], ly[MI];
    bool lok[MI];
#pragma unroll
    for (int mi = 0; mi < MI; mi++) {
        const int m = wm * 16 * MI + mi * 16 + (lane & 15), r = m / W, gy = gy0 + r;
        ltr[mi] = r;
        lx[mi] = m - r * W;
        lok[mi] = r < tr && gy < NH;
        ly[mi] = gy % H;
    }
    const int steps = op / kDgK * kk;
    auto issue = [&](int step, int stage) {
        const int oc = step / kk, t = step - oc * kk, o0 = oc * kDgK;
        if (t == 0)
            dgrad_copy_halo<T>(halo + (oc & 1) * hpix, gt, gy0, p, k, d, W, NH, hpix, op, o0);
        dgrad_issue_weights<T>(bs + stage * kDgN, wt, t, cp, c0, op, o0);
    };

    float acc[MI][4][4] = {};
    dgrad_pipeline(steps, issue, [&](int step, int stage) {
        const int oc = step / kk, t = step - oc * kk, i = t / k;
        const int j = t - i * k;
        const Row *hb = halo + (oc & 1) * hpix;
        unsigned aaddr[MI];
#pragma unroll
        for (int mi = 0; mi < MI; mi++) {
            const int oy = ly[mi] + p - i * d, ox = lx[mi] + p - j * d;
            const bool ok = lok[mi] && oy >= 0 && oy < H && ox >= 0 && ox < W;
            aaddr[mi] = smem_u32(ok ? &hb[(ltr[mi] + (k - 1 - i) * d) * W + ox][0] : &zero[0][0]) +
                        (lane >> 4) * 16;
        }
#pragma unroll
        for (int ks = 0; ks < kDgK; ks += 16) {
            unsigned af[MI][4];
#pragma unroll
            for (int mi = 0; mi < MI; mi++) ldmatrix_x4(af[mi], aaddr[mi] + ks * (int)sizeof(T));
            dgrad_products<T, MI>(acc, af, bs + stage * kDgN, ks);
        }
    });
    const int m0 = gy0 * W, rows = min(tr * W, NH * W - m0);
    dgrad_epilogue<T, MI>(
        acc, [=](int r) { return r < rows ? m0 + r : -1; }, mask, signs, scales, g64, grad_x,
        part_sum, part_dot);
}

// Per channel (one block each): grad_bias[c] = sum of the tiles' sums, dots[c] = of their dots.
__global__ void __launch_bounds__(256)
    dgrad_channel_sums(const float *part_sum, const float *part_dot, int64_t tiles, int c,
                       float *grad_bias, double *dots) {
    __shared__ double sh[2][256];
    const int ch = blockIdx.x;
    double s = 0, t = 0;
    for (int64_t i = threadIdx.x; i < tiles; i += 256) {
        s += part_sum[i * c + ch];
        t += part_dot[i * c + ch];
    }
    sh[0][threadIdx.x] = s;
    sh[1][threadIdx.x] = t;
    __syncthreads();
    for (int o = 128; o > 0; o >>= 1) {
        if ((int)threadIdx.x < o) {
            sh[0][threadIdx.x] += sh[0][threadIdx.x + o];
            sh[1][threadIdx.x] += sh[1][threadIdx.x + o];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        grad_bias[ch] = (float)sh[0][0];
        dots[ch] = sh[1][0];
    }
}

// grad_w = scale_a * the slices' partial tiles summed in order; where amax, the block's
// largest |grad_w| into amax[blockIdx.x] (the grid is then kAmaxBlocks blocks). Blocks of
// kSumThreads, so that kAmaxBlocks of them fill the device.
constexpr int kSumThreads = 1024;
__global__ void __launch_bounds__(kSumThreads)
    wgrad_sum_slices(const float *part, int slices, int64_t count, const float *scales,
                     float *grad_w, float *amax) {
    const float sa = scales[0];
    float a = 0.0f;
    for (int64_t e = (int64_t)blockIdx.x * kSumThreads + threadIdx.x; e < count;
         e += (int64_t)gridDim.x * kSumThreads) {
        float v = 0.0f;
        for (int z = 0; z < slices; z++) v += part[(int64_t)z * count + e];
        grad_w[e] = sa * v;
        a = fmaxf(a, fabsf(sa * v));
    }
    if (amax == nullptr) return;
    a = block_max<kSumThreads>(a);
    if (threadIdx.x == 0) amax[blockIdx.x] = a;
}

unsigned blocks_for(int64_t count) {
    return (unsigned)std::max<int64_t>(1, std::min<int64_t>((count + 255) / 256, 65535));
}

// Of the block slots that a launch's waves offer (slots per wave), the fraction holding a
// block: a last wave a quarter full leaves the device three quarters idle for its length.
double wave_fill(int64_t blocks, int64_t slots) {
    const int64_t waves = (blocks + slots - 1) / slots;
    return (double)blocks / (double)(waves * slots);
}
constexpr double kWaveFillMin = 0.8;  // below it, narrower tiles are tried

// grad_w blocks per SM to aim for (kSlicesPerSm), or BIE_CUDA_WGRAD_SLICES=1..8 (to time the
// K split's partial tiles and their sum against the blocks in flight).
int wgrad_slices_per_sm() {
    static const int per = [] {
        const char *e = std::getenv("BIE_CUDA_WGRAD_SLICES");
        const int v = e != nullptr ? std::atoi(e) : 0;
        return v >= 1 && v <= 8 ? v : kSlicesPerSm;
    }();
    return per;
}

// The halo grad_x kernel's widest tile: MI = 4 (256 pixels), or 2 where BIE_CUDA_DGRAD_MI=2
// (to time one against the other).
int dgrad_halo_widest() {
    static const int mi = env_is("BIE_CUDA_DGRAD_MI", "2") ? 2 : 4;
    return mi;
}

// The wgmma forms of grad_x (conv_dgrad_wgmma.cu) and of 3 x 3 grad_w (conv_wgrad_wgmma.cu)
// where the device runs them, unless BIE_CUDA_DGRAD_WGMMA=0 / BIE_CUDA_WGRAD_WGMMA=0 asks for
// the mma.sync kernels (to time one against the other, and to test both on Hopper). On an
// H200 they took 10-15 % less time than mma.sync (BENCHMARKS.md).
bool dgrad_wgmma_wanted() {
    static const bool on = !env_is("BIE_CUDA_DGRAD_WGMMA", "0");
    return on;
}
int dgrad_wgmma_nb() {
    static const int nb = env_is("BIE_CUDA_DGRAD_NB", "64") ? 64 : 128;
    return nb;
}
// grad_x of channels-last layers through the TMA kernel (conv_dgrad_tma.cu) where it takes
// the layer, unless BIE_CUDA_DGRAD_TMA=0 (to time it against the halo kernel).
bool dgrad_tma_wanted() {
    static const bool on = !env_is("BIE_CUDA_DGRAD_TMA", "0");
    return on;
}
// grad_w of 3 x 3 layers of stride 1 or 2 through the TMA kernel (conv_wgrad_tma.cu), unless
// BIE_CUDA_WGRAD_TMA=0 (to time it against conv_wgrad_wgmma.cu).
bool wgrad_tma_wanted() {
    static const bool on = !env_is("BIE_CUDA_WGRAD_TMA", "0");
    return on;
}
bool wgrad_wgmma_wanted() {
    static const bool on = !env_is("BIE_CUDA_WGRAD_WGMMA", "0");
    return on;
}

template <typename T> bie_status backward_mma_typed(const bie_cuda_bconv_backward_args &a) {
    cudaStream_t st = current_stream;
    const bie_conv_geom &g = a.g;
    const int64_t sms = device_sms();
    const int kk = (int)(g.k * g.k), cp = (int)((g.c + kDgN - 1) / kDgN * kDgN);
    const int op = (int)((g.o + kDgK - 1) / kDgK * kDgK);
    // grad_x through the halo kernel where it applies (stride 1, same size, rows that fit):
    // 256-pixel tiles (MI = 4), or 128 (MI = 2) where those would leave the device idle or
    // fill the launch's last wave clearly worse (128x28x28, N = 64: 400 blocks of 256 pixels
    // are 1.5 waves; 896 of 128 pixels, 3.4 waves, ran 14 % faster on an H200).
    // On wgmma, where the padded channels are a multiple of 128, 128-pixel tiles of 128
    // channels a block rather than 256-pixel tiles of 64 (the same accumulators per thread;
    // each gathered fragment feeds twice the products), unless BIE_CUDA_DGRAD_NB=64.
    // The other layers' grad_x (dgrad_mma) on wgmma too (conv_dgrad_phase_wgmma.cu), with 128
    // channels a block likewise.
    const bool halo_shape = g.s == 1 && g.k > 1 && g.oh == g.h && g.ow == g.w;
    const bool wg_dgrad = dgrad_wgmma_wanted() && wgmma_usable();
    const int wg_nb = wg_dgrad && cp % 128 == 0 && dgrad_wgmma_nb() == 128 ? 128 : 64;
    const int halo_nb = halo_shape ? wg_nb : 64;
    int halo_mi = 0, halo_rows = 0;
    size_t halo_smem = 0;
    const int64_t slots = kHaloFillPerSm * sms;
    if (halo_shape) {
        int64_t wider_blocks = 0;
        double wider_fill = 0;
        for (int mi = halo_nb == 128 ? 2 : dgrad_halo_widest(); mi >= 2; mi -= 2) {
            const int rows = (int)(64 * mi / g.w);
            if (rows < 1) break;
            const size_t smem =
                dgrad_halo_smem(rows, (int)g.k, (int)g.d, (int)g.w, (int)sizeof(T), op);
            const int64_t blocks = (g.n * g.h + rows - 1) / rows * (cp / halo_nb);
            if (smem > kHaloSmemMax) continue;
            const double fill = wave_fill(blocks, slots);
            if (halo_mi != 0 && wider_blocks >= slots && fill <= wider_fill) break;
            halo_mi = mi, halo_rows = rows, halo_smem = smem;
            wider_blocks = blocks, wider_fill = fill;
            if (blocks >= slots && fill >= kWaveFillMin) break;
        }
    }
    const bool use_halo = halo_mi != 0;
    // The halo kernel on wgmma (conv_dgrad_wgmma.cu) where the device runs it.
    const bool halo_wgmma =
        use_halo && dgrad_wgmma_wanted() && wgmma_usable() &&
        dgrad_halo_wgmma_smem(halo_rows, (int)g.k, (int)g.d, (int)g.w, op, halo_nb) <= kHaloSmemMax;
    DgradTmaTiles tma_tiles = {};
    const bool dgrad_tma = wg_dgrad && dgrad_tma_wanted() && dgrad_tma_tiles(g, &tma_tiles);
    DgradPhases phases = {};
    phases.split = g.s > 1 && g.s * g.s <= kMaxPhases ? (int)g.s : 1;
    for (int ph = 0, sp = phases.split; ph < sp * sp; ph++) {
        const int64_t hr = (g.h - ph / sp + sp - 1) / sp, wr = (g.w - ph % sp + sp - 1) / sp;
        phases.first[ph + 1] = phases.first[ph] + (int)((g.n * hr * wr + kDgM - 1) / kDgM);
    }
    const int64_t tiles = dgrad_tma  ? tma_tiles.tiles
                          : use_halo ? (g.n * g.h + halo_rows - 1) / halo_rows
                                     : phases.first[phases.split * phases.split];
    const int64_t ckk = g.c * kk;
    const int64_t ohw = g.oh * g.ow, chunks = (g.n * ohw + kBK - 1) / kBK;
    const int64_t xy = ((g.o + kWgM - 1) / kWgM) * bie_cuda_conv_cw(&g);
    // Slices of K for grad_w: enough blocks to fill the device, partial tiles <= 64 MiB.
    int64_t slices =
        std::min<int64_t>(chunks, std::max<int64_t>(1, wgrad_slices_per_sm() * sms / xy));
    slices = std::max<int64_t>(
        1, std::min<int64_t>(slices, ((int64_t)64 << 20) / (4 * std::max<int64_t>(1, g.o * ckk))));
    const int64_t per_slice = (chunks + slices - 1) / slices;
    slices = (chunks + per_slice - 1) / per_slice;
    // grad_w of 3 x 3 layers of stride 1 or 2 through the TMA kernel (one block per SM), with its
    // own K slices.
    WgradTmaTiles wgrad_tiles = {};
    const bool wgrad_tma = g.k == 3 && wgrad_wgmma_wanted() && wgrad_tma_wanted() &&
                           wgmma_usable() && wgrad_tma_plan(g, sms, &wgrad_tiles);
    if (wgrad_tma) slices = wgrad_tiles.slices;

    // NHWC grad_out is already pixel-major: used in place where its rows are op channels.
    const bool gt_in_place =
        g.nhwc && op == g.o && reinterpret_cast<uintptr_t>(a.grad_out) % 16 == 0;
    // The opt-in FP8 grad_x where the TMA kernel takes the layer: e4m3 weight tiles and gradient
    // rows of op8 channels (128-channel K steps), grad_out scaled by 448 / amax and rounded
    // once; grad_w stays exact. The 16-bit weight tiles are then not needed.
    const bool fp8 = a.fp8 && dgrad_tma;
    const int op8 = (int)((g.o + 127) / 128 * 128);
    Workspace<10> ws;
    BIE_CUDA_TRY(ws.alloc({fp8 ? 0 : (size_t)kk * cp * op * sizeof(T),
                           gt_in_place ? 0 : (size_t)(g.n * ohw * op) * sizeof(T),
                           (size_t)(2 * tiles * g.c) * sizeof(float), (size_t)g.c * sizeof(double),
                           (size_t)(slices * g.o * ckk) * sizeof(float), amax_workspace_bytes(),
                           wgrad_tma ? wgrad_tma_xs_bytes(g) : 0, fp8 ? (size_t)kk * cp * op8 : 0,
                           fp8 ? (size_t)(g.n * ohw * op8) : 0, fp8 ? 2 * sizeof(float) : 0},
                          "cudaMallocAsync (conv backward workspace)"));
    T *wt = ws.at<T>(0);
    uint8_t *wt8 = ws.at<uint8_t>(7), *g8 = ws.at<uint8_t>(8);
    float *fp8_scales = ws.at<float>(9);
    T *gt = gt_in_place ? const_cast<T *>(static_cast<const T *>(a.grad_out)) : ws.at<T>(1);
    float *part_sum = ws.at<float>(2), *part_dot = part_sum + tiles * g.c;
    double *dots = ws.at<double>(3);
    float *wpart = ws.at<float>(4);
    float *amax = ws.at<float>(5);

    bie_status s = check(
        use_halo ? cudaFuncSetAttribute(halo_mi == 4 ? dgrad_halo_mma<T, 4> : dgrad_halo_mma<T, 2>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, (int)halo_smem)
                 : cudaFuncSetAttribute(dgrad_mma<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)dgrad_smem<T>()),
        "cudaFuncSetAttribute (conv grad_x)");
    if (s == BIE_OK) {
        const dim3 tiles_grid((unsigned)((fp8 ? op8 : op) / 8), (unsigned)((kk * cp + 255) / 256));
        const uint32_t *wbits = reinterpret_cast<const uint32_t *>(a.wbits);
        if (fp8) {
            const T *go = static_cast<const T *>(a.grad_out);
            const int64_t rows = g.n * ohw;
            dgrad_weight<uint8_t>
                <<<tiles_grid, 256, 0, st>>>(wbits, (int)(a.ld / 4), g, cp, op8, wt8);
            amax_partials(go, rows * g.o, amax);
            const bool vec = g.o % 8 == 0 && reinterpret_cast<uintptr_t>(go) % 16 == 0;
            fp8_pixel_rows<T>
                <<<std::min(blocks_for(rows * (op8 / 8)), kFp8RowBlocks), kAmaxBlocks, 0, st>>>(
                    go, rows, (int)g.o, op8, vec, amax, fp8_scales, g8);
        } else {
            dgrad_weight<T><<<tiles_grid, 256, 0, st>>>(wbits, (int)(a.ld / 4), g, cp, op, wt);
        }
        if (!gt_in_place) conv_pixel_rows<T>(g, a.grad_out, op, gt);
        // The wgmma kernels' arguments; each kernel's tiling set below.
        DgradHaloArgs w = {std::is_same<T, __half>::value,
                           1,
                           64,
                           dim3(),
                           0,
                           gt,
                           wt,
                           a.mask,
                           a.signs,
                           a.saved_scales,
                           g,
                           op,
                           cp,
                           0,
                           a.grad_x,
                           part_sum,
                           part_dot,
                           false,
                           nullptr,
                           nullptr,
                           nullptr};
        if (fp8) {
            w.gt = g8, w.wt = wt8, w.op = op8, w.fp8_inv = fp8_scales;
            s = dgrad_tma_launch(w, tma_tiles);
        } else if (dgrad_tma) {
            s = dgrad_tma_launch(w, tma_tiles);
        } else if (halo_wgmma) {
            w.rb = halo_mi / 2, w.nb = halo_nb, w.tr = halo_rows;
            w.grid = dim3((unsigned)tiles, (unsigned)(cp / halo_nb));
            w.smem = dgrad_halo_wgmma_smem(halo_rows, (int)g.k, (int)g.d, (int)g.w, op, halo_nb);
            s = dgrad_halo_wgmma_launch(w);
        } else if (use_halo)
            (halo_mi == 4
                 ? dgrad_halo_mma<T, 4>
                 : dgrad_halo_mma<
                       T, 2>)<<<dim3((unsigned)tiles, (unsigned)(cp / kDgN)), 256, halo_smem, st>>>(
                gt, wt, a.mask, a.signs, a.saved_scales, g, op, cp, halo_rows,
                static_cast<T *>(a.grad_x), part_sum, part_dot);
        else if (wg_dgrad) {
            w.nb = wg_nb, w.grid = dim3((unsigned)tiles, (unsigned)(cp / wg_nb));
            w.smem = dgrad_phase_wgmma_smem(wg_nb);
            s = dgrad_phase_wgmma_launch(w, phases);
        } else
            dgrad_mma<T>
                <<<dim3((unsigned)tiles, (unsigned)(cp / kDgN)), 256, dgrad_smem<T>(), st>>>(
                    gt, wt, a.mask, a.signs, a.saved_scales, g, phases, op, cp,
                    static_cast<T *>(a.grad_x), part_sum, part_dot);
    }
    if (s == BIE_OK) {
        conv_tile_sums(part_sum, part_dot, tiles, g.c,
                       std::sqrt((double)g.n * (double)g.c * (double)(g.h * g.w)), dots,
                       a.grad_bias, a.grad_scale_a);
        s = wgrad_tma ? wgrad_tma_launch(a, gt, op, ws.at<void>(6), wgrad_tiles, wpart)
            : g.k == 3 && wgrad_wgmma_wanted() && wgmma_usable()
                ? conv_wgrad_wgmma(a, gt, op, (int)per_slice, (int)slices, wpart)
                : conv_wgrad_mma(a, gt, op, (int)per_slice, (int)slices, wpart);
    }
    if (s == BIE_OK) {
        conv_wgrad_sum(wpart, (int)slices, g.o * ckk, a.saved_scales, a.grad_w,
                       a.grad_w_i8 ? amax : nullptr);
        if (a.grad_w_i8) quantize_i8_partials(a.grad_w, g.o * ckk, amax, a.grad_w_i8);
        s = check(cudaGetLastError(), "binary conv2d backward kernels (tensor cores)");
    }
    return ws.release(s);
}

}  // namespace

template <typename T>
void conv_pixel_rows(const bie_conv_geom &g, const void *grad_out, int op, void *gt_out) {
    cudaStream_t st = current_stream;
    const int64_t ohw = g.oh * g.ow;
    const T *go = static_cast<const T *>(grad_out);
    T *gt = static_cast<T *>(gt_out);
    if (g.nhwc)
        pad_pixel_rows<T>
            <<<blocks_for(g.n * ohw * op), 256, 0, st>>>(go, g.n * ohw, (int)g.o, op, gt);
    else if (ohw % 8 == 0 && op % 64 == 0 && reinterpret_cast<uintptr_t>(go) % 16 == 0)
        to_pixel_major_x8<T>
            <<<dim3((unsigned)(g.n * ((ohw + 63) / 64)), (unsigned)(op / 64)), 256, 0, st>>>(
                go, (int)g.o, (int)ohw, op, gt);
    else
        to_pixel_major<T>
            <<<dim3((unsigned)(g.n * ((ohw + 31) / 32)), (unsigned)(op / 32)), 256, 0, st>>>(
                go, (int)g.o, (int)ohw, op, gt);
}
template void conv_pixel_rows<__nv_bfloat16>(const bie_conv_geom &, const void *, int, void *);
template void conv_pixel_rows<__half>(const bie_conv_geom &, const void *, int, void *);

void conv_tile_sums(const float *part_sum, const float *part_dot, int64_t tiles, int64_t c,
                    double denom, double *dots, float *grad_bias, float *grad_scale) {
    dgrad_channel_sums<<<(unsigned)c, 256, 0, current_stream>>>(part_sum, part_dot, tiles, (int)c,
                                                                grad_bias, dots);
    sum_over(dots, c, denom, grad_scale);
}

void conv_wgrad_sum(const float *part, int slices, int64_t count, const float *scales,
                    float *grad_w, float *amax) {
    const int64_t blocks = std::min<int64_t>((count + kSumThreads - 1) / kSumThreads, 65535);
    wgrad_sum_slices<<<amax ? (unsigned)kAmaxBlocks : (unsigned)std::max<int64_t>(1, blocks),
                       kSumThreads, 0, current_stream>>>(part, slices, count, scales, grad_w, amax);
}

// Whether a 16-bit layer of this geometry takes the TMA grad_x kernel (where its FP8 backward
// runs grad_x on e4m3), the same test as backward_mma_typed's.
bool conv_dgrad_tma_taken(const bie_conv_geom &g) {
    DgradTmaTiles tl = {};
    return dgrad_wgmma_wanted() && wgmma_usable() && dgrad_tma_wanted() && dgrad_tma_tiles(g, &tl);
}

bool conv_backward_mma_fits(const bie_cuda_bconv_backward_args &a) {
    return (a.dtype == BIE_BF16 || a.dtype == BIE_F16) && a.g.k >= 1 && a.g.k <= 3;
}

bie_status conv_backward_mma(const bie_cuda_bconv_backward_args &a) {
    return a.dtype == BIE_F16 ? backward_mma_typed<__half>(a)
                              : backward_mma_typed<__nv_bfloat16>(a);
}

}  // namespace bie_cuda

extern "C" bool bie_cuda_conv_fp8_grad_x(bie_dtype dtype, const bie_conv_geom *g) {
    return (dtype == BIE_BF16 || dtype == BIE_F16) && g->k >= 1 && g->k <= 3 &&
           !bie_cuda::conv_backward_gemm_forced() && bie_cuda::conv_dgrad_tma_taken(*g);
}
