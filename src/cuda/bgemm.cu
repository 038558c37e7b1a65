// Binary GEMM on tensor cores: mma.m16n8k256 b1 with AND-popc (SPEC §1.1 AND form):
//   dot = k - 2 popc(a) - 2 popc(b) + 4 popc(a AND b)
// Rows are first re-laid out on the device into zero-padded rows of whole 512-bit blocks
// (with their popcounts), so the main loop needs no tail handling.
#include <cuda_runtime.h>

#include "bie_cuda.h"
#include "cuda_common.cuh"
#include "cuda_internal.h"
#include "mma.cuh"

namespace bie_cuda {

// Device rows are padded to whole 2048-bit blocks, so every kernel's k block divides them.
constexpr int kRowAlign = 256;

// One block per row: copy the row's valid bits into a zero-padded row of `dst_bytes`, mask
// the tail, count the set bits.
__global__ void repack_rows(const uint8_t *src, int64_t src_stride, int64_t k, uint8_t *dst,
                            int64_t dst_bytes, int *popc) {
    const int64_t row = blockIdx.x;
    const int64_t nbytes = (k + 7) >> 3;
    const unsigned tail = (k & 7) ? ((1u << (k & 7)) - 1u) : 0xffu;
    const uint8_t *s = src + row * src_stride;
    unsigned *d = reinterpret_cast<unsigned *>(dst + row * dst_bytes);
    int count = 0;
    for (int64_t w = threadIdx.x; w < dst_bytes / 4; w += blockDim.x) {
        unsigned v = 0;
        for (int b = 0; b < 4; b++) {
            int64_t idx = w * 4 + b;
            if (idx < nbytes) {
                unsigned byte = s[idx];
                if (idx == nbytes - 1) byte &= tail;
                v |= byte << (8 * b);
            }
        }
        d[w] = v;
        count += __popc(v);
    }
    __shared__ int partial[32];
    for (int o = 16; o > 0; o >>= 1) count += __shfl_down_sync(0xffffffffu, count, o);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = count;
    __syncthreads();
    if (threadIdx.x == 0) {
        int total = 0;
        for (int i = 0; i < (int)(blockDim.x >> 5); i++) total += partial[i];
        popc[row] = total;
    }
}

// BM x BN output tile per block, WARPS_M x WARPS_N warps, each owning a (BM / WARPS_M) x
// (BN / WARPS_N) sub-tile of 16x8 mma tiles; a STAGES-deep cp.async pipeline over k blocks
// of BKB bytes. Shared rows are BKB + 16 bytes: the 8 rows an ldmatrix reads then fall in
// distinct banks.
template <int BM, int BN, int WARPS_M, int WARPS_N, int BKB, int STAGES>
__global__ void __launch_bounds__(32 * WARPS_M * WARPS_N)
    bgemm_b1(int m, int n, int64_t k, const uint8_t *__restrict__ A,
             const uint8_t *__restrict__ B, int64_t ld, const int *__restrict__ pa,
             const int *__restrict__ pb, float scale, float *__restrict__ out) {
    constexpr int THREADS = 32 * WARPS_M * WARPS_N;
    constexpr int kSmemRow = BKB + 16, kStages = STAGES, CHUNKS = BKB / 16;
    const int kblocks = (int)(ld / BKB);
    constexpr int WTM = BM / WARPS_M, WTN = BN / WARPS_N;
    constexpr int MT = WTM / 16, NT = WTN / 8;
    static_assert(NT % 2 == 0, "B fragments are loaded two n8 tiles at a time");
    extern __shared__ __align__(16) uint8_t smem[];
    uint8_t *sA = smem;
    uint8_t *sB = smem + kStages * BM * kSmemRow;

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

    // Epilogue: AND-form back-transform, one float multiply, as every backend does.
    const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int row = bm0 + wm * WTM + i * 16 + g + 8 * (e >> 1);
                int col = bn0 + wn * WTN + j * 8 + 2 * t4 + (e & 1);
                if (row < m && col < n) {
                    long long dot = k - 2LL * pa[row] - 2LL * pb[col] + 4LL * acc[i][j][e];
                    out[(int64_t)row * n + col] = (float)dot * scale;
                }
            }
}

struct CudaKernel {
    int id;
    const char *name;
    int bm, bn, bkb, stages;
    void (*fn)(int, int, int64_t, const uint8_t *, const uint8_t *, int64_t, const int *,
               const int *, float, float *);
    int threads;
};

#define BIE_B1_KERNEL(id, BM, BN, WM, WN, BKB, ST)                                             \
    {id, "cuda.mma_b1.bgemm_" #BM "x" #BN "_w" #WM "x" #WN "_k" #BKB "_s" #ST, BM, BN, BKB, ST,                 \
     bgemm_b1<BM, BN, WM, WN, BKB, ST>, 32 * WM * WN}

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
};
constexpr int kNumKernels = sizeof kernels / sizeof kernels[0];

