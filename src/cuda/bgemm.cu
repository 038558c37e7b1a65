// Binary GEMM on tensor cores: mma.m16n8k256 b1 with AND-popc (SPEC §1.1 AND form):
//   dot = k - 2 popc(a) - 2 popc(b) + 4 popc(a AND b)
// Operands are rows in the device GEMM layout (cuda_internal.h): zero-padded to whole
// 2048-bit blocks, with their popcounts, so the main loops need no tail handling.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "bie_cuda.h"
#include "cuda_common.cuh"
#include "cuda_internal.h"
#include "epilogue.cuh"
#include "mma.cuh"
#include "pdl.cuh"
#include "wgmma_entry.cuh"

namespace bie_cuda {

// BM x BN output tile per block, WARPS_M x WARPS_N warps, each owning a (BM / WARPS_M) x
// (BN / WARPS_N) sub-tile of 16x8 mma tiles; a STAGES-deep cp.async pipeline over k blocks
// of BKB bytes. Shared rows are BKB + 16 bytes: the 8 rows an ldmatrix reads then fall in
// distinct banks.
template <int BM, int BN, int WARPS_M, int WARPS_N, int BKB, int STAGES, int MINB = 1>
__global__ void __launch_bounds__(32 * WARPS_M * WARPS_N, MINB)
    bgemm_b1(int m, int n, int64_t k, const uint8_t *__restrict__ A, const uint8_t *__restrict__ B,
             int64_t ld, const int *__restrict__ pa, const int *__restrict__ pb, int parts_a,
             int parts_b, Epilogue ep) {
    constexpr int THREADS = 32 * WARPS_M * WARPS_N;
    constexpr int kSmemRow = BKB + 16, kStages = STAGES, CHUNKS = BKB / 16;
    const int kblocks = (int)(ld / BKB);
    constexpr int WTM = BM / WARPS_M, WTN = BN / WARPS_N;
    constexpr int MT = WTM / 16, NT = WTN / 8;
    static_assert(NT % 2 == 0, "B fragments are loaded two n8 tiles at a time");
    extern __shared__ __align__(16) uint8_t smem[];
    uint8_t *sA = smem;
    uint8_t *sB = smem + kStages * BM * kSmemRow;
    pdl_wait();  // A, B and their popcounts may come from the kernel just before (pdl.cuh)

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp / WARPS_N, wn = warp % WARPS_N;
    const int bm0 = blockIdx.y * BM, bn0 = blockIdx.x * BN;

    auto load_stage = [&](int stage, int kb) {
        for (int idx = tid; idx < BM * CHUNKS; idx += THREADS) {
            int r = idx / CHUNKS, c = idx % CHUNKS, row = bm0 + r;
            bool ok = row < m;
            cp_async16(smem_u32(sA + (stage * BM + r) * kSmemRow + c * 16),
                       A + (int64_t)(ok ? row : 0) * ld + (int64_t)kb * BKB + c * 16, ok);
        }
        for (int idx = tid; idx < BN * CHUNKS; idx += THREADS) {
            int r = idx / CHUNKS, c = idx % CHUNKS, row = bn0 + r;
            bool ok = row < n;
            cp_async16(smem_u32(sB + (stage * BN + r) * kSmemRow + c * 16),
                       B + (int64_t)(ok ? row : 0) * ld + (int64_t)kb * BKB + c * 16, ok);
        }
    };

    int acc[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0;

#pragma unroll
    for (int s = 0; s < kStages - 1; s++) {
        if (s < kblocks) load_stage(s, s);
        cp_async_commit();
    }
    const int q = lane >> 3, r8 = lane & 7;
    for (int kb = 0; kb < kblocks; kb++) {
        cp_async_wait<kStages - 2>();
        __syncthreads();
        int next = kb + kStages - 1;
        if (next < kblocks) load_stage(next % kStages, next);
        cp_async_commit();
        const uint8_t *a_s = sA + (kb % kStages) * BM * kSmemRow;
        const uint8_t *b_s = sB + (kb % kStages) * BN * kSmemRow;
#pragma unroll
        for (int kc = 0; kc < BKB / 32; kc++) {  // 256-bit mma steps of this stage
            // A fragments for the whole warp tile; B two n8 tiles at a time, used at once,
            // so that a 64x64 warp tile (128 accumulators) stays within the register file.
            unsigned af[MT][4];
#pragma unroll
            for (int i = 0; i < MT; i++) {
                int row = wm * WTM + i * 16 + r8 + 8 * (q & 1);
                ldmatrix_x4(af[i], smem_u32(a_s + row * kSmemRow + kc * 32 + 16 * (q >> 1)));
            }
#pragma unroll
            for (int j = 0; j < NT; j += 2) {
                int row = wn * WTN + j * 8 + r8 + 8 * (q >> 1);
                unsigned t[4];
                ldmatrix_x4(t, smem_u32(b_s + row * kSmemRow + kc * 32 + 16 * (q & 1)));
#pragma unroll
                for (int i = 0; i < MT; i++) {
                    mma_b1_and(acc[i][j], af[i], t[0], t[1]);
                    mma_b1_and(acc[i][j + 1], af[i], t[2], t[3]);
                }
            }
        }
    }
    cp_async_wait<0>();

    // Epilogue. The row and column popcounts are read once, before any store: the compiler
    // cannot prove that the output does not alias them, and would reload them per element.
    const float scale = ep.scale();
    const int g = lane >> 2, t4 = lane & 3;
    int prow[MT][2], pcol[NT][2];
    OutRow orow[MT][2];
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int row = bm0 + wm * WTM + i * 16 + g + 8 * h;
            prow[i][h] = row < m ? row_popc(pa, row, parts_a) : 0;
            orow[i][h] = ep.row(row < m ? row : 0);
        }
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int col = bn0 + wn * WTN + j * 8 + 2 * t4 + h;
            pcol[j][h] = col < n ? row_popc(pb, col, parts_b) : 0;
        }
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int row = bm0 + wm * WTM + i * 16 + g + 8 * (e >> 1);
                int col = bn0 + wn * WTN + j * 8 + 2 * t4 + (e & 1);
                if (row < m && col < n)
                    store_dot(ep, orow[i][e >> 1], col, k, prow[i][e >> 1], pcol[j][e & 1],
                              acc[i][j][e], scale);
            }
}

