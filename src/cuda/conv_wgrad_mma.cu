// Binary conv2d backward on tensor cores, grad_w (see conv_backward_mma.cu for both
// products): grad_w [o c k k] = scale_a * sum over output pixels of grad_out[o] * sign(x') at
// the tap's input pixel (0 in the padding), as partial tiles per K slice that the driver sums
// in a fixed order.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "backward_common.cuh"
#include "conv_backward_mma.cuh"
#include "dtype.cuh"
#include "mma.cuh"

namespace bie_cuda {
namespace {

// grad_w shared memory: A [kWgStages][kBK][kWgPitch] (pixel rows) + B [2][32 KK][kPitch] (T).
template <typename T, int KS> constexpr size_t wgrad_smem() {
    return ((size_t)kWgStages * kBK * kWgPitch + (size_t)2 * 32 * KS * KS * kPitch) * sizeof(T);
}

// grad_w: block (output-channel tile, 32-channel word, K slice); 8 warps as 2 (output
// channels, 32 each) x 4 (8 KK columns each). Column j of the tile is channel j / KK, tap
// j % KK: the tile's columns are contiguous in grad_w's [o][c k k] rows. A: kBK pixel rows of
// the pixel-major gradient, copied asynchronously and read transposed; B: the signs of the
// pixels' taps for the block's 32 channels (0 in the padding), expanded from their words.
template <typename T, int KS>
__global__ void __launch_bounds__(256, 2)
    wgrad_mma(const T *__restrict__ gt, const uint32_t *__restrict__ signs, bie_conv_geom g64,
              FastDiv by_ohw, FastDiv by_ow, int op, int chunks_per_slice,
              float *__restrict__ part) {
    constexpr int KK = KS * KS, BN = 32 * KK;
    extern __shared__ __align__(16) unsigned char smem[];
    typedef T ARow[kWgPitch];
    typedef T BRow[kPitch];
    ARow *as = reinterpret_cast<ARow *>(smem);  // [stage * kBK + pixel]
    BRow *bs = reinterpret_cast<BRow *>(smem + (size_t)kWgStages * kBK * kWgPitch * sizeof(T));
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gq = lane >> 2, tq = lane & 3;
    const int wm = warp & 1, wn = warp >> 1;
    const int C = (int)g64.c, O = (int)g64.o, H = (int)g64.h, W = (int)g64.w;
    const int OW = (int)g64.ow, OHW = (int)(g64.oh * g64.ow), cw = (C + 31) / 32;
    const int s = (int)g64.s, p = (int)g64.p, d = (int)g64.d;
    const int R = (int)(g64.n * OHW), chunks = (R + kBK - 1) / kBK;
    const int o0 = blockIdx.x * kWgM, cword = blockIdx.y;
    const int first = blockIdx.z * chunks_per_slice;
    const int steps = min(chunks_per_slice, chunks - first);
    if (steps <= 0) return;

    // A: pixel ap, 16-byte chunk ac. B: pixel pair bp, channels 16 bh .. 16 bh + 15, taps warp
    // and warp + 8. A is copied kWgStages - 1 steps ahead; B's sign words are loaded one step
    // before they are expanded (after the next step's products), so both loads' latency hides
    // behind a step of products.
    const int ap = tid >> 3, ac = tid & 7, bp = lane & 15, bh = lane >> 4;
    struct Words {
        uint32_t w[2][2];
        bool in[2][2];
    };
    auto issue_a = [&](int step) {
        if (step < steps) {
            const int rr = (first + step) * kBK + ap;
            cp_async16(smem_u32(&as[(step % kWgStages) * kBK + ap][ac * 8]),
                       gt + (rr < R ? (int64_t)rr * op + o0 + ac * 8 : 0), rr < R);
        }
        cp_async_commit();
    };
    auto load_words = [&](int step, Words &wd) {
        const int base = (first + step) * kBK;
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int r = base + 2 * bp + e;
            const bool in = step < steps && r < R;
            const int n = in ? by_ohw.div(r) : 0, pix = r - n * OHW, oy = by_ow.div(pix),
                      ox = pix - oy * OW;
#pragma unroll
            for (int u = 0; u < 2; u++) {
                const int t = warp + 8 * u, i = t / KS, j = t - i * KS;
                const int iy = oy * s - p + i * d, ix = ox * s - p + j * d;
                wd.in[u][e] = t < KK && in && iy >= 0 && iy < H && ix >= 0 && ix < W;
                wd.w[u][e] =
                    wd.in[u][e] ? signs[((int64_t)(n * H + iy) * W + ix) * cw + cword] : 0u;
            }
        }
    };
    auto store_b = [&](int buf, const Words &wd) {
        // ±1 as the 16-bit pattern (the sign bit from the word's bit, inverted), 0 outside:
        // per pair of pixels, base holds the two magnitudes, n0 / n1 the sign bits.
        const unsigned one = std::is_same<T, __half>::value ? 0x3c00u : 0x3f80u;
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const int t = warp + 8 * u;
            if (t >= KK) continue;
            const unsigned base = (wd.in[u][0] ? one : 0u) | (wd.in[u][1] ? one << 16 : 0u);
            const uint32_t n0 = (wd.in[u][0] ? ~wd.w[u][0] : 0u) >> (bh * 16);
            const uint32_t n1 = (wd.in[u][1] ? ~wd.w[u][1] : 0u) >> (bh * 16);
            BRow *col = bs + buf * BN + bh * 16 * KK + t;
#pragma unroll
            for (int b = 0; b < 16; b++)
                *reinterpret_cast<unsigned *>(&col[b * KK][2 * bp]) =
                    base | ((n0 << (15 - b)) & 0x8000u) | ((n1 << (31 - b)) & 0x80000000u);
        }
    };

