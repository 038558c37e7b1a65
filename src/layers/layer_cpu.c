/* What every kind's CPU ops table shares (layer_cpu.h): the device check, set_activation's
 * work, checking a kernel id, select_gemm_kernel, which times every available kernel of the
 * layer's op on its GEMM shape and keeps the fastest, and the 4-bit layers' training state. */
#include <math.h>
#include <time.h>

#include "../cpu/dispatch.h"
#include "../cpu/frame/pack.h"
#include "layer_cpu.h"

static bie_status on_device(const bie_layer *l, const bie_tensor *t, const char *what,
                            const char *who, bie_tensor *host) {
    (void)l;
    if (t->device.type != BIE_DEVICE_CPU)
        return bie_fail(BIE_ERR_DEVICE, "%s: %s is not on the CPU", who, what);
    *host = *t;
    return BIE_OK;
}

static bie_status activate(bie_layer *l, const bie_tensor *x, bie_tensor *x_out, const char *who) {
    (void)who;
    float scale = 0;
    BIE_TRY(bie_layer_activation_scale(l, x, &scale));
    l->scale_a = scale;
    if (x_out == NULL) return BIE_OK;
    /* bias_a per feature (the last extent) or per channel (planes of H W) */
    const int64_t n = bie_tensor_numel(x), run = l->kind->conv ? x->shape[2] * x->shape[3] : 1;
    const float *src = x->data;
    float *dst = x_out->data;
    for (int64_t i = 0; i < n; i++) dst[i] = src[i] + l->bias_a[(i / run) % l->in];
    return BIE_OK;
}

