// The exact grad_w of a 16-bit binary linear layer on Hopper (sm_90a):
// grad_w [n][k] = scale_a grad_out^T sign(x'), computed transposed, D [k][n] = sign(x')^T
// grad_out, so that both operands are M/N-major as they lie in memory and the wgmma transposes
// them as it reads: B is grad_out's [m][n] rows, brought by the tensor memory accelerator in
// boxes of 64 rows x 64 values (one 128-byte swizzle row each); A is the ±1 matrix [m rows][the
// tile's 128 features], brought the same way from a ±1 matrix in memory (FROM_MEM, the default)
// or written into the stage by the consumers from the k block's sign bits (one byte of bits is
// one 16-byte row chunk of A), so that no ±1 matrix exists in memory.
//
// Kernel 121's shape otherwise (bgemm_tma.cu): persistent blocks over 128 x 256 tiles of D
// (128 input features j, 256 outputs i), a TMA producer thread, two consumer warpgroups of 64
// features, a ring of three stages, each a k block of 64 batch rows: grad_out's four boxes
// (32 KB), the consumers' A tiles (2 x 8 KB) and the rows' sign bits for the tile's features
// (1 KB). The f32 accumulators sum the whole reduction (bie.h). The epilogue writes D
// transposed: half a tile (128 outputs) at a time through shared memory, so that each warp
// stores whole 512-byte runs of grad_w rows, and keeps the largest |grad_w| for the int8
// quantization (amax_part[blockIdx.x]; entries past the grid zero).
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <type_traits>

#include "backward_common.cuh"
#include "bgemm_wgmma.cuh"
#include "cuda_common.cuh"
#include "cuda_internal.h"
#include "mma.cuh"
#include "pdl.cuh"
#include "tma.cuh"
#include "wgmma.cuh"
#include "wgmma_entry.cuh"

