// grad_w of the binary conv2d backward for 3 x 3 layers of stride 1 or 2 on Hopper (sm_90a), with
// the operands brought by the tensor memory accelerator: conv_wgrad_wgmma.cu's product (grad_w [o c
// t] = sum over output pixels of grad_out[o] times sign(x') at the pixel's tap t input, 0 in the
// padding; partial tiles per K slice) as an implicit GEMM over two NHWC images.
//
// The saved sign words are first expanded into a ±1 image xs [n h w][cx] of the layer's 16-bit
// type (cx: the channels rounded up to 64, zeros past C). A K step is a box of 32 output pixels
// (whole rows of bw pixels, bw a power of two; of several images where they are small): one 4D
// bulk tensor copy of the pixel-major gradient (64 output channels a row) and, for each of the
// nine taps, one of xs at the box's origin shifted by the tap (64 input channels a row; for
// stride 2 the xs box takes every second pixel, the tensor map's traversal stride). The
// copies write zeros wherever a box leaves its image, which is the padding for xs and makes
// the pixels past the output contribute nothing. Both operands are MN-major (a pixel's 64
// channels contiguous), which the wgmma transposes as it reads them.
//
// A block computes 64 output channels x 64 input channels x 9 taps for the K steps of its
// slice: a producer warp fills a four-stage ring (full / empty barriers, as kernel 121); three
// consumer warpgroups, one per kernel row i, multiply the gradient tile by the tiles of taps
// 3 i .. 3 i + 2 (wgmma.m64n64k16, three accumulator sets each). The partial tile is staged
// through the ring's shared memory in grad_w's [o][c 9 + t] order and written as whole rows.
//
// Stride-1 layers take the halo form where it wastes little: a K step is tr whole output rows
// over the padded width wp = OW + 2 d (the gradient box's columns past OW arrive as zeros), so
// that one xs box of tr + 2 d rows of wp pixels (from column -p) holds every tap's operand: tap
// (i, j) is the view from row i d wp + j d on (a descriptor may start at any 128-byte row of a
// swizzled region). Two copies a step instead of ten, about a quarter of the bytes. The K extent
// is rounded up to 16 rows; the ring is zeroed once, so the rows no copy writes (the gradient
// tile's tail, the xs rows past the box) stay zero and add nothing.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <type_traits>

#include "conv_backward_mma.cuh"
#include "cuda_common.cuh"
#include "tma.cuh"
#include "wgmma.cuh"
#include "wgmma_entry.cuh"

