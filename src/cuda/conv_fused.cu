// Binary conv2d inference forward in one kernel: the input's pack and the implicit GEMM
// fused, for channel counts whose sign words come in whole 16-byte chunks (C > 96 and
// ceil(C / 32) % 4 == 0). The two-kernel path (conv.cu) covers every other case and the
// training forward (which keeps the sign and mask words for the backward).
//
// Block = (band of bp consecutive output pixels of the batch, in (image, row, column) order,
// BN output channels). A band may start mid-row and run on into the next image(s): for each
// image it touches (a segment) the block packs the receptive field of the segment's output
// rows, (rows - 1) s + (k - 1) d + 1 rows of NCHW input with the padding as zero words,
// into shared memory as one sign-word row per pixel, the segments' fields stacked. So the
// implicit GEMM's A operand is read by ldmatrix straight from the packed pixels: lane
// addresses are pixel + tap offset, no gather and no im2col, and the tile rows carry no
// padding but the last band's. Taps outside the input read zero words, exactly as the
// two-kernel path's zero-filled gathers, and the same padding-class correction and AND-form
// epilogue follow, so the results are bit for bit the same.
//
// This file: the plan (plan_fused, remembered per thread by fused_plan), the weight image
// (build_wimg) and the entry points; the kernel is in conv_fused_kernel.cu, the layouts both
// use in conv_fused.cuh.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#include "conv_fused.cuh"
#include "cuda_common.cuh"
#include "cuda_internal.h"
#include "epilogue.cuh"