namespace bie_cuda {

namespace {

constexpr int kBM = 128, kBN = 256, kBK = 64;  // features j x outputs i x batch rows a k block
constexpr int kStages = 3;
constexpr int kThreads = 384;              // producer warpgroup + two consumer warpgroups
constexpr int kBBytes = kBN * kBK * 2;     // grad_out's four boxes of 64 x 64 values
constexpr int kABytes = kBM * kBK * 2;     // the two consumers' ±1 tiles of 64 x 64
constexpr int kBitsBytes = kBK * kBM / 8;  // the k block's sign bits: 64 rows x 16 bytes
constexpr int kStage = kBBytes + kABytes + kBitsBytes;
constexpr int kPitch = kBM + 4;  // floats a staged grad_w row (conflict-free stores, below)
constexpr int kStgBytes = kBN / 2 * kPitch * 4;  // half a tile: 128 grad_w rows
constexpr int kBarOffset = kStages * kStage + kStgBytes;
constexpr size_t kSmem = 1024 + (size_t)kBarOffset + 2 * kStages * 8;
static_assert(kStage % 1024 == 0, "stages keep the swizzle alignment");

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

constexpr int kEpiBar = 5;       // the consumers' named barrier (256 threads)
constexpr int kBox = kBK * 128;  // one box of grad_out (8 KB)

// A consumer's ±1 tile of one k block (a, 64 batch rows of 128 bytes, 128-byte swizzled: its 64
// features j, +1 where the bit is set) from the block's sign bits (bits, 64 rows of 16 bytes;
// the consumer's features are bytes 8 c ..): chunk (r, b) of a row is byte b, eight values;
// thread wt writes chunks wt, wt + 128, .. (a warp: four whole rows, free of bank conflicts).
__device__ __forceinline__ void make_a(const uint8_t *bits, uint8_t *a, int c, int wt,
                                       unsigned one2) {
#pragma unroll
    for (int u = 0; u < 4; u++) {
        const int r = (wt >> 3) + 16 * u, b = wt & 7;
        const unsigned nb = ~(unsigned)bits[r * 16 + 8 * c + b];
        uint4 v;
        v.x = one2 | (nb & 1u) << 15 | (nb >> 1 & 1u) << 31;
        v.y = one2 | (nb >> 2 & 1u) << 15 | (nb >> 3 & 1u) << 31;
        v.z = one2 | (nb >> 4 & 1u) << 15 | (nb >> 5 & 1u) << 31;
        v.w = one2 | (nb >> 6 & 1u) << 15 | (nb >> 7 & 1u) << 31;
        *reinterpret_cast<uint4 *>(a + r * 128 + ((b ^ (r & 7)) << 4)) = v;
    }
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// TMA_OUT: grad_w leaves through map_w (rows of 128 bytes x 128, 128-byte swizzled) in bulk
// tensor stores, which the consumers do not wait for past their reads of the staging area.
// FROM_MEM: A comes from a ±1 matrix [m][k] in T (map_s: boxes of 64 rows x 64 values, as
// grad_out's) instead of the consumers' writes from the sign bits (map_s: the bits).
template <typename T, bool TMA_OUT, bool FROM_MEM>
__global__ void __launch_bounds__(kThreads, 1)
    wgrad16(const __grid_constant__ CUtensorMap map_g, const __grid_constant__ CUtensorMap map_s,
            const __grid_constant__ CUtensorMap map_w, const __grid_constant__ WgradArgs p,
            int tiles_m, int tiles_n) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ uint8_t smem[];
    __shared__ unsigned block_amax;  // the largest |grad_w| (float bits)
    const unsigned base = (smem_u32(smem) + 1023) & ~1023u;
    uint8_t *gbase = smem + (base - smem_u32(smem));  // the same address, generic
    const unsigned full0 = base + kBarOffset, empty0 = full0 + kStages * 8;
    const int tid = threadIdx.x, wg = tid >> 7;
    const int kblocks = (int)((p.m + kBK - 1) / kBK);
    const int my_tiles =
        (tiles_m * tiles_n - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x;
    auto origin = [&](int j, int &tm, int &tn) {
        grouped_tile((int)blockIdx.x + j * (int)gridDim.x, tiles_m, tiles_n, tm, tn);
    };
    if (tid == 0) {
        tma_ring_init(full0, empty0, kStages, 2);
        mbar_init_fence();
        block_amax = 0u;
    }
    __syncthreads();
    pdl_wait();  // grad_out and the scale may come from the kernels just before (pdl.cuh)

    if (wg == 0) {  // the producer
        setmaxnreg_dec<40>();
        if (tid == 0) {
            tma_ring_walk(&map_g, &map_s, my_tiles, kblocks, kStages, full0, empty0, origin,
                          [&](int s, int kb, int tm, int tn, unsigned full) {
                              const unsigned dst = base + (unsigned)(s * kStage);
                              mbar_arrive_expect_tx(full,
                                                    kBBytes + (FROM_MEM ? kABytes : kBitsBytes));
#pragma unroll
                              for (int q = 0; q < kBN / 64; q++)  // byte columns of the 64 outputs
                                  tma_load_2d(dst + (unsigned)(q * kBox), &map_g,
                                              (tn * kBN + 64 * q) * 2, kb * kBK, full);
                              if constexpr (FROM_MEM) {
#pragma unroll
                                  for (int q = 0; q < 2; q++)  // each consumer's 64 features
                                      tma_load_2d(dst + kBBytes + (unsigned)(q * kBox), &map_s,
                                                  (tm * kBM + 64 * q) * 2, kb * kBK, full);
                              } else {
                                  tma_load_2d(dst + kBBytes + kABytes, &map_s, tm * (kBM / 8),
                                              kb * kBK, full);
                              }
                          });
        }
        return;
    }

    // A consumer: features 64 c .. of each tile; warp w its rows 16 w .., lane (g, t).
    setmaxnreg_inc<232>();
    const int c = wg - 1, wt = tid & 127, w = wt >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int K = (int)p.k, N = (int)p.n;
    const bool vec = reinterpret_cast<uintptr_t>(p.grad_w) % 16 == 0;
    float *stg = reinterpret_cast<float *>(gbase + kStages * kStage);
    const float alpha = p.scale[0];
    float amax = 0.0f;
    float d[128];
    for (int j = 0, i = 0; j < my_tiles; j++) {
        int tm, tn;
        origin(j, tm, tn);
#pragma unroll
        for (int x = 0; x < 128; x++) d[x] = 0.0f;
        for (int kb = 0; kb < kblocks; kb++, i++) {
            const int s = i % kStages;
            mbar_wait(full0 + 8 * s, (unsigned)(i / kStages) & 1u);
            const unsigned stage = base + (unsigned)(s * kStage);
            const unsigned a_tile = stage + (unsigned)(kBBytes + c * (kABytes / 2));
            if constexpr (!FROM_MEM) {
                constexpr unsigned one2 =
                    std::is_same<T, __half>::value ? 0x3c003c00u : 0x3f803f80u;
                make_a(gbase + s * kStage + kBBytes + kABytes, gbase + (a_tile - base), c, wt,
                       one2);
                fence_proxy_async();  // the generic writes, before the wgmma's reads
                warpgroup_barrier(c + 1);
            }
            fence_acc(d);
            wgmma_fence();
#pragma unroll
            for (int q = 0; q < 4; q++)  // both operands: 8-row groups 1024 bytes apart
                wgmma_f16_ss_mn256<T>(d, smem_desc(a_tile + 2048 * q, kABytes / 2, 1024, 1),
                                      smem_desc(stage + 2048 * q, kBox, 1024, 1));
            wgmma_commit();
            wgmma_wait<1>();
            fence_acc(d);
            if (kb > 0 && wt == 0) mbar_arrive(empty0 + 8 * ((i - 1) % kStages));
        }
        wgmma_wait<0>();
        fence_acc(d);
        if (wt == 0) mbar_arrive(empty0 + 8 * ((i - 1) % kStages));
        const int j0 = tm * kBM, i0 = tn * kBN;
        if constexpr (TMA_OUT) {
            // D rows 64 c + 16 w + g (+ 8) are features j, columns 8 n8 + 2 t (+ 1) outputs i:
            // half a tile (128 outputs) staged as four boxes [i][32 features] of 128-byte rows,
            // their 16-byte chunks swizzled as the tensor map reads them (a warp's stores in 32
            // banks), then stored by thread 128. The largest |value| of the features < K.
            const int jr = 64 * c + 16 * w + g, box = jr >> 5;
            const bool live0 = j0 + jr < K, live1 = j0 + jr + 8 < K;
            const unsigned stg_s = base + (unsigned)(kStages * kStage);
#pragma unroll
            for (int half = 0; half < 2; half++) {
                if (tid == 128) tma_store_wait<0, true>();  // the last half read out
                asm volatile("bar.sync %0, 256;\n" ::"n"(kEpiBar) : "memory");
#pragma unroll
                for (int n8 = 0; n8 < 16; n8++)
#pragma unroll
                    for (int h = 0; h < 2; h++)
#pragma unroll
                        for (int e = 0; e < 2; e++) {
                            const int ir = 8 * n8 + 2 * t + e, jj = (jr + 8 * h) & 31;
                            const float v = d[4 * (n8 + 16 * half) + 2 * h + e] * alpha;
                            if (h ? live1 : live0) amax = fmaxf(amax, fabsf(v));
                            stg[box * 4096 + ir * 32 + (((jj >> 2) ^ (ir & 7)) << 2) + (jj & 3)] =
                                v;
                        }
                fence_proxy_async();  // the generic writes, before the bulk copy's reads
                asm volatile("bar.sync %0, 256;\n" ::"n"(kEpiBar) : "memory");
                if (tid == 128) {
#pragma unroll
                    for (int b = 0; b < 4; b++)
                        tma_store_2d(&map_w, (j0 + 32 * b) * 4, i0 + 128 * half,
                                     stg_s + (unsigned)(b * 16384));
                    tma_store_commit();
                }
            }
        } else {
            // D rows 64 c + 16 w + g (+ 8), columns 8 n8 + 2 t (+ 1): staged as [output][feature]
            // (a warp's 32 stores in 32 banks: kPitch = 4 mod 16), then each warp takes whole
            // staged rows, a lane four features.
#pragma unroll
            for (int half = 0; half < 2; half++) {
                asm volatile("bar.sync %0, 256;\n" ::"n"(kEpiBar) : "memory");  // staging free
#pragma unroll
                for (int n8 = 0; n8 < 16; n8++)
#pragma unroll
                    for (int h = 0; h < 2; h++)
#pragma unroll
                        for (int e = 0; e < 2; e++)
                            stg[(8 * n8 + 2 * t + e) * kPitch + 64 * c + 16 * w + g + 8 * h] =
                                d[4 * (n8 + 16 * half) + 2 * h + e] * alpha;
                asm volatile("bar.sync %0, 256;\n" ::"n"(kEpiBar) : "memory");  // staged
                const int col = j0 + 4 * lane;
                for (int r = (tid - 128) >> 5; r < kBN / 2; r += 8) {
                    const int row = i0 + 128 * half + r;
                    if (row >= N || col >= K) continue;  // K a multiple of 4: all four or none
                    const float4 v = *reinterpret_cast<const float4 *>(stg + r * kPitch + 4 * lane);
                    amax = fmaxf(fmaxf(amax, fmaxf(fabsf(v.x), fabsf(v.y))),
                                 fmaxf(fabsf(v.z), fabsf(v.w)));
                    float *out = p.grad_w + (int64_t)row * K + col;
                    if (vec) {
                        *reinterpret_cast<float4 *>(out) = v;
                    } else {
                        out[0] = v.x, out[1] = v.y, out[2] = v.z, out[3] = v.w;
                    }
                }
            }
        }
    }
    if (TMA_OUT && tid == 128) tma_store_wait<0, false>();  // grad_w written
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if (lane == 0) atomicMax(&block_amax, __float_as_uint(amax));  // amax >= 0
    asm volatile("bar.sync %0, 256;\n" ::"n"(kEpiBar) : "memory");
    if (tid == 128) p.amax_part[blockIdx.x] = __uint_as_float(block_amax);
    if (blockIdx.x == 0)
        for (int e = (int)gridDim.x + tid - 128; e < kAmaxBlocks; e += 256) p.amax_part[e] = 0.0f;
#else
    (void)map_g, (void)map_s, (void)map_w, (void)p, (void)tiles_m, (void)tiles_n;
#endif
}

template <typename T> auto pick_wgrad(bool tma_out, bool mem) {
    return tma_out ? (mem ? wgrad16<T, true, true> : wgrad16<T, true, false>)
                   : (mem ? wgrad16<T, false, true> : wgrad16<T, false, false>);
}

}  // namespace

bool linear_wgrad16_usable() { return bgemm_tma_usable() && kSmem <= max_smem(); }

bie_status linear_wgrad16_launch(const WgradArgs &p) {
    const char *who = "cuda linear backward grad_w (wgmma, TMA)";
    if (!linear_wgrad16_usable())
        return bie_fail(BIE_ERR_UNSUPPORTED, "%s: needs a device of compute capability 9.0", who);
    const int64_t tiles_m = (p.k + kBM - 1) / kBM, tiles_n = (p.n + kBN - 1) / kBN;
    const bool mem = p.xsign != nullptr;
    if (p.m < 1 || p.n < 1 || p.k < 1 || p.n % 8 || p.k % (mem ? 8 : 4) || p.ld % 16 ||
        p.n > INT_MAX || reinterpret_cast<uintptr_t>(p.xsign) % 16 || p.k > INT_MAX ||
        p.m > INT_MAX - kBK || tiles_m * tiles_n > INT_MAX ||
        reinterpret_cast<uintptr_t>(p.grad_out) % 16 || reinterpret_cast<uintptr_t>(p.signs) % 16)
        return bie_fail(BIE_ERR_INTERNAL, "%s: shape %lld x %lld x %lld", who, (long long)p.m,
                        (long long)p.n, (long long)p.k);
    CUtensorMap map_g, map_s, map_w = {};
    if (!tma_map_rows(&map_g, p.grad_out, p.m, p.n * 2, kBK) ||
        !(mem ? tma_map_rows(&map_s, p.xsign, p.m, p.k * 2, kBK)
              : tma_map_bytes(&map_s, p.signs, p.m, p.ld, kBM / 8, kBK)))
        return bie_fail(BIE_ERR_UNSUPPORTED, "%s: the driver cannot describe the operands", who);
    // grad_w through bulk tensor stores where it is 16-byte aligned (and not
    // BIE_CUDA_LINEAR_WGRAD_TMA=0)
    static const bool tma_wanted = !env_is("BIE_CUDA_LINEAR_WGRAD_TMA", "0");
    const bool tma_out = tma_wanted && reinterpret_cast<uintptr_t>(p.grad_w) % 16 == 0 &&
                         tma_map_rows(&map_w, p.grad_w, p.n, p.k * 4, kBN / 2);
    auto fn = pick_wgrad<__half>(tma_out, mem);
    if (!p.half) fn = pick_wgrad<__nv_bfloat16>(tma_out, mem);
    BIE_CUDA_TRY(
        check(cudaFuncSetAttribute(reinterpret_cast<const void *>(fn),
                                   cudaFuncAttributeMaxDynamicSharedMemorySize, (int)kSmem),
              "cudaFuncSetAttribute"));
    // at most kAmaxBlocks blocks: one partial maximum each
    const int64_t blocks =
        std::min<int64_t>({tiles_m * tiles_n, (int64_t)device_sms(), (int64_t)kAmaxBlocks});
    BIE_CUDA_TRY(check(launch_after(fn, dim3((unsigned)blocks), dim3(kThreads), kSmem, map_g, map_s,
                                    map_w, p, (int)tiles_m, (int)tiles_n),
                       who));
    return check(cudaGetLastError(), who);
}

}  // namespace bie_cuda