namespace bie_cuda {

namespace {

constexpr int kP = 32;                       // output pixels a K step (64 with two stages,
                                             // 16 with eight: slower, H100)
constexpr int kRow = 128;                    // a shared row: 64 channels of 16 bits
constexpr int kTile = kP * kRow;             // one operand tile (4 KB)
constexpr int kTaps = 9;                     // 3 x 3
constexpr int kStages = 4;                   // the ring
constexpr int kStage = (1 + kTaps) * kTile;  // the gradient tile, then the taps' xs tiles
constexpr int kConsumers = 3;                // warpgroups, one per kernel row
constexpr int kThreads = 128 * kConsumers + 32;
constexpr int kCols = 64 * kTaps;  // a staged row: 64 channels x 9 taps (floats)
constexpr int kStgPitch = kCols + 4;
constexpr size_t kStaging = (size_t)64 * kStgPitch * 4;  // the partial tile, staged
constexpr size_t kSmem = 1024 + (size_t)kStages * kStage + 16 * kStages;
static_assert(kStaging <= (size_t)kStages * kStage, "staging fits the ring");
constexpr int kHaloStageMax = 48 * 1024;  // the halo form's stage: gradient and xs tiles
// The dynamic shared memory of a launch: the ring (or the staging, if larger) and its barriers.
size_t wgrad_smem(const WgradTmaTiles &tl) {
    if (!tl.halo) return kSmem;
    const size_t ring = (size_t)kStages * (tl.gr + tl.xr) * kRow;
    return 1024 + std::max(ring, kStaging) + 16 * kStages;
}

// xs [pixels][cx] from the saved sign words [pixels][cw]: +1 where the bit is set, -1 where not,
// 0 past C. One thread per 8 channels of a pixel (16 bytes).
template <typename T>
__global__ void expand_signs(const uint32_t *__restrict__ signs, int chunks, FastDiv by_per,
                             int per, int C, int cx, T *__restrict__ xs) {
    const unsigned one = std::is_same<T, __half>::value ? 0x3c00u : 0x3f80u;
    const int cw = (C + 31) / 32;
    for (int e = (int)(blockIdx.x * 256 + threadIdx.x); e < chunks; e += (int)gridDim.x * 256) {
        const int q = by_per.div(e), c8 = (e - q * per) * 8;
        const uint32_t w = c8 < C ? __ldg(signs + (int64_t)q * cw + (c8 >> 5)) >> (c8 & 31) : 0u;
        uint4 v;
        unsigned *o = &v.x;
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int c = c8 + 2 * u;
            const unsigned lo = c < C ? one | ((w >> (2 * u)) & 1 ? 0u : 0x8000u) : 0u;
            const unsigned hi = c + 1 < C ? one | ((w >> (2 * u + 1)) & 1 ? 0u : 0x8000u) : 0u;
            o[u] = lo | hi << 16;
        }
        *reinterpret_cast<uint4 *>(xs + (int64_t)q * cx + c8) = v;
    }
}

template <typename T, bool HALO>
__global__ void __launch_bounds__(kThreads, 1)
    wgrad_tma(const __grid_constant__ CUtensorMap map_g, const __grid_constant__ CUtensorMap map_x,
              bie_conv_geom g64, WgradTmaTiles tl, float *__restrict__ part) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ __align__(16) unsigned char smem[];
    const unsigned base = (smem_u32(smem) + 1023) & ~1023u;
    unsigned char *gbase = smem + (base - smem_u32(smem));  // the same address, generic
    const int stage_bytes = HALO ? (tl.gr + tl.xr) * kRow : kStage;
    const unsigned ring =
        (unsigned)(HALO ? max((size_t)kStages * stage_bytes, kStaging) : (size_t)kStages * kStage);
    const unsigned full0 = base + ring, empty0 = full0 + 8 * kStages;
    const int tid = threadIdx.x, wg = tid >> 7;
    const int C = (int)g64.c, O = (int)g64.o, p = (int)g64.p, d = (int)g64.d, st = (int)g64.s;
    const int o0 = (int)blockIdx.x * 64, c0 = (int)blockIdx.y * 64;
    const int64_t first = (int64_t)blockIdx.z * tl.per_slice;
    const int steps = (int)min((int64_t)tl.per_slice, tl.tiles - first);
    if (tid == 0) {
        for (int s = 0; s < kStages; s++) {
            mbar_init(full0 + 8 * s, 1);
            mbar_init(empty0 + 8 * s, kConsumers);
        }
        mbar_init_fence();
    }
    if (HALO) {  // the rows no copy writes read as zeros
        for (unsigned i = (unsigned)tid * 16; i < kStages * (unsigned)stage_bytes;
             i += kThreads * 16)
            *reinterpret_cast<uint4 *>(gbase + i) = make_uint4(0, 0, 0, 0);
        fence_proxy_async();  // before the copies and the wgmma reads
    }
    __syncthreads();

