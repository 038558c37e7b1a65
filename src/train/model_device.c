/* Where a model runs: the float kernels and memory of each device (one table per device,
 * which the model's layers are written against), and moving a whole model between the CPU
 * and a CUDA device. */
#include <string.h>

#include "bie_cuda.h"
#include "train_internal.h"
#ifdef BIE_HAVE_CUDA
#include "train_cuda.h"
#endif

/* ---- the CPU: the kernels of float_layers.c / batchnorm.c, which cannot fail */

static bie_status cpu_linear_forward(const float *x, int64_t m, int64_t in, int64_t out,
                                     const float *w, const float *b, float *y) {
    bie_linear_forward(x, m, in, out, w, b, y);
    return BIE_OK;
}
static bie_status cpu_linear_backward(const float *x, const float *dy, int64_t m, int64_t in,
                                      int64_t out, const float *w, float *dx, float *dw,
                                      float *db) {
    bie_linear_backward(x, dy, m, in, out, w, dx, dw, db);
    return BIE_OK;
}
static bie_status cpu_relu_forward(const float *x, int64_t n, float *y) {
    bie_relu_forward(x, n, y);
    return BIE_OK;
}
static bie_status cpu_relu_backward(const float *y, const float *dy, int64_t n, float *dx) {
    bie_relu_backward(y, dy, n, dx);
    return BIE_OK;
}
static bie_status cpu_prelu_forward(const float *x, int64_t outer, int64_t channels, int64_t inner,
                                    const float *slopes, int64_t n_slopes, float *y) {
    bie_prelu_forward(x, outer, channels, inner, slopes, n_slopes, y);
    return BIE_OK;
}
static bie_status cpu_prelu_backward(const float *x, const float *dy, int64_t outer,
                                     int64_t channels, int64_t inner, const float *slopes,
                                     int64_t n_slopes, float *dx, float *dslopes) {
    bie_prelu_backward(x, dy, outer, channels, inner, slopes, n_slopes, dx, dslopes);
    return BIE_OK;
}
static bie_status cpu_maxpool_forward(const float *x, int64_t planes, int64_t h, int64_t w, int k,
                                      int s, int64_t oh, int64_t ow, float *y, int32_t *argmax) {
    bie_maxpool_forward(x, planes, h, w, k, s, oh, ow, y, argmax);
    return BIE_OK;
}
static bie_status cpu_maxpool_backward(const float *dy, const int32_t *argmax, int64_t planes,
                                       int64_t h, int64_t w, int64_t oh, int64_t ow, float *dx) {
    bie_maxpool_backward(dy, argmax, planes, h, w, oh, ow, dx);
    return BIE_OK;
}
static bie_status cpu_bn_train(const float *x, int64_t n, int64_t c, int64_t inner,
                               const float *gamma, const float *beta, float eps, float *y,
                               float *xhat, float *invstd, float *mean, float *var) {
    bie_batchnorm_forward_train(x, n, c, inner, gamma, beta, eps, y, xhat, invstd, mean, var);
    return BIE_OK;
}
static bie_status cpu_bn_running(int64_t c, float momentum, const float *mean, const float *var,
                                 float *running_mean, float *running_var) {
    bie_batchnorm_update_running(c, momentum, mean, var, running_mean, running_var);
    return BIE_OK;
}
static bie_status cpu_bn_eval(const float *x, int64_t n, int64_t c, int64_t inner,
                              const float *gamma, const float *beta, float eps,
                              const float *running_mean, const float *running_var, float *y) {
    bie_batchnorm_forward_eval(x, n, c, inner, gamma, beta, eps, running_mean, running_var, y);
    return BIE_OK;
}
static bie_status cpu_bn_backward(const float *xhat, const float *invstd, const float *dy,
                                  int64_t n, int64_t c, int64_t inner, const float *gamma,
                                  float *dx, float *dgamma, float *dbeta) {
    bie_batchnorm_backward(xhat, invstd, dy, n, c, inner, gamma, dx, dgamma, dbeta);
    return BIE_OK;
}
static int64_t cpu_conv2d_work_floats(const bie_conv_geom *g) { return bie_conv2d_work_floats(g); }
static bie_status cpu_conv2d_forward(const bie_conv_geom *g, const float *x, const float *w,
                                     const float *b, float *y, float *work) {
    bie_conv2d_forward(g, x, w, b, y, work);
    return BIE_OK;
}
static bie_status cpu_conv2d_backward(const bie_conv_geom *g, const float *x, const float *dy,
                                      const float *w, float *dx, float *dw, float *db,
                                      float *work) {
    bie_conv2d_backward(g, x, dy, w, dx, dw, db, work);
    return BIE_OK;
}
static bie_status cpu_avgpool_forward(const float *x, int64_t planes, int64_t h, int64_t w, int k,
                                      int s, int64_t oh, int64_t ow, float *y) {
    bie_avgpool_forward(x, planes, h, w, k, s, oh, ow, y);
    return BIE_OK;
}
static bie_status cpu_avgpool_backward(const float *dy, int64_t planes, int64_t h, int64_t w, int k,
                                       int s, int64_t oh, int64_t ow, float *dx) {
    bie_avgpool_backward(dy, planes, h, w, k, s, oh, ow, dx);
    return BIE_OK;
}
static bie_status cpu_global_avgpool_forward(const float *x, int64_t planes, int64_t inner,
                                             float *y) {
    bie_global_avgpool_forward(x, planes, inner, y);
    return BIE_OK;
}
static bie_status cpu_global_avgpool_backward(const float *dy, int64_t planes, int64_t inner,
                                              float *dx) {
    bie_global_avgpool_backward(dy, planes, inner, dx);
    return BIE_OK;
}
static bie_status cpu_add_forward(const float *a, const float *b, int64_t n, float *y) {
    bie_add_forward(a, b, n, y);
    return BIE_OK;
}
static bie_status cpu_accumulate(float *acc, const float *x, int64_t n) {
    bie_accumulate(acc, x, n);
    return BIE_OK;
}
static bie_status cpu_concat_copy(const float *x, int64_t outer, int64_t ci, int64_t inner,
                                  int64_t ctotal, int64_t offset, float *y) {
    bie_concat_copy(x, outer, ci, inner, ctotal, offset, y);
    return BIE_OK;
}
static bie_status cpu_concat_slice(const float *y, int64_t outer, int64_t ci, int64_t inner,
                                   int64_t ctotal, int64_t offset, float *x) {
    bie_concat_slice(y, outer, ci, inner, ctotal, offset, x);
    return BIE_OK;
}
static bie_status cpu_rprelu_forward(const float *x, int64_t outer, int64_t channels, int64_t inner,
                                     const float *shift_in, const float *slopes,
                                     const float *shift_out, float *y) {
    bie_rprelu_forward(x, outer, channels, inner, shift_in, slopes, shift_out, y);
    return BIE_OK;
}
static bie_status cpu_rprelu_backward(const float *x, const float *dy, int64_t outer,
                                      int64_t channels, int64_t inner, const float *shift_in,
                                      const float *slopes, float *dx, float *dshift_in,
                                      float *dslopes, float *dshift_out) {
    bie_rprelu_backward(x, dy, outer, channels, inner, shift_in, slopes, dx, dshift_in, dslopes,
                        dshift_out);
    return BIE_OK;
}
static void *cpu_alloc(size_t bytes) { return bie_alloc_aligned(bytes); }
static void cpu_release(void *p) { bie_free_aligned(p); }
static bie_status cpu_copy(void *dst, const void *src, size_t bytes) {
    if (bytes) memmove(dst, src, bytes);
    return BIE_OK;
}
static bie_status cpu_zero(void *p, size_t bytes) {
    if (bytes) memset(p, 0, bytes);
    return BIE_OK;
}

