/* The training library's internals: the model's layer record, the float layers' kernels
 * (forward / backward on raw arrays) and helpers shared by src/train/. Not installed. */
#ifndef BIE_TRAIN_INTERNAL_H
#define BIE_TRAIN_INTERNAL_H

#include "../core/formats.h"
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

    /* RPReLU: shift_in [C] and its gradient (weight = slopes, bias = shift_out). */
    float *shift_in, *grad_shift_in;
    /* conv2d: scratch of ops->conv2d_work_floats floats, grown on demand */
    float *work;
    int64_t work_cap;

    /* The node's inputs: BIE_MODEL_INPUT or earlier node indices. */
    int n_inputs;
    int inputs[BIE_MODEL_MAX_INPUTS];

    bie_layer *lowbit; /* the bie.h layer of a low-bit type, else NULL */
    bool prepared;     /* prepare_params ran (or a prepared weight / scale_w was loaded) */

    /* Saved by a training forward for the backward: batch norm's normalised input and
     * 1/std per channel; max-pool's argmax per output (index within the input plane). */
    float *saved_xhat;
    float *saved_invstd, *batch_mean, *batch_var; /* [C] each, allocated with the layer */
    int32_t *saved_argmax;
    int64_t saved_cap; /* elements allocated in saved_xhat / saved_argmax */

    /* Shapes of the last forward (in_*: the first input's). */
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
    int backward_mode; /* bie_backward_mode of the binary linear layers */
    /* Grows whenever the set of parameters or their storage changes (add, reset, prepare,
     * pack): optimizers and cached parameter lists compare it. */
    uint64_t generation;
    /* Grows with every successful backward; an optimizer steps once per backward. */
    uint64_t backward_count;
    bool can_backward;  /* a training forward was done since the last change */
    bool qweight_stale; /* low-bit weights changed since their eval qweight was made */

    /* acts[0] is a copy of the last input, acts[i + 1] the output of layer i; grads[i + 1]
     * receives d loss / d acts[i + 1] in backward (grads[0]: the input's), scratch holds an
     * input gradient that is added to one already there. */
    float **acts, **grads;
    int64_t *act_cap, *grad_cap;
    float *scratch;
    int64_t scratch_cap;
    /* Shape of the last forward's input. */
    int x_ndim;
    int64_t x_shape[BIE_MAX_DIMS];
    /* Declared shape of one input sample (bie_model_set_input_shape); ndim 0 = none. */
    int sample_ndim;
    int64_t sample_shape[BIE_MAX_DIMS];

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

/* --- the graph's float layers (float_conv.c, graph_layers.c); NCHW arrays, contiguous. */

/* Float conv2d: x [g->n, g->c, g->h, g->w], weight [g->o, g->c, g->k, g->k], bias [g->o]
 * (NULL: none), y [g->n, g->o, g->oh, g->ow]; stride g->s, zero padding g->p, dilation g->d.
 * `work` holds bie_conv2d_work_floats(g) floats of scratch memory of the same device. */
int64_t bie_conv2d_work_floats(const bie_conv_geom *g);
void bie_conv2d_forward(const bie_conv_geom *g, const float *x, const float *w, const float *b,
                        float *y, float *work);
/* dx (may be NULL) = d L / d x; dw = d L / d w (overwritten); db (may be NULL) = per-channel
 * sums of dy (overwritten). */
void bie_conv2d_backward(const bie_conv_geom *g, const float *x, const float *dy, const float *w,
                         float *dx, float *dw, float *db, float *work);
/* Average pool of `planes` planes h x w, square window k, stride s, no padding, output
 * oh x ow (floor). The backward spreads dy / (k k) over each window (overwrites dx). */
void bie_avgpool_forward(const float *x, int64_t planes, int64_t h, int64_t w, int k, int s,
                         int64_t oh, int64_t ow, float *y);
void bie_avgpool_backward(const float *dy, int64_t planes, int64_t h, int64_t w, int k, int s,
                          int64_t oh, int64_t ow, float *dx);
/* Global average pool: y[p] = mean of x[p, 0..inner); backward dx[p, i] = dy[p] / inner. */
void bie_global_avgpool_forward(const float *x, int64_t planes, int64_t inner, float *y);
void bie_global_avgpool_backward(const float *dy, int64_t planes, int64_t inner, float *dx);
/* y = a + b (y may alias a or b); acc += x (sums of gradients where a tensor feeds several
 * nodes). */
void bie_add_forward(const float *a, const float *b, int64_t n, float *y);
void bie_accumulate(float *acc, const float *x, int64_t n);
/* Channel concat: x [outer, ci, inner] is channels [offset, offset + ci) of
 * y [outer, ctotal, inner]; slice is the inverse (the backward of one input). */