    if (wg == kConsumers) {  // the producer warp
        if (tid == 128 * kConsumers) {
            tma_prefetch_map(&map_g);
            tma_prefetch_map(&map_x);
            // (The halo form's steps are whole rows of one image: xt = nimg = 1.)
            const int per_img = tl.xt * tl.ty;
            const unsigned bytes =
                HALO ? (unsigned)(kRow * tl.bw * (2 * tl.tr + 2 * d)) : (unsigned)kStage;
            for (int step = 0; step < steps; step++) {
                const int64_t kt = first + step;
                const int n0 = (int)(kt / per_img) * tl.nimg, rem = (int)(kt % per_img);
                const int oy0 = rem / tl.xt * tl.tr, ox0 = rem % tl.xt * tl.bw;
                const int s = step % kStages;
                mbar_wait(empty0 + 8 * s, ((unsigned)(step / kStages) & 1u) ^ 1u);
                const unsigned full = full0 + 8 * s, dst = base + (unsigned)(s * stage_bytes);
                mbar_arrive_expect_tx(full, bytes);
                tma_load_4d(dst, &map_g, o0 * 2, ox0, oy0, n0, full);
                if (HALO)  // one box of the rows every tap reaches
                    tma_load_4d(dst + (unsigned)(tl.gr * kRow), &map_x, c0 * 2, -p, oy0 - p, n0,
                                full);
                else
                    for (int t = 0; t < kTaps; t++)
                        tma_load_4d(dst + (unsigned)((1 + t) * kTile), &map_x, c0 * 2,
                                    ox0 * st - p + (t % 3) * d, oy0 * st - p + (t / 3) * d, n0,
                                    full);
            }
        }
        return;
    }

    // Consumer wg: taps 3 wg .. 3 wg + 2. Both operands' descriptors: the 64 channels of a tile
    // are one 128-byte swizzle row, so only the stride between groups of 8 pixel rows (1024
    // bytes) matters; it is given in both offset fields.
    const int wt = tid & 127, lane = tid & 31, wi = wt >> 5, gq = lane >> 2, tq = lane & 3;
    float acc[3][32];
#pragma unroll
    for (int u = 0; u < 3; u++)
#pragma unroll
        for (int x = 0; x < 32; x++) acc[u][x] = 0.0f;
    for (int step = 0; step < steps; step++) {
        const int s = step % kStages;
        mbar_wait(full0 + 8 * s, (unsigned)(step / kStages) & 1u);
        const unsigned stage = base + (unsigned)(s * stage_bytes);
#pragma unroll
        for (int u = 0; u < 3; u++) fence_acc(acc[u]);
        wgmma_fence();
        if (HALO) {  // tap (wg, u): the xs view from row wg d wp + u d
            const unsigned xv = stage + (unsigned)((tl.gr + wg * d * tl.bw) * kRow);
            for (int ks = 0; ks < tl.gr / 16; ks++)
#pragma unroll
                for (int u = 0; u < 3; u++)
                    wgmma_f16_ss_mn64<T>(
                        acc[u], smem_desc(stage + 2048 * ks, 1024, 1024, 1),
                        smem_desc(xv + (unsigned)((u * d + 16 * ks) * kRow), 1024, 1024, 1));
        }
#pragma unroll
        for (int ks = 0; ks < (HALO ? 0 : kP / 16); ks++)
#pragma unroll
            for (int u = 0; u < 3; u++)
                wgmma_f16_ss_mn64<T>(
                    acc[u], smem_desc(stage + 2048 * ks, 1024, 1024, 1),
                    smem_desc(stage + (unsigned)((1 + 3 * wg + u) * kTile) + 2048 * ks, 1024, 1024,
                              1));
        wgmma_commit();
        wgmma_wait<1>();
#pragma unroll
        for (int u = 0; u < 3; u++) fence_acc(acc[u]);
        if (step > 0 && wt == 0) mbar_arrive(empty0 + 8 * ((step - 1) % kStages));
    }
    wgmma_wait<0>();
#pragma unroll
    for (int u = 0; u < 3; u++) fence_acc(acc[u]);
    asm volatile("bar.sync 1, %0;\n" ::"n"(128 * kConsumers) : "memory");  // the ring is free

