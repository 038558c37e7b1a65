/* The 4-bit weight of a layer on CUDA: see q4_weight_cuda.h. */
#include "q4_weight_cuda.h"

#include "../cuda/cuda_internal.h"

static size_t weight_count(const bie_cuda_bw *d) { return (size_t)(d->rows * d->cols); }
static size_t qweight_bytes(const bie_cuda_bw *d) {
    return (size_t)(d->rows * bie_nibble_row_bytes(d->cols));
}

/* ---------------------------------------------------------------- host staging */

/* Copy the device weight and scale_w into the host's (empty) buffers. */
static bie_status stage_down(bie_cuda_bw *d, bie_q4_weight *w) {
    const size_t n = weight_count(d), qb = qweight_bytes(d);
    bie_status st = BIE_OK;
    if (d->w_f32 && (w->f32 = bie_alloc_aligned(n * sizeof(float))) == NULL) goto oom;
    if (d->qweight && (w->qweight = bie_alloc_aligned(qb)) == NULL) goto oom;
    if ((st = bie_cbw_copy_sync(&w->scale_w, d->scalars + BIE_CBW_SCALE_W, sizeof(float), d->module,
                                "scale_w to host")) != BIE_OK)
        goto fail;
    if (d->w_f32 && (st = bie_cbw_copy_sync(w->f32, d->w_f32, n * sizeof(float), d->module,
                                            "weight to host")) != BIE_OK)
        goto fail;
    if (d->qweight && (st = bie_cbw_copy_sync(w->qweight, d->qweight, qb, d->module,
                                              "qweight to host")) != BIE_OK)
        goto fail;
    return BIE_OK;
oom:
    st = bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: host staging of the weight", d->module);
fail:
    bie_q4w_free(w);
    return st;
}

/* Upload the host's buffers and scale_w as the new device weight; the host's buffers are
 * freed either way. */
static bie_status stage_up(bie_cuda_bw *d, bie_q4_weight *w) {
    void *f32 = NULL, *q = NULL;
    bie_status st;
    if ((st = bie_cbw_upload(d, &f32, w->f32, weight_count(d) * sizeof(float), "weight upload")) !=
            BIE_OK ||
        (st = bie_cbw_upload(d, &q, w->qweight, qweight_bytes(d), "qweight upload")) != BIE_OK ||
        (st = bie_cbw_copy_sync(d->scalars + BIE_CBW_SCALE_W, &w->scale_w, sizeof(float), d->module,
                                "scale_w upload")) != BIE_OK) {
        bie_cbw_free_ptr(f32);
        bie_cbw_free_ptr(q);
        bie_q4w_free(w);
        return st;
    }
    bie_cbw_free_ptr(d->w_f32);
    bie_cbw_free_ptr(d->qweight);
    d->w_f32 = f32;
    d->qweight = q;
    d->version++;
    bie_q4w_free(w);
    return BIE_OK;
}

/* After a host operation on the staged weight: upload on success, drop the staging otherwise. */
static bie_status staged(bie_cuda_bw *d, bie_q4_weight *w, bie_status st) {
    if (st != BIE_OK) {
        bie_q4w_free(w);
        return st;
    }
    return stage_up(d, w);
}

bie_status bie_cq4w_reset(bie_cuda_bw *d, bie_q4_weight *w, uint64_t seed) {
    /* a fresh float weight, no qweight; scale_w stays */
    BIE_TRY(bie_cbw_copy_sync(&w->scale_w, d->scalars + BIE_CBW_SCALE_W, sizeof(float), d->module,
                              "scale_w to host"));
    return staged(d, w, bie_q4w_reset(w, seed));
}

bie_status bie_cq4w_prepare(bie_cuda_bw *d, bie_q4_weight *w, const char *who) {
    if (d->w_f32 == NULL) return bie_bw_no_weight(who);
    BIE_TRY(stage_down(d, w));
    return staged(d, w, bie_q4w_prepare(w, who));
}

bie_status bie_cq4w_set_weight_data(bie_cuda_bw *d, bie_q4_weight *w, bie_dtype dtype,
                                    const bie_tensor *t, const char *who) {
    float *host = bie_alloc_aligned(weight_count(d) * sizeof(float));
    if (host == NULL) return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: host staging", who);
    bie_status st = bie_cbw_to_host_f32(d, dtype, t->data, weight_count(d), host);
    if (st == BIE_OK)
        st = staged(d, w, bie_q4w_set_data(w, host, who)); /* replaces weight and qweight */
    bie_free_aligned(host);
    return st;
}

bie_status bie_cq4w_generate_qweight(bie_cuda_bw *d, bie_q4_weight *w, bool qweight_only,
                                     const char *who) {
    if (d->w_f32 == NULL) return d->qweight ? BIE_OK : bie_bw_no_weight(who);
    BIE_TRY(stage_down(d, w));
    return staged(d, w, bie_q4w_generate_qweight(w, qweight_only, who));
}

bie_status bie_cq4w_set_qweight(bie_cuda_bw *d, bie_q4_weight *w, const bie_tensor *q,
                                const char *who) {
    const size_t qb = qweight_bytes(d);
    uint8_t *host = bie_alloc_aligned(qb);
    if (host == NULL) return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: host staging", who);
    bie_status st = bie_cbw_copy_sync(host, q->data, qb, d->module, "qweight to host");
    if (st == BIE_OK && (st = stage_down(d, w)) == BIE_OK)
        st = staged(d, w, bie_q4w_set_qweight(w, host, who));
    bie_free_aligned(host);
    return st;
}

/* ---------------------------------------------------------------- views and kernels */

bie_status bie_cq4w_param(bie_cuda_bw *d, bie_param which, int wndim, const int64_t *wshape,
                          bie_tensor *v) {
    if (which != BIE_PARAM_QWEIGHT) return bie_cbw_param_common(d, which, wndim, wshape, v);
    if (d->qweight == NULL)
        return bie_fail(BIE_ERR_STATE, "%s: no qweight yet (generate_quantized_weight)", d->module);
    const int64_t qshape[2] = {d->rows, bie_nibble_row_bytes(d->cols)};
    return bie_cbw_view(d->device, v, d->qweight, BIE_U8, 2, qshape);
}

bie_status bie_cq4w_check_kernel(int id, int64_t k, const char *who) {
    if (id == -1) return BIE_OK;
    bie_kernel_info info;
    if (bie_kernel_find(id, &info) != BIE_OK || info.op != BIE_OP_Q4_GEMM)
        return bie_fail(BIE_ERR_INVALID_ARGUMENT,
                        "%s: no 4-bit GEMM kernel with id %d (see "
                        "bie_kernel_get for the list)",
                        who, id);
    if (info.device != BIE_DEVICE_CUDA)
        return bie_fail(BIE_ERR_DEVICE, "%s: kernel %d (%s) runs on the CPU; this layer is on CUDA",
                        who, id, info.name);
    if (!bie_cuda_q4_kernel_fits(id, k))
        return bie_fail(BIE_ERR_UNSUPPORTED, "%s: kernel %d (%s) cannot run on this device", who,
                        id, info.name);
    return BIE_OK;
}
