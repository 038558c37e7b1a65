// What the binary conv2d backward's tensor-core kernels share (conv_backward_mma.cu: grad_x
// and the driver; conv_wgrad_mma.cu: grad_w): tile shapes, the per-launch fast division, the
// mma of the layer's 16-bit type, and the grad_w launcher.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <type_traits>

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

// Division of non-negative ints below 2^31 by a divisor fixed per launch, as a multiply-high
// and a shift (the magic number from the host): the per-step pixel index math of wgrad_mma.
struct FastDiv {
    unsigned m, l;
    explicit FastDiv(int d) {
        l = 0;
        while ((1ull << l) < (unsigned long long)d) l++;
        m = (unsigned)(((1ull << 32) * ((1ull << l) - (unsigned long long)d)) / (unsigned)d + 1);
    }
    __device__ __forceinline__ int div(int n) const {
        return (int)((__umulhi((unsigned)n, m) + (unsigned)n) >> l);
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
