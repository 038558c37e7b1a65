// grad_x of the binary conv2d backward for channels-last layers on Hopper (sm_90a), with the
// operands brought by the tensor memory accelerator: the products and results of the halo and
// stride-phase kernels (conv_dgrad_wgmma.cu, conv_dgrad_phase_wgmma.cu), with the roles of the
// operands swapped so that the wide side of each wgmma is the pixels.
//
// The input pixels are split by stride phase (y mod s, x mod s), as in the phase kernels; a
// phase's pixels form an image of their own, tiled in boxes of whole rows (or of whole images
// where they are small). A warpgroup computes 64 input channels x 256 pixels of a box as
// wgmma.m64n256k16: A is the ±1 weight of the step's tap (64 input channels x 64 output
// channels, 128 bytes a row), B the pixel-major gradient rows that the tap maps the box's
// pixels to. Tap (i, j) maps phase pixel (yy, xx) to gradient pixel (yy + (ry + p - i d) / s,
// xx + (rx + p - j d) / s) where it reaches the phase at all: the box itself, shifted. So each
// K step (a tap and 64 output channels) is one 4D bulk tensor copy of the NHWC gradient at a
// shifted origin, which also writes the zeros where the box leaves the image: no gather, no
// halo, no padding in shared memory. A producer warp issues the copies into a ring of stages
// (full / empty barriers, as kernel 121); one or two consumer warpgroups (64 channels each,
// sharing the gradient tile) read both operands through descriptors.
//
// Stride-1 layers whose rows tile well take the halo form instead: per 64 output channels, one
// copy brings the gradient rows a tile's taps reach (with zero columns on both sides, so a row
// is W + (k - 1) d pixels), the tile's pixels are numbered over that padded width, and each
// tap's B operand is a view into those rows from the tap's offset on. The gradient then crosses
// from L2 once per 64 output channels instead of once per tap; the padded columns' products are
// wasted (6 % at 32-pixel rows), so the form is taken only where its tiles hold at least 7/8 of
// the per-tap tiles' pixels.
//
// The tile's clip mask and sign words are copied (cp.async) while the products run. The
// epilogue applies the clip mask and scale_w, stages the tile's grad_x through shared
// memory (NHWC rows written 16 bytes at a time), and writes the tile's per-channel sums of the
// masked gradient and of its product with sign(x'), each summed in a fixed order.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>

#include "conv_backward_mma.cuh"
#include "conv_common.cuh"
#include "cuda_common.cuh"
#include "dtype.cuh"
#include "tma.cuh"
#include "wgmma.cuh"
#include "wgmma_entry.cuh"

