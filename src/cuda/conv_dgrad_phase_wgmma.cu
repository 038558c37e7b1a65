// grad_x of the binary conv2d backward for the layers the halo kernel does not take (strides
// above 1, outputs of another size than the input), on Hopper's warpgroup MMA (sm_90a):
// conv_backward_mma.cu's dgrad_mma (the same tiles, phases and results) with the products as
// wgmma reading both operands from shared memory.
//
// A block (two warpgroups) computes kDgM = 128 input pixels of one stride phase x NB input
// channels (64, or 128 where the padded channels allow). Each K step is one of the phase's
// taps and kDgK = 64 output channels. Every pixel's row of the pixel-major gradient at the
// output pixel the tap maps it to (zeros where none) is copied asynchronously, two steps
// ahead, into a 128-byte-swizzled row of the stage's A tile. The ±1 weights of the tap (NB
// channels x 64 output channels) land likewise in its B tile. Warpgroup wg multiplies A rows
// 64 wg .. by B with four wgmma.m64nNBk16 per step: no fragment loads at all.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "conv_backward_mma.cuh"
#include "conv_dgrad_wgmma.cuh"
#include "cuda_common.cuh"
#include "mma.cuh"
#include "wgmma.cuh"
#include "wgmma_entry.cuh"

namespace bie_cuda {

namespace {

constexpr int kRowBytes = kDgK * 2;        // a row of a stage: 64 16-bit values, one swizzle row
constexpr int kAStage = kDgM * kRowBytes;  // a stage's A tile (16 KB)
static_assert(kRowBytes == 128 && kAStage % 1024 == 0, "the 128-byte swizzle's alignment");
// One stage: the A tile and NB rows of B.
__host__ __device__ constexpr int stage_bytes(int nb) { return kAStage + nb * kRowBytes; }

template <typename T, int NB>
__global__ void __launch_bounds__(256, 2)
    dgrad_phase_wgmma(const T *__restrict__ gt, const T *__restrict__ wt,
                      const uint32_t *__restrict__ mask, const uint32_t *__restrict__ signs,
                      const float *__restrict__ scales, bie_conv_geom g64, DgradPhaseSplit phases,
                      int op, int cp, T *__restrict__ grad_x, float *__restrict__ part_sum,
                      float *__restrict__ part_dot) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ __align__(16) unsigned char smem[];
    static_assert(NB == 64 || NB == 128, "64 or 128 channels a block");
    constexpr int kStage = stage_bytes(NB);
    __shared__ int taps[16];  // the phase's taps (k <= 3)
    __shared__ float red[2][8][NB];
    const unsigned base = (smem_u32(smem) + 1023) & ~1023u;  // [kDgStages][kStage]
    const int tid = threadIdx.x, wg = tid >> 7;
    const DgradPhaseTile pt = dgrad_phase_tile(g64, phases.split, phases.first, kDgM);
    const int m0 = pt.m0, c0 = blockIdx.y * NB;
    const int ntaps = dgrad_phase_taps(g64, pt, taps);
    __syncthreads();

    // This thread's A row (one input pixel, half of its 8 16-byte chunks) and B rows.
    const int am = tid >> 1, ach = (tid & 1) * 4;
    const DgradGather px(g64, pt.pixel_of(m0 + am));
    const int per_tap = op / kDgK, steps = ntaps * per_tap;
    int itn = 0, ioc = 0;  // the tap (index into taps) and output-channel block copied next
    // The next step's copies into stage `stage`: 16-byte chunk c of row r at chunk c ^ (r % 8).
    auto issue = [&](int stage) {
        const int o0 = ioc * kDgK, t = taps[itn];
        const int row = px.row(g64, t);
        const bool ok = row >= 0;
        const T *src = gt + (ok ? (int64_t)row * op + o0 : 0);
        const unsigned sa = base + (unsigned)(stage * kStage + am * kRowBytes);
#pragma unroll
        for (int c = 0; c < 4; c++)
            cp_async16(sa + (unsigned)(((ach + c) ^ (am & 7)) << 4), src + (ach + c) * 8, ok);
#pragma unroll
        for (int row = tid >> 2; row < NB; row += 64) {
            const T *w = wt + ((int64_t)t * cp + c0 + row) * op + o0;
            const unsigned sb = base + (unsigned)(stage * kStage + kAStage + row * kRowBytes);
#pragma unroll
            for (int c = 0; c < 2; c++) {
                const int qc = (tid & 3) * 2 + c;
                cp_async16(sb + (unsigned)((qc ^ (row & 7)) << 4), w + qc * 8, true);
            }
        }
        if (++ioc == per_tap) ioc = 0, itn++;
    };

