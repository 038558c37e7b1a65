/* The device side of a binary layer on CUDA: see binary_weight_cuda.h. */
#include <cuda_runtime_api.h>

#include "../cuda/cuda_internal.h"
#include "bie_cuda.h"
#include "binary_weight_cuda.h"

static size_t weight_count(const bie_cuda_bw *d) { return (size_t)(d->rows * d->cols); }
static size_t qweight_bytes(const bie_cuda_bw *d, int word_bits) {
    return (size_t)d->rows * (size_t)bie_packed_row_bytes(d->cols, word_bits);
}

/* ---------------------------------------------------------------- host staging */

bie_status bie_cbw_stage_down(bie_cuda_bw *d, bie_binary_weight *w) {
    const size_t n = weight_count(d), qb = qweight_bytes(d, w->word_bits);
    bie_status st = BIE_OK;
    if (d->w_f32 && (w->f32 = bie_alloc_aligned(n * sizeof(float))) == NULL) goto oom;
    if (d->w_i8 && (w->i8 = bie_alloc_aligned(n)) == NULL) goto oom;
    if (d->qweight && (w->qweight = bie_alloc_aligned(qb)) == NULL) goto oom;
    if (d->w_f32 && (st = bie_cbw_copy_sync(w->f32, d->w_f32, n * sizeof(float), d->module,
                                            "weight to host")) != BIE_OK)
        goto fail;
    if (d->w_i8 &&
        (st = bie_cbw_copy_sync(w->i8, d->w_i8, n, d->module, "weight to host")) != BIE_OK)
        goto fail;
    if (d->qweight && (st = bie_cbw_copy_sync(w->qweight, d->qweight, qb, d->module,
                                              "qweight to host")) != BIE_OK)
        goto fail;
    /* scale_w too: users (and optimizers, and model loading) write it through its parameter
     * view, and stage_up uploads the host's value */
    if ((st = bie_cbw_copy_sync(&w->scale_w, d->scalars + BIE_CBW_SCALE_W, sizeof(float), d->module,
                                "scale_w to host")) != BIE_OK)
        goto fail;
    return BIE_OK;
oom:
    st = bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: host staging of the weight", d->module);
fail:
    bie_bw_free(w);
    return st;
}

bie_status bie_cbw_stage_up(bie_cuda_bw *d, bie_binary_weight *w) {
    const size_t n = weight_count(d);
    void *f32 = NULL, *i8 = NULL, *q = NULL;
    bie_status st;
    if ((st = bie_cbw_upload(d, &f32, w->f32, n * sizeof(float), "weight upload")) != BIE_OK ||
        (st = bie_cbw_upload(d, &i8, w->i8, n, "weight upload")) != BIE_OK ||
        (st = bie_cbw_upload(d, &q, w->qweight, qweight_bytes(d, w->word_bits),
                             "qweight upload")) != BIE_OK ||
        (st = bie_cbw_copy_sync(d->scalars + BIE_CBW_SCALE_W, &w->scale_w, sizeof(float), d->module,
                                "scale_w upload")) != BIE_OK) {
        bie_cbw_free_ptr(f32);
        bie_cbw_free_ptr(i8);
        bie_cbw_free_ptr(q);
        bie_bw_free(w);
        return st;
    }
    bie_cbw_free_ptr(d->w_f32);
    bie_cbw_free_ptr(d->w_i8);
    bie_cbw_free_ptr(d->qweight);
    d->w_f32 = f32;
    d->w_i8 = i8;
    d->qweight = q;
    d->version++;
    bie_bw_free(w);
    return BIE_OK;
}

/* After a host operation on the staged weight: upload on success, drop the staging otherwise. */
static bie_status staged(bie_cuda_bw *d, bie_binary_weight *w, bie_status st) {
    if (st != BIE_OK) {
        bie_bw_free(w);
        return st;
    }
    return bie_cbw_stage_up(d, w);
}

bie_status bie_cbw_reset(bie_cuda_bw *d, bie_binary_weight *w, uint64_t seed) {
    /* a fresh float weight; scale_w stays (the device's, which its view may have changed) */
    BIE_TRY(bie_cbw_copy_sync(&w->scale_w, d->scalars + BIE_CBW_SCALE_W, sizeof(float), d->module,
                              "scale_w to host"));
    return staged(d, w, bie_bw_reset(w, seed));
}