namespace bie_cuda {

namespace {

constexpr int kPix = 256;            // pixels of a tile: the wgmma's N
constexpr int kRow = 128;            // a shared row: 64 16-bit channels
constexpr int kBTile = kPix * kRow;  // the gradient tile of a stage (32 KB)
constexpr int kATile = 64 * kRow;    // a weight tile: 64 x 64 (8 KB)
constexpr int kHaloMaxRows = 1024;   // the halo form's gradient rows (128 KB)
static_assert(kDgK * 2 == kRow, "64 output channels a step");
// NC consumer warpgroups (64 input channels each) and S stages: a stage's bytes, the block's
// dynamic shared memory (the ring, then the full and empty barriers).
__host__ __device__ constexpr int stage_bytes(int nc) { return kBTile + nc * kATile; }
constexpr size_t smem_bytes(int nc, int s) { return 1024 + (size_t)s * stage_bytes(nc) + 16 * s; }
static_assert(kBTile % 1024 == 0 && kATile % 1024 == 0, "the swizzle's alignment");

// A consumer's per-channel sums of the tile (channels c and c + 8; csum, cdot over its
// columns) added over the quad's four lanes in a fixed order, at part_* [blockIdx.x][channel].
__device__ __forceinline__ void tile_sums(float (&csum)[2], float (&cdot)[2], int c, int C, int tq,
                                          float *__restrict__ part_sum,
                                          float *__restrict__ part_dot) {
#pragma unroll
    for (int h = 0; h < 2; h++) {
#pragma unroll
        for (int off = 1; off < 4; off <<= 1) {
            csum[h] += __shfl_xor_sync(0xffffffffu, csum[h], off);
            cdot[h] += __shfl_xor_sync(0xffffffffu, cdot[h], off);
        }
        if (tq == 0 && c + 8 * h < C) {
            const int64_t at = (int64_t)blockIdx.x * C + c + 8 * h;
            part_sum[at] = csum[h];
            part_dot[at] = cdot[h];
        }
    }
}

// A consumer thread's accumulators pixel by pixel, as the m64nNk16 fragment holds them:
// body(r, a0, a1) for tile pixels r = 8 nj + 2 tq + e, with a0 / a1 the products of r with the
// thread's channels 16 wi + gq and 16 wi + gq + 8 of the consumer's 64 (the epilogues' walk).
template <class Body>
__device__ __forceinline__ void for_each_pixel(float (&acc)[kPix / 2], int tq, Body &&body) {
#pragma unroll
    for (int nj = 0; nj < kPix / 8; nj++)
#pragma unroll
        for (int e = 0; e < 2; e++) body(nj * 8 + 2 * tq + e, acc[4 * nj + e], acc[4 * nj + 2 + e]);
}

// One K step's products (a tap, 64 output channels): the weight tile at a_tile times the
// gradient rows from b_rows on, committed as one wgmma group.
// F8: e4m3 operands, 128 output channels a step (the same 128-byte rows, k 32 an instruction).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
template <typename T, bool F8>
__device__ __forceinline__ void step_products(float (&acc)[kPix / 2], unsigned a_tile,
                                              unsigned b_rows) {
    fence_acc(acc);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kRow / 32; ks++) {
        const uint64_t da = smem_desc(a_tile + 32 * ks, 16, 1024, 1),
                       db = smem_desc(b_rows + 32 * ks, 16, 1024, 1);
        if constexpr (F8)
            wgmma_e4m3_ss_64x256x32(acc, da, db);
        else
            wgmma_f16_ss<T, kPix>(acc, da, db);
    }
    wgmma_commit();
}
#endif

// The halo form's dynamic shared memory: S stages of NC weight tiles, the halo (hr rows of 128
// bytes), the stage barriers and the halo's two.
constexpr size_t halo_smem_bytes(int nc, int s, int hr) {
    return 1024 + (size_t)s * nc * kATile + (size_t)hr * kRow + 16 * s + 16;
}

// HALO: stride-1 layers with each output-channel block's gradient rows copied once as a halo
// (the tile's rows and the taps' reach, with the zero columns on both sides: bw = W + (k - 1) d
// pixels a row), the tile's pixels numbered over that padded width, and each tap's B operand
// the halo from row (k - 1 - i) d bw + (k - 1 - j) d on (a descriptor may start at any 128-byte
// row of the swizzled region). A stage then holds only the weight tiles.
// Q4: the 4-bit layer's epilogue (DgradHaloArgs.q4): the clip bits and residuals of the tile
// (q4_bits, q4_resid) are copied into the ring once the products are done; grad_x is NCHW.
// F8: the FP8 backward's e4m3 operands (DgradHaloArgs.fp8_inv), 128 output channels a K step.
template <typename T, int NC, int S, bool HALO, bool Q4, bool F8>
__global__ void __launch_bounds__(128 * NC + 32, NC == 1 && (S == 2 || HALO) ? 2 : 1)
    dgrad_tma(const __grid_constant__ CUtensorMap map_g, const __grid_constant__ CUtensorMap map_w,
              const uint32_t *__restrict__ mask, const uint32_t *__restrict__ signs,
              const uint8_t *__restrict__ q4_bits, const int8_t *__restrict__ q4_resid,
              const float *__restrict__ scales, const float *__restrict__ fp8_inv,
              bie_conv_geom g64, DgradTmaTiles tl, int op, int cp, T *__restrict__ grad_x,
              float *__restrict__ part_sum, float *__restrict__ part_dot) {
    static_assert(!(Q4 && F8), "the 4-bit layer has no FP8 backward");
    constexpr int kCh = F8 ? kRow : kRow / 2;  // output channels a K step (a 128-byte row)
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int kStage = HALO ? NC * kATile : stage_bytes(NC);
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ int qpix[kPix];  // the flat input pixel of each tile pixel, -1 past the tensor
    // Q4: each tile pixel's offset in NCHW grad_x at channel 0 (n C H W + y W + x).
    __shared__ int qoff[Q4 ? kPix : 1];
    // Each consumer's clip mask and sign words (its two 32-channel words) of the tile's pixels,
    // copied while the products run.
    __shared__ uint32_t words[NC][2][kPix][2];
    const unsigned base = (smem_u32(smem) + 1023) & ~1023u;
    unsigned char *gbase = smem + (base - smem_u32(smem));  // the same address, generic
    const unsigned hbase = base + (unsigned)(S * kStage);   // the halo (HALO)
    const unsigned full0 = hbase + (unsigned)(HALO ? tl.hr * kRow : 0), empty0 = full0 + 8 * S;
    const unsigned halo_full = empty0 + 8 * S, halo_empty = halo_full + 8;
    const int tid = threadIdx.x, wg = tid >> 7;
    const int C = (int)g64.c, H = (int)g64.h, W = (int)g64.w, N = (int)g64.n;
    const int k = (int)g64.k, kk = k * k, p = (int)g64.p, d = (int)g64.d;
    // The block's stride phase (ry, rx) and tile: pixels (S yy + ry, S xx + rx) of the phase's
    // rows yy0 .. of images n0 ..; xx runs over the whole phase row (bw pixels at most).
    const int ST = tl.st, ph = (int)blockIdx.x / tl.tpp, tile = (int)blockIdx.x - ph * tl.tpp;
    const int ry = ph / ST, rx = ph - ry * ST, hr = (H - ry + ST - 1) / ST,
              wr = (W - rx + ST - 1) / ST;
    const int n0 = tile / tl.tpi * tl.nimg, yy0 = (tile % tl.tpi) * tl.tr;
    // The taps that reach the phase: (ry + p - i d) and (rx + p - j d) multiples of the stride.
    auto reaches = [&](int t) {
        const int i = t / k, j = t - i * k;
        return (ry + p - i * d) % ST == 0 && (rx + p - j * d) % ST == 0;
    };
    int ntaps = 0;
    for (int t = 0; t < kk; t++) ntaps += reaches(t);
    const int steps = op / kCh * ntaps;
    if (tid == 0) {
        for (int s = 0; s < S; s++) {
            mbar_init(full0 + 8 * s, 1);    // the producer's arrival (and the copies' bytes)
            mbar_init(empty0 + 8 * s, NC);  // one arrival per consumer warpgroup
        }
        if (HALO) mbar_init(halo_full, 1), mbar_init(halo_empty, NC);
        mbar_init_fence();
    }
    for (int r = tid; r < kPix && HALO; r += blockDim.x) {  // over the padded width
        const int y = yy0 + r / tl.bw, x = r % tl.bw;
        qpix[r] = r < tl.tr * tl.bw && x < W && y < H && n0 < N ? (n0 * H + y) * W + x : -1;
        if (Q4) qoff[r] = qpix[r] >= 0 ? n0 * C * H * W + y * W + x : 0;
    }
    for (int r = tid; r < kPix && !HALO; r += blockDim.x) {
        const int per_img = tl.tr * tl.bw, n = n0 + r / per_img, rem = r % per_img;
        const int yy = yy0 + rem / tl.bw, xx = rem % tl.bw;
        qpix[r] = r < per_img * tl.nimg && yy < hr && xx < wr && n < N
                      ? (n * H + ST * yy + ry) * W + ST * xx + rx
                      : -1;
        if (Q4) qoff[r] = qpix[r] >= 0 ? n * C * H * W + (ST * yy + ry) * W + ST * xx + rx : 0;
    }
    __syncthreads();

    if (wg == NC) {  // the producer warp
        if (tid == 128 * NC) {
            tma_prefetch_map(&map_g);
            tma_prefetch_map(&map_w);
            if (HALO) {
                const int reach = (k - 1) * d;
                const unsigned hbytes = (unsigned)(kRow * tl.bw * (tl.tr + reach));
                for (int oc = 0, step = 0; oc < op / kCh; oc++) {
                    mbar_wait(halo_empty, ((unsigned)oc & 1u) ^ 1u);  // the last block's readers
                    mbar_arrive_expect_tx(halo_full, hbytes);
                    tma_load_4d(hbase, &map_g, oc * kRow, p - reach, yy0 + p - reach, n0,
                                halo_full);
                    for (int t = 0; t < kk; t++, step++) {
                        const int s = step % S;
                        mbar_wait(empty0 + 8 * s, ((unsigned)(step / S) & 1u) ^ 1u);
                        const unsigned full = full0 + 8 * s, dst = base + (unsigned)(s * kStage);
                        mbar_arrive_expect_tx(full, kStage);
                        for (int c = 0; c < NC; c++)
                            tma_load_2d(dst + c * kATile, &map_w, oc * kRow,
                                        t * cp + (int)blockIdx.y * 64 * NC + 64 * c, full);
                    }
                }
                return;
            }
            const unsigned bytes = (unsigned)(kRow * tl.bw * tl.tr * tl.nimg + NC * kATile);
            // Tap (i, j) maps phase pixel (yy, xx) to gradient pixel (yy + (ry + p - i d) / S,
            // xx + (rx + p - j d) / S): the tile's box, shifted.
            for (int step = 0, oc = 0, t = 0; step < steps; step++) {
                while (!reaches(t))
                    if (++t == kk) t = 0, oc++;
                const int s = step % S, i = t / k, j = t - i * k;
                mbar_wait(empty0 + 8 * s, ((unsigned)(step / S) & 1u) ^ 1u);  // readers done
                const unsigned full = full0 + 8 * s, dst = base + (unsigned)(s * kStage);
                mbar_arrive_expect_tx(full, bytes);
                tma_load_4d(dst, &map_g, oc * kRow, (rx + p - j * d) / ST,
                            yy0 + (ry + p - i * d) / ST, n0, full);
                for (int c = 0; c < NC; c++)
                    tma_load_2d(dst + kBTile + c * kATile, &map_w, oc * kRow,
                                t * cp + (int)blockIdx.y * 64 * NC + 64 * c, full);
                if (++t == kk) t = 0, oc++;
            }
        }
        return;
    }

    // A consumer: input channels c0 .. c0 + 63.
    const int wt = tid & 127, lane = tid & 31, wi = wt >> 5, gq = lane >> 2, tq = lane & 3;
    const int c0 = ((int)blockIdx.y * NC + wg) * 64, cw = (C + 31) / 32;
#pragma unroll
    for (int it = 0; it < 2 * kPix * 2 / 128 && !Q4; it++) {
        const int idx = wt + 128 * it, a = idx / (2 * kPix), r = (idx >> 1) % kPix, u = idx & 1;
        const int q = qpix[r], w = c0 / 32 + u;
        const bool ok = q >= 0 && w < cw;
        cp_async_n(smem_u32(&words[wg][a][r][u]),
                   (a ? signs : mask) + (ok ? (int64_t)q * cw + w : 0), 4, ok);
    }
    cp_async_commit();
    float acc[kPix / 2];
#pragma unroll
    for (int x = 0; x < kPix / 2; x++) acc[x] = 0.0f;
    for (int oc = 0, step = 0; HALO && oc < op / kCh; oc++) {
        mbar_wait(halo_full, (unsigned)oc & 1u);
        for (int t = 0; t < kk; t++, step++) {
            const int s = step % S, i = t / k, j = t - i * k;
            mbar_wait(full0 + 8 * s, (unsigned)(step / S) & 1u);
            const unsigned a_tile = base + (unsigned)(s * kStage + wg * kATile);
            const unsigned b_view =
                hbase + (unsigned)(((k - 1 - i) * d * tl.bw + (k - 1 - j) * d) * kRow);
            step_products<T, F8>(acc, a_tile, b_view);
            if (t > 0) {
                wgmma_wait<1>();
                fence_acc(acc);
                if (wt == 0) mbar_arrive(empty0 + 8 * ((step - 1) % S));
            }
        }
        // The block's last products done before the halo is given back.
        wgmma_wait<0>();
        fence_acc(acc);
        if (wt == 0) mbar_arrive(empty0 + 8 * ((step - 1) % S)), mbar_arrive(halo_empty);
    }
    for (int step = 0; !HALO && step < steps; step++) {
        const int s = step % S;
        mbar_wait(full0 + 8 * s, (unsigned)(step / S) & 1u);
        const unsigned stage = base + (unsigned)(s * kStage);
        const unsigned a_tile = stage + (unsigned)(kBTile + wg * kATile);
        step_products<T, F8>(acc, a_tile, stage);
        wgmma_wait<1>();
        fence_acc(acc);
        if (step > 0 && wt == 0) mbar_arrive(empty0 + 8 * ((step - 1) % S));
    }
    wgmma_wait<0>();
    fence_acc(acc);
    if constexpr (Q4) {
        // Every consumer past its last product: the ring becomes the staging area, first for
        // the tile's residuals ([kPix][64], rows of kRes bytes against bank conflicts) and clip
        // bits ([kPix][8] bytes) of channels c0 .. c0 + 63, zeros past the tensor.
        asm volatile("bar.sync 1, %0;\n" ::"r"(128 * NC) : "memory");
        constexpr int kRes = 80;
        unsigned char *stg = gbase + wg * kBTile, *bits = stg + kPix * kRes;
        for (int i = wt; i < kPix * 5; i += 128) {
            const int r = i / 5, u = i - 5 * r, q = qpix[r];
            const bool ok = q >= 0;
            if (u < 4)
                cp_async_n(smem_u32(stg + r * kRes + 16 * u),
                           q4_resid + (ok ? (int64_t)q * cp + c0 + 16 * u : 0), 16, ok);
            else
                cp_async_n(smem_u32(bits + 8 * r),
                           q4_bits + (ok ? (int64_t)q * (cp / 8) + c0 / 8 : 0), 8, ok);
        }
        cp_async_commit();
        cp_async_wait<0>();
        asm volatile("bar.sync %0, 128;\n" ::"r"(2 + wg) : "memory");
        // Rows (channels) c0 + 16 wi + g + 8 h, columns (tile pixels) 8 nj + 2 tq + e: grad_x
        // = the products times scale_w where the clip bit is set, kept in acc.
        const float sw = scales[1];
        float csum[2] = {0.0f, 0.0f}, cdot[2] = {0.0f, 0.0f};
        for_each_pixel(acc, tq, [&](int r, float &a0, float &a1) {
            auto one = [&](int h, float &a) {
                const int cl = 16 * wi + gq + 8 * h;
                const float v = (bits[8 * r + (cl >> 3)] >> (cl & 7)) & 1 ? a * sw : 0.0f;
                csum[h] += v;
                cdot[h] += v * (float)(int8_t)stg[r * kRes + cl];
                a = v;
            };
            one(0, a0);
            one(1, a1);
        });
        tile_sums(csum, cdot, c0 + 16 * wi + gq, C, tq, part_sum, part_dot);
        // Then for grad_x as [64 channels][kPix] (16-byte chunks swizzled by channel), each
        // thread's neighbouring pixels as one word.
        if (grad_x == nullptr) return;
        asm volatile("bar.sync %0, 128;\n" ::"r"(2 + wg) : "memory");  // the bits read
        uint32_t *cols = reinterpret_cast<uint32_t *>(stg);            // pixel pairs
        auto pair_at = [](int cl, int r) {                             // r even
            return cl * (kPix / 2) + (((r >> 3) ^ (cl & 7)) << 2) + ((r & 7) >> 1);
        };
#pragma unroll
        for (int nj = 0; nj < kPix / 8; nj++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const T lo = from_f32<T>(acc[4 * nj + 2 * h]),
                        hi = from_f32<T>(acc[4 * nj + 2 * h + 1]);
                cols[pair_at(16 * wi + gq + 8 * h, nj * 8 + 2 * tq)] =
                    (uint32_t)bits_of(lo) | (uint32_t)bits_of(hi) << 16;
            }
        asm volatile("bar.sync %0, 128;\n" ::"r"(2 + wg) : "memory");  // its staging written
        // Thread wt writes tile pixels 2 wt and 2 wt + 1 of each channel: one word where they
        // are neighbours in grad_x and the word is aligned, else each on its own.
        const int64_t plane = (int64_t)H * W;
        const int r = 2 * wt, q0 = qpix[r], q1 = qpix[r + 1];
        const bool pair = q0 >= 0 && q1 >= 0 && qoff[r + 1] == qoff[r] + 1;
        T *d0 = grad_x + qoff[r] + c0 * plane, *d1 = grad_x + qoff[r + 1] + c0 * plane;
        for (int cl = 0; cl < 64 && c0 + cl < C; cl++, d0 += plane, d1 += plane) {
            const uint32_t v = cols[pair_at(cl, r)];
            if (pair && reinterpret_cast<uintptr_t>(d0) % 4 == 0) {
                *reinterpret_cast<uint32_t *>(d0) = v;
            } else {
                if (q0 >= 0) *d0 = of_bits<T>((uint16_t)v);
                if (q1 >= 0) *d1 = of_bits<T>((uint16_t)(v >> 16));
            }
        }
        return;
    }
    cp_async_wait<0>();
    // Every consumer past its last product: the ring becomes the staging area.
    asm volatile("bar.sync 1, %0;\n" ::"r"(128 * NC) : "memory");

    // Rows (channels) c0 + 16 wi + g + 8 h, columns (tile pixels) 8 nj + 2 tq + e.
    const float sw = F8 ? scales[1] * fp8_inv[0] : scales[1];
    unsigned char *stg = gbase + wg * kBTile;  // [kPix rows of 128 bytes], 16-byte chunks swizzled
    float csum[2] = {0.0f, 0.0f}, cdot[2] = {0.0f, 0.0f};
    for_each_pixel(acc, tq, [&](int r, float a0, float a1) {
        const uint32_t mw = words[wg][0][r][wi >> 1], sg = words[wg][1][r][wi >> 1];
        auto one = [&](int h, float a) {
            const int cl = 16 * wi + gq + 8 * h, b = cl & 31;
            const float v = (mw >> b) & 1 ? a * sw : 0.0f;
            csum[h] += v;
            cdot[h] += (sg >> b) & 1 ? v : -v;
            *reinterpret_cast<T *>(stg + r * kRow + ((((cl >> 3) ^ (r & 7))) << 4) + (cl & 7) * 2) =
                from_f32<T>(v);
        };
        one(0, a0);
        one(1, a1);
    });
    tile_sums(csum, cdot, c0 + 16 * wi + gq, C, tq, part_sum, part_dot);
    asm volatile("bar.sync %0, 128;\n" ::"r"(2 + wg) : "memory");  // its staging written
    const bool vec = C % 8 == 0 && reinterpret_cast<uintptr_t>(grad_x) % 16 == 0;
#pragma unroll 4
    for (int it = 0; it < kPix * 8 / 128; it++) {
        const int idx = wt + 128 * it, r = idx >> 3, ch = idx & 7, q = qpix[r], c = c0 + ch * 8;
        if (q < 0 || c >= C) continue;
        const uint4 v = *reinterpret_cast<const uint4 *>(stg + r * kRow + ((ch ^ (r & 7)) << 4));
        T *dst = grad_x + (int64_t)q * C + c;
        if (vec) {
            *reinterpret_cast<uint4 *>(dst) = v;
        } else {
            const T *e = reinterpret_cast<const T *>(&v);
            for (int u = 0; u < 8 && c + u < C; u++) dst[u] = e[u];
        }
    }
#else
    (void)map_g, (void)map_w, (void)mask, (void)signs, (void)q4_bits, (void)q4_resid, (void)scales,
        (void)fp8_inv, (void)g64, (void)tl, (void)op, (void)cp, (void)grad_x, (void)part_sum,
        (void)part_dot;
#endif
}

template <typename T, int NC, int S, bool HALO, bool Q4, bool F8>
bie_status launch(const DgradHaloArgs &a, const DgradTmaTiles &tl) {
    static const char *who = "conv grad_x (wgmma, TMA)";
    const bie_conv_geom &g = a.g;
    const int box_rows = HALO ? tl.tr + (int)((g.k - 1) * g.d) : tl.tr;
    const int64_t ld = (int64_t)a.op * (F8 ? 1 : 2);  // bytes of an operand row
    CUtensorMap map_g, map_w;
    if (!tma_map_nhwc(&map_g, a.gt, g.n, g.oh, g.ow, ld, tl.bw, box_rows, tl.nimg) ||
        !tma_map_rows(&map_w, a.wt, g.k * g.k * a.cp, ld, 64))
        return bie_fail(BIE_ERR_UNSUPPORTED, "%s: the driver cannot describe the operands", who);
    const auto fn = dgrad_tma<T, NC, S, HALO, Q4, F8>;
    const size_t smem = HALO ? halo_smem_bytes(NC, S, tl.hr) : smem_bytes(NC, S);
    BIE_CUDA_TRY(check(cudaFuncSetAttribute(reinterpret_cast<const void *>(fn),
                                            cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem),
                       who));
    fn<<<dim3((unsigned)tl.tiles, (unsigned)(a.cp / (64 * NC))), 128 * NC + 32, smem,
         current_stream>>>(map_g, map_w, a.mask, a.signs, a.q4_bits, a.q4_resid, a.scales,
                           a.fp8_inv, g, tl, a.op, a.cp, static_cast<T *>(a.grad_x), a.part_sum,
                           a.part_dot);
    return check(cudaGetLastError(), who);
}

template <typename T, bool Q4, bool F8 = false>
bie_status launch_typed(const DgradHaloArgs &a, const DgradTmaTiles &tl) {
    // 64 channels: two blocks of two stages per SM (one block of four took 27 % longer, H100).
    if (tl.halo)
        return a.cp % 128 == 0 ? launch<T, 2, 4, true, Q4, F8>(a, tl)
                               : launch<T, 1, 4, true, Q4, F8>(a, tl);
    return a.cp % 128 == 0 ? launch<T, 2, 4, false, Q4, F8>(a, tl)
                           : launch<T, 1, 2, false, Q4, F8>(a, tl);
}

}  // namespace

