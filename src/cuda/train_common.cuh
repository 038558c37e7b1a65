// What the training library's CUDA kernel files share (train_kernels.cu,
// train_graph_kernels.cu): launch shapes, grid-stride indices, launch checks, per-call
// device scratch and the shape of a per-channel reduction. Each file keeps its own copy
// (an anonymous namespace), as before.
#ifndef BIE_CUDA_TRAIN_COMMON_CUH
#define BIE_CUDA_TRAIN_COMMON_CUH

#include <cuda_runtime.h>

#include "cuda_common.cuh"

namespace bie_cuda {
namespace {

constexpr int kThreads = 256;

unsigned grid_1d(int64_t count) {
    int64_t b = (count + kThreads - 1) / kThreads;
    return (unsigned)(b < 1 ? 1 : b > 32768 ? 32768 : b);
}

__device__ __forceinline__ int64_t thread_index() {
    return (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t thread_stride() { return (int64_t)gridDim.x * blockDim.x; }

bie_status launched(const char *what) { return check(cudaGetLastError(), what); }

// Device scratch for one call, released on the stream when the call's kernels are queued.
struct Scratch {
    void *p = nullptr;
    ~Scratch() {
        if (p) cudaFreeAsync(p, current_stream);
    }
    bie_status get(size_t bytes, const char *what) {
        return check(cudaMallocAsync(&p, bytes ? bytes : 1, current_stream), what);
    }
};

// A per-channel reduction over [n, c, inner]: channel ch holds the n * inner elements
// (b * c + ch) * inner + i, summed in `splits` parts (see the kernels' channel_partial).
struct ChannelShape {
    int64_t n, c, inner;
    int splits;
};

int splits_for(int64_t count, int64_t c) {
    if (c >= 512) return 1;  // enough blocks already
    int64_t s = count / 16384;
    return (int)(s < 1 ? 1 : s > 32 ? 32 : s);
}

}  // namespace
}  // namespace bie_cuda

#endif
