// Pieces of the binary backward (backward.cu) that the 4-bit backward (q4backward.cu)
// shares: the per-thread cuBLAS handle, the fixed-order reductions and the masked col2im.
#pragma once
#include <cublas_v2.h>

#include <algorithm>

#include "cuda_common.cuh"
#include "cuda_internal.h"
#include "dtype.cuh"

namespace bie_cuda {
// One stream-ordered allocation on the current stream, carved into N pieces (each rounded up
// to 256 bytes): alloc, pointers by piece, release (frees, and passes the caller's status on).
template <int N> struct Workspace {
    uint8_t *base = nullptr;
    size_t off[N] = {};
    bie_status alloc(const size_t (&bytes)[N], const char *what) {
        size_t total = 0;
        for (int i = 0; i < N; i++) off[i] = total, total += (bytes[i] + 255) / 256 * 256;
        return check(cudaMallocAsync((void **)&base, total, current_stream), what);
    }
    template <typename P> P *at(int i) const { return reinterpret_cast<P *>(base + off[i]); }
    bie_status release(bie_status s) {
        const cudaError_t e = cudaFreeAsync(base, current_stream);
        BIE_CUDA_TRY(s);
        return check(e, "cudaFreeAsync");
    }
};

bie_status blas_check(cublasStatus_t s, const char *what);
// The calling thread's cuBLAS handle, bound to its current stream, scalars in device memory.
bie_status blas_handle(cublasHandle_t *out);
// A device float holding 0 (beta of the GEMMs).
bie_status device_zero(float **out);
// *out = sum of parts[0 .. count) / denom, in double and a fixed order, on the current stream.
void sum_over(const double *parts, int64_t count, double denom, float *out);
// The linear layers' mask pass (backward.cu): from grad_x before the mask g [m, k] (G: f32, or
// T where the FP8 products wrote it), grad_x = g masked (in T; none where grad_x is NULL),
// grad_bias = its column sums, and *grad_scale_a = its dot with sign(x') (binary: the clip mask and
// sign words of layout rows of ld bytes) or with the rounding residuals (4-bit: resid [m, k], clip
// bits flat over m k), divided by denom. Every sum in double and a fixed order; the workspace
// pieces dot_part and col_part of the shape's sizes, the shape made for G's columns a lane (4 for
// f32, 8 for 16-bit g; BIE_ERR_INTERNAL otherwise, nothing queued).
struct MaskPass {
    int lane_cols;  // columns a lane: 4 for f32 g, 8 for 16-bit g
    unsigned col_blocks, groups;
    size_t dot_bytes, col_bytes;
};
struct MaskBits {
    const uint8_t *mask, *signs;
    int64_t ld;
    const int8_t *resid;  // set: the 4-bit form
};
// two_per_sm: the form whose registers allow two resident blocks an SM (the 4-bit one, and g
// in 16 bits), else three.
MaskPass mask_pass_shape(int64_t m, int64_t k, bool two_per_sm, int lane_cols = 4);
template <typename T, typename G = float>
bie_status mask_pass(const MaskPass &p, const G *g, int64_t m, int64_t k, const MaskBits &bits,
                     T *grad_x, double *dot_part, double *col_part, double denom, float *grad_bias,
                     float *grad_scale_a);
// Convolutions: G [o][n oh ow] of grad_out [n][o][oh ow] (f32/bf16/f16), and from per-plane
// sums and dots [n][c]: grad_bias[c] = sum_n plane_sum, *grad_scale = sum plane_dot / denom.
void conv_grad_rows_any(bie_dtype dtype, const void *grad_out, const bie_conv_geom &g, void *dst);
void conv_bias_scale_sums(const double *plane_sum, const double *plane_dot, int64_t n, int64_t c,
                          double denom, float *grad_bias, float *grad_scale);
// The pixel-major gradient rows gt [n oh ow][op] (T, 16-bit; 0 for o >= O) of grad_out
// (NCHW, or NHWC where g.nhwc), on the current stream (conv_backward_mma.cu).
template <typename T>
void conv_pixel_rows(const bie_conv_geom &g, const void *grad_out, int op, void *gt);
// From the grad_x kernels' per-tile channel sums part_sum / part_dot [tiles][c]:
// grad_bias[c] = the sum over the tiles, *grad_scale = the sum of all dots / denom (each in
// double and a fixed order; dots: a workspace of c doubles).
void conv_tile_sums(const float *part_sum, const float *part_dot, int64_t tiles, int64_t c,
                    double denom, double *dots, float *grad_bias, float *grad_scale);
// grad_w [count] = scales[0] * the sum of the partial tiles part [slices][count], in order;
// where amax is not NULL, also the kAmaxBlocks partial maxima of |grad_w| into it (for
// quantize_i8_partials).
void conv_wgrad_sum(const float *part, int slices, int64_t count, const float *scales,
                    float *grad_w, float *amax);
// Whether bie_cuda_conv_backward_force_gemm asked for the im2col + cuBLAS backwards.
bool conv_backward_gemm_forced();
// The 4-bit conv2d backward on the TMA implicit GEMMs (q4conv_backward_tma.cu): false where
// they do not take the layer (nothing queued), else true and the status in *status.
bool q4_conv_backward_tma(const bie_cuda_q4conv_backward_args &a, bie_status *status);
// Per-tensor int8 quantization of x [n] into q (SPEC §1) on the current stream, with a
// workspace of amax_workspace_bytes() (kAmaxBlocks partial maxima of |x|, each from blocks of
// kAmaxThreads).
constexpr int kAmaxBlocks = 256, kAmaxThreads = 1024;
// The largest of the values a of a block's THREADS threads, returned to every thread (a warp's
// shuffles, then the warps' results through shared memory; one __syncthreads, which every
// thread of the block must reach).
template <int THREADS> __device__ __forceinline__ float block_max(float a) {
    static_assert(THREADS % 32 == 0 && THREADS <= 1024, "whole warps");
    __shared__ float sh[THREADS / 32];
    for (int o = 16; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = a;
    __syncthreads();
    a = sh[0];
    for (int i = 1; i < THREADS / 32; i++) a = fmaxf(a, sh[i]);
    return a;
}
// rint(x * 127 / amax) as the CPU rounds it (a float division), given inv = 1 / amax: the
// product by inv is within 3e-5 of that quotient (|quotient| <= 127 for |x| <= amax), so
// only where it lies that close to a half-integer (or is not finite) does the division run.
__device__ __forceinline__ int8_t quantize_one(float x, float amax, float inv) {
    float v = 0.0f;
    if (amax > 0) {
        const float y = x * 127.0f, fast = y * inv;
        v = rintf(fast);
        if (!(fabsf(fabsf(fast - v) - 0.5f) >= 1e-4f)) v = rintf(y / amax);
    }
    return (int8_t)(v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v);
}
size_t amax_workspace_bytes();
// part[0 .. kAmaxBlocks) = partial maxima of |x| over x [n] (float32, bfloat16 or float16;
// any split of x among them), on the current stream.
template <typename T> void amax_partials(const T *x, int64_t n, float *part);
void quantize_grad_i8(const float *x, int64_t n, float *workspace, int8_t *q);
// The same, given the kAmaxBlocks partial maxima of |x| (any split of x among them); with
// `reverse`, x read from its end (the same values: the parts written last by the product just
// before, still in L2, read first).
void quantize_i8_partials(const float *x, int64_t n, const float *partials, int8_t *q,
                          bool reverse = false);
// Whether the linear backward quantizes grad_w right after its product, from its end, instead of
// after grad_x (BIE_CUDA_LINEAR_QORDER=1: opt-in until timed on a GPU).
bool quantize_after_product();
// The FP8 scale of grad_out's one rounding to e4m3, in a kernel of kAmaxBlocks threads a
// block, from the kAmaxBlocks partial maxima of |grad_out| (amax_partials): returns
// 448 / amax to every thread (1 where amax is 0 or not finite; every thread must call it), and
// block (0, 0) writes scales[1] = it and scales[0] = its inverse for the kernels after.
__device__ __forceinline__ float fp8_scale_of_partials(const float *part, float *scales) {
    const float a = block_max<kAmaxBlocks>(part[threadIdx.x]);
    const bool some = a > 0.0f && isfinite(a);
    const float s = some ? 448.0f / a : 1.0f;
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) {
        scales[0] = some ? a / 448.0f : 1.0f;
        scales[1] = s;
    }
    return s;
}
// The opt-in FP8 products of the binary linear backward (backward_fp8.cu): whether they
// apply (FP8 mode, m, n, k multiples of 16, a device with FP8 tensor cores), and grad_x
// before the mask into g [m, k] (ctype: the layer's dtype) and grad_w; *done is false where
// cuBLASLt has no FP8 algorithm for the shape (nothing written: the exact products run
// instead).
bool fp8_backward_fits(const bie_cuda_bl_backward_args &a);
bie_status fp8_backward_products(const bie_cuda_bl_backward_args &a, cudaDataType_t ctype, void *g,
                                 bool *done);
// From the fused linear backward's per-part column sums part_sum / part_dot [parts][k]
// (float): grad_bias[c] = the sum over the parts, *grad_scale_a = the sum of all dots / denom
// (each in double and a fixed order; dots: a workspace of k doubles).
void linear_part_sums(const float *part_sum, const float *part_dot, int64_t parts, int64_t k,
                      double denom, double *dots, float *grad_bias, float *grad_scale_a);
// The same backward whole on our own FP8 kernels (Hopper: the mask, its sums and grad_w's amax
// in the products' epilogues), where usable and not turned off by BIE_CUDA_LINEAR_FUSED=0
// (cuBLASLt and the mask pass then): every gradient.
bool fp8_backward_fused_usable();
bie_status fp8_backward_fused(const bie_cuda_bl_backward_args &a);
// The exact backward of a 16-bit layer with grad_x, the mask and its sums on the same kernel
// (16-bit operands; grad_w on its own kernel): where it applies (bf16 / f16, n and k multiples of
// 16, grad_out 16-byte aligned, the fused kernels usable), and the backward (every gradient).
bool exact_fused_fits(const bie_cuda_bl_backward_args &a);
bie_status exact_backward_fused(const bie_cuda_bl_backward_args &a);
// Whether that backward makes its ±1 weight in each stage from the sign bits
// (BIE_CUDA_LINEAR_BITS=1) instead of reading a ±1 matrix.
bool exact_on_chip();
// The exact grad_w [n, k] = scale_a grad_out^T sign(x') in cuBLAS (T: the layer's dtype), on
// ±1 activations expanded from the sign bits (a workspace of its own).
template <typename T> bie_status exact_grad_w(const bie_cuda_bl_backward_args &a);
// ±1 rows [rows, k] of T (bf16 or f16) from layout sign rows of ld bytes (backward.cu).
template <typename T>
void expand_signs(const uint8_t *bits, int64_t ld, int64_t rows, int64_t k, T *dst);
// The binary conv2d backward on tensor cores (conv_backward_mma.cu): 16-bit dtypes, kernels
// of 1 to 3; fits says whether it applies.
bool conv_backward_mma_fits(const bie_cuda_bconv_backward_args &a);
bool conv_dgrad_tma_taken(const bie_conv_geom &g);
bie_status conv_backward_mma(const bie_cuda_bconv_backward_args &a);

// grad_x [n, c, h, w] (NHWC in memory where g64.nhwc) = sum over the taps that read each input
// pixel of cols [c k k][n oh ow] (tap order, as the CPU's col2im), times the clip bit mask(n, c,
// pix, at) (at: the element's flat NCHW index): one thread per element, block (pixel block,
// planes); also kept in f32 (g) for the reductions. 32-bit index math (the layers check the
// extents); UNIT: stride 1, where a tap's output position needs no division. KF: the kernel size
// when fixed at compile time (0: read from the shape); fixed, the tap loops unroll and every tap's
// load is in flight at once (the sum keeps its order).
template <typename T, bool UNIT, int KF, class Mask>
__global__ void __launch_bounds__(256)
    conv_col2im_mask(const float *cols, Mask mask, bie_conv_geom g64, T *grad_x, float *g) {
    const int C = (int)g64.c, k = KF ? KF : (int)g64.k, kk = k * k, s = (int)g64.s;
    const int p = (int)g64.p, d = (int)g64.d, h = (int)g64.h, w = (int)g64.w, hw = h * w;
    const int oh = (int)g64.oh, ow = (int)g64.ow, rows = (int)g64.n * oh * ow;
    const int pix = blockIdx.x * 256 + threadIdx.x;
    if (pix >= hw) return;
    const int y = pix / w, x = pix - y * w;
    for (int nc = blockIdx.y; nc < (int)g64.n * C; nc += gridDim.y) {
        const int n = nc / C, c = nc - n * C;
        const float *base = cols + (int64_t)c * kk * rows + (int64_t)n * oh * ow;
        float v = 0.0f;
#pragma unroll
        for (int i = 0; i < k; i++) {
            const int ty = y + p - i * d;
            if (ty < 0 || (!UNIT && ty % s)) continue;
            const int oy = UNIT ? ty : ty / s;
            if (oy >= oh) continue;
#pragma unroll
            for (int j = 0; j < k; j++) {
                const int tx = x + p - j * d;
                if (tx < 0 || (!UNIT && tx % s)) continue;
                const int ox = UNIT ? tx : tx / s;
                if (ox >= ow) continue;
                v += base[(int64_t)(i * k + j) * rows + oy * ow + ox];
            }
        }
        const int64_t at = (int64_t)nc * hw + pix;
        if (!mask(n, c, pix, at)) v = 0.0f;
        if (grad_x) grad_x[g64.nhwc ? ((int64_t)n * hw + pix) * C + c : at] = from_f32<T>(v);
        g[at] = v;
    }
}

template <typename T, class Mask>
void launch_conv_col2im_mask(const float *cols, Mask mask, const bie_conv_geom &g, T *grad_x,
                             float *gm) {
    const dim3 grid((unsigned)((g.h * g.w + 255) / 256),
                    (unsigned)std::min<int64_t>(g.n * g.c, 65535));
    auto fn =
        g.k == 3
            ? (g.s == 1 ? conv_col2im_mask<T, true, 3, Mask> : conv_col2im_mask<T, false, 3, Mask>)
            : (g.s == 1 ? conv_col2im_mask<T, true, 0, Mask> : conv_col2im_mask<T, false, 0, Mask>);
    fn<<<grid, 256, 0, current_stream>>>(cols, mask, g, grad_x, gm);
}
}  // namespace bie_cuda
