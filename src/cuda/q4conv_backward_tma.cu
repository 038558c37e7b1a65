// The 4-bit conv2d backward (SPEC §4) on the binary conv's TMA implicit GEMMs (sm_90a kernels
// of conv_dgrad_tma.cu and conv_wgrad_tma.cu), for 16-bit 3 x 3 layers of stride 1 or 2: the
// same products with code values (-8 .. 7, exact in both 16-bit types) where the binary layer
// has ±1, and no im2col buffers.
//   grad_x: the weight codes as the ±1 weight's B operand ([tap][cp][op]), the pixel-major
//           output gradient, and the grad_x kernel's raw form (f32 products times scale_w,
//           NHWC); then one pass applies the flat clip bits, writes grad_x (NCHW) and sums each
//           (n, c) plane's masked gradient and its products with the rounding residuals.
//   grad_w: the input codes as an NHWC image of the 16-bit type in place of the ±1 image, and
//           the grad_w kernel's partial tiles, summed in order and times scale_a.
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
// (code c k k + t), for 3 x 3 kernels. Block (64 outputs, 8 channels): the rows' codes of
// those channels (36 contiguous bytes each) through shared memory, then written along o.
template <typename T>
__global__ void __launch_bounds__(256)
    q4_dgrad_weight(const uint8_t *__restrict__ codes, int64_t ld, int C, int O, int cp, int op,
                    T *__restrict__ wt) {
    constexpr int kTaps = 9, kBytes = 8 * kTaps / 2;
    __shared__ uint8_t tile[64][kBytes + 1];
    const int o0 = (int)blockIdx.x * 64, c0 = (int)blockIdx.y * 8;
    const int64_t first = (int64_t)c0 * kTaps / 2, valid = (int64_t)C * kTaps;  // bytes, codes
    for (int i = threadIdx.x; i < 64 * kBytes; i += 256) {
        const int r = i / kBytes, b = i - r * kBytes, o = o0 + r;
        tile[r][b] = o < O && 2 * (first + b) < valid ? codes[(int64_t)o * ld + first + b] : 0;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < kTaps * 8 * 64; i += 256) {
        const int ol = i & 63, cl = (i >> 6) & 7, t = i >> 9, c = c0 + cl, e = cl * kTaps + t;
        const int nib = (tile[ol][e >> 1] >> ((e & 1) * 4)) & 15;
        const float v = c < C ? (float)(nib - ((nib & 8) << 1)) : 0.0f;
        wt[((int64_t)t * cp + c) * op + o0 + ol] = from_f32<T>(v);
    }
}

// xs [n h w][cx] = the input codes (flat NCHW nibbles), 0 past C. Block (32-pixel tile, 64
// channels, image): the codes read along pixels (each channel's nibbles in runs), written
// along channels through shared memory, 16 bytes a thread.
template <typename T>
__global__ void __launch_bounds__(256)
    q4_code_image(const uint8_t *__restrict__ codes, int C, int hw, int cx, T *__restrict__ xs) {
    __shared__ __align__(16) T tile[32][72];  // [pixel][channel], rows of 144 bytes
    const int p0 = (int)blockIdx.x * 32, c0 = (int)blockIdx.y * 64, n = (int)blockIdx.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int cl = warp * 8 + i, c = c0 + cl, pix = p0 + lane;
        const bool in = c < C && pix < hw;
        tile[lane][cl] =
            from_f32<T>(in ? (float)code_at(codes, ((int64_t)n * C + c) * hw + pix) : 0.0f);
    }
    __syncthreads();
    const int pl = threadIdx.x >> 3, ch = threadIdx.x & 7, pix = p0 + pl;
    if (pix < hw)
        *reinterpret_cast<uint4 *>(xs + ((int64_t)n * hw + pix) * cx + c0 + ch * 8) =
            *reinterpret_cast<const uint4 *>(&tile[pl][ch * 8]);
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
            v[j] = from_f32<T>((float)(nib - ((nib & 8) << 1)));
        }
        *reinterpret_cast<uint4 *>(xs + i * 8) = *reinterpret_cast<const uint4 *>(v);
    }
}

