// grad_w of the binary conv2d backward for 3 x 3 kernels on Hopper's warpgroup MMA (sm_90a):
// conv_wgrad_mma.cu's product (grad_w [o c k k] = sum over output pixels of grad_out[o] times
// sign(x') at the tap's input pixel, 0 in the padding, as partial tiles per K slice) with
// wgmma.m64n144k16 (f32 accumulators) instead of mma.sync.
//
// A block (two warpgroups) computes 64 output channels x (32 input channels x 9 taps = 288
// columns, column j = channel j / 9, tap j % 9: contiguous in grad_w's rows); warpgroup wg
// owns columns 144 wg ... K runs over the slice's output pixels, 64 per step (two of the
// driver's 32-pixel chunks; pixels past the slice are masked, so the slices' sums are
// unchanged). A, the pixel-major gradient rows of the step's 64 pixels (64 output channels
// each), is copied asynchronously three steps deep and read transposed by ldmatrix into the
// wgmma's register fragments (warp wi of a warpgroup: output channels 16 wi ..). B, the ±1
// signs of each pixel's taps for the block's 32 channels (0 in the padding), is expanded from
// the saved sign words into 128-byte-swizzled rows of 64 pixels (two buffers: the next step's
// expansion overlaps this step's products), which the wgmma reads through a descriptor.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "conv_backward_mma.cuh"
#include "cuda_common.cuh"
#include "mma.cuh"
#include "wgmma.cuh"
#include "wgmma_entry.cuh"

namespace bie_cuda {

namespace {

constexpr int kKK = 9, kCols = 32 * kKK, kHalf = kCols / 2;  // columns: block, warpgroup
constexpr int kPix = 2 * kBK;                                // output pixels per step
constexpr int kBRowBytes = kPix * 2;                         // a B row: 64 pixels, 16 bits
constexpr int kBBuf = kCols * kBRowBytes;                    // one B buffer (36 KB)
static_assert(kBRowBytes == 128, "one 128-byte swizzle row per column and step");
static_assert(kBBuf % 1024 == 0 && kHalf * kBRowBytes % 1024 == 0, "swizzle alignment");
// MT 64-row tiles of output channels a block (64 MT of them): an A row's pitch (elements),
// one A stage (bytes), the block's shared memory.
__host__ __device__ constexpr int a_pitch(int mt) { return 64 * mt + 8; }
constexpr size_t smem_bytes(int mt) {
    return 1024 + 2 * (size_t)kBBuf + (size_t)kWgStages * kPix * a_pitch(mt) * 2;
}

template <typename T, int MT>
__global__ void __launch_bounds__(256, MT == 1 ? 2 : 1)
    wgrad_wgmma3(const T *__restrict__ gt, const uint32_t *__restrict__ signs, bie_conv_geom g64,
                 FastDiv by_ohw, FastDiv by_ow, int op, int chunks_per_slice,
                 float *__restrict__ part) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ __align__(16) unsigned char smem[];
    constexpr int kAPitch = a_pitch(MT);
    typedef T ARow[kAPitch];
    const unsigned bbase = (smem_u32(smem) + 1023) & ~1023u;  // [2][kCols rows of 128 bytes]
    ARow *as = reinterpret_cast<ARow *>(smem + (bbase - smem_u32(smem)) + 2 * kBBuf);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2, wi = warp & 3;
    const int C = (int)g64.c, O = (int)g64.o, H = (int)g64.h, W = (int)g64.w;
    const int OW = (int)g64.ow, OHW = (int)(g64.oh * g64.ow), cw = (C + 31) / 32;
    const int s = (int)g64.s, p = (int)g64.p, d = (int)g64.d;
    const int R = (int)(g64.n * OHW), chunks = (R + kBK - 1) / kBK;
    const int o0 = blockIdx.x * 64 * MT, cword = blockIdx.y;
    const int first = blockIdx.z * chunks_per_slice;
    const int count = min(chunks_per_slice, chunks - first);
    if (count <= 0) return;
    const int base0 = first * kBK, limit = min(R, (first + count) * kBK);
    const int steps = (count + 1) / 2;

