/* Softmax cross-entropy, argmax and accuracy on [N, C] logits. */
#include <math.h>
#include <string.h>

#include "train_internal.h"
#ifdef BIE_HAVE_CUDA
#include "bie_cuda.h"
#include "train_cuda.h"
#endif

bie_status bie_train_check_f32(const bie_tensor *t, const char *what, const char *who) {
    if (t == NULL) return bie_fail(BIE_ERR_NULL_POINTER, "%s: %s is NULL", who, what);
    if (t->device.type != BIE_DEVICE_CPU)
        return bie_fail(BIE_ERR_DEVICE, "%s: %s must be a CPU tensor", who, what);
    if (t->dtype != BIE_F32)
        return bie_fail(BIE_ERR_DTYPE, "%s: %s must be F32, not %s", who, what,
                        bie_dtype_name(t->dtype));
    if (t->ndim < 1 || t->ndim > BIE_MAX_DIMS || bie_tensor_numel(t) < 1)
        return bie_fail(BIE_ERR_SHAPE, "%s: %s must be a non-empty tensor of rank 1..%d", who, what,
                        BIE_MAX_DIMS);
    if (t->data == NULL) return bie_fail(BIE_ERR_NULL_POINTER, "%s: %s has no data", who, what);
    return BIE_OK;
}

bool bie_train_same_shape(const bie_tensor *a, const bie_tensor *b) {
    if (a->ndim != b->ndim) return false;
    for (int d = 0; d < a->ndim; d++)
        if (a->shape[d] != b->shape[d]) return false;
    return true;
}

/* logits [N, C] F32 and, when given, labels [N] I32 with values in [0, C). */
static bie_status check_logits(const bie_tensor *logits, const bie_tensor *labels,
                               const char *who) {
    BIE_TRY(bie_train_check_f32(logits, "logits", who));
    if (logits->ndim != 2)
        return bie_fail(BIE_ERR_SHAPE, "%s: logits must be [N, C], got rank %d", who, logits->ndim);
    if (labels == NULL) return BIE_OK;
    if (labels->device.type != BIE_DEVICE_CPU)
        return bie_fail(BIE_ERR_DEVICE, "%s: labels must be a CPU tensor", who);
    if (labels->dtype != BIE_I32)
        return bie_fail(BIE_ERR_DTYPE, "%s: labels must be I32, not %s", who,
                        bie_dtype_name(labels->dtype));
    if (labels->ndim != 1 || labels->shape[0] != logits->shape[0])
        return bie_fail(BIE_ERR_SHAPE, "%s: labels must be [%lld] (one per logits row)", who,
                        (long long)logits->shape[0]);
    if (labels->data == NULL) return bie_fail(BIE_ERR_NULL_POINTER, "%s: labels has no data", who);
    const int32_t *lab = labels->data;
    for (int64_t i = 0; i < labels->shape[0]; i++)
        if (lab[i] < 0 || lab[i] >= logits->shape[1])
            return bie_fail(BIE_ERR_INVALID_ARGUMENT, "%s: label %lld is %d, outside [0, %lld)",
                            who, (long long)i, lab[i], (long long)logits->shape[1]);
    return BIE_OK;
}

/* Row zi [c] of a batch of n with its label: returns logsumexp(zi) - zi[label] and, when gi is
 * not NULL, writes (softmax(zi) - onehot(label)) / n to it (gi may be zi: each entry is read
 * before it is written). In double, rows in order: the loss has one summation order. */
static double cross_entropy_row(const float *zi, int64_t c, int32_t label, int64_t n, float *gi) {
    double mx = zi[0];
    for (int64_t j = 1; j < c; j++) mx = zi[j] > mx ? zi[j] : mx;
    double se = 0;
    for (int64_t j = 0; j < c; j++) se += exp((double)zi[j] - mx);
    const double lse = mx + log(se), row_loss = lse - zi[label];
    if (gi)
        for (int64_t j = 0; j < c; j++) {
            double p = exp((double)zi[j] - lse);
            gi[j] = (float)((p - (j == label ? 1.0 : 0.0)) / (double)n);
        }
    return row_loss;
}