// From the raw products raw [n hw][C] (f32): grad_x [n][c][hw] = raw where the clip bit is
// set, else 0; and per (n, c) plane and pixel chunk z the sum of grad_x and of grad_x * resid
// (in float within a thread, then in double), at [n S + z][c] (S = gridDim.z chunks of `per`
// 32-pixel tiles). The clip bits and residuals: flat over n c h w, or where NHWC, the pixels'
// rows of bie_cuda_q4_conv_encode_nhwc (cw bytes of bits). Block (channel group of 32, image,
// chunk): tiles through shared memory, so that both the NHWC reads and the NCHW writes are
// whole rows, each tile's loads issued before its barrier. Flat state: the bits and residuals
// are read where grad_x is written (warp w: channels 4 w .. 4 w + 3, lane l: the tiles' pixel
// l; then the lanes in a fixed order); NHWC state: where raw is read (lane l: channel l, warp
// w: the tiles' pixels 4 w .. 4 w + 3; then the warps in a fixed order). At most 64
// registers, so that four blocks fit an SM.
template <typename T, bool NHWC>
__global__ void __launch_bounds__(256, 4)
    q4_dgrad_tail(const float *__restrict__ raw, const uint8_t *__restrict__ mask,
                  const int8_t *__restrict__ resid, int C, int hw, int per, int cw,
                  T *__restrict__ grad_x, double *__restrict__ plane_sum,
                  double *__restrict__ plane_dot) {
    __shared__ float tile[32][33];  // [pixel][channel]
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int c0 = (int)blockIdx.x * 32, n = (int)blockIdx.y, z = (int)blockIdx.z;
    float sum[4] = {0, 0, 0, 0}, dot[4] = {0, 0, 0, 0};  // a thread's, in float
    const int pend = min(hw, (z + 1) * per * 32);
    for (int p0 = z * per * 32; p0 < pend; p0 += 32) {
        float rv[4];
        unsigned mb[4];
        int rs[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int pix = p0 + warp * 4 + i, c = c0 + lane;
            const bool here = pix < pend && c < C;
            rv[i] = here ? raw[((int64_t)n * hw + pix) * C + c] : 0.0f;
            if (NHWC) {
                const int64_t px = (int64_t)n * hw + pix;
                mb[i] = here ? mask[px * cw + (c >> 3)] >> (c & 7) : 0u;
                rs[i] = here ? resid[px * cw * 8 + c] : 0;
            } else {
                const int64_t at = ((int64_t)n * C + c0 + warp * 4 + i) * hw + p0 + lane;
                const bool in = c0 + warp * 4 + i < C && p0 + lane < pend;
                mb[i] = in ? mask[at >> 3] >> (at & 7) : 0u;
                rs[i] = in ? resid[at] : 0;
            }
        }
#pragma unroll
        for (int i = 0; i < 4; i++) {
            if (NHWC) {
                const float v = mb[i] & 1 ? rv[i] : 0.0f;
                sum[0] += v;
                dot[0] += v * (float)rs[i];
                tile[warp * 4 + i][lane] = v;
            } else {
                tile[warp * 4 + i][lane] = rv[i];
            }
        }
        __syncthreads();
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int cl = warp * 4 + i, c = c0 + cl, pix = p0 + lane;
            if (c >= C || pix >= pend) continue;
            const float v = NHWC || mb[i] & 1 ? tile[lane][cl] : 0.0f;
            if (grad_x) grad_x[((int64_t)n * C + c) * hw + pix] = from_f32<T>(v);
            if (!NHWC) {
                sum[i] += v;
                dot[i] += v * (float)rs[i];
            }
        }
        __syncthreads();
    }
    const int64_t row = ((int64_t)n * gridDim.z + z) * C;
    if constexpr (NHWC) {  // the warps' sums of channel c0 + lane, added in double
        tile[warp][lane] = sum[0];
        tile[8 + warp][lane] = dot[0];
        __syncthreads();
        if (warp == 0 && c0 + lane < C) {
            double ls = 0, ld = 0;
            for (int w = 0; w < 8; w++) ls += tile[w][lane], ld += tile[8 + w][lane];
            plane_sum[row + c0 + lane] = ls;
            plane_dot[row + c0 + lane] = ld;
        }
    } else {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            double ls = sum[i], ld = dot[i];  // the lanes' sums, added in double
            for (int o = 16; o > 0; o >>= 1) {
                ls += __shfl_down_sync(0xffffffffu, ls, o);
                ld += __shfl_down_sync(0xffffffffu, ld, o);
            }
            const int c = c0 + warp * 4 + i;
            if (lane == 0 && c < C) {
                plane_sum[row + c] = ls;
                plane_dot[row + c] = ld;
            }
        }
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
    const int op = (int)((g.o + 63) / 64 * 64), cx = cp;
    const int64_t hw = g.h * g.w, pixels = g.n * hw, planes = g.n * g.c, ckk = g.c * kk;
    // The tail's pixel chunks: about four blocks per SM in all.
    const int64_t tiles = (hw + 31) / 32, cgroups = (g.c + 31) / 32;
    const int64_t chunks = std::max<int64_t>(
        1, std::min<int64_t>(tiles, 4 * device_sms() / std::max<int64_t>(1, cgroups * g.n)));
    const int per = (int)((tiles + chunks - 1) / chunks), zs = (int)((tiles + per - 1) / per);
    // Workspace: the weight codes [t][cp][op] and the pixel-major gradient [n oh ow][op] (T),
    // the raw grad_x [pixels][C] (f32), the code image [pixels][cx] (T), grad_w's partial tiles,
    // the planes' sums and dots.
    Workspace<6> ws;
    BIE_CUDA_TRY(
        ws.alloc({(size_t)kk * cp * op * sizeof(T), (size_t)(g.n * g.oh * g.ow * op) * sizeof(T),
                  (size_t)(pixels * g.c) * sizeof(float), (size_t)(pixels * cx) * sizeof(T),
                  (size_t)wt.slices * (size_t)(g.o * ckk) * sizeof(float),
                  (size_t)(2 * planes * zs) * sizeof(double)},
                 "cudaMallocAsync (4-bit conv backward workspace)"));
    T *wtile = ws.at<T>(0), *gt = ws.at<T>(1), *xs = ws.at<T>(3);
    const bool nhwc = a.nhwc_state != 0;
    float *raw = ws.at<float>(2), *wpart = ws.at<float>(4);
    double *plane_sum = ws.at<double>(5), *plane_dot = plane_sum + planes * zs;

    q4_dgrad_weight<T><<<dim3((unsigned)(op / 64), (unsigned)(cp / 8)), 256, 0, st>>>(
        a.wcodes, a.ld, (int)g.c, (int)g.o, cp, op, wtile);
    conv_pixel_rows<T>(g, a.grad_out, op, gt);
    bie_conv_geom gn = g;
    gn.nhwc = 1;
    DgradHaloArgs d = {half,           1,  64, dim3(), 0, gt,  wtile,   nullptr, nullptr,
                       a.saved_scales, gn, op, cp,     0, raw, nullptr, nullptr, true};
    bie_status s = dgrad_tma_launch(d, dt);
    if (s == BIE_OK) {
        const dim3 tg((unsigned)cgroups, (unsigned)g.n, (unsigned)zs);
        (nhwc ? q4_dgrad_tail<T, true> : q4_dgrad_tail<T, false>)<<<tg, 256, 0, st>>>(
            raw, a.mask, a.resid, (int)g.c, (int)hw, per, (int)((g.c + 7) / 8),
            static_cast<T *>(a.grad_x), plane_sum, plane_dot);
        // grad_scale_a = sum of grad_x * resid / 254 over sqrt(7 n c h w).
        conv_bias_scale_sums(plane_sum, plane_dot, g.n * zs, g.c,
                             std::sqrt((double)planes * (double)hw * 7.0) * 254.0, a.grad_bias,
                             a.grad_scale_a);
        if (nhwc)
            q4_code_expand<T><<<grid_of(pixels * (cx / 8)), 256, 0, st>>>(
                reinterpret_cast<const unsigned *>(a.codes), pixels,
                (int)(bie_cuda_q4_conv_cb(g.c) / 4), cx / 8, xs);
        else
            q4_code_image<T>
                <<<dim3((unsigned)tiles, (unsigned)(cx / 64), (unsigned)g.n), 256, 0, st>>>(
                    a.codes, (int)g.c, (int)hw, cx, xs);
        s = wgrad_tma_run(half, g, gt, op, xs, wt, wpart);
    }
    if (s == BIE_OK) {
        conv_wgrad_sum(wpart, wt.slices, g.o * ckk, a.saved_scales, a.grad_w);
        s = check(cudaGetLastError(), "4-bit conv2d backward kernels (TMA)");
    }
    return ws.release(s);
}

}  // namespace

bool q4_conv_backward_tma(const bie_cuda_q4conv_backward_args &a, bie_status *status) {
    DgradTmaTiles dt = {};
    WgradTmaTiles wt = {};
    // An NHWC state was kept for these kernels (the forward planned them): only they read it.
    if (!plan(a.dtype, a.g, !a.nhwc_state, &dt, &wt)) {
        if (!a.nhwc_state) return false;
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
