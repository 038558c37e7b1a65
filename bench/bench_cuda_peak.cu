// Tensor-core peaks of the warpgroup MMA shapes bie's Hopper kernels use, for BENCHMARKS.md's
// "how far from the hardware limit": one block of two warpgroups per SM issues wgmma in a
// loop on shared-memory operands (four per commit, one group in flight), nothing else.
// Prints one JSON line per instruction. Compiled for sm_90a alone.
#include <cuda_runtime.h>

#include <cstdio>

#include "cuda/mma.cuh"
#include "cuda/wgmma.cuh"

using namespace bie_cuda;

namespace {

constexpr int kSmem = 64 * 1024 + 1024;

// kind 0: b1 AND-popc m64n256k256 (A and B in shared memory); 1: s8 m64n256k32 (A in
// registers).
template <int KIND> __global__ void __launch_bounds__(256, 1) peak(int iters, int *sink) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ uint8_t smem[];
    for (int i = threadIdx.x; i < kSmem / 4; i += blockDim.x)
        reinterpret_cast<unsigned *>(smem)[i] = (unsigned)i * 2654435761u;
    fence_proxy_async();
    __syncthreads();
    const unsigned base = (smem_u32(smem) + 1023) & ~1023u;
    const int wg = threadIdx.x >> 7;
    int d[128];
#pragma unroll
    for (int i = 0; i < 128; i++) d[i] = 0;
    const unsigned a[4] = {threadIdx.x, 1u, 3u, 7u};
    for (int it = 0; it < iters; it++) {
        fence_acc(d);
        wgmma_fence();
#pragma unroll
        for (int s = 0; s < 4; s++) {
            const uint64_t b = smem_desc(base + 16384 + 32 * s, 16, 1024, 1);
            if (KIND == 0)
                wgmma_b1_64x256x256(d, smem_desc(base + wg * 8192 + 32 * s, 16, 1024, 1), b);
            else
                wgmma_s8_64x256x32(d, a, b);
        }
        wgmma_commit();
        wgmma_wait<1>();
        fence_acc(d);
    }
    wgmma_wait<0>();
    fence_acc(d);
    int sum = 0;
#pragma unroll
    for (int i = 0; i < 128; i++) sum += d[i];
    sink[blockIdx.x * blockDim.x + threadIdx.x] = sum;
#else
    (void)iters, (void)sink;
#endif
}

template <int KIND> int run(const char *name, int sms, int *sink, double k) {
    if (cudaFuncSetAttribute(peak<KIND>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem) !=
        cudaSuccess)
        return 1;
    const int iters = KIND == 0 ? 2000 : 4000;
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    peak<KIND><<<sms, 256, kSmem>>>(10, sink);  // warm-up
    float best = 1e30f;
    for (int rep = 0; rep < 5; rep++) {
        cudaEventRecord(e0);
        peak<KIND><<<sms, 256, kSmem>>>(iters, sink);
        cudaEventRecord(e1);
        cudaEventSynchronize(e1);
        float ms = 0;
        cudaEventElapsedTime(&ms, e0, e1);
        best = ms < best ? ms : best;
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    if (cudaGetLastError() != cudaSuccess) return 1;
    // 2 ops per multiply-accumulate; per block: 2 warpgroups x 4 instructions per iteration
    const double ops = 2.0 * sms * 2 * 4.0 * iters * 64 * 256 * k;
    printf("{\"name\":\"%s\",\"s\":%.6e,\"tops\":%.1f}\n", name, best * 1e-3, ops / best / 1e9);
    return 0;
}

}  // namespace

int main() {
    int dev = 0, cc = 0, sms = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&cc, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
        fprintf(stderr, "bie_bench_cuda_peak: no CUDA device\n");
        return 1;
    }
    if (cc != 9) {
        fprintf(stderr, "bie_bench_cuda_peak: wgmma needs compute capability 9.0\n");
        return 0;
    }
    int *sink = nullptr;
    if (cudaMalloc(&sink, (size_t)sms * 256 * sizeof(int)) != cudaSuccess) return 1;
    int rc = run<0>("cuda_peak_wgmma_b1_m64n256k256", sms, sink, 256);
    rc |= run<1>("cuda_peak_wgmma_s8_m64n256k32", sms, sink, 32);
    cudaFree(sink);
    return rc;
}