const CudaKernel *default_kernel(int64_t m, int64_t n) {
    // Small problems need more blocks than 128x128 tiles give to fill the GPU.
    // Measured on the H100 (BENCHMARKS.md): 128x128 with 2x2 warps and 1024-bit stages is
    // fastest at 8192^3.
    return (m * n < (int64_t)4096 * 4096) ? &kernels[1] : &kernels[2];
}

}  // namespace bie_cuda

using namespace bie_cuda;

extern "C" {

int bie_cuda_kernel_count_internal(void) { return kNumKernels; }

void bie_cuda_kernel_describe(int index, bie_kernel_info *info) {
    const CudaKernel &kern = kernels[index];
    info->id = kern.id;
    info->name = kern.name;
    info->isa = "sm_80";
    info->op = BIE_OP_BINARY_GEMM;
    info->device = BIE_DEVICE_CUDA;
    info->preferred_max_m = INT64_MAX;
    info->available = bie_cuda_device_count() > 0;
}

int bie_cuda_kernel_index(int id) {
    for (int i = 0; i < kNumKernels; i++)
        if (kernels[i].id == id) return i;
    return -1;
}

bie_status bie_cuda_binary_gemm(int kernel_id, int64_t m, int64_t n, int64_t k, const void *a,
                                int64_t a_row_bytes, const void *b, int64_t b_row_bytes,
                                float scale, float *out) {
    static const char *who = "bie_cuda_binary_gemm";
    if (a == NULL || b == NULL || out == NULL)
        return bie_fail(BIE_ERR_NULL_POINTER, "%s: a, b and out must not be NULL", who);
    if (m < 1 || n < 1 || k < 1)
        return bie_fail(BIE_ERR_SHAPE, "%s: m, n, k must be >= 1", who);
    if (k > (1LL << 28) || m > 65535LL * 64 || n > INT32_MAX)
        return bie_fail(BIE_ERR_OVERFLOW, "%s: k must be <= 2^28 and m <= 4194240", who);
    if (a_row_bytes < (k + 7) / 8 || b_row_bytes < (k + 7) / 8)
        return bie_fail(BIE_ERR_SHAPE, "%s: row strides must be >= ceil(k / 8) bytes", who);
    if (!(scale - scale == 0.0f)) return bie_fail(BIE_ERR_NOT_FINITE, "%s: scale is not finite", who);
    const CudaKernel *kern = default_kernel(m, n);
    if (kernel_id >= 0) {
        int idx = bie_cuda_kernel_index(kernel_id);
        if (idx < 0) return bie_fail(BIE_ERR_INVALID_ARGUMENT, "%s: no CUDA kernel with id %d", who, kernel_id);
        kern = &kernels[idx];
    }
    BIE_CUDA_TRY(require_device());
    if (!is_device_pointer(a) || !is_device_pointer(b) || !is_device_pointer(out))
        return bie_fail(BIE_ERR_DEVICE, "%s: a, b and out must be CUDA device memory", who);

    const int64_t ld = ((k + 7) / 8 + kRowAlign - 1) / kRowAlign * kRowAlign;
    cudaStream_t st = current_stream;
    uint8_t *ws = NULL;
    size_t bytes = (size_t)(m + n) * (size_t)ld + (size_t)(m + n) * sizeof(int);
    BIE_CUDA_TRY(check(cudaMallocAsync((void **)&ws, bytes, st), "cudaMallocAsync"));
    uint8_t *ap = ws, *bp = ws + m * ld;
    int *pa = reinterpret_cast<int *>(ws + (m + n) * ld), *pb = pa + m;
    repack_rows<<<(unsigned)m, 128, 0, st>>>(static_cast<const uint8_t *>(a), a_row_bytes, k, ap, ld, pa);
    repack_rows<<<(unsigned)n, 128, 0, st>>>(static_cast<const uint8_t *>(b), b_row_bytes, k, bp, ld, pb);
    size_t smem = (size_t)kern->stages * (kern->bm + kern->bn) * (kern->bkb + 16);
    cudaError_t err = cudaFuncSetAttribute(reinterpret_cast<const void *>(kern->fn),
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (err == cudaSuccess) {
        dim3 grid((unsigned)((n + kern->bn - 1) / kern->bn), (unsigned)((m + kern->bm - 1) / kern->bm));
        kern->fn<<<grid, kern->threads, smem, st>>>((int)m, (int)n, k, ap, bp, ld, pa, pb, scale, out);
        err = cudaGetLastError();
    }
    cudaError_t free_err = cudaFreeAsync(ws, st);
    BIE_CUDA_TRY(check(err, "binary gemm launch"));
    return check(free_err, "cudaFreeAsync");
}

}  // extern "C"