bie_status bie_cbw_prepare(bie_cuda_bw *d, bie_binary_weight *w, const char *who) {
    if (d->w_f32 == NULL) return d->w_i8 ? BIE_OK : bie_bw_no_weight(who); /* already int8 */
    BIE_TRY(bie_cbw_stage_down(d, w));
    return staged(d, w, bie_bw_prepare(w, who));
}

bie_status bie_cbw_set_weight_data(bie_cuda_bw *d, bie_binary_weight *w, bie_dtype dtype,
                                   const bie_tensor *t, const char *who) {
    float *host = bie_alloc_aligned(weight_count(d) * sizeof(float));
    if (host == NULL) return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: host staging", who);
    bie_status st = bie_cbw_to_host_f32(d, dtype, t->data, weight_count(d), host);
    if (st == BIE_OK) st = bie_cbw_stage_down(d, w);
    if (st == BIE_OK) st = staged(d, w, bie_bw_set_data(w, host, who));
    bie_free_aligned(host);
    return st;
}

bie_status bie_cbw_generate_qweight(bie_cuda_bw *d, bie_binary_weight *w, bool qweight_only,
                                    const char *who) {
    BIE_TRY(bie_cbw_stage_down(d, w));
    return staged(d, w, bie_bw_generate_qweight(w, qweight_only, who));
}

bie_status bie_cbw_set_qweight(bie_cuda_bw *d, bie_binary_weight *w, const bie_tensor *q,
                               const char *who) {
    const size_t qb = qweight_bytes(d, w->word_bits);
    void *host = bie_alloc_aligned(qb);
    if (host == NULL) return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: host staging", who);
    bie_status st = bie_cbw_copy_sync(host, q->data, qb, d->module, "qweight to host");
    if (st == BIE_OK && (st = bie_cbw_stage_down(d, w)) == BIE_OK)
        st = staged(d, w, bie_bw_set_qweight(w, host, who));
    bie_free_aligned(host);
    return st;
}

bie_status bie_cbw_set_bits(bie_cuda_bw *d, bie_binary_weight *w, int bits) {
    if (!bie_word_bits_ok(bits) || d->qweight == NULL)
        return bie_bw_set_word_bits(w, bits, d->module);
    BIE_TRY(bie_cbw_stage_down(d, w));
    return staged(d, w, bie_bw_set_word_bits(w, bits, d->module));
}

/* ---------------------------------------------------------------- views */

bie_status bie_cbw_param(bie_cuda_bw *d, const bie_binary_weight *w, bie_param which, int wndim,
                         const int64_t *wshape, bie_tensor *v) {
    if (which != BIE_PARAM_QWEIGHT) return bie_cbw_param_common(d, which, wndim, wshape, v);
    if (d->qweight == NULL)
        return bie_fail(BIE_ERR_STATE, "%s: no qweight yet (generate_quantized_weight)", d->module);
    const int64_t qshape[2] = {d->rows, bie_packed_words(d->cols, w->word_bits)};
    return bie_cbw_view(d->device, v, d->qweight, bie_bw_word_dtype(w->word_bits), 2, qshape);
}

/* ---------------------------------------------------------------- kernel choice */

bie_status bie_cbw_check_kernel(int id, int64_t ld, const char *who) {
    if (id == -1) return BIE_OK;
    bie_kernel_info info;
    if (bie_kernel_find(id, &info) != BIE_OK || info.op != BIE_OP_BINARY_GEMM)
        return bie_fail(BIE_ERR_INVALID_ARGUMENT,
                        "%s: no binary GEMM kernel with id %d (see "
                        "bie_kernel_get for the list)",
                        who, id);
    if (info.device != BIE_DEVICE_CUDA)
        return bie_fail(BIE_ERR_DEVICE, "%s: kernel %d (%s) runs on the CPU; this layer is on CUDA",
                        who, id, info.name);
    if (!bie_cuda_bgemm_kernel_fits_ld(id, ld))
        return bie_fail(BIE_ERR_UNSUPPORTED, "%s: kernel %d (%s) cannot run rows of %lld bytes",
                        who, id, info.name, (long long)ld);
    return BIE_OK;
}