    float acc[1][NB / 2];
#pragma unroll
    for (int i = 0; i < NB / 2; i++) acc[0][i] = 0.0f;
#pragma unroll
    for (int st = 0; st < kDgStages - 1; st++) {
        if (st < steps) issue(st);
        cp_async_commit();
    }
    for (int step = 0, stage = 0; step < steps; step++) {
        cp_async_wait<kDgStages - 2>();
        fence_proxy_async();  // this thread's copies visible to the wgmma
        __syncthreads();      // everyone's copies of this step; the last step's wgmma done
        if (step + kDgStages - 1 < steps) issue((stage + kDgStages - 1) % kDgStages);
        cp_async_commit();
        const unsigned sa = base + (unsigned)(stage * kStage + wg * 64 * kRowBytes);
        const unsigned sb = base + (unsigned)(stage * kStage + kAStage);
        fence_acc(acc[0]);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < kDgK / 16; ks++)
            wgmma_f16_ss<T, NB>(acc[0], smem_desc(sa + 32 * ks, 16, 1024, 1),
                                smem_desc(sb + 32 * ks, 16, 1024, 1));
        wgmma_commit();
        wgmma_wait<0>();
        fence_acc(acc[0]);
        if (++stage == kDgStages) stage = 0;
    }
    cp_async_wait<0>();

    wg_dgrad_epilogue<T, 1, NB>(
        acc, [=](int r) { return pt.pixel_of(m0 + r); }, mask, signs, scales[1], (int)g64.c, pt.HW,
        g64.nhwc != 0, c0, grad_x, part_sum, part_dot, red);
#else
    (void)gt, (void)wt, (void)mask, (void)signs, (void)scales, (void)g64, (void)phases, (void)op,
        (void)cp, (void)grad_x, (void)part_sum, (void)part_dot;
#endif
}

template <typename T, int NB>
bie_status launch(const DgradHaloArgs &a, const DgradPhaseSplit &phases) {
    auto fn = dgrad_phase_wgmma<T, NB>;
    const size_t smem = dgrad_phase_wgmma_smem(NB);
    BIE_CUDA_TRY(check(cudaFuncSetAttribute(reinterpret_cast<const void *>(fn),
                                            cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem),
                       "cudaFuncSetAttribute (conv grad_x, wgmma phases)"));
    fn<<<a.grid, 256, smem, current_stream>>>(
        static_cast<const T *>(a.gt), static_cast<const T *>(a.wt), a.mask, a.signs, a.scales, a.g,
        phases, a.op, a.cp, static_cast<T *>(a.grad_x), a.part_sum, a.part_dot);
    return check(cudaGetLastError(), "conv grad_x (wgmma phases)");
}

template <typename T>
bie_status launch_typed(const DgradHaloArgs &a, const DgradPhaseSplit &phases) {
    return a.nb == 128 ? launch<T, 128>(a, phases) : launch<T, 64>(a, phases);
}

}  // namespace

size_t dgrad_phase_wgmma_smem(int nb) { return 1024 + (size_t)kDgStages * stage_bytes(nb); }

bie_status dgrad_phase_wgmma_launch(const DgradHaloArgs &a, const DgradPhaseSplit &phases) {
    return a.half ? launch_typed<__half>(a, phases) : launch_typed<__nv_bfloat16>(a, phases);
}

}  // namespace bie_cuda