bie_status bie_softmax_cross_entropy(const bie_tensor *logits, const bie_tensor *labels,
                                     float *loss, bie_tensor *grad_logits) {
    static const char *who = "softmax_cross_entropy";
    BIE_CHECK_NULL(labels);
    BIE_CHECK_NULL(loss);
    BIE_TRY(check_logits(logits, labels, who));
    if (grad_logits) {
        BIE_TRY(bie_train_check_f32(grad_logits, "grad_logits", who));
        if (!bie_train_same_shape(grad_logits, logits))
            return bie_fail(BIE_ERR_SHAPE, "%s: grad_logits must have the logits' shape", who);
    }
    const int64_t n = logits->shape[0], c = logits->shape[1];
    const float *z = logits->data;
    const int32_t *lab = labels->data;
    for (int64_t i = 0; i < n * c; i++)
        if (!isfinite(z[i]))
            return bie_fail(BIE_ERR_NOT_FINITE, "%s: logits hold a non-finite value", who);
    /* Sequential over rows: the loss sum has one order; N * C is small next to the network. */
    double total = 0;
    for (int64_t i = 0; i < n; i++) /* the gradient may alias the logits */
        total += cross_entropy_row(z + i * c, c, lab[i], n,
                                   grad_logits ? (float *)grad_logits->data + i * c : NULL);
    *loss = (float)(total / (double)n);
    return BIE_OK;
}

/* sums: F64 [3] on the logits' device. */
static bie_status check_sums(const bie_tensor *sums, const bie_tensor *logits, const char *who) {
    BIE_CHECK_NULL(sums);
    if (sums->device.type != logits->device.type || sums->device.index != logits->device.index)
        return bie_fail(BIE_ERR_DEVICE, "%s: sums must be on the logits' device", who);
    if (sums->dtype != BIE_F64)
        return bie_fail(BIE_ERR_DTYPE, "%s: sums must be F64, not %s", who,
                        bie_dtype_name(sums->dtype));
    if (sums->ndim != 1 || sums->shape[0] != 3)
        return bie_fail(BIE_ERR_SHAPE, "%s: sums must be [3]", who);
    if (sums->data == NULL) return bie_fail(BIE_ERR_NULL_POINTER, "%s: sums has no data", who);
    return BIE_OK;
}

/* The checks of bie_softmax_cross_entropy for tensors that may live on a device: the shapes
 * and dtypes as there; labels on the CPU are range-checked here. */
static bie_status check_accumulate(const bie_tensor *logits, const bie_tensor *labels,
                                   const bie_tensor *grad, const bie_tensor *sums,
                                   const char *who) {
    BIE_CHECK_NULL(logits);
    BIE_CHECK_NULL(labels);
    BIE_CHECK_NULL(grad);
    const bool on_cpu = logits->device.type == BIE_DEVICE_CPU;
#ifdef BIE_HAVE_CUDA
    if (!on_cpu && (logits->device.type != BIE_DEVICE_CUDA || logits->device.index < 0 ||
                    logits->device.index >= bie_cuda_device_count()))
        return bie_fail(BIE_ERR_DEVICE, "%s: logits must be on the CPU or an available GPU", who);
#else
    if (!on_cpu) return bie_fail(BIE_ERR_DEVICE, "%s: logits must be a CPU tensor", who);
#endif
    bie_tensor z = *logits, g = *grad; /* the CPU checks of the plain loss */
    if (!on_cpu) {
        if (grad->device.type != logits->device.type || grad->device.index != logits->device.index)
            return bie_fail(BIE_ERR_DEVICE, "%s: grad_logits must be on the logits' device", who);
        if (labels->device.type != BIE_DEVICE_CPU && (labels->device.type != logits->device.type ||
                                                      labels->device.index != logits->device.index))
            return bie_fail(BIE_ERR_DEVICE, "%s: labels must be on the CPU or the logits' device",
                            who);
        z.device = g.device = bie_cpu();
    }
    const bool host_labels = labels->device.type == BIE_DEVICE_CPU;
    if (on_cpu && !host_labels)
        return bie_fail(BIE_ERR_DEVICE, "%s: labels must be a CPU tensor, as the logits are", who);
    bie_status st = check_logits(&z, host_labels ? labels : NULL, who);
    if (st == BIE_OK && !host_labels) { /* values on the device: counted there */
        if (labels->dtype != BIE_I32)
            st = bie_fail(BIE_ERR_DTYPE, "%s: labels must be I32, not %s", who,
                          bie_dtype_name(labels->dtype));
        else if (labels->ndim != 1 || labels->shape[0] != z.shape[0])
            st = bie_fail(BIE_ERR_SHAPE, "%s: labels must be [%lld] (one per logits row)", who,
                          (long long)z.shape[0]);
        else if (labels->data == NULL)
            st = bie_fail(BIE_ERR_NULL_POINTER, "%s: labels has no data", who);
    }
    if (st == BIE_OK) st = bie_train_check_f32(&g, "grad_logits", who);
    if (st == BIE_OK && !bie_train_same_shape(&g, &z))
        st = bie_fail(BIE_ERR_SHAPE, "%s: grad_logits must have the logits' shape", who);
    if (st == BIE_OK) st = check_sums(sums, logits, who);
    return st;
}