static bie_status select_ok(cudaError_t err, const char *what) {
    return bie_cbw_cuda_ok(err, "select_gemm_kernel", what);
}

/* One launch of CUDA kernel `id` of `op` on the operands in ws (a: m rows, b: n rows of ld
 * bytes, then the popcounts of binary rows), writing float32 into out. */
static bie_status launch_one(bie_op op, int id, int64_t m, int64_t n, int64_t k, int64_t ld,
                             const uint8_t *ws, size_t bits, float *out) {
    const uint8_t *a = ws, *b = ws + m * ld;
    if (op == BIE_OP_Q4_GEMM)
        return bie_cuda_q4gemm_launch(id, m, n, k, a, b, ld, 1.0f, NULL, NULL, BIE_F32, out, NULL);
    const int64_t parts = bie_cuda_popc_parts(ld);
    const int *pa = (const int *)(ws + bits), *pb = pa + m * parts;
    return bie_cuda_bgemm_launch(id, m, n, k, a, b, ld, pa, (int)parts, pb, 1.0f, NULL, NULL,
                                 BIE_F32, out, NULL);
}

static bool fits(bie_op op, int id, int64_t k, int64_t ld) {
    return op == BIE_OP_Q4_GEMM ? bie_cuda_q4_kernel_fits(id, k)
                                : bie_cuda_bgemm_kernel_fits_ld(id, ld);
}

/* Times every CUDA kernel of `op` that fits the layer's shape (random operands, best of a
 * few launches measured with events) and keeps the fastest. */
bie_status bie_cbw_select_kernel(bie_op op, int64_t m, int64_t n, int64_t k, int64_t ld, int *id) {
    const int64_t parts = op == BIE_OP_BINARY_GEMM ? bie_cuda_popc_parts(ld) : 0;
    uint8_t *ws = NULL;
    const size_t bits = (size_t)((m + n) * ld), counts = (size_t)((m + n) * parts) * sizeof(int);
    const size_t outb = (size_t)(m * n) * sizeof(float);
    BIE_TRY(bie_cbw_alloc((void **)&ws, bits + counts + outb, "select_gemm_kernel", "workspace"));
    cudaEvent_t e0 = NULL, e1 = NULL;
    cudaStream_t stream = (cudaStream_t)bie_cuda_current_stream();
    bie_status st = select_ok(cudaMemset(ws, 0x5a, bits + counts), "select_gemm_kernel");
    if (st == BIE_OK) st = select_ok(cudaDeviceSynchronize(), "select_gemm_kernel");
    if (st == BIE_OK) st = select_ok(cudaEventCreate(&e0), "cudaEventCreate");
    if (st == BIE_OK) st = select_ok(cudaEventCreate(&e1), "cudaEventCreate");
    int best_id = -1;
    float best = 1e30f;
    const int count = bie_kernel_count();
    for (int i = 0; i < count && st == BIE_OK; i++) {
        bie_kernel_info info;
        if (bie_kernel_get(i, &info) != BIE_OK || info.device != BIE_DEVICE_CUDA || info.op != op ||
            !fits(op, info.id, k, ld))
            continue;
        float *out = (float *)(ws + bits + counts);
        float t_best = 1e30f;
        for (int rep = 0; rep < 4 && st == BIE_OK; rep++) { /* rep 0 warms up */
            cudaEventRecord(e0, stream);
            st = launch_one(op, info.id, m, n, k, ld, ws, bits, out);
            cudaEventRecord(e1, stream);
            if (st == BIE_OK) st = select_ok(cudaEventSynchronize(e1), "select_gemm_kernel");
            float ms = 0;
            if (st == BIE_OK && rep > 0 && cudaEventElapsedTime(&ms, e0, e1) == cudaSuccess &&
                ms < t_best)
                t_best = ms;
        }
        if (st == BIE_OK && t_best < best) {
            best = t_best;
            best_id = info.id;
        }
    }
    if (e0) cudaEventDestroy(e0);
    if (e1) cudaEventDestroy(e1);
    bie_cbw_free_ptr(ws);
    BIE_TRY(st);
    if (best_id < 0)
        return bie_fail(BIE_ERR_UNSUPPORTED, "select_gemm_kernel: no CUDA kernel fits this shape");
    *id = best_id;
    return BIE_OK;
}
