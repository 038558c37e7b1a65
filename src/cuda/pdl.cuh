// Programmatic dependent launch (compute capability 9.0 and later): a kernel launched with
// launch_after() may start while the kernel before it in the stream is still running. It
// does its independent preamble (index math, loads of data an earlier kernel wrote), then
// pdl_wait() blocks until the kernel before it has completed and its writes are visible; it
// must not read that kernel's output, nor write what that kernel reads, before the wait.
// The kernel before it calls pdl_trigger() to let it launch early. On older devices, and
// for kernels launched the usual way, both are no-ops and the launch is a plain one.
#pragma once
#include <cuda_runtime.h>

#include <utility>

#include "cuda_common.cuh"

namespace bie_cuda {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Whether the current device supports it.
inline bool pdl_supported() { return device_cc() >= 90; }

// kernel<<<grid, block, smem, current_stream>>>(args...), allowed to overlap the previous
// kernel in the stream where the device supports it and overlap is true.
template <typename... Params, typename... Args>
cudaError_t launch_kernel(bool overlap, void (*kernel)(Params...), dim3 grid, dim3 block,
                          size_t smem, Args &&...args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = current_stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = overlap && pdl_supported() ? 1 : 0;
    return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}
template <typename... Params, typename... Args>
cudaError_t launch_after(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                         Args &&...args) {
    return launch_kernel(true, kernel, grid, block, smem, std::forward<Args>(args)...);
}

}  // namespace bie_cuda