    // A: pixel ap of the step, 16-byte chunks 2 MT (tid % 4) and the next 2 MT - 1. B: pixel
    // pair lane;
    // warp w expands the 32 channel rows of tap w, and rows 4 w .. 4 w + 3 of tap 8, so that
    // every warp writes 36 rows.
    const int ap = tid >> 2, ac = (tid & 3) * 2 * MT;
    struct Words {
        uint32_t w[2][2];
        bool in[2][2];
    };
    auto issue_a = [&](int step) {
        if (step < steps) {
            const int rr = base0 + step * kPix + ap;
            const bool ok = rr < limit;
#pragma unroll
            for (int c = 0; c < 2 * MT; c++)
                cp_async16(smem_u32(&as[(step % kWgStages) * kPix + ap][(ac + c) * 8]),
                           gt + (ok ? (int64_t)rr * op + o0 + (ac + c) * 8 : 0), ok);
        }
        cp_async_commit();
    };
    auto load_words = [&](int step, Words &wd) {
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int r = base0 + step * kPix + 2 * lane + e;
            const bool in = step < steps && r < limit;
            const int n = in ? by_ohw.div(r) : 0, pix = r - n * OHW, oy = by_ow.div(pix),
                      ox = pix - oy * OW;
#pragma unroll
            for (int u = 0; u < 2; u++) {
                const int t = u ? kKK - 1 : warp, i = t / 3, j = t - i * 3;
                const int iy = oy * s - p + i * d, ix = ox * s - p + j * d;
                wd.in[u][e] = in && iy >= 0 && iy < H && ix >= 0 && ix < W;
                wd.w[u][e] =
                    wd.in[u][e] ? signs[((int64_t)(n * H + iy) * W + ix) * cw + cword] : 0u;
            }
        }
    };
    // ±1 as the 16-bit pattern (the sign bit from the word's bit, inverted), 0 outside; the
    // 32-bit word of pixels 2 lane, 2 lane + 1 in row b 9 + t: 16-byte chunk lane / 4 of the
    // row at chunk (lane / 4) ^ (row % 8). The two pixels' inverted words are merged so that
    // one shift brings channel b's two bits to bits 15 and 31: lo holds bits 0-15 of both
    // (pixel 2 lane in the low half), hi bits 16-31.
    auto store_b = [&](int buf, const Words &wd) {
        const unsigned one = std::is_same<T, __half>::value ? 0x3c00u : 0x3f80u;
        unsigned char *bb = smem + (bbase - smem_u32(smem)) + buf * kBBuf;
        // Channel b's bits: (lo << (15 - b)) for b < 16, (hi << (31 - b)) from 16 up.
        auto put = [&](int b, int t, uint32_t bits, unsigned mag) {
            const int row = b * kKK + t;
            *reinterpret_cast<unsigned *>(bb + row * kBRowBytes +
                                          ((((lane >> 2) ^ (row & 7))) << 4) + (lane & 3) * 4) =
                (bits & 0x80008000u) | mag;
        };
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const unsigned mag = (wd.in[u][0] ? one : 0u) | (wd.in[u][1] ? one << 16 : 0u);
            const uint32_t n0 = wd.in[u][0] ? ~wd.w[u][0] : 0u;
            const uint32_t n1 = wd.in[u][1] ? ~wd.w[u][1] : 0u;
            const uint32_t lo = (n0 & 0xffffu) | (n1 << 16), hi = (n0 >> 16) | (n1 & 0xffff0000u);
            if (u == 0) {
#pragma unroll 4
                for (int b = 0; b < 16; b++) {
                    put(b, warp, lo << (15 - b), mag);
                    put(b + 16, warp, hi << (15 - b), mag);
                }
            } else {
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    const int b = 4 * warp + q;
                    put(b, kKK - 1, b < 16 ? lo << (15 - b) : hi << (31 - b), mag);
                }
            }
        }
    };

    float acc[MT][kHalf / 2];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int i = 0; i < kHalf / 2; i++) acc[mt][i] = 0.0f;
    Words cur, nxt;
    load_words(0, cur);
    issue_a(0);
    issue_a(1);
    store_b(0, cur);
    load_words(1, cur);
    cp_async_wait<1>();
    fence_proxy_async();
    __syncthreads();
    for (int step = 0; step < steps; step++) {
        const int buf = step & 1, stage = step % kWgStages;
        issue_a(step + 2);
        load_words(step + 2, nxt);
        const unsigned bdesc = bbase + (unsigned)(buf * kBBuf + wg * kHalf * kBRowBytes);
        unsigned af[MT][4];
#pragma unroll
        for (int ks = 0; ks < kPix / 16; ks++) {
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
                ldmatrix_x4_trans(
                    af[mt], smem_u32(&as[stage * kPix + ks * 16 + (lane & 7) + ((lane >> 4) << 3)]
                                        [mt * 64 + wi * 16 + ((lane >> 3) & 1) * 8]));
#pragma unroll
            for (int mt = 0; mt < MT; mt++) fence_acc(acc[mt]);
            wgmma_fence();
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
                wgmma_f16<T, kHalf>(acc[mt], af[mt], smem_desc(bdesc + 32 * ks, 16, 1024, 1));
        }
        wgmma_commit();
        if (step + 1 < steps) store_b(buf ^ 1, cur);  // the other buffer: its reader is done
        cur = nxt;
        wgmma_wait<0>();
#pragma unroll
        for (int mt = 0; mt < MT; mt++) fence_acc(acc[mt]);
        cp_async_wait<1>();
        fence_proxy_async();  // this thread's B stores visible to the next step's wgmma
        __syncthreads();
    }
    cp_async_wait<0>();

    // Rows o0 + 64 mt + 16 wi + g (+ 8), columns 144 wg + 8 nj + 2 tq (+ 1).
    const int gq = lane >> 2, tq = lane & 3;
    const int64_t ckk = (int64_t)C * kKK;
    const int c0 = cword * 32;
    float *out = part + (int64_t)blockIdx.z * O * ckk + (int64_t)c0 * kKK;
    // Pairs of columns as one 8-byte store where the rows are 8-byte aligned (C even) and both
    // columns are in range.
    const bool pairs = C % 2 == 0;