// Weight streaming for small m (the inference shape M = 1..16): each warp owns one n8 tile
// and streams its 8 weight rows over all of k, one 16-byte vector per lane per 512 bits,
// against (up to) 16 activation rows held in shared memory. Inside each 512-bit chunk the
// lane with t = lane % 4 feeds words 4t + 2s (as fragment word t) and 4t + 2s + 1 (as word
// t + 4) to mma step s, for A and B alike: the dot product is unchanged by that permutation
// of k, and every load is a single vector.
template <int WARPS>
__global__ void __launch_bounds__(32 * WARPS)
    bgemv_b1(int m, int n, int64_t k, const uint8_t *__restrict__ A, const uint8_t *__restrict__ B,
             int64_t ld, const int *__restrict__ pa, const int *__restrict__ pb, int parts_a,
             int parts_b, Epilogue ep) {
    extern __shared__ uint4 sA[];  // 16 rows of ld + 16 bytes (the pad spreads rows over banks)
    pdl_wait();  // A, B and their popcounts may come from the kernel just before (pdl.cuh)
    const int chunks = (int)(ld / 16), srow = chunks + 1;  // ld <= 227 KB / 16 here
    const int m0 = blockIdx.y * 16, rows = min(16, m - m0);
    for (int r = 0; r < 16; r++) {
        const uint4 *src = reinterpret_cast<const uint4 *>(A + (int64_t)(m0 + r) * ld);
        for (int c = threadIdx.x; c < chunks; c += blockDim.x)
            sA[r * srow + c] = r < rows ? src[c] : make_uint4(0, 0, 0, 0);
    }
    __syncthreads();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n0 = (blockIdx.x * WARPS + warp) * 8;
    if (n0 >= n) return;
    const int g = lane >> 2, t = lane & 3;
    const uint4 *bp = reinterpret_cast<const uint4 *>(B + (int64_t)min(n0 + g, n - 1) * ld) + t;
    const uint4 *a_lo = sA + g * srow + t, *a_hi = sA + (g + 8) * srow + t;
    const int steps = chunks / 4;
    int acc[4] = {0, 0, 0, 0};
    constexpr int U = 16;  // k = 8192: every weight load of the warp in flight at once
    auto consume = [&](uint4 b, int s) {
        uint4 lo = a_lo[s * 4], hi = a_hi[s * 4];
        unsigned f0[4] = {lo.x, hi.x, lo.y, hi.y}, f1[4] = {lo.z, hi.z, lo.w, hi.w};
        mma_b1_and(acc, f0, b.x, b.y);
        mma_b1_and(acc, f1, b.z, b.w);
    };
    int s = 0;
    for (; s + U <= steps; s += U) {
        uint4 b[U];
#pragma unroll
        for (int u = 0; u < U; u++) b[u] = __ldg(bp + (s + u) * 4);
#pragma unroll
        for (int u = 0; u < U; u++) consume(b[u], s + u);
    }
    for (; s < steps; s++) consume(__ldg(bp + s * 4), s);
    const float scale = ep.scale();
    int prow[2], pcol[2];
    OutRow orow[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int row = m0 + g + 8 * h;
        prow[h] = row < m ? row_popc(pa, row, parts_a) : 0;
        orow[h] = ep.row(row < m ? row : 0);
        pcol[h] = n0 + 2 * t + h < n ? row_popc(pb, n0 + 2 * t + h, parts_b) : 0;
    }
#pragma unroll
    for (int e = 0; e < 4; e++) {
        int row = m0 + g + 8 * (e >> 1), col = n0 + 2 * t + (e & 1);
        if (row < m && col < n)
            store_dot(ep, orow[e >> 1], col, k, prow[e >> 1], pcol[e & 1], acc[e], scale);
    }
}
constexpr int kGemvWarps = 4;