bie_status bie_softmax_cross_entropy_accumulate(const bie_tensor *logits, const bie_tensor *labels,
                                                bie_tensor *grad_logits, bie_tensor *sums) {
    static const char *who = "softmax_cross_entropy_accumulate";
    BIE_TRY(check_accumulate(logits, labels, grad_logits, sums, who));
    const int64_t n = logits->shape[0], c = logits->shape[1];
#ifdef BIE_HAVE_CUDA
    if (logits->device.type == BIE_DEVICE_CUDA) {
        int previous = 0;
        BIE_TRY(bie_cuda_train_set_device(logits->device.index, &previous));
        bie_status st = bie_cuda_softmax_ce_accumulate(logits->data, labels->data,
                                                       labels->device.type == BIE_DEVICE_CPU, n, c,
                                                       grad_logits->data, sums->data);
        bie_cuda_train_set_device(previous, NULL);
        return st;
    }
#endif
    const float *z = logits->data;
    const int32_t *lab = labels->data;
    float *grad = grad_logits->data;
    double loss = 0, hits = 0, bad = 0;
    for (int64_t i = 0; i < n; i++) {
        const float *zi = z + i * c;
        float *gi = grad + i * c;
        bool finite = true;
        int64_t best = 0;
        for (int64_t j = 0; j < c; j++) {
            finite = finite && isfinite(zi[j]);
            if (zi[j] > zi[best]) best = j;
        }
        if (!finite) {
            memset(gi, 0, (size_t)c * sizeof(float));
            bad += 1;
            continue;
        }
        loss += cross_entropy_row(zi, c, lab[i], n, gi);
        hits += best == lab[i];
    }
    double *s = sums->data;
    s[0] += loss, s[1] += hits, s[2] += bad;
    return BIE_OK;
}

static void row_argmax(const float *z, int64_t n, int64_t c, int32_t *out) {
    for (int64_t i = 0; i < n; i++) {
        int64_t best = 0;
        for (int64_t j = 1; j < c; j++)
            if (z[i * c + j] > z[i * c + best]) best = j;
        out[i] = (int32_t)best;
    }
}

bie_status bie_argmax(const bie_tensor *logits, bie_tensor *predictions) {
    static const char *who = "argmax";
    BIE_CHECK_NULL(predictions);
    BIE_TRY(check_logits(logits, NULL, who));
    if (predictions->device.type != BIE_DEVICE_CPU || predictions->dtype != BIE_I32 ||
        predictions->ndim != 1 || predictions->shape[0] != logits->shape[0] ||
        predictions->data == NULL)
        return bie_fail(BIE_ERR_SHAPE, "%s: predictions must be an I32 CPU tensor [%lld]", who,
                        (long long)logits->shape[0]);
    if (logits->shape[1] > INT32_MAX)
        return bie_fail(BIE_ERR_OVERFLOW, "%s: too many classes for I32 predictions", who);
    row_argmax(logits->data, logits->shape[0], logits->shape[1], predictions->data);
    return BIE_OK;
}

bie_status bie_count_correct(const bie_tensor *logits, const bie_tensor *labels, int64_t *correct) {
    static const char *who = "count_correct";
    BIE_CHECK_NULL(labels);
    BIE_CHECK_NULL(correct);
    BIE_TRY(check_logits(logits, labels, who));
    const int64_t n = logits->shape[0], c = logits->shape[1];
    const float *z = logits->data;
    const int32_t *lab = labels->data;
    int64_t hits = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t best = 0;
        for (int64_t j = 1; j < c; j++)
            if (z[i * c + j] > z[i * c + best]) best = j;
        hits += best == lab[i];
    }
    *correct = hits;
    return BIE_OK;
}