#pragma unroll
    for (int mh = 0; mh < 2 * MT; mh++) {
        const int mt = mh >> 1, h = mh & 1, o = o0 + mt * 64 + wi * 16 + gq + 8 * h;
        if (o >= O) continue;
#pragma unroll
        for (int nj = 0; nj < kHalf / 8; nj++) {
            const int j = wg * kHalf + nj * 8 + 2 * tq;
            const float v0 = acc[mt][4 * nj + 2 * h], v1 = acc[mt][4 * nj + 2 * h + 1];
            float *at = out + (int64_t)o * ckk + j;
            if (pairs && c0 + (j + 1) / kKK < C) {
                *reinterpret_cast<float2 *>(at) = make_float2(v0, v1);
            } else {
                if (c0 + j / kKK < C) at[0] = v0;
                if (c0 + (j + 1) / kKK < C) at[1] = v1;
            }
        }
    }
#else
    (void)gt, (void)signs, (void)g64, (void)by_ohw, (void)by_ow, (void)op, (void)chunks_per_slice,
        (void)part;
#endif
}

template <typename T, int MT>
bie_status launch(const bie_cuda_bconv_backward_args &a, const void *gt, int op,
                  int chunks_per_slice, int slices, float *part) {
    const auto fn = wgrad_wgmma3<T, MT>;
    constexpr size_t smem = smem_bytes(MT);
    BIE_CUDA_TRY(check(cudaFuncSetAttribute(reinterpret_cast<const void *>(fn),
                                            cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem),
                       "cudaFuncSetAttribute (conv grad_w, wgmma)"));
    const dim3 grid((unsigned)((a.g.o + 64 * MT - 1) / (64 * MT)), (unsigned)bie_cuda_conv_cw(&a.g),
                    (unsigned)slices);
    fn<<<grid, 256, smem, current_stream>>>(static_cast<const T *>(gt), a.signs, a.g,
                                            FastDiv((int)(a.g.oh * a.g.ow)), FastDiv((int)a.g.ow),
                                            op, chunks_per_slice, part);
    return check(cudaGetLastError(), "conv grad_w (wgmma)");
}

// 128 output channels a block from 128 of them up (one block per SM; each expanded B row then
// feeds twice the products), unless BIE_CUDA_WGRAD_M=64.
template <typename T>
bie_status launch_typed(const bie_cuda_bconv_backward_args &a, const void *gt, int op,
                        int chunks_per_slice, int slices, float *part) {
    static const bool m64 = env_is("BIE_CUDA_WGRAD_M", "64");
    return a.g.o >= 128 && !m64 ? launch<T, 2>(a, gt, op, chunks_per_slice, slices, part)
                                : launch<T, 1>(a, gt, op, chunks_per_slice, slices, part);
}

}  // namespace

bie_status conv_wgrad_wgmma(const bie_cuda_bconv_backward_args &a, const void *gt, int op,
                            int chunks_per_slice, int slices, float *part) {
    if (a.g.k != 3) return bie_fail(BIE_ERR_UNSUPPORTED, "conv grad_w (wgmma): 3 x 3 kernels only");
    return a.dtype == BIE_F16
               ? launch_typed<__half>(a, gt, op, chunks_per_slice, slices, part)
               : launch_typed<__nv_bfloat16>(a, gt, op, chunks_per_slice, slices, part);
}

}  // namespace bie_cuda
