/* The training library's internals: the model's layer record, the float layers' kernels
 * (forward / backward on raw arrays) and helpers shared by src/train/. Not installed. */
#ifndef BIE_TRAIN_INTERNAL_H
#define BIE_TRAIN_INTERNAL_H

#include "../core/internal.h"
#include "bie_train.h"

/* Loops over fewer elements run on one thread: a parallel region costs more than the work.
 * Every loop gives the same result either way (sums run in a fixed order). */
#define BIE_TRAIN_PARALLEL_MIN 32768

/* Tensor checks shared by the public entry points. */
bie_status bie_train_check_f32(const bie_tensor *t, const char *what, const char *who);
bool bie_train_same_shape(const bie_tensor *a, const bie_tensor *b);

/* Deterministic uniform numbers in [-bound, bound) from a splitmix64 stream. */
uint64_t bie_train_splitmix64(uint64_t *state);
void bie_train_fill_uniform(float *dst, int64_t n, double bound, uint64_t *state);

/* What differs between layer types, in one table (model.c). */
typedef struct bie_layer_type_traits {
    const char *name;      /* bie_layer_type_name */
    bool low_bit;          /* a bie.h layer (bie_train_layer.lowbit) */
    bool conv;             /* kernel_size, stride, padding, dilation of a conv2d */
    bie_param_kind weight; /* the kind of its "weight" (BINARY: symmetric, word size) */
    /* low-bit types: make the bie.h layer that `info` describes on `device` (F32) */
    bie_status (*create)(const bie_layer_info *info, bie_device device, bie_layer **out);
} bie_layer_type_traits;

/* The row of `type`; NULL for an unknown type. */
const bie_layer_type_traits *bie_layer_type_traits_of(bie_layer_type type);

/* One layer of a model. Float parameters live here; low-bit layers are bie.h objects. */
typedef struct bie_train_layer {
    bie_layer_info info;
    bie_device device; /* where its buffers live (the model's device) */

    /* Float parameters (NULL when the type has none): linear weight [out, in] / bias [out];
     * batch norm weight (gamma) / bias (beta) [C]; PReLU slopes in `weight`. */
    float *weight, *bias;
    float *grad_weight, *grad_bias;
    float *running_mean, *running_var;
    bool has_grad; /* the gradients above come from a backward */

    bie_layer *lowbit; /* the bie.h layer of a low-bit type, else NULL */
    bool prepared;     /* prepare_params ran (or a prepared weight / scale_w was loaded) */

    /* Saved by a training forward for the backward: batch norm's normalised input and
     * 1/std per channel; max-pool's argmax per output (index within the input plane). */
    float *saved_xhat;
    float *saved_invstd, *batch_mean, *batch_var; /* [C] each, allocated with the layer */
    int32_t *saved_argmax;
    int64_t saved_cap; /* elements allocated in saved_xhat / saved_argmax */

    /* Shapes of the last forward. */
    int in_ndim, out_ndim;
    int64_t in_shape[BIE_MAX_DIMS], out_shape[BIE_MAX_DIMS];
} bie_train_layer;

/* A named parameter of the model's current state (see bie_model_param). */
typedef struct bie_param_entry {
    char name[32];
    int layer;
    bie_param_kind kind;
    int which; /* bie_param for low-bit layers, else a float-layer slot (train_params.c) */
} bie_param_entry;

struct bie_model {
    bie_train_layer *layers;
    int count, capacity;
    bie_device device;               /* every buffer below and every layer lives there */
    const struct bie_train_ops *ops; /* the float kernels and memory of that device */
    bool training, packed;
    /* Grows whenever the set of parameters or their storage changes (add, reset, prepare,
     * pack): optimizers and cached parameter lists compare it. */
    uint64_t generation;
    /* Grows with every successful backward; an optimizer steps once per backward. */
    uint64_t backward_count;
    bool can_backward;  /* a training forward was done since the last change */
    bool qweight_stale; /* low-bit weights changed since their eval qweight was made */

    /* acts[0] is a copy of the last input, acts[i + 1] the output of layer i. */
    float **acts;
    int64_t *act_cap;
    float *grad_buf[2];
    int64_t grad_cap;

    bie_param_entry *params;
    int param_count;
    uint64_t params_generation; /* generation the list was built for; 0 = never */
};

/* --- float layer kernels (float_layers.c, batchnorm.c): x, y, dy, dx are contiguous. */

/* y[m, out] = x[m, in] w^T + b (b may be NULL). */
void bie_linear_forward(const float *x, int64_t m, int64_t in, int64_t out, const float *w,
                        const float *b, float *y);
/* dx (may be NULL) = dy w; dw = dy^T x; db (may be NULL) = column sums of dy. */
void bie_linear_backward(const float *x, const float *dy, int64_t m, int64_t in, int64_t out,
                         const float *w, float *dx, float *dw, float *db);
void bie_relu_forward(const float *x, int64_t n, float *y);
void bie_relu_backward(const float *y, const float *dy, int64_t n, float *dx);
/* Input viewed as [outer, channels, inner]; `slopes` has `channels` entries, or 1 (shared). */
void bie_prelu_forward(const float *x, int64_t outer, int64_t channels, int64_t inner,
                       const float *slopes, int64_t n_slopes, float *y);
void bie_prelu_backward(const float *x, const float *dy, int64_t outer, int64_t channels,
                        int64_t inner, const float *slopes, int64_t n_slopes, float *dx,
                        float *dslopes);