static const bie_train_ops kCpuOps = {
    cpu_linear_forward,
    cpu_linear_backward,
    cpu_relu_forward,
    cpu_relu_backward,
    cpu_prelu_forward,
    cpu_prelu_backward,
    cpu_maxpool_forward,
    cpu_maxpool_backward,
    cpu_bn_train,
    cpu_bn_running,
    cpu_bn_eval,
    cpu_bn_backward,
    cpu_conv2d_work_floats,
    cpu_conv2d_forward,
    cpu_conv2d_backward,
    cpu_avgpool_forward,
    cpu_avgpool_backward,
    cpu_global_avgpool_forward,
    cpu_global_avgpool_backward,
    cpu_add_forward,
    cpu_accumulate,
    cpu_concat_copy,
    cpu_concat_slice,
    cpu_rprelu_forward,
    cpu_rprelu_backward,
    cpu_alloc,
    cpu_release,
    cpu_copy,
    cpu_zero,
};

/* ---- CUDA: the kernels of src/cuda/train_kernels.cu */
#ifdef BIE_HAVE_CUDA
static void *cuda_alloc(size_t bytes) {
    void *p = NULL;
    if (bie_cuda_train_alloc(&p, bytes ? bytes : 1, "model buffer") != BIE_OK) return NULL;
    return p;
}
static void cuda_release(void *p) {
    if (p) bie_cuda_train_free(p);
}
static bie_status cuda_copy(void *dst, const void *src, size_t bytes) {
    return bytes ? bie_cuda_train_copy(dst, src, bytes) : BIE_OK;
}
static bie_status cuda_zero(void *p, size_t bytes) {
    return bytes ? bie_cuda_train_memset0(p, bytes) : BIE_OK;
}

