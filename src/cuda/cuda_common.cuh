// Shared by the CUDA backend's host code: error checks and the current stream.
#pragma once
#include <cuda_runtime.h>

#include <mutex>

#include "../core/internal.h"

#define BIE_CUDA_TRY(call)                                 \
    do {                                                   \
        bie_status bie_cuda_try_ = (call);                 \
        if (bie_cuda_try_ != BIE_OK) return bie_cuda_try_; \
    } while (0)

namespace bie_cuda {
extern thread_local cudaStream_t current_stream;
// BIE_OK, or BIE_ERR_CUDA with the runtime's message.
bie_status check(cudaError_t err, const char *what);
bie_status require_device(void);
bool is_device_pointer(const void *p);
// The current device's compute capability as major * 10 + minor (90 on Hopper), cached per
// device; 0 when it cannot be asked.
int device_cc();
// The current device's SMs (an H100's 132 when it cannot be asked).
int device_sms();
// Whether environment variable `name` is set to exactly `value` (the kernel choices that
// BIE_CUDA_* variables override, to time one against another).
bool env_is(const char *name, const char *value);
// A kernel's largest dynamic shared memory (cudaFuncAttributeMaxDynamicSharedMemorySize) is
// one setting per kernel for the whole process. Where a kernel's need differs between calls
// (it depends on the shape), this lock is held from setting it to the launch, so that another
// thread cannot lower it in between and fail this launch (SPEC §7: distinct layers at once).
std::mutex &smem_attribute_mutex();
}  // namespace bie_cuda