/* planes = N * C planes of h x w; output oh x ow; argmax may be NULL (evaluation). */
void bie_maxpool_forward(const float *x, int64_t planes, int64_t h, int64_t w, int k, int s,
                         int64_t oh, int64_t ow, float *y, int32_t *argmax);
void bie_maxpool_backward(const float *dy, const int32_t *argmax, int64_t planes, int64_t h,
                          int64_t w, int64_t oh, int64_t ow, float *dx);
/* Batch norm on [n, c, inner]. Training: normalises with the batch statistics, saves xhat
 * and invstd for the backward and returns the batch mean and unbiased variance, which
 * bie_batchnorm_update_running folds into the running statistics once the whole forward
 * succeeded. Evaluation: running statistics. */
void bie_batchnorm_forward_train(const float *x, int64_t n, int64_t c, int64_t inner,
                                 const float *gamma, const float *beta, float eps, float *y,
                                 float *xhat, float *invstd, float *batch_mean, float *batch_var);
void bie_batchnorm_update_running(int64_t c, float momentum, const float *batch_mean,
                                  const float *batch_var, float *running_mean, float *running_var);
void bie_batchnorm_forward_eval(const float *x, int64_t n, int64_t c, int64_t inner,
                                const float *gamma, const float *beta, float eps,
                                const float *running_mean, const float *running_var, float *y);
void bie_batchnorm_backward(const float *xhat, const float *invstd, const float *dy, int64_t n,
                            int64_t c, int64_t inner, const float *gamma, float *dx, float *dgamma,
                            float *dbeta);

/* --- one device's float kernels and memory (model_device.c): the model's layers are
 * written once against this table. Kernels take pointers to that device's memory and
 * have the arguments of the CPU kernels above; on CUDA they are asynchronous on bie's
 * stream. */
typedef struct bie_train_ops {
    bie_status (*linear_forward)(const float *x, int64_t m, int64_t in, int64_t out, const float *w,
                                 const float *b, float *y);
    bie_status (*linear_backward)(const float *x, const float *dy, int64_t m, int64_t in,
                                  int64_t out, const float *w, float *dx, float *dw, float *db);
    bie_status (*relu_forward)(const float *x, int64_t n, float *y);
    bie_status (*relu_backward)(const float *y, const float *dy, int64_t n, float *dx);
    bie_status (*prelu_forward)(const float *x, int64_t outer, int64_t channels, int64_t inner,
                                const float *slopes, int64_t n_slopes, float *y);
    bie_status (*prelu_backward)(const float *x, const float *dy, int64_t outer, int64_t channels,
                                 int64_t inner, const float *slopes, int64_t n_slopes, float *dx,
                                 float *dslopes);
    bie_status (*maxpool_forward)(const float *x, int64_t planes, int64_t h, int64_t w, int k,
                                  int s, int64_t oh, int64_t ow, float *y, int32_t *argmax);
    bie_status (*maxpool_backward)(const float *dy, const int32_t *argmax, int64_t planes,
                                   int64_t h, int64_t w, int64_t oh, int64_t ow, float *dx);
    bie_status (*batchnorm_forward_train)(const float *x, int64_t n, int64_t c, int64_t inner,
                                          const float *gamma, const float *beta, float eps,
                                          float *y, float *xhat, float *invstd, float *batch_mean,
                                          float *batch_var);
    bie_status (*batchnorm_update_running)(int64_t c, float momentum, const float *batch_mean,
                                           const float *batch_var, float *running_mean,
                                           float *running_var);
    bie_status (*batchnorm_forward_eval)(const float *x, int64_t n, int64_t c, int64_t inner,
                                         const float *gamma, const float *beta, float eps,
                                         const float *running_mean, const float *running_var,
                                         float *y);
    bie_status (*batchnorm_backward)(const float *xhat, const float *invstd, const float *dy,
                                     int64_t n, int64_t c, int64_t inner, const float *gamma,
                                     float *dx, float *dgamma, float *dbeta);
    /* Memory: alloc returns NULL when out of memory; copy (between this device and the host,
     * or within either, and waits) and zero return a status. */
    void *(*alloc)(size_t bytes);
    void (*release)(void *p);
    bie_status (*copy)(void *dst, const void *src, size_t bytes);
    bie_status (*zero)(void *p, size_t bytes);
} bie_train_ops;

/* The table of a device type; NULL where this build or machine has none. */
const bie_train_ops *bie_train_ops_for(bie_device device);
/* A view of the model's device memory (a CPU view for a CPU model). */
bie_tensor bie_model_view(const bie_model *m, void *data, bie_dtype dtype, int ndim,
                          const int64_t *shape);

/* --- model internals shared between model files */

/* Output shape of layer `index` for an input shape; errors name the layer. */
bie_status bie_model_layer_out_shape(const bie_model *m, int index, int ndim, const int64_t *shape,
                                     int *out_ndim, int64_t *out_shape);
/* Rebuild the parameter list if the generation changed. */
bie_status bie_model_refresh_params(bie_model *m);
/* Initialise layer `index` from `seed` (reset_parameters of one layer). */
bie_status bie_model_layer_reset(bie_model *m, int index, uint64_t seed);
/* Free what a layer owns. */
void bie_model_layer_release(bie_train_layer *layer);
/* Build the storage and the low-bit object of a layer on `device` (nothing initialised). */
bie_status bie_model_build_layer(const bie_layer_info *info, bie_device device, bie_train_layer *l,
                                 const char *who);

#endif