bool dgrad_tma_tiles(const bie_conv_geom &g, DgradTmaTiles *tl) {
    if (!bgemm_tma_usable() || !g.nhwc || g.s > kDgradMaxStride || g.n * g.h * g.w > INT32_MAX ||
        g.n * g.oh * g.ow > INT32_MAX)
        return false;
    // Each phase's pixels as an image of hm x wm at most.
    const int st = (int)g.s, hm = (int)((g.h + st - 1) / st), wm = (int)((g.w + st - 1) / st);
    if (wm > kPix) return false;
    tl->st = st, tl->bw = wm, tl->halo = 0, tl->hr = 0;
    const int rows = kPix / wm;
    int64_t per_phase;
    if (rows >= hm) {  // whole images
        tl->tr = hm, tl->tpi = 1;
        tl->nimg = (int)std::min<int64_t>(kPix / (hm * wm), g.n);
        per_phase = (g.n + tl->nimg - 1) / tl->nimg;
    } else {  // bands of rows, as even as they can be
        tl->tpi = (hm + rows - 1) / rows, tl->tr = (hm + tl->tpi - 1) / tl->tpi, tl->nimg = 1;
        per_phase = g.n * tl->tpi;
    }
    tl->tiles = per_phase * st * st;
    tl->tpp = (int)per_phase;
    // Stride 1: the halo form where its tiles (rows padded by the kernel's reach) hold at least
    // 7/8 of the pixels of these (32-pixel rows: 224 of 256 pixels against 256; 16-pixel rows
    // would hold 128), unless BIE_CUDA_DGRAD_HALO=0.
    static const bool halo_wanted = !env_is("BIE_CUDA_DGRAD_HALO", "0");
    const int reach = (int)((g.k - 1) * g.d), wp = (int)g.w + reach;
    if (halo_wanted && st == 1 && wp <= kPix && kPix / wp + reach <= 256) {
        const int hrows = kPix / wp, tpi = (int)((g.h + hrows - 1) / hrows);
        const int tr = (int)((g.h + tpi - 1) / tpi);
        if ((int64_t)tr * g.w * 8 >= (int64_t)tl->tr * wm * tl->nimg * 7) {
            // The halo's rows: the box, and what the last tap's view reads past it.
            const int need = std::max((tr + reach) * wp, reach * wp + reach + kPix);
            // (At most 128 KB of halo: wide, far-reaching kernels keep the per-tap form.)
            if (need <= kHaloMaxRows) {
                tl->halo = 1, tl->bw = wp, tl->nimg = 1, tl->tpi = tpi, tl->tr = tr;
                tl->hr = (need + 7) / 8 * 8;
                tl->tiles = g.n * tpi, tl->tpp = (int)tl->tiles;
            }
        }
    }
    return tl->tiles <= INT32_MAX;
}

bie_status dgrad_tma_launch(const DgradHaloArgs &a, const DgradTmaTiles &tl) {
    if (a.fp8_inv) {
        if (a.q4 || a.op % 128 != 0)
            return bie_fail(BIE_ERR_INVALID_ARGUMENT,
                            "conv grad_x (TMA, FP8): 128-channel steps, binary layers only");
        return a.half ? launch_typed<__half, false, true>(a, tl)
                      : launch_typed<__nv_bfloat16, false, true>(a, tl);
    }
    if (a.q4)
        return a.half ? launch_typed<__half, true>(a, tl)
                      : launch_typed<__nv_bfloat16, true>(a, tl);
    return a.half ? launch_typed<__half, false>(a, tl) : launch_typed<__nv_bfloat16, false>(a, tl);
}

}  // namespace bie_cuda