static const bie_train_ops kCudaOps = {
    bie_cuda_linear_forward,
    bie_cuda_linear_backward,
    bie_cuda_relu_forward,
    bie_cuda_relu_backward,
    bie_cuda_prelu_forward,
    bie_cuda_prelu_backward,
    bie_cuda_maxpool_forward,
    bie_cuda_maxpool_backward,
    bie_cuda_batchnorm_forward_train,
    bie_cuda_batchnorm_update_running,
    bie_cuda_batchnorm_forward_eval,
    bie_cuda_batchnorm_backward,
    bie_cuda_conv2d_work_floats,
    bie_cuda_conv2d_forward,
    bie_cuda_conv2d_backward,
    bie_cuda_avgpool_forward,
    bie_cuda_avgpool_backward,
    bie_cuda_global_avgpool_forward,
    bie_cuda_global_avgpool_backward,
    bie_cuda_add_forward,
    bie_cuda_accumulate,
    bie_cuda_concat_copy,
    bie_cuda_concat_slice,
    bie_cuda_rprelu_forward,
    bie_cuda_rprelu_backward,
    cuda_alloc,
    cuda_release,
    cuda_copy,
    cuda_zero,
};
#endif

const bie_train_ops *bie_train_ops_for(bie_device device) {
    if (device.type == BIE_DEVICE_CPU) return &kCpuOps;
#ifdef BIE_HAVE_CUDA
    /* The model's buffers live on the current CUDA device: device 0 unless the caller
     * switched, which the layers (and their index check) do not expect either. */
    if (device.type == BIE_DEVICE_CUDA && device.index == 0 && bie_cuda_device_count() > 0)
        return &kCudaOps;
#endif
    return NULL;
}

bie_tensor bie_model_view(const bie_model *m, void *data, bie_dtype dtype, int ndim,
                          const int64_t *shape) {
    bie_tensor t;
    bie_tensor_view(&t, data, dtype, ndim, shape);
    t.device = m->device;
    return t;
}

bie_device bie_model_device(const bie_model *m) { return m ? m->device : bie_cpu(); }

/* Copy every parameter and buffer of `from` into `to`, whose layers are the same. */
static bie_status copy_state(bie_model *from, bie_model *to) {
    BIE_TRY(bie_model_refresh_params(from));
    for (int i = 0; i < from->param_count; i++) {
        bie_model_param p;
        BIE_TRY(bie_model_param_get(from, i, &p));
        BIE_TRY(bie_model_set_param(to, p.name, &p.value));
    }
    for (int i = 0; i < from->count; i++) to->layers[i].prepared = from->layers[i].prepared;
    return BIE_OK;
}

static void release_layers(bie_train_layer *layers, int count) {
    for (int i = 0; i < count; i++) bie_model_layer_release(&layers[i]);
    free(layers);
}

/* Sets `mode` on every binary linear layer; on failure the layers set so far go back to
 * the exact backward. */
static bie_status apply_backward_mode(bie_model *m, int mode) {
    for (int i = 0; i < m->count; i++) {
        bie_train_layer *l = &m->layers[i];
        if (l->info.type != BIE_LAYER_BINARY_LINEAR || l->lowbit == NULL) continue;
        bie_status st = bie_layer_set_backward_mode(l->lowbit, (bie_backward_mode)mode);
        if (st != BIE_OK) {
            for (int j = 0; j < i; j++)
                if (m->layers[j].info.type == BIE_LAYER_BINARY_LINEAR && m->layers[j].lowbit)
                    bie_layer_set_backward_mode(m->layers[j].lowbit, BIE_BACKWARD_EXACT);
            return st;
        }
    }
    return BIE_OK;
}