namespace bie_cuda {
namespace fused {
namespace {

// The band starting at batch pixel px0: its field rows and the input rows it loads (sums
// over its segments).
struct BandRows {
    int64_t field, input;
};
BandRows band_rows(const bie_conv_geom *g, int64_t px0, int64_t bp) {
    const int64_t plane = g->oh * g->ow, end = std::min(px0 + bp, g->n * plane),
                  kd = (g->k - 1) * g->d + 1;
    BandRows r = {0, 0};
    for (int64_t a = px0; a < end;) {
        const int64_t base = a / plane * plane, e = std::min(end, base + plane);
        const SegRows<int64_t> sr = seg_rows(a - base, e - base, g->ow, g->s, g->p, kd, g->h);
        r.field += sr.field;
        r.input += std::max<int64_t>(0, sr.iy1 - sr.iy0);
        a = e;
    }
    return r;
}

// For the tests: a forced plan (bn, bp; 0: the planner's) and the plan of the last call
// (0, 0 when it did not take the fused kernel).
std::atomic<int> g_force_bn{0}, g_force_bp{0}, g_last_bn{0}, g_last_bp{0};

// The plan for this call, or false when the fused kernel does not apply (then the
// two-kernel path runs). Candidates: 64-, 128- or 256-channel blocks, bands of a multiple of
// 32 pixels (no idle tile rows) or of whole output rows (smaller fields), up to 2048
// pixels, that fit in shared memory. The pick: the smallest estimated time, waves of blocks
// times a block's work in warp instructions (the pack about 2 per 32 input elements, over
// the input rows of the first bands; a 32 x 32 warp tile's k step 14; the epilogue about 4
// per 32 outputs), with 16-warp blocks (256 channels) counted 1.75 times as fast as 8-warp
// ones. Two 8-warp blocks share an SM where shared memory allows. The picks at the
// benchmark's shapes (N = 64) were checked against the other plans on the H100; the sweep is
// in BENCHMARKS.md. Bands of 96 pixels at 14x14 touch 10 input rows (140 pixels), one more
// pack round than 98-pixel ones, which ate the 25 % fewer tile rows with 128-channel blocks.
bool plan_fused(const bie_conv_geom *g, int classes, int esize, int dev, int force_bn, int force_bp,
                FusedPlan *out) {
    const int64_t cw = bie_cuda_conv_cw(g), ldr = (g->k * g->k * cw * 4 + 31) / 32 * 32;
    const int64_t plane = g->oh * g->ow, np = g->n * plane, kd = (g->k - 1) * g->d + 1;
    if (cw % 4 != 0 || ldr > 16384 || g->c * g->h * g->w >= INT32_MAX || 256 * plane >= INT32_MAX ||
        np >= INT32_MAX - 4096 || (int64_t)classes * g->o >= INT32_MAX)
        return false;
    int max_smem = 0, sm_smem = 0, sms = 1;
    if (cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) !=
            cudaSuccess ||
        cudaDeviceGetAttribute(&sm_smem, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev) !=
            cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
        cudaGetLastError();
        return false;
    }
    const int64_t units4 = cw / 4, pstride = 16 * (units4 % 2 == 0 ? units4 + 1 : units4);
    // Field columns; at stride 1 padded to ow (mod 8), so that any 8 consecutive band pixels
    // of a row (an ldmatrix's rows) sit in distinct 16-byte bank groups.
    const int64_t wp0 = (g->ow - 1) * g->s + kd;
    const int64_t wp = g->s == 1 ? wp0 + ((g->ow - wp0) % 8 + 8) % 8 : wp0;
    double best = 0;
    bool found = false;
    for (int64_t cand = 0;; cand++) {
        // Candidates 0, 1, ..: 32, 64, .. pixels, then 1, 2, .. output rows.
        const int64_t bp = cand < 64 ? 32 * (cand + 1) : (cand - 63) * g->ow;
        if (cand >= 64 && (bp > 2048 || cand - 63 > g->oh)) break;
        if (force_bp ? bp != force_bp || (cand >= 64 && bp % 32 == 0) : bp > np + 31) continue;
        const int64_t bands = (np + bp - 1) / bp,
                      segs = std::min<int64_t>(g->n, (bp - 1) / plane + 2);
        // Field rows of a band, at most. Bands repeat their layout every plane / gcd(bp,
        // plane) bands; where that is few, the most over one period, else a bound: a segment
        // of L pixels spans hi - lo <= (L + ow - 2) / ow output rows past its first, and at
        // most oh - 1. Input rows: the mean over the first bands.
        int64_t gcd = plane, rest = bp;
        while (rest != 0) {
            const int64_t r = gcd % rest;
            gcd = rest;
            rest = r;
        }
        const int64_t period = plane / gcd;
        int64_t field = 0, sample = std::min<int64_t>(bands, 16);
        double in_rows = 0;
        for (int64_t b = 0; b < std::max(sample, period <= 512 ? std::min(bands, period) : 0);
             b++) {
            const BandRows r = band_rows(g, b * bp, bp);
            field = std::max(field, r.field);
            if (b < sample) in_rows += (double)r.input / (double)sample;
        }
        if (period > 512)
            field =
                std::min<int64_t>((bp + segs * (g->ow - 2)) / g->ow, segs * (g->oh - 1)) * g->s +
                segs * kd;
        for (int bn = 64; bn <= 256; bn *= 2) {
            if (force_bn ? bn != force_bn : bn > 64 && g->o <= bn / 2)
                continue;  // a narrower tile covers O
            FusedPlan p;
            p.bn = bn;
            p.warps = bn == 256 ? 16 : 8;
            p.bp = (int)bp;
            p.bands = (int)bands;
            p.segs = (int)segs;
            p.pr = (int)field;
            p.wp = (int)wp;
            p.pstride = (int)pstride;
            p.rows = (int)((bp + 31) / 32 * 32);
            p.ldr = (int)ldr;
            p.classes = classes;
            p.esize = esize;
            const size_t smem = FusedSmem(p, (int)g->oh, (int)g->ow).total;
            if (smem > (size_t)max_smem || field * wp > (1 << 20) ||
                segs * g->o * plane >= INT32_MAX)
                continue;
            const int64_t per_sm = p.warps == 8 && smem * 2 + 2048 <= (size_t)sm_smem ? 2 : 1;
            const int64_t blocks = bands * ((g->o + bn - 1) / bn);
            const double work = (2.0 / 32 * in_rows * (double)(g->w * g->c) +
                                 14.0 * (double)(p.rows / 32) * (bn / 32) * (ldr / 32) +
                                 4.0 / 32 * (double)(bp * bn)) /
                                (p.warps == 16 ? 1.75 : 1.0);
            const double t = (double)((blocks + sms * per_sm - 1) / (sms * per_sm)) * work;
            if (!found || t < best) {
                best = t;
                *out = p;
                found = true;
            }
        }
    }
    return found;
}

// plan_fused, remembered per thread for the last few layer shapes (the search walks about
// two hundred candidates).
bool fused_plan(const bie_conv_geom *g, int classes, int esize, FusedPlan *out) {
    struct Key {
        bie_conv_geom g;
        int classes, esize, dev, force_bn, force_bp;
    };
    struct Entry {
        Key key;
        bool found;
        FusedPlan plan;
    };
    constexpr int kEntries = 8;
    thread_local Entry cache[kEntries];
    thread_local int used = 0, next = 0;
    Key key;
    memset(&key, 0, sizeof key);  // padding too: keys compare as bytes
    if (cudaGetDevice(&key.dev) != cudaSuccess) {
        cudaGetLastError();
        return false;
    }
    key.g = *g;
    key.classes = classes;
    key.esize = esize;
    key.force_bn = g_force_bn;
    key.force_bp = g_force_bp;
    for (int i = 0; i < used; i++)
        if (memcmp(&cache[i].key, &key, sizeof key) == 0) {
            *out = cache[i].plan;
            return cache[i].found;
        }
    Entry &e = cache[next];
    e.key = key;
    e.found = plan_fused(g, classes, esize, key.dev, key.force_bn, key.force_bp, &e.plan);
    next = (next + 1) % kEntries;
    used = used < kEntries ? used + 1 : used;
    *out = e.plan;
    return e.found;
}

// The image of channel block blockIdx.x (see image_block_bytes) from the packed weight rows
// (ld bytes apart), their popcount parts and the corrections (null: none).
__global__ void build_wimg(const uint8_t *__restrict__ wbits, int64_t ld,
                           const int *__restrict__ wpopc, int parts, const int *__restrict__ corr,
                           FusedPlan p, int O, uint8_t *__restrict__ img) {
    const int n0 = (int)blockIdx.x * p.bn, chunks = p.ldr / 16 + 1, cs = corr_stride(p.bn);
    uint8_t *dst = img + (size_t)blockIdx.x * image_block_bytes(p);
    for (int i = (int)threadIdx.x; i < p.bn * chunks; i += (int)blockDim.x) {
        const int r = i / chunks, c = i - r * chunks;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (n0 + r < O && c < chunks - 1)
            v = *reinterpret_cast<const uint4 *>(wbits + (int64_t)(n0 + r) * ld + c * 16);
        reinterpret_cast<uint4 *>(dst)[i] = v;
    }
    int *terms = reinterpret_cast<int *>(dst + image_terms(p));
    for (int i = (int)threadIdx.x; i < p.classes * cs; i += (int)blockDim.x) {
        const int cls = i / cs, col = i - cls * cs, n = n0 + col;
        int v = 0;
        if (col < p.bn && n < O) {
            for (int part = 0; part < parts; part++) v -= 2 * wpopc[(int64_t)n * parts + part];
            if (corr) v += corr[(int64_t)cls * O + n];
        }
        terms[i] = v + kTermBias;
    }
}

}  // namespace
}  // namespace fused
}  // namespace bie_cuda