    // Rows o0 + 16 wi + g (+ 8), channels c0 + 8 nj + 2 tq (+ 1), tap 3 wg + u: staged as
    // [o][c 9 + t] floats.
    float *stg = reinterpret_cast<float *>(gbase);
#pragma unroll
    for (int u = 0; u < 3; u++)
#pragma unroll
        for (int nj = 0; nj < 8; nj++)
#pragma unroll
            for (int h = 0; h < 2; h++)
#pragma unroll
                for (int e = 0; e < 2; e++)
                    stg[(16 * wi + gq + 8 * h) * kStgPitch + (8 * nj + 2 * tq + e) * kTaps +
                        3 * wg + u] = acc[u][4 * nj + 2 * h + e];
    asm volatile("bar.sync 1, %0;\n" ::"n"(128 * kConsumers) : "memory");
    const int64_t ckk = (int64_t)C * kTaps;
    float *out = part + (int64_t)blockIdx.z * O * ckk + (int64_t)c0 * kTaps;
    const int limit = (int)min((int64_t)kCols, ckk - (int64_t)c0 * kTaps);
    const bool vec = C % 4 == 0;
    for (int idx = tid; idx < 64 * kCols / 4; idx += 128 * kConsumers) {
        const int r = idx / (kCols / 4), col = (idx - r * (kCols / 4)) * 4, o = o0 + r;
        if (o >= O || col >= limit) continue;
        const float *src = stg + r * kStgPitch + col;
        float *dst = out + (int64_t)o * ckk + col;
        if (vec && col + 4 <= limit)
            *reinterpret_cast<float4 *>(dst) = *reinterpret_cast<const float4 *>(src);
        else
            for (int x = 0; x < 4 && col + x < limit; x++) dst[x] = src[x];
    }
#else
    (void)map_g, (void)map_x, (void)g64, (void)tl, (void)part;
#endif
}

template <typename T, bool HALO>
bie_status launch(const bie_conv_geom &g, const void *gt, int op, const void *xs,
                  const WgradTmaTiles &tl, float *part) {
    static const char *who = "conv grad_w (wgmma, TMA)";
    const int cx = (int)((g.c + 63) / 64 * 64);
    CUtensorMap map_g, map_x;
    const int xrows = HALO ? tl.tr + 2 * (int)g.d : tl.tr;  // the halo: the taps' reach
    if (!tma_map_nhwc(&map_g, gt, g.n, g.oh, g.ow, (int64_t)op * 2, tl.bw, tl.tr, tl.nimg) ||
        !tma_map_nhwc(&map_x, xs, g.n, g.h, g.w, (int64_t)cx * 2, tl.bw, xrows, tl.nimg, (int)g.s))
        return bie_fail(BIE_ERR_UNSUPPORTED, "%s: the driver cannot describe the operands", who);
    const auto fn = wgrad_tma<T, HALO>;
    const size_t smem = wgrad_smem(tl);
    BIE_CUDA_TRY(check(cudaFuncSetAttribute(reinterpret_cast<const void *>(fn),
                                            cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem),
                       who));
    fn<<<dim3((unsigned)((g.o + 63) / 64), (unsigned)(cx / 64), (unsigned)tl.slices), kThreads,
         smem, current_stream>>>(map_g, map_x, g, tl, part);
    return check(cudaGetLastError(), who);
}

int pow2_at_least(int64_t v) {
    int p = 1;
    while (p < v) p <<= 1;
    return p;
}

}  // namespace

