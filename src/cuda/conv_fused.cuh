// What the fused binary conv's planner (conv_fused.cu) and its kernel (conv_fused_kernel.cu)
// agree on: the launch plan, the band segments and their field rows, the weight image's and
// the shared memory's layouts, the column terms' bias, and the kernel's launch.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda_internal.h"
#include "epilogue.cuh"

namespace bie_cuda {
namespace fused {

// Each warp's epilogue stage: one m16 half of its tile as output values, 32 channel rows of
// 16 pixels (16 esize bytes each; see stage_at).
__host__ __device__ constexpr int stage_bytes(int esize) { return 32 * 16 * esize; }

// Words between the column terms of two padding classes in shared memory: rows of several
// classes read at once fall in different banks.
__host__ __device__ constexpr int corr_stride(int bn) { return bn + 8; }

// The launch geometry of one layer call.
struct FusedPlan {
    int bn;       // output channels per block (64, 128 or 256)
    int warps;    // 8 or 16
    int bp;       // output pixels per band
    int bands;    // ceil(N oh ow / bp)
    int segs;     // the most images a band touches
    int pr, wp;   // field rows (at most, over the bands), columns (padded coordinates)
    int pstride;  // bytes per packed pixel: cw words, padded to an odd number of 16-byte chunks
    int rows;     // bp rounded up to the 32-pixel warp tile
    int ldr;      // bytes of a weight row in shared memory (taps, padded to 32 bytes)
    int classes;
    int esize;  // bytes per input / output element
};

// A band's segment (the part of it in one image) as the pack and the tile rows see it: input
// pixels [fa, fb) of the image's plane are its field's rows inside the input, which hold
// field row rowbase + iy for input row iy; its pack items start at item0.
struct Segment {
    int fa, fb, item0, rowbase;
};

// The part of a band in one image (its pixels [a, e) of that image's plane): output rows
// lo..hi, the rows of its field ((hi - lo) s + kd, from padded row lo s) and the input rows
// [iy0, iy1) among them. The kernel lays the fields out and the planner sizes them with it.
template <typename I> struct SegRows { I lo, hi, field, iy0, iy1; };
template <typename I>
__host__ __device__ SegRows<I> seg_rows(I a, I e, I ow, I s, I pad, I kd, I h) {
    SegRows<I> r;
    r.lo = a / ow;
    r.hi = (e - 1) / ow;
    r.field = (r.hi - r.lo) * s + kd;
    r.iy0 = r.lo * s - pad > 0 ? r.lo * s - pad : 0;
    r.iy1 = r.hi * s - pad + kd < h ? r.hi * s - pad + kd : h;
    return r;
}

// The weight image of a block of bn output channels, as the layer keeps it in global memory
// (the blocks one after another) and a block copies it whole into its shared memory: bn
// weight rows of ldr bytes, ldr + 16 apart so that ldmatrix rows fall in distinct banks (rows
// past O and the gaps zero), then per padding class the column terms correction - 2
// popcount(weight column) plus kTermBias (see below), corr_stride(bn) apart (columns
// past O: the bias alone): 16-byte multiples. image_terms: where the column terms start.
__host__ __device__ inline size_t image_terms(const FusedPlan &p) {
    return (size_t)p.bn * (p.ldr + 16);
}
__host__ __device__ inline size_t image_block_bytes(const FusedPlan &p) {
    return image_terms(p) + (size_t)p.classes * corr_stride(p.bn) * sizeof(int);
}

// Shared memory of a block: the weight image (its rows at b, its column terms at corr), the
// packed receptive field, its pixels' popcounts, the tap offset of every 16-byte chunk of a
// GEMM row, each tile row's field cell, padding class and output offset, the class tables,
// the segments (and one past the last: the totals), the image copy's mbarrier and each
// warp's epilogue stage (which also holds the warp's sign thresholds during the pack).
struct FusedSmem {
    size_t b, corr, img, ppix, delta, cell, rcls, oofs, ycls, xcls, seg, bar, stage, total;
    __host__ __device__ FusedSmem(const FusedPlan &p, int oh, int ow) {
        const size_t cells = (size_t)p.pr * p.wp;
        b = 0;
        corr = b + image_terms(p);
        img = b + image_block_bytes(p);
        ppix = img + cells * p.pstride;
        delta = ppix + cells * sizeof(int);
        cell = delta + (size_t)(p.ldr / 16) * sizeof(int);
        rcls = cell + (size_t)p.rows * sizeof(int);
        oofs = rcls + (size_t)p.rows * sizeof(int);
        ycls = oofs + (size_t)p.rows * sizeof(int);
        xcls = ycls + (size_t)oh * sizeof(int);
        seg = (xcls + (size_t)ow * sizeof(int) + 15) / 16 * 16;
        bar = seg + (size_t)(p.segs + 1) * sizeof(Segment);
        stage = bar + 16;
        total = stage + (size_t)p.warps * stage_bytes(p.esize);
    }
};

// The weight image's column terms carry this bias, 1.5 2^23 as a float's bits: for |x| <
// 2^22 the float with bits kTermBias + x is exactly 1.5 2^23 + x. So 4 popc(AND) + the
// biased column term is the float 1.5 2^23 + 4 popc(AND) + column term after one integer
// multiply-add (4 popc + term is the dot product minus the row term: at most 2 K < 2^22 in
// magnitude, K <= 2^17 by plan_fused's row bound), and adding the row term minus 1.5 2^23 (a
// float, exact) gives the exact dot product as a float (|dot| <= K), without a quarter-rate
// int-to-float conversion.
constexpr int kTermBias = 0x4B400000;
constexpr float kTermBiasF = 12582912.0f;

// Runs the fused kernel for input and output type dtype (f32, bf16 or f16) on plan p, with
// the weight image wimg of the plan's channel blocks (image_block_bytes apart), allowed to
// overlap the kernel before it (programmatic dependent launch) when overlap is set.
cudaError_t launch_bconv_fused(bie_dtype dtype, const void *x, const float *bias,
                               const uint8_t *wimg, bool overlap, const bie_conv_geom *g,
                               const FusedPlan &p, const Epilogue &ep);

}  // namespace fused
}  // namespace bie_cuda