void bie_concat_copy(const float *x, int64_t outer, int64_t ci, int64_t inner, int64_t ctotal,
                     int64_t offset, float *y);
void bie_concat_slice(const float *y, int64_t outer, int64_t ci, int64_t inner, int64_t ctotal,
                      int64_t offset, float *x);
/* RPReLU per channel c of [outer, channels, inner]: t = x + shift_in[c];
 * y = (t >= 0 ? t : slope[c] t) + shift_out[c]. Backward: dx (may be NULL), and the three
 * parameter gradients (overwritten), sums per channel: d slope = sum over
 * t < 0 of dy t, d shift_out = sum dy (d shift_in = sum of d L / d x, also computed when
 * dx is NULL). */
void bie_rprelu_forward(const float *x, int64_t outer, int64_t channels, int64_t inner,
                        const float *shift_in, const float *slopes, const float *shift_out,
                        float *y);
void bie_rprelu_backward(const float *x, const float *dy, int64_t outer, int64_t channels,
                         int64_t inner, const float *shift_in, const float *slopes, float *dx,
                         float *dshift_in, float *dslopes, float *dshift_out);

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
    int64_t (*conv2d_work_floats)(const bie_conv_geom *g);
    bie_status (*conv2d_forward)(const bie_conv_geom *g, const float *x, const float *w,
                                 const float *b, float *y, float *work);
    bie_status (*conv2d_backward)(const bie_conv_geom *g, const float *x, const float *dy,
                                  const float *w, float *dx, float *dw, float *db, float *work);
    bie_status (*avgpool_forward)(const float *x, int64_t planes, int64_t h, int64_t w, int k,
                                  int s, int64_t oh, int64_t ow, float *y);
    bie_status (*avgpool_backward)(const float *dy, int64_t planes, int64_t h, int64_t w, int k,
                                   int s, int64_t oh, int64_t ow, float *dx);
    bie_status (*global_avgpool_forward)(const float *x, int64_t planes, int64_t inner, float *y);
    bie_status (*global_avgpool_backward)(const float *dy, int64_t planes, int64_t inner,
                                          float *dx);
    bie_status (*add_forward)(const float *a, const float *b, int64_t n, float *y);
    bie_status (*accumulate)(float *acc, const float *x, int64_t n);
    bie_status (*concat_copy)(const float *x, int64_t outer, int64_t ci, int64_t inner,
                              int64_t ctotal, int64_t offset, float *y);
    bie_status (*concat_slice)(const float *y, int64_t outer, int64_t ci, int64_t inner,
                               int64_t ctotal, int64_t offset, float *x);
    bie_status (*rprelu_forward)(const float *x, int64_t outer, int64_t channels, int64_t inner,
                                 const float *shift_in, const float *slopes, const float *shift_out,
                                 float *y);
    bie_status (*rprelu_backward)(const float *x, const float *dy, int64_t outer, int64_t channels,
                                  int64_t inner, const float *shift_in, const float *slopes,
                                  float *dx, float *dshift_in, float *dslopes, float *dshift_out);
    /* Memory: alloc returns NULL when out of memory; copy (between this device and the host,
     * or within either; done, as far as the host can see, when it returns: a device's copies
     * into its own memory are ordered like its kernels) and zero return a status. */
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

/* Output shape of layer `index` for the shapes of its inputs (ndims[j], shapes[j] for input
 * j of the node); errors name the layer. */
bie_status bie_model_layer_out_shape(const bie_model *m, int index, const int *ndims,
                                     const int64_t (*shapes)[BIE_MAX_DIMS], int *out_ndim,
                                     int64_t *out_shape);
/* Shapes of every node's output for an input of `in_ndim` extents `in_shape`: ndims / shapes
 * have m->count + 1 rows (row 0 the input, row i + 1 node i's output). Errors name the first
 * node that refuses its inputs; `who` prefixes them. */
bie_status bie_model_plan_shapes(const bie_model *m, int in_ndim, const int64_t *in_shape,
                                 int *ndims, int64_t (*shapes)[BIE_MAX_DIMS], const char *who);
/* Check node inputs and arity for `type` (n_inputs, inputs against node count `count`). */
bie_status bie_model_check_inputs(const bie_model *m, bie_layer_type type, int n_inputs,
                                  const int *inputs, const char *who);
/* Append node `info` (canonical) reading `inputs`, checking shapes against the declared input
 * shape; model.c. */
bie_status bie_model_append(bie_model *m, const bie_layer_info *info, int n_inputs,
                            const int *inputs, const char *who);
/* The canonical form of info (checked hyper-parameters; fields that don't apply zeroed). */
bie_status bie_model_canonical_info(const bie_layer_info *in, bie_layer_info *out, const char *who);
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