bool wgrad_tma_plan(const bie_conv_geom &g, int64_t blocks_wanted, WgradTmaTiles *tl) {
    const int64_t cx = (g.c + 63) / 64 * 64;
    if (!bgemm_tma_usable() || g.k != 3 || g.s > 2 || g.n * g.h * g.w * (cx / 8) > INT32_MAX ||
        g.n * g.oh * g.ow > INT32_MAX)
        return false;
    tl->bw = std::min(kP, pow2_at_least(g.ow));
    tl->tr = std::min(kP / tl->bw, pow2_at_least(g.oh));
    tl->nimg = kP / (tl->bw * tl->tr);
    tl->xt = (int)((g.ow + tl->bw - 1) / tl->bw);
    tl->ty = (int)((g.oh + tl->tr - 1) / tl->tr);
    tl->tiles = (g.n + tl->nimg - 1) / tl->nimg * tl->xt * tl->ty;
    tl->halo = tl->gr = tl->xr = 0;
    // Stride 1: the halo form, with the most rows a step whose stage fits kHaloStageMax and
    // whose K rows are at least 3/4 output pixels (unless BIE_CUDA_WGRAD_HALO=0; small images
    // keep the per-tap form, whose steps span several images).
    static const bool halo_wanted = !env_is("BIE_CUDA_WGRAD_HALO", "0");
    const int wp = (int)(g.ow + 2 * g.d), reach = (int)(2 * g.d);
    for (int r = (int)std::min<int64_t>(g.oh, 256 - reach);
         halo_wanted && g.s == 1 && wp <= 256 && r >= 1; r--) {
        const int gr = (r * wp + 15) / 16 * 16, xr = (gr + reach * wp + reach + 7) / 8 * 8;
        if ((gr + xr) * kRow > kHaloStageMax) continue;
        if ((int64_t)r * g.ow * 4 < (int64_t)gr * 3) continue;
        tl->halo = 1, tl->gr = gr, tl->xr = xr, tl->bw = wp, tl->tr = r, tl->nimg = 1, tl->xt = 1;
        tl->ty = (int)((g.oh + r - 1) / r);
        tl->tiles = g.n * tl->ty;
        break;
    }
    const int64_t xy = (g.o + 63) / 64 * (cx / 64);
    int64_t slices = std::max<int64_t>(1, std::min<int64_t>(tl->tiles, blocks_wanted / xy));
    // Partial tiles of 64 MiB at most.
    slices = std::max<int64_t>(
        1, std::min<int64_t>(slices, ((int64_t)64 << 20) / (4 * g.o * g.c * kTaps)));
    tl->per_slice = (int)((tl->tiles + slices - 1) / slices);
    tl->slices = (int)((tl->tiles + tl->per_slice - 1) / tl->per_slice);
    return tl->tiles <= INT32_MAX;
}

size_t wgrad_tma_xs_bytes(const bie_conv_geom &g) {
    return (size_t)(g.n * g.h * g.w * ((g.c + 63) / 64 * 64)) * 2;
}

bie_status wgrad_tma_run(bool half, const bie_conv_geom &g, const void *gt, int op, const void *xs,
                         const WgradTmaTiles &tl, float *part) {
    if (tl.halo)
        return half ? launch<__half, true>(g, gt, op, xs, tl, part)
                    : launch<__nv_bfloat16, true>(g, gt, op, xs, tl, part);
    return half ? launch<__half, false>(g, gt, op, xs, tl, part)
                : launch<__nv_bfloat16, false>(g, gt, op, xs, tl, part);
}

bie_status wgrad_tma_launch(const bie_cuda_bconv_backward_args &a, const void *gt, int op, void *xs,
                            const WgradTmaTiles &tl, float *part) {
    const bie_conv_geom &g = a.g;
    const int cx = (int)((g.c + 63) / 64 * 64), per = cx / 8;
    const int64_t chunks = g.n * g.h * g.w * per;
    const unsigned grid = (unsigned)std::min<int64_t>((chunks + 255) / 256, 65535);
    const bool half = a.dtype == BIE_F16;
    if (half)
        expand_signs<__half><<<grid, 256, 0, current_stream>>>(
            a.signs, (int)chunks, FastDiv(per), per, (int)g.c, cx, static_cast<__half *>(xs));
    else
        expand_signs<__nv_bfloat16>
            <<<grid, 256, 0, current_stream>>>(a.signs, (int)chunks, FastDiv(per), per, (int)g.c,
                                               cx, static_cast<__nv_bfloat16 *>(xs));
    return wgrad_tma_run(half, g, gt, op, xs, tl, part);
}

}  // namespace bie_cuda
