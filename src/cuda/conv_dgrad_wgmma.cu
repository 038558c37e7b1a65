// grad_x of the binary conv2d backward, halo form (conv_backward_mma.cu's dgrad_halo_mma), on
// Hopper's warpgroup MMA (sm_90a): the same tiles, steps and results, with the products as
// wgmma.m64n{64,128}k16 (f32 accumulators) instead of mma.sync.m16n8k16.
//
// A block (two warpgroups) computes 128 RB input pixels (whole rows of the flattened [n h]
// image rows, `tr` of them) x NB input channels (64; 128 with RB = 1 where the padded channels
// allow: each gathered fragment then feeds twice the products). Warpgroup wg owns tile rows
// 64 RB wg ..; its warp wi gathers the A fragments of rows + 16 wi of each 64-row block from
// the halo with ldmatrix (the zero row where a tap leaves the image), exactly as the mma.sync
// kernel does, and the warpgroup issues one wgmma per 64-row block and k16 step with A from
// those registers. B, the ±1 weight of the step's tap (NB channels x 64 output channels, 128
// bytes a row), is copied into 128-byte-swizzled shared memory that the wgmma reads through a
// matrix descriptor: no B fragment loads at all.
//
// The epilogue is the mma.sync kernel's (the clip mask, scale_w, grad_x in its dtype, the
// tile's per-channel sums of the masked gradient and of its product with sign(x')) for the
// wgmma accumulator layout: each warp holds 16 rows of every 64-row block and all 64 channels.
// The channel sums are reduced over the 8 warps in a fixed order: the results do not vary from
// run to run (their rounding differs from the mma.sync kernel's).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "conv_backward_mma.cuh"
#include "conv_dgrad_wgmma.cuh"
#include "cuda_common.cuh"
#include "dtype.cuh"
#include "mma.cuh"
#include "wgmma.cuh"
#include "wgmma_entry.cuh"

namespace bie_cuda {

namespace {

constexpr int kBRow = kDgK * 2;  // bytes of a B row: 64 output channels of 16 bits
static_assert(kBRow == 128, "one 128-byte swizzle row per channel and step");
// One stage's weight tile for NB input channels (8 or 16 KB; the swizzle's 1024-byte
// alignment kept).
__host__ __device__ constexpr int b_stage(int nb) { return nb * kBRow; }

template <typename T, int RB, int NB>
__global__ void __launch_bounds__(256, 2)
    dgrad_halo_wgmma(const T *__restrict__ gt, const T *__restrict__ wt,
                     const uint32_t *__restrict__ mask, const uint32_t *__restrict__ signs,
                     const float *__restrict__ scales, bie_conv_geom g64, int op, int cp, int tr,
                     T *__restrict__ grad_x, float *__restrict__ part_sum,
                     float *__restrict__ part_dot) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ __align__(16) unsigned char smem[];
    static_assert(NB == 64 || NB == 128, "64 or 128 channels a block");
    constexpr int kBStage = b_stage(NB);
    __shared__ float red[2][8][NB];
    typedef T Row[kDgPitch];
    const unsigned bring = (smem_u32(smem) + 1023) & ~1023u;  // [kDgStages][kBStage]
    Row *halo = reinterpret_cast<Row *>(smem + (bring - smem_u32(smem)) + kDgStages * kBStage);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2, wi = warp & 3;
    const int H = (int)g64.h, W = (int)g64.w, NH = (int)g64.n * H, k = (int)g64.k;
    const int kk = k * k, p = (int)g64.p, d = (int)g64.d;
    const int hpix = (tr + (k - 1) * d) * W, gy0 = blockIdx.x * tr, c0 = blockIdx.y * NB;
    Row *zero = halo + dgrad_halo_buffers(op) * hpix;
    if (tid < 8) *reinterpret_cast<uint4 *>(&zero[0][tid * 8]) = make_uint4(0, 0, 0, 0);

    // The A rows this lane addresses: tile row, column and image row of each 64-row block's
    // pixel 64 RB wg + 64 rb + 16 wi + lane % 16.
    int ltr[RB], lx[RB], ly[RB];
    bool lok[RB];
#pragma unroll
    for (int rb = 0; rb < RB; rb++) {
        const int m = wg * 64 * RB + rb * 64 + wi * 16 + (lane & 15), r = m / W, gy = gy0 + r;
        ltr[rb] = r;
        lx[rb] = m - r * W;
        lok[rb] = r < tr && gy < NH;
        ly[rb] = gy % H;
    }
    const int steps = op / kDgK * kk;
    // issue(oc, t, stage): the copies of step oc kk + t (output channels 64 oc .., tap t).
    auto issue = [&](int oc, int t, int stage) {
        const int o0 = oc * kDgK;
        if (t == 0)
            dgrad_copy_halo<T>(halo + (oc & 1) * hpix, gt, gy0, p, k, d, W, NH, hpix, op, o0);
            // The weight rows of channels c0 .. c0 + NB - 1 at tap t, output channels o0 ..:
            // 16-byte chunk q of row r at chunk q ^ (r % 8) (the 128-byte swizzle).
#pragma unroll
        for (int row = tid >> 2; row < NB; row += 64) {
            const T *src = wt + ((int64_t)t * cp + c0 + row) * op + o0;
            const unsigned dst = bring + (unsigned)(stage * kBStage + row * kBRow);
#pragma unroll
            for (int c = 0; c < 2; c++) {
                const int q = (tid & 3) * 2 + c;
                cp_async16(dst + (unsigned)((q ^ (row & 7)) << 4), src + q * 8, true);
            }
        }
    };

