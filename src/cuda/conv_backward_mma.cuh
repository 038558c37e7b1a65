// What the binary conv2d backward's tensor-core kernels share (conv_backward_mma.cu: grad_x
// and the driver; conv_wgrad_mma.cu: grad_w): tile shapes, the per-launch fast division, the
// mma of the layer's 16-bit type, and the grad_w launcher.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <type_traits>

#include "conv_common.cuh"
#include "cuda_internal.h"
#include "mma.cuh"

namespace bie_cuda {
namespace {

// Shared rows are padded by 16 bytes: the 8 rows an ldmatrix reads fall in distinct banks.
constexpr int kDgM = 128;                    // grad_x tile: input pixels
constexpr int kDgN = 64;                     // grad_x tile: input channels
constexpr int kDgK = 64;                     // grad_x K step: output channels of one tap
constexpr int kDgPitch = kDgK + 8;           // grad_x shared row (elements)
constexpr int kDgStages = 3;                 // grad_x pipeline depth
constexpr int kBK = 32;                      // grad_w K step: output pixels
constexpr int kPitch = kBK + 8;              // grad_w B row (elements)
constexpr int kWgM = 64;                     // grad_w tile: output channels (x 32 channels x taps)
constexpr int kWgPitch = kWgM + 8;           // grad_w A row: one pixel's kWgM channels
constexpr int kWgStages = 3;                 // grad_w A pipeline depth
constexpr size_t kHaloSmemMax = 200 * 1024;  // the halo kernel's shared memory, at most
// The halo grad_x kernels' halo buffers: two (one being copied while the other is read) where
// op spans several kDgK chunks.
__host__ __device__ constexpr int dgrad_halo_buffers(int op) { return op > kDgK ? 2 : 1; }
constexpr int kSlicesPerSm = 2;  // grad_w blocks per SM to aim for (4: slower)

// The halo grad_x kernels' halo (dgrad_halo_mma, dgrad_halo_wgmma): the pixel-major gradient
// rows of the tile's image rows gy0 + p - (k - 1) d .. (hpix pixels of W, zeros outside the
// [n h] rows), output channels o0 .. o0 + 63, into the padded rows hb (blocks of 256 threads).
template <typename T>
__device__ __forceinline__ void dgrad_copy_halo(T (*hb)[kDgPitch], const T *__restrict__ gt,
                                                int gy0, int p, int k, int d, int W, int NH,
                                                int hpix, int op, int o0) {
    const int gr0 = gy0 + p - (k - 1) * d;
    for (int idx = threadIdx.x; idx < hpix * 8; idx += 256) {
        const int px = idx >> 3, c8 = idx & 7, hr = px / W, x = px - hr * W;
        const int gr = gr0 + hr;
        const bool ok = gr >= 0 && gr < NH;
        cp_async16(smem_u32(&hb[px][c8 * 8]),
                   gt + (ok ? ((int64_t)gr * W + x) * op + o0 + c8 * 8 : 0), ok);
    }
}

// A block of the stride-phase grad_x kernels (dgrad_mma, dgrad_phase_wgmma): its phase
// (y mod S, x mod S) = (ry, rx) among the split's S x S, found from the phases' first tiles
// (first[ph] .. first[ph + 1] - 1 are phase ph's), the phase's pixel count and m0, the first
// of the block's phase pixels (tiles of `tile` pixels).
struct DgradPhaseTile {
    int S, ry, rx, wr, hrwr, count, W, HW, m0;
    // The flat input pixel of the phase's pixel l, none (-1) past the phase.
    __device__ __forceinline__ int pixel_of(int l) const {
        if (l >= count) return -1;
        const int n = l / hrwr, rem = l - n * hrwr, a = rem / wr;
        return n * HW + (ry + S * a) * W + rx + S * (rem - a * wr);
    }
};
__device__ __forceinline__ DgradPhaseTile dgrad_phase_tile(const bie_conv_geom &g, int S,
                                                           const int *first, int tile) {
    const int H = (int)g.h, W = (int)g.w;
    int ph = 0;
    while (ph + 1 < S * S && (int)blockIdx.x >= first[ph + 1]) ph++;
    DgradPhaseTile pt;
    pt.S = S, pt.ry = ph / S, pt.rx = ph - pt.ry * S, pt.W = W, pt.HW = H * W;
    const int hr = (H - pt.ry + S - 1) / S;
    pt.wr = (W - pt.rx + S - 1) / S, pt.hrwr = hr * pt.wr, pt.count = (int)g.n * pt.hrwr;
    pt.m0 = ((int)blockIdx.x - first[ph]) * tile;
    return pt;
}
// The taps (t = i k + j) that reach the phase's pixels, into taps[] (written by thread 0; the
// caller synchronizes before reading them); their count.
__device__ __forceinline__ int dgrad_phase_taps(const bie_conv_geom &g, const DgradPhaseTile &pt,
                                                int *taps) {
    const int k = (int)g.k, s = (int)g.s, p = (int)g.p, d = (int)g.d;
    int ntaps = 0;
    for (int t = 0; t < k * k; t++) {
        const int i = t / k, j = t - i * k;
        if (pt.S == 1 ||
            (((pt.ry + p - i * d) % s + s) % s == 0 && ((pt.rx + p - j * d) % s + s) % s == 0)) {
            if (threadIdx.x == 0) taps[ntaps] = t;
            ntaps++;
        }
    }
    return ntaps;
}
// One input pixel of a stride-phase tile (q: its flat index, or -1) and the pixel-major
// gradient row each tap reads for it.
struct DgradGather {
    int y = 0, x = 0, nbase = 0;
    bool in = false;
    __device__ __forceinline__ DgradGather(const bie_conv_geom &g, int q) {
        if (q < 0) return;
        const int W = (int)g.w, HW = (int)(g.h * g.w), n = q / HW, pix = q - n * HW;
        in = true, y = pix / W, x = pix - y * W, nbase = n * (int)(g.oh * g.ow);
    }
    // The gradient row (output pixel) tap t maps the pixel to, or -1 where none does.
    __device__ __forceinline__ int row(const bie_conv_geom &g, int t) const {
        const int k = (int)g.k, s = (int)g.s, p = (int)g.p, d = (int)g.d;
        const int i = t / k, j = t - i * k;
        int ty = y + p - i * d, tx = x + p - j * d;
        bool ok = in && ty >= 0 && tx >= 0;
        if (s > 1) {
            ok = ok && ty % s == 0 && tx % s == 0;
            ty /= s;
            tx /= s;
        }
        ok = ok && ty < (int)g.oh && tx < (int)g.ow;
        return ok ? nbase + ty * (int)g.ow + tx : -1;
    }
};

template <typename T>
__device__ __forceinline__ void mma16816(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                         unsigned b1) {
    if constexpr (std::is_same<T, __half>::value)
        mma_f16_16816(c, a, b0, b1);
    else
        mma_bf16_16816(c, a, b0, b1);
}

}  // namespace

// grad_w's partial tiles: part [slices][o][c k k] (f32) from the pixel-major gradient gt
// [n oh ow][op] (T = the layer's 16-bit type) and the saved activation signs; slices of
// chunks_per_slice K steps each. Queued on the current stream.
bie_status conv_wgrad_mma(const bie_cuda_bconv_backward_args &a, const void *gt, int op,
                          int chunks_per_slice, int slices, float *part);

}  // namespace bie_cuda
