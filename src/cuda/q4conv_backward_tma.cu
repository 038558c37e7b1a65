// The 4-bit conv2d backward (SPEC §4) on the binary conv's TMA implicit GEMMs (sm_90a kernels
// of conv_dgrad_tma.cu and conv_wgrad_tma.cu), for 16-bit 3 x 3 layers of stride 1 or 2 whose
// training forward kept its state NHWC (bie_cuda_q4_conv_nhwc_state): the same products with
// code values (-8 .. 7, exact in both 16-bit types) where the binary layer has ±1, and no
// im2col buffers.
//   grad_x: the weight codes as the ±1 weight's B operand ([tap][cp][op]), the pixel-major
//           output gradient, and the grad_x kernel's 4-bit epilogue: the clip bits, grad_x
//           written NCHW, and per tile and channel the sums of grad_x and of its products with
//           the rounding residuals, then summed over the tiles.
//   grad_w: the forward's NHWC codes expanded to an image of the 16-bit type in place of the ±1
//           image, and the grad_w kernel's partial tiles, summed in order and times scale_a.
// Every sum has a fixed shape and order, so results do not vary from run to run.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "backward_common.cuh"
#include "cuda_internal.h"
#include "q4_common.cuh"
#include "wgmma_entry.cuh"

namespace bie_cuda {
namespace {

unsigned grid_of(int64_t items) {
    return (unsigned)std::max<int64_t>(1, std::min<int64_t>((items + 255) / 256, 65535));
}

// wt [t][cp][op] = code of w[o][c][t] (0 past O, C) from the weight's layout rows [o][ld]
// (code c k k + t), for 3 x 3 kernels. Block (32 outputs, 4 channels; 128 threads, small
// blocks so that there are many): the rows' codes of those channels (18 contiguous bytes each)
// through shared memory, then written along o.
template <typename T>
__global__ void __launch_bounds__(128)
    q4_dgrad_weight(const uint8_t *__restrict__ codes, int64_t ld, int C, int O, int cp, int op,
                    T *__restrict__ wt) {
    constexpr int kTaps = 9, kC = 4, kO = 32, kBytes = kC * kTaps / 2;
    __shared__ uint8_t tile[kO][kBytes + 1];
    const int o0 = (int)blockIdx.x * kO, c0 = (int)blockIdx.y * kC;
    const int64_t first = (int64_t)c0 * kTaps / 2, valid = (int64_t)C * kTaps;  // bytes, codes
    for (int i = threadIdx.x; i < kO * kBytes; i += 128) {
        const int r = i / kBytes, b = i - r * kBytes, o = o0 + r;
        tile[r][b] = o < O && 2 * (first + b) < valid ? codes[(int64_t)o * ld + first + b] : 0;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < kTaps * kC * kO; i += 128) {
        const int ol = i % kO, cl = (i / kO) % kC, t = i / (kO * kC), c = c0 + cl;
        const int e = cl * kTaps + t, nib = (tile[ol][e >> 1] >> ((e & 1) * 4)) & 15;
        const float v = c < C ? (float)nibble_code(nib) : 0.0f;
        wt[((int64_t)t * cp + c) * op + o0 + ol] = from_f32<T>(v);
    }
}

// xs [n h w][cx] = the NHWC codes ([n h w][cbw] words, code 0 past C) as values: a thread
// per 8 channels of a pixel, one 16-byte store.
template <typename T>
__global__ void __launch_bounds__(256)
    q4_code_expand(const unsigned *__restrict__ codes, int64_t pixels, int cbw, int cxw,
                   T *__restrict__ xs) {
    const int64_t total = pixels * cxw;
    for (int64_t i = (int64_t)blockIdx.x * 256 + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * 256) {
        const int64_t p = i / cxw;
        const unsigned w = codes[p * cbw + (i - p * cxw)];
        __align__(16) T v[8];
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const int nib = (int)(w >> (4 * j)) & 15;
            v[j] = from_f32<T>((float)nibble_code(nib));
        }
        *reinterpret_cast<uint4 *>(xs + i * 8) = *reinterpret_cast<const uint4 *>(v);
    }
}

// The plans of both kernels for the layer, or false where they do not take it (or where
// `forced` and bie_cuda_conv_backward_force_gemm asked for the im2col path).
bool plan(bie_dtype dtype, const bie_conv_geom &g, bool forced, DgradTmaTiles *dt,
          WgradTmaTiles *wt) {
    if ((dtype != BIE_BF16 && dtype != BIE_F16) || g.k != 3 ||
        (forced && conv_backward_gemm_forced()) || !wgmma_usable() ||
        g.n * g.c * g.h * g.w > INT32_MAX || g.n > 65535)
        return false;
    bie_conv_geom gn = g;
    gn.nhwc = 1;  // the raw grad_x is NHWC whatever the layer's layout
    return dgrad_tma_tiles(gn, dt) && wgrad_tma_plan(g, device_sms(), wt);
}

template <typename T>
bie_status backward_typed(const bie_cuda_q4conv_backward_args &a, const DgradTmaTiles &dt,
                          const WgradTmaTiles &wt) {
    cudaStream_t st = current_stream;
    const bie_conv_geom &g = a.g;
    const bool half = std::is_same<T, __half>::value;
    const int kk = (int)(g.k * g.k), cp = (int)((g.c + 63) / 64 * 64);
    const int op = (int)((g.o + 63) / 64 * 64);
    const int64_t pixels = g.n * g.h * g.w, ckk = g.c * kk, tiles = dt.tiles;
    // Workspace: the weight codes [t][cp][op] and the pixel-major gradient [n oh ow][op] (T),
    // the code image [pixels][cp] (T), grad_w's partial tiles, grad_x's tile sums, the channels'
    // dots.
    Workspace<6> ws;
    BIE_CUDA_TRY(ws.alloc(
        {(size_t)kk * cp * op * sizeof(T), (size_t)(g.n * g.oh * g.ow * op) * sizeof(T),
         (size_t)(pixels * cp) * sizeof(T), (size_t)wt.slices * (size_t)(g.o * ckk) * sizeof(float),
         (size_t)(2 * tiles * g.c) * sizeof(float), (size_t)g.c * sizeof(double)},
        "cudaMallocAsync (4-bit conv backward workspace)"));
    T *wtile = ws.at<T>(0), *gt = ws.at<T>(1), *xs = ws.at<T>(2);
    float *wpart = ws.at<float>(3), *part_sum = ws.at<float>(4), *part_dot = part_sum + tiles * g.c;

    q4_dgrad_weight<T><<<dim3((unsigned)(op / 32), (unsigned)(cp / 4)), 128, 0, st>>>(
        a.wcodes, a.ld, (int)g.c, (int)g.o, cp, op, wtile);
    conv_pixel_rows<T>(g, a.grad_out, op, gt);
    bie_conv_geom gn = g;
    gn.nhwc = 1;  // the kernel's operands are NHWC; the 4-bit epilogue writes NCHW
    DgradHaloArgs d = {
        half, 1,  64, dim3(),   0,        gt,       wtile, nullptr, nullptr, a.saved_scales, gn,
        op,   cp, 0,  a.grad_x, part_sum, part_dot, true,  a.mask,  a.resid, nullptr};
    bie_status s = dgrad_tma_launch(d, dt);
    if (s == BIE_OK) {
        // grad_scale_a = sum of grad_x * resid / 254 over sqrt(7 n c h w).
        conv_tile_sums(part_sum, part_dot, tiles, g.c,
                       std::sqrt((double)g.n * (double)g.c * (double)(g.h * g.w) * 7.0) * 254.0,
                       ws.at<double>(5), a.grad_bias, a.grad_scale_a);
        q4_code_expand<T><<<grid_of(pixels * (cp / 8)), 256, 0, st>>>(
            reinterpret_cast<const unsigned *>(a.codes), pixels,
            (int)(bie_cuda_q4_conv_cb(g.c) / 4), cp / 8, xs);
        s = wgrad_tma_run(half, g, gt, op, xs, wt, wpart);
    }
    if (s == BIE_OK) {
        conv_wgrad_sum(wpart, wt.slices, g.o * ckk, a.saved_scales, a.grad_w, nullptr);
        s = check(cudaGetLastError(), "4-bit conv2d backward kernels (TMA)");
    }
    return ws.release(s);
}

}  // namespace

bool q4_conv_backward_tma(const bie_cuda_q4conv_backward_args &a, bie_status *status) {
    DgradTmaTiles dt = {};
    WgradTmaTiles wt = {};
    // Only these kernels read an NHWC state, and they read no other (the forward planned them).
    if (!a.nhwc_state) return false;
    if (!plan(a.dtype, a.g, false, &dt, &wt)) {
        *status = bie_fail(BIE_ERR_STATE, "cuda 4-bit conv2d backward: the forward's NHWC state "
                                          "needs the TMA kernels, which this device does not run");
        return true;
    }
    *status = a.dtype == BIE_F16 ? backward_typed<__half>(a, dt, wt)
                                 : backward_typed<__nv_bfloat16>(a, dt, wt);
    return true;
}

}  // namespace bie_cuda

extern "C" bool bie_cuda_q4_conv_nhwc_state(bie_dtype dtype, const bie_conv_geom *g) {
    bie_cuda::DgradTmaTiles dt = {};
    bie_cuda::WgradTmaTiles wt = {};
    return bie_cuda::plan(dtype, *g, true, &dt, &wt);
}