typedef void (*KernelFn)(int, int, int64_t, const uint8_t *, const uint8_t *, int64_t, const int *,
                         const int *, int, int, Epilogue);

struct CudaKernel {
    int id;
    const char *name;
    int bm, bn, bkb, stages;  // bm == 0: the weight-streaming kernel
    KernelFn fn;              // NULL: a wgmma kernel (120: bgemm_wgmma.cu, 121: bgemm_tma.cu)
    int threads;
};

#define BIE_B1_KERNEL(id, BM, BN, WM, WN, BKB, ST)                                                 \
    {                                                                                              \
        id, "cuda.mma_b1.bgemm_" #BM "x" #BN "_w" #WM "x" #WN "_k" #BKB "_s" #ST, BM, BN, BKB, ST, \
            bgemm_b1<BM, BN, WM, WN, BKB, ST>, 32 * WM *WN                                         \
    }

const CudaKernel kernels[] = {
    BIE_B1_KERNEL(100, 128, 128, 2, 4, 64, 3),
    BIE_B1_KERNEL(101, 64, 64, 2, 2, 64, 3),
    BIE_B1_KERNEL(102, 128, 128, 2, 2, 128, 3),
    BIE_B1_KERNEL(103, 128, 128, 2, 2, 256, 3),
    BIE_B1_KERNEL(104, 128, 128, 2, 4, 128, 4),
    BIE_B1_KERNEL(105, 128, 128, 2, 2, 128, 4),
    BIE_B1_KERNEL(106, 256, 128, 4, 2, 128, 3),
    BIE_B1_KERNEL(107, 128, 256, 2, 4, 128, 3),
    BIE_B1_KERNEL(108, 256, 128, 4, 2, 64, 4),
    // Short k (convolutions: 9 taps of a few hundred channels) gives each block little work;
    // these trade registers for more resident blocks per SM to hide the latency.
    {110, "cuda.mma_b1.bgemm_64x64_w2x2_k64_s3_b6", 64, 64, 64, 3, bgemm_b1<64, 64, 2, 2, 64, 3, 6>,
     128},
    {111, "cuda.mma_b1.bgemm_64x128_w2x2_k64_s3_b4", 64, 128, 64, 3,
     bgemm_b1<64, 128, 2, 2, 64, 3, 4>, 128},
    // Hopper's warpgroup mma (bgemm_wgmma.cu): 128 x 256 tiles, four 1024-bit stages.
    {120, "cuda.wgmma_b1.bgemm_128x256_k128_s4", 128, 256, 128, 4, nullptr, 256},
    // The same with TMA loads, a producer warpgroup and two consumers (bgemm_tma.cu).
    {121, "cuda.wgmma_b1.bgemm_tma_128x256_k128_s3", 128, 256, 128, 3, nullptr, 384},
    {109, "cuda.mma_b1.stream_m16", 0, 0, 0, 0, bgemv_b1<kGemvWarps>, 32 * kGemvWarps},
};
constexpr int kNumKernels = sizeof kernels / sizeof kernels[0];
constexpr int kStreamIndex = kNumKernels - 1;