    float acc[2][KK][4] = {};
    Words cur, nxt;
    load_words(0, cur);
    issue_a(0);
    issue_a(1);
    store_b(0, cur);
    load_words(1, cur);
    cp_async_wait<1>();
    __syncthreads();
    for (int step = 0; step < steps; step++) {
        const int buf = step & 1, stage = step % kWgStages;
        issue_a(step + 2);
        load_words(step + 2, nxt);
#pragma unroll
        for (int ks = 0; ks < kBK; ks += 16) {
            unsigned af[2][4];
#pragma unroll
            for (int mi = 0; mi < 2; mi++)
                ldmatrix_x4_trans(af[mi],
                                  smem_u32(&as[stage * kBK + ks + (lane & 7) + ((lane >> 4) << 3)]
                                              [wm * 32 + mi * 16 + ((lane >> 3) & 1) * 8]));
            const BRow *bb = bs + buf * BN + wn * 8 * KK;
#pragma unroll
            for (int ni = 0; ni < KK; ni += 2) {
                unsigned b[4];
                if (ni + 1 < KK)
                    ldmatrix_x4(b, smem_u32(&bb[ni * 8 + (lane & 7) + (lane >> 4) * 8]
                                               [ks + ((lane >> 3) & 1) * 8]));
                else
                    ldmatrix_x2(b[0], b[1],
                                smem_u32(&bb[ni * 8 + (lane & 7)][ks + ((lane >> 3) & 1) * 8]));
#pragma unroll
                for (int mi = 0; mi < 2; mi++) {
                    mma16816<T>(acc[mi][ni], af[mi], b[0], b[1]);
                    if (ni + 1 < KK) mma16816<T>(acc[mi][ni + 1], af[mi], b[2], b[3]);
                }
            }
        }
        if (step + 1 < steps) store_b(buf ^ 1, cur);
        cur = nxt;
        cp_async_wait<1>();
        __syncthreads();
    }

    const int64_t ckk = (int64_t)C * KK;
    const int c0 = cword * 32;
    float *out = part + (int64_t)blockIdx.z * O * ckk + (int64_t)c0 * KK;
#pragma unroll
    for (int mi = 0; mi < 2; mi++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int o = o0 + wm * 32 + mi * 16 + gq + 8 * h;
            if (o >= O) continue;
#pragma unroll
            for (int ni = 0; ni < KK; ni++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int j = wn * 8 * KK + ni * 8 + 2 * tq + e;
                    if (c0 + j / KK < C) out[(int64_t)o * ckk + j] = acc[mi][ni][2 * h + e];
                }
        }
}

template <typename T, int KS>
bie_status launch_wgrad(const bie_cuda_bconv_backward_args &a, const T *gt, int op,
                        int chunks_per_slice, int slices, float *part) {
    const auto fn = wgrad_mma<T, KS>;
    constexpr size_t smem = wgrad_smem<T, KS>();
    BIE_CUDA_TRY(
        check(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem),
              "cudaFuncSetAttribute (conv grad_w)"));
    const dim3 grid((unsigned)((a.g.o + kWgM - 1) / kWgM), (unsigned)bie_cuda_conv_cw(&a.g),
                    (unsigned)slices);
    fn<<<grid, 256, smem, current_stream>>>(gt, a.signs, a.g, FastDiv((int)(a.g.oh * a.g.ow)),
                                            FastDiv((int)a.g.ow), op, chunks_per_slice, part);
    return BIE_OK;
}

template <typename T>
bie_status wgrad_typed(const bie_cuda_bconv_backward_args &a, const T *gt, int op,
                       int chunks_per_slice, int slices, float *part) {
    switch (a.g.k) {
    case 1: return launch_wgrad<T, 1>(a, gt, op, chunks_per_slice, slices, part);
    case 2: return launch_wgrad<T, 2>(a, gt, op, chunks_per_slice, slices, part);
    default: return launch_wgrad<T, 3>(a, gt, op, chunks_per_slice, slices, part);
    }
}

}  // namespace

bie_status conv_wgrad_mma(const bie_cuda_bconv_backward_args &a, const void *gt, int op,
                          int chunks_per_slice, int slices, float *part) {
    return a.dtype == BIE_F16
               ? wgrad_typed(a, static_cast<const __half *>(gt), op, chunks_per_slice, slices, part)
               : wgrad_typed(a, static_cast<const __nv_bfloat16 *>(gt), op, chunks_per_slice,
                             slices, part);
}

}  // namespace bie_cuda
