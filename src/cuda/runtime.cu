// CUDA runtime glue: devices, memory, copies, streams, error mapping.
#include <cuda_runtime.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "bie_cuda.h"
#include "cuda_common.cuh"
#include "cuda_internal.h"

namespace bie_cuda {
thread_local cudaStream_t current_stream = nullptr;

bie_status check(cudaError_t err, const char *what) {
    if (err == cudaSuccess) return BIE_OK;
    cudaGetLastError();  // clear the sticky-free error state
    return bie_fail(BIE_ERR_CUDA, "%s: %s (%s)", what, cudaGetErrorString(err),
                    cudaGetErrorName(err));
}

bie_status require_device(void) {
    if (bie_cuda_device_count() == 0)
        return bie_fail(BIE_ERR_DEVICE, "no CUDA device is available");
    return BIE_OK;
}

int device_sms() {
    static std::atomic<int> known[16];  // 0: not asked yet
    int dev = 0, sms = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) {
        cudaGetLastError();
        return 132;  // an H100's
    }
    if (dev >= 0 && dev < 16 && (sms = known[dev].load(std::memory_order_relaxed)) > 0) return sms;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
        sms < 1) {
        cudaGetLastError();
        return 132;  // not cached: a later call may succeed
    }
    if (dev >= 0 && dev < 16) known[dev].store(sms, std::memory_order_relaxed);
    return sms;
}

int device_cc() {
    static std::atomic<int> known[16];  // capability + 1; 0: not asked yet
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    if (dev >= 0 && dev < 16) {
        const int k = known[dev].load(std::memory_order_relaxed);
        if (k) return k - 1;
    }
    int major = 0, minor = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
        cudaGetLastError();
        return 0;  // not cached: a later call may succeed
    }
    const int cc = major * 10 + minor;
    if (dev >= 0 && dev < 16) known[dev].store(cc + 1, std::memory_order_relaxed);
    return cc;
}

bool env_is(const char *name, const char *value) {
    const char *e = std::getenv(name);
    return e != nullptr && std::strcmp(e, value) == 0;
}

std::mutex &smem_attribute_mutex() {
    static std::mutex m;
    return m;
}

bool is_device_pointer(const void *p) {
    cudaPointerAttributes attr;
    if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
        cudaGetLastError();
        return false;
    }
    return attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
}
}  // namespace bie_cuda

using namespace bie_cuda;

extern "C" {

int bie_cuda_device_count(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return n;
}

bool bie_cuda_built(void) { return true; }

void *bie_cuda_current_stream(void) { return current_stream; }

void bie_cuda_free_ptr(void *p) {
    if (p) cudaFree(p);
}

bie_status bie_cuda_scratch_alloc(void **p, size_t bytes, const char *what) {
    *p = NULL;
    return check(cudaMallocAsync(p, bytes ? bytes : 1, current_stream), what);
}

void bie_cuda_scratch_free(void *p) {
    if (p) (void)cudaFreeAsync(p, current_stream);
}

bie_status bie_cuda_tensor_alloc(bie_tensor *out, bie_dtype dtype, int ndim, const int64_t *shape,
                                 int device) {
    if (out == NULL) return bie_fail(BIE_ERR_NULL_POINTER, "bie_cuda_tensor_alloc: 'out' is NULL");
    BIE_CUDA_TRY(require_device());
    if (device < 0 || device >= bie_cuda_device_count())
        return bie_fail(BIE_ERR_DEVICE, "bie_cuda_tensor_alloc: no CUDA device %d", device);
    bie_tensor t;
    BIE_CUDA_TRY(bie_tensor_view(&t, NULL, dtype, ndim, shape));
    size_t bytes = (size_t)bie_tensor_numel(&t) * bie_dtype_size(dtype);
    int previous = 0;
    cudaGetDevice(&previous);
    BIE_CUDA_TRY(check(cudaSetDevice(device), "cudaSetDevice"));
    void *p = NULL;
    cudaError_t err = cudaMalloc(&p, bytes ? bytes : 1);
    cudaSetDevice(previous);
    if (err != cudaSuccess) return check(err, "cudaMalloc");
    t.data = p;
    t.device.type = BIE_DEVICE_CUDA;
    t.device.index = device;
    t.owns_data = true;
    *out = t;
    return BIE_OK;
}

bie_status bie_tensor_copy(bie_tensor *dst, const bie_tensor *src) {
    if (dst == NULL || src == NULL)
        return bie_fail(BIE_ERR_NULL_POINTER, "bie_tensor_copy: NULL tensor");
    if (dst->data == NULL || src->data == NULL)
        return bie_fail(BIE_ERR_NULL_POINTER, "bie_tensor_copy: tensor without data");
    if (dst->dtype != src->dtype)
        return bie_fail(BIE_ERR_DTYPE, "bie_tensor_copy: dtypes differ (%s vs %s)",
                        bie_dtype_name(dst->dtype), bie_dtype_name(src->dtype));
    int64_t n = bie_tensor_numel(src);
    if (n < 0 || n != bie_tensor_numel(dst))
        return bie_fail(BIE_ERR_SHAPE, "bie_tensor_copy: element counts differ");
    size_t bytes = (size_t)n * bie_dtype_size(src->dtype);
    if (src->device.type == BIE_DEVICE_CPU && dst->device.type == BIE_DEVICE_CPU) {
        memmove(dst->data, src->data, bytes);
        return BIE_OK;
    }
    BIE_CUDA_TRY(require_device());
    BIE_CUDA_TRY(
        check(cudaMemcpyAsync(dst->data, src->data, bytes, cudaMemcpyDefault, current_stream),
              "cudaMemcpy"));
    return check(cudaStreamSynchronize(current_stream), "cudaStreamSynchronize");
}

bie_status bie_cuda_set_stream(void *stream) {
    current_stream = static_cast<cudaStream_t>(stream);
    return BIE_OK;
}

bie_status bie_cuda_synchronize(void) {
    BIE_CUDA_TRY(require_device());
    return check(cudaStreamSynchronize(current_stream), "cudaStreamSynchronize");
}

}  // extern "C"
