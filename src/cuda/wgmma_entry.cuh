// The host entry points of the kernels compiled for sm_90a alone (q4gemm_wgmma.cu,
// bgemm_wgmma.cu, bgemm_tma.cu, conv_dgrad_wgmma.cu, conv_wgrad_wgmma.cu: Hopper's warpgroup
// MMA), for the launchers that choose them. A build whose architectures do not
// include 90 lacks that file; wgmma_stubs.cu then answers that the device cannot run them.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda_internal.h"
#include "epilogue.cuh"
#include "q4_rows.cuh"

namespace bie_cuda {

size_t max_smem();  // bgemm.cu

// Whether the current device runs the sm_90a kernels (compute capability 9.0), cached per
// device.
bool wgmma_usable();
// A launcher's checks (a device that runs the kernels, the shared memory, output counts, the row
// stride a multiple of the k block) and its bm x bn tile grid.
bie_status wgmma_grid(const char *who, int64_t m, int64_t n, int64_t ld, int bm, int bn, int bkb,
                      size_t smem, int64_t *tiles_m, int64_t *tiles_n);

// 4-bit: the product of rows a [m][ld] and b [n][ld] (ld a multiple of 64) in 128 x 256
// tiles, and the implicit convolution of ConvA rows with weight taps b [o][ld] in 128 x bn
// tiles (bn 128 or 256); the shared memory of a block with bn columns.
size_t q4gemm_wgmma_smem(int bn);
bie_status q4gemm_wgmma_launch(int64_t m, int64_t n, int64_t k, const uint8_t *a, const uint8_t *b,
                               int64_t ld, const Epilogue &ep);
// Blocks of the convolution kernel with bn columns that fit on one SM (0: none).
int q4conv_wgmma_blocks_per_sm(int bn);
bie_status q4conv_wgmma_launch(int bn, int64_t rows, int64_t o, const ConvA &al, const uint8_t *b,
                               int64_t ld, const Epilogue &ep);

// Binary (bgemm_wgmma.cu, kernel 120): the product of rows a [m][ld] and b [n][ld] in the
// device GEMM layout (ld a multiple of 128 bytes) with their popcounts, in 128 x 256 tiles;
// the shared memory of a block.
size_t bgemm_wgmma_smem();
// Kernel 121 (bgemm_tma.cu): the same product with TMA loads and warp specialization; whether
// the driver makes the tensor maps it reads (cached).
size_t bgemm_tma_smem();
bool bgemm_tma_usable();
bie_status bgemm_tma_launch(int64_t m, int64_t n, int64_t k, const uint8_t *a, const uint8_t *b,
                            int64_t ld, const int *pa, int parts_a, const int *pb, int parts_b,
                            const Epilogue &ep);
// 4-bit kernel 211 (bgemm_tma.cu): kernel 121's pipeline on int8 code rows a [m][ld] and
// b [n][ld] (ld a multiple of 128, zero past k), the accumulators the dot products.
bie_status q4gemm_tma_launch(int64_t m, int64_t n, int64_t k, const int8_t *a, const int8_t *b,
                             int64_t ld, const Epilogue &ep);
bie_status bgemm_wgmma_launch(int64_t m, int64_t n, int64_t k, const uint8_t *a, const uint8_t *b,
                              int64_t ld, const int *pa, int parts_a, const int *pb, int parts_b,
                              const Epilogue &ep);

// The binary linear layer's opt-in FP8 products with their epilogues (linear_backward_tma.cu):
// out [M][N] = *s0 * *s1 * A B^T, A [M][K] and B [N][K] rows of K operands (e4m3 or 16-bit:
// op) in whole 16-byte units, 16-byte aligned; N a multiple of 16. The mask epilogue (grad_x; where
// mask is set): the values rounded to out_type, zero where the clip bit (bit j of row i of mask,
// rows of ld bytes, ld a multiple of 32) is clear, stored where out is set, and part_sum / part_dot
// [bwd_gemm_parts(M)][N] the column sums of those values (as stored) and of their products with the
// sign bits (signs, the same layout). Otherwise the store epilogue (grad_w): out f32, and amax_part
// [kAmaxBlocks] the partial maxima of |out|.
// The operands: e4m3 values (the FP8 backward) or 16-bit floats of the output's type (the
// exact one, mask epilogue and a 16-bit out_type only), K of them a row.
// kOpBits16: A 16-bit, B the ±1 matrix of sign bits b (bit j of row r: B's element (j, r), rows of
// ldb bytes, ldb a multiple of 16; +1 where set), made on chip.
enum BwdOperands { kOpE4M3 = 0, kOpSame16 = 1, kOpBits16 = 2 };
struct BwdGemmArgs {
    int op;  // BwdOperands
    int64_t M, N, K;
    const void *a, *b;
    const float *s0, *s1;
    void *out;
    int out_type;  // OutType (the mask epilogue; the store epilogue writes f32)
    const uint8_t *mask, *signs;
    int64_t ld;
    float *part_sum, *part_dot, *amax_part;
    int64_t ldb;  // kOpBits16: B's rows of sign bits
    // The 4-bit form of the mask epilogue (16-bit out_type only; signs then unused): part_dot
    // the column sums of the values (as stored) times resid [M][N] (int8, 4-byte aligned; the
    // 4-bit layers' rounding residuals) instead of the sign bits' ±1.
    const int8_t *resid;
    // The side job of the mask epilogue's warps (where bwd_gemm_side_taken; side_q NULL: none),
    // done in the time their tiles leave them: side_q [side_n] = the int8 quantization (SPEC §1)
    // of side_x [side_n] (f32, written before the launch) by the largest of the partial maxima
    // side_part [kAmaxBlocks] (side_sync NULL), or, with side_sync (a counter, zero at the
    // launch), by side_x's own amax, each block's share of it into side_part[blockIdx.x].
    const float *side_x;
    int8_t *side_q;
    int64_t side_n;
    float *side_part;
    unsigned *side_sync;
};
bool bwd_gemm_tma_usable();
// Whether the 4-bit form (BwdGemmArgs::resid) runs: the kernel usable and its 16-bit epilogue
// in the epilogue warps (not turned off by BIE_CUDA_LINEAR_ASYNC_EPI=0).
bool bwd_gemm_q4_usable();
int64_t bwd_gemm_parts(int64_t M);
// Whether the launch of p runs its side job (the mask epilogue in the producer's spare warps).
bool bwd_gemm_side_taken(const BwdGemmArgs &p);
bie_status bwd_gemm_tma_launch(const BwdGemmArgs &p);

// The exact grad_w of a 16-bit binary linear layer (linear_wgrad_tma.cu): grad_w [n][k] (f32) =
// *scale grad_out^T sign(x'), from grad_out [m][n] (f16 where half, else bf16; 16-byte aligned,
// n a multiple of 8) and the sign bits of x' (bit j of row r: element (r, j); rows of ld bytes,
// ld a multiple of 16), with amax_part [kAmaxBlocks] the partial maxima of |grad_w| (for
// quantize_i8_partials). xsign, where not null: sign(x') as a ±1 matrix [m][k] in the same
// type (16-byte aligned, k a multiple of 8), read instead of the bits.
struct WgradArgs {
    bool half;
    int64_t m, n, k;
    const void *grad_out;
    const uint8_t *signs;
    int64_t ld;
    const float *scale;
    float *grad_w, *amax_part;
    const void *xsign;
};
bool linear_wgrad16_usable();
bie_status linear_wgrad16_launch(const WgradArgs &p);

// Binary conv2d grad_x, halo form (conv_dgrad_wgmma.cu): the arguments of conv_backward_mma.cu's
// dgrad_halo_mma (gt, wt, grad_x in the layer's 16-bit type: half selects f16, else bf16), rb
// 64-row blocks per warpgroup (tiles of 128 rb pixels) and nb input channels a block (64, or
// 128 where rb is 1; grid.y = cp / nb); the shared memory of a block.
struct DgradHaloArgs {
    bool half;
    int rb, nb;
    dim3 grid;
    size_t smem;
    const void *gt, *wt;
    const uint32_t *mask, *signs;
    const float *scales;
    bie_conv_geom g;
    int op, cp, tr;
    void *grad_x;
    float *part_sum, *part_dot;
    // dgrad_tma only, the 4-bit layer (q4): the clip bits [input pixels][cp / 8] bytes and the
    // residuals [input pixels][cp] of bie_cuda_q4_conv_encode_nhwc's state in place of mask and
    // signs; grad_x (NCHW, any layer layout) = the products times scale_w where the clip bit is
    // set, and part_sum / part_dot [tile][C] the tiles' sums of grad_x and of grad_x times the
    // residuals.
    bool q4;
    const uint8_t *q4_bits;
    const int8_t *q4_resid;
    // dgrad_tma only, the opt-in FP8 backward (binary layers): gt and wt hold e4m3 values (rows
    // of op bytes, op a multiple of 128), and *fp8_inv is grad_out's per-tensor dequantization
    // factor (amax / 448), applied with scale_w. nullptr: 16-bit operands.
    const float *fp8_inv;
};
size_t dgrad_halo_wgmma_smem(int tr, int k, int d, int w, int op, int nb);
bie_status dgrad_halo_wgmma_launch(const DgradHaloArgs &a);
// Binary conv2d grad_x of the other layers (strides, other output sizes;
// conv_dgrad_phase_wgmma.cu): conv_backward_mma.cu's dgrad_mma with the products on wgmma, the
// input pixels split by stride phase. The same arguments (rb and tr unused; nb 64 or 128), the
// phase split, and the shared memory of a block.
constexpr int kDgradMaxPhases = 16;
struct DgradPhaseSplit {
    int split;                       // S, the stride (1: one phase)
    int first[kDgradMaxPhases + 1];  // phase ph owns pixel tiles first[ph] .. first[ph + 1] - 1
};
size_t dgrad_phase_wgmma_smem(int nb);
bie_status dgrad_phase_wgmma_launch(const DgradHaloArgs &a, const DgradPhaseSplit &phases);
// Binary conv2d grad_x of channels-last layers with TMA loads (conv_dgrad_tma.cu): the halo
// kernel's arguments (rb, nb, grid, smem and tr unused) and the tiles: the input pixels split
// by stride phase (st x st phases, tpp tiles each), a phase's pixels in tiles of tr rows of bw
// pixels of nimg images (tpi tiles an image), `tiles` in all. dgrad_tma_tiles says whether the
// kernel takes the layer on this device (strides up to kDgradMaxStride), and its tiles.
constexpr int kDgradMaxStride = 4;
struct DgradTmaTiles {
    int st, bw, tr, nimg, tpi, tpp;
    int halo, hr;  // the halo form (stride 1): bw is the padded row, hr the halo's rows
    int64_t tiles;
};
bool dgrad_tma_tiles(const bie_conv_geom &g, DgradTmaTiles *tl);
bie_status dgrad_tma_launch(const DgradHaloArgs &a, const DgradTmaTiles &tl);
// Binary conv2d grad_w of 3 x 3 layers of stride 1 or 2 with TMA loads (conv_wgrad_tma.cu): K steps
// of 64 output pixels (tr rows of bw pixels of nimg images; xt x ty steps an image group, `tiles`
// in all) in `slices` slices of per_slice steps. wgrad_tma_plan says whether the kernel takes
// the layer on this device and plans about blocks_wanted blocks; the launch expands the signs
// into xs (wgrad_tma_xs_bytes) and writes conv_wgrad_mma's partial tiles.
struct WgradTmaTiles {
    int bw, tr, nimg, xt, ty, per_slice, slices;
    int halo, gr, xr;  // the halo form (stride 1): bw the padded row, gr / xr the tiles' rows
    int64_t tiles;
};
bool wgrad_tma_plan(const bie_conv_geom &g, int64_t blocks_wanted, WgradTmaTiles *tl);
size_t wgrad_tma_xs_bytes(const bie_conv_geom &g);
bie_status wgrad_tma_launch(const bie_cuda_bconv_backward_args &a, const void *gt, int op, void *xs,
                            const WgradTmaTiles &tl, float *part);
// The same product over any image xs [n h w][cx] of the 16-bit type (half: f16, else bf16;
// cx = C rounded up to 64, zeros past C): the 4-bit layers' codes.
bie_status wgrad_tma_run(bool half, const bie_conv_geom &g, const void *gt, int op, const void *xs,
                         const WgradTmaTiles &tl, float *part);
// Binary conv2d grad_w of 3 x 3 kernels (conv_wgrad_wgmma.cu): conv_wgrad_mma's arguments and
// partial tiles (conv_backward_mma.cuh).
bie_status conv_wgrad_wgmma(const bie_cuda_bconv_backward_args &a, const void *gt, int op,
                            int chunks_per_slice, int slices, float *part);

}  // namespace bie_cuda