using namespace bie_cuda;
using namespace bie_cuda::fused;

extern "C" bie_status bie_cuda_conv_fused(bie_dtype dtype, const void *x, const bie_conv_geom *g,
                                          const float *bias, const uint8_t *wbits, int64_t ld,
                                          const int *wpopc, int classes, const float *scale_a,
                                          const float *scale_w, void *out,
                                          const bie_cuda_conv_out *conv, bie_cuda_fused_image *img,
                                          bool *ran) {
    *ran = false;
    g_last_bn = 0;
    g_last_bp = 0;
    const int which = out_type_of(dtype);
    FusedPlan p;
    if (which < 0 || !fused_plan(g, classes, (int)bie_dtype_size(dtype), &p)) return BIE_OK;
    const Epilogue ep = make_epilogue(which, out, g->o, 0.0f, scale_a, scale_w, conv);
    // The weight image of the plan's channel blocks, rebuilt after a change of the weight or
    // the geometry (the caller clears img->valid) or of the block width. The first launch
    // after a rebuild does not overlap the build (the kernel reads the image before
    // pdl_wait).
    const bool fresh = !img->valid || img->bn != p.bn;
    if (fresh) {
        const int blocks = (int)((g->o + p.bn - 1) / p.bn);
        const size_t bytes = image_block_bytes(p) * (size_t)blocks;
        img->valid = false;
        if (bytes > img->cap) {
            if (img->data)
                BIE_CUDA_TRY(check(cudaFree(img->data), "cuda fused conv: weight image"));
            img->data = nullptr;
            img->cap = 0;
            BIE_CUDA_TRY(check(cudaMalloc(&img->data, bytes), "cuda fused conv: weight image"));
            img->cap = bytes;
        }
        build_wimg<<<blocks, 256, 0, current_stream>>>(wbits, ld, wpopc, bie_cuda_popc_parts(ld),
                                                       conv->corr, p, (int)g->o,
                                                       static_cast<uint8_t *>(img->data));
        BIE_CUDA_TRY(check(cudaGetLastError(), "cuda fused conv: weight image"));
        img->bn = p.bn;
        img->valid = true;
    }
    const uint8_t *wimg = static_cast<const uint8_t *>(img->data);
    const bool overlap = !fresh;
    BIE_CUDA_TRY(
        check(launch_bconv_fused(dtype, x, bias, wimg, overlap, g, p, ep), "cuda fused conv"));
    *ran = true;
    g_last_bn = p.bn;
    g_last_bp = p.bp;
    return check(cudaGetLastError(), "cuda fused conv");
}

extern "C" void bie_cuda_conv_fused_force_plan(int bn, int bp) {
    g_force_bn = bn;
    g_force_bp = bp;
}

extern "C" void bie_cuda_conv_fused_last_plan(int *bn, int *bp) {
    *bn = g_last_bn;
    *bp = g_last_bp;
}