// The table entry with this id (one of the table's: the code below names only those).
const CudaKernel &kernel_with_id(int id) {
    int i = 0;
    while (i + 1 < kNumKernels && kernels[i].id != id) i++;
    return kernels[i];
}

size_t smem_bytes(const CudaKernel &kern, int64_t ld) {
    if (kern.bm == 0) return (size_t)16 * (size_t)(ld + 16);
    if (kern.fn == nullptr) return kern.id == 121 ? bgemm_tma_smem() : bgemm_wgmma_smem();
    return (size_t)kern.stages * (kern.bm + kern.bn) * (kern.bkb + 16);
}

// Shared memory a block may use on the current device (227 KB on Hopper, 163 KB on A100):
// it limits the deepest tile configurations, and the streaming kernel (16 activation rows in
// shared memory) to k of about 100,000 bits.
size_t max_smem() {
    int dev = 0, v = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) {
        cudaGetLastError();
        return 96 * 1024;
    }
    return (size_t)v;
}

// Whether the kernel's k block divides the row stride (the main loops have no k tail). The
// streaming kernel steps 64 bytes at a time.
bool stride_ok(const CudaKernel &kern, int64_t ld) {
    return ld % (kern.bm == 0 ? 64 : kern.bkb) == 0;
}

// Whether the current device runs the kernel (the wgmma ones: compute capability 9.0 only;
// kernel 121 also needs the driver's tensor maps).
bool runs_here(const CudaKernel &kern) {
    return kern.fn != nullptr || (kern.id == 121 ? bgemm_tma_usable() : wgmma_usable());
}

const CudaKernel *default_kernel(int64_t m, int64_t n, int64_t ld) {
    if (m <= 16 && smem_bytes(kernels[kStreamIndex], ld) <= max_smem() &&
        stride_ok(kernels[kStreamIndex], ld))
        return &kernels[kStreamIndex];
    // Small problems need more blocks than 128x128 tiles give to fill the GPU.
    // Measured on the H100 (BENCHMARKS.md): 128x128 with 2x2 warps and 1024-bit stages is
    // fastest at 8192^3; rows that are not a multiple of 128 bytes (convolutions) take the
    // 64-byte stages.
    // On Hopper the wgmma kernels from 32 of their 128 x 256 tiles up: on the H200 kernel 120
    // ran 1.2x kernel 101 at 256 x 4096 x 4096 (32 tiles), 2x at 1024 x 4096 x 4096 and
    // 2048^3, 2.5x kernel 102 at 4096^3; kernel 121 (TMA) 1.1x kernel 120 at 4096^3 and
    // 8192^3 (BENCHMARKS.md). Kernel 120 where the driver makes no tensor maps.
    const CudaKernel &tma = kernel_with_id(121), &wg = kernel_with_id(120);
    if (stride_ok(wg, ld) && ((m + wg.bm - 1) / wg.bm) * ((n + wg.bn - 1) / wg.bn) >= 32) {
        if (runs_here(tma)) return &tma;
        if (runs_here(wg)) return &wg;
    }
    if (m * n < (int64_t)4096 * 4096 || !stride_ok(kernels[2], ld)) return &kernels[1];
    return &kernels[2];
}

}  // namespace bie_cuda

using namespace bie_cuda;