bie_status bie_model_set_backward_mode(bie_model *m, bie_backward_mode mode) {
    if (m == NULL) return bie_fail(BIE_ERR_NULL_POINTER, "model_set_backward_mode: model is NULL");
    if (mode != BIE_BACKWARD_EXACT && mode != BIE_BACKWARD_FP8)
        return bie_fail(BIE_ERR_INVALID_ARGUMENT, "model_set_backward_mode: unknown mode %d",
                        (int)mode);
    if (mode == BIE_BACKWARD_FP8 && m->device.type != BIE_DEVICE_CUDA)
        return bie_fail(BIE_ERR_UNSUPPORTED,
                        "model_set_backward_mode: the FP8 backward runs on CUDA devices with FP8 "
                        "tensor cores only (the model is on the CPU)");
    BIE_TRY(apply_backward_mode(m, (int)mode));
    m->backward_mode = (int)mode;
    return BIE_OK;
}

bie_status bie_model_to_device(bie_model *m, bie_device device) {
    static const char *who = "model_to_device";
    if (m == NULL) return bie_fail(BIE_ERR_NULL_POINTER, "%s: model is NULL", who);
    if (device.type == m->device.type && device.index == m->device.index) return BIE_OK;
    const bie_train_ops *ops = bie_train_ops_for(device);
    if (ops == NULL) {
        if (device.type != BIE_DEVICE_CUDA)
            return bie_fail(BIE_ERR_DEVICE, "%s: unknown device type %d", who, (int)device.type);
        if (!bie_cuda_built())
            return bie_fail(BIE_ERR_DEVICE, "%s: this build of bie has no CUDA backend", who);
        if (bie_cuda_device_count() == 0)
            return bie_fail(BIE_ERR_DEVICE, "%s: no CUDA device is available", who);
        return bie_fail(BIE_ERR_DEVICE, "%s: a model runs on CUDA device 0 only (asked for %d)",
                        who, device.index);
    }
    /* The new layers are built and filled beside the old ones: a failure leaves the model
     * where and as it was. */
    bie_train_layer *layers = calloc((size_t)(m->capacity > 0 ? m->capacity : 1), sizeof *layers);
    if (layers == NULL) return bie_fail(BIE_ERR_OUT_OF_MEMORY, "%s: layer list", who);
    bie_model moved;
    memset(&moved, 0, sizeof moved);
    moved.layers = layers;
    moved.capacity = m->capacity;
    moved.device = device;
    moved.ops = ops;
    moved.training = m->training;
    moved.backward_mode = m->backward_mode;
    moved.generation = 1;
    bie_status st = BIE_OK;
    for (int i = 0; i < m->count && st == BIE_OK; i++) {
        st = bie_model_build_layer(&m->layers[i].info, device, &layers[i], who);
        if (st != BIE_OK) break;
        moved.count = i + 1;
        bie_train_layer *l = &layers[i];
        l->n_inputs = m->layers[i].n_inputs;
        memcpy(l->inputs, m->layers[i].inputs, sizeof l->inputs);
        if (l->lowbit) st = bie_layer_set_training(l->lowbit, m->training);
    }
    /* A packed model's new layers are packed first, so that they have qweight to load. */
    if (st == BIE_OK && m->packed) st = bie_model_pack(&moved);
    if (st == BIE_OK) st = copy_state(m, &moved);
    /* The model's backward mode where the device runs it (else the exact one, see
     * bie_model_set_backward_mode). */
    if (st == BIE_OK && m->backward_mode != BIE_BACKWARD_EXACT)
        (void)apply_backward_mode(&moved, m->backward_mode);
    free(moved.params);
    if (st != BIE_OK) {
        release_layers(layers, moved.count);
        return st;
    }
    release_layers(m->layers, m->count);
    for (int i = 0; m->acts && i <= m->count; i++) {
        m->ops->release(m->acts[i]);
        m->ops->release(m->grads[i]);
        m->acts[i] = m->grads[i] = NULL;
        m->act_cap[i] = m->grad_cap[i] = 0;
    }
    m->ops->release(m->scratch);
    m->scratch = NULL;
    m->scratch_cap = 0;
    m->layers = layers;
    m->device = device;
    m->ops = ops;
    m->generation++;
    m->can_backward = false;
    m->qweight_stale = true;
    return BIE_OK;
}