    float acc[RB][NB / 2];
#pragma unroll
    for (int rb = 0; rb < RB; rb++)
#pragma unroll
        for (int i = 0; i < NB / 2; i++) acc[rb][i] = 0.0f;
    // The steps' (output channel block, tap) counted up rather than divided out: the step
    // being multiplied (oc, t = i k + j) and the one being copied (noc, nt).
    int noc = 0, nt = 0;
    auto advance = [&](int &o, int &t) {
        if (++t == kk) t = 0, o++;
    };
#pragma unroll
    for (int st = 0; st < kDgStages - 1; st++) {
        if (st < steps) issue(noc, nt, st);
        advance(noc, nt);
        cp_async_commit();
    }
    int oc = 0, t = 0, i = 0, j = 0, stage = 0, nstage = kDgStages - 1;
    for (int step = 0; step < steps; step++) {
        cp_async_wait<kDgStages - 2>();
        fence_proxy_async();  // this thread's weight copies visible to the wgmma
        __syncthreads();      // everyone's copies of this step; the last step's wgmma done
        if (step + kDgStages - 1 < steps) issue(noc, nt, nstage);
        advance(noc, nt);
        if (++nstage == kDgStages) nstage = 0;
        cp_async_commit();
        const Row *hb = halo + (oc & 1) * hpix;
        unsigned aaddr[RB];
#pragma unroll
        for (int rb = 0; rb < RB; rb++) {
            const int oy = ly[rb] + p - i * d, ox = lx[rb] + p - j * d;
            const bool ok = lok[rb] && oy >= 0 && oy < H && ox >= 0 && ox < W;
            aaddr[rb] = smem_u32(ok ? &hb[(ltr[rb] + (k - 1 - i) * d) * W + ox][0] : &zero[0][0]) +
                        (lane >> 4) * 16;
        }
        const unsigned bst = bring + (unsigned)(stage * kBStage);
        unsigned af[kDgK / 16][RB][4];
        // Every k16 step's fragments first, then one fence and the four wgmma back to back.
#pragma unroll
        for (int ks = 0; ks < kDgK / 16; ks++)
#pragma unroll
            for (int rb = 0; rb < RB; rb++)
                ldmatrix_x4(af[ks][rb], aaddr[rb] + ks * 16 * (int)sizeof(T));
#pragma unroll
        for (int rb = 0; rb < RB; rb++) fence_acc(acc[rb]);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < kDgK / 16; ks++)
#pragma unroll
            for (int rb = 0; rb < RB; rb++)
                wgmma_f16<T, NB>(acc[rb], af[ks][rb], smem_desc(bst + 32 * ks, 16, 1024, 1));
        wgmma_commit();
        wgmma_wait<0>();
#pragma unroll
        for (int rb = 0; rb < RB; rb++) fence_acc(acc[rb]);
        if (++stage == kDgStages) stage = 0;
        if (++j == k) j = 0, i++;
        if (++t == kk) t = 0, i = 0, oc++;
    }
    cp_async_wait<0>();

    const int m0 = gy0 * W, rows = min(tr * W, NH * W - m0);
    wg_dgrad_epilogue<T, RB, NB>(
        acc, [=](int r) { return r < rows ? m0 + r : -1; }, mask, signs, scales[1], (int)g64.c,
        H * W, g64.nhwc != 0, c0, grad_x, part_sum, part_dot, red);
#else
    (void)gt, (void)wt, (void)mask, (void)signs, (void)scales, (void)g64, (void)op, (void)cp,
        (void)tr, (void)grad_x, (void)part_sum, (void)part_dot;
#endif
}

template <typename T, int RB, int NB> bie_status launch(const DgradHaloArgs &a) {
    auto fn = dgrad_halo_wgmma<T, RB, NB>;
    // Held to the launch: the shared memory depends on the shape (cuda_common.cuh).
    std::lock_guard<std::mutex> smem_lock(smem_attribute_mutex());
    BIE_CUDA_TRY(
        check(cudaFuncSetAttribute(reinterpret_cast<const void *>(fn),
                                   cudaFuncAttributeMaxDynamicSharedMemorySize, (int)a.smem),
              "cudaFuncSetAttribute (conv grad_x, wgmma)"));
    fn<<<a.grid, 256, a.smem, current_stream>>>(
        static_cast<const T *>(a.gt), static_cast<const T *>(a.wt), a.mask, a.signs, a.scales, a.g,
        a.op, a.cp, a.tr, static_cast<T *>(a.grad_x), a.part_sum, a.part_dot);
    return check(cudaGetLastError(), "conv grad_x (wgmma)");
}

template <typename T> bie_status launch_typed(const DgradHaloArgs &a) {
    if (a.rb == 2) return launch<T, 2, 64>(a);
    return a.nb == 128 ? launch<T, 1, 128>(a) : launch<T, 1, 64>(a);
}

}  // namespace

size_t dgrad_halo_wgmma_smem(int tr, int k, int d, int w, int op, int nb) {
    return 1024 + (size_t)kDgStages * b_stage(nb) +
           ((size_t)dgrad_halo_buffers(op) * (tr + (k - 1) * d) * w + 1) * kDgPitch * 2;
}

bie_status dgrad_halo_wgmma_launch(const DgradHaloArgs &a) {
    if (a.rb == 2 && a.nb != 64)
        return bie_fail(BIE_ERR_INTERNAL, "conv grad_x (wgmma): 256-pixel tiles take 64 channels");
    return a.half ? launch_typed<__half>(a) : launch_typed<__nv_bfloat16>(a);
}

}  // namespace bie_cuda