static bie_status check_kernel(const bie_layer *l, int id, const char *who) {
    const bie_cpu_kernel *kern = bie_cpu_kernel_by_id(id);
    const char *op = l->kind->op == BIE_OP_BINARY_GEMM ? "binary" : "4-bit";
    bie_kernel_info info;
    if (kern == NULL && bie_kernel_find(id, &info) == BIE_OK)
        return bie_fail(BIE_ERR_DEVICE, "%s: kernel %d (%s) runs on CUDA; this layer is on the CPU",
                        who, id, info.name);
    if (kern == NULL || kern->op != l->kind->op)
        return bie_fail(BIE_ERR_INVALID_ARGUMENT,
                        "%s: no %s GEMM kernel with id %d (see "
                        "bie_kernel_get for the list)",
                        who, op, id);
    if (!bie_cpu_kernel_available(kern))
        return bie_fail(BIE_ERR_UNSUPPORTED,
                        "%s: kernel %d (%s) is not available on this CPU or is "
                        "excluded by BIE_CPU_KERNELS",
                        who, id, kern->name);
    return BIE_OK;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* One run of kernel `kern` on the (m, n, k) operands in ws (a then b, rows of `ld` bytes or
 * codes). */
static bie_status run_once(const bie_cpu_kernel *kern, int64_t m, int64_t n, int64_t k,
                           const uint8_t *a, const uint8_t *b, int64_t ld, float *out) {
    if (kern->op == BIE_OP_BINARY_GEMM)
        return bie_cpu_bgemm(kern, m, n, k, a, ld, b, ld, 1.0f, out);
    return bie_q4_gemm(kern->id, m, n, k, (const int8_t *)a, ld, (const int8_t *)b, ld, 1.0f, out);
}

/* Best of a few runs (at least 3, up to about 50 ms). */
static bie_status time_kernel(const bie_cpu_kernel *kern, int64_t m, int64_t n, int64_t k,
                              const uint8_t *a, const uint8_t *b, int64_t ld, float *out,
                              double *best) {
    *best = 1e30;
    double start = now_s();
    for (int rep = 0; rep < 20 && (rep < 3 || now_s() - start < 0.05); rep++) {
        double t0 = now_s();
        BIE_TRY(run_once(kern, m, n, k, a, b, ld, out));
        double dt = now_s() - t0;
        if (dt < *best) *best = dt;
    }
    return BIE_OK;
}

/* Fastest available CPU kernel of `op` for an (m, n, k) GEMM, timed on random operands. */
static bie_status select_for_shape(bie_op op, int64_t m, int64_t n, int64_t k, int *id_out) {
    const int64_t ld = op == BIE_OP_BINARY_GEMM ? (k + 7) / 8 : k;
    uint8_t *a = bie_alloc_aligned((size_t)(m * ld)), *b = bie_alloc_aligned((size_t)(n * ld));
    float *out = bie_alloc_aligned((size_t)(m * n) * sizeof(float));
    bie_status st = BIE_OK;
    if (!a || !b || !out) {
        st = bie_fail(BIE_ERR_OUT_OF_MEMORY, "select_gemm_kernel: workspace");
        goto done;
    }
    /* Random operands (4-bit: codes in [-8, 7]): the timing does not depend on the values,
     * but zeros would hide nothing. */
    uint64_t s = 0x1234567ull;
    for (int64_t i = 0; i < (m + n) * ld; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        uint8_t v = (uint8_t)(s >> 56);
        if (op == BIE_OP_Q4_GEMM) v = (uint8_t)(int8_t)((int)(v & 15) - 8);
        (i < m * ld ? a : b)[i < m * ld ? i : i - m * ld] = v;
    }
    const bie_cpu_kernel *fallback = bie_cpu_default_kernel_for(op, m);
    int best_id = -1;
    double best_t = 1e30;
    for (int i = 0; i < bie_cpu_kernel_count(); i++) {
        const bie_cpu_kernel *kern = bie_cpu_kernel_at(i);
        /* The scalar reference is for testing; it runs only when nothing else may. */
        if (kern->op != op || !bie_cpu_kernel_available(kern) ||
            (kern->isa == BIE_ISA_SCALAR && fallback->isa != BIE_ISA_SCALAR))
            continue;
        double t;
        if ((st = time_kernel(kern, m, n, k, a, b, ld, out, &t)) != BIE_OK) goto done;
        if (t < best_t) {
            best_t = t;
            best_id = kern->id;
        }
    }
    *id_out = best_id >= 0 ? best_id : fallback->id;
done:
    bie_free_aligned(a);
    bie_free_aligned(b);
    bie_free_aligned(out);
    return st;
}

static bie_status select_kernel(bie_layer *l, const bie_tensor *x, int *id) {
    int64_t m, n;
    if (l->kind->conv) { /* the conv's GEMM: weights (out_c rows) against one image's pixels */
        const bie_conv_geom g = bie_layer_conv_geom(l, x);
        m = l->out;
        n = g.oh * g.ow;
    } else {
        m = bie_tensor_numel(x) / x->shape[x->ndim - 1];
        n = l->out;
    }
    return select_for_shape(l->kind->op, m, n, l->fan_in, id);
}

bool bie_q4_state_alloc(bie_q4_state *s, int64_t n, bool keep) {
    s->nib = keep ? bie_alloc_aligned((size_t)bie_nibble_row_bytes(n)) : NULL;
    s->mask = keep ? bie_alloc_aligned((size_t)((n + 7) / 8)) : NULL;
    s->resid = keep ? bie_alloc_aligned((size_t)n) : NULL;
    return !keep || (s->nib && s->mask && s->resid);
}

void bie_q4_state_keep(bie_layer *l, bie_q4_state *s, const int8_t *codes, int64_t n,
                       int8_t **wcodes, float scale_a) {
    bie_q4_pack_nibbles(codes, 1, n, s->nib);
    bie_layer_drop_saved(l);
    l->saved_codes = s->nib;
    l->saved_mask = s->mask;
    l->saved_resid = s->resid;
    l->saved_wcodes = *wcodes; /* training codes come from the float weight: owned */
    l->saved_scale_a = scale_a;
    l->saved_scale_w = l->qw.scale_w;
    l->has_saved = true;
    s->nib = s->mask = NULL;
    s->resid = *wcodes = NULL;
}

void bie_q4_state_free(bie_q4_state *s) {
    bie_free_aligned(s->nib);
    bie_free_aligned(s->mask);
    bie_free_aligned(s->resid);
}

void bie_q4_state_grads(bie_layer *l, float *gx, int64_t n, int64_t run, int64_t len, float *gw,
                        float *gb, double *sums) {
    for (int64_t c = 0; c < len; c++) sums[c] = 0;
    double dscale = 0;
    for (int64_t b = 0, i = 0; b < n / run; b++) {
        double *sum = &sums[b % len];
        for (int64_t j = 0; j < run; j++, i++) {
            const float v = bie_bit(l->saved_mask, i) ? gx[i] : 0.0f;
            gx[i] = v;
            dscale += (double)v * (double)l->saved_resid[i] / 254.0;
            *sum += v;
        }
    }
    for (int64_t c = 0; c < len; c++) gb[c] = (float)sums[c];
    bie_grads_install(&l->grads, gw, NULL, gb, (float)(dscale / sqrt((double)n * 7.0)));
}

const bie_device_ops bie_cpu_device_ops = {
    .on_device = on_device,
    .activate = activate,
    .check_kernel = check_kernel,
    .select_kernel = select_kernel,
};