extern "C" {

// The public list: the binary kernels (indices 0..kNumKernels-1), then the 4-bit ones.
int bie_cuda_kernel_count_internal(void) { return kNumKernels + bie_cuda_q4_kernel_count(); }

void bie_cuda_kernel_describe(int index, bie_kernel_info *info) {
    if (index >= kNumKernels) {
        bie_cuda_q4_kernel_describe(index - kNumKernels, info);
        return;
    }
    const CudaKernel &kern = kernels[index];
    info->id = kern.id;
    info->name = kern.name;
    info->isa = kern.fn ? "sm_80" : "sm_90a";
    info->op = BIE_OP_BINARY_GEMM;
    info->device = BIE_DEVICE_CUDA;
    info->preferred_max_m = kern.bm == 0 ? 16 : INT64_MAX;
    info->available = bie_cuda_device_count() > 0 && runs_here(kern);
}

// Index of the binary kernel with this id, or -1.
static int binary_index(int id) {
    for (int i = 0; i < kNumKernels; i++)
        if (kernels[i].id == id) return i;
    return -1;
}

int bie_cuda_kernel_index(int id) {
    int idx = binary_index(id);
    if (idx >= 0) return idx;
    idx = bie_cuda_q4_kernel_index(id);
    return idx >= 0 ? kNumKernels + idx : -1;
}

bool bie_cuda_bgemm_kernel_fits_ld(int id, int64_t ld) {
    int idx = binary_index(id);
    return idx >= 0 && runs_here(kernels[idx]) && smem_bytes(kernels[idx], ld) <= max_smem() &&
           stride_ok(kernels[idx], ld);
}

bool bie_cuda_kernel_fits(int id, int64_t k) {
    int idx = binary_index(id);
    if (idx < 0) return bie_cuda_q4_kernel_fits(id, k);
    return runs_here(kernels[idx]) &&
           smem_bytes(kernels[idx], bie_cuda_row_stride(k)) <= max_smem();
}

bie_status bie_cuda_bgemm_launch(int kernel_id, int64_t m, int64_t n, int64_t k, const uint8_t *a,
                                 const uint8_t *b, int64_t ld, const int *pa, int parts_a,
                                 const int *pb, float scale, const float *scale_a,
                                 const float *scale_w, bie_dtype out_dtype, void *out,
                                 const bie_cuda_conv_out *conv) {
    static const char *who = "cuda binary gemm";
    const CudaKernel *kern = default_kernel(m, n, ld);
    if (kernel_id >= 0) {
        int idx = binary_index(kernel_id);
        if (idx < 0)
            return bie_fail(BIE_ERR_INVALID_ARGUMENT, "%s: no CUDA binary kernel with id %d", who,
                            kernel_id);
        kern = &kernels[idx];
    }
    const int which = out_type_of(out_dtype);
    if (which < 0)
        return bie_fail(BIE_ERR_DTYPE, "%s: output dtype %s", who, bie_dtype_name(out_dtype));
    if (!stride_ok(*kern, ld))
        return bie_fail(BIE_ERR_UNSUPPORTED,
                        "%s: kernel %s cannot run rows of %lld bytes (its k block "
                        "must divide them)",
                        who, kern->name, (long long)ld);
    size_t smem = smem_bytes(*kern, ld);
    if (smem > max_smem())
        return bie_fail(BIE_ERR_UNSUPPORTED,
                        "%s: kernel %s cannot run k = %lld (needs %zu bytes of "
                        "shared memory)",
                        who, kern->name, (long long)k, smem);
    const Epilogue ep = make_epilogue(which, out, n, scale, scale_a, scale_w, conv);
    const int parts_b = bie_cuda_popc_parts(ld);
    if (kern->fn == nullptr)
        return (kern->id == 121 ? bgemm_tma_launch : bgemm_wgmma_launch)(m, n, k, a, b, ld, pa,
                                                                         parts_a, pb, parts_b, ep);
    KernelFn fn = kern->fn;
    // Held to the launch: the streaming kernel's shared memory depends on ld.
    std::lock_guard<std::mutex> smem_lock(smem_attribute_mutex());
    BIE_CUDA_TRY(check(cudaFuncSetAttribute(reinterpret_cast<const void *>(fn),
                                            cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem),
                       "cudaFuncSetAttribute"));
    // The largest shared-memory carve-out, so that as many blocks as registers allow fit.
    BIE_CUDA_TRY(check(cudaFuncSetAttribute(reinterpret_cast<const void *>(fn),
                                            cudaFuncAttributePreferredSharedMemoryCarveout, 100),
                       "cudaFuncSetAttribute"));
    dim3 grid;
    if (kern->bm == 0)
        grid = dim3((unsigned)((n + 8 * kGemvWarps - 1) / (8 * kGemvWarps)),
                    (unsigned)((m + 15) / 16));
    else
        grid = dim3((unsigned)((n + kern->bn - 1) / kern->bn),
                    (unsigned)((m + kern->bm - 1) / kern->bm));
    BIE_CUDA_TRY(check(launch_after(fn, grid, dim3(kern->threads), smem, (int)m, (int)n, k, a, b,
                                    ld, pa, pb, parts_a, parts_b, ep),
                       "binary gemm launch"));
    return check(cudaGetLastError(), "binary gemm launch");
}

bie_status bie_cuda_binary_gemm(int kernel_id, int64_t m, int64_t n, int64_t k, const void *a,
                                int64_t a_row_bytes, const void *b, int64_t b_row_bytes,
                                float scale, float *out) {
    static const char *who = "bie_cuda_binary_gemm";
    if (a == NULL || b == NULL || out == NULL)
        return bie_fail(BIE_ERR_NULL_POINTER, "%s: a, b and out must not be NULL", who);
    if (m < 1 || n < 1 || k < 1) return bie_fail(BIE_ERR_SHAPE, "%s: m, n, k must be >= 1", who);
    if (k > (1LL << 28) || m > 65535LL * 64 || n > INT32_MAX)
        return bie_fail(BIE_ERR_OVERFLOW, "%s: k must be <= 2^28 and m <= 4194240", who);
    if (a_row_bytes < (k + 7) / 8 || b_row_bytes < (k + 7) / 8)
        return bie_fail(BIE_ERR_SHAPE, "%s: row strides must be >= ceil(k / 8) bytes", who);
    if (!(scale - scale == 0.0f))
        return bie_fail(BIE_ERR_NOT_FINITE, "%s: scale is not finite", who);
    if (kernel_id >= 0 && binary_index(kernel_id) < 0)
        return bie_fail(BIE_ERR_INVALID_ARGUMENT, "%s: no CUDA binary kernel with id %d", who,
                        kernel_id);
    BIE_CUDA_TRY(require_device());
    if (!is_device_pointer(a) || !is_device_pointer(b) || !is_device_pointer(out))
        return bie_fail(BIE_ERR_DEVICE, "%s: a, b and out must be CUDA device memory", who);

    const int64_t ld = bie_cuda_row_stride(k);
    const int parts = bie_cuda_popc_parts(ld);
    cudaStream_t st = current_stream;
    uint8_t *ws = NULL;
    size_t bytes = (size_t)(m + n) * (size_t)ld + (size_t)(m + n) * parts * sizeof(int);
    BIE_CUDA_TRY(check(cudaMallocAsync((void **)&ws, bytes, st), "cudaMallocAsync"));
    uint8_t *ap = ws, *bp = ws + m * ld;
    int *pa = reinterpret_cast<int *>(ws + (m + n) * ld), *pb = pa + m * parts;
    bie_status s = bie_cuda_repack_rows(a, a_row_bytes, m, k, ld, ap, pa);
    if (s == BIE_OK) s = bie_cuda_repack_rows(b, b_row_bytes, n, k, ld, bp, pb);
    if (s == BIE_OK)
        s = bie_cuda_bgemm_launch(kernel_id, m, n, k, ap, bp, ld, pa, parts, pb, scale, NULL, NULL,
                                  BIE_F32, out, NULL);
    cudaError_t free_err = cudaFreeAsync(ws, st);
    BIE_CUDA_TRY(s);
    return check(free_err, "cudaFreeAsync");
}

}  // extern "C"
