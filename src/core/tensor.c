#include <string.h>

#include "device.h"
#include "internal.h"

bie_device bie_cpu(void) {
    bie_device d = {BIE_DEVICE_CPU, 0};
    return d;
}

size_t bie_dtype_size(bie_dtype dtype) {
    switch (dtype) {
    case BIE_F32:
    case BIE_U32:
    case BIE_I32: return 4;
    case BIE_BF16:
    case BIE_F16: return 2;
    case BIE_I8:
    case BIE_U8: return 1;
    case BIE_U64:
    case BIE_F64: return 8;
    }
    return 0;
}

const char *bie_dtype_name(bie_dtype dtype) {
    static const char *names[] = {"float32", "bfloat16", "float16", "int8",   "uint8",
                                  "uint32",  "uint64",   "int32",   "float64"};
    if ((unsigned)dtype < sizeof names / sizeof names[0]) return names[dtype];
    return "unknown";
}

void *bie_alloc_aligned(size_t bytes) {
    size_t rounded = (bytes + 63) / 64 * 64;
    if (rounded == 0) rounded = 64;
    return aligned_alloc(64, rounded);
}

void bie_free_aligned(void *p) { free(p); }

static bie_status describe(bie_tensor *out, void *data, bie_dtype dtype, int ndim,
                           const int64_t *shape, const char *who) {
    if (out == NULL) return bie_fail(BIE_ERR_NULL_POINTER, "%s: 'out' is NULL", who);
    if (shape == NULL) return bie_fail(BIE_ERR_NULL_POINTER, "%s: 'shape' is NULL", who);
    if (ndim < 1 || ndim > BIE_MAX_DIMS)
        return bie_fail(BIE_ERR_SHAPE, "%s: ndim %d outside 1..%d", who, ndim, BIE_MAX_DIMS);
    if (bie_dtype_size(dtype) == 0)
        return bie_fail(BIE_ERR_DTYPE, "%s: unknown dtype %d", who, (int)dtype);
    int64_t numel = 1;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0) return bie_fail(BIE_ERR_SHAPE, "%s: extent %d is negative", who, i);
        if (!bie_mul_ok(numel, shape[i], &numel))
            return bie_fail(BIE_ERR_OVERFLOW, "%s: element count overflows", who);
    }
    int64_t bytes;
    if (!bie_mul_ok(numel, (int64_t)bie_dtype_size(dtype), &bytes))
        return bie_fail(BIE_ERR_OVERFLOW, "%s: byte count overflows", who);
    bie_tensor t;
    memset(&t, 0, sizeof t);
    t.data = data;
    t.dtype = dtype;
    t.ndim = ndim;
    for (int i = 0; i < ndim; i++) t.shape[i] = shape[i];
    t.device = bie_cpu();
    *out = t;
    return BIE_OK;
}

bie_status bie_tensor_view(bie_tensor *out, void *data, bie_dtype dtype, int ndim,
                           const int64_t *shape) {
    return describe(out, data, dtype, ndim, shape, "bie_tensor_view");
}

bie_status bie_tensor_alloc(bie_tensor *out, bie_dtype dtype, int ndim, const int64_t *shape) {
    bie_tensor t;
    BIE_TRY(describe(&t, NULL, dtype, ndim, shape, "bie_tensor_alloc"));
    size_t bytes = (size_t)bie_tensor_numel(&t) * bie_dtype_size(dtype);
    t.data = bie_alloc_aligned(bytes);
    if (t.data == NULL)
        return bie_fail(BIE_ERR_OUT_OF_MEMORY, "bie_tensor_alloc: %zu bytes", bytes);
    memset(t.data, 0, bytes);
    t.owns_data = true;
    *out = t;
    return BIE_OK;
}

void bie_tensor_free(bie_tensor *t) {
    if (t == NULL) return;
    if (t->owns_data) {
        const bie_device_iface *dev = bie_device_get(t->device.type);
        if (dev)
            dev->free_ptr(t->data);
        else
            bie_free_aligned(t->data);
    }
    memset(t, 0, sizeof *t);
}

int64_t bie_tensor_numel(const bie_tensor *t) {
    if (t == NULL || t->ndim < 1 || t->ndim > BIE_MAX_DIMS) return 0;
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++)
        if (!bie_mul_ok(n, t->shape[i], &n)) return -1;
    return n;
}
