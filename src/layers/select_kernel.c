/* select_gemm_kernel: time every available kernel on the layer's shape, keep the fastest. */
#include <time.h>

#include "../cpu/dispatch.h"
#include "binary_conv2d_impl.h"
#include "binary_conv2d_cuda.h"
#include "binary_linear_cuda.h"
#include "binary_linear_impl.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Best of a few runs (at least 3, up to about 50 ms). */
static bie_status time_kernel(const bie_cpu_kernel *kern, int64_t m, int64_t n, int64_t k,
                              const uint8_t *a, const uint8_t *b, int64_t rb, float *out,
                              double *best) {
    *best = 1e30;
    double start = now_s();
    for (int rep = 0; rep < 20 && (rep < 3 || now_s() - start < 0.05); rep++) {
        double t0 = now_s();
        BIE_TRY(bie_cpu_bgemm(kern, m, n, k, a, rb, b, rb, 1.0f, out));
        double dt = now_s() - t0;
        if (dt < *best) *best = dt;
    }
    return BIE_OK;
}

/* Fastest available CPU kernel for an (m, n, k) binary GEMM, timed on random bits. */
static bie_status select_for_shape(int64_t m, int64_t n, int64_t k, int *id_out) {
    const int64_t rb = (k + 7) / 8;
    uint8_t *a = bie_alloc_aligned((size_t)(m * rb)), *b = bie_alloc_aligned((size_t)(n * rb));
    float *out = bie_alloc_aligned((size_t)(m * n) * sizeof(float));
    bie_status st = BIE_OK;
    if (!a || !b || !out) {
        st = bie_fail(BIE_ERR_OUT_OF_MEMORY, "select_gemm_kernel: workspace");
        goto done;
    }
    /* Random bits: the timing does not depend on the values, but zeros would hide nothing. */
    uint64_t s = 0x1234567ull;
    for (int64_t i = 0; i < m * rb; i++) a[i] = (uint8_t)((s = s * 6364136223846793005ull + 1442695040888963407ull) >> 56);
    for (int64_t i = 0; i < n * rb; i++) b[i] = (uint8_t)((s = s * 6364136223846793005ull + 1442695040888963407ull) >> 56);
    int best_id = -1;
    double best_t = 1e30;
    for (int i = 0; i < bie_cpu_kernel_count(); i++) {
        const bie_cpu_kernel *kern = bie_cpu_kernel_at(i);
        /* The scalar reference is for testing; it runs only when nothing else may. */
        if (kern->op != BIE_OP_BINARY_GEMM || !bie_cpu_kernel_available(kern) ||
            (kern->isa == BIE_ISA_SCALAR && bie_cpu_default_kernel(m)->isa != BIE_ISA_SCALAR))
            continue;
        double t;
        if ((st = time_kernel(kern, m, n, k, a, b, rb, out, &t)) != BIE_OK) goto done;
        if (t < best_t) {
            best_t = t;
            best_id = kern->id;
        }
    }
    *id_out = best_id >= 0 ? best_id : bie_cpu_default_kernel(m)->id;
done:
    bie_free_aligned(a);
    bie_free_aligned(b);
    bie_free_aligned(out);
    return st;
}

bie_status bie_binary_linear_select_gemm_kernel(bie_binary_linear *l, const bie_tensor *x) {
    if (l == NULL) return bie_fail(BIE_ERR_NULL_POINTER, "select_gemm_kernel: layer is NULL");
    BIE_ON_CUDA(l, bie_blc_select_kernel(l, x));
    BIE_TRY(bie_binary_linear_check_forward(l, x));
    int id = -1;
    BIE_TRY(select_for_shape(bie_tensor_numel(x) / x->shape[x->ndim - 1], l->out, l->in, &id));
    l->kernel_id = id;
    return BIE_OK;
}

bie_status bie_binary_conv2d_select_gemm_kernel(bie_binary_conv2d *l, const bie_tensor *x) {
    if (l == NULL) return bie_fail(BIE_ERR_NULL_POINTER, "select_gemm_kernel: layer is NULL");
    BIE_ON_CUDA(l, bie_bcc_select_kernel(l, x));
    BIE_TRY(bie_binary_conv2d_check_forward(l, x));
    int64_t oh, ow;
    BIE_TRY(bie_binary_conv2d_output_size(l, x->shape[2], x->shape[3], &oh, &ow));
    int id = -1; /* the conv's GEMM: weights (out_c rows) against the pixels of one image */
    BIE_TRY(select_for_shape(l->out_c, oh * ow, l->in_c * l->k * l->k, &id));
    return bie_binary_conv2d_set_gemm_kernel(l, id);
}

bie_status bie_binary_linear_set_gemm_kernel(bie_binary_linear *l, int id) {
    if (l == NULL) return bie_fail(BIE_ERR_NULL_POINTER, "set_gemm_kernel: layer is NULL");
    BIE_ON_CUDA(l, bie_blc_set_kernel(l, id));
    if (id == -1) {
        l->kernel_id = -1;
        return BIE_OK;
    }
    const bie_cpu_kernel *kern = bie_cpu_kernel_by_id(id);
    bie_kernel_info info;
    if (kern == NULL && bie_kernel_find(id, &info) == BIE_OK)
        return bie_fail(BIE_ERR_DEVICE, "set_gemm_kernel: kernel %d (%s) runs on CUDA; this layer "
                        "is on the CPU", id, info.name);
    if (kern == NULL || kern->op != BIE_OP_BINARY_GEMM)
        return bie_fail(BIE_ERR_INVALID_ARGUMENT, "set_gemm_kernel: no binary GEMM kernel with id %d "
                        "(see bie_kernel_get for the list)", id);
    if (!bie_cpu_kernel_available(kern))
        return bie_fail(BIE_ERR_UNSUPPORTED, "set_gemm_kernel: kernel %d (%s) is not available on "
                        "this CPU or is excluded by BIE_CPU_KERNELS", id, kern->name);
    l->kernel_id = id;
    return BIE_OK;
}

int bie_binary_linear_gemm_kernel(const bie_binary_linear *l) { return l ? l->kernel_id : -1; }
