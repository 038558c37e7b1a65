// What the wgmma grad_x kernels of the binary conv2d backward share (sm_90a;
// conv_dgrad_wgmma.cu: halo tiles of stride-1 layers, conv_dgrad_phase_wgmma.cu: the other
// layers by stride phase): the epilogue for the warpgroup accumulator layout.
#pragma once
#include <cstdint>

#include "conv_backward_mma.cuh"
#include "dtype.cuh"

namespace bie_cuda {
namespace {

// The epilogue of a block of two warpgroups, each with RB 64-row blocks of NB channels:
// tile rows 64 RB wg + 64 rb + 16 wi + g (+ 8), channels c0 + 8 nj + 2 tq (+ 1). pixel_of(r)
// is tile row r's flat input pixel (n HW + y W + x), or -1 past the tile. The clip mask,
// scale_w (sw), grad_x in its dtype (NCHW, or NHWC where nhwc), and the tile's per-channel sums of
// the masked gradient and of its product with sign(x') into part_sum / part_dot [blockIdx.x][C],
// reduced over the 8 warps in a fixed order (red: the block's shared scratch). One 32-channel word
// at a time (its four 8-channel column groups), so that only its sums are live beside the
// accumulators.
template <typename T, int RB, int NB, class PixelOf>
__device__ __forceinline__ void wg_dgrad_epilogue(
    const float (&acc)[RB][NB / 2], PixelOf pixel_of, const uint32_t *__restrict__ mask,
    const uint32_t *__restrict__ signs, float sw, int C, int HW, bool nhwc, int c0,
    T *__restrict__ grad_x, float *__restrict__ part_sum, float *__restrict__ part_dot,
    float (&red)[2][8][NB]) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2, wi = warp & 3;
    const int gq = lane >> 2, tq = lane & 3, cw = (C + 31) / 32;
#pragma unroll
    for (int half = 0; half < NB / 32; half++) {
        const int word = (c0 >> 5) + half;
        float csum[4][2] = {}, cdot[4][2] = {};
#pragma unroll
        for (int rb = 0; rb < RB; rb++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int qq = pixel_of(wg * 64 * RB + rb * 64 + wi * 16 + gq + 8 * h);
                if (qq < 0 || word >= cw) continue;
                const int n = qq / HW, pix = qq - n * HW;
                const uint32_t mw = mask[(int64_t)qq * cw + word],
                               sg = signs[(int64_t)qq * cw + word];
#pragma unroll
                for (int q = 0; q < 4; q++)
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        const int nj = 4 * half + q, b = q * 8 + 2 * tq + e,
                                  c = c0 + nj * 8 + 2 * tq + e;
                        if (c >= C) continue;
                        const float v = (mw >> b) & 1 ? acc[rb][4 * nj + 2 * h + e] * sw : 0.0f;
                        if (grad_x)
                            grad_x[nhwc ? (int64_t)qq * C + c : ((int64_t)n * C + c) * HW + pix] =
                                from_f32<T>(v);
                        csum[q][e] += v;
                        cdot[q][e] += (sg >> b) & 1 ? v : -v;
                    }
            }
#pragma unroll
        for (int q = 0; q < 4; q++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
#pragma unroll
                for (int off = 4; off < 32; off <<= 1) {
                    csum[q][e] += __shfl_xor_sync(0xffffffffu, csum[q][e], off);
                    cdot[q][e] += __shfl_xor_sync(0xffffffffu, cdot[q][e], off);
                }
                if (gq == 0) {
                    red[0][warp][half * 32 + q * 8 + 2 * tq + e] = csum[q][e];
                    red[1][warp][half * 32 + q * 8 + 2 * tq + e] = cdot[q][e];
                }
            }
    }
    __syncthreads();
    if (tid < NB && c0 + tid < C) {
        float s = 0.0f, t = 0.0f;
#pragma unroll
        for (int w = 0; w < 8; w++) s += red[0][w][tid], t += red[1][w][tid];
        const int64_t at = (int64_t)blockIdx.x * C + c0 + tid;
        part_sum[at] = s;
        part_dot[at] = t;
    }
}

}  // namespace
}  // namespace bie_cuda
